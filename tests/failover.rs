//! The README's recipe on real processes, and then its seed dies: node a `--init`,
//! nodes b and c `--join` a's ticket, all on loopback. `kill -9` of a: b and c stay
//! connected, elect a leader, acknowledge the tasks submitted to them during the
//! failover (each once, each with the CPU reference's answer) and show a as
//! unreachable; a restarted on its data dir alone is back in the mesh. A stranger
//! without the ticket gets nothing, and b's API, served off loopback, refuses a
//! request without its token.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::procs::{free_port, Proc};
use common::{accepted_once, have_any};
use gpumesh::node::api::StatusView;
use gpumesh::node::api::TaskState;
use gpumesh::protocol::{BindingRole, BindingSpec, Grid, MergeRule, ShaderSource, TaskSpec};
use gpumesh::Client;

/// A kernel written the way tutorials write them: a bounds check and a ragged last
/// workgroup, so the grid covers more invocations than there are elements.
const SQUARES: &str = "@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= arrayLength(&out)) { return; }
    out[i] = i * i + SALTu;
}
";
const N: u32 = 1000;

fn spec(salt: u32) -> TaskSpec {
    TaskSpec {
        shader: ShaderSource::Wgsl(SQUARES.replace("SALT", &salt.to_string())),
        entry_point: "main".into(),
        bindings: vec![BindingSpec {
            binding: 0,
            role: BindingRole::Output {
                size: u64::from(N) * 4,
            },
        }],
        grid: Grid([N.div_ceil(64), 1, 1]),
        shards: 2,
        merge: MergeRule::Changes,
        merges: Default::default(),
        options: Default::default(),
    }
}

/// The CPU reference.
fn expected(salt: u32) -> Vec<u8> {
    (0..N)
        .flat_map(|i| i.wrapping_mul(i).wrapping_add(salt).to_le_bytes())
        .collect()
}

