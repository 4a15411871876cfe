//! gpumesh: a peer-to-peer GPU compute mesh.
//!
//! This facade re-exports the pieces a program needs:
//! - [`protocol`]: task specs, blob ids, capabilities, the wire codec;
//! - [`shaders`]: the executor that runs WGSL on any local adapter, sharded and
//!   merged, and the built-in kernels with their CPU references.

pub use gpumesh_protocol as protocol;
pub use gpumesh_shaders as shaders;
