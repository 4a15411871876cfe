//! The deterministic state machine: tasks, shards and results, membership rules, and
//! snapshot/replay equivalence.

mod common;

use common::{spec, submit, Log};
use gpumesh_consensus::sim::SplitMix64;
use gpumesh_consensus::{
    Command, MergedOutput, Outcome, Ran, RequestId, Role, ShardState, StateMachine, TaskId,
    TaskStatus,
};
use gpumesh_protocol::BlobId;

fn result(task: TaskId, shard: u32, epoch: u32, node: u64, tag: &[u8]) -> Command {
    Command::ShardResult {
        task,
        shard,
        epoch,
        node,
        blob: BlobId::of(tag),
        size: tag.len() as u64,
        inline: None,
    }
}

#[test]
fn a_retried_submit_returns_the_same_task() {
    let mut log = Log::new();
    let id = RequestId::new(9, 1);
    let a = log.apply_as(id, submit(4));
    let b = log.apply_as(id, submit(4));
    assert_eq!(a, b);
    assert_eq!(log.sm.tasks().len(), 1);
    let Outcome::TaskSubmitted { task } = a else {
        panic!("{a:?}")
    };
    assert_eq!(log.sm.task_by_request(&id), Some(task));
    let t = log.sm.task(task).expect("task");
    assert_eq!(t.spec_hash, spec(4).hash().expect("hash"));
    assert_eq!(t.shards.len(), 2);
}

#[test]
fn first_valid_result_of_the_current_epoch_wins() {
    let mut log = Log::new();
    let Outcome::TaskSubmitted { task } = log.apply(submit(4)) else {
        panic!()
    };
    let assign = |node| Command::AssignShard {
        task,
        shard: 0,
        node,
    };
    assert_eq!(
        log.apply(assign(2)),
        Outcome::ShardAssigned {
            task,
            shard: 0,
            epoch: 1
        }
    );
    // Reassigned (e.g. node 2 looked dead): epoch 2 to node 3.
    assert_eq!(
        log.apply(Command::ReassignShard {
            task,
            shard: 0,
            epoch: 1,
            node: 3,
            reason: "down".into(),
        }),
        Outcome::ShardAssigned {
            task,
            shard: 0,
            epoch: 2
        }
    );
    // Node 2's late result for epoch 1 is stale.
    assert!(matches!(
        log.apply(result(task, 0, 1, 2, b"old")),
        Outcome::Ignored(_)
    ));
    // A result from a node that does not hold the current attempt is stale too.
    assert!(matches!(
        log.apply(result(task, 0, 2, 1, b"x")),
        Outcome::Ignored(_)
    ));
    assert_eq!(
        log.apply(Command::ShardStarted {
            task,
            shard: 0,
            epoch: 2,
            node: 3
        }),
        Outcome::Applied
    );
    assert_eq!(log.apply(result(task, 0, 2, 3, b"good")), Outcome::Applied);
    // A second result for the same epoch is ignored: the first wins.
    assert!(matches!(
        log.apply(result(task, 0, 2, 3, b"other")),
        Outcome::Ignored(_)
    ));
    let shard = &log.sm.task(task).expect("task").shards[0];
    assert_eq!(shard.state, ShardState::Done);
    assert_eq!(shard.output.expect("output").blob, BlobId::of(b"good"));
    assert_eq!(log.sm.task(task).expect("task").status, TaskStatus::Running);
    // A merge before every shard is done is ignored.
    let merged = Command::TaskMerged {
        task,
        outputs: vec![MergedOutput {
            binding: 1,
            blob: BlobId::of(b"merged"),
            size: 6,
            node: 1,
        }],
    };
    assert!(matches!(log.apply(merged.clone()), Outcome::Ignored(_)));
    // Finishing the other shard leaves the task to be merged.
    log.apply(Command::AssignShard {
        task,
        shard: 1,
        node: 1,
    });
    log.apply(result(task, 1, 1, 1, b"second"));
    assert_eq!(log.sm.task(task).expect("task").status, TaskStatus::Merging);
    // Assigning a shard that is done is ignored.
    assert!(matches!(log.apply(assign(1)), Outcome::Ignored(_)));
    // The merge completes it and records the outputs; a second merge changes nothing.
    assert_eq!(log.apply(merged.clone()), Outcome::Applied);
    let t = log.sm.task(task).expect("task");
    assert_eq!(t.status, TaskStatus::Completed);
    assert_eq!(t.outputs.len(), 1);
    assert_eq!(t.outputs[0].blob, BlobId::of(b"merged"));
    assert!(matches!(log.apply(merged), Outcome::Ignored(_)));
    assert!(matches!(
        log.apply(Command::MergeFailed {
            task,
            reason: "late".into()
        }),
        Outcome::Ignored(_)
    ));
}

