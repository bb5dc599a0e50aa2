//! Fabrics commands: Connect, Property Get, Property Set, Disconnect.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use nearstore_transport::AlignedBuf;
use nearstore_wire::fabrics::{cap, cc, connect, csts, prop, ConnectData, CONNECT_DATA_LEN, VERSION_1_3};
use nearstore_wire::opcode::fctype;
use nearstore_wire::{Sqe, Status};
use tokio::sync::mpsc::unbounded_channel;
use tracing::{debug, info, warn};

use crate::admin::DataLen;
use crate::admission::{QueueSlot, Ticket};
use crate::auth::HostKeys;
use crate::dev::Op;
use crate::io_pool::Job;
use crate::limits;
use crate::log_limit::peer_warn;
use crate::memory::Reservation;
use crate::reply::Reply;
use crate::subsystem::{Controller, ControllersFull, Subsystem};
use crate::tenant::Resolved;
use crate::Target;

/// What a successful Connect bound the queue to.
pub struct Connected {
    pub ctrl: Arc<Controller>,
    pub qid: u16,
    pub sqsize: u16,
    pub sqflow_disabled: bool,
    /// The Connect response's DW1: [`connect::ACTING_FOR_CONFIRMED`] when the connection
    /// acts for a host (its access was checked), else 0.
    pub dw1: u32,
    /// What the queue always holds ([`limits::connection_memory_fixed`]), reserved from the
    /// target's budget for as long as the connection lives; the queue grows it.
    pub memory: Reservation,
    /// Its place among its address's connected queues (None for in-process streams).
    pub slot: Option<QueueSlot>,
    /// The host's keys when it must authenticate the queue (crate::auth).
    pub auth: Option<Arc<HostKeys>>,
}

/// Byte offsets the Connect Invalid Parameters response points at.
const IPO_HOSTID: u16 = 0;
const IPO_QID: u16 = 42;
const IPO_SQSIZE: u16 = 44;
const IPO_CNTLID: u16 = 16;
const IPO_SUBNQN: u16 = 256;
const IPO_HOSTNQN: u16 = 512;
const IPO_ACTING_FOR: u16 = nearstore_wire::fabrics::ACTING_FOR_OFFSET as u16;

const NO_HOSTID: [u8; 16] = [0; 16];

fn invalid_param(in_data: bool, offset: u16) -> Reply {
    Reply { dw0: connect::invalid_param(in_data, offset), ..Reply::status(Status::CONNECT_INVALID_PARAMETERS.dnr()) }
}

