//! The fused write operations over NVMe/TCP (docs/compute-protocol.md, "Fused write
//! operations"): append-crc-write frames LevelDB log records on the target, through the
//! namespace's MicroTx journal, and an independent reader of LevelDB's log format gets
//! every record back; write-checksum and read-checksum return the checksum of exactly the
//! bytes they moved; OUTCOME answers for a transaction id, also on another connection;
//! every refusal with its standard status, nothing written.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nearstore_initiator::{ConnectOptions, Controller, Data, Error, IoQueue};
use nearstore_target::backend::{Backend, FileBackend};
use nearstore_target::config::Config;
use nearstore_target::limits::{
    CROSS_CONTROLLER_RESETS_MAX, CROSS_CONTROLLER_RESET_WAIT_MS, FUSED_WAITING_PER_NAMESPACE_MAX, MICROTX_JOURNAL_BYTES,
    QUEUE_BUFFERS_FIXED, TRANSFER_BYTES_MAX,
};
use nearstore_target::microtx::Journal;
use nearstore_target::subsystem::Namespace;
use nearstore_target::Target;
use nearstore_wire::compute::status as cs;
use nearstore_wire::fused::{self, modify, op, opcode, state, Fused};
use nearstore_wire::pdu::{self, PduType};
use nearstore_wire::resv::{racqa, rrega, Cdw10, Keys, Rtype};
use nearstore_wire::sqe::sgl_id;
use nearstore_wire::{Sgl, Sqe, Status};

const NQN: &str = "nqn.2026-11.io.nearstore:fused";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000f1";
/// In a tenant that may write only the namespace's first MiB.
const NARROW: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000f2";
/// In the wide tenant too, with its own Host Identifier.
const OTHER: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000f3";
const BS: u64 = 512;
const NS_BYTES: u64 = 8 << 20;
/// The test object: two extents of the journaled namespace (1), the second not after the
/// first, so that records cross from one to the other.
const OBJECT: [(u64, u64); 2] = [(3 << 20, 96 << 10), (1 << 20, 1 << 20)];

