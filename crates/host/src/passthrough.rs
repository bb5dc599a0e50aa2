//! Compute commands through the Linux kernel's own NVMe/TCP connection: the NVMe
//! passthrough ioctl (`NVME_IOCTL_IO64_CMD`) on the namespace's block device. This is the
//! deployment path: the kernel attached the namespace (`nvme connect`), a file system on it
//! is mounted, and the compute commands travel on the kernel's queues, next to its reads
//! and writes, with no second connection.
//!
//! The commands are those of docs/compute-protocol.md: EXEC (opcode 81h, host to
//! controller) and FETCH (82h, controller to host). The kernel takes a command's data
//! direction from the opcode's low bits, as the specification does, so it carries them
//! unchanged.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nearstore_initiator::Error;
use nearstore_wire::compute::opcode as cop;
use nearstore_wire::Status;

/// `struct nvme_passthru_cmd64` of <linux/nvme_ioctl.h>.
#[repr(C)]
#[derive(Default)]
struct PassthruCmd64 {
    opcode: u8,
    flags: u8,
    rsvd1: u16,
    nsid: u32,
    cdw2: u32,
    cdw3: u32,
    metadata: u64,
    addr: u64,
    metadata_len: u32,
    data_len: u32,
    cdw10: u32,
    cdw11: u32,
    cdw12: u32,
    cdw13: u32,
    cdw14: u32,
    cdw15: u32,
    timeout_ms: u32,
    rsvd2: u32,
    result: u64,
}

/// `_IOWR('N', 0x48, struct nvme_passthru_cmd64)`.
const NVME_IOCTL_IO64_CMD: libc::c_ulong =
    (3 << 30) | ((std::mem::size_of::<PassthruCmd64>() as libc::c_ulong) << 16) | ((b'N' as libc::c_ulong) << 8) | 0x48;

/// A kernel-attached namespace, opened for passthrough.
pub struct KernelNamespace {
    file: File,
    pub path: PathBuf,
    pub nsid: u32,
}

/// The most bytes one FETCH asks for.
const FETCH_MAX: usize = 128 * 1024;

impl KernelNamespace {
    /// Opens `/dev/<disk>` (a namespace's block device, `nvme0n1`).
    pub fn open(dev: &Path, nsid: u32) -> std::io::Result<KernelNamespace> {
        let file = std::fs::OpenOptions::new().read(true).open(dev)?;
        Ok(KernelNamespace { file, path: dev.to_path_buf(), nsid })
    }

    /// One command: the NVMe status and the completion's DW0 and DW1.
    fn command(&self, opcode: u8, cdw10: u32, cdw11: u32, data: &mut [u8], timeout: Duration) -> Result<(Status, u32, u32), Error> {
        let mut c = PassthruCmd64 {
            opcode,
            nsid: self.nsid,
            addr: data.as_mut_ptr() as u64,
            data_len: data.len() as u32,
            cdw10,
            cdw11,
            timeout_ms: timeout.as_millis().min(u32::MAX as u128) as u32,
            ..Default::default()
        };
        // SAFETY: the ioctl reads the struct and transfers at most data_len bytes to or
        // from `data`, which outlives the call.
        let r = unsafe { libc::ioctl(self.file.as_raw_fd(), NVME_IOCTL_IO64_CMD as _, &mut c as *mut PassthruCmd64) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            return Err(Error::Invalid(format!("{}: NVMe passthrough of opcode {opcode:#04x}: {e}", self.path.display())));
        }
        // A positive return is the completion's status field without its phase bit.
        let status = Status::from_field((r as u16) << 1);
        Ok((status, c.result as u32, (c.result >> 32) as u32))
    }

    /// EXEC the descriptor, then FETCH the whole result; a refusal comes back as
    /// [`Error::Compute`] with the target's message, fetched the same way.
    pub fn compute(&self, descriptor: &[u8], timeout: Duration) -> Result<Vec<u8>, Error> {
        let mut d = descriptor.to_vec();
        let (status, handle, len) = self.command(cop::EXEC, 0, 0, &mut d, timeout)?;
        if !status.is_success() {
            let message = if handle != 0 { String::from_utf8_lossy(&self.fetch(handle, len)?).into_owned() } else { String::new() };
            return Err(Error::Compute { status, message });
        }
        self.fetch(handle, len)
    }

    /// FETCHes `len` bytes held under `handle`; the last transfer releases it.
    pub fn fetch(&self, handle: u32, len: u32) -> Result<Vec<u8>, Error> {
        let mut out = Vec::with_capacity(len as usize);
        let mut buf = vec![0u8; (len as usize).clamp(1, FETCH_MAX)];
        loop {
            let want = (len as usize - out.len()).clamp(1, FETCH_MAX);
            let (status, valid, left) = self.command(cop::FETCH, handle, out.len() as u32, &mut buf[..want], Duration::from_secs(30))?;
            if !status.is_success() {
                return Err(Error::Compute { status, message: format!("FETCH of handle {handle} at byte {}", out.len()) });
            }
            let valid = (valid as usize).min(want);
            out.extend_from_slice(&buf[..valid]);
            if left == 0 || valid == 0 {
                return Ok(out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_ioctl_number_is_the_kernels() {
        // From <linux/nvme_ioctl.h> on x86_64: _IOWR('N', 0x48, struct nvme_passthru_cmd64), 80 bytes.
        assert_eq!(std::mem::size_of::<super::PassthruCmd64>(), 80);
        assert_eq!(super::NVME_IOCTL_IO64_CMD, 0xC050_4E48);
    }
}
