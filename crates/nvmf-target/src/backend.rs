//! Storage behind a namespace: a memory region, a regular (sparse) file, or a block device.
//!
//! Backends do positioned, synchronous I/O. The memory backend is cheap enough to run on
//! the network task; file and block backends run on the I/O worker pool ([`crate::io_pool`]).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use parking_lot::RwLock;

pub trait Backend: Send + Sync {
    fn describe(&self) -> String;
    /// Capacity in bytes.
    fn size(&self) -> u64;
    /// The unit offsets and lengths must be multiples of, in bytes (a block device's
    /// logical block; 1 for memory and regular files).
    fn block_bytes(&self) -> u32 {
        1
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()>;
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()>;
    /// Appends `len` bytes read at `off` to `out` (a send buffer); on error `out` is left
    /// as it was.
    fn read_append(&self, out: &mut Vec<u8>, off: u64, len: usize) -> io::Result<()> {
        let start = out.len();
        out.resize(start + len, 0);
        let r = self.read_at(&mut out[start..], off);
        if r.is_err() {
            out.truncate(start);
        }
        r
    }
    /// Calls `f` once with the bytes at `off..off + len` as slices borrowed from the backend
    /// (no copy), for backends that hold their data in memory; None otherwise.
    fn with_slices(&self, off: u64, len: usize, f: &mut dyn FnMut(&[&[u8]])) -> Option<io::Result<()>> {
        let _ = (off, len, f);
        None
    }
    /// Makes every completed write durable.
    fn flush(&self) -> io::Result<()>;
    /// Makes the given range durable (FUA); backends may flush more.
    fn flush_range(&self, off: u64, len: u64) -> io::Result<()> {
        let _ = (off, len);
        self.flush()
    }
    /// Zeroes a range; with `deallocate`, frees the space where the backend can.
    fn write_zeroes(&self, off: u64, len: u64, deallocate: bool) -> io::Result<()>;
    /// Deallocates a range: afterwards it reads as zeros.
    fn deallocate(&self, off: u64, len: u64) -> io::Result<()> {
        self.write_zeroes(off, len, true)
    }
    /// The descriptor reads and writes may go to directly (through io_uring), with the
    /// same meaning as [`read_at`](Self::read_at) and [`write_at`](Self::write_at).
    fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
    /// True when an I/O costs about a memcpy, so it may run on the network task.
    fn inline(&self) -> bool {
        false
    }
}

/// RAM, for benchmarks and tests. Split in stripes, each behind its own lock, so that
/// connections on several threads do not serialise on one lock.
pub struct MemoryBackend {
    stripes: Vec<RwLock<Vec<u8>>>,
    size: u64,
}

const STRIPE: u64 = 1 << 20;

impl MemoryBackend {
    pub fn new(size: u64) -> MemoryBackend {
        let n = size.div_ceil(STRIPE);
        let stripes = (0..n)
            .map(|i| {
                let mut v = vec![0u8; (size - i * STRIPE).min(STRIPE) as usize];
                // vec![0; n] comes from calloc, whose pages are mapped at first touch. Touch
                // them now, as SPDK's malloc bdev does, so that no I/O pays a page fault
                // (3.6% of the target's time in a QD 32 read run before this).
                for page in v.chunks_mut(4096) {
                    // SAFETY: page[0] is a valid, exclusively borrowed byte; volatile so
                    // the store of a zero into calloc memory is not optimised away.
                    unsafe { std::ptr::write_volatile(&mut page[0], 0) };
                }
                RwLock::new(v)
            })
            .collect();
        MemoryBackend { stripes, size }
    }

    fn for_each(&self, off: u64, len: u64, mut f: impl FnMut(usize, usize, usize, u64)) {
        let mut pos = off;
        let end = off + len;
        while pos < end {
            let stripe = (pos / STRIPE) as usize;
            let in_off = (pos % STRIPE) as usize;
            let n = (STRIPE - pos % STRIPE).min(end - pos);
            f(stripe, in_off, n as usize, pos - off);
            pos += n;
        }
    }
}

fn check_range(size: u64, off: u64, len: u64) -> io::Result<()> {
    match off.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(io::Error::new(io::ErrorKind::InvalidInput, "I/O beyond the end of the backend")),
    }
}

