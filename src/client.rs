//! `gpumesh::Client`: a program's way to submit tasks to a mesh and fetch results,
//! through any node's local API (`--api`, or `GPUMESH_API`).

use std::collections::BTreeMap;

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpumesh_consensus::{RequestId, RequestIds};
use gpumesh_node::api::{
    decode_run_binary, from_hex, ActorView, AttachedBytes, BlobReply, CallReply, CallRequest,
    CreateActorRequest, ErrorBody, LeftView, OutputView, RunReply, StateInit, StatusView,
    SubmitReply, SubmitRequest, TaskState, TaskView, RUN_ATTACHED_BYTES, RUN_BINARY,
};
use gpumesh_protocol::{ActorCall, BlobId, TaskSpec};

/// Default API address of a node started without `--api`.
pub const DEFAULT_API: &str = "127.0.0.1:7070";

/// Errors a client sees, each saying what to try.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(
        "cannot reach the gpumesh API at {addr} ({reason}); is a node running there? \
         Start one with `gpumesh node --api {addr}`, or point at a running node with \
         --api HOST:PORT or GPUMESH_API=HOST:PORT"
    )]
    Unreachable { addr: String, reason: String },
    #[error("{0}")]
    Refused(String),
    /// The node answered 503: it cannot serve the request now (no Raft leader, an
    /// election under way, no member to keep a second copy). Retried by every call
    /// for [`Client::retry_for`] before it is returned.
    #[error("{reason} (still so after retrying for {waited:.1?})")]
    Unavailable {
        reason: String,
        waited: std::time::Duration,
    },
    #[error("unexpected answer from {addr}: {reason}")]
    Protocol { addr: String, reason: String },
    /// The node answered this client before and then stopped answering (killed,
    /// restarting), and was not back within [`Client::retry_for`]. A request it may
    /// have taken (a submit, a call) may have been done.
    #[error("{reason}, still after {waited:.1?}")]
    Lost {
        reason: String,
        waited: std::time::Duration,
    },
}

pub type ClientResult<T> = Result<T, ClientError>;

/// Whether the connection broke under a request that had reached the node: reset or
/// closed while the body was still being written.
fn cut_off(e: &reqwest::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            );
        }
        cause = c.source();
    }
    false
}

/// The innermost cause of a failed request ("Connection refused (os error 111)"),
/// which says more than reqwest's own "error sending request for url".
fn root_cause(e: &reqwest::Error) -> String {
    let mut cause: &(dyn std::error::Error + 'static) = e;
    while let Some(inner) = cause.source() {
        cause = inner;
    }
    cause.to_string()
}

/// How long calls retry through a leader change by default.
pub const DEFAULT_RETRY_FOR: Duration = Duration::from_secs(30);

/// Told what a call is waiting for while it retries.
type Notice = Arc<dyn Fn(&str) + Send + Sync>;

/// A client of a node's API, or of several nodes' (`"a:7070,b:7071"`), one at a time.
///
/// Every call retries while the node answers 503 (no Raft leader: an election is
/// under way; no member to keep a second copy of an input), or, once the node has
/// answered this client, while it does not answer at all (killed, restarting), for
/// up to [`Client::retry_for`], then returns [`ClientError::Unavailable`] (or
/// [`ClientError::Lost`]). A node never reached is [`ClientError::Unreachable`] at
/// once (a wrong address). Given several nodes, a call that one of them does not
/// answer, or answers 503, goes on at the next at once, so that losing any one node
/// costs a client nothing. A submit, a create and a call keep one request id through
/// their retries, whichever node each goes to, so the mesh does each once however
/// many attempts reach it.
#[derive(Clone)]
pub struct Client {
    /// The nodes' API addresses (`host:port`), in the order given.
    addrs: Arc<[String]>,
    /// Which of `addrs` the client goes to now.
    current: Arc<std::sync::atomic::AtomicUsize>,
    http: reqwest::Client,
    retry_for: Duration,
    notice: Option<Notice>,
    ids: Arc<RequestIds>,
    /// Whether the node has answered, or taken a request, since this client was
    /// made: from then on a node that does not answer is one that stopped (killed,
    /// restarting), waited for as a leader change is, not a wrong address.
    reached: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("addrs", &self.addrs)
            .field("retry_for", &self.retry_for)
            .finish_non_exhaustive()
    }
}

