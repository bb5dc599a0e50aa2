//! The offload engine: runs compute commands where the data lies.
//!
//! A connection validates an EXEC (descriptor, operation, arguments, extents) and hands a
//! [`Task`] to the engine's worker pool; the connection goes on serving other commands. A
//! worker streams each input object in chunks (`compute.chunk`, 1 MiB by default) through
//! the operation of the shared compute crate, read through the namespace's device stack or
//! a peer's device ([`read`]): `compute.readahead` chunks per input in flight while the
//! operation computes, started on the network runtime, with no thread per input. Outputs
//! are written through the backend in chunks, padded to whole
//! blocks, and made durable before the command completes. The result (JSON outcomes) or
//! the error message goes back to the connection, which holds it in the controller's
//! [`Results`] under a handle for the host to FETCH.
//!
//! Bounds: a command's chunk buffers plus its operation's working memory stay under
//! `compute.memory_per_command`; it stops with TIMEOUT after `compute.timeout_secs`, and
//! when its controller goes away.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nearstore_compute::{ComputeError, Context, Operation, Outcome, Sink, Source, Stop};
use nearstore_transport::AlignedBuf;
use nearstore_wire::compute::{status as cs, Descriptor, Extent, Object};
use nearstore_wire::Status;
use serde::Deserialize;
use tokio::sync::mpsc::UnboundedSender;
use tokio_util::sync::CancellationToken;

use crate::cluster::{ClusterConfig, Peers};
use crate::config::{ByteSize, IoEngine};
use crate::io_pool::{Done, IoPool};
use crate::limits;
use crate::memory::{Memory, Reservation};
use crate::sched::{Cpu, FairQueue, Turn};
use crate::subsystem::{Controller, Namespace};
use crate::tenant::{TenantId, TenantPolicy};
use crate::uring::RingPool;

mod read;
mod volume;

use crate::dev::Op;
pub use read::IoContext;
use read::{Io, NsSource, Shared};

/// The `[compute]` section of the configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ComputeConfig {
    /// Commands computing at once (default: the machine's cores); more take turns.
    pub threads: usize,
    /// Bytes read from the backend and handed to the operation at a time.
    pub chunk: ByteSize,
    /// Chunks read ahead of the operation, per input.
    pub readahead: usize,
    /// Memory one command may use: its chunk buffers plus the operation's own. Default: a
    /// quarter of the memory budget, at most 256 MiB (`memory::Plan`); a target resolves it
    /// when it starts.
    pub memory_per_command: Option<ByteSize>,
    /// Longest a command may run before it fails with TIMEOUT.
    pub timeout_secs: u64,
    /// How long an unfetched result or message is held.
    pub result_ttl_secs: u64,
    /// The nice value of the commands' threads, absolute (0 to 19; a thread already at a
    /// higher one keeps it; the threads a command starts inherit it): computing, they yield
    /// the CPU to the target's network and I/O threads, so that plain I/O and a short
    /// command's sending and receiving do not wait behind a long command's turn.
    pub nice: i32,
}

impl Default for ComputeConfig {
    fn default() -> Self {
        ComputeConfig {
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            chunk: ByteSize(limits::COMPUTE_CHUNK_BYTES_DEFAULT),
            readahead: limits::COMPUTE_READAHEAD_CHUNKS_DEFAULT,
            memory_per_command: None,
            timeout_secs: limits::COMPUTE_TIMEOUT_SECS_DEFAULT,
            result_ttl_secs: limits::RESULT_TTL_SECS_DEFAULT,
            nice: limits::COMPUTE_NICE_DEFAULT,
        }
    }
}

impl ComputeConfig {
    /// Checks ranges; errors name the field as it is written in the TOML file.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let e = |f: &str, m: String| Err((format!("compute.{f}"), m));
        if self.threads == 0 || self.threads > limits::COMPUTE_THREADS_MAX {
            return e("threads", format!("must be between 1 and {}", limits::COMPUTE_THREADS_MAX));
        }
        let c = self.chunk.0;
        let (align, max) = (limits::COMPUTE_CHUNK_ALIGN_BYTES, limits::COMPUTE_CHUNK_BYTES_MAX);
        if !(align..=max).contains(&c) || !c.is_multiple_of(align) {
            return e(
                "chunk",
                format!("{c} bytes: must be a multiple of {} KiB between {} KiB and {} MiB", align >> 10, align >> 10, max >> 20),
            );
        }
        if self.readahead > limits::COMPUTE_READAHEAD_CHUNKS_MAX {
            return e("readahead", format!("must be at most {} chunks", limits::COMPUTE_READAHEAD_CHUNKS_MAX));
        }
        let need = self.chunk_bytes();
        if self.memory_per_command.is_some_and(|m| m.0 < need) {
            return e("memory_per_command", format!("must hold at least one input's chunks ({need} bytes)"));
        }
        if self.timeout_secs == 0 || self.timeout_secs > limits::COMPUTE_TIMEOUT_SECS_MAX {
            return e("timeout_secs", format!("must be between 1 and {}", limits::COMPUTE_TIMEOUT_SECS_MAX));
        }
        if self.result_ttl_secs == 0 || self.result_ttl_secs > limits::RESULT_TTL_SECS_MAX {
            return e("result_ttl_secs", format!("must be between 1 and {}", limits::RESULT_TTL_SECS_MAX));
        }
        if !(0..=19).contains(&self.nice) {
            return e("nice", "must be between 0 and 19 (a compute thread never runs ahead of the target's own)".into());
        }
        Ok(())
    }

    /// The chunk buffers of one input: the least memory a command needs.
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk.0 * (self.readahead as u64 + 1)
    }

    /// `memory_per_command` in bytes: as configured or as the target resolved it, else
    /// (no budget applies: `execute_here`) [`limits::COMPUTE_MEMORY_PER_COMMAND_BYTES_DEFAULT`].
    pub fn command_bytes(&self) -> u64 {
        self.memory_per_command.map_or(limits::COMPUTE_MEMORY_PER_COMMAND_BYTES_DEFAULT, |m| m.0)
    }
}

