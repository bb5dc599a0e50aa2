use super::*;
use crate::backend::MemoryBackend;
use crate::config::IoEngine;
use crate::dev::fair::{Key, Tenant};
use crate::dev::local::Local;
use crate::io_pool::IoPool;

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;

fn tenant(name: &str) -> Arc<str> {
    name.into()
}

fn grant(tenant: &str, bps: Option<u64>, batch: u64, write_cost: f64) -> GrantIn {
    GrantIn { pool_target: "t".into(), nsid: 1, tenant: tenant.into(), bps, batch_bytes: batch, write_cost, pool_bps: 0 }
}

fn go(t: &Turn) -> bool {
    matches!(t, Turn::Go)
}

/// Gates whose tenant `a` offered a first operation on pool 1 of `t` and was granted `bps`
/// (a batch of `batch`, write cost `write_cost`) for `ttl_ms`.
fn granted(bps: u64, batch: u64, write_cost: f64, ttl_ms: u64, write: bool) -> (Arc<Gates>, Arc<Gate>, Arc<str>) {
    let g = Gates::new();
    let gate = g.gate("t", 1);
    let a = tenant("a");
    g.offer(&gate, &a, 100, 4096, write, false);
    let asked = g.take();
    g.apply(&asked, &[grant("a", Some(bps), batch, write_cost)], &[], Duration::from_millis(ttl_ms));
    (g, gate, a)
}

/// `n` operations of `len` bytes offered back to back: how many went at once.
fn burst(g: &Gates, gate: &Gate, who: &Arc<str>, len: u64, write: bool, n: usize) -> usize {
    (0..n).filter(|_| go(&g.offer(gate, who, 100, len, write, false))).count()
}

#[tokio::test(start_paused = true)]
async fn without_a_grant_nothing_waits_and_offers_are_counted() {
    let g = Gates::new();
    let gate = g.gate("t", 1);
    let a = tenant("a");
    assert_eq!(burst(&g, &gate, &a, 128 * KIB, false, 100), 100, "no grant: every operation goes");
    tokio::time::advance(Duration::from_millis(100)).await;
    let d = g.take();
    assert_eq!(d.len(), 1);
    assert_eq!((d[0].tenant.as_str(), d[0].weight, d[0].backlogged), ("a", 100, false));
    // 12.5 MiB offered in 100 ms.
    assert_eq!(d[0].bps, 125 * MIB);
    assert_eq!(g.stats.held.load(Relaxed), 0);
}

#[tokio::test(start_paused = true)]
async fn a_grant_lets_its_batch_go_then_its_rate() {
    let g = Gates::new();
    let gate = g.gate("t", 1);
    let a = tenant("a");
    g.offer(&gate, &a, 100, 4096, false, false);
    let asked = g.take();
    let rate = 16 * MIB;
    let batch = 160 * KIB;
    g.apply(&asked, &[grant("a", Some(rate), batch, 1.0)], &[], Duration::from_millis(500));
    assert_eq!(g.stats.grants.load(Relaxed), 1);
    // A full bucket: the batch and one largest transfer, in 64 KiB reads.
    let cap = batch + limits::TRANSFER_BYTES_MAX as u64;
    let went = burst(&g, &gate, &a, 64 * KIB, false, 100);
    assert_eq!(went as u64, cap / (64 * KIB), "the bucket's bytes go at once, no more");
    // The next waits as long as its bytes take at the rate.
    let Turn::Wait(at) = g.offer(&gate, &a, 100, 64 * KIB, false, false) else { panic!("it waits") };
    let now = g.now();
    let need = (64 * KIB) as i128 * NS_PER_S - (cap % (64 * KIB)) as i128 * NS_PER_S;
    let expect = (need / rate as i128) as u64;
    assert!(at - now >= expect && at - now <= expect + 2, "waits {} ns, expected {expect}", at - now);
    // Over 200 ms, about the rate's bytes go (offered again as their waits end).
    let mut moved = 0;
    let end = g.now() + 200_000_000;
    while g.now() < end {
        match g.offer(&gate, &a, 100, 64 * KIB, false, true) {
            Turn::Go => moved += 64 * KIB,
            Turn::Wait(at) => tokio::time::advance(Duration::from_nanos(at - g.now())).await,
        }
    }
    let expect = rate / 5;
    assert!(moved.abs_diff(expect) <= 2 * 64 * KIB, "moved {moved} in 200 ms at {rate}/s");
    let d = g.take();
    assert!(d[0].backlogged, "it waited: it asks for more");
    assert!(g.stats.held.load(Relaxed) > 0);
}

#[tokio::test(start_paused = true)]
async fn writes_cost_the_pools_write_cost() {
    let (g, gate, a) = granted(MIB, 0, 2.0, 500, true);
    // The bucket: 0 + 128 KiB; a 64 KiB write costs 128 KiB.
    assert_eq!(burst(&g, &gate, &a, 64 * KIB, true, 10), 1);
    assert_eq!(burst(&g, &gate, &a, 64 * KIB, false, 10), 0, "the write took the bucket");
    tokio::time::advance(Duration::from_millis(100)).await;
    let d = g.take();
    // Offered (first offers only): ten 64 KiB writes at twice their bytes, ten 64 KiB reads.
    assert_eq!(d[0].bps, (10 * 128 + 10 * 64) * KIB * 10, "first offers, writes at twice their bytes");
}

