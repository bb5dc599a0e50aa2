//! NVMe/TCP PDUs (NVMe over TCP Transport Specification 1.0, chapter 3).
//!
//! A PDU is an 8-byte common header (CH), a PDU-specific header (PSH) up to HLEN,
//! an optional header digest (CRC32C of CH+PSH), optional padding up to PDO, the data,
//! and an optional data digest (CRC32C of the data). [`parse_frame`] validates all of
//! that on untrusted input; the `put_*` functions encode.

use crate::bytes::*;
use crate::sqe::{Cqe, Sqe, SQE_LEN};

pub const CH_LEN: usize = 8;
pub const DIGEST_LEN: usize = 4;
pub const IC_LEN: usize = 128;
pub const CAPSULE_CMD_HLEN: usize = CH_LEN + SQE_LEN;
pub const CAPSULE_RESP_HLEN: usize = CH_LEN + 16;
pub const DATA_HLEN: usize = 24;
pub const R2T_HLEN: usize = 24;
pub const TERM_HLEN: usize = 24;
/// TermReq PDUs carry at most this much of the offending PDU's header (plen <= 152).
pub const TERM_DATA_MAX: usize = 128;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum PduType {
    IcReq = 0x00,
    IcResp = 0x01,
    H2CTermReq = 0x02,
    C2HTermReq = 0x03,
    CapsuleCmd = 0x04,
    CapsuleResp = 0x05,
    H2CData = 0x06,
    C2HData = 0x07,
    R2T = 0x09,
}

impl PduType {
    pub fn from_u8(v: u8) -> Option<PduType> {
        Some(match v {
            0x00 => PduType::IcReq,
            0x01 => PduType::IcResp,
            0x02 => PduType::H2CTermReq,
            0x03 => PduType::C2HTermReq,
            0x04 => PduType::CapsuleCmd,
            0x05 => PduType::CapsuleResp,
            0x06 => PduType::H2CData,
            0x07 => PduType::C2HData,
            0x09 => PduType::R2T,
            _ => return None,
        })
    }

    /// HLEN the specification fixes for each PDU type.
    pub fn hlen(self) -> usize {
        match self {
            PduType::IcReq | PduType::IcResp => IC_LEN,
            PduType::CapsuleCmd => CAPSULE_CMD_HLEN,
            PduType::CapsuleResp => CAPSULE_RESP_HLEN,
            PduType::H2CData | PduType::C2HData => DATA_HLEN,
            PduType::R2T => R2T_HLEN,
            PduType::H2CTermReq | PduType::C2HTermReq => TERM_HLEN,
        }
    }

    pub fn from_host(self) -> bool {
        matches!(self, PduType::IcReq | PduType::H2CTermReq | PduType::CapsuleCmd | PduType::H2CData)
    }

    fn is_ic(self) -> bool {
        matches!(self, PduType::IcReq | PduType::IcResp)
    }

    fn is_term(self) -> bool {
        matches!(self, PduType::H2CTermReq | PduType::C2HTermReq)
    }

    fn may_carry_data(self) -> bool {
        matches!(self, PduType::CapsuleCmd | PduType::H2CData | PduType::C2HData)
    }
}

/// Common-header flags.
pub mod flags {
    pub const HDGSTF: u8 = 0x01;
    pub const DDGSTF: u8 = 0x02;
    /// Last data PDU of a transfer (H2CData, C2HData).
    pub const LAST_PDU: u8 = 0x04;
    /// C2HData only: the command completed successfully, no CapsuleResp follows.
    pub const SUCCESS: u8 = 0x08;
}

/// Fatal error status of a TermReq (NVMe/TCP 1.0, "H2CTermReq/C2HTermReq").
pub mod fes {
    pub const INVALID_HEADER_FIELD: u16 = 0x01;
    pub const PDU_SEQUENCE_ERROR: u16 = 0x02;
    pub const HEADER_DIGEST_ERROR: u16 = 0x03;
    pub const DATA_OUT_OF_RANGE: u16 = 0x04;
    pub const DATA_LIMIT_EXCEEDED: u16 = 0x05;
    pub const UNSUPPORTED_PARAMETER: u16 = 0x06;
}

