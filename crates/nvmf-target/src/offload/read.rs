//! How a compute command reads its inputs: through the block-device layer, with bounded
//! read-ahead and no thread per input.
//!
//! The command's thread (the kernels are CPU work and stay off the network threads)
//! starts one I/O task on the network runtime ([`Io::start`]); the task owns a device
//! [`Channel`], first opens the command's peers as [`Remote`](crate::dev::remote::Remote)
//! devices acting for its host (each admits the host before a byte is read), then starts
//! the reads the thread sends it on the namespace's device stack or a peer's device and
//! sends their completions back. Each input keeps up to `compute.readahead + 1` chunk
//! buffers (the one the operation holds among them), so up to `readahead` reads in flight
//! while the operation computes, of a peer too (within `cluster.read_ahead_bytes` of
//! chunks; each read is itself pipelined on its connection). A device takes at most its
//! declared queue depth of a command's operations at once, and a command at most
//! [`limits::COMPUTE_OPS_IN_FLIGHT_MAX`]; the rest wait on the command's side.
//!
//! The namespace's own device, when it needs no channel to read (memory, which lends its
//! bytes at once; a file or block device with nothing stacked on it, read with a pread),
//! is read without the I/O task: a hand-off to the network thread and back per chunk cost
//! more than the read (docs/benchmarks.md, "Issue 14, session 13"). With a core to spare
//! ([`IoContext::reader`]) the command's reader thread, one per command, reads its chunks
//! ahead while the command computes, within the same read-ahead and queue depths; on one
//! core the command's thread reads them itself, as there is nothing to overlap. The
//! outputs are written through the stack and the I/O task (`offload::NsSink`).
//!
//! Every read is waited for before the command ends, whatever stops it (its end, an error,
//! cancellation, the deadline): a device operation completes exactly once with its
//! buffer back, and none is left running when the host sees the completion.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use nearstore_compute::{ComputeError, Source};
use nearstore_transport::AlignedBuf;
use nearstore_wire::compute::{global, status as cs, Extent, Object};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{ComputeStats, Failure, Limits};
use crate::cluster::{PeerError, Peers};
use crate::config::IoEngine;
use crate::dev::{fair, BlockDevice, Channel, Completion, Op};
use crate::io_pool::IoPool;
use crate::limits;
use crate::uring::RingPool;

/// Where the engine's I/O runs: the target's network runtime, its device settings, and the
/// io_urings of ended commands kept for the next ([`RingPool`]: they belong to `rt`).
#[derive(Clone)]
pub struct IoContext {
    pub rt: tokio::runtime::Handle,
    pub engine: IoEngine,
    pub pool: IoPool,
    pub rings: Arc<RingPool>,
    /// Whom the command's reads and writes are charged to in fair-scheduled devices: its
    /// controller's tenant (None: the target's own work, as a benchmark's).
    pub tenant: Option<Arc<fair::Tenant>>,
    /// A command reads its namespace's memory or plain file ahead on a reader thread of its
    /// own, to copy there while it computes: true when the process may run on more than
    /// one core ([`spare_core`]); else its own thread reads.
    pub reader: bool,
}

/// True when this process may run on more than one core (its affinity and cgroup quota):
/// then a reader thread can copy while a command computes. Asked once.
pub fn spare_core() -> bool {
    static SPARE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SPARE.get_or_init(|| std::thread::available_parallelism().is_ok_and(|n| n.get() > 1))
}

impl IoContext {
    /// With a pool of at most [`limits::COMPUTE_RINGS_IDLE_MAX`] idle rings of its own.
    pub fn new(rt: tokio::runtime::Handle, engine: IoEngine, pool: IoPool) -> IoContext {
        let rings = Arc::new(RingPool::new(limits::COMPUTE_RINGS_IDLE_MAX));
        IoContext { rt, engine, pool, rings, tenant: None, reader: spare_core() }
    }
}

/// What the command's thread asks its I/O task (or its reader thread) to start.
struct Start {
    dev: Arc<dyn BlockDevice>,
    op: Op,
    buf: AlignedBuf,
    tag: u64,
    /// A read of a device that needs no channel ([`reads_here`]), for the reader thread.
    here: bool,
}

/// The devices of a command's peers, by tag.
pub(super) type Remotes = HashMap<u16, Arc<dyn BlockDevice>>;

/// What the I/O task sends back.
enum Event {
    /// The peers, opened for the command's host; or the first that refused.
    Opened(Result<Remotes, PeerError>),
    Done(Completion),
}

