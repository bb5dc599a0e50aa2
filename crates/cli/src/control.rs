//! The control plane's verbs: `control` (the daemon), `view`, `volume create|list|info|
//! grow|delete` and `tenant create|list|info|delete`, all through the API's client
//! (docs/control-plane.md).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use nearstore_control::agent::{Agent, AgentPool};
use nearstore_control::client::{Client, ClientError};
use nearstore_control::model::{ErrorCode, Export, ExportVolume, ExtentInfo, Move, MoveReport, MoveState, Tenant, VolumeInfo};
use nearstore_control::server::{self, Service};
use nearstore_control::store::RedbStore;

use nearstore_target::dev::volume::mover::{MoveControl, MoveOrder, Mover, MoverConfig, Served};
use nearstore_target::dev::volume::{BoxFuture, Location, Lookup, PoolDevices, ResolveError, Resolver, Volume, VolumeConfig};
use nearstore_target::subsystem::{Namespace, Subsystem};

use crate::{size, Output, Plain};

/// The control plane's default port.
pub const CONTROL_PORT: u16 = 9470;

/// Where the control plane is: --control, else NEARSTORE_CONTROL, else 127.0.0.1:9470.
#[derive(clap::Args, Clone)]
pub struct ControlArgs {
    /// The control plane: HOST or HOST:PORT, or a comma list of a leader and its standbys
    /// (default: $NEARSTORE_CONTROL, else 127.0.0.1:9470).
    #[arg(long)]
    pub control: Option<String>,
    /// A file holding the control plane's token, for one started with --token-file
    /// (default: $NEARSTORE_CONTROL_TOKEN_FILE).
    #[arg(long)]
    pub control_token_file: Option<PathBuf>,
    /// Output format: normal (text) or json.
    #[arg(short = 'o', long, value_enum, default_value = "normal")]
    pub output_format: Output,
}

impl ControlArgs {
    pub fn client(&self) -> Result<Client> {
        let a = self
            .control
            .clone()
            .or_else(|| std::env::var("NEARSTORE_CONTROL").ok().filter(|s| !s.is_empty()))
            .unwrap_or_else(|| "127.0.0.1".into());
        let list = addresses(&a).context("--control")?;
        let token = match &self.control_token_file {
            Some(f) => Some(read_token(f).context("--control-token-file")?),
            None => env_token()?,
        };
        Ok(Client::with_addrs(list).with_token(token))
    }
}

/// A client of the control plane at `addrs`: HOST[:PORT] or a comma list of them, tried in
/// turn until the leader answers; with the token in $NEARSTORE_CONTROL_TOKEN_FILE, if set
/// (a target's view agent, resolver and copier, whose `--control` this is).
pub fn client(addrs: &str) -> Result<Client> {
    Ok(Client::with_addrs(addresses(addrs)?).with_token(env_token()?))
}

fn addresses(addrs: &str) -> Result<Vec<SocketAddr>> {
    let list =
        addrs.split(',').map(str::trim).filter(|a| !a.is_empty()).map(|a| crate::resolve(a, CONTROL_PORT)).collect::<Result<Vec<_>>>()?;
    anyhow::ensure!(!list.is_empty(), "no control plane address in '{addrs}'");
    Ok(list)
}

/// The token in the file $NEARSTORE_CONTROL_TOKEN_FILE names, if it is set.
fn env_token() -> Result<Option<String>> {
    match std::env::var_os("NEARSTORE_CONTROL_TOKEN_FILE").filter(|v| !v.is_empty()) {
        Some(f) => read_token(std::path::Path::new(&f)).context("NEARSTORE_CONTROL_TOKEN_FILE").map(Some),
        None => Ok(None),
    }
}

/// A control token from its file: the first line, the file its owner's alone (mode 600 or
/// 400: refused if group or others may reach it, as ssh refuses such a key).
pub fn read_token(path: &std::path::Path) -> Result<String> {
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;
    let mut f = std::fs::File::open(path).with_context(|| path.display().to_string())?;
    // The mode of the file read, not of a name that may change in between.
    let mode = f.metadata().with_context(|| path.display().to_string())?.permissions().mode() & 0o7777;
    anyhow::ensure!(
        mode & 0o077 == 0,
        "{}: mode {mode:04o} lets group or others read the control token: chmod 600 {}",
        path.display(),
        path.display()
    );
    let mut text = String::new();
    f.read_to_string(&mut text).with_context(|| path.display().to_string())?;
    let token = text.lines().next().unwrap_or("").trim().to_string();
    anyhow::ensure!(!token.is_empty(), "{}: no token on its first line", path.display());
    Ok(token)
}

#[derive(clap::Subcommand)]
pub enum VolumeCmd {
    /// Create a volume; its extents are allocated on first write.
    Create {
        /// The volume's name: letters, digits, '.', '_', '-'.
        name: String,
        /// Its size, a multiple of the extent size (64GiB).
        #[arg(long, value_parser = size)]
        size: u64,
        /// Extent size, from 1MiB to 1GiB (default 64MiB).
        #[arg(long, value_parser = size)]
        extent_size: Option<u64>,
        #[command(flatten)]
        c: ControlArgs,
    },
    /// List the volumes.
    List {
        #[command(flatten)]
        c: ControlArgs,
    },
    /// Show a volume and its extent table: where each extent lies, or that it is unallocated.
    Info {
        /// The volume's name.
        name: String,
        #[command(flatten)]
        c: ControlArgs,
    },
    /// Grow a volume to a larger size.
    Grow {
        /// The volume's name.
        name: String,
        /// The new size, larger than the old and a multiple of the extent size.
        #[arg(long, value_parser = size)]
        size: u64,
        #[command(flatten)]
        c: ControlArgs,
    },
    /// Export a volume as a namespace of a subsystem of a target, for the hosts named.
    Export {
        /// The volume's name.
        name: String,
        /// The target to serve it: its I/O address as registered (`nearstore view` lists them).
        #[arg(long)]
        target: String,
        /// A host NQN allowed to connect (repeatable).
        #[arg(long = "allow-host", value_name = "NQN")]
        allow_host: Vec<String>,
        /// Let any host connect.
        #[arg(long)]
        allow_any_host: bool,
        #[command(flatten)]
        c: ControlArgs,
    },
    /// Stop exporting a volume: its target removes the subsystem.
    Unexport {
        /// The volume's name.
        name: String,
        #[command(flatten)]
        c: ControlArgs,
    },
    /// Delete a volume and free its extents (an exported volume is refused).
    Delete {
        /// The volume's name.
        name: String,
        #[command(flatten)]
        c: ControlArgs,
    },
    /// Spread a volume's extents over the targets: one extent at a time, from the target
    /// holding most of them to a pool of the one holding fewest, while that is two fewer.
    Rebalance {
        /// The volume's name.
        name: String,
        #[command(flatten)]
        m: MoveArgs,
    },
}

/// How `volume rebalance` and `pool drain` move extents.
#[derive(clap::Args)]
pub struct MoveArgs {
    /// Copy at most this many bytes per second per extent (default: no cap).
    #[arg(long, value_parser = size)]
    pub max_bps: Option<u64>,
    /// Move one extent after another until done, printing progress (else only the first
    /// move of a rebalance, or every move of a drain at once, is begun).
    #[arg(long)]
    pub wait: bool,
    #[command(flatten)]
    pub c: ControlArgs,
}