/// Counters of the engine, served by the metrics endpoint.
#[derive(Default)]
pub struct ComputeStats {
    pub commands: AtomicU64,
    pub errors: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    /// Commands started (on a thread of their own, computing or waiting for a turn).
    pub running: AtomicU64,
    /// Commands waiting to start.
    pub queued: AtomicU64,
    /// Device reads of the commands started and not yet completed.
    pub reads_in_flight: AtomicU64,
    /// Commands on an exported volume sent to the peer holding all their bytes.
    pub forwarded: AtomicU64,
    /// Commands on an exported volume run on this target's pool holding all their bytes.
    pub on_pool: AtomicU64,
}

/// Why a command failed: the NVMe status and the message the host can fetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub status: Status,
    pub message: String,
}

impl Failure {
    pub fn new(status: Status, message: impl Into<String>) -> Failure {
        Failure { status, message: message.into() }
    }
}

/// The NVMe status of an operation's error.
pub fn status_of(e: &ComputeError) -> Status {
    match e {
        ComputeError::UnknownOperation(_) | ComputeError::UnknownOperationId(_) => cs::UNKNOWN_OPERATION,
        ComputeError::BadArguments { .. } | ComputeError::Objects { .. } => cs::BAD_ARGUMENTS,
        ComputeError::LineTooLong { .. } | ComputeError::Data { .. } => cs::OPERATION_FAILED,
        ComputeError::OutputFull { .. } => cs::OUTPUT_TOO_SMALL,
        ComputeError::Memory { .. } | ComputeError::ResultTooLarge { .. } => cs::LIMIT_EXCEEDED,
        ComputeError::Io(_) => Status::UNRECOVERED_READ_ERROR.dnr(),
        ComputeError::WriteIo(_) => Status::WRITE_FAULT.dnr(),
        ComputeError::Timeout(_) => cs::TIMEOUT,
        ComputeError::Cancelled => Status::ABORT_REQUESTED,
    }
}

impl From<ComputeError> for Failure {
    fn from(e: ComputeError) -> Failure {
        Failure { status: status_of(&e), message: e.to_string() }
    }
}

/// What a finished task hands back: the JSON result or a failure, and the reservation of
/// its result slot (released when the connection has stored the result, or dropped).
pub struct Computed {
    pub result: Result<Vec<u8>, Failure>,
    pub slot: Slot,
}

/// A compute command's claim on one of its controller's result slots, taken when the
/// command is accepted so that its result always has room.
pub struct Slot {
    ctrl: Arc<Controller>,
    /// RESULT_BYTES_MAX of the target's memory budget, until the result is stored.
    memory: Option<Reservation>,
    /// Its controller's life while the command may still write (crate::subsystem::Life).
    _life: Option<Arc<crate::subsystem::Life>>,
}

impl Slot {
    /// Claims a slot, or RESULTS_FULL when the controller holds its limit of results and
    /// running commands, or the target's memory budget cannot hold one more result and
    /// still `command_bytes` for a command to start.
    pub fn claim(ctrl: &Arc<Controller>, memory: &Arc<Memory>, command_bytes: u64) -> Option<Slot> {
        let mut r = ctrl.results.lock();
        r.purge(Instant::now());
        if r.held.len() + r.reserved >= limits::RESULTS_HELD_MAX {
            return None;
        }
        let memory = memory.reserve_leaving(limits::RESULT_BYTES_MAX as u64, command_bytes)?;
        r.reserved += 1;
        Some(Slot { ctrl: ctrl.clone(), memory: Some(memory), _life: ctrl.life() })
    }

    /// Its controller, as a key of the engine's fair queue.
    fn owner(&self) -> usize {
        Arc::as_ptr(&self.ctrl) as usize
    }

    /// Its controller's tenant.
    fn tenant(&self) -> &Arc<TenantPolicy> {
        &self.ctrl.tenant
    }

    /// Stores `data` in the claimed slot, holding only its bytes of the budget: its handle.
    /// What is charged is the allocation, trimmed to the bytes first: a serialised result's
    /// Vec grew by doubling and held up to twice its length (found by the peak resident
    /// memory test, crates/cli/tests/memory.rs).
    pub fn fill(mut self, mut data: Vec<u8>, ttl: Duration) -> u32 {
        data.shrink_to_fit();
        let mut memory = self.memory.take();
        if let Some(m) = &mut memory {
            m.shrink_to(data.capacity() as u64);
        }
        let handle = self.ctrl.results.lock().insert(data, Instant::now() + ttl, memory);
        // Gives the slot's place among the reserved ones back.
        drop(self);
        handle
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.ctrl.results.lock().reserved -= 1;
    }
}

