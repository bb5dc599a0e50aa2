//! The file system: a passthrough of the source directory, plus operations attached to
//! open files and the `.nearstore/SPEC/path` result files.
//!
//! A regular file opened without O_DIRECT is passed through by the kernel (FUSE passthrough,
//! FOPEN_PASSTHROUGH): its reads, writes and maps go to the source file itself, as fast as
//! the source and always its current bytes (targets write outputs into the source
//! directory beside the mount), and the mount keeps no page cache of it. A file opened
//! with O_DIRECT gets FOPEN_DIRECT_IO: each of its reads reaches the mount, so an
//! operation can be attached to it and its reads return the result while the other
//! descriptors of the file return its bytes. The kind of a descriptor is fixed when it is
//! opened, so no cache can ever hand one kind's bytes to the other. Without passthrough
//! (an older kernel) every file is opened with FOPEN_DIRECT_IO.
//! The kernel checks permissions (`default_permissions`) against the source's owners and
//! modes, reported as they are.

use std::collections::HashMap;
use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags, IoctlFlags, KernelConfig,
    OpenAccMode, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyOpen,
    ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow,
};
use nearstore_host::device::DeviceMap;
use nearstore_host::mount;
use nearstore_host::{Host, HostError, How, Mode};
use parking_lot::Mutex;
use tracing::{info, warn};

use crate::limits::{ATTR_TTL, COMPUTE_IN_FLIGHT_MAX, IO_BYTES_MAX, RESULT_BYTES_MAX, XATTR_BYTES_MAX};
use crate::op::{self, OpSpec};
use crate::{ioctl, CONTROL_DIR};

thread_local! {
    /// A FUSE thread's read buffer: IO_BYTES_MAX bytes, allocated at its first read.
    static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The attribute naming the operation attached to the caller's descriptors.
pub const XATTR_OP: &str = "user.nearstore.op";
/// The attribute saying where the last result was computed: `1`, or `0 REASON`.
pub const XATTR_OFFLOADED: &str = "user.nearstore.offloaded";

/// The inode of `.nearstore`; result nodes are numbered after it, apart from the source's.
const CONTROL_INO: u64 = 1 << 62;

/// What an inode of the mount is.
#[derive(Clone, Debug)]
enum Node {
    /// A file of the source directory, by its path relative to it ("" the root).
    Real(PathBuf),
    /// `.nearstore`: its entries are operation specs.
    Control,
    /// `.nearstore/SPEC/path`: the source's `path` seen through the operation (a directory
    /// lists its source's entries; a file reads as the result).
    Result(Arc<OpSpec>, PathBuf),
}

struct Entry {
    node: Node,
    lookups: u64,
}

/// The inode table: the source's files by (st_dev, st_ino), results by (spec, path).
#[derive(Default)]
struct Inodes {
    by_ino: HashMap<u64, Entry>,
    real: HashMap<(u64, u64), u64>,
    results: HashMap<(String, PathBuf), u64>,
    next_real: u64,
    next_result: u64,
}

/// An operation attached to a descriptor, and its result once computed.
struct Attached {
    spec: Arc<OpSpec>,
    result: Mutex<Option<Arc<Computed>>>,
}

struct Computed {
    bytes: Vec<u8>,
    how: How,
}

/// An open descriptor of the mount.
struct Handle {
    ino: u64,
    /// The source file (none for a result file).
    file: Option<Arc<File>>,
    /// The source file's device and inode: an operation computes over no other.
    id: Option<FileId>,
    /// Its reads reach the mount (FOPEN_DIRECT_IO): only such a descriptor can carry an
    /// operation.
    direct: bool,
    /// The inode's backing file of a passthrough open, held until the descriptor is
    /// released: every open of an inode must name the same one.
    backing: Option<Arc<BackingId>>,
    /// The source's path, for computing.
    path: PathBuf,
    /// The process (thread group) that opened it: `fsetxattr` names the inode and the
    /// caller, not the descriptor.
    tgid: u32,
    readable: bool,
    attached: Option<Arc<Attached>>,
}

/// The compute-aware file system.
pub struct NearFs {
    source: PathBuf,
    /// The kernel passes plain opens through to the source file (set at init).
    passthrough: bool,
    /// Each inode's backing file while a passthrough descriptor of it is open.
    backing: Mutex<HashMap<u64, Weak<BackingId>>>,
    computer: Arc<Computer>,
    inodes: Mutex<Inodes>,
    handles: Mutex<HashMap<u64, Handle>>,
    next_fh: AtomicU64,
    computing: Arc<AtomicUsize>,
    /// The last result of each result node (`.nearstore/SPEC/path`), for its size and
    /// `user.nearstore.offloaded` after the descriptor that read it was closed; dropped
    /// with the node.
    last: Arc<Mutex<HashMap<u64, Arc<Computed>>>>,
}

fn errno(e: &std::io::Error) -> Errno {
    Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))
}

fn cstr(p: &Path) -> Result<CString, Errno> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| Errno::EINVAL)
}

/// A name with no separator: what a directory entry may be called.
fn plain(name: &OsStr) -> Result<&OsStr, Errno> {
    if name.as_bytes().contains(&b'/') || name == "." || name == ".." {
        return Err(Errno::EINVAL);
    }
    Ok(name)
}

fn time(secs: i64, nsecs: i64) -> SystemTime {
    if secs >= 0 {
        UNIX_EPOCH + Duration::new(secs as u64, nsecs as u32)
    } else {
        UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs())
    }
}

fn kind_of(m: &std::fs::Metadata) -> FileType {
    FileType::from_std(m.file_type()).unwrap_or(FileType::RegularFile)
}

fn attr_of(ino: u64, m: &std::fs::Metadata) -> FileAttr {
    FileAttr {
        ino: INodeNo(ino),
        size: m.len(),
        blocks: m.blocks(),
        atime: time(m.atime(), m.atime_nsec()),
        mtime: time(m.mtime(), m.mtime_nsec()),
        ctime: time(m.ctime(), m.ctime_nsec()),
        crtime: UNIX_EPOCH,
        kind: kind_of(m),
        perm: (m.mode() & 0o7777) as u16,
        nlink: m.nlink() as u32,
        uid: m.uid(),
        gid: m.gid(),
        rdev: m.rdev() as u32,
        blksize: m.blksize() as u32,
        flags: 0,
    }
}

/// The thread group of a thread (a request names the calling thread).
fn tgid_of(tid: u32) -> u32 {
    std::fs::read_to_string(format!("/proc/{tid}/status"))
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Tgid:").and_then(|v| v.trim().parse().ok())))
        .unwrap_or(tid)
}

/// The errno of a failed operation: the file's own error where there is one, else EIO.
fn host_errno(e: &HostError) -> Errno {
    match e {
        HostError::Io { source, .. } => errno(source),
        HostError::Map(nearstore_host::object::MapError::Io { source, .. }) => errno(source),
        _ => Errno::EIO,
    }
}

