//! The fused write operations on an I/O queue (docs/compute-protocol.md, "Fused write
//! operations"): a FUSED WRITE is checked here (its namespace, journal and access before
//! its data moves), keeps its transfer in the queue's pooled buffer (charged to the
//! queue's memory) and waits, as a task and not on a thread, for its turn on the
//! namespace's journal, at most FUSED_WAITING_PER_NAMESPACE_MAX of them; then its
//! transaction runs on a blocking thread (the journal's flushes) and comes back as
//! [`Done::Fused`]. READ CHECKSUM is a Read on the namespace's device, its checksum taken
//! on completion; OUTCOME is answered at once from the journal's table.

use std::io;
use std::ops::Range;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use nearstore_transport::AlignedBuf;
use nearstore_wire::fused::opcode as fop;
use nearstore_wire::log::ErrorEntry;
use nearstore_wire::{Sqe, Status};

use super::{Core, Inflight, Overflow, Transport};
use crate::fused::{self, AbortHold, Refusal};
use crate::io_cmd::{self, IoKind, IoPlan};
use crate::io_pool::Done;
use crate::limits;
use crate::log_limit::peer_warn;
use crate::reply::Reply;
use crate::request::Request;
use crate::subsystem::Controller;

/// What a FUSED WRITE's work gives back to its queue.
pub struct Finished {
    /// The completion's DW0 and DW1, or why it failed.
    pub result: Result<(u32, u32), Refusal>,
    /// The command's transfer, back to the queue's pool.
    pub buf: AlignedBuf,
}

/// True for the fused commands' opcodes.
pub fn is_fused(opcode: u8) -> bool {
    matches!(opcode, fop::FUSED_WRITE | fop::READ_CHECKSUM | fop::OUTCOME)
}

impl<T: Transport> Core<T> {
    /// Runs a fused command; its host data is `data` (in-capsule) or `buf` (fetched).
    pub(super) fn execute_fused(
        &mut self,
        ctrl: &Arc<Controller>,
        sqe: Sqe,
        data: &[u8],
        buf: Option<AlignedBuf>,
        req: Request,
    ) -> Result<(), Overflow> {
        match sqe.opcode() {
            fop::FUSED_WRITE => {
                let buf = buf.unwrap_or_else(|| {
                    // In-capsule: into a pooled buffer, which buf_ready left for it.
                    let mut b = self.take_buf();
                    b.set_len(data.len());
                    b.copy_from_slice(data);
                    b
                });
                return self.fused_write(ctrl, sqe, buf, req);
            }
            fop::READ_CHECKSUM => return self.read_checksum(ctrl, sqe, req),
            _ => match fused::outcome(ctrl, &sqe) {
                Ok((state, result)) => self.complete_with_data(req, &result, &Reply { dw0: state, ..Reply::default() }),
                Err(r) => self.refuse_fused(ctrl, &sqe, req, r),
            },
        }
        if let Some(b) = buf {
            self.put_buf(b);
        }
        Ok(())
    }

