//! The control plane's data model: what the store keeps (records) and what the API says
//! (requests, replies, errors). docs/control-plane.md describes every field.

use serde::{Deserialize, Serialize};

/// A pool is named by its target (the target's NVMe/TCP address) and its name there.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PoolId {
    pub target: String,
    pub name: String,
}

impl std::fmt::Display for PoolId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.name, self.target)
    }
}

/// A registered target: where hosts and peers reach it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Target {
    /// Its NVMe/TCP listen address (HOST:PORT): the target's identity.
    pub addr: String,
    /// The NQN of its (first) subsystem.
    pub nqn: String,
    /// Milliseconds since the Unix epoch of its last registration.
    pub registered_ms: u64,
    /// How long after it stops issuing them a volume's writes it sent to pools may still
    /// land (its peer timeout and bound on a lost connection, docs/control-plane.md,
    /// "Handing an export over"); 0 from a target that did not say: the default.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub write_bound_ms: u64,
    /// The process that registered last: random at its start (nearstore_target::cluster::
    /// incarnation); 0 from a target that did not say. Registered again with another, its
    /// exported volumes wait for the new process's fences (docs/control-plane.md, "A
    /// restarted exporter").
    #[serde(default, skip_serializing_if = "is_zero")]
    pub incarnation: u64,
    /// Set when it registered as another process than before: what its earlier processes
    /// sent to pools may still land until this one has fenced them there, or until
    /// `until_ms` (docs/control-plane.md, "A restarted exporter").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unfenced: Option<Unfenced>,
}

/// A target's earlier processes, which may still write to the pools of the volumes they
/// served.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Unfenced {
    /// Milliseconds since the Unix epoch after which nothing of them can land: their export
    /// lease and write bound past the registration.
    pub until_ms: u64,
    /// An earlier process did not say its incarnation (it predates them): its peers'
    /// controllers are not in the family a fence resets, so only `until_ms` ends it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub time_only: bool,
}

impl Unfenced {
    /// Seconds, rounded up, that it still lasts at `now_ms`; None once it is over.
    pub fn seconds_left(&self, now_ms: u64) -> Option<u64> {
        seconds_until(self.until_ms, now_ms)
    }
}

/// Seconds, rounded up, from `now_ms` to `until_ms`; None once it has passed.
fn seconds_until(until_ms: u64, now_ms: u64) -> Option<u64> {
    (now_ms < until_ms).then(|| (until_ms - now_ms).div_ceil(1000))
}

/// A pool: a file (or, later, a block device) a target sets aside for extents.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pool {
    pub id: PoolId,
    /// Its path on the target.
    pub path: String,
    /// Bytes the pool holds.
    pub size: u64,
    /// Its namespace in the target's pool subsystem (`nqn.2026-11.io.nearstore:pools`), where
    /// exporting targets read and write its extents; 0 from a target that predates it.
    #[serde(default)]
    pub nsid: u32,
    /// Takes no new extents (`pool drain` cordons it; `pool uncordon` ends it): neither
    /// allocations nor moves are placed there. Its extents stay and serve.
    #[serde(default)]
    pub cordoned: bool,
    /// Bytes per second the pool serves, as its target declares it (the pool's `fair`
    /// bandwidth); 0: not declared, and the arbiter does not divide it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bandwidth: u64,
    /// What a written byte costs against a read one in that bandwidth (1 to 64; 0 read as 1).
    #[serde(default, skip_serializing_if = "is_zero_f")]
    pub write_cost: f64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn is_false(v: &bool) -> bool {
    !*v
}

fn is_zero_f(v: &f64) -> bool {
    *v == 0.0
}

/// A volume: a logical block space cut into extents of one size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Volume {
    pub name: String,
    /// Bytes, a multiple of `extent_size`.
    pub size: u64,
    pub extent_size: u64,
    /// Milliseconds since the Unix epoch.
    pub created_ms: u64,
    /// Set when it was unexported: its last exporter may still write to its extents until
    /// it confirms it stopped, or until `until_ms` (docs/control-plane.md, "Handing an
    /// export over"). Meanwhile it is exported nowhere else, deleted, nor moved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handover: Option<Handover>,
}

