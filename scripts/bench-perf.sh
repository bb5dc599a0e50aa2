#!/usr/bin/env bash
# The foundation benchmark of docs/benchmarks.md: target on core 0 (one network thread),
# `nearstore perf` on core 1, loopback. Memory backend, then the file backend (page cache).
# Usage: scripts/bench-perf.sh [seconds-per-run]   (default 10)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
cargo build --release --locked -p nearstore >/dev/null 2>&1
bin=./target/release/nearstore
work=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
run_target() {
    RUST_LOG=warn taskset -c 0 $bin target --listen 127.0.0.1:44200 --discovery none --net-threads 1 "$@" > "$work/t.out" 2>&1 &
    pid=$!
    for _ in $(seq 50); do grep -q listening "$work/t.out" && return; sleep 0.1; done
    cat "$work/t.out"; exit 1
}
perf() { taskset -c 1 $bin perf -a 127.0.0.1:44200 -T "$secs" "$@"; }
echo "# $(date -u +%F) $(nproc) cores, $(uname -r), ${secs} s per run"
echo "## memory backend"
run_target --memory 1GiB --block-size 512
perf -w randwrite -z 4KiB -q 32 >/dev/null   # touch the pages once
perf -w randread -z 4KiB -q 1
perf -w randread -z 4KiB -q 32
perf -w randread -z 4KiB -q 128
perf -w read -z 128KiB -q 32
perf -w randwrite -z 4KiB -q 32
kill $pid; wait $pid 2>/dev/null || true; pid=
for engine in uring threads; do
    echo "## file backend, --io-engine $engine (sparse file, page cache)"
    rm -f "$work/disk.img"
    run_target --namespace "$work/disk.img" --size 1GiB --io-engine $engine --io-threads 2
    taskset -c 1 $bin perf -a 127.0.0.1:44200 -T 3 -w write -z 128KiB -q 32 >/dev/null   # fill it once
    perf -w randread -z 4KiB -q 1
    perf -w randread -z 4KiB -q 32
    perf -w read -z 128KiB -q 32
    perf -w randwrite -z 4KiB -q 32
    kill $pid; wait $pid 2>/dev/null || true; pid=
done
