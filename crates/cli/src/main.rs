//! The `nearstore` command: one binary, subcommands modelled on nvme-cli and spdk_nvme_perf.

mod compute;
mod control;
mod fused;
mod mount;
mod perf;
mod resv;
mod tools;

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use nearstore_target::config::{ByteSize, Config, NamespaceConfig};

#[derive(Parser)]
#[command(name = "nearstore", version, about = "NVMe/TCP computational storage: target, initiator tools, compute verbs, perf")]
struct Cli {
    /// Errors with the protocol's words too (NVMe status, the field it names).
    #[arg(short = 'v', long, global = true)]
    verbose: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

/// An error said in the user's terms; `detail` holds the protocol's words (the NVMe status),
/// printed with -v.
#[derive(Debug)]
pub struct Plain {
    pub said: String,
    pub detail: String,
}

impl std::fmt::Display for Plain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.said)
    }
}

impl std::error::Error for Plain {}

/// Where `read` and `write` go: a target, a namespace and the first block.
#[derive(clap::Args)]
struct Blocks {
    #[command(flatten)]
    t: TargetArgs,
    /// Namespace ID.
    #[arg(long, default_value_t = 1)]
    nsid: u32,
    /// First LBA (`-s` is the port, as in nvme-cli's fabrics verbs).
    #[arg(long, default_value_t = 0)]
    start_block: u64,
}

/// Where a target is: address and subsystem, in nvme-cli's spellings
/// (`-t tcp -a ADDR -s PORT -n NQN`).
#[derive(clap::Args, Clone)]
pub struct TargetArgs {
    /// Transport type: tcp, the only one.
    #[arg(short = 't', long, default_value = "tcp", value_parser = ["tcp"])]
    pub transport: String,
    /// Target address: HOST, or HOST:PORT.
    #[arg(short = 'a', long = "traddr", default_value = "127.0.0.1")]
    pub traddr: String,
    /// Target port (default 4420), when the address does not give one.
    #[arg(short = 's', long = "trsvcid")]
    pub trsvcid: Option<u16>,
    /// Subsystem NQN.
    #[arg(short = 'n', long = "nqn", default_value = DEFAULT_NQN)]
    pub nqn: String,
    /// Host NQN (default: /etc/nvme/hostnqn or one derived from the machine id).
    #[arg(long)]
    pub hostnqn: Option<String>,
    /// Host Identifier, a UUID: what the target keys reservations by (default: /etc/nvme/hostid
    /// with this machine's host NQN, as nvme-cli's connections; else the UUID the host NQN
    /// ends with, or one derived from it; docs/reservations.md).
    #[arg(long, value_parser = host_id)]
    pub hostid: Option<uuid::Uuid>,
    /// Header digest.
    #[arg(long)]
    pub hdr_digest: bool,
    /// Data digest.
    #[arg(long)]
    pub data_digest: bool,
    /// The host's DH-HMAC-CHAP secret (DHHC-1:..:, from gen-dhchap-key), as nvme-cli's: used
    /// when the target asks this host to authenticate.
    #[arg(long, value_parser = dhchap_secret)]
    pub dhchap_secret: Option<nearstore_dhchap::Secret>,
    /// The controller's DH-HMAC-CHAP secret: the target must prove it holds it
    /// (bidirectional authentication), or the connection is refused.
    #[arg(long, value_parser = dhchap_secret, requires = "dhchap_secret")]
    pub dhchap_ctrl_secret: Option<nearstore_dhchap::Secret>,
}

/// A DH-HMAC-CHAP secret (clap's value parser); the error never repeats the secret.
pub fn dhchap_secret(s: &str) -> Result<nearstore_dhchap::Secret, String> {
    s.parse().map_err(|e: nearstore_dhchap::SecretError| e.to_string())
}

pub const DEFAULT_NQN: &str = "nqn.2026-11.io.nearstore:disk0";

/// A socket address from `-a` and `-s`: HOST:PORT, or HOST and the port (`default_port`
/// when `-s` is not given). A port given both ways is refused unless it is the same.
pub fn address(addr: &str, port: Option<u16>, default_port: u16) -> Result<SocketAddr> {
    let a = resolve(addr, port.unwrap_or(default_port))?;
    match port {
        Some(p) if p != a.port() => bail!("-a {addr} and -s {p} give two ports: give it once"),
        _ => Ok(a),
    }
}

