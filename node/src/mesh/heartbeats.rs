//! This node's heartbeat and capability, proposed through Raft.

use super::*;
use crate::mesh::members::publish_addrs;

/// Publishes this node's capability once and a heartbeat every `interval`.
pub(super) async fn heartbeats(shared: Arc<Shared>, interval: Duration, cancel: CancellationToken) {
    let Some(consensus) = shared.consensus.get().cloned() else {
        return;
    };
    let me = shared.raft_id;
    let mut published = false;
    loop {
        let member = consensus
            .read_local(move |s| s.member(me).cloned())
            .await
            .ok()
            .flatten();
        // Until this node sees itself in the membership (a joiner catching up),
        // look again soon rather than after a whole interval.
        let wait = if member.is_some() {
            interval
        } else {
            Duration::from_millis(200)
        };
        if let Some(member) = member {
            publish_addrs(&shared, &consensus, &member.addrs).await;
            if !published {
                match (&shared.capability, &member.capability) {
                    (Some(mine), theirs) if theirs.as_ref() != Some(mine) => {
                        published = consensus
                            .propose(Command::NodeCapabilities {
                                raft_id: me,
                                capability: mine.clone(),
                            })
                            .await
                            .is_ok();
                    }
                    _ => published = true,
                }
            }
            match consensus
                .propose(Command::Heartbeat {
                    raft_id: me,
                    at_ms: scheduler::now_ms(),
                })
                .await
            {
                Ok(c) if c.outcome == gpumesh_consensus::Outcome::Applied => {}
                Ok(c) => tracing::debug!(outcome = ?c.outcome, "heartbeat had no effect"),
                Err(e) => tracing::debug!(error = %e, "heartbeat not committed"),
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}
