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

    /// The bind group of a uniform at binding 0 and an output at binding 1.
    fn bind(&self, params: &wgpu::Buffer, out: &wgpu::Buffer) -> wgpu::BindGroup {
        self.device.create_bind_group(&wgpu::BindGroupDescriptor {
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
        })
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
        let group = self.bind(&params, &out);
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

/// Medians over `runs` of each step of one trivial dispatch and its readback on
/// this device, done the direct way: what a dispatch's time is made of on an
/// adapter (buffer creation, binding, encoding, submission, the wait, the map).
/// The last rows are whole runs: buffers made per run (as [`Direct::run`]), and
/// buffers made once and reused, waited on by blocking and by polling.
pub fn steps(direct: &Direct, runs: usize) -> anyhow::Result<Vec<(String, Duration)>> {
    let device = &direct.device;
    let queue = &direct.queue;
    let uniform: &[u8] = bytemuck::cast_slice(&[1u32, 0, 0, 0]);
    let mut rows: Vec<(String, Vec<Duration>)> = Vec::new();
    let mark = |rows: &mut Vec<(String, Vec<Duration>)>, what: &str, t: &mut Instant| {
        let now = Instant::now();
        match rows.iter_mut().find(|(w, _)| w == what) {
            Some((_, v)) => v.push(now - *t),
            None => rows.push((what.to_string(), vec![now - *t])),
        }
        *t = Instant::now();
    };
    let wait = |index| {
        device.poll(wgpu::PollType::Wait {
            submission_index: Some(index),
            timeout: None,
        })
    };
    let encode = |group: &wgpu::BindGroup, out: &wgpu::Buffer, staging: &wgpu::Buffer| {
        let mut encoder =
            device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            pass.set_pipeline(&direct.pipeline);
            pass.set_bind_group(0, group, &[]);
            pass.dispatch_workgroups(1, 1, 1);
        }
        encoder.copy_buffer_to_buffer(out, 0, staging, 0, 256);
        encoder.finish()
    };
    let bind = |params: &wgpu::Buffer, out: &wgpu::Buffer| direct.bind(params, out);
    let map = |staging: &wgpu::Buffer| {
        let (tx, rx) = std::sync::mpsc::channel();
        staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        rx
    };
    let storage = |usage| wgpu::BufferDescriptor {
        label: None,
        size: 256,
        usage,
        mapped_at_creation: false,
    };
    let out_usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC;
    let staging_usage = wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST;

    for _ in 0..runs + 1 {
        let mut t = Instant::now();
        let out = device.create_buffer(&storage(out_usage));
        mark(&mut rows, "create a 256 B storage buffer", &mut t);
        let staging = device.create_buffer(&storage(staging_usage));
        mark(&mut rows, "create a 256 B readback buffer", &mut t);
        let params = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: None,
            contents: uniform,
            usage: wgpu::BufferUsages::UNIFORM,
        });
        mark(&mut rows, "create a 16 B uniform with contents", &mut t);
        let group = bind(&params, &out);
        mark(&mut rows, "create the bind group", &mut t);
        let commands = encode(&group, &out, &staging);
        mark(&mut rows, "encode dispatch and copy", &mut t);
        let index = queue.submit([commands]);
        mark(&mut rows, "submit", &mut t);
        wait(index)?;
        mark(&mut rows, "wait for the submission (blocking)", &mut t);
        let rx = map(&staging);
        device.poll(wgpu::PollType::wait_indefinitely())?;
        rx.recv()??;
        mark(&mut rows, "map the readback buffer", &mut t);
        let bytes = staging.slice(..).get_mapped_range().to_vec();
        staging.unmap();
        mark(&mut rows, "copy out and unmap", &mut t);
        drop((group, params, staging, out));
        mark(&mut rows, "drop the buffers and bind group", &mut t);
        device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        device.push_error_scope(wgpu::ErrorFilter::Validation);
        let v = pollster::block_on(device.pop_error_scope());
        let o = pollster::block_on(device.pop_error_scope());
        mark(&mut rows, "push and pop two error scopes", &mut t);
        let _ = device.poll(wgpu::PollType::Poll)?;
        mark(&mut rows, "poll the device once", &mut t);
        anyhow::ensure!(v.is_none() && o.is_none(), "the steps raised a GPU error");
        anyhow::ensure!(bytes.len() == 256, "the readback is {} bytes", bytes.len());
    }

    // Whole runs: new buffers each time, then the same buffers reused.
    let out = device.create_buffer(&storage(out_usage));
    let staging = device.create_buffer(&storage(staging_usage));
    let params = device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: 16,
        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let group = bind(&params, &out);
    for _ in 0..runs + 1 {
        let mut t = Instant::now();
        direct.run(uniform, 256, 1)?;
        mark(&mut rows, "whole run, new buffers (blocking waits)", &mut t);
        // Mapped before the wait, so one blocking wait covers both (as in the
        // executor), against the busy polling below.
        queue.write_buffer(&params, 0, uniform);
        let index = queue.submit([encode(&group, &out, &staging)]);
        let rx = map(&staging);
        wait(index)?;
        rx.recv()??;
        let _ = staging.slice(..).get_mapped_range().to_vec();
        staging.unmap();
        mark(
            &mut rows,
            "whole run, buffers reused (blocking waits)",
            &mut t,
        );
        queue.write_buffer(&params, 0, uniform);
        queue.submit([encode(&group, &out, &staging)]);
        let rx = map(&staging);
        let mapped = loop {
            let _ = device.poll(wgpu::PollType::Poll)?;
            if let Ok(r) = rx.try_recv() {
                break r;
            }
            std::hint::spin_loop();
        };
        mapped?;
        let _ = staging.slice(..).get_mapped_range().to_vec();
        staging.unmap();
        mark(
            &mut rows,
            "whole run, buffers reused (busy polling)",
            &mut t,
        );
    }
    Ok(rows
        .into_iter()
        .map(|(what, mut v)| {
            // The first pass warms allocators and caches: left out.
            v.remove(0);
            v.sort();
            (what, v[v.len() / 2])
        })
        .collect())
}
