//! `POST /v1/tasks/run` of a one-shard task runs on the node it is sent to and is
//! recorded with its result in one commit: real nodes in one process (libp2p on
//! loopback, Raft on redb, wgpu), every result against a CPU reference; then real
//! node processes, the one running such a task killed -9 mid-run.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::time::{Duration, Instant};

use common::{
    client, have_any, mesh_with, runaway_stopped, stop, LCG_STEPS as STEPS, LIMIT, RUNAWAY,
};
use gpumesh::consensus::TaskId;
use gpumesh::node::api::{decode_run_binary, from_hex, RunEnd, RunReply, TaskState, RUN_BINARY};
use gpumesh::protocol::{BindingRole, BindingSpec, Grid, MergeRule, ShaderSource, TaskSpec};
use gpumesh::ClientError;

/// Written the way compute tutorials write it: values worked on in place, a count
/// limit in a uniform, one invocation per value and a bounds check for the last,
/// partly filled workgroup.
const COLLATZ: &str = r#"
struct Params { limit: u32, _a: u32, _b: u32, _c: u32 }
@group(0) @binding(0) var<storage, read_write> values: array<u32>;
@group(0) @binding(1) var<uniform> params: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= arrayLength(&values)) {
        return;
    }
    var n = values[i];
    var steps = 0u;
    while (n > 1u && steps < params.limit) {
        if (n % 2u == 0u) { n = n / 2u; } else { n = 3u * n + 1u; }
        steps = steps + 1u;
    }
    values[i] = steps;
}
"#;

/// The CPU's answer for `values` under `limit`.
fn collatz(values: &[u32], limit: u32) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| {
            let (mut n, mut steps) = (v, 0u32);
            while n > 1 && steps < limit {
                n = if n % 2 == 0 { n / 2 } else { 3 * n + 1 };
                steps += 1;
            }
            steps.to_le_bytes()
        })
        .collect()
}

fn values(count: u32) -> Vec<u32> {
    (0..count).map(|i| i * 7 + 1).collect()
}

fn collatz_spec(blob: gpumesh::protocol::BlobId, count: u32, limit: u32) -> TaskSpec {
    let mut params = limit.to_le_bytes().to_vec();
    params.resize(16, 0);
    TaskSpec {
        shader: ShaderSource::Wgsl(COLLATZ.into()),
        entry_point: "main".into(),
        bindings: vec![
            BindingSpec {
                binding: 0,
                role: BindingRole::InOut {
                    blob,
                    size: u64::from(count) * 4,
                },
            },
            BindingSpec {
                binding: 1,
                role: BindingRole::Param { data: params },
            },
        ],
        grid: Grid([count.div_ceil(64), 1, 1]),
        shards: 1,
        merge: MergeRule::Changes,
        merges: Default::default(),
        options: Default::default(),
    }
}

