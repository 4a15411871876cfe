//! The direct Raft channel: a peer's Raft frames on a TCP connection of their own,
//! sealed with AES-256-GCM, straight from the writer task to the reader task.
//!
//! Why: on the mesh's connection a frame crosses the writer task, the connection's
//! task (Yamux, Noise), the socket, the other side's connection task and the stream's
//! reader task; each is a task woken on another thread. Every commit of the mesh
//! waits for two such trips (the append to a follower, its answer), so on a small
//! machine they cost more than the write of the entry itself. Here a frame crosses
//! the writer task, the socket and the reader task.
//!
//! How it stays closed, as the direct blob channel does: nothing is agreed on the
//! connection. The writer sends, on its Raft stream (a libp2p stream: Noise with the
//! cluster key has authenticated both peers and encrypts it), a zero length and then
//! a fresh random ticket and key ([`ask`]). The reader keeps the ticket as one for
//! Raft frames from that peer and answers with the port of the node's direct
//! listener ([`super::blob_direct::Holder`]), or that it takes none. The writer
//! connects, sends the ticket, and from then on writes each batch of frames (as on
//! the stream: each behind its u32 length) as one record: the sealed batch's length
//! (u32), the batch sealed with the key, the record's number as the nonce, and its
//! 16-byte tag. A ticket works once; a record that does not open, or one out of
//! order, ends the connection; frames on it count as the peer's who sent the ticket.
//!
//! What falls back: a peer whose direct port cannot be reached, or whose connection
//! breaks or stalls, gets its frames on the stream again, and is offered the
//! channel again later. A peer cut off by fault injection ([`super::NetHandle::cut`])
//! gets nothing on either, and its connection is closed at both ends.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use libp2p::{PeerId, Stream};
use ring::aead::{Aad, LessSafeKey};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::blob_direct::{answer_offer, nonce, offer_channel, sealing_key, Holder, KEY, TAG};
use super::{NetEvent, RaftSink};
use crate::metrics::{Lane, NetMetrics};

/// A set of peers shared between tasks: those cut off by fault injection (the Raft
/// lane's writers and readers look), those written to directly (the writers keep it).
#[derive(Clone, Default)]
pub(super) struct PeerSet(Arc<Mutex<HashSet<PeerId>>>);

pub(super) type Cut = PeerSet;

impl PeerSet {
    pub(super) fn set(&self, peer: PeerId, member: bool) {
        let mut peers = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if member {
            peers.insert(peer);
        } else {
            peers.remove(&peer);
        }
    }

    pub(super) fn has(&self, peer: &PeerId) -> bool {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(peer)
    }

    pub(super) fn clear(&self) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    pub(super) fn all(&self) -> Vec<PeerId> {
        let peers = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        peers.iter().copied().collect()
    }
}

/// Associated data of every record: a record of another channel does not open here.
const AAD: &[u8] = b"gpumesh raft direct v1";
/// How long the writer waits for the answer to its offer, and for the port to
/// accept: on a LAN both take well under a millisecond, and the writer's frames wait
/// meanwhile, so a port that drops connections (a firewall) costs this much, once
/// a minute, far inside Raft's election timeout.
const ASK: Duration = Duration::from_millis(250);
/// How long one record may take to go into the socket before the channel is
/// given up for the stream (a peer that stopped reading, packets that vanish).
pub(super) const STALL: Duration = Duration::from_secs(2);
/// How long a reader waits for the next record before it takes the connection for
/// dead and closes it: twice as long as a writer with nothing to send keeps its
/// connection open (so a live one is always closed by its writer, and no frame is
/// written into a connection the reader has given up). A connection whose packets
/// vanish (a cut link) would otherwise keep its reader waiting for good.
const READ_IDLE: Duration = Duration::from_secs(2 * super::raft_lane::IDLE.as_secs());

/// Where a Raft frame read from a peer goes: the sink once the node set one, else
/// the node's events.
#[derive(Clone)]
pub(super) struct Deliver {
    pub events: mpsc::Sender<NetEvent>,
    pub sink: Arc<OnceLock<RaftSink>>,
}

impl Deliver {
    /// False once the node has stopped taking events.
    pub(super) async fn frame(&self, from: PeerId, frame: Vec<u8>) -> bool {
        let frame = match self.sink.get() {
            Some(sink) => match sink(from, frame) {
                None => return true,
                Some(back) => back,
            },
            None => frame,
        };
        self.events
            .send(NetEvent::Raft { from, frame })
            .await
            .is_ok()
    }
}

/// The receiving side of the channel: where frames go, and their limits.
pub(super) struct Inbound {
    pub to: Deliver,
    pub max_frame: usize,
    pub metrics: NetMetrics,
    pub cut: Cut,
}

