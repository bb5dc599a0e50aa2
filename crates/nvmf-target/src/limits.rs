//! Every limit of the target, with its unit and why it has that value. Where one limit
//! bounds another, a `const` assertion below says so and the build fails when a change
//! breaks it; what the host sees of them is tabled in docs/protocol.md ("Limits"), which a
//! test keeps in agreement.

use nearstore_transport::PAGE;
use nearstore_wire::pdu::{CAPSULE_CMD_HLEN, DATA_HLEN, DIGEST_LEN, IC_LEN, TERM_DATA_MAX, TERM_HLEN};

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

/// Largest admin submission queue of the discovery controller, in entries (ASQSZ of the
/// current discovery subsystem's log entry): NVMe over Fabrics' least admin queue, and
/// Linux's NVME_AQ_DEPTH for every admin queue. A discovery queue needs no depth (a host
/// reads one log page), no allow-list admits it, and every entry costs a slot
/// (QUEUE_SLOT_BYTES), so its Connect is refused above this.
pub const DISCOVERY_QUEUE_DEPTH_MAX: u16 = 32;

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

/// Largest transfer of one command, as MDTS (a power of two of CAP.MPSMIN's 4 KiB pages):
/// 5, 2^5 4 KiB pages = 128 KiB, as SPDK's default max_io_size. The Linux host splits
/// larger I/O. Every data buffer of a queue has this size.
pub const MDTS: u8 = 5;
/// MDTS in bytes.
pub const TRANSFER_BYTES_MAX: usize = 4096 << MDTS;

/// In-capsule data accepted on I/O queues (ICDSZ). 16 KiB, as the Linux target's default
/// inline_data_size: writes up to 16 KiB travel with the command, with no R2T round trip.
pub const IN_CAPSULE_BYTES_MAX: usize = 16384;

/// In-capsule data a host may send on the admin queue, in bytes: the NVMe/TCP transport
/// fixes it at 8 KiB (the Linux host's NVME_TCP_ADMIN_CCSZ); the Connect data takes 1024.
/// One framing serves both queues, so IN_CAPSULE_BYTES_MAX must cover it.
pub const ADMIN_IN_CAPSULE_BYTES: usize = 8192;

/// Largest data in one H2CData PDU (MAXH2CDATA). Smaller than a transfer so that a large
/// write arrives as several PDUs, which keeps the receive buffer small.
pub const H2C_DATA_BYTES_MAX: u32 = 65536;

/// The largest PDU a host may send, in bytes, padding and data digest included: a command
/// capsule with IN_CAPSULE_BYTES_MAX of data, an H2CData PDU of H2C_DATA_BYTES_MAX, an ICReq
/// or an H2CTermReq. CPDA is 0, yet a host may still place its data anywhere PDO (one byte)
/// reaches past the header and its digest, and the framing accepts that padding; it refuses
/// larger PDUs before they are read.
pub const PDU_BYTES_MAX: usize = {
    let capsule = PDO_MAX + IN_CAPSULE_BYTES_MAX + DIGEST_LEN;
    let h2c = PDO_MAX + H2C_DATA_BYTES_MAX as usize + DIGEST_LEN;
    let term = TERM_HLEN + TERM_DATA_MAX;
    let mut max = capsule;
    if h2c > max {
        max = h2c;
    }
    if term > max {
        max = term;
    }
    if IC_LEN > max {
        max = IC_LEN;
    }
    max
};

/// The farthest a PDU's data may start (PDO, one byte), in bytes from the PDU's start.
const PDO_MAX: usize = u8::MAX as usize;

/// Receive buffer per connection, in bytes: a PDU is parsed whole from it, so it holds the
/// largest one with room for a batch of small commands behind it: 160 KiB, at least two
/// largest PDUs, in whole pages.
pub const RX_BUFFER_BYTES: usize = 160 * 1024;

/// Stop reading new commands while this much response data waits to be sent: bounds memory
/// when a host sends reads faster than it receives their data. The socket's own send
/// buffer (up to 4 MiB by tcp_wmem) holds more; 1 MiB here measured no slower than 4 MiB
/// for 128 KiB reads at QD 32 (docs/benchmarks.md).
pub const TX_PENDING_BYTES_MAX: usize = 1 << 20;

/// Asynchronous Event Requests outstanding per controller (AERL + 1).
pub const AER_MAX: usize = 4;

/// Cross-Controller Resets waiting per admin queue for the work of the controllers they
/// reset to end; one more is refused with Cross-Controller Reset Limit Exceeded.
pub const CROSS_CONTROLLER_RESETS_MAX: usize = 4;

/// How long a Cross-Controller Reset waits for the reset controller's work to end (its
/// queues' device operations, its I/O pool operations, its compute commands) before it
/// completes with Command Interrupted; the controller stays reset, and a retry waits again.
pub const CROSS_CONTROLLER_RESET_WAIT_MS: u64 = 10_000;

/// Milliseconds a volume's operation may wait in this target's own schedulers (an arbiter
/// gate: at most a grant's time to live; a pool's fair queue) between the volume's check
/// that it may still issue it and its issue: part of the bound it declares on its writes
/// after an export lease ends (cluster::ClusterConfig::write_bound).
pub const EXPORT_HELD_MS: u64 = 30_000;

/// Bytes of an Authentication Send (its TL): the largest message a host can send, an
/// AUTH_Negotiate of 255 protocol descriptors (NAPD is one byte; a DH-HMAC-CHAP_Reply is at
/// most 16 + 2 x 64 + 1024 bytes). A longer TL is Invalid Field before anything is
/// allocated. An Authentication Receive's AL is bounded by MDTS like any transfer.
pub const AUTH_SEND_BYTES_MAX: usize = nearstore_dhchap::msg::SEND_LEN_MAX;

/// Error log entries kept per controller (ELPE + 1).
pub const ERROR_LOG_ENTRIES: usize = 16;

/// I/O queues per controller (Number of Queues, feature 07h): one per core of a large host.
pub const IO_QUEUES_MAX: u16 = 64;

/// Namespaces per subsystem (NN): NSIDs 1..=1024.
pub const NSID_MAX: u32 = 1024;

/// Controllers per subsystem: CNTLIDs 1..=0xFFEF are valid; keep fewer to bound state.
pub const CONTROLLERS_PER_SUBSYSTEM_MAX: usize = 1024;

/// NSIDs the Changed Namespace List log page (04h) holds: its 4 KiB are 1024 NSIDs. More
/// changes before the host reads it are not recorded one by one.
pub const CHANGED_NS_LIST_MAX: usize = 1024;

/// Registrants per namespace (each a Host Identifier and a key, 24 bytes). As many as the
/// controllers a subsystem holds, so that every connected host can register; registrations
/// outlive their controllers, so the bound is needed. The Reservation Report of a full
/// namespace (64 + 64 bytes each, 64 KiB) fits one transfer. Past it, Register fails with
/// Internal Error (the specification has no status for it).
pub const RESERVATION_REGISTRANTS_MAX: usize = CONTROLLERS_PER_SUBSYSTEM_MAX;

/// Compare and Write ranges held or waited for per namespace (range_lock.rs): each holds a
/// few dozen bytes and every writer of the namespace looks through them while any is there.
/// One per I/O queue entry of 16 queues is far more than the blocks a host serializes on at
/// once; a pair past it waits on its blocking thread for one to go, never on the network.
pub const RANGE_LOCKS_MAX: usize = 16 * QUEUE_DEPTH_MAX as usize;

