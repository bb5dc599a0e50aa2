//! A target's mover: the copier's side of an extent's move (docs/control-plane.md, "Moving
//! an extent"). It blocks the extent where this target serves its volume (the cache entry
//! goes, new I/O waits), drains the I/O in flight, acknowledges, copies at most `max_bps`,
//! flushes the destination, publishes, and only then lets the waiting I/O translate again.
//!
//! The control plane is behind [`MoveControl`], so the same code runs in the target (over
//! the HTTP API, `nearstore target --control`) and in the deterministic simulation
//! (crates/sim, `moves.rs`), where [`MoveBug`] breaks the protocol on purpose to show that
//! its checker sees it.

use std::collections::{HashMap, HashSet};
use std::io;
use std::sync::Arc;
use std::time::Duration;

use nearstore_transport::AlignedBuf;
use parking_lot::Mutex;

use super::{BoxFuture, Devices, Hold, Location, Volume};
use crate::config::IoEngine;
use crate::dev::{BlockDevice, Channel, Op};
use crate::io_pool::IoPool;
use crate::limits::{MOVE_COPY_CHUNK_BYTES, MOVE_DRAIN_MS};

/// One move as its copier sees it: its id, the extent, the epoch the move began at, its
/// source and its reserved destination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoveOrder {
    /// The control plane's id of this move, which every word of the copier names: a late
    /// word of it never reaches another move of the extent.
    pub id: u64,
    pub volume: String,
    pub index: u64,
    pub epoch: u64,
    /// The pools' names, as errors name them (`NAME@TARGET`).
    pub from_name: String,
    pub to_name: String,
    pub from: Location,
    pub to: Location,
    pub extent_size: u64,
    /// Bytes per second at most (0: no cap).
    pub max_bps: u64,
    /// Given up by the control plane while its copier was silent: the copier confirms.
    pub aborted: bool,
}

/// The copier's words to the control plane.
pub trait MoveControl: Send + Sync {
    /// The moves this target copies once the control plane's version passed `since` (a
    /// long poll, held a while when nothing changed): the new version and the moves.
    fn moves(&self, since: u64) -> BoxFuture<'_, io::Result<(u64, Vec<MoveOrder>)>>;
    /// `ack` (nothing reaches the extent any more) or progress: bytes copied so far.
    fn report<'a>(&'a self, m: &'a MoveOrder, ack: bool, copied: u64) -> BoxFuture<'a, io::Result<()>>;
    /// The extent at its destination, with the next epoch.
    fn publish<'a>(&'a self, m: &'a MoveOrder, copied: u64) -> BoxFuture<'a, io::Result<()>>;
    /// Given up (or confirmed stopped): the destination is free again. An error of kind
    /// `NotFound`: no such move is under way (it ended).
    fn abort<'a>(&'a self, m: &'a MoveOrder, reason: &'a str) -> BoxFuture<'a, io::Result<()>>;
}

/// A deliberately broken protocol (the simulation shows its checker catches each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoveBug {
    /// The extent is not blocked in the volume: its cache entry stays, I/O goes on.
    NoInvalidation,
    /// Blocked, but the copy starts without waiting for the I/O in flight.
    NoDrain,
    /// The I/O waiting is let go once the copy is done, before the publication.
    UnblockBeforePublish,
}

/// A move's blocks of its extent on the volumes served.
type Holds = Vec<Arc<Hold>>;

/// The volumes this target serves and the moves it runs, shared by its exports and its
/// mover: a move blocks its extent on the volume served (and on one served while it runs).
#[derive(Default)]
pub struct Served {
    volumes: Mutex<HashMap<String, Arc<Volume>>>,
    /// Moves under way by (volume, index): the holds of their extent on the volumes served.
    running: Mutex<HashMap<(String, u64), Holds>>,
}

impl Served {
    /// Serves `vol` as `name`, blocking the extents this target is moving.
    pub fn serve(&self, name: &str, vol: Arc<Volume>) {
        let mut running = self.running.lock();
        for ((v, index), holds) in running.iter_mut() {
            if v == name {
                holds.extend(vol.block(*index).map(Arc::new));
            }
        }
        self.volumes.lock().insert(name.to_string(), vol);
    }

