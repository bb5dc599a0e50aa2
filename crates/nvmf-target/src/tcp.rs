//! The NVMe/TCP transport: one task per connection (one queue), generic over the byte
//! stream. It moves PDUs and data buffers and nothing else: ICReq/ICResp, digests, command
//! capsules handed to the queue's execution core ([`crate::exec::Core`]), R2T and H2CData
//! for the data the core fetches, C2HData (with the SUCCESS flag) and CapsuleResp for what
//! it sends ([`TcpTx`], the core's [`Transport`]).
//!
//! Per batch of received bytes the loop parses every complete PDU and hands each command
//! to the core, which runs what can run at once (memory backends, admin commands) straight
//! into the send buffer and starts the rest elsewhere; the loop takes their completions
//! while the send buffer has room, and writes everything with as few syscalls as the
//! socket allows.

use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nearstore_transport::{Interest, RxBuf, Stream, TxBuf};
use nearstore_wire::pdu::{self, fes, flags, DataHdr, Frame, Framing, IcReq, IcResp, PduError, PduType};
use nearstore_wire::Cqe;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::admission::Ticket;
use crate::dev::BlockDevice;
use crate::exec::{Core, Overflow, Replies, Transport};
use crate::io_pool::Done;
use crate::limits;
use crate::log_limit::peer_warn;
use crate::subsystem::Namespace;
use crate::{Port, Target};

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

impl From<Overflow> for ConnError {
    fn from(_: Overflow) -> ConnError {
        fatal(fes::PDU_SEQUENCE_ERROR, 0, "more commands outstanding than the queue size")
    }
}

