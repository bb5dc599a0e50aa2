//! `select` against SQLite: the same rows, as CSV and as JSON lines, split into chunks at
//! every kind of boundary, and the same queries; the results must be equal.

use nearstore_compute::{by_name, ComputeError, Context, Outcome, SliceSource, VecSink};
use rusqlite::types::ValueRef;

/// A value as both engines give it back, for comparison: booleans are SQLite's 0 and 1.
#[derive(Clone, Debug, PartialEq, PartialOrd)]
enum V {
    Null,
    Num(f64),
    Text(String),
}

fn from_json(v: &serde_json::Value) -> V {
    match v {
        serde_json::Value::Null => V::Null,
        serde_json::Value::Bool(b) => V::Num(*b as i64 as f64),
        serde_json::Value::Number(n) => V::Num(n.as_f64().unwrap()),
        serde_json::Value::String(s) => V::Text(s.clone()),
        other => panic!("unexpected {other}"),
    }
}

struct Table {
    csv: Vec<u8>,
    jsonl: Vec<u8>,
    db: rusqlite::Connection,
}

/// Rows with NULLs everywhere, negative numbers, floats that sum exactly in any order,
/// and text that needs quoting (delimiters, quotes, line breaks, LIKE's wildcards).
fn table(rows: usize) -> Table {
    let groups = [Some("north"), Some("south"), Some("East"), Some("we,st"), Some("q\"uote"), None];
    let words =
        [Some("hello world"), Some("line\nbreak"), Some("50% off"), Some("under_score"), Some(" pad "), Some("Zebra"), Some("apple"), None];
    let db = rusqlite::Connection::open_in_memory().unwrap();
    db.execute_batch("PRAGMA case_sensitive_like = ON; CREATE TABLE t (id INTEGER, g TEXT, n INTEGER, x REAL, s TEXT);").unwrap();
    let mut csv = b"id,g,n,x,s\n".to_vec();
    let mut jsonl = Vec::new();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut rnd = |m: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % m
    };
    for id in 1..=rows as i64 {
        let g = groups[rnd(groups.len() as u64) as usize];
        let n = (rnd(10) != 0).then(|| rnd(101) as i64 - 50);
        let x = (rnd(10) != 0).then(|| {
            let k = rnd(800) as i64 - 400;
            (if k % 4 == 0 { k + 1 } else { k }) as f64 * 0.25
        });
        let s = words[rnd(words.len() as u64) as usize];
        db.execute("INSERT INTO t VALUES (?1, ?2, ?3, ?4, ?5)", rusqlite::params![id, g, n, x, s]).unwrap();
        let quote = |t: &str| if t.contains([',', '"', '\n']) { format!("\"{}\"", t.replace('"', "\"\"")) } else { t.to_string() };
        csv.extend_from_slice(
            format!(
                "{id},{},{},{},{}\r\n",
                g.map(quote).unwrap_or_default(),
                n.map(|n| n.to_string()).unwrap_or_default(),
                x.map(|x| format!("{x:?}")).unwrap_or_default(),
                s.map(quote).unwrap_or_default()
            )
            .as_bytes(),
        );
        let mut o = serde_json::json!({ "id": id, "g": g, "n": n, "x": x });
        // A missing key reads as NULL, as an explicit null does.
        if let Some(s) = s {
            o["s"] = s.into();
        }
        jsonl.extend_from_slice(o.to_string().as_bytes());
        jsonl.push(b'\n');
    }
    Table { csv, jsonl, db }
}

fn sqlite(db: &rusqlite::Connection, q: &str) -> Vec<Vec<V>> {
    let mut st = db.prepare(q).unwrap_or_else(|e| panic!("sqlite: {q}: {e}"));
    let n = st.column_count();
    let rows = st
        .query_map([], |r| {
            Ok((0..n)
                .map(|i| match r.get_ref(i).unwrap() {
                    ValueRef::Null => V::Null,
                    ValueRef::Integer(i) => V::Num(i as f64),
                    ValueRef::Real(f) => V::Num(f),
                    ValueRef::Text(t) => V::Text(String::from_utf8(t.to_vec()).unwrap()),
                    ValueRef::Blob(_) => panic!("blob"),
                })
                .collect())
        })
        .unwrap();
    rows.map(Result::unwrap).collect()
}

