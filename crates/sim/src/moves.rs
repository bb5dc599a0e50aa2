//! Extents moved under I/O and faults, against a model (docs/simulation.md, "Moving
//! extents"): seed 002's invalidation protocol with the real parts wherever they run on one
//! thread. The control plane is `nearstore_control::state::Cluster` (every change planned,
//! committed, applied); each exporting target serves its volume through the real
//! `dev::volume::Volume` (its CLOCK cache, its tickets, its blocks) and runs the real
//! copier (`dev::volume::mover::Mover`); the pools are memory devices whose operations stay
//! in flight a random while. The seed chooses the workload and the faults: calls to the
//! control plane delayed, reordered, lost before or after they were applied, failed
//! commits; exporters (the moves' copiers) crashed and restarted, cut off from the control
//! plane past a move's silence limit; pools unreachable; copiers' words held back in the
//! network and taken again seconds later (a late ack, publish or abort of a move that
//! ended, maybe while the extent moves again at the same epoch).
//!
//! The model is each volume's blocks: every write stamps its blocks with its id, and a read
//! must return, per block, a write that is not older than the last one acknowledged before
//! the read began (or one in flight). After the run every block is read back, every move has
//! ended, each extent's epoch counts its publications (one per move at most), and no pool
//! space is held twice or by nothing.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use crate::{Failure, Which};
use nearstore_control::model::*;
use nearstore_control::state::Cluster;
use nearstore_target::backend::MemoryBackend;
use nearstore_target::config::IoEngine;
use nearstore_target::dev::local::Local;
use nearstore_target::dev::volume::mover::{MoveBug, MoveControl, MoveOrder, Mover, MoverConfig, Served};
use nearstore_target::dev::volume::{BoxFuture, Devices, Location, Lookup, ResolveError, Resolver, Volume, VolumeConfig};
use nearstore_target::dev::{BlockDevice, Channel, Geometry, Op};
use nearstore_target::io_pool::IoPool;
use nearstore_transport::AlignedBuf;
use nearstore_wire::Status;
use parking_lot::Mutex;
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;
use tokio::time::Instant;

use crate::trace::Trace;

const BLOCK: u64 = 4096;
/// The smallest extent the control plane takes: 256 blocks.
const EXTENT: u64 = 1 << 20;
const BLOCKS_PER_EXTENT: u64 = EXTENT / BLOCK;
const EXTENTS_PER_VOLUME: u64 = 4;
/// Five extents a pool: three volumes' 12 extents and the moves' reservations fill most of
/// the three pools, so that placement meets full pools.
const POOL_BYTES: u64 = 5 * EXTENT;
const TARGETS: usize = 3;
/// The blocks of each extent that clients use (its first and last ones), so that their
/// operations overlap, and some cross into the next extent.
const HOT: [u64; 6] = [0, 1, 2, BLOCKS_PER_EXTENT - 3, BLOCKS_PER_EXTENT - 2, BLOCKS_PER_EXTENT - 1];
/// How long a caller waits for a lost reply of the control plane.
const CALL_TIMEOUT: Duration = Duration::from_millis(1000);
/// A volume's bounded wait for the control plane and for a move (`translate_timeout_ms`).
const VOLUME_TIMEOUT: Duration = Duration::from_millis(2000);
/// The long poll of moves: held at most this long when nothing changes.
const MOVES_WAIT: Duration = Duration::from_secs(5);
/// How long the end of a run waits for every move to end.
const QUIESCE: Duration = Duration::from_secs(60);

/// What a run does besides what its seed chooses.
#[derive(Clone, Debug)]
pub struct Options {
    /// Operations per client (three clients a volume, three volumes).
    pub ops: u32,
    /// A deliberately broken copier, to show the checker finds it.
    pub bug: Option<MoveBug>,
    /// Keep every trace line (for a replay), not only the last ones.
    pub keep_trace: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options { ops: 60, bug: None, keep_trace: false }
    }
}

/// A run that passed.
#[derive(Debug, Default)]
pub struct Stats {
    pub trace_hash: u64,
    pub events: u64,
    pub trace: Vec<String>,
    pub reads: u64,
    pub writes: u64,
    /// Operations that failed (a move's wait, a crash, a lost call): not checked, and a
    /// failed write may or may not have landed.
    pub failed: u64,
    pub moves_begun: u64,
    pub published: u64,
    pub crashes: u64,
    /// Crashes of an exporter while a move it copied was under way.
    pub crashes_mid_move: u64,
    /// Moves aborted by the control plane: their copier was silent too long.
    pub expired: u64,
    pub cuts: u64,
    pub outages: u64,
    pub lost_calls: u64,
    /// Copiers' words taken a second time, late.
    pub late_words: u64,
    pub simulated: Duration,
}

/// Runs the move simulation of `seed`.
pub fn run(seed: u64, opts: &Options) -> Result<Stats, Failure> {
    crate::paused_runtime(Which::Moves, seed)?.block_on(async {
        let trace = Trace::new(opts.keep_trace);
        let sim = Sim::new(seed, opts.clone(), trace.clone());
        let started = Instant::now();
        let r = sim.clone().run().await;
        // Whatever is still running (a dead exporter's tasks) goes with the runtime.
        match r {
            Ok(()) => {
                let mut s = std::mem::take(&mut *sim.stats.lock());
                (s.trace_hash, s.events) = trace.digest();
                (s.trace, s.simulated, s.lost_calls) = (trace.all(), started.elapsed(), sim.ctl.lost.load(Relaxed));
                s.late_words = sim.ctl.late.load(Relaxed);
                Ok(s)
            }
            Err(message) => Err(Failure { which: Which::Moves, seed, message, tail: trace.tail(), trace: trace.all() }),
        }
    })
}