/// A volume's last exporter, which may still write to its extents.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Handover {
    /// The target that exported it.
    pub from: String,
    /// The export that ended ([`Export::epoch`]).
    #[serde(default)]
    pub epoch: u64,
    /// The process of `from` that served it ([`Target::incarnation`]); 0 when unknown.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub incarnation: u64,
    /// That process said it stopped (`POST .../released`), or exported the volume again:
    /// only `after_fence` may still hold the handover.
    #[serde(default, skip_serializing_if = "is_false")]
    pub released: bool,
    /// `from` had unfenced earlier processes when the volume was unexported
    /// ([`Target::unfenced`]): the handover lasts until they are fenced too.
    #[serde(default, skip_serializing_if = "is_false")]
    pub after_fence: bool,
    /// Milliseconds since the Unix epoch after which it cannot: its export lease and its
    /// writes' bound past the unexport.
    pub until_ms: u64,
}

impl Handover {
    /// Seconds, rounded up, that it still lasts at `now_ms`; None once it is over.
    pub fn seconds_left(&self, now_ms: u64) -> Option<u64> {
        seconds_until(self.until_ms, now_ms)
    }
}

impl Volume {
    pub fn extents(&self) -> u64 {
        self.size / self.extent_size
    }
}

/// One allocated extent: where extent `index` of `volume` lies. An unallocated extent has no
/// record and reads as zeros.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Extent {
    pub volume: String,
    pub index: u64,
    pub pool: PoolId,
    /// Byte offset in the pool, a multiple of the volume's extent size.
    pub offset: u64,
    /// Bumped each time the extent moves (from 1): the data path's caches refuse I/O
    /// carrying an older one.
    pub epoch: u64,
    /// Allocated, and not yet zeroed in its pool by the data path that allocated it: it
    /// reads as zeros, and the next first write zeroes it again (the allocating target may
    /// have died between the allocation and the zeroing).
    #[serde(default)]
    pub unwritten: bool,
}

/// A volume exported as a namespace of a subsystem of one target, which serves it to the
/// hosts named (its data path translating every I/O through the extent table).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Export {
    pub volume: String,
    /// The target serving it: its I/O address, as registered.
    pub target: String,
    /// Host NQNs allowed to connect.
    pub hosts: Vec<String>,
    pub allow_any_host: bool,
    /// The subsystem's NQN: `nqn.2026-11.io.nearstore:volume:NAME`.
    pub nqn: String,
    /// The volume's namespace in it.
    pub nsid: u32,
    /// Which export this is: unique among the control plane's exports (a counter), so that
    /// a target's word about an earlier export of the volume ([`Released`]) is not taken
    /// for this one's. 0 in records that predate it.
    #[serde(default)]
    pub epoch: u64,
}

/// Where a move stands (docs/control-plane.md, "Moving an extent").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MoveState {
    /// Waiting for the copier's acknowledgement that no I/O reaches the extent any more.
    Invalidating,
    /// Acknowledged: the copier copies the extent to its destination.
    Copying,
    /// Given up because its copier fell silent: the extent stays where it was, and the
    /// destination stays reserved until the copier confirms it stopped (abort, or a new
    /// registration after a restart).
    Aborted,
}

