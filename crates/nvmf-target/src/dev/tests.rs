use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nearstore_transport::AlignedBuf;
use parking_lot::Mutex;

use super::inject::{Inject, Kind, Rule};
use super::local::Local;
use super::*;
use crate::backend::{FileBackend, MemoryBackend};

const SIZE: u64 = 8 << 20;

fn buf(len: usize) -> AlignedBuf {
    let mut b = AlignedBuf::new(len);
    b.set_len(len);
    b
}

fn filled(len: usize, seed: u8) -> AlignedBuf {
    let mut b = buf(len);
    b.iter_mut().enumerate().for_each(|(i, x)| *x = (i as u8).wrapping_mul(31).wrapping_add(seed));
    b
}

fn ranges(rs: &[(u64, u64)]) -> AlignedBuf {
    let mut b = buf(rs.len() * 16);
    for (i, (off, len)) in rs.iter().enumerate() {
        b[i * 16..i * 16 + 8].copy_from_slice(&off.to_le_bytes());
        b[i * 16 + 8..i * 16 + 16].copy_from_slice(&len.to_le_bytes());
    }
    b
}

/// The devices under test: name, device, the engine of its channel. The temporary
/// directory lives as long as the files in it are used.
fn devices(dir: &tempfile::TempDir) -> Vec<(&'static str, Arc<dyn BlockDevice>, IoEngine)> {
    let file = |name: &str| -> Arc<dyn BlockDevice> {
        Arc::new(Local::new(Arc::new(FileBackend::open(&dir.path().join(name), Some(SIZE)).unwrap())))
    };
    let memory = || -> Arc<dyn BlockDevice> { Arc::new(Local::new(Arc::new(MemoryBackend::new(SIZE)))) };
    let never = Rule { kind: Some(Kind::Read), range: Some((SIZE - 1, SIZE)), nth: None, errno: libc::EIO };
    vec![
        ("memory", memory(), IoEngine::Uring),
        ("file on io_uring", file("a"), IoEngine::Uring),
        ("file on the pool", file("b"), IoEngine::Threads),
        ("delay over memory", Arc::new(delay::Delay::new(memory(), Duration::from_millis(1))), IoEngine::Uring),
        ("delay over file", Arc::new(delay::Delay::new(file("c"), Duration::from_millis(1))), IoEngine::Uring),
        ("inject (nothing matches) over file", Arc::new(Inject::new(file("d"), never.clone())), IoEngine::Uring),
        ("inject (nothing matches) over memory", Arc::new(Inject::new(memory(), never)), IoEngine::Threads),
    ]
}

/// Every operation through `Channel::run` (the future), on every device.
#[tokio::test]
async fn every_device_does_every_operation() {
    let dir = tempfile::tempdir().unwrap();
    let pool = IoPool::new(2);
    for (name, dev, engine) in devices(&dir) {
        let mut ch = Channel::new(engine, pool.clone());
        assert_eq!(dev.geometry().size, SIZE, "{name}");
        // Crosses the memory backend's 1 MiB stripe border.
        let off = (1 << 20) - 4096;
        let data = filled(3 * 4096, 7);
        let c = ch.run(&*dev, Op::Write { off, fua: true }, data).await;
        assert!(c.result.is_ok(), "{name}: write: {:?}", c.result);
        let written = c.buf;
        let c = ch.run(&*dev, Op::Read { off }, buf(3 * 4096)).await;
        assert!(c.result.is_ok(), "{name}: read: {:?}", c.result);
        assert_eq!(&c.buf[..], &written[..], "{name}: read back");
        assert!(ch.run(&*dev, Op::Flush, buf(0)).await.result.is_ok(), "{name}: flush");
        let zeroes = Op::WriteZeroes { off: off + 4096, len: 4096, deallocate: false, fua: true };
        assert!(ch.run(&*dev, zeroes, buf(0)).await.result.is_ok(), "{name}: write zeroes");
        assert!(ch.run(&*dev, Op::Deallocate, ranges(&[(off, 4096), (0, 0)])).await.result.is_ok(), "{name}: deallocate");
        let c = ch.run(&*dev, Op::Read { off }, buf(3 * 4096)).await;
        assert!(c.buf[..8192].iter().all(|&b| b == 0), "{name}: zeroed and deallocated blocks read as zeros");
        assert_eq!(&c.buf[8192..], &written[8192..], "{name}: the block after them is kept");
        let c = ch.run(&*dev, Op::Read { off: SIZE - 4096 }, buf(8192)).await;
        assert!(c.result.is_err(), "{name}: a read past the end fails");
        let c = ch.run(&*dev, Op::Write { off: u64::MAX - 5, fua: false }, buf(4096)).await;
        assert!(c.result.is_err(), "{name}: a write at an overflowing offset fails");
        assert!(!ch.busy(), "{name}: nothing left outstanding");
    }
}

