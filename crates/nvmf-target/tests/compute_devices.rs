//! The offload engine on the device layer: compute commands read their inputs through a
//! namespace's device stack (delayed, error-injecting), with no thread per input, and
//! leave no device operation behind whatever stops them.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nearstore_compute::{by_name, Outcome};
use nearstore_initiator::{Controller, Error, IoQueue};
use nearstore_target::config::Config;
use nearstore_target::Target;
use nearstore_wire::compute::{status as cs, Descriptor, Extent, Object};
use nearstore_wire::Status;

const BS: u64 = 4096;
const T: Duration = Duration::from_secs(60);
/// Namespaces of [`start`]: (nsid, what it is).
const STACKS: &[(u32, &str)] = &[
    (1, "memory"),
    (2, "memory, delayed"),
    (3, "file"),
    (4, "file, delayed"),
    (5, "memory, failing LBAs 16..32"),
    (6, "file, failing LBAs 16..32"),
    (7, "file, failing LBAs 16..32, delayed"),
];

/// Held by every test of this file: two of them count the process's threads or a
/// thread's CPU time, which another test running beside them (cargo runs two at a time)
/// would change.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A target with the namespaces of [`STACKS`], 8 MiB each, delays of `delay_us`, and
/// `extra` appended to its configuration.
async fn start(dir: &tempfile::TempDir, delay_us: u64, extra: &str) -> (Arc<Target>, std::net::SocketAddr, Controller, IoQueue) {
    common::init_logs();
    let d = dir.path().display();
    let inject = "[subsystem.namespace.inject]\nop = \"read\"\nlbas = [16, 32]";
    let ns = |nsid: u32, backing: String, delay: bool, fail: bool| {
        format!(
            "[[subsystem.namespace]]\nnsid = {nsid}\n{backing}\nblock_size = {BS}\ndelay_us = {}\n{}\n",
            if delay { delay_us } else { 0 },
            if fail { inject } else { "" }
        )
    };
    let mem = || "memory = \"8MiB\"".to_string();
    let file = |n: u32| format!("path = \"{d}/{n}.img\"\nsize = \"8MiB\"");
    let cfg = format!(
        "[[listener]]\naddress = \"127.0.0.1:0\"\n{extra}\n[[subsystem]]\nnqn = \"{}\"\nallow_any_host = true\n{}{}{}{}{}{}{}",
        common::NQN,
        ns(1, mem(), false, false),
        ns(2, mem(), true, false),
        ns(3, file(3), false, false),
        ns(4, file(4), true, false),
        ns(5, mem(), false, true),
        ns(6, file(6), false, true),
        ns(7, file(7), true, true),
    );
    let target = Target::from_config(&Config::from_toml(&cfg).unwrap()).unwrap();
    let addr = target.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    let c = Controller::connect(nearstore_initiator::ConnectOptions::new(addr, common::NQN)).await.unwrap();
    let q = c.io_queue(1).await.unwrap();
    (target, addr, c, q)
}

/// Text-like bytes: lines of words, some with the pattern the tests grep for.
fn content(len: usize, seed: u64) -> Vec<u8> {
    let words: [&[u8]; 5] = [b"alpha ", b"beta ", b"ERROR x\n", b"gamma\n", b"delta\t"];
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        out.extend_from_slice(words[(s >> 33) as usize % words.len()]);
    }
    out.truncate(len);
    out
}

/// Writes `data` at byte `at` of namespace `nsid` (through LBAs outside 16..32, which
/// fail reads only), in 128 KiB transfers.
async fn write(q: &mut IoQueue, nsid: u32, at: u64, data: &[u8]) {
    for (i, c) in data.chunks(128 << 10).enumerate() {
        let mut block = c.to_vec();
        block.resize(c.len().div_ceil(BS as usize) * BS as usize, 0);
        q.write(nsid, (at + (i as u64) * (128 << 10)) / BS, &block, BS as u32, false).await.unwrap();
    }
}

fn desc(op: &str, args: &[u8], inputs: Vec<Object>) -> Vec<u8> {
    Descriptor { op: by_name(op).unwrap().id, args: args.to_vec(), inputs, outputs: vec![] }.encode()
}

/// An object of `len` bytes in two extents, the second first in the namespace (from byte
/// `at`), with a hole between them.
fn object(at: u64, len: u64) -> Object {
    let half = len / 2 / BS * BS;
    let rest = len - half;
    Object {
        len: len + 2 * BS,
        extents: vec![Extent::data(at + rest.div_ceil(BS) * BS, half), Extent::zeros(2 * BS), Extent::data(at, rest.div_ceil(BS) * BS)],
    }
}

