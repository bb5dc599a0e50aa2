//! The compute-aware FUSE file system (docs/fuse.md; seed 001's NESCAFE): `nearstore mount
//! SOURCE_DIR MOUNTPOINT` shows a directory that lives on exported namespaces or volumes.
//! Plain reads and writes pass through to the source; an operation attached to an open
//! file (`fsetxattr` of `user.nearstore.op`, or the `NEARSTORE_IOC_ATTACH` ioctl) makes
//! reads of that descriptor return the operation's result, computed in storage by the
//! host library exactly as the CLI computes it; `.nearstore/SPEC/path` reads as the result
//! of SPEC over `path`.
//!
//! Built on `fuser` (docs/fuse.md says why): its multi-threaded session (a cloned
//! /dev/fuse descriptor per thread) serves requests; operations compute on threads of
//! their own and reply when done.

pub mod fs;
pub mod ioctl;
pub mod limits;
pub mod op;

use std::path::{Path, PathBuf};
use std::time::Duration;

use nearstore_host::device::{DeviceMap, Endpoint};

/// The directory of result paths at the mount's root.
pub const CONTROL_DIR: &str = ".nearstore";

/// What a mount is made of.
#[derive(Clone, Debug)]
pub struct Options {
    pub source: PathBuf,
    pub mountpoint: PathBuf,
    /// Which namespaces hold the source's file systems (as the CLI's --map and
    /// --target-config give it).
    pub devices: DeviceMap,
    /// FUSE worker threads.
    pub threads: usize,
    /// How long one operation may take on its target.
    pub op_timeout: Duration,
    /// Who the mount is to the targets: its host NQN (else the machine's) and its
    /// DH-HMAC-CHAP secrets, as the compute verbs take them; the targets apply that host's
    /// tenant to every operation of the mount, whichever user caused it.
    pub hostnqn: Option<String>,
    pub dhchap_secret: Option<nearstore_dhchap::Secret>,
    pub dhchap_ctrl_secret: Option<nearstore_dhchap::Secret>,
}

impl Options {
    pub fn new(source: impl Into<PathBuf>, mountpoint: impl Into<PathBuf>, devices: DeviceMap) -> Options {
        Options {
            source: source.into(),
            mountpoint: mountpoint.into(),
            devices,
            threads: limits::THREADS_DEFAULT,
            op_timeout: limits::OP_TIMEOUT_DEFAULT,
            hostnqn: None,
            dhchap_secret: None,
            dhchap_ctrl_secret: None,
        }
    }
}

/// A mounted file system served by background threads; unmounted when dropped (lazily,
/// should it be busy then).
pub struct Mounted {
    session: Option<fuser::BackgroundSession>,
    mountpoint: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("{0}: not a directory")]
    NotADirectory(PathBuf),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("--threads {0}: from 1 to {max}", max = limits::THREADS_MAX)]
    Threads(usize),
    #[error("{0}")]
    Devices(String),
}

/// Mounts `opts.source` at `opts.mountpoint` and serves it on background threads.
/// Needs root (the mount runs as root and lets the kernel check every caller's rights:
/// `allow_other`, `default_permissions`) and /dev/fuse.
pub fn spawn(opts: Options) -> Result<Mounted, MountError> {
    if !(1..=limits::THREADS_MAX).contains(&opts.threads) {
        return Err(MountError::Threads(opts.threads));
    }
    for p in [&opts.source, &opts.mountpoint] {
        let m = std::fs::metadata(p).map_err(|source| MountError::Io { path: p.clone(), source })?;
        if !m.is_dir() {
            return Err(MountError::NotADirectory(p.clone()));
        }
    }
    let source = std::fs::canonicalize(&opts.source).map_err(|source| MountError::Io { path: opts.source.clone(), source })?;
    let io = |source| MountError::Io { path: opts.mountpoint.clone(), source };
    let identity = fs::Identity { hostnqn: opts.hostnqn, dhchap_secret: opts.dhchap_secret, dhchap_ctrl_secret: opts.dhchap_ctrl_secret };
    let fs = fs::NearFs::new(source.clone(), opts.devices, opts.op_timeout, identity).map_err(io)?;
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::FSName(source.display().to_string()),
        // As a kernel option (fuser passes Subtype only to fusermount): the type reads
        // `fuse.nearstore` in /proc/self/mountinfo, which the host library looks for.
        fuser::MountOption::CUSTOM("subtype=nearstore".into()),
        fuser::MountOption::DefaultPermissions,
        fuser::MountOption::NoDev,
        fuser::MountOption::NoSuid,
    ];
    config.acl = fuser::SessionACL::All;
    config.n_threads = Some(opts.threads);
    config.clone_fd = true;
    let session = fuser::spawn_mount(fs, &opts.mountpoint, &config).map_err(io)?;
    Ok(Mounted { session: Some(session), mountpoint: opts.mountpoint })
}

impl Mounted {
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Waits until the file system is unmounted (by `umount`, or [`unmount`]).
    pub fn join(mut self) -> std::io::Result<()> {
        match self.session.take() {
            Some(s) => s.join(),
            None => Ok(()),
        }
    }
}

/// Unmounts `mountpoint`: fails with EBUSY while a file of it is open or a process works
/// in it; `lazy` detaches it at once and ends it when the last user has gone.
pub fn unmount(mountpoint: &Path, lazy: bool) -> std::io::Result<()> {
    let c = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(mountpoint.as_os_str()))
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: a valid C string.
    if unsafe { libc::umount2(c.as_ptr(), if lazy { libc::MNT_DETACH } else { 0 }) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let Some(s) = self.session.take() else { return };
        if unmount(&self.mountpoint, false).is_err() {
            let _ = unmount(&self.mountpoint, true);
        }
        let _ = s.join();
    }
}

/// The namespaces the CLI's `--map` and `--target-config` name: the same [`DeviceMap`]
/// `nearstore checksum` and the other compute verbs build.
pub fn devices(map: Option<&Path>, target_config: Option<&Path>) -> Result<DeviceMap, MountError> {
    let mut devices = DeviceMap::default();
    if let Some(p) = map {
        let text = std::fs::read_to_string(p).map_err(|source| MountError::Io { path: p.into(), source })?;
        devices.load(&text).map_err(|e| MountError::Devices(format!("--map {}: {e}", p.display())))?;
    }
    if let Some(p) = target_config {
        let cfg = nearstore_target::config::Config::from_file(p)
            .map_err(|e| MountError::Devices(format!("--target-config {}: {e}", p.display())))?;
        let Some(l) = cfg.listener.iter().find(|l| !l.discovery) else {
            return Err(MountError::Devices(format!("--target-config {}: no I/O listener", p.display())));
        };
        for s in &cfg.subsystem {
            for n in &s.namespace {
                if let Some(path) = &n.path {
                    let ep = Endpoint { address: l.address, nqn: s.nqn.clone(), nsid: n.nsid };
                    devices.add_file(path, ep).map_err(|e| MountError::Devices(format!("--target-config {}: {e}", p.display())))?;
                }
            }
        }
    }
    Ok(devices)
}
