//! The reservation verbs, modelled on nvme-cli's `nvme resv-*`: resv-register,
//! resv-acquire, resv-release, resv-report (docs/reservations.md).
//!
//! nvme-cli's short options mean here what they mean there (`-n` the namespace, `-t` the
//! reservation type, `-a` the action, `-c`/`-k`/`-p` the keys, `-i` IEKEY); the target is
//! therefore named by long options only (`--traddr`, `-s`/`--trsvcid`, `--nqn`).

use anyhow::{Context, Result};
use nearstore_initiator::{Controller, Error, IoQueue};
use nearstore_wire::resv::{racqa, rrega, rrela, Cdw10, Keys, ReservationStatus};
use nearstore_wire::Status;
use serde_json::json;

use crate::{Output, Plain, TargetArgs, DEFAULT_NQN};

/// Where the reservation verbs go: a target, a host identity, a namespace.
#[derive(clap::Args)]
pub struct ResvTarget {
    /// Transport type: tcp, the only one.
    #[arg(long, default_value = "tcp", value_parser = ["tcp"])]
    transport: String,
    /// Target address: HOST, or HOST:PORT (`-a` is the action here, as in nvme-cli).
    #[arg(long = "traddr", default_value = "127.0.0.1")]
    traddr: String,
    /// Target port (default 4420), when the address does not give one.
    #[arg(short = 's', long = "trsvcid")]
    trsvcid: Option<u16>,
    /// Subsystem NQN (`-n` is the namespace here, as in nvme-cli).
    #[arg(long = "nqn", default_value = DEFAULT_NQN)]
    nqn: String,
    /// Host NQN (default: /etc/nvme/hostnqn or one derived from the machine id).
    #[arg(long)]
    hostnqn: Option<String>,
    /// Host Identifier, a UUID: what the target keys registrations by (default: /etc/nvme/hostid
    /// with this machine's host NQN, as nvme-cli's connections; else the UUID the host NQN
    /// ends with, or one derived from it; docs/reservations.md).
    #[arg(long, value_parser = crate::host_id)]
    hostid: Option<uuid::Uuid>,
    /// The host's DH-HMAC-CHAP secret, used when the target asks this host to authenticate.
    #[arg(long, value_parser = crate::dhchap_secret)]
    dhchap_secret: Option<nearstore_dhchap::Secret>,
    /// The controller's DH-HMAC-CHAP secret: the target must prove it holds it.
    #[arg(long, value_parser = crate::dhchap_secret, requires = "dhchap_secret")]
    dhchap_ctrl_secret: Option<nearstore_dhchap::Secret>,
    /// Namespace ID.
    #[arg(short = 'n', long = "namespace-id", default_value_t = 1)]
    nsid: u32,
}

/// Reservation Register.
#[derive(clap::Args)]
pub struct RegisterArgs {
    #[command(flatten)]
    t: ResvTarget,
    /// Current reservation key (unregister, replace), decimal or 0x hex.
    #[arg(short = 'c', long, default_value = "0", value_parser = key)]
    crkey: u64,
    /// New reservation key (register, replace), decimal or 0x hex.
    #[arg(short = 'k', long, default_value = "0", value_parser = key)]
    nrkey: u64,
    /// Action: 0 register, 1 unregister, 2 replace (or the names).
    #[arg(short = 'r', long, default_value = "register", value_parser = register_action)]
    rrega: u8,
    /// Persist Through Power Loss: 0 no change, 2 clear, 3 set (or no-change, clear, set).
    #[arg(short = 'p', long, default_value = "no-change", value_parser = cptpl)]
    cptpl: u8,
    /// Ignore Existing Key: unregister or replace without checking --crkey.
    #[arg(short = 'i', long)]
    iekey: bool,
}

/// Reservation Acquire.
#[derive(clap::Args)]
pub struct AcquireArgs {
    #[command(flatten)]
    t: ResvTarget,
    /// This host's reservation key, decimal or 0x hex.
    #[arg(short = 'c', long, value_parser = key)]
    crkey: u64,
    /// Preempt: the key of the registrants to remove, decimal or 0x hex.
    #[arg(short = 'p', long, default_value = "0", value_parser = key)]
    prkey: u64,
    /// Reservation type: 1 write-exclusive (we), 2 exclusive-access (ea), 3 we-ro, 4 ea-ro
    /// (registrants only), 5 we-ar, 6 ea-ar (all registrants).
    #[arg(short = 't', long, value_parser = rtype)]
    rtype: u8,
    /// Action: 0 acquire, 1 preempt, 2 preempt-abort (or the numbers).
    #[arg(short = 'a', long, default_value = "acquire", value_parser = acquire_action)]
    racqa: u8,
    /// Ignore Existing Key (the target refuses it in Acquire: Invalid Field).
    #[arg(short = 'i', long)]
    iekey: bool,
}

