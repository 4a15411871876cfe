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
//! little-endian each). Answer: `OK` and the blob's total size (u64), then the
//! bytes from the offset to the end of the range; or `NOT_FOUND`; or `ERROR` and a
//! message (u32 length, UTF-8).

use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt};
use gpumesh_protocol::BlobId;
use libp2p::{PeerId, Stream, StreamProtocol};
use libp2p_stream::{Control, IncomingStreams};
use tokio_util::sync::CancellationToken;

use crate::blobs::store::BlobStore;
use crate::error::{NodeError, Result};
use crate::metrics::{Lane, NetMetrics};

pub const BLOB_PROTOCOL: StreamProtocol = StreamProtocol::new("/gpumesh/blob/1");

const OK: u8 = 0;
const NOT_FOUND: u8 = 1;
const ERROR: u8 = 2;

/// Bytes read from the file (and handed to the puller) at a time.
pub(super) const PIECE: u64 = 1 << 20;

/// The longest error message a holder sends.
const MAX_MESSAGE: u32 = 4096;

/// How long a holder waits for a request, or for the puller to take the next piece,
/// before it drops the stream.
const STALL: Duration = Duration::from_secs(30);

/// Serves pulls of this node's blobs until `cancel` fires.
/// Bytes count in the `blob` lane of `metrics` as they are written or read.
pub(super) fn serve(
    control: &mut Control,
    blobs: BlobStore,
    metrics: NetMetrics,
    cancel: CancellationToken,
) -> Result<()> {
    let incoming = control
        .accept(BLOB_PROTOCOL)
        .map_err(|e| NodeError::NetSetup(format!("blob protocol: {e}")))?;
    tokio::spawn(accept(incoming, blobs, metrics, cancel));
    Ok(())
}

async fn accept(
    mut incoming: IncomingStreams,
    blobs: BlobStore,
    metrics: NetMetrics,
    cancel: CancellationToken,
) {
    loop {
        let Some((peer, stream)) = super::next_stream(&mut incoming, &cancel).await else {
            return;
        };
        let (blobs, metrics, cancel) = (blobs.clone(), metrics.clone(), cancel.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                served = answer(stream, blobs, metrics) => if let Err(e) = served {
                    tracing::debug!(%peer, error = %e, "a blob pull ended early");
                }
            }
        });
    }
}

