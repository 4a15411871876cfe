//! A task resolved against its kernel and input bytes, ready for any executor.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpumesh_protocol::{Base, BindingRole, BlobId, ShardChanges, TaskSpec};

use crate::error::{ExecError, Result};
use crate::kernel::{Access, Kernel};
use crate::shard::ShardRange;

/// Bytes bound to one input binding.
#[derive(Clone, Debug)]
pub struct InputBuffer {
    /// Content address of `bytes` (parameters are hashed too), the residency key.
    pub id: BlobId,
    pub bytes: Arc<[u8]>,
    pub uniform: bool,
}

/// A writable buffer (an output or an in-out buffer): its size and what every
/// shard's copy of it starts as.
#[derive(Clone, Debug)]
pub struct Writable {
    pub size: u64,
    pub start: Start,
}

/// What a writable buffer holds before the kernel runs, in every shard alike.
#[derive(Clone, Debug)]
pub enum Start {
    /// One word repeated: zeros, or a reduction's identity element.
    Fill([u8; 4]),
    /// The bytes of an `--inout` blob.
    Blob(InputBuffer),
}

impl Writable {
    /// The starting contents, for diffs and merges.
    pub fn base(&self) -> Base<'_> {
        match &self.start {
            Start::Fill(word) => Base::Fill(*word),
            Start::Blob(input) => Base::Bytes(&input.bytes),
        }
    }
}

/// A checked task: its spec, compiled kernel, shard plan and input bytes.
#[derive(Clone, Debug)]
pub struct Job {
    pub spec: TaskSpec,
    pub kernel: Arc<Kernel>,
    pub plan: Vec<ShardRange>,
    /// Read-only and uniform bindings.
    pub(crate) inputs: BTreeMap<u32, InputBuffer>,
    /// Outputs and in-out buffers.
    pub(crate) writable: BTreeMap<u32, Writable>,
    /// Writable bindings whose final contents stay on the device after the run, under
    /// their content address (an actor's state: its next call starts from them).
    pub(crate) keep: std::collections::BTreeSet<u32>,
}

impl Job {
    /// Checks `spec` against `kernel` and gathers its inputs; `blob` returns the bytes
    /// of a blob id, which are checked against the id and the declared size.
    pub fn new(
        spec: TaskSpec,
        kernel: Arc<Kernel>,
        blob: impl Fn(&BlobId) -> Option<Arc<[u8]>>,
    ) -> Result<Self> {
        let plan = kernel.check(&spec)?;
        let mut inputs = BTreeMap::new();
        let mut writable = BTreeMap::new();
        for b in &spec.bindings {
            let uniform = kernel
                .interface
                .bindings
                .get(&b.binding)
                .is_some_and(|d| d.access == Access::Uniform);
            let load = |id: &BlobId, size: u64| {
                let bytes = blob(id).ok_or_else(|| ExecError::Binding {
                    binding: b.binding,
                    problem: format!("input blob {id} is not available"),
                })?;
                if bytes.len() as u64 != size || !id.matches(&bytes) {
                    return Err(ExecError::Binding {
                        binding: b.binding,
                        problem: format!(
                            "input blob {id} holds {} bytes that do not match its id and \
                             declared size {size}",
                            bytes.len()
                        ),
                    });
                }
                Ok(InputBuffer {
                    id: *id,
                    bytes,
                    uniform,
                })
            };
            match &b.role {
                BindingRole::Input { blob: id, size } => {
                    inputs.insert(b.binding, load(id, *size)?);
                }
                BindingRole::InOut { blob: id, size } => {
                    let start = Start::Blob(load(id, *size)?);
                    writable.insert(b.binding, Writable { size: *size, start });
                }
                BindingRole::Param { data } => {
                    inputs.insert(
                        b.binding,
                        InputBuffer {
                            id: BlobId::of(data),
                            bytes: Arc::from(data.as_slice()),
                            uniform,
                        },
                    );
                }
                BindingRole::Output { size } => {
                    let start = Start::Fill(crate::merge::identity(spec.merge_of(b.binding)));
                    writable.insert(b.binding, Writable { size: *size, start });
                }
            }
        }
        Ok(Job {
            spec,
            kernel,
            plan,
            inputs,
            writable,
            keep: Default::default(),
        })
    }

    /// Keeps the final contents of these writable bindings on the device after the
    /// run, under the blake3 address of their bytes, so that a later job starting an
    /// in-out binding from that blob finds it there and uploads nothing. Only for a job
    /// of one shard (the buffer then holds the whole result); refused otherwise.
    pub fn keep_resident(mut self, bindings: impl IntoIterator<Item = u32>) -> Result<Self> {
        for binding in bindings {
            if !self.writable.contains_key(&binding) {
                return Err(ExecError::Binding {
                    binding,
                    problem: "only an output or in-out buffer can be kept on the device".into(),
                });
            }
            self.keep.insert(binding);
        }
        if !self.keep.is_empty() && self.plan.len() != 1 {
            return Err(ExecError::Binding {
                binding: self.keep.iter().next().copied().unwrap_or_default(),
                problem: format!(
                    "a buffer is kept on the device only from a job of one shard, not {}",
                    self.plan.len()
                ),
            });
        }
        Ok(self)
    }

    /// The outputs and in-out buffers, by binding.
    pub fn writable(&self) -> &BTreeMap<u32, Writable> {
        &self.writable
    }

    /// Merges shard results (in shard order) into the task's outputs.
    pub fn merge(&self, shards: &[&ShardChanges]) -> Result<BTreeMap<u32, Vec<u8>>> {
        let targets = crate::merge::targets(
            &self.spec,
            |b| self.kernel.interface.atomic_words(b),
            |b| match &self.writable.get(&b)?.start {
                Start::Blob(input) => Some(&input.bytes[..]),
                Start::Fill(_) => None,
            },
        );
        crate::merge::merge(&targets, shards)
    }
}

/// What one shard produced: the words it changed in each writable buffer.
#[derive(Clone, Debug)]
pub struct ShardOutput {
    pub range: ShardRange,
    pub changes: ShardChanges,
    /// Wall time from submit to readback complete.
    pub elapsed: std::time::Duration,
}
