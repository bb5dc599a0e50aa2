//! Malformed PDUs, refused connects and keep-alive expiry: each gets the specification's
//! answer, and the target keeps serving everyone else.

mod common;

use std::time::Duration;

use nearstore_initiator::{Controller, Data, Error, QueueOptions, QueuePair};
use nearstore_wire::fabrics::ConnectData;
use nearstore_wire::opcode::{fctype, io, FABRICS};
use nearstore_wire::pdu::{self, fes, flags, DataHdr, PduType};
use nearstore_wire::sqe::sgl_id;
use nearstore_wire::{Sgl, Sqe, Status};
use tokio::net::TcpStream;

async fn raw(env: &common::Env, hd: bool, dd: bool) -> QueuePair<TcpStream> {
    let s = TcpStream::connect(env.addr).await.unwrap();
    QueuePair::connect(s, QueueOptions { hdgst: hd, ddgst: dd, ..Default::default() }).await.unwrap()
}

/// Expects a C2HTermReq with this FES and FEI, then the connection closed.
async fn expect_term(q: &mut QueuePair<TcpStream>, want_fes: u16, want_fei: u32, what: &str) {
    let (t, h) = q.recv_raw().await.unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(t, PduType::C2HTermReq, "{what}");
    assert_eq!(pdu::term_req_decode(&h), (want_fes, want_fei), "{what}");
    assert!(matches!(q.recv_raw().await, Err(Error::Closed) | Err(Error::Io { .. })), "{what}: connection should close");
}

fn capsule(sqe: &Sqe, data: &[u8], hd: bool, dd: bool) -> Vec<u8> {
    let mut b = Vec::new();
    pdu::put_capsule_cmd(&mut b, sqe, data, hd, dd);
    b
}

#[tokio::test]
async fn malformed_pdus_get_a_term_req_and_others_keep_working() {
    let env = common::start().await;
    let healthy = env.connect().await;
    let mut healthy_q = healthy.io_queue(1).await.unwrap();
    type Mutate = fn(&mut Vec<u8>);
    let cases: &[(&str, bool, Mutate, u16, u32)] = &[
        ("unknown PDU type", false, |b| b[0] = 0x0e, fes::INVALID_HEADER_FIELD, 0),
        ("controller-to-host type from the host", false, |b| b[0] = PduType::R2T as u8, fes::INVALID_HEADER_FIELD, 0),
        ("wrong HLEN", false, |b| b[2] = 40, fes::INVALID_HEADER_FIELD, 2),
        ("PLEN shorter than the header", false, |b| b[4..8].copy_from_slice(&10u32.to_le_bytes()), fes::INVALID_HEADER_FIELD, 4),
        ("header digest error", true, |b| b[12] ^= 0x40, fes::HEADER_DIGEST_ERROR, 0),
        (
            "in-capsule data over ICDSZ",
            false,
            |b| {
                b[3] = 72;
                b[4..8].copy_from_slice(&(1u32 << 20).to_le_bytes())
            },
            fes::DATA_LIMIT_EXCEEDED,
            4,
        ),
        (
            "PDO inside the header",
            false,
            |b| {
                b[3] = 8;
                b[4..8].copy_from_slice(&100u32.to_le_bytes())
            },
            fes::INVALID_HEADER_FIELD,
            3,
        ),
        (
            "second ICReq",
            false,
            |b| {
                b.clear();
                nearstore_wire::pdu::IcReq::default().encode(b)
            },
            fes::PDU_SEQUENCE_ERROR,
            0,
        ),
    ];
    for (what, hd, mutate, want_fes, want_fei) in cases {
        let mut q = raw(&env, *hd, false).await;
        let mut b = capsule(&Sqe::new(0x06, 1), &[], *hd, false);
        mutate(&mut b);
        q.send_raw(&b).await.unwrap();
        expect_term(&mut q, *want_fes, *want_fei, what).await;
        // Everyone else is still served.
        healthy_q.write(1, 0, &[7u8; 512], 512, false).await.unwrap_or_else(|e| panic!("after {what}: {e}"));
    }
    assert!(env.target.stats.fatal_errors.load(std::sync::atomic::Ordering::Relaxed) >= cases.len() as u64);
}

