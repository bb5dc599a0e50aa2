//! The execution core of one queue, apart from any transport (Linux nvmet's core, with
//! `nvmet_req_init`, `req->execute` and `nvmet_req_complete`): it takes a parsed command
//! ([`Core::on_capsule`]: its SQE and in-capsule data), checks it before any data moves,
//! runs it (fabrics, admin, I/O, compute, reservations) and completes it exactly once. It
//! knows nothing of PDUs: whatever crosses the wire goes through the [`Transport`] the
//! core is generic over (nvmet's `nvmet_fabrics_ops`): fetching a write's data, sending
//! read data, sending a completion. The NVMe/TCP transport is [`crate::tcp`]; the
//! in-process one of tests is [`crate::loopback`].
//!
//! Memory-backend reads and writes run at once on the caller's task (MDTS bounds them);
//! everything else goes to the namespace's device on the queue's [`Channel`], the offload
//! engine or a blocking task, and comes back through [`Core::poll_io`] and
//! [`Core::on_done`], which the transport's task calls while it has room for responses.
//! Buffers and command slots are reused; nothing is allocated per I/O on the read and
//! write paths once the queue is warm.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nearstore_transport::AlignedBuf;
use nearstore_wire::fabrics::connect;
use nearstore_wire::log::ErrorEntry;
use nearstore_wire::opcode::{fctype, FABRICS};
use nearstore_wire::sqe::sgl_id;
use nearstore_wire::{Cqe, Sqe, Status};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::admin;
use crate::admission::{QueueSlot, Ticket};
use crate::auth::QueueAuth;
use crate::dev::{Channel, Completion, Op};
use crate::fabrics;
use crate::io_cmd::{self, IoKind, IoPlan};
use crate::io_pool::Done;
use crate::limits;
use crate::log_limit::peer_warn;
use crate::memory::{Reservation, Waiting as MemoryWait};
use crate::offload::TaskAbort;
use crate::range_lock::WriteGuard;
use crate::reply::Reply;
use crate::request::{QueueRequests, Request};
use crate::subsystem::{AbortGuard, Controller, Namespace};
use crate::{Port, Target};

mod auth;
mod buffers;
mod compare;
mod compute;
mod fused;
mod reservation;
mod reset;

pub use compare::Compared;
pub use compute::is_compute;
pub use fused::Finished;

/// What a transport does for the execution core (Linux nvmet's `nvmet_fabrics_ops`): it
/// moves a command's data and its completion, and nothing else. The core is generic over
/// it, so the calls are direct (no dynamic dispatch on the I/O path).
pub trait Transport {
    /// Sends a completion (a response capsule).
    fn complete(&mut self, cqe: &Cqe);
    /// Sends `data`, all of command `cid`'s controller-to-host data, copied. `success`: the
    /// data stands for the command's completion (status success, dw0 and dw1 zero, SQ flow
    /// control disabled; NVMe/TCP's SUCCESS flag), and no [`complete`](Self::complete)
    /// follows.
    fn send_data(&mut self, cid: u16, data: &[u8], success: bool);
    /// As [`send_data`](Self::send_data), with the `len` bytes lent by a device as up to two
    /// slices for the duration of the call: a transport may send them without a copy.
    fn send_lent(&mut self, cid: u16, len: usize, success: bool, parts: &[&[u8]]);
    /// As [`send_lent`](Self::send_lent), for a read of `len` bytes at `off` that the
    /// namespace's device accepted ([`BlockDevice::lend`]): the transport takes the bytes
    /// now, or later in the same send as other responses (NVMe/TCP gathers a batch's large
    /// reads). An error taking them now fails the command; nothing was sent.
    fn send_from(&mut self, cid: u16, len: usize, success: bool, ns: &Namespace, off: u64) -> io::Result<()> {
        ns.dev.read_lent(off, len, &mut |parts| self.send_lent(cid, len, success, parts))
    }
    /// Asks the host for command `cid`'s `len` bytes of data. The transport puts them into
    /// [`Core::waiting`]`(tag)` and then calls [`Core::data_arrived`] (or
    /// [`Core::data_failed`]).
    fn fetch_data(&mut self, cid: u16, tag: u16, len: usize);
    /// True while responses may be queued: completions of work that ran elsewhere (device,
    /// offload engine, state writes) are taken, and commands read, only then, which bounds
    /// the transport's send buffer (limits::connection_memory_max): room for one more
    /// response without the buffer growing by itself.
    fn has_room(&self) -> bool;
    /// How many responses fit before the room is gone (at least one while
    /// [`has_room`](Self::has_room)).
    fn room_for(&self) -> usize {
        usize::MAX
    }
    /// Without room: Some(bytes) the send buffer must grow by to have room (0: it has room
    /// now, having dropped what it sent), or None when only the host reading helps. The core
    /// charges them to the memory budget, then calls [`grow`](Self::grow).
    fn make_room(&mut self) -> Option<usize> {
        None
    }
    /// Grows the send buffer by `bytes`, charged to the budget by the core.
    fn grow(&mut self, _bytes: usize) {}
    /// Gives back what the send buffer grew while it is empty; returns the bytes, whose
    /// charge the core gives back (another queue waits for the budget).
    fn shrink(&mut self) -> usize {
        0
    }
}

/// The core could not take a command: the host has more outstanding than its queue holds.
/// Fatal to the connection; the command ends with the queue.
#[derive(Debug)]
pub struct Overflow;

/// A slab: values addressed by a small index (R2T transfer tags, pool job tokens).
struct Slab<T> {
    slots: Vec<Option<T>>,
    free: Vec<usize>,
    live: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab { slots: Vec::new(), free: Vec::new(), live: 0 }
    }
}

impl<T> Slab<T> {
    fn insert(&mut self, v: T) -> usize {
        self.live += 1;
        match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(v);
                i
            }
            None => {
                self.slots.push(Some(v));
                self.slots.len() - 1
            }
        }
    }
    fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.slots.get_mut(i).and_then(|s| s.as_mut())
    }
    fn remove(&mut self, i: usize) -> Option<T> {
        let v = self.slots.get_mut(i)?.take()?;
        self.live -= 1;
        self.free.push(i);
        Some(v)
    }
}

