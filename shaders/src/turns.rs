//! Counting loop turns, for adapters that end loops early, and bounding the loops
//! that might never end, for adapters that do not.
//!
//! Mesa's software adapters (llvmpipe behind GL, lavapipe behind Vulkan) stop every
//! loop of an invocation once 65,535 turns have run in all, and the shader goes on
//! as if the loop had ended: the result is wrong and nothing says so. On such an
//! adapter (found by probing when the executor opens it) a kernel with loops runs
//! rewritten by [`count`]: each loop body first adds one to a private counter, and
//! the entry point, after the user's code returns, raises an atomic maximum in word
//! 0 at `@group(1) @binding(1)`. The executor reads it back and refuses the result
//! of a run whose count reached the adapter's cap.
//!
//! Everywhere else loops run as written, and a loop that never ends holds the GPU
//! past any deadline: the node abandons the device, but the dispatch runs on until
//! the process ends. There [`count`] is given a bound on the turns of an
//! invocation's loops, in a second counter (word 1). A loop [`counted_loop`] sees
//! run a number of turns known when it starts (`for (var i = 0u; i < n; i++)`, no
//! other way out) adds them when it starts and is skipped if they reach the bound:
//! nothing is added to its turns, so the loops a compiler unrolls stay as they
//! were, and nested ones with huge ends are refused before they run. Any other
//! loop adds one a turn and breaks once the count reaches the bound. The count is
//! held at the bound, never past it, so it cannot wrap back under it (a loop of
//! 2^32 - 1 turns skipped, then a few turns of another, would otherwise read as
//! a few). The entry point reports that count in word 1 only when it reached the
//! bound, so a run under it adds no atomic.
//!
//! A loop with a barrier in it is left by a workgroup's invocations together or
//! not at all: one leaving it alone leaves the rest waiting at the barrier, on a
//! GPU for ever. Counts differ between invocations (loops before it may turn
//! unequally), so as such a loop starts where they may differ, and each turn
//! where loops in it may add unequal turns, every invocation takes the
//! workgroup's most (`sync_count`): from there its turns keep the counts equal,
//! and the bound stops the whole workgroup at the same turn. A reduction inside
//! another such loop, or right after one, starts with them equal already.
//!
//! That maximum takes a word of workgroup memory. A kernel that leaves its
//! adapter less than the 16 bytes WebGPU counts for it gets none: there its loops
//! with a barrier in them are counted turn by turn and never left at the bound
//! (they run as written, to their end or to the executor's deadline), the rest are
//! bounded as ever, and a run whose count reached the bound is refused all the
//! same.

use std::collections::HashSet;
use std::num::NonZeroU32;

use naga::{
    AddressSpace, Arena, ArraySize, AtomicFunction, Barrier, BinaryOperator, Block, Expression,
    Function, GlobalVariable, Handle, Literal, LocalVariable, MathFunction, Module,
    ResourceBinding, Scalar, Span, Statement, StorageAccess, Type, TypeInner,
};

use crate::error::Result;
use crate::ir::each_statement;

/// The binding, in the shard-info group, of the counters the executor reads back.
pub(crate) const TURNS_BINDING: u32 = 1;
/// Bytes of those counters: word 0 the most turns of all loops, word 1 the most
/// turns of the open-ended loops, where it reached the bound.
pub(crate) const TURNS_BYTES: u64 = 8;

/// What [`count`] counts.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Counting {
    /// Every loop's turns, in word 0 (for an adapter that caps them).
    pub all: bool,
    /// The open-ended loops' turns, in word 1, each such loop breaking once they
    /// reach this.
    pub bound: Option<u32>,
    /// Whether the workgroup has memory to spare for its most turns (a `u32`; see
    /// `sync_count`). Without it a loop with a barrier in it is counted but never
    /// left at the bound: it runs as written (to its end, or to the executor's
    /// deadline), and a run whose count reached the bound is still refused.
    pub workgroup_room: bool,
}

/// Whether any function of `module` has a loop.
pub(crate) fn has_loops(module: &Module) -> bool {
    loops(module, |_, _, _, _| true) > 0
}

/// The loops of `module` for which `which(body, continuing, break_if, function)`
/// holds.
fn loops(
    module: &Module,
    which: impl Fn(&Block, &Block, Option<Handle<Expression>>, &Function) -> bool,
) -> usize {
    let functions = module.functions.iter().map(|(_, f)| f);
    let entry_points = module.entry_points.iter().map(|e| &e.function);
    let mut n = 0;
    for f in functions.chain(entry_points) {
        each_statement(&f.body, &mut |s| {
            if let Statement::Loop {
                body,
                continuing,
                break_if,
            } = s
            {
                n += usize::from(which(body, continuing, *break_if, f));
            }
        });
    }
    n
}

/// A loop that runs a fixed number of turns, known when it starts.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Counted {
    /// The local variable stepped by one a turn.
    pub var: Handle<LocalVariable>,
    /// The value it runs up to: the same through the loop, though perhaps
    /// evaluated in it.
    pub end: Handle<Expression>,
    /// Whether both are `i32` (else `u32`).
    pub signed: bool,
}

