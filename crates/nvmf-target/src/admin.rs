//! Admin commands: Identify, Get Log Page, Get/Set Features, Keep Alive, Abort,
//! Asynchronous Event Request.

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use nearstore_wire::identify::{
    self, cntrltype, ctratt, fuses, oncs, rescap, IdentifyController, IdentifyNamespace, IndependentNamespace, IDENTIFY_LEN,
};
use nearstore_wire::log::{self, get_log, Smart};
use nearstore_wire::opcode::{admin, cns, csi, feature, lid};
use nearstore_wire::{Sqe, Status};

use crate::limits;
use crate::reply::Reply;
use crate::subsystem::{Controller, Namespace, Snapshot};
use crate::{discovery, Target};

pub enum Outcome {
    Reply(Reply),
    /// An Asynchronous Event Request to hold until an event happens.
    ParkAer,
    /// Success once the namespace's reservation state file is written.
    Persist(Arc<Namespace>, Snapshot),
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
        // Only the Host Identifier has a data structure: 16 bytes read with EXHID, as
        // nvmet_feat_data_len; without EXHID, and Set over fabrics, it fails with no data.
        admin::GET_FEATURES if host_identifier_read(ctrl, sqe) => DataLen::AtLeast(HOST_ID_LEN),
        admin::GET_FEATURES | admin::SET_FEATURES => DataLen::AtLeast(0),
        admin::KEEP_ALIVE | admin::ASYNC_EVENT_REQUEST => DataLen::Exactly(0),
        admin::ABORT | admin::CROSS_CONTROLLER_RESET | admin::FENCE_HOST_INSTANCES if !ctrl.subsys.discovery => DataLen::Exactly(0),
        _ => return Err(Status::INVALID_OPCODE.dnr()),
    })
}

pub fn handle(target: &Target, ctrl: &Controller, sqe: &Sqe, local: Option<SocketAddr>) -> Outcome {
    let disc = ctrl.subsys.discovery;
    let r = match sqe.opcode() {
        admin::IDENTIFY => identify(ctrl, sqe),
        admin::GET_LOG_PAGE => get_log_page(target, ctrl, sqe, local),
        admin::GET_FEATURES => get_features(ctrl, sqe),
        admin::SET_FEATURES if is_reservation_feature(sqe) => return set_reservation_feature(ctrl, sqe),
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
        ctratt: if disc { 0 } else { ctratt::HOST_ID_128 | ctratt::RHII },
        cntrltype: if disc { cntrltype::DISCOVERY } else { cntrltype::IO },
        ciu: ctrl.ciu,
        cirn: ctrl.cirn,
        oacs: 0,
        acl: 3,
        aerl: (limits::AER_MAX - 1) as u8,
        frmw: 0x3, // slot 1 read-only, one slot
        // Bit 0: per-namespace SMART; bit 2: extended data (offsets) for Get Log Page.
        lpa: 0x1 | 0x4,
        elpe: (limits::ERROR_LOG_ENTRIES - 1) as u8,
        wctemp: if disc { 0 } else { WARNING_TEMPERATURE_K },
        cctemp: if disc { 0 } else { CRITICAL_TEMPERATURE_K },
        kas: (limits::KEEP_ALIVE_GRANULARITY_MS / 100) as u16,
        sqes: 0x66,
        cqes: 0x44,
        maxcmd: limits::QUEUE_DEPTH_MAX,
        nn: if disc { 0 } else { limits::NSID_MAX },
        oncs: if disc { 0 } else { oncs::COMPARE | oncs::DSM | oncs::WRITE_ZEROES | oncs::SAVE_SELECT | oncs::RESERVATIONS },
        // Compare and Write, atomic against every other writer (exec/compare.rs).
        fuses: if disc { 0 } else { fuses::COMPARE_AND_WRITE },
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
        rescap: rescap::ALL_TYPES | rescap::IEKEY_1_3 | if ns.reservations.file.is_some() { rescap::PTPL } else { 0 },
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
        // The I/O command set structures a host enabling with CC.CSS = 110b reads. NVM
        // command set specific ones: nearstore reports no limits beyond the common ones,
        // which an all-zero structure says.
        cns::CS_CONTROLLER | cns::CS_NAMESPACE | cns::CS_ACTIVE_NS_LIST if csi != csi::NVM => {
            Reply::status(Status::INVALID_IO_COMMAND_SET.dnr())
        }
        cns::CS_CONTROLLER => Reply::data(vec![0; IDENTIFY_LEN]),
        cns::CS_NAMESPACE => match sub.namespace(nsid) {
            Some(_) => Reply::data(vec![0; IDENTIFY_LEN]),
            None => Reply::status(Status::INVALID_NAMESPACE.dnr()),
        },
        cns::CS_ACTIVE_NS_LIST if nsid < 0xffff_fffe => Reply::data(identify::encode_ns_list(sub.nsids(), nsid)),
        cns::CS_INDEPENDENT_NAMESPACE => match sub.namespace(nsid) {
            Some(ns) => {
                let id = identify_namespace(&ns);
                Reply::data(IndependentNamespace { nsfeat: id.nsfeat, nmic: id.nmic, nstat: 1 }.encode())
            }
            None if nsid != 0 && nsid <= limits::NSID_MAX => Reply::data(vec![0; IDENTIFY_LEN]),
            None => Reply::status(Status::INVALID_NAMESPACE.dnr()),
        },
        // One combination, index 0: the NVM command set alone (CSI 0, bit 0).
        cns::IO_COMMAND_SETS => Reply::data(identify::encode_io_command_sets(&[1 << csi::NVM])),
        _ => Reply::status(Status::INVALID_FIELD.dnr()),
    }
}

