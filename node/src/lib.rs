//! A gpumesh node: the libp2p swarm actor, the scheduler, the worker, the blob store
//! and the local API, wiring the protocol, consensus and executor crates together.
//!
//! Not built yet: this crate is where the mesh (issue 4) lands. Until then `gpumesh`
//! runs tasks locally through `gpumesh-shaders`.
