//! sort and merge take their arguments and data off the wire: any arguments and any bytes
//! give a result or an error, never a panic; and a merge of sorted inputs cut to a key
//! range, with skipped heads, writes exactly the records of the whole sort in that range.

use nearstore_compute::{by_name, ComputeError, Context, Outcome, Sink, SliceSource, Source, VecSink};
use proptest::prelude::*;

fn exec(op: &str, args: &[u8], inputs: &[Vec<u8>], chunk: usize) -> Result<(Outcome, Vec<u8>), ComputeError> {
    let mut srcs: Vec<SliceSource> = inputs.iter().map(|d| SliceSource::new(d.chunks(chunk.max(1)))).collect();
    let mut ins: Vec<&mut dyn Source> = srcs.iter_mut().map(|s| s as &mut dyn Source).collect();
    let mut out = VecSink::new(1 << 20);
    let mut outs: Vec<&mut dyn Sink> = vec![&mut out];
    let o = by_name(op)?.execute(args, &mut ins, &mut outs, &Context::with_memory(1 << 20))?.remove(0);
    Ok((o, out.data))
}

/// Arguments from the grammar, with wrong types, sizes and junk mixed in.
fn args() -> impl Strategy<Value = Vec<u8>> {
    let num = prop_oneof![
        Just("0".to_string()),
        Just("-1".into()),
        Just("\"x\"".into()),
        (0u64..40).prop_map(|n| n.to_string()),
        Just("99999999999".into())
    ];
    let key =
        prop_oneof![Just("\"\"".to_string()), Just("\"zz\"".into()), "[0-9a-f]{0,8}".prop_map(|h| format!("\"{h}\"")), Just("7".into())];
    let skip = prop::collection::vec(0u64..20, 0..4).prop_map(|v| format!("{v:?}"));
    let field = prop_oneof![
        num.clone().prop_map(|n| format!("\"record_size\":{n}")),
        num.clone().prop_map(|n| format!("\"key_offset\":{n}")),
        num.clone().prop_map(|n| format!("\"key_length\":{n}")),
        prop_oneof![Just("\"u64\""), Just("\"bytes\""), Just("\"i32\""), Just("3")].prop_map(|t| format!("\"key_type\":{t}")),
        num.prop_map(|n| format!("\"index\":{n}")),
        key.clone().prop_map(|k| format!("\"key_min\":{k}")),
        key.prop_map(|k| format!("\"key_max\":{k}")),
        skip.prop_map(|s| format!("\"skip\":{s}")),
        Just("\"bogus\":1".to_string()),
    ];
    prop_oneof![
        prop::collection::vec(field, 0..5).prop_map(|f| format!("{{{}}}", f.join(",")).into_bytes()),
        prop::collection::vec(any::<u8>(), 0..40),
    ]
}

proptest! {
    #[test]
    fn any_arguments_and_bytes_give_a_result_or_an_error(
        a in args(),
        inputs in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..300), 1..4),
        chunk in 1usize..64,
    ) {
        for op in ["sort", "merge"] {
            let _ = exec(op, &a, &inputs, chunk);
        }
    }

    #[test]
    fn a_key_range_of_sorted_inputs_is_that_range_of_the_whole_sort(
        recs in prop::collection::vec(prop::collection::vec(prop::collection::vec(0u8..4, 6), 0..60), 1..4),
        bounds in (prop::collection::vec(0u8..4, 2), prop::collection::vec(0u8..4, 2)),
        heads in prop::collection::vec(0usize..3, 3),
        chunk in 1usize..50,
    ) {
        // Records of 6 bytes, keyed by their first 2; each input sorted by its own sort.
        let args = br#"{"record_size":6,"key_length":2}"#;
        let inputs: Vec<Vec<u8>> = recs.iter().map(|r| exec("sort", args, &[r.concat()], 7).unwrap().1).collect();
        let whole = exec("sort", args, &inputs, 64).unwrap().1;
        let (lo, hi) = if bounds.0 <= bounds.1 { bounds } else { (bounds.1, bounds.0) };
        let want: Vec<u8> = whole.chunks(6).filter(|r| r[..2] >= lo[..] && r[..2] < hi[..]).flatten().copied().collect();
        // Every input behind a head of junk the merge skips.
        let skips: Vec<u64> = inputs.iter().enumerate().map(|(i, _)| heads[i % 3] as u64).collect();
        let padded: Vec<Vec<u8>> = inputs.iter().zip(&skips).map(|(d, s)| [vec![0xee; *s as usize], d.clone()].concat()).collect();
        let a = serde_json::json!({"record_size": 6, "key_length": 2, "key_min": hex(&lo), "key_max": hex(&hi), "skip": skips});
        let (o, got) = exec("merge", &serde_json::to_vec(&a).unwrap(), &padded, chunk).unwrap();
        prop_assert_eq!(&got, &want);
        let Outcome::Merged { records, output, .. } = o else { panic!("{o:?}") };
        prop_assert_eq!((records, output), (want.len() as u64 / 6, want.len() as u64));
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