    pub fn unserve(&self, name: &str) {
        let _running = self.running.lock();
        self.volumes.lock().remove(name);
    }

    /// A move of extent `index` of `name` begins: blocked on the volume if it is served
    /// here; its holds, to drain. None: that extent is being moved here already.
    fn start(&self, name: &str, index: u64, block: bool) -> Option<Vec<Arc<Hold>>> {
        let mut running = self.running.lock();
        let key = (name.to_string(), index);
        if running.contains_key(&key) {
            return None;
        }
        let holds: Vec<Arc<Hold>> = match self.volumes.lock().get(name) {
            Some(v) if block => vec![Arc::new(v.block(index)?)],
            _ => Vec::new(),
        };
        running.insert(key, holds.clone());
        Some(holds)
    }

    /// The move ended (published or given up): the extent's operations go on, translated
    /// again.
    fn finish(&self, name: &str, index: u64) {
        self.running.lock().remove(&(name.to_string(), index));
    }
}

/// How a mover paces itself.
#[derive(Clone, Debug)]
pub struct MoverConfig {
    /// The longest a copier stays silent while it copies (nearstore-control's MOVE_REPORT_MS).
    pub report_every: Duration,
    /// The longest wait between two failed polls of the control plane.
    pub retry_max: Duration,
    pub bug: Option<MoveBug>,
}

/// A target's mover: runs the moves it copies.
pub struct Mover {
    ctl: Arc<dyn MoveControl>,
    devices: Arc<dyn Devices>,
    served: Arc<Served>,
    pool: IoPool,
    cfg: MoverConfig,
    /// Moves running here, by id.
    active: Mutex<HashSet<u64>>,
    /// The destinations this copier wrote, by move id, until the move ended here: a failed
    /// move's is quiesced before its abort is confirmed (the control plane frees it then).
    written: Mutex<HashMap<u64, Arc<dyn BlockDevice>>>,
}

fn context(what: String) -> impl FnOnce(io::Error) -> io::Error {
    move |e| io::Error::new(e.kind(), format!("{what}: {e}"))
}

impl Mover {
    pub fn new(ctl: Arc<dyn MoveControl>, devices: Arc<dyn Devices>, served: Arc<Served>, pool: IoPool, cfg: MoverConfig) -> Mover {
        Mover { ctl, devices, served, pool, cfg, active: Mutex::default(), written: Mutex::default() }
    }

