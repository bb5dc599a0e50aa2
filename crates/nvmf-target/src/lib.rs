//! The nearstore NVMe/TCP target.
//!
//! Codemap: [`exec`] executes a queue's commands and completes each once, apart from any
//! transport; [`tcp`] is the NVMe/TCP transport (moves PDUs and data), [`loopback`] an
//! in-process one for tests (commands and data as values); [`fabrics`], [`admin`], [`io_cmd`]
//! and [`discovery`] parse and execute commands, named after the parts of the
//! specification; [`subsystem`] holds subsystems, namespaces and controllers;
//! [`backend`] is the storage under a namespace, [`io_pool`] runs file and block I/O off
//! the network tasks; [`config`] reads the TOML configuration; [`metrics`] serves
//! Prometheus text.

pub mod admin;
pub mod admission;
pub mod auth;
pub mod backend;
pub mod cluster;
pub mod config;
pub mod dev;
pub mod discovery;
pub mod exec;
pub mod fabrics;
pub mod fused;
pub mod io_cmd;
pub mod io_pool;
pub mod limits;
pub mod log_limit;
pub mod loopback;
pub mod memory;
pub mod metrics;
pub mod microtx;
pub mod offload;
pub mod range_lock;
pub mod reply;
pub mod request;
pub mod reservation;
pub mod sched;
pub mod subsystem;
pub mod tcp;
pub mod tenant;
pub mod uring;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use parking_lot::RwLock;
use tokio::net::TcpListener;
use tracing::{debug, error, info, warn};

use crate::admission::Admission;
use crate::backend::{Backend, FileBackend, MemoryBackend};
use crate::config::{Config, LimitsConfig};
use crate::io_pool::IoPool;
use crate::metrics::TargetStats;
use crate::subsystem::{Namespace, NsReservations, Subsystem};

/// A listener: where hosts connect.
#[derive(Debug, Clone)]
pub struct Port {
    pub id: u16,
    pub addr: SocketAddr,
    /// Serves only the discovery subsystem.
    pub discovery: bool,
    /// Reported in the discovery log instead of `addr`'s IP.
    pub advertise: Option<std::net::IpAddr>,
}

#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error("{field}: opening {path}: {source}")]
    Backend { field: String, path: String, source: std::io::Error },
    #[error("{field}: {message}")]
    Namespace { field: String, message: String },
    #[error("{field}: cannot listen on {addr}: {source}")]
    Listen { field: String, addr: SocketAddr, source: std::io::Error },
    #[error("limits.connections: {wanted} connections need more descriptors than the limit of {nofile} allows (at most {max})")]
    Descriptors { wanted: usize, nofile: u64, max: usize },
}

pub struct Target {
    subsystems: RwLock<BTreeMap<String, Arc<Subsystem>>>,
    discovery: Arc<Subsystem>,
    ports: RwLock<Vec<Port>>,
    genctr: AtomicU64,
    pub pool: IoPool,
    pub stats: TargetStats,
    /// How long a connection keeps polling its socket after its last activity before it
    /// parks in epoll (0: never poll).
    pub busy_poll: std::time::Duration,
    pub io_engine: config::IoEngine,
    /// Runs compute commands.
    pub offload: offload::Offload,
    /// What one host may hold (`[limits]`).
    pub limits: LimitsConfig,
    /// The connection cap and the connections that have not Connected.
    pub admission: Arc<Admission>,
    /// The descriptor limit (RLIMIT_NOFILE) after raising it at start-up.
    pub nofile: u64,
    /// Rate-limits the warnings remote peers cause.
    pub log_limit: log_limit::LogLimiter,
    /// The memory budget (`limits.memory`): connection buffers, held results and started
    /// compute commands.
    pub memory: Arc<memory::Memory>,
    /// The tenants controllers are resolved against at Connect (crate::tenant).
    pub tenants: tenant::Tenants,
    /// The gates of the pools this target's volumes reach, when the control plane's
    /// arbiter divides them (`dev::grant`; used with `--control` and `volume.arbiter`).
    pub gates: Arc<dev::grant::Gates>,
    /// The volume data path's links to its peers: what this target's volumes read from and
    /// write to each other target's pools (the view agent's link views).
    pub links: Arc<dev::remote::Links>,
    /// Runs once between a Connect's tenant resolution and its controller's insertion
    /// (tests drive a reload into that window).
    #[cfg(test)]
    pub(crate) after_tenant_resolve: parking_lot::Mutex<Option<Box<dyn FnOnce(&Target) + Send>>>,
}

