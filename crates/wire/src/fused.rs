//! The fused write operations (seed 004, FusionFS's CISCops) as vendor NVM I/O commands:
//! FUSED WRITE carries a descriptor and its data in one transfer and is one transaction of
//! the namespace's MicroTx journal; READ CHECKSUM reads and returns the checksum of the
//! bytes it read; OUTCOME tells what became of a transaction id. The layout, byte by byte,
//! is docs/compute-protocol.md ("Fused write operations"); this file and that section
//! change together. Also LevelDB's log record framing, which append-crc-write computes on
//! the target and the host's log writer and tests read back.

use thiserror::Error;

/// The commands' opcodes (vendor-specific I/O, their low two bits the data direction).
pub mod opcode {
    /// Descriptor and data, host to controller.
    pub const FUSED_WRITE: u8 = 0x85;
    /// Logical blocks, controller to host; the checksum in DW0.
    pub const READ_CHECKSUM: u8 = 0x86;
    /// A transaction's result (RESULT_BYTES), controller to host; its state in DW0.
    pub const OUTCOME: u8 = 0x8a;
}

/// The fused operations (byte 6 of the descriptor; the journal's BEGIN `op`).
pub mod op {
    /// Appends a LevelDB log record (its data framed with masked crc32c, length, type).
    pub const APPEND_CRC_WRITE: u8 = 1;
    /// Writes the data at an object offset; returns the crc32c of exactly those bytes.
    pub const WRITE_CHECKSUM: u8 = 2;
    /// Reads the bytes at an object offset, combines them with the data ([`super::modify`]:
    /// replace, add, xor) and writes the result in place, atomically against every other
    /// writer; returns the crc32c of the bytes written.
    pub const READ_MODIFY_WRITE: u8 = 3;
    /// Compresses the data into one zstd frame on the target and writes the frame at an
    /// object offset; returns its crc32c and length.
    pub const COMPRESS_WRITE: u8 = 4;
}

/// append-crc-write's piece flags (byte 24 of the descriptor; 0: the whole record). A record
/// larger than one transfer (MDTS) goes as pieces, each its own transaction: the first
/// `MORE`, the middle ones `CONTINUES | MORE`, the last `CONTINUES`. Each piece's fragments
/// carry the types LevelDB's writer gives the whole record's (FIRST, MIDDLE.., LAST), so that
/// the pieces together are byte for byte the record `AddRecord` writes; pieces written
/// without their last (a crash between them) end in a record LevelDB's reader drops as
/// unfinished, and the host sets the file's size only after the last.
pub mod piece {
    /// This piece continues a record an earlier append began: its first fragment is MIDDLE
    /// or LAST, not FIRST or FULL.
    pub const CONTINUES: u8 = 1;
    /// The record goes on in a later append: this piece's last fragment is FIRST or MIDDLE,
    /// not LAST or FULL.
    pub const MORE: u8 = 2;
    pub const ALL: u8 = CONTINUES | MORE;
}

/// read-modify-write's combinations (byte 24 of the descriptor): new = f(old, data).
pub mod modify {
    /// new = data.
    pub const REPLACE: u8 = 1;
    /// Little-endian unsigned integers of the descriptor's width (byte 25: 1, 2, 4 or 8
    /// bytes), each old one plus the data's, wrapping.
    pub const ADD: u8 = 2;
    /// new = old ^ data, byte by byte.
    pub const XOR: u8 = 3;
    /// A small expression over each little-endian unsigned integer of the descriptor's width:
    /// bytes 26-31 a postfix program ([`expr`]) over `x` (the old integer) and `d` (the
    /// data's), computed in 64 bits wrapping and cut to the width.
    pub const EXPR: u8 = 4;

    /// The expression's program (bytes 26-31 of the descriptor): up to [`PROGRAM_MAX`]
    /// codes, postfix, ended by 0 or the sixth; it must leave exactly one value, never
    /// taking from an empty stack (so a program is an odd number of codes, five at most).
    pub mod expr {
        /// Push the old integer.
        pub const X: u8 = 1;
        /// Push the data's integer.
        pub const D: u8 = 2;
        pub const ADD: u8 = 3;
        pub const SUB: u8 = 4;
        pub const MUL: u8 = 5;
        pub const MIN: u8 = 6;
        pub const MAX: u8 = 7;
        pub const AND: u8 = 8;
        pub const OR: u8 = 9;
        pub const XOR: u8 = 10;
        /// 0x10 + n pushes the constant n (0 to 15).
        pub const CONST: u8 = 0x10;
        /// Codes in a program at most (bytes 26-31).
        pub const PROGRAM_MAX: usize = 6;
    }
}

