//! The direct call channel: the call lane's frames to one peer on a TCP connection
//! of their own, sealed with AES-256-GCM, in both directions.
//!
//! Why: on the mesh's connection a request crosses the caller's writer task, the
//! connection's task (Yamux, Noise), the socket, the other side's connection task
//! and the stream's reader task, and its answer the same way back; each is a task
//! woken on another thread. A call made through a node other than its actor's host
//! pays that on its path (traced: 40-70 us there and 50-110 back). Here a frame
//! crosses the writer task, the socket and the reader task.
//!
//! How it stays closed, as the direct Raft channel does: nothing is agreed on the
//! connection. Once the serving side has taken the call stream (a libp2p stream:
//! Noise with the cluster key has authenticated both peers and encrypts it), the
//! opener sends on it a zero length, then a fresh random ticket and key ([`ask`]).
//! The server keeps the ticket for a connection that brings this stream's frames
//! and answers with the port of the node's direct listener
//! ([`super::blob_direct::Holder`]), or that it takes none. The opener connects and
//! sends the ticket; the listener hands the connection to the stream's server. From
//! then on every batch of frames (as on the stream: each behind its u32 length) is
//! one record each way: the sealed batch's length (u32), the batch sealed with the
//! key, and its 16-byte tag. The opener's records are numbered from 0 and the
//! server's from 2^63, and the number is the nonce, so no nonce repeats under the
//! key; a record that does not open, or one out of order, ends the connection.
//!
//! The stream stays open beside the connection, carrying nothing: when it ends
//! (the mesh's connection closed: the peer gone, cut off by fault injection, or
//! its pings unanswered), both sides drop the direct connection too, and the
//! callers waiting on it fail as they would on the stream. A peer whose direct port
//! cannot be reached, or that takes the offer for a malformed frame (a node from
//! before this channel), gets its calls on the stream and is not offered the
//! channel again for [`REFUSED`].

use std::net::IpAddr;
use std::time::Duration;

use libp2p::Stream;
use ring::aead::{Aad, LessSafeKey};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use super::blob_direct::{answer_offer, nonce, offer_channel, sealing_key, Holder, KEY, TAG};

/// Associated data of every record: a record of another channel does not open here.
const AAD: &[u8] = b"gpumesh call direct v1";
/// How long the opener waits for the answer to its offer, and for the port to
/// accept; and the server for the connection after its answer. On a LAN each takes
/// well under a millisecond; the requests queued meanwhile wait.
pub(super) const ASK: Duration = Duration::from_millis(500);
/// How long a peer that refused the offer, or whose port did not answer, gets its
/// calls on the stream before it is offered the channel again.
pub(super) const REFUSED: Duration = Duration::from_secs(60);
/// The first record number of the server's direction.
const ANSWERS: u64 = 1 << 63;

/// Which end of the connection this is.
#[derive(Clone, Copy)]
pub(super) enum End {
    /// Sent the offer; writes requests.
    Opener,
    /// Took the offer; writes answers.
    Server,
}

/// The opener's side of an offer on a call stream the server has taken: sends it,
/// and on a yes connects to the server at `ip`. `Ok(None)`: the server takes no
/// calls this way. An error leaves the stream in an unknown state.
pub(super) async fn ask(stream: &mut Stream, ip: IpAddr) -> std::io::Result<Option<Channel>> {
    Ok(offer_channel(stream, ip, ASK)
        .await?
        .map(|(socket, key)| Channel::new(socket, &key, End::Opener)))
}

/// The server's side of an offer that arrived on its call stream (after the zero
/// length): reads it, keeps the ticket with `holder` if there is one, answers, and
/// waits (at most [`ASK`]) for the opener's connection. `Ok(None)`: none is taken,
/// and the stream goes on as before.
pub(super) async fn answer(
    stream: &mut Stream,
    holder: Option<&Holder>,
) -> std::io::Result<Option<Channel>> {
    let (handoff, connection) = tokio::sync::oneshot::channel();
    let (offer, taken) = answer_offer(stream, |offer| {
        holder.and_then(|h| h.issue_call(offer, handoff))
    })
    .await?;
    if !taken {
        return Ok(None);
    }
    let socket = tokio::time::timeout(ASK, connection)
        .await
        .map_err(|_| std::io::Error::other("the offered connection did not come in time"))?
        .map_err(|_| std::io::Error::other("the direct listener stopped"))?;
    Ok(Some(Channel::new(socket, &offer.key, End::Server)))
}

