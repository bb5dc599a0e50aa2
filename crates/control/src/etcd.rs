//! The control plane's state in etcd (`nearstore control --etcd URL,...`; docs/control-plane.md,
//! "etcd"). Several daemons may share one etcd: the one holding the leader key (under an etcd
//! lease it keeps alive) serves the API, the others stand by and take over when the lease ends.
//! A commit is one etcd transaction guarded by that lease and by the commit counter
//! ([`crate::store::GuardedStore`]); [`crate::store::Sequenced`] retries one whose outcome is
//! unknown. Everything runs on the daemon's runtime; the store's calls, made from the blocking
//! pool as every commit is, wait for it there.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use etcd_client::{Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse};
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use tokio::runtime::Handle;
use tower::ServiceExt;
use tracing::{error, info, warn};

use crate::limits::*;
use crate::model::{ApiError, ErrorBody, ErrorCode, Record, Table, Write};
use crate::server::{self, now_ms, Service};
use crate::store::{Guarded, GuardedStore, Sequenced, StoreError};

/// Where the control plane's keys live in etcd unless `--etcd-prefix` says otherwise.
pub const PREFIX_DEFAULT: &str = "/nearstore/control/";

/// The key layout under a prefix (docs/control-plane.md, "etcd").
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(prefix: &str) -> Keys {
        Keys { prefix: prefix.to_string() }
    }

    /// The leader key: the leading daemon's [`Leader`], attached to its lease.
    pub fn leader(&self) -> String {
        format!("{}leader", self.prefix)
    }

    /// The commit counter: its etcd version is the number of commits, its value the [`Counter`].
    pub fn commit(&self) -> String {
        format!("{}commit", self.prefix)
    }

    /// Where the records are: `records/TABLE/KEY`, the record as JSON.
    pub fn records(&self) -> String {
        format!("{}records/", self.prefix)
    }

    pub fn record(&self, t: Table, key: &str) -> String {
        format!("{}records/{}/{key}", self.prefix, t.name())
    }

    /// The key range of a volume's extents ("VOLUME/INDEX": a volume name holds no '/').
    fn extents_of(&self, volume: &str) -> String {
        format!("{}records/{}/{volume}/", self.prefix, Table::Extents.name())
    }
}

/// The leader key's value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Leader {
    /// Its etcd lease.
    pub lease: i64,
    /// The leader's API address, as a standby names it.
    pub api: String,
    /// When it took the lead, milliseconds since the Unix epoch.
    pub since_ms: u64,
}

/// The commit counter's value: which writer (lease) made commit `seq`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Counter {
    pub seq: u64,
    pub writer: i64,
}

fn failed(what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(format!("etcd {what}: {e}"))
}

/// One etcd call, bounded by ETCD_REQUEST_MS.
async fn call<T>(what: &str, f: impl Future<Output = Result<T, etcd_client::Error>>) -> Result<T, StoreError> {
    match tokio::time::timeout(Duration::from_millis(ETCD_REQUEST_MS), f).await {
        Ok(Ok(t)) => Ok(t),
        // etcd refuses what it will never take (too many operations, too large, a duplicate
        // key) as an invalid argument, and a lease it does not know as not found: those are
        // final. Anything else may have been applied.
        Ok(Err(etcd_client::Error::GRpcStatus(s))) if matches!(s.code(), tonic::Code::InvalidArgument | tonic::Code::NotFound) => {
            Err(failed(what, s.message()))
        }
        Ok(Err(e)) => Err(StoreError::Unknown(format!("etcd {what}: {e}"))),
        Err(_) => Err(StoreError::Unknown(format!("etcd {what}: no answer within {ETCD_REQUEST_MS} ms"))),
    }
}

/// A call that may be sent again whatever became of the last (a read, a lease revoked): sent
/// up to ETCD_READ_ATTEMPTS_MAX times, as the client's balancing may pick a dead member.
async fn again<T, F: Future<Output = Result<T, etcd_client::Error>>>(what: &str, mut f: impl FnMut() -> F) -> Result<T, StoreError> {
    let mut attempt = 1;
    loop {
        match call(what, f()).await {
            Err(StoreError::Unknown(_)) if attempt < ETCD_READ_ATTEMPTS_MAX => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(COMMIT_RETRY_MS_MIN)).await;
            }
            r => return r,
        }
    }
}

