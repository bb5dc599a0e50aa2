//! The compute verbs: checksum, grep, search, wc, select, copy, compress, decompress, sort,
//! merge. Each maps its files to virtual
//! objects and runs on the targets that hold them, or on the host (`--local`, or when a
//! file cannot offload), or reads the blocks over NVMe/TCP and computes here (`--pull`).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use nearstore_compute::Outcome;
use nearstore_host::device::{DeviceMap, Endpoint};
use nearstore_host::{csv_field, Host, HostError, How, Mode, Report};
use nearstore_target::config::Config;

use crate::{Output, Plain};

#[derive(clap::Args, Clone)]
pub struct Common {
    /// Device map (TOML, `[[namespace]]` entries naming a target namespace and the file it
    /// exports or a block device).
    #[arg(long)]
    pub map: Option<PathBuf>,
    /// A target's configuration: the files it exports map to its first listener.
    #[arg(long)]
    pub target_config: Option<PathBuf>,
    /// Compute on the host, reading through the file system.
    #[arg(long, conflicts_with = "pull")]
    pub local: bool,
    /// Compute on the host, reading the blocks over NVMe/TCP (what a host without offload does).
    #[arg(long)]
    pub pull: bool,
    /// Report bytes over the network against bytes processed, and the time (on stderr).
    #[arg(long)]
    pub stats: bool,
    /// Offload over our own NVMe/TCP connection even where the kernel attached the
    /// namespace (by default its connection carries the commands: NVMe passthrough).
    #[arg(long)]
    pub no_passthrough: bool,
    /// Fail, computing nothing, when a file cannot be offloaded (by default it is
    /// computed on the host, and stderr says why).
    #[arg(long, conflicts_with_all = ["local", "pull"])]
    pub offload_only: bool,
    /// Compute commands in flight per namespace.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub parallel: u32,
    /// Output format: normal (text) or json.
    #[arg(short = 'o', long, value_enum, default_value = "normal")]
    pub output_format: Output,
    #[command(flatten)]
    pub id: HostId,
}

/// Who the host is on its own connections to targets (the compute and fused verbs).
#[derive(clap::Args, Clone, Default)]
pub struct HostId {
    /// The host NQN of the host's own connections to targets (default: /etc/nvme/hostnqn
    /// or one derived from the machine id): whose tenant and rights the targets apply.
    #[arg(long)]
    pub hostnqn: Option<String>,
    /// The host's DH-HMAC-CHAP secret for its own connections to targets that ask for
    /// authentication (as nvme-cli's --dhchap-secret).
    #[arg(long, value_parser = crate::dhchap_secret)]
    pub dhchap_secret: Option<nearstore_dhchap::Secret>,
    /// The controller's DH-HMAC-CHAP secret: the targets must prove they hold it.
    #[arg(long, value_parser = crate::dhchap_secret, requires = "dhchap_secret")]
    pub dhchap_ctrl_secret: Option<nearstore_dhchap::Secret>,
}

impl HostId {
    pub fn identity(&self) -> nearstore_host::Identity {
        nearstore_host::Identity {
            hostnqn: self.hostnqn.clone(),
            dhchap_secret: self.dhchap_secret.clone(),
            dhchap_ctrl_secret: self.dhchap_ctrl_secret.clone(),
        }
    }
}

impl Common {
    fn mode(&self) -> Mode {
        if self.local {
            Mode::Local
        } else if self.pull {
            Mode::Pull
        } else {
            Mode::Offload
        }
    }

