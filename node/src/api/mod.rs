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
//! | POST | /v1/tasks/run?timeout_ms=T | submit, wait for the task to finish, answer it with its outputs (bytes inline up to 64 KiB in all) |
//! | GET | /v1/tasks/{id} | one task with its shards |
//! | GET | /v1/tasks/{id}/wait?done=N&timeout_ms=T | long poll: answers once the task has a shard count other than N done, or has finished, or T ms passed |
//! | GET | /v1/tasks/{id}/outputs | merged outputs: binding, size, blake3 |
//! | GET | /v1/tasks/{id}/outputs/{binding} | one merged output's bytes |
//! | POST | /v1/actors | create a GPU actor (name, state buffers, backend) |
//! | GET | /v1/actors | every actor: host, epoch, version, bytes |
//! | GET, DELETE | /v1/actors/{name} | one actor; delete it (`?request_id=` for retries) |
//! | POST | /v1/actors/{name}/calls?timeout_ms=T | a call, answered once it ran and its state is durable |
//! | GET | /v1/actors/{name}/state/{binding} | a state buffer as of the last acknowledged call |
//! | GET | /v1/status | leader, term, members |
//! | POST | /v1/leave | this node leaves the mesh for good (its blobs kept by others), then stops |
//! | DELETE | /v1/members/{id} | remove a member gone for good (raft id in hex); refused if it runs |
//! | GET | /metrics | this node's Prometheus metrics, OpenMetrics text (see [`crate::metrics`]) |
//!
//! Any other path answers 404 and any other method on a known path 405, each with a
//! JSON `error` like every other refusal.

//!
//! - `state`: what the handlers share ([`ApiState`]): handles of the node's actors,
//!   and the API's own results cache and submit count.
//! - `gate`: the bearer token and body limits; `error`: refusals; `views`: answers.
//! - `tasks`, `blobs`, `status`, `dashboard`: the handlers; `throughput`: the
//!   dashboard's series of shard results per second.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::middleware;
use axum::routing::{get, post};
use axum::Router;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use gpumesh_consensus::{ConsensusHandle, StateMachine};

use crate::error::{NodeError, Result};

mod actors;
mod blobs;
mod changes;
mod dashboard;
mod error;
mod gate;
mod state;
mod status;
mod tasks;
mod throughput;
mod views;

pub use dashboard::{Overview, OVERVIEW_TASKS};
pub(crate) use state::ApiState;
pub use throughput::{ThroughputPoint, THROUGHPUT_SAMPLES};
pub use views::*;

use error::{unavailable, ApiError, ApiResult};
use gate::{BodyCaps, Gate};

/// Binds the API's address, before the node forms or joins a mesh: an address in
/// use is refused before anything is written for a mesh. Connections made before
/// [`serve`] wait for it.
pub(crate) async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        NodeError::Config(format!(
            "cannot serve the API on {addr}: {e}; pick another --api address"
        ))
    })
}

