//! How one [`MeshRequest`] / [`MeshResponse`] travels on one libp2p stream.
//!
//! Layout: a little-endian `u32` length and the sealed
//! [envelope](gpumesh_protocol::envelope) of the message, then a `u32` length and the
//! message's bulk bytes (a Raft frame, a blob chunk, a node payload; empty for the
//! others). The bulk bytes ride beside the envelope rather than inside it so that a
//! chunk is written straight from the buffer it was read into and read straight into
//! the buffer it is kept in: bincode never copies it, and neither does the envelope.
//! The envelope still carries the version and says which message the bytes belong to.
//!
//! Both lengths are checked against a hard limit before anything is allocated, and
//! anything that does not open as a gpumesh envelope is an `InvalidData` error. Both
//! fail only the stream they arrived on: request-response reports them as an inbound or
//! outbound failure, and the connection and the node carry on.
//!
//! Every message written or read whole counts its bytes (both lengths, the envelope,
//! the bulk bytes) in the node's metrics: blob chunk requests and their answers in
//! the `blob` lane, everything else in the `call` lane. Node requests
//! ([`MeshRequest::Node`]) travel on the call lane's streams (see `call_lane`); one
//! that comes through request-response is answered with an error that says so,
//! and the node never sees it.

use std::io;

use async_trait::async_trait;
use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use gpumesh_protocol::{open, seal, MeshRequest, MeshResponse};
use libp2p::StreamProtocol;
use serde::{de::DeserializeOwned, Serialize};

use crate::metrics::{Lane, NetMetrics};

/// The stream protocol every gpumesh request rides on.
pub const MESH_PROTOCOL: StreamProtocol = StreamProtocol::new(gpumesh_protocol::lane!("mesh"));

/// A liar's length prefix must not make us allocate its claim up front: buffers start
/// at most this big and grow only as bytes actually arrive.
const INITIAL_BUFFER: usize = 4 << 20;

#[derive(Clone, Debug)]
pub(crate) struct MeshCodec {
    max_frame_bytes: usize,
    metrics: NetMetrics,
}

impl MeshCodec {
    pub(crate) fn new(max_frame_bytes: usize) -> Self {
        MeshCodec {
            max_frame_bytes,
            metrics: NetMetrics::default(),
        }
    }

    /// Counts the bytes of every message in `metrics`.
    pub(crate) fn counted_in(self, metrics: NetMetrics) -> Self {
        MeshCodec { metrics, ..self }
    }
}

/// A message whose bulk bytes can travel outside its envelope.
trait Bulk {
    /// Takes the bulk bytes out, leaving an empty vector in their place.
    fn detach(&mut self) -> Vec<u8>;
    /// Puts received bulk bytes back; fails if this message has no place for them.
    fn attach(&mut self, body: Vec<u8>) -> Result<(), Vec<u8>>;
    /// The metrics lane this message's bytes count in.
    fn lane(&self) -> Lane;
}

impl Bulk for MeshRequest {
    fn detach(&mut self) -> Vec<u8> {
        match self {
            MeshRequest::Node(bytes) => std::mem::take(bytes),
            MeshRequest::BlobChunk { .. } => Vec::new(),
        }
    }

    fn attach(&mut self, body: Vec<u8>) -> Result<(), Vec<u8>> {
        match self {
            MeshRequest::Node(bytes) if bytes.is_empty() => {
                *bytes = body;
                Ok(())
            }
            _ => Err(body),
        }
    }

    fn lane(&self) -> Lane {
        match self {
            MeshRequest::BlobChunk { .. } => Lane::Blob,
            MeshRequest::Node(_) => Lane::Call,
        }
    }
}

impl Bulk for MeshResponse {
    fn detach(&mut self) -> Vec<u8> {
        match self {
            MeshResponse::BlobChunk { data, .. } | MeshResponse::Node(data) => std::mem::take(data),
            MeshResponse::NotFound | MeshResponse::Error(_) => Vec::new(),
        }
    }