    pub(crate) fn host(&self) -> Result<Host> {
        let mut devices = DeviceMap::default();
        if let Some(p) = &self.map {
            let text = std::fs::read_to_string(p).with_context(|| format!("--map {}", p.display()))?;
            devices.load(&text).map_err(|e| anyhow::anyhow!("--map {}: {e}", p.display()))?;
        }
        if let Some(p) = &self.target_config {
            let cfg = Config::from_file(p).with_context(|| format!("--target-config {}", p.display()))?;
            let Some(l) = cfg.listener.iter().find(|l| !l.discovery) else {
                bail!("--target-config {}: no I/O listener", p.display());
            };
            for s in &cfg.subsystem {
                for n in &s.namespace {
                    if let Some(path) = &n.path {
                        let ep = Endpoint { address: l.address, nqn: s.nqn.clone(), nsid: n.nsid };
                        devices.add_file(path, ep).map_err(|e| anyhow::anyhow!("--target-config {}: {e}", p.display()))?;
                    }
                }
            }
        }
        let mut host = Host::new(devices);
        host.parallel = self.parallel as usize;
        host.passthrough = !self.no_passthrough;
        host.offload_only = self.offload_only;
        host.identity = self.id.identity();
        if self.output_format == Output::Normal && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            let bar = indicatif::ProgressBar::new(0);
            bar.set_style(
                indicatif::ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}")
                    .expect("template"),
            );
            host.progress = Some(Box::new(move |done, total| {
                // Only runs long enough to watch get a bar.
                if total >= 256 << 20 {
                    bar.set_length(total);
                    bar.set_position(done);
                    if done >= total {
                        bar.finish_and_clear();
                    }
                }
            }));
        }
        Ok(host)
    }
}

#[derive(Clone, Copy, clap::ValueEnum, PartialEq, Eq, Debug)]
pub enum Algorithm {
    Crc32c,
    Crc64Nvme,
    Xxh3_64,
    Xxh3_128,
    Blake3,
    Sha256,
    Md5,
}

impl Algorithm {
    fn op(self) -> &'static str {
        match self {
            Algorithm::Crc32c => "crc32c",
            Algorithm::Crc64Nvme => "crc64-nvme",
            Algorithm::Xxh3_64 => "xxh3-64",
            Algorithm::Xxh3_128 => "xxh3-128",
            Algorithm::Blake3 => "blake3",
            Algorithm::Sha256 => "sha256",
            Algorithm::Md5 => "md5",
        }
    }
}

#[derive(clap::Args)]
pub struct ChecksumArgs {
    /// The checksum or hash.
    #[arg(short = 'a', long, value_enum, default_value = "crc32c")]
    pub algorithm: Algorithm,
    /// The files, each computed where it lies.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    #[command(flatten)]
    pub common: Common,
}

#[derive(clap::Args)]
pub struct GrepArgs {
    /// A regular expression (Rust regex syntax), or a literal with --fixed-strings.
    pub pattern: String,
    /// The files, each computed where it lies.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Count matching lines, as grep -c (what grep does here by default).
    #[arg(short = 'c', long)]
    pub count: bool,
    /// Count matches of the expression instead of matching lines.
    #[arg(long, conflicts_with = "count")]
    pub matches: bool,
    /// The pattern is a literal: report match counts and the first offsets.
    #[arg(short = 'F', long)]
    pub fixed_strings: bool,
    /// With -F: how many match offsets to report per file.
    #[arg(long, default_value_t = 10)]
    pub max_offsets: u32,
    #[command(flatten)]
    pub common: Common,
}

#[derive(clap::Args)]
pub struct WcArgs {
    /// The files, each computed where it lies.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    #[command(flatten)]
    pub common: Common,
}

#[derive(clap::Args)]
pub struct CopyArgs {
    /// The file to copy.
    pub source: PathBuf,
    /// The copy, on the same file system to stay on the target.
    pub destination: PathBuf,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Clone, Copy, clap::ValueEnum, PartialEq, Eq, Debug)]
pub enum RowFormat {
    Csv,
    /// JSON lines: one object per line.
    Jsonl,
}

impl RowFormat {
    fn name(self) -> &'static str {
        match self {
            RowFormat::Csv => "csv",
            RowFormat::Jsonl => "jsonl",
        }
    }
}

