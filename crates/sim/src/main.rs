//! The long run of the simulation (docs/simulation.md): many seeds, or one replayed with
//! its trace.

use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use nearstore_sim::disk::DiskBug;
use nearstore_sim::net::ReplyBug;
use nearstore_sim::{run, Options};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Bug {
    /// Flush and FUA make nothing durable.
    FlushIgnored,
    /// One completion in 50 is sent twice.
    DuplicateCompletion,
    /// One completion in 50 is never sent.
    DropCompletion,
    /// With --moves: the copier does not block the extent in the volume's cache.
    NoInvalidation,
    /// With --moves: the copier copies without waiting for the I/O in flight.
    NoDrain,
    /// With --moves: the copier lets the waiting I/O go before it publishes.
    UnblockBeforePublish,
}

/// Runs the deterministic simulation of the target over many seeds.
#[derive(Parser, Debug)]
struct Args {
    /// Seeds to run, from --from.
    #[arg(long, default_value_t = 1000)]
    seeds: u64,
    /// The first seed.
    #[arg(long, default_value_t = 0)]
    from: u64,
    /// Runs this one seed (overrides --seeds and --from).
    #[arg(long)]
    seed: Option<u64>,
    /// Prints the whole event trace of each seed run.
    #[arg(long)]
    trace: bool,
    /// Commands of each run's workload.
    #[arg(long, default_value_t = Options::default().ops)]
    ops: u32,
    /// Breaks the target on purpose, to see the checker find it.
    #[arg(long, value_enum)]
    bug: Option<Bug>,
    /// Goes on after a failing seed.
    #[arg(long)]
    keep_going: bool,
    /// Runs the simulation of extents moved under I/O and faults instead (--ops is then
    /// per client).
    #[arg(long)]
    moves: bool,
    /// Runs the simulation of the bandwidth arbiter and the exporters' gates instead
    /// (docs/simulation.md, "The arbiter").
    #[arg(long)]
    arbiter: bool,
}

