//! What nodes say to each other over the mesh's request-response protocol.
//!
//! Every exchange is one [`MeshRequest`] answered by one [`MeshResponse`], each sealed
//! in the versioned [envelope](crate::envelope) and length-prefixed on its own stream
//! by the node's network actor. Raft frames and node-level requests are opaque bytes
//! here: this crate does not know the consensus crate's types, and the network layer
//! does not need to look inside them.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::BlobId;

/// A request from one peer to another.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum MeshRequest {
    /// Up to `len` bytes of blob `id` starting at `offset`. Answered with
    /// [`MeshResponse::BlobChunk`] (fewer bytes at the end of the blob) or
    /// [`MeshResponse::NotFound`]. The fetcher checks the assembled blob against `id`,
    /// so a chunk needs no hash of its own.
    BlobChunk { id: BlobId, offset: u64, len: u32 },
    /// An opaque node-level request (hello, join, peers, replicate); its encoding
    /// belongs to the node crate. Answered with [`MeshResponse::Node`] or
    /// [`MeshResponse::Error`].
    Node(#[serde(with = "bytes")] Vec<u8>),
}

impl MeshRequest {
    /// A short name for logs, without the (possibly large) payload.
    pub fn kind(&self) -> &'static str {
        match self {
            MeshRequest::BlobChunk { .. } => "blob-chunk",
            MeshRequest::Node(_) => "node",
        }
    }
}

/// The answer to one [`MeshRequest`].
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub enum MeshResponse {
    /// Bytes of a blob; `total` is the whole blob's size, so the first chunk tells the
    /// fetcher how many more to ask for.
    BlobChunk {
        total: u64,
        #[serde(with = "bytes")]
        data: Vec<u8>,
    },
    /// The peer does not have the blob that was asked for.
    NotFound,
    /// The answer to [`MeshRequest::Node`], encoded by the node crate.
    Node(#[serde(with = "bytes")] Vec<u8>),
    /// The peer could not serve the request; the text says why, for the user.
    Error(String),
}

// Hand-written so that a log line with a 1 MiB chunk in it stays one line.
impl fmt::Debug for MeshResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MeshResponse::BlobChunk { total, data } => f
                .debug_struct("BlobChunk")
                .field("total", total)
                .field("len", &data.len())
                .finish(),
            MeshResponse::NotFound => f.write_str("NotFound"),
            MeshResponse::Node(bytes) => write!(f, "Node({} bytes)", bytes.len()),
            MeshResponse::Error(reason) => f.debug_tuple("Error").field(reason).finish(),
        }
    }
}

/// Byte payloads as one length-prefixed run of bytes instead of serde's default
/// sequence of `u8`s: the same size on the wire, but encoded and decoded with a copy
/// instead of a loop per byte, which is what blob transfer throughput hinges on.
/// For `#[serde(with = "gpumesh_protocol::mesh::bytes")]` on a `Vec<u8>`.
pub mod bytes {
    use std::fmt;

    use serde::de::{SeqAccess, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(bytes)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        deserializer.deserialize_byte_buf(BytesVisitor)
    }

    struct BytesVisitor;

    impl<'de> Visitor<'de> for BytesVisitor {
        type Value = Vec<u8>;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a byte array")
        }

        fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
            Ok(v.to_vec())
        }

        fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
            Ok(v)
        }

        // Formats without a native byte type (e.g. JSON for debugging) send a sequence.
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
            while let Some(b) = seq.next_element()? {
                out.push(b);
            }
            Ok(out)
        }
    }
}

