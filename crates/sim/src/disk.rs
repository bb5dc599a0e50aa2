//! The simulated disk: a [`Backend`] with a volatile write cache. Writes land in the
//! cache; Flush and FUA make them durable; a crash keeps, per block, the durable value or
//! any one of the cached writes (the seed chooses: a real disk may have written some of
//! its cache, in any order, before power went). I/O errors are injected by the seed per
//! operation; a failed write or zeroing may have changed any of its blocks, and a failed
//! flush may have made any of its blocks durable, as the specification allows. Every
//! injected error is noted, so the checker can match it to the status the host sees.

use std::io;
use std::sync::Arc;

use nearstore_target::backend::Backend;
use parking_lot::Mutex;
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;

use crate::trace::Trace;

/// How a run's disk fails, chosen by the seed.
#[derive(Clone, Debug)]
pub struct DiskProfile {
    /// Chance in a thousand that an operation fails.
    pub error_per_mille: u32,
}

/// A deliberate fault of the target's durability, to show the checker catches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskBug {
    /// Flush and FUA report success and make nothing durable.
    FlushIgnored,
}

/// An operation the disk failed on purpose: byte offset and length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    Read { off: u64, len: u64 },
    Write { off: u64, len: u64 },
    Zeroes { off: u64, len: u64 },
    Flush,
    FlushRange { off: u64, len: u64 },
}

struct Block {
    durable: Vec<u8>,
    /// Writes not yet durable, oldest first; the last is what a read returns.
    cached: Vec<Vec<u8>>,
}

impl Block {
    fn current(&self) -> &[u8] {
        self.cached.last().unwrap_or(&self.durable)
    }
    fn persist(&mut self) {
        if let Some(last) = self.cached.pop() {
            self.durable = last;
            self.cached.clear();
        }
    }
}

struct State {
    blocks: Vec<Block>,
    rng: XorShiftRng,
    profile: DiskProfile,
    bug: Option<DiskBug>,
    /// Crashed: this instance is gone, every operation fails and changes nothing.
    dead: bool,
    /// Every fault injected since the last [`SimDisk::forget_faults`].
    faults: Vec<Fault>,
    /// What each command that reported a fault could have met (its candidates).
    claims: Vec<Vec<Fault>>,
}

pub struct SimDisk {
    block_size: u64,
    state: Mutex<State>,
    trace: Trace,
}

fn eio() -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

/// The size of a maximum matching of claims to faults, each claim to a fault equal to
/// one of its candidates, each fault to one claim (Kuhn's augmenting paths: a session
/// has tens of faults at most).
fn matching(claims: &[Vec<Fault>], faults: &[Fault]) -> usize {
    fn augment(c: usize, claims: &[Vec<Fault>], faults: &[Fault], owner: &mut [Option<usize>], seen: &mut [bool]) -> bool {
        for (f, fault) in faults.iter().enumerate() {
            if seen[f] || !claims[c].contains(fault) {
                continue;
            }
            seen[f] = true;
            if owner[f].is_none_or(|o| augment(o, claims, faults, owner, seen)) {
                owner[f] = Some(c);
                return true;
            }
        }
        false
    }
    let mut owner = vec![None; faults.len()];
    (0..claims.len()).filter(|&c| augment(c, claims, faults, &mut owner, &mut vec![false; faults.len()])).count()
}

impl SimDisk {
    /// A disk whose medium holds `medium` (one buffer per block, all of `block_size`).
    pub fn new(medium: Vec<Vec<u8>>, block_size: u64, seed: u64, profile: DiskProfile, bug: Option<DiskBug>, trace: Trace) -> Arc<SimDisk> {
        let blocks = medium.into_iter().map(|durable| Block { durable, cached: Vec::new() }).collect();
        let state =
            State { blocks, rng: XorShiftRng::seed_from_u64(seed), profile, bug, dead: false, faults: Vec::new(), claims: Vec::new() };
        Arc::new(SimDisk { block_size, state: Mutex::new(state), trace })
    }