fn args(query: &str, format: &str) -> Vec<u8> {
    serde_json::json!({ "query": query, "format": format }).to_string().into_bytes()
}

/// Runs select inline over `data` cut into pieces of `chunk` bytes.
fn select(args: &[u8], data: &[u8], chunk: usize) -> Result<Outcome, ComputeError> {
    let mut src = SliceSource::new(data.chunks(chunk.max(1)));
    Ok(by_name("select").unwrap().execute(args, &mut [&mut src], &mut [], &Context::default())?.remove(0))
}

/// The error, without printing a large result when there is none.
fn fails(r: Result<Outcome, ComputeError>) -> ComputeError {
    match r {
        Ok(o) => panic!("expected an error, got {:.300}", format!("{o:?}")),
        Err(e) => e,
    }
}

fn values(o: &Outcome) -> Vec<Vec<V>> {
    let Outcome::Select { rows, .. } = o else { panic!("{o:?}") };
    rows.iter().map(|r| r.iter().map(from_json).collect()).collect()
}

fn close(a: &[Vec<V>], b: &[Vec<V>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.len() == y.len()
                && x.iter().zip(y).all(|(p, q)| match (p, q) {
                    (V::Num(p), V::Num(q)) => (p - q).abs() <= 1e-9 * p.abs().max(1.0),
                    (p, q) => p == q,
                })
        })
}

fn sorted(mut r: Vec<Vec<V>>) -> Vec<Vec<V>> {
    r.sort_by(|a, b| a.partial_cmp(b).unwrap());
    r
}

