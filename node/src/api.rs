//! The local HTTP+JSON API (loopback by default), used by the CLI, `gpumesh::Client`
//! and, later, the dashboard. Talks to: raft (proposes submits, reads state), the
//! blob store and net (outputs are merged from shard blobs pulled from their nodes).
//!
//! It enforces the node's [`Limits`] before anything is stored or committed: request
//! bodies (blob uploads against `max_blob_bytes`, everything else against
//! `max_request_bytes`) and shader size answer 413, grid and output size 400, a
//! submitter's full queue 429; each error names the limit, its value and its flag.
//!
//! | method | path | what |
//! |---|---|---|
//! | POST | /v1/blobs | store the body as a blob, answer its id |
//! | GET | /v1/blobs/{id} | a blob's bytes (pulled from the mesh if needed) |
//! | POST | /v1/tasks | submit a task (validated here first), answer its id |
//! | GET | /v1/tasks | all tasks |
//! | GET | /v1/tasks/{id} | one task with its shards |
//! | GET | /v1/tasks/{id}/wait?done=N&timeout_ms=T | long poll: answers once the task has a shard count other than N done, or has finished, or T ms passed |
//! | GET | /v1/tasks/{id}/outputs | merged outputs: binding, size, blake3 |
//! | GET | /v1/tasks/{id}/outputs/{binding} | one merged output's bytes |
//! | GET | /v1/status | leader, term, members |
//! | GET | /metrics | this node's Prometheus metrics, OpenMetrics text (see [`crate::metrics`]) |
//!
//! Any other path answers 404 and any other method on a known path 405, each with a
//! JSON `error` like every other refusal.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use gpumesh_consensus::{
    Command, Outcome, RequestId, ShardState, StateMachine, TaskId, TaskStatus,
};
use gpumesh_protocol::{BlobId, TaskSpec};
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::error::{NodeError, Result};
use crate::limits::Limits;
use crate::liveness::{LivenessView, Presence};
use crate::mesh::Shared;

