//! Second copies again after a member is removed: every blob is kept on two members
//! (the node that made it and one more), and a member removed for good
//! (`gpumesh remove`, its machine lost) takes its copies with it. Once the removal
//! applies here, each remaining member makes sure that one other member holds each
//! blob it stores that the record names (a `Replicate`, which a member that holds
//! it already answers at once), so every such blob is on two members again. A
//! member that left by itself handed its blobs off before; the pass then finds
//! them all in place.

use futures::StreamExt;
use gpumesh_consensus::{AppliedEvent, Command, ConsensusHandle, Outcome};
use tokio::sync::broadcast::error::RecvError;
use tokio_util::sync::CancellationToken;

use super::BlobsHandle;

/// How many blobs are checked at once.
const AT_ONCE: usize = 8;

/// Runs until `cancel`: a pass over this node's blobs after each removal of another
/// member (removals during a pass make one more).
pub async fn run(blobs: BlobsHandle, consensus: ConsensusHandle, cancel: CancellationToken) {
    let me = consensus.id();
    let mut events = consensus.subscribe();
    loop {
        let removed = tokio::select! {
            _ = cancel.cancelled() => return,
            event = events.recv() => match event {
                Ok(AppliedEvent::Entry { entry, committed, duplicate, .. }) => match &entry.command {
                    Command::NodeLeft { raft_id }
                        if *raft_id != me && !duplicate && committed.outcome == Outcome::Applied =>
                    {
                        *raft_id
                    }
                    _ => continue,
                },
                Ok(AppliedEvent::Restored { .. }) | Err(RecvError::Lagged(_)) => continue,
                Err(RecvError::Closed) => return,
            },
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            () = pass(&blobs, &consensus, removed) => {}
        }
    }
}

/// One other member for every blob stored here that the record names.
async fn pass(blobs: &BlobsHandle, consensus: &ConsensusHandle, removed: u64) {
    let named = consensus.read_local(|s| s.blobs_in_use());
    let store = blobs.store().clone();
    let Ok(Ok(here)) = tokio::task::spawn_blocking(move || store.all_blobs()).await else {
        return;
    };
    let todo: Vec<_> = here.into_iter().filter(|b| named.contains(b)).collect();
    let mut done = futures::stream::iter(todo.iter().copied())
        .map(|id| async move { (id, blobs.ensure_copy(id).await) })
        .buffer_unordered(AT_ONCE);
    let mut failed = 0;
    while let Some((id, outcome)) = done.next().await {
        if let Err(e) = outcome {
            failed += 1;
            tracing::warn!(%id, error = %e, "no second copy of a blob after a member was removed");
        }
    }
    tracing::info!(
        removed = format!("{removed:x}"),
        blobs = todo.len(),
        failed,
        "made sure another member holds each blob here, after a member was removed"
    );
}
