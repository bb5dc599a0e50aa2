//! The block-device layer: what a namespace's I/O goes through.
//!
//! A [`BlockDevice`] declares its [`Geometry`] and starts operations on a [`Channel`], the
//! I/O context of one queue (one connection task, as an SPDK io_channel belongs to one
//! thread). An operation carries a caller-provided pooled [`AlignedBuf`] and a tag; its
//! [`Completion`] brings both back. The connection loop submits a batch, then polls the
//! channel without a syscall ([`Channel::poll`]) and parks on [`Channel::wait`] when
//! nothing is ready; sequential users (one request at a time) await [`Channel::run`],
//! built on the same two calls.
//!
//! Where an operation runs is the device's choice: [`local::Local`] completes memory reads
//! and writes inline (and lends memory to the caller for the zero-copy send,
//! [`BlockDevice::read_now`]), puts file and block-device I/O on the channel's io_uring,
//! and hands what is not bounded by MDTS (write zeroes, deallocate) and everything under
//! `io_engine = "threads"` to the worker pool. Devices stack: [`delay::Delay`],
//! [`inject::Inject`], [`rate::Rate`] and [`fair::Fair`] claim the device below them and
//! pass operations on.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;

use nearstore_transport::AlignedBuf;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio_util::sync::CancellationToken;
// The runtime's clock: the real one, except under the simulation's paused runtime, where a
// held-back operation is due in simulated time (crates/sim).
use tokio::time::Instant;
use tracing::warn;

use crate::backend::Backend;
use crate::config::IoEngine;
use crate::io_pool::{IoPool, Job, PoolHolds};
use crate::limits;
use crate::uring::{self, Ring, RingPool, Sub};

pub mod delay;
pub mod fair;
pub mod fence;
pub mod grant;
pub mod inject;
pub mod local;
pub mod rate;
pub mod remote;
pub mod volume;

/// An operation's failure that carries the NVMe status its command completes with (the
/// inner error of an [`io::Error`]); other failures complete reads with Unrecovered Read
/// Error and writes with Write Fault.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct StatusError {
    pub status: nearstore_wire::Status,
    pub message: String,
}

/// An error that completes its command with `status`.
pub fn status_error(status: nearstore_wire::Status, message: String) -> io::Error {
    io::Error::other(StatusError { status, message })
}

/// The status an operation's error asks its command to complete with, if it names one.
pub fn error_status(e: &io::Error) -> Option<nearstore_wire::Status> {
    e.get_ref().and_then(|i| i.downcast_ref::<StatusError>()).map(|s| s.status)
}

/// What a device is, for the namespace above it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Capacity in bytes.
    pub size: u64,
    /// The smallest unit offsets and lengths must be multiples of, in bytes.
    pub block_size: u32,
    /// Alignment data buffers need, in bytes (pooled `AlignedBuf`s are page-aligned).
    pub align: u32,
    /// Operations the device takes at once on one channel before they queue.
    pub queue_depth: u32,
}

/// One operation. The data of a write (and the packed ranges of a deallocate) is the
/// buffer that goes with it; a read fills the buffer's `len()` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read {
        off: u64,
    },
    Write {
        off: u64,
        fua: bool,
    },
    Flush,
    WriteZeroes {
        off: u64,
        len: u64,
        deallocate: bool,
        fua: bool,
    },
    /// Deallocate every (offset, length) byte range packed in the buffer as u64 pairs.
    Deallocate,
}

impl Op {
    /// Work not bounded by the transfer size (MDTS): it never runs on a network thread.
    pub fn unbounded(&self) -> bool {
        matches!(self, Op::WriteZeroes { .. } | Op::Deallocate)
    }
}

/// A finished operation: its tag, its result and its buffer back.
pub struct Completion {
    pub tag: u64,
    pub result: io::Result<()>,
    pub buf: AlignedBuf,
}

/// What [`BlockDevice::quiesce`] waits on.
pub type Quiesce = std::pin::Pin<Box<dyn std::future::Future<Output = io::Result<()>> + Send>>;

