//! The volume device against a model: memory pools, a translation service in memory that
//! can go down, and a byte array that says what every read must return.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use super::*;
use crate::backend::MemoryBackend;
use crate::dev::{error_status, local::Local};

const BLOCK: u64 = 4096;
const EXT: u64 = 16 * BLOCK;
const EXTENTS: u64 = 6;
const POOLS: u32 = 3;

/// Extents placed round robin over the pools; `down` makes every call wait forever; a
/// translation takes `delay_ms`, and `most` is the most translations seen at once.
#[derive(Default)]
struct Books {
    placed: Mutex<HashMap<u64, Location>>,
    next: AtomicU64,
    down: AtomicBool,
    translations: AtomicU64,
    delay_ms: AtomicU64,
    open: AtomicU64,
    most: AtomicU64,
    /// Allocations fail with this status.
    refuse: Mutex<Option<Status>>,
    /// Allocations name a pool no target has.
    bad_pool: AtomicBool,
}

impl Books {
    async fn gate(&self) {
        if self.down.load(Relaxed) {
            std::future::pending::<()>().await;
        }
    }
}

impl Resolver for Books {
    fn translate(&self, index: u64) -> BoxFuture<'_, Result<Lookup, ResolveError>> {
        Box::pin(async move {
            self.gate().await;
            self.translations.fetch_add(1, Relaxed);
            let now = self.open.fetch_add(1, Relaxed) + 1;
            self.most.fetch_max(now, Relaxed);
            tokio::time::sleep(Duration::from_millis(self.delay_ms.load(Relaxed))).await;
            self.open.fetch_sub(1, Relaxed);
            Ok(self.placed.lock().get(&index).cloned().map_or(Lookup::Unallocated, Lookup::Allocated))
        })
    }

    fn allocate(&self, index: u64) -> BoxFuture<'_, Result<Location, ResolveError>> {
        Box::pin(async move {
            self.gate().await;
            if let Some(status) = *self.refuse.lock() {
                return Err(ResolveError { status, message: "refused".into() });
            }
            let mut p = self.placed.lock();
            if let Some(l) = p.get(&index) {
                return Ok(l.clone());
            }
            let n = self.next.fetch_add(1, Relaxed);
            let nsid = if self.bad_pool.load(Relaxed) { 99 } else { (n % POOLS as u64) as u32 + 1 };
            let loc = Location { target: "t".into(), nsid, offset: (n / POOLS as u64) * EXT, epoch: 1, unwritten: true };
            p.insert(index, loc.clone());
            Ok(loc)
        })
    }

    fn written(&self, index: u64) -> BoxFuture<'_, Result<(), ResolveError>> {
        Box::pin(async move {
            self.gate().await;
            if let Some(l) = self.placed.lock().get_mut(&index) {
                l.unwritten = false;
            }
            Ok(())
        })
    }

    fn allocated(&self) -> BoxFuture<'_, Result<Vec<(u64, Location)>, ResolveError>> {
        Box::pin(async move {
            self.gate().await;
            Ok(self.placed.lock().iter().map(|(i, l)| (*i, l.clone())).collect())
        })
    }
}

/// Memory pools by NSID, filled with garbage: a new extent must read zeros all the same.
struct Pools(HashMap<u32, Arc<dyn BlockDevice>>);

impl Devices for Pools {
    fn open<'a>(&'a self, loc: &'a Location) -> BoxFuture<'a, io::Result<Arc<dyn BlockDevice>>> {
        Box::pin(async move { self.0.get(&loc.nsid).cloned().ok_or_else(|| io::Error::other("no such pool")) })
    }
}

struct Rig {
    vol: Arc<Volume>,
    books: Arc<Books>,
    ch: Channel,
    model: Vec<u8>,
}

fn rig(cache_entries: usize) -> Rig {
    rig_failing(cache_entries, None)
}

/// With every read of pool `failing` failing with EIO.
fn rig_failing(cache_entries: usize, failing: Option<u32>) -> Rig {
    rig_sized(cache_entries, failing, EXTENTS)
}

/// A volume of `extents` extents (its pools hold `EXTENTS`).
fn rig_sized(cache_entries: usize, failing: Option<u32>, extents: u64) -> Rig {
    rig_with(cache_entries, failing, extents, false)
}

/// [`rig_sized`], its pools fair-scheduled when `fair` (a bandwidth no test reaches).
fn rig_with(cache_entries: usize, failing: Option<u32>, extents: u64, fair: bool) -> Rig {
    let pools = (1..=POOLS)
        .map(|n| {
            let m = MemoryBackend::new(EXTENTS * EXT);
            m.write_at(&vec![0xee; (EXTENTS * EXT) as usize], 0).expect("garbage");
            let mut d: Arc<dyn BlockDevice> = Arc::new(Local::new(Arc::new(m)));
            if failing == Some(n) {
                let rule =
                    crate::dev::inject::Rule { kind: Some(crate::dev::inject::Kind::Read), range: None, nth: None, errno: libc::EIO };
                d = Arc::new(crate::dev::inject::Inject::new(d, rule));
            }
            if fair {
                d = crate::dev::fair::Fair::new(d, crate::limits::FAIR_BANDWIDTH_MAX, 1.0);
            }
            (n, d)
        })
        .collect();
    let books = Arc::new(Books::default());
    let cfg = VolumeConfig { name: "v".into(), size: extents * EXT, extent_size: EXT, cache_entries, timeout: Duration::from_millis(200) };
    let pool = IoPool::new(1);
    let vol = Arc::new(Volume::new(cfg, books.clone(), Arc::new(Pools(pools)), pool.clone()));
    Rig { vol, books, ch: Channel::new(IoEngine::Uring, pool), model: vec![0; (extents * EXT) as usize] }
}

