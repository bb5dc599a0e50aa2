//! `nearstore-lab testbed`: one client host and N target hosts on this machine, each its own
//! Linux network namespace, linked through a bridge in a switch namespace by veth pairs
//! whose both ends are shaped with `tc` (tbf for the rate, netem for a delay). Each
//! target host has its own image file holding ext4 on a loop device, filled with data and
//! exported by its own `nearstore target` inside its namespace. The client reaches the
//! targets only through the shaped links, so bytes on a link are bytes on a wire.
//!
//! Everything `up` creates is written to a state file as it is created; `down` removes it
//! all, even after a failed `up` (which calls it), and sweeps namespaces named `nstb-*`.
//!
//! `bench` measures one workload in one mode from inside the client namespace;
//! `experiment` runs the grid of an experiment (docs/experiments.md) and writes JSON.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nearstore_host::device::DeviceMap;
use nearstore_host::{Host, Mode};
use serde::{Deserialize, Serialize};

use crate::demo::sh;

/// Where the state of the testbed that is up lives.
pub const STATE: &str = "/run/nearstore-testbed.json";
const PREFIX: &str = "nstb-";
const SWITCH: &str = "nstb-sw";
const CLIENT: &str = "nstb-client";

#[derive(clap::Subcommand)]
pub enum TestbedCmd {
    /// Create the namespaces, links, file systems, data and targets.
    Up(UpArgs),
    /// Remove everything a testbed created (also after a failed `up`).
    Down,
    /// What is up: hosts, addresses, links, target processes.
    Status,
    /// Set every link's rate and delay.
    Shape(ShapeArgs),
    /// Run a command on a host of the testbed: `client` or `t1`, `t2`, ...
    Exec {
        /// The host: `client`, or a target `t1`, `t2`, ...
        host: String,
        /// The command and its arguments (after `--`).
        #[arg(trailing_var_arg = true, required = true)]
        command: Vec<String>,
    },
    /// Measure one workload in one mode on the first K targets (JSON on stdout).
    Bench(BenchArgs),
    /// Bring up a testbed, run an experiment's grid, write its JSON, take the testbed down.
    Experiment(ExperimentArgs),
}

#[derive(clap::Args, Clone)]
pub struct ShapeArgs {
    /// Link rate, as tc writes it: 100mbit, 1gbit, 10gbit; `none` for unshaped.
    #[arg(long, default_value = "1gbit")]
    pub rate: String,
    /// One-way delay added on every link (netem), as tc writes it: 0ms, 1ms, 200us.
    #[arg(long, default_value = "0ms")]
    pub delay: String,
}

#[derive(clap::Args, Clone)]
pub struct UpArgs {
    /// Target hosts.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=32))]
    pub targets: u32,
    /// Files of each kind (logs, CSV) per target.
    #[arg(long, default_value_t = 8)]
    pub files: usize,
    /// Bytes per file, with or without a unit (16MiB, 16777216).
    #[arg(long, default_value = "16MiB", value_parser = crate::size_usize)]
    pub file_size: usize,
    /// Where the images and mounts go.
    #[arg(long, default_value = "/var/tmp/nearstore-testbed")]
    pub dir: PathBuf,
    /// Bytes of each target's image, with or without a unit (1GiB; sparse; default: room
    /// for the data files).
    #[arg(long, value_parser = crate::size)]
    pub image_size: Option<u64>,
    #[command(flatten)]
    pub shape: ShapeArgs,
}

#[derive(Clone, Copy, clap::ValueEnum, Serialize, Deserialize, PartialEq, Eq, Debug)]
#[serde(rename_all = "snake_case")]
pub enum BenchMode {
    /// The client reads the files' blocks over NVMe/TCP and computes.
    Conventional,
    /// Compute commands: the targets compute.
    Offloaded,
}

#[derive(clap::Args, Clone)]
pub struct BenchArgs {
    /// crc32c, sha256, blake3 (over the logs), or select (over the CSV files).
    #[arg(long, default_value = "crc32c")]
    pub op: String,
    /// How: the targets compute, or the client reads the blocks and computes.
    #[arg(long, value_enum, default_value = "offloaded")]
    pub mode: BenchMode,
    /// Use the first K targets (default: all).
    #[arg(long)]
    pub targets: Option<usize>,
}