/// The bytes of [`object`] as the operation sees them.
fn object_bytes(data: &[u8]) -> Vec<u8> {
    let half = data.len() / 2 / BS as usize * BS as usize;
    // `object` puts the data's second part first.
    let (first, second) = data.split_at(data.len() - half);
    [second, &[0u8; 2 * BS as usize][..], first].concat()
}

/// Every operation that streams its input gives over every stack what the kernel gives
/// over the same bytes in memory: delays change the timing, not the result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compute_over_delayed_and_layered_namespaces_equals_the_local_kernel() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let (target, _, _c, mut q) = start(&dir, 300, "").await;
    // Beyond LBA 32, where nothing fails: 3 MiB and a tail cut short of its block.
    let data = content((3 << 20) + 1234, 7);
    let at = 64 * BS;
    // (operation, arguments)
    let ops: &[(&str, &[u8])] = &[("crc32c", b""), ("grep-count", br#"{"pattern":"^ERROR"}"#), ("wc", b"")];
    let bytes = object_bytes(&data);
    for &(nsid, what) in STACKS {
        // The object written as object() lays it out.
        let half = data.len() / 2 / BS as usize * BS as usize;
        let (first, second) = data.split_at(data.len() - half);
        write(&mut q, nsid, at, first).await;
        write(&mut q, nsid, at + (first.len() as u64).div_ceil(BS) * BS, second).await;
        for &(op, args) in ops {
            let want = nearstore_compute::run(op, args, [&bytes[..]]).unwrap();
            let got = q.compute(nsid, &desc(op, args, vec![object(at, data.len() as u64)]), T).await;
            let got: Vec<Outcome> = serde_json::from_slice(&got.unwrap_or_else(|e| panic!("{what} {op}: {e}"))).unwrap();
            assert_eq!(got, vec![want], "{what} {op}");
        }
    }
    assert_eq!(target.offload.stats.reads_in_flight.load(Relaxed), 0);
}

/// A read the device fails fails the command with Unrecovered Read Error and a message
/// naming where it read; reads that miss the failing blocks succeed on the same stack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_injected_read_error_fails_the_command_naming_the_place() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let (target, _, _c, mut q) = start(&dir, 300, "").await;
    for &(nsid, what) in &STACKS[4..] {
        write(&mut q, nsid, 0, &content(256 << 10, 3)).await;
        // (what, object, the byte the failing read starts at; None: succeeds)
        let cases: &[(&str, Object, Option<u64>)] = &[
            ("inside", Object { len: BS, extents: vec![Extent::data(20 * BS, BS)] }, Some(20 * BS)),
            ("across the start", Object { len: 8 * BS, extents: vec![Extent::data(12 * BS, 8 * BS)] }, Some(12 * BS)),
            ("second extent", Object { len: 2 * BS, extents: vec![Extent::data(0, BS), Extent::data(31 * BS, BS)] }, Some(31 * BS)),
            ("before", Object { len: 16 * BS, extents: vec![Extent::data(0, 16 * BS)] }, None),
            ("after, beside a hole", Object { len: 4 * BS, extents: vec![Extent::data(32 * BS, 2 * BS), Extent::zeros(2 * BS)] }, None),
        ];
        for (case, obj, fails_at) in cases {
            let r = q.compute(nsid, &desc("crc32c", b"", vec![obj.clone()]), T).await;
            match (fails_at, r) {
                (None, Ok(_)) => {}
                (Some(byte), Err(Error::Compute { status, message })) => {
                    assert_eq!(status, Status::UNRECOVERED_READ_ERROR.dnr(), "{what}, {case}: {message}");
                    let place = format!("at namespace byte {byte}");
                    assert!(message.contains(&place), "{what}, {case}: {message:?} lacks {place:?}");
                }
                (want, got) => panic!("{what}, {case}: want a failure at {want:?}, got {got:?}"),
            }
        }
    }
    assert_eq!(target.offload.stats.reads_in_flight.load(Relaxed), 0);
}

/// The threads of this process now: the target's, the test's and the runtime's.
/// This process's threads, without io_uring's workers (`iou-wrk-*`, the kernel's, made
/// when a ring punts an operation, as a cold page cache can make it do).
fn threads() -> usize {
    thread_names().iter().filter(|n| !n.starts_with("iou-wrk")).count()
}

