//! `nearstore-lab fused-bench`: each fused write operation against the same steps done the
//! conventional way over NVMe/TCP, against a running target's journaled namespace
//! (docs/benchmarks.md, "Fused write operations"; scripts/bench-fused.sh starts the
//! targets). Our initiator sends both, so the difference is the operation, not the client:
//!
//! - append: append-crc-write (one FUSED WRITE: the record framed, checksummed and journaled
//!   on the target) against Write of the framed record, then Read of it back and its crc32c
//!   on the host (the conventional writer keeps its log's last partial block, as a log
//!   writer through a page cache does, so its Write is one command);
//! - modify: read-modify-write (add of 8-byte integers) against Read, add on the host, Write;
//! - compress: compress-write (zstd level 3 on the target) against compressing on the host
//!   and a Write of the frame.
//!
//! The conventional Write is FUA with `--fua` (durable when it completes, as every fused
//! operation is), plain without. At QD 1 each operation's latency; at higher queue depths
//! `--qd` workers, each on its own I/O queue and its own part of the namespace, for
//! `--seconds`: operations and payload bytes per second.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nearstore_initiator::{ConnectOptions, Controller, IoQueue};
use nearstore_wire::fused::{self, op, Fused};

use crate::Output;

#[derive(clap::Args)]
pub struct FusedBenchArgs {
    /// The target's address (HOST:PORT).
    #[arg(short = 'a', long)]
    pub addr: std::net::SocketAddr,
    /// The subsystem.
    #[arg(short = 'n', long)]
    pub nqn: String,
    /// The journaled namespace (`microtx = true`); its content is overwritten.
    #[arg(long, default_value_t = 1)]
    pub nsid: u32,
    /// The operation: append, modify or compress.
    #[arg(long, value_enum)]
    pub op: BenchOp,
    /// How: fused (one command) or conventional (the steps on the host).
    #[arg(long, value_enum)]
    pub how: How,
    /// Payload bytes per operation (the record, the integers, the input to compress).
    #[arg(short = 'z', long, value_parser = crate::size_usize, default_value = "4KiB")]
    pub size: usize,
    /// Concurrent operations (workers, an I/O queue each); 1 measures latency.
    #[arg(short = 'q', long, default_value_t = 1)]
    pub qd: u16,
    /// Operations per worker at most.
    #[arg(long, default_value_t = 2000)]
    pub ops: u64,
    /// Seconds at most.
    #[arg(short = 'T', long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Conventional writes with FUA (durable at completion, as fused operations are).
    #[arg(long)]
    pub fua: bool,
    /// Output format: normal (text) or json.
    #[arg(short = 'o', long, value_enum, default_value = "normal")]
    pub output_format: Output,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum BenchOp {
    Append,
    Modify,
    Compress,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum How {
    Fused,
    Conventional,
}

/// One worker's part of the namespace: `bytes` from `base`, appended into in a loop.
struct Region {
    base: u64,
    bytes: u64,
}

/// A worker's state: its queue, its place, the conventional writer's cached last block.
struct Worker {
    q: IoQueue,
    nsid: u32,
    bs: u64,
    region: Region,
    /// The region byte where the next operation goes.
    at: u64,
    /// The conventional appender's copy of the block holding `at` (its bytes before `at`).
    tail: Vec<u8>,
    txid: u64,
    fua: bool,
}

impl Worker {
    /// One operation of `payload`; returns the bytes it wrote.
    async fn one(&mut self, what: BenchOp, how: How, payload: &[u8]) -> Result<usize> {
        match what {
            BenchOp::Append => self.append(how, payload).await,
            BenchOp::Modify => self.modify(how, payload).await,
            BenchOp::Compress => self.compress(how, payload).await,
        }
    }

    /// The region byte of the next operation of `n` bytes: after the last, or the region's
    /// start again (its tail then starts empty).
    fn place(&mut self, n: u64) -> u64 {
        if self.at + n > self.region.bytes {
            self.at = 0;
            self.tail.clear();
        }
        self.at
    }

    fn next_txid(&mut self) -> u64 {
        self.txid += 1;
        self.txid
    }

    async fn append(&mut self, how: How, record: &[u8]) -> Result<usize> {
        let block_offset = (self.at % fused::LOG_BLOCK_BYTES as u64) as u32;
        let n = fused::framed_len(block_offset, record.len()) as u64;
        let at = self.place(n);
        let block_offset = (at % fused::LOG_BLOCK_BYTES as u64) as u32;
        let n = fused::framed_len(block_offset, record.len()) as u64;
        let (from, to) = (at / self.bs * self.bs, (at + n).div_ceil(self.bs) * self.bs);
        match how {
            How::Fused => {
                // A record over one transfer goes as pieces cut at log block ends, each a
                // transaction, as the host library sends it (docs/compute-protocol.md).
                let max = self.q.max_transfer() - fused::HEADER_BYTES - fused::EXTENT_BYTES;
                let pieces = nearstore_host::fused::record_pieces(at, record.len(), max).context("a transfer smaller than a log block")?;
                for p in pieces {
                    let (pf, pt) = (p.offset / self.bs * self.bs, (p.offset + p.framed).div_ceil(self.bs) * self.bs);
                    let txid = self.next_txid();
                    let f = Fused {
                        op: op::APPEND_CRC_WRITE,
                        txid,
                        offset: p.offset,
                        block_offset: p.block_offset,
                        args: [p.flags, 0, 0, 0, 0, 0, 0, 0],
                        extents: vec![(self.region.base + pf, pt - pf)],
                    };
                    let (_, count) = self.q.fused_write(self.nsid, &f.encode(&record[p.data])).await?;
                    if count as u64 != p.framed {
                        bail!("append-crc-write wrote {count} bytes, the piece takes {}", p.framed);
                    }
                }
            }
            How::Conventional => {
                // The blocks from the one holding `at`: the cached bytes before it, the
                // framed record, zeros after; written and read back a transfer at a time.
                let mut blocks = std::mem::take(&mut self.tail);
                blocks.resize((at - from) as usize, 0);
                fused::frame_record(block_offset, record, &mut blocks);
                blocks.resize((to - from) as usize, 0);
                let chunk = self.q.max_transfer() / self.bs as usize * self.bs as usize;
                let first = (self.region.base + from) / self.bs;
                for (i, c) in blocks.chunks(chunk).enumerate() {
                    let lba = first + (i * chunk) as u64 / self.bs;
                    self.q.write(self.nsid, lba, c, self.bs as u32, self.fua).await?;
                }
                // Read back and checksummed, as a writer that checks what it wrote.
                let lo = (at - from) as usize;
                let mut crc = 0u32;
                for (i, c) in blocks.chunks(chunk).enumerate() {
                    let lba = first + (i * chunk) as u64 / self.bs;
                    let back = self.q.read(self.nsid, lba, (c.len() as u64 / self.bs) as u32, self.bs as u32).await?;
                    let (s, e) = ((i * chunk).max(lo), (i * chunk + c.len()).min(lo + n as usize));
                    if s < e {
                        crc = crc32c::crc32c_append(crc, &back[s - i * chunk..e - i * chunk]);
                    }
                }
                if crc != crc32c::crc32c(&blocks[lo..lo + n as usize]) {
                    bail!("the record read back differs from the one written");
                }
                let end = at + n;
                let last = end / self.bs * self.bs;
                blocks.drain(..(last - from) as usize);
                blocks.truncate((end - last) as usize);
                self.tail = blocks;
            }
        }
        self.at = at + n;
        Ok(n as usize)
    }

    async fn modify(&mut self, how: How, adds: &[u8]) -> Result<usize> {
        let n = adds.len() as u64;
        // Integers at an offset that is not a block's, so that both ends are partial.
        let at = self.place(n + 24) + 24;
        let (from, to) = (at / self.bs * self.bs, (at + n).div_ceil(self.bs) * self.bs);
        match how {
            How::Fused => {
                let txid = self.next_txid();
                let args = [fused::modify::ADD, 8, 0, 0, 0, 0, 0, 0];
                let f = Fused {
                    op: op::READ_MODIFY_WRITE,
                    txid,
                    offset: at - from,
                    block_offset: 0,
                    args,
                    extents: vec![(self.region.base + from, to - from)],
                };
                self.q.fused_write(self.nsid, &f.encode(adds)).await?;
            }
            How::Conventional => {
                let slba = (self.region.base + from) / self.bs;
                let nlb = ((to - from) / self.bs) as u32;
                let mut blocks = self.q.read(self.nsid, slba, nlb, self.bs as u32).await?;
                let lo = (at - from) as usize;
                for (o, d) in blocks[lo..lo + n as usize].chunks_exact_mut(8).zip(adds.chunks_exact(8)) {
                    let v =
                        u64::from_le_bytes(o.try_into().expect("8 bytes")).wrapping_add(u64::from_le_bytes(d.try_into().expect("8 bytes")));
                    o.copy_from_slice(&v.to_le_bytes());
                }
                self.q.write(self.nsid, slba, &blocks, self.bs as u32, self.fua).await?;
            }
        }
        // The next one over other blocks, as a table of counters updated in turn.
        self.at = to.div_ceil(self.bs) * self.bs;
        Ok(n as usize)
    }

    async fn compress(&mut self, how: How, input: &[u8]) -> Result<usize> {
        let bound = fused::compress_bound(input.len()) as u64;
        let at = self.place(bound);
        let written = match how {
            How::Fused => {
                let (from, to) = (at / self.bs * self.bs, (at + bound).div_ceil(self.bs) * self.bs);
                let txid = self.next_txid();
                let f = Fused {
                    op: op::COMPRESS_WRITE,
                    txid,
                    offset: at - from,
                    block_offset: 0,
                    args: [3, 0, 0, 0, 0, 0, 0, 0],
                    extents: vec![(self.region.base + from, to - from)],
                };
                let (_, count) = self.q.fused_write(self.nsid, &f.encode(input)).await?;
                count as u64
            }
            How::Conventional => {
                let frame = nearstore_compute::compress::compress_frame(input, 3)?;
                let (from, to) = (at / self.bs * self.bs, (at + frame.len() as u64).div_ceil(self.bs) * self.bs);
                let mut blocks = std::mem::take(&mut self.tail);
                blocks.resize((at - from) as usize, 0);
                blocks.extend_from_slice(&frame);
                blocks.resize((to - from) as usize, 0);
                self.q.write(self.nsid, (self.region.base + from) / self.bs, &blocks, self.bs as u32, self.fua).await?;
                frame.len() as u64
            }
        };
        // Frames one after the other, each from a block of its own (the conventional writer
        // then has no partial block to keep).
        self.at = (at + written).div_ceil(self.bs) * self.bs;
        self.tail.clear();
        Ok(input.len())
    }
}

/// A payload of `n` bytes: for compress, text that compresses about as a log or CSV does;
/// else counters to add (1 each) or a record.
fn payload(what: BenchOp, n: usize) -> Vec<u8> {
    match what {
        BenchOp::Compress => (0u64..).flat_map(|i| format!("{i},row {},{}\n", i * 7 % 1000, i % 13).into_bytes()).take(n).collect(),
        BenchOp::Modify => (0..n / 8).flat_map(|_| 1u64.to_le_bytes()).collect(),
        BenchOp::Append => (0..n).map(|i| (i * 31 % 251) as u8).collect(),
    }
}

pub fn run(a: FusedBenchArgs) -> Result<()> {
    if a.op == BenchOp::Modify && (a.size == 0 || !a.size.is_multiple_of(8)) {
        bail!("--size {}: modify adds 8-byte integers", a.size);
    }
    if a.qd == 0 || a.qd > 64 {
        bail!("--qd {}: from 1 to 64 (an I/O queue each)", a.qd);
    }
    let rt = crate::runtime(Some(2))?;
    let (lat, ops, bytes, secs) = rt.block_on(async {
        let mut o = ConnectOptions::new(a.addr, &a.nqn);
        o.queue_depth = 4;
        let c = Controller::connect(o).await.with_context(|| format!("connecting to {} at {}", a.nqn, a.addr))?;
        let ns = c.identify_namespace(a.nsid).await?;
        let bs = ns.block_size() as u64;
        let total = ns.nsze * bs;
        let part = total / a.qd as u64 / bs * bs;
        let per = (fused::compress_bound(a.size) as u64 + 2 * bs + 64).max(bs);
        if part < 4 * per {
            bail!("namespace {} ({total} bytes) is too small for {} workers of {}-byte operations", a.nsid, a.qd, a.size);
        }
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos() as u64;
        let mut workers = Vec::new();
        for w in 0..a.qd {
            let q = c.io_queue(w + 1).await.with_context(|| format!("I/O queue {}", w + 1))?;
            let region = Region { base: part * w as u64, bytes: part };
            workers.push(Worker { q, nsid: a.nsid, bs, region, at: 0, tail: Vec::new(), txid: seed ^ ((w as u64) << 48), fua: a.fua });
        }
        let one = workers[0].q.max_transfer() - fused::HEADER_BYTES - fused::EXTENT_BYTES;
        if a.op != BenchOp::Append && a.size > one {
            bail!("--size {}: modify and compress take one transfer, at most {one} bytes of data here (append goes in pieces)", a.size);
        }
        let data = payload(a.op, a.size);
        let deadline = Duration::from_secs_f64(a.seconds);
        let start = Instant::now();
        let tasks: Vec<_> = workers
            .into_iter()
            .map(|mut w| {
                let data = data.clone();
                let (what, how, ops) = (a.op, a.how, a.ops);
                tokio::spawn(async move {
                    let (mut lat, mut bytes) = (Vec::new(), 0u64);
                    while (lat.len() as u64) < ops && start.elapsed() < deadline {
                        let t = Instant::now();
                        w.one(what, how, &data).await?;
                        lat.push(t.elapsed());
                        bytes += data.len() as u64;
                    }
                    anyhow::Ok((lat, bytes))
                })
            })
            .collect();
        let mut lat = Vec::new();
        let mut bytes = 0;
        for t in tasks {
            let (l, b) = t.await??;
            lat.extend(l);
            bytes += b;
        }
        let secs = start.elapsed().as_secs_f64();
        let ops = lat.len() as u64;
        anyhow::Ok((lat, ops, bytes, secs))
    })?;
    let mut us: Vec<f64> = lat.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    us.sort_by(f64::total_cmp);
    let pct = |p: f64| us.get(((us.len() as f64 * p) as usize).min(us.len().saturating_sub(1))).copied().unwrap_or(0.0);
    let mean = us.iter().sum::<f64>() / us.len().max(1) as f64;
    let (iops, mbs) = (ops as f64 / secs, bytes as f64 / secs / 1e6);
    match a.output_format {
        Output::Json => println!(
            "{}",
            serde_json::json!({
                "op": format!("{:?}", a.op).to_lowercase(), "how": format!("{:?}", a.how).to_lowercase(), "size": a.size, "qd": a.qd,
                "fua": a.fua, "ops": ops, "seconds": secs, "iops": iops, "mb_per_s": mbs,
                "mean_us": mean, "p50_us": pct(0.5), "p99_us": pct(0.99),
            })
        ),
        Output::Normal => println!(
            "{:?} {:?} {} B QD {}{}: {ops} ops in {secs:.2} s, {iops:.0} ops/s, {mbs:.1} MB/s; latency mean {mean:.0} us, p50 {:.0} us, p99 {:.0} us",
            a.op,
            a.how,
            a.size,
            a.qd,
            if a.fua { " (FUA)" } else { "" },
            pct(0.5),
            pct(0.99)
        ),
    }
    Ok(())
}
