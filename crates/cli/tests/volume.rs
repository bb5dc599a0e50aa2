//! Exported volumes as real processes: a control plane and three targets with a pool each,
//! a volume whose extents lie on all three, exported by one of them and reached with our
//! initiator; who may connect (the volume's hosts, the pool subsystem's members); and the
//! control plane killed under it (docs/control-plane.md, "The data path").

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{fails, ok, Control, Target};
use nearstore_control::client::Client;
use nearstore_control::model::*;
use nearstore_initiator::{ConnectOptions, Controller, Error as InitiatorError, IoQueue};
use nearstore_wire::Status;

const MIB: u64 = 1 << 20;
const BLOCK: u32 = 4096;
const MEMBERS: [&str; 3] = ["nqn.2026-11.io.nearstore:member1", "nqn.2026-11.io.nearstore:member2", "nqn.2026-11.io.nearstore:member3"];
const HOST: &str = "nqn.2026-11.io.nearstore:host-a";
const STRANGER: &str = "nqn.2026-11.io.nearstore:host-b";
const POOLS_NQN: &str = "nqn.2026-11.io.nearstore:pools";

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

/// Target `i` (0-based): member `MEMBERS[i]` trusting all three, a small memory namespace,
/// one pool of 64 MiB, a control plane wait of 500 ms.
fn target(dir: &Path, i: usize, control: &str) -> Target {
    let config = dir.join(format!("t{i}.toml"));
    let members = MEMBERS.iter().map(|m| format!("\"{m}\"")).collect::<Vec<_>>().join(", ");
    std::fs::write(
        &config,
        format!(
            r#"
            [[listener]]
            address = "127.0.0.1:0"
            [[subsystem]]
            nqn = "nqn.2026-11.io.nearstore:t{i}"
            allow_any_host = true
            [[subsystem.namespace]]
            nsid = 1
            memory = "1MiB"
            [cluster]
            host_nqn = "{}"
            trusted_members = [{members}]
            [volume]
            translate_timeout_ms = 500
            "#,
            MEMBERS[i]
        ),
    )
    .expect("config");
    let pool = format!("{}:64MiB", dir.join(format!("p{i}")).display());
    Target::start(&["--config", config.to_str().expect("path"), "--control", control, "--pool", &pool])
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
