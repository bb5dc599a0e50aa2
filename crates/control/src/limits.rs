//! Every limit of the control plane, with its unit and why it has that value. Requests are
//! sized by these, never by a length a peer sends.

/// Largest request body the API reads, in bytes: a target's registration is the largest
/// request (POOLS_PER_TARGET_MAX pools, each with a path and a name); anything larger is
/// refused with 413 before it is parsed.
pub const BODY_BYTES_MAX: usize = 512 * 1024;
/// The shortest control token (`nearstore control --token-file`), in characters: 16, so
/// that a token is never a guessable word; `head -c 32 /dev/urandom | base64` gives 44.
pub const TOKEN_CHARS_MIN: usize = 16;

/// Largest response body the client reads, in bytes: `volume info` lists only allocated
/// extents (about 200 bytes each in JSON), so 64 MiB holds more than 300,000 of them; a
/// reply beyond it fails the call instead of growing the client's memory.
pub const RESPONSE_BYTES_MAX: usize = 64 << 20;

/// Longest volume, pool or target name, in bytes (a file name's limit on Linux).
pub const NAME_BYTES_MAX: usize = 255;

/// Longest pool path, in bytes (PATH_MAX on Linux).
pub const PATH_BYTES_MAX: usize = 4096;

/// Longest NQN, in bytes (NVMe Base Specification, "NVMe Qualified Names").
pub const NQN_BYTES_MAX: usize = 223;

/// Pools one target may register: a target serves a handful of drives or files; 64 bounds
/// the registration body and the placement's scan.
pub const POOLS_PER_TARGET_MAX: usize = 64;

/// Targets the control plane keeps: a rack of storage servers several times over; bounds
/// the view's size and a placement's scan (TARGETS_MAX * POOLS_PER_TARGET_MAX pools).
pub const TARGETS_MAX: usize = 1024;

/// Volumes the control plane keeps: bounds `volume list` and the store's volume table.
pub const VOLUMES_MAX: usize = 65536;

/// Smallest extent, in bytes: below 1 MiB the extent table of a large volume grows past
/// what a translation cache can hold, and a placement per MiB is too many.
pub const EXTENT_BYTES_MIN: u64 = 1 << 20;
/// Largest extent, in bytes: 1 GiB still spreads a 64 GiB volume over 64 pools.
pub const EXTENT_BYTES_MAX: u64 = 1 << 30;
/// Extent size when a volume does not name one, in bytes (Flint's evaluation used extents of
/// tens of MiB; 64 MiB spreads a 64 GiB volume over 1024 extents).
pub const EXTENT_BYTES_DEFAULT: u64 = 64 << 20;
/// Extents are placed at multiples of their size in a pool and read in blocks: every extent
/// size is a multiple of this, the largest NVMe logical block size nearstore serves.
pub const EXTENT_ALIGN_BYTES: u64 = 4096;

/// Extents in one volume: the extent table of one volume (and the data path's cache of it,
/// next) stays indexable by u32 and a full table fits in memory (about 100 bytes each, 100 MiB
/// at most); 2^20 extents of 64 MiB are 64 TiB.
pub const EXTENTS_PER_VOLUME_MAX: u64 = 1 << 20;

/// Largest volume, in bytes: EXTENTS_PER_VOLUME_MAX extents of the largest size (1 PiB).
pub const VOLUME_BYTES_MAX: u64 = EXTENTS_PER_VOLUME_MAX * EXTENT_BYTES_MAX;

/// Hosts one export names: a volume is served to a handful of hosts (a cluster's nodes);
/// 1024 bounds the export record and the subsystem's host list.
pub const HOSTS_PER_EXPORT_MAX: usize = 1024;

/// Milliseconds `GET /v1/exports?since=V` holds a request while nothing changed (a long
/// poll): a target learns a new export at once, and the call ends well within a client's
/// REQUEST_TIMEOUT_MS.
pub const EXPORTS_WAIT_MS: u64 = 5000;

