//! Linearizable reads (ReadIndex) on every kind of replica of a mesh grown the way a
//! real one is: one founder, then nodes added as learners and auto-promoted.

mod common;

use std::time::Duration;

use common::*;
use gpumesh_consensus::{ConsensusError, ConsensusHandle, RaftRole, RedbStorage};

const SEC: Duration = Duration::from_secs(1);

/// One founder (node 1), then `joiners` empty nodes added through `add_learner`;
/// waits until auto-promotion filled the voter cap.
async fn grown_mesh(joiners: u64, max_voters: u32, seed: u64) -> Cluster {
    let mut c = Cluster::with(1, seed, test_config, max_voters).await;
    c.leader().await;
    for id in 2..=joiners + 1 {
        let storage = RedbStorage::open(c.path(id), CLUSTER).expect("open");
        let h =
            ConsensusHandle::start(test_config(id), storage, c.net.transport(id)).expect("start");
        c.net.register(h.clone());
        c.nodes.insert(id, h);
        c.node(1)
            .add_learner(id, format!("peer-{id}"), None)
            .await
            .expect("add learner");
    }
    let voters = (joiners + 1).min(u64::from(max_voters)) as usize;
    let ok = eventually(10 * SEC, || async {
        let st = c.status(1).await;
        (st.voters.len() == voters).then_some(())
    })
    .await;
    assert!(ok.is_some(), "promotion: {:?}", c.status(1).await);
    c
}

/// Proposes on the leader, then reads on `reader`; the read must see the write.
async fn read_sees_write(c: &Cluster, leader: u64, reader: u64, round: u32) {
    let done = c
        .node(leader)
        .propose(submit(round + 1))
        .await
        .expect("submit");
    let seen = c
        .node(reader)
        .read_linearizable(|s| s.applied_index())
        .await
        .unwrap_or_else(|e| panic!("read on node {reader} (round {round}): {e}"));
    assert!(
        seen >= done.index,
        "node {reader} read {seen} < {}",
        done.index
    );
}

#[tokio::test(start_paused = true)]
async fn reads_on_leader_follower_and_learner_of_a_grown_mesh() {
    for seed in 0..4 {
        // Cap 3: nodes 2 and 3 become voters, node 4 stays a learner.
        let c = grown_mesh(3, 3, 100 + seed).await;
        let leader = c.leader().await;
        let st = c.status(leader).await;
        assert_eq!(st.learners.len(), 1, "{st:?}");
        for round in 0..20 {
            for reader in c.ids() {
                read_sees_write(&c, leader, reader, round).await;
            }
        }
        // Every node at once, many reads each.
        let mut reads = Vec::new();
        for reader in c.ids() {
            for _ in 0..20 {
                let h = c.node(reader).clone();
                reads.push(tokio::spawn(async move {
                    h.read_linearizable(|s| s.applied_index()).await
                }));
            }
        }
        for r in reads {
            r.await.expect("task").expect("concurrent read");
        }
        // A lossy, reordering network: lost requests and acks are sent again.
        c.net.set_faults(faults(0.1, 0.05, (0, 20)));
        for round in 0..5 {
            for reader in c.ids() {
                c.node(reader)
                    .read_linearizable(|s| s.applied_index())
                    .await
                    .unwrap_or_else(|e| panic!("lossy read on {reader} (round {round}): {e}"));
            }
        }
        c.shutdown().await;
    }
}

#[tokio::test(start_paused = true)]
async fn reads_right_after_a_follower_restarts() {
    for seed in 0..4 {
        let mut c = grown_mesh(2, 5, 200 + seed).await;
        let leader = c.leader().await;
        for round in 0..5 {
            let victim = c
                .ids()
                .into_iter()
                .find(|&i| i != leader)
                .expect("follower");
            read_sees_write(&c, leader, victim, round).await;
            c.crash(victim).await;
            let h = c.start(victim);
            // Issued at once: the restarted node does not know the leader yet.
            h.read_linearizable(|s| s.applied_index())
                .await
                .unwrap_or_else(|e| panic!("read right after restart (round {round}): {e}"));
            read_sees_write(&c, leader, victim, round).await;
        }
        c.shutdown().await;
    }
}

#[tokio::test(start_paused = true)]
async fn reads_across_a_leader_change() {
    let mut c = grown_mesh(2, 5, 300).await;
    let old = c.leader().await;
    let reader = c.ids().into_iter().find(|&i| i != old).expect("follower");
    let h = c.node(reader).clone();
    c.crash(old).await;
    // Issued while no leader is known: waits for the next one.
    let r = h.read_linearizable(|s| s.applied_index()).await;
    r.expect("read after the leader change");
    c.start(old);
    let leader = c.leader().await;
    for reader in c.ids() {
        read_sees_write(&c, leader, reader, 0).await;
    }
    c.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_read_before_the_first_election_waits_for_the_leader() {
    let c = Cluster::new(1, 400).await;
    // No leader yet: the read waits for one rather than failing or hanging.
    let applied = c
        .node(1)
        .read_linearizable(|s| s.applied_index())
        .await
        .expect("read");
    assert!(applied >= 1);
    assert_eq!(c.status(1).await.role, RaftRole::Leader);
    c.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_read_without_any_leader_times_out_saying_so() {
    let mut c = Cluster::new(3, 500).await;
    let leader = c.leader().await;
    let reader = c
        .ids()
        .into_iter()
        .find(|&i| i != leader)
        .expect("follower");
    for id in c.ids() {
        if id != reader {
            c.crash(id).await;
        }
    }
    // Alone, the survivor forgets the leader once its election timer runs out.
    let gone = eventually(5 * SEC, || async {
        (c.status(reader).await.leader_id == 0).then_some(())
    })
    .await;
    assert!(gone.is_some(), "{:?}", c.status(reader).await);
    let started = tokio::time::Instant::now();
    let r = c
        .node(reader)
        .read_linearizable(|s| s.applied_index())
        .await;
    // It waited for a leader for the whole read timeout, then said none was known.
    assert!(started.elapsed() >= test_config(reader).read_timeout);
    match r {
        Err(ConsensusError::ReadTimeout { reason }) => {
            assert!(reason.contains("no Raft leader"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    c.shutdown().await;
}
