//! A Jacobi solver for A x = b as a chain of tasks on a 3-node mesh: each
//! iteration's merged output is a blob on the mesh that the next iteration takes as
//! its input, so x never travels back to this program between iterations.
//!
//! `cargo run --release --example jacobi`

#[path = "common/mod.rs"]
mod common;

use gpumesh::protocol::{
    BindingRole, BindingSpec, BlobId, Grid, MergeRule, ShaderSource, TaskSpec,
};
use gpumesh::shaders::builtins::jacobi_system;

const N: usize = 512;
const ITERATIONS: usize = 25;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let (a, b) = jacobi_system(N, 7);
    let mesh = common::LocalMesh::start("jacobi", 3).await?;
    let client = mesh.client(2);
    let a_id = client.upload(common::f32_bytes(&a)).await?;
    let b_id = client.upload(common::f32_bytes(&b)).await?;
    let mut x_id = client.upload(common::f32_bytes(&vec![0f32; N])).await?;
    let bytes = (N * 4) as u64;
    let input = |binding, blob: BlobId, size| BindingSpec {
        binding,
        role: BindingRole::Input { blob, size },
    };
    for it in 0..ITERATIONS {
        let spec = TaskSpec {
            shader: ShaderSource::Builtin("jacobi".into()),
            entry_point: "main".into(),
            bindings: vec![
                BindingSpec {
                    binding: 0,
                    role: BindingRole::Param {
                        data: [N as u32, 0, 0, 0]
                            .iter()
                            .flat_map(|v| v.to_le_bytes())
                            .collect(),
                    },
                },
                input(1, a_id, bytes * N as u64),
                input(2, b_id, bytes),
                input(3, x_id, bytes),
                BindingSpec {
                    binding: 4,
                    role: BindingRole::Output { size: bytes },
                },
            ],
            grid: Grid([(N / 64) as u32, 1, 1]),
            shards: 4,
            merge: MergeRule::Changes,
            merges: Default::default(),
            options: Default::default(),
        };
        let task = client.submit(spec, None).await?;
        client.wait(task, |_, _| {}).await?;
        // Only the hash comes back: the merged x stays on the node as a blob.
        let out = client.outputs(task).await?;
        x_id = out[0].blake3.parse()?;
        if it % 5 == 4 {
            println!(
                "iteration {:>2}: x is blob {}",
                it + 1,
                &out[0].blake3[..16]
            );
        }
    }
    // Fetch the final x once and check the residual on the CPU.
    let last = client.outputs_of_blob(x_id).await?;
    let x: Vec<f64> = last
        .chunks_exact(4)
        .map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
        .collect();
    let residual = (0..N)
        .map(|i| {
            let ax: f64 = (0..N).map(|j| f64::from(a[i * N + j]) * x[j]).sum();
            (ax - f64::from(b[i])).powi(2)
        })
        .sum::<f64>()
        .sqrt();
    let norm_b = b.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
    println!(
        "after {ITERATIONS} iterations: |Ax - b| / |b| = {:.2e} (checked on the CPU)",
        residual / norm_b
    );
    anyhow::ensure!(residual / norm_b < 1e-4, "Jacobi did not converge");
    mesh.stop().await;
    Ok(())
}
