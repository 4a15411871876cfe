//! What a compare-exchange does to its word, read from the kernel: the operation a
//! merge rule must fold for its shards' partials to give the whole grid's answer.
//!
//! WGSL has no float atomics, so kernels keep float sums, maxima and minima with a
//! compare-exchange loop, written one of two ways:
//! - the new value made from the old one: `bitcast<u32>(bitcast<f32>(old) + v)`
//!   (a sum), `max(old, v)` (a maximum);
//! - the winner swapped in whole, once it beats the old value: the loop leaves
//!   when `bitcast<f32>(old) >= v`, or swaps only under `if (v > old)`, or picks
//!   with `select(old, v, v > old)` (a maximum).
//!
//! A helper function that makes its answer by one operation on the old value
//! (`fn fmax(a: f32, b: f32) -> f32 { return max(a, b); }`) counts as that
//! operation, and so does a variable set by stores one after another in one block
//! (`var next = bitcast<f32>(old); next += v;`): a read of it is what the last
//! store before the read made. Where neither is seen — the old value met in a
//! helper that chooses under an `if`, through a variable set under a condition or
//! by a helper, or under a condition that is no such comparison — the exchange is
//! [`AtomicOp::CompareExchange`], which no merge rule folds: the kernel is refused
//! split rather than merged by a rule that may not be its own.
//! An exchange that expects a constant (a slot claimed with
//! `atomicCompareExchangeWeak(&owner, 0u, id)`), or a loop that swaps in a value
//! made without the old one under no condition on it, sets its word
//! ([`AtomicOp::Claim`]), as `atomicExchange` does. One that expects anything else
//! not read from the word (an invocation's own number) folds under no rule.

use naga::{
    BinaryOperator as B, Block, Expression as E, Function, Handle, LocalVariable,
    MathFunction as M, Module, Statement,
};

use crate::atomic_ops::{AtomicOp, Combine};

type Expr = Handle<naga::Expression>;

/// What the compare-exchange `exchange` (a statement of `f`, exchanging `compare`
/// for `value` at `pointer`) does to its word.
pub(crate) fn exchange_op(
    module: &Module,
    f: &Function,
    exchange: &Statement,
    pointer: Expr,
    compare: Expr,
    value: Expr,
) -> AtomicOp {
    // Only a `compare` read from the word (`atomicLoad`, or a variable holding what
    // it held) is its old value. A constant makes the exchange a claim of a word
    // still holding it (`0u`: empty); anything else (a word stepped on only when it
    // holds this invocation's number) nothing any rule folds.
    match f.expressions[compare] {
        E::Load { .. } => {}
        E::Literal(_) | E::Constant(_) | E::ZeroValue(_) => return AtomicOp::Claim,
        _ => return AtomicOp::CompareExchange,
    }
    let old = Old::new(module, f, pointer, compare);
    let op = decided(&old, f, exchange, value);
    // Swapped or not by what the old value points at (`values[old]`): the word
    // holds an index.
    if op == AtomicOp::CompareExchange && old.chosen_by_pointee.get() {
        return AtomicOp::IndexExchange;
    }
    op
}

/// What the exchange does, by the new value it swaps in and the conditions it
/// runs under (see [`exchange_op`]).
fn decided(old: &Old, f: &Function, exchange: &Statement, value: Expr) -> AtomicOp {
    let made = old.made(value);
    // What is swapped in: the new value, or in `max(old, v)` the `v`.
    let winner = match f.expressions[strip(f, value)] {
        E::Math {
            fun: M::Max | M::Min,
            arg,
            arg1: Some(arg1),
            ..
        } => match (old.made(arg), old.made(arg1)) {
            (Made::Old, _) => strip(f, arg1),
            (_, Made::Old) => strip(f, arg),
            _ => strip(f, value),
        },
        _ => strip(f, value),
    };
    // The conditions the exchange runs under that read the old value, each as the
    // operation it makes of the loop.
    let mut guarded = None;
    for (condition, holds) in guards(&f.body, exchange, &mut Vec::new()).unwrap_or_default() {
        if old.made(condition) == Made::Without {
            continue;
        }
        let Some(c) = old.keeps(condition, holds, winner) else {
            old.chosen_by(condition);
            return AtomicOp::CompareExchange;
        };
        if guarded.is_some_and(|g| g != c) {
            return AtomicOp::CompareExchange;
        }
        guarded = Some(c);
    }
    match (made, guarded) {
        // Left as it was: the word keeps what it holds.
        (Made::Old, _) => AtomicOp::Claim,
        // Swapped in whatever the word held: set, as by `atomicExchange`.
        (Made::Without, None) => AtomicOp::Claim,
        (Made::Without, Some(c)) => AtomicOp::Loop(c),
        (Made::By(c), None) => AtomicOp::Loop(c),
        // A maximum kept by `max(old, v)` that also leaves once `old >= v`.
        (Made::By(c), Some(g)) if c == g => AtomicOp::Loop(c),
        _ => AtomicOp::CompareExchange,
    }
}

