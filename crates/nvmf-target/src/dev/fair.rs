//! Fair I/O: a device that shares the bandwidth of the device below among tenants by
//! weighted deficit round robin (Flint's arbiter, seed 003; docs/fair-io.md).
//!
//! Two things decide when a read or write goes. **The budget**: bytes refill at the
//! configured bandwidth as time passes (at most an epoch's worth,
//! [`limits::FAIR_EPOCH_US`], beyond one largest transfer), so the device below is never
//! offered more than it serves and its own queue, which serves in arrival order, stays
//! short. **The rounds**: each tenant holds a deficit; an operation goes only when its
//! tenant's deficit holds its cost. When a tenant's deficit is spent and no other tenant
//! with operations waiting still holds a turn in this round, a new round starts and every
//! tenant gets its quantum: the largest operation of the tenants tracked (at least an
//! epoch's budget) times its weight over the smallest weight tracked.
//! So each waiting tenant moves at least one operation a round, rounds stay as short as
//! the operations allow, and an operation that arrives larger than the quantum (an offload
//! chunk) goes after enough rounds, its deficit carried from one to the next. Shares
//! follow the weights per round, whatever order the waiting operations are offered again
//! in and however late their timers fire; a tenant alone starts its rounds back to back
//! (work conserving). Deficits are capped at a quantum beyond the tenant's largest
//! operation, so a tenant that does not wait cannot hoard turns.
//!
//! A tenant with no operation waiting may borrow up to an epoch's bytes from the next
//! (its deficit still bounds it): a light tenant's read beside heavy ones goes at once.
//! An operation that may not go waits on its own queue's channel until the next epoch and
//! is offered again. Without contention nothing waits: the cost is a lock and a little
//! arithmetic per read or write (docs/fair-io.md). Waiting operations are commands of their
//! queues, holding their own slots and buffers ([`limits::FAIR_WAITING_PER_QUEUE_MAX`]):
//! nothing here grows with what a host sends.

use std::io;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};

use nearstore_transport::AlignedBuf;
use parking_lot::Mutex;
use tokio::time::Instant;

use super::{BlockDevice, Channel, Geometry, Op};
use crate::limits;
use crate::tenant::{TenantId, TenantPolicy, TenantStats};

const EPOCH_NS: u64 = limits::FAIR_EPOCH_US * 1000;
const NS_PER_S: i128 = 1_000_000_000;

/// Whose share an operation is charged to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Key {
    /// A configured tenant (`[[tenant]]`, or the built-in `cluster`).
    Tenant(TenantId),
    /// Without tenants (every host in the built-in `default`): each host on its own.
    Host(Arc<str>),
    /// A peer exporter on this target's pool (the built-in `cluster` tenant), by its
    /// cluster NQN: each exporter's volume traffic on its own, weighed by its tenants'
    /// grants while the arbiter answers (`Gates::pool_weight`), else at `cluster`'s weight.
    Peer(Arc<str>),
    /// The target's own work: a volume's split operations, the offload engine's reads.
    Target,
    /// The tenants beyond [`limits::FAIR_TENANTS_MAX`], together.
    Others,
}

/// Who an operation is for, and its weight: set at Connect on a queue's channel
/// ([`Channel::set_tenant`]), and on the channels that work for its commands (a volume's
/// slow path, the offload engine's reads).
#[derive(Debug, Clone)]
pub struct Tenant {
    pub key: Key,
    /// How the control plane's arbiter knows it (`dev::grant`): the tenant's name, or
    /// `host:NQN` for a host of the built-in `default`.
    pub name: Arc<str>,
    /// Checked by the configuration: 1 to [`limits::TENANT_WEIGHT_MAX`].
    pub weight: u32,
    /// Its tenant's counters: what the scheduler let go for it and how long it held it back.
    pub stats: Arc<TenantStats>,
}

impl PartialEq for Tenant {
    fn eq(&self, o: &Tenant) -> bool {
        (&self.key, self.weight) == (&o.key, o.weight)
    }
}

impl Eq for Tenant {}

