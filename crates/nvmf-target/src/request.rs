//! One command from parse to completion.
//!
//! A queue makes a [`Request`] for every command it parses, and the request goes with the
//! command wherever it runs: executed at once, waiting for its data, on a device, on the
//! offload engine, parked (an Asynchronous Event Request). Writing the completion takes the
//! request by value ([`Request::finish`]), so a command cannot be completed twice:
//!
//! ```compile_fail,E0382
//! # use nearstore_target::request::Request;
//! fn twice(r: Request) {
//!     r.finish();
//!     r.finish(); // error[E0382]: use of moved value
//! }
//! ```
//!
//! A request dropped without completion is a lost command (a host would wait for it
//! forever): it is counted, per queue and in the target's `nearstore_requests_lost_total`,
//! and logged; tests assert the count stays zero. A queue that closes with requests
//! outstanding ends them with [`Request::abandon`]: counted apart
//! (`nearstore_requests_unfinished_total`), as nothing is lost there but the connection.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use tracing::error;

use crate::Target;

/// A queue's count of its requests' fates, shared by its requests.
pub struct QueueRequests {
    target: Arc<Target>,
    /// Dropped without completion.
    pub lost: AtomicU64,
    /// Outstanding when the queue closed.
    pub unfinished: AtomicU64,
}

impl QueueRequests {
    pub fn new(target: Arc<Target>) -> Arc<QueueRequests> {
        Arc::new(QueueRequests { target, lost: AtomicU64::new(0), unfinished: AtomicU64::new(0) })
    }
}

/// One command, from parse to completion.
#[must_use = "a request is completed exactly once (Request::finish)"]
pub struct Request {
    cid: u16,
    /// Its place in its queue's submission order (what pairs the halves of a fused
    /// operation: a host may reuse a command identifier once its command completed).
    /// Wraps: halves are next to each other, never 2^32 apart.
    seq: u32,
    start: Instant,
    /// None once finished or abandoned.
    queue: Option<Arc<QueueRequests>>,
}

impl Request {
    pub fn new(queue: &Arc<QueueRequests>, cid: u16, seq: u32, start: Instant) -> Request {
        Request { cid, seq, start, queue: Some(queue.clone()) }
    }

    pub fn cid(&self) -> u16 {
        self.cid
    }

    pub fn seq(&self) -> u32 {
        self.seq
    }

    /// When the command was parsed.
    pub fn start(&self) -> Instant {
        self.start
    }

    /// Ends the request as completed: the caller writes its completion with the command
    /// identifier returned.
    pub fn finish(mut self) -> u16 {
        self.queue = None;
        self.cid
    }

    /// Ends the request of a queue that closed before it completed.
    pub fn abandon(mut self) {
        if let Some(q) = self.queue.take() {
            q.unfinished.fetch_add(1, Relaxed);
            q.target.stats.requests_unfinished.fetch_add(1, Relaxed);
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        if let Some(q) = self.queue.take() {
            q.lost.fetch_add(1, Relaxed);
            q.target.stats.requests_lost.fetch_add(1, Relaxed);
            error!(cid = self.cid, "a command was dropped without a completion: its host waits for it forever");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn target() -> Arc<Target> {
        let cfg = Config::from_toml("[[listener]]\naddress = \"127.0.0.1:0\"").unwrap();
        Target::from_config(&cfg).unwrap()
    }

    #[test]
    fn each_fate_is_counted_once() {
        let t = target();
        let q = QueueRequests::new(t.clone());
        // (what, end of the request, lost, unfinished)
        type Case = (&'static str, fn(Request), u64, u64);
        let cases: [Case; 3] =
            [("finished", |r| assert_eq!(r.finish(), 7), 0, 0), ("abandoned at close", |r| r.abandon(), 0, 1), ("dropped", drop, 1, 1)];
        for (what, end, lost, unfinished) in cases {
            end(Request::new(&q, 7, 0, Instant::now()));
            assert_eq!((q.lost.load(Relaxed), q.unfinished.load(Relaxed)), (lost, unfinished), "{what}: the queue's counts");
            let s = &t.stats;
            assert_eq!((s.requests_lost.load(Relaxed), s.requests_unfinished.load(Relaxed)), (lost, unfinished), "{what}: the target's");
        }
    }
}
