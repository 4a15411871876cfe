//! GPU actors in the record: unique names, calls in log order, reports counted only
//! from the current host in order, moves under a new epoch, and state that survives a
//! snapshot.

mod common;

use common::Log;
use gpumesh_consensus::{
    ActorState, CallRan, CallResult, Command, MergedOutput, Outcome, RequestId, StateMachine,
    INLINE_STATE_BYTES, MAX_WAITING_CALLS,
};
use gpumesh_protocol::{
    ActorCall, BindingRole, BindingSpec, BlobId, Grid, ShaderSource, StateBuffer,
};

fn create(name: &str) -> Command {
    Command::CreateActor {
        name: name.into(),
        state: vec![ActorState {
            buffer: StateBuffer {
                binding: 0,
                size: 16,
            },
            blob: None,
        }],
        backend: None,
        creator: "p1".into(),
    }
}

fn call(param: u32) -> ActorCall {
    ActorCall {
        shader: ShaderSource::Wgsl("@compute @workgroup_size(1) fn main() {}".into()),
        entry_point: "main".into(),
        bindings: vec![BindingSpec {
            binding: 1,
            role: BindingRole::Param {
                data: param.to_le_bytes().to_vec(),
            },
        }],
        grid: Grid([1, 1, 1]),
        deadline_ms: None,
    }
}

fn queue(log: &mut Log, name: &str, param: u32) -> u64 {
    match log.apply(Command::CallActor {
        name: name.into(),
        call: call(param),
        caller: "p1".into(),
    }) {
        Outcome::CallQueued { seq } => seq,
        other => panic!("{other:?}"),
    }
}

fn done(name: &str, seq: u64, epoch: u32, node: u64, tag: &[u8]) -> Command {
    Command::ActorCallDone {
        name: name.into(),
        seq,
        epoch,
        node,
        state: vec![(0, BlobId::of(tag))],
        backup: if node == 1 { 2 } else { 1 },
        outputs: vec![MergedOutput {
            binding: 2,
            blob: BlobId::of(&[tag, b"-out"].concat()),
            size: 4,
            node,
        }],
    }
}

fn place(name: &str, epoch: u32, node: u64) -> Command {
    Command::PlaceActor {
        name: name.into(),
        epoch,
        node,
        reason: "test".into(),
    }
}

fn ignored(o: Outcome) -> String {
    match o {
        Outcome::Ignored(why) => why,
        other => panic!("expected Ignored, got {other:?}"),
    }
}

#[test]
fn names_are_unique_and_checked_and_a_deleted_name_is_free_again() {
    let mut log = Log::new();
    assert_eq!(log.apply(create("counter")), Outcome::Applied);
    match log.apply(create("counter")) {
        Outcome::Rejected(why) => assert!(why.contains("exists"), "{why}"),
        other => panic!("{other:?}"),
    }
    for bad in ["", "no spaces", "a/b"] {
        assert!(
            matches!(log.apply(create(bad)), Outcome::Rejected(_)),
            "{bad:?}"
        );
    }
    let mut odd = create("odd");
    if let Command::CreateActor { state, .. } = &mut odd {
        state[0].buffer.size = 6;
    }
    assert!(matches!(log.apply(odd), Outcome::Rejected(_)));
    assert_eq!(
        log.apply(Command::DeleteActor {
            name: "counter".into()
        }),
        Outcome::Applied
    );
    assert!(log.sm.actor("counter").is_none());
    assert!(matches!(
        log.apply(Command::CallActor {
            name: "counter".into(),
            call: call(1),
            caller: "p1".into(),
        }),
        Outcome::Rejected(_)
    ));
    assert_eq!(log.apply(create("counter")), Outcome::Applied);
}

