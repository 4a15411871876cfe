//! Pulling a blob from a peer: chunks requested a window at a time and assembled.

use futures::stream::{FuturesUnordered, StreamExt};
use gpumesh_protocol::{BlobId, MeshRequest, MeshResponse};
use libp2p::PeerId;

use crate::error::{NodeError, Result};

use super::NetHandle;

impl NetHandle {
    /// Pulls blob `id` from peer `from` into the blob store, checking it against its
    /// id. A no-op if the blob is already here. Each chunk is written and hashed off
    /// the async runtime as it arrives (on two threads, see [`write_all`]), while
    /// the next ones are on their way; the blob is fsync'd once, at the end.
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
                    let spare = self.received.clone();
                    writer = Some(tokio::task::spawn_blocking(move || {
                        write_all(incoming, rx, move |done| spare.give(done))
                    }));
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
            self.received.give(data);
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
                open_ahead: self.open_ahead,
                spare: &self.received,
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
/// finishes the blob. A blob with a file of its own is written on this thread and
/// hashed on a second one, so a piece is hashed while the next is written (either
/// pass alone takes about as long as the network brings the bytes); a packed one,
/// a few hundred KiB at most, on this thread alone. Each piece's buffer, once
/// written and hashed, goes to `spent`.
fn write_all(
    mut incoming: crate::blobs::store::Incoming,
    rx: std::sync::mpsc::Receiver<(u64, Vec<u8>)>,
    mut spent: impl FnMut(Vec<u8>) + Send,
) -> Result<()> {
    let Some(mut writer) = incoming.file_writer() else {
        for (offset, data) in rx {
            incoming.write_at(offset, data)?;
        }
        return incoming.finish();
    };
    let (to_hash, written) = std::sync::mpsc::channel::<(u64, Vec<u8>)>();
    let (wrote, hashed) = std::thread::scope(|scope| {
        let hashing = scope.spawn(move || {
            for (offset, data) in written {
                incoming.written_at(offset, data, &mut spent)?;
            }
            Ok(incoming)
        });
        let wrote = (|| -> Result<()> {
            for (offset, data) in rx {
                writer.write_at(offset, &data)?;
                if to_hash.send((offset, data)).is_err() {
                    break; // the hashing thread's error says why
                }
            }
            Ok(())
        })();
        drop(to_hash);
        let hashed = hashing.join().unwrap_or_else(|_| {
            Err(NodeError::NetSetup(
                "the blob's hashing thread panicked".into(),
            ))
        });
        (wrote, hashed)
    });
    // A write that failed leaves the blob unfinished (and its file removed) even
    // if every byte was hashed.
    wrote?;
    hashed?.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blobs::store::{BlobStore, PACK_MAX};

    /// Sends `pieces` to `write_all` for blob `id` of `total` bytes, as a pull does.
    fn write(store: &BlobStore, id: BlobId, total: u64, pieces: Vec<(u64, Vec<u8>)>) -> Result<()> {
        let incoming = store.incoming(id, total)?;
        let (tx, rx) = std::sync::mpsc::channel();
        for piece in pieces {
            tx.send(piece).unwrap();
        }
        drop(tx);
        write_all(incoming, rx, drop)
    }

    #[test]
    fn a_pulled_blob_written_and_hashed_on_two_threads_is_kept_only_if_whole_and_right() {
        let dir = tempfile::tempdir().unwrap();
        let total = 3 * PACK_MAX as usize + 777; // a file of its own: two threads
        let store = BlobStore::open(dir.path(), total as u64).unwrap();
        let bytes: Vec<u8> = (0..total).map(|i| (i * 13 % 241) as u8).collect();
        let id = BlobId::of(&bytes);
        let piece = 100_000;
        let pieces = |order: &mut dyn Iterator<Item = usize>| -> Vec<(u64, Vec<u8>)> {
            order
                .map(|at| (at as u64, bytes[at..(at + piece).min(total)].to_vec()))
                .collect()
        };
        let starts: Vec<usize> = (0..total).step_by(piece).collect();
        let leftovers = || {
            std::fs::read_dir(dir.path())
                .unwrap()
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
                .count()
        };

        // A byte changed: refused, nothing kept, no temporary file left.
        let mut wrong = pieces(&mut starts.iter().copied());
        wrong[2].1[5] ^= 0x40;
        let err = write(&store, id, total as u64, wrong).unwrap_err();
        assert!(matches!(err, NodeError::BlobMismatch { .. }), "{err}");
        // A piece missing: refused.
        let short = pieces(&mut starts.iter().copied().skip(1));
        assert!(write(&store, id, total as u64, short).is_err());
        // A piece past the end: refused by the writer before it is written.
        let mut past = pieces(&mut starts.iter().copied());
        past.push((total as u64 - 10, vec![0; 20]));
        assert!(write(&store, id, total as u64, past).is_err());
        assert!(!store.has(&id));
        assert_eq!(leftovers(), 0);

        // Whole, in reverse order: kept, read back as sent.
        write(
            &store,
            id,
            total as u64,
            pieces(&mut starts.iter().rev().copied()),
        )
        .unwrap();
        assert_eq!(store.get(&id).unwrap().unwrap(), bytes);
        assert_eq!(leftovers(), 0);

        // A packed blob (one thread) too.
        let small = bytes[..1000].to_vec();
        let small_id = BlobId::of(&small);
        write(
            &store,
            small_id,
            1000,
            vec![(500, small[500..].to_vec()), (0, small[..500].to_vec())],
        )
        .unwrap();
        assert_eq!(store.get(&small_id).unwrap().unwrap(), small);
    }
}
