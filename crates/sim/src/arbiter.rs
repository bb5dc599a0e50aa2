//! The arbiter and the gates under faults, against a model (docs/simulation.md, "The
//! arbiter"). The real parts: the control plane's `arbiter::Arbiter` (its books, its
//! division), each exporting target's `dev::grant::Gates` (its buckets, what it offers and
//! applies, its grants running out), and the pool's own scheduler `dev::fair::Drr`, where
//! the pool's target sees its own tenants by name and each peer exporter's operations as
//! one key (its cluster NQN, in the built-in `cluster` tenant). Around them, one thread and the paused clock: closed-loop clients of
//! each tenant on one or two exporters, always wanting more, each operation 1 ms in the
//! pool once the scheduler lets it go; every exporter asks the arbiter every period.
//!
//! The seed chooses the pool's bandwidth and write cost, the exporters, the tenants (their
//! weights, sizes, reads or writes, exporters) and how many requests and answers are lost.
//! Three phases: the arbiter answers; it stops answering; it comes back with empty books
//! while one peer exporter dies with its clients. The model checks, in a window at the end
//! of each phase, each tenant's share of what the pool moved: by the tenants' weights while
//! the arbiter answers (a tenant on two exporters one share); by the pool's own scheduler's
//! keys (local tenants by weight, each peer exporter at `cluster`'s) once the grants ran out, when no
//! grant may still hold. And throughout: every tenant with a live client moves something in every second,
//! and the pool moves about its bandwidth.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::Arc;
use std::time::Duration;

use nearstore_control::arbiter::{Arbiter, Capacity};
use nearstore_control::limits::{ARBITER_GRANT_TTL_MS, ARBITER_PERIOD_MS};
use nearstore_control::model::{BandwidthRequest, Demand};
use nearstore_target::dev::fair::{Drr, Key, Tenant, Turn};
use nearstore_target::dev::grant::{Gates, GrantIn, PeerIn};
use nearstore_target::tenant::{TenantId, TenantPolicy};
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;
use tokio::time::Instant;

use crate::trace::Trace;
use crate::{Failure, Which};

const POOL: &str = "t0";

/// Exporter `e`'s cluster NQN.
fn member(e: usize) -> String {
    format!("nqn.2026-11.io.nearstore:m{e}")
}
const NSID: u32 = 1;
const MS: u64 = 1_000_000;
/// How long an operation the pool's scheduler let go takes: 0.5 to 1.5 ms (not a whole
/// number of the scheduler's 1 ms epochs, which would lock completions to its turns).
const SERVICE: u64 = MS;
const SERVICE_JITTER: u64 = MS / 2;
/// When the clients start (ms).
const START_MS: u64 = 300;
/// The phases' ends and the windows checked (ms).
const DOWN_AT: u64 = 3000;
const BACK_AT: u64 = 5000;
const END: u64 = 8000;
const WINDOWS: [(u64, u64, Phase); 3] =
    [(1500, DOWN_AT, Phase::Up), (DOWN_AT + ARBITER_GRANT_TTL_MS + 300, BACK_AT, Phase::Down), (6500, END, Phase::Back)];
/// Liveness: every live client completes an operation in every bucket of this many ms
/// (a second: a share of a few MiB/s of 128 KiB operations, split among a key's clients
/// in whatever order they come back, is a handful of operations in a quarter of one).
const BUCKET_MS: u64 = 1000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Up,
    Down,
    Back,
}

/// A deliberately broken exporter, to show the model catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArbiterBug {
    /// Its demands say every tenant's weight is 100.
    IgnoreWeights,
    /// It keeps its grants for an hour, whatever the arbiter says.
    NeverExpire,
}

#[derive(Clone, Debug, Default)]
pub struct Options {
    pub bug: Option<ArbiterBug>,
    pub keep_trace: bool,
}

/// Shares of each of the pool scheduler's keys in the window the arbiter is down.
type KeyShares = BTreeMap<String, f64>;

