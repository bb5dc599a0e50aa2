//! The fused write verbs (docs/compute-protocol.md, "Fused write operations"):
//! append-crc-write appends LevelDB log records to a file, framed and checksummed on the
//! target through its MicroTx journal; write-checksum and read-checksum write or read a
//! file's bytes and print the crc32c the target computed of exactly them.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use nearstore_host::Host;

use crate::compute::{Common, HostId};
use crate::Output;

/// Where the file's target is, and how to print.
#[derive(clap::Args)]
pub struct Where {
    /// Device map (TOML, `[[namespace]]` entries naming a target namespace and the file it
    /// exports or a block device).
    #[arg(long)]
    pub map: Option<PathBuf>,
    /// A target's configuration: the files it exports map to its first listener.
    #[arg(long)]
    pub target_config: Option<PathBuf>,
    /// Output format: normal (text) or json.
    #[arg(short = 'o', long, value_enum, default_value = "normal")]
    pub output_format: Output,
    #[command(flatten)]
    pub id: HostId,
}

impl Where {
    fn host(&self) -> Result<Host> {
        let common = Common {
            map: self.map.clone(),
            target_config: self.target_config.clone(),
            local: false,
            pull: false,
            stats: false,
            no_passthrough: true,
            offload_only: true,
            parallel: 1,
            output_format: Output::Json,
            id: self.id.clone(),
        };
        common.host()
    }
}

#[derive(clap::Args)]
pub struct AppendArgs {
    /// The log file (a LevelDB log: 32 KiB blocks of records); appended at its end.
    pub file: PathBuf,
    /// The data to append (`-`: standard input).
    #[arg(long)]
    pub input: PathBuf,
    /// One record per line of the input (without its newline; an empty line an empty
    /// record), instead of one record.
    #[arg(long)]
    pub lines: bool,
    #[command(flatten)]
    pub at: Where,
}

#[derive(clap::Args)]
pub struct WriteChecksumArgs {
    /// The file, written in place (not past its end).
    pub file: PathBuf,
    /// The byte of the file where the data goes.
    #[arg(long, default_value_t = 0)]
    pub offset: u64,
    /// The data to write (`-`: standard input).
    #[arg(long)]
    pub input: PathBuf,
    #[command(flatten)]
    pub at: Where,
}

#[derive(clap::Args)]
pub struct ReadChecksumArgs {
    /// The file.
    pub file: PathBuf,
    /// The first byte to read.
    #[arg(long, default_value_t = 0)]
    pub offset: u64,
    /// Bytes to read (default: to the end of the file).
    #[arg(long)]
    pub length: Option<u64>,
    /// Where the bytes read go (by default only the checksum is printed).
    #[arg(long)]
    pub output: Option<PathBuf>,
    #[command(flatten)]
    pub at: Where,
}

fn input(p: &Path) -> Result<Vec<u8>> {
    let mut v = Vec::new();
    if p == Path::new("-") {
        std::io::stdin().read_to_end(&mut v).context("reading standard input")?;
    } else {
        v = std::fs::read(p).with_context(|| format!("--input {}", p.display()))?;
    }
    Ok(v)
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

/// The lines of `data` without their newlines, empty ones included (LevelDB writes empty
/// records too): the newline ending the input ends its last line, none follows it.
fn lines(data: &[u8]) -> Vec<&[u8]> {
    if data.is_empty() {
        return Vec::new();
    }
    data.strip_suffix(b"\n").unwrap_or(data).split(|&b| b == b'\n').collect()
}

/// `append-crc-write`: prints, per record, its crc32c, the bytes appended and the log's
/// new length.
pub fn append(a: AppendArgs) -> Result<()> {
    let data = input(&a.input)?;
    let records: Vec<&[u8]> = if a.lines { lines(&data) } else { vec![&data] };
    let mut host = a.at.host()?;
    let done = runtime()?.block_on(async {
        let mut done = Vec::with_capacity(records.len());
        for r in &records {
            match host.append_crc_write(&a.file, r).await {
                Ok(d) => done.push(d),
                // The message names the transaction (HostError::Fused), and the records
                // appended before it are printed: the operator can ask for its outcome.
                Err(e) => {
                    let txid = e.txid();
                    print_appended(a.at.output_format, &done)?;
                    let e = anyhow::Error::new(e).context(format!("appending to {}", a.file.display()));
                    return Err(match txid {
                        Some(t) => e.context(format!("transaction {t} did not complete; ask the target for its outcome")),
                        None => e,
                    });
                }
            }
        }
        anyhow::Ok(done)
    })?;
    print_appended(a.at.output_format, &done)
}

/// Per appended record: its crc32c, the bytes appended and the log's new length (and, in
/// JSON, its transaction id).
fn print_appended(format: Output, done: &[nearstore_host::fused::Appended]) -> Result<()> {
    let mut out = std::io::stdout().lock();
    if format == Output::Json {
        let v: Vec<_> = done
            .iter()
            .map(|d| serde_json::json!({ "txid": d.txid, "crc32c": format!("{:08x}", d.crc), "bytes": d.count, "length": d.len }))
            .collect();
        writeln!(out, "{}", serde_json::to_string(&v)?)?;
    } else {
        for d in done {
            writeln!(out, "crc32c {:08x}  bytes {}  length {}", d.crc, d.count, d.len)?;
        }
    }
    Ok(())
}

pub fn write_checksum(a: WriteChecksumArgs) -> Result<()> {
    let data = input(&a.input)?;
    if data.is_empty() {
        bail!("--input {}: no data to write", a.input.display());
    }
    let mut host = a.at.host()?;
    let crc =
        runtime()?.block_on(host.write_checksum(&a.file, a.offset, &data)).with_context(|| format!("writing {}", a.file.display()))?;
    print_crc(a.at.output_format, crc, a.offset, data.len() as u64)
}

pub fn read_checksum(a: ReadChecksumArgs) -> Result<()> {
    let size = std::fs::metadata(&a.file).with_context(|| a.file.display().to_string())?.len();
    let len = a.length.unwrap_or(size.saturating_sub(a.offset));
    let mut host = a.at.host()?;
    let (data, crc) =
        runtime()?.block_on(host.read_checksum(&a.file, a.offset, len)).with_context(|| format!("reading {}", a.file.display()))?;
    if let Some(p) = &a.output {
        std::fs::write(p, &data).with_context(|| format!("--output {}", p.display()))?;
    }
    print_crc(a.at.output_format, crc, a.offset, len)
}

fn print_crc(format: Output, crc: u32, offset: u64, len: u64) -> Result<()> {
    match format {
        Output::Json => println!("{}", serde_json::json!({ "crc32c": format!("{crc:08x}"), "offset": offset, "bytes": len })),
        Output::Normal => println!("crc32c {crc:08x}  offset {offset}  bytes {len}"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// `--lines`: one record per line, an empty line an empty record. Before, empty lines
    /// were dropped.
    #[test]
    fn every_line_is_a_record() {
        // (input, records)
        let cases: [(&str, &[&str]); 7] = [
            ("", &[]),
            ("\n", &[""]),
            ("a", &["a"]),
            ("a\n", &["a"]),
            ("a\n\nb\n", &["a", "", "b"]),
            ("a\n\n", &["a", ""]),
            ("\n\na", &["", "", "a"]),
        ];
        for (input, want) in cases {
            let got: Vec<&[u8]> = super::lines(input.as_bytes());
            let want: Vec<&[u8]> = want.iter().map(|l| l.as_bytes()).collect();
            assert_eq!(got, want, "{input:?}");
        }
    }
}
