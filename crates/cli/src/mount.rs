//! `nearstore mount`: the compute-aware FUSE file system (crates/fuse, docs/fuse.md).

use std::path::PathBuf;

use anyhow::{Context, Result};
use tracing::{info, warn};

#[derive(clap::Args)]
pub struct MountArgs {
    /// The directory to show, on the file systems of exported namespaces or volumes.
    pub source: PathBuf,
    /// Where to mount it (an existing directory).
    pub mountpoint: PathBuf,
    /// Device map (TOML, `[[namespace]]` entries), as the compute verbs take it.
    #[arg(long)]
    pub map: Option<PathBuf>,
    /// A target's configuration: the files it exports map to its first listener.
    #[arg(long)]
    pub target_config: Option<PathBuf>,
    /// FUSE worker threads serving requests.
    #[arg(long, default_value_t = nearstore_fuse::limits::THREADS_DEFAULT)]
    pub threads: usize,
    /// Seconds one operation may take on its target before the read fails (EIO).
    #[arg(long, default_value_t = nearstore_fuse::limits::OP_TIMEOUT_DEFAULT.as_secs())]
    pub op_timeout: u64,
    /// The mount's host NQN toward the targets, whose tenant they apply to every operation
    /// (default: /etc/nvme/hostnqn or one derived from the machine id).
    #[arg(long)]
    pub hostnqn: Option<String>,
    /// The mount's DH-HMAC-CHAP secret for targets that ask the host to authenticate (as
    /// nvme-cli's --dhchap-secret). On the command line every user of the machine reads it
    /// in /proc/PID/cmdline for as long as the mount runs: prefer --dhchap-secret-file.
    #[arg(long, value_parser = crate::dhchap_secret, conflicts_with = "dhchap_secret_file")]
    pub dhchap_secret: Option<nearstore_dhchap::Secret>,
    /// A file holding the mount's DH-HMAC-CHAP secret (its first line), its owner's alone
    /// (mode 600 or 400: refused if group or others may read or write it).
    #[arg(long, value_parser = secret_file)]
    pub dhchap_secret_file: Option<nearstore_dhchap::Secret>,
    /// The controller's DH-HMAC-CHAP secret: the targets must prove they hold it.
    #[arg(long, value_parser = crate::dhchap_secret, conflicts_with = "dhchap_ctrl_secret_file")]
    pub dhchap_ctrl_secret: Option<nearstore_dhchap::Secret>,
    /// A file holding the controller's DH-HMAC-CHAP secret (its first line), its owner's alone.
    #[arg(long, value_parser = secret_file)]
    pub dhchap_ctrl_secret_file: Option<nearstore_dhchap::Secret>,
}

/// A DH-HMAC-CHAP secret from the first line of a file (clap's value parser); the error
/// names the file, never its bytes. A file group or others may read or write is refused,
/// as ssh refuses such a key: the secret is the mount's alone.
fn secret_file(path: &str) -> Result<nearstore_dhchap::Secret, String> {
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;
    let mut f = std::fs::File::open(path).map_err(|e| format!("{path}: {e}"))?;
    // The mode of the file read, not of a name that may change in between.
    let mode = f.metadata().map_err(|e| format!("{path}: {e}"))?.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(format!("{path}: mode {mode:04o} lets group or others reach the secret: chmod 600 {path}"));
    }
    let mut text = String::new();
    f.read_to_string(&mut text).map_err(|e| format!("{path}: {e}"))?;
    crate::dhchap_secret(text.lines().next().unwrap_or("").trim()).map_err(|e| format!("{path}: {e}"))
}

/// Mounts and serves until unmounted (`umount MOUNTPOINT`, or SIGINT/SIGTERM: unmounted
/// when not busy; a second signal detaches it lazily).
pub fn run(a: MountArgs) -> Result<()> {
    let devices = nearstore_fuse::devices(a.map.as_deref(), a.target_config.as_deref())?;
    let mut opts = nearstore_fuse::Options::new(&a.source, &a.mountpoint, devices);
    opts.threads = a.threads;
    opts.op_timeout = std::time::Duration::from_secs(a.op_timeout);
    if a.dhchap_secret.is_some() || a.dhchap_ctrl_secret.is_some() {
        warn!("a DH-HMAC-CHAP secret on the command line: every user reads it in /proc/PID/cmdline; use --dhchap-secret-file");
    }
    let secret = a.dhchap_secret.or(a.dhchap_secret_file);
    let ctrl = a.dhchap_ctrl_secret.or(a.dhchap_ctrl_secret_file);
    anyhow::ensure!(secret.is_some() || ctrl.is_none(), "a controller's DH-HMAC-CHAP secret needs the host's (--dhchap-secret-file)");
    (opts.hostnqn, opts.dhchap_secret, opts.dhchap_ctrl_secret) = (a.hostnqn, secret, ctrl);
    let mounted = nearstore_fuse::spawn(opts).with_context(|| format!("mounting {} at {}", a.source.display(), a.mountpoint.display()))?;
    info!(source = %a.source.display(), mountpoint = %a.mountpoint.display(), "mounted");
    let mp = a.mountpoint.clone();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    std::thread::Builder::new().name("nearstore-mount-signals".into()).spawn(move || {
        rt.block_on(async move {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
                warn!("cannot catch SIGTERM and SIGINT: unmount with umount");
                return;
            };
            let mut lazy = false;
            loop {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
                match nearstore_fuse::unmount(&mp, lazy) {
                    Ok(()) => return,
                    Err(e) => warn!(mountpoint = %mp.display(), "cannot unmount: {e} (files are open or a process works in it); signal again to detach it lazily"),
                }
                lazy = true;
            }
        })
    })?;
    mounted.join().context("serving the mount")?;
    info!(mountpoint = %a.mountpoint.display(), "unmounted");
    Ok(())
}

