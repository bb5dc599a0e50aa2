//! The execution core does not depend on its transport: the same commands through NVMe/TCP
//! (our initiator over a socket) and through the in-process loopback transport
//! (`nearstore_target::loopback`, no socket, no PDU) give the same completions and the same
//! data, on a memory namespace (reads lent by the device) and a file namespace (reads and
//! writes on the queue's io_uring), for admin, I/O and compute commands, good and refused.

mod common;

use std::sync::Arc;
use std::time::Duration;

use nearstore_compute::by_name;
use nearstore_initiator::{prop_get, prop_set, ConnectOptions, Controller, Data, Error};
use nearstore_target::config::Config;
use nearstore_target::loopback::{self, Answer, Loopback};
use nearstore_target::Target;
use nearstore_wire::compute::{opcode as cop, status as cs, Descriptor, Extent, Object};
use nearstore_wire::fabrics::{cc, connect, csts, prop, ConnectData};
use nearstore_wire::opcode::{admin, cns, fctype, feature, io, FABRICS};
use nearstore_wire::{Cqe, Sqe, Status};

const T: Duration = Duration::from_secs(30);
/// Blocks of the memory namespace (512-byte blocks) and of the file namespace (4 KiB).
const MEM_BLOCKS: u64 = 2048;
const FILE_BLOCKS: u64 = 1024;
/// The largest transfer (MDTS).
const MDTS_BYTES: usize = 128 * 1024;
/// In-capsule data the initiator sends on the admin queue; I/O queues use the target's.
const ADMIN_IN_CAPSULE: usize = 8192;

/// A target with a memory namespace (1) and a file namespace (2).
async fn target(dir: &std::path::Path) -> (Arc<Target>, std::net::SocketAddr) {
    common::init_logs();
    let cfg = format!(
        r#"
        [[listener]]
        address = "127.0.0.1:0"
        [[subsystem]]
        nqn = "{nqn}"
        allow_any_host = true
        [[subsystem.namespace]]
        nsid = 1
        memory = "{mem}"
        [[subsystem.namespace]]
        nsid = 2
        path = "{dir}/disk.img"
        size = "{file}"
        block_size = 4096
        "#,
        nqn = common::NQN,
        mem = MEM_BLOCKS * 512,
        file = FILE_BLOCKS * 4096,
        dir = dir.display()
    );
    let target = Target::from_config(&Config::from_toml(&cfg).unwrap()).unwrap();
    let addr = target.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    (target, addr)
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Q {
    Admin,
    Io,
}

/// One command of the table: `(what, queue, command, host data, expected status (SCT, SC))`.
/// `In(n)`: n bytes to the host; `Out`: bytes from the host.
#[derive(Clone)]
enum Host {
    None,
    Out(Vec<u8>),
    In(usize),
}

struct Step {
    what: String,
    q: Q,
    sqe: Sqe,
    data: Host,
    expect: (u8, u8),
    /// The command takes the handle the previous command's completion returned (dw0) in
    /// CDW10 (a compute FETCH after its EXEC).
    handle: bool,
}

fn step(what: impl Into<String>, q: Q, sqe: Sqe, data: Host, expect: Status) -> Step {
    Step { what: what.into(), q, sqe, data, expect: (expect.sct, expect.sc), handle: false }
}

/// A pattern that differs per block and per write.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8).collect()
}

fn identify(cns: u8, nsid: u32) -> Sqe {
    let mut s = Sqe::new(admin::IDENTIFY, 0);
    s.set_nsid(nsid).set_cdw(10, cns as u32);
    s
}

fn flush(nsid: u32) -> Sqe {
    let mut s = Sqe::new(io::FLUSH, 0);
    s.set_nsid(nsid);
    s
}

