//! The NVMe/TCP connection engine: one task per connection (one queue), generic over the
//! byte stream. It parses PDUs, runs commands, and completes every command exactly once.
//!
//! Per batch of received bytes the loop parses every complete PDU, runs what can run at
//! once (memory backends, admin commands) straight into the send buffer, hands file and
//! block I/O to the worker pool, and then writes everything with as few syscalls as the
//! socket allows. Buffers and command slots are reused; nothing is allocated per I/O on
//! the read and write paths once the queue is warm.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nearstore_transport::{AlignedBuf, Interest, RxBuf, Stream, TxBuf};
use nearstore_wire::log::ErrorEntry;
use nearstore_wire::opcode::{fctype, FABRICS};
use nearstore_wire::pdu::{self, fes, flags, DataHdr, Frame, Framing, IcReq, IcResp, PduError, PduType};
use nearstore_wire::sqe::sgl_id;
use nearstore_wire::{Cqe, Sqe, Status};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::admin;
use crate::admission::Ticket;
use crate::dev::{Channel, Completion, Op};
use crate::fabrics;
use crate::io_cmd::{self, IoKind, IoPlan};
use crate::io_pool::Done;
use crate::limits;
use crate::log_limit::peer_warn;
use crate::memory::Reservation;
use crate::offload::TaskAbort;
use crate::reply::Reply;
use crate::request::{QueueRequests, Request};
use crate::subsystem::{AbortGuard, Controller, Namespace};
use crate::{Port, Target};

mod compute;
mod reservation;

#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("socket: {0}")]
    Io(#[from] io::Error),
    #[error("{0}")]
    Fatal(PduError),
    #[error("host sent a TermReq (fes {fes:#x}, fei {fei})")]
    HostTerminated { fes: u16, fei: u32 },
    #[error("controller {0} went away (keep-alive expiry, shutdown or admin queue loss)")]
    ControllerGone(u16),
    #[error("no Connect within {0:?} (limits.connect_timeout_ms)")]
    ConnectTimeout(Duration),
    #[error("closed before its Connect to make room for a new connection (limits.connections)")]
    Evicted,
}

/// Serves one connection until it closes, then detaches it from its controller.
/// `ticket`: its place among the target's connections (None for in-process streams).
pub async fn serve<S: Stream>(stream: S, target: Arc<Target>, port: Arc<Port>, local: Option<SocketAddr>, ticket: Option<Ticket>) {
    target.stats.connections.fetch_add(1, Relaxed);
    target.stats.connections_total.fetch_add(1, Relaxed);
    let peer = stream.peer();
    let fd = stream.as_raw_fd();
    let (done_tx, done_rx) = unbounded_channel();
    let (abort_tx, abort_rx) = unbounded_channel();
    let mut conn = Conn {
        stream,
        rx: RxBuf::new(limits::RX_BUFFER_BYTES),
        done_rx,
        abort_rx,
        cancel: ticket.as_ref().map_or_else(CancellationToken::new, |t| t.evicted().clone()),
        connect_by: tokio::time::Instant::now() + Duration::from_millis(target.limits.connect_timeout_ms),
        ticket,
        bound: false,
        stalled: false,
        core: Core {
            target: target.clone(),
            port,
            local,
            peer: peer.clone(),
            tx: TxBuf::with_capacity(256 * 1024),
            fd,
            framing: Framing::initial(true),
            hpda: 0,
            queue: None,
            sqhd: 0,
            r2t: Slab::default(),
            chan: Channel::new(target.io_engine, target.pool.clone()),
            completed: Vec::new(),
            inflight: Slab::default(),
            bufs: Vec::new(),
            data_bufs: 0,
            reported_bytes: 0,
            done_tx,
            abort_tx,
            aers: Vec::new(),
            close_after_flush: false,
            cancel: CancellationToken::new(),
            requests: QueueRequests::new(target.clone()),
        },
    };
    let result = conn.run().await;
    // Compute commands of this connection, queued or running, stop.
    conn.core.cancel.cancel();
    if let Err(e) = conn.flush_quickly().await {
        debug!(peer, "flushing before close: {e}");
    }
    match &result {
        Ok(()) => debug!(peer, "connection closed by host"),
        Err(ConnError::Fatal(e)) => {
            target.stats.fatal_errors.fetch_add(1, Relaxed);
            peer_warn!(target.log_limit, peer.as_str(), "closing connection after a fatal transport error", error = %e);
        }
        Err(e @ ConnError::ConnectTimeout(_)) => {
            target.stats.connect_timeouts.fetch_add(1, Relaxed);
            debug!(peer, "closing connection: {e}");
        }
        Err(e @ ConnError::Evicted) => debug!(peer, "closing connection: {e}"),
        Err(e) => info!(peer, "closing connection: {e}"),
    }
    conn.core.abandon_outstanding();
    conn.core.detach();
    target.stats.buffer_bytes.fetch_sub(conn.core.reported_bytes as i64, Relaxed);
    target.stats.connections.fetch_sub(1, Relaxed);
}

