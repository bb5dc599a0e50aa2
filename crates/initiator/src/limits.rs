//! The initiator's limits on what a target's replies may make it hold: each with its
//! unit and why that number. A value a target reports (MDTS, IOCCSZ, a log's record
//! count, a result's length) is used only up to these.

/// Largest data of one command, either direction, bytes: the most a target's MDTS is
/// taken at (MDTS 0, "no limit", too). An I/O queue holds a receive buffer of twice this
/// and a data buffer of this per command in flight, so 1 MiB keeps a queue of depth 128
/// near 130 MiB at worst; reads and writes of the library are 128 KiB anyway.
pub const TRANSFER_BYTES_MAX: usize = 1 << 20;

/// Largest write sent inside the command capsule, bytes, whatever the target's IOCCSZ
/// allows: larger writes go through R2T. 64 KiB bounds the send buffer a burst of
/// capsules can grow.
pub const IN_CAPSULE_BYTES_MAX: usize = 64 << 10;

/// Records of the discovery log read at most: the header and all records fit one
/// transfer of [`TRANSFER_BYTES_MAX`] (1024 bytes each). A discovery controller with more
/// subsystems and ports than this is refused with an error naming the count.
pub const DISCOVERY_RECORDS_MAX: usize = TRANSFER_BYTES_MAX / nearstore_wire::log::DISCOVERY_ENTRY_LEN - 1;

/// Allocation length of an Authentication Receive, bytes: as Linux's host, 4096, more than
/// the largest message a controller sends (a Challenge of 16 + 64 + 1024 bytes).
pub const AUTH_RECEIVE_BYTES: usize = 4096;

/// Longest compute result or message FETCHed, bytes: 64 times the target's result limit
/// (256 KiB), so a target's announced length cannot make the host allocate gigabytes.
pub const FETCH_BYTES_MAX: usize = 16 << 20;

/// The keep-alive timeout a connection asks for unless told otherwise (nvme-cli's default,
/// `ConnectOptions::kato_ms`), in milliseconds.
pub const KATO_MS_DEFAULT: u32 = 10_000;
