//! In-band authentication (DH-HMAC-CHAP): hosts with keys authenticate every queue before
//! other commands; right secrets connect and do I/O in every hash and group, wrong ones are
//! refused with the reason the specification gives; and every bad message (truncated,
//! replayed, out of order, of another transaction, unsupported) gets a Failure1 with its
//! reason code explanation and closes only its own queue.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;

use nearstore_dhchap::msg::{self, explanation as why, Message};
use nearstore_dhchap::{host_response, DhGroup, Hash, Secret, Transaction};
use nearstore_initiator::{ConnectOptions, Controller, Data, Error, QueueOptions, QueuePair};
use nearstore_target::config::Config;
use nearstore_target::Target;
use nearstore_wire::fabrics::{cc, connect, prop, ConnectData};
use nearstore_wire::opcode::{admin, fctype, io, FABRICS};
use nearstore_wire::{Sqe, Status};
use tokio::net::TcpStream;

const SUB: &str = "nqn.2026-11.io.nearstore:auth";
const KEY: &str = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:";
const CTRL_KEY: &str = "DHHC-1:00:MWPqcx1Ug1debg8fPIGpkqbQhLcYUt39k7UWirkblaKEH1kE:";
const OTHER_KEY: &str = "DHHC-1:00:9wCYVQqDvADjGIZo6q/v2SfmXZqqkNa9TcvYu97Ly3Q/gajh:";

/// The hosts of the test subsystem: (NQN suffix, hash, DH group, with a controller key).
const HOSTS: [(&str, &str, &str, bool); 6] = [
    ("null-sha256", "sha256", "null", false),
    ("2048-sha384", "sha384", "ffdhe2048", false),
    ("3072-sha512-bi", "sha512", "ffdhe3072", true),
    ("4096-sha256-bi", "sha256", "ffdhe4096", true),
    ("6144-sha384", "sha384", "ffdhe6144", false),
    ("8192-sha512-bi", "sha512", "ffdhe8192", true),
];

fn host(suffix: &str) -> String {
    format!("nqn.2014-08.org.nvmexpress:uuid:auth-{suffix}")
}

struct Env {
    target: Arc<Target>,
    addr: SocketAddr,
}

async fn start() -> Env {
    common::init_logs();
    let mut cfg = format!(
        r#"
        [[listener]]
        address = "127.0.0.1:0"
        [[subsystem]]
        nqn = "{SUB}"
        hosts = ["{open}"]
        [[subsystem.namespace]]
        nsid = 1
        memory = "1MiB"
        "#,
        open = host("open")
    );
    for (suffix, hash, group, bi) in HOSTS {
        cfg += &format!(
            "[[subsystem.host]]\nnqn = \"{}\"\ndhchap_key = \"{KEY}\"\ndhchap_hash = \"{hash}\"\ndhchap_dhgroup = \"{group}\"\n",
            host(suffix)
        );
        if bi {
            cfg += &format!("dhchap_ctrl_key = \"{CTRL_KEY}\"\n");
        }
    }
    let target = Target::from_config(&Config::from_toml(&cfg).unwrap()).unwrap();
    let addr = target.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    Env { target, addr }
}

fn opts(env: &Env, suffix: &str, key: Option<&str>, ctrl_key: Option<&str>) -> ConnectOptions {
    let mut o = ConnectOptions::new(env.addr, SUB);
    o.hostnqn = host(suffix);
    o.hostid = [1; 16];
    o.dhchap_secret = key.map(|k| k.parse().unwrap());
    o.dhchap_ctrl_secret = ctrl_key.map(|k| k.parse().unwrap());
    o
}

/// Connects, opens an I/O queue (which authenticates too) and writes and reads a block.
async fn io_works(o: ConnectOptions) -> Result<(), Error> {
    let c = Controller::connect(o).await?;
    let mut q = c.io_queue(1).await?;
    let block = vec![0x5a; 512];
    q.write(1, 3, &block, 512, false).await?;
    assert_eq!(q.read(1, 3, 1, 512).await?, block);
    Ok(())
}