fn smart(ctrl: &Controller, nsid: u32) -> Option<Vec<u8>> {
    let nss: Vec<_> = match nsid {
        0 | 0xffff_ffff => ctrl.subsys.namespaces(),
        n => vec![ctrl.subsys.namespace(n)?],
    };
    let over_or_under = temperature_alarm(&ctrl.state.lock().features);
    let mut s = Smart {
        critical_warning: if over_or_under { CRITICAL_WARNING_TEMPERATURE } else { 0 },
        temperature: TEMPERATURE_K,
        available_spare: 100,
        spare_threshold: 10,
        ..Default::default()
    };
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
        (lid::RESERVATION_NOTIFICATION, false) => ctrl.take_reservation_notice(get_log::rae(sqe)).encode(),
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

/// Composite temperature nearstore reports (SMART/health, kelvins): 27 °C. There is no
/// sensor; a constant lets hosts exercise the temperature thresholds.
const TEMPERATURE_K: u16 = 300;
/// Warning (WCTEMP) and critical (CCTEMP) composite temperatures in Identify Controller;
/// WCTEMP is also the over-temperature threshold's default (NVMe Base, Temperature Threshold).
const WARNING_TEMPERATURE_K: u16 = 343;
const CRITICAL_TEMPERATURE_K: u16 = 358;
/// SMART/health critical warning bit 1: a temperature is over or under a threshold.
const CRITICAL_WARNING_TEMPERATURE: u8 = 1 << 1;
/// Asynchronous event: SMART/health status (type 1), temperature threshold (info 01h), log 02h.
const AEN_TEMPERATURE: u32 = 0x01 | (0x01 << 8) | (0x02 << 16);
/// Async Event Configuration bit for the temperature critical warning.
const AEC_TEMPERATURE: u32 = 1 << 1;

/// Current values of the features that have no home elsewhere in the controller (Number
/// of Queues, Keep Alive Timer, Async Event Configuration and Volatile Write Cache keep
/// theirs in [`crate::subsystem::CtrlState`] and [`Controller::write_cache`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Features {
    /// 01h: Arbitration Burst (bits 2:0) and the priority weights, stored as set (CAP.AMS
    /// offers round robin only, so they change nothing).
    pub arbitration: u32,
    /// 02h: Power State (bits 4:0), 0: the one power state (NPSS 0); Workload Hint 0.
    pub power_management: u32,
    /// 04h: over- and under-temperature thresholds of the composite temperature, kelvins.
    pub temperature_over_k: u16,
    pub temperature_under_k: u16,
    /// 05h: Time Limited Error Recovery (bits 15:0, 100 ms units); DULBE is not supported.
    pub error_recovery: u32,
    /// 0Ah: Disable Normal (bit 0).
    pub write_atomicity: u32,
    /// 19h: the I/O command set combination in use (index into Identify CNS 1Ch).
    pub io_command_set_profile: u32,
    /// 0Fh: the Keep Alive Timer Connect set, its default.
    pub kato_at_connect_ms: u32,
}

impl Features {
    pub fn new(kato_at_connect_ms: u32) -> Features {
        Features {
            // Arbitration Burst 111b: no limit.
            arbitration: 0x7,
            power_management: 0,
            temperature_over_k: WARNING_TEMPERATURE_K,
            temperature_under_k: 0,
            error_recovery: 0,
            write_atomicity: 0,
            io_command_set_profile: 0,
            kato_at_connect_ms,
        }
    }
}

