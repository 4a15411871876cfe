//! A gpumesh node: the libp2p swarm actor, the scheduler, the worker, the blob store
//! and the local API, wiring the protocol, consensus and executor crates together.
//!
//! - [`mesh`]: [`MeshNode`], one node with every actor started in order; forming,
//!   joining and leaving a mesh; the event router.
//! - [`net`]: the libp2p swarm actor (TCP + optional cluster key + Noise + Yamux,
//!   allow-list and connection caps, mDNS, identify, request-response for blob
//!   chunks, long-lived streams for Raft frames and for node requests).
//! - [`worker`]: runs assigned shards on the GPU thread and reports results.
//! - `host`: runs the calls of the GPU actors placed on this node, in log order.
//! - [`scheduler`]: on the leader, places pending shards by capability and queue,
//!   and has tasks whose shards are all done merged.
//! - `outputs`: merging shard results into a task's outputs (on the leader), and a
//!   completed task's outputs as local blobs.
//! - [`api`]: the local HTTP+JSON API for the CLI, the client and the dashboard
//!   (served by it too), and `GET /metrics` for Prometheus.
//! - [`peers`]: the peers actor — who the other nodes are, where they listen, a
//!   connection to every member.
//! - [`metrics`]: the node's own Prometheus registry and what it counts.
//! - [`blobs`]: the blobs actor — the content-addressed store on disk, one pull
//!   per blob however many want it, second copies on another member.
//! - [`liveness`]: the one judge of whether a member is alive, silent or
//!   unreachable, read by the scheduler, the API and the dashboard.
//! - [`limits`]: what one request may ask of a node, with defaults and flags.
//! - [`admission`]: closed by default — the cluster key in the data dir, join
//!   tickets, the API's bearer token.
//! - [`cluster_key`]: the pre-shared key that closes a mesh to strangers (proven in
//!   the Noise handshake).
//! - [`identity`]: the node key and the raft id derived from it.

pub mod admission;
pub mod api;
pub mod blobs;
pub mod cluster_key;
pub mod data_dir;
mod error;
#[cfg(test)]
mod format_schema;
mod host;
pub mod identity;
pub mod limits;
pub mod liveness;
pub mod mesh;
pub mod metrics;
pub mod net;
mod outputs;
pub mod peers;
mod run_here;
pub mod scheduler;
pub mod timeline;
mod wire;
pub mod worker;

pub use cluster_key::ClusterKey;
pub use error::{NodeError, Result};
pub use libp2p::{Multiaddr, PeerId};
pub use limits::Limits;
pub use mesh::{Faults, Formation, MeshNode, NodeConfig};
pub use net::ConnectionCaps;
