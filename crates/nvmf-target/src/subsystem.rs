//! Subsystems, namespaces and controllers: the state the command handlers work on.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, Ordering::Relaxed};
use std::sync::Arc;

use nearstore_wire::log::ErrorEntry;
use nearstore_wire::resv::{NoticeLog, ReservationStatus, AEN_RESERVATION_LOG};
use nearstore_wire::Status;
use parking_lot::{Mutex, RwLock};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::auth::HostKeys;
use crate::backend::Backend;
use crate::dev::{self, BlockDevice};
use crate::io_pool::Done;
use crate::limits;
use crate::metrics::NsStats;
use crate::reservation::{Access, Effects, HostId, Reservations};
use crate::tenant::TenantPolicy;

pub struct Namespace {
    pub nsid: u32,
    /// The synchronous storage, for the offload engine and shutdown flushes.
    pub backend: Arc<dyn Backend>,
    /// The device stack every NVMe I/O command goes through: a [`dev::local::Local`] over
    /// `backend`, under the devices the configuration stacks on it.
    pub dev: Arc<dyn BlockDevice>,
    pub block_size: u32,
    pub lba_shift: u32,
    /// Capacity in logical blocks (NSZE).
    pub blocks: u64,
    pub nguid: [u8; 16],
    pub uuid: [u8; 16],
    pub stats: NsStats,
    /// Its tag in the cluster map, if it has one: extents tagged with it are local.
    pub tag: Option<u16>,
    pub reservations: NsReservations,
    /// An exported volume's data-path counters, when the namespace is one (metrics).
    pub volume: Option<Arc<crate::dev::volume::VolumeStats>>,
    /// An exported volume's translation, when the namespace is one: its compute commands run
    /// where their bytes lie (`offload/volume.rs`).
    pub placement: Option<crate::dev::volume::Volume>,
    /// Its MicroTx journal, for fused write operations (`microtx = true`).
    pub journal: Option<Arc<crate::microtx::Journal>>,
    /// Why it serves no I/O (Namespace Not Ready): its journal could not be opened or
    /// replayed at start-up (its device stack is `dev::fence::Offline`).
    pub offline: Option<String>,
    /// Its range locks: Compare and Write exclusive, every other writer shared
    /// (range_lock.rs).
    pub ranges: Arc<crate::range_lock::RangeLocks>,
}

impl Namespace {
    pub fn new(subnqn: &str, nsid: u32, backend: Arc<dyn Backend>, block_size: u32) -> Namespace {
        let key = format!("{subnqn}/ns/{nsid}");
        let uuid = *uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_URL, key.as_bytes()).as_bytes();
        let nguid = *uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, key.as_bytes()).as_bytes();
        Namespace {
            nsid,
            blocks: backend.size() / block_size as u64,
            dev: Arc::new(dev::local::Local::new(backend.clone())),
            backend,
            block_size,
            lba_shift: block_size.trailing_zeros(),
            nguid,
            uuid,
            stats: NsStats::default(),
            tag: None,
            reservations: NsReservations::new(None),
            volume: None,
            placement: None,
            journal: None,
            offline: None,
            ranges: Arc::default(),
        }
    }

    /// Keeps `journal` as its MicroTx journal, its device stack under the journal's fence
    /// (`dev::fence::Fenced`), which every I/O of its blocks meets.
    pub fn with_journal(mut self, journal: Arc<crate::microtx::Journal>) -> Namespace {
        self.dev = Arc::new(dev::fence::Fenced::new(self.dev, journal.clone(), self.backend.clone()));
        self.journal = Some(journal);
        self
    }

    /// Serves no I/O, for `why` (Namespace Not Ready, `dev::fence::Offline`).
    pub fn into_offline(mut self, why: String) -> Namespace {
        self.dev = Arc::new(dev::fence::Offline::new(self.dev, why.clone()));
        self.offline = Some(why);
        self
    }

    /// The status I/O of `len` bytes at `off` is refused with now, for the users that reach
    /// the storage without its device stack (Compare and Write, whose `dev::fence` this
    /// stands for): the namespace offline, or blocks its journal fenced (then the journal
    /// tries again to finish their transaction).
    pub fn fenced(&self, off: u64, len: u64) -> Option<Status> {
        if self.offline.is_some() {
            return Some(Status::NAMESPACE_NOT_READY.dnr());
        }
        let journal = self.journal.as_ref()?;
        if !journal.fence().holds(off, len) {
            return None;
        }
        journal.kick(self.backend.clone());
        Some(Status::COMMAND_INTERRUPTED)
    }

    /// Byte offset and length of `nlb` blocks at `slba`, if they lie inside the namespace.
    pub fn range(&self, slba: u64, nlb: u64) -> Option<(u64, u64)> {
        let end = slba.checked_add(nlb)?;
        (end <= self.blocks).then(|| (slba << self.lba_shift, nlb << self.lba_shift))
    }
}

