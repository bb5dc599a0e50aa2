//! Submission queue entries (64-byte commands), completion queue entries (16 bytes)
//! and the SGL data-block descriptor that NVMe over Fabrics uses in DPTR.

use crate::bytes::*;
use crate::status::Status;

pub const SQE_LEN: usize = 64;
pub const CQE_LEN: usize = 16;

/// A 64-byte NVMe command, kept as its sixteen dwords.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct Sqe {
    pub dw: [u32; 16],
}

impl std::fmt::Debug for Sqe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Sqe {{ opc {:#04x} cid {} nsid {} cdw10 {:#x} cdw11 {:#x} cdw12 {:#x} sgl {:?} }}",
            self.opcode(),
            self.cid(),
            self.nsid(),
            self.dw[10],
            self.dw[11],
            self.dw[12],
            self.sgl()
        )
    }
}

/// SGL descriptor identifiers (type in bits 7:4, subtype in bits 3:0) used by NVMe/TCP.
pub mod sgl_id {
    /// Data Block, Offset: data sits in the capsule at the given offset.
    pub const IN_CAPSULE: u8 = 0x01;
    /// Transport SGL Data Block, transport specific: data moves in R2T/H2CData or C2HData PDUs.
    pub const TRANSPORT: u8 = 0x5a;
}

/// The SGL descriptor in DPTR (bytes 24..40 of the command).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Sgl {
    pub addr: u64,
    pub len: u32,
    pub id: u8,
}

/// The FUSE field of CDW0 (bits 9:8).
pub mod fuse {
    pub const NORMAL: u8 = 0b00;
    /// The first command of a fused operation (Compare and Write: the Compare).
    pub const FIRST: u8 = 0b01;
    /// The second command of a fused operation (Compare and Write: the Write).
    pub const SECOND: u8 = 0b10;
}

/// PSDT bits in CDW0: SGLs for data (fabrics commands always use SGLs).
pub const PSDT_SGL: u32 = 0b01 << 14;

impl Sqe {
    pub fn new(opcode: u8, cid: u16) -> Sqe {
        let mut s = Sqe::default();
        s.dw[0] = opcode as u32 | PSDT_SGL | ((cid as u32) << 16);
        s
    }

    pub fn decode(b: &[u8]) -> Sqe {
        let mut dw = [0u32; 16];
        for (i, d) in dw.iter_mut().enumerate() {
            *d = u32_at(b, i * 4);
        }
        Sqe { dw }
    }

    pub fn encode(&self, b: &mut [u8]) {
        for (i, d) in self.dw.iter().enumerate() {
            put_u32(b, i * 4, *d);
        }
    }