impl Backend for MemoryBackend {
    fn describe(&self) -> String {
        format!("memory ({} bytes)", self.size)
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        check_range(self.size, off, buf.len() as u64)?;
        self.for_each(off, buf.len() as u64, |s, o, n, b| {
            let b = b as usize;
            buf[b..b + n].copy_from_slice(&self.stripes[s].read()[o..o + n]);
        });
        Ok(())
    }
    fn read_append(&self, out: &mut Vec<u8>, off: u64, len: usize) -> io::Result<()> {
        check_range(self.size, off, len as u64)?;
        // Straight from the stripe into the send buffer: no zeroing first (resize + read_at
        // spent 16% of the target's time in memset on 128 KiB reads).
        self.for_each(off, len as u64, |s, o, n, _| out.extend_from_slice(&self.stripes[s].read()[o..o + n]));
        Ok(())
    }
    fn with_slices(&self, off: u64, len: usize, f: &mut dyn FnMut(&[&[u8]])) -> Option<io::Result<()>> {
        if let Err(e) = check_range(self.size, off, len as u64) {
            return Some(Err(e));
        }
        // Recursive read locks: a caller may hold this stripe already, lent for an earlier
        // read (NVMe/TCP gathers a batch's reads under all their locks, tcp.rs), and a plain
        // read lock would then wait behind a writer waiting for the one it holds. Writers
        // take one stripe at a time, so readers never wait for each other's locks either.
        let (s, o) = ((off / STRIPE) as usize, (off % STRIPE) as usize);
        let first = len.min(STRIPE as usize - o);
        if first == len {
            f(&[&self.stripes[s].read_recursive()[o..o + len]]);
        } else if len - first <= STRIPE as usize {
            // Stripe locks are taken in ascending order, as writers do.
            let (a, b) = (self.stripes[s].read_recursive(), self.stripes[s + 1].read_recursive());
            f(&[&a[o..], &b[..len - first]]);
        } else {
            // Longer than two stripes (an offload chunk of up to COMPUTE_CHUNK_BYTES_MAX):
            // a slice per stripe, locked in ascending order.
            let last = (off + len as u64 - 1) / STRIPE;
            let guards: Vec<_> = (s..=last as usize).map(|i| self.stripes[i].read_recursive()).collect();
            let n = guards.len();
            let slices: Vec<&[u8]> = guards
                .iter()
                .enumerate()
                .map(|(i, g)| match i {
                    0 => &g[o..],
                    _ if i == n - 1 => &g[..len - first - (n - 2) * STRIPE as usize],
                    _ => &g[..],
                })
                .collect();
            f(&slices);
        }
        Some(Ok(()))
    }
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        check_range(self.size, off, buf.len() as u64)?;
        self.for_each(off, buf.len() as u64, |s, o, n, b| {
            let b = b as usize;
            self.stripes[s].write()[o..o + n].copy_from_slice(&buf[b..b + n]);
        });
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    fn write_zeroes(&self, off: u64, len: u64, _deallocate: bool) -> io::Result<()> {
        check_range(self.size, off, len)?;
        self.for_each(off, len, |s, o, n, _| self.stripes[s].write()[o..o + n].fill(0));
        Ok(())
    }
    fn inline(&self) -> bool {
        true
    }
}

/// A regular file (sparse where the file system allows) or a block device.
pub struct FileBackend {
    file: File,
    path: PathBuf,
    size: u64,
    block_device: bool,
    direct: bool,
    /// Logical block size of a block device, 1 for a regular file.
    block: u32,
}

impl FileBackend {
    /// Opens `path`. A regular file that does not exist is created with `create_size`
    /// bytes (sparse); a block device is opened with O_DIRECT when it accepts it.
    pub fn open(path: &Path, create_size: Option<u64>) -> io::Result<FileBackend> {
        let meta = std::fs::metadata(path);
        let block_device = matches!(&meta, Ok(m) if m.file_type().is_block_device());
        if block_device {
            let direct = OpenOptions::new().read(true).write(true).custom_flags(libc::O_DIRECT).open(path);
            let (file, direct) = match direct {
                Ok(f) => (f, true),
                Err(_) => (OpenOptions::new().read(true).write(true).open(path)?, false),
            };
            let size = block_device_size(&file)?;
            let block = logical_block_size(&file)?;
            return Ok(FileBackend { file, path: path.into(), size, block_device, direct, block });
        }
        let file = match (&meta, create_size) {
            (Err(e), Some(size)) if e.kind() == io::ErrorKind::NotFound => {
                let f = OpenOptions::new().read(true).write(true).create_new(true).open(path)?;
                f.set_len(size)?;
                f
            }
            _ => OpenOptions::new().read(true).write(true).open(path)?,
        };
        let mut size = file.metadata()?.len();
        if let Some(want) = create_size {
            if size < want {
                file.set_len(want)?;
                size = want;
            }
        }
        Ok(FileBackend { file, path: path.into(), size, block_device: false, direct: false, block: 1 })
    }

    fn fallocate(&self, mode: libc::c_int, off: u64, len: u64) -> io::Result<()> {
        // SAFETY: plain syscall on an owned fd.
        let r = unsafe { libc::fallocate(self.file.as_raw_fd(), mode, off as libc::off_t, len as libc::off_t) };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    fn zero_by_writing(&self, off: u64, len: u64) -> io::Result<()> {
        let zeros = nearstore_transport::AlignedBuf::new(1 << 20);
        let mut zeros = zeros;
        let cap = zeros.capacity();
        zeros.set_len(cap);
        let mut pos = off;
        while pos < off + len {
            let n = (off + len - pos).min(cap as u64) as usize;
            self.write_at(&zeros[..n], pos)?;
            pos += n as u64;
        }
        Ok(())
    }
}

fn block_device_size(f: &File) -> io::Result<u64> {
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), BLKGETSIZE64, &mut size) };
    if r == 0 {
        Ok(size)
    } else {
        Err(io::Error::last_os_error())
    }
}

