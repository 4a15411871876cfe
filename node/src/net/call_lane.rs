//! The call lane: node requests and their answers on one long-lived libp2p stream
//! per peer and direction, each tagged with an id.
//!
//! A node request (a call sent to an actor's host, a blob copy asked of a peer,
//! a join) waits on its answer, so its round trip is on someone's critical path.
//! Through request-response each costs a new Yamux stream and a protocol
//! negotiation, and goes through the swarm's loop on both sides, twice; here a
//! request is one write on a stream that is already open, read by a task of its own
//! on the other side, and its answer one write back on the same stream.
//!
//! Outbound, a task per peer opens the stream (dialling if needed), writes the
//! requests queued for it (those that arrived during a write go in the next one)
//! and hands each answer to its waiting caller by id. When the stream fails, every
//! request waiting on it fails with the reason, and the next request opens another.
//! Inbound, a task per stream hands each request to the node as a
//! [`NetEvent::Request`] and writes the answer back when the node gives it (in any
//! order), or an error when the node drops it or takes too long. A frame over the
//! limit closes that stream and is logged; the node carries on.
//!
//! The serving side writes one byte first (`READY`) so the opener knows the
//! stream was taken: libp2p drops an inbound stream its acceptor's queue has no
//! room for, and a request written into it would be lost. Then each frame is a
//! little-endian u32 length, then the id (u64), a kind byte and the
//! body: a request's encoded `NodeRequest`, an answer's encoded `NodeReply`, or an
//! error's text. Bytes count in the `call` lane of the node's metrics.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures::io::{ReadHalf, WriteHalf};
use futures::{AsyncReadExt, AsyncWriteExt};
use gpumesh_protocol::{MeshRequest, MeshResponse};
use libp2p::{PeerId, Stream, StreamProtocol};
use libp2p_stream::{Control, IncomingStreams};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::{NetEvent, RequestSink};
use crate::error::{NodeError, Result};
use crate::metrics::{Lane, NetMetrics};

pub const CALL_PROTOCOL: StreamProtocol = StreamProtocol::new("/gpumesh/call/1");

/// Requests queued for one peer before `request` waits for room.
const QUEUE: usize = 256;
/// Frames are gathered into one write up to about this many bytes.
const BATCH_BYTES: usize = 1 << 20;
/// How long opening a stream (and dialling) may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(5);
/// The id, kind and length prefix around a frame's body.
const HEADER: usize = 4 + 8 + 1;

const KIND_REQUEST: u8 = 0;
const KIND_ANSWER: u8 = 1;
const KIND_ERROR: u8 = 2;

/// Callers waiting for answers on one outbound stream, by request id.
type Waiting = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<MeshResponse>>>>>;

/// The sending side, shared by every [`super::NetHandle`] clone.
pub(super) struct CallLane {
    control: Control,
    /// Answers requests once the node sets it (see `NetHandle::set_request_sink`).
    sink: Arc<OnceLock<RequestSink>>,
    peers: Mutex<HashMap<PeerId, Outbound>>,
    next_id: AtomicU64,
    max_frame: usize,
    metrics: NetMetrics,
    cancel: CancellationToken,
}

/// A frame to write: id, kind, body.
type Frame = (u64, u8, Vec<u8>);

/// One peer's outbound stream: the requests to write and the callers waiting.
#[derive(Clone)]
struct Outbound {
    requests: mpsc::Sender<Frame>,
    waiting: Waiting,
}

/// Removes a caller's entry when it stops waiting (answered, timed out, dropped).
struct Unwait<'a> {
    waiting: &'a Waiting,
    id: u64,
}

impl Drop for Unwait<'_> {
    fn drop(&mut self) {
        if let Ok(mut w) = self.waiting.lock() {
            w.remove(&self.id);
        }
    }
}

