//! The model the checker holds results against: per block, the writes that may be what
//! the block holds, each with when the host issued it and saw it complete on one logical
//! clock (one tick per host event).
//!
//! A read may return, per block, the value of any write not superseded before the read
//! was issued; write W2 supersedes W when W2 succeeded, was issued after W completed, and
//! completed itself before the read was issued. A write in flight, failed, or whose
//! completion was lost supersedes nothing and is superseded only once it has completed
//! (for a lost one: once the target has let go of its connection). After a crash a block
//! may hold any write not superseded by a *durable* one (completed with FUA, or before a
//! Flush that succeeded was issued).
//!
//! Every block written carries its write's number and its LBA, so a read names the write
//! it returns and a torn or misplaced block is seen.

use std::collections::BTreeMap;
use std::sync::Arc;

use nearstore_wire::Status;
use tokio::sync::Notify;

use crate::disk::{Fault, SimDisk};

pub type Clock = u64;
const NEVER: Clock = Clock::MAX;

/// A block's value: the number of the write that put it there (0: zeros).
pub type Value = u64;

#[derive(Clone, Debug)]
pub enum Kind {
    Read,
    /// A read of a block range right after a restart: held against what may have survived
    /// the crash, then taken as the blocks' new baseline.
    Verify,
    Write {
        fua: bool,
    },
    Zeroes {
        fua: bool,
    },
    /// Deallocate these (slba, nlb) ranges.
    Deallocate(Vec<(u64, u32)>),
    Flush,
}

#[derive(Clone, Debug)]
pub struct Op {
    pub id: u64,
    pub kind: Kind,
    pub slba: u64,
    pub nlb: u32,
    pub queue: u32,
    issued: Clock,
}

impl Op {
    /// The block ranges the command changes.
    fn ranges(&self) -> Vec<(u64, u32)> {
        match &self.kind {
            Kind::Write { .. } | Kind::Zeroes { .. } => vec![(self.slba, self.nlb)],
            Kind::Deallocate(r) => r.clone(),
            Kind::Read | Kind::Verify | Kind::Flush => Vec::new(),
        }
    }

    fn value(&self) -> Value {
        match self.kind {
            Kind::Write { .. } => self.id,
            _ => 0,
        }
    }
}

#[derive(Clone, Debug)]
struct Rec {
    op: u64,
    value: Value,
    issued: Clock,
    completed: Clock,
    /// Completed successfully: it did happen.
    definite: bool,
    /// Definite and on the medium: survives a crash.
    durable: bool,
}

pub struct Model {
    block_size: usize,
    blocks: Vec<Vec<Rec>>,
    clock: Clock,
    next_op: u64,
    outstanding: BTreeMap<u64, Op>,
    /// Ops whose connection died, until the target has let go of it.
    lost: Vec<Op>,
    pub completed: u64,
    pub lost_total: u64,
    pub faults_seen: u64,
    /// Rings when the clock reaches `alarm_at`: the session's next planned fault.
    alarm: Arc<Notify>,
    alarm_at: Option<Clock>,
}

/// The 8-byte word `i` of the pattern after a block's header.
fn pattern(value: Value, lba: u64, i: usize) -> u64 {
    (value ^ lba.rotate_left(32)).wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(i as u64)
}

/// The bytes a write puts in a block: its number, the LBA, then a pattern of both.
pub fn block_bytes(value: Value, lba: u64, block_size: usize) -> Vec<u8> {
    let mut b = vec![0u8; block_size];
    if value == 0 {
        return b;
    }
    b[..8].copy_from_slice(&value.to_le_bytes());
    b[8..16].copy_from_slice(&lba.to_le_bytes());
    for (i, w) in b[16..].chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&pattern(value, lba, i).to_le_bytes());
    }
    b
}

