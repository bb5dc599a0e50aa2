//! An in-process transport (Linux nvmet's loop.c): commands and their data pass as values,
//! with no socket and no PDU. It is the second implementation of [`Transport`], used by
//! tests to run the target's command handling without the network; the execution core and
//! the I/O code are the ones NVMe/TCP drives.
//!
//! One [`Loopback`] is one queue. [`Loopback::run`] hands a command to the core and drives
//! it to its completion: the data the core fetches comes from the command's [`Data`], what
//! the core sends is gathered into the [`Answer`], and work that completes elsewhere (the
//! queue's device channel, the offload engine, state writes) is waited for as the NVMe/TCP
//! connection task waits for it. A command that waits for an event instead (an
//! Asynchronous Event Request with none pending) is parked: `run` says so
//! ([`Error::Parked`]), and its completion comes, when an event does, from
//! [`Loopback::event`].

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use nearstore_wire::sqe::{sgl_id, Sgl};
use nearstore_wire::{Cqe, Sqe, Status};

use crate::exec::{Core, Overflow, Replies, Transport};
use crate::{Port, Target};

/// A command's data, and where it travels.
#[derive(Clone, Copy, Debug)]
pub enum Data<'a> {
    None,
    /// Host to controller, in the command capsule (an in-capsule data block SGL).
    Capsule(&'a [u8]),
    /// Host to controller, fetched by the core ([`Transport::fetch_data`]; a transport data
    /// block SGL, as NVMe/TCP's R2T).
    Out(&'a [u8]),
    /// Controller to host, this many bytes.
    In(usize),
    /// Host to controller as [`Data::Out`] with an SGL of `len` bytes, of which the
    /// transport delivers only `data`: a transport that stops short, which the core must
    /// not run on a partly filled buffer.
    Short {
        len: usize,
        data: &'a [u8],
    },
}

/// What the host sees of one command: its completion and the data sent before it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The completion; a completion stood for by the data (the SUCCESS flag) is the one a
    /// host makes of it: status success, dw0 and dw1 zero.
    pub cqe: Cqe,
    pub data: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The host had more commands outstanding than the queue holds (a fatal transport error
    /// on NVMe/TCP).
    #[error("more commands outstanding than the queue size")]
    Overflow,
    /// The queue was disconnected (Disconnect) or its controller is gone (keep-alive
    /// expiry, its admin queue closed): it takes no more commands.
    #[error("the queue is closed")]
    Closed,
    #[error("waiting for the queue's device operations: {0}")]
    Io(#[from] io::Error),
    /// The command waits for an event (an Asynchronous Event Request none is pending for):
    /// its completion comes from [`Loopback::event`] once one is.
    #[error("command {0} is parked until an event")]
    Parked(u16),
    /// The command identifier is that of a parked command: a host keeps identifiers of
    /// outstanding commands unique.
    #[error("command identifier {0} is outstanding")]
    CidInUse(u16),
    /// [`Loopback::event`] with no command parked: nothing would complete.
    #[error("no command is parked")]
    NothingParked,
}

impl From<Overflow> for Error {
    fn from(_: Overflow) -> Error {
        Error::Overflow
    }
}

/// The loopback's sending half: what the core sent for the command being run, and the
/// completions of parked commands.
#[derive(Default)]
struct LoopTx {
    data: Vec<u8>,
    cqes: Vec<Cqe>,
    /// The core's request for the host's data: (tag, bytes).
    fetch: Option<(u16, usize)>,
}

impl Transport for LoopTx {
    fn complete(&mut self, cqe: &Cqe) {
        self.cqes.push(*cqe);
    }

    fn send_data(&mut self, cid: u16, data: &[u8], success: bool) {
        self.data.extend_from_slice(data);
        if success {
            self.cqes.push(Cqe { cid, status: Status::SUCCESS, ..Cqe::default() });
        }
    }

    fn send_lent(&mut self, cid: u16, _len: usize, success: bool, parts: &[&[u8]]) {
        for p in parts {
            self.data.extend_from_slice(p);
        }
        if success {
            self.cqes.push(Cqe { cid, status: Status::SUCCESS, ..Cqe::default() });
        }
    }

    fn fetch_data(&mut self, _cid: u16, tag: u16, len: usize) {
        self.fetch = Some((tag, len));
    }

    /// A loopback holds what its one command sends.
    fn has_room(&self) -> bool {
        true
    }
}

/// One in-process queue of a target, before its Connect (which is a command like the
/// others, run with [`run`](Self::run)).
pub struct Loopback {
    core: Core<LoopTx>,
    replies: Replies,
    /// Completions of parked commands, for [`event`](Self::event).
    events: std::collections::VecDeque<Cqe>,
}

impl Loopback {
    /// A queue of `target`, on a port serving its subsystems (`discovery`: the discovery
    /// subsystem only).
    pub fn new(target: &Arc<Target>, discovery: bool) -> Loopback {
        let port = Arc::new(Port { id: 0, addr: SocketAddr::from(([127, 0, 0, 1], 0)), discovery, advertise: None });
        let (core, replies) = Core::new(target.clone(), port, None, "loopback".into(), LoopTx::default());
        Loopback { core, replies, events: Default::default() }
    }

    /// Runs one command to its completion, or until it is parked ([`Error::Parked`]). Its
    /// command identifier is the host's (unique among the queue's outstanding commands);
    /// its data pointer (SGL) is set here, from `data`.
    pub async fn run(&mut self, mut sqe: Sqe, data: Data<'_>) -> Result<Answer, Error> {
        if self.core.close_after_flush || self.core.cancel.is_cancelled() {
            return Err(Error::Closed);
        }
        let cid = sqe.cid();
        if self.core.is_parked(cid) {
            return Err(Error::CidInUse(cid));
        }
        let (sgl, capsule, out): (Sgl, &[u8], &[u8]) = match data {
            Data::None => (Sgl { addr: 0, len: 0, id: sgl_id::TRANSPORT }, &[], &[]),
            Data::Capsule(d) => (Sgl { addr: 0, len: d.len() as u32, id: sgl_id::IN_CAPSULE }, d, &[]),
            Data::Out(d) => (Sgl { addr: 0, len: d.len() as u32, id: sgl_id::TRANSPORT }, &[], d),
            Data::In(n) => (Sgl { addr: 0, len: n as u32, id: sgl_id::TRANSPORT }, &[], &[]),
            Data::Short { len, data } => (Sgl { addr: 0, len: len as u32, id: sgl_id::TRANSPORT }, &[], data),
        };
        sqe.set_sgl(sgl);
        self.core.xport.data.clear();
        self.core.xport.fetch = None;
        // A command is taken with a data buffer in the queue's pool (exec/buffers.rs): one
        // command at a time always finds one of the queue's own.
        let ready = self.core.buf_ready();
        debug_assert!(ready, "a loopback queue without a data buffer for its one command");
        self.core.on_capsule(sqe, capsule, true)?;
        loop {
            if let Some((tag, len)) = self.core.xport.fetch.take() {
                // The core asks for what the command defines, never more than its SGL.
                if let Some(w) = self.core.waiting(tag) {
                    let n = len.min(out.len()).min(w.buf.len());
                    w.buf[..n].copy_from_slice(&out[..n]);
                    w.received = n;
                    self.core.data_arrived(tag)?;
                }
                continue;
            }
            // Events that came meanwhile complete parked commands, as a connection delivers
            // them between commands.
            self.core.deliver_events();
            if let Some(cqe) = self.take_completions(Some(cid)) {
                return Ok(Answer { cqe, data: std::mem::take(&mut self.core.xport.data) });
            }
            if self.core.poll_io() > 0 {
                continue;
            }
            if self.core.is_parked(cid) {
                return Err(Error::Parked(cid));
            }
            self.wait().await?;
        }
    }

    /// The completion of a parked command: one that came while others ran, else the next
    /// one, waiting for an event as long as it takes.
    pub async fn event(&mut self) -> Result<Answer, Error> {
        loop {
            self.core.deliver_events();
            self.take_completions(None);
            if let Some(cqe) = self.events.pop_front() {
                return Ok(Answer { cqe, data: Vec::new() });
            }
            if self.core.cancel.is_cancelled() {
                return Err(Error::Closed);
            }
            if !self.core.has_aers() {
                return Err(Error::NothingParked);
            }
            let Some(ctrl) = self.core.controller().cloned() else { return Err(Error::Closed) };
            let cancel = self.core.cancel.clone();
            tokio::select! {
                biased;
                _ = cancel.cancelled() => {}
                _ = ctrl.events.notified() => {}
            }
        }
    }

    /// Moves the completions the core sent to the parked ones, but for `cid`'s: returned.
    fn take_completions(&mut self, cid: Option<u16>) -> Option<Cqe> {
        let mut mine = None;
        for cqe in self.core.xport.cqes.drain(..) {
            if Some(cqe.cid) == cid && mine.is_none() {
                mine = Some(cqe);
            } else {
                self.events.push_back(cqe);
            }
        }
        mine
    }

    /// Waits for work that completes elsewhere: the queue's devices, the offload engine,
    /// state writes, another host's Preempt and Abort, the controller going.
    async fn wait(&mut self) -> Result<(), Error> {
        let io_busy = self.core.chan.busy();
        let cancel = self.core.cancel.clone();
        tokio::select! {
            biased;
            _ = cancel.cancelled() => {
                // The controller went: the queue ends as a connection does.
                self.core.abandon_outstanding();
                return Err(Error::Closed);
            }
            d = self.replies.abort.recv() => {
                if let Some(d) = d {
                    self.core.on_done(d);
                }
            }
            d = self.replies.done.recv() => {
                if let Some(d) = d {
                    self.core.on_done(d);
                }
            }
            r = self.core.chan.wait(), if io_busy => r?,
        }
        Ok(())
    }
}

impl Drop for Loopback {
    /// Closes the queue as a closing connection does: its compute commands stop, what is
    /// outstanding ends unfinished, and the queue leaves its controller.
    fn drop(&mut self) {
        self.core.cancel.cancel();
        self.core.abandon_outstanding();
        self.core.detach();
    }
}
