//! Extents moved under I/O and faults, against a model, over many seeds (docs/simulation.md,
//! "Moving extents"), and the broken move protocols it must catch.
//!
//! NEARSTORE_SIM_SEED=n runs (and with --nocapture prints the trace of) that seed only;
//! NEARSTORE_SIM_SEEDS=n runs n seeds instead of the default.

use nearstore_sim::moves::{run, Options, Stats};
use nearstore_sim::{env_u64, print_replay};
use nearstore_target::dev::volume::mover::MoveBug;

/// Seeds the suite runs: every fault meets moves in each of their steps many times, and the
/// test takes well under a minute.
const SEEDS: u64 = 500;

#[test]
fn moves_never_lose_a_write_nor_read_a_stale_block() {
    if let Some(seed) = env_u64("NEARSTORE_SIM_SEED") {
        print_replay(seed, run(seed, &Options { keep_trace: true, ..Options::default() }), |s| (&s.trace, s.trace_hash, s.events));
        return;
    }
    let n = env_u64("NEARSTORE_SIM_SEEDS").unwrap_or(SEEDS);
    let mut all = Stats::default();
    for seed in 0..n {
        let s = run(seed, &Options::default()).unwrap_or_else(|f| panic!("{f}"));
        all.reads += s.reads;
        all.writes += s.writes;
        all.failed += s.failed;
        all.moves_begun += s.moves_begun;
        all.published += s.published;
        all.crashes += s.crashes;
        all.crashes_mid_move += s.crashes_mid_move;
        all.expired += s.expired;
        all.cuts += s.cuts;
        all.outages += s.outages;
        all.lost_calls += s.lost_calls;
        all.late_words += s.late_words;
    }
    println!("{n} seeds: {all:?}");
    // The moves and the faults were there to be survived: a run without them checks nothing.
    assert!(all.published > 5 * n && all.moves_begun > all.published, "too few moves published or aborted: {all:?}");
    assert!(all.crashes_mid_move > n / 10 && all.expired > n / 10, "too few moves met a crash or a silence: {all:?}");
    assert!(all.crashes > n / 2 && all.cuts > n / 2 && all.outages > n / 2 && all.lost_calls > n, "too few faults: {all:?}");
    assert!(all.reads > 100 * n && all.writes > 100 * n, "too little I/O: {all:?}");
    assert!(all.late_words > n, "too few copiers' words came late: {all:?}");
}

#[test]
fn one_seed_replays_the_same_run() {
    let mut hashes = Vec::new();
    for seed in 0..10 {
        let a = run(seed, &Options::default()).unwrap_or_else(|f| panic!("{f}"));
        let b = run(seed, &Options::default()).unwrap_or_else(|f| panic!("{f}"));
        assert_eq!((a.trace_hash, a.events), (b.trace_hash, b.events), "seed {seed} ran differently twice");
        hashes.push(a.trace_hash);
    }
    hashes.sort_unstable();
    hashes.dedup();
    assert_eq!(hashes.len(), 10, "different seeds ran the same way");
}

/// Each broken copier, run until a seed shows it, and what the checker says.
#[test]
fn broken_move_protocols_are_caught() {
    // (bug, what the failure may say)
    let cases: &[(MoveBug, &[&str])] = &[
        (MoveBug::NoInvalidation, &["was overwritten by", "the bytes of volume"]),
        (MoveBug::NoDrain, &["was overwritten by", "the bytes of volume"]),
        (MoveBug::UnblockBeforePublish, &["was overwritten by"]),
    ];
    for &(bug, expect) in cases {
        let opts = Options { bug: Some(bug), ..Options::default() };
        let f = (0..SEEDS).find_map(|seed| run(seed, &opts).err()).unwrap_or_else(|| panic!("{bug:?}: no seed of {SEEDS} caught it"));
        println!("{bug:?} caught by seed {}: {}", f.seed, f.message);
        assert!(expect.iter().any(|e| f.message.contains(e)), "{bug:?}: seed {} failed, but not as expected: {}", f.seed, f.message);
    }
}
