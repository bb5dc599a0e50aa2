//! The discovery log page: one entry for every subsystem the host may connect to on
//! every I/O listener, plus the discovery subsystem itself on each discovery listener.

use std::net::SocketAddr;

use nearstore_wire::log::{disc, encode_discovery_log, DiscoveryEntry};

use crate::{limits, Target};

pub fn log_page(target: &Target, hostnqn: &str, local: Option<SocketAddr>) -> Vec<u8> {
    let mut entries = Vec::new();
    let ports = target.ports();
    for port in &ports {
        // A listener on 0.0.0.0 is reported with the address the host reached us on.
        let addr = match (port.advertise, port.addr.ip().is_unspecified(), local) {
            (Some(ip), _, _) => SocketAddr::new(ip, port.addr.port()),
            (None, true, Some(l)) => SocketAddr::new(l.ip(), port.addr.port()),
            _ => port.addr,
        };
        let base = DiscoveryEntry {
            trtype: disc::TRTYPE_TCP,
            adrfam: if addr.is_ipv4() { disc::ADRFAM_IPV4 } else { disc::ADRFAM_IPV6 },
            subtype: disc::SUBTYPE_NVME,
            // "Not specified" secure channel: libnvme reads "not required" as a TLS request.
            treq: disc::TREQ_DISABLE_SQFLOW,
            portid: port.id,
            cntlid: 0xffff,
            asqsz: limits::ADMIN_QUEUE_DEPTH_MAX,
            trsvcid: addr.port().to_string(),
            subnqn: String::new(),
            traddr: addr.ip().to_string(),
            sectype: 0,
        };
        if port.discovery {
            entries.push(DiscoveryEntry {
                subtype: disc::SUBTYPE_CURRENT_DISCOVERY,
                subnqn: nearstore_wire::DISCOVERY_NQN.into(),
                asqsz: limits::DISCOVERY_QUEUE_DEPTH_MAX,
                ..base
            });
            continue;
        }
        for sub in target.subsystems() {
            if sub.host_allowed(hostnqn) {
                entries.push(DiscoveryEntry { subnqn: sub.nqn.clone(), ..base.clone() });
            }
        }
    }
    encode_discovery_log(target.genctr(), &entries)
}
