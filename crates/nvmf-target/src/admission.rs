//! Which connections the target lets in: a total cap derived from the descriptor limit, a
//! per-address limit on connections that have not yet Connected, and the eviction of the
//! oldest of those when the cap is reached; then a per-address limit on connected queues
//! (docs/operations.md, "Limits").
//!
//! A connection holds a [`Ticket`] from accept to close. Until its Connect succeeds the
//! ticket is *waiting*: it counts against its source address and may be evicted (its
//! token fires) to make room for a newcomer. A host that has Connected is never evicted.
//! A Connect takes a [`QueueSlot`] of its address first ([`Ticket::queue_slot`]), held as
//! long as the queue, so that one address cannot hold the memory budget with idle queues
//! whatever host NQNs it claims.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

/// Why a new connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Its address already holds `limits.connections_per_address` connections that have
    /// not Connected.
    PerAddress,
    /// `limits.connections` are open and every one of them has Connected.
    Full,
}

pub struct Admission {
    cap: usize,
    per_address: usize,
    queues_per_address: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    open: usize,
    next: u64,
    /// Connections that have not Connected, oldest first: their address and token.
    waiting: BTreeMap<u64, (IpAddr, CancellationToken)>,
    per_address: HashMap<IpAddr, usize>,
    /// Connected queues per address.
    queues: HashMap<IpAddr, usize>,
}

impl State {
    fn unwait(&mut self, id: u64) -> Option<CancellationToken> {
        let (ip, token) = self.waiting.remove(&id)?;
        if let Some(n) = self.per_address.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                self.per_address.remove(&ip);
            }
        }
        Some(token)
    }
}

/// What admitting a connection did.
pub struct Admitted {
    pub ticket: Ticket,
    /// An older connection that had not Connected was evicted to make room.
    pub evicted: bool,
}

impl Admission {
    /// `cap` connections, `per_address` of one address before their Connect,
    /// `queues_per_address` connected queues of one address.
    pub fn new(cap: usize, per_address: usize, queues_per_address: usize) -> Arc<Admission> {
        Arc::new(Admission { cap, per_address, queues_per_address, state: Mutex::new(State::default()) })
    }

    /// Connected queues of `ip` now.
    pub fn queues(&self, ip: IpAddr) -> usize {
        self.state.lock().queues.get(&ip).copied().unwrap_or(0)
    }

    /// The total connection cap.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.state.lock().open
    }

    /// Connections open now that have not Connected.
    pub fn waiting(&self) -> usize {
        self.state.lock().waiting.len()
    }

    /// Lets a connection from `ip` in, evicting the oldest connection that has not
    /// Connected when the cap is reached, or refuses it.
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<Admitted, Refused> {
        let mut s = self.state.lock();
        if s.per_address.get(&ip).copied().unwrap_or(0) >= self.per_address {
            return Err(Refused::PerAddress);
        }
        let mut evicted = false;
        if s.open >= self.cap {
            // The evicted connection closes at its task's next turn; until then it still
            // counts in `open`, which the descriptor reserve covers (limits.rs).
            let Some(&oldest) = s.waiting.keys().next() else {
                return Err(Refused::Full);
            };
            if let Some(t) = s.unwait(oldest) {
                t.cancel();
            }
            evicted = true;
        }
        s.open += 1;
        s.next += 1;
        let id = s.next;
        let token = CancellationToken::new();
        s.waiting.insert(id, (ip, token.clone()));
        *s.per_address.entry(ip).or_default() += 1;
        Ok(Admitted { ticket: Ticket { admission: self.clone(), id, ip, token }, evicted })
    }
}

/// A connection's place among the open ones; released when dropped.
pub struct Ticket {
    admission: Arc<Admission>,
    id: u64,
    ip: IpAddr,
    token: CancellationToken,
}

impl Ticket {
    /// Fires when the connection is evicted before its Connect.
    pub fn evicted(&self) -> &CancellationToken {
        &self.token
    }

    /// The connection has Connected: it no longer counts against its address and is
    /// never evicted.
    pub fn connected(&self) {
        self.admission.state.lock().unwait(self.id);
    }

