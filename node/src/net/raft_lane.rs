//! The Raft lane: one long-lived libp2p stream per peer and direction, carrying
//! length-prefixed Raft frames.
//!
//! Raft sends many small messages to the same few peers, and each must go out at
//! once. A request-response exchange per message costs a new Yamux stream, a
//! protocol negotiation and an answer; here a frame costs one write on a stream that
//! is already open, and the frames queued while a write was under way go out
//! together in the next one. The lane gives no receipt: Raft retries what is lost.
//!
//! Outbound, a writer task per peer owns the stream and reopens it (dialling if
//! needed) after a failure, dropping what was queued meanwhile. A new stream is
//! written to once the reader on the other side has said it took it (one byte):
//! libp2p drops a new stream its acceptor has no room for yet. Inbound, a reader
//! task per stream hands frames to the node; a frame over the limit closes that
//! stream and is logged, and the node carries on. Bytes count in the `raft` lane of
//! the node's metrics: each frame with its length prefix, once written (flushed) or
//! read whole.
//!
//! Where both nodes have a direct listener, the stream also sets up the direct Raft
//! channel (see [`super::raft_direct`]): the writer offers it on the stream, and once
//! connected writes its batches there instead, back on the stream if it breaks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt};
use libp2p::{PeerId, Stream, StreamProtocol};
use libp2p_stream::{Control, IncomingStreams};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::blob_direct::{self, Holder, Peers};
use super::raft_direct::{self, Cut, Deliver, Outbound, PeerSet, TrySent};
use super::{NetEvent, RaftSink};
use crate::error::{NodeError, Result};
use crate::metrics::{Lane, NetMetrics};

pub const RAFT_PROTOCOL: StreamProtocol = StreamProtocol::new(gpumesh_protocol::lane!("raft"));

/// Frames queued for one peer; beyond this `send` fails fast and Raft retries.
const QUEUE: usize = 1024;
/// Frames are gathered into one write up to about this many bytes.
pub(super) const BATCH_BYTES: usize = 1 << 20;
/// How long opening a stream (and dialling) may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(5);
/// After a failed open, frames for the peer are dropped for this long.
const RETRY_AFTER: Duration = Duration::from_millis(500);
/// A writer with nothing to send for this long ends; the next frame starts another.
pub(super) const IDLE: Duration = Duration::from_secs(300);
/// After the direct channel to a peer failed or broke, the stream carries its
/// frames for this long before the channel is offered again.
const DIRECT_RETRY: Duration = Duration::from_secs(5);
/// After a peer said it takes no frames directly, or the offer failed, this long.
const DIRECT_REFUSED: Duration = Duration::from_secs(60);

/// The sending side, shared by every [`super::NetHandle`] clone.
pub(super) struct RaftLane {
    control: Control,
    writers: Mutex<HashMap<PeerId, Writer>>,
    max_frame: usize,
    /// Injected delay before each write, in microseconds (fault injection).
    delay_us: Arc<AtomicU64>,
    metrics: NetMetrics,
    /// Where peers' direct listeners are; `None` when the direct channel is off.
    ips: Option<Peers>,
    /// Peers cut off by fault injection: nothing is written to them directly.
    pub(super) cut: Cut,
    /// Peers whose frames go over the direct channel now.
    pub(super) direct_to: PeerSet,
    /// Where frames read go, once the node sets it.
    pub(super) sink: Arc<OnceLock<RaftSink>>,
    cancel: CancellationToken,
}

/// The sending side's hold on one peer's writer task.
struct Writer {
    frames: mpsc::Sender<Vec<u8>>,
    /// Frames handed to the writer task and not yet written (or dropped) by it.
    queued: Arc<AtomicUsize>,
    /// The direct connection to the peer, while there is one; the writer task
    /// holds the lock while it writes.
    direct: Direct,
}

type Direct = Arc<tokio::sync::Mutex<Option<Outbound>>>;

/// What the lane's readers need.
#[derive(Clone)]
struct Reading {
    to: Deliver,
    max_frame: usize,
    metrics: NetMetrics,
    /// The node's direct listener, which keeps the tickets of writers' offers.
    holder: Option<Holder>,
}

