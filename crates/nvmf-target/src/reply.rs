//! The result of a command that completes at once.

use nearstore_wire::Status;

#[derive(Debug, Default)]
pub struct Reply {
    pub status: Status,
    pub dw0: u32,
    pub dw1: u32,
    /// Controller-to-host data (Identify, Get Log Page, ...), sent before the completion.
    pub data: Vec<u8>,
}

impl Reply {
    pub fn ok() -> Reply {
        Reply::default()
    }
    pub fn status(status: Status) -> Reply {
        Reply { status, ..Reply::default() }
    }
    pub fn dw0(dw0: u32) -> Reply {
        Reply { dw0, ..Reply::default() }
    }
    pub fn data(data: Vec<u8>) -> Reply {
        Reply { data, ..Reply::default() }
    }
}
