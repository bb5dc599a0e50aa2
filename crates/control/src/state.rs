//! The control plane's state and its rules. Every change is planned first, as a batch of
//! record writes, without touching the state; the service commits the batch to the store and
//! only then applies it ([`Cluster::apply`]), the same way loading the store at start-up
//! does. So the state in memory is always what the store holds, and a failed commit changes
//! nothing.

use std::collections::{BTreeMap, HashMap};

use crate::limits::*;
use crate::model::*;
use crate::placement::{self, Candidate};

/// Everything the control plane knows, indexed for its rules.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Cluster {
    pub targets: BTreeMap<String, Target>,
    pub pools: BTreeMap<PoolId, Pool>,
    pub volumes: BTreeMap<String, Volume>,
    /// Allocated extents by (volume, index).
    pub extents: BTreeMap<(String, u64), Extent>,
    pub views: BTreeMap<PoolId, View>,
    /// Exported volumes by name.
    pub exports: BTreeMap<String, Export>,
    /// Extents being moved, by (volume, index); each reserves its destination in `placed`.
    pub moves: BTreeMap<(String, u64), Move>,
    /// What each pool holds: offset to (length, volume, index). Derived from `extents`.
    pub placed: HashMap<PoolId, BTreeMap<u64, (u64, String, u64)>>,
    /// Tenants by name, pushed to every target.
    pub tenants: BTreeMap<String, Tenant>,
    /// The store's counters by name (`MOVES_COUNTER`: the last move id handed out).
    pub counters: BTreeMap<String, u64>,
}

type Planned<T> = Result<(Vec<Write>, T), ApiError>;

fn err(code: ErrorCode, message: impl Into<String>) -> ApiError {
    ApiError::new(code, message)
}

/// A name the API accepts for a volume or a pool: 1 to NAME_BYTES_MAX bytes of letters,
/// digits, '.', '_' and '-', not starting with '.' (so that it is a path component and a URL
/// segment as it is).
pub fn check_name(what: &str, name: &str) -> Result<(), ApiError> {
    if name.is_empty() || name.len() > NAME_BYTES_MAX {
        return Err(err(ErrorCode::InvalidArgument, format!("{what} name must be 1 to {NAME_BYTES_MAX} bytes")));
    }
    if name.starts_with('.') || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
        return Err(err(
            ErrorCode::InvalidArgument,
            format!("{what} name '{name}' may hold only letters, digits, '.', '_' and '-', and not start with '.'"),
        ));
    }
    Ok(())
}

fn check_volume_size(size: u64, extent_size: u64) -> Result<(), ApiError> {
    if size == 0 {
        return Err(err(ErrorCode::InvalidArgument, "volume size must not be 0"));
    }
    if !size.is_multiple_of(extent_size) {
        return Err(err(ErrorCode::InvalidArgument, format!("volume size {size} is not a multiple of the extent size {extent_size}")));
    }
    if size > VOLUME_BYTES_MAX || size / extent_size > EXTENTS_PER_VOLUME_MAX {
        return Err(err(
            ErrorCode::LimitExceeded,
            format!("volume size {size} is over the limit: {EXTENTS_PER_VOLUME_MAX} extents, {VOLUME_BYTES_MAX} bytes"),
        ));
    }
    Ok(())
}

impl Cluster {
    /// The state a store's records make.
    pub fn from_records(records: impl IntoIterator<Item = Record>) -> Cluster {
        let mut c = Cluster::default();
        for r in records {
            c.apply(&Write::Put(r));
        }
        c
    }

    /// Applies one committed write.
    pub fn apply(&mut self, w: &Write) {
        match w {
            Write::Put(Record::Target(t)) => {
                self.targets.insert(t.addr.clone(), t.clone());
            }
            Write::Put(Record::Pool(p)) => {
                self.pools.insert(p.id.clone(), p.clone());
            }
            Write::Put(Record::Volume(v)) => {
                self.volumes.insert(v.name.clone(), v.clone());
            }
            Write::Put(Record::Extent(e)) => {
                let len = self.volumes.get(&e.volume).map_or(0, |v| v.extent_size);
                if let Some(old) = self.extents.insert((e.volume.clone(), e.index), e.clone()) {
                    self.unplace(&old);
                }
                self.placed.entry(e.pool.clone()).or_default().insert(e.offset, (len, e.volume.clone(), e.index));
            }
            Write::Put(Record::View(v)) => {
                self.views.insert(v.pool.clone(), v.clone());
            }
            Write::Delete(Table::Targets, k) => {
                self.targets.remove(k);
            }
            Write::Delete(Table::Pools, k) => {
                self.pools.retain(|id, _| pool_key(id) != *k);
            }
            Write::Delete(Table::Volumes, k) => {
                self.volumes.remove(k);
            }
            Write::Delete(Table::Extents, k) => {
                // "VOLUME/INDEX": a volume name holds no '/'.
                let key = k.rsplit_once('/').and_then(|(v, i)| Some((v.to_string(), i.parse::<u64>().ok()?)));
                if let Some(e) = key.and_then(|key| self.extents.remove(&key)) {
                    self.unplace(&e);
                }
            }
            Write::Delete(Table::Views, k) => {
                self.views.retain(|id, _| pool_key(id) != *k);
            }
            Write::Put(Record::Export(x)) => {
                self.exports.insert(x.volume.clone(), x.clone());
            }
            Write::Delete(Table::Exports, k) => {
                self.exports.remove(k);
            }
            Write::Put(Record::Move(m)) => {
                let len = self.volumes.get(&m.volume).map_or(0, |v| v.extent_size);
                self.placed.entry(m.to.clone()).or_default().insert(m.to_offset, (len, m.volume.clone(), m.index));
                self.moves.insert((m.volume.clone(), m.index), m.clone());
            }
            Write::Put(Record::Tenant(t)) => {
                self.tenants.insert(t.name.clone(), t.clone());
            }
            Write::Delete(Table::Tenants, k) => {
                self.tenants.remove(k);
            }
            Write::Put(Record::Counter(c)) => {
                self.counters.insert(c.name.clone(), c.value);
            }
            Write::Delete(Table::Counters, k) => {
                self.counters.remove(k);
            }
            Write::Delete(Table::Moves, k) => {
                let key = k.rsplit_once('/').and_then(|(v, i)| Some((v.to_string(), i.parse::<u64>().ok()?)));
                if let Some(m) = key.and_then(|key| self.moves.remove(&key)) {
                    // Published (the extent now lies there, whichever of the two writes came
                    // first), the space stays; aborted, it is free again.
                    let there = self.extents.get(&(m.volume.clone(), m.index)).is_some_and(|e| e.pool == m.to && e.offset == m.to_offset);
                    if !there {
                        if let Some(p) = self.placed.get_mut(&m.to) {
                            p.remove(&m.to_offset);
                            if p.is_empty() {
                                self.placed.remove(&m.to);
                            }
                        }
                    }
                }
            }
        }
    }

    fn unplace(&mut self, e: &Extent) {
        if let Some(m) = self.placed.get_mut(&e.pool) {
            m.remove(&e.offset);
            if m.is_empty() {
                self.placed.remove(&e.pool);
            }
        }
    }

    /// The newest view version (0: none).
    pub fn view_version(&self) -> u64 {
        self.views.values().map(|v| v.version).max().unwrap_or(0)
    }

    /// Bytes of extents in a pool.
    pub fn allocated(&self, pool: &PoolId) -> u64 {
        self.placed.get(pool).map_or(0, |m| m.values().map(|(len, _, _)| len).sum())
    }

    /// The lowest offset, a multiple of `len`, where `len` bytes are free in the pool.
    fn hole(&self, pool: &Pool, len: u64) -> Option<u64> {
        let mut at = 0u64;
        if let Some(m) = self.placed.get(&pool.id) {
            for (&off, &(l, _, _)) in m {
                if at.checked_add(len)? <= off {
                    break;
                }
                at = at.max(off.checked_add(l)?.div_ceil(len).checked_mul(len)?);
            }
        }
        (at.checked_add(len)? <= pool.size).then_some(at)
    }

    // ---- targets and pools ----

    /// Registers a target (again at each of its starts). Registered by another process than
    /// before (`incarnation`), each volume it exports waits for the new process's fences
    /// ([`Cluster::fenced`]) or its earlier processes' lease (`lease_ms`) and write bound:
    /// docs/control-plane.md, "A restarted exporter".
    pub fn register(&self, req: &RegisterTarget, now_ms: u64, lease_ms: u64) -> Planned<Registered> {
        if req.addr.is_empty() || req.addr.len() > NAME_BYTES_MAX || req.addr.contains('/') {
            return Err(err(ErrorCode::InvalidArgument, "target address must be HOST:PORT"));
        }
        if req.nqn.is_empty() || req.nqn.len() > NQN_BYTES_MAX {
            return Err(err(ErrorCode::InvalidArgument, format!("target NQN must be 1 to {NQN_BYTES_MAX} bytes")));
        }
        if req.pools.len() > POOLS_PER_TARGET_MAX {
            return Err(err(ErrorCode::LimitExceeded, format!("{} pools: a target may register {POOLS_PER_TARGET_MAX}", req.pools.len())));
        }
        if !self.targets.contains_key(&req.addr) && self.targets.len() >= TARGETS_MAX {
            return Err(err(ErrorCode::LimitExceeded, format!("the control plane keeps {TARGETS_MAX} targets")));
        }
        if req.write_bound_ms > EXPORT_WRITE_BOUND_MS_MAX {
            return Err(err(
                ErrorCode::InvalidArgument,
                format!("write_bound_ms {}: at most {EXPORT_WRITE_BOUND_MS_MAX}", req.write_bound_ms),
            ));
        }
        let old = self.targets.get(&req.addr);
        // Another process than the one registered (one that predates incarnations, 0, too:
        // it cannot fence, so only the bound ends the wait).
        let restart = old.is_some_and(|t| t.incarnation != req.incarnation);
        let same_process = req.incarnation != 0 && old.is_some_and(|t| t.incarnation == req.incarnation);
        let unfenced = match old {
            // Its earlier processes may have left writes at its volumes' pools, or in the
            // network: bounded by theirs and this one's write bound; a second restart
            // before the fence keeps the later end.
            Some(old) if restart => {
                let bound = write_bound(old.write_bound_ms).max(write_bound(req.write_bound_ms));
                let until_ms = now_ms.saturating_add(lease_ms).saturating_add(bound).saturating_add(EXPORT_HANDOVER_MARGIN_MS);
                let live = old.unfenced.as_ref().filter(|u| u.seconds_left(now_ms).is_some());
                Some(Unfenced {
                    until_ms: live.map_or(until_ms, |u| u.until_ms.max(until_ms)),
                    time_only: old.incarnation == 0 || req.incarnation == 0 || live.is_some_and(|u| u.time_only),
                })
            }
            _ => old.and_then(|t| t.unfenced.clone()),
        };
        let target = Target {
            addr: req.addr.clone(),
            nqn: req.nqn.clone(),
            registered_ms: now_ms,
            write_bound_ms: req.write_bound_ms,
            incarnation: req.incarnation,
            unfenced,
        };
        let mut writes = vec![Write::Put(Record::Target(target.clone()))];
        let mut pools = Vec::new();
        for (i, p) in req.pools.iter().enumerate() {
            check_name("pool", &p.name)?;
            if req.pools[..i].iter().any(|q| q.name == p.name) {
                return Err(err(ErrorCode::InvalidArgument, format!("pool '{}' is given twice", p.name)));
            }
            if p.path.is_empty() || p.path.len() > PATH_BYTES_MAX {
                return Err(err(ErrorCode::InvalidArgument, format!("pool path must be 1 to {PATH_BYTES_MAX} bytes")));
            }
            if p.size < EXTENT_BYTES_MIN {
                return Err(err(
                    ErrorCode::InvalidArgument,
                    format!("pool '{}' of {} bytes holds no extent ({EXTENT_BYTES_MIN} at least)", p.name, p.size),
                ));
            }
            if p.write_cost != 0.0 && !(1.0..=WRITE_COST_MAX).contains(&p.write_cost) {
                return Err(err(ErrorCode::InvalidArgument, format!("pool '{}': write cost must be 1 to {WRITE_COST_MAX}", p.name)));
            }
            let id = PoolId { target: req.addr.clone(), name: p.name.clone() };
            if let Some(old) = self.pools.get(&id) {
                if old.path != p.path {
                    return Err(err(ErrorCode::PoolConflict, format!("pool {id} is registered with path {}, not {}", old.path, p.path)));
                }
                // Extents lie anywhere below the old size: a pool only shrinks to the end of
                // its last extent.
                let end = self.placed.get(&id).and_then(|m| m.iter().next_back()).map_or(0, |(off, (len, _, _))| off + len);
                if p.size < end {
                    return Err(err(
                        ErrorCode::PoolConflict,
                        format!("pool {id} holds extents up to byte {end}: it cannot shrink to {}", p.size),
                    ));
                }
            }
            // A cordon outlives the target's restarts.
            let cordoned = self.pools.get(&id).is_some_and(|old| old.cordoned);
            writes.push(Write::Put(Record::Pool(Pool {
                id: id.clone(),
                path: p.path.clone(),
                size: p.size,
                nsid: p.nsid,
                cordoned,
                bandwidth: p.bandwidth,
                write_cost: p.write_cost,
            })));
            pools.push(RegisteredPool { name: p.name.clone(), seq: self.views.get(&id).map_or(0, |v| v.seq) });
        }
        // A target registers when it starts: the moves it copied before died with it. Its
        // earlier process may still have copy writes on their way to a destination: the
        // move stays, aborted, until the new process confirms it (after fencing the
        // destination's target: `Mover::confirm_abort`). Registered again by the same
        // process, its moves run on.
        for m in self.moves.values().filter(|m| m.copier == req.addr) {
            // A move still invalidating never opened its destination: nothing of it there.
            if restart && m.state != MoveState::Invalidating {
                if m.state != MoveState::Aborted {
                    let reason = "its copier restarted".to_string();
                    writes.push(Write::Put(Record::Move(Move { state: MoveState::Aborted, reason, ..m.clone() })));
                }
            } else if !same_process {
                writes.push(Write::Delete(Table::Moves, extent_key(&m.volume, m.index)));
            }
        }
        Ok((writes, Registered { target, pools }))
    }