impl Target {
    /// A target with no subsystems yet, as `cfg` describes it (its `[limits]` with
    /// `connections` resolved against the descriptor limit `nofile`).
    pub fn new(cfg: &Config, connections: usize, nofile: u64) -> Arc<Target> {
        Target::with_io_pool(cfg, connections, nofile, IoPool::new(cfg.io_threads))
    }

    /// [`Target::new`] with the given I/O pool (the simulation's runs on its runtime).
    pub fn with_io_pool(cfg: &Config, connections: usize, nofile: u64, pool: IoPool) -> Arc<Target> {
        let limits = cfg.limits.clone();
        let admission = Admission::new(connections, limits.connections_per_address, limits.queues_per_address);
        let plan = cfg.memory_plan(memory::physical());
        let memory = memory::Memory::new(plan.budget);
        let compute = offload::ComputeConfig { memory_per_command: Some(config::ByteSize(plan.command)), ..cfg.compute.clone() };
        Arc::new(Target {
            subsystems: RwLock::new(BTreeMap::new()),
            discovery: Arc::new(Subsystem::new(nearstore_wire::DISCOVERY_NQN, None, Some("nearstore discovery"), true, &[])),
            ports: RwLock::new(Vec::new()),
            genctr: AtomicU64::new(1),
            pool: pool.clone(),
            stats: TargetStats::default(),
            busy_poll: std::time::Duration::from_micros(cfg.busy_poll_us),
            io_engine: cfg.io_engine,
            offload: offload::Offload::new(compute, &cfg.cluster, memory.clone(), (cfg.io_engine, pool.clone())),
            limits,
            admission,
            nofile,
            log_limit: log_limit::LogLimiter::default(),
            memory,
            tenants: tenant::Tenants::default(),
            gates: dev::grant::Gates::new(),
            links: Arc::default(),
            #[cfg(test)]
            after_tenant_resolve: parking_lot::Mutex::default(),
        })
    }

