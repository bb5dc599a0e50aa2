//! The engine's reads counted at the device: how many of a command's operations a device
//! holds at once, against what it declares and what read-ahead allows.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use nearstore_compute::ComputeError;
use nearstore_transport::AlignedBuf;
use nearstore_wire::compute::{global, Descriptor, Extent, Object};

use super::read::{Io, NsSource, Shared};
use super::*;
use crate::backend::{Backend, FileBackend, MemoryBackend};
use crate::dev::{BlockDevice, Channel, Completion, Geometry};

/// A device that completes each read `delay` after it is submitted (other operations at
/// once), on a task, and counts the operations it holds: now and the most at once.
struct Slow {
    data: Arc<parking_lot::Mutex<Vec<u8>>>,
    depth: u32,
    delay: Duration,
    busy: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
}

impl Slow {
    fn new(data: Vec<u8>, depth: u32, delay: Duration) -> Arc<Slow> {
        Arc::new(Slow { data: Arc::new(parking_lot::Mutex::new(data)), depth, delay, busy: Arc::default(), most: Arc::default() })
    }

    fn bytes(&self, off: usize, len: usize) -> Vec<u8> {
        self.data.lock()[off..off + len].to_vec()
    }
}

impl BlockDevice for Slow {
    fn describe(&self) -> String {
        format!("slow device of queue depth {}", self.depth)
    }

    fn geometry(&self) -> Geometry {
        Geometry { size: self.data.lock().len() as u64, block_size: 512, align: 4096, queue_depth: self.depth }
    }

    fn submit(&self, ch: &mut Channel, op: Op, mut buf: AlignedBuf, tag: u64) {
        let n = self.busy.fetch_add(1, SeqCst) + 1;
        self.most.fetch_max(n, SeqCst);
        let len = buf.len();
        match op {
            Op::Read { off } => buf.copy_from_slice(&self.data.lock()[off as usize..off as usize + len]),
            Op::Write { off, .. } => self.data.lock()[off as usize..off as usize + len].copy_from_slice(&buf),
            _ => {}
        }
        ch.started_elsewhere();
        let delay = if matches!(op, Op::Read { .. }) { self.delay } else { Duration::ZERO };
        let (tx, busy) = (ch.sender(), self.busy.clone());
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            busy.fetch_sub(1, SeqCst);
            let _ = tx.send(Completion { tag, result: Ok(()), buf });
        });
    }
}

fn bytes(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 131 % 251) as u8).collect()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn io_context(rt: &tokio::runtime::Runtime) -> IoContext {
    IoContext::new(rt.handle().clone(), IoEngine::Uring, IoPool::new(1))
}

/// A merge of 63 inputs of 24 chunks each at read-ahead 16: the inputs run out of a chunk
/// together, so reads of all of them are wanted at once (1,008 at the start before the
/// merge waits). The device never holds more than it declares, nor more than the command's
/// limit, and reaches that; the output is the merge.
#[test]
fn a_device_holds_no_more_of_a_command_than_its_queue_depth() {
    const INPUTS: usize = 63;
    const CHUNK: usize = 16 << 10;
    const LEN: usize = 24 * CHUNK;
    let rt = runtime();
    let io = io_context(&rt);
    // Every input the same sorted lines; the output after them.
    let lines: Vec<u8> = (0..LEN / 8).flat_map(|k| format!("{k:07}\n").into_bytes()).collect();
    let mut data = lines.repeat(INPUTS);
    data.resize(2 * INPUTS * LEN, 0);
    let want: Vec<u8> = lines.chunks(8).flat_map(|l| l.repeat(INPUTS)).collect();
    let cfg = ComputeConfig { chunk: ByteSize(CHUNK as u64), readahead: 16, ..ComputeConfig::default() };
    let inputs: Vec<Object> =
        (0..INPUTS).map(|i| Object { len: LEN as u64, extents: vec![Extent::data((i * LEN) as u64, LEN as u64)] }).collect();
    let out = Object { len: (INPUTS * LEN) as u64, extents: vec![Extent::data((INPUTS * LEN) as u64, (INPUTS * LEN) as u64)] };
    let d = Descriptor { op: nearstore_compute::by_name("merge").unwrap().id, args: vec![], inputs, outputs: vec![out] }.encode();
    // (declared queue depth, the least and the most operations the device must reach and
    // may hold at once)
    let cases = [(4u32, 4..=4), (48, 48..=48), (1000, 49..=limits::COMPUTE_OPS_IN_FLIGHT_MAX)];
    for (depth, most) in cases {
        let slow = Slow::new(data.clone(), depth, Duration::from_millis(2));
        let mut ns = Namespace::new("nqn.2026-11.io.nearstore:t", 1, Arc::new(MemoryBackend::new(data.len() as u64)), 512);
        ns.dev = slow.clone();
        let got = execute_here(&ns, &d, &cfg, &io).unwrap_or_else(|f| panic!("depth {depth}: {}", f.message));
        let got: Vec<Outcome> = serde_json::from_slice(&got).unwrap();
        let n = (INPUTS * LEN) as u64;
        assert!(matches!(got[..], [Outcome::Merged { input, output, .. }] if input == n && output == n), "depth {depth}: {got:?}");
        assert!(slow.bytes(INPUTS * LEN, INPUTS * LEN) == want, "depth {depth}: the output is not the merge");
        let held = slow.most.load(SeqCst);
        assert!(most.contains(&held), "depth {depth}: the device held {held} operations at once, want {most:?}");
        assert_eq!(slow.busy.load(SeqCst), 0, "depth {depth}: operations left on the device");
    }
}

