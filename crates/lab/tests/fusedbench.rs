//! The fused write benchmarks run as scripts/bench-fused.sh runs them, briefly: every
//! operation, fused and conventional (plain and FUA), against an in-process target's
//! journaled namespace, does the operations it was asked for (the conventional append checks
//! each record it reads back); and the journal's recovery benchmark replays the records the
//! transactions left.

mod common;

use std::sync::Arc;

use common::ok;
use nearstore_target::config::Config;
use nearstore_target::Target;

const NQN: &str = "nqn.2026-11.io.nearstore:fusedbench";

/// A target with a journaled 64 MiB file namespace of 4 KiB blocks in `dir`, on its own
/// runtime (the benchmark is another process); its address.
fn target(dir: &std::path::Path) -> (tokio::runtime::Runtime, Arc<Target>, std::net::SocketAddr) {
    let cfg = format!(
        "[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\npath = \"{}\"\nsize = \"64MiB\"\nblock_size = 4096\nmicrotx = true\n",
        dir.join("ns.img").display()
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let t = Target::from_config(&Config::from_toml(&cfg).unwrap()).unwrap();
    let addr = rt.block_on(t.listen("127.0.0.1:0".parse().unwrap(), false)).unwrap();
    (rt, t, addr)
}

#[test]
fn each_operation_runs_fused_and_conventionally() {
    let dir = tempfile::tempdir().unwrap();
    let (_rt, _t, addr) = target(dir.path());
    let addr = addr.to_string();
    for op in ["append", "modify", "compress"] {
        for how in [&["--how", "fused"][..], &["--how", "conventional"], &["--how", "conventional", "--fua"]] {
            // 5000 bytes: records and frames across blocks, the conventional appender's
            // kept partial block used.
            let size = if op == "modify" { "4096" } else { "5000" };
            let mut args = vec!["fused-bench", "-a", &addr, "-n", NQN, "--op", op, "-z", size, "-q", "2", "--ops", "25", "-o", "json"];
            args.extend_from_slice(how);
            let out = ok(&args);
            let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"));
            assert_eq!(v["ops"], 50, "{args:?}: {out}");
            assert!(v["mb_per_s"].as_f64().is_some_and(|m| m > 0.0), "{args:?}: {out}");
        }
    }
    // A record over one transfer: appended in pieces (fused) or a transfer at a time
    // (conventional), each checked by the bench (the count the target wrote, the bytes read
    // back).
    for how in ["fused", "conventional"] {
        let args =
            ["fused-bench", "-a", &addr, "-n", NQN, "--op", "append", "--how", how, "-z", "1MiB", "-q", "2", "--ops", "3", "-o", "json"];
        let out = ok(&args);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"));
        assert_eq!(v["ops"], 6, "{args:?}: {out}");
    }
    // Sizes the descriptor cannot carry, or integers cut short, are refused before a command.
    common::refused(&["fused-bench", "-a", &addr, "-n", NQN, "--op", "modify", "--how", "fused", "-z", "12"], 1, "8-byte integers");
    common::refused(&["fused-bench", "-a", &addr, "-n", NQN, "--op", "compress", "--how", "fused", "-z", "1MiB"], 1, "take one transfer");
}

#[test]
fn the_journal_bench_replays_what_its_transactions_left() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let out = ok(&["journal-bench", "--dir", d, "--transactions", "0,3,30", "--repeat", "1", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v.as_array().unwrap();
    let records: Vec<u64> = rows.iter().map(|r| r["records"].as_u64().unwrap()).collect();
    assert_eq!(rows.iter().map(|r| r["transactions"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 3, 30]);
    // Each transaction leaves the same records; the journal holds them all when opened.
    let per = (records[1] - records[0]) / 3;
    assert!(per > 0 && records[2] - records[0] == 30 * per, "{records:?}");
    // Its directory is left as it was.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// The LevelDB-like benchmark as scripts/bench-leveldb.sh runs it, briefly, on ext4 on a
/// loop device whose image an in-process target exports with a MicroTx journal: fused
/// (LogWriter) and conventional writers, values within a block and across 32 KiB log
/// blocks, each log read back as a LevelDB log of exactly its batches (the benchmark fails
/// otherwise), and the logs removed after. Needs root, loop devices and mkfs.ext4.
#[test]
fn the_leveldb_bench_writes_logs_leveldb_reads() {
    let fs = nearstore_testkit::Fs::new(64);
    let cfg = format!(
        "[limits]\ncontrollers_per_host = 64\n[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\npath = \"{}\"\nblock_size = 4096\nmicrotx = true\n",
        fs.image.display()
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let t = Target::from_config(&Config::from_toml(&cfg).unwrap()).unwrap();
    let addr = rt.block_on(t.listen("127.0.0.1:0".parse().unwrap(), false)).unwrap().to_string();
    let (image, mnt) = (fs.image.to_str().unwrap(), fs.mnt.to_str().unwrap());
    for how in ["fused", "conventional"] {
        for value in ["100", "40000"] {
            let args = [
                "leveldb-bench",
                "-a",
                &addr,
                "-n",
                NQN,
                "--image",
                image,
                "--dir",
                mnt,
                "--how",
                how,
                "-z",
                value,
                "-w",
                "3",
                "--ops",
                "20",
                "-o",
                "json",
            ];
            let out = ok(&args);
            let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"));
            assert_eq!(v["ops"], 60, "{args:?}: {out}");
            assert!(v["puts_per_s"].as_f64().is_some_and(|p| p > 0.0), "{args:?}: {out}");
        }
    }
    assert!(fs.leftovers(&[]).is_empty(), "{:?}", fs.leftovers(&[]));
    drop(t);
}
