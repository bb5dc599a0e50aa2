//! FS_IOC_FIEMAP: where a file's bytes lie on its block device.
//!
//! Written by hand over `libc::ioctl`: the layout is four small structs of linux/fiemap.h
//! and no maintained crate wraps it with the flags we need.

use std::io;
use std::os::fd::AsRawFd;

/// The extent flags of linux/fiemap.h.
pub mod flags {
    pub const LAST: u32 = 0x1;
    /// Location unknown: data not on disk yet, or the file system will not say.
    pub const UNKNOWN: u32 = 0x2;
    /// Delayed allocation: no block yet (a sync allocates one).
    pub const DELALLOC: u32 = 0x4;
    /// Compressed or otherwise encoded: the blocks are not the bytes.
    pub const ENCODED: u32 = 0x8;
    pub const DATA_ENCRYPTED: u32 = 0x80;
    /// Not block aligned.
    pub const NOT_ALIGNED: u32 = 0x100;
    /// Stored with the metadata (inline data).
    pub const DATA_INLINE: u32 = 0x200;
    /// Packed with other files' tails.
    pub const DATA_TAIL: u32 = 0x400;
    /// Allocated but never written: reads as zeros.
    pub const UNWRITTEN: u32 = 0x800;
    pub const MERGED: u32 = 0x1000;
    pub const SHARED: u32 = 0x2000;
}

/// Flags under which the blocks on the device are not the file's bytes.
pub const UNUSABLE: u32 =
    flags::UNKNOWN | flags::DELALLOC | flags::ENCODED | flags::DATA_ENCRYPTED | flags::NOT_ALIGNED | flags::DATA_INLINE | flags::DATA_TAIL;

/// Writes dirty pages back before mapping (FIEMAP_FLAG_SYNC).
const FLAG_SYNC: u32 = 0x1;

/// One extent as the file system reports it, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FsExtent {
    pub logical: u64,
    pub physical: u64,
    pub length: u64,
    pub flags: u32,
}

#[repr(C)]
struct RawHeader {
    fm_start: u64,
    fm_length: u64,
    fm_flags: u32,
    fm_mapped_extents: u32,
    fm_extent_count: u32,
    fm_reserved: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RawExtent {
    fe_logical: u64,
    fe_physical: u64,
    fe_length: u64,
    fe_reserved64: [u64; 2],
    fe_flags: u32,
    fe_reserved: [u32; 3],
}

const BATCH: usize = 256;

#[repr(C)]
struct Request {
    h: RawHeader,
    e: [RawExtent; BATCH],
}

/// _IOWR('f', 11, struct fiemap): the header is 32 bytes.
const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;

/// Every extent of the file, in logical order, after writing its dirty pages back.
pub fn extents(file: &std::fs::File) -> io::Result<Vec<FsExtent>> {
    let mut out = Vec::new();
    let mut start = 0u64;
    loop {
        let mut req = Request {
            h: RawHeader {
                fm_start: start,
                fm_length: u64::MAX - start,
                fm_flags: FLAG_SYNC,
                fm_mapped_extents: 0,
                fm_extent_count: BATCH as u32,
                fm_reserved: 0,
            },
            e: [RawExtent::default(); BATCH],
        };
        // SAFETY: `req` is a struct fiemap followed by room for BATCH extents, as
        // fm_extent_count says; the kernel writes at most that many.
        let r = unsafe { libc::ioctl(file.as_raw_fd(), FS_IOC_FIEMAP as _, &mut req as *mut Request) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        let n = req.h.fm_mapped_extents as usize;
        if n == 0 {
            return Ok(out);
        }
        for e in &req.e[..n.min(BATCH)] {
            out.push(FsExtent { logical: e.fe_logical, physical: e.fe_physical, length: e.fe_length, flags: e.fe_flags });
        }
        let last = out.last().expect("n > 0");
        if last.flags & flags::LAST != 0 {
            return Ok(out);
        }
        start = last.logical + last.length;
    }
}
