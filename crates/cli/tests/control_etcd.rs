//! The control plane on a real etcd (`nearstore control --etcd`): three etcd members and the
//! daemons as processes on loopback, killed by PID whatever the outcome. A restart loses
//! nothing; killing etcd's leader while clients create volumes and allocate extents loses and
//! doubles nothing; a standby daemon takes over from a killed leader within the lease TTL, and
//! a leader that lost its lease refuses to change anything; clients given several addresses
//! follow the leader (docs/control-plane.md, "etcd").

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{ok, Target};
use nearstore_control::client::{Client, ClientError};
use nearstore_control::etcd::PREFIX_DEFAULT;
use nearstore_control::limits::{FAILOVER_MS, LEADER_POLL_MS};
use nearstore_control::model::*;
use nearstore_testkit::etcd::Etcd;

const MIB: u64 = 1 << 20;

/// A `nearstore control --etcd` process; killed (SIGKILL) when dropped.
struct Daemon {
    child: Child,
    _stdout: std::io::BufReader<std::process::ChildStdout>,
    addr: SocketAddr,
    /// Its log, shown when it does not do what the test waits for.
    log: tempfile::NamedTempFile,
}

impl Daemon {
    fn start(etcd: &Etcd, lease_ttl_s: u64) -> Daemon {
        let log = tempfile::NamedTempFile::new().expect("log file");
        let mut child = Command::new(env!("CARGO_BIN_EXE_nearstore"))
            .args(["control", "--listen", "127.0.0.1:0", "--etcd", &etcd.arg(), "--lease-ttl", &lease_ttl_s.to_string()])
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(log.reopen().expect("log"))
            .spawn()
            .expect("starting nearstore control");
        let (stdout, addr) = common::control_listening(&mut child);
        Daemon { child, _stdout: stdout, addr, log }
    }

    fn client(&self) -> Client {
        Client::new(self.addr)
    }

    /// Its role as /v1/health says it: "ok" (leading) or "standby", and the leader it names.
    fn health(&self) -> Option<serde_json::Value> {
        let r = rt().block_on(self.client().raw("GET".parse().expect("method"), "/v1/health", Vec::new())).ok()?;
        serde_json::from_slice(&r.body).ok()
    }

    fn leads(&self) -> bool {
        self.health().is_some_and(|h| h["status"] == "ok")
    }

