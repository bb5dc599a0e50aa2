//! The memory budget (`[limits] memory`) against the process that keeps it: a real
//! `nearstore target` is driven to the limit on every path its hosts can grow (queues whose
//! host stops reading with big reads outstanding, held compute results, concurrent compute
//! commands that sort and group near their bound), and its peak resident memory (VmHWM) is
//! compared with the budget plus what the budget does not count.

mod common;

use std::time::Duration;

use nearstore_compute::by_name;
use nearstore_initiator::{ConnectOptions, Controller, Data, Error, IoQueue};
use nearstore_wire::compute::{opcode as cop, status as cs, Descriptor, Extent, Object};
use nearstore_wire::opcode::io;
use nearstore_wire::{Sqe, Status};

const NQN: &str = "nqn.2024-01.io.nearstore:memory";
const MIB: u64 = 1 << 20;
/// The budget under test.
const BUDGET: u64 = 256 * MIB;
/// `compute.memory_per_command`: each started command reserves it.
const COMMAND: u64 = 32 * MIB;
/// What the budget does not count, beyond the idle process measured first: the stacks of
/// threads started for compute commands (a few KiB touched each), the allocator's
/// bookkeeping and what it keeps free for reuse, controllers and commands' own state. The
/// peak measured 57 MiB under the budget (with one malloc arena per core,
/// limits::MALLOC_ARENAS_PER_CORE); with glibc's default arenas it was 48 MiB over. With
/// glibc's self-raising mmap threshold it came within 7 MiB of the limit, and over it on a
/// busy machine (limits::MALLOC_MMAP_THRESHOLD_BYTES).
const SLACK: u64 = 16 * MIB;
const BLOCK: u64 = 512;
/// Where the CSV for the compute commands lies in the namespace, and its size.
const CSV_AT: u64 = 64 * MIB;
const CSV_BYTES: usize = 24 << 20;

/// A process's memory figure from /proc/PID/status, in bytes.
fn status_kib(pid: u32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("reading /proc/PID/status of the target");
    let line = text.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"));
    let kib: u64 = line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("a number of kB");
    kib * 1024
}

fn opts(addr: std::net::SocketAddr) -> ConnectOptions {
    let mut o = ConnectOptions::new(addr, NQN);
    o.timeout = Duration::from_secs(60);
    o
}

fn is_busy(e: &Error) -> bool {
    matches!(e, Error::Status { status, .. } if *status == Status::CONNECT_CONTROLLER_BUSY)
}

/// Queues that stop reading: I/O queues are opened until the budget refuses one, each
/// with 127 reads of 128 KiB from the file namespace outstanding and never read (each read
/// holds a data buffer, charged as the queue grows its pool, until the budget makes the
/// queue wait). Returns the queues (kept open) and whether the budget refused one (else
/// every queue granted was opened).
async fn slow_readers(c: &Controller) -> (Vec<IoQueue>, bool) {
    let mut held = Vec::new();
    for qid in 1..=c.io_queues_granted() {
        let mut q = match c.io_queue(qid).await {
            Ok(q) => q,
            Err(e) if is_busy(&e) => return (held, true),
            Err(e) => panic!("I/O queue {qid}: {e}"),
        };
        for i in 0..127u64 {
            q.queue().submit(Sqe::rw(io::READ, 1, i * 256, 256, false), Data::In(128 * 1024), i).unwrap();
        }
        q.queue().flush().await.unwrap();
        held.push(q);
    }
    (held, false)
}

