//! The cluster map and peer reads (device to device).
//!
//! A descriptor's input extent may carry a device tag in the upper 16 bits of its offset
//! (`nearstore_wire::compute::global`). Tag 0, or the addressed namespace's own tag, is
//! local; any other tag must be a peer of this target's `[cluster]` map, and the
//! offload engine reads those extents from the peer itself over NVMe/TCP, with the
//! userspace initiator, as host `cluster.host_nqn`: no byte goes through the host.
//!
//! A target reads a peer only for the host whose command it runs, and the peer decides:
//! the Connect names that host (bytes 768.. of the Connect data, a nearstore extension),
//! and the peer admits the connection only if `host_nqn` is one of its
//! `cluster.trusted_members` and that host is allowed on the subsystem; it confirms in
//! the Connect response (DW1 "NSAF"), and a connection it did not confirm is not used.
//! Connections are pooled per (peer, host), so one host's connection never serves
//! another. Every peer a command names is admitted before a byte of the command is read.
//!
//! The offload engine reads a peer through [`Peers::remote`], the peer's namespace as a
//! block device acting for the command's host ([`crate::dev::remote`]): its operations
//! are tasks on the target's network runtime, with connections from the peer's pool.
//!
//! ```toml
//! [cluster]
//! host_nqn = "nqn.2026-11.io.nearstore:t1"   # the peers must trust this member
//! trusted_members = ["nqn.2026-11.io.nearstore:t2"]   # may read this target for a host
//! connections_per_peer = 4                   # concurrent streams to one peer
//! read_ahead_bytes = "4MiB"                  # reads in flight per stream
//! timeout_secs = 30                          # connecting, and waiting for data
//!
//! [[cluster.peer]]
//! tag = 2
//! address = "10.77.0.12:4420"
//! nqn = "nqn.2026-11.io.nearstore:t2"
//! nsid = 1
//! ```
//!
//! Bounds: at most `connections_per_peer` connections to one peer, busy or idle, for
//! all hosts together (a command waits for a free one; an idle connection of another
//! host is closed to make room); an operation on one keeps at most `read_ahead_bytes` of
//! Reads in flight, into the command's own chunk buffer.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use nearstore_initiator::{ConnectOptions, Controller, Error as InitiatorError, IoQueue};
use nearstore_wire::compute::{global, status as cs};
use nearstore_wire::Status;
use serde::Deserialize;

use crate::config::ByteSize;
use crate::dev::remote::{Pool, Remote, RemoteConfig};
use crate::limits;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// The NQN this target connects to its peers with (default: the machine's host NQN).
    pub host_nqn: Option<String>,
    pub connections_per_peer: usize,
    pub read_ahead_bytes: ByteSize,
    pub timeout_secs: u64,
    pub peer: Vec<PeerConfig>,
    /// Host NQNs of the other targets (their `cluster.host_nqn`) that may connect to this
    /// one acting for a host: such a connection is admitted when that host is allowed.
    pub trusted_members: Vec<String>,
    /// Subsystems of this configuration the control plane may grant to the tenants it
    /// pushes (docs/operations.md, "Tenants from the control plane"). Any other configured
    /// subsystem is this file's alone: a pushed tenant naming it is refused here.
    pub control_grants: Vec<String>,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            host_nqn: None,
            connections_per_peer: limits::PEER_CONNECTIONS_DEFAULT,
            read_ahead_bytes: ByteSize(limits::PEER_READ_AHEAD_BYTES_DEFAULT),
            timeout_secs: limits::PEER_TIMEOUT_SECS_DEFAULT,
            peer: Vec::new(),
            trusted_members: Vec::new(),
            control_grants: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    /// The device's tag in the cluster map: 1 to 65534.
    pub tag: u16,
    pub address: SocketAddr,
    /// The peer's subsystem.
    pub nqn: String,
    #[serde(default = "one")]
    pub nsid: u32,
}

fn one() -> u32 {
    1
}

