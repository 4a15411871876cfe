//! The direct blob channel: a blob's bytes on a TCP connection of their own, sealed
//! with AES-256-GCM under a key used for that one transfer.
//!
//! Why: on the mesh's connection every byte crosses Yamux and Noise's
//! ChaCha20-Poly1305 at both ends; a large blob spends more time there than on the
//! wire. Here the bytes cross one AEAD that the CPU does in hardware (AES-NI and
//! carry-less multiply, via `ring`) and the kernel's socket, nothing else.
//!
//! How it stays closed: nothing about a transfer is agreed on this connection. The
//! puller asks for the blob on the blob lane (a libp2p stream, so Noise with the
//! cluster key has authenticated both peers and encrypts the request) and sends
//! there a fresh random key and a fresh random ticket. The holder keeps the ticket
//! for [`TICKET_LIFE`] and answers with the port of its direct listener. The puller
//! connects, sends the ticket, and reads the range as records: each the next piece
//! of at most [`RECORD`] bytes, sealed with the key, the record's number as the
//! nonce and the blob id as associated data, followed by its 16-byte tag. The
//! puller knows every record's length from the size the lane told it, so nothing
//! on this connection is taken on trust: a ticket works once, a record that does
//! not open ends the pull, and bytes missing at the end are an error. Whoever
//! watches or meddles with the connection sees a ticket already spent and
//! ciphertext under a key that never left the Noise channel.
//!
//! A connection that does not bring a live ticket within [`TICKET_WAIT`] is closed
//! with nothing sent; at most [`MAX_CONNECTIONS`] are open at once (one more is
//! closed as it comes) and at most [`MAX_TICKETS`] tickets wait (more pulls are
//! answered on the lane itself). A puller that cannot reach the port (a firewall, an
//! address it cannot route to) pulls on the lane instead and does not try this peer
//! directly again until it reconnects to it.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Seek, SeekFrom};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use gpumesh_protocol::BlobId;
use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use ring::rand::{SecureRandom, SystemRandom};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::blobs::store::{BlobStore, Located};
use crate::error::{NodeError, Result};
use crate::metrics::{Lane, NetMetrics};

/// Bytes of a record's plaintext (the last one of a range may be shorter).
pub(super) const RECORD: u64 = 1 << 20;

/// Bytes of a ticket and of a key.
pub(super) const TICKET: usize = 16;
pub(super) const KEY: usize = 32;
/// Bytes of the tag after each record.
pub(super) const TAG: usize = 16;

/// How long a ticket waits for its connection.
const TICKET_LIFE: Duration = Duration::from_secs(30);
/// How long an accepted connection has to send its ticket.
const TICKET_WAIT: Duration = Duration::from_secs(5);
/// Tickets waiting at once; more pulls are answered on the lane.
const MAX_TICKETS: usize = 256;
/// How long a puller waits for the holder's port to accept.
const CONNECT: Duration = Duration::from_secs(2);
/// How long the holder waits for the puller to take the next record.
const STALL: Duration = Duration::from_secs(30);
/// Sealed records read ahead of the socket on the holder.
const READ_AHEAD: usize = 2;
/// Connections a holder keeps open at once (waiting for their ticket or served);
/// one more is closed at once. Bounds what idle connections from anyone, and the
/// records read ahead for each, can cost.
pub(super) const MAX_CONNECTIONS: usize = 32;

/// The ticket and key that open a direct connection: sent by a puller on the blob
/// lane, and by the opener of a Raft or call channel on its lane's stream
/// ([`offer_channel`]).
#[derive(Clone, Copy)]
pub(super) struct Offer {
    pub ticket: [u8; TICKET],
    pub key: [u8; KEY],
}

impl Offer {
    /// A fresh random ticket and key.
    pub(super) fn new() -> Result<Offer> {
        let random = SystemRandom::new();
        let mut offer = Offer {
            ticket: [0; TICKET],
            key: [0; KEY],
        };
        random
            .fill(&mut offer.ticket)
            .and_then(|()| random.fill(&mut offer.key))
            .map_err(|_| NodeError::NetSetup("the system's random source failed".into()))?;
        Ok(offer)
    }
}

/// The length that announces an offer on a lane's stream (Raft's or the calls'),
/// where a frame is never empty.
pub(super) const OFFERED: u32 = 0;
/// The answers to an offer on a stream: a port follows, or no channel is taken.
const YES: u8 = 1;
const NO: u8 = 0;