/// A block device: storage, or a device stacked on the ones it claims.
pub trait BlockDevice: Send + Sync {
    fn describe(&self) -> String;
    fn geometry(&self) -> Geometry;
    /// Starts `op` on `ch`; its completion comes back from [`Channel::poll`] with `tag` and
    /// `buf`, exactly once, also when it fails.
    fn submit(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64);
    /// Waits until no write this device was given can still change `len` bytes at `off`:
    /// none running (also one whose caller went away), and none whose completion was given
    /// up while it may still land (a peer's write whose connection was lost, that timed out
    /// or was cancelled: dev::remote resets that controller at the peer). None: the
    /// device's operations end with their caller's channel, which drains its ring before it
    /// goes (local storage). A move of an extent waits for it before it copies, and before
    /// it gives up a destination it wrote (docs/control-plane.md, "Moving an extent").
    fn quiesce(&self, off: u64, len: u64) -> Option<Quiesce> {
        let _ = (off, len);
        None
    }
    /// True when [`read_now`](Self::read_now) and [`write_now`](Self::write_now) answer for
    /// every transfer up to MDTS (memory): reads and writes cost about a memcpy and
    /// complete on the caller's task.
    fn completes_now(&self) -> bool {
        false
    }
    /// Reads `len` bytes at `off` at once, lending them to `f` as slices (no copy; memory
    /// lends any length, an offload chunk too), when that costs about a memcpy. None: use [`submit`](Self::submit).
    fn read_now(&self, off: u64, len: usize, f: &mut dyn FnMut(&[&[u8]])) -> Option<io::Result<()>> {
        let _ = (off, len, f);
        None
    }
    /// Checks a read that [`read_now`](Self::read_now) would answer at once, as it would
    /// (range, injected failures), without reading: the caller takes the bytes later with
    /// [`read_lent`](Self::read_lent) (NVMe/TCP sends a batch's large reads in one writev
    /// from the device's memory). None: use [`submit`](Self::submit).
    /// `who`: the tenant the read is for (a fair scheduler charges it).
    fn lend(&self, off: u64, len: usize, who: Option<&fair::Tenant>) -> Option<io::Result<()>> {
        let _ = (off, len, who);
        None
    }
    /// The bytes of a read [`lend`](Self::lend) accepted, lent to `f` as slices without
    /// checking it again. The slices are the device's memory at the time of this call.
    fn read_lent(&self, off: u64, len: usize, f: &mut dyn FnMut(&[&[u8]])) -> io::Result<()> {
        self.read_now(off, len, f).unwrap_or_else(|| Err(io::Error::other(format!("{} lends no bytes", self.describe()))))
    }
    /// True when [`read_blocking`](Self::read_blocking) answers every read: a file or block
    /// device with nothing stacked on it that holds reads back or charges them to a tenant.
    fn reads_blocking(&self) -> bool {
        false
    }
    /// Reads `buf.len()` bytes at `off` on the calling thread, which may block for the
    /// storage (a pread): only for a thread of its own, never a network thread's (the
    /// offload engine's reader, `offload/read.rs`). None: use [`submit`](Self::submit).
    fn read_blocking(&self, off: u64, buf: &mut [u8]) -> Option<io::Result<()>> {
        let _ = (off, buf);
        None
    }
    /// Writes `data` at `off` at once (durably with `fua`), when that costs about a memcpy.
    /// None: use [`submit`](Self::submit).
    /// `who`: the tenant the write is for (a fair scheduler charges it).
    fn write_now(&self, data: &[u8], off: u64, fua: bool, who: Option<&fair::Tenant>) -> Option<io::Result<()>> {
        let _ = (data, off, fua, who);
        None
    }
}