/// A command stopped by its deadline in the middle of its reads ends only once the device
/// has completed every one of them: counted at the device, not by the engine.
#[test]
fn a_command_stopped_mid_read_ends_after_the_device_completed_its_reads() {
    const CHUNK: u64 = 64 << 10;
    let rt = runtime();
    let io = io_context(&rt);
    let data = bytes((64 * CHUNK) as usize);
    let cfg = ComputeConfig { chunk: ByteSize(CHUNK), readahead: 4, timeout_secs: 1, ..ComputeConfig::default() };
    let inputs: Vec<Object> = (0..4).map(|i| Object { len: 16 * CHUNK, extents: vec![Extent::data(i * 16 * CHUNK, 16 * CHUNK)] }).collect();
    let d = Descriptor { op: nearstore_compute::by_name("crc32c").unwrap().id, args: vec![], inputs, outputs: vec![] }.encode();
    // Every read takes 300 ms: the deadline comes with reads on the device.
    let slow = Slow::new(data.clone(), 256, Duration::from_millis(300));
    let mut ns = Namespace::new("nqn.2026-11.io.nearstore:t", 1, Arc::new(MemoryBackend::new(data.len() as u64)), 512);
    ns.dev = slow.clone();
    let stats = ComputeStats::default();
    let peers = Arc::new(Peers::new(&ClusterConfig::default()));
    let (desc, op) = validate(&ns, &d, &cfg, &peers).unwrap();
    let r = run(&ns, op, &desc, &CancellationToken::new(), None, &cfg, &stats, (&peers, "", &io));
    assert_eq!(r.unwrap_err().status, cs::TIMEOUT);
    assert!(slow.most.load(SeqCst) > 0, "no read reached the device");
    assert_eq!(slow.busy.load(SeqCst), 0, "the command ended with reads on the device");
    assert_eq!(stats.reads_in_flight.load(Relaxed), 0);
}

