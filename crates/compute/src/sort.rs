//! `sort` and `merge`: fixed-size records ordered by a byte range (the key, compared as
//! unsigned bytes: TeraSort's 100-byte records with 10-byte keys), or lines ordered by
//! their bytes (`LC_ALL=C sort`).
//!
//! sort holds its inputs in memory, within the command's memory bound, and refuses more
//! before reading a byte. merge streams: k sorted inputs into one sorted output in
//! O(k) memory, whatever their size, and refuses an input that is not sorted. Larger
//! sorts are sorts of pieces, then a merge (what the distributed sort does). Both are
//! stable: records with equal keys keep their input order, earlier inputs first.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use serde::Deserialize;

use crate::{parse_args, ComputeError, Context, IndexEntry, Outcome, Sink, Source, Transform};

/// A line (or record) is at most this long.
pub const RECORD_BYTES_MAX: usize = 1 << 20;
/// Output is handed to the output object in pieces of about this size.
const OUT_CHUNK: usize = 256 << 10;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Args {
    /// Fixed-size records of this many bytes; absent: lines.
    record_size: Option<usize>,
    /// Records: where the key starts in the record (default 0).
    key_offset: Option<usize>,
    /// Records: the key's length (default: the rest of the record; 8 for `u64`).
    key_length: Option<usize>,
    /// Records: `bytes` (unsigned bytes, the default; also big-endian integers) or `u64`
    /// (an unsigned 64-bit little-endian integer, as a u64 array in memory is).
    key_type: Option<String>,
    /// sort: also return the key and output offset of every so many records, this many
    /// entries at most (1..=4096).
    index: Option<usize>,
    /// merge: write only records whose key is at least this (hex of the compared bytes).
    key_min: Option<String>,
    /// merge: write only records whose key is below this; an input ends at its first
    /// record at or past it.
    key_max: Option<String>,
    /// merge: bytes to skip at the start of each input (a slice that starts inside a
    /// block).
    skip: Option<Vec<u64>>,
}

/// Most index entries a sort returns.
pub const INDEX_MAX: usize = 4096;

/// What sort and merge do besides ordering.
#[derive(Clone, Debug, Default)]
struct Extras {
    index: Option<usize>,
    key_min: Option<Vec<u8>>,
    key_max: Option<Vec<u8>>,
    skip: Vec<u64>,
}

/// The arguments of sort or merge, read once: how records are cut and compared, and the
/// rest.
fn parse(op: &'static str, raw: &[u8]) -> Result<(Layout, Extras), ComputeError> {
    let a: Args = if raw.iter().all(u8::is_ascii_whitespace) { Args::default() } else { parse_args(op, raw)? };
    Ok((Layout::from_args(op, &a)?, Extras::from_args(op, a)?))
}

impl Extras {
    fn from_args(op: &'static str, a: Args) -> Result<Extras, ComputeError> {
        let bad = |m: String| ComputeError::BadArguments { op, message: m };
        let key = |name: &str, v: Option<String>| -> Result<Option<Vec<u8>>, ComputeError> {
            v.map(|h| hex::decode(&h).map_err(|e| bad(format!("{name} {h:?}: not hex ({e})")))).transpose()
        };
        let is_sort = op == "sort";
        if is_sort && (a.key_min.is_some() || a.key_max.is_some() || a.skip.is_some()) {
            return Err(bad("key_min, key_max and skip are merge's".into()));
        }
        if !is_sort && a.index.is_some() {
            return Err(bad("index is sort's".into()));
        }
        if let Some(n) = a.index {
            if n == 0 || n > INDEX_MAX {
                return Err(bad(format!("index {n} is outside 1..={INDEX_MAX}")));
            }
        }
        let skip = a.skip.unwrap_or_default();
        if let Some(s) = skip.iter().find(|s| **s > RECORD_BYTES_MAX as u64) {
            return Err(bad(format!("skip {s} is more than {RECORD_BYTES_MAX} bytes")));
        }
        Ok(Extras { index: a.index, key_min: key("key_min", a.key_min)?, key_max: key("key_max", a.key_max)?, skip })
    }
}

