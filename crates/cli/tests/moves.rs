//! Moving extents as real processes (docs/control-plane.md, "Moving an extent"): a control
//! plane and three targets with a pool each; a volume exported by the first, its extents
//! moved between the pools (the exporter's own and its peers') while hosts write and read
//! them; `volume rebalance` onto a fourth target and `pool drain` under I/O.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{fails, free_port, member_target, metric, ok, Control, MemberConfig, Target};
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

/// Where each extent of `volume` lies: its target's address, by index.
fn targets_of(rt: &tokio::runtime::Runtime, c: &Client, volume: &str) -> Vec<String> {
    rt.block_on(c.volume(volume)).expect("volume").extents.iter().map(|e| e.target.clone()).collect()
}

/// The moves a `-o json` run of `volume rebalance` or `pool drain --wait` made: every one
/// published, each no faster than `max_bps` allows (loosely: half its extent's time).
fn published(out: &str, max_bps: u64) -> usize {
    let v: serde_json::Value = serde_json::from_str(out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let moves = v["moves"].as_array().expect("moves");
    for m in moves {
        assert_eq!(m["published"], true, "{m}");
        let least = MIB as f64 / max_bps as f64 / 2.0;
        assert!(m["seconds"].as_f64().expect("seconds") >= least, "faster than the cap: {m}");
    }
    moves.len()
}

#[test]
fn rebalance_and_drain_move_extents_under_io() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = Control::start(&dir.path().join("store"));
    let mut targets: Vec<Target> = (0..3).map(|i| target(dir.path(), i, &cp.a(), 64)).collect();
    let c = cp.client();
    wait_for_views(&c, 3);
    let rt = rt();
    let a = cp.a();
    // Errors, before anything moves: (arguments, what stderr says).
    #[rustfmt::skip]
    let cases: &[(&[&str], &str)] = &[
        (&["volume", "rebalance", "nope"], "no volume 'nope'"),
        (&["pool", "drain", "p9@127.0.0.1:1"], "no pool p9@127.0.0.1:1"),
        (&["pool", "drain", "p0"], "pool 'p0' is not NAME@TARGET"),
    ];
    for (args, said) in cases {
        let (_, err) = fails(&[args, &["--control", &a][..]].concat());
        assert!(err.contains(said), "{args:?}: {err}");
    }
    rt.block_on(c.create_volume(&CreateVolume { name: "vol".into(), size: 8 * MIB, extent_size: Some(MIB) })).expect("create");
    let t0 = targets[0].addr.to_string();
    let x = rt.block_on(c.export("vol", &ExportVolume { target: t0, hosts: vec![HOST.into()], allow_any_host: false })).expect("export");
    let (_c0, mut q0) = connect(&rt, targets[0].addr, &x.nqn);
    let per_extent = MIB / BLOCK as u64;
    for b in 0..8 * per_extent {
        rt.block_on(q0.write(1, b, &stamp(b, 0), BLOCK, false)).expect("first write");
    }
    // A host writes and reads back its blocks of every extent all along.
    let blocks: Vec<u64> = (0..8).flat_map(|e| [0, per_extent / 2, per_extent - 1].map(|o| e * per_extent + o)).collect();
    let (stop, ops) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let host = {
        let (addr, nqn, stop, ops, mine) = (targets[0].addr, x.nqn.clone(), stop.clone(), ops.clone(), blocks.clone());
        std::thread::spawn(move || hammer(addr, nqn, mine, stop, ops))
    };
    // A fourth target joins: the rebalance moves extents onto it, at most 8 MiB/s each.
    targets.push(target(dir.path(), 3, &a, 64));
    wait_for_views(&c, 4);
    let t3 = targets[3].addr.to_string();
    let before = targets_of(&rt, &c, "vol");
    assert!(!before.contains(&t3));
    let out = ok(&["volume", "rebalance", "vol", "--wait", "--max-bps", "8MiB", "-o", "json", "--control", &a]);
    assert!(published(&out, 8 * MIB) >= 1, "{out}");
    let after = targets_of(&rt, &c, "vol");
    let on = |t: &str| after.iter().filter(|x| *x == t).count();
    assert!(on(&t3) >= 1, "nothing moved onto the new target: {after:?}");
    let counts: Vec<usize> = targets.iter().map(|t| on(&t.addr.to_string())).collect();
    assert!(counts.iter().max().expect("max") - counts.iter().min().expect("min") <= 1, "not balanced: {counts:?}");
    // Balanced: a second rebalance moves nothing.
    let out = ok(&["volume", "rebalance", "vol", "--wait", "-o", "json", "--control", &a]);
    assert_eq!(published(&out, u64::MAX), 0, "{out}");
    // Drained: nothing left on the second target's pool.
    let t1 = targets[1].addr.to_string();
    let had = on(&t1);
    let out = ok(&["pool", "drain", &format!("p1@{t1}"), "--wait", "--max-bps", "16MiB", "-o", "json", "--control", &a]);
    assert_eq!(published(&out, 16 * MIB), had, "{out}");
    assert!(!targets_of(&rt, &c, "vol").contains(&t1), "the pool still holds extents");
    stop.store(true, Ordering::Relaxed);
    let versions = host.join().expect("the host saw a stale read or a lost write");
    assert!(ops.load(Ordering::Relaxed) > 30, "too little I/O raced the moves");
    let last: std::collections::HashMap<u64, u64> = blocks.into_iter().zip(versions).collect();
    let (_c1, mut q1) = connect(&rt, targets[0].addr, &x.nqn);
    for b in 0..8 * per_extent {
        let got = rt.block_on(q1.read(1, b, 1, BLOCK)).expect("read");
        assert!(got == stamp(b, last.get(&b).copied().unwrap_or(0)), "block {b} after the moves");
    }
    // A drain whose destination's target is killed (SIGKILL) mid-copy: the move is aborted,
    // the drain fails saying so, and the extent stays where it was, its data whole. The
    // exporter's pool is cordoned first, so the only destination is the fourth target's.
    let t2 = targets[2].addr.to_string();
    let p0 = PoolId { target: targets[0].addr.to_string(), name: "p0".into() };
    assert!(rt.block_on(c.cordon(&p0, true)).expect("cordon p0").cordoned);
    let mut drain = std::process::Command::new(env!("CARGO_BIN_EXE_nearstore"))
        .args(["pool", "drain", &format!("p2@{t2}"), "--wait", "--max-bps", "1MiB", "--control", &a])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("drain");
    let mut first = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(drain.stdout.take().expect("stdout")), &mut first).expect("first line");
    // "extent I of vol: p2@T2 -> pK@TK"
    let (index, to) = first.trim().strip_prefix("extent ").and_then(|l| l.split_once(" of vol: ")).expect(&first);
    let index: u64 = index.parse().expect("index");
    let to = to.rsplit_once('@').map(|(_, t)| t.to_string()).expect(&first);
    let k = targets.iter().position(|t| t.addr.to_string() == to).expect("a known target");
    assert_eq!(k, 3, "the placement chose a cordoned pool");
    std::thread::sleep(Duration::from_millis(300));
    let victim = targets.remove(k);
    let pid = victim.pid();
    drop(victim); // SIGKILL by its PID, and reaped
    let out = drain.wait_with_output().expect("drain ends");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "pid {pid} killed: {err}");
    assert!(err.contains(&format!("the move of extent {index} of 'vol'")) && err.contains("aborted"), "{err}");
    let e = extent(&rt, &c, "vol", index);
    assert_eq!(e.target, t2, "half-published: {e:?}");
    for b in index * per_extent..(index + 1) * per_extent {
        // As a host does, a read answered Namespace Not Ready (the extent's translation
        // slower than the target's 500 ms wait on a loaded machine) is tried again.
        let deadline = Instant::now() + Duration::from_secs(10);
        let got = loop {
            match rt.block_on(q1.read(1, b, 1, BLOCK)) {
                Ok(got) => break got,
                Err(nearstore_initiator::Error::Status { status, .. })
                    if status.sct == nearstore_wire::Status::NAMESPACE_NOT_READY.sct
                        && status.sc == nearstore_wire::Status::NAMESPACE_NOT_READY.sc
                        && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(100))
                }
                Err(e) => panic!("read of block {b} after the abort: {e}"),
            }
        };
        assert!(got == stamp(b, last.get(&b).copied().unwrap_or(0)), "block {b} after the aborted move");
    }
}

