//! Sort across targets: files on several devices sorted into one output file, or into
//! one output per device holding a range of keys (docs/compute.md, "Sorting across
//! targets").
//!
//! Every device sorts its own inputs into a run next to them. Then either
//! - one output: the output's device merges every run, or
//! - ranges: the host picks k-1 splitter keys from the runs' indexes (each run returns
//!   the key and offset of every so many records), and device j merges, from every run,
//!   the slice that holds keys of range j.
//!
//! Runs on other devices reach the merging device in one of two ways:
//! - device to device: the merge's descriptor names them by global address (their
//!   device's tag), and the target reads them from its peer itself;
//! - host-mediated (the seed's baseline): the host reads each run from its device and
//!   writes it into a copy allocated on the merging device, then the merge reads copies.
//!
//! Steps are ordered by block locks (see [`crate::orchestrator`]): a merge waits for the
//! runs (or copies) it reads because their writers hold them.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use nearstore_compute::{IndexEntry, Outcome};
use nearstore_wire::compute::{global, Descriptor, Extent, Object};
use serde::Serialize;

use crate::device::{DeviceMap, Endpoint};
use crate::object::{self, FileObject, Mapped};
use crate::orchestrator::{self, ranges_of, Action, Allocations, Locks, Options, Step, StepReport};
use crate::{HostError, PendingOutput};

/// How runs reach the merging device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Transfer {
    /// The merging target reads its peers' runs itself.
    DeviceToDevice,
    /// The host copies each run to the merging device first.
    HostMediated,
}

/// Where the sorted records go.
#[derive(Clone, Debug)]
pub enum SortOutput {
    /// One file, merged on the device it lies on.
    One(PathBuf),
    /// One file of this name per device (beside the device's first input), each holding
    /// one range of keys, in device order.
    Ranges(String),
}

#[derive(Clone, Debug)]
pub struct SortAcross {
    pub inputs: Vec<PathBuf>,
    /// The sort's arguments (record layout), as for `sort` and `merge`.
    pub args: serde_json::Value,
    pub output: SortOutput,
    pub transfer: Transfer,
}

#[derive(Clone, Debug, Serialize)]
pub struct SortedPart {
    pub path: PathBuf,
    pub device: u16,
    pub bytes: u64,
    pub records: u64,
}

/// Where a sort's time went, in seconds.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct Phases {
    /// The whole request.
    pub secs: f64,
    /// Mapping the inputs and allocating runs, copies and the output, before the first step.
    pub prepare_secs: f64,
    /// Every device sorting its inputs, until the last is done.
    pub sort_secs: f64,
    /// The rest: host copies (host-mediated) and merges, and the outputs cut to size.
    pub merge_phase_secs: f64,
    /// Within the merge phase: the span of the host copies, and of the merges.
    pub copy_secs: f64,
    pub merge_secs: f64,
    /// Time the merges waited for their inputs' bytes (the slowest merge's): reading runs
    /// from peers over the network device to device, from the local media otherwise.
    pub merge_input_wait_secs: f64,
}

impl std::fmt::Display for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.2} s: prepare {:.2} s, sort phase {:.2} s, merge phase {:.2} s (copies {:.2} s, merges {:.2} s, merge input wait {:.2} s)",
            self.secs,
            self.prepare_secs,
            self.sort_secs,
            self.merge_phase_secs,
            self.copy_secs,
            self.merge_secs,
            self.merge_input_wait_secs
        )
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct SortReport {
    pub transfer: Transfer,
    pub devices: usize,
    pub bytes: u64,
    pub outputs: Vec<SortedPart>,
    #[serde(flatten)]
    pub phases: Phases,
    pub steps: Vec<StepReport>,
}

/// Names of runs and copies (hidden, beside the inputs) start with this.
const SCRATCH: &str = ".nearstore-sort-";

/// Index entries each run returns for picking ranges.
const INDEX_ENTRIES: usize = 1024;
/// Slices of runs start at a multiple of this (every namespace block size divides it).
const ALIGN: u64 = 4096;

struct Device {
    ep: Endpoint,
    tag: u16,
    inputs: Vec<FileObject>,
    dir: PathBuf,
}

fn invalid(m: String) -> HostError {
    HostError::Invalid(m)
}

