//! select within its bounds: memory (every allocation the input can grow is charged to the
//! command's account before it is made, so the process's peak stays within the bound plus
//! a stated slack, measured by a counting allocator) and work (LIKE in linear time, long
//! evaluation inside one record stopped by cancellation or the deadline).
//!
//! Its own test binary: the allocator counts the whole process, so the cases run one at a
//! time.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nearstore_compute::select::RECORD_BYTES_MAX;
use nearstore_compute::{by_name, ComputeError, Context, Outcome, Sink, SliceSource, Source, Stop};

struct Counting;

static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            PEAK.fetch_max(NOW.fetch_add(l.size(), Relaxed) + l.size(), Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        NOW.fetch_sub(l.size(), Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // Both buffers exist while the bytes are copied.
        PEAK.fetch_max(NOW.load(Relaxed) + new, Relaxed);
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            NOW.fetch_add(new, Relaxed);
            NOW.fetch_sub(l.size(), Relaxed);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// One case at a time: the counts are the process's.
static ONE: Mutex<()> = Mutex::new(());

/// Memory the operation holds besides what it charges: the CSV reader's record and field
/// buffers (up to a record each), the plan, the reader, and the allocator's rounding.
const SLACK: usize = 2 * RECORD_BYTES_MAX + (2 << 20);

/// A sink that counts and drops what it is given (an output object's bytes are the
/// target's, not the operation's).
struct Discard(u64);

impl Sink for Discard {
    fn write(&mut self, data: &[u8]) -> Result<(), ComputeError> {
        self.0 += data.len() as u64;
        Ok(())
    }
    fn written(&self) -> u64 {
        self.0
    }
}

/// Runs a select over `data` (in 1 MiB chunks), inline or into an output object, and
/// returns its result and the peak memory it added to the process.
fn measure(query: &str, data: &[u8], memory_max: usize, into_object: bool) -> (Result<Outcome, ComputeError>, usize) {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let args = serde_json::json!({ "query": query }).to_string();
    let mut src = SliceSource::new(data.chunks(1 << 20));
    let mut sink = Discard(0);
    let ctx = Context::with_memory(memory_max);
    let base = NOW.load(Relaxed);
    PEAK.store(base, Relaxed);
    let mut outs: Vec<&mut dyn Sink> = if into_object { vec![&mut sink] } else { vec![] };
    let r = by_name("select").unwrap().execute(args.as_bytes(), &mut [&mut src], &mut outs, &ctx).map(|mut o| o.remove(0));
    (r, PEAK.load(Relaxed) - base)
}

/// A balanced tree of `a || a` of the given depth: 2^depth copies of the column.
fn concat_tree(depth: u32) -> String {
    if depth == 0 {
        "a".into()
    } else {
        let t = concat_tree(depth - 1);
        format!("({t}||{t})")
    }
}

/// A CSV with the header `a,b` and records made by `row`.
fn csv(rows: usize, row: impl Fn(usize) -> String) -> Vec<u8> {
    let mut d = b"a,b\n".to_vec();
    for i in 0..rows {
        d.extend_from_slice(row(i).as_bytes());
        d.push(b'\n');
    }
    d
}

#[test]
fn every_growing_allocation_is_refused_before_the_bound() {
    const MB: usize = 1 << 20;
    let big_record = csv(1, |_| format!("{},x", "a".repeat(RECORD_BYTES_MAX - 16)));
    let many_keys = csv(400_000, |i| format!("key-{i:08},{i}"));
    let long_fields = csv(20_000, |i| format!("{}{i},{i}", "x".repeat(2000)));
    let short = csv(20_000, |i| format!("{i:040},x"));
    let tree = concat_tree(10);
    // (what, query, data, memory bound, into an output object, what the refusal names)
    type Case<'a> = (&'a str, String, &'a [u8], usize, bool, &'a str);
    let cases: &[Case] = &[
        ("strings of one record", format!("SELECT LENGTH({tree}) FROM t"), &big_record, 64 * MB, false, "||"),
        ("strings in WHERE", format!("SELECT b FROM t WHERE LENGTH({tree}) > 0"), &big_record, 32 * MB, false, "||"),
        ("case mappings", format!("SELECT {} FROM t", ["LENGTH(UPPER(a))"; 12].join(" + ")), &big_record, 32 * MB, false, "UPPER"),
        ("groups", "SELECT a, COUNT(*) FROM t GROUP BY a".into(), &many_keys, 16 * MB, false, "groups"),
        ("group keys of strings", format!("SELECT COUNT(*) FROM t GROUP BY {}", concat_tree(3)), &many_keys, 16 * MB, false, "groups"),
        ("rows to ORDER BY", "SELECT a, b FROM t ORDER BY a DESC".into(), &many_keys, 16 * MB, true, "rows to ORDER BY"),
        ("MAX of long strings", "SELECT MAX(a) FROM t GROUP BY b".into(), &long_fields, 8 * MB, false, "MIN or MAX"),
        ("output waiting to be written", format!("SELECT {} FROM t", concat_tree(9)), &short, 16 * MB, true, "output waiting"),
    ];
    for (name, query, data, bound, object, names) in cases {
        let (r, peak) = measure(query, data, *bound, *object);
        match r {
            Err(ComputeError::Memory { limit, what, .. }) => {
                assert_eq!(limit, *bound, "{name}");
                assert!(what.contains(names), "{name}: the refusal names {what:?}, not {names:?}");
            }
            r => panic!("{name}: expected LIMIT_EXCEEDED, got {r:?}"),
        }
        assert!(peak <= bound + SLACK, "{name}: peak {} MiB over the bound of {} MiB plus {} MiB", peak >> 20, bound >> 20, SLACK >> 20);
    }
    // Under the bound, the same paths succeed (the charges are given back).
    let (r, peak) = measure("SELECT a, COUNT(*) FROM t GROUP BY a ORDER BY a DESC LIMIT 3", &many_keys, 256 * MB, false);
    let Outcome::Select { rows, records, .. } = r.unwrap() else { panic!() };
    assert_eq!((rows[0][0].as_str(), records), (Some("key-00399999"), 400_000));
    assert!(peak <= 256 * MB + SLACK);
    let (r, _) = measure(&format!("SELECT LENGTH({}) FROM t", concat_tree(5)), &big_record, 256 * MB, false);
    let Outcome::Select { rows, .. } = r.unwrap() else { panic!() };
    assert_eq!(rows[0][0], serde_json::json!(32 * (RECORD_BYTES_MAX - 16)));
}

/// A source that hands out the same record again and again: many 1 MiB records without
/// holding them.
struct Repeat {
    chunk: Vec<u8>,
    left: usize,
    header: bool,
}

impl Source for Repeat {
    fn next_chunk(&mut self) -> Result<Option<&[u8]>, ComputeError> {
        if self.header {
            self.header = false;
            return Ok(Some(b"a,b\n"));
        }
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        Ok(Some(&self.chunk))
    }
    fn len(&self) -> u64 {
        4 + self.left as u64 * self.chunk.len() as u64
    }
}

/// Runs a query over `records` records of 1 MiB of 'a' with a stop; returns the result
/// and how long it ran.
fn run_stopped(query: &str, records: usize, stop: Stop) -> (Result<Vec<Outcome>, ComputeError>, Duration) {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let mut chunk = vec![b'a'; RECORD_BYTES_MAX - 16];
    chunk.extend_from_slice(b",x\n");
    let mut src = Repeat { chunk, left: records, header: true };
    let args = serde_json::json!({ "query": query }).to_string();
    let ctx = Context { stop, ..Context::default() };
    let t = Instant::now();
    let r = by_name("select").unwrap().execute(args.as_bytes(), &mut [&mut src], &mut [], &ctx);
    (r, t.elapsed())
}

#[test]
fn adversarial_like_patterns_finish_and_long_records_stop_when_asked() {
    // Patterns that make a backtracking matcher quadratic or worse, over 1 MiB records:
    // each record costs at most 2^20 x ceil(longest segment / 64) steps.
    for pattern in [format!("%{}b%", "a".repeat(4000)), "%a".repeat(1000) + "%b", format!("%{}b", "_".repeat(3000))] {
        let (r, _) = run_stopped(&format!("SELECT COUNT(*) FROM t WHERE a LIKE '{pattern}'"), 2, Stop::default());
        let Outcome::Select { rows, records, .. } = &r.unwrap()[0] else { panic!() };
        assert_eq!((rows[0][0].as_i64(), *records), (Some(0), 2), "{}", &pattern[..20]);
    }
    // Work inside one record: a pattern of one 7,800-character segment scans the record
    // with a 122-word automaton, about 2^20 x 122 units of work. The stop is looked at
    // every STOP_CHECK_WORK units inside the record, not only between its chunks (3).
    let heavy = format!("%{}b%", "a".repeat(7800));
    let query = format!("SELECT COUNT(*) FROM t WHERE a LIKE '{heavy}'");
    let looks = Arc::new(AtomicUsize::new(0));
    let l = looks.clone();
    let (r, _) = run_stopped(&query, 1, Stop::new(None, Some(Box::new(move || l.fetch_add(1, Relaxed) == usize::MAX))));
    assert!(r.is_ok());
    let work = (RECORD_BYTES_MAX as u64 - 16) * 7801u64.div_ceil(64);
    let n = looks.load(Relaxed) as u64;
    assert!(n >= work / nearstore_compute::STOP_CHECK_WORK, "{n} looks at the stop for {work} units of work");
    // Cancelled from outside, or past its deadline, in the middle of 1000 such records,
    // it stops promptly.
    let flag = Arc::new(AtomicBool::new(false));
    let f = flag.clone();
    let canceller = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        f.store(true, Relaxed);
        Instant::now()
    });
    let f = flag.clone();
    let (r, _) = run_stopped(&query, 1000, Stop::new(None, Some(Box::new(move || f.load(Relaxed)))));
    let cancelled_at = canceller.join().unwrap();
    assert_eq!(r.unwrap_err(), ComputeError::Cancelled);
    let latency = cancelled_at.elapsed();
    assert!(latency < Duration::from_secs(2), "stopped {latency:?} after the cancel");
    let (r, took) = run_stopped(&query, 1000, Stop::new(Some(Duration::from_millis(300)), None));
    assert_eq!(r.unwrap_err(), ComputeError::Timeout(0));
    assert!(took < Duration::from_millis(300) + Duration::from_secs(2), "timed out after {took:?}");
}
