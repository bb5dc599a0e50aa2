//! What an operation may use besides its inputs: a memory bound it charges before it
//! allocates, and a [`Stop`] it looks at while it works.
//!
//! The engine that runs an operation (the target's offload engine, the host's local
//! path) builds one [`Context`] per command:
//! - `memory_max`: the command's own bound, in bytes;
//!   (a target's total over commands is its engine's: the offload engine reserves each
//!   started command's whole bound from the target's memory budget);
//! - `stop`: cancellation and a deadline. Operations call [`Stop::check`] between chunks
//!   and, through a [`Meter`], at least every [`STOP_CHECK_WORK`] units of work inside one
//!   record, so a command stops within that much work of being cancelled.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::ComputeError;

/// Work between two looks at a [`Stop`], in units of about one byte or one character
/// processed: 1 MiB of work takes well under 10 ms on any machine we run on, so a
/// command notices cancellation or its deadline within that, while the check itself
/// (an atomic load, a clock read) costs nothing measurable.
pub const STOP_CHECK_WORK: u64 = 1 << 20;

/// What an operation may use besides its inputs. Built per command by the engine that
/// runs it; cheap to clone (the stop is shared).
#[derive(Clone, Debug)]
pub struct Context {
    /// Memory the operation may hold at once (a sort's records, a select's groups, rows
    /// to order, intermediate strings of its expressions), in bytes: charged to an
    /// [`Account`] before it is allocated. Chunks read from the inputs are counted by the
    /// engine, not here.
    pub memory_max: usize,
    /// Cancellation and deadline of the command.
    pub stop: Stop,
}

impl Default for Context {
    fn default() -> Self {
        Context { memory_max: 256 << 20, stop: Stop::default() }
    }
}

impl Context {
    /// The default context with another memory bound (tests, the local path).
    pub fn with_memory(memory_max: usize) -> Context {
        Context { memory_max, ..Context::default() }
    }
}

/// A request to stop a running operation: cancelled from outside ([`Stop::cancel`], or
/// a probe the engine installs, such as "the connection went away"), or past its
/// deadline. Clones share one state.
#[derive(Clone, Default)]
pub struct Stop {
    inner: Arc<StopInner>,
}

#[derive(Default)]
struct StopInner {
    cancelled: AtomicBool,
    /// When the command times out, and its timeout in seconds for the message.
    deadline: Option<(Instant, u64)>,
    /// Also cancelled when this returns true (looked at on every check).
    probe: Option<Box<dyn Fn() -> bool + Send + Sync>>,
}

impl fmt::Debug for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stop")
            .field("cancelled", &self.inner.cancelled.load(Relaxed))
            .field("deadline", &self.inner.deadline)
            .field("probe", &self.inner.probe.is_some())
            .finish()
    }
}

impl Stop {
    /// A stop that times out `timeout` from now (None: never), and is cancelled when
    /// `probe` returns true (None: only by [`Stop::cancel`]). The target passes its
    /// command timeout and `move || token.is_cancelled()` for the controller's or
    /// connection's cancellation token.
    pub fn new(timeout: Option<Duration>, probe: Option<Box<dyn Fn() -> bool + Send + Sync>>) -> Stop {
        let deadline = timeout.map(|t| (Instant::now() + t, t.as_secs()));
        Stop { inner: Arc::new(StopInner { cancelled: AtomicBool::new(false), deadline, probe }) }
    }

    /// Cancels the operation: its next check fails with [`ComputeError::Cancelled`].
    pub fn cancel(&self) {
        self.inner.cancelled.store(true, Relaxed);
    }

    /// Ok while the operation may go on; else the error it stops with: Cancelled, or
    /// Timeout past the deadline.
    pub fn check(&self) -> Result<(), ComputeError> {
        let i = &*self.inner;
        if i.cancelled.load(Relaxed) || i.probe.as_ref().is_some_and(|p| p()) {
            i.cancelled.store(true, Relaxed);
            return Err(ComputeError::Cancelled);
        }
        if let Some((at, secs)) = i.deadline {
            if Instant::now() >= at {
                return Err(ComputeError::Timeout(secs));
            }
        }
        Ok(())
    }

