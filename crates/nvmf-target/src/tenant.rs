//! Tenants: named sets of host NQNs, what they may reach and their shares
//! (docs/operations.md, "Tenants").
//!
//! A controller's tenant is resolved at Connect from the host it serves
//! ([`crate::subsystem::Controller::requester`]: the host a cluster member acts for, or its
//! own NQN) and kept on the controller as an `Arc<TenantPolicy>`: the schedulers key on its
//! [`TenantId`], every I/O and compute command is checked against its reach before any
//! data moves. A keyed host runs no command before it authenticates the queue, so the NQN
//! a tenant is resolved from is proven before the tenant is first used.
//!
//! Without `[[tenant]]` entries every host is in the built-in tenant `default`, which
//! reaches whatever the subsystems' host lists allow. With entries, a host in none is
//! refused at Connect (Connect Invalid Host), except on the discovery subsystem and a
//! trusted cluster member connecting as itself (built-in tenant `cluster`, which reaches
//! only the pool subsystem: a member reads a peer's ordinary subsystem only acting for a
//! host, under that host's tenant).
//!
//! ```toml
//! [[tenant]]
//! name = "analytics"
//! hosts = ["nqn.2014-08.org.nvmexpress:uuid:5f1c..."]
//! io_weight = 100                 # share of I/O against other tenants (1..=10000)
//! compute_weight = 200            # share of the offload engine's CPU time (1..=10000)
//! offload_memory = "512MiB"       # its compute commands together (default: no own limit)
//! operations = ["sha256", "grep-count", "select"]   # default: every operation
//!
//! [[tenant.reach]]
//! subsystem = "nqn.2026-11.io.nearstore:disk0"
//! nsid = 1                        # default: every namespace of the subsystem
//! lbas = [0, 2097152]             # default: the whole namespace; [first, end)
//! read_only = true                # default: false
//!
//! [[tenant.reach]]
//! volume = "vol-a"                # the exported volume's subsystem
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;

use nearstore_wire::compute::Descriptor;
use parking_lot::Mutex;
use serde::Deserialize;

use crate::config::{check_nqn, ByteSize, ConfigError};
use crate::limits;

/// The NQN prefix of an exported volume's subsystem; the volume's name follows (the same
/// as the control plane's `model::VOLUME_NQN_PREFIX`, which the CLI's tests compare).
pub const VOLUME_NQN_PREFIX: &str = "nqn.2026-11.io.nearstore:volume:";

/// A tenant's identity: stable for its name while the target runs, across reloads. The
/// built-in tenants are [`TenantId::DEFAULT`] and [`TenantId::CLUSTER`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(pub u32);

impl TenantId {
    /// Every host, when no `[[tenant]]` is configured; and the discovery controllers.
    pub const DEFAULT: TenantId = TenantId(0);
    /// A trusted cluster member connecting as itself: it reaches only the pool subsystem.
    pub const CLUSTER: TenantId = TenantId(1);
}

/// What a tenant may reach and its shares. Compared on reload, its host list and counters
/// apart: a controller whose tenant's policy changed is torn down, and connects again
/// under the new one.
#[derive(Debug, Clone)]
pub struct TenantPolicy {
    pub id: TenantId,
    pub name: String,
    /// Its host NQNs (none for the built-in tenants).
    pub hosts: Vec<String>,
    /// Relative share of I/O against the other tenants active on a device.
    pub io_weight: u32,
    /// Relative share of the offload engine's CPU time.
    pub compute_weight: u32,
    /// Bytes its started compute commands may hold together; None: only the target's budget.
    pub offload_memory: Option<u64>,
    /// Compute operation ids it may run; None: every one.
    operations: Option<BTreeSet<u16>>,
    /// What it may reach; None: everything the subsystems' host lists allow.
    reach: Option<Vec<Grant>>,
    /// Its counters (metrics), kept for its name across reloads.
    pub stats: Arc<TenantStats>,
}

impl PartialEq for TenantPolicy {
    fn eq(&self, o: &TenantPolicy) -> bool {
        (self.id, &self.name, self.io_weight, self.compute_weight, self.offload_memory, &self.operations, &self.reach)
            == (o.id, &o.name, o.io_weight, o.compute_weight, o.offload_memory, &o.operations, &o.reach)
    }
}

impl Eq for TenantPolicy {}