/// The queue this connection became by Connect.
struct Queue {
    ctrl: Arc<Controller>,
    qid: u16,
    sqsize: u16,
    sqflow_disabled: bool,
    /// This connection's share of the memory budget: what it always holds
    /// (limits::connection_memory_fixed for its size, `fixed` bytes) and what it grew
    /// (exec/buffers.rs); given back when the connection ends and the queue is dropped.
    memory: Reservation,
    fixed: u64,
    /// Its place among its address's connected queues (limits.queues_per_address).
    _slot: Option<QueueSlot>,
}

/// A write that waits for a data buffer before its data is fetched (a fetch never takes
/// the queue's last buffer, limits::QUEUE_BUFFERS_FIXED).
struct Deferred {
    sqe: Sqe,
    len: usize,
    req: Request,
    /// Aborted by another host's Preempt and Abort: completes without its data.
    aborted: bool,
}

/// A command waiting for its data from the host ([`Transport::fetch_data`]); its tag is
/// its index.
pub struct Waiting {
    sqe: Sqe,
    /// Where the data goes: as long as the transfer.
    pub buf: AlignedBuf,
    /// Bytes of `buf` the transport has filled, in order.
    pub received: usize,
    req: Request,
    /// Aborted by another host's Preempt and Abort: its data is taken, then it completes
    /// with Command Aborted due to Preempt and Abort without running.
    aborted: bool,
}

/// A command running on its namespace's device (the tag of its operation is its index),
/// the offload engine, or a blocking thread.
struct Inflight {
    req: Request,
    ns: Arc<Namespace>,
    kind: IoKind,
    len: usize,
    lba: u64,
    /// A compute command's task, which a Preempt and Abort stops and whose end lets the
    /// Acquire go on (a device operation's wait goes with the operation, [`Channel::hold`]).
    task: Option<Arc<TaskAbort>>,
    /// A FUSED WRITE's or a Compare and Write's standing against a Preempt and Abort,
    /// shared with its blocking work.
    fused: Option<Arc<crate::fused::AbortHold>>,
    /// A READ CHECKSUM's checksummed bytes of its data (start, end).
    sum: Option<(u32, u32)>,
    /// A Compare and Write's second half (`req` is its Compare).
    second: Option<Request>,
    /// A write's shared range (range_lock.rs) that its device operation could not hold
    /// (`Channel::hold` gave it back): held until the completion is taken.
    write: Option<WriteGuard>,
}

impl Inflight {
    fn new(req: Request, ns: Arc<Namespace>, kind: IoKind, len: usize, lba: u64) -> Inflight {
        Inflight { req, ns, kind, len, lba, task: None, fused: None, sum: None, second: None, write: None }
    }
}

impl Waiting {
    /// The command's identifier, which the host's data names.
    pub fn cid(&self) -> u16 {
        self.sqe.cid()
    }
}

/// One queue's execution state, driven by its transport's task.
pub struct Core<T> {
    pub(crate) target: Arc<Target>,
    port: Arc<Port>,
    local: Option<SocketAddr>,
    pub(crate) peer: String,
    /// The transport's sending half.
    pub(crate) xport: T,
    /// The connection's place among the target's (None for in-process transports): its
    /// address's connected queues are counted from Connect.
    pub(crate) ticket: Option<Ticket>,
    queue: Option<Queue>,
    sqhd: u16,
    /// Commands waiting for their data from the host ([`Transport::fetch_data`]).
    waiting: Slab<Waiting>,
    /// This queue's I/O context: its devices' operations run and complete there.
    pub(crate) chan: Channel,
    /// Completions taken from `chan`, reused between polls.
    completed: Vec<Completion>,
    inflight: Slab<Inflight>,
    bufs: Vec<AlignedBuf>,
    /// Data buffers allocated and alive: pooled in `bufs` or lent to a command.
    data_bufs: usize,
    /// Writes waiting for a data buffer before their data is fetched, in arrival order.
    deferred: VecDeque<Deferred>,
    /// Bytes of the budget the transport's send buffer grew by ([`Transport::grow`]).
    xport_grown: usize,
    /// Set while this queue waits for the memory budget: others give back what they hold
    /// unused.
    memory_wait: Option<MemoryWait>,
    done_tx: UnboundedSender<Done>,
    /// Given to the controller for other hosts' Preempt and Abort ([`Replies::abort`]).
    abort_tx: UnboundedSender<Done>,
    /// Outstanding Asynchronous Event Requests.
    aers: Vec<Request>,
    /// Cross-Controller Resets waiting for the reset controller's work to end, by token
    /// (exec/reset.rs); at most `limits::CROSS_CONTROLLER_RESETS_MAX`.
    resets: Vec<(u32, Request)>,
    next_reset: u32,
    /// A Disconnect completed: the transport closes once its responses are sent.
    pub(crate) close_after_flush: bool,
    /// Fires when this connection ends or its controller goes (a child of the controller's
    /// from Connect on): stops its compute commands; the transport ends the queue.
    pub(crate) cancel: CancellationToken,
    /// What became of this queue's requests (crate::request).
    requests: Arc<QueueRequests>,
    /// Its host must authenticate this queue (AUTHREQ.ATR in the Connect response).
    auth_required: bool,
    /// The queue authenticated (crate::auth): the last state [`QueueAuth`] reported.
    auth_ok: bool,
    /// The queue's authentication state; None while a message is handled on the blocking
    /// pool, or before the host has any.
    auth: Option<Box<QueueAuth>>,
    /// The Authentication Send handled on the blocking pool.
    auth_busy: Option<Request>,
    /// Compare and Write pairs whose halves are arriving (exec/compare.rs).
    pairs: Vec<compare::Pair>,
    /// Commands parsed on this queue: the next one's place in the submission order.
    submitted: u32,
    /// The last command parsed, a first half (its place), whose second is the next command.
    open_pair: Option<u32>,
    /// Writes waiting for a Compare and Write's range to go.
    parked: VecDeque<compare::Parked>,
    /// Ranges of a closed queue's operations that `Channel::hold` gave back (finished,
    /// their completions not taken, or run on another task: a remote or volume device's):
    /// dropped after `chan`, which drains its ring (not those tasks).
    abandoned_writes: Vec<WriteGuard>,
}

/// What comes back to a queue from elsewhere, for its transport's task to wait on and hand
/// to [`Core::on_done`].
pub struct Replies {
    /// Finished compute commands and state writes: taken only while the transport has room.
    pub done: UnboundedReceiver<Done>,
    /// Other hosts' Preempt and Abort requests ([`Done::Abort`]), taken whether or not the
    /// transport has room: handling one sends nothing.
    pub abort: UnboundedReceiver<Done>,
}