/// The opener's side of an offer of a direct channel on a lane's `stream` (to a
/// peer reached at `ip`): sends the announcing length and a fresh ticket and key,
/// waits at most `wait` for the answer and as long for the port answered to accept,
/// and sends the ticket on the new connection. Returns it with the key;
/// `Ok(None)`: the peer takes no channel. An error leaves the stream in an unknown
/// state.
pub(super) async fn offer_channel(
    stream: &mut libp2p::Stream,
    ip: IpAddr,
    wait: Duration,
) -> std::io::Result<Option<(TcpStream, [u8; KEY])>> {
    use futures::{AsyncReadExt as _, AsyncWriteExt as _};
    let offer = Offer::new().map_err(|e| std::io::Error::other(e.to_string()))?;
    let mut asked = Vec::with_capacity(4 + TICKET + KEY);
    asked.extend_from_slice(&OFFERED.to_le_bytes());
    asked.extend_from_slice(&offer.ticket);
    asked.extend_from_slice(&offer.key);
    stream.write_all(&asked).await?;
    stream.flush().await?;
    let mut answer = [0u8; 3];
    let answered = async {
        stream.read_exact(&mut answer[..1]).await?;
        if answer[0] == YES {
            stream.read_exact(&mut answer[1..]).await?;
        }
        std::io::Result::Ok(())
    };
    tokio::time::timeout(wait, answered)
        .await
        .map_err(|_| std::io::Error::other("no answer to the offer in time"))??;
    match answer[0] {
        NO => return Ok(None),
        YES => {}
        other => {
            return Err(std::io::Error::other(format!(
                "the peer answered the offer with {other:#x}"
            )))
        }
    }
    let port = u16::from_le_bytes([answer[1], answer[2]]);
    let mut socket = tokio::time::timeout(wait, TcpStream::connect((ip, port)))
        .await
        .map_err(|_| std::io::Error::other(format!("{ip}:{port} did not accept in time")))??;
    socket.set_nodelay(true)?;
    socket.write_all(&offer.ticket).await?;
    Ok(Some((socket, offer.key)))
}

/// The server's side of an offer that arrived on a lane's `stream` (after the
/// announcing length): reads the ticket and key, hands them to `issue`, which keeps
/// the ticket and returns the port of the listener that takes its connection (or
/// `None`: no channel), and answers. Returns the offer and whether it was taken.
pub(super) async fn answer_offer(
    stream: &mut libp2p::Stream,
    issue: impl FnOnce(&Offer) -> Option<u16>,
) -> std::io::Result<(Offer, bool)> {
    use futures::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut offer = Offer {
        ticket: [0; TICKET],
        key: [0; KEY],
    };
    stream.read_exact(&mut offer.ticket).await?;
    stream.read_exact(&mut offer.key).await?;
    let reply = match issue(&offer) {
        Some(port) => {
            let [a, b] = port.to_le_bytes();
            vec![YES, a, b]
        }
        None => vec![NO],
    };
    stream.write_all(&reply).await?;
    stream.flush().await?;
    Ok((offer, reply[0] == YES))
}

/// What a ticket opens, under its key.
struct Ticket {
    key: [u8; KEY],
    opens: Opens,
    issued: Instant,
}

enum Opens {
    /// Bytes `at..end` of blob `id`, sent to the puller.
    Range { id: BlobId, at: u64, end: u64 },
    /// Raft frames from `peer`, received (see [`super::raft_direct`]).
    Raft { peer: PeerId },
    /// A call stream's frames both ways (see [`super::call_direct`]): the
    /// connection goes to the stream's server.
    Call {
        handoff: tokio::sync::oneshot::Sender<TcpStream>,
    },
}

/// The holder's side: its listener's port and the tickets waiting for it.
#[derive(Clone)]
pub(super) struct Holder {
    port: u16,
    tickets: Arc<Mutex<HashMap<[u8; TICKET], Ticket>>>,
    /// Where Raft frames that arrive on this listener go.
    raft: Option<Arc<super::raft_direct::Inbound>>,
    /// Record buffers already written to a socket, for the next records to be read
    /// into.
    spare: Spare,
}

