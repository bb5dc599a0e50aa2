//! The compute verbs from the command line, on the host (`--local`): what they print, what
//! they write, and that bad arguments get a message naming the problem, never a panic.

use std::path::Path;
mod common;

use common::{nearstore, ok};

/// Fails with exit status 1 or 2 (an error or a usage error, not a panic's 101) and a
/// message containing `needle`.
fn refused(args: &[&str], needle: &str) {
    let o = nearstore(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(matches!(o.status.code(), Some(1) | Some(2)), "{args:?}: status {:?}, {err}", o.status);
    assert!(err.contains(needle), "{args:?}: {err:?} lacks {needle:?}");
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn select_prints_csv_and_json_and_writes_rows() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("orders.csv");
    std::fs::write(&csv, "id,city,amount\n1,Oslo,10.5\n2,\"Lima, PE\",3\n3,Oslo,\n").unwrap();
    let out = ok(&["select", "--local", "SELECT city, COUNT(*), SUM(amount) FROM s3object GROUP BY city ORDER BY city", p(&csv)]);
    assert_eq!(out, "city,COUNT(*),SUM(amount)\n\"Lima, PE\",1,3\nOslo,2,10.5\n");
    let json = ok(&["select", "--local", "-o", "json", "SELECT MAX(id) AS top FROM t", p(&csv)]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["files"][0]["outcome"]["rows"], serde_json::json!([[3]]));
    assert_eq!(v["files"][0]["how"]["how"], "local");
    let rows = dir.path().join("oslo.jsonl");
    ok(&["select", "--local", "--into", p(&rows), "--into-format", "jsonl", "SELECT id FROM t WHERE city = 'Oslo'", p(&csv)]);
    assert_eq!(std::fs::read_to_string(&rows).unwrap(), "{\"id\":1}\n{\"id\":3}\n");
    // No row matches: a CSV output still has its header line.
    ok(&["select", "--local", "--into", p(&rows), "SELECT id, city AS place FROM t WHERE id > 10", p(&csv)]);
    assert_eq!(std::fs::read_to_string(&rows).unwrap(), "id,place\n");

    refused(&["select", "--local", "SELECT nope FROM t", p(&csv)], "no column \"nope\" in the header (id, city, amount)");
    refused(&["select", "--local", "SELECT FROM", p(&csv)], "query:");
    refused(&["select", "--local", "--delimiter", "\"", "SELECT 1 FROM t", p(&csv)], "delimiter, quote and comment must differ");
    refused(&["select", "--local", "--into", p(&rows), "SELECT 1 FROM t", p(&csv), p(&csv)], "--into takes one input file");
    refused(&["select", "--local", "SELECT 1 FROM t", p(&dir.path().join("missing.csv"))], "missing.csv");
    // A cause is said once, not again by the error chain.
    let o = nearstore(&["checksum", "--local", p(&dir.path().join("missing.csv"))]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
}

#[test]
fn compress_decompress_sort_merge() {
    let dir = tempfile::tempdir().unwrap();
    let d = |n: &str| dir.path().join(n);
    let text: String = (0..20_000).map(|i| format!("line {}\n", (i * 7919) % 20_000)).collect();
    std::fs::write(d("text"), &text).unwrap();
    let out = ok(&["compress", "--local", "-l", "19", p(&d("text")), p(&d("text.zst"))]);
    assert!(out.contains("written (") && out.contains(":1)"), "{out}");
    ok(&["decompress", "--local", p(&d("text.zst")), p(&d("text.back"))]);
    assert_eq!(std::fs::read_to_string(d("text.back")).unwrap(), text);

    ok(&["sort", "--local", "--into", p(&d("sorted")), p(&d("text"))]);
    let mut lines: Vec<&str> = text.lines().collect();
    lines.sort();
    assert_eq!(std::fs::read_to_string(d("sorted")).unwrap(), lines.join("\n") + "\n");
    std::fs::write(d("a"), "a\nc\n").unwrap();
    std::fs::write(d("b"), "b\nd\n").unwrap();
    ok(&["merge", "--local", "--into", p(&d("m")), p(&d("a")), p(&d("b"))]);
    assert_eq!(std::fs::read_to_string(d("m")).unwrap(), "a\nb\nc\nd\n");

    refused(&["merge", "--local", "--into", p(&d("m2")), p(&d("text"))], "input 0 is not sorted");
    // An output that is an input, under its own name or another (a hard link), is refused and
    // the input is left as it was.
    std::fs::hard_link(d("b"), d("b-link")).unwrap();
    for into in ["b", "b-link"] {
        refused(&["merge", "--local", "--into", p(&d(into)), p(&d("a")), p(&d("b"))], "is input 1");
        assert_eq!(std::fs::read_to_string(d("b")).unwrap(), "b\nd\n");
    }
    refused(&["compress", "--local", p(&d("a")), p(&d("a"))], "writing it would destroy the input");
    // The sort benchmark's records: generated in two pieces, sorted on the host, validated.
    ok(&["gensort", "--records", "3000", "--seed", "5", p(&d("g1"))]);
    ok(&["gensort", "--records", "2000", "--start", "3000", "--seed", "5", p(&d("g2"))]);
    let o = nearstore(&["valsort", "-o", "json", p(&d("g1")), p(&d("g2"))]);
    assert!(!o.status.success(), "unsorted records fail valsort");
    let before: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(before["records"], 5000);
    assert!(before["first_unordered"].is_u64());
    refused(&["valsort", p(&d("g1"))], "not sorted: record");
    ok(&["sort", "--local", "--record-size", "100", "--key-length", "10", "--into", p(&d("gs")), p(&d("g1")), p(&d("g2"))]);
    let after: serde_json::Value = serde_json::from_str(&ok(&["valsort", "-o", "json", p(&d("gs"))])).unwrap();
    assert_eq!((after["records"].clone(), after["checksum"].clone()), (before["records"].clone(), before["checksum"].clone()));
    refused(&["valsort", p(&d("a"))], "less than a 100-byte record");
    // grep -c, as grep users type it.
    assert_eq!(ok(&["grep", "-c", "c", "--local", p(&d("a"))]), format!("{}:1\n", p(&d("a"))));
    refused(&["decompress", "--local", p(&d("text")), p(&d("x"))], "does not say its decompressed size");
    refused(&["decompress", "--local", "--capacity", "100000", p(&d("text")), p(&d("x"))], "decompress: bad input data");
    refused(&["compress", "--local", "-l", "99", p(&d("text")), p(&d("x"))], "level 99 is outside");
    refused(&["sort", "--local", "--key-length", "4", "--into", p(&d("x")), p(&d("text"))], "--record-size");
    refused(&["sort", "--local", "--record-size", "7", "--into", p(&d("x")), p(&d("text"))], "not a multiple of the 7-byte record");
    refused(&["sort", "--local", p(&d("text"))], "--into");
}
