//! Which target namespace a block device is, and where a file system starts in it.
//!
//! - Kernel-attached NVMe/TCP namespaces say it in sysfs: subsystem NQN, transport
//!   address, NSID.
//! - A loop device is matched by its backing file to a file a target exports (from the
//!   target's configuration, or a map entry), plus the loop device's own offset.
//! - Any block device can be mapped explicitly.
//!
//! A partition adds its start. Anything else is not ours: the caller computes locally.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// A namespace on a target, as the host reaches it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Deserialize)]
pub struct Endpoint {
    pub address: SocketAddr,
    pub nqn: String,
    pub nsid: u32,
}

/// Where a file system's device lies: its namespace, and the byte offset of the device's
/// first byte in the namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    pub endpoint: Endpoint,
    pub offset: u64,
    /// The block device, for messages ("loop0p1").
    pub device: String,
    /// The namespace's block device when the kernel attached it over NVMe/TCP ("nvme0n1"):
    /// compute commands can then go through the kernel's connection (passthrough).
    pub kernel_device: Option<String>,
}

/// One `[[namespace]]` entry of a map file: the namespace and either the file the target
/// exports (loop devices backed by it map to it) or a block device name.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MapEntry {
    pub address: SocketAddr,
    pub nqn: String,
    pub nsid: u32,
    pub file: Option<PathBuf>,
    pub device: Option<String>,
    /// The namespace's device tag in the cluster map (the targets' `[[cluster.peer]]`
    /// entries name it the same way): needed to run operations across targets.
    pub tag: Option<u16>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MapFile {
    #[serde(default)]
    namespace: Vec<MapEntry>,
}

/// How the host finds namespaces for block devices.
#[derive(Clone, Debug)]
pub struct DeviceMap {
    sysfs: PathBuf,
    /// Exported files by (st_dev, st_ino).
    files: HashMap<(u64, u64), Endpoint>,
    devices: HashMap<String, Endpoint>,
    tags: HashMap<Endpoint, u16>,
}

impl Default for DeviceMap {
    fn default() -> Self {
        DeviceMap::with_sysfs("/sys")
    }
}

impl DeviceMap {
    pub fn with_sysfs(root: impl Into<PathBuf>) -> DeviceMap {
        DeviceMap { sysfs: root.into(), files: HashMap::new(), devices: HashMap::new(), tags: HashMap::new() }
    }

    /// Adds the entries of a map file (TOML, `[[namespace]]` entries); errors name the entry.
    pub fn load(&mut self, text: &str) -> Result<(), String> {
        let m: MapFile = toml::from_str(text).map_err(|e| format!("device map: {e}"))?;
        for (i, e) in m.namespace.into_iter().enumerate() {
            let ep = Endpoint { address: e.address, nqn: e.nqn, nsid: e.nsid };
            if let Some(t) = e.tag {
                self.set_tag(&ep, t).map_err(|m| format!("device map: namespace[{i}].tag: {m}"))?;
            }
            match (e.file, e.device) {
                (Some(f), None) => self.add_file(&f, ep).map_err(|m| format!("device map: namespace[{i}].file: {m}"))?,
                (None, Some(d)) => self.add_device(&d, ep),
                _ => return Err(format!("device map: namespace[{i}]: give exactly one of file and device")),
            }
        }
        Ok(())
    }

    /// Gives a namespace its device tag (1 to 65534, one namespace each).
    pub fn set_tag(&mut self, ep: &Endpoint, tag: u16) -> Result<(), String> {
        if tag == 0 || tag == u16::MAX {
            return Err(format!("{tag}: must be between 1 and 65534"));
        }
        if let Some((other, _)) = self.tags.iter().find(|(e, t)| **t == tag && *e != ep) {
            return Err(format!("tag {tag} is already {} nsid {}", other.nqn, other.nsid));
        }
        self.tags.insert(ep.clone(), tag);
        Ok(())
    }

