//! Compare and the fused Compare and Write (docs/protocol.md, "Compare and Write"), with our
//! initiator: each case's statuses and blocks, pairs whose halves are missing or differ,
//! pairs raced by other pairs and plain writers, a connection closed between the halves.

mod common;

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use nearstore_initiator::{CompareAndWrite, Controller, Data, IoQueue};
use nearstore_target::backend::{Backend, FileBackend};
use nearstore_target::subsystem::Namespace;
use nearstore_wire::compute::opcode as cop;
use nearstore_wire::fused::opcode as fop;
use nearstore_wire::identify::{fuses, oncs};
use nearstore_wire::opcode::{admin, io};
use nearstore_wire::pdu::{self, flags, DataHdr, PduType};
use nearstore_wire::sqe::{fuse, sgl_id};
use nearstore_wire::{Sgl, Sqe, Status};

/// Namespaces of the common target: memory (512-byte blocks) and file (4096).
const NAMESPACES: [u32; 2] = [1, 2];
const MDTS_BYTES: usize = 128 * 1024;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect()
}

async fn queue(c: &Controller, nsid: u32) -> (IoQueue, u32, u64) {
    let ns = c.identify_namespace(nsid).await.unwrap();
    (c.io_queue(1).await.unwrap(), ns.block_size(), ns.nsze)
}

/// What a Compare (or a pair) ends with.
fn same(a: Status, b: Status) -> bool {
    (a.sct, a.sc, a.dnr) == (b.sct, b.sc, b.dnr)
}

#[tokio::test]
async fn identify_advertises_compare_and_the_fused_pair() {
    let env = common::start().await;
    let c = env.connect().await;
    assert_ne!(c.id.oncs & oncs::COMPARE, 0, "ONCS bit 0 (Compare)");
    assert_ne!(c.id.fuses & fuses::COMPARE_AND_WRITE, 0, "FUSES bit 0 (Compare and Write)");
}