/// An input on a peer is read ahead like a local one: up to the read-ahead depth at once,
/// within `cluster.read_ahead_bytes` of chunks and the peer's declared depth, counted at
/// the (delayed) peer device. Reading one chunk at a time took one delay per chunk.
#[test]
fn a_peer_input_is_read_ahead_within_read_ahead_bytes() {
    const CHUNK: usize = 64 << 10;
    const CHUNKS: usize = 12;
    let rt = runtime();
    let io = io_context(&rt);
    let data = bytes(CHUNKS * CHUNK);
    // (compute.readahead, cluster.read_ahead_bytes, the peer's queue depth, the most reads
    // of the input the peer holds at once)
    let cases = [(2usize, 4u64 << 20, 8u32, 3usize), (2, 128 << 10, 8, 2), (8, 4 << 20, 2, 2), (0, 4 << 20, 8, 1), (6, 4 << 20, 8, 7)];
    for (readahead, ahead, depth, most) in cases {
        let what = format!("readahead {readahead}, read_ahead_bytes {ahead}, peer depth {depth}");
        let peer = Slow::new(data.clone(), depth, Duration::from_millis(20));
        let cluster = ClusterConfig { read_ahead_bytes: ByteSize(ahead), ..ClusterConfig::default() };
        let peers = Arc::new(Peers::new(&cluster));
        let stats = ComputeStats::default();
        let cancel = CancellationToken::new();
        let limits = Limits { deadline: Instant::now() + Duration::from_secs(60), timeout_secs: 60, cancel: &cancel, turn: None };
        let (reads, _) = Io::start(&io, &peers, vec![], "", &stats, &limits).unwrap_or_else(|f| panic!("{what}: {}", f.message));
        let shared = Shared {
            io: std::cell::RefCell::new(reads),
            local: Arc::new(crate::dev::local::Local::new(Arc::new(MemoryBackend::new(1 << 20)))),
            ranges: Arc::default(),
            block: 512,
            remotes: [(2u16, peer.clone() as Arc<dyn BlockDevice>)].into_iter().collect(),
            peers: &peers,
            peer_failure: std::cell::RefCell::new(None),
        };
        let obj = Object { len: data.len() as u64, extents: vec![Extent::data(global::address(2, 0), data.len() as u64)] };
        let mut src = NsSource::new(&obj, CHUNK, readahead, &shared, &limits);
        let mut got = Vec::new();
        while let Some(c) = src.next_chunk().unwrap_or_else(|e: ComputeError| panic!("{what}: {e}")) {
            got.extend_from_slice(c);
        }
        drop(src);
        assert!(got == data, "{what}: the bytes read differ");
        assert_eq!(peer.most.load(SeqCst), most, "{what}: the most reads of the peer at once");
        assert_eq!(peer.busy.load(SeqCst), 0, "{what}");
    }
}

/// A command forwarded to a peer and cancelled (a Preempt and Abort, its connection gone):
/// a peer that only reads is let go at once; one writing the command's outputs is waited
/// for until it answers, so nothing it writes lands after the command has ended.
#[test]
fn a_cancelled_forward_waits_for_a_peer_that_writes() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
    for writes in [false, true] {
        let cancel = CancellationToken::new();
        let (answer, answered) = tokio::sync::oneshot::channel::<u32>();
        let (done, ended) = std::sync::mpsc::channel();
        let (handle, token) = (rt.handle().clone(), cancel.clone());
        let waiter = std::thread::spawn(move || {
            let r = wait_forwarded(&handle, &token, writes, async move { answered.await.ok() });
            done.send(()).expect("ended");
            r
        });
        cancel.cancel();
        if writes {
            // Not before the peer answers, however long that takes.
            assert!(ended.recv_timeout(Duration::from_millis(300)).is_err(), "let go of a peer still writing");
            answer.send(5).expect("answer");
        }
        ended.recv_timeout(Duration::from_secs(30)).expect("the wait ends");
        assert_eq!(waiter.join().expect("waiter"), None, "writes {writes}: a cancelled command ends cancelled");
    }
    // Not cancelled: the peer's answer is the command's.
    let (answer, answered) = tokio::sync::oneshot::channel::<u32>();
    answer.send(9).expect("answer");
    assert_eq!(wait_forwarded(rt.handle(), &CancellationToken::new(), true, async move { answered.await.ok() }), Some(Some(9)));
}

