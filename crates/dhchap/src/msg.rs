//! The DH-HMAC-CHAP messages (NVMe Base, "Authentication" data structures), little-endian,
//! as Authentication Send carries them to the controller and Authentication Receive back.
//! Decoders take untrusted bytes: every length inside a message is checked against the
//! bytes there are, and nothing is allocated before.

/// Authentication Send and Receive: CDW10 bits 31:24, the security protocol (SECP) of
/// NVMe over Fabrics authentication; bits 15:8 and 23:16, SPSP0 and SPSP1, both 01h.
pub const SECP: u8 = 0xe9;
pub const SPSP0: u8 = 0x01;
pub const SPSP1: u8 = 0x01;

/// CDW10 of Authentication Send and Receive.
pub fn cdw10() -> u32 {
    (SPSP0 as u32) << 8 | (SPSP1 as u32) << 16 | (SECP as u32) << 24
}

/// AUTH-TYPE: common messages (Negotiate, the failures) or DH-HMAC-CHAP's.
pub mod auth_type {
    pub const COMMON: u8 = 0x00;
    pub const DHCHAP: u8 = 0x01;
}

/// AUTH-ID: which message.
pub mod auth_id {
    pub const NEGOTIATE: u8 = 0x00;
    pub const CHALLENGE: u8 = 0x01;
    pub const REPLY: u8 = 0x02;
    pub const SUCCESS1: u8 = 0x03;
    pub const SUCCESS2: u8 = 0x04;
    pub const FAILURE2: u8 = 0xf0;
    pub const FAILURE1: u8 = 0xf1;
}

/// Reason code of a failure: authentication failed (the only one defined).
pub const REASON_FAILED: u8 = 0x01;

/// Reason code explanations of a failure.
pub mod explanation {
    pub const FAILED: u8 = 0x01;
    pub const NOT_USABLE: u8 = 0x02;
    pub const CONCAT_MISMATCH: u8 = 0x03;
    pub const HASH_UNUSABLE: u8 = 0x04;
    pub const DHGROUP_UNUSABLE: u8 = 0x05;
    pub const INCORRECT_PAYLOAD: u8 = 0x06;
    pub const INCORRECT_MESSAGE: u8 = 0x07;

    /// Its name in logs and errors.
    pub fn name(e: u8) -> &'static str {
        match e {
            FAILED => "authentication failed",
            NOT_USABLE => "protocol not usable",
            CONCAT_MISMATCH => "secure channel concatenation mismatch",
            HASH_UNUSABLE => "hash function not usable",
            DHGROUP_UNUSABLE => "DH group not usable",
            INCORRECT_PAYLOAD => "incorrect payload",
            INCORRECT_MESSAGE => "incorrect protocol message",
            _ => "unknown reason",
        }
    }
}

/// The protocol identifier of DH-HMAC-CHAP in a Negotiate's descriptor (AUTHID).
pub const PROTOCOL_DHCHAP: u8 = 0x01;
/// SC_C 00h: no secure channel concatenation.
pub const SC_C_NONE: u8 = 0x00;

/// Bytes of a Negotiate's header and of one protocol descriptor (AUTHID, reserved, HALEN,
/// DHLEN, 30 hash identifiers, 30 DH group identifiers).
pub const NEGOTIATE_HEADER_LEN: usize = 8;
pub const DESCRIPTOR_LEN: usize = 64;
pub const HASH_IDS_MAX: usize = 30;
pub const DH_IDS_MAX: usize = 30;
/// Bytes of the header of Challenge, Reply, Success1 and Success2.
pub const HEADER_LEN: usize = 16;
/// Bytes of a Failure1 or Failure2.
pub const FAILURE_LEN: usize = 8;
/// The largest Negotiate there can be: NAPD is one byte.
pub const NEGOTIATE_LEN_MAX: usize = NEGOTIATE_HEADER_LEN + 255 * DESCRIPTOR_LEN;
/// The largest message of the host's (a Negotiate of 255 descriptors; a Reply is at most
/// 16 + 2 x 64 + 1024 bytes): what Authentication Send's TL may be.
pub const SEND_LEN_MAX: usize = NEGOTIATE_LEN_MAX;

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

