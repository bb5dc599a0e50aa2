//! Durability across a crash of the target process: `kill -9` after completed writes and
//! a completed Flush loses nothing, with either I/O engine.

mod common;

use std::net::SocketAddr;
use std::path::Path;

use common::{target_on_free_port, Proc};
use nearstore_initiator::{ConnectOptions, Controller};

const NQN: &str = "nqn.2026-11.io.nearstore:crash";

/// Starts a target on a free port (common::target_on_free_port: a port counts only when
/// our own process says it listens there).
async fn start(disk: &Path, engine: &str) -> (Proc, SocketAddr) {
    let disk = disk.to_str().expect("path").to_string();
    target_on_free_port(|addr| {
        let args = ["--listen", &addr.to_string(), "--discovery", "none", "--nqn", NQN, "--size", "64MiB", "--block-size", "4096"];
        args.iter().map(|a| a.to_string()).chain(["--io-engine".into(), engine.into(), "--namespace".into(), disk.clone()]).collect()
    })
}

fn block(seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

async fn crash_and_check(engine: &str) {
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk.img");
    let (mut t, addr) = start(&disk, engine).await;
    let c = Controller::connect(ConnectOptions::new(addr, NQN)).await.unwrap();
    let mut q = c.io_queue(1).await.unwrap();
    // 300 blocks at scattered LBAs; every third with FUA; a Flush after the first 200.
    let lbas: Vec<u64> = (0..300u64).map(|i| (i * 7919) % 16384).collect();
    for (i, &lba) in lbas.iter().enumerate() {
        q.write(1, lba, &block(lba), 4096, i % 3 == 0).await.unwrap();
        if i == 199 {
            q.flush(1).await.unwrap();
        }
    }
    // kill -9: no shutdown, no flush on exit.
    t.0.kill().unwrap();
    t.0.wait().unwrap();
    drop(q);
    drop(c);
    let (_t, addr) = start(&disk, engine).await;
    let c = Controller::connect(ConnectOptions::new(addr, NQN)).await.unwrap();
    let mut q = c.io_queue(1).await.unwrap();
    for &lba in &lbas {
        let got = q.read(1, lba, 1, 4096).await.unwrap();
        assert!(got == block(lba), "{engine}: LBA {lba} lost or torn after kill -9");
    }
    // A block never written reads as zeros.
    assert_eq!(q.read(1, 1, 1, 4096).await.unwrap(), vec![0u8; 4096]);
}

#[tokio::test]
async fn kill_9_after_flush_loses_nothing_io_uring() {
    crash_and_check("uring").await;
}

#[tokio::test]
async fn kill_9_after_flush_loses_nothing_thread_pool() {
    crash_and_check("threads").await;
}
