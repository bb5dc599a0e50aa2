//! The host's PIFO (Flint, seed 003): many streams of I/O share a host's queues to its
//! targets ("lanes"), and what waits for room on a lane leaves in the order of a rank computed
//! from the live view, not in arrival order, so a stream of small reads is not stuck behind
//! another stream's backlog of large writes (docs/fair-io.md, "The host's PIFO").
//!
//! The rank is a virtual finish time (self-clocked fair queueing): a request costs
//! `len / 1 KiB` units, times its lane's write cost for a write, times `1 + queue depth /
//! PIFO_LOAD_DEPTH` for the load of the pool behind the lane, divided by its stream's weight;
//! its rank is `max(V, the stream's last rank) + cost`, where `V` is the rank of the request
//! that last left. The smallest rank among the heads of the streams whose lane has room
//! goes next. Flint ranks by `len × write cost` alone (`LocalScheduler::compute_rank`), which
//! can starve a large request behind a stream of small ones; adding the stream's last rank
//! and `V` ages every waiting request, so each stream gets its weight's share of the cost
//! units and none waits for ever. A stream that was idle comes back at `V`, with no credit
//! saved up.
//!
//! [`Pifo`] owns the lanes on one task; [`PifoStream`]s are handles any task may use.
//! [`Order`] is the ordering alone, with no I/O.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{Arc, Weak};
use std::task::Poll;
use std::time::Duration;

use nearstore_wire::opcode::io;
use nearstore_wire::{Cqe, Sqe};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::{Data, Error, IoQueue, QueuePair, Result};

/// Bytes in one cost unit.
pub const PIFO_COST_UNIT: usize = 1024;
/// Requests in a lane's pool queue (EWMA, from the view) that double the cost of a request
/// to it.
pub const PIFO_LOAD_DEPTH: f64 = 32.0;
/// The largest queue depth a view may claim; more is taken as this.
pub const PIFO_QUEUE_DEPTH_MAX: f64 = 4096.0;
/// The largest write cost a view may claim; more is taken as this.
pub const PIFO_WRITE_COST_MAX: f64 = 64.0;
/// Streams open at once on one [`Pifo`].
pub const PIFO_STREAMS_MAX: usize = 1024;
/// Messages (requests, views, opened streams) waiting for the scheduler's task; a stream
/// submitting more waits for room.
pub const PIFO_CHANNEL_MAX: usize = 4096;
/// A stream's weight at most; the default is 100, as a tenant's `io_weight`.
pub const PIFO_WEIGHT_MAX: u32 = 10_000;

/// What the view says of the pool behind a lane.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LaneView {
    /// What a written byte costs against a read one (the pool's `write_cost`; 1 or more).
    pub write_cost: f64,
    /// Operations in flight on the pool (the view's `queue_depth`, an EWMA).
    pub queue_depth: f64,
}

impl Default for LaneView {
    fn default() -> Self {
        LaneView { write_cost: 1.0, queue_depth: 0.0 }
    }
}

impl LaneView {
    /// What one cost unit of this lane weighs: the write cost for a write, times the load.
    /// Out-of-range figures (NaN, negative, absurd) are clamped, never trusted.
    pub fn factor(&self, write: bool) -> f64 {
        let clamp = |v: f64, lo: f64, hi: f64| if v.is_nan() { lo } else { v.clamp(lo, hi) };
        let wc = if write { clamp(self.write_cost, 1.0, PIFO_WRITE_COST_MAX) } else { 1.0 };
        wc * (1.0 + clamp(self.queue_depth, 0.0, PIFO_QUEUE_DEPTH_MAX) / PIFO_LOAD_DEPTH)
    }
}

/// The order requests leave in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// By rank (the module's documentation).
    Pifo,
    /// In arrival order over all streams (for comparison: what a plain queue does).
    Fifo,
}

struct Queued<T> {
    rank: f64,
    seq: u64,
    lane: usize,
    item: T,
}

struct StreamQueue<T> {
    /// Cost units are divided by this (weight / 100).
    share: f64,
    /// The rank of its last request.
    finish: f64,
    queue: VecDeque<Queued<T>>,
}

/// The ordering of a PIFO, with no I/O: streams, their waiting requests, and which leaves
/// next.
pub struct Order<T> {
    policy: Policy,
    /// The rank of the request that left last.
    vtime: f64,
    seq: u64,
    streams: Vec<Option<StreamQueue<T>>>,
    waiting: usize,
}