impl CallLane {
    /// Starts accepting inbound call streams (each request becomes a
    /// [`NetEvent::Request`] on `events`, answered within `answer_timeout`) and
    /// returns the sending side.
    pub(super) fn start(
        mut control: Control,
        events: mpsc::Sender<NetEvent>,
        max_frame: usize,
        answer_timeout: Duration,
        metrics: NetMetrics,
        cancel: CancellationToken,
    ) -> Result<Arc<CallLane>> {
        let incoming = control
            .accept(CALL_PROTOCOL)
            .map_err(|e| NodeError::NetSetup(format!("call protocol: {e}")))?;
        let sink = Arc::new(OnceLock::new());
        tokio::spawn(accept(
            incoming,
            events,
            Inbound {
                max_frame,
                answer_timeout,
                metrics: metrics.clone(),
                sink: sink.clone(),
                cancel: cancel.clone(),
            },
        ));
        Ok(Arc::new(CallLane {
            control,
            sink,
            peers: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            max_frame,
            metrics,
            cancel,
        }))
    }

    /// Sends the node request `body` to `to` and waits for its answer (the caller
    /// bounds the wait).
    pub(super) async fn request(&self, to: PeerId, body: Vec<u8>) -> Result<MeshResponse> {
        if HEADER + body.len() > self.max_frame {
            return Err(NodeError::Limit {
                what: "node request in bytes",
                value: body.len() as u64,
                limit: (self.max_frame - HEADER) as u64,
                setting: "NetConfig::max_frame_bytes",
            });
        }
        if self.cancel.is_cancelled() {
            return Err(NodeError::NetStopped);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, answer) = oneshot::channel();
        let out = self.outbound(to)?;
        out.waiting
            .lock()
            .map_err(|_| NodeError::NetStopped)?
            .insert(id, reply);
        let _unwait = Unwait {
            waiting: &out.waiting,
            id,
        };
        // A stream that failed since `outbound` looked refuses the send; the
        // caller's error names the peer, and its next request opens a new stream.
        out.requests
            .send((id, KIND_REQUEST, body))
            .await
            .map_err(|_| NodeError::Request {
                peer: to.to_string(),
                reason: "the call stream closed".into(),
            })?;
        answer.await.unwrap_or(Err(NodeError::NetStopped))
    }

    pub(super) fn set_sink(&self, sink: RequestSink) {
        let _ = self.sink.set(sink);
    }

    /// The peer's outbound stream, started if it has none that is still open.
    fn outbound(&self, to: PeerId) -> Result<Outbound> {
        let mut peers = self.peers.lock().map_err(|_| NodeError::NetStopped)?;
        if let Some(out) = peers.get(&to).filter(|o| !o.requests.is_closed()) {
            return Ok(out.clone());
        }
        let (tx, rx) = mpsc::channel(QUEUE);
        let out = Outbound {
            requests: tx,
            waiting: Waiting::default(),
        };
        tokio::spawn(call(
            self.control.clone(),
            to,
            rx,
            out.waiting.clone(),
            self.max_frame,
            self.metrics.clone(),
            self.cancel.clone(),
        ));
        peers.insert(to, out.clone());
        Ok(out)
    }
}

/// Appends one frame to `out`.
fn put_frame(out: &mut Vec<u8>, id: u64, kind: u8, body: &[u8]) {
    out.extend_from_slice(&((8 + 1 + body.len()) as u32).to_le_bytes());
    out.extend_from_slice(&id.to_le_bytes());
    out.push(kind);
    out.extend_from_slice(body);
}

/// Reads one frame: its id, kind and body. `Ok(None)` when the stream ended
/// between frames.
async fn read_frame(
    stream: &mut ReadHalf<Stream>,
    max_frame: usize,
) -> std::io::Result<Option<(u64, u8, Vec<u8>)>> {
    let mut len = [0u8; 4];
    match stream.read_exact(&mut len).await {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len) as usize;
    if !(9..=max_frame).contains(&len) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes (at least 9, at most {max_frame})"),
        ));
    }
    let mut frame = vec![0u8; len];
    stream.read_exact(&mut frame).await?;
    let id = u64::from_le_bytes(frame[..8].try_into().unwrap_or_default());
    let kind = frame[8];
    frame.drain(..9);
    Ok(Some((id, kind, frame)))
}

