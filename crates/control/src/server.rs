//! The daemon: the HTTP/1.1 + JSON API (docs/control-plane.md lists every endpoint) over the
//! state and its store. Requests that change state run on tokio's blocking pool: they take
//! the state's lock and commit to the store (an fsync) before replying.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{DefaultBodyLimit, FromRequest, Path, Query, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use bytes::Bytes;
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tracing::{error, info};

use crate::limits::BODY_BYTES_MAX;
use crate::model::*;
use crate::state::Cluster;
use crate::store::{Store, StoreError};

/// The state and where it is kept.
pub struct Service {
    /// Locked only for a read, a plan or an apply, never across a commit: reads run on the
    /// runtime's workers, and a worker blocked behind a commit can starve the commit itself
    /// (the etcd client's connections are tasks on those workers) and the leader lease's
    /// keep-alive.
    cluster: Mutex<Cluster>,
    /// Held by a change from its plan to its apply, on a blocking thread: one change at a
    /// time, so that what a change planned on is what it applies to.
    changes: Mutex<()>,
    store: Box<dyn Store>,
    /// The exports' version: bumped at every export change, watched by long polls.
    exports: tokio::sync::watch::Sender<u64>,
    /// The moves' version: bumped at every move change, watched by the copiers' long polls.
    moves: tokio::sync::watch::Sender<u64>,
    /// The tenants' version: bumped at every tenant change, watched by the targets.
    tenants: tokio::sync::watch::Sender<u64>,
    /// The bandwidth arbiter's books: soft state, never stored (crate::arbiter).
    arbiter: Mutex<crate::arbiter::Arbiter>,
    /// Link views (soft state, crate::links).
    links: Mutex<crate::links::Links>,
    /// The targets' export lease (`--export-lease-ms`).
    export_lease_ms: u64,
    /// Volumes being unexported: from before the unexport's plan until its commit's end,
    /// the exports long poll no longer lists them, so that no lease on them is renewed
    /// after the handover's bound was computed (docs/control-plane.md, "Handing an export
    /// over"). Soft state.
    unexporting: Mutex<HashMap<String, usize>>,
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

type Planned<T> = Result<(Vec<Write>, T), ApiError>;

impl Service {
    /// The state the store holds.
    pub fn open(store: Box<dyn Store>) -> Result<Service, StoreError> {
        let cluster = Cluster::from_records(store.load()?);
        Ok(Service {
            cluster: Mutex::new(cluster),
            changes: Mutex::new(()),
            store,
            exports: tokio::sync::watch::Sender::new(1),
            moves: tokio::sync::watch::Sender::new(1),
            tenants: tokio::sync::watch::Sender::new(1),
            arbiter: Mutex::new(crate::arbiter::Arbiter::new()),
            links: Mutex::new(crate::links::Links::default()),
            export_lease_ms: crate::limits::EXPORT_LEASE_MS_DEFAULT,
            unexporting: Mutex::default(),
        })
    }

    /// The targets' export lease, in milliseconds (docs/control-plane.md, "Handing an
    /// export over").
    pub fn with_export_lease_ms(mut self, ms: u64) -> Service {
        self.export_lease_ms = ms;
        self
    }

    /// Wakes the targets waiting for export changes.
    fn exports_changed(&self) {
        self.exports.send_modify(|v| *v += 1);
    }

    /// Wakes the copiers waiting for move changes.
    fn moves_changed(&self) {
        self.moves.send_modify(|v| *v += 1);
    }

    /// Aborts the moves whose copiers fell silent (every MOVE_SWEEP_MS, on the blocking pool).
    pub fn expire_moves(&self) -> Result<usize, ApiError> {
        let now = now_ms();
        if !self.read(|c| c.moves.values().any(|m| m.state != MoveState::Aborted && now > m.deadline_ms)) {
            return Ok(0);
        }
        let n = self.change(|c| c.expire_moves(now))?;
        if n > 0 {
            info!(moves = n, "moves aborted: their copiers fell silent");
            self.moves_changed();
        }
        Ok(n)
    }

