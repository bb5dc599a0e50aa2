//! What `nearstore volume rebalance` and `nearstore pool drain` move (docs/control-plane.md,
//! "Rebalancing and draining"): pure choices over the API's replies. Each extent chosen is
//! moved with the control plane's move API without a destination, so that the placement
//! score chooses it; one move at a time, each choice made on the state after the last.

use std::collections::BTreeMap;

use crate::model::{ClusterView, PoolId, PoolView, VolumeInfo};

/// Whether a pool takes an extent of `len` bytes now: fresh, with that much unallocated (the
/// placement's own test is a hole of that size; this one is what the books show).
fn takes(p: &PoolView, len: u64) -> bool {
    !p.stale && p.size.saturating_sub(p.allocated) >= len
}

/// The extent `volume rebalance` moves next: one of the target holding most of the
/// volume's extents (its highest index), while that target holds at least two more than
/// another target with a fresh pool that has room for one (which may hold none yet: a new
/// target's pool). None: balanced.
pub fn rebalance_next(info: &VolumeInfo, view: &ClusterView) -> Option<u64> {
    let len = info.volume.extent_size;
    let mut per_target: BTreeMap<&str, u64> = BTreeMap::new();
    for e in &info.extents {
        *per_target.entry(e.target.as_str()).or_default() += 1;
    }
    let (most, &n) = per_target.iter().max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))?;
    let fewest = view
        .pools
        .iter()
        .filter(|p| p.target != *most && takes(p, len))
        .map(|p| per_target.get(p.target.as_str()).copied().unwrap_or(0))
        .min()?;
    (n >= fewest + 2).then(|| info.extents.iter().rev().find(|e| e.target == *most).map(|e| e.index)).flatten()
}

/// The extents `pool drain` moves off `pool`: (volume, index, extent size) in volume and
/// index order.
pub fn drain_list(pool: &PoolId, infos: &[VolumeInfo]) -> Vec<(String, u64, u64)> {
    infos
        .iter()
        .flat_map(|v| {
            v.extents
                .iter()
                .filter(|e| e.pool == pool.name && e.target == pool.target)
                .map(|e| (v.volume.name.clone(), e.index, v.volume.extent_size))
        })
        .collect()
}

/// Whether the other fresh pools have room for every extent of `list` (each pool whole
/// extents of the largest size, a bound the placement can meet): Err says how much is
/// missing.
pub fn drain_room(pool: &PoolId, list: &[(String, u64, u64)], view: &ClusterView) -> Result<(), String> {
    let Some(len) = list.iter().map(|l| l.2).max() else { return Ok(()) };
    let others = view.pools.iter().filter(|p| !(p.pool == pool.name && p.target == pool.target) && !p.stale);
    let room: u64 = others.map(|p| p.size.saturating_sub(p.allocated) / len).sum();
    if room < list.len() as u64 {
        return Err(format!(
            "pool {pool} cannot be drained: it holds {} extents, and the other fresh pools have room for {room} of {len} bytes",
            list.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ExtentInfo, Volume};

    const MIB: u64 = 1 << 20;

    fn info(extents: &[&str]) -> VolumeInfo {
        let extents = extents
            .iter()
            .enumerate()
            .filter(|(_, t)| !t.is_empty())
            .map(|(i, t)| ExtentInfo {
                index: i as u64,
                pool: "p".into(),
                target: t.to_string(),
                path: String::new(),
                offset: 0,
                epoch: 1,
                nsid: 1,
                unwritten: false,
            })
            .collect::<Vec<_>>();
        VolumeInfo {
            volume: Volume { name: "v".into(), size: 8 * MIB, extent_size: MIB, created_ms: 0 },
            extents_total: 8,
            extents_allocated: extents.len() as u64,
            extents,
        }
    }

    /// Pools "p" of (target, MiB free, stale).
    fn view(pools: &[(&str, u64, bool)]) -> ClusterView {
        let pools = pools
            .iter()
            .map(|&(t, free, stale)| PoolView {
                pool: "p".into(),
                target: t.into(),
                path: String::new(),
                size: 8 * MIB,
                allocated: 8 * MIB - free * MIB,
                extents: 0,
                view: None,
                stale,
            })
            .collect();
        ClusterView { version: 1, targets: Vec::new(), pools }
    }

    #[test]
    fn rebalance_moves_from_the_fullest_target_while_another_has_two_fewer() {
        // (the volume's extents by index: their target, "" unallocated; the pools; the
        // extent expected)
        type Case<'a> = (&'a [&'a str], &'a [(&'a str, u64, bool)], Option<u64>);
        #[rustfmt::skip]
        let cases: &[Case] = &[
            // A fourth target joined empty: t1's highest extent goes.
            (&["t1", "t2", "t3", "t1", "t2", "t3"], &[("t1", 4, false), ("t2", 4, false), ("t3", 4, false), ("t4", 8, false)], Some(5 - 2)),
            (&["t1", "t1", "t1", "t2"], &[("t1", 4, false), ("t2", 4, false)], Some(2)),
            // One apart: balanced.
            (&["t1", "t1", "t2"], &[("t1", 4, false), ("t2", 4, false)], None),
            (&["t1", "t2", "t3", "t4"], &[("t1", 4, false), ("t2", 4, false), ("t3", 4, false), ("t4", 4, false)], None),
            // The empty target is stale, or full: nowhere to go.
            (&["t1", "t1", "t2", "t2"], &[("t1", 4, false), ("t2", 4, false), ("t3", 8, true)], None),
            (&["t1", "t1", "t2", "t2"], &[("t1", 4, false), ("t2", 4, false), ("t3", 0, false)], None),
            // Ties: the smaller target name is the fullest.
            (&["t2", "t1", "t2", "t1"], &[("t1", 4, false), ("t2", 4, false), ("t3", 8, false)], Some(3)),
            // Nothing allocated: nothing to move.
            (&["", ""], &[("t1", 4, false)], None),
            // A single target: nowhere else.
            (&["t1", "t1", "t1"], &[("t1", 4, false)], None),
        ];
        for (i, (extents, pools, want)) in cases.iter().enumerate() {
            assert_eq!(rebalance_next(&info(extents), &view(pools)), *want, "case {i}");
        }
    }

    #[test]
    fn drain_lists_the_pools_extents_and_checks_the_room_elsewhere() {
        let p1 = PoolId { target: "t1".into(), name: "p".into() };
        let list = drain_list(&p1, &[info(&["t1", "t2", "t1", ""])]);
        assert_eq!(list, vec![("v".to_string(), 0, MIB), ("v".to_string(), 2, MIB)]);
        // (the pools, whether the drain of p@t1's two extents fits)
        #[rustfmt::skip]
        let cases: &[(&[(&str, u64, bool)], bool)] = &[
            (&[("t1", 0, false), ("t2", 2, false)], true),
            (&[("t1", 8, false), ("t2", 1, false)], false),
            (&[("t1", 0, false), ("t2", 1, false), ("t3", 1, false)], true),
            (&[("t1", 0, false), ("t2", 1, false), ("t3", 4, true)], false),
        ];
        for (i, (pools, fits)) in cases.iter().enumerate() {
            let r = drain_room(&p1, &list, &view(pools));
            assert_eq!(r.is_ok(), *fits, "case {i}: {r:?}");
            if let Err(e) = r {
                assert!(e.contains("p@t1 cannot be drained: it holds 2 extents"), "{e}");
            }
        }
        assert_eq!(drain_room(&p1, &[], &view(&[])), Ok(()));
    }
}
