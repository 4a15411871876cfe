//! What the multi-node test files share: node configs for loopback, seeds, adapter
//! checks, and starting and stopping small meshes.

// Each test file uses its own subset of these.
#![allow(dead_code)]

pub mod netns;
pub mod procs;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use gpumesh::consensus::MAX_HISTORY;
use gpumesh::node::api::TaskView;
use gpumesh::node::{ClusterKey, Formation, MeshNode, Multiaddr, NodeConfig};
use gpumesh::protocol::BackendKind;
use gpumesh::shaders::builtins::Problem;
use gpumesh::shaders::BackendChoice;
use gpumesh::Client;

/// The longest any one test may take.
pub const LIMIT: Duration = Duration::from_secs(120);

/// A node on loopback with an ephemeral API port, no mDNS, no calibration and a quick
/// Raft tick.
pub fn config(dir: &Path, formation: Formation, peers: &[Multiaddr]) -> NodeConfig {
    log_if_asked();
    let mut c = NodeConfig::new(dir);
    c.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
    c.api = "127.0.0.1:0".parse().unwrap();
    c.mdns = false;
    c.calibrate = false;
    c.formation = formation;
    c.peers = peers.to_vec();
    c.cluster_key = Some(mesh_key());
    c.raft_tick = Duration::from_millis(50);
    c.join_timeout = Duration::from_secs(20);
    // The backend `gpumesh node` would take from GPUMESH_BACKEND, where set (to
    // leave an adapter out of a run: on an H100, NVIDIA's OpenGL one, which every
    // node otherwise opens and gives up as it starts).
    if let Ok(backend) = std::env::var("GPUMESH_BACKEND") {
        c.backend = backend
            .parse()
            .expect("GPUMESH_BACKEND: vulkan, gl, metal, dx12 or auto");
    }
    c
}

/// With GPUMESH_TEST_LOG set (a filter: `gpumesh=debug,warn`), the in-process
/// nodes' logs go to stderr as they happen, with each line's thread: what a test
/// that stalls was doing (run it with --nocapture).
fn log_if_asked() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Ok(filter) = std::env::var("GPUMESH_TEST_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_thread_names(true)
                .with_ansi(false)
                .with_writer(std::io::stderr)
                .try_init();
        }
    });
}

/// The cluster key of every mesh a test process starts (meshes are closed by
/// default); the closed-mesh tests give some nodes other keys.
pub fn mesh_key() -> ClusterKey {
    static KEY: std::sync::OnceLock<ClusterKey> = std::sync::OnceLock::new();
    *KEY.get_or_init(ClusterKey::generate)
}

/// The node's first listen address with its peer id, as `--peer` takes it.
pub fn seed(node: &MeshNode) -> Multiaddr {
    format!("{}/p2p/{}", node.listen_addrs[0], node.peer_id)
        .parse()
        .unwrap()
}

/// Says in the test output that something is skipped: straight to the process's
/// stderr, not through `eprintln!`, which the test harness swallows for a passing test.
pub fn skipped(what: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "\n!!!!! SKIPPED: {what} !!!!!\n");
}

/// Whether a backend is present and runs a dispatch (probed once per test process);
/// a missing required one fails, others are reported. An adapter that is listed but
/// cannot run (OpenGL through EGL with no display on NVIDIA's driver) counts as
/// missing: a node would refuse it when it starts.
pub fn have(backend: BackendKind) -> bool {
    static PROBED: std::sync::Mutex<BTreeMap<&'static str, Result<(), String>>> =
        std::sync::Mutex::new(BTreeMap::new());
    let probed = PROBED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(backend.name())
        .or_insert_with(|| {
            gpumesh::shaders::Executor::new(BackendChoice::Only(backend))
                .map(drop)
                .map_err(|e| e.to_string())
        })
        .clone();
    let required = std::env::var("GPUMESH_REQUIRE_BACKENDS").unwrap_or_default();
    if let Err(e) = &probed {
        assert!(
            !required.split(',').any(|r| r.trim() == backend.name()),
            "GPUMESH_REQUIRE_BACKENDS names {} but it is unavailable: {e}",
            backend.name()
        );
        skipped(&format!(
            "NO {} ADAPTER, so the mesh cases needing it are skipped ({e})",
            backend.name().to_uppercase()
        ));
    }
    probed.is_ok()
}

pub fn have_any() -> bool {
    have(BackendKind::Vulkan) | have(BackendKind::Gl)
}

