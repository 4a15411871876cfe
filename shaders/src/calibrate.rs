//! Measures an adapter's compute throughput (GFLOP/s) and memory read bandwidth (GB/s)
//! with two short kernels, so the scheduler can place shards by measured speed.
//!
//! Each kernel runs once to warm up and then three times; the best run counts. The
//! whole calibration takes well under a second on a software adapter.

use std::sync::Arc;
use std::time::Duration;

use gpumesh_protocol::{BindingRole, BindingSpec, BlobId, Grid, MergeRule, ShaderSource, TaskSpec};

use crate::error::Result;
use crate::executor::Executor;
use crate::job::Job;
use crate::kernel::Kernel;

/// Measured speed of one adapter.
#[derive(Clone, Copy, Debug)]
pub struct Speed {
    pub gflops: f64,
    pub gbps: f64,
}

const FLOPS_SOURCE: &str = include_str!("../kernels/calibrate_flops.wgsl");
const COPY_SOURCE: &str = include_str!("../kernels/calibrate_copy.wgsl");

/// Measures `executor`'s adapter and records the result in its capability.
pub fn calibrate(executor: &mut Executor) -> Result<Speed> {
    let invocations: u32 = 64 * 64;
    let rounds: u32 = 2048;
    let flops_job = Job::new(
        TaskSpec {
            shader: ShaderSource::Wgsl(FLOPS_SOURCE.into()),
            entry_point: "main".into(),
            bindings: vec![
                BindingSpec {
                    binding: 0,
                    role: BindingRole::Param {
                        data: bytemuck::cast_slice(&[rounds, 0, 0, 0]).to_vec(),
                    },
                },
                BindingSpec {
                    binding: 1,
                    role: BindingRole::Output {
                        size: u64::from(invocations) * 16,
                    },
                },
            ],
            grid: Grid([invocations / 64, 1, 1]),
            shards: 1,
            merge: MergeRule::Changes,
            merges: Default::default(),
            options: Default::default(),
        },
        Arc::new(Kernel::compile(FLOPS_SOURCE, "main")?),
        |_| None,
    )?;
    let flops = f64::from(invocations) * f64::from(rounds) * 4.0 * 4.0 * 2.0;
    let flop_time = best_of(executor, &flops_job)?;

    let bytes: u64 = 32 << 20;
    // Each workgroup reads 4096 vec4s.
    let groups = bytes / (4096 * 16);
    let src: Arc<[u8]> = Arc::from(vec![1u8; bytes as usize]);
    let src_id = BlobId::of(&src);
    let copy_job = Job::new(
        TaskSpec {
            shader: ShaderSource::Wgsl(COPY_SOURCE.into()),
            entry_point: "main".into(),
            bindings: vec![
                BindingSpec {
                    binding: 0,
                    role: BindingRole::Input {
                        blob: src_id,
                        size: bytes,
                    },
                },
                BindingSpec {
                    binding: 1,
                    role: BindingRole::Output { size: groups * 16 },
                },
            ],
            grid: Grid([groups as u32, 1, 1]),
            shards: 1,
            merge: MergeRule::Changes,
            merges: Default::default(),
            options: Default::default(),
        },
        Arc::new(Kernel::compile(COPY_SOURCE, "main")?),
        |id| (*id == src_id).then(|| src.clone()),
    )?;
    let copy_time = best_of(executor, &copy_job)?;

    let speed = Speed {
        gflops: flops / flop_time.as_secs_f64() / 1e9,
        gbps: bytes as f64 / copy_time.as_secs_f64() / 1e9,
    };
    executor.set_speed(speed.gflops, speed.gbps);
    Ok(speed)
}

fn best_of(executor: &mut Executor, job: &Job) -> Result<Duration> {
    executor.run(job, None)?;
    let mut best = Duration::MAX;
    for _ in 0..3 {
        let out = executor.run(job, None)?;
        let t = out.shards.iter().map(|s| s.elapsed).sum::<Duration>();
        best = best.min(t);
    }
    Ok(best.max(Duration::from_micros(1)))
}
