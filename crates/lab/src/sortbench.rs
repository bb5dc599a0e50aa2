//! Records in the format of the sort benchmark (sortbenchmark.org's gensort and valsort):
//! 100-byte records whose first 10 bytes are the key, and a validator that checks order
//! and a checksum of the multiset of records, so that a sort can be shown to have kept
//! every record and put them in order.
//!
//! A record: key (10 random bytes) | 00 11 | the record's number as 32 hex digits |
//! 88 99 AA BB | 48 filler bytes (hex digits from the number) | CC DD EE FF. The same
//! layout as gensort's binary records; the keys come from our own generator (SplitMix64
//! seeded by `seed`), so the files are not byte-identical to gensort's.

use anyhow::{bail, Result};

pub const RECORD: usize = 100;
pub const KEY: usize = 10;

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Record number `i` of the data set `seed`.
pub fn record(seed: u64, i: u64) -> [u8; RECORD] {
    let mut r = [0u8; RECORD];
    let mut st = seed ^ i.wrapping_mul(0xd1b5_4a32_d192_ed03);
    let a = splitmix(&mut st).to_be_bytes();
    let b = splitmix(&mut st).to_be_bytes();
    r[..8].copy_from_slice(&a);
    r[8..10].copy_from_slice(&b[..2]);
    r[10..12].copy_from_slice(&[0x00, 0x11]);
    r[12..44].copy_from_slice(format!("{i:032X}").as_bytes());
    r[44..48].copy_from_slice(&[0x88, 0x99, 0xAA, 0xBB]);
    for (k, c) in r[48..96].iter_mut().enumerate() {
        *c = b"0123456789ABCDEF"[((i >> ((k % 16) * 4)) as usize + k / 16) & 15];
    }
    r[96..].copy_from_slice(&[0xCC, 0xDD, 0xEE, 0xFF]);
    r
}

/// What valsort reports.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Summary {
    pub records: u64,
    /// Records whose key equals the one before.
    pub duplicate_keys: u64,
    /// Sum of every record's CRC-32C, as 128-bit hex: the same for any order of the same
    /// records, different when a record is lost, duplicated or changed.
    pub checksum: String,
    /// The number of the first record whose key is less than the one before, if any.
    pub first_unordered: Option<u64>,
}

impl Summary {
    pub fn sorted(&self) -> bool {
        self.first_unordered.is_none()
    }
}

/// Checks records as they stream by, in chunks of any size.
#[derive(Default)]
pub struct Validator {
    partial: Vec<u8>,
    prev: Option<[u8; KEY]>,
    sum: u128,
    s: Summary,
}

impl Validator {
    pub fn update(&mut self, mut data: &[u8]) {
        if !self.partial.is_empty() {
            let take = (RECORD - self.partial.len()).min(data.len());
            self.partial.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.partial.len() == RECORD {
                let r = std::mem::take(&mut self.partial);
                self.one(&r);
            }
        }
        let mut chunks = data.chunks_exact(RECORD);
        for r in &mut chunks {
            self.one(r);
        }
        self.partial.extend_from_slice(chunks.remainder());
    }

    fn one(&mut self, r: &[u8]) {
        let key: [u8; KEY] = r[..KEY].try_into().expect("10 bytes");
        if let Some(p) = self.prev {
            if key < p && self.s.first_unordered.is_none() {
                self.s.first_unordered = Some(self.s.records);
            }
            if key == p {
                self.s.duplicate_keys += 1;
            }
        }
        self.prev = Some(key);
        self.sum = self.sum.wrapping_add(crc32c::crc32c(r) as u128);
        self.s.records += 1;
    }

    pub fn finish(mut self) -> Result<Summary> {
        if !self.partial.is_empty() {
            bail!("valsort: the input ends with {} bytes, less than a {RECORD}-byte record", self.partial.len());
        }
        self.s.checksum = format!("{:032x}", self.sum);
        Ok(self.s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn generate(seed: u64, n: u64) -> Vec<u8> {
        (0..n).flat_map(|i| record(seed, i)).collect()
    }

    fn check(data: &[u8], chunk: usize) -> Summary {
        let mut v = Validator::default();
        data.chunks(chunk).for_each(|c| v.update(c));
        v.finish().unwrap()
    }

    #[test]
    fn generated_records_validate_and_sorting_keeps_the_checksum() {
        let data = generate(7, 5000);
        assert_eq!(&data[10..12], &[0x00, 0x11]);
        assert_eq!(&data[12..44], format!("{:032X}", 0).as_bytes());
        assert_eq!(&data[96..100], &[0xCC, 0xDD, 0xEE, 0xFF]);
        let unsorted = check(&data, 4096);
        assert_eq!(unsorted.records, 5000);
        assert!(!unsorted.sorted());
        let mut recs: Vec<&[u8]> = data.chunks(RECORD).collect();
        recs.sort_by_key(|r| &r[..KEY]);
        let sorted: Vec<u8> = recs.concat();
        for chunk in [1, 99, 100, 101, 1 << 20] {
            let s = check(&sorted, chunk);
            assert!(s.sorted(), "chunks of {chunk}");
            assert_eq!(s.checksum, unsorted.checksum);
        }
        // A lost record, a changed byte, two records swapped: each is seen.
        assert_ne!(check(&sorted[RECORD..], 4096).checksum, unsorted.checksum);
        let mut changed = sorted.clone();
        changed[150] ^= 1;
        assert_ne!(check(&changed, 4096).checksum, unsorted.checksum);
        let mut swapped = sorted.clone();
        swapped[..2 * RECORD].rotate_left(RECORD);
        assert_eq!(check(&swapped, 4096).first_unordered, Some(1));
        let mut v = Validator::default();
        v.update(&sorted[..150]);
        assert!(v.finish().unwrap_err().to_string().contains("ends with 50 bytes"));
        // Another seed, other keys.
        assert_ne!(generate(8, 10), generate(7, 10));
    }
}