#[derive(clap::Subcommand)]
pub enum TenantCmd {
    /// Create a tenant: hosts, what they reach and their shares; pushed to every registered
    /// target (docs/operations.md, "Tenants from the control plane").
    Create {
        /// The tenant's name: letters, digits, '.', '_', '-' (not default or cluster).
        name: String,
        /// A host NQN of the tenant (repeatable; each in no other tenant).
        #[arg(long = "host", value_name = "NQN", required = true)]
        hosts: Vec<String>,
        /// Its share of I/O against other tenants, 1 to 10000.
        #[arg(long, default_value_t = nearstore_control::model::TENANT_WEIGHT_DEFAULT)]
        io_weight: u32,
        /// Its share of the offload engine's CPU time, 1 to 10000.
        #[arg(long, default_value_t = nearstore_control::model::TENANT_WEIGHT_DEFAULT)]
        compute_weight: u32,
        /// Memory its compute commands may hold together on a target (default: only the
        /// target's budget).
        #[arg(long, value_parser = size)]
        memory: Option<u64>,
        /// What it may reach: volume:NAME, or a subsystem NQN that a target's [cluster]
        /// control_grants lists (repeatable; none: nothing).
        #[arg(long, value_name = "SUBSYS|volume:NAME")]
        reach: Vec<String>,
        #[command(flatten)]
        c: ControlArgs,
    },
    /// List the tenants.
    List {
        #[command(flatten)]
        c: ControlArgs,
    },
    /// Show a tenant.
    Info {
        /// The tenant's name.
        name: String,
        #[command(flatten)]
        c: ControlArgs,
    },
    /// Delete a tenant: its hosts' controllers are torn down on every target.
    Delete {
        /// The tenant's name.
        name: String,
        #[command(flatten)]
        c: ControlArgs,
    },
}

/// One tenant in a line.
fn tenant_line(t: &Tenant) -> String {
    let memory = t.offload_memory.map_or("-".into(), bytes);
    let reach = if t.reach.is_empty() { "nothing".into() } else { t.reach.join(",") };
    format!("{:<20} {:>9} {:>9} {:>9}  {:<40} {}", t.name, t.io_weight, t.compute_weight, memory, reach, t.hosts.join(","))
}

pub async fn tenant(cmd: TenantCmd) -> Result<()> {
    let header = format!("{:<20} {:>9} {:>9} {:>9}  {:<40} hosts", "name", "io_weight", "cpu_weight", "memory", "reach");
    match cmd {
        TenantCmd::Create { name, hosts, io_weight, compute_weight, memory, reach, c } => {
            let req = Tenant { name, hosts, io_weight, compute_weight, offload_memory: memory, reach };
            let t = c.client()?.create_tenant(&req).await.map_err(plain)?;
            if c.output_format == Output::Json {
                return json(&t);
            }
            println!("tenant {}: {} hosts, io_weight {}, compute_weight {}", t.name, t.hosts.len(), t.io_weight, t.compute_weight);
        }
        TenantCmd::List { c } => {
            let ts = c.client()?.tenants(0).await.map_err(plain)?.tenants;
            if c.output_format == Output::Json {
                return json(&ts);
            }
            println!("{header}");
            for t in &ts {
                println!("{}", tenant_line(t));
            }
        }
        TenantCmd::Info { name, c } => {
            let t = c.client()?.tenant(&name).await.map_err(plain)?;
            if c.output_format == Output::Json {
                return json(&t);
            }
            println!("{header}\n{}", tenant_line(&t));
        }
        TenantCmd::Delete { name, c } => {
            c.client()?.delete_tenant(&name).await.map_err(plain)?;
            if c.output_format == Output::Json {
                return json(&serde_json::json!({ "deleted": name }));
            }
            println!("tenant {name} deleted");
        }
    }
    Ok(())
}

/// A tenant of the control plane as a target's `[[tenant]]` entry.
pub fn tenant_config(t: &Tenant) -> nearstore_target::tenant::TenantConfig {
    use nearstore_target::tenant::ReachConfig;
    let reach = t
        .reach
        .iter()
        .map(|r| {
            let (subsystem, volume) = match r.strip_prefix(nearstore_control::model::VOLUME_REACH_PREFIX) {
                Some(v) => (None, Some(v.to_string())),
                None => (Some(r.clone()), None),
            };
            ReachConfig { subsystem, volume, nsid: None, lbas: None, read_only: false }
        })
        .collect();
    nearstore_target::tenant::TenantConfig {
        name: t.name.clone(),
        hosts: t.hosts.clone(),
        io_weight: t.io_weight,
        compute_weight: t.compute_weight,
        offload_memory: t.offload_memory.map(nearstore_target::config::ByteSize),
        operations: None,
        reach,
    }
}

/// A target's side of the control plane's tenants (`target --control`).
pub struct TenantWatch {
    pub target: Arc<nearstore_target::Target>,
    pub client: Client,
}

impl TenantWatch {
    /// Runs forever: asks the control plane for the tenants (a long poll by version) and
    /// applies each new list beside the configured tenants, as a reload does. While the
    /// control plane is away, the tenants last applied stay.
    pub async fn run(self) {
        let (mut since, mut wait) = (0, 100);
        let mut applied: Option<Vec<Tenant>> = None;
        loop {
            let list = match self.client.tenants(since).await {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(control = %self.client.addr, error = %e, "cannot list the tenants; retrying");
                    tokio::time::sleep(std::time::Duration::from_millis(wait)).await;
                    wait = (wait * 2).min(nearstore_control::limits::AGENT_RETRY_MS_MAX);
                    continue;
                }
            };
            wait = 100;
            since = list.version;
            if applied.as_ref() == Some(&list.tenants) {
                continue;
            }
            let (gone, refused) = self.target.push_tenants(list.tenants.iter().map(tenant_config).collect());
            tracing::info!(
                tenants = list.tenants.len(),
                refused = refused.len(),
                controllers_torn_down = gone,
                "tenants of the control plane applied"
            );
            applied = Some(list.tenants);
        }
    }
}

#[derive(clap::Subcommand)]
pub enum PoolCmd {
    /// The pools: their target, size, extents and whether they are cordoned or stale.
    List {
        #[command(flatten)]
        c: ControlArgs,
    },
    /// Move every extent off a pool (NAME@TARGET), each to the pool the placement prefers;
    /// the pool is cordoned first (it takes no new extents until `pool uncordon`).
    Drain {
        /// The pool, as `nearstore view` names it: NAME@TARGET.
        pool: String,
        #[command(flatten)]
        m: MoveArgs,
    },
    /// Let a cordoned (drained) pool take new extents again.
    Uncordon {
        /// The pool: NAME@TARGET.
        pool: String,
        #[command(flatten)]
        c: ControlArgs,
    },
}

/// One extent moved (or begun) by `volume rebalance` or `pool drain`.
#[derive(serde::Serialize)]
struct Moved {
    volume: String,
    index: u64,
    from: String,
    to: String,
    /// Published (with --wait); false: begun only.
    published: bool,
    seconds: f64,
}

