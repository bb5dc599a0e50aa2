//! Fair sharing of the offload engine between controllers.
//!
//! Two round robins, both across controllers (a key per controller):
//! - [`FairQueue`]: commands waiting to start. A started command has a thread of its own;
//!   at most `limits::COMPUTE_STARTED_MAX` exist, `limits::COMPUTE_STARTED_PER_CONTROLLER_MAX`
//!   per controller, so one controller's backlog leaves room for others' commands.
//! - [`Cpu`]: turns to compute, `compute.threads` of them. A command holds a turn while it
//!   computes and, when another command waits for one, hands it on after
//!   `limits::COMPUTE_SLICE_MS` at its next check (between chunks, and inside a record
//!   every `STOP_CHECK_WORK` units of work): a long command cannot starve a short one.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::limits;

/// Items queued per key, taken round robin across keys.
pub struct FairQueue<T> {
    /// Keys with queued items, in the order they get their next turn.
    order: VecDeque<usize>,
    items: HashMap<usize, VecDeque<T>>,
    len: usize,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        FairQueue { order: VecDeque::new(), items: HashMap::new(), len: 0 }
    }
}

impl<T> FairQueue<T> {
    pub fn push(&mut self, key: usize, t: T) {
        let q = self.items.entry(key).or_default();
        if q.is_empty() {
            self.order.push_back(key);
        }
        q.push_back(t);
        self.len += 1;
    }

    /// The next item of the first key, in turn, that `eligible` accepts; that key goes to
    /// the back of the order if it has more.
    pub fn pop_if(&mut self, mut eligible: impl FnMut(usize) -> bool) -> Option<(usize, T)> {
        let at = self.order.iter().position(|&k| eligible(k))?;
        let key = self.order.remove(at)?;
        let q = self.items.get_mut(&key)?;
        let t = q.pop_front()?;
        if q.is_empty() {
            self.items.remove(&key);
        } else {
            self.order.push_back(key);
        }
        self.len -= 1;
        Some((key, t))
    }

