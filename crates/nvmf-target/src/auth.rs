//! In-band authentication of a queue, the controller's side of DH-HMAC-CHAP (NVMe Base,
//! "Authentication"; Linux's drivers/nvme/target/fabrics-cmd-auth.c and auth.c). A host
//! with a `dhchap_key` in its subsystem's `[[subsystem.host]]` entry gets AUTHREQ.ATR in
//! every Connect response, and each of its queues runs one transaction (more when the host
//! re-authenticates) before any other command but Property Get and Set:
//!
//! ```text
//! Send    AUTH_Negotiate            -> hash and DH group chosen, a key pair made
//! Receive DH-HMAC-CHAP_Challenge    <- C1, S1, g^x mod p
//! Send    DH-HMAC-CHAP_Reply        -> R1 checked; with C2 and S2 non-zero, R2 computed
//! Receive DH-HMAC-CHAP_Success1     <- R2 if asked for
//! Send    DH-HMAC-CHAP_Success2     -> (bidirectional only) the host accepted R2
//! ```
//!
//! A message out of order, malformed, of another transaction or with a wrong response makes
//! the next Receive a Failure1 with its reason code explanation, after which the queue
//! closes; a host's Failure2 closes it too. The pure state machine is [`QueueAuth`]; what
//! takes time (the group exponentiations, up to 8192 bits) runs on the blocking pool
//! (exec/auth.rs), never on the network thread.

use std::sync::Arc;

use nearstore_dhchap::msg::{self, explanation, Message, Negotiate};
use nearstore_dhchap::{ctrl_response, host_response, same_response, DhGroup, Hash, KeyPair, Secret, Transaction};

/// A host's keys and what its transactions use, from its `[[subsystem.host]]` entry.
#[derive(Debug)]
pub struct HostKeys {
    /// The host's secret: it proves the host.
    pub key: Secret,
    /// The controller's secret (bidirectional authentication): the controller proves itself
    /// with it when the host asks (`--dhchap-ctrl-secret`).
    pub ctrl_key: Option<Secret>,
    /// The hash and DH group this target prefers; when the host does not offer them, the
    /// first of its lists this target has (as Linux's target falls back).
    pub hash: Hash,
    pub group: DhGroup,
}

/// What the host is expected to do next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    /// Send a Negotiate (no transaction, or the last one finished).
    Negotiate,
    /// Receive the Challenge.
    Challenge,
    /// Send its Reply.
    Reply,
    /// Receive Success1.
    Success1,
    /// Send Success2.
    Success2,
    /// Receive Failure1: the transaction failed.
    Failure1,
}

/// One queue's authentication: its transaction's state and whether it is authenticated.
pub struct QueueAuth {
    /// None: the host has no key here, and a transaction it starts fails.
    keys: Option<Arc<HostKeys>>,
    hostnqn: String,
    subnqn: String,
    /// Commands other than Connect, Property Get and Set, authentication and Disconnect run
    /// only while set. A re-authentication leaves it as it is until it fails.
    pub authenticated: bool,
    /// The queue must close: a Failure1 was sent or a Failure2 received.
    pub fatal: bool,
    step: Step,
    t_id: u16,
    hash: Hash,
    group: DhGroup,
    s1: u32,
    c1: Vec<u8>,
    keypair: Option<KeyPair>,
    /// R2, for Success1, when the host asked the controller to authenticate.
    r2: Option<Vec<u8>>,
    failure: u8,
}

impl QueueAuth {
    pub fn new(keys: Option<Arc<HostKeys>>, hostnqn: &str, subnqn: &str) -> QueueAuth {
        QueueAuth {
            keys,
            hostnqn: hostnqn.into(),
            subnqn: subnqn.into(),
            authenticated: false,
            fatal: false,
            step: Step::Negotiate,
            t_id: 0,
            hash: Hash::Sha256,
            group: DhGroup::Null,
            s1: 0,
            c1: Vec::new(),
            keypair: None,
            r2: None,
            failure: 0,
        }
    }

    /// True when handling the message in `data` takes an exponentiation in a group (a
    /// Negotiate makes a key pair, a Reply with a DH value computes the session key): it
    /// goes to the blocking pool.
    pub fn is_slow(&self, data: &[u8]) -> bool {
        match data {
            [msg::auth_type::COMMON, msg::auth_id::NEGOTIATE, ..] => true,
            [msg::auth_type::DHCHAP, msg::auth_id::REPLY, ..] => self.keypair.is_some(),
            _ => false,
        }
    }

    fn fail(&mut self, why: u8) {
        self.step = Step::Failure1;
        self.failure = why;
        self.keypair = None;
        self.r2 = None;
    }

    /// A message from Authentication Send (its TL bytes). Whatever is wrong with it shows in
    /// the next Receive (a Failure1); the command itself succeeds.
    pub fn send(&mut self, data: &[u8]) {
        let m = match Message::decode(data) {
            Ok(m) => m,
            Err(msg::Bad(why)) => {
                // A malformed Negotiate starts a transaction that failed; anything else
                // fails the one under way.
                if data.len() >= 6 && data[..2] == [msg::auth_type::COMMON, msg::auth_id::NEGOTIATE] {
                    self.t_id = u16::from_le_bytes([data[4], data[5]]);
                }
                return self.fail(why);
            }
        };
        match m {
            Message::Negotiate(n) => self.negotiate(&n),
            Message::Failure { first: false, .. } => {
                // The host gave up (it rejected R2, or anything else): the queue is done.
                self.authenticated = false;
                self.fatal = true;
                self.step = Step::Negotiate;
            }
            // A failure waits for the host's Receive; nothing else changes it.
            _ if self.step == Step::Failure1 => {}
            Message::Reply(r) if self.step == Step::Reply => {
                if r.t_id != self.t_id {
                    return self.fail(explanation::INCORRECT_PAYLOAD);
                }
                self.reply(r);
            }
            Message::Success2 { t_id } if self.step == Step::Success2 => {
                if t_id != self.t_id {
                    return self.fail(explanation::INCORRECT_PAYLOAD);
                }
                self.authenticated = true;
                self.step = Step::Negotiate;
            }
            // Out of order: a Reply or Success2 when not expected (a replayed one among
            // them), or a controller's message sent by the host.
            _ => self.fail(explanation::INCORRECT_MESSAGE),
        }
    }

