//! Target configuration: a TOML file, or the flags of the one-namespace case.
//!
//! ```toml
//! io_threads = 4
//! metrics = "127.0.0.1:9100"
//! state_dir = "/var/lib/nearstore/state"   # reservation state files (default: beside each file)
//!
//! [[listener]]
//! address = "127.0.0.1:4420"
//!
//! [[listener]]
//! address = "127.0.0.1:8009"
//! discovery = true
//!
//! [[subsystem]]
//! nqn = "nqn.2026-11.io.nearstore:disk0"
//! allow_any_host = false
//! hosts = ["nqn.2014-08.org.nvmexpress:uuid:5f1c..."]
//!
//! [[subsystem.host]]                       # a host that must authenticate (DH-HMAC-CHAP)
//! nqn = "nqn.2014-08.org.nvmexpress:uuid:77aa..."
//! dhchap_key = "DHHC-1:00:...:"            # nearstore gen-dhchap-key
//! dhchap_ctrl_key = "DHHC-1:00:...:"       # optional: the target proves itself too
//! dhchap_hash = "sha256"                   # optional: sha256 (default), sha384, sha512
//! dhchap_dhgroup = "null"                  # optional: null (default), ffdhe2048 .. ffdhe8192
//!
//! [[subsystem.namespace]]
//! nsid = 1
//! path = "/var/lib/nearstore/disk0.img"   # regular file or block device
//! size = "10GiB"                           # create a sparse file of this size if missing
//! block_size = 512
//!
//! [[subsystem.namespace]]
//! nsid = 2
//! memory = "1GiB"
//! ```

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::limits;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: field.into(), message: message.into() }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub listener: Vec<ListenerConfig>,
    #[serde(default)]
    pub subsystem: Vec<SubsystemConfig>,
    /// Address of the Prometheus metrics endpoint.
    pub metrics: Option<SocketAddr>,
    /// Worker threads for file and block backend I/O.
    #[serde(default = "default_io_threads")]
    pub io_threads: usize,
    /// Worker threads of the network runtime (default: all cores).
    pub net_threads: Option<usize>,
    /// Microseconds a connection keeps polling its socket after its last activity before
    /// it sleeps in epoll: trades CPU for latency (0 turns polling off).
    #[serde(default = "default_busy_poll_us")]
    pub busy_poll_us: u64,
    /// How file and block backends do I/O.
    #[serde(default)]
    pub io_engine: IoEngine,
    /// The offload engine.
    #[serde(default)]
    pub compute: crate::offload::ComputeConfig,
    /// The cluster map: the peers whose extents this target reads itself.
    #[serde(default)]
    pub cluster: crate::cluster::ClusterConfig,
    /// What one host may hold, and the target in total.
    #[serde(default)]
    pub limits: LimitsConfig,
    /// Where reservations that persist through power loss are kept, one file per namespace
    /// named by its NGUID. Without it, a namespace on a regular file keeps them beside the
    /// file (PATH.resv); one on a block device cannot persist them (docs/operations.md).
    pub state_dir: Option<PathBuf>,
    /// The control plane this target registers with, HOST:PORT, or its leader and standbys:
    /// `["A", "B"]` or "A,B", kept as the comma list (docs/control-plane.md).
    #[serde(default, deserialize_with = "control_addrs")]
    pub control: Option<String>,
    /// Pools: files set aside for volumes' extents, registered with the control plane.
    #[serde(default)]
    pub pool: Vec<PoolConfig>,
    /// Exported volumes' data path: the mapping cache and the wait for the control plane.
    #[serde(default)]
    pub volume: VolumeConfig,
    /// Tenants: sets of hosts, what they reach and their shares (crate::tenant).
    #[serde(default)]
    pub tenant: Vec<crate::tenant::TenantConfig>,
}

/// The `[volume]` section (docs/control-plane.md, "The data path").
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VolumeConfig {
    /// Extent locations one exported volume caches (0: none, every I/O is translated).
    pub cache_entries: usize,
    /// How long an I/O waits for the control plane's translation, in milliseconds.
    pub translate_timeout_ms: u64,
    /// The volumes' tenants take the shares of pools that the control plane's arbiter
    /// grants them (docs/fair-io.md, "The arbiter"); false: each pool's own fair sharing only.
    pub arbiter: bool,
}

impl Default for VolumeConfig {
    fn default() -> Self {
        VolumeConfig {
            cache_entries: limits::VOLUME_CACHE_ENTRIES_DEFAULT,
            translate_timeout_ms: limits::VOLUME_TRANSLATE_TIMEOUT_MS_DEFAULT,
            arbiter: true,
        }
    }
}

impl VolumeConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.cache_entries > limits::VOLUME_CACHE_ENTRIES_MAX {
            return Err(invalid("volume.cache_entries", format!("must be at most {}", limits::VOLUME_CACHE_ENTRIES_MAX)));
        }
        if self.translate_timeout_ms == 0 || self.translate_timeout_ms > limits::VOLUME_TRANSLATE_TIMEOUT_MS_MAX {
            return Err(invalid(
                "volume.translate_timeout_ms",
                format!("must be between 1 and {}", limits::VOLUME_TRANSLATE_TIMEOUT_MS_MAX),
            ));
        }
        Ok(())
    }
}

/// A `[[pool]]`: a file the target makes (sparse) or extends to `size`, never shrinks.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Its name at the control plane (default: the file's name).
    pub name: Option<String>,
    pub path: PathBuf,
    pub size: ByteSize,
    /// For tests and experiments: a rate device under the pool's namespace.
    pub rate_limit: Option<ByteSize>,
    /// Share the pool's bandwidth among tenants by weight, on this target (docs/fair-io.md;
    /// no arbiter of the control plane divides it yet).
    pub fair: Option<FairConfig>,
}

impl PoolConfig {
    pub fn name(&self) -> String {
        self.name.clone().unwrap_or_else(|| self.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default())
    }
}

