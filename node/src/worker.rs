//! The worker: runs the shards the mesh assigns to this node.
//!
//! Owns the GPU executor on a dedicated thread (wgpu polling blocks); on a CPU
//! adapter a run asked for while that thread has nothing to do runs on the asking
//! task's thread instead (see [`GpuHandle::run`]). Watches the
//! applied log for `AssignShard` entries naming this node, pulls the task's input
//! blobs from whoever holds them, runs the shard, stores its outputs as one blob and
//! proposes the result (or the failure) through Raft. Talks to: raft (reads state,
//! proposes), net (fetches blobs), the blob store. Counts its shards, and the GPU
//! thread its work, in the node's [`crate::metrics`].

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use gpumesh_consensus::{AppliedEvent, Command, ConsensusHandle, Outcome, TaskId};
use gpumesh_protocol::{BlobId, DeviceKind, NodeCapability, ShardChanges, TaskSpec};
use gpumesh_shaders::{
    calibrate, BackendChoice, ChainOutput, ExecError, Executor, ExecutorLimits, Job, ShardOutput,
};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::blobs::BlobsHandle;
use crate::metrics::{GpuMetrics, ShardMetrics};
use crate::timeline::{Stage, Timeline};

enum GpuRequest {
    Run {
        job: Box<Job>,
        shard: u32,
        deadline: Option<Duration>,
        reply: oneshot::Sender<Result<ShardOutput, ExecError>>,
    },
    /// Run these one-shard jobs as one chain (`Executor::run_chain`).
    Chain {
        jobs: Vec<Job>,
        carry: Vec<u32>,
        deadline: Option<Duration>,
        reply: oneshot::Sender<Result<ChainOutput, ExecError>>,
    },
    /// Free the buffers kept on the device for these contents.
    Forget(Vec<BlobId>),
}

/// The executor on its own thread. Cheap to clone.
#[derive(Clone)]
pub struct GpuHandle {
    tx: mpsc::Sender<GpuRequest>,
    /// The executor, for runs made on the asking task's thread (the GPU thread holds
    /// the only strong reference, so the device is destroyed there, see `start`).
    executor: Weak<Mutex<Executor>>,
    /// Requests sent to the GPU thread and not yet done.
    queued: Arc<AtomicUsize>,
    /// Whether an idle executor's runs may go on the asking task's thread: on a CPU
    /// adapter (see [`GpuHandle::inline`]).
    inline: bool,
    metrics: GpuMetrics,
}