/// An extent being moved to another pool. The extent record keeps its old place and epoch
/// until the move is published, in one commit that puts the extent at `to` with epoch + 1
/// and deletes this record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Move {
    /// Unique among every move this control plane began (its store's `moves` counter, one
    /// more each move): every copier's word names it, so that a late word of an ended move
    /// never reaches a later move of the same extent at the same epoch. 0: a move stored
    /// before moves had ids.
    #[serde(default)]
    pub id: u64,
    pub volume: String,
    pub index: u64,
    /// The extent's epoch when the move began; publishing makes it epoch + 1.
    pub epoch: u64,
    pub from: PoolId,
    pub from_offset: u64,
    /// The source pool's namespace in its target's pool subsystem.
    pub from_nsid: u32,
    /// The destination, reserved in the control plane's books while the move lasts.
    pub to: PoolId,
    pub to_offset: u64,
    pub to_nsid: u32,
    /// The volume's extent size: the bytes to copy.
    pub extent_size: u64,
    /// The target that invalidates and copies: the one exporting the volume (the only cache
    /// of its extents), else the destination pool's target.
    pub copier: String,
    pub state: MoveState,
    /// Bytes per second the copier may copy (0: no cap).
    pub max_bps: u64,
    /// Bytes copied so far, as the copier last said.
    pub copied: u64,
    /// Milliseconds since the Unix epoch.
    pub started_ms: u64,
    /// When the move is aborted unless its copier says something first (MOVE_SILENCE_MS after
    /// its last word).
    pub deadline_ms: u64,
    /// Why it was aborted.
    #[serde(default)]
    pub reason: String,
}

/// A tenant: host NQNs with what they may reach and their shares, kept by the control plane
/// and pushed to every registered target, which applies it as a `[[tenant]]` entry of its
/// configuration (docs/operations.md, "Tenants"). Also the body of `POST /v1/tenants`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenant {
    pub name: String,
    /// Its host NQNs: each in no other tenant.
    pub hosts: Vec<String>,
    /// Its share of I/O against the other tenants active on a device (1 to 10000).
    #[serde(default = "default_weight")]
    pub io_weight: u32,
    /// Its share of the offload engine's CPU time (1 to 10000).
    #[serde(default = "default_weight")]
    pub compute_weight: u32,
    /// Bytes its compute commands may hold together on a target; none: only the target's budget.
    #[serde(default)]
    pub offload_memory: Option<u64>,
    /// What it may reach: subsystem NQNs, and `volume:NAME` for exported volumes. A target
    /// takes the subsystems it has and every volume.
    #[serde(default)]
    pub reach: Vec<String>,
}

/// A weight not given: the targets' default.
pub const TENANT_WEIGHT_DEFAULT: u32 = 100;

fn default_weight() -> u32 {
    TENANT_WEIGHT_DEFAULT
}

/// How a reach of a volume is spelt: `volume:NAME`.
pub const VOLUME_REACH_PREFIX: &str = "volume:";

/// `GET /v1/tenants[?since=V]`: every tenant, and the version of the tenants (one counter;
/// it starts again at 1 when the control plane restarts, so a target compares the lists).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantList {
    pub version: u64,
    pub tenants: Vec<Tenant>,
}

/// The NQN prefix of an exported volume's subsystem; the volume's name follows.
pub const VOLUME_NQN_PREFIX: &str = "nqn.2026-11.io.nearstore:volume:";

/// The NQN of every target's pool subsystem, which only cluster members read: no tenant
/// may reach it (the target's `POOLS_NQN`).
pub const POOLS_NQN: &str = "nqn.2026-11.io.nearstore:pools";

/// What a view agent measures of one pool (docs/control-plane.md, "Views").
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    /// Free bytes of the file system (or device) under the pool.
    pub fs_free_bytes: u64,
    /// Bytes per second, EWMA.
    pub read_bps: f64,
    pub write_bps: f64,
    /// Operations per second, EWMA.
    pub read_iops: f64,
    pub write_iops: f64,
    /// Mean latency of the interval's operations, microseconds, EWMA.
    pub read_latency_us: f64,
    pub write_latency_us: f64,
    /// Operations in flight, EWMA.
    pub queue_depth: f64,
    /// Microseconds per written MiB, EWMA: what a write costs this pool (0 when nothing
    /// was written yet).
    pub write_cost_us_per_mib: f64,
}

/// A view as an agent pushes it: `seq` increases with each push of one pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ViewPush {
    pub seq: u64,
    pub figures: Figures,
}