/// The table: admin commands, then for each namespace reads and writes of edge sizes
/// (the transfer 0, 1, block-1, block, block+1 bytes and more for a one-block command;
/// whole blocks up to MDTS and past it, data in the capsule and fetched), flushes, an LBA
/// range past the end, a missing namespace, and a compute command and its result.
fn table() -> Vec<Step> {
    let ok = Status::SUCCESS;
    let sgl_len = Status::DATA_SGL_LENGTH_INVALID;
    let mut t = vec![
        step("identify controller", Q::Admin, identify(cns::CONTROLLER, 0), Host::In(4096), ok),
        step("identify namespace 1", Q::Admin, identify(cns::NAMESPACE, 1), Host::In(4096), ok),
        step("identify namespace 2", Q::Admin, identify(cns::NAMESPACE, 2), Host::In(4096), ok),
        step("identify active namespaces", Q::Admin, identify(cns::ACTIVE_NS_LIST, 0), Host::In(4096), ok),
        step("identify with a short SGL", Q::Admin, identify(cns::CONTROLLER, 0), Host::In(100), sgl_len),
        step("identify of an inactive namespace", Q::Admin, identify(cns::NAMESPACE, 9), Host::In(4096), ok),
        step("admin opcode unknown", Q::Admin, Sqe::new(0x7e, 0), Host::None, Status::INVALID_OPCODE),
    ];
    for (nsid, bs, blocks) in [(1u32, 512usize, MEM_BLOCKS), (2, 4096, FILE_BLOCKS)] {
        let n = |what: &str| format!("ns {nsid}: {what}");
        // One-block commands whose transfer is 0, 1, block-1, block, block+1 bytes.
        for (len, expect) in [(0, sgl_len), (1, sgl_len), (bs - 1, sgl_len), (bs, ok), (bs + 1, sgl_len)] {
            let w = Sqe::rw(io::WRITE, nsid, 3, 1, false);
            t.push(step(n(&format!("write of one block carrying {len} bytes")), Q::Io, w, Host::Out(pattern(len, len as u8)), expect));
            let r = Sqe::rw(io::READ, nsid, 3, 1, false);
            t.push(step(n(&format!("read of one block into {len} bytes")), Q::Io, r, Host::In(len), expect));
        }
        // Whole blocks: in the capsule (up to 16 KiB), fetched, up to MDTS (128 KiB), and
        // past it (refused before any data moves, whatever the SGL says).
        for kib in [1usize, 4, 16, 20, 64, 128, 132] {
            let len = (kib * 1024).max(bs);
            let nlb = (len / bs) as u32;
            let (sent, expect) = if len > MDTS_BYTES { (MDTS_BYTES, Status::INVALID_FIELD) } else { (len, ok) };
            let w = Sqe::rw(io::WRITE, nsid, 16, nlb, kib == 64);
            t.push(step(n(&format!("write of {len} bytes")), Q::Io, w, Host::Out(pattern(sent, kib as u8)), expect));
            t.push(step(n(&format!("read of {len} bytes")), Q::Io, Sqe::rw(io::READ, nsid, 16, nlb, false), Host::In(sent), expect));
        }
        let mut dsm = Sqe::new(io::DATASET_MANAGEMENT, 0);
        dsm.set_nsid(nsid).set_cdw(10, 0).set_cdw(11, 1 << 2);
        let mut range = vec![0u8; 16];
        range[4..8].copy_from_slice(&1u32.to_le_bytes());
        range[8..16].copy_from_slice(&17u64.to_le_bytes());
        t.push(step(n("deallocate one block"), Q::Io, dsm, Host::Out(range), ok));
        t.push(step(n("flush"), Q::Io, flush(nsid), Host::None, ok));
        t.push(step(n("read of the last block"), Q::Io, Sqe::rw(io::READ, nsid, blocks - 1, 1, false), Host::In(bs), ok));
        let past = Sqe::rw(io::READ, nsid, blocks - 1, 2, false);
        t.push(step(n("read past the end"), Q::Io, past, Host::In(2 * bs), Status::LBA_OUT_OF_RANGE));
        let past = Sqe::rw(io::WRITE, nsid, blocks, 1, false);
        t.push(step(n("write past the end"), Q::Io, past, Host::Out(pattern(bs, 1)), Status::LBA_OUT_OF_RANGE));
        let zeroes = Sqe::rw(io::WRITE_ZEROES, nsid, 16, 2, false);
        t.push(step(n("write zeroes"), Q::Io, zeroes, Host::None, ok));
        t.push(step(n("read after write zeroes"), Q::Io, Sqe::rw(io::READ, nsid, 15, 4, false), Host::In(4 * bs), ok));
    }
    t.push(step("read of a missing namespace", Q::Io, Sqe::rw(io::READ, 9, 0, 1, false), Host::In(512), Status::INVALID_NAMESPACE));
    t.push(step("I/O opcode unknown", Q::Io, Sqe::rw(0x7c, 1, 0, 1, false), Host::None, Status::INVALID_OPCODE));
    // Identify Controller's VWC bits 2:1 are 10b: a broadcast Flush is not supported.
    t.push(step("flush of NSID FFFFFFFFh", Q::Io, flush(0xffff_ffff), Host::None, Status::INVALID_NAMESPACE));
    // A compute command over the blocks written above, then its result.
    let crc = Descriptor {
        op: by_name("crc32c").unwrap().id,
        args: vec![],
        inputs: vec![Object { len: 20 * 1024, extents: vec![Extent::data(16 * 512, 20 * 1024)] }],
        outputs: vec![],
    };
    let mut exec = Sqe::new(cop::EXEC, 0);
    exec.set_nsid(1);
    t.push(step("compute EXEC crc32c", Q::Io, exec, Host::Out(crc.encode()), ok));
    let mut fetch = Sqe::new(cop::FETCH, 0);
    fetch.set_cdw(11, 0);
    t.push(Step { handle: true, ..step("compute FETCH of its result", Q::Io, fetch, Host::In(4096), ok) });
    let mut bad = Sqe::new(cop::FETCH, 0);
    bad.set_cdw(10, 0xdead);
    t.push(step("compute FETCH of an unknown handle", Q::Io, bad, Host::In(4096), cs::HANDLE_INVALID));
    let mut exec = Sqe::new(cop::EXEC, 0);
    exec.set_nsid(2);
    let bad = Descriptor { op: 0x7777, ..crc.clone() };
    t.push(step("compute EXEC of an unknown operation", Q::Io, exec, Host::Out(bad.encode()), cs::UNKNOWN_OPERATION));
    t
}

