//! The etcd store's transactions against a real etcd (one member, loopback): the leader key
//! taken by one daemon at a time, a commit guarded by the lease and the commit counter, a
//! repeated attempt refused with what the retry needs to decide, a volume's extents deleted as
//! one range, and a batch over etcd's limits refused before it is sent.

use nearstore_control::etcd::{self, EtcdStore, Keys, PREFIX_DEFAULT};
use nearstore_control::limits::ETCD_TXN_OPS_MAX;
use nearstore_control::model::*;
use nearstore_control::store::{Guarded, GuardedStore, StoreError};
use nearstore_testkit::etcd::Etcd;

fn volume(name: &str) -> Record {
    Record::Volume(Volume { name: name.into(), size: 8 << 20, extent_size: 1 << 20, created_ms: 1, handover: None })
}

fn extent(v: &str, index: u64) -> Record {
    Record::Extent(Extent {
        volume: v.into(),
        index,
        pool: PoolId { target: "t:1".into(), name: "p".into() },
        offset: index << 20,
        epoch: 1,
        unwritten: false,
    })
}

#[test]
fn commits_are_guarded_by_the_lease_and_the_counter() {
    let cluster = Etcd::start(1);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
    let keys = Keys::new(PREFIX_DEFAULT);
    let client = rt.block_on(etcd::connect(&cluster.endpoints())).expect("connect");
    let lead = |api: &str| rt.block_on(etcd::try_lead(&client, &keys, 10, api)).expect("campaign");
    let first = lead("a:1").expect("the first daemon leads");
    // A second one sees the first as leader.
    assert_eq!(lead("b:1").err().flatten().map(|l| l.api), Some("a:1".to_string()));
    let s1 = EtcdStore::new(client.clone(), rt.handle().clone(), keys.clone(), first.clone());
    assert_eq!(s1.load().expect("load"), (Vec::new(), 0));
    let batch: Vec<Write> = [volume("v"), extent("v", 0), extent("v", 3), volume("w")].into_iter().map(Write::Put).collect();
    assert_eq!(s1.commit_if(0, &batch), Ok(Guarded::Applied));
    // The same attempt again (a retry, or a late duplicate): refused, and the counter says
    // that this writer made commit 1.
    assert_eq!(s1.commit_if(0, &batch), Ok(Guarded::Refused { seq: 1, writer: first.lease, leads: true }));
    // The lease ends in etcd while this daemon still believes it leads: refused.
    rt.block_on(async { client.lease_client().revoke(first.lease).await }).expect("revoke");
    let late = [Write::Put(volume("late"))];
    assert_eq!(s1.commit_if(1, &late), Ok(Guarded::Refused { seq: 1, writer: first.lease, leads: false }));
    // The next leader loads the state as committed, and a deleted volume's extents go with it.
    let second = lead("b:1").expect("the second daemon leads");
    let s2 = EtcdStore::new(client.clone(), rt.handle().clone(), keys.clone(), second.clone());
    let (records, seq) = s2.load().expect("load");
    assert_eq!(seq, 1);
    // Volumes before extents, whatever etcd's key order.
    assert_eq!(records, vec![volume("v"), volume("w"), extent("v", 0), extent("v", 3)]);
    let delete = [Write::Delete(Table::Extents, extent_key("v", 0)), Write::Delete(Table::Volumes, "v".into())];
    assert_eq!(s2.commit_if(1, &delete), Ok(Guarded::Applied));
    assert_eq!(s2.load().expect("load"), (vec![volume("w")], 2));
    // A batch over etcd's limits is refused before it is sent: nothing written.
    let big: Vec<Write> = (0..ETCD_TXN_OPS_MAX as u64).map(|i| Write::Put(extent("w", i))).collect();
    let e = s2.commit_if(2, &big).expect_err("too large");
    assert!(matches!(&e, StoreError::Backend(m) if m.contains("limits")), "{e}");
    assert_eq!(s2.load().expect("load"), (vec![volume("w")], 2));
}
