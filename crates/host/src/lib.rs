//! The host library: runs an operation over files, on the targets that hold them.
//!
//! [`object::map_file`] turns a file into a virtual object (stat + FIEMAP), using a
//! [`device::DeviceMap`] to find the namespace under its block device; [`Host`] builds
//! descriptors, sends them to the targets over NVMe/TCP (several commands in flight), and
//! checks afterwards that no file changed during the call. Files that cannot offload
//! (not on a namespace, inline or encoded extents, too fragmented) are computed on the
//! host with the same kernel, so the result is the same either way.
//!
//! Three modes: [`Mode::Offload`] (the default, with that fallback), [`Mode::Local`]
//! (read through the file system, compute here) and [`Mode::Pull`] (read the object's
//! blocks over NVMe/TCP with the initiator and compute here: what a host without offload
//! does, the baseline of the benchmarks).

pub mod device;
pub mod dsort;
pub mod fiemap;
pub mod fused;
pub mod mount;
pub mod object;
pub mod orchestrator;
pub mod passthrough;

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nearstore_compute::{Build, ComputeError, Context, Operation, Outcome, Sink, Source};
use nearstore_initiator::{ConnectOptions, Controller, IoQueue};
use nearstore_wire::compute::{limits, Descriptor, Object};

use crate::device::{DeviceMap, Endpoint};
use crate::object::{FileObject, MapError, Mapped};
use crate::passthrough::KernelNamespace;
use std::sync::Arc;

/// Bytes read at a time on the host, as the target's default chunk.
pub const CHUNK: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// On the target where possible, else on the host.
    Offload,
    /// On the host, reading through the file system.
    Local,
    /// On the host, reading the blocks over NVMe/TCP.
    Pull,
}

