//! The MicroTx journal of a namespace (seed 004, FusionFS): a fused write operation is one
//! transaction whose micro-operations (each block image it writes, the result it computed)
//! are logged with their results, committed in order with the flushes that make them
//! durable, applied in place, and marked applied. At start-up [`Journal::open`] replays the
//! log: a transaction whose writes and result are all logged is finished from its logged
//! results, any other is rolled back (nothing of it reached the namespace); the outcome of every transaction id stays known to the
//! host (a bounded table, kept in the checkpoints). A transaction the journal could not
//! finish while the target runs (its in-place writes failed, or the checkpoint that drops
//! its records) is left unfinished: its blocks are fenced ([`Fence`]: no I/O of them is
//! served) and the journal takes no other transaction until [`Journal::finish`] succeeds
//! (retried before every transaction and when fenced I/O is refused) or the next start
//! finishes it from the log. The format, byte by byte, and the order of flushes are in
//! docs/compute-protocol.md ("The MicroTx journal").
//!
//! Synchronous, over two [`Backend`]s (the journal, the namespace's data): it flushes, so it
//! runs on a blocking thread, never on a network task. One group of transactions runs at a
//! time per journal ([`Journal::run_group`], group commit): the fused commands wait in the
//! journal's queue (fused.rs, as tasks, not threads), whose leader takes turns
//! ([`Journal::turn`]), at most as many waiting as the target admits ([`Journal::admit`]).

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use tracing::{info, warn};

use crate::backend::Backend;
use crate::limits::{
    MICROTX_CHECKPOINT_BYTES, MICROTX_JOURNAL_BLOCK_BYTES, MICROTX_JOURNAL_BYTES, MICROTX_OUTCOMES_MAX, MICROTX_TX_BYTES_MAX,
    MICROTX_TX_WRITES_MAX,
};

const CHECKPOINT_MAGIC: &[u8; 4] = b"NSJC";
const RECORD_MAGIC: &[u8; 4] = b"NSJR";
const VERSION: u16 = 1;
/// Where the log starts: after the two checkpoint slots.
pub const LOG_START: u64 = 2 * MICROTX_CHECKPOINT_BYTES as u64;
const CHECKPOINT_HEADER: usize = 32;
const OUTCOME_BYTES: usize = 32;
const RECORD_HEADER: usize = 40;
/// The result of a transaction: crc32c of the bytes it wrote (u32), their count (u32), the
/// end of its last write (u64).
pub const RESULT_BYTES: usize = 16;

const _: () = assert!(CHECKPOINT_HEADER + MICROTX_OUTCOMES_MAX * OUTCOME_BYTES <= MICROTX_CHECKPOINT_BYTES);
// A group's APPLIED records (a header each, no payload) fit one journal block.
const _: () = assert!(crate::limits::MICROTX_GROUP_TXS_MAX * RECORD_HEADER <= MICROTX_JOURNAL_BLOCK_BYTES);
const _: () = assert!(MICROTX_CHECKPOINT_BYTES.is_multiple_of(MICROTX_JOURNAL_BLOCK_BYTES));
// The largest transaction fits a journal of the default size, many times.
const _: () = assert!(LOG_START + 32 * Journal::tx_space(MICROTX_TX_WRITES_MAX, MICROTX_TX_BYTES_MAX as u64) <= MICROTX_JOURNAL_BYTES);

/// Record kinds (byte 4 of a record).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Begin = 1,
    Write = 2,
    Result = 3,
    Applied = 4,
    /// Written by earlier versions when an in-place write failed; replay now finishes
    /// such a transaction like one without its APPLIED record.
    Abort = 5,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Begin,
            2 => Kind::Write,
            3 => Kind::Result,
            4 => Kind::Applied,
            5 => Kind::Abort,
            _ => return None,
        })
    }
}

/// One transaction: the block images it writes (computed by the fused operation: the
/// micro-operations' results) and the operation that made it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tx {
    /// Chosen by the host, nonzero, not one whose outcome the journal still holds.
    pub txid: u64,
    /// The fused operation's code (docs/compute-protocol.md), kept for the log's reader.
    pub op: u8,
    /// (namespace byte offset, bytes), each a whole number of the data's blocks.
    pub writes: Vec<(u64, Vec<u8>)>,
}

impl Tx {
    fn bytes(&self) -> u64 {
        self.writes.iter().map(|(_, d)| d.len() as u64).sum()
    }
}

/// What became of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Whole in the namespace; its result.
    Committed([u8; RESULT_BYTES]),
    /// Nothing of it is in the namespace: it was not wholly logged when the target stopped.
    RolledBack,
    /// Logging it or marking it applied failed (a journal write or flush): replay does not
    /// finish it; its blocks hold what they held before it, or it whole when only its
    /// APPLIED record failed.
    Failed,
}

impl Outcome {
    fn code(&self) -> u8 {
        match self {
            Outcome::Committed(_) => 1,
            Outcome::RolledBack => 2,
            Outcome::Failed => 3,
        }
    }
}

/// The result of a transaction from its writes, for transactions whose operation computes
/// none of its own ([`Journal::run`]): crc32c of the block images, their bytes, the end of
/// the last.
pub fn result_of(writes: &[(u64, Vec<u8>)]) -> [u8; RESULT_BYTES] {
    let crc = writes.iter().fold(0u32, |c, (_, d)| crc32c::crc32c_append(c, d));
    let bytes: u64 = writes.iter().map(|(_, d)| d.len() as u64).sum();
    let end = writes.last().map_or(0, |(off, d)| off + d.len() as u64);
    let mut r = [0u8; RESULT_BYTES];
    r[0..4].copy_from_slice(&crc.to_le_bytes());
    r[4..8].copy_from_slice(&(bytes as u32).to_le_bytes());
    r[8..16].copy_from_slice(&end.to_le_bytes());
    r
}

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("transaction id {0} is 0 or already known")]
    TxidInUse(u64),
    #[error("transaction {txid}: {what}")]
    TooLarge { txid: u64, what: String },
    #[error("transaction {txid}: write at {offset}+{len} is not whole blocks inside the namespace of {size} bytes")]
    OutOfRange { txid: u64, offset: u64, len: u64, size: u64 },
    #[error("journal {0}: both checkpoints are corrupt (checksums fail): not replayed, the namespace needs an operator")]
    CheckpointsCorrupt(String),
    #[error("journal {0} is smaller than its checkpoints and one transaction")]
    JournalTooSmall(String),
    #[error("journal {0} is larger than MICROTX_JOURNAL_BYTES ({1} bytes): not a journal this target wrote")]
    JournalTooLarge(String, u64),
    #[error("journal {0} claims generation {1}: no next generation (corrupt)")]
    GenerationExhausted(String, u64),
    /// The journal holds a transaction it has not finished ([`Journal::finish`] failed
    /// again): it takes no other until it has.
    #[error("the journal has not finished an earlier transaction yet: {0}")]
    Unfinished(String),
    /// Logged and durable, its in-place writes failed: finished from the log when
    /// [`Journal::finish`] succeeds or at the next start, and until then its blocks are
    /// fenced and the journal takes no other transaction.
    #[error("transaction {txid}{}: writing in place failed, finished from the journal when the namespace writes again: {source}", others(*.group))]
    InPlace { txid: u64, group: usize, source: io::Error },
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
}

/// What a message about the first of a group of `n` transactions adds for the others.
fn others(n: usize) -> String {
    match n {
        0 | 1 => String::new(),
        2 => " and the one logged with it".into(),
        n => format!(" and the {} logged with it", n - 1),
    }
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> JournalError {
    let what = what.into();
    move |source| JournalError::Io { what, source }
}

/// What start-up found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovery {
    /// The generation whose log was replayed.
    pub generation: u64,
    /// Valid records read.
    pub records: u64,
    /// A checkpoint slot failed its checksum (the other one was used).
    pub checkpoint_corrupt: bool,
    /// The log ended in a record that failed its checks (torn or never written whole).
    pub torn_tail: bool,
    /// Transactions finished from their logged results (written in place again).
    pub finished: Vec<u64>,
    /// Transactions rolled back.
    pub rolled_back: Vec<u64>,
}

/// A deliberate break of the flush order, for the simulation to show its check catches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlushBug {
    /// The in-place writes are not flushed before the transaction is marked applied.
    DataNotFlushedBeforeApplied,
    /// A group's members are written in place last first (a later member's blocks then
    /// hold an earlier one's images).
    GroupInPlaceReversed,
}

struct State {
    generation: u64,
    /// Next record's byte offset in the journal (block aligned between transactions).
    head: u64,
    /// Next record's number in this generation.
    lsn: u64,
    unfinished: Option<Unfinished>,
}

/// What the journal still owes before it takes another transaction: a transaction whose
/// records replay may find and write again in place (its blocks fenced meanwhile), or only
/// the checkpoint of a full journal. Finished by writing its blocks again in place (when
/// it is to be rolled forward) and then a checkpoint, after which replay never reads its
/// records.
struct Unfinished {
    /// The transaction, or the group's ([`Journal::run_group`]), in log order; none for
    /// the checkpoint of a full journal.
    txids: Vec<u64>,
    /// Their block images in log order, written again in place before the checkpoint
    /// (roll forward); empty when nothing is to be written (they failed before or after
    /// their in-place writes).
    apply: Vec<(u64, Vec<u8>)>,
    /// Their outcomes once written again in place.
    outcomes: Vec<(u64, Outcome)>,
    /// The checkpoint of the generation the journal is at was attempted and failed: it is
    /// written again in the same slot, never the next one, which holds the only
    /// checkpoint that passes its checks.
    checkpoint_failed: bool,
    why: String,
}

impl Unfinished {
    /// What it is, for messages.
    fn who(&self) -> String {
        match self.txids.first() {
            Some(txid) => format!("transaction {txid}{}", others(self.txids.len())),
            None => "the full journal's checkpoint".into(),
        }
    }
}

/// The blocks of a namespace no I/O may reach now (its journal's unfinished transaction's):
/// a write there would be acknowledged and then overwritten when the transaction is
/// finished, a read would return bytes that finishing it changes. Looked at on every I/O
/// of the namespace (`dev::fence`), without a lock while it is down.
#[derive(Default)]
pub struct Fence {
    up: AtomicBool,
    /// Namespace byte ranges (offset, length).
    ranges: RwLock<Vec<(u64, u64)>>,
    /// A [`Journal::kick`] is under way.
    retrying: AtomicBool,
}

