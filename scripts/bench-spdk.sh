#!/usr/bin/env bash
# nearstore's target against SPDK's nvmf_tgt in one run (docs/benchmarks.md, "Against SPDK").
# Both targets on core 0 (ours: one network thread, memory backend; SPDK: one reactor, a
# Malloc bdev), 1 GiB with 4 KiB blocks; SPDK's spdk_nvme_perf on core 1 drives both.
# Each round runs every workload on a fresh nearstore target (A), then on a fresh nvmf_tgt
# (B), after a 1 s random-write warm-up; then medians and the ratio A/B per workload, as a
# markdown table. The whole run holds the machine's build lock (BENCH_LOCK), so nothing else
# runs beside it; hugepages are set for SPDK and given back at the end.
# Usage: scripts/bench-spdk.sh [rounds] [seconds-per-run]   (default 3 rounds, 10 s)
# Environment:
#   SPDK_DIR    SPDK v26.05 built in place (default /work/spdk; build/bin/nvmf_tgt and
#               build/bin/spdk_nvme_perf are used; how to build it: shared/SPDK.md)
#   NEARSTORE   the nearstore binary (default: target/release/nearstore, built first)
#   WORKLOADS   "pattern size qd;..." (default: the five of issue 14)
#   SPDK_TRANSPORT_ARGS  extra nvmf_create_transport arguments, e.g. "-o" (no C2H SUCCESS)
#   BENCH_LOCK  the lock file (default /work/cargo.lock)
set -euo pipefail
cd "$(dirname "$0")/.."
lock=${BENCH_LOCK:-/work/cargo.lock}
if [ -z "${BENCH_SPDK_LOCKED:-}" ]; then
    BENCH_SPDK_LOCKED=1 exec flock "$lock" "$0" "$@"
fi
rounds=${1:-3} secs=${2:-10}
spdk=${SPDK_DIR:-/work/spdk}
for f in build/bin/nvmf_tgt build/bin/spdk_nvme_perf scripts/rpc.py; do
    [ -e "$spdk/$f" ] || { echo "SPDK not found: $spdk/$f is missing (set SPDK_DIR; build it as in shared/SPDK.md)" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "needs root (hugepages, SPDK)" >&2; exit 2; }
[ "$(nproc)" -ge 2 ] || { echo "needs 2 cores (targets on core 0, the client on core 1)" >&2; exit 2; }
if [ -z "${NEARSTORE:-}" ]; then
    cargo build --release --locked -p nearstore >/dev/null
    NEARSTORE=./target/release/nearstore
fi
[ -x "$NEARSTORE" ] || { echo "not an executable: $NEARSTORE" >&2; exit 2; }
IFS=';' read -ra workloads <<< "${WORKLOADS:-randread 4096 1;randread 4096 32;randread 4096 128;read 131072 32;randwrite 4096 32}"

