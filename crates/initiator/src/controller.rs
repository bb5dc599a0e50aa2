//! A connected controller: admin queue, keep-alive, I/O queues.

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use nearstore_wire::compute::opcode as cop;
use nearstore_wire::fabrics::{cap, cc, connect, csts, prop, ConnectData};
use nearstore_wire::fused;
use nearstore_wire::identify::{self, IdentifyController, IdentifyNamespace, IDENTIFY_LEN};
use nearstore_wire::log::{self, get_log, DiscoveryEntry};
use nearstore_wire::opcode::{admin, cns, fctype, feature, io, lid, FABRICS};
use nearstore_wire::resv;
use nearstore_wire::sqe::fuse;
use nearstore_wire::{Cqe, Sqe, Status};
use tokio::net::TcpStream;
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use tracing::warn;

use crate::host::HostIds;
use crate::limits::{DISCOVERY_RECORDS_MAX, FETCH_BYTES_MAX, IN_CAPSULE_BYTES_MAX, TRANSFER_BYTES_MAX};
use crate::queue::{Data, QueueOptions, QueuePair};
use crate::{io_err, Error, Result};

#[derive(Clone, Debug)]
pub struct ConnectOptions {
    pub addr: SocketAddr,
    pub subnqn: String,
    pub hostnqn: String,
    pub hostid: [u8; 16],
    /// Keep-alive timeout; 0 disables keep-alive.
    pub kato_ms: u32,
    pub hdgst: bool,
    pub ddgst: bool,
    /// I/O queue depth.
    pub queue_depth: u16,
    /// Ask the controller to drop SQ flow control, so it may complete reads with the
    /// C2HData SUCCESS flag and no CapsuleResp.
    pub disable_sqflow: bool,
    /// How long one admin command may take.
    pub timeout: Duration,
    /// Send Keep Alive commands every KATO/2 (tests turn this off to see expiry).
    pub send_keep_alive: bool,
    /// I/O queues poll their socket this long before sleeping (see [`QueueOptions`]).
    pub busy_poll: Duration,
    /// nearstore extension: connect acting for this host (a target reading its peer for
    /// a host's command). The peer must confirm it checked the host, or the connection
    /// fails with [`Error::ActingForUnconfirmed`]. None: `hostnqn` acts for itself.
    pub acting_for: Option<String>,
    /// The host's DH-HMAC-CHAP secret (nvme-cli's `--dhchap-secret`): every queue whose
    /// Connect response asks for authentication authenticates with it (crate::auth).
    pub dhchap_secret: Option<nearstore_dhchap::Secret>,
    /// The controller's secret (`--dhchap-ctrl-secret`): the target must prove it holds
    /// it, or the connection fails. Given, every queue authenticates, asked or not.
    pub dhchap_ctrl_secret: Option<nearstore_dhchap::Secret>,
}

impl ConnectOptions {
    pub fn new(addr: SocketAddr, subnqn: &str) -> ConnectOptions {
        // This machine's identity, as nvme-cli's connections have it (crate::host); with a
        // malformed hostid file, the NQN's own (the CLI refuses the file instead).
        let HostIds { hostnqn, hostid } = crate::host::resolve(None, None).unwrap_or_else(|e| {
            tracing::warn!("{e}");
            let hostnqn = crate::host::default_hostnqn();
            HostIds { hostid: crate::host::hostid_of(&hostnqn), hostnqn }
        });
        ConnectOptions {
            addr,
            subnqn: subnqn.into(),
            hostnqn,
            hostid,
            kato_ms: crate::limits::KATO_MS_DEFAULT,
            hdgst: false,
            ddgst: false,
            queue_depth: 128,
            disable_sqflow: false,
            timeout: Duration::from_secs(30),
            send_keep_alive: true,
            busy_poll: Duration::ZERO,
            acting_for: None,
            dhchap_secret: None,
            dhchap_ctrl_secret: None,
        }
    }
}

async fn tcp(addr: SocketAddr) -> Result<TcpStream> {
    let s = TcpStream::connect(addr).await.map_err(io_err(format!("connecting to {addr}")))?;
    s.set_nodelay(true).map_err(io_err("setting TCP_NODELAY"))?;
    Ok(s)
}

/// Runs one command to completion on a queue; a non-success status is an error.
pub(crate) async fn run<S: nearstore_transport::Stream>(
    q: &mut QueuePair<S>,
    sqe: Sqe,
    data: Data<'_>,
    what: &str,
    timeout: Duration,
) -> Result<(Cqe, Vec<u8>)> {
    let cid = q.submit(sqe, data, u64::MAX)?;
    let mut out = Vec::new();
    let fut = q.wait(cid, |_, cqe, d| {
        if cqe.cid == cid {
            out.extend_from_slice(d);
        }
    });
    let cqe = tokio::time::timeout(timeout, fut).await.map_err(|_| Error::Timeout(what.into()))??;
    if !cqe.status.is_success() {
        return Err(Error::Status { what: what.into(), status: cqe.status, cqe });
    }
    Ok((cqe, out))
}

