//! A file of a nearstore mount (`nearstore mount`, docs/fuse.md) as the host library maps
//! it. Linux answers FS_IOC_FIEMAP in the VFS and never passes it to a FUSE file system, so
//! the mount has an ioctl of its own, `NEARSTORE_IOC_EXTENTS`: the file's extents as the
//! source file system reports them, their places as global addresses of the namespace that
//! holds them, and that namespace. This module is both ends of it: the mount encodes the
//! reply, the host library asks it for a file whose device is a nearstore mount.
//!
//! ```c
//! struct nearstore_extent {          /* 32 bytes */
//!     uint64_t logical;              /* byte offset in the file */
//!     uint64_t address;              /* global address: device tag << 48 | byte offset in the namespace */
//!     uint64_t length;               /* bytes */
//!     uint32_t flags;                /* FIEMAP_EXTENT_* of the source file system */
//!     uint32_t reserved;
//! };
//! struct nearstore_extents {         /* NEARSTORE_IOC_EXTENTS = _IOWR('N', 3, struct nearstore_extents) */
//!     uint32_t version;              /* in: 1 */
//!     uint32_t start;                /* in: index of the first extent wanted */
//!     uint32_t count;                /* out: extents in this reply */
//!     uint32_t total;                /* out: extents of the file */
//!     uint64_t size;                 /* out: the file's size in bytes */
//!     uint32_t nsid;                 /* out: the namespace holding the extents */
//!     uint16_t tag;                  /* out: its device tag in the cluster map, 0 if none */
//!     uint16_t port;                 /* out: its target's TCP port */
//!     uint8_t  addr[16];             /* out: its target's IP address (IPv4 mapped in IPv6) */
//!     char     nqn[224];             /* out: its subsystem NQN, NUL-padded */
//!     uint8_t  reserved[16];
//!     struct nearstore_extent extents[119];
//! };                                 /* 4096 bytes, native byte order */
//! ```

use std::fs::File;
use std::io;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;

use nearstore_wire::compute::global;
use nearstore_wire::compute::limits::EXTENTS_PER_OBJECT_MAX;

use crate::device::Endpoint;
use crate::fiemap::FsExtent;

/// Bytes of `struct nearstore_extents`: one page (FUSE passes a fixed-size ioctl structure
/// of the size its number encodes).
pub const EXTENTS_BYTES: usize = 4096;
const HEADER_BYTES: usize = 288;
const EXTENT_BYTES: usize = 32;
/// Extents in one reply.
pub const EXTENTS_PER_REPLY: usize = (EXTENTS_BYTES - HEADER_BYTES) / EXTENT_BYTES;
/// Bytes of `nqn`: an NQN is at most 223 bytes, then a NUL.
const NQN_BYTES: usize = 224;
/// The structure's version.
pub const VERSION: u32 = 1;
/// `_IOWR('N', 3, struct nearstore_extents)`.
pub const IOC_EXTENTS: u32 = (3 << 30) | ((EXTENTS_BYTES as u32) << 16) | ((b'N' as u32) << 8) | 3;
/// The file system type of a nearstore mount in /proc/self/mountinfo.
pub const FSTYPE: &str = "fuse.nearstore";

const _: () = assert!(HEADER_BYTES + EXTENTS_PER_REPLY * EXTENT_BYTES == EXTENTS_BYTES);

/// One extent of a file of the mount.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MountExtent {
    pub logical: u64,
    /// A global address (`nearstore_wire::compute::global`).
    pub address: u64,
    pub length: u64,
    pub flags: u32,
}

/// A file of the mount: its size, the namespace holding it, its extents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountMap {
    pub size: u64,
    pub endpoint: Endpoint,
    /// The namespace's device tag, 0 when the cluster map gives it none.
    pub tag: u16,
    pub extents: Vec<MountExtent>,
}

impl MountMap {
    /// The extents as the source's FIEMAP gave them, physical offsets in the namespace:
    /// Err names an extent on another device than the namespace.
    pub fn fs_extents(&self) -> Result<Vec<FsExtent>, String> {
        self.extents
            .iter()
            .map(|e| match global::tag(e.address) {
                t if t == self.tag => {
                    Ok(FsExtent { logical: e.logical, physical: global::offset(e.address), length: e.length, flags: e.flags })
                }
                t => Err(format!("the extent at byte {} is on device tag {t}, not the namespace's {}", e.logical, self.tag)),
            })
            .collect()
    }
}

