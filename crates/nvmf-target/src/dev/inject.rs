//! A device that fails chosen operations with a chosen errno and passes the others to the
//! device it claims: how tests see what a host sees when a disk fails.
//!
//! A [`Rule`] picks operations by kind and by the byte range they touch; of those it fails
//! the `nth` (counted from 1 across every queue), or all of them when no `nth` is given.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use nearstore_transport::AlignedBuf;
use serde::Deserialize;

use super::{BlockDevice, Channel, Geometry, Op};

/// Kinds of operation a rule picks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    Read,
    /// Writes and write zeroes.
    Write,
    Flush,
    Deallocate,
}

impl Kind {
    fn of(op: &Op) -> Kind {
        match op {
            Op::Read { .. } => Kind::Read,
            Op::Write { .. } | Op::WriteZeroes { .. } => Kind::Write,
            Op::Flush => Kind::Flush,
            Op::Deallocate => Kind::Deallocate,
        }
    }
}

/// Which operations fail, and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// None: every kind.
    pub kind: Option<Kind>,
    /// Only operations touching bytes in `start..end`; None: anywhere. Flush and
    /// deallocate have no range of their own and match any.
    pub range: Option<(u64, u64)>,
    /// Fail only the nth matching operation (1-based); None: every one.
    pub nth: Option<u64>,
    /// The error the operation fails with (EIO by default).
    pub errno: i32,
}

pub struct Inject {
    base: Arc<dyn BlockDevice>,
    rule: Rule,
    /// Matching operations seen.
    seen: AtomicU64,
}

impl Inject {
    pub fn new(base: Arc<dyn BlockDevice>, rule: Rule) -> Inject {
        Inject { base, rule, seen: AtomicU64::new(0) }
    }

    /// True when this operation (kind, byte range) is to fail; counts it when it matches.
    fn fails(&self, kind: Kind, range: Option<(u64, u64)>) -> bool {
        if self.rule.kind.is_some_and(|k| k != kind) {
            return false;
        }
        if let (Some((start, end)), Some((off, len))) = (self.rule.range, range) {
            if off >= end || off.saturating_add(len) <= start {
                return false;
            }
        }
        let n = self.seen.fetch_add(1, Relaxed) + 1;
        self.rule.nth.is_none_or(|nth| nth == n)
    }

    fn error(&self) -> io::Error {
        io::Error::from_raw_os_error(self.rule.errno)
    }
}

fn range(op: &Op, buf: &AlignedBuf) -> Option<(u64, u64)> {
    match *op {
        Op::Read { off } | Op::Write { off, .. } => Some((off, buf.len() as u64)),
        Op::WriteZeroes { off, len, .. } => Some((off, len)),
        Op::Flush | Op::Deallocate => None,
    }
}

impl BlockDevice for Inject {
    fn describe(&self) -> String {
        format!("{} failing {:?}", self.base.describe(), self.rule)
    }

    fn geometry(&self) -> Geometry {
        self.base.geometry()
    }

    fn quiesce(&self, off: u64, len: u64) -> Option<super::Quiesce> {
        self.base.quiesce(off, len)
    }

    fn submit(&self, ch: &mut Channel, op: Op, buf: AlignedBuf, tag: u64) {
        if self.fails(Kind::of(&op), range(&op, &buf)) {
            return ch.complete(tag, Err(self.error()), buf);
        }
        self.base.submit(ch, op, buf, tag)
    }

    fn completes_now(&self) -> bool {
        self.base.completes_now()
    }

    fn read_now(&self, off: u64, len: usize, f: &mut dyn FnMut(&[&[u8]])) -> Option<io::Result<()>> {
        if !self.base.completes_now() {
            return None;
        }
        if self.fails(Kind::Read, Some((off, len as u64))) {
            return Some(Err(self.error()));
        }
        self.base.read_now(off, len, f)
    }

    fn lend(&self, off: u64, len: usize, who: Option<&super::fair::Tenant>) -> Option<io::Result<()>> {
        if !self.base.completes_now() {
            return None;
        }
        if self.fails(Kind::Read, Some((off, len as u64))) {
            return Some(Err(self.error()));
        }
        self.base.lend(off, len, who)
    }

    /// Checked (and counted) by [`lend`](BlockDevice::lend) already.
    fn read_lent(&self, off: u64, len: usize, f: &mut dyn FnMut(&[&[u8]])) -> io::Result<()> {
        self.base.read_lent(off, len, f)
    }

    fn reads_blocking(&self) -> bool {
        self.base.reads_blocking()
    }

    fn read_blocking(&self, off: u64, buf: &mut [u8]) -> Option<io::Result<()>> {
        if !self.base.reads_blocking() {
            return None;
        }
        if self.fails(Kind::Read, Some((off, buf.len() as u64))) {
            return Some(Err(self.error()));
        }
        self.base.read_blocking(off, buf)
    }

    fn write_now(&self, data: &[u8], off: u64, fua: bool, who: Option<&super::fair::Tenant>) -> Option<io::Result<()>> {
        if !self.base.completes_now() {
            return None;
        }
        if self.fails(Kind::Write, Some((off, data.len() as u64))) {
            return Some(Err(self.error()));
        }
        self.base.write_now(data, off, fua, who)
    }
}
