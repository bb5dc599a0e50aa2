//! The mount's ioctls on an open file (docs/fuse.md gives them in C).
//!
//! FUSE forwards only "restricted" ioctls from a file system other than CUSE: the kernel
//! copies `_IOC_SIZE(cmd)` bytes in and out, so each structure has a fixed size.
//!
//! ```c
//! struct nearstore_op {          /* NEARSTORE_IOC_ATTACH = _IOW('N', 1, struct nearstore_op) */
//!     uint32_t version;          /* 1 */
//!     uint32_t length;           /* bytes of spec used */
//!     char     spec[4088];       /* "sha256", "grep:ERROR", "select:SELECT ...", not NUL-terminated */
//! };
//! /* NEARSTORE_IOC_DETACH = _IO('N', 2): reads return the file's bytes again */
//! ```

/// Bytes of `struct nearstore_op`: one page.
pub const OP_BYTES: usize = 4096;
/// Bytes of its `spec`.
pub const SPEC_BYTES: usize = OP_BYTES - 8;
/// The structure's version this mount reads.
pub const VERSION: u32 = 1;

const IOC_WRITE: u32 = 1;
const fn ioc(dir: u32, nr: u32, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | ((b'N' as u32) << 8) | nr
}

/// `_IOW('N', 1, struct nearstore_op)`: attaches an operation to the descriptor.
pub const ATTACH: u32 = ioc(IOC_WRITE, 1, OP_BYTES);
/// `_IO('N', 2)`: detaches it.
pub const DETACH: u32 = ioc(0, 2, 0);

/// The spec a `struct nearstore_op` carries, or why it is malformed.
pub fn decode_op(data: &[u8]) -> Result<String, String> {
    if data.len() != OP_BYTES {
        return Err(format!("struct nearstore_op of {} bytes, not {OP_BYTES}", data.len()));
    }
    let word = |at: usize| u32::from_ne_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]);
    let (version, length) = (word(0), word(4) as usize);
    if version != VERSION {
        return Err(format!("struct nearstore_op version {version}, this mount reads {VERSION}"));
    }
    if length > SPEC_BYTES {
        return Err(format!("struct nearstore_op length {length}, more than the {SPEC_BYTES} bytes of spec"));
    }
    String::from_utf8(data[8..8 + length].to_vec()).map_err(|_| "struct nearstore_op spec is not UTF-8".to_string())
}

/// Encodes a `struct nearstore_op` (for tests and Rust callers).
pub fn encode_op(spec: &str) -> Vec<u8> {
    let mut v = vec![0u8; OP_BYTES];
    v[0..4].copy_from_slice(&VERSION.to_ne_bytes());
    v[4..8].copy_from_slice(&(spec.len() as u32).to_ne_bytes());
    let n = spec.len().min(SPEC_BYTES);
    v[8..8 + n].copy_from_slice(&spec.as_bytes()[..n]);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_the_c_macros() {
        // _IOW('N', 1, 4096 bytes) and _IO('N', 2) as <asm-generic/ioctl.h> computes them.
        assert_eq!(ATTACH, 0x5000_4E01);
        assert_eq!(DETACH, 0x0000_4E02);
    }

    #[test]
    fn malformed_structures_say_what_is_wrong() {
        let mut bad_version = encode_op("sha256");
        bad_version[0] = 9;
        let mut too_long = encode_op("sha256");
        too_long[4..8].copy_from_slice(&5000u32.to_ne_bytes());
        let mut not_utf8 = encode_op("ab");
        not_utf8[8] = 0xff;
        let cases: [(&[u8], Result<&str, &str>); 5] = [
            (&encode_op("grep:ERROR"), Ok("grep:ERROR")),
            (&[0u8; 16], Err("of 16 bytes")),
            (&bad_version, Err("version 9")),
            (&too_long, Err("length 5000")),
            (&not_utf8, Err("not UTF-8")),
        ];
        for (data, want) in cases {
            match (decode_op(data), want) {
                (Ok(s), Ok(w)) => assert_eq!(s, w),
                (Err(e), Err(w)) => assert!(e.contains(w), "{e}"),
                (got, want) => panic!("got {got:?}, want {want:?}"),
            }
        }
    }
}
