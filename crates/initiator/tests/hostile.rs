//! The initiator against a hostile target: whatever a target sends, the initiator returns
//! a result or an error, never panics, never hangs (every exchange is bounded), and never
//! sizes a buffer by what the target says beyond its own limits (`limits.rs`).
//!
//! Two fakes: one queue over a Unix socket pair (ICResp, then scripted PDUs after the
//! command, then end of stream), driven by a table of the reproduced cases and by
//! proptest with mutated and random PDUs; and a whole controller on loopback TCP
//! (Connect, properties, Identify, logs, compute) whose answers a table bends.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nearstore_initiator::limits::{IN_CAPSULE_BYTES_MAX, TRANSFER_BYTES_MAX};
use nearstore_initiator::{ConnectOptions, Controller, Data, Error, QueueOptions, QueuePair};
use nearstore_wire::compute::opcode as cop;
use nearstore_wire::fabrics::{connect, csts, prop};
use nearstore_wire::identify::{cntrltype, IdentifyController, IdentifyNamespace};
use nearstore_wire::log::{self, DiscoveryEntry};
use nearstore_wire::opcode::{admin, cns, fctype, io, FABRICS};
use nearstore_wire::pdu::{self, flags, DataHdr, Framing, IcResp, PduError, PduType};
use nearstore_wire::{Cqe, Sqe, Status};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixStream};

/// Longest one exchange may take: past it the initiator hung, and the test fails.
const BOUND: Duration = Duration::from_secs(10);
const MAXH2C: u32 = 128 * 1024;

// ---------------------------------------------------------------- one queue

/// What the initiator submits on the queue.
#[derive(Clone, Copy, Debug)]
enum Cmd {
    Flush,
    Read(usize),
    Write(usize),
}

fn ic_resp(hdgst: bool, ddgst: bool, maxh2cdata: u32, cpda: u8, pfv: u16) -> Vec<u8> {
    let mut b = Vec::new();
    IcResp { pfv, cpda, hdgst, ddgst, maxh2cdata }.encode(&mut b);
    b
}

fn c2h(cid: u16, offset: u32, data: &[u8], fl: u8) -> Vec<u8> {
    let mut b = Vec::new();
    let h = DataHdr { cccid: cid, ttag: 0, offset, len: data.len() as u32 };
    pdu::put_pdu(&mut b, PduType::C2HData, fl, &h.psh(), data, false, false);
    b
}

fn resp(cid: u16, status: Status) -> Vec<u8> {
    let mut b = Vec::new();
    pdu::put_capsule_resp(&mut b, &Cqe { cid, status, ..Default::default() }, false);
    b
}

fn r2t(cid: u16, offset: u32, len: u32) -> Vec<u8> {
    let mut b = Vec::new();
    pdu::put_r2t(&mut b, &DataHdr { cccid: cid, ttag: 1, offset, len }, false);
    b
}

fn term(fes: u16, fei: u32, offending: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    pdu::put_term_req(&mut b, PduType::C2HTermReq, &PduError::new(fes, fei, "hostile"), offending);
    b
}

/// Reads one PDU (by its PLEN) from the initiator.
async fn read_pdu<S: AsyncReadExt + Unpin>(s: &mut S) -> Option<Vec<u8>> {
    let mut b = vec![0u8; 8];
    s.read_exact(&mut b).await.ok()?;
    let plen = u32::from_le_bytes(b[4..8].try_into().ok()?) as usize;
    b.resize(plen.max(8), 0);
    s.read_exact(&mut b[8..]).await.ok()?;
    Some(b)
}

/// The fake target of one queue: takes ICReq, sends `ic`, takes the command (only after
/// a whole ICResp: an initiator still waiting for the rest of a cut one sends none), sends
/// `reply`, closes its sending side, and drains what the initiator still sends.
async fn fake_queue(mut s: UnixStream, ic: Vec<u8>, reply: Vec<u8>) {
    if read_pdu(&mut s).await.is_none() || s.write_all(&ic).await.is_err() {
        return;
    }
    if ic.len() >= pdu::IC_LEN && read_pdu(&mut s).await.is_none() {
        return;
    }
    let _ = s.write_all(&reply).await;
    let _ = s.shutdown().await;
    let mut sink = vec![0u8; 64 << 10];
    while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
}