#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub trace_hash: u64,
    pub events: u64,
    /// Operations the pool completed.
    pub ops: u64,
    /// Requests and answers lost on the way.
    pub lost: u64,
    /// Share windows checked, and the largest distance between a share and its model
    /// while the arbiter divides the pool.
    pub windows: u64,
    pub worst: f64,
    /// Grants that held an operation back.
    pub held: u64,
    pub trace: Vec<String>,
    /// The arbiter-down window's shares by key, and how far from the model's they may be
    /// for the size of the window's operations.
    down: KeyShares,
    down_slack: f64,
}

struct TenantSpec {
    name: Arc<str>,
    weight: u32,
    size: u64,
    write: bool,
}

struct Client {
    tenant: usize,
    exporter: usize,
    alive: bool,
    /// Cost bytes completed, per liveness bucket.
    buckets: Vec<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// A client's operation offered to its exporter's gate (`again`: it waited there).
    Gate {
        client: usize,
        again: bool,
    },
    /// Offered to the pool's scheduler (`again`: it waited for a turn there).
    Pool {
        client: usize,
        again: bool,
    },
    Done {
        client: usize,
    },
    Ask {
        exporter: usize,
    },
}

/// Runs `seed`; then, as the model of the window the arbiter is down, the same seed with an
/// arbiter that never answers: once the grants ran out, each key of the pool's scheduler
/// must have the share it has there, where nothing but the pool's own scheduler ever
/// divided the pool (a key's share within 0.05, give or take three of the largest
/// operations).
pub fn run(seed: u64, opts: &Options) -> Result<Stats, Failure> {
    let s = run_one(seed, opts, false)?;
    let reference = run_one(seed, &Options::default(), true)?;
    let mut report = Vec::new();
    let mut bad = None;
    for (key, share) in &s.down {
        let want = reference.down.get(key).copied().unwrap_or(0.0);
        report.push(format!("{key} {share:.3}/{want:.3}"));
        if (share - want).abs() > 0.05 + s.down_slack {
            bad = Some(key.clone());
        }
    }
    if let Some(key) = bad {
        let message = format!(
            "Down window: {key}'s share is not the one the pool's own scheduler gives without an arbiter (measured/that): {}",
            report.join(", ")
        );
        return Err(Failure {
            which: Which::Arbiter,
            seed,
            message,
            tail: s.trace.iter().rev().take(20).rev().cloned().collect(),
            trace: s.trace,
        });
    }
    Ok(s)
}

fn run_one(seed: u64, opts: &Options, reference: bool) -> Result<Stats, Failure> {
    crate::paused_runtime(Which::Arbiter, seed)?.block_on(async {
        let trace = Trace::new(opts.keep_trace);
        let r = Sim::new(seed, opts, trace.clone(), reference).run().await;
        match r {
            Ok(mut s) => {
                (s.trace_hash, s.events) = trace.digest();
                s.trace = trace.all();
                Ok(s)
            }
            Err(message) => Err(Failure { which: Which::Arbiter, seed, message, tail: trace.tail(), trace: trace.all() }),
        }
    })
}

struct Sim {
    /// The model's run: the arbiter never answers, nothing is checked.
    reference: bool,
    rng: XorShiftRng,
    bug: Option<ArbiterBug>,
    trace: Trace,
    start: Instant,
    bandwidth: u64,
    write_cost: f64,
    loss: f64,
    tenants: Vec<TenantSpec>,
    clients: Vec<Client>,
    exporters: usize,
    dead: Option<usize>,
    gates: Vec<Arc<Gates>>,
    arbiter: Arbiter,
    drr: Drr,
    /// The pool scheduler's view of each tenant: local by name, each peer exporter's
    /// operations as that exporter (by its cluster NQN, `m{e}`).
    local: Vec<Tenant>,
    peers: Vec<Tenant>,
    events: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    seq: u64,
    /// Cost bytes completed per client in each window.
    moved: Vec<[u64; 3]>,
    stats: Stats,
}

