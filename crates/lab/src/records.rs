//! `nearstore-lab gensort` and `valsort`: the sort benchmark's data sets, written and
//! checked (the format is in `sortbench.rs`).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use crate::Output;

#[derive(clap::Args)]
pub struct GensortArgs {
    /// Records to write (100 bytes each).
    #[arg(long)]
    pub records: u64,
    /// The first record's number (to write a data set in pieces).
    #[arg(long, default_value_t = 0)]
    pub start: u64,
    /// The data set: the same seed gives the same records.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The file to write.
    pub file: PathBuf,
}

#[derive(clap::Args)]
pub struct ValsortArgs {
    /// Files, read one after another as one sequence of records.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Output format: normal (text) or json.
    #[arg(short = 'o', long, value_enum, default_value = "normal")]
    pub output_format: Output,
}

/// Writes sort-benchmark records (`sortbench`).
pub fn gensort(a: GensortArgs) -> Result<()> {
    use std::io::Write;
    let f = std::fs::File::create(&a.file).with_context(|| a.file.display().to_string())?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
    let end = a.start.checked_add(a.records).context("--start + --records overflows")?;
    for i in a.start..end {
        w.write_all(&crate::sortbench::record(a.seed, i))?;
    }
    w.flush()?;
    Ok(())
}

/// The sort benchmark's summary of files read one after another as one sequence of
/// records: count, order, checksum.
pub fn validate_records(files: &[PathBuf]) -> Result<crate::sortbench::Summary> {
    use nearstore_compute::Source;
    let mut v = crate::sortbench::Validator::default();
    for p in files {
        let mut f = nearstore_host::FileSource::open(p)?;
        while let Some(c) = f.next_chunk().with_context(|| p.display().to_string())? {
            v.update(c);
        }
    }
    v.finish()
}

/// Checks order and the records' checksum; fails when they are not in order.
pub fn valsort(a: ValsortArgs) -> Result<()> {
    let s = validate_records(&a.files)?;
    if a.output_format == Output::Json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        println!("records {}\nduplicate keys {}\nchecksum {}", s.records, s.duplicate_keys, s.checksum);
    }
    match s.first_unordered {
        None => Ok(()),
        Some(i) => bail!("not sorted: record {i} sorts before the one before it"),
    }
}
