//! A device with a bandwidth: every read and write takes its length divided by the rate of
//! one shared timeline before it reaches the device below, so operations of all queues
//! queue behind one another as on a disk that serves so many bytes a second. For tests
//! and experiments: contention that is real on a machine whose memory or page cache is far
//! faster than the disks being modelled (docs/fair-io.md).

use std::sync::Arc;
use std::time::Duration;

use nearstore_transport::AlignedBuf;
use parking_lot::Mutex;
use tokio::time::Instant;

use super::{BlockDevice, Channel, Geometry, Op};

pub struct Rate {
    base: Arc<dyn BlockDevice>,
    /// Bytes per second.
    bps: u64,
    /// When the operations started so far are through.
    busy_until: Mutex<Option<Instant>>,
}

impl Rate {
    pub fn new(base: Arc<dyn BlockDevice>, bps: u64) -> Rate {
        Rate { base, bps: bps.max(1), busy_until: Mutex::new(None) }
    }

    /// When an operation of `len` bytes offered now is through.
    fn finish(&self, len: usize) -> Instant {
        let now = Instant::now();
        let took = Duration::from_nanos((len as u128 * 1_000_000_000 / self.bps as u128).min(u64::MAX as u128) as u64);
        let mut busy = self.busy_until.lock();
        let at = busy.map_or(now, |b| b.max(now)) + took;
        *busy = Some(at);
        at
    }
}

impl BlockDevice for Rate {
    fn describe(&self) -> String {
        format!("{} limited to {} bytes/s", self.base.describe(), self.bps)
    }

    fn geometry(&self) -> Geometry {
        self.base.geometry()
    }

    fn quiesce(&self, off: u64, len: u64) -> Option<super::Quiesce> {
        self.base.quiesce(off, len)
    }

    fn submit(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64) {
        match op {
            Op::Read { .. } | Op::Write { .. } => {
                let at = self.finish(buf.len());
                ch.defer(at, self.base.clone(), op, buf, tag);
            }
            _ => self.base.submit(ch, op, buf, tag),
        }
    }

    // read_now and write_now stay None: nothing completes at once on a limited device.
}