#[test]
fn a_failed_merge_fails_the_task_with_its_reason_and_one_shard_needs_no_merge() {
    let mut log = Log::new();
    let task = log.submit(2);
    for shard in 0..2 {
        log.apply(Command::AssignShard {
            task,
            shard,
            node: 1,
        });
        log.apply(result(task, shard, 1, 1, &[shard as u8]));
    }
    assert_eq!(log.sm.task(task).expect("task").status, TaskStatus::Merging);
    assert_eq!(
        log.apply(Command::MergeFailed {
            task,
            reason: "conflict: binding 1, byte offset 0".into()
        }),
        Outcome::Applied
    );
    let t = log.sm.task(task).expect("task");
    assert!(matches!(&t.status, TaskStatus::Failed(r) if r.contains("conflict")));
    assert!(t.history.iter().any(|e| e.what.contains("merge failed")));
    // A task of one shard is complete with its shard's result.
    let one = log.submit(1);
    log.apply(Command::AssignShard {
        task: one,
        shard: 0,
        node: 1,
    });
    log.apply(result(one, 0, 1, 1, b"only"));
    let t = log.sm.task(one).expect("task");
    assert_eq!(t.status, TaskStatus::Completed);
    assert!(t.outputs.is_empty());
}

#[test]
fn results_for_shards_never_assigned_are_ignored_with_a_reason() {
    let mut log = Log::new();
    let Outcome::TaskSubmitted { task } = log.apply(submit(2)) else {
        panic!()
    };
    let before = log.sm.to_bytes().unwrap();
    let stray = [
        // Shard 0 exists but was never assigned to anyone.
        result(task, 0, 1, 2, b"unasked"),
        result(task, 0, 0, 2, b"unasked"),
        // Shard 7 of a 2-shard task.
        result(task, 7, 1, 2, b"no such shard"),
        // A task that does not exist.
        result(TaskId(task.0 + 1000), 0, 1, 2, b"no such task"),
        // A start for an attempt that was never made.
        Command::ShardStarted {
            task,
            shard: 1,
            epoch: 3,
            node: 2,
        },
    ];
    for command in stray {
        match log.apply(command.clone()) {
            Outcome::Ignored(why) | Outcome::Rejected(why) => {
                assert!(!why.is_empty(), "{command:?} was dropped without a reason")
            }
            other => panic!("{command:?} should be ignored, got {other:?}"),
        }
    }
    // Nothing changed but the applied index.
    let before = StateMachine::from_bytes(&before).unwrap();
    assert_eq!(
        log.sm.task(task).unwrap().shards,
        before.task(task).unwrap().shards
    );
    assert_eq!(log.sm.tasks().len(), before.tasks().len());
}

fn submit_with(replicas: u32, tolerance: Option<f32>) -> Command {
    let mut spec = spec(2);
    spec.options.replicas = replicas;
    spec.options.tolerance = tolerance;
    Command::SubmitTask {
        spec,
        submitter: "p1".into(),
        needs: None,
    }
}

