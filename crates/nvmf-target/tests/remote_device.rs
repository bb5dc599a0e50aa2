//! The remote device: a namespace of another target read and written through the
//! initiator on the caller's runtime, acting for one host. The peer decides admission;
//! its statuses, its disconnects and its stalls fail the operation they hit and nothing
//! else; a slow peer holds back no other connection on the runtime.

mod common;

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use common::proxy::{proxy, Faults};
use nearstore_target::cluster::{ClusterConfig, PeerConfig, Peers};
use nearstore_target::config::{Config, IoEngine};
use nearstore_target::dev::remote::{peer_status, Pool, Remote, RemoteConfig};
use nearstore_target::dev::{BlockDevice, Channel, Completion, Op};
use nearstore_target::io_pool::IoPool;
use nearstore_target::Target;
use nearstore_transport::AlignedBuf;
use nearstore_wire::compute::status as cs;
use nearstore_wire::Status;

const PEER_NQN: &str = "nqn.2026-11.io.nearstore:remote-peer";
/// This target's cluster NQN: the peer trusts it.
const MEMBER: &str = "nqn.2026-11.io.nearstore:member-a";
/// The host the device acts for: the peer's subsystem allows it.
const HOST: &str = "nqn.2026-11.io.nearstore:host";
const STRANGER: &str = "nqn.2026-11.io.nearstore:stranger";
const SIZE: u64 = 8 << 20;
/// How long namespace 2 of the peer holds every operation: long enough that an operation
/// cancelled under load is still told from one the peer answered.
const DELAY: Duration = Duration::from_secs(5);
/// The device timeout, longer than DELAY.
const T: Duration = Duration::from_secs(10);

struct Peer {
    _b: Arc<Target>,
    addr: SocketAddr,
    faults: Arc<Faults>,
    proxied: SocketAddr,
}

/// The peer: namespace 1 (memory, 512-byte blocks), 2 (behind a delay of DELAY), 3
/// (failing every operation on LBAs 16..32), and a proxy in front of it.
async fn peer() -> Peer {
    common::init_logs();
    let cfg = Config::from_toml(&format!(
        r#"
        [[listener]]
        address = "127.0.0.1:0"
        [cluster]
        trusted_members = ["{MEMBER}"]
        [[subsystem]]
        nqn = "{PEER_NQN}"
        hosts = ["{HOST}", "{MEMBER}"]
        [[subsystem.namespace]]
        nsid = 1
        memory = "8MiB"
        [[subsystem.namespace]]
        nsid = 2
        memory = "1MiB"
        delay_us = {}
        [[subsystem.namespace]]
        nsid = 3
        memory = "1MiB"
        block_size = 4096
        [subsystem.namespace.inject]
        lbas = [16, 32]
        "#,
        DELAY.as_micros()
    ))
    .unwrap();
    let b = Target::from_config(&cfg).unwrap();
    let addr = b.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    let faults = Arc::new(Faults::default());
    let proxied = proxy(addr, faults.clone(), 64 << 10).await;
    Peer { _b: b, addr, faults, proxied }
}

fn config(addr: SocketAddr, nsid: u32, member: &str, host: &str, timeout: Duration) -> RemoteConfig {
    RemoteConfig {
        peer: PeerConfig { tag: 2, address: addr, nqn: PEER_NQN.into(), nsid },
        member: member.into(),
        host: host.into(),
        timeout,
        read_ahead_bytes: 1 << 20,
        kato: None,
    }
}

async fn open(addr: SocketAddr, nsid: u32) -> Remote {
    Remote::open(config(addr, nsid, MEMBER, HOST, T), Arc::new(Pool::new(4))).await.unwrap()
}

/// A host's queue's channel (a tenant's: the device completes a write it gave up only once
/// that write cannot land any more).
fn channel() -> Channel {
    let mut ch = Channel::new(IoEngine::Uring, IoPool::new(1));
    let policy = nearstore_target::tenant::TenantPolicy::unrestricted(nearstore_target::tenant::TenantId::DEFAULT, "default", 100, 100);
    ch.set_tenant(Arc::new(nearstore_target::dev::fair::Tenant::of(&policy, HOST)));
    ch
}

fn buf(len: usize) -> AlignedBuf {
    let mut b = AlignedBuf::new(len);
    b.set_len(len);
    b
}

fn filled(len: usize, seed: u8) -> AlignedBuf {
    let mut b = buf(len);
    b.iter_mut().enumerate().for_each(|(i, x)| *x = (i as u8).wrapping_mul(31).wrapping_add(seed));
    b
}

