//! One NVMe/TCP queue: ICReq/ICResp, CapsuleCmd out, R2T answered with H2CData,
//! C2HData and CapsuleResp in.

use std::io;

use nearstore_transport::{AlignedBuf, Interest, RxBuf, Stream, TxBuf};
use nearstore_wire::pdu::{self, flags, DataHdr, Framing, IcReq, IcResp, PduType};
use nearstore_wire::sqe::sgl_id;
use nearstore_wire::{Cqe, Sgl, Sqe, Status};

use crate::{io_err, Error, Result};

/// Data that moves with a command.
#[derive(Clone, Copy, Debug)]
pub enum Data<'a> {
    None,
    /// Host to controller.
    Out(&'a [u8]),
    /// Controller to host, this many bytes.
    In(usize),
}

#[derive(Clone, Debug)]
pub struct QueueOptions {
    pub hdgst: bool,
    pub ddgst: bool,
    /// Commands in flight at most (the queue size).
    pub depth: u16,
    /// Largest data of one command, either direction.
    pub max_transfer: usize,
    /// Largest write sent inside the command capsule (from the controller's IOCCSZ).
    pub in_capsule_max: usize,
    /// How long to keep polling the socket for completions before sleeping in epoll
    /// (zero: sleep at once). Polling saves the 50-150 us a sleeping thread needs to wake.
    pub busy_poll: std::time::Duration,
}

impl Default for QueueOptions {
    fn default() -> Self {
        QueueOptions {
            hdgst: false,
            ddgst: false,
            depth: 128,
            max_transfer: 128 * 1024,
            in_capsule_max: 8192,
            busy_poll: std::time::Duration::ZERO,
        }
    }
}

struct Slot {
    busy: bool,
    tag: u64,
    buf: Option<AlignedBuf>,
    len: usize,
    /// Data to send on R2T (a write that did not fit the capsule).
    out: bool,
    /// Data to receive (a command with `Data::In` of more than 0 bytes): only such a
    /// command takes C2HData.
    reads: bool,
    received: usize,
    digest_error: bool,
}

pub struct QueuePair<S> {
    stream: S,
    rx: RxBuf,
    tx: TxBuf,
    framing: Framing,
    maxh2cdata: usize,
    cpda: u8,
    opts: QueueOptions,
    slots: Vec<Slot>,
    free: Vec<u16>,
}

impl<S: Stream> QueuePair<S> {
    /// Exchanges ICReq and ICResp on a fresh stream.
    pub async fn connect(stream: S, opts: QueueOptions) -> Result<QueuePair<S>> {
        let depth = opts.depth.max(1);
        let rx_cap = (opts.max_transfer + 4096).max(64 * 1024) * 2;
        let mut q = QueuePair {
            stream,
            rx: RxBuf::new(rx_cap),
            tx: TxBuf::with_capacity(64 * 1024),
            framing: Framing::initial(false),
            maxh2cdata: 0,
            cpda: 0,
            slots: (0..depth)
                .map(|_| Slot { busy: false, tag: 0, buf: None, len: 0, out: false, reads: false, received: 0, digest_error: false })
                .collect(),
            free: (0..depth).rev().collect(),
            opts,
        };
        IcReq { pfv: 0, hpda: 0, hdgst: q.opts.hdgst, ddgst: q.opts.ddgst, maxr2t: 0 }.encode(&mut q.tx.buf);
        q.tx.flush_all(&q.stream).await.map_err(io_err("sending ICReq"))?;
        loop {
            if let Some(f) = pdu::parse_frame(q.rx.data(), &q.framing).map_err(|e| Error::Protocol(format!("ICResp: {e}")))? {
                if f.hdr.pdu_type == PduType::C2HTermReq {
                    let (fes, fei) = pdu::term_req_decode(f.header);
                    return Err(Error::Terminated { fes, fei });
                }
                if f.hdr.pdu_type != PduType::IcResp {
                    return Err(Error::Protocol(format!("expected ICResp, got {:?}", f.hdr.pdu_type)));
                }
                let r = IcResp::decode(f.header);
                let len = f.len;
                q.rx.consume(len);
                // CPDA above 31 is reserved: its alignment would not fit the PDO byte.
                if r.pfv != 0
                    || r.hdgst != q.opts.hdgst
                    || r.ddgst != q.opts.ddgst
                    || r.maxh2cdata < 4096
                    || !r.maxh2cdata.is_multiple_of(4)
                    || r.cpda > 31
                {
                    return Err(Error::Protocol(format!("unacceptable ICResp {r:?}")));
                }
                q.maxh2cdata = r.maxh2cdata as usize;
                q.cpda = r.cpda;
                q.framing = Framing {
                    hdgst: q.opts.hdgst,
                    ddgst: q.opts.ddgst,
                    from_host: false,
                    capsule_data_max: 0,
                    data_pdu_max: (q.opts.max_transfer.max(4096)) as u32,
                };
                return Ok(q);
            }
            q.fill().await?;
        }
    }

    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    pub fn depth(&self) -> usize {
        self.slots.len()
    }

