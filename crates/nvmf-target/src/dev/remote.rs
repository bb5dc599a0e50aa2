//! A namespace of another target as a device: read and written over NVMe/TCP with our
//! initiator, on the runtime of the task that submits (no thread, no second runtime).
//!
//! The device acts for one host ([`crate::cluster`], "acting for"): every connection it
//! opens names that host in its Connect, and the peer decides whether to admit it
//! (refused: [`cs::PEER_DENIED`](nearstore_wire::compute::status::PEER_DENIED) from
//! [`Remote::open`]). Connections live in the peer's [`Pool`], each kept for the host it
//! was opened for: busy and idle together at most `connections_per_peer` for every host
//! (opening one for a host closes the least recently used idle one of another host when
//! the peer's connections are all open). Each operation is a task that takes a connection
//! of its host (waiting at most `timeout_secs` for one), runs the operation as commands of
//! at most the peer's transfer size, `read_ahead_bytes` of them in flight, and sends the
//! completion to the channel; a connection that failed, timed out or still has commands
//! in flight is closed, not pooled. A pooled connection that is found dead (the peer
//! restarted) is replaced once, on a fresh connection.
//!
//! A failure is an [`io::Error`] whose inner error is a [`PeerIoError`]: the peer's NVMe
//! status when it answered with one ([`peer_status`]), and a message naming the peer.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use nearstore_initiator::{Data, Error as InitiatorError, QueuePair};
use nearstore_transport::AlignedBuf;
use nearstore_wire::opcode::io as opc;
use nearstore_wire::{Sqe, Status};
use parking_lot::Mutex;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{BlockDevice, Channel, Geometry, Op, Reply};
use crate::cluster::{self, Conn, PeerConfig, PeerError, PeerStats};

/// Ranges of one Dataset Management command (NVMe Base 2.0, "Dataset Management":
/// NR is 0's based in 8 bits).
const DSM_RANGES_MAX: usize = 256;
/// Blocks of one Write Zeroes command (NLB is 0's based in 16 bits).
const WRITE_ZEROES_BLOCKS_MAX: u64 = 1 << 16;

/// Why a remote operation failed.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct PeerIoError {
    /// The status the peer completed the command with; None when it did not answer
    /// (connection lost, timed out) or the operation was refused before it was sent.
    pub status: Option<Status>,
    pub message: String,
}

/// The peer's NVMe status inside an error of a remote operation.
pub fn peer_status(e: &io::Error) -> Option<Status> {
    e.get_ref().and_then(|i| i.downcast_ref::<PeerIoError>()).and_then(|p| p.status)
}

fn error(kind: io::ErrorKind, status: Option<Status>, message: String) -> io::Error {
    io::Error::new(kind, PeerIoError { status, message })
}

/// The io::ErrorKind of a status the peer answered with.
fn kind_of(s: Status) -> io::ErrorKind {
    if s.sct == Status::LBA_OUT_OF_RANGE.sct && s.sc == Status::LBA_OUT_OF_RANGE.sc {
        io::ErrorKind::InvalidInput
    } else if s.sct == Status::RESERVATION_CONFLICT.sct && s.sc == Status::RESERVATION_CONFLICT.sc {
        io::ErrorKind::PermissionDenied
    } else {
        io::ErrorKind::Other
    }
}

/// Where the device reads and for whom.
#[derive(Clone, Debug)]
pub struct RemoteConfig {
    pub peer: PeerConfig,
    /// This target's cluster NQN (`cluster.host_nqn`): the peer must trust it.
    pub member: String,
    /// The host this device acts for.
    pub host: String,
    /// Connecting, waiting for a free connection, and each operation.
    pub timeout: Duration,
    /// Bytes of one operation's commands in flight on its connection
    /// (`cluster.read_ahead_bytes`; at least one command).
    pub read_ahead_bytes: u64,
    /// The keep-alive timeout its connections ask for (None: the initiator's, 10 s): how
    /// soon the peer ends a lost one's controller by itself.
    pub kato: Option<Duration>,
}

/// What went over one link (this target to a peer), counted where each operation completes:
/// the volume data path's reads and writes of the peer's pools, successful ones, their bytes
/// and their time from the device's submission to the peer's completion (connection and
/// queueing included).
#[derive(Default, Debug)]
pub struct LinkStats {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub read_bytes: AtomicU64,
    pub write_bytes: AtomicU64,
    pub read_ns: AtomicU64,
    pub write_ns: AtomicU64,
}