/// Runs `cmd` on a new queue against the fake: the data a successful command returned.
async fn exchange(opts: QueueOptions, ic: Vec<u8>, cmd: Cmd, reply: Vec<u8>) -> Result<Vec<u8>, Error> {
    let (a, b) = UnixStream::pair().unwrap();
    let fake = tokio::spawn(fake_queue(b, ic, reply));
    let r = tokio::time::timeout(BOUND, async move {
        let mut q = QueuePair::connect(a, opts).await?;
        let out = vec![0x5a; if let Cmd::Write(n) = cmd { n } else { 0 }];
        let (sqe, data) = match cmd {
            Cmd::Flush => (Sqe::new(io::FLUSH, 0), Data::None),
            Cmd::Read(n) => (Sqe::rw(io::READ, 1, 0, 1, false), Data::In(n)),
            Cmd::Write(_) => (Sqe::rw(io::WRITE, 1, 0, 1, false), Data::Out(&out)),
        };
        let cid = q.submit(sqe, data, 7)?;
        let mut got = Vec::new();
        let cqe = q
            .wait(cid, |tag, c, d| {
                assert_eq!((tag, c.cid), (7, cid), "a completion for a command never submitted");
                got.extend_from_slice(d);
            })
            .await?;
        if !cqe.status.is_success() {
            return Err(Error::Status { what: format!("{cmd:?}"), status: cqe.status, cqe });
        }
        Ok(got)
    })
    .await;
    fake.abort();
    r.unwrap_or_else(|_| panic!("the initiator hung on {cmd:?}"))
}

fn plain() -> QueueOptions {
    QueueOptions::default()
}