    /// Power fails: returns what the medium holds, and this disk is dead from now on.
    pub fn crash(&self) -> Vec<Vec<u8>> {
        let mut s = self.state.lock();
        s.dead = true;
        let mut blocks = std::mem::take(&mut s.blocks);
        let mut kept = 0;
        for b in &mut blocks {
            // 0: the durable value; k: the k-th cached write reached the medium last.
            let k = s.rng.random_range(0..=b.cached.len());
            if k > 0 {
                b.durable = std::mem::take(&mut b.cached[k - 1]);
                kept += 1;
            }
        }
        drop(s);
        self.trace.event(format_args!("disk crash: {kept} blocks keep a cached write"));
        blocks.into_iter().map(|b| b.durable).collect()
    }

    /// Notes that a command reported a fault it could have met in any of `candidates`;
    /// false when the faults injected cannot account for it together with every command
    /// that reported one before. The faults are matched to the commands as a whole (a
    /// bipartite matching), never greedily: a deallocate of (57, 6) then (37, 5) that
    /// failed on its first range must not take the fault of another command's (37, 5)
    /// that failed after it (seed 469091).
    pub fn take_fault(&self, candidates: &[Fault]) -> bool {
        let mut s = self.state.lock();
        s.claims.push(candidates.to_vec());
        if matching(&s.claims, &s.faults) == s.claims.len() {
            return true;
        }
        s.claims.pop();
        false
    }

    /// Forgets the faults not matched: at the end of a session whose lost commands may
    /// have been the ones that met them.
    pub fn forget_faults(&self) {
        let mut s = self.state.lock();
        s.faults.clear();
        s.claims.clear();
    }

    /// Faults injected and not matched to a completion.
    pub fn faults_left(&self) -> usize {
        let s = self.state.lock();
        s.faults.len() - s.claims.len()
    }

    /// The blocks of a byte range, or an error the target would report as an I/O error.
    fn blocks(&self, s: &State, off: u64, len: u64) -> io::Result<std::ops::Range<usize>> {
        let bs = self.block_size;
        let end = off.checked_add(len).filter(|e| *e <= s.blocks.len() as u64 * bs);
        match end {
            Some(end) if off.is_multiple_of(bs) && len.is_multiple_of(bs) => Ok((off / bs) as usize..(end / bs) as usize),
            _ => Err(io::Error::new(io::ErrorKind::InvalidInput, format!("unaligned or out of range: {off}+{len}"))),
        }
    }

    /// Whether this operation fails: notes the fault.
    fn fails(&self, s: &mut State, fault: Fault) -> bool {
        let fail = s.profile.error_per_mille > 0 && s.rng.random_range(0..1000) < s.profile.error_per_mille;
        if fail {
            s.faults.push(fault);
        }
        fail
    }

    fn write_blocks(&self, what: &str, off: u64, len: u64, fault: Fault, data: impl Fn(usize) -> Vec<u8>) -> io::Result<()> {
        let mut s = self.state.lock();
        if s.dead {
            return Err(eio());
        }
        let range = self.blocks(&s, off, len)?;
        let failed = self.fails(&mut s, fault);
        let mut landed = 0;
        for (i, b) in range.clone().enumerate() {
            // A failed write may have changed any of its blocks.
            if !failed || s.rng.random_bool(0.5) {
                let v = data(i);
                s.blocks[b].cached.push(v);
                landed += 1;
            }
        }
        drop(s);
        let (lba, n) = (range.start, range.len());
        if failed {
            self.trace.event(format_args!("disk {what} {lba}+{n} FAILED ({landed} blocks landed)"));
            return Err(eio());
        }
        self.trace.event(format_args!("disk {what} {lba}+{n}"));
        Ok(())
    }