impl Rig {
    async fn op(&mut self, op: Op, data: Vec<u8>) -> io::Result<Vec<u8>> {
        let mut b = AlignedBuf::new(data.len().max(1));
        b.set_len(data.len());
        b.copy_from_slice(&data);
        let c = self.ch.run(&*self.vol, op, b).await;
        c.result.map(|_| c.buf.to_vec())
    }

    async fn write(&mut self, off: u64, len: u64, seed: u8) {
        let data: Vec<u8> = (0..len).map(|i| seed.wrapping_add((i / 512) as u8) | 1).collect();
        self.op(Op::Write { off, fua: false }, data.clone()).await.unwrap_or_else(|e| panic!("write {off}+{len}: {e}"));
        self.model[off as usize..(off + len) as usize].copy_from_slice(&data);
    }

    async fn check(&mut self, off: u64, len: u64) {
        let got = self.op(Op::Read { off }, vec![0; len as usize]).await.unwrap_or_else(|e| panic!("read {off}+{len}: {e}"));
        assert!(got == self.model[off as usize..(off + len) as usize], "read {off}+{len} differs from what was written");
    }

    fn allocated(&self) -> usize {
        self.books.placed.lock().len()
    }
}

#[test]
fn clock_keeps_what_is_used() {
    // (operation, key, expected: the value got, or the key evicted).
    #[rustfmt::skip]
    let steps: &[(&str, u64, Option<u64>)] = &[
        ("insert", 1, None), ("insert", 2, None), ("insert", 3, None),
        ("get", 1, Some(1)),
        // Full: 1 was used, so the hand passes it and takes 2.
        ("insert", 4, Some(2)),
        ("get", 2, None),
        // Next after 2's slot: 3 (unused).
        ("insert", 5, Some(3)),
        // 1 had its second chance; 4 and 5 are new: 1 goes.
        ("insert", 6, Some(1)),
        ("get", 4, Some(4)), ("get", 5, Some(5)), ("get", 6, Some(6)),
    ];
    let mut c: Clock<u64> = Clock::new(3);
    for (i, (what, key, want)) in steps.iter().enumerate() {
        let got = match *what {
            "insert" => c.insert(*key, *key),
            _ => c.get(*key),
        };
        assert_eq!(got, *want, "step {i}: {what} {key}");
        assert!(c.len() <= 3);
    }
    let mut none: Clock<u64> = Clock::new(0);
    assert_eq!(none.insert(1, 1), None);
    assert_eq!((none.get(1), none.is_empty()), (None, true));
}

/// Writes and reads within one extent, across one and two extent boundaries, at the block
/// edges around a boundary, against the model; unwritten bytes read as zeros and a read
/// allocates nothing.
#[tokio::test]
async fn reads_and_writes_split_at_extents() {
    // (offset, length) in bytes: edges at 0, 1, block-1, block and block+1 blocks from the
    // boundary between extents 1 and 2, and ranges over one and two boundaries.
    let b = EXT;
    #[rustfmt::skip]
    let cases: &[(u64, u64)] = &[
        (0, BLOCK), (b - BLOCK, BLOCK), (b, BLOCK),
        (2 * b - BLOCK, BLOCK), (2 * b - BLOCK, 2 * BLOCK), (2 * b - 15 * BLOCK, 16 * BLOCK),
        (2 * b - 16 * BLOCK, 17 * BLOCK), (2 * b + BLOCK, 15 * BLOCK), (2 * b - BLOCK, b + 2 * BLOCK),
        (EXTENTS * EXT - BLOCK, BLOCK),
    ];
    let mut r = rig(64);
    // Reads first: all zeros, and nothing is allocated.
    for &(off, len) in cases {
        r.check(off, len).await;
    }
    assert_eq!(r.allocated(), 0, "a read allocated an extent");
    assert!(r.vol.stats().zero_reads.load(Relaxed) > 0);
    for (i, &(off, len)) in cases.iter().enumerate() {
        r.write(off, len, i as u8 * 16).await;
        for &(o, l) in cases {
            r.check(o, l).await;
        }
    }
    // The whole volume: the pools' garbage never shows.
    r.check(0, EXTENTS * EXT).await;
    assert!(r.allocated() as u64 <= EXTENTS);
}

/// A cached extent is served without the control plane; a miss asks it once; an evicted
/// entry is asked for again.
/// The first-write gap: an extent allocated by a data path that died before zeroing it
/// reads as zeros (not the garbage in its pool) and is not cached; the next write zeroes it
/// and marks it written; a new extent is marked written once zeroed.
#[tokio::test]
async fn an_extent_left_unwritten_reads_zeros_until_a_write_zeroes_it() {
    let mut r = rig(64);
    // Allocated, then its allocator died: the books say unwritten, the pool holds garbage.
    r.books.allocate(2).await.expect("allocate");
    r.check(2 * EXT, EXT).await;
    let misses = r.vol.stats().misses.load(Relaxed);
    r.check(2 * EXT, BLOCK).await;
    assert_eq!(r.vol.stats().misses.load(Relaxed), misses + 1, "an unwritten extent is not cached");
    assert!(r.books.placed.lock()[&2].unwritten);
    // A write of one block: the rest of the extent reads zeros, and it is written now.
    r.write(2 * EXT + BLOCK, BLOCK, 7).await;
    r.check(2 * EXT, EXT).await;
    assert!(!r.books.placed.lock()[&2].unwritten);
    r.write(4 * EXT, BLOCK, 9).await;
    assert!(!r.books.placed.lock()[&4].unwritten, "a new extent is marked written once zeroed");
    r.check(0, EXTENTS * EXT).await;
}

