//! What `nearstore volume rebalance` and `nearstore pool drain` move (docs/control-plane.md,
//! "Rebalancing and draining"): pure choices over the API's replies. A rebalance names each
//! move's destination (a pool of the target holding fewest of the volume's extents); a drain
//! moves each extent without one, so that the placement score chooses it. One move at a
//! time, each choice made on the state after the last.

use std::collections::BTreeMap;

use crate::limits::MOVES_MAX;
use crate::model::{ClusterView, PoolId, PoolView, VolumeInfo};

/// Whether a pool takes an extent of `len` bytes now: fresh, not cordoned, with that much
/// unallocated (the placement's own test is a hole of that size; this one is what the books
/// show).
fn takes(p: &PoolView, len: u64) -> bool {
    !p.stale && !p.cordoned && p.size.saturating_sub(p.allocated) >= len
}

/// The move `volume rebalance` makes next: (extent index, destination). The extent is the
/// highest-numbered of the target holding most of the volume's extents; the destination is
/// a pool of the target holding fewest among those with a fresh pool that has room for one
/// (a new target's empty pool counts), its pool with the most room. Only while the first
/// holds at least two more than the second: a move then lowers the spread (the sum of the
/// squares of the targets' counts falls by 2 * (most - fewest - 1)), so the rebalance ends.
/// Never to another pool of the same target, which would change nothing and could go back
/// and forth. None: balanced. Ties go to the smaller target (and pool) name.
pub fn rebalance_next(info: &VolumeInfo, view: &ClusterView) -> Option<(u64, PoolId)> {
    let len = info.volume.extent_size;
    let mut per_target: BTreeMap<&str, u64> = BTreeMap::new();
    for e in &info.extents {
        *per_target.entry(e.target.as_str()).or_default() += 1;
    }
    let (most, &n) = per_target.iter().max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))?;
    let count = |t: &str| per_target.get(t).copied().unwrap_or(0);
    let room = |p: &PoolView| p.size.saturating_sub(p.allocated);
    // The fewest extents first, then the most room, then the names.
    let to = view.pools.iter().filter(|p| p.target != *most && takes(p, len)).min_by(|a, b| {
        count(&a.target).cmp(&count(&b.target)).then(room(b).cmp(&room(a))).then_with(|| (&a.target, &a.pool).cmp(&(&b.target, &b.pool)))
    })?;
    if n < count(&to.target) + 2 {
        return None;
    }
    let index = info.extents.iter().rev().find(|e| e.target == *most)?.index;
    Some((index, PoolId { target: to.target.clone(), name: to.pool.clone() }))
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
    let others = view.pools.iter().filter(|p| !(p.pool == pool.name && p.target == pool.target) && !p.stale && !p.cordoned);
    let room: u64 = others.map(|p| p.size.saturating_sub(p.allocated) / len).sum();
    if room < list.len() as u64 {
        return Err(format!(
            "pool {pool} cannot be drained: it holds {} extents, and the other fresh pools have room for {room} of {len} bytes",
            list.len()
        ));
    }
    Ok(())
}

/// Whether a volume with an extent in `pool` has a writer in doubt (its last exporter, or
/// its exporter's earlier processes, may still write to it: docs/control-plane.md,
/// "Handing an export over", as the control plane said in `VolumeInfo::in_doubt`): its
/// extents cannot move until that ends, so the drain is refused before it cordons the pool.
pub fn drain_handovers(pool: &PoolId, infos: &[VolumeInfo]) -> Result<(), String> {
    let on_pool = |v: &VolumeInfo| v.extents.iter().any(|e| e.pool == pool.name && e.target == pool.target);
    match infos.iter().filter(|v| on_pool(v)).find_map(|v| v.in_doubt.as_ref().map(|d| (v, d))) {
        Some((v, d)) => Err(format!(
            "pool {pool} cannot be drained now: volume '{}' was exported by {}{}, which may still write to its extents \
             (at most {} s more): try again once it said it stopped",
            v.volume.name,
            d.target,
            if d.restarted { " (its earlier process: it restarted)" } else { "" },
            d.seconds_left
        )),
        None => Ok(()),
    }
}

