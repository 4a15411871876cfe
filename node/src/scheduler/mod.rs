//! The scheduler: on the Raft leader only, turns the replicated record into
//! placements, and settles replica results that need a float comparison.
//!
//! Each shard that wants an attempt goes to the member that minimises (shards
//! queued + 1) / measured GFLOP/s among those whose adapter limits fit the task's
//! buffers, so placement is proportional to capability and current queue; replicas
//! of one shard go to distinct nodes, different adapters or backends first. Members
//! without an adapter stay in the mesh and get nothing. Which members are down is
//! [`crate::liveness`]'s to say: the attempts of a node that is down or gone move to
//! another node under a new epoch. An attempt running far past its expected time gets a
//! speculative copy elsewhere; the first valid result wins. Talks to: raft (reads
//! state, proposes), liveness, the mesh (pulls replica outputs to compare them).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gpumesh_consensus::{AppliedEvent, Command, ConsensusHandle, RaftRole, TaskId};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

mod plan;

pub use plan::{plan, Observed, Plan};

use crate::blobs::BlobsHandle;
use crate::liveness::LivenessHandle;
use crate::peers::PeersHandle;

/// When the leader gives up on a node and on a slow attempt.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    pub interval: Duration,
    /// An attempt is a straggler once it has run this many times its expected time…
    pub straggler_factor: f64,
    /// …and at least this long.
    pub straggler_min: Duration,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            interval: Duration::from_millis(250),
            straggler_factor: 4.0,
            straggler_min: Duration::from_secs(30),
        }
    }
}

/// Starts and stops the leader's clock on an attempt as its entries apply.
fn clock(
    command: &Command,
    started: &mut HashMap<(TaskId, u32, u32), Instant>,
    took: &mut HashMap<TaskId, Vec<Duration>>,
) {
    let now = Instant::now();
    match command {
        Command::ShardStarted {
            task, shard, epoch, ..
        } => {
            started.insert((*task, *shard, *epoch), now);
        }
        Command::ShardResult {
            task, shard, epoch, ..
        } => {
            if let Some(t0) = started.remove(&(*task, *shard, *epoch)) {
                took.entry(*task).or_default().push(now - t0);
            }
        }
        _ => {}
    }
}

/// A proposal of the leader's passes that has not ended: the passes until it does
/// leave what it is about alone.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Pending {
    /// An assignment, a move or a verdict for one shard.
    Shard(TaskId, u32),
    /// A task's merged result.
    Merge(TaskId),
    /// An actor's placement.
    Actor(String),
}

pub(crate) struct Scheduler {
    pub consensus: ConsensusHandle,
    /// Pulls replica outputs to compare them, and shard results to merge them.
    pub blobs: BlobsHandle,
    pub peers: PeersHandle,
    /// The kernels of tasks to merge: they tell values stored from partials.
    pub kernels: Arc<gpumesh_shaders::KernelCache>,
    /// Which members are down: their attempts are placed elsewhere.
    pub liveness: LivenessHandle,
    pub config: SchedulerConfig,
}

impl Scheduler {
    pub async fn run(self, cancel: CancellationToken) {
        let mut events = self.consensus.subscribe();
        let mut liveness = self.liveness.watch();
        let mut tick = tokio::time::interval(self.config.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Proposals not yet applied, so a pass does not repeat them.
        let mut in_flight: HashSet<Pending> = HashSet::new();
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
        let mut was_leader = false;
        // Leader-local clocks: the start of each attempt, and how long finished
        // attempts of each task took.
        let mut started: HashMap<(TaskId, u32, u32), Instant> = HashMap::new();
        let mut took: HashMap<TaskId, Vec<Duration>> = HashMap::new();
        // The down set last proposed, and when: proposed again only after a while.
        let mut down_sent: Option<(BTreeSet<u64>, Instant)> = None;
        loop {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return,
                Some(key) = done_rx.recv() => { in_flight.remove(&key); continue; }
                event = events.recv() => {
                    // The entries applied meanwhile are seen by the same pass: under
                    // load one pass per entry would plan the same tasks over again.
                    for event in gpumesh_consensus::with_waiting(event, &mut events) {
                        if let Ok(AppliedEvent::Entry { entry, .. }) = event {
                            clock(&entry.command, &mut started, &mut took);
                        }
                    }
                }
                _ = tick.tick() => {}
                Ok(()) = liveness.changed() => {}
            }
            if self.consensus.watch_status().borrow().role != RaftRole::Leader {
                in_flight.clear();
                was_leader = false;
                continue;
            }
            let now = Instant::now();
            if !was_leader {
                // A new leader has not seen running attempts start: their clocks
                // start now.
                was_leader = true;
                started.clear();
            }
            let config = self.config;
            let snapshot = self.consensus.read_local(|s| {
                s.active_tasks()
                    .flat_map(|t| {
                        t.shards.iter().enumerate().flat_map(move |(i, sh)| {
                            sh.attempts
                                .iter()
                                .map(move |a| (t.id, i as u32, a.epoch, a.node))
                        })
                    })
                    .collect::<Vec<(TaskId, u32, u32, u64)>>()
            });
            let running = snapshot;
            let mut observed = Observed {
                down: self.liveness.view().down().collect(),
                ..Observed::default()
            };
            self.record_down(&observed.down, &mut down_sent);
            let live: HashSet<(TaskId, u32, u32)> =
                running.iter().map(|(t, s, e, _)| (*t, *s, *e)).collect();
            started.retain(|k, _| live.contains(k));
            took.retain(|t, _| live.iter().any(|(lt, _, _)| lt == t));
            for (task, shard, epoch, _) in &running {
                let t0 = *started.entry((*task, *shard, *epoch)).or_insert(now);
                let expected = took
                    .get(task)
                    .and_then(|d| median(d))
                    .map(|m| m.mul_f64(config.straggler_factor))
                    .unwrap_or(Duration::ZERO)
                    .max(config.straggler_min);
                if now - t0 > expected {
                    observed.slow.insert((*task, *shard, *epoch));
                }
            }
            let plan = self.consensus.read_local(move |s| plan(s, &observed));
            self.carry_out(plan, &mut in_flight, &done_tx);
        }
    }