const QUERIES: &[&str] = &[
    "SELECT COUNT(*) FROM t",
    "SELECT COUNT(*), COUNT(n), SUM(n), MIN(n), MAX(n), AVG(n) FROM t",
    "SELECT SUM(x), MIN(x), MAX(x), AVG(x), COUNT(x) FROM t",
    "SELECT MIN(s), MAX(s), COUNT(s), MIN(g), MAX(g) FROM t",
    "SELECT g, COUNT(*), SUM(n), AVG(x), MIN(s) FROM t GROUP BY g",
    "SELECT g, COUNT(*) FROM t WHERE n > 0 GROUP BY g HAVING COUNT(*) > 5",
    "SELECT g FROM t GROUP BY g HAVING MAX(n) > 40 AND MIN(x) < 0",
    "SELECT g, n % 3, COUNT(*), MAX(x) FROM t GROUP BY g, n % 3",
    "SELECT n % 4, COUNT(*) FROM t GROUP BY 1",
    "SELECT id, n, x FROM t WHERE n IS NULL",
    "SELECT id FROM t WHERE x IS NOT NULL AND n < 0 OR s LIKE 'h%'",
    "SELECT id, s FROM t WHERE s LIKE '%o_%'",
    "SELECT id FROM t WHERE s LIKE '50!%%' ESCAPE '!'",
    "SELECT id FROM t WHERE s NOT LIKE '%e%'",
    "SELECT id FROM t WHERE s LIKE '%\n%'",
    "SELECT id FROM t WHERE NOT (n BETWEEN -10 AND 10)",
    "SELECT id FROM t WHERE x NOT BETWEEN -1 AND 1.5",
    "SELECT id FROM t WHERE n IN (1, 2, 3, NULL)",
    "SELECT id FROM t WHERE n NOT IN (1, 2, 3)",
    "SELECT id FROM t WHERE n NOT IN (1, NULL)",
    "SELECT id, n * 2 + 1, n / 3, n % 7, -n, x * n, x / 0, n / 0 FROM t",
    "SELECT id, CAST(x AS INTEGER), CAST(n AS REAL), CAST(n AS TEXT), CAST(x AS TEXT) FROM t",
    "SELECT id, g || '-' || s FROM t",
    "SELECT id, UPPER(g), LOWER(s), LENGTH(s), LENGTH(n) FROM t",
    "SELECT id, COALESCE(n, x, 0), NULLIF(n, 0), ABS(n), ABS(x) FROM t",
    "SELECT id, SUBSTR(s, 2, 3), SUBSTR(s, 4) FROM t",
    "SELECT id, TRIM(s), LTRIM(s), RTRIM(s) FROM t",
    "SELECT id, CASE WHEN n > 0 THEN 'pos' WHEN n < 0 THEN 'neg' ELSE 'zero or null' END FROM t",
    "SELECT id, CASE g WHEN 'north' THEN 1 WHEN 'south' THEN 2 END FROM t",
    "SELECT id, n FROM t ORDER BY n DESC, id LIMIT 10",
    "SELECT id, x FROM t ORDER BY x, id LIMIT 20 OFFSET 5",
    "SELECT id, s FROM t ORDER BY s DESC NULLS FIRST, id",
    "SELECT g, SUM(n) AS total FROM t GROUP BY g ORDER BY total DESC, g",
    "SELECT id, n FROM t WHERE n >= 10 ORDER BY 2, 1 LIMIT 5",
    "SELECT id FROM t WHERE n = x",
    "SELECT id FROM t WHERE n < x AND x < 3",
    "SELECT id FROM t WHERE s > 'm'",
    "SELECT id FROM t WHERE s >= g",
    "SELECT COUNT(*) FROM t WHERE n > 100",
    "SELECT SUM(n), AVG(n), MIN(s), MAX(x) FROM t WHERE n > 100",
    "SELECT g, COUNT(*) FROM t WHERE n > 100 GROUP BY g",
    "SELECT id FROM t WHERE (n > 0) IS TRUE",
    "SELECT id FROM t WHERE (n > 0) IS NOT FALSE",
    "SELECT id FROM t WHERE n IS DISTINCT FROM 5",
    "SELECT id FROM t WHERE g IS NOT DISTINCT FROM NULL",
    "SELECT COUNT(*) FROM t WHERE g IS NULL",
    "SELECT id, n > 0, n = 3 OR n IS NULL, NOT n < 0 FROM t",
    "SELECT SUM(n > 0), SUM(CASE WHEN x > 0 THEN x END) FROM t",
    "SELECT id, s FROM t WHERE s = 'line\nbreak' OR g = 'we,st' OR g = 'q\"uote'",
    "SELECT id FROM t LIMIT 7",
    "SELECT id FROM t LIMIT 0",
    "SELECT id FROM t ORDER BY id DESC LIMIT 3",
    "SELECT 1 + 2, 'lit', NULL FROM t LIMIT 2",
];

#[test]
fn select_equals_sqlite_on_csv_and_json_lines() {
    let t = table(600);
    for q in QUERIES {
        let want = sqlite(&t.db, q);
        let ordered = q.contains("ORDER BY") || q.contains("LIMIT");
        for (format, data) in [("csv", &t.csv), ("jsonl", &t.jsonl)] {
            // Whole, and cut where records, quoted fields and line ends cross chunks.
            for chunk in [data.len(), 4096, 61, 7, 1] {
                let got = values(&select(&args(q, format), data, chunk).unwrap_or_else(|e| panic!("{q} ({format}): {e}")));
                let (g, w) = if ordered { (got, want.clone()) } else { (sorted(got), sorted(want.clone())) };
                assert!(close(&g, &w), "{q} ({format}, chunks of {chunk}):\n ours   {g:?}\n sqlite {w:?}");
                if chunk < 61 && format == "jsonl" {
                    break; // JSON lines have no state across chunks worth more time.
                }
            }
        }
    }
}

