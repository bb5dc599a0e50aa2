//! Operations attached to open files of a real mount: through `fsetxattr` and the ioctl on
//! a descriptor opened with O_DIRECT, only the descriptor they were attached to reads the
//! result, the others (passed through by the kernel) never see it (equal to the operation run
//! on the file's bytes), others read the bytes; a file that cannot be offloaded is computed
//! in the mount and says why; bad input, a caller without the right, a lost target each
//! get a clear errno and a log line, never a hung mount. Needs root, loop devices,
//! mkfs.ext4 and /dev/fuse; fails naming what is missing.

mod common;

use std::ffi::CString;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use common::{text, within, Rig};
use nearstore_fuse::ioctl;

/// What the mount logged during the tests (its warnings name every refusal).
fn logs() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let w = buf.clone();
        tracing_subscriber::fmt().with_env_filter("info").with_ansi(false).with_writer(move || LogWriter(w.clone())).init();
        buf
    })
    .clone()
}

struct LogWriter(Arc<Mutex<Vec<u8>>>);
impl std::io::Write for LogWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Held by each test of this file for its whole run: the tests share one log, and one
/// running beside another could log the very words the other looks for (two tests refuse a
/// passed-through descriptor, two see the target refuse the mount's host). One at a time,
/// a line logged past a test's mark is that test's.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Where the log ends now: `logged_since` looks only past it, so that a line of an earlier
/// case cannot answer for a later one.
fn log_mark() -> usize {
    logs().lock().unwrap().len()
}

fn logged_since(mark: usize, words: &str) -> bool {
    String::from_utf8_lossy(&logs().lock().unwrap()[mark..]).contains(words)
}

