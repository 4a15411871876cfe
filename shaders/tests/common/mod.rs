//! Executors for every local adapter under test, shared by the tests of one binary.
//!
//! CI sets `GPUMESH_REQUIRE_BACKENDS=vulkan,gl`: a missing adapter there fails the
//! test. Elsewhere a missing adapter is reported loudly and its cases are skipped.

pub mod kernels;
pub mod task;

use std::sync::{Mutex, MutexGuard, OnceLock};

use gpumesh_protocol::BackendKind;
use gpumesh_shaders::{BackendChoice, Executor, ExecutorLimits};

pub struct Adapter {
    pub backend: BackendKind,
    pub executor: Mutex<Executor>,
}

pub fn adapters() -> &'static [Adapter] {
    static ALL: OnceLock<Vec<Adapter>> = OnceLock::new();
    ALL.get_or_init(|| open_all(ExecutorLimits::default()))
}

/// Loop turns [`bounded`]'s executors let an invocation run: under Mesa's own cap
/// (65,535), so their kernels run with every loop counted against the bound (ahead,
/// or turn by turn), as they do on a GPU.
#[allow(dead_code)] // each test binary includes this module; only some bound loops
pub const UNDER_THE_CAP: u32 = 65_000;

/// A second executor for every local adapter, its loops bounded at
/// [`UNDER_THE_CAP`].
#[allow(dead_code)] // as above
pub fn bounded() -> &'static [Adapter] {
    static ALL: OnceLock<Vec<Adapter>> = OnceLock::new();
    ALL.get_or_init(|| {
        open_all(ExecutorLimits {
            loop_bound: Some(UNDER_THE_CAP),
            ..ExecutorLimits::default()
        })
    })
}

fn open_all(limits: ExecutorLimits) -> Vec<Adapter> {
    {
        let required = std::env::var("GPUMESH_REQUIRE_BACKENDS").unwrap_or_default();
        let mut found = Vec::new();
        for backend in [BackendKind::Vulkan, BackendKind::Gl] {
            match Executor::with_limits(BackendChoice::Only(backend), limits) {
                Ok(executor) => {
                    eprintln!(
                        "testing on {} ({})",
                        executor.capability().adapter_name,
                        backend.name()
                    );
                    found.push(Adapter {
                        backend,
                        executor: Mutex::new(executor),
                    });
                }
                Err(e) => {
                    assert!(
                        !required.split(',').any(|r| r.trim() == backend.name()),
                        "GPUMESH_REQUIRE_BACKENDS names {} but it is unavailable: {e}",
                        backend.name()
                    );
                    // Straight to the process's stderr, not through `eprintln!`,
                    // which the test harness swallows for a passing test.
                    use std::io::Write as _;
                    let _ = writeln!(
                        std::io::stderr(),
                        "\n!!!!! SKIPPED: NO {} ADAPTER, so every GPU case on it is skipped ({e}) !!!!!\n",
                        backend.name().to_uppercase()
                    );
                }
            }
        }
        found
    }
}

/// The adapter's executor; a panic in another test does not poison it for this one.
pub fn lock(adapter: &Adapter) -> MutexGuard<'_, Executor> {
    adapter.executor.lock().unwrap_or_else(|e| e.into_inner())
}
