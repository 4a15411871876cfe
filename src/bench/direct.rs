//! The smallest honest use of wgpu for one compute dispatch, as a baseline for the
//! executor's overhead: a pipeline built once, and per run the same buffers, bind
//! group, dispatch, copy and readback the executor makes, without its checks,
//! instrumentation, tiling or merging.

use std::time::{Duration, Instant};

use wgpu::util::DeviceExt;

pub struct Direct {
    device: wgpu::Device,
    queue: wgpu::Queue,
    pipeline: wgpu::ComputePipeline,
}

impl Direct {
    pub fn new(device: &wgpu::Device, queue: &wgpu::Queue, wgsl: &str) -> Self {
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("direct"),
            source: wgpu::ShaderSource::Wgsl(wgsl.into()),
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("direct"),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        Direct {
            device: device.clone(),
            queue: queue.clone(),
            pipeline,
        }
    }

    /// One dispatch of `groups` workgroups with a uniform at binding 0 and an output
    /// of `out_bytes` at binding 1, read back in full.
    pub fn run(
        &self,
        uniform: &[u8],
        out_bytes: u64,
        groups: u32,
    ) -> anyhow::Result<(Duration, Vec<u8>)> {
        let start = Instant::now();
        let params = self
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("direct params"),
                contents: uniform,
                usage: wgpu::BufferUsages::UNIFORM,
            });
        let out = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("direct out"),
            size: out_bytes,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("direct staging"),
            size: out_bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("direct"),
            layout: &self.pipeline.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: params.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: out.as_entire_binding(),
                },
            ],
        });
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            pass.set_pipeline(&self.pipeline);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(groups, 1, 1);
        }
        encoder.copy_buffer_to_buffer(&out, 0, &staging, 0, out_bytes);
        let index = self.queue.submit([encoder.finish()]);
        let (tx, rx) = std::sync::mpsc::channel();
        staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.device.poll(wgpu::PollType::Wait {
            submission_index: Some(index),
            timeout: None,
        })?;
        rx.recv()??;
        let bytes = staging.slice(..).get_mapped_range().to_vec();
        staging.unmap();
        Ok((start.elapsed(), bytes))
    }
}
