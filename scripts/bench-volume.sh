#!/usr/bin/env bash
# Seed 002's latency table on an exported volume: 4 KiB random reads at queue depth 1, in one
# run, on (a) the volume with no mapping cache (every I/O translated by the control plane),
# (b) the volume with a cache of one extent (almost every I/O a miss: 1 GiB in 1 MiB
# extents), (c) the volume with every extent cached (warmed by one pass first), and (d) the
# same pool file exported as a plain namespace. p50/p90/p99/p99.9 and average, in us.
# Then the throughput curve of (c) and (d): 4 KiB random reads at queue depth 1, 2, 4, ...,
# 128 (QD_SECS seconds each, default 3), IOPS and the hit's ratio to the plain namespace.
# The target runs on core 0 (one network thread), the control plane and `nearstore perf` on
# core 1. Every extent is allocated (and marked written) before the runs (the pool file is sparse: reads come from
# the page cache, as the seed's "software direct" reads came from the drive).
# Run it on a quiet machine: others building at the same time make the figures meaningless.
# Usage: scripts/bench-volume.sh [path/to/nearstore] [seconds-per-run]   (default target/release/nearstore, 10 s)
set -euo pipefail
bin=${1:-target/release/nearstore}
secs=${2:-10}
qd_secs=${QD_SECS:-3}
depths="1 2 4 8 16 32 64 128"
[ -x "$bin" ] || { echo "not an executable: $bin (cargo build --release first)" >&2; exit 2; }
command -v taskset >/dev/null || { echo "missing prerequisite: taskset (apt-get install util-linux)" >&2; exit 2; }
command -v python3 >/dev/null || { echo "missing prerequisite: python3" >&2; exit 2; }
work=$(mktemp -d)
cp_pid=
t_pid=
trap '[ -n "$t_pid" ] && kill $t_pid 2>/dev/null; [ -n "$cp_pid" ] && kill $cp_pid 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
cp_port=$(port)
io_port=$(port)
control=127.0.0.1:$cp_port
member=nqn.2026-11.io.nearstore:bench
vol_nqn=nqn.2026-11.io.nearstore:volume:bench

taskset -c 1 "$bin" control --store "$work/store" --listen "$control" > "$work/cp.out" 2> "$work/cp.log" &
cp_pid=$!
for _ in $(seq 50); do grep -q listening "$work/cp.out" && break; sleep 0.1; done
grep -q listening "$work/cp.out" || { cat "$work/cp.log" >&2; exit 1; }

start_target() { # cache_entries: the volume's target on $io_port, its pool in $work/pool
    cat > "$work/t.toml" <<TOML
net_threads = 1
[[listener]]
address = "127.0.0.1:$io_port"
[[subsystem]]
nqn = "nqn.2026-11.io.nearstore:benchmem"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
memory = "1MiB"
[cluster]
host_nqn = "$member"
trusted_members = ["$member"]
[volume]
cache_entries = $1
TOML
    taskset -c 0 "$bin" target --config "$work/t.toml" --control "$control" --pool "$work/pool:1GiB" --log-level warn \
        > "$work/t.out" 2> "$work/t.log" &
    t_pid=$!
    for _ in $(seq 50); do grep -q listening "$work/t.out" && break; sleep 0.1; done
    grep -q listening "$work/t.out" || { cat "$work/t.log" >&2; exit 1; }
}
stop_target() { kill $t_pid; wait $t_pid 2>/dev/null || true; t_pid=; }

perf() { # nqn [queue depth [seconds]] -> one JSON line of figures
    taskset -c 1 "$bin" perf -a 127.0.0.1:$io_port -n "$1" -w randread -z 4KiB -q "${2:-1}" -T "${3:-$secs}" --quiet -o json
}

curve() { # nqn case: one JSON file per queue depth
    for q in $depths; do perf "$1" "$q" "$qd_secs" > "$work/$2-q$q.json"; done
}