impl ClusterConfig {
    /// How long after this target stops issuing them its writes to peers' pools may still
    /// change storage there: the longer of a write given up after `timeout_secs`, then its
    /// connection's bound ([`Conn::lost_bound`] at the initiator's keep-alive timeout), and
    /// a compute command with outputs forwarded to a peer's pool (`compute_timeout`, its
    /// time limit there: given up, it ends at twice that and a reset's wait, the peer
    /// keeping its controller alive while it runs, offload/volume.rs); then what the
    /// target's own schedulers may hold back before issuing (`EXPORT_HELD_MS`). What it
    /// tells the control plane (docs/control-plane.md, "Handing an export over").
    pub fn write_bound(&self, compute_timeout: Duration) -> Duration {
        let timeout = Duration::from_secs(self.timeout_secs);
        let kato = Duration::from_millis(u64::from(nearstore_initiator::limits::KATO_MS_DEFAULT));
        let write = timeout + 2 * kato + reset_wait(timeout);
        // Its connection to the peer may take `timeout` after the command was placed.
        let forwarded = timeout + 2 * compute_timeout + reset_wait(timeout);
        write.max(forwarded) + Duration::from_millis(limits::EXPORT_HELD_MS)
    }

    /// Checks ranges and uniqueness; `own` are the tags of this target's namespaces.
    /// Errors name the field as it is written in the TOML file.
    pub fn validate(&self, own: &[u16]) -> Result<(), (String, String)> {
        let e = |f: String, m: String| Err((format!("cluster.{f}"), m));
        if let Some(n) = &self.host_nqn {
            if let Err(m) = crate::config::check_nqn(n) {
                return e("host_nqn".into(), m);
            }
        }
        for (i, m) in self.trusted_members.iter().enumerate() {
            if let Err(m) = crate::config::check_nqn(m) {
                return e(format!("trusted_members[{i}]"), m);
            }
        }
        if self.connections_per_peer == 0 || self.connections_per_peer > limits::PEER_CONNECTIONS_MAX {
            return e("connections_per_peer".into(), format!("must be between 1 and {}", limits::PEER_CONNECTIONS_MAX));
        }
        let r = self.read_ahead_bytes.0;
        let (min, max) = (limits::PEER_READ_AHEAD_BYTES_MIN, limits::PEER_READ_AHEAD_BYTES_MAX);
        if !(min..=max).contains(&r) {
            return e("read_ahead_bytes".into(), format!("{r} bytes: must be between {} KiB and {} MiB", min >> 10, max >> 20));
        }
        if self.timeout_secs == 0 || self.timeout_secs > limits::PEER_TIMEOUT_SECS_MAX {
            return e("timeout_secs".into(), format!("must be between 1 and {}", limits::PEER_TIMEOUT_SECS_MAX));
        }
        let mut seen: Vec<u16> = own.to_vec();
        for (i, p) in self.peer.iter().enumerate() {
            if p.tag == global::LOCAL || p.tag == global::RESERVED {
                return e(
                    format!("peer[{i}].tag"),
                    format!("{}: must be between 1 and 65534 (0 is the addressed namespace, 65535 is reserved)", p.tag),
                );
            }
            if seen.contains(&p.tag) {
                return e(format!("peer[{i}].tag"), format!("tag {} is used twice in the cluster map", p.tag));
            }
            seen.push(p.tag);
            if let Err(m) = crate::config::check_nqn(&p.nqn) {
                return e(format!("peer[{i}].nqn"), m);
            }
            if p.nsid == 0 {
                return e(format!("peer[{i}].nsid"), "must be at least 1".into());
            }
        }
        Ok(())
    }
}

/// An open stream to a peer's namespace: its controller, one I/O queue, and the
/// namespace's geometry.
pub(crate) struct Conn {
    ctrl: Controller,
    pub(crate) q: IoQueue,
    pub(crate) block: u64,
    pub(crate) size: u64,
}

struct Peer {
    cfg: PeerConfig,
    /// Its connections, for every host.
    pool: Arc<Pool>,
}

/// Why reading a peer failed: the status the command fails with (PEER_DENIED, or
/// PEER_FAILED) and a message that names the peer.
#[derive(Debug)]
pub struct PeerError {
    pub status: Status,
    pub message: String,
}

pub(crate) fn failed(message: String) -> PeerError {
    PeerError { status: cs::PEER_FAILED, message }
}

/// Counters of one peer, served by the metrics endpoint.
#[derive(Default)]
pub struct PeerStats {
    /// Bytes read from the peer and handed to operations.
    pub read_bytes: AtomicU64,
    /// Streams that failed (refused, gone, stalled, out of range).
    pub failures: AtomicU64,
    /// Connections opened to it.
    pub connections: AtomicU64,
}

/// The peers of this target and their connections.
pub struct Peers {
    peers: HashMap<u16, Peer>,
    host_nqn: String,
    /// Members that may connect to this target acting for a host.
    trusted: std::collections::HashSet<String>,
    read_ahead_bytes: u64,
    timeout: Duration,
}