#[test]
fn a_speculative_copy_races_the_straggler_and_the_first_result_wins() {
    let mut log = Log::new();
    let Outcome::TaskSubmitted { task } = log.apply(submit_with(1, None)) else {
        panic!()
    };
    log.apply(Command::AssignShard {
        task,
        shard: 0,
        node: 1,
    });
    // The copy goes beside the straggler, not instead of it.
    assert_eq!(
        log.apply(Command::AssignShard {
            task,
            shard: 0,
            node: 2
        }),
        Outcome::ShardAssigned {
            task,
            shard: 0,
            epoch: 2
        }
    );
    let sh = &log.sm.task(task).unwrap().shards[0];
    assert_eq!(sh.attempts.len(), 2);
    assert!(sh.attempts[1].speculative && !sh.attempts[0].speculative);
    // The same node cannot hold two attempts of one shard.
    assert!(matches!(
        log.apply(Command::AssignShard {
            task,
            shard: 0,
            node: 2
        }),
        Outcome::Ignored(_)
    ));
    assert_eq!(log.apply(result(task, 0, 2, 2, b"fast")), Outcome::Applied);
    let sh = &log.sm.task(task).unwrap().shards[0];
    assert_eq!(sh.output.unwrap().node, 2);
    assert!(
        sh.attempts.is_empty(),
        "the straggler's attempt is cancelled"
    );
    // The straggler's result, arriving later, is ignored.
    assert!(matches!(
        log.apply(result(task, 0, 1, 1, b"slow")),
        Outcome::Ignored(_)
    ));
    assert_eq!(
        log.sm.task(task).unwrap().shards[0].output.unwrap().blob,
        BlobId::of(b"fast")
    );
}

#[test]
fn replicas_that_agree_bit_for_bit_are_accepted_and_a_mismatch_asks_a_third_node() {
    let mut log = Log::new();
    let Outcome::TaskSubmitted { task } = log.apply(submit_with(2, None)) else {
        panic!()
    };
    let sh = |log: &Log, i: usize| log.sm.task(task).unwrap().shards[i].clone();
    assert_eq!(sh(&log, 0).wanted(), 2);
    // Shard 0: two nodes agree.
    log.apply(Command::AssignShard {
        task,
        shard: 0,
        node: 1,
    });
    log.apply(Command::AssignShard {
        task,
        shard: 0,
        node: 2,
    });
    assert_eq!(sh(&log, 0).wanted(), 0);
    assert!(
        !sh(&log, 0).attempts[1].speculative,
        "a replica is not speculative"
    );
    log.apply(result(task, 0, 1, 1, b"same"));
    assert_eq!(
        sh(&log, 0).state,
        ShardState::Assigned,
        "one result is not enough"
    );
    log.apply(result(task, 0, 2, 2, b"same"));
    assert_eq!(sh(&log, 0).state, ShardState::Done);
    // Shard 1: the two disagree; a third node breaks the tie.
    log.apply(Command::AssignShard {
        task,
        shard: 1,
        node: 1,
    });
    log.apply(Command::AssignShard {
        task,
        shard: 1,
        node: 2,
    });
    log.apply(result(task, 1, 1, 1, b"right"));
    log.apply(result(task, 1, 2, 2, b"wrong"));
    let t = log.sm.task(task).unwrap();
    assert_eq!(t.mismatches, 1);
    assert!(
        t.history.iter().any(|e| e.what.contains("disagree")),
        "{:?}",
        t.history
    );
    assert_eq!(sh(&log, 1).wanted(), 1);
    // Nodes that already answered are not asked again.
    assert!(matches!(
        log.apply(Command::AssignShard {
            task,
            shard: 1,
            node: 2
        }),
        Outcome::Ignored(_)
    ));
    log.apply(Command::AssignShard {
        task,
        shard: 1,
        node: 3,
    });
    log.apply(result(task, 1, 3, 3, b"right"));
    let t = log.sm.task(task).unwrap();
    assert_eq!(t.shards[1].output.unwrap().blob, BlobId::of(b"right"));
    assert_eq!(t.status, TaskStatus::Merging);
}

