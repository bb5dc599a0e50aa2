//! Plain file operations through a real FUSE mount give what they give on the source:
//! files of many sizes written and read back, truncated, renamed, removed, listed, their
//! modes and owners, several readers at once, and a waiting request holding one thread of
//! the mount, not the mount. Needs root, loop devices, mkfs.ext4,
//! /dev/fuse and setpriv; fails naming what is missing.

mod common;

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};

use common::{as_nobody, text, within, Rig};

/// The sizes the issue names: empty, one byte, around a block, and past 1 MiB.
const SIZES: [usize; 6] = [0, 1, 4095, 4096, 4097, (1 << 20) + 1];

/// Compares bytes, saying where they differ rather than printing them.
fn same(got: &[u8], want: &[u8], what: &str) {
    let first = got.iter().zip(want).position(|(a, b)| a != b);
    assert!(got.len() == want.len() && first.is_none(), "{what}: {} bytes, want {}; first difference at {first:?}", got.len(), want.len());
}

#[test]
fn files_of_every_size_read_and_write_as_on_the_source() {
    let rig = Rig::new();
    for (i, size) in SIZES.into_iter().enumerate() {
        let name = format!("f-{size}");
        let data = text(size, i as u64);
        let (m, s) = (rig.m(&name), rig.s(&name));
        // Written through the mount: the source has the bytes, and the mount reads them.
        within(30, "write", {
            let (m, data) = (m.clone(), data.clone());
            move || std::fs::write(m, data).unwrap()
        });
        same(&std::fs::read(&s).unwrap(), &data, &format!("{name}: source after a write through the mount"));
        same(&std::fs::read(&m).unwrap(), &data, &format!("{name}: read through the mount"));
        assert_eq!(std::fs::metadata(&m).unwrap().len(), size as u64, "{name}: stat");
        // Written on the source: the mount sees it.
        let other = text(size, 100 + i as u64);
        std::fs::write(&s, &other).unwrap();
        same(&std::fs::read(&m).unwrap(), &other, &format!("{name}: source written beside the mount"));
        // Reads at odd offsets and lengths.
        let mut f = File::open(&m).unwrap();
        let mut buf = vec![0u8; 777];
        let mut got = Vec::new();
        loop {
            let n = f.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        same(&got, &other, &format!("{name}: read in 777-byte pieces"));
        // Truncated shorter and longer through the mount.
        let mut want = other.clone();
        for len in [size / 2, size + 4096] {
            OpenOptions::new().write(true).open(&m).unwrap().set_len(len as u64).unwrap();
            want.resize(len, 0);
            same(&std::fs::read(&s).unwrap(), &want, &format!("{name}: truncated to {len}"));
            assert_eq!(std::fs::metadata(&m).unwrap().len(), len as u64);
        }
        // Appended to.
        let mut f = OpenOptions::new().append(true).open(&m).unwrap();
        f.write_all(b"tail").unwrap();
        drop(f);
        assert!(std::fs::read(&s).unwrap().ends_with(b"tail"), "{name}: append");
    }
}

#[test]
fn names_change_and_list_as_on_the_source() {
    let rig = Rig::new();
    std::fs::create_dir(rig.m("d")).unwrap();
    std::fs::create_dir(rig.m("d/sub")).unwrap();
    std::fs::write(rig.m("d/sub/a"), b"alpha").unwrap();
    std::fs::write(rig.m("d/b"), b"beta").unwrap();
    assert!(rig.s("d/sub/a").is_file());
    let list = |p: &std::path::Path| {
        let mut v: Vec<String> = std::fs::read_dir(p).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    };
    assert_eq!(list(&rig.m("d")), vec!["b", "sub"]);
    // Rename a file, then the directory holding one: the old names are gone, the new
    // ones read the same bytes (a node known under its old name follows).
    std::fs::rename(rig.m("d/b"), rig.m("d/c")).unwrap();
    assert!(!rig.s("d/b").exists());
    assert_eq!(std::fs::read(rig.m("d/c")).unwrap(), b"beta");
    let a = File::open(rig.m("d/sub/a")).unwrap();
    std::fs::rename(rig.m("d/sub"), rig.m("moved")).unwrap();
    assert_eq!(std::fs::read(rig.m("moved/a")).unwrap(), b"alpha");
    assert!(!rig.m("d/sub").exists());
    drop(a);
    // Over an existing name, as rename(2) does.
    std::fs::write(rig.m("x"), b"x").unwrap();
    std::fs::rename(rig.m("d/c"), rig.m("x")).unwrap();
    assert_eq!(std::fs::read(rig.s("x")).unwrap(), b"beta");
    // Unlink and rmdir.
    std::fs::remove_file(rig.m("moved/a")).unwrap();
    std::fs::remove_dir(rig.m("moved")).unwrap();
    assert!(!rig.s("moved").exists());
    assert_eq!(std::fs::remove_dir(rig.m("d")).map_err(|e| e.kind()), Ok(()));
    assert_eq!(std::fs::remove_file(rig.m("nothing")).unwrap_err().raw_os_error(), Some(libc::ENOENT));
    // Symbolic links.
    std::os::unix::fs::symlink("x", rig.m("link")).unwrap();
    assert_eq!(std::fs::read_link(rig.m("link")).unwrap().to_str(), Some("x"));
    assert_eq!(std::fs::read(rig.m("link")).unwrap(), b"beta");
    // The root lists what the source holds (.nearstore is looked up, not listed).
    let mut want = list(&rig.fs.mnt);
    want.sort();
    assert_eq!(list(&rig.mnt), want);
}

#[test]
fn modes_and_owners_are_the_sources_and_the_kernel_enforces_them() {
    let rig = Rig::new();
    std::fs::write(rig.m("secret"), b"s3cr3t").unwrap();
    std::fs::set_permissions(rig.m("secret"), std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(std::fs::metadata(rig.s("secret")).unwrap().mode() & 0o777, 0o600, "chmod through the mount");
    let m = std::fs::metadata(rig.m("secret")).unwrap();
    assert_eq!((m.mode() & 0o777, m.uid(), m.gid()), (0o600, 0, 0));
    // (mode, what nobody gets reading it)
    let secret = rig.m("secret");
    let cases: [(u32, Result<&str, &str>); 3] =
        [(0o600, Err("Permission denied")), (0o604, Ok("s3cr3t")), (0o640, Err("Permission denied"))];
    for (mode, want) in cases {
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(mode)).unwrap();
        let out = as_nobody("cat", &[secret.to_str().unwrap()]);
        match want {
            Ok(text) => assert_eq!(String::from_utf8_lossy(&out.stdout), text, "mode {mode:o}"),
            Err(words) => {
                assert!(!out.status.success(), "mode {mode:o}: nobody read it");
                assert!(String::from_utf8_lossy(&out.stderr).contains(words), "mode {mode:o}: {}", String::from_utf8_lossy(&out.stderr));
            }
        }
    }
    // A file nobody creates is nobody's, on the source too; nobody cannot write root's.
    let mine = rig.m("nobodys");
    let out = as_nobody("sh", &["-c", &format!("echo hi > {}", mine.display())]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let m = std::fs::metadata(rig.s("nobodys")).unwrap();
    assert_eq!((m.uid(), m.gid()), (65534, 65534));
    let out = as_nobody("sh", &["-c", &format!("echo hi >> {}", secret.display())]);
    assert!(!out.status.success());
    // chown as root; timestamps set through the mount.
    std::os::unix::fs::chown(rig.m("secret"), Some(65534), None).unwrap();
    assert_eq!(std::fs::metadata(rig.s("secret")).unwrap().uid(), 65534);
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
    File::options().write(true).open(rig.m("secret")).unwrap().set_modified(t).unwrap();
    assert_eq!(std::fs::metadata(rig.s("secret")).unwrap().mtime(), 1_000_000_000);
}

#[test]
fn several_readers_at_once_each_get_their_file() {
    let rig = Rig::new();
    let files: Vec<(std::path::PathBuf, Vec<u8>)> =
        (0..8).map(|i| (rig.m(&format!("r{i}")), text((3 << 20) + i * 1000, i as u64))).collect();
    for (p, d) in &files {
        std::fs::write(p, d).unwrap();
    }
    let readers: Vec<_> =
        files.iter().cloned().map(|(p, d)| std::thread::spawn(move || (0..3).all(|_| std::fs::read(&p).unwrap() == d))).collect();
    within(120, "eight readers", move || {
        for r in readers {
            assert!(r.join().unwrap());
        }
    });
}

/// `getxattr(2)` (len 0 asks for the size) and `listxattr(2)` of a path in the mount: what
/// they return, or the errno.
fn xattr_call(path: &std::path::Path, name: Option<&str>, len: usize) -> Result<Vec<u8>, i32> {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    let mut buf = vec![0u8; len];
    let r = match name {
        Some(name) => {
            let n = std::ffi::CString::new(name).unwrap();
            // SAFETY: C strings and a buffer of buf.len() bytes.
            unsafe { libc::getxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) }
        }
        // SAFETY: a C string and a buffer of buf.len() bytes.
        None => unsafe { libc::listxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) },
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
    }
    buf.truncate(if len == 0 { 0 } else { r as usize });
    Ok(if len == 0 { (r as u64).to_string().into_bytes() } else { buf })
}

