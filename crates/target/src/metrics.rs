//! Counters and latency histograms, served as Prometheus text.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::Target;

/// Latency buckets: upper bounds in microseconds, powers of two from 1 us to about 8 s.
pub const LATENCY_BUCKETS: usize = 24;

#[derive(Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS],
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn record(&self, d: Duration) {
        let us = d.as_micros() as u64;
        let i = (64 - us.leading_zeros() as usize).min(LATENCY_BUCKETS - 1);
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum_us.fetch_add(us, Relaxed);
        self.count.fetch_add(1, Relaxed);
    }
}

/// Per-namespace I/O counters, shared by the SMART log and the metrics endpoint.
#[derive(Default)]
pub struct NsStats {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub read_bytes: AtomicU64,
    pub written_bytes: AtomicU64,
    pub other: AtomicU64,
    pub errors: AtomicU64,
    pub latency: Histogram,
}

#[derive(Default)]
pub struct TargetStats {
    pub connections: AtomicI64,
    pub connections_total: AtomicU64,
    pub fatal_errors: AtomicU64,
    pub controllers_expired: AtomicU64,
    /// Buffer bytes held by all connections now.
    pub buffer_bytes: AtomicI64,
    /// The most buffer bytes one connection has held (bounded by
    /// limits::connection_memory_max).
    pub connection_buffer_bytes_max: AtomicU64,
    /// Connections closed at accept: the cap was reached by Connected hosts, or their
    /// address held its limit of connections that had not Connected.
    pub connections_refused: AtomicU64,
    /// Connections that had not Connected, closed to make room for a new one.
    pub connections_evicted: AtomicU64,
    /// Connections closed because they did not Connect within limits.connect_timeout_ms.
    pub connect_timeouts: AtomicU64,
    /// Connects refused because the host held limits.controllers_per_host controllers.
    pub controllers_refused: AtomicU64,
}