/// Reservation Notification log pages kept per controller until read (64 bytes each). A
/// notice beyond it drops the oldest; the host sees the gap in the Log Page Count.
pub const RESERVATION_NOTICES_MAX: usize = 64;

/// Keep-alive granularity reported in KAS, in milliseconds (KAS is in 100 ms units).
pub const KEEP_ALIVE_GRANULARITY_MS: u32 = 100;

/// CAP.TO: how long a host waits for CSTS.RDY, in 500 ms units (7.5 s).
pub const READY_TIMEOUT_500MS: u8 = 15;

/// Default worker threads that run file and block backend I/O (`io_threads`): the rarer
/// operations and `--io-engine threads`; a few keep a disk's queue busy.
pub const IO_THREADS_DEFAULT: usize = 4;
/// The most `io_threads` accepts: far past what a disk's queue needs, before threads cost.
pub const IO_THREADS_MAX: usize = 256;

/// Busy-poll window after a connection's last activity, in microseconds. A round trip on
/// loopback between two polling processes takes about 20 us here, and a sleeping process
/// needs 50-150 us to wake (scheduler plus IPI); 200 us of polling covers the gap between
/// a host's completion and its next command at low queue depth. An idle connection stops
/// polling after this window, so an idle target uses no CPU.
pub const BUSY_POLL_US_DEFAULT: u64 = 200;
/// The most `busy_poll_us` accepts, in microseconds: 100 ms of spinning per activity is
/// already a core per busy connection.
pub const BUSY_POLL_US_MAX: u64 = 100_000;

/// How long the metrics endpoint waits for a scraper's request, in milliseconds: one read
/// takes a GET within a round trip; a slow or silent client is dropped after 5 s.
pub const METRICS_REQUEST_TIMEOUT_MS: u64 = 5000;

/// How long a fatal error's C2HTermReq may take to leave before the socket is closed
/// anyway, in milliseconds: a host that does not read must not hold the connection.
pub const TERM_FLUSH_TIMEOUT_MS: u64 = 1000;

/// Reads of at least this many bytes from a memory backend stay in the backend's memory
/// until the send, and go to the socket in the batch's one writev(2) together with the
/// send buffer, skipping the copy into it (crate::tcp, `TcpTx::gather`). Below it copying
/// costs less than an iovec (docs/spdk-128k-reads.md).
pub const WRITE_THROUGH_BYTES_MIN: usize = 32 * 1024;

/// Reads a connection keeps lent (their data in the memory backend until they are sent) at
/// once: a queue of 32 reads of TRANSFER_BYTES_MAX (4 MiB, what the kernel's largest send
/// buffer takes) leaves in one writev, as SPDK's target gathers 64 iovecs (a header and the
/// data of 32 reads) into one sendmsg. Also bounds how long one send holds the backend's
/// stripe locks: one copy of 4 MiB into the socket. More waiting stops commands being read.
pub const TX_LENT_READS_MAX: usize = 32;

/// The most of a lent read a send cut short copies into the send buffer, in bytes: the rest
/// of the block it was cut in (512 or 4096 bytes, config.rs), so that a write between two
/// sends never tears a block. The send buffer keeps this much free while reads are lent.
pub const TX_LENT_REST_BYTES_MAX: usize = 4096;

/// Memory of one connection's io_uring, in bytes: QUEUE_DEPTH_MAX submission entries of
/// 64 bytes and their 4-byte index array, twice as many completion entries of 16 bytes
/// (the kernel's default), rounded up to pages.
pub const RING_BYTES: usize = 32 * 1024;

/// The most one step of a connection appends to its send buffer, in bytes: one command's
/// response (a C2HData header padded to HPDA, up to TRANSFER_BYTES_MAX of data, its
/// digest, a CapsuleResp), the AER completions delivered after it, or a C2HTermReq. A
/// connection takes a step (a command, a completion) only while its send buffer has this
/// much room, so the buffer never grows by itself (crate::tcp, `tx_room`).
pub const TX_STEP_BYTES: usize = TRANSFER_BYTES_MAX + 4096;

/// The send buffer every queue holds from accept to close, in bytes: one step and room to
/// spare, so that a queue always makes progress, one response at a time, whatever the
/// memory budget. It grows past this, charged to the budget, while the host reads slower
/// than responses come.
pub const TX_BUFFER_BYTES: usize = 256 * 1024;

/// The most a send buffer grows to, in bytes: steps are taken while at most
/// TX_PENDING_BYTES_MAX bytes wait; sent bytes are kept only while they are fewer than the
/// pending ones, so the buffer holds under twice that, plus one step and the rest of a
/// lent read's block.
pub const TX_BUFFER_BYTES_MAX: usize = 2 * TX_PENDING_BYTES_MAX + TX_STEP_BYTES + TX_LENT_REST_BYTES_MAX;

/// Data buffers (of TRANSFER_BYTES_MAX) a connected queue always holds, charged at Connect:
/// one a write waiting for its data (R2T) may take, and one left for a command that needs
/// a buffer now (a file read, an in-capsule write), whose operation finishes without the
/// host. An R2T never takes the last one, so the data of every R2T sent can always be
/// read, and the queue can always run its commands one at a time whatever the budget.
pub const QUEUE_BUFFERS_FIXED: usize = 2;

/// Memory per queue entry, in bytes: the command slots a queue keeps (a write waiting for
/// its data, a command in flight, their requests), rounded up; crate::tcp asserts its
/// slots fit.
pub const QUEUE_SLOT_BYTES: usize = 768;

/// What a connected queue of `sqsize` entries always holds, in bytes, charged to the
/// memory budget at Connect: the receive buffer, the send buffer's first TX_BUFFER_BYTES,
/// QUEUE_BUFFERS_FIXED data buffers, the io_uring and one slot per entry (docs/protocol.md,
/// "Memory per connection"). More data buffers and a larger send buffer are charged as
/// they are needed, and the queue waits when the budget cannot give them.
pub const fn connection_memory_fixed(sqsize: usize) -> usize {
    RX_BUFFER_BYTES + TX_BUFFER_BYTES + QUEUE_BUFFERS_FIXED * TRANSFER_BYTES_MAX + RING_BYTES + sqsize * QUEUE_SLOT_BYTES
}

/// The most buffer memory one connection holds, for a queue of `sqsize` entries (the
/// formula of docs/protocol.md, "Memory per connection"; a test drives a connection to
/// its worst case and checks it):
/// - the receive buffer;
/// - one data buffer per command that can be outstanding, plus one taken ahead for the
///   next command (QUEUE_BUFFERS_FIXED at least);
/// - the send buffer, TX_BUFFER_BYTES_MAX;
/// - the io_uring and the slots.
pub const fn connection_memory_max(sqsize: usize) -> usize {
    let buffers = if sqsize + 1 > QUEUE_BUFFERS_FIXED { sqsize + 1 } else { QUEUE_BUFFERS_FIXED };
    RX_BUFFER_BYTES + buffers * TRANSFER_BYTES_MAX + TX_BUFFER_BYTES_MAX + RING_BYTES + sqsize * QUEUE_SLOT_BYTES
}

