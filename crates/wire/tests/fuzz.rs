//! Property tests over everything that decodes bytes from the network: arbitrary input
//! never panics, and what we encode decodes to the same value. PROPTEST_CASES sets the
//! number of cases (the test suite runs 20,000 per property).

use nearstore_wire::compute::{self, Descriptor, Extent, Object};
use nearstore_wire::fabrics::ConnectData;
use nearstore_wire::identify::{decode_ns_descriptors, decode_ns_list, IdentifyController, IdentifyNamespace};
use nearstore_wire::log::{decode_discovery_log, ErrorEntry, Smart};
use nearstore_wire::pdu::{self, DataHdr, Framing, IcReq, IcResp, PduType};
use nearstore_wire::resv;
use nearstore_wire::{Cqe, Sqe, Status};
use proptest::prelude::*;

fn framing() -> impl Strategy<Value = Framing> {
    (any::<bool>(), any::<bool>(), any::<bool>(), 0u32..70000, 0u32..70000).prop_map(|(hdgst, ddgst, from_host, c, d)| Framing {
        hdgst,
        ddgst,
        from_host,
        capsule_data_max: c,
        data_pdu_max: d,
    })
}

/// Bytes that look like a PDU often enough to get past the first checks.
fn pdu_like() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::sample::select(vec![0u8, 1, 2, 3, 4, 5, 6, 7, 9, 0x0f]),
        any::<u8>(),
        prop::sample::select(vec![24u8, 72, 128, 8, 0]),
        any::<u8>(),
        prop::collection::vec(any::<u8>(), 0..400),
    )
        .prop_map(|(t, f, h, pdo, mut rest)| {
            let plen = (8 + rest.len()) as u32;
            let mut b = vec![t, f, h, pdo];
            b.extend_from_slice(&plen.to_le_bytes());
            b.append(&mut rest);
            b
        })
}

proptest! {
    #[test]
    fn parse_frame_never_panics(buf in prop::collection::vec(any::<u8>(), 0..600), f in framing()) {
        let _ = pdu::parse_frame(&buf, &f);
    }

    #[test]
    fn pdu_like_input_decodes_or_names_a_field(buf in pdu_like(), f in framing()) {
        match pdu::parse_frame(&buf, &f) {
            Ok(Some(fr)) => {
                prop_assert!(fr.len <= buf.len());
                prop_assert_eq!(fr.header.len(), fr.hdr.hlen as usize);
                match fr.hdr.pdu_type {
                    PduType::CapsuleCmd => { let _ = pdu::capsule_sqe(fr.header); }
                    PduType::CapsuleResp => { let _ = pdu::capsule_cqe(fr.header); }
                    PduType::H2CData | PduType::C2HData | PduType::R2T => { let _ = DataHdr::decode(fr.header); }
                    PduType::IcReq => { let _ = IcReq::decode(fr.header); }
                    PduType::IcResp => { let _ = IcResp::decode(fr.header); }
                    PduType::H2CTermReq | PduType::C2HTermReq => { let _ = pdu::term_req_decode(fr.header); }
                }
            }
            Ok(None) => {}
            Err(e) => prop_assert!((1..=6).contains(&e.fes) && e.fei < 128, "{e}"),
        }
    }

    #[test]
    fn structure_decoders_never_panic(buf in prop::collection::vec(any::<u8>(), 0..5000)) {
        let _ = ConnectData::decode(&buf);
        let _ = IdentifyController::decode(&buf);
        let _ = IdentifyNamespace::decode(&buf).map(|n| n.block_size());
        let _ = decode_ns_descriptors(&buf);
        let _ = decode_ns_list(&buf);
        let _ = decode_discovery_log(&buf);
        if buf.len() >= 64 {
            let _ = ErrorEntry::decode(&buf);
            let s = Sqe::decode(&buf);
            let _ = (s.sgl(), s.nlb(), s.slba(), s.fctype());
        }
        if buf.len() >= 512 {
            let _ = Smart::decode(&buf);
        }
        let _ = resv::ReservationStatus::decode(&buf);
        let _ = resv::NoticeLog::decode(&buf);
        let _ = resv::Keys::decode(&buf, resv::KEYS_LEN);
    }

    #[test]
    fn reservation_status_round_trip(
        generation: u32,
        rtype in 0u8..7,
        ptpls: bool,
        regs in prop::collection::vec((any::<u16>(), any::<bool>(), any::<[u8; 16]>(), any::<u64>()), 0..20),
        cut in 0usize..1500,
    ) {
        let registrants: Vec<_> = regs.iter().map(|&(cntlid, holder, hostid, rkey)| resv::Registrant { cntlid, holder, hostid, rkey }).collect();
        let s = resv::ReservationStatus { generation, rtype, regctl: registrants.len() as u16, ptpls, registrants };
        prop_assert_eq!(resv::ReservationStatus::decode(&s.encode(s.encoded_len())), Some(s.clone()));
        // A transfer of any length: the registrants that fit, REGCTL as it was.
        let b = s.encode(cut);
        prop_assert_eq!(b.len(), cut);
        if let Some(d) = resv::ReservationStatus::decode(&b) {
            prop_assert_eq!(d.regctl, s.regctl);
            prop_assert_eq!(&d.registrants[..], &s.registrants[..d.registrants.len()]);
        }
    }

    #[test]
    fn capsule_round_trip(dw in prop::array::uniform16(any::<u32>()), data in prop::collection::vec(any::<u8>(), 0..300), hd: bool, dd: bool) {
        let sqe = Sqe { dw };
        let mut b = Vec::new();
        pdu::put_capsule_cmd(&mut b, &sqe, &data, hd, dd);
        let f = Framing { hdgst: hd, ddgst: dd, from_host: true, capsule_data_max: 300, data_pdu_max: 0 };
        let fr = pdu::parse_frame(&b, &f).unwrap().unwrap();
        prop_assert_eq!(fr.len, b.len());
        prop_assert_eq!(pdu::capsule_sqe(fr.header), sqe);
        prop_assert_eq!(fr.data, &data[..]);
        prop_assert!(fr.data_digest_ok);
    }

    #[test]
    fn response_round_trip(dw0: u32, dw1: u32, sqhd: u16, sqid: u16, cid: u16, sc: u8, sct in 0u8..8, dnr: bool, hd: bool) {
        let cqe = Cqe { dw0, dw1, sqhd, sqid, cid, status: Status { sct, sc, dnr } };
        let mut b = Vec::new();
        pdu::put_capsule_resp(&mut b, &cqe, hd);
        let f = Framing { hdgst: hd, ddgst: false, from_host: false, capsule_data_max: 0, data_pdu_max: 0 };
        let fr = pdu::parse_frame(&b, &f).unwrap().unwrap();
        prop_assert_eq!(pdu::capsule_cqe(fr.header), cqe);
    }

    #[test]
    fn connect_data_round_trip(
        hostid: [u8; 16],
        cntlid: u16,
        sub in "nqn\\.[a-z0-9.:-]{1,200}",
        host in "nqn\\.[a-z0-9.:-]{1,200}",
        acting_for in proptest::option::of("nqn\\.[a-z0-9.:-]{1,200}"),
    ) {
        let d = ConnectData { hostid, cntlid, subnqn: sub, hostnqn: host, acting_for };
        prop_assert_eq!(ConnectData::decode(&d.encode()).unwrap(), d);
    }
}

