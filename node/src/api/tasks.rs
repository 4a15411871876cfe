//! Tasks: submit (validated and kept on two nodes before it is committed), list,
//! one task, the long poll on one, and a completed task's outputs.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use gpumesh_consensus::{
    Command, ConsensusHandle, Outcome, RequestId, StateMachine, TaskId, TaskStatus,
};
use gpumesh_protocol::BlobId;
use serde::Deserialize;
use tokio::sync::oneshot;

use super::changes::Topic;
use super::error::{bad, not_found, too_large, unavailable, ApiError, ApiResult};
use super::gate::BodyCaps;
use super::state::ApiState;
use super::views::{
    encode_run_binary, encode_run_end, to_hex, view, OutputView, RunEnd, RunError, RunOutput,
    RunReply, SubmitReply, SubmitRequest, TaskState, TaskView, RUN_ATTACHED_BYTES, RUN_BINARY,
    RUN_INLINE_BYTES, UNCONFIRMED,
};
use super::{read_current, read_current_marked};
use crate::limits::Limits;
use crate::run_here::Early;
use crate::timeline::Stage;

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
/// task already created passes: it creates nothing (looked for at the leader's
/// commit index before a refusal, since the first try may have gone through
/// another node).
async fn queue_slot<'a>(
    api: &'a ApiState,
    c: &ConsensusHandle,
    request_id: RequestId,
    limits: &Limits,
) -> ApiResult<QueueSlot<'a>> {
    // Counted before the state is read, so a submit applied between the two reads is
    // counted twice (refusing a moment early) but never missed.
    let under_way = api.submits_in_flight.fetch_add(1, Ordering::SeqCst);
    let mut slot = QueueSlot {
        under_way: &api.submits_in_flight,
        retry: false,
    };
    let me = api.peer_name.clone();
    let (queued, retry) = c.read_local(move |s| {
        let queued = s.active_submitted_by(&me);
        (queued, s.task_by_request(&request_id).is_some())
    });
    let limit = limits.max_queued_per_submitter;
    let full = queued + under_way >= limit;
    // A retry whose first try went through another node may not be applied here
    // yet: before refusing, ask at the leader's commit index.
    let retry = retry
        || (full && read_current(c, move |s| s.task_by_request(&request_id).is_some()).await?);
    if full && !retry {
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

/// A submit that passed every check made before anything is committed.
struct Admitted<'a> {
    request_id: RequestId,
    spec: gpumesh_protocol::TaskSpec,
    /// What its kernel asks of an adapter.
    needs: gpumesh_protocol::KernelNeeds,
    received: std::time::Instant,
    slot: QueueSlot<'a>,
}

/// The checks `gpumesh run` makes, and this node's queue limit, before anything is
/// committed; records the request id in the current span.
async fn admit(
    api: &ApiState,
    body: std::result::Result<Bytes, BytesRejection>,
) -> ApiResult<Admitted<'_>> {
    let received = std::time::Instant::now();
    let limits = api.limits;
    let body = BodyCaps::of(&limits).request.within(body)?;
    let req: SubmitRequest =
        serde_json::from_slice(&body).map_err(|e| bad(format!("malformed submit request: {e}")))?;
    let c = &api.consensus;
    // The cheap limits first: a huge shader is not parsed, a huge grid not planned.
    limits.check_shader(&req.spec).map_err(too_large)?;
    limits.check_work(&req.spec).map_err(bad)?;
    let request_id = req.request_id.unwrap_or_else(|| c.new_request_id());
    tracing::Span::current().record(
        "request",
        tracing::field::display(format_args!("{:x}.{}", request_id.client, request_id.seq)),
    );
    let slot = queue_slot(api, c, request_id, &limits).await?;
    let kernel = api
        .kernels
        .get(&req.spec.shader, &req.spec.entry_point)
        .map_err(bad)?;
    kernel.check(&req.spec).map_err(bad)?;
    fits_an_adapter(c, &kernel, &req.spec)?;
    for b in &req.spec.bindings {
        if let Some(blob) = b.role.blob() {
            let size = b.role.size();
            match api.blobs.store().size(&blob) {
                // Used now: an input no task named yet is not swept while the
                // submit commits.
                Some(s) if s == size => {
                    api.blobs.store().mark_used(&blob);
                }
                Some(s) => return Err(bad(format!("binding {}: blob {blob} holds {s} bytes, the spec says {size}", b.binding))),
                None => return Err(bad(format!(
                    "binding {}: input blob {blob} is not on this node; upload it first (POST /v1/blobs)",
                    b.binding
                ))),
            }
        }
    }
    Ok(Admitted {
        request_id,
        needs: kernel.needs(),
        spec: req.spec,
        received,
        slot,
    })
}