/// A size in bytes, with or without a unit (4096, 4KiB, 1GiB, 10G): clap's value parser.
pub fn size(s: &str) -> Result<u64, String> {
    s.parse::<ByteSize>().map(|b| b.0).map_err(|e| e.to_string())
}

/// A Host Identifier: a UUID (clap's value parser).
pub fn host_id(s: &str) -> Result<uuid::Uuid, String> {
    s.trim().parse::<uuid::Uuid>().map_err(|_| format!("'{s}' is not a UUID"))
}

/// [`size`] as a usize.
pub fn size_usize(s: &str) -> Result<usize, String> {
    usize::try_from(size(s)?).map_err(|_| format!("{s} is too large for this machine"))
}

pub fn resolve(addr: &str, default_port: u16) -> Result<SocketAddr> {
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return Ok(a);
    }
    if let Ok(ip) = addr.trim_matches(['[', ']']).parse::<std::net::IpAddr>() {
        return Ok(SocketAddr::new(ip, default_port));
    }
    let s = if addr.contains(':') { addr.to_string() } else { format!("{addr}:{default_port}") };
    s.to_socket_addrs()
        .with_context(|| format!("resolving address '{addr}'"))?
        .next()
        .with_context(|| format!("address '{addr}' resolves to nothing"))
}

impl TargetArgs {
    pub fn options(&self) -> Result<nearstore_initiator::ConnectOptions> {
        let mut o = nearstore_initiator::ConnectOptions::new(address(&self.traddr, self.trsvcid, 4420)?, &self.nqn);
        // One resolution for every verb (nearstore_initiator::host), so that a host's reads,
        // writes and reservation commands are one registrant, as its kernel connection is.
        let ids = nearstore_initiator::host::resolve(self.hostnqn.as_deref(), self.hostid.map(|u| *u.as_bytes()))?;
        o.hostnqn = ids.hostnqn;
        o.hostid = ids.hostid;
        o.hdgst = self.hdr_digest;
        o.ddgst = self.data_digest;
        o.dhchap_secret = self.dhchap_secret.clone();
        o.dhchap_ctrl_secret = self.dhchap_ctrl_secret.clone();
        Ok(o)
    }
}

