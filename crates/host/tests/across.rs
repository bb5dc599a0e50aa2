//! Sorting across targets: three targets, each exporting an ext4 image on a loop device,
//! each with the others in its cluster map. Sort-benchmark records, u64 keys and lines
//! spread over them sort into one output or per-device ranges, device to device and
//! host-mediated, equal to the sort of everything in memory; the plan's faults (a lock
//! never released, a target that is gone, a peer that dies mid-transfer, an output too
//! small) each fail with the step and device named, and leave no runs, copies, outputs,
//! locks or running commands behind. Needs root, loop devices and mkfs.ext4.

mod common;
#[path = "../../nvmf-target/tests/common/proxy.rs"]
mod proxy;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::Fs;
use nearstore_host::device::{DeviceMap, Endpoint};
use nearstore_host::dsort::{sort_across, SortAcross, SortOutput, Transfer};
use nearstore_host::orchestrator::{self, Action, Locks, Options, Range, Step};
use nearstore_host::{HostError, Identity};
use nearstore_target::config::Config;
use nearstore_target::Target;
use nearstore_wire::compute::{Descriptor, Extent, Object};
use proxy::{proxy, Faults};
use tokio::net::TcpListener;

struct Cluster {
    fs: Vec<Fs>,
    map: DeviceMap,
    targets: Vec<Arc<Target>>,
    /// Where the host reaches each target.
    targets_addr: Vec<SocketAddr>,
    /// Device 3 as everyone reaches it goes through a proxy.
    faults: Arc<Faults>,
}

const NQN: &str = "nqn.2026-11.io.nearstore:across";

/// Three targets, tags 1 to 3; each lists the others as peers. Device 3 is reached
/// (by the host and by its peers) through a proxy. `more(i)` is added to target i's
/// configuration (tenants).
async fn cluster(more: &dyn Fn(usize) -> String) -> Cluster {
    let fs: Vec<Fs> = (0..3).map(|_| Fs::new(128)).collect();
    let listeners: Vec<TcpListener> = futures_listeners(3).await;
    let real: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let faults = Arc::new(Faults::default());
    let p3 = proxy(real[2], faults.clone(), 1 << 20).await;
    let seen = [real[0], real[1], p3];
    let mut targets = Vec::new();
    let mut map = DeviceMap::default();
    for (i, l) in listeners.into_iter().enumerate() {
        let mut cfg = format!(
            "[cluster]\nhost_nqn = \"nqn.2026-11.io.nearstore:t{}\"\ntrusted_members = [\"nqn.2026-11.io.nearstore:t1\", \"nqn.2026-11.io.nearstore:t2\", \"nqn.2026-11.io.nearstore:t3\"]\ntimeout_secs = 5\n[[listener]]\naddress = \"{}\"\n[[subsystem]]\nnqn = \"{NQN}{i}\"\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\npath = \"{}\"\ntag = {}\n",
            i + 1,
            real[i],
            fs[i].image.display(),
            i + 1
        );
        cfg += &more(i);
        for j in (0..3).filter(|j| *j != i) {
            cfg += &format!("[[cluster.peer]]\ntag = {}\naddress = \"{}\"\nnqn = \"{NQN}{j}\"\n", j + 1, seen[j]);
        }
        let t = Target::from_config(&Config::from_toml(&cfg).unwrap()).unwrap();
        t.serve_listener(l, false, None).unwrap();
        targets.push(t);
        let ep = Endpoint { address: seen[i], nqn: format!("{NQN}{i}"), nsid: 1 };
        map.add_file(&fs[i].image, ep.clone()).unwrap();
        map.set_tag(&ep, i as u16 + 1).unwrap();
    }
    Cluster { fs, map, targets, targets_addr: seen.to_vec(), faults }
}

