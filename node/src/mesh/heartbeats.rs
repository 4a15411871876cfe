//! This node's heartbeat, capability and listen addresses, proposed through Raft.

use super::*;

/// Publishes this node's capability once, its listen addresses whenever its record
/// says otherwise, and a heartbeat every `interval`.
pub(super) async fn heartbeats(
    consensus: ConsensusHandle,
    net: NetHandle,
    capability: Option<NodeCapability>,
    interval: Duration,
    cancel: CancellationToken,
) {
    let me = consensus.id();
    let mut published = false;
    loop {
        let member = consensus.read_local(move |s| s.member(me).cloned());
        // Until this node sees itself in the membership (a joiner catching up),
        // look again soon rather than after a whole interval.
        let wait = if member.is_some() {
            interval
        } else {
            Duration::from_millis(200)
        };
        if let Some(member) = member {
            publish_addrs(&net, &consensus, &member.addrs).await;
            if !published {
                match (&capability, &member.capability) {
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

/// Publishes where this node listens into its membership record when the record
/// says otherwise (a new member, or one restarted on other addresses).
async fn publish_addrs(net: &NetHandle, consensus: &ConsensusHandle, recorded: &[String]) {
    let Ok(mine) = net.listen_addrs().await else {
        return;
    };
    let mut mine: Vec<String> = mine.iter().map(|a| a.to_string()).collect();
    // Loopback last: a peer on another machine reaching its own loopback finds
    // itself, not this node.
    mine.sort_by_key(|a| a.starts_with("/ip4/127.") || a.starts_with("/ip6/::1/"));
    if mine.is_empty() || mine == recorded {
        return;
    }
    let proposed = consensus
        .propose(Command::NodeAddresses {
            raft_id: consensus.id(),
            addrs: mine,
        })
        .await;
    if let Err(e) = proposed {
        tracing::debug!(error = %e, "listen addresses not yet recorded");
    }
}
