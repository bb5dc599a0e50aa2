//! The fused write operations from the host (docs/compute-protocol.md, "Fused write
//! operations"; docs/compute.md, "Fused writes"): a file mapped to its namespace's extents,
//! each operation one FUSED WRITE (or READ CHECKSUM) on our own NVMe/TCP connection, and
//! [`LogWriter`], shaped like LevelDB's `log::Writer`, appending each record with
//! append-crc-write.
//!
//! Growing a file: an fallocated extent is unwritten, and the file system reads it as
//! zeros whatever the target writes into it (no system call marks it written without
//! writing it), so the host preallocates by writing zeros (through the page cache,
//! synced), maps the file, sends the operation, and only after its completion sets the
//! file's size to the log's end (dropping its cached pages first, as an output's). A crash
//! between the two leaves the file longer than its log by zeros, or by the whole record
//! when the target committed it: LevelDB's reader takes zeros after the last record as the
//! end of the log (the type-0 records of preallocated regions), and [`log_end`] finds the
//! end the next append starts from; the zeros are space to reclaim. Nothing is torn: the
//! record is whole or absent (its transaction).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use nearstore_wire::fused::{self, op, Fused, LOG_BLOCK_BYTES, LOG_HEADER_BYTES};

use crate::object::{self, FileObject, Mapped};
use crate::{causes, ep_name, finish_output, Host, HostError};

/// Bytes a [`LogWriter`] preallocates at a time: one zero fill and one mapping (fsync,
/// FIEMAP) serve the appends of a MiB of log.
pub const LOG_PREALLOC_BYTES: u64 = 1 << 20;

/// Bytes one READ CHECKSUM reads: half a transfer (MDTS, 128 KiB), whole blocks of any
/// block size.
const READ_PIECE_BYTES: u64 = 64 << 10;

/// read-modify-write's combination of the file's bytes with the data (docs/compute-protocol.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Modify {
    /// The bytes become the data.
    Replace,
    /// Byte by byte, the bytes xor the data.
    Xor,
    /// Little-endian unsigned integers of `width` bytes (1, 2, 4 or 8), each plus the data's,
    /// wrapping.
    Add { width: u8 },
    /// Little-endian unsigned integers of `width` bytes, each the value of a small postfix
    /// expression over `x` (the old integer) and `d` (the data's): [`Modify::expression`].
    Expr { width: u8, program: [u8; 6] },
}

impl Modify {
    /// Bytes 24-31 of the descriptor.
    pub fn args(self) -> [u8; 8] {
        let (kind, width) = match self {
            Modify::Replace => (fused::modify::REPLACE, 0),
            Modify::Xor => (fused::modify::XOR, 0),
            Modify::Add { width } => (fused::modify::ADD, width),
            Modify::Expr { width, program } => {
                let mut a = [fused::modify::EXPR, width, 0, 0, 0, 0, 0, 0];
                a[2..].copy_from_slice(&program);
                return a;
            }
        };
        [kind, width, 0, 0, 0, 0, 0, 0]
    }

    /// An expression over integers of `width` bytes from its postfix text, tokens apart by
    /// spaces: `x` (the old integer), `d` (the data's), constants 0 to 15, `+ - * & | ^`,
    /// `min`, `max`; at most five tokens, leaving one value. `x d max` keeps the larger,
    /// `x d + 15 min` adds and saturates at 15, `x 3 * d +` scales and bumps
    /// (docs/compute-protocol.md, "read-modify-write").
    pub fn expression(width: u8, text: &str) -> Result<Modify, HostError> {
        use fused::modify::expr;
        let bad = |what: String| HostError::Invalid(format!("expression '{text}': {what}"));
        if ![1, 2, 4, 8].contains(&width) {
            return Err(bad(format!("integers of {width} bytes (1, 2, 4 or 8)")));
        }
        let mut program = [0u8; expr::PROGRAM_MAX];
        let tokens: Vec<&str> = text.split_whitespace().collect();
        if tokens.len() > expr::PROGRAM_MAX {
            return Err(bad(format!("{} tokens, at most {}", tokens.len(), expr::PROGRAM_MAX - 1)));
        }
        for (i, t) in tokens.iter().enumerate() {
            program[i] = match *t {
                "x" => expr::X,
                "d" => expr::D,
                "+" => expr::ADD,
                "-" => expr::SUB,
                "*" => expr::MUL,
                "min" => expr::MIN,
                "max" => expr::MAX,
                "&" => expr::AND,
                "|" => expr::OR,
                "^" => expr::XOR,
                n => match n.parse::<u8>() {
                    Ok(v) if v < 16 => expr::CONST + v,
                    _ => return Err(bad(format!("'{n}' is not x, d, a constant 0 to 15, + - * & | ^, min or max"))),
                },
            };
        }
        fused::expr_program(&program).map_err(|e| bad(e.replace("bytes 26-31: ", "")))?;
        Ok(Modify::Expr { width, program })
    }

