//! Where a new extent goes: a weighted score over the pools with room for it, from the
//! control plane's books (free capacity, this volume's extents per target) and the pools'
//! views (load, write cost). Pure and deterministic: equal scores go to the smallest pool id.
//! A pool whose target has not been heard from for `VIEW_STALE_MS` is never chosen.
//! docs/control-plane.md ("Placement") gives the weights and why.

use crate::model::{Figures, PoolId};

/// Weight of the free fraction of a pool: the strongest pull, so that pools fill evenly.
pub const WEIGHT_FREE: i64 = 4;
/// Weight of the load (queue depth): busy pools take new extents later.
pub const WEIGHT_LOAD: i64 = 2;
/// Weight of the write cost: slow writers take new extents later.
pub const WEIGHT_WRITE_COST: i64 = 1;
/// Weight of the share of this volume already on the pool's target. [`place`] lets only the
/// targets holding the fewest of the volume's extents compete, so among them it is equal;
/// it stays in the score that `explain` shows.
pub const WEIGHT_SPREAD: i64 = 3;

/// Queue depth at which the load term is one half (qd / (qd + this)).
pub const LOAD_HALF_QD: f64 = 4.0;
/// Write cost at which the write-cost term is one half, in microseconds per MiB (a MiB in
/// 2 ms is 500 MB/s).
pub const WRITE_COST_HALF_US_PER_MIB: f64 = 2000.0;

/// Every term is a fraction in parts per million.
const PPM: i64 = 1_000_000;

/// One pool as placement sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub pool: PoolId,
    pub size: u64,
    /// Bytes of extents already placed in it.
    pub allocated: u64,
    /// Whether it has a hole of the extent's size (at an aligned offset).
    pub fits: bool,
    /// Its last view; none yet counts as idle.
    pub figures: Option<Figures>,
    /// Neither a view nor a registration within `limits::VIEW_STALE_MS`: its target may be
    /// gone, and an extent placed there could not be written.
    pub stale: bool,
}

/// The placement's terms and score of one candidate, for tests and `explain`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Score {
    pub free_ppm: i64,
    pub load_ppm: i64,
    pub write_cost_ppm: i64,
    pub spread_ppm: i64,
    pub total: i64,
}

fn fraction_ppm(x: f64, half: f64) -> i64 {
    if !x.is_finite() || x <= 0.0 {
        return 0;
    }
    ((x / (x + half)) * PPM as f64).round() as i64
}

/// The score of one candidate for a volume that has `volume_extents` extents allocated, of
/// which `on_target` are on this candidate's target.
pub fn score(c: &Candidate, volume_extents: u64, on_target: u64) -> Score {
    let free = c.size.saturating_sub(c.allocated);
    let free_ppm = if c.size == 0 { 0 } else { (u128::from(free) * PPM as u128 / u128::from(c.size)) as i64 };
    let (load_ppm, write_cost_ppm) = match &c.figures {
        Some(f) => (fraction_ppm(f.queue_depth, LOAD_HALF_QD), fraction_ppm(f.write_cost_us_per_mib, WRITE_COST_HALF_US_PER_MIB)),
        None => (0, 0),
    };
    let spread_ppm = (u128::from(on_target) * PPM as u128 / (u128::from(volume_extents) + 1)) as i64;
    let total = WEIGHT_FREE * free_ppm - WEIGHT_LOAD * load_ppm - WEIGHT_WRITE_COST * write_cost_ppm - WEIGHT_SPREAD * spread_ppm;
    Score { free_ppm, load_ppm, write_cost_ppm, spread_ppm, total }
}

