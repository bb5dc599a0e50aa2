//! One host against the others: it cannot lock them out with controllers or half-open
//! connections, run the target out of descriptors, or stall them with long work.
//!
//! The target runs on its own runtime with one network thread, so that anything that
//! holds a network thread stalls every other connection, as it would on a loaded target.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nearstore_initiator::{ConnectOptions, Controller, Data};
use nearstore_target::config::Config;
use nearstore_target::{limits, Target};
use nearstore_wire::opcode::io;
use nearstore_wire::pdu::{self, IcReq};
use nearstore_wire::Sqe;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

const NQN: &str = common::NQN;
const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-00000000000a";
const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-00000000000b";

/// A target with a 64 MiB memory namespace on a runtime of its own (one network thread),
/// configured with `extra` TOML (sections after the listener).
struct Isolated {
    target: Arc<Target>,
    addr: SocketAddr,
    _rt: tokio::runtime::Runtime,
}

fn isolated(extra: &str) -> Isolated {
    common::init_logs();
    let cfg = format!(
        r#"
        io_threads = 2
        [[listener]]
        address = "127.0.0.1:0"
        [[subsystem]]
        nqn = "{NQN}"
        allow_any_host = true
        [[subsystem.namespace]]
        nsid = 1
        memory = "64MiB"
        {extra}
        "#
    );
    let cfg = Config::from_toml(&cfg).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let (target, addr) = rt.block_on(async {
        let t = Target::from_config(&cfg).unwrap();
        let a = t.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
        (t, a)
    });
    Isolated { target, addr, _rt: rt }
}

impl Isolated {
    fn opts(&self, host: &str) -> ConnectOptions {
        let mut o = ConnectOptions::new(self.addr, NQN);
        o.hostnqn = host.into();
        o.timeout = Duration::from_secs(10);
        o
    }
}

fn client_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// A raw connection from `from` (a loopback address) that has sent `sent`.
async fn raw(to: SocketAddr, from: [u8; 4], sent: &[u8]) -> TcpStream {
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind(SocketAddr::from((from, 0))).unwrap();
    let mut s = sock.connect(to).await.unwrap();
    s.write_all(sent).await.unwrap();
    s
}

fn icreq() -> Vec<u8> {
    let mut b = Vec::new();
    IcReq { pfv: 0, hpda: 0, hdgst: false, ddgst: false, maxr2t: 0 }.encode(&mut b);
    b
}

/// Reads until the target closes the connection; returns how long that took. Fails if it
/// stays open for `within`.
async fn closed_within(s: &mut TcpStream, within: Duration) -> Duration {
    let start = Instant::now();
    let mut buf = [0u8; 256];
    loop {
        match tokio::time::timeout_at((start + within).into(), s.read(&mut buf)).await {
            Err(_) => panic!("connection still open after {within:?}"),
            Ok(Ok(0)) | Ok(Err(_)) => return start.elapsed(),
            Ok(Ok(_)) => {}
        }
    }
}

/// True while the target has not closed the connection (nothing to read, no EOF).
async fn still_open(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 256];
    loop {
        match tokio::time::timeout(Duration::from_millis(50), s.read(&mut buf)).await {
            Err(_) => return true,
            Ok(Ok(0)) | Ok(Err(_)) => return false,
            Ok(Ok(_)) => {}
        }
    }
}

/// Taken for the whole of every test that keeps compute threads busy and every test that
/// bounds a latency: libtest runs two tests at once, and on two cores another test's
/// endless commands could hold the CPU the measured network thread needs. Each measures
/// against its own load only.
static LOAD: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn alone() -> std::sync::MutexGuard<'static, ()> {
    // A failed test poisons the lock; the others still run.
    LOAD.lock().unwrap_or_else(|e| e.into_inner())
}

