//! Device stacks under namespaces, seen from a host: a failing device gives the NVMe status
//! and the error log entry the specification defines, on both I/O engines.

mod common;

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nearstore_initiator::{ConnectOptions, Controller, Data};
use nearstore_target::backend::FileBackend;
use nearstore_target::config::Config;
use nearstore_target::dev::delay::Delay;
use nearstore_target::dev::{BlockDevice, Channel, Geometry, Op};
use nearstore_target::subsystem::Namespace;
use nearstore_target::Target;
use nearstore_transport::AlignedBuf;
use nearstore_wire::fused::opcode as fop;
use nearstore_wire::log::ErrorEntry;
use nearstore_wire::opcode::{io, lid};
use nearstore_wire::{Sqe, Status};

const NQN: &str = "nqn.2026-11.io.nearstore:devices";
const BLOCK: u64 = 4096;

/// A target whose namespaces fail every operation touching LBAs [16, 32): memory (1), a
/// file (2), and a file under a delay of 500 us (3).
async fn start(engine: &str, dir: &tempfile::TempDir) -> (Arc<Target>, Controller) {
    common::init_logs();
    let inject = "[subsystem.namespace.inject]\nlbas = [16, 32]";
    let cfg = format!(
        r#"
        io_engine = "{engine}"
        [[listener]]
        address = "127.0.0.1:0"
        [[subsystem]]
        nqn = "{NQN}"
        allow_any_host = true
        [[subsystem.namespace]]
        nsid = 1
        memory = "4MiB"
        block_size = {BLOCK}
        {inject}
        [[subsystem.namespace]]
        nsid = 2
        path = "{d}/a.img"
        size = "4MiB"
        block_size = {BLOCK}
        {inject}
        [[subsystem.namespace]]
        nsid = 3
        path = "{d}/b.img"
        size = "4MiB"
        block_size = {BLOCK}
        delay_us = 500
        {inject}
        "#,
        d = dir.path().display()
    );
    let target = Target::from_config(&Config::from_toml(&cfg).unwrap()).unwrap();
    let addr = target.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    let c = Controller::connect(ConnectOptions::new(addr, NQN)).await.unwrap();
    (target, c)
}