/// Moves extent `index` of `volume` to pool `to`, or where the placement prefers; with
/// `wait`, until its move ends (progress printed unless `json`). A move that ended without
/// its publication is an error naming where the extent stayed.
async fn move_one(client: &Client, volume: &str, index: u64, to: Option<String>, m: &MoveArgs) -> Result<Moved> {
    let json = m.c.output_format == Output::Json;
    let req = nearstore_control::model::MoveRequest { to, max_bps: m.max_bps.unwrap_or(0) };
    let mv = client.begin_move(volume, index, &req).await.map_err(plain)?;
    if !json {
        println!("extent {index} of {volume}: {} -> {}", mv.from, mv.to);
    }
    let started = std::time::Instant::now();
    let mut moved =
        Moved { volume: volume.into(), index, from: mv.from.to_string(), to: mv.to.to_string(), published: false, seconds: 0.0 };
    if !m.wait {
        return Ok(moved);
    }
    let mut copied = 0;
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        match client.get_move(volume, index).await {
            Ok(now) if now.state == MoveState::Aborted => {
                anyhow::bail!(
                    "the move of extent {index} of '{volume}' to {} was aborted ({}): the extent stays in {}",
                    now.to,
                    now.reason,
                    now.from
                );
            }
            Ok(now) => {
                if !json && now.copied != copied {
                    copied = now.copied;
                    println!("  {} of {} copied", bytes(copied), bytes(now.extent_size));
                }
            }
            Err(e) if e.code() == Some(ErrorCode::MoveNotFound) => break,
            Err(e) => return Err(plain(e)),
        }
    }
    let info = client.volume(volume).await.map_err(plain)?;
    let at = info.extents.iter().find(|e| e.index == index);
    if !at.is_some_and(|e| e.epoch > mv.epoch) {
        anyhow::bail!(
            "the move of extent {index} of '{volume}' to {} was aborted: the extent stays in {} (the copier's log says why)",
            mv.to,
            mv.from
        );
    }
    (moved.published, moved.seconds) = (true, started.elapsed().as_secs_f64());
    if !json {
        println!("  published in {:.1} s", moved.seconds);
    }
    Ok(moved)
}

fn moved_summary(what: &str, moved: &[Moved], json_out: bool) -> Result<()> {
    if json_out {
        return json(&serde_json::json!({ "what": what, "moves": moved }));
    }
    let published = moved.iter().filter(|m| m.published).count();
    println!("{what}: {published} extents moved, {} moves begun", moved.len() - published);
    Ok(())
}

/// `nearstore volume rebalance`.
async fn rebalance(name: String, m: MoveArgs) -> Result<()> {
    let client = m.c.client()?;
    let mut moved = Vec::new();
    let total = client.volume(&name).await.map_err(plain)?.extents_total;
    for _ in 0..total {
        let info = client.volume(&name).await.map_err(plain)?;
        let view = client.view(0).await.map_err(plain)?;
        let Some((index, to)) = nearstore_control::rebalance::rebalance_next(&info, &view) else { break };
        moved.push(move_one(&client, &name, index, Some(to.to_string()), &m).await?);
        if !m.wait {
            break;
        }
    }
    moved_summary(&format!("volume {name}"), &moved, m.c.output_format == Output::Json)
}

/// `nearstore pool list|drain|uncordon`.
pub async fn pool(cmd: PoolCmd) -> Result<()> {
    let (pool, m) = match cmd {
        PoolCmd::List { c } => return pool_list(c).await,
        PoolCmd::Uncordon { pool, c } => {
            let id = nearstore_control::state::parse_pool(&pool).map_err(|e| anyhow::anyhow!(e.message))?;
            let p = c.client()?.cordon(&id, false).await.map_err(plain)?;
            if c.output_format == Output::Json {
                return json(&p);
            }
            println!("pool {id} takes new extents");
            return Ok(());
        }
        PoolCmd::Drain { pool, m } => (pool, m),
    };
    let client = m.c.client()?;
    let id = nearstore_control::state::parse_pool(&pool).map_err(|e| anyhow::anyhow!(e.message))?;
    let view = client.view(0).await.map_err(plain)?;
    if !view.pools.iter().any(|p| p.pool == id.name && p.target == id.target) {
        anyhow::bail!("no pool {id}: `nearstore view` lists them");
    }
    let mut infos = Vec::new();
    for v in client.volumes().await.map_err(plain)? {
        infos.push(client.volume(&v.name).await.map_err(plain)?);
    }
    let list = nearstore_control::rebalance::drain_list(&id, &infos);
    nearstore_control::rebalance::drain_room(&id, &list, &view).map_err(anyhow::Error::msg)?;
    nearstore_control::rebalance::drain_handovers(&id, &infos).map_err(anyhow::Error::msg)?;
    if !m.wait {
        let under_way = client.moves(None, 0).await.map_err(plain)?.moves.len();
        nearstore_control::rebalance::drain_fits_moves(&id, list.len(), under_way).map_err(anyhow::Error::msg)?;
    }
    // Cordoned first: nothing new is placed there while its extents leave.
    client.cordon(&id, true).await.map_err(plain)?;
    let mut moved = Vec::new();
    for (volume, index, _) in list {
        moved.push(move_one(&client, &volume, index, None, &m).await?);
    }
    moved_summary(&format!("pool {id}"), &moved, m.c.output_format == Output::Json)
}

/// An API error in the user's terms, its code in the detail (-v, and in JSON errors).
fn plain(e: ClientError) -> anyhow::Error {
    match e {
        ClientError::Api(a) => anyhow::Error::new(Plain { said: a.message, detail: a.code.to_string() }),
        e => anyhow::Error::new(e),
    }
}

/// The view agent of a target started with a control plane: its pools made (or grown) now,
/// its address filled in once it listens.
pub fn agent(cfg: &nearstore_target::config::Config, control: &str) -> Result<Agent> {
    let client = client(control).context("control")?;
    let mut pools = Vec::new();
    for (i, p) in cfg.pool.iter().enumerate() {
        nearstore_control::agent::prepare_pool(&p.path, p.size.0)?;
        let path = std::fs::canonicalize(&p.path).with_context(|| format!("pool {}", p.path.display()))?;
        // The pool subsystem numbers the pools from 1 in this order (nearstore_target::POOLS_NQN).
        let (bandwidth, write_cost) = p.fair.as_ref().map_or((0, 0.0), |f| (f.bandwidth.0, f.write_cost));
        pools.push(AgentPool {
            name: p.name(),
            path,
            size: p.size.0,
            nsid: i as u32 + 1,
            bandwidth,
            write_cost,
            stats: Default::default(),
        });
    }
    // Its first subsystem's; a target that serves only volumes has none: its pool
    // subsystem's, or (no pools either: an exporter only) its member NQN.
    let nqn = match cfg.subsystem.first() {
        Some(s) => s.nqn.clone(),
        None if !cfg.pool.is_empty() => nearstore_target::POOLS_NQN.to_string(),
        None => cfg.cluster.host_nqn.clone().unwrap_or_else(nearstore_initiator::default_hostnqn),
    };
    let compute_timeout = std::time::Duration::from_secs(cfg.compute.timeout_secs);
    let write_bound_ms = cfg.cluster.write_bound(compute_timeout).as_millis() as u64;
    let incarnation = nearstore_target::cluster::incarnation();
    Ok(Agent { client, addr: String::new(), nqn, pools, links: Default::default(), write_bound_ms, incarnation })
}

