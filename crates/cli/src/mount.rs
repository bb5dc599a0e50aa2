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
