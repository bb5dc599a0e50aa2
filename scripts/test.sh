#!/usr/bin/env bash
# The whole test suite: unit, integration and fuzz (bounded) tests of the workspace, then
# the Linux kernel initiator in qemu. Installs what it needs (Debian packages) when root.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ]; then
    need=()
    command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
    command -v losetup >/dev/null || need+=(mount)
    command -v cc >/dev/null || need+=(gcc)
    command -v curl >/dev/null || need+=(curl ca-certificates)
    if [ ${#need[@]} -gt 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    fi
fi
if ! command -v cargo >/dev/null; then
    [ -x "$HOME/.cargo/bin/cargo" ] || curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal >/dev/null
    export PATH="$HOME/.cargo/bin:$PATH"
fi
export PROPTEST_CASES=${PROPTEST_CASES:-20000}
cargo build --release --locked -p nearstore
cargo test --workspace --locked 2>&1 | tee /tmp/nearstore-cargo-test.log
bash tests/kernel/run.sh target/release/nearstore
