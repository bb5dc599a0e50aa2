//! The API's client: what the CLI, the targets' view agents and tests call. One HTTP/1.1
//! connection per call (hyper), bounded in time (REQUEST_TIMEOUT_MS) and in the reply's size
//! (RESPONSE_BYTES_MAX).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::limits::{REQUEST_TIMEOUT_MS, RESPONSE_BYTES_MAX};
use crate::model::*;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The control plane answered with an error.
    #[error("{0}")]
    Api(ApiError),
    /// It could not be reached, or its answer could not be read.
    #[error("control plane at {addr}: {what}")]
    Transport { addr: SocketAddr, what: String },
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

#[derive(Debug, Clone)]
pub struct Client {
    pub addr: SocketAddr,
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
        Client { addr }
    }

    fn transport(&self, what: impl std::fmt::Display) -> ClientError {
        ClientError::Transport { addr: self.addr, what: what.to_string() }
    }

    /// Sends one request with a raw body and returns the reply, whatever its status.
    pub async fn raw(&self, method: Method, path: &str, body: Vec<u8>) -> Result<Reply, ClientError> {
        let call = async {
            let stream = tokio::net::TcpStream::connect(self.addr).await.map_err(|e| self.transport(format!("connecting: {e}")))?;
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|e| self.transport(e))?;
            let conn = tokio::spawn(conn);
            let req = Request::builder()
                .method(method)
                .uri(path)
                .header(hyper::header::HOST, self.addr.to_string())
                .header(hyper::header::CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(body)))
                .map_err(|e| self.transport(e))?;
            let resp = sender.send_request(req).await.map_err(|e| self.transport(e))?;
            let status = resp.status().as_u16();
            let body = Limited::new(resp.into_body(), RESPONSE_BYTES_MAX)
                .collect()
                .await
                .map_err(|e| self.transport(format!("reading the reply: {e}")))?
                .to_bytes();
            conn.abort();
            Ok(Reply { status, body })
        };
        tokio::time::timeout(Duration::from_millis(REQUEST_TIMEOUT_MS), call)
            .await
            .map_err(|_| self.transport(format!("no reply within {REQUEST_TIMEOUT_MS} ms")))?
    }

    /// A JSON call: the reply's body as T on success, the API's error otherwise.
    pub async fn call<B: Serialize, T: DeserializeOwned>(&self, method: Method, path: &str, body: Option<&B>) -> Result<T, ClientError> {
        let bytes = match body {
            Some(b) => serde_json::to_vec(b).map_err(|e| self.transport(e))?,
            None => Vec::new(),
        };
        let r = self.raw(method, path, bytes).await?;
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

    pub async fn push_view(&self, pool: &PoolId, push: &ViewPush) -> Result<View, ClientError> {
        self.call(Method::PUT, &format!("/v1/pools/{}/{}/view", segment(&pool.target), segment(&pool.name)), Some(push)).await
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

    /// The exports `target` serves; held by the control plane while `since` is the current
    /// version (at most EXPORTS_WAIT_MS).
    pub async fn exports(&self, target: &str, since: u64) -> Result<ExportList, ClientError> {
        self.call::<(), _>(Method::GET, &format!("/v1/exports?target={}&since={since}", segment(target)), None).await
    }

    pub async fn allocate(&self, name: &str, index: u64) -> Result<ExtentInfo, ClientError> {
        self.call::<(), _>(Method::POST, &format!("/v1/volumes/{}/extents/{index}/allocate", segment(name)), None).await
    }
}
