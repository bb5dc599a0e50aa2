//! Where the control plane's records live. [`Store`] is what the service needs: every record
//! at start-up, and an atomic commit of a batch of writes. [`RedbStore`] keeps them in a redb
//! file under `--store DIR`; `crate::etcd::EtcdStore` (`--etcd`) in etcd, where a commit is a
//! [`GuardedStore`] transaction that [`Sequenced`] retries until its outcome is known.
//! Records are JSON (model::Record), one table per kind, keyed as `Record::key` says.

use std::path::Path;

use redb::{ReadableDatabase, ReadableTable, TableDefinition};

use crate::limits::COMMIT_ATTEMPTS_MAX;
use crate::model::{Record, Table, Write};

#[derive(Debug, PartialEq, thiserror::Error)]
pub enum StoreError {
    #[error("store: {0}")]
    Backend(String),
    #[error("store: record {table}/{key} is not readable: {reason}")]
    Corrupt { table: &'static str, key: String, reason: String },
    /// This control plane does not hold the leader lease (any more): it may not write.
    #[error("store: not the leader: {0}")]
    NotLeader(String),
    /// The commit was sent but its outcome is unknown (a timeout, a connection lost, the
    /// store's own leader lost mid-request): it may or may not have been applied.
    #[error("store: outcome unknown: {0}")]
    Unknown(String),
}

pub trait Store: Send + Sync {
    /// Every record, in table then key order.
    fn load(&self) -> Result<Vec<Record>, StoreError>;
    /// Commits the batch whole, durably, or not at all.
    fn commit(&self, batch: &[Write]) -> Result<(), StoreError>;
}

/// What a guarded commit did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guarded {
    Applied,
    /// The guard failed and nothing was written: the store's commit counter, the writer of
    /// its last commit, and whether this writer still holds the lease.
    Refused {
        seq: u64,
        writer: i64,
        leads: bool,
    },
}

/// A store shared by writers that take turns (etcd): a commit is applied only if the store's
/// commit counter is still `seq` and this writer still holds the leader lease, and it then
/// advances the counter to `seq + 1` naming this writer, in the same atomic step. Its outcome
/// may be unknown ([`StoreError::Unknown`]); [`Sequenced`] resolves it.
pub trait GuardedStore: Send + Sync {
    /// Every record, in table then key order, and the commit counter, read at one instant.
    fn load(&self) -> Result<(Vec<Record>, u64), StoreError>;
    /// Applies the batch and advances the counter if the counter is `seq` and this writer
    /// leads; otherwise writes nothing and says what it found.
    fn commit_if(&self, seq: u64, batch: &[Write]) -> Result<Guarded, StoreError>;
    /// This writer's identity as the counter records it (its lease).
    fn writer(&self) -> i64;
    /// How long to wait before sending again, for the `attempt`th time, a commit whose
    /// outcome is unknown; None when it may not be sent again: the writer no longer holds
    /// its lease (whose end fences off every earlier attempt).
    fn retry_after(&self, attempt: u32) -> Option<std::time::Duration>;
}

/// A [`GuardedStore`] as a [`Store`]: tracks the commit counter and retries a commit whose
/// outcome is unknown with the same guard, so that it is applied exactly once or not at all.
/// A retry that finds the counter at `seq + 1` written by this writer learns that an earlier
/// attempt was applied (commits are serial: no other batch of this writer can be at `seq`);
/// one that finds it at `seq` was not, and its own attempt decides; a late first attempt
/// arriving after a retry finds the counter moved and writes nothing.
pub struct Sequenced<S> {
    inner: S,
    /// The counter as this writer last left it; None once a commit failed with its outcome
    /// still unknown: memory may differ from the store, so nothing more is written (the
    /// daemon loads the store again when it next leads).
    seq: parking_lot::Mutex<Option<u64>>,
}

impl<S: GuardedStore> Sequenced<S> {
    pub fn new(inner: S) -> Sequenced<S> {
        Sequenced { inner, seq: parking_lot::Mutex::new(None) }
    }

    pub fn inner(&self) -> &S {
        &self.inner
    }
}

