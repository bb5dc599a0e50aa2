//! Admin commands: Identify, Get Log Page, Get/Set Features, Keep Alive, Abort,
//! Asynchronous Event Request.

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;

use nearstore_wire::identify::{self, cntrltype, oncs, IdentifyController, IdentifyNamespace, IDENTIFY_LEN};
use nearstore_wire::log::{self, get_log, Smart};
use nearstore_wire::opcode::{admin, cns, feature, lid};
use nearstore_wire::{Sqe, Status};

use crate::limits;
use crate::reply::Reply;
use crate::subsystem::{Controller, Namespace};
use crate::{discovery, Target};

pub enum Outcome {
    Reply(Reply),
    /// An Asynchronous Event Request to hold until an event happens.
    ParkAer,
}

/// How many bytes the host's SGL must describe for a command, as the command itself
/// defines its data (NVMe Base, each command's "Data Pointer"; Linux's target checks the
/// same in `nvmet_check_transfer_len` and `nvmet_check_data_len_lte`). The connection
/// engine checks it before it allocates, requests or sends anything: a longer or shorter
/// SGL is Data SGL Length Invalid (SGLS bit 18 is clear: no SGL may be longer than the data).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataLen {
    /// The SGL must describe exactly this many bytes.
    Exactly(u64),
    /// The SGL must describe at least this many bytes, and only these move (Get and Set
    /// Features: a feature's data structure, if it has one).
    AtLeast(u64),
}

impl DataLen {
    /// The bytes that move, if an SGL of `sgl_len` bytes fits; None: Data SGL Length Invalid.
    pub fn moved(self, sgl_len: u32) -> Option<u64> {
        match self {
            DataLen::Exactly(n) => (u64::from(sgl_len) == n).then_some(n),
            DataLen::AtLeast(n) => (u64::from(sgl_len) >= n).then_some(n),
        }
    }
}

/// The data of an admin command (see [`DataLen`]); an opcode this controller does not
/// implement is Invalid Opcode, before any of its data is requested.
pub fn data_len(ctrl: &Controller, sqe: &Sqe) -> Result<DataLen, Status> {
    Ok(match sqe.opcode() {
        admin::IDENTIFY => DataLen::Exactly(IDENTIFY_LEN as u64),
        // (NUMD + 1) dwords, up to 16 GiB: compared as 64 bits, never wrapped.
        admin::GET_LOG_PAGE => DataLen::Exactly(get_log::len(sqe)),
        // None of the features implemented here has a data structure.
        admin::GET_FEATURES | admin::SET_FEATURES => DataLen::AtLeast(0),
        admin::KEEP_ALIVE | admin::ASYNC_EVENT_REQUEST => DataLen::Exactly(0),
        admin::ABORT if !ctrl.subsys.discovery => DataLen::Exactly(0),
        _ => return Err(Status::INVALID_OPCODE.dnr()),
    })
}

pub fn handle(target: &Target, ctrl: &Controller, sqe: &Sqe, local: Option<SocketAddr>) -> Outcome {
    let disc = ctrl.subsys.discovery;
    let r = match sqe.opcode() {
        admin::IDENTIFY => identify(ctrl, sqe),
        admin::GET_LOG_PAGE => get_log_page(target, ctrl, sqe, local),
        admin::GET_FEATURES => get_features(ctrl, sqe),
        admin::SET_FEATURES => set_features(ctrl, sqe),
        admin::KEEP_ALIVE => Reply::ok(),
        // Commands complete too fast to be caught: report "not aborted" (DW0 bit 0).
        admin::ABORT if !disc => Reply::dw0(1),
        admin::ASYNC_EVENT_REQUEST => return Outcome::ParkAer,
        _ => Reply::status(Status::INVALID_OPCODE.dnr()),
    };
    Outcome::Reply(r)
}

