//! The fuser 0.18 side of the crate comparison in docs/fuse.md ("Why fuser"), run by
//! scripts/bench-fuse-crates.sh. A read-only file system: the root directory and one regular
//! file `data` of SIZE_BYTES bytes held in memory (byte i is i % 251 + 1), every open of it
//! with FOPEN_DIRECT_IO so that each read(2) is a request to this process. Served as
//! crates/fuse serves its mount (crates/fuse/src/lib.rs, `spawn`): fuser's multi-threaded
//! session, `Config::n_threads` threads with a cloned /dev/fuse descriptor each (`clone_fd`),
//! started by `fuser::spawn_mount`. No directory listing: the benchmark opens `data` by name.
//!
//! Usage (root): with_fuser MOUNTPOINT SIZE_BYTES [--threads N]   (1 thread by default)
//! Prints `mounted` once the kernel has the file system; serves until SIGTERM or SIGINT
//! (then unmounts) or until something else unmounts it.

use std::ffi::OsStr;
use std::process::exit;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner, OpenFlags, ReplyAttr, ReplyData,
    ReplyEntry, ReplyOpen, Request,
};

const USAGE: &str = "usage: with_fuser MOUNTPOINT SIZE_BYTES [--threads N]";
/// Nothing ever changes: the kernel may keep names and attributes for the whole run.
const TTL: Duration = Duration::from_secs(3600);
const DATA: INodeNo = INodeNo(2);

struct MemFs {
    data: Vec<u8>,
}

impl MemFs {
    fn attr(&self, ino: INodeNo) -> Option<FileAttr> {
        let (kind, perm, nlink, size) = match ino {
            INodeNo::ROOT => (FileType::Directory, 0o555, 2, 0),
            DATA => (FileType::RegularFile, 0o444, 1, self.data.len() as u64),
            _ => return None,
        };
        Some(FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: UNIX_EPOCH,
            mtime: UNIX_EPOCH,
            ctime: UNIX_EPOCH,
            crtime: UNIX_EPOCH,
            kind,
            perm,
            nlink,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }
}

impl Filesystem for MemFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.attr(DATA) {
            Some(attr) if parent == INodeNo::ROOT && name == "data" => reply.entry(&TTL, &attr, Generation(0)),
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino) {
            Some(attr) => reply.attr(&TTL, &attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match ino {
            DATA => reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO),
            INodeNo::ROOT => reply.error(Errno::EISDIR),
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if ino != DATA {
            return reply.error(Errno::ENOENT);
        }
        let start = offset.min(self.data.len() as u64) as usize;
        let end = start.saturating_add(size as usize).min(self.data.len());
        reply.data(&self.data[start..end]);
    }
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

fn main() {
    let (mountpoint, data, threads) = bench_fuse_crates::args(USAGE, 1);

    // SAFETY: the handler only stores to an atomic. Set before any thread starts.
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t);
    }
    let mut config = fuser::Config::default();
    config.mount_options = vec![fuser::MountOption::RO, fuser::MountOption::FSName("bench-fuser".into())];
    config.n_threads = Some(threads);
    config.clone_fd = true;
    // Mounts, answers the kernel's INIT, then serves on background threads.
    let session = fuser::spawn_mount(MemFs { data }, &mountpoint, &config).unwrap_or_else(|e| {
        eprintln!("with_fuser: mount {mountpoint}: {e}");
        exit(1)
    });
    println!("mounted");

    // The session's threads end by themselves when something else unmounts it; a signal
    // is noticed within 50 ms (a wake-up too rare to weigh on the measurement).
    while !STOP.load(Ordering::Relaxed) && !session.guard.is_finished() {
        std::thread::sleep(Duration::from_millis(50));
    }
    // Unmounts unless already unmounted, then waits for the threads.
    if let Err(e) = session.umount_and_join() {
        eprintln!("with_fuser: unmount {mountpoint}: {e}");
        exit(1);
    }
}