/// A view as the control plane keeps it: `version` is the control plane's, one counter over
/// all views, so `GET /v1/view?since=V` returns what changed after V.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct View {
    pub pool: PoolId,
    pub seq: u64,
    pub version: u64,
    /// Milliseconds since the Unix epoch when the control plane took it.
    pub received_ms: u64,
    pub figures: Figures,
}

/// A link's view: what the volumes of target `from` moved to and from the pools of target
/// `to` (reads and writes, their latency from the exporter's submission to the peer's
/// completion, their queue depth by Little's law), as `from`'s agent pushed it. Soft state
/// (crate::links): `version` counts pushes of links in this control plane's life.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinkView {
    pub from: String,
    pub to: String,
    pub seq: u64,
    pub version: u64,
    pub received_ms: u64,
    pub figures: Figures,
    /// Nothing heard for VIEW_STALE_MS.
    #[serde(default)]
    pub stale: bool,
}

/// A counter kept in the store: `moves` ([`MOVES_COUNTER`]) is the last move id handed out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Counter {
    pub name: String,
    pub value: u64,
}

/// The counter of move ids.
pub const MOVES_COUNTER: &str = "moves";
/// The counter of export epochs ([`Export::epoch`]).
pub const EXPORTS_COUNTER: &str = "exports";

/// Everything the store keeps, one record a key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    Target(Target),
    Pool(Pool),
    Volume(Volume),
    Extent(Extent),
    View(View),
    Export(Export),
    Move(Move),
    Tenant(Tenant),
    Counter(Counter),
}

/// The store's tables: one a record kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Table {
    Targets,
    Pools,
    Volumes,
    Extents,
    Views,
    Exports,
    Moves,
    Tenants,
    Counters,
}

impl Table {
    /// In loading order: a move's reservation needs its volume's extent size.
    pub const ALL: [Table; 9] = [
        Table::Targets,
        Table::Pools,
        Table::Volumes,
        Table::Extents,
        Table::Views,
        Table::Exports,
        Table::Moves,
        Table::Tenants,
        Table::Counters,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Table::Targets => "targets",
            Table::Pools => "pools",
            Table::Volumes => "volumes",
            Table::Extents => "extents",
            Table::Views => "views",
            Table::Exports => "exports",
            Table::Moves => "moves",
            Table::Tenants => "tenants",
            Table::Counters => "counters",
        }
    }
}

/// The key of a pool: "TARGET/NAME" (a name holds no '/').
pub fn pool_key(id: &PoolId) -> String {
    format!("{}/{}", id.target, id.name)
}

/// The key of an extent: "VOLUME/INDEX" with the index zero-padded, so that a volume's
/// extents are one key range in index order.
pub fn extent_key(volume: &str, index: u64) -> String {
    format!("{volume}/{index:010}")
}

impl Record {
    pub fn table(&self) -> Table {
        match self {
            Record::Target(_) => Table::Targets,
            Record::Pool(_) => Table::Pools,
            Record::Volume(_) => Table::Volumes,
            Record::Extent(_) => Table::Extents,
            Record::View(_) => Table::Views,
            Record::Export(_) => Table::Exports,
            Record::Move(_) => Table::Moves,
            Record::Tenant(_) => Table::Tenants,
            Record::Counter(_) => Table::Counters,
        }
    }

    pub fn key(&self) -> String {
        match self {
            Record::Target(t) => t.addr.clone(),
            Record::Pool(p) => pool_key(&p.id),
            Record::Volume(v) => v.name.clone(),
            Record::Extent(e) => extent_key(&e.volume, e.index),
            Record::View(v) => pool_key(&v.pool),
            Record::Export(x) => x.volume.clone(),
            Record::Move(m) => extent_key(&m.volume, m.index),
            Record::Tenant(t) => t.name.clone(),
            Record::Counter(c) => c.name.clone(),
        }
    }
}

/// One change of a batch the store commits atomically.
#[derive(Debug, Clone, PartialEq)]
pub enum Write {
    Put(Record),
    Delete(Table, String),
}

// ---- API requests and replies ----

