//! DH-HMAC-CHAP secrets in their textual form (NVMe Base, "Secret representation"; what
//! nvme-cli's `gen-dhchap-key` prints and `--dhchap-secret` takes):
//!
//! ```text
//! DHHC-1:XX:base64(key || CRC-32(key), little-endian):
//! ```
//!
//! XX is the transformation the secret goes through before use: 00 none, 01 SHA-256, 02
//! SHA-384, 03 SHA-512 (HMAC keyed with the secret over the NQN and "NVMe-over-Fabrics").
//! The key is 32, 48 or 64 bytes; a transformed one is as long as its hash's digest.

use std::fmt;
use std::str::FromStr;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;

use crate::Hash;

const PREFIX: &str = "DHHC-1:";

/// Lengths of a key (bytes): NVMe Base allows these three.
pub const KEY_LENS: [usize; 3] = [32, 48, 64];

/// What a secret's text may be wrong in.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    #[error("a DH-HMAC-CHAP secret starts with \"DHHC-1:\"")]
    Prefix,
    #[error("the transformation must be 00, 01, 02 or 03 (none, SHA-256, SHA-384, SHA-512), not '{0}'")]
    Transform(String),
    #[error("the key is not base64")]
    Base64,
    #[error("the key and its CRC are {0} bytes: a key is 32, 48 or 64 bytes, followed by 4 of CRC")]
    Length(usize),
    #[error("the CRC-32 of the key does not match: the secret is damaged")]
    Crc,
    #[error("a key transformed with {hash} is {want} bytes, not {got}")]
    KeyLenForHash { hash: &'static str, want: usize, got: usize },
}

/// A secret: its key and the transformation it goes through before use.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret {
    transform: Option<Hash>,
    key: Vec<u8>,
}

impl Secret {
    /// A secret from its parts, checked as a parsed one is.
    pub fn new(transform: Option<Hash>, key: Vec<u8>) -> Result<Secret, SecretError> {
        if !KEY_LENS.contains(&key.len()) {
            return Err(SecretError::Length(key.len() + 4));
        }
        if let Some(h) = transform.filter(|h| h.len() != key.len()) {
            return Err(SecretError::KeyLenForHash { hash: h.name(), want: h.len(), got: key.len() });
        }
        Ok(Secret { transform, key })
    }

    /// A new random secret, as nvme-cli's `gen-dhchap-key`: `key_len` random bytes, or with
    /// a transformation, those bytes transformed with `nqn` (its digest: `key_len` must be
    /// the hash's length).
    pub fn generate(transform: Option<Hash>, key_len: usize, nqn: &str) -> Result<Secret, GenerateError> {
        if let Some(h) = transform.filter(|h| h.len() != key_len) {
            return Err(GenerateError::Secret(SecretError::KeyLenForHash { hash: h.name(), want: h.len(), got: key_len }));
        }
        let raw = crate::random_bytes(key_len).map_err(GenerateError::Random)?;
        let key = match transform {
            None => raw,
            Some(h) => h.hmac(&raw, &[nqn.as_bytes(), b"NVMe-over-Fabrics"]),
        };
        Secret::new(transform, key).map_err(GenerateError::Secret)
    }

    pub fn transform(&self) -> Option<Hash> {
        self.transform
    }

    /// The key that goes into the HMACs of `nqn`'s responses: the key itself without a
    /// transformation, else HMAC(key, NQN || "NVMe-over-Fabrics").
    pub fn transformed(&self, nqn: &str) -> Vec<u8> {
        match self.transform {
            None => self.key.clone(),
            Some(h) => h.hmac(&self.key, &[nqn.as_bytes(), b"NVMe-over-Fabrics"]),
        }
    }
}

/// Why no secret could be generated.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("reading random bytes: {0}")]
    Random(getrandom::Error),
    #[error(transparent)]
    Secret(SecretError),
}

impl FromStr for Secret {
    type Err = SecretError;

    /// Parses `DHHC-1:XX:base64:` (the last colon may be left out, as Linux accepts).
    fn from_str(s: &str) -> Result<Secret, SecretError> {
        let rest = s.trim().strip_prefix(PREFIX).ok_or(SecretError::Prefix)?;
        let (xx, b64) = rest.split_once(':').ok_or(SecretError::Prefix)?;
        let transform = match xx {
            "00" => None,
            "01" | "02" | "03" => Hash::from_id(xx.as_bytes()[1] - b'0'),
            _ => return Err(SecretError::Transform(xx.chars().take(8).collect())),
        };
        let b64 = b64.strip_suffix(':').unwrap_or(b64);
        let raw = STANDARD.decode(b64).map_err(|_| SecretError::Base64)?;
        if !KEY_LENS.iter().any(|n| n + 4 == raw.len()) {
            return Err(SecretError::Length(raw.len()));
        }
        let (key, crc) = raw.split_at(raw.len() - 4);
        if crc32fast::hash(key).to_le_bytes() != crc {
            return Err(SecretError::Crc);
        }
        Secret::new(transform, key.to_vec())
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let mut raw = self.key.clone();
        raw.extend_from_slice(&crc32fast::hash(&self.key).to_le_bytes());
        write!(f, "{PREFIX}{:02x}:{}:", self.transform.map_or(0, Hash::id), STANDARD.encode(raw))
    }
}

