//! NVMe completion status: Status Code Type (SCT) and Status Code (SC).

use std::fmt;

/// A completion status as carried in bits 15:1 of CQE dword 3 (the phase bit excluded).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Status {
    pub sct: u8,
    pub sc: u8,
    /// Do Not Retry.
    pub dnr: bool,
}

pub mod sct {
    pub const GENERIC: u8 = 0;
    pub const COMMAND_SPECIFIC: u8 = 1;
    pub const MEDIA: u8 = 2;
}

macro_rules! statuses {
    ($($(#[$m:meta])* $name:ident = ($sct:expr, $sc:expr);)*) => {
        impl Status {
            $($(#[$m])* pub const $name: Status = Status { sct: $sct, sc: $sc, dnr: false };)*
        }
        fn name_of(s: Status) -> Option<&'static str> {
            $(if s.sct == $sct && s.sc == $sc { return Some(stringify!($name)); })*
            None
        }
    };
}

statuses! {
    SUCCESS = (0, 0x00);
    INVALID_OPCODE = (0, 0x01);
    INVALID_FIELD = (0, 0x02);
    COMMAND_ID_CONFLICT = (0, 0x03);
    DATA_TRANSFER_ERROR = (0, 0x04);
    INTERNAL_ERROR = (0, 0x06);
    ABORT_REQUESTED = (0, 0x07);
    /// Command Aborted due to Failed Fused Command: the other command of its fused
    /// operation failed (a Compare and Write's Write when the Compare failed).
    ABORTED_FAILED_FUSED = (0, 0x09);
    /// Command Aborted due to Missing Fused Command: a fused operation's first command not
    /// followed by its second, or a second without a first.
    ABORTED_MISSING_FUSED = (0, 0x0a);
    INVALID_NAMESPACE = (0, 0x0b);
    COMMAND_SEQUENCE_ERROR = (0, 0x0c);
    DATA_SGL_LENGTH_INVALID = (0, 0x0f);
    SGL_DESCRIPTOR_TYPE_INVALID = (0, 0x11);
    SGL_OFFSET_INVALID = (0, 0x16);
    /// The host identifier is not consistent across the controller's queues.
    HOST_ID_INCONSISTENT = (0, 0x18);
    KEEP_ALIVE_EXPIRED = (0, 0x19);
    KEEP_ALIVE_INVALID = (0, 0x1a);
    /// A Reservation Acquire with Preempt and Abort (RACQA 010b) of another host aborted it.
    ABORTED_PREEMPT = (0, 0x1b);
    /// The controller could not take the command now: the host should retry it (NVMe
    /// 1.4's Command Interrupted; a namespace's fused writes waiting beyond their limit).
    COMMAND_INTERRUPTED = (0, 0x21);
    /// A data digest error: the host may retry (NVMe/TCP "Data Digest Error").
    TRANSIENT_TRANSPORT_ERROR = (0, 0x22);
    /// A reservation command from a host whose Host Identifier is zero (CTRATT.RHII set).
    HOST_ID_NOT_INITIALIZED = (0, 0x27);
    LBA_OUT_OF_RANGE = (0, 0x80);
    CAPACITY_EXCEEDED = (0, 0x81);
    NAMESPACE_NOT_READY = (0, 0x82);
    /// A reservation forbids the command, or the host is not a registrant with that key.
    RESERVATION_CONFLICT = (0, 0x83);
    INVALID_QUEUE_IDENTIFIER = (1, 0x01);
    INVALID_QUEUE_SIZE = (1, 0x02);
    ABORT_LIMIT_EXCEEDED = (1, 0x03);
    ASYNC_EVENT_LIMIT_EXCEEDED = (1, 0x05);
    INVALID_LOG_PAGE = (1, 0x09);
    FEATURE_NOT_SAVEABLE = (1, 0x0d);
    FEATURE_NOT_CHANGEABLE = (1, 0x0e);
    /// Set Features (I/O Command Set Profile): the combination index names no combination.
    IO_COMMAND_SET_COMBINATION_REJECTED = (1, 0x2b);
    /// Identify: the CSI names an I/O command set the controller does not support.
    INVALID_IO_COMMAND_SET = (1, 0x2c);
    /// Cross-Controller Reset (NVMe Base 2.3): a reset of that controller is already
    /// under way (from another controller of the host).
    CROSS_CONTROLLER_RESET_IN_PROGRESS = (1, 0x3f);
    /// Cross-Controller Reset: more resets under way than the controller tracks.
    CROSS_CONTROLLER_RESET_LIMIT_EXCEEDED = (1, 0x41);
    CONNECT_INCOMPATIBLE_FORMAT = (1, 0x80);
    CONNECT_CONTROLLER_BUSY = (1, 0x81);
    CONNECT_INVALID_PARAMETERS = (1, 0x82);
    CONNECT_RESTART_DISCOVERY = (1, 0x83);
    CONNECT_INVALID_HOST = (1, 0x84);
    /// The queue's host must complete in-band authentication (DH-HMAC-CHAP) first.
    AUTH_REQUIRED = (1, 0x91);
    WRITE_FAULT = (2, 0x80);
    UNRECOVERED_READ_ERROR = (2, 0x81);
    /// Compare Failure: the blocks differ from the Compare command's data.
    COMPARE_FAILURE = (2, 0x85);
    /// Access Denied (Media and Data Integrity Errors, 86h): the host's tenant may not
    /// reach these blocks or run this operation, or its credentials were removed.
    ACCESS_DENIED = (2, 0x86);
}

impl Status {
    pub fn is_success(self) -> bool {
        self.sct == 0 && self.sc == 0
    }

    /// The same status with Do Not Retry set.
    pub fn dnr(self) -> Status {
        Status { dnr: true, ..self }
    }

    /// Encodes into the CQE status field (bits 15:0 of the upper half of dword 3),
    /// phase bit 0 left clear: fabrics have no phase tag.
    pub fn to_field(self) -> u16 {
        ((self.sc as u16) << 1) | (((self.sct & 0x7) as u16) << 9) | ((self.dnr as u16) << 15)
    }

    pub fn from_field(f: u16) -> Status {
        Status { sc: (f >> 1) as u8, sct: ((f >> 9) & 0x7) as u8, dnr: f & 0x8000 != 0 }
    }

    pub fn name(self) -> Option<&'static str> {
        name_of(Status { dnr: false, ..self }).or_else(|| crate::compute::status::name(self))
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => write!(f, "{n} (sct {:#x} sc {:#04x})", self.sct, self.sc)?,
            None => write!(f, "sct {:#x} sc {:#04x}", self.sct, self.sc)?,
        }
        if self.dnr {
            write!(f, " dnr")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_round_trip() {
        for s in [Status::SUCCESS, Status::LBA_OUT_OF_RANGE.dnr(), Status::CONNECT_INVALID_HOST, Status::WRITE_FAULT] {
            assert_eq!(Status::from_field(s.to_field()), s);
        }
        // Linux: NVME_SC_LBA_RANGE 0x80 in the low byte, shifted left by one on the wire.
        assert_eq!(Status::LBA_OUT_OF_RANGE.to_field(), 0x80 << 1);
        assert_eq!(Status::CONNECT_INVALID_HOST.to_field(), (0x184) << 1);
        assert_eq!(format!("{}", Status::INVALID_FIELD.dnr()), "INVALID_FIELD (sct 0x0 sc 0x02) dnr");
    }
}
