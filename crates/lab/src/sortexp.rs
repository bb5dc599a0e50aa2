//! The distributed-sort experiments on the testbed (docs/experiments.md, experiment 3):
//! sort-benchmark records spread over K targets, sorted with `sort --across` into one
//! output on the first target, device to device and host-mediated, every result checked
//! like valsort does (order, record count, multiset checksum equal to the inputs').
//!
//! - `sort-size`: runtime against data size on 2 targets at 1 Gbit/s;
//! - `sort-rate`: the merge phase against the link rate, with its split into copies and
//!   merge (host-mediated) and the merge's wait for its inputs (device to device);
//! - `sort-devices`: runtime against the number of targets at 1 and 10 Gbit/s.

use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::Arc;

use crate::sortbench::{self, Validator};
use anyhow::{bail, Context, Result};
use nearstore_host::dsort::{sort_across, Phases, SortAcross, SortOutput, Transfer};
use nearstore_host::orchestrator::{Locks, Options};
use serde::{Deserialize, Serialize};

use crate::testbed::{self, ExperimentArgs, State};

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct SortRecord {
    pub experiment: String,
    pub transfer: Transfer,
    /// `one` output file on the first target, or `ranges`: one per target.
    #[serde(default = "one")]
    pub output: String,
    pub targets: usize,
    pub rate: String,
    pub bytes: u64,
    pub records: u64,
    /// The median run's phases, and every run's seconds.
    #[serde(flatten)]
    pub phases: Phases,
    pub secs_runs: Vec<f64>,
    /// Every link's bytes: (host, received, sent) at the host's end.
    pub links: Vec<(String, u64, u64)>,
    /// Bytes through the client's link (received + sent).
    pub client_bytes: u64,
}

fn one() -> String {
    "one".into()
}

/// The grid of an experiment: (sizes, rates, target counts).
fn grid(a: &ExperimentArgs) -> Result<(Vec<u64>, Vec<String>, Vec<usize>)> {
    let sizes = |d: &[&str]| -> Result<Vec<u64>> {
        let given: Vec<String> = a.sizes.clone().unwrap_or_else(|| d.iter().map(|s| s.to_string()).collect());
        given
            .iter()
            .map(|s| s.parse::<nearstore_target::config::ByteSize>().map(|b| b.0).map_err(|e| anyhow::anyhow!("--sizes {s}: {e}")))
            .collect()
    };
    let rates = |d: &[&str]| a.rates.clone().unwrap_or_else(|| d.iter().map(|s| s.to_string()).collect());
    let targets = |d: &[usize]| a.targets.clone().unwrap_or_else(|| d.to_vec());
    Ok(match a.name.as_str() {
        "sort-size" => (sizes(&["32KiB", "256KiB", "2MiB", "16MiB", "128MiB", "512MiB"])?, rates(&["1gbit"]), targets(&[2])),
        "sort-rate" => (sizes(&["64MiB"])?, rates(&["20mbit", "100mbit", "1gbit", "10gbit", "40gbit", "none"]), targets(&[2])),
        "sort-devices" => (sizes(&["256MiB"])?, rates(&["1gbit", "10gbit"]), targets(&[2, 4, 8])),
        other => bail!("experiment {other:?}: sort-size, sort-rate or sort-devices"),
    })
}

pub fn is_sort(name: &str) -> bool {
    name.starts_with("sort-")
}

pub fn experiment(a: &ExperimentArgs) -> Result<()> {
    let (sizes, rates, targets) = grid(a)?;
    let max = *targets.iter().max().context("--targets is empty")?;
    let biggest = *sizes.iter().max().context("--sizes is empty")?;
    if targets.contains(&1) {
        bail!("--targets: a sort across targets needs at least 2");
    }
    // Room for a target's inputs and run, the output, and host copies, on the first.
    let image = (biggest * 3 + (256 << 20)).max(512 << 20);
    let up = testbed::UpArgs {
        targets: max as u32,
        files: 1,
        file_size: 4096,
        dir: a.dir.clone(),
        image_size: Some(image),
        shape: testbed::ShapeArgs { rate: rates[0].clone(), delay: "0ms".into() },
    };
    let mut st = testbed::up(&up)?;
    let st2 = st.clone();
    let name = a.name.clone();
    let (runs, ranges) = (a.runs, a.ranges);
    let worker = std::thread::spawn(move || -> Result<Vec<SortRecord>> {
        testbed::enter_netns("nstb-client")?;
        let mut st = st2;
        run_grid(&name, &mut st, &sizes, &rates, &targets, runs, ranges)
    });
    let r = worker.join().expect("the measuring thread");
    let d = testbed::down();
    let records = r?;
    d?;
    st.targets.clear();
    if let Some(dir) = a.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&a.out, serde_json::to_vec_pretty(&records)?)?;
    eprintln!("{} measurements in {}", records.len(), a.out.display());
    Ok(())
}

