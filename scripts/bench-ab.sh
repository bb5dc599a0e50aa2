#!/usr/bin/env bash
# Two builds of the target side by side, in one run: the before/after comparison of
# docs/benchmarks.md. Each round starts a fresh target per workload and build, alternating
# A B A B, with the target on core 0 (one network thread, memory backend, 4 KiB blocks)
# and `nearstore perf` (of build A, the same client for both) on core 1; then medians and
# the ratio B/A per workload. Offloaded workloads ("offload checksum file", "offload grep
# memory"): a 512 MiB text file on ext4 on a loop device (made once, as root), its image
# exported by the target as a file namespace, or copied into a memory namespace; build A's
# `nearstore checksum`/`grep -c --offload-only` runs 8 times in a row; MB/s of the file.
# OFFLOAD_CORES=0,1 lets those targets use both cores (the command's thread beside the
# network thread), as a target computing with the machine's cores does.
# BACKEND=file: the plain workloads on a 1 GiB file namespace (in $TMPDIR, so on the disk's
# file system; its pages are in the page cache after the warm-up write) instead of memory.
# Usage: scripts/bench-ab.sh BIN_A BIN_B [rounds] [seconds-per-run]   (default 3 rounds, 5 s)
# Example: cp target/release/nearstore /tmp/before; (change, build); \
#          scripts/bench-ab.sh /tmp/before target/release/nearstore
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,9p' "$0"; exit 2; }
a=$1 b=$2 rounds=${3:-3} secs=${4:-5}
for bin in "$a" "$b"; do [ -x "$bin" ] || { echo "not an executable: $bin" >&2; exit 2; }; done
work=$(mktemp -d)
pid=
mnt=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; wait 2>/dev/null; [ -n "$mnt" ] && umount "$mnt"; rm -rf "$work"' EXIT
port=44201
# WORKLOADS="randread 4KiB 128;read 128KiB 32" runs only those (pattern, size, queue depth).
# "offload checksum file;offload grep memory" are the offloaded ones (operation, namespace).
IFS=';' read -ra workloads <<< "${WORKLOADS:-randread 4KiB 1;randread 4KiB 32;randread 4KiB 128;read 128KiB 32;randwrite 4KiB 32}"

run() { # bin workload size qd -> "iops mb_per_s"
    local bin=$1 w=$2 z=$3 q=$4
    local export=(--memory 1GiB)
    [ "${BACKEND:-memory}" = file ] && export=(--namespace "$work/ns.img" --size 1GiB)
    taskset -c 0 "$bin" target --listen 127.0.0.1:$port --discovery none --net-threads 1 \
        "${export[@]}" --block-size 4096 --log-level warn > "$work/t.out" 2>&1 &
    pid=$!
    for _ in $(seq 50); do grep -q listening "$work/t.out" && break; sleep 0.1; done
    grep -q listening "$work/t.out" || { cat "$work/t.out" >&2; exit 1; }
    # Touch the namespace's pages once, so that reads do not find them unmapped.
    taskset -c 1 "$a" perf -a 127.0.0.1:$port -T 1 -w randwrite -z 4KiB -q 32 --quiet -o json > /dev/null
    taskset -c 1 "$a" perf -a 127.0.0.1:$port -T "$secs" -w "$w" -z "$z" -q "$q" --quiet -o json |
        python3 -c 'import json,sys; j=json.load(sys.stdin); print(round(j["iops"]), round(j["mb_per_s"]))'
    kill $pid; wait $pid 2>/dev/null || true; pid=
}

fs_setup() { # the ext4 image with the text file, mounted at $mnt
    [ "$(id -u)" = 0 ] || { echo "offloaded workloads need root (mount, a loop device)" >&2; exit 2; }
    truncate -s 640M "$work/fs.img"
    mkfs.ext4 -q -F -b 4096 "$work/fs.img"
    mkdir "$work/mnt"
    mount -o loop "$work/fs.img" "$work/mnt"
    mnt=$work/mnt
    python3 - "$mnt/data" <<'PY'
import random, sys
r = random.Random(7)
words = [b"alpha", b"beta", b"gamma", b"delta", b"ERROR", b"timeout", b"request", b"42"]
lines = []
size = 0
while size < 1 << 20:
    line = b" ".join(r.choice(words) for _ in range(r.randint(3, 14))) + b"\n"
    lines.append(line)
    size += len(line)
block = b"".join(lines)
with open(sys.argv[1], "wb") as f:
    for _ in range(512):
        f.write(block)
PY
    sync
}