impl Sim {
    fn new(seed: u64, opts: &Options, trace: Trace, reference: bool) -> Sim {
        let mut rng = XorShiftRng::seed_from_u64(seed);
        let bandwidth = [16u64, 24, 32][rng.random_range(0..3)] << 20;
        let write_cost = [1.0, 2.0][rng.random_range(0..2)];
        let exporters = rng.random_range(2..=4);
        let loss = [0.0, 0.05, 0.1][rng.random_range(0..3)];
        let n = rng.random_range(2..=4);
        let mut tenants = Vec::new();
        for i in 0..n {
            // Two tenants of different weights always: a division that ignores them shows.
            let weight = match i {
                0 => 300,
                1 => 100,
                _ => [50, 100, 200, 400][rng.random_range(0..4)],
            };
            let size = [16u64, 64, 128][rng.random_range(0..3)] << 10;
            tenants.push(TenantSpec { name: format!("t{i}").into(), weight, size, write: rng.random_bool(0.3) });
        }
        let mut clients = Vec::new();
        for (t, _) in tenants.iter().enumerate() {
            let first = rng.random_range(0..exporters);
            clients.push(Client { tenant: t, exporter: first, alive: true, buckets: vec![0; (END / BUCKET_MS) as usize] });
            if rng.random_bool(0.4) {
                let second = (first + rng.random_range(1..exporters)) % exporters;
                clients.push(Client { tenant: t, exporter: second, alive: true, buckets: vec![0; (END / BUCKET_MS) as usize] });
            }
        }
        let local = tenants
            .iter()
            .map(|t| Tenant { key: Key::Host(t.name.to_string().into()), name: t.name.clone(), weight: t.weight, stats: Arc::default() })
            .collect();
        let cluster = TenantPolicy::unrestricted(TenantId::CLUSTER, "cluster", 100, 100);
        let peers = (0..exporters).map(|e| Tenant::of(&cluster, &member(e))).collect();
        let moved = vec![[0; 3]; clients.len()];
        Sim {
            reference,
            rng,
            bug: opts.bug,
            trace,
            start: Instant::now(),
            bandwidth,
            write_cost,
            loss,
            tenants,
            clients,
            exporters,
            dead: None,
            gates: (0..exporters)
                .map(|e| {
                    let g = Gates::new();
                    g.set_own(format!("t{e}"));
                    g
                })
                .collect(),
            arbiter: Arbiter::new(),
            drr: Drr::new(bandwidth, write_cost),
            local,
            peers,
            events: BinaryHeap::new(),
            seq: 0,
            moved,
            stats: Stats::default(),
        }
    }

    fn now(&self) -> u64 {
        Instant::now().duration_since(self.start).as_nanos() as u64
    }

    /// Schedules `ev` at `t`; events of one time run in an order the seed chooses, as a
    /// runtime's tasks woken together run in an order nobody chooses.
    fn at(&mut self, t: u64, ev: Ev) {
        self.seq = self.rng.random();
        self.events.push(Reverse((t, self.seq, ev)));
    }

    /// What one operation of tenant `t` costs the pool.
    fn cost(&self, t: usize) -> u64 {
        let s = &self.tenants[t];
        if s.write {
            (s.size as f64 * self.write_cost) as u64
        } else {
            s.size
        }
    }

    async fn run(mut self) -> Result<Stats, String> {
        let desc: Vec<String> = self
            .clients
            .iter()
            .map(|c| {
                let t = &self.tenants[c.tenant];
                format!("{}(w{} {}K {}) on e{}", t.name, t.weight, t.size >> 10, if t.write { "w" } else { "r" }, c.exporter)
            })
            .collect();
        self.trace.event(format_args!(
            "pool {} MiB/s write cost {}, {} exporters, loss {}: {}",
            self.bandwidth >> 20,
            self.write_cost,
            self.exporters,
            self.loss,
            desc.join(", ")
        ));
        for c in 0..self.clients.len() {
            // Each client keeps 16 operations in flight, and at least twice what the pool
            // moves in an operation's time: at the pool's bandwidth a queue forms, and a
            // client of a few operations in flight would fall short of its share by waiting
            // in it, whatever its grant.
            let size = self.tenants[self.clients[c].tenant].size;
            let slots = (2 * self.bandwidth * SERVICE / 1_000_000_000).div_ceil(size).max(16);
            // Hosts connect once the targets run: after the arbiter's first answers.
            for _ in 0..slots {
                self.at(START_MS * MS, Ev::Gate { client: c, again: false });
            }
        }
        for e in 0..self.exporters {
            let phase = self.rng.random_range(0..ARBITER_PERIOD_MS) * MS;
            self.at(phase, Ev::Ask { exporter: e });
        }
        let (mut down_checked, mut back) = (false, false);
        while let Some(Reverse((t, _, ev))) = self.events.pop() {
            if t >= END * MS {
                break;
            }
            if t > self.now() {
                tokio::time::sleep_until(self.start + Duration::from_nanos(t)).await;
            }
            if !self.reference && !down_checked && t >= (DOWN_AT + ARBITER_GRANT_TTL_MS + 2 * ARBITER_PERIOD_MS) * MS {
                down_checked = true;
                self.no_grant_holds()?;
            }
            if !back && t >= BACK_AT * MS {
                back = true;
                self.come_back();
            }
            self.step(t, ev);
        }
        for (from, to, phase) in WINDOWS {
            if !self.reference || phase == Phase::Down {
                self.check_window(from, to, phase)?;
            }
        }
        if !self.reference {
            self.check_liveness()?;
        }
        self.stats.held = self.gates.iter().map(|g| g.stats.held.load(std::sync::atomic::Ordering::Relaxed)).sum();
        Ok(self.stats)
    }

