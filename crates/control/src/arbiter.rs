//! The arbiter: Flint's bandwidth auction (seed 003), dividing each pool's bandwidth among
//! the clients active on it (docs/fair-io.md, "The arbiter").
//!
//! A client is one tenant of one exporting target on one pool: the volumes a target exports
//! reach pools of this target and of its peers, and a peer's pool subsystem sees every
//! exporter's I/O as the one `cluster` tenant, so only here are the tenants of all exporters
//! seen together. Every `ARBITER_PERIOD_MS` each target sends its request to send (RTS,
//! [`BandwidthRequest`]): per pool and tenant the cost bytes per second it offered in its
//! last period, and whether some of them had to wait for their grant. The reply (CTS,
//! [`BandwidthGrants`]) grants each a rate, which the target enforces at its side of the
//! pool (`nearstore_target::dev::grant`) until the next one or until it expires.
//!
//! The division is deficit round robin over one period's bandwidth, handed out in slices:
//! each round every client still wanting more gets a quantum of a slice times its weight
//! over the largest weight, until the bandwidth is spent or every demand met; what is left
//! then goes to all clients by weight (a backlogged client can grow into it at once, and the
//! pool stays work conserving). A client that may want more than it got (it waited for its
//! grant, had none yet, or moved at least 80% of it: its operations may be waiting in the
//! pool's own queue, which the exporter cannot see) demands as much as it may have, its
//! weighted share; one that moved less demands twice what it moved (and at least half its
//! grant: a grant at most halves in a period), room to grow, and the rest of its share goes
//! to the others. Demands read this way are stable: a client held
//! back downstream to 60% of its grant still demands more than its share, and keeps it.
//! A tenant exported by several targets is one share on the pool: its weight is split
//! among its clients there.
//!
//! The arbiter's books are soft state, in memory: a restarted control plane learns every
//! demand again within a period. Clients not heard from for `ARBITER_CLIENT_TTL_MS` are
//! forgotten, and a request names all its target's demands, so a target's clients on pools
//! it no longer mentions go at once.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::limits::*;
use crate::model::*;

/// A pool as a volume's extents name it: its target's address and its namespace there.
pub type PoolKey = (String, u32);

/// What the control plane's records say of a pool's bandwidth.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capacity {
    /// Cost bytes per second; 0: not declared.
    pub bandwidth: u64,
    pub write_cost: f64,
}

#[derive(Debug, Clone)]
struct Client {
    weight: u32,
    /// Cost bytes per second, as the target measured them.
    offered: u64,
    backlogged: bool,
    /// The grant it was last told, bytes per second (0: none yet).
    granted: u64,
    seen_ms: u64,
}

impl Client {
    /// What it asks of the division: as much as it may have, when it may want more than
    /// it got (it waited for its grant, or had none yet, or moved at least
    /// ARBITER_SATURATED_PERCENT of it: its operations may have waited further on, in the
    /// pool's own queue); else twice what it moved, so that a client whose operations were
    /// held back downstream, moving less than its grant for it, is not taken at its word
    /// and shrunk period after period.
    fn demand(&self) -> u64 {
        let saturated = self.offered as u128 * 100 >= self.granted as u128 * ARBITER_SATURATED_PERCENT as u128;
        if self.backlogged || self.granted == 0 || saturated {
            u64::MAX / 4
        } else {
            // At most halved a period: a client whose commands a pool's queue held back
            // for a while is not shrunk to nothing meanwhile.
            self.offered.max(ARBITER_SLICE_BYTES_MIN).saturating_mul(2).max(self.granted / 2)
        }
    }
}

/// The books of the pools: clients by (requesting target, tenant).
#[derive(Debug, Default)]
pub struct Arbiter {
    books: HashMap<PoolKey, BTreeMap<(String, String), Client>>,
    /// The pools each requester has clients on.
    by_requester: HashMap<String, BTreeSet<PoolKey>>,
    /// Each requester's cluster NQN, as its last request said.
    members: HashMap<String, String>,
}

fn invalid(m: String) -> ApiError {
    ApiError::new(ErrorCode::InvalidArgument, m)
}

impl Arbiter {
    pub fn new() -> Arbiter {
        Arbiter::default()
    }

    /// Clients active on a pool.
    pub fn clients(&self, pool: &PoolKey) -> usize {
        self.books.get(pool).map_or(0, |b| b.len())
    }

