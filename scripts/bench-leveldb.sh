#!/usr/bin/env bash
# A LevelDB-like workload, fused against conventional (issue 17; docs/benchmarks.md, "A
# LevelDB-like workload"): `nearstore-lab leveldb-bench` (db_bench fillrandom with sync: a
# write batch of one Put, a random 16-byte key and a value of SIZE bytes, per log record,
# durable before the next) on ext4 in an image on STORAGE (`tmpfs` or `disk`, as in
# scripts/bench-fused.sh), mounted on a loop device, the image exported by a target with a
# MicroTx journal. Per round, per value size and number of writers (logs written at once),
# fused (LogWriter: append-crc-write per record) and conventional (the record framed on the
# host, its blocks written with FUA) in turn, the order alternating from round to round.
# A fresh file system and target per storage; target on core 0 (one network thread), the
# lab on core 1. Prints every run, then medians and the ratios fused / conventional.
# Needs root (mount, loop devices) and mkfs.ext4.
# Usage: scripts/bench-leveldb.sh DIR_OF_BINARIES [rounds] [seconds-per-run] [storage...]
#   (default 3 rounds, 2 s, tmpfs and disk). DIR holds nearstore and nearstore-lab.
# VALUES (default "100 4096"), WRITERS (default "1 32") pick some.
# Example: scripts/bench-leveldb.sh target/release 3 2
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,16p' "$0"; exit 2; }
bin=$1 rounds=${2:-3} secs=${3:-2}
shift $(( $# < 3 ? $# : 3 ))
storages=("$@")
[ ${#storages[@]} -gt 0 ] || storages=(tmpfs disk)
for b in nearstore nearstore-lab; do [ -x "$bin/$b" ] || { echo "not an executable: $bin/$b" >&2; exit 2; }; done
for t in mkfs.ext4 losetup mount; do command -v "$t" >/dev/null || { echo "bench-leveldb needs $t" >&2; exit 2; }; done
[ "$(id -u)" = 0 ] || { echo "bench-leveldb needs root (mount, loop devices)" >&2; exit 2; }
read -ra values <<< "${VALUES:-100 4096}"
read -ra writers <<< "${WRITERS:-1 32}"
work=$(mktemp -d)
tmpfs= fsmnt= pid=
cleanup() {
    [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    [ -n "$fsmnt" ] && umount "$fsmnt" 2>/dev/null
    [ -n "$tmpfs" ] && umount "$tmpfs" 2>/dev/null
    rm -rf "$work" /var/tmp/nearstore-bench-leveldb
}
trap cleanup EXIT
port=44222
nqn=nqn.2026-11.io.nearstore:bench-leveldb

start() { # storage -> ext4 in an image there, mounted, and a target exporting the image
    local dir
    case $1 in
        tmpfs) tmpfs=$work/tmpfs; mkdir -p "$tmpfs"; mount -t tmpfs -o size=2200m tmpfs "$tmpfs"; dir=$tmpfs ;;
        disk) dir=/var/tmp/nearstore-bench-leveldb; rm -rf "$dir"; mkdir -p "$dir" ;;
        *) echo "storage $1: tmpfs or disk" >&2; exit 2 ;;
    esac
    image=$dir/fs.img
    truncate -s 1G "$image"
    mkfs.ext4 -q -F -b 4096 "$image"
    fsmnt=$work/fs; mkdir -p "$fsmnt"
    mount -o loop "$image" "$fsmnt"
    # A fused writer is a Host of its own (its own controller and queues): up to 32 of one host NQN, from one address.
    cat > "$work/t.toml" <<EOF
[limits]
controllers_per_host = 64
queues_per_address = 512
connections_per_address = 512
[[listener]]
address = "127.0.0.1:$port"
[[subsystem]]
nqn = "$nqn"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
path = "$image"
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
    umount "$fsmnt"; fsmnt=
    [ -z "$tmpfs" ] || { umount "$tmpfs"; tmpfs=; }
}

echo "# $(date -u '+%F %H:%M') UTC, $(nproc) cores, $(uname -r), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# $bin; $rounds rounds of ${secs} s per run"
echo "# storage value writers how: puts/s MB/s mean_us p50_us p99_us"
for storage in "${storages[@]}"; do
    start "$storage"
    for r in $(seq "$rounds"); do
        if [ $((r % 2)) = 1 ]; then hows="fused conventional"; else hows="conventional fused"; fi
        for v in "${values[@]}"; do
            for w in "${writers[@]}"; do
                for h in $hows; do
                    taskset -c 1 "$bin/nearstore-lab" leveldb-bench -a 127.0.0.1:$port -n "$nqn" --image "$image" --dir "$fsmnt" \
                        --how "$h" -z "$v" -w "$w" -T "$secs" -o json > "$work/r.json"
                    line=$(python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(round(j["puts_per_s"]), round(j["mb_per_s"],2), round(j["mean_us"]), round(j["p50_us"]), round(j["p99_us"]))' "$work/r.json")
                    echo "$storage $v $w $h: $line" | tee -a "$work/runs"
                done
            done
        done
    done
    stop
done
echo "# storage value writers: median puts/s fused, conventional; ratio (p50 us fused, conventional)"
python3 - "$work/runs" <<'EOF'
import sys, statistics
runs = {}
for line in open(sys.argv[1]):
    key, vals = line.split(":")
    s, v, w, h = key.split()
    puts, mbs, mean, p50, p99 = map(float, vals.split())
    runs.setdefault((s, v, w), {}).setdefault(h, []).append((puts, p50))
for (s, v, w), r in runs.items():
    f = [statistics.median(x[i] for x in r["fused"]) for i in (0, 1)]
    c = [statistics.median(x[i] for x in r["conventional"]) for i in (0, 1)]
    print(f"{s} {v} B x{w}: {f[0]:.0f} {c[0]:.0f} puts/s; {f[0]/c[0]:.2f}x (p50 {f[1]:.0f} {c[1]:.0f} us)")
EOF