/// Never prints the key: secrets end up in logs through `{:?}`.
impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "Secret({PREFIX}{:02x}:<{} bytes>)", self.transform.map_or(0, Hash::id), self.key.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(transform: u8, key: &[u8], crc: Option<[u8; 4]>) -> String {
        let mut raw = key.to_vec();
        raw.extend_from_slice(&crc.unwrap_or(crc32fast::hash(key).to_le_bytes()));
        format!("DHHC-1:{transform:02}:{}:", STANDARD.encode(raw))
    }

    /// One line per case: a secret's text and what parsing it gives.
    #[test]
    fn parse_table() {
        let k32 = [0x11u8; 32];
        let k48 = [0x22u8; 48];
        let k64 = [0x33u8; 64];
        // A secret's text, and its transform and key length or the refusal.
        type Case = (String, Result<(Option<Hash>, usize), SecretError>);
        let cases: Vec<Case> = vec![
            (text(0, &k32, None), Ok((None, 32))),
            (text(0, &k48, None), Ok((None, 48))),
            (text(0, &k64, None), Ok((None, 64))),
            (text(1, &k32, None), Ok((Some(Hash::Sha256), 32))),
            (text(2, &k48, None), Ok((Some(Hash::Sha384), 48))),
            (text(3, &k64, None), Ok((Some(Hash::Sha512), 64))),
            (text(0, &k32, None).trim_end_matches(':').to_string(), Ok((None, 32))),
            (format!(" {}\n", text(0, &k32, None)), Ok((None, 32))),
            (text(1, &k64, None), Err(SecretError::KeyLenForHash { hash: "sha256", want: 32, got: 64 })),
            (text(3, &k32, None), Err(SecretError::KeyLenForHash { hash: "sha512", want: 64, got: 32 })),
            (text(4, &k32, None), Err(SecretError::Transform("04".into()))),
            (text(0, &k32, Some([0, 0, 0, 0])), Err(SecretError::Crc)),
            (text(0, &[0x11; 16], None), Err(SecretError::Length(20))),
            (text(0, &[0x11; 33], None), Err(SecretError::Length(37))),
            ("DHHC-2:00:AAAA:".into(), Err(SecretError::Prefix)),
            ("DHHC-1:00".into(), Err(SecretError::Prefix)),
            ("DHHC-1:00:not base64!:".into(), Err(SecretError::Base64)),
            ("".into(), Err(SecretError::Prefix)),
        ];
        for (s, want) in cases {
            let got = s.parse::<Secret>().map(|k| (k.transform, k.key.len()));
            assert_eq!(got, want, "{s:?}");
        }
    }

    /// The NVMe Base Specification's example secret, so the CRC and base64 are the ones
    /// other implementations write; damaged in one character, its CRC fails.
    #[test]
    fn parses_the_specifications_example() {
        let spec = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:";
        let k: Secret = spec.parse().unwrap();
        assert_eq!(k.transform(), None);
        assert_eq!(k.to_string(), spec);
        assert_eq!("DHHC-1:00:ja6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:".parse::<Secret>(), Err(SecretError::Crc));
    }

    #[test]
    fn generated_secrets_round_trip_and_transform_with_the_nqn() {
        for (t, len) in [(None, 32), (None, 48), (None, 64), (Some(Hash::Sha256), 32), (Some(Hash::Sha384), 48), (Some(Hash::Sha512), 64)] {
            let k = Secret::generate(t, len, "nqn.2014-08.org.nvmexpress:uuid:1").unwrap();
            let back: Secret = k.to_string().parse().unwrap();
            assert_eq!(back, k);
            assert_eq!(k.transformed("nqn.a").len(), t.map_or(len, Hash::len));
            assert_eq!(k.transformed("nqn.a") == k.transformed("nqn.b"), t.is_none(), "only a transformed key depends on the NQN");
            assert!(!format!("{k:?}").contains(&k.to_string()[10..20]), "Debug hides the key");
        }
        assert!(matches!(Secret::generate(Some(Hash::Sha256), 64, "nqn.a"), Err(GenerateError::Secret(SecretError::KeyLenForHash { .. }))));
    }
}