#[tokio::test]
async fn first_pdu_must_be_icreq() {
    let env = common::start().await;
    let mut s = TcpStream::connect(env.addr).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(&capsule(&Sqe::new(0x06, 1), &[], false, false)).await.unwrap();
    let mut h = [0u8; 24];
    s.read_exact(&mut h).await.unwrap();
    assert_eq!(h[0], PduType::C2HTermReq as u8);
    assert_eq!(pdu::term_req_decode(&h), (fes::PDU_SEQUENCE_ERROR, 0));
}

/// Connects a raw admin queue (Connect only) so tests can speak H2CData by hand.
async fn raw_connected(env: &common::Env, hd: bool, dd: bool) -> QueuePair<TcpStream> {
    let mut q = raw(env, hd, dd).await;
    let mut s = Sqe::new(FABRICS, 0);
    s.set_nsid(fctype::CONNECT as u32).set_cdw(11, 31).set_cdw(12, 0);
    let d =
        ConnectData { hostid: [1; 16], cntlid: 0xffff, subnqn: common::NQN.into(), hostnqn: common::GOOD_HOST.into(), acting_for: None }
            .encode();
    let cid = q.submit(s, Data::Out(&d), 0).unwrap();
    let cqe = q.wait(cid, |_, _, _| {}).await.unwrap();
    assert!(cqe.status.is_success(), "{}", cqe.status);
    q
}

#[tokio::test]
async fn h2c_data_errors() {
    let env = common::start().await;
    // A write of 8 KiB with a transport SGL on the admin queue: the target sends an R2T.
    let big_write = || {
        let mut s = Sqe::new(FABRICS, 9);
        s.set_nsid(fctype::CONNECT as u32);
        s.set_sgl(Sgl { addr: 0, len: 1024, id: sgl_id::TRANSPORT });
        s
    };
    type Send = fn(&DataHdr) -> (DataHdr, u8, usize);
    let cases: &[(&str, Send, u16, u32)] = &[
        ("unknown transfer tag", |r| (DataHdr { ttag: r.ttag + 5, ..*r }, flags::LAST_PDU, 1024), fes::INVALID_HEADER_FIELD, 10),
        ("wrong command id", |r| (DataHdr { cccid: r.cccid + 1, ..*r }, flags::LAST_PDU, 1024), fes::INVALID_HEADER_FIELD, 8),
        ("out of order", |r| (DataHdr { offset: 512, len: 512, ..*r }, 0, 512), fes::DATA_OUT_OF_RANGE, 12),
        ("beyond the R2T", |r| (DataHdr { len: 2048, ..*r }, flags::LAST_PDU, 2048), fes::DATA_OUT_OF_RANGE, 16),
        ("LAST_PDU too early", |r| (DataHdr { len: 512, ..*r }, flags::LAST_PDU, 512), fes::INVALID_HEADER_FIELD, 1),
    ];
    for (what, make, want_fes, want_fei) in cases {
        let mut q = raw(&env, false, false).await;
        let mut b = Vec::new();
        pdu::put_capsule_cmd(&mut b, &big_write(), &[], false, false);
        q.send_raw(&b).await.unwrap();
        let (t, h) = q.recv_raw().await.unwrap();
        assert_eq!(t, PduType::R2T, "{what}");
        let r = DataHdr::decode(&h);
        assert_eq!((r.cccid, r.offset, r.len), (9, 0, 1024));
        let (d, fl, n) = make(&r);
        let mut b = Vec::new();
        pdu::put_pdu(&mut b, PduType::H2CData, fl, &d.psh(), &vec![0u8; n], false, false);
        q.send_raw(&b).await.unwrap();
        expect_term(&mut q, *want_fes, *want_fei, what).await;
    }
}

#[tokio::test]
async fn data_digest_error_fails_the_command_not_the_connection() {
    let env = common::start().await;
    let mut q = raw_connected(&env, false, true).await;
    let mut b = capsule(&Sqe::new(0x06, 3), &[1u8; 64], false, true);
    let n = b.len();
    b[n - 1] ^= 0xff;
    q.send_raw(&b).await.unwrap();
    let (t, h) = q.recv_raw().await.unwrap();
    assert_eq!(t, PduType::CapsuleResp);
    let cqe = pdu::capsule_cqe(&h);
    assert_eq!((cqe.cid, cqe.status), (3, Status::TRANSIENT_TRANSPORT_ERROR));
    // Same connection, next command: a Property Get of VS.
    let cid = q.submit(nearstore_initiator_prop_get_vs(), Data::None, 1).unwrap();
    let cqe = q.wait(cid, |_, _, _| {}).await.unwrap();
    assert!(cqe.status.is_success());
    assert_eq!(cqe.dw0, 0x0001_0300);
}

