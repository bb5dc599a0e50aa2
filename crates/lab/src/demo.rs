//! `nearstore-lab demo`: the main job, shown. A real ext4 file system on a loop device, whose image a
//! target exports over NVMe/TCP; a sample data set (logs and CSV) written through the file
//! system; then checksums, grep, wc and SQL queries run offloaded (the target computes, a few bytes
//! cross the network), pulled (the blocks cross the network, the host computes) and
//! locally (through the file system), with a table of time, bytes over the network and
//! whether the results are equal.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use nearstore_host::device::{DeviceMap, Endpoint};
use nearstore_host::{Host, Mode};
use nearstore_target::config::Config;
use nearstore_target::subsystem::Namespace;
use nearstore_target::Target;

#[derive(clap::Args, Clone)]
pub struct DemoArgs {
    /// Files of each kind (logs, CSV).
    #[arg(long, default_value_t = 16)]
    pub files: usize,
    /// Bytes per file, with or without a unit (8MiB, 8388608).
    #[arg(long, default_value = "8MiB", value_parser = crate::size_usize)]
    pub file_size: usize,
    /// Also print throughputs and each kernel's in-memory limit on all cores (the
    /// benchmark of docs/benchmarks.md runs this with 4 GiB of files).
    #[arg(long)]
    pub bench: bool,
    /// With --bench: runs of each measurement; the table shows medians.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub runs: u32,
}

/// The engine alone: the target's compute engine run in this process over the same
/// objects, on all its workers, with no protocol and no network: what the target does
/// reading its backend and computing. Seconds for the whole set.
async fn engine_time(
    target: &Target,
    devices: &DeviceMap,
    op: &'static nearstore_compute::Operation,
    args: &[u8],
    files: &[PathBuf],
) -> Result<f64> {
    use nearstore_host::object::{map_file, Mapped};
    let ns = target.subsystem(NQN).and_then(|s| s.namespace(1)).context("the demo namespace")?;
    let mut objects = Vec::new();
    for f in files {
        match map_file(f, devices)? {
            Mapped::Offload(fo) => objects.push(fo.object),
            Mapped::Local { reason, .. } => bail!("{} does not offload: {reason}", f.display()),
        }
    }
    // Batched as the host batches them.
    let per = if matches!(op.build, nearstore_compute::Build::Either { .. }) { 1 } else { 16 };
    let descs: Vec<Vec<u8>> = objects
        .chunks(per)
        .map(|c| nearstore_wire::compute::Descriptor { op: op.id, args: args.to_vec(), inputs: c.to_vec(), outputs: vec![] }.encode())
        .collect();
    engine_seconds(ns, target.offload.cfg.clone(), target.io_engine, target.pool.clone(), descs).await
}

/// Runs `descs` on namespace `ns` with the engine alone, `cfg.threads` at a time, on
/// threads of the blocking pool: the engine's reads run as tasks on this runtime, as on a
/// target's, and a worker of it waiting for the engine would hold them up (on a
/// current-thread runtime, forever). Seconds for all of them.
async fn engine_seconds(
    ns: Arc<Namespace>,
    cfg: nearstore_target::offload::ComputeConfig,
    engine: nearstore_target::config::IoEngine,
    pool: nearstore_target::io_pool::IoPool,
    descs: Vec<Vec<u8>>,
) -> Result<f64> {
    let io = nearstore_target::offload::IoContext::new(tokio::runtime::Handle::current(), engine, pool);
    tokio::task::spawn_blocking(move || {
        let next = std::sync::atomic::AtomicUsize::new(0);
        let t = Instant::now();
        std::thread::scope(|s| -> Result<()> {
            let workers: Vec<_> = (0..cfg.threads)
                .map(|_| {
                    s.spawn(|| -> Result<()> {
                        while let Some(d) = descs.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
                            nearstore_target::offload::execute_here(&ns, d, &cfg, &io).map_err(|f| anyhow::anyhow!("{}", f.message))?;
                        }
                        Ok(())
                    })
                })
                .collect();
            workers.into_iter().try_for_each(|w| w.join().expect("engine thread"))
        })?;
        Ok(t.elapsed().as_secs_f64())
    })
    .await
    .context("the engine's threads")?
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// An operation's speed over bytes already in memory, on every core at once: what the
/// target could reach if reading its backend cost nothing. Bytes per second.
fn kernel_limit(op: &'static nearstore_compute::Operation, args: &[u8], sample: &[u8]) -> f64 {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let rounds = 8;
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..cores {
            s.spawn(|| {
                let b = match op.build {
                    nearstore_compute::Build::Stream(b) | nearstore_compute::Build::Either { stream: b, .. } => b,
                    nearstore_compute::Build::Transform { .. } => return,
                };
                for _ in 0..rounds {
                    let mut k = b(args, &nearstore_compute::Context::default()).expect("valid arguments");
                    for c in sample.chunks(1 << 20) {
                        k.update(c);
                    }
                    k.finish().expect("the sample computes");
                }
            });
        }
    });
    (cores * rounds * sample.len()) as f64 / t.elapsed().as_secs_f64()
}