/// How records are cut and compared.
#[derive(Clone, Copy, Debug)]
enum Layout {
    Records { size: usize, key: (usize, usize), u64le: bool },
    Lines,
}

impl Layout {
    fn from_args(op: &'static str, a: &Args) -> Result<Layout, ComputeError> {
        let bad = |m: String| ComputeError::BadArguments { op, message: m };
        match a.record_size {
            None => {
                if a.key_offset.is_some() || a.key_length.is_some() || a.key_type.is_some() {
                    return Err(bad("key_offset, key_length and key_type need record_size".into()));
                }
                Ok(Layout::Lines)
            }
            Some(size) => {
                if size == 0 || size > RECORD_BYTES_MAX {
                    return Err(bad(format!("record_size {size} is outside 1..={RECORD_BYTES_MAX}")));
                }
                let u64le = match a.key_type.as_deref() {
                    None | Some("bytes") => false,
                    Some("u64") => true,
                    Some(t) => return Err(bad(format!("key_type {t:?}: bytes or u64"))),
                };
                let off = a.key_offset.unwrap_or(0);
                let len = a.key_length.unwrap_or(if u64le { 8 } else { size.saturating_sub(off) });
                if u64le && len != 8 {
                    return Err(bad(format!("a u64 key is 8 bytes, not key_length {len}")));
                }
                if len == 0 || off.checked_add(len).is_none_or(|end| end > size) {
                    return Err(bad(format!(
                        "the key (offset {off}, length {len}) must be a non-empty range inside the {size}-byte record"
                    )));
                }
                Ok(Layout::Records { size, key: (off, len), u64le })
            }
        }
    }

    /// The bytes a record is ordered by, compared as unsigned bytes: its key (a u64 key
    /// turned big-endian), or the line without its newline.
    fn key<'a>(&self, rec: &'a [u8]) -> std::borrow::Cow<'a, [u8]> {
        match self {
            Layout::Records { key: (o, _), u64le: true, .. } => {
                let v = u64::from_le_bytes(rec[*o..*o + 8].try_into().expect("8 bytes"));
                std::borrow::Cow::Owned(v.to_be_bytes().to_vec())
            }
            Layout::Records { key: (o, l), .. } => std::borrow::Cow::Borrowed(&rec[*o..*o + *l]),
            Layout::Lines => std::borrow::Cow::Borrowed(rec.strip_suffix(b"\n").unwrap_or(rec)),
        }
    }
}

/// Output bytes, gathered and written in large pieces.
struct Writer<'s> {
    out: &'s mut dyn Sink,
    buf: Vec<u8>,
    records: u64,
}

impl Writer<'_> {
    /// One record; a last line without its newline gets one.
    fn record(&mut self, rec: &[u8], layout: Layout) -> Result<(), ComputeError> {
        self.records += 1;
        self.buf.extend_from_slice(rec);
        if matches!(layout, Layout::Lines) && !rec.ends_with(b"\n") {
            self.buf.push(b'\n');
        }
        if self.buf.len() >= OUT_CHUNK {
            self.out.write(&self.buf)?;
            self.buf.clear();
        }
        Ok(())
    }
    fn finish(self) -> Result<u64, ComputeError> {
        if !self.buf.is_empty() {
            self.out.write(&self.buf)?;
        }
        Ok(self.out.written())
    }
}

struct Sort {
    layout: Layout,
    extras: Extras,
}