/// Whether a drain of `extents` extents may begin all its moves at once (without `--wait`)
/// while `under_way` moves are: the control plane takes at most MOVES_MAX at a time, so a
/// larger drain is refused before it begins any, rather than failing part-way.
pub fn drain_fits_moves(pool: &PoolId, extents: usize, under_way: usize) -> Result<(), String> {
    if extents + under_way > MOVES_MAX {
        return Err(format!(
            "pool {pool} holds {extents} extents: without --wait a drain begins all its moves at once, and at most {MOVES_MAX} \
             moves may be under way ({under_way} are): drain it with --wait, which moves one extent after another"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ExtentInfo, InDoubt, Volume};

    const MIB: u64 = 1 << 20;

    /// A volume of 8 extents of 1 MiB: by index, "TARGET" (pool "p") or "TARGET/POOL", ""
    /// unallocated.
    fn info(extents: &[&str]) -> VolumeInfo {
        let extents = extents
            .iter()
            .enumerate()
            .filter(|(_, t)| !t.is_empty())
            .map(|(i, t)| {
                let (target, pool) = t.split_once('/').unwrap_or((t, "p"));
                ExtentInfo {
                    index: i as u64,
                    pool: pool.into(),
                    target: target.into(),
                    path: String::new(),
                    offset: 0,
                    epoch: 1,
                    nsid: 1,
                    unwritten: false,
                }
            })
            .collect::<Vec<_>>();
        VolumeInfo {
            volume: Volume { name: "v".into(), size: 8 * MIB, extent_size: MIB, created_ms: 0, handover: None },
            extents_total: 8,
            extents_allocated: extents.len() as u64,
            extents,
            in_doubt: None,
        }
    }

    /// Pools of 8 MiB: ("TARGET" for pool "p", or "TARGET/POOL"; MiB free; stale).
    fn view(pools: &[(&str, u64, bool)]) -> ClusterView {
        let pools = pools
            .iter()
            .map(|&(t, free, stale)| {
                let (target, pool) = t.split_once('/').unwrap_or((t, "p"));
                PoolView {
                    pool: pool.into(),
                    target: target.into(),
                    path: String::new(),
                    size: 8 * MIB,
                    allocated: 8 * MIB - free * MIB,
                    extents: 0,
                    view: None,
                    stale,
                    cordoned: false,
                    write_cost: 0.0,
                }
            })
            .collect();
        ClusterView { version: 1, targets: Vec::new(), pools, links: Vec::new() }
    }

    #[test]
    fn rebalance_moves_from_the_fullest_target_to_the_emptiest() {
        // (the volume's extents by index; the pools; the move expected: extent, pool)
        type Case<'a> = (&'a [&'a str], &'a [(&'a str, u64, bool)], Option<(u64, &'a str)>);
        #[rustfmt::skip]
        let cases: &[Case] = &[
            // A fourth target joined empty: t1's highest extent goes there.
            (&["t1", "t2", "t3", "t1", "t2", "t3"], &[("t1", 4, false), ("t2", 4, false), ("t3", 4, false), ("t4", 8, false)], Some((3, "p@t4"))),
            (&["t1", "t1", "t1", "t2"], &[("t1", 4, false), ("t2", 4, false)], Some((2, "p@t2"))),
            // One apart: balanced.
            (&["t1", "t1", "t2"], &[("t1", 4, false), ("t2", 4, false)], None),
            (&["t1", "t2", "t3", "t4"], &[("t1", 4, false), ("t2", 4, false), ("t3", 4, false), ("t4", 4, false)], None),
            // The empty target is stale, or full: nowhere to go.
            (&["t1", "t1", "t2", "t2"], &[("t1", 4, false), ("t2", 4, false), ("t3", 8, true)], None),
            (&["t1", "t1", "t2", "t2"], &[("t1", 4, false), ("t2", 4, false), ("t3", 0, false)], None),
            // Ties: the smaller target name is the fullest.
            (&["t2", "t1", "t2", "t1"], &[("t1", 4, false), ("t2", 4, false), ("t3", 8, false)], Some((3, "p@t3"))),
            // Nothing allocated: nothing to move.
            (&["", ""], &[("t1", 4, false)], None),
            // A single target: nowhere else, not even its second pool.
            (&["t1", "t1", "t1"], &[("t1", 4, false)], None),
            (&["t1/a", "t1/a", "t1/a", "t1/a"], &[("t1/a", 4, false), ("t1/b", 8, false)], None),
            // Two pools on the fullest target, the emptier one of them bigger than any other
            // target's: the move still goes to another target.
            (&["t1/a", "t1/a", "t1/a", "t2"], &[("t1/a", 1, false), ("t1/b", 8, false), ("t2", 2, false)], Some((2, "p@t2"))),
            // The emptiest target's pool with the most room; then the smaller name.
            (&["t1", "t1", "t1", "t1", "t2"], &[("t1", 4, false), ("t2", 4, false), ("t3/a", 2, false), ("t3/b", 6, false)], Some((3, "b@t3"))),
            (&["t1", "t1", "t1", "t2"], &[("t1", 4, false), ("t2", 4, false), ("t3/b", 6, false), ("t3/a", 6, false)], Some((2, "a@t3"))),
            // Of two targets holding fewest, the one with the most room.
            (&["t1", "t1", "t1"], &[("t1", 4, false), ("t2", 2, false), ("t3", 5, false)], Some((2, "p@t3"))),
        ];
        for (i, (extents, pools, want)) in cases.iter().enumerate() {
            let got = rebalance_next(&info(extents), &view(pools)).map(|(e, p)| (e, p.to_string()));
            assert_eq!(got, want.map(|(e, p)| (e, p.to_string())), "case {i}");
        }
    }

    /// A whole rebalance, each move applied to the books before the next choice: it ends,
    /// each move between two targets, with the targets' counts at most one apart. (Moved
    /// without a destination, an extent of a target with two pools could go to its other
    /// pool and back, the counts never changing, for as many moves as the volume has
    /// extents.)
    #[test]
    fn a_rebalance_ends_balanced_and_never_moves_within_a_target() {
        // (the volume's extents; the pools; moves expected)
        type Case<'a> = (&'a [&'a str], &'a [(&'a str, u64, bool)], usize);
        #[rustfmt::skip]
        let cases: &[Case] = &[
            (&["t1/a", "t1/a", "t1/a", "t1/a", "t1/a", "t1/a", "t2", "t2"], &[("t1/a", 2, false), ("t1/b", 8, false), ("t2", 6, false), ("t3", 8, false)], 3),
            (&["t1", "t1", "t1", "t1", "t1", "t1", "t1", "t1"], &[("t1", 0, false), ("t2/a", 8, false), ("t2/b", 8, false), ("t3", 8, false), ("t4", 8, false)], 6),
            (&["t1", "t2", "t1", "t2"], &[("t1", 6, false), ("t2", 6, false), ("t3", 8, false)], 1),
            (&["t1/a", "t1/b", "t1/a", "t1/b"], &[("t1/a", 6, false), ("t1/b", 6, false)], 0),
        ];
        for (i, (extents, pools, want)) in cases.iter().enumerate() {
            let (mut info, mut view) = (info(extents), view(pools));
            let mut moves = 0;
            while let Some((index, to)) = rebalance_next(&info, &view) {
                assert!(moves < 8, "case {i}: no end");
                let e = info.extents.iter_mut().find(|e| e.index == index).expect("the extent");
                assert_ne!(e.target, to.target, "case {i}: moved within target {}", to.target);
                for p in view.pools.iter_mut() {
                    if (p.target == e.target && p.pool == e.pool) || (p.target == to.target && p.pool == to.name) {
                        p.allocated = if p.target == to.target { p.allocated + MIB } else { p.allocated - MIB };
                    }
                }
                (e.target, e.pool) = (to.target, to.name);
                moves += 1;
            }
            assert_eq!(moves, *want, "case {i}");
            let mut per: BTreeMap<&str, u64> = view.pools.iter().filter(|p| !p.stale).map(|p| (p.target.as_str(), 0)).collect();
            info.extents.iter().for_each(|e| *per.entry(e.target.as_str()).or_default() += 1);
            let (lo, hi) = (per.values().min().copied().unwrap_or(0), per.values().max().copied().unwrap_or(0));
            assert!(hi - lo <= 1, "case {i}: not balanced: {per:?}");
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
        // A cordoned pool is no room.
        let mut v = view(&[("t1", 0, false), ("t2", 2, false)]);
        v.pools[1].cordoned = true;
        assert!(drain_room(&p1, &list, &v).is_err());
    }

    #[test]
    fn a_drain_waits_for_the_writers_in_doubt_of_its_volumes() {
        let p1 = PoolId { target: "t1".into(), name: "p".into() };
        let mut v = info(&["t1", "t2"]);
        assert_eq!(drain_handovers(&p1, std::slice::from_ref(&v)), Ok(()));
        v.in_doubt = Some(InDoubt { target: "t9".into(), seconds_left: 5, restarted: false });
        let e = drain_handovers(&p1, std::slice::from_ref(&v)).expect_err("under a handover");
        assert!(e.contains("volume 'v' was exported by t9,") && e.contains("at most 5 s more"), "{e}");
        v.in_doubt = Some(InDoubt { target: "t8".into(), seconds_left: 2, restarted: true });
        let e = drain_handovers(&p1, std::slice::from_ref(&v)).expect_err("restarted");
        assert!(e.contains("exported by t8 (its earlier process: it restarted)") && e.contains("at most 2 s more"), "{e}");
        // On another pool: no matter.
        let p3 = PoolId { target: "t3".into(), name: "p".into() };
        assert_eq!(drain_handovers(&p3, &[v]), Ok(()));
    }

    #[test]
    fn a_drain_without_wait_fits_the_moves_limit_or_is_refused() {
        let p = PoolId { target: "t1".into(), name: "p".into() };
        // (extents to move, moves under way, whether it may begin)
        let cases = [
            (0, 0, true),
            (MOVES_MAX, 0, true),
            (MOVES_MAX + 1, 0, false),
            (MOVES_MAX - 3, 3, true),
            (MOVES_MAX - 3, 4, false),
            (1, MOVES_MAX, false),
        ];
        for (extents, under_way, fits) in cases {
            let r = drain_fits_moves(&p, extents, under_way);
            assert_eq!(r.is_ok(), fits, "{extents} + {under_way}: {r:?}");
            if let Err(e) = r {
                assert!(e.contains(&format!("pool p@t1 holds {extents} extents")) && e.contains("--wait"), "{e}");
            }
        }
    }

    /// A cordoned pool is no destination of a rebalance.
    #[test]
    fn a_rebalance_skips_cordoned_pools() {
        let mut v = view(&[("t1", 4, false), ("t2", 8, false), ("t3", 6, false)]);
        let i = info(&["t1", "t1", "t1"]);
        assert_eq!(rebalance_next(&i, &v).map(|(_, p)| p.to_string()), Some("p@t2".into()));
        v.pools[1].cordoned = true;
        assert_eq!(rebalance_next(&i, &v).map(|(_, p)| p.to_string()), Some("p@t3".into()));
        v.pools[2].cordoned = true;
        assert_eq!(rebalance_next(&i, &v), None);
    }
}
