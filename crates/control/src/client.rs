//! The API's client: what the CLI, the targets' view agents and tests call. One HTTP/1.1
//! connection per call (hyper), bounded in time (REQUEST_TIMEOUT_MS) and in the reply's size
//! (RESPONSE_BYTES_MAX). Given several addresses (a leader and its standbys), a call refused
//! by a standby (`not_leader`) or whose connection is refused goes to the leader the standby
//! names, else to the next address, for at most FAILOVER_MS; the address that answered is
//! tried first by the next call.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::limits::{FAILOVER_MS, FAILOVER_ROUND_MS, REQUEST_TIMEOUT_MS, RESPONSE_BYTES_MAX};
use crate::model::*;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The control plane answered with an error.
    #[error("{0}")]
    Api(ApiError),
    /// It could not be reached, or its answer could not be read.
    #[error("control plane at {addr}: {what}")]
    Transport { addr: String, what: String },
}

impl ClientError {
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Api(e) => Some(e.code),
            ClientError::Transport { .. } => None,
        }
    }
}

/// A raw reply: the status and the body.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: Bytes,
}

/// The control plane's addresses, and which one answered last (shared by a client's clones).
#[derive(Debug, Clone)]
pub struct Addrs {
    list: Arc<Vec<SocketAddr>>,
    current: Arc<AtomicUsize>,
}

impl Addrs {
    pub fn list(&self) -> &[SocketAddr] {
        &self.list
    }

    /// The address the next call tries first.
    pub fn current(&self) -> SocketAddr {
        self.list[self.current.load(Ordering::Relaxed) % self.list.len()]
    }
}

impl std::fmt::Display for Addrs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list: Vec<String> = self.list.iter().map(|a| a.to_string()).collect();
        f.write_str(&list.join(","))
    }
}

#[derive(Debug, Clone)]
pub struct Client {
    pub addr: Addrs,
    /// The control plane's token, sent with every request (`Authorization: Bearer`).
    token: Option<Hidden>,
}

/// A token that Debug never prints.
#[derive(Clone)]
struct Hidden(Arc<str>);

impl std::fmt::Debug for Hidden {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("..")
    }
}

/// The leader's address a `not_leader` refusal names, if it names one.
fn named_leader(e: &ApiError) -> Option<SocketAddr> {
    let (_, after) = e.message.split_once("the leader's API is at ")?;
    after.split_whitespace().next()?.parse().ok()
}

