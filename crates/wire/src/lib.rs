//! Wire formats of NVMe over TCP and of the NVMe commands nearstore speaks.
//!
//! This crate does no I/O and has no async: it turns bytes into typed values and back.
//! Every decoder takes untrusted input (it came off the network) and returns an error
//! naming the offending field instead of panicking; the decoders are fuzzed for that
//! (`tests/fuzz.rs`) and round-trip tested.
//!
//! All multi-byte fields are little-endian, as NVMe requires.

pub mod bytes;
pub mod compute;
pub mod fabrics;
pub mod fused;
pub mod identify;
pub mod log;
pub mod opcode;
pub mod pdu;
pub mod resv;
pub mod sqe;
pub mod status;

pub use pdu::{PduError, PduHeader, PduType};
pub use sqe::{Cqe, Sgl, Sqe};
pub use status::Status;

/// The well-known NQN of the discovery subsystem (NVMe over Fabrics, "Discovery Service").
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";

/// Largest NQN in bytes, the NUL excluded (NVMe Base, "NVMe Qualified Names").
pub const NQN_LEN_MAX: usize = 223;