    /// Plans a change on the state, commits it, then applies it: a failed commit leaves the
    /// state as it was. Called on a blocking thread (the commit waits for the store). Changes
    /// run one at a time; reads meanwhile see the state before the change, as they would
    /// have before it was asked for, and never wait for the store.
    pub fn change<T>(&self, plan: impl FnOnce(&Cluster) -> Planned<T>) -> Result<T, ApiError> {
        let _one = self.changes.lock();
        let (writes, out) = plan(&self.cluster.lock())?;
        if let Err(e) = self.store.commit(&writes) {
            error!(error = %e, "commit failed");
            let code = if matches!(e, StoreError::NotLeader(_)) { ErrorCode::NotLeader } else { ErrorCode::StoreFailed };
            return Err(ApiError::new(code, e.to_string()));
        }
        let mut c = self.cluster.lock();
        for w in &writes {
            c.apply(w);
        }
        Ok(out)
    }

    pub fn read<T>(&self, f: impl FnOnce(&Cluster) -> T) -> T {
        f(&self.cluster.lock())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(ErrorBody { error: self })).into_response()
    }
}

/// A JSON request body, read up to BODY_BYTES_MAX; every refusal is an [`ApiError`].
pub struct Body<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(ErrorCode::BodyTooLarge, format!("request body over {BODY_BYTES_MAX} bytes"))
            } else {
                ApiError::new(ErrorCode::MalformedRequest, e.body_text())
            }
        })?;
        serde_json::from_slice(&bytes).map(Body).map_err(|e| ApiError::new(ErrorCode::MalformedRequest, format!("request body: {e}")))
    }
}

type Svc = State<Arc<Service>>;

/// Runs a change on the blocking pool: the store's commit waits for the disk.
async fn change<T: Send + 'static>(svc: Arc<Service>, plan: impl FnOnce(&Cluster) -> Planned<T> + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(move || svc.change(plan))
        .await
        .map_err(|e| ApiError::new(ErrorCode::StoreFailed, format!("commit task: {e}")))?
}

#[derive(Serialize)]
struct Health {
    status: &'static str,
    version: &'static str,
}

async fn health() -> Json<Health> {
    Json(Health { status: "ok", version: env!("CARGO_PKG_VERSION") })
}

async fn register(State(s): Svc, Body(req): Body<RegisterTarget>) -> Result<Json<Registered>, ApiError> {
    let now = now_ms();
    let lease = s.export_lease_ms;
    let r = change(s, move |c| c.register(&req, now, lease)).await?;
    info!(target_addr = %r.target.addr, pools = r.pools.len(), "target registered");
    Ok(Json(r))
}

/// A restarted target's process fenced its earlier ones: the volumes waiting for them go on.
async fn fenced(State(s): Svc, Body(req): Body<Fenced>) -> Result<StatusCode, ApiError> {
    let (target, incarnation) = (req.target.clone(), req.incarnation);
    change(s, move |c| c.fenced(&target, incarnation)).await?;
    info!(target_addr = %req.target, incarnation = req.incarnation, "target fenced its earlier processes");
    Ok(StatusCode::NO_CONTENT)
}

async fn targets(State(s): Svc) -> Json<Vec<Target>> {
    Json(s.read(|c| c.targets.values().cloned().collect()))
}

async fn push_view(
    State(s): Svc,
    Path((target, pool)): Path<(String, String)>,
    Body(push): Body<ViewPush>,
) -> Result<Json<View>, ApiError> {
    let now = now_ms();
    let id = PoolId { target, name: pool };
    Ok(Json(change(s, move |c| c.push_view(&id, &push, now)).await?))
}