#[derive(clap::Args)]
pub struct SelectArgs {
    /// The query, in S3 Select's SQL plus GROUP BY, HAVING, ORDER BY and LIMIT:
    /// SELECT ... FROM s3object s [WHERE ...] [GROUP BY ...] ... (docs/operations.md).
    pub query: String,
    /// The files, each computed where it lies.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// The files' format.
    #[arg(long, value_enum, default_value = "csv")]
    pub format: RowFormat,
    /// CSV: the first line is data, not column names (name columns _1, _2, ...).
    #[arg(long)]
    pub no_header: bool,
    /// CSV: the field delimiter.
    #[arg(long, default_value_t = ',')]
    pub delimiter: char,
    /// CSV: the quote character.
    #[arg(long, default_value_t = '"')]
    pub quote: char,
    /// CSV: skip lines starting with this character.
    #[arg(long)]
    pub comment: Option<char>,
    /// Write the rows into this file (one input file): the target writes them next to the
    /// input, and they do not cross the network.
    #[arg(long)]
    pub into: Option<PathBuf>,
    /// With --into: the rows' format.
    #[arg(long, value_enum, default_value = "csv")]
    pub into_format: RowFormat,
    /// With --into: the most bytes the output may take, with or without a unit (default: the input's size).
    #[arg(long, value_parser = crate::size)]
    pub into_capacity: Option<u64>,
    #[command(flatten)]
    pub common: Common,
}

#[derive(clap::Args)]
pub struct CompressArgs {
    /// The file to compress.
    pub input: PathBuf,
    /// The zstd file to write, on the same file system to stay on the target.
    pub output: PathBuf,
    /// zstd level: 1 (fast) to 19 (small), up to 22; negative levels are faster still.
    #[arg(short = 'l', long, default_value_t = 3, allow_negative_numbers = true)]
    pub level: i32,
    /// The most bytes the output may take, with or without a unit (default: zstd's bound for the input).
    #[arg(long, value_parser = crate::size)]
    pub capacity: Option<u64>,
    #[command(flatten)]
    pub common: Common,
}

#[derive(clap::Args)]
pub struct DecompressArgs {
    /// The zstd file.
    pub input: PathBuf,
    /// The file to write, on the same file system to stay on the target.
    pub output: PathBuf,
    /// The most bytes the output may take, with or without a unit (default: the size the zstd frame declares).
    #[arg(long, value_parser = crate::size)]
    pub capacity: Option<u64>,
    #[command(flatten)]
    pub common: Common,
}

#[derive(clap::Args)]
pub struct SortArgs {
    /// The files to sort (or, for merge, the sorted files to merge).
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// The sorted output.
    #[arg(long, required_unless_present = "ranges")]
    pub into: Option<PathBuf>,
    /// Sort files that lie on several targets as one data set: every target sorts its
    /// own, then the output's target merges (or, with --ranges, every target merges one
    /// range of keys). Needs the targets' tags in the --map file.
    #[arg(long)]
    pub across: bool,
    /// With --across: instead of one output, a file of this name on every target (beside
    /// its first input), each holding one range of keys, in the map's device order.
    #[arg(long, requires = "across", conflicts_with = "into")]
    pub ranges: Option<String>,
    /// With --across: how runs reach the merging target: `d2d` (it reads them from its
    /// peers itself) or `host` (the host copies them there first).
    #[arg(long, requires = "across", default_value = "d2d", value_parser = ["d2d", "host"])]
    pub transfer: String,
    /// With --across: seconds a step waits for blocks another step holds.
    #[arg(long, requires = "across", default_value_t = 600)]
    pub lock_timeout: u64,
    /// Fixed-size records of this many bytes (default: lines, compared as bytes, like
    /// LC_ALL=C sort).
    #[arg(long)]
    pub record_size: Option<usize>,
    /// With --record-size: where the key starts in a record.
    #[arg(long, requires = "record_size")]
    pub key_offset: Option<usize>,
    /// With --record-size: the key's length (default: the rest of the record).
    #[arg(long, requires = "record_size")]
    pub key_length: Option<usize>,
    /// With --record-size: `bytes` (compared as unsigned bytes) or `u64` (a little-endian
    /// unsigned 64-bit integer).
    #[arg(long, requires = "record_size", value_parser = ["bytes", "u64"])]
    pub key_type: Option<String>,
    /// The most bytes the output may take, with or without a unit (default: the inputs' size, and a byte each
    /// for a missing last newline).
    #[arg(long, value_parser = crate::size)]
    pub capacity: Option<u64>,
    #[command(flatten)]
    pub common: Common,
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?)
}

pub fn checksum(a: ChecksumArgs) -> Result<()> {
    stream(a.algorithm.op(), Vec::new(), &a.files, &a.common)
}