#[test]
fn float_replicas_wait_for_a_verdict_and_three_disagreeing_fail_the_task() {
    let mut log = Log::new();
    let Outcome::TaskSubmitted { task } = log.apply(submit_with(2, Some(1e-5))) else {
        panic!()
    };
    log.apply(Command::AssignShard {
        task,
        shard: 0,
        node: 1,
    });
    log.apply(Command::AssignShard {
        task,
        shard: 0,
        node: 2,
    });
    log.apply(result(task, 0, 1, 1, b"a"));
    log.apply(result(task, 0, 2, 2, b"b"));
    // Different bytes may still agree within the tolerance: the leader compares.
    assert_eq!(
        log.sm.task(task).unwrap().shards[0].state,
        ShardState::Verifying
    );
    log.apply(Command::ShardVerdict {
        task,
        shard: 0,
        agreeing: vec![1, 2],
    });
    let t = log.sm.task(task).unwrap();
    assert_eq!(t.shards[0].state, ShardState::Done);
    assert_eq!(t.mismatches, 0);
    // Shard 1: every replica disagrees with every other.
    for (node, epoch) in [(1, 1), (2, 2)] {
        log.apply(Command::AssignShard {
            task,
            shard: 1,
            node,
        });
        log.apply(result(task, 1, epoch, node, &[node as u8]));
    }
    log.apply(Command::ShardVerdict {
        task,
        shard: 1,
        agreeing: vec![1],
    });
    log.apply(Command::AssignShard {
        task,
        shard: 1,
        node: 3,
    });
    log.apply(result(task, 1, 3, 3, b"c"));
    log.apply(Command::ShardVerdict {
        task,
        shard: 1,
        agreeing: vec![3],
    });
    let t = log.sm.task(task).unwrap();
    assert_eq!(t.mismatches, 2);
    assert!(
        matches!(&t.status, TaskStatus::Failed(r) if r.contains("disagree")),
        "{:?}",
        t.status
    );
}

#[test]
fn failures_requeue_then_fail_the_task_and_cancel_stops_results() {
    let mut log = Log::new();
    let Outcome::TaskSubmitted { task } = log.apply(submit(4)) else {
        panic!()
    };
    for attempt in 1..=3 {
        log.apply(Command::AssignShard {
            task,
            shard: 0,
            node: 2,
        });
        assert_eq!(
            log.apply(Command::ShardFailed {
                task,
                shard: 0,
                epoch: attempt,
                node: 2,
                reason: "device lost".into()
            }),
            Outcome::Applied
        );
    }
    assert!(matches!(
        log.sm.task(task).expect("task").status,
        TaskStatus::Failed(_)
    ));

    let Outcome::TaskSubmitted { task } = log.apply(submit(8)) else {
        panic!()
    };
    log.apply(Command::AssignShard {
        task,
        shard: 0,
        node: 2,
    });
    assert_eq!(
        log.apply(Command::TaskCancelled {
            task,
            reason: "user".into()
        }),
        Outcome::Applied
    );
    assert!(matches!(
        log.apply(result(task, 0, 1, 2, b"late")),
        Outcome::Ignored(_)
    ));
    assert!(matches!(
        log.apply(Command::AssignShard {
            task: TaskId(999),
            shard: 0,
            node: 1
        }),
        Outcome::Rejected(_)
    ));
    // Invalid specs are rejected deterministically.
    let mut bad = spec(4);
    bad.shards = 0;
    assert!(matches!(
        log.apply(Command::SubmitTask {
            spec: bad,
            submitter: "t".into(),
            needs: None,
        }),
        Outcome::Rejected(_)
    ));
}

#[test]
fn membership_rules_hold_the_voter_cap() {
    let mut log = Log::new();
    let join = Command::NodeJoined {
        raft_id: 4,
        peer_id: "p4".into(),
        capability: None,
    };
    assert_eq!(log.sm.membership_verdict(&join), Ok(()));
    log.apply(join.clone());
    assert_eq!(log.sm.member(4).expect("member").role, Role::Learner);
    assert!(matches!(
        log.sm.membership_verdict(&join),
        Err(Outcome::Ignored(_))
    ));
    // Three voters is the cap here.
    assert!(matches!(
        log.sm
            .membership_verdict(&Command::NodePromoted { raft_id: 4 }),
        Err(Outcome::Rejected(_))
    ));
    log.apply(Command::NodeLeft { raft_id: 3 });
    assert_eq!(
        log.sm
            .membership_verdict(&Command::NodePromoted { raft_id: 4 }),
        Ok(())
    );
    log.apply(Command::Heartbeat {
        raft_id: 4,
        at_ms: 1234,
    });
    let hb = log
        .sm
        .member(4)
        .expect("member")
        .last_heartbeat
        .expect("hb");
    assert_eq!(hb.at_ms, 1234);
    assert!(matches!(
        log.apply(Command::Heartbeat {
            raft_id: 77,
            at_ms: 1
        }),
        Outcome::Rejected(_)
    ));
}