pub async fn mesh(root: &Path, n: usize) -> Vec<MeshNode> {
    mesh_with(root, n, |_, _| {}).await
}

/// A mesh of `n` nodes, node `i` configured by `tune(i, config)` before it starts.
pub async fn mesh_with(
    root: &Path,
    n: usize,
    tune: impl Fn(usize, &mut NodeConfig),
) -> Vec<MeshNode> {
    let mut c = config(&root.join("n0"), Formation::Init, &[]);
    tune(0, &mut c);
    let first = MeshNode::start(c).await.unwrap();
    let s = seed(&first);
    let mut nodes = vec![first];
    for i in 1..n {
        let mut c = config(
            &root.join(format!("n{i}")),
            Formation::Join,
            std::slice::from_ref(&s),
        );
        tune(i, &mut c);
        nodes.push(MeshNode::start(c).await.unwrap());
    }
    wait_ready(&nodes).await;
    nodes
}

/// Waits until every node's adapter is in the replicated membership, so shards can
/// be placed on all of them.
pub async fn wait_ready(nodes: &[MeshNode]) {
    let c = client(&nodes[0]);
    for _ in 0..200 {
        if let Ok(st) = c.status().await {
            if st.members.len() == nodes.len() && st.members.iter().all(|m| m.adapter.is_some()) {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the nodes' adapters never all appeared in the membership");
}

pub fn client(node: &MeshNode) -> Client {
    Client::new(node.api_addr.to_string())
}

/// Node `n`'s /metrics page.
pub async fn metrics(n: &MeshNode) -> String {
    reqwest::get(format!("http://{}/metrics", n.api_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// One sample of node `n`'s /metrics: the value after `key` (0 if it is not there).
pub async fn metric(n: &MeshNode, key: &str) -> f64 {
    metrics(n)
        .await
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// Uploads the problem's inputs through `via` and submits it in `shards` shards.
pub async fn submit(via: &Client, problem: &Problem, shards: u32) -> u64 {
    for (id, bytes) in &problem.blobs {
        assert_eq!(via.upload(bytes.to_vec()).await.unwrap(), *id);
    }
    via.submit(problem.spec(shards), None).await.unwrap()
}

pub async fn stop(nodes: Vec<MeshNode>) {
    for n in nodes {
        n.stop().await;
    }
}

/// Every shard of `view` was accepted exactly once, as its history records. A full
/// history may have dropped its oldest events; then each shard is accepted at most
/// once.
pub fn accepted_once(view: &TaskView) {
    let mut accepted: BTreeMap<u32, usize> = BTreeMap::new();
    for e in &view.history {
        if e.what.contains("accepted") {
            *accepted.entry(e.shard.unwrap_or(u32::MAX)).or_default() += 1;
        }
    }
    let complete = view.history.len() < MAX_HISTORY;
    for s in &view.shards {
        let times = accepted.get(&s.index).copied().unwrap_or(0);
        assert!(
            times == 1 || (!complete && times == 0),
            "t{} shard {} accepted {times} times: {:#?}",
            view.id,
            s.index,
            view.history
        );
    }
}

/// An actor call's kernel that tests replay on the CPU: each call multiplies the
/// state by 3 and adds its parameter (the order matters), and writes the first four
/// words as they were before it.
pub const STEP: &str = r#"
struct Params { add: u32, _a: u32, _b: u32, _c: u32 }
@group(0) @binding(0) var<storage, read_write> state: array<u32>;
@group(0) @binding(1) var<uniform> params: Params;
@group(0) @binding(2) var<storage, read_write> before: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i < arrayLength(&state)) {
        let old = state[i];
        if (i < 4u) {
            before[i] = old;
        }
        state[i] = old * 3u + params.add + i;
    }
}
"#;

/// Little-endian u32 words.
pub fn words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Each invocation steps a 32-bit LCG [`LCG_STEPS`] times from its index: slow on a
/// GPU (seconds on a software adapter for a few thousand workgroups), checked on the
/// CPU at once with [`lcg_after`]. (Fewer than 65,536 turns: Mesa's software
/// adapters refuse more.)
pub const LCG: &str = "@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var x = gid.x;
    for (var i = 0u; i < 60000u; i++) {
        x = x * 1664525u + 1013904223u;
    }
    out[gid.x] = x;
}
";
pub const LCG_STEPS: u64 = 60_000;

/// [`LCG`] over `groups` workgroups in `shards` shards: one output word per
/// invocation.
pub fn lcg_spec(groups: u32, shards: u32) -> gpumesh::protocol::TaskSpec {
    use gpumesh::protocol::{BindingRole, BindingSpec, Grid, MergeRule, ShaderSource};
    gpumesh::protocol::TaskSpec {
        shader: ShaderSource::Wgsl(LCG.into()),
        entry_point: "main".into(),
        bindings: vec![BindingSpec {
            binding: 0,
            role: BindingRole::Output {
                size: u64::from(groups) * 64 * 4,
            },
        }],
        grid: Grid([groups, 1, 1]),
        shards,
        merge: MergeRule::Changes,
        merges: Default::default(),
        options: Default::default(),
    }
}

/// Ends only when `stop` (the uniform at binding 1) is set, and it never is: past
/// any deadline on any adapter given a few thousand workgroups (llvmpipe and
/// lavapipe cut loops at 65,535 turns, seconds of work there). Binding 0 is any
/// `u32` buffer, written with bounds checked.
pub const RUNAWAY: &str = r#"
struct Params { stop: u32, _a: u32, _b: u32, _c: u32 }
@group(0) @binding(0) var<storage, read_write> state: array<u32>;
@group(0) @binding(1) var<uniform> params: Params;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var x = gid.x;
    loop {
        x = (x ^ (x >> 13u)) * 1664525u + 1u;
        if (params.stop != 0u) {
            break;
        }
    }
    if (gid.x < arrayLength(&state)) {
        state[gid.x] = x;
    }
}
"#;

/// A task of [`RUNAWAY`] over `groups` workgroups under a deadline of
/// `deadline_ms`: its output at binding 0, its stop flag (zero) at binding 1.
pub fn runaway_spec(groups: u32, deadline_ms: u64) -> gpumesh::protocol::TaskSpec {
    use gpumesh::protocol::{BindingRole, BindingSpec, Grid, MergeRule, ShaderSource};
    gpumesh::protocol::TaskSpec {
        shader: ShaderSource::Wgsl(RUNAWAY.into()),
        entry_point: "main".into(),
        bindings: vec![
            BindingSpec {
                binding: 0,
                role: BindingRole::Output {
                    size: u64::from(groups) * 256,
                },
            },
            BindingSpec {
                binding: 1,
                role: BindingRole::Param {
                    data: vec![0u8; 16],
                },
            },
        ],
        grid: Grid([groups, 1, 1]),
        shards: 1,
        merge: MergeRule::Changes,
        merges: Default::default(),
        options: gpumesh::protocol::TaskOptions {
            deadline_ms: Some(deadline_ms),
            ..Default::default()
        },
    }
}

/// Whether `why` a run of [`RUNAWAY`] failed is one of the two ways it is stopped:
/// its deadline, or (on a GPU that runs loops as written) the node's loop bound,
/// whichever comes first there.
pub fn runaway_stopped(why: &str) -> bool {
    why.contains("deadline") || why.contains("--max-loop-turns")
}

/// The CPU's answer for invocation indices 0..`invocations` each stepped `steps`
/// times through the 32-bit LCG x ↦ 1664525·x + 1013904223: the map applied `steps`
/// times is itself x ↦ A·x + C, found by composing it with itself (square and
/// multiply), so a kernel that takes the GPU seconds is checked at once.
pub fn lcg_after(steps: u64, invocations: u32) -> Vec<u8> {
    let (mut a, mut c) = (1u32, 0u32); // the identity
    let (mut pa, mut pc) = (1_664_525u32, 1_013_904_223u32); // the map, squared as we go
    let mut n = steps;
    while n > 0 {
        if n & 1 == 1 {
            // (a, c) then (pa, pc)
            c = pa.wrapping_mul(c).wrapping_add(pc);
            a = pa.wrapping_mul(a);
        }
        pc = pa.wrapping_mul(pc).wrapping_add(pc);
        pa = pa.wrapping_mul(pa);
        n >>= 1;
    }
    (0..invocations)
        .flat_map(|x| a.wrapping_mul(x).wrapping_add(c).to_le_bytes())
        .collect()
}

/// Adds one to every word of an actor's state at binding 0: a counter whose every
/// word, read back, is the number of calls that ran.
pub const COUNT: &str = r#"
@group(0) @binding(0) var<storage, read_write> count: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < arrayLength(&count)) {
        count[gid.x] = count[gid.x] + 1u;
    }
}
"#;

/// A call of [`COUNT`] over a state of `words` words.
pub fn count_call(words: u32) -> gpumesh::protocol::ActorCall {
    use gpumesh::protocol::{ActorCall, Grid, ShaderSource};
    ActorCall {
        shader: ShaderSource::Wgsl(COUNT.into()),
        entry_point: "main".into(),
        bindings: vec![],
        grid: Grid([words.div_ceil(64), 1, 1]),
        deadline_ms: None,
    }
}

/// Creates actor `name` through `via`: one state buffer of `words` zero words at
/// binding 0, for [`count_call`].
pub async fn create_counter(via: &Client, name: &str, words: u32) {
    let zeros = vec![gpumesh::node::api::StateInit {
        binding: 0,
        size: u64::from(words) * 4,
        blob: None,
    }];
    via.create_actor(name, zeros, None).await.unwrap();
}

/// Starts a node expected not to start (kept out of a mesh, refused its data dir);
/// returns its error message.
pub async fn refused(c: NodeConfig) -> String {
    match MeshNode::start(c).await {
        Ok(node) => {
            let peer = node.peer_id;
            node.stop().await;
            panic!("{peer} started where it should have been refused");
        }
        Err(e) => e.to_string(),
    }
}

/// The mesh still takes tasks through `via` and, with an adapter here, runs them and
/// serves the result through `fetch`, checked against the CPU.
pub async fn still_serves(via: &MeshNode, fetch: &MeshNode) {
    let problem = gpumesh::shaders::builtins::get("vector_add")
        .unwrap()
        .problem(256 * 8)
        .unwrap();
    let task = submit(&client(via), &problem, 2).await;
    if have_any() {
        client(via).wait(task, |_, _| {}).await.unwrap();
        problem
            .verify(&client(fetch).results(task).await.unwrap())
            .unwrap();
    } else {
        assert_eq!(client(fetch).task(task).await.unwrap().id, task);
    }
}

/// Asserts that actor `name`'s state at binding 0, read through `via`, is `words`
/// words each equal to `calls`: a [`COUNT`] counter that counted every call once.
pub async fn counted(via: &Client, name: &str, words: u32, calls: u32) {
    let state = via.actor_state(name, 0).await.unwrap();
    assert_eq!(state.len(), words as usize * 4);
    assert!(
        state
            .chunks_exact(4)
            .all(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) == calls),
        "every word of {name} counts {calls} calls"
    );
}