fn logical_block_size(f: &File) -> io::Result<u32> {
    const BLKSSZGET: libc::c_ulong = 0x1268;
    let mut size: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), BLKSSZGET, &mut size) };
    if r == 0 {
        Ok(size.max(1) as u32)
    } else {
        Err(io::Error::last_os_error())
    }
}

impl Backend for FileBackend {
    fn describe(&self) -> String {
        let kind = if self.block_device { "block device" } else { "file" };
        let direct = if self.direct { ", O_DIRECT" } else { "" };
        format!("{kind} {} ({} bytes{direct})", self.path.display(), self.size)
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn block_bytes(&self) -> u32 {
        self.block
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        check_range(self.size, off, buf.len() as u64)?;
        self.file.read_exact_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        check_range(self.size, off, buf.len() as u64)?;
        self.file.write_all_at(buf, off)
    }
    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(self.file.as_raw_fd())
    }
    fn write_zeroes(&self, off: u64, len: u64, deallocate: bool) -> io::Result<()> {
        check_range(self.size, off, len)?;
        let mode = if deallocate {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        } else {
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
        };
        match self.fallocate(mode, off, len) {
            Ok(()) => Ok(()),
            // Not every file system or device can: zero by writing.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP) | Some(libc::EINVAL)) => self.zero_by_writing(off, len),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exercise(b: &dyn Backend) {
        let data: Vec<u8> = (0..3 * 4096).map(|i| (i % 251) as u8).collect();
        // Crosses the memory backend's 1 MiB stripe border.
        let off = (1 << 20) - 4096;
        b.write_at(&data, off).unwrap();
        let mut back = vec![0u8; data.len()];
        b.read_at(&mut back, off).unwrap();
        assert_eq!(back, data);
        b.write_zeroes(off + 4096, 4096, false).unwrap();
        b.deallocate(off, 4096).unwrap();
        b.read_at(&mut back, off).unwrap();
        assert!(back[..8192].iter().all(|&x| x == 0));
        assert_eq!(&back[8192..], &data[8192..]);
        assert!(b.read_at(&mut back, b.size() - 10).is_err());
        assert!(b.write_at(&data, u64::MAX - 5).is_err());
        b.flush().unwrap();
    }

    #[test]
    fn memory() {
        exercise(&MemoryBackend::new(4 << 20));
    }

    /// Memory lends any range in place, however many stripes it spans (an offload chunk
    /// of up to 64 MiB is read on the compute thread; past two stripes it was None and
    /// went to the I/O task, a memcpy on a network thread), and exactly its bytes.
    #[test]
    fn memory_lends_ranges_over_any_number_of_stripes() {
        let size = (9 << 20) + 4096;
        let b = MemoryBackend::new(size);
        let data: Vec<u8> = (0..size as usize).map(|i| (i % 251) as u8 ^ (i >> 20) as u8).collect();
        b.write_at(&data, 0).unwrap();
        const M: u64 = 1 << 20;
        // (offset, length, slices lent)
        let cases: &[(u64, usize, usize)] = &[
            (0, 0, 1),
            (4096, 4096, 1),
            (M - 512, 1024, 2),
            (0, 2 * M as usize, 2),
            (0, 3 * M as usize, 3),
            (4096, 2 * M as usize, 3),
            (M - 4096, 4 * M as usize, 5),
            (512, 9 * M as usize, 10),
            (0, size as usize, 10),
        ];
        for &(off, len, want) in cases {
            let mut got = Vec::new();
            let mut lent = 0;
            let r = b.with_slices(off, len, &mut |slices| {
                lent = slices.len();
                slices.iter().for_each(|s| got.extend_from_slice(s));
            });
            assert!(matches!(r, Some(Ok(()))), "{off}+{len}: {r:?}");
            assert_eq!(lent, want, "{off}+{len}: slices");
            assert!(got == data[off as usize..off as usize + len], "{off}+{len}: the bytes differ");
        }
        assert!(matches!(b.with_slices(size - 4096, 8192, &mut |_| {}), Some(Err(_))), "past the end");
    }

    #[test]
    fn file_is_sparse_and_punches_holes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("disk.img");
        let b = FileBackend::open(&p, Some(8 << 20)).unwrap();
        exercise(&b);
        let blocks = std::fs::metadata(&p).map(|m| std::os::unix::fs::MetadataExt::blocks(&m)).unwrap();
        assert!(blocks * 512 < 1 << 20, "file should stay sparse, has {} bytes allocated", blocks * 512);
    }
}
