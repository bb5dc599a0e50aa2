//! Reservations across hosts: two (and three) hosts with their own Host Identifiers and
//! NQNs over TCP register, acquire, preempt, release and clear; the I/O of each is
//! allowed or refused as the reservation says; notices reach the right controllers; the
//! state persists through a restart when asked to.

mod common;

use nearstore_initiator::{Controller, Data, Error, IoQueue};
use nearstore_target::backend::{Backend, FileBackend};
use nearstore_target::config::Config;
use nearstore_target::subsystem::Namespace;
use nearstore_target::Target;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nearstore_wire::compute::{opcode as cop, Descriptor, Extent, Object};
use nearstore_wire::identify::{ctratt, oncs, rescap};
use nearstore_wire::opcode::{admin, feature, io, lid};
use nearstore_wire::resv::{self, cptpl, notice, racqa, rrega, rrela, Cdw10, Keys, NoticeLog, Rtype};
use nearstore_wire::{Sqe, Status};

/// The file namespace of common::start (it can persist reservations); 1 is in memory.
const NS: u32 = 2;
const MEM_NS: u32 = 1;

struct Host {
    c: Controller,
    q: IoQueue,
    id: [u8; 16],
}

fn hostnqn(n: u8) -> String {
    format!("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000{n:02x}")
}

async fn host_at(addr: std::net::SocketAddr, n: u8, id: [u8; 16]) -> Host {
    let mut o = nearstore_initiator::ConnectOptions::new(addr, common::NQN);
    o.hostnqn = hostnqn(n);
    o.hostid = id;
    let c = Controller::connect(o).await.unwrap();
    let q = c.io_queue(1).await.unwrap();
    Host { c, q, id }
}

async fn host(env: &common::Env, n: u8) -> Host {
    host_at(env.addr, n, [n; 16]).await
}

fn status<T>(r: Result<T, Error>) -> Status {
    match r {
        Ok(_) => Status::SUCCESS,
        Err(Error::Status { status, .. } | Error::Compute { status, .. }) => Status { dnr: false, ..status },
        Err(e) => panic!("not a status: {e}"),
    }
}

const CONFLICT: Status = Status::RESERVATION_CONFLICT;

impl Host {
    async fn register(&mut self, action: u8, crkey: u64, nrkey: u64) -> Status {
        status(self.q.resv_register(NS, Cdw10 { action, ..Default::default() }, Keys { current: crkey, other: nrkey }).await)
    }
    async fn acquire(&mut self, action: u8, t: Rtype, crkey: u64, prkey: u64) -> Status {
        let cdw10 = Cdw10 { action, rtype: t as u8, ..Default::default() };
        status(self.q.resv_acquire(NS, cdw10, Keys { current: crkey, other: prkey }).await)
    }
    async fn release(&mut self, action: u8, t: u8, crkey: u64) -> Status {
        status(self.q.resv_release(NS, Cdw10 { action, rtype: t, ..Default::default() }, crkey).await)
    }
    async fn write(&mut self) -> Status {
        status(self.q.write(NS, 8, &[7u8; 4096], 4096, false).await)
    }
    async fn read(&mut self) -> Status {
        status(self.q.read(NS, 8, 1, 4096).await)
    }
    /// Write Zeroes, Dataset Management and Flush: the rest of the write command group.
    async fn other_writes(&mut self) -> [Status; 3] {
        [
            status(self.q.write_zeroes(NS, 16, 1, false).await),
            status(self.q.deallocate(NS, &[(16, 1)]).await),
            status(self.q.flush(NS).await),
        ]
    }
    async fn notice(&self, rae: bool) -> NoticeLog {
        let mut s = Sqe::new(admin::GET_LOG_PAGE, 0);
        nearstore_wire::log::get_log::build(&mut s, lid::RESERVATION_NOTIFICATION, resv::NOTICE_LOG_LEN as u32, 0);
        if rae {
            s.set_cdw(10, s.cdw(10) | 1 << 15);
        }
        let (_, d) = self.c.admin(s, Data::In(resv::NOTICE_LOG_LEN), "Get Log Page 80h").await.unwrap();
        NoticeLog::decode(&d).unwrap()
    }
    async fn feature(&self, set: Option<u32>, fid: u8, nsid: u32) -> Result<u32, Error> {
        let mut s = Sqe::new(if set.is_some() { admin::SET_FEATURES } else { admin::GET_FEATURES }, 0);
        s.set_nsid(nsid).set_cdw(10, fid as u32).set_cdw(11, set.unwrap_or(0));
        Ok(self.c.admin(s, Data::None, "features").await?.0.dw0)
    }
    /// An Asynchronous Event Request; an event is pending, so it completes at once.
    async fn event(&self) -> u32 {
        let s = Sqe::new(admin::ASYNC_EVENT_REQUEST, 0);
        self.c.admin(s, Data::None, "Asynchronous Event Request").await.unwrap().0.dw0
    }
}