/// What a tenant's controllers did, for the metrics endpoint (`nearstore_tenant_*`).
#[derive(Debug, Default)]
pub struct TenantStats {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub read_bytes: AtomicU64,
    pub written_bytes: AtomicU64,
    /// Compute commands completed.
    pub compute_commands: AtomicU64,
    /// CPU time its compute commands' threads used, measured by the target (thread CPU
    /// clock around each turn), in nanoseconds.
    pub compute_cpu_ns: AtomicU64,
    /// Nanoseconds its compute commands waited: to start, and for turns to compute.
    pub compute_queued_ns: AtomicU64,
    /// Times one of its commands waited for a turn another tenant held or was handed.
    pub compute_turn_waits: AtomicU64,
    /// Bytes its started compute commands hold now (each its `compute.memory_per_command`).
    pub offload_memory_bytes: AtomicU64,
    /// Commands that waited to start because the tenant held its `offload_memory`.
    pub offload_memory_waits: AtomicU64,
    /// Bytes its compute commands read from their inputs and wrote to their outputs.
    pub compute_read_bytes: AtomicU64,
    pub compute_written_bytes: AtomicU64,
    /// Bytes of reads and writes fair-scheduled devices let go for it (docs/fair-io.md):
    /// of its controllers' commands, its compute commands' reads and writes, its volume
    /// operations' slow paths.
    pub io_scheduled_bytes: AtomicU64,
    /// Times a fair-scheduled device held one of its reads or writes back for a later epoch.
    pub io_waits: AtomicU64,
    /// Nanoseconds fair-scheduled devices held its reads and writes back (until the epoch
    /// each was offered again in).
    pub io_queued_ns: AtomicU64,
    /// Its weights as installed (0 once a reload or a push removed it).
    pub io_weight: AtomicU64,
    pub compute_weight: AtomicU64,
}
/// One `[[tenant.reach]]` entry, resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Grant {
    subsystem: String,
    nsid: Option<u32>,
    /// Logical blocks [first, end) of the namespace.
    lbas: Option<Range<u64>>,
    read_only: bool,
}

/// Why the tenant may not run a command: the message a compute command's host fetches and
/// the log says. The status is [`nearstore_wire::Status::ACCESS_DENIED`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denied(pub String);

impl TenantPolicy {
    /// A tenant that reaches everything and runs every operation, with these weights (the
    /// built-in tenants have the default ones; schedulers' tests make others).
    pub fn unrestricted(id: TenantId, name: &str, io_weight: u32, compute_weight: u32) -> TenantPolicy {
        TenantPolicy {
            id,
            name: name.into(),
            hosts: Vec::new(),
            io_weight,
            compute_weight,
            offload_memory: None,
            operations: None,
            reach: None,
            stats: Arc::default(),
        }
    }

    /// Whether it may read (or, `write`, write) logical blocks `lbas` of namespace `nsid`
    /// of subsystem `subnqn`; `lbas` None: any part of the namespace (Flush, the
    /// reservation commands). A write needs a grant that is not read-only; a range must lie
    /// inside one grant.
    pub fn check(&self, subnqn: &str, nsid: u32, lbas: Option<Range<u64>>, write: bool) -> Result<(), Denied> {
        let Some(grants) = &self.reach else { return Ok(()) };
        let covers = |g: &Grant| {
            g.subsystem == subnqn
                && g.nsid.is_none_or(|n| n == nsid)
                && (!write || !g.read_only)
                && match (&g.lbas, &lbas) {
                    (None, _) | (Some(_), None) => true,
                    (Some(r), Some(want)) => r.start <= want.start && want.end <= r.end,
                }
        };
        if grants.iter().any(covers) {
            return Ok(());
        }
        let what = if write { "write" } else { "read" };
        let blocks = lbas.map_or_else(|| "the namespace".to_string(), |r| format!("logical blocks {}..{}", r.start, r.end));
        Err(Denied(format!("tenant {} may not {what} {blocks} of namespace {nsid} of {subnqn}", self.name)))
    }

    /// Whether it may run a compute descriptor on namespace `nsid` (of `block_size`-byte
    /// blocks) of `subnqn`: the operation, every local extent of its inputs read and of its
    /// outputs written. Extents on peers are checked by the peer, which the target reads
    /// acting for this host (docs/compute-protocol.md, "Acting for a host"). Called with
    /// the descriptor checks, before a byte is read.
    pub fn check_descriptor(&self, subnqn: &str, nsid: u32, block_size: u64, desc: &Descriptor, op: &str) -> Result<(), Denied> {
        self.check_operation(desc.op, op)?;
        if self.reach.is_none() {
            return Ok(());
        }
        self.check(subnqn, nsid, None, false)?;
        let objects = desc.inputs.iter().map(|o| (o, false)).chain(desc.outputs.iter().map(|o| (o, true)));
        for (o, write) in objects {
            for e in o.extents.iter().filter(|e| !e.is_zeros() && !e.is_remote()) {
                let first = e.offset / block_size;
                let end = e.offset.saturating_add(e.len).div_ceil(block_size);
                self.check(subnqn, nsid, Some(first..end), write)?;
            }
        }
        Ok(())
    }

    /// Whether it may reach subsystem `subnqn` at all (checked at Connect).
    pub fn reaches(&self, subnqn: &str) -> bool {
        self.reach.as_ref().is_none_or(|g| g.iter().any(|g| g.subsystem == subnqn))
    }

