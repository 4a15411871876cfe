//! Jobs chained in one submission: an actor's batch of calls, each on the state the
//! one before left, with nothing read back between them. The carried buffers are
//! one device buffer each, written in place by every job in turn (the same as each
//! job copying the last one's result, which the one-at-a-time path does through the
//! host); every job's other writable buffers are its own, read back at the end with
//! the carried buffers' final contents.

use super::*;

/// What a chain of jobs left.
#[derive(Debug)]
pub struct ChainOutput {
    /// Each job's own writable buffers (not the carried ones), whole, by binding.
    pub outputs: Vec<BTreeMap<u32, Vec<u8>>>,
    /// The carried buffers' contents after the last job, by binding.
    pub carried: BTreeMap<u32, Vec<u8>>,
    /// From submission to the last byte read back.
    pub elapsed: Duration,
}

impl Executor {
    /// Runs `jobs` (one shard each) one after another in one submission. Each
    /// binding in `carry` is a writable buffer of every job, shared in place: it
    /// starts as the first job's start (the later jobs' own starts there are not
    /// used) and each job sees what the one before left. A carried buffer the first
    /// job keeps resident stays on the device under its final contents' address.
    ///
    /// A job whose loop turns are limited (see [`crate::turns`]) has its own
    /// counter, read back with the outputs; one that reached its limit fails the
    /// chain. An error fails the whole chain, and says nothing of which job caused
    /// it; running them one at a time finds it.
    pub fn run_chain(
        &mut self,
        jobs: &[Job],
        carry: &[u32],
        deadline: Option<Duration>,
    ) -> Result<ChainOutput> {
        let Some(first) = jobs.first() else {
            return Ok(ChainOutput {
                outputs: Vec::new(),
                carried: BTreeMap::new(),
                elapsed: Duration::ZERO,
            });
        };
        for job in jobs {
            self.check_limits(job)?;
            if job.plan.len() != 1 {
                return Err(ExecError::Task(format!(
                    "a chained job runs as one shard; this one has {}",
                    job.plan.len()
                )));
            }
            for b in carry {
                let (Some(mine), Some(theirs)) = (job.writable.get(b), first.writable.get(b))
                else {
                    return Err(ExecError::Binding {
                        binding: *b,
                        problem: "is carried through the chain but not writable in every job"
                            .into(),
                    });
                };
                if mine.size != theirs.size {
                    return Err(ExecError::Binding {
                        binding: *b,
                        problem: "is carried through the chain at different sizes".into(),
                    });
                }
            }
        }
        self.rebuild_if_lost();
        let pipelines = jobs
            .iter()
            .map(|j| self.pipeline(&j.kernel))
            .collect::<Result<Vec<_>>>()?;
        let deadline = deadline.unwrap_or(self.limits.default_deadline);
        let started = Instant::now();
        self.guarded(first, "device lost during the chain", |me| {
            me.encode_chain(jobs, &pipelines, carry, started, deadline)
        })
    }

