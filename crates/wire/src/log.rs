//! Log pages: discovery log, error information, SMART / health, firmware slot.

use crate::bytes::*;

/// Get Log Page command fields.
pub mod get_log {
    use crate::sqe::Sqe;
    pub fn lid(s: &Sqe) -> u8 {
        s.cdw(10) as u8
    }
    pub fn lsp(s: &Sqe) -> u8 {
        ((s.cdw(10) >> 8) & 0x7f) as u8
    }
    /// Retain Asynchronous Event.
    pub fn rae(s: &Sqe) -> bool {
        s.cdw(10) & (1 << 15) != 0
    }
    /// Number of bytes asked: (NUMDU:NUMDL + 1) dwords.
    pub fn len(s: &Sqe) -> u64 {
        let numd = ((s.cdw(10) >> 16) as u64) | (((s.cdw(11) & 0xffff) as u64) << 16);
        (numd + 1) * 4
    }
    pub fn offset(s: &Sqe) -> u64 {
        s.cdw(12) as u64 | ((s.cdw(13) as u64) << 32)
    }
    /// Sets LID, NUMD, LPO for a read of `len` bytes at `offset`.
    pub fn build(s: &mut Sqe, lid: u8, len: u32, offset: u64) {
        let numd = len / 4 - 1;
        s.set_cdw(10, lid as u32 | ((numd & 0xffff) << 16));
        s.set_cdw(11, numd >> 16);
        s.set_cdw(12, offset as u32);
        s.set_cdw(13, (offset >> 32) as u32);
    }
}

pub const DISCOVERY_HEADER_LEN: usize = 1024;
pub const DISCOVERY_ENTRY_LEN: usize = 1024;

/// Transport types, address families and subsystem types of discovery entries.
pub mod disc {
    pub const TRTYPE_TCP: u8 = 3;
    pub const ADRFAM_IPV4: u8 = 1;
    pub const ADRFAM_IPV6: u8 = 2;
    pub const SUBTYPE_DISCOVERY: u8 = 1;
    pub const SUBTYPE_NVME: u8 = 2;
    pub const SUBTYPE_CURRENT_DISCOVERY: u8 = 3;
    /// TREQ: secure channel not required.
    pub const TREQ_NOT_REQUIRED: u8 = 0x02;
    /// TREQ: the controller supports disabling SQ flow control.
    pub const TREQ_DISABLE_SQFLOW: u8 = 0x04;
}

/// One discovery log page entry.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct DiscoveryEntry {
    pub trtype: u8,
    pub adrfam: u8,
    pub subtype: u8,
    pub treq: u8,
    pub portid: u16,
    pub cntlid: u16,
    pub asqsz: u16,
    pub trsvcid: String,
    pub subnqn: String,
    pub traddr: String,
    /// TCP SECTYPE (byte 0 of TSAS): 0 is none.
    pub sectype: u8,
}

impl DiscoveryEntry {
    pub fn encode_into(&self, b: &mut [u8]) {
        b[0] = self.trtype;
        b[1] = self.adrfam;
        b[2] = self.subtype;
        b[3] = self.treq;
        put_u16(b, 4, self.portid);
        put_u16(b, 6, self.cntlid);
        put_u16(b, 8, self.asqsz);
        put_str(b, 32, 32, &self.trsvcid, 0);
        put_str(b, 256, 256, &self.subnqn, 0);
        put_str(b, 512, 256, &self.traddr, 0);
        b[768] = self.sectype;
    }

    pub fn decode(b: &[u8]) -> DiscoveryEntry {
        DiscoveryEntry {
            trtype: b[0],
            adrfam: b[1],
            subtype: b[2],
            treq: b[3],
            portid: u16_at(b, 4),
            cntlid: u16_at(b, 6),
            asqsz: u16_at(b, 8),
            trsvcid: str_at(b, 32, 32),
            subnqn: str_at(b, 256, 256),
            traddr: str_at(b, 512, 256),
            sectype: b[768],
        }
    }
}

/// Encodes a whole discovery log page: header then entries.
pub fn encode_discovery_log(genctr: u64, entries: &[DiscoveryEntry]) -> Vec<u8> {
    let mut b = vec![0u8; DISCOVERY_HEADER_LEN + entries.len() * DISCOVERY_ENTRY_LEN];
    put_u64(&mut b, 0, genctr);
    put_u64(&mut b, 8, entries.len() as u64);
    put_u16(&mut b, 16, 0);
    for (i, e) in entries.iter().enumerate() {
        let off = DISCOVERY_HEADER_LEN + i * DISCOVERY_ENTRY_LEN;
        e.encode_into(&mut b[off..off + DISCOVERY_ENTRY_LEN]);
    }
    b
}

/// Decodes a discovery log page; entries beyond the bytes given are left out.
pub fn decode_discovery_log(b: &[u8]) -> Option<(u64, Vec<DiscoveryEntry>)> {
    if b.len() < DISCOVERY_HEADER_LEN {
        return None;
    }
    let n = u64_at(b, 8) as usize;
    let entries = (0..n)
        .map(|i| DISCOVERY_HEADER_LEN + i * DISCOVERY_ENTRY_LEN)
        .take_while(|off| off + DISCOVERY_ENTRY_LEN <= b.len())
        .map(|off| DiscoveryEntry::decode(&b[off..off + DISCOVERY_ENTRY_LEN]))
        .collect();
    Some((u64_at(b, 0), entries))
}