#[tokio::test(start_paused = true)]
async fn a_grant_runs_out_and_the_tenant_goes_ungated() {
    let (g, gate, a) = granted(MIB, 0, 1.0, 500, false);
    assert!(g.grant_of("t", 1, "a").is_some());
    burst(&g, &gate, &a, 128 * KIB, false, 1);
    assert!(!go(&g.offer(&gate, &a, 100, 128 * KIB, false, false)), "held by its grant");
    // A waiting operation is offered again no later than its grant's end.
    let Turn::Wait(at) = g.offer(&gate, &a, 100, 1 << 30, false, false) else { panic!("it waits") };
    assert!(at <= g.now() + 500_000_000);
    // The arbiter says nothing more: past the TTL every operation goes.
    tokio::time::advance(Duration::from_millis(501)).await;
    assert_eq!(burst(&g, &gate, &a, 128 * KIB, false, 50), 50);
    assert_eq!(g.stats.expired.load(Relaxed), 1);
    assert_eq!(g.stats.grants.load(Relaxed), 0);
    assert!(g.grant_of("t", 1, "a").is_none());
}

#[tokio::test(start_paused = true)]
async fn no_grant_in_the_answer_means_local_sharing() {
    let g = Gates::new();
    let gate = g.gate("t", 1);
    let (a, b) = (tenant("a"), tenant("b"));
    g.offer(&gate, &a, 100, 4096, false, false);
    g.offer(&gate, &b, 100, 4096, false, false);
    let asked = g.take();
    // b's pool is not divided (None), a has no grant at all (the books were full).
    g.apply(&asked, &[grant("b", None, 0, 1.0)], &[], Duration::from_millis(500));
    assert!(g.arbitrated());
    assert_eq!(burst(&g, &gate, &a, 128 * KIB, false, 20), 20);
    assert_eq!(burst(&g, &gate, &b, 128 * KIB, false, 20), 20);
    assert_eq!(g.stats.grants.load(Relaxed), 0);
    // A tenant new on the pool while the arbiter answers moves a transfer at once and
    // GRANT_PROVISIONAL_BPS until an answer names it.
    let c = tenant("c");
    assert_eq!(burst(&g, &gate, &c, 64 * KIB, false, 20), 2, "one transfer's bytes at once");
    tokio::time::advance(Duration::from_millis(125)).await;
    assert_eq!(burst(&g, &gate, &c, 64 * KIB, false, 20), 2, "then GRANT_PROVISIONAL_BPS");
    let asked = g.take();
    g.apply(&asked, &[grant("c", Some(64 * MIB), 64 * MIB / 100, 1.0)], &[], Duration::from_millis(500));
    assert!(burst(&g, &gate, &c, 64 * KIB, false, 20) > 2, "its grant came");
}

#[tokio::test(start_paused = true)]
async fn a_pools_own_target_weighs_its_keys_by_the_grants() {
    use crate::dev::fair::{Key, Tenant};
    use crate::tenant::TenantId;
    let g = Gates::new();
    let local = Tenant { key: Key::Host("h".into()), name: "host:h".into(), weight: 100, stats: Arc::default() };
    let new = Tenant { key: Key::Host("n".into()), name: "host:n".into(), weight: 100, stats: Arc::default() };
    let policy = crate::tenant::TenantPolicy::unrestricted(TenantId::CLUSTER, "cluster", 100, 100);
    // Peer exporters on the pool, as their connections' channels know them.
    let (m1, m2, m3) = (Tenant::of(&policy, "nqn.m1"), Tenant::of(&policy, "nqn.m2"), Tenant::of(&policy, "nqn.m3"));
    assert_eq!(m1.key, Key::Peer("nqn.m1".into()));
    assert_eq!(g.pool_weight(1, &local), None, "no answer yet: the tenants' own weights");
    g.set_own("t".into());
    g.admit("t", 1, &local.name, 100, 4096, false, false);
    let asked = g.take();
    // The pool's grants: 30 MiB/s in all, 6 MiB/s of them this target's tenant's, 16 and
    // 4 MiB/s the tenants of exporters m1 and m2; the rest for a peer the answer did not name.
    let mut gr = grant("host:h", Some(6 * MIB), 0, 1.0);
    gr.pool_bps = 30 * MIB;
    let peer = |m: &str, bps| PeerIn { nsid: 1, member: m.into(), bps, pool_bps: 30 * MIB };
    g.apply(&asked, &[gr], &[peer("nqn.m1", 16 * MIB), peer("nqn.m2", 4 * MIB)], Duration::from_millis(1000));
    assert_eq!(g.pool_weight(1, &local), Some(6 * 1024));
    assert_eq!(g.pool_weight(1, &m1), Some(16 * 1024), "each exporter its tenants' grants");
    assert_eq!(g.pool_weight(1, &m2), Some(4 * 1024));
    assert_eq!(g.pool_weight(1, &m3), Some(4 * 1024), "a peer not named: what the grants leave");
    assert_eq!(g.pool_weight(1, &new), Some((limits::GRANT_PROVISIONAL_BPS >> 10) as u32));
    assert_eq!(g.pool_weight(2, &local), None, "a pool the answer named nothing on");
    // Only peers on a pool (no tenant of this target there): their grants weigh them.
    g.apply(
        &[],
        &[],
        &[peer("nqn.m1", 8 * MIB), PeerIn { nsid: 2, member: "nqn.m2".into(), bps: 2 * MIB, pool_bps: 12 * MIB }],
        Duration::from_millis(1000),
    );
    assert_eq!(g.pool_weight(1, &m1), Some(8 * 1024));
    assert_eq!(g.pool_weight(2, &m2), Some(2 * 1024));
    assert_eq!(g.pool_weight(2, &m1), Some(10 * 1024), "not named: what the pool's grants leave");
    // Past most of the TTL the pools' own sharing takes over, before the grants run out.
    tokio::time::advance(Duration::from_millis(801)).await;
    assert_eq!(g.pool_weight(1, &local), None);
    assert!(g.grant_of("t", 1, "host:h").is_some());
}