/// The source's extents as the mount answers them: at `offset` in the namespace (a
/// partition's or loop device's start), as global addresses of device `tag`.
pub fn translate(fs: &[FsExtent], offset: u64, tag: u16) -> Result<Vec<MountExtent>, String> {
    fs.iter()
        .map(|e| match e.physical.checked_add(offset) {
            Some(at) if at <= global::OFFSET_MASK => {
                Ok(MountExtent { logical: e.logical, address: global::address(tag, at), length: e.length, flags: e.flags })
            }
            _ => Err(format!("the extent at byte {} lies past the {} bytes a global address reaches", e.logical, global::OFFSET_MASK + 1)),
        })
        .collect()
}

fn word(d: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([d[at], d[at + 1], d[at + 2], d[at + 3]])
}

fn dword(d: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[at..at + 8]);
    u64::from_ne_bytes(b)
}

/// The request of extents from index `start`.
pub fn encode_request(start: u32) -> Vec<u8> {
    let mut v = vec![0u8; EXTENTS_BYTES];
    v[0..4].copy_from_slice(&VERSION.to_ne_bytes());
    v[4..8].copy_from_slice(&start.to_ne_bytes());
    v
}

/// The index of the first extent a request wants, or why it is malformed.
pub fn decode_request(d: &[u8]) -> Result<u32, String> {
    if d.len() != EXTENTS_BYTES {
        return Err(format!("struct nearstore_extents of {} bytes, not {EXTENTS_BYTES}", d.len()));
    }
    match word(d, 0) {
        VERSION => Ok(word(d, 4)),
        v => Err(format!("struct nearstore_extents version {v}, this mount reads {VERSION}")),
    }
}

/// The reply to a request from `start` over `map` (whose extents are all of the file's).
pub fn encode_reply(map: &MountMap, start: u32) -> Result<Vec<u8>, String> {
    let nqn = map.endpoint.nqn.as_bytes();
    if nqn.len() >= NQN_BYTES {
        return Err(format!("NQN of {} bytes, more than {}", nqn.len(), NQN_BYTES - 1));
    }
    let total = map.extents.len();
    let first = (start as usize).min(total);
    let page = &map.extents[first..(first + EXTENTS_PER_REPLY).min(total)];
    let mut v = vec![0u8; EXTENTS_BYTES];
    v[0..4].copy_from_slice(&VERSION.to_ne_bytes());
    v[4..8].copy_from_slice(&(first as u32).to_ne_bytes());
    v[8..12].copy_from_slice(&(page.len() as u32).to_ne_bytes());
    v[12..16].copy_from_slice(&(total as u32).to_ne_bytes());
    v[16..24].copy_from_slice(&map.size.to_ne_bytes());
    v[24..28].copy_from_slice(&map.endpoint.nsid.to_ne_bytes());
    v[28..30].copy_from_slice(&map.tag.to_ne_bytes());
    v[30..32].copy_from_slice(&map.endpoint.address.port().to_ne_bytes());
    let ip = match map.endpoint.address.ip() {
        IpAddr::V4(a) => a.to_ipv6_mapped(),
        IpAddr::V6(a) => a,
    };
    v[32..48].copy_from_slice(&ip.octets());
    v[48..48 + nqn.len()].copy_from_slice(nqn);
    for (i, e) in page.iter().enumerate() {
        let at = HEADER_BYTES + i * EXTENT_BYTES;
        v[at..at + 8].copy_from_slice(&e.logical.to_ne_bytes());
        v[at + 8..at + 16].copy_from_slice(&e.address.to_ne_bytes());
        v[at + 16..at + 24].copy_from_slice(&e.length.to_ne_bytes());
        v[at + 24..at + 28].copy_from_slice(&e.flags.to_ne_bytes());
    }
    Ok(v)
}

/// One reply: the map with this reply's extents, and the file's total of extents.
pub fn decode_reply(d: &[u8]) -> Result<(MountMap, u32), String> {
    if d.len() != EXTENTS_BYTES || word(d, 0) != VERSION {
        return Err("malformed struct nearstore_extents reply".into());
    }
    let (count, total) = (word(d, 8) as usize, word(d, 12));
    if count > EXTENTS_PER_REPLY || count > total as usize {
        return Err(format!("struct nearstore_extents reply of {count} extents"));
    }
    let mut ip = [0u8; 16];
    ip.copy_from_slice(&d[32..48]);
    let ip = Ipv6Addr::from(ip);
    let ip = ip.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(ip));
    let port = u16::from_ne_bytes([d[30], d[31]]);
    let nqn = &d[48..48 + NQN_BYTES];
    let nqn = std::str::from_utf8(&nqn[..nqn.iter().position(|&b| b == 0).unwrap_or(NQN_BYTES)])
        .map_err(|_| "struct nearstore_extents: the NQN is not UTF-8".to_string())?;
    let extents = (0..count)
        .map(|i| {
            let at = HEADER_BYTES + i * EXTENT_BYTES;
            MountExtent { logical: dword(d, at), address: dword(d, at + 8), length: dword(d, at + 16), flags: word(d, at + 24) }
        })
        .collect();
    let endpoint = Endpoint { address: SocketAddr::new(ip, port), nqn: nqn.into(), nsid: word(d, 24) };
    Ok((MountMap { size: dword(d, 16), endpoint, tag: u16::from_ne_bytes([d[28], d[29]]), extents }, total))
}