/// A target's agent's view of its link to another target (crate::links): soft state.
async fn push_link_view(
    State(s): Svc,
    Path((from, to)): Path<(String, String)>,
    Body(push): Body<ViewPush>,
) -> Result<Json<LinkView>, ApiError> {
    let now = now_ms();
    let known: std::collections::HashSet<String> =
        s.read(|c| [&from, &to].into_iter().filter(|t| c.targets.contains_key(t.as_str())).cloned().collect());
    Ok(Json(s.links.lock().push(&from, &to, &push, now, |t| known.contains(t))?))
}

/// Flint's request to send: a target's demands on pools, answered with its grants
/// (crate::arbiter). Nothing is committed: the books are soft state.
async fn arbitrate(State(s): Svc, Body(req): Body<BandwidthRequest>) -> Result<Json<BandwidthGrants>, ApiError> {
    // The demanded targets' pools only (a target's pools are adjacent in the map).
    let targets: std::collections::BTreeSet<&str> = req.demands.iter().map(|d| d.pool_target.as_str()).collect();
    let capacity: std::collections::HashMap<(String, u32), crate::arbiter::Capacity> = s.read(|c| {
        let mut m = std::collections::HashMap::new();
        for t in targets {
            let from = PoolId { target: t.to_string(), name: String::new() };
            for p in c.pools.range(from..).map(|(_, p)| p).take_while(|p| p.id.target == t) {
                m.insert((p.id.target.clone(), p.nsid), crate::arbiter::Capacity { bandwidth: p.bandwidth, write_cost: p.write_cost });
            }
        }
        m
    });
    let grants = s.arbiter.lock().request(now_ms(), &req, |k| capacity.get(k).copied())?;
    Ok(Json(grants))
}

/// `pool drain` cordons a pool: it takes no new extent until uncordoned.
async fn cordon(State(s): Svc, Path((target, pool)): Path<(String, String)>) -> Result<Json<Pool>, ApiError> {
    let id = PoolId { target, name: pool };
    Ok(Json(change(s, move |c| c.cordon(&id, true)).await?))
}

async fn uncordon(State(s): Svc, Path((target, pool)): Path<(String, String)>) -> Result<Json<Pool>, ApiError> {
    let id = PoolId { target, name: pool };
    Ok(Json(change(s, move |c| c.cordon(&id, false)).await?))
}

#[derive(Deserialize)]
struct Since {
    #[serde(default)]
    since: u64,
}

async fn view(State(s): Svc, q: Result<Query<Since>, axum::extract::rejection::QueryRejection>) -> Result<Json<ClusterView>, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::new(ErrorCode::InvalidArgument, e.body_text()))?;
    let now = now_ms();
    let mut v = s.read(|c| c.view(q.since, now));
    v.links = s.links.lock().views(now);
    Ok(Json(v))
}

async fn create_volume(State(s): Svc, Body(req): Body<CreateVolume>) -> Result<(StatusCode, Json<Volume>), ApiError> {
    let now = now_ms();
    let v = change(s, move |c| c.create_volume(&req, now)).await?;
    info!(volume = %v.name, size = v.size, extent_size = v.extent_size, "volume created");
    Ok((StatusCode::CREATED, Json(v)))
}

async fn list_volumes(State(s): Svc) -> Json<Vec<Volume>> {
    Json(s.read(|c| c.volumes.values().cloned().collect()))
}

async fn volume_info(State(s): Svc, Path(name): Path<String>) -> Result<Json<VolumeInfo>, ApiError> {
    let now = now_ms();
    s.read(|c| c.volume_info(&name, now)).map(Json)
}

async fn grow_volume(State(s): Svc, Path(name): Path<String>, Body(req): Body<GrowVolume>) -> Result<Json<Volume>, ApiError> {
    let v = change(s, move |c| c.grow_volume(&name, &req)).await?;
    info!(volume = %v.name, size = v.size, "volume grown");
    Ok(Json(v))
}

async fn delete_volume(State(s): Svc, Path(name): Path<String>) -> Result<StatusCode, ApiError> {
    let n = name.clone();
    let now = now_ms();
    change(s, move |c| c.delete_volume(&n, now)).await?;
    info!(volume = %name, "volume deleted");
    Ok(StatusCode::NO_CONTENT)
}