const KA: u64 = 0xa1;
const KB: u64 = 0xb2;
const KC: u64 = 0xc3;

#[tokio::test]
async fn two_hosts_reserve_preempt_release_and_clear() {
    let env = common::start().await;
    let (mut a, mut b) = (host(&env, 0xa).await, host(&env, 0xb).await);
    assert_eq!(a.register(rrega::REGISTER, 0, KA).await, Status::SUCCESS);
    assert_eq!(b.register(rrega::REGISTER, 0, KB).await, Status::SUCCESS);
    assert_eq!(a.acquire(racqa::ACQUIRE, Rtype::WriteExclusive, KA, 0).await, Status::SUCCESS);

    // Write Exclusive: B reads but may not write; A does both.
    assert_eq!(b.write().await, CONFLICT);
    assert_eq!(b.other_writes().await, [CONFLICT; 3]);
    assert_eq!(b.read().await, Status::SUCCESS);
    assert_eq!(a.write().await, Status::SUCCESS);
    assert_eq!(a.other_writes().await, [Status::SUCCESS; 3]);
    // The other namespace is not reserved.
    assert_eq!(status(b.q.write(MEM_NS, 0, &[1; 512], 512, false).await), Status::SUCCESS);

    let r = b.q.resv_report(NS).await.unwrap();
    assert_eq!((r.generation, r.rtype, r.regctl, r.ptpls), (2, Rtype::WriteExclusive as u8, 2, false));
    let regs: Vec<_> = r.registrants.iter().map(|r| (r.hostid, r.rkey, r.holder, r.cntlid)).collect();
    assert_eq!(regs, vec![(a.id, KA, true, resv::CNTLID_DYNAMIC), (b.id, KB, false, resv::CNTLID_DYNAMIC)]);

    // B preempts A into Exclusive Access: A is unregistered and can neither read nor write.
    assert_eq!(b.acquire(racqa::PREEMPT, Rtype::ExclusiveAccess, KB, KA).await, Status::SUCCESS);
    assert_eq!((a.read().await, a.write().await), (CONFLICT, CONFLICT));
    assert_eq!((b.read().await, b.write().await), (Status::SUCCESS, Status::SUCCESS));
    // A's controller is told: an event, then the Registration Preempted page, then nothing.
    assert_eq!(a.event().await, resv::AEN_RESERVATION_LOG);
    let n = a.notice(false).await;
    assert_eq!((n.kind, n.nsid, n.available), (notice::REGISTRATION_PREEMPTED, NS, 0));
    assert!(n.count >= 1);
    assert_eq!(a.notice(false).await, NoticeLog::default());
    // B issued the preempt: no notice for it.
    assert_eq!(b.notice(false).await.kind, notice::EMPTY);

    // A's operations without a registration (or with a wrong key) are refused.
    assert_eq!(a.acquire(racqa::ACQUIRE, Rtype::WriteExclusive, KA, 0).await, CONFLICT);
    assert_eq!(a.release(rrela::RELEASE, 2, KA).await, CONFLICT);
    assert_eq!(b.release(rrela::RELEASE, 2, KA).await, CONFLICT);
    // A release of another type than the reservation's.
    assert_eq!(b.release(rrela::RELEASE, 1, KB).await, Status::INVALID_FIELD);

    // B releases: everyone may write again.
    assert_eq!(b.release(rrela::RELEASE, Rtype::ExclusiveAccess as u8, KB).await, Status::SUCCESS);
    assert_eq!(a.write().await, Status::SUCCESS);

    // Write Exclusive - Registrants Only: registrants write, a third unregistered host not.
    let mut c = host(&env, 0xc).await;
    assert_eq!(a.register(rrega::REGISTER, 0, KA).await, Status::SUCCESS);
    assert_eq!(b.acquire(racqa::ACQUIRE, Rtype::WriteExclusiveRegistrantsOnly, KB, 0).await, Status::SUCCESS);
    assert_eq!((a.write().await, c.write().await, c.read().await), (Status::SUCCESS, CONFLICT, Status::SUCCESS));
    // B releases it: A, a registrant, is told; C is not registered and is not.
    assert_eq!(b.release(rrela::RELEASE, Rtype::WriteExclusiveRegistrantsOnly as u8, KB).await, Status::SUCCESS);
    assert_eq!(a.notice(false).await.kind, notice::RESERVATION_RELEASED);
    assert_eq!(c.notice(false).await.kind, notice::EMPTY);

    // A clears: registrations and reservation go, B learns it was preempted.
    assert_eq!(b.acquire(racqa::ACQUIRE, Rtype::ExclusiveAccessAllRegistrants, KB, 0).await, Status::SUCCESS);
    assert_eq!(c.read().await, CONFLICT);
    assert_eq!(a.release(rrela::CLEAR, 0, KA).await, Status::SUCCESS);
    assert_eq!(b.notice(false).await.kind, notice::RESERVATION_PREEMPTED);
    assert_eq!(c.write().await, Status::SUCCESS);
    let r = c.q.resv_report(NS).await.unwrap();
    assert_eq!((r.rtype, r.regctl, r.registrants.len()), (0, 0, 0));
}

