//! The compute commands against a live target: every operation over fragmented objects
//! with holes and exact tails gives what the same kernel gives locally; every refusal the
//! protocol names has its status and a fetchable message; and the target keeps serving.

mod common;

use std::sync::Arc;
use std::time::Duration;

use nearstore_compute::{by_name, Outcome, OPERATIONS};
use nearstore_initiator::{Controller, Data, Error, IoQueue};
use nearstore_target::config::Config;
use nearstore_target::Target;
use nearstore_wire::compute::{opcode as cop, status as cs, Descriptor, Extent, Object};
use nearstore_wire::{Sqe, Status};

const T: Duration = Duration::from_secs(60);

/// Bytes with text-like structure (lines, words, a searchable pattern).
fn content(len: usize, seed: u64) -> Vec<u8> {
    let words: [&[u8]; 6] = [b"alpha ", b"beta ", b"needle ", b"gamma\n", b"delta\t", b"ERROR x\n"];
    let mut out = Vec::with_capacity(len + 16);
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    while out.len() < len {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        out.extend_from_slice(words[(s >> 33) as usize % words.len()]);
    }
    out.truncate(len);
    out
}

/// Writes `data` to the namespace as a virtual object laid out in `extents` blocks,
/// shuffled (later bytes at lower offsets), with a hole of `hole` blocks in the middle.
/// Returns the object.
async fn place(q: &mut IoQueue, nsid: u32, bs: u64, base_lba: u64, data: &[u8], pieces: usize, hole: u64) -> Object {
    let blocks = (data.len() as u64).div_ceil(bs);
    let per = blocks.div_ceil(pieces as u64).max(1);
    let mut extents = Vec::new();
    let mut lba = base_lba + blocks + 8;
    let mut at = 0u64;
    let mut k = 0;
    let mut holes = 0;
    while at < blocks {
        let n = per.min(blocks - at);
        // Extents go downwards in the namespace while the object goes forwards.
        lba -= n;
        let mut buf = vec![0u8; (n * bs) as usize];
        let src = &data[(at * bs) as usize..data.len().min(((at + n) * bs) as usize)];
        buf[..src.len()].copy_from_slice(src);
        write_all(q, nsid, lba, &buf, bs).await;
        extents.push(Extent::data(lba * bs, n * bs));
        at += n;
        k += 1;
        if k == pieces.div_ceil(2) && hole > 0 && at < blocks {
            extents.push(Extent::zeros(hole * bs));
            holes += hole * bs;
        }
    }
    Object { len: data.len() as u64 + holes, extents }
}

/// Writes in transfers the target accepts (128 KiB).
async fn write_all(q: &mut IoQueue, nsid: u32, lba: u64, data: &[u8], bs: u64) {
    for (i, c) in data.chunks(128 * 1024).enumerate() {
        q.write(nsid, lba + (i * 128 * 1024) as u64 / bs, c, bs as u32, false).await.unwrap();
    }
}

async fn read_all(q: &mut IoQueue, nsid: u32, lba: u64, len: u64, bs: u64) -> Vec<u8> {
    let mut out = Vec::new();
    while (out.len() as u64) < len {
        let n = (len - out.len() as u64).min(128 * 1024);
        out.extend(q.read(nsid, lba + out.len() as u64 / bs, (n / bs) as u32, bs as u32).await.unwrap());
    }
    out
}

/// The object's bytes, as the target should see them (holes are zeros).
fn expected_bytes(data: &[u8], obj: &Object, bs: u64) -> Vec<u8> {
    let mut out = Vec::new();
    let mut at = 0usize;
    for e in &obj.extents {
        if e.is_zeros() {
            out.extend(std::iter::repeat_n(0u8, e.len as usize));
        } else {
            let n = (e.len as usize).min(data.len() - at);
            out.extend_from_slice(&data[at..at + n]);
            at += n;
        }
    }
    let _ = bs;
    out.truncate(obj.len as usize);
    out
}