fn auth_failures(env: &Env) -> u64 {
    env.target.stats.auth_failures.load(std::sync::atomic::Ordering::Relaxed)
}

/// Every hash and group, one way and both ways, connects with the right secrets and does
/// I/O; a host without keys is not asked to authenticate.
#[tokio::test]
async fn right_secrets_connect_and_do_io() {
    let env = start().await;
    for (suffix, _, _, bi) in HOSTS {
        io_works(opts(&env, suffix, Some(KEY), None)).await.unwrap_or_else(|e| panic!("{suffix}: {e}"));
        if bi {
            io_works(opts(&env, suffix, Some(KEY), Some(CTRL_KEY))).await.unwrap_or_else(|e| panic!("{suffix}, bidirectional: {e}"));
        }
    }
    io_works(opts(&env, "open", None, None)).await.expect("a host without keys connects as before");
    assert_eq!(auth_failures(&env), 0);
}

/// Wrong secrets, one case a line: the host, its secret and controller secret, and the
/// error it gets. A good host connects after each.
#[tokio::test]
async fn wrong_secrets_are_refused() {
    let env = start().await;
    type Check = fn(&Error) -> bool;
    // What is wrong, the key set, the host's secret and controller secret, the refusal.
    type Case = (&'static str, &'static str, Option<&'static str>, Option<&'static str>, Check);
    let cases: [Case; 6] = [
        (
            "wrong host secret",
            "null-sha256",
            Some(OTHER_KEY),
            None,
            |e| matches!(e, Error::AuthRefused { qid: 0, explanation } if *explanation == why::FAILED),
        ),
        (
            "wrong host secret, DH group",
            "2048-sha384",
            Some(OTHER_KEY),
            None,
            |e| matches!(e, Error::AuthRefused { qid: 0, explanation } if *explanation == why::FAILED),
        ),
        ("no secret", "null-sha256", None, None, |e| matches!(e, Error::AuthRequired { .. })),
        (
            "wrong controller key (the target proves another)",
            "3072-sha512-bi",
            Some(KEY),
            Some(OTHER_KEY),
            |e| matches!(e, Error::Auth(m) if m.contains("did not prove")),
        ),
        (
            "controller key, the target has none",
            "null-sha256",
            Some(KEY),
            Some(CTRL_KEY),
            |e| matches!(e, Error::AuthRefused { explanation, .. } if *explanation == why::FAILED),
        ),
        (
            "a secret for a host the target knows no key of",
            "open",
            Some(KEY),
            Some(CTRL_KEY),
            |e| matches!(e, Error::AuthRefused { explanation, .. } if *explanation == why::FAILED),
        ),
    ];
    for (what, suffix, key, ctrl_key, check) in cases {
        let e = io_works(opts(&env, suffix, key, ctrl_key)).await.expect_err(what);
        assert!(check(&e), "{what}: {e}");
        io_works(opts(&env, "2048-sha384", Some(KEY), None)).await.unwrap_or_else(|e| panic!("after {what}: {e}"));
    }
    assert!(auth_failures(&env) >= 4, "{}", auth_failures(&env));
}

/// A raw queue: Connect, then authentication messages by hand.
struct Raw {
    q: QueuePair<TcpStream>,
    hostnqn: String,
}

async fn raw_connect(env: &Env, suffix: &str, qid: u16, cntlid: u16) -> (Raw, u32) {
    let s = TcpStream::connect(env.addr).await.unwrap();
    let mut q = QueuePair::connect(s, QueueOptions::default()).await.unwrap();
    let mut s = Sqe::new(FABRICS, 0);
    s.set_nsid(fctype::CONNECT as u32).set_cdw(10, (qid as u32) << 16).set_cdw(11, 31);
    let hostnqn = host(suffix);
    let d = ConnectData { hostid: [1; 16], cntlid, subnqn: SUB.into(), hostnqn: hostnqn.clone(), acting_for: None }.encode();
    let cid = q.submit(s, Data::Out(&d), 0).unwrap();
    let cqe = q.wait(cid, |_, _, _| {}).await.unwrap();
    assert!(cqe.status.is_success(), "{}", cqe.status);
    if qid == 0 {
        // Enabling the controller is a Property Set, which runs before authentication.
        let cid = q.submit(nearstore_initiator::prop_set(prop::CC, cc::LINUX_ENABLE), Data::None, 0).unwrap();
        assert!(q.wait(cid, |_, _, _| {}).await.unwrap().status.is_success());
    }
    (Raw { q, hostnqn }, cqe.dw0)
}