/// Results and messages a controller holds for its host, by handle.
#[derive(Default)]
pub struct Results {
    next: u32,
    held: HashMap<u32, (Vec<u8>, Instant, Option<Reservation>)>,
    /// Slots claimed by running commands.
    reserved: usize,
}

impl Results {
    fn purge(&mut self, now: Instant) {
        self.held.retain(|_, (_, expires, _)| *expires > now);
    }

    fn insert(&mut self, data: Vec<u8>, expires: Instant, memory: Option<Reservation>) -> u32 {
        loop {
            self.next = self.next.wrapping_add(1);
            if self.next != 0 && !self.held.contains_key(&self.next) {
                break;
            }
        }
        self.held.insert(self.next, (data, expires, memory));
        self.next
    }

    /// Copies up to `len` bytes from `offset` of what `handle` holds: (bytes, remaining
    /// after them). Reaching the end releases the handle.
    pub fn fetch(&mut self, handle: u32, offset: u64, len: usize) -> Result<(Vec<u8>, u32), Failure> {
        self.purge(Instant::now());
        let Some((data, _, _)) = self.held.get(&handle) else {
            return Err(Failure::new(
                cs::HANDLE_INVALID,
                format!("handle {handle} is not held (never issued, fetched to the end, released or expired)"),
            ));
        };
        if offset > data.len() as u64 {
            return Err(Failure::new(
                Status::INVALID_FIELD.dnr(),
                format!("offset {offset} is past the {} bytes of handle {handle}", data.len()),
            ));
        }
        let start = offset as usize;
        let end = (start + len).min(data.len());
        let out = data[start..end].to_vec();
        let remaining = (data.len() - end) as u32;
        if remaining == 0 {
            self.held.remove(&handle);
        }
        Ok((out, remaining))
    }

    pub fn release(&mut self, handle: u32) -> bool {
        self.held.remove(&handle).is_some()
    }

    /// Compute commands of the controller still running (their slots are claimed).
    pub fn running(&self) -> usize {
        self.reserved
    }
}

/// A compute command's side of a Preempt and Abort: the cancellation that stops it and
/// the waits it holds until its task has ended, that is until the engine no longer reads
/// or writes the namespace for it ([`TaskAbort::ended`]), whether or not its connection
/// has taken the completion yet (as Linux's nvmet lets go at nvmet_req_complete).
pub struct TaskAbort {
    pub cancel: CancellationToken,
    held: parking_lot::Mutex<Held>,
}

#[derive(Default)]
struct Held {
    guards: Vec<crate::subsystem::AbortGuard>,
    /// A Preempt and Abort stopped it.
    aborted: bool,
    ended: bool,
}

impl TaskAbort {
    /// For a command of the connection whose token is `connection`.
    pub fn new(connection: &CancellationToken) -> Arc<TaskAbort> {
        Arc::new(TaskAbort { cancel: connection.child_token(), held: parking_lot::Mutex::new(Held::default()) })
    }

    /// Stops the command; `guard` is held until its task has ended (dropped at once when
    /// it already has).
    pub fn abort(&self, guard: crate::subsystem::AbortGuard) {
        let mut held = self.held.lock();
        held.aborted = true;
        if !held.ended {
            held.guards.push(guard);
        }
        drop(held);
        self.cancel.cancel();
    }

    /// Whether a Preempt and Abort stopped the command.
    pub fn aborted(&self) -> bool {
        self.held.lock().aborted
    }

    /// The task has ended: the waits it held are let go.
    fn ended(&self) {
        let guards = {
            let mut held = self.held.lock();
            held.ended = true;
            std::mem::take(&mut held.guards)
        };
        drop(guards);
    }
}

/// A validated compute command, ready to run.
pub struct Task {
    pub ns: Arc<Namespace>,
    pub op: &'static Operation,
    pub desc: Descriptor,
    pub token: u32,
    pub slot: Slot,
    pub reply: UnboundedSender<Done>,
    /// Fires when its connection closes, its controller goes away, or a Preempt and Abort
    /// aborts it (`abort`'s token, a child of the connection's).
    pub cancel: CancellationToken,
    /// Shared with the connection's record of the command.
    pub abort: Arc<TaskAbort>,
    /// The host the command runs for (`Controller::requester`): peers are read for it.
    pub host: String,
}

