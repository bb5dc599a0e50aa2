//! The fused write operations from the host library on a real ext4 file system on a loop
//! device whose image a target exports with a MicroTx journal: a LevelDB log written with
//! `LogWriter` (append-crc-write per record) reads back, record by record, with a reader
//! of LevelDB's log format written from its description (testkit); appends after a crash's
//! leftover zeros; write-checksum and read-checksum of file ranges. Needs root, loop
//! devices and mkfs.ext4; it fails, naming what is missing, without them.

mod common;
#[path = "../../nvmf-target/tests/common/proxy.rs"]
mod proxy;

use std::path::Path;

use common::Fs;
use nearstore_host::device::{DeviceMap, Endpoint};
use nearstore_host::fused::{log_end, LogWriter};
use nearstore_host::Host;
use nearstore_target::config::Config;
use nearstore_target::Target;
use nearstore_testkit::leveldb_log_records as leveldb_records;
use nearstore_wire::fused::state;

const NQN: &str = "nqn.2026-11.io.nearstore:fusedhost";

async fn start(fs: &Fs) -> Host {
    start_exporting(fs, &fs.image).await
}

/// A target whose namespace 1 is `export`, journaled: its address (the target lives as long
/// as the test process).
async fn serve(export: &Path) -> std::net::SocketAddr {
    let cfg = Config::from_toml(&format!(
        "[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\npath = \"{}\"\nmicrotx = true\n",
        export.display()
    ))
    .unwrap();
    let t = Target::from_config(&cfg).unwrap();
    let addr = t.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    std::mem::forget(t);
    addr
}

/// A host that reaches `fs`'s image at `addr`.
fn host_at(fs: &Fs, addr: std::net::SocketAddr) -> Host {
    let mut devices = DeviceMap::default();
    devices.add_file(&fs.image, Endpoint { address: addr, nqn: NQN.into(), nsid: 1 }).unwrap();
    Host::new(devices)
}

/// A target whose namespace 1 is `export`, and a host that takes it for `fs`'s image.
async fn start_exporting(fs: &Fs, export: &Path) -> Host {
    host_at(fs, serve(export).await)
}

/// A host whose target's namespace is a 1 MiB image, smaller than the file system the
/// host maps: operations on a file's bytes past its first MiB are refused by the target,
/// after they were sent.
async fn start_small(fs: &Fs) -> Host {
    let small = fs.dir.path().join("small.img");
    std::fs::write(&small, vec![0u8; 1 << 20]).unwrap();
    start_exporting(fs, &small).await
}