fn connect_sqe(opts: &ConnectOptions, qid: u16, sqsize: u16) -> Sqe {
    let mut s = Sqe::new(FABRICS, 0);
    s.set_nsid(fctype::CONNECT as u32);
    s.set_cdw(10, (qid as u32) << 16);
    let cattr = if opts.disable_sqflow { connect::CATTR_DISABLE_SQFLOW as u32 } else { 0 };
    s.set_cdw(11, (sqsize as u32 - 1) | (cattr << 16));
    s.set_cdw(12, if qid == 0 { opts.kato_ms } else { 0 });
    s
}

async fn connect_queue(opts: &ConnectOptions, qid: u16, depth: u16, cntlid: u16, qo: QueueOptions) -> Result<(QueuePair<TcpStream>, u16)> {
    // A target that stopped answering still completes the TCP handshake (its listen
    // backlog): the ICReq/ICResp exchange is bounded like every command.
    let connected = async { QueuePair::connect(tcp(opts.addr).await?, qo).await };
    let mut q = tokio::time::timeout(opts.timeout, connected)
        .await
        .map_err(|_| Error::Timeout(format!("connecting to {} (no ICResp within {:?})", opts.addr, opts.timeout)))??;
    let data = ConnectData {
        hostid: opts.hostid,
        cntlid,
        subnqn: opts.subnqn.clone(),
        hostnqn: opts.hostnqn.clone(),
        acting_for: opts.acting_for.clone(),
    }
    .encode();
    let (cqe, _) =
        run(&mut q, connect_sqe(opts, qid, depth), Data::Out(&data), &format!("Connect (queue {qid}) to {}", opts.subnqn), opts.timeout)
            .await?;
    if let Some(host) = &opts.acting_for {
        if cqe.dw1 != connect::ACTING_FOR_CONFIRMED {
            return Err(Error::ActingForUnconfirmed { subnqn: opts.subnqn.clone(), host: host.clone() });
        }
    }
    let asked = cqe.dw0 & connect::AUTHREQ_ATR != 0;
    match &opts.dhchap_secret {
        Some(k) if asked || opts.dhchap_ctrl_secret.is_some() => crate::auth::authenticate(&mut q, opts, k, qid).await?,
        None if asked => return Err(Error::AuthRequired { subnqn: opts.subnqn.clone(), hostnqn: opts.hostnqn.clone() }),
        _ => {}
    }
    Ok((q, cqe.dw0 as u16))
}

/// One instance of a controller (a CNTLID is reused once its controller is gone).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Instance {
    pub cntlid: u16,
    pub ciu: u8,
    pub cirn: u64,
}

pub struct Controller {
    admin: Arc<Mutex<QueuePair<TcpStream>>>,
    pub cntlid: u16,
    pub id: IdentifyController,
    pub cap: u64,
    pub opts: ConnectOptions,
    io_queues_granted: u16,
    keep_alive: Option<JoinHandle<()>>,
}

impl Drop for Controller {
    fn drop(&mut self) {
        if let Some(k) = self.keep_alive.take() {
            k.abort();
        }
    }
}