/// Record buffers done with, kept for the next records (at most [`SPARE`]): on a
/// holder, those already written to a socket, for the next pieces of files to be
/// read and sealed into; on a puller, those already stored (or copied out), for
/// the next records to be received into.
///
/// Why: a record is a megabyte, and a fresh one is fresh memory: the kernel zeroes
/// its pages as the bytes are first copied in (6.7% of the CPU samples of a 64 MiB
/// fetch, both ends together, under perf, before the holder kept its buffers). A
/// few buffers going round do not pay that again.
#[derive(Clone, Default)]
pub(super) struct Spare(Arc<Mutex<Vec<Vec<u8>>>>);

/// Record buffers a holder keeps between transfers: enough for the records read
/// ahead and the one on the socket of a few transfers at once.
const SPARE: usize = 8;

impl Spare {
    /// An empty buffer with room for `len` bytes.
    pub(super) fn take(&self, len: usize) -> Vec<u8> {
        let kept = self.0.lock().unwrap_or_else(PoisonError::into_inner).pop();
        match kept {
            Some(mut buffer) => {
                buffer.clear();
                buffer.reserve(len);
                buffer
            }
            None => Vec::with_capacity(len),
        }
    }

    /// Keeps `buffer` for a later record, unless enough are kept already.
    pub(super) fn give(&self, buffer: Vec<u8>) {
        let mut kept = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if kept.len() < SPARE && buffer.capacity() <= (RECORD as usize) + TAG {
            kept.push(buffer);
        }
    }
}

impl Holder {
    /// Binds a listener on the IP of each of the node's TCP listen addresses, all on
    /// one port (any free one for the first, the same for the others), and serves
    /// connections until `cancel` fires: a peer connects to the IP it reached the
    /// node at. An IP already covered by an unspecified address of its family, or
    /// whose port is taken, has no direct listener (logged): peers that reach the
    /// node there pull on the lane. `None` when the node listens on no TCP address.
    pub(super) async fn start(
        listen: &[Multiaddr],
        blobs: BlobStore,
        raft: Option<Arc<super::raft_direct::Inbound>>,
        metrics: NetMetrics,
        cancel: CancellationToken,
    ) -> Result<Option<Holder>> {
        let mut ips: Vec<IpAddr> = Vec::new();
        for ip in listen.iter().filter_map(tcp_ip) {
            if !ips.contains(&ip) {
                ips.push(ip);
            }
        }
        // A specific IP under an unspecified one of its family is already served.
        let any = |v4: bool| ips.iter().any(|i| i.is_unspecified() && i.is_ipv4() == v4);
        let (any4, any6) = (any(true), any(false));
        ips.retain(|i| i.is_unspecified() || !(if i.is_ipv4() { any4 } else { any6 }));
        let Some(first) = ips.first().copied() else {
            return Ok(None);
        };
        let at = SocketAddr::new(first, 0);
        let listener = TcpListener::bind(at)
            .await
            .map_err(|e| NodeError::NetSetup(format!("direct blob listener on {at}: {e}")))?;
        let port = listener
            .local_addr()
            .map_err(|e| NodeError::NetSetup(format!("direct blob listener: {e}")))?
            .port();
        let holder = Holder {
            port,
            tickets: Arc::default(),
            raft,
            spare: Spare::default(),
        };
        let open = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        let mut listeners = vec![listener];
        for ip in &ips[1..] {
            let at = SocketAddr::new(*ip, port);
            match TcpListener::bind(at).await {
                Ok(l) => listeners.push(l),
                Err(e) => tracing::warn!(
                    %at,
                    error = %e,
                    "no direct blob listener here; peers that reach this node at {ip} pull \
                     on the blob lane's stream"
                ),
            }
        }
        for listener in listeners {
            tokio::spawn(holder.clone().accept(
                listener,
                open.clone(),
                blobs.clone(),
                metrics.clone(),
                cancel.clone(),
            ));
        }
        Ok(Some(holder))
    }

    /// Keeps `offer`'s ticket for bytes `at..end` of `id` and returns the port to
    /// connect to; `None` when too many tickets wait already.
    pub(super) fn issue(&self, offer: &Offer, id: BlobId, at: u64, end: u64) -> Option<u16> {
        self.keep(offer, Opens::Range { id, at, end })
    }