#[derive(clap::Args, Clone)]
pub struct ExperimentArgs {
    /// `checksum` (crc32c and sha256 over the logs), `select` (over the CSV files), or a
    /// distributed sort: `sort-size`, `sort-rate`, `sort-devices`.
    pub name: String,
    /// Target counts to measure (default: 1,2,4,8; sorts: 2, or 2,4,8 for sort-devices).
    #[arg(long, value_delimiter = ',')]
    pub targets: Option<Vec<usize>>,
    /// Link rates to measure (default: 1gbit,10gbit; sort-size: 1gbit; sort-rate:
    /// 20mbit to 40gbit and none).
    #[arg(long, value_delimiter = ',')]
    pub rates: Option<Vec<String>>,
    /// Sorts: total data sizes (default: 32KiB to 512MiB for sort-size, 64MiB for
    /// sort-rate, 256MiB for sort-devices).
    #[arg(long, value_delimiter = ',')]
    pub sizes: Option<Vec<String>>,
    /// Sorts: one output per target (key ranges) instead of one output on the first.
    #[arg(long)]
    pub ranges: bool,
    /// Files of each kind per target.
    #[arg(long, default_value_t = 16)]
    pub files: usize,
    /// Bytes per file, with or without a unit (16MiB, 16777216).
    #[arg(long, default_value = "16MiB", value_parser = crate::size_usize)]
    pub file_size: usize,
    /// The JSON results (one record per cell of the grid).
    #[arg(long)]
    pub out: PathBuf,
    /// Runs per cell: each record is the run of median time, with every run's seconds.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub runs: u32,
    /// Where the images and mounts go.
    #[arg(long, default_value = "/var/tmp/nearstore-testbed")]
    pub dir: PathBuf,
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct TargetHost {
    pub name: String,
    pub ns: String,
    pub addr: SocketAddr,
    pub nqn: String,
    pub image: PathBuf,
    pub config: PathBuf,
    pub loop_dev: Option<String>,
    pub mnt: PathBuf,
    pub mounted: bool,
    pub pid: Option<u32>,
    pub logs: Vec<PathBuf>,
    pub csvs: Vec<PathBuf>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct State {
    pub dir: PathBuf,
    pub rate: String,
    pub delay: String,
    pub namespaces: Vec<String>,
    pub targets: Vec<TargetHost>,
    pub files: usize,
    pub file_size: usize,
    /// The host's device map with the cluster's tags (`--map` of the CLI).
    #[serde(default)]
    pub map: Option<PathBuf>,
}

impl State {
    fn save(&self) -> Result<()> {
        std::fs::write(STATE, serde_json::to_vec_pretty(self)?).with_context(|| format!("writing {STATE}"))
    }
    pub fn load() -> Result<State> {
        let b = std::fs::read(STATE).with_context(|| format!("no testbed is up ({STATE} is missing): nearstore-lab testbed up"))?;
        serde_json::from_slice(&b).context(STATE)
    }
}

fn netns_list() -> Vec<String> {
    sh("ip", &["netns", "list"])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(PREFIX))
        .map(str::to_string)
        .collect()
}

/// Runs `f` on a thread inside network namespace `ns`.
fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| -> Result<T> {
            enter_netns(ns)?;
            Ok(f())
        })
        .join()
        .expect("netns thread")
    })
}