struct Conn<S> {
    stream: S,
    rx: RxBuf,
    done_rx: UnboundedReceiver<Done>,
    /// Other hosts' Preempt and Abort requests ([`Done::Abort`]), taken whether or not the
    /// send buffer has room: handling one sends nothing.
    abort_rx: UnboundedReceiver<Done>,
    /// Before Connect: fires when the connection is evicted; after: the connection's own
    /// token, which fires when its controller goes.
    cancel: CancellationToken,
    /// Connect must succeed by then (limits.connect_timeout_ms from accept).
    connect_by: tokio::time::Instant,
    ticket: Option<Ticket>,
    bound: bool,
    /// process_rx stopped with bytes unread because the send buffer was full.
    stalled: bool,
    core: Core,
}

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
    /// This connection's share of the memory budget (limits::connection_memory_max for
    /// its queue size), given back when the connection ends and the queue is dropped.
    _memory: Reservation,
}

/// A write waiting for its data in H2CData PDUs after an R2T.
struct H2C {
    sqe: Sqe,
    buf: AlignedBuf,
    received: usize,
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
    /// Other hosts' Preempt and Abort waiting for this command (dropped with it); those of
    /// a device operation go with the operation instead ([`Channel::hold`]).
    held: Vec<AbortGuard>,
    /// A compute command's task, which a Preempt and Abort stops.
    task: Option<Arc<TaskAbort>>,
}

impl Inflight {
    fn new(req: Request, ns: Arc<Namespace>, kind: IoKind, len: usize, lba: u64) -> Inflight {
        Inflight { req, ns, kind, len, lba, held: Vec::new(), task: None }
    }
}

struct Core {
    target: Arc<Target>,
    port: Arc<Port>,
    local: Option<SocketAddr>,
    peer: String,
    tx: TxBuf,
    /// The socket, for sends that bypass the send buffer ([`TxBuf::write_through`]).
    fd: std::os::fd::RawFd,
    framing: Framing,
    hpda: u8,
    queue: Option<Queue>,
    sqhd: u16,
    r2t: Slab<H2C>,
    /// This queue's I/O context: its devices' operations run and complete there.
    chan: Channel,
    /// Completions taken from `chan`, reused between polls.
    completed: Vec<Completion>,
    inflight: Slab<Inflight>,
    bufs: Vec<AlignedBuf>,
    /// Data buffers allocated and alive: pooled in `bufs` or lent to a command.
    data_bufs: usize,
    /// Buffer bytes last added to the target's gauge.
    reported_bytes: usize,
    done_tx: UnboundedSender<Done>,
    /// Given to the controller for other hosts' Preempt and Abort ([`Conn::abort_rx`]).
    abort_tx: UnboundedSender<Done>,
    /// Outstanding Asynchronous Event Requests.
    aers: Vec<Request>,
    close_after_flush: bool,
    /// Fires when this connection ends or its controller goes: stops its compute commands.
    cancel: CancellationToken,
    /// What became of this queue's requests (crate::request).
    requests: Arc<QueueRequests>,
}

enum Flow {
    Continue,
    Close,
}

enum Polled {
    Activity,
    Idle,
    Closed,
}

