//! The fused write operations (docs/compute-protocol.md, "Fused write operations"): a FUSED
//! WRITE is checked here before its data moves ([`check_before_data`]) and before anything
//! is read or written ([`check`]), then runs on a blocking thread in its turn on the
//! namespace's journal ([`run`]): the blocks it touches are read, the operation's bytes
//! (append-crc-write: the LevelDB log record framed, its checksums computed here;
//! compress-write: a zstd frame; read-modify-write: the old bytes combined with the data)
//! merged into them, and the block images and the result are one transaction of the
//! namespace's MicroTx journal. READ CHECKSUM is a Read (io_cmd::plan, the namespace's device) whose
//! completion carries the checksum of [`checksum_range`].

use std::ops::Range;
use std::sync::Arc;

use nearstore_wire::compute::status as cs;
use nearstore_wire::fused::{self, op, Fused, FusedError, RESULT_BYTES};
use nearstore_wire::{Sqe, Status};

use crate::microtx::{Journal, JournalError, Outcome, Turn, Tx};
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

/// A checked FUSED WRITE, ready to run on its transfer (left in the queue's pooled buffer,
/// charged to its memory, until it has run).
pub struct Planned {
    /// Its controller, whose standing is checked again in its turn ([`recheck`]).
    ctrl: Arc<Controller>,
    pub ns: Arc<Namespace>,
    pub journal: Arc<Journal>,
    f: Fused,
    /// Where the data starts in the transfer.
    data_at: usize,
    /// Bytes the operation puts into the object, from `head` bytes into the first block of
    /// `pieces`.
    count: usize,
    head: usize,
    /// The namespace ranges (byte offset, length) of the blocks it touches, in object
    /// order: whole blocks, one journal write each.
    pieces: Vec<(u64, u64)>,
}