#[derive(Clone, Copy, clap::ValueEnum, PartialEq, Eq)]
pub enum Output {
    Normal,
    Json,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run an NVMe/TCP target.
    Target {
        /// TOML configuration (subsystems, namespaces, listeners, hosts).
        #[arg(short, long, conflicts_with_all = ["namespace", "memory"])]
        config: Option<PathBuf>,
        /// Listen address for the one-namespace case.
        #[arg(long, default_value = "127.0.0.1:4420")]
        listen: SocketAddr,
        /// Discovery listener for the one-namespace case (use "none" for none).
        #[arg(long, default_value = "127.0.0.1:8009")]
        discovery: String,
        /// A file or block device to export as namespace 1.
        #[arg(long)]
        namespace: Option<PathBuf>,
        /// Create the namespace file with this size if it does not exist (e.g. 1GiB).
        #[arg(long)]
        size: Option<String>,
        /// Export a memory namespace of this size instead (e.g. 1GiB).
        #[arg(long)]
        memory: Option<String>,
        /// Logical block size: 512 or 4096.
        #[arg(long, default_value_t = 512)]
        block_size: u32,
        /// Keep a MicroTx journal for the fused write operations (--namespace PATH: in
        /// PATH.microtx beside it), as `microtx = true` does in a configuration.
        #[arg(long)]
        microtx: bool,
        /// Subsystem NQN for the one-namespace case.
        #[arg(long, default_value = DEFAULT_NQN)]
        nqn: String,
        /// Address reported in the discovery log instead of the listen address (NAT).
        #[arg(long)]
        advertise: Option<std::net::IpAddr>,
        /// Serve Prometheus metrics on this address.
        #[arg(long)]
        metrics: Option<SocketAddr>,
        /// Network threads (default: one per core).
        #[arg(long)]
        net_threads: Option<usize>,
        /// File/block I/O worker threads.
        #[arg(long)]
        io_threads: Option<usize>,
        /// Microseconds a connection polls its socket after activity before sleeping
        /// (0: never poll; default 200).
        #[arg(long)]
        busy_poll_us: Option<u64>,
        /// File and block I/O: io_uring per connection, or the worker thread pool.
        #[arg(long, value_enum)]
        io_engine: Option<nearstore_target::config::IoEngine>,
        /// Least severe log events written (default info); RUST_LOG, when set and this is
        /// not given, is a finer filter (`warn,nearstore_target::tcp=debug`).
        #[arg(long, value_enum)]
        log_level: Option<LogLevel>,
        /// Log lines as text (colours only on a terminal) or as JSON objects, one a line.
        #[arg(long, value_enum, default_value = "text")]
        log_format: LogFormat,
        /// The control plane to register with and push pool views to (HOST:PORT, or a comma
        /// list of its leader and standbys).
        #[arg(long)]
        control: Option<String>,
        /// A pool for volumes' extents: a file, made or grown to SIZE (repeatable; needs --control).
        #[arg(long, value_name = "PATH:SIZE", value_parser = control::pool_arg)]
        pool: Vec<nearstore_target::config::PoolConfig>,
    },
    /// Run the control plane: pools, volumes, views, over an HTTP/JSON API (docs/control-plane.md).
    Control {
        /// Directory of its state (control.redb), made if missing.
        #[arg(long, required_unless_present = "etcd", conflicts_with = "etcd")]
        store: Option<PathBuf>,
        /// Keep the state in etcd instead, at these client URLs (http://HOST:PORT,...); one
        /// daemon leads, others stand by.
        #[arg(long, value_name = "URL,URL,...", value_delimiter = ',')]
        etcd: Vec<String>,
        /// Seconds of the leader lease in etcd: a standby takes over this long after the leader dies.
        #[arg(long, value_name = "SECONDS", requires = "etcd", default_value_t = nearstore_control::limits::LEASE_TTL_S_DEFAULT,
              value_parser = clap::value_parser!(u64).range(nearstore_control::limits::LEASE_TTL_S_MIN..=nearstore_control::limits::LEASE_TTL_S_MAX))]
        lease_ttl: u64,
        /// The etcd key prefix of the state (several control planes may share one etcd).
        #[arg(long, value_name = "PREFIX", requires = "etcd", default_value = nearstore_control::etcd::PREFIX_DEFAULT)]
        etcd_prefix: String,
        /// Address of the API.
        #[arg(long, default_value = "127.0.0.1:9470")]
        listen: SocketAddr,
        /// A file holding the API's token (its first line, at least 16 printable characters;
        /// the file its owner's alone): every request but GET /v1/health must carry it
        /// (docs/control-plane.md, "Authentication"). Without it the API takes every request.
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// Milliseconds a target serves its volumes' exports without hearing from the control
        /// plane (its export lease); an unexported volume's last exporter is waited for this
        /// long and its write bound before another target may export it, unless it confirms
        /// sooner that it stopped (docs/control-plane.md, "Handing an export over").
        #[arg(long, value_name = "MS", default_value_t = nearstore_control::limits::EXPORT_LEASE_MS_DEFAULT,
              value_parser = clap::value_parser!(u64).range(nearstore_control::limits::EXPORT_LEASE_MS_MIN..=nearstore_control::limits::EXPORT_LEASE_MS_MAX))]
        export_lease_ms: u64,
    },
    /// Show the control plane's live view of the pools (capacity, bandwidth, IOPS, latency).
    View(control::ControlArgs),
    /// Create, list, show, grow, rebalance and delete volumes.
    Volume {
        #[command(subcommand)]
        cmd: control::VolumeCmd,
    },
    /// Create, list, show and delete the control plane's tenants, which every registered
    /// target applies beside its configured ones.
    Tenant {
        #[command(subcommand)]
        cmd: control::TenantCmd,
    },
    /// List, drain and uncordon the control plane's pools.
    Pool {
        #[command(subcommand)]
        cmd: control::PoolCmd,
    },
    /// Print a target's discovery log.
    Discover {
        /// Transport type: tcp, the only one.
        #[arg(short = 't', long, default_value = "tcp", value_parser = ["tcp"])]
        transport: String,
        /// Discovery address: HOST, or HOST:PORT.
        #[arg(short = 'a', long = "traddr", default_value = "127.0.0.1")]
        traddr: String,
        /// Discovery port (default 8009), when the address does not give one.
        #[arg(short = 's', long = "trsvcid")]
        trsvcid: Option<u16>,
        /// Host NQN (default: /etc/nvme/hostnqn or one derived from the machine id).
        #[arg(long)]
        hostnqn: Option<String>,
        /// The host's DH-HMAC-CHAP secret, used when the discovery controller asks this host
        /// to authenticate.
        #[arg(long, value_parser = dhchap_secret)]
        dhchap_secret: Option<nearstore_dhchap::Secret>,
        /// The discovery controller's DH-HMAC-CHAP secret: it must prove it holds it.
        #[arg(long, value_parser = dhchap_secret, requires = "dhchap_secret")]
        dhchap_ctrl_secret: Option<nearstore_dhchap::Secret>,
        /// Output format: normal (nvme-cli's layout) or json.
        #[arg(short = 'o', long, value_enum, default_value = "normal")]
        output_format: Output,
    },
    /// List the namespaces of a subsystem.
    List {
        #[command(flatten)]
        t: TargetArgs,
        /// Output format: normal (text) or json.
        #[arg(short = 'o', long, value_enum, default_value = "normal")]
        output_format: Output,
    },
    /// Identify Controller.
    IdCtrl {
        #[command(flatten)]
        t: TargetArgs,
        /// Output format: normal (text) or json.
        #[arg(short = 'o', long, value_enum, default_value = "normal")]
        output_format: Output,
    },
    /// Identify Namespace.
    IdNs {
        #[command(flatten)]
        t: TargetArgs,
        /// Namespace ID.
        #[arg(long, default_value_t = 1)]
        nsid: u32,
        /// Output format: normal (text) or json.
        #[arg(short = 'o', long, value_enum, default_value = "normal")]
        output_format: Output,
    },
    /// Read blocks into a file (or standard output).
    Read {
        #[command(flatten)]
        b: Blocks,
        /// Bytes to read, with or without a unit (512, 4KiB); rounded up to whole blocks.
        #[arg(short = 'z', long, value_parser = size)]
        data_size: u64,
        /// Output file ("-" for standard output).
        #[arg(short = 'd', long, default_value = "-")]
        data: PathBuf,
    },
    /// Write a file's bytes to blocks (the tail is padded with zeros to a whole block).
    Write {
        #[command(flatten)]
        b: Blocks,
        /// Input file.
        #[arg(short = 'd', long)]
        data: PathBuf,
        /// Force unit access: durable when the command completes.
        #[arg(long)]
        fua: bool,
    },
    /// Write a file's bytes to blocks only if they hold another file's bytes, atomically
    /// against every other writer (NVMe Compare and Write, one fused pair); fails, writing
    /// nothing, when they differ. Both are padded with zeros to whole blocks.
    CompareAndWrite {
        #[command(flatten)]
        b: Blocks,
        /// The bytes the blocks must hold.
        #[arg(short = 'c', long)]
        compare: PathBuf,
        /// The bytes written if they do (as long as --compare).
        #[arg(short = 'd', long)]
        data: PathBuf,
        /// Force unit access: durable when the command completes.
        #[arg(long)]
        fua: bool,
    },
    /// Checksum files where they lie (crc32c, sha256, blake3, ...), like sha256sum.
    Checksum(compute::ChecksumArgs),
    /// Append LevelDB log records to a file, framed and checksummed on its target
    /// (one journaled fused write each); prints each one's crc32c and the new length.
    AppendCrcWrite(fused::AppendArgs),
    /// Write bytes into a file on its target and print the crc32c of exactly them.
    WriteChecksum(fused::WriteChecksumArgs),
    /// Read a file's bytes from its target with the crc32c the target computed of them.
    ReadChecksum(fused::ReadChecksumArgs),
    /// Change a file's bytes in place on its target (replace, add, xor with the data), atomic
    /// against other writers and journaled; prints the crc32c of the new bytes.
    ReadModifyWrite(fused::ModifyArgs),
    /// Compress data into one zstd frame on a file's target and write it at the file's end
    /// (or an offset), journaled; prints the frame's crc32c and length.
    CompressWrite(fused::CompressWriteArgs),
    /// Count lines matching a regular expression (grep -c), matches, or literal hits.
    Grep(compute::GrepArgs),
    /// Count bytes, lines and words (wc).
    Wc(compute::WcArgs),
    /// SQL over CSV or JSON lines files where they lie: aggregates and rows come back,
    /// or rows go into a file next to the input.
    Select(compute::SelectArgs),
    /// Compress a file with zstd on the target, into a file beside it.
    Compress(compute::CompressArgs),
    /// Decompress a zstd file on the target, into a file beside it.
    Decompress(compute::DecompressArgs),
    /// Sort files (lines, or fixed-size records by a key) on the target, into one file.
    Sort(compute::SortArgs),
    /// Merge sorted files (lines, or fixed-size records by a key) on the target, into one.
    Merge(compute::SortArgs),
    /// Copy a file on the target, without its bytes crossing the network.
    Copy(compute::CopyArgs),
    /// Mount a directory of exported namespaces with FUSE: plain reads and writes pass
    /// through, and an operation attached to an open file makes its reads return the
    /// result computed in storage (docs/fuse.md).
    Mount(mount::MountArgs),
    /// Attach an operation to a file under a `nearstore mount` and write the result its
    /// reads return, computed in storage (the ioctl, or `--xattr` the attribute).
    Attach(mount::AttachArgs),
    /// Register, unregister or replace this host's reservation key on a namespace
    /// (nvme resv-register).
    ResvRegister(resv::RegisterArgs),
    /// Acquire a reservation on a namespace, or preempt (and abort) another host's
    /// (nvme resv-acquire).
    ResvAcquire(resv::AcquireArgs),
    /// Release this host's reservation, or clear every registration (nvme resv-release).
    ResvRelease(resv::ReleaseArgs),
    /// Show a namespace's reservation and registrants (nvme resv-report).
    ResvReport(resv::ReportArgs),
    /// Measure IOPS, bandwidth and latency against a target.
    Perf(perf::PerfArgs),
    /// Print a new DH-HMAC-CHAP secret (DHHC-1:XX:..:) for a host's dhchap_key or a
    /// subsystem's dhchap_ctrl_key, as nvme-cli's gen-dhchap-key.
    GenDhchapKey {
        /// Transform the secret with this hash before use: 0 none, 1 SHA-256, 2 SHA-384,
        /// 3 SHA-512 (the key is then as long as the hash).
        #[arg(short = 'm', long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
        hmac: u8,
        /// Key length in bytes: 32, 48 or 64 (default: 32, or the hash's length).
        #[arg(short = 'l', long, value_parser = ["32", "48", "64"])]
        key_length: Option<String>,
        /// The NQN a transformed key is made for (default: this host's NQN).
        #[arg(short = 'n', long)]
        nqn: Option<String>,
    },
    /// Print a shell's completions for nearstore on stdout (docs/operations.md says where they go).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write man pages, generated from this help: nearstore.1 and one per verb
    /// (nearstore-checksum.1, nearstore-perf.1, ...).
    Man {
        /// The directory to write them in (made if missing), e.g. /usr/local/share/man/man1.
        dir: PathBuf,
    },
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