#[tokio::test]
async fn the_cache_answers_hits_and_is_bounded() {
    let mut r = rig(2);
    for e in 0..3 {
        r.write(e * EXT, BLOCK, 1).await;
    }
    let asked = r.books.translations.load(Relaxed);
    // Extents 1 and 2 are cached (the cache holds two): reads of them ask nothing.
    for _ in 0..4 {
        r.check(EXT, BLOCK).await;
        r.check(2 * EXT + BLOCK, BLOCK).await;
    }
    assert_eq!(r.books.translations.load(Relaxed), asked, "a hit asked the control plane");
    // Extent 0 was evicted: it is translated again.
    r.check(0, BLOCK).await;
    assert_eq!(r.books.translations.load(Relaxed), asked + 1);
    // No cache: every I/O is translated.
    let mut n = rig(0);
    n.write(0, BLOCK, 3).await;
    let before = n.books.translations.load(Relaxed);
    for _ in 0..3 {
        n.check(0, BLOCK).await;
    }
    assert_eq!(n.books.translations.load(Relaxed), before + 3);
}

/// The control plane down: cached extents keep serving, a miss fails after the bounded wait
/// with Namespace Not Ready (retryable), and nothing is returned that was not written.
#[tokio::test]
async fn a_control_plane_down_fails_only_misses() {
    let mut r = rig(64);
    r.write(0, 2 * BLOCK, 7).await;
    r.books.down.store(true, Relaxed);
    r.check(0, 2 * BLOCK).await;
    r.write(BLOCK, BLOCK, 9).await;
    r.check(0, 2 * BLOCK).await;
    // (operation, what it does): each is a miss.
    let misses: Vec<(Op, Vec<u8>)> = vec![
        (Op::Read { off: EXT }, vec![0; BLOCK as usize]),
        (Op::Write { off: 3 * EXT, fua: false }, vec![1; BLOCK as usize]),
        // Crossing from a cached extent into an uncached one.
        (Op::Read { off: EXT - BLOCK }, vec![0; 2 * BLOCK as usize]),
        (Op::WriteZeroes { off: 0, len: EXT, deallocate: false, fua: false }, vec![]),
    ];
    for (op, data) in misses {
        let start = std::time::Instant::now();
        let e = r.op(op, data).await.expect_err("a miss with the control plane down");
        assert_eq!(error_status(&e), Some(Status::NAMESPACE_NOT_READY), "{op:?}: {e}");
        assert!(!error_status(&e).expect("status").dnr, "retryable");
        assert!(start.elapsed() < Duration::from_secs(2), "{op:?} waited {:?}", start.elapsed());
    }
    r.books.down.store(false, Relaxed);
    r.check(0, EXTENTS * EXT).await;
}

/// Flush reaches every pool written; write zeroes and deallocate zero only what they name,
/// and allocate nothing.
#[tokio::test]
async fn flush_zeroes_and_deallocate() {
    let mut r = rig(64);
    r.write(0, 3 * EXT, 5).await;
    r.op(Op::Flush, vec![]).await.expect("flush");
    r.op(Op::WriteZeroes { off: EXT - BLOCK, len: 2 * BLOCK, deallocate: false, fua: true }, vec![]).await.expect("write zeroes");
    r.model[(EXT - BLOCK) as usize..(EXT + BLOCK) as usize].fill(0);
    let mut ranges = Vec::new();
    for (off, len) in [(2 * EXT + BLOCK, BLOCK), (4 * EXT, 2 * EXT)] {
        ranges.extend_from_slice(&off.to_le_bytes());
        ranges.extend_from_slice(&len.to_le_bytes());
        r.model[off as usize..(off + len) as usize].fill(0);
    }
    r.op(Op::Deallocate, ranges).await.expect("deallocate");
    r.check(0, EXTENTS * EXT).await;
    assert_eq!(r.allocated(), 3, "zeroing allocated an extent");
    let e = r.op(Op::Read { off: EXTENTS * EXT - BLOCK }, vec![0; 2 * BLOCK as usize]).await.expect_err("past the end");
    assert_eq!(error_status(&e), Some(Status::LBA_OUT_OF_RANGE));
}

/// `placement` hands each extent over as soon as it is known and stops where the caller
/// does: a compute command looking for one pool that holds all its bytes asks the control
/// plane no further than the first extent on another pool.
#[tokio::test]
async fn placement_stops_where_the_caller_does() {
    let r = rig(64);
    // Extents 0-5 on pools 1, 1, 2, 2, 3, 3 (extent 3 unallocated), looked up by no one yet.
    for (index, nsid) in [(0, 1), (1, 1), (2, 2), (4, 3), (5, 3)] {
        let loc = Location { target: "t".into(), nsid, offset: index * EXT, epoch: 1, unwritten: false };
        r.books.placed.lock().insert(index, loc);
    }
    let translations = || r.books.translations.load(Relaxed);
    // (first byte, length, pieces taken before a piece on a second pool is refused,
    // translations asked, whether every piece was taken).
    let cases = [
        (0, EXTENTS * EXT, 2, 3, false),
        (BLOCK, EXT, 2, 2, true),
        (EXT, 2 * EXT, 1, 2, false),
        (3 * EXT, 3 * EXT, 3, 3, true),
        (5 * EXT + BLOCK, 1, 1, 1, true),
    ];
    for (off, len, taken, asked, whole) in cases {
        // A fresh volume on the same books: nothing cached.
        let vol = Volume::new(r.vol.inner.cfg.clone(), r.books.clone(), r.vol.inner.devices.clone(), r.vol.inner.pool.clone());
        let before = translations();
        let (mut pieces, mut first) = (Vec::new(), None);
        let all = vol
            .placement(off, len, &mut Vec::new(), |p| {
                let pool = p.at.as_ref().map(|(pool, _)| pool.nsid);
                if pool.is_some() && first.is_some_and(|f| Some(f) != pool) {
                    return false;
                }
                first = first.or(pool);
                pieces.push((p.len, p.at.map(|(pool, o)| (pool.nsid, o))));
                true
            })
            .await
            .expect("placement");
        assert_eq!((pieces.len(), translations() - before, all), (taken, asked, whole), "{off}+{len}: {pieces:?}");
        let bytes: u64 = pieces.iter().map(|p| p.0).sum();
        assert!(whole == (bytes == len), "{off}+{len}: {bytes} bytes taken");
    }
    let e = r.vol.placement(EXTENTS * EXT - BLOCK, 2 * BLOCK, &mut Vec::new(), |_| true).await.expect_err("past the end");
    assert_eq!(error_status(&e), Some(Status::LBA_OUT_OF_RANGE));
}

