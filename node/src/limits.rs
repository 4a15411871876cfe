//! What one request may ask of a node: the caps the API enforces before anything is
//! stored, committed or run, each with the `gpumesh node` flag that sets it.
//!
//! Owns only the numbers and the checks that need nothing but a spec; the API applies
//! them (and counts the queue against the replicated state), the blob store applies
//! `max_blob_bytes` to every blob it stores, uploaded or pulled from a peer.

use gpumesh_protocol::{ShaderSource, TaskSpec};

use crate::error::{NodeError, Result};

/// The node's limits. Every over-limit request is refused with an error naming the
/// limit, its value and its flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of WGSL source in one task (`--max-shader-bytes`).
    pub max_shader_bytes: u64,
    /// Bytes of one blob: an upload, a blob pulled from a peer, and a task's outputs
    /// together, which are stored as blobs (`--max-blob-bytes`).
    pub max_blob_bytes: u64,
    /// Workgroups in one task's grid, x·y·z (`--max-grid`).
    pub max_grid: u64,
    /// Tasks submitted through this node and still pending or running
    /// (`--max-queued-per-submitter`).
    pub max_queued_per_submitter: usize,
    /// Bytes of one API request body, blob uploads excepted: those answer to
    /// `max_blob_bytes` (`--max-request-bytes`).
    pub max_request_bytes: u64,
    /// Bytes of GPU memory kept in use between runs: actors' state and inputs reused
    /// by later tasks (`--gpu-memory`). The node reports it; the leader places actors
    /// where their state fits in what is left of it.
    pub gpu_memory: u64,
    /// Loop turns one invocation of a kernel may run in all before its loops are
    /// stopped and the run refused, on a GPU that does not stop them sooner itself
    /// (`--max-loop-turns`): a loop that never ends then ends, and the GPU is freed.
    pub max_loop_turns: u32,
    /// Bytes left free on the data dir's disk: a new blob (an upload, an input or
    /// result copied here, a shard's output, an actor's state) that would leave less
    /// is refused, so that the Raft log can still be written when users' data has
    /// filled the rest (`--disk-reserve`; 0: none).
    pub disk_reserve: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_shader_bytes: 1 << 20,
            max_blob_bytes: 1 << 30,
            max_grid: 1 << 26,
            max_queued_per_submitter: 1024,
            max_request_bytes: 8 << 20,
            gpu_memory: 512 << 20,
            max_loop_turns: gpumesh_shaders::DEFAULT_LOOP_BOUND,
            disk_reserve: 256 << 20,
        }
    }
}

impl Limits {
    /// Refuses a zero limit: it would refuse everything, which is never the intent.
    pub fn check(&self) -> Result<()> {
        let zero = [
            ("--max-shader-bytes", self.max_shader_bytes == 0),
            ("--max-blob-bytes", self.max_blob_bytes == 0),
            ("--max-grid", self.max_grid == 0),
            (
                "--max-queued-per-submitter",
                self.max_queued_per_submitter == 0,
            ),
            ("--max-request-bytes", self.max_request_bytes == 0),
            ("--gpu-memory", self.gpu_memory == 0),
            ("--max-loop-turns", self.max_loop_turns == 0),
        ];
        match zero.iter().find(|(_, is_zero)| *is_zero) {
            Some((flag, _)) => Err(NodeError::Config(format!(
                "{flag} must be at least 1; a node with a zero limit could serve nothing"
            ))),
            None => Ok(()),
        }
    }

    /// The shader's size, before it is parsed.
    pub fn check_shader(&self, spec: &TaskSpec) -> Result<()> {
        let bytes = match &spec.shader {
            ShaderSource::Wgsl(source) => source.len(),
            ShaderSource::Builtin(name) => name.len(),
        } as u64;
        over(
            "the shader's size in bytes",
            bytes,
            self.max_shader_bytes,
            "--max-shader-bytes",
        )
    }

    /// The grid's workgroups, and the outputs, which must fit in blobs.
    pub fn check_work(&self, spec: &TaskSpec) -> Result<()> {
        over(
            "the grid's workgroup count (x·y·z)",
            spec.grid.total(),
            self.max_grid,
            "--max-grid",
        )?;
        let outputs = spec
            .bindings
            .iter()
            .filter(|b| b.role.is_writable())
            .map(|b| b.role.size())
            .fold(0u64, u64::saturating_add);
        over(
            "the task's output size in bytes (all outputs together, stored as blobs)",
            outputs,
            self.max_blob_bytes,
            "--max-blob-bytes",
        )
    }
}

fn over(what: &'static str, value: u64, limit: u64, setting: &'static str) -> Result<()> {
    if value > limit {
        return Err(NodeError::Limit {
            what,
            value,
            limit,
            setting,
        });
    }
    Ok(())
}
