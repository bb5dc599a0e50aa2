//! The orchestrator's ordering on a live target (a memory namespace, no root needed):
//! a step that reads blocks another step writes starts only when the writer is done;
//! explicit dependencies hold; steps with nothing between them run in parallel; plans
//! that cannot be run are refused before anything starts.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use nearstore_compute::by_name;
use nearstore_host::device::Endpoint;
use nearstore_host::orchestrator::{self, Action, Locks, Options, Range, Step};
use nearstore_initiator::{ConnectOptions, Controller};
use nearstore_target::config::Config;
use nearstore_target::Target;
use nearstore_wire::compute::{Descriptor, Extent, Object};

const NQN: &str = "nqn.2026-11.io.nearstore:orchestrator";
const MIB: u64 = 1 << 20;

async fn target() -> Endpoint {
    let cfg = Config::from_toml(&format!(
        "[[listener]]\naddress = \"127.0.0.1:0\"\n[[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\nmemory = \"64MiB\"\n"
    ))
    .unwrap();
    let t = Target::from_config(&cfg).unwrap();
    let address = t.listen("127.0.0.1:0".parse().unwrap(), false).await.unwrap();
    std::mem::forget(t);
    Endpoint { address, nqn: NQN.into(), nsid: 1 }
}

/// A copy of `len` bytes at `from` to `to` on the namespace, as a step.
fn copy(ep: &Endpoint, name: &str, from: u64, to: u64, len: u64, after: Vec<usize>) -> Step {
    let (i, o) = (Object { len, extents: vec![Extent::data(from, len)] }, Object { len, extents: vec![Extent::data(to, len)] });
    Step {
        name: name.into(),
        device: ep.clone(),
        tag: 1,
        reads: orchestrator::ranges_of(1, &i),
        writes: orchestrator::ranges_of(1, &o),
        action: Action::Exec { desc: Descriptor { op: by_name("copy").unwrap().id, args: vec![], inputs: vec![i], outputs: vec![o] } },
        after,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_run_in_the_order_their_blocks_and_dependencies_give() {
    let ep = target().await;
    let c = Controller::connect(ConnectOptions::new(ep.address, NQN)).await.unwrap();
    let mut q = c.io_queue(1).await.unwrap();
    let data: Vec<u8> = (0..8 * MIB).map(|i| (i * 7 % 251) as u8).collect();
    for (k, chunk) in data.chunks(128 << 10).enumerate() {
        q.write(1, (k as u64 * (128 << 10)) / 512, chunk, 512, false).await.unwrap();
    }
    let locks = Arc::new(Locks::default());
    // Someone else holds the blocks "a" reads until "e" is done: "e", which shares nothing
    // with the others, must run (and end) before "a" starts, whatever the timing.
    locks.lock(&[Range { tag: 1, start: 0, end: 8 * MIB }], "until e is done");
    let heard = Arc::new(Mutex::new(Vec::<String>::new()));
    let (h, l) = (heard.clone(), locks.clone());
    let progress = move |m: &str| {
        if m.contains("] e done in ") {
            l.unlock("until e is done");
        }
        h.lock().unwrap().push(m.to_string());
    };
    // Listed in reverse: "c" reads what "b" writes, "b" reads what "a" writes; "d" waits
    // for "a" by an explicit dependency; "e" shares nothing and may run at once.
    let steps = vec![
        copy(&ep, "a", 0, 8 * MIB, 8 * MIB, vec![]),
        copy(&ep, "c", 16 * MIB, 24 * MIB, 8 * MIB, vec![]),
        copy(&ep, "b", 8 * MIB, 16 * MIB, 8 * MIB, vec![]),
        copy(&ep, "d", 40 * MIB, 48 * MIB, MIB, vec![0]),
        copy(&ep, "e", 56 * MIB, 60 * MIB, MIB, vec![]),
    ];
    // A plan that waited for "a" before "e" fails in 30 s rather than hanging.
    let opts = Options { lock_timeout: Duration::from_secs(30), ..Options::default() };
    let r = orchestrator::run(steps, locks.clone(), &opts, &progress).await.unwrap();
    let at = |n: &str| r.iter().find(|s| s.name == n).unwrap();
    assert!(at("b").started >= at("a").ended, "b read a's blocks before a was done: {r:?}");
    assert!(at("c").started >= at("b").ended, "c read b's blocks before b was done: {r:?}");
    assert!(at("d").started >= at("a").ended, "d ran before its dependency: {r:?}");
    assert!(at("e").ended <= at("a").started, "e waited for nothing it needed: {r:?}");
    assert!(locks.held().is_empty());
    // The bytes went through the chain a -> b -> c intact.
    let mut got = Vec::new();
    while (got.len() as u64) < 8 * MIB {
        got.extend(q.read(1, (24 * MIB + got.len() as u64) / 512, 256, 512).await.unwrap());
    }
    assert!(got == data, "the chain's output differs");
    let done = heard.lock().unwrap().iter().filter(|m| m.contains(" done in ")).count();
    assert_eq!(done, 5, "{:?}", heard.lock().unwrap());

    // Refused before anything runs: two steps of one name, a dependency on a later step.
    let e = orchestrator::run(
        vec![copy(&ep, "x", 0, MIB, MIB, vec![]), copy(&ep, "x", 0, 2 * MIB, MIB, vec![])],
        locks.clone(),
        &Options::default(),
        &|_| {},
    )
    .await
    .unwrap_err();
    assert!(e.message.contains("two steps have this name"), "{e}");
    let e = orchestrator::run(
        vec![copy(&ep, "y", 0, MIB, MIB, vec![1]), copy(&ep, "z", 0, 2 * MIB, MIB, vec![])],
        locks.clone(),
        &Options::default(),
        &|_| {},
    )
    .await
    .unwrap_err();
    assert!(e.message.contains("does not come before it"), "{e}");
    // A lock someone else holds past the timeout fails the step waiting for it, naming them;
    // once released, the same plan runs.
    locks.lock(&[Range { tag: 1, start: 0, end: MIB }], "another request");
    let opts = Options { lock_timeout: Duration::from_millis(300), ..Options::default() };
    let e = orchestrator::run(vec![copy(&ep, "w", 0, 32 * MIB, MIB, vec![])], locks.clone(), &opts, &|_| {}).await.unwrap_err();
    assert_eq!(e.step, "w");
    assert!(e.message.contains("device 1 bytes 0..1048576 stayed locked by 'another request'"), "{e}");
    locks.unlock("another request");
    orchestrator::run(vec![copy(&ep, "w", 0, 32 * MIB, MIB, vec![])], locks.clone(), &opts, &|_| {}).await.unwrap();
    assert!(locks.held().is_empty());
}