async fn run(dev: &Remote, op: Op, b: AlignedBuf) -> Completion {
    channel().run(dev, op, b).await
}

#[tokio::test]
async fn reads_and_writes_go_to_the_peer() {
    let p = peer().await;
    let dev = open(p.addr, 1).await;
    let g = dev.geometry();
    assert_eq!((g.size, g.block_size), (SIZE, 512));
    // (what, offset, length): in the capsule, through R2T, split over the peer's transfer
    // size, the last block.
    let cases: &[(&str, u64, usize)] = &[
        ("one block", 0, 512),
        ("in-capsule", 4096, 8192),
        ("over the transfer size", (1 << 20) - 4096, 300 << 10),
        ("the last block", SIZE - 512, 512),
    ];
    for (i, &(what, off, len)) in cases.iter().enumerate() {
        let c = run(&dev, Op::Write { off, fua: i % 2 == 0 }, filled(len, i as u8)).await;
        assert!(c.result.is_ok(), "{what}: write: {:?}", c.result);
        let c = run(&dev, Op::Read { off }, buf(len)).await;
        assert!(c.result.is_ok(), "{what}: read: {:?}", c.result);
        assert!(c.buf[..] == filled(len, i as u8)[..], "{what}: read back what was written");
    }
    // A second device for the same host sees the same bytes through its own connections.
    let other = open(p.addr, 1).await;
    assert!(run(&other, Op::Read { off: 4096 }, buf(8192)).await.buf[..] == filled(8192, 1)[..], "another device reads it");
    assert!(run(&dev, Op::Flush, buf(0)).await.result.is_ok(), "flush");
    let off = (1 << 20) - 4096;
    let zeroes = Op::WriteZeroes { off, len: 4096, deallocate: false, fua: true };
    assert!(run(&dev, zeroes, buf(0)).await.result.is_ok(), "write zeroes");
    let mut ranges = buf(32);
    ranges[..8].copy_from_slice(&(off + 4096).to_le_bytes());
    ranges[8..16].copy_from_slice(&4096u64.to_le_bytes());
    assert!(run(&dev, Op::Deallocate, ranges).await.result.is_ok(), "deallocate (with an empty range)");
    let c = run(&dev, Op::Read { off }, buf(12288)).await;
    assert!(c.buf[..8192].iter().all(|&b| b == 0), "zeroed and deallocated blocks read as zeros");
    assert!(c.buf[8192..] == filled(300 << 10, 2)[8192..12288], "the block after them is kept");
}

#[tokio::test]
async fn the_peer_decides_whom_the_device_acts_for() {
    let p = peer().await;
    // (what, member, host)
    let cases: &[(&str, &str, &str)] = &[
        ("a host the peer does not allow", MEMBER, STRANGER),
        ("a member the peer does not trust", "nqn.2026-11.io.nearstore:untrusted", HOST),
    ];
    for &(what, member, host) in cases {
        let r = Remote::open(config(p.addr, 1, member, host, T), Arc::new(Pool::new(1))).await;
        let e = r.err().unwrap_or_else(|| panic!("{what}: admitted"));
        assert_eq!(e.status, cs::PEER_DENIED, "{what}: {}", e.message);
        assert!(e.message.contains(host), "{what}: the message names the host: {}", e.message);
    }
    // Through the cluster map: the error names the peer's tag, and counts a failure.
    let cluster = ClusterConfig {
        host_nqn: Some(MEMBER.into()),
        peer: vec![PeerConfig { tag: 2, address: p.addr, nqn: PEER_NQN.into(), nsid: 1 }],
        ..Default::default()
    };
    let peers = Peers::new(&cluster);
    let e = peers.remote(2, STRANGER).await.err().expect("a stranger is refused");
    assert_eq!(e.status, cs::PEER_DENIED);
    assert!(e.message.contains("peer tag 2"), "{}", e.message);
    assert_eq!(peers.stats()[0].2.failures.load(Relaxed), 1);
    assert_eq!(peers.remote(3, HOST).await.err().expect("no tag 3").status, cs::PEER_FAILED);
    assert_eq!(peers.remote(2, HOST).await.unwrap().geometry().size, SIZE, "the allowed host is admitted");
}

/// What, device, op, buffer length, error kind, the peer's status.
type Case<'a> = (&'a str, &'a Remote, Op, usize, io::ErrorKind, Option<Status>);

