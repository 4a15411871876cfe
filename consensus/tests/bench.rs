//! The consensus benchmark, for humans: run it in release mode.
//!
//! `cargo test -p gpumesh-consensus --release --test bench -- --ignored --nocapture`
//! (`GPUMESH_BENCH_DIR` picks the disk; default: the system temp dir.)

use gpumesh_consensus::bench::{self, BenchConfig};

#[tokio::test(flavor = "multi_thread")]
#[ignore = "a benchmark: run with --release -- --ignored --nocapture"]
async fn bench_consensus() {
    let config = BenchConfig {
        dir: std::env::var_os("GPUMESH_BENCH_DIR").map(Into::into),
        ..BenchConfig::default()
    };
    let report = bench::run(config).await.expect("benchmark");
    println!("{report}");
}

/// A tiny run in the normal suite, so the benchmark code keeps working.
#[tokio::test(flavor = "multi_thread")]
async fn bench_smoke() {
    let report = bench::run(BenchConfig {
        batched_proposals: 500,
        in_flight: 64,
        sequential_proposals: 50,
        raw_appends: 50,
        ..BenchConfig::default()
    })
    .await
    .expect("benchmark");
    let table = report.to_string();
    assert!(table.contains("one at a time"), "{table}");
    assert!(report.batched_per_sec > 0.0 && report.raw_appends_per_sec > 0.0);
}