/// Checks an EXEC's descriptor against the namespace and the cluster map before anything
/// runs. Extents on peers are checked against the peer's namespace when it is read.
pub fn validate(ns: &Namespace, data: &[u8], cfg: &ComputeConfig, peers: &Peers) -> Result<(Descriptor, &'static Operation), Failure> {
    let mut desc = Descriptor::decode(data).map_err(|e| Failure::new(e.status, e.message))?;
    let op = nearstore_compute::by_id(desc.op)?;
    op.check(&desc.args, desc.inputs.len(), desc.outputs.len())?;
    if let Some(own) = ns.tag {
        desc.localize(own);
    }
    desc.check_extents(ns.backend.size(), ns.block_size as u64).map_err(|e| Failure::new(e.status, e.message))?;
    if let Some(t) = desc.remote_tags().into_iter().find(|t| !peers.knows(*t)) {
        return Err(Failure::new(
            cs::DEVICE_UNKNOWN,
            format!("descriptor: device tag {t} is not in this target's cluster map (its [[cluster.peer]] entries)"),
        ));
    }
    let buffers = buffer_bytes(&desc, cfg);
    if buffers > cfg.command_bytes() {
        return Err(Failure::new(
            cs::LIMIT_EXCEEDED,
            format!(
                "{} inputs and {} outputs need {buffers} bytes of chunk buffers, more than compute.memory_per_command ({} bytes)",
                desc.inputs.len(),
                desc.outputs.len(),
                cfg.command_bytes()
            ),
        ));
    }
    Ok((desc, op))
}

/// Chunk buffers of one command: readahead + 1 per input, one per output.
fn buffer_bytes(desc: &Descriptor, cfg: &ComputeConfig) -> u64 {
    let chunk = cfg.chunk.0;
    desc.inputs.len() as u64 * (cfg.readahead as u64 + 1) * chunk + desc.outputs.len() as u64 * chunk
}

/// The engine: commands wait in a queue fair across controllers, start on a thread of
/// their own, and compute in turns (crate::sched).
pub struct Offload {
    engine: Arc<Engine>,
    pub cfg: ComputeConfig,
    pub stats: Arc<ComputeStats>,
    /// The cluster map's peers, read from by the workers.
    pub peers: Arc<Peers>,
    /// The io_urings of ended commands, kept for the next ones.
    pub rings: Arc<RingPool>,
}

struct Engine {
    pending: parking_lot::Mutex<Pending>,
    cpu: Arc<Cpu>,
    /// The target's budget: a started command reserves `compute.memory_per_command`.
    memory: Arc<Memory>,
    cfg: ComputeConfig,
    stats: Arc<ComputeStats>,
    peers: Arc<Peers>,
    /// The devices' settings, and the network runtime, known from the first command
    /// (submitted by a connection task on it).
    engine: IoEngine,
    pool: IoPool,
    rt: std::sync::OnceLock<tokio::runtime::Handle>,
    /// Idle io_urings of the commands' I/O tasks, all on `rt`.
    rings: Arc<RingPool>,
}

#[derive(Default)]
struct Pending {
    /// Commands waiting to start, and since when.
    tasks: FairQueue<(Task, Instant)>,
    started: usize,
    /// Started commands per controller.
    per_ctrl: HashMap<usize, usize>,
    /// Bytes the started commands of each tenant hold (`compute.memory_per_command` each).
    per_tenant: HashMap<TenantId, u64>,
}

/// Whether a command of `tenant` of `bytes` fits in its `offload_memory` beside its
/// started ones (`per_tenant`: what each tenant's hold). One always does: a limit below
/// `compute.memory_per_command` runs the tenant's commands one at a time.
fn fits(per_tenant: &HashMap<TenantId, u64>, tenant: &TenantPolicy, bytes: u64) -> bool {
    let held = per_tenant.get(&tenant.id).copied().unwrap_or(0);
    held == 0 || tenant.offload_memory.is_none_or(|limit| held + bytes <= limit)
}

impl Offload {
    /// `engine` and `pool` are the target's, for the devices the commands read.
    pub fn new(cfg: ComputeConfig, cluster: &ClusterConfig, memory: Arc<Memory>, (engine, pool): (IoEngine, IoPool)) -> Offload {
        let stats = Arc::new(ComputeStats::default());
        let peers = Arc::new(Peers::new(cluster));
        let rings = Arc::new(RingPool::new(limits::COMPUTE_RINGS_IDLE_MAX));
        let engine = Arc::new(Engine {
            pending: parking_lot::Mutex::new(Pending::default()),
            cpu: Cpu::new(cfg.threads),
            memory,
            cfg: cfg.clone(),
            stats: stats.clone(),
            peers: peers.clone(),
            engine,
            pool,
            rt: std::sync::OnceLock::new(),
            rings: rings.clone(),
        });
        Offload { engine, cfg, stats, peers, rings }
    }

    /// Queues a command; called on the network runtime, whose tasks run its I/O.
    pub fn submit(&self, task: Task) {
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let _ = self.engine.rt.get_or_init(|| rt);
        }
        let key = task.slot.owner();
        let mut p = self.engine.pending.lock();
        if !fits(&p.per_tenant, task.slot.tenant(), self.cfg.command_bytes()) {
            task.slot.tenant().stats.offload_memory_waits.fetch_add(1, Relaxed);
        }
        p.tasks.push(key, (task, Instant::now()));
        drop(p);
        self.engine.dispatch();
    }

    /// Starts queued commands if memory was given back outside the engine (a result
    /// fetched or released).
    pub fn kick(&self) {
        self.engine.dispatch();
    }
}