fn extent() -> impl Strategy<Value = Extent> {
    prop_oneof![
        (0u64..1 << 20, 1u64..64).prop_map(|(b, n)| Extent::data(b * 512, n * 512)),
        (1u64..100_000).prop_map(Extent::zeros),
        (any::<u64>(), any::<u64>()).prop_map(|(o, l)| Extent { offset: o, len: l }),
    ]
}

fn object() -> impl Strategy<Value = Object> {
    (prop::collection::vec(extent(), 0..6), any::<u16>()).prop_map(|(extents, cut)| {
        let covered = extents.iter().fold(0u64, |a, e| a.saturating_add(e.len));
        let last = extents.last().map_or(0, |e| e.len);
        // Mostly a valid length (cut inside the last extent), sometimes anything.
        let len = if cut % 8 == 0 { cut as u64 } else { covered - (cut as u64 % last.max(1)) };
        Object { len, extents }
    })
}

fn descriptor() -> impl Strategy<Value = Descriptor> {
    (any::<u16>(), prop::collection::vec(any::<u8>(), 0..40), prop::collection::vec(object(), 0..4), prop::collection::vec(object(), 0..3))
        .prop_map(|(op, args, inputs, outputs)| Descriptor { op, args, inputs, outputs })
}

proptest! {
    #[test]
    fn descriptor_decoder_never_panics(buf in prop::collection::vec(any::<u8>(), 0..600)) {
        let _ = Descriptor::decode(&buf);
    }

    /// Encoded descriptors, valid or not, mutated in a few bytes: the decoder returns a
    /// descriptor that re-encodes to the same bytes, or an error with a status from the
    /// documented set and a message.
    #[test]
    fn descriptor_mutations_decode_or_name_a_field(d in descriptor(), flips in prop::collection::vec((any::<usize>(), any::<u8>()), 0..4), cut in any::<u16>()) {
        let mut b = d.encode();
        for (at, v) in flips {
            if !b.is_empty() {
                let n = b.len();
                b[at % n] = v;
            }
        }
        if cut % 5 == 0 {
            b.truncate(cut as usize % (b.len() + 1));
        }
        match Descriptor::decode(&b) {
            Ok(got) => {
                prop_assert_eq!(got.encode(), b);
                let _ = got.check_extents(1 << 30, 512);
                for o in got.inputs.iter().chain(&got.outputs) {
                    prop_assert_eq!(o.pieces().map(|p| p.len).sum::<u64>(), o.len);
                }
            }
            Err(e) => {
                prop_assert!([compute::status::DESCRIPTOR_INVALID, compute::status::LIMIT_EXCEEDED].contains(&e.status), "{:?}", e);
                prop_assert!(e.message.starts_with("descriptor: "));
            }
        }
    }

    #[test]
    fn valid_descriptors_round_trip(d in descriptor()) {
        if let Ok(got) = Descriptor::decode(&d.encode()) {
            prop_assert_eq!(got, d);
        }
    }
}
