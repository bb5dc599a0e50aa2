//! Compare (05h) and the fused Compare and Write on an I/O queue (docs/protocol.md,
//! "Compare and Write").
//!
//! A Compare alone reads its blocks and compares them with its data. A Compare with FUSE
//! 01b and the command right after it on the queue, a Write with FUSE 10b over the same
//! blocks, are one operation: both halves are checked (tenant, reservations, range) and
//! their data taken, in whatever order the transport brings it; then, on a task of its
//! own, the namespace's range is locked exclusively (range_lock.rs, on a blocking thread),
//! read, compared, and written only if equal, through the namespace's device stack.
//! Pairing follows the submission order: it is decided when each capsule is parsed
//! ([`Core::pair_on_capsule`]), and a half settled (data in, or completed with an error)
//! resolves its pair ([`Core::resolve_pair`]).
//!
//! Writes that overlap a locked range are parked by their queue ([`Core::park`]) and run
//! again when the range goes ([`Done::Unblocked`]); nothing waits on the network thread.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use nearstore_transport::AlignedBuf;
use nearstore_wire::log::ErrorEntry;
use nearstore_wire::opcode::io;
use nearstore_wire::sqe::fuse;
use nearstore_wire::{Sqe, Status};

use super::{Core, Inflight, Overflow, Transport};
use crate::config::IoEngine;
use crate::dev::{Channel, Op};
use crate::fused::AbortHold;
use crate::io_cmd::{self, IoKind, IoPlan};
use crate::io_pool::Done;
use crate::request::Request;
use crate::subsystem::{Controller, Namespace};
use tokio_util::sync::CancellationToken;

/// What a Compare's work gives back: the statuses of its halves (the second's
/// only for a pair) and the data buffers.
pub struct Compared {
    first: Status,
    second: Status,
    bufs: [Option<AlignedBuf>; 2],
}

/// A half of a Compare and Write pair, from its capsule to its pair's run.
pub(super) enum Half {
    /// Its data is on the way (or, for a second, not yet parsed).
    Awaiting,
    /// Completed with an error: its partner fails.
    Failed,
    Ready(Box<Ready>),
}

/// A checked half with its data.
pub(super) struct Ready {
    sqe: Sqe,
    req: Request,
    buf: AlignedBuf,
    ns: Arc<Namespace>,
    off: u64,
    len: usize,
    fua: bool,
}

/// A Compare and Write pair while its halves arrive, known by its first half's place in
/// the queue's submission order (its second's is the next), never by command identifiers,
/// which a host may reuse as soon as a half completed.
pub(super) struct Pair {
    first_seq: u32,
    nsid: u32,
    /// The command parsed right after the first was a second half.
    second_parsed: bool,
    /// The command after the first was not a second half.
    missing: bool,
    first: Half,
    second: Half,
    /// Another host's Preempt and Abort came for the namespace meanwhile.
    pub(super) aborted: bool,
}

impl Pair {
    /// True if the command at `seq` is its second half.
    fn has_second(&self, seq: u32) -> bool {
        self.second_parsed && self.first_seq.wrapping_add(1) == seq
    }

    /// Halves it holds with their data (counted as outstanding commands of the queue).
    pub(super) fn ready(&self) -> usize {
        [&self.first, &self.second].into_iter().filter(|h| matches!(h, Half::Ready(_))).count()
    }

    pub(super) fn nsid(&self) -> u32 {
        self.nsid
    }

    /// The requests it holds, for a queue that closes.
    pub(super) fn abandon(self) {
        for h in [self.first, self.second] {
            if let Half::Ready(r) = h {
                r.req.abandon();
            }
        }
    }
}

/// A write parked while a Compare and Write holds blocks it writes.
pub(super) struct Parked {
    pub(super) sqe: Sqe,
    buf: AlignedBuf,
    pub(super) req: Request,
    pub(super) aborted: bool,
}

/// True for the commands this module runs: Compare, and a half of a fused operation.
pub fn is_compare(sqe: &Sqe) -> bool {
    sqe.opcode() == io::COMPARE || sqe.fuse() != fuse::NORMAL
}