impl Engine {
    /// Drops queued commands whose connection has gone and starts what the limits allow,
    /// taking controllers in turn.
    fn dispatch(self: &Arc<Self>) {
        let mut start = Vec::new();
        let mut dropped = Vec::new();
        {
            let mut guard = self.pending.lock();
            let p = &mut *guard;
            p.tasks.retain(|(t, _)| !t.cancel.is_cancelled(), |(t, _)| dropped.push(t));
            let bytes = self.cfg.command_bytes();
            while p.started < limits::COMPUTE_STARTED_MAX && !p.tasks.is_empty() {
                // A started command holds its whole bound of the budget: while the budget
                // is full, commands wait here; so do a tenant's while it holds its
                // offload_memory.
                let Some(memory) = self.memory.reserve(bytes) else { break };
                let (per, held) = (&p.per_ctrl, &p.per_tenant);
                let eligible = |k: usize, (t, _): &(Task, Instant)| {
                    per.get(&k).copied().unwrap_or(0) < limits::COMPUTE_STARTED_PER_CONTROLLER_MAX && fits(held, t.slot.tenant(), bytes)
                };
                let Some((key, (t, since))) = p.tasks.pop_if(eligible) else {
                    break;
                };
                let tenant = t.slot.tenant().clone();
                tenant.stats.compute_queued_ns.fetch_add(since.elapsed().as_nanos() as u64, Relaxed);
                tenant.stats.offload_memory_bytes.fetch_add(bytes, Relaxed);
                *p.per_tenant.entry(tenant.id).or_default() += bytes;
                p.started += 1;
                *p.per_ctrl.entry(key).or_default() += 1;
                start.push((key, t, memory));
            }
            self.stats.queued.store(p.tasks.len() as u64, Relaxed);
        }
        for t in dropped {
            finish(t, Err(ComputeError::Cancelled.into()));
        }
        for (key, t, memory) in start {
            // The task goes to the thread only once it exists: if it cannot be made, the
            // command still completes, with an error.
            let (tx, rx) = crossbeam_channel::bounded::<Task>(1);
            let engine = self.clone();
            let nice = self.cfg.nice;
            let spawned = std::thread::Builder::new().name("nearstore-compute".into()).spawn(move || {
                lower_priority(nice);
                if let Ok(t) = rx.recv() {
                    engine.run_task(key, t, memory);
                }
            });
            match spawned {
                Ok(_) => {
                    let _ = tx.send(t);
                }
                Err(e) => {
                    self.stopped(key, t.slot.tenant());
                    finish(t, Err(Failure::new(Status::INTERNAL_ERROR, format!("no thread for the command: {e}"))));
                }
            }
        }
    }

    /// Runs a started command on its own thread, in turns, then starts the next.
    fn run_task(self: &Arc<Self>, key: usize, task: Task, memory: Reservation) {
        self.stats.running.fetch_add(1, Relaxed);
        let tenant = task.slot.tenant().clone();
        let turn = Arc::new(self.cpu.turn(key, tenant.clone()));
        let cancel = task.cancel.clone();
        let result = if turn.take(&|| cancel.is_cancelled()) {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let Some(rt) = self.rt.get() else {
                    return Err(Failure::new(Status::INTERNAL_ERROR, "the offload engine has no network runtime for its I/O"));
                };
                // Its reads and writes are its tenant's share in fair-scheduled devices, as
                // its controller's I/O is (the tenant of the host it runs for).
                let share = Arc::new(crate::dev::fair::Tenant::of(&tenant, &task.host));
                let io = IoContext {
                    rt: rt.clone(),
                    engine: self.engine,
                    pool: self.pool.clone(),
                    rings: self.rings.clone(),
                    tenant: Some(share),
                    reader: read::spare_core(),
                };
                let place = match &task.ns.placement {
                    // Translating waits on the network: the turn goes to others meanwhile.
                    Some(v) => {
                        turn.give_back();
                        let placed =
                            on_runtime(rt, &task.cancel, volume::place(v.clone(), task.desc.clone())).unwrap_or(volume::Place::Here);
                        if !turn.take(&|| task.cancel.is_cancelled()) {
                            return Err(ComputeError::Cancelled.into());
                        }
                        placed
                    }
                    None => volume::Place::Here,
                };
                let peers = (&self.peers, task.host.as_str(), &io);
                // Placed on a volume's pools: not started once the volume stopped here (its
                // export ended or its lease ran out while the command waited for a turn).
                let halted = !matches!(place, volume::Place::Here) && task.ns.placement.as_ref().is_some_and(|v| v.halted());
                if halted {
                    return Err(Failure::new(Status::NAMESPACE_NOT_READY, "the volume is no longer served by this target"));
                }
                match place {
                    volume::Place::Here => run(&task.ns, task.op, &task.desc, &task.cancel, Some(&turn), &self.cfg, &self.stats, peers),
                    // The extents' tickets are held until the command is done with them: a
                    // move of one waits for it (offload/volume.rs).
                    volume::Place::Pool(ns, desc, _held) => {
                        self.stats.on_pool.fetch_add(1, Relaxed);
                        run(&ns, task.op, &desc, &task.cancel, Some(&turn), &self.cfg, &self.stats, peers)
                    }
                    volume::Place::Peer(pool, desc, _held) => {
                        self.stats.forwarded.fetch_add(1, Relaxed);
                        // The peer computes: this thread only waits, without a turn.
                        turn.give_back();
                        let (connect, runs) = (self.peers.timeout(), Duration::from_secs(self.cfg.timeout_secs));
                        let writes = !desc.outputs.is_empty();
                        let f = volume::on_peer(pool, desc, self.peers.member().to_string(), connect, runs);
                        wait_forwarded(rt, &task.cancel, writes, f).unwrap_or_else(|| Err(ComputeError::Cancelled.into()))
                    }
                }
            }))
            .unwrap_or_else(|_| Err(Failure::new(Status::INTERNAL_ERROR, "the operation panicked: a bug, please report it")))
        } else {
            Err(ComputeError::Cancelled.into())
        };
        turn.give_back();
        self.stats.running.fetch_sub(1, Relaxed);
        self.stats.commands.fetch_add(1, Relaxed);
        if result.is_err() {
            self.stats.errors.fetch_add(1, Relaxed);
        }
        tenant.stats.compute_commands.fetch_add(1, Relaxed);
        drop(turn);
        // Its tenant's offload memory is given back before the host hears of the end, so
        // that the host's next look at the metrics never sees an ended command's memory.
        self.stopped(key, &tenant);
        finish(task, result);
        drop(memory);
        self.dispatch();
    }

    /// A started command of controller `key`, tenant `tenant`, ended.
    fn stopped(&self, key: usize, tenant: &TenantPolicy) {
        let bytes = self.cfg.command_bytes();
        tenant.stats.offload_memory_bytes.fetch_sub(bytes, Relaxed);
        let mut p = self.pending.lock();
        if let Some(m) = p.per_tenant.get_mut(&tenant.id) {
            *m -= bytes;
            if *m == 0 {
                p.per_tenant.remove(&tenant.id);
            }
        }
        p.started -= 1;
        if let Some(n) = p.per_ctrl.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                p.per_ctrl.remove(&key);
            }
        }
    }
}