    /// Keeps `offer`'s ticket for a connection that brings Raft frames from `peer`
    /// (who sent the offer over the mesh's authenticated stream) and returns the
    /// port; `None` when this listener takes no Raft frames or too many tickets wait.
    pub(super) fn issue_raft(&self, offer: &Offer, peer: PeerId) -> Option<u16> {
        self.raft.as_ref()?;
        self.keep(offer, Opens::Raft { peer })
    }

    /// Keeps `offer`'s ticket (which came on a call stream, authenticated) for a
    /// connection that `handoff` takes to the stream's server, and returns the port;
    /// `None` when too many tickets wait.
    pub(super) fn issue_call(
        &self,
        offer: &Offer,
        handoff: tokio::sync::oneshot::Sender<TcpStream>,
    ) -> Option<u16> {
        self.keep(offer, Opens::Call { handoff })
    }

    fn keep(&self, offer: &Offer, opens: Opens) -> Option<u16> {
        let mut tickets = self.tickets.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        tickets.retain(|_, t| now.duration_since(t.issued) < TICKET_LIFE);
        if tickets.len() >= MAX_TICKETS {
            return None;
        }
        tickets.insert(
            offer.ticket,
            Ticket {
                key: offer.key,
                opens,
                issued: now,
            },
        );
        Some(self.port)
    }

    /// The ticket, if it is live; spent by this.
    fn redeem(&self, ticket: &[u8; TICKET]) -> Option<Ticket> {
        let mut tickets = self.tickets.lock().unwrap_or_else(PoisonError::into_inner);
        let t = tickets.remove(ticket)?;
        (t.issued.elapsed() < TICKET_LIFE).then_some(t)
    }

    /// Serves `listener`'s connections, at most [`MAX_CONNECTIONS`] at once across
    /// this holder's listeners (`open`).
    async fn accept(
        self,
        listener: TcpListener,
        open: Arc<tokio::sync::Semaphore>,
        blobs: BlobStore,
        metrics: NetMetrics,
        cancel: CancellationToken,
    ) {
        loop {
            let accepted = tokio::select! {
                _ = cancel.cancelled() => return,
                accepted = listener.accept() => accepted,
            };
            let (socket, from) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors and the like: wait rather than spin.
                    tracing::warn!(error = %e, "direct blob listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(permit) = open.clone().try_acquire_owned() else {
                tracing::debug!(%from, "direct blob listener: too many connections; closing one");
                continue;
            };
            let (holder, blobs, metrics, cancel) =
                (self.clone(), blobs.clone(), metrics.clone(), cancel.clone());
            tokio::spawn(async move {
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    served = holder.serve(socket, permit, blobs, metrics) => if let Err(e) = served {
                        tracing::debug!(%from, error = %e, "a direct blob connection ended early");
                    }
                }
            });
        }
    }

    /// One connection: its ticket, then the range it opens, record by record; or
    /// the Raft frames it brings, or the call stream's server it goes to (neither
    /// holds `permit`, the room for pulls: there is one such connection per peer and
    /// lane, and only members get tickets).
    async fn serve(
        &self,
        mut socket: TcpStream,
        permit: tokio::sync::OwnedSemaphorePermit,
        blobs: BlobStore,
        metrics: NetMetrics,
    ) -> std::io::Result<()> {
        let mut ticket = [0u8; TICKET];
        tokio::time::timeout(TICKET_WAIT, socket.read_exact(&mut ticket))
            .await
            .map_err(|_| std::io::Error::other("no ticket in time"))??;
        let Some(ticket) = self.redeem(&ticket) else {
            return Err(std::io::Error::other("not a live ticket"));
        };
        socket.set_nodelay(true)?;
        let (id, at, end) = match ticket.opens {
            Opens::Range { id, at, end } => (id, at, end),
            Opens::Raft { peer } => {
                drop(permit);
                let Some(inbound) = &self.raft else {
                    return Err(std::io::Error::other("no Raft frames taken here"));
                };
                return inbound.read(socket, &ticket.key, peer).await;
            }
            Opens::Call { handoff } => {
                drop(permit);
                return handoff
                    .send(socket)
                    .map_err(|_| std::io::Error::other("the call stream's server is gone"));
            }
        };
        let _permit = permit;
        let key = ticket.key;
        let (tx, mut rx) = mpsc::channel(READ_AHEAD);
        let spare = self.spare.clone();
        let reader =
            tokio::task::spawn_blocking(move || read_sealed(&blobs, &spare, &key, id, at, end, tx));
        while let Some(record) = rx.recv().await {
            let record: Vec<u8> = record?;
            tokio::time::timeout(STALL, socket.write_all(&record))
                .await
                .map_err(|_| std::io::Error::other("the puller stopped reading"))??;
            metrics.sent(Lane::Blob, record.len());
            self.spare.give(record);
        }
        reader.await.map_err(std::io::Error::other)?;
        socket.shutdown().await
    }
}