/// The device stack of a namespace from its configuration: the storage, then the
/// error-injecting device, then the delaying one, each claiming the one below.
pub fn stack(base: Arc<dyn BlockDevice>, inject: Option<inject::Rule>, delay_us: u64) -> Arc<dyn BlockDevice> {
    let mut dev = base;
    if let Some(rule) = inject {
        dev = Arc::new(inject::Inject::new(dev, rule));
    }
    if delay_us > 0 {
        dev = Arc::new(delay::Delay::new(dev, std::time::Duration::from_micros(delay_us)));
    }
    dev
}

/// What a namespace's or a pool's configuration asks of its bandwidth: a bandwidth-limited
/// device (tests and experiments) and the fair scheduler over it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sharing {
    /// Bytes per second the rate device serves; None: no rate device.
    pub rate_limit: Option<u64>,
    /// Bytes per second the fair scheduler shares among tenants; None: no scheduler.
    pub fair_bandwidth: Option<u64>,
    /// A written byte's cost against a read one, for the scheduler.
    pub fair_write_cost: f64,
}

/// A device that holds operations back and offers them again when their time comes (the
/// fair scheduler, an arbiter's gate): what [`Again`] calls.
trait Reoffer: BlockDevice {
    /// What it is, for an operation that finds it gone.
    const GONE: &'static str;
    /// Offers again an operation that waited.
    fn reoffer(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64);
}

/// A waiting operation's way back to the device that held it, when its time comes (held
/// weakly: an operation left waiting on a channel keeps no device alive).
struct Again<T>(std::sync::Weak<T>);

impl<T: Reoffer + 'static> BlockDevice for Again<T> {
    fn describe(&self) -> String {
        self.0.upgrade().map_or_else(|| format!("{} (gone)", T::GONE), |d| d.describe())
    }

    fn geometry(&self) -> Geometry {
        self.0.upgrade().map_or(Geometry { size: 0, block_size: 1, align: 1, queue_depth: 1 }, |d| d.geometry())
    }

    fn submit(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64) {
        match self.0.upgrade() {
            Some(d) => d.reoffer(ch, op, buf, tag),
            None => ch.complete(tag, Err(io::Error::other(format!("{} removed", T::GONE))), buf),
        }
    }
}

/// Stacks the rate device and the fair scheduler `sharing` asks for on `dev`.
pub fn share(dev: Arc<dyn BlockDevice>, sharing: Sharing) -> Arc<dyn BlockDevice> {
    let mut dev = dev;
    if let Some(bps) = sharing.rate_limit {
        dev = Arc::new(rate::Rate::new(dev, bps));
    }
    if let Some(bw) = sharing.fair_bandwidth {
        dev = fair::Fair::new(dev, bw, sharing.fair_write_cost);
    }
    dev
}

enum RingState {
    NotYet,
    Ready(Box<Ring>),
    /// io_uring is off (`io_engine = "threads"`) or unavailable here (kernel.io_uring_disabled,
    /// seccomp): devices use the pool.
    Unavailable,
}

/// What an operation holds until the storage has finished it ([`Channel::hold`]): a
/// Preempt and Abort's guard, a writer's range (range_lock.rs).
pub type Held = Box<dyn Send>;

/// An operation on the ring: its buffer is owned here until its completion is reaped, and
/// a short transfer is resubmitted for the rest.
struct RingOp {
    op: Op,
    fd: std::os::fd::RawFd,
    buf: AlignedBuf,
    done: usize,
    tag: u64,
    /// What waits for it ([`Channel::hold`]): dropped once the kernel has finished it
    /// (reaped, or the ring drained when the channel goes).
    held: Vec<Held>,
}

/// An operation a stacked device holds back until `at`, then starts on `dev`.
struct Deferred {
    at: Instant,
    dev: Arc<dyn BlockDevice>,
    op: Op,
    buf: AlignedBuf,
    tag: u64,
    /// What waits for it, handed on to the operation when it starts.
    held: Vec<Held>,
}