/// Milliseconds a target serves its exports past the request of its last answer to the
/// exports' long poll (its export lease; `nearstore control --export-lease-ms`). The long
/// poll holds a request a third of it at most; a target whose call to a dead leader times
/// out (REQUEST_TIMEOUT_MS) after the poll's hold (EXPORTS_WAIT_MS) finds the standby
/// leading within FAILOVER_MS: the default lease outlasts the three with 15 s to spare, so
/// that a leader's failover at the default `--lease-ttl` does not stop volumes
/// (`nearstore control` refuses a lease that does not outlast its own `--lease-ttl`'s).
pub const EXPORT_LEASE_MS_DEFAULT: u64 = 60_000;
pub const EXPORT_LEASE_MS_MIN: u64 = 1000;
pub const EXPORT_LEASE_MS_MAX: u64 = 600_000;

/// The shortest export lease that outlasts a failover of a control plane on etcd whose
/// leader lease is `lease_ttl_s`: a poll's hold, two calls to the dead leader (the client
/// tries it first until a call succeeds elsewhere, and standbys name it until its key
/// ends), the exporter's pause between tries, and the standby leading within the TTL and
/// 5 s.
pub const fn export_lease_ms_min_with_etcd(lease_ttl_s: u64) -> u64 {
    EXPORTS_WAIT_MS + 2 * REQUEST_TIMEOUT_MS + AGENT_RETRY_MS_MAX + lease_ttl_s * 1000 + 5000 + 1
}

/// Milliseconds a handover lasts beyond the lease and the write bound: a deposed etcd
/// leader answers the exports poll for up to a keep-alive round after its lease ended, and
/// the daemons' clocks may differ by a little (docs/control-plane.md, "Handing an export
/// over").
pub const EXPORT_HANDOVER_MARGIN_MS: u64 = 5000;

/// Milliseconds a target's pool writes may land after it stops issuing them, for a target
/// that did not say (`Target::write_bound_ms`), as a target with the default settings
/// declares it: the longer of a peer write given up after `cluster.timeout_secs` (30 s)
/// then its lost connection's bound (2 x the 10 s keep-alive + the reset's wait, 40 s),
/// and a compute command with outputs forwarded to a peer's pool (its connection's 30 s,
/// twice its 600 s time limit, the reset's wait), and 30 s more for operations a target's
/// own schedulers hold (nearstore_target::cluster::ClusterConfig::write_bound).
pub const EXPORT_WRITE_BOUND_MS_DEFAULT: u64 = 1_300_000;
/// The most a target may declare: three days (twice the longest compute time limit,
/// `compute.timeout_secs` at a day, and more).
pub const EXPORT_WRITE_BOUND_MS_MAX: u64 = 3 * 86_400_000;

/// Milliseconds a client waits for one API call (connect, request, reply): a call does at
/// most one store commit (an fsync), well under a second on any disk.
pub const REQUEST_TIMEOUT_MS: u64 = 10_000;

/// Milliseconds a client goes on looking for the leader among its addresses (standbys
/// answer `not_leader`, a killed daemon refuses connections): a standby takes over within the
/// default lease (LEASE_TTL_S_DEFAULT) plus LEADER_POLL_MS, and a call should outlast one
/// takeover, not a control plane that is down.
pub const FAILOVER_MS: u64 = LEASE_TTL_S_DEFAULT * 1000 + 5000;
/// Milliseconds a client waits after every address refused it, before the next round: a few
/// of LEADER_POLL_MS, so a takeover is found soon without spinning on refusals.
pub const FAILOVER_ROUND_MS: u64 = 200;

