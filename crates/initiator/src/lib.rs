//! A userspace NVMe/TCP initiator.
//!
//! [`QueuePair`] is one connection (one queue): submit commands, then poll for their
//! completions, many in flight at once, with no allocation per command once the queue is
//! warm. [`Controller`] builds on it: it connects the admin queue, enables the controller,
//! identifies it, keeps it alive, and opens I/O queues.

mod auth;
mod controller;
pub mod host;
pub mod limits;
pub mod pifo;
mod queue;
pub mod stream;

pub use controller::{prop_get, prop_set, CompareAndWrite, ConnectOptions, Controller, Instance, IoQueue};
pub use host::default_hostnqn;
pub use queue::{Data, QueueOptions, QueuePair};
pub use stream::{PieceReader, PieceWriter};

use nearstore_wire::{Cqe, Status};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("{what} failed: {status}")]
    Status { what: String, status: Status, cqe: Cqe },
    #[error("target terminated the connection (TermReq fes {fes:#x}, field at byte {fei})")]
    Terminated { fes: u16, fei: u32 },
    #[error("target closed the connection")]
    Closed,
    #[error("{0} timed out")]
    Timeout(String),
    #[error("queue full: {0} commands in flight")]
    QueueFull(usize),
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A compute command the target refused or that failed there: its status and the
    /// message it held for the host.
    #[error("{status}: {message}")]
    Compute { status: Status, message: String },
    /// A Connect acting for a host ([`ConnectOptions::acting_for`]) succeeded without the
    /// target's confirmation that it checked that host: it ignored the name (not a
    /// nearstore target, or an old one), so the connection would serve anyone.
    #[error("{subnqn} admitted the connection without confirming that it checked host {host} (it does not know the acting-for extension)")]
    ActingForUnconfirmed { subnqn: String, host: String },
    /// The target asks this host to authenticate (AUTHREQ.ATR) and no secret was given.
    #[error("{subnqn} requires host {hostnqn} to authenticate: give its secret (--dhchap-secret)")]
    AuthRequired { subnqn: String, hostnqn: String },
    /// The target refused the host's authentication (a DH-HMAC-CHAP_Failure1).
    #[error("authentication of queue {qid} refused by the target: {}", nearstore_dhchap::msg::explanation::name(*.explanation))]
    AuthRefused { qid: u16, explanation: u8 },
    /// Authentication failed on this side: the target's messages or its proof.
    #[error("authentication: {0}")]
    Auth(String),
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}
