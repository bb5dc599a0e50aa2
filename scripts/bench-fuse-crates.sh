#!/usr/bin/env bash
# The measurement behind docs/fuse.md's "Why fuser": fuser 0.18 against fuse3 0.10, each a
# trivial file system (bench/fuse-crates/) serving one file of SIZE_MIB from memory, every
# open of it with direct I/O, read whole by `dd bs=1M iflag=direct` RUNS times per candidate:
# fuser with 1 thread, fuser with 4 threads (a cloned /dev/fuse descriptor each, as
# crates/fuse serves), fuse3 on a tokio runtime of 2 workers, and the same bytes from a tmpfs
# (read plainly: tmpfs has no O_DIRECT) as the memory copy to compare with. Each mount's bytes
# are first checked against the tmpfs file. Prints every run, each candidate's median and a
# table. Builds bench/fuse-crates first (cargo, release): a project of its own, since fuse3
# needs Rust 1.91, above the workspace's. Needs root (mounts) and /dev/fuse: run as another
# user, it runs itself again with sudo.
# Usage: scripts/bench-fuse-crates.sh [SIZE_MIB] [RUNS]   (default 256 MiB, 3 runs)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/as-root.sh
mib=${1:-256} runs=${2:-3}
[[ $mib =~ ^[1-9][0-9]*$ && $runs =~ ^[1-9][0-9]*$ ]] || { sed -n '2,12p' "$0"; exit 2; }
[ -e /dev/fuse ] || { echo "bench-fuse-crates.sh needs /dev/fuse (the fuse kernel module)" >&2; exit 1; }
manifest=bench/fuse-crates/Cargo.toml
locked=()
[ -f bench/fuse-crates/Cargo.lock ] && locked=(--locked)
cargo build --release --manifest-path "$manifest" "${locked[@]}"
bin=bench/fuse-crates/target/release
size=$((mib << 20))
# A dd that takes this long has hung on a mount (4 MiB/s at worst, plus a minute).
dd_timeout=$((60 + mib / 4))

work=$(mktemp -d)
mnt=$work/mnt
tmp=$work/tmpfs
pid=
# alive PID: running (a zombie, ended but not yet waited for, is not).
alive() { [ "$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)" != Z ] && [ -e "/proc/$1" ]; }
# Ends the file system this script started at $mnt: SIGTERM (it unmounts and exits), SIGKILL
# after 10 s, and an unmount (lazy should a plain one fail) if the mount is still there.
stop() {
    if [ -n "$pid" ]; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 100); do alive "$pid" || break; sleep 0.1; done
        if alive "$pid"; then
            echo "# pid $pid still running 10 s after SIGTERM: SIGKILL" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
        local rc=0
        wait "$pid" 2>/dev/null || rc=$?
        [ "$rc" = 0 ] || echo "# pid $pid exited with status $rc" >&2
        pid=
    fi
    if mountpoint -q "$mnt"; then umount "$mnt" 2>/dev/null || umount -l "$mnt"; fi
}
cleanup() {
    stop
    if mountpoint -q "$tmp"; then umount "$tmp" 2>/dev/null || umount -l "$tmp"; fi
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
mkdir -p "$mnt" "$tmp"

# The reference: the same bytes on a tmpfs (byte i is i % 251 + 1, as the two binaries make).
mount -t tmpfs -o size=$((mib + 16))m tmpfs "$tmp"
python3 - "$tmp/data" "$size" <<'EOF'
import sys
path, size = sys.argv[1], int(sys.argv[2])
block = bytes(i % 251 + 1 for i in range(251 * 4096))  # whole periods: each block starts at i % 251 == 0
with open(path, "wb") as f:
    for off in range(0, size, len(block)):
        f.write(block[: size - off])
EOF

# start NAME BINARY [ARGS...]: mounts at $mnt and waits (30 s at most) for its `mounted`.
start() {
    "$bin/$2" "$mnt" "$size" "${@:3}" > "$work/$1.out" 2> "$work/$1.err" &
    pid=$!
    for _ in $(seq 300); do
        grep -qx mounted "$work/$1.out" && mountpoint -q "$mnt" && return 0
        alive "$pid" || break
        sleep 0.1
    done
    echo "$1: not mounted within 30 s" >&2
    cat "$work/$1.err" >&2
    exit 1
}

# rate FILE [DD_FLAGS...]: GB/s (10^9 bytes/s) of one dd reading FILE whole, from dd's own
# byte count and seconds (its last line: "N bytes (...) copied, S s, R GB/s").
rate() {
    local line bytes secs
    line=$(LC_ALL=C timeout -k 5 "$dd_timeout" dd if="$1" of=/dev/null bs=1M "${@:2}" 2>&1 | tail -1) || true
    bytes=${line%% bytes*}
    secs=$(sed -n 's/.* copied, \([0-9.e+-]*\) s,.*/\1/p' <<< "$line")
    [ "$bytes" = "$size" ] && [ -n "$secs" ] || { echo "dd of $1: $line" >&2; exit 1; }
    awk -v b="$bytes" -v s="$secs" 'BEGIN { printf "%.2f", b / s / 1e9 }'
}
median() { sort -n | awk '{ v[NR] = $1 } END { printf "%.2f", (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }

echo "# $(date -u '+%F %H:%M') UTC, $(nproc) cores, $(uname -r), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# $mib MiB read by dd bs=1M, $runs runs per candidate; GB/s = 10^9 bytes/s"
candidates=(fuser-1-thread fuser-4-threads fuse3-2-workers tmpfs)
declare -A medians all
for c in "${candidates[@]}"; do
    case $c in
        fuser-1-thread) start "$c" with_fuser --threads 1 ;;
        fuser-4-threads) start "$c" with_fuser --threads 4 ;;
        fuse3-2-workers) start "$c" with_fuse3 --threads 2 ;;
    esac
    if [ "$c" = tmpfs ]; then
        file=$tmp/data flags=()
    else
        file=$mnt/data flags=(iflag=direct)
        timeout -k 5 "$dd_timeout" dd if="$file" bs=1M iflag=direct status=none | cmp - "$tmp/data" ||
            { echo "$c: its data differs from the reference" >&2; exit 1; }
    fi
    : > "$work/$c.runs"
    for r in $(seq "$runs"); do
        v=$(rate "$file" "${flags[@]}")
        echo "$c run $r: $v GB/s"
        echo "$v" >> "$work/$c.runs"
    done
    stop
    medians[$c]=$(median < "$work/$c.runs")
    all[$c]=$(paste -sd' ' "$work/$c.runs")
    echo "$c median: ${medians[$c]} GB/s"
done

echo "# candidate: median GB/s (every run)"
for c in "${candidates[@]}"; do
    printf '%-16s %6s  (%s)\n' "$c" "${medians[$c]}" "${all[$c]}"
done
