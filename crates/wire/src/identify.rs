//! Identify data structures (NVMe Base 1.3/2.0, "Identify"): controller, namespace,
//! active namespace list and namespace identification descriptors. All are 4096 bytes.

use crate::bytes::*;

pub const IDENTIFY_LEN: usize = 4096;

/// Controller type (CNTRLTYPE, byte 111).
pub mod cntrltype {
    pub const IO: u8 = 1;
    pub const DISCOVERY: u8 = 2;
}

/// Optional NVM Command Support bits (ONCS).
pub mod oncs {
    pub const COMPARE: u16 = 1 << 0;
    pub const DSM: u16 = 1 << 2;
    pub const WRITE_ZEROES: u16 = 1 << 3;
    /// The Save field of Set Features and the Select field of Get Features.
    pub const SAVE_SELECT: u16 = 1 << 4;
    pub const RESERVATIONS: u16 = 1 << 5;
}

/// Fused Operation Support bits (FUSES, Identify Controller bytes 523:522).
pub mod fuses {
    pub const COMPARE_AND_WRITE: u16 = 1 << 0;
}

/// Controller Attributes bits (CTRATT, Identify Controller bytes 99:96).
pub mod ctratt {
    /// 128-bit Host Identifiers (the only kind NVMe over Fabrics has).
    pub const HOST_ID_128: u32 = 1 << 0;
    /// Reservations and Host Identifier Interaction: reservations need a non-zero Host
    /// Identifier; a host with Host Identifier 0 gets Host Identifier Not Initialized.
    pub const RHII: u32 = 1 << 18;
}

/// Reservation Capabilities of a namespace (RESCAP, Identify Namespace byte 31).
pub mod rescap {
    /// Persist Through Power Loss is supported.
    pub const PTPL: u8 = 1 << 0;
    /// Bits 6:1: the six reservation types.
    pub const ALL_TYPES: u8 = 0x7e;
    /// Ignore Existing Key as NVMe 1.3 and later define it (refused in Acquire and Release).
    pub const IEKEY_1_3: u8 = 1 << 7;
}

/// The fields of Identify Controller that nearstore sets or reads.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct IdentifyController {
    pub vid: u16,
    pub ssvid: u16,
    pub sn: String,
    pub mn: String,
    pub fr: String,
    pub rab: u8,
    pub ieee: [u8; 3],
    /// Multi-path I/O and namespace sharing (bit 1: may have several controllers).
    pub cmic: u8,
    /// Maximum data transfer size, as a power of two of 4 KiB pages (0: no limit).
    pub mdts: u8,
    pub cntlid: u16,
    pub ver: u32,
    /// Optional asynchronous events supported (bit 8: namespace attribute notices).
    pub oaes: u32,
    /// Controller attributes ([`ctratt`]).
    pub ctratt: u32,
    pub cntrltype: u8,
    /// Controller Instance Uniquifier (byte 135; NVMe Base 2.3, "Cross-Controller Reset"):
    /// with the CNTLID and CIRN it names one instance of a controller, as a CNTLID is
    /// reused once its controller is gone.
    pub ciu: u8,
    /// Controller Instance Random Number (bytes 143:136).
    pub cirn: u64,
    pub oacs: u16,
    /// Abort command limit, 0's based.
    pub acl: u8,
    /// Asynchronous event request limit, 0's based.
    pub aerl: u8,
    pub frmw: u8,
    pub lpa: u8,
    /// Error log page entries, 0's based.
    pub elpe: u8,
    /// Warning and critical composite temperature thresholds, in kelvins (0: not reported).
    pub wctemp: u16,
    pub cctemp: u16,
    /// Keep-alive support granularity in 100 ms units.
    pub kas: u16,
    pub sqes: u8,
    pub cqes: u8,
    pub maxcmd: u16,
    pub nn: u32,
    pub oncs: u16,
    /// Fused operations supported ([`fuses`]).
    pub fuses: u16,
    pub vwc: u8,
    pub sgls: u32,
    pub subnqn: String,
    /// I/O queue command capsule size in 16-byte units (64-byte SQE + in-capsule data).
    pub ioccsz: u32,
    /// I/O queue response capsule size in 16-byte units.
    pub iorcsz: u32,
    pub icdoff: u16,
    pub fcatt: u8,
    pub msdbd: u8,
}