/// Checks an expression's program (bytes 26-31): known codes, no value taken from an empty
/// stack, exactly one value left. Its codes, without the ending zeros.
pub fn expr_program(bytes: &[u8]) -> Result<&[u8], String> {
    use modify::expr;
    let n = bytes.iter().position(|&c| c == 0).unwrap_or(bytes.len());
    if bytes[n..].iter().any(|&c| c != 0) {
        return Err(format!("byte {}: a code after the program's end (0)", 26 + n + bytes[n..].iter().position(|&c| c != 0).unwrap_or(0)));
    }
    let mut depth = 0usize;
    for (i, &c) in bytes[..n].iter().enumerate() {
        depth = match c {
            expr::X | expr::D | expr::CONST..=0x1f => depth + 1,
            expr::ADD..=expr::XOR if depth >= 2 => depth - 1,
            expr::ADD..=expr::XOR => return Err(format!("byte {}: code {c} takes two values, the stack holds {depth}", 26 + i)),
            _ => return Err(format!("byte {}: unknown expression code {c:#x}", 26 + i)),
        };
    }
    if depth != 1 {
        return Err(format!("bytes 26-31: the expression leaves {depth} values, not one"));
    }
    Ok(&bytes[..n])
}

/// Runs a checked program on `x` and `d`.
fn expr_eval(program: &[u8], x: u64, d: u64) -> u64 {
    use modify::expr;
    let mut stack = [0u64; modify::expr::PROGRAM_MAX];
    let mut n = 0;
    for &c in program {
        let v = match c {
            expr::X => x,
            expr::D => d,
            expr::CONST..=0x1f => u64::from(c - expr::CONST),
            _ => {
                n -= 1;
                let (a, b) = (stack[n - 1], stack[n]);
                n -= 1;
                match c {
                    expr::ADD => a.wrapping_add(b),
                    expr::SUB => a.wrapping_sub(b),
                    expr::MUL => a.wrapping_mul(b),
                    expr::MIN => a.min(b),
                    expr::MAX => a.max(b),
                    expr::AND => a & b,
                    expr::OR => a | b,
                    _ => a ^ b,
                }
            }
        };
        stack[n] = v;
        n += 1;
    }
    stack[0]
}

/// compress-write's zstd levels (byte 24, signed; 0 takes [`COMPRESS_LEVEL_DEFAULT`]):
/// zstd's fast negative levels down to -7, and at most 19, above which zstd's "ultra"
/// levels take tens of MiB of window and far longer inside the namespace's journal turn.
pub const COMPRESS_LEVEL_MIN: i8 = -7;
pub const COMPRESS_LEVEL_MAX: i8 = 19;
pub const COMPRESS_LEVEL_DEFAULT: i8 = 3;

/// The largest zstd frame of `n` bytes of input: zstd's `ZSTD_COMPRESSBOUND` (a frame of
/// incompressible data is its raw blocks and their headers). What compress-write's extents
/// must cover; the frame written is usually much shorter.
pub const fn compress_bound(n: usize) -> usize {
    let margin = if n < (128 << 10) { ((128 << 10) - n) >> 11 } else { 0 };
    n + (n >> 8) + margin
}

/// OUTCOME's DW0.
pub mod state {
    pub const UNKNOWN: u32 = 0;
    pub const COMMITTED: u32 = 1;
    pub const ROLLED_BACK: u32 = 2;
    pub const FAILED: u32 = 3;
}

pub const MAGIC: [u8; 4] = *b"NSFW";
pub const VERSION: u16 = 1;
pub const HEADER_BYTES: usize = 48;
pub const EXTENT_BYTES: usize = 16;
/// Extents one descriptor may name: each is one write of the transaction, whose journal
/// takes at most 16 (the target's MICROTX_TX_WRITES_MAX).
pub const EXTENTS_MAX: usize = 16;
/// A transaction's result: crc32c of the bytes written (u32), their count (u32), the
/// object's end after them (u64). OUTCOME's data.
pub const RESULT_BYTES: usize = 16;

/// A FUSED WRITE's descriptor, followed by its data in the same transfer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fused {
    pub op: u8,
    /// Chosen by the host, nonzero, unique among the namespace's recent transactions.
    pub txid: u64,
    /// The object byte where the operation's bytes go (append-crc-write: the object's
    /// length before it).
    pub offset: u64,
    /// append-crc-write: where `offset` lies in its 32 KiB log block (LevelDB's
    /// `block_offset_`), `offset` modulo 32768; else 0.
    pub block_offset: u32,
    /// Bytes 24-31, the operation's arguments: read-modify-write the combination
    /// ([`modify`]) and, for add, the integers' width; compress-write the zstd level (i8);
    /// zero for the others.
    pub args: [u8; 8],
    /// The object from the logical block holding `offset` on: (namespace byte, bytes).
    pub extents: Vec<(u64, u64)>,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum FusedError {
    /// Malformed: names the field.
    #[error("fused descriptor: {0}")]
    Invalid(String),
    /// Beyond a limit of the layout.
    #[error("fused descriptor: {0}")]
    Limit(String),
}

