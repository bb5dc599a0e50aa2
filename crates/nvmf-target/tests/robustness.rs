//! The target under hostile and heavy use: random PDUs on live connections, a host that
//! stops reading, the metrics endpoint, and no leaks once everyone has gone.

mod common;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use nearstore_initiator::{Controller, Data};
use nearstore_target::{limits, Target};
use nearstore_wire::fabrics::ConnectData;
use nearstore_wire::opcode::{admin, fctype, io, FABRICS};
use nearstore_wire::pdu::{self, DataHdr, PduType};
use nearstore_wire::sqe::sgl_id;
use nearstore_wire::{Sgl, Sqe};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// One target for every fuzz case, with an admin queue held open so that fuzz cases can
/// connect I/O queues to its controller.
struct Fuzz {
    rt: tokio::runtime::Runtime,
    env: common::Env,
    cntlid: u16,
    _admin: Controller,
}

impl Fuzz {
    fn new() -> Fuzz {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let (env, admin) = rt.block_on(async {
            let env = common::start().await;
            let admin = env.connect().await;
            (env, admin)
        });
        Fuzz { rt, cntlid: admin.cntlid, env, _admin: admin }
    }
}

/// The target the proptest's cases share.
fn fuzz_env() -> &'static Fuzz {
    static F: OnceLock<Fuzz> = OnceLock::new();
    F.get_or_init(Fuzz::new)
}

fn connect_capsule(qid: u16, cntlid: u16) -> Vec<u8> {
    let mut s = Sqe::new(FABRICS, 1);
    s.set_nsid(fctype::CONNECT as u32).set_cdw(10, (qid as u32) << 16).set_cdw(11, 31);
    let d =
        ConnectData { hostid: [1; 16], cntlid, subnqn: common::NQN.into(), hostnqn: common::GOOD_HOST.into(), acting_for: None }.encode();
    s.set_sgl(Sgl { addr: 0, len: d.len() as u32, id: sgl_id::IN_CAPSULE });
    let mut b = Vec::new();
    pdu::put_capsule_cmd(&mut b, &s, &d, false, false);
    b
}

/// Valid PDUs that random mutations start from.
fn seeds(cntlid: u16) -> Vec<Vec<u8>> {
    let mut out = vec![connect_capsule(0, cntlid), connect_capsule(1, cntlid)];
    let capsule = |mut s: Sqe, data: &[u8], id: u8| {
        s.set_sgl(Sgl { addr: 0, len: data.len().max(4096) as u32, id });
        let mut b = Vec::new();
        pdu::put_capsule_cmd(&mut b, &s, if id == sgl_id::IN_CAPSULE { data } else { &[] }, false, false);
        b
    };
    out.push(capsule(Sqe::rw(io::READ, 1, 8, 7, false), &[], sgl_id::TRANSPORT));
    out.push(capsule(Sqe::rw(io::WRITE, 2, 1, 1, true), &[0x5a; 4096], sgl_id::IN_CAPSULE));
    out.push(capsule(Sqe::rw(io::WRITE, 1, 0, 64, false), &[], sgl_id::TRANSPORT));
    out.push(capsule(*Sqe::new(admin::IDENTIFY, 2).set_cdw(10, 1), &[], sgl_id::TRANSPORT));
    out.push(capsule(*Sqe::new(io::DATASET_MANAGEMENT, 3).set_nsid(2).set_cdw(11, 4), &[0; 16], sgl_id::IN_CAPSULE));
    let mut h2c = Vec::new();
    let d = DataHdr { cccid: 0, ttag: 0, offset: 0, len: 512 };
    pdu::put_pdu(&mut h2c, PduType::H2CData, pdu::flags::LAST_PDU, &d.psh(), &[1; 512], false, false);
    out.push(h2c);
    out
}

#[derive(Debug, Clone)]
struct Case {
    connect_first: bool,
    seed: usize,
    flips: Vec<(usize, u8)>,
    cut: Option<usize>,
    tail: Vec<u8>,
    repeat: u8,
}

fn case() -> impl Strategy<Value = Case> {
    (
        any::<bool>(),
        0..8usize,
        prop::collection::vec((0..5000usize, 1..=255u8), 0..6),
        prop::option::of(0..5000usize),
        prop::collection::vec(any::<u8>(), 0..300),
        1..4u8,
    )
        .prop_map(|(connect_first, seed, flips, cut, tail, repeat)| Case { connect_first, seed, flips, cut, tail, repeat })
}

