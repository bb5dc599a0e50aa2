//! The MicroTx journal under power cuts (docs/simulation.md, "The MicroTx journal"): a
//! seeded run of transactions and plain flushed writes on two simulated disks (the
//! journal's and the namespace's) with volatile write caches; power fails after a number of
//! their operations the seed chooses, inside a transaction or inside a replay, the disks
//! keep per block their durable value or any one cached write, the target starts again and
//! replays its journal. The checker holds a model of the namespace: after every start each
//! block equals it, every acknowledged transaction and flushed write whole, the one in
//! flight whole or absent as its outcome says (never torn; unknown, and then absent, only
//! when the power failed before its BEGIN was durable), and every
//! acknowledged transaction's outcome still the result the host was given.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use nearstore_target::backend::Backend;
use nearstore_target::microtx::{result_of, FlushBug, Journal, Outcome, Tx};
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;

use crate::disk::{DiskBug, DiskProfile, SimDisk};
use crate::trace::Trace;

const BLOCK: u64 = 4096;
/// The namespace: 64 blocks, so that transactions overlap one another and plain writes.
const DATA_BLOCKS: usize = 64;
/// A small journal (its smallest size is about 300 KiB), so that it fills and checkpoints
/// within a run.
const JOURNAL_BLOCKS: usize = 256;
/// Starts (lives) per seed, each ended by a power cut.
const LIVES: u64 = 12;

/// What a run may break on purpose, to show the checker catches it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Bugs {
    pub journal: Option<FlushBug>,
    pub data_disk: Option<DiskBug>,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    pub transactions: u64,
    /// Groups of two or more transactions run as one (group commit).
    pub groups: u64,
    pub cuts: u64,
    /// Cuts inside a transaction whose replay finished it.
    pub finished: u64,
    /// Cuts inside a transaction whose replay rolled it back.
    pub rolled_back: u64,
}

/// Power for both disks: the operations left before it fails (then each fails and changes
/// nothing, until the disks are crashed and the target starts again).
struct Powered {
    disk: Arc<SimDisk>,
    left: Arc<AtomicU64>,
}

impl Powered {
    fn on(&self) -> io::Result<()> {
        self.left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .map(|_| ())
            .map_err(|_| io::Error::other("power cut"))
    }
}

impl Backend for Powered {
    fn describe(&self) -> String {
        self.disk.describe()
    }
    fn size(&self) -> u64 {
        self.disk.size()
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.on()?;
        self.disk.read_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        self.on()?;
        self.disk.write_at(buf, off)
    }
    fn flush(&self) -> io::Result<()> {
        self.on()?;
        self.disk.flush()
    }
    fn flush_range(&self, off: u64, len: u64) -> io::Result<()> {
        self.on()?;
        self.disk.flush_range(off, len)
    }
    fn write_zeroes(&self, off: u64, len: u64, deallocate: bool) -> io::Result<()> {
        self.on()?;
        self.disk.write_zeroes(off, len, deallocate)
    }
}

fn apply(model: &mut [Vec<u8>], writes: &[(u64, Vec<u8>)]) {
    for (off, d) in writes {
        for (i, b) in d.chunks(BLOCK as usize).enumerate() {
            model[(off / BLOCK) as usize + i] = b.to_vec();
        }
    }
}

/// A block's contents: a stamp of the writer and a seeded fill, so no two writes agree.
fn block(rng: &mut XorShiftRng, stamp: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK as usize];
    rng.fill(&mut b[..]);
    b[..8].copy_from_slice(&stamp.to_le_bytes());
    b
}