impl LinkStats {
    fn done(&self, op: &Op, len: u64, ns: u64) {
        let (n, bytes, time) = match op {
            Op::Read { .. } => (&self.reads, &self.read_bytes, &self.read_ns),
            Op::Write { .. } => (&self.writes, &self.write_bytes, &self.write_ns),
            _ => return,
        };
        n.fetch_add(1, Relaxed);
        bytes.fetch_add(len, Relaxed);
        time.fetch_add(ns, Relaxed);
    }
}

/// Every link of this target, by peer address: at most one a peer, kept as long as the
/// target (a peer's counters survive its connections' pools).
#[derive(Default, Debug)]
pub struct Links {
    map: Mutex<HashMap<SocketAddr, Arc<LinkStats>>>,
}

impl Links {
    /// The link to `peer`, made on first use.
    pub fn of(&self, peer: SocketAddr) -> Arc<LinkStats> {
        self.map.lock().entry(peer).or_default().clone()
    }

    /// Every link's counters, by peer address.
    pub fn snapshot(&self) -> Vec<(SocketAddr, Arc<LinkStats>)> {
        let mut v: Vec<_> = self.map.lock().iter().map(|(a, s)| (*a, s.clone())).collect();
        v.sort_by_key(|x| x.0);
        v
    }
}

/// The connections to one peer, for every host: idle ones by the host each acts for
/// (least recently used first), and a permit per busy one.
pub struct Pool {
    idle: Mutex<Vec<(String, Conn)>>,
    /// `connections_per_peer`: a permit per busy connection; idle ones are closed to make
    /// room, so busy and idle together stay within it.
    permits: Arc<Semaphore>,
    per_peer: usize,
    stats: PeerStats,
    /// What its successful reads and writes moved, when a link view counts them.
    link: Option<Arc<LinkStats>>,
    /// Writes of this pool's devices that may still change the peer's storage: those
    /// running, and those whose connection closed with them in flight.
    writes: Mutex<Writes>,
    /// Bumped at every change of `writes`, for [`Pool::quiesced`].
    changed: tokio::sync::watch::Sender<u64>,
}

/// Bytes `len` at `off` of namespace `nsid` of the peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Range {
    nsid: u32,
    off: u64,
    len: u64,
}

impl Range {
    fn overlaps(&self, o: &Range) -> bool {
        self.nsid == o.nsid && self.off < o.off.saturating_add(o.len) && o.off < self.off.saturating_add(self.len)
    }

    /// What `op` writes on namespace `nsid` (None: it writes nothing).
    fn written(nsid: u32, op: &Op, buf: &AlignedBuf) -> Option<Range> {
        let (off, end) = match *op {
            Op::Write { off, .. } => (off, off.saturating_add(buf.len() as u64)),
            Op::WriteZeroes { off, len, .. } => (off, off.saturating_add(len)),
            Op::Deallocate => buf.chunks_exact(16).fold(None, |acc: Option<(u64, u64)>, r| {
                let off = u64::from_le_bytes(r[..8].try_into().expect("8 bytes"));
                let end = off.saturating_add(u64::from_le_bytes(r[8..].try_into().expect("8 bytes")));
                Some(acc.map_or((off, end), |(a, b)| (a.min(off), b.max(end))))
            })?,
            Op::Read { .. } | Op::Flush => return None,
        };
        Some(Range { nsid, off, len: end - off })
    }
}

/// A controller at the peer closed with a write in flight (a timeout, a lost connection,
/// a cancelled operation), whom it was opened for, and the bytes that write reaches: it may
/// still land there until a Cross-Controller Reset from another controller of the same
/// host says it cannot.
#[derive(Clone)]
struct Doubt {
    instance: nearstore_initiator::Instance,
    cfg: RemoteConfig,
    range: Range,
    /// When the peer has ended the controller by its own rules if no reset reached it
    /// (a peer out of reach, one without Cross-Controller Reset, one that no longer admits
    /// this target): its keep-alive timeout passed twice, then a reset's wait for its work
    /// (`cluster::Conn::lost_bound`). None: never by itself (no keep-alive timeout, or the
    /// peer said its work still runs).
    ends: Option<tokio::time::Instant>,
}

#[derive(Default)]
struct Writes {
    next: u64,
    /// Writes submitted and not ended, by id: from their submission (before a byte is
    /// sent) until their completion or their doubt.
    running: Vec<(u64, Range)>,
    doubts: Vec<Doubt>,
    /// A task resets the doubts.
    resetting: bool,
}