    fn step(&mut self, now: u64, ev: Ev) {
        match ev {
            Ev::Gate { client, again } => {
                let c = &self.clients[client];
                if !c.alive {
                    return;
                }
                let t = &self.tenants[c.tenant];
                let wait = self.gates[c.exporter].admit(POOL, NSID, &t.name, t.weight, t.size, t.write, again);
                match wait {
                    None => self.step(now, Ev::Pool { client, again: false }),
                    Some(d) => self.at(now + (d.as_nanos() as u64).max(1), Ev::Gate { client, again: true }),
                }
            }
            Ev::Pool { client, again } => {
                let c = &self.clients[client];
                // A dead exporter's connections closed: what it had waiting in the pool's
                // scheduler went with them.
                if !c.alive {
                    return;
                }
                // The pool's target is e0: while the arbiter answers it, its pool weighs its
                // keys by their grants (dev::grant::Gates::pool_weight), as dev::fair does.
                let who = if c.exporter == 0 { &self.local[c.tenant] } else { &self.peers[c.exporter] };
                let weight = self.gates[0].pool_weight(NSID, who).unwrap_or(who.weight);
                match self.drr.offer_as(now, who, weight, self.cost(c.tenant), again) {
                    Turn::Go => {
                        let took = SERVICE - SERVICE_JITTER + self.rng.random_range(0..2 * SERVICE_JITTER);
                        self.at(now + took, Ev::Done { client })
                    }
                    Turn::Wait(at) => self.at(at.max(now + 1), Ev::Pool { client, again: true }),
                }
            }
            Ev::Done { client } => {
                let cost = self.cost(self.clients[client].tenant);
                self.stats.ops += 1;
                let ms = now / MS;
                if let Some(b) = self.clients[client].buckets.get_mut((ms / BUCKET_MS) as usize) {
                    *b += cost;
                }
                for (w, (from, to, _)) in WINDOWS.iter().enumerate() {
                    if (*from..*to).contains(&ms) {
                        self.moved[client][w] += cost;
                    }
                }
                self.step(now, Ev::Gate { client, again: false });
            }
            Ev::Ask { exporter } => {
                if self.dead == Some(exporter) {
                    return;
                }
                self.at(now + ARBITER_PERIOD_MS * MS, Ev::Ask { exporter });
                self.ask(now, exporter);
            }
        }
    }

