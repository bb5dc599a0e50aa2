//! `nearstore-lab compute-load`: one tenant's compute commands in a loop against a running
//! target, as its host (scripts/exp-fair.py's compute experiment; docs/experiments.md,
//! "Experiment 5"): `--concurrency` workers, each on its own I/O queue, each sending the
//! same command over one byte range of the namespace again and again until `--seconds` or
//! `--ops`. `heavy`: sha256 over `--bytes` (a long command, many of the engine's checks);
//! `light`: grep-count and select, alternating, over a small CSV this tool writes first at
//! the range's start. `--think-ms`: a pause after each command. Prints the commands done
//! and their latency.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nearstore_initiator::{ConnectOptions, Controller};
use nearstore_wire::compute::{Descriptor, Extent, Object};

use crate::Output;

#[derive(clap::Args)]
pub struct ComputeLoadArgs {
    /// The target's address (HOST:PORT).
    #[arg(short = 'a', long)]
    pub addr: std::net::SocketAddr,
    /// The subsystem.
    #[arg(short = 'n', long)]
    pub nqn: String,
    /// The namespace the CSV is written to and computed over.
    #[arg(long, default_value_t = 1)]
    pub nsid: u32,
    /// The host NQN: whose tenant the commands are.
    #[arg(long)]
    pub hostnqn: String,
    /// heavy (sha256 over --bytes) or light (grep-count and select over a small CSV).
    #[arg(long, value_enum)]
    pub kind: Kind,
    /// The byte range's start in the namespace (a multiple of its block size).
    #[arg(long, value_parser = crate::size, default_value = "0")]
    pub offset: u64,
    /// The byte range's length: the heavy command's input, the light one's CSV.
    #[arg(long, value_parser = crate::size, default_value = "64KiB")]
    pub bytes: u64,
    /// Commands in flight at once (workers, an I/O queue each).
    #[arg(short = 'c', long, default_value_t = 1)]
    pub concurrency: u16,
    /// Commands per worker at most.
    #[arg(long, default_value_t = 1_000_000)]
    pub ops: u64,
    /// Milliseconds each worker waits after a command before its next (a tenant's think
    /// time: how much of the engine it asks for, not only how fast it is served).
    #[arg(long, default_value_t = 0)]
    pub think_ms: u64,
    /// Seconds at most (a command under way then is waited for).
    #[arg(short = 'T', long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Output format: normal (text) or json.
    #[arg(short = 'o', long, value_enum, default_value = "normal")]
    pub output_format: Output,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum Kind {
    Heavy,
    Light,
}

/// A CSV of `bytes` at most (whole lines), with a header: what the light commands read.
fn csv(bytes: usize) -> Vec<u8> {
    let mut out = b"id,level,amount\n".to_vec();
    for i in 0.. {
        let line = format!("{i},{},{}\n", if i % 7 == 0 { "ERROR" } else { "ok" }, i * 13 % 1000);
        if out.len() + line.len() > bytes {
            break;
        }
        out.extend_from_slice(line.as_bytes());
    }
    out
}

fn descriptor(op: &str, args: serde_json::Value, off: u64, len: u64) -> Result<Vec<u8>> {
    let op = nearstore_compute::by_name(op).with_context(|| format!("no operation {op}"))?.id;
    let args = if args.is_null() { Vec::new() } else { serde_json::to_vec(&args)? };
    let input = Object { len, extents: vec![Extent::data(off, len.next_multiple_of(4096))] };
    Ok(Descriptor { op, args, inputs: vec![input], outputs: vec![] }.encode())
}

pub fn run(a: ComputeLoadArgs) -> Result<()> {
    if a.concurrency == 0 || a.concurrency > 64 {
        bail!("--concurrency {}: from 1 to 64", a.concurrency);
    }
    let rt = crate::runtime(Some(2))?;
    let (lat, secs) = rt.block_on(async {
        let mut o = ConnectOptions::new(a.addr, &a.nqn);
        o.hostnqn = a.hostnqn.clone();
        o.queue_depth = 4;
        let c = Controller::connect(o).await.with_context(|| format!("connecting to {} at {} as {}", a.nqn, a.addr, a.hostnqn))?;
        let bs = c.identify_namespace(a.nsid).await?.block_size() as u64;
        if !a.offset.is_multiple_of(bs) {
            bail!("--offset {}: not a multiple of the namespace's {bs}-byte blocks", a.offset);
        }
        let commands = match a.kind {
            Kind::Heavy => vec![descriptor("sha256", serde_json::Value::Null, a.offset, a.bytes)?],
            Kind::Light => {
                let data = csv(a.bytes as usize);
                let mut blocks = data.clone();
                blocks.resize(data.len().next_multiple_of(bs as usize), b'\n');
                let mut q = c.io_queue(1).await?;
                q.write(a.nsid, a.offset / bs, &blocks, bs as u32, false).await.context("writing the CSV")?;
                let n = data.len() as u64;
                let select = serde_json::json!({ "query": "SELECT level, COUNT(*), SUM(amount) FROM s3object GROUP BY level", "format": "csv", "header": true });
                vec![
                    descriptor("grep-count", serde_json::json!({ "pattern": "ERROR" }), a.offset, n)?,
                    descriptor("select", select, a.offset, n)?,
                ]
            }
        };
        let deadline = Duration::from_secs_f64(a.seconds);
        let start = Instant::now();
        let mut tasks = Vec::new();
        for w in 0..a.concurrency {
            let mut q = c.io_queue(w + 1).await.with_context(|| format!("I/O queue {}", w + 1))?;
            let (commands, nsid, ops, think) = (commands.clone(), a.nsid, a.ops, Duration::from_millis(a.think_ms));
            tasks.push(tokio::spawn(async move {
                let mut lat = Vec::new();
                while (lat.len() as u64) < ops && start.elapsed() < deadline {
                    let d = &commands[lat.len() % commands.len()];
                    let t = Instant::now();
                    q.compute(nsid, d, Duration::from_secs(600)).await?;
                    lat.push(t.elapsed());
                    if !think.is_zero() {
                        tokio::time::sleep(think).await;
                    }
                }
                anyhow::Ok(lat)
            }));
        }
        let mut lat = Vec::new();
        for t in tasks {
            lat.extend(t.await??);
        }
        let secs = start.elapsed().as_secs_f64();
        drop(c);
        anyhow::Ok((lat, secs))
    })?;
    let mut us: Vec<f64> = lat.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    us.sort_by(f64::total_cmp);
    let pct = |p: f64| us.get(((us.len() as f64 * p) as usize).min(us.len().saturating_sub(1))).copied().unwrap_or(0.0);
    let mean = us.iter().sum::<f64>() / us.len().max(1) as f64;
    let ops = us.len();
    match a.output_format {
        Output::Json => println!(
            "{}",
            serde_json::json!({
                "kind": format!("{:?}", a.kind).to_lowercase(), "bytes": a.bytes, "concurrency": a.concurrency,
                "ops": ops, "seconds": secs, "ops_per_s": ops as f64 / secs,
                "mean_us": mean, "p50_us": pct(0.5), "p99_us": pct(0.99), "max_us": us.last().copied().unwrap_or(0.0),
            })
        ),
        Output::Normal => println!(
            "{:?} x{}: {ops} commands in {secs:.2} s; latency mean {mean:.0} us, p50 {:.0} us, p99 {:.0} us",
            a.kind,
            a.concurrency,
            pct(0.5),
            pct(0.99)
        ),
    }
    Ok(())
}