/// How an expression is made from the old value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Made {
    /// Without it.
    Without,
    /// It is the old value, through bitcasts and conversions.
    Old,
    /// The old value combined with values made without it, by one operation.
    By(Combine),
    /// From it, some other way.
    Unknown,
}

/// The old value of one compare-exchange, in the function it is in.
struct Old<'a> {
    module: &'a Module,
    f: &'a Function,
    /// The expression passed as the exchange's `compare`.
    compare: Expr,
    /// The variable `compare` loads, if it loads one (`var old = atomicLoad(..)`,
    /// set again from each exchange's `old_value`): its every load is the old value.
    var: Option<Handle<LocalVariable>>,
    /// What the exchanged word is part of: any other read of it is the old value
    /// too (or a newer one), not a value made without it.
    word: Option<Root>,
    /// Set once memory where the old value points was met (`values[old]`).
    pointed: std::cell::Cell<bool>,
    /// Set once a swap was seen to be decided by such memory (an argmin's
    /// `values[old] <= values[i]`), under no comparison [`Old::keeps`] reads.
    chosen_by_pointee: std::cell::Cell<bool>,
}

/// The buffer (or the pointer argument) a pointer points into.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Root {
    Global(Handle<naga::GlobalVariable>),
    Argument(u32),
}

fn root(f: &Function, mut pointer: Expr) -> Option<Root> {
    loop {
        match f.expressions[pointer] {
            E::Access { base, .. } | E::AccessIndex { base, .. } => pointer = base,
            E::GlobalVariable(g) => return Some(Root::Global(g)),
            E::FunctionArgument(i) => return Some(Root::Argument(i)),
            _ => return None,
        }
    }
}

impl<'a> Old<'a> {
    fn new(module: &'a Module, f: &'a Function, pointer: Expr, compare: Expr) -> Self {
        let var = match f.expressions[compare] {
            E::Load { pointer } => match f.expressions[pointer] {
                E::LocalVariable(v) => Some(v),
                _ => None,
            },
            _ => None,
        };
        Old {
            module,
            f,
            compare,
            var,
            word: root(f, pointer),
            pointed: std::cell::Cell::new(false),
            chosen_by_pointee: std::cell::Cell::new(false),
        }
    }

    /// What helper `callee` returns of its argument `index`, given as the old
    /// value (its other arguments made without it): `fn fmax(a: f32, b: f32) ->
    /// f32 { return max(a, b); }` keeps the greatest. Its every `return` must make
    /// the same of it; else (a `return` under an `if`, say) `Unknown`.
    fn returned(&self, callee: Handle<Function>, index: u32) -> Made {
        let g = &self.module.functions[callee];
        let Some((argument, _)) = g
            .expressions
            .iter()
            .find(|(_, e)| matches!(e, E::FunctionArgument(i) if *i == index))
        else {
            return Made::Without;
        };
        let inner = Old {
            module: self.module,
            f: g,
            compare: argument,
            var: None,
            word: None,
            pointed: std::cell::Cell::new(false),
            chosen_by_pointee: std::cell::Cell::new(false),
        };
        let mut made = None;
        let mut agree = true;
        crate::ir::each_statement(&g.body, &mut |s| {
            if let Statement::Return { value } = s {
                let m = value.map_or(Made::Unknown, |v| inner.made(v));
                agree &= made.is_none_or(|seen| seen == m);
                made = Some(m);
            }
        });
        match made {
            Some(m) if agree => m,
            _ => Made::Unknown,
        }
    }