/// Compute commands on a file namespace read through its I/O task (a delay stacked on it:
/// a bare file is read with a pread, not on the ring), one after another, take the task's
/// io_uring from the target's pool: many commands make one ring (each made its own
/// before), counted where rings are made. A command cancelled while its reads ran does not
/// give its ring back: the next command makes a new one.
#[test]
fn sequential_compute_commands_reuse_a_ring_but_not_a_cancelled_ones() {
    const CHUNK: u64 = 64 << 10;
    const LEN: u64 = 16 * CHUNK;
    let rt = runtime();
    let io = io_context(&rt);
    let dir = tempfile::tempdir().unwrap();
    let file = Arc::new(FileBackend::open(&dir.path().join("ns"), Some(LEN)).unwrap());
    let data = bytes(LEN as usize);
    file.write_at(&data, 0).unwrap();
    let mut ns = Namespace::new("nqn.2026-11.io.nearstore:t", 1, file, 512);
    ns.dev = crate::dev::stack(ns.dev.clone(), None, 1);
    assert!(!read::reads_here(&*ns.dev), "a delayed device is read through the I/O task");
    let cfg = ComputeConfig { chunk: ByteSize(CHUNK), readahead: 4, ..ComputeConfig::default() };
    let input = Object { len: LEN, extents: vec![Extent::data(0, LEN)] };
    let d =
        Descriptor { op: nearstore_compute::by_name("crc32c").unwrap().id, args: vec![], inputs: vec![input], outputs: vec![] }.encode();
    let want = format!("{:08x}", crc32c::crc32c(&data));
    let command = |what: &str| {
        let got = execute_here(&ns, &d, &cfg, &io).unwrap_or_else(|f| panic!("{what}: {}", f.message));
        assert!(String::from_utf8_lossy(&got).contains(&want), "{what}: {}", String::from_utf8_lossy(&got));
    };
    let commands = 2 * limits::COMPUTE_RINGS_IDLE_MAX + 1;
    for i in 0..commands {
        command(&format!("command {i}"));
    }
    assert_eq!((io.rings.created(), io.rings.idle()), (1, 1), "rings made and idle after {commands} commands in a row");

    // A command reads, then its connection goes: its ring (the idle one) is not kept.
    let cancel = CancellationToken::new();
    let stats = ComputeStats::default();
    let peers = Arc::new(Peers::new(&ClusterConfig::default()));
    let limits = Limits { deadline: Instant::now() + Duration::from_secs(60), timeout_secs: 60, cancel: &cancel, turn: None };
    let (mut reads, _) = Io::start(&io, &peers, vec![], "", &stats, &limits).unwrap_or_else(|f| panic!("{}", f.message));
    let mut buf = AlignedBuf::new(CHUNK as usize);
    buf.set_len(CHUNK as usize);
    let tag = reads.submit(&ns.dev, Op::Read { off: 0 }, buf).unwrap();
    let c = reads.take(tag, Duration::from_secs(10)).unwrap().expect("the read completes");
    assert!(c.result.is_ok() && c.buf[..] == data[..CHUNK as usize], "the cancelled command's read");
    assert_eq!(io.rings.idle(), 0, "the cancelled command took the idle ring");
    cancel.cancel();
    drop(reads);
    assert_eq!((io.rings.created(), io.rings.idle()), (1, 0), "the cancelled command's ring is not kept");
    command("the command after the cancelled one");
    assert_eq!((io.rings.created(), io.rings.idle()), (2, 1), "the next command made a ring");
}

/// A namespace of `data` in memory or in a file (kept in `dir`), its device read without
/// a channel ([`read::reads_here`]).
fn namespace(data: &[u8], file: bool, dir: &tempfile::TempDir) -> Namespace {
    let backend: Arc<dyn Backend> = if file {
        Arc::new(FileBackend::open(&dir.path().join("ns"), Some(data.len() as u64)).unwrap())
    } else {
        Arc::new(MemoryBackend::new(data.len() as u64))
    };
    backend.write_at(data, 0).unwrap();
    let ns = Namespace::new("nqn.2026-11.io.nearstore:t", 1, backend, 512);
    assert!(read::reads_here(&*ns.dev), "file {file}: the namespace's device needs a channel");
    ns
}

fn crc32c_of(ns: &Namespace, off: u64, len: u64, cfg: &ComputeConfig, io: &IoContext) -> Result<String, Failure> {
    // Whole blocks: the object's last one is cut short.
    let extents = if len == 0 { vec![] } else { vec![Extent::data(off, len.div_ceil(512) * 512)] };
    let input = Object { len, extents };
    let d =
        Descriptor { op: nearstore_compute::by_name("crc32c").unwrap().id, args: vec![], inputs: vec![input], outputs: vec![] }.encode();
    execute_here(ns, &d, cfg, io).map(|r| String::from_utf8_lossy(&r).into_owned())
}

/// A namespace's own memory or plain file is read without the I/O task: ahead on the
/// command's reader thread (a core to spare), or on the command's thread. Either way the
/// checksum of an object of every length around the chunk and the read-ahead window (from
/// a block past the start) is the local one, and no read of the file reached the ring.
#[test]
fn reads_without_a_channel_equal_the_bytes_at_edge_lengths() {
    const CHUNK: u64 = 16 << 10;
    const READAHEAD: usize = 2;
    const OFF: u64 = 512;
    let window = (READAHEAD as u64 + 1) * CHUNK;
    let lens = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK, window, window + 1, 4 * window + CHUNK - 1];
    let data = bytes((5 * window) as usize);
    let rt = runtime();
    let cfg = ComputeConfig { chunk: ByteSize(CHUNK), readahead: READAHEAD, ..ComputeConfig::default() };
    for file in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let ns = namespace(&data, file, &dir);
        for reader in [false, true] {
            let io = IoContext { reader, ..io_context(&rt) };
            for len in lens {
                let what = format!("file {file}, reader {reader}, length {len}");
                let got = crc32c_of(&ns, OFF, len, &cfg, &io).unwrap_or_else(|f| panic!("{what}: {}", f.message));
                let want = format!("\"{:08x}\"", crc32c::crc32c(&data[OFF as usize..(OFF + len) as usize]));
                assert!(got.contains(&want), "{what}: {got}, want {want}");
            }
            assert_eq!(io.rings.created(), 0, "file {file}, reader {reader}: reads went to the I/O task's ring");
        }
    }
}

