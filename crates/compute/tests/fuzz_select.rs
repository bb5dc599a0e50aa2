//! The query parser and the select engine take text from the wire (the descriptor's
//! arguments) and bytes from the object: neither may panic, whatever they get. Queries
//! are built from SQL's own tokens so that most get past the parser and reach the
//! engine. PROPTEST_CASES sets the number of cases.

use nearstore_compute::select::plan;
use nearstore_compute::{by_name, Context, SliceSource, VecSink};
use proptest::prelude::*;

const TOKENS: &[&str] = &[
    "SELECT",
    "FROM",
    "t",
    "s",
    "s3object",
    "WHERE",
    "GROUP",
    "BY",
    "HAVING",
    "ORDER",
    "LIMIT",
    "OFFSET",
    "ASC",
    "DESC",
    "NULLS",
    "FIRST",
    "(",
    ")",
    "*",
    ",",
    ".",
    "a",
    "b",
    "c",
    "_1",
    "_2",
    "_9",
    "\"a\"",
    "'x'",
    "'%a_'",
    "''",
    "1",
    "0",
    "-3",
    "2.5",
    "1e308",
    "9223372036854775807",
    "NULL",
    "TRUE",
    "FALSE",
    "AND",
    "OR",
    "NOT",
    "LIKE",
    "ILIKE",
    "ESCAPE",
    "IS",
    "IN",
    "BETWEEN",
    "DISTINCT",
    "CAST",
    "AS",
    "INT",
    "FLOAT",
    "TEXT",
    "BOOLEAN",
    "COUNT",
    "SUM",
    "AVG",
    "MIN",
    "MAX",
    "LOWER",
    "UPPER",
    "LENGTH",
    "SUBSTRING",
    "SUBSTR",
    "TRIM",
    "COALESCE",
    "NULLIF",
    "ABS",
    "CASE",
    "WHEN",
    "THEN",
    "ELSE",
    "END",
    "+",
    "-",
    "/",
    "%",
    "=",
    "<>",
    "<",
    ">=",
    "||",
    ";",
    "JOIN",
    "UNION",
];

/// Expressions from the grammar the engine supports, with aggregates sprinkled in: most
/// parse, many are refused for a reason (a column not grouped, text in a sum), and the
/// rest run.
fn expr(aggregates: bool) -> impl Strategy<Value = String> {
    let leaf = prop::sample::select(vec![
        "a",
        "b",
        "c",
        "_1",
        "_3",
        "s.a",
        "\"b\"",
        "c.d",
        "1",
        "-3",
        "0",
        "2.5",
        "'x'",
        "'1'",
        "NULL",
        "TRUE",
        "9223372036854775807",
    ])
    .prop_map(str::to_string);
    leaf.prop_recursive(4, 24, 3, move |e| {
        let op = prop::sample::select(vec!["+", "-", "*", "/", "%", "=", "<>", "<", ">=", "AND", "OR", "||"]);
        let mut funcs = vec!["LOWER", "UPPER", "LENGTH", "ABS", "COALESCE", "TRIM"];
        if aggregates {
            funcs.extend(["SUM", "MIN", "MAX", "AVG", "COUNT"]);
        }
        let func = prop::sample::select(funcs);
        let ty = prop::sample::select(vec!["INT", "FLOAT", "TEXT", "BOOLEAN"]);
        prop_oneof![
            (e.clone(), op, e.clone()).prop_map(|(a, o, b)| format!("({a} {o} {b})")),
            e.clone().prop_map(|a| format!("NOT {a}")),
            e.clone().prop_map(|a| format!("{a} IS NOT NULL")),
            e.clone().prop_map(|a| format!("{a} LIKE '%1_'")),
            (e.clone(), e.clone()).prop_map(|(a, b)| format!("{a} IN ({b}, NULL, 2)")),
            (e.clone(), e.clone(), e.clone()).prop_map(|(a, b, c)| format!("{a} BETWEEN {b} AND {c}")),
            (e.clone(), ty).prop_map(|(a, t)| format!("CAST({a} AS {t})")),
            (func, e.clone()).prop_map(|(f, a)| format!("{f}({a})")),
            (e.clone(), e.clone(), e.clone()).prop_map(|(a, b, c)| format!("CASE WHEN {a} THEN {b} ELSE {c} END")),
            (e.clone(), e.clone()).prop_map(|(a, b)| format!("SUBSTRING({a}, {b}, 2)")),
            Just(if aggregates { "COUNT(*)" } else { "1" }.to_string()),
        ]
    })
}