/// The I/O task of one command: opens `tags` of `peers` for `host`, then starts what comes
/// on `rx` until the command closes it and every operation has completed; then its ring
/// goes back to the pool, unless the command was cancelled (its connection closed, or the
/// target stops): what a cancellation tore down is not handed to the next command.
async fn serve(
    mut rx: UnboundedReceiver<Start>,
    tx: Sender<Event>,
    mut ch: Channel,
    (peers, tags, host): (Arc<Peers>, Vec<u16>, String),
    cancel: CancellationToken,
) {
    let mut opened = Remotes::with_capacity(tags.len());
    let mut refused = None;
    for tag in tags {
        match peers.remote(tag, &host).await {
            Ok(d) => {
                opened.insert(tag, Arc::new(d) as Arc<dyn BlockDevice>);
            }
            Err(e) => {
                refused = Some(e);
                break;
            }
        }
    }
    let _ = tx.send(Event::Opened(refused.map_or(Ok(opened), Err)));
    let mut open = true;
    let mut out = Vec::with_capacity(limits::REAP_BATCH);
    loop {
        while ch.poll(limits::REAP_BATCH, &mut out) > 0 {
            for c in out.drain(..) {
                // The command's thread waits for each one; gone, it needs nothing.
                let _ = tx.send(Event::Done(c));
            }
        }
        if !open && !ch.busy() {
            if !cancel.is_cancelled() {
                ch.recycle();
            }
            return;
        }
        tokio::select! {
            biased;
            s = rx.recv(), if open => match s {
                Some(s) => s.dev.submit(&mut ch, s.op, s.buf, s.tag),
                None => {
                    // The command ends: it needs none of the reads still running.
                    open = false;
                    ch.cancel();
                }
            },
            r = ch.wait(), if ch.busy() => {
                if let Err(e) = r {
                    warn!("offload engine: waiting for a device completion: {e}");
                }
            }
        }
    }
}

/// True when `dev` reads on the calling thread, without a channel: memory lent at once, or
/// a file or block device's pread.
pub(super) fn reads_here(dev: &dyn BlockDevice) -> bool {
    dev.completes_now() || dev.reads_blocking()
}

/// Reads `buf.len()` bytes of `dev` at `off` on this thread (a device [`reads_here`]).
pub(super) fn read_here(dev: &dyn BlockDevice, off: u64, buf: &mut [u8]) -> std::io::Result<()> {
    if dev.completes_now() {
        let mut at = 0;
        let r = dev.read_now(off, buf.len(), &mut |slices| {
            for s in slices {
                buf[at..at + s.len()].copy_from_slice(s);
                at += s.len();
            }
        });
        if let Some(r) = r {
            return r;
        }
    }
    dev.read_blocking(off, buf).unwrap_or_else(|| Err(std::io::Error::other(format!("{} reads only through a channel", dev.describe()))))
}

/// The reader thread of one command: reads what comes on `rx`, in order, and sends each
/// completion back, until the command closes `rx`. Once the command is cancelled it reads
/// no more: what is left completes as cancelled.
fn reader(rx: Receiver<Start>, tx: Sender<Event>, cancel: CancellationToken) {
    for Start { dev, op, mut buf, tag, .. } in rx {
        let result = match op {
            _ if cancel.is_cancelled() => Err(std::io::Error::new(std::io::ErrorKind::Interrupted, "the command was cancelled")),
            Op::Read { off } => read_here(&*dev, off, &mut buf),
            _ => Err(std::io::Error::other("the offload engine's reader only reads")),
        };
        // The command waits for each one; gone, it needs nothing.
        let _ = tx.send(Event::Done(Completion { tag, result, buf }));
    }
}

/// The command's side of its I/O: operations started and not yet completed, operations
/// waiting for room on their device, completions that arrived for another input than the
/// one waiting.
///
/// A device takes at most its declared queue depth of the command's operations at once,
/// and the command at most [`limits::COMPUTE_OPS_IN_FLIGHT_MAX`] on all its devices
/// together (its channel's ring holds that many): more wait here, in order, and start as
/// others complete.
pub(super) struct Io<'a> {
    tx: Option<UnboundedSender<Start>>,
    rx: Receiver<Event>,
    /// The reader thread's requests, once it is started ([`IoContext::reader`]).
    here: Option<crossbeam_channel::Sender<Start>>,
    /// For the reader thread's completions, until the command ends; None: no reader.
    events: Option<Sender<Event>>,
    cancel: CancellationToken,
    outstanding: usize,
    arrived: HashMap<u64, Completion>,
    next_tag: u64,
    stats: &'a ComputeStats,
    /// Per device (by address): operations started on it and the most it takes.
    slots: HashMap<usize, (u32, u32)>,
    /// Started operations by tag: their device and whether a read.
    started: HashMap<u64, (usize, bool)>,
    queued: VecDeque<(usize, Start)>,
}

