//! Cross-Controller Reset on an admin queue (NVMe Base 2.3, admin 38h, from TP8028
//! "Rapid Path Failure Recovery"): a host that lost its connection to one controller, with
//! commands in flight there, resets that controller from another controller of its own and
//! learns when nothing the lost one started can still change storage. The command
//! completes only then (this target does not complete it early and report the end in the
//! Cross-Controller Reset log page): docs/protocol.md, "Cross-Controller Reset".

use std::sync::Arc;
use std::time::Duration;

use nearstore_wire::log::ErrorEntry;
use nearstore_wire::{Sqe, Status};
use tokio_util::sync::CancellationToken;

use super::{Core, Overflow, Transport};
use crate::io_pool::Done;
use crate::limits;
use crate::request::Request;
use crate::subsystem::Controller;

impl<T: Transport> Core<T> {
    pub(super) fn cross_controller_reset(&mut self, ctrl: &Arc<Controller>, sqe: &Sqe, req: Request) -> Result<(), Overflow> {
        let icid = sqe.cdw(10) as u16;
        let ciu = (sqe.cdw(10) >> 16) as u8;
        let cirn = u64::from(sqe.cdw(12)) | (u64::from(sqe.cdw(13)) << 32);
        if self.resets.len() >= limits::CROSS_CONTROLLER_RESETS_MAX {
            self.refuse(ctrl, sqe, req, Status::CROSS_CONTROLLER_RESET_LIMIT_EXCEEDED);
            return Ok(());
        }
        let ended = match ctrl.subsys.cross_controller_reset(ctrl, icid, ciu, cirn) {
            Ok(ended) => ended,
            Err(status) => {
                self.refuse(ctrl, sqe, req, status);
                return Ok(());
            }
        };
        self.wait_for_work(vec![ended], req)
    }

    /// Fence Host Instances (vendor admin C0h): every earlier instance of the issuer's
    /// process reset, as many Cross-Controller Resets under the same limits.
    pub(super) fn fence_host_instances(&mut self, ctrl: &Arc<Controller>, sqe: &Sqe, req: Request) -> Result<(), Overflow> {
        if self.resets.len() >= limits::CROSS_CONTROLLER_RESETS_MAX {
            self.refuse(ctrl, sqe, req, Status::CROSS_CONTROLLER_RESET_LIMIT_EXCEEDED);
            return Ok(());
        }
        match ctrl.subsys.fence_host_instances(ctrl) {
            Ok(ended) => self.wait_for_work(ended, req),
            Err(status) => {
                self.refuse(ctrl, sqe, req, status);
                Ok(())
            }
        }
    }

    /// Completes `req` once every token of `ended` is cancelled (the reset controllers'
    /// work is over), or with Command Interrupted after `CROSS_CONTROLLER_RESET_WAIT_MS`.
    fn wait_for_work(&mut self, ended: Vec<CancellationToken>, req: Request) -> Result<(), Overflow> {
        if ended.iter().all(CancellationToken::is_cancelled) {
            self.complete(req, Status::SUCCESS, 0, 0);
            return Ok(());
        }
        if self.outstanding() >= self.outstanding_limit() {
            return Err(self.overflow(req));
        }
        self.next_reset = self.next_reset.wrapping_add(1);
        let token = self.next_reset;
        self.resets.push((token, req));
        let reply = self.done_tx.clone();
        tokio::spawn(async move {
            let wait = Duration::from_millis(limits::CROSS_CONTROLLER_RESET_WAIT_MS);
            let all = async {
                for e in &ended {
                    e.cancelled().await;
                }
            };
            let status = match tokio::time::timeout(wait, all).await {
                Ok(()) => Status::SUCCESS,
                Err(_) => Status::COMMAND_INTERRUPTED,
            };
            // The admin queue may be gone: then nobody waits.
            let _ = reply.send(Done::Reset { token, status });
        });
        Ok(())
    }

    /// Completes the command with `status`, in the error log (no LBA, no namespace: CDW10
    /// names a controller).
    fn refuse(&mut self, ctrl: &Controller, sqe: &Sqe, req: Request, status: Status) {
        ctrl.record_error(ErrorEntry { sqid: 0, cid: sqe.cid(), status: status.to_field(), ..Default::default() });
        self.complete(req, status, 0, 0);
    }

    /// A Cross-Controller Reset's wait ended.
    pub(super) fn on_reset(&mut self, token: u32, status: Status) {
        let Some(i) = self.resets.iter().position(|(t, _)| *t == token) else { return };
        let (_, req) = self.resets.swap_remove(i);
        self.complete(req, status, 0, 0);
    }
}