impl<T> Order<T> {
    pub fn new(policy: Policy) -> Order<T> {
        Order { policy, vtime: 0.0, seq: 0, streams: Vec::new(), waiting: 0 }
    }

    /// Adds a stream of weight 1..=[`PIFO_WEIGHT_MAX`]; its id, or None when
    /// [`PIFO_STREAMS_MAX`] are open.
    pub fn open(&mut self, weight: u32) -> Option<usize> {
        let weight = weight.clamp(1, PIFO_WEIGHT_MAX);
        let s = StreamQueue { share: weight as f64 / 100.0, finish: self.vtime, queue: VecDeque::new() };
        if let Some(i) = self.streams.iter().position(Option::is_none) {
            self.streams[i] = Some(s);
            return Some(i);
        }
        if self.streams.len() >= PIFO_STREAMS_MAX {
            return None;
        }
        self.streams.push(Some(s));
        Some(self.streams.len() - 1)
    }

    /// Removes a stream and gives back what it had waiting.
    pub fn close(&mut self, stream: usize) -> Vec<T> {
        let Some(s) = self.streams.get_mut(stream).and_then(Option::take) else { return Vec::new() };
        self.waiting -= s.queue.len();
        s.queue.into_iter().map(|q| q.item).collect()
    }

    pub fn is_open(&self, stream: usize) -> bool {
        self.streams.get(stream).is_some_and(Option::is_some)
    }

    /// Queues `item` on `stream` for `lane`, costing `units` (already weighed by the lane's
    /// view); returns its rank. Panics on a stream that is not open (a caller's bug).
    pub fn push(&mut self, stream: usize, lane: usize, units: f64, item: T) -> f64 {
        let s = self.streams[stream].as_mut().expect("stream open");
        self.seq += 1;
        let rank = match self.policy {
            Policy::Pifo => {
                let r = self.vtime.max(s.finish) + units.max(0.0) / s.share;
                s.finish = r;
                r
            }
            Policy::Fifo => self.seq as f64,
        };
        s.queue.push_back(Queued { rank, seq: self.seq, lane, item });
        self.waiting += 1;
        rank
    }

    /// Takes the waiting request of the smallest rank (then the earliest) among the heads of
    /// the streams whose lane has `room`: `(stream, lane, item)`.
    pub fn pop(&mut self, mut room: impl FnMut(usize) -> bool) -> Option<(usize, usize, T)> {
        let mut best: Option<(f64, u64, usize)> = None;
        for (i, s) in self.streams.iter().enumerate() {
            let Some(h) = s.as_ref().and_then(|s| s.queue.front()) else { continue };
            if best.is_some_and(|(r, q, _)| (r, q) <= (h.rank, h.seq)) || !room(h.lane) {
                continue;
            }
            best = Some((h.rank, h.seq, i));
        }
        let (_, _, i) = best?;
        let h = self.streams[i].as_mut().expect("chosen").queue.pop_front().expect("chosen");
        self.waiting -= 1;
        if self.policy == Policy::Pifo {
            self.vtime = self.vtime.max(h.rank);
        }
        Some((i, h.lane, h.item))
    }

    pub fn waiting(&self) -> usize {
        self.waiting
    }

    /// Keeps only the waiting requests of `stream` that `keep`; how many went.
    pub fn retain(&mut self, stream: usize, mut keep: impl FnMut(&T) -> bool) -> usize {
        let Some(s) = self.streams.get_mut(stream).and_then(Option::as_mut) else { return 0 };
        let before = s.queue.len();
        s.queue.retain(|q| keep(&q.item));
        let gone = before - s.queue.len();
        self.waiting -= gone;
        gone
    }
}

/// How a [`Pifo`] runs.
#[derive(Clone, Copy, Debug)]
pub struct PifoOptions {
    pub policy: Policy,
    /// Commands in flight on each lane at most (0: its queue's depth, which also bounds it).
    /// What the PIFO orders is what waits beyond this.
    pub in_flight: u16,
}

impl Default for PifoOptions {
    fn default() -> Self {
        PifoOptions { policy: Policy::Pifo, in_flight: 0 }
    }
}

type Reply = oneshot::Sender<Result<(Cqe, Vec<u8>)>>;

/// A command in flight: whom to answer, its opcode for the error, and when it was sent.
struct Pending {
    reply: Reply,
    opcode: u8,
    sent: Instant,
}

struct Request {
    sqe: Sqe,
    out: Vec<u8>,
    in_len: usize,
    reply: Reply,
}