/// What a host sees of one command, with the command identifier it sent (None where our
/// initiator's admin calls keep it).
struct Seen {
    answer: Answer,
    cid: Option<u16>,
}

/// Admin queue entries (both transports connect it with 32).
const ADMIN_QUEUE: u16 = 32;

/// What may differ between the two runs, taken out: the command identifier (each host's
/// own; checked to be echoed instead), SQHD's value (how many commands each host sent
/// before the table; its progression since the queue's previous command stays, modulo the
/// queue's size, or 0xffff with SQ flow control disabled), and the controller's ID in
/// Identify Controller (each target numbers its own). `prev` is SQHD of the previous
/// command on the same queue, per queue.
fn normal(what: &str, q: Q, s: Seen, prev: &mut [Option<u16>; 2], io_depth: u16) -> (Answer, Option<String>) {
    let Seen { answer: a, cid } = s;
    let echo = cid.filter(|&c| c != a.cqe.cid).map(|c| format!("{what}: CID {} in the completion of command {c}", a.cqe.cid));
    let (slot, size) = match q {
        Q::Admin => (0, ADMIN_QUEUE),
        Q::Io => (1, io_depth),
    };
    let sqhd = a.cqe.sqhd;
    let progress = match prev[slot].replace(sqhd) {
        // SQ flow control disabled: 0xffff, or 0 where the data stood for the completion.
        Some(p) if sqhd == 0xffff || p == 0xffff => sqhd,
        Some(p) => (sqhd + size - p) % size,
        // The first of the table on its queue: the value counts the commands before.
        None => 0,
    };
    let mut data = a.data;
    // The controller instance (CNTLID, and CIU and CIRN: random) differs by nature.
    if what == "identify controller" && data.len() >= 144 {
        data[78..80].fill(0);
        data[135..144].fill(0);
    }
    (Answer { cqe: Cqe { cid: 0, sqhd: progress, ..a.cqe }, data }, echo)
}