    fn persist(&self, what: &str, range: Option<(u64, u64)>) -> io::Result<()> {
        let mut s = self.state.lock();
        if s.dead {
            return Err(eio());
        }
        let blocks = match range {
            Some((off, len)) => self.blocks(&s, off, len)?,
            None => 0..s.blocks.len(),
        };
        let fault = match range {
            Some((off, len)) => Fault::FlushRange { off, len },
            None => Fault::Flush,
        };
        let failed = self.fails(&mut s, fault);
        if s.bug == Some(DiskBug::FlushIgnored) && !failed {
            drop(s);
            self.trace.event(format_args!("disk {what} {blocks:?} ignored (bug)"));
            return Ok(());
        }
        for b in blocks.clone() {
            // A failed flush may have made any of its blocks durable.
            if !failed || s.rng.random_bool(0.5) {
                s.blocks[b].persist();
            }
        }
        drop(s);
        if failed {
            self.trace.event(format_args!("disk {what} {blocks:?} FAILED"));
            return Err(eio());
        }
        self.trace.event(format_args!("disk {what} {blocks:?}"));
        Ok(())
    }
}

impl Backend for SimDisk {
    fn describe(&self) -> String {
        format!("simulated disk ({} blocks of {} bytes)", self.state.lock().blocks.len(), self.block_size)
    }