/// A fatal transport error: what to put in the TermReq, and why (for the log).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("fatal NVMe/TCP error (fes {fes:#x}, field at byte {fei}): {what}")]
pub struct PduError {
    pub fes: u16,
    /// Field Error Information: for an invalid header field, the byte offset of the field.
    pub fei: u32,
    pub what: &'static str,
}

impl PduError {
    pub fn new(fes: u16, fei: u32, what: &'static str) -> PduError {
        PduError { fes, fei, what }
    }
    pub fn header(fei: u32, what: &'static str) -> PduError {
        PduError::new(fes::INVALID_HEADER_FIELD, fei, what)
    }
}

/// The 8-byte common header.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct PduHeader {
    pub pdu_type: PduType,
    pub flags: u8,
    pub hlen: u8,
    pub pdo: u8,
    pub plen: u32,
}

/// What the receiver negotiated and accepts from its peer.
#[derive(Clone, Copy, Debug)]
pub struct Framing {
    pub hdgst: bool,
    pub ddgst: bool,
    /// PDUs this side accepts: host-to-controller types when true, the others when false.
    pub from_host: bool,
    /// Largest in-capsule data of a CapsuleCmd (ICDSZ).
    pub capsule_data_max: u32,
    /// Largest data of one H2CData (MAXH2CDATA) or C2HData PDU.
    pub data_pdu_max: u32,
}

impl Framing {
    /// Before ICReq/ICResp: no digests, only the IC PDU is expected.
    pub fn initial(from_host: bool) -> Framing {
        Framing { hdgst: false, ddgst: false, from_host, capsule_data_max: 0, data_pdu_max: 0 }
    }

    fn data_max(&self, t: PduType) -> usize {
        match t {
            PduType::CapsuleCmd => self.capsule_data_max as usize,
            PduType::H2CData | PduType::C2HData => self.data_pdu_max as usize,
            PduType::H2CTermReq | PduType::C2HTermReq => TERM_DATA_MAX,
            _ => 0,
        }
    }
}

/// One complete, validated PDU inside a receive buffer.
#[derive(Debug)]
pub struct Frame<'a> {
    pub hdr: PduHeader,
    /// CH and PSH: `hlen` bytes, digest excluded.
    pub header: &'a [u8],
    pub data: &'a [u8],
    /// Whole PDU length in the buffer (PLEN).
    pub len: usize,
    /// False if the data digest did not match: the command fails with a transient
    /// transport error, the connection stays up.
    pub data_digest_ok: bool,
}

