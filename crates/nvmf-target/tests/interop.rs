//! What other initiators send, spoken in raw PDUs: transfer lengths the command defines,
//! PDO on capsules without data, Host IDs on I/O queue Connects, admin queue sizes.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use nearstore_initiator::{Data, Error, QueueOptions, QueuePair};
use nearstore_target::limits;
use nearstore_wire::fabrics::{cc, csts, prop, ConnectData};
use nearstore_wire::log::{ErrorEntry, ERROR_ENTRY_LEN};
use nearstore_wire::opcode::{admin, cns, fctype, feature, lid, FABRICS};
use nearstore_wire::pdu::{self, DataHdr, PduType};
use nearstore_wire::sqe::sgl_id;
use nearstore_wire::{Cqe, Sgl, Sqe, Status, DISCOVERY_NQN};
use tokio::net::TcpStream;

const HOSTID: [u8; 16] = [1; 16];

async fn raw(addr: std::net::SocketAddr, hd: bool) -> QueuePair<TcpStream> {
    let s = TcpStream::connect(addr).await.unwrap();
    QueuePair::connect(s, QueueOptions { hdgst: hd, ..Default::default() }).await.unwrap()
}

/// Sends a Connect and returns its completion.
async fn connect(q: &mut QueuePair<TcpStream>, subnqn: &str, qid: u16, sqsize: u16, cntlid: u16, hostid: [u8; 16]) -> Cqe {
    let mut s = Sqe::new(FABRICS, 0);
    s.set_nsid(fctype::CONNECT as u32).set_cdw(10, (qid as u32) << 16).set_cdw(11, sqsize as u32);
    let d = ConnectData { hostid, cntlid, subnqn: subnqn.into(), hostnqn: common::GOOD_HOST.into(), acting_for: None }.encode();
    let cid = q.submit(s, Data::Out(&d), 0).unwrap();
    q.wait(cid, |_, _, _| {}).await.unwrap()
}

/// A raw admin queue on `subnqn`, connected with `hostid` and enabled (CSTS.RDY).
async fn admin_queue(addr: std::net::SocketAddr, subnqn: &str, hd: bool, hostid: [u8; 16]) -> (QueuePair<TcpStream>, u16) {
    let mut q = raw(addr, hd).await;
    let c = connect(&mut q, subnqn, 0, 31, 0xffff, hostid).await;
    assert!(c.status.is_success(), "connect: {}", c.status);
    assert_eq!(enable(&mut q, cc::LINUX_ENABLE).await, csts::RDY);
    (q, c.dw0 as u16)
}

/// Writes CC (enabling the controller) and returns CSTS.RDY and CSTS.CFS.
async fn enable(q: &mut QueuePair<TcpStream>, cc_value: u32) -> u32 {
    let mut s = Sqe::new(FABRICS, 0);
    s.set_nsid(fctype::PROPERTY_SET as u32).set_cdw(11, prop::CC).set_cdw(12, cc_value);
    assert!(run(q, s, 0).await.0.status.is_success());
    let mut s = Sqe::new(FABRICS, 0);
    s.set_nsid(fctype::PROPERTY_GET as u32).set_cdw(11, prop::CSTS);
    run(q, s, 0).await.0.dw0 & (csts::RDY | csts::CFS)
}

/// Runs one command (data controller to host of `len` bytes) on a raw queue.
async fn run(q: &mut QueuePair<TcpStream>, sqe: Sqe, len: usize) -> (Cqe, Vec<u8>) {
    let cid = q.submit(sqe, if len > 0 { Data::In(len) } else { Data::None }, 0).unwrap();
    let mut out = Vec::new();
    let cqe = q
        .wait(cid, |_, c, d| {
            if c.cid == cid {
                out.extend_from_slice(d)
            }
        })
        .await
        .unwrap();
    (cqe, out)
}

/// Sends one command exactly as given (its SGL untouched) and collects what comes back
/// until its CapsuleResp: (the C2HData bytes announced, R2Ts, the completion).
async fn exchange(q: &mut QueuePair<TcpStream>, sqe: &Sqe, hd: bool) -> (u64, usize, Cqe) {
    let mut b = Vec::new();
    pdu::put_capsule_cmd(&mut b, sqe, &[], hd, false);
    q.send_raw(&b).await.unwrap();
    let (mut c2h, mut r2t) = (0u64, 0);
    loop {
        let (t, h) = tokio::time::timeout(Duration::from_secs(10), q.recv_raw()).await.expect("a reply within 10 s").unwrap();
        match t {
            PduType::C2HData => c2h += DataHdr::decode(&h).len as u64,
            PduType::R2T => r2t += 1,
            PduType::CapsuleResp => return (c2h, r2t, pdu::capsule_cqe(&h)),
            t => panic!("unexpected {t:?}"),
        }
    }
}

fn transport(sqe: &mut Sqe, len: u32) -> Sqe {
    sqe.set_sgl(Sgl { addr: 0, len, id: sgl_id::TRANSPORT });
    *sqe
}