/// Refuses a task that no member's adapter can run (its workgroup too large, in
/// invocations or memory, or a buffer past what the adapter binds), naming each
/// kind of adapter and why: committed, it would only fail on every node it was
/// tried on. A mesh with no adapter yet takes it, to place once one joins.
fn fits_an_adapter(
    c: &ConsensusHandle,
    kernel: &gpumesh_shaders::Kernel,
    spec: &gpumesh_protocol::TaskSpec,
) -> ApiResult<()> {
    // Read in place: on the usual path the first adapter fits, and nothing is
    // copied or formatted.
    let why: Vec<String> = c.read_local(|s| {
        let mut why = Vec::new();
        for cap in s.members().values().filter_map(|m| m.capability.as_ref()) {
            match kernel.fits(spec, &cap.limits) {
                Ok(()) => return Vec::new(),
                Err(e) => {
                    let line = format!("{} ({}): {e}", cap.adapter_name, cap.backend.name());
                    if !why.contains(&line) {
                        why.push(line);
                    }
                }
            }
        }
        why
    });
    match why.is_empty() {
        true => Ok(()),
        false => Err(bad(format!(
            "no adapter in the mesh can run this task: {}",
            why.join("; ")
        ))),
    }
}

/// Commits an admitted submit for the mesh to place; answers with its task id.
async fn commit(api: &ApiState, admitted: Admitted<'_>) -> ApiResult<u64> {
    let Admitted {
        request_id,
        spec,
        needs,
        received,
        slot,
    } = admitted;
    // Inputs live on this node until a worker pulls them: a second copy first, so
    // that losing this node after the acknowledgement loses no task.
    for b in &spec.bindings {
        if let Some(blob) = b.role.blob() {
            api.blobs
                .replicate(blob, None)
                .await
                .map_err(|e| unavailable(format!("input of binding {}: {e}", b.binding)))?;
        }
    }
    let shards = spec.shards;
    let committed = api
        .consensus
        .propose_with_id(
            request_id,
            Command::SubmitTask {
                spec,
                submitter: api.peer_name.clone(),
                needs: Some(needs),
            },
        )
        .await
        .map_err(unavailable)?;
    let task = submitted(api, committed.outcome, &slot)?;
    api.timeline.mark_at(task, Stage::Received, received);
    api.timeline.mark(task, Stage::Submitted);
    tracing::debug!(shards, "task committed");
    Ok(task.0)
}

/// The task a committed submit (or a run here) made, counted unless a retry made it.
fn submitted(api: &ApiState, outcome: Outcome, slot: &QueueSlot<'_>) -> ApiResult<TaskId> {
    match outcome {
        Outcome::TaskSubmitted { task } => {
            tracing::Span::current().record("task", tracing::field::display(task));
            if !slot.retry {
                api.metrics.tasks_submitted.inc();
            }
            Ok(task)
        }
        Outcome::Rejected(why) => Err(bad(why)),
        other => Err(unavailable(format!("unexpected outcome {other:?}"))),
    }
}

/// In a `submit{request task}` span: `task` is recorded once committed, so the
/// task's lines here match the `shard{task ..}` lines of the workers that run it.
#[tracing::instrument(
    name = "submit",
    skip_all,
    fields(request = tracing::field::Empty, task = tracing::field::Empty)
)]
pub(crate) async fn submit(
    State(api): State<Arc<ApiState>>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> ApiResult<Json<SubmitReply>> {
    let admitted = admit(&api, body).await?;
    let task = commit(&api, admitted).await?;
    Ok(Json(SubmitReply { task }))
}

/// Runs an admitted submit on this node's GPU and records it with its result in one
/// commit when it qualifies ([`crate::run_here`]); else commits it for the mesh to
/// place. Answers with its task id.
#[tracing::instrument(
    name = "run",
    skip_all,
    fields(request = tracing::field::Empty, task = tracing::field::Empty)
)]
async fn submit_or_run_here(
    api: &ApiState,
    body: std::result::Result<Bytes, BytesRejection>,
    early: Option<oneshot::Sender<Early>>,
) -> ApiResult<(u64, Option<crate::run_here::RanHere>)> {
    let admitted = admit(api, body).await?;
    // A retry of a task already made creates nothing: it goes the usual way.
    if let (Some(here), false) = (&api.run_here, admitted.slot.retry) {
        // Its outputs may go ahead of the record when its result is stored as a
        // blob (too large for the entry) and they all go in the answer.
        let spec = &admitted.spec;
        let early = early.filter(|_| {
            spec.writable_bytes() > gpumesh_consensus::MAX_CARRIED_RESULT as u64
                && spec.binding_bytes() <= RUN_ATTACHED_BYTES
        });
        let ran = here
            .run(
                admitted.request_id,
                spec,
                &api.peer_name,
                admitted.received,
                early,
            )
            .await;
        if let Some((committed, result)) = ran {
            let committed = committed.map_err(unavailable)?;
            return Ok((submitted(api, committed.outcome, &admitted.slot)?.0, result));
        }
    }
    Ok((commit(api, admitted).await?, None))
}

