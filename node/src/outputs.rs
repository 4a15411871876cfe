//! A task's outputs: its shards' results merged into the final buffers.
//!
//! A task of several shards is merged once, by the leader's scheduler, as soon as
//! every shard has a result ([`merge_and_record`]): it pulls the shard results and
//! the in-out buffers' starting contents, merges them, keeps each output as a blob
//! on two nodes and commits `TaskMerged`, or `MergeFailed` when two shards changed
//! one word to different values. Only then is the task complete, so a conflict fails
//! the task instead of surfacing at fetch time (so does a result that cannot be
//! merged at all); a blob that cannot be fetched yet is tried again on the next
//! pass. A task of one shard needs no merge step: its shard's changes over the
//! starting contents are the answer, worked out by whichever node is asked for it
//! ([`task_outputs`]). Talks to: raft (reads the task, proposes), the mesh (pulls
//! and copies blobs), the blob store.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpumesh_consensus::{Command, ConsensusHandle, MergedOutput, Task, TaskId, TaskStatus};
use gpumesh_protocol::{BlobId, MergeRule, ShardChanges, TaskSpec};
use gpumesh_shaders::{merge, KernelCache};

use crate::blobs::BlobsHandle;
use crate::peers::PeersHandle;

/// How many completed tasks' outputs a node remembers; older ones are looked up in
/// the record again when asked for.
pub const REMEMBERED_RESULTS: usize = 10_000;

/// Completed tasks' outputs made local to this node, binding → blob, by task: the
/// newest [`REMEMBERED_RESULTS`] of them.
#[derive(Debug, Default)]
pub struct ResultCache(std::sync::Mutex<ResultsInner>);

#[derive(Debug, Default)]
struct ResultsInner {
    by_task: std::collections::HashMap<TaskId, BTreeMap<u32, BlobId>>,
    order: std::collections::VecDeque<TaskId>,
}

impl ResultCache {
    pub fn get(&self, task: TaskId) -> Option<BTreeMap<u32, BlobId>> {
        self.0.lock().ok()?.by_task.get(&task).cloned()
    }

    /// Drops what is known of `task` (forgotten by the record); the outputs made
    /// for it here (which the record never named) that no other task's are.
    pub fn forget(&self, task: TaskId) -> Vec<BlobId> {
        let Ok(mut inner) = self.0.lock() else {
            return Vec::new();
        };
        let Some(outputs) = inner.by_task.remove(&task) else {
            return Vec::new();
        };
        inner.order.retain(|t| *t != task);
        // Another task with the same outputs still reads them here.
        outputs
            .into_values()
            .filter(|b| !inner.by_task.values().any(|o| o.values().any(|x| x == b)))
            .collect()
    }

    pub fn insert(&self, task: TaskId, outputs: BTreeMap<u32, BlobId>) {
        let Ok(mut inner) = self.0.lock() else {
            return;
        };
        if inner.by_task.insert(task, outputs).is_none() {
            inner.order.push_back(task);
        }
        while inner.order.len() > REMEMBERED_RESULTS {
            if let Some(old) = inner.order.pop_front() {
                inner.by_task.remove(&old);
            }
        }
    }
}

/// Why outputs could not be produced.
#[derive(Debug)]
pub(crate) enum MergeError {
    /// The shards' results cannot be merged (a conflict, or a result that does not
    /// decode or fit its buffer): the task must fail with this reason.
    Fatal(String),
    /// Something was not available (a blob, the record): worth trying again.
    Unavailable(String),
}

impl std::fmt::Display for MergeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MergeError::Fatal(r) | MergeError::Unavailable(r) => f.write_str(r),
        }
    }
}

/// The bytes of one of `task`'s shard results: from the record when it keeps them,
/// else from this node's blobs or pulled from `node` (or any holder).
pub(crate) async fn result_bytes(
    blobs: &BlobsHandle,
    peers: &PeersHandle,
    task: &Task,
    blob: BlobId,
    node: u64,
) -> Result<Vec<u8>, String> {
    match task.inline.get(&blob) {
        Some(bytes) => Ok(bytes.clone()),
        None => blobs.pull(blob, peers.peer(node)).await,
    }
}

