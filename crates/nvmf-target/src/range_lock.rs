//! A namespace's range locks: what makes a Compare and Write (and a FUSED WRITE's
//! read-modify-write) atomic against every other writer of its blocks (docs/protocol.md,
//! "Compare and Write").
//!
//! A Compare and Write holds its byte range exclusively ([`RangeLocks::lock`], on a
//! blocking thread) while it reads, compares and writes; so does a read-modify-write, in its
//! journal turn, from its read to its write in place. Every other writer (Write, Write
//! Zeroes, Deallocate, the other FUSED WRITEs' transactions, a compute command's output
//! writes) holds its range shared for as long as its operation runs:
//! [`RangeLocks::try_write`] on a network thread, which never waits (a refused writer is
//! parked by its queue and tried again when the exclusive range goes), [`RangeLocks::write`]
//! on threads that may wait.
//!
//! Writers do not serialize among themselves, and while no exclusive locker is on the
//! namespace a writer only counts itself in and out (`fast`, no lock, nothing recorded).
//! An exclusive locker first makes itself seen (`exclusive`), so that later writers take
//! the slow path and record their ranges, and is granted when the fast writers that came
//! before it have gone, no recorded writer overlaps it and no earlier exclusive range
//! overlaps it (first come, first served, so a stream of writers does not starve it: a
//! writer that overlaps a waiting exclusive range waits behind it). Both counters are
//! sequentially consistent: a writer counts itself in, then looks for exclusive lockers; a
//! locker announces itself, then looks at the writers; one of the two sees the other.
//!
//! No deadlock, by three rules: nothing in the device stack (fair scheduler, delay, fence,
//! volume, remote) takes a range or a journal turn, so a holder's device operations end
//! whatever the ranges; a FUSED WRITE takes its journal turn before its range (shared, or
//! exclusive for read-modify-write); a Compare and Write never takes a journal turn. A
//! shared writer holds its range over its own operation (a device operation's goes with
//! it, `Channel::hold`, released when the storage has finished it; on a remote or volume
//! device, whose operations run on tasks, when its completion is taken, which waits for no
//! range). Waits are not bounded, though: an exclusive holder's device operations may wait
//! for its tenant's share in a fair-scheduled device or for an extent's move, and meanwhile
//! the writers of its blocks wait too (a FUSED WRITE among them holding its namespace's
//! journal turn), and an exclusive locker waits for every fast writer in the namespace that
//! came before it, whatever its blocks.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::limits;

/// Wakes a queue whose writer was refused, when an exclusive range goes.
pub type Wake = Box<dyn FnOnce() + Send>;

/// The range locks of one namespace.
#[derive(Default)]
pub struct RangeLocks {
    /// Writers counted in without a recorded range (while `exclusive` was zero).
    fast: AtomicUsize,
    /// Exclusive ranges held or waited for: while non-zero, writers record their ranges.
    exclusive: AtomicUsize,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// Exclusive ranges in arrival order, held or waited for (at most
    /// limits::RANGE_LOCKS_MAX).
    exclusive: Vec<Exclusive>,
    next_ticket: u64,
    /// Ranges of writers on the slow path, while they run (bounded by the commands the
    /// namespace's queues hold at once).
    shared: Vec<Range<u64>>,
    /// Queues with writers refused, woken when an exclusive range goes.
    parked: Vec<Wake>,
}

struct Exclusive {
    ticket: u64,
    range: Range<u64>,
}

fn overlap(a: &Range<u64>, b: &Range<u64>) -> bool {
    a.start < b.end && b.start < a.end
}

/// A writer's standing: its range is shared until this is dropped.
#[must_use = "the range is held until the guard is dropped"]
pub struct WriteGuard {
    locks: Arc<RangeLocks>,
    /// None: counted in `fast`.
    range: Option<Range<u64>>,
}

/// A Compare and Write's exclusive range, held until this is dropped.
#[must_use = "the range is held until the guard is dropped"]
pub struct RangeGuard {
    locks: Arc<RangeLocks>,
    ticket: u64,
}

impl RangeLocks {
    /// A writer of `range` that must not wait: Some while no exclusive range overlaps it,
    /// held or waited for. None: `wake` (called only then) is kept, and called when an
    /// exclusive range goes; the writer tries again then.
    pub fn try_write(self: &Arc<Self>, range: Range<u64>, wake: impl FnOnce() -> Wake) -> Option<WriteGuard> {
        if let Some(g) = self.fast() {
            return Some(g);
        }
        let mut s = self.state.lock();
        if s.exclusive.iter().any(|e| overlap(&e.range, &range)) {
            s.parked.push(wake());
            return None;
        }
        s.shared.push(range.clone());
        Some(WriteGuard { locks: self.clone(), range: Some(range) })
    }

    /// A writer of `range` on a thread that may wait (blocking pool, offload engine): waits
    /// while an exclusive range overlaps it.
    pub fn write(self: &Arc<Self>, range: Range<u64>) -> WriteGuard {
        if let Some(g) = self.fast() {
            return g;
        }
        let mut s = self.state.lock();
        while s.exclusive.iter().any(|e| overlap(&e.range, &range)) {
            self.changed.wait(&mut s);
        }
        s.shared.push(range.clone());
        WriteGuard { locks: self.clone(), range: Some(range) }
    }

    /// The writer counted in without a lock, if no exclusive range is on the namespace.
    fn fast(self: &Arc<Self>) -> Option<WriteGuard> {
        self.fast.fetch_add(1, SeqCst);
        if self.exclusive.load(SeqCst) == 0 {
            return Some(WriteGuard { locks: self.clone(), range: None });
        }
        self.fast_out();
        None
    }