/// A request to cancel a task; the reason is recorded in its history.
#[derive(Deserialize, Default)]
pub(crate) struct CancelRequest {
    reason: Option<String>,
}

/// Cancels a task that has not finished: the record marks it cancelled (its
/// outputs are never served), no shard of it starts after that anywhere, and a
/// shard already on a GPU runs to its end (at most its deadline) with its result
/// dropped. Answers the task once the cancel is committed; a task already
/// cancelled answers the same (a retried cancel), one that finished otherwise 409.
pub(crate) async fn cancel(
    State(api): State<Arc<ApiState>>,
    Path(id): Path<u64>,
    body: Option<Json<CancelRequest>>,
) -> ApiResult<Json<TaskView>> {
    let reason = body
        .and_then(|Json(r)| r.reason)
        .unwrap_or_else(|| "cancelled by a user".to_string());
    if reason.len() > MAX_CANCEL_REASON {
        return Err(bad(format!(
            "a cancel reason of {} bytes; at most {MAX_CANCEL_REASON}",
            reason.len()
        )));
    }
    let committed = api
        .consensus
        .propose(Command::TaskCancelled {
            task: TaskId(id),
            reason,
        })
        .await
        .map_err(unavailable)?;
    let c = &api.consensus;
    let task = read_current(c, move |s: &StateMachine| s.task(TaskId(id)).map(view))
        .await?
        .ok_or_else(|| not_found(id))?;
    match (&committed.outcome, &task.status) {
        (Outcome::Applied, _) | (_, TaskState::Cancelled) => Ok(Json(task)),
        (Outcome::Rejected(_), _) => Err(not_found(id)),
        _ => Err(ApiError(
            StatusCode::CONFLICT,
            format!(
                "task t{id} already finished ({}); only a pending or running task can be \
                 cancelled",
                task.status.name()
            ),
        )),
    }
}

#[derive(Deserialize)]
pub(crate) struct ForgetQuery {
    /// The client's id for this request (`CLIENT-SEQ`, hex): a retry of a forget
    /// that was recorded answers as the first did.
    request_id: Option<String>,
}

/// Forgets a finished task: it leaves the record, and every node removes its
/// results soon after (a blob another task names stays). 204 once committed; a
/// task not finished is 409 (cancel it first), an unknown one 404.
pub(crate) async fn forget(
    State(api): State<Arc<ApiState>>,
    Path(id): Path<u64>,
    Query(q): Query<ForgetQuery>,
) -> ApiResult<StatusCode> {
    let request_id = match q.request_id {
        Some(r) => r.parse::<RequestId>().map_err(bad)?,
        None => api.consensus.new_request_id(),
    };
    let c = &api.consensus;
    let results = read_current(c, move |s: &StateMachine| {
        s.task(TaskId(id)).map(|t| t.result_blobs())
    })
    .await?
    .unwrap_or_default();
    let committed = c
        .propose_with_id(
            request_id,
            Command::ForgetTask {
                task: TaskId(id),
                results,
            },
        )
        .await
        .map_err(unavailable)?;
    match committed.outcome {
        // Every node's sweeper lets its results go, and the outputs made from them.
        Outcome::Applied => Ok(StatusCode::NO_CONTENT),
        Outcome::Rejected(why) if why.starts_with("no task") => Err(not_found(id)),
        Outcome::Rejected(why) | Outcome::Ignored(why) => {
            Err(ApiError(StatusCode::CONFLICT, format!("t{id}: {why}")))
        }
        other => Err(ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("forgetting t{id} was answered {other:?}"),
        )),
    }
}

/// The longest reason a cancel may record.
const MAX_CANCEL_REASON: usize = 1024;

/// Every task the record keeps, as of the leader's commit index when it confirms it
/// within a second: a task submitted or finished through another node is listed as
/// it is there, not as this node last applied it.
pub(crate) async fn list_tasks(State(api): State<Arc<ApiState>>) -> ApiResult<Json<Vec<TaskView>>> {
    let (mut tasks, confirmed) =
        read_current_marked(&api.consensus, |s| s.tasks().map(view).collect::<Vec<_>>()).await;
    if !confirmed {
        for t in &mut tasks {
            t.unconfirmed = Some(UNCONFIRMED.to_string());
        }
    }
    Ok(Json(tasks))
}

