//! The volume experiment (scripts/exp-volume.py), small: one volume over one and two targets
//! behind 1 Gbit/s links, exported by a target and by the client's own target, read and
//! written; the links' counters say where the bytes flowed; a rebalance under load moves
//! extents onto the second target. Then a run that fails after the testbed is up leaves
//! nothing behind. Needs root, `ip`, `tc`, loop devices and python3, as the testbed's test.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
mod common;

fn namespaces() -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.starts_with("nstb-")).map(String::from).collect()
}

fn experiment(dir: &Path, out: &Path, more: &[&str]) -> Output {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/exp-volume.py");
    let bin: PathBuf = common::product().parent().unwrap().into();
    let mut cmd = Command::new("python3");
    cmd.arg(script).arg("--bin").arg(bin).arg("--dir").arg(dir).arg("--out").arg(out);
    cmd.args(["--targets", "1,2", "--rates", "1gbit", "--secs", "1", "--volume-mib", "64", "--rebalance-mib", "64", "--before", "1"])
        .args(more)
        .output()
        .expect("running python3")
}

/// What a run leaves: nothing in its directory, no namespace, no testbed.
fn nothing_left(dir: &Path) {
    assert!(namespaces().is_empty(), "namespaces left: {:?}", namespaces());
    assert!(!Path::new("/run/nearstore-testbed.json").exists(), "the testbed is still up");
    let left: Vec<_> = std::fs::read_dir(dir).unwrap().collect();
    assert!(left.is_empty(), "left in {}: {left:?}", dir.display());
    assert!(!std::fs::read_to_string("/proc/mounts").unwrap().contains(dir.to_str().unwrap()), "mounts left");
}

#[test]
fn a_volume_over_two_targets_measured_rebalanced_and_cleaned_up() {
    assert_eq!(unsafe { libc::geteuid() }, 0, "the volume experiment needs root (network namespaces, loop devices, mounts)");
    assert!(!Path::new("/run/nearstore-testbed.json").exists(), "a testbed is already up on this machine: take it down first");
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let o = experiment(dir.path(), out.path(), &["--workloads", "read,write"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    nothing_left(dir.path());

    let records: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(out.path().join("volume.json")).unwrap()).unwrap();
    assert_eq!(records.len(), 2 * 2 * 2, "1 and 2 targets, two exports, two workloads");
    let find = |n: u64, export: &str, w: &str| -> &serde_json::Value {
        records
            .iter()
            .find(|r| r["targets"] == n && r["export"] == export && r["workload"] == w)
            .unwrap_or_else(|| panic!("{n} {export} {w}"))
    };
    let (t1, t2) = ("10.77.0.11:4421", "10.77.0.12:4421");
    // Placed only on the pools let in: all 8 extents on t1, then spread over both.
    assert_eq!(find(1, "target", "read")["extents"], serde_json::json!({ t1: 8 }));
    let two = &find(2, "target", "read")["extents"];
    assert!(two[t1].as_u64().unwrap() > 0 && two[t2].as_u64().unwrap() > 0, "{two}");
    let link = |r: &serde_json::Value, h: &str, i: usize| r["links"][h][i].as_u64().unwrap();
    for w in ["read", "write"] {
        // Which counter carries the data: a target's link sends reads and receives writes,
        // the client's the other way round.
        let (data, back) = if w == "read" { (1, 0) } else { (0, 1) };
        // Exported by t1: every byte crosses t1's link, its peer's part twice (to and from t1).
        let r = find(2, "target", w);
        let bytes = r["bytes"].as_u64().unwrap();
        assert!(bytes > 0, "{r}");
        assert!(link(r, "t1", data) >= bytes, "t1's link carries every byte: {r}");
        assert!(link(r, "t1", back) >= bytes / 4 && link(r, "t2", data) >= bytes / 4, "t2's share through t1: {r}");
        // Exported by the client's target: each target's link carries its own share, and
        // t1's link not t2's.
        let r = find(2, "client", w);
        let bytes = r["bytes"].as_u64().unwrap();
        assert!(link(r, "t1", data) >= bytes / 4 && link(r, "t2", data) >= bytes / 4, "{r}");
        assert!(link(r, "t1", data) < bytes, "t1 does not forward t2's bytes: {r}");
        assert!(link(r, "client", back) >= bytes, "{r}");
    }

    let rb: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(out.path().join("volume-rebalance.json")).unwrap()).unwrap();
    let rb = &rb[0];
    assert_eq!(rb["extents_before"], serde_json::json!({ t1: 8 }));
    assert_eq!(rb["extents_after"], serde_json::json!({ t1: 4, t2: 4 }), "{rb}");
    let moves = rb["moves"].as_array().unwrap();
    assert_eq!(moves.len(), 4, "{rb}");
    assert!(moves.iter().all(|m| m["published"] == true), "{rb}");
    assert!(!rb["samples"].as_array().unwrap().is_empty(), "the client's bandwidth was sampled: {rb}");
    assert!(rb["rebalance_end"].as_f64().unwrap() >= rb["rebalance_start"].as_f64().unwrap());

    // A run that fails once everything is up (perf refuses the workload) takes it all down.
    let o = experiment(dir.path(), out.path(), &["--workloads", "sideways", "--no-rebalance"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("perf sideways"), "{err}");
    nothing_left(dir.path());
}
