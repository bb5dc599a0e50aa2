//! Fair sharing of the offload engine between tenants and their controllers.
//!
//! - [`FairQueue`]: commands waiting to start, round robin across controllers (a key per
//!   controller). A started command has a thread of its own; at most
//!   `limits::COMPUTE_STARTED_MAX` exist, `limits::COMPUTE_STARTED_PER_CONTROLLER_MAX` per
//!   controller, so one controller's backlog leaves room for others' commands; a tenant's
//!   started commands hold at most its `offload_memory` (crate::offload).
//! - [`Cpu`]: turns to compute, `compute.threads` of them, given to the waiting tenant
//!   with the least weighted virtual runtime ([`Vclock`], FusionFS's CFS-style scheduler),
//!   and within a tenant round robin across its controllers. The virtual runtime is the
//!   CPU time the target measured on the command's thread (its thread CPU clock around
//!   each turn, not a cost the host declared) divided by the tenant's `compute_weight`. A
//!   command holds a turn while it computes and, once it has had
//!   `limits::COMPUTE_SLICE_MS`, hands it at its next check (between chunks, and inside a
//!   record every `STOP_CHECK_WORK` units of work) to a waiting tenant that is not ahead
//!   of its own: a long command cannot starve a short one. A tenant that was idle joins
//!   with a bounded credit (`limits::COMPUTE_SLEEPER_CREDIT_MS`), and a command hands its
//!   turn before its slice is over to a waiting tenant at least
//!   `limits::COMPUTE_WAKEUP_GRANULARITY_MS` behind its own (CFS's sleeper credit and
//!   wakeup preemption): a light tenant's short command runs through at once.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::limits;
use crate::tenant::{TenantId, TenantPolicy};

/// Weighted virtual runtime per tenant (CFS): a tenant's CPU time in nanoseconds, scaled
/// by `TENANT_WEIGHT_DEFAULT / compute_weight`. Pure: the tests drive it with synthetic
/// costs, the [`Cpu`] with measured ones.
#[derive(Default)]
pub struct Vclock {
    tenants: HashMap<TenantId, Clock>,
    /// The least virtual runtime of the active tenants, never decreasing: where a tenant
    /// that becomes active starts.
    floor: u128,
}

#[derive(Default)]
struct Clock {
    vruntime: u128,
    /// Its commands started and not finished.
    active: usize,
}

impl Vclock {
    /// A command of tenant `t` starts. A tenant that had none joins at the floor less
    /// the sleeper credit at least (`limits::COMPUTE_SLEEPER_CREDIT_MS`): what it was idle
    /// for earns it no more than that against the others.
    pub fn join(&mut self, t: TenantId) {
        let start = Self::credited(self.floor());
        let c = self.tenants.entry(t).or_default();
        if c.active == 0 {
            c.vruntime = c.vruntime.max(start);
        }
        c.active += 1;
    }

    /// A command of tenant `t` finished.
    pub fn leave(&mut self, t: TenantId) {
        let floor = self.floor();
        if let Some(c) = self.tenants.get_mut(&t) {
            c.active = c.active.saturating_sub(1);
        }
        self.floor = floor;
        // Idle tenants that would join with the whole credit anyway are forgotten: the map
        // stays as small as the set of tenants with commands or a debt to keep.
        let start = Self::credited(floor);
        self.tenants.retain(|_, c| c.active > 0 || c.vruntime > start);
    }

    /// Where a tenant that was idle joins, at the least: `floor` less the sleeper credit.
    fn credited(floor: u128) -> u128 {
        floor.saturating_sub(u128::from(limits::COMPUTE_SLEEPER_CREDIT_MS) * 1_000_000)
    }

    /// Charges `cpu_ns` of CPU time to tenant `t` of weight `weight`.
    pub fn charge(&mut self, t: TenantId, weight: u32, cpu_ns: u64) {
        let c = self.tenants.entry(t).or_default();
        c.vruntime += cpu_ns as u128 * limits::TENANT_WEIGHT_DEFAULT as u128 / weight.max(1) as u128;
        self.floor = self.floor();
    }

    pub fn vruntime(&self, t: TenantId) -> u128 {
        self.tenants.get(&t).map_or(self.floor, |c| c.vruntime)
    }