    fn attach(&mut self, body: Vec<u8>) -> Result<(), Vec<u8>> {
        match self {
            MeshResponse::BlobChunk { data, .. } | MeshResponse::Node(data) if data.is_empty() => {
                *data = body;
                Ok(())
            }
            _ => Err(body),
        }
    }

    fn lane(&self) -> Lane {
        match self {
            // Only blob chunk requests are answered `NotFound`.
            MeshResponse::BlobChunk { .. } | MeshResponse::NotFound => Lane::Blob,
            MeshResponse::Node(_) | MeshResponse::Error(_) => Lane::Call,
        }
    }
}

fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

async fn read_len<T: AsyncRead + Unpin>(io: &mut T) -> io::Result<usize> {
    let mut prefix = [0u8; 4];
    io.read_exact(&mut prefix).await?;
    Ok(u32::from_le_bytes(prefix) as usize)
}

/// Exactly `len` bytes; allocated up front only up to [`INITIAL_BUFFER`].
async fn read_exactly<T: AsyncRead + Unpin>(io: &mut T, len: usize) -> io::Result<Vec<u8>> {
    if len <= INITIAL_BUFFER {
        let mut buf = vec![0u8; len];
        io.read_exact(&mut buf).await.map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("frame cut short (wanted {len} bytes): {e}"),
            )
        })?;
        return Ok(buf);
    }
    let mut buf = Vec::with_capacity(INITIAL_BUFFER);
    io.take(len as u64).read_to_end(&mut buf).await?;
    if buf.len() != len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("frame cut short: {} of {len} bytes", buf.len()),
        ));
    }
    Ok(buf)
}

/// One message and the bytes it took on the stream.
async fn read_frame<T, M>(io: &mut T, max: usize) -> io::Result<(M, usize)>
where
    T: AsyncRead + Unpin + Send,
    M: DeserializeOwned + Bulk,
{
    let header_len = read_len(io).await?;
    if header_len > max {
        return Err(invalid(format!(
            "frame of {header_len} bytes exceeds the limit of {max}"
        )));
    }
    let header = read_exactly(io, header_len).await?;
    let mut message: M = open(&header).map_err(|e| invalid(e.to_string()))?;
    let body_len = read_len(io).await?;
    if header_len + body_len > max {
        return Err(invalid(format!(
            "frame of {} bytes exceeds the limit of {max}",
            header_len + body_len
        )));
    }
    if body_len > 0 {
        let body = read_exactly(io, body_len).await?;
        message
            .attach(body)
            .map_err(|_| invalid("bulk bytes after a message that takes none".into()))?;
    }
    Ok((message, 8 + header_len + body_len))
}

/// Writes one message; returns the bytes it took on the stream.
async fn write_frame<T, M>(io: &mut T, max: usize, mut message: M) -> io::Result<usize>
where
    T: AsyncWrite + Unpin + Send,
    M: Serialize + Bulk,
{
    let body = message.detach();
    let header = seal(&message).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // Refused here too, so that an over-size message fails with a clear reason on the
    // sender instead of as a reset stream on the receiver.
    if header.len() + body.len() > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "message of {} bytes exceeds the frame limit of {max}",
                header.len() + body.len()
            ),
        ));
    }
    // Both fit in a u32: `max` is at most the codec's 64 MiB limit.
    let mut head = Vec::with_capacity(header.len() + 8);
    head.extend_from_slice(&(header.len() as u32).to_le_bytes());
    head.extend_from_slice(&header);
    head.extend_from_slice(&(body.len() as u32).to_le_bytes());
    // Two writes, not four: each write on a Yamux stream becomes at least one frame.
    io.write_all(&head).await?;
    if !body.is_empty() {
        io.write_all(&body).await?;
    }
    io.flush().await?;
    Ok(head.len() + body.len())
}

impl MeshCodec {
    async fn read<T, M>(&self, io: &mut T) -> io::Result<M>
    where
        T: AsyncRead + Unpin + Send,
        M: DeserializeOwned + Bulk,
    {
        let (message, bytes) = read_frame::<T, M>(io, self.max_frame_bytes).await?;
        self.metrics.received(message.lane(), bytes);
        Ok(message)
    }