/// Writes `total` bytes of records over the first `k` targets, numbered across them; the
/// inputs' summary (records, checksum).
fn generate(st: &State, k: usize, total: u64) -> Result<(Vec<PathBuf>, sortbench::Summary)> {
    let n = total / sortbench::RECORD as u64;
    let mut v = Validator::default();
    let mut files = Vec::new();
    let mut next = 0u64;
    for (i, t) in st.targets[..k].iter().enumerate() {
        let count = n * (i as u64 + 1) / k as u64 - next;
        let path = t.mnt.join("sort.in");
        let mut w = BufWriter::with_capacity(1 << 20, std::fs::File::create(&path)?);
        for r in next..next + count {
            let rec = sortbench::record(1, r);
            v.update(&rec);
            w.write_all(&rec)?;
        }
        w.into_inner()?.sync_all()?;
        next += count;
        files.push(path);
    }
    Ok((files, v.finish()?))
}

fn run_grid(
    name: &str,
    st: &mut State,
    sizes: &[u64],
    rates: &[String],
    targets: &[usize],
    runs: u32,
    ranges: bool,
) -> Result<Vec<SortRecord>> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let host = testbed::client(st)?;
    let locks = Arc::new(Locks::default());
    let mut records = Vec::new();
    for rate in rates {
        testbed::shape_all(st, rate, "0ms")?;
        for &k in targets {
            for &size in sizes {
                let (inputs, want) = generate(st, k, size)?;
                // One output on the first target, or a range on each.
                let output =
                    if ranges { SortOutput::Ranges("sort.out".into()) } else { SortOutput::One(st.targets[0].mnt.join("sort.out")) };
                let hosts: Vec<(String, String)> = std::iter::once(("client".to_string(), "nstb-client".to_string()))
                    .chain(st.targets[..k].iter().map(|t| (t.name.clone(), t.ns.clone())))
                    .collect();
                let mut cells: Vec<Vec<SortRecord>> = vec![Vec::new(), Vec::new()];
                // Modes alternate, so that drifts of the machine touch both alike.
                for _ in 0..runs {
                    for (m, transfer) in [Transfer::HostMediated, Transfer::DeviceToDevice].into_iter().enumerate() {
                        let before: Vec<(u64, u64)> = hosts.iter().map(|h| testbed::link_bytes(&h.1)).collect::<Result<_>>()?;
                        let req = SortAcross {
                            inputs: inputs.clone(),
                            args: serde_json::json!({"record_size": 100, "key_length": 10}),
                            output: output.clone(),
                            transfer,
                        };
                        let r = rt.block_on(sort_across(&host.devices, locks.clone(), &req, &Options::default(), &|_| {}))?;
                        let after: Vec<(u64, u64)> = hosts.iter().map(|h| testbed::link_bytes(&h.1)).collect::<Result<_>>()?;
                        // valsort over the outputs the sort reports, in order: in order, every
                        // record there once.
                        let paths: Vec<PathBuf> = r.outputs.iter().map(|o| o.path.clone()).collect();
                        let got = crate::records::validate_records(&paths)?;
                        if !got.sorted() || got.records != want.records || got.checksum != want.checksum {
                            bail!("{k} targets, {size} bytes, {transfer:?}: the output is not the sorted input: {got:?} against {want:?}");
                        }
                        for p in &paths {
                            std::fs::remove_file(p)?;
                        }
                        let links: Vec<(String, u64, u64)> =
                            hosts.iter().zip(after.iter().zip(&before)).map(|(h, (a, b))| (h.0.clone(), a.0 - b.0, a.1 - b.1)).collect();
                        cells[m].push(SortRecord {
                            experiment: name.into(),
                            transfer,
                            output: if ranges { "ranges".into() } else { "one".into() },
                            targets: k,
                            rate: rate.clone(),
                            bytes: r.bytes,
                            records: want.records,
                            phases: r.phases,
                            secs_runs: vec![],
                            client_bytes: links[0].1 + links[0].2,
                            links,
                        });
                    }
                }
                for mut c in cells {
                    c.sort_by(|x, y| x.phases.secs.total_cmp(&y.phases.secs));
                    let all: Vec<f64> = c.iter().map(|r| r.phases.secs).collect();
                    let mut rec = c.swap_remove(c.len() / 2);
                    rec.secs_runs = all;
                    eprintln!(
                        "{name} {} {k} targets {rate:>7} {:>10} bytes {:<15?} {} client link {} bytes",
                        rec.output, rec.bytes, rec.transfer, rec.phases, rec.client_bytes
                    );
                    records.push(rec);
                }
                for f in &inputs {
                    std::fs::remove_file(f)?;
                }
            }
        }
    }
    Ok(records)
}