/// A snapshot of a namespace's reservation state to write to its state file (None: PTPL
/// was turned off, remove the file), with the version it has.
pub struct Snapshot {
    version: u64,
    bytes: Option<Vec<u8>>,
}

/// A namespace's reservations, shared by every controller of the subsystem.
pub struct NsReservations {
    /// The state and its version (incremented with every snapshot).
    state: Mutex<(Reservations, u64)>,
    /// A reservation exists: only then does an I/O command look at the state.
    active: AtomicBool,
    /// Where the state persists while PTPL is set; None: this namespace cannot persist it.
    pub file: Option<PathBuf>,
    /// The version last written to the file.
    written: Mutex<u64>,
}

impl NsReservations {
    pub fn new(file: Option<PathBuf>) -> NsReservations {
        NsReservations { state: Mutex::new((Reservations::default(), 0)), active: AtomicBool::new(false), file, written: Mutex::new(0) }
    }

    /// Reservations persisting in `file`, read from it if it exists.
    pub fn load(file: PathBuf) -> Result<NsReservations, String> {
        let state = match std::fs::read(&file) {
            Ok(b) => Reservations::decode_file(&b, limits::RESERVATION_REGISTRANTS_MAX)
                .map_err(|e| format!("reservation state file {}: {e}", file.display()))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Reservations::default(),
            Err(e) => return Err(format!("reading reservation state file {}: {e}", file.display())),
        };
        let r = NsReservations::new(Some(file));
        r.active.store(state.rtype.is_some(), Ordering::Release);
        r.state.lock().0 = state;
        Ok(r)
    }

    /// Whether `host` may run a command of this group now.
    pub fn allows(&self, host: &HostId, access: Access) -> bool {
        !self.active.load(Ordering::Acquire) || self.state.lock().0.allows(host, access)
    }

    /// Runs a reservation command on the state. Returns its effects and, when the state
    /// changed and persists (or persisted until now), the snapshot to write before the
    /// command completes.
    pub fn update(&self, f: impl FnOnce(&mut Reservations) -> Result<Effects, Status>) -> Result<(Effects, Option<Snapshot>), Status> {
        let mut g = self.state.lock();
        let (state, version) = &mut *g;
        let persisted = state.ptpl;
        let fx = f(state)?;
        self.active.store(state.rtype.is_some(), Ordering::Release);
        let snap = (fx.changed && (persisted || state.ptpl) && self.file.is_some()).then(|| {
            *version += 1;
            Snapshot { version: *version, bytes: state.ptpl.then(|| state.encode_file()) }
        });
        Ok((fx, snap))
    }

    pub fn report(&self) -> ReservationStatus {
        self.state.lock().0.report()
    }

    pub fn ptpl(&self) -> bool {
        self.state.lock().0.ptpl
    }

    /// Writes a snapshot unless a newer one is written already: atomically (a temporary
    /// file, fsync, rename, fsync of the directory). Blocking: not on a network thread.
    pub fn persist(&self, snap: Snapshot) -> io::Result<()> {
        let Some(path) = &self.file else { return Ok(()) };
        let mut written = self.written.lock();
        if snap.version <= *written {
            return Ok(());
        }
        match snap.bytes {
            Some(b) => write_atomically(path, &b)?,
            None => match std::fs::remove_file(path) {
                Ok(()) => sync_dir(path)?,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            },
        }
        *written = snap.version;
        Ok(())
    }
}

fn sync_dir(path: &Path) -> io::Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::File::open(dir)?.sync_all()
}

fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    sync_dir(path)
}

pub struct Subsystem {
    pub nqn: String,
    pub serial: String,
    pub model: String,
    /// The well-known discovery subsystem.
    pub discovery: bool,
    allow_any_host: bool,
    hosts: HashSet<String>,
    /// Hosts that must authenticate (crate::auth), by NQN.
    keys: HashMap<String, Arc<HostKeys>>,
    namespaces: RwLock<BTreeMap<u32, Arc<Namespace>>>,
    controllers: Mutex<BTreeMap<u16, Arc<Controller>>>,
    /// Controllers removed whose work is not over yet (a queue's task, an operation on the
    /// I/O pool, a compute command): what a Cross-Controller Reset of one waits for.
    /// Each entry is pruned once its work ends, so they are bounded by the work alive.
    retiring: Mutex<Vec<Retiring>>,
    /// The next controller's Controller Instance Uniquifier (1-255, then around again).
    next_ciu: std::sync::atomic::AtomicU8,
}