    /// Builds the subsystems and namespaces a configuration describes (listeners are
    /// opened by [`Target::listen_all`]).
    pub fn from_config(cfg: &Config) -> Result<Arc<Target>, TargetError> {
        cfg.validate()?;
        if let Some(arenas) = limit_malloc_arenas() {
            warn!(arenas, "mallopt(M_ARENA_MAX) refused");
        }
        let nofile = raise_descriptor_limit();
        let max = limits::connections_max(nofile);
        let connections = match cfg.limits.connections {
            Some(wanted) if wanted > max => return Err(TargetError::Descriptors { wanted, nofile, max }),
            Some(n) => n,
            None => max,
        };
        info!(nofile, connections, "descriptor limit and connection cap");
        let physical = memory::physical();
        let plan = cfg.memory_plan(physical);
        info!(budget = plan.budget, memory_per_command = plan.command, "memory budget (limits.memory) and compute command size");
        if let (None, Some(p)) = (cfg.limits.memory, physical.filter(|p| plan.budget > p / 2)) {
            warn!(
                budget = plan.budget,
                physical = p,
                "the machine has too little memory for the default budget (half of it): raised to what one compute command and one controller need"
            );
        }
        let t = Target::new(cfg, connections, nofile);
        t.tenants.configure(cfg)?;
        if let Some(d) = &cfg.state_dir {
            std::fs::create_dir_all(d).map_err(|source| TargetError::Backend {
                field: "state_dir".into(),
                path: d.display().to_string(),
                source,
            })?;
        }
        for (i, s) in cfg.subsystem.iter().enumerate() {
            let mut keys = Vec::new();
            for (j, h) in s.host.iter().enumerate() {
                if let Some(k) = h.keys(&format!("subsystem[{i}].host[{j}]"))? {
                    keys.push((h.nqn.clone(), k));
                }
            }
            let mut hosts = s.hosts.clone();
            hosts.extend(s.host.iter().map(|h| h.nqn.clone()));
            let sub = Subsystem::new(&s.nqn, s.serial.as_deref(), s.model.as_deref(), s.allow_any_host, &hosts).with_host_keys(keys);
            for (j, n) in s.namespace.iter().enumerate() {
                let field = format!("subsystem[{i}].namespace[{j}]");
                let backend: Arc<dyn Backend> = match (&n.path, n.memory) {
                    (Some(p), _) => Arc::new(FileBackend::open(p, n.size.map(|s| s.0)).map_err(|source| TargetError::Backend {
                        field: format!("{field}.path"),
                        path: p.display().to_string(),
                        source,
                    })?),
                    (None, Some(m)) => Arc::new(MemoryBackend::new(m.0)),
                    (None, None) => unreachable!("validated"),
                };
                if backend.size() < n.block_size as u64 {
                    return Err(TargetError::Namespace { field, message: format!("{} is smaller than one block", backend.describe()) });
                }
                info!(subnqn = %s.nqn, nsid = n.nsid, "namespace on {}", backend.describe());
                let mut ns = Namespace::new(&s.nqn, n.nsid, backend, n.block_size);
                ns.dev = dev::stack(ns.dev, n.inject.as_ref().map(|i| i.rule(n.block_size)), n.delay_us);
                ns.dev = dev::share(ns.dev, config::sharing(n.rate_limit, n.fair));
                let device_block = ns.dev.geometry().block_size;
                if n.block_size % device_block != 0 {
                    let message =
                        format!("block_size {} is not a multiple of the {device_block}-byte blocks of {}", n.block_size, ns.dev.describe());
                    return Err(TargetError::Namespace { field, message });
                }
                let reservations = match n.path.as_deref().and_then(|p| reservation_file(cfg.state_dir.as_deref(), p, &ns.nguid)) {
                    Some(f) => NsReservations::load(f).map_err(|message| TargetError::Namespace { field: field.clone(), message })?,
                    None => NsReservations::new(None),
                };
                let ns = Namespace { tag: n.tag, reservations, ..ns };
                let ns = match (&n.path, n.microtx) {
                    (Some(p), true) if is_block_device(p) => {
                        let message = "microtx needs a regular file: a block device has no beside for its journal".into();
                        return Err(TargetError::Namespace { field, message });
                    }
                    // A journal that cannot be replayed keeps its namespace offline, not
                    // the target down: the other namespaces serve.
                    (Some(p), true) => match open_journal(p, &*ns.backend, n.block_size) {
                        Ok(j) => ns.with_journal(j),
                        Err(why) => {
                            error!(subnqn = %s.nqn, nsid = n.nsid, error = %why, "namespace offline (Namespace Not Ready): its MicroTx journal could not be replayed; repair or remove the journal and restart");
                            ns.into_offline(why)
                        }
                    },
                    (None, true) => return Err(TargetError::Namespace { field, message: "microtx needs a file namespace (path)".into() }),
                    (_, false) => ns,
                };
                sub.add_namespace(ns).map_err(|message| TargetError::Namespace { field, message })?;
            }
            t.subsystems.write().insert(s.nqn.clone(), Arc::new(sub));
        }
        if !cfg.pool.is_empty() {
            let sub = pool_subsystem(cfg, &t.gates)?;
            t.subsystems.write().insert(sub.nqn.clone(), Arc::new(sub));
        }
        Ok(t)
    }

    /// Replaces the tenants with `cfg`'s (checked against the subsystems it names, as at
    /// start-up; an error changes nothing). Every controller whose host is no longer in
    /// its tenant, or whose tenant's policy changed, is revoked (its next command is
    /// refused with Access Denied) and torn down, its queues closed; the host connects
    /// again under its new tenant, if it has one. Other controllers are untouched.
    /// Returns the controllers torn down.
    pub fn reload_tenants(&self, cfg: &Config) -> Result<usize, config::ConfigError> {
        for why in self.tenants.configure(cfg)? {
            warn!("tenant reload: {why}");
        }
        Ok(self.sweep_tenants())
    }

    /// Takes the tenants the control plane pushed (`target --control`) in place of those it
    /// pushed before, beside the configured ones, as a reload does: returns the controllers
    /// torn down and why pushed tenants were refused (docs/operations.md, "Tenants from the
    /// control plane").
    pub fn push_tenants(&self, pushed: Vec<tenant::TenantConfig>) -> (usize, Vec<String>) {
        let refused = self.tenants.push(pushed);
        for why in &refused {
            warn!("tenants pushed by the control plane: {why}");
        }
        (self.sweep_tenants(), refused)
    }