/// How one file was computed.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "how", content = "reason", rename_all = "snake_case")]
pub enum How {
    Offloaded,
    Pulled,
    /// On the host, and why.
    Local(String),
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct FileResult {
    pub path: PathBuf,
    pub outcome: Outcome,
    pub how: How,
}

/// The results and what they cost.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Report {
    pub files: Vec<FileResult>,
    /// Bytes of the objects the operation went through.
    pub bytes_processed: u64,
    /// TCP payload bytes sent and received by this host's NVMe/TCP connections during the
    /// call (the kernel's counters).
    pub wire_sent: u64,
    pub wire_received: u64,
    pub elapsed_secs: f64,
    /// Block devices whose compute commands went through the kernel's own NVMe/TCP
    /// connection (passthrough); those bytes are not in `wire_sent`/`wire_received`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub via_kernel: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error(transparent)]
    Map(#[from] MapError),
    #[error("{0}")]
    Compute(#[from] ComputeError),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("target {endpoint}: {source}")]
    Target { endpoint: String, source: nearstore_initiator::Error },
    #[error("{0}")]
    Invalid(String),
    /// Writing out what was read of `path` (`Host::read_checksum_into`'s writer) failed:
    /// the writer's own error, its kind kept (a full disk, a closed pipe).
    #[error("writing out what was read of {path}: {source}")]
    Output { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Step(#[from] orchestrator::StepError),
    /// With `Host::offload_only`: files that would have been computed on the host.
    #[error("not offloaded (--offload-only): {}", .0.iter().map(Cause::to_string).collect::<Vec<_>>().join("; "))]
    NotOffloaded(Vec<Cause>),
    /// A fused write operation sent to its target that did not complete as asked (refused,
    /// failed, or its completion lost): `txid` names its transaction for
    /// [`Host::outcome`](crate::Host::outcome).
    #[error("transaction {txid:#018x}: {source}")]
    Fused { txid: u64, source: Box<HostError> },
}

impl HostError {
    /// True when a target refused this host: not admitted at Connect, not authenticated,
    /// or a command beyond its tenant's reach (ACCESS_DENIED).
    pub fn is_refused(&self) -> bool {
        use nearstore_initiator::Error as E;
        if let HostError::Fused { source, .. } = self {
            return source.is_refused();
        }
        let denied = |s: &nearstore_wire::Status| {
            let s = nearstore_wire::Status { dnr: false, ..*s };
            s == nearstore_wire::Status::ACCESS_DENIED || s == nearstore_wire::Status::CONNECT_INVALID_HOST
        };
        match self {
            HostError::Target { source: E::Status { status, .. } | E::Compute { status, .. }, .. } => denied(status),
            HostError::Target { source: E::AuthRequired { .. } | E::AuthRefused { .. }, .. } => true,
            _ => false,
        }
    }

    /// The transaction id of a fused write operation this error ended after it was sent:
    /// the id to ask OUTCOME about.
    pub fn txid(&self) -> Option<u64> {
        match self {
            HostError::Fused { txid, .. } => Some(*txid),
            _ => None,
        }
    }

    /// True when the result was too big to return inline (a select's rows; [`ComputeError::ResultTooLarge`]
    /// on this host, LIMIT_EXCEEDED saying so from a target): it belongs in an output file.
    pub fn is_result_too_large(&self) -> bool {
        match self {
            HostError::Compute(ComputeError::ResultTooLarge { .. }) => true,
            HostError::Target { source: nearstore_initiator::Error::Compute { status, message }, .. } => {
                let limit = nearstore_wire::compute::status::LIMIT_EXCEEDED;
                nearstore_wire::Status { dnr: true, ..*status } == limit
                    && (message.contains(" inline") || message.starts_with("result of"))
            }
            _ => false,
        }
    }
}

/// Why some files were computed on the host, not offloaded: one reason and the files
/// that share it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cause {
    pub reason: String,
    pub files: Vec<PathBuf>,
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.files[..] {
            [one] => write!(f, "{}: {}", one.display(), self.reason),
            [first, ..] => write!(f, "{} files ({} and others): {}", self.files.len(), first.display(), self.reason),
            [] => write!(f, "{}", self.reason),
        }
    }
}

/// The files computed on the host grouped by reason, in the order the reasons first appear.
pub fn causes<'a>(local: impl IntoIterator<Item = (&'a Path, &'a str)>) -> Vec<Cause> {
    let mut out: Vec<Cause> = Vec::new();
    for (path, reason) in local {
        match out.iter_mut().find(|c| c.reason == reason) {
            Some(c) => c.files.push(path.into()),
            None => out.push(Cause { reason: reason.into(), files: vec![path.into()] }),
        }
    }
    out
}

fn ep_name(e: &Endpoint) -> String {
    format!("{} {} nsid {}", e.address, e.nqn, e.nsid)
}

struct Conn {
    _ctrl: Controller,
    queues: Vec<IoQueue>,
    block: u64,
}

/// Who a host is to the targets, on every connection the host library makes for it (a
/// file's commands, the orchestrator's steps): the tenant and the authority the targets
/// apply are the requesting host's, never the machine's by accident.
#[derive(Clone, Debug, Default)]
pub struct Identity {
    /// The host NQN (`--hostnqn`, its Host ID derived from it), else the machine's
    /// (`nearstore_initiator::host`).
    pub hostnqn: Option<String>,
    /// The DH-HMAC-CHAP secrets (`--dhchap-secret`, `--dhchap-ctrl-secret`): used where a
    /// target asks the host to authenticate.
    pub dhchap_secret: Option<nearstore_dhchap::Secret>,
    pub dhchap_ctrl_secret: Option<nearstore_dhchap::Secret>,
}

impl Identity {
    /// The options of a connection to `ep` as this host; Err says why the host NQN is not one.
    pub fn connect_options(&self, ep: &Endpoint) -> Result<ConnectOptions, String> {
        let mut o = ConnectOptions::new(ep.address, &ep.nqn);
        o.dhchap_secret = self.dhchap_secret.clone();
        o.dhchap_ctrl_secret = self.dhchap_ctrl_secret.clone();
        if let Some(nqn) = &self.hostnqn {
            let ids = nearstore_initiator::host::resolve(Some(nqn), None).map_err(|e| format!("host NQN {nqn}: {e}"))?;
            (o.hostnqn, o.hostid) = (ids.hostnqn, ids.hostid);
        }
        Ok(o)
    }
}

/// Runs operations over files. Connections to targets are made on first use and kept.
pub struct Host {
    pub devices: DeviceMap,
    /// Compute commands in flight per namespace (one connection each).
    pub parallel: usize,
    /// How long one compute command may take.
    pub timeout: Duration,
    /// Report progress: bytes done, bytes in all.
    pub progress: Option<Box<dyn Fn(u64, u64) + Send + Sync>>,
    /// Offload through the kernel's own connection (NVMe passthrough on the namespace's
    /// block device) where the kernel attached the namespace; else, and when false, over
    /// our own NVMe/TCP connection to the same target.
    pub passthrough: bool,
    /// Refuse (`HostError::NotOffloaded`, before computing anything) rather than compute
    /// on the host what cannot be offloaded; `Mode::Local` is unaffected.
    pub offload_only: bool,
    /// Who this host is on every connection it makes.
    pub identity: Identity,
    /// Compute what cannot be offloaded on the calling thread (after the offloaded work
    /// is sent) rather than on a blocking thread of the runtime: a caller acting with
    /// per-thread file-system credentials (the FUSE mount, as its user) keeps them for
    /// every file it opens.
    pub local_on_caller: bool,
    conns: HashMap<Endpoint, Conn>,
    kernel: HashMap<Endpoint, Arc<KernelNamespace>>,
}

impl Host {
    pub fn new(devices: DeviceMap) -> Host {
        Host {
            devices,
            parallel: 4,
            timeout: Duration::from_secs(3600),
            progress: None,
            passthrough: true,
            offload_only: false,
            identity: Identity::default(),
            local_on_caller: false,
            conns: HashMap::new(),
            kernel: HashMap::new(),
        }
    }

