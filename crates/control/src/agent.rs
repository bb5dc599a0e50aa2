//! A target's view agent (Flint's shadow views): it registers the target and its pools with
//! the control plane, then samples each pool every VIEW_SAMPLE_MS and pushes the pool's
//! figures when one moved by VIEW_CHANGE_PERCENT, and at least every VIEW_PUSH_INTERVAL_MS.
//! It runs as one task on the target's runtime; its only blocking call (statvfs) goes to the
//! blocking pool. The figures come from each pool's [`PoolStats`], which the volume data path
//! counts into. It samples and pushes each link of the target (what its volumes moved to and
//! from another target's pools) the same way, from the counters [`Agent::attach_links`] gives.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use crate::client::{Client, ClientError};
use crate::limits::*;
use crate::model::*;

/// Where a pool's counters come from when the data path keeps them itself (a target's pool
/// namespace): read at every sample.
pub type CounterSource = Box<dyn Fn() -> Counters + Send + Sync>;

/// Counters of one pool's I/O: the data path adds (or is attached as the
/// [`source`](PoolStats::attach)), the agent reads.
#[derive(Default)]
pub struct PoolStats {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub read_bytes: AtomicU64,
    pub write_bytes: AtomicU64,
    /// Nanoseconds from submission to completion, summed.
    pub read_ns: AtomicU64,
    pub write_ns: AtomicU64,
    source: std::sync::OnceLock<CounterSource>,
}

impl std::fmt::Debug for PoolStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolStats").field("counters", &self.snapshot()).field("attached", &self.source.get().is_some()).finish()
    }
}

impl PoolStats {
    pub fn read_done(&self, bytes: u64, ns: u64) {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.read_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.read_ns.fetch_add(ns, Ordering::Relaxed);
    }

