//! Buffers a kernel writes where, or with what, an atomic on a buffer answered.
//!
//! An append (stream compaction, as WebGPU tutorials write it):
//!
//! ```wgsl
//! let slot = atomicAdd(&count, 1u);
//! out[slot] = value;
//! ```
//!
//! Run in shards, every shard's counter starts from the same value, so the shards
//! write the same slots: their entries land on top of one another. Where two of them
//! wrote the same value at a slot, a word-by-word merge sees agreement, and the
//! merged buffer silently holds fewer entries than the counter says; where they
//! differ, it fails with a conflict only after the work is done. Such a buffer
//! cannot be split into shards at all, whatever the merge rule ([`AtomicUses::appended`]).
//!
//! A workgroup that acts on what the others did (the last one to finish sums the
//! partials of all, as reductions in one pass write it):
//!
//! ```wgsl
//! let ticket = atomicAdd(&done, 1u);
//! if (ticket == n.x - 1u) { total[0] = sum_of(partials); }
//! ```
//!
//! A shard sees only its own workgroups' updates: no shard's ticket reaches the
//! last, `total` is never written, and the merge returns it as it started. Nor can
//! a value an atomic answered be stored and merged: each shard counted from the
//! start. A buffer written with such a value, or only under a condition on one,
//! cannot be split either ([`AtomicUses::steered`]).
//!
//! The analysis follows values: one comes from an atomic if it is the result of an
//! atomic operation on a buffer (`atomicAdd`, `atomicSub`, `atomicMax`,
//! `atomicExchange`, ... on a `var<storage>`; one on a `var<workgroup>` counts
//! within a workgroup, which a shard runs whole), an `atomicLoad` of a buffer the
//! kernel updates, or is computed from one, through expressions, local variables,
//! `var<workgroup>` and `var<private>` variables (a workgroup's base in the output,
//! reserved by one invocation for all), function arguments and return values, in
//! any function of the module. It follows control too: what is stored under a
//! condition (`if`, `switch`, a loop's `break if`) on such a value, after a
//! `return`, `break` or `continue` taken under one, or in a function called under
//! one, counts as computed from it. A store (or an atomic operation) through a
//! pointer into a `@group(0)` buffer at an index computed from an atomic's value
//! makes that buffer appended (one computed only under a condition on one, a
//! loop's counter, makes it steered); with a value from one (an atomic's operand
//! included), or under a condition on one, steered, except a compare-exchange loop
//! on a location from what the atomics on that same location answered (a float
//! sum over `atomic<u32>`), which is its reduction and splits like `atomicAdd`. What follows a
//! loop whose turns depend on one (a spin until a flag is set) does not count: it
//! runs once the loop ends, however often it turned. It errs towards marking.

use std::collections::{BTreeSet, HashSet};

use naga::{Block, Expression, Function, Handle, Module, Statement, TypeInner};

use crate::ir::{each_statement, root_global};

/// The `@group(0)` bindings a kernel writes where, or with what, an atomic on a
/// buffer answered (see the module's documentation).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct AtomicUses {
    /// Written at an index computed from an atomic's result: an append.
    pub appended: BTreeSet<u32>,
    /// Written with a value computed from one, or only where one said so.
    pub steered: BTreeSet<u32>,
}

type Global = Handle<naga::GlobalVariable>;

