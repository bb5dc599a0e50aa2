//! Little-endian field access on byte slices.
//!
//! Callers check lengths first (the PDU and command decoders do); these helpers
//! take fixed offsets into buffers whose size is already known to be sufficient.

#[inline]
pub fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

#[inline]
pub fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().expect("4 bytes"))
}

#[inline]
pub fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().expect("8 bytes"))
}

#[inline]
pub fn put_u16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}

#[inline]
pub fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

#[inline]
pub fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// Writes an ASCII string into a fixed field, padded with `pad` (spaces for
/// identify strings such as SN and MN, NUL for NQNs). Truncates if too long.
pub fn put_str(b: &mut [u8], off: usize, len: usize, s: &str, pad: u8) {
    let field = &mut b[off..off + len];
    field.fill(pad);
    let n = s.len().min(len);
    field[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// Reads a fixed string field: up to the first NUL, trailing spaces trimmed.
/// Non-UTF-8 bytes are replaced, never trusted.
pub fn str_at(b: &[u8], off: usize, len: usize) -> String {
    let field = &b[off..off + len];
    let end = field.iter().position(|&c| c == 0).unwrap_or(len);
    String::from_utf8_lossy(&field[..end]).trim_end().to_string()
}
