//! Distributed linear regression: gradient steps over sharded data on a 3-node mesh.
//! Each step is one task whose shards each sum the gradient of their rows; the
//! partials merge with `sum-f32`. The data is uploaded once and stays on the mesh;
//! only the 8 weights travel per step.
//!
//! `cargo run --release --example linear_regression`

#[path = "common/mod.rs"]
mod common;

use gpumesh::protocol::{
    BindingRole, BindingSpec, ElemType, Grid, MergeRule, ShaderSource, TaskSpec,
};

const ROWS: u32 = 1 << 16;
const FEATURES: usize = 8;
const STEPS: usize = 40;
const RATE: f32 = 0.5;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let (true_w, x, y) = common::regression_data(ROWS as usize, FEATURES);

    let mesh = common::LocalMesh::start("linreg", 3).await?;
    let client = mesh.client(1);
    let xs = client.upload(common::f32_bytes(&x)).await?;
    let ys = client.upload(common::f32_bytes(&y)).await?;
    let mut w = vec![0f32; FEATURES];
    let scale = 2.0 / ROWS as f32;
    for step in 0..STEPS {
        let wb = common::f32_bytes(&w);
        let wid = client.upload(wb.clone()).await?;
        let input = |binding, blob, size: usize| BindingSpec {
            binding,
            role: BindingRole::Input {
                blob,
                size: size as u64,
            },
        };
        let spec = TaskSpec {
            shader: ShaderSource::Builtin("linreg_grad".into()),
            entry_point: "main".into(),
            bindings: vec![
                BindingSpec {
                    binding: 0,
                    role: BindingRole::Param {
                        data: [ROWS, FEATURES as u32, scale.to_bits(), 0]
                            .iter()
                            .flat_map(|v| v.to_le_bytes())
                            .collect(),
                    },
                },
                input(1, xs, x.len() * 4),
                input(2, ys, y.len() * 4),
                input(3, wid, wb.len()),
                BindingSpec {
                    binding: 4,
                    role: BindingRole::Output {
                        size: FEATURES as u64 * 4,
                    },
                },
            ],
            grid: Grid([ROWS / 256, 1, 1]),
            shards: 4,
            merge: MergeRule::Sum(ElemType::F32),
            merges: Default::default(),
            options: Default::default(),
        };
        let task = client.submit(spec, None).await?;
        client.wait(task, |_, _| {}).await?;
        let out = client.results(task).await?;
        let grad: Vec<f32> = out[&4]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        // Check this step's gradient against the CPU.
        let (want, _) =
            gpumesh::shaders::builtins::linreg_reference(&x, &y, &w, FEATURES, f64::from(scale));
        let err = grad
            .iter()
            .zip(&want)
            .map(|(g, r)| (f64::from(*g) - r).abs())
            .fold(0.0, f64::max);
        anyhow::ensure!(
            err < 1e-3,
            "step {step}: GPU gradient differs from the CPU by {err}"
        );
        for (wj, gj) in w.iter_mut().zip(&grad) {
            *wj -= RATE * gj;
        }
        if step % 10 == 0 || step == STEPS - 1 {
            let dist: f32 = w
                .iter()
                .zip(&true_w)
                .map(|(a, b)| (a - b).powi(2))
                .sum::<f32>()
                .sqrt();
            println!(
                "step {step:>3}: |w - w_true| = {dist:.5} (gradient within {err:.1e} of the CPU)"
            );
        }
    }
    let dist: f32 = w
        .iter()
        .zip(&true_w)
        .map(|(a, b)| (a - b).powi(2))
        .sum::<f32>()
        .sqrt();
    anyhow::ensure!(dist < 0.05, "did not converge: {dist}");
    println!("learned w = {w:.3?}\ntrue    w = {true_w:.3?}");
    mesh.stop().await;
    Ok(())
}
