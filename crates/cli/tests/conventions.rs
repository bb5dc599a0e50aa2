//! One convention for options on every verb: nvme-cli's `-t tcp -a ADDR -s PORT -n NQN`
//! (and `-a HOST:PORT`), `-o` the output format, sizes with or without units; a refused
//! Connect said in the user's terms, the NVMe status with -v.

mod common;

use common::{fails, nearstore, ok, Target};

const NQN: &str = "nqn.2026-11.io.nearstore:disk0";

fn json(args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&ok(args)).unwrap_or_else(|e| panic!("{args:?}: not JSON: {e}"))
}

#[test]
fn nvme_cli_spellings_reach_the_target_on_every_verb() {
    let t = Target::with_discovery(&["--memory", "64MiB"]);
    let d = t.discovery.expect("a discovery listener");
    let (host, port, hostport) = (t.addr.ip().to_string(), t.addr.port().to_string(), t.addr.to_string());
    let (dhost, dport) = (d.ip().to_string(), d.port().to_string());
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::write(&data, b"nearstore\n").unwrap();
    let back = dir.path().join("back");
    let (data, back) = (data.to_str().unwrap(), back.to_str().unwrap());
    let spellings: [Vec<&str>; 3] = [
        vec!["-t", "tcp", "-a", &host, "-s", &port, "-n", NQN],
        vec!["--transport", "tcp", "--traddr", &host, "--trsvcid", &port, "--nqn", NQN],
        vec!["-a", &hostport],
    ];
    for addr in &spellings {
        let with = |verb: &[&str]| -> Vec<String> { verb.iter().chain(addr.iter()).map(|s| s.to_string()).collect() };
        let run = |verb: &[&str]| json(&with(verb).iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(run(&["list", "-o", "json"])["subnqn"], NQN, "{addr:?}");
        assert_eq!(run(&["id-ctrl", "-o", "json"])["subnqn"], NQN, "{addr:?}");
        assert_eq!(run(&["id-ns", "-o", "json"])["nsze"], 64 << 11, "{addr:?}");
        assert_eq!(run(&["perf", "-z", "4KiB", "-T", "0.2", "-q", "4", "-o", "json"])["io_size"], 4096, "{addr:?}");
        let write: Vec<String> = with(&["write", "-d", data]);
        ok(&write.iter().map(String::as_str).collect::<Vec<_>>());
        let read: Vec<String> = with(&["read", "-z", "1KiB", "-d", back]);
        ok(&read.iter().map(String::as_str).collect::<Vec<_>>());
        let got = std::fs::read(back).unwrap();
        assert_eq!((got.len(), &got[..10]), (1024, &b"nearstore\n"[..]), "{addr:?}");
    }
    for args in [
        vec!["discover", "-t", "tcp", "-a", &dhost, "-s", &dport, "-o", "json"],
        vec!["discover", "--traddr", &dhost, "--trsvcid", &dport, "-o", "json"],
    ] {
        let v = json(&args);
        assert!(v["records"].as_array().unwrap().iter().any(|r| r["subnqn"] == NQN), "{args:?}: {v}");
    }
}

/// Each line: arguments, and what the error must say. Status 2 is a usage error (clap), 1
/// an error found later; a size with a unit that parses lets the next argument's error through.
#[test]
fn options_are_checked_with_their_names() {
    let cases: &[(&[&str], i32, &str)] = &[
        (&["list", "-a", "127.0.0.1:4420", "-s", "4421"], 1, "-a 127.0.0.1:4420 and -s 4421 give two ports"),
        (&["list", "-t", "rdma"], 2, "invalid value 'rdma' for '--transport"),
        (&["perf", "-t", "5"], 2, "invalid value '5' for '--transport"),
        (&["perf", "-z", "4XB"], 2, "invalid value '4XB' for '--io-size"),
        (&["perf", "-z", "4KiB", "-w", "sideways"], 2, "invalid value 'sideways' for '--workload"),
        (&["read", "-z", "1ZB"], 2, "for '--data-size"),
        (&["compress", "--local", "--capacity", "1 lot", "a", "b"], 2, "for '--capacity"),
        (&["select", "--local", "--into", "x", "--into-capacity", "1Q", "SELECT 1 FROM t", "a"], 2, "for '--into-capacity"),
    ];
    for (args, status, needle) in cases {
        let o = nearstore(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(*status), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err:?} lacks {needle:?}");
    }
}

#[test]
fn sizes_with_units_are_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in");
    std::fs::write(&input, "x".repeat(10_000)).unwrap();
    let out = dir.path().join("out.zst");
    let (i, o) = (input.to_str().unwrap(), out.to_str().unwrap());
    // A capacity of 1KiB takes the compressed bytes; 10 bytes cannot.
    ok(&["compress", "--local", "--capacity", "1KiB", i, o]);
    let (_, err) = fails(&["compress", "--local", "--capacity", "10", i, o]);
    assert!(err.contains("10"), "{err}");
}