/// Milliseconds between two samples of a view agent: the EWMAs' time step.
pub const VIEW_SAMPLE_MS: u64 = 1000;
/// Milliseconds after which an agent pushes its view even if no figure crossed its threshold:
/// the control plane's proof that the pool is alive.
pub const VIEW_PUSH_INTERVAL_MS: u64 = 10_000;
/// A pool whose target has not been heard from (a view, a registration) for this many
/// milliseconds is stale: shown so, and given no new extents. Three missed pushes: one lost
/// push or a slow second is not a dead target, three in a row likely are.
pub const VIEW_STALE_MS: u64 = 3 * VIEW_PUSH_INTERVAL_MS;
/// Weight of the newest sample in the agent's EWMAs, in percent: 30% follows a change within
/// about three samples and smooths single-sample spikes.
pub const VIEW_EWMA_PERCENT: u64 = 30;
/// Link views the control plane keeps at most (a target's to each other target it reaches:
/// TARGETS_MAX pairs would be a million; a link is forgotten after 2 x VIEW_STALE_MS of
/// silence).
pub const LINKS_MAX: usize = 16_384;
/// Relative change of a figure, in percent, that makes an agent push before the interval.
pub const VIEW_CHANGE_PERCENT: u64 = 10;
/// Milliseconds between an agent's attempts to reach an unreachable control plane, at most.
pub const AGENT_RETRY_MS_MAX: u64 = 5000;

const _: () = assert!(BODY_BYTES_MAX >= POOLS_PER_TARGET_MAX * (PATH_BYTES_MAX + NAME_BYTES_MAX + 256) + NQN_BYTES_MAX + 1024);
const _: () = assert!(EXTENT_BYTES_MIN.is_multiple_of(EXTENT_ALIGN_BYTES) && EXTENT_BYTES_MAX.is_multiple_of(EXTENT_ALIGN_BYTES));
const _: () = assert!(EXTENT_BYTES_MIN <= EXTENT_BYTES_DEFAULT && EXTENT_BYTES_DEFAULT <= EXTENT_BYTES_MAX);
const _: () = assert!(EXTENTS_PER_VOLUME_MAX <= u32::MAX as u64);
const _: () = assert!(EXPORTS_WAIT_MS < REQUEST_TIMEOUT_MS);
const _: () = assert!(EXPORT_LEASE_MS_DEFAULT >= export_lease_ms_min_with_etcd(LEASE_TTL_S_DEFAULT) + 10_000);
const _: () = assert!(EXPORT_LEASE_MS_MIN <= EXPORT_LEASE_MS_DEFAULT && EXPORT_LEASE_MS_DEFAULT <= EXPORT_LEASE_MS_MAX);
const _: () = assert!(VIEW_SAMPLE_MS < VIEW_PUSH_INTERVAL_MS && VIEW_PUSH_INTERVAL_MS < VIEW_STALE_MS);

/// Milliseconds a move waits for a word of its copier (its acknowledgement, a progress
/// report, its publication) before the control plane aborts it: the copier reports at least
/// every MOVE_REPORT_MS, so ten of those missed is a dead or cut-off copier, not a slow one.
pub const MOVE_SILENCE_MS: u64 = 10 * MOVE_REPORT_MS;
/// Milliseconds between a copier's progress reports of one move, at most.
pub const MOVE_REPORT_MS: u64 = 1000;
/// Milliseconds between the control plane's looks for silent moves.
pub const MOVE_SWEEP_MS: u64 = 500;
/// Moves under way at once in the whole cluster: bounds the moves' list (a reply of about
/// 500 bytes each) and the store's move table; rebalance and drain run a few at a time.
pub const MOVES_MAX: usize = 1024;
const _: () = assert!(MOVE_SWEEP_MS < MOVE_SILENCE_MS && MOVE_REPORT_MS * 2 < MOVE_SILENCE_MS);

/// Attempts of one commit whose outcome stays unknown (etcd: a member or its leader lost
/// mid-request): with the backoff below, about 20 s, longer than a leader lease, whose end
/// stops the retries first (the leader's lease is what makes a retry safe).
pub const COMMIT_ATTEMPTS_MAX: u32 = 48;
/// Milliseconds before the first retry of a commit whose outcome is unknown (about an etcd
/// election's heartbeat), doubling up to the maximum.
pub const COMMIT_RETRY_MS_MIN: u64 = 50;
/// Longest wait between two attempts of one commit, in milliseconds: an etcd election takes
/// about one election timeout (1 s by default), so a retry comes soon after it.
pub const COMMIT_RETRY_MS_MAX: u64 = 500;