impl RaftLane {
    /// Starts accepting inbound Raft streams (each frame goes to `sink` once the
    /// node sets it, else becomes a [`NetEvent::Raft`] on `events`) and returns the
    /// sending side. Readers answer writers' offers of the direct channel when the
    /// node has a direct listener (`holder`); writers offer it to peers whose
    /// address `ips` knows (`None`: the direct channel is off).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start(
        mut control: Control,
        events: mpsc::Sender<NetEvent>,
        max_frame: usize,
        delay_us: Arc<AtomicU64>,
        metrics: NetMetrics,
        holder: Option<Holder>,
        ips: Option<Peers>,
        cut: Cut,
        sink: Arc<OnceLock<RaftSink>>,
        cancel: CancellationToken,
    ) -> Result<Arc<RaftLane>> {
        let incoming = control
            .accept(RAFT_PROTOCOL)
            .map_err(|e| NodeError::NetSetup(format!("raft protocol: {e}")))?;
        let reading = Reading {
            to: Deliver {
                events,
                sink: sink.clone(),
            },
            max_frame,
            metrics: metrics.clone(),
            holder,
        };
        tokio::spawn(accept(incoming, reading, cancel.clone()));
        Ok(Arc::new(RaftLane {
            control,
            writers: Mutex::new(HashMap::new()),
            max_frame,
            delay_us,
            metrics,
            ips,
            cut,
            direct_to: PeerSet::default(),
            sink,
            cancel,
        }))
    }

    /// Queues `frame` for `to` without waiting.
    pub(super) fn send(&self, to: PeerId, frame: Vec<u8>) -> Result<()> {
        if frame.len() > self.max_frame {
            return Err(NodeError::Limit {
                what: "raft frame in bytes",
                value: frame.len() as u64,
                limit: self.max_frame as u64,
                setting: "NetConfig::max_frame_bytes",
            });
        }
        if self.cancel.is_cancelled() {
            return Err(NodeError::NetStopped);
        }
        let mut writers = self.writers.lock().map_err(|_| NodeError::NetStopped)?;
        let frame = match writers.get(&to) {
            None => frame,
            Some(writer) => {
                let Some(frame) = self.write_now(to, writer, frame) else {
                    return Ok(());
                };
                writer.queued.fetch_add(1, Ordering::AcqRel);
                match writer.frames.try_send(frame) {
                    Ok(()) => return Ok(()),
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        writer.queued.fetch_sub(1, Ordering::AcqRel);
                        return Err(NodeError::NetBusy("raft queue to the peer is full"));
                    }
                    // The writer went idle and ended: start another below.
                    Err(mpsc::error::TrySendError::Closed(frame)) => frame,
                }
            }
        };
        let (tx, rx) = mpsc::channel(QUEUE);
        let writer = Writer {
            frames: tx,
            queued: Arc::new(AtomicUsize::new(1)),
            direct: Direct::default(),
        };
        tokio::spawn(write(
            Writing {
                control: self.control.clone(),
                peer: to,
                delay_us: self.delay_us.clone(),
                metrics: self.metrics.clone(),
                ips: self.ips.clone(),
                cut: self.cut.clone(),
                direct_to: self.direct_to.clone(),
                queued: writer.queued.clone(),
                direct: writer.direct.clone(),
            },
            rx,
            self.cancel.clone(),
        ));
        let _ = writer.frames.try_send(frame);
        writers.insert(to, writer);
        Ok(())
    }

    /// Writes `frame` into the direct connection to `to` from this thread when
    /// nothing else is waiting to go there (the writer task is idle, so the order
    /// holds: sends are one at a time under the writers' lock). Saves waking the
    /// writer task, which a busy runtime may run only after the caller's next step
    /// (the leader's own log sync, a follower's applies). `Some(frame)`: not
    /// written, queue it.
    fn write_now(&self, to: PeerId, writer: &Writer, frame: Vec<u8>) -> Option<Vec<u8>> {
        if writer.queued.load(Ordering::Acquire) != 0
            || writer.frames.is_closed()
            || self.delay_us.load(Ordering::Relaxed) > 0
            || self.cut.has(&to)
        {
            return Some(frame);
        }
        let Ok(mut direct) = writer.direct.try_lock() else {
            return Some(frame);
        };
        let Some(out) = direct.as_mut() else {
            return Some(frame);
        };
        let mut batch = Vec::with_capacity(4 + frame.len());
        put_frame(&mut batch, &frame);
        match out.try_send(&batch) {
            TrySent::Whole(n) => {
                self.metrics.sent(Lane::Raft, n);
                None
            }
            TrySent::Part => {
                // The writer task writes the rest before anything after it.
                writer.queued.fetch_add(1, Ordering::AcqRel);
                if writer.frames.try_send(Vec::new()).is_err() {
                    writer.queued.fetch_sub(1, Ordering::AcqRel);
                    *direct = None; // a cut record: the reader drops the connection
                    self.direct_to.set(to, false);
                }
                None
            }
            TrySent::Broken(e) => {
                tracing::debug!(peer = %to, "direct raft connection: {e}; back to the stream");
                *direct = None;
                self.direct_to.set(to, false);
                Some(frame)
            }
        }
    }
}