impl Controller {
    /// Connects the admin queue, enables the controller, identifies it, asks for I/O
    /// queues (I/O controllers), and starts sending keep-alives.
    pub async fn connect(opts: ConnectOptions) -> Result<Controller> {
        let qo = QueueOptions {
            hdgst: opts.hdgst,
            ddgst: opts.ddgst,
            depth: 32,
            max_transfer: TRANSFER_BYTES_MAX,
            in_capsule_max: 8192,
            busy_poll: Duration::ZERO,
        };
        let (mut q, cntlid) = connect_queue(&opts, 0, 32, 0xffff, qo).await?;
        let t = opts.timeout;
        let (c, _) = run(&mut q, prop_get(prop::CAP, true), Data::None, "Property Get CAP", t).await?;
        let capv = c.result64();
        run(&mut q, prop_set(prop::CC, cc::LINUX_ENABLE), Data::None, "Property Set CC.EN", t).await?;
        // CAP.TO (up to 127.5 s), but no longer than the caller's timeout.
        let ready_wait = Duration::from_millis(cap::timeout_ms(capv).max(500)).min(t);
        let deadline = tokio::time::Instant::now() + ready_wait;
        loop {
            let (c, _) = run(&mut q, prop_get(prop::CSTS, false), Data::None, "Property Get CSTS", t).await?;
            if c.dw0 & csts::CFS != 0 {
                return Err(Error::Protocol("controller fatal status after enable".into()));
            }
            if c.dw0 & csts::RDY != 0 {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                return Err(Error::Timeout("waiting for CSTS.RDY".into()));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut s = Sqe::new(admin::IDENTIFY, 0);
        s.set_cdw(10, cns::CONTROLLER as u32);
        let (_, d) = run(&mut q, s, Data::In(IDENTIFY_LEN), "Identify Controller", t).await?;
        let id = IdentifyController::decode(&d).ok_or_else(|| Error::Protocol("short Identify Controller".into()))?;
        if id.cntlid != cntlid {
            return Err(Error::Protocol(format!("Identify says controller {} but Connect said {cntlid}", id.cntlid)));
        }
        let mut granted = 0;
        if id.cntrltype != identify::cntrltype::DISCOVERY {
            let mut s = Sqe::new(admin::SET_FEATURES, 0);
            s.set_cdw(10, feature::NUMBER_OF_QUEUES as u32);
            s.set_cdw(11, 63 | (63 << 16));
            let (c, _) = run(&mut q, s, Data::None, "Set Features (Number of Queues)", t).await?;
            granted = ((c.dw0 & 0xffff).min(c.dw0 >> 16) + 1) as u16;
        }
        let admin = Arc::new(Mutex::new(q));
        let keep_alive = (opts.kato_ms > 0 && opts.send_keep_alive).then(|| {
            let admin = admin.clone();
            let period = Duration::from_millis((opts.kato_ms / 2).max(100) as u64);
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(period).await;
                    let mut q = admin.lock().await;
                    if let Err(e) = run(&mut q, Sqe::new(admin::KEEP_ALIVE, 0), Data::None, "Keep Alive", period * 2).await {
                        warn!("keep-alive failed, stopping: {e}");
                        return;
                    }
                }
            })
        });
        Ok(Controller { admin, cntlid, id, cap: capv, opts, io_queues_granted: granted, keep_alive })
    }

    /// Bytes the admin queue has sent and received on the wire (TCP payload).
    pub async fn admin_wire_bytes(&self) -> (u64, u64) {
        self.admin.lock().await.wire_bytes()
    }

    /// The admin queue itself, for commands sent together and their completions taken as
    /// they come (tests, tools). Nothing else uses it while it is held, keep-alives
    /// included: hold it for less than the keep-alive timeout, or connect without them.
    pub async fn admin_queue(&self) -> tokio::sync::MutexGuard<'_, QueuePair<TcpStream>> {
        self.admin.lock().await
    }

    /// Runs an admin command; data in the reply is returned.
    pub async fn admin(&self, sqe: Sqe, data: Data<'_>, what: &str) -> Result<(Cqe, Vec<u8>)> {
        let mut q = self.admin.lock().await;
        run(&mut q, sqe, data, what, self.opts.timeout).await
    }

    pub fn io_queues_granted(&self) -> u16 {
        self.io_queues_granted
    }

    /// Its keep-alive timeout, as asked for at Connect (zero: none).
    pub fn kato(&self) -> Duration {
        Duration::from_millis(u64::from(self.opts.kato_ms))
    }

    /// This controller instance as a Cross-Controller Reset names it: its CNTLID, CIU and
    /// CIRN (Identify Controller bytes 79:78, 135, 143:136).
    pub fn instance(&self) -> Instance {
        Instance { cntlid: self.cntlid, ciu: self.id.ciu, cirn: self.id.cirn }
    }

    /// Cross-Controller Reset (NVMe Base 2.3, admin 38h) of `other`, a controller of this
    /// host in the same subsystem that this host lost: it ends once nothing `other`
    /// started can still change storage (nearstore's targets complete the command only
    /// then), or fails. Waits at most `wait`.
    pub async fn cross_controller_reset(&self, other: Instance, wait: Duration) -> Result<()> {
        let mut s = Sqe::new(admin::CROSS_CONTROLLER_RESET, 0);
        s.set_cdw(10, u32::from(other.cntlid) | (u32::from(other.ciu) << 16));
        s.set_cdw(12, other.cirn as u32);
        s.set_cdw(13, (other.cirn >> 32) as u32);
        let mut q = self.admin.lock().await;
        run(&mut q, s, Data::None, "Cross-Controller Reset", wait).await.map(|_| ())
    }

    /// Fence Host Instances (nearstore's vendor admin C0h, docs/protocol.md): resets every
    /// controller of this host NQN whose Host Identifier has this one's first 8 bytes and
    /// differs from it (an earlier incarnation of this process), and completes once their
    /// work ended; Command Interrupted when it did not within the target's wait.
    pub async fn fence_host_instances(&self, wait: Duration) -> Result<()> {
        let s = Sqe::new(admin::FENCE_HOST_INSTANCES, 0);
        let mut q = self.admin.lock().await;
        run(&mut q, s, Data::None, "Fence Host Instances", wait).await.map(|_| ())
    }

    pub async fn identify_namespace(&self, nsid: u32) -> Result<IdentifyNamespace> {
        let mut s = Sqe::new(admin::IDENTIFY, 0);
        s.set_nsid(nsid).set_cdw(10, cns::NAMESPACE as u32);
        let (_, d) = self.admin(s, Data::In(IDENTIFY_LEN), &format!("Identify Namespace {nsid}")).await?;
        let id = IdentifyNamespace::decode(&d).ok_or_else(|| Error::Protocol("short Identify Namespace".into()))?;
        // An active namespace's block is 512 bytes or more (LBADS 9); one larger than a
        // transfer could not be read. Callers size reads by it.
        let max_lbads = TRANSFER_BYTES_MAX.trailing_zeros() as u8;
        if id.nsze != 0 && !(9..=max_lbads).contains(&id.lbads) {
            return Err(Error::Protocol(format!(
                "namespace {nsid} reports blocks of 2^{} bytes: not between 512 bytes and {TRANSFER_BYTES_MAX}",
                id.lbads
            )));
        }
        Ok(id)
    }

    pub async fn active_namespaces(&self) -> Result<Vec<u32>> {
        let mut s = Sqe::new(admin::IDENTIFY, 0);
        s.set_cdw(10, cns::ACTIVE_NS_LIST as u32);
        let (_, d) = self.admin(s, Data::In(IDENTIFY_LEN), "Identify Active Namespace List").await?;
        Ok(identify::decode_ns_list(&d))
    }

    pub async fn ns_descriptors(&self, nsid: u32) -> Result<Vec<(u8, Vec<u8>)>> {
        let mut s = Sqe::new(admin::IDENTIFY, 0);
        s.set_nsid(nsid).set_cdw(10, cns::NS_ID_DESCRIPTORS as u32);
        let (_, d) = self.admin(s, Data::In(IDENTIFY_LEN), "Identify Namespace Descriptors").await?;
        Ok(identify::decode_ns_descriptors(&d))
    }

    pub async fn get_log(&self, lid: u8, nsid: u32, len: u32, offset: u64) -> Result<Vec<u8>> {
        let mut s = Sqe::new(admin::GET_LOG_PAGE, 0);
        s.set_nsid(nsid);
        get_log::build(&mut s, lid, len, offset);
        Ok(self.admin(s, Data::In(len as usize), &format!("Get Log Page {lid:#04x}")).await?.1)
    }

    /// Reads the whole discovery log (header first, then all entries): at most
    /// [`DISCOVERY_RECORDS_MAX`] records, and the same count both times.
    pub async fn discovery_log(&self) -> Result<(u64, Vec<DiscoveryEntry>)> {
        let head = self.get_log(lid::DISCOVERY, 0, log::DISCOVERY_HEADER_LEN as u32, 0).await?;
        let short = |n: usize| Error::Protocol(format!("discovery log of {n} bytes, shorter than its header"));
        let n = head.get(8..16).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes).ok_or_else(|| short(head.len()))?;
        if n > DISCOVERY_RECORDS_MAX as u64 {
            return Err(Error::Protocol(format!(
                "discovery log of {n} records, more than the {DISCOVERY_RECORDS_MAX} this initiator reads"
            )));
        }
        let len = (n as usize + 1) * log::DISCOVERY_ENTRY_LEN;
        let full = self.get_log(lid::DISCOVERY, 0, len as u32, 0).await?;
        let (genctr, entries) = log::decode_discovery_log(&full).ok_or_else(|| short(full.len()))?;
        if entries.len() as u64 != n {
            return Err(Error::Protocol(format!("discovery log changed while read: {n} records, then {}", entries.len())));
        }
        Ok((genctr, entries))
    }

    pub async fn get_feature(&self, fid: u8) -> Result<u32> {
        let mut s = Sqe::new(admin::GET_FEATURES, 0);
        s.set_cdw(10, fid as u32);
        Ok(self.admin(s, Data::None, &format!("Get Features {fid:#04x}")).await?.0.dw0)
    }

    pub async fn set_feature(&self, fid: u8, value: u32) -> Result<u32> {
        let mut s = Sqe::new(admin::SET_FEATURES, 0);
        s.set_cdw(10, fid as u32).set_cdw(11, value);
        Ok(self.admin(s, Data::None, &format!("Set Features {fid:#04x}")).await?.0.dw0)
    }

    /// Opens I/O queue `qid` (1-based) on its own connection.
    pub async fn io_queue(&self, qid: u16) -> Result<IoQueue> {
        let qo = QueueOptions {
            hdgst: self.opts.hdgst,
            ddgst: self.opts.ddgst,
            depth: self.opts.queue_depth,
            max_transfer: self.id.max_transfer().map_or(TRANSFER_BYTES_MAX, |m| (m as usize).min(TRANSFER_BYTES_MAX)),
            in_capsule_max: (self.id.in_capsule_max() as usize).min(IN_CAPSULE_BYTES_MAX),
            busy_poll: self.opts.busy_poll,
        };
        let (q, _) = connect_queue(&self.opts, qid, self.opts.queue_depth, self.cntlid, qo).await?;
        Ok(IoQueue { q, timeout: self.opts.timeout })
    }

    /// Shuts the controller down cleanly (CC.SHN), which flushes the target's namespaces.
    pub async fn shutdown(mut self) -> Result<()> {
        if let Some(k) = self.keep_alive.take() {
            k.abort();
        }
        self.admin(prop_set(prop::CC, cc::LINUX_ENABLE | cc::SHN_NORMAL), Data::None, "Property Set CC.SHN").await?;
        for _ in 0..500 {
            let (c, _) = self.admin(prop_get(prop::CSTS, false), Data::None, "Property Get CSTS").await?;
            if c.dw0 & csts::SHST_COMPLETE != 0 {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err(Error::Timeout("shutdown".into()))
    }
}

pub fn prop_get(ofst: u32, eight: bool) -> Sqe {
    let mut s = Sqe::new(FABRICS, 0);
    s.set_nsid(fctype::PROPERTY_GET as u32).set_cdw(10, eight as u32).set_cdw(11, ofst);
    s
}

pub fn prop_set(ofst: u32, value: u32) -> Sqe {
    let mut s = Sqe::new(FABRICS, 0);
    s.set_nsid(fctype::PROPERTY_SET as u32).set_cdw(10, 0).set_cdw(11, ofst).set_cdw(12, value);
    s
}

/// The completions of a Compare and Write pair.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct CompareAndWrite {
    /// The Compare's: success, Compare Failure, or why the pair did not run.
    pub compare: Status,
    /// The Write's: success, or Command Aborted due to Failed Fused Command when the
    /// Compare failed.
    pub write: Status,
}