impl<S: Stream> Conn<S> {
    async fn run(&mut self) -> Result<(), ConnError> {
        let evicted = self.cancel.clone();
        let timeout = Duration::from_millis(self.core.target.limits.connect_timeout_ms);
        // Biased here and below: the branches are polled in the order written, so that
        // one seed replays one run in the simulation (crates/sim); tokio's random start
        // cannot be seeded without --cfg tokio_unstable.
        let shook = tokio::select! {
            biased;
            r = tokio::time::timeout_at(self.connect_by, self.handshake()) => r.map_err(|_| ConnError::ConnectTimeout(timeout))??,
            _ = evicted.cancelled() => return Err(ConnError::Evicted),
        };
        if !shook {
            return Ok(());
        }
        loop {
            if let Flow::Close = self.process_rx()? {
                return Ok(());
            }
            self.core.poll_io();
            if self.core.queue.as_ref().is_some_and(|q| q.qid == 0) {
                // Busy-polling may skip the select below, where events are otherwise noticed.
                self.core.deliver_events();
            }
            self.core.tx.flush(&self.stream)?;
            if self.core.close_after_flush && self.core.tx.pending() == 0 {
                return Ok(());
            }
            self.account_memory();
            // Commands left in the receive buffer while the send buffer was full: the
            // socket will not wake us for them, so go round again once there is room.
            if self.stalled && self.core.tx.pending() <= limits::TX_PENDING_BYTES_MAX {
                continue;
            }
            // Completions left in the ring while the send buffer was full: the eventfd
            // signal that announced them was consumed then and will not come again, so
            // waiting on it would hang the queue (seen with busy-polling off: a host
            // waiting for 8 reads whose completions sat in the ring). Take them now.
            if self.core.tx.pending() <= limits::TX_PENDING_BYTES_MAX && self.core.chan.has_completions() {
                continue;
            }
            let mut interest = Interest::READABLE;
            if self.core.tx.pending() > limits::TX_PENDING_BYTES_MAX {
                interest = Interest::WRITABLE;
            } else if self.core.tx.pending() > 0 {
                interest |= Interest::WRITABLE;
            }
            if self.core.tx.pending() == 0 {
                match self.busy_poll().await? {
                    Polled::Activity => continue,
                    Polled::Closed => return Ok(()),
                    Polled::Idle => {}
                }
            }
            let events = self.core.queue.as_ref().filter(|q| q.qid == 0 && !self.core.aers.is_empty()).map(|q| q.ctrl.clone());
            // Completions are taken only while the send buffer has room for their responses.
            let room = self.core.tx.pending() <= limits::TX_PENDING_BYTES_MAX;
            let io_busy = self.core.chan.busy();
            // Without room, ring operations holding a Preempt and Abort still release it
            // when the storage has finished them (their completions wait).
            let holding = !room && self.core.chan.holding();
            let unbound = !self.bound;
            tokio::select! {
                biased;
                _ = self.cancel.cancelled() => {
                    if unbound {
                        return Err(ConnError::Evicted);
                    }
                    return Err(ConnError::ControllerGone(self.core.queue.as_ref().map_or(0, |q| q.ctrl.cntlid)));
                }
                _ = tokio::time::sleep_until(self.connect_by), if unbound => {
                    return Err(ConnError::ConnectTimeout(Duration::from_millis(self.core.target.limits.connect_timeout_ms)));
                }
                d = self.abort_rx.recv() => {
                    if let Some(d) = d {
                        self.core.on_done(d);
                    }
                }
                d = self.done_rx.recv(), if room => {
                    if let Some(d) = d {
                        self.core.on_done(d);
                    }
                    self.take_done();
                }
                _ = async { events.as_ref().expect("guarded").events.notified().await }, if events.is_some() => {
                    self.core.deliver_events();
                }
                r = async {
                    if room { self.core.chan.wait().await } else { self.core.chan.wait_holding().await }
                }, if (io_busy && room) || holding => {
                    r?;
                    if room {
                        self.core.poll_io();
                    } else {
                        self.core.chan.settle();
                    }
                }
                r = self.stream.ready(interest) => {
                    let r = r?;
                    if r.is_readable() || r.is_read_closed() {
                        match self.rx.fill(&self.stream) {
                            Ok(0) => return Ok(()),
                            Ok(_) => {}
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                            Err(e) => return Err(e.into()),
                        }
                    }
                }
            }
        }
    }

    /// Takes finished compute commands and state writes while the send buffer has room for
    /// their responses (device completions wait in the channel likewise). Returns how many.
    fn take_done(&mut self) -> usize {
        let mut n = 0;
        while self.core.tx.pending() <= limits::TX_PENDING_BYTES_MAX {
            let Ok(d) = self.done_rx.try_recv() else { break };
            self.core.on_done(d);
            n += 1;
        }
        n
    }

    /// Brings the target's buffer gauges up to date with this connection's buffers.
    fn account_memory(&mut self) {
        let now = self.core.buffer_bytes(&self.rx);
        let stats = &self.core.target.stats;
        if now != self.core.reported_bytes {
            stats.buffer_bytes.fetch_add(now as i64 - self.core.reported_bytes as i64, Relaxed);
            stats.connection_buffer_bytes_max.fetch_max(now as u64, Relaxed);
            self.core.reported_bytes = now;
        }
    }

