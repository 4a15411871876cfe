//! Which atomic functions a kernel applies to each of its `@group(0)` buffers.
//!
//! A reduction merges shards' partials with one operation: `sum` adds them, `min`
//! and `max` keep the least or the greatest. That gives the unsharded answer only
//! where the kernel built each partial with the same operation: a maximum kept with
//! `atomicMax` and merged with `sum` comes back as the sum of every shard's
//! maximum. [`crate::kernel::Kernel::check`] holds each buffer's functions against
//! its merge rule; this module finds them.
//!
//! An atomic reached through a pointer argument (a helper taking
//! `ptr<storage, atomic<u32>, read_write>`) is not traced to its buffer: it counts
//! for every buffer, which errs towards refusing.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use naga::valid::{FunctionInfo, ModuleInfo};
use naga::{AddressSpace, AtomicFunction, Function, Handle, Module, Statement, TypeInner};

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
    CompareExchange,
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
            AtomicOp::CompareExchange => "atomicCompareExchangeWeak",
        })
    }
}

/// The atomic functions `module` applies to each `@group(0)` buffer, by binding;
/// those through a pointer argument are in every buffer's set.
pub(crate) fn atomic_ops(module: &Module, info: &ModuleInfo) -> BTreeMap<u32, BTreeSet<AtomicOp>> {
    let functions = module.functions.iter().map(|(h, f)| (f, &info[h])).chain(
        module
            .entry_points
            .iter()
            .enumerate()
            .map(|(i, ep)| (&ep.function, info.get_entry_point(i))),
    );
    let mut by_binding: BTreeMap<u32, BTreeSet<AtomicOp>> = BTreeMap::new();
    let mut anywhere = BTreeSet::new();
    for (f, fi) in functions {
        each_statement(&f.body, &mut |s| {
            let (pointer, op) = match s {
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
        atomic_ops(&module, &info)
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
        assert_eq!(
            found.get(&2),
            Some(&set(&[A::Or, A::Store, A::CompareExchange]))
        );
        assert_eq!(found.get(&3), None, "plain stores are not atomics");
        assert_eq!(found.len(), 2, "workgroup atomics are no buffer's");
    }
}
