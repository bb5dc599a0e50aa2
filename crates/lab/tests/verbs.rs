//! The lab's verbs that need no testbed: the sort benchmark's data sets (gensort writes
//! them in pieces, valsort checks order and the multiset checksum), options refused with
//! their names, and the testbed refusing to start without the product's binary.

use std::path::Path;
mod common;

use common::{lab, ok, refused};

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn gensort_in_pieces_and_valsort_of_their_sort() {
    let dir = tempfile::tempdir().unwrap();
    let d = |n: &str| dir.path().join(n);
    ok(&["gensort", "--records", "3000", "--seed", "5", p(&d("g1"))]);
    ok(&["gensort", "--records", "2000", "--start", "3000", "--seed", "5", p(&d("g2"))]);
    let (g1, g2) = (std::fs::read(d("g1")).unwrap(), std::fs::read(d("g2")).unwrap());
    assert_eq!((g1.len(), g2.len()), (300_000, 200_000));
    // The pieces are one data set: the second starts at record 3000 of the first's numbering.
    assert_eq!(&g2[12..44], format!("{:032X}", 3000).as_bytes());
    let o = lab(&["valsort", "-o", "json", p(&d("g1")), p(&d("g2"))]);
    assert!(!o.status.success(), "unsorted records fail valsort");
    let before: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(before["records"], 5000);
    assert!(before["first_unordered"].is_u64());
    // Its error is JSON too, on stderr.
    let err: serde_json::Value = serde_json::from_slice(&o.stderr).unwrap();
    assert!(err["error"].as_str().unwrap().contains("not sorted: record"), "{err}");
    refused(&["valsort", p(&d("g1"))], 1, "not sorted: record");
    // Sorted by key here, the same records: in order, the same count and checksum.
    let all = [g1, g2].concat();
    let mut recs: Vec<&[u8]> = all.chunks(100).collect();
    recs.sort_by_key(|r| &r[..10]);
    std::fs::write(d("gs"), recs.concat()).unwrap();
    let after: serde_json::Value = serde_json::from_str(&ok(&["valsort", "-o", "json", p(&d("gs"))])).unwrap();
    assert!(after["first_unordered"].is_null(), "{after}");
    assert_eq!((after["records"].clone(), after["checksum"].clone()), (before["records"].clone(), before["checksum"].clone()));
    let text = ok(&["valsort", p(&d("gs"))]);
    assert!(text.contains("records 5000") && text.contains(before["checksum"].as_str().unwrap()), "{text}");
    // A lost record changes the checksum.
    std::fs::write(d("lost"), recs[1..].concat()).unwrap();
    let lost: serde_json::Value = serde_json::from_str(&ok(&["valsort", "-o", "json", p(&d("lost"))])).unwrap();
    assert_ne!(lost["checksum"], before["checksum"]);
    std::fs::write(d("short"), &all[..150]).unwrap();
    refused(&["valsort", p(&d("short"))], 1, "less than a 100-byte record");
}

/// Each line: arguments, exit status (2 a usage error from clap, 1 an error found later),
/// and what the error must say.
#[test]
fn options_are_checked_with_their_names() {
    let cases: &[(&[&str], i32, &str)] = &[
        (&["demo", "--file-size", "8MiB", "--runs", "0"], 2, "invalid value '0' for '--runs"),
        (&["demo", "--file-size", "8 apples"], 2, "for '--file-size"),
        (&["testbed", "up", "--file-size", "4KiB", "--image-size", "1GiB", "--targets", "0"], 2, "for '--targets"),
        (&["testbed", "up", "--image-size", "1 GB please"], 2, "for '--image-size"),
        (&["testbed", "experiment", "checksum", "--out", "x", "--file-size", "16MiB", "--runs", "0"], 2, "for '--runs"),
        (&["gensort", "--records", "many", "x"], 2, "for '--records"),
        (&["gensort", "--records", "1", "--start", "18446744073709551615", "/dev/null"], 1, "--start + --records overflows"),
        (&["valsort"], 2, "<FILES>"),
        (&["valsort", "/nonexistent/records"], 1, "/nonexistent/records"),
        (&["testbed", "frobnicate"], 2, "unrecognized subcommand 'frobnicate'"),
    ];
    for (args, status, needle) in cases {
        refused(args, *status, needle);
    }
}

/// A testbed needs the product's binary for its targets: without one beside nearstore-lab
/// or on PATH, `up` says so before it makes anything.
#[test]
fn testbed_up_without_the_product_binary_is_refused_first() {
    let dir = tempfile::tempdir().unwrap();
    let alone = dir.path().join("nearstore-lab");
    std::fs::copy(env!("CARGO_BIN_EXE_nearstore-lab"), &alone).unwrap();
    let o = std::process::Command::new(&alone)
        .args(["testbed", "up", "--dir", p(&dir.path().join("tb"))])
        .env("PATH", dir.path().join("empty"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("runs the `nearstore` binary, which is neither beside") && err.contains("cargo build -p nearstore"), "{err}");
    assert!(!dir.path().join("tb").exists(), "nothing is made");
}

/// A product binary older than one of its sources is found stale (so `product()` refuses
/// to run it); one built after all of them is not. The product's sources are found.
#[test]
fn a_stale_product_binary_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let at = |name: &str, secs: u64| {
        let p = dir.path().join(name);
        let f = std::fs::File::create(&p).unwrap();
        f.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs)).unwrap();
        p
    };
    let bin = at("nearstore", 2000);
    // (what, sources' modification times, stale)
    let cases: &[(&str, &[u64], bool)] =
        &[("built after its sources", &[1000, 1999], false), ("a source changed since", &[1000, 2001], true), ("no sources", &[], false)];
    for (i, (what, times, stale)) in cases.iter().enumerate() {
        let sources: Vec<_> = times.iter().enumerate().map(|(j, &t)| at(&format!("src{i}-{j}.rs"), t)).collect();
        assert_eq!(common::newer_source(&bin, &sources).is_some(), *stale, "{what}");
    }
    let sources = common::product_sources();
    for crate_dir in ["cli", "nvmf-target", "wire", "compute", "initiator"] {
        assert!(
            sources.iter().any(|s| s.to_string_lossy().contains(&format!("crates/{crate_dir}/src/"))),
            "no source of crates/{crate_dir}"
        );
    }
    assert!(!sources.iter().any(|s| s.to_string_lossy().contains("crates/lab/")), "the lab is not the product");
}
