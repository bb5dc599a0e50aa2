//! Reservations (NVMe Base 2.0, "Reservations"; NVM Command Set, "Reservation Register /
//! Report / Acquire / Release"): the fields of the commands, the data the host sends, the
//! Reservation Status extended data structure and the Reservation Notification log page.

use crate::bytes::*;

/// A reservation type (RTYPE).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Rtype {
    WriteExclusive = 1,
    ExclusiveAccess = 2,
    WriteExclusiveRegistrantsOnly = 3,
    ExclusiveAccessRegistrantsOnly = 4,
    WriteExclusiveAllRegistrants = 5,
    ExclusiveAccessAllRegistrants = 6,
}

impl Rtype {
    pub const ALL: [Rtype; 6] = [
        Rtype::WriteExclusive,
        Rtype::ExclusiveAccess,
        Rtype::WriteExclusiveRegistrantsOnly,
        Rtype::ExclusiveAccessRegistrantsOnly,
        Rtype::WriteExclusiveAllRegistrants,
        Rtype::ExclusiveAccessAllRegistrants,
    ];

    pub fn from_u8(v: u8) -> Option<Rtype> {
        Rtype::ALL.get((v as usize).checked_sub(1)?).copied()
    }

    /// Every registrant holds the reservation.
    pub fn all_registrants(self) -> bool {
        matches!(self, Rtype::WriteExclusiveAllRegistrants | Rtype::ExclusiveAccessAllRegistrants)
    }

    /// Reads are reserved as well as writes.
    pub fn exclusive_access(self) -> bool {
        matches!(self, Rtype::ExclusiveAccess | Rtype::ExclusiveAccessRegistrantsOnly | Rtype::ExclusiveAccessAllRegistrants)
    }

    /// Registrants other than the holder have access (Registrants Only and All Registrants).
    pub fn registrants_have_access(self) -> bool {
        !matches!(self, Rtype::WriteExclusive | Rtype::ExclusiveAccess)
    }
}

/// Reservation Register action (RREGA, CDW10 bits 2:0).
pub mod rrega {
    pub const REGISTER: u8 = 0;
    pub const UNREGISTER: u8 = 1;
    pub const REPLACE: u8 = 2;
}

/// Reservation Acquire action (RACQA, CDW10 bits 2:0).
pub mod racqa {
    pub const ACQUIRE: u8 = 0;
    pub const PREEMPT: u8 = 1;
    pub const PREEMPT_AND_ABORT: u8 = 2;
}

/// Reservation Release action (RRELA, CDW10 bits 2:0).
pub mod rrela {
    pub const RELEASE: u8 = 0;
    pub const CLEAR: u8 = 1;
}

/// Change Persist Through Power Loss State (CPTPL, Register CDW10 bits 31:30).
pub mod cptpl {
    pub const NO_CHANGE: u8 = 0;
    pub const CLEAR: u8 = 2;
    pub const SET: u8 = 3;
}

/// The CDW10 of the reservation commands: action in bits 2:0, Ignore Existing Key in bit 3,
/// the reservation type in bits 15:8 (Acquire, Release), CPTPL in bits 31:30 (Register).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Cdw10 {
    pub action: u8,
    pub iekey: bool,
    pub rtype: u8,
    pub cptpl: u8,
}

impl Cdw10 {
    pub fn decode(v: u32) -> Cdw10 {
        Cdw10 { action: (v & 0x7) as u8, iekey: v & (1 << 3) != 0, rtype: (v >> 8) as u8, cptpl: (v >> 30) as u8 }
    }

    pub fn encode(&self) -> u32 {
        (self.action & 0x7) as u32 | ((self.iekey as u32) << 3) | ((self.rtype as u32) << 8) | (((self.cptpl & 0x3) as u32) << 30)
    }
}

/// Reservation Report CDW11 bit 0: the extended data structure (128-bit Host Identifiers).
pub const REPORT_EDS: u32 = 1;

/// Bytes of the Register and Acquire data (CRKEY, then NRKEY or PRKEY).
pub const KEYS_LEN: usize = 16;
/// Bytes of the Release data (CRKEY).
pub const RELEASE_DATA_LEN: usize = 8;