    pub fn opcode(&self) -> u8 {
        self.dw[0] as u8
    }
    /// FUSE bits (9:8): [`fuse::NORMAL`], or a half of a fused operation.
    pub fn fuse(&self) -> u8 {
        ((self.dw[0] >> 8) & 0x3) as u8
    }
    pub fn set_fuse(&mut self, fuse: u8) -> &mut Self {
        self.dw[0] = (self.dw[0] & !(0x3 << 8)) | ((fuse as u32 & 0x3) << 8);
        self
    }
    pub fn psdt(&self) -> u8 {
        ((self.dw[0] >> 14) & 0x3) as u8
    }
    pub fn cid(&self) -> u16 {
        (self.dw[0] >> 16) as u16
    }
    pub fn set_cid(&mut self, cid: u16) {
        self.dw[0] = (self.dw[0] & 0xffff) | ((cid as u32) << 16);
    }
    pub fn nsid(&self) -> u32 {
        self.dw[1]
    }
    pub fn set_nsid(&mut self, nsid: u32) -> &mut Self {
        self.dw[1] = nsid;
        self
    }
    /// Fabrics command type (byte 4), meaningful when the opcode is 7Fh.
    pub fn fctype(&self) -> u8 {
        self.dw[1] as u8
    }
    pub fn sgl(&self) -> Sgl {
        Sgl { addr: self.dw[6] as u64 | ((self.dw[7] as u64) << 32), len: self.dw[8], id: (self.dw[9] >> 24) as u8 }
    }
    pub fn set_sgl(&mut self, sgl: Sgl) -> &mut Self {
        self.dw[6] = sgl.addr as u32;
        self.dw[7] = (sgl.addr >> 32) as u32;
        self.dw[8] = sgl.len;
        self.dw[9] = (sgl.id as u32) << 24;
        self
    }
    pub fn cdw(&self, n: usize) -> u32 {
        self.dw[n]
    }
    pub fn set_cdw(&mut self, n: usize, v: u32) -> &mut Self {
        self.dw[n] = v;
        self
    }
    /// Starting LBA of Read, Write, Write Zeroes (CDW10-11).
    pub fn slba(&self) -> u64 {
        self.dw[10] as u64 | ((self.dw[11] as u64) << 32)
    }
    pub fn set_slba(&mut self, slba: u64) -> &mut Self {
        self.dw[10] = slba as u32;
        self.dw[11] = (slba >> 32) as u32;
        self
    }
    /// Number of logical blocks, converted from the 0's based field (CDW12 bits 15:0).
    pub fn nlb(&self) -> u32 {
        (self.dw[12] & 0xffff) + 1
    }
    /// Force Unit Access (CDW12 bit 30).
    pub fn fua(&self) -> bool {
        self.dw[12] & (1 << 30) != 0
    }

    /// A Read or Write of `nlb` blocks (1-based) at `slba`.
    pub fn rw(opcode: u8, nsid: u32, slba: u64, nlb: u32, fua: bool) -> Sqe {
        let mut s = Sqe::new(opcode, 0);
        s.set_nsid(nsid).set_slba(slba);
        s.dw[12] = (nlb - 1) | ((fua as u32) << 30);
        s
    }
}

/// A completion queue entry.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Cqe {
    pub dw0: u32,
    pub dw1: u32,
    pub sqhd: u16,
    pub sqid: u16,
    pub cid: u16,
    pub status: Status,
}

impl Cqe {
    pub fn decode(b: &[u8]) -> Cqe {
        Cqe {
            dw0: u32_at(b, 0),
            dw1: u32_at(b, 4),
            sqhd: u16_at(b, 8),
            sqid: u16_at(b, 10),
            cid: u16_at(b, 12),
            status: Status::from_field(u16_at(b, 14)),
        }
    }

    pub fn encode(&self, b: &mut [u8]) {
        put_u32(b, 0, self.dw0);
        put_u32(b, 4, self.dw1);
        put_u16(b, 8, self.sqhd);
        put_u16(b, 10, self.sqid);
        put_u16(b, 12, self.cid);
        put_u16(b, 14, self.status.to_field());
    }

    /// DW0 and DW1 as the 64-bit result of a Property Get.
    pub fn result64(&self) -> u64 {
        self.dw0 as u64 | ((self.dw1 as u64) << 32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqe_fields() {
        let mut s = Sqe::rw(0x02, 1, 0x1_0000_0002, 8, true);
        s.set_cid(0xbeef);
        s.set_sgl(Sgl { addr: 0, len: 4096, id: sgl_id::TRANSPORT });
        let mut b = [0u8; 64];
        s.encode(&mut b);
        assert_eq!(b[0], 0x02);
        assert_eq!(&b[2..4], &0xbeefu16.to_le_bytes());
        assert_eq!(b[39], 0x5a);
        let d = Sqe::decode(&b);
        assert_eq!(d, s);
        assert_eq!((d.slba(), d.nlb(), d.fua(), d.cid(), d.nsid()), (0x1_0000_0002, 8, true, 0xbeef, 1));
        assert_eq!(d.sgl().len, 4096);
    }
}
