//! The control plane as real processes: `nearstore control` and targets with pools, on
//! loopback with ports the kernel chose. The API's error paths, restart durability, target
//! registration and views, and the volume verbs (docs/control-plane.md).

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{fails, ok, Control, Target};
use nearstore_control::client::Client;
use nearstore_control::limits::{BODY_BYTES_MAX, EXTENTS_PER_VOLUME_MAX};
use nearstore_control::model::*;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

const MIB: u64 = 1 << 20;

/// Waits (10 s at most) until the control plane's view has `pools` pools with a view.
fn wait_for_views(c: &Client, pools: usize) -> ClusterView {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = rt().block_on(c.view(0)).expect("view");
        if v.pools.iter().filter(|p| p.view.is_some()).count() >= pools {
            return v;
        }
        assert!(Instant::now() < deadline, "the targets' views did not arrive: {v:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A file holding `text`, of `mode`.
fn file_of_mode(path: &Path, text: &str, mode: u32) -> String {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).expect("write");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    path.to_str().expect("path").to_string()
}

/// A control plane started with --token-file takes a request only with its token: verbs
/// without one, or with another, are refused (unauthorized, saying which); with it from
/// --control-token-file or $NEARSTORE_CONTROL_TOKEN_FILE they run, and so do a target's
/// registration and views with the token in its environment. GET /v1/health needs none.
/// Token files others may read, and tokens too short, are refused before anything starts.
#[test]
fn a_control_plane_with_a_token_takes_requests_with_it_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let token = "0123456789abcdef-a-control-token";
    let good = file_of_mode(&d.join("token"), &format!("{token}\n"), 0o600);
    let wrong = file_of_mode(&d.join("wrong"), "0123456789abcdef-another-token\n", 0o400);
    let loose = file_of_mode(&d.join("loose"), &format!("{token}\n"), 0o644);
    let short = file_of_mode(&d.join("short"), "tooshort\n", 0o600);
    let store = d.join("store");
    for (file, says) in [(&loose, "chmod 600"), (&short, "at least 16 printable")] {
        let (_, e) = fails(&["control", "--store", store.to_str().expect("path"), "--listen", "127.0.0.1:0", "--token-file", file]);
        assert!(e.contains(says), "{file}: {e}");
    }
    let cp = Control::start_with(&store, "127.0.0.1:0", &["--token-file", &good]);
    let a = cp.a();
    let rt = rt();
    let health = rt.block_on(cp.client().raw("GET".parse().expect("method"), "/v1/health", Vec::new())).expect("health");
    assert_eq!(health.status, 200, "health needs no token");
    let (_, e) = fails(&["volume", "list", "--control", &a]);
    assert!(e.contains("no control token"), "{e}");
    let (_, e) = fails(&["volume", "list", "--control", &a, "--control-token-file", &wrong]);
    assert!(e.contains("a wrong control token"), "{e}");
    let (_, e) = fails(&["volume", "list", "--control", &a, "--control-token-file", &loose]);
    assert!(e.contains("chmod 600"), "{e}");
    ok(&["volume", "create", "tv", "--size", "1MiB", "--extent-size", "1MiB", "--control", &a, "--control-token-file", &good]);
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_nearstore"))
        .args(["volume", "list", "--control", &a, "-o", "json"])
        .env("NEARSTORE_CONTROL_TOKEN_FILE", &good)
        .output()
        .expect("volume list");
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("\"tv\""), "{o:?}");
    // A target with the token in its environment registers its pool and pushes views.
    let pool = format!("{}:8MiB", d.join("p0").display());
    let _t = Target::start_env(&["--memory", "1MiB", "--control", &a, "--pool", &pool], &[("NEARSTORE_CONTROL_TOKEN_FILE", &good)]);
    wait_for_views(&cp.client().with_token(Some(token.into())), 1);
    // The raw API says 401 and the code.
    let r = rt.block_on(cp.client().raw("GET".parse().expect("method"), "/v1/volumes", Vec::new())).expect("reply");
    assert_eq!(r.status, 401);
    let body: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
    assert_eq!(body["error"]["code"], "unauthorized", "{body}");
}

