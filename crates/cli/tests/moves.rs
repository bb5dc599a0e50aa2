//! Moving extents as real processes (docs/control-plane.md, "Moving an extent"): a control
//! plane and three targets with a pool each; a volume exported by the first, its extents
//! moved between the pools (the exporter's own and its peers') while hosts write and read
//! them; the moves of an unexported volume; copiers and pools killed mid-copy.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{member_target, Control, MemberConfig, Target};
use nearstore_control::client::Client;
use nearstore_control::model::*;
use nearstore_initiator::{ConnectOptions, Controller, IoQueue};

const MIB: u64 = 1 << 20;
const BLOCK: u32 = 4096;
const HOST: &str = "nqn.2026-11.io.nearstore:host-a";

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

/// Target `i`: member `MEMBERS[i]` trusting all three, one pool of `pool_mib` MiB.
fn target(dir: &Path, i: usize, control: &str, pool_mib: u64) -> Target {
    let more = MemberConfig { cluster: "timeout_secs = 3", tables: "[volume]\ntranslate_timeout_ms = 5000", ..Default::default() };
    member_target(dir, &format!("t{i}"), i, control, pool_mib, more)
}

/// Connects once the target has learnt the export (10 s at most).
fn connect(rt: &tokio::runtime::Runtime, addr: SocketAddr, nqn: &str) -> (Controller, IoQueue) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut o = ConnectOptions::new(addr, nqn);
        o.hostnqn = HOST.into();
        o.hostid = *uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, HOST.as_bytes()).as_bytes();
        o.timeout = Duration::from_secs(20);
        match rt.block_on(Controller::connect(o)) {
            Ok(c) => {
                let q = rt.block_on(c.io_queue(1)).expect("I/O queue");
                return (c, q);
            }
            Err(e) => assert!(Instant::now() < deadline, "the target did not serve {nqn}: {e}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Block `b`'s contents at version `v`: every byte says both.
fn stamp(b: u64, v: u64) -> Vec<u8> {
    let mut d = vec![0u8; BLOCK as usize];
    for c in d.chunks_mut(16) {
        c[..8].copy_from_slice(&b.to_le_bytes());
        c[8..].copy_from_slice(&v.to_le_bytes());
    }
    d
}

fn wait_for_views(c: &Client, pools: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while rt().block_on(c.view(0)).map(|v| v.pools.iter().filter(|p| p.view.is_some()).count()).unwrap_or(0) < pools {
        assert!(Instant::now() < deadline, "the targets did not register their pools");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until the move of extent `index` ended (published or aborted); 30 s at most.
fn wait_move(rt: &tokio::runtime::Runtime, c: &Client, volume: &str, index: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match rt.block_on(c.get_move(volume, index)) {
            Err(e) if e.code() == Some(ErrorCode::MoveNotFound) => return,
            Ok(m) => assert!(Instant::now() < deadline, "the move did not end: {m:?}"),
            Err(e) => panic!("asking for the move: {e}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn extent(rt: &tokio::runtime::Runtime, c: &Client, volume: &str, index: u64) -> ExtentInfo {
    rt.block_on(c.translate(volume, index)).expect("translate").extent.expect("allocated")
}

/// One host's queue writing and reading back its own blocks of the moving extents, each
/// write a new version: a read that returns anything but the last version written is a
/// stale read or a lost write. Returns the operations it made.
fn hammer(addr: SocketAddr, nqn: String, blocks: Vec<u64>, stop: Arc<AtomicBool>, ops: Arc<AtomicU64>) -> Vec<u64> {
    let rt = rt();
    let (_c, mut q) = connect(&rt, addr, &nqn);
    let mut versions = vec![0u64; blocks.len()];
    let mut turn = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let i = turn % blocks.len();
        let b = blocks[i];
        versions[i] += 1;
        let data = stamp(b, versions[i]);
        rt.block_on(q.write(1, b, &data, BLOCK, false)).unwrap_or_else(|e| panic!("write of block {b} v{}: {e}", versions[i]));
        // This block, and the one written before it (its write some time ago, maybe before
        // a move was published).
        for j in [i, (turn + blocks.len() - 1) % blocks.len()] {
            let got = rt.block_on(q.read(1, blocks[j], 1, BLOCK)).unwrap_or_else(|e| panic!("read of block {}: {e}", blocks[j]));
            assert!(got == stamp(blocks[j], versions[j]), "block {} read {:?}.., wrote v{} last", blocks[j], &got[..16], versions[j]);
        }
        ops.fetch_add(3, Ordering::Relaxed);
        turn += 1;
    }
    versions
}

#[test]
fn moves_under_io_never_read_stale_nor_lose_a_write() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = Control::start(&dir.path().join("store"));
    let targets: Vec<Target> = (0..3).map(|i| target(dir.path(), i, &cp.a(), 64)).collect();
    let c = cp.client();
    wait_for_views(&c, 3);
    let rt = rt();
    rt.block_on(c.create_volume(&CreateVolume { name: "vol".into(), size: 4 * MIB, extent_size: Some(MIB) })).expect("create");
    let t0 = targets[0].addr.to_string();
    let x = rt
        .block_on(c.export("vol", &ExportVolume { target: t0.clone(), hosts: vec![HOST.into()], allow_any_host: false }))
        .expect("export");
    // Every extent written once (allocated), block by block with version 0's stamps.
    let (_c0, mut q0) = connect(&rt, targets[0].addr, &x.nqn);
    let per_extent = MIB / BLOCK as u64;
    for b in 0..4 * per_extent {
        rt.block_on(q0.write(1, b, &stamp(b, 0), BLOCK, false)).expect("first write");
    }
    // Two queues on extents 0 and 1 (blocks interleaved, at both ends and in the middle of
    // each extent); extents 2 and 3 keep version 0.
    let offsets = [0, 1, 2, 3, per_extent / 2, per_extent / 2 + 1, per_extent - 2, per_extent - 1];
    let blocks: Vec<u64> = (0..2).flat_map(|e| offsets.iter().map(move |o| e * per_extent + o)).collect();
    let (stop, ops) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let hammers: Vec<_> = (0..2)
        .map(|k| {
            let mine: Vec<u64> = blocks.iter().copied().filter(|b| b % 2 == k as u64).collect();
            let (addr, nqn, stop, ops) = (targets[0].addr, x.nqn.clone(), stop.clone(), ops.clone());
            std::thread::spawn(move || (mine.clone(), hammer(addr, nqn, mine, stop, ops)))
        })
        .collect();
    // Each round moves extents 0 and 1 to the next target's pool: from and to the
    // exporter's own pool and its peers'.
    let pools: Vec<String> = (0..3).map(|i| format!("p{i}@{}", targets[i].addr)).collect();
    let mut moved = 0;
    for round in 0..6 {
        for index in 0..2u64 {
            let before = extent(&rt, &c, "vol", index);
            let at = pools.iter().position(|p| *p == format!("{}@{}", before.pool, before.target)).expect("a known pool");
            let to = pools[(at + 1 + round % 2) % 3].clone();
            let seen = ops.load(Ordering::Relaxed);
            let m = rt.block_on(c.begin_move("vol", index, &MoveRequest { to: Some(to.clone()), max_bps: 0 })).expect("move");
            assert_eq!((m.epoch, m.copier.as_str()), (before.epoch, t0.as_str()), "the exporter copies");
            wait_move(&rt, &c, "vol", index);
            let after = extent(&rt, &c, "vol", index);
            assert_eq!((format!("{}@{}", after.pool, after.target), after.epoch), (to, before.epoch + 1), "round {round} extent {index}");
            // The hosts went on meanwhile (their I/O to the extent queued, not failed).
            let deadline = Instant::now() + Duration::from_secs(10);
            while ops.load(Ordering::Relaxed) < seen + 30 {
                assert!(Instant::now() < deadline, "no I/O after the move of extent {index}");
                std::thread::sleep(Duration::from_millis(5));
            }
            moved += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut last = std::collections::HashMap::new();
    for h in hammers {
        let (mine, versions) = h.join().expect("a host saw a stale read or a lost write");
        last.extend(mine.into_iter().zip(versions));
    }
    assert_eq!(moved, 12);
    assert!(ops.load(Ordering::Relaxed) > 100, "too little I/O raced the moves: {}", ops.load(Ordering::Relaxed));
    // A new connection reads every block at its last version.
    let (_c1, mut q1) = connect(&rt, targets[0].addr, &x.nqn);
    for b in 0..4 * per_extent {
        let got = rt.block_on(q1.read(1, b, 1, BLOCK)).expect("read");
        assert!(got == stamp(b, last.get(&b).copied().unwrap_or(0)), "block {b} after the moves");
    }
}
