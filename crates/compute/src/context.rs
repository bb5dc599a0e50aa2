//! What an operation may use besides its inputs: a memory bound it charges before it
//! allocates, and a [`Stop`] it looks at while it works.
//!
//! The engine that runs an operation (the target's offload engine, the host's local
//! path) builds one [`Context`] per command:
//! - `memory_max`: the command's own bound, in bytes;
//! - `budget`: optionally a [`Budget`] shared by many commands (a target-wide total):
//!   every byte a command charges to its [`Account`] is charged to the budget too, and
//!   given back when the account is dropped, so the sum over running commands stays
//!   under the budget's limit;
//! - `stop`: cancellation and a deadline. Operations call [`Stop::check`] between chunks
//!   and, through a [`Meter`], at least every [`STOP_CHECK_WORK`] units of work inside one
//!   record, so a command stops within that much work of being cancelled.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::ComputeError;

/// Work between two looks at a [`Stop`], in units of about one byte or one character
/// processed: 1 MiB of work takes well under 10 ms on any machine we run on, so a
/// command notices cancellation or its deadline within that, while the check itself
/// (an atomic load, a clock read) costs nothing measurable.
pub const STOP_CHECK_WORK: u64 = 1 << 20;

/// What an operation may use besides its inputs. Built per command by the engine that
/// runs it; cheap to clone (the stop and the budget are shared).
#[derive(Clone, Debug)]
pub struct Context {
    /// Memory the operation may hold at once (a sort's records, a select's groups, rows
    /// to order, intermediate strings of its expressions), in bytes: charged to an
    /// [`Account`] before it is allocated. Chunks read from the inputs are counted by the
    /// engine, not here.
    pub memory_max: usize,
    /// Memory shared with other commands: charged as well as `memory_max` (None: no
    /// shared total).
    pub budget: Option<Arc<Budget>>,
    /// Cancellation and deadline of the command.
    pub stop: Stop,
}

impl Default for Context {
    fn default() -> Self {
        Context { memory_max: 256 << 20, budget: None, stop: Stop::default() }
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

/// Memory shared by many commands (the target's compute memory): every command's
/// [`Account`] charges it too. Thread-safe.
#[derive(Debug)]
pub struct Budget {
    limit: usize,
    used: AtomicUsize,
    /// The most ever used at once.
    peak: AtomicUsize,
}

impl Budget {
    pub fn new(limit: usize) -> Budget {
        Budget { limit, used: AtomicUsize::new(0), peak: AtomicUsize::new(0) }
    }
    pub fn limit(&self) -> usize {
        self.limit
    }
    /// Bytes charged now by all accounts.
    pub fn used(&self) -> usize {
        self.used.load(Relaxed)
    }
    /// The most charged at once since the budget was made.
    pub fn peak(&self) -> usize {
        self.peak.load(Relaxed)
    }

    fn try_charge(&self, bytes: usize) -> bool {
        let mut cur = self.used.load(Relaxed);
        loop {
            let Some(next) = cur.checked_add(bytes).filter(|n| *n <= self.limit) else { return false };
            match self.used.compare_exchange_weak(cur, next, Relaxed, Relaxed) {
                Ok(_) => {
                    self.peak.fetch_max(next, Relaxed);
                    return true;
                }
                Err(now) => cur = now,
            }
        }
    }

    fn release(&self, bytes: usize) {
        self.used.fetch_sub(bytes, Relaxed);
    }
}

/// The memory one command holds, charged before it is allocated: against the command's
/// bound and the shared budget, if any. Dropping the account gives its bytes back to the
/// budget.
#[derive(Debug)]
pub struct Account {
    op: &'static str,
    limit: usize,
    used: usize,
    budget: Option<Arc<Budget>>,
}

impl Account {
    pub fn new(op: &'static str, ctx: &Context) -> Account {
        Account { op, limit: ctx.memory_max, used: 0, budget: ctx.budget.clone() }
    }

    /// Charges `bytes` before they are allocated; refused with [`ComputeError::Memory`]
    /// naming `what` (called only on refusal) when the command's bound or the shared
    /// budget would be exceeded. Nothing is charged on refusal.
    pub fn charge(&mut self, bytes: usize, what: impl FnOnce() -> String) -> Result<(), ComputeError> {
        let next = self.used.checked_add(bytes).filter(|n| *n <= self.limit);
        let Some(next) = next else {
            return Err(ComputeError::Memory { op: self.op, limit: self.limit, what: what() });
        };
        if let Some(b) = &self.budget {
            if !b.try_charge(bytes) {
                return Err(ComputeError::Memory {
                    op: self.op,
                    limit: self.limit,
                    what: format!("{}; the memory shared by all commands ({} bytes) is in use", what(), b.limit()),
                });
            }
        }
        self.used = next;
        Ok(())
    }

    /// Gives back bytes charged before (freed, or handed on).
    pub fn release(&mut self, bytes: usize) {
        let bytes = bytes.min(self.used);
        self.used -= bytes;
        if let Some(b) = &self.budget {
            b.release(bytes);
        }
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

impl Drop for Account {
    fn drop(&mut self) {
        if let Some(b) = &self.budget {
            b.release(self.used);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accounts_refuse_before_the_bound_and_share_the_budget() {
        let budget = Arc::new(Budget::new(1000));
        let ctx = Context { memory_max: 600, budget: Some(budget.clone()), stop: Stop::default() };
        let (mut a, mut b) = (Account::new("t", &ctx), Account::new("t", &ctx));
        a.charge(600, || "a".into()).unwrap();
        let e = a.charge(1, || "one more byte".into()).unwrap_err();
        assert_eq!(e, ComputeError::Memory { op: "t", limit: 600, what: "one more byte".into() });
        // b's own bound has room, the shared budget has only 400.
        let e = b.charge(500, || "b's rows".into()).unwrap_err().to_string();
        assert!(e.contains("b's rows") && e.contains("shared by all commands (1000 bytes)"), "{e}");
        assert_eq!((a.used(), b.used(), budget.used()), (600, 0, 600));
        a.release(100);
        b.charge(500, || "b".into()).unwrap();
        assert_eq!(budget.used(), 1000);
        drop(a);
        drop(b);
        assert_eq!((budget.used(), budget.peak()), (0, 1000));
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
        assert!(n >= STOP_CHECK_WORK && n <= STOP_CHECK_WORK + 1000, "{n}");
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