#[tokio::test]
async fn notices_masked_by_feature_and_events_held_until_read() {
    let env = common::start().await;
    let (mut a, mut b) = (host(&env, 0xa).await, host(&env, 0xb).await);
    assert_eq!(a.feature(None, feature::RESERVATION_NOTIFICATION_MASK, NS).await.unwrap(), 0);
    // Mask Registration Preempted on A's controller for this namespace.
    a.feature(Some(1 << notice::REGISTRATION_PREEMPTED), feature::RESERVATION_NOTIFICATION_MASK, NS).await.unwrap();
    assert_eq!(a.feature(None, feature::RESERVATION_NOTIFICATION_MASK, NS).await.unwrap(), 1 << notice::REGISTRATION_PREEMPTED);
    a.register(rrega::REGISTER, 0, KA).await;
    b.register(rrega::REGISTER, 0, KB).await;
    assert_eq!(b.acquire(racqa::PREEMPT, Rtype::WriteExclusive, KB, KA).await, Status::SUCCESS);
    assert_eq!(a.notice(false).await.kind, notice::EMPTY);
    // Unmasked on every namespace (NSID FFFFFFFFh): two notices, one event until the log is
    // read with RAE cleared.
    a.feature(Some(0), feature::RESERVATION_NOTIFICATION_MASK, 0xffff_ffff).await.unwrap();
    for _ in 0..2 {
        a.register(rrega::REGISTER, 0, KA).await;
        assert_eq!(b.acquire(racqa::PREEMPT, Rtype::WriteExclusive, KB, KA).await, Status::SUCCESS);
    }
    assert_eq!(a.event().await, resv::AEN_RESERVATION_LOG);
    let first = a.notice(true).await;
    assert_eq!((first.kind, first.available), (notice::REGISTRATION_PREEMPTED, 1));
    let second = a.notice(false).await;
    assert_eq!((second.count, second.available), (first.count + 1, 0));
    // Read with RAE cleared: the next notice posts an event again.
    a.register(rrega::REGISTER, 0, KA).await;
    assert_eq!(b.acquire(racqa::PREEMPT, Rtype::WriteExclusive, KB, KA).await, Status::SUCCESS);
    assert_eq!(a.event().await, resv::AEN_RESERVATION_LOG);
    // Refused masks and namespaces.
    for (v, nsid, want) in [(1u32, NS, Status::INVALID_FIELD), (1 << 4, NS, Status::INVALID_FIELD), (0, 99, Status::INVALID_NAMESPACE)] {
        let got = status(a.feature(Some(v), feature::RESERVATION_NOTIFICATION_MASK, nsid).await);
        assert_eq!(got, want, "mask {v:#x} nsid {nsid}");
    }
    assert_eq!(status(a.feature(None, feature::RESERVATION_NOTIFICATION_MASK, 99).await), Status::INVALID_NAMESPACE);
}

#[tokio::test]
async fn controllers_of_one_host_share_its_registration() {
    let env = common::start().await;
    let mut a1 = host(&env, 0xa).await;
    let mut a2 = host(&env, 0xa).await;
    assert_ne!(a1.c.cntlid, a2.c.cntlid);
    let mut b = host(&env, 0xb).await;
    assert_eq!(a1.register(rrega::REGISTER, 0, KA).await, Status::SUCCESS);
    // The second controller is the same registrant: registering another key conflicts.
    assert_eq!(a2.register(rrega::REGISTER, 0, KC).await, CONFLICT);
    assert_eq!(a2.acquire(racqa::ACQUIRE, Rtype::ExclusiveAccess, KA, 0).await, Status::SUCCESS);
    assert_eq!((a1.write().await, a1.read().await), (Status::SUCCESS, Status::SUCCESS));
    assert_eq!(b.read().await, CONFLICT);
    let r = b.q.resv_report(NS).await.unwrap();
    assert_eq!(r.registrants.len(), 1);
    // A preempted: both of A's controllers get the notice.
    b.register(rrega::REGISTER, 0, KB).await;
    assert_eq!(b.acquire(racqa::PREEMPT, Rtype::WriteExclusive, KB, KA).await, Status::SUCCESS);
    assert_eq!(a1.notice(false).await.kind, notice::REGISTRATION_PREEMPTED);
    assert_eq!(a2.notice(false).await.kind, notice::REGISTRATION_PREEMPTED);
}