fn grammar_query() -> impl Strategy<Value = String> {
    let agg = || (prop::sample::select(vec!["SUM", "MIN", "MAX", "AVG", "COUNT"]), expr(false)).prop_map(|(f, e)| format!("{f}({e})"));
    (
        any::<bool>(),
        prop::collection::vec((expr(false), agg(), any::<bool>()), 1..4),
        prop::option::of(expr(false)),
        prop::collection::vec(expr(false), 0..3),
        prop::option::of((agg(), expr(false))),
        prop::option::of((expr(false), any::<bool>())),
        prop::option::of(0u32..5),
        // Now and then, anything (aggregates nested, columns not grouped).
        prop::option::of(expr(true)),
    )
        .prop_map(|(grouped, items, filter, keys, having, order, limit, wild)| {
            let mut q = if grouped {
                // Items are keys or aggregates.
                let items: Vec<String> =
                    items.iter().enumerate().map(|(i, (_, a, k))| if *k && i < keys.len() { keys[i].clone() } else { a.clone() }).collect();
                format!("SELECT {} FROM s3object s", items.join(", "))
            } else {
                format!("SELECT {} FROM s3object s", items.iter().map(|i| i.0.clone()).collect::<Vec<_>>().join(", "))
            };
            if let Some(w) = wild {
                q = format!("SELECT {w} FROM t");
            }
            if let Some(f) = filter {
                q += &format!(" WHERE {f}");
            }
            if grouped && !keys.is_empty() {
                q += &format!(" GROUP BY {}", keys.join(", "));
            }
            if let (true, Some((a, e))) = (grouped, having) {
                q += &format!(" HAVING {a} > {e}");
            }
            if let (false, Some((o, d))) = (grouped, order) {
                q += &format!(" ORDER BY {o}{}", if d { " DESC" } else { "" });
            }
            if let Some(l) = limit {
                q += &format!(" LIMIT {l}");
            }
            q
        })
}

/// A grammatical query with one token dropped or replaced.
fn mutated_query() -> impl Strategy<Value = String> {
    (grammar_query(), any::<prop::sample::Index>(), prop::sample::select(TOKENS), any::<bool>()).prop_map(|(q, at, tok, drop)| {
        let mut t: Vec<&str> = q.split(' ').collect();
        let i = at.index(t.len());
        if drop {
            t.remove(i);
        } else {
            t[i] = tok;
        }
        t.join(" ")
    })
}

fn query() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => grammar_query(),
        2 => mutated_query(),
        // Token soup after a plausible start.
        1 => prop::collection::vec(prop::sample::select(TOKENS), 0..40).prop_map(|t| format!("SELECT {} FROM t {}", t[..t.len() / 2].join(" "), t[t.len() / 2..].join(" "))),
        1 => prop::collection::vec(prop::sample::select(TOKENS), 0..60).prop_map(|t| t.join(" ")),
        // Any text at all.
        1 => ".{0,200}",
    ]
}

fn data() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        // CSV-shaped: a header, fields of numbers, text, quotes, empty.
        prop::collection::vec(
            prop::sample::select(vec!["a", "b", "c", ",", "\n", "\r\n", "\"", "1", "-2", "2.5", "x y", "", ";", "#"]),
            0..80
        )
        .prop_map(|t| format!("a,b,c\n{}", t.concat()).into_bytes()),
        // JSON-lines-shaped.
        prop::collection::vec(
            prop::sample::select(vec!["{\"a\":1,\"b\":\"x\"}", "{\"a\":null}", "{\"c\":{\"d\":2.5}}", "[1]", "{", "\n", "true"]),
            0..20
        )
        .prop_map(|t| t.join("\n").into_bytes()),
        prop::collection::vec(any::<u8>(), 0..300),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(3000), ..ProptestConfig::default() })]

    #[test]
    fn parsing_never_panics(q in query()) {
        if let Err(e) = plan::parse(&q) {
            prop_assert!(!e.is_empty());
        }
    }

    #[test]
    fn running_never_panics(q in query(), d in data(), json in any::<bool>(), header in any::<bool>(), chunk in 1usize..64, into in any::<bool>()) {
        let args = serde_json::json!({ "query": q, "format": if json { "jsonl" } else { "csv" }, "header": header, "comment": "#" }).to_string();
        let op = by_name("select").unwrap();
        let mut src = SliceSource::new(d.chunks(chunk));
        let mut out = VecSink::new(4096);
        let ctx = Context::with_memory(1 << 20);
        let r = if into {
            op.execute(args.as_bytes(), &mut [&mut src], &mut [&mut out], &ctx)
        } else {
            op.execute(args.as_bytes(), &mut [&mut src], &mut [], &ctx)
        };
        if let Err(e) = r {
            prop_assert!(!e.to_string().is_empty());
        }
    }
}
