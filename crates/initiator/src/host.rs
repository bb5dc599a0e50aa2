//! Who this host is to a target: its host NQN and Host Identifier. A target keys
//! reservations by the Host ID, so every connection of one host must send the same one: ours
//! (every verb, the host library, offloads) and the Linux kernel's, which `nvme connect`
//! makes with what nvme-cli resolves (libnvme's `nvme_host_get_ids`). We resolve as nvme-cli
//! does, each the first that applies:
//!
//! - host NQN: the one given; the `hostnqn` file; `nqn.2014-08.org.nvmexpress:uuid:U` with U
//!   derived from /etc/machine-id;
//! - Host ID: the one given; the `hostid` file, when the host NQN is this machine's (the one
//!   above with none given); the UUID a host NQN `...:uuid:U` ends with; else one derived
//!   from the host NQN (UUID v5), so that two NQNs are two hosts.
//!
//! One difference: nvme-cli takes the `hostid` file whatever `--hostnqn` says, but one Host ID
//! under two NQNs is two hosts claiming one identity (a reservation would take them for one
//! registrant; Linux refuses the second NQN with "found same hostid but different hostnqn"),
//! so we pair the file's Host ID only with this machine's NQN.
//!
//! The files are nvme-cli's, in /etc/nvme; NEARSTORE_NVME_DIR names another directory (tests).

use std::path::{Path, PathBuf};

/// The environment variable that replaces /etc/nvme as the directory of `hostnqn` and `hostid`.
pub const NVME_DIR_ENV: &str = "NEARSTORE_NVME_DIR";

/// A host NQN and the Host Identifier that goes with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostIds {
    pub hostnqn: String,
    pub hostid: [u8; 16],
}

#[derive(Debug, thiserror::Error)]
#[error("{path}: '{text}' is not a UUID (nvme-cli's Host ID file; give --hostid, or fix or remove the file)")]
pub struct BadHostIdFile {
    pub path: String,
    pub text: String,
}

fn nvme_dir() -> PathBuf {
    std::env::var_os(NVME_DIR_ENV).map_or_else(|| PathBuf::from("/etc/nvme"), PathBuf::from)
}

/// The host NQN of this machine: the `hostnqn` file if it holds one, else one derived from
/// the machine id, in the form nvme-cli uses.
pub fn default_hostnqn() -> String {
    machine_hostnqn(&nvme_dir())
}

fn machine_hostnqn(dir: &Path) -> String {
    if let Ok(s) = std::fs::read_to_string(dir.join("hostnqn")) {
        let s = s.trim();
        if s.starts_with("nqn.") {
            return s.to_string();
        }
    }
    let seed = std::fs::read_to_string("/etc/machine-id").unwrap_or_else(|_| "nearstore".into());
    let id = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, seed.trim().as_bytes());
    format!("nqn.2014-08.org.nvmexpress:uuid:{id}")
}

/// The Host ID a host NQN implies when none is given and it is not this machine's: the UUID
/// it ends with (`...:uuid:U`, as nvme-cli derives it), else a UUID v5 of the whole NQN.
pub fn hostid_of(hostnqn: &str) -> [u8; 16] {
    let tail = hostnqn.rsplit_once(":uuid:").map(|(_, u)| u);
    match tail.and_then(|u| uuid::Uuid::parse_str(u).ok()) {
        Some(u) => *u.as_bytes(),
        None => *uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, hostnqn.as_bytes()).as_bytes(),
    }
}

/// Resolves the host NQN and Host ID to connect with, from those given (`--hostnqn`,
/// `--hostid`) and this machine's files, in the order of the module's documentation. Fails
/// only on a `hostid` file that the resolution uses and that does not hold a UUID.
pub fn resolve(hostnqn: Option<&str>, hostid: Option<[u8; 16]>) -> Result<HostIds, BadHostIdFile> {
    resolve_in(&nvme_dir(), hostnqn, hostid)
}

/// [`resolve`] with nvme-cli's files in `dir`.
fn resolve_in(dir: &Path, hostnqn: Option<&str>, hostid: Option<[u8; 16]>) -> Result<HostIds, BadHostIdFile> {
    let machine = machine_hostnqn(dir);
    let hostnqn = hostnqn.map_or_else(|| machine.clone(), str::to_string);
    let hostid = match hostid {
        Some(id) => id,
        None if hostnqn == machine => match machine_hostid(dir)? {
            Some(id) => id,
            None => hostid_of(&hostnqn),
        },
        None => hostid_of(&hostnqn),
    };
    Ok(HostIds { hostnqn, hostid })
}

