//! Worker threads that run synchronous backend I/O off the network tasks.
//!
//! A device hands a [`Job`] (backend, operation, buffer, the channel's reply sender) to
//! the pool and the queue goes on serving other commands; the worker sends the buffer back
//! in a [`Completion`]. Buffers move, nothing is allocated per I/O.
//!
//! A job of a queue's channel also carries the channel's [`PoolHolds`]: the guards of other
//! hosts' Preempt and Abort commands waiting for it, released when the backend has finished
//! it, whether or not its connection is still there to take the completion.

use std::io;
use std::sync::Arc;

use nearstore_transport::AlignedBuf;
use tokio::sync::mpsc::UnboundedSender;

use crate::backend::Backend;
use crate::dev::{Completion, Op};
use crate::subsystem::AbortGuard;

pub struct Job {
    pub backend: Arc<dyn Backend>,
    pub op: Op,
    pub buf: AlignedBuf,
    pub token: u64,
    pub reply: UnboundedSender<Completion>,
    /// The holds of the channel that started it (None: no Preempt and Abort waits for it,
    /// as for the flushes of a shutdown).
    pub holds: Option<Arc<PoolHolds>>,
    /// The life of the controller it is for, until it has run ([`crate::subsystem::Life`]).
    pub life: Option<Arc<crate::subsystem::Life>>,
}

impl Job {
    /// Runs the job on its backend, releases what waited for that, then sends its completion.
    fn run(mut self) {
        let result = execute(&*self.backend, &self.op, &mut self.buf);
        if let Some(h) = &self.holds {
            h.finished(self.token);
        }
        // The connection may be gone; then the buffer is simply freed.
        let _ = self.reply.send(Completion { tag: self.token, result, buf: self.buf });
    }
}

/// The operations of one channel running on the pool (by tag) and what each holds (Preempt
/// and Abort guards, docs/protocol.md "Preempt and Abort"; writers' ranges): dropped when
/// the backend has finished the operation, not when its connection takes the completion.
#[derive(Default)]
pub struct PoolHolds(parking_lot::Mutex<Holds>);

#[derive(Default)]
struct Holds {
    /// Tags of the jobs submitted and not yet finished by the backend.
    running: Vec<u64>,
    held: Vec<(u64, crate::dev::Held)>,
}

impl PoolHolds {
    pub(crate) fn started(&self, tag: u64) {
        self.0.lock().running.push(tag);
    }

    /// Holds `guard` until the job `tag` has finished on the backend. Gives it back when
    /// that job is not running there (finished already, or never submitted to the pool).
    pub(crate) fn hold<G: Send + 'static>(&self, tag: u64, guard: G) -> Option<G> {
        let mut h = self.0.lock();
        if !h.running.contains(&tag) {
            return Some(guard);
        }
        h.held.push((tag, Box::new(guard)));
        None
    }

    fn finished(&self, tag: u64) {
        let mut released = Vec::new();
        {
            let mut h = self.0.lock();
            if let Some(i) = h.running.iter().position(|t| *t == tag) {
                h.running.swap_remove(i);
            }
            let mut i = 0;
            while i < h.held.len() {
                if h.held[i].0 == tag {
                    released.push(h.held.swap_remove(i).1);
                } else {
                    i += 1;
                }
            }
        }
        // Dropped outside the lock: the waiting Acquire may run at once.
        drop(released);
    }
}

/// Work a connection handed off that is not a device operation: a compute command from
/// the offload engine, or a reservation command ready; or a Preempt and Abort's request.
pub enum Done {
    Computed {
        token: u32,
        computed: Box<crate::offload::Computed>,
    },
    /// A reservation command ready to complete (its state file written, or not; the
    /// commands its Preempt and Abort waited for completed) for the command `token`.
    Persisted {
        token: u32,
        result: io::Result<()>,
    },
    /// Another host's Preempt and Abort: abort this connection's commands on `nsid`,
    /// holding `guard` with each until it completes.
    Abort {
        nsid: u32,
        guard: AbortGuard,
    },
    /// An Authentication Send handled on the blocking pool: the queue's authentication
    /// state, back with the message applied.
    Auth {
        auth: Box<crate::auth::QueueAuth>,
    },
    /// A fused command's blocking work (journal transaction, checksummed read) ended.
    Fused {
        token: u32,
        finished: Box<crate::exec::Finished>,
    },
    /// A Compare or a Compare and Write pair ended on the blocking pool.
    Compared {
        token: u32,
        compared: Box<crate::exec::Compared>,
    },
    /// A Compare and Write's range went: writes this queue parked try again.
    Unblocked,
    /// A Cross-Controller Reset's wait ended: success, or Command Interrupted when the
    /// reset controller's work outlived the wait.
    Reset {
        token: u32,
        status: nearstore_wire::Status,
    },
}

impl Done {
    pub fn computed(token: u32, c: crate::offload::Computed) -> Done {
        Done::Computed { token, computed: Box::new(c) }
    }
}

/// Runs one operation synchronously: used by the workers, and inline for cheap backends.
pub fn execute(backend: &dyn Backend, op: &Op, buf: &mut AlignedBuf) -> io::Result<()> {
    match *op {
        Op::Read { off } => backend.read_at(buf, off),
        Op::Write { off, fua } => {
            backend.write_at(buf, off)?;
            if fua {
                backend.flush_range(off, buf.len() as u64)?;
            }
            Ok(())
        }
        Op::Flush => backend.flush(),
        Op::WriteZeroes { off, len, deallocate, fua } => {
            backend.write_zeroes(off, len, deallocate)?;
            if fua {
                backend.flush_range(off, len)?;
            }
            Ok(())
        }
        Op::Deallocate => {
            for r in buf.chunks_exact(16) {
                let off = u64::from_le_bytes(r[..8].try_into().expect("8"));
                let len = u64::from_le_bytes(r[8..].try_into().expect("8"));
                if len > 0 {
                    backend.deallocate(off, len)?;
                }
            }
            Ok(())
        }
    }
}

#[derive(Clone)]
pub struct IoPool {
    /// None: jobs run as tasks of the submitting runtime ([`IoPool::on_runtime`]).
    tx: Option<crossbeam_channel::Sender<Job>>,
}

impl IoPool {
    /// A pool with no threads: every job runs as a task of the runtime of the connection
    /// that submits it, after that connection yields. Only for the deterministic
    /// simulation (crates/sim): there every backend is in memory, one thread runs
    /// everything, and an OS thread would make the order of completions depend on the
    /// OS scheduler. Never for a product target: a long job would hold the network thread.
    pub fn on_runtime() -> IoPool {
        IoPool { tx: None }
    }

    pub fn new(threads: usize) -> IoPool {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("nearstore-io-{i}"))
                .spawn(move || {
                    for job in rx {
                        job.run();
                    }
                })
                .expect("spawning an I/O worker");
        }
        IoPool { tx: Some(tx) }
    }

    pub fn submit(&self, job: Job) {
        let Some(tx) = &self.tx else {
            tokio::spawn(async move { job.run() });
            return;
        };
        if let Err(e) = tx.send(job) {
            let job = e.into_inner();
            if let Some(h) = &job.holds {
                h.finished(job.token);
            }
            let _ = job.reply.send(Completion { tag: job.token, result: Err(io::Error::other("I/O pool stopped")), buf: job.buf });
        }
    }
}
