//! Replicas on the simulated network: elections, leader loss, partitions, snapshots,
//! membership, forwarding and reads.

mod common;

use std::time::Duration;

use common::*;
use gpumesh_consensus::{
    ClusterSettings, Command, ConsensusError, ConsensusHandle, Outcome, ProposalCounts, RaftRole,
    RedbStorage, Role,
};

const SEC: Duration = Duration::from_secs(1);

#[tokio::test(start_paused = true)]
async fn single_node_commits_and_restarts_intact() {
    let mut c = Cluster::new(1, 1).await;
    let leader = c.leader().await;
    assert_eq!(leader, 1);
    let first = c.node(1).propose(submit(4)).await.expect("submit");
    let Outcome::TaskSubmitted { task } = first.outcome else {
        panic!("{first:?}")
    };
    let second = c.node(1).propose(submit(8)).await.expect("submit");
    assert!(second.index > first.index);
    c.crash(1).await;
    c.start(1);
    c.leader().await;
    let tasks = c
        .node(1)
        .read_linearizable(|s| s.tasks().map(|t| t.id).collect::<Vec<_>>())
        .await
        .expect("read");
    assert_eq!(tasks.len(), 2);
    assert!(tasks.contains(&task));
    c.shutdown().await;
}

async fn elects_and_replicates(n: u64) {
    let c = Cluster::new(n, n).await;
    let leader = c.leader().await;
    let follower = c
        .ids()
        .into_iter()
        .find(|&i| i != leader)
        .expect("a follower");
    // A proposal on a follower is forwarded to the leader and answered here.
    let done = c
        .node(follower)
        .propose(submit(16))
        .await
        .expect("forwarded submit");
    assert!(matches!(done.outcome, Outcome::TaskSubmitted { .. }));
    // Applied on the proposer before it answers: a local read sees it.
    let n_tasks = c.node(follower).read_local(|s| s.tasks().len());
    assert_eq!(n_tasks, 1);
    let ids = c.ids();
    c.wait_applied(&ids, done.index, 5 * SEC).await;
    c.converged(&ids, 5 * SEC).await;
    let st = c.status(leader).await;
    assert_eq!(st.voters.len() as u64, n);
    c.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn three_nodes_elect_and_replicate() {
    elects_and_replicates(3).await;
}

#[tokio::test(start_paused = true)]
async fn five_nodes_elect_and_replicate() {
    elects_and_replicates(5).await;
}

#[tokio::test(start_paused = true)]
async fn leader_loss_elects_a_new_leader_and_keeps_the_record() {
    for n in [3u64, 5] {
        let mut c = Cluster::new(n, 10 + n).await;
        let old = c.leader().await;
        let before = c.node(old).propose(submit(1)).await.expect("submit");
        c.crash(old).await;
        let rest = c.ids();
        let new = c.leader_among(&rest, 10 * SEC).await;
        assert_ne!(new, old);
        let after = c
            .node(rest[0])
            .propose(submit(2))
            .await
            .expect("submit after failover");
        assert!(after.index > before.index);
        // The old leader comes back as a follower and catches up.
        c.start(old);
        let all = c.ids();
        c.wait_applied(&all, after.index, 10 * SEC).await;
        c.converged(&all, 10 * SEC).await;
        let tasks = c.node(old).read_local(|s| s.tasks().len());
        assert_eq!(tasks, 2);
        c.shutdown().await;
    }
}

#[tokio::test(start_paused = true)]
async fn minority_partition_cannot_commit_and_heals() {
    let c = Cluster::new(5, 7).await;
    let leader = c.leader().await;
    let others: Vec<u64> = c.ids().into_iter().filter(|&i| i != leader).collect();
    // The old leader plus one follower are the minority.
    let minority = vec![leader, others[0]];
    let majority: Vec<u64> = others[1..].to_vec();
    c.net.partition(&[minority.clone(), majority.clone()]);

    // The minority's proposal cannot commit: the caller hears it did not, or that
    // the outcome is unknown — never a success.
    let stuck = c.node(minority[1]).propose(submit(3));
    let majority_leader = c.leader_among(&majority, 10 * SEC).await;
    let ok = c
        .node(majority_leader)
        .propose(submit(5))
        .await
        .expect("majority commits");
    match stuck.await {
        Err(ConsensusError::OutcomeUnknown { .. })
        | Err(ConsensusError::NoLeader)
        | Err(ConsensusError::ProposalDropped { .. }) => {}
        other => panic!("minority proposal must not succeed: {other:?}"),
    }
    for &id in &minority {
        let st = c.status(id).await;
        assert!(
            st.commit_index < ok.index,
            "minority node {id} committed: {st:?}"
        );
        assert_ne!(st.role, RaftRole::Leader, "an isolated leader steps down");
    }

    c.net.heal();
    let all = c.ids();
    c.wait_applied(&all, ok.index, 10 * SEC).await;
    c.converged(&all, 10 * SEC).await;
    c.shutdown().await;
}

/// A snapshot every 20 entries, 5 kept behind it.
fn small_snapshots(id: u64) -> gpumesh_consensus::ReplicaConfig {
    let mut c = test_config(id);
    c.snapshot_interval = 20;
    c.log_retain = 5;
    c
}

/// Sixty submits through `leader`, one after another; the index of the last.
async fn submit_60(c: &Cluster, leader: u64) -> u64 {
    let mut last = 0;
    for i in 0..60 {
        last = c
            .node(leader)
            .propose(submit(i + 1))
            .await
            .expect("submit")
            .index;
    }
    last
}

#[tokio::test(start_paused = true)]
async fn lagging_follower_catches_up_through_a_snapshot() {
    let c = Cluster::with(3, 3, small_snapshots, 5).await;
    let leader = c.leader().await;
    let lagger = c
        .ids()
        .into_iter()
        .find(|&i| i != leader)
        .expect("follower");
    let mut events = c.node(lagger).subscribe();
    c.net.isolate(lagger, &c.ids());
    let last = submit_60(&c, leader).await;
    // The snapshot's files are written off the replica's task: the log is
    // compacted once they are.
    let lagging = c.status(lagger).await.last_index;
    let compacted = eventually(10 * SEC, || async {
        let st = c.status(leader).await;
        (st.first_index > lagging).then_some(())
    })
    .await;
    assert!(
        compacted.is_some(),
        "log was compacted: {:?}",
        c.status(leader).await
    );
    c.net.heal();
    let all = c.ids();
    c.wait_applied(&all, last, 10 * SEC).await;
    c.converged(&all, 10 * SEC).await;
    let mut restored = false;
    while let Ok(e) = events.try_recv() {
        if matches!(e, gpumesh_consensus::AppliedEvent::Restored { .. }) {
            restored = true;
        }
    }
    assert!(restored, "the lagging follower installed a snapshot");
    // And it survives a restart from that snapshot.
    c.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_snapshot_that_cannot_be_written_leaves_the_replica_serving_and_is_tried_again() {
    let mut c = Cluster::with(3, 11, small_snapshots, 5).await;
    let leader = c.leader().await;
    let follower = c
        .ids()
        .into_iter()
        .find(|&i| i != leader)
        .expect("follower");
    // Its next two snapshots find no room for their files; its log appends do.
    c.crash(follower).await;
    c.start_with(follower, |s| s.fail_snapshot_writes(2));
    let last = submit_60(&c, leader).await;
    let all = c.ids();
    // It applies everything, its log whole where the leader's is compacted.
    c.wait_applied(&all, last, 10 * SEC).await;
    let compacted = eventually(10 * SEC, || async {
        (c.status(leader).await.first_index > 10).then_some(())
    })
    .await;
    assert!(compacted.is_some(), "leader: {:?}", c.status(leader).await);
    let st = c.status(follower).await;
    assert!(
        st.first_index <= 2 && st.snapshot_write_failures >= 1,
        "no snapshot of the follower's was named: {st:?}"
    );
    // Past its waits (1 s, then 2 s), more entries: its next snapshot is written.
    tokio::time::sleep(5 * SEC).await;
    let mut more = 0;
    for i in 0..60 {
        more = c
            .node(leader)
            .propose(submit(1000 + i))
            .await
            .expect("submit")
            .index;
    }
    c.wait_applied(&all, more, 10 * SEC).await;
    let caught_up = eventually(10 * SEC, || async {
        (c.status(follower).await.first_index > 10).then_some(())
    })
    .await;
    let st = c.status(follower).await;
    assert!(
        caught_up.is_some() && st.snapshot_write_failures == 2,
        "the follower compacted on a later try, after two failed: {st:?}"
    );
    c.converged(&all, 10 * SEC).await;
    // And it comes back from what it stored.
    c.crash(follower).await;
    c.start(follower);
    c.wait_applied(&all, more, 10 * SEC).await;
    c.converged(&all, 10 * SEC).await;
    c.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn the_log_is_compacted_once_it_holds_snapshot_bytes() {
    // Entries alone would never call for a snapshot here; only their bytes can.
    fn limited(id: u64, snapshot_bytes: u64) -> gpumesh_consensus::ReplicaConfig {
        let mut c = test_config(id);
        c.snapshot_interval = 1_000_000;
        c.snapshot_bytes = snapshot_bytes;
        c.log_retain = 5;
        c
    }
    async fn first_index_after_60(
        config: fn(u64) -> gpumesh_consensus::ReplicaConfig,
    ) -> (u64, u64) {
        let c = Cluster::with(3, 3, config, 5).await;
        let leader = c.leader().await;
        let last = submit_60(&c, leader).await;
        let all = c.ids();
        c.wait_applied(&all, last, 10 * SEC).await;
        // A snapshot's files are written off the replica's task: give one begun
        // by the last entries the time to be named.
        let _ = eventually(SEC, || async {
            (c.status(leader).await.first_index > 10).then_some(())
        })
        .await;
        let first = c.status(leader).await.first_index;
        c.shutdown().await;
        (first, last)
    }
    let (first, last) = first_index_after_60(|id| limited(id, 1 << 10)).await;
    assert!(
        first > 10 && first <= last,
        "compacted by bytes: first {first}, last {last}"
    );
    let (first, _) = first_index_after_60(|id| limited(id, 64 << 20)).await;
    assert!(
        first <= 2,
        "nothing compacted under the byte limit: first {first}"
    );
}

#[tokio::test(start_paused = true)]
async fn membership_add_promote_cap_and_remove() {
    // Two founders, cap 3 voters; nodes 3 and 4 join empty.
    let mut c = Cluster::with(2, 9, test_config, 3).await;
    let leader = c.leader().await;
    for id in [3u64, 4] {
        // A joining node starts with empty storage and waits for a snapshot.
        let storage = RedbStorage::open(c.path(id), CLUSTER).expect("open");
        assert!(!storage.is_initialized());
        let h =
            ConsensusHandle::start(test_config(id), storage, c.net.transport(id)).expect("start");
        c.net.register(h.clone());
        c.nodes.insert(id, h);
        let done = c
            .node(1)
            .add_learner(id, format!("peer-{id}"), None)
            .await
            .expect("add learner");
        assert_eq!(done.outcome, Outcome::Applied, "{done:?}");
    }
    // Auto-promotion fills the voter cap (3), the fourth stays a learner.
    let ok = eventually(10 * SEC, || async {
        let st = c.status(leader).await;
        (st.voters.len() == 3 && st.learners.len() == 1).then_some(st)
    })
    .await;
    let st = ok.expect("one learner promoted to the cap");
    let learner = st.learners[0];
    let roles = c
        .node(leader)
        .read_linearizable(|s| {
            s.members()
                .values()
                .map(|m| (m.raft_id, m.role))
                .collect::<Vec<_>>()
        })
        .await
        .expect("read");
    assert_eq!(roles.iter().filter(|(_, r)| *r == Role::Voter).count(), 3);
    // An explicit promotion past the cap is refused.
    let refused = c.node(2).promote(learner).await.expect("answered");
    assert!(
        matches!(refused.outcome, Outcome::Rejected(_)),
        "{refused:?}"
    );
    // Removing a voter makes room again.
    let victim = st
        .voters
        .iter()
        .copied()
        .find(|&v| v != leader)
        .expect("voter");
    let done = c.node(leader).remove(victim).await.expect("remove");
    assert_eq!(done.outcome, Outcome::Applied);
    c.crash(victim).await;
    let ok = eventually(10 * SEC, || async {
        let st = c.status(leader).await;
        (st.voters.len() == 3 && st.learners.is_empty() && !st.voters.contains(&victim))
            .then_some(())
    })
    .await;
    assert!(
        ok.is_some(),
        "the learner is promoted after the removal: {:?}",
        c.status(leader).await
    );
    let all = c.ids();
    c.converged(&all, 10 * SEC).await;
    c.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn linearizable_read_on_a_follower_sees_the_latest_commit() {
    let c = Cluster::new(3, 4).await;
    let leader = c.leader().await;
    let follower = c
        .ids()
        .into_iter()
        .find(|&i| i != leader)
        .expect("follower");
    // Slow links to the follower: a local read there may be stale, a linearizable
    // one may not.
    c.net.set_faults(faults(0.0, 0.0, (0, 30)));
    for i in 0..5 {
        let done = c.node(leader).propose(submit(i + 1)).await.expect("submit");
        let seen = c
            .node(follower)
            .read_linearizable(|s| s.applied_index())
            .await
            .expect("linearizable read");
        assert!(seen >= done.index, "read {seen} < committed {}", done.index);
    }
    // With the follower cut off, a linearizable read times out instead of lying.
    c.net.isolate(follower, &c.ids());
    let r = c
        .node(follower)
        .read_linearizable(|s| s.applied_index())
        .await;
    assert!(
        matches!(r, Err(ConsensusError::ReadTimeout { .. })),
        "{r:?}"
    );
    // A local read still answers, from what the follower applied before the cut.
    let local = c.node(follower).read_local(|s| s.applied_index());
    assert!(local > 0, "the follower applied nothing");
    c.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_proposal_on_a_replica_long_without_a_leader_is_answered_no_leader_in_an_election() {
    let c = Cluster::new(3, 9).await;
    let leader = c.leader().await;
    let follower = c
        .ids()
        .into_iter()
        .find(|&i| i != leader)
        .expect("follower");
    c.net.isolate(follower, &c.ids());
    // Long enough to have lost its leader and failed its elections (an election
    // timeout is 100 ms here, the proposal deadline 3 s).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let made = tokio::time::Instant::now();
    let r = c.node(follower).propose(submit(1)).await;
    let waited = made.elapsed();
    assert!(matches!(r, Err(ConsensusError::NoLeader)), "{r:?}");
    assert!(
        waited < Duration::from_millis(500),
        "answered after {waited:?}, not within about an election timeout"
    );
    // Healed, the same replica's proposals commit again.
    c.net.heal();
    c.leader().await;
    c.node(follower)
        .propose(submit(2))
        .await
        .expect("commits once healed");
    c.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn retry_with_the_same_request_id_applies_once() {
    let c = Cluster::new(3, 5).await;
    let leader = c.leader().await;
    let follower = c
        .ids()
        .into_iter()
        .find(|&i| i != leader)
        .expect("follower");
    let id = c.node(follower).new_request_id();
    let a = c
        .node(follower)
        .propose_with_id(id, submit(7))
        .await
        .expect("first");
    let b = c
        .node(leader)
        .propose_with_id(id, submit(7))
        .await
        .expect("retry elsewhere");
    assert_eq!(a, b);
    let n = c
        .node(leader)
        .read_linearizable(|s| s.tasks().len())
        .await
        .expect("read");
    assert_eq!(n, 1);
    c.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn malformed_frames_are_dropped_without_harm() {
    let c = Cluster::new(3, 6).await;
    let leader = c.leader().await;
    let garbage: Vec<Vec<u8>> = vec![
        vec![],
        b"GPMH".to_vec(),
        b"GPMH\x01\x00\xff\xff\xff\xff".to_vec(),
        b"not a frame at all".to_vec(),
        vec![0xff; 4096],
    ];
    for id in c.ids() {
        for g in &garbage {
            c.node(id)
                .receive(leader, g.clone())
                .await
                .expect("accepted for inspection");
        }
    }
    // A well-formed frame with a raft body that is not protobuf, and one claiming
    // another cluster.
    for body in [
        gpumesh_consensus::FrameBody::Raft(vec![0xde, 0xad, 0xbe, 0xef]),
        gpumesh_consensus::FrameBody::Raft(Vec::new()),
    ] {
        let frame = gpumesh_consensus::Frame {
            cluster: CLUSTER,
            from: leader,
            body,
        }
        .encode()
        .expect("encode");
        for id in c.ids() {
            c.node(id)
                .receive(leader, frame.clone())
                .await
                .expect("receive");
        }
    }
    let foreign = gpumesh_consensus::Frame {
        cluster: gpumesh_consensus::ClusterId(42),
        from: leader,
        body: gpumesh_consensus::FrameBody::Raft(Vec::new()),
    }
    .encode()
    .expect("encode");
    for id in c.ids() {
        c.node(id)
            .receive(leader, foreign.clone())
            .await
            .expect("receive");
    }
    // Still a working group.
    let done = c.node(leader).propose(submit(2)).await.expect("submit");
    let ids = c.ids();
    c.wait_applied(&ids, done.index, 5 * SEC).await;
    c.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_snapshot_whose_state_does_not_decode_is_dropped_and_the_log_kept() {
    use protobuf::Message as _;
    let c = Cluster::new(3, 7).await;
    let leader = c.leader().await;
    let done = c.node(leader).propose(submit(1)).await.expect("submit");
    let ids = c.ids();
    c.wait_applied(&ids, done.index, 5 * SEC).await;
    let follower = ids
        .iter()
        .copied()
        .find(|&i| i != leader)
        .expect("follower");
    let before = c.status(follower).await;
    // From the leader, in its term, far past the follower's log: a snapshot
    // raft-rs would adopt, its state bytes garbage.
    let mut snapshot = raft::eraftpb::Snapshot::default();
    snapshot.set_data(vec![0xa5; 4096].into());
    let meta = snapshot.mut_metadata();
    meta.index = before.last_index + 1000;
    meta.term = before.term;
    meta.mut_conf_state().voters = ids.clone();
    let mut msg = raft::eraftpb::Message::default();
    msg.set_msg_type(raft::eraftpb::MessageType::MsgSnapshot);
    msg.from = leader;
    msg.to = follower;
    msg.term = before.term;
    msg.set_snapshot(snapshot);
    let frame = gpumesh_consensus::Frame {
        cluster: CLUSTER,
        from: leader,
        body: gpumesh_consensus::FrameBody::Raft(msg.write_to_bytes().expect("encode")),
    }
    .encode()
    .expect("encode");
    c.node(follower)
        .receive(leader, frame)
        .await
        .expect("receive");
    // The follower keeps its log and goes on with the group.
    let done = c.node(leader).propose(submit(2)).await.expect("submit");
    c.wait_applied(&ids, done.index, 5 * SEC).await;
    let after = c.status(follower).await;
    assert_eq!(after.snapshot_index, before.snapshot_index, "{after:?}");
    assert!(after.last_index < before.last_index + 1000, "{after:?}");
    c.converged(&ids, 5 * SEC).await;
    c.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn founders_must_agree_and_storage_refuses_reinit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut s = RedbStorage::open(dir.path().join("a.redb"), CLUSTER).expect("open");
    s.initialize(&[(1, "p1".into())], ClusterSettings { max_voters: 5 })
        .expect("init");
    let again = s.initialize(&[(1, "p1".into())], ClusterSettings { max_voters: 5 });
    assert!(matches!(
        again,
        Err(ConsensusError::AlreadyInitialized { .. })
    ));
    let _ = Command::Heartbeat {
        raft_id: 1,
        at_ms: 0,
    };
}

#[tokio::test(start_paused = true)]
async fn a_proposal_lost_in_a_leader_change_is_reported_dropped_and_retried_once() {
    let c = Cluster::new(5, 21).await;
    let old = c.leader().await;
    let ids = c.ids();
    let f = ids.iter().copied().find(|&i| i != old).expect("follower");
    let others: Vec<u64> = ids
        .iter()
        .copied()
        .filter(|&i| i != old && i != f)
        .collect();
    // The old leader keeps only the follower `f`: together they are no quorum, so
    // what the old leader appends cannot commit; the other three elect a leader.
    for &o in &others {
        c.net.cut(old, o);
        c.net.cut(f, o);
    }
    let rid = c.node(f).new_request_id();
    let h = c.node(f).clone();
    let attempt = tokio::spawn(async move { h.propose_with_id(rid, submit(42)).await });
    let new = c.leader_among(&others, 10 * SEC).await;
    assert_ne!(new, old);
    // Commit something at the new leader so the old leader's entry is overwritten.
    c.node(new)
        .propose(submit(1))
        .await
        .expect("new leader commits");
    c.net.heal();
    let first = attempt.await.expect("task");
    eprintln!("proposal across the leader change: {first:?}");
    match &first {
        // The proposer was told for certain that its entry lost its slot...
        Err(ConsensusError::ProposalDropped { .. }) => {}
        // ...or could not tell in time (then a retry is the safe answer)...
        Err(ConsensusError::OutcomeUnknown { .. }) => {}
        // ...or it did commit (if the entry survived the change).
        Ok(done) => assert!(matches!(done.outcome, Outcome::TaskSubmitted { .. })),
        Err(e) => panic!("unexpected error: {e}"),
    }
    // Retrying with the same id applies it exactly once.
    let retry = c
        .node(f)
        .propose_with_id(rid, submit(42))
        .await
        .expect("retry");
    if let Ok(done) = &first {
        assert_eq!(done, &retry);
    }
    let all = c.ids();
    c.wait_applied(&all, retry.index, 10 * SEC).await;
    let count = c
        .node(new)
        .read_linearizable(move |s| s.tasks().filter(|t| t.request_id == rid).count())
        .await
        .expect("read");
    assert_eq!(count, 1);
    c.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn crashes_at_random_points_keep_acknowledged_state() {
    let mut c = Cluster::new(3, 31).await;
    let mut rng = gpumesh_consensus::sim::SplitMix64::new(31);
    let mut acked = Vec::new();
    for round in 0..12u32 {
        let victim = c.ids()[rng.range(0, 2) as usize];
        // Either abruptly between two rounds of the actor, or inside a Ready: the
        // storage fails at its k-th write (after a leader may have sent appends).
        if rng.chance(0.5) {
            c.crash(victim).await;
        } else {
            let k = rng.range(0, 3);
            c.crash(victim).await;
            c.start_failing(victim, Some(k));
        }
        let up: Vec<u64> = c.ids().into_iter().filter(|&i| i != victim).collect();
        for i in 0..3 {
            let via = up[rng.range(0, up.len() as u64 - 1) as usize];
            let rid = c.node(via).new_request_id();
            loop {
                match c
                    .node(via)
                    .propose_with_id(rid, submit(round * 10 + i + 1))
                    .await
                {
                    Ok(done) => {
                        acked.push((rid, done));
                        break;
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
        }
        c.crash(victim).await;
        c.start(victim);
    }
    let all = c.ids();
    let last = acked.last().expect("acked").1.index;
    c.wait_applied(&all, last, 10 * SEC).await;
    c.converged(&all, 10 * SEC).await;
    for id in all {
        let acked = acked.clone();
        let ok = c.node(id).read_local(move |s| {
            acked
                .iter()
                .all(|(rid, done)| s.outcome_of(rid).as_ref() == Some(done))
        });
        assert!(ok, "node {id} lost an acknowledged proposal");
    }
    c.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn leader_changes_and_proposal_outcomes_are_counted() {
    let mut c = Cluster::new(3, 31).await;
    let old = c.leader().await;
    for id in c.ids() {
        assert!(
            c.status(id).await.leader_changes >= 1,
            "replica {id} knows a leader"
        );
    }
    let follower = c.ids().into_iter().find(|&i| i != old).expect("a follower");
    let before = c.node(follower).proposal_counts();
    assert_eq!(before, ProposalCounts::default(), "nothing proposed yet");
    // Proposals of each committed kind, counted as the proposer sees them.
    let node = c.node(follower).clone();
    let mut expected = ProposalCounts::default();
    let cancel = |task| Command::TaskCancelled {
        task,
        reason: "test".into(),
    };
    let first = node.propose(submit(4)).await.expect("submit");
    let Outcome::TaskSubmitted { task } = first.outcome else {
        panic!("{first:?}")
    };
    let answers = [
        Ok(first),
        node.propose(cancel(task)).await,
        // Cancelled already: committed, without effect.
        node.propose(cancel(task)).await,
        // No such task: refused.
        node.propose(cancel(gpumesh_consensus::TaskId(999_999)))
            .await,
    ];
    for answer in answers {
        match answer {
            Ok(done) => match done.outcome {
                Outcome::Ignored(_) => expected.ignored += 1,
                Outcome::Rejected(_) => expected.rejected += 1,
                _ => expected.applied += 1,
            },
            Err(ConsensusError::OutcomeUnknown { .. }) => expected.unknown += 1,
            Err(_) => expected.dropped += 1,
        }
    }
    assert_eq!(node.proposal_counts(), expected);
    let each_kind = ProposalCounts {
        applied: 2,
        ignored: 1,
        rejected: 1,
        ..ProposalCounts::default()
    };
    assert_eq!(expected, each_kind);
    // A handle whose replica is gone: certainly not committed.
    let gone = c.node(old).clone();
    let seen_before = c.status(follower).await.leader_changes;
    c.crash(old).await;
    assert!(gone.propose(submit(1)).await.is_err());
    assert_eq!(gone.proposal_counts().dropped, 1);
    // The survivors elect another leader, and each counts the change.
    let rest = c.ids();
    let new = c.leader_among(&rest, 10 * SEC).await;
    assert_ne!(new, old);
    let after = c.status(follower).await.leader_changes;
    assert_eq!(after, seen_before + 1, "one change: {old} to {new}");
    c.shutdown().await;
}

/// Proposals through `through`, one after another, for `secs` seconds (paused time
/// advances with the cluster's ticks); how many.
async fn propose_for(c: &Cluster, through: &[u64], secs: u64) -> u32 {
    let until = tokio::time::Instant::now() + Duration::from_secs(secs);
    let mut n = 0;
    while tokio::time::Instant::now() < until {
        let id = through[n as usize % through.len()];
        c.node(id)
            .propose(submit(n % 64 + 1))
            .await
            .expect("submit");
        n += 1;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    n
}

#[tokio::test(start_paused = true)]
async fn leadership_moves_to_the_replica_that_proposes_most() {
    let c = Cluster::new(3, 41).await;
    let old = c.leader().await;
    let busy = c.ids().into_iter().find(|&i| i != old).expect("a follower");
    let changes = c.status(busy).await.leader_changes;
    // Every proposal through one follower: after a window of them, it leads.
    let n = propose_for(&c, &[busy], 3).await;
    assert!(n > 300, "{n} proposals");
    assert_eq!(
        c.status(busy).await.role,
        RaftRole::Leader,
        "after {n} proposals"
    );
    assert_eq!(c.leader_among(&c.ids(), SEC).await, busy);
    assert_eq!(
        c.status(busy).await.leader_changes,
        changes + 1,
        "leadership moved once"
    );
    // Every proposal went through and was applied once, on every replica.
    let ids = c.ids();
    let last = c.node(busy).propose(submit(1)).await.expect("submit").index;
    c.wait_applied(&ids, last, 5 * SEC).await;
    c.converged(&ids, 5 * SEC).await;
    assert_eq!(
        c.node(old).read_local(|s| s.tasks().len()),
        (n + 1) as usize
    );
    c.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn leadership_stays_put_under_an_even_workload_or_when_switched_off() {
    // Proposals spread over all three replicas: nobody's share is large enough.
    let c = Cluster::new(3, 43).await;
    let leader = c.leader().await;
    let changes = c.status(leader).await.leader_changes;
    propose_for(&c, &c.ids(), 3).await;
    assert_eq!(c.leader_among(&c.ids(), SEC).await, leader);
    assert_eq!(c.status(leader).await.leader_changes, changes);
    c.shutdown().await;

    // Switched off: one follower's proposals alone leave the leader where it is.
    fn unfollowing(id: u64) -> gpumesh_consensus::ReplicaConfig {
        let mut cfg = test_config(id);
        cfg.follow_workload = false;
        cfg
    }
    let c = Cluster::with(3, 47, unfollowing, 5).await;
    let leader = c.leader().await;
    let busy = c
        .ids()
        .into_iter()
        .find(|&i| i != leader)
        .expect("a follower");
    propose_for(&c, &[busy], 3).await;
    assert_eq!(c.leader_among(&c.ids(), SEC).await, leader);
    c.shutdown().await;
}

/// How long until `follower`'s applied index reached `index`, probing in
/// steps of 100 us of (paused) time; `None` if not within `within`.
async fn applied_after(
    c: &Cluster,
    follower: u64,
    index: u64,
    within: Duration,
) -> Option<Duration> {
    let start = tokio::time::Instant::now();
    while start.elapsed() <= within {
        if c.node(follower).read_local(|s| s.applied_index()) >= index {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_micros(100)).await;
    }
    None
}

/// A commit only its proposer acts on (a host's batch of calls sent to it, the host
/// leading) is not broadcast: followers learn of it with the next heartbeat, and a
/// linearizable read on one sees it at once. Any other commit reaches them with no
/// time passing. (Paused time: nothing advances the clock but timers, so "no time"
/// is exact, and the heartbeat is 20 ms of ticks away.)
#[tokio::test(start_paused = true)]
async fn followers_learn_of_a_commit_only_the_leader_acts_on_with_its_next_heartbeat() {
    let c = Cluster::new(3, 17).await;
    let leader = c.leader().await;
    let followers: Vec<u64> = c.ids().into_iter().filter(|&id| id != leader).collect();
    let recorded = |version: u64| Command::ActorCallsRan {
        name: "counter".into(),
        epoch: 1,
        node: leader,
        version,
        calls: Vec::new(),
        state: Vec::new(),
        inline: Vec::new(),
        backup: leader,
    };
    for round in 0..5u64 {
        let done = c.node(leader).propose(submit(1)).await.expect("submit");
        for &f in &followers {
            let at = applied_after(&c, f, done.index, SEC).await;
            assert_eq!(at, Some(Duration::ZERO), "round {round}: a submit on {f}");
        }

        let quiet = c
            .node(leader)
            .propose(recorded(round))
            .await
            .expect("calls");
        let at = applied_after(&c, followers[0], quiet.index, SEC).await;
        let at = at.unwrap_or_else(|| panic!("round {round}: never learnt of the commit"));
        assert!(at > Duration::ZERO, "round {round}: told at once");

        // The next one again, read through the other follower before any heartbeat.
        let quiet = c
            .node(leader)
            .propose(recorded(round))
            .await
            .expect("calls");
        let seen = c
            .node(followers[1])
            .read_linearizable(|s| s.applied_index())
            .await
            .expect("read");
        assert!(
            seen >= quiet.index,
            "round {round}: read {seen} < {}",
            quiet.index
        );
    }
}

/// A task of one shard submitted and assigned through `leader`, and its result of
/// 12,000 bytes (cycling through 0..`modulus`: carried in its entry) recorded;
/// the task, the result's blob, and its commit.
async fn carry_a_result(
    c: &Cluster,
    leader: u64,
    modulus: u32,
) -> (
    gpumesh_consensus::TaskId,
    gpumesh_protocol::BlobId,
    gpumesh_consensus::Committed,
) {
    let Outcome::TaskSubmitted { task } = c
        .node(leader)
        .propose(submit(4))
        .await
        .expect("submit")
        .outcome
    else {
        panic!("not submitted")
    };
    c.node(leader)
        .propose(Command::AssignShard {
            task,
            shard: 0,
            node: leader,
        })
        .await
        .expect("assign");
    let bytes: Vec<u8> = (0..12_000u32).map(|i| (i % modulus) as u8).collect();
    let blob = gpumesh_protocol::BlobId::of(&bytes);
    let result = c
        .node(leader)
        .propose(Command::ShardResult {
            task,
            shard: 0,
            epoch: 1,
            node: leader,
            blob,
            size: bytes.len() as u64,
            inline: Some(bytes),
        })
        .await
        .expect("result");
    assert_eq!(result.outcome, Outcome::Applied);
    (task, blob, result)
}

/// A blob store for carried results that records what was kept and what synced.
#[derive(Debug, Default)]
struct CarriedLog {
    kept: std::sync::Mutex<Vec<gpumesh_protocol::BlobId>>,
    durable: std::sync::Mutex<Vec<gpumesh_protocol::BlobId>>,
    /// While set, a keep fails as on a full disk.
    full: std::sync::atomic::AtomicBool,
}

/// Replica `id`'s config for the carried-result tests: a snapshot every 20 entries,
/// 5 kept behind it, its carried results in `stores`.
fn carrying(id: u64, stores: &[std::sync::Arc<CarriedLog>; 3]) -> gpumesh_consensus::ReplicaConfig {
    let mut c = test_config(id);
    c.snapshot_interval = 20;
    c.log_retain = 5;
    c.carried = Some(stores[id as usize - 1].clone());
    c
}

impl gpumesh_consensus::CarriedStore for CarriedLog {
    fn keep(&self, blob: gpumesh_protocol::BlobId, bytes: &[u8]) -> Result<(), String> {
        if self.full.load(std::sync::atomic::Ordering::SeqCst) {
            return Err("No space left on device (os error 28)".into());
        }
        assert!(blob.matches(bytes), "kept bytes that are not {blob}'s");
        let mut kept = self.kept.lock().expect("not poisoned");
        if !kept.contains(&blob) {
            kept.push(blob);
        }
        Ok(())
    }

    fn sync(&self) -> Result<(), String> {
        *self.durable.lock().expect("not poisoned") =
            self.kept.lock().expect("not poisoned").clone();
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn a_carried_result_is_stored_on_apply_and_synced_before_the_log_drops_it() {
    use std::sync::{Arc, OnceLock};
    static STORES: OnceLock<[Arc<CarriedLog>; 3]> = OnceLock::new();
    let stores = STORES.get_or_init(Default::default);
    let c = Cluster::with(
        3,
        5,
        |id| carrying(id, STORES.get_or_init(Default::default)),
        5,
    )
    .await;
    let leader = c.leader().await;
    let (task, blob, result) = carry_a_result(&c, leader, 253).await;
    let all = c.ids();
    c.wait_applied(&all, result.index, 10 * SEC).await;
    // Every replica stored it on applying it; the record names it without its bytes.
    for id in &all {
        let s = &stores[*id as usize - 1];
        assert_eq!(*s.kept.lock().unwrap(), [blob], "replica {id}");
        let (named, held) = c.node(*id).read_local(|s| {
            let t = s.task(task).expect("task");
            (t.shards[0].output.map(|o| o.blob), t.inline.len())
        });
        assert_eq!((named, held), (Some(blob), 0), "replica {id}'s record");
    }
    // More entries: each replica snapshots and compacts past the result's entry,
    // and had it synced first.
    let last = submit_60(&c, leader).await;
    c.wait_applied(&all, last, 10 * SEC).await;
    for id in &all {
        // Compacted once the snapshot's files, written off its task, are named.
        let _ = eventually(10 * SEC, || async {
            (c.status(*id).await.first_index > result.index).then_some(())
        })
        .await;
        let first = c.status(*id).await.first_index;
        assert!(first > result.index, "replica {id} compacted to {first}");
        let s = &stores[*id as usize - 1];
        assert_eq!(*s.durable.lock().unwrap(), [blob], "replica {id} synced it");
    }
    c.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_carried_result_that_finds_the_disk_full_is_stored_once_there_is_room() {
    use std::sync::atomic::Ordering;
    use std::sync::{Arc, OnceLock};
    static STORES: OnceLock<[Arc<CarriedLog>; 3]> = OnceLock::new();
    let stores = STORES.get_or_init(Default::default);
    let c = Cluster::with(
        3,
        6,
        |id| carrying(id, STORES.get_or_init(Default::default)),
        5,
    )
    .await;
    let leader = c.leader().await;
    let all = c.ids();
    for s in stores {
        s.full.store(true, Ordering::SeqCst);
    }
    let (_, blob, result) = carry_a_result(&c, leader, 251).await;
    // Past a snapshot's due point with the disk full: no replica stops, none
    // compacts past the entry (its log still holds the result), and nothing stored.
    let last = submit_60(&c, leader).await;
    c.wait_applied(&all, last, 10 * SEC).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    for id in &all {
        let st = c.status(*id).await;
        assert!(
            st.first_index <= result.index,
            "replica {id} compacted to {} with the result unstored",
            st.first_index
        );
        assert!(stores[*id as usize - 1].kept.lock().unwrap().is_empty());
    }
    c.node(leader)
        .propose(submit(99))
        .await
        .expect("still commits");
    // Room again: every replica stores it, and snapshots past it, synced.
    for s in stores {
        s.full.store(false, Ordering::SeqCst);
    }
    for id in &all {
        let s = &stores[*id as usize - 1];
        let _ = eventually(90 * SEC, || async {
            (c.status(*id).await.first_index > result.index).then_some(())
        })
        .await;
        assert_eq!(*s.kept.lock().unwrap(), [blob], "replica {id} stored it");
        assert_eq!(*s.durable.lock().unwrap(), [blob], "replica {id} synced it");
        assert!(
            c.status(*id).await.first_index > result.index,
            "replica {id}"
        );
    }
    c.shutdown().await;
}