/// A pool's failure fails the operation, and the slow path names the extent and its epoch.
#[tokio::test]
async fn a_failing_pool_fails_the_operation_naming_its_extent() {
    let mut r = rig_failing(64, Some(2));
    // Extents 0, 1 and 2 go to pools 1, 2 and 3.
    r.write(0, 3 * EXT, 4).await;
    r.check(0, BLOCK).await;
    r.check(2 * EXT, BLOCK).await;
    // Within extent 1 (cached: straight to the pool) and across extents 0 and 1.
    let e = r.op(Op::Read { off: EXT }, vec![0; BLOCK as usize]).await.expect_err("a read of the failing pool");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    let e = r.op(Op::Read { off: EXT - BLOCK }, vec![0; 2 * BLOCK as usize]).await.expect_err("a read across it");
    assert!(e.to_string().contains("extent 1 (epoch 1)"), "{e}");
}

/// Reads one block of each extent in `extents`, all at once, each on a channel of its own;
/// returns their results.
async fn read_at_once(r: &Rig, extents: &[u64]) -> Vec<io::Result<()>> {
    let mut set = tokio::task::JoinSet::new();
    for (i, &e) in extents.iter().enumerate() {
        let (vol, pool) = (r.vol.clone(), r.vol.inner.pool.clone());
        set.spawn(async move {
            let mut ch = Channel::new(IoEngine::Threads, pool);
            let mut b = AlignedBuf::new(BLOCK as usize);
            b.set_len(BLOCK as usize);
            (i, ch.run(&*vol, Op::Read { off: e * EXT }, b).await.result)
        });
    }
    let mut out: Vec<(usize, io::Result<()>)> = set.join_all().await;
    out.sort_by_key(|(i, _)| *i);
    out.into_iter().map(|(_, r)| r).collect()
}

/// Misses of different extents are translated together, at most VOLUME_MISSES_IN_FLIGHT_MAX
/// at once, so N cold reads take about one translation's time, not N; concurrent misses of
/// one extent make one translation. Counted at the translation service, which takes 100 ms
/// (on tokio's paused clock) to answer.
#[tokio::test(start_paused = true)]
async fn misses_are_resolved_concurrently_and_coalesced() {
    let max = crate::limits::VOLUME_MISSES_IN_FLIGHT_MAX as u64;
    // (cache entries, extents written first, concurrent reads, of how many distinct extents,
    // translations expected, the most at once expected).
    #[rustfmt::skip]
    let cases: &[(usize, u64, u64, u64, u64, u64)] = &[
        (64, 0, 8, 8, 8, 8),
        (64, 0, 8, 1, 1, 1),
        (64, 4, 16, 4, 4, 4),
        // No cache: concurrent misses of an allocated extent still share one translation.
        (0, 1, 8, 1, 1, 1),
        (64, 0, 2 * max + 2, 2 * max + 2, 2 * max + 2, max),
        (64, 0, 3 * max, max, max, max),
    ];
    for (i, &(cache, written, reads, distinct, translations, most)) in cases.iter().enumerate() {
        let mut r = rig_sized(cache, None, 2 * max + 2);
        for e in 0..written {
            r.write(e * EXT, BLOCK, 3).await;
        }
        r.vol = Arc::new(Volume::new(
            VolumeConfig { cache_entries: cache, ..r.vol.inner.cfg.clone() },
            r.vol.inner.resolver.clone(),
            r.vol.inner.devices.clone(),
            r.vol.inner.pool.clone(),
        ));
        r.books.translations.store(0, Relaxed);
        r.books.delay_ms.store(100, Relaxed);
        let extents: Vec<u64> = (0..reads).map(|n| n % distinct).collect();
        for (n, res) in read_at_once(&r, &extents).await.into_iter().enumerate() {
            res.unwrap_or_else(|e| panic!("case {i}: read {n}: {e}"));
        }
        let got = (r.books.translations.load(Relaxed), r.books.most.load(Relaxed));
        assert_eq!(got, (translations, most), "case {i}: (translations, the most at once)");
        let s = r.vol.stats();
        assert_eq!(s.misses.load(Relaxed), translations, "case {i}: misses");
        assert_eq!(s.misses.load(Relaxed) + s.coalesced.load(Relaxed) + s.hits.load(Relaxed), reads, "case {i}: lookups");
    }
}

/// Misses of one extent waiting behind a failed one fail with its error at once, not one
/// bounded wait after another.
#[tokio::test(start_paused = true)]
async fn misses_waiting_behind_a_failed_one_share_its_failure() {
    let r = rig(64);
    r.books.down.store(true, Relaxed);
    let start = tokio::time::Instant::now();
    for res in read_at_once(&r, &[2; 8]).await {
        let e = res.expect_err("a miss with the control plane down");
        assert_eq!(error_status(&e), Some(Status::NAMESPACE_NOT_READY), "{e}");
    }
    // One bounded wait (200 ms), not eight.
    assert!(start.elapsed() < Duration::from_millis(400), "waited {:?}", start.elapsed());
    assert_eq!((r.vol.stats().misses.load(Relaxed), r.vol.stats().coalesced.load(Relaxed)), (1, 7));
}

