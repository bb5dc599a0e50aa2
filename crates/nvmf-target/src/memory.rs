//! The target's memory budget (`limits.memory`): what hosts can make it hold in total.
//! Connections (what a queue always holds from Connect to close, then the data buffers
//! and send buffer it grows), held compute results and started compute commands reserve
//! from it; a reservation is given back when dropped. When it is full, Connects are
//! refused (Connect Controller Busy), queues stop reading commands until buffers come
//! back, results are refused (RESULTS_FULL) and commands wait in the engine's queue
//! (docs/operations.md, "Limits").
//!
//! A queue that waits for the budget says so ([`Memory::wait`]); others then give back
//! what they hold unused (pooled buffers, an empty send buffer's growth), and every
//! release while one waits is announced to the subscribers ([`Memory::subscribe`]).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use tokio::sync::watch;

use crate::limits;

/// The machine's physical memory in bytes, or None where it cannot be read.
pub fn physical() -> Option<u64> {
    // SAFETY: sysconf only reads system configuration.
    let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    (pages > 0 && page > 0).then(|| pages as u64 * page as u64)
}

/// The memory budget and what one started compute command reserves from it, as configured
/// or derived (docs/operations.md, "Limits"): the default budget is half the machine's
/// memory, raised to [`limits::memory_budget_min`] of the command size on a machine too
/// small for it (the target must start with its defaults); the default command size is
/// [`limits::compute_memory_per_command_default`] of that budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// `limits.memory`, in bytes.
    pub budget: u64,
    /// `compute.memory_per_command`, in bytes.
    pub command: u64,
}

impl Plan {
    /// `budget` and `command` as configured (None: derived); `chunks`: the least one command
    /// needs, its chunk buffers for one input; `physical`: the machine's memory (None:
    /// unknown, then the budget defaults to [`limits::MEMORY_BUDGET_FALLBACK_BYTES`]).
    pub fn new(budget: Option<u64>, command: Option<u64>, chunks: u64, physical: Option<u64>) -> Plan {
        let base = budget.unwrap_or_else(|| physical.map_or(limits::MEMORY_BUDGET_FALLBACK_BYTES, |p| p / 2));
        let command = command.unwrap_or_else(|| limits::compute_memory_per_command_default(base).max(chunks));
        let budget = budget.unwrap_or_else(|| base.max(limits::memory_budget_min(command)));
        Plan { budget, command }
    }

    /// The least budget that holds this command size.
    pub fn budget_min(&self) -> u64 {
        limits::memory_budget_min(self.command)
    }
}

pub struct Memory {
    limit: u64,
    used: AtomicU64,
    /// The most reserved at once.
    peak: AtomicU64,
    /// Queues waiting for the budget ([`Waiting`]).
    waiting: AtomicUsize,
    /// Bumped when a queue starts waiting and when memory is given back while one waits.
    changed: watch::Sender<u64>,
    /// How many times a queue had to wait.
    waits: AtomicU64,
}

impl Memory {
    pub fn new(limit: u64) -> Arc<Memory> {
        Arc::new(Memory {
            limit,
            used: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            waiting: AtomicUsize::new(0),
            changed: watch::Sender::new(0),
            waits: AtomicU64::new(0),
        })
    }

    /// Wakes on every change that matters to a queue: one starts waiting (give back what
    /// is unused), or memory came back while one waits (try again).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Some queue waits for the budget: hold nothing unused.
    pub fn pressed(&self) -> bool {
        self.waiting.load(Relaxed) > 0
    }

    /// Times a queue had to wait for the budget (`nearstore_memory_waits_total`).
    pub fn waits(&self) -> u64 {
        self.waits.load(Relaxed)
    }

    /// Marks a queue waiting for the budget until the guard is dropped.
    pub fn wait(self: &Arc<Self>) -> Waiting {
        self.waiting.fetch_add(1, Relaxed);
        self.waits.fetch_add(1, Relaxed);
        self.changed.send_modify(|g| *g = g.wrapping_add(1));
        Waiting { memory: self.clone() }
    }

    fn released(&self) {
        if self.pressed() {
            self.changed.send_modify(|g| *g = g.wrapping_add(1));
        }
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

    /// Reserves what a connected queue of `entries` always holds
    /// ([`limits::connection_memory_fixed`]), leaving [`Memory::queue_keep`] free.
    pub fn reserve_queue(self: &Arc<Self>, entries: usize, command: u64) -> Option<Reservation> {
        self.reserve_leaving(limits::connection_memory_fixed(entries) as u64, Self::queue_keep(command))
    }

    /// What queues leave free, reserving or growing: one compute command of `command`
    /// bytes and its result, so that connections alone never starve compute.
    pub fn queue_keep(command: u64) -> u64 {
        command + limits::RESULT_BYTES_MAX as u64
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
    /// Bytes reserved.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Reserves `more` bytes besides, if `keep` bytes stay free after them.
    pub fn grow(&mut self, more: u64, keep: u64) -> bool {
        match self.memory.reserve_leaving(more, keep) {
            Some(r) => {
                self.bytes += more;
                std::mem::forget(r);
                true
            }
            None => false,
        }
    }

    /// Gives back what is reserved beyond `bytes`.
    pub fn shrink_to(&mut self, bytes: u64) {
        if bytes < self.bytes {
            self.memory.used.fetch_sub(self.bytes - bytes, Relaxed);
            self.bytes = bytes;
            self.memory.released();
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.memory.used.fetch_sub(self.bytes, Relaxed);
        self.memory.released();
    }
}

/// A queue waiting for the budget, until dropped.
pub struct Waiting {
    memory: Arc<Memory>,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.memory.waiting.fetch_sub(1, Relaxed);
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

    /// A reservation grows only while the budget, less what must stay free, holds it; a
    /// waiting queue is told when memory comes back, and only then.
    #[test]
    fn reservations_grow_within_the_budget_and_wake_waiters() {
        // (budget, first, growths (bytes, keep), which succeed, reserved at the end)
        type Case = (u64, u64, &'static [(u64, u64)], &'static [bool], u64);
        let cases: [Case; 3] = [
            (100, 10, &[(50, 0), (40, 0), (1, 0)], &[true, true, false], 100),
            (100, 10, &[(50, 40), (50, 30)], &[true, false], 60),
            (100, 100, &[(1, 0)], &[false], 100),
        ];
        for (limit, first, grows, want, end) in cases {
            let m = Memory::new(limit);
            let mut r = m.reserve(first).unwrap();
            let got: Vec<bool> = grows.iter().map(|&(b, k)| r.grow(b, k)).collect();
            assert_eq!(got, want, "budget {limit}, growths {grows:?}");
            assert_eq!((r.bytes(), m.used()), (end, end));
        }
        let m = Memory::new(100);
        let mut rx = m.subscribe();
        let mut r = m.reserve(100).unwrap();
        r.shrink_to(90);
        assert!(!rx.has_changed().unwrap(), "nobody waits: no wake-up");
        let w = m.wait();
        assert!(m.pressed() && rx.has_changed().unwrap(), "a waiter asks the others to give back");
        rx.borrow_and_update();
        r.shrink_to(50);
        assert!(rx.has_changed().unwrap(), "memory given back wakes the waiter");
        drop(w);
        assert!(!m.pressed());
        assert_eq!(m.waits(), 1);
    }
}