/// How `module`'s `@group(0)` buffers depend on its atomics on buffers.
pub(crate) fn atomic_uses(module: &Module) -> AtomicUses {
    let functions: Vec<(Option<Handle<Function>>, &Function)> = module
        .functions
        .iter()
        .map(|(h, f)| (Some(h), f))
        .chain(module.entry_points.iter().map(|ep| (None, &ep.function)))
        .collect();
    let updated = updated_buffers(module, &functions);
    let binding = |g: &Global| {
        let rb = module.global_variables[*g].binding.as_ref()?;
        (rb.group == 0).then_some(rb.binding)
    };
    let follow = |ignore, control| Follow { ignore, control };
    // Indices from values alone make appends; one computed under a condition (a
    // loop's counter, where the loop ends on what an atomic answered) is steered.
    let values = Marks::of(module, &functions, &updated, follow(None, false));
    let all = Marks::of(module, &functions, &updated, follow(None, true));
    let mut uses = AtomicUses {
        appended: values.appended.iter().filter_map(binding).collect(),
        steered: all
            .steered
            .iter()
            .chain(all.appended.difference(&values.appended))
            .filter_map(binding)
            .collect(),
    };
    // A compare-exchange loop on a location, from what the atomics on that same
    // location answered, is its own reduction (a float sum over `atomic<u32>`: a
    // shard sums its part from the identity, and the merge adds the parts):
    // steered only if it still is with the atomics on that location left out. Any
    // other atomic update under what an atomic answered (an add only while a count
    // is low, a word set from another word of the same buffer) is steered.
    for site in &all.exchanged_steered {
        if Marks::of(module, &functions, &updated, follow(Some(*site), true))
            .exchanged_steered
            .contains(site)
        {
            uses.steered.extend(binding(&site.global));
        }
    }
    uses
}

/// The buffers written at a tainted index, and with a tainted value or under a
/// tainted condition (by a store or an atomic, and by a compare-exchange).
#[derive(Default)]
struct Marks {
    appended: HashSet<Global>,
    steered: HashSet<Global>,
    exchanged_steered: HashSet<Site>,
}

/// Where an atomic operation is: the buffer, the function (its index in the
/// analysis's list) and the pointer expression in it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Site {
    global: Global,
    function: usize,
    pointer: Handle<Expression>,
}

impl Marks {
    fn of(
        module: &Module,
        functions: &[(Option<Handle<Function>>, &Function)],
        updated: &HashSet<Global>,
        follow: Follow,
    ) -> Marks {
        let mut state: Vec<Taint> = functions
            .iter()
            .enumerate()
            .map(|(i, (_, f))| Taint::new(module, i, f, updated, follow))
            .collect();
        // Arguments a caller passes a tainted value in, functions that return one
        // (or return under a condition on one), functions called under such a
        // condition, and `var<workgroup>` / `var<private>` variables one is stored
        // in (a workgroup's base in the output, reserved by one invocation for all).
        let mut tainted_args: HashSet<(Handle<Function>, u32)> = HashSet::new();
        let mut tainted_returns: HashSet<Handle<Function>> = HashSet::new();
        let mut called_under: HashSet<Handle<Function>> = HashSet::new();
        let mut tainted_globals: HashSet<Global> = HashSet::new();
        let mut marks = Marks::default();
        // Each round can only add; a module has finitely many of everything.
        loop {
            let mut changed = false;
            for (i, (handle, f)) in functions.iter().enumerate() {
                let t = &mut state[i];
                changed |= t.expressions(
                    f,
                    *handle,
                    &tainted_args,
                    &tainted_returns,
                    &tainted_globals,
                );
                let mut found = Found::default();
                let under = handle.is_some_and(|h| called_under.contains(&h));
                t.walk(module, f, &f.body, under, &mut found);
                changed |= t.locals_changed(found.locals);
                changed |= t.results_changed(found.results);
                for global in found.globals {
                    changed |= tainted_globals.insert(global);
                }
                for call in found.args {
                    changed |= tainted_args.insert(call);
                }
                for callee in found.calls_under {
                    changed |= called_under.insert(callee);
                }
                if found.returns {
                    if let Some(h) = handle {
                        changed |= tainted_returns.insert(*h);
                    }
                }
                marks.appended.extend(found.appended);
                marks.steered.extend(found.steered);
                marks
                    .exchanged_steered
                    .extend(
                        found
                            .exchanged_steered
                            .into_iter()
                            .map(|(global, pointer)| Site {
                                global,
                                function: i,
                                pointer,
                            }),
                    );
            }
            if !changed {
                return marks;
            }
        }
    }
}

/// What an analysis follows.
#[derive(Clone, Copy)]
struct Follow {
    /// A location whose atomics are not counted as where taint comes from: those
    /// on the same buffer, in the same function, through a pointer that
    /// [`same_location`] says is the site's.
    ignore: Option<Site>,
    /// Whether conditions pass taint on to what runs under them.
    control: bool,
}

