//! nvme-cli-like verbs: target, discover, list, id-ctrl, id-ns, read, write.

use std::io::Write as _;
use std::path::Path;

use anyhow::{bail, Context, Result};
use nearstore_initiator::{ConnectOptions, Controller};
use nearstore_target::config::Config;
use nearstore_target::Target;
use serde_json::json;
use tracing::{error, info, warn};

use crate::{Output, Plain, TargetArgs};

/// The target's own address: its first I/O listener's, as bound (`bound`) or, before it
/// listens, as configured when its port is fixed (None on a port the kernel picks). With a
/// control plane, as registered: hosts reach it there (its advertised address). It is also
/// what tells this target's processes from another target's of the same member NQN
/// (docs/protocol.md, "Fence Host Instances"): set before the target listens when known (a
/// host's compute command may reach a peer at once), else once it listens.
fn own_address(cfg: &Config, bound: Option<std::net::SocketAddr>) -> Option<std::net::SocketAddr> {
    let l = cfg.listener.iter().find(|l| !l.discovery)?;
    let at = bound.unwrap_or(l.address);
    if at.port() == 0 {
        return None;
    }
    let ip = if cfg.control.is_some() { l.advertise.unwrap_or(at.ip()) } else { at.ip() };
    Some(std::net::SocketAddr::new(ip, at.port()))
}

/// Runs a target until SIGTERM or SIGINT; `file`: its configuration file, whose tenants a
/// SIGHUP reloads (docs/operations.md, "Tenants").
pub async fn run_target(cfg: Config, file: Option<std::path::PathBuf>) -> Result<()> {
    // Before saying it listens: a SIGTERM from then on (systemd's stop) flushes and exits 0.
    use tokio::signal::unix::{signal, SignalKind};
    let (mut term, mut int) = (signal(SignalKind::terminate())?, signal(SignalKind::interrupt())?);
    let mut hup = signal(SignalKind::hangup())?;
    // Pools are made (or checked) before the target opens them as its pool subsystem's
    // namespaces: a bad one stops it at start.
    let agent = cfg.control.as_deref().map(|c| crate::control::agent(&cfg, c)).transpose()?;
    let target = Target::from_config(&cfg)?;
    // Before it listens (a host's compute command may reach a peer at once), when its
    // address is known from its configuration (a fixed port): what tells this target's
    // processes from another target's of the same member NQN, its address as registered
    // (docs/protocol.md, "Fence Host Instances"). On a port the kernel picks, set below.
    if let Some(at) = own_address(&cfg, None) {
        nearstore_target::cluster::set_process_address(&at.to_string());
    }
    let addrs = target.listen_all(&cfg).await?;
    let own = own_address(&cfg, cfg.listener.iter().position(|l| !l.discovery).map(|i| addrs[i]));
    if let Some(at) = own {
        nearstore_target::cluster::set_process_address(&at.to_string());
    }
    if let Some(mut agent) = agent {
        agent.addr = own.context("the control plane needs an I/O listener")?.to_string();
        crate::control::feed(&agent, &target);
        let exporter = crate::control::Exporter {
            target: target.clone(),
            write_bound_ms: agent.write_bound_ms,
            client: agent.client.clone(),
            addr: agent.addr.clone(),
            cluster: cfg.cluster.clone(),
            volume: cfg.volume,
        };
        let tenants = crate::control::TenantWatch { target: target.clone(), client: agent.client.clone() };
        tokio::spawn(agent.run());
        tokio::spawn(exporter.run());
        tokio::spawn(tenants.run());
    }
    if let Some(m) = cfg.metrics {
        let l = tokio::net::TcpListener::bind(m).await.with_context(|| format!("metrics: cannot listen on {m}"))?;
        info!(addr = %m, "metrics at http://{m}/metrics");
        tokio::spawn(nearstore_target::metrics::serve(l, target.clone()));
    }
    for a in &addrs {
        println!("listening on {a}");
    }
    loop {
        tokio::select! {
            _ = int.recv() => break,
            _ = term.recv() => break,
            _ = hup.recv() => reload_tenants(&target, file.as_deref()),
        }
    }
    info!("stopping: flushing namespaces");
    target.flush_all();
    Ok(())
}

/// SIGHUP: the tenants of the configuration file again; an error is logged and changes
/// nothing. Reading and checking a file of a few kilobytes, on the runtime: not worth a
/// thread.
fn reload_tenants(target: &Target, file: Option<&Path>) {
    let Some(file) = file else {
        warn!("SIGHUP: no configuration file to reload tenants from (--config)");
        return;
    };
    match Config::from_file(file).map_err(anyhow::Error::from).and_then(|c| Ok(target.reload_tenants(&c)?)) {
        Ok(gone) => info!(file = %file.display(), controllers_torn_down = gone, "SIGHUP: tenants reloaded"),
        Err(e) => error!(file = %file.display(), "SIGHUP: tenants not reloaded: {e:#}"),
    }
}

