//! The `gpumesh` command: parses flags and hands off to a command, which sets up
//! logging once it knows the format.

mod bench;
mod cli;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};

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
            ExitCode::FAILURE
        }
    }
}