    /// Revokes and tears down every controller whose tenant changed. Returns how many.
    fn sweep_tenants(&self) -> usize {
        let mut gone = 0;
        for sub in std::iter::once(self.discovery.clone()).chain(self.subsystems()) {
            for cntlid in sub.cntlids() {
                let Some(c) = sub.controller(cntlid) else { continue };
                let member = c.acting_for.is_none() && self.offload.peers.trusts(&c.hostnqn);
                if self.tenants.keeps(&c.tenant, c.requester(), sub.discovery, member) {
                    continue;
                }
                warn!(subnqn = %sub.nqn, cntlid, hostnqn = %c.requester(), tenant = %c.tenant.name, "tenant reload: controller revoked and torn down");
                c.revoke();
                sub.remove_this_controller(&c);
                gone += 1;
            }
        }
        info!(tenants = self.tenants.all().len(), controllers_torn_down = gone, "tenants reloaded");
        gone
    }

    /// Removes a subsystem added at run time: its controllers go (their queues close) and
    /// the discovery log generation changes. None: there is no such subsystem.
    pub fn remove_subsystem(&self, nqn: &str) -> Option<Arc<Subsystem>> {
        let sub = self.subsystems.write().remove(nqn)?;
        for cntlid in sub.cntlids() {
            sub.remove_controller(cntlid);
        }
        self.genctr.fetch_add(1, Relaxed);
        Some(sub)
    }

    /// Adds a subsystem at run time; the discovery log generation changes.
    pub fn add_subsystem(&self, sub: Subsystem) -> Arc<Subsystem> {
        let sub = Arc::new(sub);
        self.subsystems.write().insert(sub.nqn.clone(), sub.clone());
        self.genctr.fetch_add(1, Relaxed);
        sub
    }

    /// The subsystem with this NQN, the discovery subsystem included.
    pub fn subsystem(&self, nqn: &str) -> Option<Arc<Subsystem>> {
        if nqn == nearstore_wire::DISCOVERY_NQN {
            return Some(self.discovery.clone());
        }
        self.subsystems.read().get(nqn).cloned()
    }

    /// The NVM subsystems (not the discovery subsystem).
    pub fn subsystems(&self) -> Vec<Arc<Subsystem>> {
        self.subsystems.read().values().cloned().collect()
    }

    pub fn ports(&self) -> Vec<Port> {
        self.ports.read().clone()
    }

    pub fn genctr(&self) -> u64 {
        self.genctr.load(Relaxed)
    }

    /// Opens a listener and serves it until the runtime stops. Returns the bound address
    /// (port 0 picks a free port).
    pub async fn listen(self: &Arc<Self>, addr: SocketAddr, discovery: bool) -> std::io::Result<SocketAddr> {
        self.listen_advertised(addr, discovery, None).await
    }

    /// [`Target::listen`], reporting `advertise` in the discovery log.
    pub async fn listen_advertised(
        self: &Arc<Self>,
        addr: SocketAddr,
        discovery: bool,
        advertise: Option<std::net::IpAddr>,
    ) -> std::io::Result<SocketAddr> {
        self.serve_listener(TcpListener::bind(addr).await?, discovery, advertise)
    }