/// AUTH_Negotiate, host to controller: the DH-HMAC-CHAP descriptor's lists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Negotiate {
    pub t_id: u16,
    pub sc_c: u8,
    pub hash_ids: Vec<u8>,
    pub dh_ids: Vec<u8>,
}

/// DH-HMAC-CHAP_Challenge, controller to host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Challenge {
    pub t_id: u16,
    pub hash_id: u8,
    pub dh_id: u8,
    pub seqnum: u32,
    pub cval: Vec<u8>,
    pub dhv: Vec<u8>,
}

/// DH-HMAC-CHAP_Reply, host to controller: its response, and with CVALID its own challenge
/// for bidirectional authentication.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub t_id: u16,
    pub rval: Vec<u8>,
    /// C2 when CVALID is set.
    pub cval: Option<Vec<u8>>,
    pub seqnum: u32,
    pub dhv: Vec<u8>,
}

/// A message as decoded; which one is the sender's to say (AUTH-TYPE, AUTH-ID).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    Negotiate(Negotiate),
    Challenge(Challenge),
    Reply(Reply),
    /// DH-HMAC-CHAP_Success1: the controller's response R2 when the host asked for one.
    /// HL is the hash's length with or without it (Linux's host checks it either way).
    Success1 {
        t_id: u16,
        hl: u8,
        rval: Option<Vec<u8>>,
    },
    Success2 {
        t_id: u16,
    },
    /// Failure1 (controller to host) or Failure2 (host to controller).
    Failure {
        t_id: u16,
        first: bool,
        reason: u8,
        explanation: u8,
    },
}

/// Why a message could not be decoded: the reason code explanation it is answered with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bad(pub u8);

impl Message {
    pub fn t_id(&self) -> u16 {
        match self {
            Message::Negotiate(n) => n.t_id,
            Message::Challenge(c) => c.t_id,
            Message::Reply(r) => r.t_id,
            Message::Success1 { t_id, .. } | Message::Success2 { t_id } | Message::Failure { t_id, .. } => *t_id,
        }
    }