    /// Puts the leader's judgement of who is down in the record when it differs, so
    /// that every replica places new tasks away from those members.
    fn record_down(&self, down: &BTreeSet<u64>, sent: &mut Option<(BTreeSet<u64>, Instant)>) {
        let differs = self.consensus.read_local({
            let down = down.clone();
            move |s| {
                let members: BTreeSet<u64> = s.members().keys().copied().collect();
                let want: BTreeSet<u64> = down.intersection(&members).copied().collect();
                (&want != s.down()).then_some(want)
            }
        });
        let Some(want) = differs else {
            *sent = None;
            return;
        };
        if sent
            .as_ref()
            .is_some_and(|(w, at)| *w == want && at.elapsed() < Duration::from_secs(2))
        {
            return;
        }
        *sent = Some((want.clone(), Instant::now()));
        let consensus = self.consensus.clone();
        tokio::spawn(async move {
            let down: Vec<u64> = want.into_iter().collect();
            if let Err(e) = consensus.propose(Command::MembersDown { down }).await {
                tracing::debug!(error = %e, "the down set was not recorded");
            }
        });
    }

    fn carry_out(
        &self,
        plan: Plan,
        in_flight: &mut HashSet<Pending>,
        done_tx: &tokio::sync::mpsc::UnboundedSender<Pending>,
    ) {
        // Each proposal in a `place{task shard node}` span, matching the workers'
        // `shard{task shard epoch}` spans.
        let mut commands: Vec<(Pending, Command, tracing::Span)> = Vec::new();
        for (task, shard, node) in plan.assign {
            commands.push((
                Pending::Shard(task, shard),
                Command::AssignShard { task, shard, node },
                tracing::info_span!("place", %task, shard, node = %format_args!("{node:x}")),
            ));
        }
        for (task, shard, epoch, node, reason) in plan.reassign {
            let span = tracing::info_span!(
                "place", %task, shard, node = %format_args!("{node:x}"), from_epoch = epoch, %reason
            );
            commands.push((
                Pending::Shard(task, shard),
                Command::ReassignShard {
                    task,
                    shard,
                    epoch,
                    node,
                    reason,
                },
                span,
            ));
        }
        // One proposal per shard at a time; the rest wait for the next pass.
        for (key, command, span) in commands {
            if !in_flight.insert(key.clone()) {
                continue;
            }
            let consensus = self.consensus.clone();
            let done = done_tx.clone();
            tokio::spawn(
                async move {
                    match consensus.propose(command).await {
                        Ok(_) => tracing::debug!("placement committed"),
                        Err(e) => tracing::debug!(error = %e, "placement not committed"),
                    }
                    let _ = done.send(key);
                }
                .instrument(span),
            );
        }
        for (task, shard) in plan.verify {
            if !in_flight.insert(Pending::Shard(task, shard)) {
                continue;
            }
            let consensus = self.consensus.clone();
            let (blobs, peers) = (self.blobs.clone(), self.peers.clone());
            let done = done_tx.clone();
            tokio::spawn(async move {
                match verdict(&consensus, &blobs, &peers, task, shard).await {
                    Ok(agreeing) => {
                        let _ = consensus
                            .propose(Command::ShardVerdict {
                                task,
                                shard,
                                agreeing,
                            })
                            .await;
                    }
                    Err(e) => {
                        tracing::warn!(%task, shard, "could not compare replica outputs: {e}")
                    }
                }
                let _ = done.send(Pending::Shard(task, shard));
            });
        }
        for task in plan.merge {
            if !in_flight.insert(Pending::Merge(task)) {
                continue;
            }
            let consensus = self.consensus.clone();
            let (blobs, peers) = (self.blobs.clone(), self.peers.clone());
            let kernels = self.kernels.clone();
            let done = done_tx.clone();
            tokio::spawn(
                async move {
                    if let Err(e) =
                        crate::outputs::merge_and_record(&consensus, &blobs, &peers, &kernels, task)
                            .await
                    {
                        merge_waits(task, &e);
                    }
                    let _ = done.send(Pending::Merge(task));
                }
                .instrument(tracing::info_span!("merge", %task)),
            );
        }
        // One placement per actor at a time: every pass until it applies would
        // otherwise propose it again (each one more entry, and one more pass), and
        // many actors created at once flooded the log with their placements.
        for (name, epoch, node, reason) in plan.place_actors {
            let key = Pending::Actor(name.clone());
            if !in_flight.insert(key.clone()) {
                continue;
            }
            let consensus = self.consensus.clone();
            let done = done_tx.clone();
            tokio::spawn(async move {
                tracing::info!(actor = %name, node = format_args!("{node:x}"), %reason, "placing actor");
                let placed = consensus
                    .propose(Command::PlaceActor {
                        name,
                        epoch,
                        node,
                        reason,
                    })
                    .await;
                if let Err(e) = placed {
                    tracing::debug!(error = %e, "placement not committed");
                }
                let _ = done.send(key);
            });
        }
    }
}

