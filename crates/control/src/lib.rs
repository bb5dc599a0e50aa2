//! nearstore's control plane (docs/control-plane.md): targets register their pools, view
//! agents push live figures of them, volumes are extent tables whose extents are placed
//! lazily by a weighted score over those views. `model` is the data, `state` its rules (pure:
//! every change a planned batch of writes), `placement` the score, `store` where records live
//! (redb, or etcd with a leader lease: `etcd`), `server` the HTTP API, `client` its client, `agent` a target's view
//! agent, `arbiter` the division of pools' bandwidth among the exporting targets' tenants.

pub mod agent;
pub mod arbiter;
pub mod client;
pub mod etcd;
pub mod limits;
pub mod links;
pub mod model;
pub mod placement;
pub mod rebalance;
pub mod server;
pub mod state;
pub mod store;