impl IdentifyController {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; IDENTIFY_LEN];
        put_u16(&mut b, 0, self.vid);
        put_u16(&mut b, 2, self.ssvid);
        put_str(&mut b, 4, 20, &self.sn, b' ');
        put_str(&mut b, 24, 40, &self.mn, b' ');
        put_str(&mut b, 64, 8, &self.fr, b' ');
        b[72] = self.rab;
        b[73..76].copy_from_slice(&self.ieee);
        b[76] = self.cmic;
        b[77] = self.mdts;
        put_u16(&mut b, 78, self.cntlid);
        put_u32(&mut b, 80, self.ver);
        put_u32(&mut b, 92, self.oaes);
        put_u32(&mut b, 96, self.ctratt);
        b[111] = self.cntrltype;
        b[135] = self.ciu;
        b[136..144].copy_from_slice(&self.cirn.to_le_bytes());
        put_u16(&mut b, 256, self.oacs);
        b[258] = self.acl;
        b[259] = self.aerl;
        b[260] = self.frmw;
        b[261] = self.lpa;
        b[262] = self.elpe;
        put_u16(&mut b, 266, self.wctemp);
        put_u16(&mut b, 268, self.cctemp);
        put_u16(&mut b, 320, self.kas);
        b[512] = self.sqes;
        b[513] = self.cqes;
        put_u16(&mut b, 514, self.maxcmd);
        put_u32(&mut b, 516, self.nn);
        put_u16(&mut b, 520, self.oncs);
        put_u16(&mut b, 522, self.fuses);
        b[525] = self.vwc;
        put_u32(&mut b, 536, self.sgls);
        put_str(&mut b, 768, 256, &self.subnqn, 0);
        put_u32(&mut b, 1792, self.ioccsz);
        put_u32(&mut b, 1796, self.iorcsz);
        put_u16(&mut b, 1800, self.icdoff);
        b[1802] = self.fcatt;
        b[1803] = self.msdbd;
        // Power state 0: maximum power 25.00 W in 0.01 W units.
        put_u16(&mut b, 2048, 2500);
        b
    }

    pub fn decode(b: &[u8]) -> Option<IdentifyController> {
        if b.len() < IDENTIFY_LEN {
            return None;
        }
        let mut ieee = [0u8; 3];
        ieee.copy_from_slice(&b[73..76]);
        Some(IdentifyController {
            vid: u16_at(b, 0),
            ssvid: u16_at(b, 2),
            sn: str_at(b, 4, 20),
            mn: str_at(b, 24, 40),
            fr: str_at(b, 64, 8),
            rab: b[72],
            ieee,
            cmic: b[76],
            mdts: b[77],
            cntlid: u16_at(b, 78),
            ver: u32_at(b, 80),
            oaes: u32_at(b, 92),
            ctratt: u32_at(b, 96),
            cntrltype: b[111],
            ciu: b[135],
            cirn: u64::from_le_bytes(b[136..144].try_into().expect("8 bytes")),
            oacs: u16_at(b, 256),
            acl: b[258],
            aerl: b[259],
            frmw: b[260],
            lpa: b[261],
            elpe: b[262],
            wctemp: u16_at(b, 266),
            cctemp: u16_at(b, 268),
            kas: u16_at(b, 320),
            sqes: b[512],
            cqes: b[513],
            maxcmd: u16_at(b, 514),
            nn: u32_at(b, 516),
            oncs: u16_at(b, 520),
            fuses: u16_at(b, 522),
            vwc: b[525],
            sgls: u32_at(b, 536),
            subnqn: str_at(b, 768, 256),
            ioccsz: u32_at(b, 1792),
            iorcsz: u32_at(b, 1796),
            icdoff: u16_at(b, 1800),
            fcatt: b[1802],
            msdbd: b[1803],
        })
    }

    /// Largest transfer in bytes, or None when unlimited.
    pub fn max_transfer(&self) -> Option<u32> {
        // 4 KiB << 20 and more do not fit: u32::MAX stands for them (any MDTS is valid).
        (self.mdts != 0).then(|| if self.mdts >= 20 { u32::MAX } else { 4096u32 << self.mdts })
    }

    /// Largest in-capsule data for I/O commands.
    pub fn in_capsule_max(&self) -> u32 {
        self.ioccsz.saturating_mul(16).saturating_sub(64)
    }
}