/// A random but valid-looking command stream over a few tasks and nodes.
fn random_command(rng: &mut SplitMix64, tasks: &[TaskId]) -> Command {
    let pick = |rng: &mut SplitMix64| {
        if tasks.is_empty() {
            TaskId(rng.range(0, 5))
        } else {
            tasks[rng.range(0, tasks.len() as u64 - 1) as usize]
        }
    };
    match rng.range(0, 8) {
        0 => submit(rng.range(1, 64) as u32),
        8 => {
            let mut one = spec(rng.range(1, 64) as u32);
            one.shards = 1;
            let bytes = rng.next_u64().to_le_bytes().to_vec();
            Command::TaskRan {
                spec: one,
                submitter: "p1".into(),
                node: rng.range(1, 3),
                ran: Box::new(Ran::Result {
                    blob: BlobId::of(&bytes),
                    size: bytes.len() as u64,
                    inline: Some(bytes),
                }),
            }
        }
        1 => Command::AssignShard {
            task: pick(rng),
            shard: rng.range(0, 2) as u32,
            node: rng.range(1, 4),
        },
        2 => Command::ShardStarted {
            task: pick(rng),
            shard: rng.range(0, 1) as u32,
            epoch: rng.range(0, 3) as u32,
            node: rng.range(1, 3),
        },
        3 => result(
            pick(rng),
            rng.range(0, 1) as u32,
            rng.range(0, 3) as u32,
            rng.range(1, 3),
            &rng.next_u64().to_le_bytes(),
        ),
        4 => Command::ShardFailed {
            task: pick(rng),
            shard: rng.range(0, 1) as u32,
            epoch: rng.range(0, 3) as u32,
            node: rng.range(1, 3),
            reason: "boom".into(),
        },
        5 if rng.range(0, 3) == 0 => Command::ForgetTask {
            task: pick(rng),
            results: Vec::new(),
        },
        5 => Command::TaskCancelled {
            task: pick(rng),
            reason: "r".into(),
        },
        6 => Command::Heartbeat {
            raft_id: rng.range(1, 4),
            at_ms: rng.next_u64() % 1_000_000,
        },
        _ => Command::NodeCapabilities {
            raft_id: rng.range(1, 3),
            capability: gpumesh_protocol::NodeCapability {
                gflops: rng.next_f64() * 100.0,
                gbps: rng.next_f64() * 10.0,
                ..common::capability()
            },
        },
    }
}

#[test]
fn a_state_restored_from_a_snapshot_equals_one_that_replayed_the_log() {
    for seed in 0..20u64 {
        let mut rng = SplitMix64::new(seed);
        let mut log = Log::new();
        let mut tasks = Vec::new();
        let mut snapshots = Vec::new();
        for i in 0..300 {
            let cmd = random_command(&mut rng, &tasks);
            // Some retries of earlier request ids, to exercise dedup in both paths.
            let outcome = if i % 17 == 5 && log.seq > 3 {
                let id = RequestId::new(1, rng.range(1, log.seq));
                log.apply_as(id, cmd)
            } else {
                log.apply(cmd)
            };
            if let Outcome::TaskSubmitted { task } = outcome {
                if !tasks.contains(&task) {
                    tasks.push(task);
                }
            }
            if i % 50 == 25 {
                // Also a copy, encoded only at the end (as a replica encodes one off
                // its task while it applies on): the record's changes since must not
                // reach it through the tasks it shares.
                let bytes = log.sm.to_bytes().expect("snapshot");
                snapshots.push((log.index, bytes, log.sm.for_encoding()));
            }
            // The index of live tasks the scheduler uses agrees with a full scan.
            let live: Vec<TaskId> = log.sm.active_tasks().map(|t| t.id).collect();
            let scanned: Vec<TaskId> = log
                .sm
                .tasks()
                .filter(|t| !t.status.is_terminal())
                .map(|t| t.id)
                .collect();
            assert_eq!(live, scanned, "seed {seed}, step {i}: active tasks");
        }
        for (at, bytes, copy) in snapshots {
            assert_eq!(
                copy.to_bytes().expect("the copy"),
                bytes,
                "seed {seed}: the copy taken at {at} changed"
            );
            let mut restored = StateMachine::from_bytes(&bytes).expect("restore");
            for (index, entry) in log.entries.iter().filter(|(i, _)| *i > at) {
                restored.apply(*index, 1, entry);
            }
            assert_eq!(
                restored, log.sm,
                "seed {seed}: snapshot at {at} + replay differs"
            );
        }
        // Replaying an entry twice (a restart that re-applies) changes nothing.
        let before = log.sm.clone();
        let (index, entry) = log.entries.last().cloned().expect("entries");
        log.sm.apply(index, 1, &entry);
        assert_eq!(before, log.sm);
    }
}

