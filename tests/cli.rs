//! The `gpumesh` command as a user runs it: real processes, real adapters, outputs
//! checked against CPU references, bad input answered with a clear message and a
//! non-zero exit.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

#[path = "../shaders/tests/common/kernels.rs"]
mod kernels;

use std::path::Path;
use std::process::{Command, Output};

fn gpumesh(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpumesh"))
        .args(args)
        .env("RUST_LOG", "error")
        .output()
        .expect("the gpumesh binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Backends to run GPU cases on: those present, all of `GPUMESH_REQUIRE_BACKENDS`
/// required; a missing one is reported loudly.
fn backends() -> Vec<&'static str> {
    let required = std::env::var("GPUMESH_REQUIRE_BACKENDS").unwrap_or_default();
    let listed = gpumesh(&["adapters", "--json", "--no-calibrate"]);
    let json: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap_or_default();
    let present: Vec<String> = json
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|c| c["backend"].as_str().map(str::to_lowercase))
                .collect()
        })
        .unwrap_or_default();
    let mut out = Vec::new();
    for (name, wire) in [("vulkan", "vulkan"), ("gl", "gl")] {
        if present.iter().any(|p| p == wire) {
            out.push(name);
        } else {
            assert!(
                !required.split(',').any(|r| r.trim() == name),
                "GPUMESH_REQUIRE_BACKENDS names {name} but `gpumesh adapters` does not list it"
            );
            // Straight to stderr: `eprintln!` is swallowed for a passing test.
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr(),
                "\n!!!!! SKIPPED: NO {name} ADAPTER, so its CLI cases are skipped !!!!!\n"
            );
        }
    }
    out
}

const DOUBLE: &str = "@group(0) @binding(0) var<storage, read> src: array<u32>;\n\
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;\n\
\n\
@compute @workgroup_size(64)\n\
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {\n\
    dst[gid.x] = src[gid.x] * 3u + gid.x;\n\
}\n";

fn write(dir: &Path, name: &str, bytes: &[u8]) -> String {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p.to_string_lossy().into_owned()
}

#[test]
fn builtins_verify_against_the_cpu_on_every_backend() {
    for backend in backends() {
        for (builtin, size) in [
            ("vector_add", "4096"),
            ("histogram", "8192"),
            ("blur", "64"),
        ] {
            let o = gpumesh(&[
                "run",
                "--builtin",
                builtin,
                "--size",
                size,
                "--shards",
                "3",
                "--verify",
                "--json",
                "--backend",
                backend,
            ]);
            assert!(o.status.success(), "{builtin} on {backend}: {}", stderr(&o));
            let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            assert_eq!(report["verify"]["ok"], true, "{report}");
            assert_eq!(report["shards"].as_array().unwrap().len(), 3);
        }
    }
}

