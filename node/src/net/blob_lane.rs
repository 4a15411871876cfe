//! The blob lane: a blob's bytes on one libp2p stream per pull.
//!
//! A pull asks for a range once and the holder writes it back as one stream of
//! bytes, read from its file a piece at a time: no request, answer and encoding per
//! chunk, and nothing passes through the network actor (the stream is this task's
//! and the connection's). The transport is the mesh's own: Noise (with the cluster
//! key) and Yamux, so the bytes are encrypted and the peer authenticated as for
//! everything else. A peer that does not speak the lane is pulled from in chunks
//! over request-response instead.
//!
//! Request: the blob id (32 bytes), the offset and the most bytes wanted (u64
//! little-endian each), and the route asked for: `ON_STREAM`, or `DIRECT` and a
//! ticket and key (see [`super::blob_direct`]). Answer: `OK`, the blob's total size
//! (u64) and the route taken: `ON_STREAM` and the bytes from the offset to the end
//! of the range, or `DIRECT` and the port (u16) of the holder's direct listener;
//! or `NOT_FOUND`; or `ERROR` and a message (u32 length, UTF-8). A holder without
//! the direct channel, with too many tickets waiting, or asked for less than
//! [`DIRECT_MIN`] bytes, answers on the stream.

use std::net::SocketAddr;
use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt};
use gpumesh_protocol::BlobId;
use libp2p::{PeerId, Stream, StreamProtocol};
use libp2p_stream::{Control, IncomingStreams};
use tokio_util::sync::CancellationToken;

use super::blob_direct::{self, Holder, Offer, Peers, KEY, TICKET};
use crate::blobs::store::BlobStore;
use crate::error::{NodeError, Result};
use crate::metrics::{Lane, NetMetrics};

pub const BLOB_PROTOCOL: StreamProtocol = StreamProtocol::new(gpumesh_protocol::lane!("blob"));

const OK: u8 = 0;
const NOT_FOUND: u8 = 1;
const ERROR: u8 = 2;

/// Routes: the bytes on this stream, or on the direct channel.
const ON_STREAM: u8 = 0;
const DIRECT: u8 = 1;

/// The smallest range a holder sends on the direct channel: below it, the connection
/// it opens (a round trip on a real network) costs more than the cipher saves.
pub(super) const DIRECT_MIN: u64 = blob_direct::RECORD;

/// A request's fixed part: id, offset, most bytes wanted, route.
const REQUEST: usize = 32 + 8 + 8 + 1;

/// Bytes read from the file (and handed to the puller) at a time.
const PIECE: u64 = 1 << 20;

/// Streams opened for one pull when the holder drops them unanswered.
const OPEN_TRIES: u32 = 8;
/// How long to wait before opening another, the first time: doubled each time
/// (up to 4 times), and a random part of it added, so pulls that met a full
/// queue together do not meet it together again.
const REOPEN_PAUSE: Duration = Duration::from_millis(5);

/// The longest error message a holder sends.
const MAX_MESSAGE: u32 = 4096;

/// How long a holder waits for a request, or for the puller to take the next piece,
/// before it drops the stream.
const STALL: Duration = Duration::from_secs(30);

/// Serves pulls of this node's blobs until `cancel` fires.
/// Bytes count in the `blob` lane of `metrics` as they are written or read.
/// With `direct`, pulls that ask for it are answered with its port.
pub(super) fn serve(
    control: &mut Control,
    blobs: BlobStore,
    metrics: NetMetrics,
    direct: Option<Holder>,
    cancel: CancellationToken,
) -> Result<()> {
    let incoming = control
        .accept(BLOB_PROTOCOL)
        .map_err(|e| NodeError::NetSetup(format!("blob protocol: {e}")))?;
    tokio::spawn(accept(incoming, blobs, metrics, direct, cancel));
    Ok(())
}

