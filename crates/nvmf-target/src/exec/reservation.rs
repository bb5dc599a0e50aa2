//! The reservation commands on an I/O queue, and what they (and Set Features Reservation
//! Persistence) wait for before completing: the state file written, on a blocking thread,
//! never on the network thread; and the commands a Preempt and Abort aborts.

use std::io;
use std::sync::Arc;

use nearstore_wire::log::ErrorEntry;
use nearstore_wire::{Sqe, Status};
use tracing::warn;

use super::{Core, Inflight, Overflow, Transport};
use crate::io_cmd::{self, IoKind, Later};
use crate::io_pool::Done;
use crate::request::Request;
use crate::subsystem::Controller;

impl<T: Transport> Core<T> {
    pub(super) fn execute_reservation(&mut self, ctrl: &Arc<Controller>, sqe: &Sqe, data: &[u8], req: Request) -> Result<(), Overflow> {
        match io_cmd::reservation(ctrl, sqe, data) {
            Err(s) => self.fail_io(ctrl, sqe, req, s),
            Ok((mut r, None)) => {
                let d = std::mem::take(&mut r.data);
                self.complete_with_data(req, &d, &r);
            }
            Ok((_, Some(later))) => self.later(req, later)?,
        }
        Ok(())
    }

    /// Completes the command `req` once its namespace's reservation state file is written
    /// and the commands its Preempt and Abort aborts have completed ([`Core::on_persisted`]).
    pub(super) fn later(&mut self, req: Request, later: Later) -> Result<(), Overflow> {
        if self.outstanding() >= self.outstanding_limit() {
            return Err(self.overflow(req));
        }
        let Later { ns, snapshot, abort } = later;
        let token = self.inflight.insert(Inflight::new(req, ns.clone(), IoKind::Reservation, 0, 0)) as u32;
        let reply = self.done_tx.clone();
        tokio::spawn(async move {
            let result = match snapshot {
                // The connection may be gone; the state is written all the same.
                Some(s) => {
                    tokio::task::spawn_blocking(move || ns.reservations.persist(s)).await.unwrap_or_else(|e| Err(io::Error::other(e)))
                }
                None => Ok(()),
            };
            if let Some(w) = abort {
                w.done().await;
            }
            let _ = reply.send(Done::Persisted { token, result });
        });
        Ok(())
    }

    pub(super) fn on_persisted(&mut self, token: u32, result: io::Result<()>) {
        let Some(x) = self.inflight.remove(token as usize) else { return };
        match result {
            Ok(()) => self.complete(x.req, Status::SUCCESS, 0, 0),
            Err(e) => {
                warn!(peer = %self.peer, nsid = x.ns.nsid, "writing the reservation state file failed: {e}");
                let status = Status::INTERNAL_ERROR.dnr();
                if let Some(q) = &self.queue {
                    let e = ErrorEntry { sqid: q.qid, cid: x.req.cid(), status: status.to_field(), nsid: x.ns.nsid, ..Default::default() };
                    q.ctrl.record_error(e);
                }
                self.complete(x.req, status, 0, 0);
            }
        }
    }
}