#[test]
fn random_conditions_equal_sqlite() {
    // Conditions built from comparisons of each column with constants of its type, joined
    // by AND, OR, NOT: three-valued logic over NULLs is where engines differ.
    let t = table(300);
    let atoms = [
        "n > 3",
        "n <= -7",
        "n = 0",
        "n <> 12",
        "x < 0.5",
        "x >= -20.25",
        "x = n",
        "s LIKE '%e%'",
        "s < 'k'",
        "g = 'north'",
        "g IN ('East', 'south')",
        "n IS NULL",
        "x IS NOT NULL",
        "s IS NULL",
        "n BETWEEN -5 AND 5",
        "n + x > 0",
        "n * 2 = x",
        "NULL",
        "n IN (1, NULL)",
    ];
    let mut seed = 7u64;
    let mut rnd = |m: usize| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((seed >> 33) % m as u64) as usize
    };
    for _ in 0..150 {
        let mut e = atoms[rnd(atoms.len())].to_string();
        for _ in 0..rnd(4) {
            let a = atoms[rnd(atoms.len())];
            e = match rnd(4) {
                0 => format!("({e}) AND ({a})"),
                1 => format!("({e}) OR ({a})"),
                2 => format!("NOT ({e}) OR {a}"),
                _ => format!("({a}) AND NOT ({e})"),
            };
        }
        for q in [format!("SELECT id FROM t WHERE {e}"), format!("SELECT COUNT(*), SUM(n), MIN(s), MAX(x) FROM t WHERE {e}")] {
            let want = sorted(sqlite(&t.db, &q));
            for (format, data) in [("csv", &t.csv), ("jsonl", &t.jsonl)] {
                let got = sorted(values(&select(&args(&q, format), data, 4096).unwrap()));
                assert!(close(&got, &want), "{q} ({format}):\n ours   {got:?}\n sqlite {want:?}");
            }
        }
    }
}

#[test]
fn csv_dialects_headers_and_positions() {
    let with = |extra: serde_json::Value| {
        let mut a = serde_json::json!({ "query": "" });
        a.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        a.to_string().into_bytes()
    };
    // No header: columns by position; the first record is data.
    let data = b"1;a;'x;y'\n2;b;'it''s'\n";
    let a =
        with(serde_json::json!({ "query": "SELECT _1, _3 FROM s3object WHERE _1 >= 1", "header": false, "delimiter": ";", "quote": "'" }));
    let o = select(&a, data, 3).unwrap();
    assert_eq!(values(&o), vec![vec![V::Num(1.0), V::Text("x;y".into())], vec![V::Num(2.0), V::Text("it's".into())]]);
    let Outcome::Select { columns, records, matched, rows_out, .. } = &o else { unreachable!() };
    assert_eq!((columns.clone(), *records, *matched, *rows_out), (vec!["_1".to_string(), "_3".to_string()], 2, 2, 2));
    // SELECT * without a header names the columns _1, _2, ...
    let a = with(serde_json::json!({ "query": "SELECT * FROM t", "header": false, "delimiter": "\t" }));
    let Outcome::Select { columns, rows, .. } = select(&a, b"7\tz\n", 64).unwrap() else { unreachable!() };
    assert_eq!(columns, ["_1", "_2"]);
    assert_eq!(rows, vec![vec![serde_json::json!(7), serde_json::json!("z")]]);
    // Header names: unquoted names ignore case, quoted names do not; positions still work;
    // comments skipped; a short record's missing fields are NULL.
    let data = b"Name,Age\n# a comment\nann,31\nbob\n";
    let a = with(serde_json::json!({ "query": "SELECT name, s.\"Age\", _2 FROM s3object s", "comment": "#" }));
    assert_eq!(
        values(&select(&a, data, 5).unwrap()),
        vec![vec![V::Text("ann".into()), V::Num(31.0), V::Num(31.0)], vec![V::Text("bob".into()), V::Null, V::Null]]
    );
    let a = with(serde_json::json!({ "query": "SELECT \"age\" FROM t" }));
    let e = select(&a, data, 64).unwrap_err().to_string();
    assert!(e.contains("no column \"age\" in the header (Name, Age)"), "{e}");
    let a = with(serde_json::json!({ "query": "SELECT name FROM t", "header": false }));
    assert!(select(&a, data, 64).unwrap_err().to_string().contains("no header: name the columns _1, _2"));
    // An empty object: aggregates give their empty values, rows give none.
    let Outcome::Select { rows, columns, .. } = select(&args("SELECT COUNT(*), SUM(a) AS s FROM t", "csv"), b"", 1).unwrap() else {
        unreachable!()
    };
    assert_eq!((columns, rows), (vec!["COUNT(*)".to_string(), "s".to_string()], vec![vec![serde_json::json!(0), serde_json::Value::Null]]));
    let Outcome::Select { rows, .. } = select(&args("SELECT a FROM t", "csv"), b"a\n", 1).unwrap() else { unreachable!() };
    assert!(rows.is_empty());
}

