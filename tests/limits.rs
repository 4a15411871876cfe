//! The node's limits through its real HTTP API: every request over a limit gets a 4xx
//! whose JSON error names the limit and its value, nothing is committed for it, and
//! the node goes on serving the requests within its limits.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::time::Duration;

use common::{client, config, have_any, seed, stop, submit, LIMIT};
use gpumesh::consensus::RequestId;
use gpumesh::node::api::SubmitRequest;
use gpumesh::node::{Formation, Limits, MeshNode};
use gpumesh::protocol::{BackendKind, BindingRole, Grid, ShaderSource, TaskSpec};
use gpumesh::shaders::builtins::{self, Problem};
use gpumesh::shaders::BackendChoice;
use gpumesh::ClientError;
use reqwest::StatusCode;

/// A one-node mesh with `limits`.
async fn node(dir: &std::path::Path, limits: Limits) -> MeshNode {
    let mut c = config(dir, Formation::Init, &[]);
    c.limits = limits;
    MeshNode::start(c).await.unwrap()
}

/// POSTs `body` to `path`; the status and the `error` of a JSON error body (empty
/// when the answer is not one).
async fn post(node: &MeshNode, path: &str, body: Vec<u8>) -> (StatusCode, String) {
    let resp = reqwest::Client::new()
        .post(format!("http://{}{path}", node.api_addr))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let body: serde_json::Value = resp.json().await.unwrap_or_default();
    (status, body["error"].as_str().unwrap_or("").to_string())
}

/// A raw HTTP/1.1 POST that announces `len` body bytes and, as curl does for large
/// bodies, asks for the go-ahead first (`Expect: 100-continue`): a node refusing the
/// size answers at once, without reading a byte of the body. The status and `error`.
async fn announce(node: &MeshNode, path: &str, len: u64) -> (StatusCode, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut http = tokio::net::TcpStream::connect(node.api_addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/octet-stream\r\n\
         Content-Length: {len}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
        node.api_addr
    );
    http.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), http.read_to_end(&mut answer))
        .await
        .expect("the node answers without the body")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    let code: u16 = answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {answer:?}"));
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let body: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    (
        StatusCode::from_u16(code).unwrap(),
        body["error"].as_str().unwrap_or("").to_string(),
    )
}

async fn post_spec(node: &MeshNode, spec: TaskSpec) -> (StatusCode, String) {
    let body = serde_json::to_vec(&SubmitRequest {
        spec,
        request_id: None,
    })
    .unwrap();
    post(node, "/v1/tasks", body).await
}

fn vector_add() -> Problem {
    builtins::get("vector_add")
        .unwrap()
        .problem(256 * 8)
        .unwrap()
}

async fn upload(node: &MeshNode, problem: &Problem) {
    for bytes in problem.blobs.values() {
        client(node).upload(bytes.to_vec()).await.unwrap();
    }
}

/// Asserts the refusal: its status, and a message naming the flag and the value.
#[track_caller]
fn assert_refused(got: (StatusCode, String), status: StatusCode, flag: &str, value: u64) {
    let (code, msg) = got;
    assert_eq!(code, status, "{msg}");
    assert!(
        msg.contains(flag) && msg.contains(&format!("limit of {value}")),
        "the message names {flag} and {value}: {msg:?}"
    );
}

