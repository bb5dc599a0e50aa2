//! The control plane arbiter's grants, enforced where an exporting target reaches a pool
//! (docs/fair-io.md, "The arbiter").
//!
//! A volume's operations reach pools of this target and of its peers through their pool
//! devices (`volume::PoolDevices`); with arbitration on, each pool device is wrapped in a
//! [`Gated`] device of that pool's [`Gate`]. The gate counts, per tenant, the cost bytes its
//! operations offered (a written byte costs the pool's `write_cost`) and whether one had to
//! wait; every period the arbitration task (`nearstore target --control`) sends them to the
//! arbiter ([`Gates::take`]) and applies the grants that come back ([`Gates::apply`]). A
//! grant is a token bucket: a rate, and a batch the tenant may let go at once; an operation
//! that the bucket does not hold waits on its own queue's channel until it does, as the fair
//! scheduler's do.
//!
//! Without a grant nothing waits here: a tenant new on a pool (until its first grant), a
//! pool that declares no bandwidth, a grant past its time-to-live (the arbiter stopped
//! answering: the target falls back to the local fair sharing of each pool's own
//! scheduler), the target's own work (zeroing new extents, moves: untagged channels).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::Duration;

use nearstore_transport::AlignedBuf;
use parking_lot::Mutex;
use tokio::time::Instant;

use super::fair::Turn;
use super::{BlockDevice, Channel, Geometry, Op};
use crate::limits;

const NS_PER_S: i128 = 1_000_000_000;

/// What one tenant offered one pool in the last period: a demand of the next request.
#[derive(Debug, Clone, PartialEq)]
pub struct Offered {
    pub pool_target: String,
    pub nsid: u32,
    pub tenant: String,
    pub weight: u32,
    /// Cost bytes per second over the period.
    pub bps: u64,
    /// Some of its operations waited for their grant.
    pub backlogged: bool,
}

/// A grant the arbiter gave one tenant on one pool.
#[derive(Debug, Clone, PartialEq)]
pub struct GrantIn {
    pub pool_target: String,
    pub nsid: u32,
    pub tenant: String,
    /// Cost bytes per second; None: the pool is not divided.
    pub bps: Option<u64>,
    pub batch_bytes: u64,
    pub write_cost: f64,
    /// All the pool's grants together (every exporter's tenants), bytes per second: on the
    /// pool's own target, what the peers have is this less its own tenants' grants.
    pub pool_bps: u64,
}

/// What every other exporter's tenants were granted on one of this target's pools (the
/// arbiter's reply, `peers`): the weight of that exporter's operations in the pool's
/// scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerIn {
    pub nsid: u32,
    /// The exporter's cluster NQN, as its connections to the pool name it.
    pub member: String,
    pub bps: u64,
    /// All the pool's grants together.
    pub pool_bps: u64,
}

/// The weights a pool's scheduler gives while the arbiter divides the pool: each of this
/// target's tenants its grant there, each peer exporter its tenants' grants there together,
/// a peer the reply did not name what the pool's grants leave after those.
#[derive(Debug, Default, Clone)]
struct PoolWeights {
    by_tenant: HashMap<Arc<str>, u64>,
    by_member: HashMap<Arc<str>, u64>,
    peers: u64,
}

/// A grant in bytes per second as a scheduler's weight (KiB per second, at least 1).
fn weight_of(bps: u64) -> u32 {
    (bps >> 10).clamp(1, u32::MAX as u64) as u32
}

/// The arbitration's counters (the metrics endpoint's `nearstore_arbiter_*`).
#[derive(Debug, Default)]
pub struct GateStats {
    /// Requests sent to the arbiter, and those that failed (no answer, or an error).
    pub requests: AtomicU64,
    pub failures: AtomicU64,
    /// Grants holding now (set at each answer and each expiry).
    pub grants: AtomicU64,
    /// Grants that ran out before a new one came: their tenants fell back to local sharing.
    pub expired: AtomicU64,
    /// Operations a grant held back, and for how long in all (nanoseconds).
    pub held: AtomicU64,
    pub held_ns: AtomicU64,
}

#[derive(Debug, Clone, Copy)]
struct Grant {
    /// Cost bytes per second.
    rate: u64,
    /// Most the bucket holds, in billionths of a byte: a batch beyond one largest transfer.
    cap: i128,
    write_milli: u64,
    /// Ns on the gates' clock when it runs out.
    until: u64,
    /// A new tenant's until an answer names it.
    provisional: bool,
}

