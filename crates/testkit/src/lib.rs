//! Set-up shared by the workspace's tests (a dev-dependency only): running a command that
//! a test needs, an ext4 file system on a loop device, the check that every verb and
//! argument of a binary has help, test text (`text`), and a real etcd cluster (`etcd`).

pub mod etcd;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs `cmd` and returns its trimmed standard output; panics naming the command when it
/// is missing or fails.
pub fn run(cmd: &str, args: &[&str]) -> String {
    try_run(cmd, args).unwrap_or_else(|e| panic!("{e}"))
}

/// As [`run`], but a failing command is an error that names it; only a missing command
/// panics.
fn try_run(cmd: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("cannot run {cmd} (needed by this test): {e}"));
    if !out.status.success() {
        return Err(format!("{cmd} {args:?} failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// How often a loop device or mount step is tried: tests (and other processes) set up
/// loop devices at once, and an older losetup reports a device another one took between
/// its search and its claim as busy instead of trying the next.
const LOOP_ATTEMPTS: u32 = 3;

/// Runs `cmd` up to `attempts` times, 100 ms apart, until it succeeds: its output, or the
/// last failure.
fn run_retried(cmd: &str, args: &[&str], attempts: u32) -> Result<String, String> {
    let mut last = try_run(cmd, args);
    for _ in 1..attempts {
        if last.is_ok() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        last = try_run(cmd, args);
    }
    last
}

/// An ext4 image on a loop device, mounted; unmounted and detached when dropped, even after
/// a failure.
pub struct Fs {
    /// Holds the image and the mount point; other files of a test may go beside them.
    pub dir: tempfile::TempDir,
    pub image: PathBuf,
    pub dev: String,
    pub mnt: PathBuf,
}

impl Fs {
    /// Needs root, loop devices and mkfs.ext4, and says which is missing.
    pub fn new(size_mib: u64) -> Fs {
        assert!(unsafe { libc::geteuid() } == 0, "this test needs root (loop devices, mount)");
        assert!(Path::new("/dev/loop-control").exists(), "this test needs loop devices (/dev/loop-control is missing)");
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("disk.img");
        File::create(&image).unwrap().set_len(size_mib << 20).unwrap();
        run("mkfs.ext4", &["-F", "-q", "-b", "4096", image.to_str().unwrap()]);
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        // One set-up at a time in this process; other processes' are retried.
        static SETUP: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = SETUP.lock().unwrap_or_else(|e| e.into_inner());
        let dev = run_retried("losetup", &["-f", "--show", image.to_str().unwrap()], LOOP_ATTEMPTS).unwrap_or_else(|e| panic!("{e}"));
        let fs = Fs { dir, image, dev, mnt };
        run_retried("mount", &[&fs.dev, fs.mnt.to_str().unwrap()], LOOP_ATTEMPTS).unwrap_or_else(|e| panic!("{e}"));
        fs
    }

    /// Names in the file system's root besides lost+found and `keep`.
    pub fn leftovers(&self, keep: &[&str]) -> Vec<String> {
        std::fs::read_dir(&self.mnt)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n != "lost+found" && !keep.contains(&n.as_str()))
            .collect()
    }
}

impl Drop for Fs {
    /// A file system still busy (a process or a leaked descriptor has a file open) is
    /// detached lazily, so that its mount point's directory is not removed under it.
    fn drop(&mut self) {
        if try_run("umount", &[self.mnt.to_str().unwrap()]).is_err() {
            let _ = try_run("umount", &["-l", self.mnt.to_str().unwrap()]);
        }
        let _ = try_run("losetup", &["-d", &self.dev]);
    }
}

/// A file system mounted by `mount OPTIONS... AT` (a tmpfs, an image with `-o loop`) for as
/// long as this lives; detached lazily when dropped, also after a failure, so that it goes
/// before a file system it lies in.
pub struct Mounted(PathBuf);

impl Mounted {
    pub fn new(options: &[&str], at: &Path) -> Mounted {
        let o = std::process::Command::new("mount").args(options).arg(at).output().expect("running mount");
        assert!(o.status.success(), "mount {options:?} {}: {o:?}", at.display());
        Mounted(at.to_path_buf())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = try_run("umount", &["-l", self.0.to_str().unwrap()]);
    }
}

/// The verbs and arguments of `cmd` (named `name`), at any depth, that have no help text:
/// `"name verb: the verb"` or `"name verb: argument"`. Builds `cmd` first, so arguments
/// flattened into a verb are reached.
pub fn without_help(mut cmd: clap::Command, name: &str) -> Vec<String> {
    fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
        let said = |s: Option<&clap::builder::StyledStr>| s.is_some_and(|h| !h.to_string().trim().is_empty());
        if !said(cmd.get_about()) {
            missing.push(format!("{path}: the verb"));
        }
        for a in cmd.get_arguments() {
            if !said(a.get_help()) && !said(a.get_long_help()) {
                missing.push(format!("{path}: {}", a.get_id()));
            }
        }
        for sub in cmd.get_subcommands() {
            walk(sub, &format!("{path} {}", sub.get_name()), missing);
        }
    }
    cmd.build();
    let mut missing = Vec::new();
    walk(&cmd, name, &mut missing);
    missing
}

/// The records of a LevelDB log (`db/log_format.md`), read from the format's description
/// apart from the code that writes it: 32 KiB blocks of records (crc u32: masked crc32c of
/// the type byte and the data; length u16; type), FULL, or FIRST, MIDDLE.., LAST; a block's
/// tail shorter than a header, and a zero header (a preallocated region), end the block.
/// An error names the block and byte of the first record that fails.
pub fn leveldb_log_records(log: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let unmask = |m: u32| m.wrapping_sub(0xa282_ead8).rotate_left(15);
    let (mut records, mut partial): (Vec<Vec<u8>>, Option<Vec<u8>>) = (Vec::new(), None);
    for (b, block) in log.chunks(32768).enumerate() {
        let mut p = 0;
        while p + 7 <= block.len() {
            let crc = u32::from_le_bytes([block[p], block[p + 1], block[p + 2], block[p + 3]]);
            let len = u16::from_le_bytes([block[p + 4], block[p + 5]]) as usize;
            let kind = block[p + 6];
            if kind == 0 && len == 0 {
                break;
            }
            let data = block.get(p + 7..p + 7 + len).ok_or(format!("block {b} byte {p}: record past its block"))?;
            if unmask(crc) != crc32c::crc32c_append(crc32c::crc32c(&[kind]), data) {
                return Err(format!("block {b} byte {p}: checksum"));
            }
            partial = match (kind, partial.take()) {
                (1, None) => {
                    records.push(data.to_vec());
                    None
                }
                (2, None) => Some(data.to_vec()),
                (3, Some(r)) => Some([r, data.to_vec()].concat()),
                (4, Some(r)) => {
                    records.push([r, data.to_vec()].concat());
                    None
                }
                (k, _) => return Err(format!("block {b} byte {p}: record type {k} out of place")),
            };
            p += 7 + len;
        }
    }
    match partial {
        None => Ok(records),
        Some(_) => Err("the log ends inside a record".into()),
    }
}

#[cfg(test)]
mod tests {
    use clap::{Arg, Command};

    /// A command that fails until its `n`th run is retried until then, or fails with the
    /// last failure when the attempts end first.
    #[test]
    fn a_failing_step_is_retried() {
        // (fails before run n, attempts, succeeds)
        let cases = [(1, 1, true), (3, 3, true), (3, 2, false), (4, 3, false)];
        for (n, attempts, ok) in cases {
            let dir = tempfile::tempdir().unwrap();
            let runs = dir.path().join("runs");
            let script = format!("echo >> {0}; test $(wc -l < {0}) -ge {n}", runs.display());
            let r = super::run_retried("sh", &["-c", &script], attempts);
            let ran = std::fs::read_to_string(&runs).unwrap().lines().count() as u32;
            assert_eq!(r.is_ok(), ok, "succeeding on run {n}, {attempts} attempts: {r:?}");
            assert_eq!(ran, n.min(attempts), "succeeding on run {n}, {attempts} attempts");
            if let Err(e) = r {
                assert!(e.starts_with("sh [") && e.contains("failed"), "{e}");
            }
        }
    }

    /// A file system still in use when dropped is detached lazily. Before, `umount` failed
    /// (busy), the mount stayed, and the temporary directory was removed under it.
    #[test]
    fn a_busy_file_system_is_detached_when_dropped() {
        let fs = super::Fs::new(16);
        let mnt = fs.mnt.to_str().unwrap().to_string();
        let held = std::fs::File::create(fs.mnt.join("held")).unwrap();
        drop(fs);
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(!mounts.split_whitespace().any(|f| f == mnt), "{mnt} is still mounted");
        drop(held);
    }

    #[test]
    fn verbs_and_arguments_without_help_are_named() {
        let cmd = Command::new("x")
            .about("the tool")
            .arg(Arg::new("said").long("said").help("has help"))
            .arg(Arg::new("bare").long("bare"))
            .subcommand(Command::new("sub").arg(Arg::new("deep").long("deep").long_help("long help only")))
            .subcommand(Command::new("ok").about("fine").subcommand(Command::new("inner").about("fine").arg(Arg::new("x").long("x"))));
        let mut got = super::without_help(cmd, "x");
        got.sort();
        // clap's own `help` verb repeats each verb's about.
        assert_eq!(got, ["x help sub: the verb", "x ok inner: x", "x sub: the verb", "x: bare"]);
    }
}

/// `len` bytes of text from `seed` (xorshift over a few words), with lines that match
/// `ERROR` and `needle`: the same bytes for the same seed, different ones for another.
pub fn text(len: usize, seed: u64) -> Vec<u8> {
    let words: [&[u8]; 5] = [b"lorem ", b"ipsum\n", b"needle ", b"ERROR disk\n", b"\tdolor "];
    let mut s = seed | 1;
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        out.extend_from_slice(words[(s % 5) as usize]);
    }
    out.truncate(len);
    out
}