/// False for a command whose FUSE field names a fused operation this controller does not
/// have: the only one (Identify's FUSES) is a Compare (first) and a Write (second) on an
/// I/O queue. Such a command is refused with Invalid Field in Command, as Linux's nvmet and
/// QEMU refuse every fused command; FUSE 11b is reserved.
pub fn fuse_allowed(sqe: &Sqe, io_queue: bool) -> bool {
    match (sqe.fuse(), sqe.opcode()) {
        (fuse::NORMAL, _) => true,
        (fuse::FIRST, io::COMPARE) | (fuse::SECOND, io::WRITE) => io_queue,
        _ => false,
    }
}

impl<T: Transport> Core<T> {
    /// Pairing by submission order, as each capsule of an I/O queue is parsed (`seq` its
    /// place): the command after a first half is its second, or the first misses its second.
    pub(super) fn pair_on_capsule(&mut self, sqe: &Sqe, seq: u32) {
        if let Some(first) = self.open_pair.take() {
            if let Some(p) = self.pairs.iter_mut().find(|p| p.first_seq == first) {
                if sqe.fuse() == fuse::SECOND {
                    p.second_parsed = true;
                } else {
                    p.missing = true;
                }
            }
            self.resolve_pair(first);
        }
        if sqe.fuse() == fuse::FIRST && sqe.opcode() == io::COMPARE {
            self.pairs.push(Pair {
                first_seq: seq,
                nsid: sqe.nsid(),
                second_parsed: false,
                missing: false,
                first: Half::Awaiting,
                second: Half::Awaiting,
                aborted: false,
            });
            self.open_pair = Some(seq);
        }
    }

    /// A second half (at `seq`) whose first did not come right before it: Missing Fused
    /// Command, before any of its data moves.
    pub(super) fn lone_second(&self, sqe: &Sqe, seq: u32) -> bool {
        sqe.fuse() == fuse::SECOND && !self.pairs.iter().any(|p| p.has_second(seq) && matches!(p.second, Half::Awaiting))
    }

    /// A second half (at `seq`) whose first failed: Command Aborted due to Failed Fused
    /// Command, before any of its data moves.
    pub(super) fn first_failed(&self, sqe: &Sqe, seq: u32) -> bool {
        sqe.fuse() == fuse::SECOND && self.pairs.iter().any(|p| p.has_second(seq) && matches!(p.first, Half::Failed))
    }

    /// The command at `seq` completed: if it was a half still awaited, its pair learns it
    /// failed.
    pub(super) fn pair_half_completed(&mut self, seq: u32) {
        let mut first = None;
        for p in &mut self.pairs {
            if p.first_seq == seq && matches!(p.first, Half::Awaiting) {
                p.first = Half::Failed;
            } else if p.has_second(seq) && matches!(p.second, Half::Awaiting) {
                p.second = Half::Failed;
            } else {
                continue;
            }
            first = Some(p.first_seq);
            break;
        }
        if let Some(f) = first {
            self.resolve_pair(f);
        }
    }