impl Transform for Sort {
    fn run(self: Box<Self>, inputs: &mut [&mut dyn Source], outputs: &mut [&mut dyn Sink], ctx: &Context) -> Result<Outcome, ComputeError> {
        let total: u64 = inputs.iter().map(|s| s.len()).sum();
        // The data and an index entry per record (at least one per 64 bytes for lines).
        let per = match self.layout {
            Layout::Records { size, .. } => size as u64,
            Layout::Lines => 64,
        };
        let need = total + total / per * 16;
        if need > ctx.memory_max as u64 {
            return Err(ComputeError::Memory {
                op: "sort",
                limit: ctx.memory_max,
                what: format!("{total} bytes of input: sort pieces within the bound, then merge them"),
            });
        }
        let mut data = Vec::with_capacity(total as usize + inputs.len());
        // Records as (start, end) in `data`.
        let mut recs: Vec<(usize, usize)> = Vec::new();
        for (i, src) in inputs.iter_mut().enumerate() {
            let start = data.len();
            while let Some(c) = src.next_chunk()? {
                data.extend_from_slice(c);
            }
            match self.layout {
                Layout::Records { size, .. } => {
                    let n = data.len() - start;
                    if n % size != 0 {
                        return Err(ComputeError::Data {
                            op: "sort",
                            message: format!("input {i} is {n} bytes, not a multiple of the {size}-byte record"),
                        });
                    }
                    recs.extend((start..data.len()).step_by(size).map(|s| (s, s + size)));
                }
                Layout::Lines => {
                    let mut s = start;
                    for nl in memchr::memchr_iter(b'\n', &data[start..]) {
                        recs.push((s, start + nl + 1));
                        s = start + nl + 1;
                    }
                    if s < data.len() {
                        recs.push((s, data.len()));
                    }
                }
            }
            if let Some(&(s, e)) = recs.iter().find(|(s, e)| e - s > RECORD_BYTES_MAX) {
                return Err(ComputeError::Data {
                    op: "sort",
                    message: format!("a line of {} bytes at byte {s} of the inputs, more than {RECORD_BYTES_MAX}", e - s),
                });
            }
        }
        let layout = self.layout;
        // Stable: equal keys keep their order.
        match layout {
            // u64 keys: decoded once per record, not per comparison.
            Layout::Records { key: (o, _), u64le: true, .. } => {
                recs.sort_by_cached_key(|&(s, _)| u64::from_le_bytes(data[s + o..s + o + 8].try_into().expect("8 bytes")))
            }
            // Keys of up to 16 bytes (the sort benchmark's 10) as one integer, the bytes
            // in its high end: the same order, compared in one instruction instead of a
            // slice comparison per pair: `sort --local` of 2 M sort-benchmark records went
            // from 2.8 s to 1.1 s (reading and writing included).
            Layout::Records { key: (o, l), .. } if l <= 16 => recs.sort_by_cached_key(|&(s, _)| {
                let mut k = [0u8; 16];
                k[..l].copy_from_slice(&data[s + o..s + o + l]);
                u128::from_be_bytes(k)
            }),
            _ => recs.sort_by(|a, b| layout.key(&data[a.0..a.1]).cmp(&layout.key(&data[b.0..b.1]))),
        }
        let mut w = Writer { out: &mut *outputs[0], buf: Vec::with_capacity(OUT_CHUNK + RECORD_BYTES_MAX), records: 0 };
        let records = recs.len() as u64;
        let stride = self.extras.index.map(|n| recs.len().div_ceil(n).max(1));
        let mut index = Vec::new();
        let mut at = 0u64;
        for (i, (s, e)) in recs.into_iter().enumerate() {
            if stride.is_some_and(|k| i % k == 0) {
                index.push(IndexEntry { key: hex::encode(layout.key(&data[s..e])), offset: at });
            }
            at += (e - s) as u64 + u64::from(matches!(layout, Layout::Lines) && data[e - 1] != b'\n');
            w.record(&data[s..e], layout)?;
        }
        let (input, output) = (data.len() as u64, w.finish()?);
        Ok(match stride {
            Some(_) => Outcome::Sorted { input, output, records, index },
            None => Outcome::Written { input, output },
        })
    }
}

pub fn sort(args: &[u8]) -> Result<Box<dyn Transform>, ComputeError> {
    let (layout, extras) = parse("sort", args)?;
    Ok(Box::new(Sort { layout, extras }))
}

/// One input of a merge: a window of its bytes and the record at its head.
struct Cursor<'s> {
    src: &'s mut dyn Source,
    buf: Vec<u8>,
    /// The head record: buf[head.0..head.1].
    head: (usize, usize),
    eof: bool,
    records: u64,
    read: u64,
    /// Bytes still to pass over before the first record.
    skip: u64,
    /// Time spent waiting for the source's chunks.
    wait: std::time::Duration,
}

