//! An exported volume as a device: seed 002's fast path over Flint's extents.
//!
//! A volume is a logical block space cut into extents of one size, each allocated lazily in
//! some target's pool (docs/control-plane.md). This device translates every operation, split
//! at extent boundaries, through a bounded mapping cache ([`Clock`], `volume.cache_entries`):
//! an extent it holds goes straight to the pool's device, this target's own
//! ([`dev::local`](super::local), a namespace of its pool subsystem) or a peer's
//! ([`dev::remote`](super::remote), the peer's pool subsystem); one it does not hold asks
//! the control plane ([`Resolver`]) and waits at most `volume.translate_timeout_ms`.
//!
//! - A read or write within one cached extent is submitted on the caller's channel with the
//!   caller's buffer and tag: no task, no copy, no allocation.
//! - Everything else (a miss, an operation crossing extents, flush, write zeroes,
//!   deallocate) is a task on the caller's runtime, like a remote device's operation, with a
//!   channel of its own; its completion comes back through the caller's channel.
//! - A read of an unallocated extent returns zeros and allocates nothing; the first write
//!   allocates it (the control plane's idempotent allocation), zeroes it (its pool space may
//!   have held a deleted volume's extent), and only then is it cached and written.
//! - Misses of different extents are resolved concurrently, at most
//!   `VOLUME_MISSES_IN_FLIGHT_MAX` per volume; concurrent misses of one extent wait for the
//!   first ([`Flight`]) and share its answer, so that one extent is translated once and no
//!   operation maps it while its first write still zeroes it.
//! - When the control plane cannot answer in time, the operation fails with Namespace Not
//!   Ready, which a host retries; cached extents keep serving.
//! - Before an extent moves, its copier [`blocks`](Volume::block) it here (seed 002's
//!   ATS-like invalidation, docs/control-plane.md "Moving an extent"): its cache entry goes,
//!   new operations on it wait for the move's end, and [`Hold::drained`] waits for those
//!   in flight, each counted by a [`Ticket`] taken with its mapping and dropped when it
//!   completes (a compute command run on the extent's pool holds one from its
//!   [`placement`](Volume::placement) to its end). After the move every waiter translates again; an answer the control plane
//!   gave before a move ended is never cached (it may name the old place).

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use nearstore_transport::AlignedBuf;
use nearstore_wire::Status;
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use super::{fair, status_error, BlockDevice, Channel, Geometry, Op, Reply};

pub mod mover;
use crate::backend::Backend;
use crate::config::IoEngine;
use crate::io_pool::IoPool;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where an allocated extent lies: a namespace of a target's pool subsystem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    /// The pool's target, as the control plane knows it (its I/O address).
    pub target: String,
    /// The pool's namespace in that target's pool subsystem.
    pub nsid: u32,
    /// Byte offset of the extent in the pool.
    pub offset: u64,
    /// Bumped each time the extent moves.
    pub epoch: u64,
    /// Allocated and not yet zeroed (its allocator may have died first): reads as zeros,
    /// and the next first write zeroes it.
    pub unwritten: bool,
}

/// A pool namespace of some target: where an extent's bytes lie, as a compute command on
/// the volume is sent there (`offload/volume.rs`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolRef {
    /// The pool's target, as the control plane knows it (its I/O address).
    pub target: String,
    /// The pool's namespace in that target's pool subsystem.
    pub nsid: u32,
}

/// One extent's part of a byte range of the volume: its length, and where it lies in its
/// pool (None: unallocated, zeros).
#[derive(Clone, Debug)]
pub struct Placed {
    pub len: u64,
    pub at: Option<(Arc<PoolRef>, u64)>,
}

/// What the control plane says of one extent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    Allocated(Location),
    Unallocated,
}

/// Why the control plane gave no location: the status the operation fails with.
#[derive(Clone, Debug)]
pub struct ResolveError {
    pub status: Status,
    pub message: String,
}

/// The control plane's translation service for one volume.
pub trait Resolver: Send + Sync {
    /// Where extent `index` lies, if it is allocated.
    fn translate(&self, index: u64) -> BoxFuture<'_, Result<Lookup, ResolveError>>;
    /// Allocates extent `index` (returned as it is when already allocated), unwritten.
    fn allocate(&self, index: u64) -> BoxFuture<'_, Result<Location, ResolveError>>;
    /// Extent `index` is zeroed in its pool: it is written from now on.
    fn written(&self, index: u64) -> BoxFuture<'_, Result<(), ResolveError>>;
    /// Every allocated extent (index, location): what write zeroes and deallocate reach.
    fn allocated(&self) -> BoxFuture<'_, Result<Vec<(u64, Location)>, ResolveError>>;
}

/// Opens the device of a pool namespace.
pub trait Devices: Send + Sync {
    fn open<'a>(&'a self, loc: &'a Location) -> BoxFuture<'a, io::Result<Arc<dyn BlockDevice>>>;

    /// The pool namespace `pool` when it is this target's own (a compute command whose bytes
    /// all lie there runs on it, `offload/volume.rs`).
    fn own_pool(&self, _pool: &PoolRef) -> Option<Arc<crate::subsystem::Namespace>> {
        None
    }
}

/// A bounded map with CLOCK eviction (second chance): a hit sets the entry's bit; the hand
/// clears bits until it finds an entry without one, and replaces it. Capacity 0 holds
/// nothing.
pub struct Clock<V> {
    cap: usize,
    slots: Vec<(u64, V, bool)>,
    index: HashMap<u64, usize>,
    hand: usize,
}

impl<V: Clone> Clock<V> {
    pub fn new(cap: usize) -> Clock<V> {
        Clock { cap, slots: Vec::new(), index: HashMap::new(), hand: 0 }
    }

    /// Takes `key` out (an extent about to move).
    pub fn remove(&mut self, key: u64) -> Option<V> {
        let i = self.index.remove(&key)?;
        let (_, v, _) = self.slots.swap_remove(i);
        if let Some(moved) = self.slots.get(i) {
            self.index.insert(moved.0, i);
        }
        if self.hand >= self.slots.len() {
            self.hand = 0;
        }
        Some(v)
    }