impl Subsystem {
    pub fn new(nqn: &str, serial: Option<&str>, model: Option<&str>, allow_any_host: bool, hosts: &[String]) -> Subsystem {
        let serial =
            serial.map(str::to_string).unwrap_or_else(|| format!("NS{:018X}", u64::from(crc32c::crc32c(nqn.as_bytes())) << 16 | 0x5eed));
        Subsystem {
            nqn: nqn.into(),
            serial,
            model: model.unwrap_or("nearstore").into(),
            discovery: nqn == nearstore_wire::DISCOVERY_NQN,
            allow_any_host,
            hosts: hosts.iter().cloned().collect(),
            keys: HashMap::new(),
            namespaces: RwLock::new(BTreeMap::new()),
            controllers: Mutex::new(BTreeMap::new()),
            retiring: Mutex::new(Vec::new()),
            next_ciu: std::sync::atomic::AtomicU8::new(0),
        }
    }

    pub fn host_allowed(&self, hostnqn: &str) -> bool {
        self.discovery || self.allow_any_host || self.hosts.contains(hostnqn)
    }

    /// Hosts that must authenticate with DH-HMAC-CHAP, and their keys; each is allowed.
    pub fn with_host_keys(mut self, keys: impl IntoIterator<Item = (String, HostKeys)>) -> Subsystem {
        for (nqn, k) in keys {
            self.hosts.insert(nqn.clone());
            self.keys.insert(nqn, Arc::new(k));
        }
        self
    }

    /// The keys of a host that must authenticate, None for one that need not.
    pub fn host_keys(&self, hostnqn: &str) -> Option<Arc<HostKeys>> {
        self.keys.get(hostnqn).cloned()
    }

    pub fn namespace(&self, nsid: u32) -> Option<Arc<Namespace>> {
        self.namespaces.read().get(&nsid).cloned()
    }

    pub fn namespaces(&self) -> Vec<Arc<Namespace>> {
        self.namespaces.read().values().cloned().collect()
    }

    pub fn nsids(&self) -> Vec<u32> {
        self.namespaces.read().keys().copied().collect()
    }

    /// Adds a namespace; controllers already connected get a namespace-changed event.
    pub fn add_namespace(&self, ns: Namespace) -> Result<(), String> {
        let nsid = ns.nsid;
        {
            let mut map = self.namespaces.write();
            if map.contains_key(&nsid) {
                return Err(format!("NSID {nsid} already exists in {}", self.nqn));
            }
            map.insert(nsid, Arc::new(ns));
        }
        self.notify_ns_changed(nsid);
        Ok(())
    }

    pub fn remove_namespace(&self, nsid: u32) -> Option<Arc<Namespace>> {
        let ns = self.namespaces.write().remove(&nsid);
        if ns.is_some() {
            self.notify_ns_changed(nsid);
        }
        ns
    }

    fn notify_ns_changed(&self, nsid: u32) {
        for c in self.controllers.lock().values() {
            c.ns_changed(nsid);
        }
    }

    /// Creates a controller with the lowest free CNTLID (dynamic controller model), unless
    /// the subsystem is full or `hostnqn` already holds `per_host` controllers in it.
    /// `acting_for`: the host a trusted cluster member connected for (see [`Controller::acting_for`]).
    pub fn add_controller(
        self: &Arc<Self>,
        hostnqn: &str,
        hostid: [u8; 16],
        acting_for: Option<&str>,
        kato_ms: u32,
        per_host: usize,
        tenant: Arc<TenantPolicy>,
    ) -> Result<Arc<Controller>, ControllersFull> {
        let mut ctrls = self.controllers.lock();
        if ctrls.values().filter(|c| c.hostnqn == hostnqn).count() >= per_host {
            return Err(ControllersFull::Host);
        }
        if ctrls.len() >= limits::CONTROLLERS_PER_SUBSYSTEM_MAX {
            return Err(ControllersFull::Subsystem);
        }
        let cntlid = (1..=0xffefu16).find(|id| !ctrls.contains_key(id)).ok_or(ControllersFull::Subsystem)?;
        let ciu = match self.next_ciu.fetch_add(1, Relaxed).wrapping_add(1) {
            0 => self.next_ciu.fetch_add(1, Relaxed).wrapping_add(1),
            n => n,
        };
        let mut c = Controller::new(cntlid, self.clone(), hostnqn, hostid, acting_for.map(str::to_string), kato_ms, tenant);
        c.ciu = ciu;
        let c = Arc::new(c);
        ctrls.insert(cntlid, c.clone());
        Ok(c)
    }