#[tokio::test]
async fn errors_from_the_peer_reach_the_completion() {
    let p = peer().await;
    let (one, three) = (open(p.addr, 1).await, open(p.addr, 3).await);
    let cases: Vec<Case> = vec![
        ("read past the end", &one, Op::Read { off: SIZE - 512 }, 1024, io::ErrorKind::InvalidInput, Some(Status::LBA_OUT_OF_RANGE)),
        ("write past the end", &one, Op::Write { off: SIZE, fua: false }, 512, io::ErrorKind::InvalidInput, Some(Status::LBA_OUT_OF_RANGE)),
        (
            "write zeroes past the end",
            &one,
            Op::WriteZeroes { off: SIZE - 512, len: 1024, deallocate: false, fua: false },
            0,
            io::ErrorKind::InvalidInput,
            Some(Status::LBA_OUT_OF_RANGE),
        ),
        ("a read not on a block", &one, Op::Read { off: 100 }, 512, io::ErrorKind::InvalidInput, None),
        ("a read of part of a block", &three, Op::Read { off: 0 }, 512, io::ErrorKind::InvalidInput, None),
        (
            "a failing read on the peer",
            &three,
            Op::Read { off: 16 * 4096 },
            4096,
            io::ErrorKind::Other,
            Some(Status::UNRECOVERED_READ_ERROR),
        ),
        (
            "a failing write on the peer",
            &three,
            Op::Write { off: 20 * 4096, fua: false },
            8192,
            io::ErrorKind::Other,
            Some(Status::WRITE_FAULT),
        ),
    ];
    for (what, dev, op, len, kind, status) in cases {
        let c = run(dev, op, buf(len)).await;
        let e = c.result.expect_err(what);
        assert_eq!(e.kind(), kind, "{what}: {e}");
        assert_eq!(peer_status(&e).map(|s| (s.sct, s.sc)), status.map(|s| (s.sct, s.sc)), "{what}: {e}");
        assert!(e.to_string().contains(PEER_NQN), "{what}: the message names the peer: {e}");
        assert_eq!(c.buf.len(), len, "{what}: the buffer comes back");
        // The connection the error came on still serves.
        assert!(run(dev, Op::Read { off: 0 }, buf(4096)).await.result.is_ok(), "{what}: the next read");
    }
}

#[tokio::test]
async fn a_peer_that_dies_or_stalls_fails_the_operation_only() {
    let p = peer().await;
    // What a stall takes to fail; the same device then reads 1 MiB through the proxy in it.
    let timeout = Duration::from_secs(3);
    let dev = Remote::open(config(p.proxied, 1, MEMBER, HOST, timeout), Arc::new(Pool::new(2))).await.unwrap();
    let direct = open(p.addr, 1).await;
    // (what, the fault, error kind)
    let cases: &[(&str, &std::sync::atomic::AtomicBool, io::ErrorKind)] = &[
        ("the peer disconnects mid-read", &p.faults.cut, io::ErrorKind::ConnectionAborted),
        ("the peer stalls mid-read", &p.faults.stall, io::ErrorKind::TimedOut),
    ];
    for &(what, fault, kind) in cases {
        fault.store(true, Relaxed);
        let c = run(&dev, Op::Read { off: 0 }, buf(1 << 20)).await;
        fault.store(false, Relaxed);
        let e = c.result.expect_err(what);
        assert_eq!(e.kind(), kind, "{what}: {e}");
        assert_eq!(peer_status(&e), None, "{what}");
        assert!(run(&direct, Op::Read { off: 0 }, buf(1 << 20)).await.result.is_ok(), "{what}: the peer still serves");
        assert!(run(&dev, Op::Read { off: 0 }, buf(1 << 20)).await.result.is_ok(), "{what}: the device reconnects");
    }
}