/// Moves the calling thread (and threads it starts later) into network namespace `ns`.
pub fn enter_netns(ns: &str) -> Result<()> {
    let path = format!("/run/netns/{ns}");
    let f = std::fs::File::open(&path).with_context(|| format!("{path}: is the testbed up?"))?;
    // SAFETY: setns on an open namespace descriptor; affects only this thread.
    if unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&f), libc::CLONE_NEWNET) } != 0 {
        bail!("entering {ns}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// A tc rate in bits per second: 100mbit, 1gbit, 10gbit, 500kbit.
fn rate_bits(rate: &str) -> Result<u64> {
    let r = rate.to_ascii_lowercase();
    let (num, mult) = if let Some(n) = r.strip_suffix("gbit") {
        (n, 1_000_000_000)
    } else if let Some(n) = r.strip_suffix("mbit") {
        (n, 1_000_000)
    } else if let Some(n) = r.strip_suffix("kbit") {
        (n, 1_000)
    } else {
        bail!("--rate {rate}: write it as tc does, for example 100mbit, 1gbit, 10gbit, or none");
    };
    let n: f64 = num.parse().map_err(|_| anyhow::anyhow!("--rate {rate}: not a number"))?;
    if !(n > 0.0 && n <= 400.0 * 1e9 / mult as f64) {
        bail!("--rate {rate}: out of range");
    }
    Ok((n * mult as f64) as u64)
}

/// A tc delay in microseconds: 0ms, 1ms, 200us.
fn delay_us(delay: &str) -> Result<f64> {
    let (num, mult) = if let Some(n) = delay.strip_suffix("ms") {
        (n, 1000.0)
    } else if let Some(n) = delay.strip_suffix("us") {
        (n, 1.0)
    } else {
        bail!("--delay {delay}: write it as tc does, for example 0ms, 1ms, 200us");
    };
    match num.parse::<f64>() {
        Ok(v) if (0.0..=10_000.0).contains(&v) => Ok(v * mult),
        _ => bail!("--delay {delay}: a number of ms or us from 0 to 10000"),
    }
}

/// Shapes one interface's egress: tbf at the rate (a burst of 5 ms of traffic, at least
/// 256 KiB, for the large segments veth carries), under netem when there is a delay.
fn shape_dev(ns: &str, dev: &str, rate: &str, delay: &str) -> Result<()> {
    let _ = sh("tc", &["-n", ns, "qdisc", "del", "dev", dev, "root"]);
    let delayed = delay_us(delay)? > 0.0;
    let tbf = |parent: &[&str]| -> Result<()> {
        if rate == "none" {
            return Ok(());
        }
        let burst = (rate_bits(rate)? / 8 / 200).max(256 << 10).to_string();
        let mut a = vec!["-n", ns, "qdisc", "add", "dev", dev];
        a.extend_from_slice(parent);
        a.extend_from_slice(&["tbf", "rate", rate, "burst", &burst, "latency", "50ms"]);
        sh("tc", &a).map(drop)
    };
    if delayed {
        sh("tc", &["-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", delay, "limit", "100000"]).map_err(
            |e| {
                if e.to_string().contains("qdisc kind is unknown") {
                    anyhow::anyhow!(
                        "--delay {delay} needs the netem qdisc, which this kernel lacks (sch_netem): links can be shaped in rate only here"
                    )
                } else {
                    e
                }
            },
        )?;
        tbf(&["parent", "1:", "handle", "2:"])
    } else {
        tbf(&["root"])
    }
}

fn hosts(st: &State) -> Vec<String> {
    std::iter::once("client".to_string()).chain(st.targets.iter().map(|t| t.name.clone())).collect()
}

/// Both ends of every host's link: the host's egress and the switch's egress to it.
pub fn shape_all(st: &mut State, rate: &str, delay: &str) -> Result<()> {
    if rate != "none" {
        rate_bits(rate)?;
    }
    delay_us(delay)?;
    for h in hosts(st) {
        shape_dev(&format!("{PREFIX}{h}"), "eth0", rate, delay)?;
        shape_dev(SWITCH, &format!("p-{h}"), rate, delay)?;
    }
    st.rate = rate.into();
    st.delay = delay.into();
    st.save()
}

/// Waits until the target process `pid` listens at `addr`; fails at once if it exits.
fn wait_listening(addr: SocketAddr, pid: u32) -> Result<()> {
    in_netns(CLIENT, || {
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            // SAFETY: reaps our own child if it has exited.
            let mut status = 0;
            if unsafe { libc::waitpid(pid as i32, &mut status, libc::WNOHANG) } == pid as i32 {
                return Err(anyhow::anyhow!("the target at {addr} exited"));
            }
            if Instant::now() > deadline {
                return Err(anyhow::anyhow!("the target at {addr} did not listen within 20 s"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    })?
}

pub fn up(a: &UpArgs) -> Result<State> {
    // Before anything is made: the binary every target host runs.
    let exe = crate::product_binary()?;
    if unsafe { libc::geteuid() } != 0 {
        bail!("the testbed makes network namespaces, loop devices and mounts: run it as root");
    }
    let left = netns_list();
    if Path::new(STATE).exists() || !left.is_empty() {
        bail!("a testbed is already up ({STATE}, namespaces {left:?}): run `nearstore-lab testbed down` first");
    }
    if a.shape.rate != "none" {
        rate_bits(&a.shape.rate)?;
    }
    delay_us(&a.shape.delay)?;
    let mut st = State { dir: a.dir.clone(), files: a.files, file_size: a.file_size, ..State::default() };
    st.save()?;
    match build(a, &mut st, &exe) {
        Ok(()) => Ok(st),
        Err(e) => {
            eprintln!("testbed up failed: {e:#}; taking down what was made");
            if let Err(d) = down() {
                eprintln!("and taking it down failed too: {d:#}");
            }
            Err(e)
        }
    }
}

fn build(a: &UpArgs, st: &mut State, exe: &Path) -> Result<()> {
    std::fs::create_dir_all(&a.dir).with_context(|| a.dir.display().to_string())?;
    let add_ns = |st: &mut State, ns: &str| -> Result<()> {
        sh("ip", &["netns", "add", ns])?;
        st.namespaces.push(ns.into());
        st.save()?;
        sh("ip", &["-n", ns, "link", "set", "lo", "up"]).map(drop)
    };
    add_ns(st, SWITCH)?;
    sh("ip", &["-n", SWITCH, "link", "add", "br0", "type", "bridge"])?;
    sh("ip", &["-n", SWITCH, "link", "set", "br0", "up"])?;
    let names: Vec<String> = std::iter::once("client".to_string()).chain((1..=a.targets).map(|i| format!("t{i}"))).collect();
    for (i, h) in names.iter().enumerate() {
        let ns = format!("{PREFIX}{h}");
        add_ns(st, &ns)?;
        let peer = format!("p-{h}");
        sh("ip", &["-n", &ns, "link", "add", "eth0", "type", "veth", "peer", "name", &peer, "netns", SWITCH])?;
        sh("ip", &["-n", &ns, "addr", "add", &format!("10.77.0.{}/24", 10 + i), "dev", "eth0"])?;
        sh("ip", &["-n", &ns, "link", "set", "eth0", "up"])?;
        sh("ip", &["-n", SWITCH, "link", "set", &peer, "master", "br0", "up"])?;
    }
    let addr_of = |i: usize| -> SocketAddr { SocketAddr::from(([10, 77, 0, 10 + i as u8], 4420)) };
    let nqn_of = |name: &str| format!("nqn.2026-11.io.nearstore:testbed-{name}");
    // Each target's NQN to its peers; every target trusts the others to read it for a host.
    let peer_of = |name: &str| format!("nqn.2026-11.io.nearstore:testbed-{name}-peer");
    let quoted = |v: &str| toml::Value::String(v.into()).to_string();
    // Every target has the others as peers: device tag i is target ti.
    let cluster_of = |i: usize| -> String {
        let mut c = format!(
            "[compute]\nmemory_per_command = \"2GiB\"\n[cluster]\nhost_nqn = {}\ntrusted_members = [{}]\n",
            quoted(&peer_of(&names[i])),
            names.iter().skip(1).map(|n| quoted(&peer_of(n))).collect::<Vec<_>>().join(", ")
        );
        for (j, other) in names.iter().enumerate().skip(1).filter(|(j, _)| *j != i) {
            c += &format!("[[cluster.peer]]\ntag = {j}\naddress = \"{}\"\nnqn = {}\n", addr_of(j), quoted(&nqn_of(other)));
        }
        c
    };
    let mut map = String::new();
    for (i, name) in names.iter().enumerate().skip(1) {
        let ns = format!("{PREFIX}{name}");
        let image = a.dir.join(format!("{name}.img"));
        let mnt = a.dir.join(format!("{name}.mnt"));
        let need = (a.files * a.file_size * 2) as u64;
        std::fs::File::create(&image)?.set_len(a.image_size.unwrap_or((need * 3 / 2).max(128 << 20)))?;
        let addr = addr_of(i);
        let nqn = nqn_of(name);
        let config = a.dir.join(format!("{name}.toml"));
        st.targets.push(TargetHost {
            name: name.clone(),
            ns: ns.clone(),
            addr,
            nqn: nqn.clone(),
            image: image.clone(),
            config: config.clone(),
            loop_dev: None,
            mnt: mnt.clone(),
            mounted: false,
            pid: None,
            logs: vec![],
            csvs: vec![],
        });
        st.save()?;
        let img = image.to_str().context("utf-8 path")?;
        sh("mkfs.ext4", &["-F", "-q", "-b", "4096", img])?;
        let dev = sh("losetup", &["-f", "--show", img])?;
        st.targets.last_mut().expect("pushed").loop_dev = Some(dev.clone());
        st.save()?;
        std::fs::create_dir_all(&mnt)?;
        sh("mount", &[&dev, mnt.to_str().context("utf-8 path")?])?;
        st.targets.last_mut().expect("pushed").mounted = true;
        st.save()?;
        let files = crate::demo::write_sample(&mnt, a.files, a.file_size)?;
        sh("sync", &[])?;
        let t = st.targets.last_mut().expect("pushed");
        t.logs = files.iter().filter(|f| f.extension().is_some_and(|e| e == "log")).cloned().collect();
        t.csvs = files.iter().filter(|f| f.extension().is_some_and(|e| e == "csv")).cloned().collect();
        std::fs::write(
            &config,
            format!(
                "{}[[listener]]\naddress = \"{addr}\"\n[[subsystem]]\nnqn = {}\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\npath = {}\ntag = {i}\n",
                cluster_of(i),
                quoted(&nqn),
                quoted(img)
            ),
        )?;
        map += &format!("[[namespace]]\naddress = \"{addr}\"\nnqn = {}\nnsid = 1\nfile = {}\ntag = {i}\n", quoted(&nqn), quoted(img));
        let log = std::fs::File::create(a.dir.join(format!("{name}.log")))?;
        let child = Command::new("ip")
            .args(["netns", "exec", &ns])
            .arg(exe)
            .args(["target", "--config"])
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .spawn()
            .context("starting a target")?;
        let pid = child.id();
        st.targets.last_mut().expect("pushed").pid = Some(pid);
        st.save()?;
        let log = a.dir.join(format!("{name}.log"));
        wait_listening(addr, pid)
            .with_context(|| format!("target {name}: {}", std::fs::read_to_string(&log).unwrap_or_default().trim()))?;
    }
    let map_file = a.dir.join("map.toml");
    std::fs::write(&map_file, map)?;
    st.map = Some(map_file);
    // Every host's link, targets included (they are in the state now).
    shape_all(st, &a.shape.rate, &a.shape.delay)
}

/// Stops a process we started, if it is still the one we started.
fn stop(pid: u32) {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    if !String::from_utf8_lossy(&cmdline).contains("nearstore") {
        return;
    }
    // SAFETY: signals to a process we started, checked by its command line above.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(5);
    while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        // Reap it if it is our child (a failed `up` in this process).
        unsafe { libc::waitpid(pid as i32, std::ptr::null_mut(), libc::WNOHANG) };
    }
    if Path::new(&format!("/proc/{pid}")).exists() {
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
}

/// Removes what the state file records, then any namespace named `nstb-*`. Every step is
/// tried; the first error is returned after all of them.
pub fn down() -> Result<()> {
    let st = State::load().ok();
    let mut errors = Vec::new();
    if let Some(st) = &st {
        for t in &st.targets {
            if let Some(pid) = t.pid {
                stop(pid);
            }
        }
        for t in &st.targets {
            if t.mounted {
                if let Err(e) = sh("umount", &[t.mnt.to_str().unwrap_or_default()]) {
                    errors.push(e);
                }
            }
            if let Some(d) = &t.loop_dev {
                if let Err(e) = sh("losetup", &["-d", d]) {
                    errors.push(e);
                }
            }
            // Only what `up` made: the image, the mount point, the config, the log.
            let _ = std::fs::remove_file(&t.image);
            let _ = std::fs::remove_dir(&t.mnt);
            let _ = std::fs::remove_file(&t.config);
            let _ = std::fs::remove_file(st.dir.join(format!("{}.log", t.name)));
        }
    }
    for ns in netns_list() {
        if let Err(e) = sh("ip", &["netns", "del", &ns]) {
            errors.push(e);
        }
    }
    if let Some(st) = &st {
        if let Some(m) = &st.map {
            let _ = std::fs::remove_file(m);
        }
        // The directory too, when nothing else is in it.
        let _ = std::fs::remove_dir(&st.dir);
    }
    let _ = std::fs::remove_file(STATE);
    match errors.into_iter().next() {
        Some(e) => Err(e.context("taking the testbed down")),
        None => Ok(()),
    }
}

/// Bytes received and sent by a host's link, from the interface's counters.
pub fn link_bytes(ns: &str) -> Result<(u64, u64)> {
    let out = sh("ip", &["-n", ns, "-j", "-s", "link", "show", "dev", "eth0"])?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let s = &v[0]["stats64"];
    Ok((s["rx"]["bytes"].as_u64().context("rx bytes")?, s["tx"]["bytes"].as_u64().context("tx bytes")?))
}

pub fn status() -> Result<()> {
    let st = State::load()?;
    println!("testbed in {}: links {} delay {}", st.dir.display(), st.rate, st.delay);
    let (rx, tx) = link_bytes(CLIENT)?;
    println!("client   10.77.0.10  rx {rx} tx {tx} bytes");
    for t in &st.targets {
        let alive = t.pid.is_some_and(|p| Path::new(&format!("/proc/{p}")).exists());
        let (rx, tx) = link_bytes(&t.ns)?;
        println!(
            "{:<8} {:<11} {} {} pid {} ({}), {} logs + {} CSV files, rx {rx} tx {tx} bytes",
            t.name,
            t.addr.ip(),
            t.nqn,
            t.loop_dev.as_deref().unwrap_or("-"),
            t.pid.map_or("-".into(), |p| p.to_string()),
            if alive { "running" } else { "NOT RUNNING" },
            t.logs.len(),
            t.csvs.len()
        );
    }
    Ok(())
}

pub fn exec(host: &str, command: &[String]) -> Result<()> {
    let st = State::load()?;
    if !hosts(&st).iter().any(|h| h == host) {
        bail!("no host {host:?} in the testbed (hosts: {})", hosts(&st).join(", "));
    }
    let status = Command::new("ip").args(["netns", "exec", &format!("{PREFIX}{host}")]).args(command).status()?;
    if !status.success() {
        bail!("{} exited with {status}", command.join(" "));
    }
    Ok(())
}

/// One measurement, as the experiments record it.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct Record {
    pub experiment: String,
    pub op: String,
    pub mode: BenchMode,
    pub targets: usize,
    pub rate: String,
    pub delay: String,
    pub files: usize,
    pub bytes: u64,
    pub secs: f64,
    /// Every run's seconds, when the cell was measured several times (the record is the
    /// median one).
    #[serde(default)]
    pub secs_runs: Vec<f64>,
    pub mb_per_s: f64,
    /// User + system CPU seconds of the client process during the run.
    pub client_cpu_secs: f64,
    /// From the interfaces' counters: bytes the client's link received and sent, and the
    /// targets' links sent and received.
    pub client_rx: u64,
    pub client_tx: u64,
    pub targets_tx: u64,
    pub targets_rx: u64,
    /// Every link's bytes, host by host: (host, received, sent) at the host's end.
    #[serde(default)]
    pub links: Vec<(String, u64, u64)>,
    /// Link bytes (client rx + tx) per data byte.
    pub wire_fraction: f64,
    /// Our own accounting: TCP payload bytes of the client's connections.
    pub tcp_bytes: u64,
    /// A digest of the results (every file's outcome), to compare modes.
    pub results: String,
}

fn cpu_secs() -> f64 {
    // SAFETY: getrusage fills the struct.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

fn workload(op: &str) -> Result<(&'static nearstore_compute::Operation, Vec<u8>, bool)> {
    Ok(match op {
        "crc32c" | "sha256" | "blake3" => (nearstore_compute::by_name(op)?, Vec::new(), false),
        "select" => (
            nearstore_compute::by_name("select")?,
            serde_json::to_vec(&serde_json::json!({
                "query": "SELECT city, COUNT(*), SUM(quantity), AVG(amount) FROM s3object WHERE quantity > 5 GROUP BY city"
            }))?,
            true,
        ),
        other => bail!("--op {other}: crc32c, sha256, blake3 or select"),
    })
}

/// The client's host library, with every target's image mapped to its endpoint.
pub fn client(st: &State) -> Result<Host> {
    // The map `up` wrote: the same one the CLI takes with --map.
    let map = st.map.as_ref().context("the testbed's state names no map: take it down and up again")?;
    let mut devices = DeviceMap::default();
    devices.load(&std::fs::read_to_string(map).with_context(|| map.display().to_string())?).map_err(anyhow::Error::msg)?;
    let mut host = Host::new(devices);
    host.parallel = 4;
    Ok(host)
}

/// Runs one workload over the first `k` targets' files; the caller is in the client's
/// namespace.
pub async fn measure(host: &mut Host, st: &State, experiment: &str, op: &str, mode: BenchMode, k: usize) -> Result<Record> {
    let (operation, args, csv) = workload(op)?;
    let k = k.clamp(1, st.targets.len());
    let files: Vec<PathBuf> = st.targets[..k].iter().flat_map(|t| if csv { t.csvs.clone() } else { t.logs.clone() }).collect();
    // Every link's counters: the client's, then each target's.
    let links = || -> Result<Vec<(u64, u64)>> {
        std::iter::once(CLIENT).chain(st.targets[..k].iter().map(|t| t.ns.as_str())).map(link_bytes).collect()
    };
    let before = links()?;
    let cpu0 = cpu_secs();
    let t = Instant::now();
    let r = host.run(operation, &args, &files, if mode == BenchMode::Offloaded { Mode::Offload } else { Mode::Pull }).await?;
    let secs = t.elapsed().as_secs_f64();
    let cpu = cpu_secs() - cpu0;
    let after = links()?;
    let d: Vec<(u64, u64)> = after.iter().zip(&before).map(|(a, b)| (a.0 - b.0, a.1 - b.1)).collect();
    if let Some(f) = r.files.iter().find(|f| !matches!(f.how, nearstore_host::How::Offloaded | nearstore_host::How::Pulled)) {
        bail!("{} was computed on the client: {:?}", f.path.display(), f.how);
    }
    Ok(Record {
        experiment: experiment.into(),
        op: op.into(),
        mode,
        targets: k,
        rate: st.rate.clone(),
        delay: st.delay.clone(),
        files: files.len(),
        bytes: r.bytes_processed,
        secs,
        secs_runs: vec![secs],
        mb_per_s: r.bytes_processed as f64 / secs / 1e6,
        client_cpu_secs: cpu,
        client_rx: d[0].0,
        client_tx: d[0].1,
        targets_rx: d[1..].iter().map(|x| x.0).sum(),
        links: std::iter::once("client".to_string())
            .chain(st.targets[..k].iter().map(|t| t.name.clone()))
            .zip(&d)
            .map(|(h, (rx, tx))| (h, *rx, *tx))
            .collect(),
        targets_tx: d[1..].iter().map(|x| x.1).sum(),
        wire_fraction: (d[0].0 + d[0].1) as f64 / r.bytes_processed.max(1) as f64,
        tcp_bytes: r.wire_sent + r.wire_received,
        results: {
            let outcomes: Vec<&nearstore_compute::Outcome> = r.files.iter().map(|f| &f.outcome).collect();
            nearstore_compute::run("xxh3-128", b"", [&serde_json::to_vec(&outcomes)?[..]])
                .map(|o| match o {
                    nearstore_compute::Outcome::Digest { hex, .. } => hex,
                    _ => String::new(),
                })
                .unwrap_or_default()
        },
    })
}

pub fn bench(a: &BenchArgs) -> Result<()> {
    let st = State::load()?;
    enter_netns(CLIENT)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let rec = rt.block_on(async {
        let mut host = client(&st)?;
        measure(&mut host, &st, "bench", &a.op, a.mode, a.targets.unwrap_or(st.targets.len())).await
    })?;
    println!("{}", serde_json::to_string(&rec)?);
    Ok(())
}

pub fn experiment(a: &ExperimentArgs) -> Result<()> {
    if crate::sortexp::is_sort(&a.name) {
        return crate::sortexp::experiment(a);
    }
    let a = &ExperimentArgs {
        targets: Some(a.targets.clone().unwrap_or_else(|| vec![1, 2, 4, 8])),
        rates: Some(a.rates.clone().unwrap_or_else(|| vec!["1gbit".into(), "10gbit".into()])),
        ..a.clone()
    };
    let ops: &[&str] = match a.name.as_str() {
        "checksum" => &["crc32c", "sha256"],
        "select" => &["select"],
        other => bail!("experiment {other:?}: checksum or select"),
    };
    let (targets, rates) = (a.targets.as_deref().unwrap_or_default(), a.rates.as_deref().unwrap_or_default());
    let max = *targets.iter().max().context("--targets is empty")?;
    let up_args = UpArgs {
        targets: max as u32,
        files: a.files,
        file_size: a.file_size,
        dir: a.dir.clone(),
        image_size: None,
        shape: ShapeArgs { rate: rates.first().context("--rates is empty")?.clone(), delay: "0ms".into() },
    };
    let mut st = up(&up_args)?;
    let r = run_grid(a, ops, &mut st);
    let d = down();
    let records = r?;
    d?;
    if let Some(dir) = a.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&a.out, serde_json::to_vec_pretty(&records)?)?;
    eprintln!("{} measurements in {}", records.len(), a.out.display());
    Ok(())
}

fn run_grid(a: &ExperimentArgs, ops: &[&str], st: &mut State) -> Result<Vec<Record>> {
    let mut records = Vec::new();
    let st_for_client = st.clone();
    // The measuring thread lives in the client's namespace; shaping runs from here.
    let (tx, rx) = std::sync::mpsc::channel::<(String, BenchMode, usize, String)>();
    let (rtx, rrx) = std::sync::mpsc::channel::<Result<Record>>();
    let name = a.name.clone();
    let worker = std::thread::spawn(move || -> Result<()> {
        enter_netns(CLIENT)?;
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let mut host = client(&st_for_client)?;
        for (op, mode, k, rate) in rx {
            let st = State { rate, ..st_for_client.clone() };
            let r = rt.block_on(measure(&mut host, &st, &name, &op, mode, k));
            if rtx.send(r).is_err() {
                break;
            }
        }
        Ok(())
    });
    for rate in a.rates.as_deref().unwrap_or_default() {
        shape_all(st, rate, "0ms")?;
        for &k in a.targets.as_deref().unwrap_or_default() {
            for op in ops {
                let mut results: Option<String> = None;
                // Untimed: connections made, targets' caches warm.
                tx.send((op.to_string(), BenchMode::Offloaded, k, rate.clone())).expect("measuring thread");
                rrx.recv().context("the measuring thread stopped")??;
                for mode in [BenchMode::Conventional, BenchMode::Offloaded] {
                    let mut runs = Vec::new();
                    for _ in 0..a.runs {
                        tx.send((op.to_string(), mode, k, rate.clone())).expect("measuring thread");
                        runs.push(rrx.recv().context("the measuring thread stopped")??);
                    }
                    runs.sort_by(|x, y| x.secs.total_cmp(&y.secs));
                    let all: Vec<f64> = runs.iter().map(|r| r.secs).collect();
                    let mut rec = runs.swap_remove(runs.len() / 2);
                    rec.secs_runs = all;
                    match &results {
                        None => results = Some(rec.results.clone()),
                        Some(r) if *r != rec.results => bail!("{op} on {k} targets: conventional and offloaded results differ"),
                        Some(_) => {}
                    }
                    eprintln!(
                        "{:<7} {k} targets {rate:>6} {:<12?} {:>8.1} MB/s  client link {:>12} bytes ({:.5}% of {} data bytes), client CPU {:.2} s",
                        op,
                        mode,
                        rec.mb_per_s,
                        rec.client_rx + rec.client_tx,
                        rec.wire_fraction * 100.0,
                        rec.bytes,
                        rec.client_cpu_secs
                    );
                    records.push(rec);
                }
            }
        }
    }
    drop(tx);
    worker.join().expect("measuring thread")?;
    Ok(records)
}

pub fn run(cmd: TestbedCmd) -> Result<()> {
    match cmd {
        TestbedCmd::Up(a) => {
            let st = up(&a)?;
            println!("testbed up: client 10.77.0.10 and {} targets, links {} delay {}", st.targets.len(), st.rate, st.delay);
            status()
        }
        TestbedCmd::Down => down(),
        TestbedCmd::Status => status(),
        TestbedCmd::Shape(s) => {
            let mut st = State::load()?;
            shape_all(&mut st, &s.rate, &s.delay)
        }
        TestbedCmd::Exec { host, command } => exec(&host, &command),
        TestbedCmd::Bench(a) => bench(&a),
        TestbedCmd::Experiment(a) => experiment(&a),
    }
}
