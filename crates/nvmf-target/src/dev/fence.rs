//! The devices a namespace with a MicroTx journal (`microtx = true`) is served through
//! (docs/compute-protocol.md, "The MicroTx journal"): [`Fenced`] refuses I/O of the blocks
//! of a transaction its journal has not finished (microtx::Fence), [`Offline`] everything
//! when its journal could not be replayed at start-up. Topmost in the namespace's stack,
//! so that every user of the namespace's blocks meets them: Read, Write, Write Zeroes,
//! Deallocate, READ CHECKSUM, compute inputs and outputs.

use std::sync::Arc;

use nearstore_transport::AlignedBuf;
use nearstore_wire::Status;

use super::{status_error, BlockDevice, Channel, Geometry, Op};
use crate::backend::Backend;
use crate::microtx::Journal;

/// The byte ranges an operation reads or changes; flush none.
fn ranges(op: &Op, buf: &AlignedBuf) -> Vec<(u64, u64)> {
    match *op {
        Op::Read { off } | Op::Write { off, .. } => vec![(off, buf.len() as u64)],
        Op::WriteZeroes { off, len, .. } => vec![(off, len)],
        Op::Flush => Vec::new(),
        Op::Deallocate => buf
            .chunks_exact(16)
            .map(|r| (u64::from_le_bytes(r[..8].try_into().expect("8")), u64::from_le_bytes(r[8..].try_into().expect("8"))))
            .filter(|&(_, len)| len > 0)
            .collect(),
    }
}

/// Refuses operations on fenced blocks with Command Interrupted (DNR clear: the host
/// retries), and asks the journal to try finishing its transaction again.
pub struct Fenced {
    base: Arc<dyn BlockDevice>,
    journal: Arc<Journal>,
    /// The namespace's storage, which the journal writes in place.
    data: Arc<dyn Backend>,
}

impl Fenced {
    pub fn new(base: Arc<dyn BlockDevice>, journal: Arc<Journal>, data: Arc<dyn Backend>) -> Fenced {
        Fenced { base, journal, data }
    }
}

impl BlockDevice for Fenced {
    fn describe(&self) -> String {
        format!("{} fenced by its MicroTx journal", self.base.describe())
    }

    fn geometry(&self) -> Geometry {
        self.base.geometry()
    }

    fn quiesce(&self, off: u64, len: u64) -> Option<super::Quiesce> {
        self.base.quiesce(off, len)
    }

    fn submit(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64) {
        let fence = self.journal.fence();
        if fence.is_up() {
            if let Some((off, len)) = ranges(&op, &buf).into_iter().find(|&(off, len)| fence.holds(off, len)) {
                self.journal.kick(self.data.clone());
                let message = format!("{len} bytes at {off}: blocks of a MicroTx transaction not finished yet (its in-place write failed)");
                return ch.complete(tag, Err(status_error(Status::COMMAND_INTERRUPTED, message)), buf);
            }
        }
        self.base.submit(ch, op, buf, tag)
    }

    // completes_now stays false: every operation comes through submit and its check.
}

/// A namespace whose journal could not be replayed: every operation is refused with
/// Namespace Not Ready (DNR set: an operator must repair or remove the journal and
/// restart the target), as serving it could return or overwrite blocks that replay
/// would change.
pub struct Offline {
    base: Arc<dyn BlockDevice>,
    why: String,
}

impl Offline {
    pub fn new(base: Arc<dyn BlockDevice>, why: String) -> Offline {
        Offline { base, why }
    }
}

impl BlockDevice for Offline {
    fn describe(&self) -> String {
        format!("{} offline: {}", self.base.describe(), self.why)
    }

    fn geometry(&self) -> Geometry {
        self.base.geometry()
    }

    fn quiesce(&self, off: u64, len: u64) -> Option<super::Quiesce> {
        self.base.quiesce(off, len)
    }

    fn submit(&self, ch: &mut Channel, _op: Op, buf: AlignedBuf, tag: u64) {
        let message = format!("namespace offline: {}", self.why);
        ch.complete(tag, Err(status_error(Status::NAMESPACE_NOT_READY.dnr(), message)), buf);
    }
}