impl<T: Transport> Core<T> {
    /// A queue before its Connect. `peer` names the host's end in logs.
    pub fn new(target: Arc<Target>, port: Arc<Port>, local: Option<SocketAddr>, peer: String, xport: T) -> (Core<T>, Replies) {
        let (done_tx, done) = unbounded_channel();
        let (abort_tx, abort) = unbounded_channel();
        let core = Core {
            chan: Channel::new(target.io_engine, target.pool.clone()),
            requests: QueueRequests::new(target.clone()),
            target,
            port,
            local,
            peer,
            xport,
            ticket: None,
            queue: None,
            sqhd: 0,
            waiting: Slab::default(),
            completed: Vec::new(),
            inflight: Slab::default(),
            bufs: Vec::new(),
            data_bufs: 0,
            deferred: VecDeque::new(),
            xport_grown: 0,
            memory_wait: None,
            done_tx,
            abort_tx,
            aers: Vec::new(),
            resets: Vec::new(),
            next_reset: 0,
            close_after_flush: false,
            cancel: CancellationToken::new(),
            auth_required: false,
            auth_ok: false,
            auth: None,
            auth_busy: None,
            pairs: Vec::new(),
            submitted: 0,
            open_pair: None,
            parked: VecDeque::new(),
            abandoned_writes: Vec::new(),
        };
        (core, Replies { done, abort })
    }

    /// The controller this queue belongs to, from its Connect on.
    pub fn controller(&self) -> Option<&Arc<Controller>> {
        self.queue.as_ref().map(|q| &q.ctrl)
    }

    /// True for an admin queue (after Connect).
    pub fn is_admin(&self) -> bool {
        self.queue.as_ref().is_some_and(|q| q.qid == 0)
    }

    /// True while Asynchronous Event Requests wait for events.
    pub fn has_aers(&self) -> bool {
        !self.aers.is_empty()
    }

    /// True when command `cid` is an Asynchronous Event Request waiting for an event.
    pub fn is_parked(&self, cid: u16) -> bool {
        self.aers.iter().any(|r| r.cid() == cid)
    }
}

impl<T: Transport> Core<T> {
    /// Completes a command: its response capsule. Every completion of every command (admin,
    /// fabrics, I/O, compute) ends here or in a C2HData with the SUCCESS flag
    /// ([`finish_data`](Self::finish_data)), consuming its request.
    fn complete(&mut self, req: Request, status: Status, dw0: u32, dw1: u32) {
        let seq = req.seq();
        let cid = req.finish();
        let (sqid, sqhd) = match &self.queue {
            Some(q) if q.sqflow_disabled => (q.qid, 0xffff),
            Some(q) => (q.qid, self.sqhd),
            None => (0, self.sqhd),
        };
        self.xport.complete(&Cqe { dw0, dw1, sqhd, sqid, cid, status });
        if !status.is_success() {
            if let Some(q) = &self.queue {
                debug!(peer = %self.peer, qid = q.qid, cid, %status, "command failed");
            }
            if !self.pairs.is_empty() {
                self.pair_half_completed(seq);
            }
        }
    }

    fn success_flag(&self) -> bool {
        self.queue.as_ref().is_some_and(|q| q.sqflow_disabled)
    }

    /// Sends data then the completion (or only the data, with the SUCCESS flag, which
    /// stands for a completion whose dw0 and dw1 are zero: a reply carrying values, such
    /// as a FETCH's counts, always gets its CapsuleResp).
    fn complete_with_data(&mut self, req: Request, data: &[u8], r: &Reply) {
        let success = r.status.is_success() && r.dw0 == 0 && r.dw1 == 0 && self.success_flag();
        if !data.is_empty() && r.status.is_success() {
            self.xport.send_data(req.cid(), data, success);
        }
        if !success || data.is_empty() {
            self.complete(req, r.status, r.dw0, r.dw1);
        } else {
            self.finish_data(req);
        }
    }

    /// Completes a command whose data stood for its completion (the SUCCESS flag).
    fn finish_data(&mut self, req: Request) {
        let _ = req.finish();
    }

    /// A queue closing: its outstanding commands complete nowhere; counted and logged.
    pub fn abandon_outstanding(&mut self) {
        let mut n = 0;
        for x in self.waiting.slots.iter_mut().filter_map(Option::take) {
            x.req.abandon();
            n += 1;
        }
        for x in self.inflight.slots.iter_mut().filter_map(Option::take) {
            x.req.abandon();
            n += 1;
            if let Some(r) = x.second {
                r.abandon();
                n += 1;
            }
            self.abandoned_writes.extend(x.write);
        }
        for p in self.parked.drain(..) {
            p.req.abandon();
            n += 1;
        }
        self.open_pair = None;
        for p in self.pairs.drain(..) {
            n += p.ready();
            p.abandon();
        }
        for r in self.aers.drain(..) {
            r.abandon();
            n += 1;
        }
        for (_, r) in self.resets.drain(..) {
            r.abandon();
            n += 1;
        }
        for d in self.deferred.drain(..) {
            d.req.abandon();
            n += 1;
        }
        if let Some(r) = self.auth_busy.take() {
            r.abandon();
            n += 1;
        }
        self.waiting = Slab::default();
        self.inflight = Slab::default();
        if n > 0 {
            debug!(peer = %self.peer, qid = self.queue.as_ref().map_or(0, |q| q.qid), commands = n, "queue closed with commands outstanding");
        }
    }

    /// The fatal error of a host with more commands outstanding than its queue holds; the
    /// command that overflowed it ends with the queue.
    fn overflow(&self, req: Request) -> Overflow {
        req.abandon();
        Overflow
    }

    /// Bytes of buffers the core holds for this queue, its transport's apart (see
    /// limits::connection_memory_max).
    pub fn buffer_bytes(&self) -> usize {
        self.data_bufs * limits::TRANSFER_BYTES_MAX + self.chan.memory_bytes()
    }

    /// Commands of this queue not yet completed: waiting for their data or a buffer, or
    /// running.
    fn outstanding(&self) -> usize {
        self.waiting.live
            + self.inflight.live
            + self.deferred.len()
            + self.parked.len()
            + self.resets.len()
            + self.pairs.iter().map(|p| p.ready()).sum::<usize>()
    }