/// Renders the Prometheus text exposition of every counter.
pub fn render(t: &Target) -> String {
    let mut o = String::new();
    let s = &t.stats;
    let _ = writeln!(o, "# TYPE nearstore_connections gauge\nnearstore_connections {}", s.connections.load(Relaxed));
    let _ = writeln!(o, "# TYPE nearstore_connections_total counter\nnearstore_connections_total {}", s.connections_total.load(Relaxed));
    let _ = writeln!(
        o,
        "# TYPE nearstore_transport_fatal_errors_total counter\nnearstore_transport_fatal_errors_total {}",
        s.fatal_errors.load(Relaxed)
    );
    let _ = writeln!(
        o,
        "# TYPE nearstore_keep_alive_expired_total counter\nnearstore_keep_alive_expired_total {}",
        s.controllers_expired.load(Relaxed)
    );
    let _ = writeln!(o, "# TYPE nearstore_buffer_bytes gauge\nnearstore_buffer_bytes {}", s.buffer_bytes.load(Relaxed));
    let _ = writeln!(
        o,
        "# TYPE nearstore_connection_buffer_bytes_max gauge\nnearstore_connection_buffer_bytes_max {}",
        s.connection_buffer_bytes_max.load(Relaxed)
    );
    for (name, kind, v) in [
        ("nearstore_connections_refused_total", "counter", s.connections_refused.load(Relaxed)),
        ("nearstore_connections_evicted_total", "counter", s.connections_evicted.load(Relaxed)),
        ("nearstore_connect_timeouts_total", "counter", s.connect_timeouts.load(Relaxed)),
        ("nearstore_controllers_refused_total", "counter", s.controllers_refused.load(Relaxed)),
        ("nearstore_connections_max", "gauge", t.admission.cap() as u64),
        ("nearstore_descriptor_limit", "gauge", t.nofile),
    ] {
        let _ = writeln!(o, "# TYPE {name} {kind}\n{name} {v}");
    }
    let c = &t.offload.stats;
    for (name, kind, v) in [
        ("nearstore_compute_commands_total", "counter", c.commands.load(Relaxed)),
        ("nearstore_compute_errors_total", "counter", c.errors.load(Relaxed)),
        ("nearstore_compute_read_bytes_total", "counter", c.bytes_read.load(Relaxed)),
        ("nearstore_compute_written_bytes_total", "counter", c.bytes_written.load(Relaxed)),
        ("nearstore_compute_running", "gauge", c.running.load(Relaxed)),
        ("nearstore_compute_queued", "gauge", c.queued.load(Relaxed)),
    ] {
        let _ = writeln!(o, "# TYPE {name} {kind}\n{name} {v}");
    }
    let peers = t.offload.peers.stats();
    type PeerCounter = (&'static str, fn(&crate::cluster::PeerStats) -> &AtomicU64);
    let peer_counters: [PeerCounter; 3] = [
        ("nearstore_peer_read_bytes_total", |p| &p.read_bytes),
        ("nearstore_peer_failures_total", |p| &p.failures),
        ("nearstore_peer_connections_total", |p| &p.connections),
    ];
    for (name, get) in peer_counters {
        let _ = writeln!(o, "# TYPE {name} counter");
        for (tag, addr, st) in &peers {
            let _ = writeln!(o, "{name}{{tag=\"{tag}\",address=\"{addr}\"}} {}", get(st).load(Relaxed));
        }
    }
    type Counter = (&'static str, fn(&NsStats) -> &AtomicU64);
    let counters: [Counter; 6] = [
        ("nearstore_reads_total", |n| &n.reads),
        ("nearstore_writes_total", |n| &n.writes),
        ("nearstore_read_bytes_total", |n| &n.read_bytes),
        ("nearstore_written_bytes_total", |n| &n.written_bytes),
        ("nearstore_other_commands_total", |n| &n.other),
        ("nearstore_io_errors_total", |n| &n.errors),
    ];
    let subsystems = t.subsystems();
    for (name, get) in counters {
        let _ = writeln!(o, "# TYPE {name} counter");
        for sub in &subsystems {
            for ns in sub.namespaces() {
                let _ = writeln!(o, "{name}{{subnqn=\"{}\",nsid=\"{}\"}} {}", sub.nqn, ns.nsid, get(&ns.stats).load(Relaxed));
            }
        }
    }
    let _ = writeln!(o, "# TYPE nearstore_io_latency_seconds histogram");
    for sub in &subsystems {
        for ns in sub.namespaces() {
            let h = &ns.stats.latency;
            let labels = format!("subnqn=\"{}\",nsid=\"{}\"", sub.nqn, ns.nsid);
            let mut cum = 0;
            for (i, b) in h.buckets.iter().enumerate() {
                cum += b.load(Relaxed);
                let le = (1u64 << i) as f64 / 1e6;
                let _ = writeln!(o, "nearstore_io_latency_seconds_bucket{{{labels},le=\"{le}\"}} {cum}");
            }
            let _ = writeln!(o, "nearstore_io_latency_seconds_bucket{{{labels},le=\"+Inf\"}} {}", h.count.load(Relaxed));
            let _ = writeln!(o, "nearstore_io_latency_seconds_sum{{{labels}}} {}", h.sum_us.load(Relaxed) as f64 / 1e6);
            let _ = writeln!(o, "nearstore_io_latency_seconds_count{{{labels}}} {}", h.count.load(Relaxed));
        }
    }
    o
}

/// Serves `GET /metrics` (any path, in fact) over plain HTTP/1.0 until the listener fails.
pub async fn serve(listener: TcpListener, target: Arc<Target>) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let target = target.clone();
        tokio::spawn(async move {
            let mut req = [0u8; 1024];
            // One read is enough for a GET; a slow or silent client is dropped after 5 s.
            let _ = tokio::time::timeout(Duration::from_secs(5), sock.read(&mut req)).await;
            let body = render(&target);
            let head = format!("HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n", body.len());
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
        });
    }
}
