//! Running the `nearstore` binary from the CLI tests and a target process to run it against;
//! ext4 on a loop device from nearstore-testkit.
#![allow(dead_code, unused_imports)]

use std::io::BufRead;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

pub fn nearstore(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nearstore")).args(args).output().expect("running nearstore")
}

/// Runs it, requires success, returns stdout.
pub fn ok(args: &[&str]) -> String {
    let o = nearstore(args);
    assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

/// Runs it, requires exit status 1 (an error, not a usage error or a panic), returns
/// (stdout, stderr).
pub fn fails(args: &[&str]) -> (String, String) {
    let o = nearstore(args);
    let (out, err) = (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned());
    assert_eq!(o.status.code(), Some(1), "{args:?}: status {:?}, stdout {out:?}, stderr {err:?}", o.status);
    (out, err)
}

/// The cluster members of the volume tests (crates/cli/tests/volume.rs, moves.rs): three, and
/// a fourth that joins later (moves.rs, the rebalance).
pub const MEMBERS: [&str; 4] = [
    "nqn.2026-11.io.nearstore:member1",
    "nqn.2026-11.io.nearstore:member2",
    "nqn.2026-11.io.nearstore:member3",
    "nqn.2026-11.io.nearstore:member4",
];

/// Configuration a [`member_target`] adds to the common one.
#[derive(Clone, Copy, Default)]
pub struct MemberConfig<'a> {
    /// Before the tables (e.g. `metrics = ".."`).
    pub top: &'a str,
    /// More lines of `[cluster]`.
    pub cluster: &'a str,
    /// More tables (e.g. `[volume]`).
    pub tables: &'a str,
}

/// Target `i` (0-based) of the three-member cluster: member `MEMBERS[i]` trusting all three, a
/// 1 MiB memory namespace in `nqn.2026-11.io.nearstore:t{i}` and one pool of `pool_mib` MiB,
/// registered with `control`, with `more` configuration; `name` names its configuration file.
pub fn member_target(dir: &Path, name: &str, i: usize, control: &str, pool_mib: u64, more: MemberConfig) -> Target {
    let MemberConfig { top, cluster, tables } = more;
    let config = dir.join(format!("{name}.toml"));
    let members = MEMBERS.iter().map(|m| format!("\"{m}\"")).collect::<Vec<_>>().join(", ");
    let member = MEMBERS[i];
    std::fs::write(
        &config,
        format!(
            r#"
            {top}
            [[listener]]
            address = "127.0.0.1:0"
            [[subsystem]]
            nqn = "nqn.2026-11.io.nearstore:t{i}"
            allow_any_host = true
            [[subsystem.namespace]]
            nsid = 1
            memory = "1MiB"
            [cluster]
            host_nqn = "{member}"
            trusted_members = [{members}]
            {cluster}
            {tables}
            "#
        ),
    )
    .expect("config");
    let pool = format!("{}:{pool_mib}MiB", dir.join(format!("p{i}")).display());
    Target::start(&["--config", config.to_str().expect("path"), "--control", control, "--pool", &pool])
}

/// Member target `name` (`i`) of [`member_target`] started again, as a new process, on
/// `addr`, where it listened before: the same configuration and pool.
pub fn restart_member_target(dir: &Path, name: &str, i: usize, control: &str, pool_mib: u64, addr: SocketAddr) -> Target {
    let config = dir.join(format!("{name}.toml"));
    let text = std::fs::read_to_string(&config).expect("config");
    std::fs::write(&config, text.replace("address = \"127.0.0.1:0\"", &format!("address = \"{addr}\""))).expect("config");
    let pool = format!("{}:{pool_mib}MiB", dir.join(format!("p{i}")).display());
    let t = Target::start(&["--config", config.to_str().expect("path"), "--control", control, "--pool", &pool]);
    assert_eq!(t.addr, addr, "restarted where it listened");
    t
}

/// A `nearstore target` process on a port the kernel chose (`--listen 127.0.0.1:0`), killed
/// when dropped, passed or failed.
pub struct Target {
    child: Child,
    /// Kept open: a target writing to a closed stdout would fail.
    _stdout: std::io::BufReader<std::process::ChildStdout>,
    /// Its I/O listener, and its discovery listener (on 127.0.0.2) when it has one.
    pub addr: SocketAddr,
    pub discovery: Option<SocketAddr>,
}

impl Target {
    /// `args`: what the namespace is (`--memory 64MiB`, `--namespace FILE`), or `--config
    /// FILE` with one listener on 127.0.0.1:0.
    pub fn start(args: &[&str]) -> Target {
        Target::spawn(&["--discovery", "none"], args, 1, &[])
    }

