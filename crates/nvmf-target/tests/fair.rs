//! Fair I/O on a real target (docs/fair-io.md): tenants reading a bandwidth-limited
//! namespace at once get its bytes by their `io_weight` with the scheduler on, and by their
//! queue depths without it; without `[[tenant]]` entries each host is its own tenant; a
//! tenant's offloaded reads are its own share, not the target's.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use nearstore_initiator::{ConnectOptions, Controller, Data};
use nearstore_target::config::Config;
use nearstore_target::Target;
use nearstore_wire::opcode::io;
use nearstore_wire::Sqe;
use tokio::time::Instant;

const NQN: &str = "nqn.2026-11.io.nearstore:fair";
const HEAVY: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000a1";
const LIGHT: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000b2";
/// The namespace's bandwidth, bytes per second.
const RATE: u64 = 48 << 20;
const READ: u32 = 64 << 10;

/// A target whose namespace serves RATE bytes a second, fair-scheduled when `fair`; with
/// `weights`, HEAVY and LIGHT are tenants of those `io_weight`s, else no tenant is
/// configured (each host on its own, at the default weight).
async fn start(fair: bool, weights: Option<(u32, u32)>) -> (std::sync::Arc<Target>, SocketAddr) {
    common::init_logs();
    let fair = if fair { format!("fair = {{ bandwidth = {RATE} }}") } else { String::new() };
    let tenants = weights.map_or(String::new(), |(h, l)| {
        [("heavy", HEAVY, h), ("light", LIGHT, l)]
            .map(|(name, host, w)| {
                format!("[[tenant]]\nname = \"{name}\"\nhosts = [\"{host}\"]\nio_weight = {w}\n[[tenant.reach]]\nsubsystem = \"{NQN}\"\n")
            })
            .concat()
    });
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
        {fair}
        {tenants}
        "#
    );
    let target = Target::from_config(&Config::from_toml(&cfg).unwrap()).unwrap();
    let addr = target.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    (target, addr)
}

/// Reads `READ` bytes at a time at queue depth `qd` as `host` until `end`; returns the bytes
/// completed after `from`.
async fn reader(addr: SocketAddr, host: &str, qd: u16, from: Instant, end: Instant) -> u64 {
    let mut o = ConnectOptions::new(addr, NQN);
    o.hostnqn = host.into();
    o.queue_depth = qd.max(2);
    let c = Controller::connect(o).await.unwrap();
    let mut ioq = c.io_queue(1).await.unwrap();
    let q = ioq.queue();
    let blocks = READ / 4096;
    let (mut next, mut bytes) = (0u64, 0u64);
    loop {
        let now = Instant::now();
        while now < end && q.in_flight() < qd as usize {
            let slba = next * blocks as u64 % (16 << 20 >> 12);
            q.submit(Sqe::rw(io::READ, 1, slba, blocks, false), Data::In(READ as usize), 0).unwrap();
            next += 1;
        }
        if q.in_flight() == 0 {
            return bytes;
        }
        let mut done = 0;
        q.poll(|_, cqe, _| {
            assert!(cqe.status.is_success(), "{}", cqe.status);
            done += 1;
        })
        .await
        .unwrap();
        if Instant::now() >= from && Instant::now() < end {
            bytes += done * READ as u64;
        }
    }
}

