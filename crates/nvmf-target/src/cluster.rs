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
//! host is closed to make room); each keeps at most `read_ahead_bytes` of reads in
//! flight, besides the command's own chunk buffers.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use nearstore_initiator::{ConnectOptions, Controller, Error as InitiatorError, IoQueue, PieceReader};
use nearstore_wire::compute::{global, status as cs, Extent};
use nearstore_wire::Status;
use parking_lot::Mutex;
use serde::Deserialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::ByteSize;
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
    _ctrl: Controller,
    pub(crate) q: IoQueue,
    pub(crate) block: u64,
    pub(crate) size: u64,
}

struct Peer {
    cfg: PeerConfig,
    /// Idle connections with the host each acts for, least recently used first.
    idle: Mutex<Vec<(String, Conn)>>,
    permits: Arc<Semaphore>,
    stats: PeerStats,
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

/// The peers of this target, their idle connections, and the runtime that drives them.
pub struct Peers {
    peers: HashMap<u16, Peer>,
    host_nqn: String,
    /// Members that may connect to this target acting for a host.
    trusted: std::collections::HashSet<String>,
    /// `connections_per_peer`: connections to one peer, busy and idle together.
    per_peer: usize,
    depth: usize,
    timeout: Duration,
    /// Made on first use: a target without peers runs no thread for them.
    rt: std::sync::OnceLock<tokio::runtime::Runtime>,
}

impl Peers {
    pub fn new(cfg: &ClusterConfig) -> Peers {
        Peers {
            peers: cfg
                .peer
                .iter()
                .map(|p| {
                    let permits = Arc::new(Semaphore::new(cfg.connections_per_peer));
                    (p.tag, Peer { cfg: p.clone(), idle: Mutex::new(Vec::new()), permits, stats: PeerStats::default() })
                })
                .collect(),
            host_nqn: cfg.host_nqn.clone().unwrap_or_else(nearstore_initiator::default_hostnqn),
            trusted: cfg.trusted_members.iter().cloned().collect(),
            per_peer: cfg.connections_per_peer,
            depth: (cfg.read_ahead_bytes.0 / nearstore_initiator::stream::IO_BYTES).max(1) as usize,
            timeout: Duration::from_secs(cfg.timeout_secs),
            rt: std::sync::OnceLock::new(),
        }
    }

