//! The orchestrator: a request over many targets becomes a [`Plan`] of steps (compute
//! commands on one device each, and host copies between devices), run as soon as they
//! may, in parallel.
//!
//! What orders the steps is the blocks, as in the seed's COSTA: before a plan starts,
//! every step's output blocks are locked in the host's [`Locks`] under the step's name;
//! a step starts when every block it reads is unlocked (and its explicit dependencies
//! are done), and its locks go when it ends. A sort writes its run under a lock, so the
//! merge that reads the run (from its own device, or from the peer directly) waits for
//! it without being told. Locks are addressed globally (device tag and byte range) and
//! shared by every plan of the process; a lock that stays held past the plan's lock
//! timeout fails the waiting step with the holder's name.
//!
//! Failure is clean: the first step that fails stops the plan; steps still waiting never
//! start; steps already executing on a target are waited for (bounded by the command
//! timeout), so that nothing still writes when the caller frees what it allocated; then
//! the plan's locks are released. The error names the step and its device; no step is
//! reported done that did not complete.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nearstore_compute::Outcome;
use nearstore_initiator::{Controller, PieceReader, PieceWriter};
use nearstore_wire::compute::{global, Descriptor, Extent, Object};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU8, Ordering::SeqCst};
use tokio::sync::watch;

/// A step's state: waiting for its dependencies and blocks, executing, or stopped
/// before it started.
const WAITING: u8 = 0;
const EXECUTING: u8 = 1;
const STOPPED: u8 = 2;

use crate::device::Endpoint;
use crate::Identity;

/// A byte range of a device's namespace, by its tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    pub tag: u16,
    pub start: u64,
    pub end: u64,
}

impl Range {
    fn overlaps(&self, o: &Range) -> bool {
        self.tag == o.tag && self.start < o.end && o.start < self.end
    }
}

impl std::fmt::Display for Range {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "device {} bytes {}..{}", self.tag, self.start, self.end)
    }
}

/// The byte ranges of an object's data extents on device `tag`.
pub fn ranges_of(tag: u16, o: &Object) -> Vec<Range> {
    o.extents
        .iter()
        .filter(|e| !e.is_zeros())
        .map(|e| {
            let start = global::offset(e.offset);
            Range { tag: if e.is_remote() { e.tag() } else { tag }, start, end: start + e.len }
        })
        .collect()
}

/// Block locks by global address, held by named owners.
pub struct Locks {
    held: Mutex<Vec<(Range, String)>>,
    /// Bumped on every change, for waiters.
    changed: watch::Sender<u64>,
}

impl Default for Locks {
    fn default() -> Self {
        Locks { held: Mutex::new(Vec::new()), changed: watch::channel(0).0 }
    }
}

impl Locks {
    fn signal(&self) {
        self.changed.send_modify(|g| *g += 1);
    }

    /// The first of `ranges` that someone other than `me` holds, and who.
    pub fn holder(&self, ranges: &[Range], me: &str) -> Option<(Range, String)> {
        let held = self.held.lock();
        ranges.iter().find_map(|r| held.iter().find(|(h, o)| o != me && h.overlaps(r)).map(|(h, o)| (*h, o.clone())))
    }

    /// Locks `ranges` for `owner` at once (they may overlap locks of the same owner).
    pub fn lock(&self, ranges: &[Range], owner: &str) {
        self.held.lock().extend(ranges.iter().map(|r| (*r, owner.to_string())));
        self.signal();
    }

    /// Releases every lock `owner` holds.
    pub fn unlock(&self, owner: &str) {
        self.held.lock().retain(|(_, o)| o != owner);
        self.signal();
    }

    /// Waits until no one but `me` holds any of `ranges`; Err names a lock still held
    /// after `timeout`.
    pub async fn wait_free(&self, ranges: &[Range], me: &str, timeout: Duration) -> Result<(), (Range, String)> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut rx = self.changed.subscribe();
        loop {
            rx.borrow_and_update();
            let Some(h) = self.holder(ranges, me) else { return Ok(()) };
            if tokio::time::timeout_at(deadline, rx.changed()).await.is_err() {
                return Err(h);
            }
        }
    }

    /// Every lock held, for inspection.
    pub fn held(&self) -> Vec<(Range, String)> {
        self.held.lock().clone()
    }
}

/// A step's work.
pub enum Action {
    /// A compute command on a device; input extents on other devices carry their tags.
    Exec { desc: Descriptor },
    /// A host-mediated copy: read `from` on device `from_ep` over NVMe/TCP, skip `skip`
    /// bytes, and write the rest into `to` on the step's device.
    Copy { from_ep: Endpoint, from: Object, skip: u64, to: Object },
}