    /// Cross-Controller Reset (NVMe Base 2.3, admin 38h): `by` resets the controller
    /// instance (`icid`, `ciu`, `cirn`) of its own host and learns when that instance's
    /// work is over. The controller is removed (its queues close and read no more
    /// commands); the token returned is cancelled once nothing it started still runs:
    /// every queue's task ended (its device operations completed), every operation it
    /// put on the I/O pool and every compute command of it finished. An instance this
    /// subsystem does not hold, alive or retiring, has nothing running (a restarted target
    /// holds none): its token is cancelled already.
    pub fn cross_controller_reset(&self, by: &Controller, icid: u16, ciu: u8, cirn: u64) -> Result<CancellationToken, Status> {
        if (icid, ciu, cirn) == (by.cntlid, by.ciu, by.cirn) {
            return Err(Status::INVALID_FIELD.dnr());
        }
        // Under the controllers' lock throughout: a removal moves a controller to the
        // retiring under it too, so an instance is always found in one or the other.
        let ctrls = self.controllers.lock();
        let live = ctrls.get(&icid).filter(|c| (c.ciu, c.cirn) == (ciu, cirn)).cloned();
        if let Some(c) = live {
            if c.hostnqn != by.hostnqn {
                // Another host's controller: refused like one that is not there.
                return Err(Status::INVALID_FIELD.dnr());
            }
            drop(ctrls);
            self.remove_this_controller(&c);
            return Ok(c.ended.clone());
        }
        let mut retiring = self.retiring.lock();
        retiring.retain(|r| !r.ended.is_cancelled());
        if let Some(r) = retiring.iter().find(|r| (r.cntlid, r.ciu, r.cirn) == (icid, ciu, cirn)) {
            if r.hostnqn != by.hostnqn {
                return Err(Status::INVALID_FIELD.dnr());
            }
            return Ok(r.ended.clone());
        }
        let ended = CancellationToken::new();
        ended.cancel();
        Ok(ended)
    }

    /// Fence Host Instances (nearstore's vendor admin C0h, docs/protocol.md): `by`, a
    /// controller of a restarted process, resets every earlier instance of that process:
    /// each controller of its host NQN whose Host Identifier starts with the same 8 bytes
    /// (the family: one cluster member) and differs from its own (another incarnation).
    /// Live ones are removed; the tokens returned, theirs and those of such controllers
    /// retiring already, are cancelled once their work has ended. A host without a Host
    /// Identifier names no family: Invalid Field.
    pub fn fence_host_instances(&self, by: &Controller) -> Result<Vec<CancellationToken>, Status> {
        if by.hostid == [0; 16] {
            return Err(Status::INVALID_FIELD.dnr());
        }
        let other = |hostnqn: &str, hostid: &[u8; 16]| hostnqn == by.hostnqn && hostid[..8] == by.hostid[..8] && *hostid != by.hostid;
        // Under the controllers' lock, as a Cross-Controller Reset: a removal moves a
        // controller to the retiring under it, so none is missed between the two.
        let ctrls = self.controllers.lock();
        let live: Vec<Arc<Controller>> = ctrls.values().filter(|c| other(&c.hostnqn, &c.hostid)).cloned().collect();
        let mut ended: Vec<CancellationToken> = {
            let mut retiring = self.retiring.lock();
            retiring.retain(|r| !r.ended.is_cancelled());
            retiring.iter().filter(|r| other(&r.hostnqn, &r.hostid)).map(|r| r.ended.clone()).collect()
        };
        drop(ctrls);
        for c in live {
            self.remove_this_controller(&c);
            ended.push(c.ended.clone());
        }
        Ok(ended)
    }

    /// Keeps `c`, just removed (the controllers' lock held), among the retiring until its
    /// work ends.
    fn retire(&self, c: &Controller) {
        // The controller's own hold on its life goes: from now on only its work holds it.
        // Removed before (a second removal path), it is retiring already.
        let held = c.life.lock().take();
        let Some(held) = held else { return };
        drop(held);
        if c.ended.is_cancelled() {
            return;
        }
        let mut retiring = self.retiring.lock();
        retiring.retain(|r| !r.ended.is_cancelled());
        retiring.push(Retiring {
            cntlid: c.cntlid,
            ciu: c.ciu,
            cirn: c.cirn,
            hostnqn: c.hostnqn.clone(),
            hostid: c.hostid,
            ended: c.ended.clone(),
        });
    }

    pub fn controller(&self, cntlid: u16) -> Option<Arc<Controller>> {
        self.controllers.lock().get(&cntlid).cloned()
    }