/// The largest record a writer sends for frames of at most `max_frame` bytes: a
/// batch is gathered up to `batch` bytes, and its last frame may pass that.
pub(super) fn max_record(max_frame: usize, batch: usize) -> usize {
    batch + 4 + max_frame + TAG
}

impl Inbound {
    /// Reads the records of one connection, whose ticket `peer` sent with `key`,
    /// and hands each frame to the node as `peer`'s; returns at the connection's end
    /// or the first record that is not right.
    pub(super) async fn read(
        &self,
        mut socket: TcpStream,
        key: &[u8; KEY],
        peer: PeerId,
    ) -> std::io::Result<()> {
        let key = sealing_key(key);
        let limit = max_record(self.max_frame, super::raft_lane::BATCH_BYTES);
        let mut number = 0u64;
        loop {
            let mut len = [0u8; 4];
            match tokio::time::timeout(READ_IDLE, socket.read_exact(&mut len)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    return Err(std::io::Error::other(format!(
                        "no record for {READ_IDLE:?}; taken for dead"
                    )))
                }
            }
            let len = u32::from_le_bytes(len) as usize;
            if !(TAG..=limit).contains(&len) {
                return Err(std::io::Error::other(format!(
                    "record {number}: {len} bytes, outside {TAG}..={limit}"
                )));
            }
            let mut record = vec![0u8; len];
            socket.read_exact(&mut record).await?;
            self.metrics.received(Lane::Raft, 4 + len);
            let batch = key
                .open_in_place(nonce(number), Aad::from(AAD), &mut record)
                .map_err(|_| std::io::Error::other(format!("record {number} does not open")))?;
            number += 1;
            if self.cut.has(&peer) {
                return Err(std::io::Error::other("the peer is cut off"));
            }
            for frame in frames(batch, self.max_frame)? {
                if !self.to.frame(peer, frame).await {
                    return Ok(());
                }
            }
        }
    }
}

/// The frames of an opened batch, each behind its u32 length.
fn frames(mut batch: &[u8], max_frame: usize) -> std::io::Result<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    while !batch.is_empty() {
        let bad = |why: &str| std::io::Error::other(format!("a batch of frames {why}"));
        if batch.len() < 4 {
            return Err(bad("ends inside a length"));
        }
        let len = u32::from_le_bytes([batch[0], batch[1], batch[2], batch[3]]) as usize;
        if len == 0 || len > max_frame || len > batch.len() - 4 {
            return Err(bad(&format!("holds a frame of {len} bytes")));
        }
        out.push(batch[4..4 + len].to_vec());
        batch = &batch[4 + len..];
    }
    Ok(out)
}

/// The reader's side of an offer that arrived on its stream from `peer` (after the
/// zero length): keeps the ticket if `holder` takes Raft frames, and answers.
pub(super) async fn answer(
    stream: &mut Stream,
    holder: Option<&Holder>,
    peer: PeerId,
) -> std::io::Result<()> {
    answer_offer(stream, |offer| {
        holder.and_then(|h| h.issue_raft(offer, peer))
    })
    .await?;
    Ok(())
}

/// The writing side of one connection.
pub(super) struct Outbound {
    socket: OwnedWriteHalf,
    key: LessSafeKey,
    number: u64,
    record: Vec<u8>,
    /// Set once the peer has closed or reset the connection (see [`watch`]).
    closed: Arc<AtomicBool>,
    /// The rest of a record [`Outbound::try_send`] could not write whole: written
    /// before anything else.
    unsent: Vec<u8>,
}

/// What [`Outbound::try_send`] did.
pub(super) enum TrySent {
    /// The record went into the socket whole; this many bytes.
    Whole(usize),
    /// Sealed, but the socket took only part of it (maybe none): the rest waits in
    /// the connection, for the next [`Outbound::send`] to write first.
    Part,
    /// The connection is closed or broken.
    Broken(std::io::Error),
}

impl Outbound {
    fn new(socket: TcpStream, key: &[u8; KEY], number: u64) -> Outbound {
        let (read, write) = socket.into_split();
        let closed = Arc::new(AtomicBool::new(false));
        tokio::spawn(watch(read, closed.clone()));
        Outbound {
            socket: write,
            key: sealing_key(key),
            number,
            record: Vec::new(),
            closed,
            unsent: Vec::new(),
        }
    }
}

/// Watches the reading side of a writer's connection, on which the peer sends
/// nothing: its end means the peer closed or reset the connection (its process
/// died, or it was restarted). A write would not say so until the one after it:
/// the first frame into a dead connection leaves this machine as if delivered, and a
/// connection idle since its peer restarted would lose the first message of the
/// next election that way, costing a whole election timeout.
async fn watch(mut read: OwnedReadHalf, closed: Arc<AtomicBool>) {
    let mut scratch = [0u8; 64];
    loop {
        match read.read(&mut scratch).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {} // nothing is sent this way; ignored
        }
    }
    closed.store(true, Ordering::Release);
}