/// The node answers and commits a task within its limits.
async fn still_serves(node: &MeshNode) {
    let status = client(node).status().await.unwrap();
    assert!(status.leader != 0);
    let problem = vector_add();
    submit(&client(node), &problem, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shader_over_max_shader_bytes_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let limit = 8 << 10;
        let n = node(
            dir.path(),
            Limits {
                max_shader_bytes: limit,
                ..Limits::default()
            },
        )
        .await;
        let problem = vector_add();
        upload(&n, &problem).await;
        let source = builtins::source("vector_add").unwrap();
        let padded = |to: usize| {
            let mut s = format!("{source}\n// ");
            s.push_str(&"x".repeat(to - s.len()));
            s
        };
        let mut spec = problem.spec(2);
        spec.shader = ShaderSource::Wgsl(padded(limit as usize + 1));
        assert_refused(
            post_spec(&n, spec.clone()).await,
            StatusCode::PAYLOAD_TOO_LARGE,
            "--max-shader-bytes",
            limit,
        );
        // At the limit exactly, the same kernel is taken.
        spec.shader = ShaderSource::Wgsl(padded(limit as usize));
        let (code, msg) = post_spec(&n, spec).await;
        assert_eq!(code, StatusCode::OK, "{msg}");
        still_serves(&n).await;
        n.stop().await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn blobs_over_max_blob_bytes_are_refused_on_upload_and_as_outputs() {
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let limit = 64 << 10;
        let n = node(
            dir.path(),
            Limits {
                max_blob_bytes: limit,
                ..Limits::default()
            },
        )
        .await;
        let (code, msg) = post(&n, "/v1/blobs", vec![1; limit as usize]).await;
        assert_eq!(code, StatusCode::OK, "a blob at the limit is taken: {msg}");
        // Just over: read, then refused naming the size.
        let (code, msg) = post(&n, "/v1/blobs", vec![2; limit as usize + 1]).await;
        assert_refused(
            (code, msg.clone()),
            StatusCode::PAYLOAD_TOO_LARGE,
            "--max-blob-bytes",
            limit,
        );
        assert!(
            msg.contains(&format!("is {}", limit + 1)),
            "names the size: {msg}"
        );
        // Far over: refused from its announced length, before a byte is read.
        assert_refused(
            announce(&n, "/v1/blobs", 1 << 40).await,
            StatusCode::PAYLOAD_TOO_LARGE,
            "--max-blob-bytes",
            limit,
        );
        // A client that sends a big body regardless may find the connection closed
        // under it; `gpumesh::Client` says which limit that probably was.
        match client(&n).upload(vec![4; 8 << 20]).await {
            Err(ClientError::Refused(msg)) => assert!(msg.contains("--max-blob-bytes"), "{msg}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
        // Outputs become blobs: a task whose outputs cannot be stored is refused.
        let problem = vector_add();
        upload(&n, &problem).await;
        let mut spec = problem.spec(1);
        for b in &mut spec.bindings {
            if let BindingRole::Output { size } = &mut b.role {
                *size = limit * 2;
            }
        }
        assert_refused(
            post_spec(&n, spec).await,
            StatusCode::BAD_REQUEST,
            "--max-blob-bytes",
            limit,
        );
        still_serves(&n).await;
        n.stop().await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_grid_over_max_grid_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let n = node(
            dir.path(),
            Limits {
                max_grid: 1000,
                ..Limits::default()
            },
        )
        .await;
        let problem = vector_add();
        upload(&n, &problem).await;
        let mut spec = problem.spec(1);
        // 1001 workgroups however they are laid out.
        for grid in [[1001, 1, 1], [7, 11, 13]] {
            spec.grid = Grid(grid);
            assert_refused(
                post_spec(&n, spec.clone()).await,
                StatusCode::BAD_REQUEST,
                "--max-grid",
                1000,
            );
        }
        still_serves(&n).await;
        n.stop().await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_body_over_max_request_bytes_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let limit = 32 << 10;
        let n = node(
            dir.path(),
            Limits {
                max_request_bytes: limit,
                ..Limits::default()
            },
        )
        .await;
        let problem = vector_add();
        upload(&n, &problem).await;
        // A well-formed submit, too big as a whole, and junk of the same size.
        let mut spec = problem.spec(2);
        spec.shader = ShaderSource::Wgsl(format!(
            "{}\n// {}",
            builtins::source("vector_add").unwrap(),
            "y".repeat(limit as usize)
        ));
        for body in [
            serde_json::to_vec(&SubmitRequest {
                spec,
                request_id: None,
            })
            .unwrap(),
            vec![b'{'; 3 * limit as usize],
        ] {
            assert_refused(
                post(&n, "/v1/tasks", body).await,
                StatusCode::PAYLOAD_TOO_LARGE,
                "--max-request-bytes",
                limit,
            );
        }
        assert_refused(
            announce(&n, "/v1/tasks", 1 << 30).await,
            StatusCode::PAYLOAD_TOO_LARGE,
            "--max-request-bytes",
            limit,
        );
        // Blob uploads answer to --max-blob-bytes instead.
        let (code, msg) = post(&n, "/v1/blobs", vec![3; 4 * limit as usize]).await;
        assert_eq!(code, StatusCode::OK, "{msg}");
        still_serves(&n).await;
        n.stop().await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_submitter_over_max_queued_is_refused_until_its_tasks_finish() {
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let limit = 3;
        // No adapter on this node (and none yet in the mesh): its tasks stay queued.
        let mut c = config(&dir.path().join("a"), Formation::Init, &[]);
        c.backend = BackendChoice::Only(BackendKind::Metal);
        c.limits.max_queued_per_submitter = limit;
        let a = MeshNode::start(c).await.unwrap();
        assert!(
            a.capability.is_none(),
            "this test needs a node without adapter"
        );
        let problem = vector_add();
        upload(&a, &problem).await;

        // Many at once: never more than the limit gets in, however they interleave.
        let answers =
            futures::future::join_all((0..8).map(|_| post_spec(&a, problem.spec(2)))).await;
        let accepted = answers.iter().filter(|(c, _)| *c == StatusCode::OK).count();
        assert!((1..=limit).contains(&accepted), "{answers:?}");
        for (code, msg) in &answers {
            if *code != StatusCode::OK {
                assert_refused(
                    (*code, msg.clone()),
                    StatusCode::TOO_MANY_REQUESTS,
                    "--max-queued-per-submitter",
                    limit as u64,
                );
            }
        }
        // One at a time, the queue fills up to the limit exactly.
        let mut queued = accepted;
        loop {
            let (code, msg) = post_spec(&a, problem.spec(2)).await;
            if code != StatusCode::OK {
                assert_refused(
                    (code, msg),
                    StatusCode::TOO_MANY_REQUESTS,
                    "--max-queued-per-submitter",
                    limit as u64,
                );
                break;
            }
            queued += 1;
            assert!(queued <= limit, "more than {limit} queued");
        }
        assert_eq!(queued, limit);
        let before = client(&a).tasks().await.unwrap().len();
        assert_eq!(before, limit, "refused submits commit nothing");

        // The limit is per submitter: another node's API still takes tasks. (No
        // adapter there either, so `a` stays at its limit.)
        let mut c = config(&dir.path().join("b"), Formation::Join, &[seed(&a)]);
        c.backend = BackendChoice::Only(BackendKind::Metal);
        let b = MeshNode::start(c).await.unwrap();
        upload(&b, &problem).await;
        let (code, msg) = post_spec(&b, problem.spec(2)).await;
        assert_eq!(code, StatusCode::OK, "{msg}");

        // A retry is no new task, so the limit does not refuse it: a submit whose
        // first try went through `b` and whose retry comes through `a`, at its
        // limit, gets the task the first try made.
        let id = RequestId::new(0x5eed, 1);
        let first = client(&b).submit(problem.spec(2), Some(id)).await.unwrap();
        let again = client(&a).submit(problem.spec(2), Some(id)).await;
        assert_eq!(again.expect("a retry refused"), first);
        let (code, msg) = post_spec(&a, problem.spec(2)).await;
        assert_eq!(code, StatusCode::TOO_MANY_REQUESTS, "{msg}");

        // With a worker in the mesh the queue drains, and `a` takes tasks again.
        let mut c = config(&dir.path().join("c"), Formation::Join, &[seed(&a)]);
        c.backend = BackendChoice::Auto;
        let w = MeshNode::start(c).await.unwrap();
        if have_any() && w.capability.is_some() {
            for t in client(&a).tasks().await.unwrap() {
                tokio::time::timeout(Duration::from_secs(60), client(&a).wait(t.id, |_, _| {}))
                    .await
                    .unwrap()
                    .unwrap();
            }
            let (code, msg) = post_spec(&a, problem.spec(2)).await;
            assert_eq!(code, StatusCode::OK, "{msg}");
        }
        assert!(client(&a).status().await.unwrap().leader != 0);
        stop(vec![a, b, w]).await;
    })
    .await
    .expect("bounded");
}

/// vector_add with its sum staged in a `var<workgroup>` of `words` words, in
/// workgroups of `size` (as `@workgroup_size` takes it).
fn staged_add(words: u32, size: &str) -> String {
    format!(
        "@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
var<workgroup> staged: array<f32, {words}>;

@compute @workgroup_size({size})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
    let i = gid.x;
    if (i < arrayLength(&c)) {{
        staged[lid % {words}u] = a[i] + b[i];
        c[i] = staged[lid % {words}u];
    }}
}}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kernel_no_adapter_in_the_mesh_can_run_is_refused_at_submit() {
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let n = node(dir.path(), Limits::default()).await;
        // A task run first: the node's adapter is on record.
        still_serves(&n).await;
        let problem = vector_add();
        upload(&n, &problem).await;
        let limits = n
            .capability
            .clone()
            .expect("the node has an adapter")
            .limits;
        let memory = limits.max_compute_workgroup_storage_size;
        let mut spec = problem.spec(2);
        // Sixteen bytes of workgroup memory past the adapter's, then workgroups of
        // twice the invocations it runs (each side within its own limit): each
        // refused, naming the limit.
        for (source, what, limit) in [
            (
                staged_add(memory / 4 + 4, "256"),
                "workgroup memory",
                u64::from(memory),
            ),
            (
                staged_add(
                    64,
                    &format!("{}, 2", limits.max_compute_invocations_per_workgroup),
                ),
                "invocations per workgroup",
                u64::from(limits.max_compute_invocations_per_workgroup),
            ),
        ] {
            spec.shader = ShaderSource::Wgsl(source);
            let (code, msg) = post_spec(&n, spec.clone()).await;
            assert_eq!(code, StatusCode::BAD_REQUEST, "{msg}");
            assert!(
                msg.contains("no adapter in the mesh can run this task")
                    && msg.contains(what)
                    && msg.contains(&format!("limit of {limit}")),
                "{msg}"
            );
        }
        // Nothing was committed for them, and at the limit the same kernel runs.
        let via = client(&n);
        assert_eq!(via.tasks().await.unwrap().len(), 1, "only the first task");
        spec.shader = ShaderSource::Wgsl(staged_add(memory / 4, "256"));
        let task = via.submit(spec, None).await.unwrap();
        via.wait(task, |_, _| {}).await.unwrap();
        problem.verify(&via.results(task).await.unwrap()).unwrap();
        n.stop().await;
    })
    .await
    .expect("bounded");
}
