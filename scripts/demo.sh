#!/usr/bin/env bash
# The main job: a real ext4 file system on a loop device whose image a nearstore target
# exports over NVMe/TCP, a sample data set (logs and CSV) written through the file system,
# and checksum, grep and wc run offloaded, pulled over NVMe/TCP and locally, with a table
# of time, bytes over the network and whether the results agree. Installs what it needs.
# Needs root (loop device, mount): run as another user, it runs itself again with sudo.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/as-root.sh
. scripts/prereqs.sh
cargo build --release --locked -p nearstore-lab
exec ./target/release/nearstore-lab demo "$@"
