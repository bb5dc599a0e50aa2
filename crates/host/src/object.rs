//! A file as a virtual object: its bytes as namespace extents, holes and unwritten
//! extents as zeros, and a snapshot to detect a change during the call.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nearstore_wire::compute::{limits, Extent, Object};

use crate::device::{DeviceMap, Location};
use crate::fiemap::{flags, FsExtent, UNUSABLE};

/// Zero runs past the last extent are rounded up to this many bytes, a multiple of every
/// block size a namespace can have; the object's exact length cuts them.
const TAIL_ALIGN: u64 = 4096;

/// What the call relies on staying the same: checked again after the target answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime: (i64, i64),
    pub ctime: (i64, i64),
    pub extents: Vec<FsExtent>,
}

impl Snapshot {
    fn take(file: &File) -> std::io::Result<Snapshot> {
        let m = file.metadata()?;
        // FIEMAP with its sync flag writes dirty pages back (delayed allocation gets its
        // blocks) before it maps; fsync first makes the metadata durable too.
        file.sync_all()?;
        let extents = crate::mount::fs_extents(file)?;
        Ok(Snapshot {
            dev: m.dev(),
            ino: m.ino(),
            size: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
            extents,
        })
    }
}

/// A file mapped for offload.
#[derive(Clone, Debug)]
pub struct FileObject {
    pub path: PathBuf,
    pub object: Object,
    pub location: Location,
    pub snapshot: Snapshot,
}

/// A file either offloads or is computed on the host, with the reason.
#[derive(Clone, Debug)]
// One per file of a call, short-lived: the size difference costs nothing worth a Box.
#[allow(clippy::large_enum_variant)]
pub enum Mapped {
    Offload(FileObject),
    Local { path: PathBuf, reason: String },
}

#[derive(Debug, thiserror::Error)]
pub enum MapError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: not a regular file")]
    NotRegular { path: PathBuf },
    #[error("{path}: changed during the call ({what}); nothing was reported for it")]
    Changed { path: PathBuf, what: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> MapError + '_ {
    move |source| MapError::Io { path: path.into(), source }
}

/// Maps a file: where its device lies (or why it cannot offload), then its extents.
pub fn map_file(path: &Path, devices: &DeviceMap) -> Result<Mapped, MapError> {
    map_with(path, devices, false)
}

/// Maps a scratch file: allocated with fallocate and written only by targets, never read
/// through the file system (a sort's runs and copies). Its unwritten extents are blocks
/// like any other to the target; the file system still reads them as zeros, which no one
/// does before the file is removed.
pub fn map_scratch(path: &Path, devices: &DeviceMap) -> Result<Mapped, MapError> {
    map_with(path, devices, true)
}

fn map_with(path: &Path, devices: &DeviceMap, unwritten_is_data: bool) -> Result<Mapped, MapError> {
    let file = File::open(path).map_err(io(path))?;
    let m = file.metadata().map_err(io(path))?;
    if !m.is_file() {
        return Err(MapError::NotRegular { path: path.into() });
    }
    let local = |reason: String| Ok(Mapped::Local { path: path.into(), reason });
    let location = match devices.locate(m.dev()) {
        Ok(l) => l,
        // A file of a nearstore mount: the mount names its namespace (docs/fuse.md).
        Err(_) if crate::mount::is_mount(m.dev()) => match crate::mount::extents(&file) {
            Ok(map) => Location { endpoint: map.endpoint, offset: 0, device: crate::mount::FSTYPE.into(), kernel_device: None },
            Err(e) => return local(format!("the nearstore mount does not map it: {e}")),
        },
        Err(reason) => return local(reason),
    };
    let snapshot = match Snapshot::take(&file) {
        Ok(s) => s,
        // FIEMAP unsupported by this file system.
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) || e.raw_os_error() == Some(libc::ENOTTY) => {
            return local(format!("the file system does not map extents (FIEMAP: {e})"));
        }
        Err(e) => return Err(MapError::Io { path: path.into(), source: e }),
    };
    match build_object_as(&snapshot, location.offset, unwritten_is_data) {
        Ok(object) => Ok(Mapped::Offload(FileObject { path: path.into(), object, location, snapshot })),
        Err(reason) => local(reason),
    }
}

/// Turns file-system extents into a virtual object: gaps and unwritten extents are zeros,
/// physically contiguous extents merge, `offset` (partition and loop offsets) is added.
/// Err: why the file must be computed on the host.
pub fn build_object(s: &Snapshot, offset: u64) -> Result<Object, String> {
    build_object_as(s, offset, false)
}

