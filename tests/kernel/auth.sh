#!/usr/bin/env bash
# In-band authentication (DH-HMAC-CHAP) from the Linux kernel's NVMe/TCP initiator.
#
# Debian bookworm's 6.1 kernel is built without CONFIG_NVME_AUTH; trixie's has it. So this
# test takes trixie's kernel package from the Debian archive the host already uses (an apt
# configuration of its own, in the cache directory, used only to download that one package:
# the host's apt lists and packages are left alone), unpacks the kernel and its modules there
# once (NEARSTORE_KERNEL_CACHE, default /var/cache/nearstore-kernel), and boots it in qemu as
# tests/kernel/run.sh boots bookworm's (busybox initramfs, nvme-cli, user-mode networking to a
# nearstore target on the host's loopback). The guest, with nvme-cli's `nvme connect`:
# connects with --dhchap-secret in the null group and in ffdhe3072, writes and reads back a
# block each time; is refused with a wrong secret and with no secret; connects bidirectionally
# with --dhchap-ctrl-secret and does I/O; is refused when the target cannot prove the
# controller secret it is given. Each step is reported.
#
# Usage: tests/kernel/auth.sh [path/to/nearstore]   (default: target/release/nearstore)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=${1:-$root/target/release/nearstore}
cache=${NEARSTORE_KERNEL_CACHE:-/var/cache/nearstore-kernel}
work=$(mktemp -d /tmp/nearstore-auth.XXXXXX)
target_pid=
cleanup() {
    if [ -n "$target_pid" ]; then kill "$target_pid" 2>/dev/null || true; wait "$target_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

fail() { echo "kernel authentication test: FAIL: $*" >&2; exit 1; }

. "$here/lib.sh"
guest_prereqs
command -v nvme >/dev/null || fail "missing prerequisite: nvme-cli (apt-get install nvme-cli)"
command -v depmod >/dev/null || fail "missing prerequisite: kmod (depmod)"
[ -x "$bin" ] || fail "nearstore binary not found at $bin (cargo build --release first)"

# The archive the host's own apt uses (its first Debian source), for the suite trixie.
host_mirror() {
    { cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null || true; } |
        awk '/^URIs:/ || /^deb / { for (i = 2; i <= NF; i++) if ($i ~ /\/debian$/) { print $i; exit } }'
}

# Sets kernel, kver and modroot to trixie's kernel, downloaded and unpacked once into $cache.
trixie_kernel() {
    if ! ls "$cache"/boot/vmlinuz-* >/dev/null 2>&1; then
        local apt=$cache/apt mirror pkg
        mirror=$(host_mirror)
        [ -n "$mirror" ] || fail "no Debian archive in the host's apt sources to take trixie's kernel from"
        mkdir -p "$apt/lists/partial" "$apt/archives/partial" "$apt/etc/preferences.d"
        echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" > "$apt/sources.list"
        local o=(-o Dir::Etc::SourceList="$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
            -o Dir::Etc::Preferences="$apt/etc/preferences" -o Dir::Etc::PreferencesParts="$apt/etc/preferences.d"
            -o Dir::State::Lists="$apt/lists" -o Dir::Cache::Archives="$apt/archives"
            -o Dir::Cache::pkgcache="$apt/pkgcache.bin" -o Dir::Cache::srcpkgcache="$apt/srcpkgcache.bin")
        echo "downloading trixie's kernel package list from $mirror (into $apt, apart from the host's)"
        apt-get "${o[@]}" update -qq >"$work/apt.log" 2>&1 || { cat "$work/apt.log"; fail "apt-get update of trixie's list failed"; }
        pkg=$(apt-cache "${o[@]}" depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
        [ -n "$pkg" ] || fail "trixie's linux-image-amd64 depends on no kernel package"
        echo "downloading $pkg"
        (cd "$work" && apt-get "${o[@]}" download "$pkg" >"$work/apt.log" 2>&1) || { cat "$work/apt.log"; fail "downloading $pkg failed"; }
        dpkg-deb -x "$work"/"${pkg}"_*.deb "$cache"
    fi
    kver=$(ls "$cache"/boot/vmlinuz-* | sed 's|.*/vmlinuz-||' | sort -V | tail -1)
    kernel=$cache/boot/vmlinuz-$kver
    # A merged-/usr package has its modules in usr/lib/modules; modinfo looks in lib/modules.
    if [ ! -d "$cache/lib/modules/$kver" ] && [ -d "$cache/usr/lib/modules/$kver" ]; then
        mkdir -p "$cache/lib/modules" && ln -sfn "$cache/usr/lib/modules/$kver" "$cache/lib/modules/$kver"
    fi
    [ -d "$cache/lib/modules/$kver" ] || fail "trixie's package holds no modules for $kver"
    [ -f "$cache/lib/modules/$kver/modules.dep" ] || depmod -b "$cache" "$kver"
    grep -q '^CONFIG_NVME_AUTH=[ym]' "$cache/boot/config-$kver" || fail "kernel $kver is built without CONFIG_NVME_AUTH"
    modroot=$cache
}
trixie_kernel
echo "kernel $kver from trixie"

# --- initramfs ---
ird=$work/initramfs
initramfs_busybox "$ird" sh mount mkdir cat echo sleep ip insmod ls dd poweroff grep seq head sed cmp
mkdir -p "$ird/etc/nvme"
initramfs_binary "$ird" "$(command -v nvme)"
# The crypto the kernel's DH-HMAC-CHAP asks for by name: there is no modprobe in the guest,
# so whichever of them are modules go in too.
extra=()
for m in dh_generic hmac sha256_generic sha512_generic; do
    modinfo -b "$modroot" -k "$kver" -n "$m" >/dev/null 2>&1 && extra+=("$m")
done
initramfs_modules "$ird" e1000 nvme-tcp "${extra[@]}"

nqn=nqn.2026-11.io.nearstore:auth
io_port=$(free_port)
id=6b1e3a2c-2f0e-4d6a-9f3c-0000000000a1
h_null=nqn.2014-08.org.nvmexpress:uuid:$id
h_dh=nqn.2014-08.org.nvmexpress:uuid:6b1e3a2c-2f0e-4d6a-9f3c-0000000000a2
key=$("$bin" gen-dhchap-key)
key_dh=$("$bin" gen-dhchap-key --hmac 1 --nqn "$h_dh")
ctrl_key=$("$bin" gen-dhchap-key --hmac 2 --nqn $nqn)
wrong=$("$bin" gen-dhchap-key)
cat > "$work/target.toml" <<TOML
[[listener]]
address = "127.0.0.1:$io_port"
[[subsystem]]
nqn = "$nqn"
[[subsystem.host]]
nqn = "$h_null"
dhchap_key = "$key"
dhchap_ctrl_key = "$ctrl_key"
[[subsystem.host]]
nqn = "$h_dh"
dhchap_key = "$key_dh"
dhchap_ctrl_key = "$ctrl_key"
dhchap_hash = "sha384"
dhchap_dhgroup = "ffdhe3072"
[[subsystem.namespace]]
nsid = 1
memory = "64MiB"
TOML

cat > "$ird/init" <<INIT
#!/bin/sh
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in \$(cat /modules.list); do insmod /lib/modules/\$m.ko 2>/dev/null; done
ip link set lo up; ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0; ip route add default via 10.0.2.2
step() { name=\$1; shift; if out=\$("\$@" 2>&1); then echo "STEP \$name: OK"; echo "\$out" | head -20 | sed 's/^/  | /'; else echo "STEP \$name: FAIL"; echo "\$out" | head -40 | sed 's/^/  | /'; poweroff -f; fi; }
refused() { if out=\$("\$@" 2>&1); then echo "\$out"; echo "expected a refusal"; nvme disconnect -n $nqn; return 1; fi; echo "\$out"; }
conn() { h=\$1; shift; nvme connect -t tcp -a 10.0.2.2 -s $io_port -n $nqn --hostnqn=\$h --hostid=$id "\$@"; }
# io: a block written through the namespace reads back, then the controller disconnects.
io() { for i in \$(seq 1 50); do [ -b /dev/nvme0n1 ] && break; sleep 0.1; done
  dd if=/dev/urandom of=/tmp/w bs=4096 count=1 2>/dev/null && dd if=/tmp/w of=/dev/nvme0n1 bs=4096 oflag=direct 2>&1 &&
  dd if=/dev/nvme0n1 of=/tmp/r bs=4096 count=1 iflag=direct 2>&1 && cmp /tmp/w /tmp/r; s=\$?; nvme disconnect -n $nqn; return \$s; }
step connect-null-group conn $h_null --dhchap-secret=$key
step io-null-group io
step connect-ffdhe3072 conn $h_dh --dhchap-secret=$key_dh
step io-ffdhe3072 io
step wrong-secret-refused refused conn $h_null --dhchap-secret=$wrong
step no-secret-refused refused conn $h_null
step connect-bidirectional conn $h_dh --dhchap-secret=$key_dh --dhchap-ctrl-secret=$ctrl_key
step io-bidirectional io
step wrong-ctrl-secret-refused refused conn $h_null --dhchap-secret=$key --dhchap-ctrl-secret=$wrong
step connect-after-refusals conn $h_null --dhchap-secret=$key --dhchap-ctrl-secret=$ctrl_key
step io-after-refusals io
echo AUTH-TEST-COMPLETE
poweroff -f
INIT
chmod +x "$ird/init"
initramfs_pack "$ird" "$work/initrd.gz"

# --- target ---
RUST_LOG=${RUST_LOG:-info} "$bin" target --config "$work/target.toml" > "$work/target.out" 2> "$work/target.log" &
target_pid=$!
for _ in $(seq 1 50); do grep -q "listening on 127.0.0.1:$io_port" "$work/target.out" 2>/dev/null && break; sleep 0.1; done
grep -q "listening on" "$work/target.out" || { cat "$work/target.log"; fail "target did not start"; }

boot_guest "$kernel" "$work/initrd.gz" "$work" 400 512 AUTH-TEST-COMPLETE
grep -q "authentication failed" "$work/target.log" || fail "the target logged no refused authentication"
echo "kernel authentication: 1 passed, 0 failed"