    /// Polls the socket and the pool's completions for up to the target's busy-poll window
    /// before the loop parks in epoll. Between attempts the
    /// task yields, so other connections on this thread keep running.
    async fn busy_poll(&mut self) -> Result<Polled, ConnError> {
        let window = self.core.target.busy_poll;
        if window.is_zero() || self.core.close_after_flush {
            return Ok(Polled::Idle);
        }
        let until = Instant::now() + window;
        loop {
            match self.rx.fill_now(&self.stream) {
                Ok(0) => return Ok(Polled::Closed),
                Ok(_) => return Ok(Polled::Activity),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e.into()),
            }
            if self.core.poll_io() + self.take_done() > 0 {
                return Ok(Polled::Activity);
            }
            if self.cancel.is_cancelled() || Instant::now() >= until {
                return Ok(Polled::Idle);
            }
            tokio::task::yield_now().await;
        }
    }

    /// Reads the ICReq and answers it. Ok(false): the host closed first.
    async fn handshake(&mut self) -> Result<bool, ConnError> {
        loop {
            match pdu::parse_frame(self.rx.data(), &self.core.framing) {
                Ok(Some(f)) => {
                    let len = f.len;
                    if f.hdr.pdu_type != PduType::IcReq {
                        let e = PduError::new(fes::PDU_SEQUENCE_ERROR, 0, "first PDU is not ICReq");
                        return Err(self.core.fatal(e, f.header));
                    }
                    let req = IcReq::decode(f.header);
                    if req.pfv != 0 {
                        let e = PduError::new(fes::UNSUPPORTED_PARAMETER, 8, "unsupported PDU format version");
                        return Err(self.core.fatal(e, f.header));
                    }
                    if req.hpda > 31 {
                        return Err(self.core.fatal(PduError::header(10, "HPDA above 31"), f.header));
                    }
                    self.rx.consume(len);
                    self.core.accept_ic(&req);
                    return Ok(true);
                }
                Ok(None) => {}
                Err(e) => {
                    let n = self.rx.data().len().min(pdu::TERM_DATA_MAX);
                    let hdr = self.rx.data()[..n].to_vec();
                    return Err(self.core.fatal(e, &hdr));
                }
            }
            self.stream.ready(Interest::READABLE).await?;
            match self.rx.fill(&self.stream) {
                Ok(0) => return Ok(false),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Handles every complete PDU in the receive buffer.
    fn process_rx(&mut self) -> Result<Flow, ConnError> {
        self.stalled = false;
        loop {
            if self.core.tx.pending() > limits::TX_PENDING_BYTES_MAX {
                self.stalled = !self.rx.data().is_empty();
                break;
            }
            let frame = match pdu::parse_frame(self.rx.data(), &self.core.framing) {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => {
                    let n = self.rx.data().len().min(pdu::TERM_DATA_MAX);
                    let hdr = self.rx.data()[..n].to_vec();
                    return Err(self.core.fatal(e, &hdr));
                }
            };
            let len = frame.len;
            match self.core.on_pdu(&frame) {
                Ok(Flow::Continue) => {}
                Ok(Flow::Close) => return Ok(Flow::Close),
                Err(ConnError::Fatal(e)) => return Err(self.core.fatal(e, frame.header)),
                Err(e) => return Err(e),
            }
            self.rx.consume(len);
            if !self.bound {
                if let Some(q) = &self.core.queue {
                    // From Connect on, the connection lives as long as its controller.
                    self.core.cancel = q.ctrl.cancel.child_token();
                    self.cancel = self.core.cancel.clone();
                    self.bound = true;
                    if let Some(t) = &self.ticket {
                        t.connected();
                    }
                }
            }
        }
        Ok(Flow::Continue)
    }

    async fn flush_quickly(&mut self) -> io::Result<()> {
        match tokio::time::timeout(Duration::from_millis(limits::TERM_FLUSH_TIMEOUT_MS), self.core.tx.flush_all(&self.stream)).await {
            Ok(r) => r,
            Err(_) => Err(io::ErrorKind::TimedOut.into()),
        }
    }
}

fn fatal(fes: u16, fei: u32, what: &'static str) -> ConnError {
    ConnError::Fatal(PduError::new(fes, fei, what))
}

impl Core {
    fn accept_ic(&mut self, req: &IcReq) {
        let resp = IcResp { pfv: 0, cpda: 0, hdgst: req.hdgst, ddgst: req.ddgst, maxh2cdata: limits::H2C_DATA_BYTES_MAX };
        resp.encode(&mut self.tx.buf);
        self.hpda = req.hpda;
        self.framing = Framing {
            hdgst: req.hdgst,
            ddgst: req.ddgst,
            from_host: true,
            capsule_data_max: limits::IN_CAPSULE_BYTES_MAX as u32,
            data_pdu_max: limits::H2C_DATA_BYTES_MAX,
        };
        debug!(peer = %self.peer, hdgst = req.hdgst, ddgst = req.ddgst, hpda = req.hpda, "ICReq accepted");
    }

    /// Queues a C2HTermReq carrying the offending header; the caller then closes.
    fn fatal(&mut self, e: PduError, header: &[u8]) -> ConnError {
        pdu::put_term_req(&mut self.tx.buf, PduType::C2HTermReq, &e, header);
        ConnError::Fatal(e)
    }

    fn on_pdu(&mut self, f: &Frame) -> Result<Flow, ConnError> {
        match f.hdr.pdu_type {
            PduType::CapsuleCmd => {
                self.on_capsule(pdu::capsule_sqe(f.header), f.data, f.data_digest_ok)?;
                Ok(if self.close_after_flush { Flow::Close } else { Flow::Continue })
            }
            PduType::H2CData => {
                self.on_h2c_data(f)?;
                Ok(Flow::Continue)
            }
            PduType::H2CTermReq => {
                let (fes, fei) = pdu::term_req_decode(f.header);
                Err(ConnError::HostTerminated { fes, fei })
            }
            _ => Err(fatal(fes::PDU_SEQUENCE_ERROR, 0, "ICReq after the connection was initialised")),
        }
    }

    fn hd(&self) -> bool {
        self.framing.hdgst
    }

    /// Completes a command: its CapsuleResp. Every completion of every command (admin,
    /// fabrics, I/O, compute) ends here or in a C2HData with the SUCCESS flag
    /// ([`finish_data`](Self::finish_data)), consuming its request.
    fn complete(&mut self, req: Request, status: Status, dw0: u32, dw1: u32) {
        let cid = req.finish();
        let (sqid, sqhd) = match &self.queue {
            Some(q) if q.sqflow_disabled => (q.qid, 0xffff),
            Some(q) => (q.qid, self.sqhd),
            None => (0, self.sqhd),
        };
        let cqe = Cqe { dw0, dw1, sqhd, sqid, cid, status };
        let hd = self.hd();
        pdu::put_capsule_resp(&mut self.tx.buf, &cqe, hd);
        if !status.is_success() {
            if let Some(q) = &self.queue {
                debug!(peer = %self.peer, qid = q.qid, cid, %status, "command failed");
            }
        }
    }

    /// Starts a C2HData of `len` bytes; returns where its data goes in the send buffer.
    fn begin_c2h(&mut self, cid: u16, len: usize, success: bool) -> usize {
        let mut fl = flags::LAST_PDU;
        if success {
            fl |= flags::SUCCESS;
        }
        let h = DataHdr { cccid: cid, ttag: 0, offset: 0, len: len as u32 };
        pdu::put_header_aligned(&mut self.tx.buf, PduType::C2HData, fl, &h.psh(), len, self.framing.hdgst, self.framing.ddgst, self.hpda)
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
            let start = self.begin_c2h(req.cid(), data.len(), success);
            self.tx.buf.extend_from_slice(data);
            pdu::put_data_digest(&mut self.tx.buf, start, self.framing.ddgst);
        }
        if !success || data.is_empty() {
            self.complete(req, r.status, r.dw0, r.dw1);
        } else {
            self.finish_data(req);
        }
    }

    /// Completes a command whose C2HData carried the SUCCESS flag: no CapsuleResp.
    fn finish_data(&mut self, req: Request) {
        let _ = req.finish();
    }

    /// A queue closing: its outstanding commands complete nowhere; counted and logged.
    fn abandon_outstanding(&mut self) {
        let mut n = 0;
        for x in self.r2t.slots.iter_mut().filter_map(Option::take) {
            x.req.abandon();
            n += 1;
        }
        for x in self.inflight.slots.iter_mut().filter_map(Option::take) {
            x.req.abandon();
            n += 1;
        }
        for r in self.aers.drain(..) {
            r.abandon();
            n += 1;
        }
        self.r2t = Slab::default();
        self.inflight = Slab::default();
        if n > 0 {
            debug!(peer = %self.peer, qid = self.queue.as_ref().map_or(0, |q| q.qid), commands = n, "queue closed with commands outstanding");
        }
    }

    /// The fatal error of a host with more commands outstanding than its queue holds; the
    /// command that overflowed it ends with the queue.
    fn overflow(&self, req: Request) -> ConnError {
        req.abandon();
        fatal(fes::PDU_SEQUENCE_ERROR, 0, "more commands outstanding than the queue size")
    }

    fn take_buf(&mut self) -> AlignedBuf {
        self.bufs.pop().unwrap_or_else(|| {
            self.data_bufs += 1;
            AlignedBuf::new(limits::TRANSFER_BYTES_MAX)
        })
    }

    fn put_buf(&mut self, b: AlignedBuf) {
        if self.bufs.len() < limits::QUEUE_DEPTH_MAX as usize {
            self.bufs.push(b);
        } else {
            self.data_bufs -= 1;
        }
    }

    /// Bytes of buffers this connection holds (see limits::connection_memory_max).
    fn buffer_bytes(&self, rx: &RxBuf) -> usize {
        rx.capacity() + self.tx.buf.capacity() + self.data_bufs * limits::TRANSFER_BYTES_MAX + self.chan.memory_bytes()
    }

    fn outstanding_limit(&self) -> usize {
        self.queue.as_ref().map_or(1, |q| q.sqsize as usize + 1)
    }

    fn on_capsule(&mut self, sqe: Sqe, data: &[u8], digest_ok: bool) -> Result<(), ConnError> {
        let cid = sqe.cid();
        let req = Request::new(&self.requests, cid, Instant::now());
        if let Some(q) = &self.queue {
            self.sqhd = (self.sqhd + 1) % (q.sqsize + 1);
            q.ctrl.touch();
        }
        if !digest_ok {
            peer_warn!(self.target.log_limit, self.peer.as_str(), "data digest error on a command capsule", cid);
            self.complete(req, Status::TRANSIENT_TRANSPORT_ERROR, 0, 0);
            return Ok(());
        }
        if sqe.psdt() != 1 {
            self.complete(req, Status::INVALID_FIELD.dnr(), 0, 0);
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

    /// Sends an R2T for `len` bytes, a command's whole data, after checking the command is valid.
    fn request_data(&mut self, sqe: Sqe, len: usize, req: Request) -> Result<(), ConnError> {
        let cid = sqe.cid();
        if len > limits::TRANSFER_BYTES_MAX {
            self.complete(req, Status::INVALID_FIELD.dnr(), 0, 0);
            return Ok(());
        }
        if let Some(q) = self.queue.as_ref().filter(|q| q.qid > 0 && !compute::is_compute(sqe.opcode())) {
            let checked = if io_cmd::is_reservation(sqe.opcode()) {
                io_cmd::check_reservation(&q.ctrl.subsys, &q.ctrl.hostid, &sqe).map(drop)
            } else {
                io_cmd::plan(&q.ctrl.subsys, &q.ctrl.hostid, &sqe, true).map(drop)
            };
            if let Err(s) = checked {
                let ctrl = q.ctrl.clone();
                self.fail_io(&ctrl, &sqe, req, s);
                return Ok(());
            }
        }
        if self.r2t.live + self.inflight.live >= self.outstanding_limit() {
            return Err(self.overflow(req));
        }
        let mut buf = self.take_buf();
        buf.set_len(len);
        let ttag = self.r2t.insert(H2C { sqe, buf, received: 0, req, aborted: false });
        let hd = self.hd();
        pdu::put_r2t(&mut self.tx.buf, &DataHdr { cccid: cid, ttag: ttag as u16, offset: 0, len: len as u32 }, hd);
        Ok(())
    }

    fn on_h2c_data(&mut self, f: &Frame) -> Result<(), ConnError> {
        let h = DataHdr::decode(f.header);
        let Some(x) = self.r2t.get_mut(h.ttag as usize) else {
            return Err(fatal(fes::INVALID_HEADER_FIELD, 10, "H2CData with an unknown transfer tag"));
        };
        if x.sqe.cid() != h.cccid {
            return Err(fatal(fes::INVALID_HEADER_FIELD, 8, "H2CData command id does not match its transfer tag"));
        }
        if h.offset as usize != x.received {
            return Err(fatal(fes::DATA_OUT_OF_RANGE, 12, "H2CData out of order (DATAO is not the next expected offset)"));
        }
        let end = x.received + f.data.len();
        if end > x.buf.len() {
            return Err(fatal(fes::DATA_OUT_OF_RANGE, 16, "H2CData beyond the R2T's range"));
        }
        let last = f.hdr.flags & flags::LAST_PDU != 0;
        if last != (end == x.buf.len()) {
            return Err(fatal(fes::INVALID_HEADER_FIELD, 1, "LAST_PDU flag does not match the end of the transfer"));
        }
        x.buf[x.received..end].copy_from_slice(f.data);
        x.received = end;
        if !f.data_digest_ok {
            // The data is bad; the command fails, the connection stays (NVMe/TCP 1.0, 3.6.2.x).
            let x = self.r2t.remove(h.ttag as usize).expect("present");
            peer_warn!(self.target.log_limit, self.peer.as_str(), "data digest error on H2CData", cid = h.cccid);
            self.put_buf(x.buf);
            self.complete(x.req, Status::TRANSIENT_TRANSPORT_ERROR, 0, 0);
            return Ok(());
        }
        if last {
            let x = self.r2t.remove(h.ttag as usize).expect("present");
            if x.aborted {
                self.put_buf(x.buf);
                match self.queue.as_ref().map(|q| q.ctrl.clone()) {
                    Some(ctrl) => self.fail_io(&ctrl, &x.sqe, x.req, Status::ABORTED_PREEMPT),
                    None => self.complete(x.req, Status::ABORTED_PREEMPT, 0, 0),
                }
                return Ok(());
            }
            return self.execute_buffered(x.sqe, x.buf, x.req);
        }
        Ok(())
    }

    /// Runs a command whose host data sits in a pool buffer.
    fn execute_buffered(&mut self, sqe: Sqe, buf: AlignedBuf, req: Request) -> Result<(), ConnError> {
        if self.queue.as_ref().is_some_and(|q| q.qid > 0) {
            return self.execute_io(sqe, &[], Some(buf), req);
        }
        let r = self.execute(sqe, &buf, req);
        self.put_buf(buf);
        r
    }

    fn execute(&mut self, sqe: Sqe, data: &[u8], req: Request) -> Result<(), ConnError> {
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

    fn fabrics(&mut self, sqe: Sqe, data: &[u8], req: Request) -> Result<(), ConnError> {
        let r = match (sqe.fctype(), &self.queue) {
            (fctype::CONNECT, None) => match fabrics::connect(&self.target, &sqe, data, self.port.discovery, &self.peer) {
                Ok(c) => {
                    let r = Reply { dw1: c.dw1, ..Reply::dw0(c.ctrl.cntlid as u32) };
                    if c.qid == 0 {
                        spawn_keep_alive_watchdog(self.target.clone(), c.ctrl.clone());
                    }
                    self.sqhd = 1 % (c.sqsize + 1);
                    c.ctrl.attach_queue(c.qid, self.abort_tx.clone());
                    self.queue =
                        Some(Queue { ctrl: c.ctrl, qid: c.qid, sqsize: c.sqsize, sqflow_disabled: c.sqflow_disabled, _memory: c.memory });
                    r
                }
                Err(r) => r,
            },
            (fctype::CONNECT, Some(_)) => Reply::status(Status::COMMAND_SEQUENCE_ERROR.dnr()),
            (_, None) => Reply::status(Status::COMMAND_SEQUENCE_ERROR.dnr()),
            (fctype::PROPERTY_GET, Some(q)) if q.qid == 0 => fabrics::property_get(&q.ctrl, &sqe),
            (fctype::PROPERTY_SET, Some(q)) if q.qid == 0 => fabrics::property_set(&self.target, &self.peer, &q.ctrl, &sqe),
            (fctype::DISCONNECT, Some(_)) => {
                self.close_after_flush = true;
                Reply::ok()
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
    /// buffer) or `buf` (gathered from H2CData).
    fn execute_io(&mut self, sqe: Sqe, data: &[u8], buf: Option<AlignedBuf>, req: Request) -> Result<(), ConnError> {
        let ctrl = self.queue.as_ref().expect("I/O queue").ctrl.clone();
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
        let plan = match io_cmd::plan(&ctrl.subsys, &ctrl.hostid, &sqe, ctrl.write_cache.load(Relaxed)) {
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
        // Deallocate: turn the host's ranges into byte ranges before anything runs.
        let (op, buf) = if let Op::Deallocate = op {
            let src = buf.as_deref().unwrap_or(data).to_vec();
            let mut b = buf.unwrap_or_else(|| self.take_buf());
            if let Err(s) = io_cmd::dsm_ranges(&ns, &sqe, &src, &mut b) {
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
                if let Some(r) = ns.dev.write_now(buf.as_deref().unwrap_or(data), off, fua) {
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
        if self.r2t.live + self.inflight.live >= self.outstanding_limit() {
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
        Ok(())
    }

    /// Takes device completions while the send buffer has room for their responses (they
    /// wait in the channel otherwise: this bounds the send buffer,
    /// limits::connection_memory_max). Returns how many.
    fn poll_io(&mut self) -> usize {
        self.chan.submit();
        let mut n = 0;
        while self.tx.pending() <= limits::TX_PENDING_BYTES_MAX {
            let mut done = std::mem::take(&mut self.completed);
            let k = self.chan.poll(limits::REAP_BATCH, &mut done);
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

    /// A read from a device that completes at once: a C2HData header, then the data lent by
    /// the device, copied into the send buffer or, from WRITE_THROUGH_BYTES_MIN on, sent
    /// from the device's memory with one writev (no copy). None: the device cannot, and the
    /// send buffer is as it was. Ok(true): the data carried the SUCCESS flag.
    fn read_now(&mut self, ns: &Namespace, off: u64, len: usize, cid: u16) -> Option<io::Result<bool>> {
        let success = self.success_flag();
        let mark = self.tx.buf.len();
        let dstart = self.begin_c2h(cid, len, success);
        let (tx, fd, ddgst) = (&mut self.tx, self.fd, self.framing.ddgst);
        let direct = len >= limits::WRITE_THROUGH_BYTES_MIN;
        let r = ns.dev.read_now(off, len, &mut |slices| {
            if !direct || slices.len() > 2 {
                for s in slices {
                    tx.buf.extend_from_slice(s);
                }
                pdu::put_data_digest(&mut tx.buf, dstart, ddgst);
                return;
            }
            let mut parts: [&[u8]; 3] = [&[]; 3];
            let n = slices.len();
            parts[..n].copy_from_slice(slices);
            let crc = if ddgst { slices.iter().fold(0, |c, s| crc32c::crc32c_append(c, s)) } else { 0 }.to_le_bytes();
            let mut k = n;
            if ddgst {
                parts[k] = &crc;
                k += 1;
            }
            tx.write_through(fd, &parts[..k]);
        });
        match r {
            Some(Ok(())) => Some(Ok(success)),
            other => {
                self.tx.buf.truncate(mark);
                other.map(|r| r.map(|()| success))
            }
        }
    }

    fn finish_io(&mut self, ns: &Namespace, kind: IoKind, len: usize, req: Request, data_sent_with_success: bool) {
        match kind {
            IoKind::Read => {
                ns.stats.reads.fetch_add(1, Relaxed);
                ns.stats.read_bytes.fetch_add(len as u64, Relaxed);
            }
            IoKind::Write => {
                ns.stats.writes.fetch_add(1, Relaxed);
                ns.stats.written_bytes.fetch_add(len as u64, Relaxed);
            }
            IoKind::Other | IoKind::Compute | IoKind::Reservation => {
                ns.stats.other.fetch_add(1, Relaxed);
            }
        }
        ns.stats.latency.record(req.start().elapsed());
        if data_sent_with_success {
            self.finish_data(req);
        } else {
            self.complete(req, Status::SUCCESS, 0, 0);
        }
    }

    fn io_error(&mut self, ctrl: &Controller, ns: &Namespace, kind: IoKind, lba: u64, req: Request, e: io::Error) {
        let status = match kind {
            IoKind::Read => Status::UNRECOVERED_READ_ERROR,
            _ => Status::WRITE_FAULT,
        };
        peer_warn!(self.target.log_limit, self.peer.as_str(), "backend I/O failed", nsid = ns.nsid, lba, error = %e);
        ns.stats.errors.fetch_add(1, Relaxed);
        let qid = self.queue.as_ref().map_or(0, |q| q.qid);
        ctrl.record_error(ErrorEntry { sqid: qid, cid: req.cid(), status: status.to_field(), lba, nsid: ns.nsid, ..Default::default() });
        self.complete(req, status, 0, 0);
    }

    /// A compute command or a state write finished.
    fn on_done(&mut self, d: Done) {
        match d {
            Done::Computed { token, computed } => self.on_computed(token, *computed),
            Done::Persisted { token, result } => self.on_persisted(token, result),
            Done::Abort { nsid, guard } => self.abort_commands(nsid, guard),
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
        match result {
            Ok(()) if x.kind == IoKind::Read => {
                let success = self.success_flag();
                let dstart = self.begin_c2h(x.req.cid(), x.len, success);
                self.tx.buf.extend_from_slice(&buf[..x.len]);
                pdu::put_data_digest(&mut self.tx.buf, dstart, self.framing.ddgst);
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
                t.abort(guard.clone());
                stopped = true;
                x.held.push(guard.clone());
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
            for w in self.r2t.slots.iter_mut().flatten().filter(|w| w.sqe.nsid() == nsid && !io_cmd::is_reservation(w.sqe.opcode())) {
                w.aborted = true;
            }
        }
        if stopped {
            // Queued ones leave the engine's queue now.
            self.target.offload.kick();
        }
    }

    /// Completes outstanding AERs while events are pending.
    fn deliver_events(&mut self) {
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
    fn detach(&mut self) {
        let Some(q) = self.queue.take() else { return };
        q.ctrl.detach_queue(q.qid);
        if q.qid == 0 {
            info!(peer = %self.peer, cntlid = q.ctrl.cntlid, subnqn = %q.ctrl.subsys.nqn, "controller removed");
            q.ctrl.subsys.remove_controller(q.ctrl.cntlid);
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
                ctrl.subsys.remove_controller(ctrl.cntlid);
                return;
            }
        }
    });
}