    fn size(&self) -> u64 {
        self.state.lock().blocks.len() as u64 * self.block_size
    }

    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let mut s = self.state.lock();
        if s.dead {
            return Err(eio());
        }
        let len = buf.len() as u64;
        let range = self.blocks(&s, off, len)?;
        if self.fails(&mut s, Fault::Read { off, len }) {
            drop(s);
            self.trace.event(format_args!("disk read {}+{} FAILED", range.start, range.len()));
            return Err(eio());
        }
        let bs = self.block_size as usize;
        for (i, b) in range.clone().enumerate() {
            buf[i * bs..(i + 1) * bs].copy_from_slice(s.blocks[b].current());
        }
        drop(s);
        self.trace.event(format_args!("disk read {}+{}", range.start, range.len()));
        Ok(())
    }

    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        let bs = self.block_size as usize;
        let len = buf.len() as u64;
        self.write_blocks("write", off, len, Fault::Write { off, len }, |i| buf[i * bs..(i + 1) * bs].to_vec())
    }

    fn flush(&self) -> io::Result<()> {
        self.persist("flush", None)
    }

    fn flush_range(&self, off: u64, len: u64) -> io::Result<()> {
        self.persist("flush-range", Some((off, len)))
    }

    fn write_zeroes(&self, off: u64, len: u64, deallocate: bool) -> io::Result<()> {
        let what = if deallocate { "deallocate" } else { "zeroes" };
        let bs = self.block_size as usize;
        self.write_blocks(what, off, len, Fault::Zeroes { off, len }, |_| vec![0; bs])
    }

    /// Reads and writes cost a memcpy: they run on the connection's task, as a memory
    /// namespace's do (write zeroes and deallocate still go to the I/O pool).
    fn inline(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: usize = 512;

    fn disk(blocks: usize, seed: u64, error_per_mille: u32, bug: Option<DiskBug>) -> Arc<SimDisk> {
        SimDisk::new(vec![vec![0; BS]; blocks], BS as u64, seed, DiskProfile { error_per_mille }, bug, Trace::new(false))
    }

    fn block(v: u8) -> Vec<u8> {
        vec![v; BS]
    }

    /// Writes `values` to block 0 one after another, flushing after the index `flushed`;
    /// returns what block 0 holds after a crash.
    fn crash_after(seed: u64, values: &[u8], flushed: Option<usize>, bug: Option<DiskBug>) -> u8 {
        let d = disk(1, seed, 0, bug);
        for (i, v) in values.iter().enumerate() {
            d.write_at(&block(*v), 0).unwrap();
            if flushed == Some(i) {
                d.flush().unwrap();
            }
        }
        let medium = d.crash();
        assert!(d.read_at(&mut [0; BS], 0).is_err(), "a crashed disk does no more I/O");
        medium[0][0]
    }

    #[test]
    fn a_crash_keeps_the_durable_value_or_one_cached_write() {
        // (writes, flushed after index, what may survive)
        #[rustfmt::skip]
        let cases: &[(&[u8], Option<usize>, &[u8])] = &[
            (&[1], None, &[0, 1]),
            (&[1, 2, 3], None, &[0, 1, 2, 3]),
            (&[1, 2, 3], Some(0), &[1, 2, 3]),
            (&[1, 2, 3], Some(2), &[3]),
        ];
        for &(values, flushed, allowed) in cases {
            let mut seen = std::collections::BTreeSet::new();
            for seed in 0..200 {
                let v = crash_after(seed, values, flushed, None);
                assert!(allowed.contains(&v), "{values:?} flushed after {flushed:?}: block holds {v}");
                seen.insert(v);
            }
            // The seed does choose: every allowed outcome happens.
            assert_eq!(seen.into_iter().collect::<Vec<_>>(), allowed, "{values:?} flushed after {flushed:?}");
        }
    }

    #[test]
    fn fua_makes_only_its_range_durable() {
        for seed in 0..50 {
            let d = disk(2, seed, 0, None);
            d.write_at(&[block(1), block(2)].concat(), 0).unwrap();
            d.flush_range(BS as u64, BS as u64).unwrap();
            let medium = d.crash();
            assert_eq!(medium[1][0], 2);
            assert!(medium[0][0] == 0 || medium[0][0] == 1);
        }
    }

    #[test]
    fn a_flush_that_does_not_flush_loses_writes() {
        let lost = (0..50).filter(|&seed| crash_after(seed, &[1], Some(0), Some(DiskBug::FlushIgnored)) == 0).count();
        assert!(lost > 0, "the broken flush never lost a write");
    }

    #[test]
    fn injected_errors_are_noted_and_a_failed_write_may_have_landed() {
        let mut landed = 0;
        for seed in 0..50 {
            let d = disk(4, seed, 1000, None);
            let data = [block(1), block(1), block(1), block(1)].concat();
            assert_eq!(d.write_at(&data, 0).unwrap_err().raw_os_error(), Some(libc::EIO));
            assert!(d.take_fault(&[Fault::Write { off: 0, len: 4 * BS as u64 }]));
            assert!(!d.take_fault(&[Fault::Write { off: 0, len: 4 * BS as u64 }]), "a fault is matched once");
            assert!(d.flush().is_err());
            assert_eq!(d.faults_left(), 1);
            d.forget_faults();
            assert_eq!(d.faults_left(), 0);
            landed += d.state.lock().blocks.iter().filter(|b| b.current()[0] == 1).count();
        }
        assert!(landed > 0 && landed < 200, "failed writes landed on {landed} of 200 blocks");
        // Faults go to the commands as a whole, whatever order they complete in: a
        // deallocate of (2, 6) then (26, 8) that failed on either range, and another
        // command's (2, 6) (seed 281479, and 469091 the other way round).
        let (a, b) = (Fault::Zeroes { off: 2 * BS as u64, len: 6 * BS as u64 }, Fault::Zeroes { off: 26 * BS as u64, len: 8 * BS as u64 });
        for (first, second) in [(vec![b, a], vec![a]), (vec![a], vec![b, a]), (vec![a, b], vec![a])] {
            let d = disk(40, 0, 1000, None);
            assert!(d.write_zeroes(2 * BS as u64, 6 * BS as u64, true).is_err());
            assert!(d.write_zeroes(26 * BS as u64, 8 * BS as u64, true).is_err());
            assert!(d.take_fault(&first), "{first:?}");
            assert!(d.take_fault(&second), "the other command's fault is still there: {first:?} then {second:?}");
            assert_eq!(d.faults_left(), 0);
            assert!(!d.take_fault(&[a, b]), "no third fault to match");
        }
        // Not the target's to see as a fault: misaligned or beyond the end.
        let d = disk(1, 0, 0, None);
        assert_eq!(d.read_at(&mut [0; 100], 0).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(d.write_at(&block(1), BS as u64).unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }
}