/// Parses the PDU at the start of `buf`. `Ok(None)` means more bytes are needed; the
/// length fields are validated as soon as the common header is in, so a peer cannot make
/// the receiver buffer more than one PDU of the negotiated maximum size.
pub fn parse_frame<'a>(buf: &'a [u8], f: &Framing) -> Result<Option<Frame<'a>>, PduError> {
    if buf.len() < CH_LEN {
        return Ok(None);
    }
    let t = PduType::from_u8(buf[0]).ok_or(PduError::header(0, "unknown PDU type"))?;
    if t.from_host() != f.from_host {
        return Err(PduError::header(0, "PDU type not valid in this direction"));
    }
    let hdr = PduHeader { pdu_type: t, flags: buf[1], hlen: buf[2], pdo: buf[3], plen: u32_at(buf, 4) };
    let hlen = hdr.hlen as usize;
    if hlen != t.hlen() {
        return Err(PduError::header(2, "HLEN does not match the PDU type"));
    }
    let plen = hdr.plen as usize;
    let digests_allowed = !t.is_ic() && !t.is_term();
    let hd = hdr.flags & flags::HDGSTF != 0;
    if hd != (digests_allowed && f.hdgst) {
        return Err(PduError::header(1, "HDGSTF flag does not match the negotiated header digest"));
    }
    let hlen_d = hlen + if hd { DIGEST_LEN } else { 0 };
    if plen < hlen_d {
        return Err(PduError::header(4, "PLEN shorter than the header"));
    }
    let dd = hdr.flags & flags::DDGSTF != 0;
    if dd && !digests_allowed {
        return Err(PduError::header(1, "DDGSTF set on an IC or TermReq PDU, which never carry digests"));
    }
    let (data_off, data_len) = if t.is_term() {
        (hlen, plen - hlen)
    } else if plen == hlen_d {
        // The data field is empty: PDO may be 0 or point just past the header (and its
        // digest), where the empty data field starts; anything else is inside the header
        // or beyond the PDU.
        let pdo = hdr.pdo as usize;
        if pdo != 0 && pdo != hlen_d {
            return Err(PduError::header(3, "PDO of a PDU without data is neither 0 nor the end of its header"));
        }
        if dd {
            return Err(PduError::header(1, "DDGSTF set on a PDU without data"));
        }
        (hlen_d, 0)
    } else {
        if !t.may_carry_data() {
            return Err(PduError::header(4, "PLEN larger than the header of a PDU that carries no data"));
        }
        if dd != f.ddgst {
            return Err(PduError::header(1, "DDGSTF flag does not match the negotiated data digest"));
        }
        let pdo = hdr.pdo as usize;
        if pdo < hlen_d {
            return Err(PduError::header(3, "PDO points inside the header"));
        }
        let ddl = if dd { DIGEST_LEN } else { 0 };
        if plen < pdo + ddl + 1 {
            return Err(PduError::header(4, "PLEN leaves no room for data after PDO"));
        }
        (pdo, plen - pdo - ddl)
    };
    if data_len > f.data_max(t) {
        return Err(PduError::new(fes::DATA_LIMIT_EXCEEDED, 4, "PDU data exceeds the negotiated maximum"));
    }
    if buf.len() < plen {
        return Ok(None);
    }
    if hd {
        let want = u32_at(buf, hlen);
        if crc32c::crc32c(&buf[..hlen]) != want {
            return Err(PduError::new(fes::HEADER_DIGEST_ERROR, 0, "header digest mismatch"));
        }
    }
    let data = &buf[data_off..data_off + data_len];
    let mut data_digest_ok = true;
    if dd && data_len > 0 {
        data_digest_ok = crc32c::crc32c(data) == u32_at(buf, data_off + data_len);
    }
    if matches!(t, PduType::H2CData | PduType::C2HData) && u32_at(buf, 16) as usize != data_len {
        return Err(PduError::header(16, "DATAL does not match the PDU's data length"));
    }
    Ok(Some(Frame { hdr, header: &buf[..hlen], data, len: plen, data_digest_ok }))
}

/// Appends a PDU header (CH + `psh`, digest if negotiated, no padding) for a PDU whose
/// data of `data_len` bytes the caller appends next, then calls [`put_data_digest`].
/// Returns the offset in `out` where the data starts.
pub fn put_header(out: &mut Vec<u8>, t: PduType, fl: u8, psh: &[u8], data_len: usize, hdgst: bool, ddgst: bool) -> usize {
    put_header_aligned(out, t, fl, psh, data_len, hdgst, ddgst, 0)
}