/// Names of this process's threads.
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task (procfs is needed)")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|s| s.trim().to_string())
        .collect()
}

/// A command over 60 inputs runs on one thread of its own: reading ahead takes no thread
/// per input (it took 60 before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_over_many_inputs_takes_no_thread_per_input() {
    let _serial = SERIAL.lock().await;
    const INPUTS: usize = 60;
    let dir = tempfile::tempdir().unwrap();
    let (target, _, _c, mut q) = start(&dir, 5_000, "").await;
    let data = content(INPUTS * (64 << 10), 11);
    for (nsid, _) in [(2, ""), (4, "")] {
        write(&mut q, nsid, 0, &data).await;
    }
    // Settles what starts on first use (the I/O workers, the test's runtime).
    q.compute(1, &desc("crc32c", b"", vec![object(0, 64 << 10)]), T).await.unwrap();
    let before = threads();
    for (nsid, what) in [(2, "memory, delayed"), (4, "file, delayed")] {
        let inputs: Vec<Object> =
            (0..INPUTS as u64).map(|i| Object { len: 64 << 10, extents: vec![Extent::data(i * (64 << 10), 64 << 10)] }).collect();
        let (most, done) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
        let sampler = {
            let (most, done) = (most.clone(), done.clone());
            std::thread::spawn(move || {
                let mut names = Vec::new();
                while !done.load(Relaxed) {
                    most.fetch_max(threads(), Relaxed);
                    names = thread_names();
                    std::thread::sleep(Duration::from_millis(1));
                }
                names
            })
        };
        let t0 = Instant::now();
        let got = q.compute(nsid, &desc("crc32c", b"", inputs), T).await.unwrap();
        done.store(true, Relaxed);
        let names = sampler.join().unwrap();
        let got: Vec<Outcome> = serde_json::from_slice(&got).unwrap();
        assert_eq!(got.len(), INPUTS, "{what}");
        for (i, o) in got.iter().enumerate() {
            assert_eq!(
                *o,
                nearstore_compute::run("crc32c", b"", [&data[i * (64 << 10)..(i + 1) * (64 << 10)]]).unwrap(),
                "{what} input {i}"
            );
        }
        // 60 delayed reads one after another: long enough for the sampler to see it run.
        assert!(t0.elapsed() >= Duration::from_millis(250), "{what}: ran {:?}", t0.elapsed());
        // The command's thread and the sampler; 2 to spare for the runtime's own. The
        // read-ahead threads of before were named nearstore-readahead, which Linux cuts to
        // 15 bytes in comm.
        let grew = most.load(Relaxed).saturating_sub(before);
        assert!(grew <= 4, "{what}: the process grew by {grew} threads for {INPUTS} inputs");
        assert!(!names.iter().any(|n| n.starts_with("nearstore-peers") || n.starts_with("nearstore-reada")), "{what}: {names:?}");
    }
    assert_eq!(target.offload.stats.reads_in_flight.load(Relaxed), 0);
}