    /// The integers' width, for the kinds that combine integers.
    pub fn width(self) -> Option<u8> {
        match self {
            Modify::Add { width } | Modify::Expr { width, .. } => Some(width),
            _ => None,
        }
    }
}

/// What a read-modify-write or a compress-write did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Written {
    /// Its transaction id, for OUTCOME when the completion was lost.
    pub txid: u64,
    /// crc32c of the bytes the target wrote (the new bytes; the zstd frame).
    pub crc: u32,
    /// How many: the data's length; the frame's.
    pub count: u32,
    /// The file byte after them.
    pub end: u64,
}

/// What an append did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Appended {
    /// Its transaction id, for OUTCOME when the completion was lost.
    pub txid: u64,
    /// crc32c of the framed bytes written (computed by the target).
    pub crc: u32,
    /// Bytes written: the record framed (headers, a block's zero-filled tail).
    pub count: u32,
    /// The log's length after it.
    pub len: u64,
}

/// One piece of a record: its data (a range of the record's bytes), where it goes in the
/// object, its piece flags (`fused::piece`) and the bytes it frames to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub data: std::ops::Range<usize>,
    pub offset: u64,
    pub block_offset: u32,
    pub flags: u8,
    pub framed: u64,
}

/// The pieces of a record of `len` bytes appended at object byte `at` when one transfer
/// carries `max` bytes of data ([`piece_len`]): one when it fits, else cut at log block ends.
/// None when not even one block's data fits a transfer.
pub fn record_pieces(at: u64, len: usize, max: usize) -> Option<Vec<Piece>> {
    let mut pieces = Vec::new();
    let (mut offset, mut start) = (at, 0);
    loop {
        let block_offset = (offset % LOG_BLOCK_BYTES as u64) as u32;
        let n = piece_len(block_offset, len - start, max)?;
        let continues = if start > 0 { fused::piece::CONTINUES } else { 0 };
        let more = if start + n < len { fused::piece::MORE } else { 0 };
        let framed = fused::framed_len(block_offset, n) as u64;
        pieces.push(Piece { data: start..start + n, offset, block_offset, flags: continues | more, framed });
        offset += framed;
        start += n;
        if start == len {
            return Some(pieces);
        }
    }
}

/// How much of a record's `left` bytes the next piece carries, from `block_offset` in its log
/// block, when one transfer carries `max` bytes of data: all of them when they fit, else up to
/// the end of as many log blocks as fit (so that pieces frame as the whole record would);
/// None when not even one block's data fits.
pub fn piece_len(block_offset: u32, left: usize, max: usize) -> Option<usize> {
    if left <= max {
        return Some(left);
    }
    let room = LOG_BLOCK_BYTES - (block_offset as usize).min(LOG_BLOCK_BYTES);
    // A tail shorter than a header is zero-filled: the fragment starts in the next block.
    let first = if room < LOG_HEADER_BYTES { LOG_BLOCK_BYTES - LOG_HEADER_BYTES } else { room - LOG_HEADER_BYTES };
    let block = LOG_BLOCK_BYTES - LOG_HEADER_BYTES;
    if first > max || max < block {
        return None;
    }
    let n = first + (max - first) / block * block;
    (n > 0).then_some(n)
}

/// A fresh transaction id: 64 bits from the operating system's random source (getrandom),
/// nothing derived from the clock or the process id, so writers in other containers or on
/// other hosts (same pid, same instant) draw independent ids; two of them collide with
/// probability 2^-64 per pair, and a target refuses a txid it already knows (INVALID FIELD)
/// rather than confuse two transactions. 0 is not a transaction id.
fn next_txid() -> Result<u64, HostError> {
    loop {
        let t = getrandom::u64().map_err(|e| HostError::Invalid(format!("drawing a transaction id: {e}")))?;
        if t != 0 {
            return Ok(t);
        }
    }
}

fn ioe(path: &Path) -> impl FnOnce(std::io::Error) -> HostError + '_ {
    move |source| HostError::Io { path: path.into(), source }
}