/// A path segment with everything but unreserved characters and ':' percent-encoded
/// (RFC 3986), so that a name or an address ([::1]:4420) is one segment.
pub fn segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~:".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Client {
    pub fn new(addr: SocketAddr) -> Client {
        Client::with_addrs(vec![addr])
    }

    /// A client of a control plane with standbys: `addrs` tried in turn (at least one).
    pub fn with_addrs(addrs: Vec<SocketAddr>) -> Client {
        assert!(!addrs.is_empty(), "a control plane client needs an address");
        Client { addr: Addrs { list: Arc::new(addrs), current: Arc::new(AtomicUsize::new(0)) }, token: None }
    }

    /// The same client, sending `token` with every request (a control plane started with
    /// `--token-file`: docs/control-plane.md, "Authentication").
    pub fn with_token(mut self, token: Option<String>) -> Client {
        self.token = token.map(|t| Hidden(Arc::from(t)));
        self
    }

    fn transport(&self, what: impl std::fmt::Display) -> ClientError {
        ClientError::Transport { addr: self.addr.to_string(), what: what.to_string() }
    }

    fn transport_at(addr: SocketAddr, what: impl std::fmt::Display) -> ClientError {
        ClientError::Transport { addr: addr.to_string(), what: what.to_string() }
    }

    /// Sends one request with a raw body to the address tried first and returns the reply,
    /// whatever its status (no failover: tests look at a daemon this way).
    pub async fn raw(&self, method: Method, path: &str, body: Vec<u8>) -> Result<Reply, ClientError> {
        Self::raw_at(self.addr.current(), self.token.as_ref().map(|t| &*t.0), method, path, body).await.map_err(|(_, e)| e)
    }

    /// One request to `addr`; the error says whether the request was never sent (the
    /// connection refused or not made), so that sending it elsewhere cannot do it twice.
    async fn raw_at(
        addr: SocketAddr,
        token: Option<&str>,
        method: Method,
        path: &str,
        body: Vec<u8>,
    ) -> Result<Reply, (bool, ClientError)> {
        let call = async {
            let stream =
                tokio::net::TcpStream::connect(addr).await.map_err(|e| (true, Self::transport_at(addr, format!("connecting: {e}"))))?;
            let t = |e: hyper::Error| (false, Self::transport_at(addr, e));
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(t)?;
            let conn = tokio::spawn(conn);
            let mut req = Request::builder()
                .method(method)
                .uri(path)
                .header(hyper::header::HOST, addr.to_string())
                .header(hyper::header::CONTENT_TYPE, "application/json");
            if let Some(t) = token {
                req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {t}"));
            }
            let req = req.body(Full::new(Bytes::from(body))).map_err(|e| (false, Self::transport_at(addr, e)))?;
            let resp = sender.send_request(req).await.map_err(t)?;
            let status = resp.status().as_u16();
            let body = Limited::new(resp.into_body(), RESPONSE_BYTES_MAX)
                .collect()
                .await
                .map_err(|e| (false, Self::transport_at(addr, format!("reading the reply: {e}"))))?
                .to_bytes();
            conn.abort();
            Ok(Reply { status, body })
        };
        tokio::time::timeout(Duration::from_millis(REQUEST_TIMEOUT_MS), call)
            .await
            .map_err(|_| (false, Self::transport_at(addr, format!("no reply within {REQUEST_TIMEOUT_MS} ms"))))?
    }

    /// One call, following the leader: to the address that answered last, then on
    /// `not_leader` to the leader it names (or the next address), on a refused connection to
    /// the next address, a round of them every FAILOVER_ROUND_MS, for at most FAILOVER_MS.
    /// A single address refused with no standby heard from fails at once (nothing to follow).
    /// A request that may have reached a daemon is never sent again.
    async fn failover(&self, method: Method, path: &str, body: Vec<u8>) -> Result<Reply, ClientError> {
        let list = self.addr.list();
        let deadline = Instant::now() + Duration::from_millis(FAILOVER_MS);
        let mut i = self.addr.current.load(Ordering::Relaxed) % list.len();
        let mut tried = 0usize;
        let mut redirect: Option<SocketAddr> = None;
        let mut standby_seen = false;
        loop {
            let addr = redirect.take().unwrap_or(list[i]);
            let err = match Self::raw_at(addr, self.token.as_ref().map(|t| &*t.0), method.clone(), path, body.clone()).await {
                Ok(r) => match serde_json::from_slice::<ErrorBody>(&r.body).ok().map(|b| b.error) {
                    Some(e) if r.status == 503 && e.code == ErrorCode::NotLeader => {
                        // The leader it names, unless that is where we are.
                        redirect = named_leader(&e).filter(|l| *l != addr);
                        standby_seen = true;
                        ClientError::Api(e)
                    }
                    _ => {
                        if let Some(k) = list.iter().position(|a| *a == addr) {
                            self.addr.current.store(k, Ordering::Relaxed);
                        }
                        return Ok(r);
                    }
                },
                // Nothing to follow: one address, and no standby named a leader.
                Err((true, e)) if list.len() == 1 && !standby_seen => return Err(e),
                Err((true, e)) => e,
                Err((false, e)) => return Err(e),
            };
            if Instant::now() >= deadline {
                return Err(err);
            }
            if redirect.is_none() {
                i = (i + 1) % list.len();
                tried += 1;
                if tried.is_multiple_of(list.len()) {
                    // Every address refused: a takeover under way; wait a little.
                    tokio::time::sleep(Duration::from_millis(FAILOVER_ROUND_MS)).await;
                }
            }
        }
    }

    /// A JSON call: the reply's body as T on success, the API's error otherwise.
    pub async fn call<B: Serialize, T: DeserializeOwned>(&self, method: Method, path: &str, body: Option<&B>) -> Result<T, ClientError> {
        let bytes = match body {
            Some(b) => serde_json::to_vec(b).map_err(|e| self.transport(e))?,
            None => Vec::new(),
        };
        let r = self.failover(method, path, bytes).await?;
        if (200..300).contains(&r.status) {
            // 204 has no body: read as JSON null.
            let body: &[u8] = if r.body.is_empty() { b"null" } else { &r.body };
            return serde_json::from_slice(body).map_err(|e| self.transport(format!("reply to {path}: {e}")));
        }
        match serde_json::from_slice::<ErrorBody>(&r.body) {
            Ok(e) => Err(ClientError::Api(e.error)),
            Err(_) => Err(self.transport(format!("status {} to {path}: {}", r.status, String::from_utf8_lossy(&r.body)))),
        }
    }

    pub async fn register(&self, req: &RegisterTarget) -> Result<Registered, ClientError> {
        self.call(Method::POST, "/v1/targets", Some(req)).await
    }

    /// Every registered target.
    pub async fn targets(&self) -> Result<Vec<Target>, ClientError> {
        self.call::<(), _>(Method::GET, "/v1/targets", None).await
    }

    /// Process `incarnation` of `target` fenced its earlier ones at every registered
    /// target's pools: the volumes waiting for them go on.
    pub async fn fenced(&self, target: &str, incarnation: u64) -> Result<(), ClientError> {
        let body = Fenced { target: target.to_string(), incarnation };
        self.call::<_, ()>(Method::POST, "/v1/targets/fenced", Some(&body)).await
    }

    pub async fn push_view(&self, pool: &PoolId, push: &ViewPush) -> Result<View, ClientError> {
        self.call(Method::PUT, &format!("/v1/pools/{}/{}/view", segment(&pool.target), segment(&pool.name)), Some(push)).await
    }

    /// Pushes the view of the link from target `from` to target `to` (both as registered).
    pub async fn push_link_view(&self, from: &str, to: &str, push: &ViewPush) -> Result<LinkView, ClientError> {
        self.call(Method::PUT, &format!("/v1/links/{}/{}/view", segment(from), segment(to)), Some(push)).await
    }

    /// Sends a target's demands to the arbiter; its grants come back.
    pub async fn arbitrate(&self, req: &BandwidthRequest) -> Result<BandwidthGrants, ClientError> {
        self.call(Method::POST, "/v1/arbiter", Some(req)).await
    }

    /// Cordons a pool (`true`: no new extents there) or ends its cordon.
    pub async fn cordon(&self, pool: &PoolId, cordoned: bool) -> Result<Pool, ClientError> {
        let what = if cordoned { "cordon" } else { "uncordon" };
        self.call::<(), _>(Method::POST, &format!("/v1/pools/{}/{}/{what}", segment(&pool.target), segment(&pool.name)), None).await
    }

    pub async fn view(&self, since: u64) -> Result<ClusterView, ClientError> {
        self.call::<(), _>(Method::GET, &format!("/v1/view?since={since}"), None).await
    }

    pub async fn create_volume(&self, req: &CreateVolume) -> Result<Volume, ClientError> {
        self.call(Method::POST, "/v1/volumes", Some(req)).await
    }

    pub async fn volumes(&self) -> Result<Vec<Volume>, ClientError> {
        self.call::<(), _>(Method::GET, "/v1/volumes", None).await
    }

    pub async fn volume(&self, name: &str) -> Result<VolumeInfo, ClientError> {
        self.call::<(), _>(Method::GET, &format!("/v1/volumes/{}", segment(name)), None).await
    }

    pub async fn grow_volume(&self, name: &str, size: u64) -> Result<Volume, ClientError> {
        self.call(Method::POST, &format!("/v1/volumes/{}/grow", segment(name)), Some(&GrowVolume { size })).await
    }

    pub async fn delete_volume(&self, name: &str) -> Result<(), ClientError> {
        self.call::<(), ()>(Method::DELETE, &format!("/v1/volumes/{}", segment(name)), None).await
    }

    /// The translation service: where extent `index` lies, if it is allocated.
    pub async fn translate(&self, name: &str, index: u64) -> Result<Translation, ClientError> {
        self.call::<(), _>(Method::GET, &format!("/v1/volumes/{}/extents/{index}", segment(name)), None).await
    }

    pub async fn export(&self, name: &str, req: &ExportVolume) -> Result<Export, ClientError> {
        self.call(Method::PUT, &format!("/v1/volumes/{}/export", segment(name)), Some(req)).await
    }

    pub async fn unexport(&self, name: &str) -> Result<(), ClientError> {
        self.call::<(), ()>(Method::DELETE, &format!("/v1/volumes/{}/export", segment(name)), None).await
    }

    /// Tells the control plane that `target`, the volume's last exporter, no longer writes
    /// to its extents (docs/control-plane.md, "Handing an export over").
    pub async fn released(&self, name: &str, target: &str, epoch: u64, incarnation: u64) -> Result<(), ClientError> {
        let body = Released { target: target.to_string(), epoch, incarnation };
        self.call::<_, ()>(Method::POST, &format!("/v1/volumes/{}/released", segment(name)), Some(&body)).await
    }

    /// The exports `target` serves; held by the control plane while `since` is the current
    /// version (at most EXPORTS_WAIT_MS).
    /// `incarnation`: the asking process's, answered only when it is the registered one (0:
    /// always).
    pub async fn exports(&self, target: &str, since: u64, incarnation: u64) -> Result<ExportList, ClientError> {
        let path = format!("/v1/exports?target={}&since={since}&incarnation={incarnation}", segment(target));
        self.call::<(), _>(Method::GET, &path, None).await
    }

    pub async fn allocate(&self, name: &str, index: u64) -> Result<ExtentInfo, ClientError> {
        self.call::<(), _>(Method::POST, &format!("/v1/volumes/{}/extents/{index}/allocate", segment(name)), None).await
    }

    /// Extent `index` was zeroed by the data path that allocated it.
    pub async fn mark_written(&self, name: &str, index: u64) -> Result<ExtentInfo, ClientError> {
        self.call::<(), _>(Method::POST, &format!("/v1/volumes/{}/extents/{index}/written", segment(name)), None).await
    }

    /// Begins moving extent `index` of a volume (docs/control-plane.md, "Moving an extent").
    pub async fn begin_move(&self, name: &str, index: u64, req: &MoveRequest) -> Result<Move, ClientError> {
        self.call(Method::POST, &format!("/v1/volumes/{}/extents/{index}/move", segment(name)), Some(req)).await
    }

    /// The move of extent `index` under way (MoveNotFound once it ended).
    pub async fn get_move(&self, name: &str, index: u64) -> Result<Move, ClientError> {
        self.call::<(), _>(Method::GET, &format!("/v1/volumes/{}/extents/{index}/move", segment(name)), None).await
    }

    /// The moves `target` copies (all with None); held while `since` is the current version.
    pub async fn moves(&self, target: Option<&str>, since: u64) -> Result<MoveList, ClientError> {
        let t = target.map(|t| format!("target={}&", segment(t))).unwrap_or_default();
        self.call::<(), _>(Method::GET, &format!("/v1/moves?{t}since={since}"), None).await
    }

    /// A copier's acknowledgement (`ack`) or progress report (`progress`).
    pub async fn report_move(&self, name: &str, index: u64, what: &str, r: &MoveReport) -> Result<Move, ClientError> {
        self.call(Method::POST, &format!("/v1/moves/{}/{index}/{what}", segment(name)), Some(r)).await
    }

    /// Publishes a copied extent: its new place and epoch.
    pub async fn publish_move(&self, name: &str, index: u64, r: &MoveReport) -> Result<ExtentInfo, ClientError> {
        self.call(Method::POST, &format!("/v1/moves/{}/{index}/publish", segment(name)), Some(r)).await
    }

    pub async fn abort_move(&self, name: &str, index: u64, r: &MoveReport) -> Result<(), ClientError> {
        self.call::<_, ()>(Method::POST, &format!("/v1/moves/{}/{index}/abort", segment(name)), Some(r)).await
    }

    pub async fn create_tenant(&self, t: &Tenant) -> Result<Tenant, ClientError> {
        self.call(Method::POST, "/v1/tenants", Some(t)).await
    }

    pub async fn tenant(&self, name: &str) -> Result<Tenant, ClientError> {
        self.call::<(), _>(Method::GET, &format!("/v1/tenants/{}", segment(name)), None).await
    }

    pub async fn delete_tenant(&self, name: &str) -> Result<(), ClientError> {
        self.call::<(), ()>(Method::DELETE, &format!("/v1/tenants/{}", segment(name)), None).await
    }

    /// Every tenant; held by the control plane while `since` is the current version (at
    /// most EXPORTS_WAIT_MS; 0 answers at once).
    pub async fn tenants(&self, since: u64) -> Result<TenantList, ClientError> {
        self.call::<(), _>(Method::GET, &format!("/v1/tenants?since={since}"), None).await
    }
}