    /// Drops the items `keep` refuses, handing them to `dropped`.
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool, mut dropped: impl FnMut(T)) {
        for q in self.items.values_mut() {
            let mut kept = VecDeque::with_capacity(q.len());
            for t in q.drain(..) {
                if keep(&t) {
                    kept.push_back(t);
                } else {
                    dropped(t);
                }
            }
            *q = kept;
        }
        self.items.retain(|_, q| !q.is_empty());
        let items = &self.items;
        self.order.retain(|k| items.contains_key(k));
        self.len = self.items.values().map(VecDeque::len).sum();
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Turns to compute, handed round robin across controllers.
pub struct Cpu {
    state: Mutex<CpuState>,
    wake: Condvar,
}

struct CpuState {
    free: usize,
    next_id: u64,
    waiting: FairQueue<u64>,
    /// Turns handed to a waiter that has not yet woken to take it.
    granted: Vec<u64>,
}

impl Cpu {
    pub fn new(turns: usize) -> Arc<Cpu> {
        Arc::new(Cpu {
            state: Mutex::new(CpuState { free: turns.max(1), next_id: 0, waiting: FairQueue::default(), granted: Vec::new() }),
            wake: Condvar::new(),
        })
    }

    /// A command's handle on the turns, for controller `key`; it holds none yet.
    pub fn turn(self: &Arc<Self>, key: usize) -> Turn {
        let mut s = self.state.lock();
        s.next_id += 1;
        Turn { cpu: self.clone(), key, id: s.next_id, since: Mutex::new(None) }
    }

    /// Commands waiting for a turn.
    pub fn waiting(&self) -> usize {
        self.state.lock().waiting.len()
    }

    fn give_back(&self) {
        let mut s = self.state.lock();
        match s.waiting.pop_if(|_| true) {
            Some((_, id)) => {
                s.granted.push(id);
                self.wake.notify_all();
            }
            None => s.free += 1,
        }
    }
}

/// One command's share of the [`Cpu`].
pub struct Turn {
    cpu: Arc<Cpu>,
    key: usize,
    id: u64,
    /// Since when it holds a turn; None while it holds none.
    since: Mutex<Option<Instant>>,
}

impl Turn {
    /// Waits for a turn; false if `stopped` says the command stops first.
    pub fn take(&self, stopped: &dyn Fn() -> bool) -> bool {
        let mut s = self.cpu.state.lock();
        if s.free > 0 && s.waiting.is_empty() {
            s.free -= 1;
        } else {
            s.waiting.push(self.key, self.id);
            loop {
                if let Some(at) = s.granted.iter().position(|&g| g == self.id) {
                    s.granted.swap_remove(at);
                    break;
                }
                if stopped() {
                    let id = self.id;
                    s.waiting.retain(|&w| w != id, |_| {});
                    return false;
                }
                self.cpu.wake.wait_for(&mut s, Duration::from_millis(20));
            }
        }
        *self.since.lock() = Some(Instant::now());
        true
    }

    /// At a check: hands the turn on if another command waits and this one has had its
    /// slice, then waits for the next. False if the command stops meanwhile.
    pub fn checkpoint(&self, stopped: &dyn Fn() -> bool) -> bool {
        let since = *self.since.lock();
        let Some(since) = since else { return self.take(stopped) };
        if since.elapsed() < Duration::from_millis(limits::COMPUTE_SLICE_MS) || self.cpu.waiting() == 0 {
            return true;
        }
        self.give_back();
        self.take(stopped)
    }

    /// Gives the turn back, if it holds one.
    pub fn give_back(&self) {
        if self.since.lock().take().is_some() {
            self.cpu.give_back();
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.give_back();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each case: items pushed as (key, item), and the order they come out in.
    #[test]
    fn fair_queue_takes_keys_in_turn() {
        type Case = (&'static [(usize, u32)], &'static [u32]);
        let cases: [Case; 3] = [
            (&[(1, 10), (1, 11), (1, 12), (2, 20)], &[10, 20, 11, 12]),
            (&[(1, 10), (2, 20), (3, 30), (1, 11), (2, 21)], &[10, 20, 30, 11, 21]),
            (&[(5, 1)], &[1]),
        ];
        for (pushed, want) in cases {
            let mut q = FairQueue::default();
            for &(k, v) in pushed {
                q.push(k, v);
            }
            let got: Vec<u32> = std::iter::from_fn(|| q.pop_if(|_| true).map(|(_, v)| v)).collect();
            assert_eq!(got, want, "pushed {pushed:?}");
            assert!(q.is_empty());
        }
        // A key that is not eligible keeps its place while the others go.
        let mut q = FairQueue::default();
        q.push(1, 10);
        q.push(2, 20);
        assert_eq!(q.pop_if(|k| k != 1), Some((2, 20)));
        assert_eq!(q.pop_if(|_| true), Some((1, 10)));
        // Dropped items leave the queue and its count.
        q.push(1, 1);
        q.push(1, 2);
        q.push(2, 3);
        let mut gone = Vec::new();
        q.retain(|&v| v != 2 && v != 3, |v| gone.push(v));
        gone.sort();
        assert_eq!((q.len(), gone), (1, vec![2, 3]));
        assert_eq!(q.pop_if(|_| true), Some((1, 1)));
    }

    /// With one turn, a command that holds it hands it to a waiter after its slice.
    #[test]
    fn a_turn_goes_to_a_waiter_after_the_slice() {
        let cpu = Cpu::new(1);
        let long = cpu.turn(1);
        assert!(long.take(&|| false));
        let short = cpu.turn(2);
        let t = std::thread::spawn(move || {
            let start = Instant::now();
            assert!(short.take(&|| false));
            start.elapsed()
        });
        while cpu.waiting() == 0 {
            std::thread::yield_now();
        }
        // Within the slice the turn stays; after it, the waiter gets it.
        assert!(long.checkpoint(&|| false));
        std::thread::sleep(Duration::from_millis(limits::COMPUTE_SLICE_MS + 5));
        let handed = std::thread::spawn(move || long.checkpoint(&|| false));
        let waited = t.join().unwrap();
        assert!(waited < Duration::from_secs(2), "{waited:?}");
        assert!(handed.join().unwrap(), "the long command gets its turn back once the short one is done");
        // A waiter that is stopped gives up.
        let a = cpu.turn(3);
        assert!(a.take(&|| false));
        assert!(!cpu.turn(4).take(&|| true));
        assert_eq!(cpu.waiting(), 0);
    }
}