    /// The controllers' IDs.
    pub fn cntlids(&self) -> Vec<u16> {
        self.controllers.lock().keys().copied().collect()
    }

    pub fn controller_count(&self) -> usize {
        self.controllers.lock().len()
    }

    /// Preempt and Abort: asks every queue of every controller of `hosts` to abort its
    /// commands on `nsid`. The wait returned ends once each of those commands has
    /// completed (tcp.rs, `Core::abort_commands`).
    pub fn abort_commands(&self, hosts: &[HostId], nsid: u32) -> AbortWait {
        let (guard, wait) = tokio::sync::mpsc::channel(1);
        for c in self.controllers.lock().values().filter(|c| hosts.contains(&c.hostid)) {
            for (_, q) in c.queues.lock().iter() {
                // A queue whose connection has gone has nothing left to abort.
                let _ = q.send(Done::Abort { nsid, guard: guard.clone() });
            }
        }
        AbortWait(wait)
    }

    /// Delivers a reservation notice to every controller of `host`.
    pub fn reservation_notice(&self, host: &HostId, kind: u8, nsid: u32) {
        for c in self.controllers.lock().values().filter(|c| c.hostid == *host) {
            c.reservation_notice(kind, nsid);
        }
    }

    /// Removes the controller and stops every queue attached to it.
    pub fn remove_controller(&self, cntlid: u16) {
        let mut ctrls = self.controllers.lock();
        if let Some(c) = ctrls.remove(&cntlid) {
            self.retire(&c);
            drop(ctrls);
            c.cancel.cancel();
        }
    }

    /// Removes `ctrl` if it is still this subsystem's: its CNTLID may have gone to another
    /// controller since (a reload's sweep or a Cross-Controller Reset removed it and a new
    /// Connect took the number).
    pub fn remove_this_controller(&self, ctrl: &Arc<Controller>) {
        let mut ctrls = self.controllers.lock();
        if ctrls.get(&ctrl.cntlid).is_some_and(|c| Arc::ptr_eq(c, ctrl)) {
            ctrls.remove(&ctrl.cntlid);
        }
        self.retire(ctrl);
        drop(ctrls);
        ctrl.cancel.cancel();
    }
}

/// A removed controller whose work is not over ([`Subsystem::cross_controller_reset`]).
struct Retiring {
    cntlid: u16,
    ciu: u8,
    cirn: u64,
    hostnqn: String,
    hostid: [u8; 16],
    ended: CancellationToken,
}

/// Held by everything a controller started that may still change storage after its
/// queues closed: each queue's channel (dropped after its ring drained), each operation
/// it put on the I/O pool, each compute command. When the last holder goes, the
/// controller's `ended` token is cancelled.
#[derive(Debug)]
pub struct Life {
    ended: CancellationToken,
}

impl Drop for Life {
    fn drop(&mut self) {
        self.ended.cancel();
    }
}

/// Held by a command that a Preempt and Abort waits for; dropped when the command has
/// completed (or its connection has gone).
pub type AbortGuard = tokio::sync::mpsc::Sender<()>;

/// A Preempt and Abort waiting for the commands it aborts (see [`Subsystem::abort_commands`]).
pub struct AbortWait(tokio::sync::mpsc::Receiver<()>);

impl AbortWait {
    /// Returns once every guard is dropped (nothing is ever sent on the channel).
    pub async fn done(mut self) {
        while self.0.recv().await.is_some() {}
    }
}

/// Why a controller could not be created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControllersFull {
    /// The host NQN holds limits.controllers_per_host controllers in the subsystem.
    Host,
    /// The subsystem holds CONTROLLERS_PER_SUBSYSTEM_MAX controllers.
    Subsystem,
}

/// Controller state that commands change (features, properties, logs, events).
pub struct CtrlState {
    pub cc: u32,
    pub csts: u32,
    pub kato_ms: u32,
    /// I/O queues granted by Set Features (Number of Queues), as a count.
    pub io_queues_granted: u16,
    pub io_queues: BTreeSet<u16>,
    pub async_event_config: u32,
    pub errors: VecDeque<ErrorEntry>,
    pub error_count: u64,
    pub changed_ns: BTreeSet<u32>,
    /// Events waiting for Asynchronous Event Requests to carry them (CQE DW0).
    pub pending_events: VecDeque<u32>,
    /// Reservation Notification log pages not yet read, oldest first.
    pub resv_notices: VecDeque<NoticeLog>,
    /// The Log Page Count of the last notice (never 0 once counting).
    pub resv_notice_count: u64,
    /// A reservation event was posted and the log page not yet read with RAE cleared.
    pub resv_event_posted: bool,
    /// Reservation Notification Mask (feature 82h) per NSID: bit n masks notice type n.
    pub resv_masks: BTreeMap<u32, u32>,
    /// The other features' current values.
    pub features: crate::admin::Features,
}

