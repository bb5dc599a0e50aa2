//! Operation specs: the text a user attaches to an open file (`user.nearstore.op`, the
//! ioctl, a `.nearstore/SPEC/` directory name), parsed into an operation of
//! `nearstore-compute` and its arguments exactly as the CLI builds them, and an outcome
//! rendered as the bytes a read returns.

use nearstore_compute::{Build, Operation, Outcome};
use nearstore_host::csv_field;

use crate::limits::OP_SPEC_BYTES_MAX;

/// An operation attached to a file: its text as given, the operation and its arguments.
pub struct OpSpec {
    pub text: String,
    pub op: &'static Operation,
    pub args: Vec<u8>,
    /// A transform's output: the file's name with this appended, beside it.
    pub output: Option<&'static str>,
}

impl std::fmt::Debug for OpSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OpSpec({:?})", self.text)
    }
}

/// Parses a spec: `NAME` (an operation without arguments: `sha256`, `crc32c`, `wc`, ...),
/// `grep:REGEX` (matching lines, as `nearstore grep -c`), `search:LITERAL` (as `grep -F`),
/// `select:QUERY` (CSV with a header line) or `select-jsonl:QUERY`; and the transforms,
/// whose output is a file beside the input: `compress` or `compress:LEVEL` (`FILE.zst`, as
/// `nearstore compress`), `sort` (lines, `FILE.sorted`, as `nearstore sort --into`) and
/// `select-into:QUERY` (the rows as CSV, `FILE.select.csv`, as `nearstore select --into`).
/// Errors say what is wrong in the user's terms; the operation's own check has run.
pub fn parse(text: &str) -> Result<OpSpec, String> {
    if text.len() > OP_SPEC_BYTES_MAX {
        return Err(format!("operation spec of {} bytes, more than {OP_SPEC_BYTES_MAX}", text.len()));
    }
    if text.is_empty() {
        return Err("empty operation spec".into());
    }
    let (name, args) = match text.split_once(':') {
        None => (text, None),
        Some((name, arg)) => (name, Some(arg)),
    };
    let mut output = None;
    let (op_name, args) = match (name, args) {
        ("compress", level) => {
            let level: i32 =
                level.map_or(Ok(3), str::parse).map_err(|_| format!("'compress:{}': the level is a number", level.unwrap_or("")))?;
            output = Some(".zst");
            ("compress", serde_json::json!({ "level": level }))
        }
        ("sort", None) => {
            output = Some(".sorted");
            ("sort", serde_json::json!({}))
        }
        ("select-into", Some(q)) => {
            output = Some(".select.csv");
            ("select", select_args(q, "csv"))
        }
        ("grep", Some(p)) => ("grep-count", serde_json::json!({ "pattern": p })),
        ("search", Some(p)) => ("search", serde_json::json!({ "pattern": p, "max_offsets": 10 })),
        ("select", Some(q)) => ("select", select_args(q, "csv")),
        ("select-jsonl", Some(q)) => ("select", select_args(q, "jsonl")),
        ("grep" | "search" | "select" | "select-jsonl" | "select-into", None) => {
            return Err(format!("'{name}' needs an argument: '{name}:...'"))
        }
        (other, Some(_)) => return Err(format!("'{other}' takes no argument after ':' (or is no operation)")),
        (other, None) => (other, serde_json::Value::Null),
    };
    let op = nearstore_compute::by_name(op_name).map_err(|_| format!("unknown operation '{op_name}' (docs/fuse.md lists them)"))?;
    if output.is_none() && matches!(op.build, Build::Transform { .. }) {
        return Err(format!("'{op_name}' writes an output file the mount does not name (compress, sort and select-into do)"));
    }
    let args = if args.is_null() { Vec::new() } else { serde_json::to_vec(&args).map_err(|e| e.to_string())? };
    op.check(&args, 1, output.is_some() as usize).map_err(|e| format!("{op_name}: {e}"))?;
    Ok(OpSpec { text: text.into(), op, args, output })
}

/// The arguments `nearstore select` gives a query over one file, with its defaults.
fn select_args(query: &str, format: &str) -> serde_json::Value {
    serde_json::json!({
        "query": query,
        "format": format,
        "header": true,
        "delimiter": ',',
        "quote": '"',
        "comment": null,
        "output_format": "csv",
    })
}

