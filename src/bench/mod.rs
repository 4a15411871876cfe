//! `gpumesh bench ...`: measurements printed as tables, never asserted in tests.

mod actors;
mod consensus;
mod direct;
mod executor;
mod failover;
mod faults;
mod mesh;
mod sharding;

pub use actors::{actors, ActorsBenchArgs};
pub use consensus::{consensus, ConsensusBenchArgs};
pub use executor::{executor, ExecutorBenchArgs};
pub use faults::{faults, FaultsBenchArgs};
pub use mesh::{mesh, MeshBenchArgs};

use std::time::Duration;

/// Median of `runs` timings of `f`, after one warm-up call.
pub fn median_of<E>(
    runs: usize,
    mut f: impl FnMut() -> Result<Duration, E>,
) -> Result<Duration, E> {
    f()?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs.max(1) {
        times.push(f()?);
    }
    times.sort();
    Ok(times[times.len() / 2])
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The cluster key of the meshes a bench starts (meshes are closed by default).
fn mesh_key() -> gpumesh::node::ClusterKey {
    static KEY: std::sync::OnceLock<gpumesh::node::ClusterKey> = std::sync::OnceLock::new();
    *KEY.get_or_init(gpumesh::node::ClusterKey::generate)
}
