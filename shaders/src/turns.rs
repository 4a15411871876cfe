//! Counting loop turns, for adapters that end loops early.
//!
//! Mesa's software adapters (llvmpipe behind GL, lavapipe behind Vulkan) stop every
//! loop of an invocation once 65,535 turns have run in all, and the shader goes on
//! as if the loop had ended: the result is wrong and nothing says so. On such an
//! adapter (found by [`probe_kernel`] when the executor opens it) a kernel with
//! loops runs rewritten by [`count`]: each loop body first adds one to a private
//! counter, and the entry point, after the user's code returns, raises an atomic
//! maximum at `@group(1) @binding(1)`. The executor reads it back and refuses the
//! result of a run whose count reached the adapter's cap.
//!
//! Everywhere else loops run as written, and a loop that never ends holds the GPU
//! past any deadline: the node abandons the device, but the dispatch runs on until
//! the process ends. There [`count`] is given a bound: each loop body also breaks
//! out once the counter reaches it, so every loop of a runaway invocation ends
//! within a turn of the bound, and the executor refuses the run. The entry point
//! reports only a count that reached the bound, so a run that stays under it adds
//! no atomic.

use naga::{
    AddressSpace, AtomicFunction, BinaryOperator, Block, Expression, Function, GlobalVariable,
    Handle, Literal, Module, ResourceBinding, Scalar, Span, Statement, StorageAccess, Type,
    TypeInner,
};

/// The binding, in the shard-info group, of the counter the executor reads back.
pub(crate) const TURNS_BINDING: u32 = 1;

/// Whether any function of `module` has a loop.
pub(crate) fn has_loops(module: &Module) -> bool {
    fn any(block: &Block) -> bool {
        block.iter().any(|s| match s {
            Statement::Loop { .. } => true,
            Statement::Block(b) => any(b),
            Statement::If { accept, reject, .. } => any(accept) || any(reject),
            Statement::Switch { cases, .. } => cases.iter().any(|c| any(&c.body)),
            _ => false,
        })
    }
    module.functions.iter().any(|(_, f)| any(&f.body))
        || module.entry_points.iter().any(|e| any(&e.function.body))
}

/// Rewrites `module` (already instrumented for sharding, its one entry point a
/// wrapper calling the user's code) to count loop turns and report the largest
/// count of any invocation at `@group(group) @binding(TURNS_BINDING)`. With
/// `bound`, every loop also breaks once the count reaches it, and only a count
/// that did is reported.
pub(crate) fn count(module: &Module, group: u32, bound: Option<u32>) -> Module {
    let mut m = module.clone();
    let u32_ty = m.types.insert(
        Type {
            name: None,
            inner: TypeInner::Scalar(Scalar::U32),
        },
        Span::UNDEFINED,
    );
    let atomic_ty = m.types.insert(
        Type {
            name: None,
            inner: TypeInner::Atomic(Scalar::U32),
        },
        Span::UNDEFINED,
    );
    let turns = m.global_variables.append(
        GlobalVariable {
            name: Some("gpumesh_turns".into()),
            space: AddressSpace::Private,
            binding: None,
            ty: u32_ty,
            init: None,
        },
        Span::UNDEFINED,
    );
    let most = m.global_variables.append(
        GlobalVariable {
            name: Some("gpumesh_most_turns".into()),
            space: AddressSpace::Storage {
                access: StorageAccess::LOAD | StorageAccess::STORE,
            },
            binding: Some(ResourceBinding {
                group,
                binding: TURNS_BINDING,
            }),
            ty: atomic_ty,
            init: None,
        },
        Span::UNDEFINED,
    );
    for (_, f) in m.functions.iter_mut() {
        let counter = f
            .expressions
            .append(Expression::GlobalVariable(turns), Span::UNDEFINED);
        let mut body = std::mem::take(&mut f.body);
        count_in(&mut body, f, counter, bound);
        f.body = body;
    }
    for ep in &mut m.entry_points {
        let f = &mut ep.function;
        let counter = f
            .expressions
            .append(Expression::GlobalVariable(turns), Span::UNDEFINED);
        let target = f
            .expressions
            .append(Expression::GlobalVariable(most), Span::UNDEFINED);
        let (emit, value, report_it) = match bound {
            Some(bound) => load_then(f, counter, BinaryOperator::GreaterEqual, bound),
            None => load_then(f, counter, BinaryOperator::Greater, 0),
        };
        let report = [
            emit,
            Statement::If {
                condition: report_it,
                accept: Block::from_vec(vec![Statement::Atomic {
                    pointer: target,
                    fun: AtomicFunction::Max,
                    value,
                    result: None,
                }]),
                reject: Block::new(),
            },
        ];
        // Before every return of the wrapper (it has one, at its end).
        let mut body = Vec::new();
        for s in std::mem::take(&mut f.body).span_into_iter().map(|(s, _)| s) {
            if matches!(s, Statement::Return { .. }) {
                body.extend(report.iter().cloned());
            }
            body.push(s);
        }
        f.body = Block::from_vec(body);
    }
    m
}

