//! What a node can run and how fast: reported at start, replicated in membership.

use serde::{Deserialize, Serialize};

/// The graphics API an adapter is driven through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BackendKind {
    Vulkan,
    Gl,
    Metal,
    Dx12,
    BrowserWebGpu,
    Other,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Vulkan => "vulkan",
            BackendKind::Gl => "gl",
            BackendKind::Metal => "metal",
            BackendKind::Dx12 => "dx12",
            BackendKind::BrowserWebGpu => "webgpu",
            BackendKind::Other => "other",
        }
    }
}

/// The kind of device behind an adapter, in order of preference for compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DeviceKind {
    DiscreteGpu,
    IntegratedGpu,
    VirtualGpu,
    Cpu,
    Other,
}

impl DeviceKind {
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::DiscreteGpu => "discrete",
            DeviceKind::IntegratedGpu => "integrated",
            DeviceKind::VirtualGpu => "virtual",
            DeviceKind::Cpu => "cpu",
            DeviceKind::Other => "other",
        }
    }
}

/// The adapter limits that decide what a node can be given.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdapterLimits {
    pub max_buffer_size: u64,
    pub max_storage_buffer_binding_size: u32,
    pub max_uniform_buffer_binding_size: u32,
    pub max_storage_buffers_per_shader_stage: u32,
    pub max_compute_workgroups_per_dimension: u32,
    pub max_compute_invocations_per_workgroup: u32,
    pub max_compute_workgroup_size: [u32; 3],
    pub max_compute_workgroup_storage_size: u32,
}

/// What a task's kernel asks of an adapter besides room for its buffers: the size
/// of its workgroup and the workgroup memory it uses (each `var<workgroup>` rounded
/// up to 16 bytes, as WebGPU counts it). Worked out by the node that admits the
/// task, which compiles its kernel, and recorded with it so that its shards are
/// placed only where they can run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelNeeds {
    pub workgroup_size: [u32; 3],
    pub workgroup_memory: u64,
}

/// A limit that something passes: what, its value, and the limit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exceeded {
    pub what: String,
    pub value: u64,
    pub limit: u64,
}

impl KernelNeeds {
    /// The first of `limits` this kernel passes, if any.
    pub fn exceeds(&self, limits: &AdapterLimits) -> Option<Exceeded> {
        let l = limits;
        let axes = ["x", "y", "z"];
        for (i, (&size, &max)) in self
            .workgroup_size
            .iter()
            .zip(&l.max_compute_workgroup_size)
            .enumerate()
        {
            if size > max {
                return Some(Exceeded {
                    what: format!("workgroup size along {}", axes[i]),
                    value: size.into(),
                    limit: max.into(),
                });
            }
        }
        let invocations: u64 = self.workgroup_size.iter().map(|&d| u64::from(d)).product();
        if invocations > u64::from(l.max_compute_invocations_per_workgroup) {
            return Some(Exceeded {
                what: "invocations per workgroup".into(),
                value: invocations,
                limit: l.max_compute_invocations_per_workgroup.into(),
            });
        }
        if self.workgroup_memory > u64::from(l.max_compute_workgroup_storage_size) {
            return Some(Exceeded {
                what: "workgroup memory in bytes (each var<workgroup> rounded up to 16)".into(),
                value: self.workgroup_memory,
                limit: l.max_compute_workgroup_storage_size.into(),
            });
        }
        None
    }
}

/// One node's adapter and its measured speed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeCapability {
    pub adapter_name: String,
    /// PCI vendor id (0 for software adapters that report none).
    pub vendor: u32,
    pub backend: BackendKind,
    pub device_kind: DeviceKind,
    pub driver: String,
    pub limits: AdapterLimits,
    /// Measured single-precision throughput, GFLOP/s (0 until calibrated).
    pub gflops: f64,
    /// Measured device memory bandwidth, GB/s (0 until calibrated).
    pub gbps: f64,
    /// Bytes of device memory the node keeps buffers in between runs (actors'
    /// state, inputs reused by later tasks): the leader places actors where their
    /// state fits in what is left of it.
    pub memory: u64,
}