/// Serves one connection until it closes, then detaches it from its controller.
/// `ticket`: its place among the target's connections (None for in-process streams).
pub async fn serve<S: Stream>(stream: S, target: Arc<Target>, port: Arc<Port>, local: Option<SocketAddr>, ticket: Option<Ticket>) {
    target.stats.connections.fetch_add(1, Relaxed);
    target.stats.connections_total.fetch_add(1, Relaxed);
    let peer = stream.peer();
    let xport = TcpTx::new();
    let (mut core, Replies { done: done_rx, abort: abort_rx }) = Core::new(target.clone(), port, local, peer.clone(), xport);
    let cancel = ticket.as_ref().map_or_else(CancellationToken::new, |t| t.evicted().clone());
    core.ticket = ticket;
    let mut conn = Conn {
        stream,
        rx: RxBuf::new(limits::RX_BUFFER_BYTES),
        done_rx,
        abort_rx,
        memory_rx: target.memory.subscribe(),
        cancel,
        connect_by: tokio::time::Instant::now() + Duration::from_millis(target.limits.connect_timeout_ms),
        bound: false,
        stalled: false,
        buffer_stalled: false,
        reported_bytes: 0,
        core,
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
    target.stats.buffer_bytes.fetch_sub(conn.reported_bytes as i64, Relaxed);
    target.stats.connections.fetch_sub(1, Relaxed);
}

struct Conn<S> {
    stream: S,
    rx: RxBuf,
    done_rx: UnboundedReceiver<Done>,
    /// Other hosts' Preempt and Abort requests ([`Done::Abort`]), taken whether or not the
    /// send buffer has room: handling one sends nothing.
    abort_rx: UnboundedReceiver<Done>,
    /// Changes of the memory budget that matter to a queue (crate::memory::Memory::subscribe).
    memory_rx: watch::Receiver<u64>,
    /// Before Connect: fires when the connection is evicted; after: the connection's own
    /// token, which fires when its controller goes.
    cancel: CancellationToken,
    /// Connect must succeed by then (limits.connect_timeout_ms from accept).
    connect_by: tokio::time::Instant,
    bound: bool,
    /// process_rx stopped with bytes unread because the send buffer was full.
    stalled: bool,
    /// process_rx stopped before a command because the budget could not give the queue a
    /// data buffer ([`Core::buf_ready`]); the queue waits for one to come back.
    buffer_stalled: bool,
    /// Buffer bytes last added to the target's gauge.
    reported_bytes: usize,
    core: Core<TcpTx>,
}

/// The sending half of an NVMe/TCP connection: what the execution core has sent, as PDUs
/// in the send buffer, and the large reads whose data waits in their devices' memory until
/// the send ([`TcpTx::flush`]).
pub struct TcpTx {
    tx: TxBuf,
    framing: Framing,
    hpda: u8,
    /// Reads lent by their devices ([`Transport::send_from`]), in the order of their places
    /// in the send buffer; at most limits::TX_LENT_READS_MAX.
    lent: Vec<Lent>,
    /// Their bytes not yet sent.
    lent_bytes: usize,
    /// Read data of WRITE_THROUGH_BYTES_MIN bytes and more copied into the send buffer, and
    /// sends the socket cut short, since the connection last reported them
    /// ([`TcpTx::take_counts`]).
    copied: u64,
    partial: u64,
}

/// A read whose data stays in its device until it is sent: its C2HData header is in the
/// send buffer, the data not yet sent (`len` bytes of the device at `off`) goes at `at`, and
/// with data digests on, the digest's four bytes are `at..at + 4`.
struct Lent {
    dev: Arc<dyn BlockDevice>,
    off: u64,
    len: usize,
    at: usize,
    /// The namespace's block: a send cut short inside one copies its rest, so that a
    /// write between two sends never tears a block.
    block: usize,
    /// CRC32C of the PDU's data sent before `off`.
    crc: u32,
}

/// The most slices a lent read comes in: a memory backend's stripes are at least
/// TRANSFER_BYTES_MAX, so a read spans two at most.
const LENT_PARTS_MAX: usize = 2;
/// iovecs of one gathering send: the send buffer before, between and after the lent reads,
/// and their slices.
const GATHER_IOV_MAX: usize = 1 + limits::TX_LENT_READS_MAX * (1 + LENT_PARTS_MAX);
const _: () = assert!(GATHER_IOV_MAX <= 1024, "IOV_MAX");

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
            self.core.send_deferred();
            if self.core.is_admin() && self.core.room() {
                // Busy-polling may skip the select below, where events are otherwise noticed.
                self.core.deliver_events();
            }
            self.core.xport.flush(&self.stream)?;
            if self.core.close_after_flush && self.core.xport.pending() == 0 {
                return Ok(());
            }
            self.core.trim();
            self.account_memory();
            // Completions are taken, and commands read, only while the send buffer has room
            // for their responses.
            let room = self.core.room();
            // Commands left in the receive buffer while the send buffer was full: the
            // socket will not wake us for them, so go round again once there is room.
            if self.stalled && room {
                continue;
            }
            // A command waits for a data buffer: go round again once there is one (ours
            // came back, or the budget gives one); else this queue waits for the budget, and
            // the others give back what they do not use.
            if self.buffer_stalled {
                if self.core.buf_ready() {
                    continue;
                }
                self.core.wait_for_memory();
            }
            // Completions left in the ring while the send buffer was full: the eventfd
            // signal that announced them was consumed then and will not come again, so
            // waiting on it would hang the queue (seen with busy-polling off: a host
            // waiting for 8 reads whose completions sat in the ring). Take them now.
            if room && self.core.chan.has_completions() {
                continue;
            }
            // While a command waits in the receive buffer, nothing more is read (the socket
            // is watched only to send).
            let reading = !self.stalled && !self.buffer_stalled;
            let pending = self.core.xport.pending() > 0;
            let interest = match (room && reading, pending) {
                (true, false) => Interest::READABLE,
                (true, true) => Interest::READABLE | Interest::WRITABLE,
                (false, _) => Interest::WRITABLE,
            };
            let watch_socket = reading || pending;
            if !pending && reading {
                match self.busy_poll().await? {
                    Polled::Activity => continue,
                    Polled::Closed => return Ok(()),
                    Polled::Idle => {}
                }
            }
            let events = self.core.controller().filter(|_| self.core.is_admin() && self.core.has_aers()).cloned();
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
                    return Err(ConnError::ControllerGone(self.core.controller().map_or(0, |c| c.cntlid)));
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
                _ = async { events.as_ref().expect("guarded").events.notified().await }, if events.is_some() && room => {
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
                // A queue waits for memory, or memory came back: go round (give back what
                // is unused, or try again).
                r = self.memory_rx.changed(), if self.bound => {
                    if r.is_ok() {
                        self.memory_rx.borrow_and_update();
                    }
                }
                r = self.stream.ready(interest), if watch_socket => {
                    let r = r?;
                    if reading && (r.is_readable() || r.is_read_closed()) {
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
        while self.core.room() {
            let Ok(d) = self.done_rx.try_recv() else { break };
            self.core.on_done(d);
            n += 1;
        }
        n
    }

    /// Brings the target's buffer gauges and send counters up to date with this
    /// connection's.
    fn account_memory(&mut self) {
        let now = self.rx.capacity() + self.core.xport.tx.buf.capacity() + self.core.buffer_bytes();
        let stats = &self.core.target.stats;
        let (copied, partial) = self.core.xport.take_counts();
        if copied + partial > 0 {
            stats.tx_copied_bytes.fetch_add(copied, Relaxed);
            stats.tx_partial_writes.fetch_add(partial, Relaxed);
        }
        if now != self.reported_bytes {
            stats.buffer_bytes.fetch_add(now as i64 - self.reported_bytes as i64, Relaxed);
            stats.connection_buffer_bytes_max.fetch_max(now as u64, Relaxed);
            self.reported_bytes = now;
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
            match pdu::parse_frame(self.rx.data(), &self.core.xport.framing) {
                Ok(Some(f)) => {
                    let len = f.len;
                    if f.hdr.pdu_type != PduType::IcReq {
                        let e = PduError::new(fes::PDU_SEQUENCE_ERROR, 0, "first PDU is not ICReq");
                        return Err(self.core.xport.fatal(e, f.header));
                    }
                    let req = IcReq::decode(f.header);
                    if req.pfv != 0 {
                        let e = PduError::new(fes::UNSUPPORTED_PARAMETER, 8, "unsupported PDU format version");
                        return Err(self.core.xport.fatal(e, f.header));
                    }
                    if req.hpda > 31 {
                        return Err(self.core.xport.fatal(PduError::header(10, "HPDA above 31"), f.header));
                    }
                    self.rx.consume(len);
                    self.core.xport.accept_ic(&req, &self.core.peer);
                    return Ok(true);
                }
                Ok(None) => {}
                Err(e) => {
                    let n = self.rx.data().len().min(pdu::TERM_DATA_MAX);
                    let hdr = self.rx.data()[..n].to_vec();
                    return Err(self.core.xport.fatal(e, &hdr));
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
        self.buffer_stalled = false;
        loop {
            if !self.core.room() {
                self.stalled = !self.rx.data().is_empty();
                break;
            }
            let frame = match pdu::parse_frame(self.rx.data(), &self.core.xport.framing) {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => {
                    let n = self.rx.data().len().min(pdu::TERM_DATA_MAX);
                    let hdr = self.rx.data()[..n].to_vec();
                    return Err(self.core.xport.fatal(e, &hdr));
                }
            };
            // Every command finds a data buffer in the queue's pool: it is read only then,
            // and waits in the receive buffer meanwhile (H2CData PDUs need none: the
            // command they are for holds one).
            if frame.hdr.pdu_type == PduType::CapsuleCmd && !self.core.buf_ready() {
                self.buffer_stalled = true;
                break;
            }
            let len = frame.len;
            match on_pdu(&mut self.core, &frame) {
                Ok(Flow::Continue) => {}
                Ok(Flow::Close) => return Ok(Flow::Close),
                Err(ConnError::Fatal(e)) => return Err(self.core.xport.fatal(e, frame.header)),
                Err(e) => return Err(e),
            }
            self.rx.consume(len);
            if !self.bound && self.core.controller().is_some() {
                // From Connect on, the connection lives as long as its controller
                // (the core bound its token to the controller's).
                self.cancel = self.core.cancel.clone();
                self.bound = true;
                if let Some(t) = &self.core.ticket {
                    t.connected();
                }
            }
        }
        if !self.buffer_stalled {
            self.core.memory_came();
        }
        Ok(Flow::Continue)
    }

    async fn flush_quickly(&mut self) -> io::Result<()> {
        match tokio::time::timeout(Duration::from_millis(limits::TERM_FLUSH_TIMEOUT_MS), self.core.xport.flush_all(&self.stream)).await {
            Ok(r) => r,
            Err(_) => Err(io::ErrorKind::TimedOut.into()),
        }
    }
}

/// One gathering send ([`TcpTx::gather`]) being built: the iovecs so far as raw parts,
/// valid while the lent reads' locks are held (down the recursion of [`Gather::level`]) and
/// the send buffer does not move.
struct Gather<'a> {
    buf: &'a mut Vec<u8>,
    lent: &'a [Lent],
    ddgst: bool,
    parts: [(*const u8, usize); GATHER_IOV_MAX],
    n: usize,
    /// Per lent read: its first data part in `parts` and how many.
    data: [(u16, u8); limits::TX_LENT_READS_MAX],
    /// Where the unsent bytes of `buf` start.
    sent: usize,
}

/// What one gathering send did.
struct Gathered {
    written: usize,
    total: usize,
    /// The send buffer is sent up to here.
    sent_to: usize,
    /// Lent reads sent whole.
    done: usize,
    cut: Option<Cut>,
}

/// A lent read the socket cut short (with the rest of its block copied in).
struct Cut {
    idx: usize,
    /// Its data bytes now sent or copied into the send buffer.
    took: usize,
    /// CRC32C of its data up to there.
    crc: u32,
    /// Bytes copied into the send buffer at its place.
    rest: usize,
}

impl Gather<'_> {
    fn push(&mut self, p: *const u8, len: usize) {
        self.parts[self.n] = (p, len);
        self.n += 1;
    }

    /// Adds the send buffer up to lent read `i` and its data, then goes on with the next
    /// read under this one's lock; the last level writes.
    fn level(&mut self, i: usize, write: &mut dyn FnMut(&[IoSlice<'_>]) -> io::Result<usize>) -> io::Result<Gathered> {
        let lent = self.lent;
        let prev = if i == 0 { self.sent } else { lent[i - 1].at };
        let Some(l) = lent.get(i) else {
            let end = self.buf.len();
            self.push(self.buf[prev..].as_ptr(), end - prev);
            return self.send(write);
        };
        self.push(self.buf[prev..].as_ptr(), l.at - prev);
        let mut out = None;
        l.dev.read_lent(l.off, l.len, &mut |slices| {
            if slices.len() > LENT_PARTS_MAX || slices.iter().map(|s| s.len()).sum::<usize>() != l.len {
                out = Some(Err(io::Error::other(format!("a lent read of {} bytes came in {} slices", l.len, slices.len()))));
                return;
            }
            if self.ddgst {
                let crc = slices.iter().fold(l.crc, |c, s| crc32c::crc32c_append(c, s));
                self.buf[l.at..l.at + pdu::DIGEST_LEN].copy_from_slice(&crc.to_le_bytes());
            }
            self.data[i] = (self.n as u16, slices.len() as u8);
            for s in slices {
                self.push(s.as_ptr(), s.len());
            }
            out = Some(self.level(i + 1, write));
        })?;
        out.unwrap_or_else(|| Err(io::Error::other("a lent read lent no bytes")))
    }

    /// The write, with every lock held; then, of a read cut short, the rest of its block
    /// copied into the send buffer at its place.
    fn send(&mut self, write: &mut dyn FnMut(&[IoSlice<'_>]) -> io::Result<usize>) -> io::Result<Gathered> {
        let mut iov = [IoSlice::new(&[]); GATHER_IOV_MAX];
        let mut total = 0;
        for (v, &(p, len)) in iov.iter_mut().zip(&self.parts[..self.n]) {
            // SAFETY: each part points into the send buffer (not touched until the write
            // returns) or into memory a device lends while the lock of the level that
            // pushed it is held, which it is until this returns.
            *v = IoSlice::new(unsafe { std::slice::from_raw_parts(p, len) });
            total += len;
        }
        let written = write(&iov[..self.n])?;
        let mut out = Gathered { written, total, sent_to: self.sent, done: 0, cut: None };
        // Walk the parts: the send buffer before read i, then read i's data.
        let mut left = written;
        let mut k = 0;
        for (i, l) in self.lent.iter().enumerate() {
            let seg = self.parts[k].1;
            if left < seg {
                out.sent_to += left;
                return Ok(out);
            }
            left -= seg;
            out.sent_to = l.at;
            if left < l.len {
                if left > 0 {
                    out.cut = Some(self.cut(i, left));
                }
                return Ok(out);
            }
            left -= l.len;
            out.done = i + 1;
            k = self.data[i].0 as usize + self.data[i].1 as usize;
        }
        out.sent_to += left;
        Ok(out)
    }

    /// Read `i` was sent up to `sent` bytes: copies the rest of that block in at its place.
    fn cut(&mut self, i: usize, sent: usize) -> Cut {
        let l = &self.lent[i];
        let rest = ((l.block - sent % l.block) % l.block).min(l.len - sent);
        let (first, n) = self.data[i];
        let (first, n) = (first as usize, n as usize);
        // SAFETY: as in send: the read's lock is held until the recursion returns.
        let slices = self.parts[first..first + n].iter().map(|&(p, len)| unsafe { std::slice::from_raw_parts(p, len) });
        let (mut crc, mut pos) = (l.crc, 0);
        let start = self.buf.len();
        for s in slices {
            let (a, b) = (sent.saturating_sub(pos).min(s.len()), (sent + rest).saturating_sub(pos).min(s.len()));
            if self.ddgst {
                crc = crc32c::crc32c_append(crc, &s[..b]);
            }
            self.buf.extend_from_slice(&s[a..b]);
            pos += s.len();
        }
        // Moved to the read's place, before what follows it.
        let copied = self.buf.len() - start;
        self.buf[l.at..].rotate_right(copied);
        Cut { idx: i, took: sent + rest, crc, rest }
    }
}

fn fatal(fes: u16, fei: u32, what: &'static str) -> ConnError {
    ConnError::Fatal(PduError::new(fes, fei, what))
}

fn on_pdu(core: &mut Core<TcpTx>, f: &Frame) -> Result<Flow, ConnError> {
    match f.hdr.pdu_type {
        PduType::CapsuleCmd => {
            if !f.data_digest_ok {
                let cid = pdu::capsule_sqe(f.header).cid();
                peer_warn!(core.target.log_limit, core.peer.as_str(), "data digest error on a command capsule", cid);
            }
            core.on_capsule(pdu::capsule_sqe(f.header), f.data, f.data_digest_ok)?;
            Ok(if core.close_after_flush { Flow::Close } else { Flow::Continue })
        }
        PduType::H2CData => {
            on_h2c_data(core, f)?;
            Ok(Flow::Continue)
        }
        PduType::H2CTermReq => {
            let (fes, fei) = pdu::term_req_decode(f.header);
            Err(ConnError::HostTerminated { fes, fei })
        }
        _ => Err(fatal(fes::PDU_SEQUENCE_ERROR, 0, "ICReq after the connection was initialised")),
    }
}

/// Data the core fetched ([`Transport::fetch_data`]), under the transfer tag of its R2T.
fn on_h2c_data(core: &mut Core<TcpTx>, f: &Frame) -> Result<(), ConnError> {
    let h = DataHdr::decode(f.header);
    let Some(x) = core.waiting(h.ttag) else {
        return Err(fatal(fes::INVALID_HEADER_FIELD, 10, "H2CData with an unknown transfer tag"));
    };
    if x.cid() != h.cccid {
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
        peer_warn!(core.target.log_limit, core.peer.as_str(), "data digest error on H2CData", cid = h.cccid);
        core.data_failed(h.ttag);
        return Ok(());
    }
    if last {
        core.data_arrived(h.ttag)?;
    }
    Ok(())
}

impl TcpTx {
    fn new() -> TcpTx {
        TcpTx {
            tx: TxBuf::with_capacity(limits::TX_BUFFER_BYTES),
            framing: Framing::initial(true),
            hpda: 0,
            lent: Vec::with_capacity(limits::TX_LENT_READS_MAX),
            lent_bytes: 0,
            copied: 0,
            partial: 0,
        }
    }

    /// Bytes waiting to be sent: in the send buffer and in lent reads.
    fn pending(&self) -> usize {
        self.tx.pending() + self.lent_bytes
    }

    /// The copied bytes and short sends counted since the last call.
    fn take_counts(&mut self) -> (u64, u64) {
        (std::mem::take(&mut self.copied), std::mem::take(&mut self.partial))
    }

    /// Sends as much as the socket takes without blocking: the send buffer with the lent
    /// reads' data in their places, in one writev. Ok(true) when all is sent.
    fn flush<S: Stream>(&mut self, s: &S) -> io::Result<bool> {
        if self.lent.is_empty() {
            return self.tx.flush(s);
        }
        match self.gather(&mut |iov| s.try_write_vectored(iov)) {
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => Ok(false),
            r => r,
        }
    }

    /// Writes everything, waiting for the socket as needed.
    async fn flush_all<S: Stream>(&mut self, s: &S) -> io::Result<()> {
        while !self.flush(s)? {
            s.ready(Interest::WRITABLE).await?;
        }
        Ok(())
    }

    /// Drops what was sent from the send buffer; the lent reads' places move with it.
    fn compact(&mut self) {
        let dropped = self.tx.compact();
        for l in &mut self.lent {
            l.at -= dropped;
        }
    }

    /// One gathering send of the send buffer and every lent read, their data taken from
    /// their devices' memory under the devices' locks (held down a recursion, one level a
    /// read, until the write has returned: the data sent is the memory of one moment, as a
    /// copy would be). Of a read the socket cut short, the rest of the block it was cut in
    /// is copied into the send buffer before the locks go; its later blocks, and the later
    /// reads, stay lent for the next send. Ok(true) when all is sent.
    fn gather(&mut self, write: &mut dyn FnMut(&[IoSlice<'_>]) -> io::Result<usize>) -> io::Result<bool> {
        let sent = self.tx.sent();
        let mut g = Gather {
            buf: &mut self.tx.buf,
            lent: &self.lent,
            ddgst: self.framing.ddgst,
            parts: [(std::ptr::null(), 0); GATHER_IOV_MAX],
            n: 0,
            data: [(0, 0); limits::TX_LENT_READS_MAX],
            sent,
        };
        let out = g.level(0, write)?;
        if out.written < out.total && out.written > 0 {
            self.partial += 1;
        }
        let mut done = out.done;
        if let Some(c) = out.cut {
            let l = &mut self.lent[c.idx];
            l.off += c.took as u64;
            l.len -= c.took;
            l.crc = c.crc;
            self.lent_bytes -= c.took;
            self.copied += c.rest as u64;
            for l in &mut self.lent[c.idx..] {
                l.at += c.rest;
            }
            if self.lent[c.idx].len == 0 {
                done += 1;
            }
        }
        for l in self.lent.drain(..done) {
            self.lent_bytes -= l.len;
        }
        self.tx.set_sent(out.sent_to);
        self.compact();
        Ok(out.written == out.total)
    }

    /// Send buffer kept free while reads are lent: the rest of the block a send cuts short
    /// is copied in ([`TcpTx::gather`]) without the buffer growing by itself.
    fn rest_reserve(&self) -> usize {
        if self.lent.is_empty() {
            0
        } else {
            limits::TX_LENT_REST_BYTES_MAX
        }
    }

    fn accept_ic(&mut self, req: &IcReq, peer: &str) {
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
        debug!(peer, hdgst = req.hdgst, ddgst = req.ddgst, hpda = req.hpda, "ICReq accepted");
    }

    /// Queues a C2HTermReq carrying the offending header; the caller then closes.
    fn fatal(&mut self, e: PduError, header: &[u8]) -> ConnError {
        pdu::put_term_req(&mut self.tx.buf, PduType::C2HTermReq, &e, header);
        ConnError::Fatal(e)
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
}

impl Transport for TcpTx {
    /// A CapsuleResp.
    fn complete(&mut self, cqe: &Cqe) {
        pdu::put_capsule_resp(&mut self.tx.buf, cqe, self.framing.hdgst);
    }

    /// One C2HData, copied into the send buffer.
    fn send_data(&mut self, cid: u16, data: &[u8], success: bool) {
        let dstart = self.begin_c2h(cid, data.len(), success);
        self.tx.buf.extend_from_slice(data);
        pdu::put_data_digest(&mut self.tx.buf, dstart, self.framing.ddgst);
    }

    /// One C2HData, copied into the send buffer.
    fn send_lent(&mut self, cid: u16, len: usize, success: bool, slices: &[&[u8]]) {
        let dstart = self.begin_c2h(cid, len, success);
        for s in slices {
            self.tx.buf.extend_from_slice(s);
        }
        if len >= limits::WRITE_THROUGH_BYTES_MIN {
            self.copied += len as u64;
        }
        pdu::put_data_digest(&mut self.tx.buf, dstart, self.framing.ddgst);
    }

    /// One C2HData. From WRITE_THROUGH_BYTES_MIN on, its data stays in the device's memory
    /// and leaves in the batch's one writev, with the send buffer around it ([`TcpTx::gather`]):
    /// no copy of it, and the large reads of a batch in one send, as SPDK's target sends
    /// its poll's responses in one sendmsg (docs/spdk-128k-reads.md). Smaller reads are
    /// copied, which costs less than an iovec each.
    fn send_from(&mut self, cid: u16, len: usize, success: bool, ns: &Namespace, off: u64) -> io::Result<()> {
        if len < limits::WRITE_THROUGH_BYTES_MIN || self.lent.len() >= limits::TX_LENT_READS_MAX {
            return ns.dev.read_lent(off, len, &mut |parts| self.send_lent(cid, len, success, parts));
        }
        let at = self.begin_c2h(cid, len, success);
        if self.framing.ddgst {
            self.tx.buf.extend_from_slice(&[0; pdu::DIGEST_LEN]);
        }
        let block = ns.block_size.max(1) as usize;
        self.lent.push(Lent { dev: ns.dev.clone(), off, len, at, block, crc: 0 });
        self.lent_bytes += len;
        Ok(())
    }

    /// An R2T for the command's whole data, its transfer tag `tag` ([`on_h2c_data`]).
    fn fetch_data(&mut self, cid: u16, tag: u16, len: usize) {
        pdu::put_r2t(&mut self.tx.buf, &DataHdr { cccid: cid, ttag: tag, offset: 0, len: len as u32 }, self.framing.hdgst);
    }

    /// At most TX_PENDING_BYTES_MAX waits to be sent, fewer than TX_LENT_READS_MAX reads
    /// are lent, and one more response (limits::TX_STEP_BYTES) fits the send buffer without
    /// it growing by itself, beside the rest of a block a send may cut short.
    fn has_room(&self) -> bool {
        self.tx.pending() <= limits::TX_PENDING_BYTES_MAX && self.lent.len() < limits::TX_LENT_READS_MAX && self.room_for() > 0
    }

    fn room_for(&self) -> usize {
        (self.tx.buf.capacity() - self.tx.buf.len()).saturating_sub(self.rest_reserve()) / limits::TX_STEP_BYTES
    }

    /// Drops what was sent, then asks to double the buffer (up to TX_BUFFER_BYTES_MAX,
    /// which holds a step whenever at most TX_PENDING_BYTES_MAX waits).
    fn make_room(&mut self) -> Option<usize> {
        if self.tx.pending() > limits::TX_PENDING_BYTES_MAX || self.lent.len() >= limits::TX_LENT_READS_MAX {
            return None;
        }
        self.compact();
        let (len, cap) = (self.tx.buf.len(), self.tx.buf.capacity());
        let need = len + self.rest_reserve() + limits::TX_STEP_BYTES;
        Some((2 * cap).min(limits::TX_BUFFER_BYTES_MAX).max(need).saturating_sub(cap))
    }

    fn grow(&mut self, bytes: usize) {
        let want = self.tx.buf.capacity() + bytes;
        self.tx.buf.reserve_exact(want - self.tx.buf.len());
    }

    fn shrink(&mut self) -> usize {
        let cap = self.tx.buf.capacity();
        if !self.tx.buf.is_empty() || !self.lent.is_empty() || cap <= limits::TX_BUFFER_BYTES {
            return 0;
        }
        self.tx.buf.shrink_to(limits::TX_BUFFER_BYTES);
        cap - self.tx.buf.capacity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Backend, MemoryBackend};
    use nearstore_wire::Status;
    use std::os::fd::AsRawFd;

    const LARGE: usize = 128 * 1024;

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i / 7) as u8 ^ seed).collect()
    }

    /// A namespace of `block`-byte blocks over 4 MiB of memory holding a pattern.
    fn namespace(block: u32) -> Namespace {
        let mem = Arc::new(MemoryBackend::new(4 << 20));
        mem.write_at(&pattern(4 << 20, 1), 0).unwrap();
        Namespace::new("nqn.test", 1, mem, block)
    }

    fn xport(ddgst: bool) -> TcpTx {
        let mut x = TcpTx::new();
        x.framing.hdgst = ddgst;
        x.framing.ddgst = ddgst;
        x
    }

    /// The batch every case sends: two large reads (the second across the 1 MiB stripe
    /// boundary), a small one between them, each followed by its completion.
    fn batch(x: &mut TcpTx, ns: &Namespace) {
        for (cid, off, len) in [(1u16, 8192u64, LARGE), (2, 0, 4096), (3, (1 << 20) - 3 * 4096, LARGE)] {
            x.send_from(cid, len, false, ns, off).unwrap();
            x.complete(&Cqe { cid, status: Status::SUCCESS, ..Cqe::default() });
        }
    }

    /// The same batch with every read's data copied into the send buffer: what the wire
    /// must carry.
    fn whole(ddgst: bool, ns: &Namespace) -> Vec<u8> {
        let mut x = xport(ddgst);
        for (cid, off, len) in [(1u16, 8192u64, LARGE), (2, 0, 4096), (3, (1 << 20) - 3 * 4096, LARGE)] {
            ns.dev.read_lent(off, len, &mut |p| x.send_lent(cid, len, false, p)).unwrap();
            x.complete(&Cqe { cid, status: Status::SUCCESS, ..Cqe::default() });
        }
        x.tx.buf.clone()
    }

    /// A send that takes up to `n` bytes of `iov` onto `wire`, or none (WouldBlock).
    fn take(wire: &mut Vec<u8>, iov: &[IoSlice<'_>], n: Option<usize>) -> io::Result<usize> {
        let Some(mut left) = n else { return Err(io::ErrorKind::WouldBlock.into()) };
        let before = wire.len();
        for v in iov {
            let k = left.min(v.len());
            wire.extend_from_slice(&v[..k]);
            left -= k;
        }
        Ok(wire.len() - before)
    }

    /// Sends everything left, as a socket with room would.
    fn drain(x: &mut TcpTx, wire: &mut Vec<u8>) {
        while !x.lent.is_empty() {
            assert!(x.gather(&mut |iov| take(wire, iov, Some(usize::MAX))).unwrap());
        }
        wire.extend_from_slice(&x.tx.buf[x.tx.sent()..]);
        x.tx.set_sent(x.tx.buf.len());
        x.compact();
    }

    /// A batch's large reads leave in one send from the namespace's memory, cut short by
    /// the socket at every kind of place: nothing, inside the send buffer before, between
    /// and after the reads, inside a read at and off block boundaries. The wire always
    /// carries what copying everything would have sent, in order, with right digests; only
    /// the rest of a block cut inside is copied.
    #[test]
    fn a_gathered_send_cut_anywhere_sends_the_batch_in_order_copying_at_most_a_block() {
        for block in [512u32, 4096] {
            let ns = namespace(block);
            for ddgst in [false, true] {
                let want = whole(ddgst, &ns);
                let mut probe = xport(ddgst);
                batch(&mut probe, &ns);
                let (h, a1) = (probe.lent[0].at, probe.lent[1].at);
                let d1 = a1 + LARGE;
                let cuts: &[Option<usize>] = &[
                    None,
                    Some(0),
                    Some(1),
                    Some(h),
                    Some(h + 1),
                    Some(h + block as usize),
                    Some(h + block as usize + 1),
                    Some(h + 3 * block as usize - 1),
                    Some(h + LARGE - 1),
                    Some(h + LARGE),
                    Some(h + LARGE + 10),
                    Some(d1 - 1),
                    Some(d1),
                    Some(d1 + 5000),
                    Some(d1 + LARGE),
                    Some(want.len() - 1),
                    Some(want.len()),
                ];
                for &cut in cuts {
                    let what = format!("block {block}, ddgst {ddgst}, cut {cut:?}");
                    let mut x = xport(ddgst);
                    batch(&mut x, &ns);
                    assert_eq!(x.pending(), want.len(), "{what}: pending before");
                    let mut wire = Vec::new();
                    let r = x.gather(&mut |iov| take(&mut wire, iov, cut));
                    match cut {
                        None => assert!(r.is_err_and(|e| e.kind() == io::ErrorKind::WouldBlock), "{what}"),
                        Some(c) => assert_eq!(r.unwrap(), c == want.len(), "{what}"),
                    }
                    assert_eq!(x.pending(), want.len() - wire.len(), "{what}: pending after");
                    let (copied, partial) = x.take_counts();
                    assert!(copied < block as u64, "{what}: {copied} bytes copied");
                    let inside_data = cut.is_some_and(|c| (c > h && c < h + LARGE) || (c > d1 && c < d1 + LARGE));
                    let off_block = cut.is_some_and(|c| {
                        (c > h && !(c - h).is_multiple_of(block as usize)) || (c > d1 && !(c - d1).is_multiple_of(block as usize))
                    });
                    assert_eq!(copied > 0, inside_data && off_block, "{what}: {copied} bytes copied");
                    assert_eq!(partial, u64::from(cut.is_some_and(|c| c > 0 && c < want.len())), "{what}: short sends");
                    drain(&mut x, &mut wire);
                    assert!(wire == want, "{what}: the stream differs from the copied batch's");
                    assert_eq!((x.pending(), x.lent_bytes, x.take_counts()), (0, 0, (0, 0)), "{what}: left over");
                }
            }
        }
    }

    /// A write lands between two sends of a read the socket cut short: the blocks sent
    /// before it and the one it was cut in are old, the later blocks new, and the digest
    /// covers exactly what was sent. No block is torn.
    #[test]
    fn a_write_between_two_sends_of_a_read_tears_no_block() {
        for block in [512usize, 4096] {
            let ns = namespace(block as u32);
            let mut x = xport(true);
            x.send_from(1, LARGE, false, &ns, 0).unwrap();
            let h = x.lent[0].at;
            let cut = h + 3 * block + 100;
            let mut wire = Vec::new();
            assert!(!x.gather(&mut |iov| take(&mut wire, iov, Some(cut))).unwrap());
            let new = vec![0xeeu8; LARGE];
            ns.backend.write_at(&new, 0).unwrap();
            drain(&mut x, &mut wire);
            let data = &wire[h..h + LARGE];
            let old = pattern(4 << 20, 1);
            assert!(data[..4 * block] == old[..4 * block], "block {block}: the blocks up to the cut are old");
            assert!(data[4 * block..] == new[4 * block..], "block {block}: the later blocks are new");
            let digest = u32::from_le_bytes(wire[h + LARGE..h + LARGE + 4].try_into().unwrap());
            assert_eq!(digest, crc32c::crc32c(data), "block {block}: data digest");
        }
    }

    /// On a socket with room (a reader draining it, a send buffer larger than the batch), a
    /// batch of 128 KiB reads leaves in one writev from the namespace's memory: nothing is
    /// copied, nothing cut short, and the reader gets the batch as copying would send it.
    #[tokio::test]
    async fn a_batch_of_large_reads_on_a_draining_socket_copies_nothing() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let four_mib: libc::c_int = 4 << 20;
        // SAFETY: a valid option value of its size, on this open socket.
        let r = unsafe {
            libc::setsockopt(
                a.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&four_mib as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as u32,
            )
        };
        assert_eq!(r, 0, "SO_SNDBUF");
        let ns = namespace(4096);
        let mut x = xport(true);
        let mut want = xport(true);
        for i in 0..8u16 {
            let off = i as u64 * LARGE as u64;
            x.send_from(i, LARGE, false, &ns, off).unwrap();
            x.complete(&Cqe { cid: i, status: Status::SUCCESS, ..Cqe::default() });
            ns.dev.read_lent(off, LARGE, &mut |p| want.send_lent(i, LARGE, false, p)).unwrap();
            want.complete(&Cqe { cid: i, status: Status::SUCCESS, ..Cqe::default() });
        }
        let total = want.tx.buf.len();
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut rx = nearstore_transport::RxBuf::new(1 << 20);
            while got.len() < total {
                b.ready(Interest::READABLE).await.unwrap();
                if let Ok(n) = rx.fill(&b) {
                    got.extend_from_slice(&rx.data()[..n]);
                    rx.consume(n);
                }
            }
            got
        });
        assert!(x.flush(&a).unwrap(), "the batch left in one send");
        assert_eq!(x.take_counts(), (0, 0), "copied bytes and short sends");
        assert!(reader.await.unwrap() == want.tx.buf, "the reader got the batch as copying sends it");
    }

    /// More large reads than TX_LENT_READS_MAX wait: the queue stops taking commands
    /// (no room) instead of lending more, and a full send gives the room back.
    #[test]
    fn lent_reads_are_bounded() {
        let ns = namespace(4096);
        let mut x = xport(false);
        for i in 0..limits::TX_LENT_READS_MAX {
            assert!(x.has_room(), "room for read {i}");
            x.send_from(i as u16, 32 * 1024, false, &ns, (i * 32 * 1024) as u64).unwrap();
        }
        assert!(!x.has_room(), "no room with TX_LENT_READS_MAX reads lent");
        assert!(x.make_room().is_none(), "only sending makes room");
        let mut wire = Vec::new();
        drain(&mut x, &mut wire);
        assert!(x.has_room());
        assert_eq!(x.take_counts().0, 0, "nothing copied");
    }
}