    fn outstanding_limit(&self) -> usize {
        self.queue.as_ref().map_or(1, |q| q.sqsize as usize + 1)
    }

    /// Takes a command from the host (nvmet_req_init): `data` is its in-capsule data;
    /// `data_ok` false when the transport found that data corrupt (a data digest error),
    /// which fails the command with Transient Transport Error. The command is checked
    /// before any data moves; one whose data the host holds is given the data through
    /// [`Transport::fetch_data`], then runs.
    pub fn on_capsule(&mut self, sqe: Sqe, data: &[u8], data_ok: bool) -> Result<(), Overflow> {
        let cid = sqe.cid();
        let seq = self.submitted;
        self.submitted = seq.wrapping_add(1);
        let req = Request::new(&self.requests, cid, seq, Instant::now());
        if let Some(q) = &self.queue {
            self.sqhd = (self.sqhd + 1) % (q.sqsize + 1);
            q.ctrl.touch();
            if q.qid > 0 {
                self.pair_on_capsule(&sqe, seq);
            }
        }
        if !data_ok {
            self.complete(req, Status::TRANSIENT_TRANSPORT_ERROR, 0, 0);
            return Ok(());
        }
        if sqe.psdt() != 1 {
            self.complete(req, Status::INVALID_FIELD.dnr(), 0, 0);
            return Ok(());
        }
        // Before its host has authenticated the queue, only fabrics commands run (Linux's
        // target: nvmet_check_auth_status), before any of the command's data moves.
        if sqe.opcode() != FABRICS && !self.auth_passed() {
            self.fail_admin(&sqe, req, Status::AUTH_REQUIRED.dnr());
            return Ok(());
        }
        // Its host left its tenant (a reload): nothing more runs while the queue closes.
        if sqe.opcode() != FABRICS && self.queue.as_ref().is_some_and(|q| q.ctrl.revoked()) {
            self.fail_admin(&sqe, req, Status::ACCESS_DENIED.dnr());
            return Ok(());
        }
        // The one fused operation (FUSES) is Compare and Write on an I/O queue: any other
        // command with FUSE set is refused before its data moves, never run as if plain
        // (its partner, if any, then misses it or fails with it).
        if sqe.opcode() != FABRICS && !compare::fuse_allowed(&sqe, self.queue.as_ref().is_some_and(|q| q.qid > 0)) {
            self.fail_admin(&sqe, req, Status::INVALID_FIELD.dnr());
            return Ok(());
        }
        let sgl = sqe.sgl();
        let to_controller = match sqe.opcode() {
            FABRICS => sqe.fctype() & 0x3 == 1,
            op => op & 0x3 == 1,
        };
        match sgl.id {
            sgl_id::IN_CAPSULE => {
                if sgl.addr != 0 {
                    self.complete(req, Status::SGL_OFFSET_INVALID.dnr(), 0, 0);
                    return Ok(());
                }
                if !to_controller || sgl.len as usize != data.len() {
                    self.complete(req, Status::DATA_SGL_LENGTH_INVALID.dnr(), 0, 0);
                    return Ok(());
                }
            }
            sgl_id::TRANSPORT if data.is_empty() => {}
            _ if sgl.len == 0 && data.is_empty() => {}
            sgl_id::TRANSPORT => {
                self.complete(req, Status::DATA_SGL_LENGTH_INVALID.dnr(), 0, 0);
                return Ok(());
            }
            _ => {
                self.complete(req, Status::SGL_DESCRIPTOR_TYPE_INVALID.dnr(), 0, 0);
                return Ok(());
            }
        }
        // Bytes to request from the host: the SGL's, or for fabrics and admin commands what
        // the command itself defines, checked before anything is allocated or requested.
        let want = match self.admin_data_len(&sqe) {
            Ok(Some(n)) => n as usize,
            Ok(None) => sgl.len as usize,
            Err(s) => {
                self.fail_admin(&sqe, req, s);
                return Ok(());
            }
        };
        if to_controller && sgl.id == sgl_id::TRANSPORT && want > 0 {
            return self.request_data(sqe, want, req);
        }
        self.execute(sqe, data, req)
    }

    /// For fabrics and admin commands: the bytes that move, from the data the command
    /// defines ([`admin::DataLen`]) checked against the host's SGL and MDTS. None for I/O
    /// commands, which io_cmd::plan and the compute commands check against their own fields.
    fn admin_data_len(&self, sqe: &Sqe) -> Result<Option<u64>, Status> {
        let expect = match (&self.queue, sqe.opcode()) {
            (_, FABRICS) => fabrics::data_len(sqe)?,
            (None, _) => return Err(Status::COMMAND_SEQUENCE_ERROR.dnr()),
            (Some(q), _) if q.qid == 0 => admin::data_len(&q.ctrl, sqe)?,
            (Some(_), _) => return Ok(None),
        };
        let moved = expect.moved(sqe.sgl().len).ok_or(Status::DATA_SGL_LENGTH_INVALID.dnr())?;
        if moved > limits::TRANSFER_BYTES_MAX as u64 {
            return Err(Status::INVALID_FIELD.dnr());
        }
        Ok(Some(moved))
    }

    /// Completes a fabrics or admin command refused before it ran, in the error log too.
    fn fail_admin(&mut self, sqe: &Sqe, req: Request, status: Status) {
        if let Some(q) = &self.queue {
            // The SGL is the data pointer, at byte 24 of the command.
            let param_loc = if status == Status::DATA_SGL_LENGTH_INVALID.dnr() { 24 } else { 0 };
            let e =
                ErrorEntry { sqid: q.qid, cid: sqe.cid(), status: status.to_field(), param_loc, nsid: sqe.nsid(), ..Default::default() };
            q.ctrl.record_error(e);
        }
        self.complete(req, status, 0, 0);
    }