fn auth_sqe(fct: u8, cdw10: u32, len: u32) -> Sqe {
    let mut s = Sqe::new(FABRICS, 0);
    s.set_nsid(fct as u32).set_cdw(10, cdw10).set_cdw(11, len);
    s
}

impl Raw {
    async fn status(&mut self, sqe: Sqe, data: Data<'_>) -> (Status, Vec<u8>) {
        let cid = self.q.submit(sqe, data, 0).unwrap();
        let mut out = Vec::new();
        let cqe = self.q.wait(cid, |_, _, d| out.extend_from_slice(d)).await.unwrap();
        (cqe.status, out)
    }

    async fn send(&mut self, b: &[u8]) -> Status {
        self.status(auth_sqe(fctype::AUTH_SEND, msg::cdw10(), b.len() as u32), Data::Out(b)).await.0
    }

    async fn receive(&mut self) -> Message {
        let (st, d) = self.status(auth_sqe(fctype::AUTH_RECEIVE, msg::cdw10(), 4096), Data::In(4096)).await;
        assert!(st.is_success(), "{st}");
        assert_eq!(d.len(), 4096, "padded to AL");
        Message::decode(&d).unwrap()
    }

    async fn identify(&mut self) -> Status {
        let mut s = Sqe::new(admin::IDENTIFY, 0);
        s.set_cdw(10, 1);
        self.status(s, Data::In(4096)).await.0
    }

    /// The connection closed after a failed transaction.
    async fn closed(&mut self) -> bool {
        let cid = self.q.submit(auth_sqe(fctype::AUTH_RECEIVE, msg::cdw10(), 4096), Data::In(4096), 0);
        match cid {
            Ok(cid) => self.q.wait(cid, |_, _, _| {}).await.is_err(),
            Err(_) => true,
        }
    }

    /// The Reply that answers `c` with `key`, and the session's public value.
    fn reply(&self, c: &msg::Challenge, key: &Secret) -> msg::Reply {
        let hash = Hash::from_id(c.hash_id).unwrap();
        let group = DhGroup::from_id(c.dh_id).unwrap();
        let (dhv, sk) = match group.keypair() {
            None => (vec![], None),
            Some(kp) => (kp.public.clone(), Some(kp.shared(&c.dhv).unwrap())),
        };
        let t = Transaction { hash, t_id: c.t_id, hostnqn: &self.hostnqn, subnqn: SUB, session_key: sk.as_deref() };
        msg::Reply { t_id: c.t_id, rval: host_response(&t, key, &c.cval, c.seqnum), cval: None, seqnum: 0, dhv }
    }
}

fn negotiate(t_id: u16, hashes: &[u8], groups: &[u8]) -> Vec<u8> {
    Message::Negotiate(msg::Negotiate { t_id, sc_c: 0, hash_ids: hashes.to_vec(), dh_ids: groups.to_vec() }).encode()
}

fn all_negotiate(t_id: u16) -> Vec<u8> {
    negotiate(t_id, &[1, 2, 3], &[0, 1, 2, 3, 4, 5])
}

async fn challenge(r: &mut Raw, t_id: u16) -> msg::Challenge {
    assert!(r.send(&all_negotiate(t_id)).await.is_success());
    match r.receive().await {
        Message::Challenge(c) => c,
        m => panic!("expected a challenge, got {m:?}"),
    }
}