/// A record with one task whose shard 0 is assigned to node 2 (attempt epoch 1).
fn one_assigned_shard() -> (Log, TaskId) {
    let mut log = Log::new();
    let Outcome::TaskSubmitted { task } = log.apply(submit(4)) else {
        panic!()
    };
    log.apply(Command::AssignShard {
        task,
        shard: 0,
        node: 2,
    });
    (log, task)
}

#[test]
fn a_small_result_rides_in_its_entry_and_a_bad_one_is_refused() {
    let (mut log, task) = one_assigned_shard();
    let inline = |bytes: Vec<u8>, blob: BlobId| Command::ShardResult {
        task,
        shard: 0,
        epoch: 1,
        node: 2,
        blob,
        size: bytes.len() as u64,
        inline: Some(bytes),
    };
    // Bytes that are not the blob id's, or too many to ride in the log: refused.
    let wrong = inline(b"changes".to_vec(), BlobId::of(b"other"));
    assert!(matches!(log.apply(wrong), Outcome::Rejected(_)));
    let big = vec![7u8; gpumesh_consensus::MAX_CARRIED_RESULT + 1];
    let too_big = inline(big.clone(), BlobId::of(&big));
    assert!(matches!(log.apply(too_big), Outcome::Rejected(_)));
    assert_eq!(
        log.sm.task(task).unwrap().shards[0].state,
        ShardState::Assigned
    );
    // The right bytes: the result is accepted and its bytes are in the record.
    let bytes = b"the changed words".to_vec();
    let id = BlobId::of(&bytes);
    assert_eq!(log.apply(inline(bytes.clone(), id)), Outcome::Applied);
    let t = log.sm.task(task).unwrap();
    assert_eq!(t.shards[0].output.map(|o| o.blob), Some(id));
    assert_eq!(t.inline.get(&id), Some(&bytes));
}

#[test]
fn a_result_carried_in_its_entry_but_over_the_records_bound_is_not_kept_in_the_record() {
    let (mut log, task) = one_assigned_shard();
    let bytes: Vec<u8> = (0..gpumesh_consensus::MAX_CARRIED_RESULT)
        .map(|i| (i % 251) as u8)
        .collect();
    let id = BlobId::of(&bytes);
    let command = Command::ShardResult {
        task,
        shard: 0,
        epoch: 1,
        node: 2,
        blob: id,
        size: bytes.len() as u64,
        inline: Some(bytes.clone()),
    };
    // The entry names what each replica stores as a blob on applying it.
    assert_eq!(command.carried(), Some((id, &bytes[..])));
    assert_eq!(log.apply(command), Outcome::Applied);
    let t = log.sm.task(task).unwrap();
    assert_eq!(t.shards[0].output.map(|o| o.blob), Some(id));
    assert_eq!(t.shards[0].state, ShardState::Done);
    assert!(
        t.inline.is_empty(),
        "the record keeps {} bytes",
        bytes.len()
    );
    // One the record keeps is not named as carried.
    let small = Command::ShardResult {
        task,
        shard: 0,
        epoch: 1,
        node: 2,
        blob: BlobId::of(b"x"),
        size: 1,
        inline: Some(b"x".to_vec()),
    };
    assert_eq!(small.carried(), None);
}