    fn made(&self, e: Expr) -> Made {
        self.made_seen(e, &mut Vec::new())
    }

    /// `made`, having followed the variables in `seen` already.
    fn made_seen(&self, e: Expr, seen: &mut Vec<Handle<LocalVariable>>) -> Made {
        if e == self.compare {
            return Made::Old;
        }
        let f = self.f;
        // Read where the old value points (`values[old]`, `lut[old % 4u]`): what it
        // holds is chosen by the old value, by no one operation.
        if let E::Load { pointer } = f.expressions[e] {
            if self.indexed_by_old(pointer, seen) {
                self.pointed.set(true);
                return Made::Unknown;
            }
        }
        let mut made = |x: Expr| self.made_seen(x, seen);
        match &f.expressions[e] {
            E::Load { pointer } => match local_root(f, *pointer) {
                Some(v) if Some(v) == self.var => Made::Old,
                // Another variable: what the last store before this load made, if
                // it is set store after store in one block; else from the old
                // value if any store into it is.
                Some(v) if !seen.contains(&v) => self
                    .last_stored(v, e, seen)
                    .unwrap_or_else(|| self.any_store(v, seen)),
                Some(_) => Made::Without,
                // Memory: the value it holds is made without the old one, unless
                // it is the exchanged word's buffer (`atomicLoad(&best)` read again).
                None => {
                    if root(f, *pointer).is_some_and(|r| Some(r) == self.word) {
                        Made::Unknown
                    } else {
                        Made::Without
                    }
                }
            },
            E::As { expr, .. } => made(*expr),
            E::Unary { expr, .. } => match made(*expr) {
                Made::Without => Made::Without,
                _ => Made::Unknown,
            },
            E::Binary { op, left, right } => {
                let (l, r) = (made(*left), made(*right));
                let by = match op {
                    B::Add => Combine::Add,
                    // `old - v` takes away as a sum adds; `v - old` does not.
                    B::Subtract if r == Made::Without => Combine::Add,
                    B::InclusiveOr => Combine::Or,
                    B::And => Combine::And,
                    B::ExclusiveOr => Combine::Xor,
                    _ => Combine::Other,
                };
                one_operation(l, r, by)
            }
            E::Math {
                fun: fun @ (M::Max | M::Min),
                arg,
                arg1: Some(arg1),
                ..
            } => {
                let by = if *fun == M::Max {
                    Combine::Max
                } else {
                    Combine::Min
                };
                one_operation(made(*arg), made(*arg1), by)
            }
            E::Math {
                arg, arg1, arg2, ..
            } => {
                let args = [Some(*arg), *arg1, *arg2];
                if args.into_iter().flatten().all(|a| made(a) == Made::Without) {
                    Made::Without
                } else {
                    Made::Unknown
                }
            }
            // `select(old, v, v > old)`: `v` swapped in when it wins.
            E::Select {
                condition,
                accept,
                reject,
            } => match (made(*accept), made(*reject), made(*condition)) {
                (Made::Without, Made::Without, _) => Made::Without,
                (Made::Without, Made::Old, _) => self
                    .keeps(*condition, true, strip(f, *accept))
                    .map_or_else(|| self.chosen_by(*condition), Made::By),
                (Made::Old, Made::Without, _) => self
                    .keeps(*condition, false, strip(f, *reject))
                    .map_or_else(|| self.chosen_by(*condition), Made::By),
                _ => Made::Unknown,
            },
            // A helper's answer: what it returns of the one argument that is the
            // old value; made without it if no argument is made from it.
            E::CallResult(callee) => {
                let Some(args) = call_arguments(&f.body, e) else {
                    return Made::Unknown;
                };
                let args: Vec<Made> = args.into_iter().map(made).collect();
                let mut from_old = args
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| **m != Made::Without);
                match (from_old.next(), from_old.next()) {
                    (None, _) => Made::Without,
                    (Some((i, Made::Old)), None) => self.returned(*callee, i as u32),
                    _ => Made::Unknown,
                }
            }
            // Any other expression made from the old value (a vector built of it, a
            // component, a swizzle) is made from it some other way.
            E::Access { base, index } => any_from_old(&mut made, &[*base, *index]),
            E::AccessIndex { base: x, .. }
            | E::Splat { value: x, .. }
            | E::Swizzle { vector: x, .. }
            | E::Relational { argument: x, .. } => any_from_old(&mut made, &[*x]),
            E::Compose { components, .. } => any_from_old(&mut made, components),
            _ => Made::Without,
        }
    }

    /// Notes a swap decided by `condition`, which no comparison [`Old::keeps`]
    /// reads: chosen by what the old value points at if the condition reads such
    /// memory. `Unknown`, what the swap then makes.
    fn chosen_by(&self, condition: Expr) -> Made {
        let before = self.pointed.replace(false);
        let _ = self.made(condition);
        if self.pointed.get() {
            self.chosen_by_pointee.set(true);
        }
        self.pointed.set(before || self.pointed.get());
        Made::Unknown
    }

    /// What variable `v` holds where `load` reads it, `v` being set by stores one
    /// after another in one block ([`stored_in_turn`]): what the last store before
    /// the load made (each read of `v` in it what the store before that made, and
    /// so on). `None` when the load is not in that block after a store.
    fn last_stored(
        &self,
        v: Handle<LocalVariable>,
        load: Expr,
        seen: &mut Vec<Handle<LocalVariable>>,
    ) -> Option<Made> {
        let turns = stored_in_turn(self.f, v)?;
        let at = *turns.emitted.get(&load)?;
        let (_, value) = turns.stores.iter().rev().find(|(i, _)| *i < at)?;
        Some(self.made_seen(*value, seen))
    }

    /// From the old value if any store into `v` is (what sets it, not when).
    fn any_store(&self, v: Handle<LocalVariable>, seen: &mut Vec<Handle<LocalVariable>>) -> Made {
        seen.push(v);
        let from_old = what_sets(self.f, v)
            .into_iter()
            .any(|stored| self.made_seen(stored, seen) != Made::Without);
        if from_old {
            Made::Unknown
        } else {
            Made::Without
        }
    }

    /// Whether `pointer` indexes with a value made from the old one.
    fn indexed_by_old(&self, mut pointer: Expr, seen: &mut Vec<Handle<LocalVariable>>) -> bool {
        loop {
            match self.f.expressions[pointer] {
                E::Access { base, index } => {
                    if self.made_seen(index, seen) != Made::Without {
                        return true;
                    }
                    pointer = base;
                }
                E::AccessIndex { base, .. } => pointer = base,
                _ => return false,
            }
        }
    }

    /// What swapping `winner` in keeps when `condition` is `holds`: the greatest
    /// where it says the winner is greater than the old value (`v > old`, or
    /// `old >= v` false), the least where less. `None` for any other condition.
    fn keeps(&self, condition: Expr, holds: bool, winner: Expr) -> Option<Combine> {
        let f = self.f;
        let (op, left, right) = match f.expressions[condition] {
            E::Binary { op, left, right } => (op, left, right),
            E::Unary {
                op: naga::UnaryOperator::LogicalNot,
                expr,
            } => return self.keeps(expr, !holds, winner),
            _ => return None,
        };
        let is_old = |x| self.made(x) == Made::Old;
        let is_winner = |x| strip(f, x) == winner || same_load(f, strip(f, x), winner);
        // As `winner OP old`.
        let greater = match (
            is_winner(left) && is_old(right),
            is_old(left) && is_winner(right),
        ) {
            (true, _) => matches!(op, B::Greater | B::GreaterEqual),
            (_, true) => matches!(op, B::Less | B::LessEqual),
            _ => return None,
        };
        if !matches!(op, B::Greater | B::GreaterEqual | B::Less | B::LessEqual) {
            return None;
        }
        Some(if greater == holds {
            Combine::Max
        } else {
            Combine::Min
        })
    }
}

