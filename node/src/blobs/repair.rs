//! Second copies again after a member is lost: every blob is kept on two members
//! (the node that made it and one more), and a member that is down takes its copies
//! out of reach, a member removed for good (`gpumesh remove`, its machine lost)
//! takes them with it. Once a removal applies here, or a member has been down in
//! the record for `after` (`--repair-after`), each member makes sure that one other
//! running member holds each blob it stores that the record names (a `Replicate`,
//! which a member that holds it already answers at once), so every such blob is on
//! two running members again. A member that comes back then holds copies more than
//! two; they go with their blobs. A member that left by itself handed its blobs off
//! before; the pass then finds them all in place.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Duration;

use futures::StreamExt;
use gpumesh_consensus::{AppliedEvent, Command, ConsensusHandle, Outcome};
use tokio::sync::broadcast::error::RecvError;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::BlobsHandle;

/// How many blobs are checked at once.
const AT_ONCE: usize = 8;

/// How long a member may be down in the record before the others make the copies it
/// held again elsewhere.
pub const DEFAULT_REPAIR_AFTER: Duration = Duration::from_secs(300);

/// Runs until `cancel`: a pass over this node's blobs after each removal of another
/// member, and once per outage of a member down for `after`.
pub async fn run(
    blobs: BlobsHandle,
    consensus: ConsensusHandle,
    after: Duration,
    cancel: CancellationToken,
) {
    let me = consensus.id();
    let mut events = consensus.subscribe();
    let mut outages = Outages::default();
    let mut tick = tokio::time::interval(
        (after / 4).clamp(Duration::from_millis(100), Duration::from_secs(5)),
    );
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let why = tokio::select! {
            _ = cancel.cancelled() => return,
            event = events.recv() => match event {
                Ok(AppliedEvent::Entry { entry, committed, duplicate, .. }) => match &entry.command {
                    Command::NodeLeft { raft_id }
                        if *raft_id != me && !duplicate && committed.outcome == Outcome::Applied =>
                    {
                        format!("member {raft_id:x} was removed")
                    }
                    _ => continue,
                },
                Ok(AppliedEvent::Restored { .. }) | Err(RecvError::Lagged(_)) => continue,
                Err(RecvError::Closed) => return,
            },
            _ = tick.tick() => {
                let mut down = consensus.read_local(|s| s.down().clone());
                down.remove(&me);
                let due = outages.due(&down, Instant::now(), after);
                if due.is_empty() {
                    continue;
                }
                let names: Vec<String> = due.iter().map(|id| format!("{id:x}")).collect();
                format!("member(s) {} down for {after:?}", names.join(", "))
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            () = pass(&blobs, &why) => {}
        }
    }
}

/// When each member the record holds down went down, as this node saw it, and
/// which outages have had their pass.
#[derive(Debug, Default)]
struct Outages {
    since: HashMap<u64, Instant>,
    repaired: HashSet<u64>,
}

impl Outages {
    /// The members down (per `down`, the record's judgement now) for `after` whose
    /// outage has had no pass yet; they then count as repaired until they are up.
    fn due(&mut self, down: &BTreeSet<u64>, now: Instant, after: Duration) -> Vec<u64> {
        self.since.retain(|id, _| down.contains(id));
        self.repaired.retain(|id| down.contains(id));
        for id in down {
            self.since.entry(*id).or_insert(now);
        }
        let mut due: Vec<u64> = self
            .since
            .iter()
            .filter(|(id, at)| now.duration_since(**at) >= after && !self.repaired.contains(*id))
            .map(|(id, _)| *id)
            .collect();
        due.sort_unstable();
        self.repaired.extend(&due);
        due
    }
}

/// One other member for every blob stored here that the record names.
async fn pass(blobs: &BlobsHandle, why: &str) {
    let Ok(todo) = blobs.named_here().await else {
        return;
    };
    let mut done = futures::stream::iter(todo.iter().copied())
        .map(|id| async move { (id, blobs.ensure_copy(id).await) })
        .buffer_unordered(AT_ONCE);
    let mut failed = 0;
    while let Some((id, outcome)) = done.next().await {
        if let Err(e) = outcome {
            failed += 1;
            tracing::warn!(%id, error = %e, why, "no second copy of a blob after losing a member");
        }
    }
    tracing::info!(
        why,
        blobs = todo.len(),
        failed,
        "made sure another running member holds each blob here"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_is_due_once_it_lasts_and_again_only_after_the_member_was_back() {
        let after = Duration::from_secs(60);
        let t0 = Instant::now();
        let mut o = Outages::default();
        let down: BTreeSet<u64> = [7].into();
        assert!(o.due(&down, t0, after).is_empty(), "just down");
        assert!(o.due(&down, t0 + after / 2, after).is_empty());
        assert_eq!(o.due(&down, t0 + after, after), vec![7]);
        assert!(
            o.due(&down, t0 + after * 3, after).is_empty(),
            "once per outage"
        );
        // A second member down later has its own clock.
        let both: BTreeSet<u64> = [7, 9].into();
        let t1 = t0 + after * 3;
        assert!(o.due(&both, t1, after).is_empty());
        assert_eq!(o.due(&both, t1 + after, after), vec![9]);
        // Back up, then down again: a new outage.
        assert!(o.due(&BTreeSet::new(), t1 + after * 2, after).is_empty());
        let t2 = t1 + after * 3;
        assert!(o.due(&down, t2, after).is_empty());
        assert_eq!(o.due(&down, t2 + after, after), vec![7]);
    }
}
