//! `GET /metrics` on real nodes in one process: tasks run through a 3-node mesh move
//! each node's own counters (and only its own), the Raft gauges agree on one leader,
//! the API answers unknown paths and methods with a JSON 4xx, and the README's table
//! of metrics names what a node exports.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{client, config, have_any, mesh, stop, submit, LIMIT};
use gpumesh::consensus::RequestId;
use gpumesh::node::{Formation, MeshNode};
use gpumesh::shaders::builtins;

/// One scrape: every sample line as `name{labels}` → value.
#[derive(Debug)]
struct Scrape(BTreeMap<String, f64>);

impl Scrape {
    /// The sample named exactly `key` (with its labels, if any); 0 when absent, as
    /// Prometheus treats a counter not yet exported.
    fn get(&self, key: &str) -> f64 {
        self.0.get(key).copied().unwrap_or(0.0)
    }

    /// The value of label `label` on the one sample of `metric`.
    fn label(&self, metric: &str, label: &str) -> String {
        let key = self
            .0
            .keys()
            .find(|k| k.starts_with(&format!("{metric}{{")))
            .unwrap_or_else(|| panic!("no {metric} in {self:#?}"));
        let start = key.find(&format!("{label}=\"")).unwrap() + label.len() + 2;
        key[start..].split('"').next().unwrap().to_string()
    }
}

/// Scrapes `node`, checking the content type and the OpenMetrics framing.
async fn scrape(node: &MeshNode) -> Scrape {
    let answer = reqwest::get(format!("http://{}/metrics", node.api_addr))
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let content_type = answer.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        content_type.starts_with("application/openmetrics-text; version=1.0.0"),
        "{content_type}"
    );
    let text = answer.text().await.unwrap();
    assert!(text.ends_with("# EOF\n"), "{text}");
    let mut samples = BTreeMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (key, value) = line.rsplit_once(' ').unwrap();
        assert!(key.starts_with("gpumesh_"), "{line}");
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("{line}"));
        assert!(samples.insert(key.to_string(), value).is_none(), "{line}");
    }
    Scrape(samples)
}

