//! `nearstore perf`: IOPS, bandwidth and latency, in the manner of spdk_nvme_perf.
//!
//! Each queue is its own connection driven by one task that keeps `queue_depth` commands
//! in flight. The submit time travels as the command's tag, so measuring latency needs no
//! per-command storage.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use hdrhistogram::Histogram;
use nearstore_initiator::{ConnectOptions, Controller, Data};
use nearstore_wire::opcode::io;
use nearstore_wire::Sqe;
use serde::Serialize;

use crate::{Output, TargetArgs};

#[derive(Clone, Copy, Debug, clap::ValueEnum, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    Read,
    Write,
    Randread,
    Randwrite,
    Rw,
    Randrw,
}

#[derive(clap::Args, Clone)]
pub struct PerfArgs {
    #[command(flatten)]
    pub t: TargetArgs,
    /// Namespace ID.
    #[arg(long, default_value_t = 1)]
    pub nsid: u32,
    /// Commands in flight per queue.
    #[arg(short = 'q', long, default_value_t = 32)]
    pub queue_depth: u16,
    /// I/O size, with or without a unit (4096, 4KiB, 128KiB). `-z` as nvme-cli's data size;
    /// `-o` is the output format on every verb.
    #[arg(short = 'z', long, default_value = "4KiB", value_parser = crate::size_usize)]
    pub io_size: usize,
    /// The access pattern.
    #[arg(short = 'w', long, value_enum, default_value = "randread")]
    pub workload: Workload,
    /// Percentage of reads in rw and randrw.
    #[arg(short = 'M', long, default_value_t = 50)]
    pub rwmixread: u8,
    /// Seconds to run (`-t` is the transport, as in nvme-cli).
    #[arg(short = 'T', long, default_value_t = 10.0)]
    pub time: f64,
    /// I/O queues (connections), each driven by its own task.
    #[arg(long, default_value_t = 1)]
    pub queues: u16,
    /// Runtime threads (default: 1 for one queue, else one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Microseconds each queue polls its socket before sleeping (0: sleep at once).
    #[arg(long, default_value_t = 200)]
    pub busy_poll_us: u64,
    /// No progress line on stderr every second.
    #[arg(long)]
    pub quiet: bool,
    /// Output format: normal (one line) or json.
    #[arg(short = 'o', long, value_enum, default_value = "normal")]
    pub output_format: Output,
}

#[derive(Clone, Debug)]
pub struct PerfParams {
    pub nsid: u32,
    pub queue_depth: u16,
    pub io_size: usize,
    pub workload: Workload,
    pub rwmixread: u8,
    pub duration: Duration,
    pub queues: u16,
    /// A line on stderr every second: IOPS and bandwidth of that second.
    pub progress: bool,
}