impl Peers {
    pub fn new(cfg: &ClusterConfig) -> Peers {
        Peers {
            peers: cfg.peer.iter().map(|p| (p.tag, Peer { cfg: p.clone(), pool: Arc::new(Pool::new(cfg.connections_per_peer)) })).collect(),
            host_nqn: cfg.host_nqn.clone().unwrap_or_else(nearstore_initiator::default_hostnqn),
            trusted: cfg.trusted_members.iter().cloned().collect(),
            read_ahead_bytes: cfg.read_ahead_bytes.0,
            timeout: Duration::from_secs(cfg.timeout_secs),
        }
    }

    /// Bytes of reads in flight on one connection for one operation
    /// (`cluster.read_ahead_bytes`); the offload engine keeps at most as much in its
    /// reads of one input.
    pub fn read_ahead_bytes(&self) -> u64 {
        self.read_ahead_bytes
    }

    /// The NQN this target connects to its peers with (`cluster.host_nqn`).
    pub fn member(&self) -> &str {
        &self.host_nqn
    }

    /// How long connecting to a peer may take (`cluster.timeout_secs`).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub fn knows(&self, tag: u16) -> bool {
        self.peers.contains_key(&tag)
    }

    /// Whether `hostnqn` (another target) may connect to this one acting for a host.
    pub fn trusts(&self, hostnqn: &str) -> bool {
        self.trusted.contains(hostnqn)
    }

    /// How errors name the peer with `tag`.
    pub fn name(&self, tag: u16) -> String {
        match self.peers.get(&tag) {
            Some(p) => format!("peer tag {tag} ({} {} nsid {})", p.cfg.address, p.cfg.nqn, p.cfg.nsid),
            None => format!("device tag {tag}"),
        }
    }

    /// Every peer's tag, address and counters, by tag.
    pub fn stats(&self) -> Vec<(u16, SocketAddr, &PeerStats)> {
        let mut v: Vec<_> = self.peers.iter().map(|(t, p)| (*t, p.cfg.address, p.pool.stats())).collect();
        v.sort_by_key(|x| x.0);
        v
    }

    /// Counts `n` bytes read from the peer with `tag` and handed to an operation.
    pub fn count_read(&self, tag: u16, n: u64) {
        if let Some(p) = self.peers.get(&tag) {
            p.pool.stats().read_bytes.fetch_add(n, Relaxed);
        }
    }

    /// Counts a command failed by the peer with `tag`.
    pub fn count_failure(&self, tag: u16) {
        if let Some(p) = self.peers.get(&tag) {
            p.pool.stats().failures.fetch_add(1, Relaxed);
        }
    }

    /// The peer with `tag` as a device acting for `host`, once the peer has admitted this
    /// target for that host (a pooled connection of that host, or a new one): the check a
    /// command passes before a byte is read. Its connections are the peer's pool, within
    /// `connections_per_peer` for every host together.
    pub async fn remote(&self, tag: u16, host: &str) -> Result<Remote, PeerError> {
        let peer = self.peers.get(&tag).ok_or_else(|| failed(format!("device tag {tag} is not in the cluster map")))?;
        let cfg = RemoteConfig {
            peer: peer.cfg.clone(),
            member: self.host_nqn.clone(),
            host: host.to_string(),
            timeout: self.timeout,
            read_ahead_bytes: self.read_ahead_bytes,
            kato: None,
        };
        Remote::open(cfg, peer.pool.clone()).await.map_err(|e| {
            self.count_failure(tag);
            PeerError { status: e.status, message: format!("{}: {}", self.name(tag), e.message) }
        })
    }
}

/// Opens a connection to `p` as cluster member `member` acting for `host`, with one I/O
/// queue, and identifies the namespace. The peer decides: a refusal is PEER_DENIED. A
/// member reading for itself (`host == member`: a volume's extents in a peer's pool
/// subsystem) names no host.
pub(crate) async fn connect(
    p: &PeerConfig,
    member: &str,
    host: &str,
    timeout: Duration,
    kato: Option<Duration>,
) -> Result<Conn, PeerError> {
    let kato = kato.map(|k| k.as_millis().min(u32::MAX as u128) as u32);
    let ctrl = controller(p, member, host, timeout, kato).await?;
    let id = ctrl.identify_namespace(p.nsid).await.map_err(|e| failed(format!("identifying namespace {}: {e}", p.nsid)))?;
    let block = id.block_size() as u64;
    let size = id.nsze.checked_mul(block).unwrap_or(0);
    if size == 0 {
        return Err(failed(format!("namespace {} is not there (or reports no size or block size)", p.nsid)));
    }
    let q = ctrl.io_queue(1).await.map_err(|e| failed(format!("opening an I/O queue: {e}")))?;
    Ok(Conn { ctrl, q, block, size })
}

