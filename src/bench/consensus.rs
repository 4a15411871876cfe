//! `gpumesh bench consensus`: the consensus crate's measurement, printed as a table.

use std::path::PathBuf;
use std::process::ExitCode;

use gpumesh_consensus::bench::{self, BenchConfig};

#[derive(clap::Args, Debug)]
pub struct ConsensusBenchArgs {
    /// Directory for the replicas' redb files (the disk being measured).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Proposals in the batched run.
    #[arg(long, default_value_t = 50_000)]
    pub batched: usize,
    /// Proposals in the one-at-a-time run.
    #[arg(long, default_value_t = 2_000)]
    pub sequential: usize,
}

pub fn consensus(args: ConsensusBenchArgs) -> anyhow::Result<ExitCode> {
    let config = BenchConfig {
        dir: args.dir,
        batched_proposals: args.batched,
        sequential_proposals: args.sequential,
        ..BenchConfig::default()
    };
    let runtime = tokio::runtime::Runtime::new()?;
    let report = runtime.block_on(bench::run(config))?;
    println!("{report}");
    Ok(ExitCode::SUCCESS)
}
