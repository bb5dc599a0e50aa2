//! `nearstore-lab leveldb-bench`: a LevelDB-like workload (db_bench `fillrandom` with
//! `sync=true`: each Put its own write batch, a random 16-byte key and a value of
//! `--value` bytes, appended to the write-ahead log as one record and durable before the
//! next) on files of a file system whose image a running target exports with a MicroTx
//! journal (docs/benchmarks.md, "A LevelDB-like workload"; scripts/bench-leveldb.sh makes
//! the file system, mounts it and starts the target). `--writers` logs at once, one per
//! writer (one database each), each writer on its own connection:
//!
//! - fused: the host library's `LogWriter` (LevelDB's `log::Writer` shape), one
//!   append-crc-write per record: framed, checksummed and journaled on the target;
//! - conventional: what LevelDB's writer makes of the same records on a file system over
//!   NVMe/TCP: the record framed and checksummed on the host (its log format, the same
//!   framing code), then the blocks it touches written (the log's last partial block kept,
//!   as the page cache keeps it) with FUA, durable at completion as `fdatasync` makes it
//!   (a preallocated file: no metadata to commit). Both preallocate the log the same way (1
//!   MiB of zeros at a time, synced, mapped with FIEMAP).
//!
//! At the end every log is read back through the file system and parsed as a LevelDB log
//! (nearstore-testkit's reader, written from LevelDB's description): it must hold exactly
//! the batches appended, in order.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nearstore_host::device::{DeviceMap, Endpoint};
use nearstore_host::fused::{LogWriter, LOG_PREALLOC_BYTES};
use nearstore_host::object::{self, Mapped};
use nearstore_host::Host;
use nearstore_initiator::{ConnectOptions, Controller, IoQueue};
use nearstore_wire::fused::{self, LOG_BLOCK_BYTES};
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;

use crate::fusedbench::How;
use crate::Output;

#[derive(clap::Args)]
pub struct LeveldbBenchArgs {
    /// The target's address (HOST:PORT).
    #[arg(short = 'a', long)]
    pub addr: std::net::SocketAddr,
    /// The subsystem.
    #[arg(short = 'n', long)]
    pub nqn: String,
    /// The namespace exporting IMAGE (`microtx = true`).
    #[arg(long, default_value_t = 1)]
    pub nsid: u32,
    /// The file system's image, which the target exports.
    #[arg(long)]
    pub image: PathBuf,
    /// Where that file system is mounted (on a loop device): the logs go there.
    #[arg(long)]
    pub dir: PathBuf,
    /// How: fused (append-crc-write through LogWriter) or conventional.
    #[arg(long, value_enum)]
    pub how: How,
    /// Bytes of each value (db_bench: 100 by default).
    #[arg(short = 'z', long, value_parser = crate::size_usize, default_value = "100")]
    pub value: usize,
    /// Logs written at once (databases), each by its own writer and connection.
    #[arg(short = 'w', long, default_value_t = 1)]
    pub writers: u16,
    /// Puts per writer at most.
    #[arg(long, default_value_t = 100_000)]
    pub ops: u64,
    /// Seconds at most.
    #[arg(short = 'T', long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Output format: normal (text) or json.
    #[arg(short = 'o', long, value_enum, default_value = "normal")]
    pub output_format: Output,
}

/// Bytes of a db_bench key.
const KEY_BYTES: usize = 16;

/// A LevelDB WriteBatch holding one Put (db/write_batch.cc): sequence (u64 LE), count
/// (u32 LE), then the record: kTypeValue (1), varint32 key length, key, varint32 value
/// length, value.
fn batch(seq: u64, key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(12 + 1 + 10 + key.len() + value.len());
    b.extend_from_slice(&seq.to_le_bytes());
    b.extend_from_slice(&1u32.to_le_bytes());
    b.push(1);
    for part in [key, value] {
        let mut n = part.len() as u32;
        while n >= 0x80 {
            b.push(n as u8 | 0x80);
            n >>= 7;
        }
        b.push(n as u8);
        b.extend_from_slice(part);
    }
    b
}

/// The conventional log writer: LevelDB's framing on the host, the touched blocks written
/// with FUA over our initiator into the file's blocks.
struct PlainLog {
    q: IoQueue,
    nsid: u32,
    bs: u64,
    path: PathBuf,
    devices: DeviceMap,
    len: u64,
    /// The file's extents as namespace byte ranges, covering its preallocated bytes.
    pieces: Vec<(u64, u64)>,
    mapped: u64,
    /// The bytes of the block holding `len`, before it.
    tail: Vec<u8>,
}

