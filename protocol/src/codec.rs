//! The only place gpumesh turns values into bytes and back.
//!
//! bincode 2 in serde mode with a fixed configuration: little-endian, variable-length
//! integers, and a hard limit on how much one message may claim, so a hostile length
//! prefix cannot make a node allocate gigabytes.

use serde::{de::DeserializeOwned, Serialize};

use crate::error::{ProtocolError, Result};

/// The most bytes one decoded message may claim (blob chunks are well below it).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_MESSAGE_BYTES>()
}

/// Encodes `value`; fails only if it exceeds [`MAX_MESSAGE_BYTES`].
pub fn to_bytes<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    let bytes = bincode::serde::encode_to_vec(value, config())
        .map_err(|e| ProtocolError::Encode(e.to_string()))?;
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(ProtocolError::TooLarge {
            len: bytes.len(),
            limit: MAX_MESSAGE_BYTES,
        });
    }
    Ok(bytes)
}

/// Decodes exactly one value from `bytes`; trailing bytes are an error.
pub fn from_bytes<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(ProtocolError::TooLarge {
            len: bytes.len(),
            limit: MAX_MESSAGE_BYTES,
        });
    }
    let (value, read) = bincode::serde::decode_from_slice(bytes, config())
        .map_err(|e| ProtocolError::Decode(e.to_string()))?;
    if read != bytes.len() {
        return Err(ProtocolError::TrailingBytes(bytes.len() - read));
    }
    Ok(value)
}
