//! Set-up shared by the workspace's tests (a dev-dependency only): running a command that
//! a test needs, an ext4 file system on a loop device, the check that every verb and
//! argument of a binary has help, and a real etcd cluster (`etcd`).

pub mod etcd;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs `cmd` and returns its trimmed standard output; panics naming the command when it
/// is missing or fails.
pub fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("cannot run {cmd} (needed by this test): {e}"));
    assert!(out.status.success(), "{cmd} {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
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
        let dev = run("losetup", &["-f", "--show", image.to_str().unwrap()]);
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let fs = Fs { dir, image, dev, mnt };
        run("mount", &[&fs.dev, fs.mnt.to_str().unwrap()]);
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
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mnt).status();
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
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

#[cfg(test)]
mod tests {
    use clap::{Arg, Command};

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