pub fn grep(a: GrepArgs) -> Result<()> {
    let (op, args) = if a.fixed_strings {
        ("search", serde_json::json!({ "pattern": a.pattern, "max_offsets": a.max_offsets }))
    } else if a.matches {
        ("regex-count", serde_json::json!({ "pattern": a.pattern }))
    } else {
        ("grep-count", serde_json::json!({ "pattern": a.pattern }))
    };
    stream(op, serde_json::to_vec(&args)?, &a.files, &a.common)
}

pub fn wc(a: WcArgs) -> Result<()> {
    stream("wc", Vec::new(), &a.files, &a.common)
}

pub fn select(a: SelectArgs) -> Result<()> {
    let args = serde_json::json!({
        "query": a.query,
        "format": a.format.name(),
        "header": !a.no_header,
        "delimiter": a.delimiter,
        "quote": a.quote,
        "comment": a.comment,
        "output_format": a.into_format.name(),
    });
    let args = serde_json::to_vec(&args)?;
    let Some(into) = &a.into else {
        return stream("select", args, &a.files, &a.common);
    };
    let [input] = &a.files[..] else { bail!("--into takes one input file, not {}", a.files.len()) };
    transform("select", args, std::slice::from_ref(input), into, a.into_capacity, &a.common)
}

pub fn copy(a: CopyArgs) -> Result<()> {
    transform("copy", Vec::new(), std::slice::from_ref(&a.source), &a.destination, None, &a.common)
}

pub fn compress(a: CompressArgs) -> Result<()> {
    let args = serde_json::to_vec(&serde_json::json!({ "level": a.level }))?;
    transform("compress", args, std::slice::from_ref(&a.input), &a.output, a.capacity, &a.common)
}

pub fn decompress(a: DecompressArgs) -> Result<()> {
    transform("decompress", Vec::new(), std::slice::from_ref(&a.input), &a.output, a.capacity, &a.common)
}

/// sort or merge.
pub fn sort(op: &str, a: SortArgs) -> Result<()> {
    let mut args = serde_json::Map::new();
    for (k, v) in [("record_size", a.record_size), ("key_offset", a.key_offset), ("key_length", a.key_length)] {
        if let Some(v) = v {
            args.insert(k.into(), v.into());
        }
    }
    if let Some(t) = a.key_type.clone() {
        args.insert("key_type".into(), t.into());
    }
    if a.across {
        if op != "sort" {
            bail!("--across: only sort runs across targets (a merge across them is what it does)");
        }
        return sort_across(args, a);
    }
    let into = a.into.clone().context("--into: give the output file")?;
    transform(op, serde_json::to_vec(&args)?, &a.inputs, &into, a.capacity, &a.common)
}

/// `sort --across`: the orchestrator's distributed sort.
fn sort_across(args: serde_json::Map<String, serde_json::Value>, a: SortArgs) -> Result<()> {
    use nearstore_host::dsort::{self, SortAcross, SortOutput, Transfer};
    if a.common.local || a.common.pull {
        bail!("--across runs on the targets: --local and --pull do not apply");
    }
    if a.capacity.is_some() {
        bail!("--across: the capacity of runs and outputs follows from the inputs; --capacity does not apply");
    }
    let host = a.common.host()?;
    let req = SortAcross {
        inputs: a.inputs.clone(),
        args: serde_json::Value::Object(args),
        output: match (&a.ranges, &a.into) {
            (Some(name), _) => SortOutput::Ranges(name.clone()),
            (None, Some(p)) => SortOutput::One(p.clone()),
            (None, None) => bail!("--into or --ranges: where the sorted records go"),
        },
        transfer: if a.transfer == "host" { Transfer::HostMediated } else { Transfer::DeviceToDevice },
    };
    let opts = nearstore_host::orchestrator::Options {
        lock_timeout: std::time::Duration::from_secs(a.lock_timeout),
        identity: host.identity.clone(),
        ..Default::default()
    };
    let quiet = a.common.output_format == Output::Json;
    let progress = move |m: &str| {
        if !quiet {
            eprintln!("{m}");
        }
    };
    let locks = std::sync::Arc::new(nearstore_host::orchestrator::Locks::default());
    let r = runtime()?.block_on(dsort::sort_across(&host.devices, locks, &req, &opts, &progress))?;
    if a.common.output_format == Output::Json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    for p in &r.outputs {
        println!("{}: {} records, {} bytes (device {})", p.path.display(), p.records, p.bytes, p.device);
    }
    if a.common.stats {
        eprintln!("{} bytes over {} devices ({}) in {}", r.bytes, r.devices, a.transfer, r.phases);
    }
    Ok(())
}

