//! Combining shard results into task outputs.
//!
//! Every shard ran against the writable buffers as the unsharded run would see them
//! and returned the words it changed ([`ShardChanges`]). Merging starts from the
//! same starting contents and, per rule:
//!
//! - `changes` (the default): writes each shard's changed words. A word changed by
//!   two shards must have been changed to the same value; otherwise the shards'
//!   answers cannot be combined into the unsharded one and the merge fails with a
//!   [`ExecError::Conflict`] naming the binding, the byte offset and the shards.
//! - `sum`, `min`, `max`, `or`, `and`, `xor`: every shard's buffers started from
//!   the rule's identity, so each is a partial; partials fold elementwise in shard
//!   order (so float sums are reproducible). A word one shard alone changed takes that shard's value as is.
//!   A binding that holds no atomics is written with plain stores, so its words are
//!   values, not partials: one that two shards changed merges as under `changes`
//!   (a flag every shard set to 1 stays 1 under `sum`; different values are a
//!   [`ExecError::StoredConflict`]).
//!
//! With one shard both rules give that shard's buffers exactly.

use std::collections::BTreeMap;

use gpumesh_protocol::{Base, BufferChanges, ElemType, MergeRule, Run, ShardChanges, TaskSpec};

use crate::error::{ExecError, Result};
use crate::kernel::AtomicWords;
#[cfg(doc)]
use crate::kernel::Interface;

/// The 4 bytes every word of an output starts as under `rule`.
pub fn identity(rule: MergeRule) -> [u8; 4] {
    match rule {
        MergeRule::Changes | MergeRule::Sum(_) | MergeRule::Or(_) | MergeRule::Xor(_) => [0; 4],
        MergeRule::And(_) => [0xff; 4],
        MergeRule::Min(ElemType::U32) => u32::MAX.to_le_bytes(),
        MergeRule::Min(ElemType::I32) => i32::MAX.to_le_bytes(),
        MergeRule::Min(ElemType::F32) => f32::INFINITY.to_le_bytes(),
        MergeRule::Max(ElemType::U32) => 0u32.to_le_bytes(),
        MergeRule::Max(ElemType::I32) => i32::MIN.to_le_bytes(),
        MergeRule::Max(ElemType::F32) => f32::NEG_INFINITY.to_le_bytes(),
    }
}

/// One writable binding to merge into: its rule, size and starting contents.
#[derive(Clone, Copy, Debug)]
pub struct Target<'a> {
    pub rule: MergeRule,
    pub size: u64,
    pub base: Base<'a>,
    /// Which of its words hold atomics, so hold partials; the others hold values
    /// plain stores set. `None`: no word does.
    pub atomic: Option<&'a AtomicWords>,
}

/// Every writable binding of `spec` as a merge target; `atomic` gives which words
/// of a binding hold atomics ([`Interface::atomic_words`]), `start` the bytes an
/// in-out binding starts as (the others start as their rule's identity).
pub fn targets<'a>(
    spec: &TaskSpec,
    atomic: impl Fn(u32) -> Option<&'a AtomicWords>,
    start: impl Fn(u32) -> Option<&'a [u8]>,
) -> BTreeMap<u32, Target<'a>> {
    spec.bindings
        .iter()
        .filter(|b| b.role.is_writable())
        .map(|b| {
            let target = Target {
                rule: spec.merge_of(b.binding),
                size: b.role.size(),
                base: base(spec, b.binding, &start),
                atomic: atomic(b.binding),
            };
            (b.binding, target)
        })
        .collect()
}

/// What each writable binding of `spec` starts as in every shard: the bytes
/// `start` gives (an in-out binding's), else its rule's identity.
pub fn bases<'a>(
    spec: &TaskSpec,
    start: impl Fn(u32) -> Option<&'a [u8]>,
) -> BTreeMap<u32, Base<'a>> {
    spec.bindings
        .iter()
        .filter(|b| b.role.is_writable())
        .map(|b| (b.binding, base(spec, b.binding, &start)))
        .collect()
}

