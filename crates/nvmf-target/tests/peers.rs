//! Device-to-device reads: a target that meets extents tagged with a peer's device tag
//! reads them from the peer itself over NVMe/TCP, as its own host NQN, and streams them
//! into the operation. The result equals the local computation over the same bytes;
//! unknown tags, a peer that refuses the connection, is not there, dies or stalls mid-
//! transfer, and ranges outside the peer each fail the command with a status and a
//! message naming the peer, and the target keeps serving.
//!
//! A target reads a peer only for the host whose command it runs, and only if the peer
//! admits that host (the confused deputy of issue 12): the peer decides, through the
//! acting-for extension of Connect, before a byte of the command is read.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::proxy::{proxy, Faults};
use nearstore_compute::{by_name, Outcome};
use nearstore_initiator::{ConnectOptions, Controller, Error, IoQueue};
use nearstore_target::config::Config;
use nearstore_target::Target;
use nearstore_wire::compute::{global, status as cs, Descriptor, Extent, Object};
use nearstore_wire::Status;
use tokio::net::TcpListener;

const T: Duration = Duration::from_secs(60);
const PEER_NQN: &str = "nqn.2026-11.io.nearstore:peer-b";
const A_HOST: &str = "nqn.2026-11.io.nearstore:target-a";
/// The host the tests compute as on A: B's subsystem allows it.
const HOST: &str = "nqn.2026-11.io.nearstore:host";
/// Allowed on A's open subsystem and on B's open one, not on B's subsystem.
const STRANGER: &str = "nqn.2026-11.io.nearstore:stranger";
const BS: u64 = 512;

fn content(len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            b"abcdefgh ij\n"[(s % 12) as usize]
        })
        .collect()
}

struct Pair {
    a: Arc<Target>,
    b: Arc<Target>,
    a_addr: SocketAddr,
    b_addr: SocketAddr,
    cut: Arc<Faults>,
    stall: Arc<Faults>,
}

/// Peer B, which trusts target A's host NQN as a cluster member, with three subsystems:
/// one allows A's host NQN and HOST, one allows someone else, one any host. Target A
/// (an open subsystem) whose cluster map names B directly (tag 2), B's closed subsystem
/// (3), a port where nothing listens (4), B behind proxies that cut (5) or stall (6), and
/// B's open subsystem (7).
async fn start() -> Pair {
    common::init_logs();
    let b_cfg = Config::from_toml(&format!(
        r#"
        [[listener]]
        address = "127.0.0.1:0"
        [cluster]
        trusted_members = ["{A_HOST}"]
        [[subsystem]]
        nqn = "{PEER_NQN}"
        hosts = ["{A_HOST}", "{HOST}", "{HOST}-2", "{HOST}-3"]
        [[subsystem.namespace]]
        nsid = 1
        memory = "64MiB"
        [[subsystem]]
        nqn = "{PEER_NQN}-closed"
        hosts = ["nqn.2026-11.io.nearstore:someone-else"]
        [[subsystem.namespace]]
        nsid = 1
        memory = "1MiB"
        [[subsystem]]
        nqn = "{PEER_NQN}-open"
        allow_any_host = true
        [[subsystem.namespace]]
        nsid = 1
        memory = "1MiB"
        "#
    ))
    .unwrap();
    let b = Target::from_config(&b_cfg).unwrap();
    let b_addr = b.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    let nothing = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    let (cut, stall) = (Arc::new(Faults::default()), Arc::new(Faults::default()));
    let cut_addr = proxy(b_addr, cut.clone(), 1 << 20).await;
    let stall_addr = proxy(b_addr, stall.clone(), 1 << 20).await;
    let a_cfg = Config::from_toml(&format!(
        r#"
        [[listener]]
        address = "127.0.0.1:0"
        [cluster]
        host_nqn = "{A_HOST}"
        timeout_secs = 2
        [[cluster.peer]]
        tag = 2
        address = "{b_addr}"
        nqn = "{PEER_NQN}"
        [[cluster.peer]]
        tag = 3
        address = "{b_addr}"
        nqn = "{PEER_NQN}-closed"
        [[cluster.peer]]
        tag = 4
        address = "{nothing}"
        nqn = "{PEER_NQN}"
        [[cluster.peer]]
        tag = 5
        address = "{cut_addr}"
        nqn = "{PEER_NQN}"
        [[cluster.peer]]
        tag = 6
        address = "{stall_addr}"
        nqn = "{PEER_NQN}"
        [[cluster.peer]]
        tag = 7
        address = "{b_addr}"
        nqn = "{PEER_NQN}-open"
        [[subsystem]]
        nqn = "{}"
        allow_any_host = true
        [[subsystem.namespace]]
        nsid = 1
        memory = "64MiB"
        tag = 1
        "#,
        common::NQN
    ))
    .unwrap();
    let a = Target::from_config(&a_cfg).unwrap();
    let a_addr = a.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    Pair { a, b, a_addr, b_addr, cut, stall }
}