/// The bytes a read of a descriptor with an operation returns: what the CLI prints for the
/// file, without the file's name (a digest's hex, a count, `lines words bytes`, a query's
/// rows as CSV), one line each, newline-terminated. A transform's is rendered by the
/// caller, which knows the output's name ([`render_output`]).
pub fn render(o: &Outcome) -> Vec<u8> {
    let text = match o {
        Outcome::Digest { hex, .. } => format!("{hex}\n"),
        Outcome::Count { count } => format!("{count}\n"),
        Outcome::Search { count, offsets } => {
            let shown: Vec<String> = offsets.iter().map(|o| o.to_string()).collect();
            format!("{count}{}{}\n", if shown.is_empty() { "" } else { " " }, shown.join(","))
        }
        Outcome::Wc { bytes, lines, words } => format!("{lines} {words} {bytes}\n"),
        Outcome::Select { columns, rows, .. } => {
            let mut s = columns.iter().map(|c| csv_field(&serde_json::Value::from(c.as_str()))).collect::<Vec<_>>().join(",");
            s.push('\n');
            for row in rows {
                s.push_str(&row.iter().map(csv_field).collect::<Vec<_>>().join(","));
                s.push('\n');
            }
            s
        }
        // Operations with outputs are refused by `parse`; should one come, its JSON.
        other => format!("{}\n", serde_json::to_string(other).unwrap_or_default()),
    };
    text.into_bytes()
}

/// What a read of a descriptor with a transform returns: the output's name (beside the
/// input) and its bytes.
pub fn render_output(name: &str, bytes: u64) -> Vec<u8> {
    format!("{name} {bytes}\n").into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (spec, Ok(operation name) or Err(words of the message))
    #[test]
    fn specs_parse_or_say_why_not() {
        let cases: &[(&str, Result<&str, &str>)] = &[
            ("sha256", Ok("sha256")),
            ("crc32c", Ok("crc32c")),
            ("wc", Ok("wc")),
            ("grep:ERROR", Ok("grep-count")),
            ("grep:a:b", Ok("grep-count")),
            ("search:needle", Ok("search")),
            ("select:SELECT COUNT(*) FROM s3object", Ok("select")),
            ("select-jsonl:SELECT COUNT(*) FROM s3object", Ok("select")),
            ("", Err("empty")),
            ("bogus", Err("unknown operation 'bogus'")),
            ("sha256:x", Err("takes no argument")),
            ("grep", Err("needs an argument")),
            ("grep:(", Err("grep-count")),
            ("select:SELEC nothing", Err("select")),
            ("compress", Ok("compress")),
            ("compress:19", Ok("compress")),
            ("compress:x", Err("the level is a number")),
            ("sort", Ok("sort")),
            ("select-into:SELECT * FROM s3object", Ok("select")),
            ("select-into", Err("needs an argument")),
            ("copy", Err("writes an output file the mount does not name")),
        ];
        for (spec, want) in cases {
            match (parse(spec), want) {
                (Ok(s), Ok(name)) => assert_eq!(s.op.name, *name, "{spec}"),
                (Err(e), Err(words)) => assert!(e.contains(words), "{spec}: {e}"),
                (got, want) => panic!("{spec}: got {:?}, want {want:?}", got.map(|s| s.op.name)),
            }
        }
        let long = format!("grep:{}", "a".repeat(OP_SPEC_BYTES_MAX));
        assert!(parse(&long).unwrap_err().contains("more than"));
    }

    #[test]
    fn outcomes_render_as_the_cli_prints_them() {
        let cases = [
            (Outcome::Digest { algorithm: "sha256".into(), hex: "ab01".into() }, "ab01\n"),
            (Outcome::Count { count: 7 }, "7\n"),
            (Outcome::Search { count: 2, offsets: vec![3, 90] }, "2 3,90\n"),
            (Outcome::Search { count: 0, offsets: vec![] }, "0\n"),
            (Outcome::Wc { bytes: 10, lines: 2, words: 3 }, "2 3 10\n"),
            (
                Outcome::Select {
                    columns: vec!["city".into(), "n".into()],
                    rows: vec![vec!["Oslo, N".into(), 3.into()], vec![serde_json::Value::Null, 1.into()]],
                    records: 4,
                    matched: 4,
                    rows_out: 2,
                    output: 0,
                },
                "city,n\n\"Oslo, N\",3\n,1\n",
            ),
        ];
        for (o, want) in cases {
            assert_eq!(String::from_utf8(render(&o)).unwrap(), want, "{o:?}");
        }
    }
}