/// The seed's random choices, shared by every part (one thread: the order of the calls is
/// the run's).
#[derive(Clone)]
struct Rng(Arc<Mutex<XorShiftRng>>);

impl Rng {
    fn below(&self, n: u64) -> u64 {
        self.0.lock().random_range(0..n.max(1))
    }

    /// True `per_mille` times in a thousand.
    fn chance(&self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }

    fn ms(&self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }

    fn us(&self, lo: u64, hi: u64) -> Duration {
        Duration::from_micros(lo + self.below(hi - lo + 1))
    }
}

/// One life of an exporting target: dead, nothing it started reaches a pool or the control
/// plane any more (its process is gone, with its connections).
#[derive(Default)]
struct Life {
    dead: AtomicBool,
}

/// Who calls the control plane: an exporting target in one of its lives (cut off, or dead,
/// its calls are lost), or the operator (never).
#[derive(Clone)]
struct Caller {
    cut: Arc<AtomicBool>,
    life: Arc<Life>,
}

impl Caller {
    fn up(&self) -> bool {
        !self.cut.load(Relaxed) && !self.life.dead.load(Relaxed)
    }
}

enum CallError {
    Lost(&'static str),
    Api(ApiError),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Lost(what) => write!(f, "control plane call {what}"),
            CallError::Api(e) => write!(f, "{}: {}", e.code, e.message),
        }
    }
}

type Planned<T> = Result<(Vec<Write>, T), ApiError>;

/// The control plane: the real state machine behind a lossy network.
struct Control {
    cluster: Mutex<Cluster>,
    /// Bumped when a move record changes, and `changed` told: what the moves' long poll
    /// waits for (a Notify, whose waiters wake in their order; tokio's watch picks among
    /// its own at random).
    version: AtomicU64,
    changed: tokio::sync::Notify,
    start: Instant,
    rng: Rng,
    trace: Trace,
    /// Publications by (volume, index, epoch the move began at): each at most once.
    published: Mutex<HashSet<(String, u64, u64)>>,
    /// Publications per extent.
    moved: Mutex<HashMap<(String, u64), u64>>,
    /// What the invariants' checks found (the first ends the run).
    broken: Mutex<Option<String>>,
    lost: AtomicU64,
    /// Copiers' words taken late.
    late: AtomicU64,
    /// Faults on: calls are delayed, lost and fail to commit. Off at the end of a run.
    faults: AtomicBool,
}

/// What a copier says of a move.
#[derive(Clone, Copy, Debug)]
enum Word {
    Ack,
    Progress,
    Publish,
    Abort,
}

impl Control {
    fn now_ms(&self) -> u64 {
        Instant::now().duration_since(self.start).as_millis() as u64
    }

    fn fail(&self, why: String) {
        self.broken.lock().get_or_insert(why);
    }

    /// Plans, commits (a store failure in a hundred, with faults on: nothing changes) and
    /// applies one change, then checks the books.
    fn commit<T>(&self, plan: impl FnOnce(&Cluster, u64) -> Planned<T>) -> Result<T, ApiError> {
        let now = self.now_ms();
        let mut c = self.cluster.lock();
        let (writes, t) = plan(&c, now)?;
        if writes.is_empty() {
            return Ok(t);
        }
        if self.faults.load(Relaxed) && self.rng.chance(10) {
            return Err(ApiError::new(ErrorCode::StoreFailed, "simulated store failure"));
        }
        let moves = writes.iter().any(|w| matches!(w, Write::Put(Record::Move(_)) | Write::Delete(Table::Moves, _)));
        for w in &writes {
            if let Write::Put(Record::Extent(e)) = w {
                self.published(&c, e);
            }
            c.apply(w);
        }
        if let Err(e) = check_books(&c) {
            self.fail(e);
        }
        drop(c);
        if moves {
            self.version.fetch_add(1, Relaxed);
            self.changed.notify_waiters();
        }
        Ok(t)
    }

    /// An extent record written over one at another epoch: a publication, which must be of
    /// the next epoch, once.
    fn published(&self, c: &Cluster, e: &Extent) {
        let Some(old) = c.extents.get(&(e.volume.clone(), e.index)).filter(|old| old.epoch != e.epoch) else { return };
        self.trace.event(format_args!("published {}/{} epoch {} at {} {}", e.volume, e.index, e.epoch, e.pool, e.offset));
        if e.epoch != old.epoch + 1 {
            self.fail(format!("extent {}/{} published at epoch {} from epoch {}", e.volume, e.index, e.epoch, old.epoch));
        }
        if !self.published.lock().insert((e.volume.clone(), e.index, old.epoch)) {
            self.fail(format!("the move of extent {}/{} from epoch {} was published twice", e.volume, e.index, old.epoch));
        }
        *self.moved.lock().entry((e.volume.clone(), e.index)).or_default() += 1;
    }

    /// Takes a copier's word on the move of `volume`/`index` it names.
    fn take(&self, c: &Cluster, now: u64, word: Word, volume: &str, index: u64, r: &MoveReport) -> Planned<()> {
        match word {
            Word::Ack | Word::Progress => c.report_move(volume, index, r, matches!(word, Word::Ack), now).map(|(w, _)| (w, ())),
            Word::Publish => c.publish_move(volume, index, r).map(|(w, _)| (w, ())),
            Word::Abort => c.abort_move(volume, index, r),
        }
    }