/// Where a LevelDB log in `path` ends: after its last whole record, before zeros a crash left
/// after it (a preallocation whose size was not set back) and before the pieces of a record
/// over one transfer written without their last (a FIRST and MIDDLEs with no LAST: the next
/// append writes over them). Every 32 KiB block starts with a record header, so the last
/// block's headers are walked from its start; a block that starts with a zero header is not
/// part of the log; an unfinished record's blocks are walked back to its FIRST. The host's
/// cached pages of the file go first: records a target appended lie under the zeros cached
/// when they were preallocated.
pub fn log_end(path: &Path) -> Result<u64, HostError> {
    use fused::record::{FIRST, MIDDLE, ZERO};
    let f = File::open(path).map_err(ioe(path))?;
    crate::drop_cached(&f, path)?;
    let size = f.metadata().map_err(ioe(path))?.len();
    let mut start = size / LOG_BLOCK_BYTES as u64 * LOG_BLOCK_BYTES as u64;
    let mut block = vec![0u8; LOG_BLOCK_BYTES];
    // The blocks after this one hold only fragments of a record whose FIRST is earlier.
    let mut unfinished = false;
    loop {
        let n = (size - start).min(LOG_BLOCK_BYTES as u64) as usize;
        f.read_exact_at(&mut block[..n], start).map_err(ioe(path))?;
        // After the block's last whole record (FULL or LAST), and where its last FIRST began.
        let (mut p, mut done, mut first, mut open) = (0, None, None, false);
        while p + LOG_HEADER_BYTES <= n {
            let len = u16::from_le_bytes([block[p + 4], block[p + 5]]) as usize;
            let kind = block[p + 6];
            if kind == ZERO && len == 0 {
                break;
            }
            let next = (p + LOG_HEADER_BYTES + len).min(n);
            match kind {
                FIRST => (first, open) = (Some(p), true),
                MIDDLE => open = true,
                // FULL, LAST, and types LevelDB's reader skips: the log goes on after them.
                _ => (done, first, open) = (Some(next), None, false),
            }
            p = next;
        }
        if p == 0 {
            // No record here: not part of the log (and, below an unfinished record's
            // fragments, neither are they).
            unfinished = false;
            if start == 0 {
                return Ok(0);
            }
            start -= LOG_BLOCK_BYTES as u64;
            continue;
        }
        if open || unfinished {
            match (first, done) {
                // The unfinished record began here: the log ends where it began.
                (Some(q), _) => return Ok(start + q as u64),
                // A fragment with no FIRST after a whole record: the log ends after that.
                (None, Some(d)) => return Ok(start + d as u64),
                (None, None) if start == 0 => {
                    return Err(HostError::Invalid(format!("{}: the log ends inside a record that never began", path.display())));
                }
                // Only the middle of a record: it began in an earlier block.
                (None, None) => {
                    unfinished = true;
                    start -= LOG_BLOCK_BYTES as u64;
                    continue;
                }
            }
        }
        // A tail shorter than a header is the block's zero-filled trailer: the log goes on
        // in the next block.
        let end = if n - p < LOG_HEADER_BYTES && n == LOG_BLOCK_BYTES { n } else { p };
        return Ok(start + end as u64);
    }
}

/// Zero-fills `path` from its size to `to` (rounded up to 4 KiB), synced and dropped from
/// the host's page cache: allocated, written blocks a target may write into and the file
/// system reads back from the device (the cached zeros would hide every record appended).
fn preallocate(path: &Path, to: u64) -> Result<(), HostError> {
    let f = OpenOptions::new().write(true).open(path).map_err(ioe(path))?;
    let size = f.metadata().map_err(ioe(path))?.len();
    let to = to.div_ceil(4096) * 4096;
    if size >= to {
        return Ok(());
    }
    let zeros = vec![0u8; 64 << 10];
    let mut at = size;
    while at < to {
        let n = (to - at).min(zeros.len() as u64) as usize;
        f.write_all_at(&zeros[..n], at).map_err(ioe(path))?;
        at += n as u64;
    }
    f.sync_all().map_err(ioe(path))?;
    crate::drop_cached(&f, path)
}

/// True when the target completed a sent fused operation with a status after which nothing
/// of it is ever written: every refusal (docs/compute-protocol.md) but Write Fault, after
/// which the journal may still finish the transaction.
fn nothing_written(e: &HostError) -> bool {
    use nearstore_initiator::Error as E;
    let HostError::Fused { source, .. } = e else { return false };
    match &**source {
        HostError::Target { source: E::Status { status, .. } | E::Compute { status, .. }, .. } => {
            let fault = nearstore_wire::Status::WRITE_FAULT;
            (status.sct, status.sc) != (fault.sct, fault.sc)
        }
        _ => false,
    }
}

/// `n` bytes (at least one) at `offset` lie inside the mapped file.
fn inside(path: &Path, fo: &FileObject, offset: u64, n: u64) -> Result<(), HostError> {
    if offset.checked_add(n).is_none_or(|end| end > fo.object.len) || n == 0 {
        return Err(HostError::Invalid(format!("{}: {n} bytes at {offset} are not inside its {} bytes", path.display(), fo.object.len)));
    }
    Ok(())
}