    /// Decodes a message; `b` is the whole transfer (TL or AL bytes), which may be longer
    /// than the message (Receive's allocation length).
    pub fn decode(b: &[u8]) -> Result<Message, Bad> {
        use explanation::{INCORRECT_MESSAGE, INCORRECT_PAYLOAD};
        if b.len() < 4 {
            return Err(Bad(INCORRECT_PAYLOAD));
        }
        let need = |n: usize| if b.len() < n { Err(Bad(INCORRECT_PAYLOAD)) } else { Ok(()) };
        match (b[0], b[1]) {
            (auth_type::COMMON, auth_id::NEGOTIATE) => {
                need(NEGOTIATE_HEADER_LEN + DESCRIPTOR_LEN)?;
                let napd = b[7] as usize;
                if napd == 0 {
                    return Err(Bad(INCORRECT_PAYLOAD));
                }
                // The DH-HMAC-CHAP descriptor (the only protocol there is), wherever it is.
                need(NEGOTIATE_HEADER_LEN + napd * DESCRIPTOR_LEN)?;
                let d = (0..napd)
                    .map(|i| &b[NEGOTIATE_HEADER_LEN + i * DESCRIPTOR_LEN..][..DESCRIPTOR_LEN])
                    .find(|d| d[0] == PROTOCOL_DHCHAP)
                    .ok_or(Bad(explanation::NOT_USABLE))?;
                let (halen, dhlen) = (d[2] as usize, d[3] as usize);
                if halen > HASH_IDS_MAX || dhlen > DH_IDS_MAX {
                    return Err(Bad(INCORRECT_PAYLOAD));
                }
                Ok(Message::Negotiate(Negotiate {
                    t_id: u16_at(b, 4),
                    sc_c: b[6],
                    hash_ids: d[4..4 + halen].to_vec(),
                    dh_ids: d[4 + HASH_IDS_MAX..4 + HASH_IDS_MAX + dhlen].to_vec(),
                }))
            }
            (auth_type::DHCHAP, auth_id::CHALLENGE) => {
                need(HEADER_LEN)?;
                let (hl, dhvlen) = (b[6] as usize, u16_at(b, 10) as usize);
                need(HEADER_LEN + hl + dhvlen)?;
                Ok(Message::Challenge(Challenge {
                    t_id: u16_at(b, 4),
                    hash_id: b[8],
                    dh_id: b[9],
                    seqnum: u32_at(b, 12),
                    cval: b[HEADER_LEN..HEADER_LEN + hl].to_vec(),
                    dhv: b[HEADER_LEN + hl..HEADER_LEN + hl + dhvlen].to_vec(),
                }))
            }
            (auth_type::DHCHAP, auth_id::REPLY) => {
                need(HEADER_LEN)?;
                let (hl, cvalid, dhvlen) = (b[6] as usize, b[8] & 1 != 0, u16_at(b, 10) as usize);
                // RVAL and CVAL are both HL bytes, CVAL there even when not valid.
                need(HEADER_LEN + 2 * hl + dhvlen)?;
                let at = HEADER_LEN + 2 * hl;
                Ok(Message::Reply(Reply {
                    t_id: u16_at(b, 4),
                    rval: b[HEADER_LEN..HEADER_LEN + hl].to_vec(),
                    cval: cvalid.then(|| b[HEADER_LEN + hl..at].to_vec()),
                    seqnum: u32_at(b, 12),
                    dhv: b[at..at + dhvlen].to_vec(),
                }))
            }
            (auth_type::DHCHAP, auth_id::SUCCESS1) => {
                need(HEADER_LEN)?;
                let (hl, rvalid) = (b[6] as usize, b[8] & 1 != 0);
                if rvalid {
                    need(HEADER_LEN + hl)?;
                }
                Ok(Message::Success1 { t_id: u16_at(b, 4), hl: hl as u8, rval: rvalid.then(|| b[HEADER_LEN..HEADER_LEN + hl].to_vec()) })
            }
            (auth_type::DHCHAP, auth_id::SUCCESS2) => {
                need(HEADER_LEN)?;
                Ok(Message::Success2 { t_id: u16_at(b, 4) })
            }
            // Linux sends Failure2 with either AUTH-TYPE: both are taken.
            (auth_type::COMMON | auth_type::DHCHAP, id @ (auth_id::FAILURE1 | auth_id::FAILURE2)) => {
                need(FAILURE_LEN)?;
                Ok(Message::Failure { t_id: u16_at(b, 4), first: id == auth_id::FAILURE1, reason: b[6], explanation: b[7] })
            }
            _ => Err(Bad(INCORRECT_MESSAGE)),
        }
    }