run_offload() { # bin operation namespace(file|memory) -> "0 mb_per_s"
    local bin=$1 op=$2 ns=$3
    local export=(--namespace "$work/fs.img")
    [ "$ns" = memory ] && export=(--memory 640MiB)
    taskset -c "${OFFLOAD_CORES:-0}" "$bin" target --listen 127.0.0.1:$port --discovery none --net-threads 1 \
        "${export[@]}" --block-size 4096 --log-level warn > "$work/t.out" 2>&1 &
    pid=$!
    for _ in $(seq 50); do grep -q listening "$work/t.out" && break; sleep 0.1; done
    grep -q listening "$work/t.out" || { cat "$work/t.out" >&2; exit 1; }
    [ "$ns" = memory ] && taskset -c 1 "$a" write -a 127.0.0.1:$port --data "$work/fs.img" > /dev/null 2>&1
    printf '[[namespace]]\naddress = "127.0.0.1:%s"\nnqn = "nqn.2026-11.io.nearstore:disk0"\nnsid = 1\nfile = "%s"\n' \
        $port "$work/fs.img" > "$work/map.toml"
    local verb=(checksum)
    [ "$op" = grep ] && verb=(grep -c ERROR)
    local t0 t1
    # Once to warm the target's page cache (file) and the client, then 8 times timed.
    taskset -c 1 "$a" "${verb[@]}" --map "$work/map.toml" --offload-only "$mnt/data" > /dev/null
    t0=$(date +%s.%N)
    for _ in 1 2 3 4 5 6 7 8; do
        taskset -c 1 "$a" "${verb[@]}" --map "$work/map.toml" --offload-only "$mnt/data" > /dev/null
    done
    t1=$(date +%s.%N)
    python3 -c "print(0, round(8 * 512 * 1.048576 / ($t1 - $t0)))"
    kill $pid; wait $pid 2>/dev/null || true; pid=
}

case "${BACKEND:-memory}" in memory|file) ;; *) echo "BACKEND is memory or file" >&2; exit 2 ;; esac
case "${workloads[*]}" in *offload*) fs_setup ;; esac

echo "# $(date -u '+%F %H:%M') UTC, $(nproc) cores, $(uname -r), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# A = $a"
echo "# B = $b"
echo "# $rounds rounds of ${secs} s per run, backend ${BACKEND:-memory}"
for r in $(seq "$rounds"); do
    for wl in "${workloads[@]}"; do
        read -r w z q <<< "$wl"
        for side in A B; do
            bin=$a; [ $side = B ] && bin=$b
            # Assignments, so that a failed run ends the script instead of leaving a line
            # without figures.
            if [ "$w" = offload ]; then
                out=$(run_offload "$bin" "$z" "$q")
            else
                out=$(run "$bin" "$w" "$z" "$q")
            fi
            echo "$r $side $w $z $q $out" | tee -a "$work/runs"
        done
    done
done
echo "# workload size qd: median IOPS A, B, ratio B/A (MB/s A, B); offloaded: median MB/s A, B, ratio B/A"
python3 - "$work/runs" <<'EOF'
import sys, statistics
runs = {}
for line in open(sys.argv[1]):
    r, side, w, z, q, iops, mbs = line.split()
    runs.setdefault((w, z, q), {}).setdefault(side, []).append((int(iops), int(mbs)))
for (w, z, q), s in runs.items():
    ia, ib = statistics.median(x[0] for x in s["A"]), statistics.median(x[0] for x in s["B"])
    ma, mb = statistics.median(x[1] for x in s["A"]), statistics.median(x[1] for x in s["B"])
    if w == "offload":
        print(f"offloaded {z} over a {q} namespace: {ma:.0f} {mb:.0f} MB/s, {mb / ma:.2f}x")
    else:
        print(f"{w} {z} QD{q}: {ia:.0f} {ib:.0f} {ib / ia:.2f}x ({ma:.0f} {mb:.0f} MB/s)")
EOF
