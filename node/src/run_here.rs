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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpumesh_consensus::{Command, Committed, ConsensusHandle, Ran, RequestId};
use gpumesh_protocol::{BlobId, ShardChanges, TaskSpec};
use tokio::sync::{oneshot, Semaphore};

use crate::timeline::{Stage, Timeline};
use crate::worker::{store_and_copy, ShardError, ShardRunner};

/// The tasks under way here at once by default; beyond them a task is placed by
/// the mesh (where the record can see it and spread the load). [`WAIT_BUDGET`]
/// bounds the queue by time first: only runs as short as tiny tasks (which the GPU
/// thread batches) stack this deep.
pub const DEFAULT_SLOTS: usize = 64;

/// The longest a task may expect to wait here behind the runs under way (by how
/// long runs took here lately) before it is better placed by the mesh: about what
/// a commit takes under load. Tiny tasks queue here many deep; a 100 ms kernel
/// runs here only while nothing else does.
pub const WAIT_BUDGET: Duration = Duration::from_millis(20);

pub(crate) struct RunHere {
    pub me: u64,
    pub consensus: ConsensusHandle,
    pub runner: ShardRunner,
    /// Runs under way here, at most `slot_count`.
    pub slots: Arc<Semaphore>,
    pub slot_count: usize,
    /// How long a run took on this GPU lately, in µs (a moving average).
    pub recent_us: AtomicU64,
    /// The largest buffer this node's adapter binds.
    pub fits: u64,
    pub timeline: Timeline,
}

impl RunHere {
    /// Runs `spec` here and records it, when it qualifies and a slot is free.
    /// `None`: not run here (not one shard of one replica, too large a buffer for
    /// this adapter, every slot busy or the wait behind them over [`WAIT_BUDGET`],
    /// or a failure another node may not have); the
    /// caller submits it to the mesh as usual. `Some`: the entry's fate, committed or
    /// not, and the result it records when the run gave one (its id and the words
    /// it changed, still in memory: the caller answering with the outputs need not
    /// read them back). `early` is given those changes, with the spec, as soon as
    /// the GPU is done with them, before they are stored and recorded (the caller
    /// may send them on, so long as it says whether they are the answer only once
    /// it knows).
    pub async fn run(
        &self,
        request_id: RequestId,
        spec: &TaskSpec,
        submitter: &str,
        received: Instant,
        early: Option<oneshot::Sender<Early>>,
    ) -> Option<(gpumesh_consensus::Result<Committed>, Option<RanHere>)> {
        if spec.shards != 1
            || spec.options.replicas > 1
            || gpumesh_consensus::largest_binding(spec) > self.fits
        {
            return None;
        }
        let busy = self
            .slot_count
            .saturating_sub(self.slots.available_permits()) as u64;
        if busy > 0
            && busy * self.recent_us.load(Ordering::Relaxed) > WAIT_BUDGET.as_micros() as u64
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
        let mut result = None;
        let ran = match self.runner.run(spec, submitter, 0, mark).await {
            Ok((changes, gpu)) => {
                counts.run_seconds.observe(started.elapsed().as_secs_f64());
                let took = gpu.as_micros() as u64;
                let old = self.recent_us.load(Ordering::Relaxed);
                let new = if old == 0 { took } else { (old * 7 + took) / 8 };
                self.recent_us.store(new, Ordering::Relaxed);
                let changes = Arc::new(changes);
                if let Some(early) = early {
                    let _ = early.send((changes.clone(), spec.clone()));
                }
                match store_and_copy(&self.runner.blobs, &changes, submitter).await {
                    Ok((blob, size, inline)) => {
                        result = Some(RanHere { blob, changes });
                        Ran::Result { blob, size, inline }
                    }
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
        Some((committed, result))
    }
}

/// A run's changes and its spec, handed over before they are stored and recorded.
pub(crate) type Early = (Arc<ShardChanges>, TaskSpec);

/// A result run here: its blob id as recorded, and the words it changed.
pub(crate) struct RanHere {
    pub blob: BlobId,
    pub changes: Arc<ShardChanges>,
}