    /// [`Target::start`] with more environment.
    pub fn start_env(args: &[&str], env: &[(&str, &str)]) -> Target {
        Target::spawn(&["--discovery", "none"], args, 1, env)
    }

    /// With a discovery listener too, on 127.0.0.2.
    pub fn with_discovery(args: &[&str]) -> Target {
        Target::spawn(&["--discovery", "127.0.0.2:0"], args, 2, &[])
    }

    fn spawn(discovery: &[&str], args: &[&str], listeners: usize, env: &[(&str, &str)]) -> Target {
        let mut child = Command::new(env!("CARGO_BIN_EXE_nearstore"))
            .args(["target", "--listen", "127.0.0.1:0"])
            .args(discovery)
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting nearstore target");
        let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        let mut addrs: Vec<SocketAddr> = Vec::new();
        for _ in 0..listeners {
            let mut line = String::new();
            let _ = stdout.read_line(&mut line);
            match line.trim().strip_prefix("listening on ").and_then(|a| a.parse().ok()) {
                Some(a) => addrs.push(a),
                None => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("the target did not say where it listens: {line:?}");
                }
            }
        }
        let discovery = addrs.iter().copied().find(|a| a.ip().to_string() == "127.0.0.2");
        let addr = addrs.iter().copied().find(|a| Some(*a) != discovery).expect("an I/O listener");
        Target { child, _stdout: stdout, addr, discovery }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A child process, killed (SIGKILL) and reaped when dropped.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `nearstore target` on a free port of 127.0.0.1, for a target whose address must be known
/// before it starts (a configuration its clients read too): `args(address)` writes what it
/// needs and gives the arguments after `target`. Tests run in parallel, so another process may
/// take the port between the probe and the bind and ours exits: a port counts only when the
/// target says it listens there (its stdout), else it starts again on another (5 tries).
pub fn target_on_free_port(args: impl Fn(SocketAddr) -> Vec<String>) -> (Proc, SocketAddr) {
    for _ in 0..5 {
        let addr = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port");
        let mut child = Command::new(env!("CARGO_BIN_EXE_nearstore"))
            .arg("target")
            .args(args(addr))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting nearstore target");
        let out = child.stdout.take().expect("piped stdout");
        let t = Proc(child);
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
        match rx.recv_timeout(std::time::Duration::from_secs(30)) {
            Ok(true) => return (t, addr),
            Ok(false) => continue,
            Err(_) => panic!("the target did not listen on {addr} within 30 s"),
        }
    }
    panic!("the target could not listen on any of 5 free ports");
}

pub use nearstore_testkit::Fs;

/// A `nearstore control` process; killed (SIGKILL) when dropped.
pub struct Control {
    child: Child,
    _stdout: std::io::BufReader<std::process::ChildStdout>,
    pub addr: SocketAddr,
}

impl Control {
    pub fn start(store: &Path) -> Control {
        Control::start_on(store, "127.0.0.1:0")
    }

    /// On a given address (a restart where the targets expect it).
    pub fn start_on(store: &Path, listen: &str) -> Control {
        Control::start_with(store, listen, &[])
    }

    /// With more arguments.
    pub fn start_with(store: &Path, listen: &str, more: &[&str]) -> Control {
        let mut child = Command::new(env!("CARGO_BIN_EXE_nearstore"))
            .args(["control", "--listen", listen, "--store"])
            .arg(store)
            .args(more)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting nearstore control");
        let (stdout, addr) = control_listening(&mut child);
        Control { child, _stdout: stdout, addr }
    }

    /// kill -9: no chance to flush anything.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn client(&self) -> nearstore_control::client::Client {
        nearstore_control::client::Client::new(self.addr)
    }

    pub fn a(&self) -> String {
        self.addr.to_string()
    }
}

/// The address a `nearstore control` child says it listens on (its first line of output),
/// and its stdout, kept open; the child killed if it says nothing of the kind.
pub fn control_listening(child: &mut Child) -> (std::io::BufReader<std::process::ChildStdout>, SocketAddr) {
    let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    let _ = stdout.read_line(&mut line);
    let Some(addr) = line.trim().strip_prefix("listening on ").and_then(|a| a.parse().ok()) else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the control plane did not say where it listens: {line:?}");
    };
    (stdout, addr)
}

impl Drop for Control {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port of 127.0.0.1 free now (for a metrics endpoint).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port()
}

/// One counter or gauge of a target's metrics endpoint.
pub fn metric(at: SocketAddr, name: &str) -> u64 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(at).expect("metrics endpoint");
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").expect("request");
    let mut body = String::new();
    s.read_to_string(&mut body).expect("metrics");
    let line = body.lines().find(|l| l.split_whitespace().next() == Some(name)).unwrap_or_else(|| panic!("no {name} in the metrics"));
    line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{line}"))
}
