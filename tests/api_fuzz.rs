//! The submit path of a real node under random input: arbitrary bytes and JSON, and
//! structurally valid task specs with random shaders, bindings, grids, shard counts
//! and merges, posted to its HTTP API. Every answer is a task id or a 4xx with a JSON
//! error; no request breaks its connection; the node serves normally afterwards.
//!
//! 64 cases per property by default; `PROPTEST_CASES=N` runs more.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{client, config, submit};
use gpumesh::consensus::RequestId;
use gpumesh::node::api::SubmitRequest;
use gpumesh::node::{Formation, MeshNode};
use gpumesh::protocol::{
    BindingRole, BindingSpec, BlobId, ElemType, Grid, MergeRule, ShaderSource, TaskOptions,
    TaskSpec,
};
use gpumesh::shaders::builtins::{self, Problem};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::Value;

/// The runner's settings: `PROPTEST_CASES` or 64 cases; failures are reported, not
/// saved (these cases run against a live node, not a pure function).
fn settings() -> Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    Config {
        failure_persistence: None,
        ..Config::with_cases(cases)
    }
}

/// One node, with small limits so that accepted random tasks stay cheap to run, and
/// the inputs of a known-good task already uploaded.
struct Target {
    runtime: tokio::runtime::Runtime,
    node: Option<MeshNode>,
    api: SocketAddr,
    http: reqwest::Client,
    problem: Problem,
    _dir: tempfile::TempDir,
}

impl Target {
    fn start() -> Target {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut c = config(dir.path(), Formation::Init, &[]);
        c.limits.max_grid = 4096;
        c.limits.max_blob_bytes = 1 << 20;
        c.limits.max_shader_bytes = 64 << 10;
        let problem = builtins::get("vector_add")
            .unwrap()
            .problem(256 * 8)
            .unwrap();
        let node = runtime.block_on(async {
            let node = MeshNode::start(c).await.unwrap();
            for bytes in problem.blobs.values() {
                client(&node).upload(bytes.to_vec()).await.unwrap();
            }
            node
        });
        Target {
            api: node.api_addr,
            node: Some(node),
            runtime,
            http: reqwest::Client::new(),
            problem,
            _dir: dir,
        }
    }

    /// Posts `body` to /v1/tasks and holds the answer to the contract.
    fn post(&self, body: Vec<u8>) -> Result<(), TestCaseError> {
        let (status, answer) = self.runtime.block_on(async {
            let resp = tokio::time::timeout(
                Duration::from_secs(30),
                self.http
                    .post(format!("http://{}/v1/tasks", self.api))
                    .header("content-type", "application/json")
                    .body(body)
                    .send(),
            )
            .await
            .map_err(|_| TestCaseError::fail("no answer within 30s"))?
            .map_err(|e| TestCaseError::fail(format!("the request broke: {e:?}")))?;
            let status = resp.status();
            let answer: Value = resp
                .json()
                .await
                .map_err(|e| TestCaseError::fail(format!("{status}: not JSON: {e}")))?;
            Ok::<_, TestCaseError>((status, answer))
        })?;
        if status.is_success() {
            prop_assert!(answer["task"].is_u64(), "{status}: {answer}");
        } else {
            prop_assert!(status.is_client_error(), "{status}: {answer}");
            let error = answer["error"].as_str().unwrap_or("");
            prop_assert!(!error.is_empty(), "{status}: {answer}");
        }
        Ok(())
    }

    /// The node still answers, still commits a good task and, with an adapter, runs
    /// it (after whatever random tasks it accepted) to the right result.
    fn check_serving(&self) {
        let node = self.node.as_ref().unwrap();
        self.runtime.block_on(async {
            let status = client(node).status().await.unwrap();
            assert!(status.leader != 0 && status.members.len() == 1);
            let task = submit(&client(node), &self.problem, 2).await;
            if node.capability.is_some() {
                tokio::time::timeout(Duration::from_secs(90), client(node).wait(task, |_, _| {}))
                    .await
                    .expect("the good task finishes")
                    .unwrap();
                self.problem
                    .verify(&client(node).results(task).await.unwrap())
                    .unwrap();
            }
        });
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(node) = self.node.take() {
            self.runtime.block_on(node.stop());
        }
    }
}

fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        ".{0,24}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map(
                prop_oneof![
                    Just("spec".to_string()),
                    Just("shader".to_string()),
                    Just("Wgsl".to_string()),
                    Just("Builtin".to_string()),
                    Just("bindings".to_string()),
                    Just("grid".to_string()),
                    Just("shards".to_string()),
                    Just("merge".to_string()),
                    Just("request_id".to_string()),
                    "[a-z_]{1,10}",
                ],
                inner,
                0..6
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Arbitrary bodies: bytes, JSON of any shape, and JSON shaped like a submit with
/// random values in its fields.
fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..512),
        json().prop_map(|v| serde_json::to_vec(&v).unwrap()),
        (json(), json()).prop_map(|(spec, request_id)| {
            serde_json::to_vec(&serde_json::json!({ "spec": spec, "request_id": request_id }))
                .unwrap()
        }),
    ]
}

const DOUBLE: &str = "@group(0) @binding(0) var<storage, read> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    dst[gid.x] = src[gid.x] * 3u + gid.x;
}
";