/// Merged outputs already computed on this node: task → binding → blob.
pub type ResultCache = Mutex<HashMap<TaskId, BTreeMap<u32, BlobId>>>;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SubmitRequest {
    pub spec: TaskSpec,
    /// Idempotency key: a retried submit with the same id returns the same task.
    pub request_id: Option<RequestId>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SubmitReply {
    pub task: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BlobReply {
    pub id: String,
    pub size: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ShardView {
    pub index: u32,
    pub state: String,
    /// The node of the latest attempt in flight, or of the accepted result.
    pub node: Option<u64>,
    pub epoch: u32,
    /// Attempts in flight as (node, epoch); more than one for replicas and
    /// speculative copies of stragglers.
    #[serde(default)]
    pub attempts: Vec<(u64, u32)>,
    /// Nodes whose results are in, awaiting comparison with other replicas.
    #[serde(default)]
    pub reported_by: Vec<u64>,
    pub failures: u32,
    pub last_error: Option<String>,
    pub output: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TaskView {
    pub id: u64,
    pub status: String,
    pub reason: Option<String>,
    pub kernel: String,
    pub submitter: String,
    pub merge: String,
    pub grid: String,
    pub shards_done: usize,
    pub shards: Vec<ShardView>,
    /// Nodes each shard runs on for verification.
    #[serde(default = "one")]
    pub replicas: u32,
    /// Replica results that disagreed.
    #[serde(default)]
    pub mismatches: u32,
    /// Assignments, retries, replica comparisons, newest last.
    #[serde(default)]
    pub history: Vec<HistoryView>,
}

fn one() -> u32 {
    1
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HistoryView {
    pub index: u64,
    pub shard: Option<u32>,
    pub what: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OutputView {
    pub binding: u32,
    pub size: u64,
    pub blake3: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MemberView {
    pub raft_id: u64,
    pub peer_id: String,
    pub role: String,
    /// Heard from within `down_after` and not known unreachable (see `liveness`).
    pub alive: bool,
    /// This node's connections to it closed and it could not be dialled again.
    #[serde(default)]
    pub unreachable: bool,
    /// Where it listens, from its membership record.
    #[serde(default)]
    pub addrs: Vec<String>,
    pub adapter: Option<String>,
    pub backend: Option<String>,
    pub gflops: Option<f64>,
    pub gbps: Option<f64>,
    pub queue: u32,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StatusView {
    pub node: u64,
    pub peer_id: String,
    pub leader: u64,
    pub term: u64,
    pub commit_index: u64,
    pub applied_index: u64,
    pub members: Vec<MemberView>,
}

#[derive(Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}

pub(crate) struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(ErrorBody { error: self.1 })).into_response()
    }
}

fn bad(e: impl std::fmt::Display) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, e.to_string())
}

fn too_large(e: impl std::fmt::Display) -> ApiError {
    ApiError(StatusCode::PAYLOAD_TOO_LARGE, e.to_string())
}

pub(crate) fn unavailable(e: impl std::fmt::Display) -> ApiError {
    ApiError(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
}

fn not_found(id: u64) -> ApiError {
    ApiError(
        StatusCode::NOT_FOUND,
        format!("no task t{id}; `gpumesh tasks` lists the tasks there are"),
    )
}

pub(crate) type ApiResult<T> = std::result::Result<T, ApiError>;

/// Binds `addr` and serves until `cancel`; returns the bound address.
/// Serves the API on `addr`. On a loopback address anyone on this machine may call
/// it, as before; on any other every request but the dashboard's page must carry
/// `Authorization: Bearer TOKEN` (the node's `api.token`).
pub(crate) async fn serve(
    addr: SocketAddr,
    token: String,
    shared: Arc<Shared>,
    cancel: CancellationToken,
) -> Result<(SocketAddr, JoinHandle<()>)> {
    let caps = BodyCaps::of(&shared.limits);
    let gate = Gate {
        token: (!addr.ip().is_loopback()).then(|| Arc::new(token)),
    };
    let app = Router::new()
        .route(
            "/v1/blobs",
            post(put_blob).layer(DefaultBodyLimit::max(caps.blob.max())),
        )
        .route("/v1/blobs/{id}", get(get_blob))
        .route("/v1/tasks", post(submit).get(list_tasks))
        .route("/v1/tasks/{id}", get(get_task))
        .route("/v1/tasks/{id}/wait", get(wait_task))
        .route("/v1/tasks/{id}/outputs", get(outputs))
        .route("/v1/tasks/{id}/outputs/{binding}", get(output_bytes))
        .route("/v1/status", get(status))
        .route("/", get(crate::dashboard::page))
        .route("/v1/overview", get(crate::dashboard::overview))
        .route("/metrics", get(metrics))
        .fallback(no_such_path)
        .method_not_allowed_fallback(no_such_method)
        // Every route but the blob upload above, which sets its own.
        .layer(DefaultBodyLimit::max(caps.request.max()))
        .layer(middleware::from_fn_with_state(caps, announced_within))
        .layer(middleware::from_fn_with_state(gate, bearer))
        .with_state(shared);
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        NodeError::Config(format!(
            "cannot serve the API on {addr}: {e}; pick another --api address"
        ))
    })?;
    let bound = listener
        .local_addr()
        .map_err(|e| NodeError::Config(e.to_string()))?;
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move { cancel.cancelled().await })
            .await;
    });
    Ok((bound, task))
}

pub(crate) fn consensus(shared: &Shared) -> ApiResult<gpumesh_consensus::ConsensusHandle> {
    shared
        .consensus
        .get()
        .cloned()
        .ok_or_else(|| unavailable("this node has not joined a mesh yet"))
}

