//! The control plane's arbiter (docs/fair-io.md, "The arbiter") as real processes: a control
//! plane, target A with a pool of a known bandwidth (a rate device under it, its `fair`
//! bandwidth declared), and target B with no pool. Tenant `heavy` (io_weight 300) reads a
//! volume exported by B, tenant `light` (io_weight 100) one exported by A; both volumes lie
//! in A's pool. A's pool scheduler sees B's reads as the one `cluster` tenant (weight 100),
//! so by itself it shares the pool 1:1; with the arbiter each exporter's gate holds its
//! tenant to the arbiter's grant, and the shares follow the tenants' weights, 3:1. When the
//! arbiter stops answering, the grants run out and the pool's own sharing takes over.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, metric, ok, Control, Target, MEMBERS};

const HEAVY: &str = "nqn.2014-08.org.nvmexpress:uuid:arbiter-heavy";
const LIGHT: &str = "nqn.2014-08.org.nvmexpress:uuid:arbiter-light";

/// Target `i` (member `MEMBERS[i]`, trusting A and B) with a metrics endpoint, the arbiter
/// on or off, and on A the pool: 32 MiB/s served, 28 MiB/s declared.
fn target(dir: &Path, i: usize, control: &str, arbiter: bool, metrics: SocketAddr) -> Target {
    let pool = if i == 0 {
        format!(
            "[[pool]]\npath = \"{}\"\nsize = \"64MiB\"\nrate_limit = \"32MiB\"\nfair = {{ bandwidth = \"28MiB\" }}\n",
            dir.join("p0").display()
        )
    } else {
        String::new()
    };
    let config: PathBuf = dir.join(format!("t{i}.toml"));
    std::fs::write(
        &config,
        format!(
            "control = \"{control}\"\nmetrics = \"{metrics}\"\n[[listener]]\naddress = \"127.0.0.1:0\"\n\
             [cluster]\nhost_nqn = \"{}\"\ntrusted_members = [\"{}\", \"{}\"]\n\
             [volume]\narbiter = {arbiter}\n{pool}",
            MEMBERS[i], MEMBERS[0], MEMBERS[1]
        ),
    )
    .expect("config");
    Target::start(&["--config", config.to_str().expect("path")])
}

/// `nearstore perf` as `host` on volume `v` of `t`.
fn perf(t: &Target, v: &str, host: &str, workload: &str, secs: u32) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_nearstore"));
    c.args(["perf", "-a", &t.addr.to_string(), "-n", &format!("nqn.2026-11.io.nearstore:volume:{v}"), "--hostnqn", host])
        .args(["-w", workload, "-z", "64KiB", "-q", "16", "-T", &secs.to_string(), "-o", "json"])
        .stdin(Stdio::null());
    c
}

fn mb_per_s(out: std::process::Output, who: &str) -> f64 {
    assert!(out.status.success(), "{who}: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{who}: {e}"));
    v["mb_per_s"].as_f64().unwrap_or_else(|| panic!("{who}: {v}"))
}

struct Setup {
    _dir: tempfile::TempDir,
    control: Control,
    a: Target,
    b: Target,
    metrics: [SocketAddr; 2],
}

/// The control plane, A and B, the tenants, both volumes written whole (a read of an
/// unwritten extent never reaches the pool).
fn setup(arbiter: bool) -> Setup {
    let dir = tempfile::tempdir().expect("tempdir");
    let control = Control::start(&dir.path().join("store"));
    let c = control.a();
    let metrics = [0, 1].map(|_| SocketAddr::from(([127, 0, 0, 1], free_port())));
    let a = target(dir.path(), 0, &c, arbiter, metrics[0]);
    let b = target(dir.path(), 1, &c, arbiter, metrics[1]);
    let with = |args: &[&str]| ok(&[args, &["--control", &c]].concat());
    let deadline = Instant::now() + Duration::from_secs(20);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    while rt.block_on(control.client().view(0)).map_or(0, |v| v.targets.len()) < 2 {
        assert!(Instant::now() < deadline, "the targets did not register");
        std::thread::sleep(Duration::from_millis(100));
    }
    with(&["tenant", "create", "heavy", "--host", HEAVY, "--io-weight", "300", "--reach", "volume:vh"]);
    with(&["tenant", "create", "light", "--host", LIGHT, "--io-weight", "100", "--reach", "volume:vl"]);
    for v in ["vh", "vl"] {
        with(&["volume", "create", v, "--size", "4MiB", "--extent-size", "1MiB"]);
    }
    with(&["volume", "export", "vh", "--target", &b.addr.to_string(), "--allow-host", HEAVY]);
    with(&["volume", "export", "vl", "--target", &a.addr.to_string(), "--allow-host", LIGHT]);
    let s = Setup { _dir: dir, control, a, b, metrics };
    // Written whole: sequential 64 KiB writes for a second cover 4 MiB many times over.
    for (t, v, host) in [(&s.b, "vh", HEAVY), (&s.a, "vl", LIGHT)] {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let out = perf(t, v, host, "write", 1).output().expect("perf");
            if out.status.success() {
                break;
            }
            assert!(Instant::now() < deadline, "{v} was not exported: {}", String::from_utf8_lossy(&out.stderr));
            std::thread::sleep(Duration::from_millis(200));
        }
        let info: serde_json::Value = serde_json::from_str(&with(&["volume", "info", v, "-o", "json"])).expect("json");
        assert_eq!(info["extents"].as_array().map(|e| e.len()), Some(4), "{v} written whole: {info}");
    }
    s
}