/// Both halves of a direct call connection, sealed under its key.
pub(super) struct Channel {
    pub reader: Opening,
    pub writer: Sealing,
}

impl Channel {
    pub(super) fn new(socket: TcpStream, key: &[u8; KEY], end: End) -> Channel {
        let (read, write) = socket.into_split();
        let (mine, theirs) = match end {
            End::Opener => (0, ANSWERS),
            End::Server => (ANSWERS, 0),
        };
        Channel {
            reader: Opening {
                socket: read,
                key: sealing_key(key),
                number: theirs,
            },
            writer: Sealing {
                socket: write,
                key: sealing_key(key),
                number: mine,
                record: Vec::new(),
            },
        }
    }
}

/// Opens the records the peer writes.
pub(super) struct Opening {
    socket: OwnedReadHalf,
    key: LessSafeKey,
    number: u64,
}

impl Opening {
    /// The next record's opened batch, at most `limit` bytes sealed; `Ok(None)` when
    /// the peer closed the connection between records.
    pub(super) async fn record(&mut self, limit: usize) -> std::io::Result<Option<Vec<u8>>> {
        let mut len = [0u8; 4];
        match self.socket.read_exact(&mut len).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let len = u32::from_le_bytes(len) as usize;
        if !(TAG..=limit).contains(&len) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("a record of {len} bytes (at least {TAG}, at most {limit})"),
            ));
        }
        let mut record = vec![0u8; len];
        self.socket.read_exact(&mut record).await?;
        let opened = self
            .key
            .open_in_place(nonce(self.number), Aad::from(AAD), &mut record)
            .map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::InvalidData, "a record does not open")
            })?
            .len();
        self.number += 1;
        record.truncate(opened);
        Ok(Some(record))
    }
}

/// Seals and writes this end's records.
pub(super) struct Sealing {
    socket: OwnedWriteHalf,
    key: LessSafeKey,
    number: u64,
    record: Vec<u8>,
}

impl Sealing {
    /// Seals `batch` as the next record and writes it; returns the bytes written.
    pub(super) async fn send(&mut self, batch: &[u8]) -> std::io::Result<usize> {
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
        self.socket.write_all(&self.record).await?;
        Ok(self.record.len())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// An opener's and a server's channel over one loopback connection, the
    /// server's under `server_key`.
    async fn pair(key: [u8; KEY], server_key: [u8; KEY]) -> (Channel, Channel) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let opener = TcpStream::connect(addr).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (
            Channel::new(opener, &key, End::Opener),
            Channel::new(server, &server_key, End::Server),
        )
    }

    #[tokio::test]
    async fn records_go_both_ways_in_order() {
        let (mut opener, mut server) = pair([3; KEY], [3; KEY]).await;
        opener.writer.send(b"request one").await.unwrap();
        opener.writer.send(b"request two").await.unwrap();
        server.writer.send(b"answer").await.unwrap();
        assert_eq!(
            server.reader.record(1024).await.unwrap().unwrap(),
            b"request one"
        );
        assert_eq!(
            server.reader.record(1024).await.unwrap().unwrap(),
            b"request two"
        );
        assert_eq!(
            opener.reader.record(1024).await.unwrap().unwrap(),
            b"answer"
        );
        drop(opener);
        assert!(server.reader.record(1024).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_record_under_another_key_reflected_or_over_the_limit_is_refused() {
        let (mut opener, mut server) = pair([3; KEY], [4; KEY]).await;
        opener.writer.send(b"forged").await.unwrap();
        let refused = server.reader.record(1024).await.unwrap_err();
        assert!(refused.to_string().contains("does not open"), "{refused}");

        // The opener's own record sent back to it: same key, the other direction's
        // numbers, so it does not open there.
        let (mut opener, mut server) = pair([3; KEY], [3; KEY]).await;
        opener.writer.send(b"mine").await.unwrap();
        let record = {
            let mut len = [0u8; 4];
            server.reader.socket.read_exact(&mut len).await.unwrap();
            let mut r = vec![0u8; u32::from_le_bytes(len) as usize];
            server.reader.socket.read_exact(&mut r).await.unwrap();
            [len.to_vec(), r].concat()
        };
        server.writer.socket.write_all(&record).await.unwrap();
        assert!(opener.reader.record(1024).await.is_err());

        let (mut opener, mut server) = pair([3; KEY], [3; KEY]).await;
        opener.writer.send(&[9; 2000]).await.unwrap();
        let refused = server.reader.record(1024).await.unwrap_err();
        assert!(refused.to_string().contains("at most 1024"), "{refused}");
    }
}
