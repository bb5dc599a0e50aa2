//! Running the `nearstore` binary from the CLI tests.

use std::process::{Command, Output};

pub fn nearstore(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nearstore")).args(args).output().expect("running nearstore")
}

/// Runs it, requires success, returns stdout.
pub fn ok(args: &[&str]) -> String {
    let o = nearstore(args);
    assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}