/// NVMe Base 2.2, "Reservations": a controller that needs a non-zero Host Identifier for
/// reservations says so (CTRATT.RHII) and aborts every reservation command of a host whose
/// Host Identifier is zero with Host Identifier Not Initialized; that host's other
/// commands are checked against reservations like any unregistered host's. Before, Register
/// answered Command Sequence Error and Report and Acquire went through.
#[tokio::test]
async fn a_host_without_a_host_identifier_cannot_use_reservations() {
    let env = common::start().await;
    let mut z = host_at(env.addr, 0xe, [0; 16]).await;
    assert_ne!(z.c.id.ctratt & ctratt::RHII, 0);
    let not_init = Status::HOST_ID_NOT_INITIALIZED;
    assert_eq!(z.register(rrega::REGISTER, 0, KA).await, not_init);
    assert_eq!(z.acquire(racqa::ACQUIRE, Rtype::WriteExclusive, KA, 0).await, not_init);
    assert_eq!(z.release(rrela::RELEASE, 1, KA).await, not_init);
    assert_eq!(status(z.q.resv_report(NS).await), not_init);
    // A reservation of another host applies to it as to any host that is not registered.
    let mut a = host(&env, 0xa).await;
    assert_eq!(a.register(rrega::REGISTER, 0, KA).await, Status::SUCCESS);
    assert_eq!(a.acquire(racqa::ACQUIRE, Rtype::WriteExclusive, KA, 0).await, Status::SUCCESS);
    assert_eq!((z.read().await, z.write().await), (Status::SUCCESS, CONFLICT));
    assert_eq!(a.q.resv_report(NS).await.unwrap().regctl, 1);
}

/// An endless compute command on the namespace: it reads a block of it, then a terabyte
/// of zeros.
fn endless_checksum() -> Vec<u8> {
    Descriptor {
        op: nearstore_compute::by_name("crc32c").unwrap().id,
        args: vec![],
        inputs: vec![Object { len: 4096 + (1 << 40), extents: vec![Extent::data(0, 4096), Extent::zeros(1 << 40)] }],
        outputs: vec![],
    }
    .encode()
}

async fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let until = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < until, "{what}: not within 10 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Preempt and Abort (NVMe Base 2.2, "Preempting a Reservation or Registration"): the
/// preempted host's commands on the namespace are requested to abort and the Reservation
/// Acquire completes only after they have completed. B, a registrant of A's Exclusive
/// Access - Registrants Only reservation, has an endless compute command running and a
/// 128 KiB write waiting for its data (after R2T). A preempts B's registration: when the
/// Acquire completes, B's compute command has stopped (Command Aborted due to
/// Preempt and Abort, with a message under its handle), B's write ends with the same
/// status once its data came, without reaching the namespace, and B reads and writes
/// nothing more. A plain Preempt leaves what B started running (as the specification
/// allows); before, Preempt and Abort did exactly that too.
#[tokio::test]
async fn preempt_and_abort_stops_what_the_preempted_host_started() {
    for action in [racqa::PREEMPT, racqa::PREEMPT_AND_ABORT] {
        let env = common::start().await;
        let stats = env.target.offload.stats.clone();
        let (mut a, mut b) = (host(&env, 0xa).await, host(&env, 0xb).await);
        assert_eq!(a.register(rrega::REGISTER, 0, KA).await, Status::SUCCESS);
        assert_eq!(b.register(rrega::REGISTER, 0, KB).await, Status::SUCCESS);
        assert_eq!(a.acquire(racqa::ACQUIRE, Rtype::ExclusiveAccessRegistrantsOnly, KA, 0).await, Status::SUCCESS);
        let before = [5u8; 128 << 10];
        assert_eq!(status(a.q.write(NS, 100, &before, 4096, false).await), Status::SUCCESS);

        let desc = endless_checksum();
        let qp = b.q.queue();
        let mut s = Sqe::new(cop::EXEC, 0);
        s.set_nsid(NS);
        let exec = qp.submit(s, Data::Out(&desc), 0).unwrap();
        // Not polled: the initiator sends the data only when it reads the R2T.
        let late = [9u8; 128 << 10];
        let write = qp.submit(Sqe::rw(io::WRITE, NS, 100, 32, false), Data::Out(&late), 1).unwrap();
        qp.flush().await.unwrap();
        wait_for("B's compute command running", || stats.running.load(Relaxed) == 1).await;

        assert_eq!(a.acquire(action, Rtype::ExclusiveAccessRegistrantsOnly, KA, KB).await, Status::SUCCESS);
        if action == racqa::PREEMPT {
            // The preempted host's command goes on; closing its queue stops it.
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert_eq!(stats.running.load(Relaxed), 1, "a plain Preempt aborts nothing");
            drop(b);
            wait_for("B's command stopped with its connection", || stats.running.load(Relaxed) == 0).await;
            continue;
        }
        assert_eq!(stats.running.load(Relaxed), 0, "the Acquire completed while B's command still ran");
        // Waiting for the compute command also sends the write's data and may take the
        // write's completion on the way (every completion reaped goes to the closure, the
        // compute command's own too: kept only when it is the write's, else a write that
        // completed first was forgotten and then waited for once more).
        let mut written = None;
        let cqe =
            b.q.queue()
                .wait(exec, |tag, c, _| {
                    if tag == 1 {
                        written = Some(c.status);
                    }
                })
                .await
                .unwrap();
        assert_eq!(Status { dnr: false, ..cqe.status }, Status::ABORTED_PREEMPT);
        let written = match written {
            Some(s) => s,
            None => b.q.queue().wait(write, |_, _, _| {}).await.unwrap().status,
        };
        assert_eq!(Status { dnr: false, ..written }, Status::ABORTED_PREEMPT);
        let message = String::from_utf8(b.q.fetch(cqe.dw0, cqe.dw1).await.unwrap()).unwrap();
        assert!(message.contains("Preempt and Abort") && message.contains(&format!("namespace {NS}")), "{message}");
        let got = a.q.read(NS, 100, 32, 4096).await.unwrap();
        assert!(got == before, "B's aborted write reached the namespace");
        // B is fenced: no longer a registrant, it may neither read nor write.
        assert_eq!((b.read().await, b.write().await), (CONFLICT, CONFLICT));
        assert_eq!(status(b.q.compute(NS, &desc, Duration::from_secs(10)).await), CONFLICT);
        assert_eq!(b.event().await, resv::AEN_RESERVATION_LOG);
        assert_eq!(b.notice(false).await.kind, notice::REGISTRATION_PREEMPTED);
        // A reads and writes, and its own commands were never touched.
        assert_eq!((a.read().await, a.write().await), (Status::SUCCESS, Status::SUCCESS));
    }
}

