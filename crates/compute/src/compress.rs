//! `compress` and `decompress`: zstd, streamed from the input object into the output
//! object. The target compresses a file where it lies; only the sizes come back.
//!
//! Both use zstd's streaming contexts (`zstd::stream::raw`): bounded memory whatever the
//! object's size. compress writes one frame that records the input's length, so that
//! decompress (and `zstd -l`) know the size to expect. decompress refuses what is not
//! zstd, frames cut short, and windows larger than the command's memory bound.

use serde::Deserialize;
use zstd::stream::raw::{DParameter, Decoder, Encoder, Operation};

use crate::{no_args, parse_args, ComputeError, Context, Outcome, Sink, Source, Transform};

/// Compressed or decompressed bytes are handed to the output object in pieces this big.
const OUT_CHUNK: usize = 256 << 10;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CompressArgs {
    /// zstd's level: 1 (fast) to 22 (small); negative levels are faster still.
    #[serde(default = "default_level")]
    level: i32,
}

fn default_level() -> i32 {
    3
}

struct Compress {
    level: i32,
}

/// Hands everything in `buf` to the sink and empties it.
fn drain(buf: &mut Vec<u8>, out: &mut dyn Sink) -> Result<(), ComputeError> {
    if !buf.is_empty() {
        out.write(buf)?;
        buf.clear();
    }
    Ok(())
}

fn zerr(op: &'static str) -> impl Fn(std::io::Error) -> ComputeError {
    move |e| ComputeError::Data { op, message: e.to_string() }
}

impl Transform for Compress {
    fn run(self: Box<Self>, inputs: &mut [&mut dyn Source], outputs: &mut [&mut dyn Sink], _: &Context) -> Result<Outcome, ComputeError> {
        let (src, out) = (&mut *inputs[0], &mut *outputs[0]);
        let err = zerr("compress");
        let mut enc = Encoder::new(self.level).map_err(&err)?;
        enc.set_pledged_src_size(Some(src.len())).map_err(&err)?;
        let mut buf = vec![0u8; OUT_CHUNK];
        let mut read = 0u64;
        while let Some(chunk) = src.next_chunk()? {
            read += chunk.len() as u64;
            let mut at = 0;
            while at < chunk.len() {
                let s = enc.run_on_buffers(&chunk[at..], &mut buf).map_err(&err)?;
                at += s.bytes_read;
                if s.bytes_written > 0 {
                    out.write(&buf[..s.bytes_written])?;
                }
            }
        }
        loop {
            let mut ob = zstd::stream::raw::OutBuffer::around(&mut buf[..]);
            let left = enc.finish(&mut ob, true).map_err(&err)?;
            let n = ob.pos();
            if n > 0 {
                out.write(&buf[..n])?;
            }
            if left == 0 {
                break;
            }
        }
        Ok(Outcome::Written { input: read, output: out.written() })
    }
}

pub fn compress(args: &[u8]) -> Result<Box<dyn Transform>, ComputeError> {
    let a: CompressArgs = if args.iter().all(u8::is_ascii_whitespace) { CompressArgs { level: 3 } } else { parse_args("compress", args)? };
    let (lo, hi) = (zstd::zstd_safe::min_c_level(), zstd::zstd_safe::max_c_level());
    if a.level < lo || a.level > hi || a.level == 0 {
        return Err(ComputeError::BadArguments { op: "compress", message: format!("level {} is outside {lo}..=-1 and 1..={hi}", a.level) });
    }
    Ok(Box::new(Compress { level: a.level }))
}

struct Decompress;

