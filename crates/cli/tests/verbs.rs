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
    // Fixed-size records by a key: 100-byte records with 10-byte keys (the sort benchmark's
    // shape), in two files, sort into the order of their keys with every record kept.
    let record = |i: u64| -> Vec<u8> {
        let key = (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 24).to_be_bytes();
        [&key[..], &[0x00, 0x11], format!("{i:090}").as_bytes()].concat()
    };
    let (r1, r2): (Vec<u8>, Vec<u8>) = ((0..3000).flat_map(record).collect(), (3000..5000).flat_map(record).collect());
    std::fs::write(d("g1"), &r1).unwrap();
    std::fs::write(d("g2"), &r2).unwrap();
    ok(&["sort", "--local", "--record-size", "100", "--key-length", "10", "--into", p(&d("gs")), p(&d("g1")), p(&d("g2"))]);
    let all = [r1, r2].concat();
    let mut want: Vec<&[u8]> = all.chunks(100).collect();
    want.sort_by_key(|r| &r[..10]);
    assert_eq!(std::fs::read(d("gs")).unwrap(), want.concat());
    // grep -c, as grep users type it.
    assert_eq!(ok(&["grep", "-c", "c", "--local", p(&d("a"))]), format!("{}:1\n", p(&d("a"))));
    refused(&["decompress", "--local", p(&d("text")), p(&d("x"))], "does not say its decompressed size");
    refused(&["decompress", "--local", "--capacity", "100000", p(&d("text")), p(&d("x"))], "decompress: bad input data");
    refused(&["compress", "--local", "-l", "99", p(&d("text")), p(&d("x"))], "level 99 is outside");
    refused(&["sort", "--local", "--key-length", "4", "--into", p(&d("x")), p(&d("text"))], "--record-size");
    refused(&["sort", "--local", "--record-size", "7", "--into", p(&d("x")), p(&d("text"))], "not a multiple of the 7-byte record");
    refused(&["sort", "--local", p(&d("text"))], "--into");
}