impl Fence {
    /// True when I/O on `len` bytes at `off` must be refused now.
    pub fn holds(&self, off: u64, len: u64) -> bool {
        self.up.load(Ordering::Acquire)
            && self.ranges.read().iter().any(|&(o, l)| off < o.saturating_add(l) && o < off.saturating_add(len.max(1)))
    }

    /// True while any block is fenced.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    fn raise<'a>(&self, writes: impl Iterator<Item = &'a (u64, Vec<u8>)>) {
        *self.ranges.write() = writes.map(|(off, d)| (*off, d.len() as u64)).collect();
        self.up.store(true, Ordering::Release);
    }

    fn lower(&self) {
        self.up.store(false, Ordering::Release);
        self.ranges.write().clear();
    }
}

/// Records a transaction's outcome, the newest MICROTX_OUTCOMES_MAX kept.
fn note(outcomes: &mut VecDeque<(u64, Outcome)>, txid: u64, outcome: Outcome) {
    outcomes.retain(|(id, _)| *id != txid);
    outcomes.push_back((txid, outcome));
    while outcomes.len() > MICROTX_OUTCOMES_MAX {
        outcomes.pop_front();
    }
}

pub struct Journal {
    log: Arc<dyn Backend>,
    state: Mutex<State>,
    /// The outcomes, newest last: under their own lock, taken only briefly (after `state`
    /// when both), so that OUTCOME is answered while a transaction's I/O holds `state`.
    outcomes: Mutex<VecDeque<(u64, Outcome)>>,
    /// Held by a fused operation from reading the blocks it changes to its transaction's
    /// end ([`Journal::turn`]): FIFO, awaited as a task.
    serial: Arc<tokio::sync::Mutex<()>>,
    /// Fused commands admitted ([`Journal::admit`]): waiting for their turn or running.
    admitted: AtomicUsize,
    /// The FUSED WRITEs waiting for the next group (fused.rs, group commit).
    pub(crate) waiting: crate::fused::Waiting,
    /// Groups committed, and the transactions in them (metrics).
    committed: (AtomicU64, AtomicU64),
    /// The blocks of its unfinished transaction, fenced.
    fence: Arc<Fence>,
    bug: Option<FlushBug>,
    /// The namespace's logical block: every write is whole ones.
    block_bytes: u64,
}

fn round_up(n: u64, to: u64) -> u64 {
    n.div_ceil(to) * to
}

fn record_len(payload: usize) -> u64 {
    round_up((RECORD_HEADER + payload) as u64, 8)
}

/// Appends one record to `buf`.
/// `at`: the record's generation and number in it.
fn put_record(buf: &mut Vec<u8>, kind: Kind, step: u8, op: u8, at: (u64, u64), txid: u64, payload: &[&[u8]]) {
    let (generation, lsn) = at;
    let start = buf.len();
    let len: usize = payload.iter().map(|p| p.len()).sum();
    buf.extend_from_slice(RECORD_MAGIC);
    buf.extend_from_slice(&[kind as u8, step, op, 0]);
    buf.extend_from_slice(&generation.to_le_bytes());
    buf.extend_from_slice(&lsn.to_le_bytes());
    buf.extend_from_slice(&txid.to_le_bytes());
    buf.extend_from_slice(&(len as u32).to_le_bytes());
    buf.extend_from_slice(&[0; 4]);
    for p in payload {
        buf.extend_from_slice(p);
    }
    let crc = crc32c::crc32c(&buf[start..]);
    buf[start + 36..start + 40].copy_from_slice(&crc.to_le_bytes());
    buf.resize(start + record_len(len) as usize, 0);
}

struct Record {
    kind: Kind,
    step: u8,
    txid: u64,
    payload: Vec<u8>,
}

/// The record at `at` of the journal image, if it is whole and the next of `generation`.
fn parse_record(image: &[u8], at: usize, generation: u64, lsn: u64) -> Option<(Record, usize)> {
    let h = image.get(at..at.checked_add(RECORD_HEADER)?)?;
    let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().expect("8 bytes"));
    if &h[0..4] != RECORD_MAGIC || u64_at(8) != generation || u64_at(16) != lsn {
        return None;
    }
    let kind = Kind::from_u8(h[4])?;
    let len = u32::from_le_bytes(h[32..36].try_into().expect("4 bytes")) as usize;
    let whole = image.get(at..at.checked_add(RECORD_HEADER)?.checked_add(len)?)?;
    let want = u32::from_le_bytes(h[36..40].try_into().expect("4 bytes"));
    let crc = crc32c::crc32c_append(crc32c::crc32c_append(crc32c::crc32c(&whole[..36]), &[0; 4]), &whole[RECORD_HEADER..]);
    if crc != want {
        return None;
    }
    let next = at + record_len(len) as usize;
    Some((Record { kind, step: h[5], txid: u64_at(24), payload: whole[RECORD_HEADER..].to_vec() }, next))
}

/// Whether a record of `generation` numbered `lsn` starts at `at`, whole or not: a log
/// ending there ends in a torn record.
fn started(image: &[u8], at: usize, generation: u64, lsn: u64) -> bool {
    image
        .get(at..at + 24)
        .is_some_and(|h| &h[0..4] == RECORD_MAGIC && h[8..16] == generation.to_le_bytes() && h[16..24] == lsn.to_le_bytes())
}

fn encode_checkpoint(generation: u64, outcomes: &VecDeque<(u64, Outcome)>) -> Vec<u8> {
    let mut b = vec![0u8; MICROTX_CHECKPOINT_BYTES];
    b[0..4].copy_from_slice(CHECKPOINT_MAGIC);
    b[4..6].copy_from_slice(&VERSION.to_le_bytes());
    b[8..16].copy_from_slice(&generation.to_le_bytes());
    b[16..20].copy_from_slice(&(outcomes.len() as u32).to_le_bytes());
    for (i, (txid, o)) in outcomes.iter().enumerate() {
        let e = &mut b[CHECKPOINT_HEADER + i * OUTCOME_BYTES..][..OUTCOME_BYTES];
        e[0..8].copy_from_slice(&txid.to_le_bytes());
        e[8] = o.code();
        if let Outcome::Committed(r) = o {
            e[16..32].copy_from_slice(r);
        }
    }
    let crc = crc32c::crc32c(&b);
    b[20..24].copy_from_slice(&crc.to_le_bytes());
    b
}

/// A checkpoint slot: Ok(None) all zero (never written), Err(generation it claims) when it
/// fails its checks.
type Checkpoint = (u64, VecDeque<(u64, Outcome)>);
fn decode_checkpoint(b: &[u8]) -> Result<Option<Checkpoint>, u64> {
    if b.iter().all(|&x| x == 0) {
        return Ok(None);
    }
    let generation = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
    let mut copy = b.to_vec();
    copy[20..24].fill(0);
    let crc = u32::from_le_bytes(b[20..24].try_into().expect("4 bytes"));
    let count = u32::from_le_bytes(b[16..20].try_into().expect("4 bytes")) as usize;
    if &b[0..4] != CHECKPOINT_MAGIC || b[4..6] != VERSION.to_le_bytes() || crc32c::crc32c(&copy) != crc || count > MICROTX_OUTCOMES_MAX {
        return Err(generation);
    }
    let mut outcomes = VecDeque::with_capacity(count);
    for i in 0..count {
        let e = &b[CHECKPOINT_HEADER + i * OUTCOME_BYTES..][..OUTCOME_BYTES];
        let txid = u64::from_le_bytes(e[0..8].try_into().expect("8 bytes"));
        let o = match e[8] {
            1 => Outcome::Committed(e[16..32].try_into().expect("16 bytes")),
            2 => Outcome::RolledBack,
            3 => Outcome::Failed,
            _ => return Err(generation),
        };
        outcomes.push_back((txid, o));
    }
    Ok(Some((generation, outcomes)))
}

/// A transaction as the log holds it.
#[derive(Default)]
struct Replayed {
    txid: u64,
    declared: Option<Vec<(u64, u64)>>,
    writes: Vec<Option<Vec<u8>>>,
    result: Option<[u8; RESULT_BYTES]>,
    applied: bool,
}

impl Replayed {
    fn take(&mut self, r: Record) {
        match r.kind {
            Kind::Begin => {
                let n = r.payload.get(0..4).map_or(0, |b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize);
                let extents: Vec<(u64, u64)> = r
                    .payload
                    .get(8..)
                    .unwrap_or_default()
                    .chunks_exact(16)
                    .take(n)
                    .map(|c| (u64::from_le_bytes(c[0..8].try_into().expect("8")), u64::from_le_bytes(c[8..16].try_into().expect("8"))))
                    .collect();
                if extents.len() == n {
                    self.writes = vec![None; n];
                    self.declared = Some(extents);
                }
            }
            Kind::Write => {
                let declared = self.declared.as_ref().and_then(|d| d.get(r.step as usize));
                let matches = declared.is_some_and(|&(off, len)| r.payload.len() as u64 == 8 + len && r.payload[0..8] == off.to_le_bytes());
                if matches {
                    self.writes[r.step as usize] = Some(r.payload[8..].to_vec());
                }
            }
            Kind::Result => self.result = r.payload.as_slice().try_into().ok(),
            Kind::Applied => self.applied = true,
            Kind::Abort => {}
        }
    }

    /// Its writes, when all of them are logged.
    fn whole(&self) -> Option<Vec<(u64, Vec<u8>)>> {
        let d = self.declared.as_ref()?;
        d.iter().zip(&self.writes).map(|(&(off, _), w)| w.clone().map(|w| (off, w))).collect()
    }
}

impl Journal {
    /// Opens the journal on `log` and replays it onto `data`: finishes or rolls back every
    /// transaction it holds, then starts a new generation (checkpoint). A journal of zeros
    /// is a new one.
    pub fn open(log: Arc<dyn Backend>, data: &dyn Backend, block_bytes: u64) -> Result<(Journal, Recovery), JournalError> {
        Self::open_with(log, data, block_bytes, None)
    }