fn record(i: usize) -> Vec<u8> {
    // Sizes of db_bench's values and of LevelDB's write batches, and the edges of a block.
    let len = match i % 7 {
        0 => 100,
        1 => 4096,
        2 => 0,
        3 => 32761,
        4 => 40_000,
        5 => (i * 997) % 9000,
        _ => 7,
    };
    (0..len).map(|k| (k as u8).wrapping_mul(13).wrapping_add(i as u8)).collect()
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_written_with_append_crc_write_reads_back_as_leveldb_log() {
    let fs = Fs::new(64);
    let mut host = start(&fs).await;
    let path = fs.mnt.join("000003.log");
    let mut w = LogWriter::create(&mut host, &path).unwrap();
    let mut sent = Vec::new();
    let mut appended = Vec::new();
    // Past one preallocation (1 MiB) of log.
    for i in 0..90 {
        let r = record(i);
        appended.push((w.len(), w.add_record(&r).await.unwrap()));
        sent.push(r);
    }
    let len = w.finish().unwrap();
    assert!(len > 1 << 20, "{len} bytes of log");
    let log = read(&path);
    assert_eq!(log.len() as u64, len, "the size is the log's end");
    assert_eq!(leveldb_records(&log), Ok(sent.clone()));
    // Each completion's checksum is that of the bytes it framed into the file.
    for (i, (before, a)) in appended.iter().enumerate() {
        assert_eq!(a.len - before, a.count as u64, "record {i}");
        assert_eq!(a.crc, crc32c::crc32c(&log[*before as usize..a.len as usize]), "record {i}");
        assert_eq!(host.outcome(&path, a.txid).await.unwrap().0, state::COMMITTED, "record {i}");
    }

    // A crash between a preallocation and setting the size leaves zeros after the log:
    // LevelDB's reader ends the log there, and the next append starts at the log's end.
    let f = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
    std::io::Write::write_all(&mut &f, &vec![0u8; 5000]).unwrap();
    drop(f);
    assert_eq!(log_end(&path).unwrap(), len);
    assert_eq!(leveldb_records(&read(&path)), Ok(sent.clone()));
    let a = host.append_crc_write(&path, b"after the crash").await.unwrap();
    sent.push(b"after the crash".to_vec());
    let log = read(&path);
    assert_eq!(log.len() as u64, a.len);
    assert_eq!(leveldb_records(&log), Ok(sent.clone()));
    // And LogWriter::open goes on from there.
    let mut w = LogWriter::open(&mut host, &path).unwrap();
    assert_eq!(w.len(), a.len);
    w.add_record(&record(3)).await.unwrap();
    w.finish().unwrap();
    sent.push(record(3));
    assert_eq!(leveldb_records(&read(&path)), Ok(sent));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_and_read_checksum_of_file_ranges() {
    let fs = Fs::new(64);
    let mut host = start(&fs).await;
    let path = fs.mnt.join("data");
    let mut model: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&path, &model).unwrap();
    // (offset, length): inside a block, across blocks, the last byte.
    for (i, (off, n)) in [(5000u64, 3000usize), (4095, 2), (100_000, 70_000), (299_999, 1)].into_iter().enumerate() {
        let data = vec![0xA0 + i as u8; n];
        let crc = host.write_checksum(&path, off, &data).await.unwrap();
        assert_eq!(crc, crc32c::crc32c(&data), "case {i}");
        model[off as usize..off as usize + n].copy_from_slice(&data);
    }
    assert_eq!(read(&path), model);
    for (off, n) in [(0u64, 1u64), (4000, 70_000), (1, 299_999), (299_000, 1000)] {
        let (d, crc) = host.read_checksum(&path, off, n).await.unwrap();
        let want = &model[off as usize..(off + n) as usize];
        assert_eq!(d, want, "{off}+{n}");
        assert_eq!(crc, crc32c::crc32c(want), "{off}+{n}");
    }
    // Past the file's end: refused before anything is sent.
    assert!(host.write_checksum(&path, 299_999, b"ab").await.is_err());
    assert!(host.read_checksum(&path, 299_999, 2).await.is_err());
    // A writer that fails (a full disk) fails the read with its own error, kind and all,
    // after the bytes it took.
    struct Full(usize);
    impl std::io::Write for Full {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            if self.0 == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::StorageFull));
            }
            let n = b.len().min(self.0);
            self.0 -= n;
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    match host.read_checksum_into(&path, 0, 300_000, &mut Full(1000)).await {
        Err(nearstore_host::HostError::Output { path: p, source }) => {
            assert_eq!((p, source.kind()), (path.clone(), std::io::ErrorKind::StorageFull));
        }
        r => panic!("a failing writer: {r:?}"),
    }
}

/// read-modify-write on a file of ext4: counters added to (8-byte, across a 4 KiB block),
/// bytes xored and replaced, each result's crc32c the new bytes'; nothing else changes, the
/// size neither; past the end refused before anything is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_modify_write_changes_a_files_bytes_in_place() {
    use nearstore_host::fused::Modify;
    let fs = Fs::new(64);
    let mut host = start(&fs).await;
    let path = fs.mnt.join("counters");
    let mut model: Vec<u8> = (0..100_000u32).map(|i| (i % 241) as u8).collect();
    std::fs::write(&path, &model).unwrap();
    for round in 0..3u64 {
        // Counter at 4092: its 8 bytes straddle the first 4 KiB block's end.
        let w = host.read_modify_write(&path, 4092, Modify::Add { width: 8 }, &(round + 1).to_le_bytes()).await.unwrap();
        let c = u64::from_le_bytes(model[4092..4100].try_into().unwrap()).wrapping_add(round + 1);
        model[4092..4100].copy_from_slice(&c.to_le_bytes());
        assert_eq!((w.crc, w.count, w.end), (crc32c::crc32c(&model[4092..4100]), 8, 4100), "round {round}");
    }
    let w = host.read_modify_write(&path, 50_000, Modify::Xor, &[0xff; 3000]).await.unwrap();
    model[50_000..53_000].iter_mut().for_each(|b| *b ^= 0xff);
    assert_eq!(w.crc, crc32c::crc32c(&model[50_000..53_000]));
    host.read_modify_write(&path, 99_999, Modify::Replace, b"Z").await.unwrap();
    model[99_999] = b'Z';
    assert_eq!(read(&path), model);
    assert!(host.read_modify_write(&path, 99_999, Modify::Replace, b"ZZ").await.is_err(), "past the end");
    assert!(host.read_modify_write(&path, 0, Modify::Add { width: 4 }, &[1; 6]).await.is_err(), "part of an integer");
    assert_eq!(read(&path), model);
}