/// Both tenants reading for `secs` at once: heavy's share of what they read.
fn heavy_share(s: &Setup, secs: u32) -> (f64, f64) {
    shares(&s.b, &s.a, secs)
}

/// Heavy reading its volume on `b`, light its volume on `a`, for `secs` at once.
fn shares(b: &Target, a: &Target, secs: u32) -> (f64, f64) {
    let h = perf(b, "vh", HEAVY, "randread", secs).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("perf");
    let l = perf(a, "vl", LIGHT, "randread", secs).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("perf");
    let (h, l) = (mb_per_s(h.wait_with_output().expect("heavy"), "heavy"), mb_per_s(l.wait_with_output().expect("light"), "light"));
    eprintln!("heavy {h:.1} MB/s, light {l:.1} MB/s: heavy's share {:.3}", h / (h + l));
    (h / (h + l), h + l)
}

#[test]
fn the_arbiter_carries_the_tenants_weights_into_a_peers_pool() {
    // Without the arbiter: A's pool shares 1:1 between its own tenant and `cluster`.
    let off = setup(false);
    let (share, total) = heavy_share(&off, 3);
    assert!((0.4..0.6).contains(&share), "without the arbiter heavy's share is {share:.3}, not about 0.5");
    assert!(total > 20.0, "the pool served {total:.1} MB/s");
    assert_eq!(metric(off.metrics[1], "nearstore_arbiter_requests_total"), 0, "arbiter = false sends nothing");
    drop(off);
    // With it: 3:1.
    let on = setup(true);
    let (share, total) = heavy_share(&on, 4);
    assert!((0.67..0.83).contains(&share), "with the arbiter heavy's share is {share:.3}, not about 0.75");
    assert!(total > 20.0, "the pool served {total:.1} MB/s");
    for m in on.metrics {
        assert!(metric(m, "nearstore_arbiter_requests_total") > 0);
        assert_eq!(metric(m, "nearstore_arbiter_request_failures_total"), 0);
    }
    // Heavy's gate on B held its reads to its grant.
    assert!(metric(on.metrics[1], "nearstore_arbiter_held_total") > 0);
}

#[test]
fn the_pools_own_sharing_takes_over_when_the_arbiter_stops_answering() {
    let s = setup(true);
    let (share, _) = heavy_share(&s, 2);
    assert!(share > 0.65, "with the arbiter heavy's share is {share:.3}");
    let b = s.metrics[1];
    // The control plane dies while both read: nothing stalls, the grants run out, and A's
    // pool shares 1:1 again.
    let h = perf(&s.b, "vh", HEAVY, "randread", 4).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("perf");
    let l = perf(&s.a, "vl", LIGHT, "randread", 4).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("perf");
    std::thread::sleep(Duration::from_millis(500));
    assert!(metric(b, "nearstore_arbiter_grants") >= 1, "heavy holds a grant");
    let Setup { control, a, b: tb, metrics, _dir } = s;
    control.kill();
    let (h, l) = (mb_per_s(h.wait_with_output().expect("heavy"), "heavy"), mb_per_s(l.wait_with_output().expect("light"), "light"));
    assert!(h > 1.0 && l > 1.0, "both went on reading: heavy {h:.1}, light {l:.1} MB/s");
    for m in metrics {
        assert_eq!(metric(m, "nearstore_arbiter_grants"), 0, "every grant ran out");
        assert!(metric(m, "nearstore_arbiter_grants_expired_total") >= 1);
        assert!(metric(m, "nearstore_arbiter_request_failures_total") >= 1);
    }
    let (share, _) = shares(&tb, &a, 2);
    assert!((0.38..0.62).contains(&share), "after the arbiter went heavy's share is {share:.3}, not about 0.5");
}
