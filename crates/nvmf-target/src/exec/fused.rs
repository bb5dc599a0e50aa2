//! The fused write operations on an I/O queue (docs/compute-protocol.md, "Fused write
//! operations"): FUSED WRITE and READ CHECKSUM are checked here, then run on a blocking
//! thread (the journal's flushes, file reads), never on the network thread, and come
//! back as [`Done::Fused`]; OUTCOME is answered at once from the journal's table.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use nearstore_transport::AlignedBuf;
use nearstore_wire::fused::opcode as fop;
use nearstore_wire::log::ErrorEntry;
use nearstore_wire::{Sqe, Status};

use super::{Core, Inflight, Overflow, Transport};
use crate::fused::{self, Refusal};
use crate::io_cmd::IoKind;
use crate::io_pool::Done;
use crate::log_limit::peer_warn;
use crate::reply::Reply;
use crate::request::Request;
use crate::subsystem::Controller;

/// What a fused command's blocking work gives back to its queue.
pub struct Finished {
    /// The completion's DW0 and DW1, or why it failed.
    pub result: Result<(u32, u32), Refusal>,
    /// READ CHECKSUM's data buffer, its blocks in it.
    pub buf: Option<AlignedBuf>,
}

/// True for the fused commands' opcodes.
pub fn is_fused(opcode: u8) -> bool {
    matches!(opcode, fop::FUSED_WRITE | fop::READ_CHECKSUM | fop::OUTCOME)
}

impl<T: Transport> Core<T> {
    pub(super) fn execute_fused(&mut self, ctrl: &Arc<Controller>, sqe: Sqe, data: &[u8], req: Request) -> Result<(), Overflow> {
        match sqe.opcode() {
            fop::FUSED_WRITE => {
                let p = match fused::check(ctrl, &sqe, data) {
                    Ok(p) => p,
                    Err(r) => {
                        self.refuse_fused(ctrl, &sqe, req, r);
                        return Ok(());
                    }
                };
                if self.outstanding() >= self.outstanding_limit() {
                    return Err(self.overflow(req));
                }
                let hold = Arc::new(fused::AbortHold::default());
                let x = Inflight { fused: Some(hold.clone()), ..Inflight::new(req, p.ns.clone(), IoKind::Write, p.len(), 0) };
                let token = self.inflight.insert(x) as u32;
                self.blocking(token, move || {
                    let result = fused::run(&p, &hold).map(|r| fused_reply(&r));
                    hold.ended();
                    Finished { result, buf: None }
                });
            }
            fop::READ_CHECKSUM => {
                let p = match fused::check_read(ctrl, &sqe) {
                    Ok(p) => p,
                    Err(r) => {
                        self.refuse_fused(ctrl, &sqe, req, r);
                        return Ok(());
                    }
                };
                if self.outstanding() >= self.outstanding_limit() {
                    return Err(self.overflow(req));
                }
                let mut buf = self.take_buf();
                buf.set_len(p.len);
                let token = self.inflight.insert(Inflight::new(req, p.ns.clone(), IoKind::Read, p.len, sqe.slba())) as u32;
                self.blocking(token, move || {
                    let result = fused::read_checksum(&p, &mut buf).map(|crc| (crc, 0));
                    Finished { result, buf: Some(buf) }
                });
            }
            _ => match fused::outcome(ctrl, &sqe) {
                Ok((state, result)) => self.complete_with_data(req, &result, &Reply { dw0: state, ..Reply::default() }),
                Err(r) => self.refuse_fused(ctrl, &sqe, req, r),
            },
        }
        Ok(())
    }

    /// Runs `work` on the blocking pool; its end comes back to this queue as command
    /// `token`'s (the work finishes even when the connection has gone: a transaction is
    /// never cut by its host leaving).
    fn blocking(&mut self, token: u32, work: impl FnOnce() -> Finished + Send + 'static) {
        let reply = self.done_tx.clone();
        tokio::spawn(async move {
            let finished = tokio::task::spawn_blocking(work).await.unwrap_or_else(|e| Finished {
                result: Err(Refusal { status: Status::INTERNAL_ERROR.dnr(), message: format!("fused command: {e}") }),
                buf: None,
            });
            let _ = reply.send(Done::Fused { token, finished: Box::new(finished) });
        });
    }

    /// A fused command's blocking work ended.
    pub(super) fn on_fused(&mut self, token: u32, f: Finished) {
        let Some(x) = self.inflight.remove(token as usize) else {
            if let Some(b) = f.buf {
                self.put_buf(b);
            }
            return;
        };
        let Some(ctrl) = self.queue.as_ref().map(|q| q.ctrl.clone()) else {
            x.req.abandon();
            if let Some(b) = f.buf {
                self.put_buf(b);
            }
            return;
        };
        let took = x.req.start().elapsed();
        match f.result {
            Ok((dw0, dw1)) => {
                let s = &x.ns.stats;
                let (count, bytes) = if x.kind == IoKind::Read { (&s.reads, &s.read_bytes) } else { (&s.writes, &s.written_bytes) };
                count.fetch_add(1, Relaxed);
                bytes.fetch_add(x.len as u64, Relaxed);
                s.latency.record(took);
                if let Some(b) = &f.buf {
                    self.xport.send_data(x.req.cid(), &b[..x.len], false);
                }
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
        if let Some(b) = f.buf {
            self.put_buf(b);
        }
    }

    /// A fused command refused before it ran: its status, in the error log, the reason in
    /// the target's log.
    fn refuse_fused(&mut self, ctrl: &Controller, sqe: &Sqe, req: Request, r: Refusal) {
        peer_warn!(self.target.log_limit, self.peer.as_str(), "fused command refused", nsid = sqe.nsid(), status = %r.status, error = %r.message);
        self.fail_io(ctrl, sqe, req, r.status);
    }
}

/// A FUSED WRITE's completion: DW0 the crc32c of the bytes written, DW1 their count.
fn fused_reply(r: &[u8; nearstore_wire::fused::RESULT_BYTES]) -> (u32, u32) {
    let (crc, count, _) = nearstore_wire::fused::parse_result(r);
    (crc, count)
}