/// Runs `f` on the network runtime and waits for it on this (compute) thread; None when
/// `cancel` fires first (the future is dropped there).
fn on_runtime<T: Send + 'static>(
    rt: &tokio::runtime::Handle,
    cancel: &CancellationToken,
    f: impl std::future::Future<Output = T> + Send + 'static,
) -> Option<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let cancel = cancel.clone();
    rt.spawn(async move {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => {}
            v = f => {
                let _ = tx.send(v);
            }
        }
    });
    rx.blocking_recv().ok()
}

/// Waits on this (compute) thread for a command forwarded to a peer; None when `cancel`
/// fired. A peer that only reads is let go at once (the connection to it is dropped). One
/// that `writes` the command's outputs is not stopped by that at once: its writes could
/// land after a Preempt and Abort waiting for this command went on, so it is waited for
/// until it answers (within its own time limit, the command's `run`) and the command
/// then ends cancelled.
fn wait_forwarded<T: Send + 'static>(
    rt: &tokio::runtime::Handle,
    cancel: &CancellationToken,
    writes: bool,
    f: impl std::future::Future<Output = T> + Send + 'static,
) -> Option<T> {
    if !writes {
        return on_runtime(rt, cancel, f);
    }
    let answer = on_runtime(rt, &CancellationToken::new(), f);
    answer.filter(|_| !cancel.is_cancelled())
}

/// Sends a command's result back to its connection (which may be gone).
fn finish(task: Task, result: Result<Vec<u8>, Failure>) {
    // Nothing of it touches the namespace any more: a Preempt and Abort waiting for it
    // goes on now, not when its connection takes the completion, which a host that
    // stopped reading its socket would put off indefinitely.
    task.abort.ended();
    let Task { token, slot, reply, .. } = task;
    let _ = reply.send(Done::computed(token, Computed { result, slot }));
}

/// Runs a descriptor on this thread, as a worker does, without a controller: the
/// engine alone, reading the namespace's devices and computing (benchmarks measure
/// the offloaded path against it), its I/O on `io`. Returns the JSON outcomes.
pub fn execute_here(ns: &Namespace, data: &[u8], cfg: &ComputeConfig, io: &IoContext) -> Result<Vec<u8>, Failure> {
    let peers = Arc::new(Peers::new(&ClusterConfig::default()));
    let (desc, op) = validate(ns, data, cfg, &peers)?;
    run(ns, op, &desc, &CancellationToken::new(), None, cfg, &ComputeStats::default(), (&peers, "", io))
}

