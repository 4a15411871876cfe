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
//!
//! Where the node has a direct listener and the peer's IP is known, the opener
//! moves the stream's frames to a TCP connection of their own right after it opens
//! ([`super::call_direct`]): the same frames, a batch per sealed record.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use futures::io::{ReadHalf, WriteHalf};
use futures::{AsyncReadExt, AsyncWriteExt};
use gpumesh_protocol::{MeshRequest, MeshResponse};
use libp2p::{PeerId, Stream, StreamProtocol};
use libp2p_stream::{Control, IncomingStreams};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::blob_direct::{self, Holder, Peers};
use super::call_direct::{self, Channel, Opening, Sealing};
use super::raft_direct::Cut;
use super::{NetEvent, RequestSink};
use crate::error::{NodeError, Result};
use crate::metrics::{Lane, NetMetrics};

pub const CALL_PROTOCOL: StreamProtocol = StreamProtocol::new(gpumesh_protocol::lane!("call"));

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
    direct: Direct,
    cancel: CancellationToken,
}

/// What moving a call stream to a direct connection takes (see
/// [`super::call_direct`]).
#[derive(Clone)]
pub(super) struct Direct {
    /// The node's direct listener, which takes the connections offered to it;
    /// `None` when the node has none (it then answers no to every offer).
    pub holder: Option<Holder>,
    /// Where peers' direct ports are; `None` when the node offers no direct
    /// connections.
    pub ips: Option<Peers>,
    /// Peers cut off by fault injection: nothing goes to or comes from them.
    pub cut: Cut,
    /// Peers that refused an offer (or whose port did not answer), until when.
    refused: Arc<Mutex<HashMap<PeerId, tokio::time::Instant>>>,
    /// Peers whose calls from here go over a direct connection now.
    pub to: super::raft_direct::PeerSet,
}

impl Direct {
    pub(super) fn new(holder: Option<Holder>, ips: Option<Peers>, cut: Cut) -> Direct {
        Direct {
            holder,
            ips,
            cut,
            refused: Arc::default(),
            to: Default::default(),
        }
    }

    /// The IP to offer `peer` a direct connection at, if it is to be offered one.
    fn ip(&self, peer: &PeerId) -> Option<std::net::IpAddr> {
        let refused = self.refused.lock().unwrap_or_else(PoisonError::into_inner);
        if refused
            .get(peer)
            .is_some_and(|until| tokio::time::Instant::now() < *until)
        {
            return None;
        }
        self.ips.as_ref()?.ip(peer)
    }

    fn refuse(&self, peer: PeerId) {
        let mut refused = self.refused.lock().unwrap_or_else(PoisonError::into_inner);
        refused.insert(peer, tokio::time::Instant::now() + call_direct::REFUSED);
    }
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
        direct: Direct,
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
                direct: direct.clone(),
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
            direct,
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

    /// Peers whose calls from here go over a direct connection now.
    pub(super) fn direct_peers(&self) -> Vec<PeerId> {
        self.direct.to.all()
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
            self.direct.clone(),
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

/// A frame's length, checked: at least the id and kind, at most `max_frame`.
fn frame_len(len: [u8; 4], max_frame: usize) -> std::io::Result<usize> {
    let len = u32::from_le_bytes(len) as usize;
    if !(9..=max_frame).contains(&len) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes (at least 9, at most {max_frame})"),
        ));
    }
    Ok(len)
}

/// A frame's id, kind and body, from its bytes after the length.
fn split_frame(mut frame: Vec<u8>) -> (u64, u8, Vec<u8>) {
    let id = u64::from_le_bytes(frame[..8].try_into().unwrap_or_default());
    let kind = frame[8];
    frame.drain(..9);
    (id, kind, frame)
}

/// Where a call stream's frames come from: the stream, or the direct connection
/// it moved to.
enum Frames {
    /// `first`: a frame's length already read (by the server, looking for an offer).
    Stream {
        half: ReadHalf<Stream>,
        first: Option<[u8; 4]>,
    },
    /// The last record opened, and how far into it the frames have been read.
    Direct {
        channel: Box<Opening>,
        record: Vec<u8>,
        at: usize,
    },
}

impl Frames {
    fn direct(channel: Opening) -> Frames {
        Frames::Direct {
            channel: Box::new(channel),
            record: Vec::new(),
            at: 0,
        }
    }