impl NearFs {
    pub fn new(source: PathBuf, devices: DeviceMap, op_timeout: Duration, identity: Identity) -> std::io::Result<NearFs> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("nearstore-fuse-host").enable_all().build()?;
        let root = std::fs::metadata(&source)?;
        let mut inodes = Inodes { next_real: 2, next_result: CONTROL_INO + 1, ..Default::default() };
        inodes.by_ino.insert(1, Entry { node: Node::Real(PathBuf::new()), lookups: 1 });
        inodes.real.insert((root.dev(), root.ino()), 1);
        inodes.by_ino.insert(CONTROL_INO, Entry { node: Node::Control, lookups: 1 });
        Ok(NearFs {
            source,
            passthrough: false,
            backing: Mutex::new(HashMap::new()),
            computer: Arc::new(Computer { devices, op_timeout, identity, rt }),
            inodes: Mutex::new(inodes),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            computing: Arc::new(AtomicUsize::new(0)),
            last: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    fn node(&self, ino: INodeNo) -> Result<Node, Errno> {
        self.inodes.lock().by_ino.get(&ino.0).map(|e| e.node.clone()).ok_or(Errno::ENOENT)
    }

    /// The source path of a real node.
    fn real(&self, ino: INodeNo) -> Result<PathBuf, Errno> {
        match self.node(ino)? {
            Node::Real(p) => Ok(self.source.join(p)),
            // Nothing under .nearstore can be changed.
            _ => Err(Errno::EROFS),
        }
    }

    /// Answers an extended attribute read of the source file behind `ino` (`call`: `lgetxattr`
    /// or `llistxattr` of its path into `len` bytes, at most `XATTR_BYTES_MAX`) as FUSE asks:
    /// the size when `size` is 0, else the bytes. A node under `.nearstore` has no attributes
    /// of its own: it answers `absent`, an errno (a value: ENODATA), else empty (a list).
    fn source_xattr(
        &self,
        ino: INodeNo,
        size: u32,
        reply: ReplyXattr,
        absent: Option<Errno>,
        call: impl FnOnce(*const libc::c_char, *mut libc::c_void, usize) -> isize,
    ) {
        let r = match self.node(ino) {
            Ok(Node::Real(p)) => cstr(&self.source.join(p)).and_then(|c| {
                let mut buf = vec![0u8; (size as usize).min(XATTR_BYTES_MAX)];
                let r = call(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len());
                if r < 0 {
                    return Err(errno(&std::io::Error::last_os_error()));
                }
                buf.truncate(r as usize);
                Ok((r as u32, buf))
            }),
            Ok(_) => absent.map_or(Ok((0, Vec::new())), Err),
            Err(e) => Err(e),
        };
        match r {
            Ok((n, _)) if size == 0 => reply.size(n),
            Ok((_, buf)) => reply.data(&buf),
            Err(e) => reply.error(e),
        }
    }

    /// The relative path of a real directory's entry.
    fn child(&self, parent: INodeNo, name: &OsStr) -> Result<PathBuf, Errno> {
        let name = plain(name)?;
        match self.node(parent)? {
            Node::Real(p) => Ok(p.join(name)),
            _ => Err(Errno::EROFS),
        }
    }

    /// Registers a looked-up source file: its inode number, its path now.
    fn remember_real(&self, rel: PathBuf, m: &std::fs::Metadata) -> u64 {
        let mut t = self.inodes.lock();
        let key = (m.dev(), m.ino());
        let ino = match t.real.get(&key) {
            Some(&i) => i,
            None => {
                let i = t.next_real;
                t.next_real += 1;
                t.real.insert(key, i);
                i
            }
        };
        let e = t.by_ino.entry(ino).or_insert(Entry { node: Node::Real(rel.clone()), lookups: 0 });
        if ino != 1 {
            e.node = Node::Real(rel);
        }
        e.lookups += 1;
        ino
    }

    fn remember_result(&self, spec: Arc<OpSpec>, rel: PathBuf) -> u64 {
        let mut t = self.inodes.lock();
        let key = (spec.text.clone(), rel.clone());
        let ino = match t.results.get(&key) {
            Some(&i) => i,
            None => {
                let i = t.next_result;
                t.next_result += 1;
                t.results.insert(key, i);
                i
            }
        };
        t.by_ino.entry(ino).or_insert(Entry { node: Node::Result(spec, rel), lookups: 0 }).lookups += 1;
        ino
    }

    /// A result node's attributes: its source's, read-only, sized as the result when one
    /// was computed (0 before: readers read to the end of the data).
    fn result_attr(&self, ino: u64, rel: &Path) -> Result<FileAttr, Errno> {
        let m = std::fs::metadata(self.source.join(rel)).map_err(|e| errno(&e))?;
        let mut a = attr_of(ino, &m);
        a.perm &= 0o555;
        if a.kind == FileType::RegularFile {
            a.size = self.last.lock().get(&ino).map(|c| c.bytes.len() as u64).unwrap_or(0);
            a.blocks = 0;
        }
        Ok(a)
    }

    fn control_attr(&self, ino: u64) -> FileAttr {
        let root = std::fs::metadata(&self.source).ok();
        let now = SystemTime::now();
        FileAttr {
            ino: INodeNo(ino),
            size: 0,
            blocks: 0,
            atime: now,
            mtime: now,
            ctime: now,
            crtime: UNIX_EPOCH,
            kind: FileType::Directory,
            perm: 0o555,
            nlink: 2,
            uid: root.as_ref().map(|m| m.uid()).unwrap_or(0),
            gid: root.as_ref().map(|m| m.gid()).unwrap_or(0),
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    fn attr(&self, ino: INodeNo) -> Result<FileAttr, Errno> {
        match self.node(ino)? {
            Node::Real(p) => std::fs::symlink_metadata(self.source.join(p)).map(|m| attr_of(ino.0, &m)).map_err(|e| errno(&e)),
            Node::Control => Ok(self.control_attr(ino.0)),
            Node::Result(_, rel) => self.result_attr(ino.0, &rel),
        }
    }

    /// Gives a new file or directory the caller's owner (the mount runs as root), and the
    /// group of a set-group-ID parent as the kernel would.
    fn own(&self, path: &Path, req: &Request, parent: &Path) -> Result<(), Errno> {
        let gid = match std::fs::metadata(parent) {
            Ok(m) if m.mode() & libc::S_ISGID != 0 => m.gid(),
            _ => req.gid(),
        };
        let c = cstr(path)?;
        // SAFETY: a valid C string; lchown does not follow a symbolic link.
        if unsafe { libc::lchown(c.as_ptr(), req.uid(), gid) } != 0 {
            return Err(errno(&std::io::Error::last_os_error()));
        }
        Ok(())
    }

    fn entry_of(&self, rel: PathBuf, reply: ReplyEntry) {
        match std::fs::symlink_metadata(self.source.join(&rel)) {
            Ok(m) => {
                let ino = self.remember_real(rel, &m);
                reply.entry(&ATTR_TTL, &attr_of(ino, &m), Generation(0));
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn new_fh(&self, h: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().insert(fh, h);
        fh
    }

    /// Attaches `spec` to the caller's descriptors of `ino` open for reading.
    fn attach_by_caller(&self, req: &Request, ino: INodeNo, spec: Option<Arc<OpSpec>>) -> Result<(), Errno> {
        let tgid = tgid_of(req.pid());
        let mut handles = self.handles.lock();
        let mine: Vec<&mut Handle> = handles.values_mut().filter(|h| h.ino == ino.0 && h.tgid == tgid).collect();
        if mine.is_empty() {
            warn!(ino = ino.0, pid = req.pid(), "{XATTR_OP}: the caller has no descriptor of this file open: set it with fsetxattr on one");
            return Err(Errno::EBADF);
        }
        let mut readable = 0;
        let mut passed_through = 0;
        for h in mine.into_iter().filter(|h| h.readable && h.file.is_some()) {
            if !h.direct {
                passed_through += 1;
                continue;
            }
            h.attached = spec.clone().map(|spec| Arc::new(Attached { spec, result: Mutex::new(None) }));
            readable += 1;
        }
        if readable == 0 && passed_through > 0 {
            warn!(ino = ino.0, pid = req.pid(), "{XATTR_OP}: the caller's descriptors of this file are not open with O_DIRECT");
            return Err(Errno::from_i32(libc::EBADFD));
        }
        if readable == 0 {
            warn!(ino = ino.0, pid = req.pid(), "{XATTR_OP}: the caller's descriptors of this file are not open for reading");
            return Err(Errno::EACCES);
        }
        Ok(())
    }
}

/// Who the mount is to the targets (`nearstore mount --hostnqn --dhchap-secret`).
pub use nearstore_host::Identity;

/// Who asked for an operation (a read's caller): a transform writes its output only where
/// the caller may, as the kernel would decide.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Caller {
    uid: u32,
    gid: u32,
    /// The calling process's supplementary groups when its request arrived.
    groups: Vec<u32>,
}

impl Caller {
    /// The caller of a request, its supplementary groups read now, while it waits in its
    /// system call for the reply and cannot change them (FUSE requests carry no groups).
    fn of(req: &Request) -> Caller {
        Caller::at(req.uid(), req.gid(), req.pid())
    }

    /// The caller `pid` (a thread) with the file-system ids `uid` and `gid` of its request:
    /// its groups from /proc/PID/status, if that status is still the caller's (its fsuid
    /// and fsgid are the request's). Otherwise (the caller killed, its PID taken by another
    /// process) it acts with no supplementary group, which only takes rights away.
    fn at(uid: u32, gid: u32, pid: u32) -> Caller {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| e.to_string());
        let groups = status.and_then(|s| status_groups(&s, uid, gid)).unwrap_or_else(|why| {
            warn!(pid, uid, gid, "the caller's supplementary groups are unknown ({why}): it acts with none");
            Vec::new()
        });
        Caller { uid, gid, groups }
    }

    /// May the caller do `want` (permission bits: 2 write, 1 search) to a file, by its
    /// owner, group and mode as the kernel's generic permission check decides (root may).
    fn may(&self, m: &std::fs::Metadata, want: u32) -> bool {
        if self.uid == 0 {
            return true;
        }
        let shift = if m.uid() == self.uid {
            6
        } else if m.gid() == self.gid || self.groups.contains(&m.gid()) {
            3
        } else {
            0
        };
        (m.mode() >> shift) & want == want
    }
}

/// The supplementary groups of a /proc/PID/status text whose file-system ids (the last of
/// its `Uid:` and `Gid:` fields, which a FUSE request carries) are `uid` and `gid`; Err
/// says why it is not that caller's.
fn status_groups(status: &str, uid: u32, gid: u32) -> Result<Vec<u32>, String> {
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).ok_or_else(|| format!("no {name} line"));
    let fs_id = |name: &str| -> Result<u32, String> {
        let v = field(name)?;
        v.split_whitespace().nth(3).and_then(|n| n.parse().ok()).ok_or_else(|| format!("{name} {}", v.trim()))
    };
    let (fsuid, fsgid) = (fs_id("Uid:")?, fs_id("Gid:")?);
    if (fsuid, fsgid) != (uid, gid) {
        return Err(format!("the process has fsuid {fsuid} and fsgid {fsgid}, the request {uid} and {gid}"));
    }
    field("Groups:")?.split_whitespace().map(|n| n.parse().map_err(|_| format!("group {n}"))).collect()
}

/// How the mount acts for a caller, given its own effective ids and supplementary groups.
/// Root takes the caller's credentials (true), unless the caller is root with its group
/// (false: as itself). A mount not run as root cannot take another's ids or groups
/// (setfsgid and setgroups need CAP_SETGID): it acts as itself (false), only for a caller
/// of its own user that has every group the mount has, so that it never reaches what the
/// caller may not (after `newgrp` or `sg`, the caller's group changed but it keeps its
/// groups); else Err says why.
fn acts_as_caller(euid: u32, egid: u32, mount_groups: &[u32], caller: &Caller) -> Result<bool, String> {
    if euid == 0 {
        return Ok((caller.uid, caller.gid) != (0, egid));
    }
    if caller.uid != euid {
        return Err(format!("the mount is not root and the caller is another user ({})", caller.uid));
    }
    let has = |g: &u32| *g == caller.gid || caller.groups.contains(g);
    let lacking: Vec<u32> = std::iter::once(&egid).chain(mount_groups).filter(|g| !has(g)).copied().collect();
    if !lacking.is_empty() {
        return Err(format!("the mount is not root, cannot take the caller's groups, and has groups {lacking:?} the caller lacks"));
    }
    Ok(false)
}

/// The calling thread's file-system credentials (fsuid, fsgid, supplementary groups) made
/// the caller's until dropped, when the mount's own come back. The raw system calls
/// change this thread's only (glibc's setgroups would change every thread's). A mount
/// that is not root acts as itself for its own user ([`acts_as_caller`]).
struct AsCaller {
    /// The thread's groups before, when they were changed.
    saved: Option<Vec<libc::gid_t>>,
    switched: bool,
}

/// This thread's supplementary groups.
fn thread_groups() -> std::io::Result<Vec<libc::gid_t>> {
    // SAFETY: getgroups with a zero size only counts; then fills a buffer of that size.
    let mut groups = vec![0 as libc::gid_t; unsafe { libc::getgroups(0, std::ptr::null_mut()) }.max(0) as usize];
    // SAFETY: the buffer holds groups.len() ids.
    let n = unsafe { libc::getgroups(groups.len() as libc::c_int, groups.as_mut_ptr()) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    groups.truncate(n as usize);
    Ok(groups)
}

impl AsCaller {
    fn enter(caller: &Caller) -> std::io::Result<AsCaller> {
        // SAFETY: reads the process's effective ids.
        let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let saved = thread_groups()?;
        let switch =
            acts_as_caller(euid, egid, &saved, caller).map_err(|why| std::io::Error::new(std::io::ErrorKind::PermissionDenied, why))?;
        if !switch {
            return Ok(AsCaller { saved: None, switched: false });
        }
        let groups = &caller.groups;
        // SAFETY: raw syscalls changing only this thread's credentials; the pointer is valid
        // for groups.len() ids.
        unsafe {
            if libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let guard = AsCaller { saved: Some(saved), switched: true };
            libc::syscall(libc::SYS_setfsgid, caller.gid);
            libc::syscall(libc::SYS_setfsuid, caller.uid);
            // setfs[ug]id return the id before and never fail loudly: an invalid id (-1)
            // changes nothing and says which one is in force.
            let (u, g) = (libc::syscall(libc::SYS_setfsuid, u32::MAX), libc::syscall(libc::SYS_setfsgid, u32::MAX));
            if (u as u32, g as u32) != (caller.uid, caller.gid) {
                return Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, "setfsuid/setfsgid did not take"));
            }
            Ok(guard)
        }
    }
}

impl Drop for AsCaller {
    fn drop(&mut self) {
        let Some(saved) = self.saved.take() else { return };
        // SAFETY: raw syscalls restoring this thread's credentials to the process's.
        unsafe {
            libc::syscall(libc::SYS_setfsuid, libc::geteuid());
            libc::syscall(libc::SYS_setfsgid, libc::getegid());
            libc::syscall(libc::SYS_setgroups, saved.len(), saved.as_ptr());
        }
    }
}

/// What computing needs, shared with the compute threads.
struct Computer {
    devices: DeviceMap,
    op_timeout: Duration,
    identity: Identity,
    rt: tokio::runtime::Runtime,
}

impl Computer {
    /// Computes a spec over a source file through the host library, as the CLI does:
    /// offloaded to the target that holds it, or on this host when it cannot be (the
    /// reason kept for `user.nearstore.offloaded`).
    /// Every file the operation opens, creates, renames or cuts (its input by path, the
    /// output and its temporary file) is reached with the caller's file-system
    /// credentials ([`AsCaller`]): the kernel decides, so a symbolic link or a file swapped
    /// in while the target computes gets the caller no more than its own rights. The input
    /// is opened once, by name, and must be the file of the caller's descriptor (`file`,
    /// its device and inode) when there is one; every later open of it is of that open
    /// file (/proc/self/fd), so a file swapped in at its name is never computed over.
    fn compute(&self, spec: &OpSpec, path: &Path, file: Option<FileId>, caller: Caller) -> Result<Computed, Errno> {
        let as_caller = AsCaller::enter(&caller).map_err(|e| {
            warn!(path = %path.display(), uid = caller.uid, op = %spec.text, "cannot act as the caller: {e}");
            Errno::EACCES
        })?;
        let input = open_input(path, file, spec)?;
        let path_now = PathBuf::from(format!("/proc/self/fd/{}", input.as_raw_fd()));
        let mut host = self.host();
        // A kernel-attached namespace's device is root's: as another caller the mount
        // offloads over its own connection.
        host.passthrough = !as_caller.switched;
        // A file computed here is opened on this thread, which holds the caller's
        // credentials; a blocking thread of the runtime would open it as the mount's user.
        host.local_on_caller = as_caller.switched;
        if let Some(suffix) = spec.output {
            return self.transform(host, spec, path, &path_now, suffix, caller);
        }
        let r = self.rt.block_on(host.run(spec.op, &spec.args, &[path_now], Mode::Offload));
        let report = r.map_err(|e| failed(e, spec, path))?;
        let file = report.files.into_iter().next().ok_or(Errno::EIO)?;
        let bytes = op::render(&file.outcome);
        if bytes.len() > RESULT_BYTES_MAX {
            warn!(path = %path.display(), op = %spec.text, "result of {} bytes, more than {RESULT_BYTES_MAX}", bytes.len());
            return Err(Errno::EFBIG);
        }
        if let How::Local(reason) = &file.how {
            info!(path = %path.display(), op = %spec.text, "computed in the mount, not offloaded: {reason}");
        }
        Ok(Computed { bytes, how: file.how })
    }

    /// Runs a transform into the file beside `path` named with `suffix`, as the CLI's verb
    /// does (offloaded where input and output share a namespace), where the caller may
    /// write: the directory (write and search), and a file it replaces (write; in a sticky
    /// directory, the caller's own or in its own directory). The output is the caller's.
    /// `input` is the open input (`path` names it and its output).
    fn transform(&self, mut host: Host, spec: &OpSpec, path: &Path, input: &Path, suffix: &str, caller: Caller) -> Result<Computed, Errno> {
        let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else { return Err(Errno::EINVAL) };
        let mut out_name = name.to_os_string();
        out_name.push(suffix);
        let output = dir.join(&out_name);
        let refuse = |why: &str| {
            warn!(output = %output.display(), uid = caller.uid, gid = caller.gid, op = %spec.text, "output refused: {why}");
            Errno::EACCES
        };
        let d = std::fs::metadata(dir).map_err(|e| errno(&e))?;
        if !caller.may(&d, 3) {
            return Err(refuse("the caller may not write its directory"));
        }
        match std::fs::symlink_metadata(&output) {
            Ok(o) if o.is_dir() => return Err(Errno::EISDIR),
            Ok(o) if o.file_type().is_symlink() => return Err(refuse("a symbolic link at the output's name")),
            Ok(o) if !o.is_file() => return Err(refuse("not a regular file at the output's name")),
            Ok(o) if !caller.may(&o, 2) => return Err(refuse("the caller may not write the file it would replace")),
            Ok(o) if caller.uid != 0 && o.uid() != caller.uid => return Err(refuse("another user's file at the output's name")),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(errno(&e)),
        }
        let inputs = [input.to_path_buf()];
        let cap = nearstore_host::output_capacity(spec.op, &inputs).map_err(|e| failed(e, spec, path))?;
        let r = self.rt.block_on(host.transform(spec.op, &spec.args, &inputs, &output, cap, Mode::Offload));
        let report = r.map_err(|e| failed(e, spec, path))?;
        let file = report.files.into_iter().next().ok_or(Errno::EIO)?;
        if let How::Local(reason) = &file.how {
            info!(path = %path.display(), op = %spec.text, "computed in the mount, not offloaded: {reason}");
        }
        let bytes = op::render_output(&out_name.to_string_lossy(), file.outcome.output_bytes().unwrap_or(0));
        Ok(Computed { bytes, how: file.how })
    }

    /// A host library acting as the mount's host.
    fn host(&self) -> Host {
        let mut host = Host::new(self.devices.clone());
        host.timeout = self.op_timeout;
        host.parallel = 1;
        host.identity = self.identity.clone();
        host
    }
}

/// A file by its device and inode: what a descriptor of the mount names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
}

impl FileId {
    fn of(m: &std::fs::Metadata) -> FileId {
        FileId { dev: m.dev(), ino: m.ino() }
    }
}

/// Opens an operation's input by name (with the calling thread's credentials, the
/// caller's): a regular file, and the descriptor's file when `want` names it. Refused
/// otherwise, with ESTALE and a log line: the name now holds another file than the one the
/// caller opened (replaced beside the mount), which the operation never reads. O_NONBLOCK,
/// so that a FIFO swapped in does not hold the open.
fn open_input(path: &Path, want: Option<FileId>, spec: &OpSpec) -> Result<File, Errno> {
    let opened = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY).open(path).and_then(|f| {
        let m = f.metadata()?;
        Ok((f, m))
    });
    let (f, m) = opened.map_err(|e| {
        warn!(path = %path.display(), op = %spec.text, "cannot open the input: {e}");
        errno(&e)
    })?;
    let found = FileId::of(&m);
    match want {
        Some(want) if !m.is_file() || found != want => {
            warn!(
                path = %path.display(), op = %spec.text,
                "the file at this name is not the descriptor's (device {} inode {}, the descriptor's {} {}): replaced since it was opened; not computed",
                found.dev, found.ino, want.dev, want.ino
            );
            Err(Errno::ESTALE)
        }
        None if !m.is_file() => {
            warn!(path = %path.display(), op = %spec.text, "the input is not a regular file");
            Err(Errno::EINVAL)
        }
        _ => Ok(f),
    }
}

/// The errno of a failed operation, logged.
fn failed(e: HostError, spec: &OpSpec, path: &Path) -> Errno {
    if e.is_refused() {
        // The mount's host may not reach these blocks: the caller gets no result, never
        // one the mount computed from the bytes with its own rights.
        warn!(path = %path.display(), op = %spec.text, "operation refused by the target to this mount's host: {e}");
        return Errno::EACCES;
    }
    if e.is_result_too_large() {
        // Rows beyond what a result holds: select-into writes them to a file.
        warn!(path = %path.display(), op = %spec.text, "result too large: {e}");
        return Errno::EFBIG;
    }
    warn!(path = %path.display(), op = %spec.text, "operation failed: {e}");
    host_errno(&e)
}

fn offloaded_text(how: &How) -> String {
    match how {
        How::Offloaded => "1".into(),
        How::Pulled => "0 pulled over NVMe/TCP".into(),
        How::Local(reason) => format!("0 {reason}"),
    }
}

fn reply_xattr(reply: ReplyXattr, value: &[u8], size: u32) {
    if size == 0 {
        reply.size(value.len() as u32);
    } else if value.len() > size as usize {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(value);
    }
}

impl Filesystem for NearFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if let Err(max) = config.set_max_write(IO_BYTES_MAX) {
            config.set_max_write(max).map_err(|_| std::io::Error::other("max_write"))?;
        }
        // Passthrough of plain opens, onto a source that is itself on no stacked file
        // system (the mount then may be below an overlayfs).
        self.passthrough = match config.add_capabilities(InitFlags::FUSE_PASSTHROUGH) {
            Ok(()) => config.set_max_stack_depth(1).is_ok(),
            Err(_) => false,
        };
        if !self.passthrough {
            warn!("the kernel has no FUSE passthrough: every read and write of the mount is a request to it (docs/fuse.md)");
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let node = match self.node(parent) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        match node {
            Node::Real(p) if p.as_os_str().is_empty() && name == CONTROL_DIR => {
                if let Some(e) = self.inodes.lock().by_ino.get_mut(&CONTROL_INO) {
                    e.lookups += 1;
                }
                reply.entry(&ATTR_TTL, &self.control_attr(CONTROL_INO), Generation(0))
            }
            Node::Real(p) => match plain(name) {
                Ok(n) => self.entry_of(p.join(n), reply),
                Err(e) => reply.error(e),
            },
            Node::Control => {
                let text = name.to_string_lossy();
                match op::parse(&text) {
                    Ok(spec) => {
                        let ino = self.remember_result(Arc::new(spec), PathBuf::new());
                        match self.result_attr(ino, Path::new("")) {
                            Ok(a) => reply.entry(&ATTR_TTL, &a, Generation(0)),
                            Err(e) => reply.error(e),
                        }
                    }
                    Err(e) => {
                        warn!("{CONTROL_DIR}/{text}: {e}");
                        reply.error(Errno::EINVAL)
                    }
                }
            }
            Node::Result(spec, p) => {
                let rel = match plain(name) {
                    Ok(n) => p.join(n),
                    Err(e) => return reply.error(e),
                };
                match std::fs::metadata(self.source.join(&rel)) {
                    Ok(m) if m.is_dir() || m.is_file() => {
                        let ino = self.remember_result(spec, rel.clone());
                        match self.result_attr(ino, &rel) {
                            Ok(a) => reply.entry(&ATTR_TTL, &a, Generation(0)),
                            Err(e) => reply.error(e),
                        }
                    }
                    Ok(_) => reply.error(Errno::ENOENT),
                    Err(e) => reply.error(errno(&e)),
                }
            }
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        if ino.0 == 1 || ino.0 == CONTROL_INO {
            return;
        }
        let mut t = self.inodes.lock();
        let gone = match t.by_ino.get_mut(&ino.0) {
            Some(e) => {
                e.lookups = e.lookups.saturating_sub(nlookup);
                e.lookups == 0
            }
            None => false,
        };
        if gone {
            self.last.lock().remove(&ino.0);
            t.by_ino.remove(&ino.0);
            t.real.retain(|_, i| *i != ino.0);
            t.results.retain(|_, i| *i != ino.0);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        if let Some(fh) = fh {
            if let Some(h) = self.handles.lock().get(&fh.0) {
                if let (Some(f), None) = (h.file.as_deref(), &h.attached) {
                    return match f.metadata() {
                        Ok(m) => reply.attr(&ATTR_TTL, &attr_of(ino.0, &m)),
                        Err(e) => reply.error(errno(&e)),
                    };
                }
            }
        }
        match self.attr(ino) {
            Ok(a) => reply.attr(&ATTR_TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let r = (|| -> Result<(), Errno> {
            let path = self.real(ino)?;
            let c = cstr(&path)?;
            let check = |r: libc::c_int| if r == 0 { Ok(()) } else { Err(errno(&std::io::Error::last_os_error())) };
            if let Some(mode) = mode {
                // SAFETY: a valid C string.
                check(unsafe { libc::chmod(c.as_ptr(), (mode & 0o7777) as libc::mode_t) })?;
            }
            if uid.is_some() || gid.is_some() {
                let (u, g) = (uid.unwrap_or(u32::MAX), gid.unwrap_or(u32::MAX));
                // SAFETY: a valid C string; -1 leaves an id as it is.
                check(unsafe { libc::lchown(c.as_ptr(), u, g) })?;
            }
            if let Some(size) = size {
                let handles = self.handles.lock();
                match fh.and_then(|fh| handles.get(&fh.0)).and_then(|h| h.file.as_deref()) {
                    Some(f) => f.set_len(size).map_err(|e| errno(&e))?,
                    None => {
                        drop(handles);
                        std::fs::OpenOptions::new().write(true).open(&path).and_then(|f| f.set_len(size)).map_err(|e| errno(&e))?
                    }
                }
            }
            if atime.is_some() || mtime.is_some() {
                let ts = |t: Option<TimeOrNow>| match t {
                    None => libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_OMIT },
                    Some(TimeOrNow::Now) => libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_NOW },
                    Some(TimeOrNow::SpecificTime(t)) => {
                        let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
                        libc::timespec { tv_sec: d.as_secs() as libc::time_t, tv_nsec: d.subsec_nanos() as libc::c_long }
                    }
                };
                let times = [ts(atime), ts(mtime)];
                // SAFETY: a valid C string and two timespecs.
                check(unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), libc::AT_SYMLINK_NOFOLLOW) })?;
            }
            Ok(())
        })();
        match r.and_then(|()| self.attr(ino)) {
            Ok(a) => reply.attr(&ATTR_TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.real(ino).and_then(|p| std::fs::read_link(p).map_err(|e| errno(&e))) {
            Ok(t) => reply.data(t.as_os_str().as_bytes()),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        let r = (|| -> Result<PathBuf, Errno> {
            let rel = self.child(parent, name)?;
            let path = self.source.join(&rel);
            std::fs::DirBuilder::new().mode(mode & !umask & 0o7777).create(&path).map_err(|e| errno(&e))?;
            self.own(&path, req, path.parent().unwrap_or(&self.source))?;
            Ok(rel)
        })();
        match r {
            Ok(rel) => self.entry_of(rel, reply),
            Err(e) => reply.error(e),
        }
    }

    fn symlink(&self, req: &Request, parent: INodeNo, link_name: &OsStr, target: &Path, reply: ReplyEntry) {
        let r = (|| -> Result<PathBuf, Errno> {
            let rel = self.child(parent, link_name)?;
            let path = self.source.join(&rel);
            std::os::unix::fs::symlink(target, &path).map_err(|e| errno(&e))?;
            self.own(&path, req, path.parent().unwrap_or(&self.source))?;
            Ok(rel)
        })();
        match r {
            Ok(rel) => self.entry_of(rel, reply),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.child(parent, name).and_then(|rel| std::fs::remove_file(self.source.join(rel)).map_err(|e| errno(&e))) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.child(parent, name).and_then(|rel| std::fs::remove_dir(self.source.join(rel)).map_err(|e| errno(&e))) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let r = (|| -> Result<(), Errno> {
            let (from, to) = (self.child(parent, name)?, self.child(newparent, newname)?);
            let (cf, ct) = (cstr(&self.source.join(&from))?, cstr(&self.source.join(&to))?);
            // SAFETY: valid C strings; renameat2 with the caller's flags (NOREPLACE, EXCHANGE).
            let r = unsafe { libc::renameat2(libc::AT_FDCWD, cf.as_ptr(), libc::AT_FDCWD, ct.as_ptr(), flags.bits()) };
            if r != 0 {
                return Err(errno(&std::io::Error::last_os_error()));
            }
            // Nodes under the old name now live under the new one (an exchange swaps them).
            let exchange = flags.contains(RenameFlags::RENAME_EXCHANGE);
            let mut t = self.inodes.lock();
            for e in t.by_ino.values_mut() {
                if let Node::Real(p) = &mut e.node {
                    if let Ok(rest) = p.strip_prefix(&from) {
                        *p = if rest.as_os_str().is_empty() { to.clone() } else { to.join(rest) };
                    } else if let (true, Ok(rest)) = (exchange, p.strip_prefix(&to)) {
                        *p = if rest.as_os_str().is_empty() { from.clone() } else { from.join(rest) };
                    }
                }
            }
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let tgid = tgid_of(req.pid());
        let readable = flags.acc_mode() != OpenAccMode::O_WRONLY;
        let h = match self.node(ino) {
            Err(e) => return reply.error(e),
            Ok(Node::Control) => return reply.error(Errno::EISDIR),
            Ok(Node::Result(spec, rel)) => {
                if flags.acc_mode() != OpenAccMode::O_RDONLY {
                    warn!(ino = ino.0, pid = req.pid(), path = %rel.display(), "a result path opened for writing: results are read only (EACCES)");
                    return reply.error(Errno::EACCES);
                }
                let path = self.source.join(rel);
                Handle {
                    ino: ino.0,
                    file: None,
                    id: None,
                    direct: true,
                    backing: None,
                    path,
                    tgid,
                    readable,
                    attached: Some(Arc::new(Attached { spec, result: Mutex::new(None) })),
                }
            }
            Ok(Node::Real(rel)) => {
                let path = self.source.join(rel);
                // The access mode and the flags that change the file; O_CREAT and O_EXCL
                // came as create, O_NOFOLLOW and O_DIRECTORY the kernel has applied.
                let keep = libc::O_ACCMODE | libc::O_APPEND | libc::O_TRUNC | libc::O_SYNC | libc::O_DSYNC | libc::O_NOATIME;
                let mut o = std::fs::OpenOptions::new();
                o.read(readable).write(flags.acc_mode() != OpenAccMode::O_RDONLY).custom_flags(flags.0 & keep & !libc::O_ACCMODE);
                let (file, m) = match o.open(&path).and_then(|f| f.metadata().map(|m| (f, m))) {
                    Ok(x) => x,
                    Err(e) => return reply.error(errno(&e)),
                };
                let direct = flags.0 & libc::O_DIRECT != 0;
                let backing = self.backing_of(ino.0, &file, |f| reply.open_backing(f));
                let h = Handle {
                    ino: ino.0,
                    file: Some(Arc::new(file)),
                    id: Some(FileId::of(&m)),
                    direct: direct || backing.is_none(),
                    backing,
                    path,
                    tgid,
                    readable,
                    attached: None,
                };
                let (fopen, backing) = (h.fopen(), h.backing.clone());
                let fh = FileHandle(self.new_fh(h));
                return match backing {
                    Some(b) => reply.opened_passthrough(fh, fopen, &b),
                    None => reply.opened(fh, fopen),
                };
            }
        };
        let fh = self.new_fh(h);
        reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO);
    }

    fn read(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyData,
    ) {
        let size = size.min(IO_BYTES_MAX) as usize;
        let (attached, path, id) = {
            let handles = self.handles.lock();
            let Some(h) = handles.get(&fh.0) else { return reply.error(Errno::EBADF) };
            match (&h.attached, &h.file) {
                (Some(a), _) => (a.clone(), h.path.clone(), h.id),
                (None, Some(f)) => {
                    let f = f.clone();
                    drop(handles);
                    // Into this thread's buffer, made once: no allocation (and no fresh
                    // pages to fault in) per read; the table unlocked, so that reads of
                    // several descriptors run at once.
                    return READ_BUF.with_borrow_mut(|buf| {
                        buf.resize(IO_BYTES_MAX as usize, 0);
                        let buf = &mut buf[..size];
                        let mut n = 0;
                        while n < size {
                            match f.read_at(&mut buf[n..], offset + n as u64) {
                                Ok(0) => break,
                                Ok(k) => n += k,
                                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                                Err(e) => return reply.error(errno(&e)),
                            }
                        }
                        reply.data(&buf[..n])
                    });
                }
                (None, None) => return reply.error(Errno::EBADF),
            }
        };
        let slice = move |c: &Computed| {
            let start = (offset as usize).min(c.bytes.len());
            c.bytes[start..(start + size).min(c.bytes.len())].to_vec()
        };
        if let Some(c) = attached.result.lock().as_ref() {
            return reply.data(&slice(c));
        }
        // Computing takes as long as the operation: on a thread of its own, so that the
        // FUSE threads go on serving.
        if self.computing.fetch_add(1, Ordering::SeqCst) >= COMPUTE_IN_FLIGHT_MAX {
            self.computing.fetch_sub(1, Ordering::SeqCst);
            warn!(ino = ino.0, "{COMPUTE_IN_FLIGHT_MAX} operations are computing already: EAGAIN");
            return reply.error(Errno::EAGAIN);
        }
        // The file's name now: a rename through the mount moved it (the inode table
        // follows), a file swapped in beside the mount is refused (open_input).
        let path = match (id, self.node(ino)) {
            (Some(_), Ok(Node::Real(rel))) => self.source.join(rel),
            _ => path,
        };
        let computer = self.computer.clone();
        let computing = self.computing.clone();
        let counted = self.computing.clone();
        let caller = Caller::of(req);
        let last = matches!(self.node(ino), Ok(Node::Result(..))).then(|| self.last.clone());
        std::thread::Builder::new()
            .name("nearstore-fuse-op".into())
            .spawn(move || {
                let mut result = attached.result.lock();
                let r = match result.as_ref() {
                    Some(c) => Ok(slice(c)),
                    None => computer.compute(&attached.spec, &path, id, caller).map(|c| {
                        let (s, c) = (slice(&c), Arc::new(c));
                        if let Some(last) = last {
                            last.lock().insert(ino.0, c.clone());
                        }
                        *result = Some(c);
                        s
                    }),
                };
                drop(result);
                computing.fetch_sub(1, Ordering::SeqCst);
                match r {
                    Ok(data) => reply.data(&data),
                    Err(e) => reply.error(e),
                }
            })
            .map_err(|e| {
                // The thread never ran: its count goes (else every failure would hold one of
                // COMPUTE_IN_FLIGHT_MAX for ever); its request, dropped unanswered, gets EIO.
                counted.fetch_sub(1, Ordering::SeqCst);
                warn!("cannot start a compute thread: {e}")
            })
            .ok();
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: fuser::WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyWrite,
    ) {
        let Some(f) = self.handles.lock().get(&fh.0).and_then(|h| h.file.clone()) else { return reply.error(Errno::EBADF) };
        match f.write_all_at(data, offset) {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: fuser::LockOwner, reply: ReplyEmpty) {
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let h = self.handles.lock().remove(&fh.0);
        if let Some(ino) = h.and_then(|h| h.backing.is_some().then_some(h.ino)) {
            // The last passthrough descriptor of the inode gone: its backing file with it.
            let mut backing = self.backing.lock();
            if backing.get(&ino).is_some_and(|w| w.strong_count() == 0) {
                backing.remove(&ino);
            }
        }
        reply.ok();
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        let handles = self.handles.lock();
        let Some(h) = handles.get(&fh.0) else { return reply.error(Errno::EBADF) };
        let r = match h.file.as_deref() {
            Some(f) if datasync => f.sync_data(),
            Some(f) => f.sync_all(),
            None => Ok(()),
        };
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let (rel, result) = match self.node(ino) {
            Ok(Node::Real(p)) => (p, None),
            Ok(Node::Result(spec, p)) => (p, Some(spec)),
            // Operation specs are looked up by name, not listed.
            Ok(Node::Control) => (PathBuf::new(), None),
            Err(e) => return reply.error(e),
        };
        let is_control = ino.0 == CONTROL_INO;
        let mut entries: Vec<(u64, FileType, OsString)> =
            vec![(ino.0, FileType::Directory, ".".into()), (1, FileType::Directory, "..".into())];
        if !is_control {
            let dir = match std::fs::read_dir(self.source.join(&rel)) {
                Ok(d) => d,
                Err(e) => return reply.error(errno(&e)),
            };
            for e in dir.flatten() {
                let Ok(ft) = e.file_type() else { continue };
                let kind = FileType::from_std(ft).unwrap_or(FileType::RegularFile);
                if result.is_some() && !(ft.is_dir() || ft.is_file()) {
                    continue;
                }
                // The inode number a lookup gives, where one was made; the source's otherwise.
                let key = e.metadata().map(|m| (m.dev(), m.ino())).unwrap_or_default();
                let n = self.inodes.lock().real.get(&key).copied().unwrap_or(key.1);
                entries.push((n, kind, e.file_name()));
            }
        }
        for (i, (n, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(n.max(1)), (i + 1) as u64, kind, &name) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let c = match cstr(&self.source) {
            Ok(c) => c,
            Err(e) => return reply.error(e),
        };
        // SAFETY: zeroed statvfs is a valid value to be filled.
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: a valid C string and a statvfs to fill.
        if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
            return reply.error(errno(&std::io::Error::last_os_error()));
        }
        reply.statfs(s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree, s.f_bsize as u32, s.f_namemax as u32, s.f_frsize as u32);
    }

    fn setxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, value: &[u8], flags: i32, _position: u32, reply: ReplyEmpty) {
        if name == XATTR_OP {
            let r = match self.node(ino) {
                Ok(Node::Real(p)) if self.source.join(&p).is_dir() => {
                    warn!(path = %p.display(), "{XATTR_OP} on a directory: operations attach to regular files");
                    Err(Errno::EISDIR)
                }
                Ok(Node::Real(_)) => match std::str::from_utf8(value).map_err(|_| "the value is not UTF-8".to_string()).and_then(op::parse)
                {
                    Ok(spec) => self.attach_by_caller(req, ino, Some(Arc::new(spec))),
                    Err(e) => {
                        warn!(ino = ino.0, "{XATTR_OP}: {e}");
                        Err(Errno::EINVAL)
                    }
                },
                Ok(_) => {
                    warn!(ino = ino.0, "{XATTR_OP} on a result path or the control directory: they are read only (EROFS)");
                    Err(Errno::EROFS)
                }
                Err(e) => Err(e),
            };
            return match r {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(e),
            };
        }
        if name == XATTR_OFFLOADED {
            return reply.error(Errno::EPERM);
        }
        let r = self.real(ino).and_then(|p| {
            let (c, n) = (cstr(&p)?, CString::new(name.as_bytes()).map_err(|_| Errno::EINVAL)?);
            // SAFETY: valid C strings and a buffer of value.len() bytes.
            let r = unsafe { libc::lsetxattr(c.as_ptr(), n.as_ptr(), value.as_ptr().cast(), value.len(), flags) };
            if r != 0 {
                return Err(errno(&std::io::Error::last_os_error()));
            }
            Ok(())
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        if name == XATTR_OP || name == XATTR_OFFLOADED {
            let tgid = tgid_of(req.pid());
            let handles = self.handles.lock();
            let mine = handles.values().filter(|h| h.ino == ino.0 && h.attached.is_some());
            // The caller's own descriptor first; a result file's, anyone's.
            let (own, other): (Vec<&Handle>, Vec<&Handle>) = mine.partition(|h| h.tgid == tgid);
            let is_result = matches!(self.node(ino), Ok(Node::Result(..)));
            let pick = own.into_iter().chain(other.into_iter().filter(|_| is_result));
            let value = match (name == XATTR_OP, self.node(ino)) {
                (true, Ok(Node::Result(spec, _))) => Some(spec.text.clone()),
                (true, _) => pick.filter_map(|h| h.attached.as_ref()).map(|a| a.spec.text.clone()).next(),
                (false, _) => pick
                    .filter_map(|h| h.attached.as_ref().and_then(|a| a.result.lock().as_ref().map(|c| offloaded_text(&c.how))))
                    .next()
                    .or_else(|| self.last.lock().get(&ino.0).map(|c| offloaded_text(&c.how))),
            };
            return match value {
                Some(v) => reply_xattr(reply, v.as_bytes(), size),
                None => reply.error(Errno::from_i32(libc::ENODATA)),
            };
        }
        let Ok(n) = CString::new(name.as_bytes()) else { return reply.error(Errno::EINVAL) };
        // SAFETY: valid C strings and a buffer of len bytes.
        self.source_xattr(ino, size, reply, Some(Errno::from_i32(libc::ENODATA)), |c, buf, len| unsafe {
            libc::lgetxattr(c, n.as_ptr(), buf, len)
        });
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        // SAFETY: a valid C string and a buffer of len bytes.
        self.source_xattr(ino, size, reply, None, |c, buf, len| unsafe { libc::llistxattr(c, buf.cast(), len) });
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        if name == XATTR_OP {
            return match self.attach_by_caller(req, ino, None) {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(e),
            };
        }
        let r = self.real(ino).and_then(|p| {
            let (c, n) = (cstr(&p)?, CString::new(name.as_bytes()).map_err(|_| Errno::EINVAL)?);
            // SAFETY: valid C strings.
            if unsafe { libc::lremovexattr(c.as_ptr(), n.as_ptr()) } != 0 {
                return Err(errno(&std::io::Error::last_os_error()));
            }
            Ok(())
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn create(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, flags: i32, reply: ReplyCreate) {
        let r = (|| -> Result<(PathBuf, File), Errno> {
            let rel = self.child(parent, name)?;
            let path = self.source.join(&rel);
            let acc = flags & libc::O_ACCMODE;
            let mut o = std::fs::OpenOptions::new();
            o.read(acc != libc::O_WRONLY).write(true).create(true).mode(mode & !umask & 0o7777);
            o.custom_flags(flags & (libc::O_EXCL | libc::O_TRUNC | libc::O_APPEND));
            let f = o.open(&path).map_err(|e| errno(&e))?;
            self.own(&path, req, path.parent().unwrap_or(&self.source))?;
            Ok((rel, f))
        })();
        let (rel, file) = match r {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        let m = match file.metadata() {
            Ok(m) => m,
            Err(e) => return reply.error(errno(&e)),
        };
        let ino = self.remember_real(rel.clone(), &m);
        let readable = flags & libc::O_ACCMODE != libc::O_WRONLY;
        let backing = self.backing_of(ino, &file, |f| reply.open_backing(f));
        let direct = flags & libc::O_DIRECT != 0 || backing.is_none();
        let h = Handle {
            ino,
            file: Some(Arc::new(file)),
            id: Some(FileId::of(&m)),
            direct,
            backing,
            path: self.source.join(rel),
            tgid: tgid_of(req.pid()),
            readable,
            attached: None,
        };
        let (fopen, backing) = (h.fopen(), h.backing.clone());
        let fh = FileHandle(self.new_fh(h));
        match backing {
            Some(b) => reply.created_passthrough(&ATTR_TTL, &attr_of(ino, &m), Generation(0), fh, fopen, &b),
            None => reply.created(&ATTR_TTL, &attr_of(ino, &m), Generation(0), fh, fopen),
        }
    }

    fn ioctl(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        flags: IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        if flags.contains(IoctlFlags::FUSE_IOCTL_DIR) {
            warn!(ino = ino.0, cmd = format!("{cmd:#x}"), "ioctl on a directory: operations attach to regular files");
            return reply.error(Errno::EISDIR);
        }
        let r = match cmd {
            ioctl::ATTACH => match ioctl::decode_op(in_data).and_then(|s| op::parse(&s)) {
                Ok(spec) => self.attach_fh(fh, Some(Arc::new(spec))),
                Err(e) => {
                    warn!(ino = ino.0, pid = req.pid(), "NEARSTORE_IOC_ATTACH: {e}");
                    Err(Errno::EINVAL)
                }
            },
            ioctl::DETACH => self.attach_fh(fh, None),
            mount::IOC_EXTENTS => {
                return match self.extents_of(fh, in_data) {
                    Ok(out) => reply.ioctl(0, &out),
                    Err(e) => reply.error(e),
                };
            }
            _ => {
                warn!(ino = ino.0, pid = req.pid(), cmd = format_args!("{cmd:#x}"), "an ioctl this mount does not know (ENOTTY)");
                Err(Errno::ENOTTY)
            }
        };
        match r {
            Ok(()) => reply.ioctl(0, &[]),
            Err(e) => reply.error(e),
        }
    }
}

impl Handle {
    /// What the kernel is told of the descriptor: reads through the mount (a direct one,
    /// which FOPEN_DIRECT_IO keeps from the passthrough of the others) or passed through.
    fn fopen(&self) -> FopenFlags {
        if self.direct {
            FopenFlags::FOPEN_DIRECT_IO
        } else {
            FopenFlags::empty()
        }
    }
}

impl NearFs {
    /// `NEARSTORE_IOC_EXTENTS`: the extents of a descriptor's source file (FIEMAP, which
    /// writes its dirty pages back first) as global addresses of the namespace that holds
    /// them, which the kernel will not ask a FUSE file system for with FS_IOC_FIEMAP.
    fn extents_of(&self, fh: FileHandle, in_data: &[u8]) -> Result<Vec<u8>, Errno> {
        let start = mount::decode_request(in_data).map_err(|e| {
            warn!("NEARSTORE_IOC_EXTENTS: {e}");
            Errno::EINVAL
        })?;
        let (file, path) = {
            let handles = self.handles.lock();
            let h = handles.get(&fh.0).ok_or(Errno::EBADF)?;
            match &h.file {
                Some(f) => (f.clone(), h.path.clone()),
                None => {
                    warn!(path = %h.path.display(), "NEARSTORE_IOC_EXTENTS on a result file: it has no extents");
                    return Err(Errno::EINVAL);
                }
            }
        };
        let fail = |what: &str, e: Errno| {
            warn!(path = %path.display(), "NEARSTORE_IOC_EXTENTS: {what}");
            e
        };
        let m = file.metadata().map_err(|e| fail(&e.to_string(), errno(&e)))?;
        let devices = &self.computer.devices;
        let location = devices.locate(m.dev()).map_err(|reason| fail(&format!("on no exported namespace: {reason}"), Errno::ENODEV))?;
        let fs = nearstore_host::fiemap::extents(&file).map_err(|e| fail(&format!("FIEMAP of the source: {e}"), errno(&e)))?;
        let tag = devices.tag_of(&location.endpoint).unwrap_or(0);
        let extents = mount::translate(&fs, location.offset, tag).map_err(|e| fail(&e, Errno::EOVERFLOW))?;
        mount::encode_reply(&mount::MountMap { size: m.len(), endpoint: location.endpoint, tag, extents }, start)
            .map_err(|e| fail(&e, Errno::EINVAL))
    }

    /// The backing file of a passthrough open of `ino`: the one its open descriptors
    /// share, else `file` registered with the kernel by `open_backing`. None without
    /// passthrough, or when the kernel refuses the file (logged; the open is direct).
    fn backing_of(&self, ino: u64, file: &File, open_backing: impl FnOnce(&File) -> std::io::Result<BackingId>) -> Option<Arc<BackingId>> {
        if !self.passthrough {
            return None;
        }
        let mut backing = self.backing.lock();
        if let Some(b) = backing.get(&ino).and_then(Weak::upgrade) {
            return Some(b);
        }
        match open_backing(file) {
            Ok(b) => {
                let b = Arc::new(b);
                backing.insert(ino, Arc::downgrade(&b));
                Some(b)
            }
            Err(e) => {
                warn!(ino, "the kernel does not pass this file through ({e}): its reads and writes are requests to the mount");
                None
            }
        }
    }

    /// Attaches (or detaches) an operation to one descriptor, open for reading.
    fn attach_fh(&self, fh: FileHandle, spec: Option<Arc<OpSpec>>) -> Result<(), Errno> {
        let mut handles = self.handles.lock();
        let h = handles.get_mut(&fh.0).ok_or(Errno::EBADF)?;
        if h.file.is_none() {
            // A result file has its operation from its path.
            return Err(Errno::EINVAL);
        }
        if !h.readable {
            warn!(ino = h.ino, "NEARSTORE_IOC_ATTACH on a descriptor not open for reading");
            return Err(Errno::EBADF);
        }
        if !h.direct {
            warn!(ino = h.ino, "NEARSTORE_IOC_ATTACH on a descriptor not open with O_DIRECT: the kernel reads the file itself");
            return Err(Errno::from_i32(libc::EBADFD));
        }
        h.attached = spec.map(|spec| Arc::new(Attached { spec, result: Mutex::new(None) }));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Child, Command};

    fn caller(uid: u32, gid: u32, groups: &[u32]) -> Caller {
        Caller { uid, gid, groups: groups.to_vec() }
    }

    #[test]
    fn how_the_mount_acts_for_a_caller() {
        // (the mount's euid, egid, groups; the caller; what it does: switch, as itself, or a refusal naming why)
        let cases: [(u32, u32, &[u32], Caller, Result<bool, &str>); 8] = [
            (0, 0, &[0], caller(0, 0, &[]), Ok(false)),
            (0, 0, &[0], caller(65534, 65534, &[]), Ok(true)),
            (0, 0, &[], caller(0, 5, &[]), Ok(true)),
            (1000, 1000, &[1000, 27], caller(1000, 1000, &[1000, 27]), Ok(false)),
            // After `newgrp cdrom` (24): the group changed, the groups kept.
            (1000, 1000, &[1000, 27], caller(1000, 24, &[1000, 24, 27]), Ok(false)),
            (1000, 1000, &[1000, 27], caller(1000, 27, &[1000, 27]), Ok(false)),
            // The caller dropped a group the mount has: the mount would lend it.
            (1000, 1000, &[1000, 27], caller(1000, 1000, &[]), Err("has groups [27] the caller lacks")),
            (1000, 1000, &[1000], caller(1001, 1000, &[1000]), Err("the caller is another user")),
        ];
        for (euid, egid, groups, c, want) in cases {
            let got = acts_as_caller(euid, egid, groups, &c);
            match want {
                Ok(w) => assert_eq!(got, Ok(w), "mount {euid}/{egid} {groups:?}, {c:?}"),
                Err(words) => assert!(got.as_ref().is_err_and(|e| e.contains(words)), "mount {euid}/{egid} {groups:?}, {c:?}: {got:?}"),
            }
        }
    }

    #[test]
    fn a_status_gives_groups_only_for_the_requests_ids() {
        let status =
            |uid: &str, gid: &str, groups: &str| format!("Name:\tcat\nUid:\t{uid}\nGid:\t{gid}\nGroups:\t{groups}\nVmRSS:\t1 kB\n");
        // (status, the request's fsuid and fsgid, the groups or the words of the refusal)
        let cases: [(String, u32, u32, Result<Vec<u32>, &str>); 5] = [
            (status("1000\t1000\t1000\t1000", "1000\t1000\t1000\t1000", "24 27 1000 "), 1000, 1000, Ok(vec![24, 27, 1000])),
            (status("1000\t1000\t1000\t1000", "1000\t1000\t1000\t1000", ""), 1000, 1000, Ok(vec![])),
            // The file-system ids are the last ones, which a FUSE request carries.
            (status("0\t0\t0\t65534", "0\t0\t0\t65534", "4242"), 65534, 65534, Ok(vec![4242])),
            (status("0\t0\t0\t0", "0\t0\t0\t0", "4242"), 65534, 65534, Err("fsuid 0 and fsgid 0")),
            ("Name:\tcat\n".into(), 0, 0, Err("no Uid: line")),
        ];
        for (text, uid, gid, want) in cases {
            let got = status_groups(&text, uid, gid);
            match want {
                Ok(w) => assert_eq!(got, Ok(w), "{text}"),
                Err(words) => assert!(got.as_ref().is_err_and(|e| e.contains(words)), "{text}: {got:?}"),
            }
        }
    }

    /// `sleep` as the user nobody with `groups` (setpriv's options), killed when dropped.
    struct Sleeper(Child);
    impl Drop for Sleeper {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn sleeper(groups: &str) -> Sleeper {
        let child = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", groups, "sleep", "120"])
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run setpriv (util-linux, needed by this test): {e}"));
        Sleeper(child)
    }

    /// Waits until `pid` runs sleep (setpriv changed its ids and exec'd).
    fn wait_exec(pid: u32) {
        for _ in 0..3000 {
            if std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "sleep") {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("process {pid} did not exec sleep within 30 s");
    }

    /// A sleeper with PID `pid`: the kernel's next PID set to it (ns_last_pid, root's), tried
    /// again while other processes of the machine take it first.
    fn sleeper_with_pid(pid: u32, groups: &str) -> Sleeper {
        for _ in 0..1000 {
            std::fs::write("/proc/sys/kernel/ns_last_pid", format!("{}", pid - 1))
                .unwrap_or_else(|e| panic!("cannot set /proc/sys/kernel/ns_last_pid (this test needs root): {e}"));
            let s = sleeper(groups);
            if s.0.id() == pid {
                return s;
            }
        }
        panic!("PID {pid} was not given to a new process in 1000 tries");
    }

    /// A caller's groups are the ones it had when its request arrived: read later, its
    /// PID may belong to another process by then (it was killed, its PID reused), whose
    /// groups it would lend. And a status whose ids are not the request's gives none.
    #[test]
    fn a_callers_groups_are_read_when_its_request_arrives() {
        let first = sleeper("--clear-groups");
        let pid = first.0.id();
        wait_exec(pid);
        let arrived = Caller::at(65534, 65534, pid);
        assert_eq!(arrived.groups, Vec::<u32>::new());
        drop(first);
        let _second = sleeper_with_pid(pid, "--groups=4242");
        wait_exec(pid);
        assert_eq!(Caller::at(65534, 65534, pid).groups, vec![4242], "read late, the groups are another process's");
        assert_eq!(arrived, caller(65534, 65534, &[]), "the caller keeps its own");
        assert_eq!(Caller::at(1000, 1000, pid).groups, Vec::<u32>::new(), "a status of other ids lends nothing");
    }
}