pub(crate) async fn get_task(
    State(api): State<Arc<ApiState>>,
    Path(id): Path<u64>,
) -> ApiResult<Json<TaskView>> {
    // As of the leader's commit index: this node may not have applied yet what
    // another already answered (the task's submit, its last result, its forgetting).
    // Without a leader's word, a task this node knows is shown marked as its own
    // copy, and one it does not know is not said never to have been made.
    let (found, confirmed) = read_current_marked(&api.consensus, move |s: &StateMachine| {
        s.task(TaskId(id)).map(view)
    })
    .await;
    match (found, confirmed) {
        (Some(mut task), _) => {
            if !confirmed {
                task.unconfirmed = Some(UNCONFIRMED.to_string());
            }
            Ok(Json(task))
        }
        (None, true) => Err(not_found(id)),
        (None, false) => Err(unavailable(format!(
            "this node does not know task t{id}, and cannot confirm with a leader that the \
             mesh does not ({UNCONFIRMED}). Retry, or ask another node"
        ))),
    }
}

#[derive(Deserialize)]
pub(crate) struct WaitQuery {
    done: Option<usize>,
    timeout_ms: Option<u64>,
}

pub(crate) async fn wait_task(
    State(api): State<Arc<ApiState>>,
    Path(id): Path<u64>,
    axum::extract::Query(q): axum::extract::Query<WaitQuery>,
) -> ApiResult<Json<TaskView>> {
    let deadline = tokio::time::Instant::now()
        + std::time::Duration::from_millis(q.timeout_ms.unwrap_or(30_000).min(60_000));
    wait_change(&api, id, q.done, deadline).await.map(Json)
}

#[derive(Deserialize)]
pub(crate) struct RunQuery {
    timeout_ms: Option<u64>,
}

/// `POST /v1/tasks/run`: submits like `POST /v1/tasks` (a task of one shard and one
/// replica runs on this node's GPU when a slot is free, [`crate::run_here`]), waits
/// here for the task to finish (up to `timeout_ms`, 60 s by default, 600 s at most), and answers with the
/// task and its outputs, their bytes inline when all together are at most
/// [`RUN_INLINE_BYTES`] ([`RUN_ATTACHED_BYTES`] in a binary answer): one request
/// instead of submit, wait, list and fetch.
///
/// In a binary answer, the outputs of a task run here that are too large for its
/// entry go to the client while its result is being stored on two nodes and
/// recorded ([`streamed`]); the answer's end says whether they are the answer.
pub(crate) async fn run(
    State(api): State<Arc<ApiState>>,
    axum::extract::Query(q): axum::extract::Query<RunQuery>,
    headers: axum::http::HeaderMap,
    body: std::result::Result<Bytes, BytesRejection>,
) -> ApiResult<axum::response::Response> {
    let deadline = tokio::time::Instant::now()
        + std::time::Duration::from_millis(q.timeout_ms.unwrap_or(60_000).min(600_000));
    let binary = headers
        .get_all(axum::http::header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.split(',').any(|t| t.trim() == RUN_BINARY));
    let (early_tx, mut early_rx) = oneshot::channel();
    let mut ran = Box::pin(run_and_wait(
        api.clone(),
        body,
        deadline,
        binary.then_some(early_tx),
    ));
    // The run's changes, when it ran here and they may go ahead of its record.
    let early = tokio::select! {
        biased;
        ran = &mut ran => return answer(&api, ran?, binary).await,
        early = &mut early_rx => early.ok(),
    };
    match early {
        Some(early) => Ok(streamed(api, ran, early)),
        None => answer(&api, ran.await?, binary).await,
    }
}

/// What a run came to, before its outputs are made: the task as it stands
/// (finished, or the wait ran out) and, for a task run here, its result in memory.
struct Ran {
    view: TaskView,
    here: Option<crate::run_here::RanHere>,
}

/// Submits (or runs here) and waits for the task to finish or `deadline`. `early`
/// is given the changes of a run here whose result is stored as a blob (too large
/// for its entry) and whose outputs all go in a binary answer.
async fn run_and_wait(
    api: Arc<ApiState>,
    body: std::result::Result<Bytes, BytesRejection>,
    deadline: tokio::time::Instant,
    early: Option<oneshot::Sender<Early>>,
) -> ApiResult<Ran> {
    let (id, here) = submit_or_run_here(&api, body, early).await?;
    let mut view = wait_change(&api, id, None, deadline).await?;
    while !view.status.is_finished() && tokio::time::Instant::now() < deadline {
        view = wait_change(&api, id, Some(view.shards_done), deadline).await?;
    }
    Ok(Ran { view, here })
}