async fn accept(
    mut incoming: IncomingStreams,
    blobs: BlobStore,
    metrics: NetMetrics,
    direct: Option<Holder>,
    cancel: CancellationToken,
) {
    loop {
        let Some((peer, stream)) = super::next_stream(&mut incoming, &cancel).await else {
            return;
        };
        let (blobs, metrics, cancel) = (blobs.clone(), metrics.clone(), cancel.clone());
        let direct = direct.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                served = answer(stream, blobs, metrics, direct) => if let Err(e) = served {
                    tracing::debug!(%peer, error = %e, "a blob pull ended early");
                }
            }
        });
    }
}

/// Answers one pull: the range asked for, a piece at a time, or the port to fetch
/// it from directly.
async fn answer(
    stream: Stream,
    blobs: BlobStore,
    metrics: NetMetrics,
    direct: Option<Holder>,
) -> std::io::Result<()> {
    let mut stream = Stalling(stream);
    let mut request = [0u8; REQUEST];
    stream.read_exact(&mut request).await?;
    metrics.received(Lane::Blob, request.len());
    let offer = match request[REQUEST - 1] {
        ON_STREAM => None,
        DIRECT => {
            let mut offer = [0u8; TICKET + KEY];
            stream.read_exact(&mut offer).await?;
            metrics.received(Lane::Blob, offer.len());
            let mut o = Offer {
                ticket: [0; TICKET],
                key: [0; KEY],
            };
            o.ticket.copy_from_slice(&offer[..TICKET]);
            o.key.copy_from_slice(&offer[TICKET..]);
            Some(o)
        }
        other => return Err(std::io::Error::other(format!("unknown route {other}"))),
    };
    let mut id = [0u8; 32];
    id.copy_from_slice(&request[..32]);
    let id = BlobId(id);
    let word = |at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&request[at..at + 8]);
        u64::from_le_bytes(w)
    };
    let (offset, wanted) = (word(32), word(40));
    let Some(total) = blobs.size(&id) else {
        stream.write_all(&[NOT_FOUND]).await?;
        return stream.close().await;
    };
    let end = offset.saturating_add(wanted).min(total);
    let mut at = offset.min(total);
    let mut header = vec![OK];
    header.extend_from_slice(&total.to_le_bytes());
    let port = match (offer, &direct) {
        (Some(offer), Some(holder)) if end - at >= DIRECT_MIN => holder.issue(&offer, id, at, end),
        _ => None,
    };
    if let Some(port) = port {
        header.push(DIRECT);
        header.extend_from_slice(&port.to_le_bytes());
        stream.write_all(&header).await?;
        metrics.sent(Lane::Blob, header.len());
        return stream.close().await;
    }
    header.push(ON_STREAM);
    stream.write_all(&header).await?;
    metrics.sent(Lane::Blob, header.len());
    while at < end {
        let len = PIECE.min(end - at);
        let store = blobs.clone();
        let read = tokio::task::spawn_blocking(move || store.read_range(&id, at, len))
            .await
            .map_err(std::io::Error::other)?;
        let data = match read {
            Ok(Some((_, data))) if data.len() as u64 == len => data,
            // Gone or cut short meanwhile: the puller sees the stream end early.
            Ok(_) => {
                return Err(std::io::Error::other(format!(
                    "blob {id} changed while served"
                )))
            }
            Err(e) => {
                // Nothing of the range was sent yet only on the first piece; after
                // that, ending the stream early is the only way to say it.
                return Err(std::io::Error::other(e.to_string()));
            }
        };
        stream.write_all(&data).await?;
        metrics.sent(Lane::Blob, data.len());
        at += len;
    }
    stream.close().await
}