    pub fn push_view(&self, id: &PoolId, push: &ViewPush, now_ms: u64) -> Planned<View> {
        if !self.pools.contains_key(id) {
            return Err(err(ErrorCode::PoolNotFound, format!("no pool {id}: register its target first")));
        }
        if let Some(old) = self.views.get(id) {
            if push.seq <= old.seq {
                return Err(err(ErrorCode::StaleView, format!("view seq {} of {id} is not above {}", push.seq, old.seq)));
            }
        }
        let view =
            View { pool: id.clone(), seq: push.seq, version: self.view_version() + 1, received_ms: now_ms, figures: push.figures.clone() };
        Ok((vec![Write::Put(Record::View(view.clone()))], view))
    }

    /// Whether a pool's target has been silent for more than VIEW_STALE_MS at `now_ms`: no
    /// view of the pool and no registration of its target since. A clock that went back
    /// (another leader's) counts as heard now.
    pub fn stale(&self, id: &PoolId, now_ms: u64) -> bool {
        let view = self.views.get(id).map(|v| v.received_ms);
        let registered = self.targets.get(&id.target).map(|t| t.registered_ms);
        view.max(registered).is_none_or(|heard| now_ms.saturating_sub(heard) > VIEW_STALE_MS)
    }

    pub fn view(&self, since: u64, now_ms: u64) -> ClusterView {
        let pools = self
            .pools
            .values()
            .filter(|p| since == 0 || self.views.get(&p.id).is_some_and(|v| v.version > since))
            .map(|p| {
                let view = self.views.get(&p.id).cloned();
                let stale = self.stale(&p.id, now_ms);
                PoolView {
                    pool: p.id.name.clone(),
                    target: p.id.target.clone(),
                    path: p.path.clone(),
                    size: p.size,
                    allocated: self.allocated(&p.id),
                    extents: self.placed.get(&p.id).map_or(0, |m| m.len() as u64),
                    view,
                    stale,
                    cordoned: p.cordoned,
                    write_cost: p.write_cost,
                }
            })
            .collect();
        ClusterView { version: self.view_version(), targets: self.targets.values().cloned().collect(), pools, links: Vec::new() }
    }

    /// Cordons a pool (no new extents placed there) or ends its cordon.
    pub fn cordon(&self, id: &PoolId, cordoned: bool) -> Planned<Pool> {
        let p = self.pools.get(id).ok_or_else(|| err(ErrorCode::PoolNotFound, format!("no pool {id}")))?;
        if p.cordoned == cordoned {
            return Ok((Vec::new(), p.clone()));
        }
        let p = Pool { cordoned, ..p.clone() };
        Ok((vec![Write::Put(Record::Pool(p.clone()))], p))
    }

    // ---- volumes ----

    pub fn volume(&self, name: &str) -> Result<&Volume, ApiError> {
        self.volumes.get(name).ok_or_else(|| err(ErrorCode::VolumeNotFound, format!("no volume '{name}'")))
    }

    pub fn create_volume(&self, req: &CreateVolume, now_ms: u64) -> Planned<Volume> {
        check_name("volume", &req.name)?;
        let extent_size = req.extent_size.unwrap_or(EXTENT_BYTES_DEFAULT);
        if !(EXTENT_BYTES_MIN..=EXTENT_BYTES_MAX).contains(&extent_size) || !extent_size.is_multiple_of(EXTENT_ALIGN_BYTES) {
            return Err(err(
                ErrorCode::InvalidArgument,
                format!(
                    "extent size {extent_size} must be a multiple of {EXTENT_ALIGN_BYTES} from {EXTENT_BYTES_MIN} to {EXTENT_BYTES_MAX}"
                ),
            ));
        }
        check_volume_size(req.size, extent_size)?;
        if self.volumes.contains_key(&req.name) {
            return Err(err(ErrorCode::VolumeExists, format!("volume '{}' exists", req.name)));
        }
        if self.volumes.len() >= VOLUMES_MAX {
            return Err(err(ErrorCode::LimitExceeded, format!("the control plane keeps {VOLUMES_MAX} volumes")));
        }
        let v = Volume { name: req.name.clone(), size: req.size, extent_size, created_ms: now_ms, handover: None };
        Ok((vec![Write::Put(Record::Volume(v.clone()))], v))
    }

    pub fn grow_volume(&self, name: &str, req: &GrowVolume) -> Planned<Volume> {
        let v = self.volume(name)?;
        check_volume_size(req.size, v.extent_size)?;
        if req.size <= v.size {
            return Err(err(
                ErrorCode::ShrinkRefused,
                format!("volume '{name}' has {} bytes: grow takes a larger size, not {}", v.size, req.size),
            ));
        }
        let v = Volume { size: req.size, ..v.clone() };
        Ok((vec![Write::Put(Record::Volume(v.clone()))], v))
    }

    /// Deleting a volume frees its extents; an exported one is refused (a target serves it).
    pub fn delete_volume(&self, name: &str, now_ms: u64) -> Planned<()> {
        let v = self.volume(name)?;
        if let Some(x) = self.exports.get(name) {
            return Err(err(
                ErrorCode::VolumeExported,
                format!("volume '{name}' is exported by {} as {}: unexport it first", x.target, x.nqn),
            ));
        }
        // Its extents freed under its last exporter's late writes would take them into
        // another volume's.
        self.refuse_in_doubt(v, now_ms, None)?;
        self.no_moves(name)?;
        let mut writes: Vec<Write> = self
            .extents
            .range((name.to_string(), 0)..=(name.to_string(), u64::MAX))
            .map(|((v, i), _)| Write::Delete(Table::Extents, extent_key(v, *i)))
            .collect();
        writes.push(Write::Delete(Table::Volumes, name.to_string()));
        Ok((writes, ()))
    }

    pub fn extent_info(&self, e: &Extent) -> ExtentInfo {
        ExtentInfo {
            index: e.index,
            pool: e.pool.name.clone(),
            target: e.pool.target.clone(),
            path: self.pools.get(&e.pool).map(|p| p.path.clone()).unwrap_or_default(),
            offset: e.offset,
            epoch: e.epoch,
            nsid: self.pools.get(&e.pool).map_or(0, |p| p.nsid),
            unwritten: e.unwritten,
        }
    }

    /// The translation service: where extent `index` lies, if it is allocated.
    pub fn translate(&self, name: &str, index: u64) -> Result<Translation, ApiError> {
        let v = self.volume(name)?;
        if index >= v.extents() {
            return Err(err(ErrorCode::ExtentOutOfRange, format!("volume '{name}' has {} extents: no extent {index}", v.extents())));
        }
        Ok(Translation { index, extent: self.extents.get(&(name.to_string(), index)).map(|e| self.extent_info(e)) })
    }

    /// Extent `index` was zeroed in its pool by the data path that allocated it: from now on
    /// it holds the volume's bytes (idempotent).
    pub fn mark_written(&self, name: &str, index: u64) -> Planned<ExtentInfo> {
        self.translate(name, index)?;
        let Some(e) = self.extents.get(&(name.to_string(), index)) else {
            return Err(err(ErrorCode::InvalidArgument, format!("extent {index} of '{name}' is not allocated")));
        };
        if !e.unwritten {
            return Ok((Vec::new(), self.extent_info(e)));
        }
        let e = Extent { unwritten: false, ..e.clone() };
        let info = self.extent_info(&e);
        Ok((vec![Write::Put(Record::Extent(e))], info))
    }

    // ---- exports ----