async fn over_tcp(opts: ConnectOptions, steps: &[Step]) -> Vec<Seen> {
    let ctrl = Controller::connect(opts).await.unwrap();
    let mut ioq = ctrl.io_queue(1).await.unwrap();
    let mut out: Vec<Seen> = Vec::new();
    for s in steps {
        let mut sqe = s.sqe;
        if s.handle {
            sqe.set_cdw(10, out.last().expect("a command before").answer.cqe.dw0);
        }
        let data = match &s.data {
            Host::None => Data::None,
            Host::Out(d) => Data::Out(d),
            Host::In(n) => Data::In(*n),
        };
        let a = match s.q {
            Q::Admin => match ctrl.admin(sqe, data, &s.what).await {
                Ok((cqe, data)) => Seen { answer: Answer { cqe, data }, cid: None },
                Err(Error::Status { cqe, .. }) => Seen { answer: Answer { cqe, data: Vec::new() }, cid: None },
                Err(e) => panic!("{}: {e}", s.what),
            },
            Q::Io => {
                let q = ioq.queue();
                let cid = q.submit(sqe, data, 0).unwrap();
                let mut got = Vec::new();
                let wait = q.wait(cid, |_, c, d| {
                    if c.cid == cid {
                        got.extend_from_slice(d);
                    }
                });
                let cqe = tokio::time::timeout(T, wait).await.expect(&s.what).unwrap();
                Seen { answer: Answer { cqe, data: got }, cid: Some(cid) }
            }
        };
        out.push(a);
    }
    out
}

/// Runs `sqe` on a loopback queue with its data placed as our initiator places it: in
/// the capsule up to `in_capsule` bytes, else fetched.
async fn run(q: &mut Loopback, sqe: Sqe, data: &Host, in_capsule: usize) -> Answer {
    let d = match data {
        Host::None => loopback::Data::None,
        Host::Out(d) if !d.is_empty() && d.len() <= in_capsule => loopback::Data::Capsule(d),
        Host::Out(d) => loopback::Data::Out(d),
        Host::In(n) => loopback::Data::In(*n),
    };
    tokio::time::timeout(T, q.run(sqe, d)).await.expect("the loopback command completes").unwrap()
}

fn connect_sqe(qid: u16, sqsize: u16, opts: &ConnectOptions) -> Sqe {
    let cattr = if opts.disable_sqflow { connect::CATTR_DISABLE_SQFLOW as u32 } else { 0 };
    let kato = if qid == 0 { opts.kato_ms } else { 0 };
    let mut s = Sqe::new(FABRICS, 0);
    s.set_nsid(fctype::CONNECT as u32).set_cdw(10, (qid as u32) << 16).set_cdw(11, (sqsize as u32 - 1) | (cattr << 16)).set_cdw(12, kato);
    s
}

/// Connects an admin and an I/O loopback queue as our initiator's Controller::connect
/// and io_queue do over TCP.
async fn connect_loopback(target: &Arc<Target>, opts: &ConnectOptions) -> (Loopback, Loopback) {
    let cd = |cntlid| {
        ConnectData { hostid: opts.hostid, cntlid, subnqn: opts.subnqn.clone(), hostnqn: opts.hostnqn.clone(), acting_for: None }.encode()
    };
    let mut adm = Loopback::new(target, false);
    let c = run(&mut adm, connect_sqe(0, 32, opts), &Host::Out(cd(0xffff)), ADMIN_IN_CAPSULE).await;
    assert!(c.cqe.status.is_success(), "admin Connect: {:?}", c.cqe);
    let cntlid = c.cqe.dw0 as u16;
    let s = run(&mut adm, prop_set(prop::CC, cc::LINUX_ENABLE), &Host::None, ADMIN_IN_CAPSULE).await;
    assert!(s.cqe.status.is_success(), "CC.EN: {:?}", s.cqe);
    let deadline = tokio::time::Instant::now() + T;
    while run(&mut adm, prop_get(prop::CSTS, false), &Host::None, ADMIN_IN_CAPSULE).await.cqe.dw0 & csts::RDY == 0 {
        assert!(tokio::time::Instant::now() < deadline, "CSTS.RDY");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut nq = Sqe::new(admin::SET_FEATURES, 0);
    nq.set_cdw(10, feature::NUMBER_OF_QUEUES as u32).set_cdw(11, 63 | (63 << 16));
    assert!(run(&mut adm, nq, &Host::None, ADMIN_IN_CAPSULE).await.cqe.status.is_success());
    let mut ioq = Loopback::new(target, false);
    let c = run(&mut ioq, connect_sqe(1, opts.queue_depth, opts), &Host::Out(cd(cntlid)), ADMIN_IN_CAPSULE).await;
    assert!(c.cqe.status.is_success(), "I/O queue Connect: {:?}", c.cqe);
    (adm, ioq)
}

async fn over_loopback(target: &Arc<Target>, opts: &ConnectOptions, steps: &[Step]) -> Vec<Seen> {
    let (mut adm, mut ioq) = connect_loopback(target, opts).await;
    let in_capsule = nearstore_target::limits::IN_CAPSULE_BYTES_MAX;
    let mut out: Vec<Seen> = Vec::new();
    for (i, s) in steps.iter().enumerate() {
        let mut sqe = s.sqe;
        if s.handle {
            sqe.set_cdw(10, out.last().expect("a command before").answer.cqe.dw0);
        }
        // The host's identifiers: a different one for each command.
        let cid = 0x100 + i as u16;
        sqe.set_cid(cid);
        let a = match s.q {
            Q::Admin => run(&mut adm, sqe, &s.data, ADMIN_IN_CAPSULE).await,
            Q::Io => run(&mut ioq, sqe, &s.data, in_capsule).await,
        };
        out.push(Seen { answer: a, cid: Some(cid) });
    }
    out
}

/// With SQ flow control disabled, read data stands for its completion (NVMe/TCP's
/// C2HData SUCCESS flag; the loopback's answer without a completion of its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_and_loopback_give_the_same_results() {
    for disable_sqflow in [false, true] {
        same_results(disable_sqflow).await;
    }
}