/// Pulls blob `id` from `from`, handing each piece to `each(total, offset, bytes)` as
/// it arrives; refuses a blob announced larger than `limit`. With `direct`, asks for
/// the direct channel and falls back to the stream if the holder's port cannot be
/// reached. `Ok(false)` when the peer does not speak the lane.
pub(super) async fn pull(
    ask: &Ask<'_>,
    direct: Option<&Peers>,
    each: &mut impl FnMut(u64, u64, Vec<u8>) -> Result<()>,
) -> Result<bool> {
    let (from, id) = (ask.from, ask.id);
    let route = match direct.and_then(|peers| peers.ip(&from)) {
        Some(ip) => Some((ip, Offer::new()?)),
        None => None,
    };
    let offer = route.as_ref().map(|(_, offer)| offer);
    let (total, port) = match pull_on_stream(ask, offer, each).await? {
        Answered::NotSpoken => return Ok(false),
        Answered::Streamed => return Ok(true),
        Answered::Direct { total, port } => (total, port),
    };
    let Some((ip, offer)) = route else {
        return Err(unasked(from, id));
    };
    let addr = SocketAddr::new(ip, port);
    let mut pieces = |offset, bytes| each(total, offset, bytes);
    let how = blob_direct::How {
        timeout: ask.timeout,
        metrics: ask.metrics,
        open_ahead: ask.open_ahead,
        spare: ask.spare,
    };
    match blob_direct::pull(addr, &offer, (id, 0, total), &how, &mut pieces).await {
        Ok(()) => Ok(true),
        Err(blob_direct::Failed::Each(e)) => Err(e),
        Err(blob_direct::Failed::Broken(reason)) => Err(NodeError::Request {
            peer: from.to_string(),
            reason: format!("pulling blob {id} directly: {reason}"),
        }),
        Err(blob_direct::Failed::Unreached(reason)) => {
            tracing::debug!(peer = %from, %reason, "direct blob port unreachable; pulling on the lane");
            if let Some(peers) = direct {
                peers.unreachable(from);
            }
            match pull_on_stream(ask, None, each).await? {
                Answered::NotSpoken => Ok(false),
                Answered::Streamed => Ok(true),
                Answered::Direct { .. } => Err(unasked(from, id)),
            }
        }
    }
}

/// What one pull asks for and of whom.
pub(super) struct Ask<'a> {
    pub control: &'a Control,
    pub from: PeerId,
    pub id: BlobId,
    /// The largest blob taken (`--max-blob-bytes`).
    pub limit: u64,
    /// The longest wait for an answer or for the next bytes.
    pub timeout: Duration,
    /// Where the bytes are counted.
    pub metrics: &'a NetMetrics,
    /// Records opened ahead on a direct pull (`NetConfig::blob_open_ahead`).
    pub open_ahead: usize,
    /// Buffers a direct pull receives records into.
    pub spare: &'a super::blob_direct::Spare,
}

/// A holder answered with a direct port where none was asked for.
fn unasked(from: PeerId, id: BlobId) -> NodeError {
    NodeError::Request {
        peer: from.to_string(),
        reason: format!("pulling blob {id}: a direct port offered though none was asked for"),
    }
}

/// What a pull on the stream came to.
enum Answered {
    /// The peer does not speak the lane.
    NotSpoken,
    /// Every byte came on the stream.
    Streamed,
    /// The holder gave the port of its direct channel for the `total`-byte blob.
    Direct { total: u64, port: u16 },
}