/// Many operations at once, completions taken by polling: each comes back exactly once,
/// with its own buffer.
#[tokio::test]
async fn a_batch_completes_each_operation_once() {
    let dir = tempfile::tempdir().unwrap();
    let pool = IoPool::new(2);
    for (name, dev, engine) in devices(&dir) {
        let mut ch = Channel::new(engine, pool.clone());
        const N: u64 = 64;
        for i in 0..N {
            dev.submit(&mut ch, Op::Write { off: i * 4096, fua: false }, filled(4096, i as u8), i);
        }
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        while seen.len() < N as usize {
            if ch.poll(limits::REAP_BATCH, &mut out) == 0 {
                ch.wait().await.unwrap();
            }
            assert!(out.len() <= limits::REAP_BATCH, "{name}: poll takes at most what it is asked for");
            for c in out.drain(..) {
                assert!(c.result.is_ok(), "{name}: {:?}", c.result);
                assert_eq!(c.buf[0], (c.tag as u8).wrapping_add(0), "{name}: the buffer of its own operation");
                assert!(seen.insert(c.tag), "{name}: tag {} completed twice", c.tag);
            }
        }
        for i in 0..N {
            dev.submit(&mut ch, Op::Read { off: i * 4096 }, buf(4096), N + i);
        }
        let mut back = 0;
        while back < N {
            if ch.poll(usize::MAX, &mut out) == 0 {
                ch.wait().await.unwrap();
            }
            for c in out.drain(..) {
                assert!(c.result.is_ok(), "{name}: {:?}", c.result);
                assert_eq!(&c.buf[..], &filled(4096, (c.tag - N) as u8)[..], "{name}: read {}", c.tag - N);
                back += 1;
            }
        }
        assert!(!ch.busy() && !ch.has_completions(), "{name}");
    }
}

