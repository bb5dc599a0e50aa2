//! Exported volumes as real processes: a control plane and three targets with a pool each,
//! a volume whose extents lie on all three, exported by one of them and reached with our
//! initiator; who may connect (the volume's hosts, the pool subsystem's members); and the
//! control plane killed under it (docs/control-plane.md, "The data path").

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{fails, free_port, member_target, metric, nearstore, ok, restart_member_target, Control, MemberConfig, Target, MEMBERS};
use nearstore_control::client::Client;
use nearstore_control::model::*;
use nearstore_initiator::{ConnectOptions, Controller, Error as InitiatorError, IoQueue};
use nearstore_wire::Status;

const MIB: u64 = 1 << 20;
const BLOCK: u32 = 4096;
const HOST: &str = "nqn.2026-11.io.nearstore:host-a";
const STRANGER: &str = "nqn.2026-11.io.nearstore:host-b";
const POOLS_NQN: &str = "nqn.2026-11.io.nearstore:pools";

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

/// Target `i` (0-based): member `MEMBERS[i]` trusting all three, a small memory namespace,
/// one pool of 64 MiB, a control plane wait of 500 ms.
fn target(dir: &Path, i: usize, control: &str) -> Target {
    let more = MemberConfig { tables: "[volume]\ntranslate_timeout_ms = 500", ..Default::default() };
    member_target(dir, &format!("t{i}"), i, control, 64, more)
}

fn connect_as(
    rt: &tokio::runtime::Runtime,
    addr: SocketAddr,
    nqn: &str,
    host: &str,
    acting_for: Option<&str>,
) -> Result<Controller, InitiatorError> {
    let mut o = ConnectOptions::new(addr, nqn);
    o.hostnqn = host.into();
    o.hostid = *uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, host.as_bytes()).as_bytes();
    o.acting_for = acting_for.map(str::to_string);
    o.timeout = Duration::from_secs(5);
    rt.block_on(Controller::connect(o))
}

/// Connects once the target has learnt the export (10 s at most).
fn connect_when_exported(rt: &tokio::runtime::Runtime, addr: SocketAddr, nqn: &str) -> (Controller, IoQueue) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut o = ConnectOptions::new(addr, nqn);
        o.hostnqn = HOST.into();
        o.hostid = *uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, HOST.as_bytes()).as_bytes();
        match rt.block_on(Controller::connect(o)) {
            Ok(c) => {
                let q = rt.block_on(c.io_queue(1)).expect("I/O queue");
                return (c, q);
            }
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("the target did not serve {nqn}: {e}"),
        }
    }
}

fn status_of(e: &InitiatorError) -> Option<Status> {
    match e {
        InitiatorError::Status { status, .. } => Some(*status),
        _ => None,
    }
}

/// The largest transfer of one command (MDTS, docs/protocol.md).
const CHUNK: u64 = 128 << 10;

/// Writes `data` at `off` in commands of at most CHUNK bytes, and into the model.
fn write(rt: &tokio::runtime::Runtime, q: &mut IoQueue, off: u64, data: &[u8], model: &mut [u8]) {
    for (i, c) in data.chunks(CHUNK as usize).enumerate() {
        let at = off + i as u64 * CHUNK;
        rt.block_on(q.write(1, at / BLOCK as u64, c, BLOCK, false)).unwrap_or_else(|e| panic!("write {at}+{}: {e}", c.len()));
    }
    model[off as usize..off as usize + data.len()].copy_from_slice(data);
}

/// Reads `len` bytes at `off` in commands of at most CHUNK bytes and compares with the model.
fn check(rt: &tokio::runtime::Runtime, q: &mut IoQueue, off: u64, len: u64, model: &[u8]) {
    for at in (off..off + len).step_by(CHUNK as usize) {
        let n = CHUNK.min(off + len - at);
        let got =
            rt.block_on(q.read(1, at / BLOCK as u64, (n / BLOCK as u64) as u32, BLOCK)).unwrap_or_else(|e| panic!("read {at}+{n}: {e}"));
        assert!(got == model[at as usize..(at + n) as usize], "read {at}+{n} differs from what was written");
    }
}

/// A recognisable pattern for the bytes at volume offset `off`.
fn pattern(off: u64, len: usize, seed: u8) -> Vec<u8> {
    (0..len as u64).map(|i| (((off + i) / 512) as u8).wrapping_mul(31).wrapping_add(seed) | 1).collect()
}