    /// One call over the network: the request and the reply each delayed and, with faults
    /// on, lost (the caller then waits out its timeout, not knowing whether it was applied);
    /// a caller cut off or dead reaches nothing. `long_poll`: held until the moves' version
    /// passes it.
    async fn call<T>(&self, from: &Caller, long_poll: Option<u64>, plan: impl FnOnce(&Cluster, u64) -> Planned<T>) -> Result<T, CallError> {
        let faults = self.faults.load(Relaxed);
        let lose = |what| {
            self.lost.fetch_add(1, Relaxed);
            what
        };
        let (there, back) = (self.rng.us(50, 2000), self.rng.us(50, 2000));
        let (lose_request, lose_reply) = (faults && self.rng.chance(15), faults && self.rng.chance(15));
        if !from.up() {
            tokio::time::sleep(CALL_TIMEOUT).await;
            return Err(CallError::Lost(lose("unreachable")));
        }
        tokio::time::sleep(there).await;
        if lose_request {
            tokio::time::sleep(CALL_TIMEOUT).await;
            return Err(CallError::Lost(lose("request lost")));
        }
        if let Some(since) = long_poll {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.version.load(Relaxed) == since {
                let _ = tokio::time::timeout(MOVES_WAIT, changed).await;
            }
        }
        let r = self.commit(plan);
        tokio::time::sleep(back).await;
        if lose_reply || !from.up() {
            tokio::time::sleep(CALL_TIMEOUT).await;
            return Err(CallError::Lost(lose("reply lost")));
        }
        r.map_err(CallError::Api)
    }
}

/// The books' invariants after every commit: no pool space held twice (two extents, or an
/// extent and a move's reservation), none past its pool's end, none held by nothing (the
/// derived map of what each pool holds is exactly the extents and the reservations).
fn check_books(c: &Cluster) -> Result<(), String> {
    let mut held: BTreeMap<PoolId, Vec<(u64, u64, String)>> = BTreeMap::new();
    for e in c.extents.values() {
        let len = c.volumes.get(&e.volume).map_or(0, |v| v.extent_size);
        held.entry(e.pool.clone()).or_default().push((e.offset, len, format!("extent {}/{}", e.volume, e.index)));
    }
    for m in c.moves.values() {
        held.entry(m.to.clone()).or_default().push((m.to_offset, m.extent_size, format!("the move of {}/{}", m.volume, m.index)));
    }
    for (pool, list) in &mut held {
        list.sort();
        let size = c.pools.get(pool).map_or(0, |p| p.size);
        for w in list.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(format!("pool {pool}: {} at {} and {} at {} overlap (allocated twice)", w[0].2, w[0].0, w[1].2, w[1].0));
            }
        }
        if let Some(last) = list.last().filter(|l| l.0 + l.1 > size) {
            return Err(format!("pool {pool}: {} at {} is past its end {size}", last.2, last.0));
        }
        let derived: Vec<u64> = c.placed.get(pool).map(|m| m.keys().copied().collect()).unwrap_or_default();
        let booked: Vec<u64> = list.iter().map(|l| l.0).collect();
        if derived != booked {
            return Err(format!("pool {pool}: the control plane counts offsets {derived:?} held, its records {booked:?} (leaked)"));
        }
    }
    if let Some((pool, m)) = c.placed.iter().find(|(p, m)| !held.contains_key(*p) && !m.is_empty()) {
        return Err(format!("pool {pool}: {} offsets held by no record (leaked)", m.len()));
    }
    Ok(())
}

fn resolve_error(e: CallError) -> ResolveError {
    let status = match &e {
        CallError::Lost(_) => Status::NAMESPACE_NOT_READY,
        CallError::Api(a) if a.code == ErrorCode::StoreFailed => Status::NAMESPACE_NOT_READY,
        CallError::Api(a) if a.code == ErrorCode::NoSpace => Status::CAPACITY_EXCEEDED.dnr(),
        CallError::Api(_) => Status::INTERNAL_ERROR.dnr(),
    };
    ResolveError { status, message: e.to_string() }
}

fn location(e: &ExtentInfo) -> Location {
    Location { target: e.target.clone(), nsid: e.nsid, offset: e.offset, epoch: e.epoch, unwritten: e.unwritten }
}

/// A volume's translation service, as its exporter reaches it.
struct SimResolver {
    ctl: Arc<Control>,
    caller: Caller,
    volume: String,
}

impl Resolver for SimResolver {
    fn translate(&self, index: u64) -> BoxFuture<'_, Result<Lookup, ResolveError>> {
        Box::pin(async move {
            let t = self.ctl.call(&self.caller, None, |c, _| Ok((Vec::new(), c.translate(&self.volume, index)?))).await;
            let t = t.map_err(resolve_error)?;
            Ok(t.extent.as_ref().map_or(Lookup::Unallocated, |e| Lookup::Allocated(location(e))))
        })
    }

    fn allocate(&self, index: u64) -> BoxFuture<'_, Result<Location, ResolveError>> {
        Box::pin(async move {
            let e = self.ctl.call(&self.caller, None, |c, now| c.allocate(&self.volume, index, now)).await;
            e.map(|e| location(&e)).map_err(resolve_error)
        })
    }

    fn written(&self, index: u64) -> BoxFuture<'_, Result<(), ResolveError>> {
        Box::pin(async move {
            self.ctl.call(&self.caller, None, |c, _| c.mark_written(&self.volume, index)).await.map(drop).map_err(resolve_error)
        })
    }

    fn allocated(&self) -> BoxFuture<'_, Result<Vec<(u64, Location)>, ResolveError>> {
        Box::pin(async move {
            let info = self.ctl.call(&self.caller, None, |c, now| Ok((Vec::new(), c.volume_info(&self.volume, now)?))).await;
            Ok(info.map_err(resolve_error)?.extents.iter().map(|e| (e.index, location(e))).collect())
        })
    }
}