impl Cursor<'_> {
    /// Moves to the next record; false at the end of the input.
    fn advance(&mut self, layout: Layout, input: usize) -> Result<bool, ComputeError> {
        while self.skip > 0 {
            if self.buf.is_empty() && !self.pull()? {
                self.skip = 0;
                break;
            }
            let n = (self.skip as usize).min(self.buf.len());
            self.buf.drain(..n);
            self.skip -= n as u64;
        }
        let mut start = self.head.1;
        loop {
            let avail = &self.buf[start..];
            let end = match layout {
                Layout::Records { size, .. } => (avail.len() >= size).then_some(size),
                Layout::Lines => memchr::memchr(b'\n', avail).map(|i| i + 1).or((self.eof && !avail.is_empty()).then_some(avail.len())),
            };
            if let Some(n) = end {
                self.head = (start, start + n);
                self.records += 1;
                return Ok(true);
            }
            if self.eof {
                if !avail.is_empty() {
                    return Err(ComputeError::Data {
                        op: "merge",
                        message: format!("input {input} ends with {} bytes, less than a record", avail.len()),
                    });
                }
                return Ok(false);
            }
            if avail.len() > RECORD_BYTES_MAX {
                return Err(ComputeError::Data {
                    op: "merge",
                    message: format!("input {input}: a line longer than {RECORD_BYTES_MAX} bytes"),
                });
            }
            // Keep the unread tail, then the next chunk.
            self.buf.drain(..start);
            start = 0;
            self.head = (0, 0);
            self.pull()?;
        }
    }

    /// Appends the source's next chunk to the window (timing the wait for it); false,
    /// and `eof` set, at its end.
    fn pull(&mut self) -> Result<bool, ComputeError> {
        let t = std::time::Instant::now();
        let c = self.src.next_chunk()?;
        self.wait += t.elapsed();
        match c {
            Some(c) => {
                self.read += c.len() as u64;
                self.buf.extend_from_slice(c);
                Ok(true)
            }
            None => {
                self.eof = true;
                Ok(false)
            }
        }
    }

    fn record(&self) -> &[u8] {
        &self.buf[self.head.0..self.head.1]
    }
}

struct Merge {
    layout: Layout,
    extras: Extras,
}

impl Transform for Merge {
    fn run(self: Box<Self>, inputs: &mut [&mut dyn Source], outputs: &mut [&mut dyn Sink], _: &Context) -> Result<Outcome, ComputeError> {
        let layout = self.layout;
        let x = &self.extras;
        if !x.skip.is_empty() && x.skip.len() != inputs.len() {
            return Err(ComputeError::BadArguments {
                op: "merge",
                message: format!("skip has {} entries for {} inputs", x.skip.len(), inputs.len()),
            });
        }
        let mut cursors: Vec<Cursor> = inputs
            .iter_mut()
            .enumerate()
            .map(|(i, s)| Cursor {
                src: &mut **s,
                buf: Vec::new(),
                head: (0, 0),
                eof: false,
                records: 0,
                read: 0,
                skip: x.skip.get(i).copied().unwrap_or(0),
                wait: std::time::Duration::ZERO,
            })
            .collect();
        let below_max = |k: &[u8]| x.key_max.as_deref().is_none_or(|m| k < m);
        // The smallest head key first; equal keys from the earlier input first.
        let mut heap: BinaryHeap<Reverse<(Vec<u8>, usize)>> = BinaryHeap::new();
        for (i, c) in cursors.iter_mut().enumerate() {
            // Records below key_min are passed over (they are sorted: a prefix).
            // The key before, in one buffer reused record after record.
            let mut prev: Vec<u8> = Vec::new();
            let mut first = true;
            while c.advance(layout, i)? {
                let k = layout.key(c.record());
                if !first && *k < *prev {
                    return Err(unsorted(i, c.records));
                }
                if x.key_min.as_deref().is_none_or(|m| *k >= *m) {
                    if below_max(&k) {
                        heap.push(Reverse((k.to_vec(), i)));
                    }
                    break;
                }
                prev.clear();
                prev.extend_from_slice(&k);
                first = false;
            }
        }
        let mut w = Writer { out: &mut *outputs[0], buf: Vec::with_capacity(OUT_CHUNK + RECORD_BYTES_MAX), records: 0 };
        while let Some(Reverse((mut key, i))) = heap.pop() {
            let c = &mut cursors[i];
            w.record(c.record(), layout)?;
            if c.advance(layout, i)? {
                let next = layout.key(c.record());
                if *next < *key.as_slice() {
                    return Err(unsorted(i, c.records));
                }
                // Past key_max the input is done: the rest is not read.
                if below_max(&next) {
                    // The popped key's buffer is reused for this input's next key.
                    key.clear();
                    key.extend_from_slice(&next);
                    heap.push(Reverse((key, i)));
                }
            }
        }
        let read = cursors.iter().map(|c| c.read).sum();
        let records = w.records;
        let input_wait_ms = cursors.iter().map(|c| c.wait).sum::<std::time::Duration>().as_millis() as u64;
        Ok(Outcome::Merged { input: read, output: w.finish()?, records, input_wait_ms })
    }
}

