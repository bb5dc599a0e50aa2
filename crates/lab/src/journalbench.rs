//! `nearstore-lab journal-bench`: the MicroTx journal's recovery time against how much it
//! holds (docs/benchmarks.md, "Fused write operations"). For each count of transactions, a
//! fresh journal (`limits::MICROTX_JOURNAL_BYTES`) and namespace in DIR take that many
//! transactions of one block image each, as a target's fused writes leave them; the journal
//! is then dropped without a checkpoint (as a killed target leaves it) and opened again,
//! which reads it whole and replays every record it holds: that open is timed.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use nearstore_target::backend::{Backend, FileBackend};
use nearstore_target::limits::MICROTX_JOURNAL_BYTES;
use nearstore_target::microtx::{Journal, Tx};

use crate::Output;

#[derive(clap::Args)]
pub struct JournalBenchArgs {
    /// Where the journal and the namespace's image are made (removed after): the storage
    /// measured.
    #[arg(long)]
    pub dir: PathBuf,
    /// Transactions in the journal when it is opened again, one measurement each.
    #[arg(long, value_delimiter = ',', default_values_t = [0u64, 10, 100, 500, 1000])]
    pub transactions: Vec<u64>,
    /// Bytes of each transaction's block image (a multiple of 4096).
    #[arg(short = 'z', long, value_parser = crate::size, default_value = "4KiB")]
    pub size: u64,
    /// Opens timed per count (the median is printed).
    #[arg(long, default_value_t = 5)]
    pub repeat: usize,
    /// Output format: normal (text) or json.
    #[arg(short = 'o', long, value_enum, default_value = "normal")]
    pub output_format: Output,
}

pub fn run(a: JournalBenchArgs) -> Result<()> {
    const BS: u64 = 4096;
    if a.size == 0 || !a.size.is_multiple_of(BS) {
        bail!("--size {}: whole 4096-byte blocks", a.size);
    }
    let mut rows = Vec::new();
    for &n in &a.transactions {
        let dir = tempfile::tempdir_in(&a.dir).with_context(|| format!("a directory in {}", a.dir.display()))?;
        let data = FileBackend::open(&dir.path().join("ns.img"), Some(64 << 20))?;
        let log_path = dir.path().join("ns.img.microtx");
        let log = Arc::new(FileBackend::open(&log_path, Some(MICROTX_JOURNAL_BYTES))?);
        let (journal, _) = Journal::open(log, &data, BS)?;
        let gen = journal.generation();
        let image = vec![0x5au8; a.size as usize];
        let slots = data.size() / a.size;
        for i in 0..n {
            let tx = Tx { txid: i + 1, op: nearstore_wire::fused::op::WRITE_CHECKSUM, writes: vec![((i % slots) * a.size, image.clone())] };
            journal.run(&data, &tx).with_context(|| format!("transaction {}", i + 1))?;
        }
        if journal.generation() != gen {
            bail!("{n} transactions of {} bytes filled the journal (it checkpointed): ask for fewer", a.size);
        }
        drop(journal);
        let mut times = Vec::with_capacity(a.repeat);
        let mut records = 0;
        for r in 0..a.repeat {
            // The first open replays and checkpoints; later ones would find nothing: each
            // open is of a copy of the journal as the transactions left it.
            let copy = dir.path().join(format!("copy{r}.microtx"));
            std::fs::copy(&log_path, &copy)?;
            let log = Arc::new(FileBackend::open(&copy, None)?);
            drop_cache(&copy)?;
            let t = Instant::now();
            let (_, rec) = Journal::open(log, &data, BS)?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
            records = rec.records;
            std::fs::remove_file(&copy)?;
        }
        times.sort_by(f64::total_cmp);
        rows.push((n, records, times[times.len() / 2], times[0], times[times.len() - 1]));
    }
    match a.output_format {
        Output::Json => {
            let v: Vec<_> = rows
                .iter()
                .map(|&(n, r, med, lo, hi)| serde_json::json!({ "transactions": n, "records": r, "open_ms_median": med, "open_ms_min": lo, "open_ms_max": hi }))
                .collect();
            println!("{}", serde_json::to_string(&v)?);
        }
        Output::Normal => {
            println!("transactions  records  open ms (median, min-max of {})", a.repeat);
            for (n, r, med, lo, hi) in rows {
                println!("{n:>12}  {r:>7}  {med:.2} ({lo:.2}-{hi:.2})");
            }
        }
    }
    Ok(())
}

/// Drops `path`'s cached pages, so that the open reads the storage (a restart after a
/// crash of the machine finds nothing cached).
fn drop_cache(path: &std::path::Path) -> Result<()> {
    let f = std::fs::File::open(path)?;
    f.sync_all()?;
    Ok(nearstore_host::drop_cached(&f, path)?)
}