/// Writes `first` and whatever else is queued on `frames` in one write.
async fn write_batch(
    stream: &mut WriteHalf<Stream>,
    first: Frame,
    frames: &mut mpsc::Receiver<Frame>,
    metrics: &NetMetrics,
) -> std::io::Result<()> {
    let mut batch = Vec::with_capacity(HEADER + first.2.len());
    put_frame(&mut batch, first.0, first.1, &first.2);
    while batch.len() < BATCH_BYTES {
        match frames.try_recv() {
            Ok((id, kind, body)) => put_frame(&mut batch, id, kind, &body),
            Err(_) => break,
        }
    }
    stream.write_all(&batch).await?;
    stream.flush().await?;
    metrics.sent(Lane::Call, batch.len());
    Ok(())
}

/// Owns the outbound stream to `peer`: writes the queued requests and hands each
/// answer to its caller. Ends when the stream fails; the callers still waiting
/// then fail with the reason.
async fn call(
    mut control: Control,
    peer: PeerId,
    mut requests: mpsc::Receiver<Frame>,
    waiting: Waiting,
    max_frame: usize,
    metrics: NetMetrics,
    cancel: CancellationToken,
) {
    // Why the stream ended, and whether it was ever open (if not, nothing was sent).
    let why = async {
        let stream = match tokio::time::timeout(OPEN_TIMEOUT, open(&mut control, peer)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return (format!("cannot open a call stream: {e}"), false),
            Err(_) => return ("the call stream did not open in time".to_string(), false),
        };
        let (mut reader, mut writer) = stream.split();
        let write = async {
            while let Some(first) = requests.recv().await {
                if let Err(e) = write_batch(&mut writer, first, &mut requests, &metrics).await {
                    return format!("the call stream closed: {e}");
                }
            }
            "the node stopped".to_string()
        };
        let read = async {
            loop {
                match read_frame(&mut reader, max_frame).await {
                    Ok(Some((id, kind, body))) => {
                        metrics.received(Lane::Call, HEADER + body.len());
                        let answer = match kind {
                            KIND_ANSWER => Ok(MeshResponse::Node(body)),
                            KIND_ERROR => {
                                Ok(MeshResponse::Error(String::from_utf8_lossy(&body).into()))
                            }
                            other => {
                                return format!("the peer sent a frame of kind {other}");
                            }
                        };
                        let caller = waiting.lock().ok().and_then(|mut w| w.remove(&id));
                        if let Some(caller) = caller {
                            let _ = caller.send(answer);
                        }
                    }
                    Ok(None) => return "the peer closed the call stream".to_string(),
                    Err(e) => return format!("the call stream failed: {e}"),
                }
            }
        };
        tokio::select! {
            why = write => (why, true),
            why = read => (why, true),
        }
    };
    let (why, opened) = tokio::select! {
        _ = cancel.cancelled() => ("the network stopped".to_string(), true),
        why = why => why,
    };
    tracing::debug!(%peer, "call stream ended: {why}");
    // No request gets in after this; those that did fail with the reason.
    requests.close();
    let stranded: Vec<_> = waiting
        .lock()
        .map(|mut w| w.drain().map(|(_, c)| c).collect())
        .unwrap_or_default();
    for caller in stranded {
        let error = match opened {
            true => NodeError::Request {
                peer: peer.to_string(),
                reason: why.clone(),
            },
            false => NodeError::Unreached {
                peer: peer.to_string(),
                reason: why.clone(),
            },
        };
        let _ = caller.send(Err(error));
    }
}

