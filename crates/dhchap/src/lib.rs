//! NVMe in-band authentication with DH-HMAC-CHAP (NVMe Base Specification 2.x,
//! "Authentication"; NVMe over Fabrics carries its messages in the Authentication Send and
//! Receive commands): the secrets in their `DHHC-1` form ([`secret`]), the hash functions
//! ([`Hash`]), the Diffie-Hellman groups of RFC 7919 ([`group`]), the messages ([`msg`]) and
//! the values both ends compute ([`host_response`], [`ctrl_response`]). The primitives are
//! RustCrypto's (`sha2`, `hmac`) and `num-bigint`'s; nothing here does I/O, and every
//! decoder takes untrusted bytes. The target (crates/nvmf-target, `auth.rs`) and the
//! initiator (crates/initiator, `auth.rs`) are its two users; docs/protocol.md
//! "Authentication" describes the exchange as nearstore implements it.

pub mod group;
pub mod msg;
pub mod secret;

mod ffdhe;

use hmac::digest::KeyInit;
use hmac::{Hmac, Mac};

pub use group::{DhGroup, KeyPair};
pub use secret::{Secret, SecretError};

/// A hash function of DH-HMAC-CHAP, by its identifier (NVMe Base, "DH-HMAC-CHAP hash
/// function identifiers"): also the secret transformation of a `DHHC-1:0N:` secret.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hash {
    Sha256 = 1,
    Sha384 = 2,
    Sha512 = 3,
}

impl Hash {
    pub const ALL: [Hash; 3] = [Hash::Sha256, Hash::Sha384, Hash::Sha512];

    pub fn from_id(id: u8) -> Option<Hash> {
        Hash::ALL.into_iter().find(|h| h.id() == id)
    }

    pub fn from_name(name: &str) -> Option<Hash> {
        Hash::ALL.into_iter().find(|h| h.name() == name)
    }

    pub fn id(self) -> u8 {
        self as u8
    }

    /// Its name in the configuration: sha256, sha384, sha512.
    pub fn name(self) -> &'static str {
        match self {
            Hash::Sha256 => "sha256",
            Hash::Sha384 => "sha384",
            Hash::Sha512 => "sha512",
        }
    }

    /// Bytes of its digest: the length of challenges and responses (HL).
    #[allow(clippy::len_without_is_empty)] // a digest's length: never empty
    pub fn len(self) -> usize {
        match self {
            Hash::Sha256 => 32,
            Hash::Sha384 => 48,
            Hash::Sha512 => 64,
        }
    }

    /// The digest of `data`.
    pub fn digest(self, data: &[u8]) -> Vec<u8> {
        use sha2::Digest;
        match self {
            Hash::Sha256 => sha2::Sha256::digest(data).to_vec(),
            Hash::Sha384 => sha2::Sha384::digest(data).to_vec(),
            Hash::Sha512 => sha2::Sha512::digest(data).to_vec(),
        }
    }

    /// HMAC with `key` over the concatenation of `parts`.
    pub fn hmac(self, key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
        fn run<M: Mac + KeyInit>(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
            // HMAC takes a key of any length (a long one is hashed first): this cannot fail.
            let Ok(mut m) = <M as KeyInit>::new_from_slice(key) else { unreachable!("HMAC accepts keys of any length") };
            for p in parts {
                m.update(p);
            }
            m.finalize().into_bytes().to_vec()
        }
        match self {
            Hash::Sha256 => run::<Hmac<sha2::Sha256>>(key, parts),
            Hash::Sha384 => run::<Hmac<sha2::Sha384>>(key, parts),
            Hash::Sha512 => run::<Hmac<sha2::Sha512>>(key, parts),
        }
    }
}

/// The challenge a response is computed over: C itself with the null DH group, else the
/// augmented challenge Ca = HMAC(H(g^xy mod p), C) (NVMe Base, "DH-HMAC-CHAP protocol").
pub fn augmented_challenge(hash: Hash, session_key: Option<&[u8]>, challenge: &[u8]) -> Vec<u8> {
    match session_key {
        None => challenge.to_vec(),
        Some(k) => hash.hmac(&hash.digest(k), &[challenge]),
    }
}

/// What one transaction's responses are computed from: the names, the transaction and,
/// with a DH group, the session key g^xy mod p.
pub struct Transaction<'a> {
    pub hash: Hash,
    pub t_id: u16,
    pub hostnqn: &'a str,
    pub subnqn: &'a str,
    pub session_key: Option<&'a [u8]>,
}