# Waits until the target serves the volume (it learns the export from the control plane).
wait_volume() {
    for _ in $(seq 100); do
        taskset -c 1 "$bin" perf -a 127.0.0.1:$io_port -n $vol_nqn -w randread -z 4KiB -q 1 -T 0.1 --quiet -o json > /dev/null 2>&1 && return 0
        sleep 0.1
    done
    echo "the target did not serve the volume" >&2; exit 1
}

start_target 0
"$bin" volume create bench --size 1GiB --extent-size 1MiB --control "$control" > /dev/null
python3 - "$control" <<'PY'
import sys, urllib.request
# Allocated and marked written (as if zeroed): an unwritten extent reads as zeros, uncached.
for i in range(1024):
    for step in ("allocate", "written"):
        urllib.request.urlopen(urllib.request.Request(f"http://{sys.argv[1]}/v1/volumes/bench/extents/{i}/{step}", method="POST")).read()
PY
"$bin" volume export bench --target 127.0.0.1:$io_port --allow-any-host --control "$control" > /dev/null
wait_volume
perf $vol_nqn > "$work/a.json"
stop_target

start_target 1
wait_volume
perf $vol_nqn > "$work/b.json"
stop_target

start_target 4096
wait_volume
taskset -c 1 "$bin" perf -a 127.0.0.1:$io_port -n $vol_nqn -w read -z 128KiB -q 8 -T 3 --quiet -o json > /dev/null
perf $vol_nqn > "$work/c.json"
curve $vol_nqn c
stop_target
"$bin" volume unexport bench --control "$control" > /dev/null

taskset -c 0 "$bin" target --listen 127.0.0.1:$io_port --discovery none --net-threads 1 --namespace "$work/pool" \
    --block-size 4096 --nqn nqn.2026-11.io.nearstore:plain --log-level warn > "$work/t.out" 2> "$work/t.log" &
t_pid=$!
for _ in $(seq 50); do grep -q listening "$work/t.out" && break; sleep 0.1; done
perf nqn.2026-11.io.nearstore:plain > "$work/d.json"
curve nqn.2026-11.io.nearstore:plain d
stop_target

python3 - "$work" "$secs" "$qd_secs" "$depths" <<'PY'
import json, sys
w, secs, qd_secs, depths = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split()
rows = [("a", "volume, no cache (every I/O translated)"), ("b", "volume, cache miss"), ("c", "volume, cache hit"), ("d", "the pool as a plain namespace")]
print(f"4 KiB random reads, QD 1, {secs} s each; latency in us")
print(f"| case | avg | p50 | p90 | p99 | p99.9 | IOPS |")
print(f"|---|---|---|---|---|---|---|")
figs = {}
for k, name in rows:
    j = json.load(open(f"{w}/{k}.json"))
    figs[k] = j
    print(f"| ({k}) {name} | {j['avg_us']:.1f} | {j['p50_us']:.1f} | {j['p90_us']:.1f} | {j['p99_us']:.1f} | {j['p999_us']:.1f} | {j['iops']:.0f} |")
c, d = figs["c"], figs["d"]
print(f"hit / plain: p50 {c['p50_us'] / d['p50_us']:.2f}x, p99 {c['p99_us'] / d['p99_us']:.2f}x (goal: within 1.2x)")
print()
print(f"4 KiB random reads, {qd_secs} s per queue depth; IOPS (avg latency in us)")
print("| QD | (c) volume, cache hit | (d) plain namespace | hit / plain |")
print("|---:|---:|---:|---:|")
for q in depths:
    c, d = (json.load(open(f"{w}/{k}-q{q}.json")) for k in "cd")
    print(f"| {q} | {c['iops']:.0f} ({c['avg_us']:.0f}) | {d['iops']:.0f} ({d['avg_us']:.0f}) | {c['iops'] / d['iops']:.2f} |")
PY
