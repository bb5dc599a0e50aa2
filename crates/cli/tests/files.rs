//! What the compute verbs say about each file: one that cannot be read or fails is reported
//! for itself and the others are still computed (exit status 1 at the end, as sha256sum);
//! one that cannot be offloaded is computed on the host and stderr says why, once per cause,
//! or with --offload-only nothing is computed; a result too big to return inline names --into.

mod common;

use std::path::{Path, PathBuf};

use common::{fails, nearstore, ok, Fs, Target};

const NOTICE: &str = "computed on the host, not offloaded:";

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn notices(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.contains(NOTICE)).collect()
}

/// Each line: a verb and its arguments before the files; what a good file prints.
#[test]
fn a_failing_file_is_reported_and_the_others_computed() {
    let dir = tempfile::tempdir().unwrap();
    let d = |n: &str| dir.path().join(n);
    std::fs::write(d("a.csv"), "id,city\n1,Oslo\n2,Lima\n").unwrap();
    std::fs::write(d("b.csv"), "id,city\n3,Oslo\n").unwrap();
    // Fails only when computed, by select: a sum of text.
    std::fs::write(d("bad.csv"), "id,city\nfour,Oslo\n").unwrap();
    std::fs::create_dir(d("dir")).unwrap();
    let files: Vec<PathBuf> = ["a.csv", "missing.csv", "dir", "bad.csv", "b.csv"].iter().map(|n| d(n)).collect();
    let files: Vec<&str> = files.iter().map(|f| p(f)).collect();
    let cases: &[(&[&str], &str, &str)] = &[
        (&["checksum", "--local"], "  ", "b.csv"),
        (&["checksum"], "  ", "b.csv"),
        (&["wc", "--local"], " ", "b.csv"),
        (&["grep", "-c", "Oslo", "--local"], ":", "b.csv:1"),
        (&["select", "--local", "SELECT SUM(id) FROM s3object"], "", "==> "),
    ];
    for (verb, _, last) in cases {
        let args: Vec<&str> = verb.iter().chain(files.iter()).copied().collect();
        let (out, err) = fails(&args);
        assert!(out.contains(p(&d("a.csv"))) || verb[0] == "select", "{verb:?}: {out}");
        assert!(out.contains(last), "{verb:?}: {out}");
        assert!(err.contains(&format!("{}: No such file or directory", p(&d("missing.csv")))), "{verb:?}: {err}");
        assert!(err.contains(&format!("{}: not a regular file", p(&d("dir")))), "{verb:?}: {err}");
        if verb[0] == "select" {
            assert!(err.contains(&format!("{}: select: bad input data", p(&d("bad.csv")))), "{verb:?}: {err}");
            assert_eq!(out.matches("==> ").count(), 2, "{out}");
            assert!(err.contains("3 of 5 files failed"), "{verb:?}: {err}");
        } else {
            assert!(err.contains("2 of 5 files failed"), "{verb:?}: {err}");
        }
    }
    // In order, as given: a.csv's line before b.csv's.
    let out = fails(&["checksum", "--local", files[0], files[1], files[4]]).0;
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines.len() == 2 && lines[0].ends_with("a.csv") && lines[1].ends_with("b.csv"), "{out}");
    // JSON: the results, and the files that failed.
    let o = nearstore(&["checksum", "--local", "-o", "json", files[0], files[1]]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["files"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["errors"][0]["path"], files[1], "{v}");
    // One file alone that fails: its error, as before.
    let (_, err) = fails(&["checksum", files[1]]);
    assert!(err.contains("missing.csv") && !err.contains("files failed"), "{err}");
}

