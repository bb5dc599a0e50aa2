#!/usr/bin/env bash
# User-space instructions per I/O of two builds of the target, counted by valgrind's
# callgrind: a figure the wall clock of a shared machine cannot blur (this VM has no
# performance counters). Per workload and build, a 2 s and an 8 s run of `nearstore perf`
# (build A's) against a target under callgrind (core 0, one network thread, memory backend,
# 4 KiB blocks); the difference of the two counts over the difference of their I/Os, so
# start-up cancels out. Only where the target is the bottleneck (QD 32 here): at QD 1 it
# busy-polls while it waits, and those instructions count too.
# Usage: scripts/bench-ir.sh BIN_A BIN_B   (WORKLOADS="randread 4KiB 32;...": perf workloads)
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,9p' "$0"; exit 2; }
a=$1 b=$2
command -v valgrind > /dev/null || { echo "valgrind is needed (apt-get install valgrind)" >&2; exit 2; }
for bin in "$a" "$b"; do [ -x "$bin" ] || { echo "not an executable: $bin" >&2; exit 2; }; done
work=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
port=44311
IFS=';' read -ra workloads <<< "${WORKLOADS:-randread 4KiB 32;read 128KiB 32;randwrite 4KiB 32}"

one() { # bin workload size qd secs -> "ios instructions"
    taskset -c 0 valgrind --tool=callgrind --callgrind-out-file="$work/cg" "$1" target --listen 127.0.0.1:$port \
        --discovery none --net-threads 1 --memory 256MiB --block-size 4096 --log-level warn > "$work/t.out" 2>&1 &
    pid=$!
    for _ in $(seq 300); do grep -q listening "$work/t.out" && break; sleep 0.1; done
    grep -q listening "$work/t.out" || { cat "$work/t.out" >&2; exit 1; }
    local n
    n=$(taskset -c 1 "$a" perf -a 127.0.0.1:$port -T "$5" -w "$2" -z "$3" -q "$4" --quiet -o json |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["ios"])')
    kill -INT $pid; wait $pid; pid=
    echo "$n $(awk '/^totals:/ {print $2}' "$work/cg")"
}

echo "# $(date -u '+%F %H:%M') UTC; A = $a; B = $b"
echo "# workload size qd: instructions per I/O A, B, ratio B/A"
for wl in "${workloads[@]}"; do
    read -r w z q <<< "$wl"
    declare -A per
    for side in A B; do
        bin=$a; [ $side = B ] && bin=$b
        read -r n1 i1 <<< "$(one "$bin" "$w" "$z" "$q" 2)"
        read -r n2 i2 <<< "$(one "$bin" "$w" "$z" "$q" 8)"
        per[$side]=$(( (i2 - i1) / (n2 - n1) ))
    done
    echo "$w $z QD$q: ${per[A]} ${per[B]} $(python3 -c "print(f'{${per[B]} / ${per[A]}:.2f}x')")"
done