/// The I/O context of one queue: its io_uring (made at the first file operation), the
/// completions of operations that finished at once, the reply channel of the worker pool
/// and of any other completer, and the operations stacked devices hold back.
pub struct Channel {
    /// Declared before `ring_ops`: dropping the ring waits for its entries, which point
    /// into buffers that `ring_ops` owns.
    ring: RingState,
    ring_ops: slab::Slab<RingOp>,
    /// Ring completions reaped, reused between polls.
    reaped: Vec<(u64, i32)>,
    /// Ring operations finished while the queue took no completions ([`Channel::settle`]).
    reaped_out: Vec<Completion>,
    ready: VecDeque<Completion>,
    tx: UnboundedSender<Completion>,
    rx: UnboundedReceiver<Completion>,
    /// Sorted by `at`.
    deferred: VecDeque<Deferred>,
    engine: IoEngine,
    pool: IoPool,
    /// Submitted and not yet returned by `poll`.
    outstanding: usize,
    /// Its operations on the worker pool and the guards they hold.
    holds: Arc<PoolHolds>,
    /// Cancelled when its user needs none of the operations still running
    /// ([`cancel`](Self::cancel)).
    cancel: CancellationToken,
    /// Its ring hands every operation to the kernel's workers ([`Channel::punt`]).
    punt: bool,
    /// Where its ring comes from and may go back to ([`Channel::pooled`]).
    rings: Option<Arc<RingPool>>,
    /// Operations of a volume's extents in flight, by tag ([`attach`](Self::attach)):
    /// each ticket is dropped when `poll` returns its completion, or after the ring has
    /// drained when the channel goes (declared after it).
    tickets: Vec<(u64, volume::Ticket)>,
    /// Whom its operations are for, for the fair scheduler ([`fair::Fair`]).
    tenant: Option<Arc<fair::Tenant>>,
    /// The life of the controller whose queue this is ([`Channel::set_life`]): held until
    /// the ring has drained (declared after it), and by each operation on the I/O pool.
    life: Option<Arc<crate::subsystem::Life>>,
}

impl Channel {
    pub fn new(engine: IoEngine, pool: IoPool) -> Channel {
        let (tx, rx) = unbounded_channel();
        Channel {
            ring: RingState::NotYet,
            ring_ops: slab::Slab::new(),
            reaped: Vec::new(),
            reaped_out: Vec::new(),
            ready: VecDeque::new(),
            tx,
            rx,
            deferred: VecDeque::new(),
            engine,
            pool,
            outstanding: 0,
            holds: Arc::default(),
            cancel: CancellationToken::new(),
            punt: false,
            rings: None,
            tickets: Vec::new(),
            tenant: None,
            life: None,
        }
    }

    /// Holds `life` (its controller's) while this channel or any operation it put on the
    /// I/O pool may still change storage: what a Cross-Controller Reset waits for.
    pub fn set_life(&mut self, life: Option<Arc<crate::subsystem::Life>>) {
        self.life = life;
    }

    /// Takes its io_uring from `rings` (an idle one, or a new one counted there), so that
    /// [`recycle`](Self::recycle) can give it back for another user on the same runtime.
    pub fn pooled(mut self, rings: Arc<RingPool>) -> Channel {
        self.rings = Some(rings);
        self
    }

    /// Gives its io_uring back to its pool when nothing is outstanding on it (every
    /// completion returned by `poll`); the channel makes or takes another if used again.
    /// Returns whether the ring went back.
    pub fn recycle(&mut self) -> bool {
        let Some(rings) = &self.rings else { return false };
        if self.busy() || !self.ring_ops.is_empty() {
            return false;
        }
        match std::mem::replace(&mut self.ring, RingState::NotYet) {
            RingState::Ready(ring) => rings.give(ring),
            other => {
                self.ring = other;
                false
            }
        }
    }

    /// Charges this channel's operations to `tenant` in fair-scheduled devices.
    pub fn set_tenant(&mut self, tenant: Arc<fair::Tenant>) {
        self.tenant = Some(tenant);
    }

    /// Whom this channel's operations are for; None: the target's own work.
    pub fn tenant(&self) -> Option<&fair::Tenant> {
        self.tenant.as_deref()
    }

