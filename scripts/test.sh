#!/usr/bin/env bash
# The whole test suite: unit, integration and fuzz (bounded) tests of the workspace, then
# the Linux kernel initiator in qemu (on a namespace, on a volume over three targets, its reservations, and its DH-HMAC-CHAP on Debian trixie's kernel), then 20 power cuts of the target in qemu, then every
# command block of README.md as printed (tests/readme/run.sh). Installs what it needs (Debian
# packages, without their recommendations). Needs root (loop devices, mounts, network
# namespaces): run as another user, it runs itself again with sudo.
#
# It compiles the workspace once, in cargo's test profile: the tests, and the binaries of
# every package in target/debug/, which the qemu, power-cut and README tests take by path (a
# release build would compile everything a second time; under TCG the guest's time dominates,
# not the binary's optimisation).
#
# Each phase prints its elapsed time when it ends ("phase NAME: N s", failed or not), and the
# suite ends with all of them and the total (docs/testing.md has them before and after).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/as-root.sh

phases=()
phase_name=
phase_start=
suite_start=$SECONDS
phase_end() {
    local line="phase $phase_name: $((SECONDS - phase_start)) s$1"
    echo "$line"
    phases+=("$line")
    phase_name=
}
# phase NAME COMMAND...: one phase of the suite, timed. A failing command ends the suite
# (set -e), and the exit trap prints that phase's time too.
phase() {
    phase_name=$1
    phase_start=$SECONDS
    shift
    "$@"
    phase_end ""
}
summary() {
    local rc=$?
    [ -z "$phase_name" ] || phase_end " (failed)"
    echo "--- the suite's phases ---"
    [ ${#phases[@]} = 0 ] || printf '%s\n' "${phases[@]}"
    echo "phase total: $((SECONDS - suite_start)) s$([ $rc = 0 ] || echo " (failed, exit status $rc)")"
}
trap summary EXIT

phase prereqs . scripts/prereqs.sh
export PROPTEST_CASES=${PROPTEST_CASES:-20000}
# All targets of every package: exactly what `cargo test --workspace` compiles (the same
# profile and features, so it compiles nothing more), and the binaries it does not need.
phase build cargo build --profile test --workspace --all-targets --locked
cargo_test() {
    cargo test --workspace --locked 2>&1 | tee /tmp/nearstore-cargo-test.log
    if grep -E '^ +Compiling ' /tmp/nearstore-cargo-test.log; then
        echo "cargo test compiled the crates above again: the build phase must build what it tests (same profile, features, targets)" >&2
        return 1
    fi
}
phase cargo-test cargo_test
bin=target/debug
phase kernel bash tests/kernel/run.sh $bin/nearstore
phase kernel-volume bash tests/kernel/volume.sh $bin/nearstore
phase kernel-resv bash tests/kernel/resv.sh $bin/nearstore
phase kernel-auth bash tests/kernel/auth.sh $bin/nearstore
phase powercut bash tests/kernel/powercut.sh --cuts 20 --bin $bin/nearstore --writer $bin/nearstore-powercut
phase readme bash tests/readme/run.sh --bin $bin
