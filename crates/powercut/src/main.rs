//! The power-cut test's writer and checker, run on the host once per boot of the guest
//! by tests/kernel/powercut.sh: it connects to the target in the guest, checks every
//! block against what the last cut may have left (the model in the state file), then
//! writes stamped blocks until the connection dies (the script kills the guest), and
//! saves what it issued and what was acknowledged, and how, for the next boot.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::{Parser, ValueEnum};
use nearstore_initiator::{ConnectOptions, Controller, Data, PieceReader};
use nearstore_powercut::{stamp, FusedOutcome, FusedWrite, Model, BLOCK};
use nearstore_wire::compute::Extent;
use nearstore_wire::fused::{self, state, Fused};
use nearstore_wire::opcode::io;
use nearstore_wire::{Sqe, Status};
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;

const NSID: u32 = 1;
/// Commands in flight while writing: enough to have writes in flight at every cut.
const DEPTH: usize = 16;
/// How long reading every block back may take (under TCG it takes about a second): a
/// target that stops answering fails the boot instead of hanging it.
const READ_BACK_TIME_MAX: Duration = Duration::from_secs(120);
/// Blocks per write at most.
const WRITE_BLOCKS_MAX: u64 = 8;
/// Of 100 commands in the durable phase: this many FUA writes, and one of these many
/// Flushes (chosen per boot: rarer Flushes leave more unflushed writes to the cut); the
/// rest are plain writes.
const FUA_PERCENT: u32 = 30;
/// Of 100 commands in the durable phase: this many fused writes (write-checksum of
/// stamped blocks through the namespace's MicroTx journal: durable at completion, whole
/// or absent after a cut).
const FUSED_PERCENT: u32 = 20;
const FLUSH_PERCENTS: [u32; 3] = [1, 3, 8];

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Phase {
    /// Plain writes only: the next boot requires that the cut lost some of them.
    Control,
    /// FUA writes, plain writes, Flushes.
    Durable,
    /// Check the last cut and stop.
    Verify,
}

#[derive(Parser)]
struct Args {
    /// The target in the guest (forwarded to the host's loopback).
    #[arg(long)]
    addr: SocketAddr,
    #[arg(long)]
    nqn: String,
    /// The model between boots; made on the first boot.
    #[arg(long)]
    state: PathBuf,
    /// Blocks under test from LBA 0 (only for a new state).
    #[arg(long, default_value_t = 4096)]
    blocks: u64,
    /// Seeds the run id and, with the cut number, the writes of each boot.
    #[arg(long)]
    seed: u64,
    #[arg(long, value_enum)]
    phase: Phase,
    /// How long to keep trying to connect while the guest boots.
    #[arg(long, default_value_t = 120)]
    connect_timeout_s: u64,
    /// Writing stops with an error if no cut came within this.
    #[arg(long, default_value_t = 120)]
    write_time_max_s: u64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(run(args))
}