/// The write a block's bytes name, or what is wrong with them.
fn decode(block: &[u8], lba: u64) -> Result<Value, String> {
    let word = |i: usize| u64::from_le_bytes(block[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    let (value, at) = (word(0), word(1));
    if value == 0 && at == 0 {
        return match block.iter().all(|&x| x == 0) {
            true => Ok(0),
            false => Err("is zeros with garbage".into()),
        };
    }
    if at != lba {
        return Err(format!("holds write {value}'s block for LBA {at}"));
    }
    if (2..block.len() / 8).any(|i| word(i) != pattern(value, lba, i - 2)) {
        return Err(format!("is torn or corrupt (starts like write {value})"));
    }
    Ok(value)
}

fn same(a: Status, b: Status) -> bool {
    a.sct == b.sct && a.sc == b.sc
}

impl Model {
    pub fn new(blocks: u64, block_size: usize) -> Model {
        let zero = Rec { op: 0, value: 0, issued: 0, completed: 0, definite: true, durable: true };
        Model {
            block_size,
            blocks: vec![vec![zero]; blocks as usize],
            clock: 1,
            next_op: 1,
            outstanding: BTreeMap::new(),
            lost: Vec::new(),
            completed: 0,
            lost_total: 0,
            faults_seen: 0,
            alarm: Arc::new(Notify::new()),
            alarm_at: None,
        }
    }

    fn tick(&mut self) -> Clock {
        self.clock += 1;
        if self.alarm_at.is_some_and(|at| self.clock >= at) {
            self.alarm_at = None;
            self.alarm.notify_one();
        }
        self.clock
    }

    /// What rings at the clock set by [`set_alarm`](Self::set_alarm).
    pub fn alarm(&self) -> Arc<Notify> {
        self.alarm.clone()
    }

    pub fn set_alarm(&mut self, at: Option<Clock>) {
        self.alarm_at = at;
    }

    pub fn clock(&self) -> Clock {
        self.clock
    }

    pub fn blocks(&self) -> u64 {
        self.blocks.len() as u64
    }

    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }

    /// A command is about to be sent: returns its number.
    pub fn issue(&mut self, kind: Kind, slba: u64, nlb: u32, queue: u32) -> Op {
        let now = self.tick();
        let id = self.next_op;
        self.next_op += 1;
        let op = Op { id, kind, slba, nlb, queue, issued: now };
        for (s, n) in op.ranges() {
            for b in s..s + n as u64 {
                let rec = Rec { op: id, value: op.value(), issued: now, completed: NEVER, definite: false, durable: false };
                self.blocks[b as usize].push(rec);
            }
        }
        self.outstanding.insert(id, op.clone());
        op
    }

    /// The values block `b` may hold for a read issued at `issued`.
    fn readable(&self, b: usize, issued: Clock) -> Vec<Value> {
        let h = &self.blocks[b];
        let superseded = |r: &Rec| h.iter().any(|w| w.definite && r.completed < w.issued && w.completed < issued);
        let mut v: Vec<Value> = h.iter().filter(|r| !superseded(r)).map(|r| r.value).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The values block `b` may hold after a crash.
    fn survivors(&self, b: usize) -> Vec<Value> {
        let h = &self.blocks[b];
        let superseded = |r: &Rec| h.iter().any(|w| w.durable && r.completed < w.issued);
        let mut v: Vec<Value> = h.iter().filter(|r| !superseded(r)).map(|r| r.value).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    fn settle(&mut self, op: u64, definite: bool, durable: bool, now: Clock) {
        for h in &mut self.blocks {
            for r in h.iter_mut().filter(|r| r.op == op) {
                r.completed = now;
                r.definite = definite;
                r.durable = durable && definite;
            }
        }
        if durable && definite {
            self.prune();
        }
    }

    /// Drops writes that no read and no crash can return any more: those a durable write
    /// supersedes for every read still outstanding and every read to come.
    fn prune(&mut self) {
        let horizon = self.outstanding.values().map(|o| o.issued).min().unwrap_or(self.clock);
        for h in &mut self.blocks {
            let Some(last) = h.iter().filter(|w| w.durable && w.completed < horizon).map(|w| w.issued).max() else { continue };
            h.retain(|r| r.completed >= last || r.durable && r.issued == last);
        }
    }

    /// A completion arrived: checks it. `data`: what a read returned.
    pub fn complete(&mut self, id: u64, status: Status, data: &[u8], disk: &SimDisk) -> Result<(), String> {
        let now = self.tick();
        let Some(op) = self.outstanding.remove(&id) else {
            return Err(format!("completion of op {id}, which is not outstanding (completed twice, or after its connection died)"));
        };
        self.completed += 1;
        let bs = self.block_size as u64;
        let (off, len) = (op.slba * bs, op.nlb as u64 * bs);
        let what = format!("op {} ({:?} {}+{} on queue {})", op.id, op.kind, op.slba, op.nlb, op.queue);
        if !status.is_success() {
            let (expected, faults) = match &op.kind {
                Kind::Read | Kind::Verify => (Status::UNRECOVERED_READ_ERROR, vec![Fault::Read { off, len }]),
                Kind::Write { .. } => (Status::WRITE_FAULT, vec![Fault::Write { off, len }, Fault::FlushRange { off, len }]),
                Kind::Zeroes { .. } => (Status::WRITE_FAULT, vec![Fault::Zeroes { off, len }, Fault::FlushRange { off, len }]),
                // The target deallocates the ranges in order and stops at the first that
                // fails: any range may be the one. Which command met which fault is
                // settled over all of them (`SimDisk::take_fault`): two commands may share
                // a range (seeds 281479, 469091).
                Kind::Deallocate(r) => {
                    (Status::WRITE_FAULT, r.iter().map(|(s, n)| Fault::Zeroes { off: s * bs, len: *n as u64 * bs }).collect())
                }
                Kind::Flush => (Status::WRITE_FAULT, vec![Fault::Flush]),
            };
            if !same(status, expected) {
                return Err(format!("{what} completed with {status}, expected success or {expected}"));
            }
            if !disk.take_fault(&faults) {
                return Err(format!("{what} completed with {status}, but the disk failed no such operation"));
            }
            self.faults_seen += 1;
            // A failed verification leaves its blocks as uncertain as the crash left them.
            self.settle(op.id, false, false, now);
            return Ok(());
        }
        match &op.kind {
            Kind::Read | Kind::Verify => {
                if data.len() as u64 != len {
                    return Err(format!("{what} returned {} bytes, expected {len}", data.len()));
                }
                for (i, block) in data.chunks(self.block_size).enumerate() {
                    let lba = op.slba + i as u64;
                    let allowed = match op.kind {
                        Kind::Read => self.readable(lba as usize, op.issued),
                        _ => self.survivors(lba as usize),
                    };
                    let got = decode(block, lba).map_err(|e| format!("{what}: block {lba} {e}"))?;
                    if !allowed.contains(&got) {
                        let when = if let Kind::Read = op.kind { "now" } else { "after the crash" };
                        return Err(format!("{what}: block {lba} holds write {got}; {when} it may hold only {allowed:?} (0: zeros)"));
                    }
                    if let Kind::Verify = op.kind {
                        let base = Rec { op: 0, value: got, issued: now, completed: now, definite: true, durable: true };
                        self.blocks[lba as usize] = vec![base];
                    }
                }
            }
            Kind::Write { fua } | Kind::Zeroes { fua } => {
                let fua = *fua;
                self.settle(op.id, true, fua, now);
            }
            Kind::Deallocate(_) => self.settle(op.id, true, false, now),
            Kind::Flush => self.durable_before(op.issued),
        }
        Ok(())
    }

    /// A point on the clock, for [`durable_before`](Self::durable_before).
    pub fn now(&mut self) -> Clock {
        self.tick()
    }

    /// Every write that succeeded before `at` is durable: a Flush issued at `at`, or a
    /// shutdown the controller reported complete, has made it so.
    pub fn durable_before(&mut self, at: Clock) {
        for h in &mut self.blocks {
            for r in h.iter_mut().filter(|r| r.definite && r.completed < at) {
                r.durable = true;
            }
        }
        self.prune();
    }

    /// The connection of these commands died: they may or may not have run.
    pub fn lost(&mut self, id: u64) {
        if let Some(op) = self.outstanding.remove(&id) {
            self.lost_total += 1;
            self.lost.push(op);
        }
    }

    /// The target has let go of every connection that died: lost writes landed by now or
    /// never will.
    pub fn settle_lost(&mut self) {
        let now = self.tick();
        for op in std::mem::take(&mut self.lost) {
            self.settle(op.id, false, false, now);
        }
    }

    /// Power failed: every command outstanding is lost, and nothing of it lands later.
    /// Afterwards a block may hold any write that survives; writes no longer supersede
    /// one another until a verification read or a new durable write says which it is.
    pub fn crash(&mut self) {
        let ids: Vec<u64> = self.outstanding.keys().copied().collect();
        for id in ids {
            self.lost(id);
        }
        self.settle_lost();
        let now = self.tick();
        for b in 0..self.blocks.len() {
            let keep = self.survivors(b);
            let h = &mut self.blocks[b];
            h.retain(|r| keep.contains(&r.value));
            // One of them is on the medium, durably; which one is not known.
            for r in h.iter_mut() {
                r.completed = now;
                r.definite = false;
                r.durable = false;
            }
            h.dedup_by_key(|r| r.value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::DiskProfile;
    use crate::trace::Trace;
    use nearstore_target::backend::Backend;

    const BS: usize = 512;

    /// A step of a case, on one block; ops are named by a letter.
    enum Step {
        Issue(char, Kind),
        Done(char),
        Lost(char),
        /// The target let go of the lost ops' connections.
        Settle,
        Crash,
        /// A verification read after the crash returns op `n`'s value.
        Verified(char),
    }
    use Step::*;

    fn w(fua: bool) -> Kind {
        Kind::Write { fua }
    }

    /// Runs `steps`, then a read (or a verification after a crash) issued at the end and
    /// completed with the value of op `value` ('0': zeros); Ok or the checker's complaint.
    fn check(steps: &[Step], read: Kind, value: char) -> Result<(), String> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().expect("runtime");
        rt.block_on(async {
            let disk = SimDisk::new(vec![vec![0; BS]], BS as u64, 1, DiskProfile { error_per_mille: 0 }, None, Trace::new(false));
            let mut m = Model::new(1, BS);
            let mut ids = std::collections::BTreeMap::new();
            for s in steps {
                match s {
                    Issue(n, k) => {
                        ids.insert(*n, m.issue(k.clone(), 0, 1, 1).id);
                    }
                    Done(n) => m.complete(ids[n], Status::SUCCESS, &[], &disk)?,
                    Lost(n) => m.lost(ids[n]),
                    Settle => m.settle_lost(),
                    Crash => m.crash(),
                    Verified(n) => {
                        let v = m.issue(Kind::Verify, 0, 1, 1).id;
                        m.complete(v, Status::SUCCESS, &block_bytes(ids[n], 0, BS), &disk)?;
                    }
                }
            }
            let r = m.issue(read, 0, 1, 1).id;
            let v = if value == '0' { 0 } else { ids[&value] };
            m.complete(r, Status::SUCCESS, &block_bytes(v, 0, BS), &disk)
        })
    }

    #[test]
    fn reads_and_crashes_return_only_what_may_be_there() {
        #[rustfmt::skip]
        let cases: Vec<(&str, Vec<Step>, Kind, char, bool)> = vec![
            ("a completed write is read", vec![Issue('a', w(false)), Done('a')], Kind::Read, 'a', true),
            ("what it overwrote is not", vec![Issue('a', w(false)), Done('a')], Kind::Read, '0', false),
            ("a write in flight may or may not be read", vec![Issue('a', w(false))], Kind::Read, '0', true),
            ("a write in flight may be read", vec![Issue('a', w(false))], Kind::Read, 'a', true),
            ("a later write supersedes", vec![Issue('a', w(false)), Done('a'), Issue('b', w(false)), Done('b')], Kind::Read, 'a', false),
            ("overlapping writes: either", vec![Issue('a', w(false)), Issue('b', w(false)), Done('b'), Done('a')], Kind::Read, 'a', true),
            ("overlapping writes: or the other", vec![Issue('a', w(false)), Issue('b', w(false)), Done('b'), Done('a')], Kind::Read, 'b', true),
            ("a lost write may land until settled", vec![Issue('a', w(false)), Lost('a'), Issue('b', w(false)), Done('b')], Kind::Read, 'a', true),
            ("a settled lost write is superseded", vec![Issue('a', w(false)), Lost('a'), Settle, Issue('b', w(false)), Done('b')], Kind::Read, 'a', false),
            ("an unflushed write may be lost in a crash", vec![Issue('a', w(false)), Done('a'), Crash], Kind::Verify, '0', true),
            ("or kept", vec![Issue('a', w(false)), Done('a'), Crash], Kind::Verify, 'a', true),
            ("a FUA write survives", vec![Issue('a', w(true)), Done('a'), Crash], Kind::Verify, '0', false),
            ("a write after it may be lost", vec![Issue('a', w(true)), Done('a'), Issue('b', w(false)), Done('b'), Crash], Kind::Verify, 'a', true),
            ("a flushed write survives", vec![Issue('a', w(false)), Done('a'), Issue('f', Kind::Flush), Done('f'), Crash], Kind::Verify, '0', false),
            ("a flush issued before the write completed does not cover it",
                vec![Issue('a', w(false)), Issue('f', Kind::Flush), Done('a'), Done('f'), Crash], Kind::Verify, '0', true),
            ("a write in flight at the crash may have landed", vec![Issue('a', w(false)), Crash], Kind::Verify, 'a', true),
            ("a verified block is the new baseline", vec![Issue('a', w(false)), Done('a'), Crash, Verified('a')], Kind::Read, 'a', true),
            ("what the crash may have kept is gone then", vec![Issue('a', w(false)), Done('a'), Crash, Verified('a')], Kind::Read, '0', false),
            ("a zeroed block reads as zeros", vec![Issue('a', w(true)), Done('a'), Issue('z', Kind::Zeroes { fua: false }), Done('z')], Kind::Read, '0', true),
        ];
        for (what, steps, read, value, ok) in cases {
            let r = check(&steps, read, value);
            assert_eq!(r.is_ok(), ok, "{what}: {r:?}");
        }
    }

    #[test]
    fn a_read_issued_before_a_durable_write_may_still_return_the_old_value() {
        // Found by seed 2: pruning at the FUA write's completion dropped the zeros the
        // read, still outstanding, had legitimately read.
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().expect("runtime");
        rt.block_on(async {
            let disk = SimDisk::new(vec![vec![0; BS]], BS as u64, 1, DiskProfile { error_per_mille: 0 }, None, Trace::new(false));
            let mut m = Model::new(1, BS);
            let r = m.issue(Kind::Read, 0, 1, 1).id;
            let a = m.issue(Kind::Write { fua: true }, 0, 1, 1).id;
            m.complete(a, Status::SUCCESS, &[], &disk).unwrap();
            m.complete(r, Status::SUCCESS, &block_bytes(0, 0, BS), &disk).unwrap();
        });
    }

    #[test]
    fn completions_and_statuses_are_checked() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().expect("runtime");
        rt.block_on(async {
            let failing = SimDisk::new(vec![vec![0; BS]], BS as u64, 1, DiskProfile { error_per_mille: 1000 }, None, Trace::new(false));
            let mut m = Model::new(1, BS);
            let a = m.issue(Kind::Write { fua: false }, 0, 1, 1).id;
            m.complete(a, Status::SUCCESS, &[], &failing).unwrap();
            let e = m.complete(a, Status::SUCCESS, &[], &failing).unwrap_err();
            assert!(e.contains("not outstanding"), "{e}");
            // A failed write with no fault behind it.
            let b = m.issue(Kind::Write { fua: false }, 0, 1, 1).id;
            let e = m.complete(b, Status::WRITE_FAULT, &[], &failing).unwrap_err();
            assert!(e.contains("failed no such operation"), "{e}");
            // With the fault, the status must be the one the fault calls for.
            assert!(failing.read_at(&mut [0; BS], 0).is_err());
            let c = m.issue(Kind::Read, 0, 1, 1).id;
            let e = m.complete(c, Status::WRITE_FAULT, &[], &failing).unwrap_err();
            assert!(e.contains("expected success or UNRECOVERED_READ_ERROR"), "{e}");
            let d = m.issue(Kind::Read, 0, 1, 1).id;
            m.complete(d, Status::UNRECOVERED_READ_ERROR, &[], &failing).unwrap();
            // A torn block.
            let r = m.issue(Kind::Read, 0, 1, 1).id;
            let mut torn = block_bytes(a, 0, BS);
            torn[300] ^= 1;
            let e = m.complete(r, Status::SUCCESS, &torn, &failing).unwrap_err();
            assert!(e.contains("torn"), "{e}");
        });
    }
}
