//! The compute commands: vendor-specific NVM I/O opcodes, their statuses, and the compute
//! descriptor that EXEC carries. docs/compute-protocol.md is the same thing in prose; a
//! change here is a change there, and a new layout gets a new version number.
//!
//! A descriptor names an operation, its arguments, one or more input virtual objects and
//! zero or more output virtual objects. A virtual object is the list of namespace byte
//! ranges (extents) holding a file's bytes in order, plus the file's exact length: the
//! extents cover whole blocks, the length cuts the last one.

use std::fmt;

use crate::bytes::{u16_at as get_u16, u32_at as get_u32, u64_at as get_u64};
use crate::Status;

/// Opcodes. The low two bits are the data direction (NVMe Base, "Opcodes for NVM
/// Commands"): 00 none, 01 host to controller, 10 controller to host. No command moves
/// data both ways, so the Linux passthrough ioctl carries each of them unchanged.
pub mod opcode {
    /// No data. CDW10: a handle. Releases a held result or message before it expires.
    pub const RELEASE: u8 = 0x80;
    /// Host to controller: the descriptor. Completion DW0: the handle of the result (or,
    /// on error, of the message), 0 for none; DW1: its length in bytes.
    pub const EXEC: u8 = 0x81;
    /// Controller to host: CDW10 a handle, CDW11 a byte offset into what it holds; the
    /// data length is the command's. Completion DW0: bytes valid in the data (the rest is
    /// zero-filled); DW1: bytes that remain after them. A fetch that reaches the end
    /// releases the handle.
    pub const FETCH: u8 = 0x82;
}

/// Command-specific statuses (SCT 1, the vendor-specific range C0h-FFh). Problems that
/// have a generic NVMe status use it: INVALID_NAMESPACE, LBA_OUT_OF_RANGE (an extent
/// outside the namespace), UNRECOVERED_READ_ERROR, WRITE_FAULT.
pub mod status {
    use crate::Status;
    /// The descriptor is malformed: magic, version, lengths, counts, reserved fields.
    pub const DESCRIPTOR_INVALID: Status = Status { sct: 1, sc: 0xc0, dnr: true };
    /// The operation id is not one this target runs.
    pub const UNKNOWN_OPERATION: Status = Status { sct: 1, sc: 0xc1, dnr: true };
    /// The operation refused its arguments (bad JSON, invalid regular expression, bad query).
    pub const BAD_ARGUMENTS: Status = Status { sct: 1, sc: 0xc2, dnr: true };
    /// A named limit was exceeded (see [`super::limits`] and the target's limits).
    pub const LIMIT_EXCEEDED: Status = Status { sct: 1, sc: 0xc3, dnr: true };
    /// The operation failed on the data (a line longer than its limit, corrupt input to
    /// decompress, a value a query cannot convert).
    pub const OPERATION_FAILED: Status = Status { sct: 1, sc: 0xc4, dnr: true };
    /// The command ran longer than the target's compute timeout.
    pub const TIMEOUT: Status = Status { sct: 1, sc: 0xc5, dnr: false };
    /// FETCH or RELEASE named a handle this controller does not hold (never issued,
    /// already fetched to the end, released, or expired).
    pub const HANDLE_INVALID: Status = Status { sct: 1, sc: 0xc6, dnr: true };
    /// An output object overlaps an input or another output.
    pub const OUTPUT_OVERLAP: Status = Status { sct: 1, sc: 0xc7, dnr: true };
    /// The output objects are too small for what the operation produced.
    pub const OUTPUT_TOO_SMALL: Status = Status { sct: 1, sc: 0xc8, dnr: true };
    /// The controller already holds its limit of unfetched results: fetch or release some.
    pub const RESULTS_FULL: Status = Status { sct: 1, sc: 0xc9, dnr: false };
    /// An extent names a device tag that is not in the target's cluster map.
    pub const DEVICE_UNKNOWN: Status = Status { sct: 1, sc: 0xca, dnr: true };
    /// Reading a peer's extents failed: the peer refused the connection, went away or
    /// failed the read. The message names the peer; the command may succeed again.
    pub const PEER_FAILED: Status = Status { sct: 1, sc: 0xcb, dnr: false };
    /// The peer does not let this target read it for the requesting host: the host is
    /// not on the peer subsystem's allow-list, the target is not one of the peer's
    /// trusted cluster members, or the peer did not confirm it checked the host. The
    /// message names the peer and the host. Retrying does not help until a
    /// configuration changes.
    pub const PEER_DENIED: Status = Status { sct: 1, sc: 0xcc, dnr: true };

