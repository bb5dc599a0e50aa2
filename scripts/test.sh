#!/usr/bin/env bash
# The whole test suite: unit, integration and fuzz (bounded) tests of the workspace, then
# the Linux kernel initiator in qemu (on a namespace, on a volume over three targets, its reservations, and its DH-HMAC-CHAP on Debian trixie's kernel), then 20 power cuts of the target in qemu, then every
# command block of README.md as printed (tests/readme/run.sh). Installs what it needs (Debian
# packages, without their recommendations). Needs root (loop devices, mounts, network
# namespaces): run as another user, it runs itself again with sudo.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/as-root.sh
. scripts/prereqs.sh
export PROPTEST_CASES=${PROPTEST_CASES:-20000}
cargo build --release --locked -p nearstore -p nearstore-lab -p nearstore-powercut
cargo test --workspace --locked 2>&1 | tee /tmp/nearstore-cargo-test.log
bash tests/kernel/run.sh target/release/nearstore
bash tests/kernel/volume.sh target/release/nearstore
bash tests/kernel/resv.sh target/release/nearstore
bash tests/kernel/auth.sh target/release/nearstore
bash tests/kernel/powercut.sh --cuts 20
bash tests/readme/run.sh