impl Planned {
    /// Bytes the operation writes into the object.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}

/// The namespace of a fused command and its journal: a namespace without one does not
/// serve the fused write operations (Invalid Command Opcode, as for an I/O command set
/// that lacks them); one whose journal could not be replayed serves nothing (Namespace
/// Not Ready).
fn journal_of(ctrl: &Controller, nsid: u32) -> Result<(Arc<Namespace>, Arc<Journal>), Refusal> {
    let ns = ctrl
        .subsys
        .namespace(nsid)
        .ok_or_else(|| refuse(Status::INVALID_NAMESPACE.dnr(), format!("namespace {nsid} is not in {}", ctrl.subsys.nqn)))?;
    if let Some(why) = &ns.offline {
        return Err(refuse(Status::NAMESPACE_NOT_READY.dnr(), format!("namespace {nsid} is offline: {why}")));
    }
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

/// What a FUSED WRITE is checked for before its data moves (before the R2T): its namespace
/// and journal, and that its host may write some of the namespace (the tenant's grants,
/// the reservations); [`check`] checks its blocks once the descriptor is in.
pub fn check_before_data(ctrl: &Controller, sqe: &Sqe) -> Result<(), Refusal> {
    let (ns, _) = journal_of(ctrl, sqe.nsid())?;
    allowed(ctrl, &ns, None, Access::Write)
}

/// The object bytes `n` bytes written at `offset` touch, widened to whole `bs`-byte blocks:
/// (the first block's object byte, the bytes). None when their end passes u64::MAX.
fn blocks_touched(offset: u64, n: u64, bs: u64) -> Option<(u64, u64)> {
    let from = offset / bs * bs;
    let to = offset.checked_add(n)?.div_ceil(bs).checked_mul(bs)?;
    Some((from, to - from))
}

/// Checks a FUSED WRITE (`transfer`: its descriptor and data) before anything is read or
/// written: the namespace and its journal, the layout, the extents (whole blocks, inside
/// the namespace, covering exactly the blocks the operation touches), the tenant's write
/// grants and the reservations, the transaction's size.
pub fn check(ctrl: &Arc<Controller>, sqe: &Sqe, transfer: &[u8]) -> Result<Planned, Refusal> {
    let (ns, journal) = journal_of(ctrl, sqe.nsid())?;
    let (f, data_at) = Fused::decode(transfer).map_err(|e| match e {
        FusedError::Invalid(_) => refuse(cs::DESCRIPTOR_INVALID, e.to_string()),
        FusedError::Limit(_) => refuse(cs::LIMIT_EXCEEDED, e.to_string()),
    })?;
    let count = fused::written_len(&f, transfer.len() - data_at);
    let bs = ns.block_size as u64;
    let size = ns.blocks * bs;
    let head = f.offset % bs;
    // The object's blocks the operation touches, from the one holding `offset`.
    let (_, mut want) = blocks_touched(f.offset, count as u64, bs).ok_or_else(|| {
        refuse(cs::DESCRIPTOR_INVALID, format!("fused descriptor: byte 16: {count} bytes at offset {} pass the largest offset", f.offset))
    })?;
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
    Ok(Planned { ctrl: ctrl.clone(), ns, journal, f, data_at, count, head: head as usize, pieces })
}

/// Checks a FUSED WRITE again in its turn on the journal, for what may have changed while
/// it waited: its controller revoked (its tenant reloaded) or torn down, its namespace
/// removed or replaced, the tenant's grants or the reservations on its blocks.
fn recheck(p: &Planned) -> Result<(), Refusal> {
    let (ctrl, nsid) = (&p.ctrl, p.ns.nsid);
    if ctrl.revoked() {
        return Err(refuse(Status::ACCESS_DENIED.dnr(), format!("namespace {nsid}: its host left its tenant while it waited")));
    }
    if ctrl.cancel.is_cancelled() {
        return Err(refuse(Status::ABORT_REQUESTED, format!("namespace {nsid}: its controller went away while it waited")));
    }
    if !ctrl.subsys.namespace(nsid).is_some_and(|ns| Arc::ptr_eq(&ns, &p.ns)) {
        return Err(refuse(Status::INVALID_NAMESPACE.dnr(), format!("namespace {nsid} left {} while it waited", ctrl.subsys.nqn)));
    }
    let bs = p.ns.block_size as u64;
    for &(off, len) in &p.pieces {
        allowed(ctrl, &p.ns, Some(off / bs..(off + len) / bs), Access::Write)?;
    }
    Ok(())
}

/// A FUSED WRITE's standing against a Preempt and Abort of its host (docs/protocol.md,
/// "Preempt and Abort"), shared by its queue entry and its work: asked to abort before its
/// transaction starts, it does not run (Command Aborted due to Preempt and Abort), and one
/// waiting for its turn leaves at once; asked later, the Acquire's guards are held until
/// the transaction has ended.
#[derive(Default)]
pub struct AbortHold {
    state: parking_lot::Mutex<HoldState>,
    /// Wakes the work waiting for its turn when the abort comes.
    abort: tokio::sync::Notify,
}

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
        let mut s = self.state.lock();
        if !s.ended {
            s.aborted = true;
            s.guards.push(guard);
            // One waiter at most; kept for it if it is not waiting yet.
            self.abort.notify_one();
        }
    }

    pub(crate) fn aborted(&self) -> bool {
        self.state.lock().aborted
    }

    /// Returns once the abort is requested.
    pub async fn aborted_wait(&self) {
        if !self.aborted() {
            self.abort.notified().await;
        }
    }

    /// The work has ended: the guards go (outside the lock).
    pub fn ended(&self) {
        let guards = {
            let mut s = self.state.lock();
            s.ended = true;
            std::mem::take(&mut s.guards)
        };
        drop(guards);
    }
}