/// Feeds each pool's view from its namespace in the target's pool subsystem: the reads and
/// writes that reach it over NVMe/TCP (every peer's volume I/O, and any member's), counted
/// where they complete.
pub fn feed(agent: &Agent, target: &Arc<nearstore_target::Target>) {
    use nearstore_control::agent::Counters;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    // (reads, writes, read bytes, written bytes, read ns, write ns) as the agent takes them.
    let counters = |[r, w, rb, wb, rns, wns]: [&AtomicU64; 6]| Counters {
        reads: r.load(Relaxed),
        writes: w.load(Relaxed),
        read_bytes: rb.load(Relaxed),
        write_bytes: wb.load(Relaxed),
        read_ns: rns.load(Relaxed),
        write_ns: wns.load(Relaxed),
    };
    // The links: what this target's volumes moved to each peer (counted by dev::remote).
    let links = target.links.clone();
    agent.attach_links(Box::new(move || {
        links
            .snapshot()
            .into_iter()
            .map(|(peer, s)| (peer.to_string(), counters([&s.reads, &s.writes, &s.read_bytes, &s.write_bytes, &s.read_ns, &s.write_ns])))
            .collect()
    }));
    let Some(sub) = target.subsystem(nearstore_target::POOLS_NQN) else { return };
    for p in &agent.pools {
        let Some(ns) = sub.namespace(p.nsid) else { continue };
        p.stats.attach(Box::new(move || {
            let s = &ns.stats;
            counters([&s.reads, &s.writes, &s.read_bytes, &s.written_bytes, &s.read_ns, &s.write_ns])
        }));
    }
}

/// The translation service of one volume, as its data path on a target asks it.
struct ControlResolver {
    client: Client,
    volume: String,
}

/// The status an I/O fails with when the control plane cannot say where an extent lies:
/// unreachable or failing to commit, Namespace Not Ready (the host retries); out of space,
/// Capacity Exceeded (a thin namespace that cannot grow, not retried); anything else is an
/// internal error (the volume went away under its export).
fn resolve_error(e: ClientError) -> ResolveError {
    use nearstore_wire::Status;
    let status = match e.code() {
        None | Some(ErrorCode::StoreFailed) => Status::NAMESPACE_NOT_READY,
        Some(ErrorCode::NoSpace) => Status::CAPACITY_EXCEEDED.dnr(),
        Some(_) => Status::INTERNAL_ERROR.dnr(),
    };
    ResolveError { status, message: format!("control plane: {e}") }
}

fn location(e: &ExtentInfo) -> Location {
    Location { target: e.target.clone(), nsid: e.nsid, offset: e.offset, epoch: e.epoch, unwritten: e.unwritten }
}

impl Resolver for ControlResolver {
    fn translate(&self, index: u64) -> BoxFuture<'_, Result<Lookup, ResolveError>> {
        Box::pin(async move {
            let t = self.client.translate(&self.volume, index).await.map_err(resolve_error)?;
            Ok(t.extent.as_ref().map_or(Lookup::Unallocated, |e| Lookup::Allocated(location(e))))
        })
    }

    fn allocate(&self, index: u64) -> BoxFuture<'_, Result<Location, ResolveError>> {
        Box::pin(async move { self.client.allocate(&self.volume, index).await.map(|e| location(&e)).map_err(resolve_error) })
    }

    fn written(&self, index: u64) -> BoxFuture<'_, Result<(), ResolveError>> {
        Box::pin(async move { self.client.mark_written(&self.volume, index).await.map(drop).map_err(resolve_error) })
    }

    fn allocated(&self) -> BoxFuture<'_, Result<Vec<(u64, Location)>, ResolveError>> {
        Box::pin(async move {
            let info = self.client.volume(&self.volume).await.map_err(resolve_error)?;
            Ok(info.extents.iter().map(|e| (e.index, location(e))).collect())
        })
    }
}

/// What a target needs to serve the volumes exported to it.
pub struct Exporter {
    pub target: Arc<nearstore_target::Target>,
    /// What this target declared at registration ([`Agent::write_bound_ms`]).
    pub write_bound_ms: u64,
    pub client: Client,
    /// This target's address, as registered.
    pub addr: String,
    pub cluster: nearstore_target::cluster::ClusterConfig,
    pub volume: nearstore_target::config::VolumeConfig,
}