async fn allocate(State(s): Svc, Path((name, index)): Path<(String, String)>) -> Result<Json<ExtentInfo>, ApiError> {
    let index = index_of(&index)?;
    let now = now_ms();
    Ok(Json(change(s, move |c| c.allocate(&name, index, now)).await?))
}

async fn mark_written(State(s): Svc, Path((name, index)): Path<(String, String)>) -> Result<Json<ExtentInfo>, ApiError> {
    let index = index_of(&index)?;
    Ok(Json(change(s, move |c| c.mark_written(&name, index)).await?))
}

fn index_of(index: &str) -> Result<u64, ApiError> {
    index.parse().map_err(|_| ApiError::new(ErrorCode::InvalidArgument, format!("extent index '{index}' is not a number")))
}

async fn translate(State(s): Svc, Path((name, index)): Path<(String, String)>) -> Result<Json<Translation>, ApiError> {
    let index = index_of(&index)?;
    s.read(|c| c.translate(&name, index)).map(Json)
}

async fn export(State(s): Svc, Path(name): Path<String>, Body(req): Body<ExportVolume>) -> Result<Json<Export>, ApiError> {
    let now = now_ms();
    let x = change(s.clone(), move |c| c.export(&name, &req, now)).await?;
    s.exports_changed();
    info!(volume = %x.volume, target_addr = %x.target, nqn = %x.nqn, "volume exported");
    Ok(Json(x))
}

async fn unexport(State(s): Svc, Path(name): Path<String>) -> Result<StatusCode, ApiError> {
    let n = name.clone();
    // Listed no more from now on until the commit has ended, even if this request is
    // dropped first (the guard goes with the blocking task); the bound counts from the
    // plan, after this.
    let going = Unexporting::mark(&s, &name);
    let lease = s.export_lease_ms;
    let svc = s.clone();
    tokio::task::spawn_blocking(move || {
        let _going = going;
        svc.change(move |c| c.unexport(&n, now_ms(), lease))
    })
    .await
    .map_err(|e| ApiError::new(ErrorCode::StoreFailed, format!("commit task: {e}")))??;
    info!(volume = %name, "volume unexported");
    Ok(StatusCode::NO_CONTENT)
}

/// A volume left out of the exports long poll's answers while it is unexported: until
/// dropped, when the poll's waiters are woken to see the list as committed.
struct Unexporting {
    svc: Arc<Service>,
    name: String,
}

impl Unexporting {
    fn mark(svc: &Arc<Service>, name: &str) -> Unexporting {
        *svc.unexporting.lock().entry(name.to_string()).or_default() += 1;
        svc.exports_changed();
        Unexporting { svc: svc.clone(), name: name.to_string() }
    }
}

impl Drop for Unexporting {
    fn drop(&mut self) {
        let mut going = self.svc.unexporting.lock();
        if let Some(n) = going.get_mut(&self.name) {
            *n -= 1;
            if *n == 0 {
                going.remove(&self.name);
            }
        }
        drop(going);
        self.svc.exports_changed();
    }
}