impl Fused {
    /// The descriptor and `data` as one transfer.
    pub fn encode(&self, data: &[u8]) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER_BYTES + EXTENT_BYTES * self.extents.len() + data.len());
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.push(self.op);
        b.push(0);
        b.extend_from_slice(&self.txid.to_le_bytes());
        b.extend_from_slice(&self.offset.to_le_bytes());
        b.extend_from_slice(&self.args);
        b.extend_from_slice(&self.block_offset.to_le_bytes());
        b.extend_from_slice(&(data.len() as u32).to_le_bytes());
        b.extend_from_slice(&(self.extents.len() as u16).to_le_bytes());
        b.extend_from_slice(&[0; 6]);
        for (off, len) in &self.extents {
            b.extend_from_slice(&off.to_le_bytes());
            b.extend_from_slice(&len.to_le_bytes());
        }
        b.extend_from_slice(data);
        b
    }

    /// The descriptor of a transfer and where its data starts. Checks the layout only;
    /// the target checks extents against its namespace.
    pub fn decode(b: &[u8]) -> Result<(Fused, usize), FusedError> {
        let bad = |s: &str| Err(FusedError::Invalid(s.to_string()));
        if b.len() < HEADER_BYTES {
            return Err(FusedError::Invalid(format!("{} bytes: shorter than its {HEADER_BYTES}-byte header", b.len())));
        }
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        if b[0..4] != MAGIC {
            return bad("byte 0: magic is not NSFW");
        }
        if u16_at(4) != VERSION {
            return Err(FusedError::Invalid(format!("byte 4: version {} (this target speaks {VERSION})", u16_at(4))));
        }
        let op = b[6];
        if !(op::APPEND_CRC_WRITE..=op::COMPRESS_WRITE).contains(&op) {
            return Err(FusedError::Invalid(format!("byte 6: unknown operation {op}")));
        }
        if b[7] != 0 || b[42..48].iter().any(|&x| x != 0) || (op == op::WRITE_CHECKSUM && u64_at(24) != 0) {
            return bad("bytes 7, 24-31, 42-47: reserved bytes are not zero");
        }
        let args: [u8; 8] = b[24..32].try_into().expect("8 bytes");
        let data_len = u32_at(36) as usize;
        match op {
            op::APPEND_CRC_WRITE => {
                if args[0] & !piece::ALL != 0 || args[1..].iter().any(|&x| x != 0) {
                    return bad("bytes 24-31: piece flags other than 1 and 2, or reserved bytes not zero");
                }
                if args[0] != 0 && data_len == 0 {
                    return bad("byte 24: a piece of a record carries at least one byte");
                }
            }
            op::READ_MODIFY_WRITE => {
                let (kind, width) = (args[0], args[1]);
                match kind {
                    modify::ADD if ![1, 2, 4, 8].contains(&width) => {
                        return Err(FusedError::Invalid(format!("byte 25: width {width} for add (1, 2, 4 or 8 bytes)")));
                    }
                    modify::ADD if !data_len.is_multiple_of(width as usize) => {
                        return Err(FusedError::Invalid(format!("byte 36: {data_len} bytes are not whole {width}-byte integers")));
                    }
                    modify::ADD => {}
                    modify::EXPR if ![1, 2, 4, 8].contains(&width) => {
                        return Err(FusedError::Invalid(format!("byte 25: width {width} for an expression (1, 2, 4 or 8 bytes)")));
                    }
                    modify::EXPR if !data_len.is_multiple_of(width as usize) => {
                        return Err(FusedError::Invalid(format!("byte 36: {data_len} bytes are not whole {width}-byte integers")));
                    }
                    modify::EXPR => {
                        expr_program(&args[2..]).map_err(FusedError::Invalid)?;
                    }
                    modify::REPLACE | modify::XOR if width != 0 => return bad("byte 25: a width is for add and expressions only"),
                    modify::REPLACE | modify::XOR => {}
                    _ => return Err(FusedError::Invalid(format!("byte 24: unknown combination {kind}"))),
                }
                if kind != modify::EXPR && args[2..].iter().any(|&x| x != 0) {
                    return bad("bytes 26-31: reserved bytes are not zero");
                }
            }
            op::COMPRESS_WRITE => {
                let level = args[0] as i8;
                if !(COMPRESS_LEVEL_MIN..=COMPRESS_LEVEL_MAX).contains(&level) {
                    return Err(FusedError::Invalid(format!(
                        "byte 24: zstd level {level} (from {COMPRESS_LEVEL_MIN} to {COMPRESS_LEVEL_MAX}, 0 for {COMPRESS_LEVEL_DEFAULT})"
                    )));
                }
                if args[1..].iter().any(|&x| x != 0) {
                    return bad("bytes 25-31: reserved bytes are not zero");
                }
            }
            _ => {}
        }
        let txid = u64_at(8);
        if txid == 0 {
            return bad("byte 8: transaction id 0");
        }
        let (offset, block_offset, n) = (u64_at(16), u32_at(32), u16_at(40) as usize);
        // A log's blocks start at the object's start: the record's place in its block is
        // the offset's (a block offset that disagreed would frame a record LevelDB's
        // reader cannot read).
        if op == op::APPEND_CRC_WRITE && block_offset as u64 != offset % LOG_BLOCK_BYTES as u64 {
            return Err(FusedError::Invalid(format!(
                "byte 32: block offset {block_offset} is not offset {offset} modulo {LOG_BLOCK_BYTES}"
            )));
        }
        if op != op::APPEND_CRC_WRITE && block_offset != 0 {
            return bad("byte 32: block offset is for append-crc-write only");
        }
        if n == 0 {
            return bad("byte 40: no extents");
        }
        if n > EXTENTS_MAX {
            return Err(FusedError::Limit(format!("byte 40: {n} extents, at most {EXTENTS_MAX}")));
        }
        let data_at = HEADER_BYTES + n * EXTENT_BYTES;
        if b.len() != data_at + data_len {
            return Err(FusedError::Invalid(format!(
                "byte 36: {data_len} bytes of data after {n} extents make {} bytes, the transfer is {}",
                data_at + data_len,
                b.len()
            )));
        }
        if op != op::APPEND_CRC_WRITE && data_len == 0 {
            return bad("byte 36: no bytes to write (only an append may carry an empty record)");
        }
        let mut extents = Vec::with_capacity(n);
        for i in 0..n {
            let at = HEADER_BYTES + i * EXTENT_BYTES;
            let (off, len) = (u64_at(at), u64_at(at + 8));
            if len == 0 || off.checked_add(len).is_none() {
                return Err(FusedError::Invalid(format!("extent {i}: {len} bytes at {off}: empty or overflowing")));
            }
            extents.push((off, len));
        }
        Ok((Fused { op, txid, offset, block_offset, args, extents }, data_at))
    }
}

