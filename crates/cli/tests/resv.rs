//! The reservation verbs through the binary, against a target process, as two hosts (two
//! host NQNs, hence two Host Identifiers): register, acquire, report (text and JSON),
//! preempt and abort, release, clear; refusals said in the user's terms.

mod common;

use common::{fails, nearstore, ok, Target};

const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:0000000a-0000-0000-0000-000000000000";
const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:0000000b-0000-0000-0000-000000000000";

/// `verb` for `host` against `t`, then `args`.
fn cmd(t: &Target, verb: &str, host: &str, args: &[&str]) -> Vec<String> {
    let port = t.addr.port().to_string();
    let mut v: Vec<String> = [verb, "--traddr", "127.0.0.1", "-s", &port, "--hostnqn", host].iter().map(|s| s.to_string()).collect();
    v.extend(args.iter().map(|s| s.to_string()));
    v
}

fn run_ok(t: &Target, verb: &str, host: &str, args: &[&str]) -> String {
    let v = cmd(t, verb, host, args);
    ok(&v.iter().map(String::as_str).collect::<Vec<_>>())
}

/// Fails with exit status 1; its stderr.
fn run_fails(t: &Target, verb: &str, host: &str, args: &[&str]) -> String {
    let v = cmd(t, verb, host, args);
    fails(&v.iter().map(String::as_str).collect::<Vec<_>>()).1
}

fn report(t: &Target, host: &str) -> serde_json::Value {
    serde_json::from_str(&run_ok(t, "resv-report", host, &["-n", "1", "-o", "json"])).unwrap()
}

#[test]
fn two_hosts_fence_each_other_through_the_verbs() {
    let t = Target::start(&["--memory", "64MiB"]);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("block");
    std::fs::write(&data, [7u8; 512]).unwrap();
    let data = data.to_str().unwrap();
    let port = t.addr.port().to_string();
    let write = |host: &str| nearstore(&["write", "-a", "127.0.0.1", "-s", &port, "--hostnqn", host, "-d", data]);

    assert_eq!(run_ok(&t, "resv-register", HOST_A, &["-n", "1", "-k", "0xa1"]), "registered key 0xa1 on namespace 1\n");
    run_ok(&t, "resv-register", HOST_B, &["--namespace-id", "1", "--nrkey", "178"]);
    assert!(run_ok(&t, "resv-acquire", HOST_A, &["-n", "1", "-c", "0xa1", "-t", "we"]).contains("write-exclusive"));

    // nvme-cli's JSON names; two hosts, two Host IDs; A holds.
    let r = report(&t, HOST_B);
    assert_eq!((r["gen"].as_u64(), r["rtype"].as_u64(), r["regctl"].as_u64(), r["ptpls"].as_u64()), (Some(2), Some(1), Some(2), Some(0)));
    let regs = r["regctlext"].as_array().unwrap();
    assert_eq!(
        regs.iter().map(|g| (g["rkey"].as_u64().unwrap(), g["rcsts"].as_u64().unwrap())).collect::<Vec<_>>(),
        [(0xa1, 1), (0xb2, 0)]
    );
    assert_ne!(regs[0]["hostid"], regs[1]["hostid"]);
    let text = run_ok(&t, "resv-report", HOST_A, &["-n", "1"]);
    for line in
        ["gen       : 2", "rtype     : 1 (write-exclusive)", "regctl    : 2", "rkey       : 0xa1", "rcsts      : 1 (holds the reservation)"]
    {
        assert!(text.contains(line), "{line:?} not in\n{text}");
    }

    // B may not write, and is told why; A may.
    let o = write(HOST_B);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("reservation conflict: namespace 1 is reserved"), "{err}");
    assert!(write(HOST_A).status.success());

    // B fences A: preempt and abort into Exclusive Access; now A neither writes nor reads.
    assert!(run_ok(&t, "resv-acquire", HOST_B, &["-n", "1", "-c", "0xb2", "-p", "0xa1", "-t", "ea", "-a", "preempt-abort"])
        .contains("preempted"));
    assert!(String::from_utf8_lossy(&write(HOST_A).stderr).contains("reservation conflict"));
    let o = nearstore(&["read", "-a", "127.0.0.1", "-s", &port, "--hostnqn", HOST_A, "-z", "512", "-d", "/dev/null"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("reservation conflict"));
    let r = report(&t, HOST_A);
    assert_eq!((r["rtype"].as_u64(), r["regctl"].as_u64(), r["gen"].as_u64()), (Some(2), Some(1), Some(3)));

    // Refusals in the user's terms, with the NVMe status under -v: (host, verb, args, said).
    let cases: &[(&str, &str, &[&str], &str)] = &[
        (HOST_A, "resv-acquire", &["-n", "1", "-c", "0xa1", "-t", "we"], "reservation conflict: namespace 1 is reserved already"),
        (HOST_A, "resv-release", &["-n", "1", "-c", "0xa1", "-t", "ea"], "not registered on namespace 1 with key 0xa1"),
        (HOST_B, "resv-release", &["-n", "1", "-c", "0xb2", "-t", "we"], "--rtype 1 (write-exclusive) is not the type of the reservation"),
        (HOST_B, "resv-register", &["-n", "1", "-k", "0xc3"], "registered on namespace 1 with another key"),
        (
            HOST_B,
            "resv-acquire",
            &["-n", "1", "-c", "0xb2", "-p", "0x99", "-t", "ea", "-a", "preempt"],
            "no registrant of namespace 1 has key 0x99",
        ),
        (HOST_B, "resv-report", &["-n", "9"], "no namespace 9 in this subsystem"),
        (HOST_B, "resv-register", &["-n", "1", "-k", "1", "--hostid", "00000000-0000-0000-0000-000000000000"], "Host Identifier is zero"),
    ];
    for &(host, verb, args, said) in cases {
        let err = run_fails(&t, verb, host, args);
        assert!(err.contains(said), "{verb} {args:?}: {err}");
        let mut verbose = vec!["-v"];
        verbose.extend(args);
        let err = run_fails(&t, verb, host, &verbose);
        assert!(err.contains("sct 0x"), "{verb} {args:?} -v: {err}");
    }
    // -o json: the error is a JSON object with the status.
    let err = run_fails(&t, "resv-report", HOST_B, &["-n", "9", "-o", "json"]);
    let e: serde_json::Value = serde_json::from_str(err.trim()).unwrap();
    assert!(e["status"].as_str().unwrap().contains("INVALID_NAMESPACE"), "{e}");

    // B releases; then clears every registration.
    assert!(run_ok(&t, "resv-release", HOST_B, &["-n", "1", "-c", "0xb2", "-t", "ea"]).contains("released"));
    assert!(write(HOST_A).status.success());
    run_ok(&t, "resv-release", HOST_B, &["-n", "1", "-c", "0xb2", "-a", "clear"]);
    let r = report(&t, HOST_A);
    assert_eq!((r["rtype"].as_u64(), r["regctl"].as_u64()), (Some(0), Some(0)));
}