/// The namespace pieces (byte offset, length) of object bytes [from, to).
fn pieces(fo: &FileObject, mut from: u64, to: u64) -> Result<Vec<(u64, u64)>, HostError> {
    let mut out = Vec::new();
    let mut at = 0u64;
    for e in &fo.object.extents {
        if from < at + e.len && from < to {
            if e.is_zeros() || e.is_remote() {
                return Err(HostError::Invalid(format!("{}: bytes {from}..{to} are not allocated, written blocks", fo.path.display())));
            }
            let n = (at + e.len).min(to) - from;
            out.push((nearstore_wire::compute::global::offset(e.offset) + (from - at), n));
            from += n;
        }
        at += e.len;
    }
    if from < to {
        return Err(HostError::Invalid(format!("{}: bytes {from}..{to} lie past its extents", fo.path.display())));
    }
    if out.len() > fused::EXTENTS_MAX {
        return Err(HostError::Invalid(format!(
            "{}: {} extents for one operation, at most {}",
            fo.path.display(),
            out.len(),
            fused::EXTENTS_MAX
        )));
    }
    Ok(out)
}

impl Host {
    /// Maps `path` and connects to its namespace: our own connection, which the fused
    /// commands take (not the kernel's passthrough).
    async fn fused_object(&mut self, path: &Path) -> Result<(FileObject, u64), HostError> {
        match object::map_file(path, &self.devices)? {
            Mapped::Offload(fo) => {
                let ep = fo.location.endpoint.clone();
                self.connect(&ep).await?;
                let block = self.conns[&ep].block;
                Ok((fo, block))
            }
            Mapped::Local { path, reason } => Err(HostError::NotOffloaded(causes([(path.as_path(), reason.as_str())]))),
        }
    }

    /// One FUSED WRITE of `data` at object byte `offset` of the mapped file, `n` bytes
    /// written. Returns DW0 and DW1.
    async fn fused(&mut self, fo: &FileObject, block: u64, f: Fused, n: u64, data: &[u8]) -> Result<(u32, u32), HostError> {
        let from = f.offset / block * block;
        let to = (f.offset + n).div_ceil(block) * block;
        let f = Fused { extents: pieces(fo, from, to)?, ..f };
        let ep = fo.location.endpoint.clone();
        let conn = self.conns.get_mut(&ep).expect("connected by fused_object");
        let r = conn.queues[0].fused_write(ep.nsid, &f.encode(data)).await;
        if let Err(e) = &r {
            self.forget_if_lost(&ep, e);
        }
        // Sent (or maybe sent: a lost connection): its txid goes with the error, for OUTCOME.
        r.map_err(|source| HostError::Fused { txid: f.txid, source: Box::new(HostError::Target { endpoint: ep_name(&ep), source }) })
    }

    /// Appends `data` as one LevelDB log record to the log in `path` at its end
    /// ([`log_end`]): preallocated, appended by the target (framed, checksummed,
    /// journaled), then the file's size set to the log's new end.
    pub async fn append_crc_write(&mut self, path: &Path, data: &[u8]) -> Result<Appended, HostError> {
        let len = log_end(path)?;
        let need = fused::framed_len((len % LOG_BLOCK_BYTES as u64) as u32, data.len()) as u64;
        preallocate(path, len + need)?;
        let (fo, block) = self.fused_object(path).await?;
        let a = self.append_mapped(&fo, block, len, data).await?;
        finish_output(path, a.len)?;
        Ok(a)
    }

    /// Appends `data` as one record from object byte `len`: one FUSED WRITE when it fits a
    /// transfer, else pieces cut at log block ends ([`piece_len`]), each a transaction whose
    /// fragments carry the whole record's types (`fused::piece`), so that together they are
    /// the bytes one append would write. The txid returned is the last piece's; a failed piece
    /// names its own. The crc is that of all the bytes written.
    async fn append_mapped(&mut self, fo: &FileObject, block: u64, len: u64, data: &[u8]) -> Result<Appended, HostError> {
        let ep = &fo.location.endpoint;
        let transfer = self.conns[ep].queues[0].max_transfer();
        let max = transfer.saturating_sub(fused::HEADER_BYTES + fused::EXTENTS_MAX * fused::EXTENT_BYTES);
        let total = fused::framed_len((len % LOG_BLOCK_BYTES as u64) as u32, data.len());
        if u32::try_from(total).is_err() {
            return Err(HostError::Invalid(format!("a record of {} bytes: {total} bytes framed, over 4 GiB", data.len())));
        }
        let pieces = record_pieces(len, data.len(), max).ok_or_else(|| {
            HostError::Invalid(format!(
                "a record of {} bytes: the target's transfers of {transfer} bytes cannot carry one log block's data",
                data.len()
            ))
        })?;
        let (mut crc, mut txid) = (0u32, 0u64);
        for (i, p) in pieces.iter().enumerate() {
            txid = next_txid()?;
            let args = [p.flags, 0, 0, 0, 0, 0, 0, 0];
            let f = Fused { op: op::APPEND_CRC_WRITE, txid, offset: p.offset, block_offset: p.block_offset, args, extents: Vec::new() };
            let (c, k) = self.fused(fo, block, f, p.framed, &data[p.data.clone()]).await?;
            if k as u64 != p.framed {
                let e = HostError::Invalid(format!("the target appended {k} bytes, the record's piece takes {}", p.framed));
                return Err(HostError::Fused { txid, source: Box::new(e) });
            }
            crc = if i == 0 { c } else { crc32c::crc32c_combine(crc, c, k as usize) };
        }
        // Checked before the first piece: the record's framed bytes fit 32 bits.
        Ok(Appended { txid, crc, count: total as u32, len: len + total as u64 })
    }