    /// Runs a Compare, or takes a half of a pair, its data in `buf` or `data`.
    pub(super) fn execute_compare(
        &mut self,
        ctrl: &Arc<Controller>,
        sqe: Sqe,
        data: &[u8],
        buf: Option<AlignedBuf>,
        req: Request,
    ) -> Result<(), Overflow> {
        let seq = req.seq();
        if self.lone_second(&sqe, seq) {
            if let Some(b) = buf {
                self.put_buf(b);
            }
            self.fail_io(ctrl, &sqe, req, Status::ABORTED_MISSING_FUSED.dnr());
            return Ok(());
        }
        if self.first_failed(&sqe, seq) {
            if let Some(b) = buf {
                self.put_buf(b);
            }
            let aborted = self.pairs.iter().any(|p| p.has_second(seq) && p.aborted);
            self.fail_io(ctrl, &sqe, req, if aborted { Status::ABORTED_PREEMPT } else { Status::ABORTED_FAILED_FUSED });
            return Ok(());
        }
        let plan = match io_cmd::plan(&ctrl.subsys, &ctrl.hostid, &ctrl.tenant, &sqe, ctrl.write_cache.load(Relaxed)) {
            Ok(p) => p,
            Err(s) => {
                if let Some(b) = buf {
                    self.put_buf(b);
                }
                self.fail_io(ctrl, &sqe, req, s);
                return Ok(());
            }
        };
        let IoPlan { ns, op, len, .. } = plan;
        // io_cmd::plan makes a Compare a read and a second half a write.
        let (off, fua) = match op {
            Op::Write { off, fua } => (off, fua),
            Op::Read { off } => (off, false),
            _ => {
                if let Some(b) = buf {
                    self.put_buf(b);
                }
                self.fail_io(ctrl, &sqe, req, Status::INTERNAL_ERROR.dnr());
                return Ok(());
            }
        };
        let buf = buf.unwrap_or_else(|| {
            let mut b = self.take_buf();
            b.set_len(data.len());
            b.copy_from_slice(data);
            b
        });
        let ready = Box::new(Ready { sqe, req, buf, ns, off, len, fua });
        match ready.sqe.fuse() {
            fuse::NORMAL => {
                if self.outstanding() >= self.outstanding_limit() {
                    return Err(self.overflow(ready.req));
                }
                let Ready { req, buf, ns, off, len, .. } = *ready;
                let token = self.inflight.insert(Inflight::new(req, ns.clone(), IoKind::Compare, len, off >> ns.lba_shift)) as u32;
                let chan = self.compare_channel();
                self.compare_task(token, 1, async move {
                    let (first, second, bufs) = run(chan, &ns, off, buf, None, None, None).await;
                    Compared { first, second, bufs }
                });
            }
            fuse::FIRST => match self.pairs.iter_mut().find(|p| p.first_seq == seq && matches!(p.first, Half::Awaiting)) {
                Some(p) => {
                    p.first = Half::Ready(ready);
                    self.resolve_pair(seq);
                }
                None => self.fail_ready(ctrl, *ready, Status::ABORTED_MISSING_FUSED.dnr()),
            },
            _ => match self.pairs.iter_mut().find(|p| p.has_second(seq) && matches!(p.second, Half::Awaiting)) {
                Some(p) => {
                    let first = p.first_seq;
                    p.second = Half::Ready(ready);
                    self.resolve_pair(first);
                }
                None => self.fail_ready(ctrl, *ready, Status::ABORTED_MISSING_FUSED.dnr()),
            },
        }
        Ok(())
    }

    /// Settles the pair whose first half is at `first` once both halves are: runs it, or
    /// completes what it holds with the status the specification gives each case.
    pub(super) fn resolve_pair(&mut self, first: u32) {
        let Some(i) = self.pairs.iter().position(|p| p.first_seq == first) else { return };
        let p = &self.pairs[i];
        let second_known = p.second_parsed || p.missing;
        if matches!(p.first, Half::Awaiting) || !second_known || (!p.missing && matches!(p.second, Half::Awaiting)) {
            return;
        }
        let p = self.pairs.swap_remove(i);
        let Some(ctrl) = self.queue.as_ref().map(|q| q.ctrl.clone()) else {
            p.abandon();
            return;
        };
        let aborted = p.aborted;
        let partner_failed = if aborted { Status::ABORTED_PREEMPT } else { Status::ABORTED_FAILED_FUSED };
        match (p.first, p.second, p.missing) {
            (Half::Ready(a), _, true) => self.fail_ready(&ctrl, *a, Status::ABORTED_MISSING_FUSED.dnr()),
            (Half::Ready(a), Half::Ready(b), _) if aborted => {
                self.fail_ready(&ctrl, *a, Status::ABORTED_PREEMPT);
                self.fail_ready(&ctrl, *b, Status::ABORTED_PREEMPT);
            }
            (Half::Ready(a), Half::Ready(b), _) => {
                if a.ns.nsid != b.ns.nsid || a.off != b.off || a.len != b.len {
                    // The Write names other blocks than its Compare: the Write is the
                    // invalid field, the Compare fails with its pair.
                    self.fail_ready(&ctrl, *a, Status::ABORTED_FAILED_FUSED);
                    self.fail_ready(&ctrl, *b, Status::INVALID_FIELD.dnr());
                } else {
                    self.run_pair(*a, *b);
                }
            }
            (Half::Ready(a), _, _) => self.fail_ready(&ctrl, *a, partner_failed),
            (_, Half::Ready(b), _) => self.fail_ready(&ctrl, *b, partner_failed),
            _ => {}
        }
    }

    fn fail_ready(&mut self, ctrl: &Controller, r: Ready, status: Status) {
        self.put_buf(r.buf);
        self.fail_io(ctrl, &r.sqe, r.req, status);
    }