/// A device's key among the command's.
fn key(dev: &Arc<dyn BlockDevice>) -> usize {
    Arc::as_ptr(dev) as *const () as usize
}

impl<'a> Io<'a> {
    /// Starts the command's I/O task and opens its peers (`tags`) for `host`, waiting at
    /// most as the command's limits allow: the devices by tag, or why not.
    pub(super) fn start(
        ctx: &IoContext,
        peers: &Arc<Peers>,
        tags: Vec<u16>,
        host: &str,
        stats: &'a ComputeStats,
        limits: &Limits,
    ) -> Result<(Io<'a>, Remotes), Failure> {
        let (tx, rx_start) = unbounded_channel();
        let (tx_event, rx) = crossbeam_channel::unbounded();
        // Chunks are large: a page-cache hit is copied on a kernel worker, not inside the
        // submit on the network thread.
        let ch = Channel::new(ctx.engine, ctx.pool.clone()).punt().pooled(ctx.rings.clone()).same_tenant(ctx.tenant.clone());
        let who = (peers.clone(), tags, host.to_string());
        let events = ctx.reader.then(|| tx_event.clone());
        ctx.rt.spawn(serve(rx_start, tx_event, ch, who, limits.cancel.clone()));
        let io = Io {
            tx: Some(tx),
            rx,
            here: None,
            events,
            cancel: limits.cancel.clone(),
            outstanding: 0,
            arrived: HashMap::new(),
            next_tag: 0,
            stats,
            slots: HashMap::new(),
            started: HashMap::new(),
            queued: VecDeque::new(),
        };
        loop {
            limits.check()?;
            match io.rx.recv_timeout(Duration::from_millis(100)) {
                Ok(Event::Opened(Ok(devs))) => return Ok((io, devs)),
                Ok(Event::Opened(Err(e))) => return Err(Failure::new(e.status, e.message)),
                Ok(Event::Done(_)) => unreachable!("no operation is started before the peers are open"),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Failure::new(
                        nearstore_wire::Status::INTERNAL_ERROR,
                        "the offload engine's I/O task ended (the target stops)",
                    ))
                }
            }
        }
    }

    /// Starts `op` on `dev`, or queues it until the device and the command have room:
    /// its tag.
    pub(super) fn submit(&mut self, dev: &Arc<dyn BlockDevice>, op: Op, buf: AlignedBuf) -> Result<u64, ComputeError> {
        self.queue(dev, op, buf, false)
    }

    /// True when reads of a device that [`reads_here`] go to the command's reader thread
    /// ([`submit_here`](Self::submit_here)); else the command's thread reads them itself.
    pub(super) fn reads_ahead_here(&self) -> bool {
        self.events.is_some()
    }

    /// Starts a read of `dev` (one that [`reads_here`]) at `off` on the command's reader
    /// thread, or queues it as [`submit`](Self::submit) does: its tag.
    pub(super) fn submit_here(&mut self, dev: &Arc<dyn BlockDevice>, off: u64, buf: AlignedBuf) -> Result<u64, ComputeError> {
        self.queue(dev, Op::Read { off }, buf, true)
    }

    fn queue(&mut self, dev: &Arc<dyn BlockDevice>, op: Op, buf: AlignedBuf, here: bool) -> Result<u64, ComputeError> {
        let tag = self.next_tag;
        self.next_tag += 1;
        let k = key(dev);
        self.slots.entry(k).or_insert_with(|| (0, dev.geometry().queue_depth.max(1)));
        self.queued.push_back((k, Start { dev: dev.clone(), op, buf, tag, here }));
        self.pump()?;
        Ok(tag)
    }

    /// The reader thread's requests: started at the first.
    fn reader(&mut self) -> Result<&crossbeam_channel::Sender<Start>, ComputeError> {
        if self.here.is_none() {
            let events = self.events.clone().ok_or(ComputeError::Cancelled)?;
            let (tx, rx) = crossbeam_channel::unbounded();
            let cancel = self.cancel.clone();
            std::thread::Builder::new()
                .name("nearstore-read".into())
                .spawn(move || reader(rx, events, cancel))
                .map_err(|e| ComputeError::Io(format!("starting the command's reader thread: {e}")))?;
            self.here = Some(tx);
        }
        Ok(self.here.as_ref().expect("started"))
    }

    /// Starts the queued operations whose device has room, in order, while the command
    /// has room.
    fn pump(&mut self) -> Result<(), ComputeError> {
        let mut i = 0;
        while i < self.queued.len() && self.outstanding < limits::COMPUTE_OPS_IN_FLIGHT_MAX {
            let k = self.queued[i].0;
            let room = self.slots.get(&k).is_some_and(|&(busy, max)| busy < max);
            if !room {
                i += 1;
                continue;
            }
            let Some((_, s)) = self.queued.remove(i) else { break };
            let read = matches!(s.op, Op::Read { .. });
            let tag = s.tag;
            if s.here {
                self.reader()?.send(s).map_err(|_| ComputeError::Io("the offload engine's reader thread ended".into()))?;
            } else {
                let tx = self.tx.as_ref().ok_or(ComputeError::Cancelled)?;
                tx.send(s).map_err(|_| ComputeError::Io("the offload engine's I/O task ended (the target stops)".into()))?;
            }
            if let Some(slot) = self.slots.get_mut(&k) {
                slot.0 += 1;
            }
            self.started.insert(tag, (k, read));
            self.outstanding += 1;
            if read {
                self.stats.reads_in_flight.fetch_add(1, Relaxed);
            }
        }
        Ok(())
    }

    /// The completion of `tag` if it arrives within `wait`.
    pub(super) fn take(&mut self, tag: u64, wait: Duration) -> Result<Option<Completion>, ComputeError> {
        if let Some(c) = self.arrived.remove(&tag) {
            return Ok(Some(c));
        }
        loop {
            match self.rx.recv_timeout(wait) {
                Ok(Event::Done(c)) => {
                    self.completed(c.tag);
                    self.pump()?;
                    if c.tag == tag {
                        return Ok(Some(c));
                    }
                    self.arrived.insert(c.tag, c);
                }
                Ok(Event::Opened(_)) => continue,
                Err(RecvTimeoutError::Timeout) => return Ok(None),
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(ComputeError::Io("the offload engine's I/O task ended (the target stops)".into()))
                }
            }
        }
    }

    fn completed(&mut self, tag: u64) {
        let Some((k, read)) = self.started.remove(&tag) else { return };
        if let Some(slot) = self.slots.get_mut(&k) {
            slot.0 -= 1;
        }
        self.outstanding -= 1;
        if read {
            self.stats.reads_in_flight.fetch_sub(1, Relaxed);
        }
    }
}

