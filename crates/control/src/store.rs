//! Where the control plane's records live. [`Store`] is what the service needs: every record
//! at start-up, and an atomic commit of a batch of writes. [`RedbStore`] keeps them in a redb
//! file under `--store DIR`; an etcd store (`--etcd`) is the next implementation, committing a
//! batch as one etcd transaction under the control plane's leader lease.
//! Records are JSON (model::Record), one table per kind, keyed as `Record::key` says.

use std::path::Path;

use redb::{ReadableDatabase, ReadableTable, TableDefinition};

use crate::model::{Record, Table, Write};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store: {0}")]
    Backend(String),
    #[error("store: record {table}/{key} is not readable: {reason}")]
    Corrupt { table: &'static str, key: String, reason: String },
}

pub trait Store: Send + Sync {
    /// Every record, in table then key order.
    fn load(&self) -> Result<Vec<Record>, StoreError>;
    /// Commits the batch whole, durably, or not at all.
    fn commit(&self, batch: &[Write]) -> Result<(), StoreError>;
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
            Record::Target(Target { addr: pool.target.clone(), nqn: "nqn.a".into(), registered_ms: 5 }),
            Record::Pool(Pool { id: pool.clone(), path: "/srv/p0".into(), size: 1 << 30, nsid: 1 }),
            Record::Volume(Volume { name: "v".into(), size: 4 << 20, extent_size: 1 << 20, created_ms: 6 }),
            Record::Extent(Extent { volume: "v".into(), index: 3, pool: pool.clone(), offset: 0, epoch: 1 }),
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