#[test]
fn json_lines_nested_fields_and_booleans() {
    let data = b"{\"a\":{\"b\":1,\"c\":\"x\"},\"ok\":true}\n\n{\"a\":{\"b\":2},\"ok\":false,\"n\":1.5}\r\n{\"a\":3}";
    let q = "SELECT s.a.b, a.c, ok, n FROM s3object s WHERE ok OR a = 3";
    assert_eq!(
        values(&select(&args(q, "jsonl"), data, 2).unwrap()),
        vec![vec![V::Num(1.0), V::Text("x".into()), V::Num(1.0), V::Null], vec![V::Null, V::Null, V::Null, V::Null]]
    );
    let Outcome::Select { rows, .. } = select(&args("SELECT ok FROM t WHERE NOT ok", "jsonl"), data, 64).unwrap() else { unreachable!() };
    assert_eq!(rows, vec![vec![serde_json::json!(false)]]);
    let e = select(&args("SELECT a FROM t", "jsonl"), b"{\"a\":1}\n[1,2]\n", 64).unwrap_err();
    assert_eq!(e.to_string(), "select: bad input data: record 2: not a JSON object");
    let e = select(&args("SELECT a FROM t", "jsonl"), b"{\"a\":1}\n{\"a\":\n", 64).unwrap_err();
    assert!(e.to_string().starts_with("select: bad input data: record 2: not JSON"), "{e}");
}

#[test]
fn rows_go_to_an_output_object_as_csv_or_json_lines() {
    let t = table(200);
    let q = "SELECT id, g, s, x FROM t WHERE n > 0 ORDER BY id";
    let inline = select(&args(q, "csv"), &t.csv, 4096).unwrap();
    let op = by_name("select").unwrap();
    for out_format in ["csv", "jsonl"] {
        let a = serde_json::json!({ "query": q, "output_format": out_format }).to_string().into_bytes();
        let mut src = SliceSource::new(t.csv.chunks(100));
        let mut out = VecSink::new(1 << 20);
        let o = op.execute(&a, &mut [&mut src], &mut [&mut out], &Context::default()).unwrap().remove(0);
        let Outcome::Select { rows, output, rows_out, .. } = &o else { panic!() };
        assert!(rows.is_empty());
        assert_eq!(*output, out.data.len() as u64);
        // Read the output back with select itself: the same rows.
        let back = select(&args("SELECT * FROM t", out_format), &out.data, 4096).unwrap();
        assert_eq!(rows_out, &(values(&back).len() as u64));
        assert!(close(&crate::values(&back), &values(&inline)), "{out_format}");
    }
    // A small output object is refused when it fills.
    let a = serde_json::json!({ "query": "SELECT * FROM t" }).to_string().into_bytes();
    let mut src = SliceSource::new([&t.csv[..]]);
    let mut out = VecSink::new(100);
    let e = op.execute(&a, &mut [&mut src], &mut [&mut out], &Context::default()).unwrap_err();
    assert_eq!(e, ComputeError::OutputFull { capacity: 100 });
    // One input per output object.
    let (mut s1, mut s2) = (SliceSource::new([&t.csv[..]]), SliceSource::new([&t.csv[..]]));
    let mut out = VecSink::new(1 << 20);
    let e = op.execute(&a, &mut [&mut s1, &mut s2], &mut [&mut out], &Context::default()).unwrap_err();
    assert_eq!(e.to_string(), "select takes 1 input objects, not 2");
}