/// The fields of Identify Namespace that nearstore sets or reads.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct IdentifyNamespace {
    pub nsze: u64,
    pub ncap: u64,
    pub nuse: u64,
    /// Bit 0: thin provisioning.
    pub nsfeat: u8,
    /// Deallocate logical block features: bits 2:0 = 1 means a deallocated block reads as zeros;
    /// bit 3: Write Zeroes may deallocate.
    pub dlfeat: u8,
    pub nmic: u8,
    /// Reservation capabilities ([`rescap`]).
    pub rescap: u8,
    pub nguid: [u8; 16],
    pub eui64: [u8; 8],
    /// LBA data size as a power of two (9 for 512 B, 12 for 4 KiB), format 0 only.
    pub lbads: u8,
}

impl IdentifyNamespace {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; IDENTIFY_LEN];
        put_u64(&mut b, 0, self.nsze);
        put_u64(&mut b, 8, self.ncap);
        put_u64(&mut b, 16, self.nuse);
        b[24] = self.nsfeat;
        b[25] = 0; // NLBAF: one format (0's based)
        b[26] = 0; // FLBAS: format 0, no metadata
        b[30] = self.nmic;
        b[31] = self.rescap;
        b[33] = self.dlfeat;
        b[104..120].copy_from_slice(&self.nguid);
        b[120..128].copy_from_slice(&self.eui64);
        // LBAF0: MS=0, LBADS, RP=0 (best performance).
        put_u32(&mut b, 128, (self.lbads as u32) << 16);
        b
    }

    pub fn decode(b: &[u8]) -> Option<IdentifyNamespace> {
        if b.len() < IDENTIFY_LEN {
            return None;
        }
        let flbas = (b[26] & 0xf) as usize;
        let lbaf = u32_at(b, 128 + 4 * flbas);
        let mut nguid = [0u8; 16];
        nguid.copy_from_slice(&b[104..120]);
        let mut eui64 = [0u8; 8];
        eui64.copy_from_slice(&b[120..128]);
        Some(IdentifyNamespace {
            nsze: u64_at(b, 0),
            ncap: u64_at(b, 8),
            nuse: u64_at(b, 16),
            nsfeat: b[24],
            dlfeat: b[33],
            nmic: b[30],
            rescap: b[31],
            nguid,
            eui64,
            lbads: (lbaf >> 16) as u8,
        })
    }

    pub fn block_size(&self) -> u32 {
        1u32.checked_shl(self.lbads as u32).unwrap_or(0)
    }
}

/// The I/O Command Set data structure (CNS 1Ch): 512 combinations of command sets, each a
/// 64-bit vector of CSIs; `combinations[i]` is index i, the rest are zero (none).
pub fn encode_io_command_sets(combinations: &[u64]) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_LEN];
    for (i, v) in combinations.iter().take(IDENTIFY_LEN / 8).enumerate() {
        put_u64(&mut b, i * 8, *v);
    }
    b
}

/// The I/O command set independent Identify Namespace (CNS 08h), the fields nearstore sets.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct IndependentNamespace {
    pub nsfeat: u8,
    pub nmic: u8,
    /// Namespace status, bit 0: the namespace is ready.
    pub nstat: u8,
}

impl IndependentNamespace {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; IDENTIFY_LEN];
        b[0] = self.nsfeat;
        b[1] = self.nmic;
        b[14] = self.nstat;
        b
    }
}