    /// Takes `req` (every demand of its target) at `now_ms` and returns the target's grants.
    /// `capacity` gives a pool's declared bandwidth, None for a pool the control plane does
    /// not know. A demand the books have no room for gets no grant: its target keeps
    /// to its local fair sharing for it.
    pub fn request(
        &mut self,
        now_ms: u64,
        req: &BandwidthRequest,
        capacity: impl Fn(&PoolKey) -> Option<Capacity>,
    ) -> Result<BandwidthGrants, ApiError> {
        if req.target.is_empty() || req.target.len() > NAME_BYTES_MAX {
            return Err(invalid(format!("target must be 1 to {NAME_BYTES_MAX} bytes")));
        }
        if req.demands.len() > ARBITER_DEMANDS_MAX {
            return Err(ApiError::new(
                ErrorCode::LimitExceeded,
                format!("{} demands: a request carries {ARBITER_DEMANDS_MAX}", req.demands.len()),
            ));
        }
        if req.member.len() > NQN_BYTES_MAX {
            return Err(invalid(format!("member must be at most {NQN_BYTES_MAX} bytes")));
        }
        let mut named = BTreeSet::new();
        for d in &req.demands {
            if d.tenant.is_empty() || d.tenant.len() > NQN_BYTES_MAX + 5 {
                return Err(invalid(format!("tenant must be 1 to {} bytes", NQN_BYTES_MAX + 5)));
            }
            if d.pool_target.is_empty() || d.pool_target.len() > NAME_BYTES_MAX {
                return Err(invalid(format!("pool target must be 1 to {NAME_BYTES_MAX} bytes")));
            }
            if !(1..=TENANT_WEIGHT_MAX).contains(&d.weight) {
                return Err(invalid(format!("tenant '{}': weight {} is not 1 to {TENANT_WEIGHT_MAX}", d.tenant, d.weight)));
            }
            if !named.insert((d.pool_target.as_str(), d.nsid, d.tenant.as_str())) {
                return Err(invalid(format!("tenant '{}' on pool {} of {} is asked for twice", d.tenant, d.nsid, d.pool_target)));
            }
        }
        // The request is all its target wants: its clients on pools it no longer names go.
        let mut pools: BTreeSet<PoolKey> = req.demands.iter().map(|d| (d.pool_target.clone(), d.nsid)).collect();
        let before = self.by_requester.remove(&req.target).unwrap_or_default();
        for pool in &before {
            if let Some(book) = self.books.get_mut(pool) {
                book.retain(|(t, tenant), _| t != &req.target || named.contains(&(pool.0.as_str(), pool.1, tenant.as_str())));
            }
        }
        pools.extend(before);
        for pool in &pools {
            if let Some(book) = self.books.get_mut(pool) {
                book.retain(|_, c| c.seen_ms + ARBITER_CLIENT_TTL_MS >= now_ms);
                if book.is_empty() {
                    self.books.remove(pool);
                }
            }
        }
        let mut mine = BTreeSet::new();
        for d in &req.demands {
            let pool = (d.pool_target.clone(), d.nsid);
            if !self.books.contains_key(&pool) && self.books.len() >= ARBITER_POOLS_MAX {
                continue;
            }
            let book = self.books.entry(pool.clone()).or_default();
            let key = (req.target.clone(), d.tenant.clone());
            if !book.contains_key(&key) && book.len() >= ARBITER_CLIENTS_PER_POOL_MAX {
                continue;
            }
            let c = book.entry(key).or_insert(Client { weight: d.weight, offered: 0, backlogged: false, granted: 0, seen_ms: now_ms });
            c.weight = d.weight;
            c.offered = d.wanted_bps;
            c.backlogged = d.backlogged;
            c.seen_ms = now_ms;
            mine.insert(pool);
        }
        let mut grants = Vec::new();
        for pool in &mine {
            let Some(book) = self.books.get_mut(pool) else { continue };
            let cap = capacity(pool);
            let declared = cap.filter(|c| c.bandwidth > 0);
            let write_cost = cap.map_or(1.0, |c| if c.write_cost >= 1.0 { c.write_cost } else { 1.0 });
            let clients = book.len() as u32;
            let shares = declared.map(|c| divide(c.bandwidth / 100 * ARBITER_SHARE_PERCENT, &weights(book)));
            for (i, ((target, tenant), c)) in book.iter_mut().enumerate() {
                if target != &req.target {
                    continue;
                }
                // What it was told: what its next offer is measured against.
                let bps = shares.as_ref().map(|s| s[i]);
                c.granted = bps.unwrap_or(0);
                let pool_bps = shares.as_ref().map_or(0, |s| s.iter().sum());
                grants.push(BandwidthGrant {
                    pool_bps,
                    pool_target: pool.0.clone(),
                    nsid: pool.1,
                    tenant: tenant.clone(),
                    bps,
                    batch_bytes: bps.map_or(0, batch_bytes),
                    write_cost,
                    clients,
                });
            }
        }
        self.by_requester.insert(req.target.clone(), mine);
        if req.member.is_empty() {
            self.members.remove(&req.target);
        } else {
            self.members.insert(req.target.clone(), req.member.clone());
        }
        let peers = self.peers_of(now_ms, &req.target);
        Ok(BandwidthGrants { period_ms: ARBITER_PERIOD_MS, ttl_ms: ARBITER_GRANT_TTL_MS, grants, peers })
    }