    /// A FUSED WRITE whose transfer is in `buf`: checked, admitted to wait for its turn on
    /// the namespace's journal, run there on a blocking thread.
    fn fused_write(&mut self, ctrl: &Arc<Controller>, sqe: Sqe, buf: AlignedBuf, req: Request) -> Result<(), Overflow> {
        let p = match fused::check(ctrl, &sqe, &buf) {
            Ok(p) => p,
            Err(r) => {
                self.put_buf(buf);
                self.refuse_fused(ctrl, &sqe, req, r);
                return Ok(());
            }
        };
        let Some(admitted) = p.journal.admit(limits::FUSED_WAITING_PER_NAMESPACE_MAX) else {
            self.put_buf(buf);
            let r = Refusal {
                status: Status::COMMAND_INTERRUPTED,
                message: format!(
                    "{} fused writes wait for namespace {}'s journal: retry",
                    limits::FUSED_WAITING_PER_NAMESPACE_MAX,
                    p.ns.nsid
                ),
            };
            self.refuse_fused(ctrl, &sqe, req, r);
            return Ok(());
        };
        if self.outstanding() >= self.outstanding_limit() {
            self.put_buf(buf);
            return Err(self.overflow(req));
        }
        let hold = Arc::new(AbortHold::default());
        let nsid = p.ns.nsid;
        let x = Inflight { fused: Some(hold.clone()), ..Inflight::new(req, p.ns.clone(), IoKind::Write, p.len(), 0) };
        let token = self.inflight.insert(x) as u32;
        let reply = self.done_tx.clone();
        // Its controller's life, until the transaction has ended: a Cross-Controller Reset
        // of the controller waits for it (subsystem::Life).
        let life = self.chan.life_shared();
        let removed = ctrl.cancel.clone();
        // The work finishes even when the connection has gone: a transaction is never cut
        // by its host leaving. One not yet in a group when its controller is removed (a
        // Cross-Controller Reset waiting for it) does not run.
        tokio::spawn(async move {
            let _admitted = admitted;
            let _life = life;
            let journal = p.journal.clone();
            let (id, mut ended) = fused::enqueue(p, buf, hold.clone());
            let withdrawn = |buf, status, why: &str| {
                hold.ended();
                Ok((Err(Refusal { status, message: format!("namespace {nsid}: {why}") }), buf))
            };
            let ended = tokio::select! {
                biased;
                e = &mut ended => e,
                () = hold.aborted_wait() => match fused::withdraw(&journal, id) {
                    // Not in a group yet: it does not run, and it leaves the queue now.
                    Some(buf) => withdrawn(buf, Status::ABORTED_PREEMPT, "its host was preempted and aborted"),
                    None => ended.await,
                },
                () = removed.cancelled() => match fused::withdraw(&journal, id) {
                    Some(buf) => withdrawn(buf, Status::ABORT_REQUESTED, "its controller was removed before its turn"),
                    None => ended.await,
                },
            };
            let finished = match ended {
                Ok((result, buf)) => Finished { result: result.map(|r| fused_reply(&r)), buf },
                Err(_) => {
                    hold.ended();
                    Finished {
                        result: Err(Refusal {
                            status: Status::INTERNAL_ERROR.dnr(),
                            message: "fused write: its group's work panicked".into(),
                        }),
                        // Its buffer went with the work: the pool's count stays whole.
                        buf: AlignedBuf::new(limits::TRANSFER_BYTES_MAX),
                    }
                }
            };
            let _ = reply.send(Done::Fused { token, finished: Box::new(finished) });
        });
        Ok(())
    }

    /// READ CHECKSUM: planned as a Read (the namespace, its range, MDTS, the tenant and the
    /// reservations), read through the namespace's device on this queue's channel like any
    /// read, its checksum taken when it completes ([`Core::on_read_checksum`]).
    fn read_checksum(&mut self, ctrl: &Arc<Controller>, sqe: Sqe, req: Request) -> Result<(), Overflow> {
        let plan = io_cmd::plan(&ctrl.subsys, &ctrl.hostid, &ctrl.tenant, &sqe, ctrl.write_cache.load(Relaxed));
        let (IoPlan { ns, kind, op, len, lba }, sum) = match plan.map_err(|status| Refusal { status, message: "as a Read".into() }) {
            Ok(p) => match fused::checksum_range(&sqe, p.len) {
                Ok(sum) => (p, sum),
                Err(r) => {
                    self.refuse_fused(ctrl, &sqe, req, r);
                    return Ok(());
                }
            },
            Err(r) => {
                self.refuse_fused(ctrl, &sqe, req, r);
                return Ok(());
            }
        };
        if self.outstanding() >= self.outstanding_limit() {
            return Err(self.overflow(req));
        }
        let mut b = self.take_buf();
        b.set_len(len);
        let sum = Some((sum.start as u32, sum.end as u32));
        let token = self.inflight.insert(Inflight { sum, ..Inflight::new(req, ns.clone(), kind, len, lba) });
        ns.dev.submit(&mut self.chan, op, b, token as u64);
        Ok(())
    }