/// True when the file system of device `st_dev` is a nearstore mount (its type in
/// /proc/self/mountinfo) mounted by root or by this process's user: only such a file is
/// asked the mount's ioctl, whose number another FUSE file system may use for something
/// else, and whose answers (the places of a file's blocks) are trusted.
pub fn is_mount(st_dev: u64) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else { return false };
    // SAFETY: reads the process's effective uid.
    trusted_mount(&info, &format!("{}:{}", libc::major(st_dev), libc::minor(st_dev)), unsafe { libc::geteuid() })
}

/// Whether mountinfo's line of device `dev` ("MAJOR:MINOR") is a nearstore mount whose
/// FUSE daemon is root's or `uid`'s (the super block's `user_id=` option): any user may
/// mount a FUSE file system typed `fuse.nearstore`.
fn trusted_mount(mountinfo: &str, dev: &str, uid: u32) -> bool {
    mountinfo.lines().any(|l| {
        let Some((mine, theirs)) = l.split_once(" - ") else { return false };
        let mut t = theirs.split(' ');
        let (fstype, options) = (t.next(), t.nth(1).unwrap_or(""));
        let owner = options.split(',').find_map(|o| o.strip_prefix("user_id=")).and_then(|n| n.parse::<u32>().ok());
        mine.split(' ').nth(2) == Some(dev) && fstype == Some(FSTYPE) && matches!(owner, Some(o) if o == 0 || o == uid)
    })
}