fn args_for(op: &str) -> Vec<u8> {
    match op {
        "search" => br#"{"pattern":"needle","max_offsets":50}"#.to_vec(),
        "regex-count" => br#"{"pattern":"ERR[O]R"}"#.to_vec(),
        "grep-count" => br#"{"pattern":"^ERROR"}"#.to_vec(),
        _ => Vec::new(),
    }
}

fn outcomes(json: &[u8]) -> Vec<Outcome> {
    serde_json::from_slice(json).unwrap()
}

#[tokio::test]
async fn every_stream_operation_matches_the_local_kernel_on_both_backends() {
    let env = common::start().await;
    let c = env.connect().await;
    let mut q = c.io_queue(1).await.unwrap();
    for (nsid, bs) in [(1u32, 512u64), (2, 4096)] {
        // Sizes around block and chunk borders: 3.3 MiB spans several 1 MiB chunks.
        let sizes = [1usize, 511, 4097, 3_300_001];
        let mut objects = Vec::new();
        let mut datas = Vec::new();
        let mut lba = 0;
        for (i, &len) in sizes.iter().enumerate() {
            let data = content(len, i as u64 + nsid as u64);
            let obj = place(&mut q, nsid, bs, lba, &data, 1 + i * 3, if i > 1 { 3 } else { 0 }).await;
            lba += (len as u64).div_ceil(bs) + 16;
            datas.push(expected_bytes(&data, &obj, bs));
            objects.push(obj);
        }
        // And an empty object.
        objects.push(Object::default());
        datas.push(Vec::new());
        for op in OPERATIONS.iter().filter(|o| matches!(o.build, nearstore_compute::Build::Stream(_))) {
            let args = args_for(op.name);
            let d = Descriptor { op: op.id, args: args.clone(), inputs: objects.clone(), outputs: vec![] };
            let got = outcomes(&q.compute(nsid, &d.encode(), T).await.unwrap());
            let want: Vec<Outcome> = datas.iter().map(|b| nearstore_compute::run(op.name, &args, [&b[..]]).unwrap()).collect();
            assert_eq!(got, want, "{} on nsid {nsid}", op.name);
        }
    }
}

#[tokio::test]
async fn copy_writes_the_output_object_and_refuses_overlap() {
    let env = common::start().await;
    let c = env.connect().await;
    let mut q = c.io_queue(1).await.unwrap();
    let bs = 4096u64;
    let data = content(2_500_000, 7);
    let input = place(&mut q, 2, bs, 0, &data, 5, 2).await;
    let want = expected_bytes(&data, &input, bs);
    let out_lba = 4096u64;
    let cap = (input.len).div_ceil(bs) * bs;
    // The output in two extents, the second before the first.
    let half = cap / bs / 2 * bs;
    let output = Object { len: cap, extents: vec![Extent::data(out_lba * bs + cap, half), Extent::data(out_lba * bs, cap - half)] };
    let copy = by_name("copy").unwrap();
    let d = Descriptor { op: copy.id, args: vec![], inputs: vec![input.clone()], outputs: vec![output.clone()] };
    let got = outcomes(&q.compute(2, &d.encode(), T).await.unwrap());
    assert_eq!(got, vec![Outcome::Written { input: input.len, output: input.len }]);
    let first = read_all(&mut q, 2, out_lba + cap / bs, half, bs).await;
    let second = read_all(&mut q, 2, out_lba, cap - half, bs).await;
    let mut back = [first, second].concat();
    assert!(back[want.len()..].iter().all(|&b| b == 0), "the padded tail is zeros");
    back.truncate(want.len());
    assert!(back == want, "the output object holds the input's bytes");

    // An output overlapping its input.
    let mut bad = d.clone();
    bad.outputs[0] = Object { len: input.extents[1].len, extents: vec![input.extents[1]] };
    let e = q.compute(2, &bad.encode(), T).await.unwrap_err();
    assert_refused(e, cs::OUTPUT_OVERLAP, "output 0 overlaps input 0");
    // An output too small for what the operation writes.
    let mut small = d.clone();
    small.outputs[0] = Object { len: bs, extents: vec![Extent::data(out_lba * bs, bs)] };
    let e = q.compute(2, &small.encode(), T).await.unwrap_err();
    assert_refused(e, cs::OUTPUT_TOO_SMALL, "more than its 4096 bytes");
}