/// Handles Connect. `discovery_port`: the connection came in on a discovery-only listener;
/// `ticket`: the connection's place among the target's (None for in-process streams).
pub fn connect(
    target: &Target,
    sqe: &Sqe,
    data: &[u8],
    discovery_port: bool,
    peer: &str,
    ticket: Option<&Ticket>,
) -> Result<Connected, Reply> {
    if connect::recfmt(sqe.cdw(10)) != 0 {
        return Err(Reply::status(Status::CONNECT_INCOMPATIBLE_FORMAT.dnr()));
    }
    let Some(d) = ConnectData::decode(data) else {
        return Err(Reply::status(Status::DATA_SGL_LENGTH_INVALID.dnr()));
    };
    let qid = connect::qid(sqe.cdw(10));
    let sqsize = connect::sqsize(sqe.cdw(11));
    let sqflow_disabled = connect::cattr(sqe.cdw(11)) & connect::CATTR_DISABLE_SQFLOW != 0;
    if sqsize == 0 {
        peer_warn!(target.log_limit, peer, "connect: queue size out of range", sqsize);
        return Err(invalid_param(false, IPO_SQSIZE));
    }
    let Some(sub) = target.subsystem(&d.subnqn) else {
        peer_warn!(target.log_limit, peer, "connect: no such subsystem", subnqn = %d.subnqn);
        return Err(invalid_param(true, IPO_SUBNQN));
    };
    // SQSIZE is 0's based: at most ASQSZ (admin; the discovery controller's is smaller) or
    // CAP.MQES + 1 (I/O) entries. More is Connect Invalid Parameters naming SQSIZE, as
    // Linux's target answers an SQSIZE above MQES.
    let entries_max = match (qid, sub.discovery) {
        (0, true) => limits::DISCOVERY_QUEUE_DEPTH_MAX,
        (0, false) => limits::ADMIN_QUEUE_DEPTH_MAX,
        _ => limits::QUEUE_DEPTH_MAX,
    };
    if sqsize >= entries_max {
        peer_warn!(target.log_limit, peer, "connect: queue size out of range", sqsize, entries_max);
        return Err(invalid_param(false, IPO_SQSIZE));
    }
    if discovery_port && !sub.discovery {
        peer_warn!(target.log_limit, peer, "connect: only the discovery subsystem is served on this port", subnqn = %d.subnqn);
        return Err(invalid_param(true, IPO_SUBNQN));
    }
    // nearstore extension: a trusted cluster member connecting for a host (it reads this
    // target for that host's compute command) is admitted only if that host itself is.
    let host = match &d.acting_for {
        None => &d.hostnqn,
        Some(h) => {
            if let Err(m) = crate::config::check_nqn(h) {
                peer_warn!(target.log_limit, peer, "connect: the host it acts for is not an NQN", hostnqn = %d.hostnqn, reason = %m);
                return Err(invalid_param(true, IPO_ACTING_FOR));
            }
            if !target.offload.peers.trusts(&d.hostnqn) {
                peer_warn!(target.log_limit, peer, "connect: acts for a host but is not in cluster.trusted_members", hostnqn = %d.hostnqn, acting_for = %h);
                return Err(Reply::status(Status::CONNECT_INVALID_HOST.dnr()));
            }
            h
        }
    };
    if !sub.host_allowed(host) {
        peer_warn!(target.log_limit, peer, "connect: host not allowed", hostnqn = %d.hostnqn, acting_for = ?d.acting_for, subnqn = %sub.nqn);
        return Err(Reply::status(Status::CONNECT_INVALID_HOST.dnr()));
    }
    let dw1 = if d.acting_for.is_some() { connect::ACTING_FOR_CONFIRMED } else { 0 };
    let slot = match ticket.map(Ticket::queue_slot) {
        None => None,
        Some(Some(s)) => Some(s),
        Some(None) => {
            target.stats.connects_refused_address.fetch_add(1, Relaxed);
            peer_warn!(
                target.log_limit,
                peer,
                "connect: this address holds its limit of connected queues (limits.queues_per_address)",
                limit = target.limits.queues_per_address
            );
            return Err(Reply::status(Status::CONNECT_CONTROLLER_BUSY));
        }
    };
    let memory = reserve_buffers(target, sqsize, peer)?;
    // The connecting host authenticates (a cluster member acting for a host: the member).
    let auth = sub.host_keys(&d.hostnqn);
    if qid == 0 {
        if d.cntlid != 0xffff {
            return Err(invalid_param(true, IPO_CNTLID));
        }
        let kato = connect::kato(sqe.cdw(12));
        let ctrl = admit(target, &sub, &d, host, kato, peer)?;
        ctrl.touch();
        info!(peer, subnqn = %sub.nqn, hostnqn = %d.hostnqn, acting_for = ?d.acting_for, cntlid = ctrl.cntlid, kato_ms = kato, tenant = %ctrl.tenant.name, "controller created");
        return Ok(Connected { ctrl, qid, sqsize, sqflow_disabled, dw1, memory, slot, auth });
    }
    if sub.discovery {
        return Err(invalid_param(false, IPO_QID));
    }
    let Some(ctrl) = sub.controller(d.cntlid) else {
        peer_warn!(target.log_limit, peer, "connect: I/O queue for an unknown controller", cntlid = d.cntlid);
        return Err(invalid_param(true, IPO_CNTLID));
    };
    if ctrl.revoked() {
        return Err(Reply::status(Status::CONNECT_INVALID_HOST.dnr()));
    }
    if ctrl.hostnqn != d.hostnqn {
        return Err(invalid_param(true, IPO_HOSTNQN));
    }
    if ctrl.acting_for != d.acting_for {
        return Err(invalid_param(true, IPO_ACTING_FOR));
    }
    // A Host ID of zero is no host identifier (NVMe Base, "Host Identifier"): it is ignored,
    // and only two identifiers that are both given can disagree.
    if d.hostid != NO_HOSTID && ctrl.hostid != NO_HOSTID && ctrl.hostid != d.hostid {
        peer_warn!(target.log_limit, peer, "connect: I/O queue host ID differs from the admin queue's", cntlid = d.cntlid);
        return Err(invalid_param(true, IPO_HOSTID));
    }
    let mut st = ctrl.state.lock();
    if st.csts & csts::RDY == 0 {
        return Err(Reply::status(Status::CONNECT_CONTROLLER_BUSY));
    }
    if qid > st.io_queues_granted || !st.io_queues.insert(qid) {
        peer_warn!(target.log_limit, peer, "connect: queue id not granted or already connected", qid, granted = st.io_queues_granted);
        return Err(invalid_param(false, IPO_QID));
    }
    drop(st);
    ctrl.touch();
    Ok(Connected { ctrl, qid, sqsize, sqflow_disabled, dw1, memory, slot, auth })
}

