//! The target's memory budget (`limits.memory`): what hosts can make it hold in total.
//! Connections (their worst-case buffers, from Connect to close), held compute results
//! and started compute commands reserve from it; a reservation is given back when
//! dropped. When it is full, Connects are refused (Connect Controller Busy), results are
//! refused (RESULTS_FULL) and commands wait in the engine's queue (docs/operations.md,
//! "Limits").

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

pub struct Memory {
    limit: u64,
    used: AtomicU64,
    /// The most reserved at once.
    peak: AtomicU64,
}

impl Memory {
    pub fn new(limit: u64) -> Arc<Memory> {
        Arc::new(Memory { limit, used: AtomicU64::new(0), peak: AtomicU64::new(0) })
    }

    /// Half the machine's physical memory: the default budget.
    pub fn machine_default() -> u64 {
        // SAFETY: sysconf only reads system configuration.
        let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
        if pages <= 0 || page <= 0 {
            return crate::limits::MEMORY_BUDGET_FALLBACK_BYTES;
        }
        pages as u64 * page as u64 / 2
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn used(&self) -> u64 {
        self.used.load(Relaxed)
    }

    pub fn peak(&self) -> u64 {
        self.peak.load(Relaxed)
    }

    /// Reserves `bytes`, or None when the budget cannot hold them.
    pub fn reserve(self: &Arc<Self>, bytes: u64) -> Option<Reservation> {
        self.reserve_leaving(bytes, 0)
    }

    /// Reserves `bytes` only if `keep` bytes stay free after them: held results leave room
    /// for one compute command, so that a command always starts once those running end.
    pub fn reserve_leaving(self: &Arc<Self>, bytes: u64, keep: u64) -> Option<Reservation> {
        let mut cur = self.used.load(Relaxed);
        loop {
            let next = cur.checked_add(bytes).filter(|n| n.saturating_add(keep) <= self.limit)?;
            match self.used.compare_exchange_weak(cur, next, Relaxed, Relaxed) {
                Ok(_) => {
                    self.peak.fetch_max(next, Relaxed);
                    return Some(Reservation { memory: self.clone(), bytes });
                }
                Err(now) => cur = now,
            }
        }
    }
}

/// Bytes reserved from the budget until dropped.
pub struct Reservation {
    memory: Arc<Memory>,
    bytes: u64,
}

impl Reservation {
    /// Gives back what is reserved beyond `bytes`.
    pub fn shrink_to(&mut self, bytes: u64) {
        if bytes < self.bytes {
            self.memory.used.fetch_sub(self.bytes - bytes, Relaxed);
            self.bytes = bytes;
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.memory.used.fetch_sub(self.bytes, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each case: the budget, reservations asked in order (kept), and which succeed.
    #[test]
    fn reservations_stay_under_the_budget() {
        let cases: [(u64, &[u64], &[bool]); 3] =
            [(100, &[60, 40, 1], &[true, true, false]), (100, &[101], &[false]), (10, &[5, 6, 5], &[true, false, true])];
        for (limit, asks, want) in cases {
            let m = Memory::new(limit);
            let mut kept = Vec::new();
            let got: Vec<bool> = asks.iter().map(|&b| m.reserve(b).map(|r| kept.push(r)).is_some()).collect();
            assert_eq!(got, want, "budget {limit}, asks {asks:?}");
            assert!(m.peak() <= limit);
            drop(kept);
            assert_eq!(m.used(), 0);
        }
        let m = Memory::new(100);
        let mut r = m.reserve(80).unwrap();
        r.shrink_to(30);
        assert_eq!(m.used(), 30);
        assert!(m.reserve(70).is_some());
    }
}