#[test]
fn calls_run_in_log_order_and_only_the_hosts_report_of_the_next_call_counts() {
    let mut log = Log::new();
    log.apply(create("a"));
    // Calls queue before the actor has a host.
    let first = queue(&mut log, "a", 1);
    let second = queue(&mut log, "a", 2);
    assert_eq!((first, second), (1, 2));
    assert_eq!(log.apply(place("a", 0, 1)), Outcome::Applied);
    let a = log.sm.actor("a").unwrap();
    assert_eq!((a.host, a.epoch, a.moves), (Some(1), 1, 0));
    assert_eq!(a.next_call().map(|(seq, _)| seq), Some(1));

    // Out of order, from another node, or under an old epoch: nothing changes.
    assert!(ignored(log.apply(done("a", 2, 1, 1, b"x"))).contains("call 1 is the next"));
    assert!(ignored(log.apply(done("a", 1, 1, 2, b"x"))).contains("hosted by"));
    assert!(ignored(log.apply(done("a", 1, 0, 1, b"x"))).contains("epoch"));
    assert_eq!(log.sm.actor("a").unwrap().version, 0);

    assert_eq!(log.apply(done("a", 1, 1, 1, b"v1")), Outcome::Applied);
    let a = log.sm.actor("a").unwrap();
    assert_eq!(a.version, 1);
    assert_eq!(a.state[0].blob, Some(BlobId::of(b"v1")));
    assert_eq!(a.backup, Some(2));
    assert!(matches!(
        a.results.get(&1),
        Some(CallResult::Done { version: 1, .. })
    ));
    // The same report again changes nothing.
    assert!(ignored(log.apply(done("a", 1, 1, 1, b"v1"))).contains("call 2 is the next"));

    // A call that fails leaves the state as it was.
    assert_eq!(
        log.apply(Command::ActorCallFailed {
            name: "a".into(),
            seq: 2,
            epoch: 1,
            node: 1,
            reason: "deadline".into(),
        }),
        Outcome::Applied
    );
    let a = log.sm.actor("a").unwrap();
    assert_eq!(a.version, 1);
    assert_eq!(a.state[0].blob, Some(BlobId::of(b"v1")));
    assert!(
        matches!(a.results.get(&2), Some(CallResult::Failed { reason, .. }) if reason == "deadline")
    );
    assert!(a.pending.is_empty());
}

#[test]
fn a_moved_actor_ignores_its_old_host_and_keeps_its_state() {
    let mut log = Log::new();
    log.apply(create("m"));
    log.apply(place("m", 0, 1));
    let s1 = queue(&mut log, "m", 1);
    log.apply(done("m", s1, 1, 1, b"v1"));
    let s2 = queue(&mut log, "m", 2);
    // The host dies with call 2 unfinished: the actor moves to node 2, epoch 2.
    assert_eq!(log.apply(place("m", 1, 2)), Outcome::Applied);
    // A second move computed from the same view is stale.
    assert!(ignored(log.apply(place("m", 1, 3))).contains("placed already"));
    let m = log.sm.actor("m").unwrap();
    assert_eq!((m.host, m.epoch, m.moves, m.version), (Some(2), 2, 1, 1));
    assert_eq!(
        m.state[0].blob,
        Some(BlobId::of(b"v1")),
        "the last acknowledged state"
    );
    // The old host's late report is ignored; the new host runs call 2.
    assert!(ignored(log.apply(done("m", s2, 1, 1, b"late"))).contains("hosted by"));
    assert_eq!(log.apply(done("m", s2, 2, 2, b"v2")), Outcome::Applied);
    let m = log.sm.actor("m").unwrap();
    assert_eq!(m.version, 2);
    assert_eq!(m.state[0].blob, Some(BlobId::of(b"v2")));
    // Placing on a node that is not a member is refused.
    assert!(matches!(log.apply(place("m", 2, 99)), Outcome::Rejected(_)));
}

#[test]
fn a_retried_call_takes_no_second_place_in_line() {
    let mut log = Log::new();
    log.apply(create("r"));
    let id = RequestId::new(7, 1);
    let command = Command::CallActor {
        name: "r".into(),
        call: call(5),
        caller: "p1".into(),
    };
    let first = log.apply_as(id, command.clone());
    let again = log.apply_as(id, command);
    assert_eq!(first, Outcome::CallQueued { seq: 1 });
    assert_eq!(again, first);
    assert_eq!(log.sm.actor("r").unwrap().pending.len(), 1);
}