    /// The next frame: its id, kind and body. `Ok(None)` when the peer ended the
    /// stream (or connection) between frames.
    async fn next(&mut self, max_frame: usize) -> std::io::Result<Option<(u64, u8, Vec<u8>)>> {
        match self {
            Frames::Stream { half, first } => {
                let len = match first.take() {
                    Some(len) => len,
                    None => {
                        let mut len = [0u8; 4];
                        match half.read_exact(&mut len).await {
                            Ok(()) => {}
                            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                                return Ok(None)
                            }
                            Err(e) => return Err(e),
                        }
                        len
                    }
                };
                let mut frame = vec![0u8; frame_len(len, max_frame)?];
                half.read_exact(&mut frame).await?;
                Ok(Some(split_frame(frame)))
            }
            Frames::Direct {
                channel,
                record,
                at,
            } => {
                while *at == record.len() {
                    match channel.record(max_record(max_frame)).await? {
                        Some(r) => *record = r,
                        None => return Ok(None),
                    }
                    *at = 0;
                }
                let rest = &record[*at..];
                let bad = || {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "a record ends inside a frame",
                    )
                };
                let len: [u8; 4] = rest
                    .get(..4)
                    .ok_or_else(bad)?
                    .try_into()
                    .map_err(|_| bad())?;
                let len = frame_len(len, max_frame)?;
                let frame = rest.get(4..4 + len).ok_or_else(bad)?.to_vec();
                *at += 4 + len;
                Ok(Some(split_frame(frame)))
            }
        }
    }
}

/// The largest record a direct connection's writer sends: a batch is gathered up
/// to [`BATCH_BYTES`], and its last frame may pass that.
fn max_record(max_frame: usize) -> usize {
    BATCH_BYTES + 4 + max_frame + blob_direct::TAG
}

/// Where a call stream's frames go: the stream, or the direct connection it moved
/// to.
enum Out {
    Stream(WriteHalf<Stream>),
    Direct(Box<Sealing>),
}

/// Writes `first` and whatever else is queued on `frames` in one write (one record
/// on a direct connection).
async fn write_batch(
    out: &mut Out,
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
    let sent = match out {
        Out::Stream(stream) => {
            stream.write_all(&batch).await?;
            stream.flush().await?;
            batch.len()
        }
        Out::Direct(channel) => channel.send(&batch).await?,
    };
    metrics.sent(Lane::Call, sent);
    Ok(())
}

/// Waits on a call stream whose frames moved to a direct connection, where
/// nothing more is sent: returns why it ended (the mesh's connection to the peer
/// closed, or the peer broke the rule).
async fn idle(stream: &mut Stream) -> String {
    let mut byte = [0u8; 1];
    match stream.read(&mut byte).await {
        Ok(0) => "the peer closed the call stream".to_string(),
        Ok(_) => "the peer wrote on a call stream moved to a direct connection".to_string(),
        Err(e) => format!("the call stream failed: {e}"),
    }
}

/// Opens the call stream to `peer` and, if it is to be offered one, moves it to a
/// direct connection. A peer that refuses, whose port does not answer, or that
/// takes the offer for a bad frame (which closes the stream: another is opened) is
/// not offered one again for a while.
async fn open_call(
    control: &mut Control,
    peer: PeerId,
    direct: &Direct,
) -> std::result::Result<(Stream, Option<Channel>), String> {
    let mut stream = open(control, peer).await?;
    let Some(ip) = direct.ip(&peer) else {
        return Ok((stream, None));
    };
    match call_direct::ask(&mut stream, ip).await {
        Ok(Some(channel)) => Ok((stream, Some(channel))),
        Ok(None) => {
            direct.refuse(peer);
            Ok((stream, None))
        }
        Err(e) => {
            tracing::debug!(%peer, "direct call connection not made: {e}");
            direct.refuse(peer);
            Ok((open(control, peer).await?, None))
        }
    }
}