/// compress-write appends zstd frames to a file (zstd reads the concatenation as the inputs
/// concatenated), and writes one at an offset inside the file; the file grows to each
/// frame's end and never past it, nor shrinks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compress_write_appends_frames_zstd_reads() {
    let fs = Fs::new(64);
    let mut host = start(&fs).await;
    let path = fs.mnt.join("frames.zst");
    std::fs::write(&path, b"").unwrap();
    let inputs: Vec<Vec<u8>> = (0..5usize).map(|i| (0..20_000 * (i + 1)).map(|j| b"abcdefgh\n"[(j * (i + 1)) % 9]).collect()).collect();
    let (mut len, mut first) = (0u64, 0u64);
    for (i, data) in inputs.iter().enumerate() {
        let w = host.compress_write(&path, None, data, if i % 2 == 0 { 0 } else { 19 }).await.unwrap();
        assert_eq!(w.end, len + w.count as u64, "frame {i}");
        assert!((w.count as usize) < data.len() / 4, "frame {i}: {} bytes of {}", w.count, data.len());
        len = w.end;
        if i == 0 {
            first = w.end;
        }
        assert_eq!(std::fs::metadata(&path).unwrap().len(), len, "frame {i}: the size is the frame's end");
        let file = read(&path);
        assert_eq!(w.crc, crc32c::crc32c(&file[(w.end - w.count as u64) as usize..]), "frame {i}");
    }
    assert_eq!(zstd::decode_all(&read(&path)[..]).unwrap(), inputs.concat());
    // Over the second frame, in place: the file keeps its size, the first frame stays.
    let w = host.compress_write(&path, Some(first), b"tiny", 0).await.unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), len);
    let file = read(&path);
    assert_eq!(zstd::decode_all(&file[..(w.end as usize)]).unwrap(), [&inputs[0][..], b"tiny"].concat());
    assert!(host.compress_write(&path, Some(len + 1), b"x", 0).await.is_err(), "past the end");
    assert!(host.compress_write(&path, None, b"x", 20).await.is_err(), "level 20");
    assert!(host.compress_write(&path, None, b"", 0).await.is_err(), "nothing");
}

/// A refused compress-write takes its preallocated zeros away again: the file keeps its size,
/// and the next frame follows its real end (zeros between frames would end what zstd reads).
/// Before, the zeros stayed and the retry's frame went after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_compress_write_leaves_the_file_as_it_was() {
    let fs = Fs::new(64);
    let mut host = start_small(&fs).await;
    // A file past the namespace's first MiB of the file system: its frame is refused there.
    let path = fs.mnt.join("far.zst");
    std::fs::write(&path, vec![1u8; 7 << 20]).unwrap();
    let data = vec![b'a'; 100_000];
    let e = host.compress_write(&path, None, &data, 0).await.unwrap_err();
    let txid = e.txid().unwrap_or_else(|| panic!("no txid in {e}"));
    assert_eq!(host.outcome(&path, txid).await.unwrap().0, state::UNKNOWN, "refused before its journal");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 7 << 20, "the preallocated zeros were taken away");
    assert_eq!(read(&path), vec![1u8; 7 << 20]);
}