/// Namespace identification descriptor types (CNS 03h).
pub mod nidt {
    pub const EUI64: u8 = 1;
    pub const NGUID: u8 = 2;
    pub const UUID: u8 = 3;
    pub const CSI: u8 = 4;
}

/// Encodes a namespace identification descriptor list.
pub fn encode_ns_descriptors(nguid: &[u8; 16], uuid: &[u8; 16]) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_LEN];
    let mut off = 0;
    for (t, v) in [(nidt::NGUID, &nguid[..]), (nidt::UUID, &uuid[..]), (nidt::CSI, &[0u8][..])] {
        b[off] = t;
        b[off + 1] = v.len() as u8;
        b[off + 4..off + 4 + v.len()].copy_from_slice(v);
        off += 4 + v.len();
    }
    b
}

/// Decodes a namespace identification descriptor list into (type, value) pairs.
/// Stops at the first zero-length descriptor or at a malformed one.
pub fn decode_ns_descriptors(b: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    let mut off = 0;
    while off + 4 <= b.len() {
        let (t, l) = (b[off], b[off + 1] as usize);
        if l == 0 || off + 4 + l > b.len() {
            break;
        }
        out.push((t, b[off + 4..off + 4 + l].to_vec()));
        off += 4 + l;
    }
    out
}

/// Encodes an active namespace id list: ids strictly above `after`, ascending, at most 1024.
pub fn encode_ns_list(ids: impl IntoIterator<Item = u32>, after: u32) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_LEN];
    for (i, id) in ids.into_iter().filter(|&id| id > after).take(IDENTIFY_LEN / 4).enumerate() {
        put_u32(&mut b, i * 4, id);
    }
    b
}

pub fn decode_ns_list(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32_at(c, 0)).take_while(|&id| id != 0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controller_round_trip() {
        let c = IdentifyController {
            sn: "0123456789".into(),
            mn: "nearstore".into(),
            fr: "0.1.0".into(),
            cntlid: 3,
            ciu: 7,
            cirn: 0x0123_4567_89ab_cdef,
            mdts: 5,
            ioccsz: (64 + 16384) / 16,
            subnqn: "nqn.x".into(),
            maxcmd: 128,
            nn: 4,
            ctratt: ctratt::HOST_ID_128 | ctratt::RHII,
            oncs: oncs::COMPARE | oncs::DSM,
            fuses: fuses::COMPARE_AND_WRITE,
            ..Default::default()
        };
        let d = IdentifyController::decode(&c.encode()).unwrap();
        assert_eq!(d, c);
        assert_eq!(d.max_transfer(), Some(128 * 1024));
        assert_eq!(d.in_capsule_max(), 16384);
        // Any MDTS and IOCCSZ a controller reports: no overflow (a shift of 32 and more
        // panicked), the largest values saturate.
        for (mdts, want) in [(0, None), (19, Some(1 << 31)), (20, Some(u32::MAX)), (31, Some(u32::MAX)), (255, Some(u32::MAX))] {
            assert_eq!(IdentifyController { mdts, ..Default::default() }.max_transfer(), want, "MDTS {mdts}");
        }
        for (ioccsz, want) in [(0, 0), (4, 0), (u32::MAX, u32::MAX - 64)] {
            assert_eq!(IdentifyController { ioccsz, ..Default::default() }.in_capsule_max(), want, "IOCCSZ {ioccsz}");
        }
    }

    #[test]
    fn namespace_and_descriptors() {
        let n = IdentifyNamespace { nsze: 1 << 20, ncap: 1 << 20, lbads: 12, nguid: [5; 16], ..Default::default() };
        let d = IdentifyNamespace::decode(&n.encode()).unwrap();
        assert_eq!(d, n);
        assert_eq!(d.block_size(), 4096);
        let descs = decode_ns_descriptors(&encode_ns_descriptors(&[1; 16], &[2; 16]));
        assert_eq!(descs, vec![(nidt::NGUID, vec![1; 16]), (nidt::UUID, vec![2; 16]), (nidt::CSI, vec![0])]);
        assert_eq!(decode_ns_list(&encode_ns_list([1, 2, 5], 1)), vec![2, 5]);
    }
}