impl CompareAndWrite {
    /// The blocks were equal and are written.
    pub fn written(&self) -> bool {
        self.compare.is_success() && self.write.is_success()
    }

    /// The Compare found the blocks different (nothing written).
    pub fn differed(&self) -> bool {
        self.compare.sct == Status::COMPARE_FAILURE.sct && self.compare.sc == Status::COMPARE_FAILURE.sc
    }
}

/// Blocks in `data`, a non-empty whole number of `block_size`-byte blocks.
pub(crate) fn whole_blocks(data: &[u8], block_size: u32) -> Result<u32> {
    if data.is_empty() || !data.len().is_multiple_of(block_size as usize) {
        return Err(Error::Invalid(format!("{} bytes are not a whole number of {block_size}-byte blocks", data.len())));
    }
    u32::try_from(data.len() / block_size as usize).map_err(|_| Error::Invalid(format!("{} bytes: too many blocks", data.len())))
}

/// An I/O queue with one-command-at-a-time helpers; [`IoQueue::queue`] gives the
/// [`QueuePair`] for pipelined use.
pub struct IoQueue {
    pub(crate) q: QueuePair<TcpStream>,
    pub(crate) timeout: Duration,
}

impl IoQueue {
    pub fn queue(&mut self) -> &mut QueuePair<TcpStream> {
        &mut self.q
    }

