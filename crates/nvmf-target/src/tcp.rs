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

use std::io;
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
use crate::exec::{Core, Overflow, Replies, Transport};
use crate::io_pool::Done;
use crate::limits;
use crate::log_limit::peer_warn;
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
    let xport = TcpTx {
        tx: TxBuf::with_capacity(limits::TX_BUFFER_BYTES),
        fd: stream.as_raw_fd(),
        framing: Framing::initial(true),
        hpda: 0,
        more_in_batch: false,
    };
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
/// in the send buffer (or written through to the socket).
pub struct TcpTx {
    tx: TxBuf,
    /// The socket, for sends that bypass the send buffer ([`TxBuf::write_through`]).
    fd: std::os::fd::RawFd,
    framing: Framing,
    hpda: u8,
    /// More received bytes wait behind the command being run: a large read then joins
    /// the send buffer instead of leaving on its own ([`Transport::send_lent`]).
    more_in_batch: bool,
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
            self.core.send_deferred();
            if self.core.is_admin() && self.core.room() {
                // Busy-polling may skip the select below, where events are otherwise noticed.
                self.core.deliver_events();
            }
            self.core.xport.tx.flush(&self.stream)?;
            if self.core.close_after_flush && self.core.xport.tx.pending() == 0 {
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
            let pending = self.core.xport.tx.pending() > 0;
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

    /// Brings the target's buffer gauges up to date with this connection's buffers.
    fn account_memory(&mut self) {
        let now = self.rx.capacity() + self.core.xport.tx.buf.capacity() + self.core.buffer_bytes();
        let stats = &self.core.target.stats;
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
            self.core.xport.more_in_batch = self.rx.data().len() > len;
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
        self.core.xport.more_in_batch = false;
        if !self.buffer_stalled {
            self.core.memory_came();
        }
        Ok(Flow::Continue)
    }

    async fn flush_quickly(&mut self) -> io::Result<()> {
        match tokio::time::timeout(Duration::from_millis(limits::TERM_FLUSH_TIMEOUT_MS), self.core.xport.tx.flush_all(&self.stream)).await {
            Ok(r) => r,
            Err(_) => Err(io::ErrorKind::TimedOut.into()),
        }
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

    /// One C2HData: the data copied into the send buffer or, from WRITE_THROUGH_BYTES_MIN
    /// on and when it is the last command of the batch, sent from the device's memory
    /// together with the send buffer in one writev (no copy of it).
    ///
    /// The large reads of a batch thus leave in one send, not one each: TCP then sends full
    /// segments and, with the socket's queue full, sends them from the host's
    /// acknowledgements, on the host's core, as SPDK's target does with its one sendmsg
    /// per poll. At 128 KiB QD 32 on loopback that measured 1.5x over a writev per read,
    /// copy included (docs/spdk-128k-reads.md).
    fn send_lent(&mut self, cid: u16, len: usize, success: bool, slices: &[&[u8]]) {
        let dstart = self.begin_c2h(cid, len, success);
        let ddgst = self.framing.ddgst;
        if len < limits::WRITE_THROUGH_BYTES_MIN || slices.len() > 2 || self.more_in_batch {
            for s in slices {
                self.tx.buf.extend_from_slice(s);
            }
            pdu::put_data_digest(&mut self.tx.buf, dstart, ddgst);
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
        self.tx.write_through(self.fd, &parts[..k]);
    }

    /// An R2T for the command's whole data, its transfer tag `tag` ([`on_h2c_data`]).
    fn fetch_data(&mut self, cid: u16, tag: u16, len: usize) {
        pdu::put_r2t(&mut self.tx.buf, &DataHdr { cccid: cid, ttag: tag, offset: 0, len: len as u32 }, self.framing.hdgst);
    }

    /// At most TX_PENDING_BYTES_MAX waits to be sent, and one more response
    /// (limits::TX_STEP_BYTES) fits the send buffer without it growing by itself.
    fn has_room(&self) -> bool {
        self.tx.pending() <= limits::TX_PENDING_BYTES_MAX && self.room_for() > 0
    }

    fn room_for(&self) -> usize {
        (self.tx.buf.capacity() - self.tx.buf.len()) / limits::TX_STEP_BYTES
    }

    /// Drops what was sent, then asks to double the buffer (up to TX_BUFFER_BYTES_MAX,
    /// which holds a step whenever at most TX_PENDING_BYTES_MAX waits).
    fn make_room(&mut self) -> Option<usize> {
        if self.tx.pending() > limits::TX_PENDING_BYTES_MAX {
            return None;
        }
        self.tx.compact();
        let (len, cap) = (self.tx.buf.len(), self.tx.buf.capacity());
        let need = len + limits::TX_STEP_BYTES;
        Some((2 * cap).min(limits::TX_BUFFER_BYTES_MAX).max(need).saturating_sub(cap))
    }

    fn grow(&mut self, bytes: usize) {
        let want = self.tx.buf.capacity() + bytes;
        self.tx.buf.reserve_exact(want - self.tx.buf.len());
    }

    fn shrink(&mut self) -> usize {
        let cap = self.tx.buf.capacity();
        if !self.tx.buf.is_empty() || cap <= limits::TX_BUFFER_BYTES {
            return 0;
        }
        self.tx.buf.shrink_to(limits::TX_BUFFER_BYTES);
        cap - self.tx.buf.capacity()
    }
}