/// A command cancelled in the middle of an input ends cancelled with none of its reads in
/// flight: with a reader thread, which had read ahead, once the reader has completed them;
/// without, nothing was ever in flight (its thread read each chunk when it wanted it).
#[test]
fn a_command_cancelled_mid_input_leaves_no_read_in_flight() {
    const CHUNK: usize = 16 << 10;
    const READAHEAD: usize = 4;
    let data = bytes(16 * CHUNK);
    let rt = runtime();
    for file in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let ns = namespace(&data, file, &dir);
        for reader in [false, true] {
            let what = format!("file {file}, reader {reader}");
            let io = IoContext { reader, ..io_context(&rt) };
            let cancel = CancellationToken::new();
            let stats = ComputeStats::default();
            let peers = Arc::new(Peers::new(&ClusterConfig::default()));
            let limits = Limits { deadline: Instant::now() + Duration::from_secs(60), timeout_secs: 60, cancel: &cancel, turn: None };
            let (reads, _) = Io::start(&io, &peers, vec![], "", &stats, &limits).unwrap_or_else(|f| panic!("{what}: {}", f.message));
            let shared = Shared {
                io: std::cell::RefCell::new(reads),
                local: ns.dev.clone(),
                ranges: Arc::default(),
                block: 512,
                remotes: Default::default(),
                peers: &peers,
                peer_failure: std::cell::RefCell::new(None),
            };
            let obj = Object { len: data.len() as u64, extents: vec![Extent::data(0, data.len() as u64)] };
            let mut src = NsSource::new(&obj, CHUNK, READAHEAD, &shared, &limits);
            let first = src.next_chunk().unwrap_or_else(|e| panic!("{what}: {e}")).map(|c| c.to_vec());
            assert!(first.as_deref() == Some(&data[..CHUNK]), "{what}: the first chunk");
            // Taken: the first; read ahead and not taken: the rest of the window.
            let ahead = if reader { READAHEAD as u64 } else { 0 };
            assert_eq!(stats.reads_in_flight.load(Relaxed), ahead, "{what}: reads in flight after the first chunk");
            cancel.cancel();
            assert!(matches!(src.next_chunk(), Err(ComputeError::Cancelled)), "{what}: not cancelled");
            drop(src);
            drop(shared);
            assert_eq!(stats.reads_in_flight.load(Relaxed), 0, "{what}: reads left in flight");
        }
    }
}

/// A read failing in the middle of an input (an injected EIO in its fourth chunk) fails the
/// command with Unrecovered Read Error naming the namespace byte, on the reader thread or
/// the command's; the chunks before it were read.
#[test]
fn a_device_error_mid_input_fails_the_command_at_its_byte() {
    const CHUNK: u64 = 16 << 10;
    let data = bytes((16 * CHUNK) as usize);
    let rt = runtime();
    let cfg = ComputeConfig { chunk: ByteSize(CHUNK), readahead: 2, ..ComputeConfig::default() };
    for file in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let mut ns = namespace(&data, file, &dir);
        let rule = crate::dev::inject::Rule {
            kind: Some(crate::dev::inject::Kind::Read),
            range: Some((3 * CHUNK + 100, 3 * CHUNK + 101)),
            nth: None,
            errno: libc::EIO,
        };
        ns.dev = Arc::new(crate::dev::inject::Inject::new(ns.dev.clone(), rule));
        assert!(read::reads_here(&*ns.dev), "file {file}: the failing device needs a channel");
        for reader in [false, true] {
            let what = format!("file {file}, reader {reader}");
            let io = IoContext { reader, ..io_context(&rt) };
            let f = crc32c_of(&ns, 0, data.len() as u64, &cfg, &io).expect_err(&what);
            assert_eq!(f.status, Status::UNRECOVERED_READ_ERROR.dnr(), "{what}: {}", f.message);
            let at = format!("reading {CHUNK} bytes at namespace byte {}", 3 * CHUNK);
            assert!(f.message.contains(&at), "{what}: {}, want {at}", f.message);
            // Before it, the same object reads.
            let got = crc32c_of(&ns, 0, 3 * CHUNK, &cfg, &io).unwrap_or_else(|f| panic!("{what}: {}", f.message));
            assert!(got.contains(&format!("{:08x}", crc32c::crc32c(&data[..(3 * CHUNK) as usize]))), "{what}: {got}");
        }
    }
}