/// The smallest memory budget (`limits.memory`) a target accepts, for commands of
/// `memory_per_command` bytes: connections leave one compute command and its result
/// free (crate::fabrics), and besides those the budget must hold what one controller's
/// admin and I/O queue of the largest size always hold, or no host could use the target
/// (with that, its queues run one command at a time; more buffers make them faster).
pub const fn memory_budget_min(memory_per_command: u64) -> u64 {
    memory_per_command + RESULT_BYTES_MAX as u64 + 2 * connection_memory_fixed(QUEUE_DEPTH_MAX as usize) as u64
}

/// The default `compute.memory_per_command` for a memory budget of `budget` bytes: a
/// quarter of it in whole MiB, at most COMPUTE_MEMORY_PER_COMMAND_BYTES_DEFAULT (reached
/// from a 1 GiB budget, a 2 GiB machine). Connections leave one command free, so the
/// other three quarters are for queues and results: the 512 MiB qemu guest's default budget
/// of 229 MiB gives 57 MiB commands, where 256 MiB commands left no room for a controller.
/// The least budget such a command needs (memory_budget_min) is then about 59 MiB.
pub const fn compute_memory_per_command_default(budget: u64) -> u64 {
    let quarter = budget / 4 / (1 << 20) * (1 << 20);
    if quarter < COMPUTE_MEMORY_PER_COMMAND_BYTES_DEFAULT {
        quarter
    } else {
        COMPUTE_MEMORY_PER_COMMAND_BYTES_DEFAULT
    }
}

/// glibc malloc arenas per core (M_ARENA_MAX, set at start-up unless MALLOC_ARENA_MAX is
/// in the environment). glibc's default of 8 per core let memory freed on one arena sit
/// unused while another grew: the peak resident memory test's process peaked 48 MiB over
/// its 256 MiB budget (crates/cli/tests/memory.rs), and 57 MiB under it with one arena per
/// core. The hot I/O path does not allocate, so the
/// contention fewer arenas bring falls on compute threads, which allocate per chunk, not
/// per byte.
pub const MALLOC_ARENAS_PER_CORE: usize = 1;

/// glibc's mmap threshold (M_MMAP_THRESHOLD, set at start-up unless
/// MALLOC_MMAP_THRESHOLD_ is in the environment): allocations of this size and more are
/// mapped on their own and given back to the kernel when freed. glibc's default starts
/// here too but raises itself to the size of each large block freed (up to 32 MiB), after
/// which held results and sort rows came from the arenas and stayed resident when freed:
/// the peak resident memory test (crates/cli/tests/memory.rs) measured 261-278 MiB against
/// idle 13 + budget 256 MiB, 304 and 344 MiB in runs on a busy machine, and 238-248 MiB with
/// the threshold fixed here. What is allocated at this size is pooled (data buffers) or
/// per command (compute chunks), so the mmap and munmap it costs are not per I/O.
pub const MALLOC_MMAP_THRESHOLD_BYTES: usize = 128 * 1024;

/// io_uring completions taken per look at the ring while the send buffer has room.
pub const REAP_BATCH: usize = 8;

/// The memory budget (`limits.memory`) where the machine's memory cannot be read (the
/// default is half of it), in bytes: 1 GiB holds the default compute command and a few
/// queues.
pub const MEMORY_BUDGET_FALLBACK_BYTES: u64 = 1 << 30;

/// Bytes of input handed to a compute operation at a time (`compute.chunk`): large enough
/// that per-chunk overheads (a channel hand-off, a read syscall) vanish next to the
/// compute on it, small enough that read-ahead of several chunks per input stays cheap.
pub const COMPUTE_CHUNK_BYTES_DEFAULT: u64 = 1 << 20;
/// `compute.chunk` is a multiple of this, in bytes: chunk buffers are read with O_DIRECT
/// from block devices, whose reads are aligned to 4 KiB.
pub const COMPUTE_CHUNK_ALIGN_BYTES: u64 = 4096;
/// The largest `compute.chunk`, in bytes: each input holds (readahead + 1) chunks, and 64
/// MiB chunks already take 1 GiB for one command at the most read-ahead. One device read of
/// the offload engine fills one chunk, so this also bounds what one read costs the network
/// thread that starts it (a file's page-cache hit is copied inside io_uring's submit).
pub const COMPUTE_CHUNK_BYTES_MAX: u64 = 64 << 20;
/// Device reads in flight per input ahead of the operation (`compute.readahead`), each of
/// one chunk: two keep the disk busy while the operation computes on the third. An input
/// holds at most readahead + 1 chunk buffers, charged with the outputs' to the command's
/// `compute.memory_per_command` before it starts (`offload::validate`); a peer's extents
/// are read ahead too, within `cluster.read_ahead_bytes` of chunks per input.
pub const COMPUTE_READAHEAD_CHUNKS_DEFAULT: usize = 2;
/// Longest a compute command waits, as it ends, for its device reads still running
/// (`offload::read`), in seconds. Cancelled, a peer's read completes at once; a local
/// read of one chunk (64 MiB at most) takes well under a second on a working disk. A
/// device that never completes then costs a log line, not the command's thread, compute
/// slot and memory forever; the read's buffer stays with its I/O task until it completes.
pub const COMPUTE_READ_DRAIN_SECS: u64 = 10;
/// Device operations one compute command has in flight at once, all its inputs, outputs
/// and devices together: 64 reads of a chunk keep any disk's queue full (an NVMe SSD is
/// saturated by 32 reads of 128 KiB), where 64 inputs at the most read-ahead would put
/// 1,088 on the command's ring; more wait on the command's side (`offload::read`). A
/// device takes no more of them than its declared queue depth.
pub const COMPUTE_OPS_IN_FLIGHT_MAX: usize = 64;
/// Idle io_urings of ended compute commands a target keeps for the next ones
/// (`uring::RingPool`), each RING_BYTES of kernel memory and two descriptors: making one
/// per command costs io_uring_setup, its mmaps and an eventfd registration. Four serve
/// commands that follow one another and a few at once; more at once make their own.
pub const COMPUTE_RINGS_IDLE_MAX: usize = 4;
/// The most `compute.readahead` accepts: past 16, more reads in flight only hold memory.
pub const COMPUTE_READAHEAD_CHUNKS_MAX: usize = 16;
/// Memory one compute command may use (`compute.memory_per_command`), in bytes: its chunk
/// buffers plus the operation's own (a sort's runs, a GROUP BY's groups). The default with
/// a memory budget of 1 GiB or more (compute_memory_per_command_default), and where no
/// budget applies (`offload::execute_here`).
pub const COMPUTE_MEMORY_PER_COMMAND_BYTES_DEFAULT: u64 = 256 << 20;
/// Commands computing at once at most (`compute.threads`, default the machine's cores).
pub const COMPUTE_THREADS_MAX: usize = 256;
/// Longest a compute command may run before it fails with TIMEOUT (`compute.timeout_secs`),
/// in seconds: 10 minutes scan a large disk; at most a day.
pub const COMPUTE_TIMEOUT_SECS_DEFAULT: u64 = 600;
pub const COMPUTE_TIMEOUT_SECS_MAX: u64 = 86_400;
/// How long an unfetched result is held (`compute.result_ttl_secs`), in seconds: a host
/// fetches within a round trip of the completion; a minute covers a stalled one. At most a
/// day.
pub const RESULT_TTL_SECS_DEFAULT: u64 = 60;
pub const RESULT_TTL_SECS_MAX: u64 = 86_400;

