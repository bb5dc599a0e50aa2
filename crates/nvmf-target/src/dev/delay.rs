//! A device that holds every operation back for a fixed time before passing it to the
//! device it claims: slow disks and long networks in tests, and the first stacked device.

use std::sync::Arc;
use std::time::Duration;

use nearstore_transport::AlignedBuf;
use tokio::time::Instant;

use super::{BlockDevice, Channel, Geometry, Op};

pub struct Delay {
    base: Arc<dyn BlockDevice>,
    delay: Duration,
}

impl Delay {
    pub fn new(base: Arc<dyn BlockDevice>, delay: Duration) -> Delay {
        Delay { base, delay }
    }
}

impl BlockDevice for Delay {
    fn describe(&self) -> String {
        format!("{} delayed by {:?}", self.base.describe(), self.delay)
    }

    fn geometry(&self) -> Geometry {
        self.base.geometry()
    }

    fn quiesce(&self, off: u64, len: u64) -> Option<super::Quiesce> {
        self.base.quiesce(off, len)
    }

    fn submit(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64) {
        ch.defer(Instant::now() + self.delay, self.base.clone(), op, buf, tag);
    }

    // read_now and write_now stay None: nothing completes at once through a delay.
}