    /// Writes `data` at byte `offset` inside the file (not past its end) with
    /// write-checksum; returns the crc32c of the bytes the target wrote.
    pub async fn write_checksum(&mut self, path: &Path, offset: u64, data: &[u8]) -> Result<u32, HostError> {
        let (fo, block) = self.fused_object(path).await?;
        inside(path, &fo, offset, data.len() as u64)?;
        let f = Fused { op: op::WRITE_CHECKSUM, txid: next_txid()?, offset, block_offset: 0, args: [0; 8], extents: Vec::new() };
        let (crc, _) = self.fused(&fo, block, f, data.len() as u64, data).await?;
        // Cached pages of it are stale now. The size stays as it is: the bytes were inside
        // the file, and setting the size mapped would cut what another writer appended
        // since.
        let f = File::open(path).map_err(ioe(path))?;
        crate::drop_cached(&f, path)?;
        Ok(crc)
    }

    /// Combines the `data.len()` bytes at `offset` inside the file (not past its end) with
    /// `data` as `m` says, on the target, in place and atomically against every other writer
    /// of those blocks (read-modify-write); returns the crc32c of the new bytes. An add is
    /// not idempotent: after a lost completion ask OUTCOME with the error's transaction id,
    /// never send it again with a new one.
    pub async fn read_modify_write(&mut self, path: &Path, offset: u64, m: Modify, data: &[u8]) -> Result<Written, HostError> {
        let (fo, block) = self.fused_object(path).await?;
        inside(path, &fo, offset, data.len() as u64)?;
        let txid = next_txid()?;
        let f = Fused { op: op::READ_MODIFY_WRITE, txid, offset, block_offset: 0, args: m.args(), extents: Vec::new() };
        let (crc, count) = self.fused(&fo, block, f, data.len() as u64, data).await?;
        // Cached pages of it are stale now; the size stays (write_checksum says why).
        let f = File::open(path).map_err(ioe(path))?;
        crate::drop_cached(&f, path)?;
        Ok(Written { txid, crc, count, end: offset + count as u64 })
    }

    /// Compresses `data` into one zstd frame at `level` (0: the default) on the target and
    /// writes the frame at `offset` of the file, or at its end (None): at most its size,
    /// the file grown as for an append (preallocated by the largest frame, its size set
    /// after the completion to the frame's end, never shortened). Returns the frame's
    /// crc32c, length and end. An error after which nothing of the frame will ever be
    /// written (a refusal: any status but Write Fault) takes the zeros away again, so that
    /// the next frame follows the file's real end; after a Write Fault or a lost completion
    /// the target may still commit the frame, and the zeros stay: OUTCOME, asked with the
    /// error's transaction id, gives its end. A crash before the size is set leaves zeros
    /// after the file's old end likewise (space to reclaim). One writer at a time per file.
    pub async fn compress_write(&mut self, path: &Path, offset: Option<u64>, data: &[u8], level: i8) -> Result<Written, HostError> {
        if !(fused::COMPRESS_LEVEL_MIN..=fused::COMPRESS_LEVEL_MAX).contains(&level) {
            return Err(HostError::Invalid(format!(
                "zstd level {level}: from {} to {} (0: {})",
                fused::COMPRESS_LEVEL_MIN,
                fused::COMPRESS_LEVEL_MAX,
                fused::COMPRESS_LEVEL_DEFAULT
            )));
        }
        if data.is_empty() {
            return Err(HostError::Invalid("compress-write of no bytes".into()));
        }
        let size = std::fs::metadata(path).map_err(ioe(path))?.len();
        let at = offset.unwrap_or(size);
        if at > size {
            return Err(HostError::Invalid(format!("{}: offset {at} is past its end ({size} bytes)", path.display())));
        }
        let bound = fused::compress_bound(data.len()) as u64;
        let grows = at + bound > size;
        if grows {
            preallocate(path, at + bound)?;
        }
        let txid = next_txid()?;
        let sent = self.compress_frame(path, at, bound, data, level, txid).await;
        let (crc, count) = match sent {
            Ok(done) => done,
            Err(e) => {
                if grows && (e.txid().is_none() || nothing_written(&e)) {
                    finish_output(path, size)?;
                }
                return Err(e);
            }
        };
        if count as u64 > bound {
            let e = HostError::Invalid(format!("the target wrote a frame of {count} bytes, over the bound of {bound}"));
            return Err(HostError::Fused { txid, source: Box::new(e) });
        }
        let end = at + count as u64;
        if grows {
            finish_output(path, size.max(end))?;
        } else {
            let f = File::open(path).map_err(ioe(path))?;
            crate::drop_cached(&f, path)?;
        }
        Ok(Written { txid, crc, count, end })
    }