/// The answer to a run, once it is recorded.
async fn answer(api: &ApiState, ran: Ran, binary: bool) -> ApiResult<axum::response::Response> {
    let id = ran.view.id;
    let completed = ran.view.status == TaskState::Completed;
    let inline = if binary {
        RUN_ATTACHED_BYTES
    } else {
        RUN_INLINE_BYTES
    };
    let outputs = if completed {
        outputs_of(api, id, ran.here, inline).await?
    } else {
        Vec::new()
    };
    let reply = run_reply(ran.view, outputs, binary)?;
    if completed {
        api.timeline.mark(TaskId(id), Stage::Served);
    }
    Ok(reply)
}

/// Each output of completed task `id`, with its bytes when all together are at
/// most `inline`.
async fn outputs_of(
    api: &ApiState,
    id: u64,
    here: Option<crate::run_here::RanHere>,
    inline: u64,
) -> ApiResult<Vec<(RunOutput, Option<Vec<u8>>)>> {
    let mut outputs = Vec::new();
    // One shard: its changes over the starting contents are the answer, made
    // here in memory when they go in the answer (nothing to store: any node
    // can make them again).
    let task = api
        .consensus
        .read_local(move |s| s.task(TaskId(id)).cloned())
        .ok_or_else(|| not_found(id))?;
    if task.outputs.is_empty() && task.spec.binding_bytes() <= inline {
        // Run here: the changes are still in memory, when they are what the
        // record holds (a request made twice at once may have recorded the
        // other run's).
        let made = match here {
            Some(r) if holds(&task, &r) => {
                crate::outputs::merge_changes(
                    &api.blobs,
                    &api.kernels,
                    &task.spec,
                    &task.submitter,
                    vec![r.changes],
                )
                .await
            }
            _ => crate::outputs::merge_shards(&api.blobs, &api.peers, &api.kernels, &task).await,
        }
        .map_err(|e| unavailable(e.to_string()))?;
        for (binding, bytes) in made {
            let output = RunOutput {
                binding,
                size: bytes.len() as u64,
                blake3: BlobId::of(&bytes).to_hex(),
                hex: None,
                attached: false,
            };
            outputs.push((output, Some(bytes)));
        }
        return Ok(outputs);
    }
    let ids = merged(api, id).await?;
    let store = api.blobs.store();
    // Each size asked for once; a merged output not here is an error, not an
    // output of 0 bytes.
    let sized = ids
        .into_iter()
        .map(|(binding, blob)| match store.size(&blob) {
            Some(size) => Ok((binding, blob, size)),
            None => Err(unavailable("merged output vanished")),
        })
        .collect::<ApiResult<Vec<_>>>()?;
    let total: u64 = sized.iter().map(|(_, _, size)| size).sum();
    for (binding, blob, size) in sized {
        let bytes = if total <= inline {
            let bytes = store
                .get(&blob)
                .map_err(unavailable)?
                .ok_or_else(|| unavailable("merged output vanished"))?;
            Some(bytes)
        } else {
            None
        };
        let output = RunOutput {
            binding,
            size,
            blake3: blob.to_hex(),
            hex: None,
            attached: false,
        };
        outputs.push((output, bytes));
    }
    Ok(outputs)
}

/// Whether the record has `here` as the result of `task`'s one shard.
fn holds(task: &gpumesh_consensus::Task, here: &crate::run_here::RanHere) -> bool {
    let recorded = task.shards.first().and_then(|s| s.output.as_ref());
    task.shards.len() == 1 && recorded.is_some_and(|o| o.blob == here.blob)
}

/// The answer of `POST /v1/tasks/run`: JSON with the outputs' bytes in hex, or in
/// binary (see [`RUN_BINARY`]).
fn run_reply(
    task: TaskView,
    outputs: Vec<(RunOutput, Option<Vec<u8>>)>,
    binary: bool,
) -> ApiResult<axum::response::Response> {
    use axum::response::IntoResponse;
    if !binary {
        let outputs = outputs
            .into_iter()
            .map(|(mut o, bytes)| {
                o.hex = bytes.as_deref().map(to_hex);
                o
            })
            .collect();
        return Ok(Json(RunReply { task, outputs }).into_response());
    }
    let (outputs, bytes) = outputs.into_iter().unzip();
    let mut pieces =
        encode_run_binary(RunReply { task, outputs }, bytes, 0).map_err(unavailable)?;
    let length: usize = pieces.iter().map(Vec::len).sum();
    let body = if let [head] = &mut pieces[..] {
        axum::body::Body::from(std::mem::take(head))
    } else {
        // Each output's bytes sent as they are, not copied into one body first.
        let pieces = pieces
            .into_iter()
            .map(|p| Ok::<_, std::convert::Infallible>(Bytes::from(p)));
        axum::body::Body::from_stream(futures::stream::iter(pieces))
    };
    Ok((
        [
            (axum::http::header::CONTENT_TYPE, RUN_BINARY.to_string()),
            (axum::http::header::CONTENT_LENGTH, length.to_string()),
        ],
        body,
    )
        .into_response())
}