/// Results and messages one controller holds for FETCH, running compute commands
/// included (each has a slot reserved for its result). Past it, EXEC fails with
/// RESULTS_FULL until the host fetches or releases some.
pub const RESULTS_HELD_MAX: usize = 128;

/// Largest result of one compute command (its JSON outcomes). With RESULTS_HELD_MAX, a
/// controller holds at most 32 MiB of results. Larger outputs go to output objects.
pub const RESULT_BYTES_MAX: usize = 256 * 1024;

/// Connections one source address may hold before they Connect (`limits.connections_per_address`).
/// A host opens one connection per queue and Connects each within a round trip; 65 covers
/// a host bringing up an admin queue and all IO_QUEUES_MAX I/O queues at once, while one
/// address can no longer hold thousands of half-open connections.
pub const CONNECTIONS_PER_ADDRESS_DEFAULT: usize = IO_QUEUES_MAX as usize + 1;

/// Connected queues one source address may hold, all subsystems and controllers together
/// (`limits.queues_per_address`). A host connects an admin queue and up to IO_QUEUES_MAX
/// I/O queues per controller; 130 covers two such controllers (two subsystems, or two
/// paths), while one address holds at most 130 queues' fixed memory (about 102 MiB at 128
/// entries, connection_memory_fixed), not the whole budget, whatever host NQNs it claims.
pub const QUEUES_PER_ADDRESS_DEFAULT: usize = 2 * (IO_QUEUES_MAX as usize + 1);
/// The most `limits.queues_per_address` accepts: a controller per subsystem of a large
/// host; past it one address holds as much as no limit would.
pub const QUEUES_PER_ADDRESS_MAX: usize = 64 * (IO_QUEUES_MAX as usize + 1);

/// Controllers one host NQN may hold in one subsystem (`limits.controllers_per_host`). A
/// host needs one per path (multipath: a few); 16 leaves room for reconnects whose old
/// controller has not yet expired, and with CONTROLLERS_PER_SUBSYSTEM_MAX it takes 64
/// host NQNs, not one, to fill a subsystem.
pub const CONTROLLERS_PER_HOST_DEFAULT: usize = 16;

/// Milliseconds a connection may take from accept to a successful Connect, ICReq included
/// (`limits.connect_timeout_ms`). A host sends both within a few round trips; 10 s
/// tolerates a loaded host and a slow network while idle half-open connections go.
pub const CONNECT_TIMEOUT_MS_DEFAULT: u64 = 10_000;
/// The range `limits.connect_timeout_ms` accepts, in milliseconds: under 100 a loaded host
/// on a slow link fails to Connect; past 10 minutes half-open connections are no longer
/// bounded in time.
pub const CONNECT_TIMEOUT_MS_MIN: u64 = 100;
pub const CONNECT_TIMEOUT_MS_MAX: u64 = 600_000;

/// Descriptors kept out of the connection cap: listeners, the metrics endpoint, backend
/// files, peer connections, log files, stdio, and connections being evicted (each holds
/// its socket until its task runs again).
pub const DESCRIPTORS_RESERVED: u64 = 256;

/// Descriptors one connection may hold: its socket and its io_uring.
pub const DESCRIPTORS_PER_CONNECTION: u64 = 2;