impl Transform for Decompress {
    fn run(self: Box<Self>, inputs: &mut [&mut dyn Source], outputs: &mut [&mut dyn Sink], ctx: &Context) -> Result<Outcome, ComputeError> {
        let (src, out) = (&mut *inputs[0], &mut *outputs[0]);
        let err = zerr("decompress");
        let mut dec = Decoder::new().map_err(&err)?;
        // The window is the memory a frame asks for: at most the command's bound.
        let window_log = (usize::BITS - 1 - ctx.memory_max.max(1 << 10).leading_zeros()).clamp(10, 31);
        dec.set_parameter(DParameter::WindowLogMax(window_log)).map_err(&err)?;
        let mut buf = vec![0u8; OUT_CHUNK];
        let mut pending = Vec::with_capacity(OUT_CHUNK);
        let mut read = 0u64;
        // 0 when the last frame ended exactly: the input may end there.
        let mut frame_left = 1;
        while let Some(chunk) = src.next_chunk()? {
            read += chunk.len() as u64;
            let mut at = 0;
            loop {
                let s = dec.run_on_buffers(&chunk[at..], &mut buf).map_err(|e| ComputeError::Data {
                    op: "decompress",
                    message: format!("at input byte {}: {e}", read - (chunk.len() - at) as u64),
                })?;
                at += s.bytes_read;
                // A call that moved nothing (a last look after the output buffer filled
                // exactly) reports the next frame's header as wanted: not a cut frame.
                if s.bytes_read > 0 || s.bytes_written > 0 {
                    frame_left = s.remaining;
                }
                pending.extend_from_slice(&buf[..s.bytes_written]);
                if pending.len() >= OUT_CHUNK {
                    drain(&mut pending, out)?;
                }
                // Done with this chunk once it is consumed and the decoder has no more
                // output for it (a full buffer may mean more is waiting).
                if at == chunk.len() && s.bytes_written < buf.len() {
                    break;
                }
            }
        }
        drain(&mut pending, out)?;
        if read == 0 {
            return Err(ComputeError::Data { op: "decompress", message: "the input is empty, not a zstd frame".into() });
        }
        if frame_left != 0 {
            return Err(ComputeError::Data {
                op: "decompress",
                message: format!("the input ends inside a zstd frame (after {read} bytes)"),
            });
        }
        Ok(Outcome::Written { input: read, output: out.written() })
    }
}

pub fn decompress(args: &[u8]) -> Result<Box<dyn Transform>, ComputeError> {
    no_args("decompress", args)?;
    Ok(Box::new(Decompress))
}

/// The decompressed size a zstd frame header declares, if it does: how big an output
/// object to allocate for decompress.
pub fn declared_size(first_bytes: &[u8]) -> Option<u64> {
    zstd::zstd_safe::get_frame_content_size(first_bytes).ok().flatten()
}

/// One zstd frame of `data` at `level` (its content size in its header): compress-write's
/// frame on the target, at most `nearstore_wire::fused::compress_bound` bytes.
pub fn compress_frame(data: &[u8], level: i32) -> Result<Vec<u8>, ComputeError> {
    zstd::bulk::compress(data, level)
        .map_err(|e| ComputeError::BadArguments { op: "compress-write", message: format!("level {level}: {e}") })
}

/// The most bytes compress can write for `n` input bytes.
pub fn compress_bound(n: u64) -> u64 {
    // zstd's bound for one frame, plus its header and a block header per 128 KiB.
    n + n / 255 + (n / (128 << 10) + 1) * 3 + 64
}

#[cfg(test)]
mod tests {
    use crate::{by_name, ComputeError, Context, Outcome, SliceSource, VecSink};

    fn exec(op: &str, args: &[u8], data: &[u8], chunk: usize, cap: u64) -> Result<(Outcome, Vec<u8>), ComputeError> {
        let mut src = SliceSource::new(data.chunks(chunk.max(1)));
        let mut out = VecSink::new(cap);
        let o = by_name(op).unwrap().execute(args, &mut [&mut src], &mut [&mut out], &Context::default())?.remove(0);
        Ok((o, out.data))
    }