    /// Bytes this connection has sent and received, as the kernel's TCP counters
    /// (tcpi_bytes_sent, tcpi_bytes_received) report them: TCP payload, PDU headers
    /// included, retransmissions included in "sent". (0, 0) for streams that are not TCP.
    pub fn wire_bytes(&self) -> (u64, u64) {
        tcp_bytes(self.stream.as_raw_fd())
    }

    pub fn options(&self) -> &QueueOptions {
        &self.opts
    }

    /// Queues a command; it is sent by the next [`poll`](Self::poll) or [`flush`](Self::flush).
    /// `tag` comes back with the completion.
    pub fn submit(&mut self, mut sqe: Sqe, data: Data, tag: u64) -> Result<u16> {
        let len = match data {
            Data::None => 0,
            Data::Out(d) => d.len(),
            Data::In(n) => n,
        };
        if len > self.opts.max_transfer {
            return Err(Error::Invalid(format!("transfer of {len} bytes over the {} byte limit", self.opts.max_transfer)));
        }
        let cid = self.free.pop().ok_or(Error::QueueFull(self.slots.len()))?;
        sqe.set_cid(cid);
        let slot = &mut self.slots[cid as usize];
        slot.busy = true;
        slot.tag = tag;
        slot.len = len;
        slot.received = 0;
        slot.digest_error = false;
        slot.out = false;
        slot.reads = matches!(data, Data::In(n) if n > 0);
        let (hd, dd) = (self.opts.hdgst, self.opts.ddgst);
        match data {
            Data::Out(d) if d.len() <= self.opts.in_capsule_max && !d.is_empty() => {
                sqe.set_sgl(Sgl { addr: 0, len: d.len() as u32, id: sgl_id::IN_CAPSULE });
                pdu::put_capsule_cmd(&mut self.tx.buf, &sqe, d, hd, dd);
            }
            Data::Out(d) => {
                let buf = slot.buf.get_or_insert_with(|| AlignedBuf::new(self.opts.max_transfer));
                buf.set_len(d.len());
                buf.copy_from_slice(d);
                slot.out = true;
                sqe.set_sgl(Sgl { addr: 0, len: d.len() as u32, id: sgl_id::TRANSPORT });
                pdu::put_capsule_cmd(&mut self.tx.buf, &sqe, &[], hd, dd);
            }
            Data::In(n) => {
                if n > 0 {
                    let buf = slot.buf.get_or_insert_with(|| AlignedBuf::new(self.opts.max_transfer));
                    buf.set_len(n);
                }
                sqe.set_sgl(Sgl { addr: 0, len: n as u32, id: sgl_id::TRANSPORT });
                pdu::put_capsule_cmd(&mut self.tx.buf, &sqe, &[], hd, dd);
            }
            Data::None => {
                sqe.set_sgl(Sgl { addr: 0, len: 0, id: sgl_id::TRANSPORT });
                pdu::put_capsule_cmd(&mut self.tx.buf, &sqe, &[], hd, dd);
            }
        }
        Ok(cid)
    }

    /// Sends everything queued.
    pub async fn flush(&mut self) -> Result<()> {
        self.tx.flush_all(&self.stream).await.map_err(io_err("sending commands"))
    }

    async fn fill(&mut self) -> Result<()> {
        if !self.opts.busy_poll.is_zero() && self.tx.pending() == 0 {
            let until = std::time::Instant::now() + self.opts.busy_poll;
            loop {
                match self.rx.fill_now(&self.stream) {
                    Ok(0) => return Err(Error::Closed),
                    Ok(_) => return Ok(()),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(io_err("receiving")(e)),
                }
                if std::time::Instant::now() >= until {
                    break;
                }
                // Other queues may share this thread.
                tokio::task::yield_now().await;
            }
        }
        loop {
            let mut interest = Interest::READABLE;
            if self.tx.pending() > 0 {
                interest |= Interest::WRITABLE;
            }
            let r = self.stream.ready(interest).await.map_err(io_err("waiting on the socket"))?;
            if r.is_writable() && self.tx.pending() > 0 {
                self.tx.flush(&self.stream).map_err(io_err("sending"))?;
            }
            if r.is_readable() || r.is_read_closed() {
                match self.rx.fill(&self.stream) {
                    Ok(0) => return Err(Error::Closed),
                    Ok(_) => return Ok(()),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(io_err("receiving")(e)),
                }
            }
        }
    }

