//! The executor: one adapter, one device, and the pipelines built on it.
//!
//! It runs a [`Job`]'s shards: uploads the inputs and the in-out buffers' starting
//! contents once (and keeps them resident, by content, for later tasks up to a byte
//! budget), then per shard gives every writable buffer its starting contents (zeros,
//! the merge rule's identity, or a device-side copy of the in-out file), dispatches
//! the instrumented kernel once per tile of at most
//! `max_compute_workgroups_per_dimension` workgroups, reads the writable buffers back
//! and keeps only the words the shard changed. Every wait is bounded by the task's deadline.
//! A deadline overrun or a lost device abandons the device (dropped on a side
//! thread, since a runaway dispatch may never let it go) and builds a fresh one, so
//! the next task runs.

mod chain;
mod readback;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpumesh_protocol::{
    BindingRole, BindingSpec, BlobId, BufferChanges, DeviceKind, Grid, MergeRule, NodeCapability,
    ShaderSource, ShardChanges, TaskSpec,
};
use wgpu::util::DeviceExt;

use crate::adapter::{self, BackendChoice};
use crate::error::{ExecError, Result};
use crate::job::{InputBuffer, Job, ShardOutput, Start, Writable};
use crate::kernel::{Access, Kernel, SHARD_INFO_GROUP};
use crate::shard::{self, ShardRange, SHARD_INFO_BYTES};
use crate::turns;
use readback::Readback;

pub use chain::ChainOutput;

/// Limits the executor applies on top of the adapter's own.
#[derive(Clone, Copy, Debug)]
pub struct ExecutorLimits {
    /// Most workgroups one task's grid may have in total.
    pub max_grid_workgroups: u64,
    /// Deadline applied when a run names none.
    pub default_deadline: Duration,
    /// Compiled pipelines kept before the cache is cleared.
    pub pipeline_cache_entries: usize,
    /// Bytes of input buffers kept on the device for reuse by later tasks.
    pub resident_input_bytes: u64,
    /// Loop turns one invocation may run in all before every loop of it breaks and
    /// the run is refused ([`ExecError::LoopBound`]), on an adapter that does not
    /// end loops sooner itself; `None` lets loops run as written there.
    pub loop_bound: Option<u32>,
}

/// [`ExecutorLimits::loop_bound`] unless set: 2^24 turns of one invocation's
/// open-ended loops, tens of milliseconds of that one invocation's own time on a
/// GPU (a few nanoseconds a dependent turn), far past what a kernel spread over
/// invocations asks of one. It has to be small enough that a never-ending loop
/// in every invocation of a wide dispatch frees the GPU soon: 256k invocations
/// (4,000 workgroups of 64) of a four-instruction loop at 2^24 turns each are
/// about 2^46 instructions, about a second on an H100; at 2^30 it was a minute.
pub const DEFAULT_LOOP_BOUND: u32 = 1 << 24;

impl Default for ExecutorLimits {
    fn default() -> Self {
        ExecutorLimits {
            max_grid_workgroups: 1 << 28,
            default_deadline: Duration::from_secs(300),
            pipeline_cache_entries: 64,
            resident_input_bytes: 512 << 20,
            loop_bound: Some(DEFAULT_LOOP_BOUND),
        }
    }
}

/// A whole task's result.
#[derive(Clone, Debug)]
pub struct TaskOutput {
    pub outputs: BTreeMap<u32, Vec<u8>>,
    pub shards: Vec<ShardTiming>,
    pub elapsed: Duration,
}

#[derive(Clone, Copy, Debug)]
pub struct ShardTiming {
    pub range: ShardRange,
    pub elapsed: Duration,
}

/// What an executor has asked of its device since it was created (across device
/// rebuilds); take the difference of two readings for one run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecutorCounters {
    /// Compute dispatches submitted: one per tile of each shard.
    pub dispatches: u64,
    /// Bytes written from the host into device buffers: inputs that were not already
    /// resident, outputs' initial merge identity, the per-tile shard info.
    pub bytes_to_device: u64,
    /// Bytes read back from the device: each shard's writable buffers.
    pub bytes_from_device: u64,
    /// Buffers made to read results back through; other readbacks reused one.
    pub readback_buffers_made: u64,
}

impl ExecutorCounters {
    /// What happened between `earlier` and this reading.
    pub fn since(&self, earlier: &ExecutorCounters) -> ExecutorCounters {
        ExecutorCounters {
            dispatches: self.dispatches.saturating_sub(earlier.dispatches),
            bytes_to_device: self.bytes_to_device.saturating_sub(earlier.bytes_to_device),
            bytes_from_device: self
                .bytes_from_device
                .saturating_sub(earlier.bytes_from_device),
            readback_buffers_made: self
                .readback_buffers_made
                .saturating_sub(earlier.readback_buffers_made),
        }
    }
}

/// [`ExecutorCounters`] as they are counted, from `&self` methods too.
#[derive(Debug, Default)]
struct Tally {
    dispatches: AtomicU64,
    bytes_to_device: AtomicU64,
    bytes_from_device: AtomicU64,
    readback_buffers_made: AtomicU64,
}