#[derive(clap::Args)]
pub struct AttachArgs {
    /// A file under a `nearstore mount`.
    pub file: PathBuf,
    /// The operation, as the ioctl and the attribute take it ("sha256", "grep:ERROR",
    /// "select:SELECT ...": docs/fuse.md).
    pub op: String,
    /// Attach through the attribute `user.nearstore.op` (fsetxattr) instead of the ioctl
    /// NEARSTORE_IOC_ATTACH: needs write permission on the file.
    #[arg(long)]
    pub xattr: bool,
}

/// Bytes read from the attached descriptor at a time (O_DIRECT: a page-aligned buffer).
const ATTACH_READ_BYTES: usize = 1 << 20;
/// The largest value of an extended attribute Linux passes (XATTR_SIZE_MAX).
const XATTR_SIZE_MAX: usize = 65536;

/// `nearstore attach FILE OP`: opens FILE with O_DIRECT, attaches OP to that descriptor,
/// copies what its reads return (the result computed in storage) to standard output, and
/// says on standard error where it was computed (`user.nearstore.offloaded`): the shell's
/// way to what docs/fuse.md shows in C and Python.
pub fn attach(a: AttachArgs) -> Result<()> {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;

    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&a.file)
        .with_context(|| format!("opening {} with O_DIRECT", a.file.display()))?;
    let fd = f.as_raw_fd();
    let failed = |what: &str| anyhow::anyhow!("{what} {} on {}: {}", a.op, a.file.display(), std::io::Error::last_os_error());
    if a.xattr {
        let (name, value) = (c"user.nearstore.op", a.op.as_bytes());
        // SAFETY: a valid descriptor, a NUL-terminated name, a buffer of value.len() bytes.
        if unsafe { libc::fsetxattr(fd, name.as_ptr(), value.as_ptr().cast(), value.len(), 0) } != 0 {
            return Err(failed("setting user.nearstore.op to"));
        }
    } else {
        if a.op.len() > nearstore_fuse::ioctl::SPEC_BYTES {
            anyhow::bail!("an operation of {} bytes: the ioctl carries at most {}", a.op.len(), nearstore_fuse::ioctl::SPEC_BYTES);
        }
        let op = nearstore_fuse::ioctl::encode_op(&a.op);
        // SAFETY: ATTACH's size is OP_BYTES, the length of `op`, which the kernel copies in.
        if unsafe { libc::ioctl(fd, nearstore_fuse::ioctl::ATTACH as _, op.as_ptr()) } != 0 {
            return Err(failed("attaching"));
        }
    }
    let layout = std::alloc::Layout::from_size_align(ATTACH_READ_BYTES, 4096).expect("a valid layout");
    // SAFETY: a nonzero size; freed below with the same layout.
    let ptr = unsafe { std::alloc::alloc(layout) };
    anyhow::ensure!(!ptr.is_null(), "allocating {ATTACH_READ_BYTES} bytes");
    let copied = (|| -> Result<()> {
        let mut out = std::io::stdout().lock();
        loop {
            // SAFETY: `ptr` holds ATTACH_READ_BYTES bytes.
            let n = unsafe { libc::read(fd, ptr.cast(), ATTACH_READ_BYTES) };
            if n < 0 {
                return Err(failed("reading the result of"));
            }
            if n == 0 {
                return out.flush().context("writing the result");
            }
            // SAFETY: the read filled `n` bytes.
            out.write_all(unsafe { std::slice::from_raw_parts(ptr, n as usize) }).context("writing the result")?;
        }
    })();
    // SAFETY: allocated above with `layout`.
    unsafe { std::alloc::dealloc(ptr, layout) };
    copied?;
    // Where it was computed: "1", or "0 " and why not on the target, a reason of any length
    // (the kernel bounds an attribute's value by XATTR_SIZE_MAX): its size asked first.
    let name = c"user.nearstore.offloaded";
    // SAFETY: a valid descriptor and name; a size of 0 asks the value's size only.
    let size = unsafe { libc::fgetxattr(fd, name.as_ptr(), std::ptr::null_mut(), 0) };
    if size > 0 {
        let mut value = vec![0u8; (size as usize).min(XATTR_SIZE_MAX)];
        // SAFETY: a valid descriptor and name, a buffer of its length.
        let n = unsafe { libc::fgetxattr(fd, name.as_ptr(), value.as_mut_ptr().cast(), value.len()) };
        if n > 0 {
            let value = String::from_utf8_lossy(&value[..n as usize]);
            let on = match value.strip_prefix("0 ") {
                None if value == "1" => "the target".to_string(),
                Some(why) => format!("this host (not offloaded: {why})"),
                None => format!("this host (not offloaded: {value})"),
            };
            eprintln!("{} of {}: computed on {on}", a.op, a.file.display());
            return Ok(());
        }
    }
    // The result is out; only where it was computed is unknown.
    eprintln!("{} of {}: where it was computed is unknown: {}", a.op, a.file.display(), std::io::Error::last_os_error());
    Ok(())
}