impl Exporter {
    /// Runs forever: asks the control plane for this target's exports (a long poll by
    /// version), adds a subsystem for each new one and removes those that went. A failed
    /// export is retried at the next answer (at most EXPORTS_WAIT_MS later).
    pub async fn run(self) {
        let mut devices = PoolDevices::new(&self.target, self.addr.clone(), &self.cluster);
        if self.volume.arbiter {
            self.target.gates.set_own(self.addr.clone());
            devices = devices.gated(self.target.gates.clone());
            // Its pool connections' host NQN: how the pools' schedulers know its operations.
            let member = self.cluster.host_nqn.clone().unwrap_or_else(nearstore_initiator::default_hostnqn);
            tokio::spawn(arbitrate(self.client.clone(), self.addr.clone(), member, self.target.gates.clone()));
        }
        let member = self.cluster.host_nqn.clone().unwrap_or_else(nearstore_initiator::default_hostnqn);
        let timeout = std::time::Duration::from_secs(self.cluster.timeout_secs);
        tokio::spawn(fence_earlier(self.client.clone(), self.addr.clone(), member, timeout));
        let devices = Arc::new(devices);
        let local = Arc::new(Served::default());
        let ctl = Arc::new(ControlMoves { client: self.client.clone(), addr: self.addr.clone() });
        let cfg = MoverConfig {
            report_every: std::time::Duration::from_millis(nearstore_control::limits::MOVE_REPORT_MS),
            retry_max: std::time::Duration::from_millis(nearstore_control::limits::AGENT_RETRY_MS_MAX),
            bug: None,
        };
        let mover = Arc::new(Mover::new(ctl, devices.clone(), local.clone(), self.target.pool.clone(), cfg));
        tokio::spawn(mover.run());
        let mut served: std::collections::BTreeMap<String, (Export, Volume)> = Default::default();
        // Every instance of a volume this target stopped serving, and the task releasing
        // them (docs/control-plane.md, "Handing an export over"): a release waits for all
        // of the volume's, and a volume served again stops its release.
        let mut retired: HashMap<String, Retired> = HashMap::new();
        // Exports stopped when the lease ran out, and exports listed that could not be
        // served: released once an answer no longer lists them.
        let mut lapsed: Vec<Export> = Vec::new();
        let mut unserved: HashMap<String, Export> = HashMap::new();
        let (mut since, mut wait) = (0, 100);
        // Until when this target may serve its exports without a newer answer (its export
        // lease); None: nothing served under a lease. The volumes check it too, where they
        // issue operations.
        let mut lease: Option<tokio::time::Instant> = None;
        // The longest lease granted: with the write bound, when the control plane has ended
        // a handover by itself whatever this target says.
        let mut granted = std::time::Duration::ZERO;
        loop {
            if lease.is_some_and(|end| tokio::time::Instant::now() >= end) {
                lease = None;
                since = 0;
                for (_, (x, vol)) in std::mem::take(&mut served) {
                    self.stop_serving(&x, vol, &local, &mut retired);
                    tracing::warn!(volume = %x.volume, "export lease ran out without an answer from the control plane: \
                                   the volume is not served until it answers");
                    lapsed.push(x);
                }
            }
            let sent = tokio::time::Instant::now();
            let asked = self.client.exports(&self.addr, since, nearstore_target::cluster::incarnation());
            let answer = match lease {
                Some(end) => tokio::time::timeout_at(end, asked).await.ok(),
                None => Some(asked.await),
            };
            let list = match answer {
                Some(Ok(l)) => l,
                // The lease ran out while asking: stopped at the top of the loop.
                None => continue,
                Some(Err(e)) => {
                    if e.code() == Some(ErrorCode::StaleIncarnation) {
                        // Not registered as this process yet: the agent is at it.
                        tracing::debug!(control = %self.client.addr, error = %e, "exports asked before this process registered; retrying");
                    } else {
                        tracing::warn!(control = %self.client.addr, error = %e, "cannot list this target's exports; retrying");
                    }
                    let pause = tokio::time::Instant::now() + std::time::Duration::from_millis(wait);
                    tokio::time::sleep_until(lease.map_or(pause, |end| end.min(pause))).await;
                    wait = (wait * 2).min(nearstore_control::limits::AGENT_RETRY_MS_MAX);
                    continue;
                }
            };
            wait = 100;
            since = list.version;
            // A control plane that grants no lease (0) predates them: served until told.
            lease = (list.lease_ms > 0).then(|| sent + std::time::Duration::from_millis(list.lease_ms));
            granted = granted.max(std::time::Duration::from_millis(list.lease_ms));
            if let Some(end) = lease {
                for (_, vol) in served.values() {
                    vol.set_lease(end.into_std());
                }
            }
            let listed = |x: &Export| list.exports.iter().any(|y| y.volume == x.volume && y.epoch == x.epoch);
            let mut ended: Vec<Export> = std::mem::take(&mut lapsed).into_iter().filter(|x| !listed(x)).collect();
            ended.extend(unserved.values().filter(|x| !listed(x)).cloned());
            unserved.retain(|_, x| listed(x));
            let gone: Vec<String> = served.iter().filter(|(_, (x, _))| !list.exports.contains(x)).map(|(v, _)| v.clone()).collect();
            for name in gone {
                let Some((x, vol)) = served.remove(&name) else { continue };
                self.stop_serving(&x, vol, &local, &mut retired);
                tracing::info!(volume = %x.volume, nqn = %x.nqn, "volume no longer exported");
                ended.push(x);
            }
            for x in ended {
                let r = retired.entry(x.volume.clone()).or_default();
                if let Some(t) = r.task.take() {
                    t.abort();
                }
                let give_up = std::time::Duration::from_millis(self.write_bound_ms) + granted;
                r.task = Some(tokio::spawn(release(self.client.clone(), self.addr.clone(), x, r.vols.clone(), give_up)));
            }
            for x in list.exports {
                if served.contains_key(&x.volume) {
                    continue;
                }
                // Served again: its earlier instances' release (for an export that did not
                // end after all) stops; a later one waits for them too.
                if let Some(t) = retired.get_mut(&x.volume).and_then(|r| r.task.take()) {
                    t.abort();
                }
                // Within the lease: a control plane that stops answering here does not
                // keep this loop from stopping what it serves.
                let serving = self.serve(&x, devices.clone(), &local, lease);
                let done = match lease {
                    Some(end) => {
                        tokio::time::timeout_at(end, serving).await.unwrap_or_else(|_| Err(anyhow::anyhow!("the export lease ran out")))
                    }
                    None => serving.await,
                };
                match done {
                    Ok(vol) => {
                        tracing::info!(volume = %x.volume, nqn = %x.nqn, "volume exported");
                        unserved.remove(&x.volume);
                        served.insert(x.volume.clone(), (x, vol));
                    }
                    Err(e) => {
                        tracing::warn!(volume = %x.volume, error = %e, "cannot export the volume");
                        unserved.insert(x.volume.clone(), x);
                    }
                }
            }
        }
    }

    /// Stops serving a volume: nothing of it starts on a pool any more, and its subsystem
    /// goes with its controllers (their commands are cancelled); the instance is retired,
    /// for a release to wait for.
    fn stop_serving(&self, x: &Export, vol: Volume, local: &Served, retired: &mut HashMap<String, Retired>) {
        vol.fence();
        local.unserve(&x.volume);
        self.target.remove_subsystem(&x.nqn);
        retired.entry(x.volume.clone()).or_default().vols.lock().push(vol);
    }

    async fn serve(&self, x: &Export, devices: Arc<PoolDevices>, local: &Served, lease: Option<tokio::time::Instant>) -> Result<Volume> {
        let info = self.client.volume(&x.volume).await?;
        let v = &info.volume;
        let cfg = VolumeConfig {
            name: v.name.clone(),
            size: v.size,
            extent_size: v.extent_size,
            cache_entries: self.volume.cache_entries,
            timeout: std::time::Duration::from_millis(self.volume.translate_timeout_ms),
        };
        let resolver = Arc::new(ControlResolver { client: self.client.clone(), volume: v.name.clone() });
        let vol = Volume::new(cfg, resolver, devices, self.target.pool.clone());
        if let Some(end) = lease {
            vol.set_lease(end.into_std());
        }
        let mut ns = Namespace::new(&x.nqn, x.nsid, vol.backend(), nearstore_target::limits::VOLUME_BLOCK_BYTES);
        ns.volume = Some(vol.stats().clone());
        ns.placement = Some(vol.clone());
        ns.dev = Arc::new(vol.clone());
        // Before it serves: extents this target is moving are blocked on it too.
        local.serve(&x.volume, Arc::new(vol.clone()));
        let sub = Subsystem::new(&x.nqn, None, Some("nearstore volume"), x.allow_any_host, &x.hosts);
        sub.add_namespace(ns).map_err(anyhow::Error::msg)?;
        // Exported again with other hosts: the old subsystem goes, with its controllers.
        self.target.remove_subsystem(&x.nqn);
        self.target.add_subsystem(sub);
        Ok(vol)
    }
}

/// Once this process is the target's registered one, and the control plane says its
/// earlier processes may still write (`Target::unfenced`): fences them at the pool
/// subsystem of every other target with a pool (Fence Host Instances,
/// `nearstore_target::cluster::fenced`, which this process's first connection to each does
/// anyway), then tells the control plane, which lets the volumes waiting for them go on
/// (docs/control-plane.md, "A restarted exporter"). Tried again until it is heard, or
/// until there is nothing to fence or their bound passed. A peer that cannot fence (not a
/// nearstore target) leaves them to their bound: it is not said.
async fn fence_earlier(client: Client, addr: String, member: String, timeout: std::time::Duration) {
    use nearstore_target::cluster::Fence;
    let me = nearstore_target::cluster::incarnation();
    let retry = std::time::Duration::from_millis(nearstore_control::limits::AGENT_RETRY_MS_MAX);
    loop {
        let attempt = async {
            let view = client.view(0).await?;
            let Some(t) = view.targets.iter().find(|t| t.addr == addr && t.incarnation == me) else {
                anyhow::bail!("this process is not the one registered for {addr} yet");
            };
            let now = nearstore_control::server::now_ms();
            if t.unfenced.as_ref().is_none_or(|u| u.seconds_left(now).is_none()) {
                return Ok(None);
            }
            let mut with_pools: Vec<&str> = view.pools.iter().map(|p| p.target.as_str()).filter(|t| *t != addr).collect();
            with_pools.sort_unstable();
            with_pools.dedup();
            let mut fences = tokio::task::JoinSet::new();
            for t in with_pools {
                let at = t.parse::<SocketAddr>().map_err(|_| anyhow::anyhow!("target {t} is not an address"))?;
                let (member, t) = (member.clone(), t.to_string());
                fences.spawn(async move {
                    let r = nearstore_target::cluster::fenced(at, nearstore_target::POOLS_NQN, &member, &member, timeout).await;
                    r.map_err(|e| format!("{t}: {}", e.message)).map(|f| (t, f))
                });
            }
            let (mut failed, mut unsupported) = (Vec::new(), Vec::new());
            while let Some(r) = fences.join_next().await {
                match r.map_err(|e| e.to_string()).and_then(|r| r) {
                    Ok((t, Fence::Unsupported)) => unsupported.push(t),
                    // Asked again until the bound (its configuration may change).
                    Ok((t, Fence::Refused)) => failed.push(format!("{t}: it refuses this member")),
                    Ok(_) => {}
                    Err(e) => failed.push(e),
                }
            }
            anyhow::ensure!(failed.is_empty(), "not fenced at {}", failed.join("; "));
            if !unsupported.is_empty() {
                return Ok(Some(format!(
                    "not said: {} cannot fence (not nearstore targets): the bound ends the wait",
                    unsupported.join(", ")
                )));
            }
            client.fenced(&addr, me).await?;
            Ok(Some("told the control plane".to_string()))
        };
        match attempt.await {
            Ok(None) => return,
            Ok(Some(outcome)) => {
                tracing::info!(incarnation = me, "this target's earlier processes are fenced at every target with a pool: {outcome}");
                return;
            }
            Err(e) => tracing::warn!(error = %e, "cannot fence this target's earlier processes yet; retrying"),
        }
        tokio::time::sleep(retry).await;
    }
}

