# Sourced by demo.sh and test.sh: installs what they need on a fresh Debian machine (as
# root: e2fsprogs, mount, iproute2 for the testbed, a C compiler and binutils, curl) and Rust
# (rustup) when cargo is missing.
if [ "$(id -u)" = 0 ]; then
    need=()
    command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
    command -v losetup >/dev/null || need+=(mount)
    command -v ip >/dev/null && command -v tc >/dev/null || need+=(iproute2)
    command -v cc >/dev/null || need+=(gcc)
    command -v strip >/dev/null || need+=(binutils)
    command -v curl >/dev/null || need+=(curl ca-certificates)
    if [ ${#need[@]} -gt 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    fi
fi
if ! command -v cargo >/dev/null; then
    [ -x "$HOME/.cargo/bin/cargo" ] || curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal >/dev/null
    export PATH="$HOME/.cargo/bin:$PATH"
fi