/// Commands before authentication: Connect says AUTHREQ.ATR; Property Get runs; Identify
/// and I/O get Authentication Required; after authentication they run.
#[tokio::test]
async fn a_host_skipping_authentication_is_refused() {
    let env = start().await;
    let (mut r, dw0) = raw_connect(&env, "null-sha256", 0, 0xffff).await;
    assert_eq!(dw0 & connect::AUTHREQ_ATR, connect::AUTHREQ_ATR);
    let (_, open_dw0) = raw_connect(&env, "open", 0, 0xffff).await;
    assert_eq!(open_dw0 & connect::AUTHREQ_ATR, 0, "a host without keys is not asked");
    let mut pg = Sqe::new(FABRICS, 0);
    pg.set_nsid(fctype::PROPERTY_GET as u32).set_cdw(11, 0x08);
    assert!(r.status(pg, Data::None).await.0.is_success());
    assert_eq!(r.identify().await, Status::AUTH_REQUIRED.dnr());
    let c = challenge(&mut r, 1).await;
    let key: Secret = KEY.parse().unwrap();
    assert!(r.send(&Message::Reply(r.reply(&c, &key)).encode()).await.is_success());
    assert!(matches!(r.receive().await, Message::Success1 { rval: None, hl: 32, .. }));
    assert!(r.identify().await.is_success());

    // An I/O queue of an authenticated controller is not authenticated by it.
    let ctrl = Controller::connect(opts(&env, "null-sha256", Some(KEY), None)).await.unwrap();
    let (mut ioq, dw0) = raw_connect(&env, "null-sha256", 1, ctrl.cntlid).await;
    assert_eq!(dw0 & connect::AUTHREQ_ATR, connect::AUTHREQ_ATR);
    let st = ioq.status(Sqe::rw(io::READ, 1, 0, 1, false), Data::In(512)).await.0;
    assert_eq!(st, Status::AUTH_REQUIRED.dnr());
}

/// What a bad transaction does instead of the right thing.
enum Bad {
    /// These bytes instead of the Negotiate.
    Negotiate(Vec<u8>),
    /// A Receive before any Negotiate.
    ReceiveFirst,
    /// A Reply sent before the Challenge was received.
    ReplyBeforeChallenge,
    /// The right Reply changed by this function.
    Reply(fn(Vec<u8>) -> Vec<u8>),
}