/// The cache's counters and the translation failures by kind, scraped from the metrics
/// text after known traffic (a cache of two extents).
#[tokio::test]
async fn the_metrics_count_hits_misses_evictions_and_failures() {
    let mut r = rig(2);
    let (write, read) = (true, false);
    // (the extent written or read, what to make the control plane do first, whether it
    // fails).
    #[rustfmt::skip]
    let traffic: &[(u64, bool, &str, bool)] = &[
        (0, write, "", false), (1, write, "", false),
        // The cache is full: 0 goes.
        (2, write, "", false),
        (2, read, "", false),
        // 1 goes.
        (0, read, "", false),
        (1, read, "down", true),
        (3, write, "no space", true),
        (4, write, "refuse", true),
        (5, write, "bad pool", true),
    ];
    for &(e, is_write, make, fails) in traffic {
        r.books.down.store(make == "down", Relaxed);
        *r.books.refuse.lock() = match make {
            "no space" => Some(Status::CAPACITY_EXCEEDED),
            "refuse" => Some(Status::INTERNAL_ERROR),
            _ => None,
        };
        r.books.bad_pool.store(make == "bad pool", Relaxed);
        let op = if is_write { Op::Write { off: e * EXT, fua: false } } else { Op::Read { off: e * EXT } };
        let res = r.op(op, vec![1; BLOCK as usize]).await;
        assert_eq!(res.is_err(), fails, "extent {e} ({make}): {res:?}");
    }
    let cfg = crate::config::NamespaceConfig {
        nsid: 1,
        path: None,
        memory: Some(crate::config::ByteSize(1 << 20)),
        size: None,
        block_size: 512,
        tag: None,
        delay_us: 0,
        inject: None,
        microtx: false,
        rate_limit: None,
        fair: None,
    };
    let cfg = crate::config::Config::single("127.0.0.1:0".parse().expect("address"), None, "nqn.2026-11.io.nearstore:m", cfg);
    let target = crate::Target::from_config(&cfg).expect("target");
    let mut ns = crate::subsystem::Namespace::new("nqn.v", 1, r.vol.backend(), crate::limits::VOLUME_BLOCK_BYTES);
    ns.volume = Some(r.vol.stats().clone());
    let sub = crate::subsystem::Subsystem::new("nqn.v", None, None, true, &[]);
    sub.add_namespace(ns).expect("namespace");
    target.add_subsystem(sub);
    let text = crate::metrics::render(&target);
    let l = "subnqn=\"nqn.v\",nsid=\"1\"";
    #[rustfmt::skip]
    let want = [
        ("nearstore_volume_cache_hits_total", String::new(), 1),
        ("nearstore_volume_cache_misses_total", String::new(), 8),
        ("nearstore_volume_cache_coalesced_total", String::new(), 0),
        ("nearstore_volume_cache_evictions_total", String::new(), 2),
        ("nearstore_volume_translation_failures_total", ",kind=\"timeout\"".into(), 1),
        ("nearstore_volume_translation_failures_total", ",kind=\"no_space\"".into(), 1),
        ("nearstore_volume_translation_failures_total", ",kind=\"refused\"".into(), 1),
        ("nearstore_volume_translation_failures_total", ",kind=\"pool\"".into(), 1),
        ("nearstore_volume_translate_latency_seconds_count", String::new(), 8),
        ("nearstore_volume_translate_latency_seconds_bucket", ",le=\"+Inf\"".into(), 8),
    ];
    for (name, more, n) in want {
        let line = format!("{name}{{{l}{more}}} {n}");
        assert!(text.lines().any(|x| x == line), "no line {line} in:\n{text}");
    }
}

/// A read of one block at `off` on a channel of its own, as a task.
fn read_task(r: &Rig, off: u64) -> tokio::task::JoinHandle<io::Result<Vec<u8>>> {
    let (vol, pool) = (r.vol.clone(), r.vol.inner.pool.clone());
    tokio::spawn(async move {
        let mut ch = Channel::new(IoEngine::Threads, pool);
        let mut b = AlignedBuf::new(BLOCK as usize);
        b.set_len(BLOCK as usize);
        let c = ch.run(&*vol, Op::Read { off }, b).await;
        c.result.map(|_| c.buf.to_vec())
    })
}

/// An extent blocked for a move (docs/control-plane.md, "Moving an extent"): its hits stop,
/// new operations wait for the move's end and then translate again, the drain waits for an
/// operation whose completion was not taken yet, and a translation asked before a move
/// ended is asked again rather than cached. On tokio's paused clock.
#[tokio::test(start_paused = true)]
async fn a_blocked_extent_drains_waits_and_translates_again() {
    let mut r = rig(16);
    r.write(EXT, 2 * BLOCK, 5).await;
    // A hit whose completion the queue has not taken: in flight, so the drain waits for it.
    let mut ch = Channel::new(IoEngine::Threads, r.vol.inner.pool.clone());
    let mut b = AlignedBuf::new(BLOCK as usize);
    b.set_len(BLOCK as usize);
    r.vol.submit(&mut ch, Op::Read { off: EXT }, b, 7);
    let hold = r.vol.block(1).expect("blocked");
    assert!(r.vol.block(1).is_none(), "blocked twice");
    let e = hold.drained(Duration::from_millis(50)).await.expect_err("an operation is in flight");
    assert!(e.to_string().contains("1 operations still in flight"), "{e}");
    let mut out = Vec::new();
    assert_eq!(ch.poll(1, &mut out), 1);
    drop(out);
    hold.drained(Duration::from_millis(50)).await.expect("drained once its completion was taken");
    // Blocked: a read of the extent waits, however long the move; other extents serve.
    r.check(0, BLOCK).await;
    let before = r.books.translations.load(Relaxed);
    let waiting = read_task(&r, EXT + BLOCK);
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(!waiting.is_finished(), "a read of a blocked extent went through");
    // The move published elsewhere: the waiting read translates again and reads the new place.
    let new = Location { target: "t".into(), nsid: 3, offset: 5 * EXT, epoch: 2, unwritten: false };
    r.books.placed.lock().insert(1, new);
    drop(hold);
    let got = waiting.await.expect("task").expect("read after the move");
    assert!(got.iter().all(|&b| b == 0xee), "the read did not go to the new place");
    assert_eq!(r.books.translations.load(Relaxed), before + 1);
    // Blocked longer than the control plane's wait (200 ms): Namespace Not Ready.
    let hold = r.vol.block(1).expect("blocked");
    let e = read_task(&r, EXT).await.expect("task").expect_err("waited past its bound");
    assert_eq!(error_status(&e), Some(Status::NAMESPACE_NOT_READY), "{e}");
    drop(hold);
    // A translation under way while a move ends is asked again: the second answer counts.
    // (Extent 2 allocated, then out of the cache by a move that did not move it.)
    r.write(2 * EXT, BLOCK, 9).await;
    drop(r.vol.block(2).expect("blocked"));
    r.books.delay_ms.store(100, Relaxed);
    let before = r.books.translations.load(Relaxed);
    let reading = read_task(&r, 2 * EXT);
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(r.vol.block(4).expect("another extent's move"));
    let got = reading.await.expect("task").expect("read");
    assert!(got == r.model[(2 * EXT) as usize..(2 * EXT + BLOCK) as usize], "extent 2 read wrong");
    assert_eq!(r.books.translations.load(Relaxed), before + 2, "the first answer was cached");
}

