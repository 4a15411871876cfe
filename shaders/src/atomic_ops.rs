//! Which atomic functions a kernel applies to each of its `@group(0)` buffers.
//!
//! A reduction merges shards' partials with one operation: `sum` adds them, `min`
//! and `max` keep the least or the greatest. That gives the unsharded answer only
//! where the kernel built each partial with the same operation: a maximum kept with
//! `atomicMax` and merged with `sum` comes back as the sum of every shard's
//! maximum. [`crate::kernel::Kernel::check`] holds each buffer's functions against
//! its merge rule; this module finds them.
//!
//! Which words of a buffer hold atomics ([`AtomicWords`]) tells the merge what it
//! may fold: an atomic word holds a shard's partial, any other word a value some
//! plain store set (a flag every shard sets to 1 is 1, not one per shard).
//!
//! An atomic reached through a pointer argument (a helper taking
//! `ptr<storage, atomic<u32>, read_write>`) is not traced to its buffer: it counts
//! for every buffer, which errs towards refusing.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use naga::valid::{FunctionInfo, ModuleInfo};
use naga::{
    AddressSpace, ArraySize, AtomicFunction, Function, Handle, Module, Statement, TypeInner,
};

use crate::ir::{each_statement, root_global};

/// An atomic function, as WGSL names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AtomicOp {
    Add,
    Sub,
    Min,
    Max,
    And,
    Or,
    Xor,
    Store,
    Exchange,
    /// A compare-exchange that sets its word, as `atomicExchange` does: one that
    /// expects a constant (a slot claimed with `atomicCompareExchangeWeak(&owner,
    /// 0u, id)`), or swaps in a value made without the old one under no condition
    /// on it (see [`crate::exchange`]).
    Claim,
    /// A compare-exchange whose new value is not seen to be one operation on the
    /// old one, nor a winner swapped in (see [`crate::exchange`]): no merge rule
    /// folds it.
    CompareExchange,
    /// A compare-exchange that decides by memory where the old value points: the
    /// word holds an index, kept by the value it points at (an argmin's
    /// `values[old]`). No merge rule folds it: the shards' indices would be merged
    /// as numbers, not by their values.
    IndexExchange,
    /// A compare-exchange loop whose new value combines the old one with something
    /// by this operation (`bitcast<u32>(bitcast<f32>(old) + v)`: a float sum).
    Loop(Combine),
}

/// How a compare-exchange loop's new value combines the old one with another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Combine {
    /// `+` or `-`.
    Add,
    Min,
    Max,
    Or,
    And,
    Xor,
    /// Another operation (`*`, `/`, ...), which no merge rule folds.
    Other,
}

impl AtomicOp {
    fn of(fun: &AtomicFunction) -> AtomicOp {
        match fun {
            AtomicFunction::Add => AtomicOp::Add,
            AtomicFunction::Subtract => AtomicOp::Sub,
            AtomicFunction::And => AtomicOp::And,
            AtomicFunction::InclusiveOr => AtomicOp::Or,
            AtomicFunction::ExclusiveOr => AtomicOp::Xor,
            AtomicFunction::Min => AtomicOp::Min,
            AtomicFunction::Max => AtomicOp::Max,
            AtomicFunction::Exchange { compare: None } => AtomicOp::Exchange,
            AtomicFunction::Exchange { compare: Some(_) } => AtomicOp::CompareExchange,
        }
    }
}

impl fmt::Display for AtomicOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AtomicOp::Add => "atomicAdd",
            AtomicOp::Sub => "atomicSub",
            AtomicOp::Min => "atomicMin",
            AtomicOp::Max => "atomicMax",
            AtomicOp::And => "atomicAnd",
            AtomicOp::Or => "atomicOr",
            AtomicOp::Xor => "atomicXor",
            AtomicOp::Store => "atomicStore",
            AtomicOp::Exchange => "atomicExchange",
            AtomicOp::Claim => "a compare-exchange that sets its word",
            AtomicOp::CompareExchange => "a compare-exchange of no operation seen",
            AtomicOp::IndexExchange => "a compare-exchange that keeps an index by its value",
            AtomicOp::Loop(c) => match c {
                Combine::Add => "a compare-exchange loop that adds",
                Combine::Min => "a compare-exchange loop that keeps the least",
                Combine::Max => "a compare-exchange loop that keeps the greatest",
                Combine::Or => "a compare-exchange loop that ors",
                Combine::And => "a compare-exchange loop that ands",
                Combine::Xor => "a compare-exchange loop that xors",
                Combine::Other => "a compare-exchange loop that multiplies, divides or the like",
            },
        })
    }
}

