//! Combining shard outputs into task outputs.
//!
//! `concat` joins each shard's slice in shard order; `sum`, `min` and `max` fold
//! full-size partials elementwise, in shard order so float sums are reproducible.
//! Reduction outputs start from the rule's identity element, so a shard that leaves
//! an element untouched does not disturb it.

use std::collections::BTreeMap;

use gpumesh_protocol::{ElemType, MergeRule};

use crate::error::{ExecError, Result};
use crate::job::ShardOutput;

/// The 4 bytes every element of an output starts as under `rule`.
pub fn identity(rule: MergeRule) -> [u8; 4] {
    match rule {
        MergeRule::Concat | MergeRule::Sum(_) => [0; 4],
        MergeRule::Min(ElemType::U32) => u32::MAX.to_le_bytes(),
        MergeRule::Min(ElemType::I32) => i32::MAX.to_le_bytes(),
        MergeRule::Min(ElemType::F32) => f32::INFINITY.to_le_bytes(),
        MergeRule::Max(ElemType::U32) => 0u32.to_le_bytes(),
        MergeRule::Max(ElemType::I32) => i32::MIN.to_le_bytes(),
        MergeRule::Max(ElemType::F32) => f32::NEG_INFINITY.to_le_bytes(),
    }
}

/// Merges the outputs of all shards of a task. `outputs` gives each output's size.
pub fn merge(
    rule: MergeRule,
    outputs: &BTreeMap<u32, u64>,
    shards: &[ShardOutput],
) -> Result<BTreeMap<u32, Vec<u8>>> {
    let mut ordered: Vec<&ShardOutput> = shards.iter().collect();
    ordered.sort_by_key(|s| s.range.index);
    for (i, s) in ordered.iter().enumerate() {
        if s.range.index != i as u32 {
            return Err(ExecError::Merge(format!(
                "shard {i} is missing (have {} shards)",
                ordered.len()
            )));
        }
    }
    let mut merged = BTreeMap::new();
    for (&binding, &size) in outputs {
        let parts = ordered
            .iter()
            .map(|s| {
                s.outputs.get(&binding).ok_or_else(|| {
                    ExecError::Merge(format!("shard {} has no output {binding}", s.range.index))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let out = match rule {
            MergeRule::Concat => parts.iter().flat_map(|p| p.iter().copied()).collect(),
            _ => reduce(rule, size, &parts)?,
        };
        if out.len() as u64 != size {
            return Err(ExecError::Merge(format!(
                "output {binding} merged to {} bytes, expected {size}",
                out.len()
            )));
        }
        merged.insert(binding, out);
    }
    Ok(merged)
}

fn reduce(rule: MergeRule, size: u64, parts: &[&Vec<u8>]) -> Result<Vec<u8>> {
    if let Some(p) = parts.iter().find(|p| p.len() as u64 != size) {
        return Err(ExecError::Merge(format!(
            "a partial of {} bytes cannot merge into an output of {size}",
            p.len()
        )));
    }
    let Some((first, rest)) = parts.split_first() else {
        return Err(ExecError::Merge("no shard outputs to merge".into()));
    };
    let mut acc = first.to_vec();
    for part in rest {
        for (a, p) in acc.chunks_exact_mut(4).zip(part.chunks_exact(4)) {
            let (x, y) = ([a[0], a[1], a[2], a[3]], [p[0], p[1], p[2], p[3]]);
            let r = match rule {
                MergeRule::Sum(ElemType::U32) => u32::from_le_bytes(x)
                    .wrapping_add(u32::from_le_bytes(y))
                    .to_le_bytes(),
                MergeRule::Sum(ElemType::I32) => i32::from_le_bytes(x)
                    .wrapping_add(i32::from_le_bytes(y))
                    .to_le_bytes(),
                MergeRule::Sum(ElemType::F32) => {
                    (f32::from_le_bytes(x) + f32::from_le_bytes(y)).to_le_bytes()
                }
                MergeRule::Min(ElemType::U32) => u32::from_le_bytes(x)
                    .min(u32::from_le_bytes(y))
                    .to_le_bytes(),
                MergeRule::Min(ElemType::I32) => i32::from_le_bytes(x)
                    .min(i32::from_le_bytes(y))
                    .to_le_bytes(),
                MergeRule::Min(ElemType::F32) => f32::from_le_bytes(x)
                    .min(f32::from_le_bytes(y))
                    .to_le_bytes(),
                MergeRule::Max(ElemType::U32) => u32::from_le_bytes(x)
                    .max(u32::from_le_bytes(y))
                    .to_le_bytes(),
                MergeRule::Max(ElemType::I32) => i32::from_le_bytes(x)
                    .max(i32::from_le_bytes(y))
                    .to_le_bytes(),
                MergeRule::Max(ElemType::F32) => f32::from_le_bytes(x)
                    .max(f32::from_le_bytes(y))
                    .to_le_bytes(),
                MergeRule::Concat => y,
            };
            a.copy_from_slice(&r);
        }
    }
    Ok(acc)
}