impl<S: GuardedStore> Store for Sequenced<S> {
    fn load(&self) -> Result<Vec<Record>, StoreError> {
        let (records, seq) = self.inner.load()?;
        *self.seq.lock() = Some(seq);
        Ok(records)
    }

    fn commit(&self, batch: &[Write]) -> Result<(), StoreError> {
        if batch.is_empty() {
            return Ok(());
        }
        let mut slot = self.seq.lock();
        let Some(seq) = *slot else {
            return Err(StoreError::NotLeader("an earlier commit's outcome is unknown: load the store again".into()));
        };
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.inner.commit_if(seq, batch) {
                Ok(Guarded::Applied) => {
                    *slot = Some(seq + 1);
                    return Ok(());
                }
                Ok(Guarded::Refused { seq: s, writer, .. }) if s == seq + 1 && writer == self.inner.writer() => {
                    // An earlier attempt of this very batch was applied.
                    *slot = Some(seq + 1);
                    return Ok(());
                }
                Ok(Guarded::Refused { seq: s, leads, .. }) => {
                    *slot = None;
                    return Err(StoreError::NotLeader(if leads {
                        format!("the commit counter is {s}, not {seq}: another writer committed")
                    } else {
                        "the leader lease is lost".into()
                    }));
                }
                Err(StoreError::Unknown(e)) => {
                    let Some(wait) = self.inner.retry_after(attempt).filter(|_| attempt < COMMIT_ATTEMPTS_MAX) else {
                        *slot = None;
                        return Err(StoreError::NotLeader(format!(
                            "outcome unknown after {attempt} attempts ({e}): nothing more is written until the state is loaded again"
                        )));
                    };
                    tracing::warn!(attempt, error = %e, "commit outcome unknown: sending it again with the same guard");
                    std::thread::sleep(wait);
                }
                // Refused before anything was sent (over a limit): nothing was written.
                Err(e) => return Err(e),
            }
        }
    }
}

/// The file under `--store DIR`.
pub const REDB_FILE: &str = "control.redb";

pub struct RedbStore {
    db: redb::Database,
}

fn table(t: Table) -> TableDefinition<'static, &'static str, &'static [u8]> {
    TableDefinition::new(t.name())
}

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

impl RedbStore {
    /// Opens (or makes) DIR/control.redb, making DIR if missing.
    pub fn open(dir: &Path) -> Result<RedbStore, StoreError> {
        std::fs::create_dir_all(dir).map_err(|e| backend(format!("creating {}: {e}", dir.display())))?;
        let path = dir.join(REDB_FILE);
        let db = redb::Database::create(&path).map_err(|e| backend(format!("opening {}: {e}", path.display())))?;
        // Every table exists from the first start, so that load reads them all.
        let tx = db.begin_write().map_err(backend)?;
        for t in Table::ALL {
            tx.open_table(table(t)).map_err(backend)?;
        }
        tx.commit().map_err(backend)?;
        Ok(RedbStore { db })
    }
}

impl Store for RedbStore {
    fn load(&self) -> Result<Vec<Record>, StoreError> {
        let tx = self.db.begin_read().map_err(backend)?;
        let mut out = Vec::new();
        for t in Table::ALL {
            let tab = tx.open_table(table(t)).map_err(backend)?;
            for row in tab.iter().map_err(backend)? {
                let (k, v) = row.map_err(backend)?;
                let r: Record = serde_json::from_slice(v.value()).map_err(|e| StoreError::Corrupt {
                    table: t.name(),
                    key: k.value().to_string(),
                    reason: e.to_string(),
                })?;
                if r.table() != t || r.key() != k.value() {
                    return Err(StoreError::Corrupt {
                        table: t.name(),
                        key: k.value().to_string(),
                        reason: format!("holds {}/{}", r.table().name(), r.key()),
                    });
                }
                out.push(r);
            }
        }
        Ok(out)
    }

    fn commit(&self, batch: &[Write]) -> Result<(), StoreError> {
        if batch.is_empty() {
            return Ok(());
        }
        let tx = self.db.begin_write().map_err(backend)?;
        for w in batch {
            match w {
                Write::Put(r) => {
                    let bytes = serde_json::to_vec(r).map_err(backend)?;
                    tx.open_table(table(r.table())).map_err(backend)?.insert(r.key().as_str(), bytes.as_slice()).map_err(backend)?;
                }
                Write::Delete(t, k) => {
                    tx.open_table(table(*t)).map_err(backend)?.remove(k.as_str()).map_err(backend)?;
                }
            }
        }
        // Durable on return (redb's default durability fsyncs the commit).
        tx.commit().map_err(backend)
    }
}