    /// [`Journal::open`] with a deliberate flush bug (the simulation's negative control).
    pub fn open_with(
        log: Arc<dyn Backend>,
        data: &dyn Backend,
        block_bytes: u64,
        bug: Option<FlushBug>,
    ) -> Result<(Journal, Recovery), JournalError> {
        let size = log.size();
        let block = MICROTX_JOURNAL_BLOCK_BYTES as u64;
        let smallest = LOG_START + Self::tx_space(MICROTX_TX_WRITES_MAX, MICROTX_TX_BYTES_MAX as u64);
        if size < smallest || !size.is_multiple_of(block) {
            return Err(JournalError::JournalTooSmall(log.describe()));
        }
        // The whole journal is read into memory: only one of the size this target creates.
        if size > MICROTX_JOURNAL_BYTES {
            return Err(JournalError::JournalTooLarge(log.describe(), MICROTX_JOURNAL_BYTES));
        }
        let mut image = vec![0u8; size as usize];
        log.read_at(&mut image, 0).map_err(io_err(format!("reading journal {}", log.describe())))?;
        let slots = [
            decode_checkpoint(&image[..MICROTX_CHECKPOINT_BYTES]),
            decode_checkpoint(&image[MICROTX_CHECKPOINT_BYTES..LOG_START as usize]),
        ];
        let mut rec = Recovery { checkpoint_corrupt: slots.iter().any(|s| s.is_err()), ..Recovery::default() };
        let valid = slots.iter().filter_map(|s| s.as_ref().ok().and_then(|c| c.as_ref())).max_by_key(|c| c.0);
        let (generation, mut outcomes) = match valid {
            Some((g, o)) => (*g, o.clone()),
            // Slot 0 never written and slot 1 torn: the first checkpoint of a new journal
            // (generation 1, in slot 1) was cut. A generation's records are written only
            // after its checkpoint is durable, so nothing was logged: a new journal.
            None if rec.checkpoint_corrupt && matches!(slots[0], Ok(None)) => (0, VecDeque::new()),
            None if rec.checkpoint_corrupt => return Err(JournalError::CheckpointsCorrupt(log.describe())),
            None => (0, VecDeque::new()),
        };
        rec.generation = generation;

        // The log of this generation: records in order, up to the first that fails its
        // checks. A transaction starts at a block boundary, so after a record that does
        // not end on one the next may follow the padding.
        let mut txs: Vec<Replayed> = Vec::new();
        let (mut at, mut lsn) = (LOG_START as usize, 0u64);
        loop {
            let found = parse_record(&image, at, generation, lsn).or_else(|| {
                let aligned = round_up(at as u64, block) as usize;
                (aligned != at).then(|| parse_record(&image, aligned, generation, lsn)).flatten()
            });
            let Some((r, next)) = found else {
                let aligned = round_up(at as u64, block) as usize;
                rec.torn_tail = started(&image, at, generation, lsn) || started(&image, aligned, generation, lsn);
                break;
            };
            rec.records += 1;
            // A record belongs to the newest transaction of its id: in a group
            // (Journal::run_group) the APPLIED records follow all of the group's records.
            let i = match txs.iter().rposition(|t| t.txid == r.txid) {
                Some(i) if r.kind != Kind::Begin => i,
                _ => {
                    txs.push(Replayed { txid: r.txid, ..Replayed::default() });
                    txs.len() - 1
                }
            };
            txs[i].take(r);
            (at, lsn) = (next, lsn + 1);
        }

        for t in txs {
            let outcome = if let (Some(writes), Some(result)) = (t.whole(), t.result) {
                if !t.applied {
                    for (off, d) in &writes {
                        data.write_at(d, *off).map_err(io_err(format!("recovery: writing transaction {} at {off}", t.txid)))?;
                    }
                    rec.finished.push(t.txid);
                }
                Outcome::Committed(result)
            } else {
                rec.rolled_back.push(t.txid);
                Outcome::RolledBack
            };
            note(&mut outcomes, t.txid, outcome);
        }
        if !rec.finished.is_empty() {
            data.flush().map_err(io_err("recovery: flushing the namespace"))?;
        }
        // The next generation must exceed any a slot or the log ever held, so that no stale
        // record of it is read as new: a corrupt slot may have been the newer one.
        let mut next = generation;
        for s in &slots {
            if let Err(g) = s {
                next = next.max(*g);
            }
        }
        if image[LOG_START as usize..LOG_START as usize + 4] == *RECORD_MAGIC {
            next = next.max(u64::from_le_bytes(image[LOG_START as usize + 8..LOG_START as usize + 16].try_into().expect("8 bytes")));
        }
        let journal = Journal {
            log,
            state: Mutex::new(State { generation: next, head: LOG_START, lsn: 0, unfinished: None }),
            outcomes: Mutex::new(outcomes),
            serial: Arc::new(tokio::sync::Mutex::new(())),
            admitted: AtomicUsize::new(0),
            waiting: Default::default(),
            committed: Default::default(),
            fence: Arc::default(),
            bug,
            block_bytes,
        };
        journal.checkpoint_locked(&mut journal.state.lock())?;
        Ok((journal, rec))
    }

    /// Journal bytes one transaction takes at most: its records, padded to a block, and the
    /// block of its APPLIED or ABORT record.
    const fn tx_space(writes: usize, bytes: u64) -> u64 {
        let begin = RECORD_HEADER as u64 + 8 + 16 * writes as u64 + 8;
        let each = (RECORD_HEADER as u64 + 8 + 8) * writes as u64 + bytes;
        let result = RECORD_HEADER as u64 + RESULT_BYTES as u64 + 8;
        let block = MICROTX_JOURNAL_BLOCK_BYTES as u64;
        (begin + each + result).div_ceil(block) * block + block
    }

    /// A fused operation's turn, held while it reads the blocks it merges its bytes into
    /// and runs its transaction: no other fused operation of the namespace changes them
    /// meanwhile. Turns are given in the order asked; waiting for one holds no thread.
    pub async fn turn(&self) -> Turn {
        Turn { _serial: self.serial.clone().lock_owned().await }
    }