#[test]
fn limits_and_bad_input_are_refused_by_name() {
    let t = table(8000);
    // Inline rows are bounded.
    let e = fails(select(&args("SELECT * FROM t", "csv"), &t.csv, 4096));
    assert_eq!(e.to_string(), "select returns more than 131072 bytes inline: give it an output object");
    // Groups and ORDER BY rows are bounded by the command's memory.
    let op = by_name("select").unwrap();
    let small = Context::with_memory(64 << 10);
    for q in ["SELECT id, COUNT(*) FROM t GROUP BY id", "SELECT id FROM t ORDER BY s LIMIT 1"] {
        let mut src = SliceSource::new([&t.csv[..]]);
        let e = op.execute(&args(q, "csv"), &mut [&mut src], &mut [], &small).unwrap_err();
        assert!(matches!(e, ComputeError::Memory { .. }), "{q}: {e}");
    }
    // LIMIT without ORDER BY stops reading early.
    let Outcome::Select { records, .. } = select(&args("SELECT id FROM t LIMIT 3", "csv"), &t.csv, 64).unwrap() else { unreachable!() };
    assert!(records < 10, "{records}");
    // Data errors name the record; bad arguments name the field.
    let e = select(&args("SELECT SUM(a) FROM t", "csv"), b"a\n1\nxyz\n", 64).unwrap_err();
    assert_eq!(e.to_string(), "select: bad input data: record 2: SUM or AVG of the text 'xyz'");
    let e = select(&args("SELECT CAST(a AS INT) FROM t", "csv"), b"a\n1\n2x\n", 64).unwrap_err();
    assert!(e.to_string().contains("record 2: CAST('2x' AS Int)"), "{e}");
    let e = select(&args("SELECT a FROM t WHERE a", "csv"), b"a\nyes\n", 64).unwrap_err();
    assert!(e.to_string().contains("record 1: a condition is the text 'yes'"), "{e}");
    let long = [b"a\n".to_vec(), vec![b'x'; (1 << 20) + 10]].concat();
    let e = select(&args("SELECT a FROM t", "csv"), &long, 1 << 16).unwrap_err();
    assert!(e.to_string().contains("longer than 1048576 bytes"), "{e}");
    for (a, want) in [
        (serde_json::json!({ "query": "SELECT" }), "query: "),
        (serde_json::json!({ "query": "SELECT a FROM t", "delimiter": "\n" }), "delimiter must be one ASCII character"),
        (serde_json::json!({ "query": "SELECT a FROM t", "delimiter": "\"" }), "must differ"),
        (serde_json::json!({ "query": "SELECT a FROM t", "format": "xml" }), "unknown variant `xml`"),
        (serde_json::json!({ "query": "SELECT a FROM t", "colour": 1 }), "unknown field `colour`"),
        (serde_json::json!({}), "missing field `query`"),
    ] {
        let e = op.check(a.to_string().as_bytes(), 1, 0).unwrap_err().to_string();
        assert!(e.starts_with("arguments of select: ") && e.contains(want), "{e}");
    }
}

#[test]
fn float_results_survive_the_wire_exactly() {
    // Results travel as JSON from the target: a float must parse back to the same bits
    // (serde_json's float_roundtrip), or offloaded and local results differ in the last place.
    for f in [500.19648211184443f64, 0.1 + 0.2, 1e-300, 123456.789e100, -2.5e-7] {
        let o = Outcome::Select {
            columns: vec!["x".into()],
            rows: vec![vec![serde_json::json!(f)]],
            records: 1,
            matched: 1,
            rows_out: 1,
            output: 0,
        };
        let back: Outcome = serde_json::from_str(&serde_json::to_string(&o).unwrap()).unwrap();
        assert_eq!(back, o, "{f:?}");
    }
}

