//! The fused write operations (docs/compute-protocol.md, "Fused write operations"): a FUSED
//! WRITE is checked here before its data moves ([`check_before_data`]) and before anything
//! is read or written ([`check`]), then waits for its namespace's journal ([`enqueue`]),
//! whose leader runs the FUSED WRITEs waiting then as one group on a blocking thread
//! ([`run_group`]: group commit): the blocks each touches are read (through the images of
//! the members before it), the operation's bytes (append-crc-write: the LevelDB log record
//! framed, its checksums computed here; compress-write: a zstd frame; read-modify-write:
//! the old bytes combined with the data) merged into them, and the block images and the
//! result are one transaction of the group, committed by the namespace's MicroTx journal. READ CHECKSUM is a Read (io_cmd::plan, the namespace's device) whose
//! completion carries the checksum of [`checksum_range`].

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use nearstore_transport::AlignedBuf;
use tokio::sync::oneshot;

use nearstore_wire::compute::status as cs;
use nearstore_wire::fused::{self, op, Fused, FusedError, RESULT_BYTES};
use nearstore_wire::{Sqe, Status};

use crate::backend::Backend;
use crate::limits;
use crate::microtx::{Journal, JournalError, Outcome, Turn, Tx};
use crate::reservation::Access;
use crate::subsystem::{AbortGuard, Controller, Namespace};

/// Why a fused command was refused or failed: its status and what to log.
#[derive(Clone, Debug)]
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

/// A checked FUSED WRITE waiting for its namespace's next group ([`enqueue`]), with its
/// transfer and where its end goes.
pub struct Job {
    id: u64,
    p: Planned,
    transfer: AlignedBuf,
    hold: Arc<AbortHold>,
    done: oneshot::Sender<Ended>,
}

/// A FUSED WRITE's end: its result (crc32c, count, end) or why it failed, and its transfer
/// back.
pub type Ended = (Result<[u8; RESULT_BYTES], Refusal>, AlignedBuf);

/// The FUSED WRITEs of a journal's namespace waiting for its next group, in arrival order,
/// and whether a leader task is running groups.
#[derive(Default)]
pub struct Waiting(parking_lot::Mutex<WaitingState>);

impl Waiting {
    pub fn len(&self) -> usize {
        self.0.lock().jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Default)]
struct WaitingState {
    jobs: VecDeque<Job>,
    next_id: u64,
    leading: bool,
}

/// Queues a checked FUSED WRITE (admitted: [`Journal::admit`]) for its journal's next
/// group, starting the journal's leader task if none runs: the leader takes turns on the
/// journal ([`Journal::turn`]) and in each runs every FUSED WRITE waiting then, up to
/// MICROTX_GROUP_TXS_MAX and MICROTX_GROUP_BYTES_MAX, as one group ([`run_group`]: group
/// commit). Returns the job's id (for [`withdraw`]) and where its end comes.
pub fn enqueue(p: Planned, transfer: AlignedBuf, hold: Arc<AbortHold>) -> (u64, oneshot::Receiver<Ended>) {
    let journal = p.journal.clone();
    let (done, ended) = oneshot::channel();
    let mut w = journal.waiting.0.lock();
    let id = w.next_id;
    w.next_id += 1;
    w.jobs.push_back(Job { id, p, transfer, hold, done });
    if !std::mem::replace(&mut w.leading, true) {
        tokio::spawn(lead(journal.clone()));
    }
    (id, ended)
}

/// Takes a job back out of its journal's queue, if no group has taken it yet: its transfer.
pub fn withdraw(journal: &Journal, id: u64) -> Option<AlignedBuf> {
    let mut w = journal.waiting.0.lock();
    let i = w.jobs.iter().position(|j| j.id == id)?;
    w.jobs.remove(i).map(|j| j.transfer)
}

