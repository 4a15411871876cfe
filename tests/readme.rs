//! What the README says of the `gpumesh` command that the command itself can
//! confirm: every command and flag of its command-line summary, the keys of its
//! settings table, and the data format it names. A README that drifts from the
//! binary fails here, naming the line.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

use std::collections::BTreeSet;
use std::process::{Command, Output};

fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap()
}

fn gpumesh(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpumesh"))
        .args(args)
        .env("RUST_LOG", "error")
        .output()
        .expect("the gpumesh binary runs")
}

/// `gpumesh PATH... --help`, which must succeed.
fn help(path: &[String]) -> String {
    let mut args: Vec<&str> = path.iter().map(String::as_str).collect();
    args.push("--help");
    let out = gpumesh(&args);
    assert!(
        out.status.success(),
        "`gpumesh {}` failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The subcommands a help text lists under "Commands:".
fn commands(help: &str) -> BTreeSet<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|c| c != "help")
        .collect()
}

/// The lines of the first fenced block after `heading`, a line continued with a
/// trailing `\` joined to the next.
fn block_after(text: &str, heading: &str) -> Vec<String> {
    let mut lines = text
        .lines()
        .skip_while(|l| *l != heading)
        .skip_while(|l| !l.starts_with("```"))
        .skip(1)
        .take_while(|l| !l.starts_with("```"));
    let mut out: Vec<String> = Vec::new();
    let mut continued = false;
    for line in lines.by_ref() {
        let line = line.trim_end();
        let (body, more) = match line.strip_suffix('\\') {
            Some(body) => (body, true),
            None => (line, false),
        };
        match (continued, out.last_mut()) {
            (true, Some(last)) => {
                last.push(' ');
                last.push_str(body.trim());
            }
            _ => out.push(body.to_string()),
        }
        continued = more;
    }
    out
}

/// The `--flags` named in `text`.
fn flags(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("--") {
        let name: String = rest[at + 2..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')
            .collect();
        if !name.is_empty() {
            out.insert(format!("--{name}"));
        }
        rest = &rest[at + 2 + name.len()..];
    }
    out
}

#[test]
fn every_command_and_flag_of_the_readmes_command_line_summary_exists() {
    let text = readme();
    let summary = block_after(&text, "## The command line");
    assert!(summary.len() > 10, "no command-line summary found");
    let top = commands(&help(&[]));
    let mut checked = 0;
    for line in &summary {
        // A comment says what the command does; the command is before it.
        let command = line.split("  #").next().unwrap().trim();
        let Some(rest) = command.strip_prefix("gpumesh ") else {
            continue;
        };
        // The command's path: words that the help above them lists as commands,
        // `a|b|c` naming several.
        let mut paths: Vec<Vec<String>> = vec![Vec::new()];
        let mut known = top.clone();
        for word in rest.split_whitespace() {
            let alternatives: Vec<&str> = word.split('|').collect();
            if !alternatives.iter().all(|w| known.contains(*w)) {
                // A word where a command has subcommands must be one of them.
                let a_word = |w: &&str| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase());
                assert!(
                    known.is_empty() || paths[0].is_empty() || !alternatives.iter().all(a_word),
                    "README line `{line}`: `gpumesh {}` has no command {word} (it has {known:?})",
                    paths[0].join(" ")
                );
                break;
            }
            paths = paths
                .iter()
                .flat_map(|p| {
                    alternatives.iter().map(move |w| {
                        let mut p = p.clone();
                        p.push(w.to_string());
                        p
                    })
                })
                .collect();
            known = commands(&help(&paths[0]));
        }
        assert!(
            !paths[0].is_empty(),
            "README line `{line}`: `gpumesh {rest}` names no command of `gpumesh --help`"
        );
        // `submit` takes the task flags of `run` ("<the task flags of `run`>").
        for path in &paths {
            let own = help(path);
            for flag in flags(command) {
                assert!(
                    own.contains(&flag),
                    "README line `{line}`: `gpumesh {}` has no {flag}",
                    path.join(" ")
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 20, "only {checked} commands checked");
    // And every command the binary has is in the README somewhere.
    for command in &top {
        assert!(
            text.contains(&format!("gpumesh {command}")),
            "`gpumesh {command}` is not in the README"
        );
    }
}

#[test]
fn the_readmes_settings_table_names_every_setting_and_no_other() {
    let text = readme();
    let table: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("| key | variable | flag | default |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert!(table.len() > 10, "no settings table found");
    let mut named = BTreeSet::new();
    for row in &table {
        let key_cell = row.split('|').nth(1).unwrap();
        for (n, piece) in key_cell.split('`').enumerate() {
            if n % 2 == 1 {
                named.insert(piece.to_string());
            }
        }
    }
    // The settings in effect, as `--print-config` writes them (an unset one as a
    // comment).
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("d");
    let printed = gpumesh(&[
        "node",
        "--print-config",
        "--data-dir",
        data_dir.to_str().unwrap(),
    ]);
    assert!(printed.status.success(), "{printed:?}");
    let printed = String::from_utf8_lossy(&printed.stdout);
    let keys: BTreeSet<String> = printed
        .lines()
        .map(|l| l.trim_start_matches("# "))
        .filter_map(|l| l.split_once(" = ").map(|(k, _)| k.to_string()))
        .filter(|k| k.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        .collect();
    assert!(keys.len() > 20, "{printed}");
    let missing: Vec<_> = keys.difference(&named).collect();
    let unknown: Vec<_> = named.difference(&keys).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "settings of `gpumesh node --print-config` not in the README's table: {missing:?}; \
         keys in the table that are not settings: {unknown:?}"
    );
}

#[test]
fn the_data_format_the_readme_names_is_the_binarys() {
    let version = gpumesh(&["--version"]);
    let version = String::from_utf8_lossy(&version.stdout);
    let format = version
        .split("data format ")
        .nth(1)
        .and_then(|s| s.trim().strip_suffix(')'))
        .unwrap_or_else(|| panic!("no data format in `gpumesh --version`: {version}"));
    let text = readme();
    let named = text
        .split("`gpumesh_protocol::FORMAT`, ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or_else(|| panic!("the README names no data format"));
    assert_eq!(
        named, format,
        "the README says the data format is {named}; `gpumesh --version` says {format}"
    );
}