    /// A meter that checks this stop every [`STOP_CHECK_WORK`] units of work.
    pub fn meter(&self) -> Meter {
        Meter { stop: self.clone(), left: STOP_CHECK_WORK, steps: 0 }
    }
}

/// Counts work inside one operation and looks at its [`Stop`] every
/// [`STOP_CHECK_WORK`] units: the bounded interval at which long work inside one record
/// notices cancellation.
#[derive(Clone, Debug)]
pub struct Meter {
    stop: Stop,
    left: u64,
    /// All work counted so far (tests compare it with the bound they expect).
    steps: u64,
}

impl Meter {
    /// `units` more work done (at least one is counted).
    #[inline]
    pub fn work(&mut self, units: u64) -> Result<(), ComputeError> {
        let units = units.max(1);
        self.steps += units;
        if units < self.left {
            self.left -= units;
            return Ok(());
        }
        self.left = STOP_CHECK_WORK;
        self.stop.check()
    }

    /// Work counted since the meter was made.
    pub fn steps(&self) -> u64 {
        self.steps
    }
}

/// The memory one command holds, charged before it is allocated, against the command's
/// bound.
#[derive(Debug)]
pub struct Account {
    op: &'static str,
    limit: usize,
    used: usize,
}

impl Account {
    pub fn new(op: &'static str, ctx: &Context) -> Account {
        Account { op, limit: ctx.memory_max, used: 0 }
    }

    /// Charges `bytes` before they are allocated; refused with [`ComputeError::Memory`]
    /// naming `what` (called only on refusal) when the command's bound would be exceeded.
    /// Nothing is charged on refusal.
    pub fn charge(&mut self, bytes: usize, what: impl FnOnce() -> String) -> Result<(), ComputeError> {
        let next = self.used.checked_add(bytes).filter(|n| *n <= self.limit);
        let Some(next) = next else {
            return Err(ComputeError::Memory { op: self.op, limit: self.limit, what: what() });
        };
        self.used = next;
        Ok(())
    }

    /// Gives back bytes charged before (freed, or handed on).
    pub fn release(&mut self, bytes: usize) {
        let bytes = bytes.min(self.used);
        self.used -= bytes;
    }

    /// Bytes charged now.
    pub fn used(&self) -> usize {
        self.used
    }

    /// The command's bound, in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accounts_refuse_before_the_bound() {
        let ctx = Context { memory_max: 600, stop: Stop::default() };
        let mut a = Account::new("t", &ctx);
        a.charge(600, || "a".into()).unwrap();
        let e = a.charge(1, || "one more byte".into()).unwrap_err();
        assert_eq!(e, ComputeError::Memory { op: "t", limit: 600, what: "one more byte".into() });
        assert_eq!(a.used(), 600);
        a.release(100);
        a.charge(100, || "b".into()).unwrap();
        a.release(usize::MAX);
        assert_eq!(a.used(), 0);
        assert!(Account::new("t", &ctx).charge(usize::MAX, || "all".into()).is_err());
    }

    #[test]
    fn stops_by_cancel_probe_and_deadline_within_the_check_interval() {
        let s = Stop::default();
        let mut m = s.meter();
        m.work(10).unwrap();
        s.cancel();
        // The meter looks at the stop only once STOP_CHECK_WORK units have passed.
        let mut n = 10;
        let e = loop {
            n += 1000;
            if let Err(e) = m.work(1000) {
                break e;
            }
        };
        assert_eq!(e, ComputeError::Cancelled);
        assert!((STOP_CHECK_WORK..=STOP_CHECK_WORK + 1000).contains(&n), "{n}");
        let flag = Arc::new(AtomicBool::new(false));
        let f = flag.clone();
        let s = Stop::new(None, Some(Box::new(move || f.load(Relaxed))));
        s.check().unwrap();
        flag.store(true, Relaxed);
        assert_eq!(s.check(), Err(ComputeError::Cancelled));
        let s = Stop::new(Some(Duration::ZERO), None);
        assert_eq!(s.clone().check(), Err(ComputeError::Timeout(0)));
    }
}
