#!/usr/bin/env bash
# The main job: a real ext4 file system on a loop device whose image a nearstore target
# exports over NVMe/TCP, a sample data set (logs and CSV) written through the file system,
# and checksum, grep and wc run offloaded, pulled over NVMe/TCP and locally, with a table
# of time, bytes over the network and whether the results agree. Installs what it needs;
# needs root (loop device, mount).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then echo "the demo makes a loop device and mounts it: run it as root" >&2; exit 1; fi
need=()
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
command -v losetup >/dev/null || need+=(mount)
command -v cc >/dev/null || need+=(gcc)
command -v curl >/dev/null || need+=(curl ca-certificates)
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null; then
    [ -x "$HOME/.cargo/bin/cargo" ] || curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal >/dev/null
    export PATH="$HOME/.cargo/bin:$PATH"
fi
cargo build --release --locked -p nearstore
exec ./target/release/nearstore demo "$@"