/// `Unknown` if any of `parts` is made from the old value, else `Without`.
fn any_from_old(made: &mut impl FnMut(Expr) -> Made, parts: &[Expr]) -> Made {
    if parts.iter().all(|&p| made(p) == Made::Without) {
        Made::Without
    } else {
        Made::Unknown
    }
}

/// One operation `by` between the old value (or the same operation on it already)
/// and values made without it.
fn one_operation(left: Made, right: Made, by: Combine) -> Made {
    let on_old = |m: Made| m == Made::Old || m == Made::By(by);
    match (left, right) {
        (Made::Without, Made::Without) => Made::Without,
        (l, Made::Without) if on_old(l) => Made::By(by),
        (Made::Without, r) if on_old(r) => Made::By(by),
        _ => Made::Unknown,
    }
}

/// `e` without its bitcasts and conversions.
fn strip(f: &Function, mut e: Expr) -> Expr {
    while let E::As { expr, .. } = f.expressions[e] {
        e = expr;
    }
    e
}

/// Whether `a` and `b` both load the same local variable (`v` read twice).
fn same_load(f: &Function, a: Expr, b: Expr) -> bool {
    let var = |e: Expr| match f.expressions[e] {
        E::Load { pointer } => match f.expressions[pointer] {
            E::LocalVariable(v) => Some(v),
            _ => None,
        },
        _ => None,
    };
    var(a).is_some() && var(a) == var(b)
}

