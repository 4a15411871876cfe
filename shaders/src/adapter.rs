//! Finding adapters and choosing one.
//!
//! `--backend vulkan|gl|metal|dx12` restricts the choice to one graphics API;
//! otherwise the best device wins: discrete > integrated > virtual > cpu, and among
//! equals Vulkan, Metal and DX12 before GL.

use std::fmt;
use std::str::FromStr;

use gpumesh_protocol::{AdapterLimits, BackendKind, DeviceKind, NodeCapability};

use crate::error::{ExecError, Result};

/// Which backend a node may use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendChoice {
    #[default]
    Auto,
    Only(BackendKind),
}

impl FromStr for BackendChoice {
    type Err = ExecError;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "auto" | "any" => BackendChoice::Auto,
            "vulkan" | "vk" => BackendChoice::Only(BackendKind::Vulkan),
            "gl" | "gles" | "opengl" => BackendChoice::Only(BackendKind::Gl),
            "metal" => BackendChoice::Only(BackendKind::Metal),
            "dx12" | "d3d12" => BackendChoice::Only(BackendKind::Dx12),
            other => {
                return Err(ExecError::Task(format!(
                    "unknown backend {other:?}; use vulkan, gl, metal, dx12 or auto"
                )))
            }
        })
    }
}

impl fmt::Display for BackendChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendChoice::Auto => f.write_str("auto"),
            BackendChoice::Only(b) => f.write_str(b.name()),
        }
    }
}

impl BackendChoice {
    fn backends(self) -> wgpu::Backends {
        match self {
            BackendChoice::Auto => wgpu::Backends::all(),
            BackendChoice::Only(BackendKind::Vulkan) => wgpu::Backends::VULKAN,
            BackendChoice::Only(BackendKind::Gl) => wgpu::Backends::GL,
            BackendChoice::Only(BackendKind::Metal) => wgpu::Backends::METAL,
            BackendChoice::Only(BackendKind::Dx12) => wgpu::Backends::DX12,
            BackendChoice::Only(_) => wgpu::Backends::empty(),
        }
    }
}

/// A wgpu instance over the backends `choice` allows.
pub fn instance(choice: BackendChoice) -> wgpu::Instance {
    instance_on(choice.backends())
}

fn instance_on(backends: wgpu::Backends) -> wgpu::Instance {
    wgpu::Instance::new(&wgpu::InstanceDescriptor {
        backends,
        flags: wgpu::InstanceFlags::empty().with_env(),
        ..Default::default()
    })
}

/// Every adapter `choice` allows, best first.
pub fn adapters(choice: BackendChoice) -> Vec<wgpu::Adapter> {
    adapters_on(choice.backends())
}

fn adapters_on(backends: wgpu::Backends) -> Vec<wgpu::Adapter> {
    let mut all = instance_on(backends).enumerate_adapters(backends);
    crate::pin::keep_drivers_loaded();
    all.sort_by_key(|a| rank(&a.get_info()));
    all
}

/// The best adapter `choice` allows.
pub fn choose(choice: BackendChoice) -> Result<wgpu::Adapter> {
    // A discrete GPU on Vulkan, Metal or DX12 ranks first whatever OpenGL offers,
    // so where there is one OpenGL is not looked at: its driver is not loaded, and
    // EGL's display (one for the whole process) is neither set up nor torn down
    // again as each node in a process starts. On an H100 NVIDIA's EGL adapter is
    // listed but cannot run a dispatch.
    if choice == BackendChoice::Auto {
        let native = adapters_on(wgpu::Backends::all() - wgpu::Backends::GL);
        if let Some(best) = native
            .into_iter()
            .next()
            .filter(|a| a.get_info().device_type == wgpu::DeviceType::DiscreteGpu)
        {
            return Ok(best);
        }
    }
    let mut all = adapters(choice);
    if all.is_empty() {
        let available = adapters(BackendChoice::Auto)
            .iter()
            .map(|a| {
                let i = a.get_info();
                format!("{} ({})", i.name, backend_kind(i.backend).name())
            })
            .collect();
        return Err(ExecError::NoAdapter {
            wanted: choice.to_string(),
            available,
        });
    }
    Ok(all.remove(0))
}

fn rank(info: &wgpu::AdapterInfo) -> (u8, u8) {
    let device = match info.device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    };
    let backend = match info.backend {
        wgpu::Backend::Vulkan | wgpu::Backend::Metal | wgpu::Backend::Dx12 => 0,
        wgpu::Backend::Gl => 1,
        _ => 2,
    };
    (device, backend)
}

pub fn backend_kind(b: wgpu::Backend) -> BackendKind {
    match b {
        wgpu::Backend::Vulkan => BackendKind::Vulkan,
        wgpu::Backend::Gl => BackendKind::Gl,
        wgpu::Backend::Metal => BackendKind::Metal,
        wgpu::Backend::Dx12 => BackendKind::Dx12,
        wgpu::Backend::BrowserWebGpu => BackendKind::BrowserWebGpu,
        _ => BackendKind::Other,
    }
}

fn device_kind(t: wgpu::DeviceType) -> DeviceKind {
    match t {
        wgpu::DeviceType::DiscreteGpu => DeviceKind::DiscreteGpu,
        wgpu::DeviceType::IntegratedGpu => DeviceKind::IntegratedGpu,
        wgpu::DeviceType::VirtualGpu => DeviceKind::VirtualGpu,
        wgpu::DeviceType::Cpu => DeviceKind::Cpu,
        wgpu::DeviceType::Other => DeviceKind::Other,
    }
}

/// The adapter's identity and limits; speed fields stay 0 until calibrated, memory
/// until the executor that opens it sets its budget.
pub fn describe(adapter: &wgpu::Adapter) -> NodeCapability {
    let info = adapter.get_info();
    let l = adapter.limits();
    NodeCapability {
        adapter_name: info.name.clone(),
        vendor: info.vendor,
        backend: backend_kind(info.backend),
        device_kind: device_kind(info.device_type),
        driver: format!("{} {}", info.driver, info.driver_info)
            .trim()
            .to_string(),
        limits: AdapterLimits {
            max_buffer_size: l.max_buffer_size,
            max_storage_buffer_binding_size: l.max_storage_buffer_binding_size,
            max_uniform_buffer_binding_size: l.max_uniform_buffer_binding_size,
            max_storage_buffers_per_shader_stage: l.max_storage_buffers_per_shader_stage,
            max_compute_workgroups_per_dimension: l.max_compute_workgroups_per_dimension,
            max_compute_invocations_per_workgroup: l.max_compute_invocations_per_workgroup,
            max_compute_workgroup_size: [
                l.max_compute_workgroup_size_x,
                l.max_compute_workgroup_size_y,
                l.max_compute_workgroup_size_z,
            ],
            max_compute_workgroup_storage_size: l.max_compute_workgroup_storage_size,
        },
        gflops: 0.0,
        gbps: 0.0,
        memory: 0,
    }
}