/// Offers the channel on `stream` (the Raft stream to a peer reached at `ip`) and
/// connects to the port the peer answers with. `Ok(None)`: the peer takes no
/// frames this way. An error leaves the stream in an unknown state.
pub(super) async fn ask(stream: &mut Stream, ip: IpAddr) -> std::io::Result<Option<Outbound>> {
    Ok(offer_channel(stream, ip, ASK)
        .await?
        .map(|(socket, key)| Outbound::new(socket, &key, 0)))
}

impl Outbound {
    /// Writes what is left of a record [`Outbound::try_send`] began, then seals
    /// `batch` (frames behind their lengths; none: nothing more) as the next record
    /// and writes it; returns the bytes written.
    pub(super) async fn send(&mut self, batch: &[u8]) -> std::io::Result<usize> {
        if self.closed.load(Ordering::Acquire) {
            return Err(std::io::Error::other("the peer closed the connection"));
        }
        let rest = self.unsent.len();
        if rest > 0 {
            tokio::time::timeout(STALL, self.socket.write_all(&self.unsent))
                .await
                .map_err(|_| std::io::Error::other("the peer stopped taking records"))??;
            self.unsent.clear();
        }
        if batch.is_empty() {
            return Ok(rest);
        }
        self.seal(batch)?;
        tokio::time::timeout(STALL, self.socket.write_all(&self.record))
            .await
            .map_err(|_| std::io::Error::other("the peer stopped taking records"))??;
        Ok(rest + self.record.len())
    }

