//! NVMe over Fabrics: Connect data, properties and their register layouts.

use crate::bytes::*;

/// Size of the Connect command's data (host id, controller id, NQNs).
pub const CONNECT_DATA_LEN: usize = 1024;

/// Where the nearstore extension puts the NQN of the host a connection acts for: the
/// last 256 bytes of the Connect data, reserved by the NVMe over Fabrics specification
/// (a standard initiator leaves them zero). Same format as HOSTNQN (UTF-8, NUL-padded).
pub const ACTING_FOR_OFFSET: usize = 768;
pub const ACTING_FOR_LEN: usize = 256;

/// The Connect command's data.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct ConnectData {
    pub hostid: [u8; 16],
    /// FFFFh requests any controller (dynamic model) on the admin queue; for an I/O
    /// queue it names the controller the admin queue was given.
    pub cntlid: u16,
    pub subnqn: String,
    pub hostnqn: String,
    /// nearstore extension: the host this connection acts for (a cluster member reading
    /// a peer for a host's compute command), or None (bytes 768.. zero): the host acts
    /// for itself. docs/compute-protocol.md "Acting for a host".
    pub acting_for: Option<String>,
}

impl ConnectData {
    pub fn decode(b: &[u8]) -> Option<ConnectData> {
        if b.len() < CONNECT_DATA_LEN {
            return None;
        }
        let mut hostid = [0u8; 16];
        hostid.copy_from_slice(&b[0..16]);
        let acting_for = (b[ACTING_FOR_OFFSET] != 0).then(|| str_at(b, ACTING_FOR_OFFSET, ACTING_FOR_LEN));
        Some(ConnectData { hostid, cntlid: u16_at(b, 16), subnqn: str_at(b, 256, 256), hostnqn: str_at(b, 512, 256), acting_for })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; CONNECT_DATA_LEN];
        b[0..16].copy_from_slice(&self.hostid);
        put_u16(&mut b, 16, self.cntlid);
        put_str(&mut b, 256, 256, &self.subnqn, 0);
        put_str(&mut b, 512, 256, &self.hostnqn, 0);
        if let Some(h) = &self.acting_for {
            put_str(&mut b, ACTING_FOR_OFFSET, ACTING_FOR_LEN, h, 0);
        }
        b
    }
}

/// Connect command fields in the SQE.
pub mod connect {
    /// CDW10 bits 15:0: record format, 0.
    pub fn recfmt(cdw10: u32) -> u16 {
        cdw10 as u16
    }
    /// CDW10 bits 31:16: queue id, 0 for the admin queue.
    pub fn qid(cdw10: u32) -> u16 {
        (cdw10 >> 16) as u16
    }
    /// CDW11 bits 15:0: submission queue size, 0's based.
    pub fn sqsize(cdw11: u32) -> u16 {
        cdw11 as u16
    }
    /// CDW11 bits 23:16: connect attributes. Bit 2: SQ flow control disable.
    pub fn cattr(cdw11: u32) -> u8 {
        (cdw11 >> 16) as u8
    }
    pub const CATTR_DISABLE_SQFLOW: u8 = 0x04;
    /// CDW12: keep-alive timeout in milliseconds (admin queue only).
    pub fn kato(cdw12: u32) -> u32 {
        cdw12
    }
    /// Connect-response DW0 for Connect Invalid Parameters: IATTR bit 0 set means the
    /// invalid parameter is in the data; IPO (bits 31:16) is its byte offset.
    pub fn invalid_param(in_data: bool, offset: u16) -> u32 {
        in_data as u32 | ((offset as u32) << 16)
    }
    /// Connect-response DW1 (reserved by the specification, zero) of a nearstore target
    /// that admitted a connection acting for a host (Connect data bytes 768..): it
    /// checked that host against the subsystem's allow-list and the connecting host
    /// against its trusted cluster members. An initiator that named a host and gets
    /// anything else back talks to a target that ignored the name and must not use the
    /// connection for that host. "NSAF" little-endian.
    pub const ACTING_FOR_CONFIRMED: u32 = u32::from_le_bytes(*b"NSAF");
    /// Connect-response DW0 bit 17, AUTHREQ.ATR: the host must authenticate this queue
    /// (DH-HMAC-CHAP) before other commands. Bit 18 (ASCR, a secure channel too) is never set.
    pub const AUTHREQ_ATR: u32 = 1 << 17;
}