pub fn identify_controller(ctrl: &Controller) -> IdentifyController {
    let sub = &ctrl.subsys;
    let disc = sub.discovery;
    IdentifyController {
        vid: 0,
        ssvid: 0,
        sn: sub.serial.clone(),
        mn: sub.model.clone(),
        fr: env!("CARGO_PKG_VERSION").chars().take(8).collect(),
        rab: 6,
        ieee: [0, 0, 0],
        cmic: if disc { 0 } else { 1 << 1 },
        mdts: limits::MDTS,
        cntlid: ctrl.cntlid,
        ver: nearstore_wire::fabrics::VERSION_1_3,
        oaes: if disc { 0 } else { 1 << 8 },
        cntrltype: if disc { cntrltype::DISCOVERY } else { cntrltype::IO },
        oacs: 0,
        acl: 3,
        aerl: (limits::AER_MAX - 1) as u8,
        frmw: 0x3, // slot 1 read-only, one slot
        // Bit 0: per-namespace SMART; bit 2: extended data (offsets) for Get Log Page.
        lpa: 0x1 | 0x4,
        elpe: (limits::ERROR_LOG_ENTRIES - 1) as u8,
        kas: (limits::KEEP_ALIVE_GRANULARITY_MS / 100) as u16,
        sqes: 0x66,
        cqes: 0x44,
        maxcmd: limits::QUEUE_DEPTH_MAX,
        nn: if disc { 0 } else { limits::NSID_MAX },
        oncs: if disc { 0 } else { oncs::DSM | oncs::WRITE_ZEROES },
        // Bit 0: a volatile write cache is present (the page cache); bits 2:1 = 10b:
        // Flush with NSID FFFFFFFFh is not supported.
        vwc: if disc { 0 } else { 0x1 | 0x4 },
        // SGLs supported (bits 1:0 = 01b); bit 20: offsets in SGL data block descriptors.
        sgls: 1 | (1 << 20),
        subnqn: sub.nqn.clone(),
        ioccsz: ((64 + limits::IN_CAPSULE_BYTES_MAX) / 16) as u32,
        iorcsz: 1,
        icdoff: 0,
        fcatt: 0,
        msdbd: 1,
    }
}

pub fn identify_namespace(ns: &Namespace) -> IdentifyNamespace {
    IdentifyNamespace {
        nsze: ns.blocks,
        ncap: ns.blocks,
        nuse: ns.blocks,
        nsfeat: 1, // thin provisioned: deallocate frees space
        dlfeat: 0x1 | 0x8,
        nmic: 1, // may be shared by several controllers
        nguid: ns.nguid,
        eui64: [0; 8],
        lbads: ns.lba_shift as u8,
    }
}

fn identify(ctrl: &Controller, sqe: &Sqe) -> Reply {
    let c = sqe.cdw(10) as u8;
    let csi = (sqe.cdw(11) >> 24) as u8;
    let sub = &ctrl.subsys;
    let nsid = sqe.nsid();
    if sub.discovery && c != cns::CONTROLLER {
        return Reply::status(Status::INVALID_FIELD.dnr());
    }
    match c {
        cns::CONTROLLER => Reply::data(identify_controller(ctrl).encode()),
        cns::NAMESPACE => match sub.namespace(nsid) {
            Some(ns) => Reply::data(identify_namespace(&ns).encode()),
            // An inactive NSID in the valid range returns zeros (NVMe Base, Identify Namespace).
            None if nsid != 0 && nsid <= limits::NSID_MAX => Reply::data(vec![0; IDENTIFY_LEN]),
            None => Reply::status(Status::INVALID_NAMESPACE.dnr()),
        },
        cns::ACTIVE_NS_LIST if nsid < 0xffff_fffe => Reply::data(identify::encode_ns_list(sub.nsids(), nsid)),
        cns::NS_ID_DESCRIPTORS => match sub.namespace(nsid) {
            Some(ns) => Reply::data(identify::encode_ns_descriptors(&ns.nguid, &ns.uuid)),
            None => Reply::status(Status::INVALID_NAMESPACE.dnr()),
        },
        // NVM command set specific structures: nearstore reports no limits beyond the
        // common ones, which an all-zero structure says.
        cns::CS_CONTROLLER if csi == 0 => Reply::data(vec![0; IDENTIFY_LEN]),
        cns::CS_NAMESPACE if csi == 0 => match sub.namespace(nsid) {
            Some(_) => Reply::data(vec![0; IDENTIFY_LEN]),
            None => Reply::status(Status::INVALID_NAMESPACE.dnr()),
        },
        _ => Reply::status(Status::INVALID_FIELD.dnr()),
    }
}

fn smart(ctrl: &Controller, nsid: u32) -> Option<Vec<u8>> {
    let nss: Vec<_> = match nsid {
        0 | 0xffff_ffff => ctrl.subsys.namespaces(),
        n => vec![ctrl.subsys.namespace(n)?],
    };
    let mut s = Smart { temperature: 300, available_spare: 100, spare_threshold: 10, ..Default::default() };
    let (mut rb, mut wb) = (0u64, 0u64);
    for ns in nss {
        rb += ns.stats.read_bytes.load(Relaxed);
        wb += ns.stats.written_bytes.load(Relaxed);
        s.host_reads += ns.stats.reads.load(Relaxed) as u128;
        s.host_writes += ns.stats.writes.load(Relaxed) as u128;
        s.media_errors += ns.stats.errors.load(Relaxed) as u128;
    }
    s.data_units_read = Smart::data_units(rb);
    s.data_units_written = Smart::data_units(wb);
    s.error_log_entries = ctrl.state.lock().error_count as u128;
    Some(s.encode())
}