impl Tally {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

struct Pipeline {
    pipeline: wgpu::ComputePipeline,
    user_layout: wgpu::BindGroupLayout,
    info_layout: wgpu::BindGroupLayout,
    /// Built from the kernel's loop-counting module: each dispatch binds a counter
    /// and its run is refused when the count reached this.
    turn_limit: Option<TurnLimit>,
}

/// Where a pipeline's loop turns stop (see [`crate::turns`]).
#[derive(Clone, Copy, Debug)]
struct TurnLimit {
    /// The adapter ends loops once an invocation's turns reach this (Mesa's
    /// software adapters): every loop is counted, in word 0.
    cap: Option<u32>,
    /// The open-ended loops break once an invocation's turns of them reach this
    /// ([`ExecutorLimits::loop_bound`]): counted in word 1.
    bound: Option<u32>,
}

impl TurnLimit {
    /// The error for a run whose counters read `words`, if a limit was reached:
    /// the bound first, which every node would meet again.
    fn check(self, words: [u32; 2], adapter: &str) -> Result<()> {
        if let Some(bound) = self.bound.filter(|b| words[1] >= *b) {
            return Err(ExecError::LoopBound { bound });
        }
        if let Some(cap) = self.cap.filter(|c| words[0] >= *c) {
            return Err(ExecError::LoopCap {
                cap,
                adapter: adapter.to_string(),
            });
        }
        Ok(())
    }
}

struct Gpu {
    device: wgpu::Device,
    queue: wgpu::Queue,
    lost: Arc<Mutex<Option<String>>>,
    readbacks: Arc<Mutex<readback::Pool>>,
    /// Shard-info uniforms by their bytes: most dispatches repeat a few (one tile
    /// of a small grid), and a buffer made with its contents costs a staging copy
    /// in every submission that made one. Never written after it is made.
    infos: Mutex<HashMap<Vec<u8>, wgpu::Buffer>>,
}

/// Shard-info uniforms kept per device; past this many the cache starts over.
const KEPT_INFOS: usize = 64;

/// How long a wait for a submission polls before it blocks, on an adapter that
/// is a GPU: a blocking wait sleeps until the driver wakes the thread, which on
/// NVIDIA's Vulkan driver cost about 40 µs on top of a trivial dispatch's ~60 µs
/// (bench executor (b') on an H100). On a CPU adapter (lavapipe, llvmpipe) the
/// work runs on this machine's cores, which polling would take from it.
const POLL_BEFORE_BLOCKING: Duration = Duration::from_micros(200);

/// Writable buffers a run leaves on the device, by the address of their contents.
type Kept = Vec<(BlobId, wgpu::Buffer)>;

/// The device buffers a job's shards share.
#[derive(Clone, Copy)]
struct Buffers<'a> {
    /// Read-only and uniform bindings.
    inputs: &'a BTreeMap<u32, wgpu::Buffer>,
    /// The starting contents of in-out bindings, copied into each shard's buffer.
    starts: &'a BTreeMap<u32, wgpu::Buffer>,
}

/// How an executor's devices have fared (see [`Executor::device_counts`]).
#[derive(Debug, Default)]
pub struct DeviceCounts {
    rebuilt: AtomicU64,
    abandoned: AtomicU64,
}

impl DeviceCounts {
    /// Devices replaced so far (lost, or left behind by a dispatch past its deadline).
    pub fn rebuilt(&self) -> u64 {
        self.rebuilt.load(Ordering::Acquire)
    }

    /// Replaced devices not yet dropped: each waits for the work submitted to it to
    /// end. One that stays is a dispatch the driver could not stop (a runaway on an
    /// adapter that runs loops as written), still holding the GPU.
    pub fn abandoned(&self) -> u64 {
        self.abandoned.load(Ordering::Acquire)
    }
}

/// Runs jobs on one adapter.
pub struct Executor {
    adapter: wgpu::Adapter,
    gpu: Gpu,
    pipelines: HashMap<[u8; 32], Arc<Pipeline>>,
    /// Input buffers by content, oldest first in `resident_order`.
    resident: HashMap<(BlobId, bool), wgpu::Buffer>,
    resident_order: VecDeque<(BlobId, bool)>,
    resident_bytes: u64,
    capability: NodeCapability,
    limits: ExecutorLimits,
    devices: Arc<DeviceCounts>,
    tally: Tally,
    /// Loop turns per invocation after which this adapter ends loops on its own
    /// (Mesa's software adapters), found when it is opened; `None` where loops run
    /// as written.
    loop_cap: Option<u32>,
}

impl Executor {
    /// Opens the best adapter `choice` allows.
    pub fn new(choice: BackendChoice) -> Result<Self> {
        Self::with_adapter(adapter::choose(choice)?, ExecutorLimits::default())
    }

    /// Opens the best adapter `choice` allows, under these limits.
    pub fn with_limits(choice: BackendChoice, limits: ExecutorLimits) -> Result<Self> {
        Self::with_adapter(adapter::choose(choice)?, limits)
    }

    pub fn with_adapter(adapter: wgpu::Adapter, limits: ExecutorLimits) -> Result<Self> {
        let gpu = open_device(&adapter)?;
        let mut capability = adapter::describe(&adapter);
        capability.memory = limits.resident_input_bytes;
        let mut executor = Executor {
            adapter,
            gpu,
            pipelines: HashMap::new(),
            resident: HashMap::new(),
            resident_order: VecDeque::new(),
            resident_bytes: 0,
            capability,
            limits,
            devices: Arc::default(),
            tally: Tally::default(),
            loop_cap: None,
        };
        // The first dispatch on the device: an adapter that opens but cannot run
        // one (OpenGL through EGL with no display on some NVIDIA machines) is
        // refused here, named, rather than failing every task later.
        executor.loop_cap = executor
            .probe_loop_cap()
            .map_err(|e| ExecError::RequestDevice {
                adapter: format!(
                    "{} ({})",
                    executor.capability.adapter_name,
                    executor.capability.backend.name()
                ),
                reason: format!("it opened but its first dispatch failed: {e}"),
            })?;
        if let Some(cap) = executor.loop_cap {
            tracing::info!(
                cap,
                adapter = %executor.capability.adapter_name,
                "this adapter ends loops after {cap} turns: kernels with loops run counted"
            );
        }
        Ok(executor)
    }