/// A write of a pool's device, counted until it is dropped.
struct Running {
    pool: Arc<Pool>,
    id: u64,
    range: Range,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.pool.writes.lock().running.retain(|(id, _)| *id != self.id);
        self.pool.changed.send_modify(|v| *v += 1);
    }
}

impl Pool {
    pub fn new(per_peer: usize) -> Pool {
        Pool {
            idle: Mutex::new(Vec::new()),
            permits: Arc::new(Semaphore::new(per_peer)),
            per_peer,
            stats: PeerStats::default(),
            link: None,
            writes: Mutex::new(Writes::default()),
            changed: tokio::sync::watch::Sender::new(0),
        }
    }

    /// Counts its reads and writes in `link` too.
    pub fn counted(mut self, link: Arc<LinkStats>) -> Pool {
        self.link = Some(link);
        self
    }

    /// The peer's counters (connections opened, bytes read, failures).
    pub fn stats(&self) -> &PeerStats {
        &self.stats
    }

    /// Controllers at the peer closed with writes in flight and not reset there yet.
    pub fn in_doubt(&self) -> usize {
        self.writes.lock().doubts.len()
    }

    /// Counts a write of `range` from now until the guard goes.
    fn running(self: &Arc<Self>, range: Range) -> Running {
        let mut w = self.writes.lock();
        w.next += 1;
        let id = w.next;
        w.running.push((id, range));
        Running { pool: self.clone(), id, range }
    }

    fn doubted(&self, range: &Range) -> bool {
        self.writes.lock().doubts.iter().any(|d| d.range.overlaps(range))
    }

    /// True while a write of this pool reaching `range` runs or is in doubt.
    fn unsettled(&self, range: &Range, except: Option<u64>) -> bool {
        let w = self.writes.lock();
        w.running.iter().any(|(id, r)| Some(*id) != except && r.overlaps(range)) || w.doubts.iter().any(|d| d.range.overlaps(range))
    }

    /// Waits until no write of this pool's devices can still change `len` bytes at `off` of
    /// namespace `nsid` of the peer: none running, and every controller closed with one in
    /// flight reset at the peer; at most `wait`.
    pub async fn quiesced(&self, nsid: u32, off: u64, len: u64, wait: Duration) -> io::Result<()> {
        self.settled(Range { nsid, off, len }, None, wait).await
    }

    /// Waits, at most `wait`, until a write of `range` put in doubt is reset at the peer
    /// (and no other write there runs, `except` apart); at once when none is in doubt.
    async fn outlive_doubt(&self, range: Range, except: Option<u64>, wait: Duration) -> io::Result<()> {
        if !self.doubted(&range) {
            return Ok(());
        }
        self.settled(range, except, wait).await
    }

    /// [`quiesced`](Self::quiesced) of `range`, the running write `except` (the caller's
    /// own) apart.
    async fn settled(&self, range: Range, except: Option<u64>, wait: Duration) -> io::Result<()> {
        let mut rx = self.changed.subscribe();
        let settled = tokio::time::timeout(wait, async {
            while self.unsettled(&range, except) {
                if rx.changed().await.is_err() {
                    return;
                }
            }
        })
        .await
        .is_ok();
        if settled {
            return Ok(());
        }
        let (running, doubts) = {
            let w = self.writes.lock();
            (w.running.iter().filter(|(_, r)| r.overlaps(&range)).count(), w.doubts.iter().filter(|d| d.range.overlaps(&range)).count())
        };
        Err(error(
            io::ErrorKind::TimedOut,
            None,
            format!(
                "after {} ms, {running} write(s) still running there and {doubts} connection(s) closed with writes in flight not reset at the peer",
                wait.as_millis()
            ),
        ))
    }