/// The starting contents of the in-out bindings of `spec` (submitted through
/// `submitter`), pulled from the mesh.
pub(crate) async fn starts(
    blobs: &BlobsHandle,
    spec: &TaskSpec,
    submitter: &str,
) -> Result<BTreeMap<u32, Vec<u8>>, MergeError> {
    let submitter = submitter.parse().ok();
    let mut starts = BTreeMap::new();
    for b in &spec.bindings {
        if let gpumesh_protocol::BindingRole::InOut { blob, .. } = b.role {
            let bytes = blobs.pull(blob, submitter).await.map_err(|e| {
                MergeError::Unavailable(format!("the start of in-out binding {}: {e}", b.binding))
            })?;
            starts.insert(b.binding, bytes);
        }
    }
    Ok(starts)
}

/// Merges the accepted results of every shard of `task` into its outputs.
pub(crate) async fn merge_shards(
    blobs: &BlobsHandle,
    peers: &PeersHandle,
    kernels: &Arc<KernelCache>,
    task: &Task,
) -> Result<BTreeMap<u32, Vec<u8>>, MergeError> {
    let unavailable = MergeError::Unavailable;
    let mut shards = Vec::with_capacity(task.shards.len());
    for (i, sh) in task.shards.iter().enumerate() {
        let out = sh
            .output
            .ok_or_else(|| unavailable(format!("shard {i} has no result")))?;
        let bytes = result_bytes(blobs, peers, task, out.blob, out.node)
            .await
            .map_err(|e| unavailable(format!("the result of shard {i}: {e}")))?;
        // The blob matched its hash, so a result that does not decode will not
        // decode on a retry either.
        let changes = ShardChanges::decode(&bytes)
            .map_err(|e| MergeError::Fatal(format!("the result of shard {i} is malformed: {e}")))?;
        shards.push(changes);
    }
    merge_changes(blobs, kernels, &task.spec, &task.submitter, shards).await
}

/// [`merge_shards`] of results already in hand: `shards[i]` is shard `i`'s of a
/// task of `spec` submitted through `submitter`. Results of several shards need the
/// kernel (from `kernels`) to tell values stored from partials.
pub(crate) async fn merge_changes<S>(
    blobs: &BlobsHandle,
    kernels: &Arc<KernelCache>,
    spec: &TaskSpec,
    submitter: &str,
    shards: Vec<S>,
) -> Result<BTreeMap<u32, Vec<u8>>, MergeError>
where
    S: std::borrow::Borrow<ShardChanges> + Send + 'static,
{
    let starts = starts(blobs, spec, submitter).await?;
    let spec = spec.clone();
    let bytes = spec.binding_bytes();
    // Deterministic from here: the same results fail the same way on any node. Off
    // the async runtime unless small: a merge walks every changed word of every shard.
    let kernels = kernels.clone();
    let merge = move || {
        // One shard's words are its values whatever they hold, and `changes` takes
        // every word as a value: no kernel needed.
        let reduced = spec.merge != MergeRule::Changes
            || spec.merges.values().any(|&r| r != MergeRule::Changes);
        let kernel = if reduced && shards.len() > 1 {
            let kernel = kernels
                .get(&spec.shader, &spec.entry_point)
                .map_err(|e| MergeError::Fatal(format!("the task's kernel: {e}")))?;
            Some(kernel)
        } else {
            None
        };
        let atomic = |b| kernel.as_ref().and_then(|k| k.interface.atomic_words(b));
        let targets = merge::targets(&spec, atomic, |b| starts.get(&b).map(Vec::as_slice));
        let refs: Vec<&ShardChanges> = shards.iter().map(|s| s.borrow()).collect();
        merge::merge(&targets, &refs).map_err(|e| MergeError::Fatal(e.to_string()))
    };
    if bytes <= MERGE_IN_PLACE_BYTES {
        return merge();
    }
    tokio::task::spawn_blocking(merge)
        .await
        .map_err(|e| MergeError::Unavailable(format!("the merge did not finish: {e}")))?
}

