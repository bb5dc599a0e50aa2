#!/usr/bin/env bash
# The FUSE mount's figures (docs/benchmarks.md, "The FUSE mount"): 1 MiB sequential reads and
# writes through the mount against the source directory (plain descriptors, passed through;
# and reads of a direct one), and an operation through the mount
# against the CLI on the same file, in one run (ratios of the same run: the machine is shared).
# Usage (root): scripts/bench-fuse.sh [NEARSTORE_BINARY] [MIB]
set -euo pipefail
bin=$(realpath "${1:-target/release/nearstore}")
mib=${2:-256}
[ "$(id -u)" = 0 ] || { echo "bench-fuse.sh needs root (loop device, mount)" >&2; exit 1; }
[ -e /dev/fuse ] || { echo "bench-fuse.sh needs /dev/fuse (the fuse kernel module)" >&2; exit 1; }
dir=$(mktemp -d); src=$dir/src; mnt=$dir/view; tpid=; mpid=; dev=
cleanup() {
    mountpoint -q "$mnt" && { umount "$mnt" || umount -l "$mnt"; }
    [ -n "$mpid" ] && { kill "$mpid" 2>/dev/null || true; wait "$mpid" 2>/dev/null || true; }
    [ -n "$tpid" ] && { kill "$tpid" 2>/dev/null || true; wait "$tpid" 2>/dev/null || true; }
    mountpoint -q "$src" && umount "$src"
    [ -n "$dev" ] && losetup -d "$dev"
    rm -rf "$dir"
}
trap cleanup EXIT
mkdir -p "$src" "$mnt"
truncate -s $((mib * 3 + 256))M "$dir/disk.img"
mkfs.ext4 -q -F -b 4096 "$dir/disk.img"
dev=$(losetup -f --show "$dir/disk.img")
mount "$dev" "$src"
"$bin" target --listen 127.0.0.1:0 --discovery none --namespace "$dir/disk.img" > "$dir/target.out" 2>/dev/null & tpid=$!
for _ in $(seq 200); do grep -q "listening on" "$dir/target.out" && break; sleep 0.05; done
addr=$(sed -n 's/^listening on //p' "$dir/target.out" | head -1)
printf '[[namespace]]\naddress = "%s"\nnqn = "nqn.2026-11.io.nearstore:disk0"\nnsid = 1\nfile = "%s"\n' "$addr" "$dir/disk.img" > "$dir/map.toml"
"$bin" mount --map "$dir/map.toml" "$src" "$mnt" 2>"$dir/mount.log" & mpid=$!
for _ in $(seq 200); do mountpoint -q "$mnt" && break; sleep 0.05; done
mountpoint -q "$mnt" || { cat "$dir/mount.log" >&2; exit 1; }

# GB/s of one dd (its last line).
rate() { dd "$@" 2>&1 | tail -1 | sed 's/.*, //'; }
secs() { local t0 t1; t0=$(date +%s.%N); "$@" > /dev/null; t1=$(date +%s.%N); echo "$t1 - $t0" | bc; }

echo "# 1 MiB sequential I/O, $mib MiB, 3 runs each (page cache warm for reads; writes end with fsync)"
for r in 1 2 3; do
    echo "write source run $r: $(rate if=/dev/zero of="$src/w-src" bs=1M count="$mib" conv=fsync)"
    echo "write mount  run $r: $(rate if=/dev/zero of="$mnt/w-mnt" bs=1M count="$mib" conv=fsync)"
done
head -c $((mib << 20)) /dev/urandom > "$src/big"
cat "$src/big" > /dev/null
for r in 1 2 3; do
    echo "read source run $r: $(rate if="$src/big" of=/dev/null bs=1M)"
    echo "read mount  run $r: $(rate if="$mnt/big" of=/dev/null bs=1M)"
done
# A direct descriptor (O_DIRECT: each read a request to the mount, as one with an operation).
for r in 1 2 3; do
    echo "read mount O_DIRECT run $r: $(rate if="$mnt/big" of=/dev/null bs=1M iflag=direct)"
done

echo "# sha256 of the same file: the CLI (a process, a connection) against a read of the mount's result path; seconds, 5 runs each"
head -c 4096 /dev/urandom > "$src/small"
sync
for f in small big; do
    for r in 1 2 3 4 5; do
        echo "$f cli   run $r: $(secs "$bin" checksum -a sha256 --offload-only --map "$dir/map.toml" "$src/$f")"
        echo "$f mount run $r: $(secs cat "$mnt/.nearstore/sha256/$f")"
    done
done
echo "offloaded: $(cat "$mnt/.nearstore/sha256/big" > /dev/null; python3 -c "import os,sys; print(os.getxattr(sys.argv[1], 'user.nearstore.offloaded').decode())" "$mnt/.nearstore/sha256/big")"
