//! Rate limiting of the log lines a remote peer can cause at will (a refused Connect, a
//! malformed PDU, a digest error): per peer host and cause, the first
//! [`limits::LOG_REPEATS_MAX`] lines of an interval are logged, the rest are counted, and
//! the next line after the interval is preceded by one saying how many were suppressed.
//! A host reconnecting in a tight loop with a stale controller ID wrote 3,165 identical
//! warnings in a second; now it writes a handful.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::limits;

/// Where a peer's lines are counted: its host (the port changes with every connection) and
/// the cause, a static message.
type Key = (String, &'static str);

struct Window {
    start: Instant,
    logged: u32,
    suppressed: u64,
}

pub struct LogLimiter {
    interval: Duration,
    windows: Mutex<HashMap<Key, Window>>,
}

impl Default for LogLimiter {
    fn default() -> Self {
        LogLimiter { interval: Duration::from_millis(limits::LOG_INTERVAL_MS), windows: Mutex::new(HashMap::new()) }
    }
}

/// The host part of a peer address ("192.0.2.1:50312" → "192.0.2.1", "[::1]:4420" → "[::1]").
fn host_of(peer: &str) -> &str {
    match peer.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() && (!host.contains(':') || host.ends_with(']')) => host,
        _ => peer,
    }
}

impl LogLimiter {
    /// Whether a line of `cause` from `peer` may be logged now. When it may and earlier
    /// ones were suppressed, the line that says how many is logged first.
    pub fn allow(&self, peer: &str, cause: &'static str) -> bool {
        match self.check(host_of(peer), cause, Instant::now()) {
            Some(0) => true,
            Some(suppressed) => {
                tracing::warn!(peer = host_of(peer), suppressed, "{cause}: {suppressed} more like it suppressed");
                true
            }
            None => false,
        }
    }

    /// Some(lines suppressed since the last one logged) if a line may be logged at `now`.
    fn check(&self, host: &str, cause: &'static str, now: Instant) -> Option<u64> {
        let mut windows = self.windows.lock();
        let mut key = (host.to_string(), cause);
        if !windows.contains_key(&key) && windows.len() >= limits::LOG_KEYS_MAX {
            // Forget windows that ended with nothing suppressed; if that frees nothing,
            // every further host shares one window per cause.
            windows.retain(|_, w| now.duration_since(w.start) < self.interval || w.suppressed > 0);
            if windows.len() >= limits::LOG_KEYS_MAX {
                key.0 = "*".into();
            }
        }
        let w = windows.entry(key).or_insert(Window { start: now, logged: 0, suppressed: 0 });
        if now.duration_since(w.start) >= self.interval {
            let suppressed = w.suppressed;
            *w = Window { start: now, logged: 1, suppressed: 0 };
            return Some(suppressed);
        }
        if w.logged < limits::LOG_REPEATS_MAX {
            w.logged += 1;
            return Some(0);
        }
        w.suppressed += 1;
        None
    }
}

/// `warn!` for a line a remote peer can cause at will, through the target's [`LogLimiter`]:
/// `peer_warn!(limiter, peer, "cause", fields...)`; the cause is the message.
macro_rules! peer_warn {
    ($limiter:expr, $peer:expr, $cause:literal $(, $($field:tt)+)?) => {
        if $limiter.allow($peer, $cause) {
            tracing::warn!(peer = %$peer, $($($field)+ ,)? $cause);
        }
    };
}
pub(crate) use peer_warn;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_without_port() {
        for (peer, host) in
            [("192.0.2.1:50312", "192.0.2.1"), ("[::1]:4420", "[::1]"), ("::1", "::1"), ("unix-socketpair", "unix-socketpair"), ("?", "?")]
        {
            assert_eq!(host_of(peer), host, "{peer}");
        }
    }

    /// A flood logs LOG_REPEATS_MAX lines per interval and then reports what it suppressed;
    /// other hosts and other causes have windows of their own.
    #[test]
    fn a_flood_is_cut_to_a_few_lines_and_a_count() {
        let l = LogLimiter::default();
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let first: Vec<_> = (0..1000).map(|i| l.check("a", "x", ms(i / 10))).collect();
        let n = limits::LOG_REPEATS_MAX as usize;
        assert!(first[..n].iter().all(|r| *r == Some(0)));
        assert!(first[n..].iter().all(|r| r.is_none()));
        // (host, cause, at ms, verdict)
        let cases: &[(&str, &'static str, u64, Option<u64>)] = &[
            ("b", "x", 50, Some(0)),
            ("a", "y", 50, Some(0)),
            ("a", "x", limits::LOG_INTERVAL_MS, Some(1000 - n as u64)),
            ("a", "x", limits::LOG_INTERVAL_MS + 1, Some(0)),
            ("a", "x", 3 * limits::LOG_INTERVAL_MS, Some(0)),
        ];
        for (host, cause, at, want) in cases {
            assert_eq!(l.check(host, cause, ms(*at)), *want, "{host} {cause} at {at} ms");
        }
    }

    /// Memory is bounded: past LOG_KEYS_MAX windows, new hosts share one per cause.
    #[test]
    fn windows_are_bounded() {
        let l = LogLimiter::default();
        let t = Instant::now();
        for i in 0..limits::LOG_KEYS_MAX + 100 {
            l.check(&format!("h{i}"), "x", t);
        }
        assert_eq!(l.windows.lock().len(), limits::LOG_KEYS_MAX + 1);
        let shared = (0..limits::LOG_REPEATS_MAX as usize + 5).filter(|i| l.check(&format!("new{i}"), "x", t).is_some()).count();
        assert_eq!(shared, 0, "the shared window is already full");
    }
}