    pub fn get(&mut self, key: u64) -> Option<V> {
        let i = *self.index.get(&key)?;
        let s = &mut self.slots[i];
        s.2 = true;
        Some(s.1.clone())
    }

    /// Inserts or replaces; returns the key evicted to make room.
    pub fn insert(&mut self, key: u64, v: V) -> Option<u64> {
        if self.cap == 0 {
            return None;
        }
        if let Some(&i) = self.index.get(&key) {
            self.slots[i].1 = v;
            return None;
        }
        if self.slots.len() < self.cap {
            self.index.insert(key, self.slots.len());
            self.slots.push((key, v, false));
            return None;
        }
        while self.slots[self.hand].2 {
            self.slots[self.hand].2 = false;
            self.hand = (self.hand + 1) % self.cap;
        }
        let old = std::mem::replace(&mut self.slots[self.hand], (key, v, false)).0;
        self.index.remove(&old);
        self.index.insert(key, self.hand);
        self.hand = (self.hand + 1) % self.cap;
        Some(old)
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

/// A cached extent: the device of its pool and where the extent starts there.
#[derive(Clone)]
struct Mapped {
    dev: Arc<dyn BlockDevice>,
    /// The pool namespace when it is this target's own: its counters (which its view is
    /// made of) count this volume's I/O there, which reaches its device directly.
    own: Option<Arc<crate::subsystem::Namespace>>,
    offset: u64,
    /// The extent's epoch when it was translated (named in errors).
    epoch: u64,
    /// Which pool it is (shared: a cache hit clones no string).
    pool: Arc<PoolRef>,
}

/// The volume's mappings: its cache, the extents being moved, and the operations in flight
/// on each extent (those that hold a mapping), which a move drains.
struct Table {
    clock: Clock<Mapped>,
    /// Extents being moved: operations on them wait for the move's end.
    moving: HashMap<u64, Arc<Moving>>,
    /// Operations in flight by extent: an entry while there is one, so at most as many
    /// entries as operations in flight.
    inflight: HashMap<u64, usize>,
    /// Moves of this volume's extents that ended: a translation asked before one ended may
    /// name an old place, and is asked again rather than cached.
    moves_ended: u64,
    /// No operation starts any more ([`Volume::fence`]): this target no longer exports the
    /// volume, or its export lease ran out.
    fenced: bool,
}

/// One extent's move as its volume sees it.
struct Moving {
    /// Closed when the move ends (published or not): the operations waiting translate again.
    ended: tokio::sync::Semaphore,
    /// Told when the extent's last operation in flight completes.
    drained: tokio::sync::Notify,
}

/// One operation in flight on an extent, counted until it is dropped (its completion
/// taken: [`Channel::attach`]; a compute command's end: [`Volume::placement`]).
pub struct Ticket {
    table: Arc<Mutex<Table>>,
    index: u64,
    /// A read or write on this target's own pool: counted in the pool namespace's
    /// counters when the operation is done (the ticket goes with its completion).
    io: Option<OwnIo>,
}

/// A read or write of a volume on this target's own pool namespace, from its start.
struct OwnIo {
    ns: Arc<crate::subsystem::Namespace>,
    write: bool,
    bytes: u64,
    start: std::time::Instant,
}

impl Ticket {
    /// Counts one more operation on `index`; `t` is `table` locked.
    fn enter(table: &Arc<Mutex<Table>>, t: &mut Table, index: u64) -> Ticket {
        *t.inflight.entry(index).or_default() += 1;
        Ticket { table: table.clone(), index, io: None }
    }

    /// The ticket of `op` (on the pool, `bytes` long) through `m`: a read or write of this
    /// target's own pool is counted in that pool's counters when it is done, as the pool
    /// namespace counts the operations that reach it over NVMe/TCP, so that its view shows
    /// the exporter's own fast path too.
    fn counting(mut self, m: &Mapped, op: &Op, bytes: u64) -> Ticket {
        let write = match op {
            Op::Read { .. } => false,
            Op::Write { .. } => true,
            _ => return self,
        };
        self.io = m.own.clone().map(|ns| OwnIo { ns, write, bytes, start: std::time::Instant::now() });
        self
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(io) = self.io.take() {
            let (s, ns) = (&io.ns.stats, io.start.elapsed().as_nanos() as u64);
            let (n, bytes, time) = match io.write {
                false => (&s.reads, &s.read_bytes, &s.read_ns),
                true => (&s.writes, &s.written_bytes, &s.write_ns),
            };
            n.fetch_add(1, Relaxed);
            bytes.fetch_add(io.bytes, Relaxed);
            time.fetch_add(ns, Relaxed);
        }
        let mut t = self.table.lock();
        let Some(n) = t.inflight.get_mut(&self.index) else { return };
        *n -= 1;
        if *n == 0 {
            t.inflight.remove(&self.index);
            if let Some(m) = t.moving.get(&self.index) {
                m.drained.notify_one();
            }
        }
    }
}

/// An extent blocked for its move ([`Volume::block`]): dropping it ends the move here, and
/// the operations that waited translate again.
pub struct Hold {
    table: Arc<Mutex<Table>>,
    index: u64,
    moving: Arc<Moving>,
}

impl Hold {
    /// Waits until no operation is in flight on the extent, at most `wait`.
    pub async fn drained(&self, wait: Duration) -> io::Result<()> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if !self.table.lock().inflight.contains_key(&self.index) {
                return Ok(());
            }
            // notify_one keeps a permit: a completion between the look and here is not missed.
            if tokio::time::timeout_at(deadline, self.moving.drained.notified()).await.is_err() {
                let n = self.table.lock().inflight.get(&self.index).copied().unwrap_or(0);
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("extent {}: {n} operations still in flight after {} ms", self.index, wait.as_millis()),
                ));
            }
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut t = self.table.lock();
        if t.moving.get(&self.index).is_some_and(|m| Arc::ptr_eq(m, &self.moving)) {
            t.moving.remove(&self.index);
        }
        t.moves_ended += 1;
        self.moving.ended.close();
    }
}