/// What a fused operation writes, of the operations that need nothing but their data:
/// `data` as it lands in the object at `f.offset`. append-crc-write: the record framed;
/// write-checksum: the data itself. (read-modify-write combines the data with the bytes
/// it reads, [`modify`]; compress-write compresses it: the target makes those.)
pub fn bytes_written(f: &Fused, data: &[u8]) -> Vec<u8> {
    match f.op {
        op::APPEND_CRC_WRITE => {
            let mut out = Vec::with_capacity(framed_len(f.block_offset, data.len()));
            frame_piece(f.block_offset, data, f.args[0], &mut out);
            out
        }
        _ => data.to_vec(),
    }
}

/// How many bytes the operation writes of `data_len` bytes of data, at most: exactly, but
/// for compress-write, whose frame is at most [`compress_bound`]. The extents cover these.
pub fn written_len(f: &Fused, data_len: usize) -> usize {
    match f.op {
        op::APPEND_CRC_WRITE => framed_len(f.block_offset, data_len),
        op::COMPRESS_WRITE => compress_bound(data_len),
        _ => data_len,
    }
}

/// compress-write's zstd level: byte 24, 0 for the default.
pub fn compress_level(f: &Fused) -> i32 {
    match f.args[0] as i8 {
        0 => COMPRESS_LEVEL_DEFAULT as i32,
        l => l as i32,
    }
}

/// read-modify-write's combination of the bytes read (`old`, changed in place) with the
/// data, as the descriptor's bytes 24 and 25 say (checked by [`Fused::decode`]).
pub fn modify(args: &[u8; 8], old: &mut [u8], data: &[u8]) {
    debug_assert_eq!(old.len(), data.len());
    match args[0] {
        modify::ADD => {
            let w = args[1] as usize;
            for (o, d) in old.chunks_exact_mut(w).zip(data.chunks_exact(w)) {
                let mut a = [0u8; 8];
                let mut b = [0u8; 8];
                a[..w].copy_from_slice(o);
                b[..w].copy_from_slice(d);
                let sum = u64::from_le_bytes(a).wrapping_add(u64::from_le_bytes(b));
                o.copy_from_slice(&sum.to_le_bytes()[..w]);
            }
        }
        modify::XOR => old.iter_mut().zip(data).for_each(|(o, d)| *o ^= d),
        modify::EXPR => {
            let (w, program) = (args[1] as usize, expr_program(&args[2..]).expect("checked by decode"));
            for (o, d) in old.chunks_exact_mut(w).zip(data.chunks_exact(w)) {
                let (mut a, mut b) = ([0u8; 8], [0u8; 8]);
                a[..w].copy_from_slice(o);
                b[..w].copy_from_slice(d);
                let v = expr_eval(program, u64::from_le_bytes(a), u64::from_le_bytes(b));
                o.copy_from_slice(&v.to_le_bytes()[..w]);
            }
        }
        _ => old.copy_from_slice(data),
    }
}

/// A result as OUTCOME returns it and the journal keeps it.
pub fn result(crc: u32, count: u32, end: u64) -> [u8; RESULT_BYTES] {
    let mut r = [0u8; RESULT_BYTES];
    r[0..4].copy_from_slice(&crc.to_le_bytes());
    r[4..8].copy_from_slice(&count.to_le_bytes());
    r[8..16].copy_from_slice(&end.to_le_bytes());
    r
}

/// (crc32c, count, end) of a result.
pub fn parse_result(r: &[u8; RESULT_BYTES]) -> (u32, u32, u64) {
    let u32_at = |o: usize| u32::from_le_bytes(r[o..o + 4].try_into().expect("4 bytes"));
    (u32_at(0), u32_at(4), u64::from_le_bytes(r[8..16].try_into().expect("8 bytes")))
}

/// LevelDB's log (`db/log_format.h`): 32 KiB blocks of physical records, each a 7-byte
/// header (masked crc32c of the type byte and the data, length u16, type) and its data.
pub const LOG_BLOCK_BYTES: usize = 32768;
pub const LOG_HEADER_BYTES: usize = 7;