/// Everything on one thread: while an operation waits for a slow peer, others on the
/// same runtime (other devices' connections, the peer's own) go on.
#[tokio::test(flavor = "current_thread")]
async fn a_slow_peer_does_not_stall_other_connections() {
    let p = peer().await;
    let (slow, fast) = (open(p.addr, 2).await, open(p.addr, 1).await);
    let mut slow_ch = channel();
    slow.submit(&mut slow_ch, Op::Read { off: 0 }, buf(4096), 7);
    let started = tokio::time::Instant::now();
    let mut fast_ch = channel();
    for i in 0..20 {
        let c = fast_ch.run(&fast, Op::Read { off: i * 4096 }, buf(4096)).await;
        assert!(c.result.is_ok(), "fast read {i}: {:?}", c.result);
    }
    assert!(started.elapsed() < DELAY, "the fast reads finished within the slow one's delay");
    assert!(!slow_ch.has_completions(), "the slow read is still waiting");
    let mut out = Vec::new();
    while slow_ch.poll(1, &mut out) == 0 {
        slow_ch.wait().await.unwrap();
    }
    assert_eq!(out[0].tag, 7);
    assert!(out[0].result.is_ok(), "the slow read completes: {:?}", out[0].result);
    assert!(started.elapsed() >= DELAY - Duration::from_millis(50));
}

/// An operation whose task ends without a result still completes, once, as cancelled and
/// with its buffer: when the channel's user cancels it (the peer's answer is DELAY away),
/// and when its runtime goes away mid-operation (it completed never before: the channel
/// waited forever).
#[test]
fn an_operation_cancelled_or_dropped_with_its_runtime_completes_once_as_cancelled() {
    let main = tokio::runtime::Runtime::new().unwrap();
    let p = main.block_on(peer());
    // (what, its runtime dropped rather than the operation cancelled)
    for (what, drop_runtime) in [("cancelled by the channel's user", false), ("its runtime dropped", true)] {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let dev = rt.block_on(open(p.addr, 2));
        let mut ch = channel();
        {
            let _on = rt.enter();
            dev.submit(&mut ch, Op::Read { off: 0 }, filled(4096, 1), 7);
        }
        // The read waits on the peer's delayed namespace.
        std::thread::sleep(Duration::from_millis(200));
        let t0 = std::time::Instant::now();
        if drop_runtime {
            rt.shutdown_background();
        } else {
            ch.cancel();
        }
        let c = main.block_on(async {
            let mut out = Vec::new();
            tokio::time::timeout(T, async {
                while ch.poll(4, &mut out) == 0 {
                    ch.wait().await.unwrap();
                }
            })
            .await
            .unwrap_or_else(|_| panic!("{what}: no completion within {T:?}"));
            assert!(!ch.busy(), "{what}: the channel still waits");
            out
        });
        assert!(t0.elapsed() < DELAY / 2, "{what}: completed after {:?}, as the peer answered", t0.elapsed());
        assert_eq!(c.len(), 1, "{what}");
        assert_eq!(c[0].tag, 7, "{what}");
        assert_eq!(c[0].buf.len(), 4096, "{what}: the buffer comes back");
        let e = c[0].result.as_ref().expect_err(what);
        assert_eq!(e.kind(), io::ErrorKind::Interrupted, "{what}: {e}");
        assert!(e.to_string().contains("the operation was cancelled"), "{what}: {e}");
    }
}

/// A proxy whose connections chosen by [`Held::hold_last`] or opened while
/// [`Held::hold_new`] is on stop carrying the host's bytes to the target: kept, and
/// delivered when released, also after the host closed its end (a congested or rerouted
/// flow that delivers late). Bytes from the target pass.
struct Held {
    opened: std::sync::atomic::AtomicU64,
    held: parking_lot::Mutex<std::collections::BTreeSet<u64>>,
    new: std::sync::atomic::AtomicBool,
    released: tokio::sync::Notify,
    /// Held connections whose host's end is closed (the host sees its connection lost) while
    /// their bytes stay held for the target.
    cut: parking_lot::Mutex<std::collections::BTreeSet<u64>>,
    cut_now: tokio::sync::Notify,
}

impl Held {
    /// Holds the `k` connections opened last (a controller's I/O queue opens after its
    /// admin queue).
    fn hold_last(&self, k: u64) {
        let n = self.opened.load(Relaxed);
        self.held.lock().extend(n - k..n);
    }

    /// Holds the connections opened from now on; returns the first one's number.
    fn hold_new(&self) -> u64 {
        self.new.store(true, Relaxed);
        self.opened.load(Relaxed)
    }

    /// Releases the connections numbered `from` and after, and stops holding new ones.
    fn release_from(&self, from: u64) {
        self.new.store(false, Relaxed);
        self.held.lock().retain(|n| *n < from);
        self.released.notify_waiters();
    }

    fn release(&self) {
        self.release_from(0);
    }

    fn holds(&self, n: u64) -> bool {
        self.held.lock().contains(&n)
    }