/// A client of the etcd cluster at `endpoints` (`http://HOST:PORT` or `HOST:PORT`). Requests go
/// to any member; one without a leader refuses at once (`require_leader`) rather than waits.
pub async fn connect(endpoints: &[String]) -> Result<Client, StoreError> {
    let opts = ConnectOptions::new()
        .with_connect_timeout(Duration::from_millis(ETCD_REQUEST_MS))
        .with_keep_alive(Duration::from_millis(ETCD_REQUEST_MS), Duration::from_millis(ETCD_REQUEST_MS))
        .with_require_leader(true);
    call("connect", Client::connect(endpoints, Some(opts))).await
}

/// One term of leadership: the lease that holds the leader key, kept alive by a task until
/// it is lost.
pub struct Term {
    pub lease: i64,
    ttl: Duration,
    /// The lease is surely alive until then: the last keep-alive's sending time plus the
    /// TTL etcd answered (etcd counts from when it received it, later).
    valid_until: Mutex<Instant>,
    lost: tokio::sync::watch::Sender<bool>,
}

impl Term {
    fn new(lease: i64, ttl: Duration, sent: Instant) -> Arc<Term> {
        Arc::new(Term { lease, ttl, valid_until: Mutex::new(sent + ttl), lost: tokio::sync::watch::channel(false).0 })
    }

    /// Whether this daemon surely still holds the lease.
    pub fn leads(&self) -> bool {
        !*self.lost.borrow() && Instant::now() < *self.valid_until.lock()
    }

    fn lose(&self) {
        self.lost.send_replace(true);
    }

    /// Resolves once the lease is lost (or given up).
    pub async fn lost(&self) {
        let mut rx = self.lost.subscribe();
        let _ = rx.wait_for(|l| *l).await;
    }
}

/// Keeps the term's lease alive every third of its TTL until etcd says it expired or no
/// keep-alive was answered before it surely did; then the term is lost.
async fn keep_alive(client: Client, term: Arc<Term>) {
    let every = term.ttl / 3;
    'stream: while term.leads() {
        let mut lease = client.lease_client();
        let (mut keeper, mut stream) = match call("lease keep-alive", lease.keep_alive(term.lease)).await {
            Ok(k) => k,
            Err(e) => {
                warn!(error = %e, "leader lease: no keep-alive stream, trying again");
                tokio::time::sleep(Duration::from_millis(COMMIT_RETRY_MS_MIN)).await;
                continue;
            }
        };
        while term.leads() {
            let sent = Instant::now();
            let answer = call("lease keep-alive", async {
                keeper.keep_alive().await?;
                stream.message().await
            })
            .await;
            match answer {
                Ok(Some(r)) if r.ttl() > 0 => *term.valid_until.lock() = sent + Duration::from_secs(r.ttl().unsigned_abs()),
                Ok(Some(_)) => {
                    warn!(lease = term.lease, "leader lease: etcd says it expired");
                    break 'stream;
                }
                Ok(None) | Err(_) => {
                    warn!(lease = term.lease, "leader lease: keep-alive stream broke, opening another");
                    tokio::time::sleep(Duration::from_millis(COMMIT_RETRY_MS_MIN)).await;
                    continue 'stream;
                }
            }
            tokio::time::sleep(every).await;
        }
    }
    term.lose();
}

/// Takes the leader key if no one holds it: grants a lease of `ttl_s` and creates the key
/// under it in one guarded transaction. Returns the term, or the current leader's API.
pub async fn try_lead(client: &Client, keys: &Keys, ttl_s: u64, api: &str) -> Result<Result<Arc<Term>, Option<Leader>>, StoreError> {
    let cur = again("get leader", || {
        let (mut kv, key) = (client.kv_client(), keys.leader());
        async move { kv.get(key, None).await }
    })
    .await?;
    if let Some(k) = cur.kvs().first() {
        let leader: Option<Leader> = serde_json::from_slice(k.value()).ok();
        if let Some(l) = leader.as_ref().filter(|l| l.api == api) {
            // This daemon's own key, of a term it could not give back (etcd unreachable
            // then): give it back now rather than wait out its TTL.
            revoke(client, l.lease).await;
        }
        return Ok(Err(leader));
    }
    let mut kv = client.kv_client();
    let sent = Instant::now();
    let mut lease_client = client.lease_client();
    let grant = call("lease grant", lease_client.grant(ttl_s as i64, None)).await?;
    let lease = grant.id();
    let me = serde_json::to_vec(&Leader { lease, api: api.to_string(), since_ms: now_ms() }).map_err(|e| failed("leader value", e))?;
    let txn = Txn::new().when([Compare::create_revision(keys.leader(), CompareOp::Equal, 0)]).and_then([TxnOp::put(
        keys.leader(),
        me,
        Some(PutOptions::new().with_lease(lease)),
    )]);
    match call("take leader key", kv.txn(txn)).await {
        Ok(r) if r.succeeded() => Ok(Ok(Term::new(lease, Duration::from_secs(grant.ttl().unsigned_abs()), sent))),
        other => {
            // Someone was faster, or the outcome is unknown: the lease goes, and with it the
            // key if it was taken after all.
            revoke(client, lease).await;
            other.map(|_| Err(None))
        }
    }
}