fn median(d: &[Duration]) -> Option<Duration> {
    let mut v = d.to_vec();
    v.sort();
    v.get(v.len() / 2).copied()
}

/// Pulls the outputs reported for a shard and returns the epochs of the largest
/// group that agree under the task's tolerance.
async fn verdict(
    consensus: &ConsensusHandle,
    blobs: &BlobsHandle,
    peers: &PeersHandle,
    task: TaskId,
    shard: u32,
) -> Result<Vec<u32>, String> {
    let found = consensus.read_local(move |s| s.task(task).cloned());
    let Some(t) = found else {
        return Err("the task is gone".into());
    };
    let reports = t
        .shards
        .get(shard as usize)
        .ok_or("the shard is gone")?
        .reports
        .clone();
    let mut outputs = Vec::new();
    for r in &reports {
        let bytes = crate::outputs::result_bytes(blobs, peers, &t, r.blob, r.node).await?;
        outputs.push((
            r.epoch,
            gpumesh_protocol::ShardChanges::decode(&bytes).map_err(|e| e.to_string())?,
        ));
    }
    // Replicas that changed different words are compared over whole buffers.
    let starts = crate::outputs::starts(blobs, &t.spec, &t.submitter)
        .await
        .map_err(|e| e.to_string())?;
    let bases = gpumesh_shaders::merge::bases(&t.spec, |b| starts.get(&b).map(Vec::as_slice));
    let tolerance = t.spec.options.tolerance;
    let agree = |a: &gpumesh_protocol::ShardChanges, b: &gpumesh_protocol::ShardChanges| {
        a.agrees(b, tolerance, &bases)
    };
    let mut best: Vec<u32> = Vec::new();
    for (i, (_, a)) in outputs.iter().enumerate() {
        let group: Vec<u32> = outputs
            .iter()
            .enumerate()
            .filter(|(j, (_, b))| *j == i || agree(a, b))
            .map(|(_, (e, _))| *e)
            .collect();
        if group.len() > best.len() {
            best = group;
        }
    }
    Ok(best)
}

/// Says why a merge waits: a warning at most once every [`MERGE_WARN_EVERY`], the
/// rest at debug level. A merge that waits on what is unavailable is tried again
/// on every pass, four a second, which filled a node's log with the same line.
fn merge_waits(task: TaskId, why: &str) {
    static LAST_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = now_ms();
    let last = LAST_MS.load(std::sync::atomic::Ordering::Relaxed);
    let every = MERGE_WARN_EVERY.as_millis() as u64;
    if now.saturating_sub(last) >= every
        && LAST_MS
            .compare_exchange(
                last,
                now,
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
            )
            .is_ok()
    {
        tracing::warn!(%task, "could not merge yet (said once every {MERGE_WARN_EVERY:?}): {why}");
    } else {
        tracing::debug!(%task, "could not merge yet: {why}");
    }
}

/// See [`merge_waits`].
const MERGE_WARN_EVERY: Duration = Duration::from_secs(10);

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