    /// Closes the host's end of the held connections.
    fn cut_held(&self) {
        let held = self.held.lock().clone();
        self.cut.lock().extend(held);
        self.cut_now.notify_waiters();
    }

    async fn is_cut(&self, n: u64) {
        loop {
            let now = self.cut_now.notified();
            if self.cut.lock().contains(&n) {
                return;
            }
            now.await;
        }
    }
}

async fn held_proxy(to: SocketAddr) -> (SocketAddr, Arc<Held>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let held = Arc::new(Held {
        opened: 0.into(),
        held: Default::default(),
        new: false.into(),
        released: tokio::sync::Notify::new(),
        cut: Default::default(),
        cut_now: tokio::sync::Notify::new(),
    });
    let h = held.clone();
    tokio::spawn(async move {
        while let Ok((c, _)) = l.accept().await {
            let n = h.opened.fetch_add(1, Relaxed);
            if h.new.load(Relaxed) {
                h.held.lock().insert(n);
            }
            let Ok(s) = tokio::net::TcpStream::connect(to).await else { continue };
            let (mut cr, mut cw) = c.into_split();
            let (mut sr, mut sw) = s.into_split();
            let hc = h.clone();
            tokio::spawn(async move {
                // Cut, the host's end closes (its write half goes with this task).
                tokio::select! {
                    _ = tokio::io::copy(&mut sr, &mut cw) => {}
                    _ = hc.is_cut(n) => {}
                }
            });
            let h = h.clone();
            tokio::spawn(async move {
                let mut kept: Vec<u8> = Vec::new();
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let got = cr.read(&mut buf).await.unwrap_or(0);
                    kept.extend_from_slice(&buf[..got]);
                    while h.holds(n) {
                        let released = h.released.notified();
                        if !h.holds(n) {
                            break;
                        }
                        released.await;
                    }
                    if sw.write_all(&kept).await.is_err() {
                        return;
                    }
                    kept.clear();
                    if got == 0 {
                        let _ = sw.shutdown().await;
                        return;
                    }
                }
            });
        }
    });
    (addr, held)
}

/// A controller of the peer's subsystem for `host`, without the device.
async fn controller(addr: SocketAddr, host: &str) -> nearstore_initiator::Controller {
    let mut o = nearstore_initiator::ConnectOptions::new(addr, PEER_NQN);
    o.hostnqn = host.into();
    o.hostid = *uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, host.as_bytes()).as_bytes();
    o.timeout = Duration::from_secs(5);
    nearstore_initiator::Controller::connect(o).await.unwrap()
}

fn status_of(r: nearstore_initiator::Result<()>) -> Option<Status> {
    match r {
        Err(nearstore_initiator::Error::Status { status, .. }) => Some(status),
        _ => None,
    }
}

/// Cross-Controller Reset (admin 38h): a host resets a controller instance of its own,
/// named by CNTLID, CIU and CIRN, from another controller; its own controller, another
/// host's, and a CIRN that names no instance are not reset.
#[tokio::test]
async fn a_cross_controller_reset_ends_only_the_named_instance_of_the_same_host() {
    let p = peer().await;
    let a = controller(p.addr, MEMBER).await;
    let mut aq = a.io_queue(1).await.unwrap();
    let b = controller(p.addr, MEMBER).await;
    let stranger = controller(p.addr, HOST).await;
    let wait = Duration::from_secs(5);
    let (ia, ib) = (a.instance(), b.instance());
    assert_ne!(ia.cirn, ib.cirn, "each instance draws its own random number");
    assert_ne!((ia.cntlid, ia.ciu), (ib.cntlid, ib.ciu));

    let invalid = Some(Status::INVALID_FIELD.dnr());
    assert_eq!(status_of(b.cross_controller_reset(ib, wait).await), invalid, "a controller does not reset itself");
    assert_eq!(status_of(stranger.cross_controller_reset(ia, wait).await), invalid, "another host's controller is not reset");
    let other = nearstore_initiator::Instance { cirn: ia.cirn ^ 1, ..ia };
    b.cross_controller_reset(other, wait).await.expect("an instance that is not there has nothing running");
    aq.write(1, 0, &[7u8; 512], 512, false).await.expect("A was not reset by any of those");

    b.cross_controller_reset(ia, wait).await.unwrap();
    assert!(aq.write(1, 0, &[8u8; 512], 512, false).await.is_err(), "A's queues are closed");
    b.cross_controller_reset(ia, wait).await.expect("gone, nothing of it runs");
    let mut bq = b.io_queue(1).await.unwrap();
    assert_eq!(bq.read(1, 0, 1, 512).await.unwrap(), vec![7u8; 512]);
}