    /// A place among its address's connected queues, for a Connect; None when the address
    /// holds `limits.queues_per_address` of them.
    pub fn queue_slot(&self) -> Option<QueueSlot> {
        let mut s = self.admission.state.lock();
        let n = s.queues.entry(self.ip).or_default();
        if *n >= self.admission.queues_per_address {
            return None;
        }
        *n += 1;
        Some(QueueSlot { admission: self.admission.clone(), ip: self.ip })
    }
}

/// A connected queue's place among its address's; given back when dropped.
pub struct QueueSlot {
    admission: Arc<Admission>,
    ip: IpAddr,
}

impl Drop for QueueSlot {
    fn drop(&mut self) {
        let mut s = self.admission.state.lock();
        if let Some(n) = s.queues.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                s.queues.remove(&self.ip);
            }
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut s = self.admission.state.lock();
        s.unwait(self.id);
        s.open -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each case: (cap, per-address limit, [(address, connects?)]), then what admitting
    /// one more connection from 10.0.0.9 gives, and how many stay waiting.
    #[test]
    fn admission_table() {
        let a = |n: u8| IpAddr::from([10, 0, 0, n]);
        type Case = (usize, usize, Vec<(IpAddr, bool)>, IpAddr, Result<bool, Refused>, usize);
        let cases: Vec<Case> = vec![
            // Room: admitted, nothing evicted.
            (4, 4, vec![(a(1), false)], a(9), Ok(false), 2),
            // Full of connections that have not Connected: the oldest goes.
            (2, 4, vec![(a(1), false), (a(2), false)], a(9), Ok(true), 2),
            // Full of Connected hosts: refused, nobody is evicted.
            (2, 4, vec![(a(1), true), (a(2), true)], a(9), Err(Refused::Full), 0),
            // One address at its limit of waiting connections: refused for it...
            (8, 2, vec![(a(9), false), (a(9), false)], a(9), Err(Refused::PerAddress), 2),
            // ...but Connected ones do not count against it.
            (8, 2, vec![(a(9), true), (a(9), false)], a(9), Ok(false), 2),
        ];
        for (i, (cap, per, before, ip, want, waiting)) in cases.into_iter().enumerate() {
            let adm = Admission::new(cap, per, 8);
            let held: Vec<Ticket> = before
                .iter()
                .map(|&(ip, connects)| {
                    let t = adm.admit(ip).unwrap().ticket;
                    if connects {
                        t.connected();
                    }
                    t
                })
                .collect();
            let got = adm.admit(ip).map(|x| {
                let evicted = x.evicted;
                std::mem::forget(x.ticket);
                evicted
            });
            assert_eq!(got, want, "case {i}");
            assert_eq!(adm.waiting(), waiting, "case {i}");
            if want == Ok(true) {
                assert!(held[0].evicted().is_cancelled(), "case {i}: the oldest is evicted");
                assert!(!held[1].evicted().is_cancelled(), "case {i}: only the oldest");
            }
        }
        // Tickets give their place back when dropped.
        let adm = Admission::new(1, 1, 1);
        let t = adm.admit(a(1)).unwrap().ticket;
        t.connected();
        assert_eq!(adm.admit(a(2)).err(), Some(Refused::Full));
        drop(t);
        assert_eq!(adm.open(), 0);
        assert!(adm.admit(a(2)).is_ok());
    }

    /// Each case: the connected-queue limit and how many slots an address asks for; it
    /// gets the limit, another address is not affected, and a slot given back is free again.
    #[test]
    fn queue_slots_per_address() {
        let a = |n: u8| IpAddr::from([10, 0, 0, n]);
        for (limit, asks) in [(1, 3), (3, 3), (3, 10)] {
            let adm = Admission::new(16, 16, limit);
            let t = adm.admit(a(1)).unwrap().ticket;
            let mut held: Vec<QueueSlot> = (0..asks).filter_map(|_| t.queue_slot()).collect();
            assert_eq!(held.len(), limit.min(asks), "limit {limit}, {asks} asked");
            assert_eq!(adm.queues(a(1)), held.len());
            let other = adm.admit(a(2)).unwrap().ticket;
            assert!(other.queue_slot().is_some(), "limit {limit}: another address is refused");
            if held.len() == limit {
                assert!(t.queue_slot().is_none());
                held.pop();
                assert!(t.queue_slot().is_some(), "limit {limit}: a slot given back is not free");
            }
        }
    }
}