/// The extents of an open file of a nearstore mount, through `NEARSTORE_IOC_EXTENTS`
/// (the mount writes the file's dirty pages back before it maps, as FIEMAP's sync flag).
pub fn extents(file: &File) -> io::Result<MountMap> {
    page_through(|start| {
        let mut buf = encode_request(start);
        // SAFETY: an open descriptor and a buffer of the size the command encodes, which
        // the kernel copies in and out.
        if unsafe { libc::ioctl(file.as_raw_fd(), IOC_EXTENTS as _, buf.as_mut_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(buf)
    })
}

/// A file's extents from the mount's replies (`ask`: the reply from a start index), page
/// after page, into one map. A `total` above what one descriptor carries
/// (EXTENTS_PER_OBJECT_MAX), an empty page before `total`, more extents than `total`, or
/// pages of a file that changed between them: an error, never a partial map.
fn page_through(mut ask: impl FnMut(u32) -> io::Result<Vec<u8>>) -> io::Result<MountMap> {
    let mut map: Option<(MountMap, u32)> = None;
    loop {
        let start = map.as_ref().map_or(0, |(m, _)| m.extents.len());
        let (page, total) = decode_reply(&ask(start as u32)?).map_err(io::Error::other)?;
        if total as usize > EXTENTS_PER_OBJECT_MAX {
            return Err(io::Error::other(format!(
                "the mount says {total} extents, more than the {EXTENTS_PER_OBJECT_MAX} of a descriptor"
            )));
        }
        match map.as_mut() {
            None => map = Some((page, total)),
            Some((m, t)) if (m.size, &m.endpoint, m.tag, *t) == (page.size, &page.endpoint, page.tag, total) => {
                if page.extents.is_empty() {
                    return Err(io::Error::other(format!("the mount's reply from extent {start} is empty, before its total of {total}")));
                }
                m.extents.extend(page.extents)
            }
            Some(_) => return Err(io::Error::other("the file changed while its extents were read")),
        }
        let (m, total) = map.as_ref().expect("set above");
        match m.extents.len().cmp(&(*total as usize)) {
            std::cmp::Ordering::Less if m.extents.is_empty() => {
                return Err(io::Error::other(format!("the mount's first reply is empty, before its total of {total}")));
            }
            std::cmp::Ordering::Less => {}
            std::cmp::Ordering::Equal => return Ok(map.expect("set above").0),
            std::cmp::Ordering::Greater => {
                return Err(io::Error::other(format!("the mount sent {} extents, more than its total of {total}", m.extents.len())))
            }
        }
    }
}

/// The extents of `file` as FIEMAP gives them, or, on a nearstore mount (where the kernel
/// refuses FIEMAP), as the mount gives them: what a snapshot of a file compares.
pub fn fs_extents(file: &File) -> io::Result<Vec<FsExtent>> {
    match crate::fiemap::extents(file) {
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) && is_mount(file.metadata()?.dev()) => {
            extents(file)?.fs_extents().map_err(io::Error::other)
        }
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn number_is_the_c_macro() {
        // _IOWR('N', 3, 4096 bytes) as <asm-generic/ioctl.h> computes it.
        assert_eq!(IOC_EXTENTS, 0xD000_4E03);
    }

    #[test]
    fn replies_page_through_the_extents_and_round_trip() {
        let ep = |a: &str| Endpoint { address: a.parse().unwrap(), nqn: "nqn.2026-11.io.nearstore:x".into(), nsid: 3 };
        let extents: Vec<MountExtent> = (0..300u64)
            .map(|i| MountExtent { logical: i * 8192, address: global::address(7, i * 4096), length: 4096, flags: (i == 299) as u32 })
            .collect();
        for address in ["127.0.0.1:4420", "[::1]:9"] {
            let map = MountMap { size: 300 * 8192, endpoint: ep(address), tag: 7, extents: extents.clone() };
            // (start, extents of the reply)
            for (start, count) in [(0u32, EXTENTS_PER_REPLY), (238, 62), (300, 0), (5000, 0)] {
                let (page, total) = decode_reply(&encode_reply(&map, start).unwrap()).unwrap();
                assert_eq!((page.size, &page.endpoint, page.tag, total), (map.size, &map.endpoint, 7, 300), "{address} {start}");
                assert_eq!(page.extents.len(), count, "{start}");
                let first = (start as usize).min(300);
                assert_eq!(page.extents[..], extents[first..first + count]);
            }
            assert_eq!(map.fs_extents().unwrap()[1], FsExtent { logical: 8192, physical: 4096, length: 4096, flags: 0 });
        }
        let fs = [FsExtent { logical: 0, physical: 4096, length: 8192, flags: 1 }];
        let t = translate(&fs, 1 << 20, 5).unwrap();
        assert_eq!(t, vec![MountExtent { logical: 0, address: global::address(5, (1 << 20) + 4096), length: 8192, flags: 1 }]);
        assert!(translate(&fs, global::OFFSET_MASK, 5).unwrap_err().contains("past the"));
        let mut other = MountMap { size: 1, endpoint: ep("127.0.0.1:1"), tag: 0, extents: extents[..1].to_vec() };
        assert!(other.fs_extents().unwrap_err().contains("device tag 7"));
        other.endpoint.nqn = "n".repeat(224);
        assert!(encode_reply(&other, 0).unwrap_err().contains("NQN"));
    }

    /// Replies a mount (or another file system answering the ioctl's number) might give, paged
    /// into a map or refused: the bound on `total` is the descriptor's, an empty page or one
    /// past `total` ends nothing silently.
    #[test]
    fn extents_are_paged_whole_within_the_descriptors_bound_or_refused() {
        let ep = Endpoint { address: "127.0.0.1:4420".parse().unwrap(), nqn: "nqn.2026-11.io.nearstore:x".into(), nsid: 3 };
        let map = |n: usize, size: u64| MountMap {
            size,
            endpoint: ep.clone(),
            tag: 7,
            extents: (0..n as u64)
                .map(|i| MountExtent { logical: i * 4096, address: global::address(7, i * 4096), length: 4096, flags: 0 })
                .collect(),
        };
        let set = |mut v: Vec<u8>, at: usize, x: u32| {
            v[at..at + 4].copy_from_slice(&x.to_ne_bytes());
            v
        };
        let honest = |m: MountMap| move |start: u32| encode_reply(&m, start).map_err(io::Error::other);
        type Ask<'a> = Box<dyn FnMut(u32) -> io::Result<Vec<u8>> + 'a>;
        // (what the mount answers, extents of the map or the words of the error)
        let cases: Vec<(&str, Ask<'_>, Result<usize, &str>)> = vec![
            ("none", Box::new(honest(map(0, 0))), Ok(0)),
            ("one page", Box::new(honest(map(119, 1 << 20))), Ok(119)),
            ("many pages", Box::new(honest(map(300, 1 << 21))), Ok(300)),
            ("at the bound", Box::new(honest(map(EXTENTS_PER_OBJECT_MAX, 1 << 30))), Ok(EXTENTS_PER_OBJECT_MAX)),
            ("past the bound", Box::new(honest(map(EXTENTS_PER_OBJECT_MAX + 1, 1 << 30))), Err("more than the 4096")),
            ("a total of u32::MAX", Box::new(|s| Ok(set(encode_reply(&map(3, 9), s).unwrap(), 12, u32::MAX))), Err("more than the 4096")),
            ("a first page empty", Box::new(|s| Ok(set(encode_reply(&map(3, 9), s).unwrap(), 8, 0))), Err("first reply is empty")),
            (
                "a later page empty",
                Box::new(|s| Ok(set(encode_reply(&map(300, 9), s).unwrap(), 8, if s > 0 { 0 } else { 119 }))),
                Err("from extent 119 is empty"),
            ),
            ("a count above its total", Box::new(|s| Ok(set(encode_reply(&map(100, 9), s).unwrap(), 12, 50))), Err("reply of 100 extents")),
            (
                "pages past its total",
                Box::new(|_| encode_reply(&map(150, 9), 0).map_err(io::Error::other)),
                Err("238 extents, more than its total of 150"),
            ),
            (
                "the file changed",
                Box::new(|s| encode_reply(&map(300, if s > 0 { 8 } else { 9 }), s).map_err(io::Error::other)),
                Err("changed"),
            ),
            ("the ioctl fails", Box::new(|_| Err(io::Error::from_raw_os_error(libc::ENOTTY))), Err("os error 25")),
        ];
        for (what, ask, want) in cases {
            match (page_through(ask), want) {
                (Ok(m), Ok(n)) => assert_eq!(m.extents.len(), n, "{what}"),
                (Err(e), Err(w)) => assert!(e.to_string().contains(w), "{what}: {e}"),
                (got, want) => panic!("{what}: got {:?}, want {want:?}", got.map(|m| m.extents.len())),
            }
        }
    }

    /// Only a nearstore mount of root or of this user is trusted: another user may mount a
    /// FUSE file system of that type that answers the ioctl with any places.
    #[test]
    fn only_a_nearstore_mount_of_root_or_the_user_is_trusted() {
        let line = |dev: &str, fstype: &str, options: &str| {
            format!("36 35 {dev} / /mnt/view rw,nosuid,nodev,relatime shared:1 - {fstype} /src {options}\n")
        };
        // (mountinfo, device, this user, trusted)
        let cases = [
            (line("0:50", "fuse.nearstore", "rw,user_id=0,group_id=0,allow_other"), "0:50", 1000, true),
            (line("0:50", "fuse.nearstore", "rw,user_id=1000,group_id=1000"), "0:50", 1000, true),
            (line("0:50", "fuse.nearstore", "rw,user_id=1001,group_id=1001,allow_other"), "0:50", 1000, false),
            (line("0:50", "fuse.nearstore", "rw,user_id=1001,group_id=1001,allow_other"), "0:50", 0, false),
            (line("0:50", "fuse.nearstore", "rw,group_id=0,allow_other"), "0:50", 0, false),
            (line("0:50", "fuse.nearstore", "rw,user_id=x"), "0:50", 0, false),
            (line("0:50", "fuse.other", "rw,user_id=0,group_id=0"), "0:50", 0, false),
            (line("0:51", "fuse.nearstore", "rw,user_id=0,group_id=0"), "0:50", 0, false),
            ("a line without a separator 0:50\n".to_string(), "0:50", 0, false),
        ];
        for (info, dev, uid, want) in cases {
            assert_eq!(trusted_mount(&info, dev, uid), want, "{info} as {uid}");
        }
    }

    #[test]
    fn malformed_requests_say_what_is_wrong() {
        let mut bad = encode_request(0);
        bad[0] = 2;
        // (request, start or the words of the error)
        let cases: [(&[u8], Result<u32, &str>); 3] =
            [(&encode_request(9), Ok(9)), (&[0u8; 8], Err("of 8 bytes")), (&bad, Err("version 2"))];
        for (d, want) in cases {
            match (decode_request(d), want) {
                (Ok(s), Ok(w)) => assert_eq!(s, w),
                (Err(e), Err(w)) => assert!(e.contains(w), "{e}"),
                (got, want) => panic!("got {got:?}, want {want:?}"),
            }
        }
        assert!(decode_reply(&[0u8; 16]).is_err());
    }
}