/// `Some` when the loop of `body`, `continuing` and `break_if` in `f` turns exactly
/// `max(end - var, 0)` times from when it starts: its first statement (emits
/// aside) leaves it unless `var < end` (or leaves it once `var >= end`), and
/// nothing else does (no other `break` of it, no `return` or `discard` in it, no
/// `break if`); `var` is a local variable stored in the loop once, as
/// `var = var + 1` at the top of `continuing` or last in a body with no
/// `continue`, and handed to no call; and `end` is a value the loop cannot change. `var` then
/// rises by one a turn and cannot pass `end` without wrapping, which it cannot
/// do below it. (`for (var i = 0u; i < n; i++)` and `while (i < n) { …; i++; }`
/// are such loops.)
pub(crate) fn counted_loop(
    body: &Block,
    continuing: &Block,
    break_if: Option<Handle<Expression>>,
    f: &Function,
    globals: &Arena<GlobalVariable>,
) -> Option<Counted> {
    if break_if.is_some() {
        return None;
    }
    let (head, first) = body
        .iter()
        .enumerate()
        .find(|(_, s)| !matches!(s, Statement::Emit(_)))?;
    let Statement::If {
        condition,
        accept,
        reject,
    } = first
    else {
        return None;
    };
    let is_break = |b: &Block| b.len() == 1 && matches!(b.iter().next(), Some(Statement::Break));
    let leave_when_false = accept.is_empty() && is_break(reject);
    let leave_when_true = reject.is_empty() && is_break(accept);
    if !leave_when_false && !leave_when_true {
        return None;
    }
    let rest = body.iter().skip(head + 1);
    if rest.chain(continuing.iter()).any(|s| leaves(s, true)) {
        return None;
    }
    let mut emitted = HashSet::new();
    emitted_in(body, &mut emitted);
    emitted_in(continuing, &mut emitted);
    let looked = Looked {
        f,
        globals,
        emitted: &emitted,
    };
    let (var, end) = looked.bound_by(*condition, leave_when_true)?;
    let signed = looked.stepped_once(var, body, continuing)?;
    Some(Counted { var, end, signed })
}

/// Whether `s` may leave the loop it is in (other than by `continue`), with
/// `breaks` whether a `break` in it is that loop's (not a switch's or an inner
/// loop's).
fn leaves(s: &Statement, breaks: bool) -> bool {
    match s {
        Statement::Break => breaks,
        Statement::Return { .. } | Statement::Kill => true,
        Statement::Block(b) => b.iter().any(|s| leaves(s, breaks)),
        Statement::If { accept, reject, .. } => accept
            .iter()
            .chain(reject.iter())
            .any(|s| leaves(s, breaks)),
        Statement::Switch { cases, .. } => cases
            .iter()
            .any(|c| c.body.iter().any(|s| leaves(s, false))),
        Statement::Loop {
            body, continuing, ..
        } => body
            .iter()
            .chain(continuing.iter())
            .any(|s| leaves(s, false)),
        _ => false,
    }
}

/// What [`counted_loop`] looks at: the function and the expressions evaluated
/// inside the loop.
struct Looked<'a> {
    f: &'a Function,
    globals: &'a Arena<GlobalVariable>,
    emitted: &'a HashSet<Handle<Expression>>,
}

impl Looked<'_> {
    /// The local variable `i` and the fixed `n` for which `condition` (the loop
    /// left when it is `leave_when`) is `i < n` (or `i >= n`).
    fn bound_by(
        &self,
        condition: Handle<Expression>,
        leave_when: bool,
    ) -> Option<(Handle<LocalVariable>, Handle<Expression>)> {
        let Expression::Binary { op, left, right } = self.f.expressions[condition] else {
            return None;
        };
        use BinaryOperator as B;
        let (var, end) = match (op, leave_when) {
            (B::Less, false) | (B::GreaterEqual, true) => (left, right),
            (B::Greater, false) | (B::LessEqual, true) => (right, left),
            _ => return None,
        };
        let var = self.local_load(var)?;
        self.fixed(end).then_some((var, end))
    }

    /// The local variable `e` loads, if it loads one whole.
    fn local_load(&self, e: Handle<Expression>) -> Option<Handle<LocalVariable>> {
        match self.f.expressions[e] {
            Expression::Load { pointer } => match self.f.expressions[pointer] {
                Expression::LocalVariable(var) => Some(var),
                _ => None,
            },
            _ => None,
        }
    }

    /// Whether `e` has one value through the whole loop: evaluated before it, or
    /// made only of constants, arguments and loads of memory no invocation writes.
    fn fixed(&self, e: Handle<Expression>) -> bool {
        use Expression as E;
        match &self.f.expressions[e] {
            E::Literal(_)
            | E::Constant(_)
            | E::Override(_)
            | E::ZeroValue(_)
            | E::FunctionArgument(_)
            | E::GlobalVariable(_)
            | E::LocalVariable(_) => true,
            E::CallResult(_)
            | E::AtomicResult { .. }
            | E::WorkGroupUniformLoadResult { .. }
            | E::SubgroupBallotResult
            | E::SubgroupOperationResult { .. }
            | E::RayQueryProceedResult => false,
            _ if !self.emitted.contains(&e) => true,
            E::Load { pointer } => self.read_only(*pointer),
            E::AccessIndex { base, .. } => self.fixed(*base),
            E::Access { base, index } => self.fixed(*base) && self.fixed(*index),
            E::Splat { value, .. } => self.fixed(*value),
            E::Swizzle { vector, .. } => self.fixed(*vector),
            E::Unary { expr, .. } | E::As { expr, .. } => self.fixed(*expr),
            E::Binary { left, right, .. } => self.fixed(*left) && self.fixed(*right),
            E::Select {
                condition,
                accept,
                reject,
            } => self.fixed(*condition) && self.fixed(*accept) && self.fixed(*reject),
            E::Compose { components, .. } => components.iter().all(|c| self.fixed(*c)),
            E::Math {
                arg,
                arg1,
                arg2,
                arg3,
                ..
            } => [Some(*arg), *arg1, *arg2, *arg3]
                .into_iter()
                .flatten()
                .all(|a| self.fixed(a)),
            E::ArrayLength(_) => true,
            _ => false,
        }
    }

    /// Whether `pointer` reaches memory no invocation writes (a uniform, a
    /// read-only storage buffer), at fixed indices.
    fn read_only(&self, pointer: Handle<Expression>) -> bool {
        match &self.f.expressions[pointer] {
            Expression::AccessIndex { base, .. } => self.read_only(*base),
            Expression::Access { base, index } => self.read_only(*base) && self.fixed(*index),
            Expression::GlobalVariable(var) => match self.globals[*var].space {
                AddressSpace::Uniform | AddressSpace::PushConstant | AddressSpace::Handle => true,
                AddressSpace::Storage { access } => !access.contains(StorageAccess::STORE),
                _ => false,
            },
            _ => false,
        }
    }

    /// Whether `var` is stored in the loop only as `var = var + 1`, at the top of
    /// `continuing` or last in a body no `continue` cuts short, and handed to no
    /// call: `Some(whether it is an i32)` if so.
    fn stepped_once(
        &self,
        var: Handle<LocalVariable>,
        body: &Block,
        continuing: &Block,
    ) -> Option<bool> {
        let mut stores = 0;
        let mut passed = false;
        self.uses(var, body, &mut stores, &mut passed);
        self.uses(var, continuing, &mut stores, &mut passed);
        if stores != 1 || passed {
            return None;
        }
        let step = |s: &Statement| match s {
            Statement::Store { pointer, value } if self.is_var(*pointer, var) => {
                self.plus_one(*value, var)
            }
            _ => None,
        };
        // At the back edge, or last in the body where no `continue` can skip it.
        continuing
            .iter()
            .find_map(step)
            .or_else(|| last_of(body).filter(|_| !continues(body)).and_then(step))
    }

    /// Counts the stores to `var` in `block` and notes whether a call is handed it.
    fn uses(
        &self,
        var: Handle<LocalVariable>,
        block: &Block,
        stores: &mut usize,
        passed: &mut bool,
    ) {
        each_statement(block, &mut |s| match s {
            Statement::Store { pointer, .. } if self.roots_at(*pointer, var) => *stores += 1,
            Statement::Call { arguments, .. } => {
                *passed |= arguments.iter().any(|a| self.roots_at(*a, var));
            }
            _ => {}
        });
    }

    fn is_var(&self, pointer: Handle<Expression>, var: Handle<LocalVariable>) -> bool {
        matches!(self.f.expressions[pointer], Expression::LocalVariable(v) if v == var)
    }

    /// Whether `pointer` is `var` or a part of it.
    fn roots_at(&self, pointer: Handle<Expression>, var: Handle<LocalVariable>) -> bool {
        match &self.f.expressions[pointer] {
            Expression::LocalVariable(v) => *v == var,
            Expression::AccessIndex { base, .. } | Expression::Access { base, .. } => {
                self.roots_at(*base, var)
            }
            _ => false,
        }
    }

    /// Whether `value` is `var + 1` (or `1 + var`): `Some(whether an i32's)`.
    fn plus_one(&self, value: Handle<Expression>, var: Handle<LocalVariable>) -> Option<bool> {
        let Expression::Binary {
            op: BinaryOperator::Add,
            left,
            right,
        } = self.f.expressions[value]
        else {
            return None;
        };
        let one = |e: Handle<Expression>| match self.f.expressions[e] {
            Expression::Literal(Literal::U32(1)) => Some(false),
            Expression::Literal(Literal::I32(1)) => Some(true),
            _ => None,
        };
        if self.local_load(left) == Some(var) {
            one(right)
        } else if self.local_load(right) == Some(var) {
            one(left)
        } else {
            None
        }
    }
}