/// Runs one command on the calling thread; `peers` are read for `host`, each admitted
/// before anything is read.
#[allow(clippy::too_many_arguments)]
fn run(
    ns: &Namespace,
    op: &'static Operation,
    desc: &Descriptor,
    cancel: &CancellationToken,
    turn: Option<&Arc<Turn>>,
    cfg: &ComputeConfig,
    stats: &ComputeStats,
    (peers, host, io): (&Arc<Peers>, &str, &IoContext),
) -> Result<Vec<u8>, Failure> {
    let deadline = Instant::now() + Duration::from_secs(cfg.timeout_secs);
    let block = ns.block_size as u64;
    let chunk = cfg.chunk.0 as usize;
    // The operation looks at its stop inside long work on one record, too: the
    // command's deadline, its connection's cancellation, and its turn to compute.
    let token = cancel.clone();
    let probe: Box<dyn Fn() -> bool + Send + Sync> = match turn.cloned() {
        Some(turn) => Box::new(move || !turn.checkpoint(&|| token.is_cancelled()) || token.is_cancelled()),
        None => Box::new(move || token.is_cancelled()),
    };
    let halt = Stop::new(Some(Duration::from_secs(cfg.timeout_secs)), Some(probe));
    let ctx = Context { memory_max: (cfg.command_bytes() - buffer_bytes(desc, cfg)) as usize, stop: halt };
    let limits = Limits { deadline, timeout_secs: cfg.timeout_secs, cancel, turn: turn.map(|t| &**t) };
    // Every peer admits the host before a byte is read.
    let (reads, remotes) = Io::start(io, peers, desc.remote_tags(), host, stats, &limits)?;
    let shared = Shared {
        io: std::cell::RefCell::new(reads),
        local: ns.dev.clone(),
        ranges: ns.ranges.clone(),
        block,
        remotes,
        peers,
        peer_failure: std::cell::RefCell::new(None),
    };
    let outcome: Result<Vec<Outcome>, ComputeError> = {
        let mut sources: Vec<NsSource> = desc.inputs.iter().map(|o| NsSource::new(o, chunk, cfg.readahead, &shared, &limits)).collect();
        let mut sinks: Vec<NsSink> = desc.outputs.iter().map(|o| NsSink::new(o, chunk, &shared, &limits)).collect();
        let r = {
            let mut ins: Vec<&mut dyn Source> = sources.iter_mut().map(|s| s as &mut dyn Source).collect();
            let mut outs: Vec<&mut dyn Sink> = sinks.iter_mut().map(|s| s as &mut dyn Sink).collect();
            op.execute(&desc.args, &mut ins, &mut outs, &ctx)
        };
        let read: u64 = sources.iter().map(|s| s.read).sum();
        drop(sources);
        stats.bytes_read.fetch_add(read, Relaxed);
        let tenant = io.tenant.as_ref().map(|t| &t.stats);
        if let Some(t) = tenant {
            t.compute_read_bytes.fetch_add(read, Relaxed);
        }
        r.and_then(|o| {
            for s in &mut sinks {
                s.finish()?;
                stats.bytes_written.fetch_add(s.written, Relaxed);
                if let Some(t) = tenant {
                    t.compute_written_bytes.fetch_add(s.written, Relaxed);
                }
            }
            Ok(o)
        })
    };
    let Shared { io: reads, peer_failure, .. } = shared;
    // Waits for the reads still running (the operation stopped early, or failed).
    drop(reads);
    let outcome = outcome.map_err(|e| peer_failure.into_inner().unwrap_or_else(|| e.into()))?;
    let json = serde_json::to_vec(&outcome).expect("outcomes serialise");
    if json.len() > limits::RESULT_BYTES_MAX {
        return Err(Failure::new(
            cs::LIMIT_EXCEEDED,
            format!("result of {} bytes, more than the limit of {} (write rows to an output object)", json.len(), limits::RESULT_BYTES_MAX),
        ));
    }
    Ok(json)
}

struct Limits<'a> {
    deadline: Instant,
    timeout_secs: u64,
    cancel: &'a CancellationToken,
    /// The command's turn to compute, handed on at checks when others wait.
    turn: Option<&'a Turn>,
}

impl Limits<'_> {
    /// Runs `wait` (a wait for a read's completion) without holding the command's turn to
    /// compute, which another command may take meanwhile, then holds a turn again: a
    /// command waiting on a slow device or peer does not keep the engine from others.
    /// What `wait` returned, or Cancelled if the command stops before its turn comes back.
    fn without_turn<T>(&self, wait: impl FnOnce() -> T) -> Result<T, ComputeError> {
        let Some(turn) = self.turn else { return Ok(wait()) };
        turn.give_back();
        let got = wait();
        if !turn.take(&|| self.cancel.is_cancelled()) {
            return Err(ComputeError::Cancelled);
        }
        Ok(got)
    }

    fn check(&self) -> Result<(), ComputeError> {
        let stopped = || self.cancel.is_cancelled();
        if stopped() || self.turn.is_some_and(|t| !t.checkpoint(&stopped)) {
            return Err(ComputeError::Cancelled);
        }
        if Instant::now() >= self.deadline {
            return Err(ComputeError::Timeout(self.timeout_secs));
        }
        Ok(())
    }
}

/// An output object: bytes gathered into a chunk buffer and written to its extents in
/// order through the namespace's device stack (on the command's I/O task, or at once on a
/// device that completes at once), one write at a time; the last block is padded with
/// zeros, and a flush through the stack makes them durable.
struct NsSink<'s, 'a> {
    shared: &'s Shared<'a>,
    pieces: VecDeque<Extent>,
    /// None only after a write that did not come back (the command stops).
    buf: Option<AlignedBuf>,
    chunk: usize,
    block: u64,
    capacity: u64,
    written: u64,
    /// Bytes were written since the last flush.
    dirty: bool,
    limits: &'s Limits<'s>,
}

impl<'s, 'a> NsSink<'s, 'a> {
    fn new(o: &Object, chunk: usize, shared: &'s Shared<'a>, limits: &'s Limits<'s>) -> NsSink<'s, 'a> {
        let mut buf = AlignedBuf::new(chunk);
        buf.set_len(0);
        NsSink {
            shared,
            pieces: o.extents.iter().copied().collect(),
            buf: Some(buf),
            chunk,
            block: shared.block,
            capacity: o.len,
            written: 0,
            dirty: false,
            limits,
        }
    }