    /// Seals `batch` as the next record and writes what the socket takes of it now,
    /// without waiting: the caller's thread puts it on the wire, where handing it to
    /// the writer task would wait for that task to be scheduled (on a busy runtime,
    /// behind whatever the caller does next, such as syncing the log). Only when
    /// nothing is waiting to be written ([`Outbound::send`] is not under way).
    pub(super) fn try_send(&mut self, batch: &[u8]) -> TrySent {
        if self.closed.load(Ordering::Acquire) {
            return TrySent::Broken(std::io::Error::other("the peer closed the connection"));
        }
        if !self.unsent.is_empty() {
            return TrySent::Broken(std::io::Error::other("a record is still being written"));
        }
        if let Err(e) = self.seal(batch) {
            return TrySent::Broken(e);
        }
        let mut written = 0;
        while written < self.record.len() {
            match self.socket.try_write(&self.record[written..]) {
                Ok(0) => return TrySent::Broken(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => written += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return TrySent::Broken(e),
            }
        }
        if written == self.record.len() {
            TrySent::Whole(written)
        } else {
            self.unsent.extend_from_slice(&self.record[written..]);
            TrySent::Part
        }
    }

    /// Seals `batch` (frames behind their lengths) as the next record, in `record`.
    fn seal(&mut self, batch: &[u8]) -> std::io::Result<()> {
        self.record.clear();
        self.record.extend_from_slice(&[0; 4]);
        self.record.extend_from_slice(batch);
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce(self.number), Aad::from(AAD), &mut self.record[4..])
            .map_err(|_| std::io::Error::other("sealing failed"))?;
        self.record.extend_from_slice(tag.as_ref());
        let len = (self.record.len() - 4) as u32;
        self.record[..4].copy_from_slice(&len.to_le_bytes());
        self.number += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn batch(frames: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for f in frames {
            out.extend_from_slice(&(f.len() as u32).to_le_bytes());
            out.extend_from_slice(f);
        }
        out
    }

    /// The receiving side of a test connection: frames of up to 1 KiB to `events`.
    fn inbound(events: mpsc::Sender<NetEvent>) -> Inbound {
        Inbound {
            to: Deliver {
                events,
                sink: Arc::new(OnceLock::new()),
            },
            max_frame: 1024,
            metrics: NetMetrics::default(),
            cut: Cut::default(),
        }
    }

    /// A reader of one connection under `key` and a writer into it under
    /// `writer_key`, its first record numbered `first`; returns the frames the reader
    /// handed on and how its reading ended, after `batches` were written.
    async fn exchange(
        key: [u8; KEY],
        writer_key: [u8; KEY],
        first: u64,
        batches: &[Vec<u8>],
    ) -> (Vec<Vec<u8>>, std::io::Result<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (events, mut got) = mpsc::channel(64);
        let inbound = inbound(events);
        let peer = PeerId::random();
        let reader = tokio::spawn(async move {
            let (socket, _) = listener.accept().await.unwrap();
            inbound.read(socket, &key, peer).await
        });
        let mut out = Outbound::new(TcpStream::connect(addr).await.unwrap(), &writer_key, first);
        for b in batches {
            out.send(b).await.unwrap();
        }
        drop(out);
        let ended = tokio::time::timeout(Duration::from_secs(10), reader)
            .await
            .unwrap()
            .unwrap();
        let mut frames = Vec::new();
        while let Ok(NetEvent::Raft { from, frame }) = got.try_recv() {
            assert_eq!(from, peer);
            frames.push(frame);
        }
        (frames, ended)
    }

    #[tokio::test]
    async fn a_writer_knows_its_peer_closed_the_connection_before_it_writes_again() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut out = Outbound::new(TcpStream::connect(addr).await.unwrap(), &[5; KEY], 0);
        let (peer, _) = listener.accept().await.unwrap();
        out.send(&batch(&[b"delivered"])).await.unwrap();
        // The peer goes (its process killed, say); nothing is written meanwhile.
        drop(peer);
        for _ in 0..100 {
            if out.closed.load(Ordering::Acquire) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let refused = out.send(&batch(&[b"would be lost"])).await.unwrap_err();
        assert!(refused.to_string().contains("closed"), "{refused}");
    }

    #[tokio::test]
    async fn records_under_the_ticket_key_deliver_their_frames_in_order() {
        let key = [5; KEY];
        let batches = vec![batch(&[b"a", b"bb"]), batch(&[b"ccc"])];
        let (frames, ended) = exchange(key, key, 0, &batches).await;
        assert!(ended.is_ok(), "{ended:?}");
        assert_eq!(frames, vec![b"a".to_vec(), b"bb".to_vec(), b"ccc".to_vec()]);
    }

    #[tokio::test]
    async fn a_record_under_another_key_or_out_of_order_delivers_nothing() {
        let batches = vec![batch(&[b"forged"])];
        let (frames, ended) = exchange([5; KEY], [6; KEY], 0, &batches).await;
        assert!(frames.is_empty());
        assert!(ended.unwrap_err().to_string().contains("does not open"));
        // Right key, but a record replayed or skipped: its number is not the next.
        let (frames, ended) = exchange([5; KEY], [5; KEY], 1, &batches).await;
        assert!(frames.is_empty());
        assert!(ended.unwrap_err().to_string().contains("does not open"));
        // A batch whose frames are over the limit is refused whole.
        let (frames, ended) = exchange([5; KEY], [5; KEY], 0, &[batch(&[&[1; 2000]])]).await;
        assert!(frames.is_empty());
        assert!(ended.is_err());
    }

    #[tokio::test]
    async fn a_record_the_socket_took_in_part_is_finished_before_the_next() {
        let key = [5; KEY];
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut out = Outbound::new(TcpStream::connect(addr).await.unwrap(), &key, 0);
        let (socket, _) = listener.accept().await.unwrap();
        // Nobody reads yet: records go in whole until the socket's buffers fill.
        let mut sent = Vec::new();
        loop {
            let frame = vec![sent.len() as u8; 1000];
            match out.try_send(&batch(&[&frame])) {
                TrySent::Whole(_) => sent.push(frame),
                TrySent::Part => {
                    sent.push(frame);
                    break;
                }
                TrySent::Broken(e) => panic!("{e}"),
            }
            assert!(sent.len() < 100_000, "the socket never filled");
        }
        // While the rest waits, no record may be begun beside it.
        assert!(matches!(out.try_send(&batch(&[b"x"])), TrySent::Broken(_)));
        let (events, mut got) = mpsc::channel(sent.len() + 8);
        let inbound = inbound(events);
        let peer = PeerId::random();
        let reader = tokio::spawn(async move { inbound.read(socket, &key, peer).await });
        out.send(&[]).await.unwrap();
        out.send(&batch(&[b"last"])).await.unwrap();
        sent.push(b"last".to_vec());
        drop(out);
        let ended = tokio::time::timeout(Duration::from_secs(10), reader).await;
        assert!(ended.unwrap().unwrap().is_ok());
        let mut frames = Vec::new();
        while let Ok(NetEvent::Raft { frame, .. }) = got.try_recv() {
            frames.push(frame);
        }
        assert_eq!(frames.len(), sent.len());
        assert!(frames == sent, "frames out of order or damaged");
    }

    #[test]
    fn a_batch_splits_into_its_frames_and_a_bad_one_is_refused() {
        let b = batch(&[b"one", b"two!", &[7; 300]]);
        let got = frames(&b, 1024).unwrap();
        assert_eq!(got, vec![b"one".to_vec(), b"two!".to_vec(), vec![7; 300]]);
        assert!(frames(&b, 299).is_err(), "a frame over the limit");
        assert!(frames(&b[..b.len() - 1], 1024).is_err(), "cut short");
        assert!(frames(&b[..2], 1024).is_err(), "inside a length");
        assert!(frames(&batch(&[b""]), 1024).is_err(), "an empty frame");
        assert!(frames(&[], 1024).unwrap().is_empty());
    }
}