    /// The device tag of a namespace, if the cluster map gives it one.
    pub fn tag_of(&self, ep: &Endpoint) -> Option<u16> {
        self.tags.get(ep).copied()
    }

    /// Maps loop devices backed by `file` (the file a target exports) to `ep`.
    pub fn add_file(&mut self, file: &Path, ep: Endpoint) -> Result<(), String> {
        let m = std::fs::metadata(file).map_err(|e| format!("{}: {e}", file.display()))?;
        self.files.insert((m.dev(), m.ino()), ep);
        Ok(())
    }

    /// Maps a block device ("sdb", "/dev/sdb") to `ep`.
    pub fn add_device(&mut self, name: &str, ep: Endpoint) {
        self.devices.insert(name.trim_start_matches("/dev/").to_string(), ep);
    }

    fn read(&self, rel: impl AsRef<Path>) -> Option<String> {
        std::fs::read_to_string(self.sysfs.join(rel)).ok().map(|s| s.trim().to_string())
    }

    /// The namespace under the block device `st_dev` (a file's), or why there is none.
    pub fn locate(&self, st_dev: u64) -> Result<Location, String> {
        let (major, minor) = (libc::major(st_dev), libc::minor(st_dev));
        if major == 0 {
            return Err(format!("the file system is on no single block device (device {major}:{minor}: btrfs, tmpfs, NFS or overlay)"));
        }
        let link = self.sysfs.join(format!("dev/block/{major}:{minor}"));
        let dir = std::fs::canonicalize(&link).map_err(|e| format!("block device {major}:{minor}: {}: {e}", link.display()))?;
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let (disk, part_offset) = if dir.join("partition").exists() {
            let start: u64 = std::fs::read_to_string(dir.join("start"))
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .ok_or_else(|| format!("partition {name}: no start in sysfs"))?;
            let parent = dir.parent().and_then(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            (parent, start * 512)
        } else {
            (name.clone(), 0)
        };
        let found = |endpoint: Endpoint, offset: u64| Ok(Location { endpoint, offset, device: name.clone(), kernel_device: None });
        if let Some(ep) = self.devices.get(&name).or_else(|| self.devices.get(&disk)) {
            return found(ep.clone(), if self.devices.contains_key(&name) { 0 } else { part_offset });
        }
        if let Some(backing) = self.read(format!("block/{disk}/loop/backing_file")) {
            let loop_offset: u64 = self.read(format!("block/{disk}/loop/offset")).and_then(|s| s.parse().ok()).unwrap_or(0);
            let m = std::fs::metadata(&backing).map_err(|e| format!("{disk}: backing file {backing}: {e}"))?;
            return match self.files.get(&(m.dev(), m.ino())) {
                Some(ep) => found(ep.clone(), loop_offset + part_offset),
                None => Err(format!("{disk} is backed by {backing}, which no known target exports")),
            };
        }
        // An NVMe namespace: `device` is its controller, or, with native multipath (the
        // default), its subsystem, whose controllers are the `nvmeN` entries in it.
        if let Some(ctrl) = self.nvme_tcp_controller(&disk) {
            let nqn = self.read(format!("block/{disk}/device/subsysnqn")).ok_or_else(|| format!("{disk}: no subsysnqn in sysfs"))?;
            let nsid =
                self.read(format!("block/{disk}/nsid")).and_then(|s| s.parse().ok()).ok_or_else(|| format!("{disk}: no nsid in sysfs"))?;
            let address = self.read(format!("{ctrl}/address")).ok_or_else(|| format!("{disk}: no address in sysfs"))?;
            let address = parse_nvme_address(&address).ok_or_else(|| format!("{disk}: cannot read transport address {address:?}"))?;
            return Ok(Location {
                endpoint: Endpoint { address, nqn, nsid },
                offset: part_offset,
                device: name.clone(),
                kernel_device: Some(disk),
            });
        }
        Err(format!("{disk} is not a namespace of a known nearstore target"))
    }
}

impl DeviceMap {
    /// The sysfs directory (relative) of an NVMe/TCP controller of namespace `disk`.
    fn nvme_tcp_controller(&self, disk: &str) -> Option<String> {
        let dev = format!("block/{disk}/device");
        if self.read(format!("{dev}/transport")).as_deref() == Some("tcp") {
            return Some(dev);
        }
        let mut ctrls: Vec<String> = std::fs::read_dir(self.sysfs.join(&dev))
            .ok()?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.strip_prefix("nvme").is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit())))
            .collect();
        ctrls.sort();
        ctrls.into_iter().map(|c| format!("{dev}/{c}")).find(|c| self.read(format!("{c}/transport")).as_deref() == Some("tcp"))
    }
}