/// Physical record types.
pub mod record {
    pub const ZERO: u8 = 0;
    pub const FULL: u8 = 1;
    pub const FIRST: u8 = 2;
    pub const MIDDLE: u8 = 3;
    pub const LAST: u8 = 4;
}

const MASK_DELTA: u32 = 0xa282_ead8;

/// LevelDB's masked crc (`crc32c::Mask`): a crc stored beside the data it covers is
/// rotated and offset, so that the crc of a string with crcs in it stays well distributed.
pub fn mask(crc: u32) -> u32 {
    crc.rotate_right(15).wrapping_add(MASK_DELTA)
}

pub fn unmask(masked: u32) -> u32 {
    masked.wrapping_sub(MASK_DELTA).rotate_left(15)
}

/// Appends one logical record of `data` to `out` as LevelDB's `log::Writer::AddRecord`
/// does from `block_offset`: a block's tail shorter than a header is zero-filled, and the
/// data cut into FULL or FIRST, MIDDLE.., LAST fragments at block boundaries (an empty
/// record is one empty FULL). Returns the block offset after it.
pub fn frame_record(block_offset: u32, data: &[u8], out: &mut Vec<u8>) -> u32 {
    frame_piece(block_offset, data, 0, out)
}

/// [`frame_record`] for a piece of a record ([`piece`] flags): with `CONTINUES` its first
/// fragment is not the record's first, with `MORE` its last is not the record's last.
pub fn frame_piece(mut block_offset: u32, data: &[u8], flags: u8, out: &mut Vec<u8>) -> u32 {
    let mut left = data;
    let mut begin = flags & piece::CONTINUES == 0;
    let more = flags & piece::MORE != 0;
    loop {
        let leftover = LOG_BLOCK_BYTES - block_offset as usize;
        if leftover < LOG_HEADER_BYTES {
            out.resize(out.len() + leftover, 0);
            block_offset = 0;
        }
        let avail = LOG_BLOCK_BYTES - block_offset as usize - LOG_HEADER_BYTES;
        let n = left.len().min(avail);
        let last = n == left.len();
        let end = last && !more;
        let kind = match (begin, end) {
            (true, true) => record::FULL,
            (true, false) => record::FIRST,
            (false, true) => record::LAST,
            (false, false) => record::MIDDLE,
        };
        let crc = mask(crc32c::crc32c_append(crc32c::crc32c(&[kind]), &left[..n]));
        out.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&(n as u16).to_le_bytes());
        out.push(kind);
        out.extend_from_slice(&left[..n]);
        block_offset += (LOG_HEADER_BYTES + n) as u32;
        left = &left[n..];
        begin = false;
        if last {
            return block_offset;
        }
    }
}

