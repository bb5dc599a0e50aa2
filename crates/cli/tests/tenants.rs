//! Tenants reloaded by SIGHUP (docs/operations.md, "Tenants"): a host removed from its
//! tenant in the configuration file loses its controller and cannot connect again; the
//! tenant's other host goes on. Tenants of the control plane (`nearstore tenant`): kept
//! across its restart, pushed to a registered target, which applies them beside its
//! configured ones (a conflict refused), on its subsystems and its exported volumes.

mod common;

use std::time::{Duration, Instant};

use common::Target;
use nearstore_initiator::{ConnectOptions, Controller, Error};
use nearstore_wire::Status;

const NQN: &str = "nqn.2026-11.io.nearstore:tenants";
const H1: &str = "nqn.2014-08.org.nvmexpress:uuid:tenant-h1";
const H2: &str = "nqn.2014-08.org.nvmexpress:uuid:tenant-h2";

/// The configuration with tenant `t` holding `hosts`.
fn config(hosts: &[&str]) -> String {
    let hosts: Vec<String> = hosts.iter().map(|h| format!("\"{h}\"")).collect();
    format!(
        "[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n\
         [[subsystem.namespace]]\nnsid = 1\nmemory = \"1MiB\"\n\
         [[tenant]]\nname = \"t\"\nhosts = [{}]\n[[tenant.reach]]\nsubsystem = \"{NQN}\"\n",
        hosts.join(", ")
    )
}

fn opts(t: &Target, host: &str) -> ConnectOptions {
    let mut o = ConnectOptions::new(t.addr, NQN);
    o.hostnqn = host.into();
    o
}

#[tokio::test]
async fn sighup_reloads_the_tenants() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("target.toml");
    std::fs::write(&file, config(&[H1, H2])).unwrap();
    let t = Target::start(&["--config", file.to_str().unwrap()]);
    let c1 = Controller::connect(opts(&t, H1)).await.unwrap();
    let c2 = Controller::connect(opts(&t, H2)).await.unwrap();
    let (mut q1, mut q2) = (c1.io_queue(1).await.unwrap(), c2.io_queue(1).await.unwrap());
    let block = vec![9u8; 512];
    q1.write(1, 0, &block, 512, false).await.unwrap();

    std::fs::write(&file, config(&[H2])).unwrap();
    let kill = std::process::Command::new("kill").args(["-HUP", &t.pid().to_string()]).status().expect("running kill");
    assert!(kill.success());
    // Its next command after the reload fails: refused, or its queue closed.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match q1.write(1, 0, &block, 512, false).await {
            Ok(()) => assert!(Instant::now() < deadline, "host 1 still writes 30 s after SIGHUP"),
            Err(Error::Status { status, .. }) => {
                assert_eq!(status, Status::ACCESS_DENIED.dnr());
                break;
            }
            Err(_) => break,
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    match Controller::connect(opts(&t, H1)).await {
        Err(Error::Status { status, .. }) => assert_eq!(status, Status::CONNECT_INVALID_HOST.dnr()),
        r => panic!("host 1 connects again: {:?}", r.map(drop)),
    }
    q2.write(1, 1, &block, 512, false).await.expect("host 2 goes on");
    assert_eq!(q2.read(1, 1, 1, 512).await.unwrap(), block);
}

/// Subsystems of the target beside NQN: the control plane may grant LISTED, not PRIVATE.
const LISTED: &str = "nqn.2026-11.io.nearstore:tenants-listed";
const PRIVATE: &str = "nqn.2026-11.io.nearstore:tenants-private";
const H3: &str = "nqn.2014-08.org.nvmexpress:uuid:tenant-h3";
const H4: &str = "nqn.2014-08.org.nvmexpress:uuid:tenant-h4";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port()
}

/// The metrics endpoint's text.
fn metrics(at: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(at).expect("metrics endpoint");
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").expect("request");
    let mut body = String::new();
    s.read_to_string(&mut body).expect("metrics");
    body
}