struct Env {
    _target: Arc<Target>,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

async fn start() -> Env {
    let dir = tempfile::tempdir().unwrap();
    let cfg = format!(
        r#"
        [[listener]]
        address = "127.0.0.1:0"
        [[subsystem]]
        nqn = "{NQN}"
        allow_any_host = true
        [[subsystem.namespace]]
        nsid = 1
        path = "{d}/journaled.img"
        size = "8MiB"
        block_size = {BS}
        microtx = true
        [[subsystem.namespace]]
        nsid = 2
        path = "{d}/plain.img"
        size = "1MiB"
        [[tenant]]
        name = "wide"
        hosts = ["{HOST}", "{OTHER}"]
        [[tenant.reach]]
        subsystem = "{NQN}"
        [[tenant]]
        name = "narrow"
        hosts = ["{NARROW}"]
        [[tenant.reach]]
        subsystem = "{NQN}"
        nsid = 1
        lbas = [0, 2048]
        "#,
        d = dir.path().display()
    );
    let target = Target::from_config(&Config::from_toml(&cfg).unwrap()).unwrap();
    let addr = target.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    Env { _target: target, addr, _dir: dir }
}

async fn connect(env: &Env, host: &str) -> (Controller, IoQueue) {
    let mut o = ConnectOptions::new(env.addr, NQN);
    o.hostnqn = host.into();
    let c = Controller::connect(o).await.unwrap();
    let q = c.io_queue(1).await.unwrap();
    (c, q)
}

/// The namespace pieces holding object bytes [from, to) of an object laid out on `extents`.
fn pieces(extents: &[(u64, u64)], mut from: u64, to: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = 0;
    for &(off, len) in extents {
        if from < at + len && from < to {
            let n = (at + len).min(to) - from;
            out.push((off + (from - at), n));
            from += n;
        }
        at += len;
    }
    out
}

/// A FUSED WRITE's transfer for `data` at object offset `offset` of OBJECT.
fn transfer(opcode: u8, txid: u64, offset: u64, data: &[u8]) -> Vec<u8> {
    let block_offset = if opcode == op::APPEND_CRC_WRITE { (offset % fused::LOG_BLOCK_BYTES as u64) as u32 } else { 0 };
    let n = if opcode == op::APPEND_CRC_WRITE { fused::framed_len(block_offset, data.len()) } else { data.len() } as u64;
    let (from, to) = (offset / BS * BS, (offset + n).div_ceil(BS) * BS);
    Fused { op: opcode, txid, offset, block_offset, args: [0; 8], extents: pieces(&OBJECT, from, to) }.encode(data)
}

async fn read_object(q: &mut IoQueue, len: u64) -> Vec<u8> {
    let mut out = Vec::new();
    for (off, n) in pieces(&OBJECT, 0, len.div_ceil(BS) * BS) {
        let mut at = 0;
        while at < n {
            let k = (n - at).min(64 << 10);
            out.extend(q.read(1, (off + at) / BS, (k / BS) as u32, BS as u32).await.unwrap());
            at += k;
        }
    }
    out.truncate(len as usize);
    out
}

/// LevelDB's log format read from its description (db/log_format.md), apart from the
/// target's code: 32 KiB blocks of records (crc u32: masked crc32c of the type byte and
/// the data; length u16; type), FULL or FIRST, MIDDLE.., LAST; a block's tail shorter than
/// a header, and a zero header (a preallocated region), end the block.
fn leveldb_records(log: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let unmask = |m: u32| m.wrapping_sub(0xa282_ead8).rotate_left(15);
    let (mut records, mut partial): (Vec<Vec<u8>>, Option<Vec<u8>>) = (Vec::new(), None);
    for (b, block) in log.chunks(32768).enumerate() {
        let mut p = 0;
        while p + 7 <= block.len() {
            let crc = u32::from_le_bytes(block[p..p + 4].try_into().unwrap());
            let len = u16::from_le_bytes([block[p + 4], block[p + 5]]) as usize;
            let kind = block[p + 6];
            if kind == 0 && len == 0 {
                break;
            }
            let data = block.get(p + 7..p + 7 + len).ok_or(format!("block {b} byte {p}: record past its block"))?;
            let mut typed = vec![kind];
            typed.extend_from_slice(data);
            if unmask(crc) != crc32c::crc32c(&typed) {
                return Err(format!("block {b} byte {p}: checksum"));
            }
            match (kind, partial.take()) {
                (1, None) => records.push(data.to_vec()),
                (2, None) => partial = Some(data.to_vec()),
                (3, Some(mut r)) => {
                    r.extend_from_slice(data);
                    partial = Some(r);
                }
                (4, Some(mut r)) => {
                    r.extend_from_slice(data);
                    records.push(r);
                }
                (k, _) => return Err(format!("block {b} byte {p}: record type {k} out of place")),
            }
            p += 7 + len;
        }
    }
    match partial {
        None => Ok(records),
        Some(_) => Err("the log ends inside a record".into()),
    }
}

fn status(r: Result<impl std::fmt::Debug, Error>) -> Status {
    match r {
        Err(Error::Status { status, .. }) => status,
        other => panic!("expected a status, got {other:?}"),
    }
}

fn bytes(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Records of every shape LevelDB's writer makes (empty, small, exactly a block's room,
/// across one and two block boundaries, a header that just fits a block's end), appended
/// one command each: each completion is the crc32c and count of the framed bytes; OUTCOME
/// (on another connection too) has the object's new length; the object reads back as a
/// LevelDB log holding every record.
#[tokio::test]
async fn append_crc_write_makes_a_log_leveldb_reads() {
    let env = start().await;
    let (_c, mut q) = connect(&env, HOST).await;
    let sizes = [0usize, 100, 32761 - 107, 7, 40_000, 1, 32768 - 7 - 1, 100_000, 3, 65_000];
    let (mut len, mut sent) = (0u64, Vec::new());
    for (i, n) in sizes.into_iter().enumerate() {
        let data = bytes(n, i as u8);
        let mut framed = Vec::new();
        fused::frame_record((len % 32768) as u32, &data, &mut framed);
        let txid = 1000 + i as u64;
        let (crc, count) = q.fused_write(1, &transfer(op::APPEND_CRC_WRITE, txid, len, &data)).await.unwrap();
        assert_eq!((crc, count as usize), (crc32c::crc32c(&framed), framed.len()), "record {i} of {n} bytes");
        len += count as u64;
        let (st, r) = q.outcome(1, txid).await.unwrap();
        assert_eq!((st, fused::parse_result(&r)), (state::COMMITTED, (crc, count, len)), "record {i}");
        sent.push(data);
    }
    let object = read_object(&mut q, len).await;
    assert_eq!(leveldb_records(&object), Ok(sent.clone()));
    // Zeros after the log (a preallocated tail) read as its end.
    let mut padded = object.clone();
    padded.resize(object.len() + 5000, 0);
    assert_eq!(leveldb_records(&padded), Ok(sent));
    // Another connection (a host back after a reconnect) learns the same outcomes.
    let (_c2, mut q2) = connect(&env, HOST).await;
    assert_eq!(q2.outcome(1, 1000).await.unwrap().0, state::COMMITTED);
    assert_eq!(q2.outcome(1, 999).await.unwrap(), (state::UNKNOWN, [0; fused::RESULT_BYTES]));
}

/// write-checksum at unaligned offsets inside and across blocks and extents keeps the
/// bytes around it, returns the crc32c of exactly its data; read-checksum returns the
/// blocks and the crc32c of the byte range asked for.
#[tokio::test]
async fn write_and_read_checksum_cover_exactly_their_bytes() {
    let env = start().await;
    let (_c, mut q) = connect(&env, HOST).await;
    let base = bytes(200_000, 9);
    let mut model = base.clone();
    // The object's first 200000 bytes written plainly.
    fill_object(&mut q, &base).await;
    // (object offset, length): inside a block, across blocks, across the two extents.
    let cases = [(1000u64, 10usize), (511, 2), (4000, 9000), (98_000, 1000), (96 * 1024 - 3, 6), (0, 512)];
    for (i, (off, n)) in cases.into_iter().enumerate() {
        let data = bytes(n, 100 + i as u8);
        let (crc, count) = q.fused_write(1, &transfer(op::WRITE_CHECKSUM, 2000 + i as u64, off, &data)).await.unwrap();
        assert_eq!((crc, count as usize), (crc32c::crc32c(&data), n), "case {i}");
        model[off as usize..off as usize + n].copy_from_slice(&data);
    }
    assert_eq!(read_object(&mut q, model.len() as u64).await, model);
    // read-checksum of 8 blocks of the second extent, ranges of them checksummed.
    let (ns_off, obj_off) = (OBJECT[1].0, OBJECT[0].1 as usize);
    for (lo, hi) in [(0u32, 4096u32), (7, 8), (100, 3000), (5, 5)] {
        let (d, crc) = q.read_checksum(1, ns_off / BS, 8, BS as u32, lo..hi).await.unwrap();
        assert_eq!(d, model[obj_off..obj_off + 4096], "{lo}..{hi}");
        assert_eq!(crc, crc32c::crc32c(&model[obj_off + lo as usize..obj_off + hi as usize]), "{lo}..{hi}");
    }
}

/// Writes `base` plainly over the object's first bytes (whole blocks, the last zero-filled).
async fn fill_object(q: &mut IoQueue, base: &[u8]) {
    let mut at = 0u64;
    for (off, n) in pieces(&OBJECT, 0, (base.len() as u64).div_ceil(BS) * BS) {
        let mut k = 0;
        while k < n {
            let m = (n - k).min(64 << 10);
            let mut blk = vec![0u8; m as usize];
            let lo = (at + k) as usize;
            let hi = (lo + m as usize).min(base.len());
            if lo < hi {
                blk[..hi - lo].copy_from_slice(&base[lo..hi]);
            }
            q.write(1, (off + k) / BS, &blk, BS as u32, false).await.unwrap();
            k += m;
        }
        at += n;
    }
}

/// A FUSED WRITE's transfer of operation `opcode` with `args`, its extents covering `n`
/// bytes at object offset `offset` of OBJECT.
fn transfer_with(opcode: u8, args: [u8; 8], txid: u64, offset: u64, n: u64, data: &[u8]) -> Vec<u8> {
    let (from, to) = (offset / BS * BS, (offset + n).div_ceil(BS) * BS);
    Fused { op: opcode, txid, offset, block_offset: 0, args, extents: pieces(&OBJECT, from, to) }.encode(data)
}

/// read-modify-write combines its data with exactly its bytes (inside a block, across blocks
/// and across the object's two extents, each width of add with carries and wrapping), and
/// compress-write writes one zstd frame of its data, its extents covering the largest frame
/// while the blocks past the frame it wrote stay as they were; each result is what OUTCOME
/// returns for its transaction.
#[tokio::test]
async fn read_modify_write_and_compress_write_change_exactly_their_bytes() {
    let env = start().await;
    let (_c, mut q) = connect(&env, HOST).await;
    let mut model = bytes(200_000, 3);
    fill_object(&mut q, &model).await;
    let m = |kind, width| [kind, width, 0, 0, 0, 0, 0, 0];
    // (object offset, args, data); the expected bytes computed here by hand.
    let cases: Vec<(u64, [u8; 8], Vec<u8>)> = vec![
        (1000, m(modify::REPLACE, 0), bytes(24, 50)),
        (508, m(modify::ADD, 8), [1u64.to_le_bytes(), u64::MAX.to_le_bytes()].concat()),
        (4000, m(modify::XOR, 0), bytes(9000, 51)),
        (96 * 1024 - 4, m(modify::ADD, 4), [7u32.to_le_bytes(), 0xffff_fff0u32.to_le_bytes()].concat()),
        (10_001, m(modify::ADD, 2), vec![1, 0, 0xff, 0xff, 0, 1]),
        (20_000, m(modify::ADD, 1), vec![1; 700]),
    ];
    for (i, (off, args, data)) in cases.into_iter().enumerate() {
        let txid = 3000 + i as u64;
        let (crc, count) =
            q.fused_write(1, &transfer_with(op::READ_MODIFY_WRITE, args, txid, off, data.len() as u64, &data)).await.unwrap();
        let old = &mut model[off as usize..off as usize + data.len()];
        match args[0] {
            modify::REPLACE => old.copy_from_slice(&data),
            modify::XOR => old.iter_mut().zip(&data).for_each(|(o, d)| *o ^= d),
            _ => {
                let w = args[1] as usize;
                for (o, d) in old.chunks_mut(w).zip(data.chunks(w)) {
                    let mut carry = 0u16;
                    for (ob, db) in o.iter_mut().zip(d) {
                        let s = *ob as u16 + *db as u16 + carry;
                        *ob = s as u8;
                        carry = s >> 8;
                    }
                }
            }
        }
        let new = &model[off as usize..off as usize + data.len()];
        assert_eq!((crc, count as usize), (crc32c::crc32c(new), data.len()), "case {i}");
        let (state_, result) = q.outcome(1, txid).await.unwrap();
        assert_eq!(state_, state::COMMITTED, "case {i}");
        assert_eq!(fused::parse_result(&result), (crc, count, off + data.len() as u64), "case {i}");
        assert_eq!(read_object(&mut q, model.len() as u64).await, model, "case {i}: the object after it");
    }
    // compress-write: compressible text, and random bytes, whose frame is longer than them.
    let text: Vec<u8> = (0..60_000u32).flat_map(|i| format!("line {i} of the log\n").into_bytes()).take(60_000).collect();
    // Bytes of crc32c's of counters: nothing for zstd to find.
    let noise: Vec<u8> = (0..3000u32).map(|i| crc32c::crc32c(&i.to_le_bytes()) as u8).collect();
    for (i, (off, level, data)) in [(150_001u64, 0i8, &text), (3_333, 19, &noise), (777, -5, &noise)].into_iter().enumerate() {
        let txid = 3100 + i as u64;
        let bound = fused::compress_bound(data.len()) as u64;
        let t = transfer_with(op::COMPRESS_WRITE, m(level as u8, 0), txid, off, bound, data);
        let (crc, count) = q.fused_write(1, &t).await.unwrap();
        let after = read_object(&mut q, model.len() as u64 + bound).await;
        let frame = &after[off as usize..off as usize + count as usize];
        assert_eq!(crc, crc32c::crc32c(frame), "frame {i}");
        assert_eq!(zstd::decode_all(frame).unwrap(), *data, "frame {i}");
        if i == 0 {
            assert!((count as usize) < data.len() / 4, "text compresses: {count} bytes of {}", data.len());
        }
        // Nothing else changed, the blocks past the frame included.
        model.resize(after.len(), 0);
        model[off as usize..off as usize + count as usize].copy_from_slice(frame);
        assert_eq!(after, model, "frame {i}: the object around it");
        let (state_, result) = q.outcome(1, txid).await.unwrap();
        assert_eq!((state_, fused::parse_result(&result)), (state::COMMITTED, (crc, count, off + count as u64)), "frame {i}");
    }
    // Extents that cover the data's length but not the largest frame are refused.
    let short = transfer_with(op::COMPRESS_WRITE, [0; 8], 3200, 1024, 4096, &text[..4096]);
    assert_eq!(status(q.fused_write(1, &short).await), cs::DESCRIPTOR_INVALID);
    assert_eq!(q.outcome(1, 3200).await.unwrap().0, state::UNKNOWN);
}

/// read-modify-write holds its blocks against every writer from its read to its write: a
/// host's plain writes of the same blocks, each read back, always find their bytes (past
/// the counter the adds change) and the adds all land. With its blocks shared, as other
/// fused writes hold theirs, a write landing between an add's read and its write in place
/// was undone by the add's stale block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_modify_write_undoes_no_concurrent_write() {
    let env = start().await;
    let (_c, mut q) = connect(&env, HOST).await;
    // Block 8 of the namespace: the counter in its first 8 bytes, the writer's bytes after.
    let block = 8u64;
    q.write(1, block, &[0; BS as usize], BS as u32, false).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        let (c, mut w) = connect(&env, OTHER).await;
        tokio::spawn(async move {
            let _c = c;
            let mut n = 0u64;
            while !stop.load(Relaxed) {
                n += 1;
                // The counter's bytes as they are, the rest this write's own.
                let mut b = w.read(1, block, 1, BS as u32).await.unwrap();
                b[8..].fill(n as u8);
                b[8..16].copy_from_slice(&n.to_le_bytes());
                w.write(1, block, &b, BS as u32, false).await.unwrap();
                let back = w.read(1, block, 1, BS as u32).await.unwrap();
                assert_eq!(back[8..], b[8..], "write {n} was undone by a read-modify-write");
            }
            n
        })
    };
    let adds = 200u64;
    for i in 0..adds {
        let f = Fused {
            op: op::READ_MODIFY_WRITE,
            txid: 5000 + i,
            offset: 0,
            block_offset: 0,
            args: [modify::ADD, 8, 0, 0, 0, 0, 0, 0],
            extents: vec![(block * BS, BS)],
        };
        q.fused_write(1, &f.encode(&1u64.to_le_bytes())).await.unwrap();
    }
    stop.store(true, Relaxed);
    let writes = writer.await.unwrap();
    assert!(writes > 0);
    let b = q.read(1, block, 1, BS as u32).await.unwrap();
    // A plain write carries the counter it read: an add between its read and its write is
    // lost to it (that is the plain writer's race, not the add's), so the counter is at most
    // the adds; each add's own read-modify-write is whole.
    assert!(u64::from_le_bytes(b[..8].try_into().unwrap()) <= adds);
}

