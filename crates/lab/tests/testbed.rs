//! The testbed, small: two targets behind shaped links, one conventional and one
//! offloaded run with equal results, the links' counters telling the two apart; then down,
//! leaving nothing behind; and a failing `up` cleaning up after itself. Needs root, `ip`,
//! `tc`, loop devices: it fails saying which is missing, it does not skip.

use std::path::Path;
mod common;

use common::{lab, nearstore, ok, product};
use std::process::Command;

fn prerequisites() {
    assert_eq!(unsafe { libc::geteuid() }, 0, "the testbed test needs root (network namespaces, loop devices, mounts)");
    for tool in ["ip", "tc", "losetup", "mkfs.ext4", "mount"] {
        let found = std::env::var("PATH").unwrap_or_default().split(':').any(|d| Path::new(d).join(tool).exists());
        assert!(found, "the testbed test needs `{tool}` (scripts/prereqs.sh installs it)");
    }
    assert!(
        !Path::new("/run/nearstore-testbed.json").exists(),
        "a testbed is already up on this machine (/run/nearstore-testbed.json): take it down first (nearstore-lab testbed down)"
    );
}

fn namespaces() -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("nstb-"))
        .map(String::from)
        .collect()
}

/// Takes the testbed down when the test ends, passed or failed.
struct Down;
impl Drop for Down {
    fn drop(&mut self) {
        let _ = lab(&["testbed", "down"]);
    }
}

