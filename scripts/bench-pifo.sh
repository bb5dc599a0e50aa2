#!/usr/bin/env bash
# The host's PIFO (issue 16; docs/fair-io.md, "The host's PIFO"; docs/benchmarks.md): one
# target with a 256 MiB memory namespace whose bandwidth is capped at RATE (default 256MiB, a
# drive's, so that queueing, not this VM's CPU, sets the figures), and `nearstore-lab
# pifo-bench` against it: per round the victim's 4 KiB reads at QD 1 alone, then beside a
# background of 128 KiB reads and writes at QD 32 in FIFO order, then in PIFO order, all
# through one connection keeping IN_FLIGHT (default 8) commands at the target. Target on core 0,
# the host on core 1.
# Usage: scripts/bench-pifo.sh BINDIR [rounds] [seconds-per-phase]   (default 5 rounds, 3 s)
# Example: scripts/bench-pifo.sh target/release 5 3
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,10p' "$0"; exit 2; }
dir=$1 rounds=${2:-5} secs=${3:-3}
for b in nearstore nearstore-lab; do [ -x "$dir/$b" ] || { echo "not an executable: $dir/$b" >&2; exit 2; }; done
rate=${RATE:-256MiB} inflight=${IN_FLIGHT:-8} wc=${WRITE_COST:-1}
work=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
port=44231
nqn=nqn.2026-11.io.nearstore:pifo
cat > "$work/t.toml" <<EOF
[[listener]]
address = "127.0.0.1:$port"
[[subsystem]]
nqn = "$nqn"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
memory = "256MiB"
block_size = 4096
rate_limit = "$rate"
EOF
taskset -c 0 "$dir/nearstore" target --config "$work/t.toml" --net-threads 1 --log-level warn > "$work/t.out" 2>&1 &
pid=$!
for _ in $(seq 50); do grep -q listening "$work/t.out" && break; sleep 0.1; done
grep -q listening "$work/t.out" || { cat "$work/t.out" >&2; exit 1; }
echo "# $(date -u '+%F %H:%M') UTC, $(nproc) cores, $(uname -r), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# $dir; namespace rate $rate; in flight $inflight; write cost $wc; $rounds rounds of $secs s per phase"
taskset -c 1 "$dir/nearstore-lab" pifo-bench -a 127.0.0.1:$port -n "$nqn" --span 256MiB --in-flight "$inflight" \
    --write-cost "$wc" -T "$secs" --rounds "$rounds"
