//! Authentication Send and Receive on a queue (crate::auth has the state machine). A
//! message whose handling takes an exponentiation runs on the blocking pool: the queue's
//! state goes there and comes back with [`Done::Auth`], and the command completes then.

use nearstore_wire::{Sqe, Status};
use tracing::{info, warn};

use super::{Core, Overflow, Transport};
use crate::auth::QueueAuth;
use crate::io_pool::Done;
use crate::reply::Reply;
use crate::request::Request;

impl<T: Transport> Core<T> {
    /// True when the queue may run commands other than Connect, Property Get and Set,
    /// authentication and Disconnect: its host needs no authentication or has done it.
    pub(super) fn auth_passed(&self) -> bool {
        !self.auth_required || self.auth_ok
    }

    /// The queue's authentication state, made on first use for a host without keys (whose
    /// transactions fail, as Linux's target: it has no key to check a response with).
    fn queue_auth(&mut self) -> Option<Box<QueueAuth>> {
        if let Some(a) = self.auth.take() {
            return Some(a);
        }
        let q = self.queue.as_ref()?;
        Some(Box::new(QueueAuth::new(None, &q.ctrl.hostnqn, &q.ctrl.subsys.nqn)))
    }

    /// Authentication Send: the host's message, `data` (its TL bytes, checked by
    /// fabrics::data_len before they were requested).
    pub(super) fn auth_send(&mut self, data: &[u8], req: Request) -> Result<(), Overflow> {
        let Some(mut a) = self.queue_auth().filter(|_| self.auth_busy.is_none()) else {
            // One authentication command at a time: the host waits for each.
            self.complete(req, Status::COMMAND_SEQUENCE_ERROR.dnr(), 0, 0);
            return Ok(());
        };
        if a.is_slow(data) {
            let data = data.to_vec();
            let reply = self.done_tx.clone();
            self.auth_busy = Some(req);
            tokio::spawn(async move {
                // A panic on the pool (none is expected) loses the state: the queue then
                // answers every authentication command with a sequence error.
                if let Ok(a) = tokio::task::spawn_blocking(move || {
                    a.send(&data);
                    a
                })
                .await
                {
                    let _ = reply.send(Done::Auth { auth: a });
                }
            });
            return Ok(());
        }
        a.send(data);
        self.auth_sent(a, req);
        Ok(())
    }

    /// A slow Authentication Send finished on the blocking pool.
    pub(super) fn on_auth(&mut self, a: Box<QueueAuth>) {
        match self.auth_busy.take() {
            Some(req) => self.auth_sent(a, req),
            None => self.auth = Some(a),
        }
    }

    fn auth_sent(&mut self, a: Box<QueueAuth>, req: Request) {
        self.settle_auth(a);
        self.complete(req, Status::SUCCESS, 0, 0);
    }

    /// Authentication Receive of `al` bytes: the message the transaction is at, cut to or
    /// padded with zeros to AL, as Security Receive returns data.
    pub(super) fn auth_receive(&mut self, sqe: &Sqe, req: Request) {
        let Some(mut a) = self.queue_auth().filter(|_| self.auth_busy.is_none()) else {
            self.complete(req, Status::COMMAND_SEQUENCE_ERROR.dnr(), 0, 0);
            return;
        };
        let mut m = a.receive();
        m.resize(sqe.cdw(11) as usize, 0);
        self.settle_auth(a);
        self.complete_with_data(req, &m, &Reply::ok());
    }

    /// Keeps the state; a failed transaction closes the queue once its responses are sent.
    fn settle_auth(&mut self, a: Box<QueueAuth>) {
        let was = self.auth_ok;
        self.auth_ok = a.authenticated;
        if let Some(q) = &self.queue {
            if a.fatal && !self.close_after_flush {
                warn!(peer = %self.peer, cntlid = q.ctrl.cntlid, qid = q.qid, hostnqn = %q.ctrl.hostnqn, "authentication failed: closing the queue");
                self.target.stats.auth_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.close_after_flush = true;
            } else if self.auth_ok && !was {
                info!(peer = %self.peer, cntlid = q.ctrl.cntlid, qid = q.qid, hostnqn = %q.ctrl.hostnqn, "queue authenticated");
            }
        }
        self.auth = Some(a);
    }
}