    /// Asks the host for `len` bytes, a command's whole data, after checking the command is
    /// valid.
    fn request_data(&mut self, sqe: Sqe, len: usize, req: Request) -> Result<(), Overflow> {
        if len > limits::TRANSFER_BYTES_MAX {
            self.complete(req, Status::INVALID_FIELD.dnr(), 0, 0);
            return Ok(());
        }
        if let Some(q) = self.queue.as_ref().filter(|q| q.qid > 0 && sqe.opcode() != FABRICS && !compute::is_compute(sqe.opcode())) {
            let checked = if io_cmd::is_reservation(sqe.opcode()) {
                io_cmd::check_reservation(&q.ctrl.subsys, &q.ctrl.hostid, &q.ctrl.tenant, &sqe).map(drop)
            } else if self.lone_second(&sqe, req.seq()) {
                Err(Status::ABORTED_MISSING_FUSED.dnr())
            } else if self.first_failed(&sqe, req.seq()) {
                Err(Status::ABORTED_FAILED_FUSED)
            } else {
                io_cmd::plan(&q.ctrl.subsys, &q.ctrl.hostid, &q.ctrl.tenant, &sqe, true).map(drop)
            };
            if let Err(s) = checked {
                let ctrl = q.ctrl.clone();
                self.fail_io(&ctrl, &sqe, req, s);
                return Ok(());
            }
        }
        if let Some((ctrl, r)) = self.fused_refused_before_data(&sqe) {
            self.refuse_fused(&ctrl, &sqe, req, r);
            return Ok(());
        }
        if self.outstanding() >= self.outstanding_limit() {
            return Err(self.overflow(req));
        }
        // A fetch never takes the queue's last buffer (limits::QUEUE_BUFFERS_FIXED): without
        // a second one the write waits, its command read, for one to come back.
        if self.queue.is_some() && (!self.deferred.is_empty() || !self.pool_holds(2)) {
            self.deferred.push_back(Deferred { sqe, len, req, aborted: false });
            return Ok(());
        }
        self.fetch(sqe, len, req);
        Ok(())
    }

    fn fetch(&mut self, sqe: Sqe, len: usize, req: Request) {
        let cid = sqe.cid();
        let mut buf = self.take_buf();
        buf.set_len(len);
        let tag = self.waiting.insert(Waiting { sqe, buf, received: 0, req, aborted: false });
        self.xport.fetch_data(cid, tag as u16, len);
    }

    /// The command waiting for its data under `tag`, for the transport to fill.
    pub fn waiting(&mut self, tag: u16) -> Option<&mut Waiting> {
        self.waiting.get_mut(tag as usize)
    }

    /// The transport received a corrupt part of the data under `tag` (a data digest
    /// error): the command fails with Transient Transport Error, the queue stays.
    pub fn data_failed(&mut self, tag: u16) {
        let Some(x) = self.waiting.remove(tag as usize) else { return };
        self.put_buf(x.buf);
        self.complete(x.req, Status::TRANSIENT_TRANSPORT_ERROR, 0, 0);
    }

    /// All the data under `tag` is in its buffer: the command runs (or, aborted by another
    /// host's Preempt and Abort meanwhile, completes with that status). A buffer the
    /// transport did not fill (`received` short of the transfer) would hold a previous
    /// command's bytes (buffers are pooled, not cleared): the command fails with Transient
    /// Transport Error instead of running.
    pub fn data_arrived(&mut self, tag: u16) -> Result<(), Overflow> {
        if self.waiting.get_mut(tag as usize).is_some_and(|x| x.received != x.buf.len()) {
            self.data_failed(tag);
            return Ok(());
        }
        let Some(x) = self.waiting.remove(tag as usize) else { return Ok(()) };
        if x.aborted {
            self.put_buf(x.buf);
            match self.queue.as_ref().map(|q| q.ctrl.clone()) {
                Some(ctrl) => self.fail_io(&ctrl, &x.sqe, x.req, Status::ABORTED_PREEMPT),
                None => self.complete(x.req, Status::ABORTED_PREEMPT, 0, 0),
            }
            return Ok(());
        }
        self.execute_buffered(x.sqe, x.buf, x.req)
    }

    /// Runs a command whose host data sits in a pool buffer.
    fn execute_buffered(&mut self, sqe: Sqe, buf: AlignedBuf, req: Request) -> Result<(), Overflow> {
        if self.queue.as_ref().is_some_and(|q| q.qid > 0) && sqe.opcode() != FABRICS {
            return self.execute_io(sqe, &[], Some(buf), req);
        }
        let r = self.execute(sqe, &buf, req);
        self.put_buf(buf);
        r
    }

    fn execute(&mut self, sqe: Sqe, data: &[u8], req: Request) -> Result<(), Overflow> {
        let cid = sqe.cid();
        if sqe.opcode() == FABRICS {
            return self.fabrics(sqe, data, req);
        }
        let Some(q) = &self.queue else {
            self.complete(req, Status::COMMAND_SEQUENCE_ERROR.dnr(), 0, 0);
            return Ok(());
        };
        if !q.ctrl.ready() {
            self.complete(req, Status::COMMAND_SEQUENCE_ERROR.dnr(), 0, 0);
            return Ok(());
        }
        if q.qid > 0 {
            return self.execute_io(sqe, data, None, req);
        }
        let ctrl = q.ctrl.clone();
        if sqe.opcode() == nearstore_wire::opcode::admin::CROSS_CONTROLLER_RESET && !ctrl.subsys.discovery {
            return self.cross_controller_reset(&ctrl, &sqe, req);
        }
        if sqe.opcode() == nearstore_wire::opcode::admin::FENCE_HOST_INSTANCES && !ctrl.subsys.discovery {
            return self.fence_host_instances(&ctrl, &sqe, req);
        }
        match admin::handle(&self.target, &ctrl, &sqe, self.local) {
            admin::Outcome::Reply(mut r) => {
                // The reply is what the command defines, which admin_data_len checked the
                // host's SGL against: never more than the SGL describes.
                r.data.truncate(sqe.sgl().len as usize);
                if !r.status.is_success() {
                    ctrl.record_error(ErrorEntry { sqid: 0, cid, status: r.status.to_field(), nsid: sqe.nsid(), ..Default::default() });
                }
                let data = std::mem::take(&mut r.data);
                self.complete_with_data(req, &data, &r);
            }
            admin::Outcome::Persist(ns, snapshot) => self.later(req, io_cmd::Later { ns, snapshot: Some(snapshot), abort: None })?,
            admin::Outcome::ParkAer => {
                if self.aers.len() >= limits::AER_MAX {
                    self.complete(req, Status::ASYNC_EVENT_LIMIT_EXCEEDED.dnr(), 0, 0);
                } else {
                    self.aers.push(req);
                    self.deliver_events();
                }
            }
        }
        Ok(())
    }

