//! Sharding on the mesh: kernels written the way WebGPU programs write them, split
//! across a Vulkan node and a GL node (real libp2p, Raft on redb, wgpu on lavapipe
//! and llvmpipe), must equal the unsharded local run — bit for bit for integers,
//! within a stated bound for floats — and the CPU reference; a kernel whose shards
//! cannot be merged fails with the conflict, or is refused before anything is
//! committed, and the mesh carries on.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

#[path = "../shaders/tests/common/kernels.rs"]
mod kernels;
#[path = "../shaders/tests/common/task.rs"]
mod task;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{client, config, have, stop, wait_ready, LIMIT};
use gpumesh::node::api::TaskState;
use gpumesh::node::{Formation, MeshNode};
use gpumesh::protocol::{BackendKind, MergeRule};
use gpumesh::shaders::{BackendChoice, Executor, Job, Kernel};
use gpumesh::{Client, ClientError};
use kernels::*;
use task::Task;

/// Running a test task here (unsharded) and on the mesh.
trait Run {
    fn local(
        &self,
        executor: &mut Executor,
        source: &str,
        grid: [u32; 3],
    ) -> BTreeMap<u32, Vec<u8>>;
    async fn submit(
        &self,
        via: &Client,
        source: &str,
        grid: [u32; 3],
        shards: u32,
    ) -> Result<u64, ClientError>;
}

impl Run for Task {
    /// The unsharded run on this process's own adapter.
    fn local(
        &self,
        executor: &mut Executor,
        source: &str,
        grid: [u32; 3],
    ) -> BTreeMap<u32, Vec<u8>> {
        let kernel = Arc::new(Kernel::compile(source, "main").unwrap());
        let spec = self.spec(source, grid, 1, MergeRule::Changes);
        let job = Job::new(spec, kernel, |id| self.blobs.get(id).cloned()).unwrap();
        executor.run(&job, None).unwrap().outputs
    }

    async fn submit(
        &self,
        via: &Client,
        source: &str,
        grid: [u32; 3],
        shards: u32,
    ) -> Result<u64, ClientError> {
        for bytes in self.blobs.values() {
            via.upload(bytes.to_vec()).await?;
        }
        via.submit(self.spec(source, grid, shards, MergeRule::Changes), None)
            .await
    }
}