/// [`put_header`] with the data placed at a multiple of `(pda + 1) * 4` bytes from the PDU
/// start, as the receiver asked in ICReq.HPDA (or ICResp.CPDA); padding is zeros.
#[allow(clippy::too_many_arguments)]
pub fn put_header_aligned(
    out: &mut Vec<u8>,
    t: PduType,
    mut fl: u8,
    psh: &[u8],
    data_len: usize,
    hdgst: bool,
    ddgst: bool,
    pda: u8,
) -> usize {
    let hlen = CH_LEN + psh.len();
    debug_assert_eq!(hlen, t.hlen());
    let hd = hdgst && !t.is_ic() && !t.is_term();
    let dd = ddgst && data_len > 0 && t.may_carry_data();
    let hlen_d = hlen + if hd { DIGEST_LEN } else { 0 };
    let align = (pda as usize + 1) * 4;
    let pdo = if data_len > 0 && !t.is_term() { hlen_d.div_ceil(align) * align } else { 0 };
    let plen = pdo.max(hlen_d) + data_len + if dd { DIGEST_LEN } else { 0 };
    if hd {
        fl |= flags::HDGSTF;
    }
    if dd {
        fl |= flags::DDGSTF;
    }
    let start = out.len();
    out.extend_from_slice(&[t as u8, fl, hlen as u8, pdo as u8]);
    out.extend_from_slice(&(plen as u32).to_le_bytes());
    out.extend_from_slice(psh);
    if hd {
        let crc = crc32c::crc32c(&out[start..start + hlen]);
        out.extend_from_slice(&crc.to_le_bytes());
    }
    out.resize(start + pdo.max(hlen_d), 0);
    out.len()
}

/// Appends the data digest over `out[data_start..]` when data digests are on.
pub fn put_data_digest(out: &mut Vec<u8>, data_start: usize, ddgst: bool) {
    if ddgst && out.len() > data_start {
        let crc = crc32c::crc32c(&out[data_start..]);
        out.extend_from_slice(&crc.to_le_bytes());
    }
}

/// Appends a whole PDU with `data` copied in.
pub fn put_pdu(out: &mut Vec<u8>, t: PduType, fl: u8, psh: &[u8], data: &[u8], hdgst: bool, ddgst: bool) {
    let start = put_header(out, t, fl, psh, data.len(), hdgst, ddgst);
    out.extend_from_slice(data);
    put_data_digest(out, start, ddgst);
}

/// ICReq / ICResp: the connection's first PDUs. The PSH is 120 bytes.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct IcReq {
    pub pfv: u16,
    /// Host PDU data alignment, (hpda+1)*4 bytes.
    pub hpda: u8,
    pub hdgst: bool,
    pub ddgst: bool,
    /// Maximum outstanding R2Ts per command, 0's based.
    pub maxr2t: u32,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct IcResp {
    pub pfv: u16,
    pub cpda: u8,
    pub hdgst: bool,
    pub ddgst: bool,
    pub maxh2cdata: u32,
}

fn ic_psh(pfv: u16, pda: u8, hdgst: bool, ddgst: bool, max: u32) -> [u8; IC_LEN - CH_LEN] {
    let mut p = [0u8; IC_LEN - CH_LEN];
    p[0..2].copy_from_slice(&pfv.to_le_bytes());
    p[2] = pda;
    p[3] = hdgst as u8 | ((ddgst as u8) << 1);
    p[4..8].copy_from_slice(&max.to_le_bytes());
    p
}

impl IcReq {
    pub fn decode(h: &[u8]) -> IcReq {
        IcReq { pfv: u16_at(h, 8), hpda: h[10], hdgst: h[11] & 1 != 0, ddgst: h[11] & 2 != 0, maxr2t: u32_at(h, 12) }
    }
    pub fn encode(&self, out: &mut Vec<u8>) {
        put_pdu(out, PduType::IcReq, 0, &ic_psh(self.pfv, self.hpda, self.hdgst, self.ddgst, self.maxr2t), &[], false, false);
    }
}

impl IcResp {
    pub fn decode(h: &[u8]) -> IcResp {
        IcResp { pfv: u16_at(h, 8), cpda: h[10], hdgst: h[11] & 1 != 0, ddgst: h[11] & 2 != 0, maxh2cdata: u32_at(h, 12) }
    }
    pub fn encode(&self, out: &mut Vec<u8>) {
        put_pdu(out, PduType::IcResp, 0, &ic_psh(self.pfv, self.cpda, self.hdgst, self.ddgst, self.maxh2cdata), &[], false, false);
    }
}

/// The PSH shared by H2CData, C2HData and R2T: command id, transfer tag, offset, length.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct DataHdr {
    pub cccid: u16,
    pub ttag: u16,
    pub offset: u32,
    pub len: u32,
}