/// A linearizable read (ReadIndex) when the leader confirms it within a second;
/// otherwise this replica's own state, which may trail the leader by a few entries
/// (the caller sees at worst a task a step behind, never a wrong one).
async fn read_current<R: Send + 'static>(
    c: &gpumesh_consensus::ConsensusHandle,
    f: impl Fn(&StateMachine) -> R + Clone + Send + 'static,
) -> ApiResult<R> {
    let g = f.clone();
    match tokio::time::timeout(std::time::Duration::from_secs(1), c.read_linearizable(f)).await {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "linearizable read failed; reading locally");
            c.read_local(g).await.map_err(unavailable)
        }
        Err(_) => {
            tracing::debug!("linearizable read slow; reading locally");
            c.read_local(g).await.map_err(unavailable)
        }
    }
}

/// The most bytes a request body may have, and how to name it when it has more.
#[derive(Clone, Copy, Debug)]
struct BodyCap {
    what: &'static str,
    limit: u64,
    setting: &'static str,
}

impl BodyCap {
    /// For axum's `DefaultBodyLimit`, which stops reading one byte past it.
    fn max(&self) -> usize {
        usize::try_from(self.limit).unwrap_or(usize::MAX)
    }

    fn refuse(&self, size: Option<u64>) -> ApiError {
        too_large(match size {
            Some(size) => NodeError::Limit {
                what: self.what,
                value: size,
                limit: self.limit,
                setting: self.setting,
            }
            .to_string(),
            None => format!(
                "{} is over the limit of {} (the node's {})",
                self.what, self.limit, self.setting
            ),
        })
    }

    /// The body, or a refusal naming the limit it went over while it was read.
    fn within(&self, body: std::result::Result<Bytes, BytesRejection>) -> ApiResult<Bytes> {
        body.map_err(|rejection| match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => self.refuse(None),
            status => ApiError(status, rejection.body_text()),
        })
    }
}

/// Blob uploads answer to the blob limit; every other body to the request limit.
#[derive(Clone, Copy, Debug)]
struct BodyCaps {
    blob: BodyCap,
    request: BodyCap,
}

impl BodyCaps {
    fn of(limits: &Limits) -> Self {
        BodyCaps {
            blob: BodyCap {
                what: "the blob's size in bytes",
                limit: limits.max_blob_bytes,
                setting: "--max-blob-bytes",
            },
            request: BodyCap {
                what: "the request body's size in bytes",
                limit: limits.max_request_bytes,
                setting: "--max-request-bytes",
            },
        }
    }

    fn for_path(&self, path: &str) -> BodyCap {
        if path == "/v1/blobs" {
            self.blob
        } else {
            self.request
        }
    }
}

/// Who may call the API: anyone (loopback), or holders of the token.
#[derive(Clone)]
struct Gate {
    token: Option<Arc<String>>,
}

/// Compares in time independent of where the first difference is.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Refuses, with 401 and a JSON error, a request off loopback without the token. The
/// dashboard's page itself is served (it holds no data; it sends the token it is
/// given in its address, `/#token=TOKEN`, with each request it makes).
async fn bearer(State(gate): State<Gate>, request: Request, next: Next) -> Response {
    let Some(token) = &gate.token else {
        return next.run(request).await;
    };
    if request.uri().path() == "/" {
        return next.run(request).await;
    }
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
        Some(t) if same_secret(t.as_bytes(), token.as_bytes()) => next.run(request).await,
        Some(_) => ApiError(
            StatusCode::UNAUTHORIZED,
            "wrong API token: the node's token is in its data dir (api.token); give it \
             with --token, GPUMESH_TOKEN or --data-dir"
                .into(),
        )
        .into_response(),
        None => ApiError(
            StatusCode::UNAUTHORIZED,
            "this node's API is served off loopback and requires `Authorization: Bearer \
             TOKEN`; the token is in the node's data dir (api.token): give it with --token, \
             GPUMESH_TOKEN or --data-dir"
                .into(),
        )
        .into_response(),
    }
}