    /// compress-write's command: the file mapped (after its preallocation) and the FUSED
    /// WRITE sent. Returns DW0 and DW1.
    async fn compress_frame(
        &mut self,
        path: &Path,
        at: u64,
        bound: u64,
        data: &[u8],
        level: i8,
        txid: u64,
    ) -> Result<(u32, u32), HostError> {
        let (fo, block) = self.fused_object(path).await?;
        let f = Fused {
            op: op::COMPRESS_WRITE,
            txid,
            offset: at,
            block_offset: 0,
            args: [level as u8, 0, 0, 0, 0, 0, 0, 0],
            extents: Vec::new(),
        };
        self.fused(&fo, block, f, bound, data).await
    }

    /// Reads `len` bytes at `offset` of the file with READ CHECKSUM: the bytes and the
    /// crc32c of them the target computed (one command per extent piece, the checksums
    /// combined). The bytes are held whole: for a range of any size, [`Host::read_checksum_into`].
    pub async fn read_checksum(&mut self, path: &Path, offset: u64, len: u64) -> Result<(Vec<u8>, u32), HostError> {
        let mut out = Vec::new();
        let crc = self.read_checksum_into(path, offset, len, &mut out).await?;
        Ok((out, crc))
    }

    /// [`Host::read_checksum`] writing the bytes to `out` piece by piece as they arrive
    /// (READ_PIECE_BYTES at a time, whatever `len`): the crc32c of all of them.
    pub async fn read_checksum_into(
        &mut self,
        path: &Path,
        offset: u64,
        len: u64,
        out: &mut impl std::io::Write,
    ) -> Result<u32, HostError> {
        let (fo, block) = self.fused_object(path).await?;
        if offset.checked_add(len).is_none_or(|end| end > fo.object.len) {
            return Err(HostError::Invalid(format!(
                "{}: {len} bytes at {offset} are not inside its {} bytes",
                path.display(),
                fo.object.len
            )));
        }
        let ep = fo.location.endpoint.clone();
        let (from, to) = (offset / block * block, (offset + len).div_ceil(block) * block);
        let mut crc = 0u32;
        let mut at = from;
        for (off, n) in pieces(&fo, from, to)? {
            let mut k = 0;
            while k < n {
                let m = (n - k).min(READ_PIECE_BYTES);
                // The part of these blocks inside [offset, offset + len).
                let lo = offset.max(at + k) - (at + k);
                let hi = (offset + len).min(at + k + m) - (at + k);
                let conn = self.conns.get_mut(&ep).expect("connected by fused_object");
                let r =
                    conn.queues[0].read_checksum(ep.nsid, (off + k) / block, (m / block) as u32, block as u32, lo as u32..hi as u32).await;
                if let Err(e) = &r {
                    self.forget_if_lost(&ep, e);
                }
                let (d, c) = r.map_err(|source| HostError::Target { endpoint: ep_name(&ep), source })?;
                out.write_all(&d[lo as usize..hi as usize]).map_err(|source| HostError::Output { path: path.to_path_buf(), source })?;
                crc = crc32c::crc32c_combine(crc, c, (hi - lo) as usize);
                k += m;
            }
            at += n;
        }
        Ok(crc)
    }

    /// What became of transaction `txid` on the namespace holding `path`:
    /// `nearstore_wire::fused::state` and its result.
    pub async fn outcome(&mut self, path: &Path, txid: u64) -> Result<(u32, [u8; fused::RESULT_BYTES]), HostError> {
        let (fo, _) = self.fused_object(path).await?;
        let ep = fo.location.endpoint.clone();
        let conn = self.conns.get_mut(&ep).expect("connected by fused_object");
        let r = conn.queues[0].outcome(ep.nsid, txid).await;
        if let Err(e) = &r {
            self.forget_if_lost(&ep, e);
        }
        r.map_err(|source| HostError::Target { endpoint: ep_name(&ep), source })
    }
}