/// Counters of a volume's data path.
#[derive(Default)]
pub struct VolumeStats {
    /// Extent lookups the cache answered.
    pub hits: AtomicU64,
    /// Extent lookups that asked the control plane.
    pub misses: AtomicU64,
    /// Extents this device allocated (first writes).
    pub allocations: AtomicU64,
    /// Pieces of reads answered with zeros (unallocated extents).
    pub zero_reads: AtomicU64,
    /// Extent lookups that waited for another's miss of the same extent and took its answer.
    pub coalesced: AtomicU64,
    /// Cache entries evicted to make room for another extent.
    pub evictions: AtomicU64,
    /// How long the control plane took to translate an extent (answered or not).
    pub translate_latency: crate::metrics::Histogram,
    /// Control-plane calls not answered within the bounded wait.
    pub failed_timeout: AtomicU64,
    /// Allocations refused for want of space.
    pub failed_no_space: AtomicU64,
    /// Control-plane calls refused otherwise.
    pub failed_refused: AtomicU64,
    /// Pool devices that could not be opened or a new extent zeroed.
    pub failed_pool: AtomicU64,
}

/// How a volume is set up.
#[derive(Clone, Debug)]
pub struct VolumeConfig {
    pub name: String,
    /// Bytes, a multiple of `extent_size`.
    pub size: u64,
    pub extent_size: u64,
    /// Entries of the mapping cache (0: every operation is translated).
    pub cache_entries: usize,
    /// The longest wait for the control plane.
    pub timeout: Duration,
}

struct Inner {
    cfg: VolumeConfig,
    resolver: Arc<dyn Resolver>,
    devices: Arc<dyn Devices>,
    table: Arc<Mutex<Table>>,
    /// The misses being resolved, by extent.
    flights: Mutex<HashMap<u64, Arc<Flight>>>,
    /// Turns to resolve a miss: `VOLUME_MISSES_IN_FLIGHT_MAX`.
    turns: tokio::sync::Semaphore,
    /// Every pool device this volume reached: what a flush flushes.
    touched: Mutex<Vec<Arc<dyn BlockDevice>>>,
    pool: IoPool,
    stats: Arc<VolumeStats>,
    /// Until when this target may start the volume's operations (its export lease), in
    /// nanoseconds since `born`; u64::MAX: no lease ([`Volume::set_lease`]).
    lease_ns: AtomicU64,
    born: std::time::Instant,
}

/// Milliseconds between two looks at a fenced volume's operations in flight
/// ([`Volume::released`]: rare, and not on any operation's path).
const RELEASE_POLL_MS: u64 = 10;

/// Cloned for the namespace's compute commands, which ask where its bytes lie
/// ([`Volume::placement`]).
#[derive(Clone)]
pub struct Volume {
    inner: Arc<Inner>,
}

impl Volume {
    pub fn new(cfg: VolumeConfig, resolver: Arc<dyn Resolver>, devices: Arc<dyn Devices>, pool: IoPool) -> Volume {
        let table =
            Table { clock: Clock::new(cfg.cache_entries), moving: HashMap::new(), inflight: HashMap::new(), moves_ended: 0, fenced: false };
        Volume {
            inner: Arc::new(Inner {
                cfg,
                resolver,
                devices,
                table: Arc::new(Mutex::new(table)),
                flights: Mutex::new(HashMap::new()),
                turns: tokio::sync::Semaphore::new(crate::limits::VOLUME_MISSES_IN_FLIGHT_MAX),
                touched: Mutex::new(Vec::new()),
                pool,
                stats: Arc::default(),
                lease_ns: AtomicU64::new(u64::MAX),
                born: std::time::Instant::now(),
            }),
        }
    }

    /// From `until` on, no operation of the volume starts on a pool (as if fenced) unless
    /// the lease is renewed before: the target's export lease, set at each answer of the
    /// control plane (docs/control-plane.md, "Handing an export over"), checked where an
    /// operation is issued, so that a target that stalled past it issues nothing more.
    pub fn set_lease(&self, until: std::time::Instant) {
        let ns = until.saturating_duration_since(self.inner.born).as_nanos().min(u128::from(u64::MAX - 1)) as u64;
        self.inner.lease_ns.store(ns, Relaxed);
    }

    pub fn stats(&self) -> &Arc<VolumeStats> {
        &self.inner.stats
    }