async fn same_results(disable_sqflow: bool) {
    let steps = table();
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (ta, addr) = target(dir_a.path()).await;
    let (tb, _) = target(dir_b.path()).await;
    let mut opts = ConnectOptions::new(addr, common::NQN);
    opts.hostnqn = common::GOOD_HOST.into();
    opts.timeout = T;
    opts.disable_sqflow = disable_sqflow;
    // No Keep Alive between the table's admin commands over TCP: SQHD counts every command.
    opts.kato_ms = 0;
    opts.send_keep_alive = false;
    let tcp = over_tcp(opts.clone(), &steps).await;
    let lo = over_loopback(&tb, &opts, &steps).await;
    let mut wrong = Vec::new();
    let (mut prev_a, mut prev_b) = ([None; 2], [None; 2]);
    for ((s, a), b) in steps.iter().zip(tcp).zip(lo) {
        let st = a.answer.cqe.status;
        if (st.sct, st.sc) != s.expect {
            wrong.push(format!("{}: {st} over TCP, expected {:?}", s.what, s.expect));
        }
        if let Host::In(n) = s.data {
            let want = if st.is_success() { n } else { 0 };
            if a.answer.data.len() != want {
                wrong.push(format!("{}: {} bytes over TCP, expected {want}", s.what, a.answer.data.len()));
            }
        }
        let (a, echo_a) = normal(&s.what, s.q, a, &mut prev_a, opts.queue_depth);
        let (b, echo_b) = normal(&s.what, s.q, b, &mut prev_b, opts.queue_depth);
        wrong.extend(echo_a.map(|e| format!("over TCP, {e}")));
        wrong.extend(echo_b.map(|e| format!("over the loopback, {e}")));
        if a != b {
            let at = a.data.iter().zip(&b.data).position(|(x, y)| x != y);
            wrong.push(format!(
                "{}: TCP {:?} ({} bytes) and loopback {:?} ({} bytes) differ, first at byte {at:?}",
                s.what,
                a.cqe,
                a.data.len(),
                b.cqe,
                b.data.len()
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "SQ flow control disabled: {disable_sqflow}; {} of {} commands:\n{}",
        wrong.len(),
        steps.len(),
        wrong.join("\n")
    );
    for t in [&ta, &tb] {
        assert_eq!(t.stats.requests_lost.load(std::sync::atomic::Ordering::Relaxed), 0, "commands lost");
    }
}

async fn go(q: &mut Loopback, sqe: Sqe, d: loopback::Data<'_>) -> Answer {
    tokio::time::timeout(T, q.run(sqe, d)).await.expect("the loopback command completes").unwrap()
}

/// A transport that delivers less of a write's data than its SGL describes (a short
/// delivery): the pooled buffer still holds the previous write's bytes, which the core must
/// not write. The command fails with Transient Transport Error, the blocks keep what they
/// held, and the queue goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_delivery_fails_the_write_not_the_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let (target, addr) = target(dir.path()).await;
    let mut opts = ConnectOptions::new(addr, common::NQN);
    opts.hostnqn = common::GOOD_HOST.into();
    let (_adm, mut ioq) = connect_loopback(&target, &opts).await;
    let mut wrong = Vec::new();
    // (namespace, block size, bytes delivered of two blocks)
    for (nsid, bs, delivered) in [(1u32, 512usize, 0usize), (1, 512, 1), (1, 512, 1023), (2, 4096, 0), (2, 4096, 4096), (2, 4096, 8191)] {
        let len = 2 * bs;
        // A full write leaves its bytes in the buffer the next fetched write is given.
        let full = pattern(len, 7);
        let w = go(&mut ioq, Sqe::rw(io::WRITE, nsid, 10, 2, false), loopback::Data::Out(&full)).await;
        assert!(w.cqe.status.is_success(), "ns {nsid}: the full write: {:?}", w.cqe);
        let before = go(&mut ioq, Sqe::rw(io::READ, nsid, 20, 2, false), loopback::Data::In(len)).await;
        let short = pattern(len, 99);
        let d = loopback::Data::Short { len, data: &short[..delivered] };
        let s = go(&mut ioq, Sqe::rw(io::WRITE, nsid, 20, 2, false), d).await;
        if s.cqe.status != Status::TRANSIENT_TRANSPORT_ERROR {
            wrong.push(format!("ns {nsid}, {delivered} of {len} bytes: {}", s.cqe.status));
        }
        let after = go(&mut ioq, Sqe::rw(io::READ, nsid, 20, 2, false), loopback::Data::In(len)).await;
        if after.data != before.data {
            wrong.push(format!("ns {nsid}, {delivered} of {len} bytes: the blocks changed"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert_eq!(target.stats.requests_lost.load(std::sync::atomic::Ordering::Relaxed), 0, "commands lost");
}

/// How an I/O loopback queue's controller goes away.
#[derive(Clone, Copy, Debug)]
enum Loss {
    /// The host disconnects the I/O queue itself (Disconnect): the admin queue stays.
    Disconnect,
    /// The admin queue closes: the controller is removed.
    AdminClosed,
    /// The host sends nothing for longer than KATO: the controller is removed.
    KeepAlive,
}

/// After Disconnect, or once its controller is gone, an I/O loopback queue takes no more
/// commands (before the fix it went on executing them for a removed controller).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_or_orphaned_loopback_queue_takes_no_commands() {
    let dir = tempfile::tempdir().unwrap();
    let (target, addr) = target(dir.path()).await;
    for loss in [Loss::Disconnect, Loss::AdminClosed, Loss::KeepAlive] {
        let mut opts = ConnectOptions::new(addr, common::NQN);
        opts.hostnqn = common::GOOD_HOST.into();
        // Loopback queues send no keep-alives: a short KATO only where it is the loss.
        opts.kato_ms = if matches!(loss, Loss::KeepAlive) { 200 } else { 30_000 };
        let (mut adm, mut ioq) = connect_loopback(&target, &opts).await;
        let read = Sqe::rw(io::READ, 1, 0, 1, false);
        assert!(go(&mut ioq, read, loopback::Data::In(512)).await.cqe.status.is_success(), "{loss:?}: a read before");
        match loss {
            Loss::Disconnect => {
                let mut d = Sqe::new(FABRICS, 0);
                d.set_nsid(fctype::DISCONNECT as u32);
                let a = go(&mut ioq, d, loopback::Data::None).await;
                assert!(a.cqe.status.is_success(), "Disconnect: {:?}", a.cqe);
                let k = go(&mut adm, Sqe::new(admin::KEEP_ALIVE, 0), loopback::Data::None).await;
                assert!(k.cqe.status.is_success(), "the admin queue stays: {:?}", k.cqe);
            }
            Loss::AdminClosed => drop(adm),
            Loss::KeepAlive => {
                // Watched without a command, which would count as one from the host: expired
                // and removed (its queues are cancelled as it leaves the subsystem's list).
                let sub = target.subsystem(common::NQN).unwrap();
                let t0 = std::time::Instant::now();
                while target.stats.controllers_expired.load(std::sync::atomic::Ordering::Relaxed) == 0 || sub.controller_count() != 0 {
                    assert!(t0.elapsed() < T, "the controller outlived KATO by {T:?}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                let r = tokio::time::timeout(T, adm.run(Sqe::new(admin::KEEP_ALIVE, 0), loopback::Data::None)).await.unwrap();
                assert!(matches!(r, Err(loopback::Error::Closed)), "the admin queue after keep-alive expiry: {r:?}");
            }
        }
        let w = pattern(512, 3);
        for (what, sqe, d) in [
            ("read", Sqe::rw(io::READ, 1, 0, 1, false), loopback::Data::In(512)),
            ("write", Sqe::rw(io::WRITE, 1, 0, 1, false), loopback::Data::Out(&w)),
            ("flush", flush(1), loopback::Data::None),
        ] {
            let r = tokio::time::timeout(T, ioq.run(sqe, d)).await.unwrap();
            assert!(matches!(r, Err(loopback::Error::Closed)), "{loss:?}: a {what} after: {r:?}");
        }
    }
    assert_eq!(target.stats.requests_lost.load(std::sync::atomic::Ordering::Relaxed), 0, "commands lost");
}

/// `f`'s output, which must come within T.
async fn within<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(T, f).await.unwrap_or_else(|_| panic!("{what}: did not return within {T:?}"))
}

/// An Asynchronous Event Request with no event pending parks on a loopback queue as on a
/// connection: `run` returns (it waited forever before), the queue goes on, and the event
/// that comes later completes that command, identifier and all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_aer_lets_the_loopback_go_on_and_completes_with_its_event() {
    let dir = tempfile::tempdir().unwrap();
    let (target, addr) = target(dir.path()).await;
    let mut opts = ConnectOptions::new(addr, common::NQN);
    opts.hostnqn = common::GOOD_HOST.into();
    let (mut adm, _ioq) = connect_loopback(&target, &opts).await;
    let set = |fid: u8, v: u32| {
        let mut s = Sqe::new(admin::SET_FEATURES, 0);
        s.set_cdw(10, fid as u32).set_cdw(11, v);
        s
    };
    // The temperature event: type 1 (SMART / health), information 1 (temperature), log page 2.
    const AEN_TEMPERATURE: u32 = 0x01 | (0x01 << 8) | (0x02 << 16);
    let ok = |r: Result<Answer, loopback::Error>, what: &str| -> Answer {
        let a = r.unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(a.cqe.status.is_success(), "{what}: {:?}", a.cqe);
        a
    };
    let r = adm.event().await;
    assert!(matches!(r, Err(loopback::Error::NothingParked)), "an event with nothing parked: {r:?}");
    ok(within("AEC", adm.run(set(feature::ASYNC_EVENT_CONFIG, 1 << 1), loopback::Data::None)).await, "AEC");
    let r = within("AER", adm.run(Sqe::new(admin::ASYNC_EVENT_REQUEST, 7), loopback::Data::None)).await;
    assert!(matches!(r, Err(loopback::Error::Parked(7))), "an AER with nothing pending: {r:?}");
    let r = within("reused CID", adm.run(Sqe::new(admin::KEEP_ALIVE, 7), loopback::Data::None)).await;
    assert!(matches!(r, Err(loopback::Error::CidInUse(7))), "the parked AER's identifier again: {r:?}");
    // The queue goes on: a Keep Alive, then the over-temperature threshold under the
    // temperature, whose event completes the parked AER while the Set Features runs.
    ok(within("keep alive", adm.run(Sqe::new(admin::KEEP_ALIVE, 8), loopback::Data::None)).await, "keep alive");
    let t = ok(within("threshold", adm.run(set(feature::TEMPERATURE_THRESHOLD, 290), loopback::Data::None)).await, "threshold");
    assert_eq!(t.cqe.cid, 0, "the Set Features' own completion: {:?}", t.cqe);
    let ev = ok(within("event", adm.event()).await, "the event");
    assert_eq!((ev.cqe.cid, ev.cqe.dw0), (7, AEN_TEMPERATURE), "{:?}", ev.cqe);
    let r = adm.event().await;
    assert!(matches!(r, Err(loopback::Error::NothingParked)), "the AER completed once: {r:?}");
    assert_eq!(target.stats.requests_lost.load(std::sync::atomic::Ordering::Relaxed), 0, "commands lost");
}