/// Reads the ticket's range from the blob's file a piece at a time into buffers from
/// `spare`, seals each piece and sends it on `tx`; stops at the end or when the
/// receiver is gone.
fn read_sealed(
    blobs: &BlobStore,
    spare: &Spare,
    key: &[u8; KEY],
    id: BlobId,
    at: u64,
    end: u64,
    tx: mpsc::Sender<std::io::Result<Vec<u8>>>,
) {
    let key = sealing_key(key);
    // On disk, or in memory: a packed blob's bytes, read, or a blob this node is
    // storing as it is copied.
    enum Source {
        File(std::fs::File),
        Staged(crate::blobs::store::Shared),
    }
    let opened = blobs.locate(&id).and_then(|f| match f {
        Some(Located::File { file, len }) => Ok((Source::File(file), len)),
        Some(Located::Bytes(bytes)) => {
            let len = bytes.len() as u64;
            Ok((Source::Staged(bytes.into()), len))
        }
        None => blobs
            .staged(&id)
            .map(|b| {
                let len = b.len() as u64;
                (Source::Staged(b), len)
            })
            .ok_or_else(|| NodeError::BlobNotFound {
                id,
                peer: "this node".into(),
            }),
    });
    let (mut source, end) = match opened {
        Ok((source, len)) => (source, end.min(len)),
        Err(e) => {
            let _ = tx.blocking_send(Err(std::io::Error::other(e.to_string())));
            return;
        }
    };
    let mut at = at;
    let mut number = 0u64;
    let mut first = true;
    while at < end {
        let len = RECORD.min(end - at) as usize;
        // Filled straight into its capacity, never zeroed first: a pass over
        // every byte fewer on each side (see `read_record`).
        let mut record = spare.take(len + TAG);
        let read = match &mut source {
            Source::File(file) => if first {
                file.seek(SeekFrom::Start(at)).map(|_| ())
            } else {
                Ok(())
            }
            .and_then(|()| file.take(len as u64).read_to_end(&mut record))
            .and_then(|got| match got == len {
                true => Ok(()),
                false => Err(std::io::ErrorKind::UnexpectedEof.into()),
            }),
            Source::Staged(bytes) => {
                record.extend_from_slice(&bytes[at as usize..at as usize + len]);
                Ok(())
            }
        };
        first = false;
        let sealed = read.and_then(|()| {
            key.seal_in_place_separate_tag(nonce(number), Aad::from(id.0), &mut record)
                .map(|tag| record.extend_from_slice(tag.as_ref()))
                .map_err(|_| std::io::Error::other("sealing failed"))
        });
        let failed = sealed.is_err();
        if tx.blocking_send(sealed.map(|()| record)).is_err() || failed {
            return;
        }
        at += len as u64;
        number += 1;
    }
}

/// Reads exactly `len` bytes from `socket` into `record`'s spare capacity (never
/// zeroed first, unlike a buffer for `read_exact`: at a gigabyte or more a second
/// that pass costs as much as the socket's own copy).
async fn read_record(
    socket: &mut TcpStream,
    record: &mut Vec<u8>,
    len: usize,
) -> std::io::Result<()> {
    let mut rest = socket.take(len as u64);
    while record.len() < len {
        if rest.read_buf(record).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(())
}

/// How a direct pull fell short.
pub(super) enum Failed {
    /// Before any piece was handed over: the lane can still carry the blob.
    Unreached(String),
    /// After some pieces were handed over.
    Broken(String),
    /// `each` refused a piece.
    Each(NodeError),
}

/// How a direct pull waits, counts and opens.
pub(super) struct How<'a> {
    /// The longest wait for the next bytes.
    pub timeout: Duration,
    /// Where the bytes are counted.
    pub metrics: &'a NetMetrics,
    /// Records opened on blocking threads while the next is read (0: each opened
    /// here as it arrives).
    pub open_ahead: usize,
    /// Where records are received into (and where the caller gives them back).
    pub spare: &'a Spare,
}

