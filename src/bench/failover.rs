//! Leader loss on separate `gpumesh node` processes started the way the README starts
//! them: node a `--init`, b and c `--join` a's ticket, all on loopback with default
//! timeouts. Each round kills the leader with SIGKILL (the seed, in the first round
//! the mesh has), times what a user sees from the survivors, and restarts the dead
//! node on its data dir alone.

use std::time::{Duration, Instant};

use anyhow::Context;
use gpumesh::consensus::RequestId;
use gpumesh::process::NodeProcess;
use gpumesh::Client;

use super::mesh::{spec, TINY};

/// What one round measured, each from the moment the leader's process was gone.
#[derive(Debug, Clone, Copy)]
pub struct Round {
    /// Every survivor names the same new leader.
    pub new_leader: Duration,
    /// A task submitted through a survivor right after the kill is acknowledged
    /// (the client retrying with one request id).
    pub acked: Duration,
    /// Every survivor's status shows the dead node as unreachable.
    pub shown_down: Duration,
    /// Whether the node killed was the seed the others joined through.
    pub seed: bool,
}

const LIMIT: Duration = Duration::from_secs(60);

/// Waits until every running node reports one leader among them and three live voters.
async fn settle(procs: &[NodeProcess]) -> anyhow::Result<u64> {
    let deadline = Instant::now() + LIMIT;
    loop {
        let mut leaders = Vec::new();
        for p in procs.iter().filter(|p| p.started()) {
            match p.client()?.status().await {
                Ok(st)
                    if st.members.iter().filter(|m| m.role == "voter").count() == 3
                        && st.members.iter().all(|m| m.alive && m.adapter.is_some()) =>
                {
                    leaders.push(st.leader)
                }
                _ => leaders.push(0),
            }
        }
        if leaders.iter().all(|&l| l != 0 && l == leaders[0]) {
            return Ok(leaders[0]);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the mesh did not settle within {LIMIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls the survivors' status until `done` holds for every one; the time since `t0`.
async fn until_all(
    survivors: &[Client],
    t0: Instant,
    done: impl Fn(&gpumesh::node::api::StatusView) -> bool,
) -> anyhow::Result<Duration> {
    loop {
        let mut all = true;
        for c in survivors {
            all &= c.status().await.is_ok_and(|st| done(&st));
        }
        if all {
            return Ok(t0.elapsed());
        }
        anyhow::ensure!(t0.elapsed() < LIMIT, "not seen within {LIMIT:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Runs `rounds` leader kills on a fresh 3-process mesh.
pub async fn run(rounds: usize) -> anyhow::Result<Vec<Round>> {
    let root = std::env::temp_dir().join(format!("gpumesh-bench-failover-{}", std::process::id()));
    std::fs::create_dir_all(&root)?;
    let result = rounds_on(&root, rounds).await;
    let _ = std::fs::remove_dir_all(&root);
    result
}

async fn rounds_on(root: &std::path::Path, rounds: usize) -> anyhow::Result<Vec<Round>> {
    let mut procs = super::process_mesh(root)?;
    let mut out = Vec::new();
    for round in 0..rounds {
        let leader = settle(&procs).await?;
        let victim = procs
            .iter()
            .position(|p| p.raft_id == leader)
            .context("the leader is none of the three")?;
        let survivors: Vec<Client> = procs
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != victim)
            .map(|(_, p)| p.client())
            .collect::<Result<_, _>>()?;
        let alive: Vec<u64> = procs
            .iter()
            .filter(|p| p.raft_id != leader)
            .map(|p| p.raft_id)
            .collect();
        let via = survivors[0].clone().retry_for(LIMIT);
        procs[victim].kill9();
        let t0 = Instant::now();
        let id = RequestId::new(0xFA11_0000, round as u64 + 1);
        let (new_leader, acked, shown_down) = tokio::join!(
            until_all(&survivors, t0, |st| alive.contains(&st.leader)),
            async {
                via.submit(spec(TINY, 1, 1), Some(id)).await?;
                anyhow::Ok(t0.elapsed())
            },
            until_all(&survivors, t0, |st| st
                .members
                .iter()
                .any(|m| m.raft_id == leader && !m.alive)),
        );
        out.push(Round {
            new_leader: new_leader?,
            acked: acked?,
            shown_down: shown_down?,
            seed: victim == 0,
        });
        procs[victim].start(&[])?;
    }
    settle(&procs).await?;
    for p in &mut procs {
        p.kill9();
    }
    Ok(out)
}
