//! Workgroup memory set to zero as a workgroup starts, spread over its invocations.
//!
//! WGSL gives every `var<workgroup>` zeros at the start of a workgroup. wgpu can
//! have naga write that into each backend's code, but its OpenGL output does it as
//! one array constructor with an operand per element, which llvmpipe takes minutes
//! to compile: a kernel with `var<workgroup> part: array<u32, 1024>` took 2.2 s to
//! build there, 2,048 elements 17 s and 4,096 108 s (a deadline's worth, the device
//! then rebuilt), against 11-15 ms on lavapipe. So the executor builds its
//! pipelines without it, and the entry point (the wrapper [`crate::shard`] makes)
//! first zeroes the variables itself: each invocation the array elements at its
//! `local_invocation_index` plus multiples of the workgroup's size, then one
//! workgroup barrier before the user's code runs. Both adapters here then build
//! such a kernel in milliseconds, whatever its arrays' lengths.

use naga::{
    ArraySize, Barrier, BinaryOperator, Binding, Block, BuiltIn, Expression, Function,
    FunctionArgument, GlobalVariable, Handle, Literal, LocalVariable, Module, Scalar, ScalarKind,
    Span, Statement, Type, TypeInner,
};

use crate::error::{ExecError, Result};
use crate::kernel::holds_atomic;

/// Makes `module`'s one entry point (the wrapper) zero the workgroup variables
/// `vars` (those the user's entry point uses) before anything else, then wait at a
/// workgroup barrier. Nothing changes where `vars` is empty.
pub(crate) fn zero_workgroup_memory(
    module: &mut Module,
    vars: &[Handle<GlobalVariable>],
) -> Result<()> {
    if vars.is_empty() {
        return Ok(());
    }
    let u32_ty = module.types.insert(
        Type {
            name: None,
            inner: TypeInner::Scalar(Scalar::U32),
        },
        Span::UNDEFINED,
    );
    let Module {
        types,
        global_variables,
        entry_points,
        ..
    } = module;
    let Some(ep) = entry_points.first_mut() else {
        return Ok(());
    };
    let invocations: u32 = ep.workgroup_size.iter().product();
    let f = &mut ep.function;
    let mut z = Zeroing {
        f,
        types,
        u32_ty,
        stmts: Vec::new(),
    };
    let lid = z.local_index();
    for &var in vars {
        let ty = global_variables[var].ty;
        let pointer = z.pre(Expression::GlobalVariable(var));
        match z.types[ty].inner {
            // The elements spread over the workgroup's invocations.
            TypeInner::Array {
                base,
                size: ArraySize::Constant(len),
                ..
            } => {
                let (len, step) = (len.get(), invocations);
                let element = |z: &mut Zeroing, index: Handle<Expression>, out: &mut Vec<_>| {
                    // `index < len`: the last round may run past the end.
                    let len = z.pre(Expression::Literal(Literal::U32(len)));
                    let at = z.f.expressions.len();
                    let inside = z.add(Expression::Binary {
                        op: BinaryOperator::Less,
                        left: index,
                        right: len,
                    });
                    let target = z.add(Expression::Access {
                        base: pointer,
                        index,
                    });
                    out.push(Statement::Emit(z.f.expressions.range_from(at)));
                    let mut store = Vec::new();
                    z.zero(target, base, &mut store)?;
                    out.push(Statement::If {
                        condition: inside,
                        accept: Block::from_vec(store),
                        reject: Block::new(),
                    });
                    Ok::<(), ExecError>(())
                };
                let rounds = len.div_ceil(step);
                if rounds <= 1 {
                    let mut out = Vec::new();
                    element(&mut z, lid, &mut out)?;
                    z.stmts.extend(out);
                } else {
                    // for (var k = 0u; k < rounds; k++) { element(lid + k * step) }
                    let step = z.pre(Expression::Literal(Literal::U32(step)));
                    let body = z.counted(rounds, |z, k, out| {
                        let at = z.f.expressions.len();
                        let times = z.add(Expression::Binary {
                            op: BinaryOperator::Multiply,
                            left: k,
                            right: step,
                        });
                        let index = z.add(Expression::Binary {
                            op: BinaryOperator::Add,
                            left: lid,
                            right: times,
                        });
                        out.push(Statement::Emit(z.f.expressions.range_from(at)));
                        element(z, index, out)
                    })?;
                    z.stmts.extend(body);
                }
            }
            // Anything else by the workgroup's first invocation.
            _ => {
                let zero = z.pre(Expression::Literal(Literal::U32(0)));
                let at = z.f.expressions.len();
                let first = z.add(Expression::Binary {
                    op: BinaryOperator::Equal,
                    left: lid,
                    right: zero,
                });
                z.stmts
                    .push(Statement::Emit(z.f.expressions.range_from(at)));
                let mut store = Vec::new();
                z.zero(pointer, ty, &mut store)?;
                z.stmts.push(Statement::If {
                    condition: first,
                    accept: Block::from_vec(store),
                    reject: Block::new(),
                });
            }
        }
    }
    let mut body = std::mem::take(&mut z.stmts);
    body.push(Statement::ControlBarrier(Barrier::WORK_GROUP));
    let f = z.f;
    let old = std::mem::take(&mut f.body);
    body.extend(old.span_into_iter().map(|(s, _)| s));
    f.body = Block::from_vec(body);
    Ok(())
}

