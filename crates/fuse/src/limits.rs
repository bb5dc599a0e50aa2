//! Every limit of the mount, with its unit and why that number.

use std::time::Duration;

/// Bytes of an operation spec (`user.nearstore.op`, the ioctl's `spec`, a directory
/// name under `.nearstore/` is at most NAME_MAX anyway): the ioctl's structure is one
/// page, its header 8 bytes.
pub const OP_SPEC_BYTES_MAX: usize = crate::ioctl::SPEC_BYTES;

/// Bytes of one operation's result held for a descriptor: a target returns a result of
/// at most 128 KiB inline (select's rows, docs/protocol.md), and a file computed in the
/// mount is held to the same, so that both paths fail alike; results bigger than that
/// belong in an output file.
pub const RESULT_BYTES_MAX: usize = 128 << 10;

/// Operations computing at once (each on a thread of its own, holding at most
/// RESULT_BYTES_MAX): a read beyond that fails with EAGAIN rather than queue work the
/// FUSE threads cannot see.
pub const COMPUTE_IN_FLIGHT_MAX: usize = 16;

/// The largest read or write the kernel sends the mount in one request (FUSE max_write;
/// reads follow max_pages): 1 MiB, the size of the sequential I/O the mount is measured
/// with, so that one system call is one request.
pub const IO_BYTES_MAX: u32 = 1 << 20;

/// FUSE worker threads by default (`--threads`): requests of several processes are
/// served at once; compute runs on threads of its own.
pub const THREADS_DEFAULT: usize = 4;
/// The most FUSE worker threads (`--threads`), each with a 1 MiB request buffer.
pub const THREADS_MAX: usize = 64;

/// How long one operation may take on its target by default (`--op-timeout`): a lost
/// target fails the read with EIO after this, rather than hang the reader forever.
pub const OP_TIMEOUT_DEFAULT: Duration = Duration::from_secs(60);

/// How long the kernel may cache attributes and names: short, because targets write
/// outputs into the source directory beside the mount.
pub const ATTR_TTL: Duration = Duration::from_secs(1);

/// Bytes of the value of one passed-through extended attribute (XATTR_SIZE_MAX).
pub const XATTR_BYTES_MAX: usize = 64 << 10;

const _: () = assert!(RESULT_BYTES_MAX <= IO_BYTES_MAX as usize * 4);
const _: () = assert!(THREADS_DEFAULT <= THREADS_MAX);