/// Each refusal's status; none writes a byte, and a refused transaction id stays free.
#[tokio::test]
async fn refusals_have_the_standard_statuses_and_write_nothing() {
    let env = start().await;
    let (_c, mut q) = connect(&env, HOST).await;
    let (_n, mut narrow) = connect(&env, NARROW).await;
    let good = |txid| transfer(op::APPEND_CRC_WRITE, txid, 0, b"record");
    let desc = |extents: Vec<(u64, u64)>| {
        Fused { op: op::WRITE_CHECKSUM, txid: 9, offset: 0, block_offset: 0, args: [0; 8], extents }.encode(&[7; 600])
    };
    let mut magic = good(9);
    magic[0] = b'X';
    let mut short = good(9);
    short.truncate(30);
    // The bytes written end 100 bytes before u64::MAX: their last block's end passes it.
    let near_end =
        Fused { op: op::WRITE_CHECKSUM, txid: 9, offset: u64::MAX - 700, block_offset: 0, args: [0; 8], extents: vec![(0, 1024)] }
            .encode(&[7; 600]);
    let misplaced =
        Fused { op: op::APPEND_CRC_WRITE, txid: 9, offset: 0, block_offset: 100, args: [0; 8], extents: vec![(0, 512)] }.encode(b"record");
    q.fused_write(1, &good(5)).await.unwrap();
    // (what, namespace, transfer, the narrow tenant's host, status)
    let cases: Vec<(&str, u32, Vec<u8>, bool, Status)> = vec![
        ("a namespace without a journal", 2, good(9), false, Status::INVALID_OPCODE.dnr()),
        ("no such namespace", 7, good(9), false, Status::INVALID_NAMESPACE.dnr()),
        ("bad magic", 1, magic, false, cs::DESCRIPTOR_INVALID),
        ("shorter than the header", 1, short, false, cs::DESCRIPTOR_INVALID),
        ("too many extents", 1, desc(vec![(0, 512); 17]), false, cs::LIMIT_EXCEEDED),
        ("an extent past the namespace", 1, desc(vec![(NS_BYTES - 512, 1024)]), false, Status::LBA_OUT_OF_RANGE.dnr()),
        ("an extent not whole blocks", 1, desc(vec![(0, 1000)]), false, cs::DESCRIPTOR_INVALID),
        ("an extent off a block boundary", 1, desc(vec![(100, 1024)]), false, cs::DESCRIPTOR_INVALID),
        ("extents short of the data", 1, desc(vec![(0, 512)]), false, cs::DESCRIPTOR_INVALID),
        ("blocks ending past u64::MAX", 1, near_end, false, cs::DESCRIPTOR_INVALID),
        ("a block offset not the offset's", 1, misplaced, false, cs::DESCRIPTOR_INVALID),
        ("an extent wholly past the data", 1, desc(vec![(0, 1024), (4096, 512)]), false, cs::DESCRIPTOR_INVALID),
        ("a transaction id in use", 1, good(5), false, Status::INVALID_FIELD.dnr()),
        ("beyond the tenant's blocks", 1, desc(vec![(1 << 20, 1024)]), true, Status::ACCESS_DENIED.dnr()),
    ];
    for (what, nsid, t, in_narrow, want) in cases {
        let qq = if in_narrow { &mut narrow } else { &mut q };
        assert_eq!(status(qq.fused_write(nsid, &t).await), want, "{what}");
    }
    // Nothing of them written: the object holds only the first append's record, the
    // namespace's blocks the refused ones named are zeros.
    let mut rec = Vec::new();
    fused::frame_record(0, b"record", &mut rec);
    let head = read_object(&mut q, 1024).await;
    assert_eq!(&head[..rec.len()], &rec[..]);
    assert!(head[rec.len()..].iter().all(|&b| b == 0));
    for lba in [0, 8, 2048, NS_BYTES / BS - 2] {
        assert!(q.read(1, lba, 2, BS as u32).await.unwrap().iter().all(|&b| b == 0), "LBA {lba}");
    }
    // The refused id 9 is free: it runs now, within the narrow tenant's blocks.
    assert!(narrow.fused_write(1, &desc(vec![(8192, 1024)])).await.is_ok());
    assert_eq!(q.outcome(1, 9).await.unwrap().0, state::COMMITTED);

    // READ CHECKSUM and OUTCOME refusals.
    assert_eq!(status(q.read_checksum(1, NS_BYTES / BS - 1, 2, BS as u32, 0..1).await), Status::LBA_OUT_OF_RANGE.dnr());
    assert_eq!(status(q.read_checksum(1, 0, 1, BS as u32, 500..513).await), Status::INVALID_FIELD.dnr());
    assert_eq!(status(q.read_checksum(9, 0, 1, BS as u32, 0..1).await), Status::INVALID_NAMESPACE.dnr());
    assert_eq!(status(narrow.read_checksum(1, 2048, 1, BS as u32, 0..1).await), Status::ACCESS_DENIED.dnr());
    assert_eq!(status(q.outcome(2, 5).await), Status::INVALID_OPCODE.dnr());
}

