//! GPU actors: create, list, one, delete, call (answered once the call's result and
//! the new state are durable), and a state buffer's bytes as of the last
//! acknowledged call.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use gpumesh_consensus::{Actor, CallResult, Command, MergedOutput, Outcome, RequestId};
use serde::Deserialize;

use super::changes::Topic;
use super::error::{bad, unavailable, ApiError, ApiResult};
use super::gate::BodyCaps;
use super::state::ApiState;
use super::views::{ActorView, CallReply, CallRequest, CreateActorRequest, OutputView};
use super::{read_confirmed, read_current};
use crate::host::CallAnswer;
use crate::timeline::CallStage;

fn no_actor(name: &str) -> ApiError {
    ApiError(
        StatusCode::NOT_FOUND,
        format!("no actor named {name}; `gpumesh actor list` lists the actors there are"),
    )
}

fn refused(why: String) -> ApiError {
    if why.contains("exists") {
        ApiError(StatusCode::CONFLICT, why)
    } else {
        bad(why)
    }
}

pub(crate) fn actor_view(a: &Actor, peer_of: impl Fn(u64) -> Option<String>) -> ActorView {
    ActorView {
        name: a.name.clone(),
        node: a.host.and_then(&peer_of).unwrap_or_default(),
        host: a.host.map(super::views::hex).unwrap_or_default(),
        epoch: a.epoch,
        version: a.version,
        bytes: a.state.iter().map(|s| s.buffer.size).sum(),
        state: a.state.iter().map(|s| s.buffer).collect(),
        backend: a.backend.map(|b| b.name().to_string()),
        moves: a.moves,
        pending: a.pending.len(),
        backup: a.backup.map(super::views::hex),
    }
}

pub(crate) fn peer_names(
    api: &ApiState,
) -> impl Fn(u64) -> Option<String> + Clone + Send + 'static {
    let view = api.peers.view();
    move |raft_id| view.peer(raft_id).map(|p| p.to_string())
}