/// Which of one function's values come from an atomic on a buffer.
struct Taint {
    control: bool,
    expressions: Vec<bool>,
    locals: HashSet<Handle<naga::LocalVariable>>,
    /// The results of atomic operations on buffers (`var<storage>`), and the
    /// `atomicLoad`s of buffers the kernel updates: where tainted values come
    /// from. An atomic on a `var<workgroup>` counts within a workgroup, which a
    /// shard runs whole, so what it answers is the workgroup's own.
    sources: HashSet<Handle<Expression>>,
    /// Results of statements (`workgroupUniformLoad`, an atomic on a variable
    /// holding a tainted value) that are tainted.
    results: HashSet<Handle<Expression>>,
}

/// What a walk of one function's statements found.
#[derive(Default)]
struct Found {
    locals: HashSet<Handle<naga::LocalVariable>>,
    globals: HashSet<Global>,
    results: HashSet<Handle<Expression>>,
    args: Vec<(Handle<Function>, u32)>,
    calls_under: Vec<Handle<Function>>,
    returns: bool,
    appended: Vec<Global>,
    steered: Vec<Global>,
    /// Steered by a compare-exchange rather than a store or another atomic: the
    /// buffer and the pointer.
    exchanged_steered: Vec<(Global, Handle<Expression>)>,
}

/// Jumps taken under a tainted condition in a block: after one, what follows in
/// the enclosing loop (`break`, `continue`) or function (`return`) runs or not
/// as the condition says.
#[derive(Clone, Copy, Default)]
struct Jumps {
    out_of_loop: bool,
    out_of_function: bool,
}

impl Jumps {
    fn any(self) -> bool {
        self.out_of_loop || self.out_of_function
    }

    fn or(self, other: Jumps) -> Jumps {
        Jumps {
            out_of_loop: self.out_of_loop || other.out_of_loop,
            out_of_function: self.out_of_function || other.out_of_function,
        }
    }
}

impl Taint {
    fn new(
        module: &Module,
        index: usize,
        f: &Function,
        updated: &HashSet<Global>,
        follow: Follow,
    ) -> Self {
        let counted = |pointer: Handle<Expression>| {
            follow.ignore.is_none_or(|site| {
                site.function != index
                    || root_global(f, pointer) != Some(site.global)
                    || !same_location(f, pointer, site.pointer)
            })
        };
        let mut sources = HashSet::new();
        each_statement(&f.body, &mut |s| {
            if let Statement::Atomic {
                pointer,
                result: Some(r),
                ..
            } = s
            {
                let root = root_global(f, *pointer).filter(|_| counted(*pointer));
                if root.is_some_and(|g| in_storage(module, g)) {
                    sources.insert(*r);
                }
            }
        });
        for (h, e) in f.expressions.iter() {
            if let Expression::Load { pointer } = *e {
                let loaded =
                    root_global(f, pointer).filter(|g| updated.contains(g) && counted(pointer));
                if loaded.is_some() && points_at_atomic(module, f, pointer) {
                    sources.insert(h);
                }
            }
        }
        Taint {
            control: follow.control,
            expressions: vec![false; f.expressions.len()],
            locals: HashSet::new(),
            sources,
            results: HashSet::new(),
        }
    }

    fn is(&self, e: Handle<Expression>) -> bool {
        self.expressions[e.index()]
    }

    /// Whether a condition on `e` passes taint on to what runs under it.
    fn steers(&self, e: Handle<Expression>) -> bool {
        self.control && self.is(e)
    }

