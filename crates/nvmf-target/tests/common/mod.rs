//! Shared set-up: a target on a free loopback port with a memory and a file namespace.
#![allow(dead_code)]

pub mod proxy;

use std::net::SocketAddr;
use std::sync::Arc;

use nearstore_initiator::{ConnectOptions, Controller};
use nearstore_target::config::Config;
use nearstore_target::Target;

pub const NQN: &str = "nqn.2026-11.io.nearstore:test";
pub const ALLOWED_NQN: &str = "nqn.2026-11.io.nearstore:restricted";
pub const GOOD_HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001";

pub struct Env {
    pub target: Arc<Target>,
    pub addr: SocketAddr,
    pub disc: SocketAddr,
    pub dir: tempfile::TempDir,
}

pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
        .with_test_writer()
        .try_init();
}

pub async fn start() -> Env {
    init_logs();
    let dir = tempfile::tempdir().unwrap();
    let cfg = format!(
        r#"
        io_threads = 2
        [[listener]]
        address = "127.0.0.1:0"
        [[subsystem]]
        nqn = "{NQN}"
        allow_any_host = true
        [[subsystem.namespace]]
        nsid = 1
        memory = "64MiB"
        [[subsystem.namespace]]
        nsid = 2
        path = "{}/disk.img"
        size = "64MiB"
        block_size = 4096
        [[subsystem]]
        nqn = "{ALLOWED_NQN}"
        hosts = ["{GOOD_HOST}"]
        [[subsystem.namespace]]
        nsid = 1
        memory = "1MiB"
        "#,
        dir.path().display()
    );
    let cfg = Config::from_toml(&cfg).unwrap();
    let target = Target::from_config(&cfg).unwrap();
    let addr = target.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    let disc = target.listen("127.0.0.1:0".parse().unwrap(), true).await.unwrap();
    Env { target, addr, disc, dir }
}

impl Env {
    pub fn opts(&self) -> ConnectOptions {
        let mut o = ConnectOptions::new(self.addr, NQN);
        o.hostnqn = GOOD_HOST.into();
        o
    }

    pub async fn connect(&self) -> Controller {
        Controller::connect(self.opts()).await.unwrap()
    }
}
