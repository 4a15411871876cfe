//! Identifiers: content addresses for bulk data.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::ProtocolError;

/// The blake3 hash of a blob's bytes; blobs are addressed by what they contain.
///
/// On the wire (bincode) it is its 32 bytes; in JSON it is the 64 hex digits that
/// `POST /v1/blobs` answers with, so an HTTP client can put that id straight into a
/// task's bindings (an array of 32 numbers is accepted too).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlobId(pub [u8; 32]);

impl Serialize for BlobId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.serialize_str(&self.to_hex())
        } else {
            self.0.serialize(s)
        }
    }
}

impl<'de> Deserialize<'de> for BlobId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Text {
            Hex(String),
            Bytes([u8; 32]),
        }
        if d.is_human_readable() {
            match Text::deserialize(d)? {
                Text::Hex(s) => s.parse().map_err(serde::de::Error::custom),
                Text::Bytes(b) => Ok(BlobId(b)),
            }
        } else {
            <[u8; 32]>::deserialize(d).map(BlobId)
        }
    }
}

impl BlobId {
    /// The id of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(*blake3::hash(bytes).as_bytes())
    }

    /// Whether `bytes` are the blob this id names.
    pub fn matches(&self, bytes: &[u8]) -> bool {
        *self == Self::of(bytes)
    }

    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }
}

impl fmt::Display for BlobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for BlobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlobId({}…)", &self.to_hex()[..12])
    }
}

impl FromStr for BlobId {
    type Err = ProtocolError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        blake3::Hash::from_hex(s)
            .map(|h| Self(*h.as_bytes()))
            .map_err(|e| ProtocolError::Invalid {
                what: "blob id",
                reason: format!("{s:?} is not 64 hex digits ({e})"),
            })
    }
}