    /// The message's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let header = |len: usize, ty: u8, id: u8, t_id: u16| {
            let mut b = vec![0u8; len];
            b[0] = ty;
            b[1] = id;
            b[4..6].copy_from_slice(&t_id.to_le_bytes());
            b
        };
        match self {
            Message::Negotiate(n) => {
                let mut b = header(NEGOTIATE_HEADER_LEN + DESCRIPTOR_LEN, auth_type::COMMON, auth_id::NEGOTIATE, n.t_id);
                b[6] = n.sc_c;
                b[7] = 1;
                let d = &mut b[NEGOTIATE_HEADER_LEN..];
                let (hashes, groups) = (&n.hash_ids[..n.hash_ids.len().min(HASH_IDS_MAX)], &n.dh_ids[..n.dh_ids.len().min(DH_IDS_MAX)]);
                d[0] = PROTOCOL_DHCHAP;
                d[2] = hashes.len() as u8;
                d[3] = groups.len() as u8;
                d[4..4 + hashes.len()].copy_from_slice(hashes);
                d[4 + HASH_IDS_MAX..4 + HASH_IDS_MAX + groups.len()].copy_from_slice(groups);
                b
            }
            Message::Challenge(c) => {
                let mut b = header(HEADER_LEN, auth_type::DHCHAP, auth_id::CHALLENGE, c.t_id);
                b[6] = c.cval.len() as u8;
                b[8] = c.hash_id;
                b[9] = c.dh_id;
                b[10..12].copy_from_slice(&(c.dhv.len() as u16).to_le_bytes());
                b[12..16].copy_from_slice(&c.seqnum.to_le_bytes());
                b.extend_from_slice(&c.cval);
                b.extend_from_slice(&c.dhv);
                b
            }
            Message::Reply(r) => {
                let mut b = header(HEADER_LEN, auth_type::DHCHAP, auth_id::REPLY, r.t_id);
                b[6] = r.rval.len() as u8;
                b[8] = r.cval.is_some() as u8;
                b[10..12].copy_from_slice(&(r.dhv.len() as u16).to_le_bytes());
                b[12..16].copy_from_slice(&r.seqnum.to_le_bytes());
                b.extend_from_slice(&r.rval);
                match &r.cval {
                    Some(c) => b.extend_from_slice(c),
                    None => b.resize(b.len() + r.rval.len(), 0),
                }
                b.extend_from_slice(&r.dhv);
                b
            }
            Message::Success1 { t_id, hl, rval } => {
                let mut b = header(HEADER_LEN, auth_type::DHCHAP, auth_id::SUCCESS1, *t_id);
                b[6] = *hl;
                if let Some(r) = rval {
                    b[8] = 1;
                    b.extend_from_slice(r);
                }
                b
            }
            Message::Success2 { t_id } => header(HEADER_LEN, auth_type::DHCHAP, auth_id::SUCCESS2, *t_id),
            Message::Failure { t_id, first, reason, explanation } => {
                let id = if *first { auth_id::FAILURE1 } else { auth_id::FAILURE2 };
                let mut b = header(FAILURE_LEN, auth_type::COMMON, id, *t_id);
                b[6] = *reason;
                b[7] = *explanation;
                b
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Message> {
        vec![
            Message::Negotiate(Negotiate { t_id: 3, sc_c: 0, hash_ids: vec![1, 2, 3], dh_ids: vec![0, 1, 2, 3, 4, 5] }),
            Message::Challenge(Challenge { t_id: 3, hash_id: 2, dh_id: 1, seqnum: 9, cval: vec![7; 48], dhv: vec![5; 256] }),
            Message::Reply(Reply { t_id: 3, rval: vec![1; 32], cval: Some(vec![2; 32]), seqnum: 11, dhv: vec![3; 384] }),
            Message::Reply(Reply { t_id: 3, rval: vec![1; 64], cval: None, seqnum: 0, dhv: vec![] }),
            Message::Success1 { t_id: 3, hl: 32, rval: Some(vec![4; 32]) },
            Message::Success1 { t_id: 3, hl: 48, rval: None },
            Message::Success2 { t_id: 3 },
            Message::Failure { t_id: 3, first: true, reason: REASON_FAILED, explanation: explanation::FAILED },
            Message::Failure { t_id: 3, first: false, reason: REASON_FAILED, explanation: explanation::INCORRECT_MESSAGE },
        ]
    }

    /// Every message round-trips, with bytes after it (Receive's allocation length), and
    /// every message cut short anywhere is an incorrect payload, never a panic.
    #[test]
    fn round_trip_and_truncation() {
        for m in all() {
            let mut b = m.encode();
            assert_eq!(Message::decode(&b), Ok(m.clone()));
            for cut in 0..b.len() {
                let got = Message::decode(&b[..cut]);
                assert_eq!(got, Err(Bad(explanation::INCORRECT_PAYLOAD)), "{m:?} cut at {cut}");
            }
            b.extend_from_slice(&[0xaa; 100]);
            assert_eq!(Message::decode(&b), Ok(m));
        }
    }

    /// Fields of a Negotiate and unknown messages, one case a line: (bytes to change, what
    /// decoding gives).
    #[test]
    fn bad_negotiate_and_unknown_messages() {
        let good = all()[0].encode();
        let cases: [(&[(usize, u8)], Bad); 6] = [
            (&[(7, 0)], Bad(explanation::INCORRECT_PAYLOAD)),
            (&[(7, 2)], Bad(explanation::INCORRECT_PAYLOAD)),
            (&[(8, 2)], Bad(explanation::NOT_USABLE)),
            (&[(10, 31)], Bad(explanation::INCORRECT_PAYLOAD)),
            (&[(11, 31)], Bad(explanation::INCORRECT_PAYLOAD)),
            (&[(1, 0x42)], Bad(explanation::INCORRECT_MESSAGE)),
        ];
        for (changes, want) in cases {
            let mut b = good.clone();
            for &(at, v) in changes {
                b[at] = v;
            }
            assert_eq!(Message::decode(&b), Err(want), "{changes:?}");
        }
    }
}