impl Drop for Io<'_> {
    /// Drops the operations not started, cancels every one still running and waits for
    /// them (their buffers come back and are dropped), then for the I/O task to end (its
    /// ring back in the pool before the next command), at most
    /// [`limits::COMPUTE_READ_DRAIN_SECS`] in all.
    fn drop(&mut self) {
        self.queued.clear();
        self.tx = None;
        // The reader ends after the reads it has (each completes, as cancelled once the
        // command is), and drops its sender.
        self.here = None;
        self.events = None;
        let until = std::time::Instant::now() + Duration::from_secs(limits::COMPUTE_READ_DRAIN_SECS);
        while self.outstanding > 0 {
            match self.rx.recv_deadline(until) {
                Ok(Event::Done(c)) => self.completed(c.tag),
                Ok(Event::Opened(_)) => continue,
                Err(e) => {
                    if e == RecvTimeoutError::Timeout {
                        // The I/O task keeps their buffers until they complete.
                        warn!(
                            "offload engine: {} device operations did not complete within {} s of the command's end; it ends without them",
                            self.outstanding,
                            limits::COMPUTE_READ_DRAIN_SECS
                        );
                    }
                    // Else the runtime is gone (the target stops): nothing will complete.
                    let reads = self.started.values().filter(|(_, read)| *read).count();
                    self.stats.reads_in_flight.fetch_sub(reads as u64, Relaxed);
                    self.started.clear();
                    self.outstanding = 0;
                }
            }
        }
        // The task and the reader drop their senders as they end.
        while let Ok(Event::Opened(_) | Event::Done(_)) = self.rx.recv_deadline(until) {}
    }
}