/// Waits (30 s at most) until the target's metrics hold `line`.
fn wait_for_metric(at: &str, line: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !metrics(at).lines().any(|l| l == line) {
        assert!(Instant::now() < deadline, "no '{line}' in the metrics after 30 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether `host` connects to `nqn`: None, or the status it is refused with.
fn refusal(addr: std::net::SocketAddr, nqn: &str, host: &str) -> Option<Status> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let mut o = ConnectOptions::new(addr, nqn);
    o.hostnqn = host.into();
    o.timeout = Duration::from_secs(5);
    match rt.block_on(Controller::connect(o)) {
        Ok(_) => None,
        Err(Error::Status { status, .. }) => Some(status),
        Err(e) => panic!("{host} to {nqn}: {e}"),
    }
}

/// The tenant verbs against a real control plane and a target registered with it:
/// create, list, info (text and JSON); refusals of an unknown tenant, a host in two
/// tenants, absurd weights, the pool subsystem; the tenants pushed to the target (their
/// weights on its metrics endpoint, their reach at Connect, on its own subsystems under
/// their host lists and on an exported volume), one that clashes with its configured
/// tenant and one naming a subsystem the control plane may not grant there refused; a
/// restart of the control plane keeping them; a delete taking effect on the target.
#[test]
fn tenants_of_the_control_plane_reach_the_targets() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("store");
    let cp = common::Control::start(&store);
    let control = cp.a();
    let m = format!("127.0.0.1:{}", free_port());
    let file = dir.path().join("target.toml");
    // Configured: tenant `local` holds H4 and reaches the subsystem, which the control
    // plane may grant, as it may LISTED, where only H2 is allowed; PRIVATE is not its.
    let configured = format!(
        "metrics = \"{m}\"\n{}[[subsystem]]\nnqn = \"{LISTED}\"\nhosts = [\"{H2}\"]\n[[subsystem.namespace]]\nnsid = 1\nmemory = \"1MiB\"\n\
         [[subsystem]]\nnqn = \"{PRIVATE}\"\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\nmemory = \"1MiB\"\n\
         [cluster]\ncontrol_grants = [\"{NQN}\", \"{LISTED}\"]\n",
        config(&[H4]).replace("name = \"t\"", "name = \"local\"")
    );
    std::fs::write(&file, configured).expect("config");
    let pool = format!("{}:64MiB", dir.path().join("p0").display());
    let t = Target::start(&["--config", file.to_str().expect("path"), "--control", &control, "--pool", &pool]);
    fn with<'a>(args: &[&'a str], control: &'a str) -> Vec<&'a str> {
        [args, &["--control", control]].concat()
    }
    let vol = "volume:v";
    common::ok(&with(
        &["tenant", "create", "gold", "--host", H1, "--io-weight", "300", "--reach", NQN, "--reach", vol, "--reach", LISTED],
        &control,
    ));
    common::ok(&with(
        &["tenant", "create", "silver", "--host", H2, "--compute-weight", "50", "--memory", "64MiB", "--reach", NQN, "--reach", LISTED],
        &control,
    ));
    // Refused by the control plane: each a request and the code it says.
    #[rustfmt::skip]
    let refusals: &[(&[&str], &str)] = &[
        (&["tenant", "info", "nope"], "tenant_not_found"),
        (&["tenant", "delete", "nope"], "tenant_not_found"),
        (&["tenant", "create", "gold", "--host", H3], "tenant_exists"),
        (&["tenant", "create", "bronze", "--host", H3, "--host", H1], "host_in_tenant"),
        (&["tenant", "create", "bronze", "--host", H3, "--io-weight", "0"], "invalid_argument"),
        (&["tenant", "create", "bronze", "--host", H3, "--compute-weight", "10001"], "invalid_argument"),
        (&["tenant", "create", "bronze", "--host", H3, "--reach", "disk0"], "invalid_argument"),
        (&["tenant", "create", "bronze", "--host", H3, "--reach", nearstore_control::model::POOLS_NQN], "invalid_argument"),
        (&["tenant", "create", "default", "--host", H3], "invalid_argument"),
    ];
    for (args, code) in refusals {
        // JSON errors carry the API's code.
        let (_, err) = common::fails(&[&with(args, &control)[..], &["-o", "json"]].concat());
        assert!(err.contains(&format!("\"status\":\"{code}\"")), "{args:?}: {err}");
    }
    // Accepted by the control plane, refused by the target: H4 is configured in `local`;
    // PRIVATE is not among the subsystems the target lets the control plane grant.
    common::ok(&with(&["tenant", "create", "clash", "--host", H4, "--reach", NQN], &control));
    common::ok(&with(&["tenant", "create", "grab", "--host", H3, "--reach", NQN, "--reach", PRIVATE], &control));
    let list = common::ok(&with(&["tenant", "list"], &control));
    for name in ["gold", "silver", "clash", "grab"] {
        assert!(list.lines().any(|l| l.starts_with(name)), "{name} in {list}");
    }
    let info: serde_json::Value =
        serde_json::from_str(&common::ok(&with(&["tenant", "info", "gold", "-o", "json"], &control))).expect("json");
    assert_eq!(info["io_weight"], 300);
    assert_eq!(info["hosts"], serde_json::json!([H1]));
    assert_eq!(info["reach"], serde_json::json!([NQN, vol, LISTED]));
    let silver: serde_json::Value =
        serde_json::from_str(&common::ok(&with(&["tenant", "info", "silver", "-o", "json"], &control))).expect("json");
    assert_eq!((silver["compute_weight"].clone(), silver["offload_memory"].clone()), (serde_json::json!(50), serde_json::json!(64 << 20)));
    // Pushed: the target installs gold and silver with their weights, refuses clash and grab.
    wait_for_metric(&m, "nearstore_tenant_io_weight{tenant=\"gold\"} 300");
    wait_for_metric(&m, "nearstore_tenant_compute_weight{tenant=\"silver\"} 50");
    wait_for_metric(&m, "nearstore_tenants_refused 2");
    for name in ["clash", "grab"] {
        assert!(!metrics(&m).contains(&format!("tenant=\"{name}\"")), "tenant {name} was installed");
    }
    let denied = Some(Status::CONNECT_INVALID_HOST.dnr());
    // An exported volume, open to every host named: each connects as its tenant allows.
    common::ok(&with(&["volume", "create", "v", "--size", "4MiB", "--extent-size", "1MiB"], &control));
    let hosts = [H1, H2, H3, H4].map(|h| ["--allow-host", h]).concat();
    common::ok(&with(&[&["volume", "export", "v", "--target", &t.addr.to_string()], &hosts[..]].concat(), &control));
    let v = "nqn.2026-11.io.nearstore:volume:v";
    let deadline = Instant::now() + Duration::from_secs(30);
    while refusal(t.addr, v, H1).is_some() {
        assert!(Instant::now() < deadline, "the volume was not exported to gold's host");
        std::thread::sleep(Duration::from_millis(100));
    }
    // (host, subsystem, refused with): H3 is in no tenant (grab was refused), H4 in the
    // configured one; LISTED's host list admits H2 only, whatever gold reaches; PRIVATE is
    // no pushed tenant's.
    #[rustfmt::skip]
    let cases = [
        (H1, NQN, None), (H2, NQN, None), (H3, NQN, denied), (H4, NQN, None), (H2, v, denied), (H3, v, denied), (H4, v, denied),
        (H1, LISTED, denied), (H2, LISTED, None), (H3, PRIVATE, denied), (H1, PRIVATE, denied), (H4, PRIVATE, denied),
    ];
    for (host, nqn, want) in cases {
        assert_eq!(refusal(t.addr, nqn, host), want, "{host} to {nqn}");
    }
    // A restart of the control plane keeps them, and the target keeps them meanwhile.
    let before = common::ok(&with(&["tenant", "list", "-o", "json"], &control));
    cp.kill();
    assert_eq!(refusal(t.addr, NQN, H1), None, "gold's host while the control plane is away");
    let cp = common::Control::start_on(&store, &control);
    assert_eq!(common::ok(&with(&["tenant", "list", "-o", "json"], &control)), before);
    // Deleted: gone from the target too.
    common::ok(&with(&["tenant", "delete", "silver"], &control));
    wait_for_metric(&m, "nearstore_tenant_io_weight{tenant=\"silver\"} 0");
    assert_eq!(refusal(t.addr, NQN, H2), denied);
    drop(cp);
}