    /// Waits until it leads; returns how long that took.
    fn wait_leading(&self, within: Duration) -> Duration {
        let t0 = Instant::now();
        while !self.leads() {
            assert!(t0.elapsed() < within, "the control plane did not lead within {within:?}: {:?}\n{}", self.health(), self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        t0.elapsed()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's PID.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, sig) }, 0, "signal {sig}");
    }

    /// kill -9: no chance to give its lease back.
    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

/// Registers a target with `pools` pools of `size` bytes (no target process: the books only).
fn register(c: &Client, target: &str, pools: usize, size: u64) {
    let req = RegisterTarget {
        addr: target.into(),
        nqn: "nqn.2026-11.io.nearstore:etcd-test".into(),
        pools: (0..pools)
            .map(|i| PoolSpec {
                name: format!("p{i}"),
                path: format!("/pools/{target}/p{i}"),
                size,
                nsid: i as u32 + 1,
                bandwidth: 0,
                write_cost: 0.0,
            })
            .collect(),
        write_bound_ms: 0,
        incarnation: 0,
    };
    rt().block_on(c.register(&req)).expect("register");
}

/// Everything the store holds, read from etcd itself.
fn records(etcd: &Etcd) -> Vec<Record> {
    rt().block_on(async {
        let mut c = etcd_client::Client::connect(etcd.live_endpoints(), None).await.expect("etcd client");
        let prefix = format!("{PREFIX_DEFAULT}records/");
        let r = c.get(prefix, Some(etcd_client::GetOptions::new().with_prefix())).await.expect("etcd get");
        r.kvs().iter().map(|k| serde_json::from_slice(k.value()).expect("a record")).collect()
    })
}

/// The etcd member that leads the etcd cluster, by its status (maintenance API).
fn etcd_leader(etcd: &Etcd) -> usize {
    rt().block_on(async {
        for (i, m) in etcd.members.iter().enumerate().filter(|(_, m)| m.alive()) {
            let Ok(mut c) = etcd_client::Client::connect([m.client_url.as_str()], None).await else { continue };
            let Ok(s) = c.status().await else { continue };
            if s.header().is_some_and(|h| h.member_id() == s.leader()) {
                return i;
            }
        }
        panic!("no etcd member says it leads");
    })
}

/// The store's invariants, on etcd's records: every extent belongs to a volume and lies
/// within its pool and its volume, no two overlap, and the control plane's view counts
/// each pool's used space as their sum. Returns the volumes and extents.
fn check_books(etcd: &Etcd, cp: &Client) -> (BTreeMap<String, Volume>, BTreeMap<(String, u64), Extent>) {
    let (mut pools, mut volumes, mut extents) = (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
    for r in records(etcd) {
        match r {
            Record::Pool(p) => {
                pools.insert(p.id.clone(), p);
            }
            Record::Volume(v) => {
                volumes.insert(v.name.clone(), v);
            }
            Record::Extent(e) => {
                extents.insert((e.volume.clone(), e.index), e);
            }
            _ => {}
        }
    }
    let mut used: BTreeMap<PoolId, Vec<(u64, u64)>> = BTreeMap::new();
    for e in extents.values() {
        let v = volumes.get(&e.volume).unwrap_or_else(|| panic!("extent {}/{} of no volume: leaked", e.volume, e.index));
        let p = pools.get(&e.pool).unwrap_or_else(|| panic!("extent {}/{} in unknown pool {}", e.volume, e.index, e.pool));
        assert!(e.index < v.extents() && e.offset + v.extent_size <= p.size, "{e:?} outside its volume or pool");
        used.entry(e.pool.clone()).or_default().push((e.offset, v.extent_size));
    }
    for (pool, mut v) in used.clone() {
        v.sort();
        for w in v.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "two extents at {w:?} in {pool}: allocated twice");
        }
    }
    let view = rt().block_on(cp.view(0)).expect("view");
    for p in &view.pools {
        let id = PoolId { target: p.target.clone(), name: p.pool.clone() };
        let sum: u64 = used.get(&id).map_or(0, |v| v.iter().map(|x| x.1).sum());
        assert_eq!(p.allocated, sum, "pool {id}: used space is not the sum of its extents");
    }
    (volumes, extents)
}

/// Volumes, pools, extents and views survive a kill -9 of the control plane; the next one
/// takes the lead once the old lease ends and goes on from the same books.
#[test]
fn an_etcd_control_plane_loses_nothing() {
    let etcd = Etcd::start(3);
    let ttl = 2;
    let cp = Daemon::start(&etcd, ttl);
    cp.wait_leading(Duration::from_secs(10));
    let c = cp.client();
    let rt = rt();
    register(&c, "127.0.0.1:4420", 2, 64 * MIB);
    let pool = PoolId { target: "127.0.0.1:4420".into(), name: "p0".into() };
    rt.block_on(c.push_view(&pool, &ViewPush { seq: 1, figures: Figures { queue_depth: 2.0, ..Figures::default() } })).expect("view");
    for (name, size) in [("a", 8 * MIB), ("b", 16 * MIB)] {
        rt.block_on(c.create_volume(&CreateVolume { name: name.into(), size, extent_size: Some(MIB) })).expect("create");
    }
    for i in [0, 5, 7] {
        rt.block_on(c.allocate("a", i)).expect("allocate");
    }
    rt.block_on(c.grow_volume("b", 32 * MIB)).expect("grow");
    rt.block_on(c.create_volume(&CreateVolume { name: "gone".into(), size: 4 * MIB, extent_size: Some(MIB) })).expect("create");
    rt.block_on(c.allocate("gone", 1)).expect("allocate");
    rt.block_on(c.delete_volume("gone")).expect("delete");
    // b unexported: its handover (its last exporter may still write to it) is in the books
    // too, so the next leader exports it nowhere else either.
    let to = |t: &str| ExportVolume { target: t.into(), hosts: Vec::new(), allow_any_host: true };
    register(&c, "127.0.0.1:4421", 0, 64 * MIB);
    rt.block_on(c.export("b", &to("127.0.0.1:4420"))).expect("export");
    rt.block_on(c.unexport("b")).expect("unexport");
    let before = (rt.block_on(c.volume("a")).expect("a"), rt.block_on(c.volume("b")).expect("b"), rt.block_on(c.view(0)).expect("view"));
    assert_eq!(before.1.volume.handover.as_ref().map(|h| h.from.as_str()), Some("127.0.0.1:4420"));
    cp.kill();
    let cp = Daemon::start(&etcd, ttl);
    cp.wait_leading(Duration::from_secs(ttl + 5));
    let c = cp.client();
    let after = (rt.block_on(c.volume("a")).expect("a"), rt.block_on(c.volume("b")).expect("b"), rt.block_on(c.view(0)).expect("view"));
    // What is in doubt is said in seconds left: the same writer, a little later.
    let doubt = |i: &VolumeInfo| i.in_doubt.as_ref().map(|d| (d.target.clone(), d.restarted));
    assert_eq!(doubt(&after.1), Some(("127.0.0.1:4420".to_string(), false)));
    assert_eq!(doubt(&after.1), doubt(&before.1));
    let timeless = |i: &VolumeInfo| VolumeInfo { in_doubt: None, ..i.clone() };
    assert_eq!(timeless(&after.0), timeless(&before.0));
    assert_eq!(timeless(&after.1), timeless(&before.1));
    assert_eq!(after.0.extents.iter().map(|e| e.index).collect::<Vec<_>>(), vec![0, 5, 7]);
    assert_eq!(after.1.volume.size, 32 * MIB);
    assert_eq!(after.2, before.2);
    assert_eq!(rt.block_on(c.volume("gone")).map_err(|e| e.code()).err(), Some(Some(ErrorCode::VolumeNotFound)));
    let refused = rt.block_on(c.export("b", &to("127.0.0.1:4421"))).map(drop).map_err(|e| e.code());
    assert_eq!(refused, Err(Some(ErrorCode::ExportHandover)), "exported elsewhere while its last exporter may write");
    // Allocation goes on from the books it had: no extent is placed twice.
    let e = rt.block_on(c.allocate("a", 1)).expect("allocate");
    assert!(!after.0.extents.iter().any(|x| x.offset == e.offset && x.pool == e.pool), "{e:?} overlaps {:?}", after.0.extents);
    check_books(&etcd, &c);
}

/// One client's requests and what became of them.
#[derive(Debug, Clone)]
enum Did {
    Create(String, u64),
    Allocate(String, u64, Option<(String, u64)>),
    Delete(String),
}

/// Clients create volumes, allocate their extents and delete some, in a bounded loop, while
/// the etcd leader is killed: afterwards no extent is allocated twice or leaked, every
/// acknowledged request is there, and every failed one is there whole or not at all.
#[test]
fn killing_the_etcd_leader_under_load_loses_and_doubles_nothing() {
    let mut etcd = Etcd::start(3);
    let cp = Daemon::start(&etcd, 5);
    cp.wait_leading(Duration::from_secs(10));
    let c = cp.client();
    register(&c, "127.0.0.1:4420", 2, 48 * MIB);
    register(&c, "127.0.0.2:4420", 2, 48 * MIB);
    const CLIENTS: usize = 4;
    const ROUNDS: usize = 10;
    const EXTENTS: u64 = 4;
    let done = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..CLIENTS)
        .map(|t| {
            let (c, done) = (c.clone(), done.clone());
            std::thread::spawn(move || {
                let rt = rt();
                let mut log: Vec<(Did, bool)> = Vec::new();
                for r in 0..ROUNDS {
                    let name = format!("c{t}r{r}");
                    let req = CreateVolume { name: name.clone(), size: EXTENTS * MIB, extent_size: Some(MIB) };
                    let ok = rt.block_on(c.create_volume(&req)).is_ok();
                    log.push((Did::Create(name.clone(), EXTENTS * MIB), ok));
                    for i in 0..EXTENTS {
                        let got = rt.block_on(c.allocate(&name, i)).ok().map(|e| (e.pool + "@" + &e.target, e.offset));
                        log.push((Did::Allocate(name.clone(), i, got.clone()), got.is_some()));
                    }
                    // Every third volume goes again, extents and all.
                    if r % 3 == 2 {
                        let ok = rt.block_on(c.delete_volume(&name)).is_ok();
                        log.push((Did::Delete(name), ok));
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
                log
            })
        })
        .collect();
    // A third of the way in, etcd's leader dies.
    let t0 = Instant::now();
    while done.load(Ordering::Relaxed) < CLIENTS * ROUNDS / 3 {
        assert!(t0.elapsed() < Duration::from_secs(20), "the clients made no progress");
        std::thread::sleep(Duration::from_millis(5));
    }
    let leader = etcd_leader(&etcd);
    let killed_at = done.load(Ordering::Relaxed);
    etcd.kill(leader);
    let logs: Vec<Vec<(Did, bool)>> = workers.into_iter().map(|w| w.join().expect("a client")).collect();
    assert!(killed_at < CLIENTS * ROUNDS, "the leader died after the work");
    let (volumes, extents) = check_books(&etcd, &c);
    let mut acked = 0;
    let mut failed = 0;
    for log in &logs {
        // A client's own volume: deleted by it or not, in its order.
        let mut deleted = BTreeSet::new();
        for (did, ok) in log.iter().rev() {
            if let (Did::Delete(n), true) = (did, ok) {
                deleted.insert(n.clone());
            }
        }
        for (did, ok) in log {
            if *ok {
                acked += 1;
            } else {
                failed += 1;
            }
            match did {
                Did::Create(n, size) if *ok && !deleted.contains(n) => {
                    assert_eq!(volumes.get(n).map(|v| v.size), Some(*size), "acknowledged volume {n} lost")
                }
                Did::Create(n, size) => assert!(volumes.get(n).is_none_or(|v| v.size == *size), "volume {n} half made"),
                Did::Allocate(n, i, Some((pool, off))) if !deleted.contains(n) => {
                    let e = extents.get(&(n.clone(), *i)).unwrap_or_else(|| panic!("acknowledged extent {n}/{i} lost"));
                    assert_eq!((e.pool.to_string(), e.offset), (pool.clone(), *off), "extent {n}/{i} moved");
                }
                Did::Delete(n) if *ok => assert!(!volumes.contains_key(n), "deleted volume {n} is back"),
                // A failed delete: the volume is there with its extents, or gone with them
                // (check_books found no extent without its volume).
                _ => {}
            }
        }
    }
    assert!(acked > 0, "nothing was acknowledged");
    eprintln!("etcd leader m{leader} killed after {killed_at} rounds: {acked} requests acknowledged, {failed} failed");
    // The control plane's memory is what etcd holds: a new one loads the same.
    let infos = |c: &Client| -> Vec<VolumeInfo> {
        let rt = rt();
        let names: Vec<String> = rt.block_on(c.volumes()).expect("volumes").into_iter().map(|v| v.name).collect();
        names.iter().map(|n| rt.block_on(c.volume(n)).expect("info")).collect()
    };
    let before = infos(&c);
    cp.kill();
    let cp = Daemon::start(&etcd, 5);
    cp.wait_leading(Duration::from_secs(10));
    assert_eq!(infos(&cp.client()), before);
}

fn refused(r: Result<Volume, ClientError>) -> Option<ErrorCode> {
    r.err().and_then(|e| e.code())
}

/// A volume created on one daemon only (a raw call: a client would follow the leader a
/// standby names): None if it was, else the error code and message.
fn create_on(d: &Daemon, name: &str) -> Option<(ErrorCode, String)> {
    let body = serde_json::to_vec(&CreateVolume { name: name.into(), size: 4 * MIB, extent_size: Some(MIB) }).expect("json");
    let r = rt().block_on(d.client().raw("POST".parse().expect("method"), "/v1/volumes", body)).expect("reply");
    (r.status != 201).then(|| {
        let e: ErrorBody = serde_json::from_slice(&r.body).expect("error body");
        (e.error.code, e.error.message)
    })
}

/// Two daemons on one etcd: one leads, the other stands by and refuses changes; kill -9 of
/// the leader and the standby leads within the lease TTL with everything acknowledged. A
/// leader frozen past its lease (SIGSTOP) loses the lead and, thawed, changes nothing.
/// Two daemons on `etcd`: a leads, b stands by behind it.
fn leader_and_standby(etcd: &Etcd, ttl: u64) -> (Daemon, Daemon) {
    let a = Daemon::start(etcd, ttl);
    a.wait_leading(Duration::from_secs(10));
    let b = Daemon::start(etcd, ttl);
    let t0 = Instant::now();
    while b.health().is_none_or(|h| h["leader"] != a.addr.to_string()) {
        assert!(t0.elapsed() < Duration::from_secs(5), "b does not stand by behind a: {:?}", b.health());
        std::thread::sleep(Duration::from_millis(20));
    }
    (a, b)
}

#[test]
fn a_standby_takes_over_within_the_lease_ttl() {
    let etcd = Etcd::start(3);
    let ttl = 2;
    let (a, b) = leader_and_standby(&etcd, ttl);
    let rt = rt();
    let vol = |n: &str| CreateVolume { name: n.into(), size: 4 * MIB, extent_size: Some(MIB) };
    let (code, message) = create_on(&b, "x").expect("a standby changes nothing");
    assert_eq!(code, ErrorCode::NotLeader);
    assert!(message.contains(&a.addr.to_string()), "{message}");
    register(&a.client(), "127.0.0.1:4420", 1, 64 * MIB);
    rt.block_on(a.client().create_volume(&vol("v"))).expect("create");
    let placed: Vec<ExtentInfo> = (0..4).map(|i| rt.block_on(a.client().allocate("v", i)).expect("allocate")).collect();
    a.kill();
    let took = b.wait_leading(Duration::from_secs(ttl + 5));
    // The lease ends at most its TTL after the last keep-alive; etcd looks for ended leases
    // every 500 ms, and the standby at the leader key every LEADER_POLL_MS.
    let bound = Duration::from_millis(ttl * 1000 + 500 + LEADER_POLL_MS + 500);
    assert!(took <= bound, "the standby took {took:?} to lead, over {bound:?}");
    eprintln!("standby leading {took:?} after the leader's kill -9 (lease TTL {ttl} s)");
    assert_eq!(rt.block_on(b.client().volume("v")).expect("v").extents, placed);
    // A second daemon stands by behind b; b freezes past its lease and the other leads.
    let c = Daemon::start(&etcd, ttl);
    while c.health().is_none_or(|h| h["status"] != "standby") {
        std::thread::sleep(Duration::from_millis(20));
    }
    b.signal(libc::SIGSTOP);
    let took = c.wait_leading(Duration::from_secs(ttl + 5));
    b.signal(libc::SIGCONT);
    // Thawed, b still believes nothing yet: its change is refused all the same.
    assert_eq!(create_on(&b, "late").map(|e| e.0), Some(ErrorCode::NotLeader));
    assert_eq!(refused(rt.block_on(c.client().create_volume(&vol("w")))), None);
    assert_eq!(rt.block_on(c.client().volume("late")).map_err(|e| e.code()).err(), Some(Some(ErrorCode::VolumeNotFound)));
    assert_eq!(rt.block_on(c.client().volume("v")).expect("v").extents, placed);
    let t0 = Instant::now();
    while b.health().is_none_or(|h| h["status"] != "standby") {
        assert!(t0.elapsed() < Duration::from_secs(5), "b did not stand by again: {:?}", b.health());
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("a frozen leader was replaced {took:?} after its freeze");
    check_books(&etcd, &c.client());
}

/// Waits until the leading daemon among `ds` holds a view of `pool` received after
/// `after_ms` (ms since the epoch): the target's agent reached the leader, whichever it is.
/// Returns the index of that daemon in `ds`. On a loaded machine a short lease may change
/// hands while the test runs: the views follow the leader, so the test does too.
fn wait_view_after(ds: &[&Daemon], pool: &str, after_ms: u64, within: Duration) -> usize {
    let t0 = Instant::now();
    loop {
        for (i, d) in ds.iter().enumerate() {
            let v = rt().block_on(d.client().raw("GET".parse().expect("method"), "/v1/view", Vec::new())).ok();
            let v: Option<ClusterView> = v.filter(|r| r.status == 200).and_then(|r| serde_json::from_slice(&r.body).ok());
            if v.is_some_and(|v| v.pools.iter().any(|p| p.pool == pool && p.view.as_ref().is_some_and(|w| w.received_ms > after_ms))) {
                return i;
            }
        }
        if t0.elapsed() >= within {
            let state: Vec<String> =
                ds.iter().map(|d| format!("{}: health {:?}\n--- its log ---\n{}", d.addr, d.health(), d.log())).collect();
            panic!("no leader's view of {pool} after {after_ms} within {within:?}:\n{}", state.join("\n"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() as u64
}

/// Clients follow the leader: given the standby's address first, a CLI verb (--control and
/// NEARSTORE_CONTROL), a client call and a real target's registration and views reach the
/// leader; after kill -9 of the leader they reach the new one, within FAILOVER_MS.
#[test]
fn clients_follow_the_leader() {
    let etcd = Etcd::start(3);
    // Long enough that a loaded machine's slow keep-alive rarely loses it (at 2 s CI saw the
    // lease change hands mid-test), short enough for a quick takeover.
    let ttl = 4;
    let (a, b) = leader_and_standby(&etcd, ttl);
    let list = format!("{},{}", b.addr, a.addr);
    ok(&["volume", "create", "v", "--size", "4MiB", "--extent-size", "1MiB", "--control", &list]);
    let o = Command::new(env!("CARGO_BIN_EXE_nearstore"))
        .args(["volume", "create", "w", "--size", "4MiB", "--extent-size", "1MiB"])
        .env("NEARSTORE_CONTROL", &list)
        .output()
        .expect("nearstore");
    assert!(o.status.success(), "NEARSTORE_CONTROL={list}: {}", String::from_utf8_lossy(&o.stderr));
    let dir = tempfile::tempdir().expect("tempdir");
    let _t = Target::start(&["--memory", "1MiB", "--control", &list, "--pool", &format!("{}:64MiB", dir.path().join("p0").display())]);
    // The agent registers, then pushes a view at once, and again every VIEW_SAMPLE_MS
    // until one is taken. Should the lease still change hands, follow the leader as the
    // clients do: `a` is the one leading from here on.
    let (a, b) = if wait_view_after(&[&a, &b], "p0", 0, Duration::from_secs(25)) == 0 { (a, b) } else { (b, a) };
    let c = Client::with_addrs(vec![b.addr, a.addr]);
    let rt = rt();
    let e = rt.block_on(c.allocate("v", 0)).expect("allocate through the standby's address");
    assert_eq!(e.pool, "p0");
    assert_eq!(c.addr.current(), a.addr, "the leader is asked first next time");
    // The leader killed: the same calls reach b once it leads.
    a.kill();
    let killed = now_ms();
    let t0 = Instant::now();
    ok(&["volume", "create", "x", "--size", "4MiB", "--extent-size", "1MiB", "--control", &list]);
    let took = t0.elapsed();
    assert!(took < Duration::from_millis(FAILOVER_MS), "{took:?}");
    eprintln!("a CLI verb reached the new leader {took:?} after the leader's kill -9 (lease TTL {ttl} s)");
    assert!(b.leads());
    assert_eq!(rt.block_on(c.volume("v")).expect("v").extents, vec![e]);
    assert_eq!(c.addr.current(), b.addr);
    let names: BTreeSet<String> = rt.block_on(c.volumes()).expect("volumes").into_iter().map(|v| v.name).collect();
    assert_eq!(names, ["v", "w", "x"].into_iter().map(String::from).collect());
    // The target's agent pushes its next view (every 10 s at most) to the new leader.
    assert_eq!(wait_view_after(&[&b], "p0", killed, Duration::from_secs(25)), 0);
    // With no daemon left, a call fails after FAILOVER_MS, naming an address; a client of one
    // address, at once.
    let single = Client::new(b.addr);
    b.kill();
    let t0 = Instant::now();
    assert!(matches!(rt.block_on(single.volumes()), Err(ClientError::Transport { .. })));
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    let t0 = Instant::now();
    let err = rt.block_on(c.volumes()).expect_err("no control plane");
    let took = t0.elapsed();
    assert!(matches!(err, ClientError::Transport { .. }), "{err}");
    assert!(took >= Duration::from_millis(FAILOVER_MS) && took < Duration::from_millis(FAILOVER_MS + 2000), "{took:?}");
}
