//! The simulated host: queues opened over simulated links with our initiator's
//! [`QueuePair`], and a worker per I/O queue issuing a seeded workload (reads, writes,
//! some FUA, flushes, write zeroes, deallocate) and holding every completion against the
//! [`Model`].

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use nearstore_initiator::{Data, Error, QueuePair};
use nearstore_wire::opcode::io;
use nearstore_wire::{Cqe, Sqe, Status};
use parking_lot::Mutex;
use rand::RngExt;
use rand_xorshift::XorShiftRng;
use tokio_util::sync::CancellationToken;

use crate::disk::SimDisk;
use crate::model::{block_bytes, Kind, Model};
use crate::net::{Link, SimStream};
use crate::trace::Trace;

/// How long a queue may wait for a completion while its connection moves no byte before
/// the completion counts as lost: far above the longest stall the network simulates. (A
/// slow connection may take longer than this for a command, moving bytes all along.)
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// Bytes one command moves at most: 4 KiB of 512-byte blocks, and with 4 KiB blocks
/// 128 KiB, so that a write's data takes two H2CData PDUs (MAXH2CDATA is 64 KiB).
pub fn command_blocks_max(block_size: usize) -> u64 {
    if block_size >= 4096 {
        32
    } else {
        8
    }
}

/// The namespace the simulation drives.
pub const NSID: u32 = 1;

pub type Queue = QueuePair<SimStream>;

/// Runs one command to its completion (setup commands: Connect, Property Get and Set).
pub async fn command(q: &mut Queue, sqe: Sqe, data: Data<'_>, what: &str) -> Result<Cqe, String> {
    let cid = q.submit(sqe, data, u64::MAX).map_err(|e| format!("{what}: {e}"))?;
    let cqe = tokio::time::timeout(COMMAND_TIMEOUT, q.wait(cid, |_, _, _| {}))
        .await
        .map_err(|_| format!("{what}: no completion within {COMMAND_TIMEOUT:?}"))?
        .map_err(|e| format!("{what}: {e}"))?;
    if !cqe.status.is_success() {
        return Err(format!("{what}: {}", cqe.status));
    }
    Ok(cqe)
}

/// What a worker does: a workload of `ops` commands, or reads of every block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    Workload {
        ops: u32,
    },
    /// Reads of every block; `after_crash`: held against what may survive a crash.
    ReadAll {
        after_crash: bool,
    },
}

pub struct Worker {
    pub queue: u32,
    pub q: Queue,
    pub link: Arc<Link>,
    pub depth: usize,
    pub work: Work,
    pub rng: XorShiftRng,
    /// The controller's volatile write cache is off: every write is durable when it
    /// completes, FUA or not.
    pub write_through: bool,
    pub model: Arc<Mutex<Model>>,
    pub disk: Arc<SimDisk>,
    pub block_size: usize,
    pub cancel: CancellationToken,
    /// Stop issuing, let what is outstanding complete (before a clean shutdown).
    pub drain: CancellationToken,
    pub trace: Trace,
}

/// How a worker ended.
#[derive(Debug)]
pub enum Ended {
    Done,
    /// Its connection failed (a fault, or a bug if no fault was injected).
    Died(String),
    /// The session stopped it.
    Stopped,
    /// The checker found a bug.
    Failed(String),
}

impl Worker {
    pub async fn run(mut self) -> Ended {
        let mut inflight = BTreeSet::new();
        let mut left = match self.work {
            Work::Workload { ops } => ops as u64,
            Work::ReadAll { .. } => self.model.lock().blocks().div_ceil(command_blocks_max(self.block_size)),
        };
        let mut next_lba = 0;
        let mut moved = self.link.moved();
        loop {
            while left > 0 && inflight.len() < self.depth && !self.drain.is_cancelled() {
                left -= 1;
                let (kind, slba, nlb) = match self.work {
                    Work::Workload { .. } => self.pick(),
                    Work::ReadAll { after_crash } => {
                        let blocks = self.model.lock().blocks();
                        let slba = next_lba;
                        let nlb = command_blocks_max(self.block_size).min(blocks - slba) as u32;
                        next_lba += nlb as u64;
                        (if after_crash { Kind::Verify } else { Kind::Read }, slba, nlb)
                    }
                };
                if let Err(e) = self.submit(kind, slba, nlb, &mut inflight) {
                    return Ended::Failed(e);
                }
            }
            if inflight.is_empty() {
                return Ended::Done;
            }
            let mut got: Vec<(u64, Status, Vec<u8>)> = Vec::new();
            let polled = tokio::select! {
                biased;
                _ = self.cancel.cancelled() => None,
                r = tokio::time::timeout(COMMAND_TIMEOUT, self.q.poll(|tag, cqe, data| got.push((tag, cqe.status, data.to_vec())))) => Some(r),
            };
            for (id, status, data) in got {
                inflight.remove(&id);
                self.trace.event(format_args!("q{} op {id} completed: {status}", self.queue));
                let checked = self.model.lock().complete(id, status, &data, &self.disk);
                if let Err(e) = checked {
                    return Ended::Failed(e);
                }
            }
            let end = match polled {
                None => Ended::Stopped,
                Some(Err(_)) if self.link.moved() != moved => {
                    moved = self.link.moved();
                    continue;
                }
                Some(Err(_)) => {
                    return Ended::Failed(format!(
                    "lost completion: queue {} has ops {inflight:?} outstanding, no completion and no byte moved for {COMMAND_TIMEOUT:?}",
                    self.queue
                ))
                }
                Some(Ok(Ok(_))) => continue,
                Some(Ok(Err(e @ (Error::Protocol(_) | Error::Terminated { .. })))) => {
                    return Ended::Failed(format!("queue {}: the target broke the protocol: {e}", self.queue))
                }
                Some(Ok(Err(e))) => Ended::Died(format!("queue {}: {e}", self.queue)),
            };
            let mut m = self.model.lock();
            for id in inflight {
                m.lost(id);
            }
            return end;
        }
    }