/// The volume's last exporter no longer writes to it: its part of the handover ends.
async fn released(State(s): Svc, Path(name): Path<String>, Body(req): Body<Released>) -> Result<StatusCode, ApiError> {
    let (n, target, epoch, incarnation) = (name.clone(), req.target.clone(), req.epoch, req.incarnation);
    let now = now_ms();
    change(s, move |c| c.released(&n, &target, epoch, incarnation, now)).await?;
    info!(volume = %name, target_addr = %req.target, "volume released by its last exporter");
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
struct ExportsQuery {
    target: String,
    #[serde(default)]
    since: u64,
    /// The asking process ([`Target::incarnation`]): answered only when it is the target's
    /// registered one (0: a target that predates incarnations, always answered).
    #[serde(default)]
    incarnation: u64,
}

/// A target's exports; with `since` equal to the current version, held until they change
/// or EXPORTS_WAIT_MS pass (a long poll).
async fn exports(
    State(s): Svc,
    q: Result<Query<ExportsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<ExportList>, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::new(ErrorCode::InvalidArgument, e.body_text()))?;
    let mut rx = s.exports.subscribe();
    if *rx.borrow_and_update() == q.since {
        // Timed out or changed: either way the reply is the list as it is now. Held a
        // third of the lease at most, so that a healthy control plane renews it in time.
        let hold = crate::limits::EXPORTS_WAIT_MS.min(s.export_lease_ms / 3);
        let _ = tokio::time::timeout(std::time::Duration::from_millis(hold), rx.changed()).await;
    }
    let version = *rx.borrow();
    // The volumes being unexported first, then the state, under that lock: an unexport
    // that ends between the two is in the state read.
    let going = s.unexporting.lock();
    let (registered, mut exports) = s.read(|c| (c.targets.get(&q.target).map(|t| t.incarnation), c.exports_of(&q.target)));
    exports.retain(|x| !going.contains_key(&x.volume));
    drop(going);
    // Another process than the registered one renews no lease: a new one before its
    // registration (a volume it served then would be unexported under the old one's name),
    // or an old one still running after a new one registered.
    if q.incarnation != 0 && registered != Some(q.incarnation) {
        return Err(ApiError::new(
            ErrorCode::StaleIncarnation,
            format!("process {} of target {} is not the one registered: register first", q.incarnation, q.target),
        ));
    }
    Ok(Json(ExportList { version, exports, lease_ms: s.export_lease_ms }))
}

async fn begin_move(
    State(s): Svc,
    Path((name, index)): Path<(String, String)>,
    Body(req): Body<MoveRequest>,
) -> Result<(StatusCode, Json<Move>), ApiError> {
    let index = index_of(&index)?;
    let now = now_ms();
    let m = change(s.clone(), move |c| c.begin_move(&name, index, &req, now)).await?;
    s.moves_changed();
    info!(volume = %m.volume, index = m.index, from = %m.from, to = %m.to, copier = %m.copier, "move begun");
    Ok((StatusCode::CREATED, Json(m)))
}

async fn get_move(State(s): Svc, Path((name, index)): Path<(String, String)>) -> Result<Json<Move>, ApiError> {
    let index = index_of(&index)?;
    s.read(|c| {
        c.volume(&name)?;
        c.moves
            .get(&(name.clone(), index))
            .cloned()
            .ok_or_else(|| ApiError::new(ErrorCode::MoveNotFound, format!("no move of extent {index} of volume '{name}'")))
    })
    .map(Json)
}

/// A copier's word on a move: ack, progress, publish or abort.
async fn report_move(
    State(s): Svc,
    Path((name, index, what)): Path<(String, String, String)>,
    Body(r): Body<MoveReport>,
) -> Result<Response, ApiError> {
    let index = index_of(&index)?;
    let now = now_ms();
    let reply = match what.as_str() {
        "ack" | "progress" => {
            let ack = what == "ack";
            Json(change(s.clone(), move |c| c.report_move(&name, index, &r, ack, now)).await?).into_response()
        }
        "publish" => {
            let e = change(s.clone(), move |c| c.publish_move(&name, index, &r)).await?;
            info!(extent = e.index, pool = %e.pool, target_addr = %e.target, epoch = e.epoch, "move published");
            Json(e).into_response()
        }
        "abort" => {
            let why = r.reason.clone();
            change(s.clone(), move |c| c.abort_move(&name, index, &r)).await?;
            info!(extent = index, reason = %why, "move aborted by its copier");
            StatusCode::NO_CONTENT.into_response()
        }
        _ => return Err(ApiError::new(ErrorCode::NoSuchEndpoint, format!("no move report '{what}'"))),
    };
    s.moves_changed();
    Ok(reply)
}

#[derive(Deserialize)]
struct MovesQuery {
    #[serde(default)]
    target: Option<String>,
    #[serde(default)]
    since: u64,
}