/// The `[limits]` section: what one host may hold, and the target in total
/// (docs/operations.md, "Limits").
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Connections open at once, all hosts together. Default: what the descriptor limit
    /// allows once raised to its hard limit at start-up ([`limits::connections_max`]).
    pub connections: Option<usize>,
    /// Connections one source address may hold before they Connect.
    pub connections_per_address: usize,
    /// Connected queues (admin and I/O, every controller) one source address may hold.
    pub queues_per_address: usize,
    /// Controllers one host NQN may hold in one subsystem.
    pub controllers_per_host: usize,
    /// Milliseconds a connection may take from accept to a successful Connect.
    pub connect_timeout_ms: u64,
    /// Memory hosts can make the target hold in total: connection buffers (what each queue
    /// always holds, [`limits::connection_memory_fixed`], from its Connect to its close,
    /// and the buffers it grows while it needs them), held
    /// compute results and started compute commands (their whole
    /// `compute.memory_per_command`). Default: half the machine's physical memory, or what
    /// one command and one controller need on a machine too small for that
    /// ([`crate::memory::Plan`]); a configured budget smaller than that is refused.
    pub memory: Option<ByteSize>,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            connections: None,
            connections_per_address: limits::CONNECTIONS_PER_ADDRESS_DEFAULT,
            queues_per_address: limits::QUEUES_PER_ADDRESS_DEFAULT,
            controllers_per_host: limits::CONTROLLERS_PER_HOST_DEFAULT,
            connect_timeout_ms: limits::CONNECT_TIMEOUT_MS_DEFAULT,
            memory: None,
        }
    }
}

impl LimitsConfig {
    /// Checks ranges; errors name the field as it is written in the TOML file. The
    /// connection cap is checked against the descriptor limit when the target starts.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.connections == Some(0) {
            return Err(invalid("limits.connections", "must be at least 1"));
        }
        if self.connections_per_address == 0 {
            return Err(invalid("limits.connections_per_address", "must be at least 1"));
        }
        if self.queues_per_address == 0 || self.queues_per_address > limits::QUEUES_PER_ADDRESS_MAX {
            return Err(invalid("limits.queues_per_address", format!("must be between 1 and {}", limits::QUEUES_PER_ADDRESS_MAX)));
        }
        if self.controllers_per_host == 0 || self.controllers_per_host > limits::CONTROLLERS_PER_SUBSYSTEM_MAX {
            return Err(invalid("limits.controllers_per_host", format!("must be between 1 and {}", limits::CONTROLLERS_PER_SUBSYSTEM_MAX)));
        }
        if !(limits::CONNECT_TIMEOUT_MS_MIN..=limits::CONNECT_TIMEOUT_MS_MAX).contains(&self.connect_timeout_ms) {
            return Err(invalid(
                "limits.connect_timeout_ms",
                format!("must be between {} and {}", limits::CONNECT_TIMEOUT_MS_MIN, limits::CONNECT_TIMEOUT_MS_MAX),
            ));
        }
        Ok(())
    }
}

/// How file and block backends do I/O.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum IoEngine {
    /// One io_uring per connection, driven by the connection's own thread (default);
    /// falls back to `threads` where the kernel refuses io_uring.
    #[default]
    Uring,
    /// The worker pool (`io_threads` threads doing pread/pwrite).
    Threads,
}

fn default_busy_poll_us() -> u64 {
    limits::BUSY_POLL_US_DEFAULT
}