#[derive(Debug)]
struct Client {
    weight: u32,
    /// Cost bytes offered since the last request (first offers only).
    offered: u64,
    waited: bool,
    /// Until when (ns) an operation it was told to wait for is due again: while one is,
    /// it waits at this gate, whether or not it was offered in the last period.
    waiting_until: u64,
    grant: Option<Grant>,
    /// The bucket, in billionths of a byte, and when it was last refilled (ns).
    tokens: i128,
    at: u64,
    /// Requests in a row it offered nothing in.
    quiet: u32,
    /// An answer named it (with a grant or without: not divided, or no room in the books):
    /// it is no longer new on the pool.
    answered: bool,
}

impl Client {
    /// A tenant new on a pool: nothing offered, no grant.
    fn new(weight: u32, now: u64) -> Client {
        Client { weight, offered: 0, waited: false, waiting_until: 0, grant: None, tokens: 0, at: now, quiet: 0, answered: false }
    }
}

/// One pool's gate: its tenants' buckets.
#[derive(Default)]
pub struct Gate {
    clients: Mutex<HashMap<Arc<str>, Client>>,
}

/// The gates of every pool this target's volumes reach.
pub struct Gates {
    pools: Mutex<HashMap<(String, u32), Arc<Gate>>>,
    /// Each pool's gated device, made once: operations waiting in a channel come back to it
    /// however the volumes' caches drop and take their mappings.
    devices: Mutex<HashMap<(String, u32), Arc<dyn BlockDevice>>>,
    /// The gates' clock starts here (the runtime's clock).
    start: Instant,
    /// When [`Gates::take`] last ran, ns.
    last_take: Mutex<u64>,
    /// Until when (ns) the arbiter's last answer holds: while it does, this target's pools
    /// share by the grants ([`Gates::arbitrated`], [`Gates::pool_weight`]).
    answered_until: AtomicU64,
    /// This target's address as the control plane knows it: its own pools' gates are
    /// `(own, nsid)`.
    own: std::sync::OnceLock<String>,
    /// Its own pools' weights by namespace, set at each answer.
    weights: Mutex<HashMap<u32, PoolWeights>>,
    pub stats: GateStats,
}

impl Gates {
    pub fn new() -> Arc<Gates> {
        Arc::new(Gates {
            pools: Mutex::new(HashMap::new()),
            devices: Mutex::new(HashMap::new()),
            start: Instant::now(),
            last_take: Mutex::new(0),
            answered_until: AtomicU64::new(0),
            own: std::sync::OnceLock::new(),
            weights: Mutex::new(HashMap::new()),
            stats: GateStats::default(),
        })
    }

    fn now(&self) -> u64 {
        Instant::now().saturating_duration_since(self.start).as_nanos() as u64
    }

    fn gate(&self, pool_target: &str, nsid: u32) -> Arc<Gate> {
        self.pools.lock().entry((pool_target.to_string(), nsid)).or_default().clone()
    }

    /// `base`, the device of pool `nsid` of `pool_target`, behind that pool's gate; the
    /// device made at the first call for that pool (`base` then is the pool's device).
    pub fn device(self: &Arc<Gates>, pool_target: &str, nsid: u32, base: Arc<dyn BlockDevice>) -> Arc<dyn BlockDevice> {
        let mut devices = self.devices.lock();
        if let Some(d) = devices.get(&(pool_target.to_string(), nsid)) {
            return d.clone();
        }
        let gate = self.gate(pool_target, nsid);
        let gates = self.clone();
        let d: Arc<dyn BlockDevice> =
            Arc::new_cyclic(|me: &Weak<Gated>| Gated { base, gate, gates, again: Arc::new(super::Again(me.clone())) });
        devices.insert((pool_target.to_string(), nsid), d.clone());
        d
    }

