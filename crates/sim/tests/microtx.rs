//! The MicroTx journal under power cuts, over many seeds (docs/simulation.md, "The MicroTx
//! journal"), and the flush bugs it must catch.
//!
//! NEARSTORE_SIM_SEED=n runs that seed only.

use nearstore_sim::disk::DiskBug;
use nearstore_sim::microtx::{run, Bugs, Stats};
use nearstore_target::microtx::FlushBug;

/// Seeds the suite runs: each has 11 cuts at random points, in transactions, replays and
/// plain writes.
const SEEDS: u64 = 200;

#[test]
fn every_acknowledged_transaction_survives_power_cuts_whole() {
    let seeds = match std::env::var("NEARSTORE_SIM_SEED") {
        Ok(s) => {
            let s: u64 = s.parse().expect("NEARSTORE_SIM_SEED is a number");
            s..s + 1
        }
        Err(_) => 0..SEEDS,
    };
    let mut all = Stats::default();
    for seed in seeds {
        let s = run(seed, Bugs::default()).unwrap_or_else(|e| panic!("{e} (NEARSTORE_SIM_SEED={seed} replays it)"));
        all.transactions += s.transactions;
        all.groups += s.groups;
        all.cuts += s.cuts;
        all.finished += s.finished;
        all.rolled_back += s.rolled_back;
    }
    println!("{all:?}");
    // The cuts met transactions at every stage: some were finished by replay, some rolled back.
    assert!(all.finished > 0 && all.rolled_back > 0 && all.groups > 0, "{all:?}");
}

/// Each broken flush order, run until a seed shows it (the checker can fail).
#[test]
fn broken_flush_orders_are_caught() {
    // (what, bugs)
    let cases = [
        ("in-place writes not flushed before APPLIED", Bugs { journal: Some(FlushBug::DataNotFlushedBeforeApplied), data_disk: None }),
        ("the namespace's disk ignores flushes", Bugs { journal: None, data_disk: Some(DiskBug::FlushIgnored) }),
        ("a group written in place last member first", Bugs { journal: Some(FlushBug::GroupInPlaceReversed), data_disk: None }),
    ];
    for (what, bugs) in cases {
        let caught = (0..SEEDS).find_map(|seed| run(seed, bugs).err());
        let e = caught.unwrap_or_else(|| panic!("{what}: no seed of {SEEDS} caught it"));
        let first = e.lines().next().unwrap_or_default();
        assert!(first.contains("block") || first.contains("outcome"), "{what}: {e}");
        println!("{what}: {first}");
    }
}
