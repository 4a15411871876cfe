//! The blob sweeper: removes the blobs this node stores that nothing needs any more,
//! so a mesh that runs for weeks does not fill its disks.
//!
//! Two ways in, both checked against the record as this node last applied it
//! ([`gpumesh_consensus::StateMachine::blobs_in_use`]): nothing the record names is
//! removed.
//! - Let go: an actor's state a call replaced (every version passes through an
//!   applied entry, so none is missed), the results of a task forgotten on
//!   request (and the outputs this node made from them, which the record never
//!   named). Removed `release_delay`
//!   after they were let go, unless used since.
//! - Unused: every blob that the record does not name and that nobody has used
//!   (written, fetched, looked for) for `keep_unused`: the results of tasks the
//!   record has forgotten, uploads never submitted, the outputs of actor calls it
//!   no longer remembers, anything let go before a restart. Looked for every
//!   `interval` (the first an `interval` after the node starts), while a leader is
//!   known and this node has applied all it knows committed.
//!
//! A blob is marked used whenever it is written or looked for
//! ([`BlobStore::has`]), under the same lock as the check and removal here, so a
//! blob that comes back into use as it is judged unused stays. A blob in a file of
//! its own is removed with its file; a small one's record in the store's pack is
//! no longer found, and the pack is compacted once such records come to
//! `compact_min_dead` bytes and half of the live ones
//! ([`BlobStore::compact_if_due`]).

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use gpumesh_consensus::{AppliedEvent, Command, ConsensusHandle, Outcome, StateMachine};
use gpumesh_protocol::BlobId;
use tokio::sync::broadcast::error::RecvError;
use tokio_util::sync::CancellationToken;

use super::store::Removal;
use super::BlobStore;
use crate::metrics::SweepMetrics;

/// Which of the two sweeps (see the module's documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sweep {
    LetGo,
    Unused,
}

impl Sweep {
    fn label(self) -> &'static str {
        match self {
            Sweep::LetGo => "let_go",
            Sweep::Unused => "unused",
        }
    }
}

/// When the sweeper removes what.
#[derive(Clone, Copy, Debug)]
pub struct SweepConfig {
    /// How long a blob no one uses and the record does not name is kept.
    pub keep_unused: Duration,
    /// How often every stored blob is looked at for that.
    pub interval: Duration,
    /// How long after it is let go a blob is removed.
    pub release_delay: Duration,
    /// Bytes of removed records the pack holds before it is compacted (and at
    /// least half as many as it holds live).
    pub compact_min_dead: u64,
}

impl Default for SweepConfig {
    fn default() -> Self {
        SweepConfig {
            keep_unused: Duration::from_secs(3600),
            interval: Duration::from_secs(60),
            release_delay: Duration::from_secs(30),
            compact_min_dead: 8 << 20,
        }
    }
}

/// Each actor's state blobs by binding, as the applied entries left them.
type States = HashMap<String, HashMap<u32, BlobId>>;

fn states_of(record: &StateMachine) -> States {
    record
        .actors()
        .map(|a| {
            let blobs = a
                .state
                .iter()
                .filter_map(|s| Some((s.buffer.binding, s.blob?)))
                .collect();
            (a.name.clone(), blobs)
        })
        .collect()
}

/// The actor and state blobs an entry leaves, if it changes an actor's state.
fn new_state(command: &Command) -> Option<(&str, Vec<(u32, BlobId)>)> {
    match command {
        Command::ActorCallDone { name, state, .. }
        | Command::ActorCallsDone { name, state, .. }
        | Command::ActorCallsRan { name, state, .. } => Some((name, state.clone())),
        Command::DeleteActor { name } => Some((name, Vec::new())),
        _ => None,
    }
}

/// Runs the sweeper until `cancel` fires.
pub async fn run(
    store: BlobStore,
    consensus: ConsensusHandle,
    outputs: std::sync::Arc<crate::outputs::ResultCache>,
    config: SweepConfig,
    metrics: SweepMetrics,
    cancel: CancellationToken,
) {
    let mut events = consensus.subscribe();
    let mut states = states_of(&consensus.read_local(StateMachine::clone));
    let mut release = tokio::time::interval(config.release_delay.min(Duration::from_secs(5)));
    // Not at once: a node that was away catches up with the record first (what it
    // missed may name blobs it holds).
    let mut unused = tokio::time::interval_at(
        tokio::time::Instant::now() + config.interval,
        config.interval,
    );
    let mut compact_failed = None;
    for tick in [&mut release, &mut unused] {
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    }
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            event = events.recv() => match event {
                Ok(AppliedEvent::Entry { entry, committed, duplicate, .. }) => {
                    // Only what the record took: a stale host's entry changes nothing.
                    if duplicate || committed.outcome != Outcome::Applied {
                        continue;
                    }
                    if let Command::ForgetTask { task, results } = &entry.command {
                        let made_here = outputs.forget(*task);
                        for blob in results.iter().chain(&made_here) {
                            store.release(*blob);
                        }
                        continue;
                    }
                    let Some((name, now)) = new_state(&entry.command) else {
                        continue;
                    };
                    let deleted = matches!(entry.command, Command::DeleteActor { .. });
                    if now.is_empty() && !deleted {
                        // A state held in the entry (and the record): no blob.
                        continue;
                    }
                    let now: HashMap<u32, BlobId> = now.into_iter().collect();
                    let before = if deleted {
                        states.remove(name)
                    } else {
                        states.insert(name.to_string(), now.clone())
                    };
                    for blob in before.into_iter().flat_map(|b| b.into_values()) {
                        if !now.values().any(|b| *b == blob) {
                            store.release(blob);
                        }
                    }
                }
                // A snapshot replaced the record, or entries went by unseen: start
                // again from the record (what was missed is left to the unused sweep).
                Ok(AppliedEvent::Restored { .. }) | Err(RecvError::Lagged(_)) => {
                    states = states_of(&consensus.read_local(StateMachine::clone));
                }
                Err(RecvError::Closed) => return,
            },
            _ = release.tick() => {
                let due = store.take_released(config.release_delay);
                if !due.is_empty() {
                    let since = SystemTime::now() - config.release_delay;
                    sweep(&store, &consensus, due, since, Sweep::LetGo, &metrics).await;
                    compact(&store, config.compact_min_dead, &metrics, &mut compact_failed).await;
                }
                erase(&store).await;
            }
            _ = unused.tick() => {
                // Only with the record current: a leader known and all it has
                // committed applied here.
                let st = consensus.watch_status().borrow().clone();
                if st.leader_id == 0 || st.applied_index < st.commit_index {
                    continue;
                }
                let store2 = store.clone();
                let Ok(Ok(all)) = tokio::task::spawn_blocking(move || store2.all_blobs()).await
                else {
                    continue;
                };
                let since = SystemTime::now() - config.keep_unused;
                sweep(&store, &consensus, all, since, Sweep::Unused, &metrics).await;
                compact(&store, config.compact_min_dead, &metrics, &mut compact_failed).await;
            }
        }
    }
}