/// Reservation Release.
#[derive(clap::Args)]
pub struct ReleaseArgs {
    #[command(flatten)]
    t: ResvTarget,
    /// This host's reservation key, decimal or 0x hex.
    #[arg(short = 'c', long, value_parser = key)]
    crkey: u64,
    /// Type of the reservation released (as resv-acquire's --rtype); not needed to clear.
    #[arg(short = 't', long, default_value = "0", value_parser = rtype_or_none)]
    rtype: u8,
    /// Action: 0 release, 1 clear (every registration and the reservation).
    #[arg(short = 'a', long, default_value = "release", value_parser = release_action)]
    rrela: u8,
    /// Ignore Existing Key (the target refuses it in Release: Invalid Field).
    #[arg(short = 'i', long)]
    iekey: bool,
}

/// Reservation Report.
#[derive(clap::Args)]
pub struct ReportArgs {
    #[command(flatten)]
    t: ResvTarget,
    /// Output format: normal (nvme-cli's layout) or json.
    #[arg(short = 'o', long, value_enum, default_value = "normal")]
    output_format: Output,
}

/// A key: decimal, or hex with 0x.
fn key(s: &str) -> Result<u64, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.map_err(|_| format!("'{s}' is not a 64-bit key (decimal, or hex with 0x)"))
}

/// A name or a number from a table of (number, names).
fn named(what: &str, s: &str, table: &[(u8, &[&str])]) -> Result<u8, String> {
    let l = s.to_ascii_lowercase();
    table.iter().find(|(n, names)| l == n.to_string() || names.contains(&l.as_str())).map(|(n, _)| *n).ok_or_else(|| {
        let all: Vec<String> = table.iter().map(|(n, names)| format!("{n} ({})", names.join(", "))).collect();
        format!("'{s}' names no {what}: one of {}", all.join("; "))
    })
}

const RTYPES: &[(u8, &[&str])] = &[
    (1, &["write-exclusive", "we"]),
    (2, &["exclusive-access", "ea"]),
    (3, &["write-exclusive-registrants-only", "we-ro"]),
    (4, &["exclusive-access-registrants-only", "ea-ro"]),
    (5, &["write-exclusive-all-registrants", "we-ar"]),
    (6, &["exclusive-access-all-registrants", "ea-ar"]),
];

fn rtype(s: &str) -> Result<u8, String> {
    named("reservation type", s, RTYPES)
}

fn rtype_or_none(s: &str) -> Result<u8, String> {
    if s == "0" {
        return Ok(0);
    }
    rtype(s)
}

fn register_action(s: &str) -> Result<u8, String> {
    named("register action", s, &[(rrega::REGISTER, &["register"]), (rrega::UNREGISTER, &["unregister"]), (rrega::REPLACE, &["replace"])])
}

fn acquire_action(s: &str) -> Result<u8, String> {
    named(
        "acquire action",
        s,
        &[
            (racqa::ACQUIRE, &["acquire"]),
            (racqa::PREEMPT, &["preempt"]),
            (racqa::PREEMPT_AND_ABORT, &["preempt-abort", "preempt-and-abort"]),
        ],
    )
}

fn release_action(s: &str) -> Result<u8, String> {
    named("release action", s, &[(rrela::RELEASE, &["release"]), (rrela::CLEAR, &["clear"])])
}

fn cptpl(s: &str) -> Result<u8, String> {
    named("CPTPL value", s, &[(0, &["no-change"]), (2, &["clear"]), (3, &["set"])])
}

fn type_name(t: u8) -> &'static str {
    RTYPES.iter().find(|(n, _)| *n == t).map_or("none", |(_, names)| names[0])
}