/// The data a case expects, or a part of its error.
type Expect = Result<Vec<u8>, &'static str>;
/// A case: its name, the command, the ICResp, the reply after the command, the result.
type Case = (&'static str, Cmd, Vec<u8>, Vec<u8>, Expect);

/// The reproduced and audited cases: each malformed reply is an error that says what
/// was wrong (a well-formed one, first, goes through: the harness itself works).
#[tokio::test]
async fn malformed_replies_to_one_command_are_errors() {
    let ic = || ic_resp(false, false, MAXH2C, 0, 0);
    let data: Vec<u8> = (0..512u32).map(|i| i as u8).collect();
    let ok_read: Expect = Ok(data.clone());
    let last = flags::LAST_PDU;
    let done = flags::LAST_PDU | flags::SUCCESS;
    #[rustfmt::skip]
    let cases: Vec<Case> = vec![
        // Well-formed: the harness delivers what a target sends.
        ("read completed by C2HData SUCCESS", Cmd::Read(512), ic(), c2h(0, 0, &data, done), ok_read.clone()),
        ("read in two C2HData, then CapsuleResp", Cmd::Read(512), ic(),
            [c2h(0, 0, &data[..256], 0), c2h(0, 256, &data[256..], last), resp(0, Status::SUCCESS)].concat(), ok_read.clone()),
        ("flush", Cmd::Flush, ic(), resp(0, Status::SUCCESS), Ok(vec![])),
        ("write through R2T", Cmd::Write(20_000), ic(), [r2t(0, 0, 20_000), resp(0, Status::SUCCESS)].concat(), Ok(vec![])),
        // Reproduced: a zero-length C2HData for a Flush panicked ("read slot has a buffer").
        ("zero-length C2HData for a Flush", Cmd::Flush, ic(), c2h(0, 0, &[], 0), Err("reads no data")),
        ("zero-length C2HData SUCCESS for a Flush", Cmd::Flush, ic(), c2h(0, 0, &[], done), Err("reads no data")),
        ("C2HData for an in-capsule write", Cmd::Write(100), ic(), c2h(0, 0, &[1; 10], 0), Err("reads no data")),
        ("C2HData SUCCESS for an in-capsule write", Cmd::Write(100), ic(), c2h(0, 0, &[], done), Err("reads no data")),
        ("C2HData for a write through R2T", Cmd::Write(20_000), ic(), c2h(0, 0, &[1; 10], 0), Err("reads no data")),
        ("C2HData for an unknown command id", Cmd::Read(512), ic(), c2h(5, 0, &data, done), Err("unknown command id 5")),
        ("C2HData past the transfer", Cmd::Read(256), ic(), c2h(0, 0, &data, done), Err("outside the expected transfer")),
        ("C2HData leaving a gap", Cmd::Read(512), ic(), c2h(0, 256, &data[..256], 0), Err("outside the expected transfer")),
        ("C2HData at offset 4 GiB - 1", Cmd::Read(512), ic(), c2h(0, u32::MAX, &data[..1], 0), Err("outside the expected transfer")),
        ("C2HData SUCCESS after half the data", Cmd::Read(512), ic(), c2h(0, 0, &data[..256], done), Err("after 256 of its 512 bytes")),
        ("C2HData SUCCESS without LAST_PDU", Cmd::Read(512), ic(), c2h(0, 0, &data, flags::SUCCESS), Err("SUCCESS without LAST_PDU")),
        ("CapsuleResp success after half the data", Cmd::Read(512), ic(),
            [c2h(0, 0, &data[..256], 0), resp(0, Status::SUCCESS)].concat(), Err("completed with 256 of its 512 bytes")),
        ("CapsuleResp success with no data", Cmd::Read(512), ic(), resp(0, Status::SUCCESS), Err("completed with 0 of its 512 bytes")),
        ("CapsuleResp for an unknown command id", Cmd::Flush, ic(), resp(9, Status::SUCCESS), Err("unknown command id 9")),
        ("CapsuleResp twice", Cmd::Flush, ic(), [resp(0, Status::SUCCESS), resp(0, Status::SUCCESS)].concat(), Err("unknown command id 0")),
        ("R2T for a read", Cmd::Read(512), ic(), r2t(0, 0, 512), Err("has no data to send")),
        ("R2T for an in-capsule write", Cmd::Write(100), ic(), r2t(0, 0, 100), Err("has no data to send")),
        ("R2T for an unknown command id", Cmd::Write(20_000), ic(), r2t(3, 0, 100), Err("unknown command id 3")),
        ("R2T past the write", Cmd::Write(20_000), ic(), r2t(0, 0, 40_000), Err("outside the command's 20000 bytes")),
        ("R2T of zero bytes", Cmd::Write(20_000), ic(), r2t(0, 0, 0), Err("outside the command's")),
        ("R2T at offset 4 GiB - 1", Cmd::Write(20_000), ic(), r2t(0, u32::MAX, u32::MAX), Err("outside the command's")),
        ("C2HTermReq", Cmd::Read(512), ic(), term(2, 4, &[1, 2, 3]), Err("terminated the connection (TermReq fes 0x2, field at byte 4)")),
        ("C2HTermReq cut short", Cmd::Read(512), ic(), term(2, 4, &[1; 100])[..30].to_vec(), Err("closed")),
        ("C2HData beyond the negotiated maximum", Cmd::Read(512), ic(), c2h(0, 0, &vec![0; 200_000], 0), Err("exceeds the negotiated maximum")),
        ("unknown PDU type", Cmd::Flush, ic(), vec![0x55, 0, 8, 0, 8, 0, 0, 0], Err("unknown PDU type")),
        ("a host-to-controller PDU", Cmd::Flush, ic(), { let mut b = resp(0, Status::SUCCESS); b[0] = PduType::CapsuleCmd as u8; b }, Err("not valid in this direction")),
        ("ICResp again", Cmd::Flush, ic(), ic(), Err("unexpected IcResp")),
        ("PLEN shorter than the header", Cmd::Flush, ic(), { let mut b = resp(0, Status::SUCCESS); b[4] = 8; b }, Err("PLEN shorter")),
        ("PLEN of 4 GiB - 1", Cmd::Flush, ic(), { let mut b = c2h(0, 0, &data, 0); b[4..8].copy_from_slice(&u32::MAX.to_le_bytes()); b }, Err("exceeds the negotiated maximum")),
        ("HLEN not the type's", Cmd::Flush, ic(), { let mut b = resp(0, Status::SUCCESS); b[2] = 72; b }, Err("HLEN")),
        ("header digest flag that was not negotiated", Cmd::Flush, ic(), { let mut b = resp(0, Status::SUCCESS); b[1] = flags::HDGSTF; b }, Err("HDGSTF")),
        ("connection closed inside a PDU", Cmd::Read(512), ic(), c2h(0, 0, &data, done)[..100].to_vec(), Err("closed")),
        ("connection closed before the completion", Cmd::Read(512), ic(), vec![], Err("closed")),
        // ICResp itself.
        ("ICResp with MAXH2CDATA 0", Cmd::Flush, ic_resp(false, false, 0, 0, 0), vec![], Err("unacceptable ICResp")),
        ("ICResp with MAXH2CDATA not a multiple of 4", Cmd::Flush, ic_resp(false, false, 4098, 0, 0), vec![], Err("unacceptable ICResp")),
        ("ICResp with CPDA 32 (reserved; PDO would not fit)", Cmd::Flush, ic_resp(false, false, MAXH2C, 32, 0), vec![], Err("unacceptable ICResp")),
        ("ICResp with CPDA 31", Cmd::Write(20_000), ic_resp(false, false, MAXH2C, 31, 0), [r2t(0, 0, 20_000), resp(0, Status::SUCCESS)].concat(), Ok(vec![])),
        ("ICResp with PFV 1", Cmd::Flush, ic_resp(false, false, MAXH2C, 0, 1), vec![], Err("unacceptable ICResp")),
        ("ICResp with digests not asked for", Cmd::Flush, ic_resp(true, true, MAXH2C, 0, 0), vec![], Err("unacceptable ICResp")),
        ("a CapsuleResp instead of ICResp", Cmd::Flush, resp(0, Status::SUCCESS), vec![], Err("expected ICResp")),
        ("a C2HTermReq instead of ICResp", Cmd::Flush, term(1, 0, &[]), vec![], Err("terminated the connection")),
        ("ICResp cut short", Cmd::Flush, ic()[..64].to_vec(), vec![], Err("closed")),
        ("nothing at all", Cmd::Flush, vec![], vec![], Err("closed")),
    ];
    for (name, cmd, ic, reply, want) in cases {
        let got = exchange(plain(), ic, cmd, reply).await;
        match (&got, &want) {
            (Ok(d), Ok(w)) => assert!(d == w, "{name}: got {} bytes, want {}", d.len(), w.len()),
            (Err(e), Err(w)) => assert!(e.to_string().contains(w), "{name}: error {e:?} should contain {w:?}"),
            _ => panic!("{name}: got {:?}, want {want:?}", got.map(|d| d.len())),
        }
    }
}

/// A C2HData whose data digest is wrong fails its command (transient), not the queue.
#[tokio::test]
async fn a_data_digest_error_fails_the_command() {
    let opts = QueueOptions { ddgst: true, ..plain() };
    let mut b = Vec::new();
    let h = DataHdr { cccid: 0, ttag: 0, offset: 0, len: 512 };
    pdu::put_pdu(&mut b, PduType::C2HData, flags::LAST_PDU, &h.psh(), &[7; 512], false, true);
    let n = b.len();
    b[n - 1] ^= 0xff;
    b.extend(resp(0, Status::SUCCESS));
    match exchange(opts, ic_resp(false, true, MAXH2C, 0, 0), Cmd::Read(512), b).await {
        Err(Error::Status { status, .. }) => assert_eq!(status, Status::TRANSIENT_TRANSPORT_ERROR),
        r => panic!("{:?}", r.map(|d| d.len())),
    }
}

/// One reply PDU of the proptest: well-formed with any field values, or raw bytes.
#[derive(Clone, Debug)]
enum Pdu {
    Data { cid: u16, offset: u32, len: usize, fl: u8 },
    Resp { cid: u16, sct: u8, sc: u8 },
    R2t { cid: u16, offset: u32, len: u32 },
    Term { fes: u16, fei: u32, n: usize },
    Ic { maxh2cdata: u32, cpda: u8 },
    Raw(Vec<u8>),
}

fn offset() -> impl Strategy<Value = u32> {
    prop_oneof![Just(0u32), 0u32..4096, any::<u32>()]
}

fn pdu_strategy() -> impl Strategy<Value = Pdu> {
    prop_oneof![
        4 => (0u16..3, offset(), 0usize..5000, any::<u8>()).prop_map(|(cid, offset, len, fl)| Pdu::Data { cid, offset, len, fl }),
        3 => (0u16..3, 0u8..2, any::<u8>()).prop_map(|(cid, sct, sc)| Pdu::Resp { cid, sct, sc: if sc < 128 { 0 } else { sc } }),
        2 => (0u16..3, offset(), prop_oneof![0u32..40_000, any::<u32>()]).prop_map(|(cid, offset, len)| Pdu::R2t { cid, offset, len }),
        1 => (any::<u16>(), any::<u32>(), 0usize..200).prop_map(|(fes, fei, n)| Pdu::Term { fes, fei, n }),
        1 => (any::<u32>(), any::<u8>()).prop_map(|(maxh2cdata, cpda)| Pdu::Ic { maxh2cdata, cpda }),
        1 => proptest::collection::vec(any::<u8>(), 0..80).prop_map(Pdu::Raw),
    ]
}

fn encode(p: &Pdu, hd: bool, dd: bool) -> Vec<u8> {
    let mut b = Vec::new();
    match p {
        Pdu::Data { cid, offset, len, fl } => {
            let h = DataHdr { cccid: *cid, ttag: 0, offset: *offset, len: *len as u32 };
            let data: Vec<u8> = (0..*len).map(|i| i as u8).collect();
            // The digest flags follow the negotiation; the rest of the flags are free.
            let fl = fl & !(flags::HDGSTF | flags::DDGSTF);
            pdu::put_pdu(&mut b, PduType::C2HData, fl, &h.psh(), &data, hd, dd);
        }
        Pdu::Resp { cid, sct, sc } => {
            let status = Status { sct: *sct, sc: *sc, dnr: false };
            pdu::put_capsule_resp(&mut b, &Cqe { cid: *cid, status, ..Default::default() }, hd);
        }
        Pdu::R2t { cid, offset, len } => pdu::put_r2t(&mut b, &DataHdr { cccid: *cid, ttag: 1, offset: *offset, len: *len }, hd),
        Pdu::Term { fes, fei, n } => b = term(*fes, *fei, &vec![0xee; *n]),
        Pdu::Ic { maxh2cdata, cpda } => b = ic_resp(hd, dd, *maxh2cdata, *cpda, 0),
        Pdu::Raw(r) => b = r.clone(),
    }
    b
}

fn cmd_strategy() -> impl Strategy<Value = Cmd> {
    prop_oneof![Just(Cmd::Flush), (1usize..6000).prop_map(Cmd::Read), (1usize..30_000).prop_map(Cmd::Write)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    /// Any sequence of PDUs, well-formed with any values or mutated byte by byte, after
    /// any ICResp: a result or an error, no panic, no hang; a successful read has exactly
    /// the bytes it asked for, and a flush or write none.
    #[test]
    fn any_reply_is_a_result_or_an_error(
        hd: bool,
        dd: bool,
        cmd in cmd_strategy(),
        ic in proptest::option::weighted(0.2, (any::<u32>(), 0u8..40, 0u16..2)),
        pdus in proptest::collection::vec((pdu_strategy(), proptest::option::of((any::<usize>(), any::<u8>()))), 0..6),
    ) {
        let ic = match ic {
            None => ic_resp(hd, dd, MAXH2C, 0, 0),
            Some((m, cpda, pfv)) => ic_resp(hd, dd, m, cpda, pfv),
        };
        let mut reply = Vec::new();
        for (p, flip) in &pdus {
            let mut b = encode(p, hd, dd);
            if let Some((at, x)) = flip {
                if !b.is_empty() {
                    let n = b.len();
                    b[at % n] ^= x;
                }
            }
            reply.extend(b);
        }
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let opts = QueueOptions { hdgst: hd, ddgst: dd, ..plain() };
        let r = rt.block_on(exchange(opts, ic, cmd, reply));
        if let Ok(d) = r {
            let want = if let Cmd::Read(n) = cmd { n } else { 0 };
            prop_assert_eq!(d.len(), want);
        }
    }
}

// ---------------------------------------------------------------- a whole controller

/// How the fake controller answers; each table case bends one thing.
#[derive(Clone)]
struct Script {
    /// The Connect response's DW1 (the acting-for confirmation).
    connect_dw1: u32,
    cap: u64,
    /// Whether CSTS.RDY ever comes up.
    ready: bool,
    id: IdentifyController,
    ns: IdentifyNamespace,
    /// Bytes a Get Log Page returns: this page, cut or padded to what was asked unless
    /// `log_as_is`.
    log: Vec<u8>,
    log_as_is: bool,
    /// EXEC's completion: handle and result length.
    exec: (u32, u32),
    /// FETCH's completion DW0 (valid bytes) and DW1 (remaining), given the offset asked.
    fetch: fn(u32) -> (u32, u32),
    /// Set AUTHREQ.ATR in the Connect response: the host must authenticate.
    atr: bool,
    /// What each Authentication Receive returns, in turn (its T_ID set to the host's
    /// Negotiate's unless `keep_t_id`), then nothing.
    auth: Vec<Vec<u8>>,
    keep_t_id: bool,
    /// The host's secrets.
    secret: Option<&'static str>,
    ctrl_secret: Option<&'static str>,
}

impl Default for Script {
    fn default() -> Script {
        Script {
            connect_dw1: 0,
            cap: nearstore_wire::fabrics::cap::build(127, 20),
            ready: true,
            id: IdentifyController {
                cntlid: 1,
                mdts: 5,
                ioccsz: (64 + 8192) / 16,
                cntrltype: cntrltype::IO,
                subnqn: "nqn.2026-11.io.nearstore:fake".into(),
                ..Default::default()
            },
            ns: IdentifyNamespace { nsze: 2048, ncap: 2048, lbads: 9, ..Default::default() },
            log: log::encode_discovery_log(7, &[DiscoveryEntry::default()]),
            log_as_is: false,
            exec: (1, 100),
            fetch: |off| (100u32.saturating_sub(off), 0),
            atr: false,
            auth: Vec::new(),
            keep_t_id: false,
            secret: None,
            ctrl_secret: None,
        }
    }
}

/// Serves connections with `script` until the test ends.
async fn fake_controller(script: Script) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(serve(s, script.clone()));
        }
    });
    addr
}

