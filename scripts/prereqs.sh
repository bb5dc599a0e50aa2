# Sourced by demo.sh and test.sh: installs what they need on a fresh Debian machine (as
# root, Debian packages without their recommendations, upgrading nothing already installed)
# and Rust (rustup) when cargo is missing. README.md lists the packages and why.
if [ "$(id -u)" = 0 ]; then
    need=()
    why=()
    want() { need+=("$1"); why+=("$1 ($2)"); }
    command -v mkfs.ext4 >/dev/null || want e2fsprogs "mkfs.ext4: the file systems on exported images"
    command -v losetup >/dev/null || want mount "losetup, mount: loop devices over the images"
    command -v ip >/dev/null && command -v tc >/dev/null || want iproute2 "ip, tc: the testbed's network namespaces and links"
    command -v cc >/dev/null || want gcc "a C compiler and linker for cargo"
    command -v strip >/dev/null || want binutils "strip: nearstore without debug information in the kernel test's guest"
    command -v curl >/dev/null || want curl "rustup's installer, when cargo is missing"
    [ -e /etc/ssl/certs/ca-certificates.crt ] || want ca-certificates "curl's TLS certificates"
    command -v systemd-analyze >/dev/null || want systemd "systemd-analyze: the test of dist/'s unit"
    command -v protoc >/dev/null || want protobuf-compiler "protoc: the etcd client's gRPC code is generated at build time"
    command -v etcd >/dev/null || want etcd-server "etcd: the control plane's tests on a three-member etcd"
    command -v setpriv >/dev/null || want util-linux "setpriv: the FUSE mount's tests as an unprivileged user"
    command -v python3 >/dev/null || want python3 "python3: docs/fuse.md's Python example, run by a test"
    command -v zstd >/dev/null || want zstd "zstd: docs/fuse.md's shell example decompresses a transform's output"
    command -v mksquashfs >/dev/null || want squashfs-tools "mksquashfs: the FUSE mount's test of a source file system without FIEMAP"
    # The FUSE mount's tests mount for real (no package: the kernel's fuse module).
    [ -e /dev/fuse ] || modprobe fuse 2>/dev/null || echo "no /dev/fuse: the FUSE mount's tests will fail (load the fuse module)" >&2
    if [ ${#need[@]} -gt 0 ]; then
        echo "installing Debian packages: ${why[*]}" >&2
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends --no-upgrade "${need[@]}" >/dev/null
    fi
fi
if ! command -v cargo >/dev/null; then
    if [ ! -x "$HOME/.cargo/bin/cargo" ]; then
        echo "installing Rust with rustup (minimal profile) into $HOME/.cargo" >&2
        curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal >/dev/null
    fi
    export PATH="$HOME/.cargo/bin:$PATH"
fi