/// Runs a checked FUSED WRITE on its `transfer` on a blocking thread, in its `turn` on the
/// namespace's journal: finishes an earlier unfinished transaction, makes its bytes
/// (append-crc-write's record framed, compress-write's zstd frame) and checksums them, reads
/// the blocks it only partly covers (read-modify-write: every block it touches, combined
/// with the data under an exclusive range), merges its bytes, and runs the block images as
/// one journal transaction. Returns its result (crc32c, count, end) once durable. Asked to
/// abort (`hold`) before it started, it writes nothing.
pub fn run(p: &Planned, transfer: &[u8], hold: &AbortHold, _turn: &Turn) -> Result<[u8; RESULT_BYTES], Refusal> {
    let txid = p.f.txid;
    if hold.aborted() {
        return Err(refuse(Status::ABORTED_PREEMPT, format!("transaction {txid}: its host was preempted and aborted")));
    }
    recheck(p)?;
    // An earlier transaction left unfinished (its in-place write failed) is finished first,
    // in this turn: the blocks this one reads to merge its bytes into must hold that
    // transaction's bytes, not what lay there before it, or finishing it inside run_with
    // would be undone by this one's stale images.
    p.journal.finish(&*p.ns.backend).map_err(|e| match e {
        JournalError::Unfinished(_) => refuse(Status::COMMAND_INTERRUPTED, e.to_string()),
        _ => refuse(Status::WRITE_FAULT.dnr(), e.to_string()),
    })?;
    let data = &transfer[p.data_at..];
    let bs = p.ns.block_size as usize;
    // compress-write's frame, made first: the blocks it touches are known only then (its
    // extents cover the largest frame; the blocks past the frame are left as they are).
    let frame = match p.f.op {
        op::COMPRESS_WRITE => {
            let frame = nearstore_compute::compress::compress_frame(data, fused::compress_level(&p.f))
                .map_err(|e| refuse(Status::INTERNAL_ERROR.dnr(), format!("transaction {txid}: compressing: {e}")))?;
            if frame.len() > p.count {
                return Err(refuse(
                    Status::INTERNAL_ERROR.dnr(),
                    format!("transaction {txid}: a frame of {} bytes, over its bound", frame.len()),
                ));
            }
            Some(frame)
        }
        _ => None,
    };
    let count = frame.as_ref().map_or(p.count, Vec::len);
    let (_, want) = blocks_touched(p.f.offset, count as u64, bs as u64).expect("checked with the larger count");
    let pieces = first_bytes(&p.pieces, want);
    let total: u64 = pieces.iter().map(|&(_, l)| l).sum();
    let mut image = vec![0u8; total as usize];
    // Its blocks against other writers (range_lock.rs), taken in its journal turn, which
    // no Compare and Write and no other writer takes: shared against Compare and Write,
    // and for read-modify-write exclusive, so that no write lands between its read and its
    // write in place.
    let start = pieces.iter().map(|&(off, _)| off).min().unwrap_or(0);
    let end = pieces.iter().map(|&(off, len)| off + len).max().unwrap_or(0);
    let rmw = p.f.op == op::READ_MODIFY_WRITE;
    let _shared = (!rmw).then(|| p.ns.ranges.write(start..end));
    let _exclusive = rmw.then(|| p.ns.ranges.lock(start..end));
    let read = |image: &mut [u8], r: std::ops::Range<usize>| -> Result<(), Refusal> {
        let mut done = r.start;
        while done < r.end {
            // Up to the end of the extent holding it.
            let (at, left) = locate(&pieces, done as u64)
                .ok_or_else(|| refuse(Status::INTERNAL_ERROR.dnr(), format!("transaction {txid}: byte {done} outside its extents")))?;
            let n = (r.end - done).min(left as usize);
            p.ns.backend.read_at(&mut image[done..done + n], at).map_err(|e| {
                refuse(Status::UNRECOVERED_READ_ERROR.dnr(), format!("transaction {txid}: reading namespace bytes {at}+{n}: {e}"))
            })?;
            done += n;
        }
        Ok(())
    };
    let tail = p.head + count;
    let bytes = if rmw {
        // Every block it touches, read whole, combined with the data in place.
        read(&mut image, 0..total as usize)?;
        fused::modify(&p.f.args, &mut image[p.head..tail], data);
        image[p.head..tail].to_vec()
    } else {
        let bytes = frame.unwrap_or_else(|| fused::bytes_written(&p.f, data));
        debug_assert_eq!(bytes.len(), count);
        // The blocks it covers only partly: their other bytes stay.
        let (first, last) = (0..bs, (tail / bs) * bs..(tail.div_ceil(bs) * bs));
        let partial = [(p.head != 0).then_some(first), (!tail.is_multiple_of(bs)).then_some(last)];
        for r in partial.into_iter().flatten() {
            read(&mut image, r)?;
        }
        image[p.head..tail].copy_from_slice(&bytes);
        bytes
    };
    let result = fused::result(crc32c::crc32c(&bytes), bytes.len() as u32, p.f.offset + bytes.len() as u64);
    let mut writes = Vec::with_capacity(pieces.len());
    let mut at = 0usize;
    for &(off, len) in &pieces {
        writes.push((off, image[at..at + len as usize].to_vec()));
        at += len as usize;
    }
    let tx = Tx { txid, op: p.f.op, writes };
    p.journal.run_with(&*p.ns.backend, &tx, result).map_err(|e| match e {
        JournalError::TxidInUse(_) => refuse(Status::INVALID_FIELD.dnr(), e.to_string()),
        JournalError::TooLarge { .. } => refuse(cs::LIMIT_EXCEEDED, e.to_string()),
        JournalError::OutOfRange { .. } => refuse(Status::LBA_OUT_OF_RANGE.dnr(), e.to_string()),
        // An earlier transaction not finished yet: nothing of this one was logged, its id
        // stays free; retried, it runs once the earlier one is finished.
        JournalError::Unfinished(_) => refuse(Status::COMMAND_INTERRUPTED, e.to_string()),
        _ => refuse(Status::WRITE_FAULT.dnr(), e.to_string()),
    })
}