    fn fast_out(&self) {
        if self.fast.fetch_sub(1, SeqCst) == 1 && self.exclusive.load(SeqCst) > 0 {
            // Under the lock: a locker between its look at `fast` and its wait sees this.
            let _s = self.state.lock();
            self.changed.notify_all();
        }
    }

    /// Holds `range` exclusively, waiting (on a blocking thread: never a network one) for
    /// the writers in it and the exclusive ranges before it to go.
    pub fn lock(self: &Arc<Self>, range: Range<u64>) -> RangeGuard {
        let mut s = self.state.lock();
        while s.exclusive.len() >= limits::RANGE_LOCKS_MAX {
            self.changed.wait(&mut s);
        }
        let ticket = s.next_ticket;
        s.next_ticket += 1;
        s.exclusive.push(Exclusive { ticket, range: range.clone() });
        self.exclusive.fetch_add(1, SeqCst);
        loop {
            let before = s.exclusive.iter().take_while(|e| e.ticket != ticket);
            let busy = self.fast.load(SeqCst) > 0
                || s.shared.iter().any(|r| overlap(r, &range))
                || before.into_iter().any(|e| overlap(&e.range, &range));
            if !busy {
                return RangeGuard { locks: self.clone(), ticket };
            }
            self.changed.wait(&mut s);
        }
    }

    /// Exclusive ranges held or waited for, writers recorded, queues parked (tests, metrics).
    pub fn counts(&self) -> (usize, usize, usize) {
        let s = self.state.lock();
        (s.exclusive.len(), s.shared.len(), s.parked.len())
    }
}

impl Drop for WriteGuard {
    fn drop(&mut self) {
        match self.range.take() {
            None => self.locks.fast_out(),
            Some(r) => {
                let mut s = self.locks.state.lock();
                if let Some(i) = s.shared.iter().position(|x| *x == r) {
                    s.shared.swap_remove(i);
                }
                self.locks.changed.notify_all();
            }
        }
    }
}

impl Drop for RangeGuard {
    fn drop(&mut self) {
        let parked = {
            let mut s = self.locks.state.lock();
            if let Some(i) = s.exclusive.iter().position(|e| e.ticket == self.ticket) {
                s.exclusive.remove(i);
            }
            self.locks.exclusive.fetch_sub(1, SeqCst);
            self.locks.changed.notify_all();
            std::mem::take(&mut s.parked)
        };
        for wake in parked {
            wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    fn wake_flag() -> (Arc<AtomicBool>, impl FnOnce() -> Wake) {
        let f = Arc::new(AtomicBool::new(false));
        let g = f.clone();
        (f, move || Box::new(move || g.store(true, SeqCst)) as Wake)
    }

    #[test]
    fn writers_are_refused_only_where_an_exclusive_range_is() {
        let l = Arc::new(RangeLocks::default());
        let held = l.lock(100..200);
        // (writer's range, let in)
        let cases = [(0..100, true), (200..300, true), (0..101, false), (199..200, false), (150..160, false), (0..1000, false)];
        for (r, ok) in cases {
            let (woken, wake) = wake_flag();
            let g = l.try_write(r.clone(), wake);
            assert_eq!(g.is_some(), ok, "{r:?}");
            drop(g);
            assert!(!woken.load(SeqCst), "{r:?}: woken before the range went");
        }
        let (woken, wake) = wake_flag();
        assert!(l.try_write(120..130, wake).is_none());
        drop(held);
        assert!(woken.load(SeqCst), "the parked writer is woken when the range goes");
        assert!(l.try_write(120..130, || unreachable!()).is_some());
        assert_eq!(l.counts(), (0, 0, 0));
    }

    #[test]
    fn a_locker_waits_for_the_writers_before_it() {
        let l = Arc::new(RangeLocks::default());
        // A fast writer (no range recorded) and a recorded one.
        let fast = l.try_write(0..10, || unreachable!()).expect("no exclusive range");
        let (tx, rx) = std::sync::mpsc::channel();
        let l2 = l.clone();
        let t = std::thread::spawn(move || {
            let g = l2.lock(0..10);
            tx.send(()).unwrap();
            drop(g);
        });
        // The locker announced itself: a new overlapping writer is refused.
        while l.counts().0 == 0 {
            std::thread::yield_now();
        }
        assert!(l.try_write(5..6, || Box::new(|| {})).is_none());
        let other = l.try_write(1000..1010, || unreachable!()).expect("elsewhere is free");
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err(), "granted while a writer is in the range");
        drop(other);
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err(), "granted while the fast writer runs");
        drop(fast);
        rx.recv_timeout(Duration::from_secs(30)).expect("granted once the writer went");
        t.join().unwrap();
        assert_eq!(l.counts().0, 0);
    }

    #[test]
    fn overlapping_lockers_take_turns_and_blocking_writers_wait() {
        let l = Arc::new(RangeLocks::default());
        let counter = Arc::new(Mutex::new((0u64, 0u64)));
        let mut threads = Vec::new();
        for i in 0..8 {
            let (l, c) = (l.clone(), counter.clone());
            threads.push(std::thread::spawn(move || {
                for _ in 0..200 {
                    if i % 2 == 0 {
                        let _g = l.lock(0..4096);
                        // Read, then write: a second holder inside would lose an update.
                        let v = c.lock().0;
                        std::thread::yield_now();
                        c.lock().0 = v + 1;
                    } else {
                        let _g = l.write(1024..2048);
                        c.lock().1 += 1;
                    }
                }
            }));
        }
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*counter.lock(), (800, 800));
        assert_eq!(l.counts(), (0, 0, 0));
    }
}