/// The atomic functions entry point `entry` of `module` (its index) applies to
/// each `@group(0)` buffer, by binding, in its own body and the functions it
/// calls; those through a pointer argument are in every buffer's set.
pub(crate) fn atomic_ops(
    module: &Module,
    info: &ModuleInfo,
    entry: usize,
) -> BTreeMap<u32, BTreeSet<AtomicOp>> {
    let ep = &module.entry_points[entry].function;
    let called = crate::ir::called(module, ep);
    let functions = called
        .into_iter()
        .map(|h| (&module.functions[h], &info[h]))
        .chain([(ep, info.get_entry_point(entry))]);
    let mut by_binding: BTreeMap<u32, BTreeSet<AtomicOp>> = BTreeMap::new();
    let mut anywhere = BTreeSet::new();
    for (f, fi) in functions {
        each_statement(&f.body, &mut |s| {
            let (pointer, op) = match s {
                Statement::Atomic {
                    pointer,
                    fun: AtomicFunction::Exchange { compare: Some(c) },
                    value,
                    ..
                } => (
                    *pointer,
                    crate::exchange::exchange_op(module, f, s, *pointer, *c, *value),
                ),
                Statement::Atomic { pointer, fun, .. } => (*pointer, AtomicOp::of(fun)),
                Statement::Store { pointer, .. } if stores_atomic(module, fi, *pointer) => {
                    (*pointer, AtomicOp::Store)
                }
                _ => return,
            };
            match root_global(f, pointer) {
                Some(g) => {
                    let var = &module.global_variables[g];
                    let buffer = matches!(var.space, AddressSpace::Storage { .. });
                    if let Some(rb) = var.binding.as_ref().filter(|rb| buffer && rb.group == 0) {
                        by_binding.entry(rb.binding).or_default().insert(op);
                    }
                }
                None if from_argument(f, pointer) => {
                    anywhere.insert(op);
                }
                None => {}
            }
        });
    }
    if !anywhere.is_empty() {
        for (_, var) in module.global_variables.iter() {
            if let Some(rb) = var.binding.as_ref().filter(|rb| rb.group == 0) {
                if matches!(var.space, AddressSpace::Storage { .. }) {
                    by_binding
                        .entry(rb.binding)
                        .or_default()
                        .extend(anywhere.iter().copied());
                }
            }
        }
    }
    by_binding
}

/// Which 4-byte words of a buffer's type hold atomics: words of its fixed part,
/// then a pattern repeating with each element of a trailing runtime-sized array.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AtomicWords {
    fixed: Vec<bool>,
    /// The first word of the trailing array, and which words of each element.
    tail: Option<(u64, Vec<bool>)>,
}

impl AtomicWords {
    /// The words of type `ty` (a buffer's) that hold atomics.
    pub(crate) fn of(module: &Module, ty: Handle<naga::Type>) -> AtomicWords {
        let mut words = AtomicWords::default();
        let tail = match &module.types[ty].inner {
            TypeInner::Array {
                base,
                size: ArraySize::Dynamic,
                stride,
            } => Some((0, *base, *stride)),
            TypeInner::Struct { members, .. } => {
                for m in members {
                    match module.types[m.ty].inner {
                        TypeInner::Array {
                            base,
                            size: ArraySize::Dynamic,
                            stride,
                        } => words.tail_of(module, u64::from(m.offset), base, stride),
                        _ => mark(module, m.ty, u64::from(m.offset), &mut words.fixed),
                    }
                }
                None
            }
            _ => {
                mark(module, ty, 0, &mut words.fixed);
                None
            }
        };
        if let Some((offset, base, stride)) = tail {
            words.tail_of(module, offset, base, stride);
        }
        words
    }