async fn connect(t: &ResvTarget) -> Result<(Controller, IoQueue)> {
    let args = TargetArgs {
        transport: t.transport.clone(),
        traddr: t.traddr.clone(),
        trsvcid: t.trsvcid,
        nqn: t.nqn.clone(),
        hostnqn: t.hostnqn.clone(),
        hostid: t.hostid,
        hdr_digest: false,
        data_digest: false,
        dhchap_secret: t.dhchap_secret.clone(),
        dhchap_ctrl_secret: t.dhchap_ctrl_secret.clone(),
    };
    let o = args.options()?;
    let c = crate::tools::connect_with(o).await?;
    let q = c.io_queue(1).await.context("creating an I/O queue")?;
    Ok((c, q))
}

/// A refused reservation command in the user's terms; the NVMe status stays in the detail.
fn plain(e: Error, what: &str, nsid: u32, conflict: impl FnOnce() -> String) -> anyhow::Error {
    let Error::Status { status, .. } = &e else { return anyhow::Error::new(e).context(what.to_string()) };
    let s = Status { dnr: false, ..*status };
    let said = if s == Status::RESERVATION_CONFLICT {
        format!("reservation conflict: {}", conflict())
    } else if s == Status::HOST_ID_NOT_INITIALIZED {
        "this host's Host Identifier is zero, and reservations need one: give --hostid".to_string()
    } else if s == Status::INVALID_NAMESPACE {
        format!("no namespace {nsid} in this subsystem (`nearstore list` shows them)")
    } else {
        return anyhow::Error::new(e).context(what.to_string());
    };
    anyhow::Error::new(Plain { said, detail: e.to_string() })
}

pub fn register(a: RegisterArgs) -> Result<()> {
    crate::runtime(Some(1))?.block_on(async {
        let (_c, mut q) = connect(&a.t).await?;
        let nsid = a.t.nsid;
        let cdw10 = Cdw10 { action: a.rrega, iekey: a.iekey, cptpl: a.cptpl, rtype: 0 };
        q.resv_register(nsid, cdw10, Keys { current: a.crkey, other: a.nrkey }).await.map_err(|e| {
            plain(e, "Reservation Register", nsid, || match a.rrega {
                rrega::REGISTER => format!(
                    "this host is registered on namespace {nsid} with another key (replace it: --rrega replace --crkey OLD --nrkey {:#x})",
                    a.nrkey
                ),
                _ => format!("this host is not registered on namespace {nsid} with key {:#x} (resv-report shows the keys)", a.crkey),
            })
        })?;
        match a.rrega {
            rrega::UNREGISTER => println!("unregistered from namespace {nsid}"),
            _ => println!("registered key {:#x} on namespace {nsid}", a.nrkey),
        }
        Ok(())
    })
}

pub fn acquire(a: AcquireArgs) -> Result<()> {
    crate::runtime(Some(1))?.block_on(async {
        let (_c, mut q) = connect(&a.t).await?;
        let nsid = a.t.nsid;
        let cdw10 = Cdw10 { action: a.racqa, iekey: a.iekey, rtype: a.rtype, cptpl: 0 };
        q.resv_acquire(nsid, cdw10, Keys { current: a.crkey, other: a.prkey }).await.map_err(|e| {
            plain(e, "Reservation Acquire", nsid, || match a.racqa {
                racqa::ACQUIRE => format!(
                    "namespace {nsid} is reserved already (by another host, or by this one with another type), or this host is not registered with key {:#x} (resv-report shows both)",
                    a.crkey
                ),
                _ => format!(
                    "no registrant of namespace {nsid} has key {:#x}, or this host is not registered with key {:#x} (resv-report shows the keys)",
                    a.prkey, a.crkey
                ),
            })
        })?;
        let what = match a.racqa {
            racqa::ACQUIRE => "acquired",
            racqa::PREEMPT => "preempted key",
            _ => "preempted (and aborted the commands of) key",
        };
        if a.racqa == racqa::ACQUIRE {
            println!("{what} a {} reservation on namespace {nsid}", type_name(a.rtype));
        } else {
            println!("{what} {:#x} on namespace {nsid} (this host holds the reservation, {}, if that was the holder's key)", a.prkey, type_name(a.rtype));
        }
        Ok(())
    })
}