    /// Marks the expressions that are tainted, given the locals, arguments and
    /// returns known to be; whether any is new. Operands come before the
    /// expressions that use them in the arena, so one pass in order suffices.
    fn expressions(
        &mut self,
        f: &Function,
        me: Option<Handle<Function>>,
        tainted_args: &HashSet<(Handle<Function>, u32)>,
        tainted_returns: &HashSet<Handle<Function>>,
        tainted_globals: &HashSet<Global>,
    ) -> bool {
        let mut changed = false;
        for (h, e) in f.expressions.iter() {
            if self.expressions[h.index()] {
                continue;
            }
            let any = |hs: &[Option<Handle<Expression>>]| hs.iter().flatten().any(|&x| self.is(x));
            let tainted = self.sources.contains(&h)
                || match *e {
                    Expression::AtomicResult { .. }
                    | Expression::WorkGroupUniformLoadResult { .. } => self.results.contains(&h),
                    Expression::FunctionArgument(i) => {
                        me.is_some_and(|m| tainted_args.contains(&(m, i)))
                    }
                    Expression::CallResult(callee) => tainted_returns.contains(&callee),
                    Expression::LocalVariable(lv) => self.locals.contains(&lv),
                    Expression::GlobalVariable(g) => tainted_globals.contains(&g),
                    Expression::Load { pointer } => any(&[Some(pointer)]),
                    Expression::Access { base, index } => any(&[Some(base), Some(index)]),
                    Expression::AccessIndex { base, .. } => any(&[Some(base)]),
                    Expression::Splat { value, .. } => any(&[Some(value)]),
                    Expression::Swizzle { vector, .. } => any(&[Some(vector)]),
                    Expression::Compose { ref components, .. } => {
                        components.iter().any(|&c| self.is(c))
                    }
                    Expression::Unary { expr, .. } | Expression::As { expr, .. } => {
                        any(&[Some(expr)])
                    }
                    Expression::Binary { left, right, .. } => any(&[Some(left), Some(right)]),
                    Expression::Select {
                        condition,
                        accept,
                        reject,
                    } => any(&[Some(condition), Some(accept), Some(reject)]),
                    Expression::Relational { argument, .. } => any(&[Some(argument)]),
                    Expression::Math {
                        arg,
                        arg1,
                        arg2,
                        arg3,
                        ..
                    } => any(&[Some(arg), arg1, arg2, arg3]),
                    _ => false,
                };
            if tainted {
                self.expressions[h.index()] = true;
                changed = true;
            }
        }
        changed
    }

    fn locals_changed(&mut self, found: HashSet<Handle<naga::LocalVariable>>) -> bool {
        let before = self.locals.len();
        self.locals.extend(found);
        self.locals.len() != before
    }

    fn results_changed(&mut self, found: HashSet<Handle<Expression>>) -> bool {
        let before = self.results.len();
        self.results.extend(found);
        self.results.len() != before
    }

    /// Walks `block`, `under` a tainted condition or not: tainted values (or any
    /// value, under one) stored into variables, passed to calls or returned, and
    /// writes into buffers at a tainted index, of a tainted value, or under a
    /// tainted condition. Returns the jumps taken under one.
    fn walk(
        &self,
        module: &Module,
        f: &Function,
        block: &Block,
        mut under: bool,
        found: &mut Found,
    ) -> Jumps {
        let mut jumps = Jumps::default();
        for s in block.iter() {
            let inner = match s {
                Statement::Store { pointer, value } => {
                    self.write(module, f, *pointer, under || self.is(*value), false, found);
                    Jumps::default()
                }
                Statement::Atomic {
                    pointer,
                    fun,
                    value,
                    result,
                } => {
                    let compare = match fun {
                        naga::AtomicFunction::Exchange { compare: Some(c) } => Some(self.is(*c)),
                        _ => None,
                    };
                    let tainted = under || self.is(*value) || compare == Some(true);
                    self.write(module, f, *pointer, tainted, compare.is_some(), found);
                    if let Some(r) = result {
                        if self.is(*pointer) {
                            found.results.insert(*r);
                        }
                    }
                    Jumps::default()
                }
                Statement::WorkGroupUniformLoad { pointer, result } => {
                    if self.is(*pointer) {
                        found.results.insert(*result);
                    }
                    Jumps::default()
                }
                Statement::Call {
                    function,
                    arguments,
                    ..
                } => {
                    for (i, &a) in arguments.iter().enumerate() {
                        if self.is(a) {
                            found.args.push((*function, i as u32));
                        }
                    }
                    if under {
                        found.calls_under.push(*function);
                    }
                    Jumps::default()
                }
                Statement::Return { value } => {
                    if under || value.is_some_and(|v| self.is(v)) {
                        found.returns = true;
                    }
                    Jumps {
                        out_of_function: under,
                        ..Jumps::default()
                    }
                }
                Statement::Break | Statement::Continue => Jumps {
                    out_of_loop: under,
                    ..Jumps::default()
                },
                Statement::Block(b) => self.walk(module, f, b, under, found),
                Statement::If {
                    condition,
                    accept,
                    reject,
                } => {
                    let cond = under || self.steers(*condition);
                    self.walk(module, f, accept, cond, found)
                        .or(self.walk(module, f, reject, cond, found))
                }
                Statement::Switch { selector, cases } => {
                    let cond = under || self.steers(*selector);
                    cases.iter().fold(Jumps::default(), |j, c| {
                        j.or(self.walk(module, f, &c.body, cond, found))
                    })
                }
                Statement::Loop {
                    body,
                    continuing,
                    break_if,
                } => {
                    let cond = under || break_if.is_some_and(|b| self.steers(b));
                    let mut j = self
                        .walk(module, f, body, cond, found)
                        .or(self.walk(module, f, continuing, cond, found));
                    if j.any() && !cond {
                        // Its turns depend on a tainted value: everything in it does.
                        self.walk(module, f, body, true, found);
                        self.walk(module, f, continuing, true, found);
                    }
                    // A break or continue ends here; what follows runs once it does.
                    j.out_of_loop = false;
                    j
                }
                _ => Jumps::default(),
            };
            if inner.any() {
                under = true;
                jumps = jumps.or(inner);
            }
        }
        jumps
    }