    /// Serves connections of a listener bound already (its address can then go into the
    /// configuration of peers before this target starts).
    pub fn serve_listener(
        self: &Arc<Self>,
        listener: TcpListener,
        discovery: bool,
        advertise: Option<std::net::IpAddr>,
    ) -> std::io::Result<SocketAddr> {
        let bound = listener.local_addr()?;
        let port = {
            let mut ports = self.ports.write();
            let p = Arc::new(Port { id: ports.len() as u16 + 1, addr: bound, discovery, advertise });
            ports.push((*p).clone());
            p
        };
        self.genctr.fetch_add(1, Relaxed);
        let target = self.clone();
        tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((sock, from)) => match target.admission.admit(from.ip()) {
                        Ok(a) => {
                            if a.evicted {
                                target.stats.connections_evicted.fetch_add(1, Relaxed);
                            }
                            let _ = sock.set_nodelay(true);
                            let local = sock.local_addr().ok();
                            tokio::spawn(tcp::serve(sock, target.clone(), port.clone(), local, Some(a.ticket)));
                        }
                        Err(why) => {
                            // Closed at once; counted, logged only at debug level so that a
                            // flood of connections is not also a flood of log lines.
                            target.stats.connections_refused.fetch_add(1, Relaxed);
                            debug!(%from, ?why, "connection refused");
                        }
                    },
                    Err(e) => {
                        // EMFILE and friends: keep serving the connections we have.
                        error!("accept on {bound}: {e}");
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    }
                }
            }
        });
        info!(%bound, discovery, "listening");
        Ok(bound)
    }

    /// Opens every listener of the configuration; errors name the listener.
    pub async fn listen_all(self: &Arc<Self>, cfg: &Config) -> Result<Vec<SocketAddr>, TargetError> {
        let mut out = Vec::new();
        for (i, l) in cfg.listener.iter().enumerate() {
            let a = self.listen_advertised(l.address, l.discovery, l.advertise).await.map_err(|source| TargetError::Listen {
                field: format!("listener[{i}].address"),
                addr: l.address,
                source,
            })?;
            out.push(a);
        }
        Ok(out)
    }

    /// Serves one already-connected stream (an in-process socket pair in tests).
    pub fn serve_stream<S: nearstore_transport::Stream>(self: &Arc<Self>, s: S, discovery: bool) -> tokio::task::JoinHandle<()> {
        let port = Arc::new(Port { id: 0, addr: SocketAddr::from(([127, 0, 0, 1], 0)), discovery, advertise: None });
        tokio::spawn(tcp::serve(s, self.clone(), port, None, None))
    }

    /// Flushes every namespace: called at shutdown.
    pub fn flush_all(&self) {
        for sub in self.subsystems() {
            for ns in sub.namespaces() {
                if let Err(e) = ns.backend.flush() {
                    error!(subnqn = %sub.nqn, nsid = ns.nsid, "flush at exit failed: {e}");
                }
            }
        }
    }
}

/// The NQN of every target's pool subsystem: its pools (`[[pool]]`, `--pool`) as
/// namespaces 1, 2, ... in the order they are given, for the other targets exporting
/// volumes whose extents lie in them (docs/control-plane.md, "Pools on the wire").
pub const POOLS_NQN: &str = "nqn.2026-11.io.nearstore:pools";

/// The pool subsystem: it admits only `cluster.trusted_members`, each for itself. A member
/// acting for a host is admitted only if that host is (the rule of every subsystem), and no
/// host is: a host reaches pools only through a volume exported to it.
fn pool_subsystem(cfg: &Config, gates: &Arc<dev::grant::Gates>) -> Result<Subsystem, TargetError> {
    let sub = Subsystem::new(POOLS_NQN, None, Some("nearstore pools"), false, &cfg.cluster.trusted_members);
    for (i, p) in cfg.pool.iter().enumerate() {
        let field = format!("pool[{i}].path");
        let backend = FileBackend::open(&p.path, Some(p.size.0)).map_err(|source| TargetError::Backend {
            field: field.clone(),
            path: p.path.display().to_string(),
            source,
        })?;
        let nsid = i as u32 + 1;
        info!(subnqn = POOLS_NQN, nsid, pool = %p.name(), "pool on {}", backend.describe());
        let mut ns = Namespace::new(POOLS_NQN, nsid, Arc::new(backend), limits::VOLUME_BLOCK_BYTES);
        ns.dev = dev::share(ns.dev, config::sharing(p.rate_limit, None));
        if let Some(f) = &p.fair {
            ns.dev = dev::fair::Fair::arbitrated(ns.dev, f.bandwidth.0, f.write_cost, gates.clone(), nsid);
        }
        sub.add_namespace(ns).map_err(|message| TargetError::Namespace { field, message })?;
    }
    Ok(sub)
}

/// Raises the soft descriptor limit (RLIMIT_NOFILE) to the hard limit, once per process,
/// and returns the limit in force: the connection cap is derived from it
/// ([`limits::connections_max`]).
pub fn raise_descriptor_limit() -> u64 {
    static NOFILE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NOFILE.get_or_init(|| {
        let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit and setrlimit read or fill the one struct they are given.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
            warn!("getrlimit(RLIMIT_NOFILE): {}", std::io::Error::last_os_error());
            return 1024;
        }
        if r.rlim_cur < r.rlim_max {
            let raised = libc::rlimit { rlim_cur: r.rlim_max, rlim_max: r.rlim_max };
            // SAFETY: as above.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
                r.rlim_cur = r.rlim_max;
            } else {
                warn!(soft = r.rlim_cur, hard = r.rlim_max, "raising RLIMIT_NOFILE: {}", std::io::Error::last_os_error());
            }
        }
        r.rlim_cur
    })
}