#[derive(Clone, Copy, clap::ValueEnum, PartialEq, Eq)]
enum LogFormat {
    Text,
    Json,
}

/// Logs on stderr: the target's at info, the client verbs' only of problems; RUST_LOG
/// filters finer, --log-level (the target's) wins. Colour codes only on a terminal.
fn init_logs(cmd: &Cmd) {
    let (level, format) = match cmd {
        Cmd::Target { log_level, log_format, .. } => (log_level.map(|l| format!("{l:?}").to_lowercase()), *log_format),
        _ => (None, LogFormat::Text),
    };
    let default = if matches!(cmd, Cmd::Target { .. } | Cmd::Control { .. } | Cmd::Mount(_)) { "info" } else { "warn" };
    let filter = level.or_else(|| std::env::var("RUST_LOG").ok()).unwrap_or_else(|| default.into());
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if format == LogFormat::Json {
        logs.json().init();
    } else {
        logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init();
    }
}

fn main() {
    // Before any thread exists: glibc fixes its arena limit once more than 8 arenas exist
    // (a refusal is logged when the target starts).
    nearstore_target::limit_malloc_arenas();
    let matches = Cli::command().get_matches();
    // A verb asked for JSON (-o json) says its error in JSON too, with the protocol's
    // words, so that a script reads one format.
    let mut verb = matches.subcommand().map(|(_, m)| m);
    while let Some((_, m)) = verb.and_then(|m| m.subcommand()) {
        verb = Some(m);
    }
    let json = verb.and_then(|m| m.try_get_one::<Output>("output_format").ok().flatten()) == Some(&Output::Json);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    init_logs(&cli.cmd);
    let verbose = cli.verbose;
    if let Err(e) = run(cli) {
        let detail = e.chain().find_map(|c| c.downcast_ref::<Plain>()).map(|p| p.detail.as_str());
        if json {
            // On stderr: stdout keeps at most the one document of results.
            eprintln!("{}", serde_json::json!({ "error": message(&e), "status": detail }));
        } else {
            eprintln!("error: {}", message(&e));
            if let Some(d) = detail.filter(|_| verbose) {
                eprintln!("  ({d})");
            }
        }
        std::process::exit(1);
    }
}