async fn run_case(f: &Fuzz, c: &Case) {
    let (mut host, tgt) = UnixStream::pair().unwrap();
    let h = f.env.target.serve_stream(tgt, false);
    let mut bytes = Vec::new();
    pdu_icreq(&mut bytes);
    if c.connect_first {
        bytes.extend_from_slice(&connect_capsule(1, f.cntlid));
    }
    let seeds = seeds(f.cntlid);
    let mut m = seeds[c.seed % seeds.len()].clone();
    for &(pos, x) in &c.flips {
        let n = m.len();
        m[pos % n] ^= x;
    }
    if let Some(cut) = c.cut {
        m.truncate(cut % (m.len() + 1));
    }
    for _ in 0..c.repeat {
        bytes.extend_from_slice(&m);
    }
    bytes.extend_from_slice(&c.tail);
    // The target may close early (TermReq): a failed write is fine.
    let _ = host.write_all(&bytes).await;
    let _ = host.shutdown().await;
    // Whatever it answers, it must end the connection by itself: read to the end.
    let mut sink = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(10), host.read_to_end(&mut sink)).await;
    assert!(r.is_ok(), "the target did not close the connection after EOF: {c:?}");
    drop(host);
    let joined = tokio::time::timeout(Duration::from_secs(10), h).await.expect("connection task ended");
    assert!(joined.is_ok(), "connection task panicked on {c:?}");
}