/// A writer that dies before `finish` (the application crashed, the host's kernel did not):
/// the records the target acknowledged lie under the zeros the host wrote to preallocate.
/// Reopening the log finds its end after them, LevelDB's reader on this host reads them,
/// and appending goes on after them rather than over them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_acknowledged_before_a_crash_are_found_after_it() {
    let fs = Fs::new(64);
    let mut host = start(&fs).await;
    let path = fs.mnt.join("000005.log");
    let mut w = LogWriter::create(&mut host, &path).unwrap();
    let mut sent = Vec::new();
    for i in 0..12 {
        w.add_record(&record(i)).await.unwrap();
        sent.push(record(i));
    }
    let end = w.len();
    // The crash: no finish, the preallocated zeros stay cached and past the log.
    drop(w);
    assert!(std::fs::metadata(&path).unwrap().len() > end, "the preallocation is past the log");
    assert_eq!(log_end(&path).unwrap(), end, "the log's end after its acknowledged records");
    assert_eq!(leveldb_records(&read(&path)), Ok(sent.clone()));
    let mut w = LogWriter::open(&mut host, &path).unwrap();
    assert_eq!(w.len(), end);
    w.add_record(b"after the crash").await.unwrap();
    w.finish().unwrap();
    sent.push(b"after the crash".to_vec());
    assert_eq!(leveldb_records(&read(&path)), Ok(sent));
}

/// Records larger than one transfer (MDTS, 128 KiB here) go as pieces, each a transaction,
/// cut at log block ends: the log is byte for byte what LevelDB's writer frames, its reader
/// reads every record, each completion's crc is that of all the record's bytes. The sizes:
/// one byte under, at and over what one transfer carries, and 1 MiB from several block
/// offsets (a block's tail shorter than a header included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_over_one_transfer_go_as_pieces_and_read_back_whole() {
    let fs = Fs::new(64);
    let mut host = start(&fs).await;
    let path = fs.mnt.join("000005.log");
    // What one FUSED WRITE carries of 128 KiB: the header and 16 extents come first.
    let one = (128 << 10) - 48 - 16 * 16;
    let sizes = [one - 1, one, one + 1, 1 << 20, 5, 32761 - 12, 1 << 20, 3 * 32761 + 2, 1 << 20];
    let mut w = LogWriter::create(&mut host, &path).unwrap();
    let (mut sent, mut framed, mut at) = (Vec::new(), Vec::new(), 0u32);
    for (i, &n) in sizes.iter().enumerate() {
        let r: Vec<u8> = (0..n).map(|k| (k as u8).wrapping_mul(31).wrapping_add(i as u8)).collect();
        let before = w.len();
        let a = w.add_record(&r).await.unwrap();
        at = nearstore_wire::fused::frame_record(at % 32768, &r, &mut framed);
        assert_eq!(a.len, framed.len() as u64, "record {i} of {n} bytes");
        assert_eq!(a.count as u64, a.len - before, "record {i}");
        sent.push((before, a));
    }
    let len = w.finish().unwrap();
    let log = read(&path);
    assert_eq!(log.len() as u64, len);
    assert!(log == framed, "the log's bytes are not what LevelDB's writer frames");
    for (i, (before, a)) in sent.iter().enumerate() {
        assert_eq!(a.crc, crc32c::crc32c(&log[*before as usize..a.len as usize]), "record {i}: crc of all its pieces");
        assert_eq!(host.outcome(&path, a.txid).await.unwrap().0, state::COMMITTED, "record {i}");
    }
    let records = leveldb_records(&log).unwrap();
    assert_eq!(records.iter().map(Vec::len).collect::<Vec<_>>(), sizes.to_vec());
    // append_crc_write too.
    let big: Vec<u8> = (0..(1usize << 20) + 3).map(|k| k as u8).collect();
    let a = host.append_crc_write(&path, &big).await.unwrap();
    let log = read(&path);
    assert_eq!(log.len() as u64, a.len);
    assert_eq!(leveldb_records(&log).unwrap().last(), Some(&big));
}

