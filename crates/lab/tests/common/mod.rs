//! Running the `nearstore-lab` binary from its tests, and the product's `nearstore` beside
//! it (the testbed's targets and a sort across them run it).
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

pub fn lab(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nearstore-lab")).args(args).output().expect("running nearstore-lab")
}

/// Runs it, requires success, returns stdout.
pub fn ok(args: &[&str]) -> String {
    let o = lab(args);
    assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

/// Fails with exit status `status` (1 an error, 2 a usage error; never a panic's 101) and a
/// message containing `needle`.
pub fn refused(args: &[&str], status: i32, needle: &str) {
    let o = lab(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(status), "{args:?}: {err}");
    assert!(err.contains(needle), "{args:?}: {err:?} lacks {needle:?}");
}

/// The product's binary beside this one, as `nearstore-lab` finds it. `cargo test
/// --workspace` builds it; a test of this crate alone needs `cargo build -p nearstore` first.
pub fn product() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_BIN_EXE_nearstore-lab")).with_file_name("nearstore");
    assert!(p.is_file(), "{} is missing: build the product first (cargo build -p nearstore)", p.display());
    p
}

pub fn nearstore(args: &[&str]) -> Output {
    Command::new(product()).args(args).output().expect("running nearstore")
}