impl DataHdr {
    pub fn decode(h: &[u8]) -> DataHdr {
        DataHdr { cccid: u16_at(h, 8), ttag: u16_at(h, 10), offset: u32_at(h, 12), len: u32_at(h, 16) }
    }
    pub fn psh(&self) -> [u8; 16] {
        let mut p = [0u8; 16];
        p[0..2].copy_from_slice(&self.cccid.to_le_bytes());
        p[2..4].copy_from_slice(&self.ttag.to_le_bytes());
        p[4..8].copy_from_slice(&self.offset.to_le_bytes());
        p[8..12].copy_from_slice(&self.len.to_le_bytes());
        p
    }
}

/// Appends a CapsuleCmd with optional in-capsule data.
pub fn put_capsule_cmd(out: &mut Vec<u8>, sqe: &Sqe, data: &[u8], hdgst: bool, ddgst: bool) {
    let mut psh = [0u8; SQE_LEN];
    sqe.encode(&mut psh);
    put_pdu(out, PduType::CapsuleCmd, 0, &psh, data, hdgst, ddgst);
}

/// Appends a CapsuleResp.
pub fn put_capsule_resp(out: &mut Vec<u8>, cqe: &Cqe, hdgst: bool) {
    let mut psh = [0u8; 16];
    cqe.encode(&mut psh);
    put_pdu(out, PduType::CapsuleResp, 0, &psh, &[], hdgst, false);
}

/// Appends an R2T.
pub fn put_r2t(out: &mut Vec<u8>, r: &DataHdr, hdgst: bool) {
    put_pdu(out, PduType::R2T, 0, &r.psh(), &[], hdgst, false);
}

/// Appends a TermReq carrying (a prefix of) the offending PDU's header.
pub fn put_term_req(out: &mut Vec<u8>, t: PduType, e: &PduError, offending: &[u8]) {
    let mut psh = [0u8; 16];
    psh[0..2].copy_from_slice(&e.fes.to_le_bytes());
    psh[2..6].copy_from_slice(&e.fei.to_le_bytes());
    let n = offending.len().min(TERM_DATA_MAX);
    put_pdu(out, t, 0, &psh, &offending[..n], false, false);
}

/// Decodes a TermReq's FES and FEI.
pub fn term_req_decode(h: &[u8]) -> (u16, u32) {
    (u16_at(h, 8), u32_at(h, 10))
}

/// Reads the SQE of a CapsuleCmd header.
pub fn capsule_sqe(h: &[u8]) -> Sqe {
    Sqe::decode(&h[CH_LEN..CH_LEN + SQE_LEN])
}

