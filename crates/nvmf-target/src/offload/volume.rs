//! Compute commands on an exported volume run where the volume's bytes lie
//! (docs/compute.md, "Files on volumes").
//!
//! A host sends a compute command to the volume's namespace on the target exporting it,
//! which admitted the host at Connect: authority follows the host. Its extents are volume
//! addresses (a file's FIEMAP extents on a file system on the volume). Before the command
//! runs, the exporting target translates every extent through the volume's extent table
//! (its mapping cache, else the control plane, as a read would: nothing is allocated):
//!
//! - every byte (inputs and outputs) in one pool namespace of a peer: the command, its
//!   extents now that pool's byte offsets and unallocated ones zeros, is sent to that
//!   peer's pool subsystem, as this cluster member for itself, and its result is this
//!   command's (the peer computes next to its data; nothing crosses the network but the
//!   result);
//! - every byte in one pool namespace of this target: the command runs here on that pool;
//! - otherwise (bytes on several pools, an output not yet allocated, tagged extents): it
//!   runs here through the volume's device, which reads each extent from its pool (peers'
//!   over NVMe/TCP) and allocates an output's extents on first write.
//!
//! A host never names a pool: the exporting target derives every pool address from the
//! volume's own extent table, so a command reaches only that volume's blocks.
//!
//! A command run on a pool (here or on a peer) holds a ticket of every extent it reaches
//! there, taken with the translation as a read's is, until it ends: a move of one of those
//! extents waits for it as for I/O in flight (docs/control-plane.md, "Moving an extent"),
//! so the copy never misses its output and the old place is never freed under it. One that
//! outlives the move's drain (`MOVE_DRAIN_MS`) makes the move abort; the extent stays.
//! A command placed after a move blocked its extent waits for the move's end, as I/O does.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nearstore_initiator::Error as InitiatorError;
use nearstore_wire::compute::{limits as wl, status as cs, Descriptor, Extent, Object};

use super::Failure;
use crate::cluster::{self, PeerConfig};
use crate::dev::volume::{PoolRef, Ticket, Volume};
use crate::subsystem::Namespace;

/// Where a command on a volume runs.
pub(super) enum Place {
    /// Here, through the volume's device, as the host sent it.
    Here,
    /// On this target's pool namespace, with the descriptor in its addresses and the
    /// tickets of its extents, held until the command ends.
    Pool(Arc<Namespace>, Descriptor, Vec<Ticket>),
    /// On a peer's pool namespace, with the descriptor in its addresses and the tickets of
    /// its extents, held until the peer answered.
    Peer(Arc<PoolRef>, Descriptor, Vec<Ticket>),
}

/// Appends an extent, merged with the last when they continue each other.
fn push(out: &mut Vec<Extent>, e: Extent) {
    if let Some(last) = out.last_mut() {
        let contiguous = if e.is_zeros() { last.is_zeros() } else { !last.is_zeros() && last.offset + last.len == e.offset };
        if contiguous {
            last.len += e.len;
            return;
        }
    }
    out.push(e);
}

/// `o`'s extents in the addresses of the one pool that holds all of them (`holder`, set by
/// the first allocated extent met), their tickets in `held`. None: they do not all lie in
/// one pool, an output extent is not allocated, or the translation failed (the command then
/// runs here, where the volume's device says why).
async fn translate(vol: &Volume, o: &Object, output: bool, holder: &mut Option<Arc<PoolRef>>, held: &mut Vec<Ticket>) -> Option<Object> {
    let mut out = Vec::new();
    for e in &o.extents {
        if e.is_zeros() {
            push(&mut out, *e);
            continue;
        }
        // Each piece is judged as soon as it is known: the first on another pool, or an
        // unallocated output, ends the translation before the control plane is asked of
        // the rest.
        let whole = vol.placement(e.offset, e.len, held, |p| {
            match p.at {
                None if output => return false,
                None => push(&mut out, Extent::zeros(p.len)),
                Some((pool, off)) => {
                    match holder {
                        Some(h) if **h != *pool => return false,
                        Some(_) => {}
                        None => *holder = Some(pool),
                    }
                    push(&mut out, Extent::data(off, p.len));
                }
            }
            out.len() <= wl::EXTENTS_PER_OBJECT_MAX
        });
        if !whole.await.ok()? {
            return None;
        }
    }
    Some(Object { len: o.len, extents: out })
}

