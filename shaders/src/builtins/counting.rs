//! Counting kernels: Monte Carlo pi and a histogram.

use gpumesh_protocol::{ElemType, MergeRule};

use super::{exact_u32, round_up, u32_bytes, Builtin, Problem, Rng};
use crate::error::Result;

const SAMPLES: u32 = 256;
const SEED: u32 = 0x5eed;

pub(super) fn montecarlo_pi(builtin: &'static Builtin, size: u32) -> Result<Problem> {
    let invocations = round_up(size, 64)?;
    let groups = invocations / 64;
    let mut p = Problem::new(builtin, invocations, [groups, 1, 1], MergeRule::Changes);
    p.param(0, [SAMPLES, SEED, 0, 0]);
    p.output(1, u64::from(groups) * 4);
    p.reference = Box::new(move |outputs| {
        let want = montecarlo_reference(groups, SAMPLES, SEED);
        let mut agreement = exact_u32(outputs, 1, &want)?;
        let hits: u64 = want.iter().map(|&h| u64::from(h)).sum();
        let total = u64::from(invocations) * u64::from(SAMPLES);
        agreement.note = Some(format!("pi ≈ {:.6}", 4.0 * hits as f64 / total as f64));
        Ok(agreement)
    });
    Ok(p)
}

fn hash(v: u32) -> u32 {
    let state = v.wrapping_mul(747_796_405).wrapping_add(2_891_336_453);
    let word = ((state >> ((state >> 28) + 4)) ^ state).wrapping_mul(277_803_737);
    (word >> 22) ^ word
}

/// Hits per 64-invocation workgroup, as the shader counts them.
pub fn montecarlo_reference(groups: u32, samples: u32, seed: u32) -> Vec<u32> {
    (0..groups)
        .map(|g| {
            let mut hits = 0u32;
            for inv in g * 64..(g + 1) * 64 {
                for s in 0..samples {
                    let base = inv.wrapping_mul(samples).wrapping_add(s).wrapping_mul(2);
                    let x = hash(base ^ seed) >> 17;
                    let y = hash(base.wrapping_add(1) ^ seed) >> 17;
                    if x * x + y * y < 1 << 30 {
                        hits += 1;
                    }
                }
            }
            hits
        })
        .collect()
}

pub(super) fn histogram(builtin: &'static Builtin, size: u32) -> Result<Problem> {
    let n = round_up(size, 2048)?;
    let mut rng = Rng::new(6);
    // Skewed so that bins see very different counts.
    let values: Vec<u32> = (0..n).map(|_| rng.next_u32().min(rng.next_u32())).collect();
    let mut p = Problem::new(builtin, n, [n / 2048, 1, 1], MergeRule::Sum(ElemType::U32));
    p.input(0, u32_bytes(&values));
    p.output(1, 256 * 4);
    p.reference = Box::new(move |outputs| {
        let mut bins = vec![0u32; 256];
        for v in &values {
            bins[(v >> 24) as usize] += 1;
        }
        exact_u32(outputs, 1, &bins)
    });
    Ok(p)
}