/// A chunk on its way to the operation.
enum Pending {
    Ready(AlignedBuf),
    /// A device read: its tag, the bytes of it that belong to the object (the last piece
    /// is cut short of its block), the peer's tag for a peer.
    Reading {
        tag: u64,
        take: usize,
        peer: Option<u16>,
        off: u64,
    },
}

/// What the inputs of one command share: its I/O, its devices, and the first peer failure
/// (the status the command fails with, whatever the operation makes of the read error).
pub(super) struct Shared<'a> {
    pub io: RefCell<Io<'a>>,
    pub local: Arc<dyn BlockDevice>,
    /// The namespace's range locks: an output write holds its blocks shared against
    /// Compare and Write (range_lock.rs).
    pub ranges: Arc<crate::range_lock::RangeLocks>,
    pub block: u64,
    pub remotes: Remotes,
    pub peers: &'a Peers,
    pub peer_failure: RefCell<Option<Failure>>,
}

impl Shared<'_> {
    /// Reads of a peer one input may have in flight: its read-ahead, within
    /// `cluster.read_ahead_bytes` of chunks (at least one).
    fn peer_reads_max(&self, chunk: usize, depth: usize) -> usize {
        let by_bytes = self.peers.read_ahead_bytes() / chunk.max(1) as u64;
        (depth as u64).min(by_bytes).max(1) as usize
    }
}

impl Shared<'_> {
    fn peer_failed(&self, tag: u16, message: String) -> ComputeError {
        let mut f = self.peer_failure.borrow_mut();
        if f.is_none() {
            self.peers.count_failure(tag);
            *f = Some(Failure::new(cs::PEER_FAILED, message.clone()));
        }
        ComputeError::Io(message)
    }
}

/// An input object, read ahead through the devices.
pub(super) struct NsSource<'s, 'a> {
    len: u64,
    pieces: VecDeque<Extent>,
    queue: VecDeque<Pending>,
    /// Buffers not in use. With those queued and the current one, at most `depth`.
    free: Vec<AlignedBuf>,
    depth: usize,
    chunk: usize,
    current: Option<AlignedBuf>,
    /// Reads of a peer in flight (their completions not yet taken), at most
    /// [`Shared::peer_reads_max`].
    peer_reads: usize,
    shared: &'s Shared<'a>,
    limits: &'s Limits<'s>,
    pub read: u64,
}

impl<'s, 'a> NsSource<'s, 'a> {
    pub(super) fn new(o: &Object, chunk: usize, readahead: usize, shared: &'s Shared<'a>, limits: &'s Limits<'s>) -> NsSource<'s, 'a> {
        NsSource {
            len: o.len,
            pieces: o.pieces().collect(),
            queue: VecDeque::new(),
            free: Vec::new(),
            depth: readahead + 1,
            chunk,
            current: None,
            peer_reads: 0,
            shared,
            limits,
            read: 0,
        }
    }

    fn buffer(&mut self) -> AlignedBuf {
        self.free.pop().unwrap_or_else(|| AlignedBuf::new(self.chunk))
    }

    /// Starts reads (or reads at once) until `depth` buffers are in use or the pieces end.
    fn fill(&mut self) -> Result<(), ComputeError> {
        while self.queue.len() + usize::from(self.current.is_some()) < self.depth {
            let Some(p) = self.pieces.front().copied() else { break };
            if p.is_remote() && self.peer_reads >= self.shared.peer_reads_max(self.chunk, self.depth) {
                break;
            }
            let mut buf = self.buffer();
            let cap = buf.capacity() as u64;
            let taken = if p.is_zeros() {
                let take = p.len.min(cap);
                buf.set_len(take as usize);
                buf.fill(0);
                self.queue.push_back(Pending::Ready(buf));
                take
            } else if p.is_remote() {
                self.read_peer(p, buf)?
            } else {
                self.read_local(p, buf)?
            };
            let front = self.pieces.front_mut().expect("checked");
            front.len -= taken;
            if !p.is_zeros() {
                front.offset += taken;
            }
            if front.len == 0 {
                self.pieces.pop_front();
            }
        }
        Ok(())
    }

