//! The gpumesh executor: WGSL compute on whatever wgpu adapter a node has.
//!
//! - [`adapter`]: enumerate adapters, choose one (`--backend`), describe it.
//! - [`kernel`]: parse and validate WGSL with naga (line:column errors), reflect the
//!   entry point's `@group(0)` bindings, check a task against them.
//! - `atomic_ops`: the atomic functions a kernel applies to each buffer, held
//!   against its merge rule.
//! - [`kernel_cache`]: compiled kernels by source hash, so a node compiles each once.
//! - [`shard`]: split a grid into shards and rewrite the module (naga IR) so each
//!   shard sees full-grid builtins; tile grids past the per-dimension limit.
//! - `zero`: workgroup memory zeroed by the entry point, spread over its
//!   invocations (the pipelines are built without the backends' own zeroing).
//! - [`job`]: a task resolved against its kernel and input bytes.
//! - [`executor`]: device, pipeline cache, dispatch, readback, deadlines, rebuild
//!   after device loss.
//! - [`merge`]: shard outputs' changed words, or their elementwise
//!   sum/min/max/or/and/xor.
//! - [`builtins`]: the built-in kernels (`kernels/*.wgsl`), each with a CPU reference.
//! - [`calibrate`]: measure an adapter's GFLOP/s and GB/s.

pub mod adapter;
mod atomic_ops;
pub mod builtins;
pub mod calibrate;
mod error;
mod exchange;
pub mod executor;
mod ir;
pub mod job;
pub mod kernel;
pub mod kernel_cache;
pub mod merge;
mod pin;
pub mod shard;
mod slots;
mod turns;
mod zero;

pub use adapter::BackendChoice;
pub use error::{ExecError, Result};
pub use executor::{
    ChainOutput, DeviceCounts, Executor, ExecutorCounters, ExecutorLimits, TaskOutput,
    DEFAULT_LOOP_BOUND,
};
pub use job::{Job, ShardOutput};
pub use kernel::Kernel;
pub use kernel_cache::KernelCache;