    /// A store or atomic operation through `pointer` (a compare-exchange if
    /// `exchange`), of a tainted value or under a tainted condition if `tainted`.
    fn write(
        &self,
        module: &Module,
        f: &Function,
        pointer: Handle<Expression>,
        tainted: bool,
        exchange: bool,
        found: &mut Found,
    ) {
        let Some((root, by_index)) = self.root_and_index(f, pointer) else {
            return;
        };
        match root {
            Root::Local(lv) => {
                if tainted || by_index {
                    found.locals.insert(lv);
                }
            }
            Root::Global(g) if in_space(module, g, private) => {
                if tainted || by_index {
                    found.globals.insert(g);
                }
            }
            Root::Global(g) => {
                if by_index {
                    found.appended.push(g);
                } else if tainted && exchange {
                    found.exchanged_steered.push((g, pointer));
                } else if tainted {
                    found.steered.push(g);
                }
            }
        }
    }

    /// The variable `pointer` points into, and whether an index on the way is
    /// tainted; `None` for a function's pointer argument.
    fn root_and_index(
        &self,
        f: &Function,
        mut pointer: Handle<Expression>,
    ) -> Option<(Root, bool)> {
        let mut by_index = false;
        loop {
            match f.expressions[pointer] {
                Expression::Access { base, index } => {
                    by_index |= self.is(index);
                    pointer = base;
                }
                Expression::AccessIndex { base, .. } => pointer = base,
                Expression::LocalVariable(lv) => return Some((Root::Local(lv), by_index)),
                Expression::GlobalVariable(g) => return Some((Root::Global(g), by_index)),
                _ => return None,
            }
        }
    }
}

/// The buffers (`var<storage>`) some function of the module stores into or updates
/// with an atomic: an `atomicLoad` of one may see other workgroups' updates.
fn updated_buffers(
    module: &Module,
    functions: &[(Option<Handle<Function>>, &Function)],
) -> HashSet<Global> {
    let mut updated = HashSet::new();
    for (_, f) in functions {
        each_statement(&f.body, &mut |s| {
            if let Statement::Store { pointer, .. } | Statement::Atomic { pointer, .. } = s {
                if let Some(g) = root_global(f, *pointer).filter(|&g| in_storage(module, g)) {
                    updated.insert(g);
                }
            }
        });
    }
    updated
}

/// Whether `pointer` (a chain of accesses from a global) points at an atomic.
fn points_at_atomic(module: &Module, f: &Function, pointer: Handle<Expression>) -> bool {
    fn pointee(module: &Module, f: &Function, p: Handle<Expression>) -> Option<Handle<naga::Type>> {
        let inner = |ty: Handle<naga::Type>, member: Option<u32>| match &module.types[ty].inner {
            TypeInner::Array { base, .. } | TypeInner::BindingArray { base, .. } => Some(*base),
            TypeInner::Struct { members, .. } => {
                member.and_then(|i| members.get(i as usize)).map(|m| m.ty)
            }
            _ => None,
        };
        match f.expressions[p] {
            Expression::GlobalVariable(g) => Some(module.global_variables[g].ty),
            Expression::Access { base, .. } => inner(pointee(module, f, base)?, None),
            Expression::AccessIndex { base, index } => {
                inner(pointee(module, f, base)?, Some(index))
            }
            _ => None,
        }
    }
    pointee(module, f, pointer)
        .is_some_and(|ty| matches!(module.types[ty].inner, TypeInner::Atomic(_)))
}