fn shader() -> impl Strategy<Value = ShaderSource> {
    let names: Vec<String> = builtins::ALL.iter().map(|b| b.name.to_string()).collect();
    prop_oneof![
        proptest::sample::select(names).prop_map(ShaderSource::Builtin),
        "[a-z_]{0,12}".prop_map(ShaderSource::Builtin),
        Just(ShaderSource::Wgsl(DOUBLE.into())),
        // The good kernel (ASCII, so any index is a char boundary) with a stretch
        // replaced by random text.
        (0..DOUBLE.len(), 0usize..40, ".{0,12}").prop_map(|(at, cut, with)| {
            let end = (at + cut).min(DOUBLE.len());
            ShaderSource::Wgsl(format!("{}{with}{}", &DOUBLE[..at], &DOUBLE[end..]))
        }),
        ".{0,200}".prop_map(ShaderSource::Wgsl),
    ]
}

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        1u64..4096,
        (1u64..64).prop_map(|k| k * 1024),
        any::<u64>(),
    ]
}

fn merge() -> impl Strategy<Value = MergeRule> {
    let elem = prop_oneof![
        Just(ElemType::U32),
        Just(ElemType::I32),
        Just(ElemType::F32)
    ];
    prop_oneof![
        Just(MergeRule::Changes),
        elem.clone().prop_map(MergeRule::Sum),
        elem.clone().prop_map(MergeRule::Min),
        elem.clone().prop_map(MergeRule::Max),
        // Bitwise rules of any element type, f32 included (refused).
        elem.clone().prop_map(MergeRule::Or),
        elem.clone().prop_map(MergeRule::And),
        elem.prop_map(MergeRule::Xor),
    ]
}

/// Task specs that parse, with values anywhere from right to absurd. Inputs name the
/// uploaded blobs (with their real size or another) or blobs that do not exist.
fn spec(uploaded: Vec<(BlobId, u64)>) -> impl Strategy<Value = TaskSpec> {
    let input = (
        proptest::sample::select(uploaded),
        any::<[u8; 32]>(),
        any::<bool>(),
        size(),
        any::<bool>(),
    )
        .prop_map(
            |((id, real), other, known, size, right_size)| BindingRole::Input {
                blob: if known { id } else { BlobId(other) },
                size: if right_size { real } else { size },
            },
        );
    let role = prop_oneof![
        input,
        proptest::collection::vec(any::<u8>(), 0..128).prop_map(|data| BindingRole::Param { data }),
        size().prop_map(|size| BindingRole::Output { size }),
    ];
    let dim = prop_oneof![Just(0u32), 1u32..70, any::<u32>()];
    (
        shader(),
        prop_oneof![Just("main".to_string()), ".{0,8}"],
        proptest::collection::vec((0u32..4, role), 0..5),
        [dim.clone(), dim.clone(), dim],
        prop_oneof![Just(0u32), 1u32..10, any::<u32>()],
        merge(),
        options(),
    )
        .prop_map(
            |(shader, entry_point, bindings, grid, shards, merge, options)| TaskSpec {
                shader,
                entry_point,
                bindings: bindings
                    .into_iter()
                    .map(|(binding, role)| BindingSpec { binding, role })
                    .collect(),
                grid: Grid(grid),
                shards,
                merge,
                merges: Default::default(),
                options,
            },
        )
}

/// Run options from sensible to absurd: replica counts outside 1..=3, negative or
/// non-finite tolerances, zero and huge deadlines.
fn options() -> impl Strategy<Value = TaskOptions> {
    (
        prop_oneof![1u32..=3, any::<u32>()],
        proptest::option::of(prop_oneof![Just(1e-5f32), any::<f32>()]),
        proptest::option::of(prop_oneof![Just(0u64), 1u64..60_000, any::<u64>()]),
    )
        .prop_map(|(replicas, tolerance, deadline_ms)| TaskOptions {
            replicas,
            tolerance,
            deadline_ms,
        })
}

/// The known-good task with a few of its fields changed: many of these are accepted,
/// so the path through Raft to the worker is exercised too.
fn tweaked(good: TaskSpec) -> impl Strategy<Value = TaskSpec> {
    (
        proptest::option::of(prop_oneof![1u32..80, any::<u32>()]),
        proptest::option::of(prop_oneof![1u32..17, any::<u32>()]),
        proptest::option::of(merge()),
        proptest::option::of(prop_oneof![(1u64..64).prop_map(|k| k * 256), size()]),
        proptest::option::of(shader()),
    )
        .prop_map(move |(grid_x, shards, merge, output, shader)| {
            let mut spec = good.clone();
            if let Some(x) = grid_x {
                spec.grid = Grid([x, 1, 1]);
            }
            if let Some(n) = shards {
                spec.shards = n;
            }
            if let Some(m) = merge {
                spec.merge = m;
            }
            if let Some(size) = output {
                for b in &mut spec.bindings {
                    if let BindingRole::Output { size: s } = &mut b.role {
                        *s = size;
                    }
                }
            }
            if let Some(shader) = shader {
                spec.shader = shader;
            }
            spec
        })
}

#[test]
fn arbitrary_bodies_get_a_task_id_or_a_4xx_and_the_node_keeps_serving() {
    let target = Target::start();
    let mut runner = TestRunner::new(settings());
    runner
        .run(&body(), |body| target.post(body))
        .unwrap_or_else(|e| panic!("{e}"));
    target.check_serving();
}

#[test]
fn random_task_specs_get_a_task_id_or_a_4xx_and_the_node_keeps_serving() {
    let target = Target::start();
    let uploaded: Vec<(BlobId, u64)> = target
        .problem
        .blobs
        .iter()
        .map(|(id, bytes)| (*id, bytes.len() as u64))
        .collect();
    let request = (
        prop_oneof![spec(uploaded), tweaked(target.problem.spec(2))],
        proptest::option::of((any::<u64>(), any::<u64>())),
    )
        .prop_map(|(spec, id)| SubmitRequest {
            spec,
            request_id: id.map(|(client, seq)| RequestId { client, seq }),
        });
    let mut runner = TestRunner::new(settings());
    runner
        .run(&request, |request| {
            target.post(serde_json::to_vec(&request).unwrap())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    target.check_serving();
}