fn temperature_alarm(f: &Features) -> bool {
    TEMPERATURE_K > f.temperature_over_k || TEMPERATURE_K < f.temperature_under_k
}

/// The features a controller answers: the ones the NVMe Base specification makes mandatory
/// for an I/O controller over fabrics (Interrupt Coalescing and Interrupt Vector Configuration
/// are for PCIe only), the I/O Command Set Profile that CC.CSS = 110b implies, and Volatile
/// Write Cache. A discovery controller has Async Event Configuration and Keep Alive Timer.
fn feature_known(ctrl: &Controller, fid: u8) -> bool {
    match fid {
        feature::ASYNC_EVENT_CONFIG | feature::KEEP_ALIVE_TIMER => true,
        feature::ARBITRATION
        | feature::POWER_MANAGEMENT
        | feature::TEMPERATURE_THRESHOLD
        | feature::ERROR_RECOVERY
        | feature::VOLATILE_WRITE_CACHE
        | feature::NUMBER_OF_QUEUES
        | feature::WRITE_ATOMICITY_NORMAL
        | feature::IO_COMMAND_SET_PROFILE => !ctrl.subsys.discovery,
        _ => false,
    }
}

/// Temperature Threshold's CDW11: TMPTH (15:0), TMPSEL (19:16), THSEL (21:20). Only the
/// composite temperature exists: TMPSEL 0, or Fh ("all sensors") when setting. Some(true):
/// the over-temperature threshold.
fn temperature_select(cdw11: u32, set: bool) -> Option<bool> {
    let tmpsel = (cdw11 >> 16) & 0xf;
    if tmpsel != 0 && !(set && tmpsel == 0xf) {
        return None;
    }
    match (cdw11 >> 20) & 0x3 {
        0 => Some(true),
        1 => Some(false),
        _ => None,
    }
}

/// A feature's value (CQE DW0) from `f` and the controller, current or default.
fn feature_value(ctrl: &Controller, sqe: &Sqe, current: bool) -> Option<u32> {
    let st = ctrl.state.lock();
    let f = if current { st.features } else { Features::new(st.features.kato_at_connect_ms) };
    let fid = sqe.cdw(10) as u8;
    Some(match fid {
        feature::ARBITRATION => f.arbitration,
        feature::POWER_MANAGEMENT => f.power_management,
        feature::TEMPERATURE_THRESHOLD => {
            let cdw11 = sqe.cdw(11) & 0x003f_0000;
            let over = temperature_select(cdw11, false)?;
            cdw11 | u32::from(if over { f.temperature_over_k } else { f.temperature_under_k })
        }
        feature::ERROR_RECOVERY => f.error_recovery,
        feature::WRITE_ATOMICITY_NORMAL => f.write_atomicity,
        feature::IO_COMMAND_SET_PROFILE => f.io_command_set_profile,
        feature::NUMBER_OF_QUEUES => {
            let n = if current { st.io_queues_granted } else { limits::IO_QUEUES_MAX } as u32 - 1;
            n | (n << 16)
        }
        feature::KEEP_ALIVE_TIMER if current => st.kato_ms,
        feature::KEEP_ALIVE_TIMER => f.kato_at_connect_ms,
        feature::ASYNC_EVENT_CONFIG if current => st.async_event_config,
        feature::ASYNC_EVENT_CONFIG => 0,
        feature::VOLATILE_WRITE_CACHE if current => ctrl.write_cache.load(Relaxed) as u32,
        feature::VOLATILE_WRITE_CACHE => 1,
        _ => return None,
    })
}

/// The bytes of the Host Identifier feature's data (EXHID: 128 bits).
const HOST_ID_LEN: u64 = 16;

fn get_sel(sqe: &Sqe) -> u32 {
    (sqe.cdw(10) >> 8) & 0x7
}

/// A Get Features of the Host Identifier that returns it: EXHID set, a value (not the
/// capabilities) asked for, on an I/O controller.
fn host_identifier_read(ctrl: &Controller, sqe: &Sqe) -> bool {
    sqe.cdw(10) as u8 == feature::HOST_IDENTIFIER
        && !ctrl.subsys.discovery
        && sqe.cdw(11) & feature::EXHID != 0
        && matches!(get_sel(sqe), feature::sel::CURRENT | feature::sel::DEFAULT | feature::sel::SAVED)
}