async fn queue(addr: SocketAddr, nqn: &str, host: &str) -> (Controller, IoQueue) {
    let mut o = ConnectOptions::new(addr, nqn);
    o.hostnqn = host.into();
    let c = Controller::connect(o).await.unwrap();
    let q = c.io_queue(1).await.unwrap();
    (c, q)
}

async fn write_all(q: &mut IoQueue, byte: u64, data: &[u8]) {
    let mut padded = data.to_vec();
    padded.resize(data.len().div_ceil(BS as usize) * BS as usize, 0);
    for (i, c) in padded.chunks(128 * 1024).enumerate() {
        q.write(1, byte / BS + (i * 128 * 1024) as u64 / BS, c, BS as u32, false).await.unwrap();
    }
}

fn desc(op: &str, args: &[u8], inputs: Vec<Object>, outputs: Vec<Object>) -> Descriptor {
    Descriptor { op: by_name(op).unwrap().id, args: args.to_vec(), inputs, outputs }
}

fn refused(e: Error, status: Status, needles: &[&str]) {
    match e {
        Error::Compute { status: s, message } => {
            assert_eq!(s, status, "{message}");
            for n in needles {
                assert!(message.contains(n), "message {message:?} lacks {n:?}");
            }
        }
        e => panic!("expected a compute refusal, got {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_reads_its_peers_extents_itself_and_computes_what_the_host_would() {
    let p = start().await;
    let (_ca, mut qa) = queue(p.a_addr, common::NQN, HOST).await;
    let (_cb, mut qb) = queue(p.b_addr, PEER_NQN, A_HOST).await;
    // One object: 300 KiB on A, a hole, 2.5 MiB + 100 bytes on B (in two extents, the
    // later bytes lower on B), 64 KiB on A again addressed by A's own tag.
    let (a1, b1, b2, a2) = (content(300 << 10, 1), content(1 << 20, 2), content((3 << 19) + 100, 3), content(64 << 10, 4));
    write_all(&mut qa, 0, &a1).await;
    write_all(&mut qb, 8 << 20, &b1).await;
    write_all(&mut qb, 1 << 20, &b2).await;
    write_all(&mut qa, 4 << 20, &a2).await;
    let tail = b2.len() as u64;
    let obj = Object {
        len: (300 << 10) + 4096 + (1 << 20) + tail + (64 << 10),
        extents: vec![
            Extent::data(0, 300 << 10),
            Extent::zeros(4096),
            Extent::data(global::address(2, 8 << 20), 1 << 20),
            Extent::data(global::address(2, 1 << 20), tail.div_ceil(BS) * BS),
            Extent::data(global::address(1, 4 << 20), 64 << 10),
        ],
    };
    // The bytes are not contiguous in the object: B's tail is cut to the object's length
    // only at the very end, so the object here ends in a whole-block B extent and A's.
    let obj = Object { len: obj.len - tail + tail.div_ceil(BS) * BS, ..obj };
    let mut b2_padded = b2.clone();
    b2_padded.resize(tail.div_ceil(BS) as usize * BS as usize, 0);
    let whole = [a1.clone(), vec![0; 4096], b1.clone(), b2_padded, a2.clone()].concat();
    assert_eq!(whole.len() as u64, obj.len);
    for op in ["crc32c", "sha256", "wc"] {
        let json = qa.compute(1, &desc(op, b"", vec![obj.clone()], vec![]).encode(), T).await.unwrap();
        let got: Vec<Outcome> = serde_json::from_slice(&json).unwrap();
        assert_eq!(got[0], nearstore_compute::run(op, b"", [&whole[..]]).unwrap(), "{op}");
    }
    // A copy of the object into an output on A: the bytes arrive whole.
    let out = Object { len: obj.len, extents: vec![Extent::data(16 << 20, obj.len.div_ceil(BS) * BS)] };
    qa.compute(1, &desc("copy", b"", vec![obj.clone()], vec![out]).encode(), T).await.unwrap();
    let mut copied = Vec::new();
    while (copied.len() as u64) < obj.len {
        copied.extend(qa.read(1, (16 << 20) / BS + copied.len() as u64 / BS, 256, BS as u32).await.unwrap());
    }
    copied.truncate(obj.len as usize);
    assert!(copied == whole, "the copy differs");
    // A merge of a sorted run on A with one on B: what the distributed sort's merge does.
    let args = br#"{"record_size":4}"#;
    let run = |seed: u64| -> Vec<u8> {
        let mut r: Vec<[u8; 4]> = content(40_000, seed).chunks(4).map(|c| c.try_into().unwrap()).collect();
        r.sort();
        r.concat()
    };
    let (ra, rb) = (run(7), run(8));
    write_all(&mut qa, 32 << 20, &ra).await;
    write_all(&mut qb, 32 << 20, &rb).await;
    let ins = vec![
        Object { len: 40_000, extents: vec![Extent::data(32 << 20, 40_448)] },
        Object { len: 40_000, extents: vec![Extent::data(global::address(2, 32 << 20), 40_448)] },
    ];
    let out = Object { len: 80_000, extents: vec![Extent::data(40 << 20, 80_384)] };
    qa.compute(1, &desc("merge", args, ins, vec![out]).encode(), T).await.unwrap();
    let merged = qa.read(1, (40 << 20) / BS, 157, BS as u32).await.unwrap();
    let mut want: Vec<&[u8]> = ra.chunks(4).chain(rb.chunks(4)).collect();
    want.sort();
    assert!(merged[..80_000] == want.concat()[..], "the merge differs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_tags_refused_peers_and_peers_that_die_or_stall_fail_the_command_cleanly() {
    let p = start().await;
    let (_ca, mut qa) = queue(p.a_addr, common::NQN, HOST).await;
    let (_cb, mut qb) = queue(p.b_addr, PEER_NQN, A_HOST).await;
    write_all(&mut qb, 0, &content(8 << 20, 5)).await;
    let on = |tag: u16, off: u64, len: u64| Object { len, extents: vec![Extent::data(global::address(tag, off), len)] };
    let crc = |o: Object| desc("crc32c", b"", vec![o], vec![]).encode();
    let good = qa.compute(1, &crc(on(2, 0, 8 << 20)), T).await.unwrap();

    let e = qa.compute(1, &crc(on(9, 0, 4096)), T).await.unwrap_err();
    refused(e, cs::DEVICE_UNKNOWN, &["device tag 9 is not in this target's cluster map"]);
    let e = qa.compute(1, &crc(on(3, 0, 4096)), T).await.unwrap_err();
    refused(
        e,
        cs::PEER_DENIED,
        &["peer tag 3", "does not let nqn.2026-11.io.nearstore:target-a read it for host nqn.2026-11.io.nearstore:host"],
    );
    let e = qa.compute(1, &crc(on(4, 0, 4096)), T).await.unwrap_err();
    refused(e, cs::PEER_FAILED, &["peer tag 4", "connecting as"]);
    let e = qa.compute(1, &crc(on(2, 63 << 20, 2 << 20)), T).await.unwrap_err();
    refused(e, cs::PEER_FAILED, &["peer tag 2", "lie outside its namespace of 67108864 bytes"]);
    // Outputs cannot be on a peer.
    let out = on(2, 0, 4096);
    let e = qa.compute(1, &desc("copy", b"", vec![on(0, 0, 4096)], vec![out]).encode(), T).await.unwrap_err();
    refused(e, cs::DESCRIPTOR_INVALID, &["outputs lie on the addressed namespace"]);

    // Through the proxies: first faithful (the connection is pooled), then the peer dies
    // 1 MiB into the next transfer, or stalls.
    let opened = |tag: u16| p.a.offload.peers.stats().iter().find(|s| s.0 == tag).map(|s| s.2.connections.load(Ordering::Relaxed));
    // An input on a peer is read ahead (compute.readahead 2: at most 3 reads of a 1 MiB
    // chunk at once, within read_ahead_bytes and connections_per_peer), each read on a
    // connection of its own; how many were at once when none was idle depends on timing
    // (one to three: a loaded machine finishes one before the next starts). The commands
    // after the first reuse them: four commands never open more than three.
    for _ in 0..4 {
        assert_eq!(qa.compute(1, &crc(on(5, 0, 8 << 20)), T).await.unwrap(), good);
        let n = opened(5).unwrap_or(0);
        assert!((1..=3).contains(&n), "{n} connections to peer 5: the first command's are reused by the next ones");
    }
    let before_cut = opened(5).expect("opened above");
    p.cut.cut.store(true, Ordering::Relaxed);
    let e = qa.compute(1, &crc(on(5, 0, 8 << 20)), T).await.unwrap_err();
    refused(e, cs::PEER_FAILED, &["peer tag 5"]);
    p.stall.stall.store(true, Ordering::Relaxed);
    let t0 = std::time::Instant::now();
    let e = qa.compute(1, &crc(on(6, 0, 8 << 20)), T).await.unwrap_err();
    refused(e, cs::PEER_FAILED, &["peer tag 6", "no data for 2 s"]);
    assert!(t0.elapsed() < Duration::from_secs(20), "a stalled peer held the command for {:?}", t0.elapsed());

    // The target keeps serving, peers and all, and nothing is left running.
    assert_eq!(qa.compute(1, &crc(on(2, 0, 8 << 20)), T).await.unwrap(), good);
    assert_eq!(p.a.offload.stats.running.load(Ordering::Relaxed), 0);
    // The metrics count each peer's bytes, failures and connections.
    let m = nearstore_target::metrics::render(&p.a);
    let value = |name: &str, tag: u16| -> u64 {
        let line = m.lines().find(|l| l.starts_with(&format!("{name}{{tag=\"{tag}\""))).unwrap_or_else(|| panic!("{name} tag {tag}:\n{m}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert!(value("nearstore_peer_read_bytes_total", 2) >= 16 << 20, "{m}");
    assert_eq!(value("nearstore_peer_failures_total", 2), 1, "the range outside the namespace");
    assert_eq!(value("nearstore_peer_failures_total", 3), 1, "the host B does not admit");
    assert_eq!(value("nearstore_peer_failures_total", 5), 1, "{m}");
    assert_eq!(value("nearstore_peer_failures_total", 4), 1, "{m}");
    // The cut connections were pooled: each read found its own dead and tried once more
    // on a fresh one.
    assert!(value("nearstore_peer_connections_total", 5) > before_cut, "{before_cut} before the cut: {m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_commands_share_a_bounded_number_of_peer_connections() {
    let p = start().await;
    let (_cb, mut qb) = queue(p.b_addr, PEER_NQN, A_HOST).await;
    let data = content(8 << 20, 9);
    write_all(&mut qb, 0, &data).await;
    // A target allowed one connection to its peer: three commands at once take turns on it.
    let cfg = Config::from_toml(&format!(
        "[[listener]]\naddress = \"127.0.0.1:0\"\n[cluster]\nhost_nqn = \"{A_HOST}\"\nconnections_per_peer = 1\n[[cluster.peer]]\ntag = 2\naddress = \"{}\"\nnqn = \"{PEER_NQN}\"\n[[subsystem]]\nnqn = \"{}\"\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\nmemory = \"1MiB\"\n",
        p.b_addr,
        common::NQN
    ))
    .unwrap();
    let a1 = Target::from_config(&cfg).unwrap();
    let addr = a1.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    let want = nearstore_compute::run("crc32c", b"", [&data[..]]).unwrap();
    let obj = Object { len: 8 << 20, extents: vec![Extent::data(global::address(2, 0), 8 << 20)] };
    let d = desc("crc32c", b"", vec![obj], vec![]).encode();
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let d = d.clone();
        tasks.push(tokio::spawn(async move {
            let (_c, mut q) = queue(addr, common::NQN, HOST).await;
            q.compute(1, &d, T).await.unwrap()
        }));
    }
    for t in tasks {
        let got: Vec<Outcome> = serde_json::from_slice(&t.await.unwrap()).unwrap();
        assert_eq!(got[0], want);
    }
    // The peer saw the test's own connection and one from the target, kept for reuse.
    assert_eq!(p.b.subsystem(PEER_NQN).unwrap().controller_count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_that_stops_reading_early_leaves_the_peer_connection_clean() {
    let p = start().await;
    let (_ca, mut qa) = queue(p.a_addr, common::NQN, HOST).await;
    let (_cb, mut qb) = queue(p.b_addr, PEER_NQN, A_HOST).await;
    let csv = [b"x,y\n".to_vec(), b"1,2\n".repeat(2 << 20)].concat();
    write_all(&mut qb, 0, &csv).await;
    let obj = Object { len: csv.len() as u64, extents: vec![Extent::data(global::address(2, 0), (csv.len() as u64).div_ceil(BS) * BS)] };
    let crc = desc("crc32c", b"", vec![obj.clone()], vec![]).encode();
    let want = nearstore_compute::run("crc32c", b"", [&csv[..]]).unwrap();
    for _ in 0..3 {
        // LIMIT 1 stops after the first chunk, with reads of the peer still in flight.
        let q = desc("select", br#"{"query":"SELECT x FROM s3object LIMIT 1"}"#, vec![obj.clone()], vec![]).encode();
        let got: Vec<Outcome> = serde_json::from_slice(&qa.compute(1, &q, T).await.unwrap()).unwrap();
        assert!(matches!(&got[0], Outcome::Select { rows, .. } if rows.len() == 1), "{got:?}");
        // The next stream from that peer reads the right bytes.
        let got: Vec<Outcome> = serde_json::from_slice(&qa.compute(1, &crc, T).await.unwrap()).unwrap();
        assert_eq!(got[0], want);
    }
}

/// A command whose host goes away while it waits on a stalled peer ends at once: its
/// peer reads are cancelled, not waited for until `cluster.timeout_secs` (2 s) passes;
/// the peer's connection is closed and the next command reads the peer again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_stopped_while_a_peer_stalls_ends_without_waiting_for_it() {
    let p = start().await;
    let (_cb, mut qb) = queue(p.b_addr, PEER_NQN, A_HOST).await;
    write_all(&mut qb, 0, &content(8 << 20, 3)).await;
    let crc =
        desc("crc32c", b"", vec![Object { len: 8 << 20, extents: vec![Extent::data(global::address(6, 0), 8 << 20)] }], vec![]).encode();
    let (_ca, mut qa) = queue(p.a_addr, common::NQN, HOST).await;
    // A first command pools the connection through the proxy, which then stalls.
    let good = qa.compute(1, &crc, T).await.unwrap();
    p.stall.stall.store(true, Ordering::Relaxed);
    let stats = &p.a.offload.stats;
    let (c2, mut q2) = queue(p.a_addr, common::NQN, HOST).await;
    let c = crc.clone();
    let task = tokio::spawn(async move { q2.compute(1, &c, T).await });
    let t0 = std::time::Instant::now();
    while stats.reads_in_flight.load(Ordering::Relaxed) == 0 {
        assert!(t0.elapsed() < T, "no read of the peer started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Closing the host's connection cancels the command mid-read.
    let closed = std::time::Instant::now();
    task.abort();
    drop(c2);
    while stats.running.load(Ordering::Relaxed) > 0 {
        assert!(closed.elapsed() < T, "still running");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = closed.elapsed();
    // Waiting for the stalled peer would take cluster.timeout_secs (2 s); anything short of
    // that is the cancellation (1 s here before, too close on a loaded machine).
    assert!(took < Duration::from_millis(1800), "the command waited {took:?} for its stalled peer after its host left");
    assert_eq!(stats.reads_in_flight.load(Ordering::Relaxed), 0);
    p.stall.stall.store(false, Ordering::Relaxed);
    assert_eq!(qa.compute(1, &crc, T).await.unwrap(), good, "the peer is read again");
}

/// The confused deputy as it was reproduced: a host allowed only on A's open subsystem
/// sends a copy whose input is a local extent then B's extent (B admits A's cluster NQN,
/// not this host). It read B's data back; now the command is refused with PEER_DENIED
/// naming the peer and the host, before a byte is read, locally or from B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_cannot_read_through_a_target_what_the_peer_denies_it() {
    let p = start().await;
    let (_cb, mut qb) = queue(p.b_addr, PEER_NQN, A_HOST).await;
    let secret = content(1 << 20, 11);
    write_all(&mut qb, 0, &secret).await;
    // The host could not read B itself.
    let mut o = ConnectOptions::new(p.b_addr, PEER_NQN);
    o.hostnqn = STRANGER.into();
    match Controller::connect(o).await {
        Err(Error::Status { status, .. }) => assert_eq!(status, Status::CONNECT_INVALID_HOST.dnr()),
        r => panic!("the stranger connected to B itself: {:?}", r.map(|c| c.cntlid)),
    }
    let (_ca, mut qa) = queue(p.a_addr, common::NQN, STRANGER).await;
    let b_ns = p.b.subsystem(PEER_NQN).unwrap().namespace(1).unwrap();
    let (b_reads, a_read) = (b_ns.stats.reads.load(Ordering::Relaxed), p.a.offload.stats.bytes_read.load(Ordering::Relaxed));
    let input = Object { len: 4096 + (1 << 20), extents: vec![Extent::data(0, 4096), Extent::data(global::address(2, 0), 1 << 20)] };
    let out = Object { len: input.len, extents: vec![Extent::data(16 << 20, input.len)] };
    let e = qa.compute(1, &desc("copy", b"", vec![input], vec![out]).encode(), T).await.unwrap_err();
    refused(e, cs::PEER_DENIED, &["peer tag 2", &format!("{}", p.b_addr), PEER_NQN, &format!("for host {STRANGER}"), A_HOST]);
    assert_eq!(b_ns.stats.reads.load(Ordering::Relaxed), b_reads, "B served reads for the refused command");
    assert_eq!(p.a.offload.stats.bytes_read.load(Ordering::Relaxed), a_read, "A read input bytes for the refused command");
    for i in 0..((1u64 << 20) + 4096).div_ceil(128 << 10) {
        let copied = qa.read(1, (16 << 20) / BS + i * 256, 256, BS as u32).await.unwrap();
        assert!(copied.iter().all(|&b| b == 0), "the output holds bytes of B");
    }
}

/// Who may read through A: the host B allows, any host on B's open subsystem; not a host
/// B does not allow, on either subsystem B restricts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_reads_a_peer_for_exactly_the_hosts_the_peer_admits() {
    let p = start().await;
    for nqn in [PEER_NQN.to_string(), format!("{PEER_NQN}-open")] {
        let (_cb, mut qb) = queue(p.b_addr, &nqn, A_HOST).await;
        write_all(&mut qb, 0, &content(64 << 10, 12)).await;
    }
    let want = serde_json::to_vec(&[nearstore_compute::run("crc32c", b"", [&content(64 << 10, 12)[..]]).unwrap()]).unwrap();
    let crc = |tag: u16| {
        desc("crc32c", b"", vec![Object { len: 64 << 10, extents: vec![Extent::data(global::address(tag, 0), 64 << 10)] }], vec![]).encode()
    };
    for (host, tag, denied) in [
        (HOST, 2, false),
        (STRANGER, 2, true),
        (HOST, 7, false),
        (STRANGER, 7, false),
        (HOST, 3, true),
        (A_HOST, 2, false),
        ("nqn.2026-11.io.nearstore:someone-else", 3, false),
    ] {
        let (_ca, mut qa) = queue(p.a_addr, common::NQN, host).await;
        let r = qa.compute(1, &crc(tag), T).await;
        if denied {
            refused(r.unwrap_err(), cs::PEER_DENIED, &[&format!("peer tag {tag}"), &format!("for host {host}")]);
        } else if tag == 3 {
            // B's closed subsystem holds other bytes: only admission is asked here.
            r.unwrap_or_else(|e| panic!("{host} on tag {tag}: {e}"));
        } else {
            assert_eq!(r.unwrap_or_else(|e| panic!("{host} on tag {tag}: {e}")), want, "{host} on tag {tag}");
        }
    }
}

/// The peer's side of the extension: only a trusted member may act for a host, only for
/// a host the subsystem allows, with a well-formed NQN, and an I/O queue must act for the
/// same host as its admin queue. A member's own connection (no host named) is unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_trusted_members_act_for_hosts_the_subsystem_allows() {
    let p = start().await;
    let ok = None;
    let invalid_host = Some(Status::CONNECT_INVALID_HOST.dnr());
    let invalid_param = Some(Status::CONNECT_INVALID_PARAMETERS.dnr());
    let open = format!("{PEER_NQN}-open");
    for (hostnqn, acting_for, subnqn, want) in [
        (A_HOST, Some(HOST), PEER_NQN, ok),
        (A_HOST, None, PEER_NQN, ok),
        (A_HOST, Some(STRANGER), PEER_NQN, invalid_host),
        (A_HOST, Some(STRANGER), open.as_str(), ok),
        // Not a member: refused even where the host it names, or it itself, is allowed.
        (HOST, Some(HOST), PEER_NQN, invalid_host),
        (STRANGER, Some(HOST), open.as_str(), invalid_host),
        (A_HOST, Some("not an nqn"), PEER_NQN, invalid_param),
    ] {
        let mut o = ConnectOptions::new(p.b_addr, subnqn);
        o.hostnqn = hostnqn.into();
        o.acting_for = acting_for.map(str::to_string);
        let case = format!("{hostnqn} acting for {acting_for:?} on {subnqn}");
        match (Controller::connect(o).await, want) {
            (Ok(c), None) => {
                let ctrl = p.b.subsystem(subnqn).unwrap().controller(c.cntlid).unwrap();
                assert_eq!(ctrl.requester(), acting_for.unwrap_or(hostnqn), "{case}");
                // The I/O queue must act for the same host.
                let mut c = c;
                c.io_queue(1).await.unwrap_or_else(|e| panic!("{case}: I/O queue: {e}"));
                c.opts.acting_for = Some(format!("{HOST}-2"));
                match c.io_queue(2).await {
                    Err(Error::Status { status, cqe, .. }) => {
                        assert_eq!(status, Status::CONNECT_INVALID_PARAMETERS.dnr(), "{case}");
                        assert_eq!(cqe.dw0 >> 16, 768, "{case}: IPO names the acting-for field");
                    }
                    r => panic!("{case}: an I/O queue acting for another host: {:?}", r.map(|_| ())),
                }
            }
            (Err(Error::Status { status, .. }), Some(w)) => assert_eq!(status, w, "{case}"),
            (r, w) => panic!("{case}: got {:?}, want {w:?}", r.map(|c| c.cntlid)),
        }
    }
    // A target that is not one of B's members is refused for a host B allows.
    let cfg = Config::from_toml(&format!(
        "[[listener]]\naddress = \"127.0.0.1:0\"\n[cluster]\nhost_nqn = \"{STRANGER}\"\n[[cluster.peer]]\ntag = 2\naddress = \"{}\"\nnqn = \"{PEER_NQN}\"\n[[subsystem]]\nnqn = \"{}\"\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\nmemory = \"1MiB\"\n",
        p.b_addr,
        common::NQN
    ))
    .unwrap();
    let a2 = Target::from_config(&cfg).unwrap();
    let addr = a2.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    let (_c, mut q) = queue(addr, common::NQN, HOST).await;
    let obj = Object { len: 4096, extents: vec![Extent::data(global::address(2, 0), 4096)] };
    let e = q.compute(1, &desc("crc32c", b"", vec![obj], vec![]).encode(), T).await.unwrap_err();
    refused(e, cs::PEER_DENIED, &["peer tag 2", &format!("does not let {STRANGER} read it for host {HOST}"), "trusted_members"]);
}

/// Pooled connections belong to one host: host X's connection never serves host Y, and
/// the peer's connections stay within connections_per_peer for all hosts together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_peer_connections_never_serve_another_host() {
    let p = start().await;
    let (_cb, mut qb) = queue(p.b_addr, PEER_NQN, A_HOST).await;
    let data = content(64 << 10, 13);
    write_all(&mut qb, 0, &data).await;
    let cfg = Config::from_toml(&format!(
        "[[listener]]\naddress = \"127.0.0.1:0\"\n[cluster]\nhost_nqn = \"{A_HOST}\"\nconnections_per_peer = 2\n[[cluster.peer]]\ntag = 2\naddress = \"{}\"\nnqn = \"{PEER_NQN}\"\n[[subsystem]]\nnqn = \"{}\"\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\nmemory = \"1MiB\"\n",
        p.b_addr,
        common::NQN
    ))
    .unwrap();
    let a = Target::from_config(&cfg).unwrap();
    let addr = a.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    let obj = Object { len: 64 << 10, extents: vec![Extent::data(global::address(2, 0), 64 << 10)] };
    let d = desc("crc32c", b"", vec![obj], vec![]).encode();
    let want = serde_json::to_vec(&[nearstore_compute::run("crc32c", b"", [&data[..]]).unwrap()]).unwrap();
    let connections = || a.offload.peers.stats()[0].2.connections.load(Ordering::Relaxed);
    // B's controllers made by A, by the host each acts for.
    let on_b = || -> Vec<String> {
        let sub = p.b.subsystem(PEER_NQN).unwrap();
        let mut v: Vec<String> = (1..=64)
            .filter_map(|id| sub.controller(id))
            .filter(|c| c.hostnqn == A_HOST && c.acting_for.is_some())
            .map(|c| c.requester().into())
            .collect();
        v.sort();
        v
    };
    let (h2, h3) = (format!("{HOST}-2"), format!("{HOST}-3"));
    // (host, admitted, connections opened so far)
    for (host, admitted, opened) in [
        (HOST, true, 1),
        (STRANGER, false, 2), // HOST's idle connection is not lent to it
        (HOST, true, 2),      // reused
        (h2.as_str(), true, 3),
        (HOST, true, 3),
        (h3.as_str(), true, 4), // a third host: the least recently used idle connection (h2's) closes
    ] {
        let (_c, mut q) = queue(addr, common::NQN, host).await;
        let r = q.compute(1, &d, T).await;
        if admitted {
            assert_eq!(r.unwrap_or_else(|e| panic!("{host}: {e}")), want, "{host}");
        } else {
            refused(r.unwrap_err(), cs::PEER_DENIED, &[&format!("for host {host}")]);
        }
        assert_eq!(connections(), opened, "after {host}");
    }
    let t0 = std::time::Instant::now();
    let mut want_on_b = vec![HOST.to_string(), h3.clone()];
    want_on_b.sort();
    while on_b() != want_on_b {
        assert!(t0.elapsed() < Duration::from_secs(10), "B's controllers from A act for {:?}, want {want_on_b:?}", on_b());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn cluster_configuration_errors_name_the_field() {
    let base = |extra: &str| {
        format!(
            "[[listener]]\naddress = \"127.0.0.1:0\"\n{extra}\n[[subsystem]]\nnqn = \"{}\"\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\nmemory = \"1MiB\"\ntag = 1\n",
            common::NQN
        )
    };
    for (extra, field, msg) in [
        ("[cluster]\nconnections_per_peer = 0", "cluster.connections_per_peer", "between 1 and 64"),
        ("[cluster]\nhost_nqn = \"bogus\"", "cluster.host_nqn", "nqn"),
        (
            "[[cluster.peer]]\ntag = 0\naddress = \"127.0.0.1:1\"\nnqn = \"nqn.2026-11.io.x:y\"",
            "cluster.peer[0].tag",
            "between 1 and 65534",
        ),
        ("[[cluster.peer]]\ntag = 1\naddress = \"127.0.0.1:1\"\nnqn = \"nqn.2026-11.io.x:y\"", "cluster.peer[0].tag", "used twice"),
        ("[cluster]\nread_ahead_bytes = \"1KiB\"", "cluster.read_ahead_bytes", "between 128 KiB"),
        ("[cluster]\ntrusted_members = [\"nqn.2026-11.io.x:y\", \"t2\"]", "cluster.trusted_members[1]", "not an NQN"),
    ] {
        let e = Config::from_toml(&base(extra)).unwrap_err().to_string();
        assert!(e.starts_with(field) && e.contains(msg), "{extra}: {e}");
    }
    let e = Config::from_toml(&base("[[cluster.peer]]\ntag = 70000")).unwrap_err().to_string();
    assert!(e.contains("tag"), "{e}");
}