/// A journal's leader: one group per turn, until none waits.
async fn lead(journal: Arc<Journal>) {
    loop {
        let turn = journal.turn().await;
        let group = {
            let mut w = journal.waiting.0.lock();
            if w.jobs.is_empty() {
                w.leading = false;
                return;
            }
            let room = journal.group_room().min(limits::MICROTX_GROUP_BYTES_MAX);
            let (mut group, mut bytes) = (Vec::new(), 0u64);
            while let Some(j) = w.jobs.front() {
                let space = Journal::space(j.p.pieces.len(), j.p.pieces.iter().map(|&(_, l)| l).sum());
                if !group.is_empty() && (group.len() == limits::MICROTX_GROUP_TXS_MAX || bytes + space > room) {
                    break;
                }
                bytes += space;
                group.push(w.jobs.pop_front().expect("front"));
            }
            group
        };
        let j = journal.clone();
        // A panic drops the jobs' senders: their commands fail (Internal Error).
        let _ = tokio::task::spawn_blocking(move || run_group(&j, group, &turn)).await;
    }
}

/// What a journal error refuses a FUSED WRITE with.
fn refusal_of(e: JournalError) -> Refusal {
    match e {
        JournalError::TxidInUse(_) => refuse(Status::INVALID_FIELD.dnr(), e.to_string()),
        JournalError::TooLarge { .. } => refuse(cs::LIMIT_EXCEEDED, e.to_string()),
        JournalError::OutOfRange { .. } => refuse(Status::LBA_OUT_OF_RANGE.dnr(), e.to_string()),
        // An earlier transaction not finished yet: nothing of this one was logged, its id
        // stays free; retried, it runs once the earlier one is finished.
        JournalError::Unfinished(_) => refuse(Status::COMMAND_INTERRUPTED, e.to_string()),
        _ => refuse(Status::WRITE_FAULT.dnr(), e.to_string()),
    }
}

/// Runs a group of FUSED WRITEs of one journal on a blocking thread, in its `turn`:
/// finishes an earlier unfinished transaction, holds the blocks of all of them against
/// other writers, makes each one's transaction ([`prepare`]: its blocks read through the
/// images of the members before it) and runs those it could make as one group of the
/// journal ([`Journal::run_group`]); then answers each job.
pub fn run_group(journal: &Journal, jobs: Vec<Job>, _turn: &Turn) {
    let Some(first) = jobs.first() else { return };
    let ns = first.p.ns.clone();
    // Each job's answer once known: first those asked to abort or whose standing changed
    // while they waited, refused with their own statuses before anything is done for them.
    let mut answers: Vec<Option<Result<[u8; RESULT_BYTES], Refusal>>> = jobs.iter().map(|j| screen(&j.p, &j.hold).err().map(Err)).collect();
    // An earlier transaction left unfinished (its in-place write failed) is finished first,
    // in this turn: the blocks these read to merge their bytes into must hold that
    // transaction's bytes, not what lay there before it, or finishing it inside run_group
    // would be undone by their stale images.
    let finished = if answers.iter().all(Option::is_some) { Ok(false) } else { journal.finish(&*ns.backend) };
    match finished {
        Err(e) => {
            let r = match e {
                JournalError::Unfinished(_) => refuse(Status::COMMAND_INTERRUPTED, e.to_string()),
                _ => refuse(Status::WRITE_FAULT.dnr(), e.to_string()),
            };
            answers.iter_mut().filter(|a| a.is_none()).for_each(|a| *a = Some(Err(r.clone())));
        }
        Ok(_) => {
            let live = || jobs.iter().zip(&answers).filter(|(_, a)| a.is_none()).map(|(j, _)| j);
            // The blocks of all of them against other writers (range_lock.rs), one range
            // from the first to the last, taken once in the journal's turn (which no
            // Compare and Write and no other writer takes): shared against Compare and
            // Write, and exclusive when a read-modify-write is among them, so that no
            // write lands between its read and its write in place.
            let pieces = || live().flat_map(|j| j.p.pieces.iter());
            let start = pieces().map(|&(off, _)| off).min().unwrap_or(0);
            let end = pieces().map(|&(off, len)| off + len).max().unwrap_or(0);
            let rmw = live().any(|j| j.p.f.op == op::READ_MODIFY_WRITE);
            let _shared = (!rmw).then(|| ns.ranges.write(start..end));
            let _exclusive = rmw.then(|| ns.ranges.lock(start..end));
            let mut made: Vec<Option<(Tx, [u8; RESULT_BYTES])>> = Vec::with_capacity(jobs.len());
            let mut ids = Vec::with_capacity(jobs.len());
            for (j, answer) in jobs.iter().zip(answers.iter_mut()) {
                if answer.is_some() {
                    made.push(None);
                    continue;
                }
                // A panic making one member's transaction fails that member only, not the
                // group's other hosts' commands.
                let prepared = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| prepare(journal, &j.p, &j.transfer, &made, &ids)))
                    .unwrap_or_else(|_| {
                        Err(refuse(Status::INTERNAL_ERROR.dnr(), format!("transaction {}: making it panicked", j.p.f.txid)))
                    });
                match prepared {
                    Ok((tx, result)) => {
                        ids.push(tx.txid);
                        made.push(Some((tx, result)));
                    }
                    Err(r) => {
                        made.push(None);
                        *answer = Some(Err(r));
                    }
                }
            }
            let group: Vec<(&Tx, [u8; RESULT_BYTES])> = made.iter().flatten().map(|(tx, r)| (tx, *r)).collect();
            let ran = journal.run_group(&*ns.backend, &group).map_err(refusal_of);
            for (m, answer) in made.iter().zip(answers.iter_mut()) {
                if let Some((_, result)) = m {
                    *answer = Some(ran.as_ref().map(|()| *result).map_err(Refusal::clone));
                }
            }
        }
    }
    for (j, answer) in jobs.into_iter().zip(answers) {
        j.hold.ended();
        let answer = answer.unwrap_or_else(|| Err(refuse(Status::INTERNAL_ERROR.dnr(), "fused write: no answer was made")));
        let _ = j.done.send((answer, j.transfer));
    }
}

