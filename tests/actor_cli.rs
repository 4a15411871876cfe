//! `gpumesh actor …` as a user runs it against a `gpumesh node` process: create,
//! call (outputs written out), get, list, delete; every number checked against the
//! CPU.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{words, STEP};
use gpumesh::process::NodeProcess;

const BIN: &str = env!("CARGO_BIN_EXE_gpumesh");

fn gpumesh(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("RUST_LOG", "error")
        .output()
        .expect("the gpumesh binary runs")
}

fn ok(args: &[&str]) -> String {
    let o = gpumesh(args);
    assert!(
        o.status.success(),
        "gpumesh {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn le(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn file(dir: &Path, name: &str, bytes: &[u8]) -> String {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn an_actor_is_created_called_read_listed_and_deleted_from_the_command_line() {
    if !common::have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut node = NodeProcess::new(BIN, dir.path(), "a").unwrap();
    node.start(&["--init"]).unwrap();
    let api = node.api_addr();
    let kernel = file(dir.path(), "step.wgsl", STEP.as_bytes());
    let start: Vec<u32> = (0..256).map(|i| i * 5).collect();
    let state = file(dir.path(), "start.bin", &le(&start));

    let created = ok(&[
        "actor",
        "create",
        "acc",
        "--state",
        &format!("0={state}"),
        "--api",
        &api,
    ]);
    assert!(
        created.contains("actor acc created: 1024 bytes"),
        "{created}"
    );
    let clash = gpumesh(&["actor", "create", "acc", "--state", "0:1024", "--api", &api]);
    assert!(!clash.status.success());
    assert!(String::from_utf8_lossy(&clash.stderr).contains("exists"));

    let mut cpu = start.clone();
    for (n, add) in [4u32, 9].into_iter().enumerate() {
        let params = file(dir.path(), "params.bin", &le(&[add, 0, 0, 0]));
        let out = dir.path().join(format!("out{n}"));
        let reply: serde_json::Value = serde_json::from_str(&ok(&[
            "actor",
            "call",
            "acc",
            &kernel,
            "--input",
            &format!("1={params}"),
            "--output",
            "2:16",
            "--grid",
            "4",
            "--out-dir",
            out.to_str().unwrap(),
            "--json",
            "--api",
            &api,
        ]))
        .unwrap();
        assert_eq!(reply["seq"], n as u64 + 1, "{reply}");
        assert_eq!(reply["version"], n as u64 + 1, "{reply}");
        let before = std::fs::read(out.join("2.bin")).unwrap();
        assert_eq!(words(&before), cpu[..4].to_vec(), "call {n}");
        for (i, v) in cpu.iter_mut().enumerate() {
            *v = v.wrapping_mul(3).wrapping_add(add).wrapping_add(i as u32);
        }
    }

    let got = dir.path().join("state.bin");
    ok(&[
        "actor",
        "get",
        "acc",
        "0",
        "--out",
        got.to_str().unwrap(),
        "--api",
        &api,
    ]);
    assert_eq!(words(&std::fs::read(&got).unwrap()), cpu);

    let list: serde_json::Value =
        serde_json::from_str(&ok(&["actor", "list", "--json", "--api", &api])).unwrap();
    let acc = &list.as_array().unwrap()[0];
    assert_eq!(acc["name"], "acc");
    assert_eq!(acc["version"], 2);
    assert_eq!(acc["bytes"], 1024);
    assert!(acc["epoch"].as_u64().unwrap() >= 1, "{acc}");
    assert!(!acc["node"].as_str().unwrap().is_empty(), "{acc}");
    let table = ok(&["actor", "list", "--api", &api]);
    assert!(table.lines().any(|l| l.starts_with("acc ")), "{table}");

    ok(&["actor", "delete", "acc", "--api", &api]);
    let gone = gpumesh(&[
        "actor",
        "get",
        "acc",
        "0",
        "--out",
        got.to_str().unwrap(),
        "--api",
        &api,
    ]);
    assert!(!gone.status.success());
    assert!(String::from_utf8_lossy(&gone.stderr).contains("no actor named acc"));
    node.kill9();
}
