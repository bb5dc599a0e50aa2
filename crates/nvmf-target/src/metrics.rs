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
    /// Nanoseconds reads and writes took, summed (a pool's view: latency, and queue depth
    /// by Little's law).
    pub read_ns: AtomicU64,
    pub write_ns: AtomicU64,
}

#[derive(Default)]
pub struct TargetStats {
    pub connections: AtomicI64,
    pub connections_total: AtomicU64,
    pub fatal_errors: AtomicU64,
    pub controllers_expired: AtomicU64,
    /// Queues closed because their host failed DH-HMAC-CHAP authentication.
    pub auth_failures: AtomicU64,
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
    /// Connects refused because the memory budget could not hold the queue's buffers.
    pub connects_refused_memory: AtomicU64,
    /// Connects refused because their address held limits.queues_per_address queues.
    pub connects_refused_address: AtomicU64,
    /// Commands dropped without a completion (a bug: always 0; crate::request).
    pub requests_lost: AtomicU64,
    /// Commands outstanding when their queue closed.
    pub requests_unfinished: AtomicU64,
    /// Read data of WRITE_THROUGH_BYTES_MIN and more copied into send buffers (reads of
    /// memory namespaces are sent from memory: only a block a send cut short is copied).
    pub tx_copied_bytes: AtomicU64,
    /// Sends the socket took only part of.
    pub tx_partial_writes: AtomicU64,
}