    fn fabrics(&mut self, sqe: Sqe, data: &[u8], req: Request) -> Result<(), Overflow> {
        let r = match (sqe.fctype(), &self.queue) {
            (fctype::CONNECT, None) => {
                match fabrics::connect(&self.target, &sqe, data, self.port.discovery, &self.peer, self.ticket.as_ref()) {
                    Ok(c) => {
                        let atr = if c.auth.is_some() { connect::AUTHREQ_ATR } else { 0 };
                        let r = Reply { dw1: c.dw1, ..Reply::dw0(c.ctrl.cntlid as u32 | atr) };
                        if let Some(keys) = c.auth {
                            self.auth_required = true;
                            self.auth = Some(Box::new(QueueAuth::new(Some(keys), &c.ctrl.hostnqn, &c.ctrl.subsys.nqn)));
                        }
                        if c.qid == 0 {
                            spawn_keep_alive_watchdog(self.target.clone(), c.ctrl.clone());
                        }
                        // Its I/O is its tenant's in fair-scheduled devices (for a cluster
                        // member, the tenant of the host it acts for).
                        self.chan.set_tenant(Arc::new(crate::dev::fair::Tenant::of(&c.ctrl.tenant, c.ctrl.requester())));
                        // What a Cross-Controller Reset of its controller waits for.
                        self.chan.set_life(c.ctrl.life());
                        self.sqhd = 1 % (c.sqsize + 1);
                        c.ctrl.attach_queue(c.qid, self.abort_tx.clone());
                        // From Connect on, the queue lives as long as its controller, over
                        // every transport: the controller going stops its compute commands
                        // and its transport's task.
                        self.cancel = c.ctrl.cancel.child_token();
                        let fixed = c.memory.bytes();
                        self.queue = Some(Queue {
                            ctrl: c.ctrl,
                            qid: c.qid,
                            sqsize: c.sqsize,
                            sqflow_disabled: c.sqflow_disabled,
                            memory: c.memory,
                            fixed,
                            _slot: c.slot,
                        });
                        r
                    }
                    Err(r) => r,
                }
            }
            (fctype::CONNECT, Some(_)) => Reply::status(Status::COMMAND_SEQUENCE_ERROR.dnr()),
            (_, None) => Reply::status(Status::COMMAND_SEQUENCE_ERROR.dnr()),
            (fctype::PROPERTY_GET, Some(q)) if q.qid == 0 => fabrics::property_get(&q.ctrl, &sqe),
            (fctype::PROPERTY_SET, Some(q)) if q.qid == 0 => fabrics::property_set(&self.target, &self.peer, &q.ctrl, &sqe),
            (fctype::DISCONNECT, Some(_)) => {
                self.close_after_flush = true;
                Reply::ok()
            }
            (fctype::AUTH_SEND, Some(_)) => return self.auth_send(data, req),
            (fctype::AUTH_RECEIVE, Some(_)) => {
                self.auth_receive(&sqe, req);
                return Ok(());
            }
            _ => Reply::status(Status::INVALID_FIELD.dnr()),
        };
        self.complete(req, r.status, r.dw0, r.dw1);
        Ok(())
    }

    fn fail_io(&mut self, ctrl: &Controller, sqe: &Sqe, req: Request, status: Status) {
        let qid = self.queue.as_ref().map_or(0, |q| q.qid);
        ctrl.record_error(ErrorEntry {
            sqid: qid,
            cid: sqe.cid(),
            status: status.to_field(),
            lba: sqe.slba(),
            nsid: sqe.nsid(),
            ..Default::default()
        });
        if let Some(ns) = ctrl.subsys.namespace(sqe.nsid()) {
            ns.stats.errors.fetch_add(1, Relaxed);
        }
        self.complete(req, status, 0, 0);
    }

    /// Runs an I/O command. Host data is either `data` (in-capsule, still in the receive
    /// buffer) or `buf` (fetched from the host).
    fn execute_io(&mut self, sqe: Sqe, data: &[u8], buf: Option<AlignedBuf>, req: Request) -> Result<(), Overflow> {
        let ctrl = self.queue.as_ref().expect("I/O queue").ctrl.clone();
        if fused::is_fused(sqe.opcode()) {
            return self.execute_fused(&ctrl, sqe, data, buf, req);
        }
        if compute::is_compute(sqe.opcode()) {
            let r = self.execute_compute(&ctrl, sqe, buf.as_deref().unwrap_or(data), req);
            if let Some(b) = buf {
                self.put_buf(b);
            }
            return r;
        }
        if io_cmd::is_reservation(sqe.opcode()) {
            let r = self.execute_reservation(&ctrl, &sqe, buf.as_deref().unwrap_or(data), req);
            if let Some(b) = buf {
                self.put_buf(b);
            }
            return r;
        }
        if compare::is_compare(&sqe) {
            return self.execute_compare(&ctrl, sqe, data, buf, req);
        }
        let plan = match io_cmd::plan(&ctrl.subsys, &ctrl.hostid, &ctrl.tenant, &sqe, ctrl.write_cache.load(Relaxed)) {
            Ok(p) => p,
            Err(s) => {
                if let Some(b) = buf {
                    self.put_buf(b);
                }
                self.fail_io(&ctrl, &sqe, req, s);
                return Ok(());
            }
        };
        let IoPlan { ns, kind, op, len, lba } = plan;
        // A writer holds its blocks shared while its operation runs; one a Compare and
        // Write holds waits, parked, for them (Deallocate: the whole namespace, its
        // ranges still in the host's data).
        let blocks = match op {
            Op::Write { off, .. } => Some(off..off + len as u64),
            Op::WriteZeroes { off, len, .. } => Some(off..off + len),
            Op::Deallocate if sqe.cdw(11) & (1 << 2) != 0 => Some(0..u64::MAX),
            _ => None,
        };
        let write = match blocks {
            None => None,
            Some(r) => {
                let done = &self.done_tx;
                let wake = || {
                    let tx = done.clone();
                    Box::new(move || drop(tx.send(Done::Unblocked))) as crate::range_lock::Wake
                };
                match ns.ranges.try_write(r, wake) {
                    Some(g) => Some(g),
                    None => {
                        self.park(sqe, data, buf, req);
                        return Ok(());
                    }
                }
            }
        };
        // Deallocate: turn the host's ranges into byte ranges before anything runs.
        let (op, buf) = if let Op::Deallocate = op {
            let src = buf.as_deref().unwrap_or(data).to_vec();
            let mut b = buf.unwrap_or_else(|| self.take_buf());
            if let Err(s) = io_cmd::dsm_ranges(&ns, &ctrl.tenant, &ctrl.subsys.nqn, &sqe, &src, &mut b) {
                self.put_buf(b);
                self.fail_io(&ctrl, &sqe, req, s);
                return Ok(());
            }
            (op, Some(b))
        } else {
            (op, buf)
        };
        // Reads and writes of a device that completes them at once (memory) run here:
        // MDTS bounds them. Everything else, write zeroes and deallocate included (not
        // bounded by MDTS), starts on the device and completes through the channel.
        match op {
            Op::Read { off } => {
                if let Some(r) = self.read_now(&ns, off, len, req.cid()) {
                    match r {
                        Ok(success) => self.finish_io(&ns, kind, len, req, success),
                        Err(e) => self.io_error(&ctrl, &ns, kind, lba, req, e),
                    }
                    return Ok(());
                }
            }
            Op::Write { off, fua } => {
                if let Some(r) = ns.dev.write_now(buf.as_deref().unwrap_or(data), off, fua, self.chan.tenant()) {
                    drop(write);
                    if let Some(b) = buf {
                        self.put_buf(b);
                    }
                    match r {
                        Ok(()) => self.finish_io(&ns, kind, len, req, false),
                        Err(e) => self.io_error(&ctrl, &ns, kind, lba, req, e),
                    }
                    return Ok(());
                }
            }
            _ => {}
        }
        if self.outstanding() >= self.outstanding_limit() {
            return Err(self.overflow(req));
        }
        let buf = match buf {
            Some(b) => b,
            None => {
                let mut b = self.take_buf();
                match op {
                    Op::Read { .. } => b.set_len(len),
                    _ => {
                        b.set_len(data.len());
                        b.copy_from_slice(data);
                    }
                }
                b
            }
        };
        let token = self.inflight.insert(Inflight::new(req, ns.clone(), kind, len, lba));
        ns.dev.submit(&mut self.chan, op, buf, token as u64);
        // The range goes with the operation, released when the storage has finished it
        // whoever reaps it: not held while the completion waits for a host that stopped
        // reading, nor let go while a closed connection's operation still writes. Given
        // back (finished already, or run on another task), it is dropped with the
        // completion.
        if let Some(g) = write {
            let back = self.chan.hold(token as u64, g);
            if let Some(x) = self.inflight.get_mut(token) {
                x.write = back;
            }
        }
        Ok(())
    }