/// Seconds of the control plane's leader lease in etcd (`--lease-ttl`, default): a daemon
/// that dies is replaced by a standby within this (plus LEADER_POLL_MS); a leader cut off
/// from etcd for this long stops writing. etcd refuses less than 1.5 of its election
/// timeouts; 10 s rides out an etcd leader election (1 s by default) with room.
pub const LEASE_TTL_S_DEFAULT: u64 = 10;
/// Shortest and longest `--lease-ttl`, in seconds: below 2 s one slow keep-alive loses the
/// lease; above 300 s a dead leader leaves the API read-only for too long.
pub const LEASE_TTL_S_MIN: u64 = 2;
pub const LEASE_TTL_S_MAX: u64 = 300;
/// Milliseconds between a standby's looks at the leader key: a takeover comes within this
/// after the old lease ends.
pub const LEADER_POLL_MS: u64 = 250;
/// Milliseconds one etcd request may take (connect, then the call): a commit is a few fsyncs,
/// and a member without a leader refuses at once, so a longer wait is a member or a link
/// lost; the request is then sent again (a commit on the lease's terms, COMMIT_ATTEMPTS_MAX).
/// Two fit in the shortest lease, so one lost keep-alive does not lose it.
pub const ETCD_REQUEST_MS: u64 = 1000;
/// Attempts of one etcd read (or lease revocation) that failed: the client balances requests
/// over the members and may pick a dead one, about one time in two; eight attempts 50 ms
/// apart find a live one but for one time in 256.
pub const ETCD_READ_ATTEMPTS_MAX: u32 = 8;
/// Operations in one etcd transaction: etcd's own default (`--max-txn-ops`); a commit is one
/// operation a record write, one for the commit counter, plus the guard's reads. The largest
/// batch is a registration: POOLS_PER_TARGET_MAX pools and the target. Deleting a volume
/// deletes its extents as one key range, one operation however many.
pub const ETCD_TXN_OPS_MAX: usize = 128;
/// Bytes of one etcd transaction's keys and values: under etcd's default request limit
/// (`--max-request-bytes`, 1.5 MiB) with room for the gRPC framing.
pub const ETCD_TXN_BYTES_MAX: usize = 1400 * 1024;
/// Keys read per request while loading: a pool record is at most about 4.5 KiB (its path),
/// so a page stays under 2 MiB, below the gRPC client's 4 MiB message limit.
pub const ETCD_LOAD_PAGE_KEYS: i64 = 400;
const _: () = assert!(POOLS_PER_TARGET_MAX + 2 + 2 <= ETCD_TXN_OPS_MAX);
const _: () = assert!(BODY_BYTES_MAX * 2 <= ETCD_TXN_BYTES_MAX);
const _: () = assert!((ETCD_LOAD_PAGE_KEYS as usize) * (PATH_BYTES_MAX + NAME_BYTES_MAX * 2 + 512) < 4 << 20);
const _: () = assert!(LEASE_TTL_S_MIN <= LEASE_TTL_S_DEFAULT && LEASE_TTL_S_DEFAULT <= LEASE_TTL_S_MAX);
const _: () = assert!(ETCD_REQUEST_MS * 2 <= LEASE_TTL_S_MIN * 1000);
const _: () = assert!(FAILOVER_MS > LEASE_TTL_S_DEFAULT * 1000 + LEADER_POLL_MS && FAILOVER_ROUND_MS < FAILOVER_MS);

/// Tenants the control plane keeps: the targets' own bound (nearstore_target's TENANTS_MAX,
/// which a target's configured tenants share with the pushed ones).
pub const TENANTS_MAX: usize = 256;
/// Host NQNs of one tenant, and what it reaches: a tenant record stays under the size the
/// etcd store's load pages are sized for (ETCD_LOAD_PAGE_KEYS). A tenant of more hosts is
/// configured on the targets (`[[tenant]]`, 1024 hosts).
pub const TENANT_HOSTS_MAX: usize = 12;
pub const TENANT_REACH_MAX: usize = 8;
/// A tenant's name: the targets' bound (TENANT_NAME_BYTES_MAX there).
pub const TENANT_NAME_BYTES_MAX: usize = 64;
/// The largest weight: the targets' (TENANT_WEIGHT_MAX there); 0 would never be scheduled.
pub const TENANT_WEIGHT_MAX: u32 = 10_000;
const _: () = assert!(
    (TENANT_HOSTS_MAX + TENANT_REACH_MAX) * (NQN_BYTES_MAX + 3) + TENANT_NAME_BYTES_MAX + 256 <= PATH_BYTES_MAX + NAME_BYTES_MAX * 2 + 512
);