/// Reads bytes `at..end` of `id` from the holder at `addr` with `offer`, handing each
/// piece to `each(offset, bytes)`.
pub(super) async fn pull(
    addr: SocketAddr,
    offer: &Offer,
    (id, at, end): (BlobId, u64, u64),
    how: &How<'_>,
    each: &mut impl FnMut(u64, Vec<u8>) -> Result<()>,
) -> std::result::Result<(), Failed> {
    let mut socket = match tokio::time::timeout(CONNECT, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(Failed::Unreached(format!("connecting to {addr}: {e}"))),
        Err(_) => {
            return Err(Failed::Unreached(format!(
                "{addr} did not accept within {CONNECT:?}"
            )))
        }
    };
    let _ = socket.set_nodelay(true);
    socket
        .write_all(&offer.ticket)
        .await
        .map_err(|e| Failed::Unreached(format!("sending the ticket to {addr}: {e}")))?;
    let key = Arc::new(sealing_key(&offer.key));
    // Records read and not yet handed on, oldest first: opened here, or (with
    // `open_ahead`) being opened on blocking threads while the socket is read on.
    let mut opening = std::collections::VecDeque::new();
    let (mut offset, mut number) = (at, 0u64);
    let mut handed = false;
    loop {
        while opening.len() > how.open_ahead || (offset >= end && !opening.is_empty()) {
            let Some((from, n, open)) = opening.pop_front() else {
                break;
            };
            let opened: Option<Vec<u8>> = match open {
                Opened::Now(record) => record,
                Opened::Later(task) => task
                    .await
                    .map_err(|e| Failed::Broken(format!("opening record {n} from {addr}: {e}")))?,
            };
            let Some(record) = opened else {
                return Err(Failed::Broken(format!(
                    "record {n} from {addr} does not open"
                )));
            };
            each(from, record).map_err(Failed::Each)?;
            handed = true;
        }
        if offset >= end {
            return Ok(());
        }
        let len = RECORD.min(end - offset) as usize;
        let mut record = how.spare.take(len + TAG);
        // Before any piece was handed on the lane can still carry the blob.
        let fail = |reason: String| match handed {
            true => Failed::Broken(reason),
            false => Failed::Unreached(reason),
        };
        match tokio::time::timeout(
            how.timeout,
            read_record(&mut socket, &mut record, len + TAG),
        )
        .await
        {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(fail(format!("reading from {addr}: {e}"))),
            Err(_) => {
                return Err(fail(format!(
                    "no bytes from {addr} within {:?}",
                    how.timeout
                )))
            }
        }
        how.metrics.received(Lane::Blob, record.len());
        let open = {
            let key = key.clone();
            move || {
                key.open_in_place(nonce(number), Aad::from(id.0), &mut record)
                    .ok()?;
                record.truncate(len);
                Some(record)
            }
        };
        // The last record with none before it still opening has nothing to overlap.
        let last_alone = opening.is_empty() && offset + len as u64 >= end;
        let open = if how.open_ahead == 0 || last_alone {
            Opened::Now(open())
        } else {
            Opened::Later(tokio::task::spawn_blocking(open))
        };
        opening.push_back((offset, number, open));
        offset += len as u64;
        number += 1;
    }
}

/// A record opened (`None`: it did not open), or being opened.
enum Opened {
    Now(Option<Vec<u8>>),
    Later(tokio::task::JoinHandle<Option<Vec<u8>>>),
}

pub(super) fn sealing_key(key: &[u8; KEY]) -> LessSafeKey {
    // A 32-byte key is what AES-256-GCM takes; `new` fails only on another length.
    match UnboundKey::new(&AES_256_GCM, key) {
        Ok(k) => LessSafeKey::new(k),
        Err(_) => unreachable!("AES-256-GCM takes a {KEY}-byte key"),
    }
}

/// Record `number`'s nonce: each key seals one transfer, so the count is unique.
pub(super) fn nonce(number: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&number.to_be_bytes());
    Nonce::assume_unique_for_key(n)
}

/// The IP of a `/ip4/../tcp/..` or `/ip6/../tcp/..` address.
fn tcp_ip(addr: &Multiaddr) -> Option<IpAddr> {
    let mut parts = addr.iter();
    let ip = match parts.next()? {
        Protocol::Ip4(ip) => IpAddr::V4(ip),
        Protocol::Ip6(ip) => IpAddr::V6(ip),
        _ => return None,
    };
    matches!(parts.next()?, Protocol::Tcp(_)).then_some(ip)
}