    /// Runs a loop of [`turns::PROBE_TURNS`] turns: `Some(turns that ran)` when the
    /// adapter ended it early.
    fn probe_loop_cap(&mut self) -> Result<Option<u32>> {
        let spec = TaskSpec {
            shader: ShaderSource::Wgsl(turns::PROBE.into()),
            entry_point: "main".into(),
            bindings: vec![
                BindingSpec {
                    binding: 0,
                    role: BindingRole::Param {
                        data: [turns::PROBE_TURNS, 0, 0, 0]
                            .iter()
                            .flat_map(|w| w.to_le_bytes())
                            .collect(),
                    },
                },
                BindingSpec {
                    binding: 1,
                    role: BindingRole::Output { size: 4 },
                },
            ],
            grid: Grid([1, 1, 1]),
            shards: 1,
            merge: MergeRule::Changes,
            merges: Default::default(),
            options: Default::default(),
        };
        let kernel = Arc::new(Kernel::compile(turns::PROBE, "main")?);
        let job = Job::new(spec, kernel.clone(), |_| None)?;
        // As written: the probe must meet the adapter's cap, not the executor's
        // bound, and its unbounded pipeline is not kept for a task to find.
        let bound = self.limits.loop_bound.take();
        let out = self.run(&job, Some(Duration::from_secs(30)));
        self.limits.loop_bound = bound;
        self.pipelines.remove(&kernel.hash);
        let ran = out?
            .outputs
            .get(&1)
            .and_then(|b| b.get(..4))
            .map_or(0, |w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]));
        Ok((ran < turns::PROBE_TURNS).then_some(ran))
    }

    /// Loop turns after which this adapter ends loops itself, if it does.
    pub fn loop_cap(&self) -> Option<u32> {
        self.loop_cap
    }

    /// The adapter's identity, limits and (once calibrated) speed.
    pub fn capability(&self) -> &NodeCapability {
        &self.capability
    }

    pub(crate) fn set_speed(&mut self, gflops: f64, gbps: f64) {
        self.capability.gflops = gflops;
        self.capability.gbps = gbps;
    }

    /// How many times the device has been rebuilt after a loss or a deadline.
    pub fn rebuilds(&self) -> u64 {
        self.devices.rebuilt()
    }

    /// This executor's device counts, live: they move as devices are rebuilt and as
    /// abandoned ones are finally dropped, between runs too.
    pub fn device_counts(&self) -> Arc<DeviceCounts> {
        self.devices.clone()
    }

    /// Dispatches and bytes moved to and from the device so far.
    pub fn counters(&self) -> ExecutorCounters {
        ExecutorCounters {
            dispatches: self.tally.dispatches.load(Ordering::Relaxed),
            bytes_to_device: self.tally.bytes_to_device.load(Ordering::Relaxed),
            bytes_from_device: self.tally.bytes_from_device.load(Ordering::Relaxed),
            readback_buffers_made: self.tally.readback_buffers_made.load(Ordering::Relaxed),
        }
    }

    pub fn limits(&self) -> ExecutorLimits {
        self.limits
    }

    /// The raw device and queue, for benchmarks that compare against direct wgpu use.
    pub fn device(&self) -> (&wgpu::Device, &wgpu::Queue) {
        (&self.gpu.device, &self.gpu.queue)
    }

    /// Loses the device on purpose, as a driver reset would; the next run rebuilds it.
    pub fn simulate_device_loss(&mut self) {
        self.gpu.device.destroy();
    }

    /// Runs every shard of `job` here and merges the outputs. A job of one shard
    /// whose buffers all merge by changes has its buffers read back as they are:
    /// what it changed over its start, written into that start, is them.
    pub fn run(&mut self, job: &Job, deadline: Option<Duration>) -> Result<TaskOutput> {
        let start = Instant::now();
        let whole = job.plan.len() == 1
            && job
                .writable
                .keys()
                .all(|&b| job.spec.merge_of(b) == MergeRule::Changes);
        let mut shards = self.shards_of(job, &job.plan, deadline, whole)?;
        let timings = shards
            .iter()
            .map(|s| ShardTiming {
                range: s.range,
                elapsed: s.elapsed,
            })
            .collect();
        let outputs = if whole && shards.len() == 1 {
            let only = shards.swap_remove(0);
            only.changes
                .0
                .into_iter()
                .map(|(b, c)| {
                    let bytes = c.into_whole().ok_or_else(|| {
                        ExecError::Gpu(format!("binding {b} was not read back whole"))
                    })?;
                    Ok((b, bytes))
                })
                .collect::<Result<BTreeMap<_, _>>>()?
        } else {
            let changes: Vec<&ShardChanges> = shards.iter().map(|s| &s.changes).collect();
            job.merge(&changes)?
        };
        Ok(TaskOutput {
            outputs,
            shards: timings,
            elapsed: start.elapsed(),
        })
    }

    /// Checks `job` against this adapter's limits (see [`Kernel::fits`]) and this
    /// executor's largest grid.
    pub fn check_limits(&self, job: &Job) -> Result<()> {
        job.kernel.fits(&job.spec, &self.capability.limits)?;
        if job.spec.grid.total() > self.limits.max_grid_workgroups {
            return Err(ExecError::Limit {
                what: format!("grid {} in workgroups", job.spec.grid),
                value: job.spec.grid.total(),
                limit: self.limits.max_grid_workgroups,
            });
        }
        Ok(())
    }

    /// Runs the given shards of `job` one after another, inputs uploaded once.
    pub fn run_shards(
        &mut self,
        job: &Job,
        ranges: &[ShardRange],
        deadline: Option<Duration>,
    ) -> Result<Vec<ShardOutput>> {
        self.shards_of(job, ranges, deadline, false)
    }

    /// [`Self::run_shards`]; with `whole`, each writable buffer comes back whole
    /// ([`BufferChanges::whole`]) instead of as the words it changed.
    fn shards_of(
        &mut self,
        job: &Job,
        ranges: &[ShardRange],
        deadline: Option<Duration>,
        whole: bool,
    ) -> Result<Vec<ShardOutput>> {
        self.check_limits(job)?;
        self.rebuild_if_lost();
        let deadline = deadline.unwrap_or(self.limits.default_deadline);
        let started = Instant::now();
        let pipeline = self.pipeline(&job.kernel)?;
        self.guarded(job, "device lost during the task", |me| {
            let inputs = me.upload(&job.inputs);
            let starts: BTreeMap<u32, &InputBuffer> = job
                .writable
                .iter()
                .filter_map(|(&b, w)| match &w.start {
                    Start::Blob(input) => Some((b, input)),
                    Start::Fill(_) => None,
                })
                .collect();
            let starts = me.upload(starts.iter().map(|(b, i)| (b, *i)));
            let buffers = Buffers {
                inputs: &inputs,
                starts: &starts,
            };
            me.dispatch_shards(job, &pipeline, buffers, ranges, (started, deadline), whole)
        })
    }

    /// Runs `run` (which submits work and waits for it) inside validation and
    /// out-of-memory error scopes. On success the buffers it kept take the place on
    /// the device of `keeper`'s kept starts (a kept buffer started from an older
    /// version of itself: the new version replaces it). A deadline overrun or a lost
    /// device (`lost` says where, when nothing better does) rebuilds the device.
    fn guarded<T>(
        &mut self,
        keeper: &Job,
        lost: &str,
        run: impl FnOnce(&mut Self) -> Result<(T, Kept)>,
    ) -> Result<T> {
        let device = self.gpu.device.clone();
        device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        device.push_error_scope(wgpu::ErrorFilter::Validation);
        let result = run(self);
        let validation = pollster::block_on(device.pop_error_scope());
        let oom = pollster::block_on(device.pop_error_scope());
        let result = match (result, validation.or(oom)) {
            (Ok(_), Some(e)) => Err(ExecError::Gpu(e.to_string())),
            (Ok((out, kept)), None) => {
                let replaced: Vec<BlobId> = keeper
                    .keep
                    .iter()
                    .filter_map(|b| match &keeper.writable.get(b)?.start {
                        Start::Blob(input) => Some(input.id),
                        Start::Fill(_) => None,
                    })
                    .collect();
                self.forget(&replaced);
                for (id, buffer) in kept {
                    self.make_resident((id, false), buffer);
                }
                Ok(out)
            }
            (Err(e), _) => Err(e),
        };
        match result {
            Err(ExecError::Deadline { .. } | ExecError::DeviceLost(_)) => {
                self.rebuild();
                result
            }
            // Whatever failed, a device that was lost meanwhile is the reason.
            Err(_) if self.is_lost() => {
                let lost = self.lost_or(lost);
                self.rebuild();
                Err(lost)
            }
            _ => result,
        }
    }

    fn dispatch_shards(
        &self,
        job: &Job,
        pipeline: &Pipeline,
        buffers: Buffers<'_>,
        ranges: &[ShardRange],
        (started, deadline): (Instant, Duration),
        whole: bool,
    ) -> Result<(Vec<ShardOutput>, Kept)> {
        let mut out = Vec::with_capacity(ranges.len());
        let mut kept = Vec::new();
        for range in ranges {
            let shard_start = Instant::now();
            let (changes, keep) =
                self.dispatch_one(job, pipeline, buffers, range, (started, deadline), whole)?;
            kept.extend(keep);
            out.push(ShardOutput {
                range: *range,
                changes,
                elapsed: shard_start.elapsed(),
            });
        }
        Ok((out, kept))
    }

    /// GPU buffers for `inputs`, uploaded unless already resident. Inputs are
    /// immutable and content-addressed, so a buffer can serve every later task that
    /// binds the same bytes (a chained solver's matrix, a benchmark's repeated runs,
    /// the starting contents of an in-out buffer that every shard copies).
    fn upload<'a>(
        &mut self,
        inputs: impl IntoIterator<Item = (&'a u32, &'a InputBuffer)>,
    ) -> BTreeMap<u32, wgpu::Buffer> {
        let mut buffers = BTreeMap::new();
        for (&binding, input) in inputs {
            let key = (input.id, input.uniform);
            if let Some(buffer) = self.resident.get(&key) {
                buffers.insert(binding, buffer.clone());
                continue;
            }
            let (usage, align) = if input.uniform {
                (wgpu::BufferUsages::UNIFORM, 16)
            } else {
                (
                    wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
                    4,
                )
            };
            let mut contents = input.bytes.to_vec();
            contents.resize(contents.len().div_ceil(align).max(1) * align, 0);
            let buffer = self
                .gpu
                .device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("gpumesh input"),
                    contents: &contents,
                    usage,
                });
            Tally::add(&self.tally.bytes_to_device, contents.len() as u64);
            self.make_resident(key, buffer.clone());
            buffers.insert(binding, buffer);
        }
        buffers
    }

    /// Drops the buffers kept on the device for these contents (an actor deleted or
    /// moved away); a later job that binds them uploads them again.
    pub fn forget(&mut self, ids: &[BlobId]) {
        let before = self.resident.len();
        for id in ids {
            for uniform in [false, true] {
                if let Some(buffer) = self.resident.remove(&(*id, uniform)) {
                    self.resident_bytes -= buffer.size();
                }
            }
        }
        if self.resident.len() != before {
            self.resident_order
                .retain(|k| self.resident.contains_key(k));
        }
    }

    /// Bytes of buffers kept on the device for later jobs.
    pub fn resident_bytes(&self) -> u64 {
        self.resident_bytes
    }

    /// Keeps `buffer` on the device as the contents `key` names, for later jobs,
    /// evicting the oldest resident buffers past the byte budget (a buffer over the
    /// whole budget is not kept).
    fn make_resident(&mut self, key: (BlobId, bool), buffer: wgpu::Buffer) {
        let size = buffer.size();
        if size > self.limits.resident_input_bytes || self.resident.contains_key(&key) {
            return;
        }
        while self.resident_bytes + size > self.limits.resident_input_bytes {
            let Some(old) = self.resident_order.pop_front() else {
                break;
            };
            if let Some(evicted) = self.resident.remove(&old) {
                self.resident_bytes -= evicted.size();
            }
        }
        self.resident.insert(key, buffer);
        self.resident_order.push_back(key);
        self.resident_bytes += size;
    }

    fn dispatch_one(
        &self,
        job: &Job,
        pipeline: &Pipeline,
        buffers: Buffers<'_>,
        range: &ShardRange,
        (started, deadline): (Instant, Duration),
        whole: bool,
    ) -> Result<(ShardChanges, Kept)> {
        let device = &self.gpu.device;
        let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("gpumesh shard"),
        });
        let mut outputs = BTreeMap::new();
        let mut bound = BTreeMap::new();
        for (&binding, writable) in &job.writable {
            let buffer = self.writable_buffer(&mut encoder, binding, writable, buffers.starts)?;
            bound.insert(binding, buffer.clone());
            outputs.insert(binding, (buffer, self.staging(writable.size)));
        }
        let (mut turns, tiles) =
            self.encode_pass(&mut encoder, job, pipeline, buffers.inputs, &bound, range)?;
        for (buffer, staging) in outputs.values() {
            encoder.copy_buffer_to_buffer(buffer, 0, staging.buffer(), 0, buffer.size());
        }
        let submission = self.gpu.queue.submit([encoder.finish()]);
        Tally::add(&self.tally.dispatches, tiles as u64);
        let (turns_tx, turns_rx) = mpsc::channel();
        if let Some((_, staging)) = &turns {
            staging.slice().map_async(wgpu::MapMode::Read, move |r| {
                let _ = turns_tx.send(r);
            });
        }

        let (tx, rx) = mpsc::channel();
        for (&binding, (_, staging)) in &outputs {
            let tx = tx.clone();
            staging.slice().map_async(wgpu::MapMode::Read, move |r| {
                let _ = tx.send((binding, r));
            });
        }
        drop(tx);
        self.wait(submission, started, deadline)?;
        for _ in 0..outputs.len() {
            match rx.try_recv() {
                Ok((_, Ok(()))) => {}
                Ok((binding, Err(e))) => {
                    return Err(ExecError::Gpu(format!(
                        "reading back binding {binding}: {e}"
                    )))
                }
                Err(_) => return Err(self.lost_or("readback did not complete")),
            }
        }
        if let (Some((_, staging)), Some(limit)) = (&mut turns, pipeline.turn_limit) {
            match turns_rx.try_recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(ExecError::Gpu(format!("reading back loop turns: {e}"))),
                Err(_) => return Err(self.lost_or("readback did not complete")),
            }
            limit.check(read_turns(staging), &self.capability.adapter_name)?;
        }
        let mut result = BTreeMap::new();
        let mut kept = Vec::new();
        for (binding, (buffer, mut staging)) in outputs {
            let changes = {
                let after = staging.slice().get_mapped_range();
                Tally::add(&self.tally.bytes_from_device, after.len() as u64);
                if job.keep.contains(&binding) {
                    kept.push((BlobId::of(&after), buffer));
                }
                if whole {
                    BufferChanges::whole(&after)
                } else {
                    BufferChanges::diff(job.writable[&binding].base(), &after)
                }
            };
            staging.unmap();
            result.insert(binding, changes);
        }
        Ok((ShardChanges(result), kept))
    }

    /// Waits for `submission` within what is left of the deadline.
    /// A new device buffer for writable binding `binding`, holding its start: new
    /// buffers are zeroed; other fills are written through the queue (mapping at
    /// creation would panic inside wgpu on a lost device), and an in-out buffer is
    /// copied in `encoder` from its uploaded start in `starts`.
    fn writable_buffer(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        binding: u32,
        writable: &Writable,
        starts: &BTreeMap<u32, wgpu::Buffer>,
    ) -> Result<wgpu::Buffer> {
        let size = writable.size;
        let buffer = self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("gpumesh writable"),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        match &writable.start {
            Start::Fill([0, 0, 0, 0]) => {}
            Start::Fill(word) => {
                let pattern: Vec<u8> = word.iter().copied().cycle().take(size as usize).collect();
                self.gpu.queue.write_buffer(&buffer, 0, &pattern);
                Tally::add(&self.tally.bytes_to_device, size);
            }
            Start::Blob(_) => {
                let start = starts.get(&binding).ok_or_else(|| ExecError::Binding {
                    binding,
                    problem: "its starting contents were not uploaded".into(),
                })?;
                encoder.copy_buffer_to_buffer(start, 0, &buffer, 0, size);
            }
        }
        Ok(buffer)
    }

    /// A buffer to read `size` bytes back through.
    fn staging(&self, size: u64) -> Readback {
        let (readback, made) = Readback::new(&self.gpu.device, &self.gpu.readbacks, size);
        if made {
            Tally::add(&self.tally.readback_buffers_made, 1);
        }
        readback
    }

    /// Encodes `job`'s dispatches over `range` (one per tile) into `encoder`, its
    /// bindings bound to `inputs` and `writable`. Returns the loop-turn counter and
    /// the buffer it is copied to for reading, when the pipeline counts turns, and
    /// the number of dispatches.
    fn encode_pass(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        job: &Job,
        pipeline: &Pipeline,
        inputs: &BTreeMap<u32, wgpu::Buffer>,
        writable: &BTreeMap<u32, wgpu::Buffer>,
        range: &ShardRange,
    ) -> Result<(Option<(wgpu::Buffer, Readback)>, usize)> {
        let device = &self.gpu.device;
        let wg = job.kernel.interface.workgroup_size;
        let tiles = shard::dispatches(
            range,
            job.spec.grid,
            self.capability.limits.max_compute_workgroups_per_dimension,
        );
        let stride = SHARD_INFO_BYTES.next_multiple_of(u64::from(
            device.limits().min_uniform_buffer_offset_alignment,
        ));
        let mut info = vec![0u8; (stride * tiles.len() as u64) as usize];
        for (i, tile) in tiles.iter().enumerate() {
            let words = shard::shard_info(tile, job.spec.grid, wg);
            let at = i * stride as usize;
            info[at..at + SHARD_INFO_BYTES as usize].copy_from_slice(bytemuck::cast_slice(&words));
        }
        let info = {
            let mut infos = self.gpu.infos.lock().unwrap_or_else(|p| p.into_inner());
            match infos.get(&info) {
                Some(buffer) => buffer.clone(),
                None => {
                    let buffer = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                        label: Some("gpumesh shard info"),
                        contents: &info,
                        usage: wgpu::BufferUsages::UNIFORM,
                    });
                    Tally::add(&self.tally.bytes_to_device, buffer.size());
                    if infos.len() >= KEPT_INFOS {
                        infos.clear();
                    }
                    infos.insert(info, buffer.clone());
                    buffer
                }
            }
        };

        let entries: Vec<wgpu::BindGroupEntry> = job
            .kernel
            .interface
            .bindings
            .keys()
            .map(|binding| {
                let buffer = inputs
                    .get(binding)
                    .or_else(|| writable.get(binding))
                    .ok_or_else(|| ExecError::Binding {
                        binding: *binding,
                        problem: "has no buffer".into(),
                    })?;
                Ok(wgpu::BindGroupEntry {
                    binding: *binding,
                    resource: buffer.as_entire_binding(),
                })
            })
            .collect::<Result<_>>()?;
        let user_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("gpumesh bindings"),
            layout: &pipeline.user_layout,
            entries: &entries,
        });
        // The most loop turns of any invocation, where they are limited.
        let turns = pipeline.turn_limit.is_some().then(|| {
            (
                device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("gpumesh loop turns"),
                    size: turns::TURNS_BYTES,
                    usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: false,
                }),
                self.staging(turns::TURNS_BYTES),
            )
        });
        let mut info_entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &info,
                offset: 0,
                size: NonZeroU64::new(SHARD_INFO_BYTES),
            }),
        }];
        if let Some((counter, _)) = &turns {
            info_entries.push(wgpu::BindGroupEntry {
                binding: turns::TURNS_BINDING,
                resource: counter.as_entire_binding(),
            });
        }
        let info_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("gpumesh shard info"),
            layout: &pipeline.info_layout,
            entries: &info_entries,
        });

        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("gpumesh shard"),
                timestamp_writes: None,
            });
            pass.set_pipeline(&pipeline.pipeline);
            pass.set_bind_group(0, &user_group, &[]);
            for (i, tile) in tiles.iter().enumerate() {
                pass.set_bind_group(SHARD_INFO_GROUP, &info_group, &[(i as u64 * stride) as u32]);
                pass.dispatch_workgroups(tile.groups[0], tile.groups[1], tile.groups[2]);
            }
        }
        if let Some((counter, staging)) = &turns {
            encoder.copy_buffer_to_buffer(counter, 0, staging.buffer(), 0, turns::TURNS_BYTES);
        }
        Ok((turns, tiles.len()))
    }

    fn wait(
        &self,
        submission: wgpu::SubmissionIndex,
        started: Instant,
        deadline: Duration,
    ) -> Result<()> {
        // Polled first on a GPU (see POLL_BEFORE_BLOCKING). An empty queue means
        // every submission so far, this one included, is done (and the poll has run
        // its map callbacks); otherwise the blocking wait below takes over.
        if self.capability.device_kind != DeviceKind::Cpu {
            let until = Instant::now() + POLL_BEFORE_BLOCKING;
            while Instant::now() < until && started.elapsed() <= deadline {
                match self.gpu.device.poll(wgpu::PollType::Poll) {
                    Ok(status) if status.is_queue_empty() => {
                        if started.elapsed() > deadline {
                            return Err(ExecError::Deadline { deadline });
                        }
                        return Ok(());
                    }
                    Ok(_) => std::hint::spin_loop(),
                    Err(e) => return Err(self.lost_or(&e.to_string())),
                }
            }
        }
        // A second at a time at most, as an abandoned device's drop thread waits
        // (see `wait_abandoned`): a deadline of minutes is not one wait that long.
        loop {
            let left = deadline.saturating_sub(started.elapsed());
            let polled = self.gpu.device.poll(wgpu::PollType::Wait {
                submission_index: Some(submission.clone()),
                timeout: Some(left.clamp(Duration::from_millis(1), LONGEST_WAIT)),
            });
            match polled {
                Ok(_) if started.elapsed() <= deadline => return Ok(()),
                Err(wgpu::PollError::Timeout) if started.elapsed() < deadline => continue,
                // Backends that execute at submit (GL) cannot be interrupted; the
                // overrun is still reported.
                Ok(_) | Err(wgpu::PollError::Timeout) => {
                    return Err(ExecError::Deadline { deadline })
                }
                Err(e) => return Err(self.lost_or(&e.to_string())),
            }
        }
    }

    fn lost_or(&self, fallback: &str) -> ExecError {
        let reason = self
            .gpu
            .lost
            .lock()
            .ok()
            .and_then(|l| l.clone())
            .unwrap_or_else(|| fallback.to_string());
        ExecError::DeviceLost(reason)
    }

    fn is_lost(&self) -> bool {
        let _ = self.gpu.device.poll(wgpu::PollType::Poll);
        self.gpu.lost.lock().map(|l| l.is_some()).unwrap_or(true)
    }

    fn rebuild_if_lost(&mut self) {
        if self.is_lost() {
            self.rebuild();
        }
    }

    /// Replaces the device. The old one is dropped on its own thread once the work
    /// submitted to it has ended: destroying a device while a dispatch still runs
    /// on it crashes Mesa's software adapters (the process, not just the device).
    /// A dispatch that never ends holds it forever; the executor does not wait.
    fn rebuild(&mut self) {
        match open_device(&self.adapter) {
            Ok(gpu) => {
                let old = std::mem::replace(&mut self.gpu, gpu);
                let devices = self.devices.clone();
                devices.abandoned.fetch_add(1, Ordering::AcqRel);
                let dropping = std::thread::Builder::new()
                    .name("gpumesh-device-drop".into())
                    .spawn(move || {
                        wait_abandoned(&old.device);
                        drop(old);
                        devices.abandoned.fetch_sub(1, Ordering::AcqRel);
                    });
                if dropping.is_err() {
                    // Dropped here instead, with the closure that held it.
                    self.devices.abandoned.fetch_sub(1, Ordering::AcqRel);
                }
                self.pipelines.clear();
                self.resident.clear();
                self.resident_order.clear();
                self.resident_bytes = 0;
                let rebuilds = self.devices.rebuilt.fetch_add(1, Ordering::AcqRel) + 1;
                tracing::warn!(rebuilds, "GPU device rebuilt");
            }
            Err(e) => tracing::error!(error = %e, "could not rebuild the GPU device"),
        }
    }

    /// The module `kernel` runs as here, and where its loop turns stop: its
    /// open-ended loops bounded where the bound applies (no cap of the adapter's own
    /// comes first), every loop counted where the adapter caps them, as written
    /// where neither applies or there is nothing to count.
    fn module_for(&self, kernel: &Kernel) -> (naga::Module, Option<TurnLimit>) {
        let cap = self.loop_cap;
        let bound = self
            .limits
            .loop_bound
            .filter(|b| cap.is_none_or(|cap| *b < cap));
        if let Some(bound) = bound {
            let memory = self.capability.limits.max_compute_workgroup_storage_size;
            match kernel.bounded(bound, cap.is_some(), memory.into()) {
                Ok(Some(module)) => {
                    let limit = TurnLimit {
                        cap,
                        bound: Some(bound),
                    };
                    return (module, Some(limit));
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(
                    error = %e,
                    "this kernel runs with its loops unbounded"
                ),
            }
        }
        match (&kernel.counted, cap) {
            (Some(counted), Some(_)) => (counted.clone(), Some(TurnLimit { cap, bound: None })),
            _ => (kernel.instrumented.clone(), None),
        }
    }

    fn pipeline(&mut self, kernel: &Kernel) -> Result<Arc<Pipeline>> {
        if let Some(p) = self.pipelines.get(&kernel.hash) {
            return Ok(p.clone());
        }
        if self.pipelines.len() >= self.limits.pipeline_cache_entries {
            self.pipelines.clear();
        }
        let device = &self.gpu.device;
        device.push_error_scope(wgpu::ErrorFilter::Validation);
        let (naga_module, turn_limit) = self.module_for(kernel);
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(&kernel.interface.entry_point),
            source: wgpu::ShaderSource::Naga(std::borrow::Cow::Owned(naga_module)),
        });
        let user_entries: Vec<wgpu::BindGroupLayoutEntry> = kernel
            .interface
            .bindings
            .values()
            .map(|b| wgpu::BindGroupLayoutEntry {
                binding: b.binding,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: match b.access {
                        Access::Uniform => wgpu::BufferBindingType::Uniform,
                        Access::ReadOnly => wgpu::BufferBindingType::Storage { read_only: true },
                        Access::ReadWrite => wgpu::BufferBindingType::Storage { read_only: false },
                    },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            })
            .collect();
        let user_layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("gpumesh bindings"),
            entries: &user_entries,
        });
        let mut info_entries = vec![wgpu::BindGroupLayoutEntry {
            binding: 0,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Uniform,
                has_dynamic_offset: true,
                min_binding_size: NonZeroU64::new(SHARD_INFO_BYTES),
            },
            count: None,
        }];
        if turn_limit.is_some() {
            info_entries.push(wgpu::BindGroupLayoutEntry {
                binding: turns::TURNS_BINDING,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage { read_only: false },
                    has_dynamic_offset: false,
                    min_binding_size: NonZeroU64::new(turns::TURNS_BYTES),
                },
                count: None,
            });
        }
        let info_layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("gpumesh shard info"),
            entries: &info_entries,
        });
        let layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("gpumesh"),
            bind_group_layouts: &[&user_layout, &info_layout],
            push_constant_ranges: &[],
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(&kernel.interface.entry_point),
            layout: Some(&layout),
            module: &module,
            entry_point: Some(&kernel.interface.entry_point),
            // The module zeroes its workgroup memory itself (`crate::zero`).
            compilation_options: wgpu::PipelineCompilationOptions {
                zero_initialize_workgroup_memory: false,
                ..Default::default()
            },
            cache: None,
        });
        if let Some(e) = pollster::block_on(device.pop_error_scope()) {
            return Err(ExecError::Gpu(format!("building the pipeline failed: {e}")));
        }
        let p = Arc::new(Pipeline {
            pipeline,
            user_layout,
            info_layout,
            turn_limit,
        });
        self.pipelines.insert(kernel.hash, p.clone());
        Ok(p)
    }
}