/// One seed's run; Err names what the checker found, with the seed's replay line.
pub fn run(seed: u64, bugs: Bugs) -> Result<Stats, String> {
    let mut rng = XorShiftRng::seed_from_u64(seed);
    let trace = Trace::new(false);
    let mut model = vec![vec![0u8; BLOCK as usize]; DATA_BLOCKS];
    let (mut journal_medium, mut data_medium) = (vec![vec![0u8; BLOCK as usize]; JOURNAL_BLOCKS], model.clone());
    let mut acked: Vec<(u64, [u8; 16])> = Vec::new();
    // The transactions in flight when the power failed: one, or a group's in its order.
    let mut in_flight: Vec<Tx> = Vec::new();
    // A plain write cut before its flush completed: the block holds the old or the new.
    let mut plain_in_doubt: Option<(usize, Vec<u8>)> = None;
    let mut stats = Stats::default();
    let mut next_txid = 1u64;
    let fail = |what: String| Err(format!("seed {seed}: {what}\n{}", trace.tail().join("\n")));

    for life in 0..LIVES {
        let profile = DiskProfile { error_per_mille: 0 };
        let jdisk = SimDisk::new(std::mem::take(&mut journal_medium), BLOCK, seed ^ (life << 32), profile.clone(), None, trace.clone());
        let ddisk = SimDisk::new(std::mem::take(&mut data_medium), BLOCK, seed ^ (life << 32) ^ 1, profile, bugs.data_disk, trace.clone());
        // Power fails after this many disk operations (replay included); the last life
        // keeps it to check the end.
        let left = Arc::new(AtomicU64::new(if life + 1 == LIVES { u64::MAX } else { rng.random_range(1..400) }));
        let log = Arc::new(Powered { disk: jdisk.clone(), left: left.clone() });
        let data = Powered { disk: ddisk.clone(), left: left.clone() };

        match Journal::open_with(log, &data, BLOCK, bugs.journal) {
            Err(e) if left.load(Ordering::SeqCst) == 0 => {
                // Cut inside the replay: the transaction in doubt stays in doubt.
                trace.event(format_args!("cut in replay: {e}"));
            }
            Err(e) => return fail(format!("life {life}: replay failed with power on: {e}")),
            Ok((j, rec)) => {
                trace.event(format_args!("life {life}: replayed {rec:?}"));
                // A group is finished as a prefix: once one member is rolled back, every
                // later one is too.
                let mut cut = false;
                for tx in std::mem::take(&mut in_flight) {
                    match j.outcome(tx.txid) {
                        Some(Outcome::Committed(r)) if r == result_of(&tx.writes) && !cut => {
                            apply(&mut model, &tx.writes);
                            stats.finished += 1;
                        }
                        None | Some(Outcome::RolledBack) => {
                            cut = true;
                            stats.rolled_back += 1;
                        }
                        o => {
                            return fail(format!(
                                "life {life}: in-flight transaction {}: outcome {o:?} (an earlier one rolled back: {cut})",
                                tx.txid
                            ))
                        }
                    }
                }
                if let Some((i, new)) = plain_in_doubt.take() {
                    let mut got = vec![0u8; BLOCK as usize];
                    ddisk.read_at(&mut got, i as u64 * BLOCK).map_err(|e| format!("seed {seed}: reading block {i}: {e}"))?;
                    if got == new {
                        model[i] = new;
                    }
                }
                let mut disk = vec![0u8; DATA_BLOCKS * BLOCK as usize];
                ddisk.read_at(&mut disk, 0).map_err(|e| format!("seed {seed}: reading the namespace: {e}"))?;
                for (i, (got, want)) in disk.chunks(BLOCK as usize).zip(&model).enumerate() {
                    if got != want {
                        let (g, w) =
                            (u64::from_le_bytes(got[..8].try_into().expect("8")), u64::from_le_bytes(want[..8].try_into().expect("8")));
                        return fail(format!("life {life}: block {i} holds the write stamped {g:#x}, the model {w:#x}"));
                    }
                }
                // The journal keeps the newest MICROTX_OUTCOMES_MAX outcomes of all
                // transactions, acknowledged or not.
                let kept = next_txid.saturating_sub(nearstore_target::limits::MICROTX_OUTCOMES_MAX as u64);
                for (txid, result) in acked.iter().filter(|(t, _)| *t >= kept) {
                    if j.outcome(*txid) != Some(Outcome::Committed(*result)) {
                        return fail(format!("life {life}: acknowledged transaction {txid}: outcome {:?}", j.outcome(*txid)));
                    }
                }
                // The workload, until the power fails.
                // The last life only checks.
                while left.load(Ordering::SeqCst) > 0 && life + 1 < LIVES {
                    if rng.random_bool(0.2) {
                        // A plain write, flushed: durable once acknowledged.
                        let at = rng.random_range(0..DATA_BLOCKS as u64);
                        let b = block(&mut rng, 1 << 63 | at);
                        match data.write_at(&b, at * BLOCK).and_then(|()| data.flush_range(at * BLOCK, BLOCK)) {
                            Ok(()) => model[at as usize] = b,
                            Err(_) => plain_in_doubt = Some((at as usize, b)),
                        }
                        continue;
                    }
                    // One transaction, or a group of two to four (group commit), whose
                    // members often write the same blocks.
                    let members = if rng.random_bool(0.3) { rng.random_range(2..=4) } else { 1 };
                    let txs: Vec<Tx> = (0..members)
                        .map(|_| {
                            let txid = next_txid;
                            next_txid += 1;
                            let writes = (0..rng.random_range(1..=3))
                                .map(|_| {
                                    let n = rng.random_range(1..=4u64);
                                    let at = rng.random_range(0..=DATA_BLOCKS as u64 - n);
                                    (at * BLOCK, (0..n).flat_map(|_| block(&mut rng, txid)).collect::<Vec<u8>>())
                                })
                                .collect();
                            Tx { txid, op: 1, writes }
                        })
                        .collect();
                    stats.transactions += members as u64;
                    stats.groups += (members > 1) as u64;
                    let ran = match txs.as_slice() {
                        [tx] => j.run(&data, tx).map(|r| vec![r]),
                        _ => {
                            let group: Vec<_> = txs.iter().map(|tx| (tx, result_of(&tx.writes))).collect();
                            j.run_group(&data, &group).map(|()| group.iter().map(|(_, r)| *r).collect())
                        }
                    };
                    let ids: Vec<u64> = txs.iter().map(|tx| tx.txid).collect();
                    match ran {
                        Ok(results) => {
                            trace.event(format_args!("transactions {ids:?} acknowledged, generation {}", j.generation()));
                            for (tx, r) in txs.iter().zip(results) {
                                apply(&mut model, &tx.writes);
                                acked.push((tx.txid, r));
                            }
                        }
                        Err(e) if left.load(Ordering::SeqCst) == 0 => {
                            trace.event(format_args!("cut in transactions {ids:?}: {e}"));
                            in_flight = txs;
                        }
                        Err(e) => return fail(format!("life {life}: transactions {ids:?} failed with power on: {e}")),
                    }
                }
            }
        }
        if life + 1 < LIVES {
            stats.cuts += 1;
        }
        journal_medium = jdisk.crash();
        data_medium = ddisk.crash();
    }
    Ok(stats)
}
