//! A namespace's MicroTx journal at the target's start-up (docs/compute-protocol.md, "The
//! MicroTx journal"): created beside the file, replayed before the namespace serves, a
//! damaged one refused, and only file namespaces have one.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use nearstore_target::backend::{Backend, FileBackend};
use nearstore_target::config::Config;
use nearstore_target::limits::MICROTX_JOURNAL_BYTES;
use nearstore_target::microtx::{result_of, Journal, Outcome, Tx};
use nearstore_target::Target;

fn config(ns: &str) -> Config {
    let toml = format!(
        "[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"nqn.2026-11.io.nearstore:mtx\"\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\n{ns}\nmicrotx = true\n"
    );
    Config::from_toml(&toml).unwrap()
}

fn file_ns(path: &Path) -> String {
    format!("path = \"{}\"\nsize = \"1MiB\"", path.display())
}

/// The process dies after `left` writes and flushes of the journal, and the namespace's
/// writes never reach its file (its cache is lost with it).
struct Dying {
    inner: FileBackend,
    left: AtomicUsize,
    journal: bool,
}

impl Backend for Dying {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.inner.read_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        if !self.journal {
            return Ok(());
        }
        self.left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).map_err(|_| io::Error::other("dead"))?;
        self.inner.write_at(buf, off)
    }
    fn flush(&self) -> io::Result<()> {
        match self.journal {
            true => self
                .left
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .map(|_| ())
                .map_err(|_| io::Error::other("dead")),
            false => Ok(()),
        }
    }
    fn write_zeroes(&self, _: u64, _: u64, _: bool) -> io::Result<()> {
        Err(io::Error::other("not used"))
    }
}

fn journal_path(data: &Path) -> std::path::PathBuf {
    let mut p = data.as_os_str().to_owned();
    p.push(".microtx");
    p.into()
}

/// A transaction logged and flushed whose process died before it reached the namespace:
/// the target's start-up finishes it from the journal, and knows its outcome.
#[test]
fn start_up_finishes_a_logged_transaction() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("ns.img");
    let target = Target::from_config(&config(&file_ns(&data))).unwrap();
    assert_eq!(std::fs::metadata(journal_path(&data)).unwrap().len(), MICROTX_JOURNAL_BYTES);
    drop(target);

    let log = Dying { inner: FileBackend::open(&journal_path(&data), None).unwrap(), left: AtomicUsize::new(usize::MAX), journal: true };
    let log = Arc::new(log);
    let lost = Dying { inner: FileBackend::open(&data, None).unwrap(), left: AtomicUsize::new(0), journal: false };
    let (j, _) = Journal::open(log.clone(), &lost, 512).unwrap();
    // Its records and their flush, then nothing.
    log.left.store(2, Ordering::SeqCst);
    let tx = Tx { txid: 42, op: 1, writes: vec![(8192, vec![0xE7; 4096])] };
    assert!(j.run(&lost, &tx).is_err());
    drop(j);
    let before = std::fs::read(&data).unwrap();
    assert_eq!(&before[8192..12288], &[0; 4096][..], "the namespace never got it");

    let target = Target::from_config(&config(&file_ns(&data))).unwrap();
    let after = std::fs::read(&data).unwrap();
    assert_eq!(&after[8192..12288], &[0xE7; 4096][..], "finished at start-up");
    let sub = target.subsystems().into_iter().find(|s| s.nqn.ends_with(":mtx")).unwrap();
    let journal = sub.namespace(1).unwrap().journal.clone().expect("journal");
    assert_eq!(journal.outcome(42), Some(Outcome::Committed(result_of(&tx.writes))));
}

/// What start-up refuses. (what, namespace, damage to the journal, error contains)
#[test]
fn start_up_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &str, bool, &str); 2] = [
        ("a memory namespace", "memory = \"1MiB\"", false, "microtx needs a file namespace"),
        ("both checkpoints corrupt", "", true, "both checkpoints are corrupt"),
    ];
    for (what, ns, damage, want) in cases {
        let data = dir.path().join(format!("{}.img", what.replace(' ', "_")));
        let ns = if ns.is_empty() { file_ns(&data) } else { ns.to_string() };
        if damage {
            drop(Target::from_config(&config(&ns)).unwrap());
            drop(Target::from_config(&config(&ns)).unwrap());
            let j = FileBackend::open(&journal_path(&data), None).unwrap();
            for slot in [0u64, 16384] {
                j.write_at(&[0xFF; 512], slot + 512).unwrap();
            }
        }
        let e = Target::from_config(&config(&ns)).err().unwrap_or_else(|| panic!("{what}: started"));
        assert!(e.to_string().contains(want), "{what}: {e}");
    }
}
