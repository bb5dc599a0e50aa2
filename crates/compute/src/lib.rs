//! Streaming compute kernels: one crate, used by the target's offload engine and by the
//! host's local fallback, so offloaded and local results are the same by construction.
//!
//! A kernel sees the bytes of its input object in order, in chunks of any size (the
//! offload engine uses 1 MiB; tests use every split), keeps its own state between chunks,
//! and returns an [`Outcome`] at the end.
//!
//! Adding an operation: write a file with a type implementing [`Kernel`] and a `build`
//! function from its arguments, then add one line to [`OPERATIONS`] (docs/compute.md); the
//! operations and their arguments are listed in docs/operations.md.

pub mod compress;
mod context;
pub mod copy;
pub mod digest;
pub mod search;
pub mod select;
pub mod sort;
pub mod wc;

use serde::{Deserialize, Serialize};

pub use context::{Account, Context, Meter, Stop, STOP_CHECK_WORK};

/// A streaming operation over one input object.
pub trait Kernel: Send {
    /// The next bytes of the input, in order.
    fn update(&mut self, data: &[u8]);
    /// The input has ended: the result.
    fn finish(self: Box<Self>) -> Result<Outcome, ComputeError>;
    /// False once the kernel has its answer (a LIMIT reached, an error held): the rest
    /// of the input need not be read.
    fn wants_more(&self) -> bool {
        true
    }
}

/// What an operation returns. Serialised as JSON on the wire and by `-o json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Outcome {
    /// A checksum or hash, as lowercase hex of its big-endian bytes (what `sha256sum`,
    /// `b3sum`, `crc32c` tools print).
    Digest {
        algorithm: String,
        hex: String,
    },
    /// Literal search: every non-overlapping match counted, the first offsets listed.
    Search {
        count: u64,
        offsets: Vec<u64>,
    },
    /// A count: regular-expression matches, or matching lines.
    Count {
        count: u64,
    },
    Wc {
        bytes: u64,
        lines: u64,
        words: u64,
    },
    /// An operation that wrote an output object: bytes it read and bytes it wrote (the
    /// host truncates the output file to `output`).
    Written {
        input: u64,
        output: u64,
    },
    /// A sort asked for an index: as Written, plus the key and output offset of every
    /// so many records (the distributed sort picks its ranges from them).
    Sorted {
        input: u64,
        output: u64,
        records: u64,
        index: Vec<IndexEntry>,
    },
    /// A merge: as Written, plus the records written and the time it waited for its
    /// inputs' bytes (reading the media, or a peer over the network), in milliseconds: a
    /// measurement, not part of the result ([`Outcome::result`] leaves it out).
    Merged {
        input: u64,
        output: u64,
        records: u64,
        input_wait_ms: u64,
    },
    /// A query's result: its column names and, with no output object, its rows (JSON
    /// values); `records` read, `matched` by WHERE, `rows_out` produced, `output` bytes
    /// written to the output object.
    Select {
        columns: Vec<String>,
        rows: Vec<Vec<serde_json::Value>>,
        records: u64,
        matched: u64,
        rows_out: u64,
        output: u64,
    },
}

impl Outcome {
    /// The outcome without its measurements (a merge's input wait): what two runs of the
    /// same operation over the same bytes agree on, wherever they ran.
    pub fn result(&self) -> Outcome {
        match self {
            Outcome::Merged { input, output, records, .. } => {
                Outcome::Merged { input: *input, output: *output, records: *records, input_wait_ms: 0 }
            }
            o => o.clone(),
        }
    }

    /// Bytes written to the output object, for operations that write one.
    pub fn output_bytes(&self) -> Option<u64> {
        match self {
            Outcome::Written { output, .. } | Outcome::Sorted { output, .. } | Outcome::Merged { output, .. } => Some(*output),
            Outcome::Select { output, .. } => Some(*output),
            _ => None,
        }
    }
}

