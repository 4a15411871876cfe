//! A member that was removed while it could not hear (`gpumesh remove` of a node
//! that was down, or cut off): its leader stops sending to it once the removal
//! commits, so it never applies its own removal, hears no leader again, and would
//! campaign unheard for ever, its API answering 503.
//!
//! While it hears no leader, a member asks the other members its record names
//! whether it is still one ([`NodeRequest::Membership`]). An answer that it is not,
//! from a node that has applied the entry that made it a member, means a removal
//! was committed after that entry: a member's id never comes back (a node that
//! joins again does so on a new data dir, as a new id). The node then marks its
//! data dir as one that left ([`super::leave`]'s mark, saying how) and stops,
//! saying so; started again on that dir it is refused, as a node that left is.
//!
//! An answer from a node that has not applied that entry (a learner catching up)
//! proves nothing, and neither does silence: a member cut off from its mesh, or
//! one whose quorum is down, keeps waiting, as it should.

use std::path::PathBuf;
use std::time::Duration;

use futures::StreamExt;
use gpumesh_consensus::{ClusterId, ConsensusHandle};
use libp2p::PeerId;
use tokio_util::sync::CancellationToken;

use crate::net::NetHandle;
use crate::wire::{self, NodeReply, NodeRequest};

/// How long a member hears no leader before it asks whether it is still one.
const LEADERLESS: Duration = Duration::from_secs(2);
/// How long it waits after asking before it looks again (and, hearing no leader
/// for [`LEADERLESS`] more, asks again: every 5 s or so).
const ASK_EVERY: Duration = Duration::from_secs(3);
/// How long one peer has to answer.
const ANSWER_WAIT: Duration = Duration::from_secs(2);

/// Why a node stopped itself; read by whoever runs it once [`Watch::left`] fires.
pub(crate) type Removal = std::sync::Arc<std::sync::OnceLock<String>>;

pub(super) struct Watch {
    pub consensus: ConsensusHandle,
    pub net: NetHandle,
    pub cluster: ClusterId,
    pub data_dir: PathBuf,
    /// Cancelled when this node has left or was found removed.
    pub left: CancellationToken,
    pub removal: Removal,
}

impl Watch {
    pub async fn run(self, cancel: CancellationToken) {
        let mut status = self.consensus.watch_status();
        loop {
            // Wait for a leaderless spell of LEADERLESS.
            let leaderless = async {
                loop {
                    if status.borrow_and_update().leader_id == 0 {
                        let still = tokio::time::timeout(LEADERLESS, async {
                            while status.changed().await.is_ok() {
                                if status.borrow_and_update().leader_id != 0 {
                                    return;
                                }
                            }
                            std::future::pending::<()>().await;
                        })
                        .await
                        .is_err();
                        if still {
                            return;
                        }
                    } else if status.changed().await.is_err() {
                        std::future::pending::<()>().await;
                    }
                }
            };
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = self.left.cancelled() => return,
                () = leaderless => {}
            }
            if let Some(why) = self.ask().await {
                self.stop_removed(why);
                return;
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = self.left.cancelled() => return,
                () = tokio::time::sleep(ASK_EVERY) => {}
            }
        }
    }

    /// Asks every other member this node's record names; why it is no longer a
    /// member if one answers so with authority.
    async fn ask(&self) -> Option<String> {
        let me = self.consensus.id();
        let (joined, others) = self.consensus.read_local(move |s| {
            let joined = s.member(me).map(|m| m.joined_index);
            let others: Vec<String> = s
                .members()
                .values()
                .filter(|m| m.raft_id != me)
                .map(|m| m.peer_id.clone())
                .collect();
            (joined, others)
        });
        // Not in its own record: still joining (or leaving); nothing to ask.
        let joined = joined?;
        let others: Vec<PeerId> = others.iter().filter_map(|p| p.parse().ok()).collect();
        tracing::debug!(
            asked = others.len(),
            "no leader heard: asking the members whether this node still is one"
        );
        let mut answers = futures::stream::iter(others)
            .map(|peer| async move {
                let answer = tokio::time::timeout(
                    ANSWER_WAIT,
                    wire::call(&self.net, peer, &NodeRequest::Membership),
                )
                .await;
                (peer, answer)
            })
            .buffer_unordered(8);
        while let Some((peer, answer)) = answers.next().await {
            let Ok(Ok(NodeReply::Membership {
                cluster,
                applied,
                member,
            })) = answer
            else {
                continue;
            };
            if removed(self.cluster, joined, cluster, applied, member) {
                return Some(format!(
                    "member {peer} has applied this node's removal (gpumesh remove, done while \
                     this node was down or cut off)"
                ));
            }
        }
        None
    }

    fn stop_removed(&self, why: String) {
        if let Err(e) = super::leave::mark_left(&self.data_dir, self.cluster, Some(&why)) {
            tracing::warn!(error = %e, "could not mark the data dir of a removed node");
        }
        tracing::warn!(%why, "this node is no longer a member of its mesh; stopping");
        let _ = self.removal.set(why);
        self.left.cancel();
    }
}

/// Whether an answer (`cluster`, `applied`, `member`) proves that this node, made a
/// member of mesh `ours` by the entry at `joined` (0 for a founder, which the
/// mesh's first snapshot, at index 1, holds), was removed since. A node that has
/// applied nothing (a joiner before its first snapshot) knows no member.
fn removed(ours: ClusterId, joined: u64, cluster: u64, applied: u64, member: bool) -> bool {
    cluster == ours.0 && !member && applied >= joined.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_answer_that_saw_the_joining_proves_a_removal() {
        let ours = ClusterId(7);
        assert!(removed(ours, 10, 7, 10, false));
        assert!(removed(ours, 10, 7, 500, false));
        // Still a member.
        assert!(!removed(ours, 10, 7, 500, true));
        // A learner that has not applied the entry that made this node a member.
        assert!(!removed(ours, 10, 7, 9, false));
        // A founder (joined at 0): the first snapshot names it; a node that has
        // applied nothing knows no one.
        assert!(removed(ours, 0, 7, 1, false));
        assert!(!removed(ours, 0, 7, 0, false));
        // Another mesh.
        assert!(!removed(ours, 10, 8, 500, false));
    }
}
