//! Durability across a crash of the target process: `kill -9` after completed writes and
//! a completed Flush loses nothing, with either I/O engine.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nearstore_initiator::{ConnectOptions, Controller};

const NQN: &str = "nqn.2026-11.io.nearstore:crash";

struct Target(Child);

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

/// Starts a target on a free port. Tests run in parallel: another target may take the
/// port between our probe and its bind, and then ours exits; so a port counts only when our
/// own process says it listens there (its stdout), else it starts again on another.
async fn start(disk: &Path, engine: &str) -> (Target, SocketAddr) {
    use std::io::BufRead;
    for _ in 0..5 {
        let addr = free_port();
        let mut child = Command::new(env!("CARGO_BIN_EXE_nearstore"))
            .args(["target", "--listen", &addr.to_string(), "--discovery", "none", "--nqn", NQN, "--size", "64MiB"])
            .args(["--block-size", "4096", "--io-engine", engine, "--namespace"])
            .arg(disk)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting the target binary");
        let out = child.stdout.take().expect("piped stdout");
        let t = Target(child);
        let (tx, rx) = std::sync::mpsc::channel();
        let want = format!("listening on {addr}");
        std::thread::spawn(move || {
            let mut lines = std::io::BufReader::new(out).lines();
            // true when it listens; false when it exits first (its stdout closes).
            let listening = lines.by_ref().map_while(Result::ok).any(|l| l.contains(&want));
            let _ = tx.send(listening);
            // Keep draining so the target never blocks on a full pipe.
            lines.for_each(drop);
        });
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(true) => return (t, addr),
            Ok(false) => continue,
            Err(_) => panic!("target did not listen on {addr} within 20 s"),
        }
    }
    panic!("the target could not listen on any of 5 free ports");
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