    fn negotiate(&mut self, n: &Negotiate) {
        self.t_id = n.t_id;
        self.r2 = None;
        self.keypair = None;
        if n.sc_c != msg::SC_C_NONE {
            // Secure channel concatenation (TLS keys from the transaction) is not implemented.
            return self.fail(explanation::CONCAT_MISMATCH);
        }
        let (want_hash, want_group) = self.keys.as_ref().map_or((Hash::Sha256, DhGroup::Null), |k| (k.hash, k.group));
        let Some(hash) = pick(&n.hash_ids, want_hash.id(), Hash::from_id) else {
            return self.fail(explanation::HASH_UNUSABLE);
        };
        let Some(group) = pick(&n.dh_ids, want_group.id(), DhGroup::from_id) else {
            return self.fail(explanation::DHGROUP_UNUSABLE);
        };
        self.hash = hash;
        self.group = group;
        if group != DhGroup::Null {
            let Some(kp) = group.keypair() else { return self.fail(explanation::FAILED) };
            self.keypair = Some(kp);
        }
        self.step = Step::Challenge;
    }

    fn reply(&mut self, r: msg::Reply) {
        if r.rval.len() != self.hash.len() {
            return self.fail(explanation::INCORRECT_PAYLOAD);
        }
        let session_key = match (&self.keypair, r.dhv.is_empty()) {
            (None, true) => None,
            (None, false) | (Some(_), true) => return self.fail(explanation::INCORRECT_PAYLOAD),
            (Some(kp), false) => match kp.shared(&r.dhv) {
                Ok(k) => Some(k),
                Err(_) => return self.fail(explanation::DHGROUP_UNUSABLE),
            },
        };
        let Some(keys) = self.keys.clone() else { return self.fail(explanation::FAILED) };
        let (hostnqn, subnqn) = (self.hostnqn.clone(), self.subnqn.clone());
        let t = Transaction { hash: self.hash, t_id: self.t_id, hostnqn: &hostnqn, subnqn: &subnqn, session_key: session_key.as_deref() };
        if !same_response(&host_response(&t, &keys.key, &self.c1, self.s1), &r.rval) {
            return self.fail(explanation::FAILED);
        }
        // S2 of zero: the host sent C2 for another purpose (a secure channel's key), and
        // does not ask the controller to authenticate (NVMe Base, DH-HMAC-CHAP_Reply SEQNUM).
        match r.cval.filter(|_| r.seqnum != 0) {
            None => {
                self.authenticated = true;
                self.r2 = None;
            }
            Some(c2) => {
                let Some(ck) = &keys.ctrl_key else { return self.fail(explanation::FAILED) };
                self.r2 = Some(ctrl_response(&t, ck, &c2, r.seqnum));
            }
        }
        self.keypair = None;
        self.step = Step::Success1;
    }

    /// The message an Authentication Receive returns.
    pub fn receive(&mut self) -> Vec<u8> {
        match self.step {
            Step::Challenge => match (nearstore_dhchap::random_bytes(self.hash.len()), nearstore_dhchap::random_bytes(4)) {
                (Ok(c1), Ok(s)) => {
                    // A sequence number is never zero (zero says "no bidirectional
                    // authentication" in a Reply).
                    self.s1 = u32::from_le_bytes([s[0], s[1], s[2], s[3]]).max(1);
                    self.c1 = c1;
                    self.step = Step::Reply;
                    Message::Challenge(msg::Challenge {
                        t_id: self.t_id,
                        hash_id: self.hash.id(),
                        dh_id: self.group.id(),
                        seqnum: self.s1,
                        cval: self.c1.clone(),
                        dhv: self.keypair.as_ref().map_or_else(Vec::new, |k| k.public.clone()),
                    })
                    .encode()
                }
                _ => {
                    self.fail(explanation::FAILED);
                    self.receive()
                }
            },
            Step::Success1 => {
                let rval = self.r2.take();
                self.step = if rval.is_some() { Step::Success2 } else { Step::Negotiate };
                Message::Success1 { t_id: self.t_id, hl: self.hash.len() as u8, rval }.encode()
            }
            Step::Failure1 => self.failure1(self.failure),
            // Nothing to receive now: the transaction fails.
            Step::Negotiate | Step::Reply | Step::Success2 => self.failure1(explanation::INCORRECT_MESSAGE),
        }
    }

    fn failure1(&mut self, why: u8) -> Vec<u8> {
        self.authenticated = false;
        self.fatal = true;
        self.step = Step::Negotiate;
        Message::Failure { t_id: self.t_id, first: true, reason: msg::REASON_FAILED, explanation: why }.encode()
    }
}

/// The controller's choice from a host's list: `preferred` if the host offers it, else the
/// first identifier of the list this target knows.
fn pick<T>(ids: &[u8], preferred: u8, known: fn(u8) -> Option<T>) -> Option<T> {
    ids.iter().find(|&&i| i == preferred).or_else(|| ids.iter().find(|&&i| known(i).is_some())).and_then(|&i| known(i))
}
