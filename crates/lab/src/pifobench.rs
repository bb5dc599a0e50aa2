//! `nearstore-lab pifo-bench`: the host's PIFO against FIFO order (docs/benchmarks.md, "The
//! host's PIFO"). One host, one connection to a running target: a victim stream of 4 KiB
//! random reads at QD 1 beside a background stream of 128 KiB reads and writes at QD 32, both
//! through one `Pifo` whose lane keeps `--in-flight` commands at the target. Each round runs
//! three phases back to back: the victim alone, both in FIFO order, both in PIFO order; the
//! victim's latency percentiles and the background's bandwidth for each, and the medians
//! over the rounds.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nearstore_initiator::pifo::{LaneView, Pifo, PifoOptions, Policy};
use nearstore_initiator::{ConnectOptions, Controller};
use rand::{RngExt, SeedableRng};
use serde::Serialize;

use crate::Output;

/// Victim samples kept per phase at most (a QD 1 stream of ~50 us reads for 60 s).
const SAMPLES_MAX: usize = 2_000_000;
/// The background's request.
const BIG: usize = 128 << 10;
/// The victim's request.
const SMALL: usize = 4 << 10;

#[derive(clap::Args)]
pub struct PifoBenchArgs {
    /// The target's address (HOST:PORT).
    #[arg(short = 'a', long)]
    pub addr: std::net::SocketAddr,
    /// The subsystem.
    #[arg(short = 'n', long)]
    pub nqn: String,
    /// The namespace both streams read and write.
    #[arg(long, default_value_t = 1)]
    pub nsid: u32,
    /// Bytes of the namespace the streams use, from its start.
    #[arg(long, value_parser = crate::size, default_value = "64MiB")]
    pub span: u64,
    /// Commands the lane keeps at the target; what is beyond waits in the host's order.
    #[arg(long, default_value_t = 8)]
    pub in_flight: u16,
    /// The background's outstanding requests (half reads, half writes).
    #[arg(long, default_value_t = 32)]
    pub background_qd: u16,
    /// The pool's write cost, as the view would give it (the PIFO ranks writes by it);
    /// with `--control`, the live view's instead.
    #[arg(long, default_value_t = 1.0)]
    pub write_cost: f64,
    /// A control plane: the lane's rank follows its view of the target (`--view-target`,
    /// else `--addr`), pulled every 100 ms: its pools' write cost and queue depth.
    #[arg(long)]
    pub control: Option<std::net::SocketAddr>,
    /// The target's address as registered with the control plane.
    #[arg(long)]
    pub view_target: Option<String>,
    /// Seconds per phase.
    #[arg(short = 'T', long, default_value_t = 3.0)]
    pub seconds: f64,
    /// Rounds of the three phases (alone, fifo, pifo); medians over them.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Output format: normal (text) or json.
    #[arg(short = 'o', long, value_enum, default_value = "normal")]
    pub output_format: Output,
}

#[derive(Serialize, Clone, Debug)]
pub struct Phase {
    pub phase: &'static str,
    pub round: u32,
    pub victim_ios: usize,
    pub victim_p50_us: f64,
    pub victim_p99_us: f64,
    pub victim_p999_us: f64,
    pub background_mb_per_s: f64,
}