/// The wrapper being given its zeroing statements.
struct Zeroing<'a> {
    f: &'a mut Function,
    types: &'a naga::UniqueArena<Type>,
    u32_ty: Handle<Type>,
    stmts: Vec<Statement>,
}

impl Zeroing<'_> {
    /// An expression that needs an `Emit` (the caller emits its range).
    fn add(&mut self, e: Expression) -> Handle<Expression> {
        self.f.expressions.append(e, Span::UNDEFINED)
    }

    /// An expression that needs none (a literal, a variable, an argument): it goes
    /// before any emitted range.
    fn pre(&mut self, e: Expression) -> Handle<Expression> {
        self.f.expressions.append(e, Span::UNDEFINED)
    }

    /// The invocation's `local_invocation_index`: the wrapper's argument, or a
    /// member of one, that carries it; else a new argument.
    fn local_index(&mut self) -> Handle<Expression> {
        let is_it = |b: &Option<Binding>| {
            matches!(b, Some(Binding::BuiltIn(BuiltIn::LocalInvocationIndex)))
        };
        for (i, arg) in self.f.arguments.iter().enumerate() {
            if is_it(&arg.binding) {
                return self.pre(Expression::FunctionArgument(i as u32));
            }
            if let TypeInner::Struct { members, .. } = &self.types[arg.ty].inner {
                if let Some(j) = members.iter().position(|m| is_it(&m.binding)) {
                    let base = self.pre(Expression::FunctionArgument(i as u32));
                    let at = self.f.expressions.len();
                    let member = self.add(Expression::AccessIndex {
                        base,
                        index: j as u32,
                    });
                    self.stmts
                        .push(Statement::Emit(self.f.expressions.range_from(at)));
                    return member;
                }
            }
        }
        let i = self.f.arguments.len() as u32;
        self.f.arguments.push(FunctionArgument {
            name: Some("gpumesh_local_index".into()),
            ty: self.u32_ty,
            binding: Some(Binding::BuiltIn(BuiltIn::LocalInvocationIndex)),
        });
        self.pre(Expression::FunctionArgument(i))
    }

    /// Statements storing zeros at `pointer`, a `ty`: the type's zero value where
    /// it holds no atomic (which cannot be stored whole), else each atomic in it.
    fn zero(
        &mut self,
        pointer: Handle<Expression>,
        ty: Handle<Type>,
        out: &mut Vec<Statement>,
    ) -> Result<()> {
        if !holds_atomic(self.types, ty) {
            let value = self.pre(Expression::ZeroValue(ty));
            out.push(Statement::Store { pointer, value });
            return Ok(());
        }
        match &self.types[ty].inner {
            TypeInner::Atomic(scalar) => {
                let value = self.pre(Expression::Literal(match scalar.kind {
                    ScalarKind::Sint if scalar.width == 8 => Literal::I64(0),
                    ScalarKind::Sint => Literal::I32(0),
                    ScalarKind::Uint if scalar.width == 8 => Literal::U64(0),
                    ScalarKind::Float => Literal::F32(0.0),
                    _ => Literal::U32(0),
                }));
                out.push(Statement::Store { pointer, value });
            }
            TypeInner::Struct { members, .. } => {
                let members: Vec<Handle<Type>> = members.iter().map(|m| m.ty).collect();
                for (j, member) in members.into_iter().enumerate() {
                    let at = self.f.expressions.len();
                    let field = self.add(Expression::AccessIndex {
                        base: pointer,
                        index: j as u32,
                    });
                    out.push(Statement::Emit(self.f.expressions.range_from(at)));
                    self.zero(field, member, out)?;
                }
            }
            &TypeInner::Array {
                base,
                size: ArraySize::Constant(len),
                ..
            } => {
                let body = self.counted(len.get(), |z, k, out| {
                    let at = z.f.expressions.len();
                    let element = z.add(Expression::Access {
                        base: pointer,
                        index: k,
                    });
                    out.push(Statement::Emit(z.f.expressions.range_from(at)));
                    z.zero(element, base, out)
                })?;
                out.extend(body);
            }
            _ => {
                return Err(ExecError::Unsupported(
                    "a var<workgroup> holding atomics in an array whose length is not a \
                     constant"
                        .into(),
                ))
            }
        }
        Ok(())
    }

    /// `for (var k = 0u; k < rounds; k++) { body(k) }`, written as WGSL's front end
    /// writes a `for`, so that the loop bound counts its turns as it starts.
    fn counted(
        &mut self,
        rounds: u32,
        body: impl FnOnce(&mut Self, Handle<Expression>, &mut Vec<Statement>) -> Result<()>,
    ) -> Result<Vec<Statement>> {
        let var = self.f.local_variables.append(
            LocalVariable {
                name: Some("gpumesh_zero_round".into()),
                ty: self.u32_ty,
                init: None,
            },
            Span::UNDEFINED,
        );
        let pointer = self.pre(Expression::LocalVariable(var));
        let (zero, one, end) = (
            self.pre(Expression::Literal(Literal::U32(0))),
            self.pre(Expression::Literal(Literal::U32(1))),
            self.pre(Expression::Literal(Literal::U32(rounds))),
        );
        let mut stmts = vec![Statement::Store {
            pointer,
            value: zero,
        }];
        let at = self.f.expressions.len();
        let k = self.add(Expression::Load { pointer });
        let more = self.add(Expression::Binary {
            op: BinaryOperator::Less,
            left: k,
            right: end,
        });
        let mut inside = vec![
            Statement::Emit(self.f.expressions.range_from(at)),
            Statement::If {
                condition: more,
                accept: Block::new(),
                reject: Block::from_vec(vec![Statement::Break]),
            },
        ];
        body(self, k, &mut inside)?;
        let at = self.f.expressions.len();
        let now = self.add(Expression::Load { pointer });
        let next = self.add(Expression::Binary {
            op: BinaryOperator::Add,
            left: now,
            right: one,
        });
        let continuing = vec![
            Statement::Emit(self.f.expressions.range_from(at)),
            Statement::Store {
                pointer,
                value: next,
            },
        ];
        stmts.push(Statement::Loop {
            body: Block::from_vec(inside),
            continuing: Block::from_vec(continuing),
            break_if: None,
        });
        Ok(stmts)
    }
}