/// In `f`: loads the `u32` at `pointer` and applies `op` with the literal `rhs`;
/// returns the `Emit` the two need, the loaded value and the result.
fn load_then(
    f: &mut Function,
    pointer: Handle<Expression>,
    op: BinaryOperator,
    rhs: u32,
) -> (Statement, Handle<Expression>, Handle<Expression>) {
    // A literal needs no emit: it goes before the emitted range.
    let right = f
        .expressions
        .append(Expression::Literal(Literal::U32(rhs)), Span::UNDEFINED);
    let first = f.expressions.len();
    let left = f
        .expressions
        .append(Expression::Load { pointer }, Span::UNDEFINED);
    let result = f
        .expressions
        .append(Expression::Binary { op, left, right }, Span::UNDEFINED);
    (
        Statement::Emit(f.expressions.range_from(first)),
        left,
        result,
    )
}

/// Puts `counter += 1` first in the body of every loop in `block`, and with
/// `bound`, `if counter >= bound { break; }` after it.
fn count_in(block: &mut Block, f: &mut Function, counter: Handle<Expression>, bound: Option<u32>) {
    for (s, _) in block.span_iter_mut() {
        match s {
            Statement::Loop {
                body, continuing, ..
            } => {
                count_in(body, f, counter, bound);
                count_in(continuing, f, counter, bound);
                let (emit, _, new) = load_then(f, counter, BinaryOperator::Add, 1);
                let mut first = vec![
                    emit,
                    Statement::Store {
                        pointer: counter,
                        value: new,
                    },
                ];
                if let Some(bound) = bound {
                    let limit = f
                        .expressions
                        .append(Expression::Literal(Literal::U32(bound)), Span::UNDEFINED);
                    let at = f.expressions.len();
                    let reached = f.expressions.append(
                        Expression::Binary {
                            op: BinaryOperator::GreaterEqual,
                            left: new,
                            right: limit,
                        },
                        Span::UNDEFINED,
                    );
                    first.push(Statement::Emit(f.expressions.range_from(at)));
                    first.push(Statement::If {
                        condition: reached,
                        accept: Block::from_vec(vec![Statement::Break]),
                        reject: Block::new(),
                    });
                }
                body.splice(0..0, Block::from_vec(first));
            }
            Statement::Block(b) => count_in(b, f, counter, bound),
            Statement::If { accept, reject, .. } => {
                count_in(accept, f, counter, bound);
                count_in(reject, f, counter, bound);
            }
            Statement::Switch { cases, .. } => {
                for c in cases {
                    count_in(&mut c.body, f, counter, bound);
                }
            }
            _ => {}
        }
    }
}

/// A kernel that turns its loop `params.x` times and writes how many turns ran:
/// fewer on an adapter that ends loops early.
pub(crate) const PROBE: &str = "
@group(0) @binding(0) var<uniform> params: vec4<u32>;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(1)
fn main() {
    var n = 0u;
    loop {
        if (n >= params.x) { break; }
        n = n + 1u;
    }
    out[0] = n;
}
";

/// Turns the probe asks for: more than any known cap.
pub(crate) const PROBE_TURNS: u32 = 200_000;