    /// A READ CHECKSUM's read completed: its blocks, then the completion with the crc32c of
    /// `sum` of them in DW0 (on the network thread: at most one transfer, MDTS).
    pub(super) fn on_read_checksum(&mut self, ctrl: &Controller, x: Inflight, sum: Range<usize>, result: io::Result<()>, buf: &[u8]) {
        match result {
            Ok(()) => {
                let crc = crc32c::crc32c(&buf[sum]);
                self.xport.send_data(x.req.cid(), &buf[..x.len], false);
                self.count_done(&x);
                self.complete(x.req, Status::SUCCESS, crc, 0);
            }
            Err(e) => self.io_error(ctrl, &x.ns, x.kind, x.lba, x.req, e),
        }
    }

    /// A FUSED WRITE's work ended.
    pub(super) fn on_fused(&mut self, token: u32, f: Finished) {
        let Finished { result, buf } = f;
        self.put_buf(buf);
        let Some(mut x) = self.inflight.remove(token as usize) else { return };
        let Some(ctrl) = self.queue.as_ref().map(|q| q.ctrl.clone()) else {
            x.req.abandon();
            return;
        };
        match result {
            Ok((dw0, dw1)) => {
                // The bytes it wrote (compress-write's frame, not the largest one planned).
                x.len = dw1 as usize;
                self.count_done(&x);
                self.complete(x.req, Status::SUCCESS, dw0, dw1);
            }
            Err(r) => {
                let sqid = self.queue.as_ref().map_or(0, |q| q.qid);
                peer_warn!(self.target.log_limit, self.peer.as_str(), "fused command failed", nsid = x.ns.nsid, status = %r.status, error = %r.message);
                x.ns.stats.errors.fetch_add(1, Relaxed);
                ctrl.record_error(ErrorEntry {
                    sqid,
                    cid: x.req.cid(),
                    status: r.status.to_field(),
                    nsid: x.ns.nsid,
                    ..Default::default()
                });
                self.complete(x.req, r.status, 0, 0);
            }
        }
    }

    /// A fused command's I/O in its namespace's counters.
    fn count_done(&self, x: &Inflight) {
        let s = &x.ns.stats;
        let (count, bytes) = if x.kind == IoKind::Read { (&s.reads, &s.read_bytes) } else { (&s.writes, &s.written_bytes) };
        count.fetch_add(1, Relaxed);
        bytes.fetch_add(x.len as u64, Relaxed);
        s.latency.record(x.req.start().elapsed());
    }

    /// A FUSED WRITE refused before its data moved (before the R2T): its namespace, its
    /// journal, its host's access to the namespace. Some(why) refused.
    pub(super) fn fused_refused_before_data(&self, sqe: &Sqe) -> Option<(Arc<Controller>, Refusal)> {
        let q = self.queue.as_ref().filter(|q| q.qid > 0 && sqe.opcode() == fop::FUSED_WRITE)?;
        fused::check_before_data(&q.ctrl, sqe).err().map(|r| (q.ctrl.clone(), r))
    }

    /// A fused command refused before it ran: its status, in the error log, the reason in
    /// the target's log.
    pub(super) fn refuse_fused(&mut self, ctrl: &Controller, sqe: &Sqe, req: Request, r: Refusal) {
        peer_warn!(self.target.log_limit, self.peer.as_str(), "fused command refused", nsid = sqe.nsid(), status = %r.status, error = %r.message);
        self.fail_io(ctrl, sqe, req, r.status);
    }
}

/// A FUSED WRITE's completion: DW0 the crc32c of the bytes written, DW1 their count.
fn fused_reply(r: &[u8; nearstore_wire::fused::RESULT_BYTES]) -> (u32, u32) {
    let (crc, count, _) = nearstore_wire::fused::parse_result(r);
    (crc, count)
}