    /// Both halves in, the same blocks: locked, read, compared and written on a task of
    /// its own.
    fn run_pair(&mut self, a: Ready, b: Ready) {
        let hold = Arc::new(AbortHold::default());
        let x = Inflight {
            fused: Some(hold.clone()),
            second: Some(b.req),
            ..Inflight::new(a.req, a.ns.clone(), IoKind::Compare, a.len, a.off >> a.ns.lba_shift)
        };
        let token = self.inflight.insert(x) as u32;
        let (ns, off, cmp, data, fua) = (a.ns, a.off, a.buf, b.buf, b.fua);
        let chan = self.compare_channel();
        let removed = self.queue.as_ref().map(|q| q.ctrl.cancel.clone());
        self.compare_task(token, 2, async move {
            let (first, second, bufs) = run(chan, &ns, off, cmp, Some((data, fua)), Some(&hold), removed.as_ref()).await;
            hold.ended();
            Compared { first, second, bufs }
        });
    }

    /// A channel of its own for a Compare's device operations, on the target's worker pool
    /// and charged to this queue's tenant in fair-scheduled devices, like its other I/O;
    /// holding its controller's life while it runs (a Cross-Controller Reset waits for it).
    fn compare_channel(&self) -> Channel {
        let mut chan = Channel::new(IoEngine::Threads, self.target.pool.clone()).same_tenant(self.chan.tenant_shared());
        chan.set_life(self.chan.life_shared());
        chan
    }

    /// Runs a Compare's work (`halves` data buffers: 1, or 2 for a pair) on a task of its
    /// own (it may wait for its range and its device), and hands its statuses back to the
    /// queue. A task that panicked gives back fresh buffers for its own, so that the queue's
    /// count of them comes down.
    fn compare_task(&mut self, token: u32, halves: usize, work: impl std::future::Future<Output = Compared> + Send + 'static) {
        let reply = self.done_tx.clone();
        tokio::spawn(async move {
            let fresh = || Some(AlignedBuf::new(crate::limits::TRANSFER_BYTES_MAX));
            let compared = tokio::spawn(work).await.unwrap_or_else(|_| Compared {
                first: Status::INTERNAL_ERROR.dnr(),
                second: Status::ABORTED_FAILED_FUSED,
                bufs: [fresh(), if halves == 2 { fresh() } else { None }],
            });
            let _ = reply.send(Done::Compared { token, compared: Box::new(compared) });
        });
    }

    /// A Compare or a pair ended: the Compare's completion, then the Write's.
    pub(super) fn on_compared(&mut self, token: u32, c: Compared) {
        let Some(x) = self.inflight.remove(token as usize) else {
            c.bufs.into_iter().flatten().for_each(|b| self.put_buf(b));
            return;
        };
        let Some(ctrl) = self.queue.as_ref().map(|q| q.ctrl.clone()) else {
            x.req.abandon();
            if let Some(r) = x.second {
                r.abandon();
            }
            c.bufs.into_iter().flatten().for_each(|b| self.put_buf(b));
            return;
        };
        let s = &x.ns.stats;
        s.latency.record(x.req.start().elapsed());
        if c.first.is_success() {
            s.reads.fetch_add(1, Relaxed);
            s.read_bytes.fetch_add(x.len as u64, Relaxed);
        }
        if x.second.is_some() && c.second.is_success() {
            s.writes.fetch_add(1, Relaxed);
            s.written_bytes.fetch_add(x.len as u64, Relaxed);
        }
        let halves = [(x.req, c.first)].into_iter().chain(x.second.map(|r| (r, c.second)));
        for (req, status) in halves {
            if !status.is_success() {
                let sqid = self.queue.as_ref().map_or(0, |q| q.qid);
                x.ns.stats.errors.fetch_add(1, Relaxed);
                ctrl.record_error(ErrorEntry {
                    sqid,
                    cid: req.cid(),
                    status: status.to_field(),
                    lba: x.lba,
                    nsid: x.ns.nsid,
                    ..Default::default()
                });
            }
            self.complete(req, status, 0, 0);
        }
        c.bufs.into_iter().flatten().for_each(|b| self.put_buf(b));
    }