/// A binary answer whose outputs go ahead of the record: the outputs `early`
/// makes are sent (and hashed) while `ran` stores the result on two nodes and
/// records it; the end follows once it did. When the record then holds this
/// result the end names those bytes as the outputs; otherwise (the run not
/// recorded, another run's result recorded under the same request id, an error)
/// it skips them and the answer follows as it would have without them.
fn streamed(
    api: Arc<ApiState>,
    ran: impl std::future::Future<Output = ApiResult<Ran>> + Send + 'static,
    (changes, spec): Early,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(4);
    tokio::spawn(async move {
        let made = ahead_outputs(&api, &spec, &changes).await;
        let mut sent = 0u64;
        let mut ahead = Vec::new();
        if let Ok(made) = made {
            for (binding, bytes) in made {
                let hashed = {
                    let bytes = bytes.clone();
                    tokio::task::spawn_blocking(move || BlobId::of(&bytes))
                };
                sent += bytes.len() as u64;
                ahead.push((binding, bytes.len() as u64, hashed));
                if tx.send(bytes).await.is_err() {
                    // The client is gone: the run is still stored and recorded, as
                    // a submit is once made.
                    let _ = ran.await;
                    return;
                }
            }
        }
        let end = match ran.await {
            Ok(ran) => streamed_end(&api, ran, &changes, ahead, sent).await,
            Err(ApiError(status, error)) => Err(ApiError(status, error)),
        };
        let pieces = end.unwrap_or_else(|ApiError(status, error)| {
            let end = RunEnd {
                skip: sent,
                reply: None,
                error: Some(RunError {
                    status: status.as_u16(),
                    error,
                }),
            };
            vec![encode_run_end(&end).unwrap_or_default()]
        });
        for piece in pieces {
            if tx.send(Bytes::from(piece)).await.is_err() {
                return;
            }
        }
    });
    let body = futures::stream::unfold(rx, |mut rx| async move {
        let piece = rx.recv().await?;
        Some((Ok::<_, std::convert::Infallible>(piece), rx))
    });
    (
        [(axum::http::header::CONTENT_TYPE, RUN_BINARY.to_string())],
        axum::body::Body::from_stream(body),
    )
        .into_response()
}

/// The outputs of a run here from its `changes`, made as the record's node would
/// make them: each writable buffer of `spec` that the run changed word for word
/// is its changes' bytes as they are (no copy); otherwise they are merged over
/// the buffers' starting contents.
async fn ahead_outputs(
    api: &ApiState,
    spec: &gpumesh_protocol::TaskSpec,
    changes: &Arc<gpumesh_protocol::ShardChanges>,
) -> Result<Vec<(u32, Bytes)>, crate::outputs::MergeError> {
    let mut writable: Vec<(u32, u64)> = spec
        .bindings
        .iter()
        .filter(|b| b.role.is_writable())
        .map(|b| (b.binding, b.role.size()))
        .collect();
    // In binding order, as a merge gives them.
    writable.sort_unstable();
    let whole = writable.iter().all(|(b, size)| {
        changes
            .0
            .get(b)
            .is_some_and(|c| c.size == *size && c.as_whole().is_some())
    });
    if whole {
        let output = |(binding, _)| (binding, Bytes::from_owner(Whole(changes.clone(), binding)));
        return Ok(writable.into_iter().map(output).collect());
    }
    let made = crate::outputs::merge_changes(
        &api.blobs,
        &api.kernels,
        spec,
        &api.peer_name,
        vec![changes.clone()],
    )
    .await?;
    Ok(made.into_iter().map(|(b, v)| (b, Bytes::from(v))).collect())
}

/// The bytes of a buffer a run changed word for word, in its changes (as
/// [`ahead_outputs`] checked).
struct Whole(Arc<gpumesh_protocol::ShardChanges>, u32);

impl AsRef<[u8]> for Whole {
    fn as_ref(&self) -> &[u8] {
        let changes = self.0 .0.get(&self.1);
        changes.and_then(|c| c.as_whole()).unwrap_or_default()
    }
}