fn default_io_threads() -> usize {
    limits::IO_THREADS_DEFAULT
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    pub address: SocketAddr,
    /// Serve only the discovery subsystem on this listener (port 8009 by convention).
    #[serde(default)]
    pub discovery: bool,
    /// Address to report in the discovery log instead of `address` (a target behind NAT).
    pub advertise: Option<std::net::IpAddr>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubsystemConfig {
    pub nqn: String,
    #[serde(default)]
    pub allow_any_host: bool,
    #[serde(default)]
    pub hosts: Vec<String>,
    /// Hosts with their own settings: the DH-HMAC-CHAP keys they authenticate with. Each
    /// is allowed, as if in `hosts`.
    #[serde(default)]
    pub host: Vec<HostConfig>,
    pub serial: Option<String>,
    pub model: Option<String>,
    #[serde(default)]
    pub namespace: Vec<NamespaceConfig>,
}

/// A `[[subsystem.host]]` entry (docs/operations.md, "Security").
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostConfig {
    pub nqn: String,
    /// The host's DH-HMAC-CHAP secret (`DHHC-1:..`): with one, the host must authenticate
    /// every queue before other commands.
    pub dhchap_key: Option<String>,
    /// The controller's secret, for hosts that ask the target to authenticate too.
    pub dhchap_ctrl_key: Option<String>,
    /// The hash function the target prefers: sha256 (default), sha384, sha512.
    pub dhchap_hash: Option<String>,
    /// The Diffie-Hellman group the target prefers: null (default), ffdhe2048 .. ffdhe8192.
    pub dhchap_dhgroup: Option<String>,
}

impl HostConfig {
    /// Its keys, checked; None without a `dhchap_key`. An error names the field, never the
    /// secret.
    pub fn keys(&self, f: &str) -> Result<Option<crate::auth::HostKeys>, ConfigError> {
        use nearstore_dhchap::{DhGroup, Hash, Secret};
        let secret = |field: &str, s: &str| s.parse::<Secret>().map_err(|e| invalid(format!("{f}.{field}"), e.to_string()));
        let Some(k) = &self.dhchap_key else {
            if self.dhchap_ctrl_key.is_some() {
                return Err(invalid(format!("{f}.dhchap_ctrl_key"), "a controller key needs the host's dhchap_key"));
            }
            return Ok(None);
        };
        let key = secret("dhchap_key", k)?;
        let ctrl_key = self.dhchap_ctrl_key.as_deref().map(|c| secret("dhchap_ctrl_key", c)).transpose()?;
        let hash = match &self.dhchap_hash {
            None => Hash::Sha256,
            Some(h) => Hash::from_name(h).ok_or_else(|| invalid(format!("{f}.dhchap_hash"), "must be sha256, sha384 or sha512"))?,
        };
        let group = match &self.dhchap_dhgroup {
            None => DhGroup::Null,
            Some(g) => DhGroup::from_name(g).ok_or_else(|| {
                invalid(format!("{f}.dhchap_dhgroup"), "must be null, ffdhe2048, ffdhe3072, ffdhe4096, ffdhe6144 or ffdhe8192")
            })?,
        };
        Ok(Some(crate::auth::HostKeys { key, ctrl_key, hash, group }))
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceConfig {
    pub nsid: u32,
    pub path: Option<PathBuf>,
    /// A memory namespace of this size ("1GiB", "512MiB", or bytes).
    pub memory: Option<ByteSize>,
    /// Size of the file to create when `path` does not exist.
    pub size: Option<ByteSize>,
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// This namespace's tag in the cluster map: extents tagged with it are local.
    pub tag: Option<u16>,
    /// For tests: hold every I/O operation back this many microseconds (a delay device
    /// stacked on the storage). 0: none.
    #[serde(default)]
    pub delay_us: u64,
    /// For tests: fail chosen I/O operations (an error-inject device stacked on the storage).
    pub inject: Option<InjectConfig>,
    /// Keep a MicroTx journal for fused write operations in `PATH.microtx` beside the
    /// namespace's file (created, MICROTX_JOURNAL_BYTES), replayed at start-up
    /// (docs/compute-protocol.md, "The MicroTx journal"). File namespaces only.
    #[serde(default)]
    pub microtx: bool,
    /// For tests and experiments: serve reads and writes at this many bytes per second (a
    /// rate device stacked on the storage, docs/fair-io.md).
    pub rate_limit: Option<ByteSize>,
    /// Share the namespace's bandwidth among tenants (docs/fair-io.md).
    pub fair: Option<FairConfig>,
}

/// `fair = { bandwidth = "200MiB" }` of a namespace or a pool: the fair I/O scheduler.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FairConfig {
    /// Bytes per second the device serves, shared among its tenants by weight.
    pub bandwidth: ByteSize,
    /// What a written byte costs against a read one (1 to 64; default 1), as configured
    /// (the pool's measured write cost does not replace it yet).
    #[serde(default = "one")]
    pub write_cost: f64,
}

fn one() -> f64 {
    1.0
}

impl FairConfig {
    fn validate(&self, f: &str) -> Result<(), ConfigError> {
        if !(limits::FAIR_BANDWIDTH_MIN..=limits::FAIR_BANDWIDTH_MAX).contains(&self.bandwidth.0) {
            let m = format!("must be between {} and {} bytes per second", limits::FAIR_BANDWIDTH_MIN, limits::FAIR_BANDWIDTH_MAX);
            return Err(invalid(format!("{f}.fair.bandwidth"), m));
        }
        if !(1.0..=limits::FAIR_WRITE_COST_MAX).contains(&self.write_cost) {
            return Err(invalid(format!("{f}.fair.write_cost"), format!("must be between 1 and {}", limits::FAIR_WRITE_COST_MAX)));
        }
        Ok(())
    }
}

/// The rate device and fair scheduler of a namespace or pool, checked.
pub fn sharing(rate_limit: Option<ByteSize>, fair: Option<FairConfig>) -> crate::dev::Sharing {
    crate::dev::Sharing {
        rate_limit: rate_limit.map(|r| r.0),
        fair_bandwidth: fair.map(|f| f.bandwidth.0),
        fair_write_cost: fair.map_or(1.0, |f| f.write_cost),
    }
}

fn check_rate_limit(f: &str, r: Option<ByteSize>) -> Result<(), ConfigError> {
    if r.is_some_and(|r| !(limits::FAIR_BANDWIDTH_MIN..=limits::FAIR_BANDWIDTH_MAX).contains(&r.0)) {
        let m = format!("must be between {} and {} bytes per second", limits::FAIR_BANDWIDTH_MIN, limits::FAIR_BANDWIDTH_MAX);
        return Err(invalid(format!("{f}.rate_limit"), m));
    }
    Ok(())
}

/// `[subsystem.namespace.inject]`: which I/O operations of a namespace fail, and how.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InjectConfig {
    /// "read", "write" (writes and write zeroes), "flush" or "deallocate"; absent: any.
    pub op: Option<crate::dev::inject::Kind>,
    /// Only operations touching logical blocks in [first, end); absent: anywhere.
    pub lbas: Option<[u64; 2]>,
    /// Fail only the nth matching operation (from 1); absent: every matching one.
    pub nth: Option<u64>,
    /// The errno the operation fails with (default 5, EIO).
    #[serde(default = "default_errno")]
    pub errno: i32,
}

fn default_errno() -> i32 {
    libc::EIO
}

impl InjectConfig {
    /// The device rule, for a namespace of `block_size`-byte blocks.
    pub fn rule(&self, block_size: u32) -> crate::dev::inject::Rule {
        let shift = block_size.trailing_zeros();
        crate::dev::inject::Rule {
            kind: self.op,
            range: self.lbas.map(|[a, b]| (a.saturating_mul(1 << shift), b.saturating_mul(1 << shift))),
            nth: self.nth,
            errno: self.errno,
        }
    }
}

fn default_block_size() -> u32 {
    512
}

/// A size in bytes, written as a number or a string with a unit (KiB, MiB, GiB, TiB, K, M, G, T).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl std::str::FromStr for ByteSize {
    type Err = String;
    fn from_str(s: &str) -> Result<ByteSize, String> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        let n: u64 = num.parse().map_err(|_| format!("'{s}' is not a size (examples: 4096, 512MiB, 10GiB)"))?;
        let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kib" | "kb" => 1 << 10,
            "m" | "mib" | "mb" => 1 << 20,
            "g" | "gib" | "gb" => 1 << 30,
            "t" | "tib" | "tb" => 1 << 40,
            u => return Err(format!("unknown size unit '{u}' in '{s}'")),
        };
        n.checked_mul(mult).map(ByteSize).ok_or_else(|| format!("size '{s}' overflows"))
    }
}