/// [`bytes`] for an `Option<Vec<u8>>`: the same encoding as serde's default, so
/// data written before it decodes alike. For
/// `#[serde(with = "gpumesh_protocol::mesh::opt_bytes")]`.
pub mod opt_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    use super::{AsBytes, ByteBuf};

    pub fn serialize<S: Serializer>(
        bytes: &Option<Vec<u8>>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match bytes {
            Some(b) => serializer.serialize_some(&AsBytes(b)),
            None => serializer.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<Vec<u8>>, D::Error> {
        Ok(Option::<ByteBuf>::deserialize(deserializer)?.map(|b| b.0))
    }
}

/// [`bytes`] for each of a `Vec<Vec<u8>>`: the same encoding as serde's default.
/// For `#[serde(with = "gpumesh_protocol::mesh::bytes_list")]`.
pub mod bytes_list {
    use serde::{Deserialize, Deserializer, Serializer};

    use super::{AsBytes, ByteBuf};

    pub fn serialize<S: Serializer>(list: &[Vec<u8>], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(list.iter().map(|b| AsBytes(b)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Vec<Vec<u8>>, D::Error> {
        Ok(Vec::<ByteBuf>::deserialize(deserializer)?
            .into_iter()
            .map(|b| b.0)
            .collect())
    }
}

/// [`bytes`] for each value of a `BTreeMap<K, Vec<u8>>`: the same encoding as
/// serde's default. For `#[serde(with = "gpumesh_protocol::mesh::bytes_values")]`.
pub mod bytes_values {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::{AsBytes, ByteBuf};

    pub fn serialize<K: Serialize, S: Serializer>(
        map: &BTreeMap<K, Vec<u8>>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        serializer.collect_map(map.iter().map(|(k, v)| (k, AsBytes(v))))
    }

    pub fn deserialize<'de, K: Deserialize<'de> + Ord, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<BTreeMap<K, Vec<u8>>, D::Error> {
        Ok(BTreeMap::<K, ByteBuf>::deserialize(deserializer)?
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .collect())
    }
}

/// Bytes serialized as [`bytes`] does.
struct AsBytes<'a>(&'a [u8]);

impl Serialize for AsBytes<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        bytes::serialize(self.0, serializer)
    }
}

/// Bytes deserialized as [`bytes`] does.
struct ByteBuf(Vec<u8>);

impl<'de> Deserialize<'de> for ByteBuf {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        bytes::deserialize(deserializer).map(ByteBuf)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::{open, seal};

    #[test]
    fn every_message_survives_the_envelope() {
        let requests = [
            MeshRequest::Node(vec![1, 2, 3]),
            MeshRequest::BlobChunk {
                id: BlobId::of(b"x"),
                offset: 1 << 40,
                len: 1 << 20,
            },
            MeshRequest::Node(vec![]),
        ];
        for request in requests {
            let back: MeshRequest = open(&seal(&request).unwrap()).unwrap();
            assert_eq!(back, request);
        }
        let responses = [
            MeshResponse::BlobChunk {
                total: 9,
                data: vec![7; 9],
            },
            MeshResponse::NotFound,
            MeshResponse::Node(vec![0; 3]),
            MeshResponse::Error("no".into()),
        ];
        for response in responses {
            let back: MeshResponse = open(&seal(&response).unwrap()).unwrap();
            assert_eq!(back, response);
        }
    }

    #[test]
    fn byte_fields_encode_as_serde_s_default_does() {
        // Logs and snapshots written before a field took one of these must decode
        // alike, and the other way round.
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        struct Plain {
            one: Vec<u8>,
            maybe: Option<Vec<u8>>,
            none: Option<Vec<u8>>,
            list: Vec<Vec<u8>>,
        }
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        struct Fast {
            #[serde(with = "bytes")]
            one: Vec<u8>,
            #[serde(with = "opt_bytes")]
            maybe: Option<Vec<u8>>,
            #[serde(with = "opt_bytes")]
            none: Option<Vec<u8>>,
            #[serde(with = "bytes_list")]
            list: Vec<Vec<u8>>,
        }
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        struct PlainMap(std::collections::BTreeMap<u32, Vec<u8>>);
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        struct FastMap(#[serde(with = "bytes_values")] std::collections::BTreeMap<u32, Vec<u8>>);
        let map: std::collections::BTreeMap<u32, Vec<u8>> =
            [(3, vec![1; 5000]), (1, vec![])].into_iter().collect();
        let encoded = crate::codec::to_bytes(&PlainMap(map.clone())).unwrap();
        assert_eq!(
            crate::codec::to_bytes(&FastMap(map.clone())).unwrap(),
            encoded
        );
        assert_eq!(
            crate::codec::from_bytes::<FastMap>(&encoded).unwrap().0,
            map
        );
        let big: Vec<u8> = (0..70_000u32).map(|i| (i % 255) as u8).collect();
        let plain = Plain {
            one: big.clone(),
            maybe: Some(vec![1, 2, 3]),
            none: None,
            list: vec![vec![], big.clone(), vec![9]],
        };
        let fast = Fast {
            one: big.clone(),
            maybe: Some(vec![1, 2, 3]),
            none: None,
            list: vec![vec![], big.clone(), vec![9]],
        };
        let encoded = crate::codec::to_bytes(&plain).unwrap();
        assert_eq!(crate::codec::to_bytes(&fast).unwrap(), encoded);
        assert_eq!(crate::codec::from_bytes::<Fast>(&encoded).unwrap(), fast);
        // And in JSON (for debugging), numbers as before.
        let json = serde_json::to_string(&plain).unwrap();
        assert_eq!(serde_json::to_string(&fast).unwrap(), json);
        assert_eq!(serde_json::from_str::<Fast>(&json).unwrap(), fast);
    }

    #[test]
    fn a_chunk_costs_only_a_few_bytes_more_than_its_data() {
        let data = vec![0xAB; 1 << 20];
        let sealed = seal(&MeshResponse::BlobChunk {
            total: 1 << 30,
            data: data.clone(),
        })
        .unwrap();
        assert!(sealed.len() < data.len() + 32, "{}", sealed.len());
    }

    #[test]
    fn debug_of_a_chunk_does_not_print_its_bytes() {
        let text = format!(
            "{:?}",
            MeshResponse::BlobChunk {
                total: 5,
                data: vec![1; 5]
            }
        );
        assert_eq!(text, "BlobChunk { total: 5, len: 5 }");
    }
}