impl Conn {
    /// Its controller instance at the peer, for a Cross-Controller Reset of it.
    pub(crate) fn instance(&self) -> nearstore_initiator::Instance {
        self.ctrl.instance()
    }

    /// How long after this connection is given up (its keep-alives stopped) its controller
    /// at the peer has ended what it started, by the peer's own rules, when no reset can
    /// say so: torn down once its keep-alive timeout passes (twice the timeout at most, NVMe
    /// Base 2.3, "Keep Alive Timer"), then its work given a reset's wait to end. A lease: it
    /// assumes that what was sent before is not held in the network for longer. None
    /// without a keep-alive timeout (the peer never ends it by itself). Not for a
    /// connection running a compute command: the peer keeps that controller alive while
    /// the command runs.
    pub(crate) fn lost_bound(&self, timeout: Duration) -> Option<Duration> {
        let kato = self.ctrl.kato();
        (!kato.is_zero()).then(|| 2 * kato + reset_wait(timeout))
    }
}

/// Why a Cross-Controller Reset of a lost controller did not succeed.
#[derive(Debug)]
pub(crate) enum ResetFailed {
    /// The peer took the reset and said that the controller's work has not ended (Command
    /// Interrupted), or had not answered within the reset's wait: that work may still write.
    Running(String),
    /// The peer was not reached or cannot reset it (it does not admit this host, or has no
    /// Cross-Controller Reset).
    Unanswered(String),
}

impl std::fmt::Display for ResetFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ResetFailed::Running(m) => write!(f, "its work is still running at the peer: {m}"),
            ResetFailed::Unanswered(m) => write!(f, "{m}"),
        }
    }
}

/// Cross-Controller Reset of `instance`, a lost controller of `member` acting for `host` at
/// `p`, from a new controller of the same host, which then just closes (a shutdown would
/// flush the peer's namespaces): once it succeeds nothing the lost controller started can
/// still change the peer's storage. Its keep-alive timeout is above the reset's wait: the
/// initiator holds its admin queue meanwhile.
pub(crate) async fn reset_lost(
    p: &PeerConfig,
    member: &str,
    host: &str,
    instance: nearstore_initiator::Instance,
    timeout: Duration,
) -> Result<(), ResetFailed> {
    let wait = reset_wait(timeout);
    let kato = (2 * wait.as_millis()).min(u32::MAX as u128) as u32;
    let ctrl = controller(p, member, host, timeout, Some(kato)).await.map_err(|e| ResetFailed::Unanswered(e.message))?;
    ctrl.cross_controller_reset(instance, wait).await.map_err(reset_failed)
}

/// What a Cross-Controller Reset's error says of the reset controller's work: still
/// running (Command Interrupted, or no answer within the wait: the peer took it), or
/// nothing known (any other error: refused, unsupported, the connection lost).
fn reset_failed(e: InitiatorError) -> ResetFailed {
    match e {
        e @ InitiatorError::Timeout(_) => ResetFailed::Running(e.to_string()),
        InitiatorError::Status { status, what, .. }
            if (status.sct, status.sc) == (Status::COMMAND_INTERRUPTED.sct, Status::COMMAND_INTERRUPTED.sc) =>
        {
            ResetFailed::Running(format!("{what}: {status}"))
        }
        e => ResetFailed::Unanswered(e.to_string()),
    }
}

/// How long a Cross-Controller Reset may take: the target's own limit and a connection's.
pub(crate) fn reset_wait(timeout: Duration) -> Duration {
    Duration::from_millis(limits::CROSS_CONTROLLER_RESET_WAIT_MS) + timeout
}

/// A controller of `p`'s subsystem as cluster member `member` acting for `host` (no I/O
/// queue): [`connect`]'s first step, and what resets a lost one (dev::remote).
/// `kato_ms`: its keep-alive timeout, when not the initiator's default.
pub(crate) async fn controller(
    p: &PeerConfig,
    member: &str,
    host: &str,
    timeout: Duration,
    kato_ms: Option<u32>,
) -> Result<Controller, PeerError> {
    fenced(p.address, &p.nqn, member, host, timeout).await?;
    Controller::connect(connect_options(p, member, host, timeout, kato_ms)).await.map_err(|e| connect_error(e, member, host))
}