    /// What each tenant offered each pool since the last call: the demands of the next
    /// request. Tenants quiet for `GRANT_QUIET_REQUESTS` requests in a row whose grant ran
    /// out are forgotten.
    pub fn take(&self) -> Vec<Offered> {
        let now = self.now();
        let since = std::mem::replace(&mut *self.last_take.lock(), now);
        let ns = now.saturating_sub(since).max(1) as u128;
        let mut out = Vec::new();
        let pools = self.pools.lock();
        for ((target, nsid), gate) in pools.iter() {
            let mut clients = gate.clients.lock();
            clients.retain(|tenant, c| {
                let offered = std::mem::take(&mut c.offered);
                // Backlogged: it had to wait in the period, or an operation of it still
                // waits (told to come back later than the period: a small grant's wait for
                // a large write; counted as idle, its grant shrank period after period and
                // its waits grew, the arbiter simulation's seed 345).
                let waited = std::mem::take(&mut c.waited) || c.waiting_until > now;
                if offered == 0 && !waited {
                    c.quiet += 1;
                    if c.quiet >= limits::GRANT_QUIET_REQUESTS {
                        return c.grant.is_some_and(|g| g.until > now);
                    }
                    // Quiet for a period or two, it is asked for all the same: its commands
                    // may all be waiting downstream, in the pool's queue, where a tenant that
                    // left the books would be weighed as nobody.
                } else {
                    c.quiet = 0;
                }
                let bps = (offered as u128 * NS_PER_S as u128 / ns).min(u64::MAX as u128) as u64;
                out.push(Offered {
                    pool_target: target.clone(),
                    nsid: *nsid,
                    tenant: tenant.to_string(),
                    weight: c.weight,
                    bps,
                    backlogged: waited,
                });
                true
            });
        }
        // In one order whatever the maps' (a simulation's run replays from its seed).
        out.sort_by(|a, b| (&a.pool_target, a.nsid, &a.tenant).cmp(&(&b.pool_target, b.nsid, &b.tenant)));
        out
    }

    /// Takes the arbiter's answer to the demands `asked` (what [`take`](Self::take)
    /// returned), `ttl` after which its grants run out. A tenant asked for and given no
    /// grant (the arbiter's books were full) keeps to local sharing.
    /// `peers`: what each other exporter was granted on this target's own pools.
    pub fn apply(&self, asked: &[Offered], grants: &[GrantIn], peers: &[PeerIn], ttl: Duration) {
        let now = self.now();
        let until = now.saturating_add(ttl.as_nanos().min(u64::MAX as u128) as u64);
        // The pools stop leaving the sharing to the grants a fifth of the TTL before the
        // grants run out: when the arbiter dies, the exporters' gates open a little after
        // their pools' own scheduler has taken over, not before (else the peers' operations
        // flood a pool that still serves them first come, first served).
        self.answered_until.store(now.saturating_add((ttl.as_nanos() * 4 / 5).min(u64::MAX as u128) as u64), Relaxed);
        let by: HashMap<(&str, u32, &str), &GrantIn> =
            grants.iter().map(|g| ((g.pool_target.as_str(), g.nsid, g.tenant.as_str()), g)).collect();
        for d in asked {
            let gate = self.gate(&d.pool_target, d.nsid);
            let mut clients = gate.clients.lock();
            let Some(c) = clients.get_mut(d.tenant.as_str()) else { continue };
            c.answered = true;
            let g = by.get(&(d.pool_target.as_str(), d.nsid, d.tenant.as_str()));
            match g.and_then(|g| g.bps.map(|bps| (g, bps))) {
                Some((g, rate)) => {
                    let cap = (g.batch_bytes as i128 + limits::TRANSFER_BYTES_MAX as i128) * NS_PER_S;
                    let c_milli = if g.write_cost.is_finite() {
                        (g.write_cost.clamp(1.0, limits::FAIR_WRITE_COST_MAX) * 1000.0) as u64
                    } else {
                        1000
                    };
                    match c.grant {
                        // The grant it replaces pays for the time since the bucket was last
                        // filled (else a tenant whose operations wait at the gate between
                        // two answers loses what accrued meanwhile: the arbiter simulation
                        // saw 128 KiB readers move 55% of their grants).
                        Some(old) if old.until > now && !old.provisional => {
                            c.tokens = (c.tokens + (now - c.at.min(now)) as i128 * old.rate as i128).min(old.cap).min(cap);
                        }
                        // A new grant (or the first after a provisional one) starts with a
                        // full batch.
                        _ => c.tokens = cap,
                    }
                    c.at = now;
                    c.grant = Some(Grant { rate, cap, write_milli: c_milli, until, provisional: false });
                }
                None => c.grant = None,
            }
        }
        self.count_grants(now);
        self.weigh(grants, peers);
    }