/// A LevelDB log writer (`log::Writer`: records in 32 KiB blocks, FULL or FIRST, MIDDLE..,
/// LAST fragments, masked crc32c) whose records the target frames and checksums:
/// one append-crc-write each. The file is preallocated LOG_PREALLOC_BYTES at a time and
/// mapped once per preallocation; [`LogWriter::finish`] sets its size to the log's end.
///
/// The writer is the log's only writer: before each append it checks that `path` is still
/// the file it opened (device, inode) and that its size is the one it left, and fails
/// naming what changed (replaced by a rename, truncated or grown by another writer) rather
/// than append through a stale extent map into blocks the file no longer owns.
pub struct LogWriter<'h> {
    host: &'h mut Host,
    path: PathBuf,
    len: u64,
    mapped: Option<(FileObject, u64)>,
    /// (device, inode, size) of the file as this writer last left it.
    seen: (u64, u64, u64),
    /// An append whose outcome is not known (sent, then a lost connection, a timeout, a
    /// Write Fault): it may still land where the next record would go, so the writer takes
    /// no more until reopened.
    in_doubt: Option<u64>,
}

/// (device, inode, size) of `path`.
fn identity(path: &Path) -> Result<(u64, u64, u64), HostError> {
    let m = std::fs::metadata(path).map_err(ioe(path))?;
    Ok((m.dev(), m.ino(), m.len()))
}

