//! Pulling a blob from a peer: chunks requested a window at a time and assembled.

use futures::stream::{FuturesUnordered, StreamExt};
use gpumesh_protocol::{BlobId, MeshRequest, MeshResponse};
use libp2p::PeerId;

use crate::error::{NodeError, Result};

use super::NetHandle;

impl NetHandle {
    /// Pulls blob `id` from peer `from` into the blob store, checking it against its
    /// id. A no-op if the blob is already here. Each chunk is written and hashed on
    /// the blocking pool as it arrives, while the next ones are on their way; the
    /// blob is fsync'd once, at the end.
    pub async fn fetch_blob(&self, from: PeerId, id: BlobId) -> Result<()> {
        if self.blobs.has(&id) {
            return Ok(());
        }
        let (tx, rx) = std::sync::mpsc::channel::<(u64, Vec<u8>)>();
        let mut rx = Some(rx);
        let mut writer = None;
        let mut writer_stopped = false;
        let blobs = self.blobs.clone();
        let pulled = self
            .pull_with(from, id, |total, offset, data| {
                if let Some(rx) = rx.take() {
                    let incoming = blobs.incoming(id, total)?;
                    writer = Some(tokio::task::spawn_blocking(move || write_all(incoming, rx)));
                }
                tx.send((offset, data)).map_err(|_| {
                    writer_stopped = true;
                    NodeError::NetSetup("the blob writer stopped".into())
                })
            })
            .await;
        drop(tx);
        let written = match writer {
            Some(w) => w
                .await
                .map_err(|e| NodeError::NetSetup(format!("blob store task failed: {e}")))?,
            None => Ok(()),
        };
        match (pulled, written) {
            (Ok(()), written) => written,
            // The writer's error (a full disk) says more than the closed channel
            // the pull then met; otherwise the pull's (the peer, the network) does
            // more than the incomplete blob the writer was left with.
            (Err(_), Err(w)) if writer_stopped => Err(w),
            (Err(p), _) => Err(p),
        }
    }

    /// The blob's bytes from `from`, assembled in memory. Not checked against `id`.
    pub(crate) async fn pull_blob(&self, from: PeerId, id: BlobId) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.pull_with(from, id, |total, offset, data| {
            if out.len() as u64 != total {
                out = vec![0u8; total as usize];
            }
            let start = offset as usize;
            out[start..start + data.len()].copy_from_slice(&data);
            Ok(())
        })
        .await?;
        Ok(out)
    }

    /// Pulls blob `id` from `from` and hands each piece to `each(total, offset,
    /// bytes)`: on the blob lane when both ends have it, else in chunks,
    /// `fetch_window` requests in flight so the link stays busy while each answer
    /// is on its way.
    async fn pull_with(
        &self,
        from: PeerId,
        id: BlobId,
        mut each: impl FnMut(u64, u64, Vec<u8>) -> Result<()>,
    ) -> Result<()> {
        let limit = self.blobs.max_blob_bytes();
        let timeout = self.request_timeout + self.dial_timeout;
        if let Some(streams) = &self.streams {
            let ask = super::blob_lane::Ask {
                control: streams,
                from,
                id,
                limit,
                timeout,
                metrics: &self.metrics,
            };
            if super::blob_lane::pull(&ask, self.direct.as_ref(), &mut each).await? {
                return Ok(());
            }
        }
        // A peer without the blob lane: chunks over request-response.
        let chunk = u64::from(self.chunk_bytes);
        let first = self.blob_chunk(from, id, 0, chunk).await?;
        let total = first.total;
        super::blob_lane::within_limit(total, limit)?;
        // Ranges to ask for again: a peer with a smaller frame limit than ours sends
        // less than asked, and the rest is fetched with further requests.
        let mut again = Vec::new();
        let (offset, data) = check(total, first, &mut again, from)?;
        each(total, offset, data)?;
        let mut next = chunk.min(total);
        let mut in_flight = FuturesUnordered::new();
        loop {
            while in_flight.len() < self.fetch_window {
                let (offset, len) = match again.pop() {
                    Some(range) => range,
                    None if next < total => {
                        let len = chunk.min(total - next);
                        next += len;
                        (next - len, len)
                    }
                    None => break,
                };
                in_flight.push(self.blob_chunk(from, id, offset, len));
            }
            let Some(piece) = in_flight.next().await else {
                break;
            };
            let (offset, data) = check(total, piece?, &mut again, from)?;
            each(total, offset, data)?;
        }
        Ok(())
    }

    async fn blob_chunk(&self, from: PeerId, id: BlobId, offset: u64, len: u64) -> Result<Piece> {
        let request = MeshRequest::BlobChunk {
            id,
            offset,
            len: len as u32,
        };
        let peer = from.to_string();
        match self.request(from, request).await? {
            MeshResponse::BlobChunk { total, data } => Ok(Piece {
                id,
                offset,
                asked: len,
                total,
                data,
            }),
            MeshResponse::NotFound => Err(NodeError::BlobNotFound { id, peer }),
            MeshResponse::Error(reason) => Err(NodeError::PeerRefused { peer, reason }),
            other => Err(NodeError::Request {
                peer,
                reason: format!("unexpected answer to a blob chunk request: {other:?}"),
            }),
        }
    }
}

/// One answered chunk request.
struct Piece {
    id: BlobId,
    offset: u64,
    asked: u64,
    total: u64,
    data: Vec<u8>,
}

/// Checks that a chunk fits what was asked of a `total`-byte blob and returns its
/// offset and bytes; a short (non-empty) chunk queues the rest in `again`.
fn check(
    total: u64,
    piece: Piece,
    again: &mut Vec<(u64, u64)>,
    from: PeerId,
) -> Result<(u64, Vec<u8>)> {
    let expect = piece.asked.min(total.saturating_sub(piece.offset));
    let got = piece.data.len() as u64;
    if piece.total != total || got > expect || (got == 0 && expect > 0) {
        return Err(NodeError::Request {
            peer: from.to_string(),
            reason: format!(
                "blob {}: chunk at {} has {got} bytes of a {}-byte blob, expected {expect} \
                 bytes of a {total}-byte blob (did the blob change?)",
                piece.id, piece.offset, piece.total
            ),
        });
    }
    if got < expect {
        again.push((piece.offset + got, expect - got));
    }
    Ok((piece.offset, piece.data))
}

/// Writes the pieces `rx` brings into `incoming` until the sender is gone, then
/// finishes the blob.
fn write_all(
    mut incoming: crate::blobs::store::Incoming,
    rx: std::sync::mpsc::Receiver<(u64, Vec<u8>)>,
) -> Result<()> {
    for (offset, data) in rx {
        incoming.write_at(offset, data)?;
    }
    incoming.finish()
}