    /// Sets the weights of this target's own pools from an answer's grants and peers.
    fn weigh(&self, grants: &[GrantIn], peers: &[PeerIn]) {
        let Some(own) = self.own.get() else { return };
        let mut weights: HashMap<u32, PoolWeights> = HashMap::new();
        let mut total: HashMap<u32, u64> = HashMap::new();
        for g in grants.iter().filter(|g| &g.pool_target == own) {
            if let Some(bps) = g.bps {
                weights.entry(g.nsid).or_default().by_tenant.insert(g.tenant.as_str().into(), bps);
                total.insert(g.nsid, g.pool_bps);
            }
        }
        for p in peers {
            *weights.entry(p.nsid).or_default().by_member.entry(p.member.as_str().into()).or_default() += p.bps;
            let t = total.entry(p.nsid).or_default();
            *t = (*t).max(p.pool_bps);
        }
        for (nsid, w) in weights.iter_mut() {
            let named: u64 = w.by_tenant.values().sum::<u64>() + w.by_member.values().sum::<u64>();
            // At least a new tenant's: a peer the reply did not name (new, or of an older
            // version) has its commands waiting in the pool's queue served, and its tenants,
            // offering again, get their grants back.
            w.peers = total.get(nsid).copied().unwrap_or(0).saturating_sub(named).max(limits::GRANT_PROVISIONAL_BPS);
        }
        *self.weights.lock() = weights;
    }

    /// This target's address as the control plane knows it (once; `nearstore target
    /// --control` sets it when it knows it).
    pub fn set_own(&self, addr: String) {
        let _ = self.own.set(addr);
    }

    /// The weight pool `nsid`'s scheduler gives `tenant` while the arbiter divides the pool:
    /// a tenant of this target its grant on the pool (a new one, until its grant comes,
    /// GRANT_PROVISIONAL_BPS; so does the target's own work), a peer exporter (its
    /// connections, keyed by its cluster NQN) its tenants' grants there together, a peer
    /// the arbiter did not name what the pool's grants leave. None: the arbiter does not
    /// answer, or named nothing on the pool: the tenants' own weights hold. So the pool's
    /// scheduler, which shares among its keys by weight and serves each key's operations by
    /// their bytes, shares as the arbiter divided: by its keys' own weights it would share
    /// 1:1 between each peer exporter and each of its own tenants.
    pub fn pool_weight(&self, nsid: u32, tenant: &super::fair::Tenant) -> Option<u32> {
        if !self.arbitrated() {
            return None;
        }
        let weights = self.weights.lock();
        let w = weights.get(&nsid)?;
        let bps = match &tenant.key {
            super::fair::Key::Peer(member) => w.by_member.get(member).copied().unwrap_or(w.peers),
            _ => w.by_tenant.get(&*tenant.name).copied().unwrap_or(limits::GRANT_PROVISIONAL_BPS),
        };
        Some(weight_of(bps))
    }

    /// The arbiter answered within (most of) its grants' time to live: the tenants of every
    /// exporter reaching this target's pools are held to their grants at their exporters'
    /// gates, and the pools share by the grants ([`pool_weight`](Self::pool_weight)).
    /// Past it, the pools' own sharing by the tenants' weights takes over.
    pub fn arbitrated(&self) -> bool {
        self.now() < self.answered_until.load(Relaxed)
    }

    /// Grants holding at `now`.
    fn count_grants(&self, now: u64) {
        let n: usize = self
            .pools
            .lock()
            .values()
            .map(|g| g.clients.lock().values().filter(|c| c.grant.is_some_and(|g| g.until > now && !g.provisional)).count())
            .sum();
        self.stats.grants.store(n as u64, Relaxed);
    }

    /// The grant of `tenant` on a pool, as (bytes per second, time left): for tests.
    pub fn grant_of(&self, pool_target: &str, nsid: u32, tenant: &str) -> Option<(u64, Duration)> {
        let now = self.now();
        let gate = self.pools.lock().get(&(pool_target.to_string(), nsid))?.clone();
        let clients = gate.clients.lock();
        let g = clients.get(tenant)?.grant?;
        (g.until > now).then(|| (g.rate, Duration::from_nanos(g.until - now)))
    }

    /// What the gate of pool `nsid` of `pool_target` decides for an operation of `tenant`
    /// (`again`: one that waited, offered again): None, it goes; else how long it waits.
    /// The decision [`Gated`] makes, for a simulation that drives the gates without
    /// channels (crates/sim, `arbiter.rs`).
    pub fn admit(
        &self,
        pool_target: &str,
        nsid: u32,
        tenant: &Arc<str>,
        weight: u32,
        len: u64,
        write: bool,
        again: bool,
    ) -> Option<Duration> {
        let gate = self.gate(pool_target, nsid);
        match self.offer(&gate, tenant, weight, len, write, again) {
            Turn::Go => None,
            Turn::Wait(at) => Some(Duration::from_nanos(at.saturating_sub(self.now()))),
        }
    }