impl<'h> LogWriter<'h> {
    /// A new, empty log in `path` (created or truncated).
    pub fn create(host: &'h mut Host, path: &Path) -> Result<LogWriter<'h>, HostError> {
        File::create(path).map_err(ioe(path))?;
        Ok(LogWriter { host, path: path.into(), len: 0, mapped: None, seen: identity(path)?, in_doubt: None })
    }

    /// Appends to the log in `path` from its end ([`log_end`]), as LevelDB's writer does
    /// given the file's length.
    pub fn open(host: &'h mut Host, path: &Path) -> Result<LogWriter<'h>, HostError> {
        let len = log_end(path)?;
        Ok(LogWriter { host, path: path.into(), len, mapped: None, seen: identity(path)?, in_doubt: None })
    }

    /// The log's length so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `AddRecord`: appends `data` as one logical record.
    pub async fn add_record(&mut self, data: &[u8]) -> Result<Appended, HostError> {
        if let Some(txid) = self.in_doubt {
            return Err(HostError::Invalid(format!(
                "{}: the outcome of transaction {txid:#018x} is not known: it may still be appended; once OUTCOME says it ended, reopen the log (LogWriter::open)",
                self.path.display()
            )));
        }
        self.check_unchanged()?;
        let need = fused::framed_len((self.len % LOG_BLOCK_BYTES as u64) as u32, data.len()) as u64;
        if self.mapped.as_ref().is_none_or(|(fo, _)| fo.object.len < self.len + need) {
            preallocate(&self.path, (self.len + need).div_ceil(LOG_PREALLOC_BYTES) * LOG_PREALLOC_BYTES)?;
            self.mapped = Some(self.host.fused_object(&self.path).await?);
            self.seen = identity(&self.path)?;
        }
        let (fo, block) = self.mapped.as_ref().expect("mapped above");
        let a = self.host.append_mapped(fo, *block, self.len, data).await;
        if let Err(e) = &a {
            if !nothing_written(e) {
                self.in_doubt = e.txid();
            }
        }
        let a = a?;
        self.len = a.len;
        Ok(a)
    }

    /// Fails when `path` is no longer the file as this writer left it.
    fn check_unchanged(&self) -> Result<(), HostError> {
        let (dev, ino, size) = identity(&self.path)?;
        if (dev, ino) != (self.seen.0, self.seen.1) {
            return Err(self.changed(&format!(
                "was replaced (device {dev:#x} inode {ino}, the log was device {:#x} inode {})",
                self.seen.0, self.seen.1
            )));
        }
        if size != self.seen.2 {
            return Err(self.changed(&format!("is {size} bytes, its writer left it {} bytes", self.seen.2)));
        }
        Ok(())
    }

    fn changed(&self, what: &str) -> HostError {
        HostError::Invalid(format!("{}: {what}: another writer changed the log; reopen it (LogWriter::open)", self.path.display()))
    }

    /// Sets the file's size to the log's end (the preallocated zeros after it go) and
    /// drops its stale cached pages; returns the length.
    pub fn finish(self) -> Result<u64, HostError> {
        finish_output(&self.path, self.len)?;
        Ok(self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Transaction ids are drawn, not derived: no clock or pid goes into them, so two
    /// writers started at the same instant with the same pid (containers, hosts) draw
    /// independent ids by construction (see [`super::next_txid`]); what a unit test can
    /// check is that they are drawn afresh each time: nonzero, distinct, and not a counter
    /// (the former clock ^ pid seed then +1 gave consecutive ids).
    #[test]
    fn transaction_ids_are_drawn_not_counted() {
        let ids: Vec<u64> = (0..1000).map(|_| super::next_txid().unwrap()).collect();
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), ids.len(), "distinct");
        assert!(!ids.contains(&0));
        assert!(ids.windows(2).all(|w| w[1].wrapping_sub(w[0]) != 1), "not consecutive");
    }

    #[test]
    fn a_records_pieces_cover_it_and_frame_to_its_length() {
        let max = (128 << 10) - 304;
        for (at, len) in [(0u64, 0usize), (100, max), (100, max + 1), (32768 - 7, 1 << 20), (5000, 300_000)] {
            let p = record_pieces(at, len, max).unwrap();
            assert_eq!(p.first().map(|p| p.data.start), Some(0));
            assert!(p.windows(2).all(|w| w[0].data.end == w[1].data.start && w[0].offset + w[0].framed == w[1].offset));
            assert_eq!(p.last().map(|p| p.data.end), Some(len));
            let framed: u64 = p.iter().map(|p| p.framed).sum();
            assert_eq!(framed, fused::framed_len((at % 32768) as u32, len) as u64, "at {at} len {len}");
            let flags: Vec<u8> = p.iter().map(|p| p.flags).collect();
            let n = flags.len();
            let want: Vec<u8> =
                (0..n).map(|i| if i > 0 { fused::piece::CONTINUES } else { 0 } | if i + 1 < n { fused::piece::MORE } else { 0 }).collect();
            assert_eq!(flags, want, "at {at} len {len}");
        }
        assert_eq!(record_pieces(0, 1 << 20, 1000), None, "a transfer smaller than a block's data");
    }

    #[test]
    fn pieces_end_at_log_block_ends_and_need_room_for_one_block() {
        let block = LOG_BLOCK_BYTES - LOG_HEADER_BYTES; // 32761
        let max = (128 << 10) - 304;
        // (block offset, bytes left, max per transfer, the piece)
        let cases = [
            (0, max, max, Some(max)),           // fits: all of it
            (0, max + 1, max, Some(3 * block)), // three whole blocks
            (100, 1 << 20, max, Some(block - 100 + 2 * block)),
            (32768 - 7, 1 << 20, max, Some(3 * block)), // a FIRST of 0 bytes, then three blocks
            (32768 - 3, 1 << 20, max, Some(3 * block)), // the tail zero-filled
            (0, 1 << 20, block, Some(block)),
            (0, 1 << 20, block - 1, None), // a transfer smaller than a block's data
            (0, 0, 0, Some(0)),
        ];
        for (at, left, max, want) in cases {
            assert_eq!(piece_len(at, left, max), want, "at {at}, {left} left, max {max}");
        }
    }

    /// A record's pieces written without their last (a FIRST and MIDDLEs, no LAST) are not
    /// part of the log: it ends where that record began, wherever the pieces lie, before
    /// zeros or not; whole records before it are all counted.
    #[test]
    fn log_end_stops_where_an_unfinished_record_began() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("000001.log");
        let b = LOG_BLOCK_BYTES;
        // (whole records before, the unfinished record's pieces (lengths), zeros after)
        let cases: [(&[usize], &[usize], usize); 6] = [
            (&[100, 70_000], &[40_000], 0),
            (&[100, 70_000], &[b - 7 - 4, 3 * (b - 7)], 8192),
            (&[b - 7], &[b - 7, b - 7], 0), // begins at a block's start
            (&[b - 14], &[0], 100),         // a FIRST of no bytes at a block's end
            (&[], &[5000, b - 7], 0),       // nothing whole before it
            (&[10, 20, 30], &[], 4096),     // no unfinished record: as before
        ];
        for (whole, pieces, zeros) in cases {
            let mut log = Vec::new();
            let mut at = 0u32;
            for (i, &n) in whole.iter().enumerate() {
                at = fused::frame_record(at % b as u32, &vec![i as u8 + 1; n], &mut log);
            }
            let end = log.len() as u64;
            for (i, &n) in pieces.iter().enumerate() {
                let flags = if i == 0 { fused::piece::MORE } else { fused::piece::ALL };
                at = fused::frame_piece(at % b as u32, &vec![0xa0 + i as u8; n], flags, &mut log);
            }
            log.resize(log.len() + zeros, 0);
            std::fs::write(&path, &log).unwrap();
            // Where it began: a block's tail shorter than a header before it is zero-filled.
            let want =
                if !pieces.is_empty() && b - (end as usize % b) < LOG_HEADER_BYTES { end.div_ceil(b as u64) * b as u64 } else { end };
            assert_eq!(log_end(&path).unwrap(), want, "whole {whole:?}, pieces {pieces:?}, zeros {zeros}");
        }
        // Only the middle of a record, from the file's start: no log to append after.
        let mut log = Vec::new();
        fused::frame_piece(0, &[1; 100], fused::piece::ALL, &mut log);
        std::fs::write(&path, &log).unwrap();
        assert!(log_end(&path).unwrap_err().to_string().contains("never began"));
    }
}