    pub fn write_done(&self, bytes: u64, ns: u64) {
        self.writes.fetch_add(1, Ordering::Relaxed);
        self.write_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.write_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Takes the counters from `source` from now on (once; false if one is attached
    /// already). What was added before is added to them.
    pub fn attach(&self, source: CounterSource) -> bool {
        self.source.set(source).is_ok()
    }

    pub fn snapshot(&self) -> Counters {
        let own = self.own();
        let Some(s) = self.source.get() else { return own };
        let c = s();
        Counters {
            reads: c.reads + own.reads,
            writes: c.writes + own.writes,
            read_bytes: c.read_bytes + own.read_bytes,
            write_bytes: c.write_bytes + own.write_bytes,
            read_ns: c.read_ns + own.read_ns,
            write_ns: c.write_ns + own.write_ns,
        }
    }

    fn own(&self) -> Counters {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counters {
            reads: l(&self.reads),
            writes: l(&self.writes),
            read_bytes: l(&self.read_bytes),
            write_bytes: l(&self.write_bytes),
            read_ns: l(&self.read_ns),
            write_ns: l(&self.write_ns),
        }
    }
}

/// The counters at one instant.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Counters {
    pub reads: u64,
    pub writes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub read_ns: u64,
    pub write_ns: u64,
}

/// Turns successive counters into EWMA figures.
#[derive(Debug, Default, Clone)]
pub struct Sampler {
    last: Option<Counters>,
    /// Intervals measured so far: the first one is taken as it is.
    intervals: u64,
    figures: Figures,
}

fn ewma(old: f64, sample: f64, first: bool) -> f64 {
    if first {
        sample
    } else {
        old + (sample - old) * VIEW_EWMA_PERCENT as f64 / 100.0
    }
}

impl Sampler {
    /// Takes the counters `elapsed_ms` after the previous ones. Latency and write cost keep
    /// their last value over an interval without operations of their kind (nothing was
    /// measured); rates and queue depth fall towards 0.
    pub fn sample(&mut self, now: Counters, elapsed_ms: u64, fs_free_bytes: u64) -> &Figures {
        let f = &mut self.figures;
        f.fs_free_bytes = fs_free_bytes;
        if let Some(last) = self.last.filter(|_| elapsed_ms > 0) {
            let first = self.intervals == 0;
            self.intervals += 1;
            let secs = elapsed_ms as f64 / 1000.0;
            let d = |a: u64, b: u64| a.saturating_sub(b) as f64;
            let (reads, writes) = (d(now.reads, last.reads), d(now.writes, last.writes));
            let (rb, wb) = (d(now.read_bytes, last.read_bytes), d(now.write_bytes, last.write_bytes));
            let (rns, wns) = (d(now.read_ns, last.read_ns), d(now.write_ns, last.write_ns));
            f.read_iops = ewma(f.read_iops, reads / secs, first);
            f.write_iops = ewma(f.write_iops, writes / secs, first);
            f.read_bps = ewma(f.read_bps, rb / secs, first);
            f.write_bps = ewma(f.write_bps, wb / secs, first);
            // Little's law: operations in flight on average = their busy time / the interval.
            f.queue_depth = ewma(f.queue_depth, (rns + wns) / (secs * 1e9), first);
            if reads > 0.0 {
                f.read_latency_us = ewma(f.read_latency_us, rns / reads / 1000.0, f.read_latency_us == 0.0);
            }
            if writes > 0.0 {
                f.write_latency_us = ewma(f.write_latency_us, wns / writes / 1000.0, f.write_latency_us == 0.0);
            }
            if wb > 0.0 {
                let cost = (wns / 1000.0) / (wb / (1u64 << 20) as f64);
                f.write_cost_us_per_mib = ewma(f.write_cost_us_per_mib, cost, f.write_cost_us_per_mib == 0.0);
            }
        }
        self.last = Some(now);
        &self.figures
    }
}

/// Whether `now` differs from what was last pushed enough to push it before the interval:
/// a figure moved by more than VIEW_CHANGE_PERCENT of the larger of its old value and a floor
/// (so that noise around zero pushes nothing).
pub fn changed(last: &Figures, now: &Figures) -> bool {
    let moved = |a: f64, b: f64, floor: f64| (b - a).abs() * 100.0 > VIEW_CHANGE_PERCENT as f64 * a.abs().max(floor);
    const MIB: f64 = (1u64 << 20) as f64;
    moved(last.fs_free_bytes as f64, now.fs_free_bytes as f64, 64.0 * MIB)
        || moved(last.read_bps, now.read_bps, MIB)
        || moved(last.write_bps, now.write_bps, MIB)
        || moved(last.read_iops, now.read_iops, 100.0)
        || moved(last.write_iops, now.write_iops, 100.0)
        || moved(last.read_latency_us, now.read_latency_us, 10.0)
        || moved(last.write_latency_us, now.write_latency_us, 10.0)
        || moved(last.queue_depth, now.queue_depth, 1.0)
        || moved(last.write_cost_us_per_mib, now.write_cost_us_per_mib, 1000.0)
}

/// A pool of this target: its name, file and size, and its counters.
#[derive(Debug, Clone)]
pub struct AgentPool {
    pub name: String,
    pub path: PathBuf,
    pub size: u64,
    /// Its namespace in the target's pool subsystem.
    pub nsid: u32,
    /// Bytes per second it serves (its `fair` bandwidth; 0: not declared), and a written
    /// byte's cost there: what the arbiter divides.
    pub bandwidth: u64,
    pub write_cost: f64,
    pub stats: Arc<PoolStats>,
}

/// Makes a pool's file, or checks an existing one: a regular file is extended to `size`
/// (sparse), never truncated (it may hold extents); a block device is taken as it is, if
/// large enough.
pub fn prepare_pool(path: &Path, size: u64) -> anyhow::Result<()> {
    use anyhow::Context;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .with_context(|| format!("pool {}", path.display()))?;
    let meta = f.metadata().with_context(|| format!("pool {}", path.display()))?;
    use std::os::unix::fs::FileTypeExt;
    if meta.file_type().is_block_device() {
        anyhow::bail!("pool {}: block devices as pools come next; give a file", path.display());
    }
    if !meta.is_file() {
        anyhow::bail!("pool {} is not a regular file", path.display());
    }
    if meta.len() > size {
        anyhow::bail!(
            "pool {} has {} bytes, more than the {size} given: it would lose extents (give its size or more)",
            path.display(),
            meta.len()
        );
    }
    if meta.len() < size {
        f.set_len(size).with_context(|| format!("sizing pool {} to {size} bytes", path.display()))?;
    }
    Ok(())
}

/// Free bytes of the file system holding `path` (statvfs).
pub fn fs_free(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a NUL-terminated path and st a statvfs the call fills.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// The agent of one target.
pub struct Agent {
    pub client: Client,
    pub addr: String,
    pub nqn: String,
    pub pools: Vec<AgentPool>,
    /// This target's links to the others (their addresses as registered) and their
    /// counters, read at every sample ([`Agent::attach_links`]).
    pub links: std::sync::OnceLock<LinkSource>,
    /// How long the volumes' pool writes this target issued may land after it stops
    /// issuing them, in milliseconds (0: the control plane's default).
    pub write_bound_ms: u64,
    /// This process, as the target registers it ([`crate::model::Target::incarnation`]).
    pub incarnation: u64,
}

/// Every link's counters at one instant: (peer target's address, counters).
pub type LinkSource = Box<dyn Fn() -> Vec<(String, Counters)> + Send + Sync>;

/// One link as the agent samples and pushes it.
#[derive(Default)]
struct LinkState {
    sampler: Sampler,
    /// When it was last sampled: its rates are over its own interval.
    sampled: Option<tokio::time::Instant>,
    pushed: Option<Pushed>,
    seq: u64,
    /// No push before this: the control plane does not know the peer (it left the cluster).
    quiet_until: Option<tokio::time::Instant>,
}

struct Pushed {
    figures: Figures,
    at: tokio::time::Instant,
}

/// Whether `figures` are due to be pushed at `now`: never pushed, not pushed for
/// VIEW_PUSH_INTERVAL_MS, or [`changed`] since.
fn due(pushed: Option<&Pushed>, figures: &Figures, now: tokio::time::Instant) -> bool {
    pushed.is_none_or(|last| now.duration_since(last.at) >= Duration::from_millis(VIEW_PUSH_INTERVAL_MS) || changed(&last.figures, figures))
}

impl Agent {
    /// Takes the links' counters from `source` from now on (once; false if attached already).
    pub fn attach_links(&self, source: LinkSource) -> bool {
        self.links.set(source).is_ok()
    }

    /// Samples every link and pushes the views that are due (changed, or not pushed for
    /// VIEW_PUSH_INTERVAL_MS). A link's seq is at least the wall clock's milliseconds, so a
    /// restarted agent's pushes are above its previous life's. Failures wait for the next
    /// sample.
    async fn push_links(&self, links: &mut HashMap<String, LinkState>) {
        let Some(source) = self.links.get() else { return };
        for (peer, counters) in source() {
            let now = tokio::time::Instant::now();
            let l = links.entry(peer.clone()).or_default();
            let elapsed = l.sampled.map_or(0, |t| now.duration_since(t).as_millis() as u64);
            l.sampled = Some(now);
            let figures = l.sampler.sample(counters, elapsed, 0).clone();
            if !due(l.pushed.as_ref(), &figures, now) || l.quiet_until.is_some_and(|t| now < t) {
                continue;
            }
            let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
            let seq = (l.seq + 1).max(wall);
            match self.client.push_link_view(&self.addr, &peer, &ViewPush { seq, figures: figures.clone() }).await {
                Ok(_) => {
                    l.seq = seq;
                    l.pushed = Some(Pushed { figures, at: now });
                }
                Err(ClientError::Api(e)) if e.code == ErrorCode::StaleView => l.seq = seq,
                Err(ClientError::Api(e)) if e.code == ErrorCode::TargetNotFound => {
                    // A peer no longer registered (or this target not yet): once per interval.
                    l.quiet_until = Some(now + Duration::from_millis(VIEW_PUSH_INTERVAL_MS));
                    tracing::debug!(peer = %peer, error = %e, "link view refused: a target is not registered");
                }
                Err(e) => warn!(peer = %peer, error = %e, "link view push failed; retrying at the next sample"),
            }
        }
    }

    fn registration(&self) -> RegisterTarget {
        RegisterTarget {
            addr: self.addr.clone(),
            nqn: self.nqn.clone(),
            pools: self
                .pools
                .iter()
                .map(|p| PoolSpec {
                    name: p.name.clone(),
                    path: p.path.display().to_string(),
                    size: p.size,
                    nsid: p.nsid,
                    bandwidth: p.bandwidth,
                    write_cost: p.write_cost,
                })
                .collect(),
            write_bound_ms: self.write_bound_ms,
            incarnation: self.incarnation,
        }
    }

    /// Registers until it succeeds (a control plane may start after its targets); returns
    /// the last seq of each pool's view.
    async fn register(&self) -> Vec<u64> {
        let mut wait = 100;
        loop {
            match self.client.register(&self.registration()).await {
                Ok(r) => {
                    info!(control = %self.client.addr, pools = self.pools.len(), "registered with the control plane");
                    return self.pools.iter().map(|p| r.pools.iter().find(|q| q.name == p.name).map_or(0, |q| q.seq)).collect();
                }
                Err(e) => warn!(control = %self.client.addr, error = %e, "cannot register with the control plane; retrying"),
            }
            tokio::time::sleep(Duration::from_millis(wait)).await;
            wait = (wait * 2).min(AGENT_RETRY_MS_MAX);
        }
    }

    /// Runs forever: register, then sample and push. A control plane that forgot a pool
    /// (PoolNotFound) is registered with again.
    pub async fn run(self) {
        let mut samplers = vec![Sampler::default(); self.pools.len()];
        let mut links = HashMap::new();
        'register: loop {
            let seqs = self.register().await;
            let start = tokio::time::Instant::now();
            let mut pushed: Vec<Option<Pushed>> = self.pools.iter().map(|_| None).collect();
            let mut last_seq = seqs;
            let mut last_sample = start;
            loop {
                let now = tokio::time::Instant::now();
                let elapsed = now.duration_since(last_sample).as_millis() as u64;
                last_sample = now;
                for (i, p) in self.pools.iter().enumerate() {
                    let path = p.path.clone();
                    let free = match tokio::task::spawn_blocking(move || fs_free(&path)).await {
                        Ok(Ok(f)) => f,
                        Ok(Err(e)) => {
                            warn!(pool = %p.name, error = %e, "statvfs failed");
                            0
                        }
                        Err(_) => 0,
                    };
                    let figures = samplers[i].sample(p.stats.snapshot(), elapsed, free).clone();
                    if !due(pushed[i].as_ref(), &figures, now) {
                        continue;
                    }
                    let seq = last_seq[i] + 1;
                    let id = PoolId { target: self.addr.clone(), name: p.name.clone() };
                    match self.client.push_view(&id, &ViewPush { seq, figures: figures.clone() }).await {
                        Ok(_) => {
                            last_seq[i] = seq;
                            pushed[i] = Some(Pushed { figures, at: now });
                        }
                        Err(ClientError::Api(e)) if e.code == ErrorCode::PoolNotFound => {
                            warn!(pool = %p.name, "the control plane does not know this pool; registering again");
                            continue 'register;
                        }
                        Err(ClientError::Api(e)) if e.code == ErrorCode::StaleView => {
                            // Another agent of this pool pushed above us (a restart raced);
                            // go on above what we tried.
                            last_seq[i] = seq;
                        }
                        Err(e) => warn!(pool = %p.name, error = %e, "view push failed; retrying at the next sample"),
                    }
                }
                self.push_links(&mut links).await;
                tokio::time::sleep(Duration::from_millis(VIEW_SAMPLE_MS)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// (read iops, write bps, read latency us, queue depth, write cost us/MiB).
    type Expected = (f64, f64, f64, f64, f64);

    /// Counters sampled one second apart, and the figures after each.
    #[test]
    fn samples_become_ewmas() {
        let c = |reads, writes, wbytes, rns, wns| Counters {
            reads,
            writes,
            read_bytes: reads * 4096,
            write_bytes: wbytes,
            read_ns: rns,
            write_ns: wns,
        };
        #[rustfmt::skip]
        let steps: &[(Counters, Expected)] = &[
            // The first sample has nothing to compare with.
            (c(0, 0, 0, 0, 0), (0.0, 0.0, 0.0, 0.0, 0.0)),
            // 1000 reads of 100 us, 10 writes of 1 MiB taking 2 ms each: taken as they are.
            (c(1000, 10, 10 * MIB, 100_000_000, 20_000_000), (1000.0, 10.0 * MIB as f64, 100.0, 0.12, 2000.0)),
            // An idle second: rates and depth fall by 30%, latency and cost are kept.
            (c(1000, 10, 10 * MIB, 100_000_000, 20_000_000), (700.0, 7.0 * MIB as f64, 100.0, 0.084, 2000.0)),
            // 2000 reads of 200 us: 700 + 0.3 * (2000 - 700) = 1090; 100 + 0.3 * 100 = 130.
            (c(3000, 10, 10 * MIB, 500_000_000, 20_000_000), (1090.0, 4.9 * MIB as f64, 130.0, 0.1788, 2000.0)),
        ];
        let mut s = Sampler::default();
        for (i, (counters, expected)) in steps.iter().enumerate() {
            let f = s.sample(*counters, 1000, 7).clone();
            let got = (f.read_iops, f.write_bps, f.read_latency_us, f.queue_depth, f.write_cost_us_per_mib);
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
            assert!(
                close(got.0, expected.0)
                    && close(got.1, expected.1)
                    && close(got.2, expected.2)
                    && close(got.3, expected.3)
                    && close(got.4, expected.4),
                "step {i}: {got:?} != {expected:?}"
            );
            assert_eq!(f.fs_free_bytes, 7);
        }
    }

    #[test]
    fn an_attached_source_adds_to_the_counters() {
        let s = PoolStats::default();
        s.read_done(4096, 1000);
        assert_eq!(s.snapshot(), Counters { reads: 1, read_bytes: 4096, read_ns: 1000, ..Counters::default() });
        let source = Counters { reads: 10, writes: 2, read_bytes: 40960, write_bytes: 8192, read_ns: 5000, write_ns: 7000 };
        assert!(s.attach(Box::new(move || source)));
        assert!(!s.attach(Box::new(Counters::default)), "attached once");
        assert_eq!(s.snapshot(), Counters { reads: 11, read_bytes: 45056, read_ns: 6000, ..source });
    }

    #[test]
    fn pushes_only_on_a_real_change() {
        let base = Figures { fs_free_bytes: 10 << 30, read_bps: 100.0 * MIB as f64, queue_depth: 0.2, ..Figures::default() };
        #[rustfmt::skip]
        let cases: &[(Figures, bool)] = &[
            (base.clone(), false),
            // 5% more bandwidth: no; 20% more: yes.
            (Figures { read_bps: 105.0 * MIB as f64, ..base.clone() }, false),
            (Figures { read_bps: 120.0 * MIB as f64, ..base.clone() }, true),
            // Queue depth 0.2 to 0.25: under the floor of 1, no; to 2: yes.
            (Figures { queue_depth: 0.25, ..base.clone() }, false),
            (Figures { queue_depth: 2.0, ..base.clone() }, true),
            // Write cost from nothing to 50 us/MiB: under its floor; to 500: yes.
            (Figures { write_cost_us_per_mib: 50.0, ..base.clone() }, false),
            (Figures { write_cost_us_per_mib: 500.0, ..base.clone() }, true),
            // Free space down 2 GiB of 10: yes; 100 MiB: no.
            (Figures { fs_free_bytes: 8 << 30, ..base.clone() }, true),
            (Figures { fs_free_bytes: (10 << 30) - 100 * MIB, ..base.clone() }, false),
        ];
        for (now, expected) in cases {
            assert_eq!(changed(&base, now), *expected, "{now:?}");
        }
    }

    #[test]
    fn pools_are_made_grown_never_shrunk() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("pool");
        prepare_pool(&p, 4 * MIB).expect("make");
        assert_eq!(std::fs::metadata(&p).expect("meta").len(), 4 * MIB);
        prepare_pool(&p, 8 * MIB).expect("grow");
        assert_eq!(std::fs::metadata(&p).expect("meta").len(), 8 * MIB);
        let e = prepare_pool(&p, 2 * MIB).expect_err("shrink");
        assert!(e.to_string().contains("would lose extents"), "{e}");
        assert!(prepare_pool(dir.path(), MIB).is_err(), "a directory is no pool");
        assert!(prepare_pool(&dir.path().join("missing/pool"), MIB).is_err());
        assert!(fs_free(dir.path()).expect("statvfs") > 0);
    }
}
