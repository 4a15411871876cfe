//! Walks over a naga module's statements, shared by the passes that read them.

use std::collections::BTreeSet;

use naga::{Block, Expression, Function, GlobalVariable, Handle, Module, Statement};

/// Calls `visit` with every statement of `block`, those of nested blocks included.
pub(crate) fn each_statement<'a>(block: &'a Block, visit: &mut impl FnMut(&'a Statement)) {
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

/// The global variable `pointer` points into, through any indexing; `None` for a
/// pointer from elsewhere (a function's pointer argument).
pub(crate) fn root_global(
    f: &Function,
    mut pointer: Handle<Expression>,
) -> Option<Handle<GlobalVariable>> {
    loop {
        match f.expressions[pointer] {
            Expression::Access { base, .. } | Expression::AccessIndex { base, .. } => {
                pointer = base;
            }
            Expression::GlobalVariable(g) => return Some(g),
            _ => return None,
        }
    }
}

/// The functions `f` calls, and those they call, in turn.
pub(crate) fn called(module: &Module, f: &Function) -> BTreeSet<Handle<Function>> {
    let mut found = BTreeSet::new();
    let mut next = vec![f];
    while let Some(f) = next.pop() {
        each_statement(&f.body, &mut |s| {
            if let Statement::Call { function, .. } = s {
                if found.insert(*function) {
                    next.push(&module.functions[*function]);
                }
            }
        });
    }
    found
}