    /// Where the bytes `off..off + len` lie, extent by extent, each piece handed to `visit`
    /// in order as soon as it is known: from the cache, else the control plane (as a read
    /// would ask it; nothing is allocated). Stops at the first piece `visit` refuses
    /// (returns false), so a caller that wants all bytes on one pool asks the control plane
    /// no further than the first extent elsewhere. Ok(true): every piece was taken.
    ///
    /// Each allocated piece's [`Ticket`] goes into `held`: a caller that reaches the pool
    /// directly (a compute command run on the pool) holds them until it is done with those
    /// bytes, so that a move of the extent drains it as it drains I/O (and aborts if it
    /// outlives the move's drain), never copying under it nor freeing the place it reads
    /// or writes.
    pub async fn placement(&self, off: u64, len: u64, held: &mut Vec<Ticket>, mut visit: impl FnMut(Placed) -> bool) -> io::Result<bool> {
        let i = &self.inner;
        if off.checked_add(len).is_none_or(|e| e > i.cfg.size) {
            return Err(status_error(Status::LBA_OUT_OF_RANGE, format!("bytes {off}+{len} are past volume {}", i.cfg.name)));
        }
        for (index, _, within, n) in pieces(off, len, i.cfg.extent_size) {
            let at = i.lookup(index, false).await?.map(|(m, ticket)| {
                held.push(ticket);
                (m.pool.clone(), m.offset + within)
            });
            if !visit(Placed { len: n, at }) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The pool namespace of this target that is `pool`, if it is one.
    pub fn own_pool(&self, pool: &PoolRef) -> Option<Arc<crate::subsystem::Namespace>> {
        self.inner.devices.own_pool(pool)
    }

    /// Blocks extent `index` for its move: its cache entry goes and new operations on it
    /// wait (at most `volume.translate_timeout_ms`, then Namespace Not Ready) until the
    /// [`Hold`] is dropped; then [`Hold::drained`] waits for those in flight. None when a
    /// move of it is blocked already.
    pub fn block(&self, index: u64) -> Option<Hold> {
        let mut t = self.inner.table.lock();
        if t.moving.contains_key(&index) {
            return None;
        }
        t.clock.remove(index);
        let moving = Arc::new(Moving { ended: tokio::sync::Semaphore::new(0), drained: tokio::sync::Notify::new() });
        t.moving.insert(index, moving.clone());
        Some(Hold { table: self.inner.table.clone(), index, moving })
    }

    /// Stops the volume on this target for good: from now on no operation of it starts on a
    /// pool (each fails with Namespace Not Ready), those that hold a ticket already go on.
    /// Its export moved elsewhere, or its export lease ran out (docs/control-plane.md,
    /// "Handing an export over").
    pub fn fence(&self) {
        let mut t = self.inner.table.lock();
        t.fenced = true;
        t.clock = Clock::new(self.inner.cfg.cache_entries);
    }

    /// Whether the volume may start nothing: fenced, or past its export lease. A compute
    /// command placed on its pools looks again right before it reads or forwards.
    pub fn halted(&self) -> bool {
        self.inner.halted(&self.inner.table.lock())
    }

    /// Waits, after [`fence`](Self::fence), until nothing this volume issued on a pool can
    /// still change storage: no operation holds a ticket, and no write to an allocated
    /// extent's pool runs or is in doubt there (`BlockDevice::quiesce`). Only then may
    /// another target write its extents. Errors: the control plane cannot list the extents,
    /// or a pool device cannot be opened; the caller tries again.
    pub async fn released(&self) -> io::Result<()> {
        let i = &self.inner;
        debug_assert!(i.table.lock().fenced, "released before fenced");
        while !i.table.lock().inflight.is_empty() {
            tokio::time::sleep(Duration::from_millis(RELEASE_POLL_MS)).await;
        }
        let extents = i.ask("list the extents", i.resolver.allocated()).await?;
        for (_, loc) in extents {
            let dev = i.devices.open(&loc).await?;
            if let Some(q) = dev.quiesce(loc.offset, i.cfg.extent_size) {
                q.await?;
            }
        }
        Ok(())
    }

    /// The synchronous face a namespace needs besides its device (shutdown flushes).
    pub fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(VolumeBackend { inner: self.inner.clone() })
    }
}

/// The operation with its offset moved to `off`.
fn at(op: Op, off: u64) -> Op {
    match op {
        Op::Read { .. } => Op::Read { off },
        Op::Write { fua, .. } => Op::Write { off, fua },
        op => op,
    }
}

impl BlockDevice for Volume {
    fn describe(&self) -> String {
        format!("volume {}", self.inner.cfg.name)
    }

    fn geometry(&self) -> Geometry {
        Geometry {
            size: self.inner.cfg.size,
            block_size: crate::limits::VOLUME_BLOCK_BYTES,
            align: nearstore_transport::PAGE as u32,
            queue_depth: crate::limits::QUEUE_DEPTH_MAX as u32,
        }
    }

    fn submit(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64) {
        let ext = self.inner.cfg.extent_size;
        if let Op::Read { off } | Op::Write { off, .. } = op {
            let len = buf.len() as u64;
            let end = off.checked_add(len).filter(|&e| e <= self.inner.cfg.size);
            if len > 0 && end.is_some() && off / ext == (off + len - 1) / ext {
                let index = off / ext;
                let table = &self.inner.table;
                let hit = {
                    let mut t = table.lock();
                    let m = if self.inner.halted(&t) { None } else { t.clock.get(index) };
                    m.map(|m| (m, Ticket::enter(table, &mut t, index)))
                };
                if let Some((m, ticket)) = hit {
                    self.inner.stats.hits.fetch_add(1, Relaxed);
                    let op = at(op, m.offset + off % ext);
                    ch.attach(tag, ticket.counting(&m, &op, len));
                    return m.dev.submit(ch, op, buf, tag);
                }
            }
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            let e = io::Error::other(format!("{}: not submitted on a runtime", self.describe()));
            return ch.complete(tag, Err(e), buf);
        };
        ch.started_elsewhere();
        let cancelled = |_: &str| io::Error::new(io::ErrorKind::Interrupted, "the volume operation was cancelled");
        let reply = Reply::new(ch.sender(), tag, buf, String::new(), cancelled);
        // Its pool operations are the caller's tenant's, as its fast path's are, and hold
        // the caller's controller's life (a peer's write given up holds it until quiesced).
        let (inner, stop, tenant, life) = (self.inner.clone(), ch.cancellation(), ch.tenant_shared(), ch.life_shared());
        rt.spawn(async move {
            let mut reply = reply;
            let buf = reply.buf();
            let r = inner.run(op, buf, stop, tenant, life).await;
            reply.send(r);
        });
    }
}

/// One extent's part of a byte range: (extent index, offset in the range, offset in the
/// extent, length).
fn pieces(off: u64, len: u64, ext: u64) -> impl Iterator<Item = (u64, u64, u64, u64)> {
    let mut at = 0;
    std::iter::from_fn(move || {
        if at >= len {
            return None;
        }
        let pos = off + at;
        let within = pos % ext;
        let n = (ext - within).min(len - at);
        let p = (pos / ext, at, within, n);
        at += n;
        Some(p)
    })
}

fn unresolved(e: ResolveError) -> io::Error {
    status_error(e.status, e.message)
}

/// One extent's miss: whoever holds `answer` first resolves it; those waiting behind take
/// what it found (an answer of "unallocated" does not serve a write, which allocates).
#[derive(Default)]
struct Flight {
    answer: tokio::sync::Mutex<Option<Result<Option<(Mapped, u64)>, io::Error>>>,
}

/// What a miss found: a mapping (with the count of moves ended when it was asked, and the
/// operation's ticket), unallocated, or a move in the way (ask again).
enum Resolved {
    Mapped(Mapped, u64, Ticket),
    Unallocated,
    Moved,
}

/// Where an extent stands in the table.
enum Found {
    Hit(Mapped, Ticket),
    Moving(Arc<Moving>),
    Miss,
    /// The volume is fenced: nothing starts.
    Fenced,
}

/// The same error again, for another waiter of a shared miss (its status kept).
fn again(e: &io::Error) -> io::Error {
    match super::error_status(e) {
        Some(status) => status_error(status, e.to_string()),
        None => io::Error::new(e.kind(), e.to_string()),
    }
}

/// A waiter of a flight: the last to leave (done or dropped) takes the flight off its
/// volume's map, so that a later miss of the extent starts afresh, and never while another
/// may still resolve it (one extent's misses never run at once: a first write's zeroing
/// must not overtake another's write).
struct Landing<'a> {
    flights: &'a Mutex<HashMap<u64, Arc<Flight>>>,
    index: u64,
    flight: Arc<Flight>,
}