/// Whether pointers `a` and `b` in `f` are the same location in every invocation:
/// the same variable through the same members and indices, an index being the
/// same expression, argument, literal or constant, or computed alike from those.
/// A value loaded from a variable matches only itself (the variable may change
/// in between). Errs towards "not the same".
fn same_location(f: &Function, a: Handle<Expression>, b: Handle<Expression>) -> bool {
    use Expression as E;
    if a == b {
        return true;
    }
    let same = |x, y| same_location(f, x, y);
    match (&f.expressions[a], &f.expressions[b]) {
        (E::GlobalVariable(x), E::GlobalVariable(y)) => x == y,
        (E::FunctionArgument(x), E::FunctionArgument(y)) => x == y,
        (E::Literal(x), E::Literal(y)) => x == y,
        (E::Constant(x), E::Constant(y)) => x == y,
        (
            E::Access {
                base: b1,
                index: i1,
            },
            E::Access {
                base: b2,
                index: i2,
            },
        ) => same(*b1, *b2) && same(*i1, *i2),
        (
            E::AccessIndex {
                base: b1,
                index: i1,
            },
            E::AccessIndex {
                base: b2,
                index: i2,
            },
        ) => i1 == i2 && same(*b1, *b2),
        (
            E::Binary {
                op: o1,
                left: l1,
                right: r1,
            },
            E::Binary {
                op: o2,
                left: l2,
                right: r2,
            },
        ) => o1 == o2 && same(*l1, *l2) && same(*r1, *r2),
        (
            E::As {
                expr: e1,
                kind: k1,
                convert: c1,
            },
            E::As {
                expr: e2,
                kind: k2,
                convert: c2,
            },
        ) => k1 == k2 && c1 == c2 && same(*e1, *e2),
        _ => false,
    }
}

/// What a pointer points into.
enum Root {
    Local(Handle<naga::LocalVariable>),
    Global(Global),
}

fn in_space(module: &Module, g: Global, space: impl Fn(naga::AddressSpace) -> bool) -> bool {
    space(module.global_variables[g].space)
}

fn in_storage(module: &Module, g: Global) -> bool {
    in_space(module, g, |space| {
        matches!(space, naga::AddressSpace::Storage { .. })
    })
}

/// `var<workgroup>` and `var<private>`: where a value may be kept for later.
fn private(space: naga::AddressSpace) -> bool {
    matches!(
        space,
        naga::AddressSpace::WorkGroup | naga::AddressSpace::Private
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uses(src: &str) -> AtomicUses {
        let module = naga::front::wgsl::parse_str(src).unwrap();
        atomic_uses(&module)
    }

    fn marked(src: &str) -> BTreeSet<u32> {
        uses(src).appended
    }

    const HEAD: &str = "
@group(0) @binding(0) var<storage, read> input: array<u32>;
@group(0) @binding(1) var<storage, read_write> count: atomic<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;
";

    #[test]
    fn an_append_is_found_however_the_slot_travels() {
        // Straight, through a `var`, and through arithmetic.
        for body in [
            "let slot = atomicAdd(&count, 1u); out[slot] = input[i];",
            "var slot: u32; slot = atomicAdd(&count, 1u); out[slot] = input[i];",
            "let slot = atomicAdd(&count, 2u); out[slot + 1u] = input[i];",
            "out[atomicAdd(&count, 1u)] = input[i];",
        ] {
            let src = format!(
                "{HEAD}
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
    let i = gid.x;
    if (i >= arrayLength(&input)) {{ return; }}
    if (input[i] % 3u == 0u) {{ {body} }}
}}"
            );
            assert_eq!(marked(&src), BTreeSet::from([2]), "{body}");
        }
        // Through a helper's argument, and a helper's return value.
        let src = format!(
            "{HEAD}
fn put(slot: u32, v: u32) {{ out[slot] = v; }}
fn take() -> u32 {{ return atomicAdd(&count, 1u); }}
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
    put(take(), input[gid.x]);
}}"
        );
        assert_eq!(marked(&src), BTreeSet::from([2]));
        // A struct holding the counter beside its entries.
        let src = "