    /// A name for a compute status, for messages.
    pub fn name(s: Status) -> Option<&'static str> {
        if s.sct != 1 {
            return None;
        }
        Some(match s.sc {
            0xc0 => "DESCRIPTOR_INVALID",
            0xc1 => "UNKNOWN_OPERATION",
            0xc2 => "BAD_ARGUMENTS",
            0xc3 => "LIMIT_EXCEEDED",
            0xc4 => "OPERATION_FAILED",
            0xc5 => "TIMEOUT",
            0xc6 => "HANDLE_INVALID",
            0xc7 => "OUTPUT_OVERLAP",
            0xc8 => "OUTPUT_TOO_SMALL",
            0xc9 => "RESULTS_FULL",
            0xca => "DEVICE_UNKNOWN",
            0xcb => "PEER_FAILED",
            0xcc => "PEER_DENIED",
            _ => return None,
        })
    }
}

/// Limits of the descriptor format. The target has its own (results held, memory, time).
pub mod limits {
    /// A whole descriptor: one EXEC transfer, at most the target's MDTS (128 KiB).
    pub const DESCRIPTOR_BYTES_MAX: usize = 128 * 1024;
    /// Operation arguments (JSON).
    pub const ARGS_BYTES_MAX: usize = 16 * 1024;
    /// Input plus output objects in one descriptor.
    pub const OBJECTS_MAX: usize = 64;
    /// Extents of one object. A file more fragmented than this is computed on the host.
    pub const EXTENTS_PER_OBJECT_MAX: usize = 4096;
}

pub const MAGIC: [u8; 4] = *b"NSCD";
pub const VERSION: u16 = 1;
pub const HEADER_BYTES: usize = 32;
pub const OBJECT_HEADER_BYTES: usize = 16;
pub const EXTENT_BYTES: usize = 16;
/// An extent whose offset is this reads as zeros (a hole, an unwritten extent): nothing
/// is read from the namespace for it.
pub const ZEROS: u64 = u64::MAX;

/// Global addresses: a data extent's offset is a device tag in its upper 16 bits and a
/// byte offset in that device's namespace in the lower 48 (256 TiB). Tag 0 is the
/// namespace the command is addressed to, so an untagged offset means what it always
/// meant; tags 1 to 0xFFFE name the devices of the target's cluster map; 0xFFFF is
/// reserved ([`ZEROS`] has it).
pub mod global {
    pub const TAG_SHIFT: u32 = 48;
    pub const OFFSET_MASK: u64 = (1 << TAG_SHIFT) - 1;
    /// The addressed namespace.
    pub const LOCAL: u16 = 0;
    pub const RESERVED: u16 = 0xffff;

    /// The global address of `offset` on the device tagged `tag`.
    pub fn address(tag: u16, offset: u64) -> u64 {
        debug_assert!(offset <= OFFSET_MASK);
        (tag as u64) << TAG_SHIFT | offset
    }
    pub fn tag(address: u64) -> u16 {
        (address >> TAG_SHIFT) as u16
    }
    pub fn offset(address: u64) -> u64 {
        address & OFFSET_MASK
    }
}

/// A byte range of the namespace (or, tagged, of another device's), or a run of zeros.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Byte offset in the namespace, or [`ZEROS`].
    pub offset: u64,
    pub len: u64,
}

impl Extent {
    pub fn data(offset: u64, len: u64) -> Extent {
        Extent { offset, len }
    }
    pub fn zeros(len: u64) -> Extent {
        Extent { offset: ZEROS, len }
    }
    pub fn is_zeros(&self) -> bool {
        self.offset == ZEROS
    }
    /// The device tag of a data extent ([`global::LOCAL`] for the addressed namespace).
    pub fn tag(&self) -> u16 {
        global::tag(self.offset)
    }
    /// True for a data extent on another device than the addressed one.
    pub fn is_remote(&self) -> bool {
        !self.is_zeros() && self.tag() != global::LOCAL
    }
}

