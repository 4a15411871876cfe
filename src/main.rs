//! The `gpumesh` command: parses flags and hands off to a command, which sets up
//! logging once it knows the format.

mod bench;
mod cli;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};

/// mimalloc, not glibc's allocator: a node allocates and frees many buffers per
/// task (frames, entries, answers, a blob's records), and under load glibc's
/// allocator took about a seventh of the mesh's CPU (`gpumesh bench mesh`: 4,990
/// against 4,287 tiny tasks/s, medians of five runs alternating; a 64 MiB blob
/// pull 34 against 48 ms).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // Parsed in two steps to keep the matches: they tell a flag from a default, which
    // `gpumesh node` needs to put its config file in between.
    let matches = cli::Cli::command().get_matches();
    let cli = cli::Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let log_format = cli.log_format;
    match cli::execute(cli, &matches) {
        Ok(code) => code,
        Err(e) => {
            cli::console::report_error(&e, log_format);
            match e.downcast_ref::<cli::mesh::StorageStopped>() {
                Some(_) => ExitCode::from(cli::mesh::StorageStopped::STATUS),
                None => ExitCode::FAILURE,
            }
        }
    }
}