async fn serve(mut s: TcpStream, sc: Script) -> Option<()> {
    read_pdu(&mut s).await?;
    s.write_all(&ic_resp(false, false, MAXH2C, 0, 0)).await.ok()?;
    let framing = Framing { hdgst: false, ddgst: false, from_host: true, capsule_data_max: 16384, data_pdu_max: 1 << 20 };
    let mut auth = sc.auth.clone().into_iter();
    let mut t_id = [0u8; 2];
    loop {
        let b = read_pdu(&mut s).await?;
        let f = pdu::parse_frame(&b, &framing).ok()??;
        if f.hdr.pdu_type != PduType::CapsuleCmd {
            continue;
        }
        let sqe = pdu::capsule_sqe(f.header);
        let want = sqe.sgl().len as usize;
        let mut cqe = Cqe { cid: sqe.cid(), ..Default::default() };
        let mut data: Vec<u8> = Vec::new();
        match (sqe.opcode(), sqe.fctype()) {
            (FABRICS, fctype::CONNECT) => (cqe.dw0, cqe.dw1) = (1 | if sc.atr { connect::AUTHREQ_ATR } else { 0 }, sc.connect_dw1),
            (FABRICS, fctype::AUTH_SEND) if f.data.len() >= 6 && f.data[..2] == [0, 0] => t_id.copy_from_slice(&f.data[4..6]),
            (FABRICS, fctype::AUTH_RECEIVE) => {
                data = auth.next().unwrap_or_default();
                if data.len() >= 6 && !sc.keep_t_id {
                    data[4..6].copy_from_slice(&t_id);
                }
                data.resize(want, 0);
            }
            (FABRICS, fctype::PROPERTY_GET) if sqe.cdw(11) == prop::CAP => (cqe.dw0, cqe.dw1) = (sc.cap as u32, (sc.cap >> 32) as u32),
            (FABRICS, fctype::PROPERTY_GET) => cqe.dw0 = if sc.ready { csts::RDY } else { 0 },
            (admin::IDENTIFY, _) if sqe.cdw(10) & 0xff == cns::CONTROLLER as u32 => data = sc.id.encode(),
            (admin::IDENTIFY, _) => data = sc.ns.encode(),
            (admin::SET_FEATURES, _) => cqe.dw0 = 0x003f_003f,
            (admin::GET_LOG_PAGE, _) => {
                data = sc.log.clone();
                if !sc.log_as_is {
                    data.resize(want, 0);
                }
            }
            (cop::EXEC, _) => (cqe.dw0, cqe.dw1) = sc.exec,
            (cop::FETCH, _) => {
                (cqe.dw0, cqe.dw1) = (sc.fetch)(sqe.cdw(11));
                data = vec![b'x'; want];
            }
            _ => {}
        }
        let mut out = Vec::new();
        if !data.is_empty() {
            out = c2h(sqe.cid(), 0, &data, flags::LAST_PDU);
        }
        pdu::put_capsule_resp(&mut out, &cqe, false);
        s.write_all(&out).await.ok()?;
    }
}