impl Tenant {
    /// The share of a controller of `host` (the host it serves) in `policy`: the tenant's
    /// `io_weight`, each host apart in the built-in `default`.
    pub fn of(policy: &TenantPolicy, host: &str) -> Tenant {
        let (key, name) = if policy.id == TenantId::DEFAULT {
            (Key::Host(host.into()), format!("host:{host}").into())
        } else if policy.id == TenantId::CLUSTER {
            (Key::Peer(host.into()), format!("peer:{host}").into())
        } else {
            (Key::Tenant(policy.id), policy.name.as_str().into())
        };
        Tenant { key, name, weight: policy.io_weight.clamp(1, limits::TENANT_WEIGHT_MAX), stats: policy.stats.clone() }
    }
}

/// What [`Drr::offer`] decides for one operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turn {
    Go,
    /// Offer it again at this time (ns on the scheduler's clock): the next epoch.
    Wait(u64),
}

struct Flow {
    key: Key,
    weight: u32,
    /// Bytes it may still move in this round.
    deficit: i64,
    /// The last epoch it offered an operation in.
    seen: u64,
    /// The last epoch one of its operations had to wait in.
    waited: Option<u64>,
    /// Its operations waiting to be offered again.
    waiting: u32,
    /// Its largest operation's cost: what it needs to hold a turn.
    need: i64,
}

impl Flow {
    /// Its operations wait to be offered again. Their timers may fire several epochs late on
    /// a loaded machine; operations never offered again (their connection closed) stop
    /// counting after [`limits::FAIR_IDLE_EPOCHS`].
    fn backlogged(&self, epoch: u64) -> bool {
        self.waiting > 0 && self.waited.is_some_and(|w| w + limits::FAIR_IDLE_EPOCHS >= epoch)
    }
}

/// The scheduler, pure: time is passed in, so tests drive it epoch by epoch.
pub struct Drr {
    /// Bytes per second.
    bandwidth: u64,
    /// Cost of a written byte, in thousandths.
    write_milli: u64,
    /// Budget left, in billionths of a byte (bandwidth × ns); negative after an operation
    /// larger than the cap went, or one borrowed from the next epoch.
    left: i128,
    /// Most the budget holds: an epoch's bytes beyond one largest transfer.
    cap: i128,
    /// When the budget was last refilled, ns.
    at: u64,
    epoch: u64,
    flows: Vec<Flow>,
}

impl Drr {
    /// `bandwidth` in bytes per second, `write_cost` a written byte against a read one
    /// (both checked by the configuration, clamped here).
    pub fn new(bandwidth: u64, write_cost: f64) -> Drr {
        let bw = bandwidth.clamp(limits::FAIR_BANDWIDTH_MIN, limits::FAIR_BANDWIDTH_MAX);
        let c = if write_cost.is_finite() { write_cost.clamp(1.0, limits::FAIR_WRITE_COST_MAX) } else { 1.0 };
        // An epoch's bytes beyond the largest transfer's cost (a written one costs
        // write_cost times its bytes): every read and write fits in a full budget, and one
        // that waited goes as soon as the budget is not spent. A cap below a written
        // transfer's cost (as it was, one transfer's bytes) left such a write to go only
        // when the budget was full, which under contention it never is (crates/sim's
        // arbiter simulation: 128 KiB writes at write cost 2 moved nothing).
        let cap = bw as i128 * EPOCH_NS as i128 + (limits::TRANSFER_BYTES_MAX as f64 * c) as i128 * NS_PER_S;
        Drr { bandwidth: bw, write_milli: (c * 1000.0) as u64, left: cap, cap, at: 0, epoch: 0, flows: Vec::new() }
    }

    /// Bytes per epoch.
    pub fn budget(&self) -> u64 {
        (self.bandwidth as u128 * EPOCH_NS as u128 / NS_PER_S as u128) as u64
    }

    /// What `op` of `len` bytes costs, in bytes; None for operations not scheduled (flush,
    /// write zeroes, deallocate: no data moves between host and device).
    pub fn cost(&self, op: &Op, len: usize) -> Option<u64> {
        match op {
            Op::Read { .. } => Some(len as u64),
            Op::Write { .. } => Some(len as u64 * self.write_milli / 1000),
            _ => None,
        }
    }

    /// Decides whether an operation of `tenant` costing `cost` bytes goes at `now_ns`;
    /// `again`: it is one that waited, offered again.
    pub fn offer(&mut self, now_ns: u64, tenant: &Tenant, cost: u64, again: bool) -> Turn {
        self.offer_as(now_ns, tenant, tenant.weight, cost, again)
    }