    /// Runs independent one-shard `jobs` in one submission (a chain that carries
    /// nothing): each job's writable buffers are its own, and its shard's changes
    /// are against its own starts, as [`Executor::run_shards`] gives them. What one
    /// submission saves over one per job is the driver's wake-ups and waits, most of
    /// a tiny job's cost.
    ///
    /// `Ok(None)` when a job keeps a buffer on the device or has several shards:
    /// run them one at a time. An error says
    /// nothing of which job caused it; running them one at a time finds it. Each
    /// job's `elapsed` is an equal part of the batch's.
    pub fn run_batch(
        &mut self,
        jobs: &[Job],
        deadline: Option<Duration>,
    ) -> Result<Option<Vec<ShardOutput>>> {
        if jobs.iter().any(|j| !j.keep.is_empty() || j.plan.len() != 1) {
            return Ok(None);
        }
        let out = self.run_chain(jobs, &[], deadline)?;
        let each = out.elapsed / jobs.len().max(1) as u32;
        jobs.iter()
            .zip(out.outputs)
            .map(|(job, outputs)| {
                let mut changes = BTreeMap::new();
                for (binding, writable) in &job.writable {
                    let after = outputs.get(binding).ok_or_else(|| {
                        ExecError::Gpu(format!("binding {binding} was not read back"))
                    })?;
                    changes.insert(*binding, BufferChanges::diff(writable.base(), after));
                }
                Ok(ShardOutput {
                    range: job.plan[0],
                    changes: ShardChanges(changes),
                    elapsed: each,
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    fn encode_chain(
        &mut self,
        jobs: &[Job],
        pipelines: &[Arc<Pipeline>],
        carry: &[u32],
        started: Instant,
        deadline: Duration,
    ) -> Result<(ChainOutput, Kept)> {
        let first = &jobs[0];
        let mut encoder = self
            .gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("gpumesh chain"),
            });
        // The carried buffers, from the first job's starts.
        let first_starts: BTreeMap<u32, &InputBuffer> = carry
            .iter()
            .filter_map(|b| match &first.writable[b].start {
                Start::Blob(input) => Some((*b, input)),
                Start::Fill(_) => None,
            })
            .collect();
        let first_starts = self.upload(first_starts.iter().map(|(b, i)| (b, *i)));
        let mut carried = BTreeMap::new();
        for b in carry {
            let buffer =
                self.writable_buffer(&mut encoder, *b, &first.writable[b], &first_starts)?;
            carried.insert(*b, buffer);
        }
        let mut own: Vec<BTreeMap<u32, (wgpu::Buffer, Readback)>> = Vec::new();
        let mut counted: Vec<(Readback, TurnLimit)> = Vec::new();
        let mut dispatches = 0;
        for (job, pipeline) in jobs.iter().zip(pipelines) {
            let inputs = self.upload(&job.inputs);
            let starts: BTreeMap<u32, &InputBuffer> = job
                .writable
                .iter()
                .filter(|(b, _)| !carry.contains(b))
                .filter_map(|(&b, w)| match &w.start {
                    Start::Blob(input) => Some((b, input)),
                    Start::Fill(_) => None,
                })
                .collect();
            let starts = self.upload(starts.iter().map(|(b, i)| (b, *i)));
            let mut bound = carried.clone();
            let mut mine = BTreeMap::new();
            for (&binding, writable) in job.writable.iter().filter(|(b, _)| !carry.contains(b)) {
                let buffer = self.writable_buffer(&mut encoder, binding, writable, &starts)?;
                bound.insert(binding, buffer.clone());
                let staging = self.staging(writable.size);
                mine.insert(binding, (buffer, staging));
            }
            let (turns, tiles) =
                self.encode_pass(&mut encoder, job, pipeline, &inputs, &bound, &job.plan[0])?;
            dispatches += tiles;
            if let (Some((_, staging)), Some(limit)) = (turns, pipeline.turn_limit) {
                counted.push((staging, limit));
            }
            for (buffer, staging) in mine.values() {
                encoder.copy_buffer_to_buffer(buffer, 0, staging.buffer(), 0, buffer.size());
            }
            own.push(mine);
        }
        let mut finals: BTreeMap<u32, Readback> = carried
            .iter()
            .map(|(b, buffer)| {
                let staging = self.staging(buffer.size());
                encoder.copy_buffer_to_buffer(buffer, 0, staging.buffer(), 0, buffer.size());
                (*b, staging)
            })
            .collect();
        let submission = self.gpu.queue.submit([encoder.finish()]);
        Tally::add(&self.tally.dispatches, dispatches as u64);
        let (tx, rx) = mpsc::channel();
        let stagings = own
            .iter()
            .flat_map(|m| m.values().map(|(_, s)| s))
            .chain(finals.values())
            .chain(counted.iter().map(|(s, _)| s));
        let mut mapped = 0;
        for staging in stagings {
            let tx = tx.clone();
            staging.slice().map_async(wgpu::MapMode::Read, move |r| {
                let _ = tx.send(r);
            });
            mapped += 1;
        }
        drop(tx);
        self.wait(submission, started, deadline)?;
        for _ in 0..mapped {
            match rx.try_recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(ExecError::Gpu(format!("reading back a chain: {e}"))),
                Err(_) => return Err(self.lost_or("readback did not complete")),
            }
        }
        for (staging, limit) in &mut counted {
            limit.check(read_turns(staging), &self.capability.adapter_name)?;
        }
        let read = |staging: &mut Readback| {
            let bytes = staging.slice().get_mapped_range().to_vec();
            staging.unmap();
            Tally::add(&self.tally.bytes_from_device, bytes.len() as u64);
            bytes
        };
        let outputs = own
            .iter_mut()
            .map(|m| m.iter_mut().map(|(b, (_, s))| (*b, read(s))).collect())
            .collect();
        let mut kept = Vec::new();
        let mut last = BTreeMap::new();
        for (b, staging) in &mut finals {
            let bytes = read(staging);
            if first.keep.contains(b) {
                kept.push((BlobId::of(&bytes), carried[b].clone()));
            }
            last.insert(*b, bytes);
        }
        Ok((
            ChainOutput {
                outputs,
                carried: last,
                elapsed: started.elapsed(),
            },
            kept,
        ))
    }
}