/// `control`: one address string (a comma list too) or a list of them, as one comma list.
fn control_addrs<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Addrs {
        One(String),
        Many(Vec<String>),
    }
    Ok(Some(match Addrs::deserialize(d)? {
        Addrs::One(a) => a,
        Addrs::Many(list) => list.join(","),
    }))
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<ByteSize, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(ByteSize(n)),
            Raw::S(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

impl Config {
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
        Config::from_toml(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse { path: path.into(), message },
            e => e,
        })
    }

    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let c: Config = toml::from_str(text).map_err(|e| ConfigError::Parse { path: PathBuf::new(), message: e.to_string() })?;
        c.validate()?;
        Ok(c)
    }

    /// The memory budget and the compute command size this configuration gives on a
    /// machine of `physical` bytes of memory (None: unknown), each as configured or derived
    /// ([`crate::memory::Plan`]).
    pub fn memory_plan(&self, physical: Option<u64>) -> crate::memory::Plan {
        crate::memory::Plan::new(
            self.limits.memory.map(|m| m.0),
            self.compute.memory_per_command.map(|m| m.0),
            self.compute.chunk_bytes(),
            physical,
        )
    }

    /// The `[[tenant]]` entries resolved against the subsystems and the compute chunks.
    pub fn tenants(&self) -> Result<Vec<crate::tenant::TenantPolicy>, ConfigError> {
        let subsystems: Vec<&str> = self.subsystem.iter().map(|s| s.nqn.as_str()).collect();
        crate::tenant::resolve(&self.tenant, &subsystems, self.compute.chunk_bytes())
    }

    /// Checks what TOML types cannot: names, ranges, uniqueness.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.listener.is_empty() {
            return Err(invalid("listener", "at least one listener is needed"));
        }
        let mut addrs = HashSet::new();
        for (i, l) in self.listener.iter().enumerate() {
            if !addrs.insert(l.address) {
                return Err(invalid(format!("listener[{i}].address"), format!("{} is listed twice", l.address)));
            }
        }
        if self.busy_poll_us > limits::BUSY_POLL_US_MAX {
            return Err(invalid("busy_poll_us", format!("must be at most {}", limits::BUSY_POLL_US_MAX)));
        }
        if self.io_threads == 0 || self.io_threads > limits::IO_THREADS_MAX {
            return Err(invalid("io_threads", format!("must be between 1 and {}", limits::IO_THREADS_MAX)));
        }
        self.compute.validate().map_err(|(f, m)| invalid(f, m))?;
        self.limits.validate()?;
        self.volume.validate()?;
        self.tenants()?;
        if !self.pool.is_empty() && self.control.is_none() {
            return Err(invalid("pool", "pools are registered with a control plane: give control too"));
        }
        let mut names = HashSet::new();
        for (i, p) in self.pool.iter().enumerate() {
            if !names.insert(p.name()) {
                return Err(invalid(format!("pool[{i}].name"), format!("pool '{}' is named twice", p.name())));
            }
            check_rate_limit(&format!("pool[{i}]"), p.rate_limit)?;
            if let Some(fair) = &p.fair {
                fair.validate(&format!("pool[{i}]"))?;
            }
        }
        if let Some(m) = self.limits.memory {
            let plan = self.memory_plan(None);
            if m.0 < plan.budget_min() {
                return Err(invalid(
                    "limits.memory",
                    format!(
                        "{} bytes cannot hold one compute command ({} bytes, compute.memory_per_command), its result ({} bytes) \
                         and what one controller's two largest queues always hold ({} bytes): at least {} bytes",
                        m.0,
                        plan.command,
                        limits::RESULT_BYTES_MAX,
                        2 * limits::connection_memory_fixed(limits::QUEUE_DEPTH_MAX as usize),
                        plan.budget_min()
                    ),
                ));
            }
        }
        let mut tags = Vec::new();
        for (i, s) in self.subsystem.iter().enumerate() {
            for (j, n) in s.namespace.iter().enumerate() {
                let Some(t) = n.tag else { continue };
                let f = format!("subsystem[{i}].namespace[{j}].tag");
                if t == 0 || t == u16::MAX {
                    return Err(invalid(f, format!("{t}: must be between 1 and 65534")));
                }
                if tags.contains(&t) {
                    return Err(invalid(f, format!("tag {t} is used twice")));
                }
                tags.push(t);
            }
        }
        self.cluster.validate(&tags).map_err(|(f, m)| invalid(f, m))?;
        let mut nqns = HashSet::new();
        for (i, s) in self.subsystem.iter().enumerate() {
            let f = format!("subsystem[{i}]");
            check_nqn(&s.nqn).map_err(|m| invalid(format!("{f}.nqn"), m))?;
            if s.nqn == nearstore_wire::DISCOVERY_NQN {
                return Err(invalid(format!("{f}.nqn"), "the discovery NQN is reserved for the discovery subsystem"));
            }
            if s.nqn == crate::POOLS_NQN {
                return Err(invalid(format!("{f}.nqn"), "this NQN is reserved for the pool subsystem"));
            }
            if !nqns.insert(&s.nqn) {
                return Err(invalid(format!("{f}.nqn"), format!("duplicate subsystem NQN {}", s.nqn)));
            }
            for (j, h) in s.hosts.iter().enumerate() {
                check_nqn(h).map_err(|m| invalid(format!("{f}.hosts[{j}]"), m))?;
            }
            let mut host_nqns = HashSet::new();
            for (j, h) in s.host.iter().enumerate() {
                check_nqn(&h.nqn).map_err(|m| invalid(format!("{f}.host[{j}].nqn"), m))?;
                if !host_nqns.insert(&h.nqn) {
                    return Err(invalid(format!("{f}.host[{j}].nqn"), format!("host {} has two entries", h.nqn)));
                }
                h.keys(&format!("{f}.host[{j}]"))?;
            }
            if !s.allow_any_host && s.hosts.is_empty() && s.host.is_empty() {
                return Err(invalid(format!("{f}.hosts"), "no host may connect: list hosts or set allow_any_host = true"));
            }
            let mut nsids = HashSet::new();
            for (j, n) in s.namespace.iter().enumerate() {
                let nf = format!("{f}.namespace[{j}]");
                if n.nsid == 0 || n.nsid > limits::NSID_MAX {
                    return Err(invalid(format!("{nf}.nsid"), format!("must be between 1 and {}", limits::NSID_MAX)));
                }
                if !nsids.insert(n.nsid) {
                    return Err(invalid(format!("{nf}.nsid"), format!("duplicate NSID {} in subsystem {}", n.nsid, s.nqn)));
                }
                if ![512, 4096].contains(&n.block_size) {
                    return Err(invalid(format!("{nf}.block_size"), "must be 512 or 4096"));
                }
                match (&n.path, n.memory) {
                    (Some(_), Some(_)) => return Err(invalid(&nf, "give either path or memory, not both")),
                    (None, None) => return Err(invalid(&nf, "give a path (file or block device) or a memory size")),
                    (None, Some(m)) if m.0 == 0 || m.0 % n.block_size as u64 != 0 => {
                        return Err(invalid(format!("{nf}.memory"), "must be a non-zero multiple of block_size"))
                    }
                    (None, Some(_)) if n.size.is_some() => return Err(invalid(format!("{nf}.size"), "only for a path")),
                    _ => {}
                }
                if let Some(i) = &n.inject {
                    if i.errno <= 0 || i.errno >= 4096 {
                        return Err(invalid(format!("{nf}.inject.errno"), "must be an errno between 1 and 4095"));
                    }
                    if i.nth == Some(0) {
                        return Err(invalid(format!("{nf}.inject.nth"), "counts from 1"));
                    }
                    if i.lbas.is_some_and(|[a, b]| a >= b) {
                        return Err(invalid(format!("{nf}.inject.lbas"), "must be [first, end) with first < end"));
                    }
                }
                check_rate_limit(&nf, n.rate_limit)?;
                if let Some(fair) = &n.fair {
                    fair.validate(&nf)?;
                }
            }
        }
        for (i, g) in self.cluster.control_grants.iter().enumerate() {
            if !self.subsystem.iter().any(|s| &s.nqn == g) {
                return Err(invalid(format!("cluster.control_grants[{i}]"), format!("{g} is not a configured subsystem")));
            }
        }
        Ok(())
    }

    /// The one-namespace case: `nearstore target --listen ADDR --namespace PATH`.
    pub fn single(listen: SocketAddr, discovery: Option<SocketAddr>, nqn: &str, ns: NamespaceConfig) -> Config {
        let mut listener = vec![ListenerConfig { address: listen, discovery: false, advertise: None }];
        if let Some(d) = discovery {
            listener.push(ListenerConfig { address: d, discovery: true, advertise: None });
        }
        Config {
            listener,
            subsystem: vec![SubsystemConfig {
                nqn: nqn.into(),
                allow_any_host: true,
                hosts: vec![],
                host: vec![],
                serial: None,
                model: None,
                namespace: vec![ns],
            }],
            metrics: None,
            io_threads: limits::IO_THREADS_DEFAULT,
            net_threads: None,
            busy_poll_us: limits::BUSY_POLL_US_DEFAULT,
            io_engine: IoEngine::Uring,
            compute: Default::default(),
            cluster: Default::default(),
            limits: Default::default(),
            state_dir: None,
            control: None,
            pool: Vec::new(),
            volume: Default::default(),
            tenant: Vec::new(),
        }
    }
}

