//! A cluster of real replicas on redb files in a temp dir, joined by the simulated
//! network. Tests run on tokio's paused clock: timers fire as soon as everything
//! is idle, so elections and timeouts cost no wall time.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use gpumesh_consensus::sim::{Faults, SimNetwork};
use gpumesh_consensus::{
    ClusterId, ClusterSettings, Command, ConsensusHandle, LogEntry, Outcome, RaftRole, RedbStorage,
    ReplicaConfig, RequestId, StateMachine, Status, TaskId,
};
use gpumesh_protocol::{BindingRole, BindingSpec, Grid, MergeRule, ShaderSource, TaskSpec};

pub const CLUSTER: ClusterId = ClusterId(0x6770_756d_6573_6801);

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "off".into()),
        )
        .with_test_writer()
        .try_init();
}

pub fn test_config(id: u64) -> ReplicaConfig {
    let mut c = ReplicaConfig::new(id);
    c.tick_interval = Duration::from_millis(10);
    c.election_tick = 10;
    c.heartbeat_tick = 2;
    c.proposal_timeout = Duration::from_secs(3);
    c.read_timeout = Duration::from_secs(2);
    c
}

pub fn spec(n: u32) -> TaskSpec {
    TaskSpec {
        shader: ShaderSource::Builtin("fill".into()),
        entry_point: "main".into(),
        bindings: vec![BindingSpec {
            binding: 0,
            role: BindingRole::Output {
                size: 4 * u64::from(n),
            },
        }],
        grid: Grid([n, 1, 1]),
        shards: 2,
        merge: MergeRule::Changes,
        merges: Default::default(),
        options: Default::default(),
    }
}

/// A lavapipe-like adapter's capability (10 GFLOP/s).
pub fn capability() -> gpumesh_protocol::NodeCapability {
    gpumesh_protocol::NodeCapability {
        adapter_name: "llvmpipe".into(),
        vendor: 0,
        backend: gpumesh_protocol::BackendKind::Vulkan,
        device_kind: gpumesh_protocol::DeviceKind::Cpu,
        driver: "mesa".into(),
        limits: gpumesh_protocol::AdapterLimits {
            max_buffer_size: 1 << 28,
            max_storage_buffer_binding_size: 1 << 27,
            max_uniform_buffer_binding_size: 1 << 16,
            max_storage_buffers_per_shader_stage: 8,
            max_compute_workgroups_per_dimension: 65535,
            max_compute_invocations_per_workgroup: 256,
            max_compute_workgroup_size: [256, 256, 64],
            max_compute_workgroup_storage_size: 16384,
        },
        gflops: 10.0,
        gbps: 5.0,
        memory: 512 << 20,
    }
}

pub fn submit(n: u32) -> Command {
    Command::SubmitTask {
        spec: spec(n),
        submitter: "test".into(),
        needs: None,
    }
}

pub struct Cluster {
    pub net: SimNetwork,
    pub dir: tempfile::TempDir,
    pub nodes: BTreeMap<u64, ConsensusHandle>,
    pub configure: fn(u64) -> ReplicaConfig,
}

impl Cluster {
    /// `n` founding voters 1..=n, all started.
    pub async fn new(n: u64, seed: u64) -> Self {
        Self::with(n, seed, test_config, 5).await
    }

    pub async fn with(
        n: u64,
        seed: u64,
        configure: fn(u64) -> ReplicaConfig,
        max_voters: u32,
    ) -> Self {
        init_tracing();
        let mut c = Self {
            net: SimNetwork::new(seed),
            dir: tempfile::tempdir().expect("tempdir"),
            nodes: BTreeMap::new(),
            configure,
        };
        let founders: Vec<(u64, String)> = (1..=n).map(|i| (i, format!("peer-{i}"))).collect();
        for id in 1..=n {
            let mut s = RedbStorage::open(c.path(id), CLUSTER).expect("open storage");
            s.initialize(&founders, ClusterSettings { max_voters })
                .expect("initialize");
        }
        for id in 1..=n {
            c.start(id);
        }
        c
    }

    pub fn path(&self, id: u64) -> PathBuf {
        self.dir.path().join(format!("node-{id}.redb"))
    }

    /// Starts (or restarts) replica `id` from its storage file.
    pub fn start(&mut self, id: u64) -> ConsensusHandle {
        self.start_failing(id, None)
    }

    /// Starts replica `id`; with `Some(n)`, its storage fails after `n` writes (a
    /// crash in the middle of a Ready).
    pub fn start_failing(&mut self, id: u64, fail_after: Option<u64>) -> ConsensusHandle {
        self.start_with(id, |storage| {
            if let Some(n) = fail_after {
                storage.fail_after_writes(n);
            }
        })
    }

    /// Starts replica `id` on its storage as `prepare` leaves it (a fault injected).
    pub fn start_with(
        &mut self,
        id: u64,
        prepare: impl FnOnce(&mut RedbStorage),
    ) -> ConsensusHandle {
        let mut storage = RedbStorage::open(self.path(id), CLUSTER).expect("reopen storage");
        prepare(&mut storage);
        let h = ConsensusHandle::start((self.configure)(id), storage, self.net.transport(id))
            .expect("start replica");
        self.net.register(h.clone());
        self.nodes.insert(id, h.clone());
        h
    }