/// Where the command `desc` on volume `vol` runs.
pub(super) async fn place(vol: Volume, desc: Descriptor) -> Place {
    let vol = &vol;
    if !desc.remote_tags().is_empty() {
        return Place::Here;
    }
    // Run here, the tickets taken so far go: the volume's device takes one per operation.
    let (mut holder, mut held) = (None, Vec::new());
    let mut inputs = Vec::with_capacity(desc.inputs.len());
    for o in &desc.inputs {
        let Some(t) = translate(vol, o, false, &mut holder, &mut held).await else { return Place::Here };
        inputs.push(t);
    }
    let mut outputs = Vec::with_capacity(desc.outputs.len());
    for o in &desc.outputs {
        let Some(t) = translate(vol, o, true, &mut holder, &mut held).await else { return Place::Here };
        outputs.push(t);
    }
    // Nothing allocated at all: zeros, computed here without a pool.
    let Some(pool) = holder else { return Place::Here };
    let d = Descriptor { inputs, outputs, ..desc };
    match vol.own_pool(&pool) {
        Some(ns) => Place::Pool(ns, d, held),
        None => Place::Peer(pool, d, held),
    }
}

/// Runs `desc` on a peer's pool namespace as cluster member `member` for itself; its result
/// (or its failure, status and message) is the command's.
pub(super) async fn on_peer(
    pool: Arc<PoolRef>,
    desc: Descriptor,
    member: String,
    connect: Duration,
    run: Duration,
) -> Result<Vec<u8>, Failure> {
    let name = format!("pool {} of {}", pool.nsid, pool.target);
    let address = pool.target.parse().map_err(|_| Failure::new(cs::PEER_FAILED, format!("{name}: its target is not an address")))?;
    let peer = PeerConfig { tag: 0, address, nqn: crate::POOLS_NQN.into(), nsid: pool.nsid };
    let mut conn = cluster::connect(&peer, &member, &member, connect, None)
        .await
        .map_err(|e| Failure::new(e.status, format!("{name}: {}", e.message)))?;
    let failure = |e: InitiatorError| match e {
        InitiatorError::Compute { status, message } => Failure::new(status, format!("on {name}: {message}")),
        e => Failure::new(cs::PEER_FAILED, format!("{name}: {e}")),
    };
    let (instance, started) = (conn.instance(), Instant::now());
    match conn.q.exec(pool.nsid, &desc.encode(), run).await {
        // The peer's result takes the place of this command's, in the budget reserved for it.
        Ok(cqe) => conn.q.fetch_result(&cqe, crate::limits::RESULT_BYTES_MAX).await.map_err(failure),
        // The peer answered: its command has ended.
        Err(e @ InitiatorError::Compute { .. }) => Err(failure(e)),
        Err(e) => {
            // No answer (a timeout, a lost connection): a command with outputs may still be
            // writing them at the peer. Its controller is reset there before this command
            // ends, so that nothing relying on its end (a move waiting for its extents'
            // tickets, a Preempt and Abort) meets a late write. If no reset succeeds, it ends
            // once the peer's command is past its own time limit: the peer keeps a
            // controller alive while its command runs, so its keep-alive timeout is no bound.
            // That limit runs from when the peer started it, within a time limit of being
            // sent (its queue), and is taken to be this target's (`compute.timeout_secs`).
            drop(conn);
            let until = started + 2 * run + cluster::reset_wait(connect);
            if !desc.outputs.is_empty() && !reset_until(&peer, &member, instance, connect, until).await {
                tracing::warn!(peer = %peer.address, cntlid = instance.cntlid, "a forwarded compute command's controller was not reset: ending it past twice its time limit");
            }
            Err(failure(e))
        }
    }
}

/// Resets `instance`, a lost controller of `member` at `peer` ([`cluster::reset_lost`]),
/// trying again (after 1 s, doubling to 4 s) until it succeeds or `until` has come (the
/// peer's command is past its time limit then), waiting until then if it never succeeds.
/// Whether it succeeded.
async fn reset_until(peer: &PeerConfig, member: &str, instance: nearstore_initiator::Instance, timeout: Duration, until: Instant) -> bool {
    let mut pause = crate::dev::remote::DOUBT_RETRY;
    loop {
        let attempt = tokio::time::timeout_at(until.into(), cluster::reset_lost(peer, member, member, instance, timeout));
        match attempt.await {
            Ok(Ok(())) => return true,
            Ok(Err(e)) => {
                tracing::warn!(peer = %peer.address, cntlid = instance.cntlid, "resetting a forwarded compute command's controller: {e}")
            }
            Err(_) => return false,
        }
        let now = Instant::now();
        if now >= until {
            return false;
        }
        tokio::time::sleep(pause.min(until - now)).await;
        pause = (pause * 2).min(crate::dev::remote::DOUBT_RETRY_MAX);
    }
}