    /// For each pool of `target`, what each other exporter's clients there were last
    /// granted together, by the exporter's cluster NQN (exporters that named none apart).
    fn peers_of(&self, now_ms: u64, target: &str) -> Vec<PeerGrant> {
        let mut out = Vec::new();
        for (pool, book) in self.books.iter().filter(|(p, _)| p.0 == target) {
            let (mut by, mut pool_bps): (BTreeMap<&str, u64>, u64) = (BTreeMap::new(), 0);
            for ((exporter, _), c) in book.iter().filter(|(_, c)| c.seen_ms + ARBITER_CLIENT_TTL_MS >= now_ms) {
                pool_bps += c.granted;
                if let Some(m) = self.members.get(exporter).filter(|_| exporter != target) {
                    *by.entry(m.as_str()).or_default() += c.granted;
                }
            }
            out.extend(by.into_iter().map(|(member, bps)| PeerGrant { nsid: pool.1, member: member.to_string(), bps, pool_bps }));
        }
        out.sort_by(|a, b| (a.nsid, &a.member).cmp(&(b.nsid, &b.member)));
        out
    }
}

/// Each client's weight (a tenant's weight split among its clients on the pool) and demand.
fn weights(book: &BTreeMap<(String, String), Client>) -> Vec<(f64, u64)> {
    let mut per_tenant: HashMap<&str, u32> = HashMap::new();
    for (_, tenant) in book.keys() {
        *per_tenant.entry(tenant).or_default() += 1;
    }
    book.iter().map(|((_, tenant), c)| (c.weight as f64 / per_tenant[tenant.as_str()] as f64, c.demand())).collect()
}

/// A grant's batch: the bytes its target may let go at once, ARBITER_BATCH_MS of its rate
/// and at least a slice.
pub fn batch_bytes(bps: u64) -> u64 {
    (bps / 1000 * ARBITER_BATCH_MS).max(ARBITER_SLICE_BYTES_MIN)
}

/// Divides `bandwidth` among clients of (weight, demand) by deficit round robin in slices;
/// what is left when every demand is met goes to all by weight. Returns each one's share;
/// the shares add up to the bandwidth (but for rounding down), and none is larger than a
/// demand while another client's demand is unmet.
pub fn divide(bandwidth: u64, clients: &[(f64, u64)]) -> Vec<u64> {
    divide_counting(bandwidth, clients).0
}