#[test]
fn a_task_run_where_it_was_submitted_is_recorded_with_its_result_in_one_entry() {
    let mut log = Log::new();
    let mut one = spec(4);
    one.shards = 1;
    let ran = |spec: gpumesh_protocol::TaskSpec, node: u64, ran: Ran| Command::TaskRan {
        spec,
        submitter: "p2".into(),
        node,
        ran: Box::new(ran),
    };
    let bytes = b"the changed words".to_vec();
    let id = BlobId::of(&bytes);
    let good = Ran::Result {
        blob: id,
        size: bytes.len() as u64,
        inline: Some(bytes.clone()),
    };
    // Refused, and no task made: several shards, replicas, a non-member, bad bytes.
    assert!(matches!(
        log.apply(ran(spec(4), 2, good.clone())),
        Outcome::Rejected(_)
    ));
    let mut verified = one.clone();
    verified.options.replicas = 2;
    assert!(matches!(
        log.apply(ran(verified, 2, good.clone())),
        Outcome::Rejected(_)
    ));
    assert!(matches!(
        log.apply(ran(one.clone(), 9, good.clone())),
        Outcome::Rejected(_)
    ));
    let lying = Ran::Result {
        blob: BlobId::of(b"other"),
        size: bytes.len() as u64,
        inline: Some(bytes.clone()),
    };
    assert!(matches!(
        log.apply(ran(one.clone(), 2, lying)),
        Outcome::Rejected(_)
    ));
    assert_eq!(log.sm.tasks().len(), 0);

    // A result: the task is complete in this one entry, its bytes in the record, and
    // a retry with the same request id finds it (nothing runs again).
    let request = RequestId::new(7, 1);
    let first = log.apply_as(request, ran(one.clone(), 2, good.clone()));
    let Outcome::TaskSubmitted { task } = first else {
        panic!("{first:?}")
    };
    let t = log.sm.task(task).unwrap();
    assert_eq!(t.status, TaskStatus::Completed);
    assert_eq!(t.shards[0].output.map(|o| (o.blob, o.node)), Some((id, 2)));
    assert_eq!(t.inline.get(&id), Some(&bytes));
    assert!(t.shards[0].attempts.is_empty());
    assert!(!log.sm.active_tasks().any(|t| t.id == task));
    assert_eq!(log.apply_as(request, ran(one.clone(), 3, good)), first);
    assert_eq!(log.apply_as(request, submit(4)), first);
    assert_eq!(log.sm.tasks().len(), 1);

    // A failure that no retry fixes: the task is recorded failed, with the reason.
    let failed = log.apply(ran(one, 3, Ran::Failed("ran past its deadline".into())));
    let Outcome::TaskSubmitted { task } = failed else {
        panic!("{failed:?}")
    };
    let status = &log.sm.task(task).unwrap().status;
    assert!(
        matches!(status, TaskStatus::Failed(r) if r.contains("deadline")),
        "{status:?}"
    );
}

#[test]
fn the_record_forgets_the_oldest_finished_tasks_beyond_its_bound_and_never_a_live_one() {
    let mut log = Log::new();
    let live = match log.apply(submit(4)) {
        Outcome::TaskSubmitted { task } => task,
        other => panic!("{other:?}"),
    };
    let mut one = spec(4);
    one.shards = 1;
    let bytes = b"done".to_vec();
    let ran = || Command::TaskRan {
        spec: one.clone(),
        submitter: "p1".into(),
        node: 2,
        ran: Box::new(Ran::Result {
            blob: BlobId::of(&bytes),
            size: bytes.len() as u64,
            inline: Some(bytes.clone()),
        }),
    };
    let kept = gpumesh_consensus::KEPT_FINISHED_TASKS;
    let mut finished = Vec::new();
    for i in 0..kept + 3 {
        let request = RequestId::new(5, i as u64);
        match log.apply_as(request, ran()) {
            Outcome::TaskSubmitted { task } => finished.push((request, task)),
            other => panic!("{other:?}"),
        }
    }
    // The three oldest finished are gone, with their request ids; the live task
    // (older than all of them) and the newest `kept` stay.
    assert_eq!(log.sm.tasks().len(), kept + 1);
    assert!(
        log.sm.task(live).is_some(),
        "a live task is never forgotten"
    );
    for (request, task) in &finished[..3] {
        assert!(log.sm.task(*task).is_none());
        assert_eq!(log.sm.task_by_request(request), None);
    }
    for (request, task) in &finished[3..] {
        assert_eq!(log.sm.task_by_request(request), Some(*task));
    }
    // A state restored from a snapshot forgets the same from then on.
    let mut restored = StateMachine::from_bytes(&log.sm.to_bytes().unwrap()).unwrap();
    let request = RequestId::new(5, 1 << 40);
    log.apply_as(request, ran());
    let entry = gpumesh_consensus::LogEntry {
        origin: 1,
        request_id: request,
        command: ran(),
    };
    restored.apply(log.index, 1, &entry);
    assert_eq!(restored, log.sm);
    assert!(log.sm.task(finished[3].1).is_none());
}