/// Adds the admin queue's controller under the tenant of `host` (the host whose access
/// this is: the one a member acts for). A reload (SIGHUP) that installs its table between
/// the resolution and the insertion sweeps before it can see the new controller: when the
/// table's generation moved meanwhile, the Connect checks its tenant again and, if the
/// reload changed it, takes the controller out and resolves once more under the new table.
fn admit(target: &Target, sub: &Arc<Subsystem>, d: &ConnectData, host: &str, kato: u32, peer: &str) -> Result<Arc<Controller>, Reply> {
    let member = d.acting_for.is_none() && target.offload.peers.trusts(&d.hostnqn);
    for _ in 0..limits::CONNECT_TENANT_RESOLVES_MAX {
        let generation = target.tenants.generation();
        let tenant = match target.tenants.resolve(host, sub.discovery, member) {
            Resolved::Tenant(t) if sub.discovery || t.reaches(&sub.nqn) => t,
            r => {
                let why = if r == Resolved::Refused { "in no tenant" } else { "its tenant does not reach the subsystem" };
                peer_warn!(target.log_limit, peer, "connect: host refused", hostnqn = %host, subnqn = %sub.nqn, why);
                return Err(Reply::status(Status::CONNECT_INVALID_HOST.dnr()));
            }
        };
        #[cfg(test)]
        if let Some(hook) = target.after_tenant_resolve.lock().take() {
            hook(target);
        }
        let per_host = target.limits.controllers_per_host;
        let ctrl = match sub.add_controller(&d.hostnqn, d.hostid, d.acting_for.as_deref(), kato, per_host, tenant) {
            Ok(c) => c,
            Err(full) => {
                if full == ControllersFull::Host {
                    target.stats.controllers_refused.fetch_add(1, Relaxed);
                }
                debug!(peer, subnqn = %sub.nqn, hostnqn = %d.hostnqn, ?full, "connect: no controller");
                return Err(Reply::status(Status::CONNECT_CONTROLLER_BUSY));
            }
        };
        if target.tenants.generation() == generation || target.tenants.keeps(&ctrl.tenant, host, sub.discovery, member) {
            return Ok(ctrl);
        }
        debug!(peer, subnqn = %sub.nqn, hostnqn = %host, tenant = %ctrl.tenant.name, "connect: a reload changed the tenant meanwhile; resolving again");
        ctrl.revoke();
        sub.remove_this_controller(&ctrl);
    }
    warn!(peer, subnqn = %sub.nqn, hostnqn = %host, "connect: the tenants were reloaded on every try (limits::CONNECT_TENANT_RESOLVES_MAX)");
    Err(Reply::status(Status::CONNECT_CONTROLLER_BUSY))
}