struct List { n: atomic<u32>, items: array<u32> }
@group(0) @binding(3) var<storage, read_write> list: List;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let s = atomicAdd(&list.n, 1u);
    list.items[s] = gid.x;
}";
        assert_eq!(marked(src), BTreeSet::from([3]));
    }

    #[test]
    fn a_range_reserved_for_a_workgroup_is_followed_through_workgroup_memory() {
        for load in ["workgroupUniformLoad(&base)", "base"] {
            let src = format!(
                "
@group(0) @binding(0) var<storage, read> input: array<u32>;
@group(0) @binding(1) var<storage, read_write> total: atomic<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;
var<workgroup> local_n: atomic<u32>;
var<workgroup> base: u32;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {{
    let keep = input[gid.x] % 3u == 0u;
    var slot = 0u;
    if (keep) {{ slot = atomicAdd(&local_n, 1u); }}
    workgroupBarrier();
    if (lid == 0u) {{ base = atomicAdd(&total, atomicLoad(&local_n)); }}
    workgroupBarrier();
    let b = {load};
    if (keep) {{ out[b + slot] = input[gid.x]; }}
}}"
            );
            assert_eq!(marked(&src), BTreeSet::from([2]), "{load}");
        }
    }

    #[test]
    fn a_workgroups_own_counter_hands_out_its_own_slots() {
        let src = "
@group(0) @binding(0) var<storage, read> input: array<u32>;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;
var<workgroup> n: atomic<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>,
        @builtin(workgroup_id) wid: vec3<u32>) {
    if (input[gid.x] % 3u == 0u) {
        let slot = atomicAdd(&n, 1u);
        out[wid.x * 64u + slot] = input[gid.x];
    }
}";
        assert_eq!(uses(src), AtomicUses::default());
    }

    #[test]
    fn counters_histograms_and_plain_writes_are_not_appends() {
        let src = format!(
            "{HEAD}
@group(0) @binding(3) var<storage, read_write> bins: array<atomic<u32>>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
    let i = gid.x;
    if (i >= arrayLength(&input)) {{ return; }}
    atomicAdd(&bins[input[i] % 16u], 1u);
    let seen = atomicAdd(&count, 1u);
    out[i] = input[i] * 2u;
}}"
        );
        assert_eq!(uses(&src), AtomicUses::default());
    }

    fn steered(src: &str) -> BTreeSet<u32> {
        let u = uses(src);
        assert!(u.appended.is_empty(), "{:?}", u.appended);
        u.steered
    }

    fn kernel(body: &str) -> String {
        format!(
            "{HEAD}
@group(0) @binding(3) var<storage, read_write> flag: atomic<u32>;
fn put(i: u32) {{ out[i] = 1u; }}
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
    let i = gid.x;
    {body}
}}"
        )
    }

    #[test]
    fn what_an_atomic_answered_is_followed_into_values_and_conditions() {
        for body in [
            // The last to take a ticket finishes the job.
            "if (atomicAdd(&count, 1u) == 63u) { out[0] = 1u; }",
            // A ticket kept.
            "out[i] = atomicAdd(&count, 1u);",
            // A flag another invocation set, read back.
            "atomicStore(&flag, 1u); out[i] = atomicLoad(&flag);",
            // Through a local set under the condition.
            "var first = 0u; if (atomicAdd(&count, 1u) == 0u) { first = 1u; } out[i] = first;",
            // After a return taken under it.
            "if (atomicLoad(&flag) != 0u) { return; } atomicStore(&flag, 1u); out[i] = 2u;",
            // In a helper called under it, and under a switch on it.
            "if (atomicMax(&count, i) < i) { put(i); }",
            "switch (atomicAdd(&count, 1u) % 2u) { case 0u: { out[i] = 1u; } default: {} }",
            // Through a select's condition.
            "out[i] = select(1u, 2u, atomicAdd(&count, 1u) == 0u);",
        ] {
            let steered = steered(&kernel(body));
            assert!(
                steered.contains(&2) && !steered.contains(&0),
                "{body}: {steered:?}"
            );
        }
        // In a loop a break under it ends: its counter, set under it, indexes the
        // store, which is steered (no append: no value from the atomic is a slot).
        let body = "for (var k = 0u; k < 4u; k++) { out[i + k] = k; if (atomicAdd(&count, 1u) > 9u) { break; } }";
        assert!(steered(&kernel(body)).contains(&2));
    }

    #[test]
    fn atomics_whose_answers_go_nowhere_steer_nothing() {
        for body in [
            // Counters and bins; an atomicLoad of a buffer nothing here updates.
            "atomicAdd(&count, 1u); out[i] = input[i] * 2u;",
            "let seen = atomicAdd(&count, 1u); out[i] = 3u;",
            // What follows a spin on a flag runs once, however long it spun.
            "loop { if (atomicLoad(&flag) == 1u) { break; } } out[i] = input[i];",
        ] {
            assert!(steered(&kernel(body)).is_empty(), "{body}");
        }
        let src = "
@group(0) @binding(0) var<storage, read_write> counts: array<atomic<u32>>;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    out[gid.x] = atomicLoad(&counts[gid.x]) * 2u;
}";
        assert!(steered(src).is_empty());
    }

    #[test]
    fn a_buffers_own_compare_exchange_loop_is_its_reduction_not_steered() {
        let cas = |value: &str| {
            format!(
                "
@group(0) @binding(0) var<storage, read_write> sum: array<atomic<u32>>;
@group(0) @binding(1) var<storage, read_write> other: atomic<u32>;
fn add(j: u32, v: f32) {{
    var old = atomicLoad(&sum[j]);
    loop {{
        let r = atomicCompareExchangeWeak(&sum[j], old, bitcast<u32>(bitcast<f32>(old) + {value}));
        if (r.exchanged) {{ break; }}
        old = r.old_value;
    }}
}}
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
    add(gid.x % 4u, 1.5);
}}"
            )
        };
        assert!(steered(&cas("v")).is_empty());
        // An add on a buffer only while its own count is low is steered.
        let src = "