    fn tail_of(&mut self, module: &Module, offset: u64, base: Handle<naga::Type>, stride: u32) {
        let mut element = vec![false; (stride / 4) as usize];
        mark(module, base, 0, &mut element);
        if element.iter().any(|&a| a) {
            self.tail = Some((offset / 4, element));
        }
    }

    /// Whether the word at index `word` (byte offset / 4) holds an atomic.
    pub fn get(&self, word: u64) -> bool {
        if let Some(&a) = self.fixed.get(word as usize) {
            return a;
        }
        match &self.tail {
            Some((first, element)) if word >= *first && !element.is_empty() => {
                element[((word - first) % element.len() as u64) as usize]
            }
            _ => false,
        }
    }

    /// Atomics at the words `fixed` says, none past them.
    #[cfg(test)]
    pub(crate) fn fixed(fixed: Vec<bool>) -> AtomicWords {
        AtomicWords { fixed, tail: None }
    }

    /// Whether no word holds an atomic.
    pub fn none(&self) -> bool {
        self.tail.is_none() && !self.fixed.iter().any(|&a| a)
    }
}

/// Marks in `words` (from byte `offset`) the words of sized type `ty` that hold
/// atomics, growing it as far as the last one.
fn mark(module: &Module, ty: Handle<naga::Type>, offset: u64, words: &mut Vec<bool>) {
    match &module.types[ty].inner {
        TypeInner::Atomic(_) => {
            let word = (offset / 4) as usize;
            if words.len() <= word {
                words.resize(word + 1, false);
            }
            words[word] = true;
        }
        TypeInner::Array {
            base,
            size: ArraySize::Constant(n),
            stride,
        } if crate::kernel::holds_atomic(&module.types, *base) => {
            for i in 0..u64::from(n.get()) {
                mark(module, *base, offset + i * u64::from(*stride), words);
            }
        }
        TypeInner::Struct { members, .. } => {
            for m in members {
                mark(module, m.ty, offset + u64::from(m.offset), words);
            }
        }
        _ => {}
    }
}

/// Whether a store through `pointer` is an `atomicStore`: it points at an atomic.
fn stores_atomic(module: &Module, fi: &FunctionInfo, pointer: Handle<naga::Expression>) -> bool {
    match fi[pointer].ty.inner_with(&module.types) {
        TypeInner::Pointer { base, .. } => {
            matches!(module.types[*base].inner, TypeInner::Atomic(_))
        }
        _ => false,
    }
}

