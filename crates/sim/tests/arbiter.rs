//! The arbiter and the exporters' gates under lost requests and answers, an arbiter that
//! stops answering and comes back with empty books, and a dying exporter, against a model
//! of the shares (docs/simulation.md, "The arbiter"); and the broken exporters it must catch.
//!
//! NEARSTORE_SIM_SEED=n runs (and with --nocapture prints the trace of) that seed only;
//! NEARSTORE_SIM_SEEDS=n runs n seeds instead of the default.

use nearstore_sim::arbiter::{run, ArbiterBug, Options, Stats};
use nearstore_sim::{env_u64, print_replay};

/// Seeds the suite runs: every mix of pool, exporters, tenants and losses many times.
const SEEDS: u64 = 40;

#[test]
fn shares_follow_the_weights_and_fall_back_when_the_arbiter_is_gone() {
    if let Some(seed) = env_u64("NEARSTORE_SIM_SEED") {
        print_replay(seed, run(seed, &Options { keep_trace: true, ..Options::default() }), |s| (&s.trace, s.trace_hash, s.events));
        return;
    }
    let n = env_u64("NEARSTORE_SIM_SEEDS").unwrap_or(SEEDS);
    let mut all = Stats::default();
    for seed in 0..n {
        let s = run(seed, &Options::default()).unwrap_or_else(|f| panic!("{f}"));
        all.ops += s.ops;
        all.lost += s.lost;
        all.windows += s.windows;
        all.held += s.held;
        all.worst = all.worst.max(s.worst);
    }
    println!(
        "{n} seeds: {} operations, {} requests or answers lost, {} windows, worst share off by {:.3}, {} held",
        all.ops, all.lost, all.windows, all.worst, all.held
    );
    assert_eq!(all.windows, 3 * n);
    assert!(all.lost > n, "too few requests or answers lost: {}", all.lost);
    assert!(all.held > 100 * n, "the grants held too little back: {}", all.held);
}

#[test]
fn one_seed_replays_the_same_run() {
    for seed in [3, 17] {
        let a = run(seed, &Options::default()).unwrap_or_else(|f| panic!("{f}"));
        let b = run(seed, &Options::default()).unwrap_or_else(|f| panic!("{f}"));
        assert_eq!((a.trace_hash, a.events), (b.trace_hash, b.events), "seed {seed}");
        assert!(a.events > 100);
    }
}

/// An exporter that sends every weight as 100, and one that keeps its grants past their
/// time: the model must fail each, on most seeds.
#[test]
fn broken_exporters_are_caught() {
    for (bug, says) in [(ArbiterBug::IgnoreWeights, "share is off the model"), (ArbiterBug::NeverExpire, "holds")] {
        let seeds = 10;
        let mut caught = 0;
        for seed in 0..seeds {
            match run(seed, &Options { bug: Some(bug), ..Options::default() }) {
                Ok(_) => {}
                Err(f) => {
                    assert!(f.message.contains(says), "{bug:?}, seed {seed}: {}", f.message);
                    caught += 1;
                }
            }
        }
        assert!(caught >= seeds * 8 / 10, "{bug:?} caught on {caught} of {seeds} seeds");
    }
}