/// Refuses a body whose announced length is over its cap before reading any of it,
/// so a client waiting for `100 Continue` is answered at once and sends nothing.
/// Bodies without a length are cut off by `DefaultBodyLimit` as they are read.
async fn announced_within(State(caps): State<BodyCaps>, request: Request, next: Next) -> Response {
    let cap = caps.for_path(request.uri().path());
    let announced = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match announced {
        Some(size) if size > cap.limit => cap.refuse(Some(size)).into_response(),
        _ => next.run(request).await,
    }
}

async fn put_blob(
    State(shared): State<Arc<Shared>>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> ApiResult<Json<BlobReply>> {
    let body = BodyCaps::of(&shared.limits).blob.within(body)?;
    let size = body.len() as u64;
    let blobs = shared.blobs.clone();
    let id = tokio::task::spawn_blocking(move || blobs.put(&body))
        .await
        .map_err(unavailable)?
        .map_err(|e| match e {
            NodeError::Limit { .. } => too_large(e),
            e => unavailable(format!("could not store the blob: {e}")),
        })?;
    Ok(Json(BlobReply {
        id: id.to_hex(),
        size,
    }))
}

async fn get_blob(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> ApiResult<Vec<u8>> {
    let id: BlobId = id.parse().map_err(bad)?;
    crate::mesh::fetch_blob(&shared, id, None)
        .await
        .map_err(|e| ApiError(StatusCode::NOT_FOUND, e))?;
    shared.blobs.get(&id).map_err(unavailable)?.ok_or_else(|| {
        ApiError(
            StatusCode::NOT_FOUND,
            format!("blob {id} is not on this node"),
        )
    })
}

/// A place in this node's queue, held from the limit check until the submit is
/// answered (by then a committed task is in the replicated queue it counts).
struct QueueSlot<'a> {
    under_way: &'a AtomicUsize,
    /// A task with this submit's request id exists already: the submit is a retry.
    retry: bool,
}

impl Drop for QueueSlot<'_> {
    fn drop(&mut self) {
        self.under_way.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Refuses a submit when the tasks submitted through this node and still pending or
/// running, plus the submits under way here, reach the limit. A retried submit of a
/// task already created passes: it creates nothing.
async fn queue_slot<'a>(
    shared: &'a Shared,
    c: &gpumesh_consensus::ConsensusHandle,
    request_id: RequestId,
    limits: &Limits,
) -> ApiResult<QueueSlot<'a>> {
    // Counted before the state is read, so a submit applied between the two reads is
    // counted twice (refusing a moment early) but never missed.
    let under_way = shared.submits_in_flight.fetch_add(1, Ordering::SeqCst);
    let mut slot = QueueSlot {
        under_way: &shared.submits_in_flight,
        retry: false,
    };
    let me = shared.peer_id.to_string();
    let (queued, retry) = c
        .read_local(move |s| {
            let queued = s.active_tasks().filter(|t| t.submitter == me).count();
            (queued, s.task_by_request(&request_id).is_some())
        })
        .await
        .map_err(unavailable)?;
    let limit = limits.max_queued_per_submitter;
    if !retry && queued + under_way >= limit {
        return Err(ApiError(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "{} tasks submitted through this node are pending or running, at the limit \
                 of {limit} (the node's --max-queued-per-submitter); wait for some to \
                 finish (`gpumesh tasks`) and submit again",
                queued + under_way
            ),
        ));
    }
    slot.retry = retry;
    Ok(slot)
}