/// Whether one line logged past `mark` holds every one of `words`: with the file's path
/// among them, a line of another test running at the same time cannot answer.
fn logged_line_since(mark: usize, words: &[&str]) -> bool {
    String::from_utf8_lossy(&logs().lock().unwrap()[mark..]).lines().any(|l| words.iter().all(|w| l.contains(w)))
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// fsetxattr(fd, name, value): Ok or the errno.
fn fset(f: &File, name: &str, value: &[u8]) -> Result<(), i32> {
    let n = CString::new(name).unwrap();
    // SAFETY: an open descriptor, a C string and a buffer of value.len() bytes.
    let r = unsafe { libc::fsetxattr(f.as_raw_fd(), n.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(errno())
    }
}

fn fget(f: &File, name: &str) -> Result<String, i32> {
    let n = CString::new(name).unwrap();
    let mut buf = vec![0u8; 4096];
    // SAFETY: an open descriptor, a C string and a buffer of buf.len() bytes.
    let r = unsafe { libc::fgetxattr(f.as_raw_fd(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        return Err(errno());
    }
    Ok(String::from_utf8_lossy(&buf[..r as usize]).into_owned())
}

fn set_path(p: &Path, name: &str, value: &[u8]) -> Result<(), i32> {
    let (c, n) = (CString::new(p.to_str().unwrap()).unwrap(), CString::new(name).unwrap());
    // SAFETY: C strings and a buffer of value.len() bytes.
    let r = unsafe { libc::setxattr(c.as_ptr(), n.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(errno())
    }
}

/// ioctl(fd, cmd, data): Ok or the errno.
fn ioc(f: &File, cmd: u32, data: &mut [u8]) -> Result<(), i32> {
    // SAFETY: an open descriptor and a buffer of the size the command encodes.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), cmd as _, data.as_mut_ptr()) };
    if r == 0 {
        Ok(())
    } else {
        Err(errno())
    }
}

/// The file opened for reading with O_DIRECT: each read reaches the mount, so it can carry
/// an operation.
fn direct(p: &Path) -> File {
    File::options().read(true).custom_flags(libc::O_DIRECT).open(p).unwrap()
}

/// All of a descriptor from offset 0.
fn read_all(f: &File) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = f.read_at(&mut buf, out.len() as u64).unwrap();
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&buf[..n]);
    }
}

/// The operation over the bytes, computed here, rendered as the mount renders it.
fn expected(spec: &str, data: &[u8]) -> String {
    let s = nearstore_fuse::op::parse(spec).unwrap();
    let o = nearstore_compute::run(s.op.name, &s.args, [data]).unwrap();
    String::from_utf8(nearstore_fuse::op::render(&o)).unwrap()
}

#[test]
fn an_operation_attached_to_a_descriptor_changes_only_its_reads() {
    let _serial = serial();
    logs();
    let rig = Rig::new();
    let data = text((3 << 20) + 123, 5);
    std::fs::write(rig.m("app.log"), &data).unwrap();
    let a = direct(&rig.m("app.log"));
    // (how it is attached, spec)
    let cases = [("xattr", "sha256"), ("ioctl", "grep:^ERROR"), ("xattr", "wc"), ("ioctl", "search:needle"), ("xattr", "crc32c")];
    for (how, spec) in cases {
        match how {
            "xattr" => fset(&a, "user.nearstore.op", spec.as_bytes()).unwrap(),
            _ => ioc(&a, ioctl::ATTACH, &mut ioctl::encode_op(spec)).unwrap(),
        }
        let got = within(60, spec, {
            let a = a.try_clone().unwrap();
            move || read_all(&a)
        });
        assert_eq!(String::from_utf8(got).unwrap(), expected(spec, &data), "{how} {spec}");
        assert_eq!(fget(&a, "user.nearstore.op").unwrap(), spec);
        assert_eq!(fget(&a, "user.nearstore.offloaded").unwrap(), "1", "{spec}: computed on the target");
        // A new open, and another process, read the bytes.
        let b = File::open(rig.m("app.log")).unwrap();
        assert!(read_all(&b) == data, "{spec}: another descriptor reads the file's bytes");
        let cat = std::process::Command::new("cat").arg(rig.m("app.log")).output().unwrap();
        assert!(cat.stdout == data, "{spec}: another process reads the file's bytes");
        // Past the page cache too, where the mount tells descriptors apart: a new O_DIRECT
        // descriptor of this process, and one of another process.
        assert!(read_all(&direct(&rig.m("app.log"))) == data, "{spec}: a new direct descriptor reads the file's bytes");
        let dd = std::process::Command::new("dd")
            .args(["iflag=direct", "bs=1M", "status=none"])
            .arg(format!("if={}", rig.m("app.log").display()))
            .output()
            .unwrap();
        assert!(dd.status.success() && dd.stdout == data, "{spec}: another process's direct reads get the file's bytes");
    }
    // Detached (ioctl) or removed (xattr): the bytes again.
    ioc(&a, ioctl::DETACH, &mut []).unwrap();
    assert!(read_all(&a) == data);
    fset(&a, "user.nearstore.op", b"md5").unwrap();
    assert_eq!(String::from_utf8(read_all(&a)).unwrap(), expected("md5", &data));
    let n = CString::new("user.nearstore.op").unwrap();
    // SAFETY: an open descriptor and a C string.
    assert_eq!(unsafe { libc::fremovexattr(a.as_raw_fd(), n.as_ptr()) }, 0);
    assert!(read_all(&a) == data);
    // A select over CSV, and the result path of the same.
    std::fs::write(rig.m("t.csv"), "id,city\n1,Oslo\n2,Lima\n3,Oslo\n").unwrap();
    let spec = "select:SELECT city, COUNT(*) FROM s3object GROUP BY city ORDER BY city";
    let f = direct(&rig.m("t.csv"));
    fset(&f, "user.nearstore.op", spec.as_bytes()).unwrap();
    assert_eq!(String::from_utf8(read_all(&f)).unwrap(), "city,COUNT(*)\nLima,1\nOslo,2\n");
    let via_path = rig.m(".nearstore").join(spec).join("t.csv");
    assert_eq!(std::fs::read_to_string(via_path).unwrap(), "city,COUNT(*)\nLima,1\nOslo,2\n");
    // In a subdirectory.
    std::fs::create_dir(rig.m("sub")).unwrap();
    std::fs::write(rig.m("sub/x"), b"abc").unwrap();
    assert_eq!(std::fs::read_to_string(rig.m(".nearstore/sha256/sub/x")).unwrap(), expected("sha256", b"abc"));
    let listed: Vec<String> =
        std::fs::read_dir(rig.m(".nearstore/sha256/sub")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(listed, vec!["x"]);
}

#[test]
fn a_file_that_cannot_be_offloaded_is_computed_in_the_mount_and_says_why() {
    let _serial = serial();
    let mark = log_mark();
    // No map: the source's device is no known namespace.
    let rig = Rig::with(|o| o.devices = nearstore_host::device::DeviceMap::default());
    std::fs::write(rig.m("f"), b"hello\n").unwrap();
    let f = direct(&rig.m("f"));
    fset(&f, "user.nearstore.op", b"sha256").unwrap();
    assert_eq!(String::from_utf8(read_all(&f)).unwrap(), expected("sha256", b"hello\n"));
    let why = fget(&f, "user.nearstore.offloaded").unwrap();
    assert!(why.starts_with("0 ") && why.contains("which no known target exports"), "{why}");
    let source = rig.s("f").display().to_string();
    assert!(logged_line_since(mark, &["computed in the mount, not offloaded", &source]), "a line naming {source}");
    let p = rig.m(".nearstore/wc/f");
    assert_eq!(std::fs::read_to_string(&p).unwrap(), "1 1 6\n");
}

#[test]
fn bad_input_gets_a_clear_errno_and_a_log_line() {
    let _serial = serial();
    logs();
    let rig = Rig::new();
    std::fs::write(rig.m("f"), b"data\n").unwrap();
    // Written beside the mount: no descriptor of the mount's (a close's release reaches
    // the mount after close returns).
    std::fs::write(rig.s("g"), b"not open\n").unwrap();
    std::fs::create_dir(rig.m("dir")).unwrap();
    let f = direct(&rig.m("f"));
    let plain = File::open(rig.m("f")).unwrap();
    let dir = File::open(rig.m("dir")).unwrap();
    let wo = File::options().write(true).open(rig.m("f")).unwrap();
    // A file this process holds open for writing only, past the page cache (not passed
    // through).
    std::fs::write(rig.m("h"), b"write only\n").unwrap();
    let wo_direct = File::options().write(true).custom_flags(libc::O_DIRECT).open(rig.m("h")).unwrap();
    let mut bad_version = ioctl::encode_op("sha256");
    bad_version[0] = 7;
    type Case<'a> = (&'a str, Box<dyn Fn() -> Result<(), i32> + 'a>, i32, &'a str);
    let cases: Vec<Case> = vec![
        ("unknown operation", Box::new(|| fset(&f, "user.nearstore.op", b"frobnicate")), libc::EINVAL, "unknown operation 'frobnicate'"),
        ("not UTF-8", Box::new(|| fset(&f, "user.nearstore.op", &[0xff, 0xfe])), libc::EINVAL, "not UTF-8"),
        ("bad regex", Box::new(|| fset(&f, "user.nearstore.op", b"grep:(")), libc::EINVAL, "grep-count"),
        ("bad SQL", Box::new(|| fset(&f, "user.nearstore.op", b"select:SELEKT 1")), libc::EINVAL, "select"),
        ("an unnamed output", Box::new(|| fset(&f, "user.nearstore.op", b"copy")), libc::EINVAL, "writes an output file"),
        ("xattr on a directory", Box::new(|| fset(&dir, "user.nearstore.op", b"sha256")), libc::EISDIR, "on a directory"),
        ("by path, no descriptor", Box::new(|| set_path(&rig.m("g"), "user.nearstore.op", b"sha256")), libc::EBADF, "no descriptor"),
        (
            "xattr with a write-only descriptor",
            Box::new(|| fset(&wo_direct, "user.nearstore.op", b"sha256")),
            libc::EACCES,
            "descriptors of this file are not open for reading",
        ),
        (
            "xattr on a result path",
            Box::new(|| set_path(&rig.m(".nearstore/sha256/f"), "user.nearstore.op", b"sha256")),
            libc::EROFS,
            "they are read only (EROFS)",
        ),
        (
            "write-only descriptor",
            Box::new(|| ioc(&wo, ioctl::ATTACH, &mut ioctl::encode_op("sha256"))),
            libc::EBADF,
            "NEARSTORE_IOC_ATTACH on a descriptor not open for reading",
        ),
        ("ioctl version", Box::new(|| ioc(&f, ioctl::ATTACH, &mut bad_version.clone())), libc::EINVAL, "version 7"),
        ("ioctl bad spec", Box::new(|| ioc(&f, ioctl::ATTACH, &mut ioctl::encode_op("nope"))), libc::EINVAL, "unknown operation 'nope'"),
        (
            "ioctl on a directory",
            Box::new(|| ioc(&dir, ioctl::ATTACH, &mut ioctl::encode_op("sha256"))),
            libc::EISDIR,
            "ioctl on a directory",
        ),
        (
            "descriptor passed through",
            Box::new(|| ioc(&plain, ioctl::ATTACH, &mut ioctl::encode_op("sha256"))),
            libc::EBADFD,
            "not open with O_DIRECT",
        ),
        ("unknown ioctl", Box::new(|| ioc(&f, 0x4E7F, &mut [])), libc::ENOTTY, "an ioctl this mount does not know (ENOTTY)"),
        (
            "result of an unknown operation",
            Box::new(|| std::fs::read(rig.m(".nearstore/nope/f")).map(|_| ()).map_err(|e| e.raw_os_error().unwrap())),
            libc::EINVAL,
            ".nearstore/nope",
        ),
        (
            "writing a result",
            Box::new(|| File::options().write(true).open(rig.m(".nearstore/sha256/f")).map(|_| ()).map_err(|e| e.raw_os_error().unwrap())),
            libc::EACCES,
            "a result path opened for writing",
        ),
    ];
    for (what, call, want, words) in cases {
        let mark = log_mark();
        assert_eq!(call(), Err(want), "{what}");
        assert!(logged_since(mark, words), "{what}: no log line with {words:?} after the call");
    }
    // None of it changed what the descriptor reads.
    assert_eq!(read_all(&f), b"data\n");
}

/// Runs `f` on a thread whose credentials are nobody's (65534, no groups): the raw
/// syscalls change the calling thread's only, as the FUSE requests it makes see them.
fn as_nobody_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    within(60, "as nobody", move || {
        // SAFETY: raw syscalls changing only this thread's credentials.
        unsafe {
            assert_eq!(libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()), 0);
            assert_eq!(libc::syscall(libc::SYS_setresgid, 65534, 65534, 65534), 0);
            assert_eq!(libc::syscall(libc::SYS_setresuid, 65534, 65534, 65534), 0);
        }
        f()
    })
}

