//! Linear regression whose weights live in a GPU actor: each gradient step is one
//! call that reads the data (uploaded once) and updates the weights in place on the
//! actor's host. Calls alternate between two nodes; the weights never leave the GPU
//! until the end, and then match a CPU run of the same steps.
//!
//! `cargo run --release --example linear_regression_actors`

#[path = "common/mod.rs"]
mod common;

use gpumesh::node::api::StateInit;
use gpumesh::protocol::{ActorCall, BindingRole, BindingSpec, BlobId, Grid, ShaderSource};

const ROWS: usize = 1 << 14;
const FEATURES: usize = 8;
const STEPS: usize = 30;
const RATE: f32 = 0.5;

/// One gradient step of the mean squared error, in one workgroup: each thread sums
/// its rows' share of every feature's gradient, the workgroup reduces them, and the
/// first threads update the weights (the actor's state) in place.
const STEP: &str = r#"
struct Params { rows: u32, features: u32, rate: f32, _pad: u32 }
@group(0) @binding(0) var<storage, read_write> w: array<f32>;
@group(0) @binding(1) var<uniform> params: Params;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read> y: array<f32>;

var<workgroup> partial: array<f32, 256>;
var<workgroup> grad: array<f32, 16>;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) li: u32) {
    let d = params.features;
    for (var j = 0u; j < d; j++) {
        var acc = 0.0;
        for (var i = li; i < params.rows; i += 256u) {
            var pred = 0.0;
            for (var k = 0u; k < d; k++) {
                pred += x[i * d + k] * w[k];
            }
            acc += (pred - y[i]) * x[i * d + j];
        }
        partial[li] = acc;
        workgroupBarrier();
        for (var s = 128u; s > 0u; s >>= 1u) {
            if (li < s) {
                partial[li] += partial[li + s];
            }
            workgroupBarrier();
        }
        if (li == 0u) {
            grad[j] = partial[0] * 2.0 / f32(params.rows);
        }
        workgroupBarrier();
    }
    if (li < d) {
        w[li] = w[li] - params.rate * grad[li];
    }
}
"#;

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The same step on the CPU, in f64.
fn cpu_step(x: &[f32], y: &[f32], w: &mut [f64]) {
    let mut grad = vec![0f64; FEATURES];
    for (row, yi) in x.chunks_exact(FEATURES).zip(y) {
        let pred: f64 = row
            .iter()
            .zip(w.iter())
            .map(|(a, b)| f64::from(*a) * b)
            .sum();
        for (g, xj) in grad.iter_mut().zip(row) {
            *g += (pred - f64::from(*yi)) * f64::from(*xj);
        }
    }
    for (wj, gj) in w.iter_mut().zip(&grad) {
        *wj -= f64::from(RATE) * gj * 2.0 / ROWS as f64;
    }
}

fn step_call(xs: BlobId, ys: BlobId) -> ActorCall {
    let params: Vec<u8> = [ROWS as u32, FEATURES as u32, RATE.to_bits(), 0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let input = |binding, blob, size: usize| BindingSpec {
        binding,
        role: BindingRole::Input {
            blob,
            size: size as u64,
        },
    };
    ActorCall {
        shader: ShaderSource::Wgsl(STEP.into()),
        entry_point: "main".into(),
        bindings: vec![
            BindingSpec {
                binding: 1,
                role: BindingRole::Param { data: params },
            },
            input(2, xs, ROWS * FEATURES * 4),
            input(3, ys, ROWS * 4),
        ],
        grid: Grid([1, 1, 1]),
        deadline_ms: None,
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let (true_w, x, y) = common::regression_data(ROWS, FEATURES);

    let mesh = common::LocalMesh::start("linreg-actors", 3).await?;
    let (a, b) = (mesh.client(0), mesh.client(1));
    let xs = a.upload(common::f32_bytes(&x)).await?;
    let ys = a.upload(common::f32_bytes(&y)).await?;
    // A call reads its inputs from the node it goes through: both hold the data.
    b.upload(common::f32_bytes(&x)).await?;
    b.upload(common::f32_bytes(&y)).await?;
    let weights = vec![StateInit {
        binding: 0,
        size: (FEATURES * 4) as u64,
        blob: None,
    }];
    let model = a.create_actor("model", weights, None).await?;
    println!(
        "actor {} created; calls alternate between two nodes",
        model.name
    );

    let mut cpu = vec![0f64; FEATURES];
    for step in 0..STEPS {
        let via = if step % 2 == 0 { &a } else { &b };
        let reply = via.call_actor("model", step_call(xs, ys), None).await?;
        cpu_step(&x, &y, &mut cpu);
        if step % 10 == 0 || step == STEPS - 1 {
            println!("step {step:>3}: state version {}", reply.version);
        }
    }
    let w = f32s(&b.actor_state("model", 0).await?);
    let err = w
        .iter()
        .zip(&cpu)
        .map(|(g, c)| (f64::from(*g) - c).abs())
        .fold(0.0, f64::max);
    anyhow::ensure!(
        err < 1e-3,
        "the actor's weights differ from the CPU's by {err}"
    );
    let dist: f32 = w
        .iter()
        .zip(&true_w)
        .map(|(a, b)| (a - b).powi(2))
        .sum::<f32>()
        .sqrt();
    anyhow::ensure!(dist < 0.05, "did not converge: {dist}");
    let host = b.actor("model").await?;
    println!(
        "learned w = {w:.3?}\ntrue    w = {true_w:.3?}\nwithin {err:.1e} of the CPU; {} calls on host {}",
        host.version, host.host
    );
    mesh.stop().await;
    Ok(())
}
