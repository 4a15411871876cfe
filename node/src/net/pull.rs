//! Pulling a blob from a peer: chunks requested a window at a time and assembled.

use futures::stream::{FuturesUnordered, StreamExt};
use gpumesh_protocol::{BlobId, MeshRequest, MeshResponse};
use libp2p::PeerId;

use crate::error::{NodeError, Result};

use super::NetHandle;

impl NetHandle {
    /// Pulls blob `id` from peer `from` into the blob store, checking it against its
    /// id. A no-op if the blob is already here.
    pub async fn fetch_blob(&self, from: PeerId, id: BlobId) -> Result<()> {
        if self.blobs.has(&id) {
            return Ok(());
        }
        let bytes = self.pull_blob(from, id).await?;
        let blobs = self.blobs.clone();
        tokio::task::spawn_blocking(move || blobs.put_verified(id, &bytes))
            .await
            .map_err(|e| NodeError::NetSetup(format!("blob store task failed: {e}")))?
    }

    /// The blob's bytes from `from`, assembled from chunks with `fetch_window`
    /// requests in flight, so the link stays busy while each answer is on its way. Not
    /// yet checked against `id`.
    pub(crate) async fn pull_blob(&self, from: PeerId, id: BlobId) -> Result<Vec<u8>> {
        let chunk = u64::from(self.chunk_bytes);
        let first = self.blob_chunk(from, id, 0, chunk).await?;
        let total = first.total;
        let limit = self.blobs.max_blob_bytes();
        if total > limit {
            return Err(NodeError::Limit {
                what: "blob size in bytes (as announced by the peer)",
                value: total,
                limit,
                setting: "--max-blob-bytes",
            });
        }
        let mut out = vec![0u8; total as usize];
        // Ranges to ask for again: a peer with a smaller frame limit than ours sends
        // less than asked, and the rest is fetched with further requests.
        let mut again = Vec::new();
        place(&mut out, first, &mut again, from)?;
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
            place(&mut out, piece?, &mut again, from)?;
        }
        Ok(out)
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

/// Copies a chunk into the blob being assembled after checking that it fits what was
/// asked; a short (non-empty) chunk queues the rest in `again`.
fn place(out: &mut [u8], piece: Piece, again: &mut Vec<(u64, u64)>, from: PeerId) -> Result<()> {
    let total = out.len() as u64;
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
    let start = piece.offset as usize;
    out[start..start + piece.data.len()].copy_from_slice(&piece.data);
    if got < expect {
        again.push((piece.offset + got, expect - got));
    }
    Ok(())
}