    /// `conn` (opened for `cfg`) is closed with a write of `range` in flight: its controller
    /// is reset at the peer, from a new controller of the same host, by a task that tries
    /// every doubt again, pausing longer each round ([`DOUBT_RETRY`] to
    /// [`DOUBT_RETRY_MAX`]) while the peer does not answer.
    fn doubt(self: &Arc<Self>, conn: &Conn, cfg: &RemoteConfig, range: Range) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::error!(peer = %cfg.peer.address, "a connection closed with a write in flight off a runtime: its controller cannot be reset");
            return;
        };
        let ends = conn.lost_bound(cfg.timeout).map(|b| tokio::time::Instant::now() + b);
        let d = Doubt { instance: conn.instance(), cfg: cfg.clone(), range, ends };
        let start = {
            let mut w = self.writes.lock();
            w.doubts.push(d);
            !std::mem::replace(&mut w.resetting, true)
        };
        self.changed.send_modify(|v| *v += 1);
        if !start {
            return;
        }
        let pool = self.clone();
        rt.spawn(async move {
            let mut pause = DOUBT_RETRY;
            loop {
                let doubts = {
                    let mut w = pool.writes.lock();
                    w.resetting = !w.doubts.is_empty();
                    w.doubts.clone()
                };
                if doubts.is_empty() {
                    return;
                }
                let mut failed = false;
                let same = |x: &Doubt, d: &Doubt| x.instance == d.instance && x.cfg.peer.address == d.cfg.peer.address;
                let clear = |d: &Doubt| {
                    pool.writes.lock().doubts.retain(|x| !same(x, d));
                    pool.changed.send_modify(|v| *v += 1);
                };
                for d in doubts {
                    let expired = d.ends.is_some_and(|e| tokio::time::Instant::now() >= e);
                    match reset(&d).await {
                        Ok(()) => clear(&d),
                        Err(cluster::ResetFailed::Unanswered(e)) if expired => {
                            // Never reset, and the peer has ended the controller by its own
                            // keep-alive rules by now.
                            tracing::warn!(peer = %d.cfg.peer.address, cntlid = d.instance.cntlid, "a controller closed with a write in flight was not reset ({e}); its keep-alive bound has passed: no longer in doubt");
                            clear(&d);
                        }
                        Err(e) => {
                            failed = true;
                            if let cluster::ResetFailed::Running(_) = e {
                                // Alive and still running it: only a reset ends this doubt.
                                if let Some(x) = pool.writes.lock().doubts.iter_mut().find(|x| same(x, &d)) {
                                    x.ends = None;
                                }
                            }
                            tracing::warn!(peer = %d.cfg.peer.address, cntlid = d.instance.cntlid, "resetting a controller closed with a write in flight: {e}; trying again in {} ms", pause.as_millis());
                        }
                    }
                }
                if failed {
                    // Not past the soonest keep-alive bound: a doubt ends at its bound.
                    let soonest = pool.writes.lock().doubts.iter().filter_map(|d| d.ends).min();
                    let until = soonest.map_or(pause, |e| e.saturating_duration_since(tokio::time::Instant::now())).min(pause);
                    tokio::time::sleep(until).await;
                    pause = (pause * 2).min(DOUBT_RETRY_MAX);
                } else {
                    pause = DOUBT_RETRY;
                }
            }
        });
    }

    /// A connection for `cfg.host`: an idle one of that host (true: reused), else a new
    /// one. `fresh` skips the idle ones.
    async fn checkout(&self, cfg: &RemoteConfig, fresh: bool) -> Result<(Conn, bool, OwnedSemaphorePermit), PeerError> {
        let t = cfg.timeout;
        let permit = tokio::time::timeout(t, self.permits.clone().acquire_owned())
            .await
            .map_err(|_| cluster::failed(format!("no free connection for {} s", t.as_secs())))?
            .map_err(|_| cluster::failed("the connection pool is closed".into()))?;
        {
            let mut idle = self.idle.lock();
            if let Some(i) = idle.iter().rposition(|(h, _)| *h == cfg.host).filter(|_| !fresh) {
                return Ok((idle.remove(i).1, true, permit));
            }
            let busy = self.per_peer - self.permits.available_permits();
            while !idle.is_empty() && idle.len() + busy > self.per_peer {
                idle.remove(0);
            }
        }
        self.stats.connections.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let conn = tokio::time::timeout(t, cluster::connect(&cfg.peer, &cfg.member, &cfg.host, t, cfg.kato))
            .await
            .map_err(|_| cluster::failed(format!("connecting took more than {} s", t.as_secs())))??;
        Ok((conn, false, permit))
    }

    /// Keeps a connection for `host` if nothing is in flight on it (late completions
    /// would reach the next operation), else closes it.
    fn checkin(&self, host: &str, mut conn: Conn, permit: OwnedSemaphorePermit) {
        if conn.q.queue().in_flight() == 0 {
            self.idle.lock().push((host.to_string(), conn));
        }
        drop(permit);
    }
}

/// How long the reset of controllers whose writes are in doubt pauses after a round that
/// did not reset them all, at first and at most (doubling in between).
pub(crate) const DOUBT_RETRY: Duration = Duration::from_secs(1);
/// Below a move's drain (5 s): a peer back from an outage has its doubts cleared before a
/// move of its extents gives up waiting.
pub(crate) const DOUBT_RETRY_MAX: Duration = Duration::from_secs(4);

