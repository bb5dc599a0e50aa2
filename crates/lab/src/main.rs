//! The `nearstore-lab` command: what measures and shows the product, apart from it. The
//! testbed (hosts in network namespaces behind shaped links, its benchmarks and experiment
//! grids), the demo (ext4 on a loop device, offloaded against pulled against local), and the
//! sort benchmark's data sets (gensort, valsort). Targets it starts are the product's own
//! `nearstore` binary, found beside this one.

mod computeload;
mod demo;
mod fusedbench;
mod journalbench;
mod leveldbbench;
mod pifobench;
mod records;
mod sortbench;
mod sortexp;
mod testbed;

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use nearstore_target::config::ByteSize;

#[derive(Parser)]
#[command(name = "nearstore-lab", version, about = "nearstore's lab: testbed, experiments, demo, sort benchmark data")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The main job, shown: ext4 on a loop device exported by a target; operations run
    /// offloaded, pulled and locally, with a table of times, bytes on the network and results.
    Demo(demo::DemoArgs),
    /// Client and target hosts in network namespaces with shaped links; benchmarks and
    /// experiments on them (docs/experiments.md).
    #[command(subcommand)]
    Testbed(testbed::TestbedCmd),
    /// Write records in the sort benchmark's format (100 bytes, 10-byte keys), as gensort.
    Gensort(records::GensortArgs),
    /// Check that records are sorted and report their checksum, as valsort.
    Valsort(records::ValsortArgs),
    /// A fused write operation against the same steps done conventionally, on a running
    /// target's journaled namespace: latency at QD 1, throughput at higher depths.
    FusedBench(fusedbench::FusedBenchArgs),
    /// The MicroTx journal's recovery time against the transactions it holds.
    JournalBench(journalbench::JournalBenchArgs),
    /// A LevelDB-like workload (fillrandom, sync): log records through LogWriter's
    /// append-crc-write against LevelDB's own writing, on an exported file system.
    LeveldbBench(leveldbbench::LeveldbBenchArgs),
    /// One tenant's compute commands in a loop (heavy: sha256 over a large range; light:
    /// grep and select over a small CSV): the compute-fairness experiment's load.
    ComputeLoad(computeload::ComputeLoadArgs),
    /// The host's PIFO against FIFO order: a victim's 4 KiB reads at QD 1 beside a
    /// background of 128 KiB reads and writes, through one connection.
    PifoBench(pifobench::PifoBenchArgs),
}

#[derive(Clone, Copy, clap::ValueEnum, PartialEq, Eq)]
pub enum Output {
    Normal,
    Json,
}

/// A size in bytes, with or without a unit (4096, 4KiB, 1GiB, 10G): clap's value parser.
pub fn size(s: &str) -> Result<u64, String> {
    s.parse::<ByteSize>().map(|b| b.0).map_err(|e| e.to_string())
}

/// [`size`] as a usize.
pub fn size_usize(s: &str) -> Result<usize, String> {
    usize::try_from(size(s)?).map_err(|_| format!("{s} is too large for this machine"))
}

/// The product's binary, which the testbed's target hosts run: `nearstore` beside this
/// binary (cargo builds both into one directory, an install puts them side by side), else
/// the one on PATH.
pub fn product_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("finding this binary")?;
    let beside = exe.with_file_name("nearstore");
    if beside.is_file() {
        return Ok(beside);
    }
    std::env::var_os("PATH").iter().flat_map(std::env::split_paths).map(|d| d.join("nearstore")).find(|p| p.is_file()).with_context(|| {
        format!(
            "the testbed runs the `nearstore` binary, which is neither beside {} nor on PATH: build it (cargo build -p nearstore)",
            exe.display()
        )
    })
}

fn runtime(threads: Option<usize>) -> Result<tokio::runtime::Runtime> {
    let mut b = match threads {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    if let Some(n) = threads.filter(|&n| n > 1) {
        b.worker_threads(n);
    }
    Ok(b.enable_all().build()?)
}

fn main() {
    let matches = Cli::command().get_matches();
    // A verb asked for JSON (-o json) says its error in JSON too, so that a script reads
    // one format.
    let json = matches.subcommand().and_then(|(_, m)| m.try_get_one::<Output>("output_format").ok().flatten()) == Some(&Output::Json);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // Only problems: the demo's in-process target would otherwise log every connection.
    tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if let Err(e) = run(cli) {
        if json {
            // On stderr: stdout keeps at most the one document of results.
            eprintln!("{}", serde_json::json!({ "error": format!("{e:#}") }));
        } else {
            eprintln!("error: {e:#}");
        }
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Demo(a) => demo::run(a),
        Cmd::Testbed(c) => testbed::run(c),
        Cmd::Gensort(a) => records::gensort(a),
        Cmd::Valsort(a) => records::valsort(a),
        Cmd::FusedBench(a) => fusedbench::run(a),
        Cmd::JournalBench(a) => journalbench::run(a),
        Cmd::LeveldbBench(a) => leveldbbench::run(a),
        Cmd::ComputeLoad(a) => computeload::run(a),
        Cmd::PifoBench(a) => pifobench::run(a),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every verb and every argument of `nearstore-lab --help` and of each verb's help, at
    /// any depth, has a description.
    #[test]
    fn every_verb_and_argument_has_help() {
        let missing = nearstore_testkit::without_help(Cli::command(), "nearstore-lab");
        assert!(missing.is_empty(), "arguments without a description:\n{}", missing.join("\n"));
        // The walk reaches the nested verbs and their arguments.
        let mut cmd = Cli::command();
        cmd.build();
        let up = cmd.find_subcommand("testbed").and_then(|t| t.find_subcommand("up")).expect("testbed up");
        assert!(up.get_arguments().any(|a| a.get_id() == "image_size"));
    }
}