    /// Opens a kernel-attached namespace for passthrough: its block size from sysfs.
    fn open_kernel(&mut self, ep: &Endpoint, disk: &str) -> Result<u64, HostError> {
        let block: u64 = std::fs::read_to_string(format!("/sys/block/{disk}/queue/logical_block_size"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| HostError::Invalid(format!("{disk}: no logical_block_size in sysfs")))?;
        if !self.kernel.contains_key(ep) {
            let path = PathBuf::from(format!("/dev/{disk}"));
            let k = KernelNamespace::open(&path, ep.nsid).map_err(|source| HostError::Io { path, source })?;
            self.kernel.insert(ep.clone(), Arc::new(k));
        }
        Ok(block)
    }

    /// The kernel devices the offloaded files' commands went through.
    fn via_kernel(&self, mapped: &[Mapped], mode: Mode) -> Vec<String> {
        let mut v: Vec<String> = mapped
            .iter()
            .filter_map(|m| match m {
                Mapped::Offload(fo) if mode == Mode::Offload => {
                    self.kernel.get(&fo.location.endpoint).map(|k| k.path.display().to_string())
                }
                _ => None,
            })
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// Runs one descriptor on the namespace: through the kernel where it attached it and
    /// passthrough is on, else on our first queue to the target.
    async fn exec(&mut self, ep: &Endpoint, d: &Descriptor) -> Result<Vec<u8>, HostError> {
        let err = |source| HostError::Target { endpoint: ep_name(ep), source };
        if let Some(k) = self.kernel.get(ep).cloned() {
            let (bytes, timeout) = (d.encode(), self.timeout);
            return tokio::task::spawn_blocking(move || k.compute(&bytes, timeout)).await.expect("passthrough task").map_err(err);
        }
        let conn = self.conns.get_mut(ep).expect("connected in plan");
        let r = conn.queues[0].compute(ep.nsid, &d.encode(), self.timeout).await;
        if let Err(e) = &r {
            // The connection failed under the command: the next call connects again.
            self.forget_if_lost(ep, e);
        }
        r.map_err(err)
    }

    /// Forgets the connection to `ep` when `e` says it is gone or unusable (closed, reset,
    /// terminated, a protocol error, a command that timed out and may still be in flight):
    /// the next call connects again. Before, a lost connection failed every later call to
    /// that target with `Closed`.
    pub(crate) fn forget_if_lost(&mut self, ep: &Endpoint, e: &nearstore_initiator::Error) {
        use nearstore_initiator::Error as E;
        if matches!(e, E::Io { .. } | E::Protocol(_) | E::Terminated { .. } | E::Closed | E::Timeout(_)) {
            self.conns.remove(ep);
        }
    }

    async fn connect(&mut self, ep: &Endpoint) -> Result<(), HostError> {
        if self.conns.contains_key(ep) {
            return Ok(());
        }
        let err = |source| HostError::Target { endpoint: ep_name(ep), source };
        let mut o = self.identity.connect_options(ep).map_err(HostError::Invalid)?;
        // Each step of connecting waits no longer than a command may take.
        o.timeout = o.timeout.min(self.timeout);
        let ctrl = Controller::connect(o).await.map_err(err)?;
        let block = ctrl.identify_namespace(ep.nsid).await.map_err(err)?.block_size() as u64;
        let mut queues = Vec::new();
        for qid in 1..=self.parallel.clamp(1, ctrl.io_queues_granted() as usize) as u16 {
            queues.push(ctrl.io_queue(qid).await.map_err(err)?);
        }
        self.conns.insert(ep.clone(), Conn { _ctrl: ctrl, queues, block });
        Ok(())
    }

    fn wire_total(&self) -> (u64, u64) {
        self.conns.values().flat_map(|c| &c.queues).map(|q| q.wire_bytes()).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    }

    /// Maps the files and connects to their targets. Files that cannot offload come back
    /// as Local with the reason.
    async fn plan(&mut self, files: &[PathBuf], mode: Mode) -> Result<Vec<Mapped>, HostError> {
        let mut out = Vec::new();
        for f in files {
            let m = if mode == Mode::Local {
                Mapped::Local { path: f.clone(), reason: "--local".into() }
            } else {
                object::map_file(f, &self.devices)?
            };
            let m = match m {
                Mapped::Offload(fo) => {
                    let ep = fo.location.endpoint.clone();
                    let block = match &fo.location.kernel_device {
                        Some(disk) if self.passthrough && mode == Mode::Offload => self.open_kernel(&ep, disk)?,
                        _ => {
                            self.connect(&ep).await?;
                            self.conns[&ep].block
                        }
                    };
                    if fo.aligned_to(block) {
                        Mapped::Offload(fo)
                    } else {
                        Mapped::Local { path: fo.path, reason: format!("extents not aligned to the namespace's {block}-byte blocks") }
                    }
                }
                m => m,
            };
            out.push(m);
        }
        if self.offload_only && mode != Mode::Local {
            let local = causes(out.iter().filter_map(|m| match m {
                Mapped::Local { path, reason } => Some((path.as_path(), reason.as_str())),
                Mapped::Offload(_) => None,
            }));
            if !local.is_empty() {
                return Err(HostError::NotOffloaded(local));
            }
        }
        Ok(out)
    }

    /// Runs a streaming operation (checksum, search, count, wc) over each file.
    pub async fn run(&mut self, op: &'static Operation, args: &[u8], files: &[PathBuf], mode: Mode) -> Result<Report, HostError> {
        let (build, per_batch) = match op.build {
            Build::Stream(b) => (b, 16),
            // Queries return rows inline, up to 128 KiB each: one input per command keeps
            // the result within what a target returns for one command.
            Build::Either { stream, .. } => (stream, 1),
            Build::Transform { .. } => return Err(HostError::Invalid(format!("{} writes an output object: use Host::transform", op.name))),
        };
        op.check(args, 1, 0)?;
        let start = Instant::now();
        let mapped = self.plan(files, mode).await?;
        let w0 = self.wire_total();
        let total: u64 = mapped.iter().map(size_of).sum();
        let mut results: Vec<Option<FileResult>> = vec![None; mapped.len()];
        // Remote work, per namespace: batches of files spread over its queues.
        let mut by_ep: HashMap<Endpoint, Vec<(usize, FileObject)>> = HashMap::new();
        let mut local = Vec::new();
        for (i, m) in mapped.iter().enumerate() {
            match m {
                Mapped::Offload(fo) => by_ep.entry(fo.location.endpoint.clone()).or_default().push((i, fo.clone())),
                Mapped::Local { path, reason } => local.push((i, path.clone(), reason.clone())),
            }
        }
        let done = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let progress = std::sync::Arc::new(self.progress.take());
        let mut tasks = Vec::new();
        let mut kernel_tasks = Vec::new();
        for (ep, files) in by_ep {
            if let (Mode::Offload, Some(k)) = (mode, self.kernel.get(&ep)) {
                // Through the kernel: `parallel` commands in flight, each on a blocking thread.
                for work in spread(batches(files, per_batch), self.parallel).into_iter().filter(|w| !w.is_empty()) {
                    let (k, ep, args, timeout) = (k.clone(), ep.clone(), args.to_vec(), self.timeout);
                    let (done, progress) = (done.clone(), progress.clone());
                    kernel_tasks.push(tokio::task::spawn_blocking(move || {
                        kernel_batches(&k, &ep, op, &args, work, timeout, &done, total, &progress)
                    }));
                }
                continue;
            }
            let conn = self.conns.get_mut(&ep).expect("connected in plan");
            let per_queue = spread(batches(files, per_batch), conn.queues.len());
            for (q, work) in std::mem::take(&mut conn.queues).into_iter().zip(per_queue) {
                let (ep, args, timeout, block) = (ep.clone(), args.to_vec(), self.timeout, conn.block);
                let (done, progress) = (done.clone(), progress.clone());
                tasks.push(tokio::spawn(async move {
                    let mut q = q;
                    let r = remote_batches(&mut q, &ep, op, build, &args, work, mode, block, timeout, &done, total, &progress).await;
                    (ep, q, r)
                }));
            }
        }
        // Local work meanwhile, on a blocking thread or this one.
        let local_work = {
            let args = args.to_vec();
            let (done, progress) = (done.clone(), progress.clone());
            move || -> Result<Vec<(usize, FileResult)>, HostError> {
                let mut out = Vec::new();
                for (i, path, reason) in local {
                    let outcome = compute_file(op, &args, &path)?;
                    let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
                    advance(&done, len, total, &progress);
                    out.push((i, FileResult { path, outcome, how: How::Local(reason) }));
                }
                Ok(out)
            }
        };
        let (local_task, local_here) =
            if self.local_on_caller { (None, Some(local_work())) } else { (Some(tokio::task::spawn_blocking(local_work)), None) };
        let mut first_err = None;
        for t in tasks {
            let (ep, mut q, r) = t.await.expect("compute task");
            // A queue left with commands in flight (its connection failed mid-stream) is
            // closed, not reused: their late completions would reach the next call.
            if q.queue().in_flight() == 0 {
                self.conns.get_mut(&ep).expect("connected").queues.push(q);
            }
            match r {
                Ok(v) => v.into_iter().for_each(|(i, fr)| results[i] = Some(fr)),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        for t in kernel_tasks {
            match t.await.expect("passthrough task") {
                Ok(v) => v.into_iter().for_each(|(i, fr)| results[i] = Some(fr)),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        let local_done = match (local_task, local_here) {
            (Some(t), _) => t.await.expect("local task"),
            (None, here) => here.expect("computed here"),
        };
        for (i, fr) in local_done? {
            results[i] = Some(fr);
        }
        self.progress = std::sync::Arc::try_unwrap(progress).ok().flatten();
        // A target with no usable queue left is connected again by the next call.
        self.conns.retain(|_, c| !c.queues.is_empty());
        if let Some(e) = first_err {
            return Err(e);
        }
        // Nothing is reported for a file that changed under the call.
        for m in &mapped {
            if let Mapped::Offload(fo) = m {
                fo.verify()?;
            }
        }
        let w1 = self.wire_total();
        Ok(Report {
            files: results.into_iter().map(|r| r.expect("every file has a result")).collect(),
            bytes_processed: total,
            wire_sent: w1.0 - w0.0,
            wire_received: w1.1 - w0.1,
            elapsed_secs: start.elapsed().as_secs_f64(),
            via_kernel: self.via_kernel(&mapped, mode),
        })
    }

    /// Runs an operation that writes an output file (copy, compress, sort, merge) over
    /// the inputs. `capacity`: the most bytes the output can take; the file is cut to
    /// what the operation wrote. The operation writes a new file beside the output, which
    /// replaces the output only when the call succeeds: a failed call leaves no file it
    /// made, and an output that was there before keeps its bytes.
    pub async fn transform(
        &mut self,
        op: &'static Operation,
        args: &[u8],
        inputs: &[PathBuf],
        output: &Path,
        capacity: u64,
        mode: Mode,
    ) -> Result<Report, HostError> {
        op.check(args, inputs.len(), 1)?;
        refuse_overwriting_inputs(output, inputs)?;
        let start = Instant::now();
        let pending = PendingOutput::new(output)?;
        let report = self.transform_into(op, args, inputs, &pending.path, capacity, mode).await?;
        pending.commit()?;
        Ok(Report {
            files: report.files.into_iter().map(|f| FileResult { path: output.into(), ..f }).collect(),
            elapsed_secs: start.elapsed().as_secs_f64(),
            ..report
        })
    }

    /// [`Host::transform`] into `output`, a file that is not yet in the output's place.
    async fn transform_into(
        &mut self,
        op: &'static Operation,
        args: &[u8],
        inputs: &[PathBuf],
        output: &Path,
        capacity: u64,
        mode: Mode,
    ) -> Result<Report, HostError> {
        let start = Instant::now();
        let mapped = self.plan(inputs, if mode == Mode::Local { Mode::Local } else { Mode::Offload }).await?;
        let total: u64 = mapped.iter().map(size_of).sum();
        let w0 = self.wire_total();
        let objs: Vec<&FileObject> = mapped.iter().filter_map(|m| if let Mapped::Offload(f) = m { Some(f) } else { None }).collect();
        let ep = objs.first().map(|f| f.location.endpoint.clone());
        let remote = mode != Mode::Local && objs.len() == mapped.len() && objs.iter().all(|f| Some(&f.location.endpoint) == ep.as_ref());
        let out_file = if remote { Some(prepare_output(output, capacity, &self.devices)?) } else { None };
        let how;
        let outcome = match (out_file, ep) {
            (Some(Mapped::Offload(out)), Some(ep)) if out.location.endpoint == ep => {
                let d = Descriptor {
                    op: op.id,
                    args: args.to_vec(),
                    inputs: objs.iter().map(|f| f.object.clone()).collect(),
                    outputs: vec![out.object.clone()],
                };
                let json = self.exec(&ep, &d).await?;
                let mut outs: Vec<Outcome> =
                    serde_json::from_slice(&json).map_err(|e| HostError::Invalid(format!("target's result: {e}")))?;
                for f in &objs {
                    f.verify()?;
                }
                how = How::Offloaded;
                outs.remove(0)
            }
            (out, _) => {
                let reason = match (&out, mode) {
                    (_, Mode::Local) => "--local".to_string(),
                    (Some(Mapped::Local { reason, .. }), _) => format!("output: {reason}"),
                    (Some(Mapped::Offload(_)), _) => "the output is on another namespace than the inputs".into(),
                    (None, _) => mapped
                        .iter()
                        .find_map(|m| if let Mapped::Local { reason, .. } = m { Some(reason.clone()) } else { None })
                        .unwrap_or_else(|| "the inputs are on different namespaces".into()),
                };
                if self.offload_only && mode != Mode::Local {
                    return Err(HostError::NotOffloaded(vec![Cause { reason, files: vec![output.into()] }]));
                }
                how = How::Local(reason);
                transform_local(op, args, inputs, output, capacity)?
            }
        };
        // Cut the output to what was written, and make the host's view of it fresh.
        if let Some(written) = outcome.output_bytes() {
            finish_output(output, written)?;
        }
        let w1 = self.wire_total();
        let via_kernel = if how == How::Offloaded { self.via_kernel(&mapped, Mode::Offload) } else { Vec::new() };
        Ok(Report {
            files: vec![FileResult { path: output.into(), outcome, how }],
            bytes_processed: total,
            wire_sent: w1.0 - w0.0,
            wire_received: w1.1 - w0.1,
            elapsed_secs: start.elapsed().as_secs_f64(),
            via_kernel,
        })
    }
}

fn size_of(m: &Mapped) -> u64 {
    match m {
        Mapped::Offload(f) => f.object.len,
        Mapped::Local { path, .. } => std::fs::metadata(path).map(|m| m.len()).unwrap_or(0),
    }
}

/// Groups files into descriptors: at most `per_batch` inputs each (16 for checksums, so
/// that several commands share the target's workers) and within the descriptor size limit.
fn batches(files: Vec<(usize, FileObject)>, per_batch: usize) -> Vec<Vec<(usize, FileObject)>> {
    let mut out: Vec<Vec<(usize, FileObject)>> = Vec::new();
    let mut size = 0;
    for f in files {
        let n = 16 + f.1.object.extents.len() * 16;
        match out.last_mut() {
            Some(b) if b.len() < per_batch && size + n + 64 < limits::DESCRIPTOR_BYTES_MAX - 1024 => {
                size += n;
                b.push(f);
            }
            _ => {
                size = n;
                out.push(vec![f]);
            }
        }
    }
    out
}

/// Batches dealt round-robin to `n` workers (queues or threads).
fn spread<T>(batches: Vec<T>, n: usize) -> Vec<Vec<T>> {
    let n = n.max(1);
    let mut out: Vec<Vec<T>> = (0..n).map(|_| Vec::new()).collect();
    for (i, b) in batches.into_iter().enumerate() {
        out[i % n].push(b);
    }
    out
}

#[allow(clippy::too_many_arguments)]
async fn remote_batches(
    q: &mut IoQueue,
    ep: &Endpoint,
    op: &'static Operation,
    build: nearstore_compute::BuildKernel,
    args: &[u8],
    work: Vec<Vec<(usize, FileObject)>>,
    mode: Mode,
    block: u64,
    timeout: Duration,
    done: &std::sync::atomic::AtomicU64,
    total: u64,
    progress: &Option<Box<dyn Fn(u64, u64) + Send + Sync>>,
) -> Result<Vec<(usize, FileResult)>, HostError> {
    let err = |source| HostError::Target { endpoint: ep_name(ep), source };
    let mut out = Vec::new();
    for batch in work {
        let bytes: u64 = batch.iter().map(|(_, f)| f.object.len).sum();
        if mode == Mode::Pull {
            for (i, f) in batch {
                let mut k = build(args, &Context::default())?;
                pull_object(q, ep.nsid, block, &f.object, &mut |c| k.update(c)).await.map_err(err)?;
                out.push((i, FileResult { path: f.path, outcome: k.finish()?, how: How::Pulled }));
            }
        } else {
            let json = q.compute(ep.nsid, &batch_descriptor(op, args, &batch).encode(), timeout).await.map_err(err)?;
            out.extend(batch_results(&json, batch)?);
        }
        advance(done, bytes, total, progress);
    }
    Ok(out)
}

/// One descriptor for a batch of files, no outputs.
fn batch_descriptor(op: &Operation, args: &[u8], batch: &[(usize, FileObject)]) -> Descriptor {
    Descriptor { op: op.id, args: args.to_vec(), inputs: batch.iter().map(|(_, f)| f.object.clone()).collect(), outputs: vec![] }
}

/// A batch's result: one outcome per file, in order.
fn batch_results(json: &[u8], batch: Vec<(usize, FileObject)>) -> Result<Vec<(usize, FileResult)>, HostError> {
    let outs: Vec<Outcome> = serde_json::from_slice(json).map_err(|e| HostError::Invalid(format!("target's result: {e}")))?;
    if outs.len() != batch.len() {
        return Err(HostError::Invalid(format!("target returned {} outcomes for {} inputs", outs.len(), batch.len())));
    }
    Ok(batch.into_iter().zip(outs).map(|((i, f), o)| (i, FileResult { path: f.path, outcome: o, how: How::Offloaded })).collect())
}

/// Counts `bytes` done and reports progress.
fn advance(done: &std::sync::atomic::AtomicU64, bytes: u64, total: u64, progress: &Option<Box<dyn Fn(u64, u64) + Send + Sync>>) {
    let d = done.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed) + bytes;
    if let Some(p) = progress {
        p(d, total);
    }
}

/// Batches through the kernel's connection, on a blocking thread.
#[allow(clippy::too_many_arguments)]
fn kernel_batches(
    k: &KernelNamespace,
    ep: &Endpoint,
    op: &'static Operation,
    args: &[u8],
    work: Vec<Vec<(usize, FileObject)>>,
    timeout: Duration,
    done: &std::sync::atomic::AtomicU64,
    total: u64,
    progress: &Option<Box<dyn Fn(u64, u64) + Send + Sync>>,
) -> Result<Vec<(usize, FileResult)>, HostError> {
    let mut out = Vec::new();
    for batch in work {
        let bytes: u64 = batch.iter().map(|(_, f)| f.object.len).sum();
        let json = k
            .compute(&batch_descriptor(op, args, &batch).encode(), timeout)
            .map_err(|source| HostError::Target { endpoint: format!("{} via {}", ep_name(ep), k.path.display()), source })?;
        out.extend(batch_results(&json, batch)?);
        advance(done, bytes, total, progress);
    }
    Ok(out)
}

/// Reads an object's bytes over NVMe/TCP in order, 128 KiB commands with up to 32 in
/// flight, and hands them to `f`; zero extents are not read.
pub async fn pull_object(
    q: &mut IoQueue,
    nsid: u32,
    block: u64,
    obj: &Object,
    f: &mut (dyn FnMut(&[u8]) + Send),
) -> nearstore_initiator::Result<()> {
    let mut r = nearstore_initiator::PieceReader::new(q.queue(), nsid, block, obj.pieces());
    while let Some(c) = r.next().await? {
        f(c);
    }
    Ok(())
}

/// Reads a file through the file system in chunks.
pub struct FileSource {
    file: File,
    len: u64,
    buf: Vec<u8>,
}

impl FileSource {
    pub fn open(path: &Path) -> Result<FileSource, HostError> {
        let file = File::open(path).map_err(|source| HostError::Io { path: path.into(), source })?;
        let len = file.metadata().map_err(|source| HostError::Io { path: path.into(), source })?.len();
        Ok(FileSource { file, len, buf: vec![0; CHUNK] })
    }
}

impl Source for FileSource {
    fn next_chunk(&mut self) -> Result<Option<&[u8]>, ComputeError> {
        let mut n = 0;
        while n < self.buf.len() {
            match self.file.read(&mut self.buf[n..]) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(ComputeError::Io(e.to_string())),
            }
        }
        Ok(if n == 0 { None } else { Some(&self.buf[..n]) })
    }
    fn len(&self) -> u64 {
        self.len
    }
}

/// Writes an output file on the host, up to a capacity.
pub struct FileSink {
    file: std::io::BufWriter<File>,
    capacity: u64,
    written: u64,
}

impl Sink for FileSink {
    fn write(&mut self, data: &[u8]) -> Result<(), ComputeError> {
        if self.written + data.len() as u64 > self.capacity {
            return Err(ComputeError::OutputFull { capacity: self.capacity });
        }
        self.file.write_all(data).map_err(|e| ComputeError::WriteIo(e.to_string()))?;
        self.written += data.len() as u64;
        Ok(())
    }
    fn written(&self) -> u64 {
        self.written
    }
}

/// How many bytes an operation may write for these inputs: the size of the output file
/// to allocate. Exact bounds where there are (copy, sort, merge, compress); the size the
/// zstd frame declares for decompress; the inputs' size for select (give more when a
/// query writes more than it reads).
pub fn output_capacity(op: &Operation, inputs: &[PathBuf]) -> Result<u64, HostError> {
    let mut total = 0u64;
    for p in inputs {
        total += std::fs::metadata(p).map_err(|source| HostError::Io { path: p.clone(), source })?.len();
    }
    Ok(match op.name {
        "compress" => nearstore_compute::compress::compress_bound(total),
        "decompress" => {
            let mut head = [0u8; 18];
            let mut f = File::open(&inputs[0]).map_err(|source| HostError::Io { path: inputs[0].clone(), source })?;
            let n = f.read(&mut head).map_err(|source| HostError::Io { path: inputs[0].clone(), source })?;
            nearstore_compute::compress::declared_size(&head[..n]).ok_or_else(|| {
                HostError::Invalid(format!("{}: the zstd frame does not say its decompressed size: give the capacity", inputs[0].display()))
            })?
        }
        // A last line without a newline gets one.
        "sort" | "merge" => total + inputs.len() as u64,
        _ => total,
    }
    .max(1))
}

/// The local path of a streaming operation over one file.
pub fn compute_file(op: &Operation, args: &[u8], path: &Path) -> Result<Outcome, HostError> {
    let mut src = FileSource::open(path)?;
    Ok(op.execute(args, &mut [&mut src], &mut [], &Context::default())?.remove(0))
}

fn transform_local(op: &Operation, args: &[u8], inputs: &[PathBuf], output: &Path, capacity: u64) -> Result<Outcome, HostError> {
    let mut srcs = inputs.iter().map(|p| FileSource::open(p)).collect::<Result<Vec<_>, _>>()?;
    let file = File::create(output).map_err(|source| HostError::Io { path: output.into(), source })?;
    let mut sink = FileSink { file: std::io::BufWriter::with_capacity(CHUNK, file), capacity, written: 0 };
    let mut ins: Vec<&mut dyn Source> = srcs.iter_mut().map(|s| s as &mut dyn Source).collect();
    let r = op.execute(args, &mut ins, &mut [&mut sink], &Context::default())?.remove(0);
    sink.file.flush().map_err(|source| HostError::Io { path: output.into(), source })?;
    Ok(r)
}

/// A transform's output while the call runs: a new file in the output's directory (the
/// same file system, so a target can write it and a rename puts it in place), removed
/// when dropped unless [`PendingOutput::commit`] renamed it over the output. A symbolic
/// link at the output's name is followed: the file it names is replaced.
struct PendingOutput {
    path: tempfile::TempPath,
    output: PathBuf,
}

impl PendingOutput {
    fn new(output: &Path) -> Result<PendingOutput, HostError> {
        let ioe = |source| HostError::Io { path: output.into(), source };
        let output = match std::fs::symlink_metadata(output) {
            Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(output).map_err(ioe)?,
            _ => output.to_path_buf(),
        };
        let dir = match output.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let name = output.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        // Mode 0666 less the umask, as a file the user created.
        let file = tempfile::Builder::new()
            .prefix(&format!(".{name}."))
            .suffix(".part")
            .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666))
            .tempfile_in(dir)
            .map_err(ioe)?;
        Ok(PendingOutput { path: file.into_temp_path(), output })
    }

    /// Puts the written file in the output's place.
    fn commit(self) -> Result<(), HostError> {
        let output = self.output;
        self.path.persist(&output).map_err(|e| HostError::Io { path: output, source: e.error })
    }
}

/// Refuses an output that is one of the inputs (the same file by device and inode, under
/// any name): allocating the output would truncate the input before it is read.
pub fn refuse_overwriting_inputs(output: &Path, inputs: &[PathBuf]) -> Result<(), HostError> {
    use std::os::unix::fs::MetadataExt;
    let Ok(o) = std::fs::metadata(output) else { return Ok(()) };
    for (i, p) in inputs.iter().enumerate() {
        let m = std::fs::metadata(p).map_err(|source| HostError::Io { path: p.clone(), source })?;
        if (m.dev(), m.ino()) == (o.dev(), o.ino()) {
            return Err(HostError::Invalid(format!(
                "the output {} is input {i} ({}): writing it would destroy the input; give another output",
                output.display(),
                p.display()
            )));
        }
    }
    Ok(())
}

/// Creates the output file with `capacity` bytes of allocated, written blocks, and maps
/// it. The blocks are zero-filled, not only fallocated: an unwritten extent reads as
/// zeros on the host whatever the target writes into it, and no system call marks it
/// written without writing it.
pub(crate) fn prepare_output(path: &Path, capacity: u64, devices: &DeviceMap) -> Result<Mapped, HostError> {
    prepare(path, capacity, devices, false)
}

/// Creates a scratch file of `capacity` bytes, allocated but not written (fallocate: no
/// zero fill, no write-back), and maps it with [`object::map_scratch`]. Where the file
/// system cannot fallocate, it is a zero-filled output like any other.
pub(crate) fn prepare_scratch(path: &Path, capacity: u64, devices: &DeviceMap) -> Result<Mapped, HostError> {
    prepare(path, capacity, devices, true)
}

fn prepare(path: &Path, capacity: u64, devices: &DeviceMap, scratch: bool) -> Result<Mapped, HostError> {
    let ioe = |source| HostError::Io { path: path.into(), source };
    let mut f = std::fs::OpenOptions::new().create(true).write(true).truncate(true).open(path).map_err(ioe)?;
    let cap = capacity.div_ceil(4096).max(1) * 4096;
    // For contiguous blocks; where the file system cannot fallocate, the zero fill below
    // allocates anyway.
    // SAFETY: plain syscall on an open descriptor.
    let allocated = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, cap as libc::off_t) } == 0;
    let scratch = scratch && allocated;
    if !scratch {
        let zeros = vec![0u8; CHUNK];
        let mut left = cap;
        while left > 0 {
            let n = left.min(CHUNK as u64) as usize;
            f.write_all(&zeros[..n]).map_err(ioe)?;
            left -= n as u64;
        }
    }
    f.sync_all().map_err(ioe)?;
    drop(f);
    Ok(if scratch { object::map_scratch(path, devices)? } else { object::map_file(path, devices)? })
}

/// Cuts the output to the bytes written and drops the host's cached pages of it, so a
/// plain read shows what the target wrote. The cache goes first: cutting the file zeroes
/// the rest of its last block through the cache, and a stale cached block (the zero
/// fill) would be written back over the target's bytes.
pub(crate) fn finish_output(path: &Path, written: u64) -> Result<(), HostError> {
    let ioe = |source| HostError::Io { path: path.into(), source };
    let f = std::fs::OpenOptions::new().write(true).open(path).map_err(ioe)?;
    drop_cached(&f, path)?;
    f.set_len(written).map_err(ioe)?;
    f.sync_all().map_err(ioe)?;
    drop_cached(&f, path)
}

/// Drops the host's clean cached pages of `f` (at `path`): a target writes the file's
/// blocks underneath the host's page cache, so what was cached before (a zero fill) is
/// stale and a read must reach the device. (The lab's benchmarks use it too.)
pub fn drop_cached(f: &File, path: &Path) -> Result<(), HostError> {
    // SAFETY: plain syscall on an open descriptor.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if r != 0 {
        return Err(HostError::Io { path: path.into(), source: std::io::Error::from_raw_os_error(r) });
    }
    Ok(())
}

/// A select result's value as a CSV field, as the CLI prints it and the FUSE mount reads it:
/// NULL empty, text quoted where it must be.
pub fn csv_field(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => String::new(),
        serde_json::Value::String(s) if s.is_empty() || s.contains([',', '"', '\n', '\r']) => format!("\"{}\"", s.replace('"', "\"\"")),
        serde_json::Value::String(s) => s.clone(),
        v => v.to_string(),
    }
}
