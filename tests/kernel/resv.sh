#!/usr/bin/env bash
# Reservations from the Linux kernel's NVMe/TCP initiator, driven by nvme-cli.
#
# Boots Debian's kernel in qemu as tests/kernel/run.sh does (busybox initramfs, nvme-cli,
# user-mode networking to a nearstore target on the host's loopback). The guest connects
# to one subsystem as two hosts (two host NQNs and Host IDs, so two controllers) and, with
# nvme-cli's resv-* verbs on each controller's device, registers both, lets host A take a
# Write Exclusive reservation, checks nvme resv-report (and nearstore resv-report from the
# guest, which lists the kernel's Host IDs), checks that host B's Acquire and Write get
# Reservation Conflict while its Read goes through, lets B preempt and abort A into
# Exclusive Access, checks that A's Read now conflicts, and clears. Each step is reported.
#
# The two controllers share the namespace's multipath node, which would send a command
# down either path (either host); so the reservation commands go to each controller's
# character device (/dev/nvmeN with --namespace-id=1), which the kernel runs on that
# controller's own queues.
#
# Usage: tests/kernel/resv.sh [path/to/nearstore]   (default: target/release/nearstore)
# Everything comes from Debian packages; missing ones are installed when running as root.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=${1:-$root/target/release/nearstore}
work=$(mktemp -d /tmp/nearstore-resv.XXXXXX)
target_pid=
cleanup() {
    if [ -n "$target_pid" ]; then kill "$target_pid" 2>/dev/null || true; wait "$target_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

fail() { echo "kernel reservations test: FAIL: $*" >&2; exit 1; }

. "$here/lib.sh"
guest_prereqs
if ! command -v nvme >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends --no-upgrade nvme-cli >/dev/null
    else
        fail "missing prerequisite: nvme-cli (apt-get install nvme-cli)"
    fi
fi
[ -x "$bin" ] || fail "nearstore binary not found at $bin (cargo build --release first)"

# --- initramfs ---
ird=$work/initramfs
initramfs_busybox "$ird" sh mount mkdir cat echo sleep ip insmod ls dd poweroff grep seq head sed basename tr
mkdir -p "$ird/etc/nvme"
initramfs_binary "$ird" "$(command -v nvme)"
initramfs_binary "$ird" "$bin" nearstore
initramfs_modules "$ird" e1000 nvme-tcp

nqn=nqn.2026-11.io.nearstore:resv
io_port=$(free_port)
id_a=6b1e3a2c-2f0e-4d6a-9f3c-00000000000a
id_b=6b1e3a2c-2f0e-4d6a-9f3c-00000000000b
cat > "$ird/init" <<INIT
#!/bin/sh
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in \$(cat /modules.list); do insmod /lib/modules/\$m.ko 2>/dev/null; done
ip link set lo up; ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0; ip route add default via 10.0.2.2
A=nqn.2014-08.org.nvmexpress:uuid:$id_a
B=nqn.2014-08.org.nvmexpress:uuid:$id_b
step() { name=\$1; shift; if out=\$("\$@" 2>&1); then echo "STEP \$name: OK"; echo "\$out" | head -40 | sed 's/^/  | /'; else echo "STEP \$name: FAIL"; echo "\$out" | head -40 | sed 's/^/  | /'; poweroff -f; fi; }
# The controller (nvmeN) the host NQN \$1 has on the subsystem.
ctrl_of() { for c in /sys/class/nvme/nvme*; do [ "\$(cat \$c/hostnqn 2>/dev/null)" = "\$1" ] && [ "\$(cat \$c/subsysnqn 2>/dev/null)" = "$nqn" ] && { basename \$c; return 0; }; done; return 1; }
wait_ctrl() { for i in \$(seq 1 100); do ctrl_of \$1 && [ -e /dev/\$(ctrl_of \$1) ] && return 0; sleep 0.1; done; return 1; }
connect() { echo "transport=tcp,traddr=10.0.2.2,trsvcid=$io_port,nqn=$nqn,hostnqn=\$1,hostid=\$2" > /dev/nvme-fabrics && wait_ctrl \$1; }
# Connects as host NQN \$1 with Host ID \$2 through the kernel's fabrics device: nvme-cli
# 2.3 refuses a second host's connect to the same port as "already connected" (the kernel
# tells the two apart by host NQN and Host ID).
# rv HOST VERB OPTIONS...: nvme-cli's VERB on that host's controller, namespace 1.
rv() { who=\$1; verb=\$2; shift 2; nvme \$verb /dev/\$(ctrl_of \$who) --namespace-id=1 "\$@"; }
# conflicts COMMAND...: fails, saying Reservation Conflict.
conflicts() { if out=\$("\$@" 2>&1); then echo "\$out"; echo "expected a Reservation Conflict"; return 1; fi; echo "\$out"; echo "\$out" | grep -qi "reservation conflict"; }
# report_is HOST RTYPE REGCTL [TEXT...]: nvme resv-report (extended) says so, and holds each TEXT.
report_is() { who=\$1 t=\$2 n=\$3; shift 3; out=\$(rv \$who resv-report --eds -o json) || return 1; echo "\$out"; j=\$(echo "\$out" | tr -d ' \n');
  echo "\$j" | grep -q "\"rtype\":\$t," && echo "\$j" | grep -q "\"regctl\":\$n," || return 1; for x in "\$@"; do echo "\$j" | grep -q "\$x" || { echo "missing \$x"; return 1; }; done; }
dd if=/dev/urandom of=/tmp/blk bs=512 count=1 2>/dev/null
io() { rv \$1 \$2 --start-block=0 --block-count=0 --data-size=512 --data=\$3; }
step connect-a connect \$A $id_a
step connect-b connect \$B $id_b
step two-controllers sh -c "ls /sys/class/nvme; cat /sys/class/nvme/nvme*/hostnqn"
step register-a rv \$A resv-register --nrkey=0xa1 --rrega=0
step register-b rv \$B resv-register --nrkey=0xb2 --rrega=0
step acquire-a rv \$A resv-acquire --crkey=0xa1 --rtype=1 --racqa=0
step report-a-holds report_is \$B 1 2 '"rkey":161' '"rkey":178' '"rcsts":1'
step acquire-b-conflicts conflicts rv \$B resv-acquire --crkey=0xb2 --rtype=1 --racqa=0
step write-b-conflicts conflicts io \$B write /tmp/blk
step read-b-allowed io \$B read /tmp/rd
step write-a-allowed io \$A write /tmp/blk
step nearstore-report-lists-the-kernel-hosts sh -c "nearstore resv-report --traddr 10.0.2.2 -s $io_port --nqn $nqn -o json > /tmp/r && cat /tmp/r && grep -q $(echo $id_a | tr -d -) /tmp/r && grep -q $(echo $id_b | tr -d -) /tmp/r"
step preempt-abort-b rv \$B resv-acquire --crkey=0xb2 --prkey=0xa1 --rtype=2 --racqa=2
step read-a-conflicts conflicts io \$A read /tmp/rd
step report-b-holds report_is \$A 2 1 '"rkey":178'
step release-wrong-key-conflicts conflicts rv \$A resv-release --crkey=0xa1 --rtype=2 --rrela=0
step clear-b rv \$B resv-release --crkey=0xb2 --rrela=1
step report-cleared report_is \$A 0 0
step read-a-again io \$A read /tmp/rd
step disconnect nvme disconnect -n $nqn
echo RESV-TEST-COMPLETE
poweroff -f
INIT
chmod +x "$ird/init"
initramfs_pack "$ird" "$work/initrd.gz"

# --- target ---
RUST_LOG=${RUST_LOG:-info} "$bin" target --listen 127.0.0.1:$io_port --discovery none --memory 64MiB --nqn $nqn \
    > "$work/target.out" 2> "$work/target.log" &
target_pid=$!
for _ in $(seq 1 50); do grep -q "listening on 127.0.0.1:$io_port" "$work/target.out" 2>/dev/null && break; sleep 0.1; done
grep -q "listening on" "$work/target.out" || { cat "$work/target.log"; fail "target did not start"; }

boot_guest "$kernel" "$work/initrd.gz" "$work" 300 512 RESV-TEST-COMPLETE
echo "kernel reservations: 1 passed, 0 failed"