#[tokio::test]
async fn a_failed_read_or_write_reaches_the_host_and_the_error_log() {
    // (what, opcode, slba, blocks, status)
    let cases: &[(&str, u8, u64, u32, Status)] = &[
        ("read inside", io::READ, 16, 1, Status::UNRECOVERED_READ_ERROR),
        ("read across the start", io::READ, 12, 8, Status::UNRECOVERED_READ_ERROR),
        ("large read across the end", io::READ, 31, 32, Status::UNRECOVERED_READ_ERROR),
        ("read before", io::READ, 0, 16, Status::SUCCESS),
        ("read after", io::READ, 32, 32, Status::SUCCESS),
        ("in-capsule write inside", io::WRITE, 20, 1, Status::WRITE_FAULT),
        ("large write (R2T) across the start", io::WRITE, 0, 17, Status::WRITE_FAULT),
        ("write after", io::WRITE, 32, 2, Status::SUCCESS),
        // READ CHECKSUM reads through the device stack like Read (before, it read the
        // backend beneath the stack: the failing device passed it by).
        ("read checksum inside", fop::READ_CHECKSUM, 16, 1, Status::UNRECOVERED_READ_ERROR),
        ("read checksum across the end", fop::READ_CHECKSUM, 31, 2, Status::UNRECOVERED_READ_ERROR),
        ("read checksum after", fop::READ_CHECKSUM, 32, 2, Status::SUCCESS),
        // So does Compare (before, it too read the backend beneath the stack). "write after"
        // left 0x5a in blocks 32 and 33, which it compares equal.
        ("compare inside", io::COMPARE, 16, 1, Status::UNRECOVERED_READ_ERROR),
        ("compare across the end", io::COMPARE, 31, 2, Status::UNRECOVERED_READ_ERROR),
        ("compare after", io::COMPARE, 32, 2, Status::SUCCESS),
    ];
    for engine in ["uring", "threads"] {
        let dir = tempfile::tempdir().unwrap();
        let (target, c) = start(engine, &dir).await;
        let mut ioq = c.io_queue(1).await.unwrap();
        let mut errors = 0;
        for nsid in 1..=3u32 {
            for &(what, opcode, slba, blocks, want) in cases {
                let what = format!("{engine}, nsid {nsid}, {what}");
                let len = blocks as usize * BLOCK as usize;
                let data = vec![0x5a; len];
                let sqe = Sqe::rw(opcode, nsid, slba, blocks, false);
                // Bits 1:0 of the opcode: 10b controller to host.
                let d = if opcode & 3 == 2 { Data::In(len) } else { Data::Out(&data) };
                let q = ioq.queue();
                let cid = q.submit(sqe, d, 0).unwrap_or_else(|e| panic!("{what}: {e}"));
                let cqe = q.wait(cid, |_, _, _| {}).await.unwrap();
                assert_eq!((cqe.status.sct, cqe.status.sc), (want.sct, want.sc), "{what}: got {}", cqe.status);
                if want.is_success() {
                    continue;
                }
                assert!(!cqe.status.dnr, "{what}: a media error may succeed when retried");
                errors += 1;
                let log = c.get_log(lid::ERROR_INFORMATION, 0, 64, 0).await.unwrap();
                let e = ErrorEntry::decode(&log);
                assert_eq!(Status::from_field(e.status), want, "{what}: error log status");
                assert_eq!((e.sqid, e.cid, e.nsid, e.lba), (1, cid, nsid, slba), "{what}: error log entry names the command");
                assert!(e.error_count >= errors, "{what}: error count {} after {errors} failures", e.error_count);
            }
        }
        // A Compare and Write reads and writes through the stack too: inside the failing
        // range its Compare fails with the device's status and its Write is not done; after
        // it, the pair writes (and a second pair sees the first's blocks).
        for nsid in 1..=3u32 {
            let what = format!("{engine}, nsid {nsid}, compare and write");
            let (old, new) = (vec![0x5a; BLOCK as usize], vec![0xa5; BLOCK as usize]);
            let r = ioq.compare_and_write(nsid, 16, &old, &new, BLOCK as u32, false).await.unwrap();
            assert!(same(r.compare, Status::UNRECOVERED_READ_ERROR) && same(r.write, Status::ABORTED_FAILED_FUSED), "{what} inside: {r:?}");
            let r = ioq.compare_and_write(nsid, 32, &old, &new, BLOCK as u32, true).await.unwrap();
            assert!(r.written(), "{what} after: {r:?}");
            let r = ioq.compare_and_write(nsid, 32, &old, &new, BLOCK as u32, false).await.unwrap();
            assert!(r.differed(), "{what} after, again: {r:?}");
            assert_eq!(ioq.read(nsid, 32, 1, BLOCK as u32).await.unwrap(), new, "{what}: the pair's write");
        }
        // The queue still serves outside the failing range.
        let back = ioq.read(1, 40, 1, BLOCK as u32).await.unwrap();
        assert_eq!(back.len(), BLOCK as usize);
        assert_eq!(target.stats.requests_lost.load(Relaxed), 0, "{engine}: every command completed");
    }
}

