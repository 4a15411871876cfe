//! The versioned frame every gpumesh message travels in.
//!
//! Layout: 4 magic bytes `GPMH`, the format ([`FORMAT`]) as a little-endian `u16`, then the
//! codec payload. A peer speaking another version gets
//! [`ProtocolError::VersionMismatch`] instead of a misread message.

use serde::{de::DeserializeOwned, Serialize};

use crate::codec;
use crate::error::{ProtocolError, Result};
use crate::format::FORMAT;

/// Magic bytes that open every envelope.
pub const MAGIC: [u8; 4] = *b"GPMH";
const HEADER_LEN: usize = MAGIC.len() + 2;

/// Frames `message` for the wire.
pub fn seal<T: Serialize>(message: &T) -> Result<Vec<u8>> {
    let payload = codec::to_bytes(message)?;
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT.to_le_bytes());
    out.extend_from_slice(&payload);
    Ok(out)
}

/// Checks the frame and decodes the message inside it.
pub fn open<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    if bytes.len() < HEADER_LEN {
        return Err(ProtocolError::TooShort {
            len: bytes.len(),
            need: HEADER_LEN,
        });
    }
    let mut found = [0u8; 4];
    found.copy_from_slice(&bytes[..4]);
    if found != MAGIC {
        return Err(ProtocolError::BadMagic { found });
    }
    let theirs = u16::from_le_bytes([bytes[4], bytes[5]]);
    if theirs != FORMAT {
        return Err(ProtocolError::VersionMismatch {
            ours: FORMAT,
            theirs,
        });
    }
    codec::from_bytes(&bytes[HEADER_LEN..])
}