async fn connect(t: &TargetArgs) -> Result<Controller> {
    connect_with(t.options()?).await
}

/// Connects with these options; a refused Connect said in the user's terms.
pub async fn connect_with(o: ConnectOptions) -> Result<Controller> {
    let what = format!("connecting to {} at {}", o.subnqn, o.addr);
    let (subnqn, hostnqn, addr) = (o.subnqn.clone(), o.hostnqn.clone(), o.addr);
    Controller::connect(o).await.map_err(|e| match plain_connect_error(&e, &subnqn, &hostnqn, addr) {
        Some(p) => anyhow::Error::new(p),
        None => anyhow::Error::new(e).context(what),
    })
}

/// A refused Connect in the user's terms: the subsystem does not exist there, or does not
/// let this host in. The NVMe status stays in the detail (-v).
pub fn plain_connect_error(e: &nearstore_initiator::Error, subnqn: &str, hostnqn: &str, addr: std::net::SocketAddr) -> Option<Plain> {
    use nearstore_wire::fabrics::connect;
    use nearstore_wire::Status;
    let nearstore_initiator::Error::Status { status, cqe, .. } = e else { return None };
    // The SUBNQN field's byte offset in the Connect data (NVMe over Fabrics, "Connect").
    const SUBNQN_OFFSET: u16 = 256;
    let status = Status { dnr: false, ..*status };
    let said = if status == Status::CONNECT_INVALID_PARAMETERS && cqe.dw0 == connect::invalid_param(true, SUBNQN_OFFSET) {
        format!("no such subsystem: {addr} serves no {subnqn} (`nearstore discover -a {}` lists what it serves)", addr.ip())
    } else if status == Status::CONNECT_INVALID_HOST {
        format!("{subnqn} at {addr} does not allow this host ({hostnqn}): add it to the subsystem's hosts, or give --hostnqn")
    } else {
        return None;
    };
    Some(Plain { said, detail: e.to_string() })
}

/// The host's DH-HMAC-CHAP secret and the controller's (`--dhchap-secret`,
/// `--dhchap-ctrl-secret`).
pub type Secrets = (Option<nearstore_dhchap::Secret>, Option<nearstore_dhchap::Secret>);

pub async fn discover(traddr: std::net::SocketAddr, hostnqn: Option<String>, secrets: Secrets, out: Output) -> Result<()> {
    let mut o = ConnectOptions::new(traddr, nearstore_wire::DISCOVERY_NQN);
    o.kato_ms = 0;
    (o.dhchap_secret, o.dhchap_ctrl_secret) = secrets;
    if let Some(h) = hostnqn {
        o.hostnqn = h;
    }
    let c = Controller::connect(o).await.with_context(|| format!("connecting to the discovery service at {traddr}"))?;
    let (genctr, entries) = c.discovery_log().await?;
    if out == Output::Json {
        let recs: Vec<_> = entries
            .iter()
            .map(|e| json!({"trtype": "tcp", "adrfam": if e.adrfam == 2 {"ipv6"} else {"ipv4"}, "subtype": e.subtype, "treq": e.treq, "portid": e.portid, "trsvcid": e.trsvcid, "subnqn": e.subnqn, "traddr": e.traddr}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&json!({"genctr": genctr, "numrec": entries.len(), "records": recs}))?);
        return Ok(());
    }
    println!("Discovery Log Number of Records {}, Generation counter {genctr}", entries.len());
    for (i, e) in entries.iter().enumerate() {
        let sub = match e.subtype {
            2 => "nvme subsystem",
            3 => "current discovery subsystem",
            _ => "discovery subsystem referral",
        };
        println!("=====Discovery Log Entry {i}======\ntrtype:  tcp\nadrfam:  ipv4\nsubtype: {sub}\ntreq:    {:#x}\nportid:  {}\ntrsvcid: {}\nsubnqn:  {}\ntraddr:  {}", e.treq, e.portid, e.trsvcid, e.subnqn, e.traddr);
    }
    Ok(())
}