/// Get Features 81h: the Host ID this controller's host gave in its Connect (CTRATT bit 0:
/// only the 128-bit form, so EXHID clear is Invalid Field, as nvmet answers). Over fabrics
/// it cannot be changed (capabilities 0).
fn get_host_identifier(ctrl: &Controller, sqe: &Sqe) -> Reply {
    if get_sel(sqe) == feature::sel::SUPPORTED_CAPABILITIES {
        return Reply::dw0(0);
    }
    if !host_identifier_read(ctrl, sqe) {
        return Reply::status(Status::INVALID_FIELD.dnr());
    }
    Reply::data(ctrl.hostid.to_vec())
}

fn get_features(ctrl: &Controller, sqe: &Sqe) -> Reply {
    let fid = sqe.cdw(10) as u8;
    if is_reservation_feature(sqe) && !ctrl.subsys.discovery {
        return get_reservation_feature(ctrl, sqe);
    }
    if fid == feature::HOST_IDENTIFIER && !ctrl.subsys.discovery {
        return get_host_identifier(ctrl, sqe);
    }
    if !feature_known(ctrl, fid) {
        return Reply::status(Status::INVALID_FIELD.dnr());
    }
    let value = match get_sel(sqe) {
        feature::sel::CURRENT => feature_value(ctrl, sqe, true),
        // Nothing is saveable: the saved value is the default (NVMe Base, Get Features SEL).
        feature::sel::DEFAULT | feature::sel::SAVED => feature_value(ctrl, sqe, false),
        // Changeable (bit 2); neither saveable (bit 0) nor namespace specific (bit 1).
        feature::sel::SUPPORTED_CAPABILITIES => Some(1 << 2),
        _ => None,
    };
    match value {
        Some(v) => Reply::dw0(v),
        None => Reply::status(Status::INVALID_FIELD.dnr()),
    }
}

fn set_features(ctrl: &Controller, sqe: &Sqe) -> Reply {
    if sqe.cdw(10) & (1 << 31) != 0 {
        return Reply::status(Status::FEATURE_NOT_SAVEABLE.dnr());
    }
    let fid = sqe.cdw(10) as u8;
    // Over fabrics the Host ID is the Connect's (NVMe Base, Host Identifier; nvmet the same).
    if fid == feature::HOST_IDENTIFIER && !ctrl.subsys.discovery {
        return Reply::status(Status::COMMAND_SEQUENCE_ERROR.dnr());
    }
    if !feature_known(ctrl, fid) {
        return Reply::status(Status::INVALID_FIELD.dnr());
    }
    let v = sqe.cdw(11);
    let invalid = Reply::status(Status::INVALID_FIELD.dnr());
    let mut st = ctrl.state.lock();
    match fid {
        feature::ARBITRATION => st.features.arbitration = v & 0xffff_ff07,
        // One power state (NPSS 0) and no workload hints.
        feature::POWER_MANAGEMENT if v & 0xff != 0 => return invalid,
        feature::POWER_MANAGEMENT => st.features.power_management = 0,
        feature::TEMPERATURE_THRESHOLD => {
            let Some(over) = temperature_select(v, true) else { return invalid };
            let before = temperature_alarm(&st.features);
            if over {
                st.features.temperature_over_k = v as u16;
            } else {
                st.features.temperature_under_k = v as u16;
            }
            // Once while pending: a host toggling the threshold must not grow the queue.
            if !before
                && temperature_alarm(&st.features)
                && st.async_event_config & AEC_TEMPERATURE != 0
                && !st.pending_events.contains(&AEN_TEMPERATURE)
            {
                st.pending_events.push_back(AEN_TEMPERATURE);
                drop(st);
                ctrl.events.notify_one();
            }
        }
        // DULBE (bit 16) needs NSFEAT bit 2, which no namespace sets.
        feature::ERROR_RECOVERY if v & !0xffff != 0 => return invalid,
        feature::ERROR_RECOVERY => st.features.error_recovery = v,
        feature::WRITE_ATOMICITY_NORMAL => st.features.write_atomicity = v & 1,
        // Index 0 is the only combination (Identify CNS 1Ch).
        feature::IO_COMMAND_SET_PROFILE if v & 0x1ff != 0 => return Reply::status(Status::IO_COMMAND_SET_COMBINATION_REJECTED.dnr()),
        feature::IO_COMMAND_SET_PROFILE => st.features.io_command_set_profile = 0,
        feature::NUMBER_OF_QUEUES => {
            let (nsq, ncq) = (v & 0xffff, v >> 16);
            if nsq == 0xffff || ncq == 0xffff {
                return invalid;
            }
            if !st.io_queues.is_empty() {
                return Reply::status(Status::COMMAND_SEQUENCE_ERROR.dnr());
            }
            let n = (nsq.min(ncq) + 1).min(limits::IO_QUEUES_MAX as u32) as u16;
            st.io_queues_granted = n;
            let g = (n - 1) as u32;
            return Reply::dw0(g | (g << 16));
        }
        feature::KEEP_ALIVE_TIMER => st.kato_ms = v,
        feature::ASYNC_EVENT_CONFIG => st.async_event_config = v,
        feature::VOLATILE_WRITE_CACHE => ctrl.write_cache.store(v & 1 != 0, Relaxed),
        _ => return invalid,
    }
    Reply::ok()
}

