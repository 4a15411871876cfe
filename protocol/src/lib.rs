//! Wire and state types shared by every gpumesh crate.
//!
//! - [`codec`]: the one place bytes become values (bincode 2 in serde mode, bounded).
//! - [`format`]: the format number of every encoding, in protocol names, envelopes
//!   and data directories.
//! - [`envelope`]: a frame around every message carrying the format, so a wire
//!   change is detected instead of misread.
//! - [`ids`]: content addresses ([`BlobId`], blake3) and other identifiers.
//! - [`task`]: what a user asks the mesh to run ([`TaskSpec`]) and how shard
//!   outputs are merged ([`MergeRule`]).
//! - [`changes`]: what a shard changed in its writable buffers, the format of a
//!   shard's result ([`ShardChanges`]).
//! - [`actor`]: GPU actors — a state layout ([`StateBuffer`]) and a call
//!   ([`ActorCall`]), which runs as a one-shard task with the state in place.
//! - [`capability`]: what a node's adapter is and how fast it measured
//!   ([`NodeCapability`]).
//! - [`mesh`]: what nodes say to each other ([`MeshRequest`], [`MeshResponse`]).
//!
//! This crate depends on no other workspace crate.

pub mod actor;
pub mod capability;
pub mod changes;
pub mod codec;
pub mod envelope;
mod error;
pub mod format;
pub mod ids;
pub mod mesh;
pub mod task;

pub use actor::{ActorCall, StateBuffer};
pub use capability::{
    AdapterLimits, BackendKind, DeviceKind, Exceeded, KernelNeeds, NodeCapability,
};
pub use changes::{Base, BufferChanges, Run, ShardChanges};
pub use envelope::{open, seal};
pub use error::{ProtocolError, Result};
pub use format::FORMAT;
pub use ids::BlobId;
pub use mesh::{MeshRequest, MeshResponse};
pub use task::{
    BindingRole, BindingSpec, ElemType, Grid, MergeRule, ShaderSource, TaskOptions, TaskSpec,
    TaskState, MAX_DEADLINE_MS, MAX_REPLICAS,
};