    /// Crashes replica `id`: its task is aborted and its memory dropped.
    pub async fn crash(&mut self, id: u64) {
        self.net.unregister(id);
        if let Some(h) = self.nodes.remove(&id) {
            h.kill().await;
        }
    }

    pub fn node(&self, id: u64) -> &ConsensusHandle {
        &self.nodes[&id]
    }

    pub fn ids(&self) -> Vec<u64> {
        self.nodes.keys().copied().collect()
    }

    pub async fn status(&self, id: u64) -> Status {
        self.node(id).status().await.expect("status")
    }

    /// Waits until one of `among` leads and all of them agree on it.
    pub async fn leader_among(&self, among: &[u64], within: Duration) -> u64 {
        let found = eventually(within, || async {
            let mut leader = None;
            for &id in among {
                let s = self.status(id).await;
                if s.role == RaftRole::Leader {
                    leader = Some(id);
                }
            }
            let leader = leader?;
            for &id in among {
                if self.status(id).await.leader_id != leader {
                    return None;
                }
            }
            Some(leader)
        })
        .await;
        found.unwrap_or_else(|| panic!("no agreed leader among {among:?} within {within:?}"))
    }

    pub async fn leader(&self) -> u64 {
        let ids = self.ids();
        self.leader_among(&ids, Duration::from_secs(10)).await
    }

    /// Waits until every listed replica applied at least `index`.
    pub async fn wait_applied(&self, among: &[u64], index: u64, within: Duration) {
        let ok = eventually(within, || async {
            for &id in among {
                if self.status(id).await.applied_index < index {
                    return None;
                }
            }
            Some(())
        })
        .await;
        if ok.is_none() {
            let mut report = Vec::new();
            for &id in among {
                report.push(self.status(id).await);
            }
            panic!("not all of {among:?} applied {index} within {within:?}: {report:#?}");
        }
    }

    /// Waits until the listed replicas hold equal state machines; returns it as bytes.
    pub async fn converged(&self, among: &[u64], within: Duration) {
        let ok = eventually(within, || async {
            let mut first = None;
            for &id in among {
                let s = self.node(id).read_local(|s| s.clone());
                match &first {
                    None => first = Some(s),
                    Some(f) if *f != s => return None,
                    Some(_) => {}
                }
            }
            Some(())
        })
        .await;
        if ok.is_none() {
            let mut report = Vec::new();
            for &id in among {
                report.push(self.status(id).await);
            }
            panic!("{among:?} did not converge within {within:?}: {report:#?}");
        }
    }

    pub async fn shutdown(self) {
        for h in self.nodes.values() {
            h.shutdown().await;
        }
    }
}

pub fn faults(drop: f64, duplicate: f64, delay_ms: (u64, u64)) -> Faults {
    Faults {
        drop,
        duplicate,
        delay_ms,
    }
}

/// Polls `f` every 10 ms (of the test clock) until it returns `Some` or time runs out.
pub async fn eventually<T, F, Fut>(within: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A log applied straight to a state machine, one entry after another.
pub struct Log {
    pub sm: StateMachine,
    pub index: u64,
    pub entries: Vec<(u64, LogEntry)>,
    pub seq: u64,
}

impl Log {
    /// Three founding voters, raft ids 1, 2 and 3.
    pub fn new() -> Self {
        let founders = vec![
            (1, "p1".to_string()),
            (2, "p2".to_string()),
            (3, "p3".to_string()),
        ];
        Self {
            sm: StateMachine::bootstrap(&founders, ClusterSettings { max_voters: 3 }),
            index: 1,
            entries: Vec::new(),
            seq: 0,
        }
    }

    pub fn apply_as(&mut self, request_id: RequestId, command: Command) -> Outcome {
        self.apply_from(1, request_id, command)
    }

    /// Applies `command` as proposed through node `origin`.
    pub fn apply_from(&mut self, origin: u64, request_id: RequestId, command: Command) -> Outcome {
        self.index += 1;
        let entry = LogEntry {
            origin,
            request_id,
            command,
        };
        self.entries.push((self.index, entry.clone()));
        self.sm.apply(self.index, 1, &entry).committed.outcome
    }

    pub fn apply(&mut self, command: Command) -> Outcome {
        self.seq += 1;
        self.apply_as(RequestId::new(1, self.seq), command)
    }

    /// Submits a task of `shards` shards and returns its id.
    pub fn submit(&mut self, shards: u32) -> TaskId {
        let mut spec = spec(8);
        spec.shards = shards;
        let command = Command::SubmitTask {
            spec,
            submitter: "test".into(),
            needs: None,
        };
        match self.apply(command) {
            Outcome::TaskSubmitted { task } => task,
            other => panic!("{other:?}"),
        }
    }
}