/// Bytes [`frame_record`] appends for `len` bytes of data from `block_offset`.
pub fn framed_len(block_offset: u32, len: usize) -> usize {
    let (mut at, mut left, mut total) = (block_offset as usize, len, 0);
    loop {
        if LOG_BLOCK_BYTES - at < LOG_HEADER_BYTES {
            total += LOG_BLOCK_BYTES - at;
            at = 0;
        }
        let n = left.min(LOG_BLOCK_BYTES - at - LOG_HEADER_BYTES);
        total += LOG_HEADER_BYTES + n;
        at += LOG_HEADER_BYTES + n;
        left -= n;
        if left == 0 {
            return total;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc() -> Fused {
        Fused {
            op: op::APPEND_CRC_WRITE,
            txid: 7,
            offset: 5000,
            block_offset: 5000,
            args: [0; 8],
            extents: vec![(4096, 8192), (65536, 4096)],
        }
    }

    fn with(op: u8, args: [u8; 8]) -> Fused {
        Fused { op, block_offset: 0, args, ..desc() }
    }

    #[test]
    fn a_descriptor_round_trips() {
        let d = desc();
        let b = d.encode(b"hello");
        assert_eq!(Fused::decode(&b), Ok((d, HEADER_BYTES + 2 * EXTENT_BYTES)));
        assert_eq!(&b[HEADER_BYTES + 2 * EXTENT_BYTES..], b"hello");
    }

    /// Every malformed field is refused, naming it.
    #[test]
    fn malformed_descriptors_name_the_field() {
        type Craft = fn(&mut Vec<u8>);
        // (what, change, error starts with)
        let cases: [(&str, Craft, &str); 16] = [
            ("short", |b| b.truncate(40), "40 bytes"),
            ("magic", |b| b[0] = b'X', "byte 0"),
            ("version", |b| b[4] = 2, "byte 4"),
            ("operation", |b| b[6] = 9, "byte 6"),
            ("reserved 7", |b| b[7] = 1, "bytes 7"),
            ("piece flag 4", |b| b[24] = 4, "bytes 24-31: piece flags"),
            ("reserved 25", |b| b[25] = 1, "bytes 24-31: piece flags"),
            ("reserved 42", |b| b[47] = 1, "bytes 7"),
            ("txid 0", |b| b[8..16].fill(0), "byte 8"),
            ("block offset past a block", |b| b[32..36].copy_from_slice(&32768u32.to_le_bytes()), "byte 32"),
            ("block offset not the offset's", |b| b[32..36].copy_from_slice(&5001u32.to_le_bytes()), "byte 32"),
            ("the offset moved, not its block offset", |b| b[16..24].copy_from_slice(&5001u64.to_le_bytes()), "byte 32"),
            ("no extents", |b| b[40] = 0, "byte 40"),
            ("data longer than the transfer", |b| b[36] = 9, "byte 36"),
            ("empty extent", |b| b[56..64].fill(0), "extent 0"),
            ("overflowing extent", |b| b[48..56].copy_from_slice(&u64::MAX.to_le_bytes()), "extent 0"),
        ];
        for (what, craft, want) in cases {
            let mut b = desc().encode(b"hello");
            craft(&mut b);
            let e = Fused::decode(&b).expect_err(what);
            assert!(e.to_string().starts_with(&format!("fused descriptor: {want}")), "{what}: {e}");
        }
        let mut many = desc();
        many.extents = vec![(0, 512); EXTENTS_MAX + 1];
        assert!(matches!(Fused::decode(&many.encode(b"")), Err(FusedError::Limit(_))));
        let mut w = desc();
        w.op = op::WRITE_CHECKSUM;
        assert!(Fused::decode(&w.encode(b"x")).is_err(), "a block offset outside append-crc-write");
        w.block_offset = 0;
        assert!(Fused::decode(&w.encode(b"")).is_err(), "write-checksum of nothing");
        assert!(Fused::decode(&w.encode(b"x")).is_ok());
        w.args[0] = piece::MORE;
        assert!(Fused::decode(&w.encode(b"x")).unwrap_err().to_string().contains("bytes 7, 24-31"), "piece flags on write-checksum");
        let mut a = desc();
        for flags in [piece::CONTINUES, piece::MORE, piece::ALL] {
            a.args[0] = flags;
            assert!(Fused::decode(&a.encode(b"x")).is_ok(), "flags {flags}");
            let e = Fused::decode(&a.encode(b"")).unwrap_err().to_string();
            assert!(e.contains("byte 24: a piece of a record carries at least one byte"), "{e}");
        }
    }

    /// A record cut into pieces at block ends, each framed with its flags, is byte for byte
    /// the record framed whole (what the host sends for a record over one transfer).
    #[test]
    fn pieces_cut_at_block_ends_frame_as_the_whole_record() {
        let b = LOG_BLOCK_BYTES;
        for (at, len, blocks_per_piece) in [(0, 3 * b, 1), (100, 300_000, 3), (b - 7, 70_000, 1), (b - 3, 100_000, 2), (5000, 98_284, 3)] {
            let data: Vec<u8> = (0..len).map(|i| (i * 13 + 1) as u8).collect();
            let mut whole = Vec::new();
            let end = frame_record(at as u32, &data, &mut whole);
            let (mut pieces, mut o, mut left, mut flags) = (Vec::new(), at as u32, &data[..], 0u8);
            while !left.is_empty() {
                // The data of `blocks_per_piece` fragments from `o`: to the end of its block, then whole blocks.
                let first = if b - (o as usize) < LOG_HEADER_BYTES { b - LOG_HEADER_BYTES } else { b - o as usize - LOG_HEADER_BYTES };
                let n = (first + (blocks_per_piece - 1) * (b - LOG_HEADER_BYTES)).min(left.len());
                let more = if n < left.len() { piece::MORE } else { 0 };
                o = frame_piece(o, &left[..n], flags | more, &mut pieces);
                left = &left[n..];
                flags = piece::CONTINUES;
            }
            assert_eq!(o, end, "at {at} len {len}");
            assert!(pieces == whole, "at {at} len {len} in pieces of {blocks_per_piece} blocks: not the whole record's bytes");
        }
    }

    /// The arguments of read-modify-write and compress-write round trip; every bad one is
    /// refused, naming its byte.
    #[test]
    fn the_arguments_of_modify_and_compress_are_checked() {
        let ok: [(u8, [u8; 8], &[u8]); 7] = [
            (op::READ_MODIFY_WRITE, [modify::REPLACE, 0, 0, 0, 0, 0, 0, 0], b"x"),
            (op::READ_MODIFY_WRITE, [modify::XOR, 0, 0, 0, 0, 0, 0, 0], b"xyz"),
            (op::READ_MODIFY_WRITE, [modify::ADD, 1, 0, 0, 0, 0, 0, 0], b"xyz"),
            (op::READ_MODIFY_WRITE, [modify::ADD, 8, 0, 0, 0, 0, 0, 0], &[1; 16]),
            (op::COMPRESS_WRITE, [0; 8], b"x"),
            (op::COMPRESS_WRITE, [COMPRESS_LEVEL_MIN as u8, 0, 0, 0, 0, 0, 0, 0], b"x"),
            (op::COMPRESS_WRITE, [COMPRESS_LEVEL_MAX as u8, 0, 0, 0, 0, 0, 0, 0], b"x"),
        ];
        for (op, args, data) in ok {
            let d = with(op, args);
            assert_eq!(Fused::decode(&d.encode(data)).map(|r| r.0), Ok(d), "op {op} args {args:?}");
        }
        let bad: [(&str, u8, [u8; 8], &[u8], &str); 10] = [
            ("unknown combination", op::READ_MODIFY_WRITE, [9, 0, 0, 0, 0, 0, 0, 0], b"x", "byte 24"),
            ("no combination", op::READ_MODIFY_WRITE, [0; 8], b"x", "byte 24"),
            ("add of 3 bytes", op::READ_MODIFY_WRITE, [modify::ADD, 3, 0, 0, 0, 0, 0, 0], b"xyz", "byte 25"),
            ("add without a width", op::READ_MODIFY_WRITE, [modify::ADD, 0, 0, 0, 0, 0, 0, 0], b"x", "byte 25"),
            ("add of part of an integer", op::READ_MODIFY_WRITE, [modify::ADD, 4, 0, 0, 0, 0, 0, 0], b"xyz", "byte 36"),
            ("a width for xor", op::READ_MODIFY_WRITE, [modify::XOR, 1, 0, 0, 0, 0, 0, 0], b"x", "byte 25"),
            ("reserved 26", op::READ_MODIFY_WRITE, [modify::XOR, 0, 1, 0, 0, 0, 0, 0], b"x", "bytes 26"),
            ("level 20", op::COMPRESS_WRITE, [20, 0, 0, 0, 0, 0, 0, 0], b"x", "byte 24"),
            ("level -8", op::COMPRESS_WRITE, [(-8i8) as u8, 0, 0, 0, 0, 0, 0, 0], b"x", "byte 24"),
            ("reserved 25", op::COMPRESS_WRITE, [0, 1, 0, 0, 0, 0, 0, 0], b"x", "bytes 25"),
        ];
        for (what, op, args, data, want) in bad {
            let e = Fused::decode(&with(op, args).encode(data)).expect_err(what);
            assert!(e.to_string().starts_with(&format!("fused descriptor: {want}")), "{what}: {e}");
        }
        for op in [op::READ_MODIFY_WRITE, op::COMPRESS_WRITE] {
            let args = [if op == op::COMPRESS_WRITE { 0 } else { modify::REPLACE }, 0, 0, 0, 0, 0, 0, 0];
            assert!(Fused::decode(&with(op, args).encode(b"")).is_err(), "op {op} of nothing");
        }
        // The older operations keep bytes 24-31 reserved.
        let mut w = with(op::WRITE_CHECKSUM, [0; 8]);
        w.args[3] = 1;
        assert!(Fused::decode(&w.encode(b"x")).is_err());
    }

    /// Each combination, at each width, with carries and wrapping.
    #[test]
    fn modify_combines_as_documented() {
        let a = |kind, width| [kind, width, 0, 0, 0, 0, 0, 0];
        // (args, old, data, new)
        let cases: [([u8; 8], Vec<u8>, Vec<u8>, Vec<u8>); 7] = [
            (a(modify::REPLACE, 0), vec![1, 2, 3], vec![7, 8, 9], vec![7, 8, 9]),
            (a(modify::XOR, 0), vec![0xff, 0x0f, 0], vec![0x0f, 0x0f, 0x80], vec![0xf0, 0, 0x80]),
            (a(modify::ADD, 1), vec![0xff, 1], vec![1, 1], vec![0, 2]),
            (a(modify::ADD, 2), vec![0xff, 0x00, 0xff, 0xff], vec![1, 0, 1, 0], vec![0, 1, 0, 0]),
            (a(modify::ADD, 4), 0xffff_fffeu32.to_le_bytes().to_vec(), 3u32.to_le_bytes().to_vec(), 1u32.to_le_bytes().to_vec()),
            (a(modify::ADD, 8), 41u64.to_le_bytes().to_vec(), 1u64.to_le_bytes().to_vec(), 42u64.to_le_bytes().to_vec()),
            (a(modify::ADD, 8), u64::MAX.to_le_bytes().to_vec(), 2u64.to_le_bytes().to_vec(), 1u64.to_le_bytes().to_vec()),
        ];
        for (args, mut old, data, new) in cases {
            modify(&args, &mut old, &data);
            assert_eq!(old, new, "{args:?}");
        }
    }

    /// Expressions: each code, at each width (cut to it, wrapping in 64 bits), programs of
    /// every length up to six; and the programs refused, each naming its byte.
    #[test]
    fn expressions_compute_per_integer_and_bad_programs_are_refused() {
        use modify::expr::*;
        let k = |n: u8| CONST + n;
        let e = |w: u8, p: &[u8]| {
            let mut a = [modify::EXPR, w, 0, 0, 0, 0, 0, 0];
            a[2..2 + p.len()].copy_from_slice(p);
            a
        };
        let ints = |w: usize, v: &[u64]| v.iter().flat_map(|x| x.to_le_bytes()[..w].to_vec()).collect::<Vec<u8>>();
        // (width, program, old integers, data integers, new integers)
        let cases: [(u8, &[u8], &[u64], &[u64], &[u64]); 12] = [
            (8, &[X, D, MAX], &[3, 9, 7], &[5, 2, 7], &[5, 9, 7]),
            (8, &[X, D, MIN], &[3, 9], &[5, 2], &[3, 2]),
            (4, &[X, D, SUB], &[10, 0], &[3, 1], &[7, 0xffff_ffff]),
            (2, &[X, D, MUL], &[300, 2], &[300, 3], &[(300 * 300) & 0xffff, 6]),
            (1, &[X, D, ADD], &[0xff], &[2], &[1]),
            (8, &[X, D, AND], &[0b1100], &[0b1010], &[0b1000]),
            (8, &[X, D, OR], &[0b1100], &[0b1010], &[0b1110]),
            (8, &[X, D, XOR], &[0b1100], &[0b1010], &[0b0110]),
            (8, &[D], &[1, 2], &[8, 9], &[8, 9]),
            (8, &[k(7)], &[1], &[2], &[7]),
            // x * 3 + d, a counter scaled and bumped.
            (8, &[X, k(3), MUL, D, ADD], &[5], &[1], &[16]),
            // min(x + d, 15): a saturating counter.
            (4, &[X, D, ADD, k(15), MIN], &[10, 14], &[3, 9], &[13, 15]),
        ];
        for (w, p, old, data, new) in cases {
            let args = e(w, p);
            let (mut o, d) = (ints(w as usize, old), ints(w as usize, data));
            Fused::decode(&with(op::READ_MODIFY_WRITE, args).encode(&d)).unwrap_or_else(|e| panic!("{p:?}: {e}"));
            modify(&args, &mut o, &d);
            assert_eq!(o, ints(w as usize, new), "width {w}, program {p:?}");
        }
        // (args, the error's start)
        let refused: [([u8; 8], &str); 8] = [
            // Six codes always leave an even number of values: five is the longest program.
            (e(8, &[X, D, MAX, k(2), MUL, k(1)]), "bytes 26-31: the expression leaves 2 values"),
            (e(8, &[]), "bytes 26-31: the expression leaves 0 values"),
            (e(8, &[X, D]), "bytes 26-31: the expression leaves 2 values"),
            (e(8, &[X, ADD]), "byte 27: code 3 takes two values"),
            (e(8, &[X, 0x0b]), "byte 27: unknown expression code 0xb"),
            (e(8, &[X, 0, D]), "byte 28: a code after the program's end"),
            (e(3, &[X]), "byte 25: width 3 for an expression"),
            (e(0, &[X]), "byte 25: width 0 for an expression"),
        ];
        for (args, want) in refused {
            let got = Fused::decode(&with(op::READ_MODIFY_WRITE, args).encode(&[0; 8])).expect_err(want).to_string();
            assert!(got.contains(want), "{args:?}: {got}");
        }
        let got = Fused::decode(&with(op::READ_MODIFY_WRITE, e(4, &[X])).encode(&[0; 6])).expect_err("part of an integer").to_string();
        assert!(got.contains("byte 36"), "{got}");
    }

    /// Framing as LevelDB's writer does, record by record: (block offset, length) to the
    /// fragments' (type, length) and the block offset after.
    #[test]
    fn records_split_at_blocks_as_leveldb_writes_them() {
        use record::*;
        let b = LOG_BLOCK_BYTES as u32;
        // (block offset, data length, fragments, zero-filled tail first, block offset after)
        type Case = (u32, usize, &'static [(u8, usize)], usize, u32);
        let cases: [Case; 8] = [
            (0, 0, &[(FULL, 0)], 0, 7),
            (0, 100, &[(FULL, 100)], 0, 107),
            (0, 32761, &[(FULL, 32761)], 0, 0),
            (0, 32762, &[(FIRST, 32761), (LAST, 1)], 0, 8),
            (b - 7, 1, &[(FIRST, 0), (LAST, 1)], 0, 8),
            (b - 6, 1, &[(FULL, 1)], 6, 8),
            (b, 1, &[(FULL, 1)], 0, 8),
            (100, 70000, &[(FIRST, 32661), (MIDDLE, 32761), (LAST, 4578)], 0, 4585),
        ];
        for (at, len, frags, zeros, after) in cases {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            let mut out = Vec::new();
            let next = frame_record(at.min(b), &data, &mut out);
            let case = format!("at {at} len {len}");
            assert_eq!(out.len(), framed_len(at.min(b), len), "{case}");
            assert_eq!(next % b, after, "{case}");
            assert!(out[..zeros].iter().all(|&x| x == 0), "{case}");
            let (mut p, mut got, mut joined) = (zeros, Vec::new(), Vec::new());
            while p < out.len() {
                let h = &out[p..p + 7];
                let n = u16::from_le_bytes([h[4], h[5]]) as usize;
                let body = &out[p + 7..p + 7 + n];
                let crc = crc32c::crc32c_append(crc32c::crc32c(&[h[6]]), body);
                assert_eq!(unmask(u32::from_le_bytes(h[0..4].try_into().unwrap())), crc, "{case}");
                got.push((h[6], n));
                joined.extend_from_slice(body);
                p += 7 + n;
            }
            assert_eq!(got, frags, "{case}");
            assert_eq!(joined, data, "{case}");
        }
        assert_eq!(unmask(mask(0x1234_5678)), 0x1234_5678);
    }
}