fn wait_until(what: &str, within: Duration, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < within, "{what}: not reached in {within:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// One host opening controllers until refused gets `controllers_per_host` of them; another
/// host still connects and does I/O. Before the limit, 1023 controllers of one host left
/// others with CONNECT_CTRL_BUSY.
#[test]
fn one_host_cannot_lock_another_out_with_controllers() {
    let t = isolated("[limits]\ncontrollers_per_host = 4");
    client_rt().block_on(async {
        let mut held = Vec::new();
        let refused = loop {
            match Controller::connect(t.opts(HOST_A)).await {
                Ok(c) => held.push(c),
                Err(e) => break e,
            }
            assert!(held.len() <= 4, "host A got more than 4 controllers");
        };
        assert_eq!(held.len(), 4, "host A got fewer controllers than its limit: {refused}");
        assert!(refused.to_string().contains("Connect"), "{refused}");
        assert_eq!(t.target.stats.controllers_refused.load(Relaxed), 1);
        let b = Controller::connect(t.opts(HOST_B)).await.unwrap();
        let mut q = b.io_queue(1).await.unwrap();
        q.write(1, 0, &[5u8; 512], 512, false).await.unwrap();
        assert_eq!(q.read(1, 0, 1, 512).await.unwrap(), vec![5u8; 512]);
        // Host A's controllers are its own: closing one gives it room for another, once the
        // target has seen its admin queue close (after the shutdown, asynchronously).
        held.pop().unwrap().shutdown().await.unwrap();
        let start = Instant::now();
        let _again = loop {
            match Controller::connect(t.opts(HOST_A)).await {
                Ok(c) => break c,
                Err(e) if start.elapsed() < Duration::from_secs(5) && e.to_string().contains("CONNECT_CONTROLLER_BUSY") => {
                    tokio::time::sleep(Duration::from_millis(10)).await
                }
                Err(e) => panic!("host A got no controller back after closing one: {e}"),
            }
        };
    });
}

/// Connections that stop before their Connect are closed after connect_timeout_ms, at
/// whichever step they stopped; a host that Connected stays. The timeout (1 s) also holds
/// for the host's own queues, which must Connect within it.
#[test]
fn connections_that_do_not_connect_are_closed_after_the_timeout() {
    let t = isolated("[limits]\nconnect_timeout_ms = 1000");
    client_rt().block_on(async {
        let mut half_capsule = icreq();
        half_capsule.extend_from_slice(&[pdu::PduType::CapsuleCmd as u8, 0, 72, 0]);
        let cases: [(&str, Vec<u8>); 3] = [("nothing", vec![]), ("ICReq only", icreq()), ("ICReq and half a capsule", half_capsule)];
        let host = Controller::connect(t.opts(HOST_B)).await.unwrap();
        let mut socks = Vec::new();
        for (what, sent) in &cases {
            socks.push((what, Instant::now(), raw(t.addr, [127, 0, 0, 1], sent).await));
        }
        for (what, opened, s) in &mut socks {
            closed_within(s, Duration::from_secs(10)).await;
            let took = opened.elapsed();
            assert!(took >= Duration::from_millis(900), "{what}: closed after {took:?}, before the timeout");
        }
        assert_eq!(t.target.stats.connect_timeouts.load(Relaxed), cases.len() as u64);
        // The Connected host is past the timeout and still served.
        tokio::time::sleep(Duration::from_millis(400)).await;
        let mut q = host.io_queue(1).await.unwrap();
        q.read(1, 0, 8, 512).await.unwrap();
    });
}

/// The total cap holds: when it is reached, the oldest connection that has not Connected
/// makes room; when every connection has Connected, a new one is refused. One address
/// cannot hold more than connections_per_address that have not Connected, and others
/// still get in.
#[test]
fn the_connection_cap_holds() {
    let t = isolated("[limits]\nconnections = 6\nconnections_per_address = 3");
    let adm = t.target.admission.clone();
    client_rt().block_on(async {
        // An attacker at 127.0.0.2 holds its 3 half-open connections; a 4th is refused.
        let mut attacker = Vec::new();
        for _ in 0..3 {
            attacker.push(raw(t.addr, [127, 0, 0, 2], &icreq()).await);
        }
        let mut fourth = raw(t.addr, [127, 0, 0, 2], &icreq()).await;
        closed_within(&mut fourth, Duration::from_secs(2)).await;
        assert_eq!(t.target.stats.connections_refused.load(Relaxed), 1);
        for s in &mut attacker {
            assert!(still_open(s).await, "the attacker's first three stay");
        }
        // Other hosts still connect: 3 controllers (one connection each) fill the cap of 6.
        let mut hosts = Vec::new();
        for _ in 0..3 {
            hosts.push(Controller::connect(t.opts(HOST_B)).await.unwrap());
        }
        assert_eq!(adm.open(), 6);
        // A 7th connection evicts the oldest half-open one, not a host.
        let _newcomer = raw(t.addr, [127, 0, 0, 3], &icreq()).await;
        closed_within(&mut attacker[0], Duration::from_secs(2)).await;
        assert!(still_open(&mut attacker[1]).await);
        assert_eq!(t.target.stats.connections_evicted.load(Relaxed), 1);
        // Fill the cap with Connected hosts only: then a newcomer is refused and no host is
        // evicted.
        drop(attacker);
        drop(_newcomer);
        wait_until("the half-open connections are gone", Duration::from_secs(5), || adm.open() == 3);
        for _ in 0..3 {
            hosts.push(Controller::connect(t.opts(HOST_A)).await.unwrap());
        }
        let mut late = raw(t.addr, [127, 0, 0, 3], &icreq()).await;
        closed_within(&mut late, Duration::from_secs(2)).await;
        assert_eq!(t.target.stats.connections_refused.load(Relaxed), 2);
        for h in &hosts {
            h.get_feature(0x07).await.unwrap();
        }
        assert_eq!(adm.open(), 6);
    });
}

/// At start-up the descriptor limit is raised to its hard limit and reported (metric), and
/// the default connection cap is what it allows.
#[test]
fn descriptor_limit_is_raised_and_reported() {
    let t = isolated("");
    let limits_text = std::fs::read_to_string("/proc/self/limits").unwrap();
    let line = limits_text.lines().find(|l| l.starts_with("Max open files")).unwrap();
    let v: Vec<&str> = line.split_whitespace().collect();
    let (soft, hard) = (v[3], v[4]);
    assert_eq!(soft, hard, "soft limit not raised: {line}");
    let hard: u64 = hard.parse().unwrap_or(u64::MAX);
    assert_eq!(t.target.nofile, hard);
    assert_eq!(t.target.admission.cap(), limits::connections_max(hard));
    let text = nearstore_target::metrics::render(&t.target);
    assert!(text.contains(&format!("nearstore_descriptor_limit {hard}\n")), "{text}");
    assert!(text.contains(&format!("nearstore_connections_max {}\n", limits::connections_max(hard))), "{text}");
    // A cap the descriptors cannot carry is refused, naming the key.
    let cfg = Config::from_toml(&format!(
        "[[listener]]\naddress = \"127.0.0.1:0\"\n[limits]\nconnections = {}",
        limits::connections_max(hard) + 1
    ))
    .unwrap();
    let e = Target::from_config(&cfg).err().expect("over the descriptor limit").to_string();
    assert!(e.contains("limits.connections"), "{e}");
}

/// Dataset Management of 256 ranges, each the whole namespace, over a memory namespace
/// runs off the network thread: another host's 4 KiB reads keep completing while it runs.
/// Inline, each such command held the network thread, and every host on it, for a second
/// or more.
#[test]
fn dataset_management_does_not_stall_other_hosts() {
    let _alone = alone();
    let t = isolated("");
    let blocks = (64u64 << 20) / 512;
    let mut dsm = Vec::new();
    for _ in 0..256 {
        dsm.extend_from_slice(&0u32.to_le_bytes());
        dsm.extend_from_slice(&(blocks as u32).to_le_bytes());
        dsm.extend_from_slice(&0u64.to_le_bytes());
    }
    let sqe = *Sqe::new(io::DATASET_MANAGEMENT, 1).set_nsid(1).set_cdw(10, 255).set_cdw(11, 1 << 2);
    // Enough of them to take seconds on a fast, quiet machine too (4 took 1.05 s there).
    let n = 12;
    let t = &t;
    client_rt().block_on(async move {
        let attacker = Controller::connect(t.opts(HOST_A)).await.unwrap();
        let mut aq = attacker.io_queue(1).await.unwrap();
        let victim = Controller::connect(t.opts(HOST_B)).await.unwrap();
        let mut vq = victim.io_queue(1).await.unwrap();
        vq.read(1, 0, 8, 512).await.unwrap();
        let start = Instant::now();
        let attack = tokio::spawn(async move {
            let q = aq.queue();
            for i in 0..n {
                q.submit(sqe, Data::Out(&dsm), i).unwrap();
            }
            q.flush().await.unwrap();
            let mut done = 0;
            while done < n as usize {
                done += q.poll(|_, cqe, _| assert!(cqe.status.is_success(), "{}", cqe.status)).await.unwrap();
            }
            start.elapsed()
        });
        let mut worst = Duration::ZERO;
        let mut reads = 0;
        while !attack.is_finished() {
            let t0 = Instant::now();
            vq.read(1, (reads % 1000) * 8, 8, 512).await.unwrap();
            worst = worst.max(t0.elapsed());
            reads += 1;
        }
        let took = attack.await.unwrap();
        eprintln!("{n} deallocations took {took:?}; {reads} reads meanwhile, the slowest {worst:?}");
        assert!(took > Duration::from_millis(1500), "the deallocations took only {took:?}, too short to tell");
        assert!(worst < Duration::from_millis(500), "a 4 KiB read waited {worst:?}");
        assert!(reads > 10, "only {reads} reads in {took:?}");
    });
}

/// An attacker keeps the compute engine busy with many endless commands (over a terabyte
/// of zeros); a victim's 4 KiB checksum still completes within a bound, since commands
/// take turns across controllers. When the attacker's connection closes (its controller
/// stays), its queued commands are dropped and its running ones stop. Before, the victim
/// waited behind every command ahead of it, and they ran on after the attacker had gone.
#[test]
fn compute_is_shared_fairly_and_stops_with_its_connection() {
    let _alone = alone();
    use nearstore_compute::by_name;
    use nearstore_wire::compute::{opcode as cop, Descriptor, Extent, Object};
    let t = isolated("[compute]\nthreads = 2\ntimeout_secs = 600");
    let endless = |op: &str, args: &[u8]| {
        Descriptor {
            op: by_name(op).unwrap().id,
            args: args.to_vec(),
            inputs: vec![Object { len: 1 << 40, extents: vec![Extent::zeros(1 << 40)] }],
            outputs: vec![],
        }
        .encode()
    };
    let cases: [(&str, Vec<u8>); 2] = [("crc32c", endless("crc32c", b"")), ("grep-count", endless("grep-count", br#"{"pattern":"x+y"}"#))];
    let stats = t.target.offload.stats.clone();
    let t = &t;
    client_rt().block_on(async move {
        let victim = Controller::connect(t.opts(HOST_B)).await.unwrap();
        let mut vq = victim.io_queue(1).await.unwrap();
        vq.write(1, 0, &[7u8; 4096], 512, false).await.unwrap();
        let small = Descriptor {
            op: by_name("crc32c").unwrap().id,
            args: vec![],
            inputs: vec![Object { len: 4096, extents: vec![Extent::data(0, 4096)] }],
            outputs: vec![],
        }
        .encode();
        for (what, d) in &cases {
            let attacker = Controller::connect(t.opts(HOST_A)).await.unwrap();
            let mut aq = attacker.io_queue(1).await.unwrap();
            let n = 16;
            for i in 0..n {
                let mut s = Sqe::new(cop::EXEC, 0);
                s.set_nsid(1);
                aq.queue().submit(s, Data::Out(d), i).unwrap();
            }
            aq.queue().flush().await.unwrap();
            wait_until(what, Duration::from_secs(5), || stats.running.load(Relaxed) + stats.queued.load(Relaxed) == n);
            assert_eq!(stats.running.load(Relaxed), limits::COMPUTE_STARTED_PER_CONTROLLER_MAX as u64, "{what}");
            for _ in 0..3 {
                let t0 = Instant::now();
                vq.compute(1, &small, Duration::from_secs(30)).await.unwrap();
                let took = t0.elapsed();
                assert!(took < Duration::from_secs(2), "{what}: the victim's 4 KiB checksum took {took:?}");
            }
            // The attacker's I/O queue closes; its controller (admin queue) stays.
            drop(aq);
            let t0 = Instant::now();
            wait_until(what, Duration::from_secs(10), || stats.running.load(Relaxed) == 0 && stats.queued.load(Relaxed) == 0);
            eprintln!("{what}: the attacker's commands stopped {:?} after its connection closed", t0.elapsed());
            attacker.shutdown().await.unwrap();
        }
    });
}

/// The memory budget holds in total: held results across controllers and started compute
/// commands (each reserving its whole bound) stay under `limits.memory`; past it results
/// are refused with RESULTS_FULL and commands wait in the queue. Before, each controller
/// could hold 128 results (here 4 x 128 x 60 KiB) and every command ran at once. The
/// budget is 12 MiB for the work besides what five controllers' connections always hold
/// (an admin and an I/O queue each), and five are connected whenever work is measured.
#[test]
fn the_memory_budget_holds_across_controllers_and_commands() {
    let _alone = alone();
    use nearstore_compute::by_name;
    use nearstore_wire::compute::{opcode as cop, status as cs, Descriptor, Extent, Object};
    let (admin_q, io_q) = (limits::connection_memory_fixed(32) as u64, limits::connection_memory_fixed(128) as u64);
    let work: u64 = 12 << 20;
    let budget = work + 5 * (admin_q + io_q);
    let t = isolated(&format!("[limits]\nmemory = {budget}\n[compute]\nthreads = 2\nmemory_per_command = \"4MiB\"\ntimeout_secs = 600"));
    let memory = t.target.memory.clone();
    let stats = t.target.offload.stats.clone();
    let t = &t;
    let exec = || *Sqe::new(cop::EXEC, 0).set_nsid(1);
    client_rt().block_on(async move {
        // Results of about 60 KiB: 10,000 offsets of "a" in 20 KiB of "a".
        let c = Controller::connect(t.opts(HOST_B)).await.unwrap();
        let mut q = c.io_queue(1).await.unwrap();
        q.write(1, 0, &[b'a'; 20480], 512, false).await.unwrap();
        let big = Descriptor {
            op: by_name("search").unwrap().id,
            args: br#"{"pattern":"a","max_offsets":10000}"#.to_vec(),
            inputs: vec![Object { len: 20480, extents: vec![Extent::data(0, 20480)] }],
            outputs: vec![],
        }
        .encode();
        let mut held_bytes = 0u64;
        let mut per_ctrl = Vec::new();
        // All connected before any result is held, so that each connection finds room.
        let mut ctrls = Vec::new();
        for _ in 0..4 {
            let c = Controller::connect(t.opts(HOST_A)).await.unwrap();
            let q = c.io_queue(1).await.unwrap();
            ctrls.push((c, q));
        }
        for (_, q) in &mut ctrls {
            let mut n = 0;
            loop {
                let qp = q.queue();
                let cid = qp.submit(exec(), Data::Out(&big), 0).unwrap();
                let cqe = qp.wait(cid, |_, _, _| {}).await.unwrap();
                if cqe.status == cs::RESULTS_FULL {
                    break;
                }
                assert!(cqe.status.is_success(), "{}", cqe.status);
                held_bytes += cqe.dw1 as u64;
                n += 1;
                assert!(n <= limits::RESULTS_HELD_MAX);
            }
            per_ctrl.push(n);
        }
        eprintln!("results held per controller {per_ctrl:?}: {held_bytes} bytes; budget peak {}", memory.peak());
        assert!(held_bytes <= work, "results held: {held_bytes} bytes over the budget");
        assert!(per_ctrl.iter().sum::<usize>() < 4 * limits::RESULTS_HELD_MAX, "the budget never refused a result");
        assert!(memory.peak() <= budget);
        // Closing the controllers gives their results and connections back.
        drop(ctrls);
        wait_until("results freed", Duration::from_secs(5), || memory.used() == admin_q + io_q);
        // Three idle controllers take the closed ones' place in the budget.
        let mut idle = Vec::new();
        for _ in 0..3 {
            let c = Controller::connect(t.opts(HOST_B)).await.unwrap();
            let q = c.io_queue(1).await.unwrap();
            idle.push((c, q));
        }
        // 16 endless commands: only what the budget holds starts, the rest waits.
        let endless = Descriptor {
            op: by_name("crc32c").unwrap().id,
            args: vec![],
            inputs: vec![Object { len: 1 << 40, extents: vec![Extent::zeros(1 << 40)] }],
            outputs: vec![],
        }
        .encode();
        let a = Controller::connect(t.opts(HOST_A)).await.unwrap();
        let mut aq = a.io_queue(1).await.unwrap();
        // A refused command counts as an error of the namespace.
        let ns = t.target.subsystem(NQN).unwrap().namespace(1).unwrap();
        let errors = &ns.stats.errors;
        let errors_before = errors.load(Relaxed);
        let n = 16;
        for i in 0..n {
            aq.queue().submit(exec(), Data::Out(&endless), i).unwrap();
        }
        aq.queue().flush().await.unwrap();
        // Those the budget cannot hold a result for are refused (RESULTS_FULL); of the
        // rest, only as many start as the budget holds, the others wait. Every command
        // is in one of these before the bound is checked.
        wait_until("every command started, queued or refused", Duration::from_secs(5), || {
            stats.running.load(Relaxed) + stats.queued.load(Relaxed) + errors.load(Relaxed) - errors_before == n
        });
        let running = stats.running.load(Relaxed);
        assert!(running >= 1, "no command started");
        assert!(running * (4 << 20) <= work, "{running} commands of 4 MiB started in a {work}-byte budget for work");
        assert!(memory.peak() <= budget);
        // The commands of a closed connection give their memory back.
        drop(aq);
        wait_until("commands stopped", Duration::from_secs(5), || stats.running.load(Relaxed) + stats.queued.load(Relaxed) == 0);
        wait_until("memory given back", Duration::from_secs(5), || memory.used() == 5 * admin_q + 4 * io_q);
        let _ = &mut q;
    });
}

/// An attacker at 127.0.0.2 Connects queues that then do nothing, claiming a new host NQN
/// each time on the open subsystem, or on the discovery subsystem (no allow-list at all),
/// until refused: it gets `queues_per_address` of them, the next Connect is Connect
/// Controller Busy, and a legitimate host still Connects and does I/O in the memory budget
/// they leave. Closing them gives their place back. Before, every queue reserved its worst
/// case (25.5 MiB at 128 entries) and this budget held none of the attacker's queues, or
/// the attacker held all of it.
#[test]
fn idle_queues_of_one_address_do_not_lock_others_out() {
    use nearstore_initiator::{QueueOptions, QueuePair};
    use nearstore_wire::fabrics::ConnectData;
    use nearstore_wire::opcode::{fctype, FABRICS};
    use nearstore_wire::{Status, DISCOVERY_NQN};
    let per_address = 8;
    let command = 4u64 << 20;
    let fixed = |entries: usize| limits::connection_memory_fixed(entries) as u64;
    // One compute command and its result stay free; the attacker's queues at their largest,
    // a controller of the host, and 1 MiB.
    let budget = command + limits::RESULT_BYTES_MAX as u64 + per_address as u64 * fixed(256) + 2 * fixed(128) + (1 << 20);
    let t =
        isolated(&format!("[limits]\nmemory = {budget}\nqueues_per_address = {per_address}\n[compute]\nmemory_per_command = {command}"));
    let memory = t.target.memory.clone();
    let stats = &t.target.stats;
    let attacker_ip = std::net::IpAddr::from([127, 0, 0, 2]);
    // (what, subsystem, SQSIZE: the largest its admin queue takes)
    let cases = [("admin queues, a new host NQN each", NQN, 255u16), ("discovery queues", DISCOVERY_NQN, 31)];
    let t = &t;
    client_rt().block_on(async move {
        for (i, (what, subnqn, sqsize)) in cases.into_iter().enumerate() {
            let mut held = Vec::new();
            let refused = loop {
                let sock = TcpSocket::new_v4().unwrap();
                sock.bind(SocketAddr::new(attacker_ip, 0)).unwrap();
                let mut q = QueuePair::connect(sock.connect(t.addr).await.unwrap(), QueueOptions::default()).await.unwrap();
                let mut sqe = Sqe::new(FABRICS, 0);
                sqe.set_nsid(fctype::CONNECT as u32).set_cdw(11, sqsize as u32);
                let hostnqn = format!("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-{i:04}-{:012}", held.len());
                let d = ConnectData { hostid: [7; 16], cntlid: 0xffff, subnqn: subnqn.into(), hostnqn, acting_for: None }.encode();
                let cid = q.submit(sqe, Data::Out(&d), 0).unwrap();
                let cqe = q.wait(cid, |_, _, _| {}).await.unwrap();
                if !cqe.status.is_success() {
                    break cqe.status;
                }
                held.push(q);
                assert!(held.len() <= per_address, "{what}: more than {per_address} queues from one address");
            };
            assert_eq!(held.len(), per_address, "{what}: refused with {refused} before its limit");
            assert_eq!(refused, Status::CONNECT_CONTROLLER_BUSY, "{what}");
            assert_eq!(stats.connects_refused_address.load(Relaxed), i as u64 + 1, "{what}");
            assert_eq!(t.target.admission.queues(attacker_ip), per_address, "{what}");
            // The host: a controller, an I/O queue, a write and a read of 128 KiB.
            let c = Controller::connect(t.opts(HOST_B)).await.unwrap();
            let mut q = c.io_queue(1).await.unwrap();
            let data: Vec<u8> = (0..128 * 1024).map(|i| (i % 251) as u8).collect();
            q.write(1, 0, &data, 512, false).await.unwrap();
            assert_eq!(q.read(1, 0, 256, 512).await.unwrap(), data, "{what}");
            assert!(memory.peak() <= budget, "{what}");
            drop(q);
            c.shutdown().await.unwrap();
            // The attacker's queues give their place back when they close.
            drop(held);
            wait_until("the attacker's queues closed", Duration::from_secs(5), || t.target.admission.queues(attacker_ip) == 0);
        }
        wait_until("budget given back", Duration::from_secs(5), || memory.used() == 0);
    });
}

/// A queue whose data buffers outgrow the memory budget waits for them: host A's 64 reads
/// of 128 KiB from a slow namespace (each holds a buffer for 20 ms) find room for a few
/// buffers beyond the queue's own; the queue stops reading commands until buffers come
/// back, never fails one, and every read returns its data. Host B's 4 KiB reads of another
/// namespace meanwhile wait for nothing. The budget is never exceeded. Before, each queue
/// reserved its worst case at Connect, which this budget does not hold.
#[test]
fn a_queue_past_the_budget_waits_for_buffers_and_others_are_unaffected() {
    let _alone = alone();
    let command = 4u64 << 20;
    let fixed = |entries: usize| limits::connection_memory_fixed(entries) as u64;
    let extra = 4 * limits::TRANSFER_BYTES_MAX as u64;
    // One compute command and its result stay free; two controllers (an admin queue of 32
    // and an I/O queue of 128 entries each), and room for four buffers more.
    let budget = command + limits::RESULT_BYTES_MAX as u64 + 2 * (fixed(32) + fixed(128)) + extra;
    let t = isolated(&format!(
        "[limits]\nmemory = {budget}\n[compute]\nmemory_per_command = {command}\n\
         [[subsystem.namespace]]\nnsid = 2\nmemory = \"64MiB\"\ndelay_us = 20000"
    ));
    let memory = t.target.memory.clone();
    let t = &t;
    client_rt().block_on(async move {
        let a = Controller::connect(t.opts(HOST_A)).await.unwrap();
        let mut aq = a.io_queue(1).await.unwrap();
        let b = Controller::connect(t.opts(HOST_B)).await.unwrap();
        let mut bq = b.io_queue(1).await.unwrap();
        bq.write(1, 0, &[3u8; 4096], 512, false).await.unwrap();
        let n = 64u64;
        let block = |i: u64| -> Vec<u8> { (0..128 * 1024u64).map(|j| ((i * 7 + j) % 253) as u8).collect() };
        for i in 0..n {
            aq.write(2, i * 256, &block(i), 512, false).await.unwrap();
        }
        let waits = memory.waits();
        let reader = tokio::spawn(async move {
            let q = aq.queue();
            for i in 0..n {
                q.submit(Sqe::rw(io::READ, 2, i * 256, 256, false), Data::In(128 * 1024), i).unwrap();
            }
            q.flush().await.unwrap();
            let mut got = vec![None; n as usize];
            let mut done = 0;
            while done < n as usize {
                done += q
                    .poll(|tag, cqe, data| {
                        assert!(cqe.status.is_success(), "read {tag}: {}", cqe.status);
                        got[tag as usize] = Some(data.to_vec());
                    })
                    .await
                    .unwrap();
            }
            got
        });
        let (mut worst, mut reads) = (Duration::ZERO, 0);
        while !reader.is_finished() {
            let t0 = Instant::now();
            assert_eq!(bq.read(1, 0, 8, 512).await.unwrap(), [3u8; 4096]);
            worst = worst.max(t0.elapsed());
            reads += 1;
        }
        let got = reader.await.unwrap();
        for (i, d) in got.into_iter().enumerate() {
            assert!(d == Some(block(i as u64)), "read {i} returned other data");
        }
        let waited = memory.waits() - waits;
        eprintln!(
            "{n} reads waited for buffers {waited} times; host B: {reads} reads, the slowest {worst:?}; budget peak {} of {budget}",
            memory.peak()
        );
        assert!(waited > 0, "the queue never waited: the budget did not bind");
        assert!(memory.peak() <= budget, "peak {} over the budget {budget}", memory.peak());
        assert!(worst < Duration::from_millis(200), "host B's 4 KiB read waited {worst:?}");
        assert!(reads > 10, "only {reads} reads of host B");
    });
}

/// Send buffers grow charged to the budget: hosts that stop reading with 15 MiB of reads
/// outstanding fill their send buffers only as far as the budget lets them, everything a
/// connection holds is charged, and another queue of the same host still reads, and runs a
/// compute command in what connections leave free. Closing them gives it all back. Before,
/// 40 slow readers held 1.4 GiB with no total. The slow readers read a file namespace: large
/// reads of memory leave from the namespace's memory and grow no send buffer.
#[test]
fn send_buffers_grow_within_the_memory_budget() {
    use nearstore_compute::by_name;
    use nearstore_wire::compute::{Descriptor, Extent, Object};
    let command = 4u64 << 20;
    let fixed = |entries: usize| limits::connection_memory_fixed(entries) as u64;
    let slow: u16 = 3;
    // One compute command and its result stay free; the admin queue, the slow readers and
    // a working queue, and room for one send buffer to grow 1.5 MiB, not three.
    let grow = 3u64 << 19;
    let budget = command + limits::RESULT_BYTES_MAX as u64 + fixed(32) + (slow as u64 + 1) * fixed(128) + grow;
    let dir = tempfile::tempdir().unwrap();
    let file = format!("[[subsystem.namespace]]\nnsid = 2\npath = \"{}/slow.img\"\nsize = \"16MiB\"", dir.path().display());
    let t = isolated(&format!("[limits]\nmemory = {budget}\n[compute]\nthreads = 2\nmemory_per_command = {command}\n{file}"));
    let memory = t.target.memory.clone();
    let stats = &t.target.stats;
    let t = &t;
    client_rt().block_on(async move {
        // All connected first: grown send buffers may leave no room for a queue's Connect.
        let c = Controller::connect(t.opts(HOST_A)).await.unwrap();
        let mut readers = Vec::new();
        for qid in 1..=slow {
            readers.push(c.io_queue(qid).await.unwrap());
        }
        let mut worker = c.io_queue(slow + 1).await.unwrap();
        for q in &mut readers {
            for i in 0..120u64 {
                q.queue().submit(Sqe::rw(io::READ, 2, i * 256, 256, false), Data::In(128 * 1024), i).unwrap();
            }
            q.queue().flush().await.unwrap();
        }
        wait_until("send buffers filled", Duration::from_secs(5), || memory.used() + (1 << 20) >= budget - command);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (held, used) = (stats.buffer_bytes.load(Relaxed) as u64, memory.used());
        eprintln!("{slow} slow readers: buffers {held} bytes, charged {used} of a {budget}-byte budget");
        assert!(held <= used, "connections hold {held} bytes, more than the {used} charged");
        assert!(memory.peak() <= budget);
        let queues = fixed(32) + (slow as u64 + 1) * fixed(128);
        assert!(used > queues, "no send buffer grew: the test does not measure");
        // The working queue reads, and a compute command runs in what connections leave.
        let data = vec![7u8; 128 * 1024];
        worker.write(1, 1 << 16, &data, 512, false).await.unwrap();
        assert_eq!(worker.read(1, 1 << 16, 256, 512).await.unwrap(), data);
        let d = Descriptor {
            op: by_name("crc32c").unwrap().id,
            args: vec![],
            inputs: vec![Object { len: 4096, extents: vec![Extent::data(1 << 25, 4096)] }],
            outputs: vec![],
        }
        .encode();
        worker.compute(1, &d, Duration::from_secs(10)).await.unwrap();
        drop(readers);
        drop(worker);
        c.shutdown().await.unwrap();
        wait_until("connections closed", Duration::from_secs(5), || stats.connections.load(Relaxed) == 0);
        wait_until("budget given back", Duration::from_secs(5), || memory.used() == 0);
        assert_eq!(stats.buffer_bytes.load(Relaxed), 0);
    });
}

/// A file namespace whose flush takes `flush` longer: a disk with a large dirty cache.
struct SlowFlush {
    inner: nearstore_target::backend::FileBackend,
    flush: Duration,
}

impl nearstore_target::backend::Backend for SlowFlush {
    fn describe(&self) -> String {
        format!("{} with a slow flush", self.inner.describe())
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        self.inner.read_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
        self.inner.write_at(buf, off)
    }
    fn flush(&self) -> std::io::Result<()> {
        std::thread::sleep(self.flush);
        self.inner.flush()
    }
    fn write_zeroes(&self, off: u64, len: u64, deallocate: bool) -> std::io::Result<()> {
        self.inner.write_zeroes(off, len, deallocate)
    }
    fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        self.inner.raw_fd()
    }
}

/// A shutdown (CC.SHN) flushes every namespace off the network thread: another host's
/// 4 KiB reads of the same namespace keep completing while a 2 s flush runs, the Property
/// Set completes at once, and CSTS.SHST goes from 01b (occurring) to 10b (complete) when
/// the flush is done. Before, the flush ran inside the Property Set on the network thread,
/// and every host on it waited for the whole flush.
#[test]
fn a_slow_shutdown_flush_does_not_stall_other_hosts() {
    let _alone = alone();
    use nearstore_initiator::{prop_get, prop_set};
    use nearstore_target::backend::FileBackend;
    use nearstore_target::subsystem::Namespace;
    use nearstore_wire::fabrics::{cc, csts, prop};
    let flush = Duration::from_secs(2);
    let t = isolated("");
    let dir = tempfile::tempdir().unwrap();
    let inner = FileBackend::open(&dir.path().join("slow.img"), Some(64 << 20)).unwrap();
    let ns = Namespace::new(NQN, 2, Arc::new(SlowFlush { inner, flush }), 512);
    t.target.subsystem(NQN).unwrap().add_namespace(ns).unwrap();
    let t = &t;
    client_rt().block_on(async move {
        let victim = Controller::connect(t.opts(HOST_B)).await.unwrap();
        let mut vq = victim.io_queue(1).await.unwrap();
        vq.write(2, 0, &[9u8; 4096], 512, true).await.unwrap();
        let attacker = Controller::connect(t.opts(HOST_A)).await.unwrap();
        let start = Instant::now();
        attacker.admin(prop_set(prop::CC, cc::LINUX_ENABLE | cc::SHN_NORMAL), Data::None, "Property Set CC.SHN").await.unwrap();
        let set = start.elapsed();
        // The host polls CSTS as the specification says, while the victim reads.
        let poll = tokio::spawn(async move {
            let mut seen = Vec::new();
            loop {
                let (c, _) = attacker.admin(prop_get(prop::CSTS, false), Data::None, "Property Get CSTS").await.unwrap();
                let shst = c.dw0 & (csts::SHST_OCCURRING | csts::SHST_COMPLETE);
                if seen.last() != Some(&shst) {
                    seen.push(shst);
                }
                if shst == csts::SHST_COMPLETE || c.dw0 & csts::CFS != 0 {
                    return (start.elapsed(), seen, c.dw0);
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        let (mut worst, mut reads) = (Duration::ZERO, 0u64);
        while !poll.is_finished() {
            let t0 = Instant::now();
            assert_eq!(vq.read(2, 0, 8, 512).await.unwrap(), [9u8; 4096]);
            worst = worst.max(t0.elapsed());
            reads += 1;
        }
        let (took, seen, status) = poll.await.unwrap();
        eprintln!("shutdown: Property Set {set:?}, complete after {took:?}; {reads} reads meanwhile, the slowest {worst:?}");
        assert_eq!(seen, [csts::SHST_OCCURRING, csts::SHST_COMPLETE], "CSTS.SHST went {seen:?} (CSTS {status:#x})");
        assert!(took >= flush, "shutdown complete after {took:?}, before the {flush:?} flush ended");
        assert!(set < Duration::from_millis(500), "the Property Set took {set:?}");
        assert!(worst < Duration::from_millis(500), "a 4 KiB read waited {worst:?} behind the flush");
        assert!(reads > 10, "only {reads} reads in {took:?}");
    });
}
