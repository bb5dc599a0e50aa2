//! What an operator installs and watches: shell completions and man pages generated from
//! the help, the systemd unit of dist/, perf's progress line.

mod common;

use std::process::{Command, Stdio};

use common::{nearstore, ok, Target};

#[test]
fn completions_for_each_shell_know_the_verbs_and_options() {
    // (shell, a check of the script by the shell itself where it is installed here)
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let script = ok(&["completions", shell]);
        assert!(script.contains("checksum") && script.contains("offload-only") && script.contains("trsvcid"), "{shell}");
        assert!(script.contains("resv-acquire") && script.contains("prkey") && script.contains("namespace-id"), "{shell}");
    }
    let dir = tempfile::tempdir().unwrap();
    let bash = dir.path().join("nearstore.bash");
    std::fs::write(&bash, ok(&["completions", "bash"])).unwrap();
    let st = Command::new("bash").arg("-n").arg(&bash).status().expect("bash (to check the completion script)");
    assert!(st.success(), "bash -n refuses the completion script");
    let o = nearstore(&["completions", "tcsh-or-so"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn man_pages_one_per_verb_from_the_help() {
    let dir = tempfile::tempdir().unwrap();
    let man = dir.path().join("man1");
    ok(&["man", man.to_str().unwrap()]);
    // (page, a text it must hold: roff escapes the dashes of options)
    let cases = [
        ("nearstore.1", "checksum"),
        ("nearstore-checksum.1", "offload\\-only"),
        ("nearstore-perf.1", "io\\-size"),
        ("nearstore-target.1", "log\\-format"),
        ("nearstore-sort.1", "record\\-size"),
        ("nearstore-completions.1", "shell"),
        ("nearstore-resv-acquire.1", "preempt\\-abort"),
    ];
    for (page, needle) in cases {
        let text = std::fs::read_to_string(man.join(page)).unwrap_or_else(|e| panic!("{page}: {e}"));
        assert!(text.starts_with(".ie") || text.contains(".TH"), "{page} is no man page");
        assert!(text.contains(needle), "{page} lacks {needle}");
    }
    // A page for every verb of the product; the lab's verbs are nearstore-lab's.
    let verbs = [
        "target",
        "discover",
        "list",
        "id-ctrl",
        "id-ns",
        "read",
        "write",
        "perf",
        "checksum",
        "grep",
        "wc",
        "select",
        "copy",
        "compress",
        "decompress",
        "sort",
        "merge",
        "resv-register",
        "resv-acquire",
        "resv-release",
        "resv-report",
        "completions",
        "man",
    ];
    for verb in verbs {
        assert!(man.join(format!("nearstore-{verb}.1")).is_file(), "no page for {verb}");
    }
    for lab in ["testbed", "demo", "gensort", "valsort"] {
        assert!(!man.join(format!("nearstore-{lab}.1")).exists(), "{lab} is a verb of nearstore-lab");
    }
}

/// The unit's ExecStart, with this build's binary and a test configuration, serves and
/// stops on the unit's KillSignal with status 0; systemd-analyze finds nothing wrong.
#[test]
fn the_systemd_unit_starts_and_stops_the_target() {
    let unit = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../dist/nearstore-target.service")).unwrap();
    let value = |key: &str| unit.lines().find_map(|l| l.strip_prefix(key)).unwrap_or_else(|| panic!("the unit has no {key}"));
    assert_eq!(value("KillSignal="), "SIGTERM");
    let exec: Vec<&str> = value("ExecStart=").split_whitespace().collect();
    assert_eq!(exec[..3], ["/usr/local/bin/nearstore", "target", "--config"]);
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("target.toml");
    std::fs::write(
        &cfg,
        "[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"nqn.2026-11.io.nearstore:unit\"\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\nmemory = \"16MiB\"\n",
    )
    .unwrap();
    let args: Vec<&str> = exec[1..].iter().map(|a| if *a == "/etc/nearstore/target.toml" { cfg.to_str().unwrap() } else { a }).collect();
    let mut child =
        Command::new(env!("CARGO_BIN_EXE_nearstore")).args(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
    assert!(line.starts_with("listening on 127.0.0.1:"), "{line:?}");
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{:?}: {}", out.status, String::from_utf8_lossy(&out.stderr));

    let local = dir.path().join("nearstore-target.service");
    std::fs::write(&local, unit.replace("/usr/local/bin/nearstore", env!("CARGO_BIN_EXE_nearstore"))).unwrap();
    let o = Command::new("systemd-analyze")
        .args(["verify", "--man=no", local.to_str().unwrap()])
        .output()
        .expect("systemd-analyze (the systemd package) to check the unit");
    assert!(o.status.success() && o.stderr.is_empty(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn perf_says_its_progress_every_second() {
    let t = Target::start(&["--memory", "16MiB"]);
    let addr = t.addr.to_string();
    // The reporter starts up to a moment after the queues' clock: 2.9 s gives two lines
    // whether it starts at once or 0.9 s late, and three if the queues end 0.1 s late.
    let o = nearstore(&["perf", "-a", &addr, "-z", "4KiB", "-q", "4", "-T", "2.9", "-o", "json"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("perf:") && l.contains("IOPS") && l.contains("MB/s")).collect();
    assert!((2..=3).contains(&lines.len()), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["ios"].as_u64().unwrap() > 0);
    let o = nearstore(&["perf", "-a", &addr, "-z", "4KiB", "-q", "4", "-T", "1.5", "--quiet"]);
    assert!(o.status.success() && !String::from_utf8_lossy(&o.stderr).contains("perf:"));
}