/// The local variable `pointer` points into, through any indexing.
fn local_root(f: &Function, mut pointer: Expr) -> Option<Handle<LocalVariable>> {
    loop {
        match f.expressions[pointer] {
            E::Access { base, .. } | E::AccessIndex { base, .. } => pointer = base,
            E::LocalVariable(v) => return Some(v),
            _ => return None,
        }
    }
}

/// What decides local variable `var`'s value in `f`: the values stored into
/// it (its initializer included) and the conditions each store is made under (a
/// flag set once the old value is seen to win).
fn what_sets(f: &Function, var: Handle<LocalVariable>) -> Vec<Expr> {
    let mut values: Vec<Expr> = f.local_variables[var].init.into_iter().collect();
    let block = &f.body;
    crate::ir::each_statement(block, &mut |s| {
        if let Statement::Store { pointer, value } = s {
            if local_root(f, *pointer) == Some(var) {
                values.push(*value);
                let under = guards(block, s, &mut Vec::new()).unwrap_or_default();
                values.extend(under.into_iter().map(|(condition, _)| condition));
            }
        }
    });
    values
}

/// A variable's stores, all statements of one block, none under a condition.
struct InTurn {
    /// Each store's place in the block, and the value stored, in order.
    stores: Vec<(usize, Expr)>,
    /// The place in the block of the statement each expression is evaluated in (or
    /// inside of).
    emitted: std::collections::HashMap<Expr, usize>,
}

/// `v`'s stores when every one sets the whole variable and is a statement of one
/// block (so each runs after the one before it whenever the block runs), and no
/// pointer to `v` is handed to a function: `var next = bitcast<f32>(old); next +=
/// v;`. Its initializer is not counted: a read before the first store is not
/// followed. `None` otherwise.
fn stored_in_turn(f: &Function, v: Handle<LocalVariable>) -> Option<InTurn> {
    let mut homes: Vec<*const Block> = Vec::new();
    let mut whole = true;
    each_block(&f.body, &mut |block| {
        for s in block.iter() {
            match s {
                Statement::Store { pointer, .. } if local_root(f, *pointer) == Some(v) => {
                    whole &= matches!(f.expressions[*pointer], E::LocalVariable(w) if w == v);
                    if !homes.contains(&(block as *const Block)) {
                        homes.push(block);
                    }
                }
                Statement::Call { arguments, .. } => {
                    whole &= !arguments.iter().any(|a| local_root(f, *a) == Some(v));
                }
                _ => {}
            }
        }
    });
    let [home] = homes[..] else {
        return None;
    };
    if !whole {
        return None;
    }
    let mut found = None;
    each_block(&f.body, &mut |block| {
        if std::ptr::eq(block, home) {
            found = Some(block);
        }
    });
    let block = found?;
    let mut turns = InTurn {
        stores: Vec::new(),
        emitted: std::collections::HashMap::new(),
    };
    for (i, s) in block.iter().enumerate() {
        if let Statement::Store { pointer, value } = s {
            if local_root(f, *pointer) == Some(v) {
                turns.stores.push((i, *value));
            }
        }
        let mut mark = |s: &Statement| {
            if let Statement::Emit(range) = s {
                for e in range.clone() {
                    turns.emitted.insert(e, i);
                }
            }
        };
        mark(s);
        for inner in blocks_of(s) {
            crate::ir::each_statement(inner, &mut mark);
        }
    }
    Some(turns)
}

