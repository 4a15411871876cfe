//! Running a task where it was submitted. A `POST /v1/tasks/run` of one shard and
//! one replica, made while this node's GPU has a free slot, runs here at once and is
//! recorded with what came of it in one entry ([`Command::TaskRan`]): one commit
//! instead of three (the submit, the start, the result), and no hop to a worker.
//!
//! The promise is the same as for a task the mesh places: nothing is acknowledged
//! before its entry is committed on a quorum, a small result rides in that entry and
//! a larger one is on this node and a second before it is recorded. A run that
//! cannot finish here for a reason another node might not share (an input that
//! vanished, a lost device) falls back to the mesh's placement under the same
//! request id, so the task is made at most once. Tasks with replicas are never run
//! here: their point is that other nodes run them too.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use gpumesh_consensus::{Command, Committed, ConsensusHandle, Ran, RequestId};
use gpumesh_protocol::TaskSpec;
use tokio::sync::Semaphore;

use crate::timeline::{Stage, Timeline};
use crate::worker::{store_and_copy, ShardError, ShardRunner};

/// The tasks under way here at once by default; beyond them a task is placed by
/// the mesh (where the record can see it and spread the load).
pub const DEFAULT_SLOTS: usize = 16;

pub(crate) struct RunHere {
    pub me: u64,
    pub consensus: ConsensusHandle,
    pub runner: ShardRunner,
    /// Runs under way here.
    pub slots: Arc<Semaphore>,
    /// The largest buffer this node's adapter binds.
    pub fits: u64,
    pub timeline: Timeline,
}

impl RunHere {
    /// Runs `spec` here and records it, when it qualifies and a slot is free.
    /// `None`: not run here (not one shard of one replica, too large a buffer for
    /// this adapter, every slot busy, or a failure another node may not have); the
    /// caller submits it to the mesh as usual. `Some`: the entry's fate, committed or
    /// not.
    pub async fn run(
        &self,
        request_id: RequestId,
        spec: &TaskSpec,
        submitter: &str,
        received: Instant,
    ) -> Option<gpumesh_consensus::Result<Committed>> {
        if spec.shards != 1
            || spec.options.replicas > 1
            || gpumesh_consensus::largest_binding(spec) > self.fits
        {
            return None;
        }
        let _slot = self.slots.clone().try_acquire_owned().ok()?;
        let marks = Mutex::new(vec![(Stage::Received, received)]);
        let mark = |stage| {
            if let Ok(mut m) = marks.lock() {
                m.push((stage, Instant::now()));
            }
        };
        let started = Instant::now();
        let counts = &self.runner.counts;
        let ran = match self.runner.run(spec, submitter, 0, mark).await {
            Ok(changes) => {
                counts.run_seconds.observe(started.elapsed().as_secs_f64());
                match store_and_copy(&self.runner.blobs, changes, submitter).await {
                    Ok((blob, size, inline)) => Ran::Result { blob, size, inline },
                    Err(reason) => {
                        tracing::debug!(%reason, "result not kept; the mesh places the task");
                        return None;
                    }
                }
            }
            Err(ShardError::Fatal(reason)) => {
                counts.failed.inc();
                Ran::Failed(reason)
            }
            Err(ShardError::Retry(reason)) => {
                counts.failed.inc();
                tracing::debug!(%reason, "could not run here; the mesh places the task");
                return None;
            }
        };
        let succeeded = matches!(ran, Ran::Result { .. });
        mark(Stage::Kept);
        let command = Command::TaskRan {
            spec: spec.clone(),
            submitter: submitter.to_owned(),
            node: self.me,
            ran: Box::new(ran),
        };
        let committed = self.consensus.propose_with_id(request_id, command).await;
        if let Ok(Committed {
            outcome: gpumesh_consensus::Outcome::TaskSubmitted { task },
            ..
        }) = &committed
        {
            if succeeded {
                counts.done.inc();
            }
            mark(Stage::Recorded);
            for (stage, at) in marks.into_inner().unwrap_or_default() {
                self.timeline.mark_at(*task, stage, at);
            }
        }
        Some(committed)
    }
}