fn identify(c: u8, sgl_len: u32) -> Sqe {
    let mut s = Sqe::new(admin::IDENTIFY, 7);
    s.set_cdw(10, c as u32);
    transport(&mut s, sgl_len)
}

/// Get Log Page with NUMD for `numd_bytes` (a multiple of 4, up to 16 GiB) and an SGL of `sgl_len`.
fn get_log_page(log: u8, numd_bytes: u64, sgl_len: u32) -> Sqe {
    let mut s = Sqe::new(admin::GET_LOG_PAGE, 8);
    let numd = numd_bytes / 4 - 1;
    s.set_cdw(10, log as u32 | ((numd as u32 & 0xffff) << 16)).set_cdw(11, (numd >> 16) as u32);
    transport(&mut s, sgl_len)
}

fn simple(opcode: u8, cdw10: u32, sgl_len: u32) -> Sqe {
    let mut s = Sqe::new(opcode, 9);
    s.set_cdw(10, cdw10);
    transport(&mut s, sgl_len)
}

fn fabrics(t: u8, cdw11: u32, sgl_len: u32) -> Sqe {
    let mut s = Sqe::new(FABRICS, 10);
    s.set_nsid(t as u32).set_cdw(11, cdw11);
    transport(&mut s, sgl_len)
}

/// Every admin and fabrics command's data length is the one the command defines, checked
/// before anything is allocated, requested or sent; near 4 GiB nothing wraps. On the I/O
/// controller and on the discovery controller (which admits any host) alike.
#[tokio::test]
async fn admin_transfer_lengths_are_the_commands_own() {
    let env = common::start().await;
    const GIB: u32 = 1 << 30;
    let dsli = Status::DATA_SGL_LENGTH_INVALID.dnr();
    let ok = Status::SUCCESS;
    // (what, command, on the discovery controller too, status, C2HData bytes, R2Ts)
    let cases: Vec<(&str, Sqe, bool, Status, u64, usize)> = vec![
        ("Identify, SGL 4 KiB", identify(cns::CONTROLLER, 4096), true, ok, 4096, 0),
        ("Identify, SGL 8 KiB", identify(cns::CONTROLLER, 8192), true, dsli, 0, 0),
        ("Identify, SGL 1 GiB", identify(cns::CONTROLLER, GIB), true, dsli, 0, 0),
        ("Identify, SGL FFFFFFFFh", identify(cns::CONTROLLER, u32::MAX), true, dsli, 0, 0),
        ("Identify, SGL 4095", identify(cns::CONTROLLER, 4095), true, dsli, 0, 0),
        ("Identify, SGL 0", identify(cns::CONTROLLER, 0), true, dsli, 0, 0),
        ("Identify of an unknown CNS, SGL 1 GiB", identify(0x7e, GIB), true, dsli, 0, 0),
        ("Get Log Page 4 KiB, SGL 4 KiB", get_log_page(lid::ERROR_INFORMATION, 4096, 4096), true, ok, 4096, 0),
        ("Get Log Page 4 KiB, SGL 256 MiB", get_log_page(lid::ERROR_INFORMATION, 4096, 256 << 20), true, dsli, 0, 0),
        ("Get Log Page 4 KiB, SGL 1 KiB", get_log_page(lid::ERROR_INFORMATION, 4096, 1024), true, dsli, 0, 0),
        // (NUMD + 1) x 4 is 4 GiB: a 32-bit product would wrap to the SGL's 0.
        ("Get Log Page 4 GiB, SGL 0", get_log_page(lid::ERROR_INFORMATION, 1 << 32, 0), true, dsli, 0, 0),
        ("Get Log Page 16 GiB, SGL FFFFFFFCh", get_log_page(lid::ERROR_INFORMATION, 1 << 34, u32::MAX - 3), true, dsli, 0, 0),
        (
            "Get Log Page FFFFFFFCh, SGL FFFFFFFCh: above MDTS",
            get_log_page(lid::ERROR_INFORMATION, u32::MAX as u64 - 3, u32::MAX - 3),
            true,
            Status::INVALID_FIELD.dnr(),
            0,
            0,
        ),
        (
            "Get Log Page of MDTS + 4, SGL alike",
            get_log_page(lid::ERROR_INFORMATION, limits::TRANSFER_BYTES_MAX as u64 + 4, limits::TRANSFER_BYTES_MAX as u32 + 4),
            true,
            Status::INVALID_FIELD.dnr(),
            0,
            0,
        ),
        ("Get Features, SGL 1 GiB: nothing moves", simple(admin::GET_FEATURES, 0x0f, GIB), true, ok, 0, 0),
        ("Set Features, SGL 1 GiB: nothing requested", simple(admin::SET_FEATURES, 0x0b, GIB), true, ok, 0, 0),
        ("Keep Alive, SGL 4 KiB", simple(admin::KEEP_ALIVE, 0, 4096), true, dsli, 0, 0),
        ("Abort, SGL 1 GiB", simple(admin::ABORT, 0, GIB), false, dsli, 0, 0),
        ("unknown admin opcode, host-to-controller, SGL 128 KiB", simple(0xc1, 0, 128 << 10), true, Status::INVALID_OPCODE.dnr(), 0, 0),
        ("Property Get, SGL 1 GiB", fabrics(fctype::PROPERTY_GET, prop::VS, GIB), true, dsli, 0, 0),
        ("Property Get, SGL 0", fabrics(fctype::PROPERTY_GET, prop::VS, 0), true, ok, 0, 0),
        ("Connect again, SGL 1 GiB", fabrics(fctype::CONNECT, 0, GIB), true, dsli, 0, 0),
    ];
    for hd in [false, true] {
        let (mut io, _) = admin_queue(env.addr, common::NQN, hd, HOSTID).await;
        let (mut disc, _) = admin_queue(env.disc, DISCOVERY_NQN, hd, HOSTID).await;
        for (what, sqe, on_disc, status, c2h, r2t) in &cases {
            for (ctrl, q) in [("I/O", &mut io), ("discovery", &mut disc)] {
                if ctrl == "discovery" && !on_disc {
                    continue;
                }
                let (got_c2h, got_r2t, cqe) = exchange(q, sqe, hd).await;
                assert_eq!((cqe.status, got_c2h, got_r2t), (*status, *c2h, *r2t), "{what} on the {ctrl} controller, hdgst {hd}");
            }
        }
    }
    // A refusal is in the error log, pointing at the SGL (byte 24 of the command).
    let c = env.connect().await;
    let e = c.admin(identify(cns::CONTROLLER, 0), Data::In(8192), "Identify with an 8 KiB SGL").await;
    assert!(matches!(e, Err(Error::Status { status, .. }) if status == Status::DATA_SGL_LENGTH_INVALID.dnr()), "{e:?}");
    let newest = ErrorEntry::decode(&c.get_log(lid::ERROR_INFORMATION, 0, ERROR_ENTRY_LEN as u32, 0).await.unwrap());
    assert_eq!((Status::from_field(newest.status), newest.param_loc), (Status::DATA_SGL_LENGTH_INVALID.dnr(), 24));
}

