//! A queue's buffers against the target's memory budget (docs/protocol.md, "Memory per
//! connection"). What a queue always holds is charged at Connect
//! ([`limits::connection_memory_fixed`]): its receive buffer, the first
//! [`limits::TX_BUFFER_BYTES`] of its send buffer, [`limits::QUEUE_BUFFERS_FIXED`] data
//! buffers, its io_uring and slots. More data buffers and a larger send buffer are charged
//! when the queue grows them. A queue the budget cannot grow waits: it reads no further
//! command until a buffer comes back (its own, or one another queue gives back), sends
//! nothing more until the host has read, and never fails a command for it. While a queue
//! waits, the others give back their pooled buffers and an empty send buffer's growth.

use std::mem::size_of;

use nearstore_transport::AlignedBuf;
use nearstore_wire::Status;

use super::{Core, Deferred, Inflight, Transport, Waiting};
use crate::limits;
use crate::memory::Memory;

// A queue entry's slots (a command waiting for its data, a command in flight, each in a
// slab that may double, with its free-list index; a write waiting for a buffer) fit what
// the budget charges per entry.
const _: () = assert!(
    2 * (size_of::<Option<Waiting>>() + size_of::<Option<Inflight>>() + 2 * size_of::<usize>()) + size_of::<Deferred>()
        <= limits::QUEUE_SLOT_BYTES
);

impl<T: Transport> Core<T> {
    /// Room in the transport for one more response ([`Transport::has_room`]), its send
    /// buffer grown, charged to the budget, when the budget allows.
    pub fn room(&mut self) -> bool {
        if self.xport.has_room() {
            return true;
        }
        match self.xport.make_room() {
            Some(0) => true,
            Some(bytes) if self.grow(bytes) => {
                self.xport_grown += bytes;
                self.xport.grow(bytes);
                true
            }
            _ => false,
        }
    }

    /// A data buffer waits in the pool for the next command, allocated (and charged past
    /// the queue's fixed ones) if need be: the transport reads a command only then. False:
    /// the budget cannot give one now; the queue waits ([`Core::wait_for_memory`]).
    pub fn buf_ready(&mut self) -> bool {
        self.pool_holds(1)
    }

    /// This queue waits for the budget (a command needs a buffer): the others give back
    /// what they do not use, and tell it when memory comes back. Until the next
    /// [`Core::buf_ready`] that succeeds.
    pub fn wait_for_memory(&mut self) {
        if self.memory_wait.is_none() {
            self.memory_wait = Some(self.target.memory.wait());
        }
    }

    /// No longer waiting for the budget.
    pub fn memory_came(&mut self) {
        self.memory_wait = None;
    }

    /// The pool holds `n` buffers, allocated and charged as [`Core::buf_ready`].
    pub(super) fn pool_holds(&mut self, n: usize) -> bool {
        while self.bufs.len() < n {
            if self.data_bufs >= limits::QUEUE_BUFFERS_FIXED && !self.grow(limits::TRANSFER_BYTES_MAX) {
                return false;
            }
            self.data_bufs += 1;
            self.bufs.push(AlignedBuf::new(limits::TRANSFER_BYTES_MAX));
        }
        true
    }

    /// A data buffer for a command: one from the pool, where [`Core::buf_ready`] put one
    /// before the command was read ([`Core::pool_holds`] two for a fetch).
    pub(super) fn take_buf(&mut self) -> AlignedBuf {
        self.bufs.pop().unwrap_or_else(|| {
            debug_assert!(false, "a command took a data buffer the pool did not hold");
            self.data_bufs += 1;
            AlignedBuf::new(limits::TRANSFER_BYTES_MAX)
        })
    }

    /// A data buffer comes back: pooled for the next command, or freed (and its charge
    /// given back) while another queue waits for the budget.
    pub(super) fn put_buf(&mut self, b: AlignedBuf) {
        let spare = self.data_bufs > limits::QUEUE_BUFFERS_FIXED && self.memory_wait.is_none() && self.target.memory.pressed();
        if spare || self.bufs.len() >= limits::QUEUE_DEPTH_MAX as usize {
            drop(b);
            self.data_bufs -= 1;
            self.recharge();
        } else {
            self.bufs.push(b);
        }
    }

    /// While another queue waits for the budget, gives back what this one holds unused:
    /// pooled buffers past its fixed ones, and an empty send buffer's growth.
    pub fn trim(&mut self) {
        if self.queue.is_none() || self.memory_wait.is_some() || !self.target.memory.pressed() {
            return;
        }
        let before = self.grown_bytes();
        while self.data_bufs > limits::QUEUE_BUFFERS_FIXED && self.bufs.pop().is_some() {
            self.data_bufs -= 1;
        }
        let shrunk = self.xport.shrink().min(self.xport_grown);
        self.xport_grown -= shrunk;
        if self.grown_bytes() < before {
            self.recharge();
        }
    }

    /// Fetches the data of writes that waited for a buffer, in order, while the pool holds
    /// two (a fetch never takes the last one); those aborted meanwhile by another host's
    /// Preempt and Abort complete without their data.
    pub fn send_deferred(&mut self) {
        while self.room() {
            let aborted = match self.deferred.front() {
                Some(d) => d.aborted,
                None => return,
            };
            if !aborted && !self.pool_holds(2) {
                return;
            }
            let Some(d) = self.deferred.pop_front() else { return };
            if !aborted {
                self.fetch(d.sqe, d.len, d.req);
                continue;
            }
            match self.queue.as_ref().map(|q| q.ctrl.clone()) {
                Some(ctrl) => self.fail_io(&ctrl, &d.sqe, d.req, Status::ABORTED_PREEMPT),
                None => self.complete(d.req, Status::ABORTED_PREEMPT, 0, 0),
            }
        }
    }

    /// What the queue holds beyond what it always holds, charged to the budget.
    fn grown_bytes(&self) -> u64 {
        (self.data_bufs.saturating_sub(limits::QUEUE_BUFFERS_FIXED) * limits::TRANSFER_BYTES_MAX + self.xport_grown) as u64
    }

    /// Charges `bytes` more to the budget, leaving a compute command free as Connect does;
    /// false when the budget cannot hold them or the queue is not connected yet (before
    /// Connect a connection holds only what it always holds).
    fn grow(&mut self, bytes: usize) -> bool {
        let keep = Memory::queue_keep(self.target.offload.cfg.command_bytes());
        self.queue.as_mut().is_some_and(|q| q.memory.grow(bytes as u64, keep))
    }

    /// Gives back the charge of what the queue no longer holds.
    fn recharge(&mut self) {
        let grown = self.grown_bytes();
        if let Some(q) = &mut self.queue {
            q.memory.shrink_to(q.fixed + grown);
        }
    }
}