/// Waits (two minutes at most) for [`lcg_spec`] task `task` of `groups` workgroups
/// through `via`: completed, each shard accepted once, its output the CPU
/// reference's ([`lcg_after`]).
pub async fn lcg_finished_right(via: &Client, task: u64, groups: u32) {
    let view = tokio::time::timeout(Duration::from_secs(120), via.wait(task, |_, _| {}))
        .await
        .expect("the task finished")
        .unwrap();
    assert_eq!(
        view.status,
        gpumesh::node::api::TaskState::Completed,
        "{view:#?}"
    );
    accepted_once(&view);
    let out = via
        .results(task)
        .await
        .unwrap()
        .remove(&0)
        .expect("output binding 0");
    assert!(
        out == lcg_after(LCG_STEPS, groups * 64),
        "t{task} differs from the CPU reference"
    );
}

/// Written the way WebGPU tutorials write a kernel, a bounds check for the ragged
/// last workgroup: word `i` of its output is a hash of `i` plus a salt, which
/// names the submission.
pub const SALTED: &str = "@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= arrayLength(&out)) { return; }
    out[i] = i * 2654435761u + SALTu;
}
";

/// [`SALTED`] over `n` words in two shards, with `salt`.
pub fn salted_spec(n: u32, salt: u32) -> gpumesh::protocol::TaskSpec {
    use gpumesh::protocol::{BindingRole, BindingSpec, Grid, MergeRule, ShaderSource};
    gpumesh::protocol::TaskSpec {
        shader: ShaderSource::Wgsl(SALTED.replace("SALT", &salt.to_string())),
        entry_point: "main".into(),
        bindings: vec![BindingSpec {
            binding: 0,
            role: BindingRole::Output {
                size: u64::from(n) * 4,
            },
        }],
        grid: Grid([n.div_ceil(64), 1, 1]),
        shards: 2,
        merge: MergeRule::Changes,
        merges: Default::default(),
        options: Default::default(),
    }
}

/// The CPU's answer to [`salted_spec`].
pub fn salted_expected(n: u32, salt: u32) -> Vec<u8> {
    (0..n)
        .flat_map(|i| {
            i.wrapping_mul(2_654_435_761)
                .wrapping_add(salt)
                .to_le_bytes()
        })
        .collect()
}