    /// A seeded command: its kind and block range.
    fn pick(&mut self) -> (Kind, u64, u32) {
        let blocks = self.model.lock().blocks();
        let most = command_blocks_max(self.block_size);
        let slba = self.rng.random_range(0..blocks);
        let nlb = self.rng.random_range(1..=most.min(blocks - slba)) as u32;
        let kind = match self.rng.random_range(0..100) {
            0..40 => Kind::Read,
            40..72 => Kind::Write { fua: self.rng.random_bool(0.25) },
            72..80 => Kind::Flush,
            80..90 => Kind::Zeroes { fua: self.rng.random_bool(0.2) },
            _ => {
                let mut ranges = vec![(slba, nlb)];
                if self.rng.random_bool(0.5) {
                    let s = self.rng.random_range(0..blocks);
                    ranges.push((s, self.rng.random_range(1..=most.min(blocks - s)) as u32));
                }
                Kind::Deallocate(ranges)
            }
        };
        (kind, slba, nlb)
    }

    fn submit(&mut self, kind: Kind, slba: u64, nlb: u32, inflight: &mut BTreeSet<u64>) -> Result<(), String> {
        let bs = self.block_size;
        // What the model expects: without a write cache every write is as if FUA.
        let fua = match kind {
            Kind::Write { fua } | Kind::Zeroes { fua } => Some(fua),
            _ => None,
        };
        let kind = match kind {
            Kind::Write { fua } => Kind::Write { fua: fua || self.write_through },
            Kind::Zeroes { fua } => Kind::Zeroes { fua: fua || self.write_through },
            k => k,
        };
        let op = self.model.lock().issue(kind, slba, nlb, self.queue);
        self.trace.event(format_args!("q{} op {} issued: {:?} {slba}+{nlb}", self.queue, op.id, op.kind));
        let mut out = Vec::new();
        let (sqe, data) = match &op.kind {
            Kind::Read | Kind::Verify => (Sqe::rw(io::READ, NSID, slba, nlb, false), Data::In(nlb as usize * bs)),
            Kind::Write { .. } => {
                for lba in slba..slba + nlb as u64 {
                    out.extend_from_slice(&block_bytes(op.id, lba, bs));
                }
                (Sqe::rw(io::WRITE, NSID, slba, nlb, fua == Some(true)), Data::Out(&out))
            }
            Kind::Zeroes { .. } => {
                let mut s = Sqe::rw(io::WRITE_ZEROES, NSID, slba, nlb, fua == Some(true));
                // Deallocate (DEAC) sometimes: the blocks read as zeros either way.
                if op.id.is_multiple_of(2) {
                    s.set_cdw(12, s.cdw(12) | 1 << 25);
                }
                (s, Data::None)
            }
            Kind::Deallocate(ranges) => {
                for (s, n) in ranges {
                    out.extend_from_slice(&0u32.to_le_bytes());
                    out.extend_from_slice(&n.to_le_bytes());
                    out.extend_from_slice(&s.to_le_bytes());
                }
                let mut s = Sqe::new(io::DATASET_MANAGEMENT, 0);
                s.set_nsid(NSID);
                s.set_cdw(10, ranges.len() as u32 - 1);
                // Attribute Deallocate.
                s.set_cdw(11, 1 << 2);
                (s, Data::Out(&out))
            }
            Kind::Flush => {
                let mut s = Sqe::new(io::FLUSH, 0);
                s.set_nsid(NSID);
                (s, Data::None)
            }
        };
        self.q.submit(sqe, data, op.id).map_err(|e| format!("queue {}: submitting op {}: {e}", self.queue, op.id))?;
        inflight.insert(op.id);
        Ok(())
    }
}