    /// Runs forever: long-polls this target's moves and starts each new one as a task.
    pub async fn run(self: Arc<Self>) {
        let retry_min = Duration::from_millis(100);
        let (mut since, mut wait) = (0, retry_min);
        loop {
            let list = match self.ctl.moves(since).await {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot list this target's moves; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(self.cfg.retry_max);
                    continue;
                }
            };
            (since, wait) = (list.0, retry_min);
            for m in list.1 {
                let key = m.id;
                if self.active.lock().contains(&key) {
                    continue;
                }
                // Failed here with copy writes to its destination not quiesced, or given up
                // while this target was silent (it runs nothing of it): its abort is
                // confirmed, and the destination freed, once nothing this copier wrote
                // there can still land; else at a later listing. Never copied again.
                let unconfirmed = self.written.lock().contains_key(&key);
                self.active.lock().insert(key);
                let me = self.clone();
                if m.aborted || unconfirmed {
                    tokio::spawn(async move {
                        me.confirm_abort(&m).await;
                        me.active.lock().remove(&key);
                    });
                    continue;
                }
                tokio::spawn(async move {
                    me.run_move(&m).await;
                    me.active.lock().remove(&key);
                });
            }
        }
    }

    /// One move, from its block to its end: published, or aborted with the extent where it
    /// was.
    pub async fn run_move(&self, m: &MoveOrder) {
        let block = self.cfg.bug != Some(MoveBug::NoInvalidation);
        let Some(holds) = self.served.start(&m.volume, m.index, block) else { return };
        let mut publishing = false;
        let r = self.copy(m, holds, &mut publishing).await;
        match &r {
            Ok(()) => {
                self.written.lock().remove(&m.id);
                // Only now may the extent's operations go on: they translate again, to the
                // new place.
                self.served.finish(&m.volume, m.index);
            }
            // Failed before its publication was asked for: no word of it can publish it any
            // more, so the extent's operations go on at once, at the old place. A copy
            // write given up may still land in the destination, which the control plane
            // frees at the abort: the abort waits until none can. Not quiesced, the move is
            // not confirmed, nor copied again: its destination stays reserved until a later
            // listing confirms it (`confirm_abort`), or this target registers again.
            Err(e) if !publishing => {
                self.served.finish(&m.volume, m.index);
                match self.destination_quiesced(m).await {
                    Ok(()) => self.abort_known(m, &e.to_string()).await,
                    Err(q) => {
                        tracing::warn!(volume = %m.volume, extent = m.index, error = %q, "the destination is not quiesced; the abort is confirmed later")
                    }
                }
            }
            // A publication asked for may still be taken: the extent stays blocked until the
            // abort is answered (its copy was whole and flushed, so nothing of it is in doubt).
            Err(e) => {
                if let Err(q) = self.destination_quiesced(m).await {
                    tracing::warn!(volume = %m.volume, extent = m.index, error = %q, "the destination is not quiesced");
                }
                self.abort_known(m, &e.to_string()).await;
                self.served.finish(&m.volume, m.index);
            }
        }
        match r {
            Ok(()) => tracing::info!(volume = %m.volume, extent = m.index, to = %m.to_name, "extent moved"),
            Err(e) => tracing::warn!(volume = %m.volume, extent = m.index, error = %e, "move aborted"),
        }
    }

    /// Waits, at most the drain's limit, until no copy write of this copier to `m`'s
    /// destination can still land there; then forgets that it wrote there.
    async fn destination_quiesced(&self, m: &MoveOrder) -> io::Result<()> {
        // Not written here (nothing copied yet, or by an earlier life of this target).
        let Some(dst) = self.written.lock().get(&m.id).cloned() else { return Ok(()) };
        if let Some(q) = dst.quiesce(m.to.offset, m.extent_size) {
            tokio::time::timeout(Duration::from_millis(MOVE_DRAIN_MS), q).await.map_err(|_| {
                io::Error::new(io::ErrorKind::TimedOut, format!("copy writes to {} not quiesced within {MOVE_DRAIN_MS} ms", m.to_name))
            })??;
        }
        self.written.lock().remove(&m.id);
        Ok(())
    }

    /// Confirms the abort of a move this copier does not run: given up by the control plane
    /// while this target was silent, or failed here with its destination not quiesced.
    async fn confirm_abort(&self, m: &MoveOrder) {
        // Not written by this process: perhaps by an earlier one of this target, which the
        // control plane aborted when this one registered. Opening the destination fences
        // that process at the destination's target (`cluster::fenced`) before anything is
        // confirmed: its copy writes still on their way there land nowhere after.
        if !self.written.lock().contains_key(&m.id) {
            if let Err(e) = self.devices.open(&m.to).await {
                tracing::warn!(volume = %m.volume, extent = m.index, error = %e, "cannot reach an aborted move's destination to fence it; not confirmed yet");
                return;
            }
        }
        if let Err(e) = self.destination_quiesced(m).await {
            tracing::warn!(volume = %m.volume, extent = m.index, error = %e, "a failed move's destination is not quiesced; not confirmed yet");
            return;
        }
        let why = if m.aborted { "its copier stopped" } else { "its copy failed" };
        if let Err(e) = self.ctl.abort(m, why).await {
            tracing::warn!(volume = %m.volume, extent = m.index, error = %e, "cannot confirm an aborted move");
        }
    }

    /// Aborts `m` until the control plane's answer says it ended: the abort taken, or no
    /// such move (it was published or aborted already), asking again every `report_every`.
    /// Until then a word of this move still held in the network (its publish, its ack) may
    /// yet be taken, so the extent stays blocked; after it, none is (a move's words name
    /// its id, and an ended move is never under way again).
    async fn abort_known(&self, m: &MoveOrder, reason: &str) {
        loop {
            match self.ctl.abort(m, reason).await {
                Ok(()) => return,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return,
                Err(e) => {
                    tracing::warn!(volume = %m.volume, extent = m.index, error = %e, "abort not confirmed; asking again");
                    tokio::time::sleep(self.cfg.report_every).await;
                }
            }
        }
    }

    /// Drains, acknowledges, copies, flushes and publishes one move; `holds` are the
    /// extent's blocks on the volumes served here.
    /// `publishing` is set once the publication is asked for.
    async fn copy(&self, m: &MoveOrder, holds: Vec<Arc<Hold>>, publishing: &mut bool) -> io::Result<()> {
        let src = self.devices.open(&m.from).await.map_err(context(format!("opening the source pool {}", m.from_name)))?;
        if self.cfg.bug != Some(MoveBug::NoDrain) {
            let deadline = tokio::time::Instant::now() + Duration::from_millis(MOVE_DRAIN_MS);
            for h in &holds {
                h.drained(Duration::from_millis(MOVE_DRAIN_MS)).await.map_err(context("draining the extent's operations".into()))?;
            }
            // A write to the source given up before its peer answered (timed out, its
            // connection lost, cancelled) may still land there: its controller is reset at
            // the peer first, so that the copy reads everything that will ever land.
            if let Some(q) = src.quiesce(m.from.offset, m.extent_size) {
                match tokio::time::timeout_at(deadline, q).await {
                    Ok(r) => r.map_err(context(format!("quiescing writes given up on {}", m.from_name)))?,
                    Err(_) => {
                        let e = io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("writes given up on {} not quiesced within {MOVE_DRAIN_MS} ms", m.from_name),
                        );
                        return Err(context("draining the extent's operations".into())(e));
                    }
                }
            }
        }
        self.ctl.report(m, true, 0).await.map_err(context("acknowledging".into()))?;
        let dst = self.devices.open(&m.to).await.map_err(context(format!("opening the destination pool {}", m.to_name)))?;
        self.written.lock().insert(m.id, dst.clone());
        let mut ch = Channel::new(IoEngine::Threads, self.pool.clone());
        let mut buf = AlignedBuf::new(MOVE_COPY_CHUNK_BYTES);
        let started = tokio::time::Instant::now();
        let mut reported = started;
        let mut copied = 0u64;
        while copied < m.extent_size {
            let n = (m.extent_size - copied).min(MOVE_COPY_CHUNK_BYTES as u64) as usize;
            buf.set_len(n);
            let (from, to) = (m.from.offset + copied, m.to.offset + copied);
            let c = ch.run(&*src, Op::Read { off: from }, buf).await;
            c.result.map_err(context(format!("reading {} at {from}", m.from_name)))?;
            let c = ch.run(&*dst, Op::Write { off: to, fua: false }, c.buf).await;
            c.result.map_err(context(format!("writing {} at {to}", m.to_name)))?;
            buf = c.buf;
            copied += n as u64;
            if m.max_bps > 0 {
                // The bandwidth cap: no byte before its time.
                tokio::time::sleep_until(started + Duration::from_secs_f64(copied as f64 / m.max_bps as f64)).await;
            }
            if reported.elapsed() >= self.cfg.report_every {
                self.ctl.report(m, false, copied).await.map_err(context("reporting progress".into()))?;
                reported = tokio::time::Instant::now();
            }
        }
        let c = ch.run(&*dst, Op::Flush, AlignedBuf::new(0)).await;
        c.result.map_err(context(format!("flushing {}", m.to_name)))?;
        self.ctl.report(m, false, copied).await.map_err(context("reporting progress".into()))?;
        if self.cfg.bug == Some(MoveBug::UnblockBeforePublish) {
            drop(holds);
            self.served.finish(&m.volume, m.index);
        }
        *publishing = true;
        self.ctl.publish(m, copied).await.map_err(context("publishing".into()))
    }
}