/// A client id no other process is likely to have: request ids are unique per
/// (client id, sequence).
fn random_client_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish() | 1
}

impl Client {
    /// A client of the node at `addr` (`host:port`), or of the nodes at each of a
    /// comma-separated list of them.
    pub fn new(addr: impl Into<String>) -> Self {
        let addr = addr.into();
        let mut addrs: Vec<String> = addr
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(str::to_string)
            .collect();
        if addrs.is_empty() {
            addrs.push(addr);
        }
        Client {
            addrs: addrs.into(),
            current: Arc::default(),
            http: reqwest::Client::new(),
            retry_for: DEFAULT_RETRY_FOR,
            notice: None,
            ids: Arc::new(RequestIds::new(random_client_id())),
            reached: Arc::default(),
        }
    }

    /// Sends `Authorization: Bearer TOKEN` with every request: what a node whose API
    /// is off loopback requires (its `api.token`).
    pub fn with_token(mut self, token: &str) -> ClientResult<Self> {
        let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {}", token.trim()))
            .map_err(|_| {
                ClientError::Refused("the API token holds characters a header cannot".into())
            })?;
        value.set_sensitive(true);
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(reqwest::header::AUTHORIZATION, value);
        self.http = reqwest::Client::builder()
            .default_headers(headers)
            .build()
            .map_err(|e| ClientError::Refused(format!("cannot build the HTTP client: {e}")))?;
        Ok(self)
    }

    /// How long each call retries while the node cannot serve it (default 30 s;
    /// zero: no retries).
    pub fn retry_for(mut self, limit: Duration) -> Self {
        self.retry_for = limit;
        self
    }

    /// Calls `notice` with a line saying what a call waits for each time that
    /// changes while it retries (for a terminal), and once more when the node
    /// answers again.
    pub fn on_wait(mut self, notice: impl Fn(&str) + Send + Sync + 'static) -> Self {
        self.notice = Some(Arc::new(notice));
        self
    }