/// This process's incarnation: random at its start (never 0), the last 8 bytes of the
/// Host Identifier it connects to peers with, and what it registers with the control plane
/// (docs/control-plane.md, "A restarted exporter").
pub fn incarnation() -> u64 {
    static INCARNATION: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *INCARNATION.get_or_init(|| {
        let random = uuid::Uuid::new_v4();
        u64::from_le_bytes(random.as_bytes()[..8].try_into().expect("8 bytes")).max(1)
    })
}

/// Names this target among those of one machine that share a member NQN (the default
/// one, the machine's): the address of its first I/O listener, the same at each restart
/// where it listens. Set once, before its first connection to a peer; later calls change
/// nothing (targets in one process are one incarnation anyway).
pub fn set_process_address(addr: &str) {
    let _ = PROCESS_ADDRESS.set(addr.to_string());
}

static PROCESS_ADDRESS: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The Host Identifier cluster member `member` connects to peers with: its family, the
/// first 8 bytes of a UUID v5 of its NQN and this target's address
/// ([`set_process_address`]), the same in every process of it and not the Host ID a tool
/// on the same machine derives from that NQN; then this process's [`incarnation`]. A
/// peer's Fence Host Instances resets the family's other incarnations.
pub fn member_hostid(member: &str) -> [u8; 16] {
    let at = PROCESS_ADDRESS.get().map_or("", String::as_str);
    let family = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, format!("nearstore cluster member {member} at {at}").as_bytes());
    let mut id = [0; 16];
    id[..8].copy_from_slice(&family.as_bytes()[..8]);
    id[8..].copy_from_slice(&incarnation().to_le_bytes());
    id
}

/// What fencing this process's earlier ones at a subsystem found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fence {
    /// Reset, their work ended: nothing they sent there can land any more.
    Done,
    /// The subsystem is not there: none of its processes has a controller there.
    Absent,
    /// The peer does not let the member in (for this host): nothing this process sends
    /// there goes through, but an earlier one's controllers there (admitted before a
    /// reload) are not reached: bounded by time only.
    Refused,
    /// The peer does not know the command (not a nearstore target): what they sent there
    /// is bounded by time only.
    Unsupported,
}

/// Subsystems at which this process fenced its earlier ones, by its Host Identifier (its
/// family may be set after a first fence: then it fences again), address and subsystem
/// NQN: once each. Only what holds for every later connection is kept (done, or not a
/// nearstore peer); a subsystem not there or a host refused is asked again.
type FenceKey = ([u8; 16], std::net::SocketAddr, String);
static FENCED: std::sync::LazyLock<parking_lot::Mutex<HashMap<FenceKey, Arc<tokio::sync::OnceCell<Fence>>>>> =
    std::sync::LazyLock::new(Default::default);

/// Forgets every fence done (tests whose peers reuse an earlier test's port).
#[doc(hidden)]
pub fn forget_fences() {
    FENCED.lock().clear();
}

/// Before this process's first controller at subsystem `nqn` of `address`: every
/// controller an earlier incarnation of member `member` left there is reset and its work
/// waited for (Fence Host Instances), so that nothing it sent before it died (a write held
/// at the peer or still in the network) lands after what this one writes. Once per process
/// and subsystem; a failure is tried again by the next connection. A peer that does not
/// know the command (not a nearstore target) is used as it is: an earlier incarnation's
/// writes there are bounded by time only ([`Fence::Unsupported`]).
pub async fn fenced(address: std::net::SocketAddr, nqn: &str, member: &str, host: &str, timeout: Duration) -> Result<Fence, PeerError> {
    let key = (member_hostid(member), address, nqn.to_string());
    let cell = FENCED.lock().entry(key).or_default().clone();
    if let Some(f) = cell.get() {
        return Ok(*f);
    }
    let f = fence_once(address, nqn, member, host, timeout).await?;
    if matches!(f, Fence::Done | Fence::Unsupported) {
        // Two fences at once both ran: either's outcome holds.
        let _ = cell.set(f);
    }
    Ok(f)
}

