//! The reservation commands on an I/O queue, and the state files they (and Set Features
//! Reservation Persistence) write before completing: on a blocking thread, never on the
//! network thread.

use std::io;
use std::sync::Arc;
use std::time::Instant;

use nearstore_wire::log::ErrorEntry;
use nearstore_wire::pdu::fes;
use nearstore_wire::{Sqe, Status};
use tracing::warn;

use super::{fatal, ConnError, Core, Inflight};
use crate::io_cmd::{self, IoKind};
use crate::io_pool::Done;
use crate::subsystem::{Controller, Namespace, Snapshot};

impl Core {
    pub(super) fn execute_reservation(&mut self, ctrl: &Arc<Controller>, sqe: &Sqe, data: &[u8], start: Instant) -> Result<(), ConnError> {
        match io_cmd::reservation(ctrl, sqe, data) {
            Err(s) => self.fail_io(ctrl, sqe, s),
            Ok((mut r, None)) => {
                let d = std::mem::take(&mut r.data);
                self.complete_with_data(sqe.cid(), &d, &r);
            }
            Ok((_, Some((ns, snapshot)))) => self.persist(sqe.cid(), ns, snapshot, start)?,
        }
        Ok(())
    }

    /// Writes a namespace's reservation state file; the command `cid` completes once it is
    /// written ([`Core::on_persisted`]).
    pub(super) fn persist(&mut self, cid: u16, ns: Arc<Namespace>, snapshot: Snapshot, start: Instant) -> Result<(), ConnError> {
        if self.r2t.live + self.inflight.live >= self.outstanding_limit() {
            return Err(fatal(fes::PDU_SEQUENCE_ERROR, 0, "more commands outstanding than the queue size"));
        }
        let token = self.inflight.insert(Inflight { cid, ns: ns.clone(), kind: IoKind::Other, len: 0, lba: 0, start, ring: None }) as u32;
        let reply = self.done_tx.clone();
        tokio::task::spawn_blocking(move || {
            let result = ns.reservations.persist(snapshot);
            // The connection may be gone; the state is written all the same.
            let _ = reply.send(Done::Persisted { token, result });
        });
        Ok(())
    }

    pub(super) fn on_persisted(&mut self, token: u32, result: io::Result<()>) {
        let Some(x) = self.inflight.remove(token as usize) else { return };
        match result {
            Ok(()) => self.complete(x.cid, Status::SUCCESS, 0, 0),
            Err(e) => {
                warn!(peer = %self.peer, nsid = x.ns.nsid, "writing the reservation state file failed: {e}");
                let status = Status::INTERNAL_ERROR.dnr();
                if let Some(q) = &self.queue {
                    let e = ErrorEntry { sqid: q.qid, cid: x.cid, status: status.to_field(), nsid: x.ns.nsid, ..Default::default() };
                    q.ctrl.record_error(e);
                }
                self.complete(x.cid, status, 0, 0);
            }
        }
    }
}