/// Calls `visit` with `block` and every block nested in it.
fn each_block<'a>(block: &'a Block, visit: &mut impl FnMut(&'a Block)) {
    visit(block);
    for s in block.iter() {
        for inner in blocks_of(s) {
            each_block(inner, visit);
        }
    }
}

/// The blocks directly inside statement `s`.
fn blocks_of(s: &Statement) -> Vec<&Block> {
    match s {
        Statement::Block(b) => vec![b],
        Statement::If { accept, reject, .. } => vec![accept, reject],
        Statement::Switch { cases, .. } => cases.iter().map(|c| &c.body).collect(),
        Statement::Loop {
            body, continuing, ..
        } => vec![body, continuing],
        _ => Vec::new(),
    }
}

/// The arguments of the call whose result is `result`.
fn call_arguments(block: &Block, result: Expr) -> Option<Vec<Expr>> {
    let mut found = None;
    crate::ir::each_statement(block, &mut |s| {
        if let Statement::Call {
            arguments,
            result: Some(r),
            ..
        } = s
        {
            if *r == result {
                found = Some(arguments.clone());
            }
        }
    });
    found
}

/// The conditions `target` (a statement in `block`) runs under, with whether each
/// holds: those of the `if`s around it, and of each `if` before it in an enclosing
/// block whose one branch leaves (`if (old >= v) { return; }`: false after it).
/// `None` when `target` is not in `block`.
fn guards(
    block: &Block,
    target: &Statement,
    under: &mut Vec<(Expr, bool)>,
) -> Option<Vec<(Expr, bool)>> {
    let depth = under.len();
    let mut found = None;
    for s in block.iter() {
        if std::ptr::eq(s, target) {
            found = Some(under.clone());
            break;
        }
        found = match s {
            Statement::Block(b) => guards(b, target, under),
            Statement::If {
                condition,
                accept,
                reject,
            } => {
                let mut branch = |b, holds| {
                    under.push((*condition, holds));
                    let found = guards(b, target, under);
                    under.pop();
                    found
                };
                let found = branch(accept, true).or_else(|| branch(reject, false));
                match (leaves(accept), leaves(reject)) {
                    (true, false) => under.push((*condition, false)),
                    (false, true) => under.push((*condition, true)),
                    _ => {}
                }
                found
            }
            Statement::Switch { cases, .. } => {
                cases.iter().find_map(|c| guards(&c.body, target, under))
            }
            Statement::Loop {
                body, continuing, ..
            } => guards(body, target, under).or_else(|| guards(continuing, target, under)),
            _ => None,
        };
        if found.is_some() {
            break;
        }
    }
    under.truncate(depth);
    found
}

