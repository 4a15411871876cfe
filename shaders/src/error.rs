use std::time::Duration;

use thiserror::Error;

/// Everything the executor can refuse or fail at. Each message names the problem
/// and, where there is one, what to do about it.
#[derive(Debug, Error)]
pub enum ExecError {
    #[error("no {wanted} adapter found (available: {})", if available.is_empty() { "none".to_string() } else { available.join(", ") })]
    NoAdapter {
        wanted: String,
        available: Vec<String>,
    },
    #[error("could not open a device on {adapter}: {reason}")]
    RequestDevice { adapter: String, reason: String },
    #[error("WGSL error at line {line}, column {column}: {message}\n{rendered}")]
    Shader {
        line: u32,
        column: u32,
        message: String,
        rendered: String,
    },
    #[error("entry point {name:?} not found; the shader's compute entry points are: {}", if available.is_empty() { "none".to_string() } else { available.join(", ") })]
    MissingEntryPoint {
        name: String,
        available: Vec<String>,
    },
    #[error("unknown built-in kernel {name:?}; built-ins are: {}", available.join(", "))]
    UnknownBuiltin {
        name: String,
        available: Vec<String>,
    },
    #[error("unsupported shader: {0}")]
    Unsupported(String),
    #[error("binding {binding}: {problem}")]
    Binding { binding: u32, problem: String },
    #[error("invalid task: {0}")]
    Task(String),
    #[error("{what} is {value}, over the adapter limit of {limit}")]
    Limit {
        what: String,
        value: u64,
        limit: u64,
    },
    #[error(
        "an invocation's loops turned {cap} times in all, where this adapter ({adapter}) \
         ends them without a word: the result cannot be trusted and was not kept; run it \
         on another adapter, or spread the loop's work over more invocations"
    )]
    LoopCap { cap: u32, adapter: String },
    #[error(
        "an invocation's loops reached {bound} turns in all (a loop whose turns are known \
         as it starts counts them all then), the most this node lets one invocation run \
         (its --max-loop-turns): its loops were stopped there and the result was not kept; \
         does a loop ever end? if it should run longer, spread its work over more \
         invocations or raise the nodes' bound"
    )]
    LoopBound { bound: u32 },
    #[error("task exceeded its deadline of {deadline:?}; the device was rebuilt")]
    Deadline { deadline: Duration },
    #[error("GPU device lost ({0}); it was rebuilt, retry the task")]
    DeviceLost(String),
    #[error("GPU error: {0}")]
    Gpu(String),
    #[error("cannot merge shard outputs: {0}")]
    Merge(String),
    #[error(
        "conflict: binding {binding}, byte offset {offset}: shard {} changed the word to \
         {:#010x} and shard {} to {:#010x}, so no merge gives the unsharded answer. Run it \
         with --shards 1, or, if the binding holds partial sums, minima or maxima, merge it \
         with a reduction (--merge {binding}=sum|min|max-u32|i32|f32)",
        shards.0, values.0, shards.1, values.1
    )]
    Conflict {
        binding: u32,
        offset: u64,
        /// The earlier and the later shard that changed the word.
        shards: (u32, u32),
        /// What each of them changed it to.
        values: (u32, u32),
    },
    #[error(
        "conflict: binding {binding}, byte offset {offset}: shard {} stored {:#010x} in the word \
         and shard {} {:#010x}; the binding holds no atomics, so its words are values a plain \
         store set, not partials merge {rule} could fold, and no merge gives the unsharded \
         answer. Update it with atomics (atomicAdd for a sum, atomicMin or atomicMax), or run \
         it with --shards 1",
        shards.0, values.0, shards.1, values.1
    )]
    StoredConflict {
        binding: u32,
        offset: u64,
        /// The earlier and the later shard that stored into the word.
        shards: (u32, u32),
        /// What each of them stored.
        values: (u32, u32),
        rule: gpumesh_protocol::MergeRule,
    },
    #[error("cannot be split into shards: {0}")]
    Unsplittable(String),
    #[error(transparent)]
    Protocol(#[from] gpumesh_protocol::ProtocolError),
}

pub type Result<T, E = ExecError> = std::result::Result<T, E>;