impl Drop for Landing<'_> {
    fn drop(&mut self) {
        let mut f = self.flights.lock();
        // Held by the map and by this waiter only: every waiter joins under this lock.
        if Arc::strong_count(&self.flight) == 2 && f.get(&self.index).is_some_and(|g| Arc::ptr_eq(g, &self.flight)) {
            f.remove(&self.index);
        }
    }
}

impl Inner {
    /// Whether nothing may start: the volume is fenced, or its export lease is over. `t` is
    /// its table, locked.
    fn halted(&self, t: &Table) -> bool {
        if t.fenced {
            return true;
        }
        let lease = self.lease_ns.load(Relaxed);
        lease != u64::MAX && self.born.elapsed().as_nanos() >= u128::from(lease)
    }

    /// Err (the fenced error) if nothing may start now.
    fn may_start(&self) -> io::Result<()> {
        if self.halted(&self.table.lock()) {
            return Err(self.fenced());
        }
        Ok(())
    }

    /// The error of an operation of a fenced volume.
    fn fenced(&self) -> io::Error {
        status_error(Status::NAMESPACE_NOT_READY, format!("volume {} is no longer served by this target", self.cfg.name))
    }

    /// Waits at most the configured time for the control plane.
    async fn ask<T>(&self, what: &str, f: impl Future<Output = Result<T, ResolveError>>) -> io::Result<T> {
        let t = self.cfg.timeout;
        match tokio::time::timeout(t, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                let kind = if e.status == Status::CAPACITY_EXCEEDED { &self.stats.failed_no_space } else { &self.stats.failed_refused };
                kind.fetch_add(1, Relaxed);
                Err(unresolved(e))
            }
            Err(_) => Err({
                self.stats.failed_timeout.fetch_add(1, Relaxed);
                status_error(
                    Status::NAMESPACE_NOT_READY,
                    format!("volume {}: the control plane did not {what} within {} ms", self.cfg.name, t.as_millis()),
                )
            }),
        }
    }

    /// The device of `loc`, remembered for flushes.
    async fn open(&self, loc: &Location) -> io::Result<Mapped> {
        let dev = self.devices.open(loc).await?;
        let mut t = self.touched.lock();
        if !t.iter().any(|d| Arc::ptr_eq(d, &dev)) {
            t.push(dev.clone());
        }
        let pool = Arc::new(PoolRef { target: loc.target.clone(), nsid: loc.nsid });
        let own = self.devices.own_pool(&pool);
        Ok(Mapped { dev, own, offset: loc.offset, epoch: loc.epoch, pool })
    }

    /// The extent in the table: a hit (its ticket taken), a move, or a miss.
    fn found(&self, index: u64) -> Found {
        let mut t = self.table.lock();
        if self.halted(&t) {
            return Found::Fenced;
        }
        if let Some(m) = t.moving.get(&index) {
            return Found::Moving(m.clone());
        }
        match t.clock.get(index) {
            Some(m) => {
                let ticket = Ticket::enter(&self.table, &mut t, index);
                Found::Hit(m, ticket)
            }
            None => Found::Miss,
        }
    }

    /// Waits for a move's end, until `deadline`.
    async fn wait_move(&self, index: u64, m: Arc<Moving>, deadline: tokio::time::Instant) -> io::Result<()> {
        // Closed (an error) when the move ends.
        match tokio::time::timeout_at(deadline, m.ended.acquire()).await {
            Ok(_) => Ok(()),
            Err(_) => Err(status_error(
                Status::NAMESPACE_NOT_READY,
                format!("volume {}: extent {index} is still being moved after {} ms", self.cfg.name, self.cfg.timeout.as_millis()),
            )),
        }
    }

    /// Where extent `index` lies, with the operation's ticket: from the cache, else from the
    /// control plane (allocated with `allocate` when it is not yet), or from a concurrent
    /// miss of the same extent. None: unallocated, and not allocated. An extent being moved
    /// is waited for (at most the control plane's wait), then translated again.
    async fn lookup(&self, index: u64, allocate: bool) -> io::Result<Option<(Mapped, Ticket)>> {
        let deadline = tokio::time::Instant::now() + self.cfg.timeout;
        loop {
            match self.found(index) {
                Found::Hit(m, t) => {
                    self.stats.hits.fetch_add(1, Relaxed);
                    return Ok(Some((m, t)));
                }
                Found::Moving(m) => {
                    self.wait_move(index, m, deadline).await?;
                    continue;
                }
                Found::Fenced => return Err(self.fenced()),
                Found::Miss => {}
            }
            let flight = self.flights.lock().entry(index).or_default().clone();
            let landing = Landing { flights: &self.flights, index, flight };
            let mut answer = landing.flight.answer.lock().await;
            // Another miss may have cached it meanwhile, or a move begun.
            match self.found(index) {
                Found::Hit(m, t) => {
                    self.stats.hits.fetch_add(1, Relaxed);
                    return Ok(Some((m, t)));
                }
                Found::Moving(m) => {
                    drop(answer);
                    drop(landing);
                    self.wait_move(index, m, deadline).await?;
                    continue;
                }
                Found::Fenced => return Err(self.fenced()),
                Found::Miss => {}
            }
            match &*answer {
                Some(Ok(Some((m, asked)))) => {
                    // Not cached (no cache, or evicted): still good unless a move ended since.
                    let mut t = self.table.lock();
                    if self.halted(&t) {
                        return Err(self.fenced());
                    }
                    if t.moves_ended == *asked && !t.moving.contains_key(&index) {
                        self.stats.coalesced.fetch_add(1, Relaxed);
                        let ticket = Ticket::enter(&self.table, &mut t, index);
                        return Ok(Some((m.clone(), ticket)));
                    }
                }
                Some(Ok(None)) if !allocate => {
                    self.stats.coalesced.fetch_add(1, Relaxed);
                    return Ok(None);
                }
                Some(Err(e)) => {
                    self.stats.coalesced.fetch_add(1, Relaxed);
                    return Err(again(e));
                }
                // Not resolved yet (or its resolver was dropped), or a write behind a read that
                // found it unallocated.
                _ => {}
            }
            match self.resolve(index, allocate).await {
                Ok(Resolved::Mapped(m, asked, ticket)) => {
                    *answer = Some(Ok(Some((m.clone(), asked))));
                    return Ok(Some((m, ticket)));
                }
                Ok(Resolved::Unallocated) => {
                    *answer = Some(Ok(None));
                    return Ok(None);
                }
                Ok(Resolved::Moved) => {
                    *answer = None;
                    if tokio::time::Instant::now() >= deadline {
                        return Err(status_error(
                            Status::NAMESPACE_NOT_READY,
                            format!("volume {}: extent {index} kept moving for {} ms", self.cfg.name, self.cfg.timeout.as_millis()),
                        ));
                    }
                }
                Err(e) => {
                    *answer = Some(Err(again(&e)));
                    return Err(e);
                }
            }
        }
    }

    /// Asks the control plane where extent `index` lies (allocating and zeroing it with
    /// `allocate`), in one of the volume's turns, and caches it, unless a move of the extent
    /// began or any move ended meanwhile (the answer may name the old place: Moved).
    async fn resolve(&self, index: u64, allocate: bool) -> io::Result<Resolved> {
        let _turn = self.turns.acquire().await.map_err(|_| io::Error::other("the volume's misses were closed"))?;
        let asked = {
            let t = self.table.lock();
            if t.moving.contains_key(&index) {
                return Ok(Resolved::Moved);
            }
            t.moves_ended
        };
        self.stats.misses.fetch_add(1, Relaxed);
        let started = std::time::Instant::now();
        let translated = self.ask("translate", self.resolver.translate(index)).await;
        self.stats.translate_latency.record(started.elapsed());
        let loc = match translated? {
            // Allocated by a data path that died before it zeroed the extent: its pool may
            // hold a deleted volume's bytes, so it reads as zeros and is not cached.
            Lookup::Allocated(loc) if loc.unwritten && !allocate => return Ok(Resolved::Unallocated),
            Lookup::Allocated(loc) => loc,
            Lookup::Unallocated if !allocate => return Ok(Resolved::Unallocated),
            Lookup::Unallocated => {
                let loc = self.ask("allocate", self.resolver.allocate(index)).await?;
                self.stats.allocations.fetch_add(1, Relaxed);
                loc
            }
        };
        // Unwritten (just allocated, or left so) while this task holds the extent's miss, by
        // the only target that exports the volume: no data path has written it, so zeroing
        // loses nothing.
        let fresh = loc.unwritten;
        let m = self.open(&loc).await.inspect_err(|_| {
            self.stats.failed_pool.fetch_add(1, Relaxed);
        })?;
        // The ticket before the zeroing: a move of the extent waits for it. An answer from
        // before a move ended, or an extent being moved, is asked again (an unwritten one
        // stays unwritten through its move, and is zeroed where it lies then).
        let ticket = {
            let mut t = self.table.lock();
            if self.halted(&t) {
                return Err(self.fenced());
            }
            if t.moving.contains_key(&index) || t.moves_ended != asked {
                return Ok(Resolved::Moved);
            }
            Ticket::enter(&self.table, &mut t, index)
        };
        if fresh {
            let ext = self.cfg.extent_size;
            // Durable (FUA) before the control plane hears that it is written.
            let op = Op::WriteZeroes { off: m.offset, len: ext, deallocate: true, fua: true };
            let mut ch = Channel::new(IoEngine::Threads, self.pool.clone());
            let c = ch.run(&*m.dev, op, AlignedBuf::new(0)).await;
            c.result.map_err(|e| {
                self.stats.failed_pool.fetch_add(1, Relaxed);
                io::Error::new(e.kind(), format!("zeroing new extent {index} of volume {}: {e}", self.cfg.name))
            })?;
            self.ask("mark the extent written", self.resolver.written(index)).await?;
        }
        let mut t = self.table.lock();
        if t.moving.contains_key(&index) || t.moves_ended != asked {
            return Ok(Resolved::Moved);
        }
        if t.clock.insert(index, m.clone()).is_some() {
            self.stats.evictions.fetch_add(1, Relaxed);
        }
        Ok(Resolved::Mapped(m, asked, ticket))
    }

    /// The slow path of one operation, charged to `tenant` in fair-scheduled pools.
    async fn run(
        &self,
        op: Op,
        buf: &mut AlignedBuf,
        stop: CancellationToken,
        tenant: Option<Arc<fair::Tenant>>,
        life: Option<Arc<crate::subsystem::Life>>,
    ) -> io::Result<()> {
        let ext = self.cfg.extent_size;
        let check = |off: u64, len: u64| {
            if off.checked_add(len).is_none_or(|e| e > self.cfg.size) {
                return Err(status_error(Status::LBA_OUT_OF_RANGE, format!("bytes {off}+{len} are past volume {}", self.cfg.name)));
            }
            Ok(())
        };
        let mut ch = Channel::new(IoEngine::Threads, self.pool.clone()).same_tenant(tenant);
        ch.set_life(life);
        match op {
            Op::Read { off } | Op::Write { off, .. } => {
                let len = buf.len() as u64;
                check(off, len)?;
                let write = matches!(op, Op::Write { .. });
                let mut plan = Vec::new();
                for (index, from, within, n) in pieces(off, len, ext) {
                    let range = from as usize..(from + n) as usize;
                    match self.lookup(index, write).await? {
                        Some((m, ticket)) => {
                            let mut b = AlignedBuf::new(n as usize);
                            b.set_len(n as usize);
                            if write {
                                b.copy_from_slice(&buf[range.clone()]);
                            }
                            let extent = Some((index, m.epoch));
                            let op = at(op, m.offset + within);
                            let ticket = Some(ticket.counting(&m, &op, n));
                            plan.push(Piece { op, buf: b, range, extent, dev: m.dev, _ticket: ticket });
                        }
                        None => {
                            self.stats.zero_reads.fetch_add(1, Relaxed);
                            buf[range].fill(0);
                        }
                    }
                }
                // Its lookups may have waited (a miss, a move): fenced meanwhile, it issues
                // nothing.
                self.may_start()?;
                let done = execute(&mut ch, plan, &stop).await?;
                if !write {
                    for p in done {
                        buf[p.range].copy_from_slice(&p.buf);
                    }
                }
                Ok(())
            }
            Op::Flush => {
                self.may_start()?;
                let devs = self.touched.lock().clone();
                let plan = devs
                    .into_iter()
                    .map(|dev| Piece { dev, op: Op::Flush, buf: AlignedBuf::new(0), range: 0..0, extent: None, _ticket: None })
                    .collect();
                execute(&mut ch, plan, &stop).await.map(drop)
            }
            Op::WriteZeroes { off, len, deallocate, fua } => {
                check(off, len)?;
                self.each_allocated(&mut ch, off, len, |o, n| Op::WriteZeroes { off: o, len: n, deallocate, fua }).await
            }
            Op::Deallocate => {
                let ranges: Vec<(u64, u64)> = buf
                    .chunks_exact(16)
                    .map(|p| {
                        let w = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
                        (w(&p[..8]), w(&p[8..]))
                    })
                    .collect();
                for (off, len) in ranges {
                    check(off, len)?;
                    // Deallocate lends its range in the buffer; write zeroes with deallocate
                    // is the same to a pool (its blocks read as zeros after either).
                    self.each_allocated(&mut ch, off, len, |o, n| Op::WriteZeroes { off: o, len: n, deallocate: true, fua: false }).await?;
                }
                Ok(())
            }
        }
    }

    /// Runs `make(offset in the pool, length)` on the part of every allocated extent that
    /// lies in the byte range, one extent after another; unallocated extents read as zeros
    /// already.
    async fn each_allocated(&self, ch: &mut Channel, off: u64, len: u64, make: impl Fn(u64, u64) -> Op) -> io::Result<()> {
        let ext = self.cfg.extent_size;
        let (first, last) = (off / ext, (off + len).div_ceil(ext));
        if len == 0 {
            return Ok(());
        }
        let table = self.ask("list the extents", self.resolver.allocated()).await?;
        for (index, _) in table.into_iter().filter(|(i, _)| (first..last).contains(i)) {
            let start = (index * ext).max(off);
            let end = ((index + 1) * ext).min(off + len);
            // Through the cache with a ticket, as a read: the table's place may be moving.
            let Some((m, _ticket)) = self.lookup(index, false).await? else { continue };
            let c = ch.run(&*m.dev, make(m.offset + start - index * ext, end - start), AlignedBuf::new(0)).await;
            c.result.map_err(|e| in_extent(e, index, m.epoch))?;
        }
        Ok(())
    }
}