impl PlainLog {
    async fn add_record(&mut self, data: &[u8]) -> Result<()> {
        let block_offset = (self.len % LOG_BLOCK_BYTES as u64) as u32;
        let n = fused::framed_len(block_offset, data.len()) as u64;
        if self.mapped < self.len + n {
            let to = (self.len + n).div_ceil(LOG_PREALLOC_BYTES) * LOG_PREALLOC_BYTES;
            preallocate(&self.path, to)?;
            self.map()?;
        }
        let (from, to) = (self.len / self.bs * self.bs, (self.len + n).div_ceil(self.bs) * self.bs);
        let mut blocks = std::mem::take(&mut self.tail);
        blocks.resize((self.len - from) as usize, 0);
        fused::frame_record(block_offset, data, &mut blocks);
        blocks.resize((to - from) as usize, 0);
        let mut done = 0usize;
        for (at, k) in file_pieces(&self.pieces, from, to)? {
            let chunk = &blocks[done..done + k as usize];
            self.q.write(self.nsid, at / self.bs, chunk, self.bs as u32, true).await?;
            done += k as usize;
        }
        let end = self.len + n;
        let last = end / self.bs * self.bs;
        blocks.drain(..(last - from) as usize);
        blocks.truncate((end - last) as usize);
        self.tail = blocks;
        self.len = end;
        Ok(())
    }

    fn map(&mut self) -> Result<()> {
        let Mapped::Offload(fo) = object::map_file(&self.path, &self.devices)? else {
            bail!("{}: not on the exported file system", self.path.display());
        };
        self.pieces.clear();
        for e in &fo.object.extents {
            if e.is_zeros() || e.is_remote() {
                bail!("{}: an extent that is not written, local blocks", self.path.display());
            }
            self.pieces.push((nearstore_wire::compute::global::offset(e.offset), e.len));
        }
        self.mapped = fo.object.len;
        Ok(())
    }
}

/// The namespace ranges of file bytes [from, to) of a file laid out on `pieces`.
fn file_pieces(pieces: &[(u64, u64)], mut from: u64, to: u64) -> Result<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    let mut at = 0u64;
    for &(off, len) in pieces {
        if from < at + len && from < to {
            let n = (at + len).min(to) - from;
            out.push((off + (from - at), n));
            from += n;
        }
        at += len;
    }
    if from < to {
        bail!("file bytes {from}..{to} lie past its extents");
    }
    Ok(out)
}

/// Zero-fills `path` from its size to `to`, synced, its cached pages dropped: allocated,
/// written blocks, as the host library's LogWriter preallocates.
fn preallocate(path: &Path, to: u64) -> Result<()> {
    let f = OpenOptions::new().write(true).open(path).with_context(|| path.display().to_string())?;
    let size = f.metadata()?.len();
    let zeros = vec![0u8; 64 << 10];
    let mut at = size;
    while at < to {
        let n = (to - at).min(zeros.len() as u64) as usize;
        f.write_all_at(&zeros[..n], at)?;
        at += n as u64;
    }
    f.sync_all()?;
    nearstore_host::drop_cached(&f, path)?;
    Ok(())
}

/// One writer's puts until `ops` or the deadline: their latencies and the batches.
async fn fused_writer(devices: DeviceMap, path: PathBuf, a: (u64, Duration, Instant), values: usize, seed: u64) -> Result<Writer> {
    let (ops, deadline, start) = a;
    let mut host = Host::new(devices);
    let mut w = LogWriter::create(&mut host, &path)?;
    let mut out = Writer::new(seed);
    while out.lat.len() < ops as usize && start.elapsed() < deadline {
        let b = out.next_batch(values);
        let t = Instant::now();
        w.add_record(&b).await?;
        out.done(t, b);
    }
    w.finish()?;
    Ok(out)
}

async fn plain_writer(mut log: PlainLog, a: (u64, Duration, Instant), values: usize, seed: u64) -> Result<Writer> {
    let (ops, deadline, start) = a;
    let mut out = Writer::new(seed);
    while out.lat.len() < ops as usize && start.elapsed() < deadline {
        let b = out.next_batch(values);
        let t = Instant::now();
        log.add_record(&b).await?;
        out.done(t, b);
    }
    // The file's size to the log's end, as LogWriter::finish sets it.
    OpenOptions::new().write(true).open(&log.path)?.set_len(log.len)?;
    Ok(out)
}

/// A writer's workload and what it measured.
struct Writer {
    rng: XorShiftRng,
    seq: u64,
    lat: Vec<Duration>,
    /// Every batch appended, to check the log against.
    batches: Vec<Vec<u8>>,
    bytes: u64,
}

impl Writer {
    fn new(seed: u64) -> Writer {
        Writer { rng: XorShiftRng::seed_from_u64(seed), seq: 0, lat: Vec::new(), batches: Vec::new(), bytes: 0 }
    }

    fn next_batch(&mut self, values: usize) -> Vec<u8> {
        let mut key = [0u8; KEY_BYTES];
        self.rng.fill(&mut key[..]);
        let mut value = vec![0u8; values];
        self.rng.fill(&mut value[..]);
        self.seq += 1;
        batch(self.seq, &key, &value)
    }

    fn done(&mut self, t: Instant, b: Vec<u8>) {
        self.lat.push(t.elapsed());
        self.bytes += b.len() as u64;
        self.batches.push(b);
    }
}