    /// Charges this channel's operations to whom `other`'s are for: a channel that works
    /// for another's operation (a volume's slow path) is that operation's tenant's.
    pub fn same_tenant(mut self, other: Option<Arc<fair::Tenant>>) -> Channel {
        self.tenant = other;
        self
    }

    /// Whom this channel's operations are for, to hand on ([`same_tenant`](Self::same_tenant)).
    pub fn tenant_shared(&self) -> Option<Arc<fair::Tenant>> {
        self.tenant.clone()
    }

    /// The life this channel holds, to hand on to work done for its operations elsewhere
    /// (a volume's slow path, a peer's operation task): see [`set_life`](Self::set_life).
    pub fn life_shared(&self) -> Option<Arc<crate::subsystem::Life>> {
        self.life.clone()
    }

    /// Hands every ring operation to the kernel's io-wq workers (IOSQE_ASYNC) instead of
    /// trying it inside the submit: for a channel on a network thread whose operations
    /// are large (the offload engine's chunks), so that a page-cache hit is copied on a
    /// kernel thread, not on the network thread.
    pub fn punt(mut self) -> Channel {
        self.punt = true;
        self
    }

    /// Says that no operation still running is needed: devices that can stop one early
    /// (a peer's, whose task owns its buffer) complete it at once as cancelled. Each still
    /// completes exactly once.
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Cancelled by [`cancel`](Self::cancel): for devices that complete off this task.
    pub fn cancellation(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// True while operations are started or held back whose completions `poll` has not
    /// returned yet: then [`wait`](Self::wait) has something to wait for.
    pub fn busy(&self) -> bool {
        self.outstanding > 0 || !self.deferred.is_empty()
    }

    /// Bytes this channel holds besides the operations' buffers: its io_uring.
    pub fn memory_bytes(&self) -> usize {
        if let RingState::Ready(_) = self.ring {
            limits::RING_BYTES
        } else {
            0
        }
    }

    // For devices.

    /// Completes an operation that finished (or failed) at once.
    pub fn complete(&mut self, tag: u64, result: io::Result<()>, buf: AlignedBuf) {
        self.outstanding += 1;
        self.ready.push_back(Completion { tag, result, buf });
    }

    /// A sender for completers off this task (worker threads, other tasks): each
    /// operation started through it must send exactly one completion, and is counted
    /// as started by [`started_elsewhere`](Self::started_elsewhere).
    pub fn sender(&self) -> UnboundedSender<Completion> {
        self.tx.clone()
    }

    /// Keeps `ticket` until the operation `tag` completes: what an extent's move waits for
    /// (docs/control-plane.md, "Moving an extent").
    pub fn attach(&mut self, tag: u64, ticket: volume::Ticket) {
        self.tickets.push((tag, ticket));
    }

    /// Counts an operation whose completion will come through [`sender`](Self::sender).
    pub fn started_elsewhere(&mut self) {
        self.outstanding += 1;
    }

    /// Runs `op` on the worker pool, synchronously on `backend`.
    pub fn pool(&mut self, backend: Arc<dyn Backend>, op: Op, buf: AlignedBuf, tag: u64) {
        self.outstanding += 1;
        self.holds.started(tag);
        self.pool.submit(Job {
            backend,
            op,
            buf,
            token: tag,
            reply: self.tx.clone(),
            holds: Some(self.holds.clone()),
            life: self.life.clone(),
        });
    }

    /// Queues a read, write or flush of `fd` on this queue's io_uring. Gives the operation
    /// back when there is no ring (`io_engine = "threads"`, or io_uring unavailable).
    pub fn ring(&mut self, fd: std::os::fd::RawFd, op: Op, buf: AlignedBuf, tag: u64) -> Result<(), (Op, AlignedBuf)> {
        if !matches!(op, Op::Read { .. } | Op::Write { .. } | Op::Flush) || !self.ring_ready() {
            return Err((op, buf));
        }
        self.outstanding += 1;
        let slot = self.ring_ops.insert(RingOp { op, fd, buf, done: 0, tag, held: Vec::new() });
        self.push_ring(slot);
        Ok(())
    }

    /// Starts `op` on `dev` once `at` has passed.
    pub fn defer(&mut self, at: Instant, dev: Arc<dyn BlockDevice>, op: Op, buf: AlignedBuf, tag: u64) {
        let i = self.deferred.partition_point(|d| d.at <= at);
        self.deferred.insert(i, Deferred { at, dev, op, buf, tag, held: Vec::new() });
    }

    // For the queue.

    /// Holds `guard` (another host's Preempt and Abort's, a writer's range) with the
    /// operation `tag` until the storage has finished it: on the ring until reaped (or drained when the channel goes),
    /// on the worker pool until the worker has run it, held back by a stacked device until
    /// it has started and then finished. The guard outlives the connection, so a command
    /// whose connection closed still holds the Acquire (or its blocks from a Compare and
    /// Write) while the storage runs it (docs/protocol.md, "Preempt and Abort"). Gives the guard back when the operation is
    /// not running (finished, its completion not yet taken) or runs elsewhere (a remote
    /// device's task): the caller then holds it until it takes the completion.
    pub fn hold<G: Send + 'static>(&mut self, tag: u64, guard: G) -> Option<G> {
        if let Some((_, r)) = self.ring_ops.iter_mut().find(|(_, r)| r.tag == tag) {
            r.held.push(Box::new(guard));
            return None;
        }
        if let Some(d) = self.deferred.iter_mut().find(|d| d.tag == tag) {
            d.held.push(Box::new(guard));
            return None;
        }
        self.holds.hold(tag, guard)
    }

