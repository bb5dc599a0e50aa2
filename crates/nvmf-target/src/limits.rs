//! Every limit of the target, with its unit and why it has that value.

/// Largest submission queue a host may ask for (CAP.MQES + 1). 256 covers the Linux
/// default of 128 and the QD 128 benchmarks with headroom; memory per connection grows
/// with it (docs/protocol.md, "Memory per connection").
pub const QUEUE_DEPTH_MAX: u16 = 256;

/// Largest admin submission queue a host may ask for at Connect, in entries; the discovery
/// log reports it as ASQSZ. The same as an I/O queue: admin commands hold no data buffers
/// beyond Connect's 1 KiB (their replies are bounded by what each command defines), so a
/// deep admin queue costs no more memory than an I/O queue, and initiators that ask for
/// more than Linux's 32 keep working. It must stay at least 32 (NVMe over Fabrics, ASQSZ).
pub const ADMIN_QUEUE_DEPTH_MAX: u16 = QUEUE_DEPTH_MAX;

/// Log lines of one cause from one peer host logged per interval before the rest are only
/// counted (crate::log_limit): enough to show what happens, few enough that a host looping
/// on a refused Connect (thousands a second) cannot fill the disk or bury other lines.
pub const LOG_REPEATS_MAX: u32 = 5;
/// That interval, in milliseconds; a flood costs at most LOG_REPEATS_MAX + 1 lines a second
/// per host and cause.
pub const LOG_INTERVAL_MS: u64 = 1000;
/// Hosts and causes whose lines are counted at once: about 100 bytes each, 400 KiB in all;
/// beyond, hosts share one count per cause.
pub const LOG_KEYS_MAX: usize = 4096;

/// Largest transfer of one command: MDTS = 5, 2^5 4 KiB pages = 128 KiB, as SPDK's
/// default max_io_size. The Linux host splits larger I/O.
pub const MDTS: u8 = 5;
pub const TRANSFER_BYTES_MAX: usize = 4096 << MDTS;

/// In-capsule data accepted on I/O queues (ICDSZ). 16 KiB, as the Linux target's default
/// inline_data_size: writes up to 16 KiB travel with the command, with no R2T round trip.
pub const IN_CAPSULE_BYTES_MAX: usize = 16384;

/// In-capsule data accepted on the admin queue: the 1024-byte Connect data and more;
/// 8 KiB is what the Linux host assumes (NVME_TCP_ADMIN_CCSZ).
pub const ADMIN_IN_CAPSULE_BYTES_MAX: usize = 8192;

/// Largest data in one H2CData PDU (MAXH2CDATA). Smaller than a transfer so that a large
/// write arrives as several PDUs, which keeps the receive buffer small.
pub const H2C_DATA_BYTES_MAX: u32 = 65536;

/// Receive buffer per connection: one largest PDU (in-capsule or H2CData) plus headers,
/// rounded to pages, doubled so that a batch of small commands rides along.
pub const RX_BUFFER_BYTES: usize = 2 * 81920;

/// Stop reading new commands while this much response data waits to be sent: bounds memory
/// when a host sends reads faster than it receives their data. The socket's own send
/// buffer (up to 4 MiB by tcp_wmem) holds more; 1 MiB here measured no slower than 4 MiB
/// for 128 KiB reads at QD 32 (docs/benchmarks.md).
pub const TX_PENDING_BYTES_MAX: usize = 1 << 20;

/// Asynchronous Event Requests outstanding per controller (AERL + 1).
pub const AER_MAX: usize = 4;

/// Error log entries kept per controller (ELPE + 1).
pub const ERROR_LOG_ENTRIES: usize = 16;

/// I/O queues per controller.
pub const IO_QUEUES_MAX: u16 = 64;

/// Namespaces per subsystem (NN): NSIDs 1..=1024.
pub const NSID_MAX: u32 = 1024;

/// Controllers per subsystem: CNTLIDs 1..=0xFFEF are valid; keep fewer to bound state.
pub const CONTROLLERS_PER_SUBSYSTEM_MAX: usize = 1024;

/// Registrants per namespace (each a Host Identifier and a key, 24 bytes). As many as the
/// controllers a subsystem holds, so that every connected host can register; registrations
/// outlive their controllers, so the bound is needed. The Reservation Report of a full
/// namespace (64 + 64 bytes each, 64 KiB) fits one transfer. Past it, Register fails with
/// Internal Error (the specification has no status for it).
pub const RESERVATION_REGISTRANTS_MAX: usize = CONTROLLERS_PER_SUBSYSTEM_MAX;

/// Reservation Notification log pages kept per controller until read (64 bytes each). A
/// notice beyond it drops the oldest; the host sees the gap in the Log Page Count.
pub const RESERVATION_NOTICES_MAX: usize = 64;

/// Keep-alive granularity reported in KAS, in milliseconds (KAS is in 100 ms units).
pub const KEEP_ALIVE_GRANULARITY_MS: u32 = 100;

/// CAP.TO: how long a host waits for CSTS.RDY, in 500 ms units (7.5 s).
pub const READY_TIMEOUT_500MS: u8 = 15;

/// Default worker threads that run file and block backend I/O.
pub const IO_THREADS_DEFAULT: usize = 4;

/// Busy-poll window after a connection's last activity, in microseconds. A round trip on
/// loopback between two polling processes takes about 20 us here, and a sleeping process
/// needs 50-150 us to wake (scheduler plus IPI); 200 us of polling covers the gap between
/// a host's completion and its next command at low queue depth. An idle connection stops
/// polling after this window, so an idle target uses no CPU.
pub const BUSY_POLL_US_DEFAULT: u64 = 200;
pub const BUSY_POLL_US_MAX: u64 = 100_000;