/// One request on a fresh stream: the whole blob on it, or (with `offer`) the
/// holder's direct port.
async fn pull_on_stream(
    ask: &Ask<'_>,
    offer: Option<&Offer>,
    each: &mut impl FnMut(u64, u64, Vec<u8>) -> Result<()>,
) -> Result<Answered> {
    let Ask {
        control,
        from,
        id,
        limit,
        timeout,
        metrics,
        ..
    } = *ask;
    let peer = from.to_string();
    let failed = |reason: String| NodeError::Request {
        peer: peer.clone(),
        reason,
    };
    // Nothing was asked: no connection, and none could be made.
    let unreached = |reason: String| NodeError::Unreached {
        peer: peer.clone(),
        reason,
    };
    let io = |e: std::io::Error| failed(format!("pulling blob {id}: {e}"));
    let within = |what: &'static str| {
        move |_| failed(format!("pulling blob {id}: no {what} within {timeout:?}"))
    };
    let mut request = Vec::with_capacity(REQUEST + TICKET + KEY);
    request.extend_from_slice(&id.0);
    request.extend_from_slice(&0u64.to_le_bytes());
    request.extend_from_slice(&u64::MAX.to_le_bytes());
    match offer {
        Some(offer) => {
            request.push(DIRECT);
            request.extend_from_slice(&offer.ticket);
            request.extend_from_slice(&offer.key);
        }
        None => request.push(ON_STREAM),
    }
    let mut control = control.clone();
    let mut tries = 0;
    let (mut stream, status) = loop {
        tries += 1;
        let mut stream =
            match tokio::time::timeout(timeout, control.open_stream(from, BLOB_PROTOCOL)).await {
                Ok(Ok(s)) => s,
                Ok(Err(libp2p_stream::OpenStreamError::UnsupportedProtocol(_))) => {
                    return Ok(Answered::NotSpoken)
                }
                Ok(Err(e)) => return Err(unreached(format!("opening a blob stream: {e}"))),
                Err(_) => {
                    return Err(unreached(format!(
                        "opening a blob stream took over {timeout:?}"
                    )))
                }
            };
        let asked = async {
            stream.write_all(&request).await?;
            stream.flush().await?;
            metrics.sent(Lane::Blob, request.len());
            let mut status = [0u8; 1];
            stream.read_exact(&mut status).await?;
            Ok::<_, std::io::Error>(status[0])
        };
        match tokio::time::timeout(timeout, asked).await {
            Ok(Ok(status)) => break (stream, status),
            // libp2p drops a new stream the holder's queue of them has no room for
            // (many pulls at once): nothing was read there, so ask again on another.
            Ok(Err(e)) if tries < OPEN_TRIES => {
                tracing::debug!(%from, %id, "blob stream dropped before the answer: {e}");
                let pause = REOPEN_PAUSE * (1 << (tries - 1).min(2));
                let jitter = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.subsec_nanos())
                    % pause.as_nanos().max(1) as u32;
                tokio::time::sleep(pause + Duration::from_nanos(u64::from(jitter))).await;
            }
            Ok(Err(e)) => return Err(io(e)),
            Err(e) => return Err(within("answer")(e)),
        }
    };
    match status {
        OK => {}
        NOT_FOUND => return Err(NodeError::BlobNotFound { id, peer }),
        ERROR => {
            let mut len = [0u8; 4];
            stream.read_exact(&mut len).await.map_err(io)?;
            let len = u32::from_le_bytes(len).min(MAX_MESSAGE);
            let mut text = vec![0u8; len as usize];
            stream.read_exact(&mut text).await.map_err(io)?;
            return Err(NodeError::PeerRefused {
                peer,
                reason: String::from_utf8_lossy(&text).into_owned(),
            });
        }
        other => return Err(failed(format!("unknown blob answer {other}"))),
    }
    let mut header = [0u8; 9];
    stream.read_exact(&mut header).await.map_err(io)?;
    let mut total = [0u8; 8];
    total.copy_from_slice(&header[..8]);
    let total = u64::from_le_bytes(total);
    metrics.received(Lane::Blob, 10);
    within_limit(total, limit)?;
    match header[8] {
        ON_STREAM => {}
        DIRECT if offer.is_some() => {
            let mut port = [0u8; 2];
            stream.read_exact(&mut port).await.map_err(io)?;
            metrics.received(Lane::Blob, 2);
            return Ok(Answered::Direct {
                total,
                port: u16::from_le_bytes(port),
            });
        }
        other => return Err(failed(format!("unknown blob route {other}"))),
    }
    if total == 0 {
        each(0, 0, Vec::new())?; // an empty blob is a blob too
    }
    let mut at = 0;
    while at < total {
        let mut piece = vec![0u8; PIECE.min(total - at) as usize];
        tokio::time::timeout(timeout, stream.read_exact(&mut piece))
            .await
            .map_err(within("bytes"))?
            .map_err(io)?;
        let len = piece.len() as u64;
        metrics.received(Lane::Blob, piece.len());
        each(total, at, piece)?;
        at += len;
    }
    Ok(Answered::Streamed)
}