/// The last statement `block` runs, inside a nested block that ends it.
fn last_of(block: &Block) -> Option<&Statement> {
    match block.last() {
        Some(Statement::Block(b)) => last_of(b),
        last => last,
    }
}

/// Whether `block` has a `continue` of its own loop (not of a loop inside it).
fn continues(block: &Block) -> bool {
    block.iter().any(|s| match s {
        Statement::Continue => true,
        Statement::Block(b) => continues(b),
        Statement::If { accept, reject, .. } => continues(accept) || continues(reject),
        Statement::Switch { cases, .. } => cases.iter().any(|c| continues(&c.body)),
        _ => false,
    })
}

/// The expressions `block` evaluates (its emits, nested blocks' included).
fn emitted_in(block: &Block, out: &mut HashSet<Handle<Expression>>) {
    each_statement(block, &mut |s| {
        if let Statement::Emit(range) = s {
            out.extend(range.clone());
        }
    });
}

/// Rewrites `module` (already instrumented for sharding, its one entry point a
/// wrapper calling the user's code) to count loop turns as `counting` says and
/// report them at `@group(group) @binding(TURNS_BINDING)`.
pub(crate) fn count(module: &Module, group: u32, counting: Counting) -> Result<Module> {
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
    let words_ty = m.types.insert(
        Type {
            name: None,
            inner: TypeInner::Array {
                base: atomic_ty,
                size: ArraySize::Constant(NonZeroU32::MIN.saturating_add(1)),
                stride: 4,
            },
        },
        Span::UNDEFINED,
    );
    let mut private = |name: &str| {
        m.global_variables.append(
            GlobalVariable {
                name: Some(name.into()),
                space: AddressSpace::Private,
                binding: None,
                ty: u32_ty,
                init: None,
            },
            Span::UNDEFINED,
        )
    };
    let all = counting.all.then(|| private("gpumesh_turns"));
    let open = counting
        .bound
        .map(|bound| (private("gpumesh_open_turns"), bound));
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
            ty: words_ty,
            init: None,
        },
        Span::UNDEFINED,
    );
    // Under a bound (and only then), a workgroup's most turns, for the loops with a
    // barrier in them (see `count_in`), where there are any.
    let marks = counting.bound.map(|_| {
        let barriers = functions_that(module, reaches_barrier);
        let uneven = functions_that(module, |b, found| reaches_uneven(b, &barriers, found));
        Marks { barriers, uneven }
    });
    let shared = marks
        .as_ref()
        .filter(|_| counting.workgroup_room)
        .filter(|marks| {
            loops(module, |body, continuing, _, _| {
                reaches_barrier(body, &marks.barriers)
                    || reaches_barrier(continuing, &marks.barriers)
            }) > 0
        })
        .map(|_| {
            m.global_variables.append(
                GlobalVariable {
                    name: Some("gpumesh_workgroup_turns".into()),
                    space: AddressSpace::WorkGroup,
                    binding: None,
                    ty: atomic_ty,
                    init: None,
                },
                Span::UNDEFINED,
            )
        });
    let globals = &m.global_variables;
    let functions = m
        .functions
        .iter_mut()
        .map(|(_, f)| f)
        .chain(m.entry_points.iter_mut().map(|e| &mut e.function));
    for f in functions {
        let counters = Counters {
            shared: marks.as_ref().map(|marks| {
                let g = shared.map(|g| {
                    f.expressions
                        .append(Expression::GlobalVariable(g), Span::UNDEFINED)
                });
                (g, marks)
            }),
            all: all.map(|g| {
                f.expressions
                    .append(Expression::GlobalVariable(g), Span::UNDEFINED)
            }),
            open: open.map(|(g, bound)| {
                (
                    f.expressions
                        .append(Expression::GlobalVariable(g), Span::UNDEFINED),
                    bound,
                )
            }),
        };
        let mut body = std::mem::take(&mut f.body);
        // Counts may differ as a function starts.
        count_in(&mut body, f, globals, counters, false);
        f.body = body;
    }
    for ep in &mut m.entry_points {
        let f = &mut ep.function;
        let target = f
            .expressions
            .append(Expression::GlobalVariable(most), Span::UNDEFINED);
        let mut report = Vec::new();
        // Word 0: the most turns of all loops; word 1: the most of the open-ended
        // ones, only where they reached the bound.
        let words = [
            all.map(|g| (0, g, BinaryOperator::Greater, 0)),
            open.map(|(g, bound)| (1, g, BinaryOperator::GreaterEqual, bound)),
        ];
        for (index, counter, op, rhs) in words.into_iter().flatten() {
            let counter = f
                .expressions
                .append(Expression::GlobalVariable(counter), Span::UNDEFINED);
            let (emit, value, reached) = load_then(f, counter, op, rhs);
            let at = f.expressions.len();
            let word = f.expressions.append(
                Expression::AccessIndex {
                    base: target,
                    index,
                },
                Span::UNDEFINED,
            );
            report.push(emit);
            report.push(Statement::If {
                condition: reached,
                accept: Block::from_vec(vec![
                    Statement::Emit(f.expressions.range_from(at)),
                    Statement::Atomic {
                        pointer: word,
                        fun: AtomicFunction::Max,
                        value,
                        result: None,
                    },
                ]),
                reject: Block::new(),
            });
        }
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
    // The workgroup's count starts at zero in each workgroup (as WGSL's own
    // zeroing, which the pipelines are built without, would have it; see
    // `crate::zero`): a maximum left by the last workgroup would raise this one's
    // counts.
    if let Some(shared) = shared {
        crate::zero::zero_workgroup_memory(&mut m, &[shared])?;
    }
    Ok(m)
}

