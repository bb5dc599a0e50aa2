//! The mount's test rig: an ext4 file system on a loop device whose image a target (in
//! this process, on a runtime of its own) exports, mounted through FUSE at a directory
//! every user may reach. Torn down in order when dropped, also after a failure: the
//! mount, the target, the file system.
#![allow(dead_code)] // each test file uses a part

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::mpsc;
use std::time::Duration;

use nearstore_host::device::{DeviceMap, Endpoint};
use nearstore_target::config::Config;
use nearstore_target::Target;
pub use nearstore_testkit::text;
use nearstore_testkit::Fs;

pub const NQN: &str = "nqn.2026-11.io.nearstore:fusetest";

pub struct Rig {
    pub mounted: Option<nearstore_fuse::Mounted>,
    pub mnt: PathBuf,
    pub ep: Endpoint,
    pub devices: DeviceMap,
    pub target: Option<tokio::runtime::Runtime>,
    pub fs: Fs,
    /// Holds the mount point: a directory every user may reach.
    pub dir: tempfile::TempDir,
}

impl Rig {
    /// Needs root, loop devices, mkfs.ext4 and /dev/fuse, and says which is missing.
    pub fn new() -> Rig {
        Rig::with(|_| {})
    }

    pub fn with(adjust: impl FnOnce(&mut nearstore_fuse::Options)) -> Rig {
        Rig::build(None, "", adjust)
    }

    /// A rig whose target's configuration has `extra` too (`[[tenant]]` entries).
    pub fn with_target(extra: &str, adjust: impl FnOnce(&mut nearstore_fuse::Options)) -> Rig {
        Rig::build(None, extra, adjust)
    }

    /// A rig whose namespace has device tag `tag` in the mount's device map.
    pub fn tagged(tag: u16) -> Rig {
        Rig::build(Some(tag), "", |_| {})
    }

    fn build(tag: Option<u16>, extra: &str, adjust: impl FnOnce(&mut nearstore_fuse::Options)) -> Rig {
        assert!(Path::new("/dev/fuse").exists(), "this test needs /dev/fuse (the fuse kernel module)");
        let fs = Fs::new(96);
        std::fs::set_permissions(&fs.mnt, std::fs::Permissions::from_mode(0o777)).unwrap();
        let target = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let ep = target.block_on(start_target(&fs.image, extra));
        let mut devices = DeviceMap::default();
        devices.add_file(&fs.image, ep.clone()).unwrap();
        if let Some(tag) = tag {
            devices.set_tag(&ep, tag).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let mut opts = nearstore_fuse::Options::new(&fs.mnt, &mnt, devices.clone());
        opts.op_timeout = Duration::from_secs(10);
        adjust(&mut opts);
        let mounted = nearstore_fuse::spawn(opts).unwrap();
        Rig { mounted: Some(mounted), mnt, ep, devices, target: Some(target), fs, dir }
    }

    /// A path in the mount.
    pub fn m(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    /// The same path in the source directory.
    pub fn s(&self, rel: &str) -> PathBuf {
        self.fs.mnt.join(rel)
    }

    /// Stops the target: what a host sees when its target is lost.
    pub fn lose_target(&mut self) {
        if let Some(rt) = self.target.take() {
            rt.shutdown_timeout(Duration::from_secs(5));
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        // The mount first (lazily if a failed test left a file open), then the target.
        drop(self.mounted.take());
        self.lose_target();
    }
}

async fn start_target(image: &Path, extra: &str) -> Endpoint {
    let cfg = Config::from_toml(&format!(
        "[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\npath = \"{}\"\n{extra}",
        image.display()
    ))
    .unwrap();
    let t = Target::from_config(&cfg).unwrap();
    let addr = t.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    std::mem::forget(t);
    Endpoint { address: addr, nqn: NQN.into(), nsid: 1 }
}

/// Runs `f` on a thread of its own and fails the test if it takes longer than `secs`: a
/// hung mount fails, never hangs the test.
pub fn within<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(v) => v,
        Err(_) => panic!("{what}: no answer within {secs} s (the mount hangs)"),
    }
}

/// Runs a command as the unprivileged user nobody (65534), with no supplementary groups.
pub fn as_nobody(cmd: &str, args: &[&str]) -> Output {
    Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", cmd])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run setpriv (util-linux, needed by this test): {e}"))
}