pub struct Controller {
    pub cntlid: u16,
    pub subsys: Arc<Subsystem>,
    pub hostnqn: String,
    pub hostid: [u8; 16],
    /// The host a trusted cluster member (`hostnqn`) connected for, named in the Connect
    /// data (nearstore extension): access was checked for that host, and the
    /// controller's compute commands read peers for it.
    pub acting_for: Option<String>,
    /// Its host's tenant, resolved at Connect (crate::tenant): what its commands may reach,
    /// and the key of its share in the schedulers.
    pub tenant: Arc<TenantPolicy>,
    /// Its host left its tenant (a reload): every command from now on is refused with
    /// Access Denied while its queues close.
    revoked: AtomicBool,
    pub state: Mutex<CtrlState>,
    /// Volatile write cache enabled (feature 06h); when off every write is FUA.
    pub write_cache: AtomicBool,
    /// The runtime's clock (the real one, except in the simulation, whose clock is
    /// simulated: there keep-alive expiry follows simulated time).
    epoch: tokio::time::Instant,
    last_activity_ms: AtomicU64,
    /// Fires when the controller goes away: every queue of it closes.
    pub cancel: CancellationToken,
    /// Wakes the admin queue when an asynchronous event is pending.
    pub events: Notify,
    /// Compute results and messages held for FETCH.
    pub results: Mutex<crate::offload::Results>,
    /// The connections of its queues, by QID: another host's Preempt and Abort reaches
    /// their commands through them.
    queues: Mutex<Vec<(u16, UnboundedSender<Done>)>>,
    /// Controller Instance Uniquifier and Random Number (Identify Controller bytes 135 and
    /// 143:136): with the CNTLID they name this instance for a Cross-Controller Reset.
    pub ciu: u8,
    pub cirn: u64,
    /// Its own hold on its [`Life`], until it is removed.
    life: Mutex<Option<Arc<Life>>>,
    /// Cancelled when nothing it started runs any more.
    ended: CancellationToken,
}

/// AEN: Notice, Namespace Attribute Changed, log page 04h (NVMe Base, "Asynchronous Event Information").
pub const AEN_NS_CHANGED: u32 = 0x02 | (0x04 << 16);
/// Async Event Configuration bit for namespace attribute notices.
pub const AEC_NS_ATTR: u32 = 1 << 8;

impl Controller {
    fn new(
        cntlid: u16,
        subsys: Arc<Subsystem>,
        hostnqn: &str,
        hostid: [u8; 16],
        acting_for: Option<String>,
        kato_ms: u32,
        tenant: Arc<TenantPolicy>,
    ) -> Controller {
        let ended = CancellationToken::new();
        Controller {
            cntlid,
            subsys,
            hostnqn: hostnqn.into(),
            hostid,
            acting_for,
            tenant,
            revoked: AtomicBool::new(false),
            state: Mutex::new(CtrlState {
                cc: 0,
                csts: 0,
                kato_ms,
                io_queues_granted: limits::IO_QUEUES_MAX,
                io_queues: BTreeSet::new(),
                async_event_config: 0,
                errors: VecDeque::new(),
                error_count: 0,
                changed_ns: BTreeSet::new(),
                pending_events: VecDeque::new(),
                resv_notices: VecDeque::new(),
                resv_notice_count: 0,
                resv_event_posted: false,
                resv_masks: BTreeMap::new(),
                features: crate::admin::Features::new(kato_ms),
            }),
            write_cache: AtomicBool::new(true),
            epoch: tokio::time::Instant::now(),
            last_activity_ms: AtomicU64::new(0),
            cancel: CancellationToken::new(),
            events: Notify::new(),
            results: Mutex::new(Default::default()),
            queues: Mutex::new(Vec::new()),
            ciu: 0,
            cirn: u64::from_le_bytes(uuid::Uuid::new_v4().as_bytes()[..8].try_into().expect("8 bytes")),
            life: Mutex::new(Some(Arc::new(Life { ended: ended.clone() }))),
            ended,
        }
    }

    /// A hold on its life for work that may outlive its queues (see [`Life`]); None once
    /// it is removed.
    pub fn life(&self) -> Option<Arc<Life>> {
        self.life.lock().clone()
    }

