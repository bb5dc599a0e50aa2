#!/usr/bin/env bash
# The fair I/O scheduler's cost (issue 16; docs/fair-io.md, "What the scheduler costs"): one
# build of the target, in one run, with the scheduler off and on. Both configurations are the
# same but for the namespace's `fair` line: a 1 GiB memory namespace of 4 KiB blocks, a
# configured tenant `bench` (io_weight 200) reaching it, and `nearstore perf` connecting as
# that tenant's host. Each round starts a fresh target per workload and side (target on core
# 0, one network thread; the client on core 1), the sides' order alternating from round to
# round (off on, on off, ...); then medians and the ratio on/off per workload. Each run checks
# on the metrics endpoint that the scheduler let the tenant's bytes go (on) or never saw them
# (off), so that a configuration mistake cannot pass for a free scheduler.
# BANDWIDTH (default 64GiB): the `fair` bandwidth, above anything this loopback serves, so that
# nothing waits and the figures are the scheduler's bookkeeping alone.
# Usage: scripts/bench-fair.sh BIN [rounds] [seconds-per-run]   (default 5 rounds, 5 s)
# Example: flock /work/cargo.lock scripts/bench-fair.sh target/release/nearstore 5
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,14p' "$0"; exit 2; }
bin=$1 rounds=${2:-5} secs=${3:-5}
[ -x "$bin" ] || { echo "not an executable: $bin" >&2; exit 2; }
bandwidth=${BANDWIDTH:-64GiB}
work=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
port=44211 mport=44212
nqn=nqn.2026-11.io.nearstore:disk0
host=nqn.2014-08.org.nvmexpress:uuid:bench-fair-tenant
# WORKLOADS="randread 4KiB 32" runs only those (pattern, size, queue depth).
IFS=';' read -ra workloads <<< "${WORKLOADS:-randread 4KiB 1;randread 4KiB 32;randwrite 4KiB 32;read 128KiB 32}"

config() { # side -> the target's configuration
    local fair=
    [ "$1" = on ] && fair="fair = { bandwidth = \"$bandwidth\" }"
    cat <<EOF
metrics = "127.0.0.1:$mport"
[[listener]]
address = "127.0.0.1:$port"
[[subsystem]]
nqn = "$nqn"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
memory = "1GiB"
block_size = 4096
$fair
[[tenant]]
name = "bench"
hosts = ["$host"]
io_weight = 200
[[tenant.reach]]
subsystem = "$nqn"
EOF
}

scheduled() { # the bytes the fair scheduler let go for tenant bench
    python3 - "$mport" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5).read().decode()
print(sum(int(float(l.split()[-1])) for l in text.splitlines()
          if l.startswith('nearstore_tenant_io_scheduled_bytes_total{tenant="bench"}')))
PY
}

run() { # side workload size qd -> "iops mb_per_s p99_us" in $work/out
    # Runs in this shell, not in $(...): a failure ends the script with $pid still set, so
    # the exit trap stops the target.
    local side=$1 w=$2 z=$3 q=$4
    config "$side" > "$work/t.toml"
    : > "$work/t.out"
    taskset -c 0 "$bin" target --config "$work/t.toml" --net-threads 1 --log-level warn > "$work/t.out" 2>&1 &
    pid=$!
    for _ in $(seq 50); do grep -q listening "$work/t.out" && break; sleep 0.1; done
    grep -q listening "$work/t.out" || { cat "$work/t.out" >&2; exit 1; }
    local c=(-a 127.0.0.1:$port -n "$nqn" --hostnqn "$host" --quiet -o json)
    # Touch the namespace's pages once, so that reads do not find them unmapped.
    taskset -c 1 "$bin" perf "${c[@]}" -T 1 -w randwrite -z 4KiB -q 32 > /dev/null
    # The measured run's own bytes must pass the scheduler (on) or never reach it (off):
    # counted before and after it, so the warm-up's writes cannot stand in for them.
    local before after
    before=$(scheduled)
    taskset -c 1 "$bin" perf "${c[@]}" -T "$secs" -w "$w" -z "$z" -q "$q" > "$work/p.json"
    after=$(scheduled)
    if [ "$side" = on ] && [ "$after" = "$before" ]; then echo "fair on, but the measured run's bytes were not scheduled" >&2; exit 1; fi
    if [ "$side" = off ] && [ "$after" != 0 ]; then echo "fair off, but $after bytes were scheduled" >&2; exit 1; fi
    python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(round(j["iops"]), round(j["mb_per_s"]), round(j["p99_us"]))' "$work/p.json" > "$work/out"
    kill $pid; wait $pid 2>/dev/null || true; pid=
}

echo "# $(date -u '+%F %H:%M') UTC, $(nproc) cores, $(uname -r), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# $bin; fair bandwidth $bandwidth; $rounds rounds of ${secs} s per run, memory namespace"
echo "# round side workload size qd: IOPS MB/s p99_us"
for r in $(seq "$rounds"); do
    sides="off on"
    [ $((r % 2)) = 0 ] && sides="on off"
    for wl in "${workloads[@]}"; do
        read -r w z q <<< "$wl"
        for side in $sides; do
            run "$side" "$w" "$z" "$q"
            echo "$r $side $w $z $q $(cat "$work/out")" | tee -a "$work/runs"
        done
    done
done
echo "# workload size qd: median IOPS off, on, ratio on/off (MB/s off, on; p99 us off, on)"
python3 - "$work/runs" <<'EOF'
import sys, statistics
runs = {}
for line in open(sys.argv[1]):
    r, side, w, z, q, iops, mbs, p99 = line.split()
    runs.setdefault((w, z, q), {}).setdefault(side, []).append((int(iops), int(mbs), int(p99)))
for (w, z, q), s in runs.items():
    m = {side: [statistics.median(x[i] for x in s[side]) for i in range(3)] for side in ("off", "on")}
    (io, mo, po), (i1, m1, p1) = m["off"], m["on"]
    print(f"{w} {z} QD{q}: {io:.0f} {i1:.0f} {i1 / io:.3f}x ({mo:.0f} {m1:.0f} MB/s; p99 {po:.0f} {p1:.0f} us)")
EOF