/// [`build_object`], with unwritten extents as data when `unwritten_is_data` (scratch).
fn build_object_as(s: &Snapshot, offset: u64, unwritten_is_data: bool) -> Result<Object, String> {
    let mut out: Vec<Extent> = Vec::new();
    let mut pos = 0u64;
    let push = |out: &mut Vec<Extent>, e: Extent| {
        if let Some(last) = out.last_mut() {
            let contiguous = if e.is_zeros() { last.is_zeros() } else { !last.is_zeros() && last.offset + last.len == e.offset };
            if contiguous {
                last.len += e.len;
                return;
            }
        }
        out.push(e);
    };
    for e in &s.extents {
        if e.logical >= s.size {
            break; // preallocated past the end of the file
        }
        if e.flags & UNUSABLE != 0 {
            return Err(format!("the extent at byte {} is {}", e.logical, describe(e.flags)));
        }
        if e.logical < pos {
            return Err(format!("extents overlap at byte {}", e.logical));
        }
        if e.logical > pos {
            push(&mut out, Extent::zeros(e.logical - pos));
        }
        if e.flags & flags::UNWRITTEN != 0 && !unwritten_is_data {
            push(&mut out, Extent::zeros(e.length));
        } else {
            let phys = e.physical.checked_add(offset).ok_or_else(|| format!("extent at byte {} overflows", e.logical))?;
            push(&mut out, Extent::data(phys, e.length));
        }
        pos = e.logical + e.length;
    }
    if pos < s.size {
        push(&mut out, Extent::zeros((s.size - pos).div_ceil(TAIL_ALIGN) * TAIL_ALIGN));
    }
    if out.len() > limits::EXTENTS_PER_OBJECT_MAX {
        return Err(format!("{} extents, more than the {} a descriptor carries", out.len(), limits::EXTENTS_PER_OBJECT_MAX));
    }
    Ok(Object { len: s.size, extents: out })
}

fn describe(f: u32) -> String {
    let names = [
        (flags::UNKNOWN, "of unknown location"),
        (flags::DELALLOC, "not allocated yet (delayed allocation)"),
        (flags::ENCODED, "encoded (compressed)"),
        (flags::DATA_ENCRYPTED, "encrypted"),
        (flags::NOT_ALIGNED, "not block aligned"),
        (flags::DATA_INLINE, "inline in the metadata"),
        (flags::DATA_TAIL, "packed with other tails"),
    ];
    names.iter().filter(|(b, _)| f & b != 0).map(|(_, n)| *n).collect::<Vec<_>>().join(", ")
}

impl FileObject {
    /// True when every extent suits a namespace of `block`-byte blocks.
    pub fn aligned_to(&self, block: u64) -> bool {
        self.object.extents.iter().all(|e| e.len % block == 0 && (e.is_zeros() || e.offset % block == 0))
    }

    /// Checks the file is as it was mapped: same inode, size, times and extents.
    pub fn verify(&self) -> Result<(), MapError> {
        let file = File::open(&self.path).map_err(io(&self.path))?;
        let now = Snapshot::take(&file).map_err(io(&self.path))?;
        let s = &self.snapshot;
        let what = if (now.dev, now.ino) != (s.dev, s.ino) {
            "replaced by another file"
        } else if now.size != s.size {
            "size"
        } else if now.mtime != s.mtime || now.ctime != s.ctime {
            "modified"
        } else if now.extents != s.extents {
            "its blocks moved"
        } else {
            return Ok(());
        };
        Err(MapError::Changed { path: self.path.clone(), what: what.into() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(size: u64, extents: Vec<FsExtent>) -> Snapshot {
        Snapshot { dev: 0, ino: 0, size, mtime: (0, 0), ctime: (0, 0), extents }
    }

    fn fe(logical: u64, physical: u64, length: u64, flags: u32) -> FsExtent {
        FsExtent { logical, physical, length, flags }
    }

    #[test]
    fn holes_unwritten_tails_and_merging() {
        let s = snap(
            30_000,
            vec![
                fe(0, 40960, 4096, 0),
                fe(4096, 45056, 4096, 0), // contiguous: merges
                fe(12288, 8192, 4096, flags::UNWRITTEN),
                fe(16384, 90112, 8192, flags::LAST),
            ],
        );
        let o = build_object(&s, 1 << 20).unwrap();
        assert_eq!(o.len, 30_000);
        assert_eq!(
            o.extents,
            vec![
                Extent::data((1 << 20) + 40960, 8192),
                Extent::zeros(4096 + 4096), // the hole and the unwritten extent merge
                Extent::data((1 << 20) + 90112, 8192),
                Extent::zeros(8192), // 30000 - 24576 = 5424, rounded up
            ]
        );
        // Preallocated space past the end is not part of the object.
        let s = snap(100, vec![fe(0, 4096, 4096, 0), fe(4096, 8192, 1 << 20, flags::UNWRITTEN | flags::LAST)]);
        assert_eq!(build_object(&s, 0).unwrap().extents, vec![Extent::data(4096, 4096)]);
        // A sparse file with no extent at all.
        assert_eq!(build_object(&snap(5000, vec![]), 0).unwrap().extents, vec![Extent::zeros(8192)]);
        assert_eq!(build_object(&snap(0, vec![]), 0).unwrap(), Object::default());
    }

    #[test]
    fn unusable_extents_fall_back_with_a_reason() {
        for (f, word) in
            [(flags::DATA_INLINE, "inline"), (flags::ENCODED, "encoded"), (flags::DATA_ENCRYPTED, "encrypted"), (flags::UNKNOWN, "unknown")]
        {
            let e = build_object(&snap(100, vec![fe(0, 0, 4096, f | flags::LAST)]), 0).unwrap_err();
            assert!(e.contains(word), "{e}");
        }
        let many: Vec<FsExtent> = (0..5000).map(|i| fe(i * 4096, i * 8192, 4096, 0)).collect();
        let e = build_object(&snap(5000 * 4096, many), 0).unwrap_err();
        assert!(e.contains("5000 extents, more than the 4096"), "{e}");
    }
}