    /// The tenant of `candidates` with the least virtual runtime (the first on a tie).
    pub fn pick(&self, candidates: impl IntoIterator<Item = TenantId>) -> Option<TenantId> {
        candidates.into_iter().min_by_key(|t| self.vruntime(*t))
    }

    fn floor(&self) -> u128 {
        self.tenants.values().filter(|c| c.active > 0).map(|c| c.vruntime).min().unwrap_or(self.floor).max(self.floor)
    }
}

/// This thread's CPU time in nanoseconds (CLOCK_THREAD_CPUTIME_ID).
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime fills the one timespec it is given.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

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

    /// The next item of the first key, in turn, that `eligible` accepts with its next
    /// item; that key goes to the back of the order if it has more.
    pub fn pop_if(&mut self, mut eligible: impl FnMut(usize, &T) -> bool) -> Option<(usize, T)> {
        let items = &self.items;
        let at = self.order.iter().position(|&k| items.get(&k).and_then(|q| q.front()).is_some_and(|t| eligible(k, t)))?;
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

/// Turns to compute, handed to the tenant with the least weighted virtual runtime, and
/// within a tenant round robin across controllers.
pub struct Cpu {
    state: Mutex<CpuState>,
    wake: Condvar,
    /// How long a command computes before it hands its turn to any tenant not ahead of its
    /// own (`limits::COMPUTE_SLICE_MS`; tests make it long).
    slice: Duration,
}

struct CpuState {
    free: usize,
    next_id: u64,
    /// Waiting commands by tenant, each tenant's round robin across its controllers.
    waiting: HashMap<TenantId, FairQueue<u64>>,
    clock: Vclock,
    /// Turns handed to a waiter that has not yet woken to take it.
    granted: Vec<u64>,
}

impl CpuState {
    fn waiters(&self) -> usize {
        self.waiting.values().map(FairQueue::len).sum()
    }

    /// The waiting tenant with the least virtual runtime.
    fn next_tenant(&self) -> Option<TenantId> {
        // Sorted first: a tie goes to the same tenant whatever the map's order.
        let mut ids: Vec<TenantId> = self.waiting.keys().copied().collect();
        ids.sort_unstable();
        self.clock.pick(ids)
    }
}

impl Cpu {
    pub fn new(turns: usize) -> Arc<Cpu> {
        Self::with_slice(turns, Duration::from_millis(limits::COMPUTE_SLICE_MS))
    }

    fn with_slice(turns: usize, slice: Duration) -> Arc<Cpu> {
        Arc::new(Cpu {
            state: Mutex::new(CpuState {
                free: turns.max(1),
                next_id: 0,
                waiting: HashMap::new(),
                clock: Vclock::default(),
                granted: Vec::new(),
            }),
            wake: Condvar::new(),
            slice,
        })
    }

    /// A command's handle on the turns, for controller `key` of `tenant`; it holds none yet,
    /// and its tenant is active for the virtual clock only while it holds or waits for one
    /// (a command that gave its turn back, translating a volume's extents, waiting for a
    /// peer it forwarded to or for a read, does not hold the floor back).
    pub fn turn(self: &Arc<Self>, key: usize, tenant: Arc<TenantPolicy>) -> Turn {
        let mut s = self.state.lock();
        s.next_id += 1;
        Turn { cpu: self.clone(), key, tenant, id: s.next_id, held: Mutex::new(None) }
    }

    /// Commands waiting for a turn.
    pub fn waiting(&self) -> usize {
        self.state.lock().waiters()
    }

    /// A tenant's virtual runtime now.
    pub fn vruntime(&self, t: TenantId) -> u128 {
        self.state.lock().clock.vruntime(t)
    }

    /// Charges `t` CPU time it did not spend here (tests: a tenant ahead of the others).
    #[cfg(test)]
    pub(crate) fn charge(&self, t: TenantId, weight: u32, cpu_ns: u64) {
        self.state.lock().clock.charge(t, weight, cpu_ns);
    }

    fn give_back(&self) {
        let mut s = self.state.lock();
        let next = s.next_tenant().and_then(|t| {
            let q = s.waiting.get_mut(&t)?;
            let id = q.pop_if(|_, _| true).map(|(_, id)| id);
            if q.is_empty() {
                s.waiting.remove(&t);
            }
            id
        });
        match next {
            Some(id) => {
                s.granted.push(id);
                self.wake.notify_all();
            }
            None => s.free += 1,
        }
    }
}

/// Whether a command hands its turn at a check to the waiting tenant of least virtual
/// runtime `next` (None: no one waits), its own tenant's being `own`: after its slice to one
/// not ahead of it, within it to one at least the wakeup granularity behind.
fn hands_on(sliced: bool, next: Option<u128>, own: u128) -> bool {
    let granularity = if sliced { 0 } else { u128::from(limits::COMPUTE_WAKEUP_GRANULARITY_MS) * 1_000_000 };
    next.is_some_and(|v| v + granularity <= own)
}

/// One command's share of the [`Cpu`].
pub struct Turn {
    cpu: Arc<Cpu>,
    key: usize,
    tenant: Arc<TenantPolicy>,
    id: u64,
    /// While it holds a turn: since when, and its thread's CPU time when last charged.
    held: Mutex<Option<(Instant, u64)>>,
}

impl Turn {
    /// Waits for a turn; false if `stopped` says the command stops first. Called on the
    /// command's thread, whose CPU time the turn charges to its tenant.
    pub fn take(&self, stopped: &dyn Fn() -> bool) -> bool {
        let mut s = self.cpu.state.lock();
        s.clock.join(self.tenant.id);
        if s.free > 0 && s.waiting.is_empty() {
            s.free -= 1;
        } else {
            let waited = Instant::now();
            s.waiting.entry(self.tenant.id).or_default().push(self.key, self.id);
            self.tenant.stats.compute_turn_waits.fetch_add(1, Relaxed);
            loop {
                if let Some(at) = s.granted.iter().position(|&g| g == self.id) {
                    s.granted.swap_remove(at);
                    break;
                }
                if stopped() {
                    let (id, t) = (self.id, self.tenant.id);
                    if let Some(q) = s.waiting.get_mut(&t) {
                        q.retain(|&w| w != id, |_| {});
                        if q.is_empty() {
                            s.waiting.remove(&t);
                        }
                    }
                    s.clock.leave(t);
                    return false;
                }
                self.cpu.wake.wait_for(&mut s, Duration::from_millis(20));
            }
            self.tenant.stats.compute_queued_ns.fetch_add(waited.elapsed().as_nanos() as u64, Relaxed);
        }
        *self.held.lock() = Some((Instant::now(), thread_cpu_ns()));
        true
    }

    /// Charges the CPU time this thread used since the last charge to the tenant.
    fn charge(&self) {
        let mut held = self.held.lock();
        let Some((_, mark)) = held.as_mut() else { return };
        let now = thread_cpu_ns();
        let used = now.saturating_sub(*mark);
        *mark = now;
        drop(held);
        self.tenant.stats.compute_cpu_ns.fetch_add(used, Relaxed);
        self.cpu.state.lock().clock.charge(self.tenant.id, self.tenant.compute_weight, used);
    }

    /// At a check: charges the CPU time used; once the command has had its slice, hands
    /// the turn to a waiting command whose tenant is not ahead of its own in virtual
    /// runtime, and before that to one at least `limits::COMPUTE_WAKEUP_GRANULARITY_MS`
    /// behind it; then waits for the next turn. False if the command stops meanwhile.
    pub fn checkpoint(&self, stopped: &dyn Fn() -> bool) -> bool {
        let since = self.held.lock().map(|(since, _)| since);
        let Some(since) = since else { return self.take(stopped) };
        let sliced = since.elapsed() >= self.cpu.slice;
        // Within the slice the CPU clock is read only when someone waits (a system call).
        if !sliced && self.cpu.state.lock().waiting.is_empty() {
            return true;
        }
        self.charge();
        let yield_to_other = {
            let s = self.cpu.state.lock();
            let next = s.next_tenant().map(|t| s.clock.vruntime(t));
            hands_on(sliced, next, s.clock.vruntime(self.tenant.id))
        };
        if !yield_to_other && !sliced {
            return true;
        }
        if !yield_to_other {
            // Its slice starts again: the next check after another slice looks again.
            if let Some((since, _)) = self.held.lock().as_mut() {
                *since = Instant::now();
            }
            return true;
        }
        self.give_back();
        self.take(stopped)
    }

    /// Gives the turn back, if it holds one, charging the CPU time used; its tenant is no
    /// longer active for it until it takes one again.
    pub fn give_back(&self) {
        self.charge();
        if self.held.lock().take().is_some() {
            self.cpu.state.lock().clock.leave(self.tenant.id);
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
    use std::sync::atomic::Ordering::SeqCst;

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
            let got: Vec<u32> = std::iter::from_fn(|| q.pop_if(|_, _| true).map(|(_, v)| v)).collect();
            assert_eq!(got, want, "pushed {pushed:?}");
            assert!(q.is_empty());
        }
        // A key that is not eligible keeps its place while the others go.
        let mut q = FairQueue::default();
        q.push(1, 10);
        q.push(2, 20);
        assert_eq!(q.pop_if(|k, _| k != 1), Some((2, 20)));
        assert_eq!(q.pop_if(|_, _| true), Some((1, 10)));
        // Dropped items leave the queue and its count.
        q.push(1, 1);
        q.push(1, 2);
        q.push(2, 3);
        let mut gone = Vec::new();
        q.retain(|&v| v != 2 && v != 3, |v| gone.push(v));
        gone.sort();
        assert_eq!((q.len(), gone), (1, vec![2, 3]));
        assert_eq!(q.pop_if(|_, _| true), Some((1, 1)));
    }

    fn tenant(id: u32, compute_weight: u32) -> Arc<TenantPolicy> {
        Arc::new(TenantPolicy::unrestricted(TenantId(id), &format!("t{id}"), 100, compute_weight))
    }

    /// Two tenants always runnable, each chunk of work costing a synthetic CPU time (the
    /// heavier tenant's chunks cost more, so that fairness is in time, not in chunks): the
    /// scheduler picks by weighted virtual runtime, and each tenant's CPU time comes
    /// within 5% of its weight's share. Each line: both weights, both chunk costs in
    /// microseconds.
    #[test]
    fn vruntime_shares_cpu_time_by_weight() {
        let cases: &[(u32, u32, u64, u64)] = &[
            (100, 100, 1000, 1000),
            (100, 100, 5000, 300),
            (200, 100, 1000, 1000),
            (200, 100, 700, 4000),
            (1, 3, 2000, 900),
            (10000, 1, 10, 10),
        ];
        for &(wa, wb, ca, cb) in cases {
            let (a, b) = (TenantId(10), TenantId(11));
            let mut clock = Vclock::default();
            clock.join(a);
            clock.join(b);
            let mut used = [0u64; 2];
            for _ in 0..20_000 {
                match clock.pick([a, b]) {
                    Some(t) if t == a => {
                        clock.charge(a, wa, ca * 1000);
                        used[0] += ca;
                    }
                    _ => {
                        clock.charge(b, wb, cb * 1000);
                        used[1] += cb;
                    }
                }
            }
            let share = used[0] as f64 / (used[0] + used[1]) as f64;
            let want = wa as f64 / (wa + wb) as f64;
            assert!((share - want).abs() <= 0.05 * want, "weights {wa}:{wb}, costs {ca}:{cb} us: share {share:.4}, want {want:.4}");
        }
    }

    const CREDIT: u128 = limits::COMPUTE_SLEEPER_CREDIT_MS as u128 * 1_000_000;

    /// Spins on this thread for `ns` of its CPU time.
    fn compute_for(ns: u64) {
        let start = thread_cpu_ns();
        while thread_cpu_ns() - start < ns {
            std::hint::black_box(0u64);
        }
    }

    /// `turn` takes a turn, computes for `ns` of CPU time, is charged for it (its turn
    /// given back) and holds a turn again.
    fn take_charged(turn: &Turn, ns: u64) {
        assert!(turn.take(&|| false));
        compute_for(ns);
        turn.give_back();
        assert!(turn.take(&|| false));
    }

    /// A tenant that was idle joins at the least virtual runtime of the active ones less
    /// the sleeper credit, never more: the time it did not compute buys it no more than
    /// the credit against the others, however long.
    #[test]
    fn an_idle_tenant_joins_with_a_bounded_credit() {
        let (a, b) = (TenantId(10), TenantId(11));
        let mut clock = Vclock::default();
        clock.join(a);
        clock.charge(a, 100, 1_000_000_000);
        clock.join(b);
        assert_eq!(clock.vruntime(b), clock.vruntime(a) - CREDIT, "b starts the credit behind a");
        // b runs its credit and a little more: it is behind a no longer.
        clock.charge(b, 100, CREDIT as u64 + 1_000);
        assert_eq!(clock.pick([a, b]), Some(a));
        // a leaves and comes back much later: it starts the credit behind b, not at its
        // own old time.
        clock.leave(a);
        clock.charge(b, 100, 5_000_000_000);
        clock.join(a);
        assert_eq!(clock.vruntime(a), clock.vruntime(b) - CREDIT);
        // A tenant ahead of the floor keeps its debt when it comes back.
        clock.charge(a, 100, 2 * CREDIT as u64);
        clock.leave(a);
        let owed = clock.vruntime(a);
        clock.join(a);
        assert_eq!(clock.vruntime(a), owed);
    }

    /// A tenant that sends one command at a time, back to back (idle for no time between
    /// them, so joining each time), gets no more than its weight's share beside a tenant
    /// that always computes: the credit is not won again on every command. With idle tenants
    /// forgotten at the floor rather than at the floor less the credit, each command won it
    /// again: a share of 0.9999 in the first case.
    #[test]
    fn a_tenant_joining_on_every_command_gets_its_share_only() {
        for &(command_us, chunk_us) in &[(500u64, 1000u64), (2000, 1000), (200, 5000), (5000, 300)] {
            let (a, b) = (TenantId(10), TenantId(11));
            let mut clock = Vclock::default();
            clock.join(a);
            clock.join(b);
            let (mut used, mut left) = ([0u64; 2], command_us);
            for _ in 0..20_000 {
                if clock.pick([a, b]) == Some(a) {
                    clock.charge(a, 100, chunk_us * 1000);
                    used[0] += chunk_us;
                    continue;
                }
                let run = left.min(chunk_us);
                clock.charge(b, 100, run * 1000);
                used[1] += run;
                left -= run;
                if left == 0 {
                    clock.leave(b);
                    clock.join(b);
                    left = command_us;
                }
            }
            let share = used[1] as f64 / (used[0] + used[1]) as f64;
            let what = format!("commands of {command_us} us beside chunks of {chunk_us} us: share {share:.4}");
            assert!(share <= 0.525, "{what}");
            // Behind by more than the credit when the other's chunk ends, it loses the
            // rest at its next join, as an idle tenant would: only chunks within the
            // credit leave it its whole share.
            if u128::from(chunk_us) * 1000 <= CREDIT {
                assert!(share >= 0.475, "{what}");
            }
        }
    }

    /// With one turn, a command that holds it hands it to a waiter of another tenant
    /// that is behind in virtual runtime; a tenant ahead does not take it.
    #[test]
    fn a_turn_goes_to_the_tenant_behind() {
        let cpu = Cpu::new(1);
        let (heavy, light) = (tenant(20, 100), tenant(21, 100));
        let long = cpu.turn(1, heavy.clone());
        assert!(long.take(&|| false));
        // It computes for two slices' worth of CPU time: its tenant is ahead.
        compute_for(2 * limits::COMPUTE_SLICE_MS * 1_000_000);
        let short = cpu.turn(2, light.clone());
        let t = std::thread::spawn(move || short.take(&|| false));
        while cpu.waiting() == 0 {
            std::thread::yield_now();
        }
        // At its next check (on its own thread, whose CPU time it charges), past its
        // slice, the light tenant's command gets the turn, and gives it back when done.
        assert!(long.checkpoint(&|| false), "the long command gets its turn back once the short one is done");
        assert!(t.join().unwrap());
        assert_eq!(light.stats.compute_turn_waits.load(Relaxed), 1);
        assert!(heavy.stats.compute_cpu_ns.load(Relaxed) >= 2 * limits::COMPUTE_SLICE_MS * 1_000_000);
        assert!(cpu.vruntime(heavy.id) > cpu.vruntime(light.id));
        drop(long);
        // A waiter that is stopped gives up.
        let a = cpu.turn(3, light.clone());
        assert!(a.take(&|| false));
        assert!(!cpu.turn(4, heavy).take(&|| true));
        assert_eq!(cpu.waiting(), 0);
    }

    /// Within its slice a command hands its turn only to a tenant more than the wakeup
    /// granularity behind its own; after it, to any not ahead.
    #[test]
    fn a_command_hands_its_turn_within_the_slice_only_to_a_tenant_well_behind() {
        let g = u128::from(limits::COMPUTE_WAKEUP_GRANULARITY_MS) * 1_000_000;
        let own = 10 * g;
        let cases = [
            (false, None, false),
            (false, Some(own), false),
            (false, Some(own - g + 1), false),
            (false, Some(own - g), true),
            (false, Some(own - CREDIT), true),
            (true, None, false),
            (true, Some(own + 1), false),
            (true, Some(own), true),
            (true, Some(own - 1), true),
        ];
        for (sliced, next, want) in cases {
            assert_eq!(hands_on(sliced, next, own), want, "sliced {sliced}, next {next:?}, own {own}");
        }
    }

    /// With one turn and a slice longer than the test, a command hands its turn at its next
    /// check only to a waiter of a tenant that joined with its credit, not to another of
    /// its own tenant, and gets it back once that one is done.
    #[test]
    fn a_tenant_with_credit_takes_the_turn_within_the_slice() {
        let cpu = Cpu::with_slice(1, Duration::from_secs(3600));
        let (heavy, light) = (tenant(30, 100), tenant(31, 100));
        let long = cpu.turn(1, heavy.clone());
        // It computes past the credit and the granularity, and is charged for it.
        take_charged(&long, 2 * CREDIT as u64);
        // Another command of its own tenant waits: level with it, it does not preempt.
        let same = cpu.turn(2, heavy.clone());
        let other = std::thread::spawn(move || {
            assert!(same.take(&|| false));
            drop(same);
        });
        while cpu.waiting() == 0 {
            std::thread::yield_now();
        }
        assert!(long.checkpoint(&|| false));
        assert_eq!(cpu.waiting(), 1, "kept within the slice");
        // The light tenant waits, the credit behind: the next check hands it the turn.
        let short = cpu.turn(3, light.clone());
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = std::thread::spawn({
            let ran = ran.clone();
            move || {
                assert!(short.take(&|| false));
                ran.store(true, SeqCst);
            }
        });
        while cpu.waiting() < 2 {
            std::thread::yield_now();
        }
        assert_eq!(cpu.vruntime(light.id) + CREDIT, cpu.vruntime(heavy.id), "the light tenant joined the credit behind");
        let handed = std::thread::spawn(move || {
            let got_back = long.checkpoint(&|| false);
            (got_back, ran.load(SeqCst), long)
        });
        let (got_back, light_ran, long) = handed.join().unwrap();
        // Dropped before anything is asserted: a failed hand-off fails, it does not hang.
        drop(long);
        s.join().unwrap();
        other.join().unwrap();
        assert!(got_back && light_ran, "the light command ran before the check returned");
        assert_eq!(light.stats.compute_turn_waits.load(Relaxed), 1);
    }

    /// A command that gave its turn back (translating a volume's extents, waiting for a
    /// peer it forwarded to) does not keep its tenant active: the floor follows the tenants that compute,
    /// and a tenant joining meanwhile gets no more than the credit below them.
    #[test]
    fn a_command_without_a_turn_does_not_hold_the_floor_back() {
        let cpu = Cpu::new(1);
        let (idle, busy, late) = (tenant(40, 100), tenant(41, 100), tenant(42, 100));
        let waiting = cpu.turn(1, idle.clone());
        assert!(waiting.take(&|| false));
        waiting.give_back();
        let computing = cpu.turn(2, busy.clone());
        take_charged(&computing, 3 * CREDIT as u64);
        let joined = cpu.turn(3, late.clone());
        let t = std::thread::spawn(move || {
            assert!(joined.take(&|| false));
            joined
        });
        while cpu.waiting() == 0 {
            std::thread::yield_now();
        }
        assert_eq!(cpu.vruntime(late.id) + CREDIT, cpu.vruntime(busy.id), "joined the credit below the one computing");
        drop(computing);
        drop(t.join().unwrap());
        drop(waiting);
    }

    /// With one turn, a command that holds it hands it to a waiter after its slice.
    #[test]
    fn a_turn_goes_to_a_waiter_after_the_slice() {
        let cpu = Cpu::new(1);
        let long = cpu.turn(1, tenant(2, 100));
        assert!(long.take(&|| false));
        let short = cpu.turn(2, tenant(2, 100));
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
        let a = cpu.turn(3, tenant(2, 100));
        assert!(a.take(&|| false));
        assert!(!cpu.turn(4, tenant(2, 100)).take(&|| true));
        assert_eq!(cpu.waiting(), 0);
    }
}