// The arbiter (arbiter.rs, docs/fair-io.md "The arbiter").

/// How often a target asks the arbiter for its grants, in milliseconds (Flint's batch): long
/// enough that a request per target per period costs the control plane little (a hundred
/// targets are a thousand small requests a second), short enough that a tenant starting to
/// read gets its share within a few periods.
pub const ARBITER_PERIOD_MS: u64 = 100;
/// How long a grant holds at the target after it arrived, in milliseconds: ten periods, so
/// lost requests change nothing (a gate whose grant ran out lets its tenant go unheld,
/// while the pools, answered, leave the peers' operations to their gates: the arbiter
/// simulation, crates/sim, saw a tenant take three times its share behind five lost
/// answers in a row); past it, an arbiter that stopped answering leaves the targets to
/// their local fair sharing.
pub const ARBITER_GRANT_TTL_MS: u64 = 10 * ARBITER_PERIOD_MS;
/// A client (a requesting target's tenant on a pool) not heard from for this long, in
/// milliseconds, is no longer active on the pool: its share goes to the others.
pub const ARBITER_CLIENT_TTL_MS: u64 = 3 * ARBITER_PERIOD_MS;
/// The smallest slice the arbiter hands out in a round, in bytes; a period's bandwidth is
/// divided in at most ARBITER_SLICES_MAX slices, so one division costs at most that many
/// rounds whatever the bandwidth.
pub const ARBITER_SLICE_BYTES_MIN: u64 = 64 * 1024;
pub const ARBITER_SLICES_MAX: u64 = 1024;
/// A client that moved at least this share of its grant, in percent, is saturated: it may
/// want more, and demands as much as it may have (arbiter.rs). Below it, it demands twice
/// what it moved.
pub const ARBITER_SATURATED_PERCENT: u64 = 80;
/// The share of a pool's declared bandwidth the arbiter grants, in percent: the grants
/// together leave the pool's own scheduler a little room, so that its queue drains and
/// each tenant moves its grant; at 100% the operations of the peers' tenants, one key
/// there, queue behind one another and a tenant of large operations falls short of its
/// grant (crates/sim's arbiter simulation: 0.083 of the pool for a share of 0.111).
pub const ARBITER_SHARE_PERCENT: u64 = 95;
/// A grant's batch, in milliseconds of its rate: the cost bytes its target lets go at once
/// (its bucket), at least a slice. Short, so that the pool's queue never holds much more
/// than its bandwidth serves in this time ahead of another client's operation.
pub const ARBITER_BATCH_MS: u64 = 10;
/// Demands one request carries: a target's tenants (256) on the pools its volumes reach is
/// far more, but a request stays within BODY_BYTES_MAX (about 400 bytes a demand in JSON).
pub const ARBITER_DEMANDS_MAX: usize = 1024;
/// Clients one pool's book holds: beyond it a new client is refused a grant (its target
/// stays with local fair sharing for it) until an idle one is forgotten.
pub const ARBITER_CLIENTS_PER_POOL_MAX: usize = 1024;
/// Pools the arbiter keeps books of: every pool the control plane can hold.
pub const ARBITER_POOLS_MAX: usize = TARGETS_MAX * POOLS_PER_TARGET_MAX;
/// What a written byte may cost against a read one (nearstore_target's FAIR_WRITE_COST_MAX).
pub const WRITE_COST_MAX: f64 = 64.0;
const _: () = assert!(ARBITER_DEMANDS_MAX * 400 <= BODY_BYTES_MAX);
const _: () = assert!(ARBITER_CLIENT_TTL_MS < ARBITER_GRANT_TTL_MS && ARBITER_PERIOD_MS * 2 < ARBITER_CLIENT_TTL_MS);