/// A namespace file whose in-place writes wait at a gate the test opens (its journal's
/// file is not gated), counting the writes that reached it.
struct Gated {
    file: FileBackend,
    open: AtomicBool,
    arrived: AtomicUsize,
}

impl Backend for Gated {
    fn describe(&self) -> String {
        "gated file".into()
    }
    fn size(&self) -> u64 {
        self.file.size()
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        self.file.read_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
        self.arrived.fetch_add(1, Relaxed);
        while !self.open.load(Relaxed) {
            std::thread::sleep(Duration::from_millis(2));
        }
        self.file.write_at(buf, off)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.file.flush()
    }
    fn write_zeroes(&self, off: u64, len: u64, deallocate: bool) -> std::io::Result<()> {
        self.file.write_zeroes(off, len, deallocate)
    }
}

/// Opens the gate when dropped: a failed test's runtime does not wait for ever on the
/// blocking threads held at it.
struct OpenOnDrop(Arc<Gated>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open.store(true, Relaxed);
    }
}

/// Namespace GATED of `env`: a gated 1 MiB file with its MicroTx journal.
const GATED: u32 = 3;
fn add_gated(env: &Env) -> (Arc<Gated>, Arc<Journal>) {
    let file = FileBackend::open(&env._dir.path().join("gated.img"), Some(1 << 20)).unwrap();
    let gated = Arc::new(Gated { file, open: AtomicBool::new(false), arrived: AtomicUsize::new(0) });
    let log = FileBackend::open(&env._dir.path().join("gated.img.microtx"), Some(MICROTX_JOURNAL_BYTES)).unwrap();
    let (journal, _) = Journal::open(Arc::new(log), &*gated, BS).unwrap();
    let journal = Arc::new(journal);
    let mut ns = Namespace::new(NQN, GATED, gated.clone(), BS as u32);
    ns.journal = Some(journal.clone());
    env._target.subsystem(NQN).unwrap().add_namespace(ns).unwrap();
    (gated, journal)
}

/// A write-checksum transfer of `data` at namespace byte `at` (one block-aligned extent).
fn plain_transfer(txid: u64, at: u64, data: &[u8]) -> Vec<u8> {
    Fused { op: op::WRITE_CHECKSUM, txid, offset: 0, block_offset: 0, args: [0; 8], extents: vec![(at, data.len() as u64)] }.encode(data)
}

async fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(20), "waited 20 s for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A host's connection with its own Host Identifier (reservations are the identifier's).
async fn connect_as(env: &Env, host: &str, id: u8) -> (Controller, IoQueue) {
    let mut o = ConnectOptions::new(env.addr, NQN);
    o.hostnqn = host.into();
    o.hostid = [id; 16];
    let c = Controller::connect(o).await.unwrap();
    let q = c.io_queue(1).await.unwrap();
    (c, q)
}

/// Preempt and Abort against a host with FUSED WRITEs queued behind a slow one (held at
/// the storage, its turn on the namespace's journal taken): B's queued ones complete at
/// once with Command Aborted due to Preempt and Abort and never write a byte; A's Acquire
/// completes only after B's running transaction has ended. Before, the queued ones waited
/// on blocking threads for the running one and the test slept 300 ms and accepted
/// Reservation Conflict for a queued write that had not reached the target yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preempt_and_abort_stops_queued_fused_writes() {
    let env = start().await;
    let (gated, journal) = add_gated(&env);
    let _open = OpenOnDrop(gated.clone());
    let (_ac, mut a) = connect_as(&env, OTHER, 0xa).await;
    let (_bc, mut b) = connect_as(&env, HOST, 0xb).await;
    let reg = |k| (Cdw10 { action: rrega::REGISTER, ..Default::default() }, Keys { current: 0, other: k });
    let (c, k) = reg(0xa1);
    a.resv_register(GATED, c, k).await.unwrap();
    let (c, k) = reg(0xb2);
    b.resv_register(GATED, c, k).await.unwrap();
    let rtype = Rtype::ExclusiveAccessRegistrantsOnly as u8;
    a.resv_acquire(GATED, Cdw10 { action: racqa::ACQUIRE, rtype, ..Default::default() }, Keys { current: 0xa1, other: 0 }).await.unwrap();

    // B: one fused write held at the storage, three queued behind it (the journal's turn).
    let running = tokio::spawn(async move {
        let r = b.fused_write(GATED, &plain_transfer(1, 0, &[1; 512])).await;
        (b, r)
    });
    wait_for("B's first fused write at the storage", || gated.arrived.load(Relaxed) == 1).await;
    let mut queued = Vec::new();
    for (i, at) in [4096u64, 8192, 12288].into_iter().enumerate() {
        let (c, mut q) = connect_as(&env, HOST, 0xb).await;
        queued.push(tokio::spawn(async move {
            let r = q.fused_write(GATED, &plain_transfer(10 + i as u64, at, &[2; 512])).await;
            (c, r)
        }));
    }
    wait_for("B's three queued fused writes admitted", || journal.admitted() == 4).await;
    let cdw10 = Cdw10 { action: racqa::PREEMPT_AND_ABORT, rtype, ..Default::default() };
    let acquire = tokio::spawn(async move { a.resv_acquire(GATED, cdw10, Keys { current: 0xa1, other: 0xb2 }).await.map(|_| a) });
    // The queued ones leave at once, the gate still shut.
    for (i, h) in queued.into_iter().enumerate() {
        let (_c, r) = tokio::time::timeout(Duration::from_secs(20), h).await.expect("B's queued write completes").unwrap();
        assert_eq!(Status { dnr: false, ..status(r) }, Status::ABORTED_PREEMPT, "queued write {i}");
    }
    assert!(!acquire.is_finished(), "the Acquire completed while B's fused write was at the storage");
    assert_eq!(gated.arrived.load(Relaxed), 1);
    gated.open.store(true, Relaxed);
    let mut a = tokio::time::timeout(Duration::from_secs(20), acquire).await.expect("the Acquire completes").unwrap().unwrap();
    let (_b, first) = running.await.unwrap();
    assert!(first.is_ok(), "B's first fused write ran before the preempt: {first:?}");
    assert_eq!(gated.arrived.load(Relaxed), 1, "only B's first fused write reached the storage");
    let blocks = a.read(GATED, 0, 32, BS as u32).await.unwrap();
    assert!(blocks[..512].iter().all(|&x| x == 1));
    assert!(blocks[512..].iter().all(|&x| x == 0), "a queued fused write of B's landed");
    for txid in 10..13 {
        assert_eq!(a.outcome(GATED, txid).await.unwrap().0, state::UNKNOWN, "transaction {txid} never ran");
    }
    assert_eq!(journal.admitted(), 0);
}