pub fn run(a: PifoBenchArgs) -> Result<()> {
    if !(a.seconds > 0.0 && a.seconds <= 60.0) || a.rounds == 0 || a.rounds > 100 {
        bail!("--seconds from 0 to 60 and --rounds from 1 to 100");
    }
    if a.in_flight == 0 || a.background_qd == 0 || a.background_qd > 1024 {
        bail!("--in-flight at least 1, --background-qd from 1 to 1024");
    }
    let rt = crate::runtime(Some(2))?;
    let phases = rt.block_on(async {
        let mut all = Vec::new();
        for round in 0..a.rounds {
            for (phase, policy, background) in [("alone", Policy::Pifo, false), ("fifo", Policy::Fifo, true), ("pifo", Policy::Pifo, true)]
            {
                let p = phase_run(&a, policy, background).await.with_context(|| format!("round {round}, {phase}"))?;
                all.push(Phase { phase, round, ..p });
                if a.output_format == Output::Normal {
                    let p = all.last().unwrap();
                    eprintln!(
                        "round {round} {phase:5}: victim p50 {:.0} us p99 {:.0} us p99.9 {:.0} us ({} reads); background {:.1} MB/s",
                        p.victim_p50_us, p.victim_p99_us, p.victim_p999_us, p.victim_ios, p.background_mb_per_s
                    );
                }
            }
        }
        anyhow::Ok(all)
    })?;
    let median = |phase: &str, f: fn(&Phase) -> f64| {
        let mut v: Vec<f64> = phases.iter().filter(|p| p.phase == phase).map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let summary: Vec<serde_json::Value> = ["alone", "fifo", "pifo"]
        .iter()
        .map(|ph| {
            serde_json::json!({
                "phase": ph,
                "victim_p50_us": median(ph, |p| p.victim_p50_us),
                "victim_p99_us": median(ph, |p| p.victim_p99_us),
                "background_mb_per_s": median(ph, |p| p.background_mb_per_s),
            })
        })
        .collect();
    let ratio = |ph: &str| median(ph, |p| p.victim_p99_us) / median("alone", |p| p.victim_p99_us);
    match a.output_format {
        Output::Json => println!("{}", serde_json::json!({ "rounds": phases, "medians": summary })),
        Output::Normal => {
            println!("median over {} rounds of {} s:", a.rounds, a.seconds);
            for s in &summary {
                println!(
                    "  {:5}  victim p50 {:>7.0} us  p99 {:>7.0} us   background {:>7.1} MB/s",
                    s["phase"].as_str().unwrap(),
                    s["victim_p50_us"].as_f64().unwrap(),
                    s["victim_p99_us"].as_f64().unwrap(),
                    s["background_mb_per_s"].as_f64().unwrap()
                );
            }
            println!("victim p99 against alone: fifo {:.2}x, pifo {:.2}x", ratio("fifo"), ratio("pifo"));
        }
    }
    Ok(())
}

async fn phase_run(a: &PifoBenchArgs, policy: Policy, background: bool) -> Result<Phase> {
    let mut o = ConnectOptions::new(a.addr, &a.nqn);
    o.queue_depth = a.in_flight.max(2);
    let c = Controller::connect(o).await.with_context(|| format!("connecting to {} at {}", a.nqn, a.addr))?;
    let bs = c.identify_namespace(a.nsid).await?.block_size();
    let ns_bytes = c.identify_namespace(a.nsid).await?.nsze * bs as u64;
    let span = a.span.min(ns_bytes);
    if span < BIG as u64 || bs as usize > SMALL {
        bail!("the namespace needs at least 128 KiB and blocks of at most 4 KiB");
    }
    let pifo = Pifo::new(vec![c.io_queue(1).await?], PifoOptions { policy, in_flight: a.in_flight });
    pifo.set_view(0, LaneView { write_cost: a.write_cost, queue_depth: 0.0 }).await?;
    let pifo = Arc::new(pifo);
    let follower = a.control.map(|control| {
        let target = a.view_target.clone().unwrap_or_else(|| a.addr.to_string());
        tokio::spawn(follow_view(pifo.clone(), control, target))
    });
    let stop = Arc::new(AtomicBool::new(false));
    let bytes = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    let started = Instant::now();
    if background {
        let bg = pifo.stream(100).await?;
        for w in 0..a.background_qd as u64 {
            let (bg, stop, bytes, nsid) = (bg.clone(), stop.clone(), bytes.clone(), a.nsid);
            let slots = span / BIG as u64;
            workers.push(tokio::spawn(async move {
                let mut rng = rand_xorshift::XorShiftRng::seed_from_u64(w);
                let data = vec![w as u8; BIG];
                while !stop.load(Relaxed) {
                    let slba = rng.random_range(0..slots) * (BIG / bs as usize) as u64;
                    let nlb = (BIG / bs as usize) as u32;
                    if w % 2 == 0 {
                        bg.read(0, nsid, slba, nlb, bs).await?;
                    } else {
                        bg.write(0, nsid, slba, data.clone(), bs, false).await?;
                    }
                    bytes.fetch_add(BIG as u64, Relaxed);
                }
                anyhow::Ok(())
            }));
        }
    }
    let victim = pifo.stream(100).await?;
    let deadline = started + Duration::from_secs_f64(a.seconds);
    let mut rng = rand_xorshift::XorShiftRng::seed_from_u64(7);
    let mut lat = Vec::new();
    let nlb = (SMALL / bs as usize) as u32;
    while Instant::now() < deadline && lat.len() < SAMPLES_MAX {
        let slba = rng.random_range(0..span / SMALL as u64) * nlb as u64;
        let t = Instant::now();
        victim.read(0, a.nsid, slba, nlb, bs).await.context("victim read")?;
        lat.push(t.elapsed().as_nanos() as u64);
    }
    let secs = started.elapsed().as_secs_f64();
    let moved = bytes.load(Relaxed);
    stop.store(true, Relaxed);
    for w in workers {
        w.await?.context("background")?;
    }
    drop(victim);
    if let Some(f) = follower {
        f.abort();
        let _ = f.await;
    }
    let pifo = Arc::into_inner(pifo).context("the view follower still holds the scheduler")?;
    pifo.join().await;
    c.shutdown().await.ok();
    if lat.is_empty() {
        bail!("the victim completed no read in {:.3} s", a.seconds);
    }
    lat.sort_unstable();
    let pct = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)] as f64 / 1000.0;
    Ok(Phase {
        phase: "",
        round: 0,
        victim_ios: lat.len(),
        victim_p50_us: pct(0.50),
        victim_p99_us: pct(0.99),
        victim_p999_us: pct(0.999),
        background_mb_per_s: moved as f64 / secs / 1e6,
    })
}

/// Feeds lane 0's view from the control plane's, every 100 ms, until aborted. A failed pull
/// keeps the last view (the host ranks by what it knew).
async fn follow_view(pifo: Arc<Pifo>, control: std::net::SocketAddr, target: String) {
    let client = nearstore_control::client::Client::new(control);
    loop {
        match client.view(0).await {
            Ok(v) => {
                if let Some(l) = v.load_of(&target) {
                    let _ = pifo.set_view(0, LaneView { write_cost: l.write_cost, queue_depth: l.queue_depth }).await;
                }
            }
            Err(e) => eprintln!("pifo-bench: pulling the view from {control}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