/// However a command stops in the middle of a read (its connection closes, its deadline
/// passes), its device reads have all completed when it ends: none is left outstanding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_stopped_mid_read_leaves_no_read_outstanding() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    // Every read held back 700 ms; commands may run 2 s.
    let (target, addr, _c, mut q) = start(&dir, 700_000, "[compute]\ntimeout_secs = 2\nreadahead = 4").await;
    let inputs: Vec<Object> =
        (0..4u64).map(|i| Object { len: 4 << 20, extents: vec![Extent::data(i * (2 << 20), 2 << 20), Extent::zeros(2 << 20)] }).collect();
    let d = desc("crc32c", b"", inputs);
    let stats = &target.offload.stats;
    // (what, how it stops, what the command's host sees)
    for (what, closes, nsid) in [("connection closed", true, 2), ("deadline", false, 4)] {
        let t0 = Instant::now();
        if closes {
            let c2 = Controller::connect(nearstore_initiator::ConnectOptions::new(addr, common::NQN)).await.unwrap();
            let mut q2 = c2.io_queue(1).await.unwrap();
            let d = d.clone();
            let task = tokio::spawn(async move { q2.compute(nsid, &d, T).await });
            while stats.reads_in_flight.load(Relaxed) == 0 {
                assert!(t0.elapsed() < T, "{what}: no read started");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            // Closing the host's connections ends the command mid-read.
            task.abort();
            drop(c2);
        } else {
            let r = q.compute(nsid, &d, T).await;
            match r {
                Err(Error::Compute { status, message }) => assert_eq!(status, cs::TIMEOUT, "{what}: {message}"),
                r => panic!("{what}: want TIMEOUT, got {r:?}"),
            }
        }
        // When the command has ended, its reads have completed: not one of them later.
        loop {
            let running = stats.running.load(Relaxed);
            let reads = stats.reads_in_flight.load(Relaxed);
            if running == 0 {
                assert_eq!(reads, 0, "{what}: the command ended with reads outstanding");
                break;
            }
            assert!(t0.elapsed() < T, "{what}: still running");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let lost = nearstore_target::metrics::render(&target);
    assert!(lost.lines().any(|l| l == "nearstore_requests_lost_total 0"), "{lost}");
}

/// Outputs go through the namespace's device stack as inputs do: an injected write error
/// on an output fails the command with Write Fault naming the place, a failing flush fails
/// it as well, and where nothing fails (delayed or not) the output holds the input. They
/// went to the backend directly before, past the failing devices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outputs_are_written_and_flushed_through_the_device_stack() {
    let _serial = SERIAL.lock().await;
    common::init_logs();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    // (nsid, backing, delay_us, inject)
    let stacks: &[(u32, String, u64, &str)] = &[
        (1, "memory = \"4MiB\"".into(), 0, "op = \"write\"\nlbas = [64, 80]"),
        (2, format!("path = \"{d}/2.img\"\nsize = \"4MiB\""), 0, "op = \"write\"\nlbas = [64, 80]"),
        (3, format!("path = \"{d}/3.img\"\nsize = \"4MiB\""), 2_000, "op = \"write\"\nlbas = [64, 80]"),
        (4, "memory = \"4MiB\"".into(), 2_000, "op = \"flush\""),
        (5, format!("path = \"{d}/5.img\"\nsize = \"4MiB\""), 0, "op = \"flush\""),
    ];
    let mut cfg = format!("[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"{}\"\nallow_any_host = true\n", common::NQN);
    for (nsid, backing, delay, inject) in stacks {
        cfg += &format!(
            "[[subsystem.namespace]]\nnsid = {nsid}\n{backing}\nblock_size = {BS}\ndelay_us = {delay}\n[subsystem.namespace.inject]\n{inject}\n"
        );
    }
    let target = Target::from_config(&Config::from_toml(&cfg).unwrap()).unwrap();
    let addr = target.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    let c = Controller::connect(nearstore_initiator::ConnectOptions::new(addr, common::NQN)).await.unwrap();
    let mut q = c.io_queue(1).await.unwrap();
    // 40 KiB of input at LBA 0, copied to 40 KiB in two extents.
    let data = content(40 << 10, 5);
    let copy = |out: Vec<Extent>| {
        Descriptor {
            op: by_name("copy").unwrap().id,
            args: vec![],
            inputs: vec![Object { len: data.len() as u64, extents: vec![Extent::data(0, data.len() as u64)] }],
            outputs: vec![Object { len: data.len() as u64, extents: out }],
        }
        .encode()
    };
    // Output extents: clear of LBAs 64..80, and with the second one on LBA 70.
    let clear = vec![Extent::data(100 * BS, 4 * BS), Extent::data(120 * BS, 6 * BS)];
    let failing = vec![Extent::data(100 * BS, 4 * BS), Extent::data(70 * BS, 6 * BS)];
    // (nsid, output, Ok or the place a Write Fault names)
    let cases: &[(u32, &Vec<Extent>, Result<(), &str>)] = &[
        (1, &clear, Ok(())),
        (1, &failing, Err("at namespace byte 286720")),
        (2, &clear, Ok(())),
        (2, &failing, Err("at namespace byte 286720")),
        (3, &clear, Ok(())),
        (3, &failing, Err("at namespace byte 286720")),
        (4, &clear, Err("flushing the output")),
        (5, &clear, Err("flushing the output")),
    ];
    for &(nsid, out, ref want) in cases {
        write(&mut q, nsid, 0, &data).await;
        let r = q.compute(nsid, &copy(out.clone()), T).await;
        match (want, r) {
            (Ok(()), Ok(_)) => {
                let mut back = q.read(nsid, 100, 4, BS as u32).await.unwrap();
                back.extend(q.read(nsid, 120, 6, BS as u32).await.unwrap());
                assert!(back == data, "ns {nsid}: the output differs from the input");
            }
            (Err(place), Err(Error::Compute { status, message })) => {
                assert_eq!(status, Status::WRITE_FAULT.dnr(), "ns {nsid}: {message}");
                assert!(message.contains(place), "ns {nsid}: {message:?} lacks {place:?}");
            }
            (want, got) => panic!("ns {nsid}, output {out:?}: want {want:?}, got {got:?}"),
        }
    }
    assert_eq!(target.offload.stats.reads_in_flight.load(Relaxed), 0);
    let m = nearstore_target::metrics::render(&target);
    assert!(m.lines().any(|l| l == "nearstore_requests_lost_total 0"), "{m}");
}

/// CPU time this thread has run, in nanoseconds.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a plain syscall writing into `ts`.
    assert_eq!(unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) }, 0);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CPU time thread `tid` of this process has run, in nanoseconds.
