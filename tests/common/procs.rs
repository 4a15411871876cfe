//! Real `gpumesh node` processes, for the tests that kill them with SIGKILL.

use std::path::Path;

#[allow(unused_imports)] // each test file uses its own subset
pub use gpumesh::process::{free_port, NodeProcess as Proc};

/// A node process of this build's `gpumesh` binary, data in `root/name`.
pub fn node(root: &Path, name: &str) -> Proc {
    Proc::new(env!("CARGO_BIN_EXE_gpumesh"), root, name).expect("free ports")
}