/// A source file's own extended attributes read through the mount as on the source (a
/// value, its size, a list, a buffer too small, one that is absent); a result path under
/// `.nearstore` has none of its own: an empty list, ENODATA for a value.
#[test]
fn a_source_files_attributes_read_through_the_mount() {
    let rig = Rig::new();
    std::fs::write(rig.s("f"), text(10_000, 3)).unwrap();
    let (c, n) = (std::ffi::CString::new(rig.s("f").to_str().unwrap()).unwrap(), std::ffi::CString::new("user.color").unwrap());
    // SAFETY: C strings and a buffer of 4 bytes.
    assert_eq!(unsafe { libc::setxattr(c.as_ptr(), n.as_ptr(), b"blue".as_ptr().cast(), 4, 0) }, 0, "setxattr on the source");
    let (f, result) = (rig.m("f"), rig.m(".nearstore/sha256/f"));
    // (what, path, attribute or None for the list, buffer length (0: the size), what comes back)
    let cases: [(&str, &std::path::Path, Option<&str>, usize, Result<&[u8], i32>); 9] = [
        ("a value", &f, Some("user.color"), 64, Ok(b"blue")),
        ("a value's size", &f, Some("user.color"), 0, Ok(b"4")),
        ("a buffer too small", &f, Some("user.color"), 2, Err(libc::ERANGE)),
        ("an absent value", &f, Some("user.shape"), 64, Err(libc::ENODATA)),
        ("the list", &f, None, 64, Ok(b"user.color\0")),
        ("the list's size", &f, None, 0, Ok(b"11")),
        ("a result's value", &result, Some("user.color"), 64, Err(libc::ENODATA)),
        ("a result's list", &result, None, 64, Ok(b"")),
        ("a result's list's size", &result, None, 0, Ok(b"0")),
    ];
    for (what, path, name, len, want) in cases {
        let path = path.to_path_buf();
        let name = name.map(String::from);
        let got = within(30, what, move || xattr_call(&path, name.as_deref(), len));
        assert_eq!(got.as_deref().map_err(|e| *e), want, "{what}");
    }
}

