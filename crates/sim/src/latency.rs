//! Disk latency: a device stacked on the simulated disk's (a `Local` over [`SimDisk`](crate::disk::SimDisk))
//! that holds every operation back for a time the seed chooses. A queue's operations then
//! reach the disk, and complete, in another order than they were submitted, as on a real
//! device with internal parallelism.

use std::sync::Arc;
use std::time::Duration;

use nearstore_target::dev::{BlockDevice, Channel, Geometry, Op};
use nearstore_transport::AlignedBuf;
use parking_lot::Mutex;
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;
use tokio::time::Instant;

pub struct Latency {
    base: Arc<dyn BlockDevice>,
    rng: Mutex<XorShiftRng>,
    /// Longest hold, in microseconds.
    us_max: u64,
}

impl Latency {
    pub fn new(base: Arc<dyn BlockDevice>, seed: u64, us_max: u64) -> Latency {
        Latency { base, rng: Mutex::new(XorShiftRng::seed_from_u64(seed)), us_max }
    }
}

impl BlockDevice for Latency {
    fn describe(&self) -> String {
        format!("{} with up to {} us of latency", self.base.describe(), self.us_max)
    }

    fn geometry(&self) -> Geometry {
        self.base.geometry()
    }

    fn submit(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64) {
        let hold = Duration::from_micros(self.rng.lock().random_range(0..=self.us_max));
        ch.defer(Instant::now() + hold, self.base.clone(), op, buf, tag);
    }
}
