//! NVM I/O commands: Read, Write, Compare (alone or as the first half of Compare and
//! Write), Flush, Write Zeroes, Dataset Management, and the reservation commands. Parsing and validation only; the connection runs the resulting
//! [`IoPlan`].

use std::sync::Arc;

use nearstore_transport::AlignedBuf;
use nearstore_wire::fused::opcode as fop;
use nearstore_wire::opcode::io;
use nearstore_wire::resv::{racqa, Cdw10, Keys, KEYS_LEN, RELEASE_DATA_LEN, REPORT_EDS};
use nearstore_wire::sqe::fuse;
use nearstore_wire::{Sqe, Status};

use crate::dev::Op;
use crate::limits;
use crate::reply::Reply;
use crate::reservation::{Access, HostId};
use crate::subsystem::{AbortWait, Controller, Namespace, Snapshot, Subsystem};
use crate::tenant::TenantPolicy;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum IoKind {
    Read,
    Write,
    /// A Compare, alone or the first half of a Compare and Write (exec/compare.rs).
    Compare,
    Other,
    /// A compute command (runs on the offload engine).
    Compute,
    /// A reservation command (or Set Features 83h) writing its state file or waiting for
    /// the commands its Preempt and Abort aborts.
    Reservation,
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

/// Validates an I/O command of `host` in `tenant` before any data moves. `write_cache`:
/// when off, writes are FUA. DSM ranges are checked later, in [`dsm_ranges`], once the
/// data is in.
pub fn plan(sub: &Subsystem, host: &HostId, tenant: &TenantPolicy, sqe: &Sqe, write_cache: bool) -> Result<IoPlan, Status> {
    // The one fused operation: Compare (first) and Write (second).
    match (sqe.opcode(), sqe.fuse()) {
        (_, fuse::NORMAL) | (io::COMPARE, fuse::FIRST) | (io::WRITE, fuse::SECOND) => {}
        _ => return Err(Status::INVALID_FIELD.dnr()),
    }
    let (ns, access) = match sqe.opcode() {
        io::READ | io::COMPARE | fop::READ_CHECKSUM => (namespace(sub, sqe)?, Access::Read),
        io::WRITE | io::FLUSH | io::WRITE_ZEROES | io::DATASET_MANAGEMENT => (namespace(sub, sqe)?, Access::Write),
        _ => return Err(Status::INVALID_OPCODE.dnr()),
    };
    // Its blocks as the tenant sees them: Flush and Dataset Management (whose ranges
    // dsm_ranges checks) any part of the namespace.
    let lbas = matches!(sqe.opcode(), io::READ | io::COMPARE | fop::READ_CHECKSUM | io::WRITE | io::WRITE_ZEROES)
        .then(|| sqe.slba()..sqe.slba().saturating_add(sqe.nlb() as u64));
    let write = access == Access::Write && sqe.opcode() != io::FLUSH;
    tenant.check(&sub.nqn, ns.nsid, lbas, write).map_err(|_| Status::ACCESS_DENIED.dnr())?;
    if !ns.reservations.allows(host, access) {
        return Err(Status::RESERVATION_CONFLICT.dnr());
    }
    let lba = sqe.slba();
    let (kind, op, len) = match sqe.opcode() {
        // READ CHECKSUM (docs/compute-protocol.md) reads as Read does.
        io::READ | fop::READ_CHECKSUM => {
            let (off, len) = rw_range(&ns, sqe)?;
            (IoKind::Read, Op::Read { off }, len)
        }
        io::COMPARE => {
            // Its data is the host's copy of the blocks, as long as a Write's.
            let (off, len) = rw_range(&ns, sqe)?;
            (IoKind::Compare, Op::Read { off }, len)
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
/// packed in `out`, checking each lies inside the namespace and is the tenant's to write
/// (of subsystem `subnqn`). Without the Attribute Deallocate bit (CDW11 bit 2) the command
/// is only a hint: `out` stays empty.
pub fn dsm_ranges(ns: &Namespace, tenant: &TenantPolicy, subnqn: &str, sqe: &Sqe, data: &[u8], out: &mut AlignedBuf) -> Result<(), Status> {
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
        tenant.check(subnqn, ns.nsid, Some(slba..slba + nlb), true).map_err(|_| Status::ACCESS_DENIED.dnr())?;
        out[i * 16..i * 16 + 8].copy_from_slice(&off.to_le_bytes());
        out[i * 16 + 8..i * 16 + 16].copy_from_slice(&len.to_le_bytes());
    }
    Ok(())
}

/// What a reservation command waits for before it completes: its namespace's state
/// file written, and the commands its Preempt and Abort aborts completed.
pub struct Later {
    pub ns: Arc<Namespace>,
    pub snapshot: Option<Snapshot>,
    pub abort: Option<AbortWait>,
}

pub fn is_reservation(opcode: u8) -> bool {
    matches!(opcode, io::RESERVATION_REGISTER | io::RESERVATION_REPORT | io::RESERVATION_ACQUIRE | io::RESERVATION_RELEASE)
}

/// Validates a reservation command of `host` before its data moves: a Host Identifier
/// (CTRATT.RHII: reservations need a non-zero one), the namespace, and a transfer of
/// exactly what the command defines (Report: NUMD, at most one transfer; 128-bit Host
/// Identifiers need the extended data structure); and that `tenant` reaches the namespace
/// (Report to read it, the others to write it).
pub fn check_reservation(sub: &Subsystem, host: &HostId, tenant: &TenantPolicy, sqe: &Sqe) -> Result<Arc<Namespace>, Status> {
    if sqe.fuse() != 0 {
        return Err(Status::INVALID_FIELD.dnr());
    }
    if *host == [0; 16] {
        return Err(Status::HOST_ID_NOT_INITIALIZED.dnr());
    }
    let ns = namespace(sub, sqe)?;
    tenant.check(&sub.nqn, ns.nsid, None, sqe.opcode() != io::RESERVATION_REPORT).map_err(|_| Status::ACCESS_DENIED.dnr())?;
    let want = match sqe.opcode() {
        io::RESERVATION_REGISTER | io::RESERVATION_ACQUIRE => KEYS_LEN as u64,
        io::RESERVATION_RELEASE => RELEASE_DATA_LEN as u64,
        _ => {
            if sqe.cdw(11) & REPORT_EDS == 0 {
                return Err(Status::HOST_ID_INCONSISTENT.dnr());
            }
            let len = (sqe.cdw(10) as u64 + 1) * 4;
            if len > limits::TRANSFER_BYTES_MAX as u64 {
                return Err(Status::INVALID_FIELD.dnr());
            }
            len
        }
    };
    if sqe.sgl().len as u64 != want {
        return Err(Status::DATA_SGL_LENGTH_INVALID.dnr());
    }
    Ok(ns)
}

/// Runs a reservation command of `ctrl` with its host data, delivering the notices it
/// causes and, for Preempt and Abort, asking the preempted hosts' queues to abort their
/// commands on the namespace. Returns the reply and what to wait for before completing.
pub fn reservation(ctrl: &Controller, sqe: &Sqe, data: &[u8]) -> Result<(Reply, Option<Later>), Status> {
    let ns = check_reservation(&ctrl.subsys, &ctrl.hostid, &ctrl.tenant, sqe)?;
    let c = Cdw10::decode(sqe.cdw(10));
    let host = &ctrl.hostid;
    let r = &ns.reservations;
    let keys = |len| Keys::decode(data, len).ok_or(Status::DATA_SGL_LENGTH_INVALID.dnr());
    let (fx, snap) = match sqe.opcode() {
        io::RESERVATION_REPORT => return Ok((Reply::data(r.report().encode(data_len(sqe))), None)),
        io::RESERVATION_REGISTER => {
            let k = keys(KEYS_LEN)?;
            let capable = r.file.is_some();
            r.update(|s| s.register(host, c, k, capable, limits::RESERVATION_REGISTRANTS_MAX))?
        }
        io::RESERVATION_ACQUIRE => {
            let k = keys(KEYS_LEN)?;
            r.update(|s| s.acquire(host, c, k))?
        }
        _ => {
            let k = keys(RELEASE_DATA_LEN)?;
            r.update(|s| s.release(host, c, k.current))?
        }
    };
    for n in &fx.notices {
        ctrl.subsys.reservation_notice(&n.host, n.kind, ns.nsid);
    }
    let abort = (sqe.opcode() == io::RESERVATION_ACQUIRE && c.action == racqa::PREEMPT_AND_ABORT && !fx.preempted.is_empty())
        .then(|| ctrl.subsys.abort_commands(&fx.preempted, ns.nsid));
    let later = (snap.is_some() || abort.is_some()).then(|| Later { ns: ns.clone(), snapshot: snap, abort });
    Ok((Reply::ok(), later))
}