    #[test]
    fn round_trips_and_agrees_with_the_zstd_library() {
        let text: Vec<u8> = (0..100_000u32).flat_map(|i| format!("line {} of {}\n", i % 977, i / 3).into_bytes()).collect();
        for (level, chunk) in [(1, 1 << 20), (3, 4096), (12, 777), (-5, 100_000)] {
            let args = format!(r#"{{"level":{level}}}"#);
            let (o, z) = exec("compress", args.as_bytes(), &text, chunk, super::compress_bound(text.len() as u64)).unwrap();
            assert_eq!(o, Outcome::Written { input: text.len() as u64, output: z.len() as u64 });
            assert!(z.len() < text.len() / 3, "level {level}: {} bytes", z.len());
            assert_eq!(super::declared_size(&z), Some(text.len() as u64));
            // The zstd library reads what we wrote, and we read what it writes.
            assert!(zstd::decode_all(&z[..]).unwrap() == text);
            let theirs = zstd::encode_all(&text[..], level).unwrap();
            let (o, back) = exec("decompress", b"", &theirs, chunk, text.len() as u64).unwrap();
            assert_eq!(o, Outcome::Written { input: theirs.len() as u64, output: text.len() as u64 });
            assert!(back == text);
        }
        // Two frames one after the other decompress to both.
        let two = [zstd::encode_all(&b"abc"[..], 3).unwrap(), zstd::encode_all(&b"def"[..], 3).unwrap()].concat();
        assert_eq!(exec("decompress", b"", &two, 5, 100).unwrap().1, b"abcdef");
        // The empty input compresses to a frame that decompresses to nothing.
        let (_, z) = exec("compress", b"", b"", 1, 100).unwrap();
        assert_eq!(exec("decompress", b"", &z, 1, 100).unwrap().1, b"");
    }

    #[test]
    fn every_size_at_the_edges_of_every_buffer_round_trips() {
        const K: usize = 1 << 10;
        // zstd's block (128 KiB), our output piece (256 KiB), the engine's chunk (1 MiB).
        let mut sizes = vec![0, 1, 2];
        for b in [128 * K, super::OUT_CHUNK, 1 << 20] {
            for m in [1, 2, 3, 4] {
                sizes.extend([m * b - 1, m * b, m * b + 1]);
            }
        }
        // Data that compresses, and data that does not (blocks stored raw).
        let text: Vec<u8> = (0..(4 << 20) + 1).map(|i: usize| b"abcdefgh"[(i % 8) ^ ((i >> 14) % 3)]).collect();
        let noise: Vec<u8> = (0..(4 << 20) + 1)
            .scan(7u64, |s, _| {
                *s ^= *s << 13;
                *s ^= *s >> 7;
                *s ^= *s << 17;
                Some(*s as u8)
            })
            .collect();
        for n in sizes {
            for data in [&text[..n], &noise[..n]] {
                let z = zstd::encode_all(data, 3).unwrap();
                for chunk in [1 << 20, 128 * K, super::OUT_CHUNK, 4096, z.len().max(1)] {
                    let (o, back) =
                        exec("decompress", b"", &z, chunk, n as u64).unwrap_or_else(|e| panic!("{n} bytes, chunk {chunk}: {e}"));
                    assert_eq!(o, Outcome::Written { input: z.len() as u64, output: n as u64 }, "{n} bytes, chunk {chunk}");
                    assert!(back == data, "{n} bytes, chunk {chunk}");
                }
                let (o, z) = exec("compress", b"", data, 1 << 20, super::compress_bound(n as u64)).unwrap();
                assert_eq!(o, Outcome::Written { input: n as u64, output: z.len() as u64 });
                assert!(zstd::decode_all(&z[..]).unwrap() == data, "{n} bytes");
            }
        }
    }

    #[test]
    fn refuses_bad_input_and_small_outputs() {
        let z = zstd::encode_all(&vec![7u8; 100_000][..], 3).unwrap();
        let e = exec("decompress", b"", &z[..z.len() - 3], 64, 1 << 20).unwrap_err();
        assert!(e.to_string().contains("ends inside a zstd frame"), "{e}");
        let e = exec("decompress", b"", b"not zstd at all", 64, 1 << 20).unwrap_err();
        assert!(e.to_string().starts_with("decompress: bad input data: at input byte 0: "), "{e}");
        let e = exec("decompress", b"", b"", 64, 1 << 20).unwrap_err();
        assert!(e.to_string().contains("the input is empty"), "{e}");
        // A bomb stops at the output object's capacity.
        let e = exec("decompress", b"", &z, 64, 1000).unwrap_err();
        assert_eq!(e, ComputeError::OutputFull { capacity: 1000 });
        // A frame asking for a window larger than the memory bound.
        let big = {
            let mut enc = zstd::stream::Encoder::new(Vec::new(), 3).unwrap();
            enc.window_log(27).unwrap();
            enc.long_distance_matching(true).unwrap();
            std::io::Write::write_all(&mut enc, &vec![1u8; 1 << 20]).unwrap();
            enc.finish().unwrap()
        };
        let mut src = crate::SliceSource::new([&big[..]]);
        let mut out = VecSink::new(1 << 22);
        let e = by_name("decompress").unwrap().execute(b"", &mut [&mut src], &mut [&mut out], &Context::with_memory(1 << 20)).unwrap_err();
        assert!(e.to_string().contains("decompress: bad input data"), "{e}");
        for (args, want) in
            [(&br#"{"level":99}"#[..], "level 99 is outside"), (br#"{"level":0}"#, "level 0"), (br#"{"lvl":3}"#, "unknown field")]
        {
            let e = exec("compress", args, b"x", 1, 100).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
    }
}