#[tokio::test(start_paused = true)]
async fn quiet_tenants_are_forgotten_once_their_grant_ran_out() {
    let (g, gate, _) = granted(MIB, 0, 1.0, 500, false);
    // Quiet, it is asked for a little longer (its commands may wait downstream), at 0.
    for _ in 1..limits::GRANT_QUIET_REQUESTS {
        let d = g.take();
        assert_eq!((d.len(), d[0].bps, d[0].backlogged), (1, 0, false), "{d:?}");
    }
    for _ in 0..2 {
        assert!(g.take().is_empty(), "then it asks for nothing");
    }
    assert_eq!(gate.clients.lock().len(), 1, "kept while its grant holds");
    tokio::time::advance(Duration::from_millis(501)).await;
    g.take();
    assert!(gate.clients.lock().is_empty());
}

#[tokio::test(start_paused = true)]
async fn tenants_tracked_per_pool_are_bounded() {
    let g = Gates::new();
    let gate = g.gate("t", 1);
    for i in 0..limits::FAIR_TENANTS_MAX + 10 {
        assert!(go(&g.offer(&gate, &tenant(&format!("t{i}")), 100, 4096, false, false)));
    }
    assert_eq!(gate.clients.lock().len(), limits::FAIR_TENANTS_MAX);
}

/// Through a real channel: a tenant's reads beyond its grant wait on the channel and
/// complete later, in order of their tags; the target's own (untagged) reads never wait.
#[tokio::test(start_paused = true)]
async fn the_gated_device_holds_a_tenants_reads_on_its_channel() {
    let g = Gates::new();
    let base: Arc<dyn BlockDevice> = Arc::new(Local::new(Arc::new(MemoryBackend::new(8 * MIB))));
    let dev = g.device("t", 1, base.clone());
    assert!(Arc::ptr_eq(&dev, &g.device("t", 1, base)), "one device per pool");
    let mut own = Channel::new(IoEngine::Uring, IoPool::new(1));
    let who = Arc::new(Tenant { key: Key::Host("h".into()), name: "host:h".into(), weight: 100, stats: Arc::default() });
    let mut ch = Channel::new(IoEngine::Uring, IoPool::new(1)).same_tenant(Some(who));
    let buf = |n: u64| {
        let mut b = AlignedBuf::new(n as usize);
        b.set_len(n as usize);
        b
    };
    assert!(ch.run(&*dev, Op::Read { off: 0 }, buf(4096)).await.result.is_ok());
    let asked = g.take();
    assert_eq!(asked[0].tenant, "host:h");
    g.apply(&asked, &[grant("host:h", Some(MIB), 0, 1.0)], &[], Duration::from_millis(5000));
    // The bucket holds 128 KiB: the first read goes, the second waits 128 ms.
    let t0 = tokio::time::Instant::now();
    assert!(ch.run(&*dev, Op::Read { off: 0 }, buf(128 * KIB)).await.result.is_ok());
    assert_eq!(t0.elapsed(), Duration::ZERO);
    assert!(ch.run(&*dev, Op::Read { off: 0 }, buf(128 * KIB)).await.result.is_ok());
    let waited = t0.elapsed();
    assert!(waited >= Duration::from_millis(125) && waited <= Duration::from_millis(130), "waited {waited:?}");
    // The target's own work passes.
    let t1 = tokio::time::Instant::now();
    for _ in 0..10 {
        assert!(own.run(&*dev, Op::Read { off: 0 }, buf(128 * KIB)).await.result.is_ok());
    }
    assert_eq!(t1.elapsed(), Duration::ZERO);
    // Flush is not gated.
    assert!(ch.run(&*dev, Op::Flush, buf(0)).await.result.is_ok());
    assert_eq!(t1.elapsed(), Duration::ZERO);
}