/// B's Cross-Controller Reset of `lost` (waiting up to 20 s), on a task: B and its result.
fn reset_later(b: Controller, lost: nearstore_initiator::Instance) -> tokio::task::JoinHandle<(Controller, Result<(), Error>)> {
    tokio::spawn(async move {
        let r = b.cross_controller_reset(lost, Duration::from_secs(20)).await;
        (b, r)
    })
}

/// A Cross-Controller Reset (docs/protocol.md) of a controller with a FUSED WRITE, then
/// one with a Compare and Write, held at the storage completes only once it has written:
/// each runs on a task of its own, not on the controller's queues, and holds its life.
/// Before, the reset completed as soon as the controller's queues were gone, and the write
/// landed after it (each case fails without its own change: checked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cross_controller_reset_waits_for_fused_writes_and_compare_and_write() {
    for pair in [false, true] {
        let what = if pair { "Compare and Write" } else { "fused write" };
        let env = start().await;
        let (gated, _journal) = add_gated(&env);
        let _open = OpenOnDrop(gated.clone());
        let (a, mut aq) = connect(&env, HOST).await;
        let (b, mut bq) = connect(&env, HOST).await;
        let held = tokio::spawn(async move {
            if pair {
                aq.compare_and_write(GATED, 16, &[0; 512], &[2; 512], BS as u32, false).await.map(|_| ())
            } else {
                aq.fused_write(GATED, &plain_transfer(1, 16 * BS, &[2; 512])).await.map(|_| ())
            }
        });
        wait_for(&format!("A's {what} at the storage"), || gated.arrived.load(Relaxed) == 1).await;

        let reset = reset_later(b, a.instance());
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!reset.is_finished(), "the reset completed while A's {what} was at the storage");
        gated.open.store(true, Relaxed);
        let (_b, r) = tokio::time::timeout(Duration::from_secs(20), reset).await.expect("the reset completes").unwrap();
        r.expect("A's work ended");
        // Nothing of A's is left to land: it wrote before the reset completed.
        let block = bq.read(GATED, 16, 1, BS as u32).await.unwrap();
        assert!(block.iter().all(|&x| x == 2), "A's {what} landed before the reset completed");
        // A's command itself got no completion: its queues went with the reset.
        let r = held.await.unwrap();
        assert!(r.is_err(), "a reset controller's {what} completed: {r:?}");
        drop(a);
    }
}

/// A reset controller's work that has not started does not run: a FUSED WRITE still
/// waiting for its turn on the journal leaves the queue, and a Compare and Write still
/// waiting for its blocks does not write, so the reset waits only for what already runs
/// (here a fused write held at the storage). Before, the queued fused write stayed in the
/// journal's queue until its group refused it, and the pair wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_controllers_work_not_yet_started_never_runs() {
    let env = start().await;
    let (gated, journal) = add_gated(&env);
    let _open = OpenOnDrop(gated.clone());
    let ns = env._target.subsystem(NQN).unwrap().namespace(GATED).unwrap();
    let (a, mut aq) = connect(&env, HOST).await;
    let (mut aq2, mut aq3) = (a.io_queue(2).await.unwrap(), a.io_queue(3).await.unwrap());
    let (b, mut bq) = connect(&env, HOST).await;
    let running = tokio::spawn(async move { aq.fused_write(GATED, &plain_transfer(1, 0, &[1; 512])).await });
    wait_for("A's first fused write at the storage", || gated.arrived.load(Relaxed) == 1).await;
    let queued = tokio::spawn(async move { aq2.fused_write(GATED, &plain_transfer(2, 8 * BS, &[2; 512])).await });
    wait_for("A's second fused write queued", || journal.admitted() == 2).await;
    // The pair's exclusive range waits for the writer before it (range_lock.rs).
    let paired = tokio::spawn(async move { aq3.compare_and_write(GATED, 16, &[0; 512], &[3; 512], BS as u32, false).await });
    wait_for("A's Compare and Write waiting for its blocks", || ns.ranges.counts().0 == 1).await;

    let reset = reset_later(b, a.instance());
    wait_for("the queued fused write withdrawn", || journal.admitted() == 1).await;
    assert!(!reset.is_finished(), "the reset completed while A's first fused write was at the storage");
    gated.open.store(true, Relaxed);
    let (_b, r) = tokio::time::timeout(Duration::from_secs(20), reset).await.expect("the reset completes").unwrap();
    r.expect("A's work ended");
    let blocks = bq.read(GATED, 0, 17, BS as u32).await.unwrap();
    assert!(blocks[..512].iter().all(|&x| x == 1), "the running fused write finished");
    assert!(blocks[8 * 512..9 * 512].iter().all(|&x| x == 0), "the queued fused write ran");
    assert!(blocks[16 * 512..].iter().all(|&x| x == 0), "the waiting Compare and Write wrote");
    assert_eq!(bq.outcome(GATED, 2).await.unwrap().0, state::UNKNOWN, "transaction 2 never ran");
    for r in [running.await.unwrap().map(|_| ()), queued.await.unwrap().map(|_| ()), paired.await.unwrap().map(|_| ())] {
        assert!(r.is_err(), "a reset controller's command completed: {r:?}");
    }
    drop(a);
}

/// A Cross-Controller Reset whose controller's work does not end within
/// `CROSS_CONTROLLER_RESET_WAIT_MS` completes with Command Interrupted (retryable), the
/// controller staying reset, and a retry waits again; more than
/// `CROSS_CONTROLLER_RESETS_MAX` waiting on one admin queue: Cross-Controller Reset Limit
/// Exceeded at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cross_controller_reset_is_interrupted_after_its_wait_and_limited_per_queue() {
    let env = start().await;
    let (gated, _journal) = add_gated(&env);
    let _open = OpenOnDrop(gated.clone());
    let (a, mut aq) = connect(&env, HOST).await;
    let fused = tokio::spawn(async move { aq.fused_write(GATED, &plain_transfer(1, 0, &[1; 512])).await });
    wait_for("A's fused write at the storage", || gated.arrived.load(Relaxed) == 1).await;
    let lost = a.instance();
    // B's admin queue is held for longer than a keep-alive period: none are sent.
    let mut o = ConnectOptions::new(env.addr, NQN);
    o.hostnqn = HOST.into();
    o.kato_ms = 60_000;
    o.send_keep_alive = false;
    let b = Controller::connect(o).await.unwrap();

    let start = Instant::now();
    let mut got: Vec<(u64, Status, Duration)> = Vec::new();
    {
        let mut admin = b.admin_queue().await;
        for tag in 0..=CROSS_CONTROLLER_RESETS_MAX as u64 {
            let mut s = Sqe::new(nearstore_wire::opcode::admin::CROSS_CONTROLLER_RESET, 0);
            s.set_cdw(10, u32::from(lost.cntlid) | (u32::from(lost.ciu) << 16));
            s.set_cdw(12, lost.cirn as u32);
            s.set_cdw(13, (lost.cirn >> 32) as u32);
            admin.submit(s, Data::None, tag).unwrap();
        }
        admin.flush().await.unwrap();
        let wait = Duration::from_millis(CROSS_CONTROLLER_RESET_WAIT_MS) + Duration::from_secs(20);
        while got.len() <= CROSS_CONTROLLER_RESETS_MAX {
            let poll = admin.poll(|tag, c, _| got.push((tag, c.status, start.elapsed())));
            tokio::time::timeout(wait, poll).await.expect("every reset completes").unwrap();
        }
    }
    got.sort_by_key(|g| g.0);
    let (_, over, when) = got[CROSS_CONTROLLER_RESETS_MAX];
    assert_eq!(over, Status::CROSS_CONTROLLER_RESET_LIMIT_EXCEEDED, "the one past the limit");
    assert!(when < Duration::from_millis(CROSS_CONTROLLER_RESET_WAIT_MS), "refused at once, not after {when:?}");
    for &(tag, status, when) in &got[..CROSS_CONTROLLER_RESETS_MAX] {
        assert_eq!(status, Status::COMMAND_INTERRUPTED, "reset {tag}: A's fused write is still at the storage");
        assert!(!status.dnr, "Command Interrupted is retryable");
        assert!(when >= Duration::from_millis(CROSS_CONTROLLER_RESET_WAIT_MS), "reset {tag} interrupted after {when:?}");
    }
    // A stays reset: its queues are gone, and a retry waits again until its work ends.
    assert!(fused.await.unwrap().is_err(), "a reset controller's command completed");
    let retry = tokio::spawn(async move { b.cross_controller_reset(lost, Duration::from_secs(20)).await.map(|()| b) });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!retry.is_finished(), "the retry completed while A's fused write was at the storage");
    gated.open.store(true, Relaxed);
    tokio::time::timeout(Duration::from_secs(20), retry).await.expect("the retry completes").unwrap().expect("A's work ended");
    drop(a);
}