/// A volume's instances this target stopped serving, and the task releasing them.
#[derive(Default)]
struct Retired {
    vols: Arc<parking_lot::Mutex<Vec<Volume>>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Once nothing any fenced instance of the volume issued can still change its pools'
/// storage, tells the control plane that this target stopped writing it for export `x`,
/// which may then let another target export it; tried again until it is heard, the
/// volume is gone, or `give_up` passed (by then the control plane ended the handover by
/// itself: the target's write bound and lease). The instances waited for are forgotten
/// once it is heard.
async fn release(client: Client, addr: String, x: Export, vols: Arc<parking_lot::Mutex<Vec<Volume>>>, give_up: std::time::Duration) {
    let retry = std::time::Duration::from_millis(nearstore_control::limits::AGENT_RETRY_MS_MAX);
    let until = tokio::time::Instant::now() + give_up;
    let name = x.volume.clone();
    let quiesced = async {
        loop {
            let all: Vec<Volume> = vols.lock().clone();
            let mut failed = None;
            for v in &all {
                if let Err(e) = v.released().await {
                    failed = Some(e);
                    break;
                }
            }
            match failed {
                None => return all.len(),
                Some(e) => tracing::warn!(volume = %name, error = %e, "waiting for the unexported volume's pool writes to end; retrying"),
            }
            tokio::time::sleep(retry).await;
        }
    };
    let Ok(waited) = tokio::time::timeout_at(until, quiesced).await else { return };
    loop {
        if tokio::time::Instant::now() >= until {
            return;
        }
        match client.released(&name, &addr, x.epoch, nearstore_target::cluster::incarnation()).await {
            Ok(()) => {
                tracing::info!(volume = %name, "told the control plane that this target no longer writes to the volume");
                vols.lock().drain(..waited);
                return;
            }
            Err(e) if e.code() == Some(ErrorCode::VolumeNotFound) => return,
            Err(e) => {
                tracing::warn!(volume = %name, error = %e, "cannot tell the control plane that the volume is released; retrying");
                tokio::time::sleep(retry).await;
            }
        }
    }
}

/// Asks the control plane's arbiter, every period, for this target's tenants' shares of the
/// pools its volumes reach, and sets their gates (nearstore_target::dev::grant). A request
/// that fails or is not answered within a period changes nothing: the grants run out after
/// their TTL and the tenants fall back to the pools' local fair sharing. A target whose
/// tenants offered nothing asks too (its clients leave the books, and an answer tells its
/// own pools that the arbiter divides them: `Gates::arbitrated`).
async fn arbitrate(client: Client, addr: String, member: String, gates: Arc<nearstore_target::dev::grant::Gates>) {
    use nearstore_control::limits::{ARBITER_GRANT_TTL_MS, ARBITER_PERIOD_MS};
    use nearstore_target::dev::grant::{GrantIn, PeerIn};
    use std::sync::atomic::Ordering::Relaxed;
    let period = std::time::Duration::from_millis(ARBITER_PERIOD_MS);
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tick.tick().await;
        let asked = gates.take();
        let demands = asked
            .iter()
            .map(|o| nearstore_control::model::Demand {
                pool_target: o.pool_target.clone(),
                nsid: o.nsid,
                tenant: o.tenant.clone(),
                weight: o.weight,
                wanted_bps: o.bps,
                backlogged: o.backlogged,
            })
            .collect();
        let req = nearstore_control::model::BandwidthRequest { target: addr.clone(), demands, member: member.clone() };
        gates.stats.requests.fetch_add(1, Relaxed);
        let why = match tokio::time::timeout(period, client.arbitrate(&req)).await {
            Ok(Ok(g)) => {
                if failing {
                    tracing::info!(control = %client.addr, "the arbiter answers again");
                    failing = false;
                }
                let grants: Vec<GrantIn> = g
                    .grants
                    .into_iter()
                    .map(|g| GrantIn {
                        pool_target: g.pool_target,
                        nsid: g.nsid,
                        tenant: g.tenant,
                        bps: g.bps,
                        batch_bytes: g.batch_bytes,
                        write_cost: g.write_cost,
                        pool_bps: g.pool_bps,
                    })
                    .collect();
                let peers: Vec<PeerIn> =
                    g.peers.into_iter().map(|p| PeerIn { nsid: p.nsid, member: p.member, bps: p.bps, pool_bps: p.pool_bps }).collect();
                let ttl = g.ttl_ms.clamp(ARBITER_PERIOD_MS, ARBITER_GRANT_TTL_MS);
                gates.apply(&asked, &grants, &peers, std::time::Duration::from_millis(ttl));
                continue;
            }
            Ok(Err(e)) => format!("the arbiter refused this target's request: {e}"),
            Err(_) => "the arbiter did not answer within a period".to_string(),
        };
        gates.stats.failures.fetch_add(1, Relaxed);
        if !failing {
            tracing::warn!(control = %client.addr, "{why}; its grants run out and the pools' local fair sharing takes over");
            failing = true;
        }
    }
}

/// The copier's words, through the API: the control plane's side of [`Mover`].
struct ControlMoves {
    client: Client,
    /// This target's address, as registered.
    addr: String,
}

fn order(m: &Move) -> MoveOrder {
    let at = |target: &str, nsid, offset| Location { target: target.to_string(), nsid, offset, epoch: m.epoch, unwritten: false };
    MoveOrder {
        id: m.id,
        volume: m.volume.clone(),
        index: m.index,
        epoch: m.epoch,
        from_name: m.from.to_string(),
        to_name: m.to.to_string(),
        from: at(&m.from.target, m.from_nsid, m.from_offset),
        to: at(&m.to.target, m.to_nsid, m.to_offset),
        extent_size: m.extent_size,
        max_bps: m.max_bps,
        aborted: m.state == MoveState::Aborted,
    }
}

