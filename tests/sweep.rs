//! Disk use: blobs nothing needs are removed, and nothing that is needed is.
//! Real nodes with a quick sweep: an actor called many times keeps about one
//! state's worth of blobs on each node (not one per call) and still moves off its
//! host with every call counted; an upload never submitted goes, while a task's
//! input and result stay and check against the CPU; small blobs (in the store's
//! pack) go too, and the pack's file shrinks once compacted.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{client, count_call, counted, have_any, mesh_with, metric, stop, LIMIT};
use gpumesh::node::blobs::sweep::SweepConfig;
use gpumesh::protocol::{
    BindingRole, BindingSpec, BlobId, Grid, MergeRule, ShaderSource, TaskSpec,
};

/// Sweeps in seconds rather than an hour.
fn quick() -> SweepConfig {
    SweepConfig {
        keep_unused: Duration::from_secs(3),
        interval: Duration::from_millis(500),
        release_delay: Duration::from_secs(1),
        compact_min_dead: 64 << 10,
    }
}

/// [`quick`], but unused blobs kept for a minute: what goes sooner goes because it
/// was let go.
fn let_go_only() -> SweepConfig {
    SweepConfig {
        keep_unused: Duration::from_secs(60),
        ..quick()
    }
}

/// What node `i`'s blob store takes on disk: its blob files and its pack's file.
fn on_disk(root: &Path, i: usize) -> u64 {
    let dir = root.join(format!("n{i}")).join("blobs");
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

/// The blobs in files of their own under node `i`'s data dir: how many, how many bytes.
fn stored(root: &Path, i: usize) -> (usize, u64) {
    let dir = root.join(format!("n{i}")).join("blobs");
    let mut out = (0, 0);
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.file_name().len() == 64 {
            out.0 += 1;
            out.1 += e.metadata().unwrap().len();
        }
    }
    out
}

fn has_file(root: &Path, i: usize, id: &BlobId) -> bool {
    root.join(format!("n{i}"))
        .join("blobs")
        .join(id.to_hex())
        .is_file()
}

/// Words of a blob in a file of its own (4 MiB and 8 KiB, over the pack's 4 MiB
/// and 4 KiB); the actor below has a state of that size, all of it changed by every
/// call.
const WORDS: u32 = (1 << 20) + 2048;
const STATE_BYTES: u64 = WORDS as u64 * 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_actor_keeps_one_state_on_disk_not_one_per_call_and_still_moves() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    tokio::time::timeout(LIMIT, async {
        let mut nodes = mesh_with(root, 3, |_, c| c.blob_sweep = quick()).await;
        let state = vec![gpumesh::node::api::StateInit {
            binding: 0,
            size: STATE_BYTES,
            blob: None,
        }];
        client(&nodes[0])
            .create_actor("counter", state, None)
            .await
            .unwrap();
        const CALLS: u32 = 20;
        for n in 1..=CALLS {
            let reply = client(&nodes[1])
                .call_actor("counter", count_call(WORDS), None)
                .await
                .unwrap();
            assert_eq!(reply.version, u64::from(n));
        }
        // 20 versions were written on the host and its backup; what stays is about the current one.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let bytes: Vec<u64> = (0..3).map(|i| stored(root, i).1).collect();
            if bytes.iter().all(|b| *b <= 2 * STATE_BYTES) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "replaced states were not removed: {bytes:?} bytes in blob files"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        for n in &nodes {
            counted(&client(n), "counter", WORDS, CALLS).await;
        }
        // Counted where an operator looks.
        let mut removed = 0.0;
        for n in &nodes {
            removed += metric(n, "gpumesh_blobs_removed_bytes_total{sweep=\"let_go\"}").await;
        }
        // Three quarters of the 2 x 20 versions written.
        assert!(
            removed >= 30.0 * STATE_BYTES as f64,
            "{removed} bytes counted removed"
        );

        // The host goes; the state it had is on the backup still, and counts on.
        let host = client(&nodes[0]).actor("counter").await.unwrap();
        let at = nodes
            .iter()
            .position(|n| n.peer_id.to_string() == host.node)
            .unwrap();
        nodes.remove(at).kill().await;
        let reply = client(&nodes[0])
            .call_actor("counter", count_call(WORDS), None)
            .await
            .unwrap();
        assert_eq!(reply.version, u64::from(CALLS) + 1);
        for n in &nodes {
            counted(&client(n), "counter", WORDS, CALLS + 1).await;
        }
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_actor_with_a_mid_size_state_keeps_one_version_too() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh_with(root, 2, |_, c| c.blob_sweep = quick()).await;
        // 64 KiB: over what an entry carries (16 KiB), packed (at most 4 MiB).
        const MID: u32 = 1 << 14;
        let state = vec![gpumesh::node::api::StateInit {
            binding: 0,
            size: u64::from(MID) * 4,
            blob: None,
        }];
        let a = client(&nodes[0]);
        a.create_actor("mid", state, None).await.unwrap();
        const CALLS: u64 = 20;
        for n in 1..=CALLS {
            let reply = client(&nodes[n as usize % 2])
                .call_actor("mid", count_call(MID), None)
                .await
                .unwrap();
            assert_eq!(reply.version, n);
        }
        // 20 versions of 64 KiB in the pack of
        // each of two nodes; what stays is about one, and the pack's file is
        // compacted down to it.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let mut held = Vec::new();
            for (i, n) in nodes.iter().enumerate() {
                let live = metric(n, "gpumesh_blob_store_bytes").await;
                held.push((live, on_disk(root, i)));
            }
            if held
                .iter()
                .all(|(live, disk)| *live <= f64::from(256 << 10) && *disk <= 512 << 10)
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "replaced states were kept: {held:?} (bytes in the stores, on disk)"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        for n in &nodes {
            assert!(metric(n, "gpumesh_blob_pack_compactions_total").await >= 1.0);
            assert!(metric(n, "gpumesh_blob_pack_freed_bytes_total").await > 0.0);
        }
        counted(&a, "mid", MID, CALLS as u32).await;
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

/// Adds one to every word of the input.
const PLUS_ONE: &str = r#"
@group(0) @binding(0) var<storage, read> input: array<u32>;
@group(0) @binding(1) var<storage, read_write> output: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < arrayLength(&output)) {
        output[gid.x] = input[gid.x] + 1u;
    }
}
"#;