    /// One exporter's request to the arbiter and what it does with the answer.
    fn ask(&mut self, now: u64, e: usize) {
        let asked = self.gates[e].take();
        let ms = now / MS;
        let down = (DOWN_AT..BACK_AT).contains(&ms) || self.reference;
        let demands: Vec<Demand> = asked
            .iter()
            .map(|o| Demand {
                pool_target: o.pool_target.clone(),
                nsid: o.nsid,
                tenant: o.tenant.clone(),
                weight: if self.bug == Some(ArbiterBug::IgnoreWeights) { 100 } else { o.weight },
                wanted_bps: o.bps,
                backlogged: o.backlogged,
            })
            .collect();
        if down {
            self.trace.event(format_args!("e{e} asks for {} demands: no answer (the arbiter is down)", demands.len()));
            return;
        }
        if self.rng.random_bool(self.loss) {
            self.stats.lost += 1;
            self.trace.event(format_args!("e{e} asks: the request is lost"));
            return;
        }
        let asks: Vec<String> =
            demands.iter().map(|d| format!("{}={}{}", d.tenant, d.wanted_bps >> 10, if d.backlogged { "+" } else { "" })).collect();
        self.trace.event(format_args!("e{e} asks (KiB/s offered, + waited) {}", asks.join(" ")));
        let req = BandwidthRequest { target: format!("t{e}"), demands, member: member(e) };
        let (bw, wc) = (self.bandwidth, self.write_cost);
        let cap = move |p: &(String, u32)| (p.0 == POOL && p.1 == NSID).then_some(Capacity { bandwidth: bw, write_cost: wc });
        let g = match self.arbiter.request(ms, &req, cap) {
            Ok(g) => g,
            Err(err) => {
                self.trace.event(format_args!("e{e}: the arbiter refused {req:?}: {err:?}"));
                return;
            }
        };
        if self.rng.random_bool(self.loss) {
            self.stats.lost += 1;
            self.trace.event(format_args!("e{e} asks: the answer is lost"));
            return;
        }
        let grants: Vec<GrantIn> = g
            .grants
            .iter()
            .map(|g| GrantIn {
                pool_target: g.pool_target.clone(),
                nsid: g.nsid,
                tenant: g.tenant.clone(),
                bps: g.bps,
                batch_bytes: g.batch_bytes,
                write_cost: g.write_cost,
                pool_bps: g.pool_bps,
            })
            .collect();
        let told: Vec<String> = grants.iter().map(|g| format!("{}={}", g.tenant, g.bps.unwrap_or(0) >> 10)).collect();
        self.trace.event(format_args!("e{e} granted (KiB/s) {}", told.join(" ")));
        let peers: Vec<PeerIn> =
            g.peers.iter().map(|p| PeerIn { nsid: p.nsid, member: p.member.clone(), bps: p.bps, pool_bps: p.pool_bps }).collect();
        let ttl = if self.bug == Some(ArbiterBug::NeverExpire) { 3_600_000 } else { g.ttl_ms };
        self.gates[e].apply(&asked, &grants, &peers, Duration::from_millis(ttl));
    }

    /// The arbiter comes back with empty books; a peer exporter with clients dies.
    fn come_back(&mut self) {
        self.arbiter = Arbiter::new();
        // A peer with clients, whose death leaves some client alive.
        let peers: Vec<usize> = (1..self.exporters)
            .filter(|e| self.clients.iter().any(|c| c.exporter == *e) && self.clients.iter().any(|c| c.exporter != *e))
            .collect();
        if !peers.is_empty() {
            let e = peers[self.rng.random_range(0..peers.len())];
            self.dead = Some(e);
            for c in self.clients.iter_mut().filter(|c| c.exporter == e) {
                c.alive = false;
            }
        }
        self.trace.event(format_args!("the arbiter is back with empty books; exporter {:?} died", self.dead));
    }

    /// Once the grants ran out, none holds (a gate that kept one would hold its tenant to a
    /// share the arbiter no longer stands for).
    fn no_grant_holds(&self) -> Result<(), String> {
        for (e, g) in self.gates.iter().enumerate() {
            for t in &self.tenants {
                if let Some((bps, left)) = g.grant_of(POOL, NSID, &t.name) {
                    return Err(format!(
                        "the arbiter has been down past the grants' TTL, yet exporter e{e} holds {} to {bps} B/s for {left:?} more",
                        t.name
                    ));
                }
            }
        }
        self.trace.event(format_args!("the grants ran out: none holds"));
        Ok(())
    }

