//! A namespace's MicroTx journal at the target's start-up (docs/compute-protocol.md, "The
//! MicroTx journal"): created beside the file, replayed before the namespace serves, a
//! damaged one refused, and only file namespaces have one.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use nearstore_initiator::{ConnectOptions, Controller, Error};
use nearstore_target::backend::{Backend, FileBackend};
use nearstore_target::config::Config;
use nearstore_target::limits::MICROTX_JOURNAL_BYTES;
use nearstore_target::microtx::{result_of, Journal, Outcome, Tx};
use nearstore_target::Target;
use nearstore_wire::fused::{op, Fused};
use nearstore_wire::Status;

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

/// What start-up refuses: configurations with no place for a journal. (what, namespace,
/// error contains)
#[test]
fn start_up_refusals() {
    let cases: [(&str, &str, &str); 1] = [("a memory namespace", "memory = \"1MiB\"", "microtx needs a file namespace")];
    for (what, ns, want) in cases {
        let e = Target::from_config(&config(ns)).err().unwrap_or_else(|| panic!("{what}: started"));
        assert!(e.to_string().contains(want), "{what}: {e}");
    }
}

/// A block device has no beside for its journal (and is opened with O_DIRECT, which the
/// journal's buffers are not made for): refused at start-up, as documented. Before, the
/// journal was created in /dev and its in-place writes failed on the unaligned buffers.
#[test]
fn a_block_device_namespace_with_microtx_is_refused() {
    assert!(unsafe { libc::geteuid() } == 0, "this test needs root (a loop device)");
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("disk.img");
    std::fs::File::create(&image).unwrap().set_len(1 << 20).unwrap();
    let out = std::process::Command::new("losetup").args(["-f", "--show", image.to_str().unwrap()]).output().expect("losetup");
    assert!(out.status.success(), "losetup: {}", String::from_utf8_lossy(&out.stderr));
    let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let r = Target::from_config(&config(&format!("path = \"{dev}\"")));
    let _ = std::process::Command::new("losetup").args(["-d", &dev]).status();
    let e = r.err().expect("started");
    assert!(e.to_string().contains("microtx needs a regular file"), "{e}");
    assert!(!journal_path(Path::new(&dev)).exists(), "a journal was created beside {dev}");
}

/// Namespaces whose journal cannot be replayed (both checkpoints corrupt; the journal not
/// a regular file; larger than any journal the target writes) are offline: the target starts,
/// their I/O and fused commands complete with Namespace Not Ready (DNR set), the metric
/// and the namespace say why, and the other namespaces serve. Before, start-up failed and
/// no namespace served.
#[tokio::test]
async fn a_journal_that_cannot_be_replayed_keeps_only_its_namespace_offline() {
    let dir = tempfile::tempdir().unwrap();
    let nqn = "nqn.2026-11.io.nearstore:mtx";
    let corrupt = dir.path().join("corrupt.img");
    let directory = dir.path().join("directory.img");
    let large = dir.path().join("large.img");
    let good = dir.path().join("good.img");
    // Both checkpoint slots written (two starts), then both damaged.
    drop(Target::from_config(&config(&file_ns(&corrupt))).unwrap());
    drop(Target::from_config(&config(&file_ns(&corrupt))).unwrap());
    let j = FileBackend::open(&journal_path(&corrupt), None).unwrap();
    for slot in [0u64, 16384] {
        j.write_at(&[0xFF; 512], slot + 512).unwrap();
    }
    std::fs::create_dir(journal_path(&directory)).unwrap();
    // Larger than any journal this target writes.
    std::fs::File::create(journal_path(&large)).unwrap().set_len(MICROTX_JOURNAL_BYTES + 4096).unwrap();
    let ns =
        |nsid: u32, path: &Path, microtx: bool| format!("[[subsystem.namespace]]\nnsid = {nsid}\n{}\nmicrotx = {microtx}\n", file_ns(path));
    let toml = format!(
        "[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"{nqn}\"\nallow_any_host = true\n{}{}{}{}",
        ns(1, &corrupt, true),
        ns(2, &directory, true),
        ns(3, &large, true),
        ns(4, &good, true)
    );
    let target = Target::from_config(&Config::from_toml(&toml).unwrap()).expect("the target starts");
    let sub = target.subsystem(nqn).unwrap();
    // (nsid, why it is offline)
    let offline = [(1u32, "both checkpoints are corrupt"), (2, "not a regular file"), (3, "is larger than MICROTX_JOURNAL_BYTES")];
    let metrics = nearstore_target::metrics::render(&target);
    for (nsid, why) in offline {
        let ns = sub.namespace(nsid).unwrap();
        let got = ns.offline.clone().unwrap_or_else(|| panic!("namespace {nsid} serves"));
        assert!(got.contains(why), "namespace {nsid}: {got}");
        let line = format!("nearstore_namespace_offline{{subnqn=\"{nqn}\",nsid=\"{nsid}\"}} 1");
        assert!(metrics.contains(&line), "{line}");
    }
    assert!(metrics.contains(&format!("nearstore_namespace_offline{{subnqn=\"{nqn}\",nsid=\"4\"}} 0")));
    assert!(sub.namespace(4).unwrap().offline.is_none());

    let addr = target.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    let c = Controller::connect(ConnectOptions::new(addr, nqn)).await.unwrap();
    let mut q = c.io_queue(1).await.unwrap();
    let not_ready = Status::NAMESPACE_NOT_READY.dnr();
    let status = |r: Result<(), Error>| match r {
        Err(Error::Status { status, .. }) => status,
        other => panic!("expected a status, got {other:?}"),
    };
    let transfer =
        Fused { op: op::WRITE_CHECKSUM, txid: 5, offset: 0, block_offset: 0, args: [0; 8], extents: vec![(0, 512)] }.encode(&[1; 512]);
    for (nsid, _) in offline {
        assert_eq!(status(q.read(nsid, 0, 1, 512).await.map(drop)), not_ready, "Read of {nsid}");
        assert_eq!(status(q.write(nsid, 0, &[1; 512], 512, false).await), not_ready, "Write of {nsid}");
        assert_eq!(status(q.fused_write(nsid, &transfer).await.map(drop)), not_ready, "FUSED WRITE of {nsid}");
        assert_eq!(status(q.outcome(nsid, 5).await.map(drop)), not_ready, "OUTCOME of {nsid}");
        let caw = q.compare_and_write(nsid, 0, &[0; 512], &[1; 512], 512, false).await.unwrap();
        assert_eq!(caw.compare, not_ready, "Compare and Write of {nsid}");
    }
    q.write(4, 0, &[7; 512], 512, false).await.unwrap();
    assert_eq!(q.read(4, 0, 1, 512).await.unwrap(), vec![7; 512]);
    q.fused_write(4, &transfer).await.unwrap();
    assert_eq!(std::fs::read(&corrupt).unwrap()[..512], [0; 512], "an offline namespace was written");
}