/// In a `submit{request task}` span: `task` is recorded once committed, so the
/// task's lines here match the `shard{task ..}` lines of the workers that run it.
#[tracing::instrument(
    name = "submit",
    skip_all,
    fields(request = tracing::field::Empty, task = tracing::field::Empty)
)]
async fn submit(
    State(shared): State<Arc<Shared>>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> ApiResult<Json<SubmitReply>> {
    let limits = shared.limits;
    let body = BodyCaps::of(&limits).request.within(body)?;
    let req: SubmitRequest =
        serde_json::from_slice(&body).map_err(|e| bad(format!("malformed submit request: {e}")))?;
    let c = consensus(&shared)?;
    // The cheap limits first: a huge shader is not parsed, a huge grid not planned.
    limits.check_shader(&req.spec).map_err(too_large)?;
    limits.check_work(&req.spec).map_err(bad)?;
    let request_id = req.request_id.unwrap_or_else(|| c.new_request_id());
    let span = tracing::Span::current();
    span.record(
        "request",
        tracing::field::display(format_args!("{:x}.{}", request_id.client, request_id.seq)),
    );
    let slot = queue_slot(&shared, &c, request_id, &limits).await?;
    // The same checks `gpumesh run` makes, before anything is committed.
    let kernel = shared
        .kernels
        .get(&req.spec.shader, &req.spec.entry_point)
        .map_err(bad)?;
    kernel.check(&req.spec).map_err(bad)?;
    for b in &req.spec.bindings {
        if let Some(blob) = b.role.blob() {
            let size = b.role.size();
            match shared.blobs.size(&blob) {
                Some(s) if s == size => {}
                Some(s) => return Err(bad(format!("binding {}: blob {blob} holds {s} bytes, the spec says {size}", b.binding))),
                None => return Err(bad(format!(
                    "binding {}: input blob {blob} is not on this node; upload it first (POST /v1/blobs)",
                    b.binding
                ))),
            }
        }
    }
    // Inputs live on this node until a worker pulls them: a second copy first, so
    // that losing this node after the acknowledgement loses no task.
    for b in &req.spec.bindings {
        if let Some(blob) = b.role.blob() {
            crate::mesh::replicate(&shared, blob, None)
                .await
                .map_err(|e| unavailable(format!("input of binding {}: {e}", b.binding)))?;
        }
    }
    let shards = req.spec.shards;
    let committed = c
        .propose_with_id(
            request_id,
            Command::SubmitTask {
                spec: req.spec,
                submitter: shared.peer_id.to_string(),
            },
        )
        .await
        .map_err(unavailable)?;
    match committed.outcome {
        Outcome::TaskSubmitted { task } => {
            span.record("task", tracing::field::display(task));
            tracing::debug!(shards, "task committed");
            if !slot.retry {
                shared.metrics.tasks_submitted.inc();
            }
            Ok(Json(SubmitReply { task: task.0 }))
        }
        Outcome::Rejected(why) => Err(bad(why)),
        other => Err(unavailable(format!("unexpected outcome {other:?}"))),
    }
}

/// A task's kernel as people know it: a built-in's name, or `wgsl:<entry point>`.
pub(crate) fn kernel_name(spec: &gpumesh_protocol::TaskSpec) -> String {
    match &spec.shader {
        gpumesh_protocol::ShaderSource::Builtin(n) => n.clone(),
        gpumesh_protocol::ShaderSource::Wgsl(_) => format!("wgsl:{}", spec.entry_point),
    }
}

fn view(t: &gpumesh_consensus::Task) -> TaskView {
    let (status, reason) = (t.status.name(), t.status.reason().map(str::to_string));
    TaskView {
        id: t.id.0,
        status: status.into(),
        reason,
        kernel: kernel_name(&t.spec),
        submitter: t.submitter.clone(),
        merge: t.spec.merge_label(),
        grid: t.spec.grid.to_string(),
        shards_done: t
            .shards
            .iter()
            .filter(|s| s.state == ShardState::Done)
            .count(),
        shards: t
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| ShardView {
                index: i as u32,
                state: format!("{:?}", s.state).to_lowercase(),
                node: s.assigned_to().or(s.output.map(|o| o.node)),
                epoch: s.epoch,
                attempts: s.attempts.iter().map(|a| (a.node, a.epoch)).collect(),
                reported_by: s.reports.iter().map(|r| r.node).collect(),
                failures: s.failures,
                last_error: s.last_error.clone(),
                output: s.output.map(|o| o.blob.to_hex()),
            })
            .collect(),
        replicas: t.spec.options.replicas,
        mismatches: t.mismatches,
        history: t
            .history
            .iter()
            .map(|e| HistoryView {
                index: e.index,
                shard: e.shard,
                what: e.what.clone(),
            })
            .collect(),
    }
}

