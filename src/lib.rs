//! gpumesh: a peer-to-peer GPU compute mesh.
//!
//! This facade re-exports the pieces a program needs:
//! - [`protocol`]: task specs, blob ids, capabilities, the wire codec;
//! - [`shaders`]: the executor that runs WGSL on any local adapter, sharded and
//!   merged, and the built-in kernels with their CPU references;
//! - [`node`]: a mesh node ([`node::MeshNode`]) to embed in a program;
//! - [`process`]: `gpumesh node` as a child process, for local multi-process meshes;
//! - [`Client`]: submit tasks to a mesh and fetch results through any node's API.

mod client;
pub mod process;

pub use client::{Client, ClientError, ClientResult, DEFAULT_API};
pub use gpumesh_consensus as consensus;
pub use gpumesh_node as node;
pub use gpumesh_protocol as protocol;
pub use gpumesh_shaders as shaders;