/// Held results: controllers (with I/O queues of two entries, the cheapest to connect)
/// each run searches until the target answers RESULTS_FULL before a controller's own
/// limit, or refuses the next controller or queue (Controller Busy), the budget being
/// full. A search of four inputs of 10,000 matches each has a result of about 200 KiB.
/// Returns the controllers and queues (kept open) and the results held.
async fn held_results(addr: std::net::SocketAddr) -> (Vec<(Controller, IoQueue)>, usize) {
    let input = Object { len: 65536, extents: vec![Extent::data(0, 65536)] };
    let search = Descriptor {
        op: by_name("search").unwrap().id,
        args: br#"{"pattern":"a","max_offsets":10000}"#.to_vec(),
        inputs: vec![input; 4],
        outputs: vec![],
    }
    .encode();
    let mut o = opts(addr);
    o.queue_depth = 2;
    let mut ctrls = Vec::new();
    let mut held = 0;
    loop {
        let c = match Controller::connect(o.clone()).await {
            Ok(c) => c,
            Err(e) if is_busy(&e) && held > 0 => return (ctrls, held),
            Err(e) => panic!("controller {}: {e}", ctrls.len()),
        };
        let mut q = match c.io_queue(1).await {
            Ok(q) => q,
            Err(e) if is_busy(&e) && held > 0 => return (ctrls, held),
            Err(e) => panic!("I/O queue of controller {}: {e}", ctrls.len()),
        };
        if ctrls.is_empty() {
            q.write(1, 0, &[b'a'; 65536], BLOCK as u32, false).await.unwrap();
        }
        let mut n = 0;
        let full = loop {
            let qp = q.queue();
            let cid = qp.submit(*Sqe::new(cop::EXEC, 0).set_nsid(1), Data::Out(&search), 0).unwrap();
            let cqe = qp.wait(cid, |_, _, _| {}).await.unwrap();
            if cqe.status == cs::RESULTS_FULL {
                break n < nearstore_target::limits::RESULTS_HELD_MAX;
            }
            assert!(cqe.status.is_success(), "search: {}", cqe.status);
            n += 1;
        };
        held += n;
        ctrls.push((c, q));
        if full {
            return (ctrls, held);
        }
    }
}

/// Compute commands near their bound, all at once on one queue: GROUP BY a unique key and
/// ORDER BY a text column over 24 MiB of CSV, more than a 32 MiB command can hold. Each
/// ends with success, LIMIT_EXCEEDED, or RESULTS_FULL when the budget cannot hold its
/// result besides the commands started; returns how many of each.
async fn heavy_selects(q: &mut IoQueue) -> [usize; 3] {
    let select = by_name("select").unwrap().id;
    let input = Object { len: CSV_BYTES as u64, extents: vec![Extent::data(CSV_AT, CSV_BYTES as u64)] };
    let queries =
        ["SELECT id, COUNT(*), MAX(name) FROM s3object GROUP BY id ORDER BY id LIMIT 3", "SELECT name, id FROM s3object ORDER BY name"];
    let descs: Vec<Vec<u8>> = (0..8)
        .map(|i| {
            let args = serde_json::json!({ "query": queries[i % 2] }).to_string().into_bytes();
            Descriptor { op: select, args, inputs: vec![input.clone()], outputs: vec![] }.encode()
        })
        .collect();
    let qp = q.queue();
    for (i, d) in descs.iter().enumerate() {
        qp.submit(*Sqe::new(cop::EXEC, 0).set_nsid(1), Data::Out(d), i as u64).unwrap();
    }
    qp.flush().await.unwrap();
    let (mut ends, mut done) = ([0; 3], 0);
    while done < descs.len() {
        done += qp
            .poll(|_, cqe, _| match cqe.status {
                s if s.is_success() => ends[0] += 1,
                s if s == cs::LIMIT_EXCEEDED => ends[1] += 1,
                s if s == cs::RESULTS_FULL => ends[2] += 1,
                s => panic!("a select failed otherwise: {s}"),
            })
            .await
            .unwrap();
    }
    ends
}

/// A connection, a read and a small compute command, then a disconnect.
async fn warm_up(addr: std::net::SocketAddr) {
    let c = Controller::connect(opts(addr)).await.unwrap();
    let mut q = c.io_queue(1).await.unwrap();
    q.read(1, 0, 8, BLOCK as u32).await.unwrap();
    let crc = Descriptor {
        op: by_name("crc32c").unwrap().id,
        args: vec![],
        inputs: vec![Object { len: 4096, extents: vec![Extent::data(0, 4096)] }],
        outputs: vec![],
    };
    q.compute(1, &crc.encode(), Duration::from_secs(60)).await.unwrap();
    drop(q);
    c.shutdown().await.unwrap();
}

