//! Opcodes of the commands nearstore handles.

/// Admin command set (NVMe Base 2.0, figure "Opcodes for Admin Commands").
pub mod admin {
    pub const GET_LOG_PAGE: u8 = 0x02;
    pub const IDENTIFY: u8 = 0x06;
    pub const ABORT: u8 = 0x08;
    pub const SET_FEATURES: u8 = 0x09;
    pub const GET_FEATURES: u8 = 0x0a;
    pub const ASYNC_EVENT_REQUEST: u8 = 0x0c;
    pub const KEEP_ALIVE: u8 = 0x18;
    /// NVMe Base 2.3 (TP8028, "Rapid Path Failure Recovery"): CDW10 bits 15:0 the
    /// Impacted Controller ID, bits 23:16 its CIU; CDW12-13 its CIRN.
    pub const CROSS_CONTROLLER_RESET: u8 = 0x38;
    /// nearstore, vendor-specific (C0h-FFh), no data: resets every controller of the
    /// issuer's host NQN and Host Identifier family (the first 8 bytes) whose Host
    /// Identifier is not the issuer's, live or removed, and completes once their work has
    /// ended (docs/protocol.md, "Fence Host Instances").
    pub const FENCE_HOST_INSTANCES: u8 = 0xc0;
}

/// NVM command set I/O commands.
pub mod io {
    pub const FLUSH: u8 = 0x00;
    pub const WRITE: u8 = 0x01;
    pub const READ: u8 = 0x02;
    pub const COMPARE: u8 = 0x05;
    pub const WRITE_ZEROES: u8 = 0x08;
    pub const DATASET_MANAGEMENT: u8 = 0x09;
    pub const RESERVATION_REGISTER: u8 = 0x0d;
    pub const RESERVATION_REPORT: u8 = 0x0e;
    pub const RESERVATION_ACQUIRE: u8 = 0x11;
    pub const RESERVATION_RELEASE: u8 = 0x15;
}

/// The Fabrics command opcode; the command type is in byte 4 (FCTYPE).
pub const FABRICS: u8 = 0x7f;

/// Fabrics command types (NVMe over Fabrics 1.1, "Fabrics Command Types").
pub mod fctype {
    pub const PROPERTY_SET: u8 = 0x00;
    pub const CONNECT: u8 = 0x01;
    pub const PROPERTY_GET: u8 = 0x04;
    pub const DISCONNECT: u8 = 0x08;
    /// Authentication Send and Receive (DH-HMAC-CHAP messages, crate nearstore-dhchap).
    pub const AUTH_SEND: u8 = 0x05;
    pub const AUTH_RECEIVE: u8 = 0x06;
}

/// Identify CNS values.
pub mod cns {
    pub const NAMESPACE: u8 = 0x00;
    pub const CONTROLLER: u8 = 0x01;
    pub const ACTIVE_NS_LIST: u8 = 0x02;
    pub const NS_ID_DESCRIPTORS: u8 = 0x03;
    /// I/O command set specific Identify Namespace (CSI in CDW11).
    pub const CS_NAMESPACE: u8 = 0x05;
    /// I/O command set specific Identify Controller (CSI in CDW11).
    pub const CS_CONTROLLER: u8 = 0x06;
    /// Active namespace ID list of the namespaces of one I/O command set (CSI in CDW11).
    pub const CS_ACTIVE_NS_LIST: u8 = 0x07;
    /// I/O command set independent Identify Namespace.
    pub const CS_INDEPENDENT_NAMESPACE: u8 = 0x08;
    /// I/O Command Set data structure: the combinations of command sets the controller supports.
    pub const IO_COMMAND_SETS: u8 = 0x1c;
}

/// Command Set Identifiers (CSI).
pub mod csi {
    pub const NVM: u8 = 0x00;
}

/// Feature identifiers.
pub mod feature {
    pub const ARBITRATION: u8 = 0x01;
    pub const POWER_MANAGEMENT: u8 = 0x02;
    pub const TEMPERATURE_THRESHOLD: u8 = 0x04;
    pub const ERROR_RECOVERY: u8 = 0x05;
    pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    pub const WRITE_ATOMICITY_NORMAL: u8 = 0x0a;
    pub const ASYNC_EVENT_CONFIG: u8 = 0x0b;
    pub const KEEP_ALIVE_TIMER: u8 = 0x0f;
    pub const IO_COMMAND_SET_PROFILE: u8 = 0x19;
    /// The host's Host Identifier (data: 16 bytes with EXHID, CDW11 bit 0). Over fabrics the
    /// Connect sets it; Set Features is a Command Sequence Error.
    pub const HOST_IDENTIFIER: u8 = 0x81;
    /// Get Features Host Identifier CDW11 bit 0: the extended (128-bit) Host Identifier.
    pub const EXHID: u32 = 1 << 0;
    /// Namespace specific: which reservation notices are masked.
    pub const RESERVATION_NOTIFICATION_MASK: u8 = 0x82;
    /// Namespace specific: Persist Through Power Loss.
    pub const RESERVATION_PERSISTENCE: u8 = 0x83;

    /// Get Features SEL (CDW10 bits 10:8).
    pub mod sel {
        pub const CURRENT: u32 = 0;
        pub const DEFAULT: u32 = 1;
        pub const SAVED: u32 = 2;
        pub const SUPPORTED_CAPABILITIES: u32 = 3;
    }
}

/// Log page identifiers.
pub mod lid {
    pub const ERROR_INFORMATION: u8 = 0x01;
    pub const SMART_HEALTH: u8 = 0x02;
    pub const FIRMWARE_SLOT: u8 = 0x03;
    pub const CHANGED_NS_LIST: u8 = 0x04;
    pub const DISCOVERY: u8 = 0x70;
    pub const RESERVATION_NOTIFICATION: u8 = 0x80;
}