/// Queues `n` FUSED WRITEs of 512 bytes on `q` (tags and transaction ids from `first`, at
/// GATED's blocks `first`..), sent at once.
async fn queue_fused(q: &mut IoQueue, first: u64, n: u64) {
    let qp = q.queue();
    for i in first..first + n {
        let mut s = Sqe::new(opcode::FUSED_WRITE, 0);
        s.set_nsid(GATED);
        qp.submit(s, Data::Out(&plain_transfer(i, i * BS, &[i as u8; 512])), i).unwrap();
    }
    qp.flush().await.unwrap();
}

/// Takes `n` completions of `q`: (tag, status).
async fn completions(q: &mut IoQueue, n: usize) -> Vec<(u64, Status)> {
    let mut got = Vec::new();
    while got.len() < n {
        let poll = q.queue().poll(|tag, c, _| got.push((tag, c.status)));
        tokio::time::timeout(Duration::from_secs(60), poll).await.expect("completions within 60 s").unwrap();
    }
    got
}

/// FUSED WRITEs waiting for their turn keep their transfer in the queue's pooled buffers,
/// charged to the target's memory budget. Before, each kept a copy of its own, charged to
/// nothing, and gave its buffer back: a host could make the target hold 33 MiB per queue
/// the budget did not see.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_fused_writes_are_charged_to_the_memory_budget() {
    let env = start().await;
    let (gated, journal) = add_gated(&env);
    let _open = OpenOnDrop(gated.clone());
    let (_c, mut q) = connect(&env, HOST).await;
    let before = env._target.memory.used();
    let n = 12;
    queue_fused(&mut q, 1, n).await;
    wait_for("the fused writes admitted", || journal.admitted() == n as usize).await;
    let charged = env._target.memory.used() - before;
    let held = (n as usize - QUEUE_BUFFERS_FIXED) * TRANSFER_BYTES_MAX;
    assert!(charged >= held as u64, "{n} fused writes outstanding: {charged} bytes charged, at least {held} held");
    gated.open.store(true, Relaxed);
    let done = completions(&mut q, n as usize).await;
    assert!(done.iter().all(|(_, s)| s.is_success()), "{done:?}");
}

/// A namespace's FUSED WRITEs waiting for their turn hold no blocking thread: with two
/// blocking threads, one held at the storage by GATED's running transaction and twenty
/// more waiting behind it, a fused write on another namespace still runs. Before, each
/// waiting one held a thread on the journal's lock, and the pool's last thread (its
/// reservations' state files, DH-HMAC-CHAP, other namespaces' fused writes) never came.
#[test]
fn waiting_fused_writes_hold_no_blocking_thread() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).max_blocking_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let env = start().await;
        let (gated, journal) = add_gated(&env);
        let _open = OpenOnDrop(gated.clone());
        let (_c, mut q) = connect(&env, HOST).await;
        queue_fused(&mut q, 1, 21).await;
        wait_for("the fused writes admitted", || journal.admitted() == 21).await;
        wait_for("the first one at the storage", || gated.arrived.load(Relaxed) == 1).await;
        let (_c2, mut other) = connect(&env, HOST).await;
        let r = tokio::time::timeout(Duration::from_secs(20), other.fused_write(1, &transfer(op::APPEND_CRC_WRITE, 500, 0, b"x"))).await;
        assert!(matches!(r, Ok(Ok(_))), "namespace 1's fused write: {r:?}");
        gated.open.store(true, Relaxed);
        let done = completions(&mut q, 21).await;
        assert!(done.iter().all(|(_, s)| s.is_success()), "{done:?}");
    });
}

/// FUSED_WAITING_PER_NAMESPACE_MAX fused writes admitted on a namespace (one running, the
/// rest waiting for their turn, from three connections): one more is refused with Command
/// Interrupted, which a host retries (DNR clear), and runs when retried after the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fused_writes_beyond_the_namespaces_limit_are_refused_for_a_retry() {
    let env = start().await;
    let (gated, journal) = add_gated(&env);
    let _open = OpenOnDrop(gated.clone());
    let max = FUSED_WAITING_PER_NAMESPACE_MAX as u64;
    let mut queues = Vec::new();
    for k in 0..3 {
        let (c, mut q) = connect(&env, HOST).await;
        let (first, end) = (1 + k * max / 3, if k == 2 { max + 1 } else { 1 + (k + 1) * max / 3 });
        queue_fused(&mut q, first, end - first).await;
        queues.push((c, q, end - first));
    }
    wait_for("the limit's fused writes admitted", || journal.admitted() == max as usize).await;
    let (_c, mut late) = connect(&env, HOST).await;
    let r = late.fused_write(GATED, &plain_transfer(max + 1, 0, &[9; 512])).await;
    assert_eq!(status(r), Status::COMMAND_INTERRUPTED, "one more than FUSED_WAITING_PER_NAMESPACE_MAX (DNR clear)");
    gated.open.store(true, Relaxed);
    for (_c, q, n) in &mut queues {
        let done = completions(q, *n as usize).await;
        assert!(done.iter().all(|(_, s)| s.is_success()), "{done:?}");
    }
    late.fused_write(GATED, &plain_transfer(max + 1, 0, &[9; 512])).await.unwrap();
}

/// A FUSED WRITE its host may not run is refused before its data moves: the completion
/// comes without an R2T. Before, the target asked for the whole transfer first.
#[tokio::test]
async fn a_fused_write_is_refused_before_its_r2t() {
    let env = start().await;
    let (_ac, mut a) = connect_as(&env, OTHER, 0xa).await;
    let (_bc, mut b) = connect_as(&env, HOST, 0xb).await;
    a.resv_register(1, Cdw10 { action: rrega::REGISTER, ..Default::default() }, Keys { current: 0, other: 0xa1 }).await.unwrap();
    let acquire = Cdw10 { action: racqa::ACQUIRE, rtype: Rtype::WriteExclusive as u8, ..Default::default() };
    a.resv_acquire(1, acquire, Keys { current: 0xa1, other: 0 }).await.unwrap();
    // (what, namespace, status)
    let cases = [
        ("a namespace without a journal", 2, Status::INVALID_OPCODE.dnr()),
        ("no such namespace", 7, Status::INVALID_NAMESPACE.dnr()),
        ("another host's reservation", 1, Status::RESERVATION_CONFLICT.dnr()),
    ];
    for (what, nsid, want) in cases {
        let mut s = Sqe::new(opcode::FUSED_WRITE, 0x77);
        s.set_nsid(nsid);
        s.set_sgl(Sgl { addr: 0, len: 64 << 10, id: sgl_id::TRANSPORT });
        let mut capsule = Vec::new();
        pdu::put_capsule_cmd(&mut capsule, &s, &[], false, false);
        let qp = b.queue();
        qp.send_raw(&capsule).await.unwrap();
        let (t, h) = tokio::time::timeout(Duration::from_secs(10), qp.recv_raw()).await.expect("a reply within 10 s").unwrap();
        assert_eq!(t, PduType::CapsuleResp, "{what}: the target asked for the data first");
        assert_eq!(pdu::capsule_cqe(&h).status, want, "{what}");
    }
}