/// The keys a reservation command carries: the current key (CRKEY) and the new key (NRKEY,
/// Register) or the preempt key (PRKEY, Acquire); Release carries only the current key.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Keys {
    pub current: u64,
    pub other: u64,
}

impl Keys {
    /// Decodes `len` bytes (KEYS_LEN or RELEASE_DATA_LEN); None if `b` is shorter.
    pub fn decode(b: &[u8], len: usize) -> Option<Keys> {
        if b.len() < len || len < RELEASE_DATA_LEN {
            return None;
        }
        let other = if len >= KEYS_LEN { u64_at(b, 8) } else { 0 };
        Some(Keys { current: u64_at(b, 0), other })
    }

    pub fn encode(&self) -> [u8; KEYS_LEN] {
        let mut b = [0u8; KEYS_LEN];
        put_u64(&mut b, 0, self.current);
        put_u64(&mut b, 8, self.other);
        b
    }
}

/// Header of the Reservation Status extended data structure.
pub const STATUS_EXT_HEADER_LEN: usize = 64;
/// One Registered Controller extended data structure.
pub const REGISTRANT_EXT_LEN: usize = 64;
/// CNTLID of a registrant not tied to one controller (dynamic controller model).
pub const CNTLID_DYNAMIC: u16 = 0xffff;

/// One registrant as Reservation Report shows it.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Registrant {
    pub cntlid: u16,
    /// RCSTS bit 0: this registrant holds the reservation.
    pub holder: bool,
    pub hostid: [u8; 16],
    pub rkey: u64,
}

/// The Reservation Status extended data structure (Reservation Report with EDS set).
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct ReservationStatus {
    pub generation: u32,
    /// The reservation type, 0 when there is no reservation.
    pub rtype: u8,
    /// Registrants in all (REGCTL); `registrants` holds those that fit the transfer.
    pub regctl: u16,
    /// Persist Through Power Loss State.
    pub ptpls: bool,
    pub registrants: Vec<Registrant>,
}

impl ReservationStatus {
    /// Bytes needed for the whole structure.
    pub fn encoded_len(&self) -> usize {
        STATUS_EXT_HEADER_LEN + self.registrants.len() * REGISTRANT_EXT_LEN
    }

    /// Encodes into exactly `len` bytes: truncated when the host asked for fewer, zeros after.
    pub fn encode(&self, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; self.encoded_len().max(len)];
        put_u32(&mut b, 0, self.generation);
        b[4] = self.rtype;
        put_u16(&mut b, 5, self.regctl);
        b[9] = self.ptpls as u8;
        for (i, r) in self.registrants.iter().enumerate() {
            let o = STATUS_EXT_HEADER_LEN + i * REGISTRANT_EXT_LEN;
            put_u16(&mut b, o, r.cntlid);
            b[o + 2] = r.holder as u8;
            put_u64(&mut b, o + 8, r.rkey);
            b[o + 16..o + 32].copy_from_slice(&r.hostid);
        }
        b.truncate(len);
        b
    }

    /// Decodes what a transfer holds: REGCTL entries or as many as fit.
    pub fn decode(b: &[u8]) -> Option<ReservationStatus> {
        if b.len() < STATUS_EXT_HEADER_LEN {
            return None;
        }
        let regctl = u16_at(b, 5);
        let fit = (b.len() - STATUS_EXT_HEADER_LEN) / REGISTRANT_EXT_LEN;
        let registrants = (0..(regctl as usize).min(fit))
            .map(|i| {
                let o = STATUS_EXT_HEADER_LEN + i * REGISTRANT_EXT_LEN;
                let mut hostid = [0u8; 16];
                hostid.copy_from_slice(&b[o + 16..o + 32]);
                Registrant { cntlid: u16_at(b, o), holder: b[o + 2] & 1 != 0, hostid, rkey: u64_at(b, o + 8) }
            })
            .collect();
        Some(ReservationStatus { generation: u32_at(b, 0), rtype: b[4], regctl, ptpls: b[9] & 1 != 0, registrants })
    }
}

/// Reservation Notification log page types.
pub mod notice {
    pub const EMPTY: u8 = 0;
    pub const REGISTRATION_PREEMPTED: u8 = 1;
    pub const RESERVATION_RELEASED: u8 = 2;
    pub const RESERVATION_PREEMPTED: u8 = 3;
}