pub struct Step {
    /// Unique in the plan, for messages and as the lock owner: "sort on t1".
    pub name: String,
    /// The device it runs on (for a copy: the one it writes).
    pub device: Endpoint,
    pub tag: u16,
    pub action: Action,
    /// Steps (indices) that must be done first, besides what the locks order.
    pub after: Vec<usize>,
    /// Blocks it reads: it waits until no other step holds them.
    pub reads: Vec<Range>,
    /// Blocks it writes: locked from the start of the plan until it ends.
    pub writes: Vec<Range>,
}

/// How a step went.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StepReport {
    pub name: String,
    /// Seconds from the plan's start to the step's start and end.
    pub started: f64,
    pub ended: f64,
    /// What the target returned (Exec), or the bytes copied.
    pub outcome: Option<Outcome>,
    pub bytes: u64,
}

/// A plan failed: which step, on which device, and why.
#[derive(Debug, thiserror::Error)]
#[error("step '{step}' on {device}: {message}")]
pub struct StepError {
    pub step: String,
    pub device: String,
    pub message: String,
}

/// How plans run.
#[derive(Clone, Debug)]
pub struct Options {
    /// How long a step waits for locked blocks.
    pub lock_timeout: Duration,
    /// How long one command may take.
    pub command_timeout: Duration,
    /// Who the steps' connections are to the targets: the requesting host.
    pub identity: Identity,
}

impl Default for Options {
    fn default() -> Self {
        Options { lock_timeout: Duration::from_secs(600), command_timeout: Duration::from_secs(3600), identity: Identity::default() }
    }
}

pub fn device_name(ep: &Endpoint, tag: u16) -> String {
    format!("device {tag} ({} {} nsid {})", ep.address, ep.nqn, ep.nsid)
}