/// The copier's words, as its exporter's life sends them.
struct SimMoves {
    ctl: Arc<Control>,
    caller: Caller,
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

/// A call's error; `NotFound` when the control plane has no such move (it ended).
fn io_error(e: CallError) -> io::Error {
    let kind = match &e {
        CallError::Api(a) if a.code == ErrorCode::MoveNotFound => io::ErrorKind::NotFound,
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, e.to_string())
}

impl SimMoves {
    /// Sends a copier's word. With faults on, one in twenty that leaves also stays in the
    /// network and is taken again 1 to 8 s later, whatever became of its move meanwhile.
    async fn send(&self, word: Word, m: &MoveOrder, r: MoveReport) -> io::Result<()> {
        let ctl = &self.ctl;
        if ctl.faults.load(Relaxed) && self.caller.up() && ctl.rng.chance(50) {
            let (late, ctl, volume, index, r) = (ctl.rng.ms(1000, 8000), ctl.clone(), m.volume.clone(), m.index, r.clone());
            tokio::spawn(async move {
                tokio::time::sleep(late).await;
                let got = ctl.commit(|c, now| ctl.take(c, now, word, &volume, index, &r));
                ctl.late.fetch_add(1, Relaxed);
                let said = got.map_or_else(|e| e.code.to_string(), |()| "taken".into());
                ctl.trace.event(format_args!("a late {word:?} of move {} of {volume}/{index} epoch {}: {said}", r.id, r.epoch));
            });
        }
        ctl.call(&self.caller, None, |c, now| ctl.take(c, now, word, &m.volume, m.index, &r)).await.map_err(io_error)
    }
}

impl MoveControl for SimMoves {
    fn moves(&self, since: u64) -> BoxFuture<'_, io::Result<(u64, Vec<MoveOrder>)>> {
        Box::pin(async move {
            // The list with the version it was read at.
            let ctl = &self.ctl;
            let list = ctl.call(&self.caller, Some(since), |c, _| {
                Ok((Vec::new(), (ctl.version.load(Relaxed), c.moves_of(Some(&self.addr)).iter().map(order).collect::<Vec<_>>())))
            });
            let list = list.await;
            match &list {
                Ok((v, l)) => {
                    self.ctl.trace.event(format_args!("{} polled its moves since {since}: version {v}, {} moves", self.addr, l.len()))
                }
                Err(e) => self.ctl.trace.event(format_args!("{} polled its moves since {since}: {e}", self.addr)),
            }
            list.map_err(io_error)
        })
    }

    fn report<'a>(&'a self, m: &'a MoveOrder, ack: bool, copied: u64) -> BoxFuture<'a, io::Result<()>> {
        let r = MoveReport { id: m.id, epoch: m.epoch, copied, reason: String::new() };
        Box::pin(self.send(if ack { Word::Ack } else { Word::Progress }, m, r))
    }

    fn publish<'a>(&'a self, m: &'a MoveOrder, copied: u64) -> BoxFuture<'a, io::Result<()>> {
        let r = MoveReport { id: m.id, epoch: m.epoch, copied, reason: String::new() };
        Box::pin(self.send(Word::Publish, m, r))
    }

    fn abort<'a>(&'a self, m: &'a MoveOrder, reason: &'a str) -> BoxFuture<'a, io::Result<()>> {
        let r = MoveReport { id: m.id, epoch: m.epoch, copied: 0, reason: reason.to_string() };
        Box::pin(self.send(Word::Abort, m, r))
    }
}

/// A target's pool: memory, reachable or not.
struct SimPool {
    name: String,
    target: String,
    dev: Arc<dyn BlockDevice>,
    down: AtomicBool,
}

/// A pool as one life of an exporter reaches it: every operation in flight a random while
/// (so that operations overlap moves and complete out of order), then done only if the
/// exporter still lives and the pool is reachable.
struct Reach {
    gate: Arc<dyn BlockDevice>,
    rng: Rng,
}

struct Gate {
    pool: Arc<SimPool>,
    life: Arc<Life>,
}

impl BlockDevice for Gate {
    fn describe(&self) -> String {
        format!("pool {}@{}", self.pool.name, self.pool.target)
    }

    fn geometry(&self) -> Geometry {
        self.pool.dev.geometry()
    }

    fn submit(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64) {
        if self.life.dead.load(Relaxed) {
            return ch.complete(tag, Err(io::Error::other("the exporter crashed")), buf);
        }
        if self.pool.down.load(Relaxed) {
            return ch.complete(tag, Err(io::Error::other(format!("{} is unreachable", self.describe()))), buf);
        }
        self.pool.dev.submit(ch, op, buf, tag)
    }
}

impl BlockDevice for Reach {
    fn describe(&self) -> String {
        self.gate.describe()
    }

    fn geometry(&self) -> Geometry {
        self.gate.geometry()
    }

    fn submit(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64) {
        // Mostly a pool's microseconds to a couple of milliseconds, one in ten a slow one.
        let d = if self.rng.chance(100) { self.rng.ms(2, 30) } else { self.rng.us(0, 2000) };
        ch.defer(Instant::now() + d, self.gate.clone(), op, buf, tag);
    }
}

/// The pools as one life of an exporter opens them.
struct SimDevices {
    devs: Vec<(Arc<SimPool>, Arc<dyn BlockDevice>)>,
}

impl Devices for SimDevices {
    fn open<'a>(&'a self, loc: &'a Location) -> BoxFuture<'a, io::Result<Arc<dyn BlockDevice>>> {
        Box::pin(async move {
            self.devs
                .iter()
                .find(|(p, _)| p.target == loc.target && loc.nsid == 1)
                .map(|(_, d)| d.clone())
                .ok_or_else(|| io::Error::other(format!("no pool {} of {}", loc.nsid, loc.target)))
        })
    }
}