async fn run(args: Args) -> Result<()> {
    let mut model = match std::fs::read(&args.state) {
        Ok(b) => serde_json::from_slice(&b).with_context(|| format!("reading {}", args.state.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Model::new(args.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1, args.blocks),
        Err(e) => return Err(e).with_context(|| format!("reading {}", args.state.display())),
    };
    let blocks = model.blocks.len() as u64;
    let ctrl = connect(&args).await?;
    let ns = ctrl.identify_namespace(NSID).await.context("identifying namespace 1")?;
    ensure!(1usize << ns.lbads == BLOCK, "namespace 1 has 2^{}-byte blocks, not {BLOCK}", ns.lbads);
    ensure!(ns.nsze >= blocks, "namespace 1 has {} blocks, fewer than the {blocks} under test", ns.nsze);
    let mut q = ctrl.io_queue(1).await.context("connecting I/O queue 1")?;

    // What the last cut left.
    let start = Instant::now();
    let mut disk = vec![0u8; blocks as usize * BLOCK];
    let mut at = 0;
    let read_back = async {
        let mut r = PieceReader::new(q.queue(), NSID, BLOCK as u64, [Extent::data(0, disk.len() as u64)]);
        while let Some(chunk) = r.next().await? {
            disk[at..at + chunk.len()].copy_from_slice(chunk);
            at += chunk.len();
        }
        Ok::<_, nearstore_initiator::Error>(())
    };
    match tokio::time::timeout(READ_BACK_TIME_MAX, read_back).await {
        Ok(r) => r.context("reading the blocks back")?,
        Err(_) => bail!(
            "reading the blocks back: the target returned {at} of {} bytes within {} s, then stopped answering",
            disk.len(),
            READ_BACK_TIME_MAX.as_secs()
        ),
    }
    let control = model.control;
    let read = |lba: u64| disk[lba as usize * BLOCK..][..BLOCK].to_vec();
    // The fused writes in flight at the cut: each whole or absent, as its outcome says.
    let (mut whole, mut absent) = (0, 0);
    for f in std::mem::take(&mut model.fused) {
        let (st, _) = q.outcome(NSID, f.txid).await.with_context(|| format!("OUTCOME of fused write {}", f.txid))?;
        let outcome = match st {
            state::COMMITTED => FusedOutcome::Committed,
            state::ROLLED_BACK => FusedOutcome::RolledBack,
            state::UNKNOWN => FusedOutcome::Unknown,
            _ => FusedOutcome::Failed,
        };
        match model.check_fused(&f, outcome, read) {
            Ok(true) => whole += 1,
            Ok(false) => absent += 1,
            Err(l) => bail!("cut {}: LBA {}: {} (seed {})", model.cuts, l.lba, l.what, args.seed),
        }
    }
    println!("fused writes in flight at cut {}: {whole} whole, {absent} absent, none torn", model.cuts);
    let verdict = model.settle(read);
    println!(
        "verify after cut {}: {blocks} blocks in {:.1} s: {} hold their durable version, {} a later one; {} unflushed acknowledged writes lost (allowed); {} durable writes lost",
        model.cuts,
        start.elapsed().as_secs_f64(),
        verdict.held_durable,
        verdict.held_later,
        verdict.lost_unflushed,
        verdict.losses.len()
    );
    if !verdict.losses.is_empty() {
        for l in verdict.losses.iter().take(20) {
            println!("  LBA {}: {}", l.lba, l.what);
        }
        bail!("cut {}: {} blocks lost writes acknowledged as durable (seed {})", model.cuts, verdict.losses.len(), args.seed);
    }
    if control && verdict.lost_unflushed == 0 {
        bail!(
            "control: the cut lost none of the writes made without FUA or Flush, so this setup cannot tell a Flush that works from one that does nothing"
        );
    }
    model.control = false;
    save(&args.state, &model)?;
    if args.phase == Phase::Verify {
        return Ok(());
    }

    // Write until the cut.
    let mut rng = XorShiftRng::seed_from_u64(args.seed ^ model.cuts.wrapping_mul(0x2545_f491_4f6c_dd1d));
    let flush_percent = match args.phase {
        Phase::Durable => FLUSH_PERCENTS[rng.random_range(0..FLUSH_PERCENTS.len())],
        _ => 0,
    };
    let qp = q.queue();
    let mut busy = vec![false; blocks as usize];
    let mut slots: Vec<Option<Cmd>> = (0..DEPTH).map(|_| None).collect();
    let mut buf = vec![0u8; WRITE_BLOCKS_MAX as usize * BLOCK];
    let mut counts = Counts::default();
    let mut done: Vec<(u64, Status, u32)> = Vec::with_capacity(DEPTH);
    let deadline = Instant::now() + Duration::from_secs(args.write_time_max_s);
    let mut flush_in_flight = false;
    println!("WRITING ({:?} phase, {flush_percent}% Flushes)", args.phase);
    let cut = loop {
        ensure!(Instant::now() < deadline, "no cut came within {} s of writing", args.write_time_max_s);
        while let Some(tag) = slots.iter().position(Option::is_none) {
            let roll = rng.random_range(0..100);
            let mut cmd = if roll < flush_percent && !flush_in_flight {
                flush_in_flight = true;
                Cmd::Flush { covers: model.flush_sent() }
            } else {
                let lba = rng.random_range(0..blocks);
                let n = rng.random_range(1..=WRITE_BLOCKS_MAX).min(blocks - lba);
                let range = lba as usize..(lba + n) as usize;
                if busy[range.clone()].iter().any(|&b| b) {
                    break;
                }
                busy[range].fill(true);
                let durable = args.phase == Phase::Durable;
                let fua = durable && roll < flush_percent + FUA_PERCENT;
                let fused = durable && !fua && roll < flush_percent + FUA_PERCENT + FUSED_PERCENT;
                let version = model.issue(lba, n);
                if fused {
                    Cmd::Fused { lba, n, version, txid: rng.random_range(1..u64::MAX), crc: 0 }
                } else {
                    Cmd::Write { lba, n, version, fua }
                }
            };
            let submitted = match &mut cmd {
                Cmd::Flush { .. } => {
                    let mut s = Sqe::new(io::FLUSH, 0);
                    s.set_nsid(NSID);
                    qp.submit(s, Data::None, tag as u64)
                }
                Cmd::Write { lba, n, version, fua } => {
                    let data = &mut buf[..*n as usize * BLOCK];
                    for (i, b) in data.chunks_exact_mut(BLOCK).enumerate() {
                        stamp(model.run, *lba + i as u64, *version, b);
                    }
                    qp.submit(Sqe::rw(io::WRITE, NSID, *lba, *n as u32, *fua), Data::Out(data), tag as u64)
                }
                Cmd::Fused { lba, n, version, txid, crc } => {
                    let data = &mut buf[..*n as usize * BLOCK];
                    for (i, b) in data.chunks_exact_mut(BLOCK).enumerate() {
                        stamp(model.run, *lba + i as u64, *version, b);
                    }
                    *crc = crc32c::crc32c(data);
                    let extents = vec![(*lba * BLOCK as u64, *n * BLOCK as u64)];
                    let f = Fused { op: fused::op::WRITE_CHECKSUM, txid: *txid, offset: 0, block_offset: 0, args: [0; 8], extents };
                    let mut s = Sqe::new(fused::opcode::FUSED_WRITE, 0);
                    s.set_nsid(NSID);
                    qp.submit(s, Data::Out(&f.encode(data)), tag as u64)
                }
            };
            submitted.context("submitting")?;
            slots[tag] = Some(cmd);
        }
        done.clear();
        if let Err(e) = qp.poll(|tag, cqe, _| done.push((tag, cqe.status, cqe.dw0))).await {
            break e;
        }
        for &(tag, status, dw0) in &done {
            let cmd = slots.get_mut(tag as usize).and_then(Option::take).context("a completion for no command")?;
            ensure!(status.is_success(), "{cmd:?} failed: {status}");
            match cmd {
                Cmd::Flush { covers } => {
                    model.flush_completed(&covers);
                    flush_in_flight = false;
                    counts.flushes += 1;
                }
                Cmd::Write { lba, n, version, fua } => {
                    model.completed(lba, n, version, fua);
                    busy[lba as usize..(lba + n) as usize].fill(false);
                    if fua {
                        counts.fua += 1;
                    } else {
                        counts.plain += 1;
                    }
                }
                Cmd::Fused { lba, n, version, crc, .. } => {
                    ensure!(dw0 == crc, "fused write LBA {lba}+{n}: the target's checksum {dw0:#x}, the data's {crc:#x}");
                    model.completed(lba, n, version, true);
                    busy[lba as usize..(lba + n) as usize].fill(false);
                    counts.fused += 1;
                }
            }
        }
    };
    model.cuts += 1;
    model.control = args.phase == Phase::Control;
    for cmd in slots.iter().flatten() {
        if let Cmd::Fused { lba, n, version, txid, .. } = *cmd {
            model.fused.push(FusedWrite { txid, lba, n, version });
        }
    }
    save(&args.state, &model)?;
    println!(
        "cut {}: {} FUA writes, {} plain writes, {} fused writes, {} Flushes completed ({flush_percent}% of commands Flushes); {} commands in flight, {} of them fused ({cut})",
        model.cuts,
        counts.fua,
        counts.plain,
        counts.fused,
        counts.flushes,
        slots.iter().flatten().count(),
        model.fused.len()
    );
    Ok(())
}

enum Cmd {
    Write {
        lba: u64,
        n: u64,
        version: u64,
        fua: bool,
    },
    /// A FUSED WRITE (write-checksum) of stamped blocks; `crc` the crc32c of its data.
    Fused {
        lba: u64,
        n: u64,
        version: u64,
        txid: u64,
        crc: u32,
    },
    /// What the Flush covers: every block's last version completed before it was sent.
    Flush {
        covers: Vec<u64>,
    },
}

impl std::fmt::Debug for Cmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cmd::Write { lba, n, version, fua } => write!(f, "Write LBA {lba}+{n} (version {version}{})", if *fua { ", FUA" } else { "" }),
            Cmd::Fused { lba, n, version, txid, .. } => write!(f, "fused write LBA {lba}+{n} (version {version}, transaction {txid})"),
            Cmd::Flush { .. } => write!(f, "Flush"),
        }
    }
}

#[derive(Default)]
struct Counts {
    fua: u64,
    fused: u64,
    plain: u64,
    flushes: u64,
}

/// Connects, retrying while the guest boots (user-mode networking accepts the host's
/// connection before anything listens in the guest, then drops it).
async fn connect(args: &Args) -> Result<Controller> {
    let until = Instant::now() + Duration::from_secs(args.connect_timeout_s);
    loop {
        match Controller::connect(ConnectOptions::new(args.addr, &args.nqn)).await {
            Ok(c) => return Ok(c),
            Err(_) if Instant::now() < until => tokio::time::sleep(Duration::from_millis(500)).await,
            Err(e) => return Err(e).with_context(|| format!("connecting to {} for {} s", args.addr, args.connect_timeout_s)),
        }
    }
}

/// Writes the state whole or not at all (a new file renamed over the old).
fn save(path: &Path, model: &Model) -> Result<()> {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, serde_json::to_vec(model)?).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}