enum Msg {
    Open {
        weight: u32,
        token: Weak<()>,
        reply: oneshot::Sender<Option<usize>>,
    },
    View {
        lane: usize,
        view: LaneView,
    },
    /// `token`: the stream's, so that a request of a stream that closed is not taken for one
    /// of a new stream given its id.
    Io {
        stream: usize,
        token: Weak<()>,
        lane: usize,
        req: Request,
    },
}

/// What a [`Pifo`] counts.
#[derive(Default, Debug)]
pub struct PifoCounters {
    /// Requests sent to a lane.
    pub dispatched: AtomicU64,
    /// Requests waiting for room.
    pub waiting: AtomicUsize,
    /// Waiting requests dropped unsent because their caller gave up.
    pub abandoned: AtomicU64,
}

/// A scheduler over lanes (I/O queues, one per target or connection) shared by streams.
pub struct Pifo {
    tx: mpsc::Sender<Msg>,
    lanes: usize,
    counters: Arc<PifoCounters>,
    task: tokio::task::JoinHandle<()>,
}

/// One stream of a [`Pifo`]: a FIFO of its own, ranked against the others. Cheap to clone;
/// the stream closes when its last clone drops (what it had waiting is dropped unsent).
#[derive(Clone)]
pub struct PifoStream {
    id: usize,
    tx: mpsc::Sender<Msg>,
    lanes: usize,
    _token: Arc<()>,
}

impl Pifo {
    /// Takes the lanes (each an I/O queue with nothing in flight) and starts the scheduler's
    /// task; it ends when the `Pifo` and every stream are dropped and nothing is in flight.
    pub fn new(lanes: Vec<IoQueue>, opts: PifoOptions) -> Pifo {
        let counters = Arc::new(PifoCounters::default());
        let (tx, rx) = mpsc::channel(PIFO_CHANNEL_MAX);
        let n = lanes.len();
        let lanes = lanes
            .into_iter()
            .map(|q| {
                let depth = q.q.depth();
                let limit = if opts.in_flight == 0 { depth } else { (opts.in_flight as usize).min(depth) };
                Lane {
                    q: q.q,
                    timeout: q.timeout,
                    limit,
                    pending: (0..depth).map(|_| None).collect(),
                    view: LaneView::default(),
                    dead: None,
                }
            })
            .collect();
        let task = tokio::spawn(drive(rx, lanes, opts.policy, counters.clone()));
        Pifo { tx, lanes: n, counters, task }
    }

    /// Opens a stream of `weight` (1..=[`PIFO_WEIGHT_MAX`], 100 the default share).
    pub async fn stream(&self, weight: u32) -> Result<PifoStream> {
        if weight == 0 || weight > PIFO_WEIGHT_MAX {
            return Err(Error::Invalid(format!("stream weight {weight}: must be 1 to {PIFO_WEIGHT_MAX}")));
        }
        let token = Arc::new(());
        let (reply, rx) = oneshot::channel();
        self.tx.send(Msg::Open { weight, token: Arc::downgrade(&token), reply }).await.map_err(|_| Error::Closed)?;
        match rx.await.map_err(|_| Error::Closed)? {
            Some(id) => Ok(PifoStream { id, tx: self.tx.clone(), lanes: self.lanes, _token: token }),
            None => Err(Error::Invalid(format!("{PIFO_STREAMS_MAX} streams are open already"))),
        }
    }

    /// Tells the scheduler what the view says of the pool behind `lane`; requests queued from
    /// then on are ranked by it.
    pub async fn set_view(&self, lane: usize, view: LaneView) -> Result<()> {
        if lane >= self.lanes {
            return Err(Error::Invalid(format!("lane {lane} of {}", self.lanes)));
        }
        self.tx.send(Msg::View { lane, view }).await.map_err(|_| Error::Closed)
    }

    pub fn counters(&self) -> &PifoCounters {
        &self.counters
    }

    /// Waits for the scheduler's task to end (after every stream is dropped).
    pub async fn join(self) {
        let Pifo { tx, task, .. } = self;
        drop(tx);
        let _ = task.await;
    }
}