/// A record of a sorted output: its key (the bytes it is ordered by, as hex; a u64 key
/// big-endian) and its byte offset in the output.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IndexEntry {
    pub key: String,
    pub offset: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ComputeError {
    #[error("unknown operation '{0}'")]
    UnknownOperation(String),
    #[error("unknown operation id {0:#06x}")]
    UnknownOperationId(u16),
    #[error("arguments of {op}: {message}")]
    BadArguments { op: &'static str, message: String },
    #[error("{op}: a line longer than {limit} bytes at offset {offset}")]
    LineTooLong { op: &'static str, limit: usize, offset: u64 },
    #[error("{op} {message}")]
    Objects { op: &'static str, message: String },
    #[error("output object full: the operation produced more than its {capacity} bytes")]
    OutputFull { capacity: u64 },
    #[error("{op}: needs more than the {limit}-byte memory bound of one command ({what})")]
    Memory { op: &'static str, limit: usize, what: String },
    #[error("{op} returns more than {limit} bytes inline: give it an output object")]
    ResultTooLarge { op: &'static str, limit: usize },
    #[error("{op}: bad input data: {message}")]
    Data { op: &'static str, message: String },
    #[error("I/O: {0}")]
    Io(String),
    #[error("I/O writing the output: {0}")]
    WriteIo(String),
    #[error("timed out after {0} s")]
    Timeout(u64),
    /// The command was cancelled (its connection or controller went away).
    #[error("cancelled")]
    Cancelled,
}

/// Builds a kernel from an operation's arguments.
pub type BuildKernel = fn(&[u8], &Context) -> Result<Box<dyn Kernel>, ComputeError>;
/// Builds a transform from an operation's arguments.
pub type BuildTransform = fn(&[u8]) -> Result<Box<dyn Transform>, ComputeError>;

/// How an operation runs.
#[derive(Clone, Copy)]
pub enum Build {
    /// A streaming kernel run once per input object: one outcome per input.
    Stream(BuildKernel),
    /// A transform over all inputs and outputs at once (compress, sort, merge, copy,
    /// select): one outcome. `inputs` and `outputs` are the object counts it accepts.
    Transform { build: BuildTransform, inputs: (usize, usize), outputs: (usize, usize) },
    /// A query: with no output object, a stream kernel per input with its result inline;
    /// with one, a transform of one input into it.
    Either { stream: BuildKernel, transform: BuildTransform },
}

/// One registered operation: its name (CLI and docs), its id (the descriptor's operation
/// field) and how to build it from its arguments.
pub struct Operation {
    pub name: &'static str,
    pub id: u16,
    pub build: Build,
    pub summary: &'static str,
}

/// Bytes of one input object, pulled in order. The target reads them from its backend,
/// the host from a file or memory.
pub trait Source {
    /// The next chunk, never empty; None at the end.
    fn next_chunk(&mut self) -> Result<Option<&[u8]>, ComputeError>;
    /// The object's exact length in bytes.
    fn len(&self) -> u64;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where an output object's bytes go, in order.
pub trait Sink {
    fn write(&mut self, data: &[u8]) -> Result<(), ComputeError>;
    /// Bytes written so far.
    fn written(&self) -> u64;
}

/// An operation over several inputs and outputs.
pub trait Transform: Send {
    fn run(self: Box<Self>, inputs: &mut [&mut dyn Source], outputs: &mut [&mut dyn Sink], ctx: &Context) -> Result<Outcome, ComputeError>;
}

/// Every operation. Ids are part of the wire format: never reuse one.
pub static OPERATIONS: &[Operation] = &[
    Operation {
        name: "crc32c",
        id: 0x0001,
        build: Build::Stream(digest::crc32c),
        summary: "CRC-32C (Castagnoli), as iSCSI and NVMe digests",
    },
    Operation {
        name: "crc64-nvme",
        id: 0x0002,
        build: Build::Stream(digest::crc64_nvme),
        summary: "CRC-64/NVME, the NVMe end-to-end protection CRC",
    },
    Operation { name: "xxh3-64", id: 0x0003, build: Build::Stream(digest::xxh3_64), summary: "XXH3 64-bit, seed 0" },
    Operation { name: "xxh3-128", id: 0x0004, build: Build::Stream(digest::xxh3_128), summary: "XXH3 128-bit, seed 0" },
    Operation { name: "blake3", id: 0x0005, build: Build::Stream(digest::blake3), summary: "BLAKE3, 256-bit" },
    Operation { name: "sha256", id: 0x0006, build: Build::Stream(digest::sha256), summary: "SHA-256" },
    Operation {
        name: "md5",
        id: 0x0007,
        build: Build::Stream(digest::md5),
        summary: "MD5 (for matching existing catalogues, not for security)",
    },
    Operation {
        name: "search",
        id: 0x0010,
        build: Build::Stream(search::literal),
        summary: "literal search: match count and first offsets",
    },
    Operation {
        name: "regex-count",
        id: 0x0011,
        build: Build::Stream(search::regex_count),
        summary: "regular-expression matches, within lines",
    },
    Operation {
        name: "grep-count",
        id: 0x0012,
        build: Build::Stream(search::grep_count),
        summary: "lines matching a regular expression (grep -c)",
    },
    Operation { name: "wc", id: 0x0020, build: Build::Stream(wc::build), summary: "bytes, lines, words (wc)" },
    Operation {
        name: "select",
        id: 0x0030,
        build: Build::Either { stream: select::stream, transform: select::transform },
        summary: "SQL over CSV or JSON lines: rows inline or into the output object",
    },
    Operation {
        name: "compress",
        id: 0x0041,
        build: Build::Transform { build: compress::compress, inputs: (1, 1), outputs: (1, 1) },
        summary: "zstd compression into the output object; returns both sizes",
    },
    Operation {
        name: "decompress",
        id: 0x0042,
        build: Build::Transform { build: compress::decompress, inputs: (1, 1), outputs: (1, 1) },
        summary: "zstd decompression into the output object",
    },
    Operation {
        name: "sort",
        id: 0x0050,
        build: Build::Transform { build: sort::sort, inputs: (1, 63), outputs: (1, 1) },
        summary: "sort fixed-size records by a key range, or lines, within the memory bound",
    },
    Operation {
        name: "merge",
        id: 0x0051,
        build: Build::Transform { build: sort::merge, inputs: (1, 63), outputs: (1, 1) },
        summary: "merge sorted inputs (records or lines) into one sorted output, in any size",
    },
    Operation {
        name: "copy",
        id: 0x0040,
        build: Build::Transform { build: copy::build, inputs: (1, 1), outputs: (1, 1) },
        summary: "the input into the output object",
    },
];

pub fn by_name(name: &str) -> Result<&'static Operation, ComputeError> {
    OPERATIONS.iter().find(|o| o.name == name).ok_or_else(|| ComputeError::UnknownOperation(name.into()))
}

pub fn by_id(id: u16) -> Result<&'static Operation, ComputeError> {
    OPERATIONS.iter().find(|o| o.id == id).ok_or(ComputeError::UnknownOperationId(id))
}

impl Operation {
    /// Checks the arguments and the object counts before anything is read: what the
    /// target does on EXEC, and the host before it builds a descriptor.
    pub fn check(&self, args: &[u8], inputs: usize, outputs: usize) -> Result<(), ComputeError> {
        let counts = |(lo, hi): (usize, usize), n: usize, what: &str| {
            if n < lo || n > hi {
                let want = if lo == hi {
                    format!("{lo}")
                } else if hi == usize::MAX {
                    format!("at least {lo}")
                } else {
                    format!("{lo} to {hi}")
                };
                return Err(ComputeError::Objects { op: self.name, message: format!("takes {want} {what} objects, not {n}") });
            }
            Ok(())
        };
        match self.build {
            Build::Stream(b) => {
                counts((1, usize::MAX), inputs, "input")?;
                counts((0, 0), outputs, "output")?;
                b(args, &Context::default()).map(drop)
            }
            Build::Either { stream, transform } => {
                counts((0, 1), outputs, "output")?;
                if outputs == 0 {
                    counts((1, usize::MAX), inputs, "input")?;
                    stream(args, &Context::default()).map(drop)
                } else {
                    counts((1, 1), inputs, "input")?;
                    transform(args).map(drop)
                }
            }
            Build::Transform { build, inputs: i, outputs: o } => {
                counts(i, inputs, "input")?;
                counts(o, outputs, "output")?;
                build(args).map(drop)
            }
        }
    }

    /// Runs the operation: one outcome per input for a stream kernel, one for a transform.
    pub fn execute(
        &self,
        args: &[u8],
        inputs: &mut [&mut dyn Source],
        outputs: &mut [&mut dyn Sink],
        ctx: &Context,
    ) -> Result<Vec<Outcome>, ComputeError> {
        self.check(args, inputs.len(), outputs.len())?;
        let per_input = |b: BuildKernel, inputs: &mut [&mut dyn Source]| {
            inputs
                .iter_mut()
                .map(|src| {
                    let mut k = b(args, ctx)?;
                    while k.wants_more() {
                        ctx.stop.check()?;
                        match src.next_chunk()? {
                            Some(c) => k.update(c),
                            None => break,
                        }
                    }
                    k.finish()
                })
                .collect()
        };
        match self.build {
            Build::Stream(b) => per_input(b, inputs),
            Build::Either { stream, .. } if outputs.is_empty() => per_input(stream, inputs),
            Build::Transform { build, .. } | Build::Either { transform: build, .. } => {
                // Every chunk a transform reads passes a look at the stop.
                let mut stopping: Vec<Stopping> = inputs.iter_mut().map(|s| Stopping { src: &mut **s, stop: &ctx.stop }).collect();
                let mut inputs: Vec<&mut dyn Source> = stopping.iter_mut().map(|s| s as &mut dyn Source).collect();
                Ok(vec![build(args)?.run(&mut inputs, outputs, ctx)?])
            }
        }
    }
}

/// A source that looks at the command's [`Stop`] before each chunk.
struct Stopping<'a, 's> {
    src: &'a mut (dyn Source + 's),
    stop: &'a Stop,
}

impl Source for Stopping<'_, '_> {
    fn next_chunk(&mut self) -> Result<Option<&[u8]>, ComputeError> {
        self.stop.check()?;
        self.src.next_chunk()
    }
    fn len(&self) -> u64 {
        self.src.len()
    }
}

/// A [`Source`] over chunks held in memory: the local path for small data, and tests.
pub struct SliceSource<'a> {
    chunks: Vec<&'a [u8]>,
    next: usize,
    len: u64,
}

impl<'a> SliceSource<'a> {
    pub fn new(chunks: impl IntoIterator<Item = &'a [u8]>) -> SliceSource<'a> {
        let chunks: Vec<&[u8]> = chunks.into_iter().filter(|c| !c.is_empty()).collect();
        let len = chunks.iter().map(|c| c.len() as u64).sum();
        SliceSource { chunks, next: 0, len }
    }
}

impl Source for SliceSource<'_> {
    fn next_chunk(&mut self) -> Result<Option<&[u8]>, ComputeError> {
        let c = self.chunks.get(self.next).copied();
        self.next += 1;
        Ok(c)
    }
    fn len(&self) -> u64 {
        self.len
    }
}

/// A [`Sink`] into memory, with a capacity (an output object's allocated length).
pub struct VecSink {
    pub data: Vec<u8>,
    pub capacity: u64,
}

impl VecSink {
    pub fn new(capacity: u64) -> VecSink {
        VecSink { data: Vec::new(), capacity }
    }
}

impl Sink for VecSink {
    fn write(&mut self, data: &[u8]) -> Result<(), ComputeError> {
        if self.data.len() as u64 + data.len() as u64 > self.capacity {
            return Err(ComputeError::OutputFull { capacity: self.capacity });
        }
        self.data.extend_from_slice(data);
        Ok(())
    }
    fn written(&self) -> u64 {
        self.data.len() as u64
    }
}

/// Runs a stream operation over one input held in memory as chunks: tests and the
/// simplest local path.
pub fn run<'a>(op: &str, args: &[u8], chunks: impl IntoIterator<Item = &'a [u8]>) -> Result<Outcome, ComputeError> {
    let mut src = SliceSource::new(chunks);
    let mut out = by_name(op)?.execute(args, &mut [&mut src], &mut [], &Context::default())?;
    Ok(out.remove(0))
}

/// Parses an operation's JSON arguments, naming the operation in the error.
pub(crate) fn parse_args<T: serde::de::DeserializeOwned>(op: &'static str, args: &[u8]) -> Result<T, ComputeError> {
    serde_json::from_slice(args).map_err(|e| ComputeError::BadArguments { op, message: e.to_string() })
}

/// No arguments: empty, or an empty JSON object.
pub(crate) fn no_args(op: &'static str, args: &[u8]) -> Result<(), ComputeError> {
    if args.is_empty() || args.iter().all(u8::is_ascii_whitespace) {
        return Ok(());
    }
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Empty {}
    parse_args::<Empty>(op, args).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_ids_are_unique() {
        for (i, a) in OPERATIONS.iter().enumerate() {
            for b in &OPERATIONS[i + 1..] {
                assert_ne!(a.name, b.name);
                assert_ne!(a.id, b.id);
            }
            assert_eq!(by_id(a.id).unwrap().name, a.name);
        }
        assert!(matches!(by_name("nope"), Err(ComputeError::UnknownOperation(_))));
        assert!(matches!(by_id(0xffff), Err(ComputeError::UnknownOperationId(0xffff))));
    }
}