/// How long a write given up waits for its controller's reset before its error is
/// completed: the reset's own limit and a connection's.
fn doubt_wait(cfg: &RemoteConfig) -> Duration {
    cluster::reset_wait(cfg.timeout)
}

/// Cross-Controller Reset of `d`'s controller at its peer ([`cluster::reset_lost`]).
async fn reset(d: &Doubt) -> Result<(), cluster::ResetFailed> {
    let c = &d.cfg;
    cluster::reset_lost(&c.peer, &c.member, &c.host, d.instance, c.timeout).await
}

/// A connection taken from the pool for one operation: back to the pool by
/// [`keep`](Lease::keep) when nothing is in flight on it; closed otherwise, also when the
/// operation is dropped (cancelled), and then, if a write of it was in flight, its
/// controller is in doubt, counted before the write's [`Running`] goes.
struct Lease<'a> {
    pool: &'a Arc<Pool>,
    cfg: &'a RemoteConfig,
    conn: Option<Conn>,
    permit: Option<OwnedSemaphorePermit>,
    /// The write it carries (None: a read or flush).
    running: Option<Running>,
    /// The peer answered every command of the operation (or none was sent): nothing of it
    /// can land later. Until then a write's connection closed is in doubt, whatever its
    /// queue still counts in flight (a queue that saw its connection lost forgets them).
    settled: bool,
}

impl Lease<'_> {
    fn conn(&mut self) -> &mut Conn {
        self.conn.as_mut().expect("held until kept or dropped")
    }

    /// Closes the connection for an operation that goes on to another attempt: its write
    /// comes back, counted first as a doubt when it was in flight.
    fn close(mut self) -> Option<Running> {
        self.doubt_unless_settled();
        self.running.take()
    }

    fn doubt_unless_settled(&mut self) {
        if let (Some(conn), Some(r)) = (self.conn.take(), &self.running) {
            if !self.settled {
                self.pool.doubt(&conn, self.cfg, r.range);
            }
        }
    }

    fn keep(mut self) {
        if let (Some(mut conn), Some(permit)) = (self.conn.take(), self.permit.take()) {
            if conn.q.queue().in_flight() == 0 {
                self.pool.checkin(&self.cfg.host, conn, permit);
            } else {
                self.conn = Some(conn);
            }
        }
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        self.doubt_unless_settled();
        // Only now: the write is counted as a doubt before it stops counting as running.
        self.running.take();
    }
}

struct Inner {
    cfg: RemoteConfig,
    pool: Arc<Pool>,
    block: u64,
    size: u64,
}

pub struct Remote {
    inner: Arc<Inner>,
    queue_depth: u32,
}

impl Remote {
    /// The peer's namespace acting for `cfg.host`, with connections from `pool` (the
    /// peer's, shared by every user of it): takes a connection of that host (the peer
    /// admitted it, or admits a new one now) and identifies the namespace.
    pub async fn open(cfg: RemoteConfig, pool: Arc<Pool>) -> Result<Remote, PeerError> {
        let (conn, _, permit) = pool.checkout(&cfg, false).await?;
        let (block, size) = (conn.block, conn.size);
        pool.checkin(&cfg.host, conn, permit);
        let queue_depth = pool.per_peer as u32;
        Ok(Remote { inner: Arc::new(Inner { cfg, pool, block, size }), queue_depth })
    }
}

impl BlockDevice for Remote {
    fn describe(&self) -> String {
        let p = &self.inner.cfg.peer;
        format!("{} {} nsid {} for {}", p.address, p.nqn, p.nsid, self.inner.cfg.host)
    }

    fn geometry(&self) -> Geometry {
        Geometry {
            size: self.inner.size,
            block_size: self.inner.block as u32,
            align: nearstore_transport::PAGE as u32,
            queue_depth: self.queue_depth,
        }
    }

    fn quiesce(&self, off: u64, len: u64) -> Option<super::Quiesce> {
        let (pool, nsid) = (self.inner.pool.clone(), self.inner.cfg.peer.nsid);
        // A peer that does not answer keeps its doubts: the caller's limit ends the wait.
        Some(Box::pin(async move { pool.quiesced(nsid, off, len, Duration::from_secs(3600)).await }))
    }