/// What writable `binding` of `spec` starts as: the bytes `start` gives, else its
/// rule's identity.
fn base<'a>(spec: &TaskSpec, binding: u32, start: &impl Fn(u32) -> Option<&'a [u8]>) -> Base<'a> {
    match start(binding) {
        Some(bytes) => Base::Bytes(bytes),
        None => Base::Fill(identity(spec.merge_of(binding))),
    }
}

/// Merges shard results, given in shard order, into each writable binding's final
/// bytes.
pub fn merge(
    targets: &BTreeMap<u32, Target<'_>>,
    shards: &[&ShardChanges],
) -> Result<BTreeMap<u32, Vec<u8>>> {
    if shards.is_empty() {
        return Err(ExecError::Merge("no shard results to merge".into()));
    }
    let mut merged = BTreeMap::new();
    for (
        &binding,
        &Target {
            rule,
            size,
            base,
            atomic,
        },
    ) in targets
    {
        let fits = match base {
            Base::Bytes(b) => b.len() as u64 == size,
            Base::Fill(_) => true,
        };
        if size % 4 != 0 || !fits {
            return Err(ExecError::Merge(format!(
                "binding {binding}: its starting contents do not fill a {size}-byte buffer of \
                 whole words"
            )));
        }
        let mut out = base.materialise(size as usize);
        let mut written = Written::new(size);
        for (k, shard) in shards.iter().enumerate() {
            let changes = shard.0.get(&binding).ok_or_else(|| {
                ExecError::Merge(format!("shard {k} has no result for binding {binding}"))
            })?;
            if changes.size != size {
                return Err(ExecError::Merge(format!(
                    "shard {k}'s result for binding {binding} is of a {}-byte buffer, not {size}",
                    changes.size
                )));
            }
            for (run, bytes) in changes.iter() {
                let at = run.offset as usize;
                if written.none_in(run) {
                    out[at..at + bytes.len()].copy_from_slice(bytes);
                    written.set(run);
                    continue;
                }
                for (i, new) in bytes.chunks_exact(4).enumerate() {
                    let w = at + 4 * i;
                    let word = (w / 4) as u64;
                    let old = &mut out[w..w + 4];
                    if !written.get(word) {
                        old.copy_from_slice(new);
                        written.set_word(word);
                        continue;
                    }
                    match rule {
                        MergeRule::Changes if old != new => {
                            let first = first_writer(&shards[..k], binding, w as u64);
                            return Err(ExecError::Conflict {
                                binding,
                                offset: w as u64,
                                shards: (first.unwrap_or(0), k as u32),
                                values: (word_of(old), word_of(new)),
                            });
                        }
                        MergeRule::Changes => {}
                        // Two shards stored a value here: not partials to fold.
                        _ if !atomic.is_some_and(|a| a.get(word)) && old != new => {
                            let first = first_writer(&shards[..k], binding, w as u64);
                            return Err(ExecError::StoredConflict {
                                binding,
                                offset: w as u64,
                                shards: (first.unwrap_or(0), k as u32),
                                values: (word_of(old), word_of(new)),
                                rule,
                            });
                        }
                        _ if !atomic.is_some_and(|a| a.get(word)) => {}
                        _ => {
                            let r = fold(rule, word_of(old), word_of(new));
                            old.copy_from_slice(&r.to_le_bytes());
                        }
                    }
                }
            }
        }
        merged.insert(binding, out);
    }
    Ok(merged)
}

/// The first of `shards` that changed the word at byte `offset` of `binding`.
fn first_writer(shards: &[&ShardChanges], binding: u32, offset: u64) -> Option<u32> {
    shards
        .iter()
        .position(|s| {
            s.0.get(&binding).is_some_and(|c: &BufferChanges| {
                c.runs()
                    .iter()
                    .any(|r| r.offset <= offset && offset < r.end())
            })
        })
        .map(|k| k as u32)
}

