//! The compute commands on an I/O queue: EXEC hands a validated descriptor to the offload
//! engine; FETCH and RELEASE serve the controller's held results (docs/compute-protocol.md).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use nearstore_wire::compute::{opcode as cop, status as cs};
use nearstore_wire::log::ErrorEntry;
use nearstore_wire::{Sqe, Status};
use tracing::warn;

use super::{Core, Inflight, Overflow, Transport};
use crate::io_cmd::IoKind;
use crate::limits;
use crate::offload::{self, Computed, Failure, Slot, Task, TaskAbort};
use crate::reply::Reply;
use crate::request::Request;
use crate::reservation::Access;
use crate::subsystem::Controller;

/// True for the vendor-specific opcodes the compute commands use.
pub fn is_compute(opcode: u8) -> bool {
    opcode >= 0x80
}

impl<T: Transport> Core<T> {
    pub(super) fn execute_compute(&mut self, ctrl: &Arc<Controller>, sqe: Sqe, data: &[u8], req: Request) -> Result<(), Overflow> {
        match sqe.opcode() {
            cop::EXEC => {
                let Some(slot) = Slot::claim(ctrl, &self.target.memory, self.target.offload.cfg.command_bytes()) else {
                    self.fail_io(ctrl, &sqe, req, cs::RESULTS_FULL);
                    return Ok(());
                };
                let Some(ns) = ctrl.subsys.namespace(sqe.nsid()) else {
                    let f =
                        Failure::new(Status::INVALID_NAMESPACE.dnr(), format!("namespace {} is not in {}", sqe.nsid(), ctrl.subsys.nqn));
                    self.fail_compute(ctrl, req, sqe.nsid(), slot, f);
                    return Ok(());
                };
                let (desc, op) = match offload::validate(&ns, data, &self.target.offload.cfg, &self.target.offload.peers) {
                    Ok(v) => v,
                    Err(f) => {
                        ns.stats.errors.fetch_add(1, Relaxed);
                        self.fail_compute(ctrl, req, sqe.nsid(), slot, f);
                        return Ok(());
                    }
                };
                if let Err(d) = ctrl.tenant.check_descriptor(&ctrl.subsys.nqn, ns.nsid, ns.block_size as u64, &desc, op.name) {
                    self.fail_compute(ctrl, req, sqe.nsid(), slot, Failure::new(Status::ACCESS_DENIED.dnr(), d.0));
                    return Ok(());
                }
                // Reading the namespace's extents is a read; writing outputs into it a write.
                let access = if desc.outputs.is_empty() { Access::Read } else { Access::Write };
                if !ns.reservations.allows(&ctrl.hostid, access) {
                    let f = Failure::new(Status::RESERVATION_CONFLICT.dnr(), format!("namespace {} is reserved by another host", ns.nsid));
                    self.fail_compute(ctrl, req, sqe.nsid(), slot, f);
                    return Ok(());
                }
                if self.outstanding() >= self.outstanding_limit() {
                    return Err(self.overflow(req));
                }
                let abort = TaskAbort::new(&self.cancel);
                let token =
                    self.inflight.insert(Inflight { task: Some(abort.clone()), ..Inflight::new(req, ns.clone(), IoKind::Compute, 0, 0) });
                let task = Task {
                    ns,
                    op,
                    desc,
                    token: token as u32,
                    slot,
                    reply: self.done_tx.clone(),
                    cancel: abort.cancel.clone(),
                    abort,
                    host: ctrl.requester().to_string(),
                };
                self.target.offload.submit(task);
            }
            cop::FETCH => {
                let len = sqe.sgl().len as usize;
                if len > limits::TRANSFER_BYTES_MAX {
                    self.fail_io(ctrl, &sqe, req, Status::INVALID_FIELD.dnr());
                    return Ok(());
                }
                let r = ctrl.results.lock().fetch(sqe.cdw(10), sqe.cdw(11) as u64, len);
                match r {
                    Ok((mut bytes, remaining)) => {
                        if remaining == 0 {
                            self.target.offload.kick();
                        }
                        let valid = bytes.len() as u32;
                        bytes.resize(len, 0);
                        self.complete_with_data(req, &bytes, &Reply { dw0: valid, dw1: remaining, ..Reply::default() });
                    }
                    Err(f) => self.fail_io(ctrl, &sqe, req, f.status),
                }
            }
            cop::RELEASE => {
                let released = ctrl.results.lock().release(sqe.cdw(10));
                if released {
                    self.target.offload.kick();
                }
                let status = if released { Status::SUCCESS } else { cs::HANDLE_INVALID };
                if released {
                    self.complete(req, status, 0, 0);
                } else {
                    self.fail_io(ctrl, &sqe, req, status);
                }
            }
            _ => self.fail_io(ctrl, &sqe, req, Status::INVALID_OPCODE.dnr()),
        }
        Ok(())
    }

    /// Fails an EXEC, refused at once or failed on the engine: recorded in the error log,
    /// the message held under the handle the completion carries.
    fn fail_compute(&mut self, ctrl: &Controller, req: Request, nsid: u32, slot: Slot, f: Failure) {
        warn!(peer = %self.peer, nsid, status = %f.status, "compute command failed: {}", f.message);
        let sqid = self.queue.as_ref().map_or(0, |q| q.qid);
        ctrl.record_error(ErrorEntry { sqid, cid: req.cid(), status: f.status.to_field(), nsid, ..Default::default() });
        let len = f.message.len() as u32;
        let handle = slot.fill(f.message.into_bytes(), self.result_ttl());
        self.complete(req, f.status, handle, len);
    }

    fn result_ttl(&self) -> Duration {
        Duration::from_secs(self.target.offload.cfg.result_ttl_secs)
    }

    /// A compute command finished on the offload engine.
    pub(super) fn on_computed(&mut self, token: u32, c: Computed) {
        let Some(x) = self.inflight.remove(token as usize) else { return };
        let Some(ctrl) = self.queue.as_ref().map(|q| q.ctrl.clone()) else {
            x.req.abandon();
            return;
        };
        x.ns.stats.latency.record(x.req.start().elapsed());
        match c.result {
            Ok(json) => {
                x.ns.stats.other.fetch_add(1, Relaxed);
                let len = json.len() as u32;
                let handle = c.slot.fill(json, self.result_ttl());
                self.complete(x.req, Status::SUCCESS, handle, len);
            }
            Err(f) => {
                x.ns.stats.errors.fetch_add(1, Relaxed);
                // Stopped by another host's Preempt and Abort (a failure of its own, or a
                // closing connection, keeps its status).
                let f = if x.task.as_ref().is_some_and(|t| t.aborted())
                    && f.status == Status::ABORT_REQUESTED
                    && !self.cancel.is_cancelled()
                {
                    Failure::new(
                        Status::ABORTED_PREEMPT,
                        format!("aborted: another host preempted this host's registration on namespace {} (Preempt and Abort)", x.ns.nsid),
                    )
                } else {
                    f
                };
                self.fail_compute(&ctrl, x.req, x.ns.nsid, c.slot, f);
            }
        }
    }
}
