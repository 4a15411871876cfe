//! Every built-in kernel on every local adapter, against its CPU reference.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use gpumesh_shaders::builtins;

#[test]
fn every_builtin_matches_its_cpu_reference_on_every_adapter() {
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        for builtin in builtins::ALL {
            let problem = builtin.problem(builtin.test_size).unwrap();
            for shards in [1, 3] {
                let job = problem.job(shards).unwrap();
                let out = executor.run(&job, None).unwrap_or_else(|e| {
                    panic!("{} on {}: {e}", builtin.name, adapter.backend.name())
                });
                match problem.verify(&out.outputs) {
                    Ok(agreement) => eprintln!(
                        "{:>14} {:>6} shards={shards}: {agreement}",
                        builtin.name,
                        adapter.backend.name()
                    ),
                    Err(m) => panic!(
                        "{} on {} with {shards} shards: {m}",
                        builtin.name,
                        adapter.backend.name()
                    ),
                }
            }
        }
    }
}