#[test]
fn a_wgsl_file_runs_sharded_and_writes_its_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = write(dir.path(), "double.wgsl", DOUBLE.as_bytes());
    let n = 64 * 10u32;
    let input: Vec<u8> = (0..n).flat_map(|v| (v * 7 + 1).to_le_bytes()).collect();
    let input_path = write(dir.path(), "in.bin", &input);
    let want: Vec<u8> = (0..n)
        .flat_map(|v| ((v * 7 + 1) * 3 + v).to_le_bytes())
        .collect();
    for backend in backends() {
        let out_dir = dir.path().join(format!("out-{backend}"));
        let o = gpumesh(&[
            "run",
            &kernel,
            "--input",
            &format!("0={input_path}"),
            "--output",
            &format!("1:{}", n * 4),
            "--grid",
            "10",
            "--shards",
            "4",
            "--out-dir",
            out_dir.to_str().unwrap(),
            "--backend",
            backend,
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let got = std::fs::read(out_dir.join("1.bin")).unwrap();
        assert_eq!(got, want, "on {backend}");
        let hash = blake3::hash(&want).to_hex().to_string();
        assert!(
            stdout(&o).contains(&hash),
            "the output hash is printed: {}",
            stdout(&o)
        );
        assert!(
            stdout(&o).contains(" ms"),
            "the time is printed: {}",
            stdout(&o)
        );
    }
}

/// Runs a WGSL task expected to fail; returns its stderr.
fn refused(kernel_source: &str, extra: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let kernel = write(dir.path(), "k.wgsl", kernel_source.as_bytes());
    let input = write(dir.path(), "in.bin", &[0u8; 256]);
    let out_dir = dir.path().join("out");
    let input_arg = format!("0={input}");
    let mut args = vec![
        "run",
        kernel.as_str(),
        "--out-dir",
        out_dir.to_str().unwrap(),
    ];
    if !extra.contains(&"--no-default-input") {
        args.extend(["--input", input_arg.as_str()]);
    }
    args.extend(extra.iter().filter(|a| **a != "--no-default-input"));
    let o = gpumesh(&args);
    assert!(!o.status.success(), "expected failure, got: {}", stdout(&o));
    let err = stderr(&o);
    assert!(!err.contains("panicked"), "no panic: {err}");
    err
}

#[test]
fn malformed_wgsl_is_reported_with_file_line_and_column() {
    let bad = DOUBLE.replace("* 3u +", "* 3u + +");
    let err = refused(&bad, &["--output", "1:256", "--grid", "1"]);
    assert!(err.contains("k.wgsl:6:"), "{err}");
}

#[test]
fn output_piped_into_a_reader_that_stops_ends_quietly() {
    use std::io::Read as _;
    use std::process::Stdio;
    // As `gpumesh tasks | head -1` does: the reader closes after its first bytes.
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpumesh"))
        .args(["completions", "bash"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 16];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_missing_entry_point_is_named() {
    let err = refused(
        DOUBLE,
        &["--entry", "nope", "--output", "1:256", "--grid", "1"],
    );
    assert!(err.contains("\"nope\"") && err.contains("main"), "{err}");
}

#[test]
fn a_kernel_with_one_entry_point_runs_without_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let source = DOUBLE.replace("fn main(", "fn computeSomething(");
    let kernel = write(dir.path(), "k.wgsl", source.as_bytes());
    let words: Vec<u32> = (0..64).collect();
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let input = write(dir.path(), "in.bin", &bytes);
    let out_dir = dir.path().join("out");
    let o = gpumesh(&[
        "run",
        kernel.as_str(),
        "--input",
        &format!("0={input}"),
        "--output",
        "1:256",
        "--grid",
        "1",
        "--out-dir",
        out_dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = std::fs::read(out_dir.join("1.bin")).unwrap();
    let got: Vec<u32> = out
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let want: Vec<u32> = words.iter().map(|&x| x * 3 + x).collect();
    assert_eq!(got, want);
    // Two entry points, neither `main`: refused, naming them.
    let two = format!("{source}\n@compute @workgroup_size(1)\nfn other() {{}}\n");
    let err = refused(&two, &["--output", "1:256", "--grid", "1"]);
    assert!(
        err.contains("computeSomething") && err.contains("--entry"),
        "{err}"
    );
}

#[test]
fn an_undeclared_binding_is_named() {
    let err = refused(
        DOUBLE,
        &["--output", "1:256", "--output", "5:256", "--grid", "1"],
    );
    assert!(err.contains("binding 5"), "{err}");
}

#[test]
fn a_binding_of_another_access_mode_is_named() {
    let err = refused(
        DOUBLE,
        &[
            "--no-default-input",
            "--output",
            "0:256",
            "--output",
            "1:256",
            "--grid",
            "1",
        ],
    );
    assert!(
        err.contains("binding 0") && err.contains("read_write"),
        "{err}"
    );
}

#[test]
fn an_inout_file_is_updated_in_place_by_shards_and_written_out() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = write(dir.path(), "collatz.wgsl", kernels::COLLATZ.as_bytes());
    let start: Vec<u32> = (0..777).map(|i| i * 37 + 1).collect(); // 13 ragged workgroups
    let start_path = write(dir.path(), "start.bin", &kernels::u32_bytes(&start));
    let want: Vec<u32> = start
        .iter()
        .map(|&v| kernels::collatz_reference(v))
        .collect();
    for backend in backends() {
        let out_dir = dir.path().join(format!("out-{backend}"));
        let o = gpumesh(&[
            "run",
            &kernel,
            "--inout",
            &format!("0={start_path}"),
            "--grid",
            "13",
            "--shards",
            "5",
            "--out-dir",
            out_dir.to_str().unwrap(),
            "--backend",
            backend,
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let got = std::fs::read(out_dir.join("0.bin")).unwrap();
        assert_eq!(kernels::u32s(&got), want, "on {backend}");
    }
}

#[test]
fn an_output_of_any_size_splits_over_a_ragged_grid() {
    // 3 workgroups over 250 words: no divisibility rule.
    let dir = tempfile::tempdir().unwrap();
    let kernel = write(dir.path(), "k.wgsl", kernels::DOUBLE.as_bytes());
    let input: Vec<f32> = (0..250).map(|i| i as f32 * 0.25).collect();
    let input_path = write(dir.path(), "in.bin", &kernels::f32_bytes(&input));
    let out_dir = dir.path().join("out");
    let o = gpumesh(&[
        "run",
        &kernel,
        "--input",
        &format!("0={input_path}"),
        "--output",
        "1:1000",
        "--grid",
        "4",
        "--shards",
        "3",
        "--out-dir",
        out_dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let got = kernels::f32s(&std::fs::read(out_dir.join("1.bin")).unwrap());
    assert_eq!(got, input.iter().map(|v| v * 2.0).collect::<Vec<_>>());
}

#[test]
fn shards_that_change_one_word_differently_are_a_conflict_not_an_answer() {
    let values: Vec<u32> = (0..640).collect();
    let dir = tempfile::tempdir().unwrap();
    let input = write(dir.path(), "v.bin", &kernels::u32_bytes(&values));
    let err = refused(
        kernels::RUNNING_MAX,
        &[
            "--no-default-input",
            "--input",
            &format!("0={input}"),
            "--output",
            "1:8",
            "--grid",
            "10",
            "--shards",
            "3",
        ],
    );
    assert!(
        err.contains("conflict") && err.contains("binding 1") && err.contains("byte offset 0"),
        "{err}"
    );
    assert!(err.contains("--shards 1"), "{err}");
}

#[test]
fn an_atomic_counter_split_under_the_default_merge_is_refused() {
    let err = refused(
        kernels::COUNTER,
        &["--output", "1:4", "--grid", "4", "--shards", "2"],
    );
    assert!(
        err.contains("atomics") && err.contains("--shards 1") && err.contains("sum"),
        "{err}"
    );
}

#[test]
fn a_merge_rule_for_one_binding_splits_a_kernel_with_an_atomic_total() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = write(dir.path(), "k.wgsl", kernels::DOUBLE_AND_COUNT.as_bytes());
    let values: Vec<u32> = (0..1000).map(|i| i * 7 + 3).collect();
    let odd = values.iter().filter(|v| *v % 2 == 1).count() as u32;
    let input = write(dir.path(), "v.bin", &kernels::u32_bytes(&values));
    let out_dir = dir.path().join("out");
    let mut args = vec![
        "run",
        kernel.as_str(),
        "--input",
        "",
        "--output",
        "1:4000",
        "--output",
        "2:4",
        "--grid",
        "16",
        "--shards",
        "4",
        "--merge",
        "2=sum-u32",
        "--out-dir",
        out_dir.to_str().unwrap(),
    ];
    let input_arg = format!("0={input}");
    args[3] = &input_arg;
    let o = gpumesh(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let doubled = kernels::u32s(&std::fs::read(out_dir.join("1.bin")).unwrap());
    assert_eq!(doubled, values.iter().map(|v| v * 2).collect::<Vec<_>>());
    assert_eq!(
        kernels::u32s(&std::fs::read(out_dir.join("2.bin")).unwrap()),
        [odd]
    );
    // One rule per binding.
    args.extend(["--merge", "2=max-u32"]);
    let o = gpumesh(&args);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("twice"), "{}", stderr(&o));
}

#[test]
fn a_file_for_a_read_write_binding_is_pointed_to_inout() {
    let in_place = "@group(0) @binding(0) var<storage, read_write> a: array<u32>;\n\
@group(0) @binding(1) var<storage, read_write> b: array<u32>;\n\
@compute @workgroup_size(64)\n\
fn main(@builtin(global_invocation_id) gid: vec3<u32>) { b[gid.x] = a[gid.x] + 1u; }\n";
    // `refused` passes the file as --input 0.
    let err = refused(in_place, &["--output", "1:256", "--grid", "1"]);
    assert!(
        err.contains("binding 0") && err.contains("--inout 0=FILE"),
        "{err}"
    );
}

#[test]
fn a_missing_input_file_is_named() {
    let err = refused(
        DOUBLE,
        &[
            "--no-default-input",
            "--input",
            "0=/nonexistent/in.bin",
            "--output",
            "1:256",
            "--grid",
            "1",
        ],
    );
    assert!(
        err.contains("cannot read input file /nonexistent/in.bin for binding 0"),
        "{err}"
    );
}

#[test]
fn a_missing_kernel_file_is_named() {
    let o = gpumesh(&[
        "run",
        "/nonexistent/k.wgsl",
        "--output",
        "1:256",
        "--grid",
        "1",
        "--out-dir",
        "/tmp",
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("cannot read kernel file /nonexistent/k.wgsl"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_grid_over_the_limits_is_refused() {
    if backends().is_empty() {
        return;
    }
    let err = refused(
        DOUBLE,
        &[
            "--output",
            "1:256",
            "--grid",
            "65536,65536",
            "--merge",
            "sum-u32",
        ],
    );
    assert!(err.contains("over the adapter limit"), "{err}");
}

#[test]
fn a_buffer_over_the_adapter_maximum_is_refused() {
    if backends().is_empty() {
        return;
    }
    let err = refused(DOUBLE, &["--output", "1:68719476736", "--grid", "1"]);
    assert!(
        err.contains("binding 1") && err.contains("over the adapter limit"),
        "{err}"
    );
}

#[test]
fn unknown_builtins_and_bad_flags_are_explained() {
    let o = gpumesh(&["run", "--builtin", "nope"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("matmul"),
        "lists the built-ins: {}",
        stderr(&o)
    );
    let o = gpumesh(&["run", "--builtin", "matmul", "--merge", "avg-f32"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("sum-f32"), "{}", stderr(&o));
    let o = gpumesh(&["run", "--builtin", "matmul", "--backend", "voodoo"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("vulkan, gl"), "{}", stderr(&o));
}

#[test]
fn adapters_lists_each_backend_with_measured_speed() {
    let found = backends();
    if found.is_empty() {
        return;
    }
    let o = gpumesh(&["adapters", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let caps: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for c in caps.as_array().unwrap() {
        assert!(c["gflops"].as_f64().unwrap() > 0.0, "{c}");
        assert!(c["gbps"].as_f64().unwrap() > 0.0, "{c}");
    }
}

#[test]
fn keygen_writes_a_private_key_file_once_and_prints_its_fingerprint() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mesh.key");
    let o = gpumesh(&["keygen", "--out", path.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text:?}");
    assert_eq!(lines[0], "/key/swarm/psk/1.0.0/");
    assert_eq!(lines[1], "/base16/");
    assert!(
        lines[2].len() == 64 && lines[2].chars().all(|c| c.is_ascii_hexdigit()),
        "{text:?}"
    );
    // What libp2p itself reads, and the fingerprint printed is this key's.
    let key: gpumesh::node::ClusterKey = text.parse().unwrap();
    assert!(stdout(&o).contains(&key.fingerprint()), "{}", stdout(&o));
    assert!(
        !stdout(&o).contains(lines[2]),
        "the key itself is not printed"
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "mode {mode:o}");
    }

    // A second run refuses to replace it.
    let again = gpumesh(&["keygen", "--out", path.to_str().unwrap()]);
    assert!(!again.status.success());
    assert!(
        stderr(&again).contains(path.to_str().unwrap())
            && stderr(&again).contains("already exists"),
        "{}",
        stderr(&again)
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), text, "unchanged");

    // Without --out the key goes to stdout, ready to redirect, and differs each time.
    let a = gpumesh(&["keygen"]);
    let b = gpumesh(&["keygen"]);
    assert!(a.status.success() && b.status.success());
    let key_a: gpumesh::node::ClusterKey = stdout(&a).parse().unwrap();
    let key_b: gpumesh::node::ClusterKey = stdout(&b).parse().unwrap();
    assert_ne!(key_a, key_b);
    assert!(stderr(&a).contains(&key_a.fingerprint()), "{}", stderr(&a));
}

#[test]
fn a_node_with_a_bad_cluster_key_file_stops_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(
        dir.path(),
        "bad.key",
        b"/key/swarm/psk/1.0.0/\n/base16/\nnot-hex\n",
    );
    let missing = dir.path().join("missing.key");
    let missing = missing.to_str().unwrap();
    let data = dir.path().join("data");
    let node_args = [
        "node",
        "--data-dir",
        data.to_str().unwrap(),
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--api",
        "127.0.0.1:0",
        "--no-mdns",
        "--init",
    ];
    let flagged = |key: &str| {
        let mut args = node_args.to_vec();
        args.extend(["--cluster-key", key]);
        gpumesh(&args)
    };
    for (o, file, why) in [
        (flagged(&bad), bad.as_str(), "is not a cluster key"),
        (
            flagged(missing),
            missing,
            "cannot read the cluster key file",
        ),
    ] {
        assert!(!o.status.success(), "started: {}", stdout(&o));
        let err = stderr(&o);
        assert!(err.contains(file) && err.contains(why), "{err}");
        assert!(
            err.contains("gpumesh keygen"),
            "says how to make one: {err}"
        );
    }
    // The same through GPUMESH_CLUSTER_KEY.
    let o = Command::new(env!("CARGO_BIN_EXE_gpumesh"))
        .args(node_args)
        .env("GPUMESH_CLUSTER_KEY", &bad)
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert!(!o.status.success(), "started: {}", stdout(&o));
    assert!(stderr(&o).contains(&bad), "{}", stderr(&o));
    assert!(!data.exists(), "nothing started: no data dir was made");
}

#[test]
fn a_node_shows_its_cluster_key_fingerprint_and_never_the_key() {
    use std::io::{BufRead, Read};
    use std::process::Stdio;
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().unwrap();
    let key_path = dir.path().join("mesh.key");
    assert!(gpumesh(&["keygen", "--out", key_path.to_str().unwrap()])
        .status
        .success());
    let text = std::fs::read_to_string(&key_path).unwrap();
    let key: gpumesh::node::ClusterKey = text.parse().unwrap();
    let secret = text.lines().nth(2).unwrap().to_string();

    let data = dir.path().join("data");
    let mut node = Command::new(env!("CARGO_BIN_EXE_gpumesh"))
        .args([
            "node",
            "--data-dir",
            data.to_str().unwrap(),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--api",
            "127.0.0.1:0",
            "--no-mdns",
            "--init",
            // No adapter: starts at once, without calibrating.
            "--backend",
            "metal",
            "--cluster-key",
            key_path.to_str().unwrap(),
        ])
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, lines) = std::sync::mpsc::channel();
    let out = node.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut stdout = String::new();
    while !stdout.contains("API on") {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => stdout.push_str(&(line + "\n")),
            Err(_) => break,
        }
    }
    node.kill().unwrap();
    node.wait().unwrap();
    let mut stderr = String::new();
    node.stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();

    assert!(
        stdout.contains("API on"),
        "the node started: {stdout}\n{stderr}"
    );
    let fingerprint = key.fingerprint();
    assert!(
        stdout.contains(&format!("cluster key: fingerprint {fingerprint}")),
        "{stdout}"
    );
    assert!(stderr.contains(&fingerprint), "logged: {stderr}");
    assert!(
        !stdout.contains(&secret) && !stderr.contains(&secret),
        "the key itself never shows"
    );
}

/// `gpumesh ARGS` in `dir`, with no `GPUMESH_*` setting inherited and `env` added.
fn gpumesh_in(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpumesh"));
    cmd.args(args).current_dir(dir).env("RUST_LOG", "error");
    for (name, _) in std::env::vars() {
        if name.starts_with("GPUMESH_") {
            cmd.env_remove(name);
        }
    }
    cmd.envs(env.iter().copied());
    cmd.output().expect("the gpumesh binary runs")
}

/// `gpumesh node --print-config ...`, parsed.
fn printed_config(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> toml::Table {
    let mut argv = vec!["node", "--print-config"];
    argv.extend(args);
    let o = gpumesh_in(dir, &argv, env);
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o)
        .parse()
        .unwrap_or_else(|e| panic!("not TOML: {e}\n{}", stdout(&o)))
}

#[test]
fn print_config_without_a_file_shows_the_defaults_and_starts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let c = printed_config(dir.path(), &[], &[]);
    assert_eq!(c["listen"].as_str(), Some("/ip4/0.0.0.0/tcp/4070"));
    assert_eq!(c["api"].as_str(), Some("127.0.0.1:7070"));
    assert_eq!(c["init"].as_bool(), Some(false));
    assert_eq!(c["mdns"].as_bool(), Some(true));
    assert_eq!(c["backend"].as_str(), Some("auto"));
    assert_eq!(c["peers"].as_array().map(Vec::len), Some(0));
    assert_eq!(c["join_timeout"].as_float(), Some(30.0));
    assert_eq!(c["max_connections_per_peer"].as_integer(), Some(8));
    assert_eq!(c["max_grid"].as_integer(), Some(1 << 26));
    assert_eq!(c["down_after"].as_float(), Some(8.0));
    assert_eq!(c["straggler_factor"].as_float(), Some(4.0));
    assert_eq!(c["straggler_min"].as_float(), Some(30.0));
    assert_eq!(c["default_deadline"].as_float(), Some(60.0));
    assert_eq!(c["log_format"].as_str(), Some("text"));
    assert!(!c.contains_key("cluster_key") && !c.contains_key("bootstrap_expect"));
    let data_dir = Path::new(c["data_dir"].as_str().unwrap());
    assert!(
        data_dir.is_absolute() && data_dir.ends_with("gpumesh-data"),
        "{data_dir:?}"
    );
    assert!(!dir.path().join("gpumesh-data").exists(), "nothing started");
}

#[test]
fn flags_override_the_environment_which_overrides_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "node.toml",
        b"api = \"127.0.0.1:7001\"\n\
          max_grid = 1001\n\
          down_after = 11.5\n\
          listen = \"/ip4/127.0.0.1/tcp/4001\"\n\
          data_dir = \"state\"\n\
          init = true\n\
          peers = [\"/ip4/10.0.0.1/tcp/4070\"]\n",
    );
    let env = [
        ("GPUMESH_CONFIG", file.as_str()),
        ("GPUMESH_API", "127.0.0.1:7002"),
        ("GPUMESH_MAX_GRID", "1002"),
        (
            "GPUMESH_PEERS",
            "/ip4/10.0.0.2/tcp/4070,/ip4/10.0.0.3/tcp/4070",
        ),
    ];
    let c = printed_config(
        dir.path(),
        &["--api", "127.0.0.1:7003", "--bootstrap-expect", "3"],
        &env,
    );
    assert_eq!(c["api"].as_str(), Some("127.0.0.1:7003"), "flag over env");
    assert_eq!(c["max_grid"].as_integer(), Some(1002), "env over file");
    assert_eq!(
        c["peers"].as_array().unwrap().len(),
        2,
        "env list over file"
    );
    assert_eq!(c["down_after"].as_float(), Some(11.5), "file over default");
    assert_eq!(c["listen"].as_str(), Some("/ip4/127.0.0.1/tcp/4001"));
    assert_eq!(
        Path::new(c["data_dir"].as_str().unwrap()),
        dir.path().join("state"),
        "relative to the file"
    );
    // --bootstrap-expect replaces the file's init: how the mesh forms is one choice.
    assert_eq!(c["bootstrap_expect"].as_integer(), Some(3));
    assert_eq!(c["init"].as_bool(), Some(false));
    // Without flags and environment, the file's values; --config names it too.
    let c = printed_config(dir.path(), &["--config", &file], &[]);
    assert_eq!(c["api"].as_str(), Some("127.0.0.1:7001"));
    assert_eq!(c["max_grid"].as_integer(), Some(1001));
    assert_eq!(c["init"].as_bool(), Some(true));

    // What --print-config printed starts the same node when fed back.
    let printed = gpumesh_in(dir.path(), &["node", "--print-config"], &env);
    let again = write(dir.path(), "again.toml", &printed.stdout);
    let back = gpumesh_in(
        dir.path(),
        &["node", "--print-config", "--config", &again],
        &[],
    );
    assert_eq!(stdout(&back), stdout(&printed), "{}", stderr(&back));
}

#[test]
fn an_unknown_key_in_the_config_file_is_named_with_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "node.toml",
        b"api = \"127.0.0.1:7070\"\nmax_gird = 5\n",
    );
    let o = gpumesh_in(dir.path(), &["node", "--config", &file], &[]);
    assert!(!o.status.success(), "started: {}", stdout(&o));
    let err = stderr(&o);
    assert!(err.contains("max_gird") && err.contains(&file), "{err}");
    assert!(err.contains("max_grid"), "lists the keys there are: {err}");
    assert!(!dir.path().join("gpumesh-data").exists(), "nothing started");
}

#[test]
fn a_malformed_config_file_is_reported_with_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    for (text, line) in [
        // Not TOML.
        ("init = true\nlisten = \n", "line 2, column"),
        // TOML, but a value that is not a multiaddr.
        ("init = true\n\nlisten = \"tcp:4070\"\n", "line 3, column"),
        // A number where a flag takes one, but not negative.
        ("max_grid = -1\n", "line 1, column"),
    ] {
        let file = write(dir.path(), "node.toml", text.as_bytes());
        let o = gpumesh_in(
            dir.path(),
            &["node", "--print-config", "--config", &file],
            &[],
        );
        assert!(!o.status.success(), "accepted {text:?}: {}", stdout(&o));
        let err = stderr(&o);
        assert!(err.contains(line) && err.contains(&file), "{text:?}: {err}");
    }
    // A missing file is named, with where its name came from.
    let o = gpumesh_in(
        dir.path(),
        &["node", "--print-config"],
        &[("GPUMESH_CONFIG", "/nonexistent/node.toml")],
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("/nonexistent/node.toml") && stderr(&o).contains("GPUMESH_CONFIG"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn settings_no_node_could_run_with_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    for (args, env, named) in [
        (vec!["--down-after", "0"], vec![], "down_after"),
        (
            vec![],
            vec![("GPUMESH_STRAGGLER_FACTOR", "0.5")],
            "GPUMESH_STRAGGLER_FACTOR",
        ),
        (
            vec!["--init", "--bootstrap-expect", "2"],
            vec![],
            "bootstrap_expect",
        ),
        (vec!["--max-grid", "0"], vec![], "--max-grid"),
        (
            vec![],
            vec![("GPUMESH_MAX_CONNECTIONS", "0")],
            "max_connections",
        ),
    ] {
        let mut argv = vec!["node", "--print-config"];
        argv.extend(&args);
        let o = gpumesh_in(dir.path(), &argv, &env);
        assert!(!o.status.success(), "{args:?} {env:?}: {}", stdout(&o));
        assert!(stderr(&o).contains(named), "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn completions_print_a_script_for_each_shell() {
    let o = gpumesh(&["completions", "bash"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let script = stdout(&o);
    assert!(
        script.contains("gpumesh") && script.contains("complete"),
        "{script}"
    );
    assert!(
        script.contains("--print-config"),
        "knows the subcommands' flags"
    );
    for shell in ["zsh", "fish", "elvish", "powershell"] {
        let o = gpumesh(&["completions", shell]);
        assert!(
            o.status.success() && stdout(&o).contains("gpumesh"),
            "{shell}"
        );
    }
    assert!(!gpumesh(&["completions", "tcsh"]).status.success());
}

#[test]
fn an_unreachable_api_names_the_address_and_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    // Port 9 (discard) on loopback: nothing listens there.
    for args in [
        vec!["status", "--api", "127.0.0.1:9"],
        vec!["tasks"],
        vec!["task", "t1"],
        vec!["cancel", "t1"],
    ] {
        let o = gpumesh_in(dir.path(), &args, &[("GPUMESH_API", "127.0.0.1:9")]);
        assert!(!o.status.success());
        let err = stderr(&o);
        assert!(err.contains("127.0.0.1:9"), "{args:?}: {err}");
        assert!(
            err.contains("gpumesh node") && err.contains("GPUMESH_API"),
            "{err}"
        );
        assert!(err.contains("refused"), "says why: {err}");
    }
    // Several nodes given, none there: each is named.
    let o = gpumesh_in(
        dir.path(),
        &["status", "--api", "127.0.0.1:9,127.0.0.1:7"],
        &[],
    );
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("127.0.0.1:9, 127.0.0.1:7"), "{err}");
    // With JSON logs the error is a JSON line too.
    let o = gpumesh_in(
        dir.path(),
        &["status", "--log-format", "json"],
        &[("GPUMESH_API", "127.0.0.1:9")],
    );
    assert!(!o.status.success());
    let line: serde_json::Value = serde_json::from_str(stderr(&o).trim()).unwrap();
    assert_eq!(line["level"], "ERROR");
    assert!(line["fields"]["message"]
        .as_str()
        .unwrap()
        .contains("127.0.0.1:9"));
}

#[test]
fn adapters_prints_json_with_json_and_a_table_without() {
    let o = gpumesh(&["adapters", "--json", "--no-calibrate"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let caps: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for c in caps.as_array().unwrap() {
        assert!(
            c["adapter_name"].is_string() && c["backend"].is_string(),
            "{c}"
        );
    }
    if caps.as_array().unwrap().is_empty() {
        return;
    }
    let o = gpumesh(&["adapters", "--no-calibrate"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).starts_with("#   adapter"), "{}", stdout(&o));
}

/// A `gpumesh node` process on loopback, killed when dropped.
struct RunningNode {
    child: std::process::Child,
    api: String,
    stdout: String,
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
}

impl RunningNode {
    /// Starts `gpumesh node` with `extra` flags and `env`; returns once it serves
    /// its API.
    fn start(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> RunningNode {
        use std::io::BufRead;
        use std::process::Stdio;
        use std::time::{Duration, Instant};

        let data = dir.join("data");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpumesh"));
        cmd.args([
            "node",
            "--data-dir",
            data.to_str().unwrap(),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--api",
            "127.0.0.1:0",
            "--no-mdns",
            "--init",
        ])
        .args(extra)
        .env("RUST_LOG", "info");
        for (name, _) in std::env::vars() {
            if name.starts_with("GPUMESH_") {
                cmd.env_remove(name);
            }
        }
        cmd.envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let err = child.stderr.take().unwrap();
        let sink = stderr.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                let mut s = sink.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut stdout = String::new();
        let mut api = None;
        while api.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            match lines.recv_timeout(left) {
                Ok(line) => {
                    api = line
                        .split_once("API on http://")
                        .and_then(|(_, rest)| rest.split_whitespace().next())
                        .map(str::to_string);
                    stdout.push_str(&(line + "\n"));
                }
                Err(_) => break,
            }
        }
        let Some(api) = api else {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the node did not start: {stdout}\n{}",
                stderr.lock().unwrap()
            );
        };
        RunningNode {
            child,
            api,
            stdout,
            stderr,
        }
    }

    /// Stops the node; returns everything it wrote to stderr.
    fn stop(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The reader thread sees the pipe close; give it a moment to finish.
        std::thread::sleep(std::time::Duration::from_millis(200));
        let s = self.stderr.lock().unwrap().clone();
        s
    }
}

impl Drop for RunningNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_running_node_answers_read_commands_in_json_and_logs_json_lines() {
    let dir = tempfile::tempdir().unwrap();
    let node = RunningNode::start(
        dir.path(),
        // No adapter: starts at once, without calibrating; tasks stay pending.
        &["--backend", "metal", "--log-format", "json"],
        &[("RUST_LOG", "info,gpumesh_node=debug")],
    );
    assert!(node.stdout.contains("adapter: none"), "{}", node.stdout);
    let api = node.api.clone();
    let read = |args: &[&str]| -> serde_json::Value {
        let mut argv = args.to_vec();
        argv.extend(["--api", &api, "--json"]);
        let o = gpumesh(&argv);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {}", stdout(&o)))
    };

    let status = read(&["status"]);
    assert_eq!(status["members"].as_array().unwrap().len(), 1, "{status}");
    assert_eq!(status["leader"], status["node"], "{status}");
    assert_eq!(read(&["tasks"]), serde_json::json!([]));

    let submitted = read(&[
        "submit",
        "--builtin",
        "vector_add",
        "--size",
        "1024",
        "--shards",
        "2",
    ]);
    let id = submitted["task"].as_u64().unwrap();
    let tasks = read(&["tasks"]);
    assert_eq!(tasks.as_array().unwrap().len(), 1, "{tasks}");
    let task = read(&["task", &format!("t{id}")]);
    assert_eq!(task["id"].as_u64(), Some(id), "{task}");
    assert_eq!(task["shards"].as_array().unwrap().len(), 2, "{task}");
    assert!(
        task["history"].is_array() && task["replicas"].is_u64(),
        "{task}"
    );

    // The same task for people: a headline and one row per shard.
    let o = gpumesh(&["task", &id.to_string(), "--api", &api]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.starts_with(&format!("t{id} ")), "{text}");
    assert!(
        text.contains("vector_add") && text.contains("epoch"),
        "{text}"
    );
    let o = gpumesh(&["task", "t999", "--api", &api]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no task t999"), "{}", stderr(&o));

    let logs = node.stop();
    let mut submit_span = false;
    for line in logs.lines() {
        // A C library the GPU probe loads may write to stderr itself, past any
        // logger (libwayland, as the OpenGL adapters are listed, when it finds no
        // display: "error: XDG_RUNTIME_DIR is invalid ..."). Every line of ours is
        // JSON: a line that is not must not be one of ours in the text format.
        if !line.starts_with('{') {
            let ours = [
                "gpumesh", " TRACE ", " DEBUG ", " INFO ", " WARN ", " ERROR ",
            ];
            assert!(
                !ours.iter().any(|o| line.contains(o)),
                "a line of ours is not JSON: {line}"
            );
            continue;
        }
        let event: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("a stderr line is not JSON ({e}): {line}"));
        assert!(event["level"].is_string(), "{line}");
        if event["span"]["name"] == "submit" && event["span"]["task"] == format!("t{id}") {
            submit_span = true;
        }
    }
    assert!(logs.contains("node started"), "{logs}");
    assert!(submit_span, "the submit span carries the task id: {logs}");
}