/// Runs the steps; `progress` hears of each step that starts and ends. Returns the
/// reports in step order, or the first failure.
pub async fn run(
    steps: Vec<Step>,
    locks: Arc<Locks>,
    opts: &Options,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<Vec<StepReport>, StepError> {
    static PLANS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let plan_id = format!("plan-{}", PLANS.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let owner = |name: &str| format!("{plan_id}/{name}");
    let mut names: HashMap<String, usize> = HashMap::new();
    for (i, s) in steps.iter().enumerate() {
        if names.insert(s.name.clone(), i).is_some() {
            return Err(StepError {
                step: s.name.clone(),
                device: device_name(&s.device, s.tag),
                message: "two steps have this name".into(),
            });
        }
        if let Some(&d) = s.after.iter().find(|&&d| d >= i) {
            return Err(StepError {
                step: s.name.clone(),
                device: device_name(&s.device, s.tag),
                message: format!("depends on step {d}, which does not come before it"),
            });
        }
    }
    for s in &steps {
        locks.lock(&s.writes, &owner(&s.name));
    }
    let start = Instant::now();
    let (done_tx, done_rx) = watch::channel(vec![false; steps.len()]);
    let done_tx = Arc::new(done_tx);
    let mut set = tokio::task::JoinSet::new();
    let n = steps.len();
    // Each step waits, then executes; a failing plan stops the waiting ones only.
    let states: Arc<Vec<AtomicU8>> = Arc::new((0..n).map(|_| AtomicU8::new(WAITING)).collect());
    let mut handles = Vec::with_capacity(n);
    // Said before any step runs: whoever listens sees the plan before its first lock
    // is waited for.
    progress(&format!("{n} steps planned"));
    for (i, s) in steps.into_iter().enumerate() {
        let (locks, opts, done_tx, mut done_rx) = (locks.clone(), opts.clone(), done_tx.clone(), done_rx.clone());
        let states = states.clone();
        let me = owner(&s.name);
        handles.push(set.spawn(async move {
            let fail = |m: String| StepError { step: s.name.clone(), device: device_name(&s.device, s.tag), message: m };
            // Explicit dependencies, then the blocks it reads.
            while !s.after.iter().all(|&d| done_rx.borrow_and_update()[d]) {
                if done_rx.changed().await.is_err() {
                    return (i, Err(fail("the plan stopped".into())));
                }
            }
            if let Err((r, holder)) = locks.wait_free(&s.reads, &me, opts.lock_timeout).await {
                let holder = holder.rsplit('/').next().unwrap_or(&holder).to_string();
                return (i, Err(fail(format!("{r} stayed locked by '{holder}' for {} s (the lock timeout)", opts.lock_timeout.as_secs()))));
            }
            if states[i].compare_exchange(WAITING, EXECUTING, SeqCst, SeqCst).is_err() {
                return (i, Err(fail("the plan stopped".into())));
            }
            let started = start.elapsed().as_secs_f64();
            let r = execute(&s, &opts).await.map_err(fail);
            locks.unlock(&me);
            let r = r.map(|(outcome, bytes)| StepReport {
                name: s.name.clone(),
                started,
                ended: start.elapsed().as_secs_f64(),
                outcome,
                bytes,
            });
            if r.is_ok() {
                done_tx.send_modify(|d| d[i] = true);
            }
            (i, r)
        }));
    }
    let mut reports: Vec<Option<StepReport>> = (0..n).map(|_| None).collect();
    let mut failure = None;
    while let Some(j) = set.join_next().await {
        match j {
            Ok((i, Ok(r))) => {
                progress(&format!("[{}/{n}] {} done in {:.2} s", reports.iter().flatten().count() + 1, r.name, r.ended - r.started));
                reports[i] = Some(r);
            }
            Ok((_, Err(e))) => {
                failure = Some(e);
                break;
            }
            Err(e) => {
                failure = Some(StepError { step: "?".into(), device: "?".into(), message: format!("a step panicked: {e}") });
                break;
            }
        }
    }
    if failure.is_some() {
        // Steps still waiting never start. Steps executing are waited for, not dropped: a
        // target notices a closed connection only at its command's next chunk, and until
        // then it could write into blocks the caller is about to free.
        for (i, h) in handles.iter().enumerate() {
            if states[i].compare_exchange(WAITING, STOPPED, SeqCst, SeqCst).is_ok() {
                h.abort();
            }
        }
        while set.join_next().await.is_some() {}
    }
    for name in names.keys() {
        locks.unlock(&owner(name));
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(reports.into_iter().map(|r| r.expect("every step reported")).collect()),
    }
}

async fn connect(ep: &Endpoint, who: &Identity) -> Result<(Controller, nearstore_initiator::IoQueue, u64), String> {
    let c = Controller::connect(who.connect_options(ep)?).await.map_err(|e| format!("connecting: {e}"))?;
    let block = c.identify_namespace(ep.nsid).await.map_err(|e| format!("identifying the namespace: {e}"))?.block_size() as u64;
    let q = c.io_queue(1).await.map_err(|e| format!("opening a queue: {e}"))?;
    Ok((c, q, block))
}

async fn execute(s: &Step, opts: &Options) -> Result<(Option<Outcome>, u64), String> {
    match &s.action {
        Action::Exec { desc } => {
            let (_c, mut q, _) = connect(&s.device, &opts.identity).await?;
            let json = q.compute(s.device.nsid, &desc.encode(), opts.command_timeout).await.map_err(|e| e.to_string())?;
            let mut outs: Vec<Outcome> = serde_json::from_slice(&json).map_err(|e| format!("the target's result: {e}"))?;
            if outs.is_empty() {
                return Err("the target returned no outcome".into());
            }
            let bytes = desc.inputs.iter().map(|o| o.len).sum();
            Ok((Some(outs.remove(0)), bytes))
        }
        Action::Copy { from_ep, from, skip, to } => {
            let ((_fc, mut fq, fblock), (_tc, mut tq, tblock)) =
                tokio::try_join!(connect(from_ep, &opts.identity), connect(&s.device, &opts.identity))?;
            let mut r = PieceReader::new(fq.queue(), from_ep.nsid, fblock, from.pieces());
            let mut w = PieceWriter::new(
                tq.queue(),
                s.device.nsid,
                tblock,
                to.extents.iter().map(|e| Extent::data(global::offset(e.offset), e.len)),
            );
            let mut at = 0u64;
            while let Some(c) = r.next().await.map_err(|e| format!("reading from {}: {e}", from_ep.address))? {
                let n = c.len() as u64;
                let from_here = skip.saturating_sub(at).min(n) as usize;
                at += n;
                w.write(&c[from_here..]).await.map_err(|e| format!("writing: {e}"))?;
            }
            let written = w.finish().await.map_err(|e| format!("writing: {e}"))?;
            Ok((None, written))
        }
    }
}

/// The temporary files a request allocated, removed when it ends (its outputs are
/// pending files of their own, put in place only on success).
#[derive(Default)]
pub struct Allocations {
    pub temporary: Vec<PathBuf>,
}

impl Allocations {
    /// Removes the temporaries.
    pub fn release(&mut self) {
        for p in std::mem::take(&mut self.temporary) {
            let _ = std::fs::remove_file(&p);
        }
    }
}