    /// Decides whether an operation of `tenant` (its weight `weight`) costing `len` bytes
    /// read or written goes through `gate` now; `again`: one that waited, offered again.
    fn offer(&self, gate: &Gate, tenant: &Arc<str>, weight: u32, len: u64, write: bool, again: bool) -> Turn {
        let now = self.now();
        let mut clients = gate.clients.lock();
        if !clients.contains_key(tenant) {
            if clients.len() >= limits::FAIR_TENANTS_MAX {
                // Beyond the tracked tenants: not counted, not held (local sharing).
                return Turn::Go;
            }
            clients.insert(tenant.clone(), Client::new(weight, now));
        }
        let c = clients.get_mut(tenant).expect("inserted");
        c.weight = weight;
        let milli = c.grant.map_or(1000, |g| g.write_milli);
        let cost = if write { len.saturating_mul(milli) / 1000 } else { len };
        if !again {
            c.offered = c.offered.saturating_add(cost);
        }
        let g = match c.grant {
            Some(g) => g,
            // New on the pool while the arbiter answers: until an answer names it (the
            // next, a period away) it moves a transfer at once and GRANT_PROVISIONAL_BPS,
            // not all it can queue: a host starting with 32 commands in flight would fill
            // the pool's queue ahead of every tenant held to its grant, and that queue
            // drains only as fast as the grants leave room (the arbiter simulation's
            // tenants, each 16 commands of 128 KiB, took seconds to drain one).
            None if !c.answered && self.arbitrated() => {
                let g = Grant {
                    rate: limits::GRANT_PROVISIONAL_BPS,
                    cap: limits::TRANSFER_BYTES_MAX as i128 * NS_PER_S,
                    write_milli: 1000,
                    until: self.answered_until.load(Relaxed),
                    provisional: true,
                };
                c.grant = Some(g);
                c.tokens = g.cap;
                c.at = now;
                g
            }
            None => return Turn::Go,
        };
        if g.until <= now {
            c.grant = None;
            drop(clients);
            self.stats.expired.fetch_add(1, Relaxed);
            self.count_grants(now);
            return Turn::Go;
        }
        c.tokens = (c.tokens + (now - c.at.min(now)) as i128 * g.rate as i128).min(g.cap);
        c.at = now;
        // An operation larger than the bucket goes when it is full.
        let want = (cost as i128 * NS_PER_S).min(g.cap);
        if c.tokens >= want {
            c.tokens -= cost as i128 * NS_PER_S;
            return Turn::Go;
        }
        c.waited = true;
        let at = if g.rate == 0 { g.until } else { now + ((want - c.tokens) / g.rate as i128) as u64 + 1 };
        let at = at.min(g.until);
        c.waiting_until = c.waiting_until.max(at);
        self.stats.held.fetch_add(1, Relaxed);
        self.stats.held_ns.fetch_add(at - now, Relaxed);
        Turn::Wait(at)
    }
}

/// A pool's device behind its gate.
pub struct Gated {
    base: Arc<dyn BlockDevice>,
    gate: Arc<Gate>,
    gates: Arc<Gates>,
    /// Where a waiting operation is offered again (holds this device weakly).
    again: Arc<dyn BlockDevice>,
}

impl Gated {
    fn offer(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64, again: bool) {
        let write = match op {
            Op::Read { .. } => false,
            Op::Write { .. } => true,
            _ => return self.base.submit(ch, op, buf, tag),
        };
        let turn = match ch.tenant() {
            // The target's own work, and a tenant with no name: not arbitrated.
            None => Turn::Go,
            Some(t) if t.name.is_empty() => Turn::Go,
            Some(t) => self.gates.offer(&self.gate, &t.name, t.weight, buf.len() as u64, write, again),
        };
        match turn {
            Turn::Go => self.base.submit(ch, op, buf, tag),
            Turn::Wait(at) => {
                let at = self.gates.start + Duration::from_nanos(at);
                ch.defer(at, self.again.clone(), op, buf, tag);
            }
        }
    }
}

impl BlockDevice for Gated {
    fn describe(&self) -> String {
        format!("{} behind the arbiter's grants", self.base.describe())
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

    // read_now, write_now, lend and read_blocking stay None: every read and write is
    // offered to the gate.
}

impl super::Reoffer for Gated {
    const GONE: &'static str = "arbiter gate";

    fn reoffer(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64) {
        self.offer(ch, op, buf, tag, true)
    }
}

#[cfg(test)]
mod tests;