/// Reads the CQE of a CapsuleResp header.
pub fn capsule_cqe(h: &[u8]) -> Cqe {
    Cqe::decode(&h[CH_LEN..CH_LEN + 16])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target_framing(hdgst: bool, ddgst: bool) -> Framing {
        Framing { hdgst, ddgst, from_host: true, capsule_data_max: 8192, data_pdu_max: 65536 }
    }

    /// One table: a PDU mutation and the fatal error it must produce.
    #[test]
    fn malformed_pdus_name_the_field() {
        let mut good = Vec::new();
        put_capsule_cmd(&mut good, &Sqe::new(0x01, 7), &[1, 2, 3, 4], true, true);
        let f = target_framing(true, true);
        assert!(parse_frame(&good, &f).unwrap().is_some());
        type Mutate = fn(&mut Vec<u8>);
        let cases: &[(&str, Mutate, u16, u32)] = &[
            ("unknown type", |b| b[0] = 0x0f, fes::INVALID_HEADER_FIELD, 0),
            ("controller-to-host type", |b| b[0] = 0x05, fes::INVALID_HEADER_FIELD, 0),
            ("hlen", |b| b[2] = 70, fes::INVALID_HEADER_FIELD, 2),
            ("no header digest flag", |b| b[1] &= !flags::HDGSTF, fes::INVALID_HEADER_FIELD, 1),
            ("no data digest flag", |b| b[1] &= !flags::DDGSTF, fes::INVALID_HEADER_FIELD, 1),
            ("plen short", |b| b[4] = 10, fes::INVALID_HEADER_FIELD, 4),
            ("pdo inside header", |b| b[3] = 8, fes::INVALID_HEADER_FIELD, 3),
            ("header digest", |b| b[20] ^= 0xff, fes::HEADER_DIGEST_ERROR, 0),
            ("too much data", |b| b[4..8].copy_from_slice(&(100_000u32).to_le_bytes()), fes::DATA_LIMIT_EXCEEDED, 4),
        ];
        for (name, mutate, want_fes, want_fei) in cases {
            let mut b = good.clone();
            mutate(&mut b);
            let e = parse_frame(&b, &f).expect_err(name);
            assert_eq!((e.fes, e.fei), (*want_fes, *want_fei), "{name}: {e}");
        }
    }

    /// PDO on every PDU that has one: 0 or the end of the header (digest included) when
    /// the data field is empty, at or past the header when there is data, never inside it.
    #[test]
    fn pdo_is_checked_against_the_header_and_the_data() {
        let cmd = |hd: bool, data: &[u8]| {
            let mut b = Vec::new();
            put_capsule_cmd(&mut b, &Sqe::new(0x06, 1), data, hd, false);
            b
        };
        let h2c = |hd: bool| {
            let mut b = Vec::new();
            let d = DataHdr { cccid: 1, ttag: 0, offset: 0, len: 8 };
            put_pdu(&mut b, PduType::H2CData, flags::LAST_PDU, &d.psh(), &[7; 8], hd, false);
            b
        };
        let resp = |hd: bool| {
            let mut b = Vec::new();
            put_capsule_resp(&mut b, &Cqe::default(), hd);
            b
        };
        let r2t = |hd: bool| {
            let mut b = Vec::new();
            put_r2t(&mut b, &DataHdr { cccid: 1, ttag: 0, offset: 0, len: 4096 }, hd);
            b
        };
        let host = |hd| Framing { hdgst: hd, ddgst: false, from_host: true, capsule_data_max: 8192, data_pdu_max: 65536 };
        let ctrl = |hd| Framing { from_host: false, ..host(hd) };
        // (what, PDU, framing, PDO written, Ok(data length) or Err(FEI))
        type Case = (&'static str, Vec<u8>, Framing, u8, Result<usize, u32>);
        let cases: Vec<Case> = vec![
            ("capsule, no data, PDO 0", cmd(false, &[]), host(false), 0, Ok(0)),
            ("capsule, no data, PDO = HLEN", cmd(false, &[]), host(false), 72, Ok(0)),
            ("capsule, no data, PDO = HLEN + HDGST", cmd(true, &[]), host(true), 76, Ok(0)),
            ("capsule, no data, PDO on the header digest", cmd(true, &[]), host(true), 72, Err(3)),
            ("capsule, no data, PDO inside the header", cmd(false, &[]), host(false), 8, Err(3)),
            ("capsule, no data, PDO past the PDU", cmd(false, &[]), host(false), 100, Err(3)),
            ("capsule with data, PDO = HLEN", cmd(false, &[1; 16]), host(false), 72, Ok(16)),
            ("capsule with data, PDO inside the header", cmd(false, &[1; 16]), host(false), 64, Err(3)),
            ("capsule with data and HDGST, PDO on the digest", cmd(true, &[1; 16]), host(true), 72, Err(3)),
            ("H2CData, PDO = HLEN", h2c(false), host(false), 24, Ok(8)),
            ("H2CData, PDO inside the header", h2c(false), host(false), 16, Err(3)),
            ("H2CData with HDGST, PDO on the digest", h2c(true), host(true), 24, Err(3)),
            ("CapsuleResp, PDO = HLEN", resp(false), ctrl(false), 24, Ok(0)),
            ("CapsuleResp with HDGST, PDO = HLEN + HDGST", resp(true), ctrl(true), 28, Ok(0)),
            ("CapsuleResp, PDO inside the header", resp(false), ctrl(false), 12, Err(3)),
            ("R2T, PDO = HLEN", r2t(false), ctrl(false), 24, Ok(0)),
            ("R2T, PDO past the PDU", r2t(false), ctrl(false), 32, Err(3)),
        ];
        for (what, mut b, f, pdo, want) in cases {
            b[3] = pdo;
            if f.hdgst {
                let hlen = b[2] as usize;
                let crc = crc32c::crc32c(&b[..hlen]);
                b[hlen..hlen + 4].copy_from_slice(&crc.to_le_bytes());
            }
            let got = parse_frame(&b, &f).map(|fr| fr.expect("whole PDU").data.len()).map_err(|e| e.fei);
            assert_eq!(got, want, "{what}");
        }
    }

    /// PLEN near 4 GiB: the length arithmetic does not wrap; the PDU is refused for its
    /// size as soon as the common header is in, before anything is buffered.
    #[test]
    fn plen_near_4_gib_does_not_wrap() {
        let f = target_framing(false, false);
        for (what, t, pdo, plen) in [
            ("capsule, PLEN FFFFFFFFh", PduType::CapsuleCmd, 72u8, u32::MAX),
            ("capsule, PLEN FFFFFFFFh, PDO FFh", PduType::CapsuleCmd, 0xff, u32::MAX),
            ("capsule, PLEN FFFFFFF0h", PduType::CapsuleCmd, 72, u32::MAX - 15),
            ("H2CData, PLEN FFFFFFFFh", PduType::H2CData, 24, u32::MAX),
            ("H2CTermReq, PLEN FFFFFFFFh", PduType::H2CTermReq, 0, u32::MAX),
        ] {
            let mut b = vec![t as u8, 0, t.hlen() as u8, pdo];
            b.extend_from_slice(&plen.to_le_bytes());
            let e = parse_frame(&b, &f).expect_err(what);
            assert_eq!((e.fes, e.fei), (fes::DATA_LIMIT_EXCEEDED, 4), "{what}: {e}");
        }
        // A receiver that accepts any size still only asks for more bytes.
        let any = Framing { capsule_data_max: u32::MAX, ..f };
        let mut b = vec![PduType::CapsuleCmd as u8, 0, 72, 72];
        b.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(parse_frame(&b, &any).unwrap().is_none());
    }

    #[test]
    fn data_digest_error_is_not_fatal() {
        let mut b = Vec::new();
        put_capsule_cmd(&mut b, &Sqe::new(0x01, 7), &[9; 512], false, true);
        let n = b.len();
        b[n - 5] ^= 1;
        let fr = parse_frame(&b, &target_framing(false, true)).unwrap().unwrap();
        assert!(!fr.data_digest_ok);
        assert_eq!(fr.data.len(), 512);
    }

    #[test]
    fn data_alignment_pads_to_pda() {
        let mut b = Vec::new();
        let d = DataHdr { cccid: 1, ttag: 0, offset: 0, len: 3 };
        let start = put_header_aligned(&mut b, PduType::C2HData, flags::LAST_PDU, &d.psh(), 3, true, false, 7);
        assert_eq!(start, 32);
        b.extend_from_slice(&[1, 2, 3]);
        let f = Framing { hdgst: true, ddgst: false, from_host: false, capsule_data_max: 0, data_pdu_max: 64 };
        let fr = parse_frame(&b, &f).unwrap().unwrap();
        assert_eq!((fr.hdr.pdo, fr.data), (32, &[1u8, 2, 3][..]));
    }

    #[test]
    fn partial_input_asks_for_more() {
        let mut b = Vec::new();
        put_capsule_cmd(&mut b, &Sqe::new(0x02, 1), &[], true, false);
        for cut in 0..b.len() {
            assert!(parse_frame(&b[..cut], &target_framing(true, false)).unwrap().is_none(), "cut {cut}");
        }
    }
}
