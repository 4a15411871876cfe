//! Where a task's time goes: the moment each task passes each stage of its path,
//! recorded only when a node is given a recording [`Timeline`] (`gpumesh bench
//! mesh` gives its three in-process nodes one between them); otherwise a no-op.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use gpumesh_consensus::TaskId;

/// The stages of a task's path, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// The submitting node's API has the request.
    Received,
    /// `SubmitTask` is applied on the submitting node: the submit is answered.
    Submitted,
    /// The worker has applied its assignment and takes the shard.
    Assigned,
    /// Inputs local, kernel compiled: the GPU thread takes the shard.
    GpuStart,
    /// The shard's changes are read back.
    GpuDone,
    /// Its result is stored on the worker and on a second node.
    Kept,
    /// `ShardResult` is applied on the worker.
    Recorded,
    /// The node the client waits on has applied the task's completion.
    Completed,
    /// The node the client fetches from has served the outputs' bytes.
    Served,
}

impl Stage {
    pub const ALL: [Stage; 9] = [
        Stage::Received,
        Stage::Submitted,
        Stage::Assigned,
        Stage::GpuStart,
        Stage::GpuDone,
        Stage::Kept,
        Stage::Recorded,
        Stage::Completed,
        Stage::Served,
    ];

    /// What happens between the previous stage and this one.
    pub fn what(self) -> &'static str {
        match self {
            Stage::Received => "request received",
            Stage::Submitted => "submit committed and applied (submitting node)",
            Stage::Assigned => "assignment committed and applied (worker)",
            Stage::GpuStart => "inputs, kernel, to the GPU thread",
            Stage::GpuDone => "GPU run and readback",
            Stage::Kept => "result stored here and on a second node",
            Stage::Recorded => "result committed and applied (worker)",
            Stage::Completed => "completion applied (waiting node), wait answered",
            Stage::Served => "outputs asked for and served",
        }
    }
}

/// One mark: a task passed a stage at an instant.
pub type Mark = (TaskId, Stage, Instant);

/// Marks shared by every node given a clone; `Timeline::default()` records nothing.
#[derive(Clone, Default)]
pub struct Timeline(Option<Arc<Mutex<Vec<Mark>>>>);

impl Timeline {
    pub fn recording() -> Self {
        Timeline(Some(Arc::default()))
    }

    pub fn mark(&self, task: TaskId, stage: Stage) {
        self.mark_at(task, stage, Instant::now());
    }

    pub fn mark_at(&self, task: TaskId, stage: Stage, at: Instant) {
        if let Some(marks) = &self.0 {
            marks
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((task, stage, at));
        }
    }

    /// Every mark so far, and none kept.
    pub fn take(&self) -> Vec<Mark> {
        match &self.0 {
            Some(marks) => std::mem::take(&mut *marks.lock().unwrap_or_else(|e| e.into_inner())),
            None => Vec::new(),
        }
    }
}

impl std::fmt::Debug for Timeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Timeline(recording)"
        } else {
            "Timeline(off)"
        })
    }
}