/// A volume's exporting target: its lives, each with a volume device (a cold cache) and a
/// mover.
struct Exporter {
    addr: String,
    volume: String,
    cut: Arc<AtomicBool>,
    life: Mutex<Option<Living>>,
}

/// An exporter's life: what it dies with, its volume device, its mover's task.
type Living = (Arc<Life>, Arc<Volume>, tokio::task::JoinHandle<()>);

/// One write or read of the model: its place in the order of events, and for a write
/// whether it was acknowledged.
#[derive(Clone, Copy)]
struct Span {
    start: u64,
    /// u64::MAX while in flight.
    end: u64,
    acked: bool,
}

/// Each volume's blocks: the writes that reached each, in the order they began.
struct Model {
    seq: u64,
    writes: Vec<Span>,
    /// (volume, block) to the ids of the writes of it; id 0 is the zeros every block starts with.
    blocks: HashMap<(usize, u64), Vec<u64>>,
}

impl Model {
    fn tick(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// Which writes a read of the block over `[start, end]` may return: any that began before
    /// it ended and was not overwritten, before it began, by one acknowledged after it ended.
    fn allowed(&self, vol: usize, block: u64, id: u64, start: u64, end: u64) -> Result<(), String> {
        let list = self.blocks.get(&(vol, block)).map_or(&[0u64][..], |l| &l[..]);
        if !list.contains(&id) {
            return Err(format!("write {id} never wrote there"));
        }
        let w = self.writes[id as usize];
        if w.start > end {
            return Err(format!("write {id} began after the read"));
        }
        if let Some(&a) = list.iter().find(|&&a| {
            let s = self.writes[a as usize];
            s.acked && s.start > w.end && s.end < start
        }) {
            let s = self.writes[a as usize];
            return Err(format!(
                "write {id} (events {}..{}) was overwritten by write {a} (events {}..{}, acknowledged) before the read began",
                w.start, w.end, s.start, s.end
            ));
        }
        Ok(())
    }
}

/// A block's bytes for write `id`: (id, the block's address) over and over, so that a
/// block read from another place, or torn, is seen.
fn stamp(buf: &mut [u8], id: u64, vol: usize, block: u64) {
    let addr = ((vol as u64) << 32) | block;
    for c in buf.chunks_exact_mut(16) {
        c[..8].copy_from_slice(&id.to_le_bytes());
        c[8..].copy_from_slice(&addr.to_le_bytes());
    }
}

/// The write whose stamp a block holds (0: zeros).
fn unstamp(buf: &[u8], vol: usize, block: u64) -> Result<u64, String> {
    if buf.iter().all(|&b| b == 0) {
        return Ok(0);
    }
    let first = &buf[..16];
    if !buf.chunks_exact(16).all(|c| c == first) {
        return Err("a torn block (two writes' bytes)".into());
    }
    let id = u64::from_le_bytes(first[..8].try_into().expect("8 bytes"));
    let addr = u64::from_le_bytes(first[8..].try_into().expect("8 bytes"));
    let want = ((vol as u64) << 32) | block;
    if addr != want {
        return Err(format!("the bytes of volume {} block {} (write {id})", addr >> 32, addr & 0xffff_ffff));
    }
    Ok(id)
}

struct Sim {
    seed: u64,
    opts: Options,
    rng: Rng,
    trace: Trace,
    ctl: Arc<Control>,
    pools: Vec<Arc<SimPool>>,
    exporters: Vec<Arc<Exporter>>,
    model: Mutex<Model>,
    stats: Mutex<Stats>,
    /// Cache entries of every volume this run: 0 (each operation translated) to 3.
    cache_entries: usize,
    /// Faults per second the seed asks for (0 in some runs).
    fault_rate: u64,
    clients_done: AtomicBool,
}

fn volume_name(v: usize) -> String {
    format!("v{v}")
}

impl Sim {
    fn new(seed: u64, opts: Options, trace: Trace) -> Arc<Sim> {
        let rng = Rng(Arc::new(Mutex::new(XorShiftRng::seed_from_u64(seed))));
        let ctl = Arc::new(Control {
            cluster: Mutex::new(Cluster::default()),
            version: AtomicU64::new(0),
            changed: tokio::sync::Notify::new(),
            start: Instant::now(),
            rng: rng.clone(),
            trace: trace.clone(),
            published: Mutex::default(),
            moved: Mutex::default(),
            broken: Mutex::default(),
            lost: AtomicU64::new(0),
            late: AtomicU64::new(0),
            faults: AtomicBool::new(true),
        });
        let pools = (0..TARGETS)
            .map(|t| {
                Arc::new(SimPool {
                    name: "p".into(),
                    target: format!("10.0.0.{}:4420", t + 1),
                    dev: Arc::new(Local::new(Arc::new(MemoryBackend::new(POOL_BYTES)))),
                    down: AtomicBool::new(false),
                })
            })
            .collect::<Vec<_>>();
        let exporters = (0..TARGETS)
            .map(|t| {
                Arc::new(Exporter { addr: pools[t].target.clone(), volume: volume_name(t), cut: Arc::default(), life: Mutex::new(None) })
            })
            .collect();
        let cache_entries = rng.below(4) as usize;
        let fault_rate = [0, 1, 2, 4][rng.below(4) as usize];
        Arc::new(Sim {
            seed,
            opts,
            rng,
            trace,
            ctl,
            pools,
            exporters,
            model: Mutex::new(Model { seq: 0, writes: vec![Span { start: 0, end: 0, acked: true }], blocks: HashMap::new() }),
            stats: Mutex::default(),
            cache_entries,
            fault_rate,
            clients_done: AtomicBool::new(false),
        })
    }