/// The host's response R1 to the controller's challenge C1 with sequence number S1:
/// HMAC(Kh, Ca1 || S1 || T_ID || SC_C || "HostHost" || NQNh || 00h || NQNc), Kh the host's
/// secret transformed with its NQN.
pub fn host_response(t: &Transaction, host_key: &Secret, c1: &[u8], s1: u32) -> Vec<u8> {
    let key = host_key.transformed(t.hostnqn);
    let ca = augmented_challenge(t.hash, t.session_key, c1);
    let parts: [&[u8]; 8] =
        [&ca, &s1.to_le_bytes(), &t.t_id.to_le_bytes(), &[0], b"HostHost", t.hostnqn.as_bytes(), &[0], t.subnqn.as_bytes()];
    t.hash.hmac(&key, &parts)
}

/// The controller's response R2 to the host's challenge C2 with sequence number S2
/// (bidirectional authentication): HMAC(Kc, Ca2 || S2 || T_ID || 00h || "Controller" ||
/// NQNc || 00h || NQNh), Kc the controller's secret transformed with the subsystem NQN.
pub fn ctrl_response(t: &Transaction, ctrl_key: &Secret, c2: &[u8], s2: u32) -> Vec<u8> {
    let key = ctrl_key.transformed(t.subnqn);
    let ca = augmented_challenge(t.hash, t.session_key, c2);
    let parts: [&[u8]; 8] =
        [&ca, &s2.to_le_bytes(), &t.t_id.to_le_bytes(), &[0], b"Controller", t.subnqn.as_bytes(), &[0], t.hostnqn.as_bytes()];
    t.hash.hmac(&key, &parts)
}

/// Equality of two responses in time independent of where they differ.
pub fn same_response(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `n` random bytes from the operating system (challenges, keys, exponents).
pub fn random_bytes(n: usize) -> Result<Vec<u8>, getrandom::Error> {
    let mut b = vec![0u8; n];
    getrandom::fill(&mut b)?;
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 4231 test case 2 (key "Jefe"): the HMACs are RustCrypto's, wired to the right
    /// hash per identifier.
    #[test]
    fn hmac_per_hash_id() {
        let cases: [(u8, &str); 3] = [
            (1, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"),
            (2, "af45d2e376484031617f78d2b58a6b1b9c7ef464f5a01b47e42ec3736322445e8e2240ca5e69e2c78b3239ecfab21649"),
            (3, "164b7a7bfcf819e2e395fbe73b56e0a387bd64222e831fd610270cd7ea2505549758bf75c05a994a6d034f65f8f0e6fdcaeab1a34d4a6b4b636e070a38bce737"),
        ];
        for (id, want) in cases {
            let h = Hash::from_id(id).unwrap();
            let got = h.hmac(b"Jefe", &[b"what do ya want ", b"for nothing?"]);
            assert_eq!(hex(&got), want, "{}", h.name());
            assert_eq!(got.len(), h.len());
        }
        assert!(Hash::from_id(0).is_none() && Hash::from_id(4).is_none());
    }

    /// The two responses differ by role (a host's reply cannot stand for the controller's),
    /// by transaction and by sequence number (a reply of one transaction fails in another).
    #[test]
    fn responses_depend_on_role_transaction_and_sequence() {
        let key: Secret = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:".parse().unwrap();
        let t = Transaction { hash: Hash::Sha256, t_id: 7, hostnqn: "nqn.h", subnqn: "nqn.s", session_key: None };
        let c = [9u8; 32];
        let r = host_response(&t, &key, &c, 1);
        assert_ne!(r, ctrl_response(&t, &key, &c, 1));
        assert_ne!(r, host_response(&Transaction { t_id: 8, ..t }, &key, &c, 1));
        assert_ne!(r, host_response(&Transaction { t_id: 7, ..t }, &key, &c, 2));
        assert_ne!(r, host_response(&Transaction { session_key: Some(&[1, 2, 3]), ..t }, &key, &c, 1));
        assert_eq!(r, host_response(&Transaction { t_id: 7, ..t }, &key, &c, 1));
        assert!(same_response(&r, &r.clone()) && !same_response(&r, &r[..31]));
    }

    pub(crate) fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }
}