/// Runs an operation that writes an output file: on the target that holds the inputs and
/// the output, else here.
fn transform(op: &str, args: Vec<u8>, inputs: &[PathBuf], output: &std::path::Path, capacity: Option<u64>, common: &Common) -> Result<()> {
    let op = nearstore_compute::by_name(op)?;
    let cap = match capacity {
        Some(c) => c,
        None => nearstore_host::output_capacity(op, inputs)?,
    };
    let mut host = common.host()?;
    let r = runtime()?.block_on(host.transform(op, &args, inputs, output, cap, common.mode())).map_err(in_user_terms)?;
    print_report(&r, common, &[])
}

/// Runs a streaming operation over each file, as sha256sum does: a file that cannot be read
/// or fails is reported for itself on stderr, the others are still computed, and the exit
/// status is 1 at the end.
fn stream(op: &str, args: Vec<u8>, files: &[PathBuf], common: &Common) -> Result<()> {
    let op = nearstore_compute::by_name(op)?;
    let mut host = common.host()?;
    let rt = runtime()?;
    let mut failed: Vec<(PathBuf, String)> = Vec::new();
    let readable: Vec<PathBuf> = files
        .iter()
        .filter(|f| match std::fs::File::open(f).and_then(|h| h.metadata()) {
            Ok(m) if m.is_file() => true,
            Ok(_) => {
                failed.push(((*f).clone(), "not a regular file".into()));
                false
            }
            Err(e) => {
                failed.push(((*f).clone(), e.to_string()));
                false
            }
        })
        .cloned()
        .collect();
    let report = if readable.is_empty() {
        Report::default()
    } else {
        match rt.block_on(host.run(op, &args, &readable, common.mode())) {
            Ok(r) => r,
            // One file's failure failed the call: each file again on its own, to report
            // which (a refusal of --offload-only, or one file alone, is the answer as it is).
            Err(e) if readable.len() == 1 || matches!(e, HostError::NotOffloaded(_)) => return Err(in_user_terms(e)),
            Err(_) => {
                let mut all = Report::default();
                for f in &readable {
                    match rt.block_on(host.run(op, &args, std::slice::from_ref(f), common.mode())) {
                        Ok(r) => {
                            all.files.extend(r.files);
                            all.bytes_processed += r.bytes_processed;
                            all.wire_sent += r.wire_sent;
                            all.wire_received += r.wire_received;
                            all.elapsed_secs += r.elapsed_secs;
                            all.via_kernel.extend(r.via_kernel);
                        }
                        Err(e) => failed.push((f.clone(), file_error(in_user_terms(e), f))),
                    }
                }
                all.via_kernel.sort();
                all.via_kernel.dedup();
                all
            }
        }
    };
    // One file alone: its error is the error.
    if let ([f], [(_, e)]) = (files, &failed[..]) {
        bail!("{}: {e}", f.display());
    }
    // In the order given, as sha256sum reports them.
    failed.sort_by_key(|(f, _)| files.iter().position(|g| g == f));
    for (f, e) in &failed {
        eprintln!("nearstore: {}: {e}", f.display());
    }
    print_report(&report, common, &failed)?;
    match failed.len() {
        0 => Ok(()),
        n => bail!("{n} of {} files failed", files.len()),
    }
}

/// A file's error without its path when the message already starts with it.
fn file_error(e: anyhow::Error, f: &std::path::Path) -> String {
    let msg = crate::message(&e);
    let prefix = format!("{}: ", f.display());
    msg.strip_prefix(&prefix).map(str::to_string).unwrap_or(msg)
}

/// An error in the user's terms where the target's are the protocol's: a result too big to
/// return inline names --into. The first words stay in the detail (-v).
fn in_user_terms(e: HostError) -> anyhow::Error {
    if e.is_result_too_large() {
        let said = "the result is too big to return inline (docs/protocol.md gives the limit): write the rows into a file with --into FILE";
        return Plain { said: said.into(), detail: e.to_string() }.into();
    }
    e.into()
}