    /// Whether it may run compute operation `op` (its id), named `name` in the message.
    pub fn check_operation(&self, op: u16, name: &str) -> Result<(), Denied> {
        match &self.operations {
            Some(ops) if !ops.contains(&op) => Err(Denied(format!("tenant {} may not run operation {name}", self.name))),
            _ => Ok(()),
        }
    }
}

/// A `[[tenant]]` entry of the configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    pub name: String,
    /// Host NQNs: authenticated ones when their subsystem entry has a key.
    pub hosts: Vec<String>,
    #[serde(default = "default_weight")]
    pub io_weight: u32,
    #[serde(default = "default_weight")]
    pub compute_weight: u32,
    pub offload_memory: Option<ByteSize>,
    /// Operation names (`nearstore_compute::OPERATIONS`); absent: every one.
    pub operations: Option<Vec<String>>,
    #[serde(default)]
    pub reach: Vec<ReachConfig>,
}

/// A `[[tenant.reach]]` entry: a subsystem or an exported volume.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReachConfig {
    pub subsystem: Option<String>,
    pub volume: Option<String>,
    pub nsid: Option<u32>,
    pub lbas: Option<[u64; 2]>,
    #[serde(default)]
    pub read_only: bool,
}

const DEFAULT_WEIGHT: u32 = limits::TENANT_WEIGHT_DEFAULT;

fn default_weight() -> u32 {
    limits::TENANT_WEIGHT_DEFAULT
}

fn invalid(field: String, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field, message: message.into() }
}

/// Checks a weight: 0 would never be scheduled, more than the maximum makes every other
/// tenant's share round to nothing.
fn check_weight(field: String, w: u32) -> Result<(), ConfigError> {
    if w == 0 || w > limits::TENANT_WEIGHT_MAX {
        return Err(invalid(field, format!("{w}: a weight must be between 1 and {}", limits::TENANT_WEIGHT_MAX)));
    }
    Ok(())
}

/// Checks the `[[tenant]]` entries against the configured subsystems (`subsystems`: their
/// NQNs) and the least memory one compute command needs (`command_min` bytes); resolves
/// them to policies numbered from 2 in order (the built-in tenants hold 0 and 1).
pub fn resolve(tenants: &[TenantConfig], subsystems: &[&str], command_min: u64) -> Result<Vec<TenantPolicy>, ConfigError> {
    if tenants.len() > limits::TENANTS_MAX {
        return Err(invalid("tenant".into(), format!("at most {} tenants", limits::TENANTS_MAX)));
    }
    let mut owner: HashMap<&str, &str> = HashMap::new();
    let mut names = BTreeSet::new();
    let mut out = Vec::with_capacity(tenants.len());
    for (i, t) in tenants.iter().enumerate() {
        let f = format!("tenant[{i}]");
        let good_name = !t.name.is_empty()
            && t.name.len() <= limits::TENANT_NAME_BYTES_MAX
            && t.name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !good_name {
            return Err(invalid(
                format!("{f}.name"),
                format!("'{}': 1 to {} letters, digits, '-', '_' or '.'", t.name, limits::TENANT_NAME_BYTES_MAX),
            ));
        }
        if t.name == "default" || t.name == "cluster" || !names.insert(t.name.as_str()) {
            return Err(invalid(format!("{f}.name"), format!("'{}' is built in or named twice", t.name)));
        }
        if t.hosts.len() > limits::TENANT_HOSTS_MAX {
            return Err(invalid(format!("{f}.hosts"), format!("at most {} hosts", limits::TENANT_HOSTS_MAX)));
        }
        for (j, h) in t.hosts.iter().enumerate() {
            check_nqn(h).map_err(|m| invalid(format!("{f}.hosts[{j}]"), m))?;
            if let Some(other) = owner.insert(h, &t.name) {
                return Err(invalid(format!("{f}.hosts[{j}]"), format!("host {h} is in tenants {other} and {}", t.name)));
            }
        }
        check_weight(format!("{f}.io_weight"), t.io_weight)?;
        check_weight(format!("{f}.compute_weight"), t.compute_weight)?;
        if let Some(m) = t.offload_memory.filter(|m| m.0 < command_min) {
            return Err(invalid(
                format!("{f}.offload_memory"),
                format!("{} bytes cannot hold one compute command's chunk buffers ({command_min} bytes)", m.0),
            ));
        }
        let operations = match &t.operations {
            None => None,
            Some(names) => Some(
                names
                    .iter()
                    .enumerate()
                    .map(|(j, n)| {
                        nearstore_compute::by_name(n).map(|o| o.id).map_err(|e| invalid(format!("{f}.operations[{j}]"), e.to_string()))
                    })
                    .collect::<Result<BTreeSet<u16>, _>>()?,
            ),
        };
        let mut reach = Vec::with_capacity(t.reach.len());
        for (j, r) in t.reach.iter().enumerate() {
            let rf = format!("{f}.reach[{j}]");
            let subsystem = match (&r.subsystem, &r.volume) {
                (Some(s), None) => {
                    if !subsystems.contains(&s.as_str()) {
                        return Err(invalid(format!("{rf}.subsystem"), format!("{s} is not a configured subsystem")));
                    }
                    s.clone()
                }
                (None, Some(v)) => {
                    let nqn = format!("{VOLUME_NQN_PREFIX}{v}");
                    check_nqn(&nqn).map_err(|m| invalid(format!("{rf}.volume"), m))?;
                    nqn
                }
                _ => return Err(invalid(rf, "give one of subsystem and volume")),
            };
            if r.nsid == Some(0) {
                return Err(invalid(format!("{rf}.nsid"), "0 is no namespace"));
            }
            if let Some([a, b]) = r.lbas {
                if a >= b {
                    return Err(invalid(format!("{rf}.lbas"), format!("[{a}, {b}] is empty: give [first, end)")));
                }
                if r.nsid.is_none() {
                    return Err(invalid(format!("{rf}.lbas"), "blocks are of one namespace: give nsid too"));
                }
            }
            reach.push(Grant { subsystem, nsid: r.nsid, lbas: r.lbas.map(|[a, b]| a..b), read_only: r.read_only });
        }
        out.push(TenantPolicy {
            id: TenantId(i as u32 + 2),
            name: t.name.clone(),
            hosts: t.hosts.clone(),
            io_weight: t.io_weight,
            compute_weight: t.compute_weight,
            offload_memory: t.offload_memory.map(|m| m.0),
            operations,
            reach: Some(reach),
            stats: Arc::default(),
        });
    }
    Ok(out)
}