pub async fn list(t: &TargetArgs, out: Output) -> Result<()> {
    let c = connect(t).await?;
    let mut rows = Vec::new();
    for nsid in c.active_namespaces().await? {
        let ns = c.identify_namespace(nsid).await?;
        rows.push((nsid, ns));
    }
    if out == Output::Json {
        let v: Vec<_> = rows
            .iter()
            .map(|(n, ns)| json!({"nsid": n, "blocks": ns.nsze, "block_size": ns.block_size(), "bytes": ns.nsze * ns.block_size() as u64}))
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({"subnqn": c.id.subnqn, "serial": c.id.sn, "model": c.id.mn, "namespaces": v}))?
        );
        return Ok(());
    }
    println!("{:<24} {:<20} {:<6} {:>16} {:>8}", "Subsystem", "SN", "NSID", "Usage", "Format");
    for (nsid, ns) in rows {
        let bytes = ns.nsze * ns.block_size() as u64;
        println!("{:<24} {:<20} {:<6} {:>13.2} GB {:>6} B", short(&c.id.subnqn, 24), c.id.sn, nsid, bytes as f64 / 1e9, ns.block_size());
    }
    Ok(())
}

fn short(s: &str, n: usize) -> String {
    if s.len() <= n {
        s.to_string()
    } else {
        format!("...{}", &s[s.len() - (n - 3)..])
    }
}

pub async fn id_ctrl(t: &TargetArgs, out: Output) -> Result<()> {
    let c = connect(t).await?;
    let id = &c.id;
    let v = json!({
        "vid": id.vid, "ssvid": id.ssvid, "sn": id.sn, "mn": id.mn, "fr": id.fr, "cntlid": id.cntlid,
        "ver": format!("{:#x}", id.ver), "mdts": id.mdts, "cntrltype": id.cntrltype, "aerl": id.aerl, "elpe": id.elpe,
        "kas": id.kas, "sqes": id.sqes, "cqes": id.cqes, "maxcmd": id.maxcmd, "nn": id.nn, "oncs": format!("{:#x}", id.oncs),
        "vwc": id.vwc, "sgls": format!("{:#x}", id.sgls), "subnqn": id.subnqn, "ioccsz": id.ioccsz, "iorcsz": id.iorcsz,
        "icdoff": id.icdoff, "msdbd": id.msdbd,
    });
    print_kv(&v, out)
}

pub async fn id_ns(t: &TargetArgs, nsid: u32, out: Output) -> Result<()> {
    let c = connect(t).await?;
    let ns = c.identify_namespace(nsid).await?;
    if ns.nsze == 0 {
        bail!("namespace {nsid} is not active in {}", c.id.subnqn);
    }
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let v = json!({
        "nsze": ns.nsze, "ncap": ns.ncap, "nuse": ns.nuse, "nsfeat": ns.nsfeat, "nlbaf": 0, "flbas": 0,
        "dlfeat": ns.dlfeat, "nmic": ns.nmic, "nguid": hex(&ns.nguid), "eui64": hex(&ns.eui64),
        "lbaf0": format!("ms:0 lbads:{} rp:0 (in use)", ns.lbads),
    });
    print_kv(&v, out)
}

/// A command a reservation refused, said so (docs/reservations.md); other errors as they are.
fn conflict(e: nearstore_initiator::Error, nsid: u32) -> anyhow::Error {
    match &e {
        nearstore_initiator::Error::Status { status, .. }
            if (nearstore_wire::Status { dnr: false, ..*status }) == nearstore_wire::Status::RESERVATION_CONFLICT =>
        {
            let said = format!("reservation conflict: namespace {nsid} is reserved, and this host may not do that (`nearstore resv-report -n {nsid}` shows the reservation)");
            anyhow::Error::new(Plain { said, detail: e.to_string() })
        }
        _ => e.into(),
    }
}

fn print_kv(v: &serde_json::Value, out: Output) -> Result<()> {
    if out == Output::Json {
        println!("{}", serde_json::to_string_pretty(v)?);
        return Ok(());
    }
    for (k, v) in v.as_object().expect("object") {
        let s = v.as_str().map(str::to_string).unwrap_or_else(|| v.to_string());
        println!("{k:<10}: {s}");
    }
    Ok(())
}

async fn block_size(c: &Controller, nsid: u32) -> Result<u32> {
    let ns = c.identify_namespace(nsid).await?;
    if ns.nsze == 0 {
        bail!("namespace {nsid} is not active in {}", c.id.subnqn);
    }
    Ok(ns.block_size())
}