    /// Takes device completions while the transport has room for their responses (they
    /// wait in the channel otherwise: this bounds the send buffer,
    /// limits::connection_memory_max). Returns how many.
    pub fn poll_io(&mut self) -> usize {
        self.chan.submit();
        let mut n = 0;
        while self.room() {
            // As many as the transport takes without its send buffer growing.
            let fit = self.xport.room_for().clamp(1, limits::REAP_BATCH);
            let mut done = std::mem::take(&mut self.completed);
            let k = self.chan.poll(fit, &mut done);
            for c in done.drain(..) {
                self.on_completion(c);
            }
            self.completed = done;
            if k == 0 {
                break;
            }
            n += k;
        }
        n
    }

    /// A read from a device that completes at once: the data lent by the device goes to
    /// the transport, which may send it without a copy, now or with the batch. None: the
    /// device cannot, and nothing was sent. Ok(true): the data stood for the completion
    /// (the SUCCESS flag).
    fn read_now(&mut self, ns: &Namespace, off: u64, len: usize, cid: u16) -> Option<io::Result<bool>> {
        let success = self.success_flag();
        match ns.dev.lend(off, len, self.chan.tenant())? {
            Ok(()) => Some(self.xport.send_from(cid, len, success, ns, off).map(|()| success)),
            Err(e) => Some(Err(e)),
        }
    }

    fn finish_io(&mut self, ns: &Namespace, kind: IoKind, len: usize, req: Request, data_sent_with_success: bool) {
        let took = req.start().elapsed();
        let tenant = self.queue.as_ref().map(|q| &q.ctrl.tenant.stats);
        match kind {
            IoKind::Read => {
                ns.stats.reads.fetch_add(1, Relaxed);
                ns.stats.read_bytes.fetch_add(len as u64, Relaxed);
                ns.stats.read_ns.fetch_add(took.as_nanos() as u64, Relaxed);
                if let Some(t) = tenant {
                    t.reads.fetch_add(1, Relaxed);
                    t.read_bytes.fetch_add(len as u64, Relaxed);
                }
            }
            IoKind::Write => {
                ns.stats.writes.fetch_add(1, Relaxed);
                ns.stats.written_bytes.fetch_add(len as u64, Relaxed);
                ns.stats.write_ns.fetch_add(took.as_nanos() as u64, Relaxed);
                if let Some(t) = tenant {
                    t.writes.fetch_add(1, Relaxed);
                    t.written_bytes.fetch_add(len as u64, Relaxed);
                }
            }
            IoKind::Other | IoKind::Compare | IoKind::Compute | IoKind::Reservation => {
                ns.stats.other.fetch_add(1, Relaxed);
            }
        }
        ns.stats.latency.record(took);
        if data_sent_with_success {
            self.finish_data(req);
        } else {
            self.complete(req, Status::SUCCESS, 0, 0);
        }
    }

    fn io_error(&mut self, ctrl: &Controller, ns: &Namespace, kind: IoKind, lba: u64, req: Request, e: io::Error) {
        let status = crate::dev::error_status(&e).unwrap_or(match kind {
            IoKind::Read => Status::UNRECOVERED_READ_ERROR,
            _ => Status::WRITE_FAULT,
        });
        peer_warn!(self.target.log_limit, self.peer.as_str(), "backend I/O failed", nsid = ns.nsid, lba, error = %e);
        ns.stats.errors.fetch_add(1, Relaxed);
        let qid = self.queue.as_ref().map_or(0, |q| q.qid);
        ctrl.record_error(ErrorEntry { sqid: qid, cid: req.cid(), status: status.to_field(), lba, nsid: ns.nsid, ..Default::default() });
        self.complete(req, status, 0, 0);
    }