/// Bad messages, one case a line: the host, what it does, and the reason code explanation
/// of the Failure1 it gets; then its queue closes, and the other queues go on.
#[tokio::test]
async fn bad_messages_get_a_failure1_with_their_reason() {
    let env = start().await;
    let mut sc_c = all_negotiate(1);
    sc_c[6] = 1;
    let cases: Vec<(&str, &str, Bad, u8)> = vec![
        ("truncated Negotiate", "null-sha256", Bad::Negotiate(all_negotiate(1)[..10].to_vec()), why::INCORRECT_PAYLOAD),
        ("Negotiate cut in its descriptor", "null-sha256", Bad::Negotiate(all_negotiate(1)[..40].to_vec()), why::INCORRECT_PAYLOAD),
        ("unsupported hashes", "null-sha256", Bad::Negotiate(negotiate(1, &[7, 9], &[0, 1])), why::HASH_UNUSABLE),
        ("no hash at all", "null-sha256", Bad::Negotiate(negotiate(1, &[], &[0, 1])), why::HASH_UNUSABLE),
        ("unsupported DH groups", "2048-sha384", Bad::Negotiate(negotiate(1, &[1, 2], &[9, 17])), why::DHGROUP_UNUSABLE),
        ("secure channel concatenation", "null-sha256", Bad::Negotiate(sc_c), why::CONCAT_MISMATCH),
        ("unknown message", "null-sha256", Bad::Negotiate(vec![1, 0x42, 0, 0, 1, 0, 0, 0]), why::INCORRECT_MESSAGE),
        ("Receive before Negotiate", "null-sha256", Bad::ReceiveFirst, why::INCORRECT_MESSAGE),
        ("Reply before the Challenge", "null-sha256", Bad::ReplyBeforeChallenge, why::INCORRECT_MESSAGE),
        ("truncated Reply", "null-sha256", Bad::Reply(|b| b[..30].to_vec()), why::INCORRECT_PAYLOAD),
        ("truncated Reply, DH value cut", "2048-sha384", Bad::Reply(|b| b[..b.len() - 1].to_vec()), why::INCORRECT_PAYLOAD),
        (
            "Reply of another transaction",
            "null-sha256",
            Bad::Reply(|mut b| {
                b[4] ^= 1;
                b
            }),
            why::INCORRECT_PAYLOAD,
        ),
        (
            "wrong response",
            "null-sha256",
            Bad::Reply(|mut b| {
                b[16] ^= 1;
                b
            }),
            why::FAILED,
        ),
        (
            "wrong response, DH group",
            "2048-sha384",
            Bad::Reply(|mut b| {
                b[16] ^= 1;
                b
            }),
            why::FAILED,
        ),
        (
            "response shorter than the hash",
            "null-sha256",
            Bad::Reply(|mut b| {
                b[6] = 16;
                b
            }),
            why::INCORRECT_PAYLOAD,
        ),
        (
            "DH value in the null group",
            "null-sha256",
            Bad::Reply(|mut b| {
                b[10] = 4;
                b.extend_from_slice(&[2, 2, 2, 2]);
                b
            }),
            why::INCORRECT_PAYLOAD,
        ),
        (
            "DH value outside the group",
            "2048-sha384",
            Bad::Reply(|mut b| {
                let n = b.len();
                b[n - 256..].fill(0);
                b[n - 1] = 1;
                b
            }),
            why::DHGROUP_UNUSABLE,
        ),
        (
            "no DH value in a DH group",
            "2048-sha384",
            Bad::Reply(|mut b| {
                b[10..12].fill(0);
                b.truncate(b.len() - 256);
                b
            }),
            why::INCORRECT_PAYLOAD,
        ),
    ];
    let key: Secret = KEY.parse().unwrap();
    let before = auth_failures(&env);
    let healthy = Controller::connect(opts(&env, "null-sha256", Some(KEY), None)).await.unwrap();
    for (what, suffix, bad, want) in &cases {
        let (mut r, _) = raw_connect(&env, suffix, 0, 0xffff).await;
        match bad {
            Bad::Negotiate(b) => assert!(r.send(b).await.is_success(), "{what}"),
            Bad::ReceiveFirst => {}
            Bad::ReplyBeforeChallenge => {
                assert!(r.send(&all_negotiate(1)).await.is_success());
                let fake = msg::Reply { t_id: 1, rval: vec![0; 32], cval: None, seqnum: 0, dhv: vec![] };
                assert!(r.send(&Message::Reply(fake).encode()).await.is_success(), "{what}");
            }
            Bad::Reply(change) => {
                let c = challenge(&mut r, 1).await;
                let b = change(Message::Reply(r.reply(&c, &key)).encode());
                assert!(r.send(&b).await.is_success(), "{what}");
            }
        }
        match r.receive().await {
            Message::Failure { first: true, reason, explanation, .. } => {
                assert_eq!((reason, explanation), (msg::REASON_FAILED, *want), "{what}: {}", msg::explanation::name(explanation))
            }
            m => panic!("{what}: expected a Failure1, got {m:?}"),
        }
        assert!(r.closed().await, "{what}: the queue closes after its Failure1");
    }
    assert_eq!(auth_failures(&env) - before, cases.len() as u64);
    assert!(healthy.active_namespaces().await.is_ok(), "other controllers go on");
}