    /// Runs `call` until it succeeds, fails for a reason a retry cannot fix, or
    /// [`Client::retry_for`] passes while the node answers 503.
    async fn retrying<T, F, Fut>(&self, mut call: F) -> ClientResult<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = ClientResult<T>>,
    {
        let start = Instant::now();
        let mut pause = Duration::from_millis(50);
        let mut said: Option<String> = None;
        // Nodes in a row that did not answer, or answered 503, in this round.
        let mut missed = 0;
        loop {
            let answer = call().await;
            if self.addrs.len() > 1
                && matches!(
                    answer,
                    Err(ClientError::Unreachable { .. } | ClientError::Unavailable { .. })
                )
            {
                // Another node given: the call goes on there at once, the same
                // request id with it. Once none answered, the round is waited out
                // as one node's would be.
                missed += 1;
                let from = self.addr().to_string();
                self.next_node();
                if missed < self.addrs.len() {
                    if let Some(notice) = &self.notice {
                        let why = match &answer {
                            Err(ClientError::Unreachable { reason, .. }) => {
                                format!("does not answer ({reason})")
                            }
                            Err(e) => e.to_string(),
                            Ok(_) => String::new(),
                        };
                        notice(&format!("{from} {why}; going on at {}", self.addr()));
                    }
                    continue;
                }
                missed = 0;
            }
            // A node that answered before and now does not stopped (killed,
            // restarting): waited for as a leader change is (a request id makes the
            // retry safe), and `Lost` if it is not back in time.
            let (answer, lost) = match answer {
                Err(ClientError::Unreachable { addr, reason }) if self.was_reached() => {
                    let reason = format!("the node at {addr} does not answer ({reason})");
                    (
                        Err(ClientError::Unavailable {
                            reason,
                            waited: Duration::ZERO,
                        }),
                        true,
                    )
                }
                // None of the nodes given was ever reached: say which were tried.
                Err(ClientError::Unreachable { reason, .. }) if self.addrs.len() > 1 => {
                    return Err(ClientError::Unreachable {
                        addr: self.addrs.join(", "),
                        reason,
                    })
                }
                other => (other, false),
            };
            match answer {
                Err(ClientError::Unavailable { reason, .. }) => {
                    let waited = start.elapsed();
                    if waited >= self.retry_for {
                        return Err(match lost {
                            true => ClientError::Lost { reason, waited },
                            false => ClientError::Unavailable { reason, waited },
                        });
                    }
                    if said.as_deref() != Some(reason.as_str()) {
                        if let Some(notice) = &self.notice {
                            notice(&format!(
                                "waiting for the mesh (up to {:.0?} in all): {reason}",
                                self.retry_for
                            ));
                        }
                        said = Some(reason);
                    }
                    let left = self.retry_for.saturating_sub(waited);
                    tokio::time::sleep(pause.min(left)).await;
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
                other => {
                    if let (Some(notice), Some(_)) = (&self.notice, &said) {
                        if other.is_ok() {
                            notice(&format!(
                                "the mesh answers again after {:.1?}",
                                start.elapsed()
                            ));
                        }
                    }
                    return other;
                }
            }
        }
    }

    /// A client of `GPUMESH_API`, or of the default address.
    pub fn from_env() -> Self {
        Self::new(std::env::var("GPUMESH_API").unwrap_or_else(|_| DEFAULT_API.to_string()))
    }

    /// The address of the node the client goes to now.
    pub fn addr(&self) -> &str {
        let at = self.current.load(std::sync::atomic::Ordering::Relaxed);
        &self.addrs[at % self.addrs.len()]
    }

    /// Goes on at the next node given (back to the first after the last).
    fn next_node(&self) {
        self.current
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr())
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> ClientResult<reqwest::Response> {
        let req = req.build().map_err(|e| ClientError::Protocol {
            addr: self.addr().to_string(),
            reason: format!("cannot make the request: {e}"),
        })?;
        let has_body = req.body().is_some();
        let sent = self.http.execute(req).await;
        if let Err(e) = &sent {
            if !e.is_connect() {
                // Connected: the request may have reached the node before it was
                // lost with the connection.
                self.reached
                    .store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        // A body cut off while being sent: refused for its size by a node that
        // still runs, or lost with a node that stopped.
        let refused_body = match &sent {
            Err(e) if has_body && cut_off(e) => self.answers().await,
            _ => false,
        };
        let resp = sent.map_err(|e| {
            if refused_body {
                // A node refusing a body over its limits answers 413 and hangs up;
                // a client still sending finds the connection gone before it reads
                // the answer.
                ClientError::Refused(format!(
                    "the node at {} closed the connection while the request was being \
                     sent: the body is probably over one of its limits (--max-blob-bytes \
                     for uploads, --max-request-bytes otherwise), or the node stopped",
                    self.addr()
                ))
            } else {
                ClientError::Unreachable {
                    addr: self.addr().to_string(),
                    reason: root_cause(&e),
                }
            }
        })?;
        self.reached
            .store(true, std::sync::atomic::Ordering::Relaxed);
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let body = resp.bytes().await.unwrap_or_default();
        Err(match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(e) => self.error_of(status, e.error),
            Err(_) => ClientError::Protocol {
                addr: self.addr().to_string(),
                reason: format!("HTTP {status}"),
            },
        })
    }

    fn was_reached(&self) -> bool {
        self.reached.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `DELETE path`, retried (the path carries its request id).
    async fn delete(&self, path: &str) -> ClientResult<()> {
        self.retrying(|| async {
            self.send(self.http.delete(self.url(path)))
                .await
                .map(|_| ())
        })
        .await
    }

    /// Whether the node's API accepts a connection within a second.
    async fn answers(&self) -> bool {
        let connect = tokio::net::TcpStream::connect(self.addr());
        matches!(
            tokio::time::timeout(Duration::from_secs(1), connect).await,
            Ok(Ok(_))
        )
    }

    /// The error an answer of HTTP `status` saying `error` is: one worth waiting
    /// out (503), or a refusal.
    fn error_of(&self, status: reqwest::StatusCode, error: String) -> ClientError {
        if status == reqwest::StatusCode::SERVICE_UNAVAILABLE {
            ClientError::Unavailable {
                reason: error,
                waited: Duration::ZERO,
            }
        } else {
            ClientError::Refused(error)
        }
    }

    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        req: reqwest::RequestBuilder,
    ) -> ClientResult<T> {
        self.send(req)
            .await?
            .json()
            .await
            .map_err(|e| ClientError::Protocol {
                addr: self.addr().to_string(),
                reason: e.to_string(),
            })
    }

    /// Stores `bytes` on the node as an input blob.
    pub async fn upload(&self, bytes: Vec<u8>) -> ClientResult<BlobId> {
        let reply: BlobReply = self
            .retrying(|| self.json(self.http.post(self.url("/v1/blobs")).body(bytes.clone())))
            .await?;
        reply.id.parse().map_err(|e| ClientError::Protocol {
            addr: self.addr().to_string(),
            reason: format!("{e}"),
        })
    }

    /// Submits a task whose inputs were uploaded; returns its id once committed.
    /// Without a `request_id` the client makes one; every retry sends the same, so
    /// the task is created once.
    pub async fn submit(&self, spec: TaskSpec, request_id: Option<RequestId>) -> ClientResult<u64> {
        let request = SubmitRequest {
            spec,
            request_id: Some(request_id.unwrap_or_else(|| self.ids.next_id())),
        };
        let reply: SubmitReply = self
            .retrying(|| self.json(self.http.post(self.url("/v1/tasks")).json(&request)))
            .await?;
        Ok(reply.task)
    }

    pub async fn task(&self, id: u64) -> ClientResult<TaskView> {
        self.retrying(|| self.json(self.http.get(self.url(&format!("/v1/tasks/{id}")))))
            .await
    }

    /// Cancels task `id` if it has not finished (`POST /v1/tasks/N/cancel`), with
    /// `reason` in its history; answers the task as the record has it then. A task
    /// that finished otherwise is refused ([`ClientError::Refused`]).
    pub async fn cancel(&self, id: u64, reason: Option<&str>) -> ClientResult<TaskView> {
        let path = format!("/v1/tasks/{id}/cancel");
        let body = serde_json::json!({ "reason": reason });
        self.retrying(|| self.json(self.http.post(self.url(&path)).json(&body)))
            .await
    }

    /// Forgets finished task `id` (`DELETE /v1/tasks/N`): it leaves the record and
    /// every node removes its results soon after. One request id through the
    /// retries: a forget recorded before its answer was lost answers as done.
    pub async fn forget(&self, id: u64) -> ClientResult<()> {
        let rid = self.ids.next_id();
        self.delete(&format!("/v1/tasks/{id}?request_id={rid}"))
            .await
    }

    pub async fn tasks(&self) -> ClientResult<Vec<TaskView>> {
        self.retrying(|| self.json(self.http.get(self.url("/v1/tasks"))))
            .await
    }

    /// Takes the node out of the mesh for good (`POST /v1/leave`): other members keep
    /// what it holds, it is removed, and it stops. Not retried: a leave whose answer
    /// was lost shows in `status` (the node is gone from it).
    pub async fn leave(&self) -> ClientResult<LeftView> {
        self.json(self.http.post(self.url("/v1/leave"))).await
    }

    /// Removes member `raft_id` (gone for good: its machine lost) from the mesh
    /// (`DELETE /v1/members/ID`); refused for the node asked and for a member that
    /// runs (`leave` on it instead).
    pub async fn remove_member(&self, raft_id: u64) -> ClientResult<()> {
        let url = self.url(&format!("/v1/members/{raft_id:x}"));
        self.send(self.http.delete(url)).await.map(|_| ())
    }

    /// The mesh as this node sees it; not retried (a status without a leader is
    /// still an answer).
    pub async fn status(&self) -> ClientResult<StatusView> {
        // Given several nodes, the first that answers.
        let mut tried = 0;
        loop {
            match self.json(self.http.get(self.url("/v1/status"))).await {
                Err(ClientError::Unreachable { addr, reason }) => {
                    tried += 1;
                    if tried >= self.addrs.len() {
                        let addr = match self.addrs.len() {
                            1 => addr,
                            _ => self.addrs.join(", "),
                        };
                        return Err(ClientError::Unreachable { addr, reason });
                    }
                    self.next_node();
                }
                other => return other,
            }
        }
    }

    /// Waits until the task finishes, calling `progress(done, total)` on each change.
    /// Each request is a long poll the node answers when the task's shard count
    /// changes, so waiting costs the node nothing between changes.
    pub async fn wait(
        &self,
        id: u64,
        mut progress: impl FnMut(usize, usize),
    ) -> ClientResult<TaskView> {
        let mut last = usize::MAX;
        loop {
            let path = format!("/v1/tasks/{id}/wait?done={last}&timeout_ms=30000");
            // A node that stops answering mid-wait (killed, restarting under a
            // supervisor) is waited for as a leader change is, for `retry_for`.
            let t: TaskView = self
                .retrying(|| self.json(self.http.get(self.url(&path))))
                .await?;
            if t.shards_done != last {
                last = t.shards_done;
                progress(t.shards_done, t.shards.len());
            }
            match t.status {
                TaskState::Completed => return Ok(t),
                TaskState::Failed | TaskState::Cancelled => {
                    return Err(ClientError::Refused(format!(
                        "task t{id} {}: {}",
                        t.status,
                        t.reason.unwrap_or_default()
                    )))
                }
                _ => {}
            }
        }
    }

    /// The merged outputs' bindings, sizes and hashes.
    pub async fn outputs(&self, id: u64) -> ClientResult<Vec<OutputView>> {
        self.retrying(|| self.json(self.http.get(self.url(&format!("/v1/tasks/{id}/outputs")))))
            .await
    }

    /// Creates GPU actor `name` with these state buffers (upload starting bytes
    /// first with [`Client::upload`]); `backend` pins it to one backend.
    pub async fn create_actor(
        &self,
        name: &str,
        state: Vec<StateInit>,
        backend: Option<String>,
    ) -> ClientResult<ActorView> {
        // One request id through the retries: a create that was recorded before its
        // answer was lost answers with the actor, not with "the name is taken".
        let request = CreateActorRequest {
            name: name.to_string(),
            state,
            backend,
            request_id: Some(self.ids.next_id()),
        };
        self.retrying(|| self.json(self.http.post(self.url("/v1/actors")).json(&request)))
            .await
    }

    pub async fn actors(&self) -> ClientResult<Vec<ActorView>> {
        self.retrying(|| self.json(self.http.get(self.url("/v1/actors"))))
            .await
    }

    pub async fn actor(&self, name: &str) -> ClientResult<ActorView> {
        self.retrying(|| self.json(self.http.get(self.url(&format!("/v1/actors/{name}")))))
            .await
    }

    /// Deletes actor `name`. One request id through the retries: a delete that was
    /// recorded before its answer was lost answers as done, not "no actor named".
    pub async fn delete_actor(&self, name: &str) -> ClientResult<()> {
        let id = self.ids.next_id();
        self.delete(&format!("/v1/actors/{name}?request_id={id}"))
            .await
    }

    /// Calls actor `name` and returns once the call ran and the new state is
    /// durable. Without a `request_id` the client makes one; every retry (through a
    /// leader change, or a host that is moving) sends the same, so the call runs once.
    pub async fn call_actor(
        &self,
        name: &str,
        call: ActorCall,
        request_id: Option<RequestId>,
    ) -> ClientResult<CallReply> {
        let request = CallRequest {
            call,
            request_id: Some(request_id.unwrap_or_else(|| self.ids.next_id())),
        };
        let path = format!("/v1/actors/{name}/calls");
        self.retrying(|| self.json(self.http.post(self.url(&path)).json(&request)))
            .await
    }

    /// A state buffer of actor `name` as of its last acknowledged call.
    pub async fn actor_state(&self, name: &str, binding: u32) -> ClientResult<Vec<u8>> {
        let path = format!("/v1/actors/{name}/state/{binding}");
        self.retrying(|| async {
            let resp = self.send(self.http.get(self.url(&path))).await?;
            resp.bytes()
                .await
                .map(|b| b.to_vec())
                .map_err(|e| ClientError::Protocol {
                    addr: self.addr().to_string(),
                    reason: e.to_string(),
                })
        })
        .await
    }

    /// The bytes of a blob the node holds or can pull from the mesh (for example a
    /// merged output named by [`Client::outputs`]).
    pub async fn outputs_of_blob(&self, id: BlobId) -> ClientResult<Vec<u8>> {
        self.checked_bytes(&format!("/v1/blobs/{id}"), id, &format!("blob {id}"))
            .await
    }

    /// GETs `path` and checks the body against `id`, so a wrong byte is an error.
    async fn checked_bytes(&self, path: &str, id: BlobId, what: &str) -> ClientResult<Vec<u8>> {
        let bytes = self
            .retrying(|| self.send(self.http.get(self.url(path))))
            .await?
            .bytes()
            .await
            .map_err(|e| ClientError::Protocol {
                addr: self.addr().to_string(),
                reason: e.to_string(),
            })?;
        if !id.matches(&bytes) {
            return Err(ClientError::Protocol {
                addr: self.addr().to_string(),
                reason: format!("{what} does not match its hash"),
            });
        }
        Ok(bytes.to_vec())
    }

    /// Submits a task and waits for its outputs in one request (`POST
    /// /v1/tasks/run`): the task's id and every output's bytes, checked against the
    /// hash the node reports (small outputs come in the answer, larger ones are
    /// fetched). A failed or cancelled task is [`ClientError::Refused`]. The request
    /// id makes a retry after a lost answer wait for the same task.
    pub async fn run(&self, spec: TaskSpec) -> ClientResult<(u64, BTreeMap<u32, Vec<u8>>)> {
        self.run_with_id(spec, self.ids.next_id()).await
    }

    /// [`Client::run`] under a request id of the caller's choosing: a run retried
    /// with the same id, through any node, makes one task.
    pub async fn run_with_id(
        &self,
        spec: TaskSpec,
        request_id: RequestId,
    ) -> ClientResult<(u64, BTreeMap<u32, Vec<u8>>)> {
        let expected = usize::try_from(spec.writable_bytes()).unwrap_or(usize::MAX);
        let request = SubmitRequest {
            spec,
            request_id: Some(request_id),
        };
        let (reply, attached) = self
            .retrying(|| async {
                let asked = self
                    .http
                    .post(self.url("/v1/tasks/run"))
                    .header(reqwest::header::ACCEPT, RUN_BINARY)
                    .json(&request);
                self.run_reply(self.send(asked).await?, expected).await
            })
            .await?;
        let t = reply.task;
        match t.status {
            TaskState::Completed => {}
            TaskState::Failed | TaskState::Cancelled => {
                return Err(ClientError::Refused(format!(
                    "task t{} {}: {}",
                    t.id,
                    t.status,
                    t.reason.unwrap_or_default()
                )))
            }
            // Still running when the node's wait ran out: wait on.
            _ => {
                self.wait(t.id, |_, _| {}).await?;
                return Ok((t.id, self.results(t.id).await?));
            }
        }
        let protocol = |reason: String| ClientError::Protocol {
            addr: self.addr().to_string(),
            reason,
        };
        let mut out = BTreeMap::new();
        for (o, attached) in reply.outputs.into_iter().zip(attached) {
            let hash: BlobId = o.blake3.parse().map_err(|e| protocol(format!("{e}")))?;
            let inline = match (attached, o.hex) {
                (Some(bytes), _) => Some(bytes),
                (None, Some(hex)) => Some(from_hex(&hex).map_err(protocol)?),
                (None, None) => None,
            };
            let bytes = match inline {
                Some(bytes) => {
                    if !hash.matches(&bytes) {
                        return Err(protocol(format!(
                            "output {} does not match its hash",
                            o.binding
                        )));
                    }
                    bytes
                }
                None => {
                    let path = format!("/v1/tasks/{}/outputs/{}", t.id, o.binding);
                    self.checked_bytes(&path, hash, &format!("output {}", o.binding))
                        .await?
                }
            };
            out.insert(o.binding, bytes);
        }
        Ok((t.id, out))
    }

    /// The answer of `POST /v1/tasks/run`, in binary (see [`RUN_BINARY`]) or, from
    /// a node that answers only in JSON, as JSON: the reply, and each output's bytes
    /// where they came attached. The body is read into one buffer of room for
    /// `expected` bytes (the outputs the task declares) and the first output keeps
    /// it: no copy of the bytes past the one out of the connection.
    async fn run_reply(
        &self,
        mut resp: reqwest::Response,
        expected: usize,
    ) -> ClientResult<(RunReply, AttachedBytes)> {
        let protocol = |reason: String| ClientError::Protocol {
            addr: self.addr().to_string(),
            reason,
        };
        let binary = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .is_some_and(|t| t.as_bytes() == RUN_BINARY.as_bytes());
        let room = resp
            .content_length()
            .map_or(expected.saturating_add(64 << 10), |n| n as usize);
        let mut body = Vec::with_capacity(room.min(RUN_ATTACHED_BYTES as usize + (1 << 20)));
        while let Some(chunk) = resp.chunk().await.map_err(|e| protocol(e.to_string()))? {
            body.extend_from_slice(&chunk);
        }
        if !binary {
            let reply: RunReply =
                serde_json::from_slice(&body).map_err(|e| protocol(e.to_string()))?;
            let none = vec![None; reply.outputs.len()];
            return Ok((reply, none));
        }
        match decode_run_binary(body).map_err(protocol)? {
            Ok(answer) => Ok(answer),
            // An answer whose body had begun before the error came.
            Err(e) => match reqwest::StatusCode::from_u16(e.status) {
                Ok(status) => Err(self.error_of(status, e.error)),
                Err(_) => Err(protocol(format!(
                    "an answer ended with status {}",
                    e.status
                ))),
            },
        }
    }

    /// Every merged output's bytes, checked against the hash the node reports.
    pub async fn results(&self, id: u64) -> ClientResult<BTreeMap<u32, Vec<u8>>> {
        let mut out = BTreeMap::new();
        for o in self.outputs(id).await? {
            let hash: BlobId = o.blake3.parse().map_err(|e| ClientError::Protocol {
                addr: self.addr().to_string(),
                reason: format!("{e}"),
            })?;
            let path = format!("/v1/tasks/{id}/outputs/{}", o.binding);
            let bytes = self
                .checked_bytes(&path, hash, &format!("output {}", o.binding))
                .await?;
            out.insert(o.binding, bytes);
        }
        Ok(out)
    }
}