/// Three nodes: Vulkan (it forms the mesh), GL, GL.
async fn mixed_mesh(root: &std::path::Path) -> Vec<MeshNode> {
    let mut c = config(&root.join("vk"), Formation::Init, &[]);
    c.backend = BackendChoice::Only(BackendKind::Vulkan);
    let first = MeshNode::start(c).await.unwrap();
    let seed = common::seed(&first);
    let mut nodes = vec![first];
    for i in 0..2 {
        let mut c = config(
            &root.join(format!("gl{i}")),
            Formation::Join,
            std::slice::from_ref(&seed),
        );
        c.backend = BackendChoice::Only(BackendKind::Gl);
        nodes.push(MeshNode::start(c).await.unwrap());
    }
    wait_ready(&nodes).await;
    nodes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kernels_split_over_vulkan_and_gl_nodes_equal_the_unsharded_local_run() {
    if !(have(BackendKind::Vulkan) && have(BackendKind::Gl)) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT * 2, async {
        let nodes = mixed_mesh(dir.path()).await;
        let vk = nodes[0].raft_id;
        let mut local = Executor::new(BackendChoice::Only(BackendKind::Vulkan)).unwrap();
        let (submit_via, fetch_via) = (client(&nodes[1]), client(&nodes[2]));
        let mut rng = Rng(11);
        let mut on_both = 0;

        // In place: one read_write buffer from a file, 13 ragged workgroups.
        let start: Vec<u32> = (0..777).map(|_| rng.below(100_000)).collect();
        let collatz = Task::default().inout(0, u32_bytes(&start));
        // A bounds check and a ragged last workgroup.
        let input: Vec<f32> = (0..1000).map(|_| rng.unit() * 100.0).collect();
        let double = Task::default().input(0, f32_bytes(&input)).output(1, 4000);
        // A 2-D grid with its dimensions in a uniform, split along y.
        let (w, h) = (61u32, 77u32);
        let src: Vec<u32> = (0..w * h).map(|_| rng.below(1 << 24)).collect();
        let transpose = Task::default()
            .input(0, u32_bytes(&[w, h]))
            .input(1, u32_bytes(&src))
            .output(2, u64::from(w * h) * 4);
        // Uniforms, an input, two in-out buffers and an output together.
        let x: Vec<u32> = (0..300).map(|_| rng.below(1000)).collect();
        let y: Vec<u32> = (0..300).map(|_| rng.below(1000)).collect();
        let mixed = Task::default()
            .input(0, u32_bytes(&[7, 11]))
            .input(1, u32_bytes(&x))
            .inout(2, u32_bytes(&y))
            .inout(3, u32_bytes(&[5; 300]))
            .output(4, 1200)
            .input(5, u32_bytes(&[300, 0, 0, 0]));

        let cases: [(&str, &str, &Task, [u32; 3], u32); 4] = [
            ("collatz", COLLATZ, &collatz, [13, 1, 1], 5),
            ("double", DOUBLE, &double, [16, 1, 1], 6),
            ("transpose", TRANSPOSE, &transpose, [8, 10, 1], 7),
            ("mixed", MIXED, &mixed, [10, 1, 1], 4),
        ];
        for (name, source, task, grid, shards) in cases {
            let id = task
                .submit(&submit_via, source, grid, shards)
                .await
                .unwrap();
            let view = submit_via.wait(id, |_, _| {}).await.unwrap();
            common::accepted_once(&view);
            if view.shards.iter().any(|s| s.node == Some(vk))
                && view.shards.iter().any(|s| s.node.is_some_and(|n| n != vk))
            {
                on_both += 1;
            }
            let got = fetch_via.results(id).await.unwrap();
            // Integers, and one exact float operation: bit for bit.
            assert_eq!(
                got,
                task.local(&mut local, source, grid),
                "{name}: mesh vs local unsharded run"
            );
            match name {
                "collatz" => {
                    let want: Vec<u32> = start.iter().map(|&v| collatz_reference(v)).collect();
                    assert_eq!(u32s(&got[&0]), want);
                }
                "double" => {
                    let want: Vec<f32> = input.iter().map(|v| v * 2.0).collect();
                    assert_eq!(f32s(&got[&1]), want);
                }
                "transpose" => assert_eq!(u32s(&got[&2]), transpose_reference(&src, w, h)),
                _ => {
                    let new_y: Vec<u32> = (0..300).map(|i| 7 * x[i] + y[i] + 11).collect();
                    assert_eq!(u32s(&got[&2]), new_y);
                    assert_eq!(u32s(&got[&3]), vec![6; 300]);
                    assert_eq!(
                        u32s(&got[&4]),
                        new_y.iter().map(|v| v & 1).collect::<Vec<_>>()
                    );
                }
            }
        }
        assert!(
            on_both > 0,
            "no task had shards on both the Vulkan and a GL node"
        );

        // Floats across backends: the particle step within 1e-5 of the local run and
        // of the CPU reference (a particle or two may sit exactly at a radius).
        let p = particles(1000, 12);
        let flat: Vec<f32> = p.iter().flatten().copied().collect();
        let particles_task = Task::default()
            .input(0, f32_bytes(&PARTICLE_PARAMS))
            .input(1, f32_bytes(&flat))
            .output(2, 16_000);
        let id = particles_task
            .submit(&submit_via, PARTICLES, [16, 1, 1], 6)
            .await
            .unwrap();
        submit_via.wait(id, |_, _| {}).await.unwrap();
        let got = f32s(&fetch_via.results(id).await.unwrap()[&2]);
        let here = f32s(&particles_task.local(&mut local, PARTICLES, [16, 1, 1])[&2]);
        assert!(particles_off(&got, &here, 1e-5) <= 2);
        assert!(particles_off(&got, &particles_reference(&p), 1e-5) <= 2);
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unmergeable_kernels_fail_with_the_conflict_or_are_refused_and_the_mesh_carries_on() {
    if !(have(BackendKind::Vulkan) && have(BackendKind::Gl)) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT * 2, async {
        let nodes = mixed_mesh(dir.path()).await;
        let c = client(&nodes[1]);
        let values: Vec<u32> = (0..640).collect();

        // Shards that change one word to different values: the task fails, and says
        // where and what to do.
        let running_max = Task::default().input(0, u32_bytes(&values)).output(1, 8);
        let id = running_max
            .submit(&c, RUNNING_MAX, [10, 1, 1], 4)
            .await
            .unwrap();
        let e = c.wait(id, |_, _| {}).await.unwrap_err().to_string();
        assert!(
            e.contains("conflict") && e.contains("binding 1") && e.contains("byte offset 0"),
            "{e}"
        );
        assert!(e.contains("--shards 1"), "{e}");
        let view = client(&nodes[0]).task(id).await.unwrap();
        assert_eq!(view.status, TaskState::Failed);
        let fetched = client(&nodes[2]).results(id).await.unwrap_err().to_string();
        assert!(fetched.contains("conflict"), "{fetched}");
        // Summed, its word is still a value each shard stored: the leader's merge
        // fails it, rather than adding the shards' maxima.
        let summed = running_max
            .clone()
            .merge(1, MergeRule::Sum(gpumesh::protocol::ElemType::U32));
        let id = summed.submit(&c, RUNNING_MAX, [10, 1, 1], 4).await.unwrap();
        let e = c.wait(id, |_, _| {}).await.unwrap_err().to_string();
        assert!(
            e.contains("conflict") && e.contains("holds no atomics") && e.contains("sum-u32"),
            "{e}"
        );
        // A flag several shards set, summed: 1, not one for each shard that set it.
        let mut signed: Vec<i32> = (0..640).collect();
        signed[3] = -1;
        signed[600] = -1;
        let bytes: Vec<u8> = signed.iter().flat_map(|v| v.to_le_bytes()).collect();
        let flag = Task::default()
            .input(0, bytes)
            .output(1, 4)
            .merge(1, MergeRule::Sum(gpumesh::protocol::ElemType::U32));
        let id = flag.submit(&c, ANY_NEGATIVE, [10, 1, 1], 3).await.unwrap();
        c.wait(id, |_, _| {}).await.unwrap();
        assert_eq!(u32s(&client(&nodes[2]).results(id).await.unwrap()[&1]), [1]);
        // A maximum kept with atomicMax, merged as a sum: refused before anything
        // is committed, naming the rule that folds it.
        let before = c.tasks().await.unwrap().len();
        let range = Task::default()
            .input(0, u32_bytes(&values))
            .output(1, 4)
            .output(2, 4)
            .merge(1, MergeRule::Sum(gpumesh::protocol::ElemType::I32))
            .merge(2, MergeRule::Min(gpumesh::protocol::ElemType::I32));
        let e = range
            .submit(&c, RANGE, [10, 1, 1], 3)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("atomicMax") && e.contains("--merge 1=max-i32"),
            "{e}"
        );
        assert_eq!(c.tasks().await.unwrap().len(), before);
        // Unsharded it is never refused.
        let id = running_max
            .submit(&c, RUNNING_MAX, [10, 1, 1], 1)
            .await
            .unwrap();
        c.wait(id, |_, _| {}).await.unwrap();
        let word = u32s(&c.results(id).await.unwrap()[&1])[0];
        assert!(word % 64 == 63 && word <= 639, "{word}");

        // An atomic append is refused split, before anything is committed...
        let before = c.tasks().await.unwrap().len();
        let append = Task::default()
            .input(0, u32_bytes(&values))
            .output(1, 4 + 4 * 640);
        let e = append
            .submit(&c, APPEND, [10, 1, 1], 3)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("slots an atomic hands out") && e.contains("--shards 1"),
            "{e}"
        );
        assert_eq!(c.tasks().await.unwrap().len(), before);
        // So is one whose counter is a buffer of its own, merged as a sum.
        let apart = Task::default()
            .input(0, u32_bytes(&values))
            .output(1, 4)
            .output(2, 4 * 640)
            .merge(1, MergeRule::Sum(gpumesh::protocol::ElemType::U32));
        let e = apart
            .submit(&c, APPEND_APART, [10, 1, 1], 3)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("binding 2 (items)"), "{e}");
        assert_eq!(c.tasks().await.unwrap().len(), before);
        // So is a sum the last workgroup to take a ticket finishes, its counter
        // merged as a sum; whole, it is the CPU's sum.
        let last = Task::default()
            .input(0, u32_bytes(&values))
            .output(1, 4 * 10)
            .output(2, 4)
            .output(3, 4)
            .merge(2, MergeRule::Sum(gpumesh::protocol::ElemType::U32));
        let e = last
            .submit(&c, LAST_WORKGROUP_SUM, [10, 1, 1], 2)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("binding 3 (total)") && e.contains("--shards 1"),
            "{e}"
        );
        assert_eq!(c.tasks().await.unwrap().len(), before);
        let id = last
            .submit(&c, LAST_WORKGROUP_SUM, [10, 1, 1], 1)
            .await
            .unwrap();
        c.wait(id, |_, _| {}).await.unwrap();
        let total = u32s(&client(&nodes[2]).results(id).await.unwrap()[&3]);
        assert_eq!(total, [values.iter().sum::<u32>()]);
        // ...and runs whole, with the CPU's count and items.
        let id = append.submit(&c, APPEND, [10, 1, 1], 1).await.unwrap();
        c.wait(id, |_, _| {}).await.unwrap();
        let words = u32s(&client(&nodes[0]).results(id).await.unwrap()[&1]);
        let mut want: Vec<u32> = values.iter().copied().filter(|v| v % 7 == 3).collect();
        let mut got = words[1..=words[0] as usize].to_vec();
        want.sort_unstable();
        got.sort_unstable();
        assert_eq!(got, want);

        // Every node still takes and runs work.
        let flags: Vec<u8> = [-1i32, 2, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
        let flag = Task::default().input(0, flags).output(1, 4);
        for n in &nodes {
            let id = flag
                .submit(&client(n), ANY_NEGATIVE, [1, 1, 1], 1)
                .await
                .unwrap();
            client(n).wait(id, |_, _| {}).await.unwrap();
            assert_eq!(u32s(&client(n).results(id).await.unwrap()[&1]), [1]);
        }
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

/// The HTTP API as a program in any language would use it: upload the file, put
/// the id it answers into an in-out binding, submit the spec as JSON, wait, fetch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_inout_task_submitted_as_plain_json_over_http() {
    if !common::have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = common::mesh(dir.path(), 2).await;
        let base = format!("http://{}", nodes[1].api_addr);
        let http = reqwest::Client::new();
        let start: Vec<u32> = (1..=100).collect();
        let uploaded: serde_json::Value = http
            .post(format!("{base}/v1/blobs"))
            .body(u32_bytes(&start))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let blob = uploaded["id"].as_str().unwrap();
        let request = serde_json::json!({
            "spec": {
                "shader": { "Wgsl": COLLATZ },
                "entry_point": "main",
                "bindings": [
                    { "binding": 0, "role": { "InOut": { "blob": blob, "size": 400 } } }
                ],
                "grid": [2, 1, 1],
                "shards": 2,
                "merge": "Changes"
            }
        });
        let submitted = http
            .post(format!("{base}/v1/tasks"))
            .json(&request)
            .send()
            .await
            .unwrap();
        assert!(
            submitted.status().is_success(),
            "{}",
            submitted.text().await.unwrap()
        );
        let task = submitted.json::<serde_json::Value>().await.unwrap()["task"]
            .as_u64()
            .unwrap();
        client(&nodes[0]).wait(task, |_, _| {}).await.unwrap();
        let bytes = http
            .get(format!("{base}/v1/tasks/{task}/outputs/0"))
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        let want: Vec<u32> = start.iter().map(|&v| collatz_reference(v)).collect();
        assert_eq!(u32s(&bytes), want);
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}
