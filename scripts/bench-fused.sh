#!/usr/bin/env bash
# Fused write operations against the same steps done the conventional way (issue 17;
# docs/benchmarks.md, "Fused write operations"): `nearstore-lab fused-bench` against a target
# with a 1 GiB journaled file namespace (4 KiB blocks), its image and journal on STORAGE:
# `tmpfs` (a flush costs about nothing: the operations' own cost, round trips, copies and
# computation) or `disk` (a directory on this machine's disk, ext4 or whatever /var/tmp is:
# the flushes' cost too). Per round, per operation (append, modify, compress), size and queue
# depth, three runs in turn: fused, conventional with plain writes, conventional with FUA
# writes (durable at completion, as a fused operation is), the order rotating from round to
# round. A fresh target per storage; target on core 0 (one network thread), client on core 1.
# Prints every run, then medians and the ratios fused / conventional.
# Usage: scripts/bench-fused.sh DIR_OF_BINARIES [rounds] [seconds-per-run] [storage...]
#   (default 3 rounds, 2 s, tmpfs and disk). DIR holds nearstore and nearstore-lab.
# SIZES (default "4KiB 64KiB"), QDS (default "1 32"), OPS (default "append
# modify compress") pick some.
# Example: scripts/bench-fused.sh target/release 3 3
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,16p' "$0"; exit 2; }
bin=$1 rounds=${2:-3} secs=${3:-2}
shift $(( $# < 3 ? $# : 3 ))
storages=("$@")
[ ${#storages[@]} -gt 0 ] || storages=(tmpfs disk)
for b in nearstore nearstore-lab; do [ -x "$bin/$b" ] || { echo "not an executable: $bin/$b" >&2; exit 2; }; done
read -ra sizes <<< "${SIZES:-4KiB 64KiB}"
read -ra qds <<< "${QDS:-1 32}"
read -ra ops <<< "${OPS:-append modify compress}"
work=$(mktemp -d)
mnt=
pid=
cleanup() {
    [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    [ -n "$mnt" ] && umount "$mnt" 2>/dev/null
    rm -rf "$work" /var/tmp/nearstore-bench-fused
}
trap cleanup EXIT
port=44221
nqn=nqn.2026-11.io.nearstore:bench-fused

start() { # storage -> a target serving the namespace there
    local dir
    case $1 in
        tmpfs) mnt=$work/tmpfs; mkdir -p "$mnt"; mount -t tmpfs -o size=2200m tmpfs "$mnt"; dir=$mnt ;;
        disk) dir=/var/tmp/nearstore-bench-fused; rm -rf "$dir"; mkdir -p "$dir" ;;
        *) echo "storage $1: tmpfs or disk" >&2; exit 2 ;;
    esac
    cat > "$work/t.toml" <<EOF
[[listener]]
address = "127.0.0.1:$port"
[[subsystem]]
nqn = "$nqn"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
path = "$dir/ns.img"
size = "1GiB"
block_size = 4096
microtx = true
EOF
    : > "$work/t.out"
    taskset -c 0 "$bin/nearstore" target --config "$work/t.toml" --discovery none --net-threads 1 --log-level warn > "$work/t.out" 2>&1 &
    pid=$!
    for _ in $(seq 100); do grep -q listening "$work/t.out" && break; sleep 0.1; done
    grep -q listening "$work/t.out" || { cat "$work/t.out" >&2; exit 1; }
    echo "# storage $1: $(df -hT "$dir" | tail -1 | awk '{print $2, $1}')"
}

stop() {
    kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
    [ -z "$mnt" ] || { umount "$mnt"; mnt=; }
}

echo "# $(date -u '+%F %H:%M') UTC, $(nproc) cores, $(uname -r), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# $bin; $rounds rounds of ${secs} s per run"
echo "# storage op size qd how: ops/s MB/s mean_us p50_us p99_us"
for storage in "${storages[@]}"; do
    start "$storage"
    for r in $(seq "$rounds"); do
        case $((r % 3)) in 1) hows="fused plain fua" ;; 2) hows="plain fua fused" ;; 0) hows="fua fused plain" ;; esac
        for o in "${ops[@]}"; do
            for z in "${sizes[@]}"; do
                for q in "${qds[@]}"; do
                    for h in $hows; do
                        args=(--op "$o" -z "$z" -q "$q" -T "$secs" --ops 100000 -o json)
                        case $h in
                            fused) args+=(--how fused) ;;
                            plain) args+=(--how conventional) ;;
                            fua) args+=(--how conventional --fua) ;;
                        esac
                        taskset -c 1 "$bin/nearstore-lab" fused-bench -a 127.0.0.1:$port -n "$nqn" "${args[@]}" > "$work/r.json"
                        line=$(python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(round(j["iops"]), round(j["mb_per_s"],1), round(j["mean_us"]), round(j["p50_us"]), round(j["p99_us"]))' "$work/r.json")
                        echo "$storage $o $z $q $h: $line" | tee -a "$work/runs"
                    done
                done
            done
        done
    done
    stop
done
echo "# storage op size qd: median ops/s fused, plain, fua; ratio fused/plain, fused/fua (p50 us fused, plain, fua)"
python3 - "$work/runs" <<'EOF'
import sys, statistics
runs = {}
for line in open(sys.argv[1]):
    key, vals = line.split(":")
    s, o, z, q, h = key.split()
    iops, mbs, mean, p50, p99 = map(float, vals.split())
    runs.setdefault((s, o, z, q), {}).setdefault(h, []).append((iops, p50))
for (s, o, z, q), r in runs.items():
    m = {h: (statistics.median(x[0] for x in r[h]), statistics.median(x[1] for x in r[h])) for h in ("fused", "plain", "fua")}
    f, p, u = m["fused"], m["plain"], m["fua"]
    print(f"{s} {o} {z} QD{q}: {f[0]:.0f} {p[0]:.0f} {u[0]:.0f} ops/s; {f[0]/p[0]:.2f}x {f[0]/u[0]:.2f}x (p50 {f[1]:.0f} {p[1]:.0f} {u[1]:.0f} us)")
EOF