pub fn run(a: LeveldbBenchArgs) -> Result<()> {
    if a.writers == 0 || a.writers > 64 {
        bail!("--writers {}: from 1 to 64", a.writers);
    }
    let mut devices = DeviceMap::default();
    devices
        .add_file(&a.image, Endpoint { address: a.addr, nqn: a.nqn.clone(), nsid: a.nsid })
        .map_err(|e| anyhow::anyhow!("{}: {e}", a.image.display()))?;
    let paths: Vec<PathBuf> = (0..a.writers).map(|w| a.dir.join(format!("{:06}.log", w + 3))).collect();
    let rt = crate::runtime(Some(2))?;
    let (writers, secs) = rt.block_on(async {
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos() as u64;
        let mut plain = Vec::new();
        if a.how == How::Conventional {
            let mut o = ConnectOptions::new(a.addr, &a.nqn);
            o.queue_depth = 4;
            let c = Controller::connect(o).await.with_context(|| format!("connecting to {} at {}", a.nqn, a.addr))?;
            let bs = c.identify_namespace(a.nsid).await?.block_size() as u64;
            for (w, path) in paths.iter().enumerate() {
                File::create(path).with_context(|| path.display().to_string())?;
                let q = c.io_queue(w as u16 + 1).await.with_context(|| format!("I/O queue {}", w + 1))?;
                let (devices, path) = (devices.clone(), path.clone());
                plain.push(PlainLog { q, nsid: a.nsid, bs, path, devices, len: 0, pieces: Vec::new(), mapped: 0, tail: Vec::new() });
            }
            // The controller stays connected while its queues run.
            std::mem::forget(c);
        }
        let start = Instant::now();
        let limits = (a.ops, Duration::from_secs_f64(a.seconds), start);
        let tasks: Vec<_> = match a.how {
            How::Fused => paths
                .iter()
                .enumerate()
                .map(|(w, p)| tokio::spawn(fused_writer(devices.clone(), p.clone(), limits, a.value, seed ^ w as u64)))
                .collect(),
            How::Conventional => {
                plain.into_iter().enumerate().map(|(w, log)| tokio::spawn(plain_writer(log, limits, a.value, seed ^ w as u64))).collect()
            }
        };
        let mut writers = Vec::new();
        for t in tasks {
            writers.push(t.await??);
        }
        anyhow::Ok((writers, start.elapsed().as_secs_f64()))
    })?;
    // Each log, read back through the file system, is a LevelDB log of exactly its batches.
    for (path, w) in paths.iter().zip(&writers) {
        let f = File::open(path)?;
        nearstore_host::drop_cached(&f, path)?;
        let records =
            nearstore_testkit::leveldb_log_records(&std::fs::read(path)?).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        if records != w.batches {
            bail!("{}: {} records read back, {} batches appended, or they differ", path.display(), records.len(), w.batches.len());
        }
        std::fs::remove_file(path)?;
    }
    let mut us: Vec<f64> = writers.iter().flat_map(|w| w.lat.iter().map(|d| d.as_secs_f64() * 1e6)).collect();
    us.sort_by(f64::total_cmp);
    let ops = us.len() as u64;
    let bytes: u64 = writers.iter().map(|w| w.bytes).sum();
    let pct = |p: f64| us.get(((us.len() as f64 * p) as usize).min(us.len().saturating_sub(1))).copied().unwrap_or(0.0);
    let mean = us.iter().sum::<f64>() / us.len().max(1) as f64;
    let (puts, mbs) = (ops as f64 / secs, bytes as f64 / secs / 1e6);
    match a.output_format {
        Output::Json => println!(
            "{}",
            serde_json::json!({
                "how": format!("{:?}", a.how).to_lowercase(), "value": a.value, "writers": a.writers, "ops": ops, "seconds": secs,
                "puts_per_s": puts, "mb_per_s": mbs, "mean_us": mean, "p50_us": pct(0.5), "p99_us": pct(0.99),
            })
        ),
        Output::Normal => println!(
            "{:?} {} B values, {} writers: {ops} puts in {secs:.2} s, {puts:.0} puts/s, {mbs:.1} MB/s of log records; latency mean {mean:.0} us, p50 {:.0} us, p99 {:.0} us (every log read back whole)",
            a.how,
            a.value,
            a.writers,
            pct(0.5),
            pct(0.99)
        ),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// A write batch as LevelDB's WriteBatch::Put makes it (db/write_batch.cc), with a
    /// value whose length takes two varint bytes.
    #[test]
    fn a_batch_is_leveldbs() {
        let b = super::batch(0x0102, b"k1", &[7u8; 200]);
        assert_eq!(&b[..8], &[2, 1, 0, 0, 0, 0, 0, 0], "sequence");
        assert_eq!(&b[8..12], &[1, 0, 0, 0], "count");
        assert_eq!(&b[12..16], &[1, 2, b'k', b'1'], "kTypeValue, key length, key");
        assert_eq!(&b[16..18], &[0xC8, 0x01], "200 as a varint32");
        assert_eq!((b.len(), b[18]), (18 + 200, 7));
    }
}