#[test]
fn testbed_up_bench_down_and_a_failed_up_cleans_up() {
    prerequisites();
    // The testbed's targets are the product's binary.
    let product = product();
    let nearstore_bin = product.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tb = dir.path().join("tb");
    let tbs = tb.to_str().unwrap();
    let _down = Down;
    ok(&["testbed", "up", "--targets", "2", "--files", "2", "--file-size", "2097152", "--rate", "100mbit", "--dir", tbs]);
    let state: serde_json::Value = serde_json::from_slice(&std::fs::read("/run/nearstore-testbed.json").unwrap()).unwrap();
    let pids: Vec<u64> = state["targets"].as_array().unwrap().iter().map(|t| t["pid"].as_u64().unwrap()).collect();
    let loops: Vec<String> = state["targets"].as_array().unwrap().iter().map(|t| t["loop_dev"].as_str().unwrap().to_string()).collect();
    assert_eq!(namespaces().len(), 4, "switch, client, two targets");
    // Each target host runs the product's binary, the one beside nearstore-lab.
    for pid in &pids {
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap();
        assert_eq!(exe, product.canonicalize().unwrap(), "target {pid}");
    }
    let status = ok(&["testbed", "status"]);
    assert_eq!(status.matches("(running)").count(), 2, "{status}");
    // Every link is shaped from the start, the targets' too (target to target traffic).
    for h in ["client", "t1", "t2"] {
        let o = lab(&["testbed", "exec", h, "--", "tc", "qdisc", "show", "dev", "eth0"]);
        let q = String::from_utf8_lossy(&o.stdout);
        assert!(q.contains("tbf") && q.contains("100Mbit"), "{h}: {q}");
    }
    // A second testbed is refused while this one is up.
    let o = lab(&["testbed", "up", "--targets", "1", "--dir", tbs]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("a testbed is already up"));

    let run =
        |mode: &str| -> serde_json::Value { serde_json::from_str(&ok(&["testbed", "bench", "--op", "crc32c", "--mode", mode])).unwrap() };
    let conv = run("conventional");
    let off = run("offloaded");
    assert_eq!(conv["results"], off["results"], "conventional and offloaded checksums are equal");
    assert!(!conv["results"].as_str().unwrap().is_empty());
    let data = conv["bytes"].as_u64().unwrap();
    assert!((4 * 2097152..4 * 2097152 + 4 * 200).contains(&data), "two log files of 2 MiB and a line per target: {data}");
    // The client's interface saw every data byte conventionally, a sliver offloaded.
    assert!(conv["client_rx"].as_u64().unwrap() >= data, "{conv}");
    let off_link = off["client_rx"].as_u64().unwrap() + off["client_tx"].as_u64().unwrap();
    assert!(off_link * 20 < data, "offloaded link bytes {off_link} of {data}");
    assert!(off["targets_tx"].as_u64().unwrap() * 20 < data);
    // Every link is counted: each target's link sent its half of the data.
    let links = conv["links"].as_array().unwrap();
    assert_eq!(links.iter().map(|l| l[0].as_str().unwrap()).collect::<Vec<_>>(), ["client", "t1", "t2"]);
    for l in &links[1..] {
        assert!(l[2].as_u64().unwrap() >= data / 2, "{l}");
    }
    // The shaping is in effect: conventional reads cannot beat the 100 Mbit/s link.
    assert!(conv["mb_per_s"].as_f64().unwrap() < 100.0 / 8.0 * 1.2, "{conv}");
    // A sort across both targets from the client, through the CLI, with the testbed's map:
    // device to device (the client's link carries commands only) and host-mediated.
    let map = state["map"].as_str().unwrap().to_string();
    let mnts: Vec<String> = state["targets"].as_array().unwrap().iter().map(|t| t["mnt"].as_str().unwrap().to_string()).collect();
    ok(&["gensort", "--records", "30000", &format!("{}/part0", mnts[0])]);
    ok(&["gensort", "--records", "20000", "--start", "30000", &format!("{}/part1", mnts[1])]);
    // The inputs together are not in order (valsort says so and fails), but their checksum
    // is what the sorted output must have.
    let want = String::from_utf8(lab(&["valsort", &format!("{}/part0", mnts[0]), &format!("{}/part1", mnts[1])]).stdout).unwrap();
    let want_sum = want.lines().find(|l| l.contains("checksum")).unwrap_or_else(|| panic!("{want}")).to_string();
    for transfer in ["d2d", "host"] {
        let out = format!("{}/sorted", mnts[1]);
        let o = ok(&[
            "testbed",
            "exec",
            "client",
            "--",
            nearstore_bin,
            "sort",
            "--across",
            "--map",
            &map,
            "--record-size",
            "100",
            "--key-length",
            "10",
            "--transfer",
            transfer,
            "--into",
            &out,
            &format!("{}/part0", mnts[0]),
            &format!("{}/part1", mnts[1]),
        ]);
        assert!(o.contains("50000 records, 5000000 bytes (device 2)"), "{transfer}: {o}");
        let v = ok(&["valsort", &out]);
        assert!(v.contains(&want_sum), "{transfer}: {v} against {want}");
        std::fs::remove_file(&out).unwrap();
    }
    // Refused by name: no tags in the map, and --across with merge.
    let o = nearstore(&["sort", "--across", "--record-size", "100", "--into", "/tmp/x", &format!("{}/part0", mnts[0])]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("not on a target's namespace"), "{}", String::from_utf8_lossy(&o.stderr));
    let o = nearstore(&["merge", "--across", "--map", &map, "--into", "/tmp/x", &format!("{}/part0", mnts[0])]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("only sort runs across targets"), "{}", String::from_utf8_lossy(&o.stderr));

    // Commands on a host; a host that does not exist.
    let o = lab(&["testbed", "exec", "t2", "--", "ip", "-br", "addr", "show", "eth0"]);
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("10.77.0.12"));
    let o = lab(&["testbed", "exec", "t9", "--", "true"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("no host \"t9\""));
    let o = lab(&["testbed", "shape", "--rate", "fast"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("--rate fast"));
    // A delay needs netem: applied where the kernel has it, refused by name where not.
    let o = lab(&["testbed", "shape", "--rate", "100mbit", "--delay", "1ms"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() || err.contains("needs the netem qdisc, which this kernel lacks"), "{err}");
    ok(&["testbed", "shape", "--rate", "100mbit", "--delay", "0ms"]);

    ok(&["testbed", "down"]);
    assert!(namespaces().is_empty(), "namespaces left: {:?}", namespaces());
    for pid in pids {
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "target {pid} still runs");
    }
    let l = String::from_utf8(Command::new("losetup").arg("-a").output().unwrap().stdout).unwrap();
    for d in loops {
        assert!(!l.contains(&format!("{d}:")) || !l.contains("nearstore-testbed") && !l.contains(tbs), "{d} still attached: {l}");
    }
    assert!(!std::fs::read_to_string("/proc/mounts").unwrap().contains(tbs), "mounts left");
    assert!(!tb.exists() && !Path::new("/run/nearstore-testbed.json").exists());

    // An `up` that fails half-way (the first target's mount point is taken by a file)
    // takes down what it made, and leaves what it did not make.
    std::fs::create_dir(&tb).unwrap();
    std::fs::write(tb.join("t1.mnt"), b"in the way").unwrap();
    std::fs::write(tb.join("mine"), b"a user's file").unwrap();
    let o = lab(&["testbed", "up", "--targets", "1", "--files", "1", "--file-size", "4096", "--dir", tbs]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("taking down what was made"), "{err}");
    assert!(namespaces().is_empty(), "namespaces left after a failed up: {:?}", namespaces());
    assert!(!Path::new("/run/nearstore-testbed.json").exists());
    assert!(!tb.join("t1.img").exists(), "the image is removed");
    let l = String::from_utf8(Command::new("losetup").arg("-a").output().unwrap().stdout).unwrap();
    assert!(!l.contains(tbs), "loop device left: {l}");
    assert_eq!(std::fs::read(tb.join("mine")).unwrap(), b"a user's file");
}