/// The pool for a new extent of a volume, or None when no fresh pool fits it. `on_target(t)`
/// is the number of the volume's extents on target t; `volume_extents` their total.
///
/// Spread first: only the pools whose target holds the fewest of the volume's extents (of
/// the pools that fit it) compete, and the score picks among them. A volume's bandwidth is
/// the sum of its targets' only when its extents are spread evenly (a random or whole-volume
/// workload runs at the fullest target's pace), so a busy or slower target still takes its
/// share, as Flint's striping gives it; load and write cost choose the order within a
/// round. Before, spread was one weighted term, and a load reported by the pools of the
/// last benchmark outweighed it: on 8 targets three held none of a volume
/// (docs/experiments.md, "Experiment 4").
pub fn place(candidates: &[Candidate], volume_extents: u64, on_target: impl Fn(&str) -> u64) -> Option<&Candidate> {
    let viable = || candidates.iter().filter(|c| c.fits && !c.stale);
    let fewest = viable().map(|c| on_target(&c.pool.target)).min()?;
    viable()
        .filter(|c| on_target(&c.pool.target) == fewest)
        .map(|c| (score(c, volume_extents, on_target(&c.pool.target)).total, c))
        // Highest score; among equals the smallest pool id, whatever the input order.
        .max_by(|(a, ca), (b, cb)| a.cmp(b).then_with(|| cb.pool.cmp(&ca.pool)))
        .map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const GIB: u64 = 1 << 30;

    /// A pool in a test table: (target, name, size GiB, allocated GiB, queue depth, write
    /// cost us/MiB; a negative queue depth means no view).
    type Row = (&'static str, &'static str, u64, u64, f64, f64);

    fn candidates(rows: &[Row]) -> Vec<Candidate> {
        candidates_stale(rows, &[])
    }

    /// The same, the pools named in `stale` ("name@target") stale.
    fn candidates_stale(rows: &[Row], stale: &[&str]) -> Vec<Candidate> {
        rows.iter()
            .map(|&(t, n, size, alloc, qd, wc)| Candidate {
                pool: PoolId { target: t.into(), name: n.into() },
                size: size * GIB,
                allocated: alloc * GIB,
                fits: size > alloc,
                figures: (qd >= 0.0).then(|| Figures { queue_depth: qd, write_cost_us_per_mib: wc, ..Figures::default() }),
                stale: stale.contains(&format!("{n}@{t}").as_str()),
            })
            .collect()
    }

    /// Places `n` extents one after the other (as a volume's first writes would) and returns
    /// the pools chosen, as "name@target".
    fn check(rows: &[Row], n: usize, expected: &[&str]) {
        check_stale(rows, &[], n, expected)
    }

    /// The same, the pools named in `stale` stale.
    fn check_stale(rows: &[Row], stale: &[&str], n: usize, expected: &[&str]) {
        let candidates = |rows: &[Row]| candidates_stale(rows, stale);
        let mut cands = candidates(rows);
        let mut per_target: HashMap<String, u64> = HashMap::new();
        let mut got = Vec::new();
        for i in 0..n {
            let Some(c) = place(&cands, i as u64, |t| per_target.get(t).copied().unwrap_or(0)) else {
                got.push("none".to_string());
                continue;
            };
            let id = c.pool.clone();
            got.push(id.to_string());
            *per_target.entry(id.target.clone()).or_default() += 1;
            let c = cands.iter_mut().find(|c| c.pool == id).expect("chosen pool");
            c.allocated += GIB;
            c.fits = c.size >= c.allocated + GIB;
        }
        assert_eq!(got, expected, "table {rows:?}");
        // Deterministic whatever the order the pools come in.
        let mut reversed = rows.to_vec();
        reversed.reverse();
        if n > 0 {
            let a = place(&candidates(rows), 0, |_| 0).map(|c| c.pool.clone());
            let b = place(&candidates(&reversed), 0, |_| 0).map(|c| c.pool.clone());
            assert_eq!(a, b, "order changed the placement: {rows:?}");
        }
    }

    #[test]
    fn placements() {
        #[rustfmt::skip]
        let cases: &[(&[Row], usize, &[&str])] = &[
            // Equal pools: the smallest id first, then the other target (spread).
            (&[("t1", "a", 10, 0, -1.0, 0.0), ("t2", "a", 10, 0, -1.0, 0.0)], 4, &["a@t1", "a@t2", "a@t1", "a@t2"]),
            // Same, given in the other order.
            (&[("t2", "a", 10, 0, -1.0, 0.0), ("t1", "a", 10, 0, -1.0, 0.0)], 2, &["a@t1", "a@t2"]),
            // The emptier pool first.
            (&[("t1", "a", 10, 8, -1.0, 0.0), ("t2", "a", 10, 2, -1.0, 0.0)], 1, &["a@t2"]),
            // Two pools on one target and one on another: spread over targets before filling
            // a target's second pool.
            (&[("t1", "a", 10, 0, -1.0, 0.0), ("t1", "b", 10, 0, -1.0, 0.0), ("t2", "a", 10, 0, -1.0, 0.0)], 3, &["a@t1", "a@t2", "b@t1"]),
            // A loaded pool (queue depth 32) loses to an idle one with a little less room.
            (&[("t1", "a", 10, 0, 32.0, 0.0), ("t2", "a", 10, 1, 0.0, 0.0)], 1, &["a@t2"]),
            // A slow writer (10 ms a MiB) loses to a fast one of equal room.
            (&[("t1", "a", 10, 0, 0.0, 10000.0), ("t2", "a", 10, 0, 0.0, 100.0)], 1, &["a@t2"]),
            // But room wins over a little load: 90% free against 10% free.
            (&[("t1", "a", 10, 1, 2.0, 0.0), ("t2", "a", 10, 9, 0.0, 0.0)], 1, &["a@t1"]),
            // A full pool is never chosen; when all are full, nothing.
            (&[("t1", "a", 10, 10, -1.0, 0.0), ("t2", "a", 2, 0, -1.0, 0.0)], 3, &["a@t2", "a@t2", "none"]),
            // No pools at all.
            (&[], 1, &["none"]),
            // Four targets, two of them busy (queue depth 32, as after a benchmark): the
            // volume still spreads evenly, the idle ones first in each round. Before, the
            // load outweighed the spread and the busy targets got none of the first eight
            // (Flint's experiment: three of eight targets held nothing).
            (&[("t1", "a", 10, 0, 32.0, 0.0), ("t2", "a", 10, 0, 32.0, 0.0), ("t3", "a", 10, 0, 0.0, 0.0), ("t4", "a", 10, 0, 0.0, 0.0)], 8,
             &["a@t3", "a@t4", "a@t1", "a@t2", "a@t3", "a@t4", "a@t1", "a@t2"]),
            // Spread does not fill a target past its room: a small pool full, the others go on.
            (&[("t1", "a", 1, 0, -1.0, 0.0), ("t2", "a", 10, 0, -1.0, 0.0)], 3, &["a@t1", "a@t2", "a@t2"]),
        ];
        for (rows, n, expected) in cases {
            check(rows, *n, expected);
        }
    }

    #[test]
    fn stale_pools_are_skipped() {
        // Pools, the stale ones, extents placed, the pools expected.
        type Case<'a> = (&'a [Row], &'a [&'a str], usize, &'a [&'a str]);
        #[rustfmt::skip]
        let cases: &[Case] = &[
            // The emptiest, idle pool is stale: the fresh one takes every extent.
            (&[("t1", "a", 10, 0, 0.0, 0.0), ("t2", "a", 10, 8, 32.0, 10000.0)], &["a@t1"], 3, &["a@t2", "a@t2", "none"]),
            // A stale pool of a target whose other pool is fresh: only that one.
            (&[("t1", "a", 10, 0, -1.0, 0.0), ("t1", "b", 10, 0, -1.0, 0.0), ("t2", "a", 10, 0, -1.0, 0.0)], &["a@t2"], 2, &["a@t1", "b@t1"]),
            // Only stale pools have room: nothing, however much room.
            (&[("t1", "a", 10, 0, -1.0, 0.0), ("t2", "a", 10, 10, -1.0, 0.0)], &["a@t1"], 1, &["none"]),
            // Every pool stale.
            (&[("t1", "a", 10, 0, -1.0, 0.0), ("t2", "a", 10, 0, -1.0, 0.0)], &["a@t1", "a@t2"], 1, &["none"]),
            // None stale: as before.
            (&[("t1", "a", 10, 0, -1.0, 0.0), ("t2", "a", 10, 0, -1.0, 0.0)], &[], 2, &["a@t1", "a@t2"]),
        ];
        for (rows, stale, n, expected) in cases {
            check_stale(rows, stale, *n, expected);
        }
    }

    #[test]
    fn score_terms() {
        let c = &candidates(&[("t", "p", 4, 1, 4.0, 2000.0)])[0];
        let s = score(c, 3, 1);
        assert_eq!(
            s,
            Score {
                free_ppm: 750_000,
                load_ppm: 500_000,
                write_cost_ppm: 500_000,
                spread_ppm: 250_000,
                total: 4 * 750_000 - 2 * 500_000 - 500_000 - 3 * 250_000
            }
        );
        // Figures that are not numbers count as nothing, never as a panic.
        let mut c = c.clone();
        c.figures = Some(Figures { queue_depth: f64::NAN, write_cost_us_per_mib: f64::INFINITY, ..Figures::default() });
        let s = score(&c, 0, 0);
        assert_eq!((s.load_ppm, s.write_cost_ppm), (0, 0));
    }
}
