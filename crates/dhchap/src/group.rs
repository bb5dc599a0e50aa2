//! The Diffie-Hellman groups of DH-HMAC-CHAP (NVMe Base, "DH-HMAC-CHAP Diffie-Hellman group
//! identifiers"): the null group (no exchange) and the finite-field groups of RFC 7919.
//! Values go on the wire big-endian, as long as the group's prime.

use std::sync::OnceLock;

use num_bigint::BigUint;

use crate::ffdhe;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DhGroup {
    Null = 0,
    Ffdhe2048 = 1,
    Ffdhe3072 = 2,
    Ffdhe4096 = 3,
    Ffdhe6144 = 4,
    Ffdhe8192 = 5,
}

/// Bits of a private exponent: at least twice the security strength of the largest group
/// (ffdhe8192, about 200 bits; RFC 7919 section 5.2 asks for two times), for every group.
pub const EXPONENT_BITS: usize = 512;

/// The bytes of the largest group's values (ffdhe8192): what DHVLEN can be at most.
pub const VALUE_BYTES_MAX: usize = 1024;

/// The peer's public value is not one of the group (RFC 7919 section 5.1: 1 < y < p-1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the public value is not in the group (1 < y < p-1, at most as long as p)")]
pub struct BadPublicValue;

impl DhGroup {
    pub const ALL: [DhGroup; 6] =
        [DhGroup::Null, DhGroup::Ffdhe2048, DhGroup::Ffdhe3072, DhGroup::Ffdhe4096, DhGroup::Ffdhe6144, DhGroup::Ffdhe8192];

    pub fn from_id(id: u8) -> Option<DhGroup> {
        DhGroup::ALL.into_iter().find(|g| g.id() == id)
    }

    pub fn from_name(name: &str) -> Option<DhGroup> {
        DhGroup::ALL.into_iter().find(|g| g.name() == name)
    }

    pub fn id(self) -> u8 {
        self as u8
    }

    /// Its name in the configuration: null, ffdhe2048 .. ffdhe8192.
    pub fn name(self) -> &'static str {
        match self {
            DhGroup::Null => "null",
            DhGroup::Ffdhe2048 => "ffdhe2048",
            DhGroup::Ffdhe3072 => "ffdhe3072",
            DhGroup::Ffdhe4096 => "ffdhe4096",
            DhGroup::Ffdhe6144 => "ffdhe6144",
            DhGroup::Ffdhe8192 => "ffdhe8192",
        }
    }

    /// Bytes of its values (DHVLEN): 0 for the null group.
    pub fn value_len(self) -> usize {
        match self {
            DhGroup::Null => 0,
            DhGroup::Ffdhe2048 => 256,
            DhGroup::Ffdhe3072 => 384,
            DhGroup::Ffdhe4096 => 512,
            DhGroup::Ffdhe6144 => 768,
            DhGroup::Ffdhe8192 => 1024,
        }
    }

    /// Its prime, parsed once; None for the null group.
    fn prime(self) -> Option<&'static BigUint> {
        static PRIMES: [OnceLock<BigUint>; 5] = [const { OnceLock::new() }; 5];
        let (i, hex) = match self {
            DhGroup::Null => return None,
            DhGroup::Ffdhe2048 => (0, ffdhe::FFDHE2048),
            DhGroup::Ffdhe3072 => (1, ffdhe::FFDHE3072),
            DhGroup::Ffdhe4096 => (2, ffdhe::FFDHE4096),
            DhGroup::Ffdhe6144 => (3, ffdhe::FFDHE6144),
            DhGroup::Ffdhe8192 => (4, ffdhe::FFDHE8192),
        };
        Some(PRIMES[i].get_or_init(|| BigUint::parse_bytes(hex.as_bytes(), 16).unwrap_or_default()))
    }

    /// A new key pair: a random exponent x of [`EXPONENT_BITS`] and g^x mod p. None for the
    /// null group, or when the system has no random bytes to give.
    pub fn keypair(self) -> Option<KeyPair> {
        let p = self.prime()?;
        let x = BigUint::from_bytes_be(&crate::random_bytes(EXPONENT_BITS / 8).ok()?);
        let public = pad(&BigUint::from(2u32).modpow(&x, p), self.value_len());
        Some(KeyPair { group: self, x, public })
    }
}

/// The big-endian bytes of `v`, left-padded with zeros to `len`.
fn pad(v: &BigUint, len: usize) -> Vec<u8> {
    let b = v.to_bytes_be();
    let mut out = vec![0u8; len.saturating_sub(b.len())];
    out.extend_from_slice(&b);
    out
}

/// One end's Diffie-Hellman key pair for one transaction.
pub struct KeyPair {
    group: DhGroup,
    x: BigUint,
    /// g^x mod p, as long as the group's values: the DH value this end sends.
    pub public: Vec<u8>,
}

impl KeyPair {
    /// The session key g^xy mod p from the peer's public value (any length up to the
    /// group's, big-endian), as long as the group's values.
    pub fn shared(&self, peer: &[u8]) -> Result<Vec<u8>, BadPublicValue> {
        let p = self.group.prime().ok_or(BadPublicValue)?;
        if peer.len() > self.group.value_len() {
            return Err(BadPublicValue);
        }
        let y = BigUint::from_bytes_be(peer);
        let one = BigUint::from(1u32);
        if y <= one || y >= p - &one {
            return Err(BadPublicValue);
        }
        Ok(pad(&y.modpow(&self.x, p), self.group.value_len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 7919's primes: as long as their name, 64 one bits at each end, and prime to
    /// Fermat's test with base 3 (a typo in the constants fails it).
    #[test]
    fn primes_are_rfc_7919() {
        for g in DhGroup::ALL.into_iter().skip(1) {
            let p = g.prime().unwrap();
            assert_eq!(p.bits() as usize, g.value_len() * 8, "{}", g.name());
            let b = p.to_bytes_be();
            assert!(b[..8].iter().chain(&b[b.len() - 8..]).all(|&x| x == 0xff), "{}", g.name());
            let one = BigUint::from(1u32);
            assert_eq!(BigUint::from(3u32).modpow(&(p - &one), p), one, "{} fails Fermat's test", g.name());
        }
        assert!(DhGroup::Null.prime().is_none() && DhGroup::Null.keypair().is_none());
    }

    /// Both ends reach one session key in every group; values outside the group are
    /// refused, one case a line.
    #[test]
    fn exchange_and_bad_public_values() {
        for g in DhGroup::ALL.into_iter().skip(1) {
            let (a, b) = (g.keypair().unwrap(), g.keypair().unwrap());
            assert_eq!(a.public.len(), g.value_len());
            let k = a.shared(&b.public).unwrap();
            assert_eq!(k, b.shared(&a.public).unwrap(), "{}", g.name());
            assert_eq!(k.len(), g.value_len());
            let p = g.prime().unwrap();
            let p_minus_1 = pad(&(p - 1u32), g.value_len());
            let mut too_long = vec![0u8];
            too_long.extend_from_slice(&b.public);
            let bad: [(&str, Vec<u8>); 6] = [
                ("zero", vec![0; g.value_len()]),
                ("one", vec![1]),
                ("p - 1", p_minus_1),
                ("p", pad(p, g.value_len())),
                ("longer than p", too_long),
                ("empty", vec![]),
            ];
            for (what, v) in bad {
                assert_eq!(a.shared(&v), Err(BadPublicValue), "{}: {what}", g.name());
            }
            assert_eq!(a.shared(&[2]).map(|k| k.len()), Ok(g.value_len()), "a short value is a number like any other");
        }
    }
}