    /// Reads the start of local piece `p` into `buf`: bytes taken from the piece.
    fn read_local(&mut self, p: Extent, mut buf: AlignedBuf) -> Result<u64, ComputeError> {
        let block = self.shared.block;
        let cap = buf.capacity() as u64;
        let take = p.len.min(cap - cap % block);
        // Whole blocks: the extent holds them, only the object's last piece is cut short
        // of its block.
        let whole = take.div_ceil(block) * block;
        buf.set_len(whole as usize);
        let dev = &self.shared.local;
        let mut io = self.shared.io.borrow_mut();
        let tag = if !reads_here(&**dev) {
            io.submit(dev, Op::Read { off: p.offset }, buf)?
        } else if io.reads_ahead_here() {
            io.submit_here(dev, p.offset, buf)?
        } else {
            drop(io);
            if let Err(e) = read_here(&**dev, p.offset, &mut buf) {
                return Err(ComputeError::Io(format!("reading {whole} bytes at namespace byte {}: {e}", p.offset)));
            }
            buf.set_len(take as usize);
            self.queue.push_back(Pending::Ready(buf));
            return Ok(take);
        };
        self.queue.push_back(Pending::Reading { tag, take: take as usize, peer: None, off: p.offset });
        Ok(take)
    }

    /// Starts reading the start of peer piece `p` into `buf`: bytes taken from the piece.
    fn read_peer(&mut self, p: Extent, mut buf: AlignedBuf) -> Result<u64, ComputeError> {
        let (tag, off) = (p.tag(), global::offset(p.offset));
        let name = self.shared.peers.name(tag);
        let dev = self.shared.remotes.get(&tag).cloned().ok_or_else(|| self.shared.peer_failed(tag, format!("{name}: not opened")))?;
        let g = dev.geometry();
        let block = g.block_size as u64;
        let end = off + p.len.div_ceil(block) * block;
        let cap = buf.capacity() as u64;
        let take = p.len.min(cap - cap % block);
        let bad = if !off.is_multiple_of(block) {
            Some(format!("offset {off} is not a multiple of its {block}-byte block"))
        } else if end > g.size {
            Some(format!("bytes {off}..{end} lie outside its namespace of {} bytes", g.size))
        } else if take == 0 {
            Some(format!("its {block}-byte block is larger than compute.chunk"))
        } else {
            None
        };
        if let Some(m) = bad {
            return Err(self.shared.peer_failed(tag, format!("{name}: {m}")));
        }
        buf.set_len((take.div_ceil(block) * block) as usize);
        let t = self.shared.io.borrow_mut().submit(&dev, Op::Read { off }, buf)?;
        self.queue.push_back(Pending::Reading { tag: t, take: take as usize, peer: Some(tag), off });
        self.peer_reads += 1;
        Ok(take)
    }
}

impl Source for NsSource<'_, '_> {
    fn next_chunk(&mut self) -> Result<Option<&[u8]>, ComputeError> {
        if let Some(b) = self.current.take() {
            self.free.push(b);
        }
        loop {
            self.limits.check()?;
            self.fill()?;
            let (tag, take, peer, off) = match self.queue.front() {
                None => return Ok(None),
                Some(Pending::Ready(_)) => {
                    let Some(Pending::Ready(b)) = self.queue.pop_front() else { unreachable!("matched") };
                    self.read += b.len() as u64;
                    return Ok(Some(&self.current.insert(b)[..]));
                }
                Some(&Pending::Reading { tag, take, peer, off }) => (tag, take, peer, off),
            };
            let mut io = self.shared.io.borrow_mut();
            let got = match io.take(tag, Duration::ZERO)? {
                Some(c) => Some(c),
                // Not in yet: waited for without the turn to compute, which others take.
                None => self.limits.without_turn(|| io.take(tag, Duration::from_millis(100)))??,
            };
            drop(io);
            let Some(c) = got else { continue };
            self.queue.pop_front();
            let Completion { result, mut buf, .. } = c;
            if let Some(t) = peer {
                self.peer_reads -= 1;
                if let Err(e) = result {
                    self.free.push(buf);
                    return Err(self.shared.peer_failed(t, format!("peer tag {t}: {e}")));
                }
                self.shared.peers.count_read(t, take as u64);
            } else if let Err(e) = result {
                let whole = buf.len();
                self.free.push(buf);
                return Err(ComputeError::Io(format!("reading {whole} bytes at namespace byte {off}: {e}")));
            }
            buf.set_len(take);
            self.read += take as u64;
            return Ok(Some(&self.current.insert(buf)[..]));
        }
    }

    fn len(&self) -> u64 {
        self.len
    }
}