async fn open(control: &mut Control, peer: PeerId) -> std::result::Result<Stream, String> {
    super::open_taken(control, peer, CALL_PROTOCOL, "call")
        .await
        .map_err(|e| e.to_string())
}

/// What serving inbound streams takes.
#[derive(Clone)]
struct Inbound {
    max_frame: usize,
    answer_timeout: Duration,
    metrics: NetMetrics,
    sink: Arc<OnceLock<RequestSink>>,
    cancel: CancellationToken,
}

async fn accept(mut incoming: IncomingStreams, events: mpsc::Sender<NetEvent>, with: Inbound) {
    loop {
        let Some((peer, stream)) = super::next_stream(&mut incoming, &with.cancel).await else {
            return;
        };
        tokio::spawn(serve(peer, stream, events.clone(), with.clone()));
    }
}

/// How a request's answer comes: from the sink's future, or from the node.
enum Answer {
    Now(futures::future::BoxFuture<'static, MeshResponse>),
    Later(oneshot::Receiver<MeshResponse>),
}

/// Hands each request on one inbound stream to the node (or its sink) and writes
/// the answers back as they come.
async fn serve(peer: PeerId, stream: Stream, events: mpsc::Sender<NetEvent>, with: Inbound) {
    let (mut reader, mut writer) = stream.split();
    let (answers_tx, mut answers) = mpsc::channel::<Frame>(QUEUE);
    let metrics = with.metrics.clone();
    let write = async {
        if !super::say_taken(&mut writer).await {
            return;
        }
        while let Some(first) = answers.recv().await {
            if let Err(e) = write_batch(&mut writer, first, &mut answers, &metrics).await {
                tracing::debug!(%peer, "call stream closed: {e}");
                return;
            }
        }
    };
    let read = async {
        loop {
            let (id, kind, body) = match read_frame(&mut reader, with.max_frame).await {
                Ok(Some(frame)) => frame,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(%peer, "bad call frame; closing the peer's stream: {e}");
                    return;
                }
            };
            with.metrics.received(Lane::Call, HEADER + body.len());
            if kind != KIND_REQUEST {
                tracing::warn!(%peer, kind, "call frame of an unknown kind; closing the peer's stream");
                return;
            }
            let request = MeshRequest::Node(body);
            let answer = match with.sink.get() {
                Some(sink) => Answer::Now(sink(peer, request)),
                None => {
                    let (reply, answer) = oneshot::channel();
                    let request = NetEvent::Request {
                        from: peer,
                        request,
                        reply,
                    };
                    if events.send(request).await.is_err() {
                        return;
                    }
                    Answer::Later(answer)
                }
            };
            let answers = answers_tx.clone();
            let timeout = with.answer_timeout;
            tokio::spawn(async move {
                let answer = async {
                    match answer {
                        Answer::Now(answering) => Ok(answering.await),
                        Answer::Later(answer) => answer.await,
                    }
                };
                let (kind, body) = match tokio::time::timeout(timeout, answer).await {
                    Ok(Ok(MeshResponse::Node(bytes))) => (KIND_ANSWER, bytes),
                    Ok(Ok(MeshResponse::Error(why))) => (KIND_ERROR, why.into_bytes()),
                    Ok(Ok(other)) => (
                        KIND_ERROR,
                        format!("the node answered {other:?} to a node request").into_bytes(),
                    ),
                    Ok(Err(_)) => (
                        KIND_ERROR,
                        b"the node did not handle the node request".to_vec(),
                    ),
                    Err(_) => (
                        KIND_ERROR,
                        format!(
                            "the node did not answer the node request within {:.1}s",
                            timeout.as_secs_f64()
                        )
                        .into_bytes(),
                    ),
                };
                let _ = answers.send((id, kind, body)).await;
            });
        }
    };
    tokio::select! {
        _ = with.cancel.cancelled() => {}
        _ = read => {}
        _ = write => {}
    }
}