    /// [`offer`](Self::offer) with `tenant` at `weight` instead of its own (a pool's
    /// tenants weighed by the arbiter's grants, `Gates::pool_weight`).
    pub fn offer_as(&mut self, now_ns: u64, tenant: &Tenant, weight: u32, cost: u64, again: bool) -> Turn {
        self.decide(now_ns, tenant, weight, cost, again, true)
    }

    /// [`offer_as`](Self::offer_as), or with `counts` false an operation that may not go is
    /// not counted as waiting (its caller offers it next, which counts it).
    fn decide(&mut self, now_ns: u64, tenant: &Tenant, weight: u32, cost: u64, again: bool, counts: bool) -> Turn {
        self.refill(now_ns);
        let epoch = self.epoch;
        let i = self.flow(tenant, weight);
        let cost = cost.min(i64::MAX as u64 >> 2) as i64;
        let f = &mut self.flows[i];
        f.seen = epoch;
        // The catch-all share keeps its own weight, whoever overflowed into it last.
        let reweighted = f.key != Key::Others && f.weight != weight;
        if reweighted {
            f.weight = weight;
        }
        if again {
            f.waiting = f.waiting.saturating_sub(1);
        }
        f.need = f.need.max(cost);
        if reweighted {
            // A lighter weight takes effect now: the turns a heavier one gathered go (on a
            // pool whose arbiter stopped answering, a tenant's grant gives way to its weight).
            let (unit, least) = self.unit();
            let f = &mut self.flows[i];
            f.deficit = f.deficit.min(Drr::quantum(unit, f.weight, least) + f.need);
        }
        let f = &mut self.flows[i];
        if f.deficit < cost {
            // Its turn in this round is spent: a new round, unless a tenant with operations
            // waiting still holds a turn in this one.
            let holding = self.flows.iter().enumerate().any(|(j, f)| j != i && f.backlogged(epoch) && f.deficit >= f.need);
            if holding {
                return if counts { self.wait(i) } else { Turn::Wait(0) };
            }
            self.new_rounds(i, cost);
        }
        // The budget holds it (an operation larger than all the budget may hold goes when it
        // is full). A tenant with nothing waiting may borrow up to an epoch's bytes from the
        // next: a light tenant's read goes at once within its share, and the waiting
        // tenants' next epoch pays for it. An operation that waited (and that the budget
        // can hold) goes as soon as the budget is not spent, borrowing the rest from the
        // epochs after: else a large one never finds the budget holding all of it while the
        // small operations of its tenant (or of the others sharing its key, a peer's
        // `cluster`) take each epoch's bytes as they come (crates/sim's arbiter simulation
        // found a 64 KiB read that waited for ever behind 16 KiB ones).
        let want = cost as i128 * NS_PER_S;
        let floor = if self.flows[i].backlogged(epoch) { 0 } else { -(self.bandwidth as i128 * EPOCH_NS as i128) };
        let need = if again && want <= self.cap { 1 } else { want.min(self.cap) };
        if self.left - need < floor {
            return if counts { self.wait(i) } else { Turn::Wait(0) };
        }
        self.left -= want;
        self.flows[i].deficit -= cost;
        Turn::Go
    }

    fn wait(&mut self, i: usize) -> Turn {
        self.flows[i].waited = Some(self.epoch);
        self.flows[i].waiting = self.flows[i].waiting.saturating_add(1);
        Turn::Wait((self.epoch + 1) * EPOCH_NS)
    }

    /// Tenants tracked.
    pub fn tenants(&self) -> usize {
        self.flows.len()
    }

    /// The quantum of a flow of `weight`: `unit` times its weight over the smallest weight
    /// tracked, `least`.
    fn quantum(unit: i64, weight: u32, least: u32) -> i64 {
        (unit as i128 * weight as i128 / least.max(1) as i128) as i64
    }

    /// The quantum at the smallest weight: the largest operation of a flow tracked (so that
    /// every flow waiting moves at least one each round), at least an epoch's budget (a
    /// tenant that waits for the next round waits for its next epoch: shorter rounds would
    /// leave the budget unused) and [`limits::FAIR_QUANTUM_MIN_BYTES`].
    fn unit(&self) -> (i64, u32) {
        let least = (self.budget() as i64).max(limits::FAIR_QUANTUM_MIN_BYTES as i64);
        let unit = self.flows.iter().map(|f| f.need).max().unwrap_or(0).max(least);
        (unit, self.flows.iter().map(|f| f.weight).min().unwrap_or(1))
    }