/// The records in etcd as a [`GuardedStore`], for one term of leadership.
pub struct EtcdStore {
    client: Client,
    rt: Handle,
    keys: Keys,
    term: Arc<Term>,
}

impl EtcdStore {
    pub fn new(client: Client, rt: Handle, keys: Keys, term: Arc<Term>) -> EtcdStore {
        EtcdStore { client, rt, keys, term }
    }

    async fn load_async(&self) -> Result<(Vec<Record>, u64), StoreError> {
        // The counter, and the revision every page is read at.
        let c = again("get commit counter", || {
            let (mut kv, key) = (self.client.kv_client(), self.keys.commit());
            async move { kv.get(key, None).await }
        })
        .await?;
        let rev = c.header().map_or(0, |h| h.revision());
        let seq = c.kvs().first().map_or(0, |k| k.version().unsigned_abs());
        let prefix = self.keys.records();
        let end = prefix_end(prefix.as_bytes());
        let mut from = prefix.clone().into_bytes();
        let mut out = Vec::new();
        loop {
            let page = again("load records", || {
                let opts = GetOptions::new().with_range(end.clone()).with_limit(ETCD_LOAD_PAGE_KEYS).with_revision(rev);
                let (mut kv, from) = (self.client.kv_client(), from.clone());
                async move { kv.get(from, Some(opts)).await }
            })
            .await?;
            for k in page.kvs() {
                out.push(self.record(k.key(), k.value())?);
            }
            match page.kvs().last() {
                Some(last) if page.more() => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => break,
            }
        }
        // etcd's order is by key bytes; the state loads volumes before their extents.
        out.sort_by_key(|r| r.table());
        Ok((out, seq))
    }

    fn record(&self, key: &[u8], value: &[u8]) -> Result<Record, StoreError> {
        let key = String::from_utf8_lossy(key);
        let rest = key.strip_prefix(&self.keys.records()).unwrap_or(&key);
        let (table, k) = rest.split_once('/').unwrap_or((rest, ""));
        let corrupt = |reason: String| StoreError::Corrupt { table: "etcd", key: key.to_string(), reason };
        let r: Record = serde_json::from_slice(value).map_err(|e| corrupt(e.to_string()))?;
        if r.table().name() != table || r.key() != k {
            return Err(corrupt(format!("holds {}/{}", r.table().name(), r.key())));
        }
        Ok(r)
    }

    /// The batch as transaction operations: the last write of a key wins (a transaction
    /// takes a key once), and a deleted volume's extents go as one key range.
    fn ops(&self, batch: &[Write]) -> Result<Vec<TxnOp>, StoreError> {
        let volumes: HashSet<&str> = batch
            .iter()
            .filter_map(|w| match w {
                Write::Delete(Table::Volumes, k) => Some(k.as_str()),
                _ => None,
            })
            .collect();
        let mut seen = HashSet::new();
        let (mut ops, mut bytes) = (Vec::new(), 0usize);
        for w in batch.iter().rev() {
            let (t, k) = match w {
                Write::Put(r) => (r.table(), r.key()),
                Write::Delete(t, k) => (*t, k.clone()),
            };
            if t == Table::Extents && k.rsplit_once('/').is_some_and(|(v, _)| volumes.contains(v)) {
                continue;
            }
            let key = self.keys.record(t, &k);
            if !seen.insert(key.clone()) {
                continue;
            }
            bytes += key.len();
            ops.push(match w {
                Write::Put(r) => {
                    let v = serde_json::to_vec(r).map_err(|e| failed("record", e))?;
                    bytes += v.len();
                    TxnOp::put(key, v, None)
                }
                Write::Delete(..) => TxnOp::delete(key, None),
            });
        }
        for v in volumes {
            ops.push(TxnOp::delete(self.keys.extents_of(v), Some(DeleteOptions::new().with_prefix())));
        }
        // The counter's put comes on top.
        if ops.len() + 1 > ETCD_TXN_OPS_MAX || bytes > ETCD_TXN_BYTES_MAX {
            return Err(StoreError::Backend(format!(
                "a commit of {} operations and {bytes} bytes is over the etcd store's limits ({ETCD_TXN_OPS_MAX} operations, {ETCD_TXN_BYTES_MAX} bytes)",
                ops.len() + 1
            )));
        }
        Ok(ops)
    }