/// The source file system frozen (FIFREEZE, as `fsfreeze` does; by ioctl, so that no child
/// process is started while requests of this process wait) for as long as this lives:
/// writes to it wait, reads go on. Thawed when dropped, also after a failure (else the rig
/// could not unmount, and the waiting requests would hold the test's process).
struct Frozen(File);

/// FIFREEZE and FITHAW: _IOWR('X', 119, int) and _IOWR('X', 120, int).
const FIFREEZE: u64 = 0xC004_5877;
const FITHAW: u64 = 0xC004_5878;

impl Frozen {
    fn new(mnt: &std::path::Path) -> Frozen {
        use std::os::fd::AsRawFd;
        let dir = File::open(mnt).unwrap();
        // SAFETY: an open descriptor of the file system's root; the ioctl takes no argument.
        let r = unsafe { libc::ioctl(dir.as_raw_fd(), FIFREEZE as _, 0) };
        assert_eq!(r, 0, "FIFREEZE {}: {}", mnt.display(), std::io::Error::last_os_error());
        Frozen(dir)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: as in new.
        if unsafe { libc::ioctl(self.0.as_raw_fd(), FITHAW as _, 0) } != 0 {
            // Not a panic (this may run while unwinding): said, with how to thaw by hand.
            eprintln!("FITHAW: {}: the source stays frozen (fsfreeze --unfreeze it)", std::io::Error::last_os_error());
        }
    }
}

/// A direct descriptor of the mount: its reads and writes are the mount's requests, never
/// the page cache's.
fn direct(p: &std::path::Path, write: bool) -> File {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new().read(true).write(write).custom_flags(libc::O_DIRECT).open(p).unwrap()
}

/// One request that waits (a write to the frozen source) holds one of the mount's threads,
/// not the mount: other files read meanwhile. With one thread (`--threads 1`) the same read
/// waits behind the write, so the first half can fail.
#[test]
fn a_request_that_waits_holds_one_thread_not_the_mount() {
    use std::os::unix::fs::FileExt;
    for threads in [nearstore_fuse::Options::new("/", "/", Default::default()).threads, 1] {
        let rig = Rig::with(|o| o.threads = threads);
        std::fs::write(rig.m("w"), text(8192, 1)).unwrap();
        let other = text(1 << 20, 2);
        std::fs::write(rig.m("r"), &other).unwrap();
        let (w, r) = (direct(&rig.m("w"), true), direct(&rig.m("r"), false));
        let frozen = Frozen::new(&rig.fs.mnt);
        let writer = std::thread::spawn(move || w.write_all_at(&text(4096, 3), 0).map(|_| w));
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(!writer.is_finished(), "{threads} threads: a write to the frozen source waits");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 20];
            let _ = tx.send(r.read_at(&mut buf, 0).map(|n| buf[..n].to_vec()).map_err(|e| e.to_string()));
        });
        let read = rx.recv_timeout(std::time::Duration::from_secs(if threads > 1 { 30 } else { 2 }));
        if threads > 1 {
            same(&read.expect("a read of another file while a write waits").unwrap(), &other, "read while a write waits");
        } else {
            assert!(read.is_err(), "one thread: the read waits behind the write (else this test proves nothing)");
        }
        drop(frozen);
        let w = within(60, "the write after the thaw", move || writer.join().unwrap().unwrap());
        drop(w);
        let mut want = text(8192, 1);
        want[..4096].copy_from_slice(&text(4096, 3));
        same(&std::fs::read(rig.s("w")).unwrap(), &want, "the write that waited");
        if threads == 1 {
            same(&rx.recv_timeout(std::time::Duration::from_secs(60)).unwrap().unwrap(), &other, "the read that waited");
        }
    }
}