#[derive(Clone, Copy, Debug)]
enum Action {
    /// Connect (with `acting_for` if given) and open an I/O queue: its transfer limits.
    Connect(Option<&'static str>),
    Discovery,
    IdentifyNamespace,
    Compute,
}

/// Runs `action` against a fake controller following `script`; Ok carries a summary.
async fn drive(script: Script, action: Action) -> Result<String, Error> {
    let (secret, ctrl_secret) = (script.secret, script.ctrl_secret);
    let addr = fake_controller(script).await;
    let mut o = ConnectOptions::new(addr, "nqn.2026-11.io.nearstore:fake");
    // Well within BOUND, and long enough for any exchange with the fake under load; a
    // controller never ready is waited for this long.
    o.timeout = Duration::from_secs(5);
    o.send_keep_alive = false;
    o.dhchap_secret = secret.map(|k| k.parse().unwrap());
    o.dhchap_ctrl_secret = ctrl_secret.map(|k| k.parse().unwrap());
    if let Action::Connect(h) = action {
        o.acting_for = h.map(str::to_string);
    }
    let t0 = Instant::now();
    let r = tokio::time::timeout(BOUND, async move {
        let c = Controller::connect(o).await?;
        Ok(match action {
            Action::Connect(_) => {
                let mut q = c.io_queue(1).await?;
                let o = q.queue().options();
                format!("max_transfer {} in_capsule_max {}", o.max_transfer, o.in_capsule_max)
            }
            Action::Discovery => format!("{:?}", c.discovery_log().await?.1.len()),
            Action::IdentifyNamespace => format!("{}", c.identify_namespace(1).await?.block_size()),
            Action::Compute => format!("{}", c.io_queue(1).await?.compute(1, &[0; 64], Duration::from_secs(5)).await?.len()),
        })
    })
    .await
    .unwrap_or_else(|_| panic!("the initiator hung on {action:?}"));
    assert!(t0.elapsed() < BOUND, "{action:?} took {:?}", t0.elapsed());
    r
}

/// The NVMe Base Specification's example DH-HMAC-CHAP secret.
const KEY: &str = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:";

/// The fake asks for authentication and answers the Receives with `msgs`.
fn auth(s: &mut Script, msgs: Vec<Vec<u8>>) {
    s.atr = true;
    s.secret = Some(KEY);
    s.auth = msgs;
}

/// A Challenge: hash and group IDs, HL bytes of C1 and DHVLEN bytes of a DH value (0x55..,
/// inside every group).
fn challenge(hash: u8, group: u8, hl: usize, dhvlen: usize) -> Vec<u8> {
    use nearstore_dhchap::msg::{Challenge, Message};
    Message::Challenge(Challenge { t_id: 0, hash_id: hash, dh_id: group, seqnum: 1, cval: vec![3; hl], dhv: vec![0x55; dhvlen] }).encode()
}

fn success1(hl: u8, rval: Option<Vec<u8>>) -> Vec<u8> {
    nearstore_dhchap::msg::Message::Success1 { t_id: 0, hl, rval }.encode()
}

fn failure1(explanation: u8) -> Vec<u8> {
    nearstore_dhchap::msg::Message::Failure { t_id: 0, first: true, reason: 1, explanation }.encode()
}

/// Values a controller reports that the initiator used as sizes or trusted: each is
/// bounded or refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_s_values_are_bounded_or_refused() {
    type Bend = fn(&mut Script);
    #[rustfmt::skip]
    let cases: Vec<(&str, Bend, Action, Result<String, &str>)> = vec![
        ("as it should be", |_| {}, Action::Connect(None), Ok(format!("max_transfer {} in_capsule_max 8192", 128 << 10))),
        ("MDTS 0 (no limit)", |s| s.id.mdts = 0, Action::Connect(None), Ok(format!("max_transfer {TRANSFER_BYTES_MAX} in_capsule_max 8192"))),
        ("MDTS 20 (4 GiB)", |s| s.id.mdts = 20, Action::Connect(None), Ok(format!("max_transfer {TRANSFER_BYTES_MAX} in_capsule_max 8192"))),
        ("MDTS 255 (a shift past every width)", |s| s.id.mdts = 255, Action::Connect(None), Ok(format!("max_transfer {TRANSFER_BYTES_MAX} in_capsule_max 8192"))),
        ("IOCCSZ 4 G x 16 bytes", |s| s.id.ioccsz = u32::MAX, Action::Connect(None), Ok(format!("max_transfer {} in_capsule_max {IN_CAPSULE_BYTES_MAX}", 128 << 10))),
        ("Identify names another controller", |s| s.id.cntlid = 7, Action::Connect(None), Err("Identify says controller 7 but Connect said 1")),
        ("never ready, CAP.TO 127.5 s", |s| { s.ready = false; s.cap |= 0xff << 24 }, Action::Connect(None), Err("CSTS.RDY timed out")),
        ("acting for a host, unconfirmed", |_| {}, Action::Connect(Some("nqn.2026-11.io.nearstore:h")), Err("without confirming that it checked host nqn.2026-11.io.nearstore:h")),
        ("acting for a host, confirmed", |s| s.connect_dw1 = connect::ACTING_FOR_CONFIRMED, Action::Connect(Some("nqn.2026-11.io.nearstore:h")), Ok(format!("max_transfer {} in_capsule_max 8192", 128 << 10))),
        ("discovery log", |_| {}, Action::Discovery, Ok("1".into())),
        // Reproduced: a short discovery log was sliced past its end.
        ("discovery log of 8 bytes", |s| { s.log.truncate(8); s.log_as_is = true }, Action::Discovery, Err("completed with 8 of its 1024 bytes")),
        ("discovery log of 2^64 - 1 records", |s| s.log = { let mut h = log::encode_discovery_log(1, &[]); h[8..16].copy_from_slice(&u64::MAX.to_le_bytes()); h }, Action::Discovery, Err("18446744073709551615 records, more than the 1023")),
        ("discovery log longer than asked", |s| { s.log.resize(8192, 0); s.log_as_is = true }, Action::Discovery, Err("outside the expected transfer")),
        ("namespace of 512-byte blocks", |_| {}, Action::IdentifyNamespace, Ok("512".into())),
        ("namespace blocks of 2^63 bytes", |s| s.ns.lbads = 63, Action::IdentifyNamespace, Err("blocks of 2^63 bytes")),
        ("namespace blocks of 2 bytes", |s| s.ns.lbads = 1, Action::IdentifyNamespace, Err("blocks of 2^1 bytes")),
        ("compute result", |_| {}, Action::Compute, Ok("100".into())),
        ("compute result of 4 GiB - 1", |s| s.exec = (1, u32::MAX), Action::Compute, Err("4294967295 bytes, more than the 16777216")),
        ("FETCH that never ends", |s| s.fetch = |_| (64, 1), Action::Compute, Err("more than the 100 bytes its result has")),
        ("FETCH claiming more valid bytes than it sent: cut to what came", |s| s.fetch = |_| (u32::MAX, 0), Action::Compute, Ok("100".into())),
        // In-band authentication (DH-HMAC-CHAP): the target's messages, bent.
        ("authentication asked, no secret", |s| s.atr = true, Action::Connect(None), Err("requires host")),
        ("authenticates", |s| auth(s, vec![challenge(1, 0, 32, 0), success1(32, None)]), Action::Connect(None), Ok(format!("max_transfer {} in_capsule_max 8192", 128 << 10))),
        ("authenticates in ffdhe2048", |s| auth(s, vec![challenge(1, 1, 32, 256), success1(32, None)]), Action::Connect(None), Ok(format!("max_transfer {} in_capsule_max 8192", 128 << 10))),
        ("Failure1 at once", |s| auth(s, vec![failure1(4)]), Action::Connect(None), Err("refused by the target: hash function not usable")),
        ("nothing to receive", |s| auth(s, vec![]), Action::Connect(None), Err("malformed")),
        ("a message that is none", |s| auth(s, vec![vec![0xff; 40]]), Action::Connect(None), Err("malformed")),
        ("challenge of another transaction", |s| { auth(s, vec![challenge(1, 0, 32, 0)]); s.keep_t_id = true }, Action::Connect(None), Err("answered transaction")),
        ("challenge of an unknown hash", |s| auth(s, vec![challenge(9, 0, 32, 0)]), Action::Connect(None), Err("unknown hash 9")),
        ("challenge of an unknown DH group", |s| auth(s, vec![challenge(1, 6, 32, 0)]), Action::Connect(None), Err("unknown DH group 6")),
        ("challenge shorter than its hash", |s| auth(s, vec![challenge(1, 0, 16, 0)]), Action::Connect(None), Err("lengths do not fit")),
        ("DH value in the null group", |s| auth(s, vec![challenge(1, 0, 32, 8)]), Action::Connect(None), Err("lengths do not fit")),
        ("DH value longer than its group", |s| auth(s, vec![challenge(1, 1, 32, 300)]), Action::Connect(None), Err("lengths do not fit")),
        ("DH value outside its group", |s| auth(s, vec![{ let mut c = challenge(1, 1, 32, 256); c[16 + 32..].fill(0); c }]), Action::Connect(None), Err("the target's DH value")),
        ("a second challenge instead of Success1", |s| auth(s, vec![challenge(1, 0, 32, 0), challenge(1, 0, 32, 0)]), Action::Connect(None), Err("another message than Success1")),
        ("no R2 when asked for one", |s| { auth(s, vec![challenge(1, 0, 32, 0), success1(32, None)]); s.ctrl_secret = Some(KEY) }, Action::Connect(None), Err("did not prove")),
        ("a wrong R2", |s| { auth(s, vec![challenge(1, 0, 32, 0), success1(32, Some(vec![7; 32]))]); s.ctrl_secret = Some(KEY) }, Action::Connect(None), Err("did not prove")),
    ];
    for (name, bend, action, want) in cases {
        let mut s = Script::default();
        bend(&mut s);
        let got = drive(s, action).await;
        match (&got, &want) {
            (Ok(g), Ok(w)) => assert_eq!(g, w, "{name}"),
            (Err(e), Err(w)) => assert!(e.to_string().contains(w), "{name}: error {e:?} should contain {w:?}"),
            _ => panic!("{name}: got {got:?}, want {want:?}"),
        }
    }
}