    /// Keeps a write refused by a Compare and Write's range until the range goes.
    pub(super) fn park(&mut self, sqe: Sqe, data: &[u8], buf: Option<AlignedBuf>, req: Request) {
        let buf = buf.unwrap_or_else(|| {
            let mut b = self.take_buf();
            b.set_len(data.len());
            b.copy_from_slice(data);
            b
        });
        self.parked.push_back(Parked { sqe, buf, req, aborted: false });
    }

    /// A range went: the parked writes run again (and park again if another holds them).
    pub(super) fn unpark(&mut self) {
        let parked = std::mem::take(&mut self.parked);
        for p in parked {
            let Some(ctrl) = self.queue.as_ref().map(|q| q.ctrl.clone()) else {
                p.req.abandon();
                continue;
            };
            if p.aborted {
                self.put_buf(p.buf);
                self.fail_io(&ctrl, &p.sqe, p.req, Status::ABORTED_PREEMPT);
                continue;
            }
            // Counted as outstanding while parked, so it cannot overflow the queue.
            let _ = self.execute_io(p.sqe, &[], Some(p.buf), p.req);
        }
    }
}

/// A Compare (`write` None) or a Compare and Write: the blocks at `off` read through the
/// namespace's device stack (a volume's extents, injected faults, delays and the fair
/// scheduler alike) and compared with `cmp` and, for a pair, written with the Write's data
/// only if equal, under the range's exclusive lock (taken on a blocking thread: it may
/// wait). Returns the statuses of the Compare and the Write, and the data buffers.
async fn run(
    mut chan: Channel,
    ns: &Arc<Namespace>,
    off: u64,
    cmp: AlignedBuf,
    write: Option<(AlignedBuf, bool)>,
    hold: Option<&AbortHold>,
    removed: Option<&CancellationToken>,
) -> (Status, Status, [Option<AlignedBuf>; 2]) {
    let len = cmp.len();
    let (data, fua) = write.map_or((None, false), |(d, fua)| (Some(d), fua));
    let bufs = |cmp, data| [Some(cmp), data];
    let _range = if data.is_some() {
        let locks = ns.ranges.clone();
        match tokio::task::spawn_blocking(move || locks.lock(off..off + len as u64)).await {
            Ok(g) => Some(g),
            Err(_) => return (Status::INTERNAL_ERROR.dnr(), Status::ABORTED_FAILED_FUSED, bufs(cmp, data)),
        }
    } else {
        None
    };
    if hold.is_some_and(|h| h.aborted()) {
        return (Status::ABORTED_PREEMPT, Status::ABORTED_PREEMPT, bufs(cmp, data));
    }
    // Its controller removed while it waited for its range (a Cross-Controller Reset waits
    // for it): it does not run, and its host hears nothing of it either way.
    if removed.is_some_and(CancellationToken::is_cancelled) {
        return (Status::ABORT_REQUESTED, Status::ABORT_REQUESTED, bufs(cmp, data));
    }
    // Checked here too, under the exclusive range, as the device stack's fence does
    // (dev::fence): a Compare and Write names the status before it reads.
    if let Some(s) = ns.fenced(off, len as u64) {
        return (s, Status::ABORTED_FAILED_FUSED, bufs(cmp, data));
    }
    // As long as the command's transfer, which MDTS bounds (io_cmd::plan).
    let mut blocks = AlignedBuf::new(len);
    blocks.set_len(len);
    let read = chan.run(&*ns.dev, Op::Read { off }, blocks).await;
    if let Err(e) = read.result {
        let s = crate::dev::error_status(&e).unwrap_or(Status::UNRECOVERED_READ_ERROR);
        return (s, Status::ABORTED_FAILED_FUSED, bufs(cmp, data));
    }
    if read.buf[..len] != cmp[..] {
        return (Status::COMPARE_FAILURE.dnr(), Status::ABORTED_FAILED_FUSED, bufs(cmp, data));
    }
    let Some(data) = data else { return (Status::SUCCESS, Status::SUCCESS, bufs(cmp, None)) };
    // A write with FUA is durable when the device completes it (dev::Op::Write).
    let written = chan.run(&*ns.dev, Op::Write { off, fua }, data).await;
    match written.result {
        Ok(()) => (Status::SUCCESS, Status::SUCCESS, bufs(cmp, Some(written.buf))),
        Err(e) => (Status::ABORTED_FAILED_FUSED, crate::dev::error_status(&e).unwrap_or(Status::WRITE_FAULT), bufs(cmp, Some(written.buf))),
    }
}
