//! A task under construction for tests: its bindings, the blobs they name and its
//! merge rules. Shared by the executor's tests (`shaders/tests/kernels.rs`) and the
//! mesh's (`tests/sharding.rs`), which add running it their own way.

#![allow(dead_code)] // each including test uses its own subset

use std::collections::BTreeMap;
use std::sync::Arc;

use gpumesh_protocol::{BindingRole, BindingSpec, BlobId, Grid, MergeRule, ShaderSource, TaskSpec};

#[derive(Default, Clone)]
pub struct Task {
    pub bindings: Vec<BindingSpec>,
    pub blobs: BTreeMap<BlobId, Arc<[u8]>>,
    pub merges: BTreeMap<u32, MergeRule>,
}

impl Task {
    fn blob(mut self, binding: u32, bytes: Vec<u8>, inout: bool) -> Self {
        let (blob, size) = (BlobId::of(&bytes), bytes.len() as u64);
        self.blobs.insert(blob, Arc::from(bytes));
        let role = if inout {
            BindingRole::InOut { blob, size }
        } else {
            BindingRole::Input { blob, size }
        };
        self.bindings.push(BindingSpec { binding, role });
        self
    }

    /// A `var<storage, read>` or `var<uniform>` binding filled from a file.
    pub fn input(self, binding: u32, bytes: Vec<u8>) -> Self {
        self.blob(binding, bytes, false)
    }

    /// A `read_write` binding that starts as `bytes` (`--inout`).
    pub fn inout(self, binding: u32, bytes: Vec<u8>) -> Self {
        self.blob(binding, bytes, true)
    }

    /// A `read_write` binding that starts as zeros (`--output`).
    pub fn output(mut self, binding: u32, size: u64) -> Self {
        self.bindings.push(BindingSpec {
            binding,
            role: BindingRole::Output { size },
        });
        self
    }

    /// A merge rule for one binding (`--merge BINDING=RULE`).
    pub fn merge(mut self, binding: u32, rule: MergeRule) -> Self {
        self.merges.insert(binding, rule);
        self
    }

    pub fn spec(&self, source: &str, grid: [u32; 3], shards: u32, merge: MergeRule) -> TaskSpec {
        TaskSpec {
            shader: ShaderSource::Wgsl(source.into()),
            entry_point: "main".into(),
            bindings: self.bindings.clone(),
            grid: Grid(grid),
            shards,
            merge,
            merges: self.merges.clone(),
            options: Default::default(),
        }
    }
}
