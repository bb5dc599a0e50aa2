//! The cluster map and peer reads (device to device).
//!
//! A descriptor's input extent may carry a device tag in the upper 16 bits of its offset
//! (`nearstore_wire::compute::global`). Tag 0, or the addressed namespace's own tag, is
//! local; any other tag must be a peer of this target's `[cluster]` map, and the
//! offload engine reads those extents from the peer itself over NVMe/TCP, with the
//! userspace initiator, as host `cluster.host_nqn`: no byte goes through the host.
//!
//! ```toml
//! [cluster]
//! host_nqn = "nqn.2026-11.io.nearstore:t1"   # the peers must allow this host
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
//! Bounds: at most `connections_per_peer` streams read from one peer at a time (a
//! command waits for a free one); each keeps at most `read_ahead_bytes` of reads in
//! flight, besides the command's own chunk buffers.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use nearstore_initiator::{ConnectOptions, Controller, IoQueue, PieceReader};
use nearstore_wire::compute::{global, Extent};
use parking_lot::Mutex;
use serde::Deserialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::ByteSize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// The NQN this target connects to its peers with (default: the machine's host NQN).
    pub host_nqn: Option<String>,
    pub connections_per_peer: usize,
    pub read_ahead_bytes: ByteSize,
    pub timeout_secs: u64,
    pub peer: Vec<PeerConfig>,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig { host_nqn: None, connections_per_peer: 4, read_ahead_bytes: ByteSize(4 << 20), timeout_secs: 30, peer: Vec::new() }
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
        if self.connections_per_peer == 0 || self.connections_per_peer > 64 {
            return e("connections_per_peer".into(), "must be between 1 and 64".into());
        }
        let r = self.read_ahead_bytes.0;
        if !(128 << 10..=64 << 20).contains(&r) {
            return e("read_ahead_bytes".into(), format!("{r} bytes: must be between 128 KiB and 64 MiB"));
        }
        if self.timeout_secs == 0 || self.timeout_secs > 3600 {
            return e("timeout_secs".into(), "must be between 1 and 3600".into());
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
struct Conn {
    _ctrl: Controller,
    q: IoQueue,
    block: u64,
    size: u64,
}

struct Peer {
    cfg: PeerConfig,
    idle: Mutex<Vec<Conn>>,
    permits: Arc<Semaphore>,
    stats: PeerStats,
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

    /// Every peer's tag, address and counters, by tag.
    pub fn stats(&self) -> Vec<(u16, SocketAddr, &PeerStats)> {
        let mut v: Vec<_> = self.peers.iter().map(|(t, p)| (*t, p.cfg.address, &p.stats)).collect();
        v.sort_by_key(|x| x.0);
        v
    }

    /// Streams a piece of a peer (a tagged extent) to `f` in order, a few hundred KiB at
    /// a time. `f` returns false to stop early. Errors name the peer.
    pub fn stream(&self, piece: Extent, f: &mut dyn FnMut(&[u8]) -> bool) -> Result<(), String> {
        let tag = piece.tag();
        let peer = self.peers.get(&tag).ok_or_else(|| format!("device tag {tag} is not in the cluster map"))?;
        let mut counted = |b: &[u8]| {
            peer.stats.read_bytes.fetch_add(b.len() as u64, Relaxed);
            f(b)
        };
        let r = self.stream_from(peer, piece, &mut counted);
        if r.is_err() {
            peer.stats.failures.fetch_add(1, Relaxed);
        }
        r
    }

    fn stream_from(&self, peer: &Peer, piece: Extent, f: &mut dyn FnMut(&[u8]) -> bool) -> Result<(), String> {
        let tag = piece.tag();
        let name = format!("peer tag {tag} ({} {} nsid {})", peer.cfg.address, peer.cfg.nqn, peer.cfg.nsid);
        let local = Extent::data(global::offset(piece.offset), piece.len);
        let mut delivered = 0u64;
        // A pooled connection may have died since it was last used (the peer restarted):
        // such a failure before the first byte is retried once on a fresh connection.
        for attempt in 0..2 {
            let (mut conn, reused, permit) = self.checkout(peer).map_err(|e| format!("{name}: {e}"))?;
            let end = local.offset + local.len.div_ceil(conn.block) * conn.block;
            let bad = if !local.offset.is_multiple_of(conn.block) {
                Some(format!("offset {} is not a multiple of its {}-byte block", local.offset, conn.block))
            } else if end > conn.size {
                Some(format!("bytes {}..{end} lie outside its namespace of {} bytes", local.offset, conn.size))
            } else {
                None
            };
            if let Some(m) = bad {
                self.checkin(peer, conn, permit);
                return Err(format!("{name}: {m}"));
            }
            let r = self.read(&mut conn, peer.cfg.nsid, local, delivered, f);
            match r {
                Ok(true) => {
                    self.checkin(peer, conn, permit);
                    return Ok(());
                }
                // Stopped early: reads are still in flight on the connection, so it is not
                // reused (their completions would reach the next stream).
                Ok(false) => return Ok(()),
                Err((e, n)) => {
                    delivered = n;
                    if !(reused && attempt == 0 && delivered == 0) {
                        return Err(format!("{name}: {e}"));
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

    fn checkout(&self, peer: &Peer) -> Result<(Conn, bool, OwnedSemaphorePermit), String> {
        self.rt().block_on(async {
            let permit = tokio::time::timeout(self.timeout, peer.permits.clone().acquire_owned())
                .await
                .map_err(|_| format!("no free connection for {} s", self.timeout.as_secs()))?
                .expect("the semaphore is never closed");
            if let Some(c) = peer.idle.lock().pop() {
                return Ok((c, true, permit));
            }
            peer.stats.connections.fetch_add(1, Relaxed);
            let conn = tokio::time::timeout(self.timeout, self.connect(&peer.cfg))
                .await
                .map_err(|_| format!("connecting took more than {} s", self.timeout.as_secs()))??;
            Ok((conn, false, permit))
        })
    }

    /// Returns a connection to the pool, if nothing is in flight on it (else its late
    /// completions would reach the next stream: it is closed instead).
    fn checkin(&self, peer: &Peer, mut conn: Conn, permit: OwnedSemaphorePermit) {
        if conn.q.queue().in_flight() == 0 {
            peer.idle.lock().push(conn);
        }
        drop(permit);
    }

    async fn connect(&self, p: &PeerConfig) -> Result<Conn, String> {
        let mut opts = ConnectOptions::new(p.address, &p.nqn);
        opts.hostnqn = self.host_nqn.clone();
        opts.hostid = *uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, self.host_nqn.as_bytes()).as_bytes();
        opts.timeout = self.timeout;
        let ctrl = Controller::connect(opts).await.map_err(|e| format!("connecting as {}: {e}", self.host_nqn))?;
        let id = ctrl.identify_namespace(p.nsid).await.map_err(|e| format!("identifying namespace {}: {e}", p.nsid))?;
        let (block, size) = (id.block_size() as u64, id.nsze * id.block_size() as u64);
        if size == 0 {
            return Err(format!("namespace {} is not there", p.nsid));
        }
        let q = ctrl.io_queue(1).await.map_err(|e| format!("opening an I/O queue: {e}"))?;
        Ok(Conn { _ctrl: ctrl, q, block, size })
    }
}