/// A function's pointers to the counters [`count`] adds.
#[derive(Clone, Copy)]
struct Counters<'a> {
    /// Every loop's turns.
    all: Option<Handle<Expression>>,
    /// The open-ended loops' turns, and where they break.
    open: Option<(Handle<Expression>, u32)>,
    /// Under a bound: the workgroup's most turns (where a loop has a barrier in it;
    /// `None` where the workgroup has no memory to spare for them, so such loops
    /// are never left at the bound), and which functions reach a barrier or may add
    /// unequal turns.
    shared: Option<(Option<Handle<Expression>>, &'a Marks)>,
}

/// The functions of a module that may reach a workgroup barrier, and those that
/// may add unequal turns to its invocations' counts, through the functions they
/// call too.
struct Marks {
    barriers: HashSet<Handle<Function>>,
    uneven: HashSet<Handle<Function>>,
}

/// Whether running `block` may reach a workgroup barrier: a barrier, a
/// `workgroupUniformLoad`, or a call of one of `marked` (functions that may).
fn reaches_barrier(block: &Block, marked: &HashSet<Handle<Function>>) -> bool {
    reaches(block, marked, &|s| {
        matches!(
            s,
            Statement::ControlBarrier(_) | Statement::WorkGroupUniformLoad { .. }
        )
    })
}

/// Whether running `block` may add unequal turns to the counts of a workgroup's
/// invocations whose counts were equal: a loop with no barrier in it may (its
/// turns are its invocation's own), one with a barrier adds the same to each
/// (it is uniform across the workgroup) unless what it runs may, and so may a
/// call of one of `uneven`. `barriers` are the functions that reach a barrier.
fn reaches_uneven(
    block: &Block,
    barriers: &HashSet<Handle<Function>>,
    uneven: &HashSet<Handle<Function>>,
) -> bool {
    block.iter().any(|s| uneven_statement(s, barriers, uneven))
}

/// [`reaches_uneven`] for one statement.
fn uneven_statement(
    s: &Statement,
    barriers: &HashSet<Handle<Function>>,
    uneven: &HashSet<Handle<Function>>,
) -> bool {
    let inside = |b| reaches_uneven(b, barriers, uneven);
    match s {
        Statement::Loop {
            body, continuing, ..
        } => {
            !(reaches_barrier(body, barriers) || reaches_barrier(continuing, barriers))
                || inside(body)
                || inside(continuing)
        }
        Statement::Call { function, .. } => uneven.contains(function),
        Statement::Block(b) => inside(b),
        Statement::If { accept, reject, .. } => inside(accept) || inside(reject),
        Statement::Switch { cases, .. } => cases.iter().any(|c| inside(&c.body)),
        _ => false,
    }
}

/// Whether `block` has a statement that is `what`, or calls one of `marked`.
fn reaches(
    block: &Block,
    marked: &HashSet<Handle<Function>>,
    what: &dyn Fn(&Statement) -> bool,
) -> bool {
    block.iter().any(|s| {
        what(s)
            || match s {
                Statement::Call { function, .. } => marked.contains(function),
                Statement::Block(b) => reaches(b, marked, what),
                Statement::If { accept, reject, .. } => {
                    reaches(accept, marked, what) || reaches(reject, marked, what)
                }
                Statement::Switch { cases, .. } => {
                    cases.iter().any(|c| reaches(&c.body, marked, what))
                }
                Statement::Loop {
                    body, continuing, ..
                } => reaches(body, marked, what) || reaches(continuing, marked, what),
                _ => false,
            }
    })
}

