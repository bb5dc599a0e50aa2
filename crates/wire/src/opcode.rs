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
}

/// NVM command set I/O commands.
pub mod io {
    pub const FLUSH: u8 = 0x00;
    pub const WRITE: u8 = 0x01;
    pub const READ: u8 = 0x02;
    pub const WRITE_ZEROES: u8 = 0x08;
    pub const DATASET_MANAGEMENT: u8 = 0x09;
}

/// The Fabrics command opcode; the command type is in byte 4 (FCTYPE).
pub const FABRICS: u8 = 0x7f;

/// Fabrics command types (NVMe over Fabrics 1.1, "Fabrics Command Types").
pub mod fctype {
    pub const PROPERTY_SET: u8 = 0x00;
    pub const CONNECT: u8 = 0x01;
    pub const PROPERTY_GET: u8 = 0x04;
    pub const DISCONNECT: u8 = 0x08;
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
}

/// Feature identifiers.
pub mod feature {
    pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    pub const ASYNC_EVENT_CONFIG: u8 = 0x0b;
    pub const KEEP_ALIVE_TIMER: u8 = 0x0f;
}

/// Log page identifiers.
pub mod lid {
    pub const ERROR_INFORMATION: u8 = 0x01;
    pub const SMART_HEALTH: u8 = 0x02;
    pub const FIRMWARE_SLOT: u8 = 0x03;
    pub const CHANGED_NS_LIST: u8 = 0x04;
    pub const DISCOVERY: u8 = 0x70;
}