/// The `hostid` file's UUID, None when there is no such file.
fn machine_hostid(dir: &Path) -> Result<Option<[u8; 16]>, BadHostIdFile> {
    let path = dir.join("hostid");
    let Ok(text) = std::fs::read_to_string(&path) else { return Ok(None) };
    let text = text.trim();
    match uuid::Uuid::parse_str(text) {
        Ok(u) => Ok(Some(*u.as_bytes())),
        Err(_) => Err(BadHostIdFile { path: path.display().to_string(), text: text.to_string() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE_NQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0062216e-1d66-4bce-afda-9311e3a3169c";
    const FILE_ID: &str = "e4b3c653-9a5e-47f7-9553-c7fa133c904f";
    const OTHER_NQN: &str = "nqn.2026-11.io.example:host-b";

    fn id(s: &str) -> [u8; 16] {
        *uuid::Uuid::parse_str(s).unwrap().as_bytes()
    }

    /// The files present, --hostnqn, --hostid, the Host ID expected.
    type Case<'a> = (Option<&'a str>, Option<&'a str>, Option<&'a str>, Option<[u8; 16]>, [u8; 16]);

    /// Each line: the files present (host NQN, Host ID), --hostnqn, --hostid, and the Host ID
    /// expected; the NQN is --hostnqn, else the file's.
    #[test]
    fn ids_resolve_in_nvme_clis_order() {
        let given = id("6b1e3a2c-2f0e-4d6a-9f3c-000000000042");
        let v5 = |n: &str| *uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, n.as_bytes()).as_bytes();
        #[rustfmt::skip]
        let cases: &[Case] = &[
            // nvme-cli installed: the machine's NQN takes the machine's Host ID, given or not.
            (Some(FILE_NQN), Some(FILE_ID), None, None, id(FILE_ID)),
            (Some(FILE_NQN), Some(FILE_ID), Some(FILE_NQN), None, id(FILE_ID)),
            // Another NQN is another host: its own Host ID, not the file's.
            (Some(FILE_NQN), Some(FILE_ID), Some(OTHER_NQN), None, v5(OTHER_NQN)),
            (Some(FILE_NQN), Some(FILE_ID), Some("nqn.2014-08.org.nvmexpress:uuid:0000000b-0000-0000-0000-000000000000"), None,
                id("0000000b-0000-0000-0000-000000000000")),
            // --hostid wins.
            (Some(FILE_NQN), Some(FILE_ID), None, Some(given), given),
            (Some(FILE_NQN), Some(FILE_ID), Some(OTHER_NQN), Some(given), given),
            // No hostid file: the UUID of a uuid NQN, as nvme-cli; else the NQN's v5.
            (Some(FILE_NQN), None, None, None, id("0062216e-1d66-4bce-afda-9311e3a3169c")),
            (Some(OTHER_NQN), None, None, None, v5(OTHER_NQN)),
            (Some("nqn.2014-08.org.nvmexpress:uuid:not-a-uuid"), None, None, None, v5("nqn.2014-08.org.nvmexpress:uuid:not-a-uuid")),
        ];
        for (i, &(file_nqn, file_id, nqn, hostid, want)) in cases.iter().enumerate() {
            let dir = tempfile::tempdir().unwrap();
            if let Some(n) = file_nqn {
                std::fs::write(dir.path().join("hostnqn"), format!("{n}\n")).unwrap();
            }
            if let Some(h) = file_id {
                std::fs::write(dir.path().join("hostid"), format!("{h}\n")).unwrap();
            }
            let got = resolve_in(dir.path(), nqn, hostid).unwrap();
            assert_eq!(got.hostnqn, nqn.or(file_nqn).unwrap(), "case {i}");
            assert_eq!(got.hostid, want, "case {i}: {:?}", uuid::Uuid::from_bytes(got.hostid));
        }
    }

    /// A malformed hostid file is an error naming it when it would be used, and ignored when
    /// another NQN is given.
    #[test]
    fn a_bad_hostid_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("hostnqn"), FILE_NQN).unwrap();
        std::fs::write(dir.path().join("hostid"), "garbage\n").unwrap();
        let e = resolve_in(dir.path(), None, None).unwrap_err().to_string();
        assert!(e.contains("hostid: 'garbage' is not a UUID"), "{e}");
        assert!(resolve_in(dir.path(), Some(OTHER_NQN), None).is_ok());
    }
}