/// OUTCOME is answered while another FUSED WRITE of the namespace is stuck at the storage
/// (its transaction holding the journal): a transaction that committed before is COMMITTED,
/// the one still running UNKNOWN; after it ends, COMMITTED. Before, OUTCOME waited on the
/// network thread for the journal's lock, held across the stuck write: no answer until the
/// gate opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcome_is_answered_while_a_fused_write_is_stuck() {
    let env = start().await;
    let (gated, _) = add_gated(&env);
    let _open = OpenOnDrop(gated.clone());
    let (_c, mut q) = connect(&env, HOST).await;
    gated.open.store(true, Relaxed);
    q.fused_write(GATED, &plain_transfer(1, 0, &[1; 512])).await.unwrap();
    gated.open.store(false, Relaxed);
    let stuck = tokio::spawn(async move {
        let r = q.fused_write(GATED, &plain_transfer(2, 4096, &[2; 512])).await;
        (q, r)
    });
    wait_for("the second fused write at the storage", || gated.arrived.load(Relaxed) == 2).await;
    let (_c2, mut q2) = connect(&env, HOST).await;
    // (transaction, its state while the second one is stuck)
    for (txid, want) in [(1u64, state::COMMITTED), (2, state::UNKNOWN), (3, state::UNKNOWN)] {
        let answer = tokio::time::timeout(Duration::from_secs(10), q2.outcome(GATED, txid)).await;
        let (st, _) = answer.unwrap_or_else(|_| panic!("OUTCOME of {txid} waited for the stuck fused write")).unwrap();
        assert_eq!(st, want, "transaction {txid}");
    }
    assert!(!stuck.is_finished());
    gated.open.store(true, Relaxed);
    let (_q, r) = tokio::time::timeout(Duration::from_secs(20), stuck).await.expect("the stuck write ends").unwrap();
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(q2.outcome(GATED, 2).await.unwrap().0, state::COMMITTED);
}

/// A file whose writes touching bytes `range` fail while `failing` is set.
struct Flaky {
    file: FileBackend,
    failing: AtomicBool,
    range: (u64, u64),
}

impl Backend for Flaky {
    fn describe(&self) -> String {
        "flaky".into()
    }
    fn size(&self) -> u64 {
        self.file.size()
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        self.file.read_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
        if self.failing.load(Relaxed) && off < self.range.1 && self.range.0 < off + buf.len() as u64 {
            return Err(std::io::Error::other("injected"));
        }
        self.file.write_at(buf, off)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.file.flush()
    }
    fn write_zeroes(&self, off: u64, len: u64, deallocate: bool) -> std::io::Result<()> {
        self.file.write_zeroes(off, len, deallocate)
    }
}

/// Namespace FLAKY of `env`: a 1 MiB file with its MicroTx journal, whose second block
/// fails writes on demand.
const FLAKY: u32 = 4;
fn add_flaky(env: &Env) -> (Arc<Flaky>, Arc<Journal>) {
    let file = FileBackend::open(&env._dir.path().join("flaky.img"), Some(1 << 20)).unwrap();
    let flaky = Arc::new(Flaky { file, failing: AtomicBool::new(false), range: (BS, 2 * BS) });
    let log = FileBackend::open(&env._dir.path().join("flaky.img.microtx"), Some(MICROTX_JOURNAL_BYTES)).unwrap();
    let (journal, _) = Journal::open(Arc::new(log), &*flaky, BS).unwrap();
    let journal = Arc::new(journal);
    let ns = Namespace::new(NQN, FLAKY, flaky.clone(), BS as u32).with_journal(journal.clone());
    env._target.subsystem(NQN).unwrap().add_namespace(ns).unwrap();
    (flaky, journal)
}

/// A FUSED WRITE whose in-place write fails after its records are durable: from then
/// until its transaction is finished every I/O of its blocks (Read, Write, Write Zeroes,
/// Deallocate, Compare and Write) is refused with Command Interrupted (DNR clear: retry),
/// other blocks serve, the next FUSED WRITE waits (refused for a retry, its id free); once
/// the storage writes again, a refused I/O has the journal finish the transaction in
/// place, the retried write lands over it, and the next start does not write the
/// transaction again over that acknowledged write. Before, plain writes of those blocks
/// were acknowledged and then overwritten by the replay at the next start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_in_place_write_fences_its_blocks_until_it_is_finished() {
    let env = start().await;
    let (flaky, journal) = add_flaky(&env);
    let (_c, mut q) = connect(&env, HOST).await;
    let bs = BS as u32;
    flaky.failing.store(true, Relaxed);
    // Blocks 0 and 1; block 1's write fails.
    let r = q.fused_write(FLAKY, &plain_transfer(1, 0, &[1; 1024])).await;
    assert_eq!(status(r), Status::WRITE_FAULT.dnr());
    assert_eq!(q.outcome(FLAKY, 1).await.unwrap().0, state::UNKNOWN, "in doubt until finished");
    let retry = Status::COMMAND_INTERRUPTED;
    assert_eq!(status(q.write(FLAKY, 0, &[2; 512], bs, false).await), retry, "Write");
    assert_eq!(status(q.read(FLAKY, 1, 1, bs).await), retry, "Read");
    assert_eq!(status(q.write_zeroes(FLAKY, 0, 1, false).await), retry, "Write Zeroes");
    assert_eq!(status(q.deallocate(FLAKY, &[(1, 1)]).await), retry, "Deallocate");
    let caw = q.compare_and_write(FLAKY, 1, &[0; 512], &[5; 512], bs, false).await.unwrap();
    assert_eq!(caw.compare, retry, "Compare and Write: {caw:?}");
    // Other blocks serve.
    q.write(FLAKY, 8, &[3; 512], bs, false).await.unwrap();
    assert_eq!(q.read(FLAKY, 8, 1, bs).await.unwrap(), vec![3; 512]);
    // The next transaction waits for the unfinished one, which cannot be finished yet.
    assert_eq!(status(q.fused_write(FLAKY, &plain_transfer(2, 8192, &[4; 512])).await), retry);
    assert_eq!(q.outcome(FLAKY, 2).await.unwrap().0, state::UNKNOWN, "its id stays free");
    let fenced = format!("nearstore_microtx_fenced{{subnqn=\"{NQN}\",nsid=\"{FLAKY}\"}} 1");
    assert!(nearstore_target::metrics::render(&env._target).contains(&fenced), "{fenced}");

    // The storage writes again: the write, retried, lands once the transaction is finished.
    flaky.failing.store(false, Relaxed);
    let start = Instant::now();
    while let Err(e) = q.write(FLAKY, 0, &[2; 512], bs, false).await {
        assert_eq!(status(Err::<(), _>(e)), retry);
        assert!(start.elapsed() < Duration::from_secs(20), "the fence did not lift in 20 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!journal.fence().is_up());
    assert_eq!(q.outcome(FLAKY, 1).await.unwrap().0, state::COMMITTED);
    let blocks = q.read(FLAKY, 0, 2, bs).await.unwrap();
    assert_eq!((&blocks[..512], &blocks[512..]), (&[2; 512][..], &[1; 512][..]), "the write over the transaction's first block");
    q.fused_write(FLAKY, &plain_transfer(2, 8192, &[4; 512])).await.unwrap();
    let unfenced = format!("nearstore_microtx_fenced{{subnqn=\"{NQN}\",nsid=\"{FLAKY}\"}} 0");
    assert!(nearstore_target::metrics::render(&env._target).contains(&unfenced), "{unfenced}");

    // The next start finds nothing to finish: the acknowledged write stays.
    let log = FileBackend::open(&env._dir.path().join("flaky.img.microtx"), None).unwrap();
    let (_, rec) = Journal::open(Arc::new(log), &*flaky, BS).unwrap();
    assert!(rec.finished.is_empty(), "{rec:?}");
    let mut b = vec![0; 512];
    flaky.read_at(&mut b, 0).unwrap();
    assert_eq!(b, vec![2; 512]);
}

/// A FUSED WRITE that merges its bytes into a block an unfinished transaction wrote reads
/// that block after the transaction is finished: the next write of a log into the block
/// of a record whose in-place write failed keeps the record. Before, it read the block
/// before finishing the transaction (whose outcome then became committed) and wrote the
/// block's old bytes back over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fused_write_merges_into_the_blocks_of_an_unfinished_transaction_once_finished() {
    let env = start().await;
    let (flaky, journal) = add_flaky(&env);
    let (_c, mut q) = connect(&env, HOST).await;
    flaky.failing.store(true, Relaxed);
    // Blocks 0 and 1; block 1's write fails: in doubt until finished.
    assert_eq!(status(q.fused_write(FLAKY, &plain_transfer(1, 0, &[1; 1024])).await), Status::WRITE_FAULT.dnr());
    assert!(journal.fence().is_up());
    // The storage writes again; nothing touches the fenced blocks, so nothing finishes the
    // transaction but the next FUSED WRITE: bytes 100..200 of block 1, which it merges.
    flaky.failing.store(false, Relaxed);
    let t =
        Fused { op: op::WRITE_CHECKSUM, txid: 2, offset: 100, block_offset: 0, args: [0; 8], extents: vec![(BS, BS)] }.encode(&[9; 100]);
    q.fused_write(FLAKY, &t).await.unwrap();
    assert!(!journal.fence().is_up());
    assert_eq!(q.outcome(FLAKY, 1).await.unwrap().0, state::COMMITTED);
    let block = q.read(FLAKY, 1, 1, BS as u32).await.unwrap();
    let want: Vec<u8> = [vec![1; 100], vec![9; 100], vec![1; 312]].concat();
    assert_eq!(block, want, "transaction 1's bytes around transaction 2's");
}