    /// True while an operation on the ring or held back holds something (a Preempt and
    /// Abort's guard, a writer's range): then [`wait_holding`](Self::wait_holding) and [`settle`](Self::settle) release it
    /// when the storage has finished, even while the queue takes no completions.
    pub fn holding(&self) -> bool {
        self.ring_ops.iter().any(|(_, r)| !r.held.is_empty()) || self.deferred.iter().any(|d| !d.held.is_empty())
    }

    /// Resolves when a ring operation may have finished or a held-back one is due,
    /// ignoring completions already taken from the ring (which [`wait`](Self::wait) returns
    /// at once for). Cancel-safe.
    pub async fn wait_holding(&mut self) -> io::Result<()> {
        let ring = match &self.ring {
            RingState::Ready(r) if r.in_flight() > 0 => Some(r.waker()),
            _ => None,
        };
        let due = self.deferred.front().map(|d| d.at);
        tokio::select! {
            biased;
            r = async { uring::wait(ring.as_ref().expect("guarded")).await }, if ring.is_some() => r,
            _ = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() => Ok(()),
            _ = std::future::pending::<()>(), if ring.is_none() && due.is_none() => Ok(()),
        }
    }

    /// Starts the held-back operations that are due and moves the ring's finished
    /// operations to the completions [`poll`](Self::poll) returns, releasing the guards
    /// they held: for a queue whose send buffer is full (a host that stopped reading),
    /// whose completions wait, while the storage is done with them.
    pub fn settle(&mut self) {
        self.submit();
        let mut out = std::mem::take(&mut self.reaped_out);
        while self.reap_ring(limits::REAP_BATCH, &mut out) > 0 {}
        self.ready.extend(out.drain(..));
        self.reaped_out = out;
    }

    /// Starts the held-back operations that are due and hands the ring's queued entries
    /// to the kernel (one syscall for a batch; none when nothing is queued).
    pub fn submit(&mut self) {
        self.start_due();
        if let RingState::Ready(ring) = &mut self.ring {
            if let Err(e) = ring.submit() {
                warn!("io_uring submit: {e}");
            }
        }
    }