pub async fn read(t: &TargetArgs, nsid: u32, slba: u64, bytes: u64, out: &Path) -> Result<()> {
    let c = connect(t).await?;
    let bs = block_size(&c, nsid).await?;
    let mut q = c.io_queue(1).await?;
    // The queue's transfer limit: the target's MDTS, bounded by the initiator's.
    let chunk_blocks = (q.queue().options().max_transfer as u64 / bs as u64).max(1);
    let total_blocks = bytes.div_ceil(bs as u64);
    let mut w: Box<dyn std::io::Write> = if out == Path::new("-") {
        Box::new(std::io::stdout().lock())
    } else {
        Box::new(std::io::BufWriter::new(std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?))
    };
    let mut done = 0u64;
    while done < total_blocks {
        let n = (total_blocks - done).min(chunk_blocks);
        let d = q.read(nsid, slba + done, n as u32, bs).await.map_err(|e| conflict(e, nsid))?;
        let keep = ((bytes - done * bs as u64).min(d.len() as u64)) as usize;
        w.write_all(&d[..keep])?;
        done += n;
    }
    w.flush()?;
    Ok(())
}

pub async fn write(t: &TargetArgs, nsid: u32, slba: u64, input: &Path, fua: bool) -> Result<()> {
    let data = std::fs::read(input).with_context(|| format!("reading {}", input.display()))?;
    if data.is_empty() {
        bail!("{} is empty: nothing to write", input.display());
    }
    let c = connect(t).await?;
    let bs = block_size(&c, nsid).await? as usize;
    let mut q = c.io_queue(1).await?;
    let chunk = q.queue().options().max_transfer / bs * bs;
    if chunk == 0 {
        bail!("the controller's transfer limit ({} bytes) is below one {bs}-byte block", q.queue().options().max_transfer);
    }
    for (i, part) in data.chunks(chunk).enumerate() {
        let mut buf = part.to_vec();
        buf.resize(part.len().div_ceil(bs) * bs, 0);
        q.write(nsid, slba + (i * chunk / bs) as u64, &buf, bs as u32, fua).await.map_err(|e| conflict(e, nsid))?;
    }
    q.flush(nsid).await.map_err(|e| conflict(e, nsid))?;
    eprintln!("wrote {} bytes at LBA {slba} of namespace {nsid}", data.len());
    Ok(())
}

/// Compare and Write of one command's blocks at `slba`: `data`'s bytes written only if the
/// blocks hold `compare`'s (both padded with zeros to whole blocks).
pub async fn compare_and_write(t: &TargetArgs, nsid: u32, slba: u64, compare: &Path, data: &Path, fua: bool) -> Result<()> {
    let read = |p: &Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let (mut cmp, mut new) = (read(compare)?, read(data)?);
    if cmp.is_empty() || cmp.len() != new.len() {
        bail!("--compare has {} bytes and --data {}: both must have the same, more than none", cmp.len(), new.len());
    }
    let c = connect(t).await?;
    let bs = block_size(&c, nsid).await? as usize;
    let mut q = c.io_queue(1).await?;
    let len = cmp.len().div_ceil(bs) * bs;
    if len > q.queue().options().max_transfer {
        bail!("{len} bytes of blocks: more than one command carries ({} bytes)", q.queue().options().max_transfer);
    }
    cmp.resize(len, 0);
    new.resize(len, 0);
    let r = q.compare_and_write(nsid, slba, &cmp, &new, bs as u32, fua).await.map_err(|e| conflict(e, nsid))?;
    if r.differed() {
        bail!("the blocks at LBA {slba} of namespace {nsid} differ from {}: nothing written", compare.display());
    }
    if !r.written() {
        bail!("Compare and Write at LBA {slba} of namespace {nsid} failed: Compare {}, Write {}", r.compare, r.write);
    }
    eprintln!("compared and wrote {len} bytes at LBA {slba} of namespace {nsid}");
    Ok(())
}

/// A new DH-HMAC-CHAP secret, as nvme-cli's gen-dhchap-key: `hmac` 0 to 3 (the
/// transformation), `key_length` 32, 48 or 64 (default 32, or the hash's length), `nqn` the
/// one a transformed key is made for (default: this host's, nearstore_initiator::host).
pub fn gen_dhchap_key(hmac: u8, key_length: Option<&str>, nqn: Option<String>) -> Result<nearstore_dhchap::Secret> {
    let hash = nearstore_dhchap::Hash::from_id(hmac);
    let len = match key_length {
        Some(l) => l.parse::<usize>().with_context(|| format!("--key-length {l}"))?,
        None => hash.map_or(32, nearstore_dhchap::Hash::len),
    };
    let nqn = match nqn {
        Some(n) => n,
        None => nearstore_initiator::host::resolve(None, None)?.hostnqn,
    };
    nearstore_dhchap::Secret::generate(hash, len, &nqn).map_err(|e| anyhow::anyhow!("--hmac {hmac} --key-length {len}: {e}"))
}