/// A compute thread lowers its own priority to `compute.nice`, never raises it, and no
/// other thread of the target changes.
#[test]
fn a_compute_thread_lowers_only_its_own_priority() {
    fn nice() -> i32 {
        // SAFETY: gettid takes nothing; getpriority reads this thread's nice value.
        unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
    }
    let ours = nice();
    let theirs = std::thread::spawn(move || {
        lower_priority(ours + 5);
        let lowered = nice();
        lower_priority(ours + 1);
        (lowered, nice())
    })
    .join()
    .unwrap();
    // 19 is the lowest priority: asked for more, a thread gets 19.
    let lowered = (ours + 5).min(19);
    assert_eq!(theirs, (lowered, lowered), "lowered to its nice value, not raised again");
    assert_eq!(nice(), ours, "the calling thread only");
}

/// A command forwarded to a peer's pool with an output, given up by the exporter before the
/// peer answered (its time limit at the exporter passed), ends only once the peer's command
/// has ended: its controller at the peer is reset first (offload/volume.rs, `on_peer`).
/// Before, it ended at once while the peer went on reading and writing its output, which a
/// move waiting for the command's extents then raced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_command_given_up_ends_after_the_peers_command() {
    const MEMBER: &str = "nqn.2026-11.io.nearstore:member-a";
    let dir = tempfile::tempdir().unwrap();
    let cfg = crate::config::Config::from_toml(&format!(
        r#"
        control = "127.0.0.1:9"
        [[listener]]
        address = "127.0.0.1:0"
        [cluster]
        trusted_members = ["{MEMBER}"]
        [[pool]]
        path = "{}/pool0"
        size = "8MiB"
        rate_limit = "2MiB"
        "#,
        dir.path().display()
    ))
    .unwrap();
    let peer = crate::Target::from_config(&cfg).unwrap();
    let addr = peer.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    let mib = 1u64 << 20;
    // A copy of 1 MiB to the pool's third MiB, through a device of 2 MiB/s: about a second.
    let copy = nearstore_compute::by_name("copy").unwrap();
    let desc = Descriptor {
        op: copy.id,
        args: vec![],
        inputs: vec![Object { len: mib, extents: vec![Extent::data(0, mib)] }],
        outputs: vec![Object { len: mib, extents: vec![Extent::data(2 * mib, mib)] }],
    };
    let running = || peer.offload.stats.running.load(std::sync::atomic::Ordering::Relaxed);
    let pool = Arc::new(crate::dev::volume::PoolRef { target: addr.to_string(), nsid: 1 });
    let t = std::time::Instant::now();
    let r = volume::on_peer(pool, desc, MEMBER.into(), Duration::from_secs(5), Duration::from_millis(200)).await;
    let e = r.expect_err("given up after 200 ms");
    assert_eq!(e.status, nearstore_wire::compute::status::PEER_FAILED, "{}", e.message);
    assert_eq!(running(), 0, "the peer's command ended before the forwarded one did ({:?}): {}", t.elapsed(), e.message);
    assert!(!e.message.contains("may still be written"), "{}", e.message);
}