    /// A compute command or a state write finished, or another host's Preempt and Abort
    /// came ([`Replies`]).
    pub fn on_done(&mut self, d: Done) {
        match d {
            Done::Computed { token, computed } => self.on_computed(token, *computed),
            Done::Persisted { token, result } => self.on_persisted(token, result),
            Done::Abort { nsid, guard } => self.abort_commands(nsid, guard),
            Done::Auth { auth } => self.on_auth(auth),
            Done::Fused { token, finished } => self.on_fused(token, *finished),
            Done::Compared { token, compared } => self.on_compared(token, *compared),
            Done::Unblocked => self.unpark(),
            Done::Reset { token, status } => self.on_reset(token, status),
        }
    }

    /// A device operation finished.
    fn on_completion(&mut self, c: Completion) {
        let Completion { tag, result, buf } = c;
        let Some(x) = self.inflight.remove(tag as usize) else {
            self.put_buf(buf);
            return;
        };
        let Some(ctrl) = self.queue.as_ref().map(|q| q.ctrl.clone()) else {
            x.req.abandon();
            self.put_buf(buf);
            return;
        };
        if let Some((start, end)) = x.sum {
            self.on_read_checksum(&ctrl, x, start as usize..end as usize, result, &buf);
            self.put_buf(buf);
            return;
        }
        match result {
            Ok(()) if x.kind == IoKind::Read => {
                let success = self.success_flag();
                self.xport.send_data(x.req.cid(), &buf[..x.len], success);
                self.finish_io(&x.ns, x.kind, x.len, x.req, success);
            }
            Ok(()) => self.finish_io(&x.ns, x.kind, x.len, x.req, false),
            Err(e) => self.io_error(&ctrl, &x.ns, x.kind, x.lba, x.req, e),
        }
        self.put_buf(buf);
    }

    /// Another host's Preempt and Abort unregistered this controller's host on `nsid`
    /// (docs/protocol.md, "Preempt and Abort"). Every command of this queue on `nsid`
    /// being processed is requested to abort: compute commands stop at their next check,
    /// writes waiting for their data will not run; the rest (I/O on the backend, short)
    /// completes as it is. Each holds `guard` until it completes (a device operation: until
    /// the storage has finished it, [`Channel::hold`]), so the Reservation Acquire
    /// completes after them. Reservation commands are neither aborted nor waited
    /// for (two Preempt and Abort commands could wait for each other).
    fn abort_commands(&mut self, nsid: u32, guard: AbortGuard) {
        let mut stopped = false;
        for (token, slot) in self.inflight.slots.iter_mut().enumerate() {
            let Some(x) = slot.as_mut().filter(|x| x.ns.nsid == nsid && x.kind != IoKind::Reservation) else { continue };
            if let Some(t) = &x.task {
                // Held by the task until it has ended, not until its completion is taken.
                t.abort(guard.clone());
                stopped = true;
                continue;
            }
            if let Some(f) = &x.fused {
                // Not started: it will not run; running: held until its transaction ends.
                f.abort(guard.clone());
                continue;
            }
            // A device operation: the guard goes with it to whoever runs it, and is
            // dropped when the storage has finished it, even if this connection is gone.
            // Given back, the operation has finished (its completion waits for room in the
            // send buffer): nothing to wait for, as Linux's nvmet, which lets go at
            // nvmet_req_complete, not when the response leaves.
            drop(self.chan.hold(token as u64, guard.clone()));
        }
        if self.queue.as_ref().is_some_and(|q| q.qid > 0) {
            for w in self.waiting.slots.iter_mut().flatten().filter(|w| w.sqe.nsid() == nsid && !io_cmd::is_reservation(w.sqe.opcode())) {
                w.aborted = true;
            }
            for w in self.deferred.iter_mut().filter(|w| w.sqe.nsid() == nsid && !io_cmd::is_reservation(w.sqe.opcode())) {
                w.aborted = true;
            }
            for w in self.parked.iter_mut().filter(|w| w.sqe.nsid() == nsid) {
                w.aborted = true;
            }
            for p in self.pairs.iter_mut().filter(|p| p.nsid() == nsid) {
                p.aborted = true;
            }
        }
        if stopped {
            // Queued ones leave the engine's queue now.
            self.target.offload.kick();
        }
    }

    /// Completes outstanding AERs while events are pending.
    pub fn deliver_events(&mut self) {
        if self.aers.is_empty() {
            return;
        }
        let Some(ctrl) = self.queue.as_ref().map(|q| q.ctrl.clone()) else { return };
        while !self.aers.is_empty() {
            let Some(ev) = ctrl.state.lock().pending_events.pop_front() else { return };
            let req = self.aers.remove(0);
            self.complete(req, Status::SUCCESS, ev, 0);
        }
    }

    /// Detaches the queue from its controller when the connection ends. Losing the admin
    /// queue removes the controller and so closes its I/O queues.
    pub fn detach(&mut self) {
        let Some(q) = self.queue.take() else { return };
        q.ctrl.detach_queue(q.qid);
        if q.qid == 0 {
            info!(peer = %self.peer, cntlid = q.ctrl.cntlid, subnqn = %q.ctrl.subsys.nqn, "controller removed");
            // This controller, not whichever holds its CNTLID now (a Cross-Controller
            // Reset may have removed it and a new Connect taken the number).
            q.ctrl.subsys.remove_this_controller(&q.ctrl);
        } else {
            q.ctrl.state.lock().io_queues.remove(&q.qid);
        }
    }
}

/// Tears the controller down when the host sends nothing for longer than KATO.
fn spawn_keep_alive_watchdog(target: Arc<Target>, ctrl: Arc<Controller>) {
    tokio::spawn(async move {
        loop {
            let kato = ctrl.state.lock().kato_ms as u64;
            let tick = if kato == 0 { 1000 } else { (kato / 4).clamp(50, 1000) };
            tokio::select! {
                biased;
                _ = ctrl.cancel.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_millis(tick)) => {}
            }
            // A host waiting for a long compute command is not idle.
            if ctrl.results.lock().running() > 0 {
                ctrl.touch();
            }
            if kato != 0 && ctrl.idle_ms() > kato {
                // Keyed by host NQN: a host may connect and fall silent over and over.
                let host = ctrl.hostnqn.as_str();
                peer_warn!(target.log_limit, host, "keep-alive timeout: controller torn down", cntlid = ctrl.cntlid, subnqn = %ctrl.subsys.nqn, kato_ms = kato);
                target.stats.controllers_expired.fetch_add(1, Relaxed);
                ctrl.subsys.remove_this_controller(&ctrl);
                return;
            }
        }
    });
}