/// A command on the host's queue with these fields and data; its status.
async fn raw(q: &mut IoQueue, opcode: u8, nsid: u32, cdw10: u32, cdw11: u32, data: Data<'_>) -> Status {
    let mut s = Sqe::new(opcode, 0);
    s.set_nsid(nsid).set_cdw(10, cdw10).set_cdw(11, cdw11);
    let qp = q.queue();
    let cid = qp.submit(s, data, 0).unwrap();
    let cqe = qp.wait(cid, |_, _, _| {}).await.unwrap();
    Status { dnr: false, ..cqe.status }
}

#[tokio::test]
async fn malformed_reservation_commands_get_the_specified_status() {
    let env = common::start().await;
    let mut a = host(&env, 0xa).await;
    let keys = Keys { current: 0, other: KA }.encode();
    let eds = resv::REPORT_EDS;
    let reg = io::RESERVATION_REGISTER;
    let acq = io::RESERVATION_ACQUIRE;
    let rel = io::RESERVATION_RELEASE;
    let rep = io::RESERVATION_REPORT;
    let cases: Vec<(&str, u8, u32, u32, u32, Data, Status)> = vec![
        ("register data of 8 bytes", reg, NS, 0, 0, Data::Out(&keys[..8]), Status::DATA_SGL_LENGTH_INVALID),
        ("register, no data", reg, NS, 0, 0, Data::None, Status::DATA_SGL_LENGTH_INVALID),
        ("register on no namespace", reg, 77, 0, 0, Data::Out(&keys), Status::INVALID_NAMESPACE),
        ("register action 3", reg, NS, 3, 0, Data::Out(&keys), Status::INVALID_FIELD),
        ("register CPTPL 01b", reg, NS, 1 << 30, 0, Data::Out(&keys), Status::INVALID_FIELD),
        ("PTPL on a memory namespace", reg, MEM_NS, 3 << 30, 0, Data::Out(&keys), Status::INVALID_FIELD),
        ("acquire type 0", acq, NS, 0, 0, Data::Out(&keys), Status::INVALID_FIELD),
        ("acquire type 7", acq, NS, 7 << 8, 0, Data::Out(&keys), Status::INVALID_FIELD),
        ("acquire with IEKEY", acq, NS, 1 << 8 | 1 << 3, 0, Data::Out(&keys), Status::INVALID_FIELD),
        ("acquire action 3", acq, NS, 1 << 8 | 3, 0, Data::Out(&keys), Status::INVALID_FIELD),
        ("acquire unregistered", acq, NS, 1 << 8, 0, Data::Out(&keys), CONFLICT),
        ("release with IEKEY", rel, NS, 1 << 3, 0, Data::Out(&keys[..8]), Status::INVALID_FIELD),
        ("release data of 16 bytes", rel, NS, 0, 0, Data::Out(&keys), Status::DATA_SGL_LENGTH_INVALID),
        ("release unregistered", rel, NS, 0, 0, Data::Out(&keys[..8]), CONFLICT),
        ("report without EDS", rep, NS, 15, 0, Data::In(64), Status::HOST_ID_INCONSISTENT),
        ("report NUMD beyond one transfer", rep, NS, 0xffff_ffff, eds, Data::In(64), Status::INVALID_FIELD),
        ("report NUMD against a shorter SGL", rep, NS, 31, eds, Data::In(64), Status::DATA_SGL_LENGTH_INVALID),
        ("report on no namespace", rep, 77, 15, eds, Data::In(64), Status::INVALID_NAMESPACE),
        // Shorter than the header is what the host asked for: the first dwords.
        ("report of one dword", rep, NS, 0, eds, Data::In(4), Status::SUCCESS),
    ];
    for (what, op, nsid, cdw10, cdw11, data, want) in cases {
        assert_eq!(raw(&mut a.q, op, nsid, cdw10, cdw11, data).await, want, "{what}");
    }
    // The queue still works.
    assert_eq!(a.register(rrega::REGISTER, 0, KA).await, Status::SUCCESS);
}