fn task_cpu_ns(tid: i32) -> u64 {
    let s =
        std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).expect("schedstat (procfs with CONFIG_SCHEDSTATS is needed)");
    s.split_whitespace().next().and_then(|n| n.parse().ok()).expect("schedstat's first field")
}

/// A compute command's reads of a file namespace cost the network thread no copy: a
/// page-cache hit is copied on a kernel worker (IOSQE_ASYNC), not inside the submit on the
/// thread that serves every connection (it copied one compute.chunk per read there
/// before). Measured as the network thread's CPU time during a command over 256 MiB in the
/// page cache, against this thread's time to copy the same bytes once: a ratio, the same
/// on a fast or a slow machine (measured on 6.18: 1.2 to 1.3 copies before, 0.3 after; the
/// rest is the submits, the connections and the task wake-ups).
#[test]
fn file_reads_of_a_compute_command_copy_nothing_on_the_network_thread() {
    let _serial = SERIAL.blocking_lock();
    const LEN: usize = 256 << 20;
    common::init_logs();
    let dir = tempfile::tempdir().unwrap();
    let cfg = format!(
        "[[listener]]\naddress = \"127.0.0.1:0\"\n[compute]\nchunk = \"16MiB\"\n[[subsystem]]\nnqn = \"{}\"\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\npath = \"{}/ns.img\"\nsize = \"256MiB\"\nblock_size = {BS}\n",
        common::NQN,
        dir.path().display()
    );
    let target = Target::from_config(&Config::from_toml(&cfg).unwrap()).unwrap();
    let data: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
    // Written through the page cache, where the command finds it.
    target.subsystem(common::NQN).unwrap().namespace(1).unwrap().backend.write_at(&data, 0).unwrap();
    // The target's network runtime: one thread, whose CPU time is measured.
    let (tx, rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let t = target.clone();
    let net = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let addr = t.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
            // SAFETY: a plain syscall.
            tx.send((addr, unsafe { libc::gettid() })).unwrap();
            let _ = stop_rx.await;
        });
    });
    let (addr, tid) = rx.recv().unwrap();
    let host = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (net_ns, crc) = host.block_on(async {
        let c = Controller::connect(nearstore_initiator::ConnectOptions::new(addr, common::NQN)).await.unwrap();
        let mut q = c.io_queue(1).await.unwrap();
        let d = desc("crc32c", b"", vec![Object { len: LEN as u64, extents: vec![Extent::data(0, LEN as u64)] }]);
        // The first makes the engine's ring and warms what starts on first use.
        q.compute(1, &d, T).await.unwrap();
        let before = task_cpu_ns(tid);
        let got = q.compute(1, &d, T).await.unwrap();
        (task_cpu_ns(tid) - before, got)
    });
    let got: Vec<Outcome> = serde_json::from_slice(&crc).unwrap();
    assert_eq!(got, vec![nearstore_compute::run("crc32c", b"", [&data[..]]).unwrap()]);
    // One copy of the same bytes on this thread, into memory already touched.
    let mut to = vec![1u8; LEN];
    let t0 = thread_cpu_ns();
    to.copy_from_slice(std::hint::black_box(&data));
    let copy_ns = thread_cpu_ns() - t0;
    std::hint::black_box(&to);
    let _ = stop_tx.send(());
    net.join().unwrap();
    assert!(
        net_ns * 2 < copy_ns,
        "the network thread ran {} us during the command, a copy of its {} MiB takes {} us here",
        net_ns / 1000,
        LEN >> 20,
        copy_ns / 1000
    );
}
