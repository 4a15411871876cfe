//! Dense linear algebra kernels: vector add, matrix multiply, a regression gradient
//! and a Jacobi step.

use gpumesh_protocol::{ElemType, MergeRule};

use super::{close_f32, f32_bytes, round_up, Builtin, Problem, Rng};
use crate::error::Result;

pub(super) fn vector_add(builtin: &'static Builtin, size: u32) -> Result<Problem> {
    let n = round_up(size, 256)?;
    let mut rng = Rng::new(1);
    let (a, b) = (rng.f32s(n as usize), rng.f32s(n as usize));
    let mut p = Problem::new(builtin, n, [n / 256, 1, 1], MergeRule::Changes);
    p.input(0, f32_bytes(&a));
    p.input(1, f32_bytes(&b));
    p.output(2, u64::from(n) * 4);
    p.flops = f64::from(n);
    p.reference = Box::new(move |outputs| {
        // f32 addition is correctly rounded everywhere: the sums must be exact.
        let want: Vec<f64> = a.iter().zip(&b).map(|(x, y)| f64::from(x + y)).collect();
        close_f32(outputs, 2, &want, |_| 0.0, "bit-exact")
    });
    Ok(p)
}

pub(super) fn matmul(builtin: &'static Builtin, size: u32) -> Result<Problem> {
    let n = round_up(size, 64)?;
    let len = (n as usize) * (n as usize);
    let mut rng = Rng::new(2);
    let (a, b) = (rng.f32s(len), rng.f32s(len));
    let mut p = Problem::new(builtin, n, [n / 64, n / 64, 1], MergeRule::Changes);
    p.param(0, [n, 0, 0, 0]);
    p.input(1, f32_bytes(&a));
    p.input(2, f32_bytes(&b));
    p.output(3, len as u64 * 4);
    p.flops = 2.0 * f64::from(n).powi(3);
    p.reference = Box::new(move |outputs| {
        let (want, magnitude) = matmul_reference(&a, &b, n as usize);
        // Recursive summation of n products errs by at most about n·ε·Σ|a||b|.
        let eps = f64::from(f32::EPSILON);
        close_f32(
            outputs,
            3,
            &want,
            |i| 2.0 * f64::from(n) * eps * magnitude[i] + 1e-30,
            "2·n·ε·Σ|a||b| per element",
        )
    });
    Ok(p)
}

/// C = A B in f64, and Σ_k |a_ik b_kj| for the error bound.
pub fn matmul_reference(a: &[f32], b: &[f32], n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut c = vec![0.0f64; n * n];
    let mut m = vec![0.0f64; n * n];
    for i in 0..n {
        for k in 0..n {
            let aik = f64::from(a[i * n + k]);
            let row_c = &mut c[i * n..(i + 1) * n];
            let row_b = &b[k * n..(k + 1) * n];
            for (cj, &bkj) in row_c.iter_mut().zip(row_b) {
                *cj += aik * f64::from(bkj);
            }
            let row_m = &mut m[i * n..(i + 1) * n];
            for (mj, &bkj) in row_m.iter_mut().zip(row_b) {
                *mj += (aik * f64::from(bkj)).abs();
            }
        }
    }
    (c, m)
}

const FEATURES: u32 = 8;

pub(super) fn linreg_grad(builtin: &'static Builtin, size: u32) -> Result<Problem> {
    let rows = round_up(size, 256)?;
    let d = FEATURES as usize;
    let mut rng = Rng::new(3);
    let x = rng.f32s(rows as usize * d);
    let true_w: Vec<f32> = (0..d).map(|j| j as f32 * 0.25 - 1.0).collect();
    let y: Vec<f32> = x
        .chunks_exact(d)
        .map(|xi| xi.iter().zip(&true_w).map(|(a, b)| a * b).sum::<f32>() + 0.01 * rng.unit_f32())
        .collect();
    let w = vec![0.0f32; d];
    let scale = 2.0 / rows as f32;
    let mut p = Problem::new(
        builtin,
        rows,
        [rows / 256, 1, 1],
        MergeRule::Sum(ElemType::F32),
    );
    p.param(0, [rows, FEATURES, scale.to_bits(), 0]);
    p.input(1, f32_bytes(&x));
    p.input(2, f32_bytes(&y));
    p.input(3, f32_bytes(&w));
    p.output(4, u64::from(FEATURES) * 4);
    p.flops = 4.0 * f64::from(rows) * f64::from(FEATURES);
    p.reference = Box::new(move |outputs| {
        let (grad, magnitude) = linreg_reference(&x, &y, &w, d, f64::from(scale));
        close_f32(
            outputs,
            4,
            &grad,
            |j| 1e-4 * magnitude[j] + 1e-7,
            "1e-4 relative to Σ|terms|",
        )
    });
    Ok(p)
}

/// The gradient in f64, and scale·Σ_i |r_i x_ij| for the error bound.
pub fn linreg_reference(
    x: &[f32],
    y: &[f32],
    w: &[f32],
    d: usize,
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let mut grad = vec![0.0f64; d];
    let mut magnitude = vec![0.0f64; d];
    for (xi, &yi) in x.chunks_exact(d).zip(y) {
        let r: f64 = xi
            .iter()
            .zip(w)
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum::<f64>()
            - f64::from(yi);
        for j in 0..d {
            grad[j] += r * f64::from(xi[j]);
            magnitude[j] += (r * f64::from(xi[j])).abs();
        }
    }
    (
        grad.iter().map(|g| g * scale).collect(),
        magnitude.iter().map(|m| m * scale).collect(),
    )
}

pub(super) fn jacobi(builtin: &'static Builtin, size: u32) -> Result<Problem> {
    let n = round_up(size, 64)?;
    let (a, b) = jacobi_system(n as usize, 4);
    let x = vec![0.5f32; n as usize];
    let mut p = Problem::new(builtin, n, [n / 64, 1, 1], MergeRule::Changes);
    p.param(0, [n, 0, 0, 0]);
    p.input(1, f32_bytes(&a));
    p.input(2, f32_bytes(&b));
    p.input(3, f32_bytes(&x));
    p.output(4, u64::from(n) * 4);
    p.flops = 2.0 * f64::from(n) * f64::from(n);
    p.reference = Box::new(move |outputs| {
        let n = n as usize;
        let eps = f64::from(f32::EPSILON);
        let mut want = vec![0.0; n];
        let mut bound = vec![0.0; n];
        for i in 0..n {
            let row = &a[i * n..(i + 1) * n];
            let mut sigma = 0.0f64;
            let mut magnitude = f64::from(b[i]).abs();
            for j in (0..n).filter(|&j| j != i) {
                sigma += f64::from(row[j]) * f64::from(x[j]);
                magnitude += (f64::from(row[j]) * f64::from(x[j])).abs();
            }
            let diag = f64::from(row[i]).abs();
            want[i] = (f64::from(b[i]) - sigma) / f64::from(row[i]);
            bound[i] = 2.0 * n as f64 * eps * magnitude / diag + 2.0 * eps * want[i].abs();
        }
        close_f32(
            outputs,
            4,
            &want,
            |i| bound[i],
            "2·n·ε relative to the row's magnitude",
        )
    });
    Ok(p)
}

/// A strictly diagonally dominant system (so Jacobi converges) and its right side.
pub fn jacobi_system(n: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut rng = Rng::new(seed);
    let mut a = rng.f32s(n * n);
    for i in 0..n {
        let off: f32 = (0..n).filter(|&j| j != i).map(|j| a[i * n + j].abs()).sum();
        a[i * n + i] = off + 1.0;
    }
    let b = rng.f32s(n);
    (a, b)
}