    /// Starts as many rounds as flow `i` needs to hold `cost`: every flow gets a quantum a
    /// round, its deficit capped at a quantum beyond its largest operation.
    fn new_rounds(&mut self, i: usize, cost: i64) {
        let (unit, least) = self.unit();
        let qi = Drr::quantum(unit, self.flows[i].weight, least);
        let lack = cost - self.flows[i].deficit;
        let rounds = ((lack + qi - 1) / qi).max(1);
        for f in &mut self.flows {
            let q = Drr::quantum(unit, f.weight, least);
            f.deficit = f.deficit.saturating_add(q.saturating_mul(rounds)).min(q + f.need);
        }
    }

    /// Refills the budget for the time passed since the last offer; at a new epoch,
    /// forgets flows that neither offered nor waited for [`limits::FAIR_IDLE_EPOCHS`].
    fn refill(&mut self, now: u64) {
        if now > self.at {
            self.left = (self.left + (now - self.at) as i128 * self.bandwidth as i128).min(self.cap);
            self.at = now;
        }
        let e = now / EPOCH_NS;
        if e > self.epoch {
            self.epoch = e;
            self.flows.retain(|f| f.seen + limits::FAIR_IDLE_EPOCHS >= e || f.backlogged(e));
        }
    }

    /// The index of `t`'s flow (at `weight`), made with a fresh quantum when new.
    fn flow(&mut self, t: &Tenant, weight: u32) -> usize {
        if let Some(i) = self.flows.iter().position(|f| f.key == t.key) {
            return i;
        }
        let (key, weight) = if self.flows.len() + 1 >= limits::FAIR_TENANTS_MAX {
            if let Some(i) = self.flows.iter().position(|f| f.key == Key::Others) {
                return i;
            }
            (Key::Others, limits::TENANT_WEIGHT_DEFAULT)
        } else {
            (t.key.clone(), weight)
        };
        let (unit, least) = self.unit();
        let deficit = Drr::quantum(unit, weight, least.min(weight));
        self.flows.push(Flow { key, weight, deficit, seen: self.epoch, waited: None, waiting: 0, need: 0 });
        self.flows.len() - 1
    }
}

/// The fair-scheduled device over `base`.
pub struct Fair {
    base: Arc<dyn BlockDevice>,
    drr: Mutex<Drr>,
    /// The scheduler's clock starts here (the runtime's clock: simulated time in crates/sim).
    start: Instant,
    /// Where a waiting operation is offered again (holds this device weakly).
    again: Arc<dyn BlockDevice>,
    untagged: Tenant,
    /// A pool's: the target's gates and the pool's namespace, whose grants weigh its
    /// tenants while the control plane's arbiter divides the pool
    /// ([`Gates::pool_weight`](super::grant::Gates::pool_weight)).
    arbiter: Option<(Arc<super::grant::Gates>, u32)>,
}

impl Fair {
    pub fn new(base: Arc<dyn BlockDevice>, bandwidth: u64, write_cost: f64) -> Arc<Fair> {
        Fair::with(base, bandwidth, write_cost, None)
    }

    /// Pool `nsid`'s scheduler: while `gates` say the arbiter divides the pool, each tenant
    /// weighs its grant there, the peers (`cluster`) what the grants leave
    /// ([`Gates::pool_weight`](super::grant::Gates::pool_weight)).
    pub fn arbitrated(
        base: Arc<dyn BlockDevice>,
        bandwidth: u64,
        write_cost: f64,
        gates: Arc<super::grant::Gates>,
        nsid: u32,
    ) -> Arc<Fair> {
        Fair::with(base, bandwidth, write_cost, Some((gates, nsid)))
    }

    fn with(base: Arc<dyn BlockDevice>, bandwidth: u64, write_cost: f64, arbiter: Option<(Arc<super::grant::Gates>, u32)>) -> Arc<Fair> {
        Arc::new_cyclic(|me: &Weak<Fair>| Fair {
            base,
            drr: Mutex::new(Drr::new(bandwidth, write_cost)),
            start: Instant::now(),
            again: Arc::new(super::Again(me.clone())),
            untagged: Tenant { key: Key::Target, name: "".into(), weight: limits::TENANT_WEIGHT_DEFAULT, stats: Arc::default() },
            arbiter,
        })
    }

