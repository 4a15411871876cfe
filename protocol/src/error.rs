use thiserror::Error;

/// Everything that can go wrong turning bytes into protocol values.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("message is {len} bytes, shorter than the {need}-byte envelope header")]
    TooShort { len: usize, need: usize },
    #[error("not a gpumesh message (magic bytes {found:02x?})")]
    BadMagic { found: [u8; 4] },
    #[error("a message of gpumesh data format {theirs}, this node format {ours}: run one gpumesh build on every node")]
    VersionMismatch { ours: u16, theirs: u16 },
    #[error("message of {len} bytes exceeds the {limit}-byte limit")]
    TooLarge { len: usize, limit: usize },
    #[error("could not encode message: {0}")]
    Encode(String),
    #[error("could not decode message: {0}")]
    Decode(String),
    #[error("{0} trailing bytes after the message")]
    TrailingBytes(usize),
    #[error("invalid {what}: {reason}")]
    Invalid { what: &'static str, reason: String },
}

pub type Result<T, E = ProtocolError> = std::result::Result<T, E>;
