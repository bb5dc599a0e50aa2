//! The fused write operations (docs/compute-protocol.md, "Fused write operations"): a FUSED
//! WRITE is checked here before anything is read or written ([`check`]), then runs on a
//! blocking thread ([`run`]): the blocks it touches are read, the operation's bytes
//! (append-crc-write: the LevelDB log record framed, its checksums computed here) merged
//! into them, and the block images and the result are one transaction of the namespace's
//! MicroTx journal. READ CHECKSUM ([`read_checksum`]) reads and checksums in one command.

use std::ops::Range;
use std::sync::Arc;

use nearstore_wire::compute::status as cs;
use nearstore_wire::fused::{self, Fused, FusedError, RESULT_BYTES};
use nearstore_wire::{Sqe, Status};

use crate::microtx::{Journal, JournalError, Outcome, Tx};
use crate::reservation::Access;
use crate::subsystem::{AbortGuard, Controller, Namespace};

/// Why a fused command was refused or failed: its status and what to log.
#[derive(Debug)]
pub struct Refusal {
    pub status: Status,
    pub message: String,
}

fn refuse(status: Status, message: impl Into<String>) -> Refusal {
    Refusal { status, message: message.into() }
}

/// A checked FUSED WRITE, ready to run.
pub struct Planned {
    pub ns: Arc<Namespace>,
    journal: Arc<Journal>,
    txid: u64,
    op: u8,
    /// The bytes the operation puts into the object, from `head` bytes into the first
    /// block of `pieces`.
    bytes: Vec<u8>,
    head: usize,
    /// The namespace ranges (byte offset, length) of the blocks it touches, in object
    /// order: whole blocks, one journal write each.
    pieces: Vec<(u64, u64)>,
    result: [u8; RESULT_BYTES],
}

impl Planned {
    /// Bytes the operation writes into the object.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// The namespace of a fused command and its journal: a namespace without one does not
/// serve the fused write operations (Invalid Command Opcode, as for an I/O command set
/// that lacks them).
fn journal_of(ctrl: &Controller, nsid: u32) -> Result<(Arc<Namespace>, Arc<Journal>), Refusal> {
    let ns = ctrl
        .subsys
        .namespace(nsid)
        .ok_or_else(|| refuse(Status::INVALID_NAMESPACE.dnr(), format!("namespace {nsid} is not in {}", ctrl.subsys.nqn)))?;
    let journal = ns
        .journal
        .clone()
        .ok_or_else(|| refuse(Status::INVALID_OPCODE.dnr(), format!("namespace {nsid} keeps no MicroTx journal (microtx = true)")))?;
    Ok((ns, journal))
}

/// The tenant and the reservations allow `ctrl`'s host these logical blocks (None: the
/// namespace as a whole).
fn allowed(ctrl: &Controller, ns: &Namespace, lbas: Option<Range<u64>>, access: Access) -> Result<(), Refusal> {
    let write = access == Access::Write;
    ctrl.tenant.check(&ctrl.subsys.nqn, ns.nsid, lbas, write).map_err(|d| refuse(Status::ACCESS_DENIED.dnr(), d.0))?;
    if !ns.reservations.allows(&ctrl.hostid, access) {
        return Err(refuse(Status::RESERVATION_CONFLICT.dnr(), format!("namespace {} is reserved by another host", ns.nsid)));
    }
    Ok(())
}

/// Checks a FUSED WRITE (`transfer`: its descriptor and data) before anything is read or
/// written: the namespace and its journal, the layout, the extents (whole blocks, inside
/// the namespace, covering exactly the blocks the operation touches), the tenant's write
/// grants and the reservations, the transaction's size.
pub fn check(ctrl: &Controller, sqe: &Sqe, transfer: &[u8]) -> Result<Planned, Refusal> {
    let (ns, journal) = journal_of(ctrl, sqe.nsid())?;
    let (f, data_at) = Fused::decode(transfer).map_err(|e| match e {
        FusedError::Invalid(_) => refuse(cs::DESCRIPTOR_INVALID, e.to_string()),
        FusedError::Limit(_) => refuse(cs::LIMIT_EXCEEDED, e.to_string()),
    })?;
    let bytes = fused::bytes_written(&f, &transfer[data_at..]);
    let bs = ns.block_size as u64;
    let size = ns.blocks * bs;
    let head = f.offset % bs;
    let end = f
        .offset
        .checked_add(bytes.len() as u64)
        .ok_or_else(|| refuse(cs::DESCRIPTOR_INVALID, format!("fused descriptor: byte 16: offset {} overflows", f.offset)))?;
    // The object's blocks the operation touches, from the one holding `offset`.
    let mut want = (end.div_ceil(bs) * bs) - (f.offset - head);
    let mut pieces = Vec::with_capacity(f.extents.len());
    for (i, &(off, len)) in f.extents.iter().enumerate() {
        if !off.is_multiple_of(bs) || !len.is_multiple_of(bs) {
            return Err(refuse(
                cs::DESCRIPTOR_INVALID,
                format!("fused descriptor: extent {i}: {len} bytes at {off} are not whole {bs}-byte blocks"),
            ));
        }
        if off + len > size {
            return Err(refuse(
                Status::LBA_OUT_OF_RANGE.dnr(),
                format!("fused descriptor: extent {i}: bytes {off}..{} lie outside the namespace of {size} bytes", off + len),
            ));
        }
        if want == 0 {
            return Err(refuse(cs::DESCRIPTOR_INVALID, format!("fused descriptor: extent {i} lies wholly past the bytes written")));
        }
        let take = len.min(want);
        allowed(ctrl, &ns, Some(off / bs..(off + take) / bs), Access::Write)?;
        pieces.push((off, take));
        want -= take;
    }
    if want > 0 {
        return Err(refuse(cs::DESCRIPTOR_INVALID, format!("fused descriptor: the extents end {want} bytes before the bytes written")));
    }
    let crc = crc32c::crc32c(&bytes);
    let result = fused::result(crc, bytes.len() as u32, end);
    Ok(Planned { ns, journal, txid: f.txid, op: f.op, bytes, head: head as usize, pieces, result })
}

/// A FUSED WRITE's standing against a Preempt and Abort of its host (docs/protocol.md,
/// "Preempt and Abort"), shared by its queue entry and its blocking work: asked to abort
/// before its transaction starts, it does not run (Command Aborted due to Preempt and
/// Abort); asked later, the Acquire's guards are held until the transaction has ended.
#[derive(Default)]
pub struct AbortHold(parking_lot::Mutex<HoldState>);

#[derive(Default)]
struct HoldState {
    aborted: bool,
    ended: bool,
    guards: Vec<AbortGuard>,
}

impl AbortHold {
    /// Requests the abort; `guard` is held until the work has ended (dropped at once when
    /// it has).
    pub fn abort(&self, guard: AbortGuard) {
        let mut s = self.0.lock();
        if !s.ended {
            s.aborted = true;
            s.guards.push(guard);
        }
    }