    /// Bytes this queue has sent and received on the wire (TCP payload).
    pub fn wire_bytes(&self) -> (u64, u64) {
        self.q.wire_bytes()
    }

    /// The largest data one command may carry on this queue (the controller's MDTS, at most
    /// this initiator's own limit).
    pub fn max_transfer(&self) -> usize {
        self.q.options().max_transfer
    }

    pub async fn read(&mut self, nsid: u32, slba: u64, nlb: u32, block_size: u32) -> Result<Vec<u8>> {
        let len = nlb as usize * block_size as usize;
        let (_, d) =
            run(&mut self.q, Sqe::rw(io::READ, nsid, slba, nlb, false), Data::In(len), &format!("Read LBA {slba}+{nlb}"), self.timeout)
                .await?;
        Ok(d)
    }

    pub async fn write(&mut self, nsid: u32, slba: u64, data: &[u8], block_size: u32, fua: bool) -> Result<()> {
        if data.is_empty() || !data.len().is_multiple_of(block_size as usize) {
            return Err(Error::Invalid(format!("write of {} bytes is not a whole number of {block_size}-byte blocks", data.len())));
        }
        let nlb = (data.len() / block_size as usize) as u32;
        run(&mut self.q, Sqe::rw(io::WRITE, nsid, slba, nlb, fua), Data::Out(data), &format!("Write LBA {slba}+{nlb}"), self.timeout)
            .await?;
        Ok(())
    }