    fn submit(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            let e = error(io::ErrorKind::Other, None, format!("{}: not submitted on a runtime", self.describe()));
            return ch.complete(tag, Err(e), buf);
        };
        ch.started_elsewhere();
        let cancelled = |name: &str| error(io::ErrorKind::Interrupted, None, format!("{name}: the operation was cancelled"));
        let mut reply = Reply::new(ch.sender(), tag, buf, self.inner.name(), cancelled);
        let (inner, stop) = (self.inner.clone(), ch.cancellation());
        // A write counts from here, before its caller can let go of it (a move's drain).
        let range = Range::written(inner.cfg.peer.nsid, &op, reply.buf());
        let running = range.map(|r| inner.pool.running(r));
        // The caller's controller lives on while this may still write (its Cross-Controller
        // Reset waits for it).
        let life = ch.life_shared();
        // A host's write given up completes after its reset (its host's next write must not
        // be overtaken); the target's own work (a move's copy) handles its doubts itself.
        let for_host = ch.tenant().is_some();
        rt.spawn(async move {
            let mut reply = reply;
            let buf = reply.buf();
            // Cancelled, the operation is dropped where it waits: the task owns the buffer,
            // and a connection left with commands in flight is closed, not pooled, its
            // write in doubt until reset at the peer; the task ends only then (or after the
            // reset's limit), holding the caller's life.
            // (The operation's future is dropped when the select ends, before the doubt is
            // looked at: its connection's doubt is counted by then.)
            let outcome = tokio::select! {
                r = inner.run(op, buf, running, for_host) => Some(r),
                _ = stop.cancelled() => None,
            };
            let Some(result) = outcome else {
                if let Some(range) = range {
                    let _ = inner.pool.outlive_doubt(range, None, doubt_wait(&inner.cfg)).await;
                }
                drop(life);
                return;
            };
            drop(life);
            reply.send(result);
        });
    }
}

impl Inner {
    fn name(&self) -> String {
        let p = &self.cfg.peer;
        format!("peer {} ({} nsid {}) for {}", p.address, p.nqn, p.nsid, self.cfg.host)
    }

    async fn run(&self, op: Op, buf: &mut AlignedBuf, running: Option<Running>, for_host: bool) -> io::Result<()> {
        let started = std::time::Instant::now();
        let range = running.as_ref().map(|r| r.range);
        let r = self.attempt(op, buf, running).await;
        // A write given up is completed only once nothing of it can land any more (its
        // controller reset at the peer), or after the reset's limit: the caller's next
        // write of these blocks must not be overtaken by it.
        if let (Err(_), Some(range), true) = (&r, range, for_host) {
            if let Err(e) = self.pool.outlive_doubt(range, None, doubt_wait(&self.cfg)).await {
                tracing::warn!(peer = %self.cfg.peer.address, "a write given up is completed still in doubt: {e}");
            }
        }
        if let (Ok(()), Some(link)) = (&r, &self.pool.link) {
            link.done(&op, buf.len() as u64, started.elapsed().as_nanos() as u64);
        }
        r
    }

    async fn attempt(&self, op: Op, buf: &mut AlignedBuf, running: Option<Running>) -> io::Result<()> {
        let t = self.cfg.timeout;
        let mut fresh = false;
        let mut running = running;
        loop {
            let (conn, reused, permit) = self.pool.checkout(&self.cfg, fresh).await.map_err(|e| {
                let kind = if e.status == nearstore_wire::compute::status::PEER_DENIED {
                    io::ErrorKind::PermissionDenied
                } else {
                    io::ErrorKind::ConnectionRefused
                };
                error(kind, None, format!("{}: {}", self.name(), e.message))
            })?;
            let mut lease =
                Lease { pool: &self.pool, cfg: &self.cfg, conn: Some(conn), permit: Some(permit), running: running.take(), settled: false };
            let r = match tokio::time::timeout(t, self.exec(lease.conn(), op, buf)).await {
                Ok(r) => r,
                Err(_) => Err(error(io::ErrorKind::TimedOut, None, format!("no data for {} s", t.as_secs()))),
            };
            // A connection is kept only when nothing is in flight on it; a status from the
            // peer leaves it usable. One closed with writes in flight puts its controller
            // in doubt (Lease's drop).
            let usable = r.as_ref().err().is_none_or(|e| peer_status(e).is_some());
            // Refused before a command was sent (bytes not in whole blocks): nothing to doubt.
            let unsent = matches!(&r, Err(e) if peer_status(e).is_none() && e.kind() == io::ErrorKind::InvalidInput);
            lease.settled = (usable && lease.conn().q.queue().in_flight() == 0) || unsent;
            let again = matches!(&r, Err(e) if reused && !fresh && lost_connection(e));
            if usable {
                lease.keep();
            } else if again {
                // The write goes on to its next attempt (its doubt, if any, counted first).
                running = lease.close();
            } else {
                drop(lease);
            }
            match r {
                // A pooled connection the peer closed meanwhile (it restarted): once more on
                // a new one, once what it may still have written there is quiesced.
                Err(e) if again => {
                    if let Some(r) = &running {
                        self.pool
                            .outlive_doubt(r.range, Some(r.id), doubt_wait(&self.cfg))
                            .await
                            .map_err(|q| error(e.kind(), None, format!("{}: {e}; not tried again: {q}", self.name())))?;
                    }
                    fresh = true;
                }
                r => {
                    return r.map_err(|e| {
                        let kind = e.kind();
                        let status = peer_status(&e);
                        error(kind, status, format!("{}: {e}", self.name()))
                    })
                }
            }
        }
    }