/// `POST /v1/targets`: a target says who it is and which pools it has.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterTarget {
    pub addr: String,
    pub nqn: String,
    pub pools: Vec<PoolSpec>,
    /// [`Target::write_bound_ms`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub write_bound_ms: u64,
    /// [`Target::incarnation`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub incarnation: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    pub name: String,
    pub path: String,
    pub size: u64,
    /// Its namespace in the target's pool subsystem.
    #[serde(default)]
    pub nsid: u32,
    /// Bytes per second it serves (its `fair` bandwidth), 0 when not declared: what the
    /// arbiter divides among the clients active on it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bandwidth: u64,
    /// A written byte's cost against a read one in that bandwidth (0: 1).
    #[serde(default, skip_serializing_if = "is_zero_f")]
    pub write_cost: f64,
}

/// The reply to a registration: the last view `seq` the control plane holds of each pool, so
/// that a restarted agent goes on above it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Registered {
    pub target: Target,
    pub pools: Vec<RegisteredPool>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegisteredPool {
    pub name: String,
    pub seq: u64,
}

/// `POST /v1/volumes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateVolume {
    pub name: String,
    pub size: u64,
    #[serde(default)]
    pub extent_size: Option<u64>,
}

/// `POST /v1/volumes/{name}/grow`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrowVolume {
    pub size: u64,
}

/// Where an allocated extent lies, as `volume info` and the allocation call say it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExtentInfo {
    pub index: u64,
    pub pool: String,
    pub target: String,
    pub path: String,
    pub offset: u64,
    pub epoch: u64,
    /// The pool's namespace in its target's pool subsystem.
    #[serde(default)]
    pub nsid: u32,
    /// Allocated, not zeroed yet: it reads as zeros (see [`Extent::unwritten`]).
    #[serde(default)]
    pub unwritten: bool,
}

/// `GET /v1/volumes/{name}/extents/{index}`: the translation service's answer for one
/// extent, None while it is unallocated (it reads as zeros).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Translation {
    pub index: u64,
    pub extent: Option<ExtentInfo>,
}

/// `PUT /v1/volumes/{name}/export`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportVolume {
    /// The target to serve it (its registered address).
    pub target: String,
    #[serde(default)]
    pub hosts: Vec<String>,
    #[serde(default)]
    pub allow_any_host: bool,
}

/// `GET /v1/exports?target=ADDR[&since=V]`: a target's exports, and the version of the
/// exports (one counter over all of them; it starts again at 1 when the control plane
/// restarts, so a caller compares the lists, not only the versions).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportList {
    pub version: u64,
    pub exports: Vec<Export>,
    /// Milliseconds, from when it sent the request, the target may serve these exports
    /// without a newer answer (its export lease): past it, it stops issuing their I/O.
    #[serde(default)]
    pub lease_ms: u64,
}

/// `POST /v1/volumes/{name}/released`: the volume's last exporter no longer writes to its
/// extents (nothing it issued runs or is in doubt).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Released {
    pub target: String,
    /// The export it stopped serving ([`Export::epoch`]).
    pub epoch: u64,
    /// The process that says so ([`Target::incarnation`]); 0 from one that predates them.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub incarnation: u64,
}

/// `POST /v1/targets/fenced`: the process `incarnation` of `target` has fenced its earlier
/// processes at every registered target's pools.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fenced {
    pub target: String,
    pub incarnation: u64,
}

/// `POST /v1/volumes/{name}/extents/{index}/move`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoveRequest {
    /// The destination pool, `NAME@TARGET`; none: the placement's choice among the others.
    #[serde(default)]
    pub to: Option<String>,
    /// Bytes per second the copy may take (0 or none: no cap).
    #[serde(default)]
    pub max_bps: u64,
}

/// What a copier says of a move: `POST /v1/moves/{volume}/{index}/{ack|progress|publish|abort}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoveReport {
    /// The move's id: a word naming another move of the extent (an ended one) is refused.
    pub id: u64,
    /// The epoch the move began at.
    pub epoch: u64,
    /// Bytes copied so far.
    #[serde(default)]
    pub copied: u64,
    /// Why it aborts.
    #[serde(default)]
    pub reason: String,
}