/// A call's error; `NotFound` when the control plane has no such move (the mover's sign that
/// it ended).
fn io_error(e: ClientError) -> std::io::Error {
    let kind = if e.code() == Some(ErrorCode::MoveNotFound) { std::io::ErrorKind::NotFound } else { std::io::ErrorKind::Other };
    std::io::Error::new(kind, e.to_string())
}

impl MoveControl for ControlMoves {
    fn moves(&self, since: u64) -> BoxFuture<'_, std::io::Result<(u64, Vec<MoveOrder>)>> {
        Box::pin(async move {
            let l = self.client.moves(Some(&self.addr), since).await.map_err(io_error)?;
            Ok((l.version, l.moves.iter().map(order).collect()))
        })
    }

    fn report<'a>(&'a self, m: &'a MoveOrder, ack: bool, copied: u64) -> BoxFuture<'a, std::io::Result<()>> {
        Box::pin(async move {
            let r = MoveReport { id: m.id, epoch: m.epoch, copied, reason: String::new() };
            self.client.report_move(&m.volume, m.index, if ack { "ack" } else { "progress" }, &r).await.map(drop).map_err(io_error)
        })
    }

    fn publish<'a>(&'a self, m: &'a MoveOrder, copied: u64) -> BoxFuture<'a, std::io::Result<()>> {
        Box::pin(async move {
            let r = MoveReport { id: m.id, epoch: m.epoch, copied, reason: String::new() };
            self.client.publish_move(&m.volume, m.index, &r).await.map(drop).map_err(io_error)
        })
    }

    fn abort<'a>(&'a self, m: &'a MoveOrder, reason: &'a str) -> BoxFuture<'a, std::io::Result<()>> {
        Box::pin(async move {
            let r = MoveReport { id: m.id, epoch: m.epoch, copied: 0, reason: reason.to_string() };
            self.client.abort_move(&m.volume, m.index, &r).await.map_err(io_error)
        })
    }
}

/// A `--pool PATH:SIZE` (the last ':' splits, so a path may hold one).
pub fn pool_arg(s: &str) -> Result<nearstore_target::config::PoolConfig, String> {
    let (path, sz) = s.rsplit_once(':').ok_or_else(|| format!("'{s}' is not PATH:SIZE"))?;
    if path.is_empty() {
        return Err(format!("'{s}' names no file"));
    }
    Ok(nearstore_target::config::PoolConfig {
        name: None,
        path: path.into(),
        size: nearstore_target::config::ByteSize(size(sz)?),
        rate_limit: None,
        fair: None,
    })
}

/// Where `nearstore control` keeps its state.
pub enum State {
    Redb(PathBuf),
    Etcd(nearstore_control::etcd::Options),
}

/// `nearstore control`: serves the API until SIGINT or SIGTERM (with etcd, as the leader or
/// a standby).
pub async fn daemon(state: State, listen: SocketAddr, token: Option<server::Token>, export_lease_ms: u64) -> Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let (mut term, mut int) = (signal(SignalKind::terminate())?, signal(SignalKind::interrupt())?);
    let stop = async move {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
    };
    match state {
        State::Redb(store) => {
            let st = tokio::task::spawn_blocking(move || RedbStore::open(&store).and_then(|s| Service::open(Box::new(s))))
                .await??
                .with_export_lease_ms(export_lease_ms);
            let l = bind(listen).await?;
            tokio::select! {
                r = server::serve_with(l, Arc::new(st), token) => r.context("control plane server")?,
                () = stop => {}
            }
        }
        State::Etcd(opts) => nearstore_control::etcd::serve(bind(listen).await?, opts, stop).await.context("control plane on etcd")?,
    }
    Ok(())
}

/// The API's listener, its address said on stdout.
async fn bind(listen: SocketAddr) -> Result<tokio::net::TcpListener> {
    let l = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("control: cannot listen on {listen}"))?;
    let addr = l.local_addr()?;
    tracing::info!(%addr, "control plane serving");
    println!("listening on {addr}");
    Ok(l)
}

fn json(v: &impl serde::Serialize) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