/// The moves (a copier's with `target`); with `since` equal to the current version, held
/// until they change or EXPORTS_WAIT_MS pass (a long poll, as for exports).
async fn moves(State(s): Svc, q: Result<Query<MovesQuery>, axum::extract::rejection::QueryRejection>) -> Result<Json<MoveList>, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::new(ErrorCode::InvalidArgument, e.body_text()))?;
    let mut rx = s.moves.subscribe();
    if *rx.borrow_and_update() == q.since {
        let _ = tokio::time::timeout(std::time::Duration::from_millis(crate::limits::EXPORTS_WAIT_MS), rx.changed()).await;
    }
    let version = *rx.borrow();
    Ok(Json(MoveList { version, moves: s.read(|c| c.moves_of(q.target.as_deref())) }))
}

async fn create_tenant(State(s): Svc, Body(req): Body<Tenant>) -> Result<(StatusCode, Json<Tenant>), ApiError> {
    let t = change(s.clone(), move |c| c.create_tenant(&req)).await?;
    s.tenants.send_modify(|v| *v += 1);
    info!(tenant = %t.name, hosts = t.hosts.len(), io_weight = t.io_weight, compute_weight = t.compute_weight, "tenant created");
    Ok((StatusCode::CREATED, Json(t)))
}

async fn tenant_info(State(s): Svc, Path(name): Path<String>) -> Result<Json<Tenant>, ApiError> {
    s.read(|c| c.tenant(&name).cloned()).map(Json)
}

async fn delete_tenant(State(s): Svc, Path(name): Path<String>) -> Result<StatusCode, ApiError> {
    let n = name.clone();
    change(s.clone(), move |c| c.delete_tenant(&n)).await?;
    s.tenants.send_modify(|v| *v += 1);
    info!(tenant = %name, "tenant deleted");
    Ok(StatusCode::NO_CONTENT)
}

/// Every tenant; with `since` equal to the current version, held until they change or
/// EXPORTS_WAIT_MS pass (the targets' long poll, as for exports).
async fn tenants(State(s): Svc, q: Result<Query<Since>, axum::extract::rejection::QueryRejection>) -> Result<Json<TenantList>, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::new(ErrorCode::InvalidArgument, e.body_text()))?;
    let mut rx = s.tenants.subscribe();
    if *rx.borrow_and_update() == q.since {
        let _ = tokio::time::timeout(std::time::Duration::from_millis(crate::limits::EXPORTS_WAIT_MS), rx.changed()).await;
    }
    let version = *rx.borrow();
    Ok(Json(TenantList { version, tenants: s.read(|c| c.tenants.values().cloned().collect()) }))
}

/// Looks for silent moves every MOVE_SWEEP_MS while the service lives.
async fn sweep(svc: std::sync::Weak<Service>) {
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(crate::limits::MOVE_SWEEP_MS)).await;
        let Some(s) = svc.upgrade() else { return };
        match tokio::task::spawn_blocking(move || s.expire_moves()).await {
            Ok(Err(e)) => error!(error = %e, "aborting silent moves"),
            Err(e) => error!(error = %e, "aborting silent moves"),
            Ok(Ok(_)) => {}
        }
    }
}

async fn no_such_endpoint(req: Request) -> ApiError {
    ApiError::new(ErrorCode::NoSuchEndpoint, format!("no endpoint {} {}", req.method(), req.uri().path()))
}