work=$(mktemp -d)
rpc_sock=$work/spdk.sock
pid= client=
hugepages_before=$(cat /proc/sys/vm/nr_hugepages)
mounted=
cleanup() {
    [ -n "$client" ] && kill "$client" 2>/dev/null && wait "$client" 2>/dev/null
    [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    [ -n "$mounted" ] && umount /dev/hugepages
    echo "$hugepages_before" > /proc/sys/vm/nr_hugepages
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# SPDK's target (1 GiB Malloc) and its perf each take hugepages; 3 GiB leaves room for both.
echo 1536 > /proc/sys/vm/nr_hugepages
if ! mountpoint -q /dev/hugepages; then
    mkdir -p /dev/hugepages
    mount -t hugetlbfs nodev /dev/hugepages
    mounted=1
fi
[ "$(cat /proc/sys/vm/nr_hugepages)" -ge 1536 ] || { echo "could not reserve 1536 hugepages" >&2; exit 1; }

ours_port=44210 spdk_port=44211
ours_nqn=nqn.2026-11.io.nearstore:disk0 spdk_nqn=nqn.2016-06.io.spdk:bench

start_ours() {
    taskset -c 0 "$NEARSTORE" target --listen 127.0.0.1:$ours_port --discovery none --net-threads 1 \
        --memory 1GiB --block-size 4096 --nqn $ours_nqn --log-level warn > "$work/t.out" 2>&1 &
    pid=$!
    for _ in $(seq 50); do grep -q listening "$work/t.out" && return; sleep 0.1; done
    cat "$work/t.out" >&2; exit 1
}
rpc() { /usr/bin/python3 "$spdk/scripts/rpc.py" -s "$rpc_sock" "$@" > /dev/null; }
start_spdk() {
    taskset -c 0 "$spdk/build/bin/nvmf_tgt" -m 0x1 -r "$rpc_sock" > "$work/t.out" 2>&1 &
    pid=$!
    for _ in $(seq 100); do [ -S "$rpc_sock" ] && break; sleep 0.1; done
    rpc framework_wait_init
    # shellcheck disable=SC2086 # SPDK_TRANSPORT_ARGS is a list of arguments
    rpc nvmf_create_transport -t TCP ${SPDK_TRANSPORT_ARGS:-}
    rpc bdev_malloc_create -b Malloc0 1024 4096
    rpc nvmf_create_subsystem $spdk_nqn -a -s SPDK00000000000001
    rpc nvmf_subsystem_add_ns $spdk_nqn Malloc0
    rpc nvmf_subsystem_add_listener $spdk_nqn -t tcp -a 127.0.0.1 -s $spdk_port
}
stop_target() {
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    pid=
}
client() { # port nqn pattern size qd seconds -> "iops mib_per_s avg_us"
    taskset -c 1 "$spdk/build/bin/spdk_nvme_perf" -c 0x2 -q "$5" -o "$4" -w "$3" -t "$6" \
        -r "trtype:tcp adrfam:IPv4 traddr:127.0.0.1 trsvcid:$1 subnqn:$2" > "$work/c.out" 2>&1 &
    client=$!
    wait "$client" || true
    client=
    # "Total : IOPS MiB/s Average min max"; SPDK 26.05's perf prints CQ transport errors at
    # teardown, and exits non-zero after some of them, so the Total line is what counts.
    awk '/^Total/ { sub(/.*:/, ""); print $1, $2, $3; found = 1 } END { exit !found }' "$work/c.out" ||
        { cat "$work/c.out" >&2; exit 1; }
}
run() { # side pattern size qd
    local port nqn
    if [ "$1" = nearstore ]; then start_ours; port=$ours_port nqn=$ours_nqn; else start_spdk; port=$spdk_port nqn=$spdk_nqn; fi
    client $port $nqn randwrite 4096 32 1 > /dev/null
    client $port $nqn "$2" "$3" "$4" "$secs"
    stop_target
}

echo "# $(date -u '+%F %H:%M') UTC, $(nproc) cores, $(uname -r), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
echo "# uptime: $(uptime)"
echo "# nearstore = $NEARSTORE ($(git rev-parse --short HEAD 2>/dev/null || echo '?')), SPDK = $spdk ($(git -C "$spdk" describe --tags 2>/dev/null || echo '?')) ${SPDK_TRANSPORT_ARGS:+transport $SPDK_TRANSPORT_ARGS}"
echo "# $rounds rounds of ${secs} s per run; round side pattern size qd IOPS MiB/s avg_us"
for r in $(seq "$rounds"); do
    echo "# round $r, uptime: $(uptime)"
    for wl in "${workloads[@]}"; do
        read -r w z q <<< "$wl"
        for side in nearstore spdk; do
            # An assignment, so that a run that fails (a target that did not start) ends
            # the script here instead of leaving a line without figures.
            out=$(run $side "$w" "$z" "$q")
            echo "$r $side $w $z $q $out" | tee -a "$work/runs"
        done
    done
done
echo
python3 - "$work/runs" <<'EOF'
import sys, statistics
runs = {}
for line in open(sys.argv[1]):
    r, side, w, z, q, iops, mibs, lat = line.split()
    runs.setdefault((w, int(z), q), {}).setdefault(side, []).append((float(iops), float(mibs)))
print("| workload | nearstore IOPS (MB/s) | SPDK IOPS (MB/s) | ratio |")
print("|---|---:|---:|---:|")
for (w, z, q), s in runs.items():
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in s.items()}
    (ia, ma), (ib, mb) = med["nearstore"], med["spdk"]
    size = f"{z // 1024} KiB"
    print(f"| {size} {w} QD {q} | {ia:,.0f} ({ma * 1.048576:,.0f}) | {ib:,.0f} ({mb * 1.048576:,.0f}) | {ia / ib:.2f} |")
EOF
