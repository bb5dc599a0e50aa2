//! The power-cut test's model (tests/kernel/powercut.sh, docs/crash-testing.md): how a
//! block is stamped, what a host may expect of every block after a cut, and the check of
//! what a cut left.
//!
//! A block's *version* is the sequence number of the write that put it there; version 0
//! is the zeros the namespace starts with. Per block the model keeps the last version
//! acknowledged durable (a FUA write completed, or a write completed before a Flush was
//! sent that then completed), the last version acknowledged at all, and every version
//! issued after the durable one. After a cut a block must hold its durable version or one
//! of those issued later (a write in flight or not yet flushed may or may not have landed,
//! as a whole block). Anything else, an older version, zeros, another block's data, a
//! torn block, is a lost write.
//!
//! Writes to one block are never in flight together, so a block's versions complete in
//! the order they were issued, and "later" means a higher version.
//!
//! A fused write (FUSED WRITE, write-checksum, on a namespace with a MicroTx journal) is
//! durable when it completes, as a FUA write is, and atomic: one in flight at a cut must
//! be whole (every block holds its version) or absent (none does), as the outcome the
//! target gives for its transaction id after the reboot says ([`Model::check_fused`]).

use serde::{Deserialize, Serialize};

/// Bytes per block: the namespace's logical block size.
pub const BLOCK: usize = 4096;
const MAGIC: &[u8; 8] = b"NSPOWCUT";
/// Where the CRC32C of the bytes before it sits.
const CRC_AT: usize = BLOCK - 4;

/// Fills `out` (one block) with version `version` of block `lba` of run `run`: magic,
/// run, LBA, version (little-endian), bytes derived from all three, and a CRC32C.
pub fn stamp(run: u64, lba: u64, version: u64, out: &mut [u8]) {
    assert_eq!(out.len(), BLOCK, "one block");
    out[..8].copy_from_slice(MAGIC);
    out[8..16].copy_from_slice(&run.to_le_bytes());
    out[16..24].copy_from_slice(&lba.to_le_bytes());
    out[24..32].copy_from_slice(&version.to_le_bytes());
    // xorshift64 from the three, so no two versions of a block look alike.
    let mut x = (run ^ lba.rotate_left(21) ^ version.rotate_left(42)).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for w in out[32..CRC_AT].chunks_exact_mut(4) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&(x as u32).to_le_bytes());
    }
    let crc = crc32c::crc32c(&out[..CRC_AT]);
    out[CRC_AT..].copy_from_slice(&crc.to_le_bytes());
}

/// What one block read back holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Content {
    Zeros,
    Stamp {
        run: u64,
        lba: u64,
        version: u64,
    },
    /// Neither zeros nor a whole stamped block: why.
    Torn(&'static str),
}

pub fn decode(block: &[u8]) -> Content {
    if block.len() != BLOCK {
        return Content::Torn("not one block long");
    }
    if block.iter().all(|&b| b == 0) {
        return Content::Zeros;
    }
    if &block[..8] != MAGIC {
        return Content::Torn("no stamp");
    }
    let crc = u32::from_le_bytes([block[CRC_AT], block[CRC_AT + 1], block[CRC_AT + 2], block[CRC_AT + 3]]);
    if crc32c::crc32c(&block[..CRC_AT]) != crc {
        return Content::Torn("checksum mismatch");
    }
    let field = |at: usize| u64::from_le_bytes(block[at..at + 8].try_into().expect("8 bytes"));
    Content::Stamp { run: field(8), lba: field(16), version: field(24) }
}

/// One block's expectations.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Block {
    /// The last version acknowledged durable.
    pub durable: u64,
    /// The last version acknowledged (durable or not).
    pub acked: u64,
    /// Versions issued after `durable`, in order: any of them may have landed.
    pub later: Vec<u64>,
}

/// The state a run keeps between boots (a JSON file on the host).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Model {
    /// Stamped into every block: data of another run is never taken for ours.
    pub run: u64,
    /// The version the next write gets.
    pub next_version: u64,
    /// Cuts so far.
    pub cuts: u64,
    /// The last cut ended a control phase (no FUA, no Flush): it must have lost writes.
    pub control: bool,
    pub blocks: Vec<Block>,
    /// Fused writes in flight at the last cut.
    #[serde(default)]
    pub fused: Vec<FusedWrite>,
}

