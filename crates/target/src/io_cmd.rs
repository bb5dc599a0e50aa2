//! NVM I/O commands: Read, Write, Flush, Write Zeroes, Dataset Management.
//! Parsing and validation only; the connection runs the resulting [`IoPlan`].

use std::sync::Arc;

use nearstore_transport::AlignedBuf;
use nearstore_wire::opcode::io;
use nearstore_wire::{Sqe, Status};

use crate::io_pool::Op;
use crate::limits;
use crate::subsystem::{Namespace, Subsystem};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum IoKind {
    Read,
    Write,
    Other,
    /// A compute command (runs on the offload engine).
    Compute,
}

/// A validated I/O command.
pub struct IoPlan {
    pub ns: Arc<Namespace>,
    pub kind: IoKind,
    pub op: Op,
    /// Bytes moved to or from the host.
    pub len: usize,
    /// Starting LBA, for the error log.
    pub lba: u64,
}

/// Where an I/O command's host-to-controller data comes from.
pub fn data_len(sqe: &Sqe) -> usize {
    sqe.sgl().len as usize
}

fn namespace(sub: &Subsystem, sqe: &Sqe) -> Result<Arc<Namespace>, Status> {
    sub.namespace(sqe.nsid()).ok_or(Status::INVALID_NAMESPACE.dnr())
}

fn rw_range(ns: &Namespace, sqe: &Sqe) -> Result<(u64, usize), Status> {
    let (off, len) = ns.range(sqe.slba(), sqe.nlb() as u64).ok_or(Status::LBA_OUT_OF_RANGE.dnr())?;
    if len as usize > limits::TRANSFER_BYTES_MAX {
        return Err(Status::INVALID_FIELD.dnr());
    }
    if sqe.sgl().len as u64 != len {
        return Err(Status::DATA_SGL_LENGTH_INVALID.dnr());
    }
    Ok((off, len as usize))
}

/// Validates an I/O command before any data moves. `write_cache`: when off, writes are FUA.
/// DSM ranges are checked later, in [`dsm_ranges`], once the data is in.
pub fn plan(sub: &Subsystem, sqe: &Sqe, write_cache: bool) -> Result<IoPlan, Status> {
    if sqe.fuse() != 0 {
        return Err(Status::INVALID_FIELD.dnr());
    }
    let ns = match sqe.opcode() {
        io::READ | io::WRITE | io::FLUSH | io::WRITE_ZEROES | io::DATASET_MANAGEMENT => namespace(sub, sqe)?,
        _ => return Err(Status::INVALID_OPCODE.dnr()),
    };
    let lba = sqe.slba();
    let (kind, op, len) = match sqe.opcode() {
        io::READ => {
            let (off, len) = rw_range(&ns, sqe)?;
            (IoKind::Read, Op::Read { off }, len)
        }
        io::WRITE => {
            let (off, len) = rw_range(&ns, sqe)?;
            (IoKind::Write, Op::Write { off, fua: sqe.fua() || !write_cache }, len)
        }
        io::FLUSH => (IoKind::Other, Op::Flush, 0),
        io::WRITE_ZEROES => {
            let (off, len) = ns.range(lba, sqe.nlb() as u64).ok_or(Status::LBA_OUT_OF_RANGE.dnr())?;
            let deallocate = sqe.cdw(12) & (1 << 25) != 0;
            (IoKind::Other, Op::WriteZeroes { off, len, deallocate, fua: sqe.fua() || !write_cache }, 0)
        }
        _ => {
            // The Linux host may send more than NR+1 ranges' worth of bytes (a whole
            // segment); only NR+1 ranges count. Up to 256 ranges, 4 KiB.
            let nr = (sqe.cdw(10) & 0xff) as usize + 1;
            let len = data_len(sqe);
            if len < nr * 16 || len > 4096 {
                return Err(Status::DATA_SGL_LENGTH_INVALID.dnr());
            }
            (IoKind::Other, Op::Deallocate, len)
        }
    };
    Ok(IoPlan { ns, kind, op, len, lba })
}

/// Turns DSM range entries (context attributes, NLB, SLBA; 16 bytes each) into byte ranges
/// packed in `out`, checking each lies inside the namespace. Without the Attribute
/// Deallocate bit (CDW11 bit 2) the command is only a hint: `out` stays empty.
pub fn dsm_ranges(ns: &Namespace, sqe: &Sqe, data: &[u8], out: &mut AlignedBuf) -> Result<(), Status> {
    out.set_len(0);
    if sqe.cdw(11) & (1 << 2) == 0 {
        return Ok(());
    }
    let n = ((sqe.cdw(10) & 0xff) as usize + 1).min(data.len() / 16);
    if n * 16 > out.capacity() {
        return Err(Status::INVALID_FIELD.dnr());
    }
    out.set_len(n * 16);
    for (i, r) in data.chunks_exact(16).take(n).enumerate() {
        let nlb = u32::from_le_bytes(r[4..8].try_into().expect("4")) as u64;
        let slba = u64::from_le_bytes(r[8..16].try_into().expect("8"));
        let (off, len) = ns.range(slba, nlb).ok_or(Status::LBA_OUT_OF_RANGE.dnr())?;
        out[i * 16..i * 16 + 8].copy_from_slice(&off.to_le_bytes());
        out[i * 16 + 8..i * 16 + 16].copy_from_slice(&len.to_le_bytes());
    }
    Ok(())
}