/// Property offsets (NVMe Base, "Controller Properties").
pub mod prop {
    pub const CAP: u32 = 0x00;
    pub const VS: u32 = 0x08;
    pub const CC: u32 = 0x14;
    pub const CSTS: u32 = 0x1c;
    pub const NSSR: u32 = 0x20;
}

/// Controller Capabilities.
pub mod cap {
    /// CSS bit 0: the NVM command set.
    pub const CSS_NVM: u64 = 1 << 37;
    /// CSS bit 6: one or more I/O command sets, selected with CC.CSS = 110b.
    pub const CSS_IO_COMMAND_SETS: u64 = 1 << 43;
    /// Builds CAP: MQES (0's based), CQR set, TO in 500 ms units, the NVM command set
    /// alone or among all supported I/O command sets, memory page size 4 KiB.
    pub fn build(mqes: u16, timeout_500ms: u8) -> u64 {
        mqes as u64 | (1 << 16) | ((timeout_500ms as u64) << 24) | CSS_NVM | CSS_IO_COMMAND_SETS
    }
    pub fn mqes(cap: u64) -> u16 {
        cap as u16
    }
    pub fn timeout_ms(cap: u64) -> u64 {
        ((cap >> 24) & 0xff) * 500
    }
}

/// Controller Configuration.
pub mod cc {
    pub const EN: u32 = 1;
    pub fn shn(cc: u32) -> u32 {
        (cc >> 14) & 0x3
    }
    pub fn iosqes(cc: u32) -> u32 {
        (cc >> 16) & 0xf
    }
    pub fn iocqes(cc: u32) -> u32 {
        (cc >> 20) & 0xf
    }
    pub fn mps(cc: u32) -> u32 {
        (cc >> 7) & 0xf
    }
    pub fn css(cc: u32) -> u32 {
        (cc >> 4) & 0x7
    }
    /// CSS 000b: the NVM command set.
    pub const CSS_NVM: u32 = 0b000;
    /// CSS 110b: all I/O command sets that CAP.CSS bit 6 says are supported.
    pub const CSS_ALL_IO_COMMAND_SETS: u32 = 0b110;
    /// What the Linux host writes to enable: EN, IOSQES=6, IOCQES=4.
    pub const LINUX_ENABLE: u32 = EN | (6 << 16) | (4 << 20);
    pub const SHN_NORMAL: u32 = 1 << 14;
}

/// Controller Status.
pub mod csts {
    pub const RDY: u32 = 1;
    pub const CFS: u32 = 1 << 1;
    pub const SHST_OCCURRING: u32 = 1 << 2;
    pub const SHST_COMPLETE: u32 = 2 << 2;
}

/// NVMe version 1.3.0, the level whose features nearstore implements (see docs/protocol.md).
pub const VERSION_1_3: u32 = 0x0001_0300;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_data_round_trip() {
        let d = ConnectData {
            hostid: [7; 16],
            cntlid: 0xffff,
            subnqn: "nqn.2026-11.io.nearstore:disk0".into(),
            hostnqn: "nqn.2014-08.org.nvmexpress:uuid:1234".into(),
            acting_for: None,
        };
        assert_eq!(ConnectData::decode(&d.encode()).unwrap(), d);
        assert!(d.encode()[ACTING_FOR_OFFSET..].iter().all(|&b| b == 0), "a host acting for itself leaves the reserved bytes zero");
        let delegated = ConnectData { acting_for: Some("nqn.2026-11.io.nearstore:h".into()), ..d };
        let b = delegated.encode();
        assert_eq!(&b[ACTING_FOR_OFFSET..ACTING_FOR_OFFSET + 26], b"nqn.2026-11.io.nearstore:h");
        assert_eq!(ConnectData::decode(&b).unwrap(), delegated);
        assert!(ConnectData::decode(&[0u8; 100]).is_none());
    }
}