/// `GET /v1/moves[?target=ADDR][&since=V]`: the moves (a target's: those it copies).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoveList {
    pub version: u64,
    pub moves: Vec<Move>,
}

/// `GET /v1/volumes/{name}`: the volume and its allocated extents in index order; the
/// others are unallocated (read as zeros).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VolumeInfo {
    #[serde(flatten)]
    pub volume: Volume,
    pub extents_total: u64,
    pub extents_allocated: u64,
    pub extents: Vec<ExtentInfo>,
    /// A target that may still write to its extents although it is not its exporter any
    /// more, or an exporter's earlier processes: meanwhile it is exported nowhere else,
    /// deleted, nor moved (docs/control-plane.md, "Handing an export over").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_doubt: Option<InDoubt>,
}

/// Who may still write to a volume's extents, and for how long at most.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InDoubt {
    pub target: String,
    pub seconds_left: u64,
    /// Earlier processes of `target`, which restarted (else its own unexported export).
    pub restarted: bool,
}

/// One pool in `GET /v1/view`: the control plane's books and the agent's last view.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolView {
    pub pool: String,
    pub target: String,
    pub path: String,
    pub size: u64,
    /// Bytes of extents placed in it.
    pub allocated: u64,
    pub extents: u64,
    pub view: Option<View>,
    /// No view, or none for VIEW_STALE_MS.
    pub stale: bool,
    /// Takes no new extents (see [`Pool::cordoned`]).
    #[serde(default)]
    pub cordoned: bool,
    /// What a written byte costs against a read one, as its target declares it (see
    /// [`Pool::write_cost`]; 0: not declared).
    #[serde(default)]
    pub write_cost: f64,
}

/// `GET /v1/view[?since=V]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterView {
    /// The newest view's version (0: none yet).
    pub version: u64,
    pub targets: Vec<Target>,
    pub pools: Vec<PoolView>,
    /// Every link's last view (whatever `since` asks: links are few and soft).
    #[serde(default)]
    pub links: Vec<LinkView>,
}

/// What a host ranks its requests to one target by (its PIFO's lane view, docs/fair-io.md
/// "The host's PIFO").
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TargetLoad {
    /// The largest declared write cost among the target's pools (1 when none declares one).
    pub write_cost: f64,
    /// The operations in flight on its pools, summed (their views' `queue_depth` EWMAs).
    pub queue_depth: f64,
}

impl ClusterView {
    /// The load of the target registered at `addr`, from its pools' fresh views; None when
    /// it has no pool with a fresh view (nothing to rank by: the host keeps what it had).
    pub fn load_of(&self, addr: &str) -> Option<TargetLoad> {
        let fresh: Vec<&PoolView> = self.pools.iter().filter(|p| p.target == addr && !p.stale && p.view.is_some()).collect();
        if fresh.is_empty() {
            return None;
        }
        let write_cost = fresh.iter().map(|p| p.write_cost).filter(|w| w.is_finite()).fold(1.0, f64::max);
        let queue_depth = fresh.iter().filter_map(|p| p.view.as_ref()).map(|v| v.figures.queue_depth.max(0.0)).sum();
        Some(TargetLoad { write_cost, queue_depth })
    }
}

/// `POST /v1/arbiter`, Flint's request to send (RTS): what each tenant of an exporting target
/// moved to, and asked of, each pool its volumes reached in its last period
/// (docs/fair-io.md, "The arbiter"). Sent every `ARBITER_PERIOD_MS`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BandwidthRequest {
    /// The requesting target, as registered (its I/O address).
    pub target: String,
    pub demands: Vec<Demand>,
    /// The requesting target's cluster NQN (`cluster.host_nqn`), as which it reaches its
    /// peers' pools: how a pool's target tells its operations from other exporters'
    /// ([`BandwidthGrants::peers`]). Empty: not known (an older target).
    #[serde(default)]
    pub member: String,
}