/// A fused write of stamped blocks: its transaction id, blocks and version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FusedWrite {
    pub txid: u64,
    pub lba: u64,
    pub n: u64,
    pub version: u64,
}

/// What the target says became of a fused write's transaction (OUTCOME after a reboot).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FusedOutcome {
    Committed,
    RolledBack,
    Unknown,
    Failed,
}

/// What a check found wrong with one block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loss {
    pub lba: u64,
    pub what: String,
}

/// What a cut left, over all blocks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    pub losses: Vec<Loss>,
    /// Blocks that hold their durable version.
    pub held_durable: u64,
    /// Blocks that hold a version issued after their durable one.
    pub held_later: u64,
    /// Blocks whose last acknowledged (not durable) version was lost, as allowed.
    pub lost_unflushed: u64,
}

impl Model {
    pub fn new(run: u64, blocks: u64) -> Model {
        Model { run, next_version: 1, cuts: 0, control: false, blocks: vec![Block::default(); blocks as usize], fused: Vec::new() }
    }

    /// Checks a fused write that was in flight at the cut against what its blocks hold now
    /// (`read(lba)`) and its transaction's outcome: whole when committed, absent when rolled
    /// back or unknown (its records never durable), never part of it; a crash never makes
    /// it failed. Ok(true): whole.
    pub fn check_fused(&self, f: &FusedWrite, outcome: FusedOutcome, read: impl Fn(u64) -> Vec<u8>) -> Result<bool, Loss> {
        let holding = (f.lba..f.lba + f.n)
            .filter(|&lba| matches!(decode(&read(lba)), Content::Stamp { run, lba: at, version } if run == self.run && at == lba && version == f.version))
            .count() as u64;
        let loss =
            |what: String| Loss { lba: f.lba, what: format!("fused write {} of {} blocks (version {}): {what}", f.txid, f.n, f.version) };
        match (outcome, holding) {
            (FusedOutcome::Committed, h) if h == f.n => Ok(true),
            (FusedOutcome::RolledBack | FusedOutcome::Unknown, 0) => Ok(false),
            (FusedOutcome::Failed, _) => Err(loss("failed, though only the power went".into())),
            (o, h) if h != 0 && h != f.n => Err(loss(format!("torn: {h} of its blocks hold it ({o:?})"))),
            (o, h) => Err(loss(format!("{o:?}, but {h} of its blocks hold it"))),
        }
    }

    fn range(&mut self, lba: u64, n: u64) -> &mut [Block] {
        &mut self.blocks[lba as usize..(lba + n) as usize]
    }

    /// A write of `n` blocks at `lba` is about to be sent: its version.
    pub fn issue(&mut self, lba: u64, n: u64) -> u64 {
        let v = self.next_version;
        self.next_version += 1;
        self.range(lba, n).iter_mut().for_each(|b| b.later.push(v));
        v
    }

    /// The write `version` of `n` blocks at `lba` completed successfully.
    pub fn completed(&mut self, lba: u64, n: u64, version: u64, fua: bool) {
        for b in self.range(lba, n) {
            b.acked = b.acked.max(version);
            if fua {
                make_durable(b, version);
            }
        }
    }

    /// A Flush is about to be sent: what it will make durable (every block's last
    /// completed version; writes completing later are not covered).
    pub fn flush_sent(&self) -> Vec<u64> {
        self.blocks.iter().map(|b| b.acked).collect()
    }

    /// The Flush sent with `covers` completed successfully.
    pub fn flush_completed(&mut self, covers: &[u64]) {
        for (b, &v) in self.blocks.iter_mut().zip(covers) {
            make_durable(b, v);
        }
    }