/// Records in memory, for tests and the simulation: a commit fails whole when told to.
#[derive(Default)]
pub struct MemStore {
    records: parking_lot::Mutex<std::collections::BTreeMap<(Table, String), Record>>,
    /// The next this many commits fail.
    pub fail_commits: std::sync::atomic::AtomicU32,
}

impl Store for MemStore {
    fn load(&self) -> Result<Vec<Record>, StoreError> {
        Ok(self.records.lock().values().cloned().collect())
    }

    fn commit(&self, batch: &[Write]) -> Result<(), StoreError> {
        use std::sync::atomic::Ordering;
        if self.fail_commits.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok() {
            return Err(StoreError::Backend("injected commit failure".into()));
        }
        let mut m = self.records.lock();
        for w in batch {
            match w {
                Write::Put(r) => m.insert((r.table(), r.key()), r.clone()),
                Write::Delete(t, k) => m.remove(&(*t, k.clone())),
            };
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::*;

    fn records() -> Vec<Record> {
        let pool = PoolId { target: "127.0.0.1:4420".into(), name: "p0".into() };
        vec![
            Record::Target(Target {
                addr: pool.target.clone(),
                nqn: "nqn.a".into(),
                registered_ms: 5,
                write_bound_ms: 0,
                incarnation: 0,
                unfenced: None,
            }),
            Record::Pool(Pool {
                id: pool.clone(),
                path: "/srv/p0".into(),
                size: 1 << 30,
                nsid: 1,
                cordoned: false,
                bandwidth: 0,
                write_cost: 0.0,
            }),
            Record::Volume(Volume { name: "v".into(), size: 4 << 20, extent_size: 1 << 20, created_ms: 6, handover: None }),
            Record::Extent(Extent { volume: "v".into(), index: 3, pool: pool.clone(), offset: 0, epoch: 1, unwritten: true }),
            Record::View(View { pool, seq: 2, version: 9, received_ms: 7, figures: Figures { read_bps: 1.5, ..Figures::default() } }),
        ]
    }

    /// What one store commits the other loads the same, and a reopened redb file holds it.
    #[test]
    fn stores_round_trip_and_redb_survives_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let batch: Vec<Write> = records().into_iter().map(Write::Put).collect();
        {
            let s = RedbStore::open(dir.path()).expect("open");
            s.commit(&batch).expect("commit");
            s.commit(&[Write::Delete(Table::Extents, extent_key("v", 3))]).expect("delete");
        }
        let mut expected = records();
        expected.retain(|r| r.table() != Table::Extents);
        assert_eq!(RedbStore::open(dir.path()).expect("reopen").load().expect("load"), expected);
        let m = MemStore::default();
        m.commit(&batch).expect("commit");
        m.commit(&[Write::Delete(Table::Extents, extent_key("v", 3))]).expect("delete");
        assert_eq!(m.load().expect("load"), expected);
    }

    /// One attempt's answer (None: lost, outcome unknown).
    type Answer = Result<Option<Guarded>, StoreError>;
    /// The answers, whether the writer leads, the outcome, the attempts, whether the next
    /// commit may be sent.
    type Case = (Vec<Answer>, bool, Result<(), &'static str>, u32, bool);

    /// A guarded store that answers each attempt as scripted, and lets retries go on while
    /// `leads`.
    struct Scripted {
        answers: parking_lot::Mutex<std::collections::VecDeque<Answer>>,
        leads: bool,
        /// The guard of every attempt.
        guards: parking_lot::Mutex<Vec<u64>>,
    }

    impl GuardedStore for Scripted {
        fn load(&self) -> Result<(Vec<Record>, u64), StoreError> {
            Ok((Vec::new(), 4))
        }
        fn commit_if(&self, seq: u64, _: &[Write]) -> Result<Guarded, StoreError> {
            self.guards.lock().push(seq);
            match self.answers.lock().pop_front() {
                Some(Ok(Some(g))) => Ok(g),
                Some(Err(e)) => Err(e),
                Some(Ok(None)) | None => Err(StoreError::Unknown("lost".into())),
            }
        }
        fn writer(&self) -> i64 {
            9
        }
        fn retry_after(&self, _: u32) -> Option<std::time::Duration> {
            self.leads.then_some(std::time::Duration::ZERO)
        }
    }

    /// What a commit makes of its attempts' answers: the outcome, the attempts sent, and
    /// whether the next commit may still be sent.
    #[test]
    fn sequenced_decides_from_the_answers() {
        use Guarded::*;
        let lost = || Ok(None);
        let is = |g| Ok(Some(g));
        #[rustfmt::skip]
        let cases: Vec<Case> = vec![
            (vec![is(Applied)], true, Ok(()), 1, true),
            // Lost before it was applied: sent again, applied then.
            (vec![lost(), lost(), is(Applied)], true, Ok(()), 3, true),
            // Lost after it was applied: the retry finds the counter at 5 by this writer.
            (vec![lost(), is(Refused { seq: 5, writer: 9, leads: true })], true, Ok(()), 2, true),
            (vec![lost(), is(Refused { seq: 5, writer: 9, leads: false })], true, Ok(()), 2, true),
            // Another writer's commit 5, or a lease lost: refused, and nothing more is written.
            (vec![is(Refused { seq: 5, writer: 8, leads: true })], true, Err("another writer"), 1, false),
            (vec![lost(), is(Refused { seq: 4, writer: 9, leads: false })], true, Err("lease is lost"), 2, false),
            // Lost, and the lease ended: outcome unknown, nothing more is written.
            (vec![lost()], false, Err("outcome unknown"), 1, false),
            // Never answered while leading: given up after the limit.
            (vec![], true, Err("outcome unknown"), COMMIT_ATTEMPTS_MAX, false),
            // Refused before it was sent: nothing written, the next commit may go.
            (vec![Err(StoreError::Backend("over the limits".into()))], true, Err("over the limits"), 1, true),
        ];
        for (answers, leads, expected, attempts, usable) in cases {
            let what = format!("{answers:?}");
            let s = Sequenced::new(Scripted { answers: parking_lot::Mutex::new(answers.into()), leads, guards: Default::default() });
            s.load().expect("load");
            let batch = [Write::Delete(Table::Volumes, "v".into())];
            match (s.commit(&batch), expected) {
                (Ok(()), Ok(())) => {}
                (Err(e), Err(said)) => assert!(e.to_string().contains(said), "{what}: {e}"),
                (got, _) => panic!("{what}: {got:?}, expected {expected:?}"),
            }
            // Every attempt carried the guard of the counter loaded.
            assert_eq!(*s.inner().guards.lock(), vec![4; attempts as usize], "{what}");
            s.inner().answers.lock().push_back(Ok(Some(Applied)));
            let next = s.commit(&batch);
            assert_eq!(!matches!(next, Err(StoreError::NotLeader(_))), usable, "{what}: then {next:?}");
        }
    }

    #[test]
    fn an_injected_failure_commits_nothing() {
        let m = MemStore::default();
        m.fail_commits.store(1, std::sync::atomic::Ordering::Relaxed);
        assert!(m.commit(&records().into_iter().map(Write::Put).collect::<Vec<_>>()).is_err());
        assert!(m.load().expect("load").is_empty());
    }

    #[test]
    fn a_record_under_the_wrong_key_is_corrupt() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = RedbStore::open(dir.path()).expect("open");
        let tx = s.db.begin_write().expect("tx");
        tx.open_table(table(Table::Volumes))
            .expect("t")
            .insert("other", br#"{"kind":"volume","name":"v","size":1,"extent_size":1,"created_ms":0}"#.as_slice())
            .expect("insert");
        tx.open_table(table(Table::Volumes)).expect("t").insert("junk", b"{".as_slice()).expect("insert");
        tx.commit().expect("commit");
        let e = s.load().expect_err("corrupt");
        assert!(e.to_string().contains("volumes/junk") || e.to_string().contains("volumes/other"), "{e}");
    }
}