fn bytes(n: u64) -> String {
    const UNITS: [(&str, u64); 4] = [("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (u, b) in UNITS {
        if n >= b && n.is_multiple_of(b) {
            return format!("{}{u}", n / b);
        }
        if n >= b {
            return format!("{:.1}{u}", n as f64 / b as f64);
        }
    }
    format!("{n}B")
}

/// `nearstore view`.
pub async fn view(c: ControlArgs) -> Result<()> {
    let v = c.client()?.view(0).await.map_err(plain)?;
    if c.output_format == Output::Json {
        return json(&v);
    }
    println!("view version {}: {} targets, {} pools", v.version, v.targets.len(), v.pools.len());
    println!(
        "{:<12} {:<22} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7} {:>6} {:>7}  path",
        "pool", "target", "size", "alloc", "fs free", "rd MB/s", "wr MB/s", "rd iops", "wr iops", "qd", "version"
    );
    for p in &v.pools {
        let f = p.view.as_ref().map(|w| &w.figures);
        let g = |x: Option<f64>, scale: f64| x.map_or("-".to_string(), |x| format!("{:.1}", x / scale));
        println!(
            "{:<12} {:<22} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7} {:>6} {:>7}  {}{}",
            p.pool,
            p.target,
            bytes(p.size),
            bytes(p.allocated),
            f.map_or("-".into(), |f| bytes(f.fs_free_bytes)),
            g(f.map(|f| f.read_bps), 1e6),
            g(f.map(|f| f.write_bps), 1e6),
            g(f.map(|f| f.read_iops), 1.0),
            g(f.map(|f| f.write_iops), 1.0),
            g(f.map(|f| f.queue_depth), 1.0),
            p.view.as_ref().map_or("-".into(), |w| w.version.to_string()),
            p.path,
            marks(p),
        );
    }
    if !v.links.is_empty() {
        println!();
        println!(
            "{:<22} {:<22} {:>9} {:>9} {:>7} {:>7} {:>9} {:>9} {:>6}",
            "link from", "to", "rd MB/s", "wr MB/s", "rd iops", "wr iops", "rd lat us", "wr lat us", "qd"
        );
        for l in &v.links {
            let f = &l.figures;
            println!(
                "{:<22} {:<22} {:>9.1} {:>9.1} {:>7.0} {:>7.0} {:>9.0} {:>9.0} {:>6.1}{}",
                l.from,
                l.to,
                f.read_bps / 1e6,
                f.write_bps / 1e6,
                f.read_iops,
                f.write_iops,
                f.read_latency_us,
                f.write_latency_us,
                f.queue_depth,
                if l.stale { " (stale)" } else { "" }
            );
        }
    }
    Ok(())
}

/// " (stale)", " (cordoned)", both or nothing.
fn marks(p: &nearstore_control::model::PoolView) -> String {
    format!("{}{}", if p.stale { " (stale)" } else { "" }, if p.cordoned { " (cordoned)" } else { "" })
}

/// `nearstore pool list`.
async fn pool_list(c: ControlArgs) -> Result<()> {
    let v = c.client()?.view(0).await.map_err(plain)?;
    if c.output_format == Output::Json {
        return json(&v.pools);
    }
    println!("{:<28} {:>9} {:>9} {:>7}  path", "pool", "size", "alloc", "extents");
    for p in &v.pools {
        let name = format!("{}@{}", p.pool, p.target);
        println!("{name:<28} {:>9} {:>9} {:>7}  {}{}", bytes(p.size), bytes(p.allocated), p.extents, p.path, marks(p));
    }
    Ok(())
}

/// The extent table in lines: allocated extents one a line, runs of unallocated ones as one.
fn extent_lines(info: &VolumeInfo) -> Vec<String> {
    let mut out = Vec::new();
    let mut next = 0u64;
    let gap = |from: u64, to: u64, out: &mut Vec<String>| match to - from {
        0 => {}
        1 => out.push(format!("{from:>8}  unallocated")),
        _ => out.push(format!("{from:>8}  to {}  unallocated", to - 1)),
    };
    for e in &info.extents {
        gap(next, e.index, &mut out);
        let ExtentInfo { index, pool, target, path, offset, epoch, .. } = e;
        out.push(format!("{index:>8}  {pool}@{target}  {path} +{offset}  epoch {epoch}"));
        next = index + 1;
    }
    gap(next, info.extents_total, &mut out);
    out
}

pub async fn volume(cmd: VolumeCmd) -> Result<()> {
    match cmd {
        VolumeCmd::Rebalance { name, m } => rebalance(name, m).await?,
        VolumeCmd::Create { name, size, extent_size, c } => {
            let v = c.client()?.create_volume(&nearstore_control::model::CreateVolume { name, size, extent_size }).await.map_err(plain)?;
            if c.output_format == Output::Json {
                return json(&v);
            }
            println!("volume {}: {} in {} extents of {}", v.name, bytes(v.size), v.extents(), bytes(v.extent_size));
        }
        VolumeCmd::List { c } => {
            let vs = c.client()?.volumes().await.map_err(plain)?;
            if c.output_format == Output::Json {
                return json(&vs);
            }
            println!("{:<24} {:>10} {:>10} {:>8}", "name", "size", "extent", "extents");
            for v in vs {
                println!("{:<24} {:>10} {:>10} {:>8}", v.name, bytes(v.size), bytes(v.extent_size), v.extents());
            }
        }
        VolumeCmd::Info { name, c } => {
            let info = c.client()?.volume(&name).await.map_err(plain)?;
            if c.output_format == Output::Json {
                return json(&info);
            }
            let v = &info.volume;
            println!(
                "volume {}: {}, extents of {}, {} of {} allocated",
                v.name,
                bytes(v.size),
                bytes(v.extent_size),
                info.extents_allocated,
                info.extents_total
            );
            for l in extent_lines(&info) {
                println!("{l}");
            }
        }
        VolumeCmd::Grow { name, size, c } => {
            let v = c.client()?.grow_volume(&name, size).await.map_err(plain)?;
            if c.output_format == Output::Json {
                return json(&v);
            }
            println!("volume {}: {} in {} extents", v.name, bytes(v.size), v.extents());
        }
        VolumeCmd::Export { name, target, allow_host, allow_any_host, c } => {
            let req = ExportVolume { target, hosts: allow_host, allow_any_host };
            let x = c.client()?.export(&name, &req).await.map_err(plain)?;
            if c.output_format == Output::Json {
                return json(&x);
            }
            println!("volume {} exported by {} as {} nsid {}", x.volume, x.target, x.nqn, x.nsid);
        }
        VolumeCmd::Unexport { name, c } => {
            c.client()?.unexport(&name).await.map_err(plain)?;
            if c.output_format == Output::Json {
                return json(&serde_json::json!({ "unexported": name }));
            }
            println!("volume {name} unexported");
        }
        VolumeCmd::Delete { name, c } => {
            c.client()?.delete_volume(&name).await.map_err(plain)?;
            if c.output_format == Output::Json {
                return json(&serde_json::json!({ "deleted": name }));
            }
            println!("volume {name} deleted");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use nearstore_control::model::Volume;

    #[test]
    fn extent_tables_show_unallocated_runs() {
        let e = |index| ExtentInfo {
            index,
            pool: "p".into(),
            target: "t:1".into(),
            path: "/x".into(),
            offset: index << 20,
            epoch: 1,
            nsid: 1,
            unwritten: false,
        };
        let info = |total, extents: Vec<ExtentInfo>| VolumeInfo {
            volume: Volume { name: "v".into(), size: total << 20, extent_size: 1 << 20, created_ms: 0, handover: None },
            extents_total: total,
            extents_allocated: extents.len() as u64,
            extents,
            in_doubt: None,
        };
        #[rustfmt::skip]
        let cases: Vec<(VolumeInfo, Vec<&str>)> = vec![
            (info(1, vec![]), vec!["       0  unallocated"]),
            (info(4, vec![]), vec!["       0  to 3  unallocated"]),
            (info(4, vec![e(0), e(3)]), vec!["       0  p@t:1  /x +0  epoch 1", "       1  to 2  unallocated", "       3  p@t:1  /x +3145728  epoch 1"]),
            (info(3, vec![e(1)]), vec!["       0  unallocated", "       1  p@t:1  /x +1048576  epoch 1", "       2  unallocated"]),
        ];
        for (i, expected) in cases {
            assert_eq!(extent_lines(&i), expected);
        }
    }

    #[test]
    fn pool_arguments() {
        for (arg, expected) in [
            ("/srv/p0:1GiB", Ok(("/srv/p0", 1u64 << 30))),
            ("/srv/a:b/p0:64MiB", Ok(("/srv/a:b/p0", 64 << 20))),
            ("/srv/p0", Err("is not PATH:SIZE")),
            (":1GiB", Err("names no file")),
            ("/srv/p0:lots", Err("lots")),
        ] {
            match (pool_arg(arg), expected) {
                (Ok(p), Ok((path, size))) => assert_eq!((p.path.to_str(), p.size.0, p.name()), (Some(path), size, "p0".into()), "{arg}"),
                (Err(e), Err(want)) => assert!(e.contains(want), "{arg}: {e}"),
                (got, want) => panic!("{arg}: {got:?} against {want:?}"),
            }
        }
    }

    /// What the control plane answers becomes the status a volume's I/O fails with.
    #[test]
    fn control_plane_errors_become_statuses() {
        use nearstore_control::model::ApiError;
        use nearstore_wire::Status;
        let api = |code| ClientError::Api(ApiError::new(code, "x"));
        let down = ClientError::Transport { addr: "127.0.0.1:1".into(), what: "connecting: refused".into() };
        #[rustfmt::skip]
        let cases: Vec<(ClientError, Status)> = vec![
            // Retried by the host: the control plane is unreachable or could not commit.
            (down, Status::NAMESPACE_NOT_READY),
            (api(ErrorCode::StoreFailed), Status::NAMESPACE_NOT_READY),
            // Not retried: no pool has room, or the volume went away under its export.
            (api(ErrorCode::NoSpace), Status::CAPACITY_EXCEEDED.dnr()),
            (api(ErrorCode::VolumeNotFound), Status::INTERNAL_ERROR.dnr()),
            (api(ErrorCode::ExtentOutOfRange), Status::INTERNAL_ERROR.dnr()),
        ];
        for (e, want) in cases {
            let what = e.to_string();
            let got = resolve_error(e);
            assert_eq!(got.status, want, "{what}");
            assert!(got.message.contains(&what), "{}", got.message);
        }
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        for (n, s) in [(0, "0B"), (512, "512B"), (1 << 20, "1MiB"), (64 << 30, "64GiB"), (3 << 19, "1.5MiB")] {
            assert_eq!(bytes(n), s);
        }
    }
}