/// The rest of a [`streamed`] answer once the run is recorded: the end naming the
/// `ahead` outputs (binding, size, hash) sent from `changes` when the record
/// holds them, else the answer as it would have been, after the `sent` bytes.
async fn streamed_end(
    api: &ApiState,
    ran: Ran,
    changes: &Arc<gpumesh_protocol::ShardChanges>,
    ahead: Vec<(u32, u64, tokio::task::JoinHandle<BlobId>)>,
    sent: u64,
) -> ApiResult<Vec<Vec<u8>>> {
    let id = ran.view.id;
    if ran.view.status != TaskState::Completed {
        return encode_run_binary(
            RunReply {
                task: ran.view,
                outputs: Vec::new(),
            },
            Vec::new(),
            sent,
        )
        .map_err(unavailable);
    }
    let task = api
        .consensus
        .read_local(move |s| s.task(TaskId(id)).cloned())
        .ok_or_else(|| not_found(id))?;
    let ours = ran
        .here
        .as_ref()
        .is_some_and(|h| Arc::ptr_eq(&h.changes, changes) && holds(&task, h));
    let attach = task.outputs.is_empty() && task.spec.binding_bytes() <= RUN_ATTACHED_BYTES;
    let pieces = if ours && attach && !ahead.is_empty() {
        let mut outputs = Vec::with_capacity(ahead.len());
        for (binding, size, hashed) in ahead {
            let hash = hashed
                .await
                .map_err(|e| unavailable(format!("an output's hash: {e}")))?;
            outputs.push(RunOutput {
                binding,
                size,
                blake3: hash.to_hex(),
                hex: None,
                attached: true,
            });
        }
        let reply = RunReply {
            task: ran.view,
            outputs,
        };
        vec![encode_run_end(&RunEnd {
            skip: 0,
            reply: Some(reply),
            error: None,
        })
        .map_err(unavailable)?]
    } else {
        let outputs = outputs_of(api, id, ran.here, RUN_ATTACHED_BYTES).await?;
        let (outputs, bytes) = outputs.into_iter().unzip();
        encode_run_binary(
            RunReply {
                task: ran.view,
                outputs,
            },
            bytes,
            sent,
        )
        .map_err(unavailable)?
    };
    api.timeline.mark(TaskId(id), Stage::Served);
    Ok(pieces)
}

/// Task `id` once it has other than `done` shards done, or has finished, or
/// `deadline` passed: a long poll on this node's applied state.
async fn wait_change(
    api: &ApiState,
    id: u64,
    done: Option<usize>,
    deadline: tokio::time::Instant,
) -> ApiResult<TaskView> {
    let c = &api.consensus;
    // Watched before the first read so no change slips between the two.
    let watch = api.changes.watch(Topic::Task(TaskId(id)));
    loop {
        let view = match c.read_local(move |s| s.task(TaskId(id)).map(view)) {
            Some(v) => v,
            // Submitted through another node and not applied here yet: read at the
            // leader's commit index before calling it unknown.
            None => read_current(c, move |s: &StateMachine| s.task(TaskId(id)).map(view))
                .await?
                .ok_or_else(|| not_found(id))?,
        };
        let finished = view.status.is_finished();
        if finished {
            api.timeline.mark(TaskId(id), Stage::Completed);
        }
        if finished || Some(view.shards_done) != done {
            return Ok(view);
        }
        // Woken only by entries about this task: many clients may be waiting.
        match tokio::time::timeout_at(deadline, watch.changed()).await {
            Err(_) => return Ok(view),
            Ok(false) => return Err(unavailable("the node is shutting down")),
            Ok(true) => {}
        }
    }
}

/// A completed task's outputs as blobs on this node, binding → blob.
async fn merged(api: &ApiState, id: u64) -> ApiResult<BTreeMap<u32, BlobId>> {
    // A completed task's outputs never change: once known here (and still here: a
    // copy found damaged is dropped from the store), no read of the record.
    let c = &api.consensus;
    if let Some(done) = api.results.get(TaskId(id)) {
        let store = api.blobs.store();
        // Still in the record here: a task forgotten through another node is gone.
        let known = c.read_local(|s| s.task(TaskId(id)).is_some());
        if known && done.values().all(|b| store.has(b)) {
            return Ok(done);
        }
    }
    let task = read_current(c, move |s: &StateMachine| s.task(TaskId(id)).cloned())
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
    crate::outputs::task_outputs(&api.blobs, &api.peers, &api.kernels, &api.results, &task)
        .await
        .map_err(|e| unavailable(e.to_string()))
}

