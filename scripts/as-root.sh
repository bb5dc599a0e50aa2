# Sourced first by demo.sh and test.sh: they need root (loop devices, mounts, network
# namespaces, apt-get). As root they go on; otherwise they run themselves again with sudo,
# keeping the caller's Rust toolchain (PATH, CARGO_HOME, RUSTUP_HOME).
if [ "$(id -u)" != 0 ]; then
    if ! command -v sudo >/dev/null; then
        echo "$0 needs root (loop devices, mounts, network namespaces): run it as root, or install sudo" >&2
        exit 1
    fi
    exec sudo env PATH="$PATH" CARGO_HOME="${CARGO_HOME:-$HOME/.cargo}" RUSTUP_HOME="${RUSTUP_HOME:-$HOME/.rustup}" bash "$0" "$@"
fi