/// Limits glibc's malloc to [`limits::MALLOC_ARENAS_PER_CORE`] arenas per core, once per
/// process, unless the operator set MALLOC_ARENA_MAX; and fixes its mmap threshold at
/// [`limits::MALLOC_MMAP_THRESHOLD_BYTES`] unless MALLOC_MMAP_THRESHOLD_ is set, so that
/// large blocks freed go back to the kernel instead of staying resident in an arena. By default glibc makes up to 8 per
/// core and keeps what a thread freed in its arena for that arena's later use: memory
/// one compute thread freed (a result, a sort's rows) was not reused by the next command
/// on another arena, and the process peaked 48 MiB over its memory budget
/// (crates/cli/tests/memory.rs). glibc fixes its arena limit for good once a thread needs
/// a new arena while more than 8 exist, so a binary calls this first, before it starts a
/// thread (the `nearstore` CLI does); [`Target::from_config`] calls it too, which then
/// changes nothing, and logs a refusal. Returns the arenas mallopt refused, if it did.
pub fn limit_malloc_arenas() -> Option<i32> {
    static REFUSED: std::sync::OnceLock<Option<i32>> = std::sync::OnceLock::new();
    *REFUSED.get_or_init(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
            let bytes = limits::MALLOC_MMAP_THRESHOLD_BYTES as i32;
            // SAFETY: mallopt only changes a malloc parameter; any value is accepted or refused.
            if unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, bytes) } == 0 {
                warn!(bytes, "mallopt(M_MMAP_THRESHOLD) refused");
            }
        }
        if std::env::var_os("MALLOC_ARENA_MAX").is_some() {
            return None;
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let arenas = (cores * limits::MALLOC_ARENAS_PER_CORE).min(i32::MAX as usize) as i32;
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: mallopt only changes a malloc parameter; any value is accepted or refused.
        if unsafe { libc::mallopt(libc::M_ARENA_MAX, arenas) } == 0 {
            return Some(arenas);
        }
        #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
        let _ = arenas;
        None
    })
}

/// Opens (creating it) a namespace's MicroTx journal beside its file and replays it onto the
/// namespace, before the namespace serves. Err: why it could not (the journal named).
fn open_journal(path: &std::path::Path, data: &dyn Backend, block_size: u32) -> Result<Arc<microtx::Journal>, String> {
    let mut jp = path.as_os_str().to_owned();
    jp.push(".microtx");
    let jp = std::path::PathBuf::from(jp);
    // Only a regular file: the replay reads and writes it with plain buffers, which a
    // block device opened with O_DIRECT would refuse.
    if std::fs::metadata(&jp).is_ok_and(|m| !m.is_file()) {
        return Err(format!("{}: not a regular file", jp.display()));
    }
    let log = FileBackend::open(&jp, Some(limits::MICROTX_JOURNAL_BYTES)).map_err(|e| format!("opening {}: {e}", jp.display()))?;
    let (journal, rec) = microtx::Journal::open(Arc::new(log), data, block_size as u64).map_err(|e| format!("{}: {e}", jp.display()))?;
    if rec.checkpoint_corrupt || rec.torn_tail {
        warn!(journal = %jp.display(), checkpoint_corrupt = rec.checkpoint_corrupt, torn_tail = rec.torn_tail, "MicroTx journal damaged where a crash leaves it: replayed what is whole");
    }
    info!(journal = %jp.display(), generation = rec.generation, records = rec.records, finished = ?rec.finished, rolled_back = ?rec.rolled_back, "MicroTx journal replayed");
    Ok(Arc::new(journal))
}

fn is_block_device(path: &std::path::Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device())
}

/// Where a namespace on `path` keeps reservations that persist through power loss: in the
/// state directory by NGUID, else beside a regular file; a block device without a state
/// directory has nowhere to keep them.
fn reservation_file(state_dir: Option<&std::path::Path>, path: &std::path::Path, nguid: &[u8; 16]) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::FileTypeExt;
    if let Some(d) = state_dir {
        let name: String = nguid.iter().map(|b| format!("{b:02x}")).collect();
        return Some(d.join(format!("{name}.resv")));
    }
    if std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device()) {
        return None;
    }
    let mut f = path.as_os_str().to_owned();
    f.push(".resv");
    Some(f.into())
}