    /// Exports a volume on a registered target, to the hosts named; exported again to the
    /// same target, its hosts are replaced. A volume is served by one target at a time: its
    /// data path is then the only one that allocates its extents.
    pub fn export(&self, name: &str, req: &ExportVolume, now_ms: u64) -> Planned<Export> {
        let v = self.volume(name)?;
        if !self.targets.contains_key(&req.target) {
            return Err(err(ErrorCode::TargetNotFound, format!("no target {} is registered", req.target)));
        }
        if let Some(x) = self.exports.get(name).filter(|x| x.target != req.target) {
            return Err(err(ErrorCode::VolumeExported, format!("volume '{name}' is exported by {}: unexport it first", x.target)));
        }
        if self.exports.get(name).is_none_or(|x| x.target != req.target) {
            // A move's copier is the exporting target, or the destination's when none.
            self.no_moves(name)?;
        }
        // Its last exporter may still write: not another target's yet. Exported again
        // where it was, or once the handover is over, the record goes.
        self.refuse_in_doubt(v, now_ms, Some(&req.target))?;
        if req.hosts.is_empty() && !req.allow_any_host {
            return Err(err(ErrorCode::InvalidArgument, "name the hosts allowed, or allow any host"));
        }
        if req.hosts.len() > HOSTS_PER_EXPORT_MAX {
            return Err(err(ErrorCode::LimitExceeded, format!("{} hosts: an export allows {HOSTS_PER_EXPORT_MAX}", req.hosts.len())));
        }
        for h in &req.hosts {
            if !h.starts_with("nqn.") || h.len() > NQN_BYTES_MAX || !h.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(err(ErrorCode::InvalidArgument, format!("host '{h}' is not an NQN (nqn., at most {NQN_BYTES_MAX} bytes)")));
            }
        }
        let nqn = format!("{VOLUME_NQN_PREFIX}{name}");
        if nqn.len() > NQN_BYTES_MAX {
            return Err(err(
                ErrorCode::InvalidArgument,
                format!("volume name '{name}' makes an NQN over {NQN_BYTES_MAX} bytes: it cannot be exported"),
            ));
        }
        let mut hosts = req.hosts.clone();
        hosts.sort();
        hosts.dedup();
        // The same export asked again (a retry): nothing changes, and its target keeps
        // serving it as it is.
        if let Some(x) =
            self.exports.get(name).filter(|x| x.target == req.target && x.hosts == hosts && x.allow_any_host == req.allow_any_host)
        {
            return Ok((Vec::new(), x.clone()));
        }
        let epoch = self.counters.get(EXPORTS_COUNTER).copied().unwrap_or(0) + 1;
        let x = Export { volume: name.into(), target: req.target.clone(), hosts, allow_any_host: req.allow_any_host, nqn, nsid: 1, epoch };
        let counter = Counter { name: EXPORTS_COUNTER.into(), value: epoch };
        let mut writes = vec![Write::Put(Record::Counter(counter)), Write::Put(Record::Export(x.clone()))];
        // A handover that is over goes. Exported again by the process that unexported it,
        // which waits for its own instances before serving: its part is over, what its
        // target's earlier processes may still send is not (`after_fence`).
        let current = self.targets.get(&req.target).map_or(0, |t| t.incarnation);
        if let Some(h) = &v.handover {
            if self.handover_left(h, now_ms).is_none() {
                writes.push(Write::Put(Record::Volume(Volume { handover: None, ..v.clone() })));
            } else if h.from == req.target && h.incarnation == current && !h.released {
                writes.push(self.own_part_over(v, h, now_ms));
            }
        }
        Ok((writes, x))
    }

    /// Stops exporting a volume (nothing to do when it is not exported). Its exporter may
    /// go on writing until its export lease (`lease_ms`) runs out, and what it issued may
    /// land until its write bound after that: the volume records the handover, which ends
    /// when the exporter confirms it stopped ([`Cluster::released`]) or at that bound
    /// (docs/control-plane.md, "Handing an export over").
    pub fn unexport(&self, name: &str, now_ms: u64, lease_ms: u64) -> Planned<()> {
        let v = self.volume(name)?;
        let Some(x) = self.exports.get(name) else { return Ok((Vec::new(), ())) };
        let bound = write_bound(self.targets.get(&x.target).map_or(0, |t| t.write_bound_ms));
        let until_ms = now_ms.saturating_add(lease_ms).saturating_add(bound).saturating_add(EXPORT_HANDOVER_MARGIN_MS);
        let incarnation = self.targets.get(&x.target).map_or(0, |t| t.incarnation);
        // Its earlier processes not fenced yet: the handover waits for that too.
        let after_fence = self.unfenced_left(&x.target, now_ms).is_some();
        let handover = Handover { from: x.target.clone(), epoch: x.epoch, incarnation, until_ms, released: false, after_fence };
        let writes = vec![
            Write::Delete(Table::Exports, name.to_string()),
            Write::Put(Record::Volume(Volume { handover: Some(handover), ..v.clone() })),
        ];
        Ok((writes, ()))
    }

    /// The volume's last exporter `target`, process `incarnation`, says it no longer writes
    /// to its extents for export `epoch`: its part of the handover ends (the handover goes,
    /// unless its target's earlier processes are still to be fenced). Nothing to do for
    /// another target, another export of it (a late word about an earlier one), a process
    /// that did not unexport it or is not the registered one, or when none is under way.
    pub fn released(&self, name: &str, target: &str, epoch: u64, incarnation: u64, now_ms: u64) -> Planned<()> {
        let v = self.volume(name)?;
        let current = self.targets.get(target).map_or(0, |t| t.incarnation);
        let writes = match &v.handover {
            Some(h) if h.from == target && h.epoch == epoch && h.incarnation == incarnation && incarnation == current && !h.released => {
                vec![self.own_part_over(v, h, now_ms)]
            }
            _ => Vec::new(),
        };
        Ok((writes, ()))
    }

    /// Volume `v` with its handover `h`'s exporter's part over: the handover goes unless its
    /// `after_fence` part still holds.
    fn own_part_over(&self, v: &Volume, h: &Handover, now_ms: u64) -> Write {
        let h = Handover { released: true, ..h.clone() };
        let handover = self.handover_left(&h, now_ms).is_some().then_some(h);
        Write::Put(Record::Volume(Volume { handover, ..v.clone() }))
    }

    /// Process `incarnation` of `target` has fenced its earlier processes at the pools of
    /// every registered target: nothing they sent can land any more. One record changes,
    /// the target's; the volumes waiting for them (exported by it, or handed over by it)
    /// go on. Nothing to do for a process that is no longer the target's registered one (it
    /// cannot speak for a later one's predecessors), for an unknown target, or for earlier
    /// processes a fence does not reach (`time_only`).
    pub fn fenced(&self, target: &str, incarnation: u64) -> Planned<()> {
        let Some(t) = self.targets.get(target).filter(|t| incarnation != 0 && t.incarnation == incarnation) else {
            return Ok((Vec::new(), ()));
        };
        let writes = match &t.unfenced {
            Some(u) if !u.time_only => vec![Write::Put(Record::Target(Target { unfenced: None, ..t.clone() }))],
            _ => Vec::new(),
        };
        Ok((writes, ()))
    }

    /// Seconds that `target`'s earlier processes may still write to the pools of the
    /// volumes they served at `now_ms`; None when none may.
    pub fn unfenced_left(&self, target: &str, now_ms: u64) -> Option<u64> {
        self.targets.get(target)?.unfenced.as_ref()?.seconds_left(now_ms)
    }

    /// Whether handover `h` still holds at `now_ms`: the seconds left at most, and whether
    /// only its target's earlier processes hold it. Its exporter's part ends with that
    /// process's word (`released`) or its bound; for an earlier process of the target (the
    /// target registered another since), also with the fence of the registered one. Its
    /// `after_fence` part ends with that fence or the target's `unfenced` bound.
    pub fn handover_left(&self, h: &Handover, now_ms: u64) -> Option<(u64, bool)> {
        let t = self.targets.get(&h.from);
        let current = t.map_or(0, |t| t.incarnation);
        let record = t.and_then(|t| t.unfenced.as_ref());
        let earlier = record.and_then(|u| u.seconds_left(now_ms));
        let by_earlier = current != 0 && h.incarnation != current;
        // An earlier process's part ends when the registered process fenced it: the record
        // went (the registration that changed the incarnation made it). Not merely past its
        // bound: that bound is the target's declared one at the restart, and the handover's
        // may be longer (the crates/control/tests/sim.rs oracle found one declared 0, then 50).
        let own = if h.released || (by_earlier && record.is_none()) { None } else { h.seconds_left(now_ms) };
        let fence = if h.after_fence { earlier } else { None };
        match (own, fence) {
            (None, None) => None,
            (own, fence) => Some((own.unwrap_or(0).max(fence.unwrap_or(0)), own.is_none() || by_earlier)),
        }
    }

    /// Who may still write to volume `v`'s extents at `now_ms` and is not `to`, for how
    /// long at most: its handover's exporter, or the earlier processes of its exporter.
    /// The longer of the two when both hold.
    pub fn in_doubt(&self, v: &Volume, now_ms: u64, to: Option<&str>) -> Option<InDoubt> {
        let handover = v.handover.as_ref().filter(|h| to != Some(h.from.as_str())).and_then(|h| {
            let (seconds_left, restarted) = self.handover_left(h, now_ms)?;
            Some(InDoubt { target: h.from.clone(), seconds_left, restarted })
        });
        let exporter = self.exports.get(&v.name).filter(|x| to != Some(x.target.as_str())).and_then(|x| {
            let seconds_left = self.unfenced_left(&x.target, now_ms)?;
            Some(InDoubt { target: x.target.clone(), seconds_left, restarted: true })
        });
        handover.into_iter().chain(exporter).max_by_key(|d| d.seconds_left)
    }

    /// Refuses what [`Cluster::in_doubt`] forbids: anything but exporting the volume again on
    /// the target that may still write (`to`).
    fn refuse_in_doubt(&self, v: &Volume, now_ms: u64, to: Option<&str>) -> Result<(), ApiError> {
        let Some(d) = self.in_doubt(v, now_ms, to) else { return Ok(()) };
        let (name, from, left) = (&v.name, &d.target, d.seconds_left);
        let message = if d.restarted {
            format!(
                "volume '{name}' was exported by {from}, which restarted: its earlier process may still write to its \
                 extents until the new one has fenced it, at the latest in {left} s: try again then"
            )
        } else {
            format!(
                "volume '{name}' was exported by {from}, which may still write to its extents until it confirms it \
                 stopped, at the latest in {left} s: try again then"
            )
        };
        Err(err(ErrorCode::ExportHandover, message))
    }

    /// The exports a target serves.
    pub fn exports_of(&self, target: &str) -> Vec<Export> {
        self.exports.values().filter(|x| x.target == target).cloned().collect()
    }

    // ---- tenants (docs/operations.md, "Tenants") ----

    pub fn tenant(&self, name: &str) -> Result<&Tenant, ApiError> {
        self.tenants.get(name).ok_or_else(|| err(ErrorCode::TenantNotFound, format!("no tenant '{name}'")))
    }

    /// Creates a tenant, checked as a target checks a `[[tenant]]` entry, so that every
    /// target takes it: a name not built in, weights in range, host NQNs in no other
    /// tenant, reaches that are NQNs or `volume:NAME`.
    pub fn create_tenant(&self, t: &Tenant) -> Planned<Tenant> {
        check_name("tenant", &t.name)?;
        if t.name.len() > TENANT_NAME_BYTES_MAX || t.name == "default" || t.name == "cluster" {
            return Err(err(
                ErrorCode::InvalidArgument,
                format!("tenant name '{}': built in, or over {TENANT_NAME_BYTES_MAX} bytes", t.name),
            ));
        }
        if self.tenants.contains_key(&t.name) {
            return Err(err(ErrorCode::TenantExists, format!("tenant '{}' exists", t.name)));
        }
        if self.tenants.len() >= TENANTS_MAX {
            return Err(err(ErrorCode::LimitExceeded, format!("{TENANTS_MAX} tenants exist already")));
        }
        for (what, w) in [("io_weight", t.io_weight), ("compute_weight", t.compute_weight)] {
            if w == 0 || w > TENANT_WEIGHT_MAX {
                return Err(err(ErrorCode::InvalidArgument, format!("{what} {w}: a weight must be between 1 and {TENANT_WEIGHT_MAX}")));
            }
        }
        if t.offload_memory == Some(0) {
            return Err(err(ErrorCode::InvalidArgument, "offload_memory 0 holds no compute command"));
        }
        if t.hosts.is_empty() || t.hosts.len() > TENANT_HOSTS_MAX {
            return Err(err(ErrorCode::LimitExceeded, format!("{} hosts: a tenant has 1 to {TENANT_HOSTS_MAX}", t.hosts.len())));
        }
        if t.reach.len() > TENANT_REACH_MAX {
            return Err(err(ErrorCode::LimitExceeded, format!("{} reaches: a tenant has at most {TENANT_REACH_MAX}", t.reach.len())));
        }
        let nqn = |h: &str| h.starts_with("nqn.") && h.len() <= NQN_BYTES_MAX && h.bytes().all(|b| b.is_ascii_graphic());
        for (i, h) in t.hosts.iter().enumerate() {
            if !nqn(h) {
                return Err(err(ErrorCode::InvalidArgument, format!("host '{h}' is not an NQN (nqn., at most {NQN_BYTES_MAX} bytes)")));
            }
            if t.hosts[..i].contains(h) {
                return Err(err(ErrorCode::InvalidArgument, format!("host {h} is named twice")));
            }
            if let Some(o) = self.tenants.values().find(|o| o.hosts.contains(h)) {
                return Err(err(ErrorCode::HostInTenant, format!("host {h} is in tenant '{}' already", o.name)));
            }
        }
        for r in &t.reach {
            match r.strip_prefix(VOLUME_REACH_PREFIX) {
                Some(v) => check_name("volume", v)?,
                // It holds every volume's blocks: a tenant reaching it would read past the
                // volumes it was given.
                None if r == POOLS_NQN => {
                    return Err(err(ErrorCode::InvalidArgument, format!("reach {r}: the pool subsystem is the cluster members' only")))
                }
                None if nqn(r) => {}
                None => return Err(err(ErrorCode::InvalidArgument, format!("reach '{r}' is neither a subsystem NQN nor volume:NAME"))),
            }
        }
        Ok((vec![Write::Put(Record::Tenant(t.clone()))], t.clone()))
    }

    pub fn delete_tenant(&self, name: &str) -> Planned<()> {
        self.tenant(name)?;
        Ok((vec![Write::Delete(Table::Tenants, name.to_string())], ()))
    }

    // ---- moves (docs/control-plane.md, "Moving an extent") ----

    fn no_moves(&self, name: &str) -> Result<(), ApiError> {
        match self.moves.range((name.to_string(), 0)..=(name.to_string(), u64::MAX)).next() {
            Some((_, m)) => Err(err(
                ErrorCode::MoveInProgress,
                format!("extent {} of volume '{name}' is being moved ({}): wait for its move to end", m.index, state_name(m.state)),
            )),
            None => Ok(()),
        }
    }

    /// Begins moving extent `index` of a volume to `req.to`, or to the pool the placement
    /// prefers among the others: the destination is reserved, and the copier (the exporting
    /// target, else the destination's) is told through its moves' long poll.
    pub fn begin_move(&self, name: &str, index: u64, req: &MoveRequest, now_ms: u64) -> Planned<Move> {
        let v = self.volume(name)?;
        // A late write of its last exporter would land in `from` after the copy read it.
        self.refuse_in_doubt(v, now_ms, None)?;
        if index >= v.extents() {
            return Err(err(ErrorCode::ExtentOutOfRange, format!("volume '{name}' has {} extents: no extent {index}", v.extents())));
        }
        let Some(e) = self.extents.get(&(name.to_string(), index)) else {
            return Err(err(ErrorCode::ExtentNotAllocated, format!("extent {index} of volume '{name}' is unallocated: nothing to move")));
        };
        if let Some(m) = self.moves.get(&(name.to_string(), index)) {
            return Err(err(
                ErrorCode::MoveInProgress,
                format!("extent {index} of volume '{name}' is being moved to {} ({})", m.to, state_name(m.state)),
            ));
        }
        if self.moves.len() >= MOVES_MAX {
            return Err(err(ErrorCode::LimitExceeded, format!("{MOVES_MAX} moves are under way: wait for some to end")));
        }
        let to = match &req.to {
            Some(spec) => {
                let id = parse_pool(spec)?;
                let pool = self.pools.get(&id).ok_or_else(|| err(ErrorCode::PoolNotFound, format!("no pool {id}")))?;
                if id == e.pool {
                    return Err(err(ErrorCode::InvalidArgument, format!("extent {index} of volume '{name}' is in {id} already")));
                }
                if pool.cordoned {
                    return Err(err(
                        ErrorCode::PoolCordoned,
                        format!("pool {id} is cordoned (drained): it takes no extent until uncordoned"),
                    ));
                }
                let offset = self.hole(pool, v.extent_size).ok_or_else(|| {
                    err(ErrorCode::NoSpace, format!("pool {id} has no free {} bytes for extent {index} of '{name}'", v.extent_size))
                })?;
                (id, offset)
            }
            None => {
                let chosen = self.place(name, v.extent_size, |p| *p != e.pool, now_ms).map_err(|stale| {
                    err(ErrorCode::NoSpace, format!("no other pool has {} free bytes for extent {index} of '{name}'{stale}", v.extent_size))
                })?;
                let offset =
                    self.hole(&self.pools[&chosen], v.extent_size).ok_or_else(|| err(ErrorCode::NoSpace, "the chosen pool filled"))?;
                (chosen, offset)
            }
        };
        let copier = self.exports.get(name).map_or_else(|| to.0.target.clone(), |x| x.target.clone());
        let id = self.counters.get(MOVES_COUNTER).copied().unwrap_or(0) + 1;
        let m = Move {
            id,
            volume: name.to_string(),
            index,
            epoch: e.epoch,
            from: e.pool.clone(),
            from_offset: e.offset,
            from_nsid: self.pools.get(&e.pool).map_or(0, |p| p.nsid),
            to_nsid: self.pools.get(&to.0).map_or(0, |p| p.nsid),
            to: to.0,
            to_offset: to.1,
            extent_size: v.extent_size,
            copier,
            state: MoveState::Invalidating,
            max_bps: req.max_bps,
            copied: 0,
            started_ms: now_ms,
            deadline_ms: now_ms + MOVE_SILENCE_MS,
            reason: String::new(),
        };
        let counter = Counter { name: MOVES_COUNTER.into(), value: id };
        Ok((vec![Write::Put(Record::Counter(counter)), Write::Put(Record::Move(m.clone()))], m))
    }

    /// The move a copier reports on: the one under way with the report's id (and epoch). A
    /// word of a move that ended is refused, whatever move of the extent is under way now.
    fn reported(&self, name: &str, index: u64, r: &MoveReport) -> Result<&Move, ApiError> {
        self.moves.get(&(name.to_string(), index)).filter(|m| m.id == r.id && m.epoch == r.epoch).ok_or_else(|| {
            err(ErrorCode::MoveNotFound, format!("no move {} of extent {index} of volume '{name}' is under way (it ended)", r.id))
        })
    }

    /// The copier's word: `ack` (nothing reaches the extent any more: Invalidating to
    /// Copying), or progress (bytes copied); either puts the deadline off. An aborted move
    /// is refused: the copier stops and says `abort`.
    pub fn report_move(&self, name: &str, index: u64, r: &MoveReport, ack: bool, now_ms: u64) -> Planned<Move> {
        let m = self.reported(name, index, r)?;
        let refuse = |why: &str| err(ErrorCode::MoveNotFound, format!("the move of extent {index} of volume '{name}' {why}"));
        let state = match (m.state, ack) {
            (MoveState::Aborted, _) => return Err(refuse(&format!("was aborted: {}", m.reason))),
            (MoveState::Invalidating, false) => return Err(refuse("is not acknowledged yet")),
            _ => MoveState::Copying,
        };
        let m = Move { state, copied: r.copied.max(m.copied), deadline_ms: now_ms + MOVE_SILENCE_MS, ..m.clone() };
        Ok((vec![Write::Put(Record::Move(m.clone()))], m))
    }

    /// Publishes a copied extent: in one commit, the extent at its destination with the
    /// next epoch, and the move gone (the old place is free again).
    pub fn publish_move(&self, name: &str, index: u64, r: &MoveReport) -> Planned<ExtentInfo> {
        let m = self.reported(name, index, r)?;
        if m.state != MoveState::Copying {
            return Err(err(
                ErrorCode::MoveNotFound,
                format!("the move of extent {index} of volume '{name}' is {}: it cannot be published", state_name(m.state)),
            ));
        }
        // Unwritten stays so (its copy is of whatever the old place held, which reads as zeros).
        let unwritten = self.extents.get(&(name.to_string(), index)).is_some_and(|e| e.unwritten);
        let e = Extent { volume: name.to_string(), index, pool: m.to.clone(), offset: m.to_offset, epoch: m.epoch + 1, unwritten };
        let info = self.extent_info(&e);
        Ok((vec![Write::Put(Record::Extent(e)), Write::Delete(Table::Moves, extent_key(name, index))], info))
    }

    /// The copier gave up (or confirms it stopped): the move goes, its destination is free,
    /// the extent stays where it was.
    pub fn abort_move(&self, name: &str, index: u64, r: &MoveReport) -> Planned<()> {
        self.reported(name, index, r)?;
        Ok((vec![Write::Delete(Table::Moves, extent_key(name, index))], ()))
    }

    /// Aborts the moves whose copier said nothing by their deadline; their destinations stay
    /// reserved until the copier confirms (it may still be writing there).
    pub fn expire_moves(&self, now_ms: u64) -> Planned<usize> {
        let writes: Vec<Write> = self
            .moves
            .values()
            .filter(|m| m.state != MoveState::Aborted && now_ms > m.deadline_ms)
            .map(|m| {
                let reason = format!("its copier {} said nothing for {} ms", m.copier, MOVE_SILENCE_MS);
                Write::Put(Record::Move(Move { state: MoveState::Aborted, reason, ..m.clone() }))
            })
            .collect();
        let n = writes.len();
        Ok((writes, n))
    }

    /// The moves `target` copies (every move without one).
    pub fn moves_of(&self, target: Option<&str>) -> Vec<Move> {
        self.moves.values().filter(|m| target.is_none_or(|t| m.copier == t)).cloned().collect()
    }

    pub fn volume_info(&self, name: &str, now_ms: u64) -> Result<VolumeInfo, ApiError> {
        let v = self.volume(name)?;
        let extents: Vec<ExtentInfo> =
            self.extents.range((name.to_string(), 0)..=(name.to_string(), u64::MAX)).map(|(_, e)| self.extent_info(e)).collect();
        let in_doubt = self.in_doubt(v, now_ms, None);
        Ok(VolumeInfo { volume: v.clone(), extents_total: v.extents(), extents_allocated: extents.len() as u64, extents, in_doubt })
    }

    /// Allocates extent `index` of a volume at `now_ms`, placed by [`placement::place`] on a
    /// pool that is not stale; an extent already allocated is returned as it is (the data
    /// path may ask twice).
    pub fn allocate(&self, name: &str, index: u64, now_ms: u64) -> Planned<ExtentInfo> {
        let v = self.volume(name)?;
        if index >= v.extents() {
            return Err(err(ErrorCode::ExtentOutOfRange, format!("volume '{name}' has {} extents: no extent {index}", v.extents())));
        }
        if let Some(e) = self.extents.get(&(name.to_string(), index)) {
            return Ok((Vec::new(), self.extent_info(e)));
        }
        let chosen = self.place(name, v.extent_size, |_| true, now_ms).map_err(|stale| {
            err(
                ErrorCode::NoSpace,
                format!(
                    "no {}pool has {} free bytes for extent {index} of '{name}'{stale}",
                    if stale.is_empty() { "" } else { "fresh " },
                    v.extent_size
                ),
            )
        })?;
        let pool = &self.pools[&chosen];
        let offset = self.hole(pool, v.extent_size).ok_or_else(|| err(ErrorCode::NoSpace, "the chosen pool filled"))?;
        let e = Extent { volume: name.to_string(), index, pool: pool.id.clone(), offset, epoch: 1, unwritten: true };
        let info = self.extent_info(&e);
        Ok((vec![Write::Put(Record::Extent(e))], info))
    }

    /// The pool [`placement::place`] prefers for an extent of volume `name` among those
    /// `allowed` that are not stale. Err: none, with "; only stale pools have room ..." when
    /// stale ones have.
    fn place(&self, name: &str, extent_size: u64, allowed: impl Fn(&PoolId) -> bool, now_ms: u64) -> Result<PoolId, String> {
        let candidates: Vec<Candidate> = self
            .pools
            .values()
            .filter(|p| allowed(&p.id) && !p.cordoned)
            .map(|p| Candidate {
                pool: p.id.clone(),
                size: p.size,
                allocated: self.allocated(&p.id),
                fits: self.hole(p, extent_size).is_some(),
                figures: self.views.get(&p.id).map(|w| w.figures.clone()),
                stale: self.stale(&p.id, now_ms),
            })
            .collect();
        let mut per_target: HashMap<&str, u64> = HashMap::new();
        let mut total = 0;
        for e in self.extents.range((name.to_string(), 0)..=(name.to_string(), u64::MAX)).map(|(_, e)| e) {
            *per_target.entry(e.pool.target.as_str()).or_default() += 1;
            total += 1;
        }
        match placement::place(&candidates, total, |t| per_target.get(t).copied().unwrap_or(0)) {
            Some(c) => Ok(c.pool.clone()),
            None => {
                let stale: Vec<String> = candidates.iter().filter(|c| c.fits && c.stale).map(|c| c.pool.to_string()).collect();
                if stale.is_empty() {
                    return Err(String::new());
                }
                Err(format!("; only stale pools have room (no view for {} s): {}", VIEW_STALE_MS / 1000, stale.join(", ")))
            }
        }
    }
}