/// Every error path of the API: each request, the HTTP status and the error code.
#[test]
fn api_error_paths() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = Control::start(&dir.path().join("store"));
    let c = cp.client();
    let rt = rt();
    rt.block_on(c.create_volume(&CreateVolume { name: "v".into(), size: 4 * MIB, extent_size: Some(MIB) })).expect("v");
    let big = format!(r#"{{"name":"w","size":1,"pad":"{}"}}"#, "x".repeat(BODY_BYTES_MAX));
    let over = format!(r#"{{"name":"w","size":{},"extent_size":{MIB}}}"#, (EXTENTS_PER_VOLUME_MAX + 1) * MIB);
    #[rustfmt::skip]
    let cases: Vec<(&str, &str, String, u16, Option<&str>)> = vec![
        ("GET", "/v1/health", String::new(), 200, None),
        ("GET", "/v1/volumes/nope", String::new(), 404, Some("volume_not_found")),
        ("DELETE", "/v1/volumes/nope", String::new(), 404, Some("volume_not_found")),
        ("POST", "/v1/volumes/nope/grow", r#"{"size":8388608}"#.into(), 404, Some("volume_not_found")),
        ("POST", "/v1/volumes/nope/extents/0/allocate", String::new(), 404, Some("volume_not_found")),
        ("POST", "/v1/volumes", r#"{"name":"v","size":4194304,"extent_size":1048576}"#.into(), 409, Some("volume_exists")),
        ("POST", "/v1/volumes", r#"{"name":"w","size":0,"extent_size":1048576}"#.into(), 400, Some("invalid_argument")),
        ("POST", "/v1/volumes", r#"{"name":"w","size":1572864,"extent_size":1048576}"#.into(), 400, Some("invalid_argument")),
        ("POST", "/v1/volumes", r#"{"name":"w","size":1048576,"extent_size":4096}"#.into(), 400, Some("invalid_argument")),
        ("POST", "/v1/volumes", over, 400, Some("limit_exceeded")),
        ("POST", "/v1/volumes", r#"{"name":"a b","size":1048576,"extent_size":1048576}"#.into(), 400, Some("invalid_argument")),
        ("POST", "/v1/volumes/v/grow", r#"{"size":2097152}"#.into(), 400, Some("shrink_refused")),
        ("POST", "/v1/volumes/v/grow", r#"{"size":4194304}"#.into(), 400, Some("shrink_refused")),
        ("POST", "/v1/volumes/v/extents/4/allocate", String::new(), 400, Some("extent_out_of_range")),
        ("POST", "/v1/volumes/v/extents/x/allocate", String::new(), 400, Some("invalid_argument")),
        // No pools registered yet: nowhere to put an extent.
        ("POST", "/v1/volumes/v/extents/0/allocate", String::new(), 507, Some("no_space")),
        ("POST", "/v1/volumes", r#"{"name":"w","size":"#.into(), 400, Some("malformed_request")),
        ("POST", "/v1/volumes", r#"{"name":"w"}"#.into(), 400, Some("malformed_request")),
        ("POST", "/v1/volumes", r#"{"name":"w","size":1048576,"colour":1}"#.into(), 400, Some("malformed_request")),
        ("POST", "/v1/volumes", r#"{"name":"w","size":-1}"#.into(), 400, Some("malformed_request")),
        ("POST", "/v1/volumes", big, 413, Some("body_too_large")),
        ("POST", "/v1/targets", r#"{"addr":"127.0.0.1:1","nqn":"nqn.x","pools":[{"name":"p","path":"/p","size":1}]}"#.into(), 400, Some("invalid_argument")),
        ("PUT", "/v1/pools/127.0.0.1:1/p/view", r#"{"seq":1,"figures":{"fs_free_bytes":0,"read_bps":0,"write_bps":0,"read_iops":0,"write_iops":0,"read_latency_us":0,"write_latency_us":0,"queue_depth":0,"write_cost_us_per_mib":0}}"#.into(), 404, Some("pool_not_found")),
        ("GET", "/v1/view?since=x", String::new(), 400, Some("invalid_argument")),
        // The translation service.
        ("GET", "/v1/volumes/v/extents/0", String::new(), 200, None),
        ("GET", "/v1/volumes/v/extents/4", String::new(), 400, Some("extent_out_of_range")),
        ("GET", "/v1/volumes/v/extents/x", String::new(), 400, Some("invalid_argument")),
        ("GET", "/v1/volumes/nope/extents/0", String::new(), 404, Some("volume_not_found")),
        // Exports (an exported volume's delete, refused with volume_exported, and an export to
        // a second target are driven in tests/volume.rs, which has targets).
        ("PUT", "/v1/volumes/v/export", r#"{"target":"127.0.0.1:1","hosts":["nqn.h"]}"#.into(), 404, Some("target_not_found")),
        ("PUT", "/v1/volumes/nope/export", r#"{"target":"127.0.0.1:1","hosts":["nqn.h"]}"#.into(), 404, Some("volume_not_found")),
        ("PUT", "/v1/volumes/v/export", r#"{"target":"127.0.0.1:1","colour":1}"#.into(), 400, Some("malformed_request")),
        ("DELETE", "/v1/volumes/nope/export", String::new(), 404, Some("volume_not_found")),
        ("DELETE", "/v1/volumes/v/export", String::new(), 204, None),
        ("GET", "/v1/exports", String::new(), 400, Some("invalid_argument")),
        ("GET", "/v1/exports?target=127.0.0.1:1&since=x", String::new(), 400, Some("invalid_argument")),
        // A process of a target that is not its registered one (none is: not registered).
        ("GET", "/v1/exports?target=127.0.0.1:1&incarnation=5", String::new(), 409, Some("stale_incarnation")),
        ("GET", "/v1/exports?target=127.0.0.1:1&incarnation=0", String::new(), 200, None),
        ("POST", "/v1/targets/fenced", r#"{"target":"127.0.0.1:1","incarnation":5}"#.into(), 204, None),
        ("POST", "/v1/targets/fenced", r#"{"target":"127.0.0.1:1"}"#.into(), 400, Some("malformed_request")),
        ("GET", "/v2/volumes", String::new(), 404, Some("no_such_endpoint")),
        ("PATCH", "/v1/volumes", String::new(), 404, Some("no_such_endpoint")),
    ];
    for (method, path, body, status, code) in cases {
        let r = rt.block_on(c.raw(method.parse().expect("method"), path, body.into_bytes())).expect("reply");
        assert_eq!(r.status, status, "{method} {path}: {}", String::from_utf8_lossy(&r.body));
        if let Some(code) = code {
            let e: ErrorBody =
                serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("{method} {path}: not an error body ({e}): {:?}", r.body));
            assert_eq!(e.error.code.to_string(), code, "{method} {path}: {}", e.error.message);
            assert!(!e.error.message.is_empty());
        }
    }
    // Nothing of the refused requests changed anything.
    let vs = rt.block_on(c.volumes()).expect("list");
    assert_eq!(vs.iter().map(|v| (v.name.as_str(), v.size)).collect::<Vec<_>>(), vec![("v", 4 * MIB)]);
}

/// Volumes, pools and extents survive a kill -9 of the control plane.
#[test]
fn a_killed_control_plane_loses_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("store");
    let cp = Control::start(&store);
    let t = Target::start(&["--memory", "1MiB", "--control", &cp.a(), "--pool", &format!("{}:64MiB", dir.path().join("p0").display())]);
    let c = cp.client();
    wait_for_views(&c, 1);
    let rt = rt();
    for (name, size) in [("a", 8 * MIB), ("b", 16 * MIB)] {
        rt.block_on(c.create_volume(&CreateVolume { name: name.into(), size, extent_size: Some(MIB) })).expect("create");
    }
    for i in [0, 5, 7] {
        rt.block_on(c.allocate("a", i)).expect("allocate");
    }
    rt.block_on(c.grow_volume("b", 32 * MIB)).expect("grow");
    let before = (rt.block_on(c.volume("a")).expect("a"), rt.block_on(c.volume("b")).expect("b"), rt.block_on(c.view(0)).expect("view"));
    cp.kill();
    drop(t);
    let cp = Control::start(&store);
    let c = cp.client();
    let after = (rt.block_on(c.volume("a")).expect("a"), rt.block_on(c.volume("b")).expect("b"), rt.block_on(c.view(0)).expect("view"));
    assert_eq!(after.0, before.0);
    assert_eq!(after.1, before.1);
    assert_eq!(after.0.extents.iter().map(|e| e.index).collect::<Vec<_>>(), vec![0, 5, 7]);
    assert_eq!(after.1.volume.size, 32 * MIB);
    assert_eq!((after.2.version, after.2.targets, after.2.pools.len()), (before.2.version, before.2.targets, 1));
    // Allocation goes on from the books it had: no extent is placed twice.
    let e = rt.block_on(c.allocate("a", 1)).expect("allocate");
    assert!(!after.0.extents.iter().any(|x| x.offset == e.offset), "{e:?} overlaps {:?}", after.0.extents);
}

/// Targets register their pools and push views; a restarted target goes on above its last
/// seq; `nearstore view` shows them.
#[test]
fn targets_register_pools_and_push_views() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = Control::start(&dir.path().join("store"));
    let p = |n: &str, s: &str| format!("{}:{s}", dir.path().join(n).display());
    let t1 = Target::start(&["--memory", "1MiB", "--control", &cp.a(), "--pool", &p("a0", "64MiB"), "--pool", &p("a1", "32MiB")]);
    let t2 = Target::start(&["--memory", "1MiB", "--control", &cp.a(), "--pool", &p("b0", "64MiB")]);
    let c = cp.client();
    let v = wait_for_views(&c, 3);
    let mut got: Vec<(String, String, u64)> = v.pools.iter().map(|p| (p.target.clone(), p.pool.clone(), p.size)).collect();
    got.sort();
    let mut want = vec![
        (t1.addr.to_string(), "a0".to_string(), 64 * MIB),
        (t1.addr.to_string(), "a1".into(), 32 * MIB),
        (t2.addr.to_string(), "b0".into(), 64 * MIB),
    ];
    want.sort();
    assert_eq!(got, want);
    assert_eq!(std::fs::metadata(dir.path().join("a1")).expect("pool file").len(), 32 * MIB);
    // Versions are distinct and the view's is the largest.
    let mut versions: Vec<u64> = v.pools.iter().filter_map(|p| p.view.as_ref().map(|w| w.version)).collect();
    versions.sort();
    versions.dedup();
    assert_eq!(versions.len(), 3);
    assert_eq!(v.version, *versions.last().expect("a version"));
    assert!(v.pools.iter().all(|p| !p.stale && p.view.as_ref().is_some_and(|w| w.figures.fs_free_bytes > 0)));
    // The CLI shows the same.
    let shown: ClusterView = serde_json::from_str(&ok(&["view", "--control", &cp.a(), "-o", "json"])).expect("view json");
    assert_eq!(shown.pools.len(), 3);
    let text = ok(&["view", "--control", &cp.a()]);
    assert!(text.contains("a0") && text.contains("b0") && text.contains(&t2.addr.to_string()), "{text}");
    // A volume spreads over both targets.
    let rt = rt();
    rt.block_on(c.create_volume(&CreateVolume { name: "v".into(), size: 4 * MIB, extent_size: Some(MIB) })).expect("create");
    let targets: std::collections::BTreeSet<String> = (0..2).map(|i| rt.block_on(c.allocate("v", i)).expect("allocate").target).collect();
    assert_eq!(targets.len(), 2, "{targets:?}");
    // t2 restarts on another port, same pool file: it registers anew with a seq above nothing
    // (a new address is a new target), and t1's pools are untouched.
    let before = v.version;
    drop(t2);
    let _t2 = Target::start(&["--memory", "1MiB", "--control", &cp.a(), "--pool", &p("b0", "64MiB")]);
    let v = wait_for_views(&c, 4);
    assert!(v.version > before);
}

/// A target started before its control plane registers once the control plane is up.
#[test]
fn a_target_waits_for_its_control_plane() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Take a free port, then free it for the control plane to come.
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let control = format!("127.0.0.1:{port}");
    let _t = Target::start(&["--memory", "1MiB", "--control", &control, "--pool", &format!("{}:8MiB", dir.path().join("p").display())]);
    std::thread::sleep(Duration::from_millis(300));
    let mut cp = Command::new(env!("CARGO_BIN_EXE_nearstore"))
        .args(["control", "--listen", &control, "--store"])
        .arg(dir.path().join("store"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("control");
    let addr: SocketAddr = control.parse().expect("addr");
    let deadline = Instant::now() + Duration::from_secs(15);
    let registered = loop {
        if let Ok(v) = rt().block_on(Client::new(addr).view(0)) {
            if !v.pools.is_empty() {
                break true;
            }
        }
        if Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = cp.kill();
    let _ = cp.wait();
    assert!(registered, "the target did not register with a control plane that came late");
}

/// The volume verbs, with --control and NEARSTORE_CONTROL, text and JSON, and their errors.
#[test]
fn volume_verbs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = Control::start(&dir.path().join("store"));
    let _t = Target::start(&["--memory", "1MiB", "--control", &cp.a(), "--pool", &format!("{}:64MiB", dir.path().join("p0").display())]);
    wait_for_views(&cp.client(), 1);
    let a = cp.a();
    let out = ok(&["volume", "create", "v", "--size", "64MiB", "--extent-size", "4MiB", "--control", &a]);
    assert_eq!(out.trim(), "volume v: 64MiB in 16 extents of 4MiB");
    let v: Volume = serde_json::from_str(&ok(&["volume", "create", "w", "--size", "128MiB", "--control", &a, "-o", "json"])).expect("json");
    assert_eq!((v.size, v.extent_size), (128 * MIB, 64 * MIB));
    rt().block_on(cp.client().allocate("v", 2)).expect("allocate");
    let info = ok(&["volume", "info", "v", "--control", &a]);
    let lines: Vec<&str> = info.lines().collect();
    assert_eq!(lines[0], "volume v: 64MiB, extents of 4MiB, 1 of 16 allocated");
    assert_eq!(lines[1].trim(), "0  to 1  unallocated");
    assert!(lines[2].contains("p0@") && lines[2].contains(&format!("{} +0", dir.path().join("p0").display())), "{info}");
    assert_eq!(lines[3].trim(), "3  to 15  unallocated");
    // NEARSTORE_CONTROL instead of --control.
    let o = Command::new(env!("CARGO_BIN_EXE_nearstore"))
        .args(["volume", "list", "-o", "json"])
        .env("NEARSTORE_CONTROL", &a)
        .output()
        .expect("list");
    let vs: Vec<Volume> = serde_json::from_slice(&o.stdout).expect("list json");
    assert_eq!(vs.iter().map(|v| v.name.as_str()).collect::<Vec<_>>(), vec!["v", "w"]);
    ok(&["volume", "grow", "v", "--size", "128MiB", "--control", &a]);
    let info: VolumeInfo = serde_json::from_str(&ok(&["volume", "info", "v", "--control", &a, "-o", "json"])).expect("info json");
    assert_eq!((info.extents_total, info.extents_allocated), (32, 1));
    ok(&["volume", "delete", "v", "--control", &a]);
    let (_, err) = fails(&["volume", "info", "v", "--control", &a]);
    assert_eq!(err.trim(), "error: no volume 'v'");
    let (_, err) = fails(&["volume", "grow", "w", "--size", "64MiB", "--control", &a, "-o", "json"]);
    let e: serde_json::Value = serde_json::from_str(err.trim()).expect("json error");
    assert_eq!(e["status"], "shrink_refused");
    let (_, err) = fails(&["volume", "create", "w", "--size", "64MiB", "--control", &a, "-v"]);
    assert!(err.contains("volume 'w' exists") && err.contains("(volume_exists)"), "{err}");
    // No control plane there: a clear error, not a hang.
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let (_, err) = fails(&["volume", "list", "--control", &format!("127.0.0.1:{port}")]);
    assert!(err.contains("connecting"), "{err}");
}

/// An export lease that a leader's failover outlasts would stop every volume at each
/// failover: refused at start, before anything is reached; one out of range is a usage
/// error.
#[test]
fn an_export_lease_shorter_than_a_failover_is_refused() {
    let (_, err) = fails(&["control", "--etcd", "http://127.0.0.1:1", "--lease-ttl", "10", "--export-lease-ms", "30000"]);
    assert!(err.contains("--export-lease-ms 30000: at least 45001 with --lease-ttl 10"), "{err}");
    let o = common::nearstore(&["control", "--store", "/nonexistent/x", "--export-lease-ms", "999"]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("999"), "{o:?}");
}