/// Appends `frame` to `out` behind its little-endian u32 length.
fn put_frame(out: &mut Vec<u8>, frame: &[u8]) {
    out.extend_from_slice(&(frame.len() as u32).to_le_bytes());
    out.extend_from_slice(frame);
}

/// What a writer needs besides its queue.
struct Writing {
    control: Control,
    peer: PeerId,
    delay_us: Arc<AtomicU64>,
    metrics: NetMetrics,
    ips: Option<Peers>,
    cut: Cut,
    direct_to: PeerSet,
    /// Frames queued for this writer and not yet written by it.
    queued: Arc<AtomicUsize>,
    /// The direct connection, shared with [`RaftLane::write_now`].
    direct: Direct,
}

/// Counts frames a writer took off its queue as done when dropped (written, or
/// given up on).
struct Taken<'a>(&'a AtomicUsize, usize);

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::AcqRel);
    }
}

/// Owns the outbound stream to `peer`, and the direct connection once there is one;
/// writes what is queued, batching whatever arrived while the previous write was
/// under way.
async fn write(mut w: Writing, mut frames: mpsc::Receiver<Vec<u8>>, cancel: CancellationToken) {
    let peer = w.peer;
    let mut stream: Option<Stream> = None;
    let mut offer_at = tokio::time::Instant::now();
    let mut batch = Vec::new();
    let mut quiet_until = tokio::time::Instant::now();
    loop {
        let first = tokio::select! {
            _ = cancel.cancelled() => None,
            next = tokio::time::timeout(IDLE, frames.recv()) => next.ok().flatten(),
        };
        let Some(first) = first else {
            // Ended: the connection is closed with it.
            frames.close();
            *w.direct.lock().await = None;
            w.direct_to.set(peer, false);
            return;
        };
        let mut taken = Taken(&w.queued, 1);
        let now = tokio::time::Instant::now();
        if now < quiet_until {
            continue; // the peer was unreachable a moment ago; Raft will retry
        }
        let delay = w.delay_us.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_micros(delay)).await;
        }
        batch.clear();
        // An empty frame only asks for the rest of a record written in part (see
        // `RaftLane::write_now`) to be written: `send_direct` does that first.
        if !first.is_empty() {
            put_frame(&mut batch, &first);
        }
        while batch.len() < BATCH_BYTES {
            match frames.try_recv() {
                Ok(frame) => {
                    taken.1 += 1;
                    if !frame.is_empty() {
                        put_frame(&mut batch, &frame);
                    }
                }
                Err(_) => break,
            }
        }
        if w.cut.has(&peer) {
            *w.direct.lock().await = None; // closed, as the mesh's connections are
            w.direct_to.set(peer, false);
            continue;
        }
        if w.send_direct(&batch, &mut offer_at).await || batch.is_empty() {
            continue;
        }
        if stream.is_none() {
            match tokio::time::timeout(OPEN_TIMEOUT, open(&mut w.control, peer)).await {
                Ok(Ok(s)) => stream = Some(s),
                Ok(Err(e)) => {
                    tracing::debug!(%peer, "raft stream: {e}");
                    quiet_until = tokio::time::Instant::now() + RETRY_AFTER;
                    continue;
                }
                Err(_) => {
                    tracing::debug!(%peer, "raft stream did not open in time");
                    quiet_until = tokio::time::Instant::now() + RETRY_AFTER;
                    continue;
                }
            }
        }
        let Some(s) = stream.as_mut() else { continue };
        let ip = w.ips.as_ref().and_then(|ips| ips.ip(&peer));
        if let (Some(ip), true) = (ip, now >= offer_at) {
            match raft_direct::ask(s, ip).await {
                Ok(Some(d)) => {
                    *w.direct.lock().await = Some(d);
                    w.direct_to.set(peer, true);
                }
                Ok(None) => offer_at = now + DIRECT_REFUSED,
                Err(e) => {
                    // Its port out of reach (a firewall), or a peer from before the
                    // direct channel, which takes the offer for a malformed frame
                    // and closes the stream: not again for a while.
                    tracing::debug!(%peer, "direct raft connection not made: {e}");
                    offer_at = now + DIRECT_REFUSED;
                    stream = None; // an answer may still come on it
                    continue;
                }
            }
            if w.send_direct(&batch, &mut offer_at).await {
                continue;
            }
        }
        let written = async {
            s.write_all(&batch).await?;
            s.flush().await
        };
        match written.await {
            Ok(()) => w.metrics.sent(Lane::Raft, batch.len()),
            Err(e) => {
                tracing::debug!(%peer, "raft stream closed: {e}");
                stream = None;
            }
        }
        drop(taken);
    }
}