    fn buf(&mut self) -> Result<&mut AlignedBuf, ComputeError> {
        self.buf.as_mut().ok_or_else(|| ComputeError::WriteIo("an earlier write of the output did not complete".into()))
    }

    /// Runs `op` with the sink's buffer on the namespace's stack and waits for it; the
    /// buffer comes back with it.
    fn run_op(&mut self, op: Op) -> Result<std::io::Result<()>, ComputeError> {
        let dev = &self.shared.local;
        let buf = self.buf.take().ok_or_else(|| ComputeError::WriteIo("an earlier write of the output did not complete".into()))?;
        let tag = self.shared.io.borrow_mut().submit(dev, op, buf)?;
        loop {
            // Stopped meanwhile, the write is left to the command's end, which waits for it.
            self.limits.check()?;
            if let Some(c) = self.shared.io.borrow_mut().take(tag, Duration::from_millis(100))? {
                self.buf = Some(c.buf);
                return Ok(c.result);
            }
        }
    }

    /// Writes the first `n` buffered bytes at namespace byte `off`.
    fn write_piece(&mut self, off: u64, n: usize) -> Result<(), ComputeError> {
        let place = |e: std::io::Error| ComputeError::WriteIo(format!("writing {n} bytes at namespace byte {off}: {e}"));
        // On the command's thread, which may wait for a Compare and Write on these blocks.
        let _range = self.shared.ranges.write(off..off + n as u64);
        let dev = self.shared.local.clone();
        if dev.completes_now() {
            let buf = self.buf()?;
            if let Some(r) = dev.write_now(&buf[..n], off, false, None) {
                return r.map_err(place);
            }
        }
        let len = self.buf()?.len();
        self.buf()?.set_len(n);
        let r = self.run_op(Op::Write { off, fua: false })?;
        // The bytes past `n` are still there: set_len keeps them.
        self.buf()?.set_len(len);
        r.map_err(place)
    }

    /// Writes the buffered bytes (a multiple of the block, or the padded tail) to the
    /// next extents.
    fn drain(&mut self) -> Result<(), ComputeError> {
        while !self.buf()?.is_empty() {
            let len = self.buf()?.len();
            let Some(p) = self.pieces.front().copied() else {
                return Err(ComputeError::OutputFull { capacity: self.capacity });
            };
            let n = (p.len as usize).min(len);
            self.write_piece(p.offset, n)?;
            self.dirty = true;
            let front = self.pieces.front_mut().expect("checked");
            front.offset += n as u64;
            front.len -= n as u64;
            if front.len == 0 {
                self.pieces.pop_front();
            }
            // The rest goes to the next extent from the buffer's start.
            let buf = self.buf()?;
            buf.copy_within(n..len, 0);
            buf.set_len(len - n);
        }
        Ok(())
    }

    /// Writes the tail and makes every written byte durable: a flush through the stack.
    fn finish(&mut self) -> Result<(), ComputeError> {
        let block = self.block as usize;
        let buf = self.buf()?;
        let n = buf.len();
        let padded = n.div_ceil(block) * block;
        buf.set_len(padded);
        buf[n..padded].fill(0);
        self.drain()?;
        if self.dirty {
            self.buf()?.set_len(0);
            self.run_op(Op::Flush)?.map_err(|e| ComputeError::WriteIo(format!("flushing the output: {e}")))?;
            self.dirty = false;
        }
        Ok(())
    }
}

impl Sink for NsSink<'_, '_> {
    fn write(&mut self, mut data: &[u8]) -> Result<(), ComputeError> {
        if self.written + data.len() as u64 > self.capacity {
            return Err(ComputeError::OutputFull { capacity: self.capacity });
        }
        self.limits.check()?;
        self.written += data.len() as u64;
        while !data.is_empty() {
            let chunk = self.chunk;
            let buf = self.buf()?;
            let len = buf.len();
            let n = (chunk - len).min(data.len());
            buf.set_len(len + n);
            buf[len..len + n].copy_from_slice(&data[..n]);
            data = &data[n..];
            if len + n == chunk {
                self.drain()?;
            }
        }
        Ok(())
    }

    fn written(&self) -> u64 {
        self.written
    }
}

/// Lowers the calling thread's CPU priority to nice value `nice`, if it is not lower
/// already (`compute.nice`). On Linux a thread's nice value is its own: setpriority with
/// its thread id changes no other running thread of the target (threads it starts later
/// inherit it).
fn lower_priority(nice: i32) {
    // SAFETY: gettid takes nothing; getpriority and setpriority name this thread only.
    unsafe {
        let tid = libc::gettid() as libc::id_t;
        *libc::__errno_location() = 0;
        let now = libc::getpriority(libc::PRIO_PROCESS, tid);
        if *libc::__errno_location() == 0 && now < nice && libc::setpriority(libc::PRIO_PROCESS, tid, nice) != 0 {
            tracing::debug!("compute thread: nice {nice}: {}", std::io::Error::last_os_error());
        }
    }
}

#[cfg(test)]
mod tests;
