//! A task resolved against its kernel and input bytes, ready for any executor.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpumesh_protocol::{BindingRole, BlobId, TaskSpec};

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

/// A checked task: its spec, compiled kernel, shard plan and input bytes.
#[derive(Clone, Debug)]
pub struct Job {
    pub spec: TaskSpec,
    pub kernel: Arc<Kernel>,
    pub plan: Vec<ShardRange>,
    pub(crate) inputs: BTreeMap<u32, InputBuffer>,
    /// Output binding → size in bytes.
    pub(crate) outputs: BTreeMap<u32, u64>,
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
        let mut outputs = BTreeMap::new();
        for b in &spec.bindings {
            let uniform = kernel
                .interface
                .bindings
                .get(&b.binding)
                .is_some_and(|d| d.access == Access::Uniform);
            match &b.role {
                BindingRole::Input { blob: id, size } => {
                    let bytes = blob(id).ok_or_else(|| ExecError::Binding {
                        binding: b.binding,
                        problem: format!("input blob {id} is not available"),
                    })?;
                    if bytes.len() as u64 != *size || !id.matches(&bytes) {
                        return Err(ExecError::Binding {
                            binding: b.binding,
                            problem: format!(
                                "input blob {id} holds {} bytes that do not match its id and \
                                 declared size {size}",
                                bytes.len()
                            ),
                        });
                    }
                    inputs.insert(
                        b.binding,
                        InputBuffer {
                            id: *id,
                            bytes,
                            uniform,
                        },
                    );
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
                    outputs.insert(b.binding, *size);
                }
            }
        }
        Ok(Job {
            spec,
            kernel,
            plan,
            inputs,
            outputs,
        })
    }

    /// Output binding numbers and sizes.
    pub fn outputs(&self) -> &BTreeMap<u32, u64> {
        &self.outputs
    }
}

/// What one shard produced: for `concat`, each output's slice; otherwise full-size
/// partials.
#[derive(Clone, Debug)]
pub struct ShardOutput {
    pub range: ShardRange,
    pub outputs: BTreeMap<u32, Vec<u8>>,
    /// Wall time from submit to readback complete.
    pub elapsed: std::time::Duration,
}