/// A Compare and Write whose Write the device fails (its read does not): the Compare
/// completes with Command Aborted due to Failed Fused Command and the Write with the
/// device's Write Fault, on both engines and a memory and a file namespace; the blocks stay
/// as they were (the write is what failed) and the next pair on them runs.
#[tokio::test]
async fn a_pair_whose_write_fails_reports_write_fault() {
    for engine in ["uring", "threads"] {
        let dir = tempfile::tempdir().unwrap();
        let inject = "[subsystem.namespace.inject]\nop = \"write\"\nlbas = [16, 32]\nnth = 1";
        let cfg = format!(
            "io_engine = \"{engine}\"\n[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n\
             [[subsystem.namespace]]\nnsid = 1\nmemory = \"4MiB\"\nblock_size = {BLOCK}\n{inject}\n\
             [[subsystem.namespace]]\nnsid = 2\npath = \"{}\"\nsize = \"4MiB\"\nblock_size = {BLOCK}\n{inject}\n",
            dir.path().join("a.img").display()
        );
        let target = Target::from_config(&Config::from_toml(&cfg).unwrap()).unwrap();
        let addr = target.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
        let c = Controller::connect(ConnectOptions::new(addr, NQN)).await.unwrap();
        let mut q = c.io_queue(1).await.unwrap();
        for nsid in 1..=2u32 {
            let what = format!("{engine}, nsid {nsid}");
            let (zeros, new) = (vec![0u8; BLOCK as usize], vec![0xa5; BLOCK as usize]);
            // The first write into the range fails (nth = 1): this pair's.
            let r = q.compare_and_write(nsid, 20, &zeros, &new, BLOCK as u32, false).await.unwrap();
            assert!(same(r.compare, Status::ABORTED_FAILED_FUSED) && same(r.write, Status::WRITE_FAULT), "{what}: {r:?}");
            assert_eq!(q.read(nsid, 20, 1, BLOCK as u32).await.unwrap(), zeros, "{what}: nothing written");
            // Only the first failed: the same pair again writes.
            let r = q.compare_and_write(nsid, 20, &zeros, &new, BLOCK as u32, false).await.unwrap();
            assert!(r.written(), "{what}, again: {r:?}");
            assert_eq!(q.read(nsid, 20, 1, BLOCK as u32).await.unwrap(), new, "{what}: the second pair's write");
        }
        assert_eq!(target.stats.requests_lost.load(Relaxed), 0, "{engine}: every command completed");
    }
}

fn same(a: Status, b: Status) -> bool {
    (a.sct, a.sc, a.dnr) == (b.sct, b.sc, b.dnr)
}

/// A device that counts the operations submitted to it, then passes them on.
struct Counted {
    base: Arc<dyn BlockDevice>,
    submitted: AtomicU64,
}

impl BlockDevice for Counted {
    fn describe(&self) -> String {
        format!("{} (counted)", self.base.describe())
    }
    fn geometry(&self) -> Geometry {
        self.base.geometry()
    }
    fn submit(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64) {
        self.submitted.fetch_add(1, Relaxed);
        self.base.submit(ch, op, buf, tag);
    }
}

/// A queue that closes while its commands are on a device counts them as unfinished, and
/// loses none (nothing dropped without completion). The reads go to a file namespace
/// delayed by 2 s, under a device that tells when all four are on it.
#[tokio::test]
async fn a_queue_closed_with_commands_outstanding_counts_them() {
    for engine in ["uring", "threads"] {
        let dir = tempfile::tempdir().unwrap();
        let (target, c) = start(engine, &dir).await;
        let file = FileBackend::open(&dir.path().join("c.img"), Some(4 << 20)).unwrap();
        let mut ns = Namespace::new(NQN, 4, Arc::new(file), BLOCK as u32);
        let counted =
            Arc::new(Counted { base: Arc::new(Delay::new(ns.dev.clone(), Duration::from_secs(2))), submitted: AtomicU64::new(0) });
        ns.dev = counted.clone();
        target.subsystem(NQN).unwrap().add_namespace(ns).unwrap();
        let mut ioq = c.io_queue(1).await.unwrap();
        let q = ioq.queue();
        for i in 0..4 {
            q.submit(Sqe::rw(io::READ, 4, 64 + i, 1, false), Data::In(BLOCK as usize), 0).unwrap();
        }
        q.flush().await.unwrap();
        // Once the reads are on the device, close both queues.
        let t = Instant::now();
        while counted.submitted.load(Relaxed) < 4 {
            assert!(t.elapsed() < Duration::from_secs(10), "{engine}: the reads never reached the device");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        drop(ioq);
        drop(c);
        let s = &target.stats;
        let t = Instant::now();
        while s.requests_unfinished.load(Relaxed) < 4 && t.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(s.requests_unfinished.load(Relaxed), 4, "{engine}: the four reads were outstanding at close");
        assert_eq!(s.requests_lost.load(Relaxed), 0, "{engine}: none lost");
    }
}