impl GpuHandle {
    /// Opens and calibrates the adapter `choice` allows; `None` (logged) when this
    /// machine has none: the node still joins the mesh, and gets no shards. The
    /// thread ends once every handle is dropped and its last dispatch is done; its
    /// join handle lets the node wait for that (and so for the device to be
    /// destroyed) before it says it has stopped. Every shard run is counted in
    /// `metrics` (calibration is not).
    pub fn start(
        choice: BackendChoice,
        calibrate_speed: bool,
        limits: ExecutorLimits,
        metrics: GpuMetrics,
    ) -> Option<(GpuHandle, NodeCapability, std::thread::JoinHandle<()>)> {
        let (tx, mut rx) = mpsc::channel::<GpuRequest>(16);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let (done, handle_metrics) = (queued.clone(), metrics.clone());
        let spawned = std::thread::Builder::new()
            .name("gpumesh-gpu".into())
            .spawn(move || {
                let mut executor = match Executor::with_limits(choice, limits) {
                    Ok(e) => e,
                    Err(e) => {
                        tracing::warn!(error = %e, "no usable GPU adapter; this node will run no shards");
                        let _ = ready_tx.send(None);
                        return;
                    }
                };
                if calibrate_speed {
                    if let Err(e) = calibrate::calibrate(&mut executor) {
                        tracing::warn!(error = %e, "calibration failed");
                    }
                }
                metrics.watch_devices(executor.device_counts());
                let shared = Arc::new(Mutex::new(executor));
                let _ = ready_tx.send(Some((
                    Arc::downgrade(&shared),
                    lock(&shared).capability().clone(),
                )));
                // A request taken from the queue while gathering a batch, and not
                // part of it: handled next.
                let mut held = None;
                loop {
                    let Some(req) = held.take().or_else(|| rx.blocking_recv()) else {
                        break;
                    };
                    let mut executor = lock(&shared);
                    let executor = &mut *executor;
                    let mut handled = 1;
                    match req {
                        GpuRequest::Run {
                            job,
                            shard,
                            deadline,
                            reply,
                        } => {
                            let mut batch = vec![Queued {
                                job,
                                shard,
                                deadline,
                                reply,
                            }];
                            // Runs waiting behind this one go in the same submission.
                            while batch[0].batches() && batch.len() < MAX_BATCH {
                                match rx.try_recv() {
                                    Ok(GpuRequest::Run {
                                        job,
                                        shard,
                                        deadline,
                                        reply,
                                    }) => {
                                        let next = Queued {
                                            job,
                                            shard,
                                            deadline,
                                            reply,
                                        };
                                        if next.batches() {
                                            batch.push(next);
                                            handled += 1;
                                        } else {
                                            held = Some(next.into_request());
                                            break;
                                        }
                                    }
                                    Ok(other) => {
                                        held = Some(other);
                                        break;
                                    }
                                    Err(_) => break,
                                }
                            }
                            run_queued(executor, batch, &metrics);
                        }
                        GpuRequest::Chain {
                            jobs,
                            carry,
                            deadline,
                            reply,
                        } => {
                            let _ = reply.send(run_chain(executor, &jobs, &carry, deadline, &metrics));
                        }
                        GpuRequest::Forget(ids) => executor.forget(&ids),
                    }
                    metrics.set_resident(executor.resident_bytes());
                    done.fetch_sub(handled, Ordering::Release);
                }
            });
        let thread = spawned.ok()?;
        let (executor, capability) = ready_rx.recv().ok().flatten()?;
        let handle = GpuHandle {
            tx,
            executor,
            queued,
            inline: capability.device_kind == DeviceKind::Cpu,
            metrics: handle_metrics,
        };
        Some((handle, capability, thread))
    }

    /// Runs `f` on the executor on this thread, when that is quicker than handing it
    /// to the GPU thread: the adapter is a CPU one, nothing is queued there or
    /// running, and this is a worker of a multi-threaded runtime (which
    /// `block_in_place` lets block while the kernel runs). Saves waking that thread
    /// and this task again, on every small run's path: 0.01-0.04 ms of a trivial
    /// task or actor call on lavapipe with two cores. Not on a GPU: there wgpu's own
    /// work (encoding, submitting, reading back) ran about twice as slow on whichever
    /// runtime worker the task was on as on the one thread that always does it, more
    /// than the hand-over costs (an H100's actor call p50 0.69-0.89 ms handed over
    /// against 0.88-1.04 inline, alternating in one run). `None`: hand it over.
    fn inline<T>(&self, f: impl FnOnce(&mut Executor) -> T) -> Option<T> {
        if !self.inline {
            return None;
        }
        let multi_thread = matches!(
            tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()),
            Ok(tokio::runtime::RuntimeFlavor::MultiThread)
        );
        if !multi_thread || self.queued.load(Ordering::Acquire) != 0 {
            return None;
        }
        let shared = self.executor.upgrade()?;
        let mut executor = shared.try_lock().ok()?;
        Some(tokio::task::block_in_place(|| {
            let out = f(&mut executor);
            self.metrics.set_resident(executor.resident_bytes());
            out
        }))
    }

    pub async fn run(
        &self,
        job: Job,
        shard: u32,
        deadline: Option<Duration>,
    ) -> Result<ShardOutput, ExecError> {
        if let Some(ran) = self.inline(|e| run_one(e, &job, shard, deadline, &self.metrics)) {
            return ran;
        }
        self.ask(|reply| GpuRequest::Run {
            job: Box::new(job),
            shard,
            deadline,
            reply,
        })
        .await
    }

    /// Sends the GPU thread the request `make` builds around a reply channel, and
    /// waits for the reply.
    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, ExecError>>) -> GpuRequest,
    ) -> Result<T, ExecError> {
        let stopped = || ExecError::Gpu("the GPU thread has stopped".into());
        let (reply, rx) = oneshot::channel();
        self.queued.fetch_add(1, Ordering::AcqRel);
        if self.tx.send(make(reply)).await.is_err() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(stopped());
        }
        rx.await.map_err(|_| stopped())?
    }
}

