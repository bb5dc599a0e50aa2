//! The host's PIFO (`nearstore_initiator::pifo`, docs/fair-io.md "The host's PIFO") over
//! real connections to a real target: a small read overtakes another stream's queued
//! backlog (and does not in FIFO order, so the test can fail); data round-trips; a lane whose
//! target dies or hangs fails its own requests and no other lane's.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::proxy::{proxy, Faults};
use nearstore_initiator::pifo::{Pifo, PifoOptions, Policy};
use nearstore_initiator::{ConnectOptions, Controller, IoQueue};
use nearstore_target::config::Config;
use nearstore_target::Target;

const NQN: &str = "nqn.2026-11.io.nearstore:pifo";
/// The namespace's bandwidth: a 64 KiB read takes 4 ms.
const RATE: u64 = 16 << 20;
const BIG: u32 = 16; // blocks of 4 KiB

async fn start() -> (Arc<Target>, SocketAddr) {
    common::init_logs();
    let cfg = format!(
        r#"
        [[listener]]
        address = "127.0.0.1:0"
        [[subsystem]]
        nqn = "{NQN}"
        allow_any_host = true
        [[subsystem.namespace]]
        nsid = 1
        memory = "16MiB"
        block_size = 4096
        rate_limit = {RATE}
        "#
    );
    let target = Target::from_config(&Config::from_toml(&cfg).unwrap()).unwrap();
    let addr = target.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    (target, addr)
}

async fn lane(addr: SocketAddr, timeout: Duration) -> (Controller, IoQueue) {
    let mut o = ConnectOptions::new(addr, NQN);
    o.queue_depth = 32;
    o.timeout = timeout;
    let c = Controller::connect(o).await.unwrap();
    let q = c.io_queue(1).await.unwrap();
    (c, q)
}

/// Where among the completions the victim's read came, behind 24 queued 64 KiB reads of
/// another stream with two commands in flight.
async fn victim_place(policy: Policy) -> usize {
    let (_t, addr) = start().await;
    let (_c, q) = lane(addr, Duration::from_secs(10)).await;
    let pifo = Pifo::new(vec![q], PifoOptions { policy, in_flight: 2 });
    let (bg, victim) = (pifo.stream(100).await.unwrap(), pifo.stream(100).await.unwrap());
    let done = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..24u64 {
        let (bg, done) = (bg.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            bg.read(0, 1, i * BIG as u64, BIG, 4096).await.unwrap();
            done.lock().unwrap().push(i);
        }));
    }
    // Every background read is in flight or waiting before the victim asks.
    for _ in 0..1000 {
        if pifo.counters().waiting.load(std::sync::atomic::Ordering::Relaxed) >= 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(pifo.counters().waiting.load(std::sync::atomic::Ordering::Relaxed) >= 20, "the backlog never queued");
    let data = victim.read(0, 1, 4000, 1, 4096).await.unwrap();
    assert_eq!(data.len(), 4096);
    done.lock().unwrap().push(999);
    for t in tasks {
        t.await.unwrap();
    }
    let order = done.lock().unwrap().clone();
    order.iter().position(|&i| i == 999).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_read_overtakes_another_streams_backlog() {
    let pifo = victim_place(Policy::Pifo).await;
    // Two in flight when it came, at most a third started before its turn.
    assert!(pifo <= 3, "PIFO: the victim finished {pifo}th of 25");
    let fifo = victim_place(Policy::Fifo).await;
    assert!(fifo >= 20, "FIFO: the victim finished {fifo}th of 25 (the backlog should go first)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_round_trips_and_statuses_come_back() {
    let (_t, addr) = start().await;
    let (_c, q) = lane(addr, Duration::from_secs(10)).await;
    let pifo = Pifo::new(vec![q], PifoOptions::default());
    let s = pifo.stream(100).await.unwrap();
    // Edge sizes: one block, one more than the in-capsule limit, the largest transfer.
    for (i, blocks) in [1u32, 3, 32].into_iter().enumerate() {
        let data: Vec<u8> = (0..blocks as usize * 4096).map(|b| (b * 7 + i) as u8).collect();
        let slba = 100 * i as u64;
        s.write(0, 1, slba, data.clone(), 4096, false).await.unwrap();
        assert_eq!(s.read(0, 1, slba, blocks, 4096).await.unwrap(), data, "{blocks} blocks");
    }
    // Past the namespace's end: the target's status, as an error naming it.
    let e = s.read(0, 1, (16 << 20) / 4096, 1, 4096).await.unwrap_err();
    assert!(e.to_string().contains("Read failed: LBA_OUT_OF_RANGE"), "{e}");
    assert!(s.write(0, 1, 0, vec![0; 100], 4096, false).await.is_err(), "not whole blocks");
    assert!(s.read(1, 1, 0, 1, 4096).await.unwrap_err().to_string().contains("lane 1 of 1"));
    assert!(pifo.stream(0).await.is_err() && pifo.stream(10_001).await.is_err(), "weights 0 and absurd");
    drop(s);
    tokio::time::timeout(Duration::from_secs(5), pifo.join()).await.expect("the scheduler ends with its streams");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_whose_target_dies_or_hangs_fails_alone() {
    let (_t, addr) = start().await;
    for hang in [false, true] {
        let faults = Arc::new(Faults::default());
        let proxied = proxy(addr, faults.clone(), 0).await;
        let (_c1, bad) = lane(proxied, Duration::from_secs(2)).await;
        let (_c2, good) = lane(addr, Duration::from_secs(10)).await;
        let pifo = Pifo::new(vec![bad, good], PifoOptions { policy: Policy::Pifo, in_flight: 2 });
        let s = pifo.stream(100).await.unwrap();
        if hang {
            faults.stall.store(true, std::sync::atomic::Ordering::Relaxed);
        } else {
            faults.cut.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        // Two in flight and four waiting on the bad lane: all six fail.
        let mut doomed = Vec::new();
        for i in 0..6u64 {
            let s = s.clone();
            doomed.push(tokio::spawn(async move { s.read(0, 1, i * BIG as u64, BIG, 4096).await }));
        }
        for d in doomed {
            let e = tokio::time::timeout(Duration::from_secs(10), d).await.expect("answered").unwrap().unwrap_err();
            let want = if hang { "a command not completed within" } else { "lane failed" };
            assert!(e.to_string().contains(want), "hang {hang}: {e}");
        }
        // Later requests to it fail at once; the other lane serves as before.
        assert!(s.read(0, 1, 0, 1, 4096).await.unwrap_err().to_string().contains("lane failed"));
        assert_eq!(s.read(1, 1, 0, 1, 4096).await.unwrap().len(), 4096);
    }
}