/// One device operation of a slow-path operation: `range` is its part of the caller's
/// buffer, `extent` the extent (index, epoch) it reaches, which its error names.
struct Piece {
    dev: Arc<dyn BlockDevice>,
    op: Op,
    buf: AlignedBuf,
    range: std::ops::Range<usize>,
    extent: Option<(u64, u64)>,
    /// Counts it in flight on its extent until the operation is done.
    _ticket: Option<Ticket>,
}

/// A pool operation's error, naming the extent it was for.
fn in_extent(e: io::Error, index: u64, epoch: u64) -> io::Error {
    io::Error::new(e.kind(), format!("extent {index} (epoch {epoch}): {e}"))
}

/// Runs every piece of a plan at once on `ch` and waits for all of them; on cancellation,
/// the devices that can stop early do. Returns the pieces with their buffers back, or the
/// first error.
async fn execute(ch: &mut Channel, plan: Vec<Piece>, stop: &CancellationToken) -> io::Result<Vec<Piece>> {
    let n = plan.len();
    let mut back: Vec<Piece> = Vec::with_capacity(n);
    for (i, mut p) in plan.into_iter().enumerate() {
        let buf = std::mem::replace(&mut p.buf, AlignedBuf::new(0));
        p.dev.submit(ch, p.op, buf, i as u64);
        back.push(p);
    }
    let mut failed: Option<io::Error> = None;
    let mut got = 0;
    let mut out = Vec::with_capacity(n);
    while got < n {
        out.clear();
        got += ch.poll(n - got, &mut out);
        for c in out.drain(..) {
            let Some(p) = back.get_mut(c.tag as usize) else { continue };
            if let Err(e) = c.result {
                failed.get_or_insert(match p.extent {
                    Some((index, epoch)) => in_extent(e, index, epoch),
                    None => e,
                });
            }
            p.buf = c.buf;
        }
        if got == n {
            break;
        }
        tokio::select! {
            biased;
            r = ch.wait() => {
                if let Err(e) = r {
                    tracing::warn!("waiting for a volume's pool operations: {e}");
                }
            }
            _ = stop.cancelled(), if !stop.is_cancelled() => ch.cancel(),
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(back),
    }
}

/// The cluster's pools as devices: this target's own through its pool subsystem's
/// namespaces, another target's through its pool subsystem over NVMe/TCP, connecting as
/// this cluster member for itself (the peer admits only its `cluster.trusted_members`).
/// Connections to one peer are pooled (`cluster.connections_per_peer`).
pub struct PoolDevices {
    /// This target's address as the control plane knows it.
    own: String,
    local: Option<Arc<crate::subsystem::Subsystem>>,
    member: String,
    per_peer: usize,
    timeout: Duration,
    read_ahead_bytes: u64,
    remotes: tokio::sync::Mutex<HashMap<(String, u32), Arc<dyn BlockDevice>>>,
    pools: Mutex<HashMap<std::net::SocketAddr, Arc<super::remote::Pool>>>,
    /// The target's links, where each peer's pool counts what it moved.
    links: Arc<super::remote::Links>,
    /// Every pool device behind its gate, when the arbiter divides the pools (`dev::grant`).
    gates: Option<Arc<super::grant::Gates>>,
}

impl PoolDevices {
    pub fn new(target: &crate::Target, own: String, cluster: &crate::cluster::ClusterConfig) -> PoolDevices {
        PoolDevices {
            own,
            local: target.subsystem(crate::POOLS_NQN),
            member: cluster.host_nqn.clone().unwrap_or_else(nearstore_initiator::default_hostnqn),
            per_peer: cluster.connections_per_peer,
            timeout: Duration::from_secs(cluster.timeout_secs),
            read_ahead_bytes: cluster.read_ahead_bytes.0,
            remotes: tokio::sync::Mutex::new(HashMap::new()),
            pools: Mutex::new(HashMap::new()),
            links: target.links.clone(),
            gates: None,
        }
    }

    /// Puts every pool device behind its gate of `gates` (the arbiter's grants).
    pub fn gated(mut self, gates: Arc<super::grant::Gates>) -> PoolDevices {
        self.gates = Some(gates);
        self
    }

    fn gate(&self, loc: &Location, d: Arc<dyn BlockDevice>) -> Arc<dyn BlockDevice> {
        match &self.gates {
            Some(g) => g.device(&loc.target, loc.nsid, d),
            None => d,
        }
    }
}

impl Devices for PoolDevices {
    fn own_pool(&self, pool: &PoolRef) -> Option<Arc<crate::subsystem::Namespace>> {
        if pool.target != self.own {
            return None;
        }
        self.local.as_ref().and_then(|s| s.namespace(pool.nsid))
    }

    fn open<'a>(&'a self, loc: &'a Location) -> BoxFuture<'a, io::Result<Arc<dyn BlockDevice>>> {
        Box::pin(async move {
            if loc.target == self.own {
                let ns = self.local.as_ref().and_then(|s| s.namespace(loc.nsid));
                return ns
                    .map(|ns| self.gate(loc, ns.dev.clone()))
                    .ok_or_else(|| io::Error::other(format!("this target has no pool namespace {}", loc.nsid)));
            }
            let key = (loc.target.clone(), loc.nsid);
            let mut remotes = self.remotes.lock().await;
            if let Some(d) = remotes.get(&key) {
                return Ok(d.clone());
            }
            let address: std::net::SocketAddr =
                loc.target.parse().map_err(|_| io::Error::other(format!("pool target '{}' is not an address", loc.target)))?;
            let pool = self
                .pools
                .lock()
                .entry(address)
                .or_insert_with(|| Arc::new(super::remote::Pool::new(self.per_peer).counted(self.links.of(address))))
                .clone();
            let cfg = super::remote::RemoteConfig {
                peer: crate::cluster::PeerConfig { tag: 0, address, nqn: crate::POOLS_NQN.into(), nsid: loc.nsid },
                member: self.member.clone(),
                host: self.member.clone(),
                timeout: self.timeout,
                read_ahead_bytes: self.read_ahead_bytes,
                kato: None,
            };
            let r = super::remote::Remote::open(cfg, pool)
                .await
                .map_err(|e| io::Error::other(format!("pool {} of {}: {}", loc.nsid, loc.target, e.message)))?;
            let d = self.gate(loc, Arc::new(r));
            remotes.insert(key, d.clone());
            Ok(d)
        })
    }
}

/// The volume's synchronous face, which a namespace has besides its device (compute
/// commands read and write a volume through its device).
struct VolumeBackend {
    inner: Arc<Inner>,
}

impl Backend for VolumeBackend {
    fn describe(&self) -> String {
        format!("volume {}", self.inner.cfg.name)
    }

    fn size(&self) -> u64 {
        self.inner.cfg.size
    }

    fn block_bytes(&self) -> u32 {
        crate::limits::VOLUME_BLOCK_BYTES
    }

    fn read_at(&self, _buf: &mut [u8], _off: u64) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "a volume is read through its device"))
    }

    fn write_at(&self, _buf: &[u8], _off: u64) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "a volume is written through its device"))
    }

    fn flush(&self) -> io::Result<()> {
        // Synchronous callers (a target's stop) cannot wait for the pools' devices, which
        // run on the pool and the runtime. A controller's shutdown (CC.SHN) flushes the
        // volume through its device instead (fabrics.rs), as a host's Flush does; each
        // pool's target flushes its pools at its own stop.
        Ok(())
    }

    fn write_zeroes(&self, _off: u64, _len: u64, _deallocate: bool) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "a volume is written through its device"))
    }
}

#[cfg(test)]
mod tests;