    fn rt(&self) -> &tokio::runtime::Runtime {
        self.rt.get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("nearstore-peers")
                .enable_all()
                .build()
                .expect("building the peer runtime")
        })
    }

    pub fn knows(&self, tag: u16) -> bool {
        self.peers.contains_key(&tag)
    }

    /// Whether `hostnqn` (another target) may connect to this one acting for a host.
    pub fn trusts(&self, hostnqn: &str) -> bool {
        self.trusted.contains(hostnqn)
    }

    /// Checks that every peer in `tags` lets this target read it for `host`, before a
    /// command reads anything: a pooled connection for that host is proof, else one is
    /// opened (and kept for the command's streams).
    pub fn admit(&self, tags: &[u16], host: &str) -> Result<(), PeerError> {
        for &tag in tags {
            let peer = self.peers.get(&tag).ok_or_else(|| failed(format!("device tag {tag} is not in the cluster map")))?;
            match self.checkout(peer, host) {
                Ok((conn, _, permit)) => self.checkin(peer, host, conn, permit),
                Err(e) => {
                    peer.stats.failures.fetch_add(1, Relaxed);
                    return Err(PeerError { status: e.status, message: format!("{}: {}", self.name(tag, peer), e.message) });
                }
            }
        }
        Ok(())
    }

    fn name(&self, tag: u16, peer: &Peer) -> String {
        format!("peer tag {tag} ({} {} nsid {})", peer.cfg.address, peer.cfg.nqn, peer.cfg.nsid)
    }

    /// Every peer's tag, address and counters, by tag.
    pub fn stats(&self) -> Vec<(u16, SocketAddr, &PeerStats)> {
        let mut v: Vec<_> = self.peers.iter().map(|(t, p)| (*t, p.cfg.address, &p.stats)).collect();
        v.sort_by_key(|x| x.0);
        v
    }

    /// Streams a piece of a peer (a tagged extent) to `f` in order, a few hundred KiB at
    /// a time, read for `host`. `f` returns false to stop early. Errors name the peer.
    pub fn stream(&self, piece: Extent, host: &str, f: &mut dyn FnMut(&[u8]) -> bool) -> Result<(), PeerError> {
        let tag = piece.tag();
        let peer = self.peers.get(&tag).ok_or_else(|| failed(format!("device tag {tag} is not in the cluster map")))?;
        let mut counted = |b: &[u8]| {
            peer.stats.read_bytes.fetch_add(b.len() as u64, Relaxed);
            f(b)
        };
        let r = self.stream_from(peer, piece, host, &mut counted);
        if r.is_err() {
            peer.stats.failures.fetch_add(1, Relaxed);
        }
        r
    }

    fn stream_from(&self, peer: &Peer, piece: Extent, host: &str, f: &mut dyn FnMut(&[u8]) -> bool) -> Result<(), PeerError> {
        let name = self.name(piece.tag(), peer);
        let local = Extent::data(global::offset(piece.offset), piece.len);
        let mut delivered = 0u64;
        // A pooled connection may have died since it was last used (the peer restarted):
        // such a failure before the first byte is retried once on a fresh connection.
        for attempt in 0..2 {
            let (mut conn, reused, permit) =
                self.checkout(peer, host).map_err(|e| PeerError { status: e.status, message: format!("{name}: {}", e.message) })?;
            let end = local.offset + local.len.div_ceil(conn.block) * conn.block;
            let bad = if !local.offset.is_multiple_of(conn.block) {
                Some(format!("offset {} is not a multiple of its {}-byte block", local.offset, conn.block))
            } else if end > conn.size {
                Some(format!("bytes {}..{end} lie outside its namespace of {} bytes", local.offset, conn.size))
            } else {
                None
            };
            if let Some(m) = bad {
                self.checkin(peer, host, conn, permit);
                return Err(failed(format!("{name}: {m}")));
            }
            let r = self.read(&mut conn, peer.cfg.nsid, local, delivered, f);
            match r {
                Ok(true) => {
                    self.checkin(peer, host, conn, permit);
                    return Ok(());
                }
                // Stopped early: reads are still in flight on the connection, so it is not
                // reused (their completions would reach the next stream).
                Ok(false) => return Ok(()),
                Err((e, n)) => {
                    delivered = n;
                    if !(reused && attempt == 0 && delivered == 0) {
                        return Err(failed(format!("{name}: {e}")));
                    }
                }
            }
        }
        unreachable!("the second attempt returns")
    }

    /// Reads `local` from the peer, skipping the first `skip` bytes (already delivered):
    /// true when it read it all, false when `f` stopped it. On failure, the error and the
    /// bytes delivered so far.
    fn read(&self, conn: &mut Conn, nsid: u32, local: Extent, skip: u64, f: &mut dyn FnMut(&[u8]) -> bool) -> Result<bool, (String, u64)> {
        let (block, timeout, depth) = (conn.block, self.timeout, self.depth);
        self.rt().block_on(async {
            let mut r = PieceReader::new(conn.q.queue(), nsid, block, [local]).depth(depth);
            let mut at = 0u64;
            loop {
                let c = match tokio::time::timeout(timeout, r.next()).await {
                    Ok(Ok(Some(c))) => c,
                    Ok(Ok(None)) => return Ok(true),
                    Ok(Err(e)) => return Err((e.to_string(), at.max(skip))),
                    Err(_) => return Err((format!("no data for {} s", timeout.as_secs()), at.max(skip))),
                };
                let n = c.len() as u64;
                let from = skip.saturating_sub(at).min(n) as usize;
                at += n;
                if from < c.len() && !f(&c[from..]) {
                    return Ok(false);
                }
            }
        })
    }

    /// A connection to `peer` acting for `host`: an idle one of that host, else a new one
    /// (closing the least recently used idle connection of another host when the peer's
    /// connections are all open).
    fn checkout(&self, peer: &Peer, host: &str) -> Result<(Conn, bool, OwnedSemaphorePermit), PeerError> {
        self.rt().block_on(async {
            let permit = tokio::time::timeout(self.timeout, peer.permits.clone().acquire_owned())
                .await
                .map_err(|_| failed(format!("no free connection for {} s", self.timeout.as_secs())))?
                .expect("the semaphore is never closed");
            {
                let mut idle = peer.idle.lock();
                if let Some(i) = idle.iter().rposition(|(h, _)| h == host) {
                    return Ok((idle.remove(i).1, true, permit));
                }
                let busy = self.per_peer - peer.permits.available_permits();
                while !idle.is_empty() && idle.len() + busy > self.per_peer {
                    idle.remove(0);
                }
            }
            peer.stats.connections.fetch_add(1, Relaxed);
            let conn = tokio::time::timeout(self.timeout, self.connect(&peer.cfg, host))
                .await
                .map_err(|_| failed(format!("connecting took more than {} s", self.timeout.as_secs())))??;
            Ok((conn, false, permit))
        })
    }

    /// Returns a connection to the pool of its host, if nothing is in flight on it (else
    /// its late completions would reach the next stream: it is closed instead).
    fn checkin(&self, peer: &Peer, host: &str, mut conn: Conn, permit: OwnedSemaphorePermit) {
        if conn.q.queue().in_flight() == 0 {
            peer.idle.lock().push((host.to_string(), conn));
        }
        drop(permit);
    }

    async fn connect(&self, p: &PeerConfig, host: &str) -> Result<Conn, PeerError> {
        connect(p, &self.host_nqn, host, self.timeout).await
    }

    /// The peer with `tag` as a device acting for `host`, its connections counted with
    /// every other stream to that peer (`connections_per_peer`).
    pub async fn remote(&self, tag: u16, host: &str) -> Result<crate::dev::remote::Remote, PeerError> {
        let peer = self.peers.get(&tag).ok_or_else(|| failed(format!("device tag {tag} is not in the cluster map")))?;
        let cfg = crate::dev::remote::RemoteConfig {
            peer: peer.cfg.clone(),
            member: self.host_nqn.clone(),
            host: host.to_string(),
            timeout: self.timeout,
        };
        crate::dev::remote::Remote::open(cfg, peer.permits.clone()).await.map_err(|e| {
            peer.stats.failures.fetch_add(1, Relaxed);
            PeerError { status: e.status, message: format!("{}: {}", self.name(tag, peer), e.message) }
        })
    }
}