    async fn exec(&self, conn: &mut Conn, op: Op, buf: &mut AlignedBuf) -> io::Result<()> {
        let (nsid, block) = (self.cfg.peer.nsid, self.block);
        let q = conn.q.queue();
        let max = q.options().max_transfer as u64 / block * block;
        let aligned = |off: u64, len: u64| {
            if off.is_multiple_of(block) && len.is_multiple_of(block) {
                Ok(())
            } else {
                Err(error(io::ErrorKind::InvalidInput, None, format!("bytes {off}+{len} are not whole {block}-byte blocks")))
            }
        };
        match op {
            Op::Read { off } | Op::Write { off, .. } => {
                let len = buf.len() as u64;
                aligned(off, len)?;
                if max == 0 {
                    return Err(error(io::ErrorKind::Other, None, format!("the peer's transfer size is below its {block}-byte block")));
                }
                let window = (self.cfg.read_ahead_bytes / max).clamp(1, q.options().depth.max(1) as u64) as usize;
                pipeline(q, nsid, block, max, window, op, off, buf).await
            }
            Op::Flush => {
                let mut s = Sqe::new(opc::FLUSH, 0);
                s.set_nsid(nsid);
                command(q, s, Data::None, None).await
            }
            Op::WriteZeroes { off, len, deallocate, fua } => {
                aligned(off, len)?;
                let (mut slba, end) = (off / block, (off + len) / block);
                while slba < end {
                    let nlb = WRITE_ZEROES_BLOCKS_MAX.min(end - slba);
                    let mut s = Sqe::rw(opc::WRITE_ZEROES, nsid, slba, nlb as u32, fua);
                    if deallocate {
                        s.set_cdw(12, s.cdw(12) | (1 << 25));
                    }
                    command(q, s, Data::None, None).await?;
                    slba += nlb;
                }
                Ok(())
            }
            Op::Deallocate => {
                let mut ranges = Vec::with_capacity(DSM_RANGES_MAX * 16);
                for pair in buf.chunks_exact(16) {
                    let off = u64::from_le_bytes(pair[..8].try_into().expect("8 bytes"));
                    let len = u64::from_le_bytes(pair[8..].try_into().expect("8 bytes"));
                    aligned(off, len)?;
                    let (mut slba, end) = (off / block, off.saturating_add(len) / block);
                    while slba < end {
                        let nlb = (u32::MAX as u64).min(end - slba);
                        ranges.extend_from_slice(&[0u8; 4]);
                        ranges.extend_from_slice(&(nlb as u32).to_le_bytes());
                        ranges.extend_from_slice(&slba.to_le_bytes());
                        slba += nlb;
                        if ranges.len() == DSM_RANGES_MAX * 16 {
                            dsm(q, nsid, &ranges).await?;
                            ranges.clear();
                        }
                    }
                }
                if !ranges.is_empty() {
                    dsm(q, nsid, &ranges).await?;
                }
                Ok(())
            }
        }
    }
}