    /// Checks one block read back after a cut: the version it holds, or the loss.
    pub fn check(&self, lba: u64, block: &[u8]) -> Result<u64, Loss> {
        let loss = |what: String| Loss { lba, what };
        let b = self.blocks.get(lba as usize).ok_or_else(|| loss("outside the tested range".into()))?;
        let version = match decode(block) {
            Content::Zeros => 0,
            Content::Torn(why) => return Err(loss(format!("torn or foreign block ({why}); durable version {}", b.durable))),
            Content::Stamp { run, .. } if run != self.run => {
                return Err(loss(format!("holds data of run {run:#x}, not of this run {:#x}", self.run)))
            }
            Content::Stamp { lba: at, version, .. } if at != lba => {
                return Err(loss(format!("holds version {version} of LBA {at} (a misdirected write)")))
            }
            Content::Stamp { version, .. } => version,
        };
        if version == b.durable || b.later.contains(&version) {
            return Ok(version);
        }
        let held = if version == 0 { "zeros".to_string() } else { format!("version {version}") };
        Err(loss(if version < b.durable {
            format!("lost its durable version {}: holds {held}, older", b.durable)
        } else {
            format!("holds {held}, never written there (durable version {})", b.durable)
        }))
    }

    /// Checks every block (`held[i]` is block i read back) and makes what they hold the
    /// new starting point: it was read from the disk after a reboot, so it is durable,
    /// and what did not land by now never will.
    pub fn settle(&mut self, read: impl Fn(u64) -> Vec<u8>) -> Verdict {
        let mut v = Verdict::default();
        let mut held = Vec::with_capacity(self.blocks.len());
        for lba in 0..self.blocks.len() as u64 {
            let b = &self.blocks[lba as usize];
            match self.check(lba, &read(lba)) {
                Ok(version) => {
                    if version == b.durable {
                        v.held_durable += 1;
                    } else {
                        v.held_later += 1;
                    }
                    if version < b.acked {
                        v.lost_unflushed += 1;
                    }
                    held.push(version);
                }
                Err(loss) => {
                    v.losses.push(loss);
                    held.push(b.durable);
                }
            }
        }
        for (b, version) in self.blocks.iter_mut().zip(held) {
            *b = Block { durable: version, acked: version, later: Vec::new() };
        }
        v
    }
}