    /// Submits ([`submit`](Self::submit)) and moves up to `max` completions into `out`;
    /// no syscall besides the ring's submit. Returns how many.
    pub fn poll(&mut self, max: usize, out: &mut Vec<Completion>) -> usize {
        self.submit();
        let start = out.len();
        let mut n = 0;
        while n < max {
            let Some(c) = self.ready.pop_front() else { break };
            out.push(c);
            n += 1;
        }
        n += self.reap_ring(max - n, out);
        while n < max {
            let Ok(c) = self.rx.try_recv() else { break };
            out.push(c);
            n += 1;
        }
        self.outstanding -= n;
        if !self.tickets.is_empty() {
            for c in &out[start..] {
                if let Some(i) = self.tickets.iter().position(|(t, _)| *t == c.tag) {
                    self.tickets.swap_remove(i);
                }
            }
        }
        n
    }

    /// True when `poll` would return a completion now: the ring's wake-up may already
    /// have been consumed by a wait while the caller could not take them.
    pub fn has_completions(&mut self) -> bool {
        let ring = match &mut self.ring {
            RingState::Ready(r) => r.has_completions(),
            _ => false,
        };
        ring || !self.ready.is_empty() || !self.rx.is_empty() || self.deferred.front().is_some_and(|d| d.at <= Instant::now())
    }

    /// Resolves when a completion may be ready (the ring's eventfd, a completion sent
    /// from elsewhere, a deferred operation due). Cancel-safe.
    pub async fn wait(&mut self) -> io::Result<()> {
        if !self.ready.is_empty() {
            return Ok(());
        }
        let ring = match &self.ring {
            RingState::Ready(r) if r.in_flight() > 0 => Some(r.waker()),
            _ => None,
        };
        let due = self.deferred.front().map(|d| d.at);
        // Biased, as the connection loop: a seed replays a simulated run (crates/sim).
        tokio::select! {
            biased;
            r = async { uring::wait(ring.as_ref().expect("guarded")).await }, if ring.is_some() => r,
            c = self.rx.recv() => {
                // The channel holds its own sender, so recv never ends.
                if let Some(c) = c {
                    self.ready.push_back(c);
                }
                Ok(())
            }
            _ = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() => Ok(()),
        }
    }

    /// Runs one operation and waits for it: the completion by future, for users with one
    /// operation at a time on this channel (an operation already outstanding fails it).
    pub async fn run(&mut self, dev: &dyn BlockDevice, op: Op, buf: AlignedBuf) -> Completion {
        const TAG: u64 = u64::MAX;
        if self.busy() {
            return Completion { tag: TAG, result: Err(io::Error::other("channel busy: run takes one operation at a time")), buf };
        }
        dev.submit(self, op, buf, TAG);
        let mut out = Vec::with_capacity(1);
        loop {
            if self.poll(1, &mut out) > 0 {
                if let Some(c) = out.pop() {
                    return c;
                }
            }
            if let Err(e) = self.wait().await {
                warn!("waiting for a device completion: {e}");
            }
        }
    }

    fn start_due(&mut self) {
        while self.deferred.front().is_some_and(|d| d.at <= Instant::now()) {
            let d = self.deferred.pop_front().expect("checked");
            d.dev.submit(self, d.op, d.buf, d.tag);
            for g in d.held {
                // Given back: it completed at once (or runs on a remote device's task,
                // which nothing stacks a delay on); nothing is left to wait for.
                drop(self.hold(d.tag, g));
            }
        }
    }

    /// True once this channel has an io_uring; makes one the first time.
    fn ring_ready(&mut self) -> bool {
        if let RingState::NotYet = self.ring {
            if self.engine == IoEngine::Threads {
                self.ring = RingState::Unavailable;
                return false;
            }
            let entries = limits::QUEUE_DEPTH_MAX as u32;
            let made = match &self.rings {
                Some(rings) => rings.take(entries),
                None => Ring::new(entries).map(Box::new),
            };
            self.ring = match made {
                Ok(mut r) => {
                    r.set_punt(self.punt);
                    RingState::Ready(r)
                }
                Err(e) => {
                    // Once per process: it is the machine's setting, and a host reconnecting
                    // in a loop would repeat it.
                    static WARNED: std::sync::Once = std::sync::Once::new();
                    WARNED.call_once(|| warn!("io_uring unavailable, file I/O goes to the worker pool: {e}"));
                    RingState::Unavailable
                }
            };
        }
        matches!(self.ring, RingState::Ready(_))
    }