    async fn commit_async(&self, seq: u64, batch: &[Write]) -> Result<Guarded, StoreError> {
        let mut ops = self.ops(batch)?;
        let counter = serde_json::to_vec(&Counter { seq: seq + 1, writer: self.term.lease }).map_err(|e| failed("counter", e))?;
        ops.push(TxnOp::put(self.keys.commit(), counter, None));
        let txn = Txn::new()
            .when([
                Compare::lease(self.keys.leader(), CompareOp::Equal, self.term.lease),
                Compare::version(self.keys.commit(), CompareOp::Equal, seq as i64),
            ])
            .and_then(ops)
            .or_else([TxnOp::get(self.keys.leader(), None), TxnOp::get(self.keys.commit(), None)]);
        let r = call("commit", self.client.kv_client().txn(txn)).await?;
        if r.succeeded() {
            return Ok(Guarded::Applied);
        }
        let got = r.op_responses();
        let first = |i: usize| match got.get(i) {
            Some(TxnOpResponse::Get(g)) => g.kvs().first().cloned(),
            _ => None,
        };
        let leads = first(0).is_some_and(|k| k.lease() == self.term.lease);
        let (seq, writer) = match first(1) {
            Some(k) => (k.version().unsigned_abs(), serde_json::from_slice::<Counter>(k.value()).map_or(0, |c| c.writer)),
            None => (0, 0),
        };
        Ok(Guarded::Refused { seq, writer, leads })
    }
}