/// A FUSED WRITE that waited for its turn is checked again when its turn comes: another
/// host acquired a Write Exclusive reservation meanwhile, so it completes with Reservation
/// Conflict and writes nothing. Before, only its arrival was checked, and it wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fused_write_is_checked_again_when_its_turn_comes() {
    let env = start().await;
    let (gated, journal) = add_gated(&env);
    let _open = OpenOnDrop(gated.clone());
    let (_ac, mut a) = connect_as(&env, OTHER, 0xa).await;
    let (_bc, mut b) = connect_as(&env, HOST, 0xb).await;
    // B: one fused write held at the storage, one waiting for its turn behind it.
    let running = tokio::spawn(async move {
        let r = b.fused_write(GATED, &plain_transfer(1, 0, &[1; 512])).await;
        (b, r)
    });
    wait_for("B's first fused write at the storage", || gated.arrived.load(Relaxed) == 1).await;
    let (_bc2, mut b2) = connect_as(&env, HOST, 0xb).await;
    let waiting = tokio::spawn(async move { b2.fused_write(GATED, &plain_transfer(2, 4096, &[2; 512])).await });
    wait_for("B's second fused write admitted", || journal.admitted() == 2).await;
    // A reserves the namespace: only A may write now.
    let reg = (Cdw10 { action: rrega::REGISTER, ..Default::default() }, Keys { current: 0, other: 0xa1 });
    a.resv_register(GATED, reg.0, reg.1).await.unwrap();
    let rtype = Rtype::WriteExclusive as u8;
    a.resv_acquire(GATED, Cdw10 { action: racqa::ACQUIRE, rtype, ..Default::default() }, Keys { current: 0xa1, other: 0 }).await.unwrap();
    gated.open.store(true, Relaxed);
    let (_b, first) = running.await.unwrap();
    assert!(first.is_ok(), "B's first ran before the reservation: {first:?}");
    let second = tokio::time::timeout(Duration::from_secs(20), waiting).await.expect("B's second completes").unwrap();
    assert_eq!(status(second), Status::RESERVATION_CONFLICT.dnr());
    assert_eq!(gated.arrived.load(Relaxed), 1, "B's second reached the storage");
    assert_eq!(a.read(GATED, 8, 1, BS as u32).await.unwrap(), vec![0; 512]);
    assert_eq!(a.outcome(GATED, 2).await.unwrap().0, state::UNKNOWN, "its id stays free");
}

/// Group commit: FUSED WRITEs that arrive while a group runs are committed together in the
/// next one (two groups for 41 writes here, three flushes each), and a member reads the
/// blocks it merges into through the images of the members before it: forty 100-byte
/// write-checksums laid end to end, most sharing a 512-byte block with the one before, all
/// land (each read back beside its neighbours) with their own checksums. Reading those
/// blocks from the namespace instead, a later member wrote back the earlier one's block
/// as it was before it (zeros).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fused_writes_waiting_together_commit_as_one_group() {
    let env = start().await;
    let (gated, journal) = add_gated(&env);
    let _open = OpenOnDrop(gated.clone());
    let (_c, mut q) = connect(&env, HOST).await;
    let (_c0, mut first) = connect(&env, HOST).await;
    let held = tokio::spawn(async move { first.fused_write(GATED, &plain_transfer(1, 0, &[1; 512])).await });
    wait_for("the first fused write at the storage", || gated.arrived.load(Relaxed) == 1).await;
    let (n, len, base) = (40u64, 100u64, 4096u64);
    let record = |i: u64| (0..len).map(|b| (i * 7 + b) as u8 | 1).collect::<Vec<u8>>();
    let qp = q.queue();
    for i in 0..n {
        let at = base + i * len;
        let (from, to) = (at / BS * BS, (at + len).div_ceil(BS) * BS);
        let f =
            Fused { op: op::WRITE_CHECKSUM, txid: 100 + i, offset: at, block_offset: 0, args: [0; 8], extents: vec![(from, to - from)] };
        let mut s = Sqe::new(opcode::FUSED_WRITE, 0);
        s.set_nsid(GATED);
        qp.submit(s, Data::Out(&f.encode(&record(i))), i).unwrap();
    }
    qp.flush().await.unwrap();
    wait_for("the forty waiting for the next group", || journal.waiting() == n as usize).await;
    gated.open.store(true, Relaxed);
    let mut results = Vec::new();
    while results.len() < n as usize {
        let poll = q.queue().poll(|tag, c, _| results.push((tag, c.status, c.dw0)));
        tokio::time::timeout(Duration::from_secs(60), poll).await.expect("completions within 60 s").unwrap();
    }
    assert!(held.await.unwrap().is_ok());
    for (tag, status, crc) in &results {
        assert!(status.is_success(), "write {tag}: {status:?}");
        assert_eq!(*crc, crc32c::crc32c(&record(*tag)), "write {tag}'s checksum");
    }
    assert_eq!(journal.committed(), (2, n + 1), "groups, transactions");
    let blocks = q.read(GATED, base / BS, ((n * len).div_ceil(BS)) as u32, BS as u32).await.unwrap();
    for i in 0..n {
        let at = (i * len) as usize;
        assert_eq!(&blocks[at..at + len as usize], &record(i)[..], "write {i} read back");
    }
    for txid in 100..100 + n {
        assert_eq!(q.outcome(GATED, txid).await.unwrap().0, state::COMMITTED, "transaction {txid}");
    }
}