async fn list_tasks(State(shared): State<Arc<Shared>>) -> ApiResult<Json<Vec<TaskView>>> {
    let c = consensus(&shared)?;
    let tasks = c
        .read_local(|s| s.tasks().values().map(view).collect::<Vec<_>>())
        .await
        .map_err(unavailable)?;
    Ok(Json(tasks))
}

async fn get_task(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<u64>,
) -> ApiResult<Json<TaskView>> {
    let c = consensus(&shared)?;
    // This replica's state: a submit is acknowledged only once the submitting
    // replica has applied it, and waiting clients long-poll on local applies.
    c.read_local(move |s| s.task(TaskId(id)).map(view))
        .await
        .map_err(unavailable)?
        .map(Json)
        .ok_or_else(|| not_found(id))
}

#[derive(Deserialize)]
struct WaitQuery {
    done: Option<usize>,
    timeout_ms: Option<u64>,
}

async fn wait_task(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<u64>,
    axum::extract::Query(q): axum::extract::Query<WaitQuery>,
) -> ApiResult<Json<TaskView>> {
    let c = consensus(&shared)?;
    // Subscribe before the first read so no change slips between the two.
    let mut events = c.subscribe();
    let deadline = tokio::time::Instant::now()
        + std::time::Duration::from_millis(q.timeout_ms.unwrap_or(30_000).min(60_000));
    loop {
        let view = c
            .read_local(move |s| s.task(TaskId(id)).map(view))
            .await
            .map_err(unavailable)?
            .ok_or_else(|| not_found(id))?;
        let finished = matches!(view.status.as_str(), "completed" | "failed" | "cancelled");
        if finished || Some(view.shards_done) != q.done {
            return Ok(Json(view));
        }
        // Sleep through entries about other tasks: many clients may be waiting.
        loop {
            match tokio::time::timeout_at(deadline, events.recv()).await {
                Err(_) => return Ok(Json(view)),
                Ok(Err(tokio::sync::broadcast::error::RecvError::Closed)) => {
                    return Err(unavailable("the node is shutting down"))
                }
                Ok(Ok(gpumesh_consensus::AppliedEvent::Entry { entry, .. })) => {
                    if concerns(&entry.command, TaskId(id)) {
                        break;
                    }
                }
                Ok(_) => break,
            }
        }
    }
}

/// Whether applying `command` can change task `id`.
fn concerns(command: &Command, id: TaskId) -> bool {
    command.task() == Some(id)
}

/// A completed task's outputs as blobs on this node, binding → blob.
async fn merged(shared: &Arc<Shared>, id: u64) -> ApiResult<BTreeMap<u32, BlobId>> {
    // A completed task's outputs never change: once known here, no read of the record.
    if let Some(done) = shared
        .results
        .lock()
        .ok()
        .and_then(|r| r.get(&TaskId(id)).cloned())
    {
        return Ok(done);
    }
    let c = consensus(shared)?;
    let task = read_current(&c, move |s: &StateMachine| s.task(TaskId(id)).cloned())
        .await?
        .ok_or_else(|| not_found(id))?;
    match &task.status {
        TaskStatus::Completed => {}
        TaskStatus::Failed(r) | TaskStatus::Cancelled(r) => {
            return Err(ApiError(
                StatusCode::CONFLICT,
                format!("task t{id} did not complete: {r}"),
            ))
        }
        TaskStatus::Merging => {
            return Err(ApiError(
                StatusCode::CONFLICT,
                format!("task t{id} is being merged; `gpumesh submit --wait` or retry in a moment"),
            ))
        }
        _ => {
            return Err(ApiError(
                StatusCode::CONFLICT,
                format!("task t{id} is still running; `gpumesh submit --wait` or retry later"),
            ))
        }
    }
    crate::outputs::task_outputs(shared, &task)
        .await
        .map_err(|e| unavailable(e.to_string()))
}