/// Where each peer was last reached (the IP of its connection), and the peers whose
/// direct port did not answer since; shared by the network actor, which fills it as
/// connections come up, and the pullers.
#[derive(Clone, Default)]
pub(super) struct Peers(Arc<Mutex<PeerIps>>);

/// How a connection's address names its peer's host.
enum Host {
    Ip(IpAddr),
    /// A DNS name, and whether only IPv4 (`/dns4`) or IPv6 (`/dns6`) answers count.
    Name(String, Option<bool>),
}

#[derive(Default)]
struct PeerIps {
    ips: HashMap<PeerId, IpAddr>,
    unreachable: HashSet<PeerId>,
}

impl Peers {
    /// A connection to `peer` came up at `addr`: try its direct port again. A peer
    /// dialled by host name (`/dns4/...`) is reached at what that name resolves to.
    pub(super) fn connected(&self, peer: PeerId, addr: &Multiaddr) {
        let host = addr.iter().find_map(|p| match p {
            Protocol::Ip4(ip) => Some(Host::Ip(IpAddr::V4(ip))),
            Protocol::Ip6(ip) => Some(Host::Ip(IpAddr::V6(ip))),
            Protocol::Dns(name) => Some(Host::Name(name.to_string(), None)),
            Protocol::Dns4(name) => Some(Host::Name(name.to_string(), Some(true))),
            Protocol::Dns6(name) => Some(Host::Name(name.to_string(), Some(false))),
            _ => None,
        });
        match host {
            Some(Host::Ip(ip)) => self.reached(peer, ip),
            Some(Host::Name(name, v4)) => {
                let peers = self.clone();
                tokio::spawn(async move {
                    let Ok(found) = tokio::net::lookup_host((name.as_str(), 0)).await else {
                        return;
                    };
                    let ip = found
                        .map(|a| a.ip())
                        .find(|ip| v4.is_none_or(|v4| ip.is_ipv4() == v4));
                    if let Some(ip) = ip {
                        peers.reached(peer, ip);
                    }
                });
            }
            None => {}
        }
    }

    fn reached(&self, peer: PeerId, ip: IpAddr) {
        let mut peers = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        peers.ips.insert(peer, ip);
        peers.unreachable.remove(&peer);
    }

    /// The IP to reach `peer`'s direct port at, unless it did not answer there.
    pub(super) fn ip(&self, peer: &PeerId) -> Option<IpAddr> {
        let peers = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if peers.unreachable.contains(peer) {
            return None;
        }
        peers.ips.get(peer).copied()
    }