/// A write given up by its host (timed out) can still land later, when the network
/// delivers it: a controller closed with writes in flight is reset at the peer, and once
/// the pool says they are quiesced nothing of them lands. Without the reset (the raw
/// initiator's controller, dropped), the late write lands: the negative control.
#[tokio::test]
async fn a_write_given_up_is_quiesced_at_the_peer_before_anything_relies_on_it() {
    let p = peer().await;
    let (via, held) = held_proxy(p.addr).await;
    let mut direct = b_queue(p.addr).await;

    // The negative control: a write held in the network, its connection dropped by its
    // host after a second, arrives once released.
    {
        let c = controller(via, MEMBER).await;
        let mut q = c.io_queue(1).await.unwrap();
        q.write(1, 8, &[1u8; 512], 512, false).await.unwrap();
        held.hold_last(1);
        let late = tokio::time::timeout(Duration::from_secs(1), q.write(1, 8, &[2u8; 512], 512, false)).await;
        assert!(late.is_err(), "held in the network, the write does not complete");
        // Its queue closed by the host; its controller stays (as a host's other queues
        // would), so the peer ends the queue only when the network delivers its end.
        drop(q);
        assert_eq!(direct.read(1, 8, 1, 512).await.unwrap(), vec![1u8; 512]);
        held.release();
        let landed = async {
            while direct.read(1, 8, 1, 512).await.unwrap() != vec![2u8; 512] {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), landed).await.expect("the write given up lands late");
        drop(c);
    }

    // The device: the same write, timed out, puts its controller in doubt; the pool resets
    // it at the peer over a new connection, and only then is the write completed (with
    // its error): a later write of its host cannot be overtaken by it.
    let pool = Arc::new(Pool::new(4));
    let dev = Arc::new(Remote::open(config(via, 1, MEMBER, MEMBER, Duration::from_secs(1)), pool.clone()).await.unwrap());
    assert!(run(&dev, Op::Write { off: 0, fua: false }, filled(4096, 1)).await.result.is_ok());
    // Both of the device's connections (its controller's admin and I/O queues) are cut
    // off: the peer sees neither close. New connections are held too, for now.
    held.hold_last(2);
    let first_new = held.hold_new();
    let write = tokio::spawn({
        let dev = dev.clone();
        async move { run(&dev, Op::Write { off: 0, fua: false }, filled(4096, 2)).await }
    });
    in_doubt_within(&pool, Duration::from_secs(5)).await.expect("the write given up is in doubt");
    let quiesced = dev.quiesce(0, 4096).expect("a peer's device quiesces");
    let quiesced = tokio::spawn(quiesced);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!write.is_finished(), "the write's error waits for its controller's reset");
    assert!(!quiesced.is_finished(), "not quiesced while the reset cannot reach the peer");
    assert_eq!(pool.in_doubt(), 1);
    // The network lets new connections through: the reset reaches the peer.
    held.release_from(first_new);
    let c = tokio::time::timeout(Duration::from_secs(15), write).await.expect("completed after the reset").unwrap();
    assert_eq!(c.result.unwrap_err().kind(), io::ErrorKind::TimedOut);
    assert_eq!(pool.in_doubt(), 0, "its controller was reset before its error was completed");
    tokio::time::timeout(Duration::from_secs(5), quiesced).await.expect("quiesced").unwrap().unwrap();
    let before = direct.read(1, 0, 8, 512).await.unwrap();
    assert_eq!(before, filled(4096, 1).to_vec(), "the held write has not reached the peer");
    // Released, the network delivers the write to a controller that is gone.
    held.release();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(direct.read(1, 0, 8, 512).await.unwrap(), before, "nothing lands after the reset");
    // The device goes on, on new connections.
    assert!(run(&dev, Op::Write { off: 0, fua: false }, filled(4096, 3)).await.result.is_ok());
    assert_eq!(direct.read(1, 0, 8, 512).await.unwrap(), filled(4096, 3).to_vec());
    // A read given up changes nothing: no doubt.
    held.hold_last(2);
    let c = run(&dev, Op::Read { off: 0 }, buf(4096)).await;
    assert_eq!(c.result.unwrap_err().kind(), io::ErrorKind::TimedOut);
    assert_eq!(pool.in_doubt(), 0, "a read given up is not in doubt");
    held.release();
}

