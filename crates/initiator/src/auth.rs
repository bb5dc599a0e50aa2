//! The host's side of in-band authentication (DH-HMAC-CHAP, as Linux's
//! drivers/nvme/host/auth.c and nvme-cli's `--dhchap-secret` / `--dhchap-ctrl-secret`): a
//! queue whose Connect response has AUTHREQ.ATR set runs one transaction before anything
//! else; with a controller secret the host asks the target to prove itself too, and a
//! target that cannot is refused with a Failure2.

use nearstore_dhchap::msg::{self, explanation, Message};
use nearstore_dhchap::{ctrl_response, host_response, same_response, DhGroup, Hash, Secret, Transaction};
use nearstore_transport::Stream;
use nearstore_wire::opcode::{fctype, FABRICS};
use nearstore_wire::Sqe;

use crate::controller::{run, ConnectOptions};
use crate::limits::AUTH_RECEIVE_BYTES;
use crate::queue::{Data, QueuePair};
use crate::{Error, Result};

fn auth_sqe(fct: u8, len: usize) -> Sqe {
    let mut s = Sqe::new(FABRICS, 0);
    s.set_nsid(fct as u32);
    s.set_cdw(10, msg::cdw10());
    s.set_cdw(11, len as u32);
    s
}

async fn send<S: Stream>(q: &mut QueuePair<S>, m: &Message, opts: &ConnectOptions, qid: u16) -> Result<()> {
    let b = m.encode();
    run(q, auth_sqe(fctype::AUTH_SEND, b.len()), Data::Out(&b), &format!("Authentication Send (queue {qid})"), opts.timeout).await?;
    Ok(())
}

/// The controller's next message; a Failure1 is the target's refusal.
async fn receive<S: Stream>(q: &mut QueuePair<S>, opts: &ConnectOptions, qid: u16, t_id: u16) -> Result<Message> {
    let what = format!("Authentication Receive (queue {qid})");
    let (_, d) = run(q, auth_sqe(fctype::AUTH_RECEIVE, AUTH_RECEIVE_BYTES), Data::In(AUTH_RECEIVE_BYTES), &what, opts.timeout).await?;
    let m = Message::decode(&d)
        .map_err(|msg::Bad(e)| Error::Auth(format!("{what}: the target's message is malformed ({})", explanation::name(e))))?;
    if let Message::Failure { first: true, explanation, .. } = m {
        return Err(Error::AuthRefused { qid, explanation });
    }
    if m.t_id() != t_id {
        return Err(Error::Auth(format!("{what}: the target answered transaction {} in transaction {t_id}", m.t_id())));
    }
    Ok(m)
}

/// Authenticates queue `qid` with the host's `secret` (and, bidirectionally, checks the
/// target's response with `opts.dhchap_ctrl_secret`).
pub(crate) async fn authenticate<S: Stream>(q: &mut QueuePair<S>, opts: &ConnectOptions, secret: &Secret, qid: u16) -> Result<()> {
    let random = |n| nearstore_dhchap::random_bytes(n).map_err(|e| Error::Auth(format!("reading random bytes: {e}")));
    let r = random(2)?;
    let t_id = u16::from_le_bytes([r[0], r[1]]);
    let negotiate = msg::Negotiate {
        t_id,
        sc_c: msg::SC_C_NONE,
        hash_ids: Hash::ALL.iter().map(|h| h.id()).collect(),
        dh_ids: DhGroup::ALL.iter().map(|g| g.id()).collect(),
    };
    send(q, &Message::Negotiate(negotiate), opts, qid).await?;
    let Message::Challenge(c) = receive(q, opts, qid, t_id).await? else {
        return Err(Error::Auth(format!("queue {qid}: the target sent another message than its challenge")));
    };
    let hash = Hash::from_id(c.hash_id).ok_or_else(|| Error::Auth(format!("queue {qid}: the target chose unknown hash {}", c.hash_id)))?;
    let group =
        DhGroup::from_id(c.dh_id).ok_or_else(|| Error::Auth(format!("queue {qid}: the target chose unknown DH group {}", c.dh_id)))?;
    if c.cval.len() != hash.len() || (group == DhGroup::Null) != c.dhv.is_empty() || c.dhv.len() > group.value_len() {
        return Err(Error::Auth(format!("queue {qid}: the challenge's lengths do not fit {} and {}", hash.name(), group.name())));
    }
    // The group's exponentiations (up to 8192 bits) off the runtime's threads.
    let (public, session_key) = if group == DhGroup::Null {
        (Vec::new(), None)
    } else {
        let peer = c.dhv.clone();
        let kp = tokio::task::spawn_blocking(move || group.keypair().map(|kp| (kp.shared(&peer), kp.public)))
            .await
            .map_err(|e| Error::Auth(format!("DH key exchange: {e}")))?
            .ok_or_else(|| Error::Auth("reading random bytes for a DH key".into()))?;
        let (shared, public) = kp;
        let shared = shared.map_err(|e| Error::Auth(format!("queue {qid}: the target's DH value: {e}")))?;
        (public, Some(shared))
    };
    let t = Transaction { hash, t_id, hostnqn: &opts.hostnqn, subnqn: &opts.subnqn, session_key: session_key.as_deref() };
    let rval = host_response(&t, secret, &c.cval, c.seqnum);
    let bidirectional = match &opts.dhchap_ctrl_secret {
        None => None,
        Some(k) => {
            let s = random(4)?;
            Some((k, random(hash.len())?, u32::from_le_bytes([s[0], s[1], s[2], s[3]]).max(1)))
        }
    };
    let reply = msg::Reply {
        t_id,
        rval,
        cval: bidirectional.as_ref().map(|(_, c2, _)| c2.clone()),
        seqnum: bidirectional.as_ref().map_or(0, |b| b.2),
        dhv: public,
    };
    send(q, &Message::Reply(reply), opts, qid).await?;
    let Message::Success1 { rval, .. } = receive(q, opts, qid, t_id).await? else {
        return Err(Error::Auth(format!("queue {qid}: the target sent another message than Success1")));
    };
    if let Some((ctrl_key, c2, s2)) = bidirectional {
        let want = ctrl_response(&t, ctrl_key, &c2, s2);
        if !rval.is_some_and(|r| same_response(&r, &want)) {
            let f = Message::Failure { t_id, first: false, reason: msg::REASON_FAILED, explanation: explanation::FAILED };
            // The target learns it failed; the connection is given up whatever it answers.
            let _ = send(q, &f, opts, qid).await;
            return Err(Error::Auth(format!(
                "queue {qid}: the target did not prove it holds the controller secret (--dhchap-ctrl-secret): refused"
            )));
        }
        send(q, &Message::Success2 { t_id }, opts, qid).await?;
    }
    Ok(())
}