/// The tenant table a target resolves controllers against; replaced whole on reload.
pub struct Tenants {
    table: Mutex<Table>,
    /// What the table is made of: the configured tenants and the control plane's.
    sources: Mutex<Sources>,
    /// Counts installs: a Connect compares it before resolving and after adding its
    /// controller, to catch a reload whose sweep could not see that controller yet.
    generation: AtomicU64,
    /// Pushed tenants the last install refused (a conflict with the configured ones).
    pub refused: AtomicU64,
    default: Arc<TenantPolicy>,
    cluster: Arc<TenantPolicy>,
}

#[derive(Default)]
struct Table {
    /// Configured tenants by host NQN; empty: every host is in `default`.
    by_host: HashMap<String, Arc<TenantPolicy>>,
    all: Vec<Arc<TenantPolicy>>,
    /// Ids given to names, kept across reloads so that a name keeps its id.
    ids: HashMap<String, TenantId>,
    /// Counters by id, kept across reloads, of tenants removed too (until the target stops).
    stats: BTreeMap<TenantId, Arc<TenantStats>>,
}

/// Where a controller's host stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolved {
    Tenant(Arc<TenantPolicy>),
    /// Tenants are configured and the host is in none.
    Refused,
}

/// The tenants of the configuration file and those the control plane pushed
/// (docs/operations.md, "Tenants from the control plane").
#[derive(Default)]
struct Sources {
    configured: Vec<TenantConfig>,
    /// The configured subsystems' NQNs, which a pushed tenant's reach is cut to.
    subsystems: Vec<String>,
    /// Those of them the control plane may grant (`[cluster] control_grants`).
    grantable: Vec<String>,
    /// The least memory one compute command needs, bytes.
    command_min: u64,
    pushed: Vec<TenantConfig>,
}

impl Sources {
    /// The configured tenants (checked already) and every pushed one that agrees with them:
    /// a pushed tenant named as a configured one, holding a configured tenant's host,
    /// reaching what the control plane may not grant here ([`Sources::beyond_grant`]) or
    /// not valid here is refused (its reason in the second list), never merged. A pushed
    /// tenant reaches the subsystems of this target among those it names, and its volumes.
    fn combine(&self) -> (Vec<TenantPolicy>, Vec<String>) {
        let subs: Vec<&str> = self.subsystems.iter().map(String::as_str).collect();
        let mut list = self.configured.clone();
        let mut refused = Vec::new();
        for p in &self.pushed {
            let clash = self.configured.iter().find_map(|c| {
                if c.name == p.name {
                    return Some(format!("tenant {} is configured on this target too ([[tenant]])", p.name));
                }
                let h = p.hosts.iter().find(|h| c.hosts.contains(*h))?;
                Some(format!("host {h} of tenant {} is in configured tenant {}", p.name, c.name))
            });
            let clash = clash.or_else(|| self.beyond_grant(p));
            let mut here = p.clone();
            here.reach.retain(|r| r.volume.is_some() || r.subsystem.as_deref().is_some_and(|s| subs.contains(&s)));
            let mut trial = list.clone();
            trial.push(here);
            match clash.map_or_else(|| resolve(&trial, &subs, self.command_min).map(drop).map_err(|e| e.to_string()), Err) {
                Ok(()) => list = trial,
                Err(why) => refused.push(format!("pushed tenant {}: {why}", p.name)),
            }
        }
        match resolve(&list, &subs, self.command_min) {
            Ok(policies) => (policies, refused),
            // Each was accepted beside the ones before it: not reached.
            Err(e) => (resolve(&self.configured, &subs, self.command_min).unwrap_or_default(), vec![e.to_string()]),
        }
    }
}