/// Reserves what a queue of `sqsize` (0's based) entries always holds
/// ([`limits::connection_memory_fixed`]) from the target's budget, leaving room for one
/// compute command and its result ([`crate::memory::Memory::reserve_queue`]). A full
/// budget is Connect Controller Busy without DNR: the host may retry once others have gone
/// (NVMe over Fabrics: the controller is busy), as it does when a subsystem has no
/// controller left.
fn reserve_buffers(target: &Target, sqsize: u16, peer: &str) -> Result<Reservation, Reply> {
    let entries = sqsize as usize + 1;
    target.memory.reserve_queue(entries, target.offload.cfg.command_bytes()).ok_or_else(|| {
        target.stats.connects_refused_memory.fetch_add(1, Relaxed);
        peer_warn!(
            target.log_limit,
            peer,
            "connect: the memory budget cannot hold this queue's buffers (limits.memory)",
            bytes = limits::connection_memory_fixed(entries),
            reserved = target.memory.used(),
            budget = target.memory.limit()
        );
        Reply::status(Status::CONNECT_CONTROLLER_BUSY)
    })
}

/// The data of a fabrics command (see [`DataLen`]): Connect's 1024 bytes, Authentication
/// Send's TL and Receive's AL, none for the others. An authentication command for another
/// security protocol (SECP, SPSP0, SPSP1 in CDW10), or of zero bytes, is Invalid Field
/// (as Linux's target), and so is a TL longer than the largest message a host sends
/// ([`limits::AUTH_SEND_BYTES_MAX`]): checked before anything is allocated.
pub fn data_len(sqe: &Sqe) -> Result<DataLen, Status> {
    match sqe.fctype() {
        fctype::CONNECT => Ok(DataLen::Exactly(CONNECT_DATA_LEN as u64)),
        fctype::PROPERTY_GET | fctype::PROPERTY_SET | fctype::DISCONNECT => Ok(DataLen::Exactly(0)),
        fctype::AUTH_SEND | fctype::AUTH_RECEIVE => {
            let len = sqe.cdw(11);
            let send = sqe.fctype() == fctype::AUTH_SEND;
            if sqe.cdw(10) & 0xffff_ff00 != nearstore_dhchap::msg::cdw10() || len == 0 || send && len as usize > limits::AUTH_SEND_BYTES_MAX
            {
                return Err(Status::INVALID_FIELD.dnr());
            }
            Ok(DataLen::Exactly(len as u64))
        }
        _ => Err(Status::INVALID_FIELD.dnr()),
    }
}

/// CAP as this target reports it.
pub fn cap_value() -> u64 {
    cap::build(limits::QUEUE_DEPTH_MAX - 1, limits::READY_TIMEOUT_500MS)
}

pub fn property_get(ctrl: &Controller, sqe: &Sqe) -> Reply {
    let size8 = sqe.cdw(10) & 0x7 == 1;
    let st = ctrl.state.lock();
    let v: u64 = match (sqe.cdw(11), size8) {
        (prop::CAP, _) => cap_value(),
        (prop::VS, false) => VERSION_1_3 as u64,
        (prop::CC, false) => st.cc as u64,
        (prop::CSTS, false) => st.csts as u64,
        _ => return Reply::status(Status::INVALID_FIELD.dnr()),
    };
    Reply { dw0: v as u32, dw1: (v >> 32) as u32, ..Reply::ok() }
}