/// A stream whose every read and write must make progress within [`STALL`]: a
/// puller that stops reading, or never sends its request, does not hold the holder's
/// task for ever.
struct Stalling(Stream);

impl Stalling {
    async fn within<T>(
        what: &str,
        f: impl std::future::Future<Output = std::io::Result<T>>,
    ) -> std::io::Result<T> {
        tokio::time::timeout(STALL, f).await.map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the puller stalled {what} for {STALL:?}"),
            )
        })?
    }

    async fn read_exact(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        Self::within("its request", self.0.read_exact(buf)).await
    }

    async fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        Self::within("reading", self.0.write_all(buf)).await
    }

    async fn close(&mut self) -> std::io::Result<()> {
        Self::within("closing", self.0.close()).await
    }
}

/// Refuses a blob a peer announces as larger than this node keeps (`limit`, its
/// `--max-blob-bytes`), before any of it is received.
pub(super) fn within_limit(total: u64, limit: u64) -> Result<()> {
    if total > limit {
        return Err(NodeError::Limit {
            what: "blob size in bytes (as announced by the peer)",
            value: total,
            limit,
            setting: "--max-blob-bytes",
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use libp2p::identity::Keypair;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::sync::mpsc;

    use super::*;
    use crate::net::blob_direct::{nonce, sealing_key, RECORD, TAG};
    use crate::net::{NetConfig, NetHandle};

    /// How a test node moves blobs.
    #[derive(Clone, Copy, PartialEq)]
    enum Route {
        Chunks,
        Stream,
        Direct,
    }

    async fn node(
        dir: &std::path::Path,
        route: Route,
    ) -> (NetHandle, NetMetrics, CancellationToken) {
        let mut config = NetConfig::new(Keypair::generate_ed25519());
        config.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
        config.mdns = false;
        config.blob_lane = route != Route::Chunks;
        config.blob_direct = route == Route::Direct;
        let metrics = config.metrics.clone();
        let (events, _) = mpsc::channel(16);
        let cancel = CancellationToken::new();
        let store = BlobStore::open(dir, 64 << 20).unwrap();
        let (net, _) = NetHandle::start(config, store, events, cancel.clone())
            .await
            .unwrap();
        (net, metrics, cancel)
    }

    /// A holder with `data` stored and a puller connected to it, both with the
    /// direct channel.
    struct Pair {
        /// Kept so the holder's network runs until `stop`.
        _server: NetHandle,
        server_metrics: NetMetrics,
        client: NetHandle,
        peer: PeerId,
        id: BlobId,
        stops: [CancellationToken; 2],
        _dir: tempfile::TempDir,
    }

    impl Pair {
        async fn start(data: &[u8]) -> Pair {
            let dir = tempfile::tempdir().unwrap();
            let (server, server_metrics, stop_server) =
                node(&dir.path().join("s"), Route::Direct).await;
            let (client, _, stop_client) = node(&dir.path().join("c"), Route::Direct).await;
            let id = server.blobs.put(data).unwrap();
            let peer = client
                .dial(server.listen_addrs().await.unwrap().remove(0))
                .await
                .unwrap();
            Pair {
                _server: server,
                server_metrics,
                client,
                peer,
                id,
                stops: [stop_server, stop_client],
                _dir: dir,
            }
        }

        fn stop(&self) {
            for stop in &self.stops {
                stop.cancel();
            }
        }
    }

    fn bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed;
        (0..len)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 33) as u8
            })
            .collect()
    }

    /// A request for bytes `offset..offset + len` of `id` on the stream.
    fn request(id: &[u8], offset: u64, len: u64) -> Vec<u8> {
        let mut r = id.to_vec();
        r.extend_from_slice(&offset.to_le_bytes());
        r.extend_from_slice(&len.to_le_bytes());
        r.push(ON_STREAM);
        r
    }

    /// Sends `request` on a fresh blob stream to `to` and reads the answer to its end.
    async fn raw(net: &NetHandle, to: PeerId, request: &[u8]) -> Vec<u8> {
        let mut control = net.streams.clone().unwrap();
        let mut stream = control.open_stream(to, BLOB_PROTOCOL).await.unwrap();
        futures::AsyncWriteExt::write_all(&mut stream, request)
            .await
            .unwrap();
        futures::AsyncWriteExt::close(&mut stream).await.unwrap();
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(
            Duration::from_secs(10),
            futures::AsyncReadExt::read_to_end(&mut stream, &mut answer),
        )
        .await
        .unwrap();
        answer
    }

    /// Connects to the holder's direct port, sends `ticket` and reads to the end.
    async fn direct_raw(port: u16, ticket: &[u8]) -> Vec<u8> {
        let mut socket = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        socket.write_all(ticket).await.unwrap();
        socket.shutdown().await.unwrap();
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), socket.read_to_end(&mut answer))
            .await
            .unwrap();
        answer
    }

    /// Asks `net`'s peer `to` for `id` with a direct offer; the port it answers with.
    async fn ask_direct(net: &NetHandle, to: PeerId, id: BlobId, offer: &Offer) -> u16 {
        let mut ask = request(&id.0, 0, u64::MAX);
        *ask.last_mut().unwrap() = DIRECT;
        ask.extend_from_slice(&offer.ticket);
        ask.extend_from_slice(&offer.key);
        let answer = raw(net, to, &ask).await;
        assert_eq!(answer.len(), 12, "{answer:?}");
        assert_eq!((answer[0], answer[9]), (OK, DIRECT));
        u16::from_le_bytes([answer[10], answer[11]])
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_blob_moves_whole_on_every_route_and_a_peer_without_the_lane_gets_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let (server, server_metrics, stop_server) =
            node(&dir.path().join("s"), Route::Direct).await;
        let (client, _, stop_client) = node(&dir.path().join("c"), Route::Direct).await;
        let data = bytes(3 * PIECE as usize + 12_345, 7);
        let id = server.blobs.put(&data).unwrap();
        let empty = server.blobs.put(b"").unwrap();
        let addr = server.listen_addrs().await.unwrap().remove(0);
        let peer = client.dial(addr.clone()).await.unwrap();

        // Direct: every record carries its tag, which the stream never sends.
        assert!(
            client.pull_blob(peer, id).await.unwrap() == data,
            "bytes differ"
        );
        // Counted once each record's write returns, which may be just after the
        // puller has read it all.
        let records = data.len().div_ceil(RECORD as usize);
        let carried = (data.len() + records * TAG) as u64;
        let counted = std::time::Instant::now() + Duration::from_secs(5);
        let mut sent = server_metrics.totals(Lane::Blob).0;
        while sent < carried && std::time::Instant::now() < counted {
            tokio::time::sleep(Duration::from_millis(10)).await;
            sent = server_metrics.totals(Lane::Blob).0;
        }
        assert!(
            sent >= carried,
            "the direct channel carried {sent} bytes of a {}-byte blob in {records} records",
            data.len()
        );
        // Less than DIRECT_MIN: on the stream, though the direct channel was offered.
        let small = server.blobs.put(&bytes(100_000, 4)).unwrap();
        let before = server_metrics.totals(Lane::Blob).0;
        client.fetch_blob(peer, small).await.unwrap();
        assert_eq!(server_metrics.totals(Lane::Blob).0 - before, 100_000 + 10);
        client.fetch_blob(peer, empty).await.unwrap();
        assert_eq!(client.blobs.get(&empty).unwrap().unwrap(), b"");
        let unknown = BlobId::of(b"nobody has this");
        let err = client.fetch_blob(peer, unknown).await.unwrap_err();
        assert!(matches!(err, NodeError::BlobNotFound { .. }), "{err:?}");

        // A puller without the direct channel: on the stream, exactly the bytes.
        let (streamer, _, stop_streamer) = node(&dir.path().join("l"), Route::Stream).await;
        let from = streamer.dial(addr.clone()).await.unwrap();
        let before = server_metrics.totals(Lane::Blob).0;
        streamer.fetch_blob(from, id).await.unwrap();
        assert!(streamer.blobs.get(&id).unwrap().unwrap() == data);
        let streamed = server_metrics.totals(Lane::Blob).0 - before;
        assert_eq!(streamed, data.len() as u64 + 10, "header and bytes only");

        // A client without the lane (and so a server it asks in chunks).
        let (old, _, stop_old) = node(&dir.path().join("o"), Route::Chunks).await;
        let peer = old.dial(addr).await.unwrap();
        old.fetch_blob(peer, id).await.unwrap();
        assert!(old.blobs.get(&id).unwrap().unwrap() == data, "bytes differ");
        // And the other way: a lane client pulling from a server without it.
        let old_addr = old.listen_addrs().await.unwrap().remove(0);
        let from_old = client.dial(old_addr).await.unwrap();
        let other = old.blobs.put(&bytes(100_000, 9)).unwrap();
        client.fetch_blob(from_old, other).await.unwrap();
        assert!(client.blobs.has(&other));
        for stop in [stop_server, stop_client, stop_streamer, stop_old] {
            stop.cancel();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_direct_port_out_of_reach_falls_back_to_the_stream() {
        let data = bytes(2 * PIECE as usize + 1, 5);
        let pair = Pair::start(&data).await;
        let (client, peer, id) = (&pair.client, pair.peer, pair.id);
        let server_metrics = &pair.server_metrics;
        // As if the server were reached at an address its direct listener is not on
        // (the listener is on 127.0.0.1 only): the connect is refused.
        let peers = client.direct.clone().unwrap();
        peers.connected(peer, &"/ip4/127.0.0.2/tcp/1".parse().unwrap());
        client.fetch_blob(peer, id).await.unwrap();
        assert!(
            client.blobs.get(&id).unwrap().unwrap() == data,
            "bytes differ"
        );
        assert_eq!(peers.ip(&peer), None, "not tried directly again");
        // The next pull goes on the stream at once: header and bytes only.
        let before = server_metrics.totals(Lane::Blob).0;
        assert!(client.pull_blob(peer, id).await.unwrap() == data);
        assert_eq!(
            server_metrics.totals(Lane::Blob).0 - before,
            data.len() as u64 + 10
        );
        pair.stop();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_ticket_opens_its_range_once_and_garbage_on_the_direct_port_gets_nothing() {
        let data = bytes(RECORD as usize + 777, 11);
        let pair = Pair::start(&data).await;
        let (client, peer, id) = (&pair.client, pair.peer, pair.id);
        let server_metrics = &pair.server_metrics;

        // The records: each piece sealed under the offer's key, numbered from 0,
        // the blob id as associated data.
        let offer = Offer::new().unwrap();
        let port = ask_direct(client, peer, id, &offer).await;
        let sealed = direct_raw(port, &offer.ticket).await;
        assert_eq!(sealed.len(), data.len() + 2 * TAG);
        let key = sealing_key(&offer.key);
        let mut first = sealed[..RECORD as usize + TAG].to_vec();
        let mut second = sealed[RECORD as usize + TAG..].to_vec();
        let opened = key
            .open_in_place(nonce(0), ring::aead::Aad::from(id.0), &mut first)
            .unwrap()
            .to_vec();
        assert!(opened == data[..RECORD as usize], "first record");
        let opened = key
            .open_in_place(nonce(1), ring::aead::Aad::from(id.0), &mut second)
            .unwrap();
        assert_eq!(opened, &data[RECORD as usize..]);
        // Under another key, or as another record, nothing opens.
        let mut again = sealed[..RECORD as usize + TAG].to_vec();
        let other = sealing_key(&Offer::new().unwrap().key);
        assert!(other
            .open_in_place(nonce(0), ring::aead::Aad::from(id.0), &mut again)
            .is_err());
        let mut again = sealed[RECORD as usize + TAG..].to_vec();
        assert!(key
            .open_in_place(nonce(0), ring::aead::Aad::from(id.0), &mut again)
            .is_err());

        // The ticket is spent; a made-up one, one cut short and none open nothing.
        assert!(direct_raw(port, &offer.ticket).await.is_empty());
        assert!(direct_raw(port, &[7u8; TICKET]).await.is_empty());
        let fresh = Offer::new().unwrap();
        let port = ask_direct(client, peer, id, &fresh).await;
        assert!(direct_raw(port, &fresh.ticket[..5]).await.is_empty());
        assert!(direct_raw(port, &[]).await.is_empty());
        // An unknown blob with an offer: NOT_FOUND, no port.
        let mut unknown = request(&[9u8; 32], 0, u64::MAX);
        *unknown.last_mut().unwrap() = DIRECT;
        unknown.extend_from_slice(&fresh.ticket);
        unknown.extend_from_slice(&fresh.key);
        assert_eq!(raw(client, peer, &unknown).await, vec![NOT_FOUND]);
        // An offer cut short, an unknown route: nothing.
        let mut short = request(&id.0, 0, u64::MAX);
        *short.last_mut().unwrap() = DIRECT;
        short.extend_from_slice(&[1, 2, 3]);
        assert!(raw(client, peer, &short).await.is_empty());
        let mut odd = request(&id.0, 0, u64::MAX);
        *odd.last_mut().unwrap() = 9;
        assert!(raw(client, peer, &odd).await.is_empty());

        // Connections that never send a ticket fill the holder's room; one more is
        // closed at once. Once they go, it serves on, directly.
        let mut idle = Vec::new();
        for _ in 0..blob_direct::MAX_CONNECTIONS {
            idle.push(
                tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .unwrap(),
            );
        }
        let mut extra = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let mut nothing = Vec::new();
        tokio::time::timeout(Duration::from_secs(4), extra.read_to_end(&mut nothing))
            .await
            .expect("the connection over the cap is closed before the ticket wait")
            .unwrap();
        assert!(nothing.is_empty());
        drop(idle);
        // The holder sees them end (EOF before a ticket) and frees their room.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (sent, _) = server_metrics.totals(Lane::Blob);
        assert!(client.pull_blob(peer, id).await.unwrap() == data);
        assert!(server_metrics.totals(Lane::Blob).0 - sent > (data.len() + TAG) as u64);
        pair.stop();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn garbage_on_a_blob_stream_gets_no_bytes_and_the_holder_serves_on() {
        let data = bytes(100_000, 3);
        let pair = Pair::start(&data).await;
        let (client, peer, id) = (&pair.client, pair.peer, pair.id);
        // A request cut short, then an empty one: the stream ends, nothing sent.
        assert!(raw(client, peer, &[1, 2, 3]).await.is_empty());
        assert!(raw(client, peer, &[]).await.is_empty());
        // An unknown blob: NOT_FOUND and nothing else.
        let unknown = request(&[9u8; 32], 0, u64::MAX);
        assert_eq!(raw(client, peer, &unknown).await, vec![NOT_FOUND]);
        // An offset past the end: the size, the route, and no bytes.
        let past = request(&id.0, u64::MAX, u64::MAX);
        let answer = raw(client, peer, &past).await;
        assert_eq!(answer[0], OK);
        assert_eq!(answer[1..9], (data.len() as u64).to_le_bytes());
        assert_eq!(answer[9..], [ON_STREAM]);
        // A range in the middle: exactly those bytes.
        let middle = request(&id.0, 1000, 10);
        let answer = raw(client, peer, &middle).await;
        assert_eq!(answer[10..], data[1000..1010]);
        // The holder still serves a whole blob.
        assert!(client.pull_blob(peer, id).await.unwrap() == data);
        pair.stop();
    }
}