/// Removes each of `candidates` the record does not name and nobody used since
/// `since`; says what it freed.
async fn sweep(
    store: &BlobStore,
    consensus: &ConsensusHandle,
    candidates: Vec<BlobId>,
    since: SystemTime,
    which: Sweep,
    metrics: &SweepMetrics,
) {
    // A copy shares every task and actor with the record (each behind its own
    // `Arc`): the replica waits only for the copy, not for the walk over it.
    let record = consensus.read_local(StateMachine::clone);
    let store = store.clone();
    let freed = tokio::task::spawn_blocking(move || {
        let in_use = record.blobs_in_use();
        let (mut blobs, mut bytes) = (0u64, 0u64);
        for id in candidates.iter().filter(|id| !in_use.contains(id)) {
            match store.remove_unused(id, since) {
                Removal::Removed(len) => {
                    blobs += 1;
                    bytes += len;
                }
                // Let go but used since (read, fetched): looked at again later.
                Removal::InUse if which == Sweep::LetGo => store.release(*id),
                Removal::InUse | Removal::Absent => {}
            }
        }
        (blobs, bytes)
    })
    .await;
    if let Ok((blobs, bytes)) = freed {
        if blobs > 0 {
            metrics.removed(which.label(), blobs, bytes);
            tracing::debug!(blobs, bytes, ?which, "removed blobs nothing needs");
        }
    }
}

/// After a compaction fails (a disk without room for the new file), the next is
/// tried no sooner than this: each try copies every live record first.
const COMPACT_RETRY: Duration = Duration::from_secs(600);

/// Compacts the store's pack if enough of it is dead (see
/// [`BlobStore::compact_if_due`]), off the runtime's threads; after a failure,
/// not again for [`COMPACT_RETRY`] (`failed` is when the last one failed).
/// How long a dead record of the pack keeps its bytes: far longer than a read that
/// found it before it died takes.
const ERASE_GRACE: Duration = Duration::from_secs(5);

/// Overwrites the pack's records dead for [`ERASE_GRACE`] (removed blobs' bytes).
async fn erase(store: &BlobStore) {
    let store = store.clone();
    match tokio::task::spawn_blocking(move || store.erase_dead(ERASE_GRACE)).await {
        Ok(Ok(0)) => {}
        Ok(Ok(n)) => tracing::debug!(records = n, "erased dead records of the blob pack"),
        Ok(Err(e)) => tracing::warn!(
            error = %e,
            "could not erase the blob pack's dead records (tried again in a few seconds)"
        ),
        Err(e) => tracing::warn!(error = %e, "erasing the blob pack's dead records panicked"),
    }
}

async fn compact(
    store: &BlobStore,
    min_dead: u64,
    metrics: &SweepMetrics,
    failed: &mut Option<tokio::time::Instant>,
) {
    if failed.is_some_and(|at| at.elapsed() < COMPACT_RETRY) {
        return;
    }
    let store = store.clone();
    let done = tokio::task::spawn_blocking(move || store.compact_if_due(min_dead)).await;
    match done {
        Ok(Ok(Some(c))) => {
            *failed = None;
            metrics.compacted(c.before.saturating_sub(c.after));
            tracing::debug!(
                before = c.before,
                after = c.after,
                kept = c.kept,
                dropped = c.dropped,
                "compacted the blob pack"
            );
        }
        Ok(Ok(None)) => {}
        Ok(Err(e)) => {
            *failed = Some(tokio::time::Instant::now());
            tracing::warn!(
                error = %e,
                retry_s = COMPACT_RETRY.as_secs(),
                "could not compact the blob pack (it is as it was; its removed blobs' \
                 space is given back once a compaction succeeds)"
            );
        }
        Err(e) => {
            *failed = Some(tokio::time::Instant::now());
            tracing::warn!(error = %e, "the blob pack's compaction panicked");
        }
    }
}