    /// Sends what is queued, waits for at least one completion, and calls `f(tag, cqe,
    /// data)` for every completion that has arrived. Returns how many completed.
    pub async fn poll(&mut self, mut f: impl FnMut(u64, &Cqe, &[u8])) -> Result<usize> {
        if self.in_flight() == 0 {
            return Ok(0);
        }
        self.tx.flush(&self.stream).map_err(io_err("sending commands"))?;
        loop {
            let n = self.process(&mut f)?;
            if n > 0 {
                return Ok(n);
            }
            self.fill().await?;
        }
    }

    /// Polls until the command with `cid` completes; other completions go to `f` too.
    pub async fn wait(&mut self, cid: u16, mut f: impl FnMut(u64, &Cqe, &[u8])) -> Result<Cqe> {
        let mut mine = None;
        while mine.is_none() {
            let want = self
                .slots
                .get(cid as usize)
                .filter(|s| s.busy)
                .ok_or_else(|| Error::Invalid(format!("command id {cid} is not in flight")))?
                .tag;
            self.poll(|tag, cqe, data| {
                if cqe.cid == cid && tag == want {
                    mine = Some(*cqe);
                }
                f(tag, cqe, data)
            })
            .await?;
        }
        Ok(mine.expect("set"))
    }

    fn process(&mut self, f: &mut impl FnMut(u64, &Cqe, &[u8])) -> Result<usize> {
        let mut done = 0;
        loop {
            let frame = match pdu::parse_frame(self.rx.data(), &self.framing) {
                Ok(Some(fr)) => fr,
                Ok(None) => break,
                Err(e) => {
                    let n = self.rx.data().len().min(pdu::TERM_DATA_MAX);
                    let hdr = self.rx.data()[..n].to_vec();
                    pdu::put_term_req(&mut self.tx.buf, PduType::H2CTermReq, &e, &hdr);
                    let _ = self.tx.flush(&self.stream);
                    return Err(Error::Protocol(e.to_string()));
                }
            };
            let len = frame.len;
            match frame.hdr.pdu_type {
                PduType::CapsuleResp => {
                    let cqe = pdu::capsule_cqe(frame.header);
                    let slot = self
                        .slots
                        .get(cqe.cid as usize)
                        .filter(|s| s.busy)
                        .ok_or_else(|| Error::Protocol(format!("completion for unknown command id {}", cqe.cid)))?;
                    let mut cqe = cqe;
                    if slot.digest_error && cqe.status.is_success() {
                        cqe.status = Status::TRANSIENT_TRANSPORT_ERROR;
                    }
                    let data_in = slot.reads;
                    // A command completes successfully only with all of its data.
                    if data_in && cqe.status.is_success() && slot.received != slot.len {
                        return Err(Error::Protocol(format!(
                            "command id {} completed with {} of its {} bytes of data",
                            cqe.cid, slot.received, slot.len
                        )));
                    }
                    let data: &[u8] = match &slot.buf {
                        Some(b) if data_in => &b[..slot.received],
                        _ => &[],
                    };
                    f(slot.tag, &cqe, data);
                    self.release(cqe.cid);
                    done += 1;
                }
                PduType::C2HData => {
                    let h = DataHdr::decode(frame.header);
                    let slot = self
                        .slots
                        .get_mut(h.cccid as usize)
                        .filter(|s| s.busy)
                        .ok_or_else(|| Error::Protocol(format!("C2HData for unknown command id {}", h.cccid)))?;
                    let reads = slot.reads;
                    let Some(buf) = slot.buf.as_mut().filter(|_| reads) else {
                        return Err(Error::Protocol(format!("C2HData for command id {}, which reads no data", h.cccid)));
                    };
                    let end = h.offset as usize + frame.data.len();
                    if h.offset as usize != slot.received || end > slot.len {
                        return Err(Error::Protocol(format!(
                            "C2HData offset {} length {} outside the expected transfer",
                            h.offset,
                            frame.data.len()
                        )));
                    }
                    if !frame.data_digest_ok {
                        slot.digest_error = true;
                    }
                    let success = frame.hdr.flags & flags::SUCCESS != 0;
                    if success && frame.hdr.flags & flags::LAST_PDU == 0 {
                        return Err(Error::Protocol("C2HData SUCCESS without LAST_PDU".into()));
                    }
                    if success && end != slot.len {
                        return Err(Error::Protocol(format!(
                            "C2HData SUCCESS for command id {} after {end} of its {} bytes",
                            h.cccid, slot.len
                        )));
                    }
                    let status = if slot.digest_error { Status::TRANSIENT_TRANSPORT_ERROR } else { Status::SUCCESS };
                    let cqe = Cqe { cid: h.cccid, status, ..Default::default() };
                    // The whole transfer in one PDU, completed by it: hand the data over from
                    // the receive buffer, no copy (the copy was a third of perf's time on
                    // 128 KiB reads).
                    let whole = success && h.offset == 0;
                    if !whole {
                        buf[h.offset as usize..end].copy_from_slice(frame.data);
                        slot.received = end;
                    }
                    if success {
                        let data = if whole { frame.data } else { &buf[..end] };
                        f(slot.tag, &cqe, data);
                        self.release(h.cccid);
                        done += 1;
                    }
                }
                PduType::R2T => {
                    let h = DataHdr::decode(frame.header);
                    let slot = self
                        .slots
                        .get(h.cccid as usize)
                        .filter(|s| s.busy)
                        .ok_or_else(|| Error::Protocol(format!("R2T for unknown command id {}", h.cccid)))?;
                    let (off, rl) = (h.offset as usize, h.len as usize);
                    if off + rl > slot.len || rl == 0 {
                        return Err(Error::Protocol(format!("R2T range {off}+{rl} outside the command's {} bytes", slot.len)));
                    }
                    let Some(buf) = slot.buf.as_ref().filter(|_| slot.out) else {
                        return Err(Error::Protocol(format!("R2T for command id {}, which has no data to send", h.cccid)));
                    };
                    let mut pos = off;
                    while pos < off + rl {
                        let n = (off + rl - pos).min(self.maxh2cdata);
                        let last = pos + n == off + rl;
                        let d = DataHdr { cccid: h.cccid, ttag: h.ttag, offset: pos as u32, len: n as u32 };
                        let fl = if last { flags::LAST_PDU } else { 0 };
                        let start = pdu::put_header_aligned(
                            &mut self.tx.buf,
                            PduType::H2CData,
                            fl,
                            &d.psh(),
                            n,
                            self.opts.hdgst,
                            self.opts.ddgst,
                            self.cpda,
                        );
                        self.tx.buf.extend_from_slice(&buf[pos..pos + n]);
                        pdu::put_data_digest(&mut self.tx.buf, start, self.opts.ddgst);
                        pos += n;
                    }
                    self.tx.flush(&self.stream).map_err(io_err("sending H2CData"))?;
                }
                PduType::C2HTermReq => {
                    let (fes, fei) = pdu::term_req_decode(frame.header);
                    return Err(Error::Terminated { fes, fei });
                }
                t => {
                    return Err(Error::Protocol(format!("unexpected {t:?}")));
                }
            }
            self.rx.consume(len);
        }
        Ok(done)
    }