#[derive(Debug, Serialize)]
pub struct PerfResult {
    pub workload: Workload,
    pub io_size: usize,
    pub queue_depth: u16,
    pub queues: u16,
    pub seconds: f64,
    pub ios: u64,
    pub iops: f64,
    pub mb_per_s: f64,
    pub avg_us: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

struct QueueStats {
    ios: u64,
    hist: Histogram<u64>,
}

pub fn run(a: PerfArgs) -> Result<()> {
    let io_size = a.io_size;
    if a.rwmixread > 100 {
        bail!("--rwmixread: {} is not a percentage", a.rwmixread);
    }
    if !(a.time > 0.0 && a.time <= 3600.0) {
        bail!("--time: must be between 0 and 3600 seconds");
    }
    if a.queue_depth == 0 || a.queues == 0 {
        bail!("--queue-depth and --queues must be at least 1");
    }
    let p = PerfParams {
        nsid: a.nsid,
        queue_depth: a.queue_depth,
        io_size,
        workload: a.workload,
        rwmixread: a.rwmixread,
        duration: Duration::from_secs_f64(a.time),
        queues: a.queues,
        progress: !a.quiet,
    };
    let threads = a.threads.unwrap_or(if a.queues == 1 { 1 } else { 0 });
    let rt = crate::runtime(if threads == 0 { None } else { Some(threads) })?;
    if a.busy_poll_us > 100_000 {
        bail!("--busy-poll-us: at most 100000 (0.1 s)");
    }
    let mut o = a.t.options()?;
    o.busy_poll = Duration::from_micros(a.busy_poll_us);
    // Reads then complete with the C2HData SUCCESS flag: one PDU per read instead of two.
    o.disable_sqflow = true;
    let r = rt.block_on(measure(o, &p))?;
    print(&r, a.output_format)
}

pub fn print(r: &PerfResult, out: Output) -> Result<()> {
    if out == Output::Json {
        println!("{}", serde_json::to_string_pretty(r)?);
        return Ok(());
    }
    println!(
        "{:?} {} B QD {} x {} queue(s), {:.1} s: {:>10.0} IOPS {:>9.1} MB/s  avg {:>8.1} us  p50 {:>8.1}  p90 {:>8.1}  p99 {:>8.1}  p99.9 {:>8.1}  max {:>9.1} us",
        r.workload, r.io_size, r.queue_depth, r.queues, r.seconds, r.iops, r.mb_per_s, r.avg_us, r.p50_us, r.p90_us, r.p99_us, r.p999_us, r.max_us
    );
    Ok(())
}

pub async fn measure(mut o: ConnectOptions, p: &PerfParams) -> Result<PerfResult> {
    // A queue of N entries holds N - 1 commands.
    o.queue_depth = p.queue_depth.saturating_add(1);
    let c = Arc::new(Controller::connect(o).await.context("connecting")?);
    let ns = c.identify_namespace(p.nsid).await?;
    if ns.nsze == 0 {
        bail!("namespace {} is not active", p.nsid);
    }
    let bs = ns.block_size() as usize;
    if p.io_size == 0 || !p.io_size.is_multiple_of(bs) {
        bail!("--io-size {} is not a multiple of the {bs}-byte block size", p.io_size);
    }
    if let Some(max) = c.id.max_transfer() {
        if p.io_size > max as usize {
            bail!("--io-size {} is above the controller's {max}-byte transfer limit", p.io_size);
        }
    }
    if p.queues > c.io_queues_granted() {
        bail!("{} queues asked, the controller grants {}", p.queues, c.io_queues_granted());
    }
    let per = (p.io_size / bs) as u64;
    let slots = ns.nsze / per;
    if slots == 0 {
        bail!("namespace smaller than one I/O");
    }
    let mut tasks = Vec::new();
    // I/Os completed by all queues, for the progress line.
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let start = Instant::now();
    for qid in 1..=p.queues {
        let mut q = c.io_queue(qid).await?;
        let p = p.clone();
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds");
            let data = vec![0x5au8; p.io_size];
            let qp = q.queue();
            let epoch = Instant::now();
            let deadline = epoch + p.duration;
            let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (qid as u64) << 32;
            let mut seq = (qid as u64 - 1) * (slots / p.queues as u64);
            let mut ios = 0u64;
            loop {
                let now = Instant::now();
                while now < deadline && qp.in_flight() < p.queue_depth as usize {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let (random, read) = match p.workload {
                        Workload::Read => (false, true),
                        Workload::Write => (false, false),
                        Workload::Randread => (true, true),
                        Workload::Randwrite => (true, false),
                        Workload::Rw => (false, (rng >> 40) % 100 < p.rwmixread as u64),
                        Workload::Randrw => (true, (rng >> 40) % 100 < p.rwmixread as u64),
                    };
                    let slot = if random { rng % slots } else { seq % slots };
                    seq += 1;
                    let tag = epoch.elapsed().as_nanos() as u64;
                    let slba = slot * per;
                    if read {
                        qp.submit(Sqe::rw(io::READ, p.nsid, slba, per as u32, false), Data::In(p.io_size), tag)?;
                    } else {
                        qp.submit(Sqe::rw(io::WRITE, p.nsid, slba, per as u32, false), Data::Out(&data), tag)?;
                    }
                }
                if qp.in_flight() == 0 {
                    break;
                }
                let mut err = None;
                let before = ios;
                qp.poll(|tag, cqe, _| {
                    if !cqe.status.is_success() {
                        err = Some(cqe.status);
                    }
                    let lat = (epoch.elapsed().as_nanos() as u64).saturating_sub(tag).max(1);
                    let _ = hist.record(lat);
                    ios += 1;
                })
                .await?;
                done.fetch_add(ios - before, std::sync::atomic::Ordering::Relaxed);
                if let Some(s) = err {
                    bail!("I/O failed: {s}");
                }
            }
            Ok::<_, anyhow::Error>(QueueStats { ios, hist })
        }));
    }
    let reporter = p.progress.then(|| tokio::spawn(report_progress(done, p.io_size)));
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("bounds");
    let mut ios = 0;
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await);
    }
    if let Some(r) = reporter {
        r.abort();
    }
    for r in results {
        let s = r??;
        ios += s.ios;
        hist.add(&s.hist).expect("same bounds");
    }
    let secs = start.elapsed().as_secs_f64();
    let us = |ns: u64| ns as f64 / 1000.0;
    Ok(PerfResult {
        workload: p.workload,
        io_size: p.io_size,
        queue_depth: p.queue_depth,
        queues: p.queues,
        seconds: secs,
        ios,
        iops: ios as f64 / secs,
        mb_per_s: ios as f64 * p.io_size as f64 / secs / 1e6,
        avg_us: hist.mean() / 1000.0,
        p50_us: us(hist.value_at_quantile(0.5)),
        p90_us: us(hist.value_at_quantile(0.9)),
        p99_us: us(hist.value_at_quantile(0.99)),
        p999_us: us(hist.value_at_quantile(0.999)),
        max_us: us(hist.max()),
    })
}

/// Every second until aborted, on stderr: the seconds so far and that second's IOPS and
/// bandwidth, from the count of I/Os completed.
async fn report_progress(done: Arc<std::sync::atomic::AtomicU64>, io_size: usize) {
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    let (mut last, mut last_at) = (0u64, start);
    loop {
        tick.tick().await;
        let (n, now) = (done.load(std::sync::atomic::Ordering::Relaxed), Instant::now());
        let secs = now.duration_since(last_at).as_secs_f64().max(1e-9);
        let iops = (n - last) as f64 / secs;
        eprintln!("perf: {:>4.0} s {iops:>10.0} IOPS {:>9.1} MB/s", now.duration_since(start).as_secs_f64(), iops * io_size as f64 / 1e6);
        (last, last_at) = (n, now);
    }
}