/// Outputs of at most this many bytes in all are merged on the task that wants
/// them: a hand-over to the blocking pool (a thread to wake, then the task again)
/// costs more than such a merge.
pub(crate) const MERGE_IN_PLACE_BYTES: u64 = 64 << 10;

/// On the leader: merges a task awaiting its merge, keeps the outputs on two nodes
/// and records them, or fails the task on a conflict. Anything unavailable is left
/// for the next scheduling pass.
pub(crate) async fn merge_and_record(
    consensus: &ConsensusHandle,
    blobs: &BlobsHandle,
    peers: &PeersHandle,
    kernels: &Arc<KernelCache>,
    id: TaskId,
) -> Result<(), String> {
    let task = consensus
        .read_local(move |s| s.task(id).cloned())
        .ok_or("the task is gone")?;
    if task.status != TaskStatus::Merging {
        return Ok(());
    }
    let command = match merge_shards(blobs, peers, kernels, &task).await {
        Ok(merged) => {
            let mut outputs = Vec::with_capacity(merged.len());
            for (binding, bytes) in merged {
                let size = bytes.len() as u64;
                // A leader at its disk reserve has two other members keep them:
                // a full disk here must not hold every merge of the mesh back.
                let (blob, node) = if blobs.store().has_room(size) {
                    let blob = blobs
                        .put_and_copy(bytes, task.submitter.parse().ok())
                        .await
                        .map_err(|e| e.to_string())?;
                    (blob, consensus.id())
                } else {
                    let (blob, keeper) = blobs
                        .keep_elsewhere(bytes)
                        .await
                        .map_err(|e| e.to_string())?;
                    (blob, crate::identity::raft_id(&keeper))
                };
                outputs.push(MergedOutput {
                    binding,
                    blob,
                    size,
                    node,
                });
            }
            Command::TaskMerged { task: id, outputs }
        }
        Err(MergeError::Fatal(reason)) => Command::MergeFailed { task: id, reason },
        Err(MergeError::Unavailable(reason)) => return Err(reason),
    };
    consensus
        .propose(command)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// A completed task's outputs, binding → blob, made local to this node: the merged
/// blobs the leader recorded, or (one shard) its result over the starting contents.
/// Remembered in the node's result cache, which the API reads first.
pub(crate) async fn task_outputs(
    blobs: &BlobsHandle,
    peers: &PeersHandle,
    kernels: &Arc<KernelCache>,
    results: &ResultCache,
    task: &Task,
) -> Result<BTreeMap<u32, BlobId>, MergeError> {
    let mut ids = BTreeMap::new();
    if task.outputs.is_empty() {
        for (binding, bytes) in merge_shards(blobs, peers, kernels, task).await? {
            let id = blobs
                .store()
                .put(&bytes)
                .map_err(|e| MergeError::Unavailable(e.to_string()))?;
            ids.insert(binding, id);
        }
    } else {
        for o in &task.outputs {
            blobs.fetch(o.blob, peers.peer(o.node)).await.map_err(|e| {
                MergeError::Unavailable(format!("output of binding {}: {e}", o.binding))
            })?;
            ids.insert(o.binding, o.blob);
        }
    }
    results.insert(task.id, ids.clone());
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_result_cache_forgets_the_oldest_tasks_past_its_bound() {
        let cache = ResultCache::default();
        let outputs = |n: u8| BTreeMap::from([(0u32, BlobId::of(&[n]))]);
        for i in 0..=REMEMBERED_RESULTS as u64 {
            cache.insert(TaskId(i), outputs((i % 251) as u8));
        }
        assert_eq!(cache.get(TaskId(0)), None, "the oldest is forgotten");
        let newest = REMEMBERED_RESULTS as u64;
        assert_eq!(
            cache.get(TaskId(newest)),
            Some(outputs((newest % 251) as u8))
        );
        // Remembering a task again does not count it twice.
        cache.insert(TaskId(newest), outputs(1));
        assert_eq!(cache.get(TaskId(1)), Some(outputs(1)));
    }
}