/// Waits until the live nodes agree on a leader among them and on three voters
/// with adapters, each alive.
async fn settled(procs: &mut [Proc]) -> StatusView {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let mut views = Vec::new();
        for p in procs.iter_mut().filter(|p| p.started()) {
            if let Ok(st) = p.client().unwrap().status().await {
                views.push(st);
            }
        }
        let live = procs.iter().filter(|p| p.started()).count();
        if views.len() == live
            && views.iter().all(|st| {
                st.leader != 0
                    && st.leader == views[0].leader
                    && st.members.iter().filter(|m| m.role == "voter").count() == 3
                    && st.members.iter().all(|m| m.adapter.is_some() && m.alive)
            })
        {
            return views.remove(0);
        }
        assert!(
            Instant::now() < deadline,
            "the mesh never settled with three live voters: {views:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Submits task `salt` through `via` (retrying through the failover) and checks
/// its answer against the CPU reference.
async fn submit_and_check(via: Client, salt: u32) -> u64 {
    let task = via.submit(spec(salt), None).await.unwrap();
    let view = tokio::time::timeout(Duration::from_secs(90), via.wait(task, |_, _| {}))
        .await
        .expect("the task finished")
        .unwrap();
    assert_eq!(view.status, TaskState::Completed, "{view:#?}");
    accepted_once(&view);
    let out = via.results(task).await.unwrap().remove(&0).unwrap();
    assert!(
        out == expected(salt),
        "t{task} differs from the CPU reference"
    );
    task
}

/// `gpumesh node` for a stranger: gives up joining within a few seconds.
fn stranger(root: &std::path::Path, name: &str, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gpumesh"))
        .args(["node", "--data-dir"])
        .arg(root.join(name))
        .args([
            "--listen",
            &format!("/ip4/127.0.0.1/tcp/{}", free_port().unwrap()),
        ])
        .args(["--api", &format!("127.0.0.1:{}", free_port().unwrap())])
        .args(["--no-mdns", "--join-timeout", "4", "--backend", "metal"])
        .args(extra)
        .env("RUST_LOG", "error")
        .env("XDG_RUNTIME_DIR", std::env::temp_dir())
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mesh_outlives_its_seed_and_keeps_strangers_out() {
    if !have_any() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let mut procs: Vec<Proc> = ["a", "b", "c"]
        .iter()
        .map(|n| common::procs::node(root.path(), n))
        .collect();
    // b serves its API on every interface: off loopback, so it wants its token.
    procs[1].api_host = "0.0.0.0".into();
    procs[0].start(&["--init"]).unwrap();
    let ticket = procs[0].ticket().unwrap();
    for p in &mut procs[1..] {
        p.start(&["--join", &ticket]).unwrap();
    }
    settled(&mut procs).await;

    // The seed dies, whichever node leads.
    let seed_id = procs[0].raft_id;
    procs[0].kill9();
    let killed = Instant::now();
    let submits: Vec<_> = (0..4u32)
        .map(|i| {
            let via = procs[1 + (i as usize % 2)].client().unwrap();
            tokio::spawn(submit_and_check(via, 100 + i))
        })
        .collect();
    let mut tasks = Vec::new();
    for s in submits {
        tasks.push(s.await.unwrap());
    }
    tasks.sort();
    tasks.dedup();
    assert_eq!(tasks.len(), 4, "four submissions, four tasks: {tasks:?}");
    // No retried submission made a second task.
    let all = procs[1].client().unwrap().tasks().await.unwrap();
    assert_eq!(
        all.len(),
        4,
        "{:#?}",
        all.iter().map(|t| t.id).collect::<Vec<_>>()
    );

    // The survivors lead and show the seed as unreachable.
    for p in &procs[1..] {
        let st = p.client().unwrap().status().await.unwrap();
        assert!(st.leader != 0 && st.leader != seed_id, "{st:#?}");
        let a = st.members.iter().find(|m| m.raft_id == seed_id).unwrap();
        assert!(!a.alive && a.unreachable, "{a:#?}");
    }
    eprintln!(
        "four tasks acknowledged and checked {:?} after the kill",
        killed.elapsed()
    );

    // The seed comes back on its data dir alone and is a member again.
    procs[0].start(&[]).unwrap();
    let st = settled(&mut procs).await;
    assert!(st.members.iter().any(|m| m.raft_id == seed_id && m.alive));
    let task = submit_and_check(procs[0].client().unwrap(), 200).await;
    assert!(!tasks.contains(&task));

    // A stranger: without a ticket it is told how to join; with an open transport
    // or another key it gets no connection, and the mesh knows nothing of it.
    let b = procs[1].seed.clone();
    let o = stranger(root.path(), "s1", &["--peer", &b]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--join TICKET"), "{err}");
    let o = stranger(root.path(), "s2", &["--open", "--peer", &b]);
    assert!(!o.status.success(), "an open node joined a closed mesh");
    let key = root.path().join("other.key");
    let made = Command::new(env!("CARGO_BIN_EXE_gpumesh"))
        .args(["keygen", "--out", key.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(made.status.success());
    let o = stranger(
        root.path(),
        "s3",
        &["--cluster-key", key.to_str().unwrap(), "--peer", &b],
    );
    assert!(!o.status.success(), "a node with another key joined");
    let st = procs[1].client().unwrap().status().await.unwrap();
    assert_eq!(st.members.len(), 3, "{st:#?}");
    assert_eq!(procs[1].client().unwrap().tasks().await.unwrap().len(), 5);

    // b's API off loopback: no token or a wrong one is a 401 with a JSON error.
    let url = format!("http://127.0.0.1:{}/v1/status", procs[1].api);
    let http = reqwest::Client::new();
    for auth in [None, Some("Bearer 00ff")] {
        let mut req = http.get(&url);
        if let Some(a) = auth {
            req = req.header("Authorization", a);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401);
        let body: serde_json::Value = resp.json().await.unwrap();
        assert!(
            body["error"].as_str().unwrap().contains("api.token"),
            "{body}"
        );
    }
    assert!(Client::new(format!("127.0.0.1:{}", procs[1].api))
        .status()
        .await
        .is_err());
    // The CLI finds the token in the data dir.
    let cli = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_gpumesh"))
            .args(["status", "--api", &format!("127.0.0.1:{}", procs[1].api)])
            .args(extra)
            .env_remove("GPUMESH_TOKEN")
            .env_remove("GPUMESH_DATA_DIR")
            .output()
            .unwrap()
    };
    let o = cli(&["--data-dir", procs[1].dir.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = cli(&["--data-dir", root.path().join("nowhere").to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("api.token"));
    // Every node still runs.
    for p in &mut procs {
        assert!(p.running(), "node {} stopped", p.name);
    }
}
