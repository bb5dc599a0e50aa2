#!/usr/bin/env bash
# Two builds of the target side by side, in one run: the before/after comparison of
# docs/benchmarks.md. Each round starts a fresh target per workload and build, alternating
# A B A B, with the target on core 0 (one network thread, memory backend, 4 KiB blocks)
# and `nearstore perf` (of build A, the same client for both) on core 1; then medians and
# the ratio B/A per workload.
# Usage: scripts/bench-ab.sh BIN_A BIN_B [rounds] [seconds-per-run]   (default 3 rounds, 5 s)
# Example: cp target/release/nearstore /tmp/before; (change, build); \
#          scripts/bench-ab.sh /tmp/before target/release/nearstore
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,9p' "$0"; exit 2; }
a=$1 b=$2 rounds=${3:-3} secs=${4:-5}
for bin in "$a" "$b"; do [ -x "$bin" ] || { echo "not an executable: $bin" >&2; exit 2; }; done
work=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
port=44201
# WORKLOADS="randread 4KiB 128;read 128KiB 32" runs only those (pattern, size, queue depth).
IFS=';' read -ra workloads <<< "${WORKLOADS:-randread 4KiB 1;randread 4KiB 32;randread 4KiB 128;read 128KiB 32;randwrite 4KiB 32}"

run() { # bin workload size qd -> "iops mb_per_s"
    local bin=$1 w=$2 z=$3 q=$4
    taskset -c 0 "$bin" target --listen 127.0.0.1:$port --discovery none --net-threads 1 \
        --memory 1GiB --block-size 4096 --log-level warn > "$work/t.out" 2>&1 &
    pid=$!
    for _ in $(seq 50); do grep -q listening "$work/t.out" && break; sleep 0.1; done
    grep -q listening "$work/t.out" || { cat "$work/t.out" >&2; exit 1; }
    # Touch the namespace's pages once, so that reads do not find them unmapped.
    taskset -c 1 "$a" perf -a 127.0.0.1:$port -T 1 -w randwrite -z 4KiB -q 32 --quiet -o json > /dev/null
    taskset -c 1 "$a" perf -a 127.0.0.1:$port -T "$secs" -w "$w" -z "$z" -q "$q" --quiet -o json |
        python3 -c 'import json,sys; j=json.load(sys.stdin); print(round(j["iops"]), round(j["mb_per_s"]))'
    kill $pid; wait $pid 2>/dev/null || true; pid=
}

echo "# $(date -u '+%F %H:%M') UTC, $(nproc) cores, $(uname -r), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# A = $a"
echo "# B = $b"
echo "# $rounds rounds of ${secs} s per run"
for r in $(seq "$rounds"); do
    for wl in "${workloads[@]}"; do
        read -r w z q <<< "$wl"
        for side in A B; do
            bin=$a; [ $side = B ] && bin=$b
            echo "$r $side $w $z $q $(run "$bin" "$w" "$z" "$q")" | tee -a "$work/runs"
        done
    done
done
echo "# workload size qd: median IOPS A, B, ratio B/A (MB/s A, B)"
python3 - "$work/runs" <<'EOF'
import sys, statistics
runs = {}
for line in open(sys.argv[1]):
    r, side, w, z, q, iops, mbs = line.split()
    runs.setdefault((w, z, q), {}).setdefault(side, []).append((int(iops), int(mbs)))
for (w, z, q), s in runs.items():
    ia, ib = statistics.median(x[0] for x in s["A"]), statistics.median(x[0] for x in s["B"])
    ma, mb = statistics.median(x[1] for x in s["A"]), statistics.median(x[1] for x in s["B"])
    print(f"{w} {z} QD{q}: {ia:.0f} {ib:.0f} {ib / ia:.2f}x ({ma:.0f} {mb:.0f} MB/s)")
EOF
