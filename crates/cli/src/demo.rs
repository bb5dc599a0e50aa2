//! `nearstore demo`: the main job at this stage. A target exports a sparse file, our
//! initiator writes data through NVMe/TCP and reads it back, and a short perf runs.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use nearstore_initiator::{ConnectOptions, Controller, Data};
use nearstore_target::config::Config;
use nearstore_target::Target;
use nearstore_wire::opcode::io;
use nearstore_wire::Sqe;

use crate::perf::{self, PerfParams, Workload};
use crate::Output;

#[derive(clap::Args, Clone)]
pub struct DemoArgs {
    /// Seconds of each perf run.
    #[arg(long, default_value_t = 2.0)]
    pub perf_seconds: f64,
    /// Bytes to write and read back.
    #[arg(long, default_value_t = 64 << 20)]
    pub bytes: usize,
}

const NQN: &str = "nqn.2026-11.io.nearstore:demo";

pub fn run(a: DemoArgs) -> Result<()> {
    crate::runtime(None)?.block_on(demo(a))
}

async fn demo(a: DemoArgs) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let img = dir.path().join("disk.img");
    let cfg = Config::from_toml(&format!(
        r#"
        [[listener]]
        address = "127.0.0.1:0"
        [[subsystem]]
        nqn = "{NQN}"
        allow_any_host = true
        [[subsystem.namespace]]
        nsid = 1
        path = "{}"
        size = "1GiB"
        [[subsystem.namespace]]
        nsid = 2
        memory = "1GiB"
        "#,
        img.display()
    ))?;
    let target = Target::from_config(&cfg)?;
    let addr = target.listen("127.0.0.1:0".parse()?, false).await?;
    println!("1. target listening on {addr}, subsystem {NQN}");
    println!("   namespace 1: sparse file {} (1 GiB), namespace 2: 1 GiB of memory", img.display());

    let mut o = ConnectOptions::new(addr, NQN);
    o.queue_depth = 32;
    let c = Controller::connect(o.clone()).await?;
    println!("2. connected: controller {} \"{}\" serial {}, namespaces {:?}", c.cntlid, c.id.mn, c.id.sn, c.active_namespaces().await?);

    let mut ioq = c.io_queue(1).await?;
    let q = ioq.queue();
    let chunk = 128 * 1024;
    let blocks = (chunk / 512) as u32;
    let n = a.bytes.div_ceil(chunk);
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let data: Vec<u8> = (0..n * chunk)
        .map(|_| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng as u8
        })
        .collect();
    let t = Instant::now();
    let (mut sub, mut done) = (0usize, 0usize);
    while done < n {
        while sub < n && q.in_flight() < 32 {
            q.submit(
                Sqe::rw(io::WRITE, 1, (sub * chunk / 512) as u64, blocks, false),
                Data::Out(&data[sub * chunk..(sub + 1) * chunk]),
                sub as u64,
            )?;
            sub += 1;
        }
        let mut failed = None;
        q.poll(|_, cqe, _| {
            if !cqe.status.is_success() {
                failed = Some(cqe.status);
            }
            done += 1;
        })
        .await?;
        if let Some(s) = failed {
            bail!("write failed: {s}");
        }
    }
    ioq.flush(1).await?;
    let wt = t.elapsed();
    let q = ioq.queue();
    let t = Instant::now();
    let mut back = vec![0u8; n * chunk];
    let (mut sub, mut done) = (0usize, 0usize);
    while done < n {
        while sub < n && q.in_flight() < 32 {
            q.submit(Sqe::rw(io::READ, 1, (sub * chunk / 512) as u64, blocks, false), Data::In(chunk), sub as u64)?;
            sub += 1;
        }
        q.poll(|tag, _, d| {
            back[tag as usize * chunk..(tag as usize + 1) * chunk].copy_from_slice(d);
            done += 1;
        })
        .await?;
    }
    let rt = t.elapsed();
    let mb = (n * chunk) as f64 / 1e6;
    let same = back == data;
    println!(
        "3. wrote {mb:.0} MB in {:.2} s ({:.0} MB/s), flushed, read back in {:.2} s ({:.0} MB/s): {}",
        wt.as_secs_f64(),
        mb / wt.as_secs_f64(),
        rt.as_secs_f64(),
        mb / rt.as_secs_f64(),
        if same { "identical" } else { "DIFFERENT" }
    );
    if !same {
        bail!("data read back differs from data written");
    }
    let file_crc = std::fs::read(&img).map(|b| b[..n * chunk] == data[..])?;
    println!("   the image file on the target's side holds the same bytes: {file_crc}");
    drop(ioq);
    c.shutdown().await?;

    println!("4. perf, {} s each, target and initiator in this process:", a.perf_seconds);
    for (nsid, what) in [(1u32, "file  "), (2, "memory")] {
        for (w, size, qd) in [
            (Workload::Randread, 4096, 1),
            (Workload::Randread, 4096, 32),
            (Workload::Randwrite, 4096, 32),
            (Workload::Read, 128 * 1024, 32),
        ] {
            let p = PerfParams {
                nsid,
                queue_depth: qd,
                io_size: size,
                workload: w,
                rwmixread: 50,
                duration: Duration::from_secs_f64(a.perf_seconds),
                queues: 1,
            };
            let r = perf::measure(o.clone(), &p).await?;
            print!("   {what} ");
            perf::print(&r, Output::Normal)?;
        }
    }
    println!("done: the target served {} connections", target.stats.connections_total.load(std::sync::atomic::Ordering::Relaxed));
    Ok(())
}