pub(crate) async fn create(
    State(api): State<Arc<ApiState>>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> ApiResult<Json<ActorView>> {
    let body = BodyCaps::of(&api.limits).request.within(body)?;
    let req: CreateActorRequest =
        serde_json::from_slice(&body).map_err(|e| bad(format!("malformed actor: {e}")))?;
    let mut state = Vec::with_capacity(req.state.len());
    for s in &req.state {
        if s.size > api.limits.max_blob_bytes {
            return Err(super::error::too_large(format!(
                "state binding {} is {} bytes, over the limit of {} (the node's \
                 --max-blob-bytes)",
                s.binding, s.size, api.limits.max_blob_bytes
            )));
        }
        if let Some(blob) = s.blob {
            match api.blobs.store().size(&blob) {
                // Used now, so not swept while the actor is created.
                Some(size) if size == s.size => {
                    api.blobs.store().mark_used(&blob);
                }
                Some(size) => {
                    return Err(bad(format!(
                        "state binding {}: blob {blob} holds {size} bytes, the actor says {}",
                        s.binding, s.size
                    )))
                }
                None => {
                    return Err(bad(format!(
                        "state binding {}: blob {blob} is not on this node; upload it first \
                         (POST /v1/blobs)",
                        s.binding
                    )))
                }
            }
            // A second copy first: losing this node must not lose the starting state.
            api.blobs
                .replicate(blob, None)
                .await
                .map_err(|e| unavailable(format!("state binding {}: {e}", s.binding)))?;
        }
        state.push(gpumesh_consensus::ActorState {
            buffer: gpumesh_protocol::StateBuffer {
                binding: s.binding,
                size: s.size,
            },
            blob: s.blob,
        });
    }
    let backend = match req.backend.as_deref() {
        None => None,
        Some(name) => match name
            .parse::<gpumesh_shaders::BackendChoice>()
            .map_err(bad)?
        {
            gpumesh_shaders::BackendChoice::Auto => None,
            gpumesh_shaders::BackendChoice::Only(kind) => Some(kind),
        },
    };
    let request_id = req
        .request_id
        .unwrap_or_else(|| api.consensus.new_request_id());
    let committed = api
        .consensus
        .propose_with_id(
            request_id,
            Command::CreateActor {
                name: req.name.clone(),
                state,
                backend,
                creator: api.peer_name.clone(),
            },
        )
        .await
        .map_err(unavailable)?;
    match committed.outcome {
        Outcome::Applied => {}
        Outcome::Rejected(why) | Outcome::Ignored(why) => return Err(refused(why)),
        other => return Err(unavailable(format!("unexpected outcome {other:?}"))),
    }
    // The actor this request made is the one created at its entry's index: a retry
    // may come after it was deleted, or after another took its name.
    let names = peer_names(&api);
    let (name, index) = (req.name.clone(), committed.index);
    let found = api.consensus.read_local(move |s| {
        s.actor(&name)
            .map(|a| (a.created == index).then(|| actor_view(a, names)))
    });
    match found {
        Some(Some(view)) => Ok(Json(view)),
        Some(None) => Err(ApiError(
            StatusCode::CONFLICT,
            format!(
                "actor {} made by this request was deleted since, and another actor now \
                 has the name",
                req.name
            ),
        )),
        None => Err(ApiError(
            StatusCode::GONE,
            format!(
                "actor {} was made by this request and has been deleted since",
                req.name
            ),
        )),
    }
}

/// Every actor, as of the leader's commit index when it confirms it within a second.
pub(crate) async fn list(State(api): State<Arc<ApiState>>) -> ApiResult<Json<Vec<ActorView>>> {
    let names = peer_names(&api);
    read_confirmed(&api.consensus, "the actors", move |s| {
        s.actors().map(|a| actor_view(a, &names)).collect()
    })
    .await
    .map(Json)
}

/// Every actor in this node's copy of the record.
pub(crate) fn all(api: &ApiState) -> Vec<ActorView> {
    let names = peer_names(api);
    api.consensus
        .read_local(move |s| s.actors().map(|a| actor_view(a, &names)).collect())
}

pub(crate) async fn one(
    State(api): State<Arc<ApiState>>,
    Path(name): Path<String>,
) -> ApiResult<Json<ActorView>> {
    let names = peer_names(&api);
    let n = name.clone();
    read_confirmed(&api.consensus, &format!("actor {name}"), move |s| {
        s.actor(&n).map(|a| actor_view(a, names.clone()))
    })
    .await?
    .map(Json)
    .ok_or_else(|| no_actor(&name))
}

#[derive(Deserialize)]
pub(crate) struct DeleteQuery {
    /// `CLIENT-SEQ` in hex: a retry with the same id (its answer lost, or the
    /// delete committed after this node said it could not tell) is answered as the
    /// first was, not with "no actor named", and deletes nothing made since.
    request_id: Option<String>,
}

pub(crate) async fn delete(
    State(api): State<Arc<ApiState>>,
    Path(name): Path<String>,
    Query(q): Query<DeleteQuery>,
) -> ApiResult<StatusCode> {
    let request_id = match q.request_id {
        Some(id) => id.parse::<RequestId>().map_err(bad)?,
        None => api.consensus.new_request_id(),
    };
    let committed = api
        .consensus
        .propose_with_id(request_id, Command::DeleteActor { name: name.clone() })
        .await
        .map_err(unavailable)?;
    match committed.outcome {
        Outcome::Applied => Ok(StatusCode::NO_CONTENT),
        _ => Err(no_actor(&name)),
    }
}

#[derive(Deserialize)]
pub(crate) struct CallQuery {
    timeout_ms: Option<u64>,
}

/// Sends the call to the actor's host, or queues it in the record when the host
/// does not record it (once per request id either way), and answers when its result
/// is recorded: the new state is then in the log and on two nodes (or, when small,
/// in the log entry itself).
pub(crate) async fn call(
    State(api): State<Arc<ApiState>>,
    Path(name): Path<String>,
    Query(q): Query<CallQuery>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> ApiResult<Json<CallReply>> {
    let received = std::time::Instant::now();
    let body = BodyCaps::of(&api.limits).request.within(body)?;
    let req: CallRequest =
        serde_json::from_slice(&body).map_err(|e| bad(format!("malformed call: {e}")))?;
    let kernel = api
        .kernels
        .get(&req.call.shader, &req.call.entry_point)
        .map_err(bad)?;
    // An actor's layout never changes, so this node's copy of the record serves
    // when it has the actor; one just created through another node may not be here
    // yet, so otherwise the read is at the leader's commit index. (A host read here
    // that has moved on answers NotRun, and the call goes through the queue.)
    let (layout, host) = {
        let n = name.clone();
        let find =
            move |s: &gpumesh_consensus::StateMachine| s.actor(&n).map(|a| (a.layout(), a.host));
        match api.consensus.read_local(find.clone()) {
            Some(found) => found,
            None => read_current(&api.consensus, find)
                .await?
                .ok_or_else(|| no_actor(&name))?,
        }
    };
    // The same checks the record and the host make, before anything is committed.
    req.call.check_shape(&layout).map_err(bad)?;
    let pairs: Vec<_> = layout.iter().map(|s| (*s, None)).collect();
    kernel
        .check(&req.call.as_task(&pairs))
        .map_err(|e| bad(format!("the call does not fit the kernel: {e}")))?;
    for b in &req.call.bindings {
        if let Some(blob) = b.role.blob() {
            if !api.blobs.store().has(&blob) {
                return Err(bad(format!(
                    "binding {}: input blob {blob} is not on this node; upload it first \
                     (POST /v1/blobs)",
                    b.binding
                )));
            }
            api.blobs
                .replicate(blob, None)
                .await
                .map_err(|e| unavailable(format!("input of binding {}: {e}", b.binding)))?;
        }
    }
    // Watched before the call is sent so no change slips past.
    let watch = api.changes.watch(Topic::Actor(name.clone()));
    let request_id = req
        .request_id
        .unwrap_or_else(|| api.consensus.new_request_id());
    // Straight to the host, which records the call with its result in one entry;
    // a retry of a request the record knows waits for it there instead.
    let known = api
        .consensus
        .read_local(move |s| s.prior(&request_id).is_some());
    if let (Some(host), Some(sender), false) = (host, &api.calls, known) {
        api.timeline
            .mark_call_at(request_id, CallStage::Received, received);
        let answer = sender.send(host, &name, req.call.clone(), request_id).await;
        api.timeline.mark_call(request_id, CallStage::Answered);
        match answer {
            CallAnswer::Done {
                seq,
                version,
                outputs,
            } => return Ok(Json(call_reply(seq, version, &outputs))),
            CallAnswer::Failed { seq, reason } => return Err(call_failed(&name, seq, &reason)),
            CallAnswer::NotRun(why) => {
                tracing::debug!(actor = %name, %request_id, %why, "call not run by the host; queued in the record");
            }
        }
    }
    let committed = api
        .consensus
        .propose_with_id(
            request_id,
            Command::CallActor {
                name: name.clone(),
                call: req.call,
                caller: api.peer_name.clone(),
            },
        )
        .await
        .map_err(unavailable)?;
    let seq = match committed.outcome {
        Outcome::CallQueued { seq } => seq,
        // Deleted since this node's copy of the record was read.
        Outcome::Rejected(why) if why.starts_with("no actor named") => return Err(no_actor(&name)),
        Outcome::Rejected(why) if why.contains("calls waiting to run") => {
            return Err(ApiError(StatusCode::TOO_MANY_REQUESTS, why))
        }
        Outcome::Rejected(why) | Outcome::Ignored(why) => return Err(bad(why)),
        other => return Err(unavailable(format!("unexpected outcome {other:?}"))),
    };
    let timeout = Duration::from_millis(q.timeout_ms.unwrap_or(60_000).min(600_000));
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let n = name.clone();
        let found = api
            .consensus
            .read_local(move |s| s.actor(&n).map(|a| a.results.get(&seq).cloned()));
        match found {
            None => {
                return Err(ApiError(
                    StatusCode::GONE,
                    format!("actor {name} was deleted before call {seq} ran"),
                ))
            }
            Some(Some(CallResult::Done {
                version, outputs, ..
            })) => return Ok(Json(call_reply(seq, version, &outputs))),
            Some(Some(CallResult::Failed { reason, .. })) => {
                return Err(call_failed(&name, seq, &reason))
            }
            Some(None) => {}
        }
        match tokio::time::timeout_at(deadline, watch.changed()).await {
            Err(_) => {
                return Err(unavailable(format!(
                    "call {seq} to actor {name} has not run within {timeout:?} (is its host \
                     moving?); ask again with the same request id to wait for it"
                )))
            }
            Ok(false) => return Err(unavailable("the node is shutting down")),
            Ok(true) => {}
        }
    }
}

fn call_reply(seq: u64, version: u64, outputs: &[MergedOutput]) -> CallReply {
    CallReply {
        seq,
        version,
        outputs: outputs
            .iter()
            .map(|o| OutputView {
                binding: o.binding,
                size: o.size,
                blake3: o.blob.to_hex(),
            })
            .collect(),
    }
}

fn call_failed(name: &str, seq: u64, reason: &str) -> ApiError {
    ApiError(
        StatusCode::UNPROCESSABLE_ENTITY,
        format!("call {seq} to actor {name} failed, and the state is as it was: {reason}"),
    )
}

/// A state buffer's bytes as of the last acknowledged call, whichever node it was
/// acknowledged through (read at the leader's commit index when it confirms it).
pub(crate) async fn state(
    State(api): State<Arc<ApiState>>,
    Path((name, binding)): Path<(String, u32)>,
) -> ApiResult<Vec<u8>> {
    let n = name.clone();
    let found = read_confirmed(&api.consensus, &format!("actor {name}'s state"), move |s| {
        s.actor(&n).map(|a| {
            (
                a.state
                    .iter()
                    .find(|st| st.buffer.binding == binding)
                    .copied(),
                a.backup,
                a.inline_state(binding).map(<[u8]>::to_vec),
            )
        })
    })
    .await?
    .ok_or_else(|| no_actor(&name))?;
    if let (_, _, Some(bytes)) = found {
        return Ok(bytes); // the record holds this state itself
    }
    let (Some(st), backup, _) = found else {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("actor {name} has no state at binding {binding}"),
        ));
    };
    let Some(blob) = st.blob else {
        return Ok(vec![0; st.buffer.size as usize]);
    };
    let holder = backup.and_then(|b| api.peers.peer(b));
    api.blobs
        .pull(blob, holder)
        .await
        .map_err(|e| unavailable(e.to_string()))
}