/// The API's routes.
pub fn router(svc: Arc<Service>) -> Router {
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        rt.spawn(sweep(Arc::downgrade(&svc)));
    }
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/targets", post(register).get(targets))
        .route("/v1/targets/fenced", post(fenced))
        .route("/v1/pools/{target}/{pool}/view", put(push_view))
        .route("/v1/pools/{target}/{pool}/cordon", post(cordon))
        .route("/v1/pools/{target}/{pool}/uncordon", post(uncordon))
        .route("/v1/view", get(view))
        .route("/v1/links/{from}/{to}/view", put(push_link_view))
        .route("/v1/arbiter", post(arbitrate))
        .route("/v1/volumes", post(create_volume).get(list_volumes))
        .route("/v1/volumes/{name}", get(volume_info).delete(delete_volume))
        .route("/v1/volumes/{name}/grow", post(grow_volume))
        .route("/v1/volumes/{name}/extents/{index}", get(translate))
        .route("/v1/volumes/{name}/extents/{index}/allocate", post(allocate))
        .route("/v1/volumes/{name}/extents/{index}/written", post(mark_written))
        .route("/v1/volumes/{name}/export", put(export).delete(unexport))
        .route("/v1/volumes/{name}/released", post(released))
        .route("/v1/exports", get(exports))
        .route("/v1/volumes/{name}/extents/{index}/move", post(begin_move).get(get_move))
        .route("/v1/moves/{name}/{index}/{what}", post(report_move))
        .route("/v1/moves", get(moves))
        .route("/v1/tenants", post(create_tenant).get(tenants))
        .route("/v1/tenants/{name}", get(tenant_info).delete(delete_tenant))
        .fallback(no_such_endpoint)
        .method_not_allowed_fallback(no_such_endpoint)
        .layer(DefaultBodyLimit::max(BODY_BYTES_MAX))
        .with_state(svc)
}

/// Serves the API on `listener` until the future is dropped.
pub async fn serve(listener: tokio::net::TcpListener, svc: Arc<Service>) -> std::io::Result<()> {
    serve_with(listener, svc, None).await
}

/// [`serve`], every request but `GET /v1/health` required to carry `token` ([`authorized`]).
pub async fn serve_with(listener: tokio::net::TcpListener, svc: Arc<Service>, token: Option<Token>) -> std::io::Result<()> {
    axum::serve(listener, authorized(router(svc), token)).await
}

/// The API's token (docs/control-plane.md, "Authentication"): what a request must carry as
/// `Authorization: Bearer TOKEN`. Kept as its SHA-256, compared in time independent of where
/// the bytes differ, so that neither the token's length nor its prefix shows in the reply's
/// time.
#[derive(Clone)]
pub struct Token(Arc<[u8; 32]>);

/// Never the token, nor its digest.
impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Token {
    /// A token of at least `limits::TOKEN_CHARS_MIN` printable ASCII characters.
    pub fn new(token: &str) -> Result<Token, String> {
        if token.len() < crate::limits::TOKEN_CHARS_MIN || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!(
                "a control token is at least {} printable ASCII characters, no spaces (e.g. head -c 32 /dev/urandom | base64)",
                crate::limits::TOKEN_CHARS_MIN
            ));
        }
        Ok(Token(Arc::new(digest(token))))
    }

    /// Whether `presented` is the token.
    pub fn matches(&self, presented: &str) -> bool {
        digest(presented).iter().zip(self.0.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

fn digest(text: &str) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(text.as_bytes()).into()
}

/// `router` with every request but `GET /v1/health` (which load balancers and the
/// standbys' followers ask) refused with `unauthorized` (401) unless it carries `token`;
/// `router` itself when there is none.
pub fn authorized(router: Router, token: Option<Token>) -> Router {
    let Some(token) = token else { return router };
    router.layer(axum::middleware::from_fn(move |req: Request, next: axum::middleware::Next| {
        let token = token.clone();
        async move {
            let presented = req.headers().get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
            let ok = presented.and_then(|v| v.strip_prefix("Bearer ")).is_some_and(|t| token.matches(t));
            if ok || req.uri().path() == "/v1/health" {
                return next.run(req).await;
            }
            let what = if presented.is_some() { "a wrong control token" } else { "no control token" };
            ApiError::new(
                ErrorCode::Unauthorized,
                format!(
                    "{what}: this control plane takes requests with its token only (--control-token-file or NEARSTORE_CONTROL_TOKEN_FILE)"
                ),
            )
            .into_response()
        }
    }))
}