/// The loop-turn counters' words (see [`crate::turns`]), from their read-back.
fn read_turns(staging: &mut Readback) -> [u32; 2] {
    let words = {
        let w = staging.slice().get_mapped_range();
        [
            u32::from_le_bytes([w[0], w[1], w[2], w[3]]),
            u32::from_le_bytes([w[4], w[5], w[6], w[7]]),
        ]
    };
    staging.unmap();
    words
}

/// The longest one wait for a device's work lasts (the executor's, and an abandoned
/// device's drop thread's); a longer one is several.
const LONGEST_WAIT: Duration = Duration::from_secs(1);
/// How often a device still busy after it was abandoned is reported.
const ABANDONED_REPORT: Duration = Duration::from_secs(60);

/// Waits until the work submitted to `device` (abandoned: nothing more will be)
/// has ended or the device is lost, a second at a time: a wait never parks in the
/// driver for longer, holding the device's locks in wgpu-core all the while. A
/// device still busy is reported each minute, with how long it has waited: a
/// dispatch that neither ends nor is stopped (its loops unbounded, or a driver
/// that never signals), which the `abandoned` count shows too.
fn wait_abandoned(device: &wgpu::Device) {
    let since = Instant::now();
    let mut reported = since;
    loop {
        let polled = device.poll(wgpu::PollType::Wait {
            submission_index: None,
            timeout: Some(LONGEST_WAIT),
        });
        match polled {
            Err(wgpu::PollError::Timeout) => {}
            // Done, or lost (nothing runs on it any more).
            Ok(_) | Err(_) => return,
        }
        if reported.elapsed() >= ABANDONED_REPORT {
            reported = Instant::now();
            tracing::warn!(
                waited_s = since.elapsed().as_secs(),
                "an abandoned GPU device is still busy: the work left on it has not ended"
            );
        }
    }
}

fn open_device(adapter: &wgpu::Adapter) -> Result<Gpu> {
    let info = adapter.get_info();
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("gpumesh"),
        required_features: wgpu::Features::empty(),
        required_limits: adapter.limits(),
        ..Default::default()
    }))
    .map_err(|e| ExecError::RequestDevice {
        adapter: info.name.clone(),
        reason: e.to_string(),
    })?;
    let lost = Arc::new(Mutex::new(None));
    let flag = lost.clone();
    device.set_device_lost_callback(move |reason, message| {
        tracing::warn!(?reason, %message, "GPU device lost");
        if let Ok(mut l) = flag.lock() {
            *l = Some(format!("{reason:?}: {message}"));
        }
    });
    device.on_uncaptured_error(Arc::new(|e| {
        tracing::error!(error = %e, "uncaptured GPU error");
    }));
    Ok(Gpu {
        device,
        queue,
        lost,
        readbacks: Default::default(),
        infos: Default::default(),
    })
}