fn get_log_page(target: &Target, ctrl: &Controller, sqe: &Sqe, local: Option<SocketAddr>) -> Reply {
    let len = get_log::len(sqe);
    let off = get_log::offset(sqe);
    if !off.is_multiple_of(4) || len > limits::TRANSFER_BYTES_MAX as u64 {
        return Reply::status(Status::INVALID_FIELD.dnr());
    }
    let disc = ctrl.subsys.discovery;
    let page = match (get_log::lid(sqe), disc) {
        (lid::DISCOVERY, true) => discovery::log_page(target, &ctrl.hostnqn, local),
        (lid::ERROR_INFORMATION, _) => {
            let st = ctrl.state.lock();
            let mut b = vec![0u8; limits::ERROR_LOG_ENTRIES * log::ERROR_ENTRY_LEN];
            for (i, e) in st.errors.iter().enumerate() {
                e.encode_into(&mut b[i * log::ERROR_ENTRY_LEN..(i + 1) * log::ERROR_ENTRY_LEN]);
            }
            b
        }
        (lid::SMART_HEALTH, false) => match smart(ctrl, sqe.nsid()) {
            Some(b) => b,
            None => return Reply::status(Status::INVALID_NAMESPACE.dnr()),
        },
        (lid::FIRMWARE_SLOT, false) => log::encode_firmware_slot(env!("CARGO_PKG_VERSION")),
        (lid::CHANGED_NS_LIST, false) => {
            let mut st = ctrl.state.lock();
            let ids = std::mem::take(&mut st.changed_ns);
            identify::encode_ns_list(ids, 0)
        }
        _ => return Reply::status(Status::INVALID_LOG_PAGE.dnr()),
    };
    if off > page.len() as u64 {
        return Reply::status(Status::INVALID_FIELD.dnr());
    }
    let mut data = page[off as usize..].to_vec();
    data.resize(len as usize, 0);
    Reply::data(data)
}

fn get_features(ctrl: &Controller, sqe: &Sqe) -> Reply {
    let fid = sqe.cdw(10) as u8;
    let sel = (sqe.cdw(10) >> 8) & 0x7;
    if sel == 3 {
        // Supported capabilities: changeable (bit 2), not saveable, not per-namespace.
        return match fid {
            feature::NUMBER_OF_QUEUES | feature::KEEP_ALIVE_TIMER | feature::ASYNC_EVENT_CONFIG | feature::VOLATILE_WRITE_CACHE => {
                Reply::dw0(1 << 2)
            }
            _ => Reply::status(Status::INVALID_FIELD.dnr()),
        };
    }
    let st = ctrl.state.lock();
    match fid {
        feature::NUMBER_OF_QUEUES => {
            let n = (st.io_queues_granted - 1) as u32;
            Reply::dw0(n | (n << 16))
        }
        feature::KEEP_ALIVE_TIMER => Reply::dw0(st.kato_ms),
        feature::ASYNC_EVENT_CONFIG => Reply::dw0(st.async_event_config),
        feature::VOLATILE_WRITE_CACHE if !ctrl.subsys.discovery => Reply::dw0(ctrl.write_cache.load(Relaxed) as u32),
        _ => Reply::status(Status::INVALID_FIELD.dnr()),
    }
}

fn set_features(ctrl: &Controller, sqe: &Sqe) -> Reply {
    if sqe.cdw(10) & (1 << 31) != 0 {
        return Reply::status(Status::FEATURE_NOT_SAVEABLE.dnr());
    }
    let fid = sqe.cdw(10) as u8;
    let v = sqe.cdw(11);
    let mut st = ctrl.state.lock();
    match fid {
        feature::NUMBER_OF_QUEUES if !ctrl.subsys.discovery => {
            let (nsq, ncq) = (v & 0xffff, v >> 16);
            if nsq == 0xffff || ncq == 0xffff {
                return Reply::status(Status::INVALID_FIELD.dnr());
            }
            if !st.io_queues.is_empty() {
                return Reply::status(Status::COMMAND_SEQUENCE_ERROR.dnr());
            }
            let n = (nsq.min(ncq) + 1).min(limits::IO_QUEUES_MAX as u32) as u16;
            st.io_queues_granted = n;
            let g = (n - 1) as u32;
            Reply::dw0(g | (g << 16))
        }
        feature::KEEP_ALIVE_TIMER => {
            st.kato_ms = v;
            Reply::ok()
        }
        feature::ASYNC_EVENT_CONFIG => {
            st.async_event_config = v;
            Reply::ok()
        }
        feature::VOLATILE_WRITE_CACHE if !ctrl.subsys.discovery => {
            ctrl.write_cache.store(v & 1 != 0, Relaxed);
            Reply::ok()
        }
        _ => Reply::status(Status::INVALID_FIELD.dnr()),
    }
}
