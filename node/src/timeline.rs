//! Where a task's or an actor call's time goes: the moment each passes each stage
//! of its path, recorded only when a node is given a recording [`Timeline`]
//! (`gpumesh bench mesh` and `bench actors` give their three in-process nodes one
//! between them); otherwise a no-op.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use gpumesh_consensus::{RequestId, TaskId};

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

/// The stages of an actor call sent to its host, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CallStage {
    /// The API the client called has the request.
    Received,
    /// The actor's host has the call in its mailbox.
    AtHost,
    /// The host starts a batch with it.
    Taken,
    /// The batch has run on the GPU (its state fetched first if it was not there)
    /// and its state and outputs are read back.
    Ran,
    /// The host's `ActorCallsRan` is applied there: the call is recorded.
    Recorded,
    /// The API the client called has the answer.
    Answered,
}

impl CallStage {
    pub const ALL: [CallStage; 6] = [
        CallStage::Received,
        CallStage::AtHost,
        CallStage::Taken,
        CallStage::Ran,
        CallStage::Recorded,
        CallStage::Answered,
    ];

    /// What happens between the previous stage and this one.
    pub fn what(self) -> &'static str {
        match self {
            CallStage::Received => "request received",
            CallStage::AtHost => "to the actor's host",
            CallStage::Taken => "waiting in the host's mailbox",
            CallStage::Ran => "GPU run and readback",
            CallStage::Recorded => "calls and state committed and applied (host)",
            CallStage::Answered => "answer to the node called",
        }
    }
}

/// One mark: a task passed a stage at an instant.
pub type Mark = (TaskId, Stage, Instant);

/// One mark of an actor call, by its request id.
pub type CallMark = (RequestId, CallStage, Instant);

#[derive(Default)]
struct Marks {
    tasks: Mutex<Vec<Mark>>,
    calls: Mutex<Vec<CallMark>>,
}

/// Marks shared by every node given a clone; `Timeline::default()` records nothing.
#[derive(Clone, Default)]
pub struct Timeline(Option<Arc<Marks>>);

impl Timeline {
    pub fn recording() -> Self {
        Timeline(Some(Arc::default()))
    }

    pub fn mark(&self, task: TaskId, stage: Stage) {
        self.mark_at(task, stage, Instant::now());
    }

    pub fn mark_at(&self, task: TaskId, stage: Stage, at: Instant) {
        if let Some(marks) = &self.0 {
            lock(&marks.tasks).push((task, stage, at));
        }
    }

    pub fn mark_call(&self, request: RequestId, stage: CallStage) {
        self.mark_call_at(request, stage, Instant::now());
    }

    pub fn mark_call_at(&self, request: RequestId, stage: CallStage, at: Instant) {
        if let Some(marks) = &self.0 {
            lock(&marks.calls).push((request, stage, at));
        }
    }

    /// Whether marks are kept (callers skip work that only feeds them).
    pub fn is_recording(&self) -> bool {
        self.0.is_some()
    }

    /// Every task mark so far, and none kept.
    pub fn take(&self) -> Vec<Mark> {
        match &self.0 {
            Some(marks) => std::mem::take(&mut *lock(&marks.tasks)),
            None => Vec::new(),
        }
    }

    /// Every call mark so far, and none kept.
    pub fn take_calls(&self) -> Vec<CallMark> {
        match &self.0 {
            Some(marks) => std::mem::take(&mut *lock(&marks.calls)),
            None => Vec::new(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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