/// A restarted member (a new incarnation: the same host NQN and Host Identifier family, a
/// new Host Identifier) fences a peer before its first controller there: every controller
/// its earlier incarnation left is reset, so a write of it still held in the network lands
/// nowhere, and what the new incarnation writes stays. The member's controllers of this
/// incarnation and a tool's (the same NQN, another family) are not reset. Without the
/// fence the held write lands: the negative control of the test above.
#[tokio::test]
async fn a_restarted_member_fences_its_earlier_incarnation_before_writing() {
    let p = peer().await;
    let (via, held) = held_proxy(p.addr).await;
    let mut direct = b_queue(p.addr).await;
    let connect = |addr: SocketAddr, hostid: [u8; 16]| {
        let mut o = nearstore_initiator::ConnectOptions::new(addr, PEER_NQN);
        o.hostnqn = MEMBER.into();
        o.hostid = hostid;
        o.timeout = Duration::from_secs(5);
        nearstore_initiator::Controller::connect(o)
    };
    // Tests before this one may have fenced at a peer on this port.
    nearstore_target::cluster::forget_fences();
    let ours = nearstore_target::cluster::member_hostid(MEMBER);
    let mut earlier = ours;
    earlier[8..].copy_from_slice(&(nearstore_target::cluster::incarnation() ^ 1).to_le_bytes());
    // The earlier incarnation: a write done, then one held in the network when it died
    // (neither its write nor its connections' end reach the peer).
    let old = connect(via, earlier).await.unwrap();
    let mut oq = old.io_queue(1).await.unwrap();
    oq.write(1, 16, &[1u8; 512], 512, false).await.unwrap();
    held.hold_last(1);
    let late = tokio::time::timeout(Duration::from_secs(1), oq.write(1, 16, &[2u8; 512], 512, false)).await;
    assert!(late.is_err(), "held in the network, the write does not complete");
    let tool = controller(p.addr, MEMBER).await;
    let mut tq = tool.io_queue(1).await.unwrap();
    // A controller of this incarnation, there before the fence.
    let new = connect(p.addr, ours).await.unwrap();
    let mut nq = new.io_queue(1).await.unwrap();

    let fence = nearstore_target::cluster::fenced(p.addr, PEER_NQN, MEMBER, MEMBER, Duration::from_secs(5)).await;
    assert_eq!(fence.expect("fenced"), nearstore_target::cluster::Fence::Done);
    nq.write(1, 16, &[3u8; 512], 512, false).await.expect("this incarnation's controller stays");
    // Released, the network delivers the old write to a controller that is gone.
    held.release();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(direct.read(1, 16, 1, 512).await.unwrap(), vec![3u8; 512], "nothing of the earlier incarnation lands");
    assert!(oq.write(1, 17, &[4u8; 512], 512, false).await.is_err(), "its queues are closed");
    tq.write(1, 18, &[5u8; 512], 512, false).await.expect("another family's controller stays");
    // The command again from this incarnation, with nothing earlier left: at once, and its
    // own controllers stay.
    new.fence_host_instances(Duration::from_secs(5)).await.expect("nothing to wait for");
    nq.write(1, 19, &[6u8; 512], 512, false).await.expect("still");
    // A subsystem that is not there: none of this member's controllers are there.
    let absent = nearstore_target::cluster::fenced(p.addr, "nqn.2026-11.io.nearstore:none", MEMBER, MEMBER, Duration::from_secs(5)).await;
    assert_eq!(absent.expect("nothing there"), nearstore_target::cluster::Fence::Absent);
}

