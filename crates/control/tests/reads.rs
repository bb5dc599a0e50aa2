//! Reads never wait for the store: while a change's commit is stuck in the store (etcd slow or
//! between leaders), the API's reads answer at once, from the state before the change, on a
//! runtime of a single worker. Once a read waited for the commit: on a loaded machine every
//! worker of the daemon blocked behind one registration, the etcd client's connection tasks
//! and the lease's keep-alive starved, and the leader lost its lease with the API dead.

use std::sync::Arc;
use std::time::Duration;

use nearstore_control::client::Client;
use nearstore_control::model::*;
use nearstore_control::server::{serve, Service};
use nearstore_control::store::{MemStore, Store, StoreError};
use parking_lot::{Condvar, Mutex};

/// A store whose commits wait until the test opens its gate.
#[derive(Default)]
struct Gated {
    records: MemStore,
    /// (commits waiting at the gate, the gate open)
    state: Mutex<(usize, bool)>,
    changed: Condvar,
}

impl Gated {
    fn wait_for_a_commit(&self) {
        let mut s = self.state.lock();
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while s.0 == 0 {
            assert!(!self.changed.wait_until(&mut s, until).timed_out(), "no commit reached the store");
        }
    }

    fn open(&self) {
        self.state.lock().1 = true;
        self.changed.notify_all();
    }

    /// Closes the gate again: the next commit waits (and is the next one counted).
    fn close(&self) {
        *self.state.lock() = (0, false);
    }
}

/// Opens the gate when the test ends, failed or not: a runtime waits for its blocking
/// threads when dropped.
struct OpenAtTheEnd(Arc<Gated>);

impl Drop for OpenAtTheEnd {
    fn drop(&mut self) {
        self.0.open();
    }
}

struct Shared(Arc<Gated>);

impl Store for Shared {
    fn load(&self) -> Result<Vec<Record>, StoreError> {
        self.0.records.load()
    }

    fn commit(&self, batch: &[Write]) -> Result<(), StoreError> {
        let g = &self.0;
        let mut s = g.state.lock();
        s.0 += 1;
        g.changed.notify_all();
        while !s.1 {
            g.changed.wait(&mut s);
        }
        drop(s);
        g.records.commit(batch)
    }
}

/// The API over `gated` on a runtime of its own, at its smallest (one worker), and a client
/// runtime with its client: (the server's runtime, the client's, the client).
fn daemon(gated: &Arc<Gated>) -> (tokio::runtime::Runtime, tokio::runtime::Runtime, Client) {
    let svc = Arc::new(Service::open(Box::new(Shared(gated.clone()))).expect("service"));
    let server = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
    let listener = server.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("bind");
    let addr = listener.local_addr().expect("addr");
    server.spawn(serve(listener, svc));
    let client = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    (server, client, Client::new(addr))
}

#[test]
fn reads_answer_while_a_commit_is_stuck_in_the_store() {
    let gated = Arc::new(Gated::default());
    let (_server, client, c) = daemon(&gated);
    let _open = OpenAtTheEnd(gated.clone());
    // The change: a target registering a pool, which the view shows once applied.
    let register = {
        let c = c.clone();
        client.spawn(async move {
            let pools =
                vec![PoolSpec { name: "p0".into(), path: "/pools/p0".into(), size: 64 << 20, nsid: 1, bandwidth: 0, write_cost: 0.0 }];
            c.register(&RegisterTarget {
                addr: "127.0.0.1:4420".into(),
                nqn: "nqn.2026-11.io.nearstore:reads".into(),
                pools,
                write_bound_ms: 0,
                incarnation: 0,
            })
            .await
        })
    };
    gated.wait_for_a_commit();
    // Several reads at once, more than the server's workers, while the commit waits.
    let reads: Vec<_> = (0..4)
        .map(|i| {
            let c = c.clone();
            client.spawn(async move {
                let r = tokio::time::timeout(Duration::from_secs(5), async {
                    if i % 2 == 0 {
                        c.view(0).await.map(|v| v.pools.len())
                    } else {
                        c.view(0).await.map(|v| v.targets.len())
                    }
                })
                .await;
                (i, r)
            })
        })
        .collect();
    for r in reads {
        let (i, r) = client.block_on(r).expect("read task");
        let n = r.unwrap_or_else(|_| panic!("read {i} waited for the stuck commit")).expect("read");
        assert_eq!(n, 0, "read {i} saw the change before its commit");
    }
    assert!(!register.is_finished(), "the change completed before its commit");
    gated.open();
    client.block_on(register).expect("register task").expect("register");
    let v = client.block_on(c.view(0)).expect("view");
    assert_eq!((v.targets.len(), v.pools.len()), (1, 1), "the change once committed");
}

/// An unexport stuck in the store hides its volume from the exports long poll until its
/// commit has ended, even once its request was given up: no target's lease on the volume
/// is renewed after its handover's bound was computed (docs/control-plane.md, "Handing an
/// export over").
#[test]
fn an_unexport_stuck_in_the_store_hides_the_volume_from_the_exports_poll() {
    let gated = Arc::new(Gated::default());
    gated.open();
    let (_server, client, c) = daemon(&gated);
    let _open = OpenAtTheEnd(gated.clone());
    let t = "127.0.0.1:4420";
    let pools = vec![PoolSpec { name: "p0".into(), path: "/pools/p0".into(), size: 64 << 20, nsid: 1, bandwidth: 0, write_cost: 0.0 }];
    client
        .block_on(c.register(&RegisterTarget {
            addr: t.into(),
            nqn: "nqn.2026-11.io.nearstore:reads".into(),
            pools,
            write_bound_ms: 0,
            incarnation: 0,
        }))
        .expect("register");
    client.block_on(c.create_volume(&CreateVolume { name: "v".into(), size: 4 << 20, extent_size: Some(1 << 20) })).expect("create");
    client.block_on(c.export("v", &ExportVolume { target: t.into(), hosts: Vec::new(), allow_any_host: true })).expect("export");
    let listed = || client.block_on(c.exports(t, 0, 0)).expect("exports").exports.iter().any(|x| x.volume == "v");
    assert!(listed(), "exported");
    gated.close();
    let unexport = {
        let c = c.clone();
        client.spawn(async move { c.unexport("v").await })
    };
    gated.wait_for_a_commit();
    assert!(!listed(), "listed while its unexport commits");
    // The request given up (its connection closed): still hidden until the commit ends.
    unexport.abort();
    let _ = client.block_on(unexport);
    std::thread::sleep(Duration::from_millis(300));
    assert!(!listed(), "listed again once the unexport's request was given up, its commit still running");
    gated.open();
    let until = std::time::Instant::now() + Duration::from_secs(10);
    let handover = loop {
        if let Some(h) = client.block_on(c.volume("v")).expect("v").volume.handover {
            break h;
        }
        assert!(std::time::Instant::now() < until, "the unexport never committed");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(handover.from, t);
    assert!(!listed(), "listed after its unexport");
}