async fn futures_listeners(n: usize) -> Vec<TcpListener> {
    let mut v = Vec::new();
    for _ in 0..n {
        v.push(TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    v
}

fn write(path: &Path, data: &[u8]) -> PathBuf {
    std::fs::write(path, data).unwrap();
    path.to_path_buf()
}

/// Records in the sort benchmark's shape (100 bytes, a 10-byte key), `n` from number
/// `start`: keys scattered by a multiplicative hash of the number, the number after them.
fn records(n: u64, start: u64) -> Vec<u8> {
    (start..start + n)
        .flat_map(|i| {
            let key = i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes();
            [&key[..], &[0x00, 0x11], format!("{i:090}").as_bytes()].concat()
        })
        .collect()
}

/// The inputs of a data set on the three devices (two files on the first), and their
/// sort in memory.
fn spread(c: &Cluster, parts: [Vec<u8>; 4], args: &[u8]) -> (Vec<PathBuf>, Vec<u8>) {
    let files = vec![
        write(&c.fs[0].mnt.join("a.in"), &parts[0]),
        write(&c.fs[0].mnt.join("b.in"), &parts[1]),
        write(&c.fs[1].mnt.join("c.in"), &parts[2]),
        write(&c.fs[2].mnt.join("d.in"), &parts[3]),
    ];
    (files, sorted(&parts, args))
}

/// The sort of `parts` in memory.
fn sorted(parts: &[Vec<u8>], args: &[u8]) -> Vec<u8> {
    let refs: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
    let mut srcs: Vec<nearstore_compute::SliceSource> =
        refs.iter().map(|d| nearstore_compute::SliceSource::new(d.chunks(1 << 20))).collect();
    let mut ins: Vec<&mut dyn nearstore_compute::Source> = srcs.iter_mut().map(|s| s as &mut dyn nearstore_compute::Source).collect();
    let mut out = nearstore_compute::VecSink::new(1 << 30);
    nearstore_compute::by_name("sort").unwrap().execute(args, &mut ins, &mut [&mut out], &Default::default()).unwrap();
    out.data
}

fn quiet(_: &str) {}

fn opts(lock_secs: u64) -> Options {
    Options { lock_timeout: Duration::from_secs(lock_secs), command_timeout: Duration::from_secs(120), ..Options::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sorts_across_three_targets_into_one_output_or_ranges_in_both_modes() {
    let c = cluster(&|_| String::new()).await;
    let locks = Arc::new(Locks::default());
    let layouts: [(serde_json::Value, [Vec<u8>; 4]); 3] = [
        (
            serde_json::json!({"record_size": 100, "key_length": 10}),
            [records(3000, 0), records(1500, 3000), records(5000, 4500), records(2500, 9500)],
        ),
        (serde_json::json!({"record_size": 16, "key_type": "u64"}), {
            let u =
                |n: u64, s: u64| -> Vec<u8> { (0..n).flat_map(|i| [(i * 7919 + s) % 100_003, i].map(u64::to_le_bytes).concat()).collect() };
            [u(4000, 1), u(10, 2), u(6000, 3), u(3000, 4)]
        }),
        (
            serde_json::json!({}),
            [b"pear\nfig\n".repeat(500), b"apple\nkiwi".to_vec(), b"plum\nfig\nlime\n".repeat(900), b"date\n".repeat(300)],
        ),
    ];
    for (args, parts) in layouts {
        let (inputs, want) = spread(&c, parts, &serde_json::to_vec(&args).unwrap());
        for transfer in [Transfer::DeviceToDevice, Transfer::HostMediated] {
            let what = format!("{args} {transfer:?}");
            // One output, on the second device: it merges.
            let out = c.fs[1].mnt.join("sorted.out");
            let req = SortAcross { inputs: inputs.clone(), args: args.clone(), output: SortOutput::One(out.clone()), transfer };
            let r = sort_across(&c.map, locks.clone(), &req, &opts(60), &quiet).await.unwrap();
            assert!(std::fs::read(&out).unwrap() == want, "{what}: one output differs from the sort in memory");
            assert_eq!((r.outputs.len(), r.outputs[0].device, r.outputs[0].bytes), (1, 2, want.len() as u64), "{what}");
            let copies = r.steps.iter().filter(|s| s.name.starts_with("copy")).count();
            assert_eq!(
                copies,
                if transfer == Transfer::HostMediated { 2 } else { 0 },
                "{what}: {:?}",
                r.steps.iter().map(|s| &s.name).collect::<Vec<_>>()
            );
            // Ranges: one output per device; in device order they are the whole sort.
            let req = SortAcross { output: SortOutput::Ranges("part.out".into()), ..req };
            let r = sort_across(&c.map, locks.clone(), &req, &opts(60), &quiet).await.unwrap();
            let joined: Vec<u8> = r.outputs.iter().flat_map(|p| std::fs::read(&p.path).unwrap()).collect();
            assert!(joined == want, "{what}: ranges differ from the sort in memory");
            assert_eq!(r.outputs.iter().map(|p| p.device).collect::<Vec<_>>(), vec![1, 2, 3]);
            assert!(r.outputs.iter().all(|p| p.bytes > 0), "{what}: an empty range: {:?}", r.outputs);
            for (k, fs) in c.fs.iter().enumerate() {
                let keep: &[&str] = &["a.in", "b.in", "c.in", "d.in", "sorted.out", "part.out"];
                assert!(fs.leftovers(keep).is_empty(), "{what}: device {} keeps {:?}", k + 1, fs.leftovers(keep));
            }
        }
    }
    // Fewer records than devices, and empty inputs: empty ranges give empty outputs.
    let args = serde_json::json!({"record_size": 100, "key_length": 10});
    let (inputs, want) = spread(&c, [records(1, 0), vec![], records(1, 1), vec![]], &serde_json::to_vec(&args).unwrap());
    for transfer in [Transfer::DeviceToDevice, Transfer::HostMediated] {
        let req = SortAcross { inputs: inputs.clone(), args: args.clone(), output: SortOutput::Ranges("part.out".into()), transfer };
        let r = sort_across(&c.map, locks.clone(), &req, &opts(60), &quiet).await.unwrap();
        let joined: Vec<u8> = r.outputs.iter().flat_map(|p| std::fs::read(&p.path).unwrap()).collect();
        assert!(joined == want, "{transfer:?}: tiny ranges differ");
        assert_eq!(r.outputs.iter().map(|p| p.records).sum::<u64>(), 2);
    }
    assert!(locks.held().is_empty());
}

/// With tenants on the targets, every connection of the sort (its steps', and the peers'
/// reads acting for it) is the requesting host's (`Options::identity`): a host whose
/// tenant reaches devices 1 and 2 sorts files there, in both transfer modes; with an input
/// on device 3, which its tenant does not reach, the plan fails naming device 3; the
/// machine's own host NQN, in no tenant, is refused where the sorter succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sort_connects_as_the_requesting_host_and_reaches_what_its_tenant_does() {
    const SORTER: &str = "nqn.2026-11.io.nearstore:across-sorter";
    let c = cluster(&|i| {
        let host = if i < 2 { SORTER } else { "nqn.2026-11.io.nearstore:across-other" };
        format!("[[tenant]]\nname = \"sorting\"\nhosts = [\"{host}\"]\n[[tenant.reach]]\nsubsystem = \"{NQN}{i}\"\n")
    })
    .await;
    let locks = Arc::new(Locks::default());
    let args = serde_json::json!({"record_size": 100, "key_length": 10});
    let parts = [records(300, 0), records(200, 300), records(500, 500), records(400, 1000)];
    let args_bytes = serde_json::to_vec(&args).unwrap();
    let (inputs, _) = spread(&c, parts.clone(), &args_bytes);
    let want = sorted(&parts[..3], &args_bytes);
    let out = c.fs[1].mnt.join("sorted.out");
    // (what, host NQN, inputs, transfer, Ok or the device named in the failure)
    let cases: [(&str, Option<&str>, usize, Transfer, Result<(), &str>); 5] = [
        ("sorter, devices 1 and 2", Some(SORTER), 3, Transfer::DeviceToDevice, Ok(())),
        ("sorter, devices 1 and 2, host-mediated", Some(SORTER), 3, Transfer::HostMediated, Ok(())),
        ("sorter, an input on device 3", Some(SORTER), 4, Transfer::DeviceToDevice, Err("device 3")),
        ("sorter, an input on device 3, host-mediated", Some(SORTER), 4, Transfer::HostMediated, Err("device 3")),
        ("the machine's host", None, 3, Transfer::DeviceToDevice, Err("device ")),
    ];
    for (what, host, n, transfer, expect) in cases {
        let _ = std::fs::remove_file(&out);
        let req = SortAcross { inputs: inputs[..n].to_vec(), args: args.clone(), output: SortOutput::One(out.clone()), transfer };
        let o = Options { identity: Identity { hostnqn: host.map(String::from), ..Identity::default() }, ..opts(60) };
        let r = sort_across(&c.map, locks.clone(), &req, &o, &quiet).await;
        match expect {
            Ok(()) => {
                r.unwrap_or_else(|e| panic!("{what}: {e}"));
                assert!(std::fs::read(&out).unwrap() == want, "{what}: the output differs from the sort in memory");
            }
            Err(device) => {
                expect_step_error(r, "", device, &["connecting"]);
                assert!(!out.exists(), "{what}: an output was written");
            }
        }
        for fs in &c.fs {
            let keep: &[&str] = &["a.in", "b.in", "c.in", "d.in", "sorted.out"];
            assert!(fs.leftovers(keep).is_empty(), "{what}: left {:?}", fs.leftovers(keep));
        }
    }
    assert!(locks.held().is_empty());
}

fn expect_step_error(r: Result<impl std::fmt::Debug, HostError>, step: &str, device: &str, needles: &[&str]) {
    match r {
        Err(HostError::Step(e)) => {
            assert!(e.step.contains(step) && e.device.contains(device), "{e}");
            for n in needles {
                assert!(e.message.contains(n), "{e} lacks {n:?}");
            }
        }
        r => panic!("expected a failed step, got {r:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_fail_the_request_naming_step_and_device_and_leave_nothing_behind() {
    let c = cluster(&|_| String::new()).await;
    let locks = Arc::new(Locks::default());
    let args = serde_json::json!({"record_size": 100, "key_length": 10});
    let (inputs, _) = spread(
        &c,
        [records(100, 0), records(100, 100), records(20_000, 200), records(30_000, 20_200)],
        &serde_json::to_vec(&args).unwrap(),
    );
    // The user's own files where the outputs go (one output, and ranges named part.out on
    // every device): a failed sort leaves them byte for byte. Before, they were allocated
    // in place (zero-filled) and removed on failure.
    let out = c.fs[0].mnt.join("sorted.out");
    let mine: Vec<(PathBuf, Vec<u8>)> = [out.clone()]
        .into_iter()
        .chain(c.fs.iter().map(|fs| fs.mnt.join("part.out")))
        .enumerate()
        .map(|(i, p)| {
            let data = format!("the user's file {i}\n").repeat(1000 + i).into_bytes();
            std::fs::write(&p, &data).unwrap();
            (p, data)
        })
        .collect();
    let req = SortAcross { inputs, args, output: SortOutput::One(out.clone()), transfer: Transfer::DeviceToDevice };
    let clean = |what: &str| {
        for fs in &c.fs {
            let keep: &[&str] = &["a.in", "b.in", "c.in", "d.in", "sorted.out", "part.out"];
            assert!(fs.leftovers(keep).is_empty(), "{what}: left {:?}", fs.leftovers(keep));
        }
        for (p, data) in &mine {
            let now = std::fs::read(p).unwrap_or_else(|e| panic!("{what}: {} is gone: {e}", p.display()));
            assert!(&now == data, "{what}: {} changed", p.display());
        }
        for t in &c.targets {
            assert_eq!(t.offload.stats.running.load(Ordering::Relaxed), 0, "{what}: a command still runs");
        }
    };

    // The output is an input: refused before anything is written, the input intact.
    let before = std::fs::read(&req.inputs[0]).unwrap();
    let into_input = SortAcross { output: SortOutput::One(req.inputs[0].clone()), ..req.clone() };
    match sort_across(&c.map, locks.clone(), &into_input, &opts(60), &quiet).await {
        Err(HostError::Invalid(m)) => assert!(m.contains("is input 0"), "{m}"),
        r => panic!("expected a refusal, got {r:?}"),
    }
    assert!(std::fs::read(&req.inputs[0]).unwrap() == before, "the input changed");
    let into_input = SortAcross { output: SortOutput::Ranges("c.in".into()), ..req.clone() };
    match sort_across(&c.map, locks.clone(), &into_input, &opts(60), &quiet).await {
        Err(HostError::Invalid(m)) => assert!(m.contains("is input 2"), "{m}"),
        r => panic!("expected a refusal, got {r:?}"),
    }
    clean("output is an input");

    // A lock that is never released: someone holds all of device 1.
    locks.lock(&[Range { tag: 1, start: 0, end: u64::MAX }], "a stuck request");
    let r = sort_across(&c.map, locks.clone(), &req, &opts(1), &quiet).await;
    // The sort and the merge on device 1 both read its blocks: whichever gives up first.
    expect_step_error(r, "on device 1", "device 1", &["stayed locked by 'a stuck request' for 1 s"]);
    assert_eq!(locks.held().len(), 1, "the plan's own locks are released, the stranger's stays");
    locks.unlock("a stuck request");
    clean("lock timeout");

    // In ranges, the outputs are allocated after the sort phase: a stranger takes device 1
    // as the merges are planned (the second plan), so a merge reading it gives up.
    let plans = std::sync::atomic::AtomicUsize::new(0);
    let stranger = |m: &str| {
        if m.ends_with("steps planned") && plans.fetch_add(1, Ordering::Relaxed) == 1 {
            locks.lock(&[Range { tag: 1, start: 0, end: u64::MAX }], "a stuck request");
        }
    };
    let ranges = SortAcross { output: SortOutput::Ranges("part.out".into()), ..req.clone() };
    let r = sort_across(&c.map, locks.clone(), &ranges, &opts(1), &stranger).await;
    expect_step_error(r, "merge on device", "device", &["device 1 bytes", "stayed locked by 'a stuck request' for 1 s"]);
    locks.unlock("a stuck request");
    clean("lock timeout, ranges");

    // A peer dies mid-transfer: device 3's run, read by device 1's merge, is cut after
    // 1 MiB.
    c.faults.cut.store(true, Ordering::Relaxed);
    let r = sort_across(&c.map, locks.clone(), &req, &opts(60), &quiet).await;
    expect_step_error(r, "merge on device 1", "device 1", &["PEER_FAILED", "peer tag 3"]);
    clean("peer died");

    // A target that is gone: nothing answers for device 3.
    c.faults.gone.store(true, Ordering::Relaxed);
    let r = sort_across(&c.map, locks.clone(), &req, &opts(60), &quiet).await;
    expect_step_error(r, "sort on device 3", "device 3", &["connecting"]);
    clean("target gone");
    assert!(locks.held().is_empty());

    // A namespace without a tag in the host's map: refused before anything is allocated.
    let mut untagged = DeviceMap::default();
    for (i, fs) in c.fs.iter().enumerate() {
        let ep = Endpoint { address: c.targets_addr[i], nqn: format!("{NQN}{i}"), nsid: 1 };
        untagged.add_file(&fs.image, ep).unwrap();
    }
    let r = sort_across(&untagged, locks.clone(), &req, &opts(60), &quiet).await;
    match r {
        Err(HostError::Invalid(m)) => assert!(m.contains("has no tag in the cluster map"), "{m}"),
        r => panic!("expected a refusal, got {r:?}"),
    }
    clean("untagged");

    // A host whose connection breaks mid-pull reconnects on its next call.
    c.faults.gone.store(false, Ordering::Relaxed);
    let mut host = nearstore_host::Host::new(c.map.clone());
    host.parallel = 1;
    let d_in = vec![c.fs[2].mnt.join("d.in")];
    let crc = nearstore_compute::by_name("crc32c").unwrap();
    let want = host.run(crc, b"", &d_in, nearstore_host::Mode::Local).await.unwrap().files[0].outcome.clone();
    let r = host.run(crc, b"", &d_in, nearstore_host::Mode::Pull).await;
    assert!(r.is_err(), "the cut connection fails the pull: {r:?}");
    c.faults.cut.store(false, Ordering::Relaxed);
    let r = host.run(crc, b"", &d_in, nearstore_host::Mode::Pull).await.unwrap();
    assert_eq!(r.files[0].outcome, want);

    // An output too small, in a plan of the orchestrator's own.
    let src = c.fs[1].mnt.join("c.in");
    let dst = c.fs[1].mnt.join("small.out");
    std::fs::write(&dst, vec![0u8; 4096]).unwrap();
    let obj = |p: &Path| match nearstore_host::object::map_file(p, &c.map).unwrap() {
        nearstore_host::object::Mapped::Offload(f) => f,
        _ => panic!("not offloadable"),
    };
    let (s, d) = (obj(&src), obj(&dst));
    let step = Step {
        name: "copy into a small file".into(),
        device: s.location.endpoint.clone(),
        tag: 2,
        action: Action::Exec {
            desc: Descriptor {
                op: nearstore_compute::by_name("copy").unwrap().id,
                args: vec![],
                inputs: vec![s.object.clone()],
                outputs: vec![Object { len: 4096, extents: vec![Extent { offset: d.object.extents[0].offset, len: 4096 }] }],
            },
        },
        after: vec![],
        reads: orchestrator::ranges_of(2, &s.object),
        writes: orchestrator::ranges_of(2, &d.object),
    };
    let r = orchestrator::run(vec![step], locks.clone(), &opts(5), &quiet).await.map_err(HostError::Step);
    expect_step_error(r, "copy into a small file", "device 2", &["OUTPUT_TOO_SMALL"]);
    assert!(locks.held().is_empty());
}
