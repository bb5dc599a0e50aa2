#!/usr/bin/env bash
# The main job: a target exporting a sparse file, data written and read back through our
# NVMe/TCP initiator, then a short perf. Builds what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "cargo not found: install Rust (rustup) first" >&2; exit 1; }
cargo build --release --locked -p nearstore
exec ./target/release/nearstore demo "$@"