/// A pool named `NAME@TARGET`, as the CLI prints it.
pub fn parse_pool(spec: &str) -> Result<PoolId, ApiError> {
    match spec.split_once('@') {
        Some((name, target)) if !name.is_empty() && !target.is_empty() => Ok(PoolId { target: target.into(), name: name.into() }),
        _ => Err(err(ErrorCode::InvalidArgument, format!("pool '{spec}' is not NAME@TARGET"))),
    }
}

fn state_name(s: MoveState) -> &'static str {
    match s {
        MoveState::Invalidating => "invalidating",
        MoveState::Copying => "copying",
        MoveState::Aborted => "aborted, waiting for its copier to confirm",
    }
}

/// A target's declared write bound (`Target::write_bound_ms`), or the default when it
/// declared none (0).
fn write_bound(declared_ms: u64) -> u64 {
    if declared_ms == 0 {
        EXPORT_WRITE_BOUND_MS_DEFAULT
    } else {
        declared_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn cluster(pools: &[(&str, &str, u64)]) -> Cluster {
        let mut c = Cluster::default();
        let mut by_target: BTreeMap<&str, Vec<PoolSpec>> = BTreeMap::new();
        for &(t, n, size) in pools {
            by_target.entry(t).or_default().push(PoolSpec {
                name: n.into(),
                path: format!("/p/{n}"),
                size,
                nsid: 1,
                bandwidth: 0,
                write_cost: 0.0,
            });
        }
        for (t, pools) in by_target {
            let (w, _) = c
                .register(&RegisterTarget { addr: t.into(), nqn: "nqn.x".into(), pools, write_bound_ms: 0, incarnation: 0 }, 0, 0)
                .expect("register");
            w.iter().for_each(|w| c.apply(w));
        }
        c
    }

    fn commit<T>(c: &mut Cluster, plan: impl FnOnce(&Cluster) -> Planned<T>) -> Result<T, ErrorCode> {
        let (w, t) = plan(c).map_err(|e| e.code)?;
        w.iter().for_each(|w| c.apply(w));
        Ok(t)
    }

    /// Each request against a cluster with one volume 'v' (4 extents of 1 MiB) and one pool of
    /// 2 MiB: the error code expected, or none.
    #[test]
    fn volume_requests() {
        enum Req {
            Create(&'static str, u64, Option<u64>),
            Grow(&'static str, u64),
            Delete(&'static str),
            Alloc(&'static str, u64),
            Translate(&'static str, u64),
            ExportTo(&'static str, &'static str, &'static [&'static str], bool),
            Unexport(&'static str),
        }
        use Req::*;
        #[rustfmt::skip]
        let cases: &[(Req, Option<ErrorCode>)] = &[
            (Create("w", 4 * MIB, Some(MIB)), None),
            (Create("v", 4 * MIB, Some(MIB)), Some(ErrorCode::VolumeExists)),
            (Create("w", 0, Some(MIB)), Some(ErrorCode::InvalidArgument)),
            (Create("w", 3 * MIB / 2, Some(MIB)), Some(ErrorCode::InvalidArgument)),
            (Create("w", 64 * MIB, None), None),
            (Create("w", 32 * MIB, None), Some(ErrorCode::InvalidArgument)),
            (Create("w", 4 * MIB, Some(MIB / 2)), Some(ErrorCode::InvalidArgument)),
            (Create("w", 4 * MIB, Some(2 * EXTENT_BYTES_MAX)), Some(ErrorCode::InvalidArgument)),
            (Create("w", 4 * MIB, Some(MIB + 512)), Some(ErrorCode::InvalidArgument)),
            (Create("w", (EXTENTS_PER_VOLUME_MAX + 1) * MIB, Some(MIB)), Some(ErrorCode::LimitExceeded)),
            (Create("w", EXTENTS_PER_VOLUME_MAX * MIB, Some(MIB)), None),
            (Create("", MIB, Some(MIB)), Some(ErrorCode::InvalidArgument)),
            (Create("a/b", MIB, Some(MIB)), Some(ErrorCode::InvalidArgument)),
            (Create(".hidden", MIB, Some(MIB)), Some(ErrorCode::InvalidArgument)),
            (Grow("v", 8 * MIB), None),
            (Grow("v", 4 * MIB), Some(ErrorCode::ShrinkRefused)),
            (Grow("v", 2 * MIB), Some(ErrorCode::ShrinkRefused)),
            (Grow("v", 9 * MIB / 2), Some(ErrorCode::InvalidArgument)),
            (Grow("nope", 8 * MIB), Some(ErrorCode::VolumeNotFound)),
            (Delete("v"), None),
            (Delete("nope"), Some(ErrorCode::VolumeNotFound)),
            (Alloc("v", 0), None),
            (Alloc("v", 3), None),
            (Alloc("v", 4), Some(ErrorCode::ExtentOutOfRange)),
            (Alloc("nope", 0), Some(ErrorCode::VolumeNotFound)),
            (Translate("v", 3), None),
            (Translate("v", 4), Some(ErrorCode::ExtentOutOfRange)),
            (Translate("nope", 0), Some(ErrorCode::VolumeNotFound)),
            // 'x' is exported to t1.
            (ExportTo("v", "t1", &["nqn.h"], false), None),
            (ExportTo("v", "t1", &[], true), None),
            (ExportTo("x", "t1", &["nqn.h2"], false), None),
            (ExportTo("x", "t2", &["nqn.h"], false), Some(ErrorCode::VolumeExported)),
            (ExportTo("v", "t9", &["nqn.h"], false), Some(ErrorCode::TargetNotFound)),
            (ExportTo("nope", "t1", &["nqn.h"], false), Some(ErrorCode::VolumeNotFound)),
            (ExportTo("v", "t1", &[], false), Some(ErrorCode::InvalidArgument)),
            (ExportTo("v", "t1", &["host"], false), Some(ErrorCode::InvalidArgument)),
            (Delete("x"), Some(ErrorCode::VolumeExported)),
            (Unexport("x"), None),
            (Unexport("v"), None),
            (Unexport("nope"), Some(ErrorCode::VolumeNotFound)),
        ];
        for (req, expected) in cases {
            let mut c = cluster(&[("t1", "p", 2 * MIB), ("t2", "p", 2 * MIB)]);
            commit(&mut c, |c| c.create_volume(&CreateVolume { name: "v".into(), size: 4 * MIB, extent_size: Some(MIB) }, 0)).expect("v");
            commit(&mut c, |c| c.create_volume(&CreateVolume { name: "x".into(), size: 4 * MIB, extent_size: Some(MIB) }, 0)).expect("x");
            let req_x = ExportVolume { target: "t1".into(), hosts: vec!["nqn.h".into()], allow_any_host: false };
            commit(&mut c, |c| c.export("x", &req_x, 0)).expect("export x");
            let got = match req {
                Create(n, s, e) => {
                    commit(&mut c, |c| c.create_volume(&CreateVolume { name: n.to_string(), size: *s, extent_size: *e }, 0)).map(drop)
                }
                Grow(n, s) => commit(&mut c, |c| c.grow_volume(n, &GrowVolume { size: *s })).map(drop),
                Delete(n) => commit(&mut c, |c| c.delete_volume(n, 0)),
                Alloc(n, i) => commit(&mut c, |c| c.allocate(n, *i, 0)).map(drop),
                Translate(n, i) => c.translate(n, *i).map(drop).map_err(|e| e.code),
                ExportTo(n, t, hosts, any) => {
                    let req =
                        ExportVolume { target: t.to_string(), hosts: hosts.iter().map(|h| h.to_string()).collect(), allow_any_host: *any };
                    commit(&mut c, |c| c.export(n, &req, 0)).map(drop)
                }
                Unexport(n) => commit(&mut c, |c| c.unexport(n, 0, 1000)),
            };
            assert_eq!(got.err(), *expected);
        }
    }

    /// An unexported volume's last exporter may still write to its extents: until it says
    /// it stopped, or its lease and write bound pass, the volume is exported nowhere else,
    /// deleted, nor moved; exported again where it was, at once.
    #[test]
    fn an_unexported_volume_waits_for_its_last_exporter() {
        let mut c = cluster(&[("t1", "p", 4 * MIB), ("t2", "p", 4 * MIB)]);
        // t1 declares a 5 s write bound, t2 none (the default).
        let pool = PoolSpec { name: "p".into(), path: "/p/p".into(), size: 4 * MIB, nsid: 1, bandwidth: 0, write_cost: 0.0 };
        let reg = RegisterTarget { addr: "t1".into(), nqn: "nqn.x".into(), pools: vec![pool], write_bound_ms: 5000, incarnation: 0 };
        commit(&mut c, |c| c.register(&reg, 0, 0)).expect("t1 again");
        commit(&mut c, |c| c.create_volume(&CreateVolume { name: "v".into(), size: 4 * MIB, extent_size: Some(MIB) }, 0)).expect("v");
        commit(&mut c, |c| c.allocate("v", 0, 0)).expect("extent 0");
        let to = |t: &str| ExportVolume { target: t.into(), hosts: vec![], allow_any_host: true };
        let first = commit(&mut c, |c| c.export("v", &to("t1"), 0)).expect("on t1").epoch;
        // Exported again where it is (other hosts): another export.
        let x =
            commit(&mut c, |c| c.export("v", &ExportVolume { target: "t1".into(), hosts: vec!["nqn.h".into()], allow_any_host: false }, 0))
                .expect("again on t1");
        assert!(x.epoch > first, "{} after {first}", x.epoch);
        // The same export again (a retry): nothing changes, not even its epoch.
        let (w, again) = c
            .export("v", &ExportVolume { target: "t1".into(), hosts: vec!["nqn.h".into(), "nqn.h".into()], allow_any_host: false }, 0)
            .expect("the same again");
        assert!(w.is_empty() && again == x, "{w:?} {again:?}");
        // Unexported at 1000 with a 2 s lease: until 1000 + 2000 + 5000 and the margin.
        commit(&mut c, |c| c.unexport("v", 1000, 2000)).expect("unexport");
        let until_ms = 8000 + EXPORT_HANDOVER_MARGIN_MS;
        let h = Handover { from: "t1".into(), epoch: x.epoch, incarnation: 0, until_ms, released: false, after_fence: false };
        assert_eq!(c.volumes["v"].handover, Some(h));
        let refused = |r: Result<(), ErrorCode>, what: &str| assert_eq!(r, Err(ErrorCode::ExportHandover), "{what}");
        refused(c.export("v", &to("t2"), until_ms - 1).map(drop).map_err(|e| e.code), "exported elsewhere");
        refused(c.delete_volume("v", 1000).map(drop).map_err(|e| e.code), "deleted");
        refused(c.begin_move("v", 0, &MoveRequest::default(), 1000).map(drop).map_err(|e| e.code), "moved");
        let e = c.export("v", &to("t2"), 1000).err().expect("refused");
        assert!(e.message.contains("exported by t1") && e.message.contains("in 12 s"), "{}", e.message);
        // Another target's word changes nothing, nor the last exporter's about an earlier
        // export (a late release of the export it replaced); its word about this one ends it.
        commit(&mut c, |c| c.released("v", "t2", x.epoch, 0, 1000)).expect("t2 says");
        commit(&mut c, |c| c.released("v", "t1", first, 0, 1000)).expect("t1 says, late");
        assert!(c.volumes["v"].handover.is_some());
        commit(&mut c, |c| c.released("v", "t1", x.epoch, 0, 1000)).expect("t1 says");
        assert_eq!(c.volumes["v"].handover, None);
        commit(&mut c, |c| c.export("v", &to("t2"), 1000)).expect("on t2 once released");
        // Unexported from t2 (no bound declared: the default); exported again on t2 at once,
        // which ends the handover.
        commit(&mut c, |c| c.unexport("v", 10_000, 2000)).expect("unexport");
        let until = 10_000 + 2000 + EXPORT_WRITE_BOUND_MS_DEFAULT + EXPORT_HANDOVER_MARGIN_MS;
        assert_eq!(c.volumes["v"].handover.as_ref().map(|h| h.until_ms), Some(until));
        commit(&mut c, |c| c.export("v", &to("t2"), 10_001)).expect("again where it was");
        assert_eq!(c.volumes["v"].handover, None);
        // Past the bound, without a word: allowed.
        commit(&mut c, |c| c.unexport("v", 20_000, 2000)).expect("unexport");
        let until = c.volumes["v"].handover.as_ref().expect("handover").until_ms;
        refused(c.export("v", &to("t1"), until - 1).map(drop).map_err(|e| e.code), "one ms before");
        commit(&mut c, |c| c.export("v", &to("t1"), until)).expect("at the bound");
        assert_eq!(c.volumes["v"].handover, None);
        // A target may not declare an absurd bound.
        let reg = RegisterTarget { write_bound_ms: EXPORT_WRITE_BOUND_MS_MAX + 1, ..reg };
        assert_eq!(commit(&mut c, |c| c.register(&reg, 0, 0)).err(), Some(ErrorCode::InvalidArgument));
    }

    /// A target registered again by another process (a restart on the same address): what
    /// its earlier processes sent may still land, so each volume it exports or handed over
    /// is moved, deleted nor exported elsewhere until the new process says it fenced them,
    /// or their lease and write bound pass. One record says so, the target's. The new
    /// process's own handovers end by its own word, not by its fence, and an earlier
    /// process's handover by the fence, not by the new one's word; a handover begun while
    /// earlier processes were unfenced waits for the fence too. Words from a process that is
    /// no longer the registered one change nothing.
    #[test]
    fn a_restarted_exporters_volumes_wait_for_its_fences() {
        // t1 registers first as process 1 (the helper's registration would be a process
        // that predates incarnations).
        let mut c = cluster(&[("t2", "p", 16 * MIB)]);
        let pool = PoolSpec { name: "p".into(), path: "/p/p".into(), size: 16 * MIB, nsid: 1, bandwidth: 0, write_cost: 0.0 };
        let reg = |incarnation| RegisterTarget {
            addr: "t1".into(),
            nqn: "nqn.x".into(),
            pools: vec![pool.clone()],
            write_bound_ms: 5000,
            incarnation,
        };
        commit(&mut c, |c| c.register(&reg(1), 0, 2000)).expect("t1, process 1");
        let to = |t: &str| ExportVolume { target: t.into(), hosts: vec![], allow_any_host: true };
        for v in ["u", "v", "w"] {
            commit(&mut c, |c| c.create_volume(&CreateVolume { name: v.into(), size: 4 * MIB, extent_size: Some(MIB) }, 0))
                .expect("create");
            commit(&mut c, |c| c.allocate(v, 0, 0)).expect("extent 0");
        }
        for v in ["v", "w"] {
            commit(&mut c, |c| c.export(v, &to("t1"), 0)).expect("on t1");
        }
        commit(&mut c, |c| c.unexport("w", 100, 2000)).expect("w unexported by process 1");
        let wh = c.volumes["w"].handover.clone().expect("w's handover");
        assert_eq!((wh.incarnation, wh.after_fence), (1, false));
        commit(&mut c, |c| c.register(&reg(1), 500, 2000)).expect("the same process again");
        assert_eq!(c.targets["t1"].unfenced, None, "registered again by the same process: no restart");

        // Process 2 at 1000, with a 2 s lease: until 1000 + 2000 + 5000 and the margin.
        let (w, _) = c.register(&reg(2), 1000, 2000).expect("t1, process 2");
        assert_eq!(w.len(), 2, "the target and its pool, whatever it exports: {w:?}");
        commit(&mut c, |c| c.register(&reg(2), 1000, 2000)).expect("t1, process 2");
        let until_ms = 8000 + EXPORT_HANDOVER_MARGIN_MS;
        assert_eq!(c.targets["t1"].unfenced, Some(Unfenced { until_ms, time_only: false }));
        let refused = |r: Result<(), ApiError>, what: &str| assert_eq!(r.map_err(|e| e.code), Err(ErrorCode::ExportHandover), "{what}");
        let e = c.begin_move("v", 0, &MoveRequest::default(), 1000).err().expect("refused");
        assert!(e.message.contains("restarted") && e.message.contains("in 12 s"), "{}", e.message);
        assert_eq!(
            c.volume_info("v", 1000).expect("info").in_doubt,
            Some(InDoubt { target: "t1".into(), seconds_left: 12, restarted: true })
        );
        c.begin_move("u", 0, &MoveRequest::default(), 1000).expect("u: never exported by t1");
        refused(c.export("w", &to("t2"), 1000).map(drop), "w exported elsewhere");
        // Process 2 cannot release process 1's handover; exported again on t1, it stays.
        commit(&mut c, |c| c.released("w", "t1", wh.epoch, 2, 1000)).expect("process 2 says");
        commit(&mut c, |c| c.released("w", "t1", wh.epoch, 1, 1000)).expect("process 1 says, late");
        assert_eq!(c.volumes["w"].handover, Some(wh.clone()), "neither ends it");
        commit(&mut c, |c| c.export("w", &to("t1"), 1000)).expect("w on t1 again");
        assert_eq!(c.volumes["w"].handover, Some(wh.clone()));
        // v unexported by process 2: its own handover, which also waits for the fence.
        commit(&mut c, |c| c.unexport("v", 1000, 2000)).expect("v unexported by process 2");
        let vh = c.volumes["v"].handover.clone().expect("v's handover");
        assert_eq!((vh.incarnation, vh.after_fence), (2, true));
        refused(c.export("v", &to("t2"), 1000).map(drop), "v exported elsewhere");
        refused(c.delete_volume("v", 1000).map(drop), "v deleted");
        commit(&mut c, |c| c.released("v", "t1", vh.epoch, 2, 1000)).expect("process 2 released v");
        assert!(c.volumes["v"].handover.as_ref().is_some_and(|h| h.released), "its part over, the fence's not");
        refused(c.export("v", &to("t2"), 1000).map(drop), "still");

        // Words that change nothing: from process 1, from another target, about an unknown one.
        for (t, i) in [("t1", 1), ("t2", 2), ("t9", 2), ("t1", 0)] {
            commit(&mut c, |c| c.fenced(t, i)).expect("a word");
        }
        assert!(c.targets["t1"].unfenced.is_some());
        // Process 2 fenced: v and w go on (w's handover was process 1's).
        let (w, _) = c.fenced("t1", 2).expect("fenced");
        assert_eq!(w.len(), 1, "one record: {w:?}");
        commit(&mut c, |c| c.fenced("t1", 2)).expect("fenced");
        assert_eq!(c.targets["t1"].unfenced, None);
        for v in ["v", "w"] {
            assert_eq!(c.volume_info(v, 1000).expect("info").in_doubt, None, "{v}");
        }
        commit(&mut c, |c| c.export("v", &to("t2"), 1000)).expect("v on t2");
        let m = commit(&mut c, |c| c.begin_move("w", 0, &MoveRequest::default(), 1000)).expect("w moves");
        // Its copier (t1) acknowledged: it may write to the destination from now on.
        let ack = MoveReport { id: m.id, epoch: m.epoch, copied: 0, reason: String::new() };
        commit(&mut c, |c| c.report_move("w", 0, &ack, true, 1000)).expect("ack");

        // Without a word: process 3 at 10 s, then 4 at 20 s with no lease. The later bound
        // holds; once it passed, the volumes go on.
        commit(&mut c, |c| c.register(&reg(3), 10_000, 2000)).expect("process 3");
        let first = c.targets["t1"].unfenced.as_ref().expect("unfenced").until_ms;
        assert_eq!(first, 17_000 + EXPORT_HANDOVER_MARGIN_MS);
        commit(&mut c, |c| c.register(&reg(4), 20_000, 0)).expect("process 4");
        let until = c.targets["t1"].unfenced.as_ref().expect("unfenced").until_ms;
        assert_eq!(until, first.max(25_000 + EXPORT_HANDOVER_MARGIN_MS));
        // Process 3's word: no longer the registered one.
        commit(&mut c, |c| c.fenced("t1", 3)).expect("stale");
        assert!(c.targets["t1"].unfenced.is_some());
        // w is exported by t1 (the move above aborted by the restart: its copier restarted).
        assert_eq!(c.moves.get(&("w".to_string(), 0)).map(|m| m.state), Some(MoveState::Aborted));
        let (name, index) = ("w".to_string(), 0);
        let m = c.moves[&(name.clone(), index)].clone();
        commit(&mut c, |c| c.abort_move("w", 0, &MoveReport { id: m.id, epoch: m.epoch, copied: 0, reason: "confirmed".into() }))
            .expect("confirmed");
        refused(c.begin_move("w", 0, &MoveRequest::default(), until - 1).map(drop), "one ms before");
        commit(&mut c, |c| c.begin_move("w", 0, &MoveRequest::default(), until)).expect("at the bound");

        // An earlier process that predates incarnations is not fenced by its successor's
        // word: only its bound ends the wait.
        let mut c = cluster(&[("t1", "p", 16 * MIB)]);
        commit(&mut c, |c| c.register(&reg(0), 0, 2000)).expect("an old process");
        commit(&mut c, |c| c.register(&reg(5), 100, 2000)).expect("a new one");
        commit(&mut c, |c| c.fenced("t1", 5)).expect("fenced");
        assert!(c.targets["t1"].unfenced.as_ref().is_some_and(|u| u.time_only), "the fence cannot reach it");

        // A move its restarted copier had not acknowledged never opened its destination:
        // it goes at the registration, the destination free at once.
        let mut c = cluster(&[("t2", "p", 16 * MIB)]);
        commit(&mut c, |c| c.register(&reg(7), 0, 2000)).expect("process 7");
        commit(&mut c, |c| c.create_volume(&CreateVolume { name: "x".into(), size: 4 * MIB, extent_size: Some(MIB) }, 0)).expect("x");
        commit(&mut c, |c| c.allocate("x", 0, 0)).expect("extent 0");
        commit(&mut c, |c| c.export("x", &to("t1"), 0)).expect("on t1");
        let m = commit(&mut c, |c| c.begin_move("x", 0, &MoveRequest::default(), 0)).expect("x moves");
        assert_eq!((m.state, m.copier.as_str()), (MoveState::Invalidating, "t1"));
        commit(&mut c, |c| c.register(&reg(8), 100, 2000)).expect("process 8");
        assert!(c.moves.is_empty(), "{:?}", c.moves);
    }

    #[test]
    fn a_full_pool_says_no_space_and_delete_frees_it() {
        let mut c = cluster(&[("t1", "p", 2 * MIB)]);
        commit(&mut c, |c| c.create_volume(&CreateVolume { name: "v".into(), size: 4 * MIB, extent_size: Some(MIB) }, 0)).expect("v");
        let a = commit(&mut c, |c| c.allocate("v", 2, 0)).expect("2");
        let b = commit(&mut c, |c| c.allocate("v", 0, 0)).expect("0");
        assert_eq!((a.offset, b.offset), (0, MIB));
        // Asked again: the same place, nothing written.
        let (w, again) = c.allocate("v", 2, 0).expect("again");
        assert!(w.is_empty());
        assert_eq!(again, a);
        assert_eq!(commit(&mut c, |c| c.allocate("v", 1, 0)).err(), Some(ErrorCode::NoSpace));
        // The translation service says what is allocated, with the pool's namespace.
        let t = c.translate("v", 2).expect("translate 2");
        assert_eq!((t.index, t.extent.as_ref().map(|e| (e.offset, e.nsid))), (2, Some((0, 1))));
        assert_eq!(c.translate("v", 1).expect("translate 1").extent, None);
        commit(&mut c, |c| c.delete_volume("v", 0)).expect("delete");
        assert!(c.extents.is_empty());
        assert_eq!(c.allocated(&PoolId { target: "t1".into(), name: "p".into() }), 0);
    }

    #[test]
    fn registration_rules() {
        let mut c = cluster(&[("t1", "p", 4 * MIB)]);
        commit(&mut c, |c| c.create_volume(&CreateVolume { name: "v".into(), size: 4 * MIB, extent_size: Some(MIB) }, 0)).expect("v");
        for i in 0..3 {
            commit(&mut c, |c| c.allocate("v", i, 0)).expect("alloc");
        }
        let reg = |path: &str, size: u64| RegisterTarget {
            addr: "t1".into(),
            nqn: "n".into(),
            pools: vec![PoolSpec { name: "p".into(), path: path.into(), size, nsid: 1, bandwidth: 0, write_cost: 0.0 }],
            write_bound_ms: 0,
            incarnation: 0,
        };
        #[rustfmt::skip]
        let cases: &[(RegisterTarget, Option<ErrorCode>)] = &[
            (reg("/p/p", 8 * MIB), None),
            (reg("/p/p", 3 * MIB), None),
            (reg("/p/p", 2 * MIB), Some(ErrorCode::PoolConflict)),
            (reg("/elsewhere", 4 * MIB), Some(ErrorCode::PoolConflict)),
            (reg("/p/p", MIB - 1), Some(ErrorCode::InvalidArgument)),
            (RegisterTarget { addr: "t1".into(), nqn: "n".into(), pools: vec![PoolSpec { name: "q".into(), path: "/a".into(), size: MIB, nsid: 1, bandwidth: 0, write_cost: 0.0 }, PoolSpec { name: "q".into(), path: "/b".into(), size: MIB, nsid: 1, bandwidth: 0, write_cost: 0.0 }], write_bound_ms: 0, incarnation: 0 }, Some(ErrorCode::InvalidArgument)),
            (RegisterTarget { addr: "t2".into(), nqn: "n".into(), pools: (0..=POOLS_PER_TARGET_MAX).map(|i| PoolSpec { name: format!("p{i}"), path: "/a".into(), size: MIB, nsid: 1, bandwidth: 0, write_cost: 0.0 }).collect(), write_bound_ms: 0, incarnation: 0 }, Some(ErrorCode::LimitExceeded)),
            (RegisterTarget { addr: "".into(), nqn: "n".into(), pools: vec![], write_bound_ms: 0, incarnation: 0 }, Some(ErrorCode::InvalidArgument)),
            (RegisterTarget { addr: "t2".into(), nqn: "".into(), pools: vec![], write_bound_ms: 0, incarnation: 0 }, Some(ErrorCode::InvalidArgument)),
        ];
        for (req, expected) in cases {
            assert_eq!(c.register(req, 1, 0).err().map(|e| e.code), *expected, "{req:?}");
        }
    }

    #[test]
    fn views_take_only_newer_seqs_and_count_versions() {
        let mut c = cluster(&[("t1", "a", 4 * MIB), ("t2", "b", 4 * MIB)]);
        let a = PoolId { target: "t1".into(), name: "a".into() };
        let b = PoolId { target: "t2".into(), name: "b".into() };
        let push = |seq| ViewPush { seq, figures: Figures::default() };
        assert_eq!(commit(&mut c, |c| c.push_view(&a, &push(1), 0)).map(|v| v.version), Ok(1));
        assert_eq!(commit(&mut c, |c| c.push_view(&b, &push(7), 0)).map(|v| v.version), Ok(2));
        assert_eq!(commit(&mut c, |c| c.push_view(&a, &push(1), 0)).err(), Some(ErrorCode::StaleView));
        assert_eq!(commit(&mut c, |c| c.push_view(&a, &push(2), 0)).map(|v| v.version), Ok(3));
        let nope = PoolId { target: "t3".into(), name: "a".into() };
        assert_eq!(commit(&mut c, |c| c.push_view(&nope, &push(1), 0)).err(), Some(ErrorCode::PoolNotFound));
        // Pulled by version: only what changed after 2.
        let v = c.view(2, 0);
        assert_eq!((v.version, v.pools.len(), v.pools[0].pool.as_str()), (3, 1, "a"));
        // Stale after VIEW_STALE_MS.
        assert!(!c.view(0, VIEW_STALE_MS).pools[0].stale);
        assert!(c.view(0, VIEW_STALE_MS + 1).pools[0].stale);
        // A re-registration hands back the last seq.
        let (_, r) = c
            .register(
                &RegisterTarget {
                    addr: "t1".into(),
                    nqn: "n".into(),
                    pools: vec![PoolSpec { name: "a".into(), path: "/p/a".into(), size: 4 * MIB, nsid: 1, bandwidth: 0, write_cost: 0.0 }],
                    write_bound_ms: 0,
                    incarnation: 0,
                },
                0,
                0,
            )
            .expect("again");
        assert_eq!(r.pools[0].seq, 2);
    }

    /// Allocation at a time when some pools' targets went silent: pools registered at 0, each
    /// row's views pushed at the given times (ms), one allocation at `now`; the pool chosen or
    /// the error's words.
    /// An extent is allocated unwritten, and written once its data path says it zeroed it.
    #[test]
    fn extents_are_allocated_unwritten_until_marked_written() {
        let mut c = cluster(&[("t1", "a", 4 * MIB)]);
        commit(&mut c, |c| c.create_volume(&CreateVolume { name: "v".into(), size: 2 * MIB, extent_size: Some(MIB) }, 0)).expect("v");
        assert!(commit(&mut c, |c| c.allocate("v", 0, 0)).expect("allocate").unwritten);
        assert!(c.translate("v", 0).expect("translate").extent.expect("allocated").unwritten);
        // (index, expected: unwritten after, writes planned, or the error's code)
        #[rustfmt::skip]
        let cases: &[(u64, Result<(bool, usize), ErrorCode>)] = &[
            (0, Ok((false, 1))),
            (0, Ok((false, 0))),
            (1, Err(ErrorCode::InvalidArgument)),
            (2, Err(ErrorCode::ExtentOutOfRange)),
        ];
        for (i, (index, want)) in cases.iter().enumerate() {
            let got = c.mark_written("v", *index).map(|(w, e)| (e.unwritten, w.len())).map_err(|e| e.code);
            assert_eq!(got, *want, "case {i}");
            if let Ok((w, _)) = c.mark_written("v", *index) {
                w.iter().for_each(|w| c.apply(w));
            }
        }
        assert!(!c.translate("v", 0).expect("translate").extent.expect("allocated").unwritten);
        assert_eq!(c.mark_written("w", 0).map_err(|e| e.code).err(), Some(ErrorCode::VolumeNotFound));
    }

    #[test]
    fn allocation_skips_stale_pools() {
        let s = VIEW_STALE_MS;
        // Views (pool, ms), now, the pool chosen or the error's words.
        type Case<'a> = (&'a [(&'a str, u64)], u64, Result<&'a str, &'a str>);
        #[rustfmt::skip]
        let cases: &[Case] = &[
            // Registered just now: both fresh, the smaller id first.
            (&[], s, Ok("a@t1")),
            // a@t1 silent since its registration, b@t2 pushed lately.
            (&[("b", s)], s + 1, Ok("b@t2")),
            (&[("a", s), ("b", 1)], s + 2, Ok("a@t1")),
            // Both silent: neither, and the error names them.
            (&[], s + 1, Err("only stale pools have room (no view for 30 s): a@t1, b@t2")),
            // At the limit still fresh, one past it stale.
            (&[("a", 5), ("b", 9)], s + 9, Ok("b@t2")),
            (&[("a", 5), ("b", 9)], s + 10, Err("only stale pools have room (no view for 30 s): a@t1, b@t2")),
            // A view from a clock ahead of ours (another leader's) is fresh.
            (&[("a", 10 * s), ("b", 10 * s)], s + 1, Ok("a@t1")),
        ];
        for (views, now, expected) in cases {
            let mut c = cluster(&[("t1", "a", 2 * MIB), ("t2", "b", 2 * MIB)]);
            commit(&mut c, |c| c.create_volume(&CreateVolume { name: "v".into(), size: 4 * MIB, extent_size: Some(MIB) }, 0)).expect("v");
            for (i, &(pool, at)) in views.iter().enumerate() {
                let id = c.pools.keys().find(|p| p.name == pool).expect("pool").clone();
                commit(&mut c, |c| c.push_view(&id, &ViewPush { seq: i as u64 + 1, figures: Figures::default() }, at)).expect("view");
            }
            let got = c.allocate("v", 0, *now).map(|(_, e)| format!("{}@{}", e.pool, e.target)).map_err(|e| e.message);
            match (got, expected) {
                (Ok(p), Ok(want)) => assert_eq!(p, *want, "{views:?} at {now}"),
                (Err(e), Err(want)) => {
                    assert!(e.contains(want), "{views:?} at {now}: {e}");
                }
                (got, _) => panic!("{views:?} at {now}: {got:?}, expected {expected:?}"),
            }
        }
        // Without any pool with room, the error is the plain one, stale or not.
        let mut c = cluster(&[("t1", "a", MIB)]);
        commit(&mut c, |c| c.create_volume(&CreateVolume { name: "v".into(), size: 4 * MIB, extent_size: Some(MIB) }, 0)).expect("v");
        commit(&mut c, |c| c.allocate("v", 0, 0)).expect("0");
        let e = c.allocate("v", 1, s + 1).expect_err("full");
        assert_eq!(e.code, ErrorCode::NoSpace);
        assert!(!e.message.contains("stale"), "{}", e.message);
    }

    /// Moves asked of a cluster with pools p@t1 and p@t2 (4 MiB) and q@t3 (1 MiB, full),
    /// volume 'v' (4 extents of 1 MiB, 0 and 1 allocated on p@t1, 2 on q@t3) and 'w' (not
    /// allocated): the error code expected, or none.
    #[test]
    fn move_requests() {
        #[rustfmt::skip]
        let cases: &[(&str, u64, Option<&str>, Option<ErrorCode>)] = &[
            ("v", 0, Some("p@t2"), None),
            ("v", 0, None, None),
            ("v", 2, None, None),
            ("nope", 0, None, Some(ErrorCode::VolumeNotFound)),
            ("v", 4, None, Some(ErrorCode::ExtentOutOfRange)),
            ("v", 3, None, Some(ErrorCode::ExtentNotAllocated)),
            ("w", 0, None, Some(ErrorCode::ExtentNotAllocated)),
            ("v", 0, Some("zz@t1"), Some(ErrorCode::PoolNotFound)),
            ("v", 0, Some("p@t9"), Some(ErrorCode::PoolNotFound)),
            ("v", 0, Some("p@t1"), Some(ErrorCode::InvalidArgument)),
            ("v", 0, Some("p"), Some(ErrorCode::InvalidArgument)),
            ("v", 0, Some("q@t3"), Some(ErrorCode::NoSpace)),
            // Extent 1 is being moved.
            ("v", 1, None, Some(ErrorCode::MoveInProgress)),
        ];
        for &(name, index, to, expected) in cases {
            let mut c = cluster(&[("t1", "p", 4 * MIB), ("t2", "p", 4 * MIB), ("t3", "q", MIB)]);
            for v in ["v", "w"] {
                commit(&mut c, |c| c.create_volume(&CreateVolume { name: v.into(), size: 4 * MIB, extent_size: Some(MIB) }, 0)).expect("v");
            }
            let on = |c: &mut Cluster, index, pool: &str| {
                let (n, t) = pool.split_once('@').expect("pool");
                let e = Extent {
                    volume: "v".into(),
                    index,
                    pool: PoolId { target: t.into(), name: n.into() },
                    offset: index * MIB,
                    epoch: 1,
                    unwritten: false,
                };
                c.apply(&Write::Put(Record::Extent(e)));
            };
            on(&mut c, 0, "p@t1");
            on(&mut c, 1, "p@t1");
            let e2 = Extent {
                volume: "v".into(),
                index: 2,
                pool: PoolId { target: "t3".into(), name: "q".into() },
                offset: 0,
                epoch: 1,
                unwritten: false,
            };
            c.apply(&Write::Put(Record::Extent(e2)));
            commit(&mut c, |c| c.begin_move("v", 1, &MoveRequest::default(), 0)).expect("move 1");
            let req = MoveRequest { to: to.map(str::to_string), max_bps: 0 };
            let got = commit(&mut c, |c| c.begin_move(name, index, &req, 0));
            assert_eq!(got.as_ref().err().copied(), expected, "{name} {index} {to:?}: {got:?}");
            if let Ok(m) = got {
                // Never onto its own pool; the placement spreads (p@t2 before q@t3, full).
                assert_ne!(m.to, m.from);
                assert!(c.hole(&c.pools[&m.to], MIB).is_some() || m.to.target != "t3", "{m:?}");
            }
        }
    }

    /// A move's life: acknowledged, reported, published (the extent at its destination with
    /// the next epoch, its old place free), aborted by its copier or by silence, released by
    /// the copier's new registration; what a move in progress refuses.
    #[test]
    fn a_move_is_published_once_or_not_at_all() {
        let mut c = cluster(&[("t1", "p", 2 * MIB), ("t2", "p", 2 * MIB)]);
        commit(&mut c, |c| c.create_volume(&CreateVolume { name: "v".into(), size: 4 * MIB, extent_size: Some(MIB) }, 0)).expect("v");
        let p1 = PoolId { target: "t1".into(), name: "p".into() };
        let p2 = PoolId { target: "t2".into(), name: "p".into() };
        let e = commit(&mut c, |c| c.allocate("v", 0, 0)).expect("0");
        assert_eq!(e.target, "t1");
        let m = commit(&mut c, |c| c.begin_move("v", 0, &MoveRequest::default(), 100)).expect("move");
        assert_eq!(
            (m.to.clone(), m.copier.as_str(), m.state, m.deadline_ms),
            (p2.clone(), "t2", MoveState::Invalidating, 100 + MOVE_SILENCE_MS)
        );
        // The destination is reserved while the extent still lies at its source.
        assert_eq!((c.allocated(&p1), c.allocated(&p2)), (MIB, MIB));
        assert_eq!(c.translate("v", 0).expect("t").extent.map(|e| (e.target, e.epoch)), Some(("t1".into(), 1)));
        let r = |id, epoch| MoveReport { id, epoch, copied: 0, reason: String::new() };
        assert_eq!(m.id, 1);
        #[rustfmt::skip]
        let refusals: Vec<(Planned<()>, ErrorCode)> = vec![
            (c.publish_move("v", 0, &r(1, 1)).map(|(w, _)| (w, ())), ErrorCode::MoveNotFound),
            (c.report_move("v", 0, &r(1, 1), false, 0).map(|(w, _)| (w, ())), ErrorCode::MoveNotFound),
            (c.report_move("v", 0, &r(1, 2), true, 0).map(|(w, _)| (w, ())), ErrorCode::MoveNotFound),
            (c.report_move("v", 0, &r(2, 1), true, 0).map(|(w, _)| (w, ())), ErrorCode::MoveNotFound),
            (c.abort_move("v", 1, &r(1, 1)), ErrorCode::MoveNotFound),
            (c.delete_volume("v", 0), ErrorCode::MoveInProgress),
            (c.export("v", &ExportVolume { target: "t1".into(), hosts: vec![], allow_any_host: true }, 0).map(|(w, _)| (w, ())), ErrorCode::MoveInProgress),
            (c.begin_move("v", 0, &MoveRequest::default(), 0).map(|(w, _)| (w, ())), ErrorCode::MoveInProgress),
        ];
        for (i, (got, code)) in refusals.into_iter().enumerate() {
            assert_eq!(got.err().map(|e| e.code), Some(code), "refusal {i}");
        }
        let m = commit(&mut c, |c| c.report_move("v", 0, &MoveReport { id: 1, epoch: 1, copied: 5, reason: String::new() }, true, 200))
            .expect("ack");
        assert_eq!((m.state, m.copied, m.deadline_ms), (MoveState::Copying, 5, 200 + MOVE_SILENCE_MS));
        // Not yet silent; then silent: aborted, the destination still reserved.
        assert_eq!(commit(&mut c, |c| c.expire_moves(200 + MOVE_SILENCE_MS)), Ok(0));
        assert_eq!(commit(&mut c, |c| c.expire_moves(201 + MOVE_SILENCE_MS)), Ok(1));
        assert_eq!(c.moves[&("v".to_string(), 0)].state, MoveState::Aborted);
        assert_eq!(c.allocated(&p2), MIB);
        assert_eq!(c.publish_move("v", 0, &r(1, 1)).err().map(|e| e.code), Some(ErrorCode::MoveNotFound));
        // The copier registers again (it restarted): the move goes, its destination is free.
        let reg = RegisterTarget {
            addr: "t2".into(),
            nqn: "n".into(),
            pools: vec![PoolSpec { name: "p".into(), path: "/p/p".into(), size: 2 * MIB, nsid: 1, bandwidth: 0, write_cost: 0.0 }],
            write_bound_ms: 0,
            incarnation: 0,
        };
        commit(&mut c, |c| c.register(&reg, 300, 0)).expect("register");
        assert!(c.moves.is_empty());
        assert_eq!(c.allocated(&p2), 0);
        // Again, aborted by the copier: the same.
        commit(&mut c, |c| c.begin_move("v", 0, &MoveRequest::default(), 400)).expect("move");
        commit(&mut c, |c| c.abort_move("v", 0, &r(2, 1))).expect("abort");
        assert_eq!((c.moves.len(), c.allocated(&p2)), (0, 0));
        // Again, published: at its destination, epoch 2, the source free; in either order of
        // the two writes, and as the store loads them.
        commit(&mut c, |c| c.begin_move("v", 0, &MoveRequest { to: Some("p@t2".into()), max_bps: 0 }, 500)).expect("move");
        commit(&mut c, |c| c.report_move("v", 0, &r(3, 1), true, 500)).expect("ack");
        let (writes, info) = c.publish_move("v", 0, &r(3, 1)).expect("publish");
        assert_eq!((info.target.as_str(), info.epoch), ("t2", 2));
        for order in [writes.clone(), writes.iter().rev().cloned().collect()] {
            let mut d = c.clone();
            order.iter().for_each(|w| d.apply(w));
            assert_eq!((d.allocated(&p1), d.allocated(&p2), d.moves.len()), (0, MIB, 0));
            assert_eq!(d.translate("v", 0).expect("t").extent.map(|e| (e.target, e.epoch)), Some(("t2".into(), 2)));
        }
        writes.iter().for_each(|w| c.apply(w));
        let records: Vec<Record> = c
            .extents
            .values()
            .map(|e| Record::Extent(e.clone()))
            .chain(c.pools.values().map(|p| Record::Pool(p.clone())))
            .chain(c.volumes.values().map(|v| Record::Volume(v.clone())))
            .chain(c.targets.values().map(|t| Record::Target(t.clone())))
            .collect();
        let mut sorted = records;
        sorted.sort_by_key(|r| Table::ALL.iter().position(|t| *t == r.table()));
        let loaded = Cluster::from_records(sorted);
        assert_eq!((loaded.allocated(&p1), loaded.allocated(&p2)), (0, MIB));
        // A move's reservation survives a restart too.
        commit(&mut c, |c| c.begin_move("v", 0, &MoveRequest::default(), 600)).expect("move back");
        let again = Cluster::from_records(
            [Table::Targets, Table::Pools, Table::Volumes, Table::Extents, Table::Moves]
                .iter()
                .flat_map(|t| match t {
                    Table::Targets => c.targets.values().map(|x| Record::Target(x.clone())).collect::<Vec<_>>(),
                    Table::Pools => c.pools.values().map(|x| Record::Pool(x.clone())).collect(),
                    Table::Volumes => c.volumes.values().map(|x| Record::Volume(x.clone())).collect(),
                    Table::Extents => c.extents.values().map(|x| Record::Extent(x.clone())).collect(),
                    _ => c.moves.values().map(|x| Record::Move(x.clone())).collect(),
                })
                .collect::<Vec<_>>(),
        );
        assert_eq!((again.allocated(&p1), again.allocated(&p2), again.moves.len()), (MIB, MIB, 1));
    }

    /// Every move has its own id, from a counter kept in the store (so after a restart too),
    /// and a copier's word must name the move under way: the late words of an ended move
    /// (aborted, then the extent moved again at the same epoch) are refused and change
    /// nothing. (Named by volume, index and epoch, a late ack of the first move made the
    /// second copy before its copier drained, and a late publish published it uncopied.)
    #[test]
    fn late_words_of_an_ended_move_are_refused() {
        let mut c = cluster(&[("t1", "p", 2 * MIB), ("t2", "p", 2 * MIB), ("t3", "p", 2 * MIB)]);
        commit(&mut c, |c| c.create_volume(&CreateVolume { name: "v".into(), size: 4 * MIB, extent_size: Some(MIB) }, 0)).expect("v");
        commit(&mut c, |c| c.allocate("v", 0, 0)).expect("0");
        let first = commit(&mut c, |c| c.begin_move("v", 0, &MoveRequest { to: Some("p@t2".into()), max_bps: 0 }, 0)).expect("move");
        let r = |m: &Move, copied| MoveReport { id: m.id, epoch: m.epoch, copied, reason: "late".into() };
        commit(&mut c, |c| c.report_move("v", 0, &r(&first, 0), true, 0)).expect("ack");
        commit(&mut c, |c| c.abort_move("v", 0, &r(&first, 0))).expect("abort");
        let second = commit(&mut c, |c| c.begin_move("v", 0, &MoveRequest { to: Some("p@t3".into()), max_bps: 0 }, 0)).expect("again");
        assert_eq!((first.id, second.id, first.epoch), (1, 2, second.epoch));
        // (the late word of the first move)
        let late: &[&str] = &["ack", "progress", "publish", "abort"];
        for word in late {
            let before = c.clone();
            let got = match *word {
                "ack" | "progress" => c.report_move("v", 0, &r(&first, MIB), *word == "ack", 0).map(drop),
                "publish" => c.publish_move("v", 0, &r(&first, MIB)).map(drop),
                _ => c.abort_move("v", 0, &r(&first, MIB)).map(drop),
            };
            let e = got.expect_err(word);
            assert_eq!(e.code, ErrorCode::MoveNotFound, "{word}: {e:?}");
            assert!(e.message.contains("no move 1 of extent 0"), "{word}: {}", e.message);
            assert_eq!(c, before, "{word}");
        }
        assert_eq!(c.moves[&("v".to_string(), 0)].state, MoveState::Invalidating, "the second move was acknowledged by the first's word");
        // The second move's own words are taken.
        commit(&mut c, |c| c.report_move("v", 0, &r(&second, 0), true, 0)).expect("ack");
        let info = commit(&mut c, |c| c.publish_move("v", 0, &r(&second, MIB))).expect("publish");
        assert_eq!((info.target.as_str(), info.epoch), ("t3", 2));
        // The counter is a record: loaded again, the next move takes the next id.
        let records: Vec<Record> = c
            .targets
            .values()
            .map(|t| Record::Target(t.clone()))
            .chain(c.pools.values().map(|p| Record::Pool(p.clone())))
            .chain(c.volumes.values().map(|v| Record::Volume(v.clone())))
            .chain(c.extents.values().map(|e| Record::Extent(e.clone())))
            .chain(c.counters.iter().map(|(name, &value)| Record::Counter(Counter { name: name.clone(), value })))
            .collect();
        let mut loaded = Cluster::from_records(records);
        let third = commit(&mut loaded, |c| c.begin_move("v", 0, &MoveRequest::default(), 0)).expect("a third move");
        assert_eq!(third.id, 3);
    }

    /// A cordoned pool takes no allocation and no move, explicit or placed; it keeps its
    /// extents, shows as cordoned, stays so when its target registers again, and takes
    /// extents again once uncordoned.
    #[test]
    fn a_cordoned_pool_takes_no_new_extents() {
        let mut c = cluster(&[("t1", "p", 4 * MIB), ("t2", "p", 4 * MIB)]);
        commit(&mut c, |c| c.create_volume(&CreateVolume { name: "v".into(), size: 8 * MIB, extent_size: Some(MIB) }, 0)).expect("v");
        let p1 = PoolId { target: "t1".into(), name: "p".into() };
        assert_eq!(commit(&mut c, |c| c.allocate("v", 0, 0)).expect("0").target, "t1");
        commit(&mut c, |c| c.cordon(&p1, true)).expect("cordon");
        assert_eq!(c.cordon(&p1, true).map(|(w, _)| w.len()), Ok(0), "cordoned twice writes nothing");
        // (what, the pool it lands on, or the error)
        for i in 1..4 {
            assert_eq!(commit(&mut c, |c| c.allocate("v", i, 0)).expect("alloc").target, "t2", "extent {i}");
        }
        let to_p1 = MoveRequest { to: Some("p@t1".into()), max_bps: 0 };
        assert_eq!(commit(&mut c, |c| c.begin_move("v", 1, &to_p1, 0)).err(), Some(ErrorCode::PoolCordoned));
        assert_eq!(commit(&mut c, |c| c.begin_move("v", 0, &MoveRequest::default(), 0)).expect("off p1").to.target, "t2");
        assert!(c.view(0, 0).pools.iter().any(|p| p.target == "t1" && p.cordoned));
        let reg = RegisterTarget {
            addr: "t1".into(),
            nqn: "n".into(),
            pools: vec![PoolSpec { name: "p".into(), path: "/p/p".into(), size: 4 * MIB, nsid: 1, bandwidth: 0, write_cost: 0.0 }],
            write_bound_ms: 0,
            incarnation: 0,
        };
        commit(&mut c, |c| c.register(&reg, 0, 0)).expect("register");
        assert!(c.pools[&p1].cordoned, "a registration ended the cordon");
        // t2 full (three extents and the move's reservation): nowhere else.
        assert_eq!(commit(&mut c, |c| c.allocate("v", 4, 0)).err(), Some(ErrorCode::NoSpace));
        commit(&mut c, |c| c.cordon(&p1, false)).expect("uncordon");
        assert_eq!(commit(&mut c, |c| c.allocate("v", 4, 0)).expect("alloc").target, "t1");
        let ghost = PoolId { target: "t9".into(), name: "p".into() };
        assert_eq!(c.cordon(&ghost, true).err().map(|e| e.code), Some(ErrorCode::PoolNotFound));
    }

    #[test]
    fn holes_are_found_between_extents_of_other_sizes() {
        let mut c = cluster(&[("t1", "p", 8 * MIB)]);
        commit(&mut c, |c| c.create_volume(&CreateVolume { name: "small".into(), size: 4 * MIB, extent_size: Some(MIB) }, 0))
            .expect("small");
        commit(&mut c, |c| c.create_volume(&CreateVolume { name: "big".into(), size: 4 * MIB, extent_size: Some(2 * MIB) }, 0))
            .expect("big");
        let offsets: Vec<u64> = [("small", 0), ("big", 0), ("small", 1), ("big", 1)]
            .iter()
            .map(|(v, i)| commit(&mut c, |c| c.allocate(v, *i, 0)).expect("alloc").offset)
            .collect();
        // 1 MiB at 0, 2 MiB aligned at 2 MiB, 1 MiB in the hole at 1 MiB, 2 MiB at 4 MiB.
        assert_eq!(offsets, vec![0, 2 * MIB, MIB, 4 * MIB]);
    }

    /// Tenant requests, each line one request against the tenants made so far and the
    /// error code wanted (None: made); then a delete frees its hosts for another tenant.
    #[test]
    fn tenant_requests() {
        let mut c = Cluster::default();
        let t = |name: &str, hosts: &[&str]| Tenant {
            name: name.into(),
            hosts: hosts.iter().map(|h| format!("nqn.2014-08.org.example:{h}")).collect(),
            io_weight: 100,
            compute_weight: 100,
            offload_memory: None,
            reach: vec!["nqn.2026-11.io.nearstore:a".into(), "volume:v".into()],
        };
        let many: Vec<String> = (0..=TENANT_HOSTS_MAX).map(|i| format!("h{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        #[rustfmt::skip]
        let cases: Vec<(Tenant, Option<ErrorCode>)> = vec![
            (t("a", &["h1", "h2"]), None),
            (t("a", &["h3"]), Some(ErrorCode::TenantExists)),
            (t("b", &["h3", "h2"]), Some(ErrorCode::HostInTenant)),
            (t("b", &["h3", "h3"]), Some(ErrorCode::InvalidArgument)),
            (Tenant { io_weight: 0, ..t("b", &["h3"]) }, Some(ErrorCode::InvalidArgument)),
            (Tenant { compute_weight: TENANT_WEIGHT_MAX + 1, ..t("b", &["h3"]) }, Some(ErrorCode::InvalidArgument)),
            (Tenant { offload_memory: Some(0), ..t("b", &["h3"]) }, Some(ErrorCode::InvalidArgument)),
            (Tenant { hosts: vec!["h3".into()], ..t("b", &[]) }, Some(ErrorCode::InvalidArgument)),
            (t("b", &[]), Some(ErrorCode::LimitExceeded)),
            (t("b", &many), Some(ErrorCode::LimitExceeded)),
            (Tenant { reach: vec!["disk0".into()], ..t("b", &["h3"]) }, Some(ErrorCode::InvalidArgument)),
            (Tenant { reach: vec![POOLS_NQN.into()], ..t("b", &["h3"]) }, Some(ErrorCode::InvalidArgument)),
            (Tenant { reach: vec!["volume:a/b".into()], ..t("b", &["h3"]) }, Some(ErrorCode::InvalidArgument)),
            (Tenant { reach: vec!["volume:v".into(); TENANT_REACH_MAX + 1], ..t("b", &["h3"]) }, Some(ErrorCode::LimitExceeded)),
            (t("default", &["h3"]), Some(ErrorCode::InvalidArgument)),
            (t("cluster", &["h3"]), Some(ErrorCode::InvalidArgument)),
            (t("a b", &["h3"]), Some(ErrorCode::InvalidArgument)),
            (t(&"n".repeat(TENANT_NAME_BYTES_MAX + 1), &["h3"]), Some(ErrorCode::InvalidArgument)),
            (Tenant { io_weight: TENANT_WEIGHT_MAX, compute_weight: 1, reach: vec![], ..t("b", &["h3"]) }, None),
        ];
        for (i, (req, want)) in cases.iter().enumerate() {
            assert_eq!(commit(&mut c, |c| c.create_tenant(req)).err(), *want, "case {i}: {req:?}");
        }
        assert_eq!(c.tenants.keys().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(commit(&mut c, |c| c.delete_tenant("nope")), Err(ErrorCode::TenantNotFound));
        commit(&mut c, |c| c.delete_tenant("a")).expect("delete");
        commit(&mut c, |c| c.create_tenant(&t("c", &["h1"]))).expect("a deleted tenant's host is free");
        // Loading the records makes the same state.
        let records = c.tenants.values().map(|t| Record::Tenant(t.clone()));
        assert_eq!(Cluster::from_records(records).tenants, c.tenants);
    }
}