pub fn release(a: ReleaseArgs) -> Result<()> {
    crate::runtime(Some(1))?.block_on(async {
        let (_c, mut q) = connect(&a.t).await?;
        let nsid = a.t.nsid;
        let cdw10 = Cdw10 { action: a.rrela, iekey: a.iekey, rtype: a.rtype, cptpl: 0 };
        q.resv_release(nsid, cdw10, a.crkey).await.map_err(|e| {
            let wrong_type = matches!(&e, Error::Status { status, .. } if (Status { dnr: false, ..*status }) == Status::INVALID_FIELD);
            if wrong_type && a.rrela == rrela::RELEASE && !a.iekey {
                let said = format!(
                    "--rtype {} ({}) is not the type of the reservation on namespace {nsid} (resv-report shows it)",
                    a.rtype,
                    type_name(a.rtype)
                );
                return anyhow::Error::new(Plain { said, detail: e.to_string() });
            }
            plain(e, "Reservation Release", nsid, || {
                format!("this host is not registered on namespace {nsid} with key {:#x} (resv-report shows the keys)", a.crkey)
            })
        })?;
        match a.rrela {
            rrela::CLEAR => println!("cleared the reservation and every registration of namespace {nsid}"),
            _ => println!("released namespace {nsid} (nothing to release unless this host held the reservation)"),
        }
        Ok(())
    })
}

pub fn report(a: ReportArgs) -> Result<()> {
    crate::runtime(Some(1))?.block_on(async {
        let (_c, mut q) = connect(&a.t).await?;
        let nsid = a.t.nsid;
        let r = q.resv_report(nsid).await.map_err(|e| plain(e, "Reservation Report", nsid, String::new))?;
        print_report(&r, a.output_format)
    })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// nvme-cli's layout and names (gen, rtype, regctl, ptpls; regctlext: cntlid, rcsts, rkey,
/// hostid).
fn print_report(r: &ReservationStatus, out: Output) -> Result<()> {
    if out == Output::Json {
        let regs: Vec<_> = r
            .registrants
            .iter()
            .map(|g| json!({"cntlid": g.cntlid, "rcsts": g.holder as u8, "rkey": g.rkey, "hostid": hex(&g.hostid)}))
            .collect();
        let v = json!({"gen": r.generation, "rtype": r.rtype, "regctl": r.regctl, "ptpls": r.ptpls as u8, "regctlext": regs});
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("NVME Reservation status:\n");
    println!("gen       : {}", r.generation);
    println!("rtype     : {} ({})", r.rtype, if r.rtype == 0 { "no reservation" } else { type_name(r.rtype) });
    println!("regctl    : {}", r.regctl);
    println!("ptpls     : {}", r.ptpls as u8);
    for (i, g) in r.registrants.iter().enumerate() {
        println!("regctlext[{i}] :");
        println!("  cntlid     : {:x}", g.cntlid);
        println!("  rcsts      : {:x}{}", g.holder as u8, if g.holder { " (holds the reservation)" } else { "" });
        println!("  rkey       : {:#x}", g.rkey);
        println!("  hostid     : {}", hex(&g.hostid));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each case: the parser, the text, and the value (None: refused).
    #[test]
    fn values_by_number_or_name() {
        type Parser = fn(&str) -> Result<u8, String>;
        let cases: &[(Parser, &str, Option<u8>)] = &[
            (rtype, "1", Some(1)),
            (rtype, "ea", Some(2)),
            (rtype, "EA-RO", Some(4)),
            (rtype, "exclusive-access-all-registrants", Some(6)),
            (rtype, "0", None),
            (rtype, "7", None),
            (rtype_or_none, "0", Some(0)),
            (acquire_action, "preempt-abort", Some(2)),
            (acquire_action, "1", Some(1)),
            (acquire_action, "3", None),
            (register_action, "replace", Some(2)),
            (release_action, "clear", Some(1)),
            (release_action, "2", None),
            (cptpl, "set", Some(3)),
            (cptpl, "1", None),
        ];
        for &(parse, s, want) in cases {
            assert_eq!(parse(s).ok(), want, "{s}");
        }
        assert_eq!(key("0xA1"), Ok(0xa1));
        assert_eq!(key("18446744073709551615"), Ok(u64::MAX));
        assert!(key("0x1_0000_0000_0000_0000").is_err() && key("-1").is_err() && key("").is_err());
        assert!(rtype("9").unwrap_err().contains("1 (write-exclusive, we)"));
    }
}
