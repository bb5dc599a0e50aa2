//! The device over a synchronous [`Backend`]: the bottom of every stack.
//!
//! Where each operation runs:
//! - memory ([`Backend::inline`]): reads and writes on the calling task, reads lent
//!   straight from memory ([`BlockDevice::read_now`]); they cost about a memcpy and MDTS
//!   bounds them;
//! - file and block device ([`Backend::raw_fd`]): reads, writes and flushes on the
//!   channel's io_uring; reads also synchronously for a thread of its own
//!   ([`BlockDevice::read_blocking`], the offload engine's reader);
//! - on the worker pool: write zeroes and deallocate (not bounded by MDTS: inline they held
//!   a network thread, and every connection on it, for seconds), everything when the ring
//!   is off (`io_engine = "threads"`) or unavailable, and every operation of a backend that
//!   is neither (a simulated disk).

use std::io;
use std::sync::Arc;

use nearstore_transport::AlignedBuf;

use super::{BlockDevice, Channel, Geometry, Op};
use crate::backend::Backend;
use crate::io_pool;
use crate::limits;

pub struct Local {
    backend: Arc<dyn Backend>,
    /// The backend is in memory and lends its bytes ([`Backend::with_slices`]): reads and
    /// writes complete at once. An inline backend that cannot lend (a simulated disk) runs
    /// them on the calling task through `submit`.
    now: bool,
}

impl Local {
    pub fn new(backend: Arc<dyn Backend>) -> Local {
        let now = backend.inline() && backend.with_slices(0, 0, &mut |_| {}).is_some();
        Local { backend, now }
    }
}

impl BlockDevice for Local {
    fn describe(&self) -> String {
        self.backend.describe()
    }

    fn geometry(&self) -> Geometry {
        Geometry {
            size: self.backend.size(),
            block_size: self.backend.block_bytes(),
            align: nearstore_transport::PAGE as u32,
            queue_depth: limits::QUEUE_DEPTH_MAX as u32,
        }
    }

    fn submit(&self, ch: &mut Channel, op: Op, mut buf: AlignedBuf, tag: u64) {
        if op.unbounded() {
            return ch.pool(self.backend.clone(), op, buf, tag);
        }
        if self.backend.inline() {
            let r = io_pool::execute(&*self.backend, &op, &mut buf);
            return ch.complete(tag, r, buf);
        }
        let (op, buf) = match self.backend.raw_fd() {
            Some(fd) => match ch.ring(fd, op, buf, tag) {
                Ok(()) => return,
                Err(back) => back,
            },
            None => (op, buf),
        };
        ch.pool(self.backend.clone(), op, buf, tag);
    }

    fn completes_now(&self) -> bool {
        self.now
    }

    fn read_now(&self, off: u64, len: usize, f: &mut dyn FnMut(&[&[u8]])) -> Option<io::Result<()>> {
        if !self.now {
            return None;
        }
        self.backend.with_slices(off, len, f)
    }

    fn lend(&self, off: u64, len: usize, _who: Option<&super::fair::Tenant>) -> Option<io::Result<()>> {
        if !self.now {
            return None;
        }
        // What with_slices checks, without taking a stripe lock.
        Some(match off.checked_add(len as u64) {
            Some(end) if end <= self.backend.size() => Ok(()),
            _ => Err(io::Error::new(io::ErrorKind::InvalidInput, "I/O beyond the end of the backend")),
        })
    }

    fn reads_blocking(&self) -> bool {
        !self.backend.inline() && self.backend.raw_fd().is_some()
    }

    fn read_blocking(&self, off: u64, buf: &mut [u8]) -> Option<io::Result<()>> {
        self.reads_blocking().then(|| self.backend.read_at(buf, off))
    }

    fn write_now(&self, data: &[u8], off: u64, fua: bool, _who: Option<&super::fair::Tenant>) -> Option<io::Result<()>> {
        if !self.now {
            return None;
        }
        let r = self.backend.write_at(data, off);
        Some(if fua { r.and_then(|_| self.backend.flush_range(off, data.len() as u64)) } else { r })
    }
}