    /// A queue connected: `done` is where its connection takes other hosts' Preempt and
    /// Abort requests (also while its send buffer is full).
    pub fn attach_queue(&self, qid: u16, done: UnboundedSender<Done>) {
        self.queues.lock().push((qid, done));
    }

    pub fn detach_queue(&self, qid: u16) {
        self.queues.lock().retain(|(q, _)| *q != qid);
    }

    /// The host whose access this controller has: the one it acts for, or its own.
    pub fn requester(&self) -> &str {
        self.acting_for.as_deref().unwrap_or(&self.hostnqn)
    }

    /// Its tenant no longer holds its host: commands are refused from now on.
    pub fn revoke(&self) {
        self.revoked.store(true, Ordering::Release);
    }

    pub fn revoked(&self) -> bool {
        self.revoked.load(Ordering::Acquire)
    }

    /// Records host activity for the keep-alive timer.
    pub fn touch(&self) {
        self.last_activity_ms.store(self.epoch.elapsed().as_millis() as u64, Relaxed);
    }

    pub fn idle_ms(&self) -> u64 {
        (self.epoch.elapsed().as_millis() as u64).saturating_sub(self.last_activity_ms.load(Relaxed))
    }

    pub fn ready(&self) -> bool {
        self.state.lock().csts & nearstore_wire::fabrics::csts::RDY != 0
    }

    pub fn record_error(&self, mut e: ErrorEntry) {
        let mut s = self.state.lock();
        s.error_count += 1;
        e.error_count = s.error_count;
        if s.errors.len() == limits::ERROR_LOG_ENTRIES {
            s.errors.pop_back();
        }
        s.errors.push_front(e);
    }

    fn ns_changed(&self, nsid: u32) {
        let mut s = self.state.lock();
        if s.changed_ns.len() < limits::CHANGED_NS_LIST_MAX {
            s.changed_ns.insert(nsid);
        }
        if s.async_event_config & AEC_NS_ATTR != 0 && !s.pending_events.contains(&AEN_NS_CHANGED) {
            s.pending_events.push_back(AEN_NS_CHANGED);
            drop(s);
            self.events.notify_one();
        }
    }

    /// Logs a reservation notice unless masked, and posts the event unless one is posted
    /// and the log not yet read.
    fn reservation_notice(&self, kind: u8, nsid: u32) {
        let mut s = self.state.lock();
        if s.resv_masks.get(&nsid).copied().unwrap_or(0) & (1 << kind) != 0 {
            return;
        }
        s.resv_notice_count = s.resv_notice_count.checked_add(1).unwrap_or(1);
        if s.resv_notices.len() == limits::RESERVATION_NOTICES_MAX {
            s.resv_notices.pop_front();
        }
        let count = s.resv_notice_count;
        s.resv_notices.push_back(NoticeLog { count, kind, available: 0, nsid });
        if !s.resv_event_posted {
            s.resv_event_posted = true;
            s.pending_events.push_back(AEN_RESERVATION_LOG);
            drop(s);
            self.events.notify_one();
        }
    }