impl GpuHandle {
    /// Runs one-shard `jobs` one after another in one submission, the `carry`
    /// bindings shared in place (see `Executor::run_chain`).
    pub async fn run_chain(
        &self,
        jobs: Vec<Job>,
        carry: Vec<u32>,
        deadline: Option<Duration>,
    ) -> Result<ChainOutput, ExecError> {
        let metrics = &self.metrics;
        if let Some(ran) = self.inline(|e| run_chain(e, &jobs, &carry, deadline, metrics)) {
            return ran;
        }
        self.ask(|reply| GpuRequest::Chain {
            jobs,
            carry,
            deadline,
            reply,
        })
        .await
    }

    /// Frees the buffers the executor keeps on the device for these contents (the
    /// state of an actor no longer hosted here). Does not wait.
    pub async fn forget(&self, ids: Vec<BlobId>) {
        if !ids.is_empty() {
            self.queued.fetch_add(1, Ordering::AcqRel);
            if self.tx.send(GpuRequest::Forget(ids)).await.is_err() {
                self.queued.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}

/// Runs waiting on the GPU thread that go in one submission at most.
const MAX_BATCH: usize = 16;

/// A run taken from the GPU thread's queue.
struct Queued {
    job: Box<Job>,
    shard: u32,
    deadline: Option<Duration>,
    reply: oneshot::Sender<Result<ShardOutput, ExecError>>,
}

impl Queued {
    /// Whether it can share a submission: the whole of a one-shard job (one that
    /// keeps a buffer on the device is still run alone, see `Executor::run_batch`).
    fn batches(&self) -> bool {
        self.shard == 0 && self.job.plan.len() == 1
    }

    fn into_request(self) -> GpuRequest {
        GpuRequest::Run {
            job: self.job,
            shard: self.shard,
            deadline: self.deadline,
            reply: self.reply,
        }
    }
}

/// Runs `batch`: together in one submission when there are several (the shortest
/// of their deadlines for all), else, or when that fails or cannot be done here,
/// one at a time, so each run gets its own result and its own error.
fn run_queued(executor: &mut Executor, batch: Vec<Queued>, metrics: &GpuMetrics) {
    let mut batch = batch;
    if batch.len() > 1 {
        // The shortest: no run is let go on past its own deadline in the batch (one
        // that takes longer fails the batch, and each then runs alone under its own).
        let default = executor.limits().default_deadline;
        let deadline = batch.iter().map(|q| q.deadline.unwrap_or(default)).min();
        let (jobs, rest): (Vec<Job>, Vec<_>) = batch
            .into_iter()
            .map(|q| (*q.job, (q.shard, q.deadline, q.reply)))
            .unzip();
        let before = executor.counters();
        let started = Instant::now();
        let ran = executor.run_batch(&jobs, deadline);
        metrics.record(started.elapsed(), executor.counters().since(&before));
        if let Ok(Some(outputs)) = ran {
            metrics.batched(outputs.len());
            for ((_, _, reply), output) in rest.into_iter().zip(outputs) {
                let _ = reply.send(Ok(output));
            }
            return;
        }
        batch = jobs
            .into_iter()
            .zip(rest)
            .map(|(job, (shard, deadline, reply))| Queued {
                job: Box::new(job),
                shard,
                deadline,
                reply,
            })
            .collect();
    }
    for q in batch {
        let _ = q
            .reply
            .send(run_one(executor, &q.job, q.shard, q.deadline, metrics));
    }
}

/// The executor, whoever held it last.
fn lock(shared: &Mutex<Executor>) -> std::sync::MutexGuard<'_, Executor> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs shard `shard` of `job` alone, counted in `metrics`.
fn run_one(
    executor: &mut Executor,
    job: &Job,
    shard: u32,
    deadline: Option<Duration>,
    metrics: &GpuMetrics,
) -> Result<ShardOutput, ExecError> {
    let before = executor.counters();
    let started = Instant::now();
    let result = job_shard(job, shard).and_then(|range| {
        executor
            .run_shards(job, &[range], deadline)
            .map(|mut v| v.remove(0))
    });
    metrics.record(started.elapsed(), executor.counters().since(&before));
    result
}

/// Runs `jobs` as one chain (`Executor::run_chain`), counted in `metrics`.
fn run_chain(
    executor: &mut Executor,
    jobs: &[Job],
    carry: &[u32],
    deadline: Option<Duration>,
    metrics: &GpuMetrics,
) -> Result<ChainOutput, ExecError> {
    let before = executor.counters();
    let started = Instant::now();
    let result = executor.run_chain(jobs, carry, deadline);
    metrics.record(started.elapsed(), executor.counters().since(&before));
    result
}

fn job_shard(job: &Job, shard: u32) -> Result<gpumesh_shaders::shard::ShardRange, ExecError> {
    job.plan
        .get(shard as usize)
        .copied()
        .ok_or_else(|| ExecError::Task(format!("shard {shard} is not in the task's plan")))
}

/// Why a shard did not produce outputs.
pub(crate) enum ShardError {
    /// Worth another attempt (perhaps elsewhere).
    Retry(String),
    /// Will fail again anywhere: the task fails.
    Fatal(String),
}

/// One shard this node was asked to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Assignment {
    task: TaskId,
    shard: u32,
    epoch: u32,
}

/// Runs one shard on this node's GPU and keeps its result: what the worker does for
/// a shard the mesh placed here, and the API for a task run where it was submitted
/// ([`crate::run_here`]). Cheap to clone.
#[derive(Clone)]
pub(crate) struct ShardRunner {
    pub blobs: BlobsHandle,
    /// Compiled kernels, shared with the API's submit validation.
    pub kernels: Arc<gpumesh_shaders::KernelCache>,
    /// What this node's shards did, for `/metrics`.
    pub counts: ShardMetrics,
    pub gpu: GpuHandle,
    pub default_deadline: Duration,
    pub faults: Faults,
}

pub(crate) struct Worker {
    pub me: u64,
    pub consensus: ConsensusHandle,
    pub runner: ShardRunner,
    /// Bounds the shard results being stored and reported at once.
    pub post: Arc<tokio::sync::Semaphore>,
    pub timeline: Timeline,
}

impl Worker {
    pub async fn run(self, cancel: CancellationToken) {
        let mut events = self.consensus.subscribe();
        let mut queue: VecDeque<Assignment> = VecDeque::new();
        // Anything already assigned to us (a restart) comes first.
        queue.extend(self.assigned_to_me().await);
        loop {
            while let Some(a) = queue.pop_front() {
                if cancel.is_cancelled() {
                    return;
                }
                self.execute(a).await;
            }
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return,
                event = events.recv() => match event {
                    Ok(AppliedEvent::Entry { entry, committed, duplicate: false, .. }) => {
                        // A new task's shards are placed when its submit is applied.
                        if let Outcome::TaskSubmitted { task } = committed.outcome {
                            queue.extend(self.assigned_to_me_in(task));
                        }
                        if let (
                            Command::AssignShard { node, .. } | Command::ReassignShard { node, .. },
                            Outcome::ShardAssigned { task, shard, epoch },
                        ) = (&entry.command, &committed.outcome)
                        {
                            if *node == self.me {
                                queue.push_back(Assignment { task: *task, shard: *shard, epoch: *epoch });
                            }
                        }
                    }
                    Ok(_) => {}
                    // Missed events or a snapshot: rescan the state.
                    Err(_) => queue.extend(self.assigned_to_me().await),
                },
            }
        }
    }

    /// The attempts of task `task` placed on this node.
    fn assigned_to_me_in(&self, task: TaskId) -> Vec<Assignment> {
        let me = self.me;
        self.consensus.read_local(move |s| {
            let Some(t) = s.task(task) else {
                return Vec::new();
            };
            t.shards
                .iter()
                .enumerate()
                .flat_map(|(i, sh)| {
                    sh.attempts
                        .iter()
                        .filter(|a| a.node == me)
                        .map(move |a| Assignment {
                            task,
                            shard: i as u32,
                            epoch: a.epoch,
                        })
                })
                .collect()
        })
    }

    async fn assigned_to_me(&self) -> Vec<Assignment> {
        let me = self.me;
        self.consensus.read_local(move |s| {
            let mut out = Vec::new();
            for t in s.active_tasks() {
                for (i, sh) in t.shards.iter().enumerate() {
                    for a in sh.attempts.iter().filter(|a| a.node == me) {
                        out.push(Assignment {
                            task: t.id,
                            shard: i as u32,
                            epoch: a.epoch,
                        });
                    }
                }
            }
            out
        })
    }

    async fn execute(&self, a: Assignment) {
        let span = tracing::info_span!("shard", task = %a.task, shard = a.shard, epoch = a.epoch);
        self.execute_in_span(a).instrument(span).await
    }

    async fn execute_in_span(&self, a: Assignment) {
        let me = self.me;
        let current = self.consensus.read_local(move |s| {
            s.task(a.task).and_then(|t| {
                let sh = t.shards.get(a.shard as usize)?;
                (!t.status.is_terminal() && sh.attempt(a.epoch, me).is_some())
                    .then(|| (t.spec.clone(), t.submitter.clone(), sh.failures > 0))
            })
        });
        let Some((spec, submitter, failed_before)) = current else {
            return; // superseded, won by another attempt, finished or cancelled
        };
        self.timeline.mark(a.task, Stage::Assigned);
        let counts = &self.runner.counts;
        if failed_before {
            counts.retried.inc();
        }
        // Recorded for status and stragglers; the shard does not wait for it.
        let consensus = self.consensus.clone();
        let started = Command::ShardStarted {
            task: a.task,
            shard: a.shard,
            epoch: a.epoch,
            node: self.me,
        };
        tokio::spawn(
            async move {
                let _ = consensus.propose(started).await;
            }
            .in_current_span(),
        );
        let failed = |reason: String| Command::ShardFailed {
            task: a.task,
            shard: a.shard,
            epoch: a.epoch,
            node: self.me,
            reason,
        };
        let started = Instant::now();
        let mark = |stage| self.timeline.mark(a.task, stage);
        let outputs = match self.runner.run(&spec, &submitter, a.shard, mark).await {
            Ok((outputs, _)) => {
                counts.run_seconds.observe(started.elapsed().as_secs_f64());
                outputs
            }
            Err(ShardError::Fatal(reason)) => {
                counts.failed.inc();
                tracing::warn!(%reason, "shard cannot succeed; failing its task");
                let command = Command::TaskFailed {
                    task: a.task,
                    shard: a.shard,
                    epoch: a.epoch,
                    node: self.me,
                    reason,
                };
                if let Err(e) = self.consensus.propose(command).await {
                    tracing::warn!(error = %e, "could not report the task's failure");
                }
                return;
            }
            Err(ShardError::Retry(reason)) => {
                counts.failed.inc();
                tracing::warn!(%reason, "shard failed");
                if let Err(e) = self.consensus.propose(failed(reason)).await {
                    tracing::warn!(error = %e, "could not report the shard's failure");
                }
                return;
            }
        };
        // Cancelled (or finished by other attempts) while on the GPU: nothing to
        // store, copy or record.
        let live = self
            .consensus
            .read_local(|s| s.task(a.task).is_some_and(|t| !t.status.is_terminal()));
        if !live {
            tracing::debug!(
                "the task finished or was cancelled while the shard ran; result dropped"
            );
            return;
        }
        // Storing, copying to a second node and recording the result overlap with
        // the next shard on the GPU; the permit bounds how many are in flight.
        let permit = self.post.clone().acquire_owned().await;
        let (blobs, counts) = (self.runner.blobs.clone(), self.runner.counts.clone());
        let consensus = self.consensus.clone();
        let me = self.me;
        let timeline = self.timeline.clone();
        tokio::spawn(
            async move {
                let _permit = permit;
                let command = match store_and_copy(&blobs, &outputs, &submitter).await {
                    Ok((blob, size, inline)) => Command::ShardResult {
                        task: a.task,
                        shard: a.shard,
                        epoch: a.epoch,
                        node: me,
                        blob,
                        size,
                        inline,
                    },
                    Err(reason) => {
                        counts.failed.inc();
                        tracing::warn!(%reason, "shard output could not be kept");
                        Command::ShardFailed {
                            task: a.task,
                            shard: a.shard,
                            epoch: a.epoch,
                            node: me,
                            reason,
                        }
                    }
                };
                let is_result = matches!(command, Command::ShardResult { .. });
                if is_result {
                    timeline.mark(a.task, Stage::Kept);
                }
                match consensus.propose(command).await {
                    // Applied: the result came from a live attempt and was recorded.
                    Ok(c) if is_result && c.outcome == Outcome::Applied => {
                        timeline.mark(a.task, Stage::Recorded);
                        counts.done.inc();
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "could not report the shard's outcome"),
                }
            }
            .in_current_span(),
        );
    }
}

impl ShardRunner {
    /// Runs shard `shard` of a task; returns its outputs and how long the GPU took.
    /// `mark` is told when the GPU thread takes the shard and when its changes are
    /// read back.
    pub async fn run(
        &self,
        spec: &TaskSpec,
        submitter: &str,
        shard: u32,
        mark: impl Fn(Stage),
    ) -> Result<(ShardChanges, Duration), ShardError> {
        for b in &spec.bindings {
            if let Some(blob) = b.role.blob() {
                self.ensure_blob(blob, submitter)
                    .await
                    .map_err(ShardError::Retry)?;
            }
        }
        if let Some(delay) = self.faults.gpu_delay {
            tokio::time::sleep(delay).await;
        }
        let kernel = self
            .kernels
            .get(&spec.shader, &spec.entry_point)
            .map_err(|e| ShardError::Retry(e.to_string()))?;
        let blobs = self.blobs.store().clone();
        let job = Job::new(spec.clone(), kernel, |id| {
            blobs.get(id).ok().flatten().map(Arc::from)
        })
        .map_err(|e| ShardError::Retry(e.to_string()))?;
        let deadline = spec
            .options
            .deadline_ms
            .map_or(self.default_deadline, Duration::from_millis);
        mark(Stage::GpuStart);
        let mut out = self
            .gpu
            .run(job, shard, Some(deadline))
            .await
            .map_err(|e| match e {
                // Runs past its deadline again anywhere: not worth two more tries.
                ExecError::Deadline { .. } => ShardError::Fatal(format!(
                    "{e} (does the shader ever finish? the GPU was recovered)"
                )),
                // Every node stops its loops at a bound (the same one unless set
                // otherwise): another try would run up to it again.
                ExecError::LoopBound { .. } => ShardError::Fatal(e.to_string()),
                other => ShardError::Retry(other.to_string()),
            })?;
        mark(Stage::GpuDone);
        tracing::debug!(gpu_ms = out.elapsed.as_secs_f64() * 1e3, "shard ran");
        if self.faults.corrupt_outputs {
            if let Some(byte) = out
                .changes
                .0
                .values_mut()
                .flat_map(|c| c.values_mut().iter_mut())
                .next()
            {
                *byte ^= 1;
            }
        }
        Ok((out.changes, out.elapsed))
    }