/// A record's piece refused after earlier pieces committed: the error names the refused
/// piece's transaction (never run), the file's size is not set, and the pieces that did land
/// are a record without its end, which `log_end` leaves out (the next append writes over
/// them). The target exports a copy of the image cut 200 KiB into the log's blocks, so the
/// first two pieces (three log blocks each) land and the third is out of its range.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_refused_after_some_pieces_leaves_no_record() {
    use nearstore_host::object::{map_file, Mapped};
    let fs = Fs::new(64);
    let path = fs.mnt.join("000013.log");
    // The log's blocks allocated and written (zeros), where the host will find them.
    let f = std::fs::File::create(&path).unwrap();
    std::io::Write::write_all(&mut &f, &vec![0u8; 2 << 20]).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let mut probe = DeviceMap::default();
    probe.add_file(&fs.image, Endpoint { address: "127.0.0.1:9".parse().unwrap(), nqn: NQN.into(), nsid: 1 }).unwrap();
    let Ok(Mapped::Offload(fo)) = map_file(&path, &probe) else { panic!("the log does not map") };
    let at = fo.object.extents[0].offset;
    assert!(fo.object.extents[0].len >= 256 << 10, "{:?}", fo.object.extents);
    let cut = fs.dir.path().join("cut.img");
    let image = std::fs::read(&fs.image).unwrap();
    std::fs::write(&cut, &image[..(at + (200 << 10)) as usize]).unwrap();
    let mut host = start_exporting(&fs, &cut).await;
    let record: Vec<u8> = (0..1usize << 20).map(|k| (k * 7) as u8).collect();
    let e = host.append_crc_write(&path, &record).await.unwrap_err();
    let txid = e.txid().unwrap_or_else(|| panic!("no txid in {e}"));
    assert_eq!(host.outcome(&path, txid).await.unwrap().0, state::UNKNOWN, "the refused piece never ran: {e}");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 2 << 20, "the size was not set");
    // What landed (in the cut copy): a FIRST, MIDDLEs, no LAST. As a log, it ends before it.
    let landed = std::fs::read(&cut).unwrap()[at as usize..].to_vec();
    assert_eq!(landed[6], nearstore_wire::fused::record::FIRST, "the first piece landed");
    assert_eq!(landed[3 * 32768 + 6], nearstore_wire::fused::record::MIDDLE, "the second piece landed");
    let mut framed = Vec::new();
    nearstore_wire::fused::frame_record(0, &record, &mut framed);
    assert!(landed[..6 * 32768] == framed[..6 * 32768], "the two pieces are the record's first six blocks");
    let tail = fs.dir.path().join("landed.log");
    std::fs::write(&tail, [landed, vec![0u8; 64 << 10]].concat()).unwrap();
    assert_eq!(log_end(&tail).unwrap(), 0, "an unfinished record is not part of the log");
}

/// An append whose completion is lost (the connection cut as the target answers) is in
/// doubt: it may have landed, so the LogWriter takes no more records (the next one would go
/// over it) until reopened; reopened, it goes on after the record, which did land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_writer_takes_no_record_after_an_append_in_doubt() {
    use std::sync::atomic::Ordering::Relaxed;
    let fs = Fs::new(64);
    let faults = std::sync::Arc::new(proxy::Faults::default());
    let via = proxy::proxy(serve(&fs.image).await, faults.clone(), 0).await;
    let mut host = host_at(&fs, via);
    let path = fs.mnt.join("000015.log");
    let mut w = LogWriter::create(&mut host, &path).unwrap();
    w.add_record(b"first").await.unwrap();
    faults.cut.store(true, Relaxed);
    let e = w.add_record(b"in doubt").await.unwrap_err();
    let txid = e.txid().unwrap_or_else(|| panic!("no txid in {e}"));
    faults.cut.store(false, Relaxed);
    let refused = w.add_record(b"over it?").await.unwrap_err().to_string();
    assert!(refused.contains(&format!("{txid:#018x}")) && refused.contains("reopen"), "{refused}");
    drop(w);
    // Its outcome, then the log reopened from its end: the record in doubt is in it.
    let mut outcome = None;
    for _ in 0..50 {
        match host.outcome(&path, txid).await {
            Ok((s, _)) if s != state::UNKNOWN => {
                outcome = Some(s);
                break;
            }
            r => {
                eprintln!("outcome: {r:?}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await
            }
        }
    }
    assert_eq!(outcome, Some(state::COMMITTED));
    let mut w = LogWriter::open(&mut host, &path).unwrap();
    w.add_record(b"third").await.unwrap();
    w.finish().unwrap();
    assert_eq!(leveldb_records(&read(&path)), Ok(vec![b"first".to_vec(), b"in doubt".to_vec(), b"third".to_vec()]));
}