fn unsorted(input: usize, record: u64) -> ComputeError {
    ComputeError::Data { op: "merge", message: format!("input {input} is not sorted: its record {record} sorts before the one before it") }
}

pub fn merge(args: &[u8]) -> Result<Box<dyn Transform>, ComputeError> {
    let (layout, extras) = parse("merge", args)?;
    Ok(Box::new(Merge { layout, extras }))
}

#[cfg(test)]
mod tests {
    use crate::{by_name, ComputeError, Context, Outcome, Sink, SliceSource, Source, VecSink};

    fn exec(op: &str, args: &[u8], inputs: &[&[u8]], chunk: usize, ctx: &Context) -> Result<(Outcome, Vec<u8>), ComputeError> {
        let mut srcs: Vec<SliceSource> = inputs.iter().map(|d| SliceSource::new(d.chunks(chunk.max(1)))).collect();
        let mut ins: Vec<&mut dyn Source> = srcs.iter_mut().map(|s| s as &mut dyn Source).collect();
        let mut out = VecSink::new(1 << 26);
        let mut outs: Vec<&mut dyn Sink> = vec![&mut out];
        let o = by_name(op).unwrap().execute(args, &mut ins, &mut outs, ctx)?.remove(0);
        Ok((o, out.data))
    }

    fn records(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        (0..n * 20)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                // A small alphabet: many equal keys, to show stability.
                b'a' + (s % 3) as u8
            })
            .collect()
    }

    #[test]
    fn sorts_records_by_key_stably_and_lines_like_c_sort() {
        let ctx = Context::default();
        let (a, b) = (records(500, 1), records(300, 2));
        let args = br#"{"record_size":20,"key_offset":3,"key_length":4}"#;
        let (o, out) = exec("sort", args, &[&a, &b], 333, &ctx).unwrap();
        assert_eq!(o, Outcome::Written { input: 16_000, output: 16_000 });
        let mut want: Vec<&[u8]> = a.chunks(20).chain(b.chunks(20)).collect();
        want.sort_by_key(|r| &r[3..7]); // std's sort is stable too
        assert!(out == want.concat());

        let text = b"pear\nApple\n\napple\nbanana\n\xc3\xa9clair\nbanana";
        let (o, out) = exec("sort", b"", &[text], 4, &ctx).unwrap();
        assert_eq!(out, b"\nApple\napple\nbanana\nbanana\npear\n\xc3\xa9clair\n");
        assert_eq!(o, Outcome::Written { input: text.len() as u64, output: text.len() as u64 + 1 });
    }

    #[test]
    fn u64_keys_sort_as_numbers() {
        let ctx = Context::default();
        let nums = [5u64, 1 << 40, 3, u64::MAX, 0, 256, 255];
        let data: Vec<u8> = nums.iter().flat_map(|n| [n.to_le_bytes().to_vec(), b"payload!".to_vec()].concat()).collect();
        let args = br#"{"record_size":16,"key_type":"u64"}"#;
        let (_, out) = exec("sort", args, &[&data], 5, &ctx).unwrap();
        let got: Vec<u64> = out.chunks(16).map(|r| u64::from_le_bytes(r[..8].try_into().unwrap())).collect();
        let mut want = nums.to_vec();
        want.sort();
        assert_eq!(got, want);
        let halves: Vec<Vec<u8>> = [&data[..48], &data[48..]].iter().map(|h| exec("sort", args, &[h], 16, &ctx).unwrap().1).collect();
        assert_eq!(exec("merge", args, &[&halves[0], &halves[1]], 7, &ctx).unwrap().1, out);
        let e = exec("sort", br#"{"record_size":16,"key_type":"u64","key_length":4}"#, &[&data], 5, &ctx).unwrap_err();
        assert!(e.to_string().contains("a u64 key is 8 bytes"), "{e}");
        let e = exec("sort", br#"{"record_size":16,"key_type":"i32"}"#, &[&data], 5, &ctx).unwrap_err();
        assert!(e.to_string().contains("bytes or u64"), "{e}");
    }

    #[test]
    fn merge_of_sorted_pieces_equals_the_sort_of_the_whole() {
        let ctx = Context::default();
        let args = br#"{"record_size":20,"key_length":5}"#;
        let pieces: Vec<Vec<u8>> =
            (0..5).map(|i| exec("sort", args, &[&records(200 + i * 37, i as u64 + 9)], 1 << 20, &ctx).unwrap().1).collect();
        let refs: Vec<&[u8]> = pieces.iter().map(|p| &p[..]).collect();
        let whole = exec("sort", args, &refs, 1 << 20, &ctx).unwrap().1;
        for chunk in [7, 20, 4096] {
            let (o, merged) = exec("merge", args, &refs, chunk, &ctx).unwrap();
            assert!(merged == whole, "chunks of {chunk}");
            let Outcome::Merged { input, output, records, .. } = o else { panic!("{o:?}") };
            assert_eq!((input, output, records), (whole.len() as u64, whole.len() as u64, whole.len() as u64 / 20));
        }
        let (_, m) = exec("merge", b"", &[b"a\nc\ne", b"b\nd\n", b""], 1, &ctx).unwrap();
        assert_eq!(m, b"a\nb\nc\nd\ne\n");
    }

    #[test]
    fn refusals() {
        let ctx = Context::default();
        let e = exec("merge", b"", &[b"a\nc\nb\n"], 2, &ctx).unwrap_err();
        assert_eq!(e.to_string(), "merge: bad input data: input 0 is not sorted: its record 3 sorts before the one before it");
        let e = exec("merge", br#"{"record_size":4}"#, &[b"aaaabb"], 2, &ctx).unwrap_err();
        assert!(e.to_string().contains("input 0 ends with 2 bytes, less than a record"), "{e}");
        let e = exec("sort", br#"{"record_size":4}"#, &[b"aaaa", b"bbbbb"], 2, &ctx).unwrap_err();
        assert!(e.to_string().contains("input 1 is 5 bytes, not a multiple of the 4-byte record"), "{e}");
        let e = exec("sort", b"", &[&vec![b'x'; 5000]], 100, &Context::with_memory(4096)).unwrap_err();
        assert!(matches!(e, ComputeError::Memory { .. }), "{e}");
        let long = vec![b'x'; super::RECORD_BYTES_MAX + 2];
        let e = exec("merge", b"", &[&long], 4096, &ctx).unwrap_err();
        assert!(e.to_string().contains("a line longer than"), "{e}");
        for (args, want) in [
            (&br#"{"record_size":0}"#[..], "record_size 0"),
            (br#"{"record_size":10,"key_offset":8,"key_length":3}"#, "inside the 10-byte record"),
            (br#"{"record_size":10,"key_offset":10}"#, "non-empty range"),
            (br#"{"key_length":3}"#, "need record_size"),
            (br#"{"key_type":"u64"}"#, "need record_size"),
            (br#"{"record_size":"x"}"#, "invalid type"),
        ] {
            let e = exec("sort", args, &[b""], 1, &ctx).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
    }

    /// The distributed sort's pieces: sorted runs with an index, ranges picked from the
    /// index, slices of the runs that start inside a block (skip), merged by key range:
    /// the ranges concatenated equal the sort of everything.
    #[test]
    fn index_and_key_ranges_split_a_sort_into_ranges() {
        let ctx = Context::default();
        for (args, size) in [(&br#"{"record_size":20,"key_length":3}"#[..], 20usize), (br#"{"record_size":16,"key_type":"u64"}"#, 16)] {
            let runs: Vec<Vec<u8>> = (0..3).map(|i| records(300 + i * 50, 40 + i as u64)).collect();
            let runs: Vec<Vec<u8>> = runs.iter().map(|r| r[..r.len() / size * size].to_vec()).collect();
            let with_index = [&args[..args.len() - 1], b",\"index\":16}"].concat();
            let mut sorted = Vec::new();
            let mut index = Vec::new();
            for r in &runs {
                let (o, out) = exec("sort", &with_index, &[r], 64, &ctx).unwrap();
                let Outcome::Sorted { records, index: ix, output, .. } = o else { panic!("{o:?}") };
                assert_eq!((records as usize, output as usize), (r.len() / size, r.len()));
                assert!(ix.len() <= 16 && ix[0].offset == 0);
                for e in &ix {
                    assert_eq!(e.offset % size as u64, 0);
                }
                index.push(ix);
                sorted.push(out);
            }
            let refs: Vec<&[u8]> = runs.iter().map(|r| &r[..]).collect();
            let whole = exec("sort", args, &refs, 4096, &ctx).unwrap().1;
            // Two splitters from the index; each range merges a slice of every run: from
            // the last entry below its low key, to the first entry at or past its high key.
            let mut keys: Vec<&String> = index.iter().flatten().map(|e| &e.key).collect();
            keys.sort();
            let splitters = [keys[keys.len() / 3].clone(), keys[2 * keys.len() / 3].clone()];
            let bounds = [None, Some(&splitters[0]), Some(&splitters[1]), None];
            let mut joined = Vec::new();
            for j in 0..3 {
                let (lo, hi) = (bounds[j], bounds[j + 1]);
                let mut slices = Vec::new();
                let mut skips = Vec::new();
                for (ix, run) in index.iter().zip(&sorted) {
                    let start = lo.map_or(0, |lo| ix.iter().filter(|e| &e.key < lo).map(|e| e.offset).max().unwrap_or(0));
                    let end = hi.map_or(run.len() as u64, |hi| ix.iter().find(|e| &e.key >= hi).map_or(run.len() as u64, |e| e.offset));
                    // As the host cuts objects: from the block (8 bytes here) holding start.
                    let from = start / 8 * 8;
                    slices.push(&run[from as usize..end as usize]);
                    skips.push(start - from);
                }
                let mut a: serde_json::Value = serde_json::from_slice(args).unwrap();
                a["skip"] = serde_json::json!(skips);
                if let Some(lo) = lo {
                    a["key_min"] = serde_json::json!(lo);
                }
                if let Some(hi) = hi {
                    a["key_max"] = serde_json::json!(hi);
                }
                let (_, part) = exec("merge", &serde_json::to_vec(&a).unwrap(), &slices, 7, &ctx).unwrap();
                joined.extend(part);
            }
            assert!(joined == whole, "ranges differ from the whole sort");
        }
        let e = exec("sort", br#"{"record_size":4,"index":0}"#, &[b""], 1, &ctx).unwrap_err().to_string();
        assert!(e.contains("index 0 is outside"), "{e}");
        let e = exec("merge", br#"{"record_size":4,"key_min":"zz"}"#, &[b""], 1, &ctx).unwrap_err().to_string();
        assert!(e.contains("key_min \"zz\": not hex"), "{e}");
        let e = exec("merge", br#"{"record_size":4,"skip":[1,2]}"#, &[b""], 1, &ctx).unwrap_err().to_string();
        assert!(e.contains("skip has 2 entries for 1 inputs"), "{e}");
        let e = exec("sort", br#"{"record_size":4,"skip":[1]}"#, &[b""], 1, &ctx).unwrap_err().to_string();
        assert!(e.contains("merge's"), "{e}");
    }
}