/// One identifier rule everywhere (select list, WHERE, GROUP BY, HAVING, ORDER BY, aliases,
/// JSON paths): unquoted ignoring case, quoted exactly; a name matching two fields is refused
/// naming both.
#[test]
fn identifiers_follow_one_rule_in_every_place() {
    let csv = b"carrier,delay\nAA,1\nBB,2\nAA,3\n";
    let json = b"{\"carrier\":\"AA\",\"s\":{\"city\":\"Oslo\"},\"delay\":1}\n{\"carrier\":\"BB\",\"s\":{\"city\":\"Rome\"},\"delay\":2}\n{\"carrier\":\"AA\",\"s\":{\"city\":\"Oslo\"},\"delay\":3}\n";
    let grouped = serde_json::json!([["AA", 4], ["BB", 2]]);
    for (format, data) in [("csv", &csv[..]), ("jsonl", &json[..])] {
        for (query, want) in [
            ("SELECT carrier, SUM(delay) FROM t GROUP BY CARRIER ORDER BY carrier", &grouped),
            ("SELECT CARRIER, SUM(Delay) FROM t GROUP BY \"carrier\" ORDER BY Carrier", &grouped),
            ("SELECT \"carrier\", SUM(delay) FROM t GROUP BY carrier HAVING COUNT(CARRIER) > 0 ORDER BY 1", &grouped),
            ("SELECT t.Carrier, SUM(DELAY) FROM t GROUP BY t.carrier HAVING Carrier <> 'x' ORDER BY CARRIER", &grouped),
            ("SELECT carrier AS c, SUM(delay) AS total FROM t WHERE CARRIER <> 'x' GROUP BY Carrier ORDER BY C", &grouped),
            ("SELECT carrier AS \"C\", SUM(delay) FROM t GROUP BY carrier ORDER BY \"C\"", &grouped),
            ("SELECT CARRIER FROM t WHERE \"carrier\" = 'BB' AND Delay = 2", &serde_json::json!([["BB"]])),
        ] {
            let o = select(&args(query, format), data, 7).unwrap_or_else(|e| panic!("{format}: {query}: {e}"));
            let Outcome::Select { rows, .. } = o else { panic!() };
            assert_eq!(serde_json::Value::from(rows), *want, "{format}: {query}");
        }
    }
    let o = select(&args("SELECT S.CITY, s.\"city\" FROM t LIMIT 1", "jsonl"), json, 7).unwrap();
    let Outcome::Select { rows, .. } = o else { panic!() };
    assert_eq!(serde_json::Value::from(rows), serde_json::json!([["Oslo", "Oslo"]]));
    // Refused: two fields by the rule, a quoted spelling no field has, two outputs.
    let twice = b"Carrier,carrier\nAA,BB\n";
    let twice_json = b"{\"Carrier\":\"AA\",\"carrier\":\"BB\"}\n";
    for (format, data, query, want) in [
        ("csv", &twice[..], "SELECT carrier FROM t", "matches the header fields \"Carrier\" and \"carrier\""),
        ("jsonl", &twice_json[..], "SELECT CARRIER FROM t", "matches the keys \"Carrier\" and \"carrier\""),
        ("csv", &csv[..], "SELECT \"Carrier\" FROM t", "no column \"Carrier\""),
        ("csv", &csv[..], "SELECT carrier AS x, delay AS X FROM t ORDER BY x", "matches the output columns \"x\" and \"X\""),
    ] {
        let e = fails(select(&args(query, format), data, 7)).to_string();
        assert!(e.contains(want), "{query}: {e}");
    }
    // Quoted names tell apart what unquoted ones cannot.
    let o = select(&args("SELECT \"carrier\", \"Carrier\" FROM t", "csv"), twice, 7).unwrap();
    let Outcome::Select { rows, .. } = o else { panic!() };
    assert_eq!(serde_json::Value::from(rows), serde_json::json!([["BB", "AA"]]));
}