/// Owns the outbound stream to `peer`: writes the queued requests and hands each
/// answer to its caller. Ends when the stream fails; the callers still waiting
/// then fail with the reason.
#[allow(clippy::too_many_arguments)]
async fn call(
    mut control: Control,
    peer: PeerId,
    mut requests: mpsc::Receiver<Frame>,
    waiting: Waiting,
    max_frame: usize,
    metrics: NetMetrics,
    direct: Direct,
    cancel: CancellationToken,
) {
    // Why the stream ended, and whether it was ever open (if not, nothing was sent).
    let why = async {
        let opened = tokio::time::timeout(OPEN_TIMEOUT, open_call(&mut control, peer, &direct));
        let (stream, channel) = match opened.await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return (format!("cannot open a call stream: {e}"), false),
            Err(_) => return ("the call stream did not open in time".to_string(), false),
        };
        direct.to.set(peer, channel.is_some());
        let (mut frames, mut out, mut moved) = match channel {
            Some(c) => (
                Frames::direct(c.reader),
                Out::Direct(Box::new(c.writer)),
                Some(stream),
            ),
            None => {
                let (reader, writer) = stream.split();
                let frames = Frames::Stream {
                    half: reader,
                    first: None,
                };
                (frames, Out::Stream(writer), None)
            }
        };
        let write = async {
            while let Some(first) = requests.recv().await {
                if direct.cut.has(&peer) {
                    return "the peer is cut off".to_string();
                }
                if let Err(e) = write_batch(&mut out, first, &mut requests, &metrics).await {
                    return format!("the call stream closed: {e}");
                }
            }
            "the node stopped".to_string()
        };
        let read = async {
            loop {
                match frames.next(max_frame).await {
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
        let stream_ended = async {
            match moved.as_mut() {
                Some(stream) => idle(stream).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            why = write => (why, true),
            why = read => (why, true),
            why = stream_ended => (why, true),
        }
    };
    let (why, opened) = tokio::select! {
        _ = cancel.cancelled() => ("the network stopped".to_string(), true),
        why = why => why,
    };
    tracing::debug!(%peer, "call stream ended: {why}");
    direct.to.set(peer, false);
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
    direct: Direct,
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

/// Takes an inbound call stream: says so, and moves it to a direct connection if
/// its opener offers one first. Returns where its frames come from and go, and the
/// stream to watch if they moved; `None` when the stream is gone.
async fn take(
    mut stream: Stream,
    peer: PeerId,
    with: &Inbound,
) -> Option<(Frames, Out, Option<Stream>)> {
    if !super::say_taken(&mut stream).await {
        return None;
    }
    let mut first = [0u8; 4];
    stream.read_exact(&mut first).await.ok()?;
    if u32::from_le_bytes(first) != blob_direct::OFFERED {
        let (reader, writer) = stream.split();
        let frames = Frames::Stream {
            half: reader,
            first: Some(first),
        };
        return Some((frames, Out::Stream(writer), None));
    }
    match call_direct::answer(&mut stream, with.direct.holder.as_ref()).await {
        Ok(Some(channel)) => Some((
            Frames::direct(channel.reader),
            Out::Direct(Box::new(channel.writer)),
            Some(stream),
        )),
        Ok(None) => {
            let (reader, writer) = stream.split();
            let frames = Frames::Stream {
                half: reader,
                first: None,
            };
            Some((frames, Out::Stream(writer), None))
        }
        Err(e) => {
            tracing::debug!(%peer, "direct call connection not taken: {e}");
            None
        }
    }
}

/// Hands each request on one inbound stream (or the direct connection it moved
/// to) to the node (or its sink) and writes the answers back as they come.
async fn serve(peer: PeerId, stream: Stream, events: mpsc::Sender<NetEvent>, with: Inbound) {
    let taken = tokio::select! {
        _ = with.cancel.cancelled() => return,
        taken = take(stream, peer, &with) => taken,
    };
    let Some((mut frames, mut out, mut moved)) = taken else {
        return;
    };
    let (answers_tx, mut answers) = mpsc::channel::<Frame>(QUEUE);
    let metrics = with.metrics.clone();
    let cut = with.direct.cut.clone();
    let write = async {
        while let Some(first) = answers.recv().await {
            if cut.has(&peer) {
                return;
            }
            if let Err(e) = write_batch(&mut out, first, &mut answers, &metrics).await {
                tracing::debug!(%peer, "call stream closed: {e}");
                return;
            }
        }
    };
    let read = async {
        loop {
            let (id, kind, body) = match frames.next(with.max_frame).await {
                Ok(Some(frame)) => frame,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(%peer, "bad call frame; closing the peer's stream: {e}");
                    return;
                }
            };
            with.metrics.received(Lane::Call, HEADER + body.len());
            if cut.has(&peer) {
                return;
            }
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
    let stream_ended = async {
        match moved.as_mut() {
            Some(stream) => {
                let why = idle(stream).await;
                tracing::debug!(%peer, "direct call connection closed: {why}");
            }
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = with.cancel.cancelled() => {}
        _ = read => {}
        _ = write => {}
        _ = stream_ended => {}
    }
}