const NQN: &str = "nqn.2026-11.io.nearstore:demo";

/// The loop device and mount, undone on drop even after an error.
struct Mounted {
    dev: String,
    mnt: PathBuf,
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mnt).status();
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
    }
}

/// Runs a tool; its trimmed stdout, or an error with its stderr.
pub(crate) fn sh(cmd: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(cmd).args(args).output().with_context(|| format!("running {cmd} (install it: scripts/prereqs.sh does)"))?;
    if !out.status.success() {
        bail!("{cmd} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Log lines and CSV rows, deterministic.
pub fn write_sample(dir: &Path, files: usize, size: usize) -> Result<Vec<PathBuf>> {
    let levels = ["INFO", "INFO", "INFO", "WARN", "ERROR", "DEBUG"];
    let msgs = ["request served", "cache miss", "timeout talking to peer", "disk latency high", "checksum verified", "retrying write"];
    let cities = ["Lisbon", "Oslo", "Lima", "Osaka", "Accra", "Quito"];
    let mut out = Vec::new();
    let mut s: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut rnd = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    for i in 0..files {
        let p = dir.join(format!("app-{i:03}.log"));
        let mut w = std::io::BufWriter::new(std::fs::File::create(&p)?);
        let mut n = 0;
        let mut t = 1_700_000_000u64 + i as u64 * 86_400;
        while n < size {
            t += rnd() % 3;
            let line = format!("{t} {} [worker-{}] {}\n", levels[(rnd() % 6) as usize], rnd() % 16, msgs[(rnd() % 6) as usize]);
            w.write_all(line.as_bytes())?;
            n += line.len();
        }
        w.flush()?;
        out.push(p);
        let p = dir.join(format!("orders-{i:03}.csv"));
        let mut w = std::io::BufWriter::new(std::fs::File::create(&p)?);
        let mut n = w.write(b"id,city,amount,quantity\n")?;
        let mut id = i as u64 * 10_000_000;
        while n < size {
            id += 1;
            let line = format!("{id},{},{}.{:02},{}\n", cities[(rnd() % 6) as usize], rnd() % 1000, rnd() % 100, rnd() % 20);
            w.write_all(line.as_bytes())?;
            n += line.len();
        }
        w.flush()?;
        out.push(p);
    }
    Ok(out)
}

pub fn run(a: DemoArgs) -> Result<()> {
    crate::runtime(None)?.block_on(demo(a))
}

async fn demo(a: DemoArgs) -> Result<()> {
    if unsafe { libc::geteuid() } != 0 {
        bail!("the demo makes a loop device and mounts it: run it as root (sudo scripts/demo.sh)");
    }
    let dir = tempfile::tempdir()?;
    let image = dir.path().join("disk.img");
    let need = (a.files * a.file_size * 2) as u64;
    std::fs::File::create(&image)?.set_len((need * 3 / 2).max(256 << 20))?;
    sh("mkfs.ext4", &["-F", "-q", "-b", "4096", image.to_str().expect("utf-8 path")])?;
    let dev = sh("losetup", &["-f", "--show", image.to_str().expect("utf-8 path")])?;
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt)?;
    let m = Mounted { dev, mnt };
    sh("mount", &[&m.dev, m.mnt.to_str().expect("utf-8 path")])?;
    println!("ext4 on {} (image {}), mounted at {}", m.dev, image.display(), m.mnt.display());

    let cfg = Config::from_toml(&format!(
        "[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\npath = \"{}\"\n",
        image.display()
    ))?;
    let target = Target::from_config(&cfg)?;
    let addr = target.listen("127.0.0.1:0".parse()?, false).await?;
    println!("target {NQN} at {addr} exports the image as namespace 1");

    let t = Instant::now();
    let files = write_sample(&m.mnt, a.files, a.file_size)?;
    let bytes: u64 = files.iter().map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0)).sum();
    println!(
        "wrote {} files, {:.1} MiB of logs and CSV, in {:.2} s\n",
        files.len(),
        bytes as f64 / (1 << 20) as f64,
        t.elapsed().as_secs_f64()
    );

    let mut devices = DeviceMap::default();
    devices.add_file(&image, Endpoint { address: addr, nqn: NQN.into(), nsid: 1 }).map_err(anyhow::Error::msg)?;
    let mut host = Host::new(devices);
    // Connect and warm the page cache once, so the table compares computations.
    host.run(nearstore_compute::by_name("crc32c")?, b"", &files, Mode::Offload).await?;
    let logs: Vec<PathBuf> = files.iter().filter(|f| f.extension().is_some_and(|e| e == "log")).cloned().collect();
    let csvs: Vec<PathBuf> = files.iter().filter(|f| f.extension().is_some_and(|e| e == "csv")).cloned().collect();
    let query = |q: &str| serde_json::json!({ "query": q }).to_string();
    let jobs: Vec<(&str, &str, String, &[PathBuf])> = vec![
        ("checksum crc32c", "crc32c", String::new(), &files),
        ("checksum sha256", "sha256", String::new(), &files),
        ("checksum blake3", "blake3", String::new(), &files),
        ("grep -c ERROR", "grep-count", r#"{"pattern":"ERROR"}"#.into(), &logs),
        ("grep -F timeout", "search", r#"{"pattern":"timeout","max_offsets":3}"#.into(), &logs),
        ("wc", "wc", String::new(), &files),
        ("select where", "select", query("SELECT COUNT(*), MAX(amount) FROM s3object WHERE city = 'Oslo' AND quantity > 10"), &csvs),
        (
            "select group by",
            "select",
            query("SELECT city, COUNT(*), SUM(quantity), AVG(amount) FROM s3object GROUP BY city ORDER BY city"),
            &csvs,
        ),
    ];
    println!(
        "{:<18} {:>10} {:>12} {:>10} {:>12} {:>10} {:>12}  results",
        "operation", "offloaded", "net bytes", "pulled", "net bytes", "local", "net bytes"
    );
    let mut all_equal = true;
    for (label, op, args, set) in jobs {
        let op = nearstore_compute::by_name(op)?;
        let mut row = Vec::new();
        let mut outcomes = Vec::new();
        let mut times = Vec::new();
        let mut wires = Vec::new();
        let runs = if a.bench { a.runs } else { 1 };
        for mode in [Mode::Offload, Mode::Pull, Mode::Local] {
            let mut secs = Vec::new();
            let mut first = None;
            for _ in 0..runs {
                let r = host.run(op, args.as_bytes(), set, mode).await?;
                secs.push(r.elapsed_secs);
                first.get_or_insert(r);
            }
            let r = first.expect("one run at least");
            let t = median(secs);
            times.push(t);
            wires.push(r.wire_sent + r.wire_received);
            row.push(format!("{:>9.3}s {:>12}", t, r.wire_sent + r.wire_received));
            outcomes.push(r.files.into_iter().map(|f| f.outcome).collect::<Vec<_>>());
        }
        let equal = outcomes.windows(2).all(|w| w[0] == w[1]);
        all_equal &= equal;
        println!("{label:<18} {}  {}", row.join(" "), if equal { "equal" } else { "DIFFERENT" });
        if !equal {
            let i = (0..outcomes[0].len()).find(|&i| outcomes.iter().any(|o| o[i] != outcomes[0][i])).unwrap_or(0);
            for (mode, o) in ["offloaded", "pulled", "local"].iter().zip(&outcomes) {
                eprintln!("  {mode}, {}: {}", set[i].display(), serde_json::to_string(&o[i])?);
            }
        }
        if a.bench {
            let n: u64 = set.iter().map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0)).sum();
            let mbs = |secs: f64| n as f64 / secs / 1e6;
            let limit = kernel_limit(op, args.as_bytes(), &std::fs::read(&set[0])?) / 1e6;
            let mut secs = Vec::new();
            for _ in 0..runs {
                secs.push(engine_time(&target, &host.devices, op, args.as_bytes(), set).await?);
            }
            let engine = mbs(median(secs));
            let off = mbs(times[0]);
            println!(
                "{:<18} {:>9.0} MB/s, pulled {:.0} MB/s, local {:.0} MB/s; engine alone (read backend + compute) {:.0} MB/s, kernel in memory {:.0} MB/s; offloaded/engine {:.2}, offloaded/pulled {:.2}; wire/data offloaded {:.5}%",
                "",
                off,
                mbs(times[1]),
                mbs(times[2]),
                engine,
                limit,
                off / engine,
                off / mbs(times[1]),
                wires[0] as f64 * 100.0 / n as f64
            );
        }
    }
    println!(
        "\noffloaded: the target computes where the data lies, only descriptors and results cross the network;\n\
         pulled: the host reads the blocks over NVMe/TCP and computes; local: the host reads through ext4.\n\
         Try it yourself: nearstore checksum --target-config CONFIG --stats FILE... (README)."
    );
    drop(m);
    if !all_equal {
        bail!("offloaded, pulled and local results differ");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine alone on a current-thread runtime: its file reads run as tasks on that
    /// runtime, which must stay free while the engine's threads wait for them. It waited
    /// on the runtime's thread before (a worker of the demo's runtime held, and this one
    /// held forever).
    #[test]
    fn the_engine_alone_leaves_its_runtime_free() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = Config::from_toml(&format!(
            "[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\npath = \"{}\"\nsize = \"4MiB\"\nblock_size = 4096\n",
            dir.path().join("ns.img").display()
        ))
        .unwrap();
        let data: Vec<u8> = (0..4u32 << 20).map(|i| (i * 7 % 251) as u8).collect();
        let (tx, rx) = std::sync::mpsc::channel();
        // The runtime on a thread of its own: a runtime held by the engine never ends.
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let r = rt.block_on(async {
                let target = Target::from_config(&cfg)?;
                let ns = target.subsystem(NQN).and_then(|s| s.namespace(1)).context("namespace 1")?;
                ns.backend.write_at(&data, 0)?;
                let obj =
                    nearstore_wire::compute::Object { len: 4 << 20, extents: vec![nearstore_wire::compute::Extent::data(0, 4 << 20)] };
                let op = nearstore_compute::by_name("crc32c")?;
                let d = nearstore_wire::compute::Descriptor { op: op.id, args: vec![], inputs: vec![obj], outputs: vec![] }.encode();
                engine_seconds(ns, target.offload.cfg.clone(), target.io_engine, target.pool.clone(), vec![d; 4]).await
            });
            let _ = tx.send(r.map_err(|e| format!("{e:#}")));
        });
        match rx.recv_timeout(std::time::Duration::from_secs(30)) {
            Ok(r) => {
                let secs = r.unwrap();
                assert!(secs > 0.0, "{secs}");
            }
            Err(e) => panic!("the engine alone did not finish in 30 s on a current-thread runtime: {e}"),
        }
    }
}