    /// The scheduler's decision on `op` of `len` bytes of `who` (None: the target's own),
    /// charged to it when it goes. `counts`: one that may not go is counted as waiting (an
    /// offer); else it is only given back (a lend or write at once, which its caller then
    /// offers).
    fn decide(&self, op: &Op, len: usize, who: Option<&Tenant>, again: bool, counts: bool) -> Turn {
        let mut d = self.drr.lock();
        let Some(cost) = d.cost(op, len) else { return Turn::Go };
        let now = Instant::now().saturating_duration_since(self.start).as_nanos() as u64;
        let tenant = who.unwrap_or(&self.untagged);
        let weight = self.arbiter.as_ref().and_then(|(g, nsid)| g.pool_weight(*nsid, tenant)).unwrap_or(tenant.weight);
        let turn = d.decide(now, tenant, weight, cost, again, counts);
        match turn {
            Turn::Go => {
                tenant.stats.io_scheduled_bytes.fetch_add(len as u64, Relaxed);
            }
            // Held back until the epoch it is offered again in (its timer may fire later on a
            // loaded machine).
            Turn::Wait(at) if counts => {
                tenant.stats.io_waits.fetch_add(1, Relaxed);
                tenant.stats.io_queued_ns.fetch_add(at.saturating_sub(now), Relaxed);
            }
            Turn::Wait(_) => {}
        }
        turn
    }

    /// Whether `op` goes at once (charged when it does): [`decide`](Self::decide) without
    /// counting a wait.
    fn go_now(&self, op: &Op, len: usize, who: Option<&Tenant>) -> bool {
        matches!(self.decide(op, len, who, false, false), Turn::Go)
    }

    /// Offers `op` to the scheduler (`again`: it waited before) and submits it below or
    /// makes it wait on `ch` for the next epoch.
    fn offer(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64, again: bool) {
        let turn = self.decide(&op, buf.len(), ch.tenant(), again, true);
        match turn {
            Turn::Go => self.base.submit(ch, op, buf, tag),
            Turn::Wait(at) => {
                let at = self.start + std::time::Duration::from_nanos(at);
                ch.defer(at, self.again.clone(), op, buf, tag);
            }
        }
    }
}

impl BlockDevice for Fair {
    fn describe(&self) -> String {
        let d = self.drr.lock();
        format!("{} fair-scheduled at {} bytes per {} us epoch", self.base.describe(), d.budget(), limits::FAIR_EPOCH_US)
    }

    fn geometry(&self) -> Geometry {
        self.base.geometry()
    }

    fn quiesce(&self, off: u64, len: u64) -> Option<super::Quiesce> {
        self.base.quiesce(off, len)
    }

    fn submit(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64) {
        self.offer(ch, op, buf, tag, false)
    }

    /// A read of a device that lends its memory (a memory namespace) goes at once, without a
    /// copy, when the scheduler lets it go at once (charged then); else None, and the caller
    /// submits it, to wait for its turn. read_now stays None: the offload engine's reads,
    /// which have no tenant at hand here, go through `submit`.
    fn lend(&self, off: u64, len: usize, who: Option<&Tenant>) -> Option<io::Result<()>> {
        if !self.base.completes_now() || !self.go_now(&Op::Read { off }, len, who) {
            return None;
        }
        self.base.lend(off, len, who)
    }

    fn read_lent(&self, off: u64, len: usize, f: &mut dyn FnMut(&[&[u8]])) -> io::Result<()> {
        self.base.read_lent(off, len, f)
    }

    /// [`lend`](Self::lend)'s way for a write.
    fn write_now(&self, data: &[u8], off: u64, fua: bool, who: Option<&Tenant>) -> Option<io::Result<()>> {
        if !self.base.completes_now() || !self.go_now(&Op::Write { off, fua }, data.len(), who) {
            return None;
        }
        self.base.write_now(data, off, fua, who)
    }
}

impl super::Reoffer for Fair {
    const GONE: &'static str = "fair scheduler";

    fn reoffer(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64) {
        self.offer(ch, op, buf, tag, true)
    }
}

#[cfg(test)]
mod tests;