    /// Admits one more fused command to wait for a turn, while fewer than `max` are
    /// admitted (waiting or running); None beyond. Admitted until the [`Admitted`] drops.
    pub fn admit(self: &Arc<Self>, max: usize) -> Option<Admitted> {
        self.admitted.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < max).then_some(n + 1)).ok()?;
        Some(Admitted(self.clone()))
    }

    /// Fused commands admitted now: waiting for their turn or running.
    pub fn admitted(&self) -> usize {
        self.admitted.load(Ordering::SeqCst)
    }

    /// The outcome of a transaction id, while the journal holds it (the newest
    /// MICROTX_OUTCOMES_MAX); None also while it runs. Never waits for a transaction's I/O.
    pub fn outcome(&self, txid: u64) -> Option<Outcome> {
        self.outcomes.lock().iter().rev().find(|(id, _)| *id == txid).map(|(_, o)| o.clone())
    }

    /// Runs one transaction: log, flush the journal, write in place, flush those blocks,
    /// log APPLIED, flush the journal. Returns its result ([`result_of`] its writes) once
    /// all of that is durable.
    pub fn run(&self, data: &dyn Backend, tx: &Tx) -> Result<[u8; RESULT_BYTES], JournalError> {
        // Checked first: a refused transaction's writes may not even have an end.
        self.check(data, tx)?;
        self.run_with(data, tx, result_of(&tx.writes))
    }

    /// [`Journal::run`] with the result the fused operation computed (its checksum
    /// micro-operation), logged in its RESULT record and kept as its outcome.
    pub fn run_with(&self, data: &dyn Backend, tx: &Tx, result: [u8; RESULT_BYTES]) -> Result<[u8; RESULT_BYTES], JournalError> {
        self.run_group(data, &[(tx, result)]).map(|()| result)
    }

    /// Runs a group of transactions as one (group commit): the records of all of them in one
    /// journal write and one flush, all of them in place and one flush of their blocks, the
    /// APPLIED records of all of them in one write and one flush. Three flushes for the
    /// group instead of three for each member. A later member may write blocks an earlier
    /// one writes (its images then hold the earlier one's bytes): in place and in replay
    /// they are written in the group's order. Every member is checked ([`Journal::admissible`])
    /// before anything is written, and the group succeeds or fails as one: replay finishes
    /// a prefix of it (those wholly logged when the power failed), never a later member
    /// without the earlier ones.
    pub fn run_group(&self, data: &dyn Backend, group: &[(&Tx, [u8; RESULT_BYTES])]) -> Result<(), JournalError> {
        if group.is_empty() {
            return Ok(());
        }
        let mut ids = Vec::with_capacity(group.len());
        for (tx, _) in group {
            self.admissible(data, tx, &ids)?;
            ids.push(tx.txid);
        }
        let mut s = self.state.lock();
        self.finish_locked(&mut s, data)?;
        // Finishing noted outcomes: the ids are checked again against them.
        for (tx, _) in group {
            if self.known(tx.txid) {
                return Err(JournalError::TxidInUse(tx.txid));
            }
        }
        let r = self.group_locked(&mut s, data, group);
        match &r {
            Ok(()) => {
                group.iter().for_each(|(tx, result)| self.note(tx.txid, Outcome::Committed(*result)));
                self.committed.0.fetch_add(1, Ordering::Relaxed);
                self.committed.1.fetch_add(group.len() as u64, Ordering::Relaxed);
            }
            // In doubt until it is finished: no outcome yet, as while it runs.
            Err(JournalError::InPlace { .. }) => {}
            // A journal write or flush failed: known as failed (drop_failed noted them).
            Err(JournalError::Io { .. }) => {
                group.iter().filter(|(tx, _)| !self.known(tx.txid)).for_each(|(tx, _)| self.note(tx.txid, Outcome::Failed))
            }
            // Not logged (refused, or an earlier transaction unfinished): their ids stay
            // free for their retries.
            Err(_) => {}
        }
        r
    }

    /// Whether `tx` may join a group whose earlier members are `earlier`: its size, its
    /// writes (whole blocks inside the namespace `data`), its id (nonzero, not one whose
    /// outcome the journal holds, not an earlier member's). A fused operation checks this
    /// before its images enter the group, so that a later member never holds bytes of a
    /// member the journal refuses.
    pub fn admissible(&self, data: &dyn Backend, tx: &Tx, earlier: &[u64]) -> Result<(), JournalError> {
        self.check(data, tx)?;
        if tx.txid == 0 || earlier.contains(&tx.txid) || self.known(tx.txid) {
            return Err(JournalError::TxidInUse(tx.txid));
        }
        Ok(())
    }

    /// Journal bytes a group of at most this many bytes may take: the log a generation
    /// holds, so that a group always fits after a checkpoint. The fused commands' groups
    /// stop there ([`crate::limits::MICROTX_GROUP_BYTES_MAX`] too).
    pub fn group_room(&self) -> u64 {
        self.log.size() - LOG_START
    }

    /// Journal bytes a transaction of `writes` writes of `bytes` bytes takes at most, in a
    /// group ([`Journal::group_room`]).
    pub fn space(writes: usize, bytes: u64) -> u64 {
        Self::tx_space(writes, bytes)
    }

    fn known(&self, txid: u64) -> bool {
        self.outcomes.lock().iter().any(|(id, _)| *id == txid)
    }

    fn note(&self, txid: u64, outcome: Outcome) {
        note(&mut self.outcomes.lock(), txid, outcome);
    }

    fn check(&self, data: &dyn Backend, tx: &Tx) -> Result<(), JournalError> {
        let (txid, size, bs) = (tx.txid, data.size(), self.block_bytes);
        if tx.writes.len() > MICROTX_TX_WRITES_MAX || tx.bytes() > MICROTX_TX_BYTES_MAX as u64 {
            let what = format!(
                "{} writes of {} bytes: at most {MICROTX_TX_WRITES_MAX} writes of {MICROTX_TX_BYTES_MAX} bytes",
                tx.writes.len(),
                tx.bytes()
            );
            return Err(JournalError::TooLarge { txid, what });
        }
        for (offset, d) in &tx.writes {
            let len = d.len() as u64;
            let inside = offset.checked_add(len).is_some_and(|end| end <= size);
            if !inside || len == 0 || !offset.is_multiple_of(bs) || !len.is_multiple_of(bs) {
                return Err(JournalError::OutOfRange { txid, offset: *offset, len, size });
            }
        }
        Ok(())
    }

    fn group_locked(&self, s: &mut State, data: &dyn Backend, group: &[(&Tx, [u8; RESULT_BYTES])]) -> Result<(), JournalError> {
        let Some((first, _)) = group.first() else { return Ok(()) };
        let space: u64 = group.iter().map(|(tx, _)| Self::tx_space(tx.writes.len(), tx.bytes())).sum();
        if space > self.group_room() {
            let what =
                format!("a group of {} transactions needs {space} journal bytes, the journal holds {}", group.len(), self.group_room());
            return Err(JournalError::TooLarge { txid: first.txid, what });
        }
        if s.head + space > self.log.size() {
            // Full: every transaction of this generation is applied (durable in the
            // namespace before its APPLIED record), so a new generation forgets them. A
            // checkpoint that failed leaves records of a generation replay would not read:
            // the journal takes nothing until it is written (nothing to fence: every
            // transaction replay would find is applied).
            if let Err(e) = self.checkpoint_locked(s) {
                let why = format!("checkpoint of the full journal: {e}");
                let failed = !matches!(e, JournalError::GenerationExhausted(..));
                s.unfinished = Some(Unfinished {
                    txids: Vec::new(),
                    apply: Vec::new(),
                    outcomes: Vec::new(),
                    checkpoint_failed: failed,
                    why: why.clone(),
                });
                return Err(JournalError::Unfinished(why));
            }
        }
        let g = s.generation;
        let mut buf = Vec::with_capacity(space as usize);
        let mut lsn = s.lsn;
        let mut next = || {
            lsn += 1;
            lsn - 1
        };
        for (tx, result) in group {
            let mut begin = Vec::with_capacity(8 + 16 * tx.writes.len());
            begin.extend_from_slice(&(tx.writes.len() as u32).to_le_bytes());
            begin.extend_from_slice(&[0; 4]);
            for (off, d) in &tx.writes {
                begin.extend_from_slice(&off.to_le_bytes());
                begin.extend_from_slice(&(d.len() as u64).to_le_bytes());
            }
            put_record(&mut buf, Kind::Begin, 0, tx.op, (g, next()), tx.txid, &[&begin]);
            for (i, (off, d)) in tx.writes.iter().enumerate() {
                put_record(&mut buf, Kind::Write, i as u8, 0, (g, next()), tx.txid, &[&off.to_le_bytes(), d]);
            }
            put_record(&mut buf, Kind::Result, 0, 0, (g, next()), tx.txid, &[result]);
            // Each transaction starts at a block boundary.
            buf.resize(round_up(buf.len() as u64, MICROTX_JOURNAL_BLOCK_BYTES as u64) as usize, 0);
        }

        // 1. Logged and durable: from here recovery finishes the group.
        let logged = self.log.write_at(&buf, s.head).and_then(|()| self.log.flush());
        s.head += buf.len() as u64;
        s.lsn = lsn;
        if let Err(e) = logged {
            // Its records may or may not be durable: a new generation drops them, so
            // recovery cannot finish what the hosts saw fail.
            return Err(self.drop_failed(s, e, group, "logging"));
        }
        // 2. In place in the group's order, durable before it is marked applied (recovery
        // then never writes it again over a later write of those blocks).
        let writes = || group.iter().flat_map(|(tx, _)| tx.writes.iter());
        let in_place = match self.bug {
            Some(FlushBug::GroupInPlaceReversed) => {
                group.iter().rev().flat_map(|(tx, _)| tx.writes.iter()).try_for_each(|(off, d)| data.write_at(d, *off))
            }
            _ => writes().try_for_each(|(off, d)| data.write_at(d, *off)),
        };
        // One flush for the group: its range when it wrote one, else the namespace's (a
        // file's flush_range is its fdatasync anyway, and one per write cost a group as
        // many flushes as members).
        let applied = in_place.and_then(|()| match (self.bug, writes().nth(1)) {
            (Some(FlushBug::DataNotFlushedBeforeApplied), _) => Ok(()),
            (_, None) => writes().try_for_each(|(off, d)| data.flush_range(*off, d.len() as u64)),
            (_, Some(_)) => data.flush(),
        });
        if let Err(source) = applied {
            // Some of its writes may be in place, others not: it stays logged without its
            // APPLIED records, so that it is written whole again (roll forward) by `finish`
            // or the next start. Until then its blocks are fenced (fenced before its
            // commands complete: a write a host sends after seeing the failure meets
            // the fence) and no other transaction runs: one of them, or finishing this
            // group, would change blocks the other relies on.
            let txid = first.txid;
            let why = format!("transaction {txid}{}: writing in place failed: {source}", others(group.len()));
            warn!(journal = %self.log.describe(), txid, group = group.len(), error = %source, "MicroTx transaction's in-place write failed: its blocks are fenced until it is finished");
            self.fence.raise(writes());
            s.unfinished = Some(Unfinished {
                txids: group.iter().map(|(tx, _)| tx.txid).collect(),
                apply: writes().cloned().collect(),
                outcomes: group.iter().map(|(tx, r)| (tx.txid, Outcome::Committed(*r))).collect(),
                checkpoint_failed: false,
                why,
            });
            return Err(JournalError::InPlace { txid, group: group.len(), source });
        }
        // 3. APPLIED, one record for each member, back to back in one block write.
        let mut mark = Vec::with_capacity(MICROTX_JOURNAL_BLOCK_BYTES);
        for (tx, _) in group {
            put_record(&mut mark, Kind::Applied, 0, 0, (g, s.lsn), tx.txid, &[]);
            s.lsn += 1;
        }
        mark.resize(round_up(mark.len() as u64, MICROTX_JOURNAL_BLOCK_BYTES as u64) as usize, 0);
        let marked = self.log.write_at(&mark, s.head).and_then(|()| self.log.flush());
        s.head += mark.len() as u64;
        if let Err(e) = marked {
            return Err(self.drop_failed(s, e, group, "marking"));
        }
        Ok(())
    }

    /// After a journal write or flush failed: a checkpoint starts a generation without the
    /// records in doubt. When that fails too, replay may still find the group's records
    /// and write it in place: it is unfinished, its blocks fenced, until the checkpoint is
    /// written.
    fn drop_failed(&self, s: &mut State, e: io::Error, group: &[(&Tx, [u8; RESULT_BYTES])], what: &str) -> JournalError {
        let txid = group.first().map_or(0, |(tx, _)| tx.txid);
        let also = others(group.len());
        let err = JournalError::Io { what: format!("transaction {txid}{also}: {what} it in the journal"), source: e };
        // Known as failed from the checkpoint on.
        group.iter().for_each(|(tx, _)| self.note(tx.txid, Outcome::Failed));
        if let Err(c) = self.checkpoint_locked(s) {
            warn!(journal = %self.log.describe(), txid, error = %c, "MicroTx checkpoint failed after a failed journal write: the transaction's blocks are fenced until it is written");
            self.fence.raise(group.iter().flat_map(|(tx, _)| tx.writes.iter()));
            let failed = !matches!(c, JournalError::GenerationExhausted(..));
            let why = format!("transaction {txid}{also}: {what} it and the checkpoint after failed: {c}");
            let txids = group.iter().map(|(tx, _)| tx.txid).collect();
            s.unfinished = Some(Unfinished { txids, apply: Vec::new(), outcomes: Vec::new(), checkpoint_failed: failed, why });
        }
        err
    }

    /// Starts a new generation: the outcomes into the next checkpoint slot, flushed.
    fn checkpoint_locked(&self, s: &mut State) -> Result<(), JournalError> {
        let g = s.generation.checked_add(1).ok_or_else(|| JournalError::GenerationExhausted(self.log.describe(), s.generation))?;
        // Whatever happens, the old generation's log is not appended to again.
        s.generation = g;
        s.head = LOG_START;
        s.lsn = 0;
        self.write_checkpoint(g)
    }

    /// Writes the checkpoint of generation `g` into its slot, flushed.
    fn write_checkpoint(&self, g: u64) -> Result<(), JournalError> {
        let slot = (g % 2) * MICROTX_CHECKPOINT_BYTES as u64;
        let b = encode_checkpoint(g, &self.outcomes.lock());
        self.log
            .write_at(&b, slot)
            .and_then(|()| self.log.flush())
            .map_err(io_err(format!("writing checkpoint {g} of journal {}", self.log.describe())))
    }

    /// Finishes the unfinished transaction, if there is one: its blocks written again in
    /// place and flushed (when it is rolled forward), then a checkpoint, so that replay
    /// never writes it again; then its fence goes. Ok(true): one was finished; Ok(false):
    /// there was none. A failure leaves it unfinished, to be tried again.
    pub fn finish(&self, data: &dyn Backend) -> Result<bool, JournalError> {
        let mut s = self.state.lock();
        let had = s.unfinished.is_some();
        self.finish_locked(&mut s, data).map(|()| had)
    }

    fn finish_locked(&self, s: &mut State, data: &dyn Backend) -> Result<(), JournalError> {
        let Some(mut u) = s.unfinished.take() else { return Ok(()) };
        let applied = u.apply.iter().try_for_each(|(off, d)| data.write_at(d, *off).and_then(|()| data.flush_range(*off, d.len() as u64)));
        if let Err(e) = applied {
            u.why = format!("{}: writing in place failed again: {e}", u.who());
            let why = u.why.clone();
            s.unfinished = Some(u);
            return Err(JournalError::Unfinished(why));
        }
        // Whole and durable in place: their outcomes go into the checkpoint.
        for (txid, o) in std::mem::take(&mut u.outcomes) {
            self.note(txid, o);
        }
        let written = match u.checkpoint_failed {
            true => self.write_checkpoint(s.generation),
            false => self.checkpoint_locked(s),
        };
        if let Err(e) = written {
            u.checkpoint_failed |= !matches!(e, JournalError::GenerationExhausted(..));
            u.why = format!("{}: its checkpoint failed: {e}", u.who());
            let why = u.why.clone();
            s.unfinished = Some(u);
            return Err(JournalError::Unfinished(why));
        }
        self.fence.lower();
        info!(journal = %self.log.describe(), txids = ?u.txids, "MicroTx journal finished its unfinished transaction: its blocks serve again");
        Ok(())
    }

    /// The blocks of its unfinished transaction, which no I/O may reach meanwhile.
    pub fn fence(&self) -> &Arc<Fence> {
        &self.fence
    }

    /// Why the journal holds an unfinished transaction, if it does.
    pub fn unfinished(&self) -> Option<String> {
        self.state.lock().unfinished.as_ref().map(|u| u.why.clone())
    }

    /// Tries [`Journal::finish`] in the background (in a turn of the journal, on the
    /// blocking pool), unless a try is under way: called when fenced I/O is refused, so
    /// that a fence lifts as soon as the namespace's device writes again, without a
    /// restart. Outside a runtime it does nothing (the next transaction tries).
    pub fn kick(self: &Arc<Self>, data: Arc<dyn Backend>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        if self.fence.retrying.swap(true, Ordering::AcqRel) {
            return;
        }
        let journal = self.clone();
        rt.spawn(async move {
            let turn = journal.turn().await;
            let j = journal.clone();
            let r = tokio::task::spawn_blocking(move || {
                let _turn = turn;
                j.finish(&*data)
            })
            .await;
            if let Ok(Err(e)) = r {
                warn!(journal = %journal.log.describe(), error = %e, "MicroTx journal could not finish its transaction yet");
            }
            journal.fence.retrying.store(false, Ordering::Release);
        });
    }

    /// Groups committed since start-up and the transactions in them: their ratio is the
    /// flushes group commit saves (metrics `nearstore_microtx_groups_total`,
    /// `nearstore_microtx_transactions_total`).
    pub fn committed(&self) -> (u64, u64) {
        (self.committed.0.load(Ordering::Relaxed), self.committed.1.load(Ordering::Relaxed))
    }

    /// FUSED WRITEs waiting for the journal's next group.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// The generation the journal writes (tests).
    pub fn generation(&self) -> u64 {
        self.state.lock().generation
    }
}