async fn outputs(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<u64>,
) -> ApiResult<Json<Vec<OutputView>>> {
    let ids = merged(&shared, id).await?;
    Ok(Json(
        ids.into_iter()
            .map(|(binding, blob)| OutputView {
                binding,
                size: shared.blobs.size(&blob).unwrap_or(0),
                blake3: blob.to_hex(),
            })
            .collect(),
    ))
}

async fn output_bytes(
    State(shared): State<Arc<Shared>>,
    Path((id, binding)): Path<(u64, u32)>,
) -> ApiResult<Vec<u8>> {
    let ids = merged(&shared, id).await?;
    let blob = ids.get(&binding).ok_or_else(|| {
        ApiError(
            StatusCode::NOT_FOUND,
            format!(
                "task t{id} has no output binding {binding}; it has {:?}",
                ids.keys().collect::<Vec<_>>()
            ),
        )
    })?;
    shared
        .blobs
        .get(blob)
        .map_err(unavailable)?
        .ok_or_else(|| unavailable("merged output vanished"))
}

/// How members look from this node (see [`crate::liveness`]); before the liveness
/// actor runs, everyone counts as alive.
pub(crate) fn liveness_view(shared: &Shared) -> Arc<LivenessView> {
    shared.liveness.get().map(|l| l.view()).unwrap_or_default()
}

async fn status(State(shared): State<Arc<Shared>>) -> ApiResult<Json<StatusView>> {
    let c = consensus(&shared)?;
    let st = c.status().await.map_err(unavailable)?;
    let liveness = liveness_view(&shared);
    let members = c
        .read_local(move |s| {
            let queue = s.queue_by_node();
            s.members()
                .values()
                .map(|m| MemberView {
                    raft_id: m.raft_id,
                    peer_id: m.peer_id.clone(),
                    role: format!("{:?}", m.role).to_lowercase(),
                    alive: liveness.is_alive(m.raft_id),
                    unreachable: liveness.presence(m.raft_id) == Presence::Unreachable,
                    addrs: m.addrs.clone(),
                    adapter: m.capability.as_ref().map(|c| c.adapter_name.clone()),
                    backend: m.capability.as_ref().map(|c| c.backend.name().to_string()),
                    gflops: m.capability.as_ref().map(|c| c.gflops),
                    gbps: m.capability.as_ref().map(|c| c.gbps),
                    queue: queue.get(&m.raft_id).copied().unwrap_or(0),
                })
                .collect::<Vec<_>>()
        })
        .await
        .map_err(unavailable)?;
    Ok(Json(StatusView {
        node: shared.raft_id,
        peer_id: shared.peer_id.to_string(),
        leader: st.leader_id,
        term: st.term,
        commit_index: st.commit_index,
        applied_index: st.applied_index,
        members,
    }))
}

/// This node's metrics in the OpenMetrics text format; what is read rather than
/// counted (tasks by status, the blob store) is refreshed first.
async fn metrics(State(shared): State<Arc<Shared>>) -> ApiResult<Response> {
    shared.metrics.refresh(&shared.blobs, &shared.kernels).await;
    let text = shared
        .metrics
        .encode()
        .map_err(|e| unavailable(format!("could not encode the metrics: {e}")))?;
    Ok(([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text).into_response())
}

async fn no_such_path(uri: axum::http::Uri) -> ApiError {
    ApiError(
        StatusCode::NOT_FOUND,
        format!(
            "no such path {}; the API serves /v1/blobs, /v1/tasks, /v1/status and /metrics",
            uri.path()
        ),
    )
}

async fn no_such_method(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} does not take {method}", uri.path()),
    )
}