#[test]
fn an_operation_attaches_only_where_the_caller_may_read() {
    let _serial = serial();
    logs();
    let rig = Rig::new();
    std::fs::write(rig.m("secret"), b"s3cr3t\n").unwrap();
    std::fs::set_permissions(rig.m("secret"), std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(rig.m("public"), b"open\n").unwrap();
    std::fs::set_permissions(rig.m("public"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let (secret, public, result) = (rig.m("secret"), rig.m("public"), rig.m(".nearstore/sha256/secret"));
    let want = expected("sha256", b"open\n");
    let got = as_nobody_thread(move || {
        let open_secret = File::open(&secret).map(|_| ()).map_err(|e| e.raw_os_error());
        let result_secret = std::fs::read(&result).map(|_| ()).map_err(|e| e.raw_os_error());
        // A reader attaches with the ioctl: it needs only a descriptor open for reading.
        let f = direct(&public);
        let ioctl = ioc(&f, ioctl::ATTACH, &mut ioctl::encode_op("sha256"));
        let read = String::from_utf8(read_all(&f)).unwrap();
        // The attribute is a user.* attribute: the kernel wants write permission for it.
        let g = File::open(&public).unwrap();
        let xattr = fset(&g, "user.nearstore.op", b"sha256");
        (open_secret, result_secret, ioctl, read, xattr)
    });
    assert_eq!(got.0, Err(Some(libc::EACCES)), "nobody opens a 0600 file of root");
    assert_eq!(got.1, Err(Some(libc::EACCES)), "nobody reads its result path");
    assert_eq!(got.2, Ok(()));
    assert_eq!(got.3, want);
    assert_eq!(got.4, Err(libc::EACCES));
}

#[test]
fn a_target_lost_under_an_open_file_fails_its_reads_not_the_mount() {
    let _serial = serial();
    let mark = log_mark();
    let mut rig = Rig::new();
    let data = text(1 << 20, 9);
    std::fs::write(rig.m("f"), &data).unwrap();
    let f = direct(&rig.m("f"));
    fset(&f, "user.nearstore.op", b"sha256").unwrap();
    rig.lose_target();
    let r = within(60, "a read with the target gone", move || {
        let mut buf = vec![0u8; 4096];
        f.read_at(&mut buf, 0).map_err(|e| e.raw_os_error())
    });
    assert_eq!(r, Err(Some(libc::EIO)));
    let source = rig.s("f").display().to_string();
    assert!(logged_line_since(mark, &["operation failed", &source]), "the failure is logged, naming {source}");
    // The mount goes on serving the file's bytes.
    assert!(std::fs::read(rig.m("f")).unwrap() == data);
}

/// A descriptor opened without O_DIRECT is passed through to the source file (it maps, and
/// sees bytes written beside the mount at once); one with O_DIRECT carries an operation.
/// Neither ever reads the other's bytes, whatever was read before; and an operation
/// attaches to no passed-through descriptor.
#[test]
fn passed_through_and_attached_descriptors_never_share_bytes() {
    let _serial = serial();
    let mark = log_mark();
    let rig = Rig::new();
    let data = text((1 << 20) + 77, 11);
    std::fs::write(rig.m("f"), &data).unwrap();
    let a = File::open(rig.m("f")).unwrap();
    assert!(read_all(&a) == data, "a plain descriptor reads the bytes");
    let b = direct(&rig.m("f"));
    ioc(&b, ioctl::ATTACH, &mut ioctl::encode_op("sha256")).unwrap();
    let want = expected("sha256", &data);
    // (descriptor, what it reads) in an order that would let a shared cache leak either way.
    let plain_after = File::open(rig.m("f")).unwrap();
    let unattached_direct = direct(&rig.m("f"));
    let reads: [(&str, &File, &[u8]); 5] = [
        ("attached", &b, want.as_bytes()),
        ("plain, opened before", &a, &data),
        ("attached, again", &b, want.as_bytes()),
        ("plain, opened after", &plain_after, &data),
        ("direct, nothing attached", &unattached_direct, &data),
    ];
    for (what, f, want) in reads {
        let got = within(60, what, {
            let f = f.try_clone().unwrap();
            move || read_all(&f)
        });
        assert!(got == want, "{what}: {} bytes, want {}", got.len(), want.len());
    }
    // Passed through: a plain descriptor maps (a direct-I/O FUSE file cannot), and sees a
    // write beside the mount at once, no stale cache in between.
    // SAFETY: a read-only shared map of an open descriptor, unmapped below.
    let map = unsafe { libc::mmap(std::ptr::null_mut(), data.len(), libc::PROT_READ, libc::MAP_SHARED, plain_after.as_raw_fd(), 0) };
    assert_ne!(map, libc::MAP_FAILED, "mmap of a plain descriptor: {}", std::io::Error::last_os_error());
    // SAFETY: the map is data.len() bytes long.
    let mapped = unsafe { std::slice::from_raw_parts(map as *const u8, data.len()) } == &data[..];
    // SAFETY: the map made above.
    unsafe { libc::munmap(map, data.len()) };
    assert!(mapped, "the map holds the file's bytes");
    File::options().write(true).open(rig.s("f")).unwrap().write_all_at(b"CHANGED", 0).unwrap();
    let mut head = [0u8; 7];
    a.read_exact_at(&mut head, 0).unwrap();
    assert_eq!(&head, b"CHANGED", "a plain descriptor reads the source's bytes now");
    assert!(read_all(&b) == want.as_bytes(), "the attached descriptor keeps its result");
    // The attribute through a process whose only descriptor is passed through.
    std::fs::write(rig.m("g"), b"g\n").unwrap();
    let g = File::open(rig.m("g")).unwrap();
    assert_eq!(fset(&g, "user.nearstore.op", b"sha256"), Err(libc::EBADFD));
    assert!(logged_since(mark, "not open with O_DIRECT"));
    assert_eq!(read_all(&g), b"g\n");
}

/// The mount is one tenant (`--hostnqn`): the target applies that host's reach to every
/// operation, whichever user caused it. Beyond its reach, or for a host in no tenant, a
/// result read fails with EACCES and a log line; the mount never computes it from the bytes
/// with its own rights instead.
#[test]
fn the_mount_is_one_tenant_and_gets_no_result_beyond_its_reach() {
    let _serial = serial();
    let mark = log_mark();
    let host = |name: &str| format!("nqn.2026-11.io.nearstore:fusetest-{name}");
    let tenants = format!(
        "[[tenant]]\nname = \"wide\"\nhosts = [\"{}\"]\n[[tenant.reach]]\nsubsystem = \"{}\"\n\
         [[tenant]]\nname = \"narrow\"\nhosts = [\"{}\"]\n[[tenant.reach]]\nsubsystem = \"{}\"\nnsid = 1\nlbas = [0, 8]\n",
        host("wide"),
        common::NQN,
        host("narrow"),
        common::NQN
    );
    let rig = Rig::with_target(&tenants, |o| o.hostnqn = Some(host("wide")));
    let data = text(200_000, 4);
    std::fs::write(rig.m("f"), &data).unwrap();
    let want = expected("sha256", &data);
    // (host NQN of the mount, what a result read gives)
    let cases: [(&str, Result<&str, i32>); 3] =
        [("wide", Ok(want.as_str())), ("narrow", Err(libc::EACCES)), ("stranger", Err(libc::EACCES))];
    for (name, want) in cases {
        let got = sha256_through_another_mount(&rig, name, |o| o.hostnqn = Some(host(name)));
        assert_eq!(got.as_deref().map_err(|e| *e), want, "{name}");
    }
    assert!(logged_since(mark, "operation refused by the target to this mount's host"));
}

/// Reads `.nearstore/sha256/f` through a second mount of the rig's source, made as
/// `adjust` says; the file's bytes read as ever through it (the kernel checks the caller).
fn sha256_through_another_mount(rig: &Rig, name: &str, adjust: impl FnOnce(&mut nearstore_fuse::Options)) -> Result<String, i32> {
    let mnt = rig.dir.path().join(format!("as-{name}"));
    std::fs::create_dir(&mnt).unwrap();
    let mut opts = nearstore_fuse::Options::new(&rig.fs.mnt, &mnt, rig.devices.clone());
    opts.op_timeout = std::time::Duration::from_secs(10);
    adjust(&mut opts);
    let _mounted = nearstore_fuse::spawn(opts).unwrap();
    let result = mnt.join(".nearstore/sha256/f");
    let got = within(60, name, move || std::fs::read_to_string(result).map_err(|e| e.raw_os_error().unwrap_or(0)));
    assert!(std::fs::read(mnt.join("f")).unwrap() == std::fs::read(rig.s("f")).unwrap(), "{name}: the bytes");
    got
}

/// The mount authenticates as its host (`--dhchap-secret`) where the target asks: with the
/// host's key it gets the result; without one, or with another, the read fails with EACCES
/// and a log line.
#[test]
fn the_mount_authenticates_as_its_host() {
    let _serial = serial();
    let mark = log_mark();
    const KEY: &str = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:";
    const OTHER_KEY: &str = "DHHC-1:00:9wCYVQqDvADjGIZo6q/v2SfmXZqqkNa9TcvYu97Ly3Q/gajh:";
    let keyed = "nqn.2026-11.io.nearstore:fusetest-keyed";
    let rig = Rig::with_target(&format!("[[subsystem.host]]\nnqn = \"{keyed}\"\ndhchap_key = \"{KEY}\"\n"), |_| {});
    let data = text(100_000, 6);
    std::fs::write(rig.m("f"), &data).unwrap();
    let want = expected("sha256", &data);
    // (name, the mount's secret, what a result read gives)
    let cases: [(&str, Option<&str>, Result<&str, i32>); 3] = [
        ("right-key", Some(KEY), Ok(want.as_str())),
        ("no-key", None, Err(libc::EACCES)),
        ("wrong-key", Some(OTHER_KEY), Err(libc::EACCES)),
    ];
    for (name, secret, want) in cases {
        let got = sha256_through_another_mount(&rig, name, |o| {
            o.hostnqn = Some(keyed.into());
            o.dhchap_secret = secret.map(|k| k.parse().unwrap());
        });
        assert_eq!(got.as_deref().map_err(|e| *e), want, "{name}");
    }
    assert!(logged_since(mark, "operation refused by the target to this mount's host"));
}

/// docs/fuse.md's Python example of NEARSTORE_IOC_EXTENTS, run as printed against a real
/// mount, gives the extents the host library reads.
#[test]
fn the_extents_python_example_of_the_docs_runs() {
    let _serial = serial();
    logs();
    let rig = Rig::tagged(3);
    let f = File::create(rig.m("f")).unwrap();
    for i in 0..200u64 {
        f.write_all_at(&text(4096, i + 1), i * 8192).unwrap();
    }
    drop(f);
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/fuse.md")).unwrap();
    let at = doc.find("NEARSTORE_IOC_EXTENTS = 0xD0004E03").expect("docs/fuse.md has the extents example");
    let start = doc[..at].rfind("```python\n").unwrap() + "```python\n".len();
    let script =
        format!("{}\nfor e in extents({:?}):\n    print(*e)\n", &doc[start..start + doc[start..].find("```").unwrap()], rig.m("f"));
    let out = std::process::Command::new("python3")
        .args(["-c", &script])
        .output()
        .unwrap_or_else(|e| panic!("cannot run python3 (needed by this test): {e}"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let map = nearstore_host::mount::extents(&File::open(rig.m("f")).unwrap()).unwrap();
    let want: String = map.extents.iter().map(|e| format!("{} 3 {} {}\n", e.logical, e.address & ((1 << 48) - 1), e.length)).collect();
    assert!(map.extents.len() > 119, "more than one reply");
    assert_eq!(String::from_utf8_lossy(&out.stdout), want);
}

/// The output of `FILE` through the host library on this host, as `nearstore` writes it
/// (`Host::transform`), into `out`.
fn transform_here(spec: &str, file: &Path, out: &Path) -> Vec<u8> {
    let s = nearstore_fuse::op::parse(spec).unwrap();
    let inputs = [file.to_path_buf()];
    let cap = nearstore_host::output_capacity(s.op, &inputs).unwrap();
    let mut host = nearstore_host::Host::new(nearstore_host::device::DeviceMap::default());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(host.transform(s.op, &s.args, &inputs, out, cap, nearstore_host::Mode::Local)).unwrap();
    std::fs::read(out).unwrap()
}

/// Transforms (compress, sort, select-into) through a result path or attached to a
/// descriptor write their output beside the file, offloaded, equal to the host library's
/// output of the same operation, owned by the caller; where the caller may not write
/// (a directory of root's as the user nobody, a file of root's it would replace) the read
/// fails with EACCES and a log line, and nothing is written.
#[test]
fn transform_outputs_appear_as_files_where_the_caller_may_write() {
    let _serial = serial();
    let mark = log_mark();
    let rig = Rig::new();
    for d in ["open", "closed"] {
        std::fs::create_dir(rig.m(d)).unwrap();
    }
    std::fs::set_permissions(rig.m("open"), std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::set_permissions(rig.m("closed"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let data = text(300_000, 8);
    let rows: String = (0..2000).map(|i| format!("{i},{}\n", ["Oslo", "Lima", "Kyiv"][i % 3])).collect();
    for d in ["open", "closed"] {
        std::fs::write(rig.m(&format!("{d}/app.log")), &data).unwrap();
        std::fs::write(rig.m(&format!("{d}/t.csv")), format!("id,city\n{rows}")).unwrap();
    }
    let query = "SELECT city, COUNT(*) FROM s3object GROUP BY city ORDER BY city";
    // (spec, file, its output beside it) through the result path, as root
    let cases = [("compress", "open/app.log", "open/app.log.zst"), ("sort", "open/app.log", "open/app.log.sorted")];
    let into = format!("select-into:{query}");
    let cases = cases.iter().copied().chain([(into.as_str(), "open/t.csv", "open/t.csv.select.csv")]);
    for (spec, file, output) in cases {
        let report = within(60, spec, {
            let p = rig.m(".nearstore").join(spec).join(file);
            move || std::fs::read_to_string(p)
        })
        .unwrap();
        let got = std::fs::read(rig.m(output)).unwrap();
        assert_eq!(report, format!("{} {}\n", Path::new(output).file_name().unwrap().to_str().unwrap(), got.len()), "{spec}");
        let want = transform_here(spec, &rig.s(file), &rig.s("here.out"));
        assert!(got == want, "{spec}: the mount's output ({} bytes) is the host library's ({} bytes)", got.len(), want.len());
        assert_eq!(fget(&File::open(rig.m(".nearstore").join(spec).join(file)).unwrap(), "user.nearstore.offloaded"), Ok("1".into()));
    }
    // Attached to a descriptor, read as the user nobody: an output where nobody may write is
    // nobody's; where it may not, EACCES.
    let (open_log, closed_log, closed_csv) = (rig.m("open/t.csv"), rig.m("closed/app.log"), rig.m(".nearstore/compress/closed/t.csv"));
    std::fs::write(rig.s("open/t.csv.sorted"), b"root's\n").unwrap();
    let got = as_nobody_thread(move || {
        let read = |f: &File| {
            let mut buf = vec![0u8; 4096];
            f.read_at(&mut buf, 0).map(|n| String::from_utf8_lossy(&buf[..n]).into_owned()).map_err(|e| e.raw_os_error())
        };
        let f = direct(&open_log);
        ioc(&f, ioctl::ATTACH, &mut ioctl::encode_op("compress:5")).unwrap();
        let compressed = read(&f);
        // A file of root's it would replace.
        ioc(&f, ioctl::ATTACH, &mut ioctl::encode_op("sort")).unwrap();
        let sorted = read(&f);
        let g = direct(&closed_log);
        ioc(&g, ioctl::ATTACH, &mut ioctl::encode_op("sort")).unwrap();
        let closed = read(&g);
        let by_path = std::fs::read(closed_csv).map(|_| ()).map_err(|e| e.raw_os_error());
        (compressed, sorted, closed, by_path)
    });
    let out = std::fs::metadata(rig.s("open/t.csv.zst")).unwrap();
    assert_eq!(got.0, Ok(format!("t.csv.zst {}\n", out.len())));
    assert_eq!((out.uid(), out.gid()), (65534, 65534), "the output is the caller's");
    assert_eq!(std::fs::read(rig.s("open/t.csv.zst")).unwrap(), transform_here("compress:5", &rig.s("open/t.csv"), &rig.s("here.out")));
    assert_eq!(got.1, Err(Some(libc::EACCES)), "replacing root's file");
    assert_eq!(std::fs::read(rig.s("open/t.csv.sorted")).unwrap(), b"root's\n", "untouched");
    assert_eq!(got.2, Err(Some(libc::EACCES)), "in root's directory");
    assert_eq!(got.3, Err(Some(libc::EACCES)), "in root's directory, by path");
    assert!(!rig.s("closed/app.log.sorted").exists() && !rig.s("closed/t.csv.zst").exists());
    assert!(logged_since(mark, "output refused: the caller may not write its directory"));
    assert!(logged_since(mark, "output refused: the caller may not write the file it would replace"));
}

/// The mount runs as root for unprivileged callers: whatever names a caller swaps in (a
/// symbolic link at the output's name, the source itself replaced by a link after the
/// open), the operation reaches files with the caller's rights only. Each case, as the user
/// nobody in its own directory: (what nobody does before attaching, the operation, what
/// nobody does between attaching and reading); the read fails with EACCES and root's files
/// keep their bytes.
#[test]
fn a_caller_reaches_no_file_of_roots_through_swapped_names() {
    let _serial = serial();
    let mark = log_mark();
    let rig = Rig::new();
    std::fs::create_dir(rig.s("mine")).unwrap();
    std::os::unix::fs::chown(rig.s("mine"), Some(65534), Some(65534)).unwrap();
    std::fs::write(rig.s("crontab"), b"root's crontab\n").unwrap();
    std::fs::set_permissions(rig.s("crontab"), std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::write(rig.s("shadow"), b"root's secret\n").unwrap();
    std::fs::set_permissions(rig.s("shadow"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let (crontab, shadow) = (rig.s("crontab"), rig.s("shadow"));
    // (file, operation, its link made before attaching, the file replaced after attaching)
    let cases = [
        ("a", "sort", Some(("mine/a.sorted", crontab.clone())), None),
        ("b", "compress", Some(("mine/b.zst", crontab.clone())), None),
        ("c", "sha256", None, Some(shadow.clone())),
        ("d", "sort", None, Some(shadow.clone())),
    ];
    for (name, spec, link, swap) in cases {
        let (file, mounted) = (rig.s(&format!("mine/{name}")), rig.m(&format!("mine/{name}")));
        let link = link.map(|(l, to)| (rig.s(l), to));
        let got = as_nobody_thread(move || {
            std::fs::write(&file, b"b\na\n").unwrap();
            if let Some((l, to)) = &link {
                std::os::unix::fs::symlink(to, l).unwrap();
            }
            let f = direct(&mounted);
            ioc(&f, ioctl::ATTACH, &mut ioctl::encode_op(spec)).unwrap();
            if let Some(to) = &swap {
                std::fs::remove_file(&file).unwrap();
                std::os::unix::fs::symlink(to, &file).unwrap();
            }
            let mut buf = vec![0u8; 4096];
            f.read_at(&mut buf, 0).map(|n| String::from_utf8_lossy(&buf[..n]).into_owned()).map_err(|e| e.raw_os_error())
        });
        assert_eq!(got, Err(Some(libc::EACCES)), "{name}: {spec}");
        assert_eq!(std::fs::read(&crontab).unwrap(), b"root's crontab\n", "{name}: {spec}");
        assert_eq!(std::fs::read(&shadow).unwrap(), b"root's secret\n", "{name}: {spec}");
        let m = std::fs::metadata(&crontab).unwrap();
        assert_eq!((m.uid(), m.mode() & 0o777), (0, 0o644), "{name}: {spec}");
    }
    assert!(logged_since(mark, "output refused: a symbolic link at the output's name"));
}

/// docs/fuse.md's Python example, run as printed against a real mount.
#[test]
fn the_python_example_of_the_docs_runs() {
    let _serial = serial();
    logs();
    let rig = Rig::new();
    let data = text(200_000, 3);
    std::fs::write(rig.m("app.log"), &data).unwrap();
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/fuse.md")).unwrap();
    let start = doc.find("```python\n").expect("docs/fuse.md has a Python example") + "```python\n".len();
    let script = doc[start..start + doc[start..].find("```").unwrap()].replace("/mnt/view", rig.mnt.to_str().unwrap());
    let out = std::process::Command::new("python3")
        .args(["-c", &script])
        .output()
        .unwrap_or_else(|e| panic!("cannot run python3 (needed by this test): {e}"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let want = format!("lines with ERROR: {}sha256: {}offloaded: 1\n", expected("grep:^ERROR", &data), expected("sha256", &data));
    assert_eq!(String::from_utf8_lossy(&out.stdout), want);
}

/// NEARSTORE_IOC_EXTENTS on files of every layout (one block, large, sparse, more extents
/// than one reply holds) is the source's FIEMAP as global addresses of the namespace's tag,
/// with the namespace named; the host library maps a file of the mount to the same object
/// as the source's file.
#[test]
fn the_mounts_extents_are_the_sources_fiemap_as_global_addresses() {
    let _serial = serial();
    logs();
    let rig = Rig::tagged(9);
    // (name, (offset, bytes) written)
    let many: Vec<(u64, usize)> = (0..300u64).map(|i| (i * 8192, 4096)).collect();
    let cases: [(&str, Vec<(u64, usize)>); 4] =
        [("small", vec![(0, 100)]), ("large", vec![(0, 3 << 20)]), ("sparse", vec![(0, 65536), (10 << 20, 5000)]), ("fragmented", many)];
    for (name, writes) in cases {
        let f = File::create(rig.m(name)).unwrap();
        for (i, (at, len)) in writes.iter().enumerate() {
            f.write_all_at(&text(*len, i as u64 + 1), *at).unwrap();
        }
        drop(f);
        let got = nearstore_host::mount::extents(&File::open(rig.m(name)).unwrap()).unwrap();
        let source = File::open(rig.s(name)).unwrap();
        let want = nearstore_host::mount::translate(&nearstore_host::fiemap::extents(&source).unwrap(), 0, 9).unwrap();
        assert_eq!((got.size, &got.endpoint, got.tag), (source.metadata().unwrap().len(), &rig.ep, 9), "{name}");
        assert_eq!(got.extents, want, "{name}");
        assert!(!want.is_empty(), "{name}");
        let (on_mount, on_source) = (
            nearstore_host::object::map_file(&rig.m(name), &rig.devices).unwrap(),
            nearstore_host::object::map_file(&rig.s(name), &rig.devices).unwrap(),
        );
        match (on_mount, on_source) {
            (nearstore_host::object::Mapped::Offload(m), nearstore_host::object::Mapped::Offload(s)) => {
                assert_eq!((&m.object, &m.location.endpoint), (&s.object, &s.location.endpoint), "{name}");
                m.verify().unwrap();
            }
            other => panic!("{name}: {other:?}"),
        }
    }
    assert!(nearstore_host::mount::extents(&File::open(rig.m("fragmented")).unwrap()).unwrap().extents.len() > 119, "paged");
}

/// NEARSTORE_IOC_EXTENTS where there are no extents to give: a clear errno and a log line.
#[test]
fn the_extents_ioctl_refuses_what_has_no_extents_on_a_namespace() {
    let _serial = serial();
    let mark = log_mark();
    let rig = Rig::new();
    std::fs::write(rig.m("f"), b"data\n").unwrap();
    std::fs::create_dir(rig.m("dir")).unwrap();
    let unmapped = Rig::with(|o| o.devices = nearstore_host::device::DeviceMap::default());
    std::fs::write(unmapped.m("f"), b"data\n").unwrap();
    let extents = |p: &Path| {
        let f = File::open(p).map_err(|e| e.raw_os_error().unwrap())?;
        nearstore_host::mount::extents(&f).map(|_| ()).map_err(|e| e.raw_os_error().unwrap_or(0))
    };
    let mut bad_version = nearstore_host::mount::encode_request(0);
    bad_version[0] = 3;
    let f = File::open(rig.m("f")).unwrap();
    // (what, result, errno, what the log says)
    let cases: [(&str, Result<(), i32>, i32, &str); 4] = [
        ("a directory", extents(&rig.m("dir")), libc::EISDIR, "ioctl on a directory"),
        ("a file on no exported namespace", extents(&unmapped.m("f")), libc::ENODEV, "on no exported namespace"),
        ("a result file", extents(&rig.m(".nearstore/sha256/f")), libc::EINVAL, "on a result file"),
        ("a bad version", ioc(&f, nearstore_host::mount::IOC_EXTENTS, &mut bad_version), libc::EINVAL, "version 3"),
    ];
    for (what, got, want, words) in cases {
        assert_eq!(got, Err(want), "{what}");
        assert!(logged_since(mark, words), "{what}: no log line with {words:?}");
    }
    // The host library computes such a file itself and says why.
    match nearstore_host::object::map_file(&unmapped.m("f"), &unmapped.devices).unwrap() {
        nearstore_host::object::Mapped::Local { reason, .. } => assert!(reason.contains("nearstore mount does not map it"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

/// A file on a block device the mount's map names, whose file system maps no extents
/// (squashfs has no FIEMAP): NEARSTORE_IOC_EXTENTS fails with the source's errno,
/// EOPNOTSUPP, and says so in the log.
#[test]
fn the_extents_ioctl_passes_on_a_source_without_fiemap() {
    let _serial = serial();
    let mark = log_mark();
    let dir = tempfile::tempdir().unwrap();
    let content = dir.path().join("content");
    std::fs::create_dir(&content).unwrap();
    std::fs::write(content.join("f"), text(100_000, 4)).unwrap();
    let image = dir.path().join("sq.img");
    let o = std::process::Command::new("mksquashfs")
        .arg(&content)
        .arg(&image)
        .args(["-quiet", "-noappend"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run mksquashfs (squashfs-tools, needed by this test): {e}"));
    assert!(o.status.success(), "mksquashfs: {o:?}");
    let somewhere =
        nearstore_host::device::Endpoint { address: "127.0.0.1:9".parse().unwrap(), nqn: "nqn.2026-11.io.nearstore:none".into(), nsid: 1 };
    let rig = Rig::with(|o| o.devices.add_file(&image, somewhere).unwrap());
    let at = rig.s("sq");
    std::fs::create_dir(&at).unwrap();
    let _mounted = nearstore_testkit::Mounted::new(&["-t", "squashfs", "-o", "loop,ro", image.to_str().unwrap()], &at);
    let f = File::open(rig.m("sq/f")).unwrap();
    assert_eq!(nearstore_host::mount::extents(&f).map(|_| ()).map_err(|e| e.raw_os_error()), Err(Some(libc::EOPNOTSUPP)));
    assert!(logged_since(mark, "FIEMAP of the source"), "the refusal is logged");
}

/// Linux answers FIEMAP in the VFS from the inode's fiemap operation, which FUSE lacks: the
/// mount answers NEARSTORE_IOC_EXTENTS instead (docs/fuse.md, "FIEMAP").
#[test]
fn fiemap_on_the_mount_is_refused_by_the_kernel() {
    let _serial = serial();
    let rig = Rig::new();
    std::fs::write(rig.m("f"), text(100_000, 1)).unwrap();
    let e = nearstore_host::fiemap::extents(&File::open(rig.m("f")).unwrap()).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EOPNOTSUPP), "{e}");
    assert!(!nearstore_host::fiemap::extents(&File::open(rig.s("f")).unwrap()).unwrap().is_empty());
}

/// FS_IOC_FIEMAP through a program of a user's, as the C library passes it: the script
/// answers each query (`[path, start, length, count, flags]`, JSON on its argv) with what
/// FIEMAP gave, one JSON line each.
const FIEMAP_PY: &str = r#"
import fcntl, json, os, struct, sys
FS_IOC_FIEMAP = 0xC020660B
for path, start, length, count, flags in json.loads(sys.argv[1]):
    buf = bytearray(struct.pack("QQIIII", start, length, flags, 0, count, 0) + bytes(56 * max(count, 20)))
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, FS_IOC_FIEMAP, buf)
        err = 0
    except OSError as e:
        err = e.errno
    finally:
        os.close(fd)
    flags_out, mapped = struct.unpack_from("II", buf, 16)
    extents = [list(struct.unpack_from("QQQ", buf, 32 + 56 * i)) + [struct.unpack_from("I", buf, 72 + 56 * i)[0]] for i in range(mapped if count else 0)]
    print(json.dumps({"errno": err, "flags": flags_out, "mapped": mapped, "extents": extents if not err else []}))
"#;

/// crates/fuse/shim/nearstore_fiemap.c, built with the C compiler into `dir`.
fn fiemap_shim(dir: &Path) -> std::path::PathBuf {
    let so = dir.join("libnearstore_fiemap.so");
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/shim/nearstore_fiemap.c");
    let out = std::process::Command::new("cc")
        .args(["-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-o"])
        .arg(&so)
        .args([src, "-ldl"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run cc (a C compiler, needed by this test to build the FIEMAP library): {e}"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    so
}

/// Runs FIEMAP_PY's `queries`, with `preload` in LD_PRELOAD if some.
fn fiemap_queries(preload: Option<&Path>, queries: &serde_json::Value) -> Vec<serde_json::Value> {
    let mut cmd = std::process::Command::new("python3");
    cmd.args(["-c", FIEMAP_PY, &queries.to_string()]);
    if let Some(so) = preload {
        cmd.env("LD_PRELOAD", so);
    }
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run python3 (needed by this test): {e}"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// Preloaded, crates/fuse/shim's library answers FIEMAP on files of the mount from the
/// mount's extents ioctl with FIEMAP's semantics (a range, a count only, a short array, an
/// unsupported flag, an empty range), the physical addresses global ones of the namespace's
/// tag; FIEMAP on the source goes to the kernel untouched, and without it the mount's files
/// still have none. filefrag, which knows only FIEMAP, maps a file through the mount.
#[test]
fn fiemap_through_the_preloaded_library_is_the_mounts_extents() {
    let _serial = serial();
    logs();
    let rig = Rig::tagged(5);
    let so = fiemap_shim(rig.dir.path());
    let (sync, xattr) = (1u32, 2u32); // FIEMAP_FLAG_SYNC, FIEMAP_FLAG_XATTR
    let many: Vec<(u64, usize)> = (0..300u64).map(|i| (i * 8192, 4096)).collect();
    let cases: [(&str, Vec<(u64, usize)>); 5] = [
        ("empty", vec![]),
        ("one", vec![(0, 1)]),
        ("large", vec![(0, 3 << 20)]),
        ("sparse", vec![(0, 65536), (10 << 20, 5000)]),
        ("fragmented", many),
    ];
    for (name, writes) in cases {
        let f = File::create(rig.m(name)).unwrap();
        for (i, (at, len)) in writes.iter().enumerate() {
            f.write_all_at(&text(*len, i as u64 + 1), *at).unwrap();
        }
        drop(f);
        let map = nearstore_host::mount::extents(&File::open(rig.m(name)).unwrap()).unwrap();
        assert!(map.extents.iter().all(|e| e.address >> 48 == 5), "{name}: tagged");
        let path = rig.m(name).to_str().unwrap().to_string();
        let mid = map.extents.get(map.extents.len() / 2).map_or(0, |e| e.logical + 1);
        // (start, length, count, flags)
        let queries: Vec<(u64, u64, u32, u32)> = vec![
            (0, u64::MAX, 0, sync),
            (0, u64::MAX, 1000, sync),
            (0, u64::MAX, 2, 0),
            (0, u64::MAX, 1, 0),
            (mid, 8192 * 10, 1000, 0),
            (mid, 1, 1000, 0),
            (map.size, u64::MAX, 1000, 0),
            (0, u64::MAX, 20, sync | xattr),
            (0, 0, 20, 0),
        ];
        let asked = serde_json::Value::from(
            queries.iter().map(|&(s, l, c, fl)| serde_json::json!([path.clone(), s, l, c, fl])).collect::<Vec<_>>(),
        );
        let got = fiemap_queries(Some(&so), &asked);
        for (&(start, length, count, flags), got) in queries.iter().zip(&got) {
            let want = if flags & !sync != 0 {
                serde_json::json!({"errno": libc::EBADR, "flags": flags & !sync, "mapped": 0, "extents": []})
            } else if length == 0 {
                serde_json::json!({"errno": libc::EINVAL, "flags": flags, "mapped": 0, "extents": []})
            } else {
                let end = start.saturating_add(length);
                let hit: Vec<_> = map.extents.iter().filter(|e| e.logical + e.length > start && e.logical < end).collect();
                let listed: Vec<_> =
                    hit.iter().take(count as usize).map(|e| serde_json::json!([e.logical, e.address, e.length, e.flags])).collect();
                let mapped = if count == 0 { hit.len() } else { listed.len() };
                serde_json::json!({"errno": 0, "flags": flags, "mapped": mapped, "extents": listed})
            };
            assert_eq!(got, &want, "{name}: FIEMAP from {start} for {length}, {count} extents, flags {flags}");
        }
        assert_eq!(got[0]["mapped"], serde_json::json!(map.extents.len()), "{name}: counted");
    }
    assert!(nearstore_host::mount::extents(&File::open(rig.m("fragmented")).unwrap()).unwrap().extents.len() > 119, "paged");
    // The source's FIEMAP goes to its kernel file system untouched; without the library the
    // mount's files have none; a result file has none through it either.
    let all = |p: &Path| serde_json::json!([[p.to_str().unwrap(), 0, u64::MAX, 1000, sync]]);
    let source = nearstore_host::fiemap::extents(&File::open(rig.s("sparse")).unwrap()).unwrap();
    let want: Vec<_> = source.iter().map(|e| serde_json::json!([e.logical, e.physical, e.length, e.flags])).collect();
    assert_eq!(fiemap_queries(Some(&so), &all(&rig.s("sparse")))[0]["extents"], serde_json::json!(want));
    assert_eq!(fiemap_queries(None, &all(&rig.m("sparse")))[0]["errno"], serde_json::json!(libc::EOPNOTSUPP));
    // Where the mount has no extents to give (a result file, a file on no exported
    // namespace), FIEMAP's "not here", as the kernel says it of a file system without it.
    assert_eq!(fiemap_queries(Some(&so), &all(&rig.m(".nearstore/sha256/sparse")))[0]["errno"], serde_json::json!(libc::EOPNOTSUPP));
    std::fs::create_dir(rig.s("mem")).unwrap();
    let _tmpfs = nearstore_testkit::Mounted::new(&["-t", "tmpfs", "-o", "size=1m", "tmpfs"], &rig.s("mem"));
    std::fs::write(rig.m("mem/f"), b"on no namespace\n").unwrap();
    assert_eq!(fiemap_queries(Some(&so), &all(&rig.m("mem/f")))[0]["errno"], serde_json::json!(libc::EOPNOTSUPP));
    // filefrag, a tool of e2fsprogs that knows only FIEMAP.
    let filefrag = |preload: bool| {
        let mut cmd = std::process::Command::new("filefrag");
        cmd.args(["-v", "-b4096"]).arg(rig.m("fragmented"));
        if preload {
            cmd.env("LD_PRELOAD", &so);
        }
        let out = cmd.output().unwrap_or_else(|e| panic!("cannot run filefrag (e2fsprogs, needed by this test): {e}"));
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    };
    let out = filefrag(true);
    let map = nearstore_host::mount::extents(&File::open(rig.m("fragmented")).unwrap()).unwrap();
    let first = &map.extents[0];
    let row = format!("0:        0..       0: {:>10}..{:>10}:", first.address / 4096, first.address / 4096);
    assert!(out.contains(&row), "filefrag's first extent is the mount's ({row:?}): {out}");
    let last = &map.extents[299];
    let row_last =
        format!("299: {:>8}..{:>8}: {:>10}..{:>10}:", last.logical / 4096, last.logical / 4096, last.address / 4096, last.address / 4096);
    assert!(out.contains(&row_last) && out.contains("last,eof"), "filefrag's last extent is the mount's ({row_last:?}): {out}");
    let without = filefrag(false);
    assert!(!without.contains(&row), "without the library, no FIEMAP on the mount: {without}");
}

/// What happens to a file between attaching an operation to a descriptor of it and reading
/// the result.
#[derive(Clone, Copy, Debug)]
enum Change {
    Nothing,
    /// Renamed through the mount: the descriptor's file under another name.
    RenamedThroughTheMount,
    /// Another file the caller may read renamed over its name in the source directory.
    ReplacedBeside,
    /// A FIFO made at its name in the source directory.
    FifoBeside,
}

/// An operation computes over the file its descriptor opened, never over another file put
/// at its name afterwards (one the caller may read, or a FIFO, whose open would block): the
/// read fails with ESTALE and a log line. A rename through the mount is followed.
#[test]
fn an_operation_computes_only_over_the_file_its_descriptor_opened() {
    let _serial = serial();
    let mark = log_mark();
    let rig = Rig::new();
    std::fs::create_dir(rig.s("mine")).unwrap();
    std::os::unix::fs::chown(rig.s("mine"), Some(65534), Some(65534)).unwrap();
    let (a, b) = (b"the descriptor's file\n", b"a file swapped in\n");
    let want_a = expected("sha256", a);
    // (as the user nobody, what happens, what the read gives)
    let cases: [(bool, Change, Result<&str, i32>); 6] = [
        (false, Change::Nothing, Ok(&want_a)),
        (false, Change::RenamedThroughTheMount, Ok(&want_a)),
        (false, Change::ReplacedBeside, Err(libc::ESTALE)),
        (true, Change::ReplacedBeside, Err(libc::ESTALE)),
        (false, Change::FifoBeside, Err(libc::ESTALE)),
        (true, Change::FifoBeside, Err(libc::ESTALE)),
    ];
    for (i, (nobody, change, want)) in cases.into_iter().enumerate() {
        let (file, other) = (rig.s(&format!("mine/f{i}")), rig.s(&format!("mine/g{i}")));
        let (mounted, renamed) = (rig.m(&format!("mine/f{i}")), rig.m(&format!("mine/h{i}")));
        let run = move || {
            std::fs::write(&file, a).unwrap();
            std::fs::write(&other, b).unwrap();
            let f = direct(&mounted);
            ioc(&f, ioctl::ATTACH, &mut ioctl::encode_op("sha256")).unwrap();
            match change {
                Change::Nothing => {}
                Change::RenamedThroughTheMount => std::fs::rename(&mounted, &renamed).unwrap(),
                Change::ReplacedBeside => std::fs::rename(&other, &file).unwrap(),
                Change::FifoBeside => {
                    std::fs::remove_file(&file).unwrap();
                    let c = CString::new(file.to_str().unwrap()).unwrap();
                    // SAFETY: a C string.
                    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
                }
            }
            let mut buf = vec![0u8; 4096];
            f.read_at(&mut buf, 0).map(|n| String::from_utf8_lossy(&buf[..n]).into_owned()).map_err(|e| e.raw_os_error().unwrap_or(0))
        };
        let got = if nobody { as_nobody_thread(run) } else { within(60, "a read", run) };
        assert_eq!(got.as_deref().map_err(|e| *e), want, "{change:?}, as {}", if nobody { "nobody" } else { "root" });
    }
    assert!(logged_since(mark, "not the descriptor's"), "the refusal is logged");
}

/// A result larger than a read of the mount holds (select's rows beyond what a result
/// returns inline), computed on the target or in the mount: EFBIG and a log line, as
/// docs/fuse.md's error table says.
#[test]
fn a_result_too_large_fails_with_efbig() {
    let _serial = serial();
    let mark = log_mark();
    let rows: String = (0..20_000).map(|i| format!("{i},{}\n", "x".repeat(20))).collect();
    // (where it is computed, the mount)
    let rigs: [(&str, fn() -> Rig); 2] =
        [("on the target", Rig::new), ("in the mount", || Rig::with(|o| o.devices = nearstore_host::device::DeviceMap::default()))];
    for (how, rig) in rigs {
        let rig = rig();
        std::fs::write(rig.m("t.csv"), format!("id,name\n{rows}")).unwrap();
        let p = rig.m(".nearstore/select:SELECT * FROM s3object/t.csv");
        let got = within(60, how, move || std::fs::read(p).map(|_| ()).map_err(|e| e.raw_os_error()));
        assert_eq!(got, Err(Some(libc::EFBIG)), "{how}");
        let small = rig.m(".nearstore/select:SELECT COUNT(*) FROM s3object/t.csv");
        assert_eq!(std::fs::read_to_string(small).unwrap(), "COUNT(*)\n20000\n", "{how}: a small result of the same file");
    }
    assert!(logged_since(mark, "result too large"), "the refusal is logged");
}
