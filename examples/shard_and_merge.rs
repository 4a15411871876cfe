//! Runs one WGSL kernel on every local adapter, unsharded and in 5 shards, and shows
//! that the merged result equals the unsharded one and a CPU reference.
//!
//! `cargo run --release --example shard_and_merge`

use std::sync::Arc;

use anyhow::Context;
use gpumesh::protocol::{
    BindingRole, BindingSpec, BlobId, Grid, MergeRule, ShaderSource, TaskSpec,
};
use gpumesh::shaders::{adapter, BackendChoice, Executor, Job, Kernel};

const SQUARES: &str = r#"
@group(0) @binding(0) var<storage, read> xs: array<u32>;
@group(0) @binding(1) var<storage, read_write> squares: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    squares[gid.x] = xs[gid.x] * xs[gid.x];
}
"#;

fn main() -> anyhow::Result<()> {
    let n = 64 * 100u32;
    let xs: Vec<u8> = (0..n).flat_map(|x| x.to_le_bytes()).collect();
    let want: Vec<u8> = (0..n)
        .flat_map(|x| x.wrapping_mul(x).to_le_bytes())
        .collect();
    let blob = BlobId::of(&xs);
    let xs: Arc<[u8]> = Arc::from(xs);
    let kernel = Arc::new(Kernel::compile(SQUARES, "main")?);
    let job = |shards| {
        let spec = TaskSpec {
            shader: ShaderSource::Wgsl(SQUARES.into()),
            entry_point: "main".into(),
            bindings: vec![
                BindingSpec {
                    binding: 0,
                    role: BindingRole::Input {
                        blob,
                        size: xs.len() as u64,
                    },
                },
                BindingSpec {
                    binding: 1,
                    role: BindingRole::Output {
                        size: u64::from(n) * 4,
                    },
                },
            ],
            grid: Grid([n / 64, 1, 1]),
            shards,
            merge: MergeRule::Changes,
            merges: Default::default(),
            options: Default::default(),
        };
        Job::new(spec, kernel.clone(), |id| (*id == blob).then(|| xs.clone()))
    };
    let adapters = adapter::adapters(BackendChoice::Auto);
    anyhow::ensure!(!adapters.is_empty(), "no GPU adapter found");
    for a in adapters {
        let mut ex = Executor::with_adapter(a, Default::default())?;
        let whole = ex.run(&job(1)?, None)?;
        let sharded = ex.run(&job(5)?, None)?;
        let name = format!(
            "{} ({})",
            ex.capability().adapter_name,
            ex.capability().backend.name()
        );
        let out = sharded.outputs.get(&1).context("output 1")?;
        anyhow::ensure!(whole.outputs == sharded.outputs, "{name}: shards differ");
        anyhow::ensure!(*out == want, "{name}: wrong squares");
        println!(
            "{name}: 1 shard {:.2} ms, 5 shards {:.2} ms, results equal and match the CPU",
            whole.elapsed.as_secs_f64() * 1e3,
            sharded.elapsed.as_secs_f64() * 1e3
        );
    }
    Ok(())
}
