//! Running the `nearstore-lab` binary from its tests, and the product's `nearstore` beside
//! it (the testbed's targets and a sort across them run it).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
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
/// --workspace` builds it; a test of this crate alone needs `cargo build -p nearstore`
/// first, and again whenever a source of the product changed: an older binary fails here
/// rather than testing stale code.
pub fn product() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_BIN_EXE_nearstore-lab")).with_file_name("nearstore");
    assert!(p.is_file(), "{} is missing: build the product first (cargo build -p nearstore)", p.display());
    if let Some(newer) = newer_source(&p, &product_sources()) {
        panic!("{} is older than {}: build the product again (cargo build -p nearstore)", p.display(), newer.display());
    }
    p
}

/// The files the product is built from: crates/cli and the workspace's library crates
/// (the `path` dependencies of the root Cargo.toml), their sources and manifests.
pub fn product_sources() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("the workspace root");
    let manifest: toml::Table = std::fs::read_to_string(root.join("Cargo.toml")).expect("reading Cargo.toml").parse().expect("Cargo.toml");
    let deps = manifest.get("workspace").and_then(|w| w.get("dependencies")).and_then(|d| d.as_table()).expect("[workspace.dependencies]");
    let mut dirs = vec![root.join("crates/cli")];
    dirs.extend(deps.values().filter_map(|d| d.get("path")?.as_str()).map(|p| root.join(p)));
    let mut files = Vec::new();
    for dir in dirs {
        files.push(dir.join("Cargo.toml"));
        walk(&dir.join("src"), &mut files);
    }
    files
}

fn walk(dir: &Path, files: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())) {
        let path = e.expect("a directory entry").path();
        if path.is_dir() {
            walk(&path, files);
        } else {
            files.push(path);
        }
    }
}

/// The first of `sources` modified after `bin`, if any.
pub fn newer_source(bin: &Path, sources: &[PathBuf]) -> Option<PathBuf> {
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let built = modified(bin);
    sources.iter().find(|s| modified(s) > built).cloned()
}

pub fn nearstore(args: &[&str]) -> Output {
    Command::new(product()).args(args).output().expect("running nearstore")
}