/// A completed task's outputs made in memory, none stored here: what a node whose
/// disk has no room for them serves (binding → bytes; `only` that binding when
/// given). Merged outputs are pulled from the member that keeps them; a task of
/// one shard has its result applied to its starting contents.
async fn in_memory(
    api: &ApiState,
    task: &gpumesh_consensus::Task,
    only: Option<u32>,
) -> ApiResult<BTreeMap<u32, Vec<u8>>> {
    let id = task.id.0;
    let wanted = |b: u32| only.is_none_or(|o| o == b);
    if task.outputs.is_empty() {
        let mut made = crate::outputs::merge_shards(&api.blobs, &api.peers, &api.kernels, task)
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        made.retain(|b, _| wanted(*b));
        return Ok(made);
    }
    let mut made = BTreeMap::new();
    for o in task.outputs.iter().filter(|o| wanted(o.binding)) {
        let bytes = api
            .blobs
            .pull(o.blob, api.peers.peer(o.node))
            .await
            .map_err(|e| unavailable(format!("output {} of task t{id}: {e}", o.binding)))?;
        made.insert(o.binding, bytes);
    }
    Ok(made)
}

/// Task `id` from the record as it is now (it completed: [`merged`] said so).
async fn completed(api: &ApiState, id: u64) -> ApiResult<gpumesh_consensus::Task> {
    read_current(&api.consensus, move |s: &StateMachine| {
        s.task(TaskId(id)).cloned()
    })
    .await?
    .ok_or_else(|| not_found(id))
}

/// Whether an answer says this node's disk has no room (507).
fn no_room(e: &ApiError) -> bool {
    e.0 == StatusCode::INSUFFICIENT_STORAGE
}

pub(crate) async fn outputs(
    State(api): State<Arc<ApiState>>,
    Path(id): Path<u64>,
) -> ApiResult<Json<Vec<OutputView>>> {
    let ids = match merged(&api, id).await {
        Ok(ids) => ids,
        Err(e) if no_room(&e) => {
            tracing::debug!(task = id, "no room here for the outputs: made in memory");
            let task = completed(&api, id).await?;
            // Merged: the record says what each is.
            let views = if task.outputs.is_empty() {
                in_memory(&api, &task, None)
                    .await?
                    .into_iter()
                    .map(|(binding, bytes)| OutputView {
                        binding,
                        size: bytes.len() as u64,
                        blake3: BlobId::of(&bytes).to_hex(),
                    })
                    .collect()
            } else {
                task.outputs
                    .iter()
                    .map(|o| OutputView {
                        binding: o.binding,
                        size: o.size,
                        blake3: o.blob.to_hex(),
                    })
                    .collect()
            };
            return Ok(Json(views));
        }
        Err(e) => return Err(e),
    };
    let store = api.blobs.store();
    ids.into_iter()
        .map(|(binding, blob)| match store.size(&blob) {
            Some(size) => Ok(OutputView {
                binding,
                size,
                blake3: blob.to_hex(),
            }),
            None => Err(unavailable(format!(
                "output {binding} of task t{id} ({blob}) is not on this node"
            ))),
        })
        .collect::<ApiResult<Vec<_>>>()
        .map(Json)
}

pub(crate) async fn output_bytes(
    State(api): State<Arc<ApiState>>,
    Path((id, binding)): Path<(u64, u32)>,
) -> ApiResult<Vec<u8>> {
    let ids = match merged(&api, id).await {
        Ok(ids) => ids,
        Err(e) if no_room(&e) => {
            let task = completed(&api, id).await?;
            let mut made = in_memory(&api, &task, Some(binding)).await?;
            let bytes = made.remove(&binding).ok_or_else(|| {
                ApiError(
                    StatusCode::NOT_FOUND,
                    format!("task t{id} has no output binding {binding}"),
                )
            })?;
            api.timeline.mark(TaskId(id), Stage::Served);
            return Ok(bytes);
        }
        Err(e) => return Err(e),
    };
    let blob = ids.get(&binding).ok_or_else(|| {
        ApiError(
            StatusCode::NOT_FOUND,
            format!(
                "task t{id} has no output binding {binding}; it has {:?}",
                ids.keys().collect::<Vec<_>>()
            ),
        )
    })?;
    let store = api.blobs.store();
    let bytes = match store.get(blob) {
        Ok(Some(bytes)) => bytes,
        // Damaged here (the store drops such a copy) or gone: made again from the
        // mesh's copies (pulled, or merged from the shards), once.
        first => {
            tracing::warn!(task = id, binding, blob = %blob, answer = ?first.err(), "an output is not readable here; making it again from the mesh");
            let ids = merged(&api, id).await?;
            let blob = ids.get(&binding).copied().unwrap_or(*blob);
            store
                .get(&blob)
                .map_err(unavailable)?
                .ok_or_else(|| unavailable("merged output vanished"))?
        }
    };
    api.timeline.mark(TaskId(id), Stage::Served);
    Ok(bytes)
}