/// The functions of `module` whose body `reaches` something, given the functions
/// found so far (a function calls only others, never itself).
fn functions_that(
    module: &Module,
    reaches: impl Fn(&Block, &HashSet<Handle<Function>>) -> bool,
) -> HashSet<Handle<Function>> {
    let mut found = HashSet::new();
    loop {
        let more: Vec<_> = module
            .functions
            .iter()
            .filter(|(h, f)| !found.contains(h) && reaches(&f.body, &found))
            .map(|(h, _)| h)
            .collect();
        if more.is_empty() {
            return found;
        }
        found.extend(more);
    }
}

/// Gives every invocation of the workgroup the count of the one that turned most
/// (`counter` ← the maximum at `shared`), between two barriers: the first so that
/// every invocation has added its own count, the second so that none adds a later
/// one before all have read. A loop with a barrier in it is uniform across the
/// workgroup (its barrier must be reached by all or none), so from equal counts
/// its turns, each adding one, keep them equal, and every invocation reaches the
/// bound at the same turn and leaves (or skips) the loop with the others. Were
/// one to leave it alone, the others would wait at its barrier for ever on a
/// GPU. Counts only rise, so the maximum is never stale; raising an invocation's
/// count to it changes nothing that is refused, since the run is refused once any
/// invocation reaches the bound.
fn sync_count(
    f: &mut Function,
    shared: Handle<Expression>,
    counter: Handle<Expression>,
) -> Vec<Statement> {
    let at = f.expressions.len();
    let own = f
        .expressions
        .append(Expression::Load { pointer: counter }, Span::UNDEFINED);
    let loaded = Statement::Emit(f.expressions.range_from(at));
    let at = f.expressions.len();
    let most = f
        .expressions
        .append(Expression::Load { pointer: shared }, Span::UNDEFINED);
    vec![
        loaded,
        Statement::Atomic {
            pointer: shared,
            fun: AtomicFunction::Max,
            value: own,
            result: None,
        },
        Statement::ControlBarrier(Barrier::WORK_GROUP),
        Statement::Emit(f.expressions.range_from(at)),
        Statement::ControlBarrier(Barrier::WORK_GROUP),
        Statement::Store {
            pointer: counter,
            value: most,
        },
    ]
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

/// `counter += 1` (held at `most`, if given), as the statements that do it, and
/// the new count.
fn step(
    f: &mut Function,
    counter: Handle<Expression>,
    most: Option<u32>,
) -> (Vec<Statement>, Handle<Expression>) {
    let limit = most.map(|m| {
        f.expressions
            .append(Expression::Literal(Literal::U32(m)), Span::UNDEFINED)
    });
    let (emit, _, mut new) = load_then(f, counter, BinaryOperator::Add, 1);
    let mut stmts = vec![emit];
    if let Some(limit) = limit {
        let at = f.expressions.len();
        new = f.expressions.append(
            Expression::Math {
                fun: MathFunction::Min,
                arg: new,
                arg1: Some(limit),
                arg2: None,
                arg3: None,
            },
            Span::UNDEFINED,
        );
        stmts.push(Statement::Emit(f.expressions.range_from(at)));
    }
    stmts.push(Statement::Store {
        pointer: counter,
        value: new,
    });
    (stmts, new)
}

/// Counts the turns of every loop in `block`: `all += 1` first in its body where
/// every loop is counted; under a bound, a loop [`counted_loop`] sees run a
/// fixed number of turns adds them to `open` when it starts and is skipped if
/// that reaches the bound, any other loop does `open += 1; if open >= bound {
/// break; }` first in its body. `even`: the workgroup's counts are known to be
/// equal as `block` starts (a loop with a barrier in it then needs no
/// [`sync_count`] to start).
fn count_in(
    block: &mut Block,
    f: &mut Function,
    globals: &Arena<GlobalVariable>,
    counters: Counters,
    mut even: bool,
) {
    let uneven = |s: &Statement| {
        counters
            .shared
            .is_none_or(|(_, marks)| uneven_statement(s, &marks.barriers, &marks.uneven))
    };
    for (s, _) in block.span_iter_mut() {
        let was_uneven = uneven(s);
        match s {
            Statement::Loop {
                body,
                continuing,
                break_if,
            } => {
                // Where the loop may reach a barrier, the workgroup's counts are made
                // equal as it starts, and each turn too where loops in it may add
                // unequal turns (see `sync_count`).
                let shared = counters.shared.and_then(|(shared, marks)| {
                    let barrier = reaches_barrier(body, &marks.barriers)
                        || reaches_barrier(continuing, &marks.barriers);
                    let uneven = reaches_uneven(body, &marks.barriers, &marks.uneven)
                        || reaches_uneven(continuing, &marks.barriers, &marks.uneven);
                    barrier.then_some((shared, uneven))
                });
                // Without room for the workgroup's count, such a loop is counted turn
                // by turn and never left at the bound.
                let pinned = matches!(shared, Some((None, _)));
                let counted = counters
                    .open
                    .filter(|_| !pinned)
                    .and_then(|_| counted_loop(body, continuing, *break_if, f, globals));
                let inside = counted.map(|_| {
                    let mut inside = HashSet::new();
                    emitted_in(body, &mut inside);
                    emitted_in(continuing, &mut inside);
                    inside
                });
                // Equal as each turn starts: made so, or kept so by turns that add
                // the same to each (a loop counted ahead is not made equal each turn).
                let (in_body, in_continuing) = match shared {
                    Some((_, uneven)) => (counted.is_none() || !uneven, !uneven),
                    None => (false, false),
                };
                count_in(body, f, globals, counters, in_body);
                count_in(continuing, f, globals, counters, in_continuing);
                let mut first = Vec::new();
                if let Some(all) = counters.all {
                    first.extend(step(f, all, None).0);
                }
                if let (Some((counter, bound)), None) = (counters.open, counted) {
                    if let Some((Some(shared), true)) = shared {
                        first.extend(sync_count(f, shared, counter));
                    }
                    // Held at the bound: the count never wraps back under it, however
                    // many loops start (and stop at once) once it is reached.
                    let (stepped, new) = step(f, counter, Some(bound));
                    first.extend(stepped);
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
                    if !pinned {
                        first.push(Statement::Emit(f.expressions.range_from(at)));
                        first.push(Statement::If {
                            condition: reached,
                            accept: Block::from_vec(vec![Statement::Break]),
                            reject: Block::new(),
                        });
                    }
                }
                body.splice(0..0, Block::from_vec(first));
                let synced = match (counters.open, shared) {
                    (Some((counter, _)), Some((Some(shared), _))) if !even => {
                        sync_count(f, shared, counter)
                    }
                    _ => Vec::new(),
                };
                if shared.is_some() {
                    // Equal as it started; as it ends, unless what it runs may not
                    // keep them so.
                    even = true;
                }
                if let (Some((counter, bound)), Some(counted), Some(inside)) =
                    (counters.open, counted, inside)
                {
                    let the_loop = std::mem::replace(s, Statement::Block(Block::new()));
                    let mut ahead = synced;
                    ahead.extend(count_ahead(f, the_loop, counted, &inside, counter, bound));
                    *s = Statement::Block(Block::from_vec(ahead));
                } else if !synced.is_empty() {
                    let the_loop = std::mem::replace(s, Statement::Block(Block::new()));
                    let mut block = synced;
                    block.push(the_loop);
                    *s = Statement::Block(Block::from_vec(block));
                }
            }
            Statement::Block(b) => count_in(b, f, globals, counters, even),
            Statement::If { accept, reject, .. } => {
                count_in(accept, f, globals, counters, even);
                count_in(reject, f, globals, counters, even);
            }
            Statement::Switch { cases, .. } => {
                for c in cases {
                    count_in(&mut c.body, f, globals, counters, even);
                }
            }
            _ => {}
        }
        even &= !was_uneven;
    }
}

/// `the_loop`, which runs `counted`'s turns, with what adds them to `counter`
/// before it starts (saturating at `u32::MAX`), and starts it at its end, so it
/// runs no turn, if that reaches `bound`. `inside` is what the loop evaluates: `end` is evaluated again, ahead
/// of it, where it is one of those.
fn count_ahead(
    f: &mut Function,
    the_loop: Statement,
    counted: Counted,
    inside: &HashSet<Handle<Expression>>,
    counter: Handle<Expression>,
    bound: u32,
) -> Vec<Statement> {
    let mut literal = |l| {
        f.expressions
            .append(Expression::Literal(l), Span::UNDEFINED)
    };
    let (zero, most, limit) = (
        literal(Literal::U32(0)),
        literal(Literal::U32(u32::MAX)),
        literal(Literal::U32(bound)),
    );
    let var = f
        .expressions
        .append(Expression::LocalVariable(counted.var), Span::UNDEFINED);
    let at = f.expressions.len();
    let end = hoist(f, counted.end, inside);
    let mut add = |e| f.expressions.append(e, Span::UNDEFINED);
    let start = add(Expression::Load { pointer: var });
    let (end_as_is, now) = (end, start);
    let ahead = add(Expression::Binary {
        op: BinaryOperator::Greater,
        left: end,
        right: now,
    });
    // An i32's distance, taken as u32s: end > now, so it fits.
    let (end, now) = if counted.signed {
        let bits = |expr| Expression::As {
            expr,
            kind: naga::ScalarKind::Uint,
            convert: None,
        };
        (add(bits(end)), add(bits(now)))
    } else {
        (end, now)
    };
    let left = add(Expression::Binary {
        op: BinaryOperator::Subtract,
        left: end,
        right: now,
    });
    let turns = add(Expression::Select {
        condition: ahead,
        accept: left,
        reject: zero,
    });
    let before = add(Expression::Load { pointer: counter });
    let room = add(Expression::Binary {
        op: BinaryOperator::Subtract,
        left: most,
        right: before,
    });
    let fits = add(Expression::Binary {
        op: BinaryOperator::LessEqual,
        left: turns,
        right: room,
    });
    let sum = add(Expression::Binary {
        op: BinaryOperator::Add,
        left: before,
        right: turns,
    });
    let saturated = add(Expression::Select {
        condition: fits,
        accept: sum,
        reject: most,
    });
    // Held at the bound, as a turn-by-turn count is.
    let total = add(Expression::Math {
        fun: MathFunction::Min,
        arg: saturated,
        arg1: Some(limit),
        arg2: None,
        arg3: None,
    });
    let reached = add(Expression::Binary {
        op: BinaryOperator::GreaterEqual,
        left: total,
        right: limit,
    });
    // Skipped by starting it at its end, so its own first test leaves it: no
    // branch around it (on a SIMD adapter a loop under a branch that may diverge
    // runs every turn masked).
    let from = add(Expression::Select {
        condition: reached,
        accept: end_as_is,
        reject: start,
    });
    vec![
        Statement::Emit(f.expressions.range_from(at)),
        Statement::Store {
            pointer: counter,
            value: total,
        },
        Statement::Store {
            pointer: var,
            value: from,
        },
        the_loop,
    ]
}

/// `e` evaluated anew where it is one of `inside` (what a loop evaluates), its
/// operands likewise; as it is otherwise. Only what [`Looked::fixed`] admits
/// comes here, so every copy is an expression that is emitted.
fn hoist(
    f: &mut Function,
    e: Handle<Expression>,
    inside: &HashSet<Handle<Expression>>,
) -> Handle<Expression> {
    if !inside.contains(&e) {
        return e;
    }
    let mut copy = f.expressions[e].clone();
    {
        let mut again = |h: &mut Handle<Expression>| *h = hoist(f, *h, inside);
        use Expression as E;
        match &mut copy {
            E::Load { pointer } => again(pointer),
            E::AccessIndex { base, .. } => again(base),
            E::Access { base, index } => {
                again(base);
                again(index);
            }
            E::Splat { value, .. } => again(value),
            E::Swizzle { vector, .. } => again(vector),
            E::Unary { expr, .. } | E::As { expr, .. } => again(expr),
            E::Binary { left, right, .. } => {
                again(left);
                again(right);
            }
            E::Select {
                condition,
                accept,
                reject,
            } => {
                again(condition);
                again(accept);
                again(reject);
            }
            E::Compose { components, .. } => components.iter_mut().for_each(again),
            E::Math {
                arg,
                arg1,
                arg2,
                arg3,
                ..
            } => {
                again(arg);
                for a in [arg1, arg2, arg3].into_iter().flatten() {
                    again(a);
                }
            }
            E::ArrayLength(array) => again(array),
            _ => {}
        }
    }
    f.expressions.append(copy, Span::UNDEFINED)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// How many loops of `module` count their turns one by one under a bound: those
    /// [`counted_loop`] does not see run a fixed number of turns.
    fn open_loops(module: &Module) -> usize {
        let globals = &module.global_variables;
        loops(module, |body, continuing, break_if, f| {
            counted_loop(body, continuing, break_if, f, globals).is_none()
        })
    }

    /// Whether the one loop of a kernel whose body is `body` is open-ended.
    fn open(body: &str) -> bool {
        let source = format!(
            "@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@group(0) @binding(1) var<uniform> n: vec4<u32>;
@group(0) @binding(2) var<storage, read> table: array<u32>;
fn bump(p: ptr<function, u32>) {{ *p = *p + 1u; }}
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
    var x = gid.x;
    {body}
    out[gid.x] = x;
}}"
        );
        let module =
            naga::front::wgsl::parse_str(&source).unwrap_or_else(|e| panic!("{body}: {e}"));
        match open_loops(&module) {
            0 => false,
            1 => true,
            n => panic!("{body}: {n} open loops"),
        }
    }

    #[test]
    fn loops_that_run_a_number_of_turns_known_when_they_start_are_counted_ahead() {
        for body in [
            "for (var i = 0u; i < n.x; i++) { x = x * 3u; }",
            "for (var i = 0; i < 10; i++) { x = x + 1u; }",
            "for (var i = 0u; i < arrayLength(&out); i++) { x = x + out[i]; }",
            "for (var i = 0u; i < table[0]; i++) { x = x + 1u; }",
            "for (var i = 0u; n.y > i; i++) { x = x + 1u; }",
            "let m = x; for (var i = 0u; i < m; i++) { x = x + 1u; }",
            "var i = 0u; loop { if (i >= n.x) { break; } x = x + i; continuing { i = i + 1u; } }",
            "for (var i = 0u; i < n.x; i++) { if (x == 5u) { continue; } x = x * 3u; }",
            "var i = 0u; while (i < n.x) { x = x + 1u; i++; }",
            "var i = 0u; while (i < n.x) { for (var j = 0u; j < 4u; j++) { if (j == x) { continue; } } i++; }",
        ] {
            assert!(!open(body), "counted turn by turn: {body}");
        }
    }

    #[test]
    fn loops_that_might_not_end_or_might_end_early_count_each_turn() {
        for body in [
            "loop { x = x * 3u; if (x == 1u) { break; } }",
            "while (x != 1u) { x = select(x / 2u, 3u * x + 1u, (x & 1u) == 1u); }",
            // It can stay at the end: i <= 0xffffffff always holds.
            "for (var i = 0u; i <= n.x; i++) { x = x + 1u; }",
            // The end is in memory the loop may write.
            "for (var i = 0u; i < out[0]; i++) { out[0] = out[0] + 1u; }",
            // The end moves as the loop turns.
            "for (var i = 0u; i < x; i++) { x = x + 1u; }",
            // Two steps at a time can pass the end by wrapping.
            "for (var i = 0u; i < n.x; i += 2u) { x = x + 1u; }",
            // Stored in the body too.
            "for (var i = 0u; i < n.x; i++) { i = i - 1u; }",
            // Stepped in the body, where a continue would skip it.
            "var i = 0u; while (i < n.x) { if (x == 5u) { continue; } i++; }",
            // Stepped in the body, not last.
            "var i = 0u; while (i < n.x) { i++; if (x == 5u) { x = 0u; } }",
            // Left only at an exact value.
            "var i = 0u; loop { if (i == n.x) { break; } x = x + 1u; i++; }",
            // Handed to a function that may store to it.
            "for (var i = 0u; i < n.x; i++) { bump(&i); }",
            // Only one of the conditions needs to fail to stay.
            "for (var i = 0u; i < n.x || x != 0u; i++) { x = x + 1u; }",
            // Another way out: it may end sooner than its count.
            "for (var i = 0u; i < n.x && x != 7u; i++) { x = x * 3u; }",
            "var i = 0u; loop { if (i >= n.x || x > 9u) { break; } x = x * 3u; i++; }",
            "for (var i = 0u; i < n.x; i++) { if (x == 7u) { break; } x = x * 3u; }",
            "for (var i = 0u; i < n.x; i++) { if (x == 7u) { out[0] = x; return; } x = x * 3u; }",
            "var i = 0u; loop { if (i >= n.x) { break; } x = x * 3u; continuing { i = i + 1u; break if x == 7u; } }",
        ] {
            assert!(open(body), "counted ahead: {body}");
        }
    }

    /// The barriers in `module`'s functions and entry points.
    fn barriers(module: &Module) -> usize {
        statements(module, &|s| matches!(s, Statement::ControlBarrier(_)))
    }

    fn breaks(module: &Module) -> usize {
        statements(module, &|s| matches!(s, Statement::Break))
    }

    /// The statements of `module` for which `which` holds.
    fn statements(module: &Module, which: &dyn Fn(&Statement) -> bool) -> usize {
        fn walk(block: &Block, which: &dyn Fn(&Statement) -> bool) -> usize {
            block
                .iter()
                .map(|s| {
                    usize::from(which(s))
                        + match s {
                            Statement::Block(b) => walk(b, which),
                            Statement::If { accept, reject, .. } => {
                                walk(accept, which) + walk(reject, which)
                            }
                            Statement::Switch { cases, .. } => {
                                cases.iter().map(|c| walk(&c.body, which)).sum()
                            }
                            Statement::Loop {
                                body, continuing, ..
                            } => walk(body, which) + walk(continuing, which),
                            _ => 0,
                        }
                })
                .sum()
        }
        module
            .functions
            .iter()
            .map(|(_, f)| walk(&f.body, which))
            .chain(
                module
                    .entry_points
                    .iter()
                    .map(|e| walk(&e.function.body, which)),
            )
            .sum()
    }

    #[test]
    fn loops_with_a_barrier_in_them_start_with_the_workgroups_counts_equal() {
        // A reduction counted turn by turn, a tiled loop counted ahead, a loop that
        // reaches its barrier through a call, one with a loop in it that may add
        // unequal turns, a loop with no barrier, and a reduction again.
        let source = "
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@group(0) @binding(1) var<uniform> n: vec4<u32>;
var<workgroup> part: array<u32, 64>;
fn sync() { workgroupBarrier(); }
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32) {
    var x = lid;
    for (var half = 32u; half > 0u; half = half >> 1u) {
        if (lid < half) { part[lid] = part[lid] + part[lid + half]; }
        workgroupBarrier();
    }
    for (var t = 0u; t < n.x; t++) {
        part[lid] = x;
        workgroupBarrier();
        x = x + part[(lid + 1u) % 64u];
        workgroupBarrier();
    }
    loop { sync(); if (n.y == 0u) { break; } }
    loop {
        for (var k = 0u; k < x; k++) { x = x + 1u; }
        workgroupBarrier();
        if (n.z == 0u) { break; }
    }
    loop { x = x * 3u; if (x == 1u) { break; } }
    for (var half = 32u; half > 0u; half = half >> 1u) {
        if (lid < half) { part[lid] = part[lid] + part[lid + half]; }
        workgroupBarrier();
    }
    out[lid] = x;
}";
        let module = naga::front::wgsl::parse_str(source).unwrap();
        let before = barriers(&module);
        let bounded = count(
            &module,
            1,
            Counting {
                all: false,
                bound: Some(1000),
                workgroup_room: true,
            },
        )
        .unwrap();
        // Two barriers where counts may differ: as the first reduction starts (the
        // function's), each turn of the loop with a loop in it, and as the last
        // reduction starts (after the loop with none). The loops between keep the
        // counts equal. And one after the workgroup's count is set to zero, first.
        assert_eq!(barriers(&bounded), before + 7);
        let stop = bounded
            .global_variables
            .iter()
            .find(|(_, g)| g.name.as_deref() == Some("gpumesh_workgroup_turns"))
            .expect("the workgroup's count");
        assert_eq!(stop.1.space, AddressSpace::WorkGroup);
        naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::default(),
        )
        .validate(&bounded)
        .expect("the rewritten module is valid");
        // Every loop counted turn by turn breaks at the bound: all but the tiled one,
        // counted ahead.
        assert_eq!(breaks(&bounded), breaks(&module) + 6);
        // Without room in workgroup memory for the count, the loops with a barrier
        // in them are counted turn by turn and never left: no barrier added, and
        // only the two loops with none break at the bound.
        let pinned = count(
            &module,
            1,
            Counting {
                all: false,
                bound: Some(1000),
                workgroup_room: false,
            },
        )
        .unwrap();
        assert_eq!(barriers(&pinned), before);
        assert_eq!(breaks(&pinned), breaks(&module) + 2);
        assert!(pinned
            .global_variables
            .iter()
            .all(|(_, g)| g.space != AddressSpace::WorkGroup || g.name.as_deref() == Some("part")));
        naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::default(),
        )
        .validate(&pinned)
        .expect("the rewritten module is valid");
        // Counting alone (a capped adapter, no bound) adds none, nor does a bound
        // where no loop has a barrier.
        let counted = count(
            &module,
            1,
            Counting {
                all: true,
                bound: None,
                workgroup_room: true,
            },
        )
        .unwrap();
        assert_eq!(barriers(&counted), before);
        let plain = naga::front::wgsl::parse_str(
            "@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32) {
    var x = lid;
    loop { x = x * 3u; if (x == 1u) { break; } }
    workgroupBarrier();
    out[lid] = x;
}",
        )
        .unwrap();
        let bounded = count(
            &plain,
            1,
            Counting {
                all: false,
                bound: Some(1000),
                workgroup_room: true,
            },
        )
        .unwrap();
        assert_eq!(barriers(&bounded), 1);
        assert!(bounded
            .global_variables
            .iter()
            .all(|(_, g)| g.name.as_deref() != Some("gpumesh_workgroup_turns")));
    }

    #[test]
    fn the_built_in_kernels_loops_are_counted_ahead_but_three() {
        use crate::builtins::sources as k;
        for (name, source, want) in [
            ("blur", k::BLUR, 0),
            ("histogram", k::HISTOGRAM, 0),
            ("jacobi", k::JACOBI, 0),
            // Left at its iteration cap or once the point escapes.
            ("mandelbrot", k::MANDELBROT, 1),
            ("matmul", k::MATMUL, 0),
            ("montecarlo_pi", k::MONTECARLO_PI, 0),
            // A compare-exchange retry loop and a halving reduction.
            ("linreg_grad", k::LINREG_GRAD, 2),
        ] {
            let module = naga::front::wgsl::parse_str(source).unwrap();
            assert_eq!(open_loops(&module), want, "{name}");
        }
    }
}