/// [`PLUS_ONE`] over `n` words of blob `input`, in `shards` shards.
fn plus_one(input: BlobId, n: u32, shards: u32) -> TaskSpec {
    TaskSpec {
        shader: ShaderSource::Wgsl(PLUS_ONE.into()),
        entry_point: "main".into(),
        bindings: vec![
            BindingSpec {
                binding: 0,
                role: BindingRole::Input {
                    blob: input,
                    size: u64::from(n) * 4,
                },
            },
            BindingSpec {
                binding: 1,
                role: BindingRole::Output {
                    size: u64::from(n) * 4,
                },
            },
        ],
        grid: Grid([n / 64, 1, 1]),
        shards,
        merge: MergeRule::Changes,
        merges: Default::default(),
        options: Default::default(),
    }
}

/// What [`PLUS_ONE`] makes of `input`, worked out on the CPU.
fn plus_one_cpu(input: &[u8]) -> Vec<u8> {
    input
        .chunks_exact(4)
        .flat_map(|w| (u32::from_le_bytes([w[0], w[1], w[2], w[3]]) + 1).to_le_bytes())
        .collect()
}

fn words(seed: u32, n: u32) -> Vec<u8> {
    (0..n)
        .flat_map(|i| (i.wrapping_mul(2_654_435_761) ^ seed).to_le_bytes())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upload_never_used_goes_while_a_tasks_input_and_result_stay() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh_with(root, 2, |_, c| c.blob_sweep = quick()).await;
        let via = client(&nodes[0]);
        const N: u32 = WORDS; // over 4 MiB: files of their own, not packed
        let unused = via.upload(words(1, N)).await.unwrap();
        let input = words(2, N);
        let input_id = via.upload(input.clone()).await.unwrap();
        let spec = plus_one(input_id, N, 2);
        let task = via.submit(spec, None).await.unwrap();
        let expected = plus_one_cpu(&input);
        if have_any() {
            via.wait(task, |_, _| {}).await.unwrap();
            assert!(via.results(task).await.unwrap()[&1] == expected);
        }

        // Past the time an unused blob is kept, and a few sweeps more.
        let deadline = Instant::now() + Duration::from_secs(30);
        while (0..2).any(|i| has_file(root, i, &unused)) {
            assert!(Instant::now() < deadline, "the unused upload was kept");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let mut unused_removed = 0.0;
        for n in &nodes {
            unused_removed += metric(n, "gpumesh_blobs_removed_total{sweep=\"unused\"}").await;
        }
        assert!(
            unused_removed >= 1.0,
            "the unused upload's removal is counted"
        );
        tokio::time::sleep(Duration::from_secs(4)).await;
        let holders = (0..2).filter(|i| has_file(root, *i, &input_id)).count();
        assert_eq!(holders, 2, "the task's input is on both nodes still");
        if have_any() {
            let outputs = via.outputs(task).await.unwrap();
            assert!(!outputs.is_empty());
            for (i, node) in nodes.iter().enumerate() {
                let got = client(node).results(task).await.unwrap();
                assert!(got[&1] == expected, "node {i}: the result changed or went");
            }
        }
        assert!(
            via.outputs_of_blob(unused).await.is_err(),
            "the unused upload is still served"
        );
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forgotten_tasks_results_go_soon_but_not_a_blob_another_task_names() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh_with(root, 2, |_, c| c.blob_sweep = let_go_only()).await;
        let (a, b) = (client(&nodes[0]), client(&nodes[1]));
        const N: u32 = WORDS; // files of their own
        let input = words(3, N);
        let input_id = a.upload(input.clone()).await.unwrap();
        let spec = || plus_one(input_id, N, 1);
        let expected = plus_one_cpu(&input);
        // Two tasks with the same result: one blob, named by both.
        let (first, second) = (
            a.submit(spec(), None).await.unwrap(),
            b.submit(spec(), None).await.unwrap(),
        );
        for t in [first, second] {
            a.wait(t, |_, _| {}).await.unwrap();
        }
        // Both tasks' outputs fetched through both nodes: each node made the
        // binding's bytes from the shard's result, one blob for both tasks.
        for c in [&a, &b] {
            for t in [first, second] {
                assert!(c.results(t).await.unwrap()[&1] == expected);
            }
        }
        let result: BlobId = a.outputs(first).await.unwrap()[0].blake3.parse().unwrap();
        assert_eq!(b.outputs(second).await.unwrap()[0].blake3, result.to_hex());
        let holders = |id: BlobId| (0..2).filter(|i| has_file(root, *i, &id)).count();
        assert_eq!(holders(result), 2, "the result is on both nodes");
        let files = |i: usize| stored(root, i).0;
        let before: Vec<usize> = (0..2).map(files).collect();

        // The first forgotten: gone from the record; what the second names stays.
        b.forget(first).await.unwrap();
        for c in [&a, &b] {
            let gone = c.task(first).await.unwrap_err().to_string();
            assert!(gone.contains(&format!("no task t{first}")), "{gone}");
            assert!(
                c.results(first).await.is_err(),
                "a forgotten task's outputs"
            );
        }
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert_eq!(
            holders(result),
            2,
            "a result another task names was removed"
        );
        assert_eq!((0..2).map(files).collect::<Vec<_>>(), before);
        for c in [&a, &b] {
            assert!(c.results(second).await.unwrap()[&1] == expected);
        }

        // The second forgotten: its results (the shard's, the bytes made from it)
        // go from both nodes within seconds, though unused blobs are kept a minute
        // here; its input has a minute yet, and is all that is left.
        a.forget(second).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while (0..2).any(|i| files(i) > 1) {
            assert!(
                Instant::now() < deadline,
                "the forgotten results were kept: {:?} blob files",
                (0..2).map(files).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert_eq!(holders(input_id), 2);
        assert_eq!(holders(result), 0);

        // A task not finished is not forgotten; nor is an unknown one; a forget
        // repeated answers as the first when retried with its request id (the
        // client's), and "no task" when asked again.
        let running = a.submit(common::lcg_spec(6000, 6), None).await.unwrap();
        let refused = b.forget(running).await.unwrap_err().to_string();
        assert!(refused.contains("cancel it first"), "{refused}");
        b.cancel(running, None).await.unwrap();
        b.forget(running).await.unwrap();
        let unknown = a.forget(running).await.unwrap_err().to_string();
        assert!(
            unknown.contains(&format!("no task t{running}")),
            "{unknown}"
        );
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forgotten_small_results_leave_the_pack_and_the_rest_stay_right() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh_with(root, 2, |_, c| c.blob_sweep = let_go_only()).await;
        let (a, b) = (client(&nodes[0]), client(&nodes[1]));
        // 40 KiB: results over what an entry carries, stored in the packs of two
        // nodes.
        const N: u32 = 10 << 10;
        let kept_input = words(100, N);
        let kept_id = a.upload(kept_input.clone()).await.unwrap();
        let kept = a.submit(plus_one(kept_id, N, 1), None).await.unwrap();
        a.wait(kept, |_, _| {}).await.unwrap();
        let mut tasks = Vec::new();
        for seed in 0..24 {
            let id = b.upload(words(seed, N)).await.unwrap();
            tasks.push(b.submit(plus_one(id, N, 1), None).await.unwrap());
        }
        for t in &tasks {
            b.wait(*t, |_, _| {}).await.unwrap();
        }
        let full: Vec<u64> = (0..2).map(|i| on_disk(root, i)).collect();
        for t in &tasks {
            a.forget(*t).await.unwrap();
        }
        // 24 results of 40 KiB let go on each node (their inputs have a minute yet,
        // so the pack holds about half of what it did once compacted).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let now: Vec<u64> = (0..2).map(|i| on_disk(root, i)).collect();
            if now.iter().zip(&full).all(|(n, f)| n * 10 < f * 7) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "forgotten results stayed in the pack: {now:?} bytes on disk, {full:?} before"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // What the record names is there, right, on both nodes (moved by the
        // compaction, served from the new file); the forgotten ones are gone.
        for c in [&a, &b] {
            assert!(c.results(kept).await.unwrap()[&1] == plus_one_cpu(&kept_input));
            assert!(c.results(tasks[0]).await.is_err());
        }
        for n in &nodes {
            assert!(metric(n, "gpumesh_blob_pack_compactions_total").await >= 1.0);
        }
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

/// A forgotten task's small result leaves its bytes in no pack on any node within
/// seconds of being let go, with no compaction (the dead records are overwritten),
/// and a node's store opened again does not find it: before, the bytes stayed in
/// the file until a compaction, and a store opened again found the blob again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forgotten_small_result_is_erased_from_the_packs_and_stays_gone() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    tokio::time::timeout(LIMIT, async {
        let no_compaction = SweepConfig {
            compact_min_dead: u64::MAX,
            ..let_go_only()
        };
        let nodes = mesh_with(root, 2, |_, c| c.blob_sweep = no_compaction).await;
        let (a, b) = (client(&nodes[0]), client(&nodes[1]));
        // 40 KiB results: stored as blobs in the packs of both nodes.
        const N: u32 = 10 << 10;
        let mut results = Vec::new();
        for seed in 0..3 {
            let input = words(200 + seed, N);
            let id = b.upload(input.clone()).await.unwrap();
            let task = b.submit(plus_one(id, N, 1), None).await.unwrap();
            b.wait(task, |_, _| {}).await.unwrap();
            let got = a.results(task).await.unwrap().remove(&1).unwrap();
            assert_eq!(got, plus_one_cpu(&input));
            results.push((task, got));
        }
        let pack = |i: usize| root.join(format!("n{i}")).join("blobs").join("small.pack");
        let holds = |i: usize, bytes: &[u8]| {
            std::fs::read(pack(i))
                .unwrap()
                .windows(4096)
                .any(|w| w == &bytes[..4096])
        };
        for (_, bytes) in &results {
            assert!(
                (0..2).all(|i| holds(i, bytes)),
                "a result is not in both packs"
            );
        }
        for (task, _) in &results {
            a.forget(*task).await.unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while results
            .iter()
            .any(|(_, bytes)| (0..2).any(|i| holds(i, bytes)))
        {
            assert!(
                Instant::now() < deadline,
                "a forgotten result's bytes are still in a pack"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        stop(nodes).await;
        for i in 0..2 {
            let store = gpumesh::node::blobs::BlobStore::open(
                root.join(format!("n{i}")).join("blobs"),
                1 << 30,
            )
            .unwrap();
            for (_, bytes) in &results {
                assert!(!store.has(&BlobId::of(bytes)), "found again on node {i}");
            }
        }
    })
    .await
    .expect("bounded");
}
