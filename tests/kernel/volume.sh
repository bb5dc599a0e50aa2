#!/usr/bin/env bash
# The Linux kernel initiator on an exported volume whose extents lie on three targets.
#
# On the host: a control plane and three targets with a pool each (members of one cluster,
# trusting one another), a volume of 64 MiB in extents of 1 MiB, exported by the first
# target to the guest's host NQN. In qemu (tests/kernel/lib.sh): the guest discovers the
# volume, connects, makes ext4 on it, mounts it, writes files, unmounts, disconnects,
# connects again, remounts and verifies the files' checksums. Then `nearstore mount` (FUSE)
# over the ext4: a result path of a file whose extents lie on several targets
# (.nearstore/sha256/FILE) must equal `nearstore checksum -a sha256 --offload-only` and busybox
# sha256sum of the file, computed on the targets (the mount logs no fallback), and so must
# the reads of a descriptor of the file with sha256 attached (`nearstore attach`: the ioctl,
# then the attribute). The host then
# checks that the volume's allocated extents lie on all three targets, and the file's on at
# least two (debugfs in the guest lists its blocks).
#
# Usage: tests/kernel/volume.sh [path/to/nearstore]   (default: target/release/nearstore)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=${1:-$root/target/release/nearstore}
work=$(mktemp -d /tmp/nearstore-volume.XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT

fail() { echo "kernel volume test: FAIL: $*" >&2; exit 1; }

. "$here/lib.sh"
guest_prereqs
command -v nvme >/dev/null || fail "missing prerequisite: nvme-cli (apt-get install nvme-cli)"
[ -x "$bin" ] || fail "nearstore binary not found at $bin (cargo build --release first)"
moddir=/lib/modules/$kver

# --- initramfs ---
ird=$work/initramfs
initramfs_busybox "$ird" sh mount umount mkdir cat echo sleep md5sum ip insmod ls dd sync poweroff grep seq head sed wc test sha256sum awk sort tr kill
mkdir -p "$ird/etc/nvme"
initramfs_binary "$ird" "$(command -v nvme)"
initramfs_binary "$ird" "$(command -v mke2fs)"
initramfs_binary "$ird" "$(command -v debugfs)"
initramfs_binary "$ird" "$bin" nearstore
cp /etc/mke2fs.conf "$ird/etc/"
initramfs_modules "$ird" e1000 crc32c_generic nvme-tcp ext4 fuse

hostnqn=nqn.2014-08.org.nvmexpress:uuid:6b1e3a2c-2f0e-4d6a-9f3c-000000000043
nqn=nqn.2026-11.io.nearstore:volume:kvol
cat > "$ird/init" <<INIT
#!/bin/sh
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in \$(cat /modules.list); do insmod /lib/modules/\$m.ko 2>/dev/null; done
echo $hostnqn > /etc/nvme/hostnqn
echo 6b1e3a2c-2f0e-4d6a-9f3c-000000000043 > /etc/nvme/hostid
ip link set lo up; ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0; ip route add default via 10.0.2.2
step() { name=\$1; shift; if out=\$("\$@" 2>&1); then echo "STEP \$name: OK"; echo "\$out" | head -40 | sed 's/^/  | /'; else echo "STEP \$name: FAIL"; echo "\$out" | head -40 | sed 's/^/  | /'; poweroff -f; fi; }
dev() { ls /dev/nvme[0-9]*n1 2>/dev/null | head -1; }
wait_dev() { for i in \$(seq 1 100); do [ -n "\$(dev)" ] && dev && return 0; sleep 0.1; done; return 1; }
gone_dev() { for i in \$(seq 1 100); do [ -z "\$(dev)" ] && return 0; sleep 0.1; done; return 1; }
step discover sh -c 'nvme discover -t tcp -a 10.0.2.2 -s 8009 | tee /tmp/disc && grep -q "subnqn: *$nqn" /tmp/disc'
step connect nvme connect -t tcp -a 10.0.2.2 -s 4420 -n $nqn
step device-appears wait_dev
step id-ns sh -c 'nvme id-ns \$(ls /dev/nvme[0-9]*n1 | head -1) | grep -E "^(nsze|ncap|lbaf)"'
step mkfs sh -c '/bin/mke2fs -t ext4 -q -F \$(ls /dev/nvme[0-9]*n1 | head -1)'
step mount sh -c 'mount -t ext4 \$(ls /dev/nvme[0-9]*n1 | head -1) /mnt'
step write-files sh -c 'echo hello from a volume > /mnt/hello.txt && dd if=/dev/urandom of=/mnt/random.bin bs=1M count=24 2>/dev/null && mkdir /mnt/dir && for i in \$(seq 1 50); do echo file \$i > /mnt/dir/f\$i; done && sync'
step checksums sh -c 'md5sum /mnt/hello.txt /mnt/random.bin > /tmp/sums && cat /tmp/sums'
step umount umount /mnt
step disconnect nvme disconnect -n $nqn
step device-gone gone_dev
step connect-again nvme connect -t tcp -a 10.0.2.2 -s 4420 -n $nqn
step device-appears-again wait_dev
step remount sh -c 'mount -t ext4 \$(ls /dev/nvme[0-9]*n1 | head -1) /mnt'
step verify md5sum -c /tmp/sums
step verify-dir sh -c 'test \$(ls /mnt/dir | wc -l) = 50 && cat /mnt/dir/f50'
# The 1 MiB volume extents holding random.bin's blocks (the host maps them to targets).
file_extents() {
    d=\$(dev); bs=\$(debugfs -R stats \$d 2>/dev/null | sed -n 's/^Block size: *//p')
    test -n "\$bs" || return 1
    echo "FILE-EXTENTS: \$(debugfs -R 'blocks /random.bin' \$d 2>/dev/null | awk -v bs=\$bs '{ for (i = 1; i <= NF; i++) print int(\$i * bs / 1048576) }' | sort -un | tr '\\n' ' ')"
}
step file-extents file_extents
step fuse-mount sh -c 'mkdir -p /view && (RUST_LOG=info nearstore mount /mnt /view > /tmp/mount.log 2>&1 & echo \$! > /tmp/mount.pid) && for i in \$(seq 1 300); do grep -q " /view fuse" /proc/mounts && exit 0; sleep 0.1; done; cat /tmp/mount.log; exit 1'
step fuse-sha256 sh -c 'cat /view/.nearstore/sha256/random.bin | tee /tmp/fuse.sum && test -s /tmp/fuse.sum'
step cli-sha256 sh -c 'nearstore checksum -a sha256 --offload-only /mnt/random.bin | tee /tmp/cli.sum'
step sha256-equal sh -c 'sha256sum /mnt/random.bin | tee /tmp/bb.sum && f=\$(awk "{print \\\$1}" /tmp/fuse.sum) && c=\$(awk "{print \\\$1}" /tmp/cli.sum) && b=\$(awk "{print \\\$1}" /tmp/bb.sum) && echo "mount \$f cli \$c busybox \$b" && test -n "\$b" && test "\$f" = "\$b" && test "\$c" = "\$b"'
# An operation attached to an O_DIRECT descriptor of the volume's file: through the ioctl,
# then through the attribute (nearstore attach, the guest having no Python or setfattr).
step fuse-attach-ioctl sh -c 'nearstore attach /view/random.bin sha256 > /tmp/att.sum 2> /tmp/att.err; cat /tmp/att.sum /tmp/att.err; test "\$(awk "{print \\\$1}" /tmp/att.sum)" = "\$(awk "{print \\\$1}" /tmp/bb.sum)" && grep -q "computed on the target" /tmp/att.err'
step fuse-attach-xattr sh -c 'nearstore attach --xattr /view/random.bin sha256 > /tmp/attx.sum 2> /tmp/attx.err; cat /tmp/attx.sum /tmp/attx.err; test "\$(awk "{print \\\$1}" /tmp/attx.sum)" = "\$(awk "{print \\\$1}" /tmp/bb.sum)" && grep -q "computed on the target" /tmp/attx.err'
step fuse-offloaded sh -c 'cat /tmp/mount.log; ! grep -q "not offloaded" /tmp/mount.log'
# The mount, orphaned, is a zombie of this init once it exits: gone or State Z.
step fuse-umount sh -c 'umount /view && p=\$(cat /tmp/mount.pid) && for i in \$(seq 1 100); do if [ ! -e /proc/\$p ] || grep -q "^State:.*Z" /proc/\$p/status; then grep "unmounted" /tmp/mount.log; exit; fi; sleep 0.1; done; echo "the mount did not exit"; cat /tmp/mount.log; exit 1'
step umount-again umount /mnt
step disconnect-again nvme disconnect -n $nqn
echo KERNEL-TEST-COMPLETE
poweroff -f
INIT
chmod +x "$ird/init"

# --- control plane and targets ---
cp_port=$(free_port)
control=127.0.0.1:$cp_port
"$bin" control --store "$work/store" --listen "$control" > "$work/control.out" 2> "$work/control.log" &
pids+=($!)
for _ in $(seq 1 50); do grep -q "listening on" "$work/control.out" 2>/dev/null && break; sleep 0.1; done
grep -q "listening on" "$work/control.out" || { cat "$work/control.log"; fail "the control plane did not start"; }

members='"nqn.2026-11.io.nearstore:kmember0", "nqn.2026-11.io.nearstore:kmember1", "nqn.2026-11.io.nearstore:kmember2"'
io_port=$(free_port)
disc_port=$(free_port)
addrs=()
for i in 0 1 2; do
    if [ $i = 0 ]; then
        # The guest reaches the host's loopback as 10.0.2.2: the exporting target advertises it.
        listen="[[listener]]
address = \"127.0.0.1:$io_port\"
advertise = \"10.0.2.2\"
[[listener]]
address = \"127.0.0.1:$disc_port\"
discovery = true
advertise = \"10.0.2.2\""
        addrs+=("10.0.2.2:$io_port")
    else
        port=$(free_port)
        listen="[[listener]]
address = \"127.0.0.1:$port\""
        addrs+=("127.0.0.1:$port")
    fi
    cat > "$work/t$i.toml" <<TOML
$listen
[[subsystem]]
nqn = "nqn.2026-11.io.nearstore:kt$i"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
memory = "1MiB"
[cluster]
host_nqn = "nqn.2026-11.io.nearstore:kmember$i"
trusted_members = [$members]
TOML
    RUST_LOG=${RUST_LOG:-info} "$bin" target --config "$work/t$i.toml" --control "$control" --pool "$work/pool$i:128MiB" \
        > "$work/t$i.out" 2> "$work/t$i.log" &
    pids+=($!)
done
for i in 0 1 2; do
    for _ in $(seq 1 50); do grep -q "listening on" "$work/t$i.out" 2>/dev/null && break; sleep 0.1; done
    grep -q "listening on" "$work/t$i.out" || { cat "$work/t$i.log"; fail "target $i did not start"; }
done
cp "$work/t0.log" "$work/target.log" 2>/dev/null || true
for _ in $(seq 1 100); do
    [ "$("$bin" view --control "$control" -o json | grep -c '"seq"')" -ge 3 ] && break
    sleep 0.1
done
"$bin" volume create kvol --size 64MiB --extent-size 1MiB --control "$control" >/dev/null
"$bin" volume export kvol --target "${addrs[0]}" --allow-host "$hostnqn" --control "$control"

sed -i "s/-s 4420/-s $io_port/g; s/-s 8009/-s $disc_port/g" "$ird/init"
initramfs_pack "$ird" "$work/initrd.gz"
boot_guest "$kernel" "$work/initrd.gz" "$work" 600 1024 KERNEL-TEST-COMPLETE

holders=$("$bin" volume info kvol --control "$control" -o json | grep -o '"target": *"[^"]*"' | sort -u | wc -l)
[ "$holders" -ge 3 ] || fail "the volume's extents lie on $holders targets, not 3"
file_extents=$(grep -o 'FILE-EXTENTS:.*' "$work/guest.log" | head -1 | sed 's/^FILE-EXTENTS://; s/\r//g')
[ -n "${file_extents// /}" ] || fail "the guest listed no extents of random.bin"
file_targets=$("$bin" volume info kvol --control "$control" -o json | python3 -c '
import json, sys
want = {int(x) for x in sys.argv[1].split()}
def walk(v):
    if isinstance(v, dict):
        if "index" in v and "target" in v:
            yield v
        for x in v.values():
            yield from walk(x)
    elif isinstance(v, list):
        for x in v:
            yield from walk(x)
print(len({e["target"] for e in walk(json.load(sys.stdin)) if e["index"] in want}))
' "$file_extents")
[ "$file_targets" -ge 2 ] || fail "random.bin's extents ($file_extents) lie on $file_targets target(s), not several"
echo "host: random.bin (checksummed through the mount) lies on $file_targets targets"
allocated=$("$bin" volume info kvol --control "$control" -o json | grep -o '"extents_allocated": *[0-9]*' | grep -o '[0-9]*$')
echo "host: the volume has $allocated of 64 extents allocated, on $holders targets"
"$bin" volume unexport kvol --control "$control" >/dev/null
echo "kernel volume: 1 passed, 0 failed"