/// The results on stdout (with the files that failed, in JSON), then on stderr why files
/// were computed on the host, one line per cause, and with --stats the costs.
fn print_report(r: &Report, common: &Common, failed: &[(PathBuf, String)]) -> Result<()> {
    if common.output_format == Output::Json {
        let mut v = serde_json::to_value(r)?;
        if !failed.is_empty() {
            let errors: Vec<_> = failed.iter().map(|(p, e)| serde_json::json!({ "path": p, "error": e })).collect();
            v["errors"] = errors.into();
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        for f in &r.files {
            let p = f.path.display();
            match &f.outcome {
                Outcome::Digest { hex, .. } => println!("{hex}  {p}"),
                Outcome::Count { count } => println!("{p}:{count}"),
                Outcome::Search { count, offsets } => {
                    let shown: Vec<String> = offsets.iter().map(|o| o.to_string()).collect();
                    println!("{p}: {count} matches{}{}", if shown.is_empty() { "" } else { " at " }, shown.join(","));
                }
                Outcome::Wc { bytes, lines, words } => println!("{lines:>8} {words:>8} {bytes:>10} {p}"),
                Outcome::Sorted { input, output, records, .. } => println!("{p}: {records} records, {input} bytes read, {output} written"),
                Outcome::Merged { input, output, records, .. } => println!("{p}: {records} records, {input} bytes read, {output} written"),
                Outcome::Written { input, output } => {
                    let ratio = if *output > 0 { format!(" ({:.2}:1)", *input as f64 / *output as f64) } else { String::new() };
                    println!("{p}: {input} bytes read, {output} written{ratio}")
                }
                Outcome::Select { columns, rows, records, rows_out, output, .. } => {
                    if !rows.is_empty() || *output == 0 {
                        if r.files.len() > 1 {
                            println!("==> {p} <==");
                        }
                        println!(
                            "{}",
                            columns.iter().map(|c| csv_field(&serde_json::Value::from(c.as_str()))).collect::<Vec<_>>().join(",")
                        );
                        for row in rows {
                            println!("{}", row.iter().map(csv_field).collect::<Vec<_>>().join(","));
                        }
                    } else {
                        println!("{p}: {rows_out} rows from {records} records, {output} bytes written");
                    }
                }
            }
        }
    }
    // Asked for with --local: no news. Otherwise the host computing a file is.
    if !common.local {
        let local = nearstore_host::causes(r.files.iter().filter_map(|f| match &f.how {
            How::Local(reason) => Some((f.path.as_path(), reason.as_str())),
            _ => None,
        }));
        let hint = if common.map.is_none() && common.target_config.is_none() {
            " (--map or --target-config names the targets that export images; --offload-only refuses)"
        } else {
            " (--offload-only refuses)"
        };
        for c in local {
            eprintln!("nearstore: computed on the host, not offloaded: {c}{hint}");
        }
    }
    if common.stats {
        let offloaded = r.files.iter().filter(|f| f.how == How::Offloaded).count();
        let pulled = r.files.iter().filter(|f| f.how == How::Pulled).count();
        let local = r.files.iter().filter(|f| matches!(f.how, How::Local(_))).count();
        let wire = r.wire_sent + r.wire_received;
        let pct = if r.bytes_processed > 0 { wire as f64 * 100.0 / r.bytes_processed as f64 } else { 0.0 };
        eprintln!(
            "{} files ({offloaded} offloaded, {pulled} pulled, {} local): {} processed, {} over the network ({pct:.4}%), {:.3} s, {:.1} MB/s",
            r.files.len(),
            local,
            human(r.bytes_processed),
            human(wire),
            r.elapsed_secs,
            r.bytes_processed as f64 / r.elapsed_secs.max(1e-9) / 1e6
        );
        if !r.via_kernel.is_empty() {
            eprintln!("  offloaded through the kernel's NVMe/TCP connection on {}", r.via_kernel.join(", "));
        }
    }
    Ok(())
}

fn human(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", units[u])
    }
}