/// An append the target refuses after it was sent (here: its extents lie past the end of
/// a namespace smaller than the file system the host mapped) fails carrying its
/// transaction id, which the host can ask OUTCOME about. Before, the error had no id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_append_names_its_transaction_for_outcome() {
    let fs = Fs::new(64);
    let mut host = start_small(&fs).await;
    let path = fs.mnt.join("000007.log");
    // Past the namespace's first MiB of the file system.
    std::fs::write(&path, vec![1u8; 8 << 20]).unwrap();
    let e = host.write_checksum(&path, 7 << 20, b"x").await.unwrap_err();
    let txid = e.txid().unwrap_or_else(|| panic!("no txid in {e}"));
    assert!(e.to_string().contains(&format!("{txid:#018x}")), "{e}");
    assert_eq!(host.outcome(&path, txid).await.unwrap().0, state::UNKNOWN, "refused before its journal");
    let log = fs.mnt.join("000009.log");
    // 7 MiB of log (each block one record header and its bytes, as log_end reads them):
    // the append goes after them, outside the namespace.
    std::fs::write(&log, vec![0xffu8; 7 << 20]).unwrap();
    let e = host.append_crc_write(&log, b"record").await.unwrap_err();
    let txid = e.txid().unwrap_or_else(|| panic!("no txid in {e}"));
    assert_eq!(host.outcome(&log, txid).await.unwrap().0, state::UNKNOWN);
    // An error before anything was sent carries none.
    let e = host.write_checksum(&path, 9 << 20, b"x").await.unwrap_err();
    assert_eq!(e.txid(), None, "{e}");
}

/// A LogWriter whose file another writer replaced (a rename over it) or truncated fails
/// its next append naming what changed, instead of appending through its stale extent
/// map into blocks the file no longer owns. Before, the append went through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_changed_under_its_writer_fails_the_next_append() {
    let fs = Fs::new(64);
    let mut host = start(&fs).await;
    // (case, what changes the file, what the error says)
    type Change = fn(&Path);
    let cases: [(&str, Change, &str); 3] = [
        (
            "renamed over",
            |p| {
                let other = p.with_extension("new");
                std::fs::write(&other, b"").unwrap();
                std::fs::rename(&other, p).unwrap();
            },
            "was replaced",
        ),
        ("truncated", |p| std::fs::OpenOptions::new().write(true).open(p).unwrap().set_len(0).unwrap(), "is 0 bytes"),
        (
            "appended to",
            |p| std::io::Write::write_all(&mut std::fs::OpenOptions::new().append(true).open(p).unwrap(), b"x").unwrap(),
            "bytes, its writer left it",
        ),
    ];
    for (i, (case, change, says)) in cases.into_iter().enumerate() {
        let path = fs.mnt.join(format!("{i}.log"));
        let mut w = LogWriter::create(&mut host, &path).unwrap();
        w.add_record(&record(0)).await.unwrap();
        change(&path);
        let e = w.add_record(&record(1)).await.unwrap_err();
        assert!(e.to_string().contains(says), "{case}: {e}");
    }
}

/// write-checksum inside a file while another writer appends to it: the file keeps every
/// appended byte. Before, write-checksum set the size it had mapped, cutting the appends
/// made during its round trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_checksum_never_cuts_a_concurrent_append() {
    let fs = Fs::new(64);
    let mut host = start(&fs).await;
    let path = fs.mnt.join("grown");
    std::fs::write(&path, vec![7u8; 64 << 10]).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let appender = {
        let (path, stop) = (path.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut f = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::io::Write::write_all(&mut f, &[9u8; 512]).unwrap();
                n += 512;
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
            n
        })
    };
    for i in 0..20u8 {
        host.write_checksum(&path, 4096 * i as u64, &[i; 100]).await.unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let appended = appender.join().unwrap();
    assert!(appended > 0);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), (64 << 10) + appended);
}
