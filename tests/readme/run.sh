#!/usr/bin/env bash
# README.md as a test: every ```sh block, in order, run exactly as printed by one bash (a
# block sees the variables and the working directory the blocks before it left), from the
# repository's root, as root, with no sudo (a `sudo` stub that fails comes first on PATH) and
# a fresh TMPDIR (the README works in `mktemp -d`). A block whose fence reads
# ```sh no-test REASON is shown, not run. The first failing command fails the test.
# Afterwards, passed or failed, it stops what the README left running (processes whose
# working directory is in its TMPDIR, by PID), unmounts and detaches the loop devices under
# it, takes down a testbed the README brought up, and removes it.
# The README's first block builds the binaries and puts them on PATH; it is marked no-test,
# and the test puts DIR's binaries (--bin, default target/release) first on PATH instead, so
# that the suite, which compiled the workspace once already, does not compile it again.
# Usage: tests/readme/run.sh [--bin DIR] [README.md]   (DIR holds nearstore and nearstore-lab)
#   or another page of sh blocks instead of README.md: docs/fuse.md (nearstore-lab only if it names it)
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
fail() { echo "README test: FAIL: $*" >&2; exit 1; }
bin=$root/target/release
if [ "${1:-}" = --bin ]; then
    [ $# -ge 2 ] || fail "--bin needs a directory"
    bin=$2
    shift 2
fi
readme=$(realpath "${1:-$root/README.md}")
name=$(basename "$readme")
for b in nearstore nearstore-lab; do
    [ "$b" = nearstore ] || grep -q "$b" "$readme" || continue
    [ -x "$bin/$b" ] || fail "no $b in $bin (cargo build --release, or --bin DIR)"
done
bin=$(cd "$bin" && pwd)
[ -z "${NEARSTORE_README_TEST:-}" ] || fail "a README block runs the suite, which runs this test again: mark it \`\`\`sh no-test"
export NEARSTORE_README_TEST=1
[ "$(id -u)" = 0 ] || fail "needs root (loop devices, mounts, network namespaces)"
for tool in mkfs.ext4 losetup mount findmnt ip tc timeout; do
    command -v "$tool" >/dev/null || fail "needs \`$tool\` (scripts/prereqs.sh installs it)"
done
testbed_state=/run/nearstore-testbed.json
[ -e "$testbed_state" ] && fail "a testbed is already up ($testbed_state): the README brings up its own; take it down first"

work=$(mktemp -d /tmp/nearstore-readme.XXXXXX)
mkdir -p "$work/bin" "$work/tmp"
cleanup() {
    set +e +o pipefail
    local p
    for p in /proc/[0-9]*; do
        case "$(readlink "$p/cwd" 2>/dev/null)" in
        "$work"/*) echo "README test: stopping ${p#/proc/} ($(tr '\0' ' ' < "$p/cmdline" 2>/dev/null))" >&2; kill "${p#/proc/}" 2>/dev/null || true ;;
        esac
    done
    sleep 0.5
    findmnt -rn -o TARGET | grep "^$work/" | sort -r | while read -r m; do umount -l "$m" || true; done
    losetup -n -l -O NAME,BACK-FILE | awk -v w="$work/" 'index($2, w) == 1 { print $1 }' | while read -r d; do losetup -d "$d" || true; done
    if [ -e "$testbed_state" ]; then "$bin/nearstore-lab" testbed down || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

cat > "$work/bin/sudo" <<'STUB'
#!/bin/sh
echo "README test: sudo is not installed on this machine: a README command must work as root without it" >&2
exit 127
STUB
chmod +x "$work/bin/sudo"

# The blocks, each announced with its line, then a trap that stops the background jobs the
# README started (by PID) when the script ends, however it ends.
script=$work/readme.sh
{
    echo 'set -euo pipefail'
    echo 'trap '\''for j in $(jobs -p); do kill "$j" 2>/dev/null || true; done; wait'\'' EXIT'
    echo 'trap "exit 143" TERM INT'
    awk -v name="$name" '
        /^```sh( |$)/ { inside = 1; skip = ($2 ~ /^no-test/); n++; if (!skip) printf "echo \"== %s block %d (line %d)\" >&2\n", name, n, NR; next }
        /^```/ && inside { inside = 0; next }
        inside && !skip { print }
    ' "$readme"
} > "$script"
blocks=$(grep -c '^```sh' "$readme" || true)
run=$(grep -c "^== $name block" <(grep -o "== $name block [0-9]*" "$script") || true)
[ "$run" -gt 0 ] || fail "no \`\`\`sh block to run in $readme"
echo "README test: $run of $blocks sh blocks of $readme run (the others are marked no-test)" >&2

cd "$root"
if PATH="$work/bin:$bin:$PATH" TMPDIR="$work/tmp" timeout 1800 bash "$script"; then
    echo "README test: 1 passed, 0 failed"
else
    status=$?
    echo "README test: 0 passed, 1 failed"
    fail "a command of $name failed (exit status $status; the last block announced above holds it)"
fi
