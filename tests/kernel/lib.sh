# Sourced by the qemu tests (run.sh, powercut.sh): the prerequisites, Debian's kernel, and
# a small initramfs of busybox, binaries with their shared libraries, and kernel modules.
# The caller defines fail() (prints its test's name and exits); the initramfs functions use
# $busybox and $kver, which guest_prereqs sets.

# Checks qemu, static busybox, cpio, e2fsprogs and a Debian kernel with its modules;
# installs the missing packages when root, else fails naming them.
guest_prereqs() {
    local need=()
    command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
    { [ -x /bin/busybox ] && file -L /bin/busybox 2>/dev/null | grep -q static; } || [ -x /usr/bin/busybox ] || need+=(busybox-static)
    command -v mke2fs >/dev/null || need+=(e2fsprogs)
    command -v cpio >/dev/null || need+=(cpio)
    command -v file >/dev/null || need+=(file)
    ls /boot/vmlinuz-* >/dev/null 2>&1 || need+=(linux-image-amd64)
    if [ ${#need[@]} -gt 0 ]; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            echo "installing ${need[*]}" >&2
            apt-get update -qq >/dev/null
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends --no-upgrade "${need[@]}" >/dev/null
        else
            fail "missing prerequisites: ${need[*]} (install them: apt-get install ${need[*]})"
        fi
    fi
    kver=$(ls /boot/vmlinuz-* | sed 's|/boot/vmlinuz-||' | sort -V | tail -1)
    kernel=/boot/vmlinuz-$kver
    [ -d "/lib/modules/$kver" ] || fail "modules for kernel $kver not found in /lib/modules/$kver"
    busybox=$(command -v busybox || echo /bin/busybox)
    file -L "$busybox" | grep -q static || busybox=/bin/busybox
    file -L "$busybox" | grep -q static || fail "busybox is not static: install busybox-static"
}

# initramfs_busybox DIR APPLET...: the directory tree, busybox and its applets.
initramfs_busybox() {
    local ird=$1 app
    shift
    mkdir -p "$ird"/{bin,sbin,etc,proc,sys,dev,mnt,tmp,run,lib/modules}
    cp "$busybox" "$ird/bin/busybox"
    for app in "$@"; do ln -sf busybox "$ird/bin/$app"; done
}

# initramfs_binary DIR BINARY [NAME]: the binary (stripped) as DIR/bin/NAME (default: its
# own name), and the libraries it links.
initramfs_binary() {
    local ird=$1 b=$2 name=${3:-$(basename "$2")} lib
    strip -o "$ird/bin/$name" "$b"
    ldd "$b" | grep -o '/[^ ]*' | while read -r lib; do
        mkdir -p "$ird$(dirname "$lib")"
        cp -L "$lib" "$ird$lib"
    done
}

# initramfs_modules DIR MODULE...: the modules and what they depend on, uncompressed, in
# DIR/lib/modules, and their load order in DIR/modules.list. With $modroot set, the modules
# of $kver are those under $modroot/lib/modules (a kernel unpacked apart, auth.sh).
initramfs_modules() {
    local ird=$1 m f
    shift
    local -A seen=()
    local order=()
    add_mod() {
        local m=$1 d
        [ -n "${seen[$m]:-}" ] && return
        seen[$m]=1
        for d in $(modinfo ${modroot:+-b "$modroot"} -k "$kver" -F depends "$m" | tr ',' ' '); do add_mod "$d"; done
        order+=("$m")
    }
    for m in "$@"; do add_mod "$m"; done
    : > "$ird/modules.list"
    for m in "${order[@]}"; do
        f=$(modinfo ${modroot:+-b "$modroot"} -k "$kver" -n "$m")
        case "$f" in
            *.ko) cp "$f" "$ird/lib/modules/$m.ko" ;;
            *.ko.xz) xz -dc "$f" > "$ird/lib/modules/$m.ko" ;;
            *.ko.zst) zstd -qdc "$f" > "$ird/lib/modules/$m.ko" ;;
            *) continue ;;
        esac
        echo "$m" >> "$ird/modules.list"
    done
}

# initramfs_pack DIR OUT: DIR as a gzipped cpio archive.
initramfs_pack() {
    (cd "$1" && find . | cpio -o -H newc --quiet | gzip -1 > "$2")
}

# A free TCP port on the host's loopback.
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# boot_guest KERNEL INITRD WORK TIMEOUT_S MEMORY_MIB MARKER: boots the guest (TCG, or KVM
# with NEARSTORE_QEMU_KVM=1) on user networking, its console in WORK/guest.log, prints its
# STEP lines, and fails (with the console's and WORK/target.log's tails) unless the guest
# printed MARKER and no step failed. Needs the caller's fail().
boot_guest() {
    local kernel=$1 initrd=$2 work=$3 limit=$4 mem=$5 marker=$6 accel=tcg start
    if [ -w /dev/kvm ] && [ "${NEARSTORE_QEMU_KVM:-0}" = 1 ]; then accel=kvm; fi
    echo "booting $kernel ($accel) against the target on the host (guest sees 10.0.2.2)"
    start=$(date +%s)
    timeout "$limit" qemu-system-x86_64 -accel $accel -m "$mem" -smp 1 -nographic -no-reboot \
        -kernel "$kernel" -initrd "$initrd" -append "console=ttyS0 loglevel=5 panic=-1" \
        -netdev user,id=n0 -device e1000,netdev=n0 > "$work/guest.log" 2>&1 || true
    echo "guest ran $(( $(date +%s) - start )) s"
    cp "$work/guest.log" "${NEARSTORE_KERNEL_LOG:-/dev/null}" || true
    grep -E "^STEP|^  \|" "$work/guest.log" || true
    if ! grep -q "$marker" "$work/guest.log"; then
        echo "--- guest console (tail) ---"; tail -40 "$work/guest.log"
        echo "--- target log (tail) ---"; tail -20 "$work/target.log"
        fail "the guest did not finish every step"
    fi
    if grep -q "STEP .*: FAIL" "$work/guest.log"; then fail "a guest step failed"; fi
}