impl Writing {
    /// Writes `batch` on the direct connection, if there is one; false when there is
    /// none or it broke (then it is dropped, and offered again after a while).
    async fn send_direct(&self, batch: &[u8], offer_at: &mut tokio::time::Instant) -> bool {
        let mut direct = self.direct.lock().await;
        let Some(d) = direct.as_mut() else {
            return false;
        };
        match d.send(batch).await {
            Ok(n) => {
                self.metrics.sent(Lane::Raft, n);
                true
            }
            Err(e) => {
                tracing::debug!(peer = %self.peer, "direct raft connection: {e}; back to the stream");
                *direct = None;
                self.direct_to.set(self.peer, false);
                *offer_at = tokio::time::Instant::now() + DIRECT_RETRY;
                false
            }
        }
    }
}

async fn open(control: &mut Control, peer: PeerId) -> std::io::Result<Stream> {
    super::open_taken(control, peer, RAFT_PROTOCOL, "raft").await
}

async fn accept(mut incoming: IncomingStreams, reading: Reading, cancel: CancellationToken) {
    loop {
        let Some((peer, stream)) = super::next_stream(&mut incoming, &cancel).await else {
            return;
        };
        tokio::spawn(read(peer, stream, reading.clone(), cancel.clone()));
    }
}

/// Hands each frame on one inbound stream to the node, waiting while the node is
/// busy (which slows the sender through the stream's flow control), and answers
/// the writer's offers of the direct channel.
async fn read(peer: PeerId, mut stream: Stream, r: Reading, cancel: CancellationToken) {
    let frames = async {
        if !super::say_taken(&mut stream).await {
            return;
        }
        loop {
            let mut len = [0u8; 4];
            if stream.read_exact(&mut len).await.is_err() {
                return; // the peer closed the stream or went away
            }
            let len = u32::from_le_bytes(len) as usize;
            if len == blob_direct::OFFERED as usize {
                if let Err(e) = raft_direct::answer(&mut stream, r.holder.as_ref(), peer).await {
                    tracing::debug!(%peer, "raft stream: answering an offer: {e}");
                    return;
                }
                continue;
            }
            if len > r.max_frame {
                tracing::warn!(
                    %peer,
                    len,
                    limit = r.max_frame,
                    "raft frame over the limit; closing the peer's stream"
                );
                return;
            }
            let mut frame = vec![0u8; len];
            if let Err(e) = stream.read_exact(&mut frame).await {
                tracing::debug!(%peer, "raft stream cut short: {e}");
                return;
            }
            r.metrics.received(Lane::Raft, 4 + len);
            if !r.to.frame(peer, frame).await {
                return;
            }
        }
    };
    tokio::select! {
        _ = cancel.cancelled() => {}
        _ = frames => {}
    }
    let _ = stream.close().await;
}