/// A compute command on a volume's extent while that extent moves (docs/control-plane.md,
/// "Moving an extent"): a sort runs on the exporter's own pool, slowed to 512 KiB/s (a rate
/// device under the pool, 1 MiB/s), reading the extent's second half and writing its output
/// into the first; the extent's move to a peer begins while it reads. The move
/// waits for the command (its placement's ticket, about 1 s, within the move's 5 s drain) and
/// then copies its output: the command's result is the local sort's, the move is published,
/// and the output reads back from the new place. (Before compute commands took tickets the
/// copy ran under the sort, and its output, written to the old place after the copy had
/// read that part, was lost.)
#[test]
fn a_move_waits_for_a_compute_command_on_its_extent() {
    use nearstore_compute::{by_name, Context, Outcome, SliceSource, VecSink};
    use nearstore_wire::compute::{Descriptor, Extent, Object};
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = Control::start(&dir.path().join("store"));
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
    // The slow pool is in the configuration, which then names the control plane too.
    let top = format!("metrics = \"{metrics}\"\ncontrol = \"{}\"", cp.a());
    let slow = dir.path().join("slow");
    let tables = format!(
        "[volume]\ntranslate_timeout_ms = 5000\n[[pool]]\nname = \"slow\"\npath = \"{}\"\nsize = \"8MiB\"\nrate_limit = \"1MiB\"",
        slow.display()
    );
    let more = MemberConfig { top: &top, cluster: "timeout_secs = 3", tables: &tables };
    let mut targets = vec![member_target(dir.path(), "t0", 0, &cp.a(), 64, more)];
    targets.extend((1..3).map(|i| target(dir.path(), i, &cp.a(), 64)));
    let c = cp.client();
    wait_for_views(&c, 4);
    let rt = rt();
    rt.block_on(c.create_volume(&CreateVolume { name: "cv".into(), size: 4 * MIB, extent_size: Some(MIB) })).expect("create");
    let t0 = targets[0].addr.to_string();
    let x =
        rt.block_on(c.export("cv", &ExportVolume { target: t0.clone(), hosts: vec![HOST.into()], allow_any_host: false })).expect("export");
    // Extent 0: text lines, then moved onto the slow pool.
    let mut text = Vec::new();
    for i in 0u64.. {
        if text.len() as u64 >= MIB {
            break;
        }
        text.extend_from_slice(format!("{:08}\n", (i * 7919) % 100_003).as_bytes());
    }
    text.truncate(MIB as usize);
    let (_c0, mut q) = connect(&rt, targets[0].addr, &x.nqn);
    for (i, chunk) in text.chunks(128 << 10).enumerate() {
        rt.block_on(q.write(1, (i as u64 * (128 << 10)) / BLOCK as u64, chunk, BLOCK, false)).expect("write");
    }
    let slow_pool = format!("slow@{t0}");
    if format!("{}@{}", extent(&rt, &c, "cv", 0).pool, t0) != slow_pool {
        rt.block_on(c.begin_move("cv", 0, &MoveRequest { to: Some(slow_pool.clone()), max_bps: 0 })).expect("move to the slow pool");
        wait_move(&rt, &c, "cv", 0);
    }
    let before = extent(&rt, &c, "cv", 0);
    assert_eq!(format!("{}@{}", before.pool, before.target), slow_pool);

    // The sort, on a connection of its own.
    // The input may end mid-line: its sorted output is a newline longer, so the output
    // object has a block more.
    let (input, out_off, n, out_n) = (512u64 << 10, 0, 512u64 << 10, (512u64 << 10) - 4096);
    let n = n - 4096 - 4096;
    let sort = by_name("sort").expect("sort");
    let object = |off: u64, len: u64| Object { len, extents: vec![Extent::data(off, len)] };
    let d = Descriptor { op: sort.id, args: b"{}".to_vec(), inputs: vec![object(input, n)], outputs: vec![object(out_off, out_n)] };
    let on_pool = metric(metrics, "nearstore_compute_on_pool_total");
    let (addr, nqn) = (targets[0].addr, x.nqn.clone());
    let sorting = std::thread::spawn(move || {
        let own = crate::rt();
        let (_c, mut q) = connect(&own, addr, &nqn);
        own.block_on(q.compute(1, &d.encode(), Duration::from_secs(60)))
    });
    // Once it reads, the extent moves to a peer's pool.
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(metrics, "nearstore_compute_reads_in_flight") == 0 {
        assert!(!sorting.is_finished() && Instant::now() < deadline, "the sort was never seen reading");
        std::thread::sleep(Duration::from_millis(2));
    }
    let to = format!("p1@{}", targets[1].addr);
    let m = rt.block_on(c.begin_move("cv", 0, &MoveRequest { to: Some(to.clone()), max_bps: 0 })).expect("move");
    let json = sorting.join().expect("the sort's thread").expect("the sort");
    wait_move(&rt, &c, "cv", 0);
    let after = extent(&rt, &c, "cv", 0);
    assert_eq!((format!("{}@{}", after.pool, after.target), after.epoch), (to, m.epoch + 1), "the move was not published");
    assert_eq!(metric(metrics, "nearstore_compute_on_pool_total"), on_pool + 1, "the sort did not run on the pool");
    // Its result and its output, read from the extent's new place, are the local sort's.
    let mut src = SliceSource::new([&text[input as usize..(input + n) as usize]]);
    let mut sink = VecSink::new(out_n);
    let want = sort.execute(b"{}", &mut [&mut src], &mut [&mut sink], &Context::default()).expect("local sort");
    let got: Vec<Outcome> = serde_json::from_slice(&json).expect("outcomes");
    assert_eq!(got.iter().map(Outcome::result).collect::<Vec<_>>(), want.iter().map(Outcome::result).collect::<Vec<_>>());
    let mut back = Vec::new();
    for at in (out_off..out_off + out_n).step_by(128 << 10) {
        let blocks = (128u64 << 10).min(out_off + out_n - at) / BLOCK as u64;
        back.extend(rt.block_on(q.read(1, at / BLOCK as u64, blocks as u32, BLOCK)).expect("read the output"));
    }
    assert!(back[..sink.data.len()] == sink.data[..], "the sort's output was lost by the move");
    // The input's extent half moved whole.
    for at in (input..MIB).step_by(128 << 10) {
        let rest = rt.block_on(q.read(1, at / BLOCK as u64, (128 << 10) / BLOCK, BLOCK)).expect("read");
        assert!(rest[..] == text[at as usize..at as usize + (128 << 10)], "the extent's text at {at} after the move");
    }
}