@group(0) @binding(0) var<storage, read_write> counts: array<atomic<u32>>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (atomicAdd(&counts[0], 1u) < 100u) { atomicAdd(&counts[1], 1u); }
}";
        assert_eq!(steered(src), BTreeSet::from([0]));
        // Adding what another buffer's atomic answered is steered, and so is that
        // buffer: it counts the loop's retries.
        assert_eq!(
            steered(&cas("f32(atomicAdd(&other, 1u))")),
            BTreeSet::from([0, 1])
        );
        // The same loop written inline at a location computed alike twice.
        let inline = "
@group(0) @binding(0) var<storage, read_write> sum: array<atomic<u32>>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var old = atomicLoad(&sum[gid.x % 4u]);
    loop {
        let r = atomicCompareExchangeWeak(&sum[gid.x % 4u], old, bitcast<u32>(bitcast<f32>(old) + 1.0));
        if (r.exchanged) { break; }
        old = r.old_value;
    }
}";
        assert!(steered(inline).is_empty());
        // A word of a buffer set, once, from what another word of it held: each
        // shard copies its own count, and the merge adds the copies.
        let other_word = |load: &str, target: &str| {
            format!(
                "
@group(0) @binding(0) var<storage, read_write> words: array<atomic<u32>>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
    atomicAdd(&words[0], 1u);
    let seen = atomicLoad(&words[{load}]);
    atomicCompareExchangeWeak(&words[{target}], 0u, seen);
}}"
            )
        };
        assert_eq!(steered(&other_word("0u", "1u")), BTreeSet::from([0]));
        assert_eq!(
            steered(&other_word("gid.x", "gid.x + 1u")),
            BTreeSet::from([0])
        );
        // Set from what that same word held: its own loop, not steered.
        assert_eq!(steered(&other_word("1u", "1u")), BTreeSet::new());
    }
}
