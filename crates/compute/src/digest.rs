//! Checksums and hashes. Each is the library's own streaming state behind [`Kernel`].

use sha2::Digest as _;

use crate::{no_args, ComputeError, Context, Kernel, Outcome};

enum State {
    Crc32c(u32),
    Crc64(crc::Digest<'static, u64>),
    Xxh3_64(Box<xxhash_rust::xxh3::Xxh3>),
    Xxh3_128(Box<xxhash_rust::xxh3::Xxh3>),
    Blake3(Box<blake3::Hasher>),
    Sha256(sha2::Sha256),
    Md5(md5::Md5),
}

struct Hash {
    name: &'static str,
    state: State,
}

static CRC64_NVME: crc::Crc<u64> = crc::Crc::<u64>::new(&crc::CRC_64_NVME);

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Kernel for Hash {
    fn update(&mut self, data: &[u8]) {
        match &mut self.state {
            State::Crc32c(c) => *c = crc32c::crc32c_append(*c, data),
            State::Crc64(d) => d.update(data),
            State::Xxh3_64(h) | State::Xxh3_128(h) => h.update(data),
            State::Blake3(h) => {
                h.update(data);
            }
            State::Sha256(h) => h.update(data),
            State::Md5(h) => h.update(data),
        }
    }

    fn finish(self: Box<Self>) -> Result<Outcome, ComputeError> {
        let hex = match self.state {
            State::Crc32c(c) => hex(&c.to_be_bytes()),
            State::Crc64(d) => hex(&d.finalize().to_be_bytes()),
            State::Xxh3_64(h) => hex(&h.digest().to_be_bytes()),
            State::Xxh3_128(h) => hex(&h.digest128().to_be_bytes()),
            State::Blake3(h) => h.finalize().to_hex().to_string(),
            State::Sha256(h) => hex(&h.finalize()),
            State::Md5(h) => hex(&h.finalize()),
        };
        Ok(Outcome::Digest { algorithm: self.name.into(), hex })
    }
}

fn build(name: &'static str, args: &[u8], state: State) -> Result<Box<dyn Kernel>, ComputeError> {
    no_args(name, args)?;
    Ok(Box::new(Hash { name, state }))
}

pub fn crc32c(args: &[u8], _: &Context) -> Result<Box<dyn Kernel>, ComputeError> {
    build("crc32c", args, State::Crc32c(0))
}

pub fn crc64_nvme(args: &[u8], _: &Context) -> Result<Box<dyn Kernel>, ComputeError> {
    build("crc64-nvme", args, State::Crc64(CRC64_NVME.digest()))
}

pub fn xxh3_64(args: &[u8], _: &Context) -> Result<Box<dyn Kernel>, ComputeError> {
    build("xxh3-64", args, State::Xxh3_64(Box::new(xxhash_rust::xxh3::Xxh3::new())))
}

pub fn xxh3_128(args: &[u8], _: &Context) -> Result<Box<dyn Kernel>, ComputeError> {
    build("xxh3-128", args, State::Xxh3_128(Box::new(xxhash_rust::xxh3::Xxh3::new())))
}

pub fn blake3(args: &[u8], _: &Context) -> Result<Box<dyn Kernel>, ComputeError> {
    build("blake3", args, State::Blake3(Box::new(blake3::Hasher::new())))
}

pub fn sha256(args: &[u8], _: &Context) -> Result<Box<dyn Kernel>, ComputeError> {
    build("sha256", args, State::Sha256(sha2::Sha256::new()))
}

pub fn md5(args: &[u8], _: &Context) -> Result<Box<dyn Kernel>, ComputeError> {
    build("md5", args, State::Md5(md5::Md5::new()))
}

#[cfg(test)]
mod tests {
    use crate::{run, Outcome};

    fn hex_of(op: &str, data: &[u8]) -> String {
        match run(op, b"", [data]).unwrap() {
            Outcome::Digest { hex, .. } => hex,
            o => panic!("{o:?}"),
        }
    }

    /// Published check values ("123456789") and the empty input.
    #[test]
    fn known_answers() {
        assert_eq!(hex_of("crc32c", b"123456789"), "e3069283");
        assert_eq!(hex_of("crc64-nvme", b"123456789"), "ae8b14860a799888");
        assert_eq!(hex_of("sha256", b""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        assert_eq!(hex_of("md5", b""), "d41d8cd98f00b204e9800998ecf8427e");
        assert_eq!(hex_of("blake3", b""), "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262");
        assert_eq!(hex_of("xxh3-64", b""), "2d06800538d394c2");
        assert_eq!(hex_of("xxh3-128", b""), "99aa06d3014798d86001c324468d497f");
    }

    #[test]
    fn arguments_are_refused() {
        assert!(run("sha256", b"{}", [&b"x"[..]]).is_ok());
        let e = run("sha256", br#"{"seed": 3}"#, [&b"x"[..]]).unwrap_err().to_string();
        assert!(e.contains("sha256") && e.contains("seed"), "{e}");
    }
}