/// Values are checked before anything connects: usage errors (exit status 2) naming the
/// value.
#[test]
fn bad_values_are_usage_errors() {
    let cases: &[(&[&str], &str)] = &[
        (&["resv-acquire", "-c", "1", "-t", "7"], "'7' names no reservation type"),
        (&["resv-acquire", "-c", "1", "-t", "we", "-a", "steal"], "'steal' names no acquire action"),
        (&["resv-acquire", "-c", "0xzz", "-t", "we"], "'0xzz' is not a 64-bit key"),
        (&["resv-register", "-k", "1", "-r", "3"], "'3' names no register action"),
        (&["resv-register", "-k", "1", "-p", "1"], "'1' names no CPTPL value"),
        (&["resv-release", "-c", "1", "-a", "drop"], "'drop' names no release action"),
        (&["resv-acquire", "-t", "we"], "--crkey"),
    ];
    for &(args, said) in cases {
        let o = nearstore(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(said), "{args:?}: {err}");
    }
}

/// A host that gives no --hostnqn or --hostid is one host to the target in every verb: on a
/// machine with nvme-cli's files (a Host ID that is not the host NQN's UUID, as `nvme
/// gen-hostnqn` and `uuidgen` make them) the reservation verbs and the reads and writes all
/// send the file's Host ID, so the holder of a reservation writes through it. The verbs
/// once took /etc/nvme/hostid for the reservation and a Host ID derived from the NQN for
/// the write, which then conflicted with the host's own reservation.
#[test]
fn one_host_by_default_in_every_verb() {
    let t = Target::start(&["--memory", "64MiB"]);
    let dir = tempfile::tempdir().unwrap();
    let etc = dir.path().join("nvme");
    std::fs::create_dir(&etc).unwrap();
    std::fs::write(etc.join("hostnqn"), "nqn.2014-08.org.nvmexpress:uuid:0062216e-1d66-4bce-afda-9311e3a3169c\n").unwrap();
    std::fs::write(etc.join("hostid"), "e4b3c653-9a5e-47f7-9553-c7fa133c904f\n").unwrap();
    let data = dir.path().join("block");
    std::fs::write(&data, [7u8; 512]).unwrap();
    let port = t.addr.port().to_string();
    let target = ["--traddr", "127.0.0.1", "-s", &port];
    let run = |verb: &str, args: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_nearstore"))
            .env(nearstore_initiator::host::NVME_DIR_ENV, &etc)
            .arg(verb)
            .args(target)
            .args(args)
            .output()
            .unwrap();
        (o.status.code(), String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr))
    };
    let (data, null) = (data.to_str().unwrap(), "/dev/null");

    for (verb, args) in [("resv-register", &["-n", "1", "-k", "0xa1"][..]), ("resv-acquire", &["-n", "1", "-c", "0xa1", "-t", "ea"])] {
        let (code, out) = run(verb, args);
        assert_eq!(code, Some(0), "{verb}: {out}");
    }
    let (_, report) = run("resv-report", &["-n", "1", "-o", "json"]);
    let r: serde_json::Value = serde_json::from_str(&report).unwrap();
    assert_eq!(r["regctlext"][0]["hostid"], "e4b3c6539a5e47f79553c7fa133c904f", "{r}");

    // Exclusive Access: the holder writes and reads; another host does neither.
    for (verb, args) in [("write", &["-d", data][..]), ("read", &["-z", "512", "-d", null])] {
        let (code, out) = run(verb, args);
        assert_eq!(code, Some(0), "{verb} by the holder: {out}");
        let mut other = vec!["--hostnqn", HOST_B];
        other.extend(args);
        let (code, out) = run(verb, &other);
        assert!(code == Some(1) && out.contains("reservation conflict"), "{verb} by another host: {out}");
    }
}