/// Rewrites a PDU's PDO, and its header digest to match.
fn set_pdo(b: &mut [u8], pdo: u8, hd: bool) {
    b[3] = pdo;
    if hd {
        let hlen = b[2] as usize;
        let crc = crc32c::crc32c(&b[..hlen]);
        b[hlen..hlen + 4].copy_from_slice(&crc.to_le_bytes());
    }
}

/// A CapsuleCmd whose data field is empty may carry PDO = HLEN (+ HDGST): what one
/// third-party initiator sends for every admin command. PDO inside the header stays fatal.
#[tokio::test]
async fn pdo_at_the_end_of_the_header_on_a_capsule_without_data() {
    let env = common::start().await;
    // (header digest, PDO, Ok: the command completes / Err: TermReq FEI)
    let cases: &[(bool, u8, Result<(), u32>)] =
        &[(false, 0, Ok(())), (false, 72, Ok(())), (true, 76, Ok(())), (true, 72, Err(3)), (false, 8, Err(3)), (false, 200, Err(3))];
    for &(hd, pdo, want) in cases {
        let (mut q, _) = admin_queue(env.addr, common::NQN, hd, HOSTID).await;
        for sqe in [identify(cns::CONTROLLER, 4096), simple(admin::KEEP_ALIVE, 0, 0), fabrics(fctype::PROPERTY_GET, prop::VS, 0)] {
            let mut b = Vec::new();
            pdu::put_capsule_cmd(&mut b, &sqe, &[], hd, false);
            set_pdo(&mut b, pdo, hd);
            q.send_raw(&b).await.unwrap();
            let mut got = None;
            while got.is_none() {
                let (t, h) = q.recv_raw().await.unwrap_or_else(|e| panic!("hd {hd} pdo {pdo}: {e}"));
                got = match t {
                    PduType::C2HData => None,
                    PduType::CapsuleResp => Some(Ok(pdu::capsule_cqe(&h))),
                    PduType::C2HTermReq => Some(Err(pdu::term_req_decode(&h))),
                    t => panic!("unexpected {t:?}"),
                };
            }
            match (got.expect("reply"), want) {
                (Ok(cqe), Ok(())) => assert_eq!(cqe.status, Status::SUCCESS, "hd {hd} pdo {pdo} {sqe:?}"),
                (Err((fes, fei)), Err(w)) => {
                    assert_eq!((fes, fei), (pdu::fes::INVALID_HEADER_FIELD, w), "hd {hd} pdo {pdo}");
                    break;
                }
                (g, w) => panic!("hd {hd} pdo {pdo}: got {g:?}, want {w:?}"),
            }
        }
    }
}