/// Opens a connection to `p` as cluster member `member` acting for `host`, with one I/O
/// queue, and identifies the namespace. The peer decides: a refusal is PEER_DENIED.
pub(crate) async fn connect(p: &PeerConfig, member: &str, host: &str, timeout: Duration) -> Result<Conn, PeerError> {
    let mut opts = ConnectOptions::new(p.address, &p.nqn);
    opts.hostnqn = member.to_string();
    opts.hostid = *uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, member.as_bytes()).as_bytes();
    opts.timeout = timeout;
    opts.acting_for = Some(host.to_string());
    let ctrl = Controller::connect(opts).await.map_err(|e| {
            let denied = matches!(&e, InitiatorError::ActingForUnconfirmed { .. })
                || matches!(&e, InitiatorError::Status { status, .. } if status.sct == Status::CONNECT_INVALID_HOST.sct && status.sc == Status::CONNECT_INVALID_HOST.sc);
            if denied {
                PeerError {
                    status: cs::PEER_DENIED,
                    message: format!(
                        "does not let {} read it for host {host}: {e} (the peer's subsystem must allow {host} and its cluster.trusted_members must list {})",
                        member, member
                    ),
                }
            } else {
                failed(format!("connecting as {} for host {host}: {e}", member))
            }
        })?;
    let id = ctrl.identify_namespace(p.nsid).await.map_err(|e| failed(format!("identifying namespace {}: {e}", p.nsid)))?;
    let block = id.block_size() as u64;
    let size = id.nsze.checked_mul(block).unwrap_or(0);
    if size == 0 {
        return Err(failed(format!("namespace {} is not there (or reports no size or block size)", p.nsid)));
    }
    let q = ctrl.io_queue(1).await.map_err(|e| failed(format!("opening an I/O queue: {e}")))?;
    Ok(Conn { _ctrl: ctrl, q, block, size })
}