    fn event(&self, what: std::fmt::Arguments) {
        self.trace.event(what);
    }

    fn broken(&self) -> Result<(), String> {
        match self.ctl.broken.lock().clone() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    async fn run(self: Arc<Self>) -> Result<(), String> {
        self.event(format_args!(
            "seed {}: {} cache entries a volume, {} faults/s, bug {:?}",
            self.seed, self.cache_entries, self.fault_rate, self.opts.bug
        ));
        // The cluster: three targets with a pool each, a volume of four extents each,
        // exported by its own target (three caches, three copiers).
        for x in &self.exporters {
            self.register(x).await;
        }
        let operator = Caller { cut: Arc::default(), life: Arc::default() };
        for v in 0..TARGETS {
            let req = CreateVolume { name: volume_name(v), size: EXTENTS_PER_VOLUME * EXTENT, extent_size: Some(EXTENT) };
            self.until_ok(&operator, |c, now| c.create_volume(&req, now)).await;
            let req = ExportVolume { target: self.exporters[v].addr.clone(), hosts: Vec::new(), allow_any_host: true };
            self.until_ok(&operator, |c, now| c.export(&volume_name(v), &req, now)).await;
        }
        for x in &self.exporters {
            self.start(x);
        }
        let background = [
            tokio::spawn(self.clone().views()),
            tokio::spawn(self.clone().sweeper()),
            tokio::spawn(self.clone().operator(operator)),
            tokio::spawn(self.clone().faults()),
        ];
        let mut clients = tokio::task::JoinSet::new();
        for v in 0..TARGETS {
            for c in 0..3 {
                clients.spawn(self.clone().client(v, c));
            }
        }
        while let Some(r) = clients.join_next().await {
            r.map_err(|e| format!("a client panicked: {e}"))??;
            self.broken()?;
        }
        self.clients_done.store(true, Relaxed);
        for b in &background[2..] {
            b.abort();
        }
        self.quiesce().await?;
        self.read_back().await?;
        self.final_books()?;
        for b in &background {
            b.abort();
        }
        for x in &self.exporters {
            if let Some((life, _, mover)) = x.life.lock().take() {
                life.dead.store(true, Relaxed);
                mover.abort();
            }
        }
        self.broken()
    }

    /// Calls until the control plane answers (set-up steps, which faults only delay): a
    /// refusal is an answer too (a volume made by a call whose reply was lost exists).
    async fn until_ok<T>(&self, from: &Caller, plan: impl Fn(&Cluster, u64) -> Planned<T>) {
        loop {
            match self.ctl.call(from, None, &plan).await {
                Err(CallError::Lost(_)) => {}
                Err(CallError::Api(e)) if e.code == ErrorCode::StoreFailed => {}
                _ => return,
            }
        }
    }

    /// A target (re)registers its pool: the moves it copied before die with its old life.
    async fn register(&self, x: &Exporter) {
        let req = RegisterTarget {
            addr: x.addr.clone(),
            nqn: format!("nqn.sim:{}", x.addr),
            pools: vec![PoolSpec { name: "p".into(), path: "/pool".into(), size: POOL_BYTES, nsid: 1, bandwidth: 0, write_cost: 0.0 }],
            write_bound_ms: 0,
            // Its lives are not fenced processes here: no restart waits (the moves model
            // the invalidations, not the pools' late writes).
            incarnation: 0,
        };
        let me = Caller { cut: x.cut.clone(), life: Arc::default() };
        self.until_ok(&me, |c, now| c.register(&req, now, 0)).await;
    }

    /// Starts a life of an exporter: a volume device with a cold cache and a mover.
    fn start(&self, x: &Arc<Exporter>) {
        let life = Arc::new(Life::default());
        let caller = Caller { cut: x.cut.clone(), life: life.clone() };
        let devs = self
            .pools
            .iter()
            .map(|p| {
                let gate: Arc<dyn BlockDevice> = Arc::new(Gate { pool: p.clone(), life: life.clone() });
                let d: Arc<dyn BlockDevice> = Arc::new(Reach { gate, rng: self.rng.clone() });
                (p.clone(), d)
            })
            .collect();
        let devices = Arc::new(SimDevices { devs });
        let cfg = VolumeConfig {
            name: x.volume.clone(),
            size: EXTENTS_PER_VOLUME * EXTENT,
            extent_size: EXTENT,
            cache_entries: self.cache_entries,
            timeout: VOLUME_TIMEOUT,
        };
        let resolver = Arc::new(SimResolver { ctl: self.ctl.clone(), caller: caller.clone(), volume: x.volume.clone() });
        let vol = Arc::new(Volume::new(cfg, resolver, devices.clone(), IoPool::on_runtime()));
        let served = Arc::new(Served::default());
        served.serve(&x.volume, vol.clone());
        let ctl = Arc::new(SimMoves { ctl: self.ctl.clone(), caller, addr: x.addr.clone() });
        let cfg = MoverConfig {
            report_every: Duration::from_millis(nearstore_control::limits::MOVE_REPORT_MS),
            retry_max: Duration::from_millis(nearstore_control::limits::AGENT_RETRY_MS_MAX),
            bug: self.opts.bug,
        };
        let mover = Arc::new(Mover::new(ctl, devices, served, IoPool::on_runtime(), cfg));
        let task = tokio::spawn(mover.run());
        *x.life.lock() = Some((life, vol, task));
    }

    /// The exporter dies: nothing it started reaches anything any more.
    fn crash(&self, x: &Exporter) -> bool {
        let Some((life, _, mover)) = x.life.lock().take() else { return false };
        life.dead.store(true, Relaxed);
        mover.abort();
        true
    }

    /// The view agents: every 5 s a view of each pool, so that none goes stale.
    async fn views(self: Arc<Self>) {
        for seq in 1.. {
            for p in &self.pools {
                let id = PoolId { target: p.target.clone(), name: p.name.clone() };
                let push = ViewPush { seq, figures: Figures::default() };
                let _ = self.ctl.commit(|c, now| c.push_view(&id, &push, now));
            }
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
    }

    /// The control plane's sweep of silent copiers.
    async fn sweeper(self: Arc<Self>) {
        loop {
            tokio::time::sleep(Duration::from_millis(nearstore_control::limits::MOVE_SWEEP_MS)).await;
            if let Ok(n) = self.ctl.commit(|c, now| c.expire_moves(now)) {
                if n > 0 {
                    self.stats.lock().expired += n as u64;
                    self.event(format_args!("{n} moves aborted: their copiers were silent"));
                }
            }
        }
    }

    /// Asks for moves: a random extent, to a pool chosen or the placement's, capped or not.
    async fn operator(self: Arc<Self>, me: Caller) {
        loop {
            tokio::time::sleep(self.rng.ms(20, 250)).await;
            let volume = volume_name(self.rng.below(TARGETS as u64) as usize);
            let index = self.rng.below(EXTENTS_PER_VOLUME);
            let to = self.rng.chance(500).then(|| format!("p@{}", self.pools[self.rng.below(TARGETS as u64) as usize].target));
            let max_bps = if self.rng.chance(500) { 0 } else { (4 + self.rng.below(60)) << 20 };
            let req = MoveRequest { to: to.clone(), max_bps };
            match self.ctl.call(&me, None, |c, now| c.begin_move(&volume, index, &req, now)).await {
                Ok(m) => {
                    self.stats.lock().moves_begun += 1;
                    self.event(format_args!("move {volume}/{index} epoch {} {} -> {} at {max_bps} B/s", m.epoch, m.from, m.to));
                }
                Err(e) => self.event(format_args!("move {volume}/{index} to {to:?} refused: {e}")),
            }
        }
    }

    /// Crashes, cuts and outages at the seed's rate, each healed a while later.
    async fn faults(self: Arc<Self>) {
        if self.fault_rate == 0 {
            return;
        }
        loop {
            tokio::time::sleep(self.rng.ms(0, 2000 / self.fault_rate)).await;
            let t = self.rng.below(TARGETS as u64) as usize;
            let x = self.exporters[t].clone();
            match self.rng.below(3) {
                0 => {
                    let moving = self.ctl.cluster.lock().moves.values().any(|m| m.copier == x.addr && m.state != MoveState::Aborted);
                    if !self.crash(&x) {
                        continue;
                    }
                    let mut s = self.stats.lock();
                    (s.crashes, s.crashes_mid_move) = (s.crashes + 1, s.crashes_mid_move + moving as u64);
                    drop(s);
                    let down = self.rng.ms(10, 800);
                    self.event(format_args!("crash of {} for {down:?}", x.addr));
                    let me = self.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(down).await;
                        me.restart(&x).await;
                    });
                }
                1 => {
                    if x.cut.swap(true, Relaxed) {
                        continue;
                    }
                    self.stats.lock().cuts += 1;
                    // One in five past a move's silence limit (10 s).
                    let cut = if self.rng.chance(200) { self.rng.ms(10_500, 13_000) } else { self.rng.ms(20, 1500) };
                    self.event(format_args!("{} cut off from the control plane for {cut:?}", x.addr));
                    let me = self.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(cut).await;
                        x.cut.store(false, Relaxed);
                        me.event(format_args!("{} reaches the control plane again", x.addr));
                    });
                }
                _ => {
                    let p = self.pools[t].clone();
                    if p.down.swap(true, Relaxed) {
                        continue;
                    }
                    self.stats.lock().outages += 1;
                    let down = self.rng.ms(5, 400);
                    self.event(format_args!("pool of {} unreachable for {down:?}", p.target));
                    tokio::spawn(async move {
                        tokio::time::sleep(down).await;
                        p.down.store(false, Relaxed);
                    });
                }
            }
        }
    }

    async fn restart(&self, x: &Arc<Exporter>) {
        if x.life.lock().is_some() {
            return;
        }
        self.register(x).await;
        if x.life.lock().is_none() {
            self.start(x);
            self.event(format_args!("{} restarted", x.addr));
        }
    }

    /// A host's queue on volume `v`: reads and writes of the extents' first and last blocks,
    /// checked against the model as they complete.
    async fn client(self: Arc<Self>, v: usize, c: usize) -> Result<(), String> {
        let mut ch = Channel::new(IoEngine::Threads, IoPool::on_runtime());
        let blocks = EXTENTS_PER_VOLUME * BLOCKS_PER_EXTENT;
        for n in 0..self.opts.ops {
            let vol = loop {
                if let Some((_, vol, _)) = &*self.exporters[v].life.lock() {
                    break vol.clone();
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            };
            let first = self.rng.below(EXTENTS_PER_VOLUME) * BLOCKS_PER_EXTENT + HOT[self.rng.below(HOT.len() as u64) as usize];
            let count = (1 + self.rng.below(3)).min(blocks - first);
            let write = self.rng.chance(500);
            let mut buf = AlignedBuf::new((count * BLOCK) as usize);
            buf.set_len((count * BLOCK) as usize);
            let (id, start) = {
                let mut m = self.model.lock();
                let start = m.tick();
                let id = if write {
                    let id = m.writes.len() as u64;
                    m.writes.push(Span { start, end: u64::MAX, acked: false });
                    for b in first..first + count {
                        m.blocks.entry((v, b)).or_insert_with(|| vec![0]).push(id);
                    }
                    id
                } else {
                    0
                };
                (id, start)
            };
            if write {
                for (i, chunk) in buf.chunks_exact_mut(BLOCK as usize).enumerate() {
                    stamp(chunk, id, v, first + i as u64);
                }
            }
            let op = if write { Op::Write { off: first * BLOCK, fua: self.rng.chance(200) } } else { Op::Read { off: first * BLOCK } };
            let done = ch.run(&*vol, op, buf).await;
            {
                let mut m = self.model.lock();
                let end = m.tick();
                let what = if write { "write" } else { "read" };
                match done.result {
                    Err(e) => {
                        self.stats.lock().failed += 1;
                        if write {
                            m.writes[id as usize].end = end;
                        }
                        self.event(format_args!("v{v} client {c} op {n}: {what} {first}+{count} failed: {e}"));
                    }
                    Ok(()) if write => {
                        self.stats.lock().writes += 1;
                        m.writes[id as usize] = Span { start, end, acked: true };
                        self.event(format_args!("v{v} client {c} op {n}: write {id} of blocks {first}+{count} acknowledged"));
                    }
                    Ok(()) => {
                        self.stats.lock().reads += 1;
                        let mut got = Vec::new();
                        for (i, chunk) in done.buf.chunks_exact(BLOCK as usize).enumerate() {
                            let b = first + i as u64;
                            let id = unstamp(chunk, v, b).and_then(|id| m.allowed(v, b, id, start, end).map(|()| id));
                            match id {
                                Ok(id) => got.push(id),
                                Err(e) => {
                                    let ext = b / BLOCKS_PER_EXTENT;
                                    return Err(format!("v{v} client {c} op {n}: a read of block {b} (extent {ext}) returned {e}"));
                                }
                            }
                        }
                        self.event(format_args!("v{v} client {c} op {n}: read {first}+{count} = writes {got:?}"));
                    }
                }
            }
            tokio::time::sleep(self.rng.us(0, 3000)).await;
        }
        Ok(())
    }

    /// The end of a run: every fault healed, every exporter up, no control call lost; then
    /// every move must end (published, or aborted and confirmed).
    async fn quiesce(&self) -> Result<(), String> {
        self.ctl.faults.store(false, Relaxed);
        for p in &self.pools {
            p.down.store(false, Relaxed);
        }
        for x in &self.exporters {
            x.cut.store(false, Relaxed);
            self.restart(x).await;
        }
        self.event(format_args!("healed: waiting for the moves to end"));
        let deadline = Instant::now() + QUIESCE;
        loop {
            self.broken()?;
            let left: Vec<String> =
                self.ctl.cluster.lock().moves.values().map(|m| format!("{}/{} ({:?})", m.volume, m.index, m.state)).collect();
            if left.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!("moves never ended: {left:?}"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Every hot block of every volume read back through its exporter.
    async fn read_back(&self) -> Result<(), String> {
        let mut ch = Channel::new(IoEngine::Threads, IoPool::on_runtime());
        for (v, x) in self.exporters.iter().enumerate() {
            let vol = x.life.lock().as_ref().map(|l| l.1.clone()).ok_or("an exporter is down at the end")?;
            for e in 0..EXTENTS_PER_VOLUME {
                for h in HOT {
                    let b = e * BLOCKS_PER_EXTENT + h;
                    let mut buf = AlignedBuf::new(BLOCK as usize);
                    buf.set_len(BLOCK as usize);
                    let start = self.model.lock().tick();
                    let done = ch.run(&*vol, Op::Read { off: b * BLOCK }, buf).await;
                    done.result.map_err(|e| format!("reading back v{v} block {b}: {e}"))?;
                    let m = self.model.lock();
                    let id = unstamp(&done.buf, v, b).and_then(|id| m.allowed(v, b, id, start, start).map(|()| id));
                    id.map_err(|err| format!("reading back v{v} block {b} (extent {e}) at the end returned {err}"))?;
                }
            }
        }
        Ok(())
    }

    /// The books at the end: no move, each pool holding exactly its extents, each extent's
    /// epoch one more than its publications, and the state the same as its records load.
    fn final_books(&self) -> Result<(), String> {
        let c = self.ctl.cluster.lock();
        check_books(&c)?;
        let moved = self.ctl.moved.lock();
        for e in c.extents.values() {
            let n = moved.get(&(e.volume.clone(), e.index)).copied().unwrap_or(0);
            if e.epoch != n + 1 {
                return Err(format!("extent {}/{} is at epoch {} after {n} publications", e.volume, e.index, e.epoch));
            }
        }
        self.stats.lock().published = moved.values().sum();
        let records = c
            .targets
            .values()
            .map(|t| Record::Target(t.clone()))
            .chain(c.pools.values().map(|p| Record::Pool(p.clone())))
            .chain(c.volumes.values().map(|v| Record::Volume(v.clone())))
            .chain(c.extents.values().map(|e| Record::Extent(e.clone())))
            .chain(c.views.values().map(|v| Record::View(v.clone())))
            .chain(c.exports.values().map(|x| Record::Export(x.clone())))
            .chain(c.counters.iter().map(|(name, &value)| Record::Counter(Counter { name: name.clone(), value })));
        if Cluster::from_records(records) != *c {
            return Err("the state in memory is not what its records load".into());
        }
        Ok(())
    }
}