fn nearstore_initiator_prop_get_vs() -> Sqe {
    let mut s = Sqe::new(FABRICS, 0);
    s.set_nsid(fctype::PROPERTY_GET as u32).set_cdw(11, 0x08);
    s
}

#[tokio::test]
async fn commands_before_connect_and_refused_connects() {
    let env = common::start().await;
    let mut q = raw(&env, false, false).await;
    let cid = q.submit(Sqe::rw(io::READ, 1, 0, 1, false), Data::In(512), 0).unwrap();
    let mut st = None;
    q.wait(cid, |_, c, _| st = Some(c.status)).await.unwrap();
    assert_eq!(st.unwrap(), Status::COMMAND_SEQUENCE_ERROR.dnr());

    let mut o = env.opts();
    o.subnqn = "nqn.2026-11.io.nearstore:nope".into();
    let e = Controller::connect(o).await.err().expect("unknown subsystem refused");
    assert!(
        matches!(e, Error::Status { status, cqe, .. } if status == Status::CONNECT_INVALID_PARAMETERS.dnr() && cqe.dw0 == (1 | (256 << 16))),
        "{e}"
    );

    let mut o = env.opts();
    o.subnqn = common::ALLOWED_NQN.into();
    o.hostnqn = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000ff".into();
    let e = Controller::connect(o).await.err().expect("host not on the list refused");
    assert!(matches!(e, Error::Status { status, .. } if status == Status::CONNECT_INVALID_HOST.dnr()), "{e}");

    let mut o = env.opts();
    o.subnqn = common::ALLOWED_NQN.into();
    Controller::connect(o).await.expect("listed host connects");

    // Only the discovery subsystem answers on the discovery port.
    let mut o = env.opts();
    o.addr = env.disc;
    assert!(Controller::connect(o).await.is_err());
}

/// A controller that hears nothing for KATO is torn down, not before; one whose host sends
/// keep-alives outlives KATO many times over.
#[tokio::test]
async fn keep_alive_expiry_tears_the_controller_down() {
    let env = common::start().await;
    let mut o = env.opts();
    o.kato_ms = 300;
    o.send_keep_alive = false;
    let start = std::time::Instant::now();
    let c = Controller::connect(o).await.unwrap();
    let mut q = c.io_queue(1).await.unwrap();
    let sub = env.target.subsystem(common::NQN).unwrap();
    assert_eq!(sub.controller_count(), 1);
    while sub.controller_count() != 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "controller should be gone after KATO");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(300), "the controller went after {took:?}, before KATO");
    assert!(q.read(1, 0, 1, 512).await.is_err(), "its I/O queue is closed");
    assert_eq!(env.target.stats.controllers_expired.load(std::sync::atomic::Ordering::Relaxed), 1);

    // With keep-alives (every KATO / 2), the controller stays well past KATO. The KATO is
    // long enough that a stall of the test's one thread does not delay a keep-alive past it.
    let mut o = env.opts();
    o.kato_ms = 1500;
    let c = Controller::connect(o).await.unwrap();
    let mut q = c.io_queue(1).await.unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    q.read(1, 0, 1, 512).await.unwrap();
}

#[tokio::test]
async fn discovery_log_lists_what_the_host_may_reach() {
    let env = common::start().await;
    let mut o = env.opts();
    o.addr = env.disc;
    o.subnqn = nearstore_wire::DISCOVERY_NQN.into();
    o.kato_ms = 0;
    let c = Controller::connect(o.clone()).await.unwrap();
    let (_, entries) = c.discovery_log().await.unwrap();
    let nqns: Vec<_> = entries.iter().map(|e| e.subnqn.as_str()).collect();
    assert!(
        nqns.contains(&common::NQN) && nqns.contains(&common::ALLOWED_NQN) && nqns.contains(&nearstore_wire::DISCOVERY_NQN),
        "{nqns:?}"
    );
    let port = env.addr.port().to_string();
    assert!(entries.iter().any(|e| e.subnqn == common::NQN && e.trsvcid == port && e.traddr == "127.0.0.1"));
    // Another host does not see the restricted subsystem.
    o.hostnqn = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000ee".into();
    let c = Controller::connect(o).await.unwrap();
    let (_, entries) = c.discovery_log().await.unwrap();
    assert!(!entries.iter().any(|e| e.subnqn == common::ALLOWED_NQN));
}