/// Bytes of the Reservation Notification log page (80h).
pub const NOTICE_LOG_LEN: usize = 64;

/// The asynchronous event for it: type 110b (I/O command specific status), information
/// 00h (Reservation Log Page Available), log page 80h.
pub const AEN_RESERVATION_LOG: u32 = 0x6 | (0x80 << 16);

/// The Reservation Notification log page.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct NoticeLog {
    /// Log Page Count: 0 for an empty page; a gap means pages were lost.
    pub count: u64,
    pub kind: u8,
    /// Number of Available Log Pages after this one.
    pub available: u8,
    pub nsid: u32,
}

impl NoticeLog {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; NOTICE_LOG_LEN];
        put_u64(&mut b, 0, self.count);
        b[8] = self.kind;
        b[9] = self.available;
        put_u32(&mut b, 12, self.nsid);
        b
    }

    pub fn decode(b: &[u8]) -> Option<NoticeLog> {
        if b.len() < NOTICE_LOG_LEN {
            return None;
        }
        Some(NoticeLog { count: u64_at(b, 0), kind: b[8], available: b[9], nsid: u32_at(b, 12) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdw10_fields() {
        // Acquire, preempt, Exclusive Access: RACQA 1, RTYPE 2 in bits 15:8.
        assert_eq!(Cdw10 { action: 1, rtype: 2, ..Default::default() }.encode(), 0x0201);
        // Register with IEKEY and CPTPL = 11b.
        assert_eq!(Cdw10 { action: 0, iekey: true, cptpl: 3, rtype: 0 }.encode(), 0xc000_0008);
        for v in [0u32, 0x0201, 0xc000_0008, 0x8000_0602] {
            assert_eq!(Cdw10::decode(v).encode(), v);
        }
    }

    #[test]
    fn rtype_values() {
        assert_eq!(Rtype::from_u8(0), None);
        assert_eq!(Rtype::from_u8(7), None);
        for t in Rtype::ALL {
            assert_eq!(Rtype::from_u8(t as u8), Some(t));
        }
    }

    #[test]
    fn status_layout_and_truncation() {
        let s = ReservationStatus {
            generation: 7,
            rtype: 3,
            regctl: 2,
            ptpls: true,
            registrants: vec![
                Registrant { cntlid: CNTLID_DYNAMIC, holder: true, hostid: [1; 16], rkey: 0xaa },
                Registrant { cntlid: CNTLID_DYNAMIC, holder: false, hostid: [2; 16], rkey: 0xbb },
            ],
        };
        let b = s.encode(s.encoded_len());
        assert_eq!(b.len(), 192);
        assert_eq!((b[4], b[5], b[9]), (3, 2, 1));
        assert_eq!((b[64], b[65], b[66]), (0xff, 0xff, 1));
        assert_eq!(b[72], 0xaa);
        assert_eq!(&b[80..96], &[1; 16]);
        assert_eq!(ReservationStatus::decode(&b), Some(s.clone()));
        // A transfer that holds only the header and one registrant: REGCTL still says 2.
        let short = ReservationStatus::decode(&s.encode(128)).unwrap();
        assert_eq!((short.regctl, short.registrants.len()), (2, 1));
        assert_eq!(s.encode(256).len(), 256);
        assert_eq!(ReservationStatus::decode(&b[..63]), None);
    }

    #[test]
    fn notice_log_layout() {
        let n = NoticeLog { count: 5, kind: notice::RESERVATION_RELEASED, available: 2, nsid: 9 };
        let b = n.encode();
        assert_eq!((b[0], b[8], b[9], b[12]), (5, 2, 2, 9));
        assert_eq!(NoticeLog::decode(&b), Some(n));
        assert_eq!(NoticeLog::decode(&b[..10]), None);
    }

    #[test]
    fn keys() {
        let k = Keys { current: 1, other: 2 };
        assert_eq!(Keys::decode(&k.encode(), KEYS_LEN), Some(k));
        assert_eq!(Keys::decode(&k.encode(), RELEASE_DATA_LEN), Some(Keys { current: 1, other: 0 }));
        assert_eq!(Keys::decode(&[0; 7], RELEASE_DATA_LEN), None);
        assert_eq!(Keys::decode(&[0; 8], KEYS_LEN), None);
    }
}
