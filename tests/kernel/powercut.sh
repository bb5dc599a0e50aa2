#!/usr/bin/env bash
# Power loss: every write acknowledged durable survives a cut; the rest may be lost.
#
# The target runs in a qemu guest; the writer and checker (crates/powercut) runs on the
# host and talks to it through user-mode networking forwarded to the host's loopback.
# Each boot checks every block against what the last cut may have left, then writes
# stamped blocks (FUA writes, plain writes, fused writes through the namespace's MicroTx
# journal, Flushes) until the script kills qemu with SIGKILL at a seeded random time: that
# is the cut. One boot per cut, all on one disk. A fused write in flight at a cut must be
# whole or absent, as the outcome the target gives for it after the reboot says.
#
# What a cut loses, and why this setup: killing qemu loses the guest's page cache and
# whatever qemu had not yet written to its disk image; what reached the image survives
# (the host's page cache outlives qemu). So the target in the guest exports a *file* on
# an ext4 file system on the virtio disk: the file backend writes through the guest's
# page cache (no O_DIRECT) and only fdatasync (Flush, FUA) pushes writes to the disk, so
# a Flush that did nothing would lose writes here. A block-device namespace (/dev/vda)
# would not do: the backend opens it with O_DIRECT, each write goes straight to qemu
# and on to the image, and a cut could not tell a working Flush from a no-op. The disk
# is cache=none: qemu keeps no cache of its own, so what the guest flushed is in the
# image. The file starts sparse, so writes also allocate blocks, and fdatasync must make
# that metadata durable too.
#
# The first boot is a control: plain writes only, then a cut; the next boot requires
# that the cut lost some acknowledged writes, or the test fails (the setup could not
# catch a Flush that does nothing). Boots alternate the target's I/O engines (io_uring,
# worker threads). A last boot checks the last cut.
#
# Usage: tests/kernel/powercut.sh [--cuts N] [--seed S] [--chunk N --lock FILE]
#                                 [--bin path/to/nearstore] [--writer path/to/nearstore-powercut]
#   --cuts N      cuts after the control (default 20)
#   --seed S      seeds the cut times and the writes (default: from the clock; printed)
#   --chunk N --lock FILE
#                 hold flock FILE while qemu runs, N boots at a time (qemu under TCG
#                 takes a core; others may take the lock between chunks)
# Binaries default to target/release/. Needs qemu, static busybox, e2fsprogs, cpio and a
# Debian kernel (installed when root and missing).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cuts=20
seed=$(( $(date +%s%N) % 1000000007 ))
chunk=0
lock=
bin=$root/target/release/nearstore
writer=$root/target/release/nearstore-powercut
while [ $# -gt 0 ]; do
    case "$1" in
        --cuts) cuts=$2; shift 2 ;;
        --seed) seed=$2; shift 2 ;;
        --chunk) chunk=$2; shift 2 ;;
        --lock) lock=$2; shift 2 ;;
        --bin) bin=$2; shift 2 ;;
        --writer) writer=$2; shift 2 ;;
        *) echo "usage: $0 [--cuts N] [--seed S] [--chunk N --lock FILE] [--bin nearstore] [--writer nearstore-powercut]" >&2; exit 2 ;;
    esac
done

fail() { echo "power-cut test: FAIL: $*" >&2; exit 1; }
. "$here/lib.sh"