/// A fused operation's turn on its namespace's journal ([`Journal::turn`]).
pub struct Turn {
    _serial: tokio::sync::OwnedMutexGuard<()>,
}

/// A fused command admitted to wait for its turn ([`Journal::admit`]), until dropped.
pub struct Admitted(Arc<Journal>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.admitted.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::backend::MemoryBackend;

    const JOURNAL: u64 = 2 << 20;
    const DATA: u64 = 1 << 20;
    const BLOCK: u64 = 512;

    fn tx(txid: u64, writes: &[(u64, usize, u8)]) -> Tx {
        Tx { txid, op: 1, writes: writes.iter().map(|&(off, len, v)| (off, vec![v; len])).collect() }
    }

    fn mem(size: u64) -> Arc<MemoryBackend> {
        Arc::new(MemoryBackend::new(size))
    }

    fn read(b: &dyn Backend, off: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        b.read_at(&mut v, off).unwrap();
        v
    }

    /// A transaction cut after each of its journal and data operations in turn, then
    /// replayed: it is whole (committed, with its result) or absent (rolled back), never
    /// torn, and an earlier one stays whole.
    #[test]
    fn a_transaction_cut_at_any_point_is_whole_or_absent() {
        let t = tx(7, &[(4096, 8192, 0xAB), (65536, 4096, 0xCD)]);
        // log, flush, 2 writes, their flush, mark, flush: 7 operations on the two backends.
        for cut in 0..=7 {
            let (log, data) = (mem(JOURNAL), mem(DATA));
            let first = tx(3, &[(0, 4096, 0x11)]);
            Journal::open(log.clone(), &*data, BLOCK).unwrap().0.run(&*data, &first).unwrap();
            // The cut counts operations on both backends through one budget, from the run.
            let clog = Faulty::cut(&log);
            let cdata = clog.beside(&data);
            let (j, _) = Journal::open(clog.clone(), &*data, BLOCK).unwrap();
            clog.fail(cut, usize::MAX);
            let r = j.run(&*cdata, &t);
            assert_eq!(r.is_ok(), cut == 7, "cut {cut}: {r:?}");
            let (j, rec) = Journal::open(log.clone(), &*data, BLOCK).unwrap();
            assert_eq!(read(&*data, 0, 4096), vec![0x11; 4096], "cut {cut}: the earlier one");
            let a = read(&*data, 4096, 8192);
            let b = read(&*data, 65536, 4096);
            match j.outcome(7) {
                Some(Outcome::Committed(res)) => {
                    assert_eq!(res, result_of(&t.writes), "cut {cut}");
                    assert_eq!((a, b), (vec![0xAB; 8192], vec![0xCD; 4096]), "cut {cut}");
                }
                Some(Outcome::RolledBack) | None => {
                    assert_eq!((a, b), (vec![0; 8192], vec![0; 4096]), "cut {cut}: {rec:?}");
                }
                Some(Outcome::Failed) => panic!("cut {cut}: a crash is not a failure"),
            }
            // Once logged and flushed (operations 1 and 2) it is finished, whatever follows;
            // not logged, it is not. Cut at the flush, the process died with the records
            // written: either outcome.
            let committed = matches!(j.outcome(7), Some(Outcome::Committed(_)));
            assert!(cut == 1 || committed == (cut >= 2), "cut {cut}: {rec:?}");
        }
    }

    /// Logs a transaction's records by hand, without applying it: what a crash between the
    /// journal's flush and the in-place writes leaves. `keep` says which of its records
    /// (BEGIN, WRITE 0.., RESULT) reach the journal; the first lost one ends the log.
    fn log_only(log: &dyn Backend, generation: u64, t: &Tx, keep: usize, garbage_after: bool) {
        let mut buf = Vec::new();
        let mut begin = (t.writes.len() as u32).to_le_bytes().to_vec();
        begin.extend_from_slice(&[0; 4]);
        for (off, d) in &t.writes {
            begin.extend_from_slice(&off.to_le_bytes());
            begin.extend_from_slice(&(d.len() as u64).to_le_bytes());
        }
        let mut n = 0u64;
        put_record(&mut buf, Kind::Begin, 0, t.op, (generation, 0), t.txid, &[&begin]);
        for (i, (off, d)) in t.writes.iter().enumerate() {
            n += 1;
            put_record(&mut buf, Kind::Write, i as u8, 0, (generation, n), t.txid, &[&off.to_le_bytes(), d]);
        }
        put_record(&mut buf, Kind::Result, 0, 0, (generation, n + 1), t.txid, &[&result_of(&t.writes)]);
        // Cut after `keep` records: find where record `keep` starts.
        let mut at = 0;
        for i in 0..keep {
            at = parse_record(&buf, at, generation, i as u64).expect("record").1;
        }
        buf.truncate(at);
        if garbage_after {
            // A torn record: its header claims more bytes than were written.
            let mut torn = Vec::new();
            put_record(&mut torn, Kind::Write, 0, 0, (generation, keep as u64), t.txid, &[&[0x5A; 600]]);
            torn.truncate(300);
            buf.extend_from_slice(&torn);
        }
        buf.resize(round_up(buf.len() as u64 + 1, 4096) as usize, 0);
        log.write_at(&buf, LOG_START).unwrap();
    }

    /// What replay does with each prefix of a logged, unapplied transaction: finished from
    /// its logged writes and result, or rolled back. Without its RESULT record (written
    /// and flushed with its WRITEs, before anything in place) it was never applied, and
    /// the result a fused operation computed is not recomputed from block images.
    #[test]
    fn replay_finishes_from_logged_results_or_rolls_back() {
        let t = tx(9, &[(8192, 4096, 0x77), (16384, 8192, 0x88)]);
        // (records kept, a torn record after them, committed)
        let cases = [
            (0, false, None),
            (0, true, None),
            (1, false, Some(false)),
            (1, true, Some(false)),
            (2, false, Some(false)),
            (2, true, Some(false)),
            (3, false, Some(false)),
            (3, true, Some(false)),
            (4, false, Some(true)),
        ];
        for (keep, torn, committed) in cases {
            let (log, data) = (mem(JOURNAL), mem(DATA));
            let (j, _) = Journal::open(log.clone(), &*data, BLOCK).unwrap();
            log_only(&*log, j.generation(), &t, keep, torn);
            let (j, rec) = Journal::open(log.clone(), &*data, BLOCK).unwrap();
            let case = format!("keep {keep} torn {torn}: {rec:?}");
            assert_eq!(rec.torn_tail, torn, "{case}");
            match committed {
                None => assert_eq!(j.outcome(9), None, "{case}"),
                Some(false) => assert_eq!(j.outcome(9), Some(Outcome::RolledBack), "{case}"),
                Some(true) => assert_eq!(j.outcome(9), Some(Outcome::Committed(result_of(&t.writes))), "{case}"),
            }
            let whole = committed == Some(true);
            assert_eq!(read(&*data, 8192, 4096), vec![if whole { 0x77 } else { 0 }; 4096], "{case}");
            assert_eq!(read(&*data, 16384, 8192), vec![if whole { 0x88 } else { 0 }; 8192], "{case}");
            assert_eq!(rec.finished.contains(&9), whole, "{case}");
            // Replayed once: a second start finds a new generation with nothing to do.
            let (_, again) = Journal::open(log.clone(), &*data, BLOCK).unwrap();
            assert!(again.finished.is_empty() && again.rolled_back.is_empty(), "{case}: {again:?}");
        }
    }

    /// A full journal starts a new generation (checkpoint) and goes on; everything stays
    /// whole and every outcome known across restarts, up to MICROTX_OUTCOMES_MAX.
    #[test]
    fn a_full_journal_checkpoints_and_goes_on() {
        let (log, data) = (mem(JOURNAL), mem(DATA));
        let (j, _) = Journal::open(log.clone(), &*data, BLOCK).unwrap();
        let first = j.generation();
        let n = 300u64;
        for i in 1..=n {
            j.run(&*data, &tx(i, &[((i % 8) * 65536, 65536, i as u8)])).unwrap();
        }
        assert!(j.generation() > first + 5, "{} checkpoints", j.generation() - first);
        let (j, rec) = Journal::open(log.clone(), &*data, BLOCK).unwrap();
        assert!(rec.finished.is_empty() && rec.rolled_back.is_empty(), "{rec:?}");
        for i in n - 7..=n {
            assert_eq!(read(&*data, (i % 8) * 65536, 65536), vec![i as u8; 65536], "tx {i}");
        }
        for i in 1..=n {
            let want = (i > n - MICROTX_OUTCOMES_MAX as u64)
                .then(|| Outcome::Committed(result_of(&tx(i, &[((i % 8) * 65536, 65536, i as u8)]).writes)));
            assert_eq!(j.outcome(i), want, "tx {i}");
        }
    }

    /// A corrupt checkpoint slot is told by its checksum; the other one is used, and the
    /// next generation is beyond both. Both corrupt: the journal is not replayed.
    #[test]
    fn corrupt_checkpoints_are_detected() {
        // (slots corrupted, opens)
        let cases = [(vec![0], true), (vec![1], true), (vec![0, 1], false)];
        for (slots, opens) in cases {
            let (log, data) = (mem(JOURNAL), mem(DATA));
            let (j, _) = Journal::open(log.clone(), &*data, BLOCK).unwrap();
            j.run(&*data, &tx(5, &[(0, 4096, 0x42)])).unwrap();
            // Two more generations: both slots written.
            drop(j);
            Journal::open(log.clone(), &*data, BLOCK).unwrap();
            let before = Journal::open(log.clone(), &*data, BLOCK).unwrap().0.generation();
            for s in &slots {
                // One bit in its outcomes table.
                let at = *s as u64 * MICROTX_CHECKPOINT_BYTES as u64 + CHECKPOINT_HEADER as u64;
                let mut b = read(&*log, at, 1);
                b[0] ^= 0x10;
                log.write_at(&b, at).unwrap();
            }
            match Journal::open(log.clone(), &*data, BLOCK) {
                Ok((j, rec)) => {
                    assert!(opens && rec.checkpoint_corrupt, "{slots:?}: {rec:?}");
                    assert!(j.generation() > before, "{slots:?}");
                    assert_eq!(j.outcome(5), Some(Outcome::Committed(result_of(&tx(5, &[(0, 4096, 0x42)]).writes))), "{slots:?}");
                }
                Err(e) => assert!(!opens && matches!(e, JournalError::CheckpointsCorrupt(_)), "{slots:?}: {e}"),
            }
        }
    }

    /// What `run` refuses before it logs anything.
    #[test]
    fn refusals() {
        let (log, data) = (mem(JOURNAL), mem(DATA));
        let (j, _) = Journal::open(log, &*data, BLOCK).unwrap();
        j.run(&*data, &tx(1, &[(0, 4096, 1)])).unwrap();
        let many: Vec<(u64, usize, u8)> = (0..=MICROTX_TX_WRITES_MAX as u64).map(|i| (i * 4096, 4096, 1)).collect();
        // (what, transaction, accepted)
        let cases = [
            ("txid 0", tx(0, &[(0, 4096, 1)]), "TxidInUse"),
            ("txid known", tx(1, &[(0, 4096, 1)]), "TxidInUse"),
            ("past the end", tx(2, &[(DATA - 4096, 8192, 1)]), "OutOfRange"),
            ("offset overflows", Tx { txid: 2, op: 1, writes: vec![(u64::MAX - 4095, vec![1; 4096])] }, "OutOfRange"),
            ("not whole blocks", tx(2, &[(0, 100, 1)]), "OutOfRange"),
            ("unaligned", tx(2, &[(256, 4096, 1)]), "OutOfRange"),
            ("empty write", tx(2, &[(0, 0, 1)]), "OutOfRange"),
            ("too many writes", tx(2, &many), "TooLarge"),
            ("too many bytes", tx(2, &[(0, MICROTX_TX_BYTES_MAX + 4096, 1)]), "TooLarge"),
        ];
        for (what, t, want) in cases {
            let e = j.run(&*data, &t).expect_err(what);
            assert!(format!("{e:?}").starts_with(want), "{what}: {e:?}");
        }
        assert_eq!(read(&*data, 4096, 4096), vec![0; 4096]);
    }

    /// A journal that fails a write or flush: the transaction fails, is not finished at the
    /// next start, and the journal goes on in a new generation. When the checkpoint that
    /// starts it fails too, replay could still find the transaction's records: its blocks
    /// are fenced until the checkpoint is written, before the next transaction.
    #[test]
    fn a_failed_journal_flush_fails_the_transaction_and_replay_does_not_finish_it() {
        // (journal operations failing, counted from the run: its records 0, their flush 1,
        // APPLIED 2, its flush 3, the checkpoint after a failure next; fenced)
        let cases = [(0, 1, false), (1, 2, false), (1, 3, true), (2, 4, true), (3, 5, true)];
        for (from, to, fenced) in cases {
            let what = format!("failing {from}..{to}");
            let (log, data) = (mem(JOURNAL), mem(DATA));
            Journal::open(log.clone(), &*data, BLOCK).unwrap();
            let flaky = Faulty::cut(&log);
            let (j, _) = Journal::open(flaky.clone(), &*data, BLOCK).unwrap();
            flaky.fail(from, to);
            assert!(matches!(j.run(&*data, &tx(4, &[(0, 4096, 9)])), Err(JournalError::Io { .. })), "{what}");
            assert_eq!(j.outcome(4), Some(Outcome::Failed), "{what}");
            assert_eq!(j.fence().holds(0, 4096), fenced, "{what}");
            assert!(!j.fence().holds(4096, 4096), "{what}");
            j.run(&*data, &tx(5, &[(4096, 4096, 10)])).unwrap();
            assert!(!j.fence().is_up(), "{what}");
            // Marked or not, it is not written at the next start: a write after it stays.
            data.write_at(&[11; 4096], 0).unwrap();
            let (j, rec) = Journal::open(log.clone(), &*data, BLOCK).unwrap();
            assert!(rec.finished.is_empty(), "{what}: {rec:?}");
            assert_eq!(read(&*data, 0, 4096), vec![11; 4096], "{what}");
            assert_eq!(read(&*data, 4096, 4096), vec![10; 4096], "{what}");
            assert_eq!(j.outcome(4), Some(Outcome::Failed), "{what}");
        }
    }

    /// An in-place write or flush that fails (the device's error, the process lives on)
    /// and goes on failing: the transaction is logged, so it is neither failed nor rolled
    /// back but finished whole from the log at the next start; until then its blocks are
    /// fenced and the journal takes no other transaction (no later one lands on blocks the
    /// replay writes again). Before, a failed second write was marked ABORT: its first
    /// write stayed in place, the second not, and replay left it torn.
    #[test]
    fn a_failed_in_place_write_is_finished_from_the_log_at_the_next_start() {
        let t = tx(7, &[(4096, 8192, 0xAB), (65536, 4096, 0xCD)]);
        // (operation failing, counted from the run: log 0, flush 1, writes 2 and 3, their
        // one flush 4)
        let cases = [(2, "first write"), (3, "second write"), (4, "the flush")];
        for (op, what) in cases {
            let (log, data) = (mem(JOURNAL), mem(DATA));
            let clog = Faulty::cut(&log);
            let cdata = clog.beside(&data);
            let (j, _) = Journal::open(clog.clone(), &*data, BLOCK).unwrap();
            assert!(!j.fence().is_up());
            // From this operation on the storage fails, the journal's too.
            clog.fail(op, usize::MAX);
            let r = j.run(&*cdata, &t);
            assert!(matches!(r, Err(JournalError::InPlace { txid: 7, .. })), "{what}: {r:?}");
            assert_eq!(j.outcome(7), None, "{what}: in doubt until it is finished");
            // Its blocks, and only they, are fenced.
            let fence = j.fence();
            assert!(fence.holds(4096, 512) && fence.holds(12288 - 512, 4096) && fence.holds(65536 + 4095, 1), "{what}");
            assert!(!fence.holds(0, 4096) && !fence.holds(12288, 4096) && !fence.holds(69632, 4096), "{what}");
            let next = j.run(&*cdata, &tx(8, &[(0, 4096, 1)]));
            assert!(matches!(next, Err(JournalError::Unfinished(_))), "{what}: {next:?}");
            assert_eq!(j.outcome(8), None, "{what}: the refused one's id stays free");
            assert!(matches!(j.finish(&*cdata), Err(JournalError::Unfinished(_))), "{what}");
            assert!(j.fence().is_up(), "{what}");
            assert_eq!(read(&*data, 0, 4096), vec![0; 4096], "{what}: the refused one wrote nothing");
            let (j, rec) = Journal::open(log.clone(), &*data, BLOCK).unwrap();
            assert_eq!(rec.finished, vec![7], "{what}: {rec:?}");
            assert_eq!(j.outcome(7), Some(Outcome::Committed(result_of(&t.writes))), "{what}");
            assert_eq!((read(&*data, 4096, 8192), read(&*data, 65536, 4096)), (vec![0xAB; 8192], vec![0xCD; 4096]), "{what}");
            assert!(!j.fence().is_up(), "{what}");
            j.run(&*data, &tx(8, &[(0, 4096, 1)])).unwrap();
        }
    }

    /// An in-place write or flush that fails once: the transaction is finished in place
    /// as soon as the storage writes again (`finish`, or the next transaction before it
    /// runs), without a restart; its fence lifts, its outcome is committed, and the next
    /// start does not write it again over what was written after it. Before, the journal
    /// stayed closed until a restart, whose replay wrote it over the plain writes
    /// acknowledged in the meantime.
    #[test]
    fn a_failed_in_place_write_is_finished_in_place_once_the_storage_writes_again() {
        let t = tx(7, &[(4096, 8192, 0xAB), (65536, 4096, 0xCD)]);
        // (operation failing, counted from the run, as above; finished by the next
        // transaction, else by `finish`)
        let cases = [(2, false), (3, true), (4, false), (4, true)];
        for (op, by_next) in cases {
            let what = format!("op {op}, by the next transaction {by_next}");
            let (log, data) = (mem(JOURNAL), mem(DATA));
            let clog = Faulty::cut(&log);
            let cdata = clog.beside(&data);
            let (j, _) = Journal::open(clog.clone(), &*data, BLOCK).unwrap();
            clog.fail(op, op + 1);
            assert!(matches!(j.run(&*cdata, &t), Err(JournalError::InPlace { txid: 7, .. })), "{what}");
            assert!(j.fence().holds(65536, 4096), "{what}");
            if by_next {
                j.run(&*cdata, &tx(8, &[(0, 4096, 1)])).unwrap();
                assert_eq!(read(&*data, 0, 4096), vec![1; 4096], "{what}");
            } else {
                assert!(j.finish(&*cdata).unwrap(), "{what}: one finished");
                assert!(!j.finish(&*cdata).unwrap(), "{what}: none left");
            }
            assert!(!j.fence().is_up(), "{what}");
            assert_eq!(j.outcome(7), Some(Outcome::Committed(result_of(&t.writes))), "{what}");
            assert_eq!((read(&*data, 4096, 8192), read(&*data, 65536, 4096)), (vec![0xAB; 8192], vec![0xCD; 4096]), "{what}");
            // A plain write of its blocks, acknowledged once the fence lifted.
            data.write_at(&[0x5A; 4096], 65536).unwrap();
            let (j, rec) = Journal::open(log.clone(), &*data, BLOCK).unwrap();
            assert!(rec.finished.is_empty(), "{what}: written again at the start: {rec:?}");
            assert_eq!(read(&*data, 65536, 4096), vec![0x5A; 4096], "{what}: the later write is lost");
            assert_eq!(j.outcome(7), Some(Outcome::Committed(result_of(&t.writes))), "{what}");
        }
    }

    /// The checkpoint that finishes a transaction fails: it stays unfinished and fenced
    /// (a start in between replays it from the log), and the next try writes the same
    /// generation into the same slot, never the next one, which holds the only checkpoint
    /// replay can use when the failed write tore its own.
    #[test]
    fn a_failed_finishing_checkpoint_is_written_again_in_its_own_slot() {
        let t = tx(7, &[(4096, 4096, 0xAB)]);
        let (log, data) = (mem(JOURNAL), mem(DATA));
        let clog = Faulty::cut(&log);
        let cdata = clog.beside(&data);
        let (j, _) = Journal::open(clog.clone(), &*data, BLOCK).unwrap();
        let g = j.generation();
        // The in-place write (op 2) fails.
        clog.fail(2, 3);
        assert!(matches!(j.run(&*cdata, &t), Err(JournalError::InPlace { .. })));
        // Finishing: write in place (0), its flush (1), the checkpoint (2) fails.
        clog.fail(2, 3);
        assert!(matches!(j.finish(&*cdata), Err(JournalError::Unfinished(_))));
        assert!(j.fence().holds(4096, 4096));
        assert_eq!(j.generation(), g + 1);
        // The failed write tore the slot of generation g + 1.
        let slot = ((g + 1) % 2) * MICROTX_CHECKPOINT_BYTES as u64;
        log.write_at(&[0xEE; 512], slot).unwrap();
        {
            // A start now: the checkpoint of generation g, and its log, replayed.
            let copy = mem(JOURNAL);
            copy.write_at(&read(&*log, 0, JOURNAL as usize), 0).unwrap();
            let (_, rec) = Journal::open(copy, &*mem(DATA), BLOCK).unwrap();
            assert_eq!((rec.generation, rec.finished.clone()), (g, vec![7]), "{rec:?}");
        }
        assert!(j.finish(&*cdata).unwrap());
        assert_eq!(j.generation(), g + 1, "the checkpoint went to the next slot");
        assert!(!j.fence().is_up());
        let (j, rec) = Journal::open(log.clone(), &*data, BLOCK).unwrap();
        assert_eq!((rec.generation, rec.finished.clone(), rec.checkpoint_corrupt), (g + 1, vec![], false), "{rec:?}");
        assert_eq!(j.outcome(7), Some(Outcome::Committed(result_of(&t.writes))));
    }

    /// A checkpoint that fails when the journal is full: the transaction fails (nothing of
    /// it logged, its id free), and the journal takes no other until the checkpoint is
    /// written, into the same slot: otherwise the next generation's records would follow
    /// a checkpoint replay never reads.
    #[test]
    fn a_failed_checkpoint_of_a_full_journal_is_written_before_the_next_transaction() {
        for lasts in [false, true] {
            let (log, data) = (mem(JOURNAL), mem(DATA));
            let flaky = Faulty::cut(&log);
            let (j, _) = Journal::open(flaky.clone(), &*data, BLOCK).unwrap();
            let first = j.generation();
            let fit = (JOURNAL - LOG_START) / Journal::tx_space(1, 65536);
            for i in 1..=fit {
                j.run(&*data, &tx(i, &[((i % 8) * 65536, 65536, i as u8)])).unwrap();
            }
            assert_eq!(j.generation(), first, "{fit} transactions fill one generation");
            // The next one checkpoints first: its write fails (and, `lasts`, every later one).
            flaky.fail(0, if lasts { usize::MAX } else { 1 });
            let r = j.run(&*data, &tx(fit + 1, &[(0, 65536, 1)]));
            assert!(matches!(r, Err(JournalError::Unfinished(_))), "{r:?}");
            assert_eq!(j.outcome(fit + 1), None);
            assert!(!j.fence().is_up(), "no transaction of it to fence");
            let next = j.run(&*data, &tx(fit + 2, &[(0, 65536, 2)]));
            if lasts {
                assert!(matches!(next, Err(JournalError::Unfinished(_))), "{next:?}");
                continue;
            }
            next.unwrap();
            assert_eq!(j.generation(), first + 1);
            let (j, _) = Journal::open(log.clone(), &*data, BLOCK).unwrap();
            assert!(matches!(j.outcome(fit + 2), Some(Outcome::Committed(_))));
            assert!(matches!(j.outcome(fit), Some(Outcome::Committed(_))));
        }
    }

    /// Journals as a disk may hold them, each opened without a panic: refused with its
    /// error, or replayed.
    #[test]
    fn crafted_journals_are_refused_or_replayed() {
        // (what, journal size, opened once before it is crafted, crafted, expected: Ok(rolled
        // back) or Err(error name))
        type Craft = fn(&MemoryBackend);
        let cases: [(&str, u64, bool, Craft, Result<Vec<u64>, &str>); 4] = [
            ("larger than the limit", MICROTX_JOURNAL_BYTES + 4096, false, |_| {}, Err("JournalTooLarge")),
            (
                "a BEGIN shorter than its header",
                JOURNAL,
                true,
                |log| {
                    let mut b = Vec::new();
                    put_record(&mut b, Kind::Begin, 0, 1, (1, 0), 77, &[&[1, 0, 0, 0]]);
                    log.write_at(&b, LOG_START).unwrap();
                },
                Ok(vec![77]),
            ),
            (
                "a checkpoint of the last generation",
                JOURNAL,
                true,
                |log| {
                    log.write_at(&encode_checkpoint(u64::MAX, &VecDeque::new()), (u64::MAX % 2) * MICROTX_CHECKPOINT_BYTES as u64).unwrap()
                },
                Err("GenerationExhausted"),
            ),
            (
                "the first checkpoint torn",
                JOURNAL,
                false,
                |log| {
                    let mut b = encode_checkpoint(1, &VecDeque::new());
                    b[CHECKPOINT_HEADER] ^= 0x10;
                    log.write_at(&b, MICROTX_CHECKPOINT_BYTES as u64).unwrap();
                },
                Ok(vec![]),
            ),
        ];
        for (what, size, opened, craft, want) in cases {
            let (log, data) = (mem(size), mem(DATA));
            if opened {
                // Generation 1, its checkpoint in slot 1 and its log empty.
                Journal::open(log.clone(), &*data, BLOCK).unwrap();
            }
            craft(&log);
            match (Journal::open(log.clone(), &*data, BLOCK), want) {
                (Ok((j, rec)), Ok(rolled_back)) => {
                    assert_eq!(rec.rolled_back, rolled_back, "{what}: {rec:?}");
                    // It goes on, and what it logs replays.
                    j.run(&*data, &tx(5, &[(0, 4096, 0x42)])).unwrap();
                    let (j, _) = Journal::open(log.clone(), &*data, BLOCK).unwrap();
                    assert!(matches!(j.outcome(5), Some(Outcome::Committed(_))), "{what}");
                }
                (Err(e), Err(name)) => assert!(format!("{e:?}").starts_with(name), "{what}: {e:?}"),
                (got, want) => panic!("{what}: got {:?}, want {want:?}", got.map(|(_, r)| r)),
            }
        }
    }

    /// A group of three where the second writes a block the first writes (its image holds
    /// the first's bytes) and the third elsewhere, logged whole and then cut after each of
    /// its records in turn: replay finishes exactly the members whose records all precede
    /// the cut (a prefix of the group, in the group's order, so the shared block ends with
    /// the second's image only when the second is finished) and rolls back the rest.
    #[test]
    fn a_group_cut_after_any_record_finishes_a_prefix() {
        let a = tx(11, &[(0, 4096, 0xA1)]);
        let mut b = tx(12, &[(0, 4096, 0xB2), (8192, 4096, 0xB2)]);
        b.writes[0].1[..100].fill(0xA1); // merged over a's bytes, as a fused write's image
        let c = tx(13, &[(65536, 8192, 0xC3)]);
        let group = [(&a, result_of(&a.writes)), (&b, result_of(&b.writes)), (&c, result_of(&c.writes))];
        // Logged whole, then the process dies before anything in place.
        let (log, data) = (mem(JOURNAL), mem(DATA));
        let clog = Faulty::cut(&log);
        let cdata = clog.beside(&data);
        let (j, _) = Journal::open(clog.clone(), &*data, BLOCK).unwrap();
        let g = j.generation();
        clog.fail(2, usize::MAX);
        assert!(matches!(j.run_group(&*cdata, &group), Err(JournalError::InPlace { txid: 11, group: 3, .. })));
        let mut image = vec![0u8; JOURNAL as usize];
        log.read_at(&mut image, 0).unwrap();
        // Where each record of the group ends: BEGIN, WRITE, RESULT of a; BEGIN, 2 WRITEs,
        // RESULT of b; BEGIN, WRITE, RESULT of c; each member from a block boundary.
        let mut ends = Vec::new();
        let (mut at, mut lsn) = (LOG_START as usize, 0);
        while let Some((_, next)) =
            parse_record(&image, at, g, lsn).or_else(|| parse_record(&image, round_up(at as u64, 4096) as usize, g, lsn))
        {
            ends.push(next);
            (at, lsn) = (next, lsn + 1);
        }
        assert_eq!(ends.len(), 10, "the group's records");
        for kept in 0..=ends.len() {
            let cut = if kept == 0 { LOG_START as usize } else { ends[kept - 1] };
            let mut torn = image.clone();
            torn[cut..].fill(0);
            let (log2, data2) = (mem(JOURNAL), mem(DATA));
            log2.write_at(&torn, 0).unwrap();
            let (j2, rec) = Journal::open(log2, &*data2, BLOCK).unwrap();
            // a is whole after 3 records, b after 7, c after 10.
            let whole = [kept >= 3, kept >= 7, kept >= 10];
            for (i, (t, r)) in group.iter().enumerate() {
                let want = if whole[i] { Some(Outcome::Committed(*r)) } else { (kept > [0, 3, 7][i]).then_some(Outcome::RolledBack) };
                assert_eq!(j2.outcome(t.txid), want, "kept {kept}: transaction {}: {rec:?}", t.txid);
            }
            let block0 = match whole {
                [_, true, _] => b.writes[0].1.clone(),
                [true, false, _] => vec![0xA1; 4096],
                _ => vec![0; 4096],
            };
            assert_eq!(read(&*data2, 0, 4096), block0, "kept {kept}");
            assert_eq!(read(&*data2, 8192, 4096), vec![if whole[1] { 0xB2 } else { 0 }; 4096], "kept {kept}");
            assert_eq!(read(&*data2, 65536, 8192), vec![if whole[2] { 0xC3 } else { 0 }; 8192], "kept {kept}");
        }
    }

    /// A group that ran whole: its APPLIED records follow all of its records, and replay
    /// (which finds each record's transaction by its id) knows every member committed and
    /// writes none of them again; a group refused for one member's id writes nothing.
    #[test]
    fn a_whole_group_is_applied_once_and_a_refused_one_writes_nothing() {
        let (log, data) = (mem(JOURNAL), mem(DATA));
        let (j, _) = Journal::open(log.clone(), &*data, BLOCK).unwrap();
        let (a, b) = (tx(21, &[(0, 4096, 1)]), tx(22, &[(0, 4096, 2)]));
        j.run_group(&*data, &[(&a, [1; RESULT_BYTES]), (&b, [2; RESULT_BYTES])]).unwrap();
        assert_eq!(read(&*data, 0, 4096), vec![2; 4096], "in the group's order");
        // Overwritten since by a plain write: replay must not write the group again.
        data.write_at(&[9; 4096], 0).unwrap();
        let (j, rec) = Journal::open(log.clone(), &*data, BLOCK).unwrap();
        assert!(rec.finished.is_empty() && rec.rolled_back.is_empty(), "{rec:?}");
        assert_eq!(
            (j.outcome(21), j.outcome(22)),
            (Some(Outcome::Committed([1; RESULT_BYTES])), Some(Outcome::Committed([2; RESULT_BYTES])))
        );
        assert_eq!(read(&*data, 0, 4096), vec![9; 4096]);
        // Refused: an id twice in the group, or one the journal knows.
        let (c, d) = (tx(23, &[(4096, 4096, 3)]), tx(23, &[(8192, 4096, 4)]));
        let head = j.state.lock().head;
        assert!(matches!(j.run_group(&*data, &[(&c, [3; 16]), (&d, [4; 16])]), Err(JournalError::TxidInUse(23))));
        assert!(matches!(j.run_group(&*data, &[(&c, [3; 16]), (&a, [4; 16])]), Err(JournalError::TxidInUse(21))));
        assert_eq!(j.admissible(&*data, &c, &[23]).map_err(|e| e.to_string()), Err("transaction id 23 is 0 or already known".into()));
        assert_eq!((j.state.lock().head, read(&*data, 4096, 8192)), (head, vec![0; 8192]), "nothing logged, nothing written");
        assert_eq!(j.outcome(23), None, "a refused id stays free");
        // A group larger than the journal's log: refused whole, its ids free, nothing logged;
        // an empty group is no group.
        let big: Vec<Tx> = (0..(JOURNAL / (256 << 10)) + 1).map(|i| tx(40 + i, &[(0, 256 << 10, 5)])).collect();
        let group: Vec<_> = big.iter().map(|t| (t, [5; RESULT_BYTES])).collect();
        assert!(matches!(j.run_group(&*data, &group), Err(JournalError::TooLarge { txid: 40, .. })));
        assert!(big.iter().all(|t| j.outcome(t.txid).is_none()), "a refused group's ids stay free");
        let groups = j.committed();
        j.run_group(&*data, &[]).unwrap();
        assert_eq!((j.committed(), j.state.lock().head), (groups, head), "an empty group logs and counts nothing");
    }

    /// A group's in-place write fails: every member is in doubt (no outcome), all its
    /// blocks fenced, and finishing it writes them again in the group's order and gives
    /// every member its outcome.
    #[test]
    fn a_group_whose_in_place_write_fails_is_finished_whole() {
        let (log, data) = (mem(JOURNAL), mem(DATA));
        let clog = Faulty::cut(&log);
        let cdata = clog.beside(&data);
        let (j, _) = Journal::open(clog.clone(), &*data, BLOCK).unwrap();
        let (a, b) = (tx(31, &[(0, 4096, 1)]), tx(32, &[(0, 8192, 2)]));
        // The journal's write and flush pass; the first in-place write fails, once.
        clog.fail(2, 3);
        let r = j.run_group(&*cdata, &[(&a, [1; RESULT_BYTES]), (&b, [2; RESULT_BYTES])]);
        assert!(matches!(r, Err(JournalError::InPlace { txid: 31, group: 2, .. })), "{r:?}");
        assert!(r.unwrap_err().to_string().starts_with("transaction 31 and the one logged with it: "));
        assert_eq!((j.outcome(31), j.outcome(32)), (None, None));
        assert!(j.fence().holds(0, 1) && j.fence().holds(4096, 1) && !j.fence().holds(8192, 1));
        assert!(j.finish(&*cdata).unwrap());
        assert_eq!(
            (j.outcome(31), j.outcome(32)),
            (Some(Outcome::Committed([1; RESULT_BYTES])), Some(Outcome::Committed([2; RESULT_BYTES])))
        );
        assert_eq!(read(&*data, 0, 8192), vec![2; 8192]);
        assert!(!j.fence().is_up());
    }

    /// A backend whose writes and flushes, counted from the last `fail` (through `ops`,
    /// which two backends share when one process dies for both), fail from number `from`
    /// to before `to`: from one on forever is the process dying there (memory keeps what
    /// was written, later operations change nothing); one of them an injected error.
    struct Faulty {
        inner: Arc<MemoryBackend>,
        ops: Arc<AtomicUsize>,
        from: Arc<AtomicUsize>,
        to: Arc<AtomicUsize>,
    }

    impl Faulty {
        /// Over `inner`, failing nothing until `fail`.
        fn cut(inner: &Arc<MemoryBackend>) -> Arc<Faulty> {
            let n = |v| Arc::new(AtomicUsize::new(v));
            Arc::new(Faulty { inner: inner.clone(), ops: n(0), from: n(usize::MAX), to: n(usize::MAX) })
        }

        /// Over `inner`, counting and failing with `self`.
        fn beside(&self, inner: &Arc<MemoryBackend>) -> Arc<Faulty> {
            Arc::new(Faulty { inner: inner.clone(), ops: self.ops.clone(), from: self.from.clone(), to: self.to.clone() })
        }

        fn fail(&self, from: usize, to: usize) {
            self.ops.store(0, Ordering::SeqCst);
            self.to.store(to, Ordering::SeqCst);
            self.from.store(from, Ordering::SeqCst);
        }

        fn step(&self) -> io::Result<()> {
            let n = self.ops.fetch_add(1, Ordering::SeqCst);
            match n >= self.from.load(Ordering::SeqCst) && n < self.to.load(Ordering::SeqCst) {
                true => Err(io::Error::other("injected")),
                false => Ok(()),
            }
        }
    }

    impl Backend for Faulty {
        fn describe(&self) -> String {
            "faulty".into()
        }
        fn size(&self) -> u64 {
            self.inner.size()
        }
        fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
            self.inner.read_at(buf, off)
        }
        fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
            self.step()?;
            self.inner.write_at(buf, off)
        }
        fn flush(&self) -> io::Result<()> {
            self.step()
        }
        fn write_zeroes(&self, off: u64, len: u64, deallocate: bool) -> io::Result<()> {
            self.step()?;
            self.inner.write_zeroes(off, len, deallocate)
        }
    }
}
