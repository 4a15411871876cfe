//! The dashboard end to end in headless Chromium: a 3-node mesh runs a task, the
//! page (served by a node's API) is loaded and its rendered DOM must show every
//! member alive, the leader, and the finished task; after a member is killed the
//! page shows it unreachable instead of breaking.
//!
//! Needs `chromium` (Debian's package; `.ci/run` installs it). Without it the test
//! says so and skips, unless GPUMESH_REQUIRE_CHROMIUM=1 (as in CI) makes it fail.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use gpumesh::node::api::Overview;
use gpumesh::node::api::TaskState;
use gpumesh::shaders::builtins;

fn chromium() -> Option<PathBuf> {
    let found = [
        "chromium",
        "chromium-browser",
        "google-chrome",
        "google-chrome-stable",
    ]
    .iter()
    .find_map(|name| {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join(name))
                .find(|p| p.is_file())
        })
    });
    if found.is_none() {
        assert!(
            std::env::var("GPUMESH_REQUIRE_CHROMIUM").is_err(),
            "GPUMESH_REQUIRE_CHROMIUM is set but no chromium is on PATH"
        );
        common::skipped("NO CHROMIUM ON PATH: the dashboard browser test is skipped");
    }
    found
}

/// The page's DOM after its scripts have run and fetched the overview.
fn render(browser: &PathBuf, url: &str) -> String {
    let profile = tempfile::tempdir().unwrap();
    let out = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--virtual-time-budget=3000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(["--dump-dom", url])
        .output()
        .unwrap();
    let dom = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        dom.contains("data-loaded=\"true\""),
        "the page did not load its overview: {dom}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    dom
}

async fn overview(api: &str) -> Overview {
    reqwest::get(format!("http://{api}/v1/overview"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_dashboard_shows_members_and_tasks_and_a_lost_member() {
    if !have_any() {
        return;
    }
    let Some(browser) = chromium() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let mut nodes = mesh(dir.path(), 3).await;
        let b = builtins::get("histogram").unwrap();
        let problem = b.problem(b.test_size).unwrap();
        let c = client(&nodes[0]);
        let task = submit(&c, &problem, 3).await;
        let view = c.wait(task, |_, _| {}).await.unwrap();
        assert_eq!(view.status, TaskState::Completed);
        problem.verify(&c.results(task).await.unwrap()).unwrap();

        // The page as a browser renders it, from a node that did not take the submit.
        let api = nodes[1].api_addr.to_string();
        let o = overview(&api).await;
        let dom = render(&browser, &format!("http://{api}/"));
        for m in &o.members {
            assert!(
                dom.contains(&format!("data-member=\"{}\" data-state=\"alive\"", m.id)),
                "member {} shown alive: {dom}",
                m.id
            );
            assert!(dom.contains(&format!("data-topology-member=\"{}\"", m.id)));
        }
        assert!(!o.leader.is_empty());
        assert!(dom.contains(&format!("{} ★", &o.leader[..8.min(o.leader.len())])));
        assert!(
            dom.contains(&format!("data-task=\"{task}\" data-status=\"completed\"")),
            "task t{task} shown completed: {dom}"
        );
        assert!(dom.contains("3/3"), "shard progress 3/3");

        // A member dies: the page still renders and says so.
        let victim = nodes.pop().unwrap();
        let victim_id = format!("{:x}", victim.raft_id);
        victim.kill().await;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let o = overview(&api).await;
            if o.members.iter().any(|m| m.id == victim_id && !m.alive) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the lost member never showed as down"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let dom = render(&browser, &format!("http://{api}/"));
        assert!(
            dom.contains(&format!(
                "data-member=\"{victim_id}\" data-state=\"unreachable\""
            )) || dom.contains(&format!("data-member=\"{victim_id}\" data-state=\"down\"")),
            "the lost member is shown as such: {dom}"
        );
        assert!(dom.contains(&format!("data-task=\"{task}\" data-status=\"completed\"")));
        stop(nodes).await;
    })
    .await
    .expect("test exceeded its time limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_and_the_overview_are_served_without_a_browser() {
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let mut c = config(&dir.path().join("n0"), gpumesh::node::Formation::Init, &[]);
        c.backend = gpumesh::shaders::BackendChoice::Only(gpumesh::protocol::BackendKind::Metal);
        let node = gpumesh::node::MeshNode::start(c).await.unwrap();
        let api = node.api_addr.to_string();
        let page = reqwest::get(format!("http://{api}/")).await.unwrap();
        assert!(page.status().is_success());
        assert!(page
            .headers()
            .get("content-type")
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("text/html"));
        let html = page.text().await.unwrap();
        assert!(html.contains("/v1/overview") && html.contains("<title>gpumesh</title>"));
        // No markup is built from data: task text goes in as text only.
        assert!(!html.contains("innerHTML"));
        let o = overview(&api).await;
        assert_eq!(o.members.len(), 1);
        assert_eq!(o.node, format!("{:x}", node.raft_id));
        assert_eq!(
            o.members[0].adapter, None,
            "a node without an adapter says so"
        );
        // A wrong method on the overview is a 4xx, not a crash.
        let wrong = reqwest::Client::new()
            .post(format!("http://{api}/v1/overview"))
            .body("x")
            .send()
            .await
            .unwrap();
        assert!(wrong.status().is_client_error());
        node.stop().await;
    })
    .await
    .expect("test exceeded its time limit");
}