pub const ERROR_ENTRY_LEN: usize = 64;

/// One Error Information log entry.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct ErrorEntry {
    pub error_count: u64,
    pub sqid: u16,
    pub cid: u16,
    pub status: u16,
    /// Byte and bit of the command field in error: byte in bits 7:0, bit in 10:8.
    pub param_loc: u16,
    pub lba: u64,
    pub nsid: u32,
}

impl ErrorEntry {
    pub fn encode_into(&self, b: &mut [u8]) {
        put_u64(b, 0, self.error_count);
        put_u16(b, 8, self.sqid);
        put_u16(b, 10, self.cid);
        put_u16(b, 12, self.status);
        put_u16(b, 14, self.param_loc);
        put_u64(b, 16, self.lba);
        put_u32(b, 24, self.nsid);
        b[29] = disc::TRTYPE_TCP;
    }
    pub fn decode(b: &[u8]) -> ErrorEntry {
        ErrorEntry {
            error_count: u64_at(b, 0),
            sqid: u16_at(b, 8),
            cid: u16_at(b, 10),
            status: u16_at(b, 12),
            param_loc: u16_at(b, 14),
            lba: u64_at(b, 16),
            nsid: u32_at(b, 24),
        }
    }
}

pub const SMART_LEN: usize = 512;

/// SMART / Health log counters nearstore reports.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Smart {
    pub critical_warning: u8,
    /// Kelvin.
    pub temperature: u16,
    pub available_spare: u8,
    pub spare_threshold: u8,
    pub percentage_used: u8,
    /// Thousands of 512-byte units, rounded up, as the specification counts them.
    pub data_units_read: u128,
    pub data_units_written: u128,
    pub host_reads: u128,
    pub host_writes: u128,
    pub power_on_hours: u128,
    pub media_errors: u128,
    pub error_log_entries: u128,
}

fn put_u128(b: &mut [u8], off: usize, v: u128) {
    b[off..off + 16].copy_from_slice(&v.to_le_bytes());
}
fn u128_at(b: &[u8], off: usize) -> u128 {
    u128::from_le_bytes(b[off..off + 16].try_into().expect("16 bytes"))
}

impl Smart {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; SMART_LEN];
        b[0] = self.critical_warning;
        put_u16(&mut b, 1, self.temperature);
        b[3] = self.available_spare;
        b[4] = self.spare_threshold;
        b[5] = self.percentage_used;
        put_u128(&mut b, 32, self.data_units_read);
        put_u128(&mut b, 48, self.data_units_written);
        put_u128(&mut b, 64, self.host_reads);
        put_u128(&mut b, 80, self.host_writes);
        put_u128(&mut b, 128, self.power_on_hours);
        put_u128(&mut b, 160, self.media_errors);
        put_u128(&mut b, 176, self.error_log_entries);
        b
    }
    pub fn decode(b: &[u8]) -> Smart {
        Smart {
            critical_warning: b[0],
            temperature: u16_at(b, 1),
            available_spare: b[3],
            spare_threshold: b[4],
            percentage_used: b[5],
            data_units_read: u128_at(b, 32),
            data_units_written: u128_at(b, 48),
            host_reads: u128_at(b, 64),
            host_writes: u128_at(b, 80),
            power_on_hours: u128_at(b, 128),
            media_errors: u128_at(b, 160),
            error_log_entries: u128_at(b, 176),
        }
    }
    /// Bytes to data units: thousands of 512-byte units, rounded up.
    pub fn data_units(bytes: u64) -> u128 {
        (bytes as u128 / 512).div_ceil(1000)
    }
}

pub const FIRMWARE_SLOT_LEN: usize = 512;

/// Firmware slot log: slot 1 active, holding `revision`.
pub fn encode_firmware_slot(revision: &str) -> Vec<u8> {
    let mut b = vec![0u8; FIRMWARE_SLOT_LEN];
    b[0] = 1;
    put_str(&mut b, 8, 8, revision, b' ');
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovery_round_trip() {
        let e = DiscoveryEntry {
            trtype: disc::TRTYPE_TCP,
            adrfam: disc::ADRFAM_IPV4,
            subtype: disc::SUBTYPE_NVME,
            treq: disc::TREQ_NOT_REQUIRED,
            portid: 1,
            cntlid: 0xffff,
            asqsz: 32,
            trsvcid: "4420".into(),
            subnqn: "nqn.a".into(),
            traddr: "127.0.0.1".into(),
            sectype: 0,
        };
        let b = encode_discovery_log(9, &[e.clone(), e.clone()]);
        assert_eq!(decode_discovery_log(&b).unwrap(), (9, vec![e.clone(), e]));
        // Only the header: entries cut off, count still readable.
        assert_eq!(decode_discovery_log(&b[..1024]).unwrap().1.len(), 0);
    }

    #[test]
    fn smart_round_trip() {
        let s = Smart { data_units_read: Smart::data_units(512_512), host_reads: 3, temperature: 300, ..Default::default() };
        assert_eq!(Smart::decode(&s.encode()), s);
        assert_eq!(Smart::data_units(512_512), 2);
    }
}