/// The error and its causes, each said once: many errors already include their cause's
/// text, which the chain would print a second time.
fn message(e: &anyhow::Error) -> String {
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !msg.contains(&c) {
            msg.push_str(": ");
            msg.push_str(&c);
        }
    }
    msg
}

fn runtime(threads: Option<usize>) -> Result<tokio::runtime::Runtime> {
    let mut b = match threads {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    if let Some(n) = threads.filter(|&n| n > 1) {
        b.worker_threads(n);
    }
    Ok(b.enable_all().build()?)
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Target {
            config,
            listen,
            discovery,
            namespace,
            size,
            memory,
            block_size,
            microtx,
            nqn,
            advertise,
            metrics,
            net_threads,
            io_threads,
            busy_poll_us,
            io_engine,
            log_level: _,
            log_format: _,
            control,
            pool,
        } => {
            let mut cfg = match &config {
                Some(p) => Config::from_file(p)?,
                None => {
                    let disc = if discovery == "none" {
                        None
                    } else {
                        Some(discovery.parse().with_context(|| format!("--discovery: '{discovery}' is not an address"))?)
                    };
                    let parse = |flag: &str, v: &Option<String>| -> Result<Option<ByteSize>> {
                        v.as_ref().map(|s| s.parse::<ByteSize>().map_err(|e| anyhow::anyhow!("{flag}: {e}"))).transpose()
                    };
                    let ns = NamespaceConfig {
                        nsid: 1,
                        path: namespace.clone(),
                        memory: parse("--memory", &memory)?,
                        size: parse("--size", &size)?,
                        block_size,
                        tag: None,
                        delay_us: 0,
                        inject: None,
                        microtx,
                        rate_limit: None,
                        fair: None,
                    };
                    if ns.path.is_none() && ns.memory.is_none() {
                        bail!("give --namespace PATH, --memory SIZE or --config FILE");
                    }
                    let c = Config::single(listen, disc, &nqn, ns);
                    c.validate()?;
                    c
                }
            };
            if advertise.is_some() {
                for l in &mut cfg.listener {
                    l.advertise = advertise;
                }
            }
            if metrics.is_some() {
                cfg.metrics = metrics;
            }
            if let Some(n) = io_threads {
                cfg.io_threads = n;
            }
            if net_threads.is_some() {
                cfg.net_threads = net_threads;
            }
            if let Some(e) = io_engine {
                cfg.io_engine = e;
            }
            if control.is_some() {
                cfg.control = control;
            }
            cfg.pool.extend(pool);
            cfg.validate().context("--pool")?;
            if let Some(us) = busy_poll_us {
                cfg.busy_poll_us = us;
                cfg.validate().context("--busy-poll-us")?;
            }
            runtime(cfg.net_threads)?.block_on(tools::run_target(cfg, config))
        }
        Cmd::Control { store, etcd, lease_ttl, etcd_prefix, listen, token_file, export_lease_ms } => {
            let token = match &token_file {
                Some(f) => Some(
                    nearstore_control::server::Token::new(&control::read_token(f)?).map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?,
                ),
                None => None,
            };
            if !etcd.is_empty() && export_lease_ms < nearstore_control::limits::export_lease_ms_min_with_etcd(lease_ttl) {
                anyhow::bail!(
                    "--export-lease-ms {export_lease_ms}: at least {} with --lease-ttl {lease_ttl}, or every volume stops \
                     while a standby takes over",
                    nearstore_control::limits::export_lease_ms_min_with_etcd(lease_ttl)
                );
            }
            let state = match store {
                Some(dir) => control::State::Redb(dir),
                None => control::State::Etcd(nearstore_control::etcd::Options {
                    endpoints: etcd,
                    prefix: etcd_prefix,
                    lease_ttl_s: lease_ttl,
                    token: token.clone(),
                    export_lease_ms,
                }),
            };
            runtime(None)?.block_on(control::daemon(state, listen, token, export_lease_ms))
        }
        Cmd::View(c) => runtime(Some(1))?.block_on(control::view(c)),
        Cmd::Volume { cmd } => runtime(Some(1))?.block_on(control::volume(cmd)),
        Cmd::Pool { cmd } => runtime(Some(1))?.block_on(control::pool(cmd)),
        Cmd::Tenant { cmd } => runtime(Some(1))?.block_on(control::tenant(cmd)),
        Cmd::Discover { transport: _, traddr, trsvcid, hostnqn, dhchap_secret, dhchap_ctrl_secret, output_format } => {
            let secrets = (dhchap_secret, dhchap_ctrl_secret);
            runtime(Some(1))?.block_on(tools::discover(address(&traddr, trsvcid, 8009)?, hostnqn, secrets, output_format))
        }
        Cmd::List { t, output_format } => runtime(Some(1))?.block_on(tools::list(&t, output_format)),
        Cmd::IdCtrl { t, output_format } => runtime(Some(1))?.block_on(tools::id_ctrl(&t, output_format)),
        Cmd::IdNs { t, nsid, output_format } => runtime(Some(1))?.block_on(tools::id_ns(&t, nsid, output_format)),
        Cmd::Read { b, data_size, data } => runtime(Some(1))?.block_on(tools::read(&b.t, b.nsid, b.start_block, data_size, &data)),
        Cmd::Write { b, data, fua } => runtime(Some(1))?.block_on(tools::write(&b.t, b.nsid, b.start_block, &data, fua)),
        Cmd::CompareAndWrite { b, compare, data, fua } => {
            runtime(Some(1))?.block_on(tools::compare_and_write(&b.t, b.nsid, b.start_block, &compare, &data, fua))
        }
        Cmd::Checksum(a) => compute::checksum(a),
        Cmd::AppendCrcWrite(a) => fused::append(a),
        Cmd::WriteChecksum(a) => fused::write_checksum(a),
        Cmd::ReadChecksum(a) => fused::read_checksum(a),
        Cmd::ReadModifyWrite(a) => fused::read_modify_write(a),
        Cmd::CompressWrite(a) => fused::compress_write(a),
        Cmd::Grep(a) => compute::grep(a),
        Cmd::Wc(a) => compute::wc(a),
        Cmd::Select(a) => compute::select(a),
        Cmd::Compress(a) => compute::compress(a),
        Cmd::Decompress(a) => compute::decompress(a),
        Cmd::Sort(a) => compute::sort("sort", a),
        Cmd::Merge(a) => compute::sort("merge", a),
        Cmd::Copy(a) => compute::copy(a),
        Cmd::Mount(a) => mount::run(a),
        Cmd::Attach(a) => mount::attach(a),
        Cmd::ResvRegister(a) => resv::register(a),
        Cmd::ResvAcquire(a) => resv::acquire(a),
        Cmd::ResvRelease(a) => resv::release(a),
        Cmd::ResvReport(a) => resv::report(a),
        Cmd::Perf(a) => perf::run(a),
        Cmd::GenDhchapKey { hmac, key_length, nqn } => {
            println!("{}", tools::gen_dhchap_key(hmac, key_length.as_deref(), nqn)?);
            Ok(())
        }
        Cmd::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "nearstore", &mut std::io::stdout());
            Ok(())
        }
        Cmd::Man { dir } => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            clap_mangen::generate_to(Cli::command(), &dir).with_context(|| format!("writing man pages into {}", dir.display()))?;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every verb and every argument of `nearstore --help` and of each verb's help, at any
    /// depth, has a description.
    #[test]
    fn every_verb_and_argument_has_help() {
        let missing = nearstore_testkit::without_help(Cli::command(), "nearstore");
        assert!(missing.is_empty(), "arguments without a description:\n{}", missing.join("\n"));
        // The walk reaches the verbs' flattened arguments (the target's address on perf).
        let mut cmd = Cli::command();
        cmd.build();
        let perf = cmd.find_subcommand("perf").expect("perf");
        assert!(perf.get_arguments().any(|a| a.get_id() == "traddr"));
    }
}