/// [`divide`], and the rounds it took.
fn divide_counting(bandwidth: u64, clients: &[(f64, u64)]) -> (Vec<u64>, u64) {
    let n = clients.len();
    let mut rounds = 0;
    let mut share = vec![0u64; n];
    if n == 0 {
        return (share, 0);
    }
    let slice = (bandwidth / ARBITER_SLICES_MAX).max(ARBITER_SLICE_BYTES_MIN) as f64;
    let mut deficit = vec![0f64; n];
    let mut left = bandwidth;
    while left > 0 {
        // The heaviest wanting client's quantum is one slice: no quantum is larger than
        // what is divided, and each round hands out at least a slice or meets a demand, so
        // a division takes at most ARBITER_SLICES_MAX rounds and one a client.
        let most = clients.iter().enumerate().filter(|(i, c)| c.1 > share[*i]).map(|(_, c)| c.0).fold(0.0, f64::max);
        if most <= 0.0 {
            break;
        }
        rounds += 1;
        let mut wanting = false;
        for (i, &(w, want)) in clients.iter().enumerate() {
            let unmet = want.saturating_sub(share[i]);
            if unmet == 0 || left == 0 {
                continue;
            }
            wanting = true;
            deficit[i] += slice * w / most;
            let take = (deficit[i] as u64).min(unmet).min(left);
            share[i] += take;
            deficit[i] -= take as f64;
            left -= take;
        }
        if !wanting {
            break;
        }
    }
    let total: f64 = clients.iter().map(|c| c.0).sum();
    if left > 0 && total > 0.0 {
        for (i, &(w, _)) in clients.iter().enumerate() {
            share[i] += (left as f64 * w / total) as u64;
        }
    }
    (share, rounds)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn demand(pool: &str, tenant: &str, weight: u32, bps: u64, backlogged: bool) -> Demand {
        Demand { pool_target: pool.into(), nsid: 1, tenant: tenant.into(), weight, wanted_bps: bps, backlogged }
    }

    fn req(target: &str, demands: Vec<Demand>) -> BandwidthRequest {
        BandwidthRequest { target: target.into(), demands, member: format!("nqn.m:{target}") }
    }

    fn cap(bw: u64) -> impl Fn(&PoolKey) -> Option<Capacity> {
        move |p: &PoolKey| (p.0 != "unknown").then_some(Capacity { bandwidth: bw, write_cost: 2.0 })
    }

    /// What the arbiter divides of a pool of `bw`.
    fn share(bw: u64) -> u64 {
        bw / 100 * ARBITER_SHARE_PERCENT
    }

    fn bps(g: &BandwidthGrants, tenant: &str) -> u64 {
        g.grants.iter().find(|g| g.tenant == tenant).and_then(|g| g.bps).expect("a grant")
    }

    #[test]
    fn division_follows_weights_and_demands() {
        // Equal weights, both wanting everything: halves.
        assert_eq!(divide(100 * MIB, &[(1.0, u64::MAX), (1.0, u64::MAX)]), vec![50 * MIB, 50 * MIB]);
        // 2:1 weights.
        let s = divide(90 * MIB, &[(200.0, u64::MAX), (100.0, u64::MAX)]);
        assert!((s[0] as f64 / 90.0 / MIB as f64 - 2.0 / 3.0).abs() < 0.01, "{s:?}");
        assert!(s.iter().sum::<u64>() <= 90 * MIB);
        // A client wanting less than its share gets it; the rest goes to the other.
        let s = divide(100 * MIB, &[(1.0, 10 * MIB), (1.0, u64::MAX)]);
        assert_eq!(s[0], 10 * MIB);
        assert_eq!(s[1], 90 * MIB);
        // Every demand met: the surplus goes to all by weight.
        let s = divide(100 * MIB, &[(3.0, 10 * MIB), (1.0, 10 * MIB)]);
        assert_eq!(s, vec![10 * MIB + 60 * MIB, 10 * MIB + 20 * MIB]);
        // Nobody, or a bandwidth smaller than a slice.
        assert!(divide(MIB, &[]).is_empty());
        let s = divide(1000, &[(1.0, u64::MAX), (1.0, u64::MAX)]);
        assert!(s.iter().sum::<u64>() <= 1000 && s[0] + s[1] >= 999, "{s:?}");
        // The largest weights against the smallest, a bandwidth of a TiB: exact.
        let s = divide(1 << 40, &[(10_000.0, u64::MAX), (1.0, u64::MAX)]);
        assert!(s[1] > 0 && (s[0] as f64 / s[1] as f64 - 10_000.0).abs() < 10.0, "{s:?}");
        // The heavy one met at once, the light one wanting the rest: it gets it in few
        // rounds (a division that took a round per 1/10000 of a slice would not end here).
        let (s, rounds) = divide_counting(1 << 40, &[(10_000.0, 1), (1.0, u64::MAX)]);
        assert_eq!(s[0] + s[1], 1 << 40, "{s:?}");
        assert!(rounds <= ARBITER_SLICES_MAX + 2, "{rounds} rounds");
    }

    #[test]
    fn two_targets_share_a_pool_by_their_tenants_weights() {
        let mut a = Arbiter::new();
        let now = 1_000;
        // Tenant heavy through target A, light through target B, both on pool P1@A.
        let ga = a.request(now, &req("A", vec![demand("A", "heavy", 300, 40 * MIB, true)]), cap(64 * MIB)).unwrap();
        assert_eq!(bps(&ga, "heavy"), share(64 * MIB), "alone, it gets all the arbiter divides");
        assert_eq!(ga.grants[0].pool_bps, share(64 * MIB));
        let gb = a.request(now + 10, &req("B", vec![demand("A", "light", 100, 40 * MIB, true)]), cap(64 * MIB)).unwrap();
        let ga = a.request(now + 20, &req("A", vec![demand("A", "heavy", 300, 40 * MIB, true)]), cap(64 * MIB)).unwrap();
        let (h, l) = (bps(&ga, "heavy"), bps(&gb, "light"));
        assert!((h as f64 / share(64 * MIB) as f64 - 0.75).abs() < 0.01, "heavy {h}");
        assert!((l as f64 / share(64 * MIB) as f64 - 0.25).abs() < 0.01, "light {l}");
        assert!(ga.grants[0].pool_bps >= h + l - 2 && ga.grants[0].pool_bps <= share(64 * MIB));
        assert_eq!(ga.grants[0].clients, 2);
        assert_eq!(ga.grants[0].write_cost, 2.0);
        assert_eq!(ga.grants[0].batch_bytes, batch_bytes(h));
        assert_eq!((ga.period_ms, ga.ttl_ms), (ARBITER_PERIOD_MS, ARBITER_GRANT_TTL_MS));
    }

    /// The pool's own target learns, for each pool of its own, what each other exporter's
    /// tenants were granted there together, by the exporter's cluster NQN: its scheduler
    /// weighs each exporter's operations by it. Also when it has no demand of its own there;
    /// an exporter whose clients went quiet, or that named no NQN, is left out.
    #[test]
    fn the_pools_target_learns_each_exporters_grants_on_its_pools() {
        let mut a = Arbiter::new();
        let now = 1_000;
        a.request(now, &req("B", vec![demand("A", "t1", 100, 40 * MIB, true), demand("A", "t2", 100, 40 * MIB, true)]), cap(64 * MIB))
            .unwrap();
        let gc = a.request(now + 10, &req("C", vec![demand("A", "t3", 400, 40 * MIB, true)]), cap(64 * MIB)).unwrap();
        let gb = a
            .request(
                now + 20,
                &req("B", vec![demand("A", "t1", 100, 40 * MIB, true), demand("A", "t2", 100, 40 * MIB, true)]),
                cap(64 * MIB),
            )
            .unwrap();
        assert!(gb.peers.is_empty() && gc.peers.is_empty(), "B and C have no pools");
        let ga = a.request(now + 30, &req("A", vec![]), cap(64 * MIB)).unwrap();
        assert!(ga.grants.is_empty());
        let b = bps(&gb, "t1") + bps(&gb, "t2");
        let c = bps(&gc, "t3");
        let want = vec![
            PeerGrant { nsid: 1, member: "nqn.m:B".into(), bps: b, pool_bps: b + c },
            PeerGrant { nsid: 1, member: "nqn.m:C".into(), bps: c, pool_bps: b + c },
        ];
        assert_eq!(ga.peers, want);
        assert!(b > 0 && c > 0);
        // C named no NQN in its last request: left out; B quiet past the clients' time to live: too.
        let mut anon = req("C", vec![demand("A", "t3", 400, 40 * MIB, true)]);
        anon.member.clear();
        a.request(now + 40, &anon, cap(64 * MIB)).unwrap();
        let ga = a.request(now + 50, &req("A", vec![]), cap(64 * MIB)).unwrap();
        assert_eq!(ga.peers.iter().map(|p| p.member.as_str()).collect::<Vec<_>>(), vec!["nqn.m:B"]);
        let ga = a.request(now + 50 + ARBITER_CLIENT_TTL_MS + 21, &req("A", vec![]), cap(64 * MIB)).unwrap();
        assert!(ga.peers.iter().all(|p| p.member != "nqn.m:B"), "{:?}", ga.peers);
        let long = BandwidthRequest { member: "n".repeat(NQN_BYTES_MAX + 1), ..req("A", vec![]) };
        assert_eq!(a.request(now, &long, cap(64 * MIB)).unwrap_err().code, ErrorCode::InvalidArgument);
    }

    #[test]
    fn a_tenant_through_two_targets_is_one_share() {
        let mut a = Arbiter::new();
        let d = |t: &str| demand("P", t, 100, u64::MAX / 4, true);
        a.request(0, &req("A", vec![d("x")]), cap(90 * MIB)).unwrap();
        a.request(0, &req("B", vec![d("x")]), cap(90 * MIB)).unwrap();
        let gc = a.request(0, &req("C", vec![d("y")]), cap(90 * MIB)).unwrap();
        let ga = a.request(0, &req("A", vec![d("x")]), cap(90 * MIB)).unwrap();
        let gb = a.request(0, &req("B", vec![d("x")]), cap(90 * MIB)).unwrap();
        let (xa, xb, y) = (bps(&ga, "x"), bps(&gb, "x"), bps(&gc, "y"));
        assert!((y as f64 / (xa + xb) as f64 - 1.0).abs() < 0.02, "x {xa}+{xb}, y {y}");
    }

    #[test]
    fn idle_and_withdrawn_clients_are_forgotten() {
        let mut a = Arbiter::new();
        let pool = ("P".to_string(), 1);
        a.request(0, &req("A", vec![demand("P", "x", 100, MIB, true)]), cap(64 * MIB)).unwrap();
        a.request(0, &req("B", vec![demand("P", "y", 100, MIB, true)]), cap(64 * MIB)).unwrap();
        assert_eq!(a.clients(&pool), 2);
        // A names P no more: its client goes at once.
        a.request(50, &req("A", vec![]), cap(64 * MIB)).unwrap();
        assert_eq!(a.clients(&pool), 1);
        a.request(60, &req("A", vec![demand("P", "x", 100, MIB, true)]), cap(64 * MIB)).unwrap();
        assert_eq!(a.clients(&pool), 2);
        // B falls silent: past the client TTL, A is alone.
        let g = a.request(60 + ARBITER_CLIENT_TTL_MS + 1, &req("A", vec![demand("P", "x", 100, MIB, true)]), cap(64 * MIB)).unwrap();
        assert_eq!(a.clients(&pool), 1);
        assert_eq!(bps(&g, "x"), share(64 * MIB));
        assert_eq!(g.grants[0].clients, 1);
    }

    #[test]
    fn a_pool_without_a_bandwidth_is_not_divided() {
        let mut a = Arbiter::new();
        let g = a.request(0, &req("A", vec![demand("P", "x", 100, MIB, true), demand("unknown", "x", 100, MIB, false)]), cap(0)).unwrap();
        assert_eq!(g.grants.len(), 2);
        assert!(g.grants.iter().all(|g| g.bps.is_none() && g.batch_bytes == 0), "{g:?}");
    }

    #[test]
    fn a_client_that_may_want_more_demands_twice_what_it_got() {
        let mut a = Arbiter::new();
        let all = share(64 * MIB);
        // y alone, new: all the arbiter divides. It moved 1 MiB/s of it (under 80%): it
        // demands twice that; x, new, may want more: it demands all it may have, and gets
        // all y leaves.
        let g = a.request(0, &req("B", vec![demand("P", "y", 100, MIB, false)]), cap(64 * MIB)).unwrap();
        assert_eq!(bps(&g, "y"), all);
        let g = a.request(0, &req("A", vec![demand("P", "x", 100, MIB, true)]), cap(64 * MIB)).unwrap();
        // (y's demand: twice what it moved, at least half its grant.)
        let y = (2 * MIB).max(all / 2);
        let near = |got: u64, want: u64| assert!(got.abs_diff(want) <= want / 500, "{got} is not {want}");
        near(bps(&g, "x"), all - y);
        // x moved over 80% of its grant: it still demands all it may have.
        let told = bps(&g, "x");
        let g = a.request(100, &req("A", vec![demand("P", "x", 100, told * 9 / 10, false)]), cap(64 * MIB)).unwrap();
        near(bps(&g, "x"), all - y);
        // Then it moves a tenth of that: it demands twice what it moved, or half its grant
        // (a grant at most halves a period); the rest goes to both by weight.
        let told = bps(&g, "x");
        let g = a.request(200, &req("A", vec![demand("P", "x", 100, told / 10, false)]), cap(64 * MIB)).unwrap();
        let x = (told / 5).max(told / 2);
        near(bps(&g, "x"), x + (all - x - y) / 2);
        // A pool saturated below the gates: neither waits at its gate, each moves what the
        // pool's own scheduler lets through (equal shares there: one tenant is the peer's
        // `cluster`), at most its grant. The division comes to follow the weights, not what
        // each happened to move. (Each is told its grant at its own request, so while
        // demands change the grants told may add up to more than the bandwidth for a
        // period: the pool's own scheduler holds the sum meanwhile.)
        let pool = |h: u64, l: u64| -> (u64, u64) {
            let half = 14 * MIB;
            match (h < half, l < half) {
                (true, _) => (h, l.min(28 * MIB - h)),
                (_, true) => (h.min(28 * MIB - l), l),
                _ => (half, half),
            }
        };
        let mut a = Arbiter::new();
        let (mut h, mut l) = (u64::MAX, u64::MAX);
        for round in 0..6 {
            let (mh, ml) = pool(h, l);
            let gl = a.request(0, &req("A", vec![demand("P", "light", 100, ml, false)]), cap(28 * MIB)).unwrap();
            let gh = a.request(0, &req("B", vec![demand("P", "heavy", 300, mh, false)]), cap(28 * MIB)).unwrap();
            (h, l) = (bps(&gh, "heavy"), bps(&gl, "light"));
            if round >= 3 {
                assert!(h + l <= share(28 * MIB), "round {round}: heavy {h}, light {l}");
                assert!((h as f64 / (h + l) as f64 - 0.75).abs() < 0.02, "round {round}: heavy {h}, light {l}");
                assert_eq!(pool(h, l), (h, l), "round {round}: the pool moves the grants");
            }
        }
    }

    #[test]
    fn bad_requests_are_refused_with_their_reason() {
        let mut a = Arbiter::new();
        let cases = [
            (req("", vec![]), ErrorCode::InvalidArgument, "target"),
            (req("A", vec![demand("P", "x", 0, MIB, false)]), ErrorCode::InvalidArgument, "weight 0"),
            (req("A", vec![demand("P", "x", TENANT_WEIGHT_MAX + 1, MIB, false)]), ErrorCode::InvalidArgument, "weight 10001"),
            (req("A", vec![demand("P", "", 1, MIB, false)]), ErrorCode::InvalidArgument, "tenant must be"),
            (req("A", vec![demand("", "x", 1, MIB, false)]), ErrorCode::InvalidArgument, "pool target"),
            (req("A", vec![demand("P", "x", 1, MIB, false), demand("P", "x", 2, MIB, false)]), ErrorCode::InvalidArgument, "twice"),
            (
                req("A", (0..=ARBITER_DEMANDS_MAX).map(|i| demand("P", &format!("t{i}"), 1, MIB, false)).collect()),
                ErrorCode::LimitExceeded,
                "demands",
            ),
        ];
        for (r, code, says) in cases {
            let e = a.request(0, &r, cap(MIB)).expect_err("refused");
            assert_eq!(e.code, code, "{e:?}");
            assert!(e.message.contains(says), "{} lacks {says}", e.message);
        }
        assert!(a.books.is_empty(), "a refused request changes nothing");
    }

    #[test]
    fn a_full_book_refuses_new_clients_a_grant() {
        let mut a = Arbiter::new();
        let pool = ("P".to_string(), 1);
        for i in 0..ARBITER_CLIENTS_PER_POOL_MAX {
            a.request(0, &req(&format!("t{i}"), vec![demand("P", "x", 1, MIB, false)]), cap(MIB)).unwrap();
        }
        let g = a.request(0, &req("late", vec![demand("P", "x", 1, MIB, false)]), cap(MIB)).unwrap();
        assert!(g.grants.is_empty(), "no room: no grant, local sharing");
        assert_eq!(a.clients(&pool), ARBITER_CLIENTS_PER_POOL_MAX);
        // Once the others fall silent, the late one gets in.
        let g = a.request(ARBITER_CLIENT_TTL_MS + 1, &req("late", vec![demand("P", "x", 1, MIB, false)]), cap(MIB)).unwrap();
        assert_eq!(g.grants.len(), 1);
    }
}