    /// Frees a completed command's slot.
    fn release(&mut self, cid: u16) {
        self.slots[cid as usize].busy = false;
        self.free.push(cid);
    }

    /// Sends raw bytes as they are: for tests that speak malformed protocol on purpose.
    pub async fn send_raw(&mut self, bytes: &[u8]) -> Result<()> {
        self.tx.buf.extend_from_slice(bytes);
        self.flush().await
    }

    /// Waits for the next PDU and returns its type and header: for tests.
    pub async fn recv_raw(&mut self) -> Result<(PduType, Vec<u8>)> {
        loop {
            if let Some(f) = pdu::parse_frame(self.rx.data(), &Framing { data_pdu_max: u32::MAX, ..self.framing })
                .map_err(|e| Error::Protocol(e.to_string()))?
            {
                let r = (f.hdr.pdu_type, f.header.to_vec());
                let len = f.len;
                self.rx.consume(len);
                return Ok(r);
            }
            self.fill().await?;
        }
    }
}

/// The kernel's byte counters of a TCP socket.
pub(crate) fn tcp_bytes(fd: std::os::fd::RawFd) -> (u64, u64) {
    // SAFETY: tcp_info is plain data; getsockopt writes at most `len` bytes into it.
    unsafe {
        let mut info: libc::tcp_info = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        if libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, &mut info as *mut _ as *mut libc::c_void, &mut len) != 0 {
            return (0, 0);
        }
        (info.tcpi_bytes_sent, info.tcpi_bytes_received)
    }
}
