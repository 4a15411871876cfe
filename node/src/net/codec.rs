//! How one [`MeshRequest`] / [`MeshResponse`] travels on one libp2p stream: a
//! little-endian `u32` length, then the sealed [envelope](gpumesh_protocol::envelope).
//!
//! The length is checked against a hard limit before anything is allocated, and
//! anything that does not open as a gpumesh envelope is an `InvalidData` error. Both
//! fail only the stream they arrived on: request-response reports them as an inbound or
//! outbound failure, and the connection and the node carry on.

use std::io;

use async_trait::async_trait;
use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use gpumesh_protocol::{open, seal, MeshRequest, MeshResponse};
use libp2p::StreamProtocol;
use serde::{de::DeserializeOwned, Serialize};

/// The stream protocol every gpumesh request rides on.
pub const MESH_PROTOCOL: StreamProtocol = StreamProtocol::new("/gpumesh/mesh/1");

/// A liar's length prefix must not make us allocate its claim up front: buffers start
/// at most this big and grow only as bytes actually arrive.
const INITIAL_BUFFER: usize = 4 << 20;

#[derive(Clone, Debug)]
pub(crate) struct MeshCodec {
    max_frame_bytes: usize,
}

impl MeshCodec {
    pub(crate) fn new(max_frame_bytes: usize) -> Self {
        MeshCodec { max_frame_bytes }
    }
}

async fn read_frame<T, M>(io: &mut T, max: usize) -> io::Result<M>
where
    T: AsyncRead + Unpin + Send,
    M: DeserializeOwned,
{
    let mut prefix = [0u8; 4];
    io.read_exact(&mut prefix).await?;
    let len = u32::from_le_bytes(prefix) as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the limit of {max}"),
        ));
    }
    let mut buf = Vec::with_capacity(len.min(INITIAL_BUFFER));
    io.take(len as u64).read_to_end(&mut buf).await?;
    if buf.len() != len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("frame cut short: {} of {len} bytes", buf.len()),
        ));
    }
    open(&buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

async fn write_frame<T, M>(io: &mut T, max: usize, message: &M) -> io::Result<()>
where
    T: AsyncWrite + Unpin + Send,
    M: Serialize,
{
    let bytes = seal(message).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // Refused here too, so that an over-size message fails with a clear reason on the
    // sender instead of as a reset stream on the receiver.
    if bytes.len() > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "message of {} bytes exceeds the frame limit of {max}",
                bytes.len()
            ),
        ));
    }
    let len = u32::try_from(bytes.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame over 4 GiB"))?;
    io.write_all(&len.to_le_bytes()).await?;
    io.write_all(&bytes).await?;
    io.flush().await
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
        read_frame(io, self.max_frame_bytes).await
    }

    async fn read_response<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<MeshResponse>
    where
        T: AsyncRead + Unpin + Send,
    {
        read_frame(io, self.max_frame_bytes).await
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
        write_frame(io, self.max_frame_bytes, &request).await
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
        write_frame(io, self.max_frame_bytes, &response).await
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use futures::io::Cursor;
    use libp2p::request_response::Codec;

    use super::*;

    fn framed(body: &[u8]) -> Vec<u8> {
        let mut out = (body.len() as u32).to_le_bytes().to_vec();
        out.extend_from_slice(body);
        out
    }

    #[tokio::test]
    async fn a_request_round_trips() {
        let mut codec = MeshCodec::new(1 << 20);
        let mut wire = Cursor::new(Vec::new());
        let request = MeshRequest::Raft(vec![9; 1000]);
        codec
            .write_request(&MESH_PROTOCOL, &mut wire, request.clone())
            .await
            .unwrap();
        let mut wire = Cursor::new(wire.into_inner());
        let back = codec.read_request(&MESH_PROTOCOL, &mut wire).await.unwrap();
        assert_eq!(back, request);
    }

    #[tokio::test]
    async fn garbage_oversize_and_short_frames_are_invalid_data_not_panics() {
        let mut codec = MeshCodec::new(1024);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (framed(b"hello there, not an envelope"), "magic"),
            (u32::MAX.to_le_bytes().to_vec(), "exceeds the limit"),
            (framed(&[0u8; 2000]), "exceeds the limit"),
            ([framed(&[0u8; 10])[..8].to_vec()].concat(), "cut short"),
            (vec![1, 2], "eof"),
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

    #[tokio::test]
    async fn an_oversize_message_is_refused_before_it_is_sent() {
        let mut codec = MeshCodec::new(100);
        let mut wire = Cursor::new(Vec::new());
        let err = codec
            .write_request(&MESH_PROTOCOL, &mut wire, MeshRequest::Raft(vec![0; 200]))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("frame limit"), "{err}");
        assert!(wire.into_inner().is_empty());
    }
}
