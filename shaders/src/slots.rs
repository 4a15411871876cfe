//! Buffers a kernel writes at slots an atomic hands out: the append (stream
//! compaction) pattern of WebGPU tutorials,
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
//! cannot be split into shards at all, whatever the merge rule, and the task is
//! refused up front (see `Kernel::check`).
//!
//! The analysis follows values, not control flow: a value is a slot if it is the
//! result of an atomic operation on a buffer (`atomicAdd`, `atomicSub`, `atomicMax`,
//! `atomicExchange`, ... on a `var<storage>`; one on a `var<workgroup>` hands out
//! the workgroup's own slots, and a shard runs whole workgroups) or is computed
//! from one, through expressions, local variables, `var<workgroup>` and
//! `var<private>` variables (a workgroup's base in the output, reserved by one
//! invocation for all), function arguments and return values, in any function of
//! the module. A store (or an atomic
//! operation) through a pointer into a `@group(0)` buffer whose index is a slot marks
//! that buffer. It errs towards marking: a slot used only, say, to pick a bin
//! through a condition is not followed, but one used in arithmetic for an index is.

use std::collections::{BTreeSet, HashSet};

use naga::{Block, Expression, Function, Handle, Module, Statement};

/// The `@group(0)` binding numbers of the buffers `module` writes at an index computed
/// from an atomic operation's result.
pub(crate) fn written_at_atomic_slots(module: &Module) -> BTreeSet<u32> {
    let functions: Vec<(Option<Handle<Function>>, &Function)> = module
        .functions
        .iter()
        .map(|(h, f)| (Some(h), f))
        .chain(module.entry_points.iter().map(|ep| (None, &ep.function)))
        .collect();
    let mut state: Vec<Taint> = functions
        .iter()
        .map(|(_, f)| Taint::new(module, f))
        .collect();
    // Arguments a caller passes a slot in, functions that return one, and
    // `var<workgroup>` / `var<private>` variables one is stored in (a workgroup's
    // base in the output, reserved by one invocation for all).
    let mut slot_args: HashSet<(Handle<Function>, u32)> = HashSet::new();
    let mut slot_returns: HashSet<Handle<Function>> = HashSet::new();
    let mut slot_globals: HashSet<Handle<naga::GlobalVariable>> = HashSet::new();
    let mut marked = BTreeSet::new();
    // Each round can only add; a module has finitely many of everything.
    loop {
        let mut changed = false;
        for (i, (handle, f)) in functions.iter().enumerate() {
            let t = &mut state[i];
            changed |= t.expressions(f, *handle, &slot_args, &slot_returns, &slot_globals);
            let mut found = Found::default();
            t.statements(module, f, &f.body, &mut found);
            changed |= t.locals_changed(found.locals);
            changed |= t.uniform_loads_changed(found.uniform_loads);
            for global in found.globals {
                changed |= slot_globals.insert(global);
            }
            for call in found.args {
                changed |= slot_args.insert(call);
            }
            if found.returns {
                if let Some(h) = handle {
                    changed |= slot_returns.insert(*h);
                }
            }
            for global in found.stores {
                if let Some(rb) = &module.global_variables[global].binding {
                    if rb.group == 0 {
                        marked.insert(rb.binding);
                    }
                }
            }
        }
        if !changed {
            return marked;
        }
    }
}

/// What one function's values are slots.
struct Taint {
    expressions: Vec<bool>,
    locals: HashSet<Handle<naga::LocalVariable>>,
    /// The results of atomic operations on buffers (`var<storage>`): where slots
    /// come from. One on a `var<workgroup>` counts within a workgroup, which a
    /// shard runs whole, so the slots it hands out are the workgroup's own.
    sources: HashSet<Handle<Expression>>,
    /// `workgroupUniformLoad` results of a variable holding a slot.
    uniform_loads: HashSet<Handle<Expression>>,
}