#[tokio::test]
async fn identify_advertises_reservations() {
    let env = common::start().await;
    let a = host(&env, 0xa).await;
    assert_ne!(a.c.id.oncs & oncs::RESERVATIONS, 0);
    let file = a.c.identify_namespace(NS).await.unwrap();
    assert_eq!(file.rescap, rescap::ALL_TYPES | rescap::IEKEY_1_3 | rescap::PTPL);
    assert_eq!(file.nmic & 1, 1);
    let mem = a.c.identify_namespace(MEM_NS).await.unwrap();
    assert_eq!(mem.rescap, rescap::ALL_TYPES | rescap::IEKEY_1_3);
    assert_eq!(status(a.feature(Some(1), feature::RESERVATION_PERSISTENCE, MEM_NS).await), Status::INVALID_FIELD);
}

fn ptpl_config(dir: &std::path::Path) -> Config {
    Config::from_toml(&format!(
        r#"
        io_threads = 1
        [[listener]]
        address = "127.0.0.1:0"
        [[subsystem]]
        nqn = "{}"
        allow_any_host = true
        [[subsystem.namespace]]
        nsid = {NS}
        path = "{}/disk.img"
        size = "16MiB"
        block_size = 4096
        "#,
        common::NQN,
        dir.display()
    ))
    .unwrap()
}

/// Runs `f` against a target started from `cfg` on a runtime of its own; dropping the
/// runtime at the end stops the target and every connection: a restart.
fn with_target<F, Fut>(cfg: &Config, f: F)
where
    F: FnOnce(std::net::SocketAddr) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let t = Target::from_config(cfg).unwrap();
        let addr = t.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
        f(addr).await;
    });
}

#[test]
fn reservations_persist_through_a_restart_when_asked() {
    common::init_logs();
    let dir = tempfile::tempdir().unwrap();
    let cfg = ptpl_config(dir.path());
    let file = dir.path().join("disk.img.resv");
    with_target(&cfg, |addr| async move {
        let (mut a, mut b) = (host_at(addr, 0xa, [0xa; 16]).await, host_at(addr, 0xb, [0xb; 16]).await);
        let cdw10 = Cdw10 { action: rrega::REGISTER, cptpl: cptpl::SET, ..Default::default() };
        a.q.resv_register(NS, cdw10, Keys { current: 0, other: KA }).await.unwrap();
        assert_eq!(a.feature(None, feature::RESERVATION_PERSISTENCE, NS).await.unwrap(), 1);
        b.register(rrega::REGISTER, 0, KB).await;
        assert_eq!(a.acquire(racqa::ACQUIRE, Rtype::WriteExclusiveRegistrantsOnly, KA, 0).await, Status::SUCCESS);
    });
    assert!(file.exists());
    with_target(&cfg, |addr| async move {
        let mut c = host_at(addr, 0xc, [0xc; 16]).await;
        let r = c.q.resv_report(NS).await.unwrap();
        assert_eq!((r.rtype, r.regctl, r.ptpls), (Rtype::WriteExclusiveRegistrantsOnly as u8, 2, true));
        assert_eq!(
            r.registrants.iter().map(|r| (r.hostid[0], r.rkey, r.holder)).collect::<Vec<_>>(),
            vec![(0xa, KA, true), (0xb, KB, false)]
        );
        assert_eq!(c.write().await, CONFLICT);
        let mut b = host_at(addr, 0xb, [0xb; 16]).await;
        assert_eq!(b.write().await, Status::SUCCESS);
        // PTPL off (Set Features 83h): the state file goes, and the state with the restart.
        assert_eq!(b.feature(Some(0), feature::RESERVATION_PERSISTENCE, NS).await.unwrap(), 0);
    });
    assert!(!file.exists());
    with_target(&cfg, |addr| async move {
        let mut c = host_at(addr, 0xc, [0xc; 16]).await;
        let r = c.q.resv_report(NS).await.unwrap();
        assert_eq!((r.rtype, r.regctl, r.ptpls), (0, 0, false));
        // Set Features 83h turns it on again, written before the command completes.
        c.feature(Some(1), feature::RESERVATION_PERSISTENCE, NS).await.unwrap();
    });
    assert!(file.exists());
    // A damaged state file stops the start-up, naming the file.
    let mut b = std::fs::read(&file).unwrap();
    b[10] ^= 1;
    std::fs::write(&file, &b).unwrap();
    let e = Target::from_config(&cfg).err().expect("a damaged state file is refused").to_string();
    assert!(e.contains("disk.img.resv") && e.contains("checksum"), "{e}");
}