fn pdu_icreq(out: &mut Vec<u8>) {
    pdu::IcReq { pfv: 0, hpda: 0, hdgst: false, ddgst: false, maxr2t: 0 }.encode(out);
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("NEARSTORE_LIVE_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(300),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]
    /// Random and mutated PDUs on live connections: no panic, no hang, and (checked
    /// after) the target still serves a healthy host.
    #[test]
    fn live_fuzz(c in case()) {
        let f = fuzz_env();
        f.rt.block_on(run_case(f, &c));
    }
}

/// On a target of its own: `live_fuzz` runs beside it and keeps connecting to the shared
/// one, so counts there would include its cases.
#[test]
fn live_fuzz_leaves_target_serving_and_leak_free() {
    let f = &Fuzz::new();
    f.rt.block_on(async {
        for seed in 0..40u64 {
            let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut tail = vec![0u8; (seed as usize * 37) % 700];
            for b in &mut tail {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                *b = rng as u8;
            }
            let c = Case {
                connect_first: seed % 2 == 0,
                seed: seed as usize,
                flips: vec![((rng % 97) as usize, (rng >> 8) as u8 | 1)],
                cut: None,
                tail,
                repeat: 1,
            };
            run_case(f, &c).await;
        }
        // A healthy host still gets served.
        let c = f.env.connect().await;
        let mut q = c.io_queue(1).await.unwrap();
        q.write(1, 0, &[7u8; 4096], 512, false).await.unwrap();
        assert_eq!(q.read(1, 0, 8, 512).await.unwrap(), vec![7u8; 4096]);
        drop(q);
        c.shutdown().await.unwrap();
    });
    // Every fuzz connection has gone: only the admin queue held by `Fuzz` remains.
    wait_until(|| f.env.target.stats.connections.load(std::sync::atomic::Ordering::Relaxed) == 1);
    let sub = f.env.target.subsystem(common::NQN).unwrap();
    assert_eq!(sub.controller_count(), 1, "controllers left behind by fuzz connections");
}

fn wait_until(cond: impl Fn() -> bool) {
    for _ in 0..200 {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    panic!("condition not reached in 5 s");
}

/// A host that sends 128 reads of 128 KiB and reads nothing for a while: the target stops
/// taking commands and completions, and one connection's buffers stay under the formula
/// of docs/protocol.md. Once the host reads, every command completes and, after it
/// leaves, every buffer byte is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_per_connection_stays_under_the_formula_and_is_released() {
    let env = common::start().await;
    let stats = &env.target.stats;
    for nsid in [1u32, 2] {
        let mut o = env.opts();
        o.queue_depth = 129;
        let c = Controller::connect(o).await.unwrap();
        let ns = c.identify_namespace(nsid).await.unwrap();
        let per = (128 * 1024 / ns.block_size()) as u32;
        let mut io = c.io_queue(1).await.unwrap();
        let q = io.queue();
        let partial = stats.tx_partial_writes.load(std::sync::atomic::Ordering::Relaxed);
        for i in 0..128u64 {
            q.submit(Sqe::rw(io::READ, nsid, i * per as u64, per, false), Data::In(128 * 1024), i).unwrap();
        }
        q.flush().await.unwrap();
        // The host reads nothing until the back-pressure holds, so the gauge does measure:
        // the responses to 16 MiB of reads cannot all fit the socket. Reads of the file
        // namespace are copied into the send buffer until it reaches its threshold; those
        // of the memory namespace wait in its memory (at most TX_LENT_READS_MAX of them)
        // once the socket has cut a send short.
        let t0 = std::time::Instant::now();
        let held = || match nsid {
            1 => stats.tx_partial_writes.load(std::sync::atomic::Ordering::Relaxed) > partial,
            _ => stats.connection_buffer_bytes_max.load(std::sync::atomic::Ordering::Relaxed) >= limits::TX_PENDING_BYTES_MAX as u64,
        };
        while !held() {
            assert!(t0.elapsed() < Duration::from_secs(10), "nsid {nsid}: the back-pressure never held");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut done = 0;
        while done < 128 {
            done += q
                .poll(|_, cqe, data| {
                    assert!(cqe.status.is_success());
                    assert_eq!(data.len(), 128 * 1024);
                })
                .await
                .unwrap();
        }
        let peak = stats.connection_buffer_bytes_max.load(std::sync::atomic::Ordering::Relaxed) as usize;
        let bound = limits::connection_memory_max(129);
        assert!(peak <= bound, "nsid {nsid}: peak {peak} over the bound {bound}");
        drop(io);
        c.shutdown().await.unwrap();
    }
    let t: &Arc<Target> = &env.target;
    wait_until(|| t.stats.connections.load(std::sync::atomic::Ordering::Relaxed) == 0);
    assert_eq!(t.stats.buffer_bytes.load(std::sync::atomic::Ordering::Relaxed), 0, "buffer bytes not released");
    assert_eq!(t.subsystem(common::NQN).unwrap().controller_count(), 0);
}

/// The metrics endpoint serves Prometheus text with the I/O just done.
#[tokio::test]
async fn metrics_endpoint_counts_io() {
    let env = common::start().await;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let maddr = l.local_addr().unwrap();
    tokio::spawn(nearstore_target::metrics::serve(l, env.target.clone()));
    let c = env.connect().await;
    let mut q = c.io_queue(1).await.unwrap();
    for i in 0..5 {
        q.write(2, i, &[1u8; 4096], 4096, false).await.unwrap();
    }
    for i in 0..3 {
        q.read(2, i, 1, 4096).await.unwrap();
    }
    assert!(q.read(2, 1 << 40, 1, 4096).await.is_err());
    let mut s = tokio::net::TcpStream::connect(maddr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").await.unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    assert!(body.starts_with("HTTP/1.0 200 OK\r\n"), "{body}");
    let labels = format!("{{subnqn=\"{}\",nsid=\"2\"}}", common::NQN);
    let value = |name: &str| -> f64 {
        let key = format!("{name}{labels} ");
        let line = body.lines().find(|l| l.starts_with(&key)).unwrap_or_else(|| panic!("no {key} in\n{body}"));
        line[key.len()..].parse().unwrap()
    };
    assert_eq!(value("nearstore_writes_total"), 5.0);
    assert_eq!(value("nearstore_reads_total"), 3.0);
    assert_eq!(value("nearstore_written_bytes_total"), 5.0 * 4096.0);
    assert_eq!(value("nearstore_read_bytes_total"), 3.0 * 4096.0);
    assert_eq!(value("nearstore_io_latency_seconds_count"), 8.0);
    assert!(body.contains("nearstore_connections 2"), "admin + I/O queue connected:\n{body}");
    assert!(body.lines().any(|l| l.starts_with("nearstore_buffer_bytes ") && !l.ends_with(" 0")), "{body}");
}

/// Reads whose completions wait in the io_uring while the send buffer is full are taken
/// once it has room, even with busy-polling off: the eventfd that announced them was
/// consumed when the first of them were reaped and will not signal again. The power-cut
/// test found a read-back hanging this way (docs/crash-testing.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_completions_left_while_the_send_buffer_was_full_are_taken() {
    common::init_logs();
    let dir = tempfile::tempdir().unwrap();
    let cfg = format!(
        r#"
        busy_poll_us = 0
        io_engine = "uring"
        [[listener]]
        address = "127.0.0.1:0"
        [[subsystem]]
        nqn = "{}"
        allow_any_host = true
        [[subsystem.namespace]]
        nsid = 1
        path = "{}/disk.img"
        size = "32MiB"
        block_size = 4096
        "#,
        common::NQN,
        dir.path().display()
    );
    let target = Target::from_config(&nearstore_target::config::Config::from_toml(&cfg).unwrap()).unwrap();
    let addr = target.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    let mut o = nearstore_initiator::ConnectOptions::new(addr, common::NQN);
    o.queue_depth = 128;
    let c = Controller::connect(o).await.unwrap();
    let mut io = c.io_queue(1).await.unwrap();
    let q = io.queue();
    // Page-cache hits complete inside the submit: each batch of 64 x 128 KiB (8 MiB)
    // completes at once, far more than the 1 MiB the send buffer takes before it stops
    // reaping.
    for round in 0..8u64 {
        for i in 0..64u64 {
            q.submit(Sqe::rw(io::READ, 1, i * 32, 32, false), Data::In(128 * 1024), i).unwrap();
        }
        let mut done = 0;
        while done < 64 {
            let n = tokio::time::timeout(Duration::from_secs(10), q.poll(|_, cqe, _| assert!(cqe.status.is_success())))
                .await
                .unwrap_or_else(|_| panic!("round {round}: {done} of 64 reads completed, the rest hang"))
                .unwrap();
            done += n;
        }
    }
    drop(io);
    c.shutdown().await.unwrap();
}