/// A memory backend that records the thread each operation ran on.
struct Recording {
    mem: MemoryBackend,
    threads: Mutex<Vec<(&'static str, String)>>,
}

impl Recording {
    fn note(&self, what: &'static str) {
        let t = std::thread::current().name().unwrap_or("").to_string();
        self.threads.lock().push((what, t));
    }
}

impl Backend for Recording {
    fn describe(&self) -> String {
        "recording".into()
    }
    fn size(&self) -> u64 {
        self.mem.size()
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.note("read");
        self.mem.read_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        self.note("write");
        self.mem.write_at(buf, off)
    }
    fn with_slices(&self, off: u64, len: usize, f: &mut dyn FnMut(&[&[u8]])) -> Option<io::Result<()>> {
        self.note("read");
        self.mem.with_slices(off, len, f)
    }
    fn flush(&self) -> io::Result<()> {
        self.note("flush");
        Ok(())
    }
    fn write_zeroes(&self, off: u64, len: u64, deallocate: bool) -> io::Result<()> {
        self.note(if deallocate { "deallocate" } else { "write zeroes" });
        self.mem.write_zeroes(off, len, deallocate)
    }
    fn inline(&self) -> bool {
        true
    }
}

/// Reads, writes and flushes of memory run on the caller's thread; write zeroes and
/// deallocate, which MDTS does not bound, on the worker pool.
#[tokio::test]
async fn memory_runs_only_bounded_work_inline() {
    let rec = Arc::new(Recording { mem: MemoryBackend::new(SIZE), threads: Mutex::new(Vec::new()) });
    let dev = Local::new(rec.clone());
    let mut ch = Channel::new(IoEngine::Uring, IoPool::new(1));
    let here = std::thread::current().name().unwrap_or("").to_string();
    let cases: Vec<(Op, AlignedBuf, &str, bool)> = vec![
        (Op::Write { off: 0, fua: false }, filled(4096, 1), "write", true),
        (Op::Read { off: 0 }, buf(4096), "read", true),
        (Op::Flush, buf(0), "flush", true),
        (Op::WriteZeroes { off: 0, len: SIZE, deallocate: false, fua: false }, buf(0), "write zeroes", false),
        (Op::Deallocate, ranges(&[(0, SIZE)]), "deallocate", false),
    ];
    for (op, b, what, inline) in cases {
        rec.threads.lock().clear();
        assert!(ch.run(&dev, op, b).await.result.is_ok(), "{what}");
        let threads = rec.threads.lock().clone();
        assert_eq!(threads.len(), 1, "{what}: {threads:?}");
        let (seen, thread) = &threads[0];
        assert_eq!(*seen, what);
        if inline {
            assert_eq!(*thread, here, "{what} runs on the caller's thread");
        } else {
            assert!(thread.starts_with("nearstore-io-"), "{what} ran on {thread:?}, not on the worker pool");
        }
    }
    assert!(dev.write_now(&[1; 512], 0, false, None).is_some(), "memory writes complete at once");
    let mut lent = 0;
    assert!(dev.read_now(0, 512, &mut |s| lent = s.iter().map(|s| s.len()).sum()).is_some_and(|r| r.is_ok()));
    assert_eq!(lent, 512, "memory lends the bytes it reads");
}

/// One error-inject rule, the operations sent through it, and which of them fail.
struct InjectCase {
    what: &'static str,
    rule: Rule,
    ops: Vec<Op>,
    fail: Vec<bool>,
}

#[tokio::test]
async fn inject_fails_the_chosen_operations() {
    let rule = |kind, range, nth| Rule { kind, range, nth, errno: libc::ENOSPC };
    let r = |off| Op::Read { off };
    let w = |off| Op::Write { off, fua: false };
    let cases = [
        InjectCase { what: "every op", rule: rule(None, None, None), ops: vec![r(0), w(0), Op::Flush], fail: vec![true, true, true] },
        InjectCase {
            what: "only reads",
            rule: rule(Some(Kind::Read), None, None),
            ops: vec![w(0), r(0), Op::Flush],
            fail: vec![false, true, false],
        },
        InjectCase {
            what: "the second read",
            rule: rule(Some(Kind::Read), None, Some(2)),
            ops: vec![r(0), w(0), r(0), r(0)],
            fail: vec![false, false, true, false],
        },
        InjectCase {
            what: "writes touching [8192, 12288)",
            rule: rule(Some(Kind::Write), Some((8192, 12288)), None),
            ops: vec![w(0), w(4096), w(8192), w(12288), r(8192), Op::WriteZeroes { off: 0, len: 65536, deallocate: false, fua: false }],
            fail: vec![false, false, true, false, false, true],
        },
        InjectCase {
            what: "the first op in a range",
            rule: rule(None, Some((4096, 8192)), Some(1)),
            ops: vec![r(0), w(4096), r(4096)],
            fail: vec![false, true, false],
        },
        InjectCase { what: "flushes", rule: rule(Some(Kind::Flush), None, None), ops: vec![w(0), Op::Flush], fail: vec![false, true] },
    ];
    let dir = tempfile::tempdir().unwrap();
    let pool = IoPool::new(1);
    for base in ["memory", "file"] {
        for (i, case) in cases.iter().enumerate() {
            let dev: Arc<dyn BlockDevice> = match base {
                "memory" => Arc::new(Local::new(Arc::new(MemoryBackend::new(SIZE)))),
                _ => Arc::new(Local::new(Arc::new(FileBackend::open(&dir.path().join(format!("{i}")), Some(SIZE)).unwrap()))),
            };
            let dev = Inject::new(dev, case.rule.clone());
            let mut ch = Channel::new(IoEngine::Uring, pool.clone());
            for (j, (op, fail)) in case.ops.iter().zip(&case.fail).enumerate() {
                let b = if let Op::Read { .. } | Op::Write { .. } = op { buf(4096) } else { buf(0) };
                // Memory reads and writes take the at-once path, as the connection does.
                let now = match *op {
                    Op::Read { off } => dev.read_now(off, 4096, &mut |_| {}),
                    Op::Write { off, fua } => dev.write_now(&b, off, fua, None),
                    _ => None,
                };
                let result = match now {
                    Some(r) => r,
                    None => ch.run(&dev, *op, b).await.result,
                };
                let what = format!("{base}, {}: op {j} ({op:?})", case.what);
                assert_eq!(result.is_err(), *fail, "{what}: {result:?}");
                if let Err(e) = result {
                    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{what}: the rule's errno");
                }
            }
        }
    }
}

#[tokio::test]
async fn delay_holds_each_operation_back() {
    let delay = Duration::from_millis(30);
    let base: Arc<dyn BlockDevice> = Arc::new(Local::new(Arc::new(MemoryBackend::new(SIZE))));
    let dev = delay::Delay::new(base, delay);
    assert!(dev.read_now(0, 512, &mut |_| {}).is_none(), "nothing completes at once through a delay");
    let mut ch = Channel::new(IoEngine::Uring, IoPool::new(1));
    let t = Instant::now();
    for i in 0..4 {
        dev.submit(&mut ch, Op::Read { off: 0 }, buf(512), i);
    }
    let mut out = Vec::new();
    assert_eq!(ch.poll(usize::MAX, &mut out), 0, "held back");
    assert!(ch.busy(), "held-back operations keep the channel busy");
    while out.len() < 4 {
        if ch.poll(usize::MAX, &mut out) == 0 {
            ch.wait().await.unwrap();
        }
    }
    assert!(t.elapsed() >= delay, "completed after {:?}", t.elapsed());
}

#[tokio::test]
async fn run_refuses_a_busy_channel() {
    let dev = Local::new(Arc::new(MemoryBackend::new(SIZE)));
    let mut ch = Channel::new(IoEngine::Uring, IoPool::new(1));
    dev.submit(&mut ch, Op::Flush, buf(0), 1);
    let c = ch.run(&dev, Op::Flush, buf(0)).await;
    assert!(c.result.is_err(), "a second user would take the first one's completion");
    let mut out = Vec::new();
    assert_eq!(ch.poll(usize::MAX, &mut out), 1);
    assert_eq!(out[0].tag, 1);
}

/// A Preempt and Abort guard held with an operation ([`Channel::hold`]) is released only
/// once the storage has finished it: on every device, it is still held right after the
/// operation started (unless given back because the operation had already finished) and
/// released by the time its completion comes back; an operation still on the ring when
/// its channel goes releases it once the ring has drained.
#[tokio::test]
async fn a_held_guard_goes_with_its_operation() {
    use tokio::sync::mpsc::error::TryRecvError;
    let dir = tempfile::tempdir().unwrap();
    let pool = IoPool::new(2);
    for (name, dev, engine) in devices(&dir) {
        // (then: poll the completion, or drop the channel)
        for poll in [true, false] {
            let mut ch = Channel::new(engine, pool.clone());
            let (guard, mut wait) = tokio::sync::mpsc::channel::<()>(1);
            dev.submit(&mut ch, Op::Read { off: 4096 }, buf(64 << 10), 1);
            let given_back = ch.hold(1, guard);
            let at_once = matches!(name, "memory" | "inject (nothing matches) over memory");
            // A worker may have run the read already: then the guard comes back too.
            let worker = name == "file on the pool";
            if !worker {
                assert_eq!(given_back.is_some(), at_once, "{name}: a guard is given back only for an operation finished at once");
            }
            if given_back.is_none() && !worker {
                assert_eq!(wait.try_recv(), Err(TryRecvError::Empty), "{name}: released before the operation finished");
            }
            drop(given_back);
            if poll {
                let mut out = Vec::new();
                while ch.poll(1, &mut out) == 0 {
                    ch.wait().await.unwrap();
                }
                assert!(out[0].result.is_ok(), "{name}");
            } else {
                // Dropped at once: a held-back operation never reaches the storage.
                drop(ch);
                if worker {
                    // The worker still owns the job's hold: it releases it when it has run.
                    let until = Instant::now() + Duration::from_secs(10);
                    while wait.try_recv() != Err(TryRecvError::Disconnected) && Instant::now() < until {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
            }
            assert_eq!(wait.try_recv(), Err(TryRecvError::Disconnected), "{name} (poll {poll}): still held after the operation finished");
        }
    }
}

/// A queue that takes no completions (its send buffer full) still lets go of the guards
/// its operations hold once the storage has finished them ([`Channel::settle`]), and the
/// completions are then returned by `poll`, each once.
#[tokio::test]
async fn settle_releases_guards_and_keeps_completions() {
    use tokio::sync::mpsc::error::TryRecvError;
    let dir = tempfile::tempdir().unwrap();
    let pool = IoPool::new(2);
    for (name, dev, engine) in devices(&dir).into_iter().filter(|(n, ..)| matches!(*n, "file on io_uring" | "delay over file")) {
        let mut ch = Channel::new(engine, pool.clone());
        let (guard, mut wait) = tokio::sync::mpsc::channel::<()>(1);
        for tag in 0..4 {
            dev.submit(&mut ch, Op::Read { off: tag * 4096 }, buf(4096), tag);
            assert!(ch.hold(tag, guard.clone()).is_none(), "{name}: on the ring or held back");
        }
        drop(guard);
        assert!(ch.holding(), "{name}");
        let until = Instant::now() + Duration::from_secs(10);
        while ch.holding() {
            assert!(Instant::now() < until, "{name}: guards not released within 10 s");
            tokio::time::timeout(Duration::from_millis(50), ch.wait_holding()).await.ok();
            ch.settle();
        }
        assert_eq!(wait.try_recv(), Err(TryRecvError::Disconnected), "{name}: released once the storage finished");
        let mut out = Vec::new();
        while out.len() < 4 {
            assert!(Instant::now() < until, "{name}: completions lost");
            if ch.poll(8, &mut out) == 0 {
                ch.wait().await.unwrap();
            }
        }
        let tags: HashSet<u64> = out.iter().map(|c| c.tag).collect();
        assert_eq!((out.len(), tags.len()), (4, 4), "{name}: each completion once");
        assert!(!ch.busy(), "{name}");
    }
}
