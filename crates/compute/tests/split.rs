//! Every kernel gives the same result however its input is cut into chunks, and the
//! search and count kernels agree with plain reference implementations.

use nearstore_compute::{run, Build, Context, Operation, Outcome, Sink, SliceSource, VecSink, OPERATIONS};
use proptest::prelude::*;

fn args_for(op: &str, pattern: &str) -> Vec<u8> {
    match op {
        "search" => format!(r#"{{"pattern":{pattern:?},"max_offsets":10000}}"#).into_bytes(),
        "regex-count" | "grep-count" => format!(r#"{{"pattern":{:?}}}"#, regex::escape(pattern)).into_bytes(),
        // Fields are the words of each line.
        "select" => {
            r#"{"query":"SELECT COUNT(*), MIN(_1), MAX(_2) FROM t WHERE _1 LIKE '%a%' OR _2 IS NULL","delimiter":" ","header":false}"#
                .as_bytes()
                .to_vec()
        }
        _ => Vec::new(),
    }
}

/// Runs any operation over one input given as chunks, with one output object of ample
/// room when the operation writes one: its results (outcomes without their
/// measurements, such as a merge's wait for input) and the output bytes.
fn exec(op: &Operation, args: &[u8], chunks: Vec<&[u8]>) -> (Vec<Outcome>, Vec<u8>) {
    let mut src = SliceSource::new(chunks);
    let mut out = VecSink::new(1 << 20);
    let wants_output = matches!(op.build, Build::Transform { outputs: (1, _), .. });
    let mut outs: Vec<&mut dyn Sink> = if wants_output { vec![&mut out] } else { vec![] };
    let r = op.execute(args, &mut [&mut src], &mut outs, &Context::default()).unwrap();
    (results(&r), out.data)
}

/// What two runs over the same bytes must agree on.
fn results(outcomes: &[Outcome]) -> Vec<Outcome> {
    outcomes.iter().map(Outcome::result).collect()
}

#[test]
fn runs_compare_by_results_not_measurements() {
    let merged = |records, input_wait_ms| Outcome::Merged { input: 10, output: 10, records, input_wait_ms };
    // A slow disk or a busy machine: the same merge waited longer for its input.
    assert_eq!(results(&[merged(2, 0)]), results(&[merged(2, 37)]));
    assert_ne!(results(&[merged(2, 0)]), results(&[merged(3, 0)]));
}

fn chunks<'a>(data: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (data.len() + 1)).collect();
    cuts.sort();
    let mut out = Vec::new();
    let mut prev = 0;
    for c in cuts {
        out.push(&data[prev..c]);
        prev = c;
    }
    out.push(&data[prev..]);
    out
}

/// Leftmost non-overlapping matches, the slow obvious way.
fn naive_search(data: &[u8], p: &[u8]) -> Vec<u64> {
    let mut out = Vec::new();
    let mut i = 0;
    while i + p.len() <= data.len() {
        if &data[i..i + p.len()] == p {
            out.push(i as u64);
            i += p.len();
        } else {
            i += 1;
        }
    }
    out
}

fn text() -> impl Strategy<Value = Vec<u8>> {
    // A small alphabet makes matches, borders and newlines frequent.
    prop::collection::vec(prop::sample::select(vec![b'a', b'b', b'\n', b' ', b'c']), 0..400)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn any_split_gives_the_same_result(data in text(), cuts in prop::collection::vec(any::<usize>(), 0..8), pattern in "[ab]{1,4}") {
        for op in OPERATIONS {
            let args = args_for(op.name, &pattern);
            // Inputs the operation accepts: zstd frames to decompress, sorted lines to merge.
            let data = match op.name {
                "decompress" => zstd::encode_all(&data[..], 3).unwrap(),
                "merge" => {
                    let mut lines: Vec<&[u8]> = data.split(|&b| b == b'\n').collect();
                    lines.sort();
                    lines.join(&b'\n')
                }
                _ => data.clone(),
            };
            let whole = exec(op, &args, vec![&data[..]]);
            let split = exec(op, &args, chunks(&data, &cuts));
            prop_assert_eq!(&whole, &split, "{}", op.name);
        }
    }

    #[test]
    fn search_and_counts_match_references(data in text(), pattern in "[ab]{1,4}") {
        let p = pattern.as_bytes();
        let want = naive_search(&data, p);
        prop_assert_eq!(run("search", &args_for("search", &pattern), [&data[..]]).unwrap(), Outcome::Search { count: want.len() as u64, offsets: want });
        let lines: Vec<&[u8]> = if data.is_empty() { vec![] } else { data.strip_suffix(b"\n").unwrap_or(&data).split(|&b| b == b'\n').collect() };
        let matching = lines.iter().filter(|l| !naive_search(l, p).is_empty()).count() as u64;
        let matches: u64 = lines.iter().map(|l| naive_search(l, p).len() as u64).sum();
        prop_assert_eq!(run("grep-count", &args_for("grep-count", &pattern), [&data[..]]).unwrap(), Outcome::Count { count: matching });
        prop_assert_eq!(run("regex-count", &args_for("regex-count", &pattern), [&data[..]]).unwrap(), Outcome::Count { count: matches });
        let words = data.split(|b| b" \t\n\r\x0b\x0c".contains(b)).filter(|w| !w.is_empty()).count() as u64;
        let nl = data.iter().filter(|&&b| b == b'\n').count() as u64;
        prop_assert_eq!(run("wc", b"", [&data[..]]).unwrap(), Outcome::Wc { bytes: data.len() as u64, lines: nl, words });
    }
}