/// Property Set of CC: enable, disable (reset) and shutdown. Shutdown flushes every
/// namespace before reporting complete, so a host that shuts down cleanly loses nothing:
/// CSTS.SHST says "occurring" (01b) until the flushes, on the I/O pool, are done, then
/// "complete" (10b), as the host polls it (NVMe base specification, "Shutdown").
pub fn property_set(target: &Target, peer: &str, ctrl: &Arc<Controller>, sqe: &Sqe) -> Reply {
    if sqe.cdw(10) & 0x7 != 0 || sqe.cdw(11) != prop::CC {
        return Reply::status(Status::INVALID_FIELD.dnr());
    }
    let new = sqe.cdw(12);
    let mut st = ctrl.state.lock();
    let old = st.cc;
    st.cc = new;
    if new & cc::EN != 0 && old & cc::EN == 0 {
        let io = !ctrl.subsys.discovery;
        // CSS: the NVM command set (000b) or all supported I/O command sets (110b, CAP.CSS
        // bit 6), which here is the NVM command set too; other values are unsupported and,
        // as for Linux's target, fail the enable with CSTS.CFS.
        let css_ok = matches!(cc::css(new), cc::CSS_NVM | cc::CSS_ALL_IO_COMMAND_SETS);
        if io && (cc::iosqes(new) != 6 || cc::iocqes(new) != 4) || cc::mps(new) != 0 || !css_ok {
            peer_warn!(
                target.log_limit,
                peer,
                "CC enable with unsupported queue entry size, page size or command set",
                cntlid = ctrl.cntlid,
                cc = new
            );
            st.csts = csts::CFS;
        } else {
            st.csts = csts::RDY;
        }
    } else if new & cc::EN == 0 && old & cc::EN != 0 {
        st.csts = 0;
    }
    if cc::shn(new) != 0 && cc::shn(old) == 0 {
        st.csts = (st.csts & !SHST) | csts::SHST_OCCURRING;
        drop(st);
        flush_for_shutdown(target, ctrl.clone());
    }
    Reply::ok()
}

/// CSTS.SHST, both bits.
const SHST: u32 = csts::SHST_OCCURRING | csts::SHST_COMPLETE;

/// Flushes every namespace of a controller being shut down, one I/O pool job each, then
/// reports the shutdown in CSTS. Not on the network thread: a flush can take seconds (a
/// large dirty page cache, a slow disk), and every connection on the thread waited for
/// it. A shutdown that lost data is not complete: a failed flush sets Controller Fatal
/// Status, the error no completion queue can carry, instead (the simulation found writes
/// lost after a shutdown reported complete). A reset (CC.EN cleared) meanwhile ends the
/// shutdown: then nothing is reported.
///
/// An exported volume's namespace is flushed through its device instead, as a host's Flush
/// is: every pool the volume reached, this target's and its peers', on a task of the
/// runtime (its pools' flushes run on the I/O pool and over NVMe/TCP, which a job on the
/// pool would wait for).
fn flush_for_shutdown(target: &Target, ctrl: Arc<Controller>) {
    let namespaces = ctrl.subsys.namespaces();
    let (tx, mut rx) = unbounded_channel();
    let mut volumes = Vec::new();
    for (i, ns) in namespaces.iter().enumerate() {
        if ns.placement.is_some() {
            volumes.push(ns.clone());
            continue;
        }
        let job = Job {
            backend: ns.backend.clone(),
            op: Op::Flush,
            buf: AlignedBuf::new(0),
            token: i as u64,
            reply: tx.clone(),
            holds: None,
            life: None,
        };
        target.pool.submit(job);
    }
    drop(tx);
    let pool = target.pool.clone();
    tokio::spawn(async move {
        let mut flushed = true;
        for ns in volumes {
            let mut ch = crate::dev::Channel::new(crate::config::IoEngine::Threads, pool.clone());
            if let Err(e) = ch.run(&*ns.dev, Op::Flush, AlignedBuf::new(0)).await.result {
                warn!(nsid = ns.nsid, cntlid = ctrl.cntlid, "flush of a volume's pools at shutdown failed: {e}");
                flushed = false;
            }
        }
        while let Some(done) = rx.recv().await {
            if let Err(e) = done.result {
                let nsid = namespaces.get(done.tag as usize).map_or(0, |ns| ns.nsid);
                warn!(nsid, cntlid = ctrl.cntlid, "flush at shutdown failed: {e}");
                flushed = false;
            }
        }
        let mut st = ctrl.state.lock();
        if st.csts & SHST == csts::SHST_OCCURRING {
            st.csts = (st.csts & !SHST) | if flushed { csts::SHST_COMPLETE } else { csts::CFS };
        }
    });
}

/// Whether a fabrics command type may run before the queue is connected.
pub fn is_connect(sqe: &Sqe) -> bool {
    sqe.fctype() == fctype::CONNECT
}

#[cfg(test)]
mod tests {
    use nearstore_wire::opcode::FABRICS;