/// A volume operation is its caller's tenant's in fair-scheduled pools, on the fast path
/// (a cached extent, on the caller's channel) and on the slow path (a miss, an operation
/// split at extents: a task with a channel of its own), so that no tenant escapes its
/// `io_weight` through a volume. Each line: the cache's entries, the operation, offset,
/// length and the path it takes; the tenant's scheduled bytes grow by the length each time.
#[tokio::test]
async fn volume_operations_are_their_callers_tenants_on_every_path() {
    let b = EXT;
    #[rustfmt::skip]
    let cases: &[(usize, &str, u64, u64, &str)] = &[
        (0, "write", 0, 2 * b, "allocations, split"),
        (0, "read", 0, BLOCK, "a miss"),
        (0, "read", b - BLOCK, 2 * BLOCK, "misses, split"),
        (0, "write", b + BLOCK, BLOCK, "a miss"),
        (64, "write", 0, 2 * b, "allocations, split"),
        (64, "read", BLOCK, BLOCK, "fast"),
        (64, "write", 2 * BLOCK, BLOCK, "fast"),
        (64, "read", b - BLOCK, 2 * BLOCK, "cached, split"),
    ];
    let policy = crate::tenant::TenantPolicy::unrestricted(crate::tenant::TenantId(7), "t", 300, 100);
    let tenant = Arc::new(crate::dev::fair::Tenant::of(&policy, "h"));
    let mut rigs: HashMap<usize, Rig> = HashMap::new();
    for (i, &(cache, what, off, len, path)) in cases.iter().enumerate() {
        let r = rigs.entry(cache).or_insert_with(|| rig_with(cache, None, EXTENTS, true));
        r.ch.set_tenant(tenant.clone());
        let (bytes, misses) = (policy.stats.io_scheduled_bytes.load(Relaxed), r.vol.stats().misses.load(Relaxed));
        match what {
            "write" => r.write(off, len, i as u8).await,
            _ => r.check(off, len).await,
        }
        let case = format!("case {i}: {what} {off}+{len} with {cache} cache entries ({path})");
        assert_eq!(r.vol.stats().misses.load(Relaxed) > misses, path.contains("miss") || path.contains("alloc"), "{case}: misses");
        assert_eq!(policy.stats.io_scheduled_bytes.load(Relaxed) - bytes, len, "{case}: bytes charged to the tenant");
    }
}

/// A copier's words, as the control plane would take them: a publication puts the extent at
/// its destination with the next epoch in the books.
struct Words {
    books: Arc<Books>,
    said: Mutex<Vec<String>>,
}

impl mover::MoveControl for Words {
    fn moves(&self, _since: u64) -> BoxFuture<'_, io::Result<(u64, Vec<mover::MoveOrder>)>> {
        Box::pin(std::future::pending())
    }

    fn report<'a>(&'a self, _m: &'a mover::MoveOrder, ack: bool, _copied: u64) -> BoxFuture<'a, io::Result<()>> {
        self.said.lock().push(if ack { "ack" } else { "progress" }.into());
        Box::pin(async { Ok(()) })
    }

    fn publish<'a>(&'a self, m: &'a mover::MoveOrder, _copied: u64) -> BoxFuture<'a, io::Result<()>> {
        self.said.lock().push("publish".into());
        self.books.placed.lock().insert(m.index, Location { epoch: m.epoch + 1, ..m.to.clone() });
        Box::pin(async { Ok(()) })
    }

    fn abort<'a>(&'a self, _m: &'a mover::MoveOrder, reason: &'a str) -> BoxFuture<'a, io::Result<()>> {
        self.said.lock().push(format!("abort: {reason}"));
        Box::pin(async { Ok(()) })
    }
}

/// Starts the move of extent 1 of `r`'s volume from `from` to `to` by a copier that reaches
/// the pools through `devices` and says its words to the returned [`Words`].
fn start_move(r: &Rig, devices: Arc<dyn Devices>, from: Location, to: Location) -> (Arc<Words>, tokio::task::JoinHandle<()>) {
    let words = Arc::new(Words { books: r.books.clone(), said: Mutex::default() });
    let served = Arc::new(mover::Served::default());
    served.serve("v", r.vol.clone());
    let cfg = mover::MoverConfig { report_every: Duration::from_secs(1), retry_max: Duration::from_secs(1), bug: None };
    let m = Arc::new(mover::Mover::new(words.clone(), devices, served, r.vol.inner.pool.clone(), cfg));
    let order = mover::MoveOrder {
        id: 1,
        volume: "v".into(),
        index: 1,
        epoch: 1,
        from_name: "from".into(),
        to_name: "to".into(),
        from,
        to,
        extent_size: EXT,
        max_bps: 0,
        aborted: false,
    };
    (words, tokio::spawn(async move { m.run_move(&order).await }))
}