fn bytes(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// The task's one shard: the node whose result was accepted, and whether its
/// history says it ran where it was submitted.
fn ran_where(node: &gpumesh::node::MeshNode, task: u64) -> (u64, bool) {
    node.consensus.read_local(move |s| {
        let t = s.task(TaskId(task)).expect("the task is in the record");
        let here = t
            .history
            .iter()
            .any(|e| e.what.contains("where it was submitted"));
        (t.shards[0].output.expect("a result").node, here)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_goes_on_the_node_it_is_sent_to_and_is_recorded_with_its_result() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        // Node 2 runs nothing itself: every run sent there is placed by the mesh.
        let nodes = mesh_with(dir.path(), 3, |i, c| {
            if i == 2 {
                c.run_here_slots = 0;
            }
        })
        .await;

        // A small result (in the log entry and the record), a larger one (carried in
        // the entry, a blob on every node that applies it) and one larger still (a
        // blob on two nodes before it is recorded): 1000, 1500 and 20,000 values,
        // none a whole number of workgroups.
        for (count, limit) in [(1000u32, 40u32), (1500, 1000), (20_000, 1000)] {
            let input = values(count);
            let cpu = collatz(&input, limit);
            for n in &nodes {
                let c = client(n);
                let blob = c.upload(bytes(&input)).await.unwrap();
                let (task, out) = c.run(collatz_spec(blob, count, limit)).await.unwrap();
                assert!(out[&0] == cpu, "{count} values run through {:x}", n.raft_id);
                let (node, here) = ran_where(n, task);
                if n.raft_id == nodes[2].raft_id {
                    assert!(!here, "node 2 has no slots: the mesh placed t{task}");
                } else {
                    assert_eq!(node, n.raft_id, "t{task} ran where it was sent");
                    assert!(here, "t{task}'s history says so");
                }
                let (output, in_record) = n.consensus.read_local(move |s| {
                    let t = s.task(TaskId(task)).expect("recorded");
                    let output = t.shards[0].output.expect("a result");
                    (output, t.inline.contains_key(&output.blob))
                });
                let size = output.size as usize;
                assert_eq!(
                    in_record,
                    size <= gpumesh::consensus::MAX_INLINE_RESULT,
                    "t{task}: a result of {size} bytes in the record"
                );
                let carried = size > gpumesh::consensus::MAX_INLINE_RESULT
                    && size <= gpumesh::consensus::MAX_CARRIED_RESULT;
                assert_eq!(
                    (in_record, carried),
                    (count == 1000, count == 1500),
                    "{count} values: a result of {size} bytes"
                );
                if size > gpumesh::consensus::MAX_CARRIED_RESULT {
                    // Kept on two nodes before it was recorded (its second copy
                    // pulled from here).
                    let holders = nodes.iter().filter(|m| m.blobs.has(&output.blob)).count();
                    assert!(holders >= 2, "t{task}'s result is on {holders} node(s)");
                } else if size > gpumesh::consensus::MAX_INLINE_RESULT {
                    // Carried in its entry: every node stores it on applying it,
                    // before any has been asked for it.
                    for m in &nodes {
                        let mut held = false;
                        for _ in 0..100 {
                            held = m.blobs.has(&output.blob);
                            if held {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        assert!(held, "t{task}'s carried result is not on {:x}", m.raft_id);
                    }
                }
                // Every node serves the same bytes.
                for other in &nodes {
                    assert!(client(other).results(task).await.unwrap()[&0] == cpu);
                }
            }
        }

        // The dashboard's throughput counts results recorded where they ran.
        let overview = format!("http://{}/v1/overview", nodes[0].api_addr);
        let me = format!("{:x}", nodes[0].raft_id);
        let mut counted = false;
        for _ in 0..40 {
            let o: gpumesh::node::api::Overview =
                reqwest::get(&overview).await.unwrap().json().await.unwrap();
            counted = o
                .throughput
                .iter()
                .any(|p| p.rates.get(&me).is_some_and(|r| *r > 0.0));
            if counted {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(counted, "no throughput shown for node {me}");

        // A retried request (the same request id) gets the same task; nothing runs
        // again.
        let via = client(&nodes[0]);
        let input = values(300);
        let blob = via.upload(bytes(&input)).await.unwrap();
        let body = serde_json::json!({
            "spec": collatz_spec(blob, 300, 100),
            "request_id": {"client": 77, "seq": 1},
        });
        let url = format!("http://{}/v1/tasks/run", nodes[0].api_addr);
        let http = reqwest::Client::new();
        let mut tasks = Vec::new();
        for _ in 0..2 {
            let reply: RunReply = http
                .post(&url)
                .json(&body)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            assert_eq!(reply.task.status, TaskState::Completed, "{reply:#?}");
            tasks.push(reply.task.id);
        }
        assert_eq!(tasks[0], tasks[1], "a retry finds the task the first made");

        // The same request asking for a binary answer: a length, the same reply as
        // JSON with the output marked attached instead of in hex, then its bytes.
        let answer = http
            .post(&url)
            .header(reqwest::header::ACCEPT, RUN_BINARY)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(
            answer.headers()[reqwest::header::CONTENT_TYPE].as_bytes(),
            RUN_BINARY.as_bytes()
        );
        let framed = answer.bytes().await.unwrap();
        // The output's bytes first, then the reply as JSON, then its length.
        let (reply, attached) = decode_run_binary(framed.to_vec()).unwrap().unwrap();
        assert_eq!(
            reply.task.id, tasks[0],
            "the binary answer names the same task"
        );
        assert_eq!(reply.outputs.len(), 1, "{reply:#?}");
        let output = &reply.outputs[0];
        assert!(output.attached && output.hex.is_none(), "{output:?}");
        let cpu = collatz(&input, 100);
        assert!(framed.starts_with(&cpu), "the output's bytes come first");
        assert!(
            attached[0].as_deref() == Some(&cpu[..]),
            "attached bytes are the answer"
        );
        let accepted = nodes[0]
            .consensus
            .read_local(|s| s.tasks().filter(|t| t.request_id.client == 77).count());
        assert_eq!(accepted, 1, "one task for the request id");

        // Replicas are never run where they are sent: two nodes each ran the shard.
        let mut verified = collatz_spec(blob, 300, 100);
        verified.options.replicas = 2;
        let (task, out) = via.run(verified).await.unwrap();
        assert!(out[&0] == collatz(&input, 100));
        let reporters = nodes[0].consensus.read_local(move |s| {
            let t = s.task(TaskId(task)).unwrap();
            let mut nodes: Vec<u64> = t.shards[0].reports.iter().map(|r| r.node).collect();
            nodes.sort();
            nodes.dedup();
            nodes.len()
        });
        assert!(reporters >= 2, "t{task}: results from {reporters} node(s)");

        // A kernel that runs past its deadline here fails with the reason, recorded;
        // every node goes on serving.
        let mut runaway = collatz_spec(blob, 300, 100);
        runaway.shader = ShaderSource::Wgsl(RUNAWAY.into());
        runaway.bindings[1].role = BindingRole::Param { data: vec![0; 16] };
        runaway.grid = Grid([4000, 1, 1]);
        runaway.options.deadline_ms = Some(300);
        let answer = via.run(runaway).await;
        match answer {
            Err(ClientError::Refused(why)) => assert!(runaway_stopped(&why), "{why}"),
            other => panic!("a runaway kernel's run: {other:?}"),
        }
        let (task, out) = via.run(collatz_spec(blob, 300, 7)).await.unwrap();
        assert!(out[&0] == collatz(&input, 7), "t{task} after the runaway");
        // The node says it replaced its device, and drops the old one once the
        // runaway's dispatch ends (Mesa's adapters cap its loops; GL ran it to its
        // end at submit): until then it counts as abandoned.
        let addr = nodes[0].api_addr;
        assert!(metric(addr, "gpumesh_gpu_device_rebuilds_total").await >= 1.0);
        let given = Instant::now();
        while metric(addr, "gpumesh_gpu_devices_abandoned").await > 0.0 {
            assert!(
                given.elapsed() < Duration::from_secs(120),
                "the abandoned device is still held"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for n in &nodes {
            client(n).status().await.unwrap();
        }
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

/// The value of the sample `name` (no labels) on the node's /metrics.
async fn metric(addr: std::net::SocketAddr, name: &str) -> f64 {
    let text = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

/// `POST /v1/tasks/run` with `Accept: RUN_BINARY` to the API at `addr`: the
/// answer's content type and body.
async fn run_binary(addr: std::net::SocketAddr, body: &serde_json::Value) -> (String, Vec<u8>) {
    let answer = reqwest::Client::new()
        .post(format!("http://{addr}/v1/tasks/run"))
        .header(reqwest::header::ACCEPT, RUN_BINARY)
        .json(body)
        .send()
        .await
        .unwrap();
    let kind = answer.headers()[reqwest::header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .to_string();
    (kind, answer.bytes().await.unwrap().to_vec())
}

/// The end of a binary answer, as JSON.
fn end_of(body: &[u8]) -> RunEnd {
    let at = body.len() - 4;
    let len = u32::from_le_bytes(body[at..].try_into().unwrap()) as usize;
    serde_json::from_slice(&body[at - len..at]).unwrap()
}

/// A run whose result is too large for its entry sends its outputs while they
/// are stored and recorded. The same request sent twice at once, both run where
/// they were sent (the GPU held back 300 ms): each answer is the CPU's bytes and
/// names the one task the record made.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_sent_twice_at_once_answers_both_with_the_one_task() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh_with(dir.path(), 3, |i, c| {
            if i == 0 {
                c.faults.gpu_delay = Some(Duration::from_millis(300));
            }
        })
        .await;
        // 20,000 values: an 80,000-byte result, too large to ride in its entry, so
        // stored as a blob (its outputs go ahead of the record).
        let input = values(20_000);
        let cpu = collatz(&input, 60);
        let blob = client(&nodes[0]).upload(bytes(&input)).await.unwrap();
        let body = serde_json::json!({
            "spec": collatz_spec(blob, 20_000, 60),
            "request_id": {"client": 91, "seq": 1},
        });
        let addr = nodes[0].api_addr;
        let (a, b) = tokio::join!(run_binary(addr, &body), run_binary(addr, &body));
        let mut tasks = Vec::new();
        for (kind, body) in [a, b] {
            assert_eq!(kind, RUN_BINARY);
            let end = end_of(&body);
            let (reply, attached) = decode_run_binary(body.clone()).unwrap().unwrap();
            assert_eq!(reply.task.status, TaskState::Completed, "{reply:#?}");
            assert!(
                attached[0].as_deref() == Some(&cpu[..]),
                "an answer (skipping {} bytes) is not the CPU's",
                end.skip
            );
            tasks.push(reply.task.id);
        }
        assert_eq!(tasks[0], tasks[1], "both answers name one task");
        let made = nodes[0]
            .consensus
            .read_local(|s| s.tasks().filter(|t| t.request_id.client == 91).count());
        assert_eq!(made, 1, "one task for the request id");
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

/// A run whose outputs went to the client ahead of its record, and which then
/// could not be recorded (the two other nodes of the mesh stopped while the GPU
/// ran it): its answer ends in the error, skipping the bytes sent, so nothing
/// reads them as a result; the node goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn outputs_sent_ahead_of_a_record_that_never_comes_end_in_an_error() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let mut nodes = mesh_with(dir.path(), 3, |i, c| {
            if i == 0 {
                c.faults.gpu_delay = Some(Duration::from_millis(800));
            }
        })
        .await;
        // Too large to ride in its entry (as above).
        let input = values(20_000);
        let blob = client(&nodes[0]).upload(bytes(&input)).await.unwrap();
        let body = serde_json::json!({
            "spec": collatz_spec(blob, 20_000, 60),
            "request_id": {"client": 92, "seq": 1},
        });
        let addr = nodes[0].api_addr;
        let asked = tokio::spawn(async move { run_binary(addr, &body).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let others = nodes.split_off(1);
        stop(others).await;
        let (kind, body) = asked.await.unwrap();
        assert_eq!(kind, RUN_BINARY);
        let end = end_of(&body);
        assert!(end.reply.is_none(), "{end:?}");
        let error = decode_run_binary(body.clone()).unwrap().unwrap_err();
        assert_eq!(error.status, 503, "{error:?}");
        assert_eq!(end.skip, 80_000, "the output went ahead and is skipped");
        assert_eq!(
            end.skip as usize,
            body.len() - 4 - serde_json::to_vec(&end).unwrap().len(),
            "the end skips every byte before it"
        );
        println!("sent ahead: {} bytes; error: {}", end.skip, error.error);
        client(&nodes[0]).status().await.unwrap();
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

/// Tutorial kernels without loops, so every adapter can batch them: an affine step
/// on values in place (uniform, bounds check, ragged last workgroup) ...
const AFFINE: &str = r#"
struct Params { mul: u32, add: u32, _a: u32, _b: u32 }
@group(0) @binding(0) var<storage, read_write> values: array<u32>;
@group(0) @binding(1) var<uniform> params: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= arrayLength(&values)) {
        return;
    }
    values[i] = values[i] * params.mul + params.add + i;
}
"#;

/// ... and a histogram counted with atomics.
const HISTOGRAM: &str = r#"
struct Params { bins: u32, _a: u32, _b: u32, _c: u32 }
@group(0) @binding(0) var<storage, read> values: array<u32>;
@group(0) @binding(1) var<uniform> params: Params;
@group(0) @binding(2) var<storage, read_write> counts: array<atomic<u32>>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= arrayLength(&values)) {
        return;
    }
    atomicAdd(&counts[values[i] % params.bins], 1u);
}
"#;

/// Task `k` of a burst: its spec, and the CPU's bytes for its one output binding.
fn burst_task(k: u32, blob: gpumesh::protocol::BlobId, input: &[u32]) -> (TaskSpec, u32, Vec<u8>) {
    let count = input.len() as u32;
    let param = |words: [u32; 4]| BindingRole::Param {
        data: bytes(&words),
    };
    if k.is_multiple_of(2) {
        let (mul, add) = (k + 2, 1000 * k + 1);
        let cpu: Vec<u32> = input
            .iter()
            .enumerate()
            .map(|(i, v)| v.wrapping_mul(mul).wrapping_add(add).wrapping_add(i as u32))
            .collect();
        let spec = TaskSpec {
            shader: ShaderSource::Wgsl(AFFINE.into()),
            entry_point: "main".into(),
            bindings: vec![
                BindingSpec {
                    binding: 0,
                    role: BindingRole::InOut {
                        blob,
                        size: u64::from(count) * 4,
                    },
                },
                BindingSpec {
                    binding: 1,
                    role: param([mul, add, 0, 0]),
                },
            ],
            grid: Grid([count.div_ceil(64), 1, 1]),
            shards: 1,
            merge: MergeRule::Changes,
            merges: Default::default(),
            options: Default::default(),
        };
        (spec, 0, bytes(&cpu))
    } else {
        let bins = 3 + k % 13;
        let mut cpu = vec![0u32; bins as usize];
        for v in input {
            cpu[(v % bins) as usize] += 1;
        }
        let spec = TaskSpec {
            shader: ShaderSource::Wgsl(HISTOGRAM.into()),
            entry_point: "main".into(),
            bindings: vec![
                BindingSpec {
                    binding: 0,
                    role: BindingRole::Input {
                        blob,
                        size: u64::from(count) * 4,
                    },
                },
                BindingSpec {
                    binding: 1,
                    role: param([bins, 0, 0, 0]),
                },
                BindingSpec {
                    binding: 2,
                    role: BindingRole::Output {
                        size: u64::from(bins) * 4,
                    },
                },
            ],
            grid: Grid([count.div_ceil(64), 1, 1]),
            shards: 1,
            merge: MergeRule::Changes,
            merges: Default::default(),
            options: Default::default(),
        };
        (spec, 2, bytes(&cpu))
    }
}

/// Node `n`'s `gpumesh_gpu_batched_runs_total`.
async fn batched_runs(n: &gpumesh::node::MeshNode) -> f64 {
    common::metric(n, "gpumesh_gpu_batched_runs_total").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn runs_waiting_for_the_gpu_share_a_submission_and_each_gets_its_own_result() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        // One node, so every run waits for the one GPU.
        let nodes = mesh_with(dir.path(), 1, |_, _| {}).await;
        let c = client(&nodes[0]);
        for with_runaway in [false, true] {
            // Tasks of two kernels, different sizes (none a whole number of
            // workgroups), inputs and uniforms, uploaded first.
            let mut burst = Vec::new();
            for k in 0..20u32 {
                let input: Vec<u32> = (0..100 + 37 * k).map(|i| i * (k + 3) + k).collect();
                let blob = c.upload(bytes(&input)).await.unwrap();
                burst.push(burst_task(k, blob, &input));
            }
            let before = batched_runs(&nodes[0]).await;
            // A long run holds the GPU while the burst queues behind it.
            let blocker = tokio::spawn({
                let c = c.clone();
                async move { c.run(common::lcg_spec(300, 1)).await }
            });
            tokio::time::sleep(Duration::from_millis(50)).await;
            let mut runs = tokio::task::JoinSet::new();
            for (k, (spec, binding, cpu)) in burst.into_iter().enumerate() {
                let c = c.clone();
                runs.spawn(async move {
                    let (task, out) = c.run(spec).await.unwrap();
                    assert!(
                        out[&binding] == cpu,
                        "task {k} (t{task}) differs from the CPU"
                    );
                });
            }
            if with_runaway {
                // Among them, a kernel that never ends: it fails on its own deadline
                // and takes none of the others with it.
                let input = c.upload(bytes(&values(300))).await.unwrap();
                let mut runaway = collatz_spec(input, 300, 1);
                runaway.shader = ShaderSource::Wgsl(RUNAWAY.into());
                runaway.bindings[1].role = BindingRole::Param { data: vec![0; 16] };
                runaway.grid = Grid([4000, 1, 1]);
                runaway.options.deadline_ms = Some(300);
                match c.run(runaway).await {
                    Err(ClientError::Refused(why)) => assert!(runaway_stopped(&why), "{why}"),
                    other => panic!("a runaway kernel's run: {other:?}"),
                }
            }
            while let Some(done) = runs.join_next().await {
                done.unwrap();
            }
            let (_, out) = blocker.await.unwrap().unwrap();
            assert!(
                out[&0] == lcg_expected(300 * 64),
                "the long run differs from the CPU"
            );
            let batched = batched_runs(&nodes[0]).await - before;
            if !with_runaway {
                assert!(batched >= 2.0, "{batched} runs shared a submission");
            }
        }
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

const GROUPS: u32 = 3000;

fn lcg_expected(invocations: u32) -> Vec<u8> {
    common::lcg_after(STEPS, invocations)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_node_running_a_run_then_the_retry_through_another_makes_the_task_once() {
    if !have_any() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let mut procs = common::procs::three(root.path());
    let leader = common::procs::three_voters(&procs).await.leader;
    // The victim is a follower, so the mesh keeps its leader.
    let victim = procs.iter().position(|p| p.raft_id != leader).unwrap();
    let other = (0..3).find(|&i| i != victim).unwrap();
    let spec = common::lcg_spec(GROUPS, 1);
    let body = serde_json::json!({"spec": spec, "request_id": {"client": 99, "seq": 7}});
    let post = |addr: String| {
        let body = body.clone();
        async move {
            reqwest::Client::new()
                .post(format!("http://{addr}/v1/tasks/run?timeout_ms=300000"))
                .json(&body)
                .send()
                .await?
                .json::<RunReply>()
                .await
        }
    };
    let expected = lcg_expected(GROUPS * 64);
    // A completed task whose inline bytes (when the node sent them) are the CPU's.
    let task_of = |reply: &RunReply| {
        assert_eq!(reply.task.status, TaskState::Completed, "{reply:#?}");
        if let Some(hex) = &reply.outputs[0].hex {
            assert!(from_hex(hex).unwrap() == expected, "differs from the CPU");
        }
        reply.task.id
    };
    let started = Instant::now();
    let first = tokio::spawn(post(procs[victim].api_addr()));
    tokio::time::sleep(Duration::from_millis(700)).await;
    procs[victim].kill9();
    let first = first.await.unwrap();
    // Killed mid-run (a software adapter takes seconds), the client saw no answer
    // and tries again through another node with the same request id. (A GPU fast
    // enough to finish within the 0.7 s answered the first; the retry must then
    // return that same task.)
    let task = task_of(&post(procs[other].api_addr()).await.unwrap());
    match &first {
        Ok(reply) => assert_eq!(task_of(reply), task, "the first run's task"),
        Err(e) => eprintln!("killed mid-run after {:?}: {e}", started.elapsed()),
    }
    let c = procs[other].client().unwrap();
    let out = c.results(task).await.unwrap();
    let words = |b: &[u8]| common::words(&b[..16]);
    assert!(
        out[&0] == expected,
        "t{task} differs from the CPU reference: {:?} vs {:?}, {} vs {} bytes",
        words(&out[&0]),
        words(&expected),
        out[&0].len(),
        expected.len()
    );
    let tasks = c.tasks().await.unwrap();
    assert_eq!(tasks.len(), 1, "one task made for the request: {tasks:#?}");
}