/// Reads of at least this many bytes from a memory backend go from the backend's memory
/// to the socket with writev(2), skipping the copy into the send buffer. Below it, copying
/// lets a batch of small reads leave in one syscall, which is cheaper.
pub const WRITE_THROUGH_BYTES_MIN: usize = 32 * 1024;

/// Memory of one connection's io_uring (256 submission entries of 64 bytes and their
/// index array, 512 completion entries of 16 bytes), rounded up to pages.
pub const RING_BYTES: usize = 32 * 1024;

/// The most buffer memory one connection holds, for a queue of `sqsize` entries (the
/// formula of docs/protocol.md, "Memory per connection"; a test drives a connection to
/// its worst case and checks it):
/// - the receive buffer;
/// - one data buffer per command that can be outstanding, plus one for a command being
///   executed inline;
/// - the send buffer: reading commands and taking completions stop once
///   TX_PENDING_BYTES_MAX bytes wait; past that point one command's response, one pool
///   completion and one batch of REAP_BATCH ring completions may still be appended; the
///   buffer keeps sent bytes only while they are fewer than the pending ones (at most
///   twice the pending bytes), and a Vec grows by doubling: at most 4x in all;
/// - the io_uring.
pub fn connection_memory_max(sqsize: usize) -> usize {
    let response = TRANSFER_BYTES_MAX + 256;
    let tx = TX_PENDING_BYTES_MAX + (REAP_BATCH + 2) * response;
    RX_BUFFER_BYTES + (sqsize + 2) * TRANSFER_BYTES_MAX + 4 * tx + RING_BYTES
}

/// The smallest memory budget (`limits.memory`) a target accepts, for commands of
/// `memory_per_command` bytes: connections leave one compute command and its result
/// free (crate::fabrics), and besides those the budget must hold one controller, an
/// admin and an I/O queue of the largest size, or no host could use the target.
pub fn memory_budget_min(memory_per_command: u64) -> u64 {
    memory_per_command + RESULT_BYTES_MAX as u64 + 2 * connection_memory_max(QUEUE_DEPTH_MAX as usize) as u64
}

/// io_uring completions taken per look at the ring while the send buffer has room.
pub const REAP_BATCH: usize = 8;

/// Bytes of input handed to a compute operation at a time (compute.chunk): large enough
/// that per-chunk overheads (a channel hand-off, a read syscall) vanish next to the
/// compute on it, small enough that read-ahead of several chunks per input stays cheap.
pub const COMPUTE_CHUNK_DEFAULT: u64 = 1 << 20;

/// Results and messages one controller holds for FETCH, running compute commands
/// included (each has a slot reserved for its result). Past it, EXEC fails with
/// RESULTS_FULL until the host fetches or releases some.
pub const RESULTS_HELD_MAX: usize = 128;

/// Largest result of one compute command (its JSON outcomes). With RESULTS_HELD_MAX, a
/// controller holds at most 32 MiB of results. Larger outputs go to output objects.
pub const RESULT_BYTES_MAX: usize = 256 * 1024;

/// Connections one source address may hold before they Connect (`limits.connections_per_address`).
/// A host opens one connection per queue and Connects each within a round trip; 64 covers
/// a host bringing up an admin queue and 63 I/O queues at once, while one address can no
/// longer hold thousands of half-open connections.
pub const CONNECTIONS_PER_ADDRESS_DEFAULT: usize = 64;

/// Controllers one host NQN may hold in one subsystem (`limits.controllers_per_host`). A
/// host needs one per path (multipath: a few); 16 leaves room for reconnects whose old
/// controller has not yet expired, and with CONTROLLERS_PER_SUBSYSTEM_MAX it takes 64
/// host NQNs, not one, to fill a subsystem.
pub const CONTROLLERS_PER_HOST_DEFAULT: usize = 16;

/// Milliseconds a connection may take from accept to a successful Connect, ICReq included
/// (`limits.connect_timeout_ms`). A host sends both within a few round trips; 10 s
/// tolerates a loaded host and a slow network while idle half-open connections go.
pub const CONNECT_TIMEOUT_MS_DEFAULT: u64 = 10_000;

/// Descriptors kept out of the connection cap: listeners, the metrics endpoint, backend
/// files, peer connections, log files, stdio, and connections being evicted (each holds
/// its socket until its task runs again).
pub const DESCRIPTORS_RESERVED: u64 = 256;

/// Descriptors one connection may hold: its socket and its io_uring.
pub const DESCRIPTORS_PER_CONNECTION: u64 = 2;

/// The connection cap a descriptor limit allows.
pub fn connections_max(nofile: u64) -> usize {
    (nofile.saturating_sub(DESCRIPTORS_RESERVED) / DESCRIPTORS_PER_CONNECTION) as usize
}

/// Compute commands started at once, all controllers together: each has a thread of its
/// own (a stack of 2 MiB address space, a few KiB touched) and its chunk buffers, reserved
/// from the memory budget; they compute `compute.threads` at a time, in turns. More wait
/// in the fair queue.
pub const COMPUTE_STARTED_MAX: usize = 256;

/// Compute commands one controller may have started: with turns handed round robin, 8
/// keep every core of a large target busy for one host, and one controller holds at most
/// 1/32 of COMPUTE_STARTED_MAX.
pub const COMPUTE_STARTED_PER_CONTROLLER_MAX: usize = 8;

/// How long a command computes before it hands its turn to a waiting one, in
/// milliseconds: a host's 4 KiB checksum waits for at most one slice per command ahead
/// of it in the round robin, while switching every 10 ms costs nothing measurable.
pub const COMPUTE_SLICE_MS: u64 = 10;