    /// Compare (05h): true when the `data.len()` bytes of blocks at `slba` equal `data`,
    /// false on Compare Failure; any other status is an error.
    pub async fn compare(&mut self, nsid: u32, slba: u64, data: &[u8], block_size: u32) -> Result<bool> {
        let nlb = whole_blocks(data, block_size)?;
        let what = format!("Compare LBA {slba}+{nlb}");
        match run(&mut self.q, Sqe::rw(io::COMPARE, nsid, slba, nlb, false), Data::Out(data), &what, self.timeout).await {
            Ok(_) => Ok(true),
            Err(Error::Status { status, .. }) if status.sct == Status::COMPARE_FAILURE.sct && status.sc == Status::COMPARE_FAILURE.sc => {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Compare and Write, the fused pair (docs/protocol.md, "Compare and Write"): a
    /// Compare of `compare` (FUSE first) and right after it a Write of `write` (FUSE
    /// second) over the same blocks at `slba`, sent together. The target writes only if
    /// the blocks equal `compare`, atomically against its other writers. Both completions'
    /// statuses come back, whatever they are ([`CompareAndWrite::written`]).
    pub async fn compare_and_write(
        &mut self,
        nsid: u32,
        slba: u64,
        compare: &[u8],
        write: &[u8],
        block_size: u32,
        fua: bool,
    ) -> Result<CompareAndWrite> {
        let nlb = whole_blocks(compare, block_size)?;
        if write.len() != compare.len() {
            return Err(Error::Invalid(format!(
                "a Compare of {} bytes and a Write of {} name different blocks",
                compare.len(),
                write.len()
            )));
        }
        let mut first = Sqe::rw(io::COMPARE, nsid, slba, nlb, false);
        first.set_fuse(fuse::FIRST);
        let mut second = Sqe::rw(io::WRITE, nsid, slba, nlb, fua);
        second.set_fuse(fuse::SECOND);
        self.fused_pair(first, compare, second, write, &format!("Compare and Write LBA {slba}+{nlb}")).await
    }

    /// Sends `first` and `second` (their FUSE bits already set) back to back, with their
    /// data, and waits for both completions. Nothing else may be in flight on the queue
    /// between them: the two are queued together.
    pub async fn fused_pair(
        &mut self,
        first: Sqe,
        first_data: &[u8],
        second: Sqe,
        second_data: &[u8],
        what: &str,
    ) -> Result<CompareAndWrite> {
        if self.q.depth() < self.q.in_flight() + 2 {
            return Err(Error::QueueFull(self.q.in_flight()));
        }
        const TAGS: [u64; 2] = [u64::MAX - 2, u64::MAX - 1];
        let c1 = self.q.submit(first, Data::Out(first_data), TAGS[0])?;
        let c2 = self.q.submit(second, Data::Out(second_data), TAGS[1])?;
        let mut got: [Option<Status>; 2] = [None, None];
        let q = &mut self.q;
        let wait = async {
            while got.iter().any(Option::is_none) {
                q.poll(|tag, cqe, _| {
                    for (i, (cid, t)) in [(c1, TAGS[0]), (c2, TAGS[1])].into_iter().enumerate() {
                        if cqe.cid == cid && tag == t {
                            got[i] = Some(cqe.status);
                        }
                    }
                })
                .await?;
            }
            Ok::<_, Error>(())
        };
        tokio::time::timeout(self.timeout, wait).await.map_err(|_| Error::Timeout(what.into()))??;
        let [Some(compare), Some(write)] = got else { return Err(Error::Protocol(format!("{what}: a completion is missing"))) };
        Ok(CompareAndWrite { compare, write })
    }

    pub async fn flush(&mut self, nsid: u32) -> Result<()> {
        let mut s = Sqe::new(io::FLUSH, 0);
        s.set_nsid(nsid);
        run(&mut self.q, s, Data::None, "Flush", self.timeout).await?;
        Ok(())
    }

    pub async fn write_zeroes(&mut self, nsid: u32, slba: u64, nlb: u32, deallocate: bool) -> Result<()> {
        let mut s = Sqe::rw(io::WRITE_ZEROES, nsid, slba, nlb, false);
        if deallocate {
            s.set_cdw(12, s.cdw(12) | (1 << 25));
        }
        run(&mut self.q, s, Data::None, "Write Zeroes", self.timeout).await?;
        Ok(())
    }

    /// Dataset Management with the Deallocate attribute for (slba, nlb) ranges.
    pub async fn deallocate(&mut self, nsid: u32, ranges: &[(u64, u32)]) -> Result<()> {
        if ranges.is_empty() || ranges.len() > 256 {
            return Err(Error::Invalid("between 1 and 256 ranges".into()));
        }
        let mut d = vec![0u8; ranges.len() * 16];
        for (i, (slba, nlb)) in ranges.iter().enumerate() {
            d[i * 16 + 4..i * 16 + 8].copy_from_slice(&nlb.to_le_bytes());
            d[i * 16 + 8..i * 16 + 16].copy_from_slice(&slba.to_le_bytes());
        }
        let mut s = Sqe::new(io::DATASET_MANAGEMENT, 0);
        s.set_nsid(nsid).set_cdw(10, ranges.len() as u32 - 1).set_cdw(11, 1 << 2);
        run(&mut self.q, s, Data::Out(&d), "Dataset Management (deallocate)", self.timeout).await?;
        Ok(())
    }

    /// Reservation Register with these CDW10 fields (action, IEKEY, CPTPL) and keys
    /// (CRKEY, NRKEY).
    pub async fn resv_register(&mut self, nsid: u32, cdw10: resv::Cdw10, keys: resv::Keys) -> Result<()> {
        self.resv(io::RESERVATION_REGISTER, nsid, cdw10, &keys.encode(), "Reservation Register").await
    }

    /// Reservation Acquire with these CDW10 fields (action, type) and keys (CRKEY, PRKEY).
    pub async fn resv_acquire(&mut self, nsid: u32, cdw10: resv::Cdw10, keys: resv::Keys) -> Result<()> {
        self.resv(io::RESERVATION_ACQUIRE, nsid, cdw10, &keys.encode(), "Reservation Acquire").await
    }

    /// Reservation Release with these CDW10 fields (action, type) and the current key.
    pub async fn resv_release(&mut self, nsid: u32, cdw10: resv::Cdw10, crkey: u64) -> Result<()> {
        self.resv(io::RESERVATION_RELEASE, nsid, cdw10, &crkey.to_le_bytes(), "Reservation Release").await
    }

    async fn resv(&mut self, opcode: u8, nsid: u32, cdw10: resv::Cdw10, data: &[u8], what: &str) -> Result<()> {
        let mut s = Sqe::new(opcode, 0);
        s.set_nsid(nsid).set_cdw(10, cdw10.encode());
        run(&mut self.q, s, Data::Out(data), what, self.timeout).await?;
        Ok(())
    }

    /// Reservation Report (extended data structure) of `len` bytes, a multiple of 4.
    pub async fn resv_report_len(&mut self, nsid: u32, len: u32) -> Result<resv::ReservationStatus> {
        if len < 4 || !len.is_multiple_of(4) {
            return Err(Error::Invalid(format!("a report of {len} bytes is not a whole number of dwords")));
        }
        let mut s = Sqe::new(io::RESERVATION_REPORT, 0);
        s.set_nsid(nsid).set_cdw(10, len / 4 - 1).set_cdw(11, resv::REPORT_EDS);
        let (_, d) = run(&mut self.q, s, Data::In(len as usize), "Reservation Report", self.timeout).await?;
        resv::ReservationStatus::decode(&d).ok_or_else(|| Error::Protocol(format!("Reservation Report of {} bytes", d.len())))
    }

    /// The whole Reservation Report: the header first, then every registrant that fits
    /// this queue's largest transfer.
    pub async fn resv_report(&mut self, nsid: u32) -> Result<resv::ReservationStatus> {
        let head = self.resv_report_len(nsid, resv::STATUS_EXT_HEADER_LEN as u32).await?;
        let max = self.q.options().max_transfer.min(128 * 1024);
        let len = (resv::STATUS_EXT_HEADER_LEN + head.regctl as usize * resv::REGISTRANT_EXT_LEN).min(max);
        self.resv_report_len(nsid, len as u32).await
    }

    /// Runs a compute command (docs/compute-protocol.md): EXEC with the encoded
    /// descriptor, then FETCH of the whole result. A refused or failed command returns
    /// [`Error::Compute`] with the target's status and its message, fetched the same way.
    pub async fn compute(&mut self, nsid: u32, descriptor: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        self.compute_at_most(nsid, descriptor, timeout, FETCH_BYTES_MAX).await
    }

    /// [`compute`](Self::compute) taking a result of at most `max` bytes: a larger one is
    /// RELEASEd unread and the call fails with [`Error::Protocol`] (a target forwarding a
    /// command holds only its own result bound for the peer's answer).
    pub async fn compute_at_most(&mut self, nsid: u32, descriptor: &[u8], timeout: Duration, max: usize) -> Result<Vec<u8>> {
        let cqe = self.exec(nsid, descriptor, timeout).await?;
        self.fetch_result(&cqe, max).await
    }

    /// EXEC of a compute command: its completion, whose DW0 and DW1 hold its result's handle
    /// and length ([`fetch_result`](Self::fetch_result)), or [`Error::Compute`] with the
    /// target's status and message. Any other error means that no completion came: the
    /// command may still run at the target.
    pub async fn exec(&mut self, nsid: u32, descriptor: &[u8], timeout: Duration) -> Result<Cqe> {
        let mut s = Sqe::new(cop::EXEC, 0);
        s.set_nsid(nsid);
        match run(&mut self.q, s, Data::Out(descriptor), "compute EXEC", timeout).await {
            Ok((cqe, _)) => Ok(cqe),
            Err(Error::Status { status, cqe, .. }) => {
                // The target answered: whatever befalls its message, the command has ended.
                let message = if cqe.dw0 != 0 {
                    match self.fetch(cqe.dw0, cqe.dw1).await {
                        Ok(m) => String::from_utf8_lossy(&m).into_owned(),
                        Err(e) => format!("(its message could not be fetched: {e})"),
                    }
                } else {
                    String::new()
                };
                Err(Error::Compute { status, message })
            }
            Err(e) => Err(e),
        }
    }

    /// FETCHes the result an EXEC completed with (`cqe`), if it is at most `max` bytes; a
    /// larger one is RELEASEd unread and the call fails with [`Error::Protocol`].
    pub async fn fetch_result(&mut self, cqe: &Cqe, max: usize) -> Result<Vec<u8>> {
        if cqe.dw1 as usize > max.min(FETCH_BYTES_MAX) {
            // The handle would hold the target's memory until it expires.
            let _ = self.release(cqe.dw0).await;
            return Err(Error::Protocol(format!(
                "a result of {} bytes, more than the {} this call takes",
                cqe.dw1,
                max.min(FETCH_BYTES_MAX)
            )));
        }
        self.fetch(cqe.dw0, cqe.dw1).await
    }

    /// FETCHes `len` bytes held under `handle`, in transfers of at most the queue's
    /// largest; the last releases the handle. At most [`FETCH_BYTES_MAX`], and never more
    /// than `len`, whatever the target says remains.
    pub async fn fetch(&mut self, handle: u32, len: u32) -> Result<Vec<u8>> {
        let len = len as usize;
        if len > FETCH_BYTES_MAX {
            return Err(Error::Protocol(format!("a result of {len} bytes, more than the {FETCH_BYTES_MAX} this initiator fetches")));
        }
        let max = self.q.options().max_transfer.min(128 * 1024);
        let mut out = Vec::with_capacity(len);
        loop {
            let want = (len - out.len()).clamp(1, max);
            let mut s = Sqe::new(cop::FETCH, 0);
            s.set_cdw(10, handle).set_cdw(11, out.len() as u32);
            let (cqe, d) = run(&mut self.q, s, Data::In(want), "compute FETCH", self.timeout).await?;
            let valid = (cqe.dw0 as usize).min(d.len());
            if out.len() + valid > len || (cqe.dw1 != 0 && out.len() + valid == len && valid > 0) {
                return Err(Error::Protocol(format!(
                    "FETCH of handle {handle} returns more than the {len} bytes its result has ({} valid at byte {}, {} remaining)",
                    valid,
                    out.len(),
                    cqe.dw1
                )));
            }
            out.extend_from_slice(&d[..valid]);
            if cqe.dw1 == 0 || valid == 0 {
                return Ok(out);
            }
        }
    }

    /// FUSED WRITE (docs/compute-protocol.md, "Fused write operations"): `transfer` is the
    /// encoded descriptor and its data (`nearstore_wire::fused::Fused::encode`). Returns
    /// the completion's DW0 (crc32c of the bytes written) and DW1 (their count), once the
    /// target's journal made them durable.
    pub async fn fused_write(&mut self, nsid: u32, transfer: &[u8]) -> Result<(u32, u32)> {
        let mut s = Sqe::new(fused::opcode::FUSED_WRITE, 0);
        s.set_nsid(nsid);
        let (cqe, _) = run(&mut self.q, s, Data::Out(transfer), "FUSED WRITE", self.timeout).await?;
        Ok((cqe.dw0, cqe.dw1))
    }

    /// READ CHECKSUM of `nlb` blocks at `slba`: the blocks, and the crc32c the target
    /// computed of `sum` (byte range) of them.
    pub async fn read_checksum(&mut self, nsid: u32, slba: u64, nlb: u32, block_size: u32, sum: Range<u32>) -> Result<(Vec<u8>, u32)> {
        let len = nlb as usize * block_size as usize;
        let mut s = Sqe::rw(fused::opcode::READ_CHECKSUM, nsid, slba, nlb, false);
        s.set_cdw(13, sum.start).set_cdw(14, sum.end.saturating_sub(sum.start));
        let (cqe, d) = run(&mut self.q, s, Data::In(len), &format!("READ CHECKSUM LBA {slba}+{nlb}"), self.timeout).await?;
        Ok((d, cqe.dw0))
    }

    /// OUTCOME of transaction `txid`: its state (`nearstore_wire::fused::state`) and
    /// result (crc32c, count, end; zero unless committed).
    pub async fn outcome(&mut self, nsid: u32, txid: u64) -> Result<(u32, [u8; fused::RESULT_BYTES])> {
        let mut s = Sqe::new(fused::opcode::OUTCOME, 0);
        s.set_nsid(nsid).set_cdw(10, txid as u32).set_cdw(11, (txid >> 32) as u32);
        let (cqe, d) = run(&mut self.q, s, Data::In(fused::RESULT_BYTES), "OUTCOME", self.timeout).await?;
        let r = d.as_slice().try_into().map_err(|_| Error::Protocol(format!("OUTCOME returned {} bytes", d.len())))?;
        Ok((cqe.dw0, r))
    }

    /// RELEASEs a held result before it expires.
    pub async fn release(&mut self, handle: u32) -> Result<()> {
        let mut s = Sqe::new(cop::RELEASE, 0);
        s.set_cdw(10, handle);
        run(&mut self.q, s, Data::None, "compute RELEASE", self.timeout).await?;
        Ok(())
    }
}