/// A virtual object: extents in order, and the exact length in bytes. The extents cover
/// at least `len` bytes; bytes past `len` (the rest of the last block) are not part of it.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Object {
    pub len: u64,
    pub extents: Vec<Extent>,
}

impl Object {
    /// The pieces of the object in order, each cut to the object's length.
    pub fn pieces(&self) -> impl Iterator<Item = Extent> + '_ {
        let mut left = self.len;
        self.extents.iter().map_while(move |e| {
            if left == 0 {
                return None;
            }
            let n = e.len.min(left);
            left -= n;
            Some(Extent { offset: e.offset, len: n })
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Descriptor {
    /// The operation's id (the compute crate's registry).
    pub op: u16,
    pub args: Vec<u8>,
    pub inputs: Vec<Object>,
    pub outputs: Vec<Object>,
}

/// Why a descriptor was refused, naming the field. [`DescriptorError::status`] is the
/// NVMe status the target completes EXEC with; the message is what FETCH returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DescriptorError {
    pub status: Status,
    pub message: String,
}

impl fmt::Display for DescriptorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DescriptorError {}

fn invalid(message: String) -> DescriptorError {
    DescriptorError { status: status::DESCRIPTOR_INVALID, message }
}

fn limit(message: String) -> DescriptorError {
    DescriptorError { status: status::LIMIT_EXCEEDED, message }
}

fn pad8(n: usize) -> usize {
    (n + 7) & !7
}

/// Names an object for messages: "input 0", "output 1".
pub fn object_name(i: usize, inputs: usize) -> String {
    if i < inputs {
        format!("input {i}")
    } else {
        format!("output {}", i - inputs)
    }
}

impl Descriptor {
    /// The encoded size in bytes.
    pub fn encoded_len(&self) -> usize {
        HEADER_BYTES
            + pad8(self.args.len())
            + self.inputs.iter().chain(&self.outputs).map(|o| OBJECT_HEADER_BYTES + o.extents.len() * EXTENT_BYTES).sum::<usize>()
    }

    /// Encodes the descriptor. It does not check limits: [`Descriptor::decode`] of the
    /// result does, as the target will.
    pub fn encode(&self) -> Vec<u8> {
        let total = self.encoded_len();
        let mut b = Vec::with_capacity(total);
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&self.op.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&(self.args.len() as u32).to_le_bytes());
        b.extend_from_slice(&(self.inputs.len() as u16).to_le_bytes());
        b.extend_from_slice(&(self.outputs.len() as u16).to_le_bytes());
        b.extend_from_slice(&(total as u32).to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&self.args);
        b.resize(HEADER_BYTES + pad8(self.args.len()), 0);
        for o in self.inputs.iter().chain(&self.outputs) {
            b.extend_from_slice(&o.len.to_le_bytes());
            b.extend_from_slice(&(o.extents.len() as u32).to_le_bytes());
            b.extend_from_slice(&0u32.to_le_bytes());
            for e in &o.extents {
                b.extend_from_slice(&e.offset.to_le_bytes());
                b.extend_from_slice(&e.len.to_le_bytes());
            }
        }
        debug_assert_eq!(b.len(), total);
        b
    }

    /// Decodes and checks a descriptor: layout, limits, and that every object's extents
    /// add up to its length. Namespace bounds are the target's to check
    /// ([`Descriptor::check_extents`]).
    pub fn decode(b: &[u8]) -> Result<Descriptor, DescriptorError> {
        if b.len() > limits::DESCRIPTOR_BYTES_MAX {
            return Err(limit(format!("descriptor: {} bytes, more than the limit of {}", b.len(), limits::DESCRIPTOR_BYTES_MAX)));
        }
        if b.len() < HEADER_BYTES {
            return Err(invalid(format!("descriptor: {} bytes, shorter than its {HEADER_BYTES}-byte header", b.len())));
        }
        if b[..4] != MAGIC {
            return Err(invalid(format!("descriptor: magic {:02x?} is not \"NSCD\"", &b[..4])));
        }
        let version = get_u16(b, 4);
        if version != VERSION {
            return Err(invalid(format!("descriptor: version {version} is not supported (this target speaks version {VERSION})")));
        }
        let op = get_u16(b, 6);
        let flags = get_u32(b, 8);
        if flags != 0 {
            return Err(invalid(format!("descriptor: flags {flags:#x}: no flags are defined in version 1")));
        }
        let args_len = get_u32(b, 12) as usize;
        let n_in = get_u16(b, 16) as usize;
        let n_out = get_u16(b, 18) as usize;
        let total = get_u32(b, 20) as usize;
        if get_u64(b, 24) != 0 {
            return Err(invalid("descriptor: reserved bytes 24..32 are not zero".into()));
        }
        if total != b.len() {
            return Err(invalid(format!("descriptor: length field {total} but {} bytes were sent", b.len())));
        }
        if args_len > limits::ARGS_BYTES_MAX {
            return Err(limit(format!("descriptor: arguments of {args_len} bytes, more than the limit of {}", limits::ARGS_BYTES_MAX)));
        }
        if n_in == 0 {
            return Err(invalid("descriptor: no input object".into()));
        }
        if n_in + n_out > limits::OBJECTS_MAX {
            return Err(limit(format!(
                "descriptor: {n_in} inputs and {n_out} outputs, more than the limit of {} objects",
                limits::OBJECTS_MAX
            )));
        }
        let mut at = HEADER_BYTES + pad8(args_len);
        if at > b.len() {
            return Err(invalid(format!("descriptor: arguments of {args_len} bytes run past its end")));
        }
        if b[HEADER_BYTES + args_len..at].iter().any(|&x| x != 0) {
            return Err(invalid("descriptor: the padding after the arguments is not zero".into()));
        }
        let args = b[HEADER_BYTES..HEADER_BYTES + args_len].to_vec();
        let mut objects = Vec::with_capacity(n_in + n_out);
        for i in 0..n_in + n_out {
            let name = object_name(i, n_in);
            if at + OBJECT_HEADER_BYTES > b.len() {
                return Err(invalid(format!("descriptor: {name} starts past its end")));
            }
            let len = get_u64(b, at);
            let n = get_u32(b, at + 8) as usize;
            if get_u32(b, at + 12) != 0 {
                return Err(invalid(format!("descriptor: {name}: reserved bytes are not zero")));
            }
            if n > limits::EXTENTS_PER_OBJECT_MAX {
                return Err(limit(format!("descriptor: {name}: {n} extents, more than the limit of {}", limits::EXTENTS_PER_OBJECT_MAX)));
            }
            at += OBJECT_HEADER_BYTES;
            if at + n * EXTENT_BYTES > b.len() {
                return Err(invalid(format!("descriptor: {name}: {n} extents run past its end")));
            }
            let mut extents = Vec::with_capacity(n);
            let mut covered: u64 = 0;
            for k in 0..n {
                let e = Extent { offset: get_u64(b, at), len: get_u64(b, at + 8) };
                at += EXTENT_BYTES;
                if e.len == 0 {
                    return Err(invalid(format!("descriptor: {name} extent {k}: length 0")));
                }
                if !e.is_zeros() && e.offset.checked_add(e.len).is_none() {
                    return Err(invalid(format!("descriptor: {name} extent {k}: offset {} + length {} overflows", e.offset, e.len)));
                }
                if covered >= len {
                    return Err(invalid(format!("descriptor: {name} extent {k}: lies wholly past the object's length {len}")));
                }
                covered = covered
                    .checked_add(e.len)
                    .ok_or_else(|| invalid(format!("descriptor: {name} extent {k}: the extents' lengths overflow")))?;
                extents.push(e);
            }
            if covered < len {
                return Err(invalid(format!("descriptor: {name}: extents cover {covered} bytes, less than its length {len}")));
            }
            objects.push(Object { len, extents });
        }
        if at != b.len() {
            return Err(invalid(format!("descriptor: {} bytes after the last object", b.len() - at)));
        }
        let outputs = objects.split_off(n_in);
        Ok(Descriptor { op, args, inputs: objects, outputs })
    }

    /// Rewrites extents tagged with the addressed namespace's own tag (its place in the
    /// cluster map) as local ones.
    pub fn localize(&mut self, own: u16) {
        if own == global::LOCAL || own == global::RESERVED {
            return;
        }
        for e in self.inputs.iter_mut().chain(&mut self.outputs).flat_map(|o| &mut o.extents) {
            if !e.is_zeros() && e.tag() == own {
                e.offset = global::offset(e.offset);
            }
        }
    }

    /// The device tags the inputs name besides the addressed namespace, in order.
    pub fn remote_tags(&self) -> Vec<u16> {
        let mut t: Vec<u16> = self.inputs.iter().flat_map(|o| &o.extents).filter(|e| e.is_remote()).map(|e| e.tag()).collect();
        t.sort_unstable();
        t.dedup();
        t
    }

    /// Checks every extent against a namespace of `size` bytes and `block` bytes per
    /// logical block: inside it, block-aligned; and that no output overlaps an input or
    /// another output. Input extents on other devices (tagged) are left to the peer that
    /// holds them; outputs lie on the addressed namespace.
    pub fn check_extents(&self, size: u64, block: u64) -> Result<(), DescriptorError> {
        let n_in = self.inputs.len();
        for (i, o) in self.inputs.iter().chain(&self.outputs).enumerate() {
            for (k, e) in o.extents.iter().enumerate() {
                if i >= n_in && e.is_zeros() {
                    return Err(invalid(format!("descriptor: {} extent {k}: an output cannot be zeros", object_name(i, n_in))));
                }
                if !e.is_zeros() && e.tag() == global::RESERVED {
                    return Err(invalid(format!(
                        "descriptor: {} extent {k}: device tag {:#06x} is reserved",
                        object_name(i, n_in),
                        global::RESERVED
                    )));
                }
                if e.is_remote() {
                    if i >= n_in {
                        return Err(invalid(format!(
                            "descriptor: {} extent {k} names device tag {}: outputs lie on the addressed namespace",
                            object_name(i, n_in),
                            e.tag()
                        )));
                    }
                    continue;
                }
                if e.is_zeros() {
                    if e.len % block != 0 {
                        return Err(invalid(format!(
                            "descriptor: {} extent {k}: length {} must be a multiple of the {block}-byte block",
                            object_name(i, n_in),
                            e.len
                        )));
                    }
                    continue;
                }
                if e.offset % block != 0 || e.len % block != 0 {
                    return Err(invalid(format!(
                        "descriptor: {} extent {k}: offset {} and length {} must be multiples of the {block}-byte block",
                        object_name(i, n_in),
                        e.offset,
                        e.len
                    )));
                }
                if e.offset + e.len > size {
                    return Err(DescriptorError {
                        status: Status::LBA_OUT_OF_RANGE.dnr(),
                        message: format!(
                            "descriptor: {} extent {k}: bytes {}..{} lie outside the namespace of {size} bytes",
                            object_name(i, n_in),
                            e.offset,
                            e.offset + e.len
                        ),
                    });
                }
            }
        }
        // Outputs against everything: sort the ranges, then neighbours must not overlap
        // unless both are inputs.
        let mut ranges: Vec<(u64, u64, usize)> = Vec::new();
        for (i, o) in self.inputs.iter().chain(&self.outputs).enumerate() {
            ranges.extend(o.extents.iter().filter(|e| !e.is_zeros() && !e.is_remote()).map(|e| (e.offset, e.offset + e.len, i)));
        }
        ranges.sort_unstable();
        // The furthest-reaching range so far of each kind: any input, any output.
        let mut reach_in: Option<(u64, usize)> = None;
        let mut reach_out: Option<(u64, usize)> = None;
        for &(start, end, i) in &ranges {
            let is_out = i >= n_in;
            let clash = if is_out { [reach_in, reach_out] } else { [reach_out, None] };
            for (r, j) in clash.into_iter().flatten() {
                if r > start && (j != i || is_out) {
                    return Err(DescriptorError {
                        status: status::OUTPUT_OVERLAP,
                        message: format!("descriptor: {} overlaps {} at byte {start}", object_name(i, n_in), object_name(j, n_in)),
                    });
                }
            }
            let slot = if is_out { &mut reach_out } else { &mut reach_in };
            if slot.is_none_or(|(r, _)| end > r) {
                *slot = Some((end, i));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Descriptor {
        Descriptor {
            op: 6,
            args: br#"{"pattern":"x"}"#.to_vec(),
            inputs: vec![Object { len: 5000, extents: vec![Extent::data(4096, 4096), Extent::zeros(512), Extent::data(0, 512)] }],
            outputs: vec![Object { len: 1024, extents: vec![Extent::data(65536, 1024)] }],
        }
    }

    #[test]
    fn round_trip() {
        let d = sample();
        let b = d.encode();
        assert_eq!(b.len(), d.encoded_len());
        assert_eq!(b.len() % 8, 0);
        assert_eq!(Descriptor::decode(&b).unwrap(), d);
        d.check_extents(1 << 20, 512).unwrap();
    }

    #[test]
    fn pieces_cut_to_length() {
        let d = sample();
        let p: Vec<_> = d.inputs[0].pieces().collect();
        assert_eq!(p, vec![Extent::data(4096, 4096), Extent::zeros(512), Extent::data(0, 392)]);
        assert_eq!(Object::default().pieces().count(), 0);
    }

    fn err(b: &[u8]) -> DescriptorError {
        Descriptor::decode(b).unwrap_err()
    }

    #[test]
    fn header_errors_name_the_field() {
        let good = sample().encode();
        assert!(err(&good[..20]).message.contains("shorter than its 32-byte header"));
        let mut b = good.clone();
        b[0] = b'X';
        assert!(err(&b).message.contains("magic"));
        let mut b = good.clone();
        b[4] = 2;
        let e = err(&b);
        assert!(e.message.contains("version 2 is not supported"), "{e}");
        assert_eq!(e.status, status::DESCRIPTOR_INVALID);
        let mut b = good.clone();
        b[8] = 1;
        assert!(err(&b).message.contains("flags"));
        let mut b = good.clone();
        b[30] = 1;
        assert!(err(&b).message.contains("reserved bytes 24..32"));
        let mut b = good.clone();
        b.push(0);
        assert!(err(&b).message.contains("length field"));
        let mut b = good.clone();
        b[16] = 0;
        assert!(err(&b).message.contains("no input object"));
    }

    #[test]
    fn object_errors_name_the_object_and_extent() {
        let mut d = sample();
        d.inputs[0].extents[1].len = 0;
        assert!(err(&d.encode()).message.contains("input 0 extent 1: length 0"));
        let mut d = sample();
        d.inputs[0].len = 9000;
        assert!(err(&d.encode()).message.contains("input 0: extents cover 5120 bytes, less than its length 9000"));
        let mut d = sample();
        d.inputs[0].len = 4096;
        assert!(err(&d.encode()).message.contains("input 0 extent 1: lies wholly past"));
        let mut d = sample();
        d.inputs[0].extents[0] = Extent::data(u64::MAX - 10, 4096);
        assert!(err(&d.encode()).message.contains("overflows"));
        let mut d = sample();
        d.inputs[0].extents = vec![Extent::zeros(u64::MAX - 1), Extent::zeros(5)];
        d.inputs[0].len = u64::MAX - 1;
        assert!(err(&d.encode()).message.contains("lengths overflow") || err(&d.encode()).message.contains("wholly past"));
        let mut d = sample();
        d.outputs[0].len = 0;
        assert!(err(&d.encode()).message.contains("output 0 extent 0: lies wholly past"));
        // An empty object (an empty file) is valid.
        let mut d = sample();
        d.inputs[0] = Object::default();
        assert_eq!(Descriptor::decode(&d.encode()).unwrap(), d);
    }

    #[test]
    fn each_limit_is_enforced() {
        let mut d = sample();
        d.args = vec![b' '; limits::ARGS_BYTES_MAX + 1];
        let e = err(&d.encode());
        assert_eq!(e.status, status::LIMIT_EXCEEDED);
        assert!(e.message.contains("arguments of 16385 bytes"), "{e}");
        d.args = vec![b' '; limits::ARGS_BYTES_MAX];
        Descriptor::decode(&d.encode()).unwrap();

        let mut d = sample();
        d.inputs = vec![Object { len: 1, extents: vec![Extent::data(0, 512)] }; limits::OBJECTS_MAX];
        let e = err(&d.encode());
        assert_eq!(e.status, status::LIMIT_EXCEEDED);
        assert!(e.message.contains("more than the limit of 64 objects"), "{e}");
        d.outputs.clear();
        Descriptor::decode(&d.encode()).unwrap();

        let n = limits::EXTENTS_PER_OBJECT_MAX;
        let mut d = sample();
        d.inputs[0] = Object { len: (n as u64 + 1) * 512, extents: (0..=n as u64).map(|k| Extent::data(k * 512, 512)).collect() };
        let e = err(&d.encode());
        assert_eq!(e.status, status::LIMIT_EXCEEDED);
        assert!(e.message.contains("input 0: 4097 extents"), "{e}");
        d.inputs[0].extents.pop();
        d.inputs[0].len -= 512;
        Descriptor::decode(&d.encode()).unwrap();

        let big = vec![0u8; limits::DESCRIPTOR_BYTES_MAX + 8];
        let e = err(&big);
        assert_eq!(e.status, status::LIMIT_EXCEEDED);
        assert!(e.message.contains("more than the limit of 131072"));
    }

    #[test]
    fn extents_checked_against_the_namespace() {
        let d = sample();
        let e = d.check_extents(66048, 512).unwrap_err();
        assert_eq!(e.status, Status::LBA_OUT_OF_RANGE.dnr());
        assert!(e.message.contains("output 0 extent 0: bytes 65536..66560 lie outside"), "{e}");
        let mut d = sample();
        d.inputs[0].extents[0].offset = 4000;
        assert!(d.check_extents(1 << 20, 512).unwrap_err().message.contains("multiples of the 512-byte block"));
        let mut d = sample();
        d.outputs[0].extents[0] = Extent::zeros(1024);
        assert!(d.check_extents(1 << 20, 512).unwrap_err().message.contains("an output cannot be zeros"));
        let mut d = sample();
        d.inputs[0].extents[1] = Extent::zeros(500);
        d.inputs[0].len -= 12;
        assert!(d.check_extents(1 << 20, 512).unwrap_err().message.contains("input 0 extent 1: length 500 must be a multiple"));
    }

    #[test]
    fn outputs_must_not_overlap() {
        let mut d = sample();
        d.outputs[0].extents[0].offset = 4096 + 1024;
        let e = d.check_extents(1 << 20, 512).unwrap_err();
        assert_eq!(e.status, status::OUTPUT_OVERLAP);
        assert!(e.message.contains("output 0 overlaps input 0"), "{e}");
        // Output before the input it overlaps.
        let mut d = sample();
        d.outputs[0].extents[0] = Extent::data(3584, 1024);
        assert!(d.check_extents(1 << 20, 512).unwrap_err().message.contains("overlaps"));
        // Two outputs.
        let mut d = sample();
        d.outputs.push(Object { len: 512, extents: vec![Extent::data(65536 + 512, 512)] });
        assert!(d.check_extents(1 << 20, 512).unwrap_err().message.contains("output 1 overlaps output 0"));
        // Inputs may overlap each other (the same file twice); adjacent ranges are fine.
        let mut d = sample();
        d.inputs.push(d.inputs[0].clone());
        d.outputs[0].extents[0] = Extent::data(8192, 1024);
        d.check_extents(1 << 20, 512).unwrap();
    }

    #[test]
    fn tagged_extents() {
        let a = global::address(3, 8192);
        assert_eq!((global::tag(a), global::offset(a)), (3, 8192));
        assert_eq!(Extent::zeros(512).tag(), global::RESERVED);
        assert!(!Extent::zeros(512).is_remote());
        let mut d = sample();
        // A peer's extent far past this namespace's end is left to the peer; it may
        // overlap the output's local bytes: it is another device.
        d.inputs.push(Object { len: 4096, extents: vec![Extent::data(global::address(7, 65536), 4096)] });
        d.check_extents(1 << 20, 512).unwrap();
        assert_eq!(d.remote_tags(), vec![7]);
        // Tagged with the namespace's own tag, it is local again, and overlaps.
        d.localize(7);
        assert_eq!(d.inputs[1].extents[0], Extent::data(65536, 4096));
        assert!(d.remote_tags().is_empty());
        assert_eq!(d.check_extents(1 << 20, 512).unwrap_err().status, status::OUTPUT_OVERLAP);
        let mut d = sample();
        d.outputs[0].extents[0] = Extent::data(global::address(2, 65536), 1024);
        let e = d.check_extents(1 << 20, 512).unwrap_err();
        assert!(e.message.contains("output 0 extent 0 names device tag 2: outputs lie on the addressed namespace"), "{e}");
        let mut d = sample();
        d.inputs[0].extents[0] = Extent::data(global::address(global::RESERVED, 0), 4096);
        let e = d.check_extents(1 << 20, 512).unwrap_err();
        assert!(e.message.contains("device tag 0xffff is reserved"), "{e}");
    }
}