/// Jain's fairness index of `x`: 1 when all are equal, 1/n when one takes everything.
fn jain(x: &[f64]) -> f64 {
    let sum: f64 = x.iter().sum();
    sum * sum / (x.len() as f64 * x.iter().map(|v| v * v).sum::<f64>())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_bytes_follow_their_weights_with_the_scheduler_on() {
    // (fair scheduler on, io_weights (heavy, light) or no tenants, queue depths (heavy,
    // light), heavy's share of the bytes wanted). Without the scheduler the device serves
    // commands in arrival order: weights count for nothing and queue depths decide; with
    // it, the weights do. At RATE one 1 ms epoch's budget is smaller than one READ.
    let cases = [
        (false, Some((200, 100)), (16, 16), 0.5),
        (true, Some((200, 100)), (16, 16), 2.0 / 3.0),
        (false, Some((100, 100)), (8, 32), 0.2),
        (true, Some((100, 100)), (8, 32), 0.5),
        (true, Some((100, 300)), (16, 16), 0.25),
        (true, None, (8, 32), 0.5),
    ];
    for (fair, weights, qd, want) in cases {
        let (target, addr) = start(fair, weights).await;
        let t0 = Instant::now();
        let (from, end) = (t0 + Duration::from_millis(500), t0 + Duration::from_millis(2500));
        let (heavy, light) = tokio::join!(reader(addr, HEAVY, qd.0, from, end), reader(addr, LIGHT, qd.1, from, end));
        let share = heavy as f64 / (heavy + light) as f64;
        let total = (heavy + light) as f64 / 2.0;
        let case = format!("fair {fair}, weights {weights:?}, depths {qd:?}: heavy {heavy} light {light} bytes, share {share:.3}");
        eprintln!("{case}");
        assert!((share - want).abs() <= 0.05 * want, "{case}, wanted {want:.3}");
        if fair && want == 0.5 {
            let j = jain(&[heavy as f64, light as f64]);
            assert!(j >= 0.98, "{case}: Jain's index {j:.4}");
        }
        // The device stays busy: the scheduler lends what one host does not take.
        assert!(total >= 0.8 * RATE as f64, "{case}: {total:.0} bytes/s of {RATE}");
        assert_eq!(target.stats.requests_lost.load(std::sync::atomic::Ordering::Relaxed), 0);
    }
}

/// The tenant's scheduled bytes (`nearstore_tenant_io_scheduled_bytes_total`).
fn scheduled(target: &Target, name: &str) -> u64 {
    let stats = target.tenants.stats().into_iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no tenant {name}")).1;
    stats.io_scheduled_bytes.load(std::sync::atomic::Ordering::Relaxed)
}

/// Runs sha256 over the whole namespace as `host`, one command after another, until `end`
/// (at least one).
async fn offloader(addr: SocketAddr, host: &str, end: Instant) {
    use nearstore_wire::compute::{Descriptor, Extent, Object};
    let mut o = ConnectOptions::new(addr, NQN);
    o.hostnqn = host.into();
    let c = Controller::connect(o).await.unwrap();
    let mut q = c.io_queue(1).await.unwrap();
    let len = 16 << 20;
    let sha = nearstore_compute::by_name("sha256").unwrap().id;
    let d = Descriptor { op: sha, args: vec![], inputs: vec![Object { len, extents: vec![Extent::data(0, len)] }], outputs: vec![] };
    loop {
        q.compute(1, &d.encode(), Duration::from_secs(60)).await.unwrap();
        if Instant::now() >= end {
            return;
        }
    }
}

/// The offload engine's reads are the share of the command's tenant, at its `io_weight`,
/// not the target's own at the default weight: one sha256 over the namespace is charged to
/// its tenant exactly; then a tenant of weight 300 offloading on two controllers against
/// one of weight 100 reading at queue depth 16 gets three quarters of the bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_offloaded_reads_are_its_share() {
    let (target, addr) = start(true, Some((100, 300))).await;
    let before = scheduled(&target, "light");
    offloader(addr, LIGHT, Instant::now()).await;
    assert_eq!(scheduled(&target, "light") - before, 16 << 20, "one command's reads charged to its tenant");
    let t0 = Instant::now();
    let (from, end) = (t0 + Duration::from_millis(500), t0 + Duration::from_millis(2500));
    let sample = |at: Instant| {
        let target = target.clone();
        async move {
            tokio::time::sleep_until(at).await;
            (scheduled(&target, "heavy"), scheduled(&target, "light"))
        }
    };
    let (_, _, _, a, b) = tokio::join!(
        reader(addr, HEAVY, 16, from, end),
        offloader(addr, LIGHT, end),
        offloader(addr, LIGHT, end),
        sample(from),
        sample(end)
    );
    let (heavy, light) = (b.0 - a.0, b.1 - a.1);
    let share = light as f64 / (heavy + light) as f64;
    let case = format!("reader {heavy} bytes, offloader {light} bytes: the offloader's share {share:.3}");
    eprintln!("{case}");
    assert!((share - 0.75).abs() <= 0.05, "{case}, wanted 0.75");
    assert!((heavy + light) as f64 >= 0.8 * RATE as f64 * 2.0, "{case}: the device stays busy");
    assert_eq!(target.stats.requests_lost.load(std::sync::atomic::Ordering::Relaxed), 0);
}