#[test]
fn a_refused_connect_is_said_in_the_users_terms() {
    let t = Target::start(&["--memory", "16MiB"]);
    let addr = t.addr.to_string();
    let (_, err) = fails(&["list", "-a", &addr, "-n", "nqn.2026-11.io.nearstore:nope"]);
    assert!(err.contains("no such subsystem") && err.contains("nqn.2026-11.io.nearstore:nope"), "{err}");
    assert!(!err.contains("CONNECT_INVALID"), "the status is for -v: {err}");
    let (_, err) = fails(&["-v", "id-ctrl", "-a", &addr, "-n", "nqn.2026-11.io.nearstore:nope"]);
    assert!(err.contains("no such subsystem") && err.contains("CONNECT_INVALID_PARAMETERS"), "{err}");
    // Asked for JSON, the error is JSON on stderr, the status in it; stdout stays empty.
    let (out, err) = fails(&["list", "-o", "json", "-a", &addr, "-n", "nqn.2026-11.io.nearstore:nope"]);
    let v: serde_json::Value = serde_json::from_str(err.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {err}"));
    assert!(v["error"].as_str().is_some_and(|m| m.contains("no such subsystem")), "{v}");
    assert!(v["status"].as_str().is_some_and(|s| s.contains("CONNECT_INVALID_PARAMETERS")), "{v}");
    assert!(out.is_empty(), "{out}");

    // A host the subsystem does not list.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("t.toml");
    std::fs::write(
        &cfg,
        format!("[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"{NQN}\"\nhosts = [\"nqn.2014-08.org.example:friend\"]\n[[subsystem.namespace]]\nnsid = 1\nmemory = \"16MiB\"\n"),
    )
    .unwrap();
    let t = Target::start(&["--config", cfg.to_str().unwrap()]);
    let addr = t.addr.to_string();
    let (_, err) = fails(&["list", "-a", &addr, "--hostnqn", "nqn.2014-08.org.example:stranger"]);
    assert!(err.contains("does not allow this host (nqn.2014-08.org.example:stranger)"), "{err}");
    let (_, err) = fails(&["-v", "list", "-a", &addr, "--hostnqn", "nqn.2014-08.org.example:stranger"]);
    assert!(err.contains("CONNECT_INVALID_HOST"), "{err}");
    ok(&["list", "-a", &addr, "--hostnqn", "nqn.2014-08.org.example:friend"]);
}

/// The target's logs on stderr, not a terminal here, as each set of options and RUST_LOG
/// make them: (arguments, RUST_LOG, check of the whole stderr).
#[test]
fn target_logs_without_colours_at_a_level_as_text_or_json() {
    type Check = fn(&str) -> bool;
    let cases: &[(&[&str], Option<&str>, Check)] = &[
        (&[], None, |e| e.contains(" INFO ") && e.contains("listening") && !e.contains('\x1b')),
        (&["--log-level", "warn"], None, |e| !e.contains("INFO")),
        (&[], Some("warn"), |e| !e.contains("INFO")),
        (&["--log-level", "info"], Some("warn"), |e| e.contains(" INFO ")),
        (&["--log-format", "json"], None, |e| {
            e.lines().count() > 0
                && e.lines().all(|l| serde_json::from_str::<serde_json::Value>(l).is_ok_and(|v| v["level"].is_string()))
                && e.contains("\"listening\"")
        }),
    ];
    for (args, rust_log, check) in cases {
        use std::io::BufRead;
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_nearstore"));
        cmd.args(["target", "--memory", "16MiB", "--listen", "127.0.0.1:0", "--discovery", "none"]).args(*args);
        match rust_log {
            Some(v) => cmd.env("RUST_LOG", v),
            None => cmd.env_remove("RUST_LOG"),
        };
        let mut child = cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(line.starts_with("listening on"), "{args:?}: {line:?} {err}");
        assert!(check(&err), "{args:?} RUST_LOG={rust_log:?}: {err}");
    }
}

/// `compare-and-write`: each line the bytes compared, the bytes to write, and what happens
/// (the error's words, or None: written); the blocks are read back after each.
#[test]
fn compare_and_write_writes_only_over_what_it_compared() {
    let t = Target::start(&["--memory", "64MiB"]);
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, bytes: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p.to_str().unwrap().to_string()
    };
    let a = t.addr.to_string();
    let back = dir.path().join("back");
    let start = file("start", b"first\n");
    ok(&["write", "-a", &a, "-n", NQN, "-d", &start]);
    type Case<'a> = (&'a [u8], &'a [u8], Option<&'a str>, &'a [u8]);
    let cases: [Case; 4] = [
        (b"first\n", b"second", None, b"second"),
        (b"first\n", b"third!", Some("differ from"), b"second"),
        (b"second", b"3", Some("must have the same"), b"second"),
        (b"second", b"third!", None, b"third!"),
    ];
    for (i, (cmp, new, fails_with, after)) in cases.into_iter().enumerate() {
        let (c, d) = (file(&format!("c{i}"), cmp), file(&format!("d{i}"), new));
        let args = ["compare-and-write", "-a", &a, "-n", NQN, "-c", &c, "-d", &d];
        match fails_with {
            None => drop(ok(&args)),
            Some(needle) => {
                let (_, err) = fails(&args);
                assert!(err.contains(needle), "case {i}: {err:?} lacks {needle:?}");
            }
        }
        ok(&["read", "-a", &a, "-n", NQN, "-z", "512", "-d", back.to_str().unwrap()]);
        let got = std::fs::read(&back).unwrap();
        assert_eq!(&got[..after.len()], after, "case {i}: the blocks after it");
        assert!(got[after.len()..].iter().all(|&b| b == 0), "case {i}: the block's padding");
    }
}