/// An object's extents as seen from the device tagged `at`: those on another device
/// carry their tag.
fn seen_from(o: &Object, on: u16, at: u16) -> Result<Object, HostError> {
    let mut out = o.clone();
    if on != at {
        for e in out.extents.iter_mut().filter(|e| !e.is_zeros()) {
            if e.offset > global::OFFSET_MASK {
                return Err(invalid(format!("namespace byte {} is beyond what a global address holds (256 TiB)", e.offset)));
            }
            e.offset = global::address(on, e.offset);
        }
    }
    Ok(out)
}

/// The bytes `from..to` of an object; `from` is a multiple of [`ALIGN`].
fn slice(o: &Object, from: u64, to: u64) -> Object {
    let mut out = Object { len: to - from, extents: Vec::new() };
    let mut at = 0u64;
    for e in &o.extents {
        let (s, t) = (at, at + e.len);
        at = t;
        if t <= from || s >= to {
            continue;
        }
        let cut = from.saturating_sub(s);
        let end = e.len.min(to - s).div_ceil(ALIGN) * ALIGN;
        let len = end.min(e.len) - cut;
        let offset = if e.is_zeros() { e.offset } else { e.offset + cut };
        out.extents.push(Extent { offset, len });
    }
    out
}

/// Bytes a sort of these files writes: lines get a newline where one is missing.
fn sorted_len(files: &[FileObject], lines: bool) -> Result<u64, HostError> {
    let mut n = 0;
    for f in files {
        let len = f.object.len;
        n += len;
        if lines && len > 0 {
            let mut file = std::fs::File::open(&f.path).map_err(|source| HostError::Io { path: f.path.clone(), source })?;
            let mut last = [0u8];
            file.seek(SeekFrom::Start(len - 1))
                .and_then(|_| file.read_exact(&mut last))
                .map_err(|source| HostError::Io { path: f.path.clone(), source })?;
            n += u64::from(last[0] != b'\n');
        }
    }
    Ok(n)
}

/// Allocates `path` with `capacity` bytes on a target's namespace (on `want`, if given).
/// Runs and copies are scratch (read by targets only), recorded in `scratch` to be removed
/// at the end; outputs (`scratch` None) are pending files that remove themselves, read
/// through the file system afterwards, so they need written blocks.
fn allocate(
    path: &Path,
    capacity: u64,
    devices: &DeviceMap,
    want: Option<&Endpoint>,
    scratch: Option<&mut Vec<PathBuf>>,
) -> Result<FileObject, HostError> {
    let m = match scratch {
        Some(alloc) => {
            // Ours to remove once prepared, or if we made it: a file that was there and
            // could not be prepared is left alone.
            let existed = path.exists();
            let m = crate::prepare_scratch(path, capacity, devices);
            if m.is_ok() || !existed {
                alloc.push(path.to_path_buf());
            }
            m
        }
        None => crate::prepare_output(path, capacity, devices),
    };
    match m? {
        Mapped::Offload(f) if want.is_none_or(|w| &f.location.endpoint == w) => Ok(f),
        Mapped::Offload(f) => {
            let want = want.expect("checked above");
            Err(invalid(format!(
                "{}: allocated on {} {}, not on {} {}",
                path.display(),
                f.location.endpoint.address,
                f.location.endpoint.nqn,
                want.address,
                want.nqn
            )))
        }
        Mapped::Local { reason, .. } => Err(invalid(format!("{}: cannot be written by a target: {reason}", path.display()))),
    }
}

/// What a merge step wrote: bytes and records, or an error naming the step.
fn merged(r: &StepReport) -> Result<(u64, u64), HostError> {
    match &r.outcome {
        Some(Outcome::Merged { output, records, .. }) => Ok((*output, *records)),
        o => Err(invalid(format!("step '{}' returned {o:?}", r.name))),
    }
}