    use super::*;
    use crate::config::Config;

    const SUB: &str = "nqn.2026-11.io.nearstore:a";
    const HOST: &str = "nqn.2014-08.org.example:h";

    /// One subsystem, which tenant `t` reaches; `t` holds HOST (unless `with_host` is false) at `io_weight`,
    /// tenant `u` another host when `other` is set.
    fn config(with_host: bool, io_weight: u32, other: bool) -> Config {
        let hosts = if with_host { format!("\"{HOST}\"") } else { String::new() };
        let u = if other { "[[tenant]]\nname = \"u\"\nhosts = [\"nqn.2014-08.org.example:i\"]\n" } else { "" };
        Config::from_toml(&format!(
            "[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"{SUB}\"\nallow_any_host = true\n\
             [[subsystem.namespace]]\nnsid = 1\nmemory = \"1MiB\"\n\
             [[tenant]]\nname = \"t\"\nhosts = [{hosts}]\nio_weight = {io_weight}\n[[tenant.reach]]\nsubsystem = \"{SUB}\"\n{u}"
        ))
        .unwrap()
    }

    fn connect_admin(target: &Target) -> Result<Connected, Reply> {
        let mut sqe = Sqe::new(FABRICS, 0);
        sqe.set_nsid(fctype::CONNECT as u32).set_cdw(10, 0).set_cdw(11, 31).set_cdw(12, 30_000);
        let d = ConnectData { hostid: [1; 16], cntlid: 0xffff, subnqn: SUB.into(), hostnqn: HOST.into(), acting_for: None }.encode();
        connect(target, &sqe, &d, false, "test", None)
    }

    /// A reload (its install and its sweep) lands between a Connect's tenant resolution
    /// and its controller's insertion, the window a SIGHUP can hit: the Connect must end
    /// under the new table, never holding the policy the reload revoked. Each line: the
    /// reloaded configuration, then the io_weight of the controller's tenant (None: the
    /// Connect is refused and leaves no controller).
    #[test]
    fn a_connect_racing_a_reload_takes_the_new_policy() {
        let cases: &[(&str, Option<Config>, Option<u32>)] = &[
            ("no reload", None, Some(100)),
            ("the host removed from its tenant", Some(config(false, 100, false)), None),
            ("its tenant's weight changed", Some(config(true, 300, false)), Some(300)),
            ("another tenant added", Some(config(true, 100, true)), Some(100)),
        ];
        for (what, reload, want) in cases {
            let target = Target::from_config(&config(true, 100, false)).unwrap();
            let reloaded = Arc::new(std::sync::atomic::AtomicBool::new(false));
            if let Some(cfg) = reload.clone() {
                let done = reloaded.clone();
                *target.after_tenant_resolve.lock() = Some(Box::new(move |t: &Target| {
                    t.reload_tenants(&cfg).unwrap();
                    done.store(true, Relaxed);
                }));
            }
            let sub = target.subsystem(SUB).unwrap();
            let got = connect_admin(&target);
            assert_eq!(reloaded.load(Relaxed), reload.is_some(), "{what}: the reload ran in the window");
            match (got, want) {
                (Ok(c), Some(w)) => {
                    assert_eq!(c.ctrl.tenant.io_weight, *w, "{what}");
                    assert!(!c.ctrl.revoked(), "{what}");
                    assert_eq!(sub.cntlids(), vec![c.ctrl.cntlid], "{what}: only its controller");
                    assert!(target.tenants.keeps(&c.ctrl.tenant, HOST, false, false), "{what}: it holds the current policy");
                }
                (Err(r), None) => {
                    assert_eq!(r.status, Status::CONNECT_INVALID_HOST.dnr(), "{what}");
                    assert_eq!(sub.controller_count(), 0, "{what}: no controller left");
                }
                (Ok(c), None) => panic!("{what}: connected under {} (io_weight {})", c.ctrl.tenant.name, c.ctrl.tenant.io_weight),
                (Err(r), Some(_)) => panic!("{what}: refused with {}", r.status),
            }
        }
    }
}