/// One Fence Host Instances at subsystem `nqn` of `address` ([`fenced`]).
async fn fence_once(address: std::net::SocketAddr, nqn: &str, member: &str, host: &str, timeout: Duration) -> Result<Fence, PeerError> {
    let p = PeerConfig { tag: 0, address, nqn: nqn.to_string(), nsid: 0 };
    let wait = reset_wait(timeout);
    let kato = (2 * wait.as_millis()).min(u32::MAX as u128) as u32;
    let ctrl = match Controller::connect(connect_options(&p, member, host, timeout, Some(kato))).await {
        Ok(c) => c,
        // Refused for its host (an earlier process's controllers admitted before a reload
        // are not reached), or no such subsystem (Connect Invalid Parameters: none there).
        Err(e) if refused_host(&e) => return Ok(Fence::Refused),
        Err(e) if is_status(&e, Status::CONNECT_INVALID_PARAMETERS) => return Ok(Fence::Absent),
        Err(e) => return Err(failed(format!("connecting as {member} to fence its earlier incarnations at {address} {nqn}: {e}"))),
    };
    match ctrl.fence_host_instances(wait).await {
        Ok(()) => Ok(Fence::Done),
        Err(e) if is_status(&e, Status::INVALID_OPCODE) => {
            tracing::warn!(peer = %address, %nqn, "the peer cannot fence this target's earlier incarnations \
                           (Fence Host Instances: Invalid Opcode): what they sent there is bounded by time only");
            Ok(Fence::Unsupported)
        }
        Err(e) => Err(failed(format!("fencing this target's earlier incarnations at {address} {nqn}: {e}"))),
    }
}

/// Whether `e` is a command's completion with `status` (its DNR bit aside).
fn is_status(e: &InitiatorError, status: Status) -> bool {
    matches!(e, InitiatorError::Status { status: s, .. } if (s.sct, s.sc) == (status.sct, status.sc))
}

/// Whether the peer refused the member for its host at Connect.
fn refused_host(e: &InitiatorError) -> bool {
    matches!(e, InitiatorError::ActingForUnconfirmed { .. }) || is_status(e, Status::CONNECT_INVALID_HOST)
}

/// How member `member` connects to `p` for `host`.
fn connect_options(p: &PeerConfig, member: &str, host: &str, timeout: Duration, kato_ms: Option<u32>) -> ConnectOptions {
    let mut opts = ConnectOptions::new(p.address, &p.nqn);
    if let Some(k) = kato_ms {
        opts.kato_ms = k;
    }
    opts.hostnqn = member.to_string();
    opts.hostid = member_hostid(member);
    opts.timeout = timeout;
    opts.acting_for = (host != member).then(|| host.to_string());
    opts
}

/// What a refused Connect of member `member` for `host` says.
fn connect_error(e: InitiatorError, member: &str, host: &str) -> PeerError {
    if refused_host(&e) {
        PeerError {
            status: cs::PEER_DENIED,
            message: format!(
                "does not let {member} read it for host {host}: {e} (the peer's subsystem must allow {host} and its cluster.trusted_members must list {member})"
            ),
        }
    } else {
        failed(format!("connecting as {member} for host {host}: {e}"))
    }
}

#[cfg(test)]
mod reset_tests {
    use super::*;

    /// Only an answer that the work still runs, or no answer within the wait, counts as
    /// running: a doubt then outlives its keep-alive bound (dev::remote).
    #[test]
    fn a_resets_error_says_whether_the_work_still_runs() {
        let status = |s: Status| InitiatorError::Status {
            what: "Cross-Controller Reset".into(),
            status: s,
            cqe: nearstore_wire::Cqe { status: s, ..Default::default() },
        };
        let cases = [
            (status(Status::COMMAND_INTERRUPTED), true),
            (status(Status { dnr: true, ..Status::COMMAND_INTERRUPTED }), true),
            (InitiatorError::Timeout("Cross-Controller Reset".into()), true),
            (status(Status::INVALID_OPCODE.dnr()), false),
            (status(Status::INVALID_FIELD.dnr()), false),
            (status(Status::CROSS_CONTROLLER_RESET_LIMIT_EXCEEDED), false),
            (InitiatorError::Closed, false),
            (InitiatorError::Io { context: "reading".into(), source: std::io::ErrorKind::ConnectionReset.into() }, false),
        ];
        for (e, running) in cases {
            let what = e.to_string();
            assert_eq!(matches!(reset_failed(e), ResetFailed::Running(_)), running, "{what}");
        }
    }
}