    fn aborted(&self) -> bool {
        self.0.lock().aborted
    }

    /// The work has ended: the guards go (outside the lock).
    pub fn ended(&self) {
        let guards = {
            let mut s = self.0.lock();
            s.ended = true;
            std::mem::take(&mut s.guards)
        };
        drop(guards);
    }
}

/// Runs a checked FUSED WRITE on a blocking thread: reads the blocks it only partly
/// covers, merges its bytes, and runs the block images as one journal transaction.
/// Returns its result (crc32c, count, end) once durable. Asked to abort (`hold`) before it
/// has the namespace's journal, it writes nothing.
pub fn run(p: &Planned, hold: &AbortHold) -> Result<[u8; RESULT_BYTES], Refusal> {
    let bs = p.ns.block_size as usize;
    let total: u64 = p.pieces.iter().map(|&(_, l)| l).sum();
    let mut image = vec![0u8; total as usize];
    // One operation at a time on the namespace's journal, so that the blocks read here
    // are not changed by another fused operation before this one's are written.
    let _serial = p.journal.exclusive();
    if hold.aborted() {
        return Err(refuse(Status::ABORTED_PREEMPT, format!("transaction {}: its host was preempted and aborted", p.txid)));
    }
    let tail = p.head + p.bytes.len();
    let (first, last) = (0..bs, (tail / bs) * bs..(tail.div_ceil(bs) * bs));
    let partial = [(p.head != 0).then_some(first), (!tail.is_multiple_of(bs)).then_some(last)];
    for r in partial.into_iter().flatten() {
        let at = namespace_byte(&p.pieces, r.start as u64).ok_or_else(|| {
            refuse(Status::INTERNAL_ERROR.dnr(), format!("transaction {}: block {} outside its extents", p.txid, r.start))
        })?;
        let block = &mut image[r.clone()];
        p.ns.backend.read_at(block, at).map_err(|e| {
            refuse(Status::UNRECOVERED_READ_ERROR.dnr(), format!("transaction {}: reading the block at namespace byte {at}: {e}", p.txid))
        })?;
    }
    image[p.head..tail].copy_from_slice(&p.bytes);
    let mut writes = Vec::with_capacity(p.pieces.len());
    let mut at = 0usize;
    for &(off, len) in &p.pieces {
        writes.push((off, image[at..at + len as usize].to_vec()));
        at += len as usize;
    }
    let tx = Tx { txid: p.txid, op: p.op, writes };
    p.journal.run_with(&*p.ns.backend, &tx, p.result).map_err(|e| match e {
        JournalError::TxidInUse(_) => refuse(Status::INVALID_FIELD.dnr(), e.to_string()),
        JournalError::TooLarge { .. } => refuse(cs::LIMIT_EXCEEDED, e.to_string()),
        JournalError::OutOfRange { .. } => refuse(Status::LBA_OUT_OF_RANGE.dnr(), e.to_string()),
        _ => refuse(Status::WRITE_FAULT.dnr(), e.to_string()),
    })
}

/// The namespace byte of byte `at` of the blocks `pieces` cover.
fn namespace_byte(pieces: &[(u64, u64)], mut at: u64) -> Option<u64> {
    for &(off, len) in pieces {
        if at < len {
            return Some(off + at);
        }
        at -= len;
    }
    None
}

/// A checked READ CHECKSUM: the namespace bytes to read, and the part of them to checksum.
pub struct ReadPlan {
    pub ns: Arc<Namespace>,
    pub off: u64,
    pub len: usize,
    pub sum: Range<usize>,
}

/// Checks a READ CHECKSUM: SLBA (CDW10-11) and NLB (CDW12, 0's based) as a Read, the
/// transfer exactly their bytes, at most one transfer; CDW13 the first byte checksummed
/// and CDW14 how many, inside the transfer. Read access as for a Read.
pub fn check_read(ctrl: &Controller, sqe: &Sqe) -> Result<ReadPlan, Refusal> {
    let nsid = sqe.nsid();
    let ns = ctrl
        .subsys
        .namespace(nsid)
        .ok_or_else(|| refuse(Status::INVALID_NAMESPACE.dnr(), format!("namespace {nsid} is not in {}", ctrl.subsys.nqn)))?;
    let (slba, nlb) = (sqe.slba(), sqe.nlb() as u64);
    allowed(ctrl, &ns, Some(slba..slba.saturating_add(nlb)), Access::Read)?;
    let (off, len) = ns.range(slba, nlb).ok_or_else(|| {
        refuse(Status::LBA_OUT_OF_RANGE.dnr(), format!("blocks {slba}+{nlb} lie outside namespace {nsid} of {} blocks", ns.blocks))
    })?;
    if len > crate::limits::TRANSFER_BYTES_MAX as u64 {
        return Err(refuse(Status::INVALID_FIELD.dnr(), format!("{len} bytes: more than one transfer")));
    }
    if sqe.sgl().len as u64 != len {
        return Err(refuse(Status::DATA_SGL_LENGTH_INVALID.dnr(), format!("SGL of {} bytes for {len} bytes of blocks", sqe.sgl().len)));
    }
    let (start, count) = (sqe.cdw(13) as u64, sqe.cdw(14) as u64);
    if start + count > len {
        return Err(refuse(Status::INVALID_FIELD.dnr(), format!("checksum of bytes {start}+{count} of a {len}-byte transfer")));
    }
    Ok(ReadPlan { ns, off, len: len as usize, sum: start as usize..(start + count) as usize })
}

/// Reads a checked READ CHECKSUM's blocks into `buf` (its length) on a blocking thread
/// and returns the crc32c of the part asked for.
pub fn read_checksum(p: &ReadPlan, buf: &mut [u8]) -> Result<u32, Refusal> {
    p.ns.backend.read_at(buf, p.off).map_err(|e| {
        refuse(Status::UNRECOVERED_READ_ERROR.dnr(), format!("reading {} bytes at namespace byte {}: {e}", buf.len(), p.off))
    })?;
    Ok(crc32c::crc32c(&buf[p.sum.clone()]))
}

/// OUTCOME: a transaction's state (DW0) and result (the data, exactly RESULT_BYTES),
/// while the namespace's journal holds it. Read access to the namespace, as any host
/// that may read it may learn what became of a write.
pub fn outcome(ctrl: &Controller, sqe: &Sqe) -> Result<(u32, [u8; RESULT_BYTES]), Refusal> {
    let (ns, journal) = journal_of(ctrl, sqe.nsid())?;
    allowed(ctrl, &ns, None, Access::Read)?;
    if sqe.sgl().len as usize != RESULT_BYTES {
        return Err(refuse(
            Status::DATA_SGL_LENGTH_INVALID.dnr(),
            format!("SGL of {} bytes for a {RESULT_BYTES}-byte result", sqe.sgl().len),
        ));
    }
    let txid = sqe.cdw(10) as u64 | (sqe.cdw(11) as u64) << 32;
    Ok(match journal.outcome(txid) {
        None => (fused::state::UNKNOWN, [0; RESULT_BYTES]),
        Some(Outcome::Committed(r)) => (fused::state::COMMITTED, r),
        Some(Outcome::RolledBack) => (fused::state::ROLLED_BACK, [0; RESULT_BYTES]),
        Some(Outcome::Failed) => (fused::state::FAILED, [0; RESULT_BYTES]),
    })
}