/// Whether `block` ends by leaving (a `return`, `break`, `continue` or discard).
fn leaves(block: &Block) -> bool {
    block
        .iter()
        .rev()
        .find(|s| !matches!(s, Statement::Emit(_)))
        .is_some_and(|s| {
            matches!(
                s,
                Statement::Return { .. } | Statement::Break | Statement::Continue | Statement::Kill
            )
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use AtomicOp as A;

    /// What the one compare-exchange in `body` (the loop of a helper taking `v`,
    /// on buffer `best`) does.
    fn op(body: &str) -> AtomicOp {
        let src = format!(
            "
@group(0) @binding(0) var<storage, read> values: array<f32>;
@group(0) @binding(1) var<storage, read_write> best: atomic<u32>;
fn twice(x: f32) -> f32 {{ return x * 2.0; }}
fn fmax(a: f32, b: f32) -> f32 {{ return max(a, b); }}
fn fadd(a: f32, b: f32) -> f32 {{ let s = a + b; return s; }}
fn pick(a: f32, b: f32) -> f32 {{ if (a > b) {{ return a; }} return b; }}
fn double(p: ptr<function, f32>) {{ *p = *p * 2.0; }}
fn keep(v: f32) {{
    var old = atomicLoad(&best);
    {body}
}}
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
    keep(values[gid.x]);
}}"
        );
        let module = naga::front::wgsl::parse_str(&src).unwrap();
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::default(),
        )
        .validate(&module)
        .unwrap();
        let ops = crate::atomic_ops::atomic_ops(&module, &info, 0);
        let ops: Vec<AtomicOp> = ops[&1].iter().copied().collect();
        assert_eq!(ops.len(), 1, "{ops:?}");
        ops[0]
    }

    fn looped(before: &str, next: &str) -> String {
        format!(
            "loop {{
        {before}
        let r = atomicCompareExchangeWeak(&best, old, {next});
        if (r.exchanged) {{ break; }}
        old = r.old_value;
    }}"
        )
    }

    /// A loop that swaps `v` in only inside `if (condition)`, after `before`.
    fn swapped_under(before: &str, condition: &str) -> String {
        format!(
            "loop {{
        {before}
        if ({condition}) {{
            let r = atomicCompareExchangeWeak(&best, old, bitcast<u32>(v));
            if (r.exchanged) {{ break; }}
            old = r.old_value;
        }} else {{
            break;
        }}
    }}"
        )
    }

    #[test]
    fn a_winner_swapped_in_keeps_what_its_comparison_says() {
        let exits = |cond: &str| looped(&format!("if ({cond}) {{ return; }}"), "bitcast<u32>(v)");
        assert_eq!(op(&exits("bitcast<f32>(old) >= v")), A::Loop(Combine::Max));
        assert_eq!(op(&exits("v <= bitcast<f32>(old)")), A::Loop(Combine::Max));
        assert_eq!(op(&exits("bitcast<f32>(old) <= v")), A::Loop(Combine::Min));
        assert_eq!(
            op(&exits("!(v < bitcast<f32>(old))")),
            A::Loop(Combine::Min)
        );
        // Swapped only inside the `if`.
        assert_eq!(
            op(&swapped_under("", "v < bitcast<f32>(old)")),
            A::Loop(Combine::Min)
        );
        assert_eq!(
            op(&looped(
                "",
                "select(old, bitcast<u32>(v), v > bitcast<f32>(old))"
            )),
            A::Loop(Combine::Max)
        );
        assert_eq!(
            op(&looped(
                "",
                "select(bitcast<u32>(v), old, v > bitcast<f32>(old))"
            )),
            A::Loop(Combine::Min)
        );
        // A maximum made with max() that also leaves once it cannot win.
        assert_eq!(
            op(&looped(
                "if (bitcast<f32>(old) >= v) { return; }",
                "bitcast<u32>(max(bitcast<f32>(old), v))"
            )),
            A::Loop(Combine::Max)
        );
    }

    #[test]
    fn a_new_value_made_in_a_variable_store_after_store_is_followed() {
        let made = |stores: &str| {
            op(&looped(
                &format!("var next: f32; {stores}"),
                "bitcast<u32>(next)",
            ))
        };
        assert_eq!(
            made("next = bitcast<f32>(old); next += v;"),
            A::Loop(Combine::Add)
        );
        assert_eq!(
            made("next = v; next = max(next, bitcast<f32>(old));"),
            A::Loop(Combine::Max)
        );
        // Read before a later store: what the store before the read made.
        assert_eq!(
            made("next = bitcast<f32>(old) + v; let sum = next; next = 0.0; next = sum;"),
            A::Loop(Combine::Add)
        );
        assert_eq!(
            made("next = bitcast<f32>(old); next *= v;"),
            A::Loop(Combine::Other)
        );
    }

    #[test]
    fn an_operation_not_seen_folds_under_no_rule() {
        // Made through a variable under a condition, or by a helper handed a
        // pointer to it: which store the exchange sees is not followed.
        let made = |stores: &str| {
            op(&looped(
                &format!("var next = bitcast<f32>(old); {stores}"),
                "bitcast<u32>(next)",
            ))
        };
        assert_eq!(made("if (v > 0.0) { next += v; }"), A::CompareExchange);
        assert_eq!(made("double(&next);"), A::CompareExchange);
        // Read in the loop before it is set there: the last turn's value.
        let before = "var next = 0.0;
    loop {
        let was = next;
        next = bitcast<f32>(old) + v;
        let r = atomicCompareExchangeWeak(&best, old, bitcast<u32>(was + v));
        if (r.exchanged) { break; }
        old = r.old_value;
    }";
        assert_eq!(op(before), A::CompareExchange);
        // In a helper, or as `v - old`.
        // A helper that does more than one operation on it (or none seen).
        assert_eq!(
            op(&looped("", "bitcast<u32>(twice(bitcast<f32>(old)))")),
            A::Loop(Combine::Other)
        );
        assert_eq!(
            op(&looped("", "bitcast<u32>(pick(bitcast<f32>(old), v))")),
            A::CompareExchange
        );
        assert_eq!(
            op(&looped("", "bitcast<u32>(v - bitcast<f32>(old))")),
            A::Loop(Combine::Other)
        );
        // A count that stops at 100: the shards' counts would each stop there.
        assert_eq!(
            op(&looped("if (old >= 100u) { return; }", "old + 1u")),
            A::CompareExchange
        );
        // A winner swapped in under a flag set from the old value.
        let flagged = swapped_under(
            "var done = false;
        if (bitcast<f32>(old) >= v) { done = true; }",
            "!done",
        );
        assert_eq!(op(&flagged), A::CompareExchange);
        // The index of the least value: the guard reads memory where the old
        // value points. Under min or max the shards' indices would be merged as
        // numbers, not by the values they point at.
        let argmin = "loop {
        let cur = atomicLoad(&best);
        if (values[cur] <= v) { return; }
        let r = atomicCompareExchangeWeak(&best, cur, u32(v));
        if (r.exchanged) { return; }
    }";
        assert_eq!(op(argmin), A::IndexExchange);
        // The same chosen by a select.
        let picked = "loop {
        let cur = atomicLoad(&best);
        let r = atomicCompareExchangeWeak(&best, cur, select(cur, u32(v), v < values[cur]));
        if (r.exchanged) { return; }
    }";
        assert_eq!(op(picked), A::IndexExchange);
        // A value looked up in a table where the old value points.
        assert_eq!(
            op(&looped(
                "var lut = array<u32, 4>(3u, 1u, 4u, 1u);",
                "lut[old % 4u]"
            )),
            A::CompareExchange
        );
        // A component of a vector made from the old value.
        assert_eq!(
            op(&looped("", "vec2<u32>(old, 1u).x + 1u")),
            A::CompareExchange
        );
        // A guard that reads the word again rather than the old value.
        assert_eq!(
            op(&looped(
                "if (bitcast<f32>(atomicLoad(&best)) >= v) { return; }",
                "bitcast<u32>(v)"
            )),
            A::CompareExchange
        );
        // Swapped in under a bound that is not the winner.
        assert_eq!(
            op(&looped(
                "if (bitcast<f32>(old) > 10.0) { return; }",
                "bitcast<u32>(v)"
            )),
            A::CompareExchange
        );
    }

    #[test]
    fn a_helpers_one_operation_on_the_old_value_is_its_own() {
        assert_eq!(
            op(&looped("", "bitcast<u32>(fmax(bitcast<f32>(old), v))")),
            A::Loop(Combine::Max)
        );
        assert_eq!(
            op(&looped("", "bitcast<u32>(fadd(v, bitcast<f32>(old)))")),
            A::Loop(Combine::Add)
        );
    }

    #[test]
    fn a_value_swapped_in_under_no_condition_on_the_old_one_is_set() {
        assert_eq!(
            op("let r = atomicCompareExchangeWeak(&best, 0u, bitcast<u32>(v));"),
            A::Claim
        );
        assert_eq!(op(&looped("", "bitcast<u32>(v)")), A::Claim);
        // Stepped on only when it holds this invocation's number: not a claim.
        assert_eq!(
            op("let r = atomicCompareExchangeWeak(&best, u32(v), u32(v) + 1u);"),
            A::CompareExchange
        );
        assert_eq!(
            op(&looped("", "bitcast<u32>(bitcast<f32>(old) + v)")),
            A::Loop(Combine::Add)
        );
    }
}