    /// Queues (the rest of) the ring operation in `slot`.
    fn push_ring(&mut self, slot: usize) {
        let (RingState::Ready(ring), Some(r)) = (&mut self.ring, self.ring_ops.get_mut(slot)) else {
            return;
        };
        let (fd, done) = (r.fd, r.done);
        let rest = (r.buf.len() - done) as u32;
        let sub = match r.op {
            Op::Read { off } => Sub::Read { fd, buf: r.buf[done..].as_mut_ptr(), len: rest, off: off + done as u64 },
            Op::Write { off, fua } => Sub::Write { fd, buf: r.buf[done..].as_ptr(), len: rest, off: off + done as u64, dsync: fua },
            _ => Sub::Fdatasync { fd },
        };
        // SAFETY: the buffer is owned by the slot, which is removed only after this entry's
        // completion is reaped (reap_ring), or after the ring has drained (the ring field is
        // dropped before the slots).
        if let Err(e) = unsafe { ring.push(sub, slot as u64) } {
            self.reaped.push((slot as u64, -e.raw_os_error().unwrap_or(libc::EIO)));
        }
    }

    /// Moves up to `max` finished ring operations into `out`.
    fn reap_ring(&mut self, max: usize, out: &mut Vec<Completion>) -> usize {
        let mut n = 0;
        while n < max {
            if self.reaped.is_empty() {
                let RingState::Ready(ring) = &mut self.ring else { break };
                let reaped = &mut self.reaped;
                if ring.reap(max - n, |slot, res| reaped.push((slot, res))) == 0 {
                    break;
                }
            }
            while let Some((slot, res)) = self.reaped.pop() {
                let slot = slot as usize;
                let Some(r) = self.ring_ops.get_mut(slot) else { continue };
                let result = match res {
                    e if e < 0 => Err(io::Error::from_raw_os_error(-e)),
                    0 if !matches!(r.op, Op::Flush) => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "zero-length transfer")),
                    k => {
                        r.done += k as usize;
                        if r.done < r.buf.len() && !matches!(r.op, Op::Flush) {
                            self.push_ring(slot);
                            continue;
                        }
                        Ok(())
                    }
                };
                let r = self.ring_ops.remove(slot);
                out.push(Completion { tag: r.tag, result, buf: r.buf });
                n += 1;
            }
        }
        n
    }
}

#[cfg(test)]
mod tests;

/// The completion of an operation a device runs as a task of its own (a peer's, a volume's
/// slow path), sent exactly once: with its result, or as cancelled when the task ends
/// without one (cancelled, panicked, or dropped with its runtime), so the channel never
/// waits for an operation nobody runs.
pub(crate) struct Reply {
    tx: UnboundedSender<Completion>,
    tag: u64,
    buf: Option<AlignedBuf>,
    /// The device, for the error of a cancelled operation.
    name: String,
    cancelled: fn(&str) -> io::Error,
}

impl Reply {
    pub(crate) fn new(tx: UnboundedSender<Completion>, tag: u64, buf: AlignedBuf, name: String, cancelled: fn(&str) -> io::Error) -> Reply {
        Reply { tx, tag, buf: Some(buf), name, cancelled }
    }

    /// The operation's buffer, held until the reply is sent.
    pub(crate) fn buf(&mut self) -> &mut AlignedBuf {
        self.buf.as_mut().expect("held until sent")
    }

    pub(crate) fn send(mut self, result: io::Result<()>) {
        if let Some(buf) = self.buf.take() {
            // The channel holds its own receiver; a channel dropped meanwhile needs nothing.
            let _ = self.tx.send(Completion { tag: self.tag, result, buf });
        }
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            let e = (self.cancelled)(&self.name);
            let _ = self.tx.send(Completion { tag: self.tag, result: Err(e), buf });
        }
    }
}