    async fn write<T, M>(&self, io: &mut T, message: M) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
        M: Serialize + Bulk,
    {
        let lane = message.lane();
        let bytes = write_frame(io, self.max_frame_bytes, message).await?;
        self.metrics.sent(lane, bytes);
        Ok(())
    }
}

#[async_trait]
impl libp2p::request_response::Codec for MeshCodec {
    type Protocol = StreamProtocol;
    type Request = MeshRequest;
    type Response = MeshResponse;

    async fn read_request<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<MeshRequest>
    where
        T: AsyncRead + Unpin + Send,
    {
        self.read(io).await
    }

    async fn read_response<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<MeshResponse>
    where
        T: AsyncRead + Unpin + Send,
    {
        self.read(io).await
    }

    async fn write_request<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        request: MeshRequest,
    ) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        self.write(io, request).await
    }

    async fn write_response<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        response: MeshResponse,
    ) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        self.write(io, response).await
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use futures::io::Cursor;
    use gpumesh_protocol::BlobId;
    use libp2p::request_response::Codec;

    use super::*;

    fn framed(body: &[u8]) -> Vec<u8> {
        let mut out = (body.len() as u32).to_le_bytes().to_vec();
        out.extend_from_slice(body);
        out
    }

    #[tokio::test]
    async fn every_message_round_trips_with_its_bulk_bytes_beside_the_envelope() {
        let mut codec = MeshCodec::new(1 << 20);
        let requests = [
            MeshRequest::Node(vec![9; 1000]),
            MeshRequest::Node(vec![]),
            MeshRequest::Node(b"call".to_vec()),
            MeshRequest::BlobChunk {
                id: BlobId::of(b"x"),
                offset: 5,
                len: 7,
            },
        ];
        for request in requests {
            let mut wire = Cursor::new(Vec::new());
            codec
                .write_request(&MESH_PROTOCOL, &mut wire, request.clone())
                .await
                .unwrap();
            let mut wire = Cursor::new(wire.into_inner());
            let back = codec.read_request(&MESH_PROTOCOL, &mut wire).await.unwrap();
            assert_eq!(back, request);
        }
        let responses = [
            MeshResponse::BlobChunk {
                total: 1 << 40,
                data: vec![3; 70_000],
            },
            MeshResponse::Node(vec![1]),
            MeshResponse::Error("no".into()),
        ];
        for response in responses {
            let mut wire = Cursor::new(Vec::new());
            codec
                .write_response(&MESH_PROTOCOL, &mut wire, response.clone())
                .await
                .unwrap();
            let bytes = wire.into_inner();
            if let MeshResponse::BlobChunk { data, .. } = &response {
                // The chunk is not inside the envelope: the frame is the chunk plus
                // a few dozen bytes.
                assert!(bytes.len() < data.len() + 64, "{}", bytes.len());
                assert_eq!(&bytes[bytes.len() - data.len()..], &data[..]);
            }
            let back = codec
                .read_response(&MESH_PROTOCOL, &mut Cursor::new(bytes))
                .await
                .unwrap();
            assert_eq!(back, response);
        }
    }

    #[tokio::test]
    async fn garbage_oversize_and_short_frames_are_errors_not_panics() {
        let mut codec = MeshCodec::new(1024);
        let blob = seal(&MeshRequest::BlobChunk {
            id: gpumesh_protocol::BlobId::of(b"p"),
            offset: 0,
            len: 1,
        })
        .unwrap();
        let node = seal(&MeshRequest::Node(vec![])).unwrap();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (framed(b"hello there, not an envelope"), "magic"),
            (u32::MAX.to_le_bytes().to_vec(), "exceeds the limit"),
            (framed(&[0u8; 2000]), "exceeds the limit"),
            (framed(&[0u8; 10])[..8].to_vec(), "cut short"),
            (vec![1, 2], "end of file"),
            // A good header, then a body over the limit, cut short, or misplaced.
            (
                [framed(&node), 5000u32.to_le_bytes().to_vec()].concat(),
                "exceeds the limit",
            ),
            (
                [framed(&node), framed(&[1; 100])[..50].to_vec()].concat(),
                "cut short",
            ),
            ([framed(&blob), framed(&[1; 10])].concat(), "bulk bytes"),
            (framed(&node), "end of file"),
        ];
        for (bytes, expect) in cases {
            let err = codec
                .read_request(&MESH_PROTOCOL, &mut Cursor::new(bytes))
                .await
                .unwrap_err();
            assert!(
                err.to_string().to_lowercase().contains(expect),
                "{err} should mention {expect}"
            );
        }
    }

    mod fuzz {
        //! Arbitrary byte streams, and valid frames with arbitrary edits, read as
        //! requests and responses: an answer or an error, never a panic, and never
        //! more than the frame limit kept. `PROPTEST_CASES=N` runs more.

        use futures::executor::block_on;
        use proptest::prelude::*;

        use super::*;

        const LIMIT: usize = 4096;

        fn read_both(bytes: &[u8]) -> (io::Result<MeshRequest>, io::Result<MeshResponse>) {
            let mut codec = MeshCodec::new(LIMIT);
            block_on(async {
                let request = codec
                    .read_request(&MESH_PROTOCOL, &mut Cursor::new(bytes))
                    .await;
                let response = codec
                    .read_response(&MESH_PROTOCOL, &mut Cursor::new(bytes))
                    .await;
                (request, response)
            })
        }

        /// What was read goes out again as a frame within the limit that reads back
        /// the same: a message that decodes is a real message.
        fn check_decoded(bytes: &[u8]) -> Result<(), TestCaseError> {
            let (request, response) = read_both(bytes);
            let mut codec = MeshCodec::new(LIMIT);
            if let Ok(request) = request {
                let mut wire = Cursor::new(Vec::new());
                block_on(codec.write_request(&MESH_PROTOCOL, &mut wire, request.clone()))?;
                prop_assert!(wire.get_ref().len() <= LIMIT + 8);
                prop_assert_eq!(read_both(&wire.into_inner()).0?, request);
            }
            if let Ok(response) = response {
                let mut wire = Cursor::new(Vec::new());
                block_on(codec.write_response(&MESH_PROTOCOL, &mut wire, response.clone()))?;
                prop_assert!(wire.get_ref().len() <= LIMIT + 8);
                prop_assert_eq!(read_both(&wire.into_inner()).1?, response);
            }
            Ok(())
        }

        fn valid_frame() -> impl Strategy<Value = Vec<u8>> {
            let data = proptest::collection::vec(any::<u8>(), 0..600);
            let message = prop_oneof![
                data.clone()
                    .prop_map(|d| (Some(MeshRequest::Node(d)), None)),
                (any::<[u8; 32]>(), any::<u64>(), any::<u32>()).prop_map(|(h, offset, len)| {
                    (
                        Some(MeshRequest::BlobChunk {
                            id: gpumesh_protocol::BlobId(h),
                            offset,
                            len,
                        }),
                        None,
                    )
                }),
                (any::<u64>(), data.clone()).prop_map(|(total, data)| (
                    None,
                    Some(MeshResponse::BlobChunk { total, data })
                )),
                data.prop_map(|d| (None, Some(MeshResponse::Node(d)))),
                ".{0,40}".prop_map(|e| (None, Some(MeshResponse::Error(e)))),
                Just((None, Some(MeshResponse::NotFound))),
            ];
            message.prop_map(|(request, response)| {
                let mut codec = MeshCodec::new(LIMIT);
                let mut wire = Cursor::new(Vec::new());
                block_on(async {
                    match (request, response) {
                        (Some(r), _) => codec.write_request(&MESH_PROTOCOL, &mut wire, r).await,
                        (_, Some(r)) => codec.write_response(&MESH_PROTOCOL, &mut wire, r).await,
                        (None, None) => Ok(()),
                    }
                })
                .unwrap();
                wire.into_inner()
            })
        }

        /// (position, bytes to write there, bytes to cut there); positions wrap.
        fn edits() -> impl Strategy<Value = Vec<(usize, Vec<u8>, usize)>> {
            proptest::collection::vec(
                (
                    any::<usize>(),
                    proptest::collection::vec(any::<u8>(), 0..6),
                    0usize..8,
                ),
                1..5,
            )
        }

        proptest! {
            #[test]
            fn arbitrary_streams_are_read_or_refused(
                bytes in proptest::collection::vec(any::<u8>(), 0..2048),
            ) {
                check_decoded(&bytes)?;
            }

            #[test]
            fn streams_with_plausible_lengths_are_read_or_refused(
                header_len in 0u32..(LIMIT as u32 * 2),
                body_len in prop_oneof![0u32..(LIMIT as u32 * 2), any::<u32>()],
                header in proptest::collection::vec(any::<u8>(), 0..256),
                tail in proptest::collection::vec(any::<u8>(), 0..512),
            ) {
                // A header that may even open as an envelope, then a body length.
                let mut bytes = header_len.to_le_bytes().to_vec();
                bytes.extend_from_slice(b"GPMH");
                bytes.extend_from_slice(&gpumesh_protocol::FORMAT.to_le_bytes());
                bytes.extend_from_slice(&header);
                bytes.extend_from_slice(&body_len.to_le_bytes());
                bytes.extend_from_slice(&tail);
                check_decoded(&bytes)?;
            }

            #[test]
            fn edited_valid_frames_are_read_or_refused(frame in valid_frame(), edits in edits()) {
                let mut bytes = frame;
                for (at, write, cut) in edits {
                    let at = at % (bytes.len() + 1);
                    let end = (at + cut).min(bytes.len());
                    bytes.splice(at..end, write);
                }
                check_decoded(&bytes)?;
            }
        }
    }

    #[tokio::test]
    async fn the_bytes_of_each_message_count_in_its_lane_as_they_go_on_the_stream() {
        let metrics = NetMetrics::default();
        let mut codec = MeshCodec::new(1 << 20).counted_in(metrics.clone());
        let mut chunk = Cursor::new(Vec::new());
        let answer = MeshResponse::BlobChunk {
            total: 5000,
            data: vec![7; 5000],
        };
        codec
            .write_response(&MESH_PROTOCOL, &mut chunk, answer)
            .await
            .unwrap();
        let mut call = Cursor::new(Vec::new());
        codec
            .write_request(&MESH_PROTOCOL, &mut call, MeshRequest::Node(vec![1; 30]))
            .await
            .unwrap();
        let (chunk, call) = (chunk.into_inner(), call.into_inner());
        assert_eq!(metrics.totals(Lane::Blob), (chunk.len() as u64, 0));
        assert_eq!(metrics.totals(Lane::Call), (call.len() as u64, 0));
        codec
            .read_response(&MESH_PROTOCOL, &mut Cursor::new(chunk.clone()))
            .await
            .unwrap();
        codec
            .read_request(&MESH_PROTOCOL, &mut Cursor::new(call.clone()))
            .await
            .unwrap();
        let both = |n: usize| (n as u64, n as u64);
        assert_eq!(metrics.totals(Lane::Blob), both(chunk.len()));
        assert_eq!(metrics.totals(Lane::Call), both(call.len()));
        // What fails to decode is not counted.
        let _ = codec
            .read_request(&MESH_PROTOCOL, &mut Cursor::new(framed(b"garbage")))
            .await
            .unwrap_err();
        assert_eq!(metrics.totals(Lane::Call), both(call.len()));
        assert_eq!(metrics.totals(Lane::Raft), (0, 0));
    }

    #[tokio::test]
    async fn an_oversize_message_is_refused_before_it_is_sent() {
        let mut codec = MeshCodec::new(100);
        let mut wire = Cursor::new(Vec::new());
        let err = codec
            .write_request(&MESH_PROTOCOL, &mut wire, MeshRequest::Node(vec![0; 200]))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("frame limit"), "{err}");
        assert!(wire.into_inner().is_empty());
    }
}