#[tokio::test]
async fn select_runs_on_the_target_inline_and_into_an_output_object() {
    let env = common::start().await;
    let c = env.connect().await;
    let mut q = c.io_queue(1).await.unwrap();
    let bs = 4096u64;
    let mut csv = b"id,city,amount\n".to_vec();
    for i in 0..40_000u32 {
        csv.extend_from_slice(format!("{i},\"{}\",{}.{}\n", ["Oslo", "Lima, PE", "Quito"][i as usize % 3], i % 997, i % 10).as_bytes());
    }
    // Fragmented and out of order, so records cross extents.
    let input = place(&mut q, 2, bs, 0, &csv, 7, 0).await;
    let select = by_name("select").unwrap();
    let args = |query: &str| serde_json::json!({ "query": query }).to_string().into_bytes();
    let group = args("SELECT city, COUNT(*), SUM(amount), MAX(id) FROM s3object GROUP BY city ORDER BY city");
    let d = Descriptor { op: select.id, args: group.clone(), inputs: vec![input.clone(), input.clone()], outputs: vec![] };
    let got = outcomes(&q.compute(2, &d.encode(), T).await.unwrap());
    let want = nearstore_compute::run("select", &group, [&csv[..]]).unwrap();
    assert_eq!(got, vec![want.clone(), want], "one result per input, equal to the local kernel");

    // Rows into an output object: the target writes them; they read back as CSV.
    let rows = args("SELECT id, city FROM s3object WHERE amount > 900");
    let out_lba = 8192u64;
    let output = Object { len: 1 << 20, extents: vec![Extent::data(out_lba * bs, 1 << 20)] };
    let d = Descriptor { op: select.id, args: rows.clone(), inputs: vec![input.clone()], outputs: vec![output] };
    let got = outcomes(&q.compute(2, &d.encode(), T).await.unwrap());
    let Outcome::Select { output: written, rows_out, .. } = got[0].clone() else { panic!("{got:?}") };
    let back = read_all(&mut q, 2, out_lba, written.div_ceil(bs) * bs, bs).await;
    let text = String::from_utf8(back[..written as usize].to_vec()).unwrap();
    assert!(text.starts_with("id,city\n"), "{}", &text[..40]);
    assert_eq!(text.lines().count() as u64, rows_out + 1);
    assert!(text.contains("\"Lima, PE\""), "fields with the delimiter are quoted");

    // A bad query, a query over columns the object lacks, bad data, too many rows inline.
    let e = q.compute(2, &Descriptor { args: args("SELECT a FROM t WHERE"), ..d.clone() }.encode(), T).await.unwrap_err();
    assert_refused(e, cs::BAD_ARGUMENTS, "arguments of select: query: sql parser error");
    let inline = |a: Vec<u8>| Descriptor { op: select.id, args: a, inputs: vec![input.clone()], outputs: vec![] };
    let e = q.compute(2, &inline(args("SELECT nope FROM t")).encode(), T).await.unwrap_err();
    assert_refused(e, cs::BAD_ARGUMENTS, "no column \"nope\" in the header (id, city, amount)");
    let e = q.compute(2, &inline(args("SELECT SUM(city) FROM t")).encode(), T).await.unwrap_err();
    assert_refused(e, cs::OPERATION_FAILED, "record 1: SUM or AVG of the text 'Oslo'");
    let e = q.compute(2, &inline(args("SELECT * FROM t")).encode(), T).await.unwrap_err();
    assert_refused(e, cs::LIMIT_EXCEEDED, "more than 131072 bytes inline");
    // And the target still serves.
    let got = outcomes(&q.compute(2, &inline(args("SELECT COUNT(*) FROM t")).encode(), T).await.unwrap());
    assert!(matches!(&got[0], Outcome::Select { rows, .. } if rows == &vec![vec![serde_json::json!(40_000)]]), "{got:?}");
}