    /// `peer`'s direct port did not answer: pull on the lane until it reconnects.
    pub(super) fn unreachable(&self, peer: PeerId) {
        let mut peers = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        peers.unreachable.insert(peer);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A holder on a port of its own that takes one connection, reads its ticket
    /// and sends `data` as records sealed under `key`, but record `bad` (if any)
    /// under another key.
    async fn holder(data: Vec<u8>, id: BlobId, key: [u8; KEY], bad: Option<u64>) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut ticket = [0u8; TICKET];
            socket.read_exact(&mut ticket).await.unwrap();
            for (n, piece) in data.chunks(RECORD as usize).enumerate() {
                let n = n as u64;
                let seal = sealing_key(&if bad == Some(n) { [7; KEY] } else { key });
                let mut record = piece.to_vec();
                let tag = seal
                    .seal_in_place_separate_tag(nonce(n), Aad::from(id.0), &mut record)
                    .unwrap();
                record.extend_from_slice(tag.as_ref());
                if socket.write_all(&record).await.is_err() {
                    return; // the puller gave up
                }
            }
        });
        addr
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_puller_opening_records_ahead_hands_them_on_in_order_and_stops_at_one_that_does_not_open(
    ) {
        let data: Vec<u8> = (0..5 * RECORD as usize + 4321)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let id = BlobId::of(&data);
        let metrics = NetMetrics::default();
        // Buffers given back and received into again: a record must not keep any
        // of the one before it.
        let spare = Spare::default();
        for open_ahead in [0, 2] {
            let how = How {
                timeout: Duration::from_secs(10),
                metrics: &metrics,
                open_ahead,
                spare: &spare,
            };
            let offer = Offer::new().unwrap();
            let addr = holder(data.clone(), id, offer.key, None).await;
            let mut got = Vec::new();
            let range = (id, 0, data.len() as u64);
            pull(addr, &offer, range, &how, &mut |at, bytes| {
                assert_eq!(at, got.len() as u64, "in order");
                got.extend_from_slice(&bytes);
                spare.give(bytes);
                Ok(())
            })
            .await
            .unwrap_or_else(|_| panic!("open_ahead {open_ahead}: the pull failed"));
            assert!(got == data, "open_ahead {open_ahead}: bytes differ");
            // Record 3 sealed under another key: records 0-2 are handed on, then
            // the pull fails naming it, and nothing after it is handed on.
            let offer = Offer::new().unwrap();
            let addr = holder(data.clone(), id, offer.key, Some(3)).await;
            let mut handed = 0;
            let failed = pull(addr, &offer, range, &how, &mut |_, bytes| {
                handed += 1;
                spare.give(bytes);
                Ok(())
            })
            .await;
            match failed {
                Err(Failed::Broken(reason)) => assert!(reason.contains("record 3"), "{reason}"),
                _ => panic!("open_ahead {open_ahead}: a record that does not open was taken"),
            }
            assert_eq!(handed, 3, "open_ahead {open_ahead}");
        }
    }

    /// The IP recorded for `peer` once `addr` connected, waiting up to `tenths`
    /// tenths of a second for a name to resolve.
    async fn reached(addr: &str, tenths: u32) -> Option<IpAddr> {
        let peers = Peers::default();
        let peer = PeerId::random();
        peers.connected(peer, &addr.parse().unwrap());
        for _ in 0..tenths {
            if let Some(ip) = peers.ip(&peer) {
                return Some(ip);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        None
    }

    /// Whether a TCP connection to `ip:port` is accepted.
    async fn accepts(ip: &str, port: u16) -> bool {
        TcpStream::connect((ip.parse::<IpAddr>().unwrap(), port))
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn the_direct_listener_is_on_every_listen_ip_on_one_port() {
        let dir = tempfile::tempdir().unwrap();
        let blobs = BlobStore::open(dir.path(), 1 << 20).unwrap();
        let start = |listen: &[&str]| {
            let listen: Vec<Multiaddr> = listen.iter().map(|a| a.parse().unwrap()).collect();
            let (blobs, cancel) = (blobs.clone(), CancellationToken::new());
            async move {
                let holder =
                    Holder::start(&listen, blobs, None, NetMetrics::default(), cancel.clone())
                        .await
                        .unwrap();
                (holder, cancel)
            }
        };
        // Two loopback IPs (a node on two networks): a peer that reached the node at
        // either connects there.
        let (holder, cancel) = start(&["/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.2/tcp/0"]).await;
        let port = holder.unwrap().port;
        assert!(accepts("127.0.0.1", port).await);
        assert!(accepts("127.0.0.2", port).await);
        assert!(!accepts("127.0.0.3", port).await, "an IP it was not given");
        cancel.cancel();
        // An unspecified IP covers the specific ones of its family.
        let (holder, cancel) = start(&["/ip4/127.0.0.4/tcp/0", "/ip4/0.0.0.0/tcp/0"]).await;
        let port = holder.unwrap().port;
        assert!(accepts("127.0.0.4", port).await);
        assert!(accepts("127.0.0.5", port).await);
        cancel.cancel();
        // No TCP address: no direct channel.
        let (holder, _cancel) = start(&["/ip4/127.0.0.1/udp/0/quic-v1"]).await;
        assert!(holder.is_none());
    }

    #[tokio::test]
    async fn a_peer_reached_by_host_name_is_pulled_from_at_what_the_name_resolves_to() {
        assert_eq!(
            reached("/ip4/10.1.2.3/tcp/4001", 1).await,
            Some("10.1.2.3".parse().unwrap())
        );
        assert_eq!(
            reached("/dns4/localhost/tcp/4001", 50).await,
            Some("127.0.0.1".parse().unwrap())
        );
        // A name that does not resolve leaves the peer to the lane's stream.
        assert_eq!(
            reached("/dns4/no-such-host.invalid/tcp/4001", 10).await,
            None
        );
    }
}