/// A Reply replayed: within its transaction after it succeeded (out of order), and in a
/// later transaction with the same transaction id (its challenge and sequence number are
/// new, so the old response fails).
#[tokio::test]
async fn replayed_replies_are_refused() {
    let env = start().await;
    let key: Secret = KEY.parse().unwrap();
    for suffix in ["null-sha256", "2048-sha384"] {
        let (mut r, _) = raw_connect(&env, suffix, 0, 0xffff).await;
        let c = challenge(&mut r, 5).await;
        let old = Message::Reply(r.reply(&c, &key)).encode();
        assert!(r.send(&old).await.is_success());
        assert!(matches!(r.receive().await, Message::Success1 { rval: None, .. }));
        assert!(r.identify().await.is_success());
        assert!(r.send(&old).await.is_success());
        assert!(matches!(r.receive().await, Message::Failure { first: true, explanation: why::INCORRECT_MESSAGE, .. }), "{suffix}");
        assert!(r.closed().await);

        let (mut r, _) = raw_connect(&env, suffix, 0, 0xffff).await;
        let c2 = challenge(&mut r, 5).await;
        assert_ne!((c2.cval.clone(), c2.seqnum), (c.cval.clone(), c.seqnum), "every challenge is new");
        assert!(r.send(&old).await.is_success());
        assert!(matches!(r.receive().await, Message::Failure { first: true, explanation: why::FAILED, .. }), "{suffix}");
        assert!(r.closed().await);
    }
}

/// Re-authentication: a host that authenticated starts another transaction whenever it
/// likes; its commands run meanwhile, and after it.
#[tokio::test]
async fn a_host_re_authenticates() {
    let env = start().await;
    let key: Secret = KEY.parse().unwrap();
    let (mut r, _) = raw_connect(&env, "4096-sha256-bi", 0, 0xffff).await;
    for t_id in [1, 2, 3] {
        let c = challenge(&mut r, t_id).await;
        if t_id > 1 {
            assert!(r.identify().await.is_success(), "commands run while the host re-authenticates");
        }
        assert!(r.send(&Message::Reply(r.reply(&c, &key)).encode()).await.is_success());
        assert!(matches!(r.receive().await, Message::Success1 { rval: None, t_id: t, hl: 32, .. } if t == t_id));
        assert!(r.identify().await.is_success());
    }
}

/// The commands' own fields, one case a line: a security protocol other than DH-HMAC-CHAP's,
/// no data, more data than any message, an SGL of another length than TL: each is refused
/// with the status Linux's target gives, before any data moves.
#[tokio::test]
async fn authentication_commands_with_bad_fields() {
    let env = start().await;
    let (mut r, _) = raw_connect(&env, "null-sha256", 0, 0xffff).await;
    let good = msg::cdw10();
    let big = vec![0u8; nearstore_target::limits::AUTH_SEND_BYTES_MAX + 1];
    let n = all_negotiate(1);
    let cases: [(&str, u8, u32, u32, Data, Status); 7] = [
        ("SECP", fctype::AUTH_SEND, good ^ 0x0100_0000, n.len() as u32, Data::Out(&n), Status::INVALID_FIELD.dnr()),
        ("SPSP0", fctype::AUTH_SEND, good ^ 0x0000_0100, n.len() as u32, Data::Out(&n), Status::INVALID_FIELD.dnr()),
        ("SPSP1", fctype::AUTH_RECEIVE, good ^ 0x0001_0000, 4096, Data::In(4096), Status::INVALID_FIELD.dnr()),
        ("TL zero", fctype::AUTH_SEND, good, 0, Data::None, Status::INVALID_FIELD.dnr()),
        ("AL zero", fctype::AUTH_RECEIVE, good, 0, Data::None, Status::INVALID_FIELD.dnr()),
        ("TL over the largest message", fctype::AUTH_SEND, good, big.len() as u32, Data::Out(&big), Status::INVALID_FIELD.dnr()),
        ("SGL longer than TL", fctype::AUTH_SEND, good, 8, Data::Out(&n), Status::DATA_SGL_LENGTH_INVALID.dnr()),
    ];
    for (what, fct, cdw10, len, data, want) in cases {
        assert_eq!(r.status(auth_sqe(fct, cdw10, len), data).await.0, want, "{what}");
    }
    // The transaction was never started by any of them.
    assert!(matches!(r.receive().await, Message::Failure { explanation: why::INCORRECT_MESSAGE, .. }));
}
