//! Tenants reloaded by SIGHUP (docs/operations.md, "Tenants"): a host removed from its
//! tenant in the configuration file loses its controller and cannot connect again; the
//! tenant's other host goes on.

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