/// `--arbiter`: the arbiter simulation over the seeds asked.
fn arbiter(args: &Args, seeds: std::ops::Range<u64>) -> ExitCode {
    use nearstore_sim::arbiter;
    let opts = arbiter::Options { bug: None, keep_trace: args.trace };
    let (mut passed, mut failed) = (0u64, Vec::new());
    let started = std::time::Instant::now();
    for seed in seeds {
        match arbiter::run(seed, &opts) {
            Ok(s) => {
                if args.trace {
                    s.trace.iter().for_each(|l| println!("{l}"));
                }
                passed += 1;
            }
            Err(f) => {
                if args.trace {
                    f.trace.iter().for_each(|l| println!("{l}"));
                }
                eprintln!("{f}");
                failed.push(seed);
                if !args.keep_going {
                    break;
                }
            }
        }
    }
    println!("{passed} seeds passed, {} failed {failed:?}, {:.0?}", failed.len(), started.elapsed());
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `--moves`: the move simulation over the seeds asked.
fn moves(args: &Args, seeds: std::ops::Range<u64>) -> ExitCode {
    use nearstore_sim::moves;
    use nearstore_target::dev::volume::mover::MoveBug;
    let bug = match args.bug {
        Some(Bug::NoInvalidation) => Some(MoveBug::NoInvalidation),
        Some(Bug::NoDrain) => Some(MoveBug::NoDrain),
        Some(Bug::UnblockBeforePublish) => Some(MoveBug::UnblockBeforePublish),
        Some(b) => {
            eprintln!("--bug {b:?} breaks the target, not a move: run it without --moves");
            return ExitCode::FAILURE;
        }
        None => None,
    };
    let ops = if args.ops == Options::default().ops { moves::Options::default().ops } else { args.ops };
    let opts = moves::Options { ops, bug, keep_trace: args.trace };
    let started = Instant::now();
    let (mut passed, mut failed, mut all) = (0u64, Vec::new(), moves::Stats::default());
    for seed in seeds {
        match moves::run(seed, &opts) {
            Ok(s) => {
                s.trace.iter().for_each(|l| println!("{l}"));
                if args.seed.is_some() {
                    println!("seed {seed}: passed, trace hash {:016x} over {} events", s.trace_hash, s.events);
                }
                passed += 1;
                (all.reads, all.writes, all.failed) = (all.reads + s.reads, all.writes + s.writes, all.failed + s.failed);
                (all.moves_begun, all.published, all.expired) =
                    (all.moves_begun + s.moves_begun, all.published + s.published, all.expired + s.expired);
                (all.crashes, all.crashes_mid_move) = (all.crashes + s.crashes, all.crashes_mid_move + s.crashes_mid_move);
                (all.cuts, all.outages, all.lost_calls) = (all.cuts + s.cuts, all.outages + s.outages, all.lost_calls + s.lost_calls);
                all.simulated += s.simulated;
            }
            Err(f) => {
                f.trace.iter().for_each(|l| println!("{l}"));
                eprintln!("{f}");
                failed.push(seed);
                if !args.keep_going {
                    break;
                }
            }
        }
        if (passed + failed.len() as u64).is_multiple_of(1000) {
            eprintln!("{} seeds, {} failed, {:.0?}", passed + failed.len() as u64, failed.len(), started.elapsed());
        }
    }
    println!(
        "{passed} seeds passed, {} failed {failed:?}; {} reads and {} writes checked, {} failed; {} moves begun, {} published, \
         {} expired; {} crashes ({} mid-move), {} cuts, {} pool outages, {} calls lost; {:.1?} simulated in {:.1?}",
        failed.len(),
        all.reads,
        all.writes,
        all.failed,
        all.moves_begun,
        all.published,
        all.expired,
        all.crashes,
        all.crashes_mid_move,
        all.cuts,
        all.outages,
        all.lost_calls,
        all.simulated,
        started.elapsed()
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let seeds = match args.seed {
        Some(s) => s..s + 1,
        None => args.from..args.from + args.seeds,
    };
    if args.moves {
        return moves(&args, seeds);
    }
    if args.arbiter {
        return arbiter(&args, seeds);
    }
    let mut opts = Options { ops: args.ops, keep_trace: args.trace, ..Options::default() };
    match args.bug {
        Some(Bug::FlushIgnored) => opts.disk_bug = Some(DiskBug::FlushIgnored),
        Some(Bug::DuplicateCompletion) => opts.reply_bug = Some(ReplyBug::DuplicateCompletion(50)),
        Some(Bug::DropCompletion) => opts.reply_bug = Some(ReplyBug::DropCompletion(50)),
        Some(b) => {
            eprintln!("--bug {b:?} breaks a move: run it with --moves");
            return ExitCode::FAILURE;
        }
        None => {}
    }
    let started = Instant::now();
    let (mut passed, mut failed) = (0u64, Vec::new());
    let (mut completed, mut lost, mut faults, mut cuts, mut crashes) = (0, 0, 0, 0, 0);
    let mut simulated = std::time::Duration::ZERO;
    for seed in seeds {
        match run(seed, &opts) {
            Ok(o) => {
                for l in &o.trace {
                    println!("{l}");
                }
                passed += 1;
                (completed, lost, faults) = (completed + o.completed, lost + o.lost, faults + o.faults);
                (cuts, crashes) = (cuts + o.cuts, crashes + o.crashes);
                simulated += o.simulated;
                if args.seed.is_some() {
                    println!("seed {seed}: passed, trace hash {:016x} over {} events", o.trace_hash, o.events);
                }
            }
            Err(f) => {
                for l in &f.trace {
                    println!("{l}");
                }
                eprintln!("{f}");
                failed.push(seed);
                if !args.keep_going {
                    break;
                }
            }
        }
        if (passed + failed.len() as u64).is_multiple_of(1000) {
            eprintln!("{} seeds, {} failed, {:.0?}", passed + failed.len() as u64, failed.len(), started.elapsed());
        }
    }
    println!(
        "{passed} seeds passed, {} failed {failed:?}; {completed} commands completed, {lost} lost to faults, \
         {faults} disk errors reported, {cuts} disconnects, {crashes} crashes; {simulated:.1?} simulated in {:.1?}",
        failed.len(),
        started.elapsed()
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