#[tokio::test]
async fn a_state_file_that_cannot_be_written_fails_the_command() {
    let env = common::start().await;
    let mut a = host(&env, 0xa).await;
    // The temporary file's name is taken by a directory: creating it fails.
    std::fs::create_dir(env.dir.path().join("disk.img.resv.tmp")).unwrap();
    let cdw10 = Cdw10 { action: rrega::REGISTER, cptpl: cptpl::SET, ..Default::default() };
    let r = a.q.resv_register(NS, cdw10, Keys { current: 0, other: KA }).await;
    assert_eq!(status(r), Status::INTERNAL_ERROR);
}

/// A file namespace whose reads, writes and write zeroes wait at a gate the test opens, and
/// say when they started and finished on the storage. Without an io_uring descriptor
/// every operation runs on the I/O pool, as with `io_engine = "threads"`.
struct Gated {
    file: FileBackend,
    open: AtomicBool,
    started: AtomicBool,
    finished: AtomicBool,
}

impl Gated {
    fn pass(&self) {
        self.started.store(true, Relaxed);
        while !self.open.load(Relaxed) {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Backend for Gated {
    fn describe(&self) -> String {
        "gated file".into()
    }
    fn size(&self) -> u64 {
        self.file.size()
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        self.pass();
        let r = self.file.read_at(buf, off);
        self.finished.store(true, Relaxed);
        r
    }
    fn write_at(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
        self.pass();
        let r = self.file.write_at(buf, off);
        self.finished.store(true, Relaxed);
        r
    }
    fn flush(&self) -> std::io::Result<()> {
        self.file.flush()
    }
    fn write_zeroes(&self, off: u64, len: u64, deallocate: bool) -> std::io::Result<()> {
        self.pass();
        let r = self.file.write_zeroes(off, len, deallocate);
        self.finished.store(true, Relaxed);
        r
    }
}

/// Preempt and Abort when the preempted host's connection closes while its command still
/// runs on the storage (the usual fencing case: the host was reset or its keep-alive
/// expired). B's Write Zeroes (always on the I/O pool), plain write or READ CHECKSUM (on
/// the pool, as with `io_engine = "threads"`) is held at the storage; A preempts and aborts B, then
/// B's connection closes. The Acquire completes only once the storage has finished B's
/// operation: before, the wait was dropped with the closed connection's record of the
/// command and the Acquire completed while B's operation still wrote the namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preempt_and_abort_waits_for_the_storage_after_the_preempted_host_closes() {
    const GATED: u32 = 3;
    // (what B starts, how)
    type Start = fn(IoQueue) -> tokio::task::JoinHandle<()>;
    let cases: [(&str, Start); 3] = [
        ("write zeroes", |mut q| {
            tokio::spawn(async move {
                let _ = q.write_zeroes(GATED, 0, 2048, false).await;
            })
        }),
        ("write", |mut q| {
            tokio::spawn(async move {
                let _ = q.write(GATED, 0, &[3u8; 128 << 10], 4096, false).await;
            })
        }),
        // Read on the device like Read (before, on a blocking thread nothing held).
        ("read checksum", |mut q| {
            tokio::spawn(async move {
                let _ = q.read_checksum(GATED, 0, 32, 4096, 0..100).await;
            })
        }),
    ];
    for (what, start) in cases {
        let env = common::start().await;
        let file = FileBackend::open(&env.dir.path().join("gated.img"), Some(16 << 20)).unwrap();
        let gated =
            Arc::new(Gated { file, open: AtomicBool::new(false), started: AtomicBool::new(false), finished: AtomicBool::new(false) });
        let ns = Namespace::new(common::NQN, GATED, gated.clone(), 4096);
        env.target.subsystem(common::NQN).unwrap().add_namespace(ns).unwrap();
        let (mut a, b) = (host(&env, 0xa).await, host(&env, 0xb).await);
        let Host { c: bc, q: mut bq, .. } = b;
        let reg = |k| (Cdw10 { action: rrega::REGISTER, ..Default::default() }, Keys { current: 0, other: k });
        let (c, k) = reg(KA);
        a.q.resv_register(GATED, c, k).await.unwrap();
        let (c, k) = reg(KB);
        bq.resv_register(GATED, c, k).await.unwrap();
        let rtype = Rtype::ExclusiveAccessRegistrantsOnly as u8;
        a.q.resv_acquire(GATED, Cdw10 { action: racqa::ACQUIRE, rtype, ..Default::default() }, Keys { current: KA, other: 0 })
            .await
            .unwrap();

        let running = start(bq);
        wait_for(&format!("{what}: B's operation at the storage"), || gated.started.load(Relaxed)).await;
        let cdw10 = Cdw10 { action: racqa::PREEMPT_AND_ABORT, rtype, ..Default::default() };
        let acquire = tokio::spawn(async move {
            let r = a.q.resv_acquire(GATED, cdw10, Keys { current: KA, other: KB }).await;
            (r, a)
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!acquire.is_finished(), "{what}: the Acquire completed while B's operation ran");
        // B's connections close (a reset, a keep-alive expiry) with its operation running.
        running.abort();
        drop(bc);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!acquire.is_finished(), "{what}: the Acquire completed after B's connection closed, while its operation ran");
        assert!(!gated.finished.load(Relaxed), "{what}: the gate is still shut");
        gated.open.store(true, Relaxed);
        let (r, _a) = tokio::time::timeout(Duration::from_secs(10), acquire).await.expect("the Acquire completes").unwrap();
        assert!(gated.finished.load(Relaxed), "{what}: the Acquire completed before B's operation finished");
        assert_eq!(status(r), Status::SUCCESS, "{what}");
    }
}

/// Preempt and Abort against a host that stops reading its socket: B has many 128 KiB
/// reads outstanding on the namespace and reads nothing, so the target's send buffer to it
/// stays full. A's Preempt and Abort completes all the same, within a bounded time: the
/// abort request is taken without room in the send buffer, and B's reads let go of the
/// Acquire when the storage has finished them, not when their data has left. Before, the
/// Acquire waited for B's keep-alive to expire (forever with KATO 0). The second case adds
/// an endless checksum of B's: the Acquire completes once the offload engine has ended it,
/// though B's connection has not taken the command's completion (before, it waited for
/// that: forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preempt_and_abort_does_not_wait_for_a_host_that_stopped_reading() {
    for with_compute in [false, true] {
        let env = common::start().await;
        let stats = env.target.offload.stats.clone();
        let (mut a, mut b) = (host(&env, 0xa).await, host(&env, 0xb).await);
        assert_eq!(a.register(rrega::REGISTER, 0, KA).await, Status::SUCCESS);
        assert_eq!(b.register(rrega::REGISTER, 0, KB).await, Status::SUCCESS);
        assert_eq!(a.acquire(racqa::ACQUIRE, Rtype::ExclusiveAccessRegistrantsOnly, KA, 0).await, Status::SUCCESS);
        let desc = endless_checksum();
        let qp = b.q.queue();
        let mut reads = 128u64;
        if with_compute {
            let mut s = Sqe::new(cop::EXEC, 0);
            s.set_nsid(NS);
            qp.submit(s, Data::Out(&desc), 1000).unwrap();
            reads -= 1;
        }
        // 128 KiB reads filling the queue (16 MiB): more than the socket buffers and the
        // target's send buffer hold; B never reads a byte of them.
        for tag in 0..reads {
            qp.submit(Sqe::rw(io::READ, NS, tag * 32, 32, false), Data::In(128 << 10), tag).unwrap();
        }
        qp.flush().await.unwrap();
        if with_compute {
            wait_for("B's compute command running", || stats.running.load(Relaxed) == 1).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let r = tokio::time::timeout(
            Duration::from_secs(5),
            a.acquire(racqa::PREEMPT_AND_ABORT, Rtype::ExclusiveAccessRegistrantsOnly, KA, KB),
        )
        .await
        .unwrap_or_else(|_| panic!("the Acquire waited for a host that stopped reading (compute command: {with_compute})"));
        assert_eq!(r, Status::SUCCESS);
        assert_eq!(stats.running.load(Relaxed), 0, "the Acquire completed while B's command still ran");
        drop(b);
    }
}