/// The first key after every key starting with `p` (etcd's range end of a prefix).
fn prefix_end(p: &[u8]) -> Vec<u8> {
    let mut end = p.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

impl GuardedStore for EtcdStore {
    fn load(&self) -> Result<(Vec<Record>, u64), StoreError> {
        self.rt.block_on(self.load_async())
    }

    fn commit_if(&self, seq: u64, batch: &[Write]) -> Result<Guarded, StoreError> {
        if !self.term.leads() {
            return Err(StoreError::NotLeader("the leader lease is lost".into()));
        }
        self.rt.block_on(self.commit_async(seq, batch))
    }

    fn writer(&self) -> i64 {
        self.term.lease
    }

    fn retry_after(&self, attempt: u32) -> Option<Duration> {
        let ms = COMMIT_RETRY_MS_MIN.saturating_mul(1 << attempt.saturating_sub(1).min(16)).min(COMMIT_RETRY_MS_MAX);
        self.term.leads().then(|| Duration::from_millis(ms))
    }
}

/// How `nearstore control --etcd` runs.
#[derive(Debug, Clone)]
pub struct Options {
    pub endpoints: Vec<String>,
    pub prefix: String,
    pub lease_ttl_s: u64,
    /// The API's token, if it has one (server::authorized).
    pub token: Option<server::Token>,
    /// The targets' export lease (server::Service::with_export_lease_ms).
    pub export_lease_ms: u64,
}

/// What the API serves: the leader's routes while this daemon leads, else the standby's.
#[derive(Default)]
struct Slot {
    router: RwLock<Option<Router>>,
    /// The leader a standby last saw.
    leader: Mutex<Option<Leader>>,
}

#[derive(Serialize)]
struct StandbyHealth {
    status: &'static str,
    version: &'static str,
    leader: Option<String>,
}

async fn route(State(slot): State<Arc<Slot>>, req: Request) -> Response {
    let leading = slot.router.read().clone();
    if let Some(r) = leading {
        return match r.oneshot(req).await {
            Ok(resp) => resp,
            Err(never) => match never {},
        };
    }
    let leader = slot.leader.lock().as_ref().map(|l| l.api.clone());
    if req.uri().path() == "/v1/health" {
        return Json(StandbyHealth { status: "standby", version: env!("CARGO_PKG_VERSION"), leader }).into_response();
    }
    let message = match leader {
        Some(a) => format!("this control plane is a standby: the leader's API is at {a}"),
        None => "this control plane is a standby: no leader yet".to_string(),
    };
    (StatusCode::SERVICE_UNAVAILABLE, Json(ErrorBody { error: ApiError::new(ErrorCode::NotLeader, message) })).into_response()
}

/// Serves the API on `listener` with its state in etcd until `shutdown` resolves: stands by
/// until it takes the leader key, loads the state, leads until its lease is lost, and stands
/// by again. On shutdown a leader gives its lease back, so a standby takes over at once.
pub async fn serve(listener: tokio::net::TcpListener, opts: Options, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let api = listener.local_addr()?.to_string();
    let client = connect(&opts.endpoints).await?;
    let keys = Keys::new(&opts.prefix);
    let slot = Arc::new(Slot::default());
    let app = server::authorized(Router::new().fallback(route).with_state(slot.clone()), opts.token.clone());
    let http = tokio::spawn(async move { axum::serve(listener, app).await });
    let term: Mutex<Option<Arc<Term>>> = Mutex::new(None);
    let lead = async {
        loop {
            let t = campaign(&client, &keys, opts.lease_ttl_s, &api, &slot).await;
            *term.lock() = Some(t.clone());
            tokio::spawn(keep_alive(client.clone(), t.clone()));
            let loaded = loop {
                let store = EtcdStore::new(client.clone(), Handle::current(), keys.clone(), t.clone());
                let lease_ms = opts.export_lease_ms;
                let r = tokio::task::spawn_blocking(move || {
                    Service::open(Box::new(Sequenced::new(store))).map(|s| s.with_export_lease_ms(lease_ms))
                })
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r.map_err(|e| e.to_string()));
                match r {
                    Err(e) if t.leads() => {
                        warn!(error = %e, "loading the state from etcd failed: trying again");
                        tokio::time::sleep(Duration::from_millis(COMMIT_RETRY_MS_MAX)).await;
                    }
                    r => break r,
                }
            };
            match loaded {
                Ok(svc) => {
                    *slot.router.write() = Some(server::router(Arc::new(svc)));
                    info!(lease = t.lease, "control plane leading: state loaded from etcd");
                    t.lost().await;
                    *slot.router.write() = None;
                    warn!(lease = t.lease, "control plane lost its leader lease: standing by");
                    // Gone already, or still alive in etcd (this daemon stopped believing
                    // first): either way nobody waits out its TTL.
                    resign(&client, &t).await;
                }
                Err(e) => {
                    error!(error = %e, "loading the state from etcd failed: giving the lead back");
                    resign(&client, &t).await;
                    tokio::time::sleep(Duration::from_millis(LEADER_POLL_MS)).await;
                }
            }
            *term.lock() = None;
        }
    };
    tokio::select! {
        _ = lead => {}
        r = http => { r??; }
        () = shutdown => {}
    }
    let t = term.lock().take();
    if let Some(t) = t {
        resign(&client, &t).await;
        info!(lease = t.lease, "leader lease given back");
    }
    Ok(())
}

/// Waits until this daemon takes the leader key.
async fn campaign(client: &Client, keys: &Keys, ttl_s: u64, api: &str, slot: &Slot) -> Arc<Term> {
    let mut said = None;
    loop {
        match try_lead(client, keys, ttl_s, api).await {
            Ok(Ok(t)) => {
                *slot.leader.lock() = None;
                return t;
            }
            Ok(Err(leader)) => {
                if said != leader.as_ref().map(|l| l.lease) {
                    info!(leader = leader.as_ref().map_or("?", |l| l.api.as_str()), "control plane standing by");
                    said = leader.as_ref().map(|l| l.lease);
                }
                *slot.leader.lock() = leader;
            }
            Err(e) => warn!(error = %e, "etcd: cannot campaign for the lead"),
        }
        tokio::time::sleep(Duration::from_millis(LEADER_POLL_MS)).await;
    }
}

/// Gives the lease back: the leader key goes with it.
async fn resign(client: &Client, term: &Term) {
    term.lose();
    revoke(client, term.lease).await;
}

async fn revoke(client: &Client, lease: i64) {
    let r = again("lease revoke", || {
        let mut l = client.lease_client();
        async move { l.revoke(lease).await }
    })
    .await;
    match r {
        Ok(_) => {}
        // Already gone.
        Err(StoreError::Backend(_)) => {}
        Err(e) => warn!(error = %e, "etcd: a leader lease was not given back; it ends with its TTL"),
    }
}
