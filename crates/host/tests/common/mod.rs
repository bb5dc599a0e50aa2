//! Shared set-up of the host tests: commands, and an ext4 file system on a loop device.
#![allow(dead_code)]

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;

pub fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("cannot run {cmd} (needed by this test): {e}"));
    assert!(out.status.success(), "{cmd} {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// An ext4 image on a loop device, mounted; torn down on drop, even after a failure.
pub struct Fs {
    _dir: tempfile::TempDir,
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
        let fs = Fs { _dir: dir, image, dev, mnt };
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