/// An I/O queue Connect whose Host ID differs from the admin queue's is Connect Invalid
/// Parameters naming HOSTID (in the data, offset 0); a Host ID of zero is ignored.
#[tokio::test]
async fn io_queue_host_id() {
    let env = common::start().await;
    let other = [2u8; 16];
    let zero = [0u8; 16];
    let bad = Err(1); // IATTR: in the data; IPO 0: HOSTID
    type Case = (&'static str, [u8; 16], [u8; 16], Result<(), u32>);
    let cases: &[Case] = &[
        ("same", HOSTID, HOSTID, Ok(())),
        ("different", HOSTID, other, bad),
        ("zero on the I/O queue", HOSTID, zero, Ok(())),
        ("zero on the admin queue", zero, other, Ok(())),
        ("zero on both", zero, zero, Ok(())),
    ];
    for (what, admin_id, io_id, want) in cases {
        let (_admin, cntlid) = admin_queue(env.addr, common::NQN, false, *admin_id).await;
        let mut q = raw(env.addr, false).await;
        let c = connect(&mut q, common::NQN, 1, 31, cntlid, *io_id).await;
        match want {
            Ok(()) => assert!(c.status.is_success(), "{what}: {}", c.status),
            Err(dw0) => assert_eq!((c.status, c.dw0), (Status::CONNECT_INVALID_PARAMETERS.dnr(), *dw0), "{what}"),
        }
    }
}

/// The discovery log's ASQSZ is what Connect accepts for an admin queue: 256 entries on an
/// I/O subsystem, 32 on the discovery subsystem (its queue is clamped: no allow-list
/// admits it, and every entry costs memory). One entry more, SQSIZE 0 or the largest
/// SQSIZE is Connect Invalid Parameters naming SQSIZE, as Linux's target answers an SQSIZE
/// above MQES. Before, a discovery queue of 256 entries was accepted.
#[tokio::test]
async fn admin_queue_size_agrees_with_asqsz() {
    let env = common::start().await;
    let mut o = env.opts();
    o.addr = env.disc;
    o.subnqn = DISCOVERY_NQN.into();
    let c = nearstore_initiator::Controller::connect(o).await.unwrap();
    let (_, entries) = c.discovery_log().await.unwrap();
    let asqsz = |nqn: &str| {
        let sizes: Vec<u16> = entries.iter().filter(|e| e.subnqn == nqn).map(|e| e.asqsz).collect();
        assert!(!sizes.is_empty() && sizes.iter().all(|&s| s == sizes[0]), "{nqn}: {entries:?}");
        sizes[0]
    };
    let too_big = Err(44 << 16); // IATTR 0 (in the command), IPO 44: SQSIZE
                                 // (listener, subsystem, its ASQSZ as the log must say, then SQSIZE (0's based) and
                                 // whether Connect accepts it or its Connect Invalid Parameters DW0)
    type Case = (SocketAddr, &'static str, u16, Vec<(u16, Result<(), u32>)>);
    let cases: &[Case] = &[
        (env.disc, DISCOVERY_NQN, 32, vec![(0, too_big), (1, Ok(())), (31, Ok(())), (32, too_big), (255, too_big), (u16::MAX, too_big)]),
        (env.addr, common::NQN, 256, vec![(0, too_big), (31, Ok(())), (255, Ok(())), (256, too_big), (u16::MAX, too_big)]),
    ];
    for (addr, nqn, want_asqsz, sizes) in cases {
        assert_eq!(asqsz(nqn), *want_asqsz, "{nqn}");
        assert!(*want_asqsz >= 32, "ASQSZ is at least 32 entries");
        for (sqsize, want) in sizes.iter() {
            let mut q = raw(*addr, false).await;
            let c = connect(&mut q, nqn, 0, *sqsize, 0xffff, HOSTID).await;
            match want {
                Ok(()) => assert!(c.status.is_success(), "{nqn} SQSIZE {sqsize}: {}", c.status),
                Err(dw0) => assert_eq!((c.status, c.dw0), (Status::CONNECT_INVALID_PARAMETERS.dnr(), *dw0), "{nqn} SQSIZE {sqsize}"),
            }
        }
    }
}

fn get_feature(fid: u8, sel: u32, cdw11: u32) -> Sqe {
    let mut s = Sqe::new(admin::GET_FEATURES, 0);
    s.set_cdw(10, fid as u32 | (sel << 8)).set_cdw(11, cdw11);
    s
}

fn set_feature(fid: u8, cdw11: u32) -> Sqe {
    let mut s = Sqe::new(admin::SET_FEATURES, 0);
    s.set_cdw(10, fid as u32).set_cdw(11, cdw11);
    s
}

/// Every feature the base specification makes mandatory for an I/O controller over fabrics
/// answers Get Features with each SEL (current, default, saved = default, capabilities)
/// and Set Features with its own checks, as SPDK's spdk_nvme_identify expects.
#[tokio::test]
async fn mandatory_features_get_and_set() {
    let env = common::start().await;
    let (mut q, _) = admin_queue(env.addr, common::NQN, false, HOSTID).await;
    let under = 1 << 20; // THSEL 01b: the under-temperature threshold
                         // (feature, CDW11 of the Get, default value)
    let defaults: &[(u8, u32, u32)] = &[
        (feature::ARBITRATION, 0, 0x7),
        (feature::POWER_MANAGEMENT, 0, 0),
        (feature::TEMPERATURE_THRESHOLD, 0, 343),
        (feature::TEMPERATURE_THRESHOLD, under, under),
        (feature::ERROR_RECOVERY, 0, 0),
        (feature::VOLATILE_WRITE_CACHE, 0, 1),
        (feature::NUMBER_OF_QUEUES, 0, 63 | (63 << 16)),
        (feature::WRITE_ATOMICITY_NORMAL, 0, 0),
        (feature::ASYNC_EVENT_CONFIG, 0, 0),
        (feature::KEEP_ALIVE_TIMER, 0, 0),
        (feature::IO_COMMAND_SET_PROFILE, 0, 0),
    ];
    for &(fid, cdw11, default) in defaults {
        for (sel, want) in [(feature::sel::CURRENT, default), (feature::sel::DEFAULT, default), (feature::sel::SAVED, default), (3, 1 << 2)]
        {
            let (c, _) = run(&mut q, get_feature(fid, sel, cdw11), 0).await;
            assert_eq!((c.status, c.dw0), (Status::SUCCESS, want), "feature {fid:#04x} SEL {sel} CDW11 {cdw11:#x}");
        }
        let (c, _) = run(&mut q, get_feature(fid, 4, cdw11), 0).await;
        assert_eq!(c.status, Status::INVALID_FIELD.dnr(), "feature {fid:#04x}: SEL 4 is reserved");
    }
    let invalid = Status::INVALID_FIELD.dnr();
    // (what, feature, Set CDW11, status, then Get CDW11 and the current value it reads)
    let sets: &[(&str, u8, u32, Status, u32, u32)] = &[
        ("arbitration weights and burst", feature::ARBITRATION, 0x0302_0103, Status::SUCCESS, 0, 0x0302_0103),
        ("arbitration reserved bits dropped", feature::ARBITRATION, 0x0000_00f9, Status::SUCCESS, 0, 0x1),
        ("power state 0", feature::POWER_MANAGEMENT, 0, Status::SUCCESS, 0, 0),
        ("power state 1: NPSS is 0", feature::POWER_MANAGEMENT, 1, invalid, 0, 0),
        ("workload hint", feature::POWER_MANAGEMENT, 1 << 5, invalid, 0, 0),
        ("over-temperature 350 K", feature::TEMPERATURE_THRESHOLD, 350, Status::SUCCESS, 0, 350),
        ("over-temperature, all sensors", feature::TEMPERATURE_THRESHOLD, (0xf << 16) | 360, Status::SUCCESS, 0, 360),
        ("under-temperature 250 K", feature::TEMPERATURE_THRESHOLD, under | 250, Status::SUCCESS, under, under | 250),
        ("sensor 1 does not exist", feature::TEMPERATURE_THRESHOLD, (1 << 16) | 300, invalid, 0, 360),
        ("THSEL 10b is reserved", feature::TEMPERATURE_THRESHOLD, 2 << 20, invalid, 0, 360),
        ("error recovery TLER 3 s", feature::ERROR_RECOVERY, 30, Status::SUCCESS, 0, 30),
        ("DULBE is not supported", feature::ERROR_RECOVERY, 1 << 16, invalid, 0, 30),
        ("write atomicity: disable normal", feature::WRITE_ATOMICITY_NORMAL, 1, Status::SUCCESS, 0, 1),
        ("write cache off", feature::VOLATILE_WRITE_CACHE, 0, Status::SUCCESS, 0, 0),
        ("write cache on", feature::VOLATILE_WRITE_CACHE, 1, Status::SUCCESS, 0, 1),
        ("keep alive 5 s", feature::KEEP_ALIVE_TIMER, 5000, Status::SUCCESS, 0, 5000),
        ("I/O command set combination 0", feature::IO_COMMAND_SET_PROFILE, 0, Status::SUCCESS, 0, 0),
        (
            "I/O command set combination 1: none",
            feature::IO_COMMAND_SET_PROFILE,
            1,
            Status::IO_COMMAND_SET_COMBINATION_REJECTED.dnr(),
            0,
            0,
        ),
        ("interrupt coalescing: PCIe only", 0x08, 0, invalid, 0, 0),
    ];
    for &(what, fid, cdw11, status, get11, current) in sets {
        let (c, _) = run(&mut q, set_feature(fid, cdw11), 0).await;
        assert_eq!(c.status, status, "{what}");
        if fid != 0x08 {
            let (c, _) = run(&mut q, get_feature(fid, feature::sel::CURRENT, get11), 0).await;
            assert_eq!((c.status, c.dw0), (Status::SUCCESS, current), "{what}: read back");
        }
    }
    let mut s = set_feature(feature::ARBITRATION, 0);
    s.set_cdw(10, feature::ARBITRATION as u32 | (1 << 31));
    assert_eq!(run(&mut q, s, 0).await.0.status, Status::FEATURE_NOT_SAVEABLE.dnr(), "SV: nothing is saveable");
    // The default stays the default after a Set.
    let (c, _) = run(&mut q, get_feature(feature::ERROR_RECOVERY, feature::sel::DEFAULT, 0), 0).await;
    assert_eq!(c.dw0, 0);
    // A discovery controller has only Async Event Configuration and Keep Alive Timer.
    let (mut d, _) = admin_queue(env.disc, DISCOVERY_NQN, false, HOSTID).await;
    for fid in [feature::ARBITRATION, feature::TEMPERATURE_THRESHOLD, feature::NUMBER_OF_QUEUES] {
        assert_eq!(run(&mut d, get_feature(fid, 0, 0), 0).await.0.status, invalid, "discovery, feature {fid:#04x}");
    }
    assert!(run(&mut d, get_feature(feature::KEEP_ALIVE_TIMER, 0, 0), 0).await.0.status.is_success());
}

/// Get Features Host Identifier returns the Connect's 128-bit Host ID with EXHID and is
/// Invalid Field without it (CTRATT bit 0: only 128-bit IDs); Set is a Command Sequence Error
/// over fabrics; a discovery controller has no such feature.
#[tokio::test]
async fn host_identifier_feature() {
    let env = common::start().await;
    let (mut q, _) = admin_queue(env.addr, common::NQN, false, HOSTID).await;
    let (mut d, _) = admin_queue(env.disc, DISCOVERY_NQN, false, HOSTID).await;
    let fid = feature::HOST_IDENTIFIER;
    let invalid = Status::INVALID_FIELD.dnr();
    let with_data = |sqe: Sqe, len: u32| {
        let mut sqe = sqe;
        transport(&mut sqe, len)
    };
    // (what, on discovery, command, bytes asked for, status, DW0, data)
    type Case = (&'static str, bool, Sqe, usize, Status, u32, Vec<u8>);
    let cases: Vec<Case> = vec![
        ("EXHID, current", false, get_feature(fid, feature::sel::CURRENT, feature::EXHID), 16, Status::SUCCESS, 0, HOSTID.to_vec()),
        ("EXHID, default", false, get_feature(fid, feature::sel::DEFAULT, feature::EXHID), 16, Status::SUCCESS, 0, HOSTID.to_vec()),
        ("EXHID, saved", false, get_feature(fid, feature::sel::SAVED, feature::EXHID), 16, Status::SUCCESS, 0, HOSTID.to_vec()),
        ("EXHID, SGL of 4 KiB: 16 bytes move", false, with_data(get_feature(fid, 0, feature::EXHID), 4096), 0, Status::SUCCESS, 0, vec![]),
        (
            "EXHID, SGL of 8 bytes",
            false,
            with_data(get_feature(fid, 0, feature::EXHID), 8),
            0,
            Status::DATA_SGL_LENGTH_INVALID.dnr(),
            0,
            vec![],
        ),
        ("EXHID clear: 64-bit IDs are not supported", false, get_feature(fid, 0, 0), 8, invalid, 0, vec![]),
        (
            "capabilities: not changeable",
            false,
            get_feature(fid, feature::sel::SUPPORTED_CAPABILITIES, feature::EXHID),
            0,
            Status::SUCCESS,
            0,
            vec![],
        ),
        ("Set over fabrics", false, set_feature(fid, feature::EXHID), 0, Status::COMMAND_SEQUENCE_ERROR.dnr(), 0, vec![]),
        (
            "Set with 16 bytes of data",
            false,
            with_data(set_feature(fid, feature::EXHID), 16),
            0,
            Status::COMMAND_SEQUENCE_ERROR.dnr(),
            0,
            vec![],
        ),
        ("discovery: no such feature", true, get_feature(fid, 0, feature::EXHID), 16, invalid, 0, vec![]),
    ];
    for (what, disc, sqe, len, status, dw0, data) in cases {
        let qp = if disc { &mut d } else { &mut q };
        // A case with its own SGL is sent as given: what moves is counted, not collected.
        let (c, got) = if len == 0 && sqe.sgl().len > 0 {
            let (c2h, r2t, c) = exchange(qp, &sqe, false).await;
            assert_eq!(r2t, 0, "{what}: no data requested");
            assert_eq!(c2h, if status.is_success() { 16 } else { 0 }, "{what}: the Host ID only");
            (c, vec![])
        } else {
            run(qp, sqe, len).await
        };
        assert_eq!((c.status, c.dw0, got), (status, dw0, data), "{what}");
    }
}

/// An over-temperature threshold below the composite temperature (300 K) raises the
/// temperature critical warning in SMART/health and, when enabled, an asynchronous event;
/// moving it back clears the warning.
#[tokio::test]
async fn temperature_threshold_warns() {
    let env = common::start().await;
    let (mut q, _) = admin_queue(env.addr, common::NQN, false, HOSTID).await;
    let smart_warning = |d: &[u8]| d[0] & (1 << 1) != 0;
    let smart = || {
        let mut s = Sqe::new(admin::GET_LOG_PAGE, 0);
        s.set_nsid(0xffff_ffff);
        nearstore_wire::log::get_log::build(&mut s, lid::SMART_HEALTH, 512, 0);
        s
    };
    assert!(!smart_warning(&run(&mut q, smart(), 512).await.1));
    assert!(run(&mut q, set_feature(feature::ASYNC_EVENT_CONFIG, 1 << 1), 0).await.0.status.is_success());
    let aer = q.submit(Sqe::new(admin::ASYNC_EVENT_REQUEST, 0), Data::None, 0).unwrap();
    let mut event = None;
    let set = q.submit(set_feature(feature::TEMPERATURE_THRESHOLD, 290), Data::None, 0).unwrap();
    q.wait(set, |_, c, _| {
        if c.cid == aer {
            event = Some(c.dw0)
        }
    })
    .await
    .unwrap();
    if event.is_none() {
        let c = tokio::time::timeout(Duration::from_secs(5), q.wait(aer, |_, _, _| {})).await.expect("an event").unwrap();
        event = Some(c.dw0);
    }
    // SMART/health status (1), temperature threshold (01h), log page 02h.
    assert_eq!(event, Some(0x0002_0101));
    assert!(smart_warning(&run(&mut q, smart(), 512).await.1));
    assert!(run(&mut q, set_feature(feature::TEMPERATURE_THRESHOLD, 343), 0).await.0.status.is_success());
    assert!(!smart_warning(&run(&mut q, smart(), 512).await.1));
    // A host toggling the threshold with no event request outstanding queues one event,
    // not one per toggle: the first request gets it, a second waits.
    for _ in 0..100 {
        for t in [290, 343] {
            assert!(run(&mut q, set_feature(feature::TEMPERATURE_THRESHOLD, t), 0).await.0.status.is_success());
        }
    }
    let first = q.submit(Sqe::new(admin::ASYNC_EVENT_REQUEST, 0), Data::None, 0).unwrap();
    let c = tokio::time::timeout(Duration::from_secs(5), q.wait(first, |_, _, _| {})).await.expect("an event").unwrap();
    assert_eq!(c.dw0, 0x0002_0101);
    let second = q.submit(Sqe::new(admin::ASYNC_EVENT_REQUEST, 0), Data::None, 0).unwrap();
    assert!(tokio::time::timeout(Duration::from_millis(300), q.wait(second, |_, _, _| {})).await.is_err(), "a second event was queued");
}

/// CC.CSS = 110b ("all supported I/O command sets", CAP.CSS bit 6) enables the controller
/// like 000b, with the Identify structures it implies; reserved values fail the enable
/// with CSTS.CFS, as Linux's target does.
#[tokio::test]
async fn all_io_command_sets_enable() {
    let env = common::start().await;
    let cap = {
        let mut q = raw(env.addr, false).await;
        assert!(connect(&mut q, common::NQN, 0, 31, 0xffff, HOSTID).await.status.is_success());
        let mut s = Sqe::new(FABRICS, 0);
        s.set_nsid(fctype::PROPERTY_GET as u32).set_cdw(10, 1).set_cdw(11, prop::CAP);
        run(&mut q, s, 0).await.0.result64()
    };
    assert_eq!(cap & (1 << 37 | 1 << 43), 1 << 37 | 1 << 43, "CAP.CSS: NVM and I/O command sets: {cap:#x}");
    // (CC.CSS, CSTS after the enable)
    let cases: &[(u32, u32)] =
        &[(0b000, csts::RDY), (0b110, csts::RDY), (0b001, csts::CFS), (0b010, csts::CFS), (0b101, csts::CFS), (0b111, csts::CFS)];
    for &(css, want) in cases {
        for (addr, nqn) in [(env.addr, common::NQN), (env.disc, DISCOVERY_NQN)] {
            let mut q = raw(addr, false).await;
            assert!(connect(&mut q, nqn, 0, 31, 0xffff, HOSTID).await.status.is_success());
            assert_eq!(enable(&mut q, cc::LINUX_ENABLE | (css << 4)).await, want, "{nqn}: CSS {css:03b}");
        }
    }
    let mut q = raw(env.addr, false).await;
    let cntlid = connect(&mut q, common::NQN, 0, 31, 0xffff, HOSTID).await.dw0 as u16;
    assert_eq!(enable(&mut q, cc::LINUX_ENABLE | (0b110 << 4)).await, csts::RDY);
    let id = |c: u8, csi: u8, nsid: u32| {
        let mut s = Sqe::new(admin::IDENTIFY, 0);
        s.set_nsid(nsid).set_cdw(10, c as u32).set_cdw(11, (csi as u32) << 24);
        s
    };
    let (c, d) = run(&mut q, id(cns::IO_COMMAND_SETS, 0, 0), 4096).await;
    assert!(c.status.is_success());
    assert_eq!((u64::from_le_bytes(d[0..8].try_into().unwrap()), d[8..].iter().all(|&b| b == 0)), (1, true), "one combination: NVM");
    // (what, CNS, CSI, NSID, status)
    let ok = Status::SUCCESS;
    let cases: &[(&str, u8, u8, u32, Status)] = &[
        ("NVM Identify Controller", cns::CS_CONTROLLER, 0, 0, ok),
        ("NVM Identify Namespace", cns::CS_NAMESPACE, 0, 1, ok),
        ("NVM active namespaces", cns::CS_ACTIVE_NS_LIST, 0, 0, ok),
        ("independent Identify Namespace", cns::CS_INDEPENDENT_NAMESPACE, 0, 1, ok),
        ("zoned Identify Controller", cns::CS_CONTROLLER, 2, 0, Status::INVALID_IO_COMMAND_SET.dnr()),
        ("key-value active namespaces", cns::CS_ACTIVE_NS_LIST, 1, 0, Status::INVALID_IO_COMMAND_SET.dnr()),
        ("NVM Identify Namespace of no namespace", cns::CS_NAMESPACE, 0, 0xffff_fff0, Status::INVALID_NAMESPACE.dnr()),
    ];
    for &(what, c, csi, nsid, status) in cases {
        assert_eq!(run(&mut q, id(c, csi, nsid), 4096).await.0.status, status, "{what}");
    }
    let (_, d) = run(&mut q, id(cns::CS_ACTIVE_NS_LIST, 0, 0), 4096).await;
    assert_eq!(nearstore_wire::identify::decode_ns_list(&d), vec![1, 2]);
    let (_, d) = run(&mut q, id(cns::CS_INDEPENDENT_NAMESPACE, 0, 1), 4096).await;
    assert_eq!((d[0], d[1], d[14]), (1, 1, 1), "NSFEAT thin, NMIC shared, NSTAT ready");
    let (_, d) = run(&mut q, id(cns::NS_ID_DESCRIPTORS, 0, 1), 4096).await;
    assert!(nearstore_wire::identify::decode_ns_descriptors(&d).contains(&(nearstore_wire::identify::nidt::CSI, vec![0])));
    // The I/O queues work as with CSS 000b.
    let mut io = raw(env.addr, false).await;
    assert!(connect(&mut io, common::NQN, 1, 31, cntlid, HOSTID).await.status.is_success());
    assert!(run(&mut io, Sqe::rw(nearstore_wire::opcode::io::READ, 1, 0, 1, false), 512).await.0.status.is_success());
}

/// Log lines captured from the tracing subscriber of the test's thread.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A host reconnecting in a tight loop with a stale controller ID: a few warnings per
/// interval and one line counting the rest, not one line per attempt.
#[tokio::test]
async fn a_reconnect_flood_logs_a_bounded_number_of_lines() {
    let env = common::start().await;
    let log = Captured::default();
    let writer = log.clone();
    let subscriber =
        tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).with_max_level(tracing::Level::WARN).finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    const FLOOD: u64 = 300;
    let start = std::time::Instant::now();
    for _ in 0..FLOOD {
        let mut q = raw(env.addr, false).await;
        let c = connect(&mut q, common::NQN, 1, 31, 0x1234, HOSTID).await;
        assert_eq!((c.status, c.dw0), (Status::CONNECT_INVALID_PARAMETERS.dnr(), 1 | (16 << 16)));
    }
    let intervals = start.elapsed().as_millis() as u64 / limits::LOG_INTERVAL_MS + 1;
    // Once the interval is over, the next attempt brings the count of what was suppressed.
    tokio::time::sleep(Duration::from_millis(limits::LOG_INTERVAL_MS + 50)).await;
    let mut q = raw(env.addr, false).await;
    connect(&mut q, common::NQN, 1, 31, 0x1234, HOSTID).await;
    let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
    let cause = "connect: I/O queue for an unknown controller";
    let logged = text.lines().filter(|l| l.contains(cause) && !l.contains("suppressed")).count() as u64;
    let suppressed: u64 = text
        .lines()
        .filter(|l| l.contains(cause))
        .filter_map(|l| l.split("suppressed=").nth(1))
        .map(|n| n.split_whitespace().next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert!(logged <= (intervals + 1) * limits::LOG_REPEATS_MAX as u64, "{logged} lines in {intervals} intervals:\n{text}");
    assert_eq!(logged + suppressed, FLOOD + 1, "every attempt is logged or counted:\n{text}");
    assert!(suppressed >= FLOOD - intervals * limits::LOG_REPEATS_MAX as u64, "{text}");
}