work=$(mktemp -d "${TMPDIR:-/var/tmp}/nearstore-powercut.XXXXXX")
qemu_pid=
writer_pid=
cleanup() {
    local p
    for p in $writer_pid $qemu_pid; do kill -9 "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT

guest_prereqs
[ -x "$bin" ] || fail "nearstore binary not found at $bin (cargo build --release -p nearstore)"
[ -x "$writer" ] || fail "writer not found at $writer (cargo build --release -p nearstore-powercut)"
[ -z "$lock" ] || [ "$chunk" -gt 0 ] || fail "--lock needs --chunk N"
[ "$cuts" -ge 1 ] || fail "--cuts must be at least 1"
echo "power-cut test: seed $seed, $cuts cuts after a control cut (reproduce: $0 --cuts $cuts --seed $seed)"

# --- initramfs ---
nqn=nqn.2026-11.io.nearstore:powercut
ird=$work/initramfs
initramfs_busybox "$ird" sh mount mkdir cat echo sleep ip insmod grep seq sed poweroff kill tail
initramfs_binary "$ird" "$bin" nearstore
initramfs_modules "$ird" virtio_pci virtio_blk virtio_net crc32c_generic ext4
cat > "$ird/init" <<INIT
#!/bin/sh
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in \$(cat /modules.list); do insmod /lib/modules/\$m.ko 2>/dev/null; done
ip link set lo up; ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0; ip route add default via 10.0.2.2
engine=\$(sed -n 's/.*powercut.engine=\([a-z_]*\).*/\1/p' /proc/cmdline)
for i in \$(seq 1 100); do [ -b /dev/vda ] && break; sleep 0.1; done
# Mounting replays the journal: the file system as the cut left it.
mount -t ext4 /dev/vda /mnt || { echo POWERCUT-GUEST-FAIL mount; poweroff -f; }
RUST_LOG=warn nearstore target --listen 10.0.2.15:4420 --discovery none --nqn $nqn --namespace /mnt/ns.img \\
    --block-size 4096 --microtx --io-engine \$engine --busy-poll-us 0 > /tmp/target.out 2> /dev/console &
pid=\$!
for i in \$(seq 1 600); do grep -q "listening on" /tmp/target.out && break; kill -0 \$pid 2>/dev/null || break; sleep 0.1; done
grep -q "listening on" /tmp/target.out || { echo POWERCUT-GUEST-FAIL target; poweroff -f; }
echo "POWERCUT-TARGET-UP (\$engine)"
wait \$pid
echo "POWERCUT-TARGET-EXITED \$?"
poweroff -f
INIT
chmod +x "$ird/init"
initramfs_pack "$ird" "$work/initrd.gz"

# --- the disk: ext4 holding a sparse 16 MiB namespace file (4096 blocks of 4 KiB) ---
blocks=4096
img=$work/disk.raw
mkdir "$work/stage"
truncate -s $((blocks * 4096)) "$work/stage/ns.img"
truncate -s 128M "$img"
mke2fs -q -t ext4 -d "$work/stage" -F "$img" || fail "mke2fs could not make the disk image"
state=$work/state.json

accel=tcg
if [ -w /dev/kvm ] && [ "${NEARSTORE_QEMU_KVM:-0}" = 1 ]; then accel=kvm; fi

# wait_for FILE PATTERN SECONDS PID: until FILE has PATTERN; fails when PID ends first.
wait_for() {
    local i
    for i in $(seq 1 $(($3 * 10))); do
        grep -q "$2" "$1" 2>/dev/null && return 0
        kill -0 "$4" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}

show_failure() {
    echo "--- writer ---"; cat "$work/writer.out" 2>/dev/null || true
    echo "--- guest console (tail) ---"; tail -30 "$work/guest.log" 2>/dev/null || true
}

# boot N PHASE: one boot of the guest; the writer checks the last cut, then (unless PHASE
# is verify) writes until the cut.
boot() {
    local n=$1 phase=$2 engine port delay_ms=0 start rc
    engine=$([ $((n % 2)) = 0 ] && echo uring || echo threads)
    port=$(free_port)
    start=$(date +%s%N)
    qemu-system-x86_64 -accel $accel -m 512 -smp 1 -nographic -no-reboot \
        -kernel "$kernel" -initrd "$work/initrd.gz" -append "console=ttyS0 loglevel=4 panic=-1 powercut.engine=$engine" \
        -drive file="$img",format=raw,if=virtio,cache=none \
        -netdev user,id=n0,hostfwd=tcp:127.0.0.1:$port-10.0.2.15:4420 -device virtio-net-pci,netdev=n0 \
        > "$work/guest.log" 2>&1 &
    qemu_pid=$!
    wait_for "$work/guest.log" POWERCUT-TARGET-UP 180 $qemu_pid || { show_failure; fail "boot $n: the target in the guest did not start"; }
    RUST_LIB_BACKTRACE=0 "$writer" --addr 127.0.0.1:$port --nqn $nqn --state "$state" --blocks $blocks --seed "$seed" --phase "$phase" \
        > "$work/writer.out" 2>&1 &
    writer_pid=$!
    if [ "$phase" != verify ]; then
        if ! wait_for "$work/writer.out" '^WRITING' 300 $writer_pid; then
            kill -9 $writer_pid 2>/dev/null || true
            wait $writer_pid || true
            writer_pid=
            show_failure
            fail "boot $n: the writer failed or hung before writing (seed $seed)"
        fi
        # A seeded time into the writes: 0.3-4 s (the control 3 s, so that writes completed).
        if [ "$phase" = control ]; then delay_ms=3000; else delay_ms=$((300 + (RANDOM * 32768 + RANDOM) % 3700)); fi
        sleep "$((delay_ms / 1000)).$(printf %03d $((delay_ms % 1000)))"
        kill -0 $writer_pid 2>/dev/null || { wait $writer_pid || true; writer_pid=; show_failure; fail "boot $n: the writer stopped before the cut"; }
        grep -q POWERCUT-TARGET-EXITED "$work/guest.log" && { show_failure; fail "boot $n: the target in the guest exited before the cut"; }
        kill -9 $qemu_pid
        wait $qemu_pid 2>/dev/null || true
        qemu_pid=
    fi
    rc=0
    wait $writer_pid || rc=$?
    writer_pid=
    [ $rc = 0 ] || { show_failure; fail "boot $n ($engine): the writer failed (seed $seed)"; }
    if [ -n "$qemu_pid" ]; then kill -9 $qemu_pid; wait $qemu_pid 2>/dev/null || true; qemu_pid=; fi
    printf 'boot %d (%s, %s, %d s%s):\n' "$n" "$phase" "$engine" $((($(date +%s%N) - start) / 1000000000)) \
        "$([ "$phase" = verify ] || echo ", cut at ${delay_ms} ms")"
    grep -E '^(verify|cut|fused) ' "$work/writer.out" | sed 's/^/  /'
}

RANDOM=$((seed % 32768))
lockfd=
total=$((cuts + 2))
for n in $(seq 0 $((total - 1))); do
    if [ -n "$lock" ] && [ $((n % chunk)) = 0 ]; then exec {lockfd}>"$lock"; flock "$lockfd"; fi
    if [ "$n" = 0 ]; then phase=control; elif [ "$n" = $((total - 1)) ]; then phase=verify; else phase=durable; fi
    boot "$n" $phase
    if [ -n "$lockfd" ] && { [ $(((n + 1) % chunk)) = 0 ] || [ "$n" = $((total - 1)) ]; }; then exec {lockfd}>&-; lockfd=; fi
done
echo "power-cut test: $cuts cuts and a control, seed $seed: no write acknowledged durable was lost"
echo "powercut: 1 passed, 0 failed"