/// Serves the API on `listener` (see [`bind`]) until `cancel`; returns the bound
/// address. On a loopback address anyone on this machine may call it; on any other
/// every request but the dashboard's page must carry `Authorization: Bearer TOKEN`
/// (the node's `api.token`).
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    token: String,
    api: ApiState,
    cancel: CancellationToken,
) -> Result<(SocketAddr, JoinHandle<()>)> {
    let caps = BodyCaps::of(&api.limits);
    // The dashboard's throughput series follows the applied log while the API runs.
    let tracker = api
        .throughput
        .clone()
        .track(api.consensus.clone(), cancel.clone());
    let follower = api
        .changes
        .clone()
        .follow(api.consensus.clone(), cancel.clone());
    let bound = listener
        .local_addr()
        .map_err(|e| NodeError::Config(e.to_string()))?;
    let gate = Gate {
        token: (!bound.ip().is_loopback()).then(|| Arc::new(token)),
    };
    let app = Router::new()
        .route(
            "/v1/blobs",
            post(blobs::put_blob).layer(DefaultBodyLimit::max(caps.blob.max())),
        )
        .route("/v1/blobs/{id}", get(blobs::get_blob))
        .route("/v1/tasks", post(tasks::submit).get(tasks::list_tasks))
        .route("/v1/tasks/run", post(tasks::run))
        .route("/v1/tasks/{id}", get(tasks::get_task).delete(tasks::forget))
        .route("/v1/tasks/{id}/wait", get(tasks::wait_task))
        .route("/v1/tasks/{id}/cancel", post(tasks::cancel))
        .route("/v1/tasks/{id}/outputs", get(tasks::outputs))
        .route("/v1/tasks/{id}/outputs/{binding}", get(tasks::output_bytes))
        .route("/v1/actors", post(actors::create).get(actors::list))
        .route("/v1/actors/{name}", get(actors::one).delete(actors::delete))
        .route("/v1/actors/{name}/calls", post(actors::call))
        .route("/v1/actors/{name}/state/{binding}", get(actors::state))
        .route("/v1/status", get(status::status))
        .route("/v1/leave", post(status::leave))
        .route(
            "/v1/members/{id}",
            axum::routing::delete(status::remove_member),
        )
        .route("/", get(dashboard::page))
        .route("/v1/overview", get(dashboard::overview))
        .route("/metrics", get(status::metrics))
        .fallback(no_such_path)
        .method_not_allowed_fallback(no_such_method)
        // Every route but the blob upload above, which sets its own.
        .layer(DefaultBodyLimit::max(caps.request.max()))
        .layer(middleware::from_fn_with_state(caps, gate::announced_within))
        .layer(middleware::from_fn_with_state(gate, gate::bearer))
        .with_state(Arc::new(api));
    // Answers go out as soon as they are written, not held back by Nagle's
    // algorithm behind an unacknowledged segment.
    let listener = axum::serve::ListenerExt::tap_io(listener, |socket| {
        let _ = socket.set_nodelay(true);
    });
    let task = tokio::spawn(async move {
        let server = axum::serve(listener, app)
            .with_graceful_shutdown(async move { cancel.cancelled().await });
        let (served, (), ()) = tokio::join!(
            std::future::IntoFuture::into_future(server),
            tracker,
            follower
        );
        if let Err(e) = served {
            tracing::warn!(error = %e, "the API stopped serving");
        }
    });
    Ok((bound, task))
}

async fn no_such_path(uri: axum::http::Uri) -> ApiError {
    ApiError(
        StatusCode::NOT_FOUND,
        format!(
            "no such path {}; the API serves /v1/blobs, /v1/tasks, /v1/actors, /v1/status and /metrics",
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

/// A linearizable read (ReadIndex) when a leader confirms it within a second;
/// otherwise 503 saying why, so that the client retries (through this node or
/// another) rather than take this node's own copy, which may trail the mesh by
/// any number of entries when it is cut off from the majority. For what a caller
/// takes as the answer: an actor's state and where it stands.
pub(crate) async fn read_confirmed<R: Send + 'static>(
    c: &ConsensusHandle,
    what: &str,
    f: impl Fn(&StateMachine) -> R + Clone + Send + 'static,
) -> ApiResult<R> {
    let why = match tokio::time::timeout(std::time::Duration::from_secs(1), c.read_linearizable(f))
        .await
    {
        Ok(Ok(r)) => return Ok(r),
        Ok(Err(e)) => e.to_string(),
        Err(_) => "no leader confirmed a read within 1 s".to_string(),
    };
    Err(unavailable(format!(
        "this node cannot confirm that its copy of {what} is current ({why}): an election \
         is under way, or this node is cut off from most of the mesh. Retry, or ask another \
         node"
    )))
}

/// A linearizable read (ReadIndex) when the leader confirms it within a second;
/// otherwise this replica's own state, which may trail the leader by a few entries
/// (by any number while this node is cut off from the majority): for what stays
/// true once recorded (a finished task's outputs) and for listings, which
/// [`read_current_marked`] lets mark as this node's copy.
pub(crate) async fn read_current<R: Send + 'static>(
    c: &ConsensusHandle,
    f: impl Fn(&StateMachine) -> R + Clone + Send + 'static,
) -> ApiResult<R> {
    Ok(read_current_marked(c, f).await.0)
}

/// [`read_current`], and whether a leader confirmed the read: `false` where the
/// value is this node's own copy, which trails the mesh by any number of entries
/// when it is cut off from the majority.
pub(crate) async fn read_current_marked<R: Send + 'static>(
    c: &ConsensusHandle,
    f: impl Fn(&StateMachine) -> R + Clone + Send + 'static,
) -> (R, bool) {
    let g = f.clone();
    match tokio::time::timeout(std::time::Duration::from_secs(1), c.read_linearizable(f)).await {
        Ok(Ok(r)) => (r, true),
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "linearizable read failed; reading locally");
            (c.read_local(g), false)
        }
        Err(_) => {
            tracing::debug!("linearizable read slow; reading locally");
            (c.read_local(g), false)
        }
    }
}