fn word_of(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// One reduction step on the bit patterns of two words.
fn fold(rule: MergeRule, a: u32, b: u32) -> u32 {
    let (fa, fb) = (f32::from_bits(a), f32::from_bits(b));
    let (ia, ib) = (a as i32, b as i32);
    match rule {
        MergeRule::Sum(ElemType::U32) => a.wrapping_add(b),
        MergeRule::Sum(ElemType::I32) => ia.wrapping_add(ib) as u32,
        MergeRule::Sum(ElemType::F32) => (fa + fb).to_bits(),
        MergeRule::Min(ElemType::U32) => a.min(b),
        MergeRule::Min(ElemType::I32) => ia.min(ib) as u32,
        MergeRule::Min(ElemType::F32) => fa.min(fb).to_bits(),
        MergeRule::Max(ElemType::U32) => a.max(b),
        MergeRule::Max(ElemType::I32) => ia.max(ib) as u32,
        MergeRule::Max(ElemType::F32) => fa.max(fb).to_bits(),
        // On the bits, whatever the type (an f32 is refused before anything runs).
        MergeRule::Or(_) => a | b,
        MergeRule::And(_) => a & b,
        MergeRule::Xor(_) => a ^ b,
        MergeRule::Changes => b,
    }
}

/// Which words of a buffer some shard has written so far: one bit per word.
struct Written(Vec<u64>);

impl Written {
    fn new(size: u64) -> Self {
        Written(vec![0; (size / 4).div_ceil(64) as usize])
    }

    fn get(&self, word: u64) -> bool {
        self.0[(word / 64) as usize] & (1 << (word % 64)) != 0
    }

    fn set_word(&mut self, word: u64) {
        self.0[(word / 64) as usize] |= 1 << (word % 64);
    }

    /// Bit masks of the 64-bit blocks covering `run`'s words.
    fn blocks(run: Run) -> impl Iterator<Item = (usize, u64)> {
        let (first, end) = (run.offset / 4, run.end() / 4);
        (first / 64..end.div_ceil(64)).map(move |block| {
            let lo = first.max(block * 64) - block * 64;
            let hi = end.min(block * 64 + 64) - block * 64;
            let mask = if hi - lo == 64 {
                u64::MAX
            } else {
                ((1u64 << (hi - lo)) - 1) << lo
            };
            (block as usize, mask)
        })
    }

    fn none_in(&self, run: Run) -> bool {
        Self::blocks(run).all(|(b, mask)| self.0[b] & mask == 0)
    }

    fn set(&mut self, run: Run) {
        for (b, mask) in Self::blocks(run) {
            self.0[b] |= mask;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn words(v: &[u32]) -> Vec<u8> {
        v.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// A shard's result for binding 0: `after` against `before`.
    fn shard(before: &[u32], after: &[u32]) -> ShardChanges {
        let b = words(before);
        ShardChanges(BTreeMap::from([(
            0,
            BufferChanges::diff(Base::Bytes(&b), &words(after)),
        )]))
    }

    fn run(rule: MergeRule, start: &[u32], shards: &[ShardChanges]) -> Result<Vec<u32>> {
        let all = AtomicWords::fixed(vec![true; start.len()]);
        run_target(rule, Some(&all), start, shards)
    }

    /// [`run`], of a binding whose words hold atomics where `atomic` says.
    fn run_target(
        rule: MergeRule,
        atomic: Option<&AtomicWords>,
        start: &[u32],
        shards: &[ShardChanges],
    ) -> Result<Vec<u32>> {
        let s = words(start);
        let target = Target {
            rule,
            size: s.len() as u64,
            base: Base::Bytes(&s),
            atomic,
        };
        let refs: Vec<&ShardChanges> = shards.iter().collect();
        let out = merge(&BTreeMap::from([(0, target)]), &refs)?;
        Ok(out[&0]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    #[test]
    fn changes_apply_each_shards_words_over_the_start() {
        let start = [7, 7, 7, 7, 7, 7];
        let a = shard(&start, &[1, 2, 7, 7, 7, 7]);
        let b = shard(&start, &[7, 7, 7, 4, 5, 7]);
        assert_eq!(
            run(MergeRule::Changes, &start, &[a, b]).unwrap(),
            [1, 2, 7, 4, 5, 7]
        );
    }

    #[test]
    fn ragged_shares_need_no_divisibility() {
        // 5 words over 3 shards in uneven pieces, and one shard that wrote nothing.
        let start = [0; 5];
        let shards = [
            shard(&start, &[1, 0, 0, 0, 0]),
            shard(&start, &[0, 0, 0, 0, 0]),
            shard(&start, &[0, 2, 3, 4, 5]),
        ];
        assert_eq!(
            run(MergeRule::Changes, &start, &shards).unwrap(),
            [1, 2, 3, 4, 5]
        );
    }

    #[test]
    fn the_same_value_from_two_shards_is_not_a_conflict() {
        let start = [0, 0];
        let shards = [shard(&start, &[9, 1]), shard(&start, &[9, 0])];
        assert_eq!(run(MergeRule::Changes, &start, &shards).unwrap(), [9, 1]);
    }

    #[test]
    fn different_values_in_one_word_are_a_conflict_naming_where() {
        let start = [0; 200];
        let mut x = [0; 200];
        let mut y = [0; 200];
        x[100..130].fill(1);
        y[129] = 2; // the last word shard 1 changed, inside shard 0's run
        let third = [0; 200];
        let e = run(
            MergeRule::Changes,
            &start,
            &[shard(&start, &third), shard(&start, &x), shard(&start, &y)],
        )
        .unwrap_err();
        match &e {
            ExecError::Conflict {
                binding,
                offset,
                shards,
                values,
            } => {
                assert_eq!(
                    (*binding, *offset, *shards, *values),
                    (0, 129 * 4, (1, 2), (1, 2))
                );
            }
            other => panic!("not a conflict: {other}"),
        }
        let text = e.to_string();
        assert!(
            text.contains("conflict") && text.contains("--shards 1"),
            "{text}"
        );
        assert!(
            text.contains("binding 0") && text.contains("byte offset 516"),
            "{text}"
        );
    }

    /// Under a reduction, a word that holds no atomic holds a value, not a partial:
    /// one two shards stored alike keeps its value (a flag under sum is 1, not 2),
    /// different values are a conflict naming the rule; an atomic word beside it
    /// (a struct of both) folds. Before, the sum of the shards' stores came back: 3
    /// for a flag three shards set.
    #[test]
    fn words_stored_by_two_shards_are_values_not_partials() {
        let id = [0; 3];
        let flags = [
            shard(&id, &[1, 5, 0]),
            shard(&id, &[1, 0, 0]),
            shard(&id, &[1, 0, 7]),
        ];
        let sum = MergeRule::Sum(ElemType::U32);
        assert_eq!(run_target(sum, None, &id, &flags).unwrap(), [1, 5, 7]);
        let counts = AtomicWords::fixed(vec![true; 3]);
        assert_eq!(
            run_target(sum, Some(&counts), &id, &flags).unwrap(),
            [3, 5, 7]
        );
        let flag_and_count = AtomicWords::fixed(vec![false, true]);
        let both = [shard(&id, &[1, 2, 0]), shard(&id, &[1, 3, 0])];
        assert_eq!(
            run_target(sum, Some(&flag_and_count), &id, &both).unwrap(),
            [1, 5, 0]
        );
        let differ = [shard(&id, &[0, 0, 2]), shard(&id, &[0, 0, 3])];
        let e = run_target(sum, Some(&flag_and_count), &id, &differ).unwrap_err();
        assert!(
            matches!(
                e,
                ExecError::StoredConflict {
                    binding: 0,
                    offset: 8,
                    shards: (0, 1),
                    values: (2, 3),
                    ..
                }
            ),
            "{e}"
        );
        let text = e.to_string();
        assert!(
            text.contains("merge sum-u32") && text.contains("atomicAdd"),
            "{text}"
        );
    }

    #[test]
    fn reductions_fold_partials_in_shard_order() {
        let id = [0; 3];
        let shards = [
            shard(&id, &[1, 0, 5]),
            shard(&id, &[2, 0, 0]),
            shard(&id, &[3, 4, 0]),
        ];
        let sum = run(MergeRule::Sum(ElemType::U32), &id, &shards).unwrap();
        assert_eq!(sum, [6, 4, 5]);
        let max = run(MergeRule::Max(ElemType::U32), &id, &shards).unwrap();
        assert_eq!(max, [3, 4, 5]);
        let big = [u32::MAX; 2];
        let mins = [shard(&big, &[4, u32::MAX]), shard(&big, &[2, 8])];
        assert_eq!(
            run(MergeRule::Min(ElemType::U32), &big, &mins).unwrap(),
            [2, 8]
        );
        let neg = (-3i32) as u32;
        let isum = run(
            MergeRule::Sum(ElemType::I32),
            &[0],
            &[shard(&[0], &[neg]), shard(&[0], &[1])],
        )
        .unwrap();
        assert_eq!(isum, [(-2i32) as u32]);
    }

    #[test]
    fn a_float_written_by_one_shard_keeps_its_bits() {
        // -0.0 from the only shard that wrote it stays -0.0 (0.0 + -0.0 would not).
        let neg_zero = (-0.0f32).to_bits();
        let out = run(
            MergeRule::Sum(ElemType::F32),
            &[0],
            &[shard(&[0], &[neg_zero]), shard(&[0], &[0])],
        )
        .unwrap();
        assert_eq!(out, [neg_zero]);
        let halves = [
            shard(&[0], &[0.5f32.to_bits()]),
            shard(&[0], &[0.25f32.to_bits()]),
        ];
        assert_eq!(
            run(MergeRule::Sum(ElemType::F32), &[0], &halves).unwrap(),
            [0.75f32.to_bits()]
        );
    }

    #[test]
    fn one_shard_gives_its_buffer_exactly_under_every_rule() {
        let start = [5, 6, 7];
        let after = [5, 0, 9];
        for rule in [
            MergeRule::Changes,
            MergeRule::Sum(ElemType::F32),
            MergeRule::Min(ElemType::I32),
        ] {
            assert_eq!(run(rule, &start, &[shard(&start, &after)]).unwrap(), after);
        }
    }

    #[test]
    fn missing_or_mis_sized_results_are_errors_not_guesses() {
        let start = [0, 0];
        assert!(run(MergeRule::Changes, &start, &[]).is_err());
        let wrong = ShardChanges(BTreeMap::from([(0, BufferChanges::whole(&[0; 12]))]));
        assert!(run(MergeRule::Changes, &start, &[wrong]).is_err());
        let other = ShardChanges(BTreeMap::from([(5, BufferChanges::whole(&[0; 8]))]));
        assert!(run(MergeRule::Changes, &start, &[other]).is_err());
    }

    #[test]
    fn the_written_bitmap_covers_block_edges() {
        let mut w = Written::new(4 * 200);
        let r = Run {
            offset: 4 * 60,
            len: 4 * 70,
        };
        assert!(w.none_in(r));
        w.set(r);
        assert!((60..130).all(|i| w.get(i)));
        assert!(!w.get(59) && !w.get(130));
        assert!(w.none_in(Run {
            offset: 0,
            len: 240
        }));
        assert!(!w.none_in(Run {
            offset: 4 * 129,
            len: 8
        }));
        let full = Run {
            offset: 0,
            len: 4 * 200,
        };
        w.set(full);
        assert!((0..200).all(|i| w.get(i)));
    }
}