/// Waits until the control plane's view has `pools` pools with a view.
fn wait_for_views(c: &Client, pools: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while rt().block_on(c.view(0)).map(|v| v.pools.iter().filter(|p| p.view.is_some()).count()).unwrap_or(0) < pools {
        assert!(Instant::now() < deadline, "the targets did not register their pools");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_volume_over_three_targets() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("store");
    let cp = Control::start(&store);
    let targets: Vec<Target> = (0..3).map(|i| target(dir.path(), i, &cp.a())).collect();
    let c = cp.client();
    wait_for_views(&c, 3);
    let rt = rt();
    let a = cp.a();
    ok(&["volume", "create", "vol", "--size", "12MiB", "--extent-size", "1MiB", "--control", &a]);
    let t0 = targets[0].addr.to_string();
    let x: Export =
        serde_json::from_str(&ok(&["volume", "export", "vol", "--target", &t0, "--allow-host", HOST, "--control", &a, "-o", "json"]))
            .expect("export json");
    assert_eq!((x.nqn.as_str(), x.nsid, x.hosts.as_slice()), ("nqn.2026-11.io.nearstore:volume:vol", 1, &[HOST.to_string()][..]));
    // Exported by one target at a time; an exported volume is not deleted.
    let (_, err) = fails(&["volume", "export", "vol", "--target", &targets[1].addr.to_string(), "--allow-any-host", "--control", &a, "-v"]);
    assert!(err.contains("(volume_exported)"), "{err}");
    let (_, err) = fails(&["volume", "delete", "vol", "--control", &a, "-v"]);
    assert!(err.contains("unexport it first") && err.contains("(volume_exported)"), "{err}");

    let (ctrl, mut q) = connect_when_exported(&rt, targets[0].addr, &x.nqn);
    let id = rt.block_on(ctrl.identify_namespace(1)).expect("identify");
    assert_eq!((id.nsze, id.block_size()), (12 * MIB / BLOCK as u64, BLOCK));

    // Writes within extents, across one and two boundaries, at block edges around them.
    // (offset, length) in bytes.
    #[rustfmt::skip]
    let writes: &[(u64, u64)] = &[
        (0, 4096), (MIB - 4096, 8192), (2 * MIB - 4096, 4096), (2 * MIB, 4096),
        (3 * MIB - 8192, MIB + 16384), (5 * MIB + 4096, 4096), (6 * MIB - 4096, 4096),
    ];
    let mut model = vec![0u8; (12 * MIB) as usize];
    for (i, &(off, len)) in writes.iter().enumerate() {
        write(&rt, &mut q, off, &pattern(off, len as usize, i as u8), &mut model);
    }
    rt.block_on(q.flush(1)).expect("flush");
    check(&rt, &mut q, 0, 8 * MIB, &model);
    // Extents 0 to 5 are allocated, on all three targets; 6 to 11 are not, and read as zeros.
    let info = rt.block_on(c.volume("vol")).expect("info");
    assert_eq!(info.extents.iter().map(|e| e.index).collect::<Vec<_>>(), (0..6).collect::<Vec<_>>());
    let holders: std::collections::BTreeSet<&str> = info.extents.iter().map(|e| e.target.as_str()).collect();
    assert_eq!(holders.len(), 3, "{holders:?}");
    check(&rt, &mut q, 6 * MIB, 6 * MIB, &model);
    assert_eq!(rt.block_on(c.volume("vol")).expect("info").extents_allocated, 6, "a read allocated an extent");

    // Who may connect: not a host the export does not name; to a pool subsystem, only a
    // member for itself, neither a host nor a member acting for one.
    let refused = |r: Result<Controller, InitiatorError>, what: &str| match r {
        Err(e) => assert_eq!(status_of(&e).map(|s| Status { dnr: false, ..s }), Some(Status::CONNECT_INVALID_HOST), "{what}: {e}"),
        Ok(_) => panic!("{what}: admitted"),
    };
    refused(connect_as(&rt, targets[0].addr, &x.nqn, STRANGER, None), "a host the export does not name");
    refused(connect_as(&rt, targets[1].addr, POOLS_NQN, HOST, None), "a host on a pool subsystem");
    refused(connect_as(&rt, targets[1].addr, POOLS_NQN, MEMBERS[0], Some(HOST)), "a member acting for a host on a pool subsystem");
    connect_as(&rt, targets[1].addr, POOLS_NQN, MEMBERS[0], None).expect("a member on a pool subsystem");

    // The control plane killed: cached extents keep serving; a miss fails within the bounded
    // wait with Namespace Not Ready, which a host retries.
    cp.kill();
    check(&rt, &mut q, 0, 6 * MIB, &model);
    write(&rt, &mut q, 4 * MIB - 4096, &pattern(4 * MIB, 8192, 99), &mut model);
    let start = Instant::now();
    let e = rt.block_on(q.read(1, 9 * MIB / BLOCK as u64, 1, BLOCK)).expect_err("a miss without a control plane");
    assert_eq!(status_of(&e), Some(Status::NAMESPACE_NOT_READY), "{e}");
    let e = rt.block_on(q.write(1, 10 * MIB / BLOCK as u64, &pattern(10 * MIB, 4096, 7), BLOCK, false)).expect_err("an allocation");
    assert_eq!(status_of(&e), Some(Status::NAMESPACE_NOT_READY), "{e}");
    assert!(start.elapsed() < Duration::from_secs(5), "misses waited {:?}", start.elapsed());

    // Back on its address: the misses succeed, and nothing was lost.
    let cp = Control::start_on(&store, &a);
    let data = pattern(10 * MIB, 4096, 7);
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Err(e) = rt.block_on(q.write(1, 10 * MIB / BLOCK as u64, &data, BLOCK, false)) {
        assert!(Instant::now() < deadline, "writes still fail with the control plane back: {e}");
        std::thread::sleep(Duration::from_millis(100));
    }
    model[(10 * MIB) as usize..(10 * MIB + 4096) as usize].copy_from_slice(&data);
    check(&rt, &mut q, 0, 12 * MIB, &model);

    // Exported again to any host: the target replaces the subsystem, and the host it refused
    // comes in and reads what was written.
    ok(&["volume", "export", "vol", "--target", &t0, "--allow-any-host", "--control", &cp.a()]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let stranger = loop {
        match connect_as(&rt, targets[0].addr, &x.nqn, STRANGER, None) {
            Ok(s) => break s,
            Err(e) => assert!(Instant::now() < deadline, "the target did not take the new hosts: {e}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut sq = rt.block_on(stranger.io_queue(1)).expect("I/O queue");
    check(&rt, &mut sq, 0, 12 * MIB, &model);

    // Unexported: the target removes the subsystem, and the volume can go.
    ok(&["volume", "unexport", "vol", "--control", &cp.a()]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while connect_as(&rt, targets[0].addr, &x.nqn, HOST, None).is_ok() {
        assert!(Instant::now() < deadline, "the target still serves an unexported volume");
        std::thread::sleep(Duration::from_millis(100));
    }
    ok(&["volume", "delete", "vol", "--control", &cp.a()]);
}

/// A free port on 127.0.0.1 for a target's metrics endpoint.
/// Target `i` as [`target`], with its metrics endpoint at `metrics`.
fn target_with_metrics(dir: &Path, i: usize, control: &str, metrics: SocketAddr) -> Target {
    let top = format!("metrics = \"{metrics}\"");
    member_target(dir, &format!("m{i}"), i, control, 64, MemberConfig { top: &top, ..Default::default() })
}

/// A byte range of the volume as an object (block-aligned extent, exact length), as a file's
/// FIEMAP extents on the volume map.
fn object(off: u64, len: u64) -> nearstore_wire::compute::Object {
    use nearstore_wire::compute::{Extent, Object};
    let extents = if len == 0 { vec![] } else { vec![Extent::data(off, len.div_ceil(BLOCK as u64) * BLOCK as u64)] };
    Object { len, extents }
}

/// Where a command on the volume ran, by the exporting target's counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ran {
    /// On the exporting target, through the volume's device.
    Here,
    /// On the exporting target's own pool.
    OwnPool,
    /// Sent to the peer holding every byte.
    Peer,
}

#[test]
fn compute_on_a_volume_runs_where_its_bytes_lie() {
    use nearstore_compute::{by_name, Context, Outcome, SliceSource, VecSink};
    use nearstore_wire::compute::Descriptor;
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = Control::start(&dir.path().join("store"));
    let metrics: Vec<SocketAddr> = (0..3).map(|_| SocketAddr::from(([127, 0, 0, 1], free_port()))).collect();
    let targets: Vec<Target> = (0..3).map(|i| target_with_metrics(dir.path(), i, &cp.a(), metrics[i])).collect();
    let c = cp.client();
    wait_for_views(&c, 3);
    let rt = rt();
    let a = cp.a();
    let t0 = targets[0].addr.to_string();
    ok(&["volume", "create", "cv", "--size", "12MiB", "--extent-size", "1MiB", "--control", &a]);
    ok(&["volume", "create", "other", "--size", "4MiB", "--extent-size", "1MiB", "--control", &a]);
    let x: Export =
        serde_json::from_str(&ok(&["volume", "export", "cv", "--target", &t0, "--allow-host", HOST, "--control", &a, "-o", "json"]))
            .expect("export json");
    let y: Export =
        serde_json::from_str(&ok(&["volume", "export", "other", "--target", &t0, "--allow-host", STRANGER, "--control", &a, "-o", "json"]))
            .expect("export json");

    // CSV text over extents 0 to 5, so that every target's pool holds some; 6 to 11 stay
    // unallocated and read as zeros.
    let mut csv = b"id,city,amount\n".to_vec();
    for i in 0u64.. {
        if csv.len() as u64 >= 6 * MIB {
            break;
        }
        csv.extend_from_slice(
            format!("{i},{},{}.{}\n", ["Oslo", "Lima", "Quito", "Bergen"][i as usize % 4], (i * 7919) % 997, i % 10).as_bytes(),
        );
    }
    csv.truncate((6 * MIB) as usize);
    let (_ctrl, mut q) = connect_when_exported(&rt, targets[0].addr, &x.nqn);
    let mut model = vec![0u8; (12 * MIB) as usize];
    write(&rt, &mut q, 0, &csv, &mut model);
    // The other volume, which only STRANGER may reach, holds bytes HOST must never see.
    let secret = b"SECRET-OF-ANOTHER-VOLUME\n".repeat((2 * MIB / 25) as usize + 1);
    let secret = &secret[..(2 * MIB) as usize];
    let mut sc = None;
    let deadline = Instant::now() + Duration::from_secs(10);
    while sc.is_none() {
        match connect_as(&rt, targets[0].addr, &y.nqn, STRANGER, None) {
            Ok(s) => sc = Some(s),
            Err(e) => assert!(Instant::now() < deadline, "the other volume is not served: {e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let sc = sc.expect("connected");
    let mut sq = rt.block_on(sc.io_queue(1)).expect("I/O queue");
    let mut other_model = vec![0u8; (4 * MIB) as usize];
    write(&rt, &mut sq, 0, secret, &mut other_model);
    rt.block_on(q.flush(1)).expect("flush");
    rt.block_on(sq.flush(1)).expect("flush");

    // Authority follows the host: HOST may not connect to the other volume.
    match connect_as(&rt, targets[0].addr, &y.nqn, HOST, None) {
        Err(e) => assert_eq!(status_of(&e).map(|s| Status { dnr: false, ..s }), Some(Status::CONNECT_INVALID_HOST), "{e}"),
        Ok(_) => panic!("a host the other volume's export does not name was admitted"),
    }

    let info = rt.block_on(c.volume("cv")).expect("info");
    let holder = |index: u64| info.extents.iter().find(|e| e.index == index).map(|e| e.target.clone());
    let holders: std::collections::BTreeSet<String> = (0..6).filter_map(holder).collect();
    assert_eq!(holders.len(), 3, "the data lies on three targets: {holders:?}");
    let own = (0..6).find(|&i| holder(i).as_deref() == Some(t0.as_str())).expect("an extent on the exporting target");
    let peer = (0..6).find(|&i| holder(i).is_some_and(|h| h != t0)).expect("an extent on a peer");
    let peer_target = targets.iter().position(|t| Some(t.addr.to_string()) == holder(peer)).expect("the peer");

    let args = |op: &str| -> Vec<u8> {
        match op {
            "grep-count" => br#"{"pattern":"Oslo|SECRET"}"#.to_vec(),
            "select" => serde_json::json!({"query": "SELECT city, COUNT(*), SUM(amount) FROM s3object GROUP BY city ORDER BY city"})
                .to_string()
                .into_bytes(),
            _ => Vec::new(),
        }
    };
    let streams = ["crc32c", "sha256", "grep-count", "wc"];
    // (what, volume offset, length, where it runs, operations)
    #[rustfmt::skip]
    let cases: Vec<(&str, u64, u64, Ran, Vec<&str>)> = vec![
        ("over all three targets", 0, 6 * MIB, Ran::Here, vec!["crc32c", "sha256", "grep-count", "wc", "select"]),
        ("the whole volume, with its unallocated half", 0, 12 * MIB, Ran::Here, streams.to_vec()),
        ("a prefix", 0, 4097, if holder(0).as_deref() == Some(t0.as_str()) { Ran::OwnPool } else { Ran::Peer }, vec!["crc32c", "select"]),
        ("one byte on a peer", peer * MIB + 4096, 1, Ran::Peer, streams.to_vec()),
        ("a block less one on a peer", peer * MIB, 4095, Ran::Peer, streams.to_vec()),
        ("a whole extent on a peer", peer * MIB, MIB, Ran::Peer, streams.to_vec()),
        ("one extent of the exporting target", own * MIB + 8192, MIB - 8192, Ran::OwnPool, streams.to_vec()),
        ("the last extent written and the first unallocated", 5 * MIB + 4096, MIB + 4097, if holder(5).as_deref() == Some(t0.as_str()) { Ran::OwnPool } else { Ran::Peer }, streams.to_vec()),
        ("only unallocated extents", 8 * MIB + 4096, 3, Ran::Here, streams.to_vec()),
        ("nothing", 0, 0, Ran::Here, streams.to_vec()),
    ];
    for (what, off, len, ran, ops) in cases {
        for op in ops {
            let o = by_name(op).expect("operation");
            let d = Descriptor { op: o.id, args: args(op), inputs: vec![object(off, len)], outputs: vec![] };
            let before = (metric(metrics[0], "nearstore_compute_forwarded_total"), metric(metrics[0], "nearstore_compute_on_pool_total"));
            let peer_before = metric(metrics[peer_target], "nearstore_compute_commands_total");
            let json = rt.block_on(q.compute(1, &d.encode(), Duration::from_secs(60))).unwrap_or_else(|e| panic!("{what}: {op}: {e}"));
            let got: Vec<Outcome> = serde_json::from_slice(&json).expect("outcomes");
            let want = nearstore_compute::run(op, &args(op), [&model[off as usize..(off + len) as usize]]).expect("local");
            assert_eq!(got, vec![want], "{what}: {op} differs from the computation over the bytes read plainly");
            let after = (metric(metrics[0], "nearstore_compute_forwarded_total"), metric(metrics[0], "nearstore_compute_on_pool_total"));
            let seen = match (after.0 - before.0, after.1 - before.1) {
                (0, 0) => Ran::Here,
                (0, 1) => Ran::OwnPool,
                (1, 0) => Ran::Peer,
                d => panic!("{what}: {op}: counters moved by {d:?}"),
            };
            assert_eq!(seen, ran, "{what}: {op} ran elsewhere");
            if ran == Ran::Peer && holder(off / MIB) == holder(peer) {
                assert_eq!(
                    metric(metrics[peer_target], "nearstore_compute_commands_total"),
                    peer_before + 1,
                    "{what}: {op}: the peer computed"
                );
            }
        }
    }

    // A sort on a peer's extent into the rest of that extent: the peer writes the output.
    // Into an unallocated extent: the exporting target does, allocating it on first write.
    let sort = by_name("sort").expect("sort");
    for (what, input, out_off, ran) in [
        ("into the same extent", (peer * MIB + 4096, 300_000u64), peer * MIB + MIB / 2, Ran::Peer),
        ("into an unallocated extent", (0, 300_000), 9 * MIB, Ran::Here),
    ] {
        let d = Descriptor {
            op: sort.id,
            args: b"{}".to_vec(),
            inputs: vec![object(input.0, input.1)],
            outputs: vec![object(out_off, MIB / 2)],
        };
        let before = metric(metrics[0], "nearstore_compute_forwarded_total");
        let json = rt.block_on(q.compute(1, &d.encode(), Duration::from_secs(60))).unwrap_or_else(|e| panic!("sort {what}: {e}"));
        let got: Vec<Outcome> = serde_json::from_slice(&json).expect("outcomes");
        let bytes = &model[input.0 as usize..(input.0 + input.1) as usize];
        let mut src = SliceSource::new([bytes]);
        let mut sink = VecSink::new(MIB / 2);
        let want = sort.execute(b"{}", &mut [&mut src], &mut [&mut sink], &Context::default()).expect("local sort");
        assert_eq!(
            got.iter().map(Outcome::result).collect::<Vec<_>>(),
            want.iter().map(Outcome::result).collect::<Vec<_>>(),
            "sort {what}"
        );
        let n = sink.data.len() as u64;
        let mut back = Vec::new();
        for at in (out_off..out_off + n).step_by(CHUNK as usize) {
            let blocks = CHUNK.min(out_off + n - at).div_ceil(BLOCK as u64) as u32;
            back.extend(rt.block_on(q.read(1, at / BLOCK as u64, blocks, BLOCK)).expect("read the output"));
        }
        assert!(back[..n as usize] == sink.data[..], "sort {what}: the output read back differs from the local sort");
        let forwarded = metric(metrics[0], "nearstore_compute_forwarded_total") - before;
        assert_eq!(forwarded, u64::from(ran == Ran::Peer), "sort {what} ran elsewhere");
    }
    assert!(rt.block_on(c.volume("cv")).expect("info").extents.iter().any(|e| e.index == 9), "the output's extent was allocated");
}

/// Reads of extent `k` of a volume in a loop, on a connection and runtime of their own,
/// until stopped.
struct Reader {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl Reader {
    fn start(addr: SocketAddr, nqn: &str, k: u64) -> Reader {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s, nqn) = (stop.clone(), nqn.to_string());
        let thread = std::thread::spawn(move || {
            let rt = crate::rt();
            let (_ctrl, mut q) = connect_when_exported(&rt, addr, &nqn);
            let mut n = 0u64;
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                let off = k * MIB + (n * CHUNK) % MIB;
                rt.block_on(q.read(1, off / BLOCK as u64, (CHUNK / BLOCK as u64) as u32, BLOCK)).expect("read");
                n += 1;
            }
            n
        });
        Reader { stop, thread }
    }

    /// Stops the reads: how many there were.
    fn stop(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().expect("reader")
    }
}

/// Waits until pool `w`'s view shows reads: bandwidth, IOPS, latency and a queue depth.
fn view_shows_reads(rt: &tokio::runtime::Runtime, c: &Client, w: &PoolView) -> Figures {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = rt.block_on(c.view(0)).expect("view");
        let p = v.pools.iter().find(|p| (&p.target, &p.pool) == (&w.target, &w.pool)).expect("W").clone();
        let f = p.view.as_ref().expect("a view").figures.clone();
        if f.read_bps > 0.0 && f.read_iops > 0.0 && f.read_latency_us > 0.0 && f.queue_depth > 0.0 {
            return f;
        }
        assert!(Instant::now() < deadline, "{}@{}'s view never showed the reads: {f:?}", w.pool, w.target);
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits until the link from `from` to `to` shows reads (bandwidth, IOPS, latency, queue
/// depth), and `nearstore view` prints it.
fn link_shows_reads(rt: &tokio::runtime::Runtime, c: &Client, a: &str, from: &str, to: &str) -> Figures {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = rt.block_on(c.view(0)).expect("view");
        if let Some(l) = v.links.iter().find(|l| (l.from.as_str(), l.to.as_str()) == (from, to)) {
            let f = l.figures.clone();
            if f.read_bps > 0.0 && f.read_iops > 0.0 && f.read_latency_us > 0.0 && f.queue_depth > 0.0 {
                assert!(!l.stale);
                let text = ok(&["view", "--control", a]);
                assert!(text.contains("link from") && text.lines().any(|l| l.starts_with(from) && l.contains(to)), "{text}");
                return f;
            }
        }
        assert!(Instant::now() < deadline, "the link {from} -> {to} never showed the reads: {:?}", v.links);
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The exporting target's own fast path into its own pool is in that pool's view: a volume
/// exported by the target holding extent k, read there, loads that pool's view. Before, the
/// pool's counters saw only the I/O reaching it over NVMe/TCP, and the exporter's own reads,
/// submitted straight to the pool's device, left its view idle.
#[test]
fn the_exporters_own_pool_io_is_in_its_view() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = Control::start(&dir.path().join("store"));
    let targets: Vec<Target> = (0..3).map(|i| target(dir.path(), i, &cp.a())).collect();
    let c = cp.client();
    wait_for_views(&c, 3);
    let rt = rt();
    let a = cp.a();
    ok(&["volume", "create", "ov", "--size", "1MiB", "--extent-size", "1MiB", "--control", &a]);
    let e = rt.block_on(c.allocate("ov", 0)).expect("allocate");
    rt.block_on(c.mark_written("ov", 0)).expect("written");
    let view = rt.block_on(c.view(0)).expect("view");
    let w = view.pools.iter().find(|p| (&p.target, &p.pool) == (&e.target, &e.pool)).expect("the extent's pool").clone();
    let owner = targets.iter().find(|t| t.addr.to_string() == w.target).expect("the extent's target");
    let args = ["volume", "export", "ov", "--target", &owner.addr.to_string(), "--allow-host", HOST, "--control", &a, "-o", "json"];
    let x: Export = serde_json::from_str(&ok(&args)).expect("export json");
    let reading = Reader::start(owner.addr, &x.nqn, 0);
    view_shows_reads(&rt, &c, &w);
    assert!(reading.stop() > 0);
    // No other pool saw any of it, and it crossed no link.
    let v = rt.block_on(c.view(0)).expect("view");
    assert!(v.links.iter().all(|l| l.figures.read_bps == 0.0), "{:?}", v.links);
    for p in v.pools.iter().filter(|p| p.target != w.target) {
        assert_eq!(p.view.as_ref().expect("a view").figures.read_bps, 0.0, "{} read nothing", p.pool);
    }
}

#[test]
fn pool_views_carry_the_data_paths_load_and_placement_avoids_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = Control::start(&dir.path().join("store"));
    let targets: Vec<Target> = (0..3).map(|i| target(dir.path(), i, &cp.a())).collect();
    let c = cp.client();
    wait_for_views(&c, 3);
    let rt = rt();
    let a = cp.a();
    ok(&["volume", "create", "lv", "--size", "3MiB", "--extent-size", "1MiB", "--control", &a]);
    ok(&["volume", "create", "nv", "--size", "1MiB", "--extent-size", "1MiB", "--control", &a]);
    // One extent on every pool, allocated and marked written without a write (as if zeroed):
    // no pool has done any I/O, and reads of them reach the pools.
    for i in 0..3 {
        rt.block_on(c.allocate("lv", i)).expect("allocate");
        rt.block_on(c.mark_written("lv", i)).expect("written");
    }
    let info = rt.block_on(c.volume("lv")).expect("info");
    let on: std::collections::BTreeSet<&str> = info.extents.iter().map(|e| e.target.as_str()).collect();
    assert_eq!(on.len(), 3, "{on:?}");
    // Idle and equally full, pools tie, and the tie goes to the smallest (target, name): W.
    let view = rt.block_on(c.view(0)).expect("view");
    let w = view.pools.iter().min_by_key(|p| (p.target.clone(), p.pool.clone())).expect("pools").clone();
    for p in &view.pools {
        let f = &p.view.as_ref().expect("a view").figures;
        assert_eq!((f.read_bps, f.queue_depth, f.write_cost_us_per_mib), (0.0, 0.0, 0.0), "{} is idle", p.pool);
    }
    let k = info.extents.iter().find(|e| e.target == w.target).expect("an extent on W").index;
    // Exported by another target, whose reads of extent k reach W's pool over NVMe/TCP.
    let exporter = targets.iter().find(|t| t.addr.to_string() != w.target).expect("another target");
    let x: Export = serde_json::from_str(&ok(&[
        "volume",
        "export",
        "lv",
        "--target",
        &exporter.addr.to_string(),
        "--allow-host",
        HOST,
        "--control",
        &a,
        "-o",
        "json",
    ]))
    .expect("export json");
    let reading = Reader::start(exporter.addr, &x.nqn, k);
    let loaded = view_shows_reads(&rt, &c, &w);
    // They crossed the link from the exporter to W's target, and only that one.
    let link = link_shows_reads(&rt, &c, &a, &exporter.addr.to_string(), &w.target);
    assert_eq!((link.write_bps, link.fs_free_bytes), (0.0, 0), "{link:?}");
    let v = rt.block_on(c.view(0)).expect("view");
    assert!(v.links.iter().all(|l| l.from == exporter.addr.to_string() && l.to == w.target), "{:?}", v.links);
    // A new extent goes to an idle pool, not the loaded one.
    let placed = rt.block_on(c.allocate("nv", 0)).expect("allocate");
    assert!(reading.stop() > 0);
    assert!(
        (placed.target.as_str(), placed.pool.as_str()) != (w.target.as_str(), w.pool.as_str()),
        "placed on the loaded pool {}@{} ({loaded:?})",
        w.pool,
        w.target
    );
    // The other pools saw none of it.
    let v = rt.block_on(c.view(0)).expect("view");
    for p in v.pools.iter().filter(|p| p.target != w.target) {
        assert_eq!(p.view.as_ref().expect("a view").figures.read_bps, 0.0, "{} read nothing", p.pool);
    }
}

#[test]
fn a_controller_shutdown_flushes_the_volumes_pools() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = Control::start(&dir.path().join("store"));
    let metrics: Vec<SocketAddr> = (0..3).map(|_| SocketAddr::from(([127, 0, 0, 1], free_port()))).collect();
    let targets: Vec<Target> = (0..3).map(|i| target_with_metrics(dir.path(), i, &cp.a(), metrics[i])).collect();
    let c = cp.client();
    wait_for_views(&c, 3);
    let rt = rt();
    let a = cp.a();
    let t0 = targets[0].addr.to_string();
    ok(&["volume", "create", "sv", "--size", "3MiB", "--extent-size", "1MiB", "--control", &a]);
    let x: Export =
        serde_json::from_str(&ok(&["volume", "export", "sv", "--target", &t0, "--allow-host", HOST, "--control", &a, "-o", "json"]))
            .expect("export json");
    let (ctrl, mut q) = connect_when_exported(&rt, targets[0].addr, &x.nqn);
    let mut model = vec![0u8; (3 * MIB) as usize];
    for i in 0..3 {
        write(&rt, &mut q, i * MIB, &pattern(i * MIB, 4096, 5), &mut model);
    }
    let info = rt.block_on(c.volume("sv")).expect("info");
    let peers: Vec<usize> = (1..3).filter(|&i| info.extents.iter().any(|e| e.target == targets[i].addr.to_string())).collect();
    assert_eq!(peers.len(), 2, "both peers hold an extent");
    // Each peer's 4 KiB crossed t0's link to it, as its metrics say.
    for &i in &peers {
        let link = |m: &str| metric(metrics[0], &format!("{m}{{peer=\"{}\"}}", targets[i].addr));
        assert!(link("nearstore_link_write_bytes_total") >= 4096, "t0's link to target {i}");
        assert!(link("nearstore_link_writes_total") >= 1 && link("nearstore_link_write_nanoseconds_total") > 0);
    }
    // Flushes reach a peer's pool as commands on its pool subsystem's namespace.
    let pool_commands = r#"nearstore_other_commands_total{subnqn="nqn.2026-11.io.nearstore:pools",nsid="1"}"#;
    let before: Vec<u64> = peers.iter().map(|&i| metric(metrics[i], pool_commands)).collect();
    drop(q);
    rt.block_on(ctrl.shutdown()).expect("shutdown reported complete");
    for (&i, b) in peers.iter().zip(before) {
        assert!(metric(metrics[i], pool_commands) > b, "the shutdown flushed no pool of target {i}");
    }
}

/// Handing an export over (docs/control-plane.md): a volume unexported from a live target
/// is exported elsewhere once that target says it no longer writes, and reads there what
/// was written through the first; a target that loses the control plane for longer than
/// its export lease stops serving, and serves again when it answers; a volume whose last
/// exporter died is exported nowhere else until that exporter's bound has passed.
#[test]
fn an_export_moves_only_once_its_last_exporter_stopped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("store");
    // Short enough to wait out, long enough (a 1.7 s poll hold) for a loaded machine.
    let lease = ["--export-lease-ms", "5000"];
    let cp = Control::start_with(&store, "127.0.0.1:0", &lease);
    let a = cp.a();
    let mut targets: Vec<Target> = (0..2).map(|i| target(dir.path(), i, &a)).collect();
    let c = cp.client();
    wait_for_views(&c, 2);
    let rt = rt();
    let (t0, t1) = (targets[0].addr.to_string(), targets[1].addr.to_string());
    for v in ["v", "w"] {
        ok(&["volume", "create", v, "--size", "4MiB", "--extent-size", "1MiB", "--control", &a]);
    }
    let x: Export =
        serde_json::from_str(&ok(&["volume", "export", "v", "--target", &t0, "--allow-host", HOST, "--control", &a, "-o", "json"]))
            .expect("export json");
    let (ctrl, mut q) = connect_when_exported(&rt, targets[0].addr, &x.nqn);
    let mut model = vec![0u8; (4 * MIB) as usize];
    write(&rt, &mut q, MIB - 4096, &pattern(MIB - 4096, 3 * 4096, 1), &mut model);
    rt.block_on(q.flush(1)).expect("flush");
    drop((q, ctrl));

    // Unexported from t0, which is alive: exported on t1 as soon as t0 says it stopped.
    ok(&["volume", "unexport", "v", "--control", &a]);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (out, err) = match nearstore(&["volume", "export", "v", "--target", &t1, "--allow-host", HOST, "--control", &a, "-v"]) {
            o if o.status.success() => break,
            o => (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned()),
        };
        assert!(err.contains("(export_handover)") && err.contains(&format!("exported by {t0}")), "{out}{err}");
        assert!(Instant::now() < deadline, "t0 never said it stopped writing: {err}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (ctrl, mut q) = connect_when_exported(&rt, targets[1].addr, &x.nqn);
    check(&rt, &mut q, 0, 4 * MIB, &model);
    drop((q, ctrl));
    let Err(e) = connect_as(&rt, targets[0].addr, &x.nqn, HOST, None) else { panic!("t0 still serves v") };
    assert!(status_of(&e).is_some(), "{e}");

    // The control plane gone for longer than the lease (5 s): t1 stops serving v; back, it serves
    // it again, with what was written.
    cp.kill();
    std::thread::sleep(Duration::from_millis(8000));
    let Err(e) = connect_as(&rt, targets[1].addr, &x.nqn, HOST, None) else { panic!("t1 serves v past its export lease") };
    assert!(status_of(&e).is_some(), "{e}");
    let cp = Control::start_with(&store, &a, &lease);
    let (ctrl, mut q) = connect_when_exported(&rt, targets[1].addr, &x.nqn);
    check(&rt, &mut q, 0, 4 * MIB, &model);
    drop((q, ctrl));

    // w exported by t0, which dies: unexported, w is exported nowhere else until t0's bound
    // (its lease and write bound, well over a minute) has passed; nor deleted.
    ok(&["volume", "export", "w", "--target", &t0, "--allow-any-host", "--control", &cp.a()]);
    let y = rt.block_on(c.volume("w")).expect("info w");
    assert_eq!(y.volume.handover, None);
    drop(targets.remove(0));
    ok(&["volume", "unexport", "w", "--control", &cp.a()]);
    std::thread::sleep(Duration::from_millis(500));
    let (_, err) = fails(&["volume", "export", "w", "--target", &t1, "--allow-any-host", "--control", &cp.a(), "-v"]);
    assert!(err.contains("(export_handover)") && err.contains(&format!("exported by {t0}")), "{err}");
    let (_, err) = fails(&["volume", "delete", "w", "--control", &cp.a(), "-v"]);
    assert!(err.contains("(export_handover)"), "{err}");
    let h = rt.block_on(c.volume("w")).expect("info w").volume.handover.expect("a handover");
    assert_eq!(h.from, t0);

    // t0 started again where it was: its new process fences the dead one at t1, which ends
    // w's handover long before its bound.
    let _t0 = restart_target(dir.path(), 0, &cp.a(), &t0);
    export_within(&["volume", "export", "w", "--target", &t1, "--allow-any-host", "--control", &cp.a()], Duration::from_secs(30));
}

/// Target `i` of [`target`] started again on `addr` (its address before).
fn restart_target(dir: &Path, i: usize, control: &str, addr: &str) -> Target {
    restart_member_target(dir, &format!("t{i}"), i, control, 64, addr.parse().expect("address"))
}

/// Runs `args` until it succeeds; every failure meanwhile must be a handover's refusal.
fn export_within(args: &[&str], within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let o = nearstore(&[args, &["-v"]].concat());
        if o.status.success() {
            return;
        }
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(err.contains("(export_handover)"), "{err}");
        assert!(Instant::now() < deadline, "still refused after {within:?}: {err}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// An exporter killed and started again on the same address (a new process) serves its
/// volumes at once, but what its dead process left at the pools of other targets may still
/// land: until the new one has fenced it at every registered target (Fence Host Instances),
/// the volume is exported nowhere else, deleted nor moved. A target that cannot answer (here
/// stopped) holds that up; answering again, the fence completes and the volume goes on.
#[test]
fn a_restarted_exporters_volume_moves_only_once_its_dead_process_is_fenced() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("store");
    let cp = Control::start_with(&store, "127.0.0.1:0", &["--export-lease-ms", "5000"]);
    let a = cp.a();
    let mut t0 = Some(target(dir.path(), 0, &a));
    let t1 = target(dir.path(), 1, &a);
    let c = cp.client();
    wait_for_views(&c, 2);
    let rt = rt();
    let (a0, a1) = (t0.as_ref().expect("t0").addr.to_string(), t1.addr.to_string());
    ok(&["volume", "create", "v", "--size", "4MiB", "--extent-size", "1MiB", "--control", &a]);
    let x: Export =
        serde_json::from_str(&ok(&["volume", "export", "v", "--target", &a0, "--allow-host", HOST, "--control", &a, "-o", "json"]))
            .expect("export json");
    let (ctrl, mut q) = connect_when_exported(&rt, t0.as_ref().expect("t0").addr, &x.nqn);
    let mut model = vec![0u8; (4 * MIB) as usize];
    write(&rt, &mut q, 0, &pattern(0, 4 * MIB as usize, 7), &mut model);
    rt.block_on(q.flush(1)).expect("flush");
    drop((q, ctrl));
    let info = rt.block_on(c.volume("v")).expect("info v");
    assert!(info.extents.iter().any(|e| e.target == a1), "an extent of v on t1: {:?}", info.extents);

    // t1 stopped (it cannot answer a fence), t0 killed and started again where it was.
    let thaw = Thaw(t1.pid());
    unsafe { assert_eq!(libc::kill(t1.pid() as i32, libc::SIGSTOP), 0) };
    drop(t0.take());
    let _t0 = restart_target(dir.path(), 0, &a, &a0);
    let deadline = Instant::now() + Duration::from_secs(15);
    let d = loop {
        if let Some(d) = rt.block_on(c.volume("v")).expect("info v").in_doubt {
            break d;
        }
        assert!(Instant::now() < deadline, "the restart is not recorded");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(d.target == a0 && d.restarted, "{d:?}");
    ok(&["volume", "unexport", "v", "--control", &a]);
    std::thread::sleep(Duration::from_millis(2000));
    let (_, err) = fails(&["volume", "export", "v", "--target", &a1, "--allow-host", HOST, "--control", &a, "-v"]);
    assert!(err.contains("(export_handover)"), "{err}");
    let t = rt.block_on(c.targets()).expect("targets").into_iter().find(|t| t.addr == a0).expect("t0");
    assert!(t.unfenced.is_some(), "not fenced while t1 cannot answer: {t:?}");

    // t1 answers again: the fence completes, and v goes to t1 with what was written.
    drop(thaw);
    export_within(&["volume", "export", "v", "--target", &a1, "--allow-host", HOST, "--control", &a], Duration::from_secs(90));
    assert_eq!(rt.block_on(c.volume("v")).expect("info v").in_doubt, None);
    let (ctrl, mut q) = connect_when_exported(&rt, t1.addr, &x.nqn);
    check(&rt, &mut q, 0, 4 * MIB, &model);
    drop((q, ctrl));
}

/// Continues a stopped process when dropped (a test that fails leaves none stopped).
struct Thaw(u32);

impl Drop for Thaw {
    fn drop(&mut self) {
        unsafe { libc::kill(self.0 as i32, libc::SIGCONT) };
    }
}
