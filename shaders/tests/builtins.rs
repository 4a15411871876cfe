//! Every built-in kernel on every local adapter, against its CPU reference.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use gpumesh_shaders::builtins;

#[test]
fn every_builtin_matches_its_cpu_reference_on_every_adapter() {
    every_builtin_on(common::adapters(), "");
}

#[test]
fn every_builtin_matches_its_cpu_reference_with_its_loops_bounded() {
    every_builtin_on(common::bounded(), ", loops bounded");
}

fn every_builtin_on(adapters: &[common::Adapter], how: &str) {
    for adapter in adapters {
        let mut executor = common::lock(adapter);
        for builtin in builtins::ALL {
            let problem = builtin.problem(builtin.test_size).unwrap();
            for shards in [1, 3] {
                let job = problem.job(shards).unwrap();
                let out = executor.run(&job, None).unwrap_or_else(|e| {
                    panic!("{} on {}{how}: {e}", builtin.name, adapter.backend.name())
                });
                match problem.verify(&out.outputs) {
                    Ok(agreement) => eprintln!(
                        "{:>14} {:>6} shards={shards}{how}: {agreement}",
                        builtin.name,
                        adapter.backend.name()
                    ),
                    Err(m) => panic!(
                        "{} on {} with {shards} shards{how}: {m}",
                        builtin.name,
                        adapter.backend.name()
                    ),
                }
            }
        }
    }
}