impl Sources {
    /// Why pushed tenant `p` reaches something the control plane may not grant on this
    /// target, if it does. The control plane owns what it made (exported volumes); the
    /// subsystems of this target's configuration, and the host lists that guard them, are
    /// the configuration's: a pushed tenant may name one only when `[cluster]
    /// control_grants` lists it. The pool subsystem holds every volume's blocks and is
    /// reached only by cluster members as themselves: no tenant may name it. Naming a
    /// subsystem this target does not have is no refusal (the control plane pushes every
    /// tenant to every target; that reach is for another one).
    fn beyond_grant(&self, p: &TenantConfig) -> Option<String> {
        p.reach.iter().find_map(|r| {
            let nqn = match (&r.subsystem, &r.volume) {
                (Some(s), None) => s.clone(),
                (None, Some(v)) => format!("{VOLUME_NQN_PREFIX}{v}"),
                _ => return None,
            };
            if nqn == crate::POOLS_NQN {
                return Some(format!("tenant {} reaches the pool subsystem {nqn}, which only cluster members read", p.name));
            }
            (self.subsystems.contains(&nqn) && !self.grantable.contains(&nqn)).then(|| {
                format!(
                    "tenant {} reaches {nqn}, a subsystem of this target's configuration that [cluster] control_grants does not list",
                    p.name
                )
            })
        })
    }
}

impl Default for Tenants {
    fn default() -> Self {
        let t = Tenants {
            table: Mutex::default(),
            sources: Mutex::default(),
            generation: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            default: Arc::new(TenantPolicy::unrestricted(TenantId::DEFAULT, "default", DEFAULT_WEIGHT, DEFAULT_WEIGHT)),
            // NQNs are self-asserted (an allow_any_host subsystem proves none): a host
            // claiming a member's NQN must gain nothing beyond what a member reads for
            // itself, the pool subsystem. A member acting for a host gets the host's tenant.
            cluster: Arc::new(TenantPolicy {
                reach: Some(vec![Grant { subsystem: crate::POOLS_NQN.into(), nsid: None, lbas: None, read_only: false }]),
                ..TenantPolicy::unrestricted(TenantId::CLUSTER, "cluster", DEFAULT_WEIGHT, DEFAULT_WEIGHT)
            }),
        };
        for p in [&t.default, &t.cluster] {
            p.stats.io_weight.store(p.io_weight.into(), SeqCst);
            p.stats.compute_weight.store(p.compute_weight.into(), SeqCst);
        }
        t
    }
}

impl Tenants {
    /// Takes the configuration's `[[tenant]]` entries (at start-up and on SIGHUP): checked
    /// alone first (an error changes nothing), then installed with the pushed tenants that
    /// agree with them. Returns why pushed ones were refused.
    pub fn configure(&self, cfg: &crate::config::Config) -> Result<Vec<String>, ConfigError> {
        cfg.tenants()?;
        let mut s = self.sources.lock();
        s.configured = cfg.tenant.clone();
        s.subsystems = cfg.subsystem.iter().map(|x| x.nqn.clone()).collect();
        s.grantable = cfg.cluster.control_grants.clone();
        s.command_min = cfg.compute.chunk_bytes();
        let (policies, refused) = s.combine();
        self.install(policies);
        self.refused.store(refused.len() as u64, SeqCst);
        Ok(refused)
    }

    /// Takes the control plane's tenants in place of those it pushed before, with the
    /// configured ones. Returns why pushed ones were refused.
    pub fn push(&self, pushed: Vec<TenantConfig>) -> Vec<String> {
        let mut s = self.sources.lock();
        s.pushed = pushed;
        let (policies, refused) = s.combine();
        self.install(policies);
        self.refused.store(refused.len() as u64, SeqCst);
        refused
    }

    /// Replaces the table with `policies` (from [`resolve`]); a name seen before keeps its
    /// id. Returns the policies as installed.
    pub fn install(&self, policies: Vec<TenantPolicy>) -> Vec<Arc<TenantPolicy>> {
        let mut t = self.table.lock();
        let mut next = t.ids.values().map(|id| id.0 + 1).max().unwrap_or(2).max(2);
        let mut by_host = HashMap::new();
        let mut all = Vec::with_capacity(policies.len());
        for mut p in policies {
            p.id = *t.ids.entry(p.name.clone()).or_insert_with(|| {
                next += 1;
                TenantId(next - 1)
            });
            p.stats = t.stats.entry(p.id).or_insert_with(|| p.stats.clone()).clone();
            let p = Arc::new(p);
            for h in &p.hosts {
                by_host.insert(h.clone(), p.clone());
            }
            all.push(p);
        }
        for st in t.stats.values() {
            st.io_weight.store(0, SeqCst);
            st.compute_weight.store(0, SeqCst);
        }
        for p in &all {
            p.stats.io_weight.store(p.io_weight.into(), SeqCst);
            p.stats.compute_weight.store(p.compute_weight.into(), SeqCst);
        }
        t.by_host = by_host;
        t.all = all.clone();
        self.generation.fetch_add(1, SeqCst);
        all
    }