/// Files on an ext4 image exported by no target we know of, and files on a file system that
/// is no block device's: two causes, two lines, whatever the number of files.
#[test]
fn a_host_fallback_is_said_once_per_cause_and_offload_only_refuses() {
    let fs = Fs::new(64);
    let other = tempfile::tempdir_in("/dev/shm").expect("a tmpfs at /dev/shm (a file system on no block device)");
    let mut files = Vec::new();
    for i in 0..3 {
        let f = fs.mnt.join(format!("on-image-{i}.log"));
        std::fs::write(&f, format!("line {i}\nERROR {i}\n").repeat(1000)).unwrap();
        files.push(f);
    }
    for i in 0..2 {
        let f = other.path().join(format!("in-memory-{i}.log"));
        std::fs::write(&f, "ERROR\n").unwrap();
        files.push(f);
    }
    let files: Vec<&str> = files.iter().map(|f| p(f)).collect();
    let with = |verb: &[&str]| -> Vec<String> { verb.iter().chain(files.iter()).map(|s| s.to_string()).collect() };
    let run = |verb: &[&str]| nearstore(&with(verb).iter().map(String::as_str).collect::<Vec<_>>());

    // Each line: the verb, notices expected (offloaded nothing: the image is no target's).
    for verb in [&["checksum"][..], &["grep", "-c", "ERROR"], &["wc"], &["checksum", "--pull"]] {
        let o = run(verb);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{verb:?}: {err}");
        assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 5, "{verb:?}");
        let n = notices(&err);
        assert_eq!(n.len(), 2, "{verb:?}: one line per cause: {err}");
        assert!(n[0].contains("3 files") && n[0].contains("which no known target exports"), "{verb:?}: {err}");
        assert!(n[1].contains("2 files") && n[1].contains("no single block device"), "{verb:?}: {err}");
        assert!(n[0].contains("--target-config"), "{verb:?}: the notice says how to offload: {err}");
    }
    // Asked for: no notice.
    let o = run(&["checksum", "--local"]);
    assert!(o.status.success() && notices(&String::from_utf8_lossy(&o.stderr)).is_empty());
    // --offload-only: nothing computed, every cause said, exit 1.
    let (out, err) = fails(&with(&["checksum", "--offload-only"]).iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(out, "");
    assert!(err.contains("not offloaded (--offload-only)") && err.contains("3 files") && err.contains("2 files"), "{err}");
    let out_zst = fs.mnt.join("out.zst");
    let (_, err) = fails(&["compress", "--offload-only", files[0], p(&out_zst)]);
    assert!(err.contains("not offloaded (--offload-only)"), "{err}");
    assert!(!out_zst.exists(), "nothing written");
    // --offload-only with --local or --pull makes no sense.
    let o = nearstore(&["checksum", "--offload-only", "--local", files[0]]);
    assert_eq!(o.status.code(), Some(2));

    // With a target exporting the image, the files on it offload: one notice left, and
    // --offload-only takes those files.
    let t = Target::start(&["--namespace", p(&fs.image)]);
    let map = fs.dir.path().join("map.toml");
    std::fs::write(
        &map,
        format!(
            "[[namespace]]\naddress = \"{}\"\nnqn = \"nqn.2026-11.io.nearstore:disk0\"\nnsid = 1\nfile = \"{}\"\n",
            t.addr,
            p(&fs.image)
        ),
    )
    .unwrap();
    let o = run(&["checksum", "--map", p(&map)]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert_eq!(notices(&err).len(), 1, "{err}");
    assert!(notices(&err)[0].contains("2 files"), "{err}");
    let on_image: Vec<&str> =
        ["checksum", "--offload-only", "--stats", "--map", p(&map)].into_iter().chain(files[..3].iter().copied()).collect();
    let o = nearstore(&on_image);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("3 offloaded") && notices(&err).is_empty(), "{err}");

    // A result too big to return inline names --into; with it, the rows go to a file.
    let big = fs.mnt.join("big.csv");
    let rows: String = (0..40_000).map(|i| format!("{i},row number {i}\n")).collect();
    std::fs::write(&big, format!("id,text\n{rows}")).unwrap();
    let (_, err) = fails(&["select", "--map", p(&map), "SELECT * FROM s3object", p(&big)]);
    assert!(err.contains("--into FILE") && !err.contains("LIMIT_EXCEEDED"), "{err}");
    let (_, err) = fails(&["select", "--local", "SELECT * FROM s3object", p(&big)]);
    assert!(err.contains("--into FILE"), "computed on the host, the same words: {err}");
    let (_, err) = fails(&["-v", "select", "--map", p(&map), "SELECT * FROM s3object", p(&big)]);
    assert!(err.contains("--into FILE") && err.contains("LIMIT_EXCEEDED"), "{err}");
    let rows_out = fs.mnt.join("rows.csv");
    ok(&["select", "--map", p(&map), "--into", p(&rows_out), "SELECT * FROM s3object", p(&big)]);
    assert_eq!(std::fs::read_to_string(&rows_out).unwrap().lines().count(), 40_001);
}

/// The compute verbs connect as `--hostnqn` (with tenants on the target, the one that
/// decides what a host reaches): the tenant's host gets the offloaded result, which equals
/// the host's own; another host, or none given (the machine's, in no tenant), is refused.
#[test]
fn the_compute_verbs_connect_as_hostnqn() {
    const HOST: &str = "nqn.2026-11.io.nearstore:files-tenant-host";
    const SUB: &str = "nqn.2026-11.io.nearstore:disk0";
    let fs = Fs::new(64);
    let f = fs.mnt.join("app.log");
    std::fs::write(&f, "line\nERROR\n".repeat(5000)).unwrap();
    let cfg = fs.dir.path().join("t.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"{SUB}\"\nallow_any_host = true\n\
             [[subsystem.namespace]]\nnsid = 1\npath = \"{}\"\n\
             [[tenant]]\nname = \"logs\"\nhosts = [\"{HOST}\"]\n[[tenant.reach]]\nsubsystem = \"{SUB}\"\n",
            p(&fs.image)
        ),
    )
    .unwrap();
    let t = Target::start(&["--config", p(&cfg)]);
    let map = fs.dir.path().join("map.toml");
    std::fs::write(&map, format!("[[namespace]]\naddress = \"{}\"\nnqn = \"{SUB}\"\nnsid = 1\nfile = \"{}\"\n", t.addr, p(&fs.image)))
        .unwrap();
    let want = ok(&["checksum", "--local", p(&f)]);
    // (who, the arguments naming it, offloaded or refused)
    let cases: [(&str, &[&str], bool); 3] = [
        ("the tenant's host", &["--hostnqn", HOST], true),
        ("another host", &["--hostnqn", "nqn.2026-11.io.nearstore:files-stranger"], false),
        ("the machine's host", &[], false),
    ];
    for (who, identity, offloaded) in cases {
        let args: Vec<&str> =
            ["checksum", "--offload-only", "--map", p(&map)].into_iter().chain(identity.iter().copied()).chain([p(&f)]).collect();
        if offloaded {
            assert_eq!(ok(&args), want, "{who}");
        } else {
            let (out, err) = fails(&args);
            assert!(out.is_empty() && err.contains(SUB), "{who}: {err}");
        }
    }
}