/// Answers one pull: the range asked for, a piece at a time.
async fn answer(stream: Stream, blobs: BlobStore, metrics: NetMetrics) -> std::io::Result<()> {
    let mut stream = Stalling(stream);
    let mut request = [0u8; 48];
    stream.read_exact(&mut request).await?;
    metrics.received(Lane::Blob, request.len());
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

/// Pulls bytes `offset..` of blob `id` from `from` on one stream, handing each piece
/// to `each(total, offset, bytes)` as it arrives; refuses a blob announced larger
/// than `limit`. `Ok(false)` when the peer does not speak the lane.
pub(super) async fn pull(
    control: &Control,
    from: PeerId,
    id: BlobId,
    limit: u64,
    timeout: Duration,
    metrics: &NetMetrics,
    each: &mut impl FnMut(u64, u64, Vec<u8>) -> Result<()>,
) -> Result<bool> {
    let peer = from.to_string();
    let failed = |reason: String| NodeError::Request {
        peer: peer.clone(),
        reason,
    };
    let mut control = control.clone();
    let mut stream =
        match tokio::time::timeout(timeout, control.open_stream(from, BLOB_PROTOCOL)).await {
            Ok(Ok(s)) => s,
            Ok(Err(libp2p_stream::OpenStreamError::UnsupportedProtocol(_))) => return Ok(false),
            Ok(Err(e)) => return Err(failed(format!("opening a blob stream: {e}"))),
            Err(_) => return Err(failed("opening a blob stream timed out".into())),
        };
    let io = |e: std::io::Error| failed(format!("pulling blob {id}: {e}"));
    let within = |what: &'static str| {
        move |_| failed(format!("pulling blob {id}: no {what} within {timeout:?}"))
    };
    let mut request = Vec::with_capacity(48);
    request.extend_from_slice(&id.0);
    request.extend_from_slice(&0u64.to_le_bytes());
    request.extend_from_slice(&u64::MAX.to_le_bytes());
    stream.write_all(&request).await.map_err(io)?;
    stream.flush().await.map_err(io)?;
    metrics.sent(Lane::Blob, request.len());
    let mut status = [0u8; 1];
    tokio::time::timeout(timeout, stream.read_exact(&mut status))
        .await
        .map_err(within("answer"))?
        .map_err(io)?;
    match status[0] {
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
    let mut total = [0u8; 8];
    stream.read_exact(&mut total).await.map_err(io)?;
    let total = u64::from_le_bytes(total);
    metrics.received(Lane::Blob, 9);
    within_limit(total, limit)?;
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
    Ok(true)
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
    use tokio::sync::mpsc;

    use super::*;
    use crate::net::{NetConfig, NetHandle};

    async fn node(dir: &std::path::Path, lane: bool) -> (NetHandle, NetMetrics, CancellationToken) {
        let mut config = NetConfig::new(Keypair::generate_ed25519());
        config.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
        config.mdns = false;
        config.blob_lane = lane;
        let metrics = config.metrics.clone();
        let (events, _) = mpsc::channel(16);
        let cancel = CancellationToken::new();
        let store = BlobStore::open(dir, 64 << 20).unwrap();
        let (net, _) = NetHandle::start(config, store, events, cancel.clone())
            .await
            .unwrap();
        (net, metrics, cancel)
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

    /// Sends `request` on a fresh blob stream to `to` and reads the answer to its end.
    async fn raw(net: &NetHandle, to: PeerId, request: &[u8]) -> Vec<u8> {
        let mut control = net.streams.clone().unwrap();
        let mut stream = control.open_stream(to, BLOB_PROTOCOL).await.unwrap();
        stream.write_all(request).await.unwrap();
        stream.close().await.unwrap();
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
            .await
            .unwrap();
        answer
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_blob_streams_whole_on_the_lane_and_a_peer_without_it_gets_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let (server, server_metrics, stop_server) = node(&dir.path().join("s"), true).await;
        let (client, _, stop_client) = node(&dir.path().join("c"), true).await;
        let data = bytes(3 * PIECE as usize + 12_345, 7);
        let id = server.blobs.put(&data).unwrap();
        let empty = server.blobs.put(b"").unwrap();
        let addr = server.listen_addrs().await.unwrap().remove(0);
        let peer = client.dial(addr.clone()).await.unwrap();

        assert!(
            client.pull_blob(peer, id).await.unwrap() == data,
            "bytes differ"
        );
        let (sent, _) = server_metrics.totals(Lane::Blob);
        assert!(
            sent >= data.len() as u64,
            "the lane carried {sent} bytes of a {}-byte blob",
            data.len()
        );
        client.fetch_blob(peer, empty).await.unwrap();
        assert_eq!(client.blobs.get(&empty).unwrap().unwrap(), b"");
        let unknown = BlobId::of(b"nobody has this");
        let err = client.fetch_blob(peer, unknown).await.unwrap_err();
        assert!(matches!(err, NodeError::BlobNotFound { .. }), "{err:?}");

        // A client without the lane (and so a server it asks in chunks).
        let (old, _, stop_old) = node(&dir.path().join("o"), false).await;
        let peer = old.dial(addr).await.unwrap();
        old.fetch_blob(peer, id).await.unwrap();
        assert!(old.blobs.get(&id).unwrap().unwrap() == data, "bytes differ");
        // And the other way: a lane client pulling from a server without it.
        let old_addr = old.listen_addrs().await.unwrap().remove(0);
        let from_old = client.dial(old_addr).await.unwrap();
        let other = old.blobs.put(&bytes(100_000, 9)).unwrap();
        client.fetch_blob(from_old, other).await.unwrap();
        assert!(client.blobs.has(&other));
        for stop in [stop_server, stop_client, stop_old] {
            stop.cancel();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn garbage_on_a_blob_stream_gets_no_bytes_and_the_holder_serves_on() {
        let dir = tempfile::tempdir().unwrap();
        let (server, _, stop_server) = node(&dir.path().join("s"), true).await;
        let (client, _, stop_client) = node(&dir.path().join("c"), true).await;
        let data = bytes(100_000, 3);
        let id = server.blobs.put(&data).unwrap();
        let peer = client
            .dial(server.listen_addrs().await.unwrap().remove(0))
            .await
            .unwrap();
        // A request cut short, then an empty one: the stream ends, nothing sent.
        assert!(raw(&client, peer, &[1, 2, 3]).await.is_empty());
        assert!(raw(&client, peer, &[]).await.is_empty());
        // An unknown blob: NOT_FOUND and nothing else.
        let mut unknown = vec![9u8; 32];
        unknown.extend_from_slice(&0u64.to_le_bytes());
        unknown.extend_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(raw(&client, peer, &unknown).await, vec![NOT_FOUND]);
        // An offset past the end: the size, and no bytes.
        let mut past = id.0.to_vec();
        past.extend_from_slice(&u64::MAX.to_le_bytes());
        past.extend_from_slice(&u64::MAX.to_le_bytes());
        let answer = raw(&client, peer, &past).await;
        assert_eq!(answer[0], OK);
        assert_eq!(answer[1..], (data.len() as u64).to_le_bytes());
        // A range in the middle: exactly those bytes.
        let mut middle = id.0.to_vec();
        middle.extend_from_slice(&1000u64.to_le_bytes());
        middle.extend_from_slice(&10u64.to_le_bytes());
        let answer = raw(&client, peer, &middle).await;
        assert_eq!(answer[9..], data[1000..1010]);
        // The holder still serves a whole blob.
        assert!(client.pull_blob(peer, id).await.unwrap() == data);
        stop_server.cancel();
        stop_client.cancel();
    }
}