/// An NQN: "nqn." then a date and a reverse domain, at most 223 bytes, printable ASCII.
pub fn check_nqn(nqn: &str) -> Result<(), String> {
    if !nqn.starts_with("nqn.") {
        return Err(format!("'{nqn}' is not an NQN: it must start with 'nqn.'"));
    }
    if nqn.len() > nearstore_wire::NQN_LEN_MAX {
        return Err(format!("NQN is {} bytes, at most {} allowed", nqn.len(), nearstore_wire::NQN_LEN_MAX));
    }
    if !nqn.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!("'{nqn}' has characters outside printable ASCII"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
        [[listener]]
        address = "127.0.0.1:4420"
        [[subsystem]]
        nqn = "nqn.2026-11.io.nearstore:a"
        allow_any_host = true
        [[subsystem.namespace]]
        nsid = 1
        memory = "1MiB"
    "#;

    #[test]
    fn good_config_parses() {
        let c = Config::from_toml(GOOD).unwrap();
        assert_eq!(c.subsystem[0].namespace[0].memory, Some(ByteSize(1 << 20)));
        assert_eq!(c.io_threads, limits::IO_THREADS_DEFAULT);
        assert_eq!(c.busy_poll_us, limits::BUSY_POLL_US_DEFAULT);
        assert_eq!(c.io_engine, IoEngine::Uring);
    }

    #[test]
    fn control_is_an_address_a_comma_list_or_a_list() {
        #[rustfmt::skip]
        let cases: &[(&str, Option<&str>)] = &[
            ("", None),
            ("control = \"10.0.0.1:9470\"\n", Some("10.0.0.1:9470")),
            ("control = \"a:1,b:2\"\n", Some("a:1,b:2")),
            ("control = [\"a:1\", \"b:2\", \"c\"]\n", Some("a:1,b:2,c")),
        ];
        for (line, want) in cases {
            let c = Config::from_toml(&format!("{line}{GOOD}")).unwrap_or_else(|e| panic!("{line}: {e}"));
            assert_eq!(c.control.as_deref(), *want, "{line}");
        }
        // Anything else is refused.
        assert!(Config::from_toml(&format!("control = 7\n{GOOD}")).is_err());
    }

    #[test]
    fn inject_rule_counts_blocks_of_the_namespace() {
        let text = GOOD.replacen(
            "memory = \"1MiB\"",
            "memory = \"1MiB\"\nblock_size = 4096\ndelay_us = 7\n[subsystem.namespace.inject]\nop = \"write\"\nlbas = [2, 3]\nnth = 4",
            1,
        );
        let c = Config::from_toml(&text).unwrap();
        let n = &c.subsystem[0].namespace[0];
        assert_eq!(n.delay_us, 7);
        let rule = n.inject.as_ref().unwrap().rule(n.block_size);
        let want = crate::dev::inject::Rule {
            kind: Some(crate::dev::inject::Kind::Write),
            range: Some((8192, 12288)),
            nth: Some(4),
            errno: libc::EIO,
        };
        assert_eq!(rule, want);
    }

    /// The machine's memory, limits.memory, compute.memory_per_command; the budget and command
    /// size expected.
    type MemoryCase = (Option<u64>, Option<u64>, Option<u64>, u64, u64);

    /// The memory budget and compute command size a configuration comes to on a machine,
    /// and that with them a Linux host's first controller connects (an admin queue of 32
    /// entries, an I/O queue of 128), as Connect reserves its queues. Each line: the
    /// machine's memory, `limits.memory` and `compute.memory_per_command` as configured,
    /// then the budget and command size expected. The default budget once took no account
    /// of the command size: a 512 MiB machine refused every Connect.
    #[test]
    fn memory_defaults_follow_the_machine() {
        const MIB: u64 = 1 << 20;
        let min = limits::memory_budget_min;
        let chunks = limits::COMPUTE_CHUNK_BYTES_DEFAULT * (limits::COMPUTE_READAHEAD_CHUNKS_DEFAULT as u64 + 1);
        #[rustfmt::skip]
        let cases: &[MemoryCase] = &[
            // Defaults: half the memory, a quarter of that per command, at most 256 MiB.
            (Some(64 << 30), None, None, 32 << 30, 256 * MIB),
            (Some(2 << 30), None, None, 1 << 30, 256 * MIB),
            (Some(1 << 30), None, None, 512 * MIB, 128 * MIB),
            // The qemu guest of tests/kernel/powercut.sh: 512 MiB, of which its kernel reports this.
            (Some(512 * MIB), None, None, 256 * MIB, 64 * MIB),
            (Some(479_645_696), None, None, 239_822_848, 57 * MIB),
            (Some(128 * MIB), None, None, 64 * MIB, 16 * MIB),
            // Too small for half: raised to what one command and one controller need.
            (Some(8 * MIB), None, None, min(chunks), chunks),
            // Memory unknown: the fallback budget.
            (None, None, None, limits::MEMORY_BUDGET_FALLBACK_BYTES, 256 * MIB),
            // Configured: the machine does not matter; a derived command follows the budget.
            (Some(512 * MIB), Some(200 * MIB), None, 200 * MIB, 50 * MIB),
            (Some(64 << 30), Some(200 * MIB), None, 200 * MIB, 50 * MIB),
            (Some(512 * MIB), None, Some(32 * MIB), 256 * MIB, 32 * MIB),
            (Some(512 * MIB), None, Some(256 * MIB), min(256 * MIB), 256 * MIB),
            (Some(512 * MIB), Some(1 << 30), Some(100 * MIB), 1 << 30, 100 * MIB),
        ];
        for &(physical, budget, command, want_budget, want_command) in cases {
            let mut text = GOOD.to_string();
            if let Some(b) = budget {
                text = format!("[limits]\nmemory = {b}\n{text}");
            }
            if let Some(c) = command {
                text = format!("[compute]\nmemory_per_command = {c}\n{text}");
            }
            let cfg = Config::from_toml(&text).unwrap_or_else(|e| panic!("{physical:?} {budget:?} {command:?}: {e}"));
            let plan = cfg.memory_plan(physical);
            let case = format!("machine {physical:?}, limits.memory {budget:?}, memory_per_command {command:?}: {plan:?}");
            assert_eq!((plan.budget, plan.command), (want_budget, want_command), "{case}");
            assert!(plan.budget >= plan.budget_min(), "{case}");
            let memory = crate::memory::Memory::new(plan.budget);
            let admin = memory.reserve_queue(32, plan.command);
            let io = memory.reserve_queue(128, plan.command);
            assert!(admin.is_some() && io.is_some(), "{case}: a controller's queues do not fit");
            assert!(memory.reserve(plan.command).is_some(), "{case}: no compute command fits beside them");
        }
    }

    /// The NVMe Base Specification's example DH-HMAC-CHAP secret.
    const SPEC_KEY: &str = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:";

    /// GOOD's namespace followed by a `[[subsystem.host]]` entry with these lines.
    fn host(lines: &str) -> String {
        format!("memory = \"1MiB\"\n[[subsystem.host]]\nnqn = \"nqn.2014-08.org.example:h\"\n{lines}")
    }

    /// Each bad config names its field.
    #[test]
    fn bad_configs_name_the_field() {
        let cases: &[(&str, &str, &str)] = &[
            ("nsid = 1", "nsid = 0", "subsystem[0].namespace[0].nsid"),
            ("memory = \"1MiB\"", "memory = \"1MiB\"\n[[subsystem.namespace]]\nnsid = 1\nmemory = \"1MiB\"", "duplicate NSID 1"),
            ("nqn = \"nqn.2026-11.io.nearstore:a\"", "nqn = \"iqn.bad\"", "subsystem[0].nqn"),
            ("allow_any_host = true", "allow_any_host = false", "subsystem[0].hosts"),
            ("memory = \"1MiB\"", "memory = \"1MiB\"\nblock_size = 1000", "block_size"),
            ("memory = \"1MiB\"", "memory = \"1XB\"", "unknown size unit"),
            ("memory = \"1MiB\"", "", "give a path"),
            ("nsid = 1", "nsid = 1\ncolour = 3", "unknown field `colour`"),
            ("[[listener]]", "busy_poll_us = 1000000\n[[listener]]", "busy_poll_us"),
            ("[[listener]]", "io_engine = \"aio\"\n[[listener]]", "unknown variant `aio`"),
            ("[[listener]]", "[limits]\nconnections = 0\n[[listener]]", "limits.connections"),
            ("[[listener]]", "[limits]\nconnections_per_address = 0\n[[listener]]", "limits.connections_per_address"),
            ("[[listener]]", "[limits]\ncontrollers_per_host = 2000\n[[listener]]", "limits.controllers_per_host"),
            ("[[listener]]", "[limits]\nconnect_timeout_ms = 5\n[[listener]]", "limits.connect_timeout_ms"),
            ("[[listener]]", "[limits]\nsockets = 5\n[[listener]]", "unknown field `sockets`"),
            // With the command size derived (a quarter, at least its chunks): 3 MiB + 256 KiB + 2 x 896 KiB.
            ("[[listener]]", "[limits]\nmemory = \"4MiB\"\n[[listener]]", "limits.memory: 4194304 bytes cannot hold"),
            ("[[listener]]", "[limits]\nmemory = \"4MiB\"\n[[listener]]", "at least 5242880 bytes"),
            // A command and its result fit, but not a controller's queues besides.
            (
                "[[listener]]",
                "[limits]\nmemory = \"257MiB\"\n[compute]\nmemory_per_command = \"256MiB\"\n[[listener]]",
                "one compute command (268435456 bytes, compute.memory_per_command)",
            ),
            ("memory = \"1MiB\"", "memory = \"1MiB\"\n[subsystem.namespace.inject]\nerrno = 0", "namespace[0].inject.errno"),
            ("memory = \"1MiB\"", "memory = \"1MiB\"\n[subsystem.namespace.inject]\nnth = 0", "namespace[0].inject.nth"),
            ("memory = \"1MiB\"", "memory = \"1MiB\"\n[subsystem.namespace.inject]\nlbas = [8, 8]", "namespace[0].inject.lbas"),
            ("memory = \"1MiB\"", "memory = \"1MiB\"\n[subsystem.namespace.inject]\nop = \"trim\"", "unknown variant `trim`"),
            ("memory = \"1MiB\"", "memory = \"1MiB\"\ndelay_us = -1", "delay_us"),
            (
                "address = \"127.0.0.1:4420\"",
                "address = \"127.0.0.1:4420\"\n[[listener]]\naddress = \"127.0.0.1:4420\"",
                "listener[1].address",
            ),
            ("[[listener]]", "[[pool]]\npath = \"/srv/p0\"\nsize = \"1GiB\"\n[[listener]]", "give control too"),
            (
                "[[listener]]",
                "control = \"127.0.0.1:9470\"\n[[pool]]\npath = \"/a/p0\"\nsize = \"1GiB\"\n[[pool]]\npath = \"/b/p0\"\nsize = \"1GiB\"\n[[listener]]",
                "pool[1].name: pool 'p0' is named twice",
            ),
            ("[[listener]]", "control = \"127.0.0.1:9470\"\n[[pool]]\npath = \"/a/p0\"\n[[listener]]", "missing field `size`"),
            ("nqn = \"nqn.2026-11.io.nearstore:a\"", "nqn = \"nqn.2026-11.io.nearstore:pools\"", "reserved for the pool subsystem"),
            ("[[listener]]", "[volume]\ncache_entries = 1048577\n[[listener]]", "volume.cache_entries: must be at most 1048576"),
            ("[[listener]]", "[volume]\ntranslate_timeout_ms = 0\n[[listener]]", "volume.translate_timeout_ms"),
            ("[[listener]]", "[volume]\ntranslate_timeout_ms = 60001\n[[listener]]", "volume.translate_timeout_ms"),
            ("memory = \"1MiB\"", &host("dhchap_key = \"DHHC-1:00:AAAA:\""), "subsystem[0].host[0].dhchap_key: the key and its CRC are 3 bytes"),
            ("memory = \"1MiB\"", &host("dhchap_key = \"DHHC-1:00:ja6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:\""), "host[0].dhchap_key: the CRC-32"),
            ("memory = \"1MiB\"", &host("dhchap_key = \"DHHC-1:07:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:\""), "host[0].dhchap_key: the transformation"),
            ("memory = \"1MiB\"", &host(&format!("dhchap_ctrl_key = \"{SPEC_KEY}\"")), "host[0].dhchap_ctrl_key: a controller key needs"),
            ("memory = \"1MiB\"", &host(&format!("dhchap_key = \"{SPEC_KEY}\"\ndhchap_ctrl_key = \"x\"")), "host[0].dhchap_ctrl_key: a DH-HMAC-CHAP"),
            ("memory = \"1MiB\"", &host(&format!("dhchap_key = \"{SPEC_KEY}\"\ndhchap_hash = \"md5\"")), "host[0].dhchap_hash"),
            ("memory = \"1MiB\"", &host(&format!("dhchap_key = \"{SPEC_KEY}\"\ndhchap_dhgroup = \"modp1024\"")), "host[0].dhchap_dhgroup"),
            ("memory = \"1MiB\"", &host("dhchap_secret = \"x\""), "unknown field `dhchap_secret`"),
            ("memory = \"1MiB\"", "memory = \"1MiB\"\n[[subsystem.host]]\nnqn = \"bad\"", "subsystem[0].host[0].nqn"),
            ("memory = \"1MiB\"", &format!("{}\n{}", host(""), &host("")["memory = \"1MiB\"\n".len()..]), "host[1].nqn: host nqn.2014-08.org.example:h has two entries"),
            ("memory = \"1MiB\"", "memory = \"1MiB\"\nfair = { bandwidth = \"1KiB\" }", "namespace[0].fair.bandwidth: must be between 1048576"),
            ("memory = \"1MiB\"", "memory = \"1MiB\"\nfair = { bandwidth = \"2TiB\" }", "namespace[0].fair.bandwidth"),
            ("memory = \"1MiB\"", "memory = \"1MiB\"\nfair = { bandwidth = \"1GiB\", write_cost = 0.5 }", "namespace[0].fair.write_cost"),
            ("memory = \"1MiB\"", "memory = \"1MiB\"\nfair = { bandwidth = \"1GiB\", write_cost = 65 }", "namespace[0].fair.write_cost"),
            ("memory = \"1MiB\"", "memory = \"1MiB\"\nfair = { rate = 1 }", "unknown field `rate`"),
            ("memory = \"1MiB\"", "memory = \"1MiB\"\nrate_limit = \"1KiB\"", "namespace[0].rate_limit"),
            (
                "[[listener]]",
                "control = \"127.0.0.1:9470\"\n[[pool]]\npath = \"/a/p0\"\nsize = \"1GiB\"\nfair = { bandwidth = 0 }\n[[listener]]",
                "pool[0].fair.bandwidth",
            ),
        ];
        for (from, to, want) in cases {
            let text = GOOD.replacen(from, to, 1);
            let e = Config::from_toml(&text).expect_err(to).to_string();
            assert!(e.contains(want), "config with {to:?}: error {e:?} should contain {want:?}");
        }
    }

    /// Every configurable range is its named limits: each bound accepted, one past it
    /// refused naming the field. Each line: the settings (a section header included), and
    /// None or the field the error names.
    #[test]
    fn ranges_are_their_limits() {
        use limits::*;
        let cases: Vec<(String, Option<&str>)> = vec![
            (format!("io_threads = {IO_THREADS_MAX}"), None),
            (format!("io_threads = {}", IO_THREADS_MAX + 1), Some("io_threads")),
            ("io_threads = 0".into(), Some("io_threads")),
            (format!("busy_poll_us = {BUSY_POLL_US_MAX}"), None),
            (format!("busy_poll_us = {}", BUSY_POLL_US_MAX + 1), Some("busy_poll_us")),
            (format!("[limits]\nconnect_timeout_ms = {CONNECT_TIMEOUT_MS_MIN}"), None),
            (format!("[limits]\nconnect_timeout_ms = {}", CONNECT_TIMEOUT_MS_MIN - 1), Some("limits.connect_timeout_ms")),
            (format!("[limits]\nconnect_timeout_ms = {CONNECT_TIMEOUT_MS_MAX}"), None),
            (format!("[limits]\nconnect_timeout_ms = {}", CONNECT_TIMEOUT_MS_MAX + 1), Some("limits.connect_timeout_ms")),
            ("[limits]\nqueues_per_address = 1".to_string(), None),
            ("[limits]\nqueues_per_address = 0".to_string(), Some("limits.queues_per_address")),
            (format!("[limits]\nqueues_per_address = {QUEUES_PER_ADDRESS_MAX}"), None),
            (format!("[limits]\nqueues_per_address = {}", QUEUES_PER_ADDRESS_MAX + 1), Some("limits.queues_per_address")),
            (format!("[limits]\ncontrollers_per_host = {CONTROLLERS_PER_SUBSYSTEM_MAX}"), None),
            (format!("[limits]\ncontrollers_per_host = {}", CONTROLLERS_PER_SUBSYSTEM_MAX + 1), Some("limits.controllers_per_host")),
            (format!("[compute]\nthreads = {COMPUTE_THREADS_MAX}"), None),
            (format!("[compute]\nthreads = {}", COMPUTE_THREADS_MAX + 1), Some("compute.threads")),
            ("[compute]\nthreads = 0".into(), Some("compute.threads")),
            ("[compute]\nnice = 19".into(), None),
            ("[compute]\nnice = 0".into(), None),
            ("[compute]\nnice = 20".into(), Some("compute.nice")),
            ("[compute]\nnice = -1".into(), Some("compute.nice")),
            (format!("[compute]\nchunk = {COMPUTE_CHUNK_ALIGN_BYTES}"), None),
            (format!("[compute]\nchunk = {}", COMPUTE_CHUNK_ALIGN_BYTES + 1), Some("compute.chunk")),
            (format!("[compute]\nchunk = {COMPUTE_CHUNK_BYTES_MAX}\nreadahead = 0"), None),
            (format!("[compute]\nchunk = {}", COMPUTE_CHUNK_BYTES_MAX + COMPUTE_CHUNK_ALIGN_BYTES), Some("compute.chunk")),
            (format!("[compute]\nreadahead = {COMPUTE_READAHEAD_CHUNKS_MAX}"), None),
            (format!("[compute]\nreadahead = {}", COMPUTE_READAHEAD_CHUNKS_MAX + 1), Some("compute.readahead")),
            (format!("[compute]\ntimeout_secs = {COMPUTE_TIMEOUT_SECS_MAX}"), None),
            (format!("[compute]\ntimeout_secs = {}", COMPUTE_TIMEOUT_SECS_MAX + 1), Some("compute.timeout_secs")),
            (format!("[compute]\nresult_ttl_secs = {RESULT_TTL_SECS_MAX}"), None),
            (format!("[compute]\nresult_ttl_secs = {}", RESULT_TTL_SECS_MAX + 1), Some("compute.result_ttl_secs")),
            (format!("[cluster]\nconnections_per_peer = {PEER_CONNECTIONS_MAX}"), None),
            (format!("[cluster]\nconnections_per_peer = {}", PEER_CONNECTIONS_MAX + 1), Some("cluster.connections_per_peer")),
            (format!("[cluster]\nread_ahead_bytes = {PEER_READ_AHEAD_BYTES_MIN}"), None),
            (format!("[cluster]\nread_ahead_bytes = {}", PEER_READ_AHEAD_BYTES_MIN - 1), Some("cluster.read_ahead_bytes")),
            (format!("[cluster]\nread_ahead_bytes = {PEER_READ_AHEAD_BYTES_MAX}"), None),
            (format!("[cluster]\nread_ahead_bytes = {}", PEER_READ_AHEAD_BYTES_MAX + 1), Some("cluster.read_ahead_bytes")),
            (format!("[cluster]\ntimeout_secs = {PEER_TIMEOUT_SECS_MAX}"), None),
            (format!("[cluster]\ntimeout_secs = {}", PEER_TIMEOUT_SECS_MAX + 1), Some("cluster.timeout_secs")),
            ("[cluster]\ncontrol_grants = [\"nqn.2026-11.io.nearstore:a\"]".into(), None),
            (
                "[cluster]\ncontrol_grants = [\"nqn.2026-11.io.nearstore:a\", \"nqn.2026-11.io.nearstore:b\"]".into(),
                Some("cluster.control_grants[1]: nqn.2026-11.io.nearstore:b is not a configured subsystem"),
            ),
        ];
        for (settings, refused) in &cases {
            // Top-level keys go before the first table; a section after the subsystem.
            let text = if settings.starts_with('[') { format!("{GOOD}\n{settings}\n") } else { format!("{settings}\n{GOOD}") };
            match (Config::from_toml(&text), refused) {
                (Ok(_), None) => {}
                (Err(e), Some(field)) => assert!(e.to_string().contains(field), "{settings:?}: {e} should name {field}"),
                (r, _) => panic!("{settings:?}: {:?} where {refused:?} was expected", r.map(|_| "accepted")),
            }
        }
        // The defaults are inside the ranges: the shortest configuration is valid.
        let c = Config::from_toml(GOOD).unwrap();
        assert_eq!(
            (c.compute.chunk.0, c.compute.readahead, c.cluster.read_ahead_bytes.0, c.limits.connections_per_address),
            (COMPUTE_CHUNK_BYTES_DEFAULT, COMPUTE_READAHEAD_CHUNKS_DEFAULT, PEER_READ_AHEAD_BYTES_DEFAULT, IO_QUEUES_MAX as usize + 1)
        );
    }

    #[test]
    fn missing_file_names_the_path() {
        let e = Config::from_file(Path::new("/nonexistent/t.toml")).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/t.toml"), "{e}");
    }
}