/// A compute command run on an extent's pool holds the tickets its placement took until it
/// ends: a move of the extent begun meanwhile waits for it (it acknowledges nothing, copies
/// nothing) and then copies the command's output with the rest, or, when the command
/// outlives the move's drain (MOVE_DRAIN_MS), aborts and leaves the extent, output and all,
/// where it was. A command placed while the move blocks the extent waits for the move's end.
/// Before placements took tickets the move copied at once, and the output the command
/// wrote to the old place afterwards was lost at the publication. On tokio's paused clock.
#[tokio::test(start_paused = true)]
async fn a_move_waits_for_the_compute_commands_on_its_extent() {
    let drain = crate::limits::MOVE_DRAIN_MS;
    let aborted = format!("abort: draining the extent's operations: extent 1: 1 operations still in flight after {drain} ms");
    // (how long the command runs after the move began, what the copier says, where extent
    // 1 lies at the end: its epoch)
    let cases: &[(u64, Vec<&str>, u64)] = &[(300, vec!["ack", "progress", "publish"], 2), (drain + 500, vec![&aborted], 1)];
    for (i, (runs, said, epoch)) in cases.iter().enumerate() {
        let mut r = rig(16);
        r.write(EXT, EXT, 3).await;
        let from = r.books.placed.lock()[&1].clone();
        // Free in every pool: the rig allocates from offset 0 up.
        let to = Location { nsid: from.nsid % POOLS + 1, offset: 5 * EXT, ..from.clone() };
        // The command's placement: extent 1 on its pool, with its ticket.
        let mut held = Vec::new();
        let mut pools = Vec::new();
        let placed = r.vol.placement(EXT + BLOCK, 2 * BLOCK, &mut held, |p| {
            pools.extend(p.at);
            true
        });
        assert!(placed.await.expect("placement"));
        assert_eq!((held.len(), pools.len()), (1, 1), "case {i}");
        let pool = r.vol.inner.pool.clone();
        let (words, moving) = start_move(&r, r.vol.inner.devices.clone(), from.clone(), to);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(words.said.lock().is_empty(), "case {i}: the move went on under the command: {:?}", words.said.lock());
        // Another command placed now waits for the move's end (or fails after the volume's
        // bounded wait, 200 ms), never placed on the moving extent.
        let vol = r.vol.clone();
        let later = tokio::spawn(async move { vol.placement(EXT, BLOCK, &mut Vec::new(), |_| true).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!later.is_finished(), "case {i}: a command was placed on a moving extent");
        // The command writes its output into the extent on the pool, then ends.
        tokio::time::sleep(Duration::from_millis(runs - 150)).await;
        let output = vec![0x5a; 2 * BLOCK as usize];
        let dev = r.vol.inner.devices.open(&from).await.expect("the pool");
        let mut ch = Channel::new(IoEngine::Threads, pool);
        let mut b = AlignedBuf::new(output.len());
        b.set_len(output.len());
        b.copy_from_slice(&output);
        ch.run(&*dev, Op::Write { off: from.offset + BLOCK, fua: false }, b).await.result.expect("the command's output");
        r.model[(EXT + BLOCK) as usize..(EXT + 3 * BLOCK) as usize].copy_from_slice(&output);
        drop(held);
        moving.await.expect("the move");
        assert_eq!(*words.said.lock(), *said, "case {i}");
        if let Err(e) = later.await.expect("task") {
            assert_eq!(error_status(&e), Some(Status::NAMESPACE_NOT_READY), "case {i}: {e}");
        }
        assert_eq!(r.books.placed.lock()[&1].epoch, *epoch, "case {i}");
        r.check(0, EXTENTS * EXT).await;
    }
}

/// A pool device whose writes given up (a peer's) are quiesced only when `done` says so.
struct Quiescing {
    base: Arc<dyn BlockDevice>,
    done: tokio::sync::watch::Receiver<bool>,
}

impl BlockDevice for Quiescing {
    fn describe(&self) -> String {
        self.base.describe()
    }

    fn geometry(&self) -> crate::dev::Geometry {
        self.base.geometry()
    }

    fn submit(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64) {
        self.base.submit(ch, op, buf, tag)
    }

    fn quiesce(&self, _off: u64, _len: u64) -> Option<crate::dev::Quiesce> {
        let mut done = self.done.clone();
        Some(Box::pin(async move { done.wait_for(|d| *d).await.map(|_| ()).map_err(|_| io::Error::other("gone")) }))
    }
}

/// The copier's view of the pools: pool `only` behind [`Quiescing`].
struct QuiescingPools {
    base: Arc<dyn Devices>,
    only: u32,
    done: tokio::sync::watch::Receiver<bool>,
}

impl Devices for QuiescingPools {
    fn open<'a>(&'a self, loc: &'a Location) -> BoxFuture<'a, io::Result<Arc<dyn BlockDevice>>> {
        Box::pin(async move {
            let base = self.base.open(loc).await?;
            if loc.nsid != self.only {
                return Ok(base);
            }
            Ok(Arc::new(Quiescing { base, done: self.done.clone() }) as Arc<dyn BlockDevice>)
        })
    }
}

/// A move acknowledges and copies only once the source pool's writes given up are
/// quiesced (a peer's controller reset, dev::remote): a late write could otherwise land
/// in the source after the copy read it. Not quiesced within the drain's limit, the move
/// aborts and the extent stays. On tokio's paused clock.
#[tokio::test(start_paused = true)]
async fn a_move_waits_for_the_source_pools_writes_given_up() {
    let drain = crate::limits::MOVE_DRAIN_MS;
    let aborted = format!("abort: draining the extent's operations: writes given up on from not quiesced within {drain} ms");
    // (when the source is quiesced after the move began, what the copier says, extent 1's
    // epoch at the end)
    let cases: &[(Option<u64>, Vec<&str>, u64)] = &[(Some(300), vec!["ack", "progress", "publish"], 2), (None, vec![&aborted], 1)];
    for (i, (after, said, epoch)) in cases.iter().enumerate() {
        let mut r = rig(16);
        r.write(EXT, EXT, 4).await;
        let from = r.books.placed.lock()[&1].clone();
        let to = Location { nsid: from.nsid % POOLS + 1, offset: 5 * EXT, ..from.clone() };
        let (quiesced, done) = tokio::sync::watch::channel(false);
        let devices = Arc::new(QuiescingPools { base: r.vol.inner.devices.clone(), only: from.nsid, done });
        let (words, moving) = start_move(&r, devices, from, to);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(words.said.lock().is_empty(), "case {i}: acknowledged before the source was quiesced: {:?}", words.said.lock());
        if let Some(after) = after {
            tokio::time::sleep(Duration::from_millis(after - 100)).await;
            quiesced.send_replace(true);
        }
        moving.await.expect("the move");
        assert_eq!(*words.said.lock(), *said, "case {i}");
        assert_eq!(r.books.placed.lock()[&1].epoch, *epoch, "case {i}");
        r.check(0, EXTENTS * EXT).await;
    }
}

/// A fenced volume (its export moved away, or its lease ran out: docs/control-plane.md,
/// "Handing an export over") starts nothing on its pools, by the fast path, the slow path
/// or a compute command's placement; it is released only once the operation that held a
/// ticket before the fence completed and its pools' writes given up are quiesced. On
/// tokio's paused clock.
#[tokio::test(start_paused = true)]
async fn a_fenced_volume_starts_nothing_and_is_released_only_once_quiesced() {
    let mut r = rig(16);
    r.write(0, 2 * EXT, 3).await;
    let nsid = r.books.placed.lock()[&1].nsid;
    let (quiesced, done) = tokio::sync::watch::channel(false);
    let devices = Arc::new(QuiescingPools { base: r.vol.inner.devices.clone(), only: nsid, done });
    let cfg =
        VolumeConfig { name: "v".into(), size: EXTENTS * EXT, extent_size: EXT, cache_entries: 16, timeout: Duration::from_millis(200) };
    let pool = r.vol.inner.pool.clone();
    let vol = Volume::new(cfg, r.books.clone(), devices, pool.clone());
    let one = |off: u64| {
        let mut b = AlignedBuf::new(BLOCK as usize);
        b.set_len(BLOCK as usize);
        (Op::Read { off }, b)
    };
    // Cached, then a hit whose completion is not taken yet: in flight across the fence.
    let mut ch = Channel::new(IoEngine::Threads, pool.clone());
    let (op, b) = one(0);
    ch.run(&vol, op, b).await.result.expect("a read before the fence");
    let (op, b) = one(0);
    vol.submit(&mut ch, op, b, 7);
    vol.fence();
    let refused = |e: io::Error, what: &str| {
        assert_eq!(error_status(&e), Some(Status::NAMESPACE_NOT_READY), "{what}: {e}");
        assert!(e.to_string().contains("no longer served by this target"), "{what}: {e}");
    };
    let mut other = Channel::new(IoEngine::Threads, pool.clone());
    let (op, b) = one(0);
    refused(other.run(&vol, op, b).await.result.expect_err("a read of a cached extent"), "fast path");
    let (op, b) = one(EXT + BLOCK);
    refused(other.run(&vol, op, b).await.result.expect_err("a read of another extent"), "slow path");
    let mut w = AlignedBuf::new(2 * BLOCK as usize);
    w.set_len(2 * BLOCK as usize);
    refused(other.run(&vol, Op::Write { off: EXT - BLOCK, fua: false }, w).await.result.expect_err("a write"), "split write");
    let mut held = Vec::new();
    refused(vol.placement(0, BLOCK, &mut held, |_| true).await.expect_err("a placement"), "compute placement");
    assert!(held.is_empty());
    // Released only once the read in flight completed and extent 1's pool is quiesced.
    let released = tokio::spawn({
        let vol = vol.clone();
        async move { vol.released().await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!released.is_finished(), "released with an operation in flight");
    ch.wait().await.expect("the read in flight completes");
    let mut out = Vec::new();
    assert_eq!(ch.poll(1, &mut out), 1);
    drop(out);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!released.is_finished(), "released before extent 1's pool was quiesced");
    quiesced.send_replace(true);
    released.await.expect("task").expect("released once quiesced");
    // What was written before the fence is all there (through the unfenced volume).
    r.check(0, 2 * EXT).await;
}

/// Past its export lease a volume starts nothing, as if fenced, on every path, until the
/// lease is renewed (the target's exporter renews it at each answer of the control plane).
#[tokio::test]
async fn a_volume_past_its_export_lease_starts_nothing_until_renewed() {
    let mut r = rig(16);
    r.write(0, 2 * BLOCK, 3).await;
    let now = std::time::Instant::now;
    r.vol.set_lease(now() + Duration::from_secs(3600));
    r.check(0, 2 * BLOCK).await;
    r.vol.set_lease(now());
    for (off, what) in [(0, "a cached extent"), (EXT, "an extent not cached")] {
        let e = r.op(Op::Read { off }, vec![0; BLOCK as usize]).await.expect_err(what);
        assert_eq!(error_status(&e), Some(Status::NAMESPACE_NOT_READY), "{what}: {e}");
    }
    let mut held = Vec::new();
    r.vol.placement(0, BLOCK, &mut held, |_| true).await.expect_err("a compute command's placement");
    r.vol.set_lease(now() + Duration::from_secs(3600));
    r.check(0, 2 * BLOCK).await;
    r.write(EXT, BLOCK, 4).await;
}