/// A write given up whose controller no reset can reach (every new connection to the
/// peer held) stays in doubt until the peer's own keep-alive rules have ended that
/// controller: its keep-alive timeout twice, then a reset's wait. Only then is the pool
/// quiesced, and the late write, delivered after, lands nowhere: the peer tore the
/// controller down when its keep-alives stopped.
#[tokio::test]
async fn a_doubt_no_reset_reaches_ends_at_the_peers_keep_alive_bound() {
    let p = peer().await;
    let (via, held) = held_proxy(p.addr).await;
    let mut direct = b_queue(p.addr).await;
    let pool = Arc::new(Pool::new(4));
    let (kato, timeout) = (Duration::from_secs(2), Duration::from_secs(1));
    let cfg = RemoteConfig { kato: Some(kato), ..config(via, 1, MEMBER, MEMBER, timeout) };
    let dev = Arc::new(Remote::open(cfg, pool.clone()).await.unwrap());
    assert!(run(&dev, Op::Write { off: 0, fua: false }, filled(4096, 1)).await.result.is_ok());
    held.hold_last(2);
    held.hold_new();
    let given_up = std::time::Instant::now();
    let write = tokio::spawn({
        let dev = dev.clone();
        async move { run(&dev, Op::Write { off: 0, fua: false }, filled(4096, 2)).await }
    });
    in_doubt_within(&pool, Duration::from_secs(5)).await.expect("the write given up is in doubt");
    let quiesced = tokio::spawn(dev.quiesce(0, 4096).expect("a peer's device quiesces"));
    let bound = 2 * kato + Duration::from_millis(nearstore_target::limits::CROSS_CONTROLLER_RESET_WAIT_MS) + timeout;
    tokio::time::sleep(bound / 2).await;
    assert!(!quiesced.is_finished(), "quiesced {:?} after the write was given up, before its keep-alive bound", given_up.elapsed());
    assert_eq!(pool.in_doubt(), 1);
    tokio::time::timeout(Duration::from_secs(30), quiesced).await.expect("quiesced at the bound").unwrap().unwrap();
    assert!(given_up.elapsed() >= bound, "quiesced after {:?}, before the bound of {bound:?}", given_up.elapsed());
    assert_eq!(pool.in_doubt(), 0);
    let c = write.await.unwrap();
    assert!(c.result.is_err(), "the write given up fails");
    // Released now, the network delivers the write to a controller the peer has ended.
    assert_eq!(direct.read(1, 0, 8, 512).await.unwrap(), filled(4096, 1).to_vec(), "the held write has not reached the peer");
    held.release();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(direct.read(1, 0, 8, 512).await.unwrap(), filled(4096, 1).to_vec(), "nothing lands after the bound");
}

/// A pooled connection found lost with a write in flight: the write is tried again on a
/// new connection only once the old one's controller is reset at the peer; else the old
/// write, delivered late, would land over what the host wrote after the retry completed.
#[tokio::test]
async fn a_write_tried_again_after_a_lost_connection_waits_for_the_old_ones_reset() {
    let p = peer().await;
    let (via, held) = held_proxy(p.addr).await;
    let mut direct = b_queue(p.addr).await;
    let pool = Arc::new(Pool::new(4));
    let dev = Arc::new(Remote::open(config(via, 1, MEMBER, MEMBER, Duration::from_secs(5)), pool.clone()).await.unwrap());
    assert!(run(&dev, Op::Write { off: 8192, fua: false }, filled(4096, 1)).await.result.is_ok());
    // The pooled connection's admin and I/O queues: held, then cut on the device's side.
    held.hold_last(2);
    let write = tokio::spawn({
        let dev = dev.clone();
        async move { run(&dev, Op::Write { off: 8192, fua: false }, filled(4096, 2)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    // New connections are held too for now: the reset cannot reach the peer yet.
    let first_new = held.hold_new();
    held.cut_held();
    in_doubt_within(&pool, Duration::from_secs(5)).await.expect("the lost write is in doubt before it is tried again");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!write.is_finished(), "not tried again before the old controller's reset");
    held.release_from(first_new);
    let c = tokio::time::timeout(Duration::from_secs(15), write).await.expect("tried again").unwrap();
    c.result.expect("the write tried again on a new connection succeeds");
    assert_eq!(pool.in_doubt(), 0);
    // The host goes on: a later write of the same blocks, then the network delivers the
    // first attempt to a controller that is gone.
    assert!(run(&dev, Op::Write { off: 8192, fua: false }, filled(4096, 3)).await.result.is_ok());
    held.release();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(direct.read(1, 16, 8, 512).await.unwrap(), filled(4096, 3).to_vec(), "the first attempt did not land late");
}

/// Waits until `pool` has a controller in doubt, at most `within`.
async fn in_doubt_within(pool: &Pool, within: Duration) -> Result<(), tokio::time::error::Elapsed> {
    let doubted = async {
        while pool.in_doubt() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(within, doubted).await
}

/// An I/O queue of the peer's namespace 1, straight to it, for the checks.
async fn b_queue(addr: SocketAddr) -> nearstore_initiator::IoQueue {
    let c = controller(addr, HOST).await;
    let q = c.io_queue(1).await.unwrap();
    // The controller lives as long as the queue needs it: leaked for the test's length.
    std::mem::forget(c);
    q
}