    /// Reads the oldest reservation notice (an empty page when there is none); with `rae`
    /// clear, a new notice posts an event again.
    pub fn take_reservation_notice(&self, rae: bool) -> NoticeLog {
        let mut s = self.state.lock();
        if !rae {
            s.resv_event_posted = false;
        }
        let mut n = s.resv_notices.pop_front().unwrap_or_default();
        n.available = s.resv_notices.len().min(255) as u8;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenant::TenantId;

    const HOST: &str = "nqn.2026-11.io.nearstore:h";
    const OTHER: &str = "nqn.2026-11.io.nearstore:o";

    fn sub() -> Arc<Subsystem> {
        Arc::new(Subsystem::new("nqn.2026-11.io.nearstore:s", None, None, true, &[]))
    }

    fn ctrl(s: &Arc<Subsystem>, host: &str) -> Arc<Controller> {
        let t = Arc::new(TenantPolicy::unrestricted(TenantId::DEFAULT, "default", 100, 100));
        s.add_controller(host, [1; 16], None, 0, 16, t).expect("room")
    }

    /// A Cross-Controller Reset waits for the work of the instance it names: live (removed
    /// by the reset) or removed already (retiring), until the last holder of its life goes;
    /// an instance with nothing left, or unknown, is reset at once; another host's, or the
    /// issuer itself, is refused. A CNTLID taken again by the issuer is not the issuer.
    #[test]
    fn a_reset_waits_for_the_named_instances_work_only() {
        let s = sub();
        let (a, b, o) = (ctrl(&s, HOST), ctrl(&s, HOST), ctrl(&s, OTHER));
        let id = |c: &Controller| (c.cntlid, c.ciu, c.cirn);
        assert_ne!(a.ciu, b.ciu);
        let invalid = Err(Status::INVALID_FIELD.dnr());
        let reset = |by: &Controller, (i, u, r): (u16, u8, u64)| s.cross_controller_reset(by, i, u, r).map(|t| t.is_cancelled());
        assert_eq!(reset(&b, id(&b)), invalid, "not itself");
        assert_eq!(reset(&o, id(&a)), invalid, "not another host's");
        assert_eq!(reset(&b, (a.cntlid, a.ciu, a.cirn ^ 1)), Ok(true), "no such instance: nothing runs");
        assert!(s.controller(a.cntlid).is_some(), "and A is still there");

        // A live one with work (a queue's channel, a pool job) holding its life.
        let work = a.life().expect("alive");
        let t = s.cross_controller_reset(&b, a.cntlid, a.ciu, a.cirn).expect("reset");
        assert!(s.controller(a.cntlid).is_none() && a.cancel.is_cancelled(), "removed, its queues told to close");
        assert!(!t.is_cancelled(), "its work runs");
        assert!(a.life().is_none(), "no new work takes its life");
        assert_eq!(reset(&b, id(&a)), Ok(false), "asked again, still waiting");
        assert_eq!(reset(&o, id(&a)), invalid, "retiring, still not another host's");
        drop(work);
        assert!(t.is_cancelled(), "its work ended");
        assert_eq!(reset(&b, id(&a)), Ok(true));

        // Removed by its admin queue's close, its work still running: retiring.
        let c = ctrl(&s, HOST);
        let work = c.life().expect("alive");
        s.remove_this_controller(&c);
        assert_eq!(reset(&b, id(&c)), Ok(false), "its work runs");
        // Its CNTLID is free: the issuer that takes it is another instance.
        let d = ctrl(&s, HOST);
        assert_eq!(d.cntlid, c.cntlid);
        assert_eq!(reset(&d, id(&c)), Ok(false), "the same number, another instance: not itself");
        drop(work);
        assert_eq!(reset(&d, id(&c)), Ok(true));
        // Removed with no work left: nothing to wait for.
        let e = ctrl(&s, HOST);
        s.remove_controller(e.cntlid);
        assert_eq!(reset(&b, id(&e)), Ok(true));
    }

    /// Fence Host Instances resets the issuer's other incarnations only (same host NQN,
    /// same first 8 bytes of Host Identifier, another Host Identifier), live or retiring,
    /// and its tokens end with their work; the issuer's own controllers, the same host
    /// NQN's other families (a tool on the same machine) and other hosts stay. A host
    /// without a Host Identifier is refused.
    #[test]
    fn a_fence_resets_the_issuers_other_incarnations_only() {
        let s = sub();
        let t = Arc::new(TenantPolicy::unrestricted(TenantId::DEFAULT, "default", 100, 100));
        let add = |host: &str, hostid: [u8; 16]| s.add_controller(host, hostid, None, 0, 16, t.clone()).expect("room");
        let id = |family: u8, incarnation: u8| {
            let mut h = [family; 16];
            h[8..].fill(incarnation);
            h
        };
        let (old, gone) = (add(HOST, id(1, 1)), add(HOST, id(1, 2)));
        let (me, sibling) = (add(HOST, id(1, 3)), add(HOST, id(1, 3)));
        let (tool, other) = (add(HOST, id(2, 1)), add(OTHER, id(1, 1)));
        let (work, gone_work) = (old.life().expect("alive"), gone.life().expect("alive"));
        s.remove_this_controller(&gone);
        let ended = s.fence_host_instances(&me).expect("fenced");
        assert_eq!(ended.len(), 2, "the live earlier incarnation and the retiring one");
        assert!(s.controller(old.cntlid).is_none() && old.cancel.is_cancelled(), "removed, its queues told to close");
        for (c, what) in [(&me, "itself"), (&sibling, "its own other controller"), (&tool, "another family"), (&other, "another host")] {
            assert!(s.controller(c.cntlid).is_some() && !c.cancel.is_cancelled(), "{what} stays");
        }
        let over = |e: &[CancellationToken]| e.iter().all(CancellationToken::is_cancelled);
        drop(work);
        assert!(!over(&ended), "the retiring one's work runs");
        drop(gone_work);
        assert!(over(&ended), "every earlier incarnation's work ended");
        assert!(over(&s.fence_host_instances(&me).expect("again")), "nothing left: at once");
        let anonymous = add(HOST, [0; 16]);
        assert_eq!(s.fence_host_instances(&anonymous).map(|e| e.len()), Err(Status::INVALID_FIELD.dnr()));
    }
}