impl PifoStream {
    /// Sends `sqe` on `lane` when its turn comes: `data` out (a write) or `in_len` bytes in
    /// (a read); the completion and the data read. A status other than success is an error.
    pub async fn submit(&self, lane: usize, sqe: Sqe, out: Vec<u8>, in_len: usize) -> Result<(Cqe, Vec<u8>)> {
        if lane >= self.lanes {
            return Err(Error::Invalid(format!("lane {lane} of {}", self.lanes)));
        }
        if !out.is_empty() && in_len > 0 {
            return Err(Error::Invalid("a command moves data one way".into()));
        }
        let (reply, rx) = oneshot::channel();
        let req = Request { sqe, out, in_len, reply };
        let token = Arc::downgrade(&self._token);
        self.tx.send(Msg::Io { stream: self.id, token, lane, req }).await.map_err(|_| Error::Closed)?;
        rx.await.map_err(|_| Error::Closed)?
    }

    pub async fn read(&self, lane: usize, nsid: u32, slba: u64, nlb: u32, block_size: u32) -> Result<Vec<u8>> {
        let len = nlb as usize * block_size as usize;
        Ok(self.submit(lane, Sqe::rw(io::READ, nsid, slba, nlb, false), Vec::new(), len).await?.1)
    }

    pub async fn write(&self, lane: usize, nsid: u32, slba: u64, data: Vec<u8>, block_size: u32, fua: bool) -> Result<()> {
        let nlb = crate::controller::whole_blocks(&data, block_size)?;
        self.submit(lane, Sqe::rw(io::WRITE, nsid, slba, nlb, fua), data, 0).await.map(|_| ())
    }
}

struct Lane {
    q: QueuePair<TcpStream>,
    timeout: Duration,
    limit: usize,
    /// Indexed by command id.
    pending: Vec<Option<Pending>>,
    view: LaneView,
    /// Why the lane failed: every request to it fails with this from then on.
    dead: Option<String>,
}

impl Lane {
    fn room(&self) -> bool {
        self.dead.is_none() && self.q.in_flight() < self.limit
    }

    fn start(&mut self, req: Request) {
        let data = if !req.out.is_empty() { Data::Out(&req.out) } else { Data::In(req.in_len) };
        let opcode = req.sqe.opcode();
        match self.q.submit(req.sqe, data, 0) {
            Ok(cid) => {
                self.pending[cid as usize] = Some(Pending { reply: req.reply, opcode, sent: Instant::now() });
            }
            Err(e) => {
                let _ = req.reply.send(Err(e));
            }
        }
    }

    /// Waits for completions and answers them.
    async fn poll(&mut self) -> Result<usize> {
        let pending = &mut self.pending;
        let n = self
            .q
            .poll(|_, cqe, data| {
                if let Some(p) = pending.get_mut(cqe.cid as usize).and_then(Option::take) {
                    let r = if cqe.status.is_success() {
                        Ok((*cqe, data.to_vec()))
                    } else {
                        Err(Error::Status { what: command_name(p.opcode), status: cqe.status, cqe: *cqe })
                    };
                    let _ = p.reply.send(r);
                }
            })
            .await?;
        Ok(n)
    }

    /// When its oldest command in flight times out (None: nothing in flight). A timeout too
    /// large to add is taken as never.
    fn deadline(&self) -> Option<Instant> {
        if self.dead.is_some() {
            return None;
        }
        let oldest = self.pending.iter().flatten().map(|p| p.sent).min()?;
        Some(oldest.checked_add(self.timeout).unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400 * 365)))
    }

    /// Fails the lane: everything in flight on it, and every later request to it.
    fn fail(&mut self, why: String) {
        for p in self.pending.iter_mut().filter_map(Option::take) {
            let _ = p.reply.send(Err(lane_failed(&why)));
        }
        self.dead = Some(why);
    }
}

/// What a request to a failed lane gets.
fn lane_failed(why: &str) -> Error {
    Error::Protocol(format!("lane failed: {why}"))
}

fn command_name(opcode: u8) -> String {
    match opcode {
        io::READ => "Read".into(),
        io::WRITE => "Write".into(),
        o => format!("I/O command {o:#04x}"),
    }
}