/// Scrapes every node until `done` holds for the scrapes (the last shard's result
/// may be applied on a worker a moment after the submitter saw the task complete).
async fn scrape_until(nodes: &[MeshNode], done: impl Fn(&[Scrape]) -> bool) -> Vec<Scrape> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut all = Vec::new();
        for node in nodes {
            all.push(scrape(node).await);
        }
        if done(&all) || tokio::time::Instant::now() > deadline {
            return all;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Checks that the README's table of metrics names every metric family `node`
/// exports (by its family or sample name) and none it does not.
async fn the_readme_names_the_metrics_of(node: &MeshNode) {
    let text = reqwest::get(format!("http://{}/metrics", node.api_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let families: BTreeMap<String, String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| (name.to_string(), kind.to_string()))
        .collect();
    assert!(families.len() > 20, "{text}");
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = readme
        .split("\n## Metrics\n")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("the README has a Metrics section");
    // Names in the first cell of each row, labels and sample suffixes taken off.
    let mut named = std::collections::BTreeSet::new();
    for row in section.lines().filter(|l| l.starts_with("| `gpumesh_")) {
        let cell = row.split('|').nth(1).unwrap();
        for name in cell.split('`').skip(1).step_by(2) {
            let name = name.split('{').next().unwrap();
            let family = ["_total", "_info"]
                .iter()
                .filter_map(|s| name.strip_suffix(s))
                .find(|f| families.contains_key(*f))
                .unwrap_or(name);
            named.insert(family.to_string());
        }
    }
    let unnamed: Vec<_> = families.keys().filter(|f| !named.contains(*f)).collect();
    let unknown: Vec<_> = named
        .iter()
        .filter(|n| !families.contains_key(*n))
        .collect();
    assert!(
        unnamed.is_empty() && unknown.is_empty(),
        "metrics a node exports that the README's table does not name: {unnamed:?}; \
         names in the table that no node exports: {unknown:?}"
    );
}

fn sum(scrapes: &[Scrape], key: &str) -> f64 {
    scrapes.iter().map(|s| s.get(key)).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tasks_move_each_nodes_own_counters_and_one_leader_is_reported() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh(dir.path(), 3).await;
        for s in scrape_until(&nodes, |_| true).await {
            assert_eq!(s.get("gpumesh_tasks_submitted_total"), 0.0, "{s:#?}");
            assert_eq!(s.get("gpumesh_shards_done_total"), 0.0, "{s:#?}");
        }
        the_readme_names_the_metrics_of(&nodes[0]).await;

        // Task A through node 1 (submitted twice under one request id: one task),
        // task B through node 2; node 0 submits nothing.
        let vector_add = builtins::get("vector_add").unwrap();
        let a = vector_add.problem(256 * 8).unwrap();
        let histogram = builtins::get("histogram").unwrap();
        let b = histogram.problem(histogram.test_size).unwrap();
        let (a_shards, b_shards) = (4u32, 3u32);
        let via = client(&nodes[1]);
        for (id, bytes) in &a.blobs {
            assert_eq!(via.upload(bytes.to_vec()).await.unwrap(), *id);
        }
        let request = RequestId::new(0x6d65_7472, 1);
        let task_a = via.submit(a.spec(a_shards), Some(request)).await.unwrap();
        let again = via.submit(a.spec(a_shards), Some(request)).await.unwrap();
        assert_eq!(again, task_a, "a retried submit is the same task");
        let task_b = submit(&client(&nodes[2]), &b, b_shards).await;
        for (task, problem) in [(task_a, &a), (task_b, &b)] {
            client(&nodes[0]).wait(task, |_, _| {}).await.unwrap();
            // Fetched through every node: each merges the outputs and keeps them.
            for node in &nodes {
                problem
                    .verify(&client(node).results(task).await.unwrap())
                    .unwrap();
            }
        }

        let shards = f64::from(a_shards + b_shards);
        // Every node connected to both others too: the membership sweep dials a
        // member it has no connection to within a sweep or two.
        let scrapes = scrape_until(&nodes, |all| {
            sum(all, "gpumesh_shards_done_total") >= shards
                && all.iter().all(|s| {
                    s.get("gpumesh_tasks{status=\"completed\"}") == 2.0
                        && s.get("gpumesh_net_connected_peers") == 2.0
                })
        })
        .await;

        // Each node counts only what went through it.
        let submitted: Vec<f64> = scrapes
            .iter()
            .map(|s| s.get("gpumesh_tasks_submitted_total"))
            .collect();
        assert_eq!(submitted, [0.0, 1.0, 1.0], "{scrapes:#?}");
        assert_eq!(sum(&scrapes, "gpumesh_shards_done_total"), shards);
        let mut raft_ids = Vec::new();
        for (node, s) in nodes.iter().zip(&scrapes) {
            let raft_id = s.label("gpumesh_node_info", "raft_id");
            assert_eq!(raft_id, node.raft_id.to_string(), "{s:#?}");
            assert_eq!(
                s.label("gpumesh_node_info", "peer_id"),
                node.peer_id.to_string()
            );
            raft_ids.push(raft_id);

            let done = s.get("gpumesh_shards_done_total");
            assert_eq!(s.get("gpumesh_shards_failed_total"), 0.0, "{s:#?}");
            assert_eq!(s.get("gpumesh_shards_retried_total"), 0.0, "{s:#?}");
            assert!(s.get("gpumesh_shard_run_seconds_count") >= done, "{s:#?}");
            if done > 0.0 {
                assert!(s.get("gpumesh_gpu_dispatches_total") >= done, "{s:#?}");
                assert!(s.get("gpumesh_gpu_busy_seconds_total") > 0.0, "{s:#?}");
                assert!(
                    s.get("gpumesh_gpu_bytes_total{direction=\"from_gpu\"}") > 0.0,
                    "{s:#?}"
                );
                assert!(
                    s.get("gpumesh_gpu_bytes_total{direction=\"to_gpu\"}") > 0.0,
                    "{s:#?}"
                );
            }

            assert!(s.get("gpumesh_raft_term") >= 1.0, "{s:#?}");
            assert!(s.get("gpumesh_raft_leader_changes_total") >= 1.0, "{s:#?}");
            assert_eq!(
                s.get("gpumesh_raft_snapshot_write_failures_total"),
                0.0,
                "{s:#?}"
            );
            let (commit, applied) = (
                s.get("gpumesh_raft_commit_index"),
                s.get("gpumesh_raft_applied_index"),
            );
            assert!(applied > 0.0 && commit >= applied, "{s:#?}");
            // Heartbeats at least, from every node.
            assert!(
                s.get("gpumesh_raft_proposals_total{outcome=\"applied\"}") >= 1.0,
                "{s:#?}"
            );
            assert_eq!(s.get("gpumesh_tasks{status=\"completed\"}"), 2.0, "{s:#?}");
            assert_eq!(s.get("gpumesh_tasks{status=\"failed\"}"), 0.0, "{s:#?}");

            assert_eq!(s.get("gpumesh_net_connected_peers"), 2.0, "{s:#?}");
            assert!(
                s.get("gpumesh_net_sent_bytes_total{lane=\"raft\"}") > 0.0,
                "{s:#?}"
            );
            assert!(
                s.get("gpumesh_net_received_bytes_total{lane=\"raft\"}") > 0.0,
                "{s:#?}"
            );
            assert!(s.get("gpumesh_blob_store_blobs") > 0.0, "{s:#?}");
            assert!(s.get("gpumesh_blob_store_bytes") > 0.0, "{s:#?}");
            // Two kernels in the mesh: a node compiles each at most once, however
            // often it validates a submit of it or runs one of its shards.
            assert!(s.get("gpumesh_kernels_compiled") <= 2.0, "{s:#?}");
        }
        // Node 1 validated task A's submit (twice) and so compiled vector_add.
        assert!(
            scrapes[1].get("gpumesh_kernels_compiled") >= 1.0,
            "{scrapes:#?}"
        );
        raft_ids.sort();
        raft_ids.dedup();
        assert_eq!(raft_ids.len(), 3, "each node answers for itself");
        let leaders: Vec<f64> = scrapes
            .iter()
            .map(|s| s.get("gpumesh_raft_is_leader"))
            .collect();
        assert_eq!(
            leaders.iter().filter(|&&l| l == 1.0).count(),
            1,
            "{leaders:?}"
        );
        assert_eq!(
            leaders.iter().filter(|&&l| l == 0.0).count(),
            2,
            "{leaders:?}"
        );
        // The node GPUs did the shards' work between them.
        assert!(sum(&scrapes, "gpumesh_gpu_dispatches_total") >= shards);
        // Every input went to a second node before its task was committed (a small
        // one inside the request, not on the blob lane, so the lane's counters
        // need not show it): it is on two nodes.
        for id in a.blobs.keys().chain(b.blobs.keys()) {
            let copies = nodes.iter().filter(|n| n.blobs.has(id)).count();
            assert!(copies >= 2, "input {id} is on {copies} node(s)");
        }
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unknown_paths_and_methods_get_a_json_4xx_and_the_node_carries_on() {
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let node = MeshNode::start(config(dir.path(), Formation::Init, &[]))
            .await
            .unwrap();
        let http = reqwest::Client::new();
        let base = format!("http://{}", node.api_addr);
        let cases = [
            (reqwest::Method::GET, "/nope", 404),
            (reqwest::Method::GET, "/v1/tasks/1/nope/deeper", 404),
            (reqwest::Method::POST, "/metrics", 405),
            (reqwest::Method::DELETE, "/v1/status", 405),
            (reqwest::Method::PUT, "/v1/tasks", 405),
        ];
        for (method, path, code) in cases {
            let answer = http
                .request(method.clone(), format!("{base}{path}"))
                .send()
                .await
                .unwrap();
            assert_eq!(answer.status().as_u16(), code, "{method} {path}");
            let body: serde_json::Value = answer.json().await.unwrap();
            let error = body["error"].as_str().unwrap_or_default();
            assert!(error.contains(path), "{method} {path}: {body}");
        }
        // Still serving, metrics included.
        assert!(client(&node).status().await.is_ok());
        let s = scrape(&node).await;
        assert_eq!(s.get("gpumesh_raft_is_leader"), 1.0, "{s:#?}");
        assert_eq!(s.get("gpumesh_net_connected_peers"), 0.0, "{s:#?}");
        node.stop().await;
    })
    .await
    .expect("bounded");
}