fn assert_refused(e: Error, status: Status, needle: &str) {
    match e {
        Error::Compute { status: s, message } => {
            assert_eq!(s, status, "{message}");
            assert!(message.contains(needle), "message {message:?} lacks {needle:?}");
        }
        e => panic!("expected a compute refusal, got {e}"),
    }
}

fn crc_of(obj: Object) -> Descriptor {
    Descriptor { op: by_name("crc32c").unwrap().id, args: vec![], inputs: vec![obj], outputs: vec![] }
}

#[tokio::test]
async fn bad_descriptors_get_a_status_and_a_message_and_the_target_keeps_serving() {
    let env = common::start().await;
    let c = env.connect().await;
    let mut q = c.io_queue(1).await.unwrap();
    let ns_bytes = 64u64 << 20;
    let good = crc_of(Object { len: 1000, extents: vec![Extent::data(0, 1024)] });
    let cases: Vec<(Vec<u8>, u32, Status, &str)> = vec![
        (
            crc_of(Object { len: 512, extents: vec![Extent::data(ns_bytes, 512)] }).encode(),
            1,
            Status::LBA_OUT_OF_RANGE.dnr(),
            "outside the namespace",
        ),
        (
            crc_of(Object { len: 512, extents: vec![Extent::data(ns_bytes - 512, 1024)] }).encode(),
            1,
            Status::LBA_OUT_OF_RANGE.dnr(),
            "outside the namespace",
        ),
        (
            crc_of(Object { len: 512, extents: vec![Extent::data(100, 512)] }).encode(),
            1,
            cs::DESCRIPTOR_INVALID,
            "multiples of the 512-byte block",
        ),
        (crc_of(Object { len: 512, extents: vec![Extent::data(u64::MAX - 511, 512)] }).encode(), 1, cs::DESCRIPTOR_INVALID, "overflows"),
        (crc_of(Object { len: 4096, extents: vec![Extent::data(0, 512)] }).encode(), 1, cs::DESCRIPTOR_INVALID, "less than its length"),
        (crc_of(Object { len: 512, extents: vec![Extent::data(0, 0)] }).encode(), 1, cs::DESCRIPTOR_INVALID, "length 0"),
        (Descriptor { inputs: vec![], ..good.clone() }.encode(), 1, cs::DESCRIPTOR_INVALID, "no input object"),
        (Descriptor { op: 0x7777, ..good.clone() }.encode(), 1, cs::UNKNOWN_OPERATION, "unknown operation id 0x7777"),
        (
            Descriptor { op: by_name("grep-count").unwrap().id, args: br#"{"pattern":"(unclosed"}"#.to_vec(), ..good.clone() }.encode(),
            1,
            cs::BAD_ARGUMENTS,
            "regex",
        ),
        (Descriptor { args: br#"{"surprise":1}"#.to_vec(), ..good.clone() }.encode(), 1, cs::BAD_ARGUMENTS, "surprise"),
        (
            Descriptor { outputs: vec![Object { len: 512, extents: vec![Extent::data(8192, 512)] }], ..good.clone() }.encode(),
            1,
            cs::BAD_ARGUMENTS,
            "takes 0 output objects",
        ),
        (b"NSCD garbage".to_vec(), 1, cs::DESCRIPTOR_INVALID, "shorter than its 32-byte header"),
        (
            {
                let mut b = good.encode();
                b[4] = 9;
                b
            },
            1,
            cs::DESCRIPTOR_INVALID,
            "version 9 is not supported",
        ),
        (
            crc_of(Object { len: 512 * 4097, extents: (0..4097).map(|i| Extent::data(i * 512, 512)).collect() }).encode(),
            1,
            cs::LIMIT_EXCEEDED,
            "4097 extents, more than the limit of 4096",
        ),
        (good.encode(), 9, Status::INVALID_NAMESPACE.dnr(), "namespace 9"),
    ];
    for (bytes, nsid, status, needle) in cases {
        let e = q.compute(nsid, &bytes, T).await.unwrap_err();
        assert_refused(e, status, needle);
        // The target still serves: the good descriptor works after each refusal.
        let r = outcomes(&q.compute(1, &good.encode(), T).await.unwrap());
        assert!(matches!(r[0], Outcome::Digest { .. }));
    }
    // A result larger than RESULT_BYTES_MAX: 40 inputs with 10,000 offsets each.
    let ones = vec![b'a'; 512 * 40];
    q.write(1, 0, &ones, 512, false).await.unwrap();
    let obj = Object { len: 20480, extents: vec![Extent::data(0, 20480)] };
    let d = Descriptor {
        op: by_name("search").unwrap().id,
        args: br#"{"pattern":"a","max_offsets":10000}"#.to_vec(),
        inputs: vec![obj; 40],
        outputs: vec![],
    };
    let e = q.compute(1, &d.encode(), T).await.unwrap_err();
    assert_refused(e, cs::LIMIT_EXCEEDED, "more than the limit of 262144");
    // The error log records compute refusals like any command's.
    let log = c.get_log(nearstore_wire::opcode::lid::ERROR_INFORMATION, 0, 64, 0).await.unwrap();
    assert_ne!(u64::from_le_bytes(log[..8].try_into().unwrap()), 0);
}

async fn submit(q: &mut IoQueue, sqe: Sqe, data: Data<'_>) -> nearstore_wire::Cqe {
    let qp = q.queue();
    let cid = qp.submit(sqe, data, 0).unwrap();
    qp.wait(cid, |_, _, _| {}).await.unwrap()
}

fn exec_sqe(nsid: u32) -> Sqe {
    let mut s = Sqe::new(cop::EXEC, 0);
    s.set_nsid(nsid);
    s
}

/// A target with small compute limits: results expire after `result_ttl_secs`, commands
/// time out after 1 s, 8 MiB per command.
async fn start_small(result_ttl_secs: u64) -> (Arc<Target>, Controller) {
    let (target, addr) = start_small_at(result_ttl_secs).await;
    let c = Controller::connect(nearstore_initiator::ConnectOptions::new(addr, common::NQN)).await.unwrap();
    (target, c)
}

/// [`start_small`] without a controller: the target and its address.
async fn start_small_at(result_ttl_secs: u64) -> (Arc<Target>, std::net::SocketAddr) {
    common::init_logs();
    let cfg = Config::from_toml(&format!(
        r#"
        [[listener]]
        address = "127.0.0.1:0"
        [compute]
        threads = 2
        timeout_secs = 1
        result_ttl_secs = {result_ttl_secs}
        memory_per_command = "8MiB"
        [[subsystem]]
        nqn = "{}"
        allow_any_host = true
        [[subsystem.namespace]]
        nsid = 1
        memory = "4MiB"
        "#,
        common::NQN
    ))
    .unwrap();
    let target = Target::from_config(&cfg).unwrap();
    let addr = target.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    (target, addr)
}

/// The results are held for 5 s: everything up to the partial fetch (128 EXECs, each on a
/// thread of its own, and the fetches) must come before the first result expires, which
/// under load took more than 1 s.
#[tokio::test]
async fn results_are_held_within_limits_and_expire() {
    let ttl = Duration::from_secs(5);
    let (_t, c) = start_small(ttl.as_secs()).await;
    let mut q = c.io_queue(1).await.unwrap();
    let d = crc_of(Object { len: 512, extents: vec![Extent::data(0, 512)] }).encode();
    // Fill the controller's result slots without fetching.
    let mut handles = Vec::new();
    for _ in 0..128 {
        let cqe = submit(&mut q, exec_sqe(1), Data::Out(&d)).await;
        assert!(cqe.status.is_success(), "{}", cqe.status);
        handles.push(cqe.dw0);
    }
    let cqe = submit(&mut q, exec_sqe(1), Data::Out(&d)).await;
    assert_eq!(cqe.status, cs::RESULTS_FULL);
    // Releasing one makes room.
    q.release(handles.pop().unwrap()).await.unwrap();
    let cqe = submit(&mut q, exec_sqe(1), Data::Out(&d)).await;
    assert!(cqe.status.is_success());
    // A fetch to the end releases the handle; a second fetch finds nothing.
    let r = q.fetch(cqe.dw0, cqe.dw1).await.unwrap();
    assert_eq!(r.len(), cqe.dw1 as usize);
    let mut f = Sqe::new(cop::FETCH, 0);
    f.set_cdw(10, cqe.dw0);
    assert_eq!(submit(&mut q, f, Data::In(4096)).await.status, cs::HANDLE_INVALID);
    // A fetch from an offset past the end, and a partial fetch that leaves the rest.
    let h = handles[0];
    let mut f = Sqe::new(cop::FETCH, 0);
    f.set_cdw(10, h).set_cdw(11, 1 << 20);
    assert_eq!(submit(&mut q, f, Data::In(512)).await.status, Status::INVALID_FIELD.dnr());
    let mut f = Sqe::new(cop::FETCH, 0);
    f.set_cdw(10, h);
    let part = submit(&mut q, f, Data::In(4)).await;
    assert!(part.status.is_success());
    assert_eq!(part.dw0, 4);
    assert!(part.dw1 > 0, "bytes remain after a partial fetch");
    // Unknown handles.
    assert!(matches!(q.release(0xdead_beef).await, Err(Error::Status { status, .. }) if status == cs::HANDLE_INVALID));
    // After the TTL every held result is gone, and the slots are free again.
    tokio::time::sleep(ttl + Duration::from_millis(300)).await;
    let mut f = Sqe::new(cop::FETCH, 0);
    f.set_cdw(10, handles[1]);
    assert_eq!(submit(&mut q, f, Data::In(512)).await.status, cs::HANDLE_INVALID);
    for _ in 0..100 {
        assert!(submit(&mut q, exec_sqe(1), Data::Out(&d)).await.status.is_success());
    }
}

/// A caller bounding the result (a target forwarding a command to a peer holds only its
/// own result bound): a larger result is refused and its handle released, so refusals
/// beyond the controller's 128 result slots never fill them; a result of exactly the
/// bound is taken.
#[tokio::test]
async fn a_result_past_the_callers_bound_is_refused_and_released() {
    let (_t, c) = start_small(60).await;
    let mut q = c.io_queue(1).await.unwrap();
    let d = crc_of(Object { len: 512, extents: vec![Extent::data(0, 512)] }).encode();
    let whole = q.compute(1, &d, T).await.expect("unbounded");
    for (i, max) in [0, 1, whole.len() - 1].into_iter().cycle().take(130).enumerate() {
        match q.compute_at_most(1, &d, T, max).await {
            Err(Error::Protocol(m)) => assert!(m.contains(&format!("more than the {max}")), "{i}: {m}"),
            other => panic!("{i}: a result of {} bytes under a bound of {max}: {other:?}", whole.len()),
        }
    }
    assert_eq!(q.compute_at_most(1, &d, T, whole.len()).await.expect("exactly the bound"), whole);
}

/// A FETCH's completion carries counts (valid bytes, bytes remaining): a C2HData with the
/// SUCCESS flag, allowed when the host disabled SQ flow control, stands for a completion
/// whose dw0 and dw1 are zero, so such a reply must still come with its CapsuleResp.
#[tokio::test]
async fn fetch_counts_survive_sq_flow_control_disabled() {
    let (_t, addr) = start_small_at(1).await;
    for disable_sqflow in [false, true] {
        let mut o = nearstore_initiator::ConnectOptions::new(addr, common::NQN);
        o.disable_sqflow = disable_sqflow;
        let c = Controller::connect(o).await.unwrap();
        let mut q = c.io_queue(1).await.unwrap();
        let d = crc_of(Object { len: 512, extents: vec![Extent::data(0, 512)] }).encode();
        let cqe = submit(&mut q, exec_sqe(1), Data::Out(&d)).await;
        assert!(cqe.status.is_success(), "{}", cqe.status);
        let (handle, len) = (cqe.dw0, cqe.dw1);
        assert!(len > 4, "a crc result has more than 4 bytes");
        let mut f = Sqe::new(cop::FETCH, 0);
        f.set_cdw(10, handle);
        let part = submit(&mut q, f, Data::In(4)).await;
        assert!(part.status.is_success(), "{}", part.status);
        assert_eq!((part.dw0, part.dw1), (4, len - 4), "sqflow disabled: {disable_sqflow}");
        let all = q.fetch(handle, len).await.unwrap();
        assert_eq!(all.len(), len as usize, "sqflow disabled: {disable_sqflow}");
    }
}

#[tokio::test]
async fn absurd_objects_time_out_and_memory_is_bounded() {
    let (_t, c) = start_small(1).await;
    let mut q = c.io_queue(1).await.unwrap();
    // A terabyte of zeros: valid, but it cannot finish in the 1 s timeout.
    let d = crc_of(Object { len: 1 << 40, extents: vec![Extent::zeros(1 << 40)] });
    let start = std::time::Instant::now();
    let e = q.compute(1, &d.encode(), T).await.unwrap_err();
    assert_refused(e, cs::TIMEOUT, "timed out after 1 s");
    assert!(start.elapsed() < Duration::from_secs(10));
    // Three inputs need 9 MiB of chunk buffers: more than the 8 MiB per command.
    let one = Object { len: 512, extents: vec![Extent::data(0, 512)] };
    let d = Descriptor { inputs: vec![one.clone(), one.clone(), one], ..crc_of(Object::default()) };
    let e = q.compute(1, &d.encode(), T).await.unwrap_err();
    assert_refused(e, cs::LIMIT_EXCEEDED, "compute.memory_per_command");
    // Still serving.
    let d = crc_of(Object { len: 512, extents: vec![Extent::data(0, 512)] });
    q.compute(1, &d.encode(), T).await.unwrap();
}

#[tokio::test]
async fn commands_run_in_parallel_and_results_come_back_to_their_command() {
    let env = common::start().await;
    let c = env.connect().await;
    let mut q = c.io_queue(1).await.unwrap();
    let data = content(1 << 20, 3);
    write_all(&mut q, 1, 0, &data, 512).await;
    // 16 EXECs in flight at once over different lengths; each result matches its own.
    let qp = q.queue();
    let mut cids = Vec::new();
    let descs: Vec<Vec<u8>> = (1..=16u64)
        .map(|k| {
            let len = k * 60_000;
            crc_of(Object { len, extents: vec![Extent::data(0, len.div_ceil(512) * 512)] }).encode()
        })
        .collect();
    for (k, d) in descs.iter().enumerate() {
        cids.push((qp.submit(exec_sqe(1), Data::Out(d), k as u64).unwrap(), k));
    }
    let mut replies = Vec::new();
    while replies.len() < cids.len() {
        qp.poll(|tag, cqe, _| replies.push((tag, cqe.status, cqe.dw0, cqe.dw1))).await.unwrap();
    }
    for (tag, status, handle, len) in replies {
        assert!(status.is_success());
        let json = q.fetch(handle, len).await.unwrap();
        let k = tag as usize + 1;
        let want = nearstore_compute::run("crc32c", b"", [&data[..k * 60_000]]).unwrap();
        assert_eq!(outcomes(&json), vec![want]);
    }
    // The metrics count them, and the object bytes they streamed.
    let text = nearstore_target::metrics::render(&env.target);
    assert!(text.contains("nearstore_compute_commands_total 16\n"), "{text}");
    let read: u64 = (1..=16u64).map(|k| k * 60_000).sum();
    assert!(text.contains(&format!("nearstore_compute_read_bytes_total {read}\n")), "{text}");
    assert!(text.contains("nearstore_compute_running 0\n"));
}