/// "traddr=127.0.0.1,trsvcid=4420[,src_addr=...]" as the nvme driver writes it.
fn parse_nvme_address(s: &str) -> Option<SocketAddr> {
    let mut addr = None;
    let mut port = None;
    for kv in s.split(',') {
        match kv.split_once('=') {
            Some(("traddr", v)) => addr = v.parse::<std::net::IpAddr>().ok(),
            Some(("trsvcid", v)) => port = v.parse::<u16>().ok(),
            _ => {}
        }
    }
    Some(SocketAddr::new(addr?, port?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn ep(nsid: u32) -> Endpoint {
        Endpoint { address: "127.0.0.1:4420".parse().unwrap(), nqn: "nqn.2026-11.io.nearstore:t".into(), nsid }
    }

    /// A sysfs tree with loop7 (and its partition loop7p2), an NVMe/TCP namespace and a
    /// plain disk.
    fn fake_sysfs(backing: &Path) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        let w = |p: &str, s: &str| {
            let p = r.join(p);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, s).unwrap();
        };
        w("devices/virtual/block/loop7/loop/backing_file", &format!("{}\n", backing.display()));
        w("devices/virtual/block/loop7/loop/offset", "1048576\n");
        w("devices/virtual/block/loop7/loop7p2/partition", "2\n");
        w("devices/virtual/block/loop7/loop7p2/start", "2048\n");
        w("devices/virtual/nvme-fabrics/ctl/nvme1/nvme1n3/nsid", "3\n");
        w("devices/virtual/nvme-fabrics/ctl/nvme1/nvme1n3/device/transport", "tcp\n");
        w("devices/virtual/nvme-fabrics/ctl/nvme1/nvme1n3/device/subsysnqn", "nqn.2026-11.io.nearstore:k\n");
        w("devices/virtual/nvme-fabrics/ctl/nvme1/nvme1n3/device/address", "traddr=10.0.0.2,trsvcid=4420,src_addr=10.0.0.1\n");
        // Native multipath: the namespace's device is the subsystem, with its controllers in it.
        w("devices/virtual/nvme-subsystem/nvme-subsys0/nvme0n1/nsid", "1\n");
        w("devices/virtual/nvme-subsystem/nvme-subsys0/subsysnqn", "nqn.2026-11.io.nearstore:mp\n");
        w("devices/virtual/nvme-subsystem/nvme-subsys0/nvme0/transport", "tcp\n");
        w("devices/virtual/nvme-subsystem/nvme-subsys0/nvme0/address", "traddr=10.0.2.2,trsvcid=4420\n");
        symlink(
            r.join("devices/virtual/nvme-subsystem/nvme-subsys0"),
            r.join("devices/virtual/nvme-subsystem/nvme-subsys0/nvme0n1/device"),
        )
        .unwrap();
        w("devices/pci/block/sda/size", "100\n");
        std::fs::create_dir_all(r.join("dev/block")).unwrap();
        std::fs::create_dir_all(r.join("block")).unwrap();
        for (devno, target) in [
            ("7:0", "devices/virtual/block/loop7"),
            ("259:2", "devices/virtual/block/loop7/loop7p2"),
            ("259:5", "devices/virtual/nvme-fabrics/ctl/nvme1/nvme1n3"),
            ("259:0", "devices/virtual/nvme-subsystem/nvme-subsys0/nvme0n1"),
            ("8:0", "devices/pci/block/sda"),
        ] {
            symlink(r.join(target), r.join("dev/block").join(devno)).unwrap();
            let name = Path::new(target).file_name().unwrap();
            if !target.ends_with("p2") {
                symlink(r.join(target), r.join("block").join(name)).unwrap();
            }
        }
        d
    }

    #[test]
    fn loop_devices_partitions_nvme_and_strangers() {
        let img = tempfile::NamedTempFile::new().unwrap();
        let sys = fake_sysfs(img.path());
        let mut m = DeviceMap::with_sysfs(sys.path());
        // Backed by a file no target exports.
        let e = m.locate(libc::makedev(7, 0)).unwrap_err();
        assert!(e.contains("which no known target exports"), "{e}");
        m.add_file(img.path(), ep(1)).unwrap();
        let l = m.locate(libc::makedev(7, 0)).unwrap();
        assert_eq!((l.endpoint.nsid, l.offset, l.device.as_str()), (1, 1 << 20, "loop7"));
        // The partition: loop offset plus 2048 sectors.
        let l = m.locate(libc::makedev(259, 2)).unwrap();
        assert_eq!((l.offset, l.device.as_str()), ((1 << 20) + 2048 * 512, "loop7p2"));
        // NVMe/TCP from sysfs.
        let l = m.locate(libc::makedev(259, 5)).unwrap();
        assert_eq!(l.endpoint, Endpoint { address: "10.0.0.2:4420".parse().unwrap(), nqn: "nqn.2026-11.io.nearstore:k".into(), nsid: 3 });
        assert_eq!(l.kernel_device.as_deref(), Some("nvme1n3"));
        // NVMe/TCP with native multipath: through the subsystem to its controller.
        let l = m.locate(libc::makedev(259, 0)).unwrap();
        assert_eq!(l.endpoint, Endpoint { address: "10.0.2.2:4420".parse().unwrap(), nqn: "nqn.2026-11.io.nearstore:mp".into(), nsid: 1 });
        assert_eq!(l.kernel_device.as_deref(), Some("nvme0n1"));
        // A plain disk, until mapped explicitly.
        assert!(m.locate(libc::makedev(8, 0)).unwrap_err().contains("sda is not a namespace"));
        m.load("[[namespace]]\naddress = \"127.0.0.1:4421\"\nnqn = \"nqn.x\"\nnsid = 2\ndevice = \"/dev/sda\"\n").unwrap();
        assert_eq!(m.locate(libc::makedev(8, 0)).unwrap().endpoint.nsid, 2);
        // No block device at all.
        assert!(m.locate(libc::makedev(0, 42)).unwrap_err().contains("no single block device"));
        assert!(m.locate(libc::makedev(9, 9)).unwrap_err().contains("block device 9:9"));
    }

    #[test]
    fn map_file_errors_name_the_entry() {
        let mut m = DeviceMap::default();
        let e = m.load("[[namespace]]\naddress = \"127.0.0.1:1\"\nnqn = \"n\"\nnsid = 1\n").unwrap_err();
        assert!(e.contains("namespace[0]: give exactly one of file and device"), "{e}");
        let e = m.load("[[namespace]]\naddress = \"127.0.0.1:1\"\nnqn = \"n\"\nnsid = 1\nfile = \"/nonexistent/x\"\n").unwrap_err();
        assert!(e.contains("namespace[0].file"), "{e}");
        let e = m.load("[[namespace]]\naddress = \"nope\"\n").unwrap_err();
        assert!(e.starts_with("device map:"), "{e}");
    }
}