/// A queued FUSED WRITE checked in its group before anything is done for it: asked to
/// abort (`hold`) before it started, it does not run; checked again for what may have
/// changed while it waited ([`recheck`]).
fn screen(p: &Planned, hold: &AbortHold) -> Result<(), Refusal> {
    if hold.aborted() {
        return Err(refuse(Status::ABORTED_PREEMPT, format!("transaction {}: its host was preempted and aborted", p.f.txid)));
    }
    recheck(p)
}

/// Makes a FUSED WRITE's transaction, in its group after the members made `before` (their
/// block images not yet in place: read through them) and ids `ids`: its bytes
/// (append-crc-write's record framed, compress-write's zstd frame) and their checksum, the
/// blocks it only partly covers read (read-modify-write: every block it touches, combined
/// with the data), its bytes merged in; checked by the journal ([`Journal::admissible`])
/// before its images can reach a later member.
fn prepare(
    journal: &Journal,
    p: &Planned,
    transfer: &[u8],
    before: &[Option<(Tx, [u8; RESULT_BYTES])>],
    ids: &[u64],
) -> Result<(Tx, [u8; RESULT_BYTES]), Refusal> {
    let txid = p.f.txid;
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
    let read = |image: &mut [u8], r: std::ops::Range<usize>| -> Result<(), Refusal> {
        let mut done = r.start;
        while done < r.end {
            // Up to the end of the extent holding it.
            let (at, left) = locate(&pieces, done as u64)
                .ok_or_else(|| refuse(Status::INTERNAL_ERROR.dnr(), format!("transaction {txid}: byte {done} outside its extents")))?;
            let n = (r.end - done).min(left as usize);
            read_through(&*p.ns.backend, before, &mut image[done..done + n], at).map_err(|e| {
                refuse(Status::UNRECOVERED_READ_ERROR.dnr(), format!("transaction {txid}: reading namespace bytes {at}+{n}: {e}"))
            })?;
            done += n;
        }
        Ok(())
    };
    let tail = p.head + count;
    let bytes = if p.f.op == op::READ_MODIFY_WRITE {
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
    journal.admissible(&*p.ns.backend, &tx, ids).map_err(refusal_of)?;
    Ok((tx, result))
}

/// Reads namespace bytes at `at` as they will be once `before` (a group's earlier members,
/// their block images not yet in place, in order) are.
fn read_through(backend: &dyn Backend, before: &[Option<(Tx, [u8; RESULT_BYTES])>], buf: &mut [u8], at: u64) -> std::io::Result<()> {
    backend.read_at(buf, at)?;
    let end = at + buf.len() as u64;
    for (off, d) in before.iter().flatten().flat_map(|(tx, _)| tx.writes.iter()) {
        let (from, to) = (at.max(*off), end.min(off + d.len() as u64));
        if from < to {
            buf[(from - at) as usize..(to - at) as usize].copy_from_slice(&d[(from - off) as usize..(to - off) as usize]);
        }
    }
    Ok(())
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