/// 24 MiB of CSV with a unique id and a 40-byte name per row.
fn csv() -> Vec<u8> {
    let mut out = b"id,name\n".to_vec();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut i = 0u64;
    while out.len() < CSV_BYTES - 64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(format!("{i},{x:020}{:020}\n", x.rotate_left(17)).as_bytes());
        i += 1;
    }
    out.resize(CSV_BYTES - 1, b' ');
    out.push(b'\n');
    out
}

#[test]
fn peak_resident_memory_stays_within_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("target.toml");
    let disk = dir.path().join("disk.img");
    std::fs::write(
        &config,
        format!(
            "io_threads = 2\n[[listener]]\naddress = \"127.0.0.1:0\"\n[limits]\nmemory = {BUDGET}\n\
             [compute]\nthreads = 2\nmemory_per_command = {COMMAND}\ntimeout_secs = 600\n\
             [[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n\
             [[subsystem.namespace]]\nnsid = 1\npath = \"{}\"\nsize = \"128MiB\"\n",
            disk.display()
        ),
    )
    .unwrap();
    let target = common::Target::start(&["--config", config.to_str().unwrap()]);
    let pid = target.pid();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // Idle is the process once it has served a host: runtime workers, I/O rings and a
    // compute thread started, whatever the time that took.
    rt.block_on(warm_up(target.addr));
    let idle = status_kib(pid, "VmHWM:");
    let (slow, refused) = rt.block_on(async {
        let c = Controller::connect(opts(target.addr)).await.unwrap();
        let mut q = c.io_queue(1).await.unwrap();
        let data = csv();
        for (i, piece) in data.chunks(128 * 1024).enumerate() {
            q.write(1, (CSV_AT + i as u64 * 128 * 1024) / BLOCK, piece, BLOCK as u32, false).await.unwrap();
        }
        drop(q);
        c.shutdown().await.unwrap();

        let c = Controller::connect(opts(target.addr)).await.unwrap();
        let (readers, refused) = slow_readers(&c).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        eprintln!("{} slow readers: VmRSS {} MiB", readers.len(), status_kib(pid, "VmRSS:") / MIB);
        let slow = readers.len();
        drop(readers);
        c.shutdown().await.unwrap();

        let (ctrls, held) = held_results(target.addr).await;
        eprintln!("{held} results held by {} controllers: VmRSS {} MiB", ctrls.len(), status_kib(pid, "VmRSS:") / MIB);
        for (c, q) in ctrls {
            drop(q);
            c.shutdown().await.unwrap();
        }

        let c = Controller::connect(opts(target.addr)).await.unwrap();
        let mut q = c.io_queue(1).await.unwrap();
        let [ok, limited, full] = heavy_selects(&mut q).await;
        eprintln!("selects: {ok} succeeded, {limited} LIMIT_EXCEEDED, {full} RESULTS_FULL: VmRSS {} MiB", status_kib(pid, "VmRSS:") / MIB);
        assert!(ok + limited >= 2, "fewer than two selects ran");
        drop(q);
        c.shutdown().await.unwrap();
        (slow, refused)
    });
    let peak = status_kib(pid, "VmHWM:");
    eprintln!("VmHWM: idle {} MiB, peak {} MiB; budget {} MiB + slack {} MiB", idle / MIB, peak / MIB, BUDGET / MIB, SLACK / MIB);
    assert!(peak <= idle + BUDGET + SLACK, "peak resident memory {peak} bytes over idle {idle} + budget {BUDGET} + slack {SLACK}");
    // Driven to the limit: the budget refused a queue, or the reads asked for more buffers
    // than it holds (then queues waited for them).
    let asked = slow as u64 * 127 * 128 * 1024;
    assert!(refused || asked > BUDGET, "{slow} I/O queues of slow readers asked for {asked} bytes and the budget never refused one");
    assert!(slow >= 2, "only {slow} slow readers fit the budget");
}