fn is_reservation_feature(sqe: &Sqe) -> bool {
    matches!(sqe.cdw(10) as u8, feature::RESERVATION_NOTIFICATION_MASK | feature::RESERVATION_PERSISTENCE)
}

/// Get Features 82h and 83h of one namespace: nothing is saveable, so the saved value is
/// the default (0: no notice masked, PTPL off).
fn get_reservation_feature(ctrl: &Controller, sqe: &Sqe) -> Reply {
    let Some(ns) = ctrl.subsys.namespace(sqe.nsid()) else {
        return Reply::status(Status::INVALID_NAMESPACE.dnr());
    };
    match ((sqe.cdw(10) >> 8) & 0x7, sqe.cdw(10) as u8) {
        (feature::sel::CURRENT, feature::RESERVATION_NOTIFICATION_MASK) => {
            Reply::dw0(ctrl.state.lock().resv_masks.get(&ns.nsid).copied().unwrap_or(0))
        }
        (feature::sel::CURRENT, _) => Reply::dw0(ns.reservations.ptpl() as u32),
        (feature::sel::DEFAULT | feature::sel::SAVED, _) => Reply::dw0(0),
        // Changeable (bit 2) and namespace specific (bit 1).
        (feature::sel::SUPPORTED_CAPABILITIES, _) => Reply::dw0((1 << 2) | (1 << 1)),
        _ => Reply::status(Status::INVALID_FIELD.dnr()),
    }
}

/// Notice types the Reservation Notification Mask may mask (bits 3:1).
const RESV_MASK_BITS: u32 = 0xe;

/// Set Features 82h (the notices masked for one namespace, or for all with NSID FFFFFFFFh)
/// and 83h (Persist Through Power Loss of one namespace, written before completion).
fn set_reservation_feature(ctrl: &Controller, sqe: &Sqe) -> Outcome {
    let fail = |s: Status| Outcome::Reply(Reply::status(s));
    if ctrl.subsys.discovery {
        return fail(Status::INVALID_FIELD.dnr());
    }
    if sqe.cdw(10) & (1 << 31) != 0 {
        return fail(Status::FEATURE_NOT_SAVEABLE.dnr());
    }
    let (fid, v, nsid) = (sqe.cdw(10) as u8, sqe.cdw(11), sqe.nsid());
    if fid == feature::RESERVATION_NOTIFICATION_MASK {
        if v & !RESV_MASK_BITS != 0 {
            return fail(Status::INVALID_FIELD.dnr());
        }
        let nsids = match nsid {
            0xffff_ffff => ctrl.subsys.nsids(),
            n if ctrl.subsys.namespace(n).is_some() => vec![n],
            _ => return fail(Status::INVALID_NAMESPACE.dnr()),
        };
        let mut st = ctrl.state.lock();
        for n in nsids {
            st.resv_masks.insert(n, v);
        }
        return Outcome::Reply(Reply::ok());
    }
    let Some(ns) = ctrl.subsys.namespace(nsid) else {
        return fail(Status::INVALID_NAMESPACE.dnr());
    };
    // It changes the namespace's reservation state, as Reservation Register does.
    if ctrl.tenant.check(&ctrl.subsys.nqn, nsid, None, true).is_err() {
        return fail(Status::ACCESS_DENIED.dnr());
    }
    let on = v & 1 != 0;
    if v & !1 != 0 || (on && ns.reservations.file.is_none()) {
        return fail(Status::INVALID_FIELD.dnr());
    }
    let r = ns.reservations.update(|s| {
        let changed = s.ptpl != on;
        s.ptpl = on;
        Ok(crate::reservation::Effects { changed, ..Default::default() })
    });
    match r {
        Ok((_, Some(snapshot))) => Outcome::Persist(ns, snapshot),
        Ok((_, None)) => Outcome::Reply(Reply::ok()),
        Err(s) => fail(s),
    }
}