/// Runs a sort across devices. The runs and copies it allocates are removed when it
/// ends. The outputs are written as new files beside them, renamed over them only when
/// every merge succeeded: a failed sort leaves the user's files as they were.
pub async fn sort_across(
    devices_map: &DeviceMap,
    locks: Arc<Locks>,
    req: &SortAcross,
    opts: &Options,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<SortReport, HostError> {
    let mut alloc = Allocations::default();
    let r = plan_and_run(devices_map, locks, req, opts, progress, &mut alloc).await;
    alloc.release();
    r
}

async fn plan_and_run(
    map: &DeviceMap,
    locks: Arc<Locks>,
    req: &SortAcross,
    opts: &Options,
    progress: &(dyn Fn(&str) + Send + Sync),
    alloc: &mut Allocations,
) -> Result<SortReport, HostError> {
    let t0 = Instant::now();
    let sort_op = nearstore_compute::by_name("sort")?;
    let merge_op = nearstore_compute::by_name("merge")?;
    let args = serde_json::to_vec(&req.args).map_err(|e| invalid(e.to_string()))?;
    sort_op.check(&args, 1, 1)?;
    let lines = req.args.get("record_size").is_none();
    if req.inputs.is_empty() {
        return Err(invalid("no input files".into()));
    }
    // The devices, in order of their first input.
    let mut devs: Vec<Device> = Vec::new();
    for p in &req.inputs {
        let f = match object::map_file(p, map)? {
            Mapped::Offload(f) => f,
            Mapped::Local { reason, .. } => return Err(invalid(format!("{}: not on a target's namespace ({reason})", p.display()))),
        };
        let ep = f.location.endpoint.clone();
        let tag = map.tag_of(&ep).ok_or_else(|| {
            invalid(format!("{}: its namespace ({} {} nsid {}) has no tag in the cluster map", p.display(), ep.address, ep.nqn, ep.nsid))
        })?;
        match devs.iter_mut().find(|d| d.ep == ep) {
            Some(d) => d.inputs.push(f),
            None => {
                let dir = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf();
                devs.push(Device { ep, tag, inputs: vec![f], dir })
            }
        }
    }
    // Unique among the sorts of this process and of others (the pid) at once.
    static SORTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = format!("{}-{}", std::process::id(), SORTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let k = devs.len();
    // Runs, allocated beside each device's inputs.
    let mut runs: Vec<(FileObject, u64)> = Vec::new();
    for (i, d) in devs.iter().enumerate() {
        let len = sorted_len(&d.inputs, lines)?;
        let path = d.dir.join(format!("{SCRATCH}{id}-run{i}"));
        let f = allocate(&path, len, map, Some(&d.ep), Some(&mut alloc.temporary))?;
        runs.push((f, len));
    }
    let total: u64 = runs.iter().map(|r| r.1).sum();
    let sort_args = |index: bool| -> Vec<u8> {
        let mut a = req.args.clone();
        if index {
            a["index"] = INDEX_ENTRIES.into();
        }
        serde_json::to_vec(&a).expect("JSON")
    };
    let sort_steps = |index: bool| -> Vec<Step> {
        devs.iter()
            .zip(&runs)
            .map(|(d, (run, len))| {
                // An empty run has no blocks to name (a descriptor's extents lie within
                // the object's length).
                let out = if *len == 0 { Object::default() } else { Object { len: *len, ..run.object.clone() } };
                let inputs: Vec<Object> = d.inputs.iter().map(|f| f.object.clone()).collect();
                Step {
                    name: format!("sort on device {}", d.tag),
                    device: d.ep.clone(),
                    tag: d.tag,
                    reads: inputs.iter().flat_map(|o| ranges_of(d.tag, o)).collect(),
                    writes: ranges_of(d.tag, &run.object),
                    action: Action::Exec { desc: Descriptor { op: sort_op.id, args: sort_args(index), inputs, outputs: vec![out] } },
                    after: vec![],
                }
            })
            .collect()
    };
    let run_obj = |i: usize| Object { len: runs[i].1, ..runs[i].0.object.clone() };

    // Each merge: its device, the slices of runs it merges (run, from, to), key bounds,
    // its output.
    struct MergeJob {
        dev: usize,
        slices: Vec<(usize, u64, u64)>,
        key_min: Option<String>,
        key_max: Option<String>,
        /// The output as the user named it, and the new file written in its place.
        path: PathBuf,
        pending: PendingOutput,
        output: FileObject,
    }
    let mut reports: Vec<StepReport> = Vec::new();
    let mut steps: Vec<Step> = Vec::new();
    // When the first plan started: mapping and allocating came before.
    let mut prepare_secs = 0.0;
    let jobs = match &req.output {
        SortOutput::One(out) => {
            crate::refuse_overwriting_inputs(out, &req.inputs)?;
            steps = sort_steps(false);
            let pending = PendingOutput::new(out)?;
            let f = allocate(&pending.path, total, map, None, None)?;
            let ep = f.location.endpoint.clone();
            let m = match devs.iter().position(|d| d.ep == ep) {
                Some(m) => m,
                None => {
                    let tag = map.tag_of(&ep).ok_or_else(|| {
                        invalid(format!("{}: its namespace ({} {}) has no tag in the cluster map", out.display(), ep.address, ep.nqn))
                    })?;
                    devs.push(Device { ep, tag, inputs: vec![], dir: PathBuf::new() });
                    devs.len() - 1
                }
            };
            let slices = (0..k).map(|i| (i, 0, runs[i].1)).collect();
            vec![MergeJob { dev: m, slices, key_min: None, key_max: None, path: out.clone(), pending, output: f }]
        }
        SortOutput::Ranges(name) => {
            for d in &devs {
                crate::refuse_overwriting_inputs(&d.dir.join(name), &req.inputs)?;
            }
            progress("sort phase: every device sorts its inputs");
            prepare_secs = t0.elapsed().as_secs_f64();
            reports = orchestrator::run(sort_steps(true), locks.clone(), opts, progress).await.map_err(HostError::Step)?;
            shift(&mut reports, prepare_secs);
            let index: Vec<Vec<IndexEntry>> = reports
                .iter()
                .map(|r| match &r.outcome {
                    Some(Outcome::Sorted { index, .. }) => Ok(index.clone()),
                    o => Err(invalid(format!("step '{}' returned no index: {o:?}", r.name))),
                })
                .collect::<Result<_, _>>()?;
            let cuts = splitters(&index, &runs.iter().map(|r| r.1).collect::<Vec<_>>(), k);
            let mut jobs = Vec::new();
            for (j, dev) in devs.iter().enumerate() {
                let (lo, hi) = (j.checked_sub(1).map(|i| cuts[i].clone()), cuts.get(j).cloned());
                let slices: Vec<(usize, u64, u64)> = (0..k)
                    .map(|i| {
                        let ix = &index[i];
                        let from = lo.as_ref().map_or(0, |lo| ix.iter().filter(|e| &e.key < lo).map(|e| e.offset).max().unwrap_or(0));
                        let to = hi.as_ref().map_or(runs[i].1, |hi| ix.iter().find(|e| &e.key >= hi).map_or(runs[i].1, |e| e.offset));
                        (i, from, to.max(from))
                    })
                    .collect();
                let cap: u64 = slices.iter().map(|s| s.2 - s.1).sum();
                let path = dev.dir.join(name);
                let pending = PendingOutput::new(&path)?;
                let f = allocate(&pending.path, cap, map, Some(&dev.ep), None)?;
                jobs.push(MergeJob { dev: j, slices, key_min: lo, key_max: hi, path, pending, output: f });
            }
            jobs
        }
    };
    // The merges, with the copies before them when host-mediated.
    for (jn, job) in jobs.iter().enumerate() {
        let here = &devs[job.dev];
        let mut inputs = Vec::new();
        let mut skips = Vec::new();
        let mut reads = Vec::new();
        for &(i, from, to) in &job.slices {
            if from == to {
                continue; // no record of this range in run i
            }
            let at = from / ALIGN * ALIGN;
            let piece = slice(&run_obj(i), at, to);
            let there = &devs[i];
            if i == job.dev || req.transfer == Transfer::DeviceToDevice {
                reads.extend(ranges_of(there.tag, &piece));
                inputs.push(seen_from(&piece, there.tag, here.tag)?);
                skips.push(from - at);
                continue;
            }
            let path = here.dir.join(format!("{SCRATCH}{id}-copy{i}to{}-{jn}", job.dev));
            let copy = allocate(&path, to - from, map, Some(&here.ep), Some(&mut alloc.temporary))?;
            let to_obj = Object { len: to - from, ..copy.object.clone() };
            steps.push(Step {
                name: format!(
                    "copy run of device {} to device {}{}",
                    there.tag,
                    here.tag,
                    if jobs.len() > 1 { format!(" (range {jn})") } else { String::new() }
                ),
                device: here.ep.clone(),
                tag: here.tag,
                reads: ranges_of(there.tag, &piece),
                writes: ranges_of(here.tag, &copy.object),
                action: Action::Copy { from_ep: there.ep.clone(), from: piece, skip: from - at, to: to_obj.clone() },
                after: vec![],
            });
            reads.extend(ranges_of(here.tag, &copy.object));
            inputs.push(to_obj);
            skips.push(0);
        }
        if inputs.is_empty() {
            continue; // an empty range: its output stays empty
        }
        let mut a = req.args.clone();
        a["skip"] = skips.into();
        if let Some(lo) = &job.key_min {
            a["key_min"] = lo.clone().into();
        }
        if let Some(hi) = &job.key_max {
            a["key_max"] = hi.clone().into();
        }
        steps.push(Step {
            name: merge_name(here.tag, jn, jobs.len()),
            device: here.ep.clone(),
            tag: here.tag,
            reads,
            writes: ranges_of(here.tag, &job.output.object),
            action: Action::Exec {
                desc: Descriptor {
                    op: merge_op.id,
                    args: serde_json::to_vec(&a).expect("JSON"),
                    inputs,
                    outputs: vec![job.output.object.clone()],
                },
            },
            after: vec![],
        });
    }
    let offset = t0.elapsed().as_secs_f64();
    if reports.is_empty() {
        prepare_secs = offset;
    }
    let mut more = orchestrator::run(steps, locks, opts, progress).await.map_err(HostError::Step)?;
    shift(&mut more, offset);
    reports.extend(more);
    // The inputs are as they were mapped: a file changed during the sort fails it.
    for f in devs.iter().flat_map(|d| &d.inputs) {
        f.verify()?;
    }
    // The outputs, cut to what the merges wrote, then put in place.
    let mut outputs = Vec::new();
    let merges: Vec<&StepReport> = reports.iter().filter(|r| r.name.starts_with("merge")).collect();
    for (jn, job) in jobs.iter().enumerate() {
        let name = merge_name(devs[job.dev].tag, jn, jobs.len());
        let (bytes, records) = match merges.iter().find(|r| r.name == name) {
            Some(r) => merged(r)?,
            None => (0, 0),
        };
        crate::finish_output(&job.output.path, bytes)?;
        outputs.push(SortedPart { path: job.path.clone(), device: devs[job.dev].tag, bytes, records });
    }
    for job in jobs {
        job.pending.commit()?;
    }
    let secs = t0.elapsed().as_secs_f64();
    let span = |prefix: &str| -> f64 {
        let v: Vec<&StepReport> = reports.iter().filter(|r| r.name.starts_with(prefix)).collect();
        if v.is_empty() {
            return 0.0;
        }
        v.iter().map(|r| r.ended).fold(0.0, f64::max) - v.iter().map(|r| r.started).fold(f64::MAX, f64::min)
    };
    let sort_end = reports.iter().filter(|r| r.name.starts_with("sort")).map(|r| r.ended).fold(0.0, f64::max);
    let wait_ms = merges
        .iter()
        .filter_map(|r| if let Some(Outcome::Merged { input_wait_ms, .. }) = &r.outcome { Some(*input_wait_ms) } else { None })
        .max();
    Ok(SortReport {
        transfer: req.transfer,
        devices: k,
        bytes: total,
        outputs,
        phases: Phases {
            secs,
            prepare_secs,
            sort_secs: sort_end - prepare_secs,
            merge_phase_secs: secs - sort_end,
            copy_secs: span("copy"),
            merge_secs: span("merge"),
            merge_input_wait_secs: wait_ms.unwrap_or(0) as f64 / 1000.0,
        },
        steps: reports,
    })
}

/// Makes step times relative to the request's start: the plan started `at` seconds in.
fn shift(reports: &mut [StepReport], at: f64) {
    for r in reports {
        r.started += at;
        r.ended += at;
    }
}

fn merge_name(tag: u16, job: usize, jobs: usize) -> String {
    if jobs > 1 {
        format!("merge on device {tag} (range {job})")
    } else {
        format!("merge on device {tag}")
    }
}

/// k-1 keys that cut the runs into k ranges of about equal records: weighted quantiles
/// of the index entries (an entry of run i stands for records_i / entries_i records).
fn splitters(index: &[Vec<IndexEntry>], lens: &[u64], k: usize) -> Vec<String> {
    let mut all: Vec<(&str, f64)> = Vec::new();
    for (ix, len) in index.iter().zip(lens) {
        let w = *len as f64 / ix.len().max(1) as f64;
        all.extend(ix.iter().map(|e| (e.key.as_str(), w)));
    }
    all.sort_by(|a, b| a.0.cmp(b.0));
    let total: f64 = all.iter().map(|e| e.1).sum();
    let mut out = Vec::new();
    let mut acc = 0.0;
    let mut next = 1;
    for (key, w) in all {
        acc += w;
        while next < k && acc >= total * next as f64 / k as f64 {
            out.push(key.to_string());
            next += 1;
        }
    }
    while out.len() < k - 1 {
        out.push(out.last().cloned().unwrap_or_default());
    }
    out
}