/// Polls every lane with commands in flight (each in turn at every wake, so that a busy lane
/// cannot keep the others from sending or receiving) until at least one answers: the index
/// and result of each that did.
async fn poll_lanes(lanes: &mut [Lane]) -> Vec<(usize, Result<usize>)> {
    type LaneFuture<'a> = Pin<Box<dyn Future<Output = (usize, Result<usize>)> + Send + 'a>>;
    let mut futs: Vec<Option<LaneFuture<'_>>> = lanes
        .iter_mut()
        .enumerate()
        .filter(|(_, l)| l.dead.is_none() && l.q.in_flight() > 0)
        .map(|(i, l)| Some(Box::pin(async move { (i, l.poll().await) }) as LaneFuture<'_>))
        .collect();
    if futs.is_empty() {
        return std::future::pending().await;
    }
    std::future::poll_fn(|cx| {
        let mut ready = Vec::new();
        for slot in futs.iter_mut() {
            if let Some(f) = slot {
                if let Poll::Ready(r) = f.as_mut().poll(cx) {
                    ready.push(r);
                    *slot = None;
                }
            }
        }
        if ready.is_empty() {
            Poll::Pending
        } else {
            Poll::Ready(ready)
        }
    })
    .await
}

async fn drive(mut rx: mpsc::Receiver<Msg>, mut lanes: Vec<Lane>, policy: Policy, counters: Arc<PifoCounters>) {
    let mut order: Order<Request> = Order::new(policy);
    // One a stream id: its handles' token while it is open.
    let mut tokens: Vec<Option<Weak<()>>> = Vec::new();
    let mut open = true;
    loop {
        // Streams whose every handle dropped: what they left waiting goes unsent.
        for (i, t) in tokens.iter_mut().enumerate() {
            if t.as_ref().is_some_and(|t| t.strong_count() == 0) {
                let left = order.close(i);
                counters.abandoned.fetch_add(left.len() as u64, AtomicOrdering::Relaxed);
                *t = None;
            }
        }
        // What is sent here goes on the wire in the lane's next poll; a failed lane's
        // requests are answered with its failure as they come to the head of their stream.
        while let Some((_, lane, req)) = order.pop(|l| lanes[l].room() || lanes[l].dead.is_some()) {
            if req.reply.is_closed() {
                counters.abandoned.fetch_add(1, AtomicOrdering::Relaxed);
                continue;
            }
            if let Some(why) = &lanes[lane].dead {
                let _ = req.reply.send(Err(lane_failed(why)));
                continue;
            }
            lanes[lane].start(req);
            counters.dispatched.fetch_add(1, AtomicOrdering::Relaxed);
        }
        counters.waiting.store(order.waiting(), AtomicOrdering::Relaxed);
        let busy = lanes.iter().any(|l| l.dead.is_none() && l.q.in_flight() > 0);
        if !open && !busy && order.waiting() == 0 {
            return;
        }
        let deadline = lanes.iter().filter_map(Lane::deadline).min().unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
        tokio::select! {
            m = rx.recv(), if open => match m {
                None => open = false,
                Some(Msg::Open { weight, token, reply }) => {
                    let id = order.open(weight);
                    if let Some(i) = id {
                        if tokens.len() <= i {
                            tokens.resize(i + 1, None);
                        }
                        tokens[i] = Some(token);
                    }
                    let _ = reply.send(id);
                }
                Some(Msg::View { lane, view }) => lanes[lane].view = view,
                Some(Msg::Io { stream, token, lane, req }) => {
                    // Its stream's token while it is open: a stream closed (its token gone) or
                    // another given its id has none or another.
                    let mine = tokens.get(stream).and_then(Option::as_ref).is_some_and(|t| t.ptr_eq(&token));
                    if let Some(why) = &lanes[lane].dead {
                        let _ = req.reply.send(Err(lane_failed(why)));
                    } else if !mine {
                        // Sent just before its stream's last handle dropped: nobody waits.
                        counters.abandoned.fetch_add(1, AtomicOrdering::Relaxed);
                    } else {
                        // Requests whose callers gave up go now, not when they reach the head.
                        let dropped = order.retain(stream, |r| !r.reply.is_closed());
                        counters.abandoned.fetch_add(dropped as u64, AtomicOrdering::Relaxed);
                        let write = !req.out.is_empty();
                        let len = if write { req.out.len() } else { req.in_len };
                        let units = len.max(PIFO_COST_UNIT) as f64 / PIFO_COST_UNIT as f64 * lanes[lane].view.factor(write);
                        order.push(stream, lane, units, req);
                    }
                }
            },
            ready = poll_lanes(&mut lanes) => {
                for (i, r) in ready {
                    if let Err(e) = r {
                        lanes[i].fail(e.to_string());
                    }
                }
            }
            _ = tokio::time::sleep_until(deadline), if busy => {
                // A command not completed within the queue's timeout fails its lane (one lost
                // command would otherwise hold its caller and its slot for ever).
                let now = Instant::now();
                for l in lanes.iter_mut().filter(|l| l.deadline().is_some_and(|d| d <= now)) {
                    l.fail(format!("a command not completed within {:?}", l.timeout));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
