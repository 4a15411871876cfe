//! `gpumesh bench consensus`: how fast the replicated record commits on this machine.
//!
//! Starts a cluster of real replicas in this process (redb files with fsync on, in a
//! scratch directory; the in-process network without faults) and measures:
//! - committed proposals per second with many proposals in flight (they batch into
//!   one append and one fsync per round);
//! - one proposal at a time: proposals per second and commit latency (p50, p99),
//!   from `propose` until the outcome is applied on the leader;
//! - next to it, in the same run and directory, the storage's raw rate of fsync'd
//!   single-entry appends: the physical limit for one-at-a-time commits here.

use std::fmt;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use raft::eraftpb::Entry;

use crate::cluster::ClusterId;
use crate::command::{Command, LogEntry, RequestId};
use crate::error::{ConsensusError, Result};
use crate::replica::{ConsensusHandle, RaftRole, ReplicaConfig};
use crate::sim::SimNetwork;
use crate::state::ClusterSettings;
use crate::storage::RedbStorage;

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Where the replicas' files go (a scratch directory is made inside and removed
    /// afterwards). Default: the system temp dir. Point it at the disk you care about.
    pub dir: Option<PathBuf>,
    /// Replicas in the cluster.
    pub nodes: u64,
    /// Proposals in the batched run.
    pub batched_proposals: usize,
    /// Proposals in flight at once in the batched run.
    pub in_flight: usize,
    /// Proposals in the one-at-a-time run.
    pub sequential_proposals: usize,
    /// Single-entry fsync'd appends in the raw storage run.
    pub raw_appends: usize,
}

impl Default for BenchConfig {
    fn default() -> Self {
        Self {
            dir: None,
            nodes: 3,
            batched_proposals: 50_000,
            in_flight: 1024,
            sequential_proposals: 2_000,
            raw_appends: 2_000,
        }
    }
}

/// The measurements; `Display` renders a plain-text table.
#[derive(Clone, Debug)]
pub struct BenchReport {
    pub nodes: u64,
    pub dir: String,
    /// Bytes of one proposal's log entry (the command plus its envelope).
    pub entry_bytes: usize,
    pub batched_proposals: usize,
    pub batched_per_sec: f64,
    pub sequential_proposals: usize,
    pub sequential_per_sec: f64,
    pub latency_p50: Duration,
    pub latency_p99: Duration,
    pub raw_appends: usize,
    pub raw_appends_per_sec: f64,
    pub raw_append_p50: Duration,
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        writeln!(
            f,
            "consensus benchmark: {} replicas in one process, redb with fsync, in {}",
            self.nodes, self.dir
        )?;
        writeln!(f, "proposal entry size: {} bytes", self.entry_bytes)?;
        writeln!(f)?;
        writeln!(
            f,
            "{:<44} {:>10} {:>14} {:>10} {:>10}",
            "measurement", "count", "rate (/s)", "p50 (ms)", "p99 (ms)"
        )?;
        writeln!(f, "{}", "-".repeat(92))?;
        writeln!(
            f,
            "{:<44} {:>10} {:>14.0} {:>10} {:>10}",
            "committed proposals, batched (many in flight)",
            self.batched_proposals,
            self.batched_per_sec,
            "-",
            "-"
        )?;
        writeln!(
            f,
            "{:<44} {:>10} {:>14.0} {:>10.3} {:>10.3}",
            "committed proposals, one at a time",
            self.sequential_proposals,
            self.sequential_per_sec,
            ms(self.latency_p50),
            ms(self.latency_p99)
        )?;
        writeln!(
            f,
            "{:<44} {:>10} {:>14.0} {:>10.3} {:>10}",
            "raw storage: fsync'd single-entry appends",
            self.raw_appends,
            self.raw_appends_per_sec,
            ms(self.raw_append_p50),
            "-"
        )
    }
}