fn make_durable(b: &mut Block, version: u64) {
    if version > b.durable {
        b.durable = version;
        b.later.retain(|&v| v > version);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RUN: u64 = 0xabc;

    fn stamped(run: u64, lba: u64, version: u64) -> Vec<u8> {
        let mut b = vec![0; BLOCK];
        stamp(run, lba, version, &mut b);
        b
    }

    #[test]
    fn stamps_decode_and_damage_is_seen() {
        let b = stamped(RUN, 7, 9);
        assert_eq!(decode(&b), Content::Stamp { run: RUN, lba: 7, version: 9 });
        assert_ne!(b[32..CRC_AT], stamped(RUN, 7, 10)[32..CRC_AT], "versions differ in their bytes");
        // (what, the damage, what the block decodes to)
        type Case = (&'static str, fn(&mut Vec<u8>), Content);
        let cases: &[Case] = &[
            ("zeros", |b| b.fill(0), Content::Zeros),
            ("a flipped payload bit", |b| b[100] ^= 1, Content::Torn("checksum mismatch")),
            ("a flipped version bit", |b| b[24] ^= 1, Content::Torn("checksum mismatch")),
            ("the second half zeroed (a torn write)", |b| b[BLOCK / 2..].fill(0), Content::Torn("checksum mismatch")),
            ("the first sector zeroed", |b| b[..512].fill(0), Content::Torn("no stamp")),
            ("short", |b| b.truncate(512), Content::Torn("not one block long")),
        ];
        for (name, damage, want) in cases {
            let mut d = b.clone();
            damage(&mut d);
            assert_eq!(decode(&d), *want, "{name}");
        }
    }

    /// A model of one block (LBA 3 of 8) with the given expectations.
    fn one(durable: u64, acked: u64, later: &[u64]) -> Model {
        let mut m = Model::new(RUN, 8);
        m.blocks[3] = Block { durable, acked, later: later.to_vec() };
        m
    }

    #[test]
    fn check_accepts_the_durable_or_a_later_version_only() {
        // (durable, acked, later, what LBA 3 holds, Ok(version) or Err(part of the message))
        type Case = (u64, u64, &'static [u64], Vec<u8>, Result<u64, &'static str>);
        let torn = {
            let mut b = stamped(RUN, 3, 5);
            b[BLOCK - 100..].fill(0);
            b
        };
        let cases: Vec<Case> = vec![
            (0, 0, &[], vec![0; BLOCK], Ok(0)),
            (5, 5, &[], stamped(RUN, 3, 5), Ok(5)),
            (5, 7, &[7], stamped(RUN, 3, 7), Ok(7)),
            (5, 7, &[7], stamped(RUN, 3, 5), Ok(5)),
            (5, 7, &[7, 9], stamped(RUN, 3, 9), Ok(9)),
            (0, 4, &[4], vec![0; BLOCK], Ok(0)),
            (0, 0, &[4], stamped(RUN, 3, 4), Ok(4)),
            (5, 5, &[], stamped(RUN, 3, 2), Err("lost its durable version 5: holds version 2, older")),
            (5, 5, &[], vec![0; BLOCK], Err("lost its durable version 5: holds zeros, older")),
            (5, 9, &[9], stamped(RUN, 3, 8), Err("holds version 8, never written there")),
            (5, 5, &[], stamped(RUN, 3, 6), Err("holds version 6, never written there")),
            (5, 5, &[], stamped(RUN, 4, 5), Err("holds version 5 of LBA 4 (a misdirected write)")),
            (5, 5, &[], stamped(RUN + 1, 3, 5), Err("holds data of run 0xabd")),
            (5, 5, &[], torn, Err("torn or foreign block (checksum mismatch)")),
            (0, 0, &[], vec![0xff; BLOCK], Err("torn or foreign block (no stamp)")),
        ];
        for (i, (durable, acked, later, block, want)) in cases.into_iter().enumerate() {
            let got = one(durable, acked, later).check(3, &block);
            match (got, want) {
                (Ok(v), Ok(w)) => assert_eq!(v, w, "case {i}"),
                (Err(loss), Err(w)) => assert!(loss.what.contains(w), "case {i}: {:?} does not say {w:?}", loss.what),
                (got, want) => panic!("case {i}: got {got:?}, want {want:?}"),
            }
        }
    }

    /// One step of a host's life: what it sends and what completes.
    #[derive(Clone, Copy, Debug)]
    enum Step {
        /// Issue a write of (lba, n): it gets the next version.
        Issue(u64, u64),
        /// The write with this version at (lba, n) completed, with FUA or not.
        Done(u64, u64, u64, bool),
        /// A Flush is sent (its coverage is kept until FlushDone).
        FlushSent,
        FlushDone,
    }

    #[test]
    fn durability_follows_fua_and_completed_flushes() {
        use Step::*;
        // (steps, block 0's expected (durable, later) and acked afterwards)
        type Case = (&'static [Step], (u64, &'static [u64]), u64);
        let cases: &[Case] = &[
            (&[Issue(0, 1), Done(0, 1, 1, false)], (0, &[1]), 1),
            (&[Issue(0, 1), Done(0, 1, 1, true)], (1, &[]), 1),
            (&[Issue(0, 2), Done(0, 2, 1, false), FlushSent, FlushDone], (1, &[]), 1),
            // A Flush sent before the write completed does not cover it.
            (&[Issue(0, 1), FlushSent, Done(0, 1, 1, false), FlushDone], (0, &[1]), 1),
            // A Flush that never completed covers nothing.
            (&[Issue(0, 1), Done(0, 1, 1, false), FlushSent], (0, &[1]), 1),
            // A later plain write keeps the FUA version durable; both may be on disk.
            (&[Issue(0, 1), Done(0, 1, 1, true), Issue(0, 1), Done(0, 1, 2, false)], (1, &[2]), 2),
            // A write in flight at the cut may land.
            (&[Issue(0, 1), Done(0, 1, 1, true), Issue(0, 1)], (1, &[2]), 1),
            // A later FUA write makes earlier versions impossible.
            (&[Issue(0, 1), Done(0, 1, 1, false), Issue(0, 1), Done(0, 1, 2, true), Issue(0, 1)], (2, &[3]), 2),
            // A Flush covers what completed before it even if a FUA write came between.
            (&[Issue(0, 1), Done(0, 1, 1, false), FlushSent, Issue(1, 1), Done(1, 1, 2, true), FlushDone], (1, &[]), 1),
        ];
        for (i, (steps, (durable, later), acked)) in cases.iter().enumerate() {
            let mut m = Model::new(RUN, 4);
            let mut covers = Vec::new();
            for s in steps.iter() {
                match *s {
                    Issue(lba, n) => {
                        m.issue(lba, n);
                    }
                    Done(lba, n, v, fua) => m.completed(lba, n, v, fua),
                    FlushSent => covers = m.flush_sent(),
                    FlushDone => m.flush_completed(&covers),
                }
            }
            let want = Block { durable: *durable, acked: *acked, later: later.to_vec() };
            assert_eq!(m.blocks[0], want, "case {i}: {steps:?}");
        }
    }

    #[test]
    fn settle_counts_and_restarts_from_what_was_read() {
        let mut m = Model::new(RUN, 4);
        m.blocks[0] = Block { durable: 2, acked: 4, later: vec![4] };
        m.blocks[1] = Block { durable: 3, acked: 5, later: vec![5, 6] };
        m.blocks[2] = Block { durable: 7, acked: 7, later: vec![] };
        let disk = [stamped(RUN, 0, 2), stamped(RUN, 1, 6), stamped(RUN, 2, 1), vec![0; BLOCK]];
        let v = m.settle(|lba| disk[lba as usize].clone());
        assert_eq!((v.held_durable, v.held_later, v.lost_unflushed), (2, 1, 1));
        assert_eq!(v.losses, vec![Loss { lba: 2, what: "lost its durable version 7: holds version 1, older".into() }]);
        let now: Vec<(u64, u64, usize)> = m.blocks.iter().map(|b| (b.durable, b.acked, b.later.len())).collect();
        assert_eq!(now, vec![(2, 2, 0), (6, 6, 0), (7, 7, 0), (0, 0, 0)]);
    }

    /// A fused write in flight at a cut: whole with a committed outcome, absent with a
    /// rolled-back or unknown one; anything else (part of it, an outcome its blocks
    /// contradict, failed) is a loss.
    #[test]
    fn a_fused_write_is_whole_or_absent_as_its_outcome_says() {
        use FusedOutcome::*;
        let m = Model::new(RUN, 8);
        let f = FusedWrite { txid: 77, lba: 2, n: 3, version: 9 };
        // (blocks 2, 3, 4 hold version 9?, outcome, Ok(whole) or the loss's words)
        let cases: [([bool; 3], FusedOutcome, Result<bool, &str>); 8] = [
            ([true; 3], Committed, Ok(true)),
            ([false; 3], RolledBack, Ok(false)),
            ([false; 3], Unknown, Ok(false)),
            ([true, true, false], Committed, Err("torn: 2 of its blocks hold it")),
            ([false, true, false], RolledBack, Err("torn: 1 of its blocks hold it")),
            ([false; 3], Committed, Err("Committed, but 0 of its blocks hold it")),
            ([true; 3], RolledBack, Err("RolledBack, but 3 of its blocks hold it")),
            ([true; 3], Failed, Err("failed, though only the power went")),
        ];
        for (i, (holds, outcome, want)) in cases.into_iter().enumerate() {
            let read = |lba: u64| match lba.checked_sub(2).map(|k| holds[k as usize]) {
                Some(true) => stamped(RUN, lba, 9),
                _ => stamped(RUN, lba, 4),
            };
            match (m.check_fused(&f, outcome, read), want) {
                (Ok(w), Ok(want)) => assert_eq!(w, want, "case {i}"),
                (Err(loss), Err(w)) => assert!(loss.what.contains(w) && loss.what.contains("fused write 77"), "case {i}: {:?}", loss.what),
                (got, want) => panic!("case {i}: got {got:?}, want {want:?}"),
            }
        }
    }
}
