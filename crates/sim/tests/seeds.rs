//! The simulation in the suite: a few thousand seeds, determinism, and deliberately
//! broken targets that it must catch (docs/simulation.md).
//!
//! NEARSTORE_SIM_SEED=n runs (and with --nocapture prints the trace of) that seed only;
//! NEARSTORE_SIM_SEEDS=n runs n seeds instead of the default.

use nearstore_sim::disk::DiskBug;
use nearstore_sim::net::ReplyBug;
use nearstore_sim::{env_u64, print_replay, run, Options};

/// Seeds the suite runs: enough for every fault to meet every command kind many times,
/// few enough for the test to take well under a minute.
const SEEDS: u64 = 3000;

#[test]
fn seeds() {
    if let Some(seed) = env_u64("NEARSTORE_SIM_SEED") {
        print_replay(seed, run(seed, &Options { keep_trace: true, ..Options::default() }), |o| (&o.trace, o.trace_hash, o.events));
        return;
    }
    let n = env_u64("NEARSTORE_SIM_SEEDS").unwrap_or(SEEDS);
    let (mut crashes, mut cuts, mut faults, mut lost, mut completed) = (0u64, 0u64, 0, 0, 0);
    for seed in 0..n {
        match run(seed, &Options::default()) {
            Ok(o) => {
                (crashes, cuts, faults) = (crashes + o.crashes as u64, cuts + o.cuts as u64, faults + o.faults);
                (lost, completed) = (lost + o.lost, completed + o.completed);
            }
            Err(f) => panic!("{f}"),
        }
    }
    println!("{n} seeds: {completed} commands completed, {lost} lost, {faults} disk errors, {cuts} disconnects, {crashes} crashes");
    // The faults were there to be survived: a harness that injects none checks nothing.
    assert!(crashes > n / 10 && cuts > n / 10 && faults > n && lost > n, "too few faults injected");
}

#[test]
fn one_seed_replays_the_same_run() {
    let mut hashes = Vec::new();
    for seed in 0..40 {
        let a = run(seed, &Options::default()).unwrap_or_else(|f| panic!("{f}"));
        let b = run(seed, &Options::default()).unwrap_or_else(|f| panic!("{f}"));
        assert_eq!((a.trace_hash, a.events), (b.trace_hash, b.events), "seed {seed} ran differently twice");
        hashes.push(a.trace_hash);
    }
    hashes.sort_unstable();
    hashes.dedup();
    assert_eq!(hashes.len(), 40, "different seeds ran the same way");
}

/// A broken target, and what the checker may say about it (one of `expect`).
fn caught(disk_bug: Option<DiskBug>, reply_bug: Option<ReplyBug>, expect: &[&str]) {
    let opts = Options { disk_bug, reply_bug, ..Options::default() };
    for seed in 0..200 {
        if let Err(f) = run(seed, &opts) {
            println!("{disk_bug:?} {reply_bug:?} caught by seed {seed}:\n{f}");
            assert!(expect.iter().any(|e| f.message.contains(e)), "seed {seed} failed, but not as expected ({expect:?}): {}", f.message);
            return;
        }
    }
    panic!("no seed of 200 caught {disk_bug:?} {reply_bug:?}");
}

#[test]
fn a_broken_target_is_caught() {
    // A duplicate completion that arrives after its command ID was reused completes the
    // new command early, and that one's own completion is then the unknown one, or lost.
    let cases: &[(Option<DiskBug>, Option<ReplyBug>, &[&str])] = &[
        (Some(DiskBug::FlushIgnored), None, &["after the crash it may hold only"]),
        (None, Some(ReplyBug::DuplicateCompletion(50)), &["completion for unknown command id", "lost completion", "may hold only"]),
        (None, Some(ReplyBug::DropCompletion(50)), &["lost completion"]),
    ];
    for &(disk, reply, expect) in cases {
        caught(disk, reply, expect);
    }
}