/// The metrics endpoint's text.
async fn metrics_text(target: &std::sync::Arc<Target>) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = listener.local_addr().unwrap();
    let server = tokio::spawn(nearstore_target::metrics::serve(listener, target.clone()));
    let mut sock = tokio::net::TcpStream::connect(at).await.unwrap();
    sock.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").await.unwrap();
    let mut text = String::new();
    sock.read_to_string(&mut text).await.unwrap();
    server.abort();
    text
}

/// Reads `n` times `READ` bytes at queue depth `qd` as `host`.
async fn read_n(addr: SocketAddr, host: &str, qd: u16, n: u64) {
    let mut o = ConnectOptions::new(addr, NQN);
    o.hostnqn = host.into();
    o.queue_depth = qd.max(2);
    let c = Controller::connect(o).await.unwrap();
    let mut ioq = c.io_queue(1).await.unwrap();
    let q = ioq.queue();
    let blocks = READ / 4096;
    let (mut sent, mut done) = (0u64, 0u64);
    while done < n {
        while sent < n && q.in_flight() < qd as usize {
            q.submit(Sqe::rw(io::READ, 1, sent * blocks as u64 % (16 << 20 >> 12), blocks, false), Data::In(READ as usize), 0).unwrap();
            sent += 1;
        }
        q.poll(|_, cqe, _| {
            assert!(cqe.status.is_success(), "{}", cqe.status);
            done += 1;
        })
        .await
        .unwrap();
    }
}

/// Per tenant, the metrics endpoint shows its I/O commands and bytes, what the fair
/// scheduler let go for it, how often and how long it held the tenant's reads back, and
/// its compute commands' bytes: two tenants reading at once past the namespace's bandwidth
/// both wait; one then offloads a sha256 of the namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_show_each_tenants_io_and_its_queueing() {
    let (target, addr) = start(true, Some((200, 100))).await;
    const N: u64 = 256;
    tokio::join!(read_n(addr, HEAVY, 16, N), read_n(addr, LIGHT, 16, N));
    offloader(addr, LIGHT, Instant::now()).await;
    let text = metrics_text(&target).await;
    let value = |name: &str, tenant: &str| -> u64 {
        let prefix = format!("{name}{{tenant=\"{tenant}\"}} ");
        let line = text.lines().find_map(|l| l.strip_prefix(&prefix)).unwrap_or_else(|| panic!("no {prefix}"));
        line.parse().unwrap()
    };
    let whole = 16u64 << 20;
    // (series, tenant, value wanted; None: more than zero).
    let cases: &[(&str, &str, Option<u64>)] = &[
        ("nearstore_tenant_reads_total", "heavy", Some(N)),
        ("nearstore_tenant_read_bytes_total", "heavy", Some(N * READ as u64)),
        ("nearstore_tenant_io_scheduled_bytes_total", "heavy", Some(N * READ as u64)),
        ("nearstore_tenant_io_waits_total", "heavy", None),
        ("nearstore_tenant_io_queued_nanoseconds_total", "heavy", None),
        ("nearstore_tenant_compute_read_bytes_total", "heavy", Some(0)),
        ("nearstore_tenant_reads_total", "light", Some(N)),
        ("nearstore_tenant_io_scheduled_bytes_total", "light", Some(N * READ as u64 + whole)),
        ("nearstore_tenant_io_waits_total", "light", None),
        ("nearstore_tenant_io_queued_nanoseconds_total", "light", None),
        ("nearstore_tenant_compute_read_bytes_total", "light", Some(whole)),
        ("nearstore_tenant_compute_written_bytes_total", "light", Some(0)),
        ("nearstore_tenant_compute_cpu_nanoseconds_total", "light", None),
        ("nearstore_tenant_compute_queued_nanoseconds_total", "light", None),
        ("nearstore_tenant_offload_memory_bytes", "light", Some(0)),
        ("nearstore_tenant_io_scheduled_bytes_total", "default", Some(0)),
    ];
    for &(name, tenant, want) in cases {
        let got = value(name, tenant);
        match want {
            Some(w) => assert_eq!(got, w, "{name} of {tenant}"),
            None => assert!(got > 0, "{name} of {tenant} is {got}"),
        }
    }
}