/// Whether `pointer` is reached from one of the function's arguments.
fn from_argument(f: &Function, mut pointer: Handle<naga::Expression>) -> bool {
    use naga::Expression as E;
    loop {
        match f.expressions[pointer] {
            E::Access { base, .. } | E::AccessIndex { base, .. } => pointer = base,
            E::FunctionArgument(_) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use AtomicOp as A;

    fn ops(src: &str) -> BTreeMap<u32, BTreeSet<AtomicOp>> {
        let module = naga::front::wgsl::parse_str(src).unwrap();
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::default(),
        )
        .validate(&module)
        .unwrap();
        atomic_ops(&module, &info, 0)
    }

    fn set(ops: &[AtomicOp]) -> BTreeSet<AtomicOp> {
        ops.iter().copied().collect()
    }

    #[test]
    fn each_buffers_functions_are_found_in_helpers_and_structs() {
        let found = ops(r#"
struct Stats { count: atomic<u32>, best: atomic<i32>, items: array<u32> }
@group(0) @binding(0) var<storage, read> data: array<i32>;
@group(0) @binding(1) var<storage, read_write> stats: Stats;
@group(0) @binding(2) var<storage, read_write> bits: array<atomic<u32>>;
@group(0) @binding(3) var<storage, read_write> plain: array<u32>;
var<workgroup> local: atomic<u32>;

fn mark(v: u32) { atomicOr(&bits[v / 32u], 1u << (v % 32u)); }

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let v = data[gid.x];
    atomicAdd(&stats.count, 1u);
    atomicMax(&stats.best, v);
    atomicStore(&bits[0], 0u);
    mark(u32(v));
    atomicAdd(&local, 1u);
    plain[gid.x] = u32(v);
    let old = atomicCompareExchangeWeak(&bits[1], 0u, 1u);
}
"#);
        assert_eq!(found.get(&1), Some(&set(&[A::Add, A::Max])));
        assert_eq!(found.get(&2), Some(&set(&[A::Or, A::Store, A::Claim])));
        assert_eq!(found.get(&3), None, "plain stores are not atomics");
        assert_eq!(found.len(), 2, "workgroup atomics are no buffer's");
    }

    /// A float sum, maximum and product kept by compare-exchange loops, as WGSL
    /// writes float atomics, each in a buffer of its own.
    #[test]
    fn a_compare_exchange_loops_operation_is_found() {
        let found = ops(r#"
@group(0) @binding(0) var<storage, read> values: array<f32>;
@group(0) @binding(1) var<storage, read_write> total: atomic<u32>;
@group(0) @binding(2) var<storage, read_write> best: array<atomic<u32>>;
@group(0) @binding(3) var<storage, read_write> product: atomic<u32>;
@group(0) @binding(4) var<storage, read_write> flag: atomic<u32>;

fn add(v: f32) {
    var old = atomicLoad(&total);
    loop {
        let r = atomicCompareExchangeWeak(&total, old, bitcast<u32>(bitcast<f32>(old) + v));
        if (r.exchanged) { break; }
        old = r.old_value;
    }
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let v = values[gid.x];
    add(v);
    var old = atomicLoad(&best[gid.x % 4u]);
    loop {
        let next = bitcast<u32>(max(v * 2.0, bitcast<f32>(old)));
        let r = atomicCompareExchangeWeak(&best[gid.x % 4u], old, next);
        if (r.exchanged) { break; }
        old = r.old_value;
    }
    var p = atomicLoad(&product);
    loop {
        let r = atomicCompareExchangeWeak(&product, p, bitcast<u32>(bitcast<f32>(p) * v));
        if (r.exchanged) { break; }
        p = r.old_value;
    }
    let first = atomicCompareExchangeWeak(&flag, 0u, 1u);
}
"#);
        assert_eq!(found.get(&1), Some(&set(&[A::Loop(Combine::Add)])));
        assert_eq!(found.get(&2), Some(&set(&[A::Loop(Combine::Max)])));
        assert_eq!(found.get(&3), Some(&set(&[A::Loop(Combine::Other)])));
        assert_eq!(found.get(&4), Some(&set(&[A::Claim])), "a slot claimed");
    }

    /// The words of each global's type that hold atomics, by name.
    fn words(src: &str) -> BTreeMap<String, AtomicWords> {
        let module = naga::front::wgsl::parse_str(src).unwrap();
        module
            .global_variables
            .iter()
            .map(|(_, g)| (g.name.clone().unwrap(), AtomicWords::of(&module, g.ty)))
            .collect()
    }

    #[test]
    fn atomic_words_are_found_in_structs_arrays_and_tails() {
        let found = words(
            r#"
struct Pair { hits: atomic<u32>, last: u32 }
struct Mixed { flag: u32, count: atomic<u32>, pad: vec2<u32>, pairs: array<Pair> }
@group(0) @binding(0) var<storage, read_write> mixed: Mixed;
@group(0) @binding(1) var<storage, read_write> bins: array<atomic<i32>, 4>;
@group(0) @binding(2) var<storage, read_write> plain: array<u32>;
@group(0) @binding(3) var<storage, read_write> total: atomic<u32>;
"#,
        );
        let mixed = &found["mixed"];
        let atomic: Vec<u64> = (0..12).filter(|&w| mixed.get(w)).collect();
        // flag 0, count 1, pad 2-3, then pairs from word 4: hits, last.
        assert_eq!(atomic, [1, 4, 6, 8, 10]);
        assert!((0..4).all(|w| found["bins"].get(w)) && !found["bins"].get(4));
        assert!(found["plain"].none() && !found["plain"].get(0));
        assert!(found["total"].get(0) && !found["total"].none());
    }
}