    /// Makes blob `id` local: from the submitter first, then from any peer.
    async fn ensure_blob(&self, id: BlobId, submitter: &str) -> Result<(), String> {
        self.blobs
            .fetch(id, submitter.parse().ok())
            .await
            .map_err(|e| format!("input {e}"))
    }
}

/// A shard's result (the words it changed), kept: a small one rides in its
/// `ShardResult` entry (the log puts it on a quorum, and each member stores it as a
/// blob on applying it when the record does not keep it); a larger one is stored as
/// a blob here and on a second node before it is reported. Returns its id, its
/// size, and its bytes when they ride in the entry.
pub(crate) async fn store_and_copy(
    blobs: &BlobsHandle,
    changes: &ShardChanges,
    submitter: &str,
) -> Result<(BlobId, u64, Option<Vec<u8>>), String> {
    let bytes = changes.encode();
    let size = bytes.len() as u64;
    if bytes.len() <= gpumesh_consensus::MAX_CARRIED_RESULT {
        return Ok((BlobId::of(&bytes), size, Some(bytes)));
    }
    let id = blobs
        .put_and_copy(bytes, submitter.parse().ok())
        .await
        .map_err(|e| e.to_string())?;
    Ok((id, size, None))
}

/// Faults a node can be told to inject into its own work.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Sleep this long before each shard (a slow or overloaded GPU).
    pub gpu_delay: Option<Duration>,
    /// Flip a bit in every shard output before reporting it (a faulty GPU).
    pub corrupt_outputs: bool,
}

/// How long to wait between attempts when nothing is known yet.
pub const RETRY: Duration = Duration::from_millis(200);
