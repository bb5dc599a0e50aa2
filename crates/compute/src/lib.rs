//! Streaming compute kernels: one crate, used by the target's offload engine and by the
//! host's local fallback, so offloaded and local results are the same by construction.
//!
//! A kernel sees the bytes of its input object in order, in chunks of any size (the
//! offload engine uses 1 MiB; tests use every split), keeps its own state between chunks,
//! and returns an [`Outcome`] at the end.
//!
//! Adding an operation: write a file with a type implementing [`Kernel`] and a `build`
//! function from its arguments, then add one line to [`OPERATIONS`] (docs/compute.md).

pub mod digest;
pub mod search;
pub mod wc;

use serde::{Deserialize, Serialize};

/// A streaming operation over one input object.
pub trait Kernel: Send {
    /// The next bytes of the input, in order.
    fn update(&mut self, data: &[u8]);
    /// The input has ended: the result.
    fn finish(self: Box<Self>) -> Result<Outcome, ComputeError>;
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
}

/// Builds a kernel from an operation's arguments.
pub type Build = fn(&[u8]) -> Result<Box<dyn Kernel>, ComputeError>;

/// One registered operation: its name (CLI and docs), its id (the descriptor's operation
/// field) and how to build it from its arguments.
pub struct Operation {
    pub name: &'static str,
    pub id: u16,
    pub build: Build,
    pub summary: &'static str,
}

/// Every operation. Ids are part of the wire format: never reuse one.
pub static OPERATIONS: &[Operation] = &[
    Operation { name: "crc32c", id: 0x0001, build: digest::crc32c, summary: "CRC-32C (Castagnoli), as iSCSI and NVMe digests" },
    Operation { name: "crc64-nvme", id: 0x0002, build: digest::crc64_nvme, summary: "CRC-64/NVME, the NVMe end-to-end protection CRC" },
    Operation { name: "xxh3-64", id: 0x0003, build: digest::xxh3_64, summary: "XXH3 64-bit, seed 0" },
    Operation { name: "xxh3-128", id: 0x0004, build: digest::xxh3_128, summary: "XXH3 128-bit, seed 0" },
    Operation { name: "blake3", id: 0x0005, build: digest::blake3, summary: "BLAKE3, 256-bit" },
    Operation { name: "sha256", id: 0x0006, build: digest::sha256, summary: "SHA-256" },
    Operation { name: "md5", id: 0x0007, build: digest::md5, summary: "MD5 (for matching existing catalogues, not for security)" },
    Operation { name: "search", id: 0x0010, build: search::literal, summary: "literal search: match count and first offsets" },
    Operation { name: "regex-count", id: 0x0011, build: search::regex_count, summary: "regular-expression matches, within lines" },
    Operation { name: "grep-count", id: 0x0012, build: search::grep_count, summary: "lines matching a regular expression (grep -c)" },
    Operation { name: "wc", id: 0x0020, build: wc::build, summary: "bytes, lines, words (wc)" },
];

pub fn by_name(name: &str) -> Result<&'static Operation, ComputeError> {
    OPERATIONS.iter().find(|o| o.name == name).ok_or_else(|| ComputeError::UnknownOperation(name.into()))
}

pub fn by_id(id: u16) -> Result<&'static Operation, ComputeError> {
    OPERATIONS.iter().find(|o| o.id == id).ok_or(ComputeError::UnknownOperationId(id))
}

/// Runs an operation over chunks held in memory: the local path, and tests.
pub fn run<'a>(op: &str, args: &[u8], chunks: impl IntoIterator<Item = &'a [u8]>) -> Result<Outcome, ComputeError> {
    let mut k = (by_name(op)?.build)(args)?;
    for c in chunks {
        k.update(c);
    }
    k.finish()
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