/// One tenant's demand on one pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Demand {
    /// The pool, as a volume's extents name it: its target and its namespace in that
    /// target's pool subsystem.
    pub pool_target: String,
    pub nsid: u32,
    /// The tenant's name (a host NQN prefixed `host:` for hosts of no configured tenant).
    pub tenant: String,
    /// Its `io_weight`, 1 to 10000.
    pub weight: u32,
    /// Cost bytes per second it wants (a written byte costs the pool's `write_cost`).
    pub wanted_bps: u64,
    /// Some of its operations waited for their grant in the period: it wants more than it
    /// was granted.
    #[serde(default)]
    pub backlogged: bool,
}

/// The reply to a [`BandwidthRequest`], the clear to send (CTS): the requester's grants.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BandwidthGrants {
    /// Ask again after this many milliseconds.
    pub period_ms: u64,
    /// Each grant holds this long after it is received; then the target falls back to
    /// local fair sharing until a new grant comes.
    pub ttl_ms: u64,
    pub grants: Vec<BandwidthGrant>,
    /// For each pool of the requesting target, what every other exporter's tenants were
    /// granted there together: the pool's scheduler weighs each exporter's operations (one
    /// key per exporter, its cluster NQN) by it.
    #[serde(default)]
    pub peers: Vec<PeerGrant>,
}

/// What one exporter's tenants may move to one pool of the requester, together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerGrant {
    /// The pool: its namespace in the requester's pool subsystem.
    pub nsid: u32,
    /// The exporter, by its cluster NQN.
    pub member: String,
    /// Cost bytes per second.
    pub bps: u64,
    /// All the pool's grants together, bytes per second: what an exporter the reply does
    /// not name (of an older version) is weighed by is what these leave.
    #[serde(default)]
    pub pool_bps: u64,
}

/// What one tenant of the requester may move to one pool until the next grant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BandwidthGrant {
    pub pool_target: String,
    pub nsid: u32,
    pub tenant: String,
    /// Cost bytes per second; None: the pool declares no bandwidth, nothing is divided.
    pub bps: Option<u64>,
    /// Cost bytes it may move at once (a batch): the bucket of its grant.
    pub batch_bytes: u64,
    /// A written byte's cost in `bps`.
    pub write_cost: f64,
    /// Clients the pool's bandwidth was divided among.
    pub clients: u32,
    /// All the pool's grants together, bytes per second (0: not divided): the pool's own
    /// target weighs the peers' operations by what its own tenants' grants leave of it.
    #[serde(default)]
    pub pool_bps: u64,
}

/// An API error: a stable code a program matches on, and a message for people.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message} ({code})")]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The body is not JSON of the request's shape.
    MalformedRequest,
    /// The body is larger than limits::BODY_BYTES_MAX.
    BodyTooLarge,
    /// No such path, or no such method on it.
    NoSuchEndpoint,
    /// A field's value is not allowed (a name's characters, a size of 0 or not a multiple).
    InvalidArgument,
    /// A value or a count is over a named limit (crate::limits).
    LimitExceeded,
    VolumeNotFound,
    VolumeExists,
    TargetNotFound,
    PoolNotFound,
    /// A pool registered again with another path, or smaller than its extents need.
    PoolConflict,
    /// An extent index at or beyond the volume's size.
    ExtentOutOfRange,
    /// A volume grown to a size not larger than it is.
    ShrinkRefused,
    /// No pool has room for one more extent.
    NoSpace,
    /// The volume is exported (to another target, or delete was asked): unexport it first.
    VolumeExported,
    /// A view push whose seq is not above the last one taken.
    StaleView,
    /// The store failed to commit; nothing changed.
    StoreFailed,
    /// This control plane does not hold the leader lease (a standby, or one that lost its
    /// lease: `--etcd`); nothing changed. The leader's API is named in the message when known.
    NotLeader,
    /// The extent (or one of the volume's) is being moved: wait for the move to end.
    MoveInProgress,
    /// No move of that extent (at that epoch): it was published or aborted.
    MoveNotFound,
    /// The extent is unallocated: there is nothing to move.
    ExtentNotAllocated,
    TenantNotFound,
    /// A tenant of that name exists already.
    TenantExists,
    /// A host named is in another tenant already (the message names it).
    HostInTenant,
    /// A move to a cordoned pool (being drained): uncordon it first.
    PoolCordoned,
    /// The control plane has a token (`nearstore control --token-file`) and the request
    /// carried none, or another (`Authorization: Bearer TOKEN`).
    Unauthorized,
    /// The volume's last exporter may still write to its extents: it is exported nowhere
    /// else, deleted, nor moved until it confirms it stopped or its bound passes (the
    /// message says when).
    ExportHandover,
    /// A target's process that is not the one registered for its address asked for its
    /// exports: it registers first (or it is an earlier process, still running).
    StaleIncarnation,
}

