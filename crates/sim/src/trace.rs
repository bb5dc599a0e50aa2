//! The event trace of a run: every host command issued and completed, every disk
//! operation, fault and crash, with its simulated time. Its hash is what the determinism
//! test compares; its tail goes into a failure's report, and the whole of it is printed
//! when a seed is replayed.

use std::collections::VecDeque;
use std::fmt::{self, Write as _};
use std::hash::{DefaultHasher, Hasher};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::time::Instant;

/// Lines kept for a failure's report.
const TAIL_LINES: usize = 40;

#[derive(Clone)]
pub struct Trace(Arc<Mutex<Inner>>);

struct Inner {
    start: Instant,
    hasher: DefaultHasher,
    events: u64,
    tail: VecDeque<String>,
    /// Every line, when the run is replayed with its trace printed.
    all: Option<Vec<String>>,
}

impl Trace {
    pub fn new(keep_all: bool) -> Trace {
        Trace(Arc::new(Mutex::new(Inner {
            start: Instant::now(),
            hasher: DefaultHasher::new(),
            events: 0,
            tail: VecDeque::new(),
            all: keep_all.then(Vec::new),
        })))
    }

    pub fn event(&self, what: fmt::Arguments) {
        let mut t = self.0.lock();
        let mut line = String::new();
        let at = Instant::now().duration_since(t.start);
        let _ = write!(line, "{:>10.6}s {what}", at.as_secs_f64());
        t.hasher.write(line.as_bytes());
        t.events += 1;
        if t.tail.len() == TAIL_LINES {
            t.tail.pop_front();
        }
        t.tail.push_back(line.clone());
        if let Some(all) = &mut t.all {
            all.push(line);
        }
    }

    /// The hash of every line so far, and how many there were.
    pub fn digest(&self) -> (u64, u64) {
        let t = self.0.lock();
        (t.hasher.clone().finish(), t.events)
    }

    pub fn tail(&self) -> Vec<String> {
        self.0.lock().tail.iter().cloned().collect()
    }

    pub fn all(&self) -> Vec<String> {
        self.0.lock().all.clone().unwrap_or_default()
    }
}