    /// Each tenant's (or, arbiter down, each pool key's) share of window `w` against the
    /// model's, and the pool's throughput against its bandwidth.
    fn check_window(&mut self, from: u64, to: u64, phase: Phase) -> Result<(), String> {
        let w = WINDOWS.iter().position(|x| x.0 == from).expect("a window");
        // (key, weight, moved)
        let mut keys: BTreeMap<String, (u32, u64)> = BTreeMap::new();
        for (i, c) in self.clients.iter().enumerate() {
            // The clients of a dead exporter count until their exporter died.
            if !c.alive && to > BACK_AT {
                continue;
            }
            let t = &self.tenants[c.tenant];
            let (key, weight) = match phase {
                Phase::Down if c.exporter != 0 => (format!("peer e{}", c.exporter), 100),
                Phase::Down => (format!("local {}", t.name), t.weight),
                _ => (t.name.to_string(), t.weight),
            };
            let k = keys.entry(key).or_insert((weight, 0));
            k.1 += self.moved[i][w];
        }
        let rates: Vec<String> = (0..self.clients.len())
            .map(|i| {
                format!(
                    "{}@e{} {:.0}",
                    self.tenants[self.clients[i].tenant].name,
                    self.clients[i].exporter,
                    self.moved[i][w] as f64 / 1024.0 / ((to - from) as f64 / 1000.0)
                )
            })
            .collect();
        self.trace.event(format_args!("{phase:?} window {from}-{to} ms: each client's KiB/s (cost) {}", rates.join(", ")));
        let total: u64 = keys.values().map(|k| k.1).sum();
        let largest = (0..self.tenants.len()).map(|t| self.cost(t)).max().unwrap_or(0);
        let weights: u64 = keys.values().map(|k| k.0 as u64).sum();
        let secs = (to - from) as f64 / 1000.0;
        let rate = total as f64 / secs;
        if rate < 0.85 * self.bandwidth as f64 && !self.reference {
            return Err(format!(
                "{phase:?} window {from}-{to} ms: the pool moved {:.1} MiB/s of {} MiB/s",
                rate / 1048576.0,
                self.bandwidth >> 20
            ));
        }
        if phase == Phase::Down {
            // Its model is the run without an arbiter (run).
            self.stats.down = keys.iter().map(|(k, (_, moved))| (k.clone(), *moved as f64 / total.max(1) as f64)).collect();
            self.stats.down_slack = 3.0 * largest as f64 / total.max(1) as f64;
            let shares: Vec<String> = self.stats.down.iter().map(|(k, v)| format!("{k} {v:.3}")).collect();
            self.trace.event(format_args!("{phase:?} window {from}-{to} ms: shares {}", shares.join(", ")));
            self.stats.windows += 1;
            return Ok(());
        }
        let mut report = Vec::new();
        let mut bad = None;
        for (name, (weight, moved)) in &keys {
            let share = *moved as f64 / total.max(1) as f64;
            let want = *weight as f64 / weights as f64;
            let off = (share - want).abs();
            report.push(format!("{name} {share:.3}/{want:.3}"));
            // A window holds a few hundred operations: a share is within 5% of the model,
            // give or take five percent of the pool and three of the largest operations
            // (the grants leave the pool's queue 5% to drain in, and clients whose commands
            // wait in it move less than their grants for a while).
            self.stats.worst = self.stats.worst.max(off);
            if off > 0.05 * want + 0.05 + 3.0 * largest as f64 / total.max(1) as f64 {
                bad = Some(name.clone());
            }
        }
        self.stats.windows += 1;
        self.trace.event(format_args!("{phase:?} window {from}-{to} ms: shares (measured/model) {}", report.join(", ")));
        if let Some(name) = bad {
            return Err(format!("{phase:?} window {from}-{to} ms: {name}'s share is off the model: {}", report.join(", ")));
        }
        Ok(())
    }

    /// Every tenant with a live client moved something in every bucket (its first apart).
    /// Per tenant, not per client: a tenant of a small share split among its exporters by
    /// what each asked for may leave one of its clients an operation a second.
    fn check_liveness(&self) -> Result<(), String> {
        for (t, spec) in self.tenants.iter().enumerate() {
            for b in 1..(END / BUCKET_MS) as usize {
                let end = (b as u64 + 1) * BUCKET_MS;
                let live: Vec<&Client> = self.clients.iter().filter(|c| c.tenant == t && (c.alive || end <= BACK_AT)).collect();
                if !live.is_empty() && live.iter().all(|c| c.buckets[b] == 0) {
                    return Err(format!("tenant {} moved nothing in {}-{end} ms", spec.name, b as u64 * BUCKET_MS));
                }
            }
        }
        Ok(())
    }
}