impl ErrorCode {
    /// The HTTP status the API answers with.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::MalformedRequest | ErrorCode::InvalidArgument | ErrorCode::LimitExceeded | ErrorCode::ExtentOutOfRange => 400,
            ErrorCode::ShrinkRefused => 400,
            ErrorCode::BodyTooLarge => 413,
            ErrorCode::NoSuchEndpoint | ErrorCode::VolumeNotFound | ErrorCode::TargetNotFound | ErrorCode::PoolNotFound => 404,
            ErrorCode::VolumeExists | ErrorCode::PoolConflict | ErrorCode::StaleView | ErrorCode::VolumeExported => 409,
            ErrorCode::MoveInProgress | ErrorCode::ExtentNotAllocated | ErrorCode::PoolCordoned | ErrorCode::ExportHandover => 409,
            ErrorCode::StaleIncarnation => 409,
            ErrorCode::MoveNotFound | ErrorCode::TenantNotFound => 404,
            ErrorCode::TenantExists | ErrorCode::HostInTenant => 409,
            ErrorCode::NoSpace => 507,
            ErrorCode::StoreFailed => 500,
            ErrorCode::NotLeader => 503,
            ErrorCode::Unauthorized => 401,
        }
    }
}

/// The code as the API spells it (snake_case).
impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = serde_json::to_value(self).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
        f.write_str(&s)
    }
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError { code, message: message.into() }
    }
}

/// The body of every error reply: `{"error": {"code": ..., "message": ...}}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ApiError,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(target: &str, name: &str, write_cost: f64, depth: Option<f64>, stale: bool) -> PoolView {
        let view = depth.map(|queue_depth| View {
            pool: PoolId { target: target.into(), name: name.into() },
            seq: 1,
            version: 1,
            received_ms: 0,
            figures: Figures { queue_depth, ..Figures::default() },
        });
        PoolView {
            pool: name.into(),
            target: target.into(),
            path: String::new(),
            size: 1 << 30,
            allocated: 0,
            extents: 0,
            view,
            stale,
            cordoned: false,
            write_cost,
        }
    }

    #[test]
    fn a_targets_load_sums_its_fresh_pools_and_takes_their_largest_write_cost() {
        let v = ClusterView {
            version: 3,
            targets: Vec::new(),
            pools: vec![
                pool("a:1", "p0", 2.0, Some(3.0), false),
                pool("a:1", "p1", 0.0, Some(5.0), false),
                pool("a:1", "old", 9.0, Some(100.0), true),
                pool("a:1", "unseen", 7.0, None, false),
                pool("b:1", "p0", f64::NAN, Some(-4.0), false),
            ],
            links: Vec::new(),
        };
        assert_eq!(v.load_of("a:1"), Some(TargetLoad { write_cost: 2.0, queue_depth: 8.0 }), "stale and unseen pools left out");
        assert_eq!(v.load_of("b:1"), Some(TargetLoad { write_cost: 1.0, queue_depth: 0.0 }), "NaN and negatives ignored");
        assert_eq!(v.load_of("c:1"), None);
    }
}
