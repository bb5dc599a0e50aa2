//! The fuse3 0.10 side of the crate comparison in docs/fuse.md ("Why fuser"), run by
//! scripts/bench-fuse-crates.sh: the same file system as with_fuser.rs (the root directory
//! and one regular file `data` of SIZE_BYTES bytes held in memory, byte i is i % 251 + 1,
//! every open of it with FOPEN_DIRECT_IO), on fuse3's inode-based `raw` API and tokio: a
//! multi-threaded runtime of N workers (2 by default), fuse3 running each request as a task
//! of its own. Mounted as root (`Session::mount`, the mount(2) system call, no fusermount3),
//! as fuser mounts as root. No directory listing: the benchmark opens `data` by name.
//!
//! Usage (root): with_fuse3 MOUNTPOINT SIZE_BYTES [--threads N]   (N tokio workers)
//! Prints `mounted` once the kernel has the file system; serves until SIGTERM or SIGINT
//! (then unmounts) or until something else unmounts it.

use std::ffi::OsStr;
use std::num::NonZeroU32;
use std::process::exit;
use std::time::{Duration, UNIX_EPOCH};

use bytes::Bytes;
use fuse3::raw::prelude::*;
use fuse3::{MountOptions, Result};
use tokio::signal::unix::{signal, SignalKind};

const USAGE: &str = "usage: with_fuse3 MOUNTPOINT SIZE_BYTES [--threads N]";
/// Nothing ever changes: the kernel may keep names and attributes for the whole run.
const TTL: Duration = Duration::from_secs(3600);
const ROOT: u64 = 1;
const DATA: u64 = 2;
/// FOPEN_DIRECT_IO of the kernel's include/uapi/linux/fuse.h (fuse3 names no open flags).
const FOPEN_DIRECT_IO: u32 = 1 << 0;

struct MemFs {
    data: Bytes,
}

impl MemFs {
    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let (kind, perm, nlink, size) = match ino {
            ROOT => (FileType::Directory, 0o555, 2, 0),
            DATA => (FileType::RegularFile, 0o444, 1, self.data.len() as u64),
            _ => return None,
        };
        let t = UNIX_EPOCH.into();
        Some(FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: t,
            mtime: t,
            ctime: t,
            kind,
            perm,
            nlink,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
        })
    }
}

impl Filesystem for MemFs {
    async fn init(&self, _req: Request) -> Result<ReplyInit> {
        // max_write only (reads are not bounded by it); 1 MiB, a dd block.
        Ok(ReplyInit::new(NonZeroU32::new(1 << 20).unwrap()))
    }

    async fn destroy(&self, _req: Request) {}

    async fn lookup(&self, _req: Request, parent: u64, name: &OsStr) -> Result<ReplyEntry> {
        match self.attr(DATA) {
            Some(attr) if parent == ROOT && name == "data" => Ok(ReplyEntry { ttl: TTL, attr, generation: 0 }),
            _ => Err(libc::ENOENT.into()),
        }
    }

    async fn getattr(&self, _req: Request, inode: u64, _fh: Option<u64>, _flags: u32) -> Result<ReplyAttr> {
        self.attr(inode).map(|attr| ReplyAttr { ttl: TTL, attr }).ok_or_else(|| libc::ENOENT.into())
    }

    async fn open(&self, _req: Request, inode: u64, _flags: u32) -> Result<ReplyOpen> {
        match inode {
            DATA => Ok(ReplyOpen { fh: 0, flags: FOPEN_DIRECT_IO }),
            ROOT => Err(libc::EISDIR.into()),
            _ => Err(libc::ENOENT.into()),
        }
    }

    async fn read(&self, _req: Request, inode: u64, _fh: u64, offset: u64, size: u32) -> Result<ReplyData> {
        if inode != DATA {
            return Err(libc::ENOENT.into());
        }
        let start = offset.min(self.data.len() as u64) as usize;
        let end = start.saturating_add(size as usize).min(self.data.len());
        // A slice of the same buffer, no copy (fuser's reply takes a slice too).
        Ok(ReplyData { data: self.data.slice(start..end) })
    }
}

fn main() {
    let (mountpoint, data, workers) = bench_fuse_crates::args(USAGE, 2);

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(workers).enable_all().build().unwrap_or_else(|e| {
        eprintln!("with_fuse3: tokio runtime: {e}");
        exit(1)
    });
    runtime.block_on(serve(&mountpoint, MemFs { data: Bytes::from(data) }));
}

async fn serve(mountpoint: &str, fs: MemFs) {
    let (mut term, mut int) = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(t), Ok(i)) => (t, i),
        _ => {
            eprintln!("with_fuse3: cannot catch SIGTERM and SIGINT");
            exit(1)
        }
    };
    let mut options = MountOptions::default();
    options.read_only(true).fs_name("bench-fuse3");
    // Mounts; the session (INIT first) then runs as a task, the handle resolving when it ends.
    let mut handle = Session::new(options).mount(fs, mountpoint).await.unwrap_or_else(|e| {
        eprintln!("with_fuse3: mount {mountpoint}: {e}");
        exit(1)
    });
    println!("mounted");

    let signalled = tokio::select! {
        ended = &mut handle => {
            // Unmounted by something else: nothing left to do.
            if let Err(e) = ended {
                eprintln!("with_fuse3: session: {e}");
                exit(1);
            }
            false
        }
        _ = term.recv() => true,
        _ = int.recv() => true,
    };
    // Ends the session, then unmounts (umount(2)).
    if signalled {
        if let Err(e) = handle.unmount().await {
            eprintln!("with_fuse3: unmount {mountpoint}: {e}");
            exit(1);
        }
    }
}
