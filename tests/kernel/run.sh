#!/usr/bin/env bash
# The Linux kernel's NVMe/TCP initiator against a nearstore target.
#
# Boots Debian's kernel in qemu (KVM if it works, else TCG) with a small initramfs
# (busybox, nvme-cli, e2fsprogs, the nvme-tcp and ext4 modules) and user-mode networking.
# The guest discovers, connects, lists, identifies, makes an ext4 file system on the
# namespace, mounts it, writes files, unmounts, disconnects, reconnects with connect-all
# (SQ flow control disabled, so reads complete with the C2HData SUCCESS flag), remounts,
# verifies the files' checksums, runs nearstore's checksum and grep on the mounted files
# through the kernel's NVMe passthrough ioctl (the compute commands on the kernel's own
# connection) and compares them with the same computed locally, and disconnects, reporting
# each step. The host then checks
# the image file holds the same files.
#
# Usage: tests/kernel/run.sh [path/to/nearstore]   (default: target/release/nearstore)
# Everything comes from Debian packages; missing ones are installed when running as root.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=${1:-$root/target/release/nearstore}
work=$(mktemp -d /tmp/nearstore-kernel.XXXXXX)
target_pid=
cleanup() {
    if [ -n "$target_pid" ]; then kill "$target_pid" 2>/dev/null || true; wait "$target_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

fail() { echo "kernel-initiator test: FAIL: $*" >&2; exit 1; }

need_pkgs=()
command -v qemu-system-x86_64 >/dev/null || need_pkgs+=(qemu-system-x86)
[ -x /bin/busybox ] && file -L /bin/busybox 2>/dev/null | grep -q static || [ -x /usr/bin/busybox ] || need_pkgs+=(busybox-static)
command -v nvme >/dev/null || need_pkgs+=(nvme-cli)
command -v mke2fs >/dev/null || need_pkgs+=(e2fsprogs)
command -v cpio >/dev/null || need_pkgs+=(cpio)
command -v debugfs >/dev/null || need_pkgs+=(e2fsprogs)
ls /boot/vmlinuz-* >/dev/null 2>&1 || need_pkgs+=(linux-image-amd64)
if [ ${#need_pkgs[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing for the kernel-initiator test (qemu boots Debian's kernel, nvme-cli in a busybox initramfs): ${need_pkgs[*]}" >&2
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends --no-upgrade "${need_pkgs[@]}" >/dev/null
    else
        fail "missing prerequisites: ${need_pkgs[*]} (install them: apt-get install ${need_pkgs[*]})"
    fi
fi
[ -x "$bin" ] || fail "nearstore binary not found at $bin (cargo build --release first)"

kver=$(ls /boot/vmlinuz-* | sed 's|/boot/vmlinuz-||' | sort -V | tail -1)
kernel=/boot/vmlinuz-$kver
moddir=/lib/modules/$kver
[ -d "$moddir" ] || fail "modules for $kver not found in $moddir"
busybox=$(command -v busybox)
file -L "$busybox" | grep -q static || busybox=/bin/busybox
file -L "$busybox" | grep -q static || fail "busybox is not static: install busybox-static"

# --- initramfs ---
. "$here/lib.sh"
ird=$work/initramfs
initramfs_busybox "$ird" sh mount umount mkdir cat echo sleep md5sum ip insmod ls dd sync poweroff grep seq head sed wc cut test tr cmp
mkdir -p "$ird/etc/nvme"
initramfs_binary "$ird" "$(command -v nvme)"
# nearstore itself, without its debug information, and the libraries it links.
initramfs_binary "$ird" "$bin" nearstore
initramfs_binary "$ird" "$(command -v mke2fs)"
cp /etc/mke2fs.conf "$ird/etc/"
initramfs_modules "$ird" e1000 crc32c_generic nvme-tcp ext4

nqn=nqn.2026-11.io.nearstore:kernel
cat > "$ird/init" <<INIT
#!/bin/sh
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in \$(cat /modules.list); do insmod /lib/modules/\$m.ko 2>/dev/null; done
echo nqn.2014-08.org.nvmexpress:uuid:6b1e3a2c-2f0e-4d6a-9f3c-000000000042 > /etc/nvme/hostnqn
echo 6b1e3a2c-2f0e-4d6a-9f3c-000000000042 > /etc/nvme/hostid
ip link set lo up; ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0; ip route add default via 10.0.2.2
step() { name=\$1; shift; if out=\$("\$@" 2>&1); then echo "STEP \$name: OK"; echo "\$out" | head -40 | sed 's/^/  | /'; else echo "STEP \$name: FAIL"; echo "\$out" | head -40 | sed 's/^/  | /'; poweroff -f; fi; }
dev() { ls /dev/nvme[0-9]*n1 2>/dev/null | head -1; }
wait_dev() { for i in \$(seq 1 100); do [ -n "\$(dev)" ] && dev && return 0; sleep 0.1; done; return 1; }
gone_dev() { for i in \$(seq 1 100); do [ -z "\$(dev)" ] && return 0; sleep 0.1; done; return 1; }
step discover nvme discover -t tcp -a 10.0.2.2 -s 8009
step connect nvme connect -t tcp -a 10.0.2.2 -s 4420 -n $nqn
step device-appears wait_dev
step list nvme list
step id-ctrl sh -c 'nvme id-ctrl /dev/nvme0 | grep -E "^(sn|mn|fr|cntlid|subnqn|ioccsz|mdts|oncs|vwc) "'
step id-ns sh -c 'nvme id-ns /dev/nvme0n1 | grep -E "^(nsze|ncap|nguid|lbaf)"'
step mkfs /bin/mke2fs -t ext4 -q -F /dev/nvme0n1
step mount mount -t ext4 /dev/nvme0n1 /mnt
step write-files sh -c 'echo hello from the kernel initiator > /mnt/hello.txt && dd if=/dev/urandom of=/mnt/random.bin bs=1M count=24 2>/dev/null && mkdir /mnt/dir && for i in \$(seq 1 50); do echo file \$i > /mnt/dir/f\$i; done && sync'
step checksums sh -c 'md5sum /mnt/hello.txt /mnt/random.bin > /tmp/sums && cat /tmp/sums'
files='/mnt/random.bin /mnt/hello.txt /mnt/dir/f1 /mnt/dir/f50'
step offload-checksum sh -c "nearstore checksum -a sha256 --stats \$files > /tmp/off 2> /tmp/stats; cat /tmp/off /tmp/stats; grep -q 'offloaded through the kernel.s NVMe/TCP connection on /dev/nvme0n1' /tmp/stats && grep -q '(4 offloaded' /tmp/stats"
step local-checksum sh -c "nearstore checksum -a sha256 --local \$files > /tmp/loc; cat /tmp/loc"
step offloaded-equals-local cmp /tmp/off /tmp/loc
step offload-grep sh -c "nearstore grep -c file --stats /mnt/dir/f1 /mnt/dir/f2 /mnt/hello.txt > /tmp/goff 2> /tmp/gstats && nearstore grep -c file --local /mnt/dir/f1 /mnt/dir/f2 /mnt/hello.txt > /tmp/gloc && cat /tmp/goff /tmp/gstats && cmp /tmp/goff /tmp/gloc && grep -q 'through the kernel' /tmp/gstats"
step offload-select sh -c "printf 'city,n\\nOslo,3\\nLima,4\\nOslo,5\\n' > /mnt/t.csv && sync && nearstore select --stats 'SELECT city, SUM(n) FROM s3object GROUP BY city' /mnt/t.csv > /tmp/soff 2> /tmp/sstats && nearstore select --local 'SELECT city, SUM(n) FROM s3object GROUP BY city' /mnt/t.csv > /tmp/sloc && cat /tmp/soff && cmp /tmp/soff /tmp/sloc && grep -q 'through the kernel' /tmp/sstats"
step refusal-through-kernel sh -c "if nearstore select 'SELECT nope FROM s3object' /mnt/t.csv 2> /tmp/serr; then exit 1; fi; cat /tmp/serr; grep -q 'no column .nope. in the header (city, n)' /tmp/serr"
step umount umount /mnt
step disconnect nvme disconnect -n $nqn
step device-gone gone_dev
step connect-all nvme connect-all -v -t tcp -a 10.0.2.2 -s 8009
step device-appears-again wait_dev
step remount sh -c 'mount -t ext4 \$(ls /dev/nvme[0-9]*n1 | head -1) /mnt'
step verify md5sum -c /tmp/sums
step verify-dir sh -c 'test \$(ls /mnt/dir | wc -l) = 50 && cat /mnt/dir/f50'
step umount-again umount /mnt
step disconnect-again nvme disconnect -n $nqn
echo KERNEL-TEST-COMPLETE
poweroff -f
INIT
chmod +x "$ird/init"

# --- target ---
img=$work/disk.img
# The guest reaches the host's loopback as 10.0.2.2; pick two free loopback ports.
read -r io_port disc_port < <(python3 -c 'import socket
s=[socket.socket() for _ in range(2)]
[x.bind(("127.0.0.1",0)) for x in s]
print(*[x.getsockname()[1] for x in s])')
sed -i "s/-s 4420/-s $io_port/; s/-s 8009/-s $disc_port/g" "$ird/init"
initramfs_pack "$ird" "$work/initrd.gz"
rm -f "$img"
RUST_LOG=${RUST_LOG:-info} "$bin" target --listen 127.0.0.1:$io_port --discovery 127.0.0.1:$disc_port --advertise 10.0.2.2 \
    --namespace "$img" --size 256MiB --nqn $nqn > "$work/target.out" 2> "$work/target.log" &
target_pid=$!
for _ in $(seq 1 50); do grep -q "listening on 127.0.0.1:$disc_port" "$work/target.out" 2>/dev/null && break; sleep 0.1; done
grep -q "listening on" "$work/target.out" || { cat "$work/target.log"; fail "target did not start"; }

boot_guest "$kernel" "$work/initrd.gz" "$work" 600 1024 KERNEL-TEST-COMPLETE

# The target's image file is the same ext4: read a file back on the host.
kill "$target_pid" 2>/dev/null || true; wait "$target_pid" 2>/dev/null || true; target_pid=
got=$(debugfs -R "cat /hello.txt" "$img" 2>/dev/null)
[ "$got" = "hello from the kernel initiator" ] || fail "image file does not hold hello.txt (got '$got')"
echo "host: the image file holds the guest's ext4 and hello.txt"
if grep -E " (WARN|ERROR) " "$work/target.log" | grep -v "keep-alive" | head -5 | grep -q .; then
    echo "--- target warnings ---"; grep -E " (WARN|ERROR) " "$work/target.log" | head -10
fi
echo "kernel: 1 passed, 0 failed"