/// Reads or writes `buf` at byte `off` as commands of at most `max` bytes, `window` of
/// them in flight: the peer's bandwidth, not its round trip, bounds the operation.
#[allow(clippy::too_many_arguments)]
async fn pipeline(
    q: &mut QueuePair<TcpStream>,
    nsid: u32,
    block: u64,
    max: u64,
    window: usize,
    op: Op,
    off: u64,
    buf: &mut AlignedBuf,
) -> io::Result<()> {
    let len = buf.len() as u64;
    let write = matches!(op, Op::Write { .. });
    let fua = matches!(op, Op::Write { fua: true, .. });
    // Commands in flight: (command id, byte offset in `buf` it reads or writes).
    let mut flight: std::collections::VecDeque<(u16, u64)> = std::collections::VecDeque::with_capacity(window);
    let mut failed: Option<io::Error> = None;
    let mut at = 0u64;
    while (at < len || !flight.is_empty()) && failed.is_none() {
        while at < len && flight.len() < window {
            let n = max.min(len - at);
            let (slba, nlb) = ((off + at) / block, (n / block) as u32);
            let range = at as usize..(at + n) as usize;
            let cid = if write {
                q.submit(Sqe::rw(opc::WRITE, nsid, slba, nlb, fua), Data::Out(&buf[range]), at)
            } else {
                q.submit(Sqe::rw(opc::READ, nsid, slba, nlb, false), Data::In(n as usize), at)
            }
            .map_err(lost)?;
            flight.push_back((cid, at));
            at += n;
        }
        let Some(&(cid, _)) = flight.front() else { break };
        // Completions of the others arrive meanwhile, too: each is taken as it comes.
        let mut done: Vec<(u64, Status, usize)> = Vec::new();
        q.wait(cid, |tag, c, d| {
            let from = tag as usize;
            let mut got = 0;
            if !write && c.status.is_success() {
                let end = (from + max as usize).min(buf.len());
                got = d.len().min(end - from);
                buf[from..from + got].copy_from_slice(&d[..got]);
            }
            done.push((tag, c.status, got));
        })
        .await
        .map_err(lost)?;
        for (tag, status, got) in done {
            flight.retain(|&(_, t)| t != tag);
            let want = if write { 0 } else { max.min(len - tag) as usize };
            if !status.is_success() {
                let opcode = if write { opc::WRITE } else { opc::READ };
                failed.get_or_insert(error(
                    kind_of(status),
                    Some(status),
                    format!("the peer completed opcode {opcode:#04x} with {status}"),
                ));
            } else if got < want {
                failed.get_or_insert(error(io::ErrorKind::UnexpectedEof, None, format!("the peer returned {got} of {want} bytes")));
            }
        }
    }
    match failed {
        // Commands still in flight: the connection is closed by the caller (in_flight > 0).
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Dataset Management with the Deallocate attribute for the packed ranges.
async fn dsm(q: &mut QueuePair<TcpStream>, nsid: u32, ranges: &[u8]) -> io::Result<()> {
    let mut s = Sqe::new(opc::DATASET_MANAGEMENT, 0);
    s.set_nsid(nsid).set_cdw(10, (ranges.len() / 16) as u32 - 1).set_cdw(11, 1 << 2);
    command(q, s, Data::Out(ranges), None).await
}

/// Runs one command on `q`, the data it returns copied into `sink`.
async fn command(q: &mut QueuePair<TcpStream>, sqe: Sqe, data: Data<'_>, mut sink: Option<&mut [u8]>) -> io::Result<()> {
    let want = sink.as_ref().map_or(0, |s| s.len());
    let cid = q.submit(sqe, data, 0).map_err(lost)?;
    let mut got = 0;
    let cqe = q
        .wait(cid, |_, c, d| {
            if let Some(s) = sink.as_deref_mut().filter(|_| c.cid == cid) {
                let k = d.len().min(s.len() - got);
                s[got..got + k].copy_from_slice(&d[..k]);
                got += k;
            }
        })
        .await
        .map_err(lost)?;
    if !cqe.status.is_success() {
        return Err(error(
            kind_of(cqe.status),
            Some(cqe.status),
            format!("the peer completed opcode {:#04x} with {}", sqe.opcode(), cqe.status),
        ));
    }
    if got < want {
        return Err(error(io::ErrorKind::UnexpectedEof, None, format!("the peer returned {got} of {want} bytes")));
    }
    Ok(())
}

/// True when `e` says the connection is gone (no status from the peer).
fn lost_connection(e: &io::Error) -> bool {
    peer_status(e).is_none()
        && matches!(
            e.kind(),
            io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe | io::ErrorKind::UnexpectedEof
        )
}

/// An initiator error on the connection: it is lost.
fn lost(e: InitiatorError) -> io::Error {
    let kind = match &e {
        InitiatorError::Closed | InitiatorError::Terminated { .. } => io::ErrorKind::ConnectionAborted,
        InitiatorError::Timeout(_) => io::ErrorKind::TimedOut,
        InitiatorError::Io { source, .. } => source.kind(),
        _ => io::ErrorKind::Other,
    };
    error(kind, None, e.to_string())
}