#[tokio::test]
async fn compare_per_case() {
    let env = common::start().await;
    let c = env.connect().await;
    for nsid in NAMESPACES {
        let (mut q, bs, nsze) = queue(&c, nsid).await;
        let bsz = bs as usize;
        // (what, first block, bytes on the namespace there, bytes compared: None = the same,
        // Some(i) = the same but byte i flipped; expected status)
        type Case = (&'static str, u64, usize, Option<usize>, Result<bool, Status>);
        let cases: Vec<Case> = vec![
            ("one block, equal", 0, bsz, None, Ok(true)),
            ("one block, the first byte differs", 0, bsz, Some(0), Ok(false)),
            ("one block, the last byte differs", 3, bsz, Some(bsz - 1), Ok(false)),
            ("MDTS (in R2T data), equal", 16, MDTS_BYTES, None, Ok(true)),
            ("MDTS, the last byte differs", 16, MDTS_BYTES, Some(MDTS_BYTES - 1), Ok(false)),
            ("the namespace's last block", nsze - 1, bsz, None, Ok(true)),
            ("across the namespace's end", nsze - 1, 2 * bsz, None, Err(Status::LBA_OUT_OF_RANGE.dnr())),
            ("more than MDTS", 0, MDTS_BYTES + bsz, None, Err(Status::INVALID_FIELD.dnr())),
        ];
        for (what, slba, len, flip, want) in cases {
            let what = format!("nsid {nsid}: {what}");
            let data = pattern(len, slba as u8);
            let blocks_in_ns = (nsze - slba) as usize * bsz;
            if len <= blocks_in_ns && len <= MDTS_BYTES {
                q.write(nsid, slba, &data, bs, false).await.unwrap();
            }
            let mut cmp = data.clone();
            if let Some(i) = flip {
                cmp[i] ^= 0x80;
            }
            if len > MDTS_BYTES {
                // Past our initiator's own limit: the raw command with an SGL of its size.
                let nlb = (len / bsz) as u32;
                let s = Sqe::rw(io::COMPARE, nsid, slba, nlb, false);
                let mut qp = c.io_queue(2).await.unwrap();
                let cid = qp.queue().submit(s, Data::Out(&cmp[..MDTS_BYTES]), 0).unwrap();
                let cqe = qp.queue().wait(cid, |_, _, _| {}).await.unwrap();
                assert!(same(cqe.status, want.unwrap_err()), "{what}: {}", cqe.status);
                continue;
            }
            let got = q.compare(nsid, slba, &cmp, bs).await;
            match (got, want) {
                (Ok(g), Ok(w)) => assert_eq!(g, w, "{what}"),
                (Err(nearstore_initiator::Error::Status { status, .. }), Err(w)) => assert!(same(status, w), "{what}: {status}"),
                (g, w) => panic!("{what}: got {g:?}, want {w:?}"),
            }
        }
    }
    assert_eq!(env.target.stats.requests_lost.load(Relaxed), 0);
}

/// A pair's halves as sent: (opcode, FUSE, nsid, first block, blocks) each, the Compare's
/// data, the Write's.
struct Pair {
    first: Sqe,
    second: Sqe,
}

fn half(opcode: u8, fuse: u8, nsid: u32, slba: u64, nlb: u32) -> Sqe {
    let mut s = Sqe::rw(opcode, nsid, slba, nlb, false);
    s.set_fuse(fuse);
    s
}

#[tokio::test]
async fn compare_and_write_per_case() {
    let env = common::start().await;
    let c = env.connect().await;
    for nsid in NAMESPACES {
        let (mut q, bs, nsze) = queue(&c, nsid).await;
        let bsz = bs as usize;
        let fail = Status::ABORTED_FAILED_FUSED;
        let ok = Status::SUCCESS;
        // (what, the pair, its data's length (both halves), the Compare's data equal to the
        // blocks, (Compare's status, Write's status), written)
        type Case = (&'static str, Pair, usize, bool, (Status, Status), bool);
        let p = |s1: Sqe, s2: Sqe| Pair { first: s1, second: s2 };
        let cw = |slba: u64, nlb: u32| p(half(io::COMPARE, fuse::FIRST, nsid, slba, nlb), half(io::WRITE, fuse::SECOND, nsid, slba, nlb));
        let mdts_blocks = (MDTS_BYTES / bsz) as u32;
        let cases: Vec<Case> = vec![
            ("one block, equal: written", cw(10, 1), bsz, true, (ok, ok), true),
            ("one block, different: nothing written", cw(10, 1), bsz, false, (Status::COMPARE_FAILURE.dnr(), fail), false),
            ("MDTS in R2T data, equal: written", cw(32, mdts_blocks), MDTS_BYTES, true, (ok, ok), true),
            ("MDTS, different: nothing written", cw(32, mdts_blocks), MDTS_BYTES, false, (Status::COMPARE_FAILURE.dnr(), fail), false),
            ("the namespace's last block", cw(nsze - 1, 1), bsz, true, (ok, ok), true),
            (
                "the Write one block further",
                p(half(io::COMPARE, fuse::FIRST, nsid, 10, 1), half(io::WRITE, fuse::SECOND, nsid, 11, 1)),
                bsz,
                true,
                (fail, Status::INVALID_FIELD.dnr()),
                false,
            ),
            (
                "the Write one block longer",
                p(half(io::COMPARE, fuse::FIRST, nsid, 10, 1), half(io::WRITE, fuse::SECOND, nsid, 10, 2)),
                bsz,
                true,
                (fail, Status::INVALID_FIELD.dnr()),
                false,
            ),
            (
                "the Write on the other namespace (other blocks, its data not their size)",
                p(half(io::COMPARE, fuse::FIRST, nsid, 10, 1), half(io::WRITE, fuse::SECOND, 3 - nsid, 10, 1)),
                bsz,
                true,
                (fail, Status::DATA_SGL_LENGTH_INVALID.dnr()),
                false,
            ),
            ("across the namespace's end", cw(nsze - 1, 2), 2 * bsz, true, (Status::LBA_OUT_OF_RANGE.dnr(), fail), false),
            (
                "a Read (with data) as the first half",
                p(half(io::READ, fuse::FIRST, nsid, 10, 1), half(io::WRITE, fuse::SECOND, nsid, 10, 1)),
                bsz,
                true,
                (Status::INVALID_FIELD.dnr(), Status::ABORTED_MISSING_FUSED.dnr()),
                false,
            ),
            (
                "a Compare as the second half",
                p(half(io::COMPARE, fuse::FIRST, nsid, 10, 1), half(io::COMPARE, fuse::SECOND, nsid, 10, 1)),
                bsz,
                true,
                (fail, Status::INVALID_FIELD.dnr()),
                false,
            ),
        ];
        for (what, pair, len, equal, (s1, s2), written) in cases {
            let what = format!("nsid {nsid}: {what}");
            let slba = pair.first.slba();
            let inside = slba + (len / bsz) as u64 <= nsze;
            let before = pattern(len, 1);
            if inside {
                q.write(nsid, slba, &before, bs, false).await.unwrap();
            }
            let cmp = if equal { before.clone() } else { pattern(len, 2) };
            let new = pattern(len, 3);
            let second_len = (pair.second.nlb() as usize * bsz).min(MDTS_BYTES);
            let second_data = pattern(second_len, 3);
            let got = q.fused_pair(pair.first, &cmp, pair.second, &second_data, &what).await.unwrap();
            assert!(same(got.compare, s1) && same(got.write, s2), "{what}: got {got:?}, want ({s1}, {s2})");
            if inside {
                let back = q.read(nsid, slba, (len / bsz) as u32, bs).await.unwrap();
                let want = if written { &new } else { &before };
                assert!(back == *want, "{what}: the blocks are {}", if back == before { "as before" } else { "changed" });
            }
        }
        // The Write next to a mismatched one was never written there either.
        let back = q.read(nsid, 11, 1, bs).await.unwrap();
        assert!(back != pattern(bsz, 3), "nsid {nsid}: a refused Write reached block 11");
    }
    assert_eq!(env.target.stats.requests_lost.load(Relaxed), 0);
}

/// Submits `cmds` back to back on a fresh queue and returns their statuses in order.
async fn back_to_back(q: &mut IoQueue, cmds: Vec<(Sqe, Vec<u8>)>) -> Vec<Status> {
    let qp = q.queue();
    let mut cids = Vec::new();
    for (i, (s, d)) in cmds.iter().enumerate() {
        cids.push(qp.submit(*s, if d.is_empty() { Data::None } else { Data::Out(d) }, i as u64).unwrap());
    }
    let mut got = vec![None; cids.len()];
    while got.iter().any(Option::is_none) {
        qp.poll(|tag, cqe, _| got[tag as usize] = Some(cqe.status)).await.unwrap();
    }
    got.into_iter().map(Option::unwrap).collect()
}

#[tokio::test]
async fn halves_out_of_order_are_missing_their_partner() {
    let env = common::start().await;
    let c = env.connect().await;
    let (mut q, bs, _) = queue(&c, 1).await;
    let bsz = bs as usize;
    let missing = Status::ABORTED_MISSING_FUSED.dnr();
    let ok = Status::SUCCESS;
    let data = pattern(bsz, 5);
    q.write(1, 40, &data, bs, false).await.unwrap();
    let cmp = |slba| (half(io::COMPARE, fuse::FIRST, 1, slba, 1), data.clone());
    let wr = |slba, f| (half(io::WRITE, f, 1, slba, 1), pattern(bsz, 6));
    let mut flush = Sqe::new(io::FLUSH, 0);
    flush.set_nsid(1);
    let flush = (flush, Vec::new());
    // (what, commands in submission order, their statuses)
    type Case = (&'static str, Vec<(Sqe, Vec<u8>)>, Vec<Status>);
    let cases: Vec<Case> = vec![
        ("a second alone", vec![wr(40, fuse::SECOND)], vec![missing]),
        ("a plain Write between the halves", vec![cmp(40), wr(41, fuse::NORMAL), wr(40, fuse::SECOND)], vec![missing, ok, missing]),
        ("a Flush after the first", vec![cmp(40), flush], vec![missing, ok]),
        ("two firsts, then a second", vec![cmp(40), cmp(40), wr(40, fuse::SECOND)], vec![missing, ok, ok]),
        ("a second after a whole pair", vec![cmp(40), wr(40, fuse::SECOND), wr(40, fuse::SECOND)], vec![ok, ok, missing]),
    ];
    for (what, cmds, want) in cases {
        // Each case starts from the blocks `data` (a pair that wrote changed them).
        q.write(1, 40, &data, bs, false).await.unwrap();
        let got = back_to_back(&mut q, cmds).await;
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(same(*g, *w), "{what}: command {i} got {g}, want {w}");
        }
    }
    assert_eq!(env.target.stats.requests_lost.load(Relaxed), 0);
}

#[tokio::test]
async fn fuse_set_on_any_other_command_is_refused_with_its_partner() {
    let env = common::start().await;
    let c = env.connect().await;
    let (mut q, bs, _) = queue(&c, 1).await;
    let bsz = bs as usize;
    let invalid = Status::INVALID_FIELD.dnr();
    let missing = Status::ABORTED_MISSING_FUSED.dnr();
    let failed = Status::ABORTED_FAILED_FUSED;
    let data = pattern(bsz, 5);
    let cmp = || (half(io::COMPARE, fuse::FIRST, 1, 40, 1), data.clone());
    let wr = |f| (half(io::WRITE, f, 1, 40, 1), pattern(bsz, 6));
    // Vendor commands that run, plain, without data: a compute RELEASE (of no handle) and
    // a fused OUTCOME; READ CHECKSUM; a reservation, a Flush and a Read.
    let vendor = |opcode: u8, f: u8| {
        let mut s = Sqe::new(opcode, 0);
        s.set_nsid(1).set_cdw(10, 0x1234);
        s.set_fuse(f);
        (s, Vec::new())
    };
    let mut report = Sqe::new(io::RESERVATION_REPORT, 0);
    report.set_nsid(1);
    report.set_fuse(fuse::SECOND);
    // (what, commands in submission order, their statuses)
    type Case = (&'static str, Vec<(Sqe, Vec<u8>)>, Vec<Status>);
    let cases: Vec<Case> = vec![
        ("RELEASE as a first", vec![vendor(cop::RELEASE, fuse::FIRST)], vec![invalid]),
        ("RELEASE as a first, then a Write second", vec![vendor(cop::RELEASE, fuse::FIRST), wr(fuse::SECOND)], vec![invalid, missing]),
        ("a Compare, then RELEASE as its second", vec![cmp(), vendor(cop::RELEASE, fuse::SECOND)], vec![failed, invalid]),
        ("a Compare, then OUTCOME as its second", vec![cmp(), vendor(fop::OUTCOME, fuse::SECOND)], vec![failed, invalid]),
        ("a Compare, then READ CHECKSUM as its second", vec![cmp(), vendor(fop::READ_CHECKSUM, fuse::SECOND)], vec![failed, invalid]),
        ("a Compare, then a Reservation Report as its second", vec![cmp(), (report, Vec::new())], vec![failed, invalid]),
        ("a Flush as a first", vec![vendor(io::FLUSH, fuse::FIRST), wr(fuse::SECOND)], vec![invalid, missing]),
        ("FUSE 11b on a Write", vec![wr(3)], vec![invalid]),
        // The pair still works after each.
        ("a whole pair", vec![cmp(), wr(fuse::SECOND)], vec![Status::SUCCESS, Status::SUCCESS]),
    ];
    for (what, cmds, want) in cases {
        q.write(1, 40, &data, bs, false).await.unwrap();
        let got = back_to_back(&mut q, cmds).await;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(same(*g, *w), "{what}: command {i} got {g}, want {w}");
        }
    }
    // Nor is an admin command fused.
    let mut identify = Sqe::new(admin::IDENTIFY, 0);
    identify.set_cdw(10, 1);
    for f in [fuse::FIRST, fuse::SECOND] {
        identify.set_fuse(f);
        match c.admin(identify, Data::In(4096), "identify").await {
            Err(nearstore_initiator::Error::Status { status, .. }) => assert!(same(status, invalid), "admin FUSE {f}: {status}"),
            r => panic!("admin FUSE {f}: {:?}", r.map(|(cqe, _)| cqe.status)),
        }
    }
    assert_eq!(env.target.stats.requests_lost.load(Relaxed), 0);
}

/// Sends a capsule on a raw queue: its data in the capsule, or (`r2t`) `len` bytes the
/// target asks for.
async fn send_capsule(q: &mut nearstore_initiator::QueuePair<tokio::net::TcpStream>, mut sqe: Sqe, cid: u16, data: &[u8], r2t: bool) {
    sqe.set_cid(cid);
    let id = if r2t { sgl_id::TRANSPORT } else { sgl_id::IN_CAPSULE };
    sqe.set_sgl(Sgl { addr: 0, len: data.len() as u32, id });
    let mut b = Vec::new();
    pdu::put_capsule_cmd(&mut b, &sqe, if r2t { &[] } else { data }, false, true);
    q.send_raw(&b).await.unwrap();
}

/// The next PDU of a raw queue, or a panic if none comes (a pair that hangs).
async fn next_pdu(q: &mut nearstore_initiator::QueuePair<tokio::net::TcpStream>, what: &str) -> (PduType, Vec<u8>) {
    tokio::time::timeout(Duration::from_secs(30), q.recv_raw())
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing came"))
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}

#[tokio::test]
async fn pairs_follow_submission_order_not_command_identifiers() {
    // A pair whose first half failed (a data digest error) while its second's data is
    // still on the way; its first's identifier, free again, starts the next pair, which
    // must run at once, not wait for (or be taken for) the first pair.
    let env = common::start().await;
    let mut o = env.opts();
    o.ddgst = true;
    let c = nearstore_initiator::Controller::connect(o).await.unwrap();
    let (mut q, bs, _) = queue(&c, 1).await;
    let big = 64 * 1024;
    let nlb = (big / bs as usize) as u32;
    let old = pattern(big, 1);
    q.write(1, 400, &old, bs, false).await.unwrap();
    let small = pattern(bs as usize, 2);
    q.write(1, 600, &small, bs, false).await.unwrap();
    let raw = q.queue();
    // First pair, cids 1 and 2, both halves' data asked for by R2T.
    send_capsule(raw, half(io::COMPARE, fuse::FIRST, 1, 400, nlb), 1, &old, true).await;
    send_capsule(raw, half(io::WRITE, fuse::SECOND, 1, 400, nlb), 2, &pattern(big, 3), true).await;
    // (The second's R2T may wait for a buffer the first gives back.)
    let mut r2ts = Vec::new();
    let mut cqes = Vec::new();
    while !r2ts.iter().any(|r: &DataHdr| r.cccid == 1) {
        let (t, h) = next_pdu(raw, "the first's R2T").await;
        assert_eq!(t, PduType::R2T);
        r2ts.push(DataHdr::decode(&h));
    }
    // The first's data with a bad digest: it fails, its identifier is free.
    let r = *r2ts.iter().find(|r| r.cccid == 1).unwrap();
    let mut b = Vec::new();
    pdu::put_pdu(&mut b, PduType::H2CData, flags::LAST_PDU, &DataHdr { offset: 0, len: big as u32, ..r }.psh(), &old, false, true);
    let n = b.len();
    b[n - 1] ^= 0xff;
    raw.send_raw(&b).await.unwrap();
    while cqes.is_empty() || !r2ts.iter().any(|r| r.cccid == 2) {
        let (t, h) = next_pdu(raw, "the first half's failure and the second's R2T").await;
        match t {
            PduType::R2T => r2ts.push(DataHdr::decode(&h)),
            PduType::CapsuleResp => cqes.push(pdu::capsule_cqe(&h)),
            t => panic!("{t:?}"),
        }
    }
    assert_eq!(cqes.iter().map(|c| (c.cid, c.status)).collect::<Vec<_>>(), [(1, Status::TRANSIENT_TRANSPORT_ERROR)]);
    // Second pair: cid 1 again and 3, in-capsule, on other blocks.
    send_capsule(raw, half(io::COMPARE, fuse::FIRST, 1, 600, 1), 1, &small, false).await;
    send_capsule(raw, half(io::WRITE, fuse::SECOND, 1, 600, 1), 3, &pattern(bs as usize, 4), false).await;
    let mut got = Vec::new();
    while got.len() < 2 {
        let (t, h) = next_pdu(raw, "the second pair's completions").await;
        assert_eq!(t, PduType::CapsuleResp);
        let cqe = pdu::capsule_cqe(&h);
        got.push((cqe.cid, cqe.status));
    }
    got.sort_by_key(|g| g.0);
    assert_eq!(got, [(1, Status::SUCCESS), (3, Status::SUCCESS)], "the second pair ran");
    // The first pair's second, its data in: aborted with its failed first.
    let r = *r2ts.iter().find(|r| r.cccid == 2).unwrap();
    let mut b = Vec::new();
    pdu::put_pdu(
        &mut b,
        PduType::H2CData,
        flags::LAST_PDU,
        &DataHdr { offset: 0, len: big as u32, ..r }.psh(),
        &pattern(big, 3),
        false,
        true,
    );
    raw.send_raw(&b).await.unwrap();
    let (t, h) = next_pdu(raw, "the first pair's second").await;
    assert_eq!(t, PduType::CapsuleResp);
    let cqe = pdu::capsule_cqe(&h);
    assert_eq!((cqe.cid, cqe.status), (2, Status::ABORTED_FAILED_FUSED));
    assert_eq!(q.read(1, 400, nlb, bs).await.unwrap(), old, "the failed pair wrote");
    assert_eq!(q.read(1, 600, 1, bs).await.unwrap(), pattern(bs as usize, 4), "the second pair did not write");
    let ns = env.target.subsystem(common::NQN).unwrap().namespace(1).unwrap();
    assert_eq!(ns.ranges.counts(), (0, 0, 0));
    assert_eq!(env.target.stats.requests_lost.load(Relaxed), 0);
}

/// Blocks (4 KiB) each increment compares and writes: the counter's, and one for each plain
/// writer (at most SPAN - 1).
const SPAN: u32 = 5;

/// `k` hosts each add one, `n` times, to the counter in the first 8 bytes of block 200
/// through `step`; `writers` more hosts meanwhile each write their own block inside the
/// pairs' range (writer `w` block 201 + w) with a sequence number, and read it back: a
/// pair that succeeds writes back what it compared, so a writer finds its own last value
/// unless a pair compared, then wrote around its write (not atomic). Returns (the counter,
/// the increments that reported success).
async fn count_up<F>(env: &common::Env, k: usize, n: usize, writers: usize, step: F) -> (u64, u64)
where
    F: Fn(IoQueue, usize) -> tokio::task::JoinHandle<(IoQueue, u64)>,
{
    assert!(writers < SPAN as usize);
    let c = env.connect().await;
    let (mut q, bs, _) = queue(&c, 2).await;
    let bsz = bs as usize;
    q.write(2, 200, &vec![0u8; SPAN as usize * bsz], bs, false).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mut plain = Vec::new();
    for w in 0..writers {
        let c = env.connect().await;
        let stop = stop.clone();
        plain.push(tokio::spawn(async move {
            let (mut q, bs, _) = queue(&c, 2).await;
            let block = 201 + w as u64;
            let mut writes = 0u64;
            while !stop.load(Relaxed) {
                writes += 1;
                let mut b = vec![0u8; bs as usize];
                b[..8].copy_from_slice(&writes.to_le_bytes());
                b[8] = w as u8 + 1;
                q.write(2, block, &b, bs, false).await.unwrap_or_else(|e| panic!("writer {w}: {e}"));
                let back = q.read(2, block, 1, bs).await.unwrap_or_else(|e| panic!("writer {w}: {e}"));
                assert!(back == b, "writer {w}: its write {writes} was undone by a pair");
                // Paced: a writer in a tight loop changed the pairs' blocks between nearly
                // every read and Compare, and the pairs retried for minutes (87 to 474 s in
                // two suite runs); a write every millisecond still lands among the pairs.
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            assert!(writes > 0, "writer {w} wrote nothing");
        }));
    }
    let mut hosts = Vec::new();
    let mut conns = Vec::new();
    for _ in 0..k {
        let c = env.connect().await;
        let (q, _, _) = queue(&c, 2).await;
        hosts.push(step(q, n));
        conns.push(c);
    }
    let mut successes = 0;
    for h in hosts {
        successes += h.await.unwrap().1;
    }
    stop.store(true, Relaxed);
    for p in plain {
        p.await.unwrap();
    }
    let back = q.read(2, 200, 1, bs).await.unwrap();
    (u64::from_le_bytes(back[..8].try_into().unwrap()), successes)
}

/// One increment with the fused pair: read the blocks, Compare them and Write them with
/// the counter plus one; again while the Compare finds them changed.
fn fused_increments(mut q: IoQueue, n: usize) -> tokio::task::JoinHandle<(IoQueue, u64)> {
    tokio::spawn(async move {
        let mut done = 0;
        while done < n as u64 {
            let old = q.read(2, 200, SPAN, 4096).await.unwrap();
            let mut new = old.clone();
            let v = u64::from_le_bytes(old[..8].try_into().unwrap());
            new[..8].copy_from_slice(&(v + 1).to_le_bytes());
            let r: CompareAndWrite = q.compare_and_write(2, 200, &old, &new, 4096, false).await.unwrap();
            if r.written() {
                done += 1;
            } else {
                assert!(r.differed(), "a pair failed otherwise: {r:?}");
            }
        }
        (q, done)
    })
}

#[tokio::test]
async fn concurrent_pairs_and_writers_lose_no_increment() {
    let env = common::start().await;
    // (hosts adding, increments each, plain writers)
    for (k, n, writers) in [(4, 50, 0), (4, 50, 2), (8, 20, 4)] {
        let (count, successes) = count_up(&env, k, n, writers, fused_increments).await;
        assert_eq!(successes, (k * n) as u64, "{k} hosts, {writers} writers: every host made its increments");
        assert_eq!(count, successes, "{k} hosts, {writers} writers: the counter lost increments");
    }
    let ns = env.target.subsystem(common::NQN).unwrap().namespace(2).unwrap();
    assert_eq!(ns.ranges.counts(), (0, 0, 0), "no range held or waited for at the end");
    assert_eq!(env.target.stats.requests_lost.load(Relaxed), 0);
}

/// Increments done as a Compare, then a Write, two commands: every host reads and compares,
/// then (a barrier between) every host writes what it compared plus one, so each round
/// every host succeeds and the counter moves by one. What the pair must not be.
fn split_increments(hosts: usize) -> impl Fn(IoQueue, usize) -> tokio::task::JoinHandle<(IoQueue, u64)> {
    let barrier = Arc::new(tokio::sync::Barrier::new(hosts));
    move |mut q, n| {
        let barrier = barrier.clone();
        tokio::spawn(async move {
            let mut done = 0;
            for _ in 0..n {
                let old = q.read(2, 200, SPAN, 4096).await.unwrap();
                let mut new = old.clone();
                let v = u64::from_le_bytes(old[..8].try_into().unwrap());
                new[..8].copy_from_slice(&(v + 1).to_le_bytes());
                let equal = q.compare(2, 200, &old, 4096).await.unwrap();
                barrier.wait().await;
                if equal {
                    q.write(2, 200, &new, 4096, false).await.unwrap();
                    done += 1;
                }
                barrier.wait().await;
            }
            (q, done)
        })
    }
}

#[tokio::test]
async fn the_counter_check_catches_a_compare_then_write_that_is_not_atomic() {
    // count_up's check, the one concurrent_pairs_and_writers_lose_no_increment makes, against
    // hosts whose Compare and Write are two commands: it sees increments lost.
    let env = common::start().await;
    let (k, n) = (3, 10);
    let (count, successes) = count_up(&env, k, n, 0, split_increments(k)).await;
    assert_eq!(successes, (k * n) as u64, "every split increment reports success");
    assert_eq!(count, n as u64, "each round's hosts overwrote one another");
    assert_ne!(count, successes, "the check fails a compare-then-write that is not atomic");
    // The same interleaving with the pair: the second finds the blocks changed.
    let c = env.connect().await;
    let (mut a, bs, _) = queue(&c, 2).await;
    let c2 = env.connect().await;
    let (mut b, _, _) = queue(&c2, 2).await;
    let old = a.read(2, 200, SPAN, bs).await.unwrap();
    let mut new = old.clone();
    new[..8].copy_from_slice(&(count + 1).to_le_bytes());
    assert!(a.compare_and_write(2, 200, &old, &new, bs, false).await.unwrap().written());
    assert!(b.compare_and_write(2, 200, &old, &new, bs, false).await.unwrap().differed());
}

#[tokio::test]
async fn a_connection_closed_between_the_halves_leaves_nothing_half_done() {
    let env = common::start().await;
    let ns = env.target.subsystem(common::NQN).unwrap().namespace(1).unwrap();
    for len in [512usize, 64 * 1024] {
        let unfinished = env.target.stats.requests_unfinished.load(Relaxed);
        let c = env.connect().await;
        let (mut q, bs, _) = queue(&c, 1).await;
        let before = pattern(len, 7);
        q.write(1, 300, &before, bs, false).await.unwrap();
        // The first half alone, its data in the capsule or waiting for its R2T, then the
        // connection goes.
        let first = half(io::COMPARE, fuse::FIRST, 1, 300, (len / 512) as u32);
        q.queue().submit(first, Data::Out(&before), 0).unwrap();
        q.queue().flush().await.unwrap();
        drop(q);
        drop(c);
        // Another host finds the blocks as they were, writes them plainly and pairs on
        // them: nothing holds them.
        let c = env.connect().await;
        let (mut q, bs, _) = queue(&c, 1).await;
        // The target ends the abandoned first half with its queue.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while env.target.stats.requests_unfinished.load(Relaxed) == unfinished && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            env.target.stats.requests_unfinished.load(Relaxed) > unfinished,
            "{len} bytes: the first half was not ended with its queue"
        );
        assert_eq!(q.read(1, 300, (len / 512) as u32, bs).await.unwrap(), before, "{len} bytes: the blocks changed");
        q.write(1, 300, &pattern(len, 8), bs, false).await.unwrap();
        let r = q.compare_and_write(1, 300, &pattern(len, 8), &pattern(len, 9), bs, false).await.unwrap();
        assert!(r.written(), "{len} bytes: {r:?}");
        assert_eq!(ns.ranges.counts(), (0, 0, 0), "{len} bytes: a range is still held");
    }
    assert_eq!(env.target.stats.requests_lost.load(Relaxed), 0);
}

/// A file namespace whose writes wait at a gate the test opens (reads pass), saying when
/// one started and finished. Without an io_uring descriptor its operations run on the I/O
/// pool, as with `io_engine = "threads"`.
struct WriteGate {
    file: FileBackend,
    open: AtomicBool,
    started: AtomicBool,
    finished: AtomicBool,
}

impl Backend for WriteGate {
    fn describe(&self) -> String {
        "write-gated file".into()
    }
    fn size(&self) -> u64 {
        self.file.size()
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        self.file.read_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
        self.started.store(true, Relaxed);
        while !self.open.load(Relaxed) {
            std::thread::sleep(Duration::from_millis(2));
        }
        let r = self.file.write_at(buf, off);
        self.finished.store(true, Relaxed);
        r
    }
    fn flush(&self) -> std::io::Result<()> {
        self.file.flush()
    }
    fn write_zeroes(&self, off: u64, len: u64, deallocate: bool) -> std::io::Result<()> {
        self.file.write_zeroes(off, len, deallocate)
    }
}

async fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(std::time::Instant::now() < until, "{what}: not within 10 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// B's plain write of a block is held at the storage when B's connection closes; A's pair
/// over that block, comparing with B's data, must wait until the write has finished, then
/// find B's data and write. Before, the write's range went with B's closed queue while
/// the write still ran: A's pair compared the old block and failed (or, had it matched,
/// would have been overwritten by B's write after it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pair_waits_for_a_plain_write_still_at_the_storage_after_its_host_closed() {
    const GATED: u32 = 3;
    let env = common::start().await;
    let file = FileBackend::open(&env.dir.path().join("gated.img"), Some(16 << 20)).unwrap();
    let gate =
        Arc::new(WriteGate { file, open: AtomicBool::new(false), started: AtomicBool::new(false), finished: AtomicBool::new(false) });
    let ns = Namespace::new(common::NQN, GATED, gate.clone(), 4096);
    env.target.subsystem(common::NQN).unwrap().add_namespace(ns).unwrap();
    let ns = env.target.subsystem(common::NQN).unwrap().namespace(GATED).unwrap();
    let b_data = pattern(4096, 9);
    let b = env.connect().await;
    let mut bq = b.io_queue(1).await.unwrap();
    let data = b_data.clone();
    let running = tokio::spawn(async move {
        let _ = bq.write(GATED, 5, &data, 4096, false).await;
    });
    wait_for("B's write at the storage", || gate.started.load(Relaxed)).await;
    let unfinished = env.target.stats.requests_unfinished.load(Relaxed);
    running.abort();
    drop(b);
    wait_for("B's queue closed", || env.target.stats.requests_unfinished.load(Relaxed) > unfinished).await;
    let a = env.connect().await;
    let mut aq = a.io_queue(1).await.unwrap();
    let a_data = pattern(4096, 10);
    let new = a_data.clone();
    let pair = tokio::spawn(async move { aq.compare_and_write(GATED, 5, &b_data, &new, 4096, false).await.map(|r| (r, aq)) });
    wait_for("A's pair at the range", || ns.ranges.counts().0 == 1 || pair.is_finished()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!pair.is_finished(), "A's pair ended while B's write was at the storage");
    assert!(!gate.finished.load(Relaxed), "the gate is still shut");
    gate.open.store(true, Relaxed);
    let (r, mut aq) = tokio::time::timeout(Duration::from_secs(30), pair).await.expect("the pair completes").unwrap().unwrap();
    assert!(r.written(), "A's pair found B's data: {r:?}");
    assert_eq!(aq.read(GATED, 5, 1, 4096).await.unwrap(), a_data);
    assert_eq!(ns.ranges.counts(), (0, 0, 0));
    assert_eq!(env.target.stats.requests_lost.load(Relaxed), 0);
}

/// B writes a block, then fills its queue with 128 KiB reads and stops reading its socket,
/// so the target's send buffer to it stays full and the write's completion is never taken.
/// Once the storage has finished the write, A's pair over that block runs (finding B's
/// data): before, the write's range went only with its completion, and the pair waited for
/// B forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_stopped_reading_holds_no_range_after_its_write_finished() {
    const GATED: u32 = 3;
    let env = common::start().await;
    let file = FileBackend::open(&env.dir.path().join("gated.img"), Some(16 << 20)).unwrap();
    let gate =
        Arc::new(WriteGate { file, open: AtomicBool::new(false), started: AtomicBool::new(false), finished: AtomicBool::new(false) });
    let ns = Namespace::new(common::NQN, GATED, gate.clone(), 4096);
    env.target.subsystem(common::NQN).unwrap().add_namespace(ns).unwrap();
    let b_data = pattern(4096, 11);
    let b = env.connect().await;
    let mut bq = b.io_queue(1).await.unwrap();
    let qp = bq.queue();
    qp.submit(Sqe::rw(io::WRITE, GATED, 4000, 1, false), Data::Out(&b_data), 1000).unwrap();
    qp.flush().await.unwrap();
    wait_for("B's write at the storage", || gate.started.load(Relaxed)).await;
    // 120 reads of 128 KiB (15 MiB): more than the socket buffers and the target's send
    // buffer hold; B never reads a byte of them.
    for tag in 0..120u64 {
        qp.submit(Sqe::rw(io::READ, GATED, tag * 32, 32, false), Data::In(128 << 10), tag).unwrap();
    }
    qp.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    gate.open.store(true, Relaxed);
    wait_for("B's write finished at the storage", || gate.finished.load(Relaxed)).await;
    let a = env.connect().await;
    let mut aq = a.io_queue(1).await.unwrap();
    let a_data = pattern(4096, 12);
    let r = tokio::time::timeout(Duration::from_secs(10), aq.compare_and_write(GATED, 4000, &b_data, &a_data, 4096, false))
        .await
        .expect("the pair waited for a host that stopped reading")
        .unwrap();
    assert!(r.written(), "A's pair found B's data: {r:?}");
    assert_eq!(aq.read(GATED, 4000, 1, 4096).await.unwrap(), a_data);
    drop(bq);
    drop(b);
}