/// What a walk of one function's statements found.
#[derive(Default)]
struct Found {
    locals: HashSet<Handle<naga::LocalVariable>>,
    globals: HashSet<Handle<naga::GlobalVariable>>,
    uniform_loads: HashSet<Handle<Expression>>,
    args: Vec<(Handle<Function>, u32)>,
    returns: bool,
    stores: Vec<Handle<naga::GlobalVariable>>,
}

impl Taint {
    fn new(module: &Module, f: &Function) -> Self {
        let mut sources = HashSet::new();
        storage_atomics(module, f, &f.body, &mut sources);
        Taint {
            expressions: vec![false; f.expressions.len()],
            locals: HashSet::new(),
            sources,
            uniform_loads: HashSet::new(),
        }
    }

    fn is(&self, e: Handle<Expression>) -> bool {
        self.expressions[e.index()]
    }

    /// Marks the expressions that are slots, given the locals, arguments and
    /// returns known to be; whether any is new. Operands come before the
    /// expressions that use them in the arena, so one pass in order suffices.
    fn expressions(
        &mut self,
        f: &Function,
        me: Option<Handle<Function>>,
        slot_args: &HashSet<(Handle<Function>, u32)>,
        slot_returns: &HashSet<Handle<Function>>,
        slot_globals: &HashSet<Handle<naga::GlobalVariable>>,
    ) -> bool {
        let mut changed = false;
        for (h, e) in f.expressions.iter() {
            if self.expressions[h.index()] {
                continue;
            }
            let any = |hs: &[Option<Handle<Expression>>]| hs.iter().flatten().any(|&x| self.is(x));
            let slot = match *e {
                Expression::AtomicResult { .. } => self.sources.contains(&h),
                Expression::FunctionArgument(i) => me.is_some_and(|m| slot_args.contains(&(m, i))),
                Expression::CallResult(callee) => slot_returns.contains(&callee),
                Expression::LocalVariable(lv) => self.locals.contains(&lv),
                Expression::GlobalVariable(g) => slot_globals.contains(&g),
                Expression::WorkGroupUniformLoadResult { .. } => self.uniform_loads.contains(&h),
                Expression::Load { pointer } => any(&[Some(pointer)]),
                Expression::Access { base, index } => any(&[Some(base), Some(index)]),
                Expression::AccessIndex { base, .. } => any(&[Some(base)]),
                Expression::Splat { value, .. } => any(&[Some(value)]),
                Expression::Swizzle { vector, .. } => any(&[Some(vector)]),
                Expression::Compose { ref components, .. } => {
                    components.iter().any(|&c| self.is(c))
                }
                Expression::Unary { expr, .. } | Expression::As { expr, .. } => any(&[Some(expr)]),
                Expression::Binary { left, right, .. } => any(&[Some(left), Some(right)]),
                Expression::Select { accept, reject, .. } => any(&[Some(accept), Some(reject)]),
                Expression::Math {
                    arg,
                    arg1,
                    arg2,
                    arg3,
                    ..
                } => any(&[Some(arg), arg1, arg2, arg3]),
                _ => false,
            };
            if slot {
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

    fn uniform_loads_changed(&mut self, found: HashSet<Handle<Expression>>) -> bool {
        let before = self.uniform_loads.len();
        self.uniform_loads.extend(found);
        self.uniform_loads.len() != before
    }

    /// Walks `block`: stores of slots into locals, slots passed to calls or
    /// returned, and writes into buffers at a slot.
    fn statements(&self, module: &Module, f: &Function, block: &Block, found: &mut Found) {
        each_statement(block, &mut |s| match s {
            Statement::Store { pointer, value } => match root(f, *pointer) {
                Some(Root::Local(lv)) if self.is(*value) => {
                    found.locals.insert(lv);
                }
                Some(Root::Global(g)) => {
                    if let Some(global) = self.indexed_by_slot(f, *pointer) {
                        found.stores.push(global);
                    } else if self.is(*value) && in_space(module, g, private) {
                        found.globals.insert(g);
                    }
                }
                _ => {}
            },
            Statement::WorkGroupUniformLoad { pointer, result } if self.is(*pointer) => {
                found.uniform_loads.insert(*result);
            }
            Statement::Atomic { pointer, .. } => {
                if let Some(global) = self.indexed_by_slot(f, *pointer) {
                    found.stores.push(global);
                }
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
            }
            Statement::Return { value: Some(v) } if self.is(*v) => found.returns = true,
            _ => {}
        });
    }

    /// The global variable `pointer` points into, if an index on the way is a slot.
    fn indexed_by_slot(
        &self,
        f: &Function,
        mut pointer: Handle<Expression>,
    ) -> Option<Handle<naga::GlobalVariable>> {
        let mut by_slot = false;
        loop {
            match f.expressions[pointer] {
                Expression::Access { base, index } => {
                    by_slot |= self.is(index);
                    pointer = base;
                }
                Expression::AccessIndex { base, .. } => pointer = base,
                Expression::GlobalVariable(g) => return by_slot.then_some(g),
                _ => return None,
            }
        }
    }
}

/// Collects into `sources` the results of the atomic operations in `block` on
/// buffers in `var<storage>` (through a pointer rooted at the variable itself; one
/// through a function's pointer argument is not followed).
fn storage_atomics(
    module: &Module,
    f: &Function,
    block: &Block,
    sources: &mut HashSet<Handle<Expression>>,
) {
    each_statement(block, &mut |s| {
        if let Statement::Atomic {
            pointer,
            result: Some(r),
            ..
        } = s
        {
            if let Some(Root::Global(g)) = root(f, *pointer) {
                if in_space(module, g, |space| {
                    matches!(space, naga::AddressSpace::Storage { .. })
                }) {
                    sources.insert(*r);
                }
            }
        }
    });
}

/// Calls `visit` with every statement of `block`, those of nested blocks included.
fn each_statement<'a>(block: &'a Block, visit: &mut impl FnMut(&'a Statement)) {
    for s in block.iter() {
        visit(s);
        match s {
            Statement::Block(b) => each_statement(b, visit),
            Statement::If { accept, reject, .. } => {
                each_statement(accept, visit);
                each_statement(reject, visit);
            }
            Statement::Switch { cases, .. } => {
                for c in cases {
                    each_statement(&c.body, visit);
                }
            }
            Statement::Loop {
                body, continuing, ..
            } => {
                each_statement(body, visit);
                each_statement(continuing, visit);
            }
            _ => {}
        }
    }
}

/// What a pointer points into.
enum Root {
    Local(Handle<naga::LocalVariable>),
    Global(Handle<naga::GlobalVariable>),
}

/// The variable `pointer` points into, through any indexing; `None` for a
/// function's pointer argument.
fn root(f: &Function, mut pointer: Handle<Expression>) -> Option<Root> {
    loop {
        match f.expressions[pointer] {
            Expression::Access { base, .. } | Expression::AccessIndex { base, .. } => {
                pointer = base;
            }
            Expression::LocalVariable(lv) => return Some(Root::Local(lv)),
            Expression::GlobalVariable(g) => return Some(Root::Global(g)),
            _ => return None,
        }
    }
}

fn in_space(
    module: &Module,
    g: Handle<naga::GlobalVariable>,
    space: impl Fn(naga::AddressSpace) -> bool,
) -> bool {
    space(module.global_variables[g].space)
}

/// `var<workgroup>` and `var<private>`: where a slot may be kept for later.
fn private(space: naga::AddressSpace) -> bool {
    matches!(
        space,
        naga::AddressSpace::WorkGroup | naga::AddressSpace::Private
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marked(src: &str) -> BTreeSet<u32> {
        let module = naga::front::wgsl::parse_str(src).unwrap();
        written_at_atomic_slots(&module)
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
        assert!(marked(src).is_empty());
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
        assert!(marked(&src).is_empty());
    }
}
