//! The fused write operations with real target processes: the CLI verbs on a file of ext4
//! on a loop device whose image a target exports with a MicroTx journal (needs root, loop
//! devices and mkfs.ext4, and says which is missing); and targets SIGKILLed at random
//! points during append-crc-writes, restarted: every acknowledged append is whole, none is
//! torn, and OUTCOME answers for the one in flight.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::{fails, ok, target_on_free_port, Fs, Proc};
use nearstore_initiator::{ConnectOptions, Controller, IoQueue};
use nearstore_testkit::leveldb_log_records;
use nearstore_wire::fused::{self, op, state, Fused};

const NQN: &str = "nqn.2026-11.io.nearstore:fusedcli";

/// Starts `nearstore target --config` with a journaled namespace on `disk` on a free port,
/// the configuration written to `config`. A port counts only when the target says it
/// listens there (another test may take it between the probe and the bind).
fn start(disk: &Path, size: &str, config: &Path) -> (Proc, SocketAddr) {
    start_for(disk, size, config, "allow_any_host = true\n")
}

/// [`start`] with the subsystem's `hosts` lines (who may connect).
fn start_for(disk: &Path, size: &str, config: &Path, hosts: &str) -> (Proc, SocketAddr) {
    let size = if size.is_empty() { String::new() } else { format!("size = \"{size}\"\n") };
    target_on_free_port(|addr| {
        std::fs::write(
            config,
            format!(
                "[[listener]]\naddress = \"{addr}\"\n[[subsystem]]\nnqn = \"{NQN}\"\n{hosts}[[subsystem.namespace]]\nnsid = 1\npath = \"{}\"\n{size}block_size = 4096\nmicrotx = true\n",
                disk.display()
            ),
        )
        .unwrap();
        vec!["--discovery".into(), "none".into(), "--config".into(), p(config).into()]
    })
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// append-crc-write, write-checksum and read-checksum as a user runs them: the log reads
/// back with LevelDB's format, the printed checksums are those of the bytes in the file.
#[test]
fn the_verbs_append_records_and_print_their_checksums() {
    let fs = Fs::new(64);
    let config = fs.dir.path().join("target.toml");
    let (_t, _) = start(&fs.image, "", &config);
    let (cfg, log) = (p(&config).to_string(), fs.mnt.join("000005.log"));
    std::fs::File::create(&log).unwrap();
    let input = fs.dir.path().join("input");
    std::fs::write(&input, b"first record").unwrap();
    let out = ok(&["append-crc-write", "--target-config", &cfg, p(&log), "--input", p(&input)]);
    let bytes = std::fs::read(&log).unwrap();
    assert_eq!(out.trim(), format!("crc32c {:08x}  bytes {}  length {}", crc32c::crc32c(&bytes), bytes.len(), bytes.len()));
    // --lines, as JSON: a record per line.
    std::fs::write(&input, b"two\nthree\n").unwrap();
    let out = ok(&["append-crc-write", "--target-config", &cfg, p(&log), "--input", p(&input), "--lines", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let bytes = std::fs::read(&log).unwrap();
    assert_eq!(v.as_array().map(Vec::len), Some(2), "{out}");
    assert_eq!(v[1]["length"], bytes.len() as u64, "{out}");
    let start = bytes.len() - v[1]["bytes"].as_u64().unwrap() as usize;
    assert_eq!(v[1]["crc32c"], format!("{:08x}", crc32c::crc32c(&bytes[start..])), "{out}");
    assert_eq!(leveldb_log_records(&bytes), Ok(vec![b"first record".to_vec(), b"two".to_vec(), b"three".to_vec()]));
    // A record over one transfer (300 KiB: three pieces), as one record.
    let big: Vec<u8> = (0..300 << 10).map(|i: u32| (i % 251) as u8).collect();
    std::fs::write(&input, &big).unwrap();
    let out = ok(&["append-crc-write", "--target-config", &cfg, p(&log), "--input", p(&input), "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v.as_array().map(Vec::len), Some(1), "one record: {out}");
    let v = v[0].clone();
    let all = std::fs::read(&log).unwrap();
    let n = v["bytes"].as_u64().unwrap() as usize;
    assert_eq!(v["length"], all.len() as u64, "{out}");
    assert_eq!(v["crc32c"], format!("{:08x}", crc32c::crc32c(&all[all.len() - n..])), "{out}");
    assert_eq!(leveldb_log_records(&all).unwrap().last(), Some(&big));
    std::fs::write(&log, &bytes).unwrap();

    let data = fs.mnt.join("data");
    std::fs::write(&data, vec![7u8; 20_000]).unwrap();
    std::fs::write(&input, b"0123456789").unwrap();
    let out = ok(&["write-checksum", "--target-config", &cfg, p(&data), "--offset", "4090", "--input", p(&input)]);
    assert_eq!(out.trim(), format!("crc32c {:08x}  offset 4090  bytes 10", crc32c::crc32c(b"0123456789")));
    let back = fs.dir.path().join("back");
    let out = ok(&["read-checksum", "--target-config", &cfg, p(&data), "--offset", "4000", "--length", "200", "--output", p(&back)]);
    let want = std::fs::read(&data).unwrap()[4000..4200].to_vec();
    assert_eq!(&want[90..100], b"0123456789");
    assert_eq!(std::fs::read(&back).unwrap(), want);
    assert_eq!(out.trim(), format!("crc32c {:08x}  offset 4000  bytes 200", crc32c::crc32c(&want)));

    // read-modify-write: an 8-byte counter across a block's end, added to twice.
    std::fs::write(&input, 5u64.to_le_bytes()).unwrap();
    let before = u64::from_le_bytes(std::fs::read(&data).unwrap()[4092..4100].try_into().unwrap());
    for round in 1..=2u64 {
        let out =
            ok(&["read-modify-write", "--target-config", &cfg, p(&data), "--offset", "4092", "--modify", "add", "--input", p(&input)]);
        let file = std::fs::read(&data).unwrap();
        let counter = u64::from_le_bytes(file[4092..4100].try_into().unwrap());
        assert_eq!(counter, before.wrapping_add(5 * round), "round {round}");
        assert_eq!(out.trim(), format!("crc32c {:08x}  offset 4092  bytes 8  input 8  end 4100", crc32c::crc32c(&file[4092..4100])));
    }
    std::fs::write(&input, b"abc").unwrap();
    fails(&["read-modify-write", "--target-config", &cfg, p(&data), "--modify", "add", "--width", "2", "--input", p(&input)]);
    // An expression: two 4-byte counters across the block's end, each min(x + d, 15): added
    // to and saturated, on the target.
    let mut d = Vec::new();
    d.extend_from_slice(&9u32.to_le_bytes());
    d.extend_from_slice(&1u32.to_le_bytes());
    std::fs::write(&input, &d).unwrap();
    let before = std::fs::read(&data).unwrap();
    let (c0, c1) = (u32::from_le_bytes(before[4092..4096].try_into().unwrap()), u32::from_le_bytes(before[4096..4100].try_into().unwrap()));
    let rmw = ["read-modify-write", "--target-config", &cfg, p(&data), "--offset", "4092", "--modify", "expr", "--width", "4"];
    ok(&[&rmw[..], &["--expr", "x d + 15 min", "--input", p(&input)]].concat());
    let file = std::fs::read(&data).unwrap();
    let want = (c0.wrapping_add(9).min(15), c1.wrapping_add(1).min(15));
    assert_eq!((u32::from_le_bytes(file[4092..4096].try_into().unwrap()), u32::from_le_bytes(file[4096..4100].try_into().unwrap())), want);
    assert_eq!((&file[..4092], &file[4100..]), (&before[..4092], &before[4100..]), "only the two counters changed");
    // A malformed expression is refused before anything is sent, naming what is wrong.
    let (_, e) = fails(&[&rmw[..], &["--expr", "x +", "--input", p(&input)]].concat());
    assert!(e.contains("--expr") && e.contains("takes two values"), "{e}");
    let (_, e) = fails(&[&rmw[..], &["--expr", "x 16 +", "--input", p(&input)]].concat());
    assert!(e.contains("'16' is not x, d, a constant 0 to 15"), "{e}");
    // compress-write: two frames appended to a new file, which zstd reads back whole.
    let frames = fs.mnt.join("frames.zst");
    std::fs::File::create(&frames).unwrap();
    let text: Vec<u8> = (0..5000).flat_map(|i: u32| format!("row {i},{}\n", i * 7).into_bytes()).collect();
    std::fs::write(&input, &text).unwrap();
    let mut end = 0u64;
    for level in ["3", "-2"] {
        let out = ok(&["compress-write", "--target-config", &cfg, p(&frames), "--level", level, "--input", p(&input), "-o", "json"]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let file = std::fs::read(&frames).unwrap();
        assert_eq!(
            (v["offset"].as_u64(), v["end"].as_u64(), v["input"].as_u64()),
            (Some(end), Some(file.len() as u64), Some(text.len() as u64)),
            "{out}"
        );
        assert_eq!(v["crc32c"], format!("{:08x}", crc32c::crc32c(&file[end as usize..])), "{out}");
        end = file.len() as u64;
    }
    assert_eq!(zstd::decode_all(&std::fs::read(&frames).unwrap()[..]).unwrap(), [&text[..], &text[..]].concat());
}

/// The verbs connect as `--hostnqn`: a target that admits only that host lets them write
/// and read, and refuses them without it (as the machine's own host NQN).
#[test]
fn the_verbs_connect_as_hostnqn() {
    const HOST: &str = "nqn.2026-11.io.nearstore:fused-writer";
    let fs = Fs::new(64);
    let config = fs.dir.path().join("target.toml");
    let (_t, _) = start_for(&fs.image, "", &config, &format!("[[subsystem.host]]\nnqn = \"{HOST}\"\n"));
    let (cfg, log) = (p(&config).to_string(), fs.mnt.join("000007.log"));
    std::fs::File::create(&log).unwrap();
    let input = fs.dir.path().join("input");
    std::fs::write(&input, b"a record").unwrap();
    let data = fs.mnt.join("data");
    std::fs::write(&data, vec![7u8; 8192]).unwrap();
    let verbs: [&[&str]; 3] = [
        &["append-crc-write", &cfg, p(&log), "--input", p(&input)],
        &["write-checksum", &cfg, p(&data), "--offset", "100", "--input", p(&input)],
        &["read-checksum", &cfg, p(&data), "--offset", "0", "--length", "4096", "--output", "/dev/null"],
    ];
    for verb in verbs {
        let mut args = vec![verb[0], "--target-config"];
        args.extend_from_slice(&verb[1..]);
        let (_, err) = fails(&args);
        assert!(err.contains("refused") || err.contains("not allowed") || err.contains("Connect"), "{}: {err}", verb[0]);
        args.extend_from_slice(&["--hostnqn", HOST]);
        let out = ok(&args);
        assert!(out.contains("crc32c"), "{}: {out}", verb[0]);
    }
    assert_eq!(leveldb_log_records(&std::fs::read(&log).unwrap()), Ok(vec![b"a record".to_vec()]));
}

/// A record of `i`: sizes of db_bench's values, across blocks too.
fn record(i: u64) -> Vec<u8> {
    let len = [100usize, 4096, 0, 9000, 40_000, 7][(i % 6) as usize];
    (0..len).map(|k| (k as u64 * 31 + i * 7) as u8).collect()
}

/// Appends `data` at `len` of a log laid out from namespace byte 0 (one extent).
async fn append(q: &mut IoQueue, txid: u64, len: u64, data: &[u8]) -> Result<(u32, u32), nearstore_initiator::Error> {
    let block_offset = (len % fused::LOG_BLOCK_BYTES as u64) as u32;
    let need = fused::framed_len(block_offset, data.len()) as u64;
    let (from, to) = (len / 4096 * 4096, (len + need).div_ceil(4096) * 4096);
    q.fused_write(
        1,
        &Fused { op: op::APPEND_CRC_WRITE, txid, offset: len, block_offset, args: [0; 8], extents: vec![(from, to - from)] }.encode(data),
    )
    .await
}

async fn read_log(q: &mut IoQueue, len: u64) -> Vec<u8> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < len.div_ceil(4096) * 4096 {
        out.extend(q.read(1, at / 4096, 16, 4096).await.unwrap());
        at += 16 * 4096;
    }
    out.truncate(len as usize);
    out
}

/// 50 rounds: a target appends records (one fused write each, QD 1) until it is SIGKILLed
/// after a random delay; restarted, it replays its journal. Every acknowledged record is
/// in the log, whole; the one in flight is committed (then whole, at the end) or rolled
/// back or unknown (then nothing of it: zeros after the log), as OUTCOME says; the log
/// reads back as LevelDB's, record by record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_targets_leave_every_acknowledged_append_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (disk, config) = (dir.path().join("disk.img"), dir.path().join("target.toml"));
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut len, mut records, mut txid) = (0u64, Vec::<Vec<u8>>::new(), 1u64);
    let (mut committed_in_flight, mut lost_in_flight) = (0, 0);
    for round in 0..50 {
        let (mut t, addr) = start(&disk, "64MiB", &config);
        let c = Controller::connect(ConnectOptions::new(addr, NQN)).await.unwrap();
        let mut q = c.io_queue(1).await.unwrap();
        // Where the last round left off: the log is what was acknowledged, and the record
        // in flight if OUTCOME says it committed.
        let log = read_log(&mut q, len + 200_000).await;
        assert_eq!(leveldb_log_records(&log[..len as usize]), Ok(records.clone()), "round {round}");
        let (st, result) = q.outcome(1, txid).await.unwrap();
        let in_flight = record(txid);
        if st == state::COMMITTED {
            let (_, count, end) = fused::parse_result(&result);
            assert_eq!(end, len + count as u64, "round {round}");
            len = end;
            records.push(in_flight);
            committed_in_flight += 1;
        } else {
            assert!(st == state::ROLLED_BACK || st == state::UNKNOWN, "round {round}: state {st}");
            lost_in_flight += 1;
        }
        // Nothing after the log: no torn record of the one in flight.
        let log = read_log(&mut q, len + 200_000).await;
        assert_eq!(leveldb_log_records(&log), Ok(records.clone()), "round {round}");
        assert!(log[len as usize..].iter().all(|&b| b == 0), "round {round}: bytes after the log");
        txid += 1;

        // Append until killed, after 5 to 60 ms.
        let kill_after = Duration::from_millis(5 + next() % 55);
        let pid = t.0.id() as i32;
        let killer = tokio::spawn(async move {
            tokio::time::sleep(kill_after).await;
            // SAFETY: a signal to the child this test started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        });
        loop {
            let r = record(txid);
            match append(&mut q, txid, len, &r).await {
                Ok((_, count)) => {
                    len += count as u64;
                    records.push(r);
                    txid += 1;
                }
                Err(_) => break,
            }
        }
        killer.await.unwrap();
        let _ = t.0.wait();
        drop(q);
        drop(c);
    }
    assert!(records.len() > 50, "{} records in 50 rounds", records.len());
    eprintln!("{} records; in flight at the kill: {committed_in_flight} committed, {lost_in_flight} not", records.len());
}

/// An append the target refuses after it was sent (the file system the map names is larger
/// than the namespace, and the log's end lies past it) fails printing its transaction id,
/// for OUTCOME. Before, the message had no id.
#[test]
fn a_failed_append_prints_its_transaction_id() {
    let fs = Fs::new(64);
    let small = fs.dir.path().join("small.img");
    std::fs::write(&small, vec![0u8; 1 << 20]).unwrap();
    let config = fs.dir.path().join("target.toml");
    let (_t, addr) = start(&small, "", &config);
    let map = fs.dir.path().join("map.toml");
    std::fs::write(&map, format!("[[namespace]]\naddress = \"{addr}\"\nnqn = \"{NQN}\"\nnsid = 1\nfile = \"{}\"\n", p(&fs.image))).unwrap();
    // 7 MiB of log (each block one record header and its bytes): the append goes after it.
    let log = fs.mnt.join("000009.log");
    std::fs::write(&log, vec![0xffu8; 7 << 20]).unwrap();
    let input = fs.dir.path().join("input");
    std::fs::write(&input, b"a record").unwrap();
    let (_, err) = fails(&["append-crc-write", "--map", p(&map), p(&log), "--input", p(&input)]);
    let txid = err
        .split("transaction ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no transaction id in: {err}"));
    assert_ne!(txid, 0, "{err}");
    assert!(err.contains("did not complete"), "{err}");
}

/// read-checksum of a range larger than the process may hold (its data segment limited with
/// prlimit to 64 MiB, the range 160 MiB): the bytes stream to --output piece by piece, whole,
/// with the checksum of all of them. Holding the range whole, the verb failed here.
#[test]
fn read_checksum_streams_a_range_larger_than_its_memory() {
    let fs = Fs::new(256);
    let config = fs.dir.path().join("target.toml");
    let (_t, _) = start(&fs.image, "", &config);
    let data = fs.mnt.join("big");
    let bytes = nearstore_testkit::text(160 << 20, 7);
    std::fs::write(&data, &bytes).unwrap();
    let back = fs.dir.path().join("back");
    let (offset, len) = (4095u64, (160u64 << 20) - 4095 - 1);
    let o = std::process::Command::new("prlimit")
        .arg(format!("--data={}", 64u64 << 20))
        .arg(env!("CARGO_BIN_EXE_nearstore"))
        .args(["read-checksum", "--target-config", p(&config), p(&data), "--offset", &offset.to_string()])
        .args(["--length", &len.to_string(), "--output", p(&back)])
        .output()
        .unwrap_or_else(|e| panic!("cannot run prlimit (util-linux, needed by this test): {e}"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want = &bytes[offset as usize..(offset + len) as usize];
    assert!(std::fs::read(&back).unwrap() == want, "the bytes read back are the file's");
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), format!("crc32c {:08x}  offset {offset}  bytes {len}", crc32c::crc32c(want)));
}