/// Writes a metric family's `# HELP` and `# TYPE` lines.
fn family(o: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Renders the Prometheus text exposition of every counter, each family with its help.
pub fn render(t: &Target) -> String {
    let mut o = String::new();
    let s = &t.stats;
    let a = &t.gates.stats;
    let target: [(&str, &str, &str, i64); 29] = [
        (
            "nearstore_arbiter_requests_total",
            "counter",
            "Requests this target sent the control plane's arbiter for its volumes' tenants' shares of pools.",
            a.requests.load(Relaxed) as i64,
        ),
        (
            "nearstore_arbiter_request_failures_total",
            "counter",
            "Requests to the arbiter that failed (no answer in time, or an error).",
            a.failures.load(Relaxed) as i64,
        ),
        ("nearstore_arbiter_grants", "gauge", "The arbiter's grants holding now (a tenant on a pool each).", a.grants.load(Relaxed) as i64),
        (
            "nearstore_arbiter_grants_expired_total",
            "counter",
            "Grants that ran out before a new one came: their tenants fell back to the pools' local fair sharing.",
            a.expired.load(Relaxed) as i64,
        ),
        (
            "nearstore_arbiter_held_total",
            "counter",
            "Reads and writes of volumes a grant held back until its bucket held them.",
            a.held.load(Relaxed) as i64,
        ),
        (
            "nearstore_arbiter_held_nanoseconds_total",
            "counter",
            "Time grants held reads and writes back (nanoseconds).",
            a.held_ns.load(Relaxed) as i64,
        ),
        ("nearstore_connections", "gauge", "NVMe/TCP connections open now (one per queue).", s.connections.load(Relaxed)),
        ("nearstore_connections_total", "counter", "NVMe/TCP connections accepted.", s.connections_total.load(Relaxed) as i64),
        (
            "nearstore_transport_fatal_errors_total",
            "counter",
            "Connections closed for a transport error (malformed PDU, digest mismatch, protocol violation).",
            s.fatal_errors.load(Relaxed) as i64,
        ),
        (
            "nearstore_keep_alive_expired_total",
            "counter",
            "Controllers removed because their host's keep-alive timer expired.",
            s.controllers_expired.load(Relaxed) as i64,
        ),
        (
            "nearstore_auth_failures_total",
            "counter",
            "Queues closed because their host failed in-band authentication (DH-HMAC-CHAP).",
            s.auth_failures.load(Relaxed) as i64,
        ),
        (
            "nearstore_tx_copied_bytes_total",
            "counter",
            "Read data of 32 KiB and more copied into send buffers (memory namespaces send from memory; a send cut short copies the rest of one block).",
            s.tx_copied_bytes.load(Relaxed) as i64,
        ),
        (
            "nearstore_tx_partial_writes_total",
            "counter",
            "Sends to a host's socket that it took only part of (its send buffer full).",
            s.tx_partial_writes.load(Relaxed) as i64,
        ),
        ("nearstore_buffer_bytes", "gauge", "Bytes of buffers held by all connections now.", s.buffer_bytes.load(Relaxed)),
        (
            "nearstore_connection_buffer_bytes_max",
            "gauge",
            "The most buffer bytes one connection has held (bounded as docs/protocol.md says).",
            s.connection_buffer_bytes_max.load(Relaxed) as i64,
        ),
        (
            "nearstore_connections_refused_total",
            "counter",
            "Connections closed at accept: the cap was reached, or their address held its limit of connections not yet Connected.",
            s.connections_refused.load(Relaxed) as i64,
        ),
        (
            "nearstore_connections_evicted_total",
            "counter",
            "Connections not yet Connected, closed to make room for a new one.",
            s.connections_evicted.load(Relaxed) as i64,
        ),
        (
            "nearstore_connect_timeouts_total",
            "counter",
            "Connections closed because they did not Connect in time (limits.connect_timeout_ms).",
            s.connect_timeouts.load(Relaxed) as i64,
        ),
        (
            "nearstore_controllers_refused_total",
            "counter",
            "Connects refused because the host held its limit of controllers (limits.controllers_per_host).",
            s.controllers_refused.load(Relaxed) as i64,
        ),
        (
            "nearstore_connects_refused_memory_total",
            "counter",
            "Connects refused because the memory budget (limits.memory) could not hold the queue's buffers.",
            s.connects_refused_memory.load(Relaxed) as i64,
        ),
        (
            "nearstore_connects_refused_address_total",
            "counter",
            "Connects refused because their source address held its limit of connected queues (limits.queues_per_address).",
            s.connects_refused_address.load(Relaxed) as i64,
        ),
        (
            "nearstore_requests_lost_total",
            "counter",
            "Commands dropped without a completion: a bug, always 0 (each is logged).",
            s.requests_lost.load(Relaxed) as i64,
        ),
        (
            "nearstore_requests_unfinished_total",
            "counter",
            "Commands outstanding when their connection closed (they complete nowhere).",
            s.requests_unfinished.load(Relaxed) as i64,
        ),
        ("nearstore_connections_max", "gauge", "The most connections the target accepts at once.", t.admission.cap() as i64),
        (
            "nearstore_descriptor_limit",
            "gauge",
            "The process's file descriptor limit (RLIMIT_NOFILE) the target sized itself by.",
            t.nofile as i64,
        ),
        ("nearstore_memory_budget_bytes", "gauge", "The memory budget (limits.memory).", t.memory.limit() as i64),
        (
            "nearstore_memory_reserved_bytes",
            "gauge",
            "Bytes of the budget reserved now (connection buffers, held results, started compute commands).",
            t.memory.used() as i64,
        ),
        ("nearstore_memory_reserved_bytes_max", "gauge", "The most bytes of the budget reserved at once.", t.memory.peak() as i64),
        (
            "nearstore_memory_waits_total",
            "counter",
            "Times a queue stopped reading commands until the budget could give it a buffer.",
            t.memory.waits() as i64,
        ),
    ];
    for (name, kind, help, v) in target {
        family(&mut o, name, kind, help);
        let _ = writeln!(o, "{name} {v}");
    }
    let c = &t.offload.stats;
    for (name, kind, help, v) in [
        ("nearstore_compute_commands_total", "counter", "Compute commands executed by the offload engine.", c.commands.load(Relaxed)),
        ("nearstore_compute_errors_total", "counter", "Compute commands that failed.", c.errors.load(Relaxed)),
        ("nearstore_compute_read_bytes_total", "counter", "Bytes compute commands read from namespaces.", c.bytes_read.load(Relaxed)),
        (
            "nearstore_compute_written_bytes_total",
            "counter",
            "Bytes compute commands wrote to output objects.",
            c.bytes_written.load(Relaxed),
        ),
        (
            "nearstore_compute_forwarded_total",
            "counter",
            "Compute commands on an exported volume sent to the peer whose pool holds all their bytes.",
            c.forwarded.load(Relaxed),
        ),
        (
            "nearstore_compute_on_pool_total",
            "counter",
            "Compute commands on an exported volume run on this target's pool holding all their bytes.",
            c.on_pool.load(Relaxed),
        ),
        ("nearstore_compute_running", "gauge", "Compute commands running now.", c.running.load(Relaxed)),
        ("nearstore_compute_queued", "gauge", "Compute commands waiting to start.", c.queued.load(Relaxed)),
        (
            "nearstore_compute_reads_in_flight",
            "gauge",
            "Device reads of running compute commands not yet completed.",
            c.reads_in_flight.load(Relaxed),
        ),
        (
            "nearstore_compute_rings_created_total",
            "counter",
            "io_urings made for compute commands' I/O (idle ones are reused, limits::COMPUTE_RINGS_IDLE_MAX).",
            t.offload.rings.created(),
        ),
        ("nearstore_compute_rings_idle", "gauge", "io_urings of ended compute commands kept for the next.", t.offload.rings.idle() as u64),
    ] {
        family(&mut o, name, kind, help);
        let _ = writeln!(o, "{name} {v}");
    }
    let peers = t.offload.peers.stats();
    type PeerCounter = (&'static str, &'static str, fn(&crate::cluster::PeerStats) -> &AtomicU64);
    let peer_counters: [PeerCounter; 3] = [
        ("nearstore_peer_read_bytes_total", "Bytes read from this peer of the cluster map, device to device.", |p| &p.read_bytes),
        ("nearstore_peer_failures_total", "Peer read streams that failed: refused, gone, stalled, out of range.", |p| &p.failures),
        ("nearstore_peer_connections_total", "Connections opened to this peer (idle ones are reused).", |p| &p.connections),
    ];
    for (name, help, get) in peer_counters {
        family(&mut o, name, "counter", help);
        for (tag, addr, st) in &peers {
            let _ = writeln!(o, "{name}{{tag=\"{tag}\",address=\"{addr}\"}} {}", get(st).load(Relaxed));
        }
    }
    // The volume data path's links: what this target's volumes moved to each peer's pools.
    let links = t.links.snapshot();
    type LinkCounter = (&'static str, &'static str, fn(&crate::dev::remote::LinkStats) -> u64);
    let link_counters: [LinkCounter; 6] = [
        ("nearstore_link_reads_total", "Reads of a peer's pools by this target's volumes, completed.", |l| l.reads.load(Relaxed)),
        ("nearstore_link_writes_total", "Writes to a peer's pools by this target's volumes, completed.", |l| l.writes.load(Relaxed)),
        ("nearstore_link_read_bytes_total", "Bytes this target's volumes read from a peer's pools.", |l| l.read_bytes.load(Relaxed)),
        ("nearstore_link_write_bytes_total", "Bytes this target's volumes wrote to a peer's pools.", |l| l.write_bytes.load(Relaxed)),
        ("nearstore_link_read_nanoseconds_total", "Time of those reads, submission to the peer's completion.", |l| l.read_ns.load(Relaxed)),
        ("nearstore_link_write_nanoseconds_total", "Time of those writes, submission to the peer's completion.", |l| {
            l.write_ns.load(Relaxed)
        }),
    ];
    for (name, help, get) in link_counters {
        family(&mut o, name, "counter", help);
        for (peer, l) in &links {
            let _ = writeln!(o, "{name}{{peer=\"{peer}\"}} {}", get(l));
        }
    }
    tenant_metrics(&mut o, t);
    type Counter = (&'static str, &'static str, fn(&NsStats) -> &AtomicU64);
    let counters: [Counter; 6] = [
        ("nearstore_reads_total", "Read commands completed on the namespace.", |n| &n.reads),
        ("nearstore_writes_total", "Write commands completed on the namespace.", |n| &n.writes),
        ("nearstore_read_bytes_total", "Bytes read from the namespace by hosts.", |n| &n.read_bytes),
        ("nearstore_written_bytes_total", "Bytes written to the namespace by hosts.", |n| &n.written_bytes),
        ("nearstore_other_commands_total", "Other I/O and compute commands (flush, write zeroes, dataset management, compute).", |n| {
            &n.other
        }),
        ("nearstore_io_errors_total", "I/O commands that completed with an error status.", |n| &n.errors),
    ];
    let subsystems = t.subsystems();
    for (name, help, get) in counters {
        family(&mut o, name, "counter", help);
        for sub in &subsystems {
            for ns in sub.namespaces() {
                let _ = writeln!(o, "{name}{{subnqn=\"{}\",nsid=\"{}\"}} {}", sub.nqn, ns.nsid, get(&ns.stats).load(Relaxed));
            }
        }
    }
    family(
        &mut o,
        "nearstore_io_latency_seconds",
        "histogram",
        "Latency of I/O and compute commands on the namespace, from command to completion.",
    );
    for sub in &subsystems {
        for ns in sub.namespaces() {
            histogram(&mut o, "nearstore_io_latency_seconds", &format!("subnqn=\"{}\",nsid=\"{}\"", sub.nqn, ns.nsid), &ns.stats.latency);
        }
    }
    journals(&mut o, &subsystems);
    volumes(&mut o, &subsystems);
    o
}

/// Namespaces kept offline because their MicroTx journal could not be replayed at
/// start-up, and those whose journal fences the blocks of a transaction it has not
/// finished (docs/compute-protocol.md, "The MicroTx journal"): 1 or 0 each.
fn journals(o: &mut String, subsystems: &[Arc<crate::subsystem::Subsystem>]) {
    let journaled: Vec<_> = subsystems
        .iter()
        .flat_map(|sub| sub.namespaces().into_iter().map(move |ns| (sub.nqn.clone(), ns)))
        .filter(|(_, ns)| ns.journal.is_some() || ns.offline.is_some())
        .collect();
    family(
        o,
        "nearstore_namespace_offline",
        "gauge",
        "1: the namespace serves no I/O, its MicroTx journal could not be replayed at start-up (the log says why).",
    );
    for (nqn, ns) in &journaled {
        let _ = writeln!(o, "nearstore_namespace_offline{{subnqn=\"{nqn}\",nsid=\"{}\"}} {}", ns.nsid, u8::from(ns.offline.is_some()));
    }
    family(
        o,
        "nearstore_microtx_fenced",
        "gauge",
        "1: the namespace's MicroTx journal has not finished a transaction; I/O of its blocks is refused until it has.",
    );
    for (nqn, ns) in &journaled {
        let up = ns.journal.as_ref().is_some_and(|j| j.fence().is_up());
        let _ = writeln!(o, "nearstore_microtx_fenced{{subnqn=\"{nqn}\",nsid=\"{}\"}} {}", ns.nsid, u8::from(up));
    }
    // Group commit: transactions per group is what it saves (three flushes a group).
    let committed: Vec<_> = journaled.iter().filter_map(|(nqn, ns)| Some((nqn, ns.nsid, ns.journal.as_ref()?.committed()))).collect();
    family(
        o,
        "nearstore_microtx_groups_total",
        "counter",
        "Groups of fused write transactions the MicroTx journal committed (three flushes each).",
    );
    for (nqn, nsid, (groups, _)) in &committed {
        let _ = writeln!(o, "nearstore_microtx_groups_total{{subnqn=\"{nqn}\",nsid=\"{nsid}\"}} {groups}");
    }
    family(
        o,
        "nearstore_microtx_transactions_total",
        "counter",
        "Fused write transactions the MicroTx journal committed, in all its groups.",
    );
    for (nqn, nsid, (_, txs)) in &committed {
        let _ = writeln!(o, "nearstore_microtx_transactions_total{{subnqn=\"{nqn}\",nsid=\"{nsid}\"}} {txs}");
    }
}

/// Writes one histogram's samples.
fn histogram(o: &mut String, name: &str, labels: &str, h: &Histogram) {
    let mut cum = 0;
    for (i, b) in h.buckets.iter().enumerate() {
        cum += b.load(Relaxed);
        let le = (1u64 << i) as f64 / 1e6;
        let _ = writeln!(o, "{name}_bucket{{{labels},le=\"{le}\"}} {cum}");
    }
    let _ = writeln!(o, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", h.count.load(Relaxed));
    let _ = writeln!(o, "{name}_sum{{{labels}}} {}", h.sum_us.load(Relaxed) as f64 / 1e6);
    let _ = writeln!(o, "{name}_count{{{labels}}} {}", h.count.load(Relaxed));
}

/// The mapping caches of exported volumes (dev::volume), by namespace.
fn volumes(o: &mut String, subsystems: &[Arc<crate::subsystem::Subsystem>]) {
    use crate::dev::volume::VolumeStats;
    let vols: Vec<(String, Arc<VolumeStats>)> = subsystems
        .iter()
        .flat_map(|sub| {
            sub.namespaces().into_iter().filter_map(|ns| Some((format!("subnqn=\"{}\",nsid=\"{}\"", sub.nqn, ns.nsid), ns.volume.clone()?)))
        })
        .collect();
    type Stat = fn(&VolumeStats) -> &AtomicU64;
    type VolCounter = (&'static str, &'static str, Stat);
    let counters: [VolCounter; 4] = [
        ("nearstore_volume_cache_hits_total", "Extent lookups the volume's mapping cache answered.", |v| &v.hits),
        ("nearstore_volume_cache_misses_total", "Extent lookups that asked the control plane's translation service.", |v| &v.misses),
        ("nearstore_volume_cache_coalesced_total", "Extent lookups that took the answer of a concurrent miss of the same extent.", |v| {
            &v.coalesced
        }),
        ("nearstore_volume_cache_evictions_total", "Mapping cache entries evicted to make room for another extent.", |v| &v.evictions),
    ];
    for (name, help, get) in counters {
        family(o, name, "counter", help);
        for (labels, v) in &vols {
            let _ = writeln!(o, "{name}{{{labels}}} {}", get(v).load(Relaxed));
        }
    }
    let kinds: [(&str, Stat); 4] = [
        ("timeout", |v| &v.failed_timeout),
        ("no_space", |v| &v.failed_no_space),
        ("refused", |v| &v.failed_refused),
        ("pool", |v| &v.failed_pool),
    ];
    let name = "nearstore_volume_translation_failures_total";
    family(
        o,
        name,
        "counter",
        "Misses that failed, by kind: timeout (no answer within volume.translate_timeout_ms), no_space, refused (any other control-plane error), pool (its pool device could not be opened or a new extent zeroed).",
    );
    for (labels, v) in &vols {
        for (kind, get) in kinds {
            let _ = writeln!(o, "{name}{{{labels},kind=\"{kind}\"}} {}", get(v).load(Relaxed));
        }
    }
    let name = "nearstore_volume_translate_latency_seconds";
    family(o, name, "histogram", "Time the control plane took to translate an extent on a miss (answered or timed out).");
    for (labels, v) in &vols {
        histogram(o, name, labels, &v.translate_latency);
    }
}

/// Per tenant (docs/operations.md, "Tenants"): its I/O, its compute CPU time and waits,
/// its offload memory; a tenant removed by a reload keeps its series until the target stops.
fn tenant_metrics(o: &mut String, t: &Target) {
    type TenantCounter = (&'static str, &'static str, &'static str, fn(&crate::tenant::TenantStats) -> &AtomicU64);
    let tenants = t.tenants.stats();
    let families: [TenantCounter; 17] = [
        ("nearstore_tenant_reads_total", "counter", "Read commands the tenant's controllers completed.", |s| &s.reads),
        ("nearstore_tenant_writes_total", "counter", "Write commands the tenant's controllers completed.", |s| &s.writes),
        ("nearstore_tenant_read_bytes_total", "counter", "Bytes the tenant's controllers read.", |s| &s.read_bytes),
        ("nearstore_tenant_written_bytes_total", "counter", "Bytes the tenant's controllers wrote.", |s| &s.written_bytes),
        ("nearstore_tenant_compute_commands_total", "counter", "Compute commands of the tenant the offload engine ran.", |s| {
            &s.compute_commands
        }),
        (
            "nearstore_tenant_compute_cpu_nanoseconds_total",
            "counter",
            "CPU time the tenant's compute commands used, measured on their threads (nanoseconds).",
            |s| &s.compute_cpu_ns,
        ),
        (
            "nearstore_tenant_compute_queued_nanoseconds_total",
            "counter",
            "Time the tenant's compute commands waited to start and for turns to compute (nanoseconds).",
            |s| &s.compute_queued_ns,
        ),
        ("nearstore_tenant_compute_turn_waits_total", "counter", "Times one of the tenant's compute commands waited for a turn.", |s| {
            &s.compute_turn_waits
        }),
        (
            "nearstore_tenant_offload_memory_bytes",
            "gauge",
            "Bytes the tenant's started compute commands hold now (compute.memory_per_command each).",
            |s| &s.offload_memory_bytes,
        ),
        (
            "nearstore_tenant_offload_memory_waits_total",
            "counter",
            "Compute commands of the tenant that waited to start because it held its offload_memory.",
            |s| &s.offload_memory_waits,
        ),
        ("nearstore_tenant_compute_read_bytes_total", "counter", "Bytes the tenant's compute commands read.", |s| &s.compute_read_bytes),
        ("nearstore_tenant_compute_written_bytes_total", "counter", "Bytes the tenant's compute commands wrote.", |s| {
            &s.compute_written_bytes
        }),
        (
            "nearstore_tenant_io_scheduled_bytes_total",
            "counter",
            "Bytes of the tenant's reads and writes fair-scheduled devices let go: its controllers', its compute commands', its volume operations'.",
            |s| &s.io_scheduled_bytes,
        ),
        (
            "nearstore_tenant_io_waits_total",
            "counter",
            "Times a fair-scheduled device held one of the tenant's reads or writes back for a later epoch.",
            |s| &s.io_waits,
        ),
        (
            "nearstore_tenant_io_queued_nanoseconds_total",
            "counter",
            "Time fair-scheduled devices held the tenant's reads and writes back, until the epoch each was offered again in (nanoseconds).",
            |s| &s.io_queued_ns,
        ),
        ("nearstore_tenant_io_weight", "gauge", "The tenant's io_weight as installed (0: removed).", |s| &s.io_weight),
        ("nearstore_tenant_compute_weight", "gauge", "The tenant's compute_weight as installed (0: removed).", |s| &s.compute_weight),
    ];
    for (name, kind, help, get) in families {
        family(o, name, kind, help);
        for (tenant, st) in &tenants {
            let _ = writeln!(o, "{name}{{tenant=\"{tenant}\"}} {}", get(st).load(Relaxed));
        }
    }
    family(
        o,
        "nearstore_tenants_refused",
        "gauge",
        "Tenants the control plane pushed that this target refused (a conflict with its configured tenants, or not valid here; the log says why).",
    );
    let _ = writeln!(o, "nearstore_tenants_refused {}", t.tenants.refused.load(Relaxed));
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
            // One read is enough for a GET; a slow or silent client is dropped.
            let _ = tokio::time::timeout(Duration::from_millis(crate::limits::METRICS_REQUEST_TIMEOUT_MS), sock.read(&mut req)).await;
            let body = render(&target);
            let head = format!("HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n", body.len());
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ByteSize, Config, NamespaceConfig};

    /// Every sample belongs to a family announced before it with a `# HELP` that says
    /// something and a `# TYPE`, as Prometheus' text format wants.
    #[test]
    fn every_metric_has_help_and_type() {
        let ns = NamespaceConfig {
            nsid: 1,
            path: None,
            memory: Some(ByteSize(1 << 20)),
            size: None,
            block_size: 512,
            tag: None,
            delay_us: 0,
            inject: None,
            microtx: false,
            rate_limit: None,
            fair: None,
        };
        let cfg = Config::single("127.0.0.1:0".parse().unwrap(), None, "nqn.2026-11.io.nearstore:metrics", ns);
        let text = render(&Target::from_config(&cfg).unwrap());
        let (mut helped, mut typed) = (Vec::new(), Vec::new());
        let mut samples = 0;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
                assert!(help.len() > 10, "{name}: help {help:?}");
                helped.push(name.to_string());
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let name = rest.split(' ').next().unwrap_or_default();
                assert_eq!(helped.last().map(String::as_str), Some(name), "# HELP right before # TYPE of {name}");
                typed.push(name.to_string());
            } else {
                let name = line.split(['{', ' ']).next().unwrap_or_default();
                let family =
                    ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).filter(|f| typed.iter().any(|t| t == f));
                let family = family.unwrap_or(name);
                assert!(typed.iter().any(|t| t == family), "{line}: no # TYPE for {family}");
                samples += 1;
            }
        }
        assert_eq!(helped, typed);
        assert!(helped.len() >= 21 && samples > helped.len(), "{text}");
    }
}