    /// How many times a table was installed. A Connect reads it before resolving its
    /// host's tenant and again after adding its controller: when equal, any later reload
    /// bumps it only after this point, so that reload's sweep (which follows its install)
    /// sees the controller; when not, the Connect checks its tenant again itself.
    pub fn generation(&self) -> u64 {
        self.generation.load(SeqCst)
    }

    /// Every configured tenant.
    pub fn all(&self) -> Vec<Arc<TenantPolicy>> {
        self.table.lock().all.clone()
    }

    /// Every tenant that has counters, the built-in ones first: (name, counters), for
    /// the metrics endpoint. A tenant removed by a reload keeps its series.
    pub fn stats(&self) -> Vec<(String, Arc<TenantStats>)> {
        let t = self.table.lock();
        let names: HashMap<TenantId, &String> = t.ids.iter().map(|(n, id)| (*id, n)).collect();
        let builtin = [&self.default, &self.cluster].map(|p| (p.name.clone(), p.stats.clone()));
        builtin.into_iter().chain(t.stats.iter().filter_map(|(id, s)| Some((names.get(id)?.to_string(), s.clone())))).collect()
    }

    /// The built-in tenant of every host when none is configured.
    pub fn default_tenant(&self) -> Arc<TenantPolicy> {
        self.default.clone()
    }

    /// Whether a controller of `host` holding `tenant` keeps it after a reload: its host
    /// resolves to the same policy (`discovery`, `member` as for [`Tenants::resolve`]).
    pub fn keeps(&self, tenant: &TenantPolicy, host: &str, discovery: bool, member: bool) -> bool {
        let same =
            |p: &TenantPolicy| TenantPolicy { hosts: Vec::new(), ..p.clone() } == TenantPolicy { hosts: Vec::new(), ..tenant.clone() };
        matches!(self.resolve(host, discovery, member), Resolved::Tenant(p) if same(&p))
    }