#[test]
fn a_finished_task_is_forgotten_on_request_and_a_live_one_is_not() {
    let mut log = Log::new();
    let Outcome::TaskSubmitted { task } = log.apply(submit(4)) else {
        panic!()
    };
    let forget = |task| Command::ForgetTask {
        task,
        results: Vec::new(),
    };
    match log.apply(forget(task)) {
        Outcome::Rejected(why) => assert!(why.contains("cancel it first"), "{why}"),
        other => panic!("a live task forgotten: {other:?}"),
    }
    assert!(log.sm.task(task).is_some());
    log.apply(Command::TaskCancelled {
        task,
        reason: "user".into(),
    });
    let request = log.sm.task(task).unwrap().request_id;
    assert_eq!(log.apply(forget(task)), Outcome::Applied);
    assert!(log.sm.task(task).is_none());
    assert_eq!(log.sm.task_by_request(&request), None);
    assert!(log.sm.tasks().all(|t| t.id != task));
    match log.apply(forget(task)) {
        Outcome::Rejected(why) => assert!(why.starts_with("no task"), "{why}"),
        other => panic!("{other:?}"),
    }
    // The same from a snapshot on.
    let restored = StateMachine::from_bytes(&log.sm.to_bytes().unwrap()).unwrap();
    assert_eq!(restored, log.sm);
}

#[test]
fn a_task_with_inputs_leans_to_the_node_it_was_submitted_through_but_not_against_an_idler_one() {
    let mut log = Log::new();
    // Three like adapters whose measured speeds differ a little, as measurements do.
    for (node, gflops) in [(1, 10.2), (2, 10.0), (3, 9.9)] {
        let mut capability = common::capability();
        capability.gflops = gflops;
        log.apply(Command::NodeCapabilities {
            raft_id: node,
            capability,
        });
    }
    let with_input = || {
        let mut one = spec(4);
        one.shards = 1;
        one.bindings.push(gpumesh_protocol::BindingSpec {
            binding: 1,
            role: gpumesh_protocol::BindingRole::Input {
                blob: BlobId::of(b"uploaded through node 3"),
                size: 23,
            },
        });
        one
    };
    let mut seq = 100;
    let mut submit_through = |log: &mut Log, spec: gpumesh_protocol::TaskSpec| {
        seq += 1;
        let command = Command::SubmitTask {
            spec,
            submitter: "p3".into(),
            needs: None,
        };
        let Outcome::TaskSubmitted { task } = log.apply_from(3, RequestId::new(3, seq), command)
        else {
            panic!("not submitted")
        };
        let attempts = &log.sm.task(task).unwrap().shards[0].attempts;
        assert_eq!(attempts.len(), 1);
        attempts[0].node
    };
    // Idle: the inputs' node, though another measured faster.
    assert_eq!(submit_through(&mut log, with_input()), 3);
    // Without inputs the fastest idle node, wherever it was submitted.
    let mut plain = spec(4);
    plain.shards = 1;
    assert_eq!(submit_through(&mut log, plain), 1);
    // Nodes 1 and 3 busy with one each: node 2, idle, is clearly less busy.
    assert_eq!(submit_through(&mut log, with_input()), 2);
    // One each everywhere: a near tie, which the inputs' node wins.
    assert_eq!(submit_through(&mut log, with_input()), 3);
}