/// The connection cap a descriptor limit allows.
pub const fn connections_max(nofile: u64) -> usize {
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
/// of it in the round robin. 2 ms (10 ms before): a light tenant's grep and select beside
/// heavy sha256s went from 7.5x to 4.6x their p99 alone, and the heavy tenants' commands
/// per second did not change (scripts/exp-fair.py --only compute, docs/experiments.md).
pub const COMPUTE_SLICE_MS: u64 = 2;

/// The nice value of compute commands' threads by default (`compute.nice`): below the
/// network threads', so that a long command's turn delays neither plain I/O nor a short
/// command's sending and receiving on a busy core.
pub const COMPUTE_NICE_DEFAULT: i32 = 10;

/// How far below the least virtual runtime of the active tenants a tenant that was idle
/// joins, in milliseconds of CPU time at the default weight (CFS's sleeper credit, half its
/// 6 ms latency period): a light tenant's command of a few milliseconds runs through ahead
/// of a heavy tenant's instead of sharing the turns slice for slice. Bounded: a tenant
/// idle for an hour joins with no more, and one that goes idle between its commands gets
/// no credit back until the others have run past it (sched::Vclock).
pub const COMPUTE_SLEEPER_CREDIT_MS: u64 = 3;

/// A command hands its turn before its slice is over, at its next check, to a waiting
/// tenant at least this far behind its own in virtual runtime, in milliseconds (CFS's wakeup
/// granularity): a tenant joining with its credit does not wait out the slice.
pub const COMPUTE_WAKEUP_GRANULARITY_MS: u64 = 1;

/// A tenant's I/O and compute weight when its entry gives none (`[[tenant]]`), and the
/// built-in tenants': a round number that leaves room to give a tenant a tenth of another's.
pub const TENANT_WEIGHT_DEFAULT: u32 = 100;
/// The largest tenant weight: 100 times the default. A tenant of weight 1 beside one of
/// 10000 still gets one turn in ten thousand; more only makes shares round to nothing.
pub const TENANT_WEIGHT_MAX: u32 = 10_000;
/// `[[tenant]]` entries: each is looked up per command by its controller, never searched,
/// so the number bounds only the table and the metrics' series.
pub const TENANTS_MAX: usize = 256;
/// Host NQNs in one tenant.
pub const TENANT_HOSTS_MAX: usize = 1024;
/// A tenant's name in bytes: it is a metrics label and a control-plane key.
pub const TENANT_NAME_BYTES_MAX: usize = 64;
/// Times one admin Connect resolves its host's tenant: a reload between the resolution and
/// the new controller's insertion sends it round again under the new table. Each round
/// needs another reload (SIGHUP) to land in that window; past this many the Connect is
/// Controller Busy, which the host retries.
pub const CONNECT_TENANT_RESOLVES_MAX: usize = 4;

/// Connections to one peer target, busy and idle, for all hosts (`cluster.connections_per_peer`):
/// four reads of a peer's extents run in parallel; more than 64 only add sockets.
pub const PEER_CONNECTIONS_DEFAULT: usize = 4;
pub const PEER_CONNECTIONS_MAX: usize = 64;

/// Reads in flight on one connection to a peer, for one read of a peer device
/// (`cluster.read_ahead_bytes`), in bytes: 4 MiB fills a 10 Gbit/s link with a few
/// milliseconds of round trip. At least one of the initiator's pipelined reads, at most 64
/// MiB per connection.
pub const PEER_READ_AHEAD_BYTES_DEFAULT: u64 = 4 << 20;
pub const PEER_READ_AHEAD_BYTES_MIN: u64 = 128 << 10;
pub const PEER_READ_AHEAD_BYTES_MAX: u64 = 64 << 20;

/// How long a peer may take to answer before the command fails with PEER_FAILED
/// (`cluster.timeout_secs`), in seconds: 30 tolerates a loaded peer; at most an hour.
pub const PEER_TIMEOUT_SECS_DEFAULT: u64 = 30;
pub const PEER_TIMEOUT_SECS_MAX: u64 = 3600;

/// Extents whose location one exported volume keeps in its mapping cache
/// (`volume.cache_entries`), in entries of about 100 bytes: 4096 entries map 256 GiB of
/// 64 MiB extents in 400 KiB; 0 turns the cache off (every I/O asks the control plane, the
/// benchmark's "no cache" case); at most 2^20, a volume's largest extent table
/// (nearstore-control's EXTENTS_PER_VOLUME_MAX), so a full table fits.
pub const VOLUME_CACHE_ENTRIES_DEFAULT: usize = 4096;
pub const VOLUME_CACHE_ENTRIES_MAX: usize = 1 << 20;

/// How long an I/O to an extent the cache does not hold waits for the control plane's
/// translation (or allocation) before it fails with Namespace Not Ready, which a host
/// retries (`volume.translate_timeout_ms`), in milliseconds: 2 s is many round trips and an
/// fsync of the control plane; Linux retries a command 5 times, so a host sees an error
/// after about 10 s of control plane outage, not a hang. At most a minute.
pub const VOLUME_TRANSLATE_TIMEOUT_MS_DEFAULT: u64 = 2000;
pub const VOLUME_TRANSLATE_TIMEOUT_MS_MAX: u64 = 60_000;

/// The logical block size of an exported volume, in bytes: every extent size is a multiple
/// of it (nearstore-control's EXTENT_ALIGN_BYTES), and 4 KiB is what file systems use.
pub const VOLUME_BLOCK_BYTES: u32 = 4096;
/// Bytes a copier reads and writes at once when it moves an extent: one command's largest
/// transfer, so a peer's pool takes it as one command.
pub const MOVE_COPY_CHUNK_BYTES: usize = TRANSFER_BYTES_MAX;
/// Milliseconds a copier waits for the operations in flight on an extent to complete before
/// it gives the move up: on a healthy pool they complete in milliseconds, one still running
/// after 5 s is a pool in trouble, a bad time to move; and the control plane hears nothing
/// from the copier meanwhile, so it is under nearstore-control's MOVE_SILENCE_MS (10 s).
pub const MOVE_DRAIN_MS: u64 = 5000;

/// Misses of one volume resolved at once, in extents (each a task and a control-plane
/// request, then the pool device's open and, for a first write, its zeroing): 16 lets a
/// host's queue of cold reads be translated together in one round trip instead of one
/// after another, while a volume read cold at any queue depth keeps at most 16 requests on
/// the control plane; more misses wait for a turn (within their own bounded wait).
pub const VOLUME_MISSES_IN_FLIGHT_MAX: usize = 16;

/// The fair I/O scheduler's epoch (`dev::fair`), in microseconds: waiting operations are
/// offered again once per epoch, and the budget holds at most an epoch's bytes beyond one
/// transfer. 1 ms is the runtime's timer resolution (a shorter epoch would not be kept)
/// and short against the latency of a disk under load: what a busy device holds ahead of
/// a light tenant is about one epoch of bytes.
pub const FAIR_EPOCH_US: u64 = 1000;

/// The bandwidth a fair-scheduled device serves (`fair_bandwidth` of a namespace or a pool),
/// in bytes per second: at least 1 MiB/s (an epoch's budget of about a KiB; an operation
/// larger than the budget holds goes when the budget is full), at most 1 TiB/s (an epoch's
/// budget stays far within i64 arithmetic).
pub const FAIR_BANDWIDTH_MIN: u64 = 1 << 20;
pub const FAIR_BANDWIDTH_MAX: u64 = 1 << 40;

/// Epochs after which the fair scheduler forgets a tenant that neither offered an
/// operation nor had one waiting (its share goes to the others; back, it starts afresh),
/// and stops counting operations that waited but were never offered again (their
/// connection closed): 16 ms, several times how late a timer fires on a loaded machine,
/// so that a backlogged tenant whose retries come late keeps its deficit and its turn.
pub const FAIR_IDLE_EPOCHS: u64 = 16;

/// Tenants one fair-scheduled device tracks at once, in tenants (about 80 bytes each): each
/// connected host is one, and one idle for FAIR_IDLE_EPOCHS is forgotten; beyond this the newest
/// share one catch-all entry rather than growing the table a host can make it grow.
pub const FAIR_TENANTS_MAX: usize = 256;

/// The smallest quantum of the fair I/O scheduler (`dev::fair`), in bytes: one 4 KiB block.
/// A tenant's quantum is the largest operation of the tenants a device tracks (at least
/// this) times its weight over the smallest weight, so that every tenant with operations
/// waiting moves at least one each round while rounds stay short: two tenants of weight
/// 100 reading 128 KiB at 100 MiB/s take turns every 2.5 ms.
pub const FAIR_QUANTUM_MIN_BYTES: u64 = 4096;

/// What a written byte costs against a read one in the fair scheduler (`fair_write_cost`),
/// dimensionless: 1 (default: the device costs the same) to 64 (flash writes cost a few
/// times reads, a shingled disk's more; beyond 64 a 4 KiB write outweighs a 128 KiB read
/// pair many times over, which no device we know does).
pub const FAIR_WRITE_COST_MAX: f64 = 64.0;

/// What a tenant new on a pool may move until its first grant, while the arbiter answers
/// (`dev::grant`), in cost bytes per second, beyond one transfer at once: a period (100 ms)
/// of it is a few commands, enough for a light tenant's reads to go on meanwhile.
pub const GRANT_PROVISIONAL_BPS: u64 = 1 << 20;

/// Requests to the control plane's arbiter in a row in which a tenant offered a pool
/// nothing, after which its gate forgets it once its grant ran out (`dev::grant`): a few
/// periods, so a tenant pausing between bursts keeps its bucket.
pub const GRANT_QUIET_REQUESTS: u32 = 3;

/// Operations waiting in the fair scheduler for one queue, in operations: a waiting
/// operation is a command of that queue holding its own slot and data buffer, so a queue
/// never has more waiting than its depth, and a host that keeps submitting meets the queue
/// being full (the command waits at the transport, in the socket), never a growing list.
pub const FAIR_WAITING_PER_QUEUE_MAX: usize = QUEUE_DEPTH_MAX as usize;

// How the limits bound one another. Each line fails the build when a change breaks it.

// Queues: CAP.MQES is QUEUE_DEPTH_MAX - 1 (0's based, at least 1); an admin queue must take
// the 32 entries NVMe over Fabrics requires; the io_uring of a connection has one
// submission entry per command and fits RING_BYTES.
const _: () = assert!(QUEUE_DEPTH_MAX >= 2);
const _: () = assert!(ADMIN_QUEUE_DEPTH_MAX >= 32);
const _: () = assert!({
    let sq = QUEUE_DEPTH_MAX.next_power_of_two() as usize;
    sq * (64 + 4) + 2 * sq * 16 <= RING_BYTES && RING_BYTES.is_multiple_of(PAGE)
});
const _: () = assert!(REAP_BATCH <= QUEUE_DEPTH_MAX as usize);
// A compute command's operations in flight fit the entries of its channel's ring.
const _: () = assert!(COMPUTE_OPS_IN_FLIGHT_MAX >= 1 && COMPUTE_OPS_IN_FLIGHT_MAX <= QUEUE_DEPTH_MAX as usize);
const _: () = assert!(DISCOVERY_QUEUE_DEPTH_MAX >= 32 && DISCOVERY_QUEUE_DEPTH_MAX <= ADMIN_QUEUE_DEPTH_MAX);

// Memory per queue: the send buffer a queue always holds takes one step, so a queue with
// nothing pending can always take one; at least one data buffer is left after an R2T.
const _: () = assert!(TX_BUFFER_BYTES >= TX_STEP_BYTES && TX_BUFFER_BYTES <= TX_BUFFER_BYTES_MAX);
const _: () = assert!(TX_STEP_BYTES >= TRANSFER_BYTES_MAX + 256 + (AER_MAX + 1) * 32 + TERM_HLEN + TERM_DATA_MAX);
const _: () = assert!(QUEUE_BUFFERS_FIXED >= 2);
// An Authentication Send's data is one transfer, in one pooled data buffer.
const _: () = assert!(AUTH_SEND_BYTES_MAX <= TRANSFER_BYTES_MAX);
const _: () = assert!(QUEUES_PER_ADDRESS_DEFAULT >= 1 && QUEUES_PER_ADDRESS_DEFAULT <= QUEUES_PER_ADDRESS_MAX);

// Data: in-capsule data and H2CData PDUs are pieces of one transfer; IOCCSZ counts the
// capsule in 16-byte units; one framing (IN_CAPSULE_BYTES_MAX) serves admin and I/O
// queues, so it takes the admin queue's 8 KiB; the receive buffer holds two largest PDUs.
const _: () = assert!(IN_CAPSULE_BYTES_MAX <= TRANSFER_BYTES_MAX && IN_CAPSULE_BYTES_MAX.is_multiple_of(16));
const _: () = assert!(ADMIN_IN_CAPSULE_BYTES <= IN_CAPSULE_BYTES_MAX);
const _: () = assert!(H2C_DATA_BYTES_MAX as usize <= TRANSFER_BYTES_MAX);
const _: () = assert!(RX_BUFFER_BYTES >= 2 * PDU_BYTES_MAX && RX_BUFFER_BYTES.is_multiple_of(PAGE));
// The data of a capsule or H2CData PDU can start right after its header and digest.
const _: () = assert!(CAPSULE_CMD_HLEN + DIGEST_LEN <= PDO_MAX && DATA_HLEN + DIGEST_LEN <= PDO_MAX);
// A threshold past the largest read would turn the path off unseen.
const _: () = assert!(WRITE_THROUGH_BYTES_MIN <= TRANSFER_BYTES_MAX);
const _: () = assert!(TX_LENT_READS_MAX >= 1 && TX_LENT_READS_MAX <= QUEUE_DEPTH_MAX as usize);
// Namespace blocks are 512 or 4096 bytes (config.rs).
const _: () = assert!(TX_LENT_REST_BYTES_MAX >= 4096);

// Identify and logs: AERL, ELPE and a reservation log's Number of Available Log Pages are
// one byte; KAS counts 100 ms units in 16 bits; CNTLIDs above FFEFh are not controllers; a
// full namespace's Reservation Report (extended data structure) is one transfer.
const _: () = assert!(AER_MAX >= 1 && AER_MAX <= 256);
const _: () = assert!(ERROR_LOG_ENTRIES >= 1 && ERROR_LOG_ENTRIES <= 256);
const _: () = assert!(RESERVATION_NOTICES_MAX <= 255);
const _: () = assert!(KEEP_ALIVE_GRANULARITY_MS.is_multiple_of(100) && KEEP_ALIVE_GRANULARITY_MS / 100 <= u16::MAX as u32);
const _: () = assert!(CONTROLLERS_PER_SUBSYSTEM_MAX <= 0xffef);
const _: () = assert!(CONTROLLERS_PER_HOST_DEFAULT <= CONTROLLERS_PER_SUBSYSTEM_MAX);
const _: () = assert!(
    nearstore_wire::resv::STATUS_EXT_HEADER_LEN + RESERVATION_REGISTRANTS_MAX * nearstore_wire::resv::REGISTRANT_EXT_LEN
        <= TRANSFER_BYTES_MAX
);
const _: () = assert!(CHANGED_NS_LIST_MAX * 4 == 4096);

// Compute: a descriptor arrives in one EXEC transfer; a select's inline rows must fit the
// result they go back in; a controller's started commands each hold a result slot; the
// defaults pass the configuration's own checks (a chunk and its read-ahead fit a command's
// memory), and the fallback budget admits the default command and two full queues.
const _: () = assert!(nearstore_wire::compute::limits::DESCRIPTOR_BYTES_MAX <= TRANSFER_BYTES_MAX);
const _: () = assert!(nearstore_compute::select::INLINE_BYTES_MAX < RESULT_BYTES_MAX);
const _: () = assert!(COMPUTE_STARTED_PER_CONTROLLER_MAX <= RESULTS_HELD_MAX);
const _: () = assert!(COMPUTE_STARTED_PER_CONTROLLER_MAX <= COMPUTE_STARTED_MAX);
const _: () = assert!(
    COMPUTE_CHUNK_BYTES_DEFAULT >= COMPUTE_CHUNK_ALIGN_BYTES
        && COMPUTE_CHUNK_BYTES_DEFAULT <= COMPUTE_CHUNK_BYTES_MAX
        && COMPUTE_CHUNK_BYTES_DEFAULT.is_multiple_of(COMPUTE_CHUNK_ALIGN_BYTES)
        && COMPUTE_CHUNK_BYTES_MAX.is_multiple_of(COMPUTE_CHUNK_ALIGN_BYTES)
);
const _: () = assert!(COMPUTE_READAHEAD_CHUNKS_DEFAULT <= COMPUTE_READAHEAD_CHUNKS_MAX);
const _: () =
    assert!(COMPUTE_MEMORY_PER_COMMAND_BYTES_DEFAULT >= COMPUTE_CHUNK_BYTES_DEFAULT * (COMPUTE_READAHEAD_CHUNKS_DEFAULT as u64 + 1));
const _: () = assert!(COMPUTE_TIMEOUT_SECS_DEFAULT <= COMPUTE_TIMEOUT_SECS_MAX && RESULT_TTL_SECS_DEFAULT <= RESULT_TTL_SECS_MAX);
const _: () = assert!(MEMORY_BUDGET_FALLBACK_BYTES >= memory_budget_min(COMPUTE_MEMORY_PER_COMMAND_BYTES_DEFAULT));

// Configuration defaults inside their ranges; a peer stream reads at least one piece.
const _: () = assert!(BUSY_POLL_US_DEFAULT <= BUSY_POLL_US_MAX);
const _: () = assert!(IO_THREADS_DEFAULT >= 1 && IO_THREADS_DEFAULT <= IO_THREADS_MAX);
const _: () = assert!(CONNECT_TIMEOUT_MS_MIN <= CONNECT_TIMEOUT_MS_DEFAULT && CONNECT_TIMEOUT_MS_DEFAULT <= CONNECT_TIMEOUT_MS_MAX);
const _: () = assert!(PEER_CONNECTIONS_DEFAULT >= 1 && PEER_CONNECTIONS_DEFAULT <= PEER_CONNECTIONS_MAX);
const _: () = assert!(PEER_READ_AHEAD_BYTES_MIN >= nearstore_initiator::stream::IO_BYTES);
const _: () =
    assert!(PEER_READ_AHEAD_BYTES_MIN <= PEER_READ_AHEAD_BYTES_DEFAULT && PEER_READ_AHEAD_BYTES_DEFAULT <= PEER_READ_AHEAD_BYTES_MAX);
const _: () = assert!(PEER_TIMEOUT_SECS_DEFAULT >= 1 && PEER_TIMEOUT_SECS_DEFAULT <= PEER_TIMEOUT_SECS_MAX);
const _: () = assert!(VOLUME_CACHE_ENTRIES_DEFAULT <= VOLUME_CACHE_ENTRIES_MAX);
const _: () = assert!(VOLUME_TRANSLATE_TIMEOUT_MS_DEFAULT >= 1 && VOLUME_TRANSLATE_TIMEOUT_MS_DEFAULT <= VOLUME_TRANSLATE_TIMEOUT_MS_MAX);
// Fair I/O: an epoch's budget at the largest bandwidth stays far within i64; a queue's
// waiting operations are its commands (at most its depth).
const _: () = assert!(
    FAIR_BANDWIDTH_MIN <= FAIR_BANDWIDTH_MAX && (FAIR_BANDWIDTH_MAX as u128 * FAIR_EPOCH_US as u128 / 1_000_000) < (i64::MAX as u128) >> 16
);
const _: () = assert!(FAIR_WAITING_PER_QUEUE_MAX == QUEUE_DEPTH_MAX as usize && FAIR_TENANTS_MAX >= 2);
// A quantum (the largest operation, an offload chunk at most) at the largest weight ratio
// stays far within i64.
const _: () = assert!(COMPUTE_CHUNK_BYTES_MAX as u128 * TENANT_WEIGHT_MAX as u128 * 4 < i64::MAX as u128);

/// A namespace's MicroTx journal (microtx.rs, docs/compute-protocol.md "The MicroTx
/// journal"), in bytes: 16 MiB holds about 60 transactions of the largest size between
/// checkpoints (a checkpoint costs one write and one flush) and is read whole at start-up
/// in tens of milliseconds.
pub const MICROTX_JOURNAL_BYTES: u64 = 16 << 20;
/// The journal's unit of writing, in bytes: a transaction's records start on one, so a
/// record torn by a crash never straddles another transaction's. 4 KiB: the largest
/// logical block a namespace's file or device has.
pub const MICROTX_JOURNAL_BLOCK_BYTES: usize = 4096;
/// One checkpoint slot, in bytes (two at the journal's start): its header and
/// MICROTX_OUTCOMES_MAX outcomes of 32 bytes fit.
pub const MICROTX_CHECKPOINT_BYTES: usize = 16384;
/// Transaction outcomes a journal keeps for hosts asking after a reconnect: 256, the
/// deepest queue a host may have in flight (QUEUE_DEPTH_MAX) on one namespace.
pub const MICROTX_OUTCOMES_MAX: usize = QUEUE_DEPTH_MAX as usize;
/// Bytes one fused operation writes, in bytes: a transfer (MDTS) of payload grows by a
/// block of read-modify-write at each end and by its trailer or compression frame, so
/// twice a transfer covers every operation.
pub const MICROTX_TX_BYTES_MAX: usize = 2 * TRANSFER_BYTES_MAX;
/// Separate writes in one fused operation: each is a record of its own; 16 covers the
/// operations of docs/compute-protocol.md (at most 2) with room.
pub const MICROTX_TX_WRITES_MAX: usize = 16;
/// FUSED WRITEs admitted per namespace, waiting for their turn on its journal or running:
/// 256, one host's full queue (QUEUE_DEPTH_MAX). Each holds its transfer's pooled buffer,
/// charged to its queue's memory, and waits as a task, not on a thread. The journal runs
/// one group at a time, three flushes each: past a full queue of them, several hosts'
/// commands would wait behind many groups, holding their buffers, where a retry costs a
/// round trip. One more is refused with Command Interrupted (DNR clear), which the host
/// retries.
pub const FUSED_WAITING_PER_NAMESPACE_MAX: usize = QUEUE_DEPTH_MAX as usize;
/// FUSED WRITEs of a namespace committed as one group (group commit, microtx.rs
/// `Journal::run_group`): those waiting when the journal's previous group ended, in
/// arrival order, up to 64 of them and MICROTX_GROUP_BYTES_MAX of journal. A group costs
/// three flushes whatever its size, so at a deep queue the flushes per operation fall by
/// its size; 64 bounds the images a group holds and the wait of its last member. Measured
/// in docs/benchmarks.md ("Group commit").
pub const MICROTX_GROUP_TXS_MAX: usize = 64;
/// Journal bytes one group may take (its members' records, `Journal::space`), in bytes:
/// 4 MiB, a quarter of MICROTX_JOURNAL_BYTES, so a full journal's checkpoint comes after
/// four groups at the least, and the block images a group holds in memory stay under it
/// (one transaction, MICROTX_TX_BYTES_MAX, is far smaller).
pub const MICROTX_GROUP_BYTES_MAX: u64 = 4 << 20;

// A fused write's descriptor names at most as many extents as a transaction has writes
// (each extent one write); its data, one transfer, framed as a LevelDB log record (a
// header per 32 KiB block and a block's zero-filled tail) and widened to whole logical
// blocks at both ends, fits one transaction.
const _: () = assert!(nearstore_wire::fused::EXTENTS_MAX <= MICROTX_TX_WRITES_MAX);
const _: () = assert!(
    TRANSFER_BYTES_MAX
        + (TRANSFER_BYTES_MAX / (nearstore_wire::fused::LOG_BLOCK_BYTES - nearstore_wire::fused::LOG_HEADER_BYTES) + 2)
            * nearstore_wire::fused::LOG_HEADER_BYTES
        + 2 * MICROTX_JOURNAL_BLOCK_BYTES
        <= MICROTX_TX_BYTES_MAX
);
// compress-write's extents cover the largest zstd frame of a transfer of data.
const _: () = assert!(nearstore_wire::fused::compress_bound(TRANSFER_BYTES_MAX) + 2 * MICROTX_JOURNAL_BLOCK_BYTES <= MICROTX_TX_BYTES_MAX);

#[cfg(test)]
mod tests {
    use super::*;

    /// The value cell of the row of `doc`'s table whose first cell is `limit`.
    fn cell<'a>(doc: &'a str, limit: &str) -> &'a str {
        let row = doc.lines().find(|l| l.starts_with(&format!("| {limit} |"))).unwrap_or_else(|| panic!("no row {limit:?}"));
        row.split('|').nth(2).map_or("", str::trim)
    }

    /// The largest PDUs the target's framing (as ICResp sets it) accepts from a host are
    /// PDU_BYTES_MAX long: a capsule and an H2CData PDU with their most data at PDO 255 and
    /// a data digest; one byte more of data is refused.
    #[test]
    fn the_largest_pdu_a_host_may_send_is_pdu_bytes_max() {
        use nearstore_wire::pdu::{fes, flags, parse_frame, DataHdr, Framing, PduType};
        let f = Framing {
            hdgst: true,
            ddgst: true,
            from_host: true,
            capsule_data_max: IN_CAPSULE_BYTES_MAX as u32,
            data_pdu_max: H2C_DATA_BYTES_MAX,
        };
        // A PDU of type `t` with `psh`, its data of `len` bytes at PDO 255, both digests.
        let pdu = |t: PduType, psh: &[u8], len: usize| {
            let hlen = 8 + psh.len();
            let plen = PDO_MAX + len + DIGEST_LEN;
            let mut b = vec![t as u8, flags::HDGSTF | flags::DDGSTF, hlen as u8, PDO_MAX as u8];
            b.extend_from_slice(&(plen as u32).to_le_bytes());
            b.extend_from_slice(psh);
            b.extend_from_slice(&crc32c::crc32c(&b).to_le_bytes());
            b.resize(PDO_MAX, 0);
            b.extend(std::iter::repeat_n(0x5a, len));
            b.extend_from_slice(&crc32c::crc32c(&b[PDO_MAX..]).to_le_bytes());
            b
        };
        let h2c = |len: usize| DataHdr { cccid: 1, ttag: 0, offset: 0, len: len as u32 }.psh().to_vec();
        let sqe = [0u8; 64];
        let (c, d) = (IN_CAPSULE_BYTES_MAX, H2C_DATA_BYTES_MAX as usize);
        // (what, PDU, accepted)
        let cases = [
            ("capsule, most in-capsule data", pdu(PduType::CapsuleCmd, &sqe, c), true),
            ("capsule, one byte more", pdu(PduType::CapsuleCmd, &sqe, c + 1), false),
            ("H2CData, MAXH2CDATA", pdu(PduType::H2CData, &h2c(d), d), true),
            ("H2CData, one byte more", pdu(PduType::H2CData, &h2c(d + 1), d + 1), false),
        ];
        let mut longest = 0;
        for (what, b, accepted) in cases {
            match parse_frame(&b, &f) {
                Ok(Some(frame)) if accepted => {
                    assert_eq!(frame.len, b.len(), "{what}");
                    longest = longest.max(frame.len);
                }
                Err(e) if !accepted => assert_eq!(e.fes, fes::DATA_LIMIT_EXCEEDED, "{what}: {e}"),
                r => panic!("{what}: {:?}", r.map(|f| f.map(|f| f.len))),
            }
        }
        assert_eq!(longest, PDU_BYTES_MAX);
    }

    /// docs/protocol.md's table of limits and docs/compute-protocol.md's say what the code
    /// has. Each line: the document, the row, and the value the code gives it.
    #[test]
    fn the_documents_tables_are_the_code() {
        let protocol = include_str!("../../../docs/protocol.md");
        let compute = include_str!("../../../docs/compute-protocol.md");
        let kib = |b: usize| format!("{} KiB", b >> 10);
        let cases: Vec<(&str, &str, String)> = vec![
            (protocol, "MDTS (largest transfer of one command)", format!("{MDTS} ({})", kib(TRANSFER_BYTES_MAX))),
            (protocol, "in-capsule data, I/O queues (IOCCSZ)", kib(IN_CAPSULE_BYTES_MAX)),
            (protocol, "in-capsule data, admin queue", kib(ADMIN_IN_CAPSULE_BYTES)),
            (protocol, "data in one H2CData PDU (MAXH2CDATA)", kib(H2C_DATA_BYTES_MAX as usize)),
            (protocol, "largest PDU from a host, headers, padding (PDO up to 255) and digests included", format!("{PDU_BYTES_MAX} bytes")),
            (protocol, "receive buffer per connection", kib(RX_BUFFER_BYTES)),
            (protocol, "response data waiting before commands stop being read", format!("{} MiB", TX_PENDING_BYTES_MAX >> 20)),
            (protocol, "I/O queue entries (CAP.MQES + 1, MAXCMD)", QUEUE_DEPTH_MAX.to_string()),
            (protocol, "admin queue entries (ASQSZ)", ADMIN_QUEUE_DEPTH_MAX.to_string()),
            (protocol, "discovery admin queue entries (its ASQSZ)", DISCOVERY_QUEUE_DEPTH_MAX.to_string()),
            (protocol, "I/O queues per controller", IO_QUEUES_MAX.to_string()),
            (protocol, "namespaces per subsystem (NN)", NSID_MAX.to_string()),
            (protocol, "controllers per subsystem", CONTROLLERS_PER_SUBSYSTEM_MAX.to_string()),
            (protocol, "Asynchronous Event Requests outstanding (AERL + 1)", AER_MAX.to_string()),
            (protocol, "Cross-Controller Resets waiting per admin queue", CROSS_CONTROLLER_RESETS_MAX.to_string()),
            (protocol, "a Cross-Controller Reset's wait for the reset controller's work", format!("{CROSS_CONTROLLER_RESET_WAIT_MS} ms")),
            (protocol, "error log entries (ELPE + 1)", ERROR_LOG_ENTRIES.to_string()),
            (protocol, "reservation registrants per namespace", RESERVATION_REGISTRANTS_MAX.to_string()),
            (protocol, "Reservation Notification log pages kept per controller", RESERVATION_NOTICES_MAX.to_string()),
            (protocol, "namespaces in the Changed Namespace List log", CHANGED_NS_LIST_MAX.to_string()),
            (protocol, "keep-alive granularity (KAS)", format!("{KEEP_ALIVE_GRANULARITY_MS} ms")),
            (protocol, "ready timeout (CAP.TO)", format!("{READY_TIMEOUT_500MS} ({} s)", READY_TIMEOUT_500MS as f64 / 2.0)),
            (protocol, "a TermReq's time to leave before the socket closes", format!("{TERM_FLUSH_TIMEOUT_MS} ms")),
            (protocol, "Authentication Send data (TL)", format!("{AUTH_SEND_BYTES_MAX} bytes")),
            (protocol, "Compare and Write ranges held or waited for per namespace", RANGE_LOCKS_MAX.to_string()),
            (compute, "descriptor size", format!("{} (one transfer, MDTS)", kib(nearstore_wire::compute::limits::DESCRIPTOR_BYTES_MAX))),
            (compute, "arguments", kib(nearstore_wire::compute::limits::ARGS_BYTES_MAX)),
            (compute, "objects (inputs + outputs)", nearstore_wire::compute::limits::OBJECTS_MAX.to_string()),
            (compute, "extents per object", nearstore_wire::compute::limits::EXTENTS_PER_OBJECT_MAX.to_string()),
            (compute, "result size", kib(RESULT_BYTES_MAX)),
            (compute, "results held per controller (running commands included)", RESULTS_HELD_MAX.to_string()),
            (compute, "how long a result is held", format!("{RESULT_TTL_SECS_DEFAULT} s")),
            (
                compute,
                "memory per command (chunk buffers + the operation's own)",
                format!("{} MiB", COMPUTE_MEMORY_PER_COMMAND_BYTES_DEFAULT >> 20),
            ),
            (compute, "run time per command", format!("{COMPUTE_TIMEOUT_SECS_DEFAULT} s")),
        ];
        for (doc, limit, value) in &cases {
            assert_eq!(cell(doc, limit), value, "{limit}");
        }
    }
}