    /// The tenant of `host` connecting to a subsystem; `discovery`: the discovery
    /// subsystem; `member`: a trusted cluster member connecting as itself.
    pub fn resolve(&self, host: &str, discovery: bool, member: bool) -> Resolved {
        let t = self.table.lock();
        if let Some(p) = t.by_host.get(host) {
            return Resolved::Tenant(p.clone());
        }
        if t.all.is_empty() || discovery {
            Resolved::Tenant(self.default.clone())
        } else if member {
            Resolved::Tenant(self.cluster.clone())
        } else {
            Resolved::Refused
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    const SUB: &str = "nqn.2026-11.io.nearstore:a";
    const PRIVATE: &str = "nqn.2026-11.io.nearstore:private";

    /// A configuration with one subsystem and the `[[tenant]]` entries given.
    fn config(tenants: &str) -> Result<Config, ConfigError> {
        Config::from_toml(&format!(
            "[[listener]]\naddress = \"127.0.0.1:4420\"\n[[subsystem]]\nnqn = \"{SUB}\"\nallow_any_host = true\n\
             [[subsystem.namespace]]\nnsid = 1\nmemory = \"1MiB\"\n{tenants}"
        ))
    }

    fn tenant(name: &str, host: &str, lines: &str) -> String {
        format!("[[tenant]]\nname = \"{name}\"\nhosts = [\"nqn.2014-08.org.example:{host}\"]\n{lines}\n")
    }

    /// Each bad `[[tenant]]` is refused at load with an error naming its field.
    #[test]
    fn bad_tenants_name_the_field() {
        let t = |lines: &str| tenant("t", "h", lines);
        let cases: Vec<(String, &str)> = vec![
            (t("io_weight = 0"), "tenant[0].io_weight: 0: a weight must be between 1 and 10000"),
            (t("compute_weight = 0"), "tenant[0].compute_weight"),
            (t("io_weight = 10001"), "tenant[0].io_weight: 10001"),
            (t("compute_weight = 4294967295"), "tenant[0].compute_weight"),
            (t("io_weight = -1"), "io_weight"),
            (t("offload_memory = \"4KiB\""), "tenant[0].offload_memory: 4096 bytes cannot hold"),
            (t("operations = [\"sha256\", \"rot13\"]"), "tenant[0].operations[1]"),
            (t("[[tenant.reach]]\nsubsystem = \"nqn.2026-11.io.nearstore:nope\""), "tenant[0].reach[0].subsystem"),
            (t(&format!("[[tenant.reach]]\nsubsystem = \"{SUB}\"\nvolume = \"v\"")), "tenant[0].reach[0]: give one of"),
            (t("[[tenant.reach]]\nnsid = 1"), "tenant[0].reach[0]: give one of"),
            (t(&format!("[[tenant.reach]]\nsubsystem = \"{SUB}\"\nnsid = 0")), "tenant[0].reach[0].nsid"),
            (t(&format!("[[tenant.reach]]\nsubsystem = \"{SUB}\"\nnsid = 1\nlbas = [8, 8]")), "tenant[0].reach[0].lbas"),
            (t(&format!("[[tenant.reach]]\nsubsystem = \"{SUB}\"\nlbas = [0, 8]")), "give nsid too"),
            (t("[[tenant.reach]]\nvolume = \"a b\""), "tenant[0].reach[0].volume"),
            (t("colour = 1"), "unknown field `colour`"),
            (tenant("", "h", ""), "tenant[0].name"),
            (tenant("a/b", "h", ""), "tenant[0].name"),
            (tenant(&"n".repeat(65), "h", ""), "tenant[0].name"),
            (tenant("default", "h", ""), "'default' is built in"),
            (tenant("cluster", "h", ""), "'cluster' is built in"),
            (tenant("t", "h", "") + &tenant("t", "i", ""), "tenant[1].name: 't' is built in or named twice"),
            (tenant("t", "h", "") + &tenant("u", "h", ""), "tenant[1].hosts[0]: host nqn.2014-08.org.example:h is in tenants t and u"),
            ("[[tenant]]\nname = \"t\"\nhosts = [\"bad\"]\n".into(), "tenant[0].hosts[0]"),
        ];
        for (text, want) in &cases {
            let e = config(text).expect_err(text).to_string();
            assert!(e.contains(want), "{text:?}: {e:?} should contain {want:?}");
        }
        // The bounds themselves are accepted.
        config(&t("io_weight = 1\ncompute_weight = 10000")).unwrap();
    }

    /// Who resolves to what: each line a host, whether it connects to the discovery
    /// subsystem, whether it is a trusted member connecting as itself, and the tenant it
    /// gets (None: refused). Without tenants, every host is in `default`.
    #[test]
    fn hosts_resolve_to_their_tenant() {
        let host = |h: &str| format!("nqn.2014-08.org.example:{h}");
        let none = Tenants::default();
        assert_eq!(none.resolve(&host("x"), false, false), Resolved::Tenant(none.default_tenant()));
        let cfg = config(&(tenant("t", "h", "") + &tenant("u", "i", ""))).unwrap();
        let tenants = Tenants::default();
        tenants.install(cfg.tenants().unwrap());
        let name = |r: Resolved| match r {
            Resolved::Tenant(p) => Some((p.name.clone(), p.id)),
            Resolved::Refused => None,
        };
        /// A host, discovery, member, and the tenant's name and id (None: refused).
        type Case = (&'static str, bool, bool, Option<(&'static str, TenantId)>);
        let cases: &[Case] = &[
            ("h", false, false, Some(("t", TenantId(2)))),
            ("i", false, false, Some(("u", TenantId(3)))),
            ("h", true, false, Some(("t", TenantId(2)))),
            ("x", false, false, None),
            ("x", true, false, Some(("default", TenantId::DEFAULT))),
            ("x", false, true, Some(("cluster", TenantId::CLUSTER))),
        ];
        for &(h, discovery, member, want) in cases {
            let want = want.map(|(n, id)| (n.to_string(), id));
            assert_eq!(name(tenants.resolve(&host(h), discovery, member)), want, "{h} {discovery} {member}");
        }
        // A reload keeps a name's id, whatever its place; a new name gets a new one.
        let cfg = config(&(tenant("v", "j", "") + &tenant("u", "i", ""))).unwrap();
        tenants.install(cfg.tenants().unwrap());
        assert_eq!(name(tenants.resolve(&host("i"), false, false)), Some(("u".into(), TenantId(3))));
        assert_eq!(name(tenants.resolve(&host("j"), false, false)), Some(("v".into(), TenantId(4))));
        assert_eq!(name(tenants.resolve(&host("h"), false, false)), None);
    }

    /// Tenants pushed by the control plane beside the configured ones: each line a pushed
    /// tenant (name, host, offload memory, reaches) and why it is refused (None: installed);
    /// an accepted one reaches only this target's subsystems among those it names, and its
    /// volumes; one naming a configured subsystem not in `control_grants`, or the pool
    /// subsystem, is refused. A SIGHUP reload keeps the pushed tenants, and its
    /// `control_grants` decide again.
    #[test]
    fn pushed_tenants_join_the_configured_ones_or_are_refused() {
        let host = |h: &str| format!("nqn.2014-08.org.example:{h}");
        let pushed = |name: &str, h: &str, memory: Option<u64>, reach: &[&str]| TenantConfig {
            name: name.into(),
            hosts: vec![host(h)],
            io_weight: 300,
            compute_weight: 100,
            offload_memory: memory.map(ByteSize),
            operations: None,
            reach: reach
                .iter()
                .map(|r| match r.strip_prefix("volume:") {
                    Some(v) => ReachConfig { subsystem: None, volume: Some(v.into()), nsid: None, lbas: None, read_only: false },
                    None => ReachConfig { subsystem: Some(r.to_string()), volume: None, nsid: None, lbas: None, read_only: false },
                })
                .collect(),
        };
        let other = "nqn.2026-11.io.nearstore:elsewhere";
        let not_granted =
            format!("reaches {PRIVATE}, a subsystem of this target's configuration that [cluster] control_grants does not list");
        let cases: Vec<(TenantConfig, Option<&str>)> = vec![
            (pushed("p", "p1", None, &[SUB, other, "volume:v"]), None),
            (pushed("t", "p2", None, &[SUB]), Some("tenant t is configured on this target too")),
            (pushed("q", "h", None, &[SUB]), Some("host nqn.2014-08.org.example:h of tenant q is in configured tenant t")),
            (pushed("r", "p3", Some(4096), &[SUB]), Some("offload_memory")),
            (pushed("s", "p4", None, &[other]), None),
            (pushed("g", "p5", None, &[SUB, PRIVATE]), Some(not_granted.as_str())),
            (pushed("k", "p6", None, &["volume:v", crate::POOLS_NQN]), Some("reaches the pool subsystem")),
        ];
        // SUB is the control plane's to grant, PRIVATE is not.
        let configured = |grants: &str| {
            config(&format!(
                "{}[[subsystem]]\nnqn = \"{PRIVATE}\"\nallow_any_host = true\n[cluster]\ncontrol_grants = [{grants}]\n",
                tenant("t", "h", &format!("[[tenant.reach]]\nsubsystem = \"{SUB}\""))
            ))
            .unwrap()
        };
        let cfg = configured(&format!("\"{SUB}\""));
        let tenants = Tenants::default();
        assert!(tenants.configure(&cfg).unwrap().is_empty());
        let refused = tenants.push(cases.iter().map(|(t, _)| t.clone()).collect());
        assert_eq!(tenants.refused.load(SeqCst), refused.len() as u64);
        for (t, want) in &cases {
            let mine: Vec<&String> = refused.iter().filter(|r| r.starts_with(&format!("pushed tenant {}:", t.name))).collect();
            match want {
                None => assert!(mine.is_empty(), "{}: {mine:?}", t.name),
                Some(w) => assert!(mine.len() == 1 && mine[0].contains(w), "{}: {mine:?} should say {w:?}", t.name),
            }
        }
        let names: Vec<String> = tenants.all().iter().map(|p| p.name.clone()).collect();
        assert_eq!(names, ["t", "p", "s"]);
        // The configured tenant keeps its host; the pushed one reaches what this target has.
        let Resolved::Tenant(p) = tenants.resolve(&host("p1"), false, false) else { panic!("p1 refused") };
        assert_eq!((p.name.as_str(), p.io_weight), ("p", 300));
        assert!(p.reaches(SUB) && p.reaches(&format!("{VOLUME_NQN_PREFIX}v")) && !p.reaches(other));
        let Resolved::Tenant(s) = tenants.resolve(&host("p4"), false, false) else { panic!("p4 refused") };
        assert!(!s.reaches(SUB), "a tenant of another target's subsystem reaches nothing here");
        assert_eq!(tenants.resolve(&host("h"), false, false), Resolved::Tenant(tenants.all()[0].clone()));
        assert_eq!(tenants.resolve(&host("p2"), false, false), Resolved::Refused);
        assert_eq!(tenants.resolve(&host("p5"), false, false), Resolved::Refused);
        // A reload of the configuration keeps what was pushed, and one that grants PRIVATE
        // too lets in the tenant reaching it; one that grants nothing refuses those
        // reaching SUB.
        tenants.configure(&cfg).unwrap();
        assert_eq!(tenants.all().len(), 3);
        assert_eq!(tenants.configure(&configured(&format!("\"{SUB}\", \"{PRIVATE}\""))).unwrap().len(), 4);
        let Resolved::Tenant(g) = tenants.resolve(&host("p5"), false, false) else { panic!("p5 refused") };
        assert!(g.reaches(SUB) && g.reaches(PRIVATE));
        let refused = tenants.configure(&configured("")).unwrap();
        assert_eq!(refused.len(), 6, "{refused:?}");
        assert_eq!(tenants.all().iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["t", "s"]);
        tenants.configure(&cfg).unwrap();
        // A push of nothing leaves the configured tenants alone.
        assert!(tenants.push(Vec::new()).is_empty());
        assert_eq!(tenants.all().iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["t"]);
        assert_eq!(tenants.refused.load(SeqCst), 0);
    }
}