#[test]
fn a_call_that_binds_over_the_state_is_refused() {
    let mut log = Log::new();
    log.apply(create("s"));
    let mut over = call(1);
    over.bindings[0].binding = 0;
    match log.apply(Command::CallActor {
        name: "s".into(),
        call: over,
        caller: "p1".into(),
    }) {
        Outcome::Rejected(why) => assert!(why.contains("the actor's state"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(log.sm.actor("s").unwrap().next_seq, 1, "no number taken");
}

#[test]
fn actors_survive_a_snapshot() {
    let mut log = Log::new();
    log.apply(create("snap"));
    log.apply(place("snap", 0, 3));
    let s1 = queue(&mut log, "snap", 1);
    log.apply(done("snap", s1, 1, 3, b"v1"));
    queue(&mut log, "snap", 2);
    let restored = StateMachine::from_bytes(&log.sm.to_bytes().unwrap()).unwrap();
    assert_eq!(restored, log.sm);
    assert_eq!(restored.actor("snap").unwrap().pending.len(), 1);
}

#[test]
fn a_batch_of_calls_is_recorded_whole_in_order_or_not_at_all() {
    let mut log = Log::new();
    log.apply(create("b"));
    log.apply(place("b", 0, 1));
    for p in 1..=4 {
        queue(&mut log, "b", p);
    }
    // Each batch as run on the version the state is at when it is made.
    let batch = |version: u64, first: u64, epoch: u32, node: u64, ran: Vec<CallRan>| {
        Command::ActorCallsDone {
            name: "b".into(),
            epoch,
            node,
            version,
            first,
            ran,
            state: vec![(0, BlobId::of(b"after"))],
            inline: vec![],
            backup: 2,
        }
    };
    let ok = || CallRan::Done { outputs: vec![] };
    // Not the next call in line, not the host, not this epoch, past the waiting
    // calls, empty, or run on a version the state is not at: nothing is recorded.
    ignored(log.apply(batch(1, 1, 1, 1, vec![ok()])));
    ignored(log.apply(batch(0, 2, 1, 1, vec![ok()])));
    ignored(log.apply(batch(0, 1, 1, 3, vec![ok()])));
    ignored(log.apply(batch(0, 1, 0, 1, vec![ok()])));
    assert!(matches!(
        log.apply(batch(0, 1, 1, 1, vec![ok(); 5])),
        Outcome::Rejected(_)
    ));
    assert!(matches!(
        log.apply(batch(0, 1, 1, 1, vec![])),
        Outcome::Rejected(_)
    ));
    assert_eq!(log.sm.actor("b").unwrap().version, 0);
    assert_eq!(log.sm.actor("b").unwrap().pending.len(), 4);

    // Calls 1-3: two ran, one failed between them; the state is the batch's last.
    let three = vec![
        ok(),
        CallRan::Failed {
            reason: "too big".into(),
        },
        ok(),
    ];
    assert_eq!(log.apply(batch(0, 1, 1, 1, three)), Outcome::Applied);
    let a = log.sm.actor("b").unwrap();
    assert_eq!(a.version, 2);
    assert_eq!(a.state[0].blob, Some(BlobId::of(b"after")));
    assert_eq!(a.backup, Some(2));
    assert!(matches!(a.results[&1], CallResult::Done { version: 1, .. }));
    assert!(matches!(&a.results[&2], CallResult::Failed { reason, .. } if reason == "too big"));
    assert!(matches!(a.results[&3], CallResult::Done { version: 2, .. }));
    assert_eq!(a.next_call().map(|(s, _)| s), Some(4));
    // A replay of the same batch (a retried report) changes nothing.
    ignored(log.apply(batch(2, 1, 1, 1, vec![ok(); 3])));
    // A batch of failures leaves the state where it was.
    let failed = vec![CallRan::Failed {
        reason: "deadline".into(),
    }];
    let mut only = batch(2, 4, 1, 1, failed);
    if let Command::ActorCallsDone { state, .. } = &mut only {
        state.clear();
    }
    assert_eq!(log.apply(only), Outcome::Applied);
    let a = log.sm.actor("b").unwrap();
    assert_eq!(
        (a.version, a.state[0].blob),
        (2, Some(BlobId::of(b"after")))
    );
    assert!(a.pending.is_empty());
}

/// An actor whose state (one buffer of `size` bytes at binding 0) may be inline.
fn create_sized(name: &str, size: u64) -> Command {
    Command::CreateActor {
        name: name.into(),
        state: vec![ActorState {
            buffer: StateBuffer { binding: 0, size },
            blob: None,
        }],
        backend: None,
        creator: "p1".into(),
    }
}

/// A batch of calls sent to host `node`, run on `version`, leaving `bytes` inline.
fn sent(
    name: &str,
    (epoch, node): (u32, u64),
    version: u64,
    calls: Vec<(RequestId, CallRan)>,
    bytes: &[u8],
) -> Command {
    Command::ActorCallsRan {
        name: name.into(),
        epoch,
        node,
        version,
        calls,
        state: vec![(0, BlobId::of(bytes))],
        inline: vec![bytes.to_vec()],
        backup: node,
    }
}

#[test]
fn calls_sent_to_the_host_are_recorded_once_with_the_state_inline() {
    let mut log = Log::new();
    log.apply(create_sized("s", 16));
    log.apply(place("s", 0, 1));
    let ok = || CallRan::Done { outputs: vec![] };
    let id = |n| RequestId::new(77, n);
    let v2 = [2u8; 16];
    // From another node, under another epoch, or empty: nothing is recorded.
    ignored(log.apply(sent("s", (1, 2), 0, vec![(id(1), ok())], &v2)));
    ignored(log.apply(sent("s", (0, 1), 0, vec![(id(1), ok())], &v2)));
    assert!(matches!(
        log.apply(sent("s", (1, 1), 0, vec![], &v2)),
        Outcome::Rejected(_)
    ));
    // Bytes that are not the state reported, or not its size: refused.
    let mut lying = sent("s", (1, 1), 0, vec![(id(1), ok())], &v2);
    if let Command::ActorCallsRan { inline, .. } = &mut lying {
        inline[0][0] = 9;
    }
    assert!(matches!(log.apply(lying), Outcome::Rejected(_)));
    let short = [2u8; 8];
    assert!(matches!(
        log.apply(sent("s", (1, 1), 0, vec![(id(1), ok())], &short)),
        Outcome::Rejected(_)
    ));
    assert_eq!(log.sm.actor("s").unwrap().next_seq, 1, "no number taken");

    // Two ran and one failed between them: numbered in order, the state inline.
    let three = vec![
        (id(1), ok()),
        (
            id(2),
            CallRan::Failed {
                reason: "deadline".into(),
            },
        ),
        (id(3), ok()),
    ];
    assert_eq!(
        log.apply(sent("s", (1, 1), 0, three, &v2)),
        Outcome::Applied
    );
    let a = log.sm.actor("s").unwrap();
    assert_eq!((a.version, a.next_seq, a.backup), (2, 4, None));
    assert_eq!(a.inline_state(0), Some(&v2[..]));
    assert_eq!(a.state[0].blob, Some(BlobId::of(&v2)));
    assert!(matches!(a.results[&1], CallResult::Done { version: 1, .. }));
    assert!(matches!(a.results[&2], CallResult::Failed { .. }));
    assert!(matches!(a.results[&3], CallResult::Done { version: 2, .. }));
    // Each request id answers as if it had been queued: a retry through the queue
    // finds its number and makes no new call.
    assert_eq!(
        log.apply_as(
            id(3),
            Command::CallActor {
                name: "s".into(),
                call: call(3),
                caller: "p2".into(),
            }
        ),
        Outcome::CallQueued { seq: 3 }
    );
    assert!(log.sm.actor("s").unwrap().pending.is_empty());

    // The same batch again, or one run on a version the state has left: ignored.
    let v3 = [3u8; 16];
    ignored(log.apply(sent("s", (1, 1), 2, vec![(id(1), ok())], &v3)));
    ignored(log.apply(sent("s", (1, 1), 1, vec![(id(4), ok())], &v3)));
    // A call that went through the queue while the host ran it too: the batch
    // would run it twice, so it is ignored; the queued call runs first.
    assert_eq!(
        log.apply_as(
            id(5),
            Command::CallActor {
                name: "s".into(),
                call: call(5),
                caller: "p2".into(),
            }
        ),
        Outcome::CallQueued { seq: 4 }
    );
    let why = ignored(log.apply(sent("s", (1, 1), 2, vec![(id(5), ok())], &v3)));
    assert!(why.contains("twice"), "{why}");
    let why = ignored(log.apply(sent("s", (1, 1), 2, vec![(id(6), ok())], &v3)));
    assert!(why.contains("queued call 4"), "{why}");
    // A batch of the queued call run on the state before the sent batch below
    // was recorded is stale once it is: it would lose that batch's changes.
    let queued_on = |version: u64, bytes: &[u8]| Command::ActorCallsDone {
        name: "s".into(),
        epoch: 1,
        node: 1,
        version,
        first: 4,
        ran: vec![ok()],
        state: vec![(0, BlobId::of(bytes))],
        inline: vec![bytes.to_vec()],
        backup: 1,
    };
    let stale = queued_on(1, &[9u8; 16]);
    let why = ignored(log.apply(stale));
    assert!(why.contains("version 1"), "{why}");
    let queued = Command::ActorCallsDone {
        name: "s".into(),
        epoch: 1,
        node: 1,
        version: 2,
        first: 4,
        ran: vec![ok()],
        state: vec![(0, BlobId::of(&v3))],
        inline: vec![v3.to_vec()],
        backup: 1,
    };
    assert_eq!(log.apply(queued), Outcome::Applied);
    let v4 = [4u8; 16];
    assert_eq!(
        log.apply(sent("s", (1, 1), 3, vec![(id(6), ok())], &v4)),
        Outcome::Applied
    );
    let a = log.sm.actor("s").unwrap();
    assert_eq!((a.version, a.next_seq), (4, 6));
    assert_eq!(a.inline_state(0), Some(&v4[..]));

    // The bytes survive a snapshot.
    let restored = StateMachine::from_bytes(&log.sm.to_bytes().unwrap()).unwrap();
    assert_eq!(restored, log.sm);
    assert_eq!(restored.actor("s").unwrap().inline_state(0), Some(&v4[..]));
}

#[test]
fn a_state_over_the_inline_bound_is_never_held_by_the_record() {
    let mut log = Log::new();
    let size = INLINE_STATE_BYTES + 4;
    log.apply(create_sized("big", size));
    log.apply(place("big", 0, 1));
    let bytes = vec![1u8; size as usize];
    let ok = CallRan::Done { outputs: vec![] };
    let why = match log.apply(sent(
        "big",
        (1, 1),
        0,
        vec![(RequestId::new(5, 1), ok.clone())],
        &bytes,
    )) {
        Outcome::Rejected(why) => why,
        other => panic!("{other:?}"),
    };
    assert!(why.contains("does not hold it"), "{why}");
    // Reported as a blob with its second copy, it is recorded.
    let mut blob = sent("big", (1, 1), 0, vec![(RequestId::new(5, 1), ok)], &bytes);
    if let Command::ActorCallsRan { inline, backup, .. } = &mut blob {
        inline.clear();
        *backup = 2;
    }
    assert_eq!(log.apply(blob), Outcome::Applied);
    let a = log.sm.actor("big").unwrap();
    assert_eq!((a.version, a.backup, a.inline_state(0)), (1, Some(2), None));
}

#[test]
fn calls_waiting_in_the_record_are_capped_per_actor_and_a_retry_still_finds_its_call() {
    let mut log = Log::new();
    log.apply(create("full"));
    log.apply(create("other"));
    // No host yet: every call waits in the record.
    let first = RequestId::new(9, 0);
    let call = |name: &str| Command::CallActor {
        name: name.into(),
        call: call(1),
        caller: "p1".into(),
    };
    assert_eq!(
        log.apply_as(first, call("full")),
        Outcome::CallQueued { seq: 1 }
    );
    for _ in 1..MAX_WAITING_CALLS {
        assert!(matches!(
            log.apply(call("full")),
            Outcome::CallQueued { .. }
        ));
    }
    match log.apply(call("full")) {
        Outcome::Rejected(why) => assert!(why.contains("calls waiting to run"), "{why}"),
        other => panic!("{other:?}"),
    }
    let a = log.sm.actor("full").unwrap();
    assert_eq!(a.pending.len(), MAX_WAITING_CALLS);
    assert_eq!(a.next_seq, MAX_WAITING_CALLS as u64 + 1, "no number taken");
    // A retry of a call already waiting finds it; another actor is not held back.
    assert_eq!(
        log.apply_as(first, call("full")),
        Outcome::CallQueued { seq: 1 }
    );
    assert_eq!(log.apply(call("other")), Outcome::CallQueued { seq: 1 });
    // Once some have run, calls are taken again.
    log.apply(place("full", 0, 1));
    let batch = Command::ActorCallsDone {
        name: "full".into(),
        epoch: 1,
        node: 1,
        version: 0,
        first: 1,
        ran: vec![CallRan::Done { outputs: vec![] }; 16],
        state: vec![(0, BlobId::of(&[1u8; 16]))],
        inline: vec![vec![1u8; 16]],
        backup: 1,
    };
    assert_eq!(log.apply(batch), Outcome::Applied);
    assert!(matches!(
        log.apply(call("full")),
        Outcome::CallQueued { .. }
    ));
}

/// The hosts and queues the record indexes, as every actor in it says.
fn indexes_agree_with_the_actors(sm: &StateMachine) {
    let mut hosts: std::collections::BTreeMap<Option<u64>, Vec<String>> = Default::default();
    for a in sm.actors() {
        hosts.entry(a.host).or_default().push(a.name.clone());
    }
    let indexed: Vec<(Option<u64>, usize)> = sm.actor_hosts().collect();
    let counted: Vec<(Option<u64>, usize)> = hosts.iter().map(|(h, n)| (*h, n.len())).collect();
    assert_eq!(indexed, counted);
    for (host, names) in &hosts {
        let listed: Vec<String> = sm.actors_hosted_by(*host).map(|a| a.name.clone()).collect();
        assert_eq!(&listed, names, "host {host:?}");
    }
    let queued: Vec<&str> = sm
        .actors()
        .filter(|a| !a.pending.is_empty())
        .map(|a| a.name.as_str())
        .collect();
    let listed: Vec<&str> = sm
        .actors_with_queued_calls()
        .map(|a| a.name.as_str())
        .collect();
    assert_eq!(listed, queued);
}

#[test]
fn the_hosts_and_queues_indexed_follow_every_change_and_a_snapshot() {
    let mut log = Log::new();
    // A fixed pseudo-random walk over five actors and three nodes: creates, moves,
    // calls queued, results from the host and from others, deletes.
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let mut copies = Vec::new();
    for step in 0..600 {
        let name = format!("a{}", next(5));
        let node = 1 + next(3);
        let actor = log.sm.actor(&name).cloned();
        let command = match (next(6), actor) {
            (_, None) => create(&name),
            (0, Some(a)) => place(&name, a.epoch, node),
            (1 | 2, Some(_)) => Command::CallActor {
                name: name.clone(),
                call: call(step),
                caller: "p1".into(),
            },
            (3 | 4, Some(a)) => match (a.next_call(), a.host) {
                (Some((seq, _)), Some(host)) => {
                    done(&name, seq, a.epoch, host, &step.to_le_bytes())
                }
                _ => place(&name, a.epoch, node),
            },
            (_, Some(_)) => Command::DeleteActor { name: name.clone() },
        };
        log.apply(command);
        indexes_agree_with_the_actors(&log.sm);
        if step % 50 == 0 {
            let bytes = log.sm.to_bytes().unwrap();
            let restored = StateMachine::from_bytes(&bytes).unwrap();
            assert_eq!(restored, log.sm, "step {step}");
            // A copy for encoding off the replica's task shares the actors: the
            // changes after it must not reach it.
            copies.push((step, bytes, log.sm.for_encoding()));
        }
    }
    for (step, bytes, copy) in copies {
        assert_eq!(
            copy.to_bytes().unwrap(),
            bytes,
            "the copy taken at step {step}"
        );
    }
    assert!(log.sm.actors_with_queued_calls().count() > 0);
    assert!(log.sm.actor_hosts().count() > 1);
}
