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

/// How read-modify-write combines a file's bytes with the data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ModifyKind {
    /// The bytes become the data.
    Replace,
    /// Little-endian unsigned integers of --width bytes, each plus the data's, wrapping.
    Add,
    /// Byte by byte, the bytes xor the data.
    Xor,
    /// Little-endian unsigned integers of --width bytes, each the value of --expr.
    Expr,
}

#[derive(clap::Args)]
pub struct ModifyArgs {
    /// The file, changed in place (not past its end).
    pub file: PathBuf,
    /// The byte of the file where the change starts.
    #[arg(long, default_value_t = 0)]
    pub offset: u64,
    /// How the file's bytes combine with the data.
    #[arg(long, value_enum)]
    pub modify: ModifyKind,
    /// add, expr: the integers' width in bytes.
    #[arg(long, default_value_t = 8, value_parser = clap::builder::TypedValueParser::map(clap::builder::PossibleValuesParser::new(["1", "2", "4", "8"]), |s: String| s.parse::<u8>().expect("one of the widths")))]
    pub width: u8,
    /// expr: a postfix expression over x (the file's integer) and d (the data's), constants 0
    /// to 15, + - * & | ^, min, max; at most five tokens ("x d max", "x d + 15 min").
    #[arg(long, required_if_eq("modify", "expr"))]
    pub expr: Option<String>,
    /// The data to combine with (`-`: standard input).
    #[arg(long)]
    pub input: PathBuf,
    #[command(flatten)]
    pub at: Where,
}

#[derive(clap::Args)]
pub struct CompressWriteArgs {
    /// The file the frame is written into: at its end (an append), or at --offset.
    pub file: PathBuf,
    /// The byte of the file where the frame goes, at most its size (default: its end).
    #[arg(long)]
    pub offset: Option<u64>,
    /// zstd level, from -7 to 19 (0: 3).
    #[arg(long, default_value_t = 3, allow_negative_numbers = true)]
    pub level: i8,
    /// The data to compress (`-`: standard input).
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
                    print_appended(a.at.output_format, &done)?;
                    return Err(failed(e, format!("appending to {}", a.file.display())));
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

/// The context of a failed fused operation: its transaction, for OUTCOME.
fn failed(e: nearstore_host::HostError, what: String) -> anyhow::Error {
    let txid = e.txid();
    let e = anyhow::Error::new(e).context(what);
    match txid {
        Some(t) => e.context(format!("transaction {t} did not complete; ask the target for its outcome")),
        None => e,
    }
}

/// `read-modify-write`: prints the crc32c of the new bytes, where they start and how many.
pub fn read_modify_write(a: ModifyArgs) -> Result<()> {
    use nearstore_host::fused::Modify;
    let data = input(&a.input)?;
    if a.expr.is_some() && a.modify != ModifyKind::Expr {
        bail!("--expr is for --modify expr");
    }
    let m = match a.modify {
        ModifyKind::Replace => Modify::Replace,
        ModifyKind::Xor => Modify::Xor,
        ModifyKind::Add => Modify::Add { width: a.width },
        ModifyKind::Expr => {
            Modify::expression(a.width, a.expr.as_deref().unwrap_or_default()).map_err(|e| anyhow::anyhow!("--expr: {e}"))?
        }
    };
    if data.is_empty() || (m.width().is_some() && !data.len().is_multiple_of(a.width as usize)) {
        bail!("--input {}: {} bytes are not whole {}-byte integers", a.input.display(), data.len(), a.width);
    }
    let mut host = a.at.host()?;
    let w = runtime()?
        .block_on(host.read_modify_write(&a.file, a.offset, m, &data))
        .map_err(|e| failed(e, format!("changing {}", a.file.display())))?;
    print_written(a.at.output_format, &w, a.offset, data.len())
}

/// `compress-write`: prints the frame's crc32c, where it starts, its length, the input's
/// and the file byte after it.
pub fn compress_write(a: CompressWriteArgs) -> Result<()> {
    let data = input(&a.input)?;
    if data.is_empty() {
        bail!("--input {}: no data to compress", a.input.display());
    }
    let mut host = a.at.host()?;
    let w = runtime()?
        .block_on(host.compress_write(&a.file, a.offset, &data, a.level))
        .map_err(|e| failed(e, format!("writing a frame into {}", a.file.display())))?;
    print_written(a.at.output_format, &w, w.end - w.count as u64, data.len())
}

fn print_written(format: Output, w: &nearstore_host::fused::Written, offset: u64, input: usize) -> Result<()> {
    match format {
        Output::Json => println!(
            "{}",
            serde_json::json!({ "txid": w.txid, "crc32c": format!("{:08x}", w.crc), "offset": offset, "bytes": w.count, "input": input, "end": w.end })
        ),
        Output::Normal => println!("crc32c {:08x}  offset {offset}  bytes {}  input {input}  end {}", w.crc, w.count, w.end),
    }
    Ok(())
}

pub fn read_checksum(a: ReadChecksumArgs) -> Result<()> {
    let size = std::fs::metadata(&a.file).with_context(|| a.file.display().to_string())?.len();
    let len = a.length.unwrap_or(size.saturating_sub(a.offset));
    // Checked before --output is created over whatever is there (the host library checks
    // again against the file it maps).
    anyhow::ensure!(
        a.offset.checked_add(len).is_some_and(|end| end <= size),
        "{}: {len} bytes at {} are not inside its {size} bytes",
        a.file.display(),
        a.offset
    );
    let mut host = a.at.host()?;
    // The bytes go to --output (or nowhere) as they arrive: a range of any size in the
    // memory of one piece.
    let mut out: Box<dyn std::io::Write> = match &a.output {
        Some(p) => Box::new(std::io::BufWriter::new(std::fs::File::create(p).with_context(|| format!("--output {}", p.display()))?)),
        None => Box::new(std::io::sink()),
    };
    let crc = runtime()?
        .block_on(host.read_checksum_into(&a.file, a.offset, len, &mut out))
        .with_context(|| format!("reading {}", a.file.display()))?;
    out.flush().with_context(|| format!("--output {}", a.output.as_deref().unwrap_or(Path::new("-")).display()))?;
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
    fn the_modify_and_compress_verbs_parse_their_options() {
        use clap::Parser;
        #[derive(clap::Parser)]
        enum Cli {
            Rmw(super::ModifyArgs),
            Cw(super::CompressWriteArgs),
        }
        let rmw = |w: &str| Cli::try_parse_from(["x", "rmw", "f", "--modify", "add", "--width", w, "--input", "-"]);
        for w in ["1", "2", "4", "8"] {
            assert!(matches!(rmw(w), Ok(Cli::Rmw(a)) if a.width.to_string() == w), "width {w}");
        }
        for w in ["0", "3", "16", "x"] {
            assert!(rmw(w).is_err(), "width {w}");
        }
        let cw = |l: &str| Cli::try_parse_from(["x", "cw", "f", "--level", l, "--input", "-"]);
        assert!(matches!(cw("-5"), Ok(Cli::Cw(a)) if a.level == -5 && a.offset.is_none()));
        assert!(matches!(cw("19"), Ok(Cli::Cw(a)) if a.level == 19));
        assert!(cw("200").is_err());
    }

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
