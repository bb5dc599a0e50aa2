//! A real etcd cluster for the control plane's tests: members on loopback ports the kernel
//! chose, their data in a temporary directory, every member killed by its PID when the
//! cluster is dropped, passed or failed. etcd is Debian's `etcd-server`, installed here when
//! missing and the test runs as root; otherwise the test fails naming the package.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Heartbeat and election timeout of the test clusters, in milliseconds: a killed leader is
/// replaced within about half a second (etcd's defaults are 100 and 1000).
pub const HEARTBEAT_MS: u64 = 50;
pub const ELECTION_MS: u64 = 500;
/// How long a cluster may take to elect its first leader.
const READY_MS_MAX: u64 = 15_000;

/// The `etcd` binary: on the PATH, or installed from Debian's `etcd-server` (once per test
/// process) when running as root with apt-get.
fn etcd_binary() -> &'static str {
    static FOUND: OnceLock<Result<(), String>> = OnceLock::new();
    let found = FOUND.get_or_init(|| {
        let present =
            || Command::new("etcd").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
        if present() {
            return Ok(());
        }
        let root = unsafe { libc::geteuid() } == 0;
        if !root || Command::new("apt-get").arg("--version").stdout(Stdio::null()).status().is_err() {
            return Err("etcd is missing: install Debian's etcd-server (apt-get install etcd-server)".into());
        }
        eprintln!("installing etcd-server (etcd, for the control plane's tests)");
        let apt = |args: &[&str]| {
            Command::new("apt-get")
                .args(args)
                .env("DEBIAN_FRONTEND", "noninteractive")
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        let _ = apt(&["update", "-qq"]);
        if !apt(&["install", "-y", "-qq", "--no-install-recommends", "--no-upgrade", "etcd-server"]) || !present() {
            return Err("etcd is missing and installing Debian's etcd-server failed (apt-get install etcd-server)".into());
        }
        Ok(())
    });
    if let Err(e) = found {
        panic!("{e}");
    }
    "etcd"
}

/// A loopback port nobody listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free loopback port")
}

pub struct Member {
    pub name: String,
    /// http://127.0.0.1:PORT, where clients reach it.
    pub client_url: String,
    child: Option<Child>,
}

impl Member {
    pub fn alive(&self) -> bool {
        self.child.is_some()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

/// An etcd cluster of real processes.
pub struct Etcd {
    /// Each member's data directory and log (`NAME.log`).
    pub dir: tempfile::TempDir,
    pub members: Vec<Member>,
}

impl Etcd {
    /// Starts `n` members and waits until they have elected a leader.
    pub fn start(n: usize) -> Etcd {
        let bin = etcd_binary();
        let dir = tempfile::tempdir().expect("tempdir");
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let peers = |i: usize| format!("http://127.0.0.1:{}", ports[i].1);
        let initial: Vec<String> = (0..n).map(|i| format!("m{i}={}", peers(i))).collect();
        let token = format!("nearstore-test-{}-{}", std::process::id(), ports[0].0);
        let mut etcd = Etcd { dir, members: Vec::new() };
        for (i, &(client, _)) in ports.iter().enumerate() {
            let name = format!("m{i}");
            let client_url = format!("http://127.0.0.1:{client}");
            let log = std::fs::File::create(etcd.dir.path().join(format!("{name}.log"))).expect("etcd log");
            let child = Command::new(bin)
                .args(["--name", &name, "--data-dir"])
                .arg(etcd.dir.path().join(&name))
                .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
                .args(["--listen-peer-urls", &peers(i), "--initial-advertise-peer-urls", &peers(i)])
                .args(["--initial-cluster", &initial.join(","), "--initial-cluster-state", "new", "--initial-cluster-token", &token])
                .args(["--heartbeat-interval", &HEARTBEAT_MS.to_string(), "--election-timeout", &ELECTION_MS.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("starting etcd: {e}"));
            etcd.members.push(Member { name, client_url, child: Some(child) });
        }
        let deadline = Instant::now() + Duration::from_millis(READY_MS_MAX);
        for i in 0..n {
            while !etcd.healthy(i) {
                assert!(Instant::now() < deadline, "etcd member m{i} is not healthy after {READY_MS_MAX} ms: {}", etcd.log(i));
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        etcd
    }

    /// The client URLs of every member, dead ones too (a client copes with those).
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.client_url.clone()).collect()
    }

    /// The client URLs of the members alive.
    pub fn live_endpoints(&self) -> Vec<String> {
        self.members.iter().filter(|m| m.alive()).map(|m| m.client_url.clone()).collect()
    }

    /// `--etcd`'s argument.
    pub fn arg(&self) -> String {
        self.endpoints().join(",")
    }

    /// Whether member `i` answers that its cluster has a leader (etcd's /health).
    pub fn healthy(&self, i: usize) -> bool {
        let m = &self.members[i];
        if !m.alive() {
            return false;
        }
        let Some(addr) = m.client_url.strip_prefix("http://") else { return false };
        let ask = || -> std::io::Result<String> {
            let mut s = TcpStream::connect(addr)?;
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            s.write_all(format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())?;
            let mut out = String::new();
            s.read_to_string(&mut out)?;
            Ok(out)
        };
        ask().is_ok_and(|r| r.contains("\"health\":\"true\""))
    }

    /// kill -9 of member `i`, by its PID.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The last lines of member `i`'s log, for a failure's message.
    pub fn log(&self, i: usize) -> String {
        let all = std::fs::read_to_string(self.dir.path().join(format!("{}.log", self.members[i].name))).unwrap_or_default();
        let lines: Vec<&str> = all.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}