/// The first `want` bytes of the blocks `pieces` cover, as pieces.
fn first_bytes(pieces: &[(u64, u64)], mut want: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::with_capacity(pieces.len());
    for &(off, len) in pieces {
        if want == 0 {
            break;
        }
        let take = len.min(want);
        out.push((off, take));
        want -= take;
    }
    out
}

/// Byte `at` of the blocks `pieces` cover: its namespace byte and the bytes from it to the
/// end of its piece.
fn locate(pieces: &[(u64, u64)], mut at: u64) -> Option<(u64, u64)> {
    for &(off, len) in pieces {
        if at < len {
            return Some((off + at, len - at));
        }
        at -= len;
    }
    None
}

/// READ CHECKSUM's checksummed range: CDW13 the first byte of its transfer of `len` bytes
/// (io_cmd::plan checked it as a Read), CDW14 how many, inside the transfer.
pub fn checksum_range(sqe: &Sqe, len: usize) -> Result<Range<usize>, Refusal> {
    let (start, count) = (sqe.cdw(13) as u64, sqe.cdw(14) as u64);
    if start + count > len as u64 {
        return Err(refuse(Status::INVALID_FIELD.dnr(), format!("checksum of bytes {start}+{count} of a {len}-byte transfer")));
    }
    Ok(start as usize..(start + count) as usize)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The wire's constant bound of a compress-write frame is zstd's own, around zstd's
    /// 128 KiB step and at MDTS.
    #[test]
    fn the_frame_bound_is_zstds() {
        let t = crate::limits::TRANSFER_BYTES_MAX;
        for n in [1usize, 255, 256, 4095, 4096, 100_000, (128 << 10) - 1, 128 << 10, (128 << 10) + 1, t, 1 << 20] {
            assert_eq!(fused::compress_bound(n), zstd::zstd_safe::compress_bound(n), "{n} bytes");
        }
    }

    /// The pieces of a prefix, and what is left of a piece from a byte on.
    #[test]
    fn prefixes_of_pieces() {
        let p = [(4096, 1024), (0, 512), (8192, 2048)];
        assert_eq!(first_bytes(&p, 0), vec![]);
        assert_eq!(first_bytes(&p, 1), vec![(4096, 1)]);
        assert_eq!(first_bytes(&p, 1024), vec![(4096, 1024)]);
        assert_eq!(first_bytes(&p, 1025), vec![(4096, 1024), (0, 1)]);
        assert_eq!(first_bytes(&p, 1 << 20), p.to_vec());
        let at = |b| locate(&p, b);
        assert_eq!((at(0), at(1023), at(1024), at(1536)), (Some((4096, 1024)), Some((5119, 1)), Some((0, 512)), Some((8192, 2048))));
        assert_eq!(at(3584), None);
    }

    /// The blocks a fused operation touches, near u64::MAX too: None where their end would
    /// pass it (before, the rounding overflowed).
    #[test]
    fn blocks_touched_never_overflow() {
        let m = u64::MAX;
        // (offset, bytes, block size, (first block's byte, bytes) or None)
        let cases = [
            (0, 1, 512, Some((0, 512))),
            (511, 2, 512, Some((0, 1024))),
            (1000, 24, 512, Some((512, 512))),
            (4096, 4096, 4096, Some((4096, 4096))),
            (m - 700, 600, 512, None),
            (m - 100, 200, 512, None),
            (m / 512 * 512 - 512, 512, 512, Some((m / 512 * 512 - 512, 512))),
            (m / 512 * 512 - 512, 513, 512, None),
        ];
        for (offset, n, bs, want) in cases {
            assert_eq!(blocks_touched(offset, n, bs), want, "{n} bytes at {offset} in {bs}-byte blocks");
        }
    }
}
