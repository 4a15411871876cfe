//! A gpumesh node: the libp2p swarm actor, the scheduler, the worker, the blob store
//! and the local API, wiring the protocol, consensus and executor crates together.
//!
//! - [`blob`]: the content-addressed blob store on disk.
//!
//! The mesh itself (issue 4) is being built here; until it lands `gpumesh` runs tasks
//! locally through `gpumesh-shaders`.

pub mod blob;
mod error;

pub use error::{NodeError, Result};