/// A command waiting for a read's completion does not hold its turn to compute: with one
/// turn, another tenant's command takes it meanwhile, and the waiting command holds a turn
/// again when its wait is over. Before, a command waiting on a slow device or peer kept
/// the engine from every other command.
#[test]
fn a_command_waiting_for_its_reads_lets_others_compute() {
    use crate::tenant::{TenantId, TenantPolicy};
    let cpu = crate::sched::Cpu::new(1);
    let policy = |id| Arc::new(TenantPolicy::unrestricted(TenantId(id), &format!("t{id}"), 100, 100));
    let waiting = cpu.turn(1, policy(50));
    assert!(waiting.take(&|| false));
    let cancel = CancellationToken::new();
    let limits =
        Limits { deadline: std::time::Instant::now() + Duration::from_secs(60), timeout_secs: 60, cancel: &cancel, turn: Some(&waiting) };
    let computed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let other = cpu.turn(2, policy(51));
    let t = std::thread::spawn({
        let computed = computed.clone();
        move || {
            assert!(other.take(&|| false));
            computed.store(true, SeqCst);
        }
    });
    // The wait: until the other command has computed, or 10 s.
    let during = limits
        .without_turn(|| {
            let start = std::time::Instant::now();
            while !computed.load(SeqCst) && start.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(1));
            }
            computed.load(SeqCst)
        })
        .unwrap();
    if !during {
        // Let the other command go before failing, so that the test fails, not hangs.
        drop(limits);
        drop(waiting);
        t.join().unwrap();
        panic!("the other command did not compute while this one waited for its read");
    }
    t.join().unwrap();
    assert_eq!(cpu.waiting(), 0);
    // It holds a turn again: another command now waits for it.
    let third = cpu.turn(3, policy(52));
    let w = std::thread::spawn(move || third.take(&|| false));
    while cpu.waiting() == 0 {
        std::thread::yield_now();
    }
    drop(waiting);
    assert!(w.join().unwrap());
}

/// The same through a whole command: a crc32c over a device whose every read takes 500 ms,
/// holding the only turn to compute when it starts, lets another tenant's command take the
/// turn while its reads are on the device, and still computes the right checksum. The
/// other tenant is far ahead in virtual runtime, so no check of the first command hands it
/// the turn: before, it waited for the whole command.
#[test]
fn a_command_on_a_slow_device_does_not_hold_the_turn_while_it_reads() {
    use crate::tenant::{TenantId, TenantPolicy};
    const CHUNK: u64 = 64 << 10;
    let rt = runtime();
    let io = io_context(&rt);
    let data = bytes((6 * CHUNK) as usize);
    let cfg = ComputeConfig { chunk: ByteSize(CHUNK), readahead: 0, ..ComputeConfig::default() };
    let input = Object { len: 6 * CHUNK, extents: vec![Extent::data(0, 6 * CHUNK)] };
    let d =
        Descriptor { op: nearstore_compute::by_name("crc32c").unwrap().id, args: vec![], inputs: vec![input], outputs: vec![] }.encode();
    let slow = Slow::new(data.clone(), 16, Duration::from_millis(500));
    let mut ns = Namespace::new("nqn.2026-11.io.nearstore:t", 1, Arc::new(MemoryBackend::new(data.len() as u64)), 512);
    ns.dev = slow.clone();
    let cpu = crate::sched::Cpu::new(1);
    let policy = |id| Arc::new(TenantPolicy::unrestricted(TenantId(id), &format!("t{id}"), 100, 100));
    cpu.charge(TenantId(61), 100, 10_000_000_000);
    let reading = Arc::new(cpu.turn(1, policy(60)));
    assert!(reading.take(&|| false));
    let peers = Arc::new(Peers::new(&ClusterConfig::default()));
    let (desc, op) = validate(&ns, &d, &cfg, &peers).unwrap();
    let command = std::thread::spawn({
        let reading = reading.clone();
        move || {
            let stats = ComputeStats::default();
            let r = run(&ns, op, &desc, &CancellationToken::new(), Some(&reading), &cfg, &stats, (&peers, "", &io));
            reading.give_back();
            r
        }
    });
    // Another tenant's command, once the first has a read on the device: it gets the turn
    // within one read's time, long before the first's six reads (3 s) are done.
    while slow.busy.load(SeqCst) == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let other = cpu.turn(2, policy(61));
    let asked = std::time::Instant::now();
    assert!(other.take(&|| false));
    let waited = asked.elapsed();
    let still_running = !command.is_finished();
    drop(other);
    let got = command.join().unwrap().unwrap_or_else(|f| panic!("{}", f.message));
    assert!(still_running && waited < Duration::from_millis(1500), "the other command waited {waited:?} for the turn");
    let got: Vec<Outcome> = serde_json::from_slice(&got).unwrap();
    assert_eq!(got, vec![nearstore_compute::run("crc32c", b"", [&data[..]]).unwrap()]);
}