/// Runs the benchmark on the current tokio runtime (a multi-threaded one gives the
/// replicas the machine's cores).
pub async fn run(config: BenchConfig) -> Result<BenchReport> {
    let base = config.dir.clone().unwrap_or_else(std::env::temp_dir);
    let stamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let scratch = base.join(format!("gpumesh-bench-{}-{stamp}", std::process::id()));
    std::fs::create_dir_all(&scratch).map_err(|e| ConsensusError::Storage {
        path: scratch.display().to_string(),
        reason: format!("cannot create the scratch directory: {e}"),
    })?;
    let result = measure(&config, &scratch).await;
    // Best effort: a leftover scratch directory is harmless.
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

async fn measure(config: &BenchConfig, scratch: &std::path::Path) -> Result<BenchReport> {
    let cluster = ClusterId::derive(b"gpumesh consensus bench");
    let n = config.nodes.max(1);
    let founders: Vec<(u64, String)> = (1..=n).map(|i| (i, format!("bench-{i}"))).collect();
    let net = SimNetwork::new(1);
    let mut nodes = Vec::new();
    for id in 1..=n {
        let mut storage = RedbStorage::open(scratch.join(format!("node-{id}.redb")), cluster)?;
        storage.initialize(&founders, ClusterSettings { max_voters: 5 })?;
        let mut cfg = ReplicaConfig::new(id);
        cfg.tick_interval = Duration::from_millis(20);
        cfg.proposal_timeout = Duration::from_secs(30);
        let h = ConsensusHandle::start(cfg, storage, net.transport(id))?;
        net.register(h.clone());
        nodes.push(h);
    }
    let leader = wait_for_leader(&nodes).await?;
    let sample = Command::Heartbeat {
        raft_id: leader.id(),
        at_ms: 1_700_000_000_000,
    };
    let entry_bytes = gpumesh_protocol::codec::to_bytes(&LogEntry {
        origin: leader.id(),
        request_id: RequestId::new(leader.id(), u64::MAX / 2),
        command: sample.clone(),
    })?
    .len();

    // Warm up (first snapshot, allocator, page cache).
    for _ in 0..200 {
        leader.propose(sample.clone()).await?;
    }

    // Batched: many proposals in flight, spread over worker tasks.
    let total = config.batched_proposals;
    let workers = config.in_flight.clamp(1, total.max(1));
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(workers);
    for w in 0..workers {
        let h = leader.clone();
        let cmd = sample.clone();
        let share = total / workers + usize::from(w < total % workers);
        tasks.push(tokio::spawn(async move {
            for _ in 0..share {
                h.propose(cmd.clone()).await?;
            }
            Ok::<_, ConsensusError>(())
        }));
    }
    for t in tasks {
        t.await
            .map_err(|e| ConsensusError::Invalid(format!("bench task: {e}")))??;
    }
    let batched_per_sec = total as f64 / started.elapsed().as_secs_f64();

    // One at a time.
    let mut latencies = Vec::with_capacity(config.sequential_proposals);
    let started = Instant::now();
    for _ in 0..config.sequential_proposals {
        let t = Instant::now();
        leader.propose(sample.clone()).await?;
        latencies.push(t.elapsed());
    }
    let sequential_per_sec = config.sequential_proposals as f64 / started.elapsed().as_secs_f64();
    latencies.sort_unstable();

    for h in &nodes {
        h.shutdown().await;
    }

    // Raw storage: one fsync'd append per write, same entry size, same disk.
    let (raw_appends_per_sec, raw_append_p50) =
        raw_appends(scratch, cluster, config.raw_appends, entry_bytes)?;

    Ok(BenchReport {
        nodes: n,
        dir: scratch
            .parent()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        entry_bytes,
        batched_proposals: total,
        batched_per_sec,
        sequential_proposals: config.sequential_proposals,
        sequential_per_sec,
        latency_p50: percentile(&latencies, 0.50),
        latency_p99: percentile(&latencies, 0.99),
        raw_appends: config.raw_appends,
        raw_appends_per_sec,
        raw_append_p50,
    })
}

async fn wait_for_leader(nodes: &[ConsensusHandle]) -> Result<ConsensusHandle> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        for h in nodes {
            if h.watch_status().borrow().role == RaftRole::Leader {
                return Ok(h.clone());
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Err(ConsensusError::NoLeader)
}

fn raw_appends(
    scratch: &std::path::Path,
    cluster: ClusterId,
    count: usize,
    entry_bytes: usize,
) -> Result<(f64, Duration)> {
    let mut storage = RedbStorage::open(scratch.join("raw.redb"), cluster)?;
    storage.initialize(&[(1, "raw".into())], ClusterSettings { max_voters: 5 })?;
    let mut times = Vec::with_capacity(count);
    let started = Instant::now();
    for i in 0..count as u64 {
        let e = Entry {
            index: i + 2,
            term: 1,
            data: vec![0x5a; entry_bytes].into(),
            ..Default::default()
        };
        let t = Instant::now();
        storage.persist(None, &[e], None)?;
        times.push(t.elapsed());
    }
    let rate = count as f64 / started.elapsed().as_secs_f64();
    times.sort_unstable();
    Ok((rate, percentile(&times, 0.5)))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}
