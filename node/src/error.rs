use std::path::Path;

use gpumesh_protocol::BlobId;
use thiserror::Error;

/// Everything a node can fail at, each saying what to do where there is something.
#[derive(Debug, Error)]
pub enum NodeError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("blob {id} does not match its content (hashes to {got})")]
    BlobMismatch { id: BlobId, got: BlobId },
    #[error(
        "{len} bytes of blob {id} sent in a request: a blob over {limit} bytes is pulled, not sent"
    )]
    SentTooLarge { id: BlobId, len: u64, limit: u64 },
    #[error("{what} is {value}, over the limit of {limit} (the node's {setting})")]
    Limit {
        what: &'static str,
        value: u64,
        limit: u64,
        /// The `gpumesh node` flag that sets the limit.
        setting: &'static str,
    },
    // Its text holds RESERVE_MARK: the API knows it by that when it comes as text.
    #[error(
        "{path} has {} free, and {} more would leave less than this node's disk reserve of \
         {} (--disk-reserve): new data is refused so that the mesh's record can still be \
         written. `gpumesh forget` finished tasks (their results leave every disk), or free \
         space on that disk",
        mib(*free),
        mib(*adding),
        mib(*reserve)
    )]
    DiskReserve {
        path: String,
        /// Bytes free, less those promised to blobs still arriving.
        free: u64,
        /// The blob's bytes.
        adding: u64,
        reserve: u64,
    },
    #[error("{0}")]
    Config(String),
    /// A node message that could not be encoded, or bytes that are not one (a peer
    /// of another version, or garbage).
    #[error("node message codec: {0}")]
    Codec(#[from] gpumesh_protocol::ProtocolError),
    #[error(transparent)]
    Consensus(#[from] gpumesh_consensus::ConsensusError),
    // Network (net actor) errors.
    #[error("could not start the network: {0}")]
    NetSetup(String),
    #[error("could not connect to {addr}: {reason}; check that a gpumesh node listens there and uses the same cluster key")]
    Dial { addr: String, reason: String },
    #[error("{addr} did not complete a connection within {secs:.1}s; check the address, the firewall, and that the node there uses the same cluster key")]
    DialTimeout { addr: String, secs: f64 },
    #[error("request to peer {peer} failed: {reason}")]
    Request { peer: String, reason: String },
    /// Nothing was sent: no stream to the peer could be opened (no connection and
    /// no address to dial, the dial refused).
    #[error("could not reach peer {peer}: {reason}")]
    Unreached { peer: String, reason: String },
    #[error("peer {peer} answered: {reason}")]
    PeerRefused { peer: String, reason: String },
    #[error("peer {peer} does not have blob {id}")]
    BlobNotFound { id: BlobId, peer: String },
    #[error("the network actor is busy ({0}); try again")]
    NetBusy(&'static str),
    #[error("the network actor has stopped (the node is shutting down)")]
    NetStopped,
    // Blobs (the blobs actor) errors.
    /// No member handed the blob over: every possible holder was tried, connections
    /// made where there were none, for several rounds.
    #[error("blob {id} could not be fetched: {reason}")]
    BlobUnavailable { id: BlobId, reason: String },
    /// No other member kept a copy of a blob this node holds.
    #[error("no second copy of blob {blob}: {reason}")]
    NoSecondCopy { blob: BlobId, reason: String },
    #[error("the node is stopping")]
    Stopping,
}

impl NodeError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        NodeError::Io {
            path: path.display().to_string(),
            source,
        }
    }

    /// Whether the file system had no room for a write (or the file grew past what
    /// it allows): an error that retrying does not mend.
    pub fn is_disk_full(&self) -> bool {
        match self {
            NodeError::DiskReserve { .. } => true,
            NodeError::Io { source, .. } => matches!(
                source.raw_os_error(),
                Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG)
            ),
            _ => false,
        }
    }
}

pub type Result<T, E = NodeError> = std::result::Result<T, E>;

/// `bytes` in MiB, to a tenth.
fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

/// What the text of [`NodeError::DiskReserve`] holds, and no other error's: how the
/// refusal is known once it has become text (a pull's answer, a merge's reason).
pub(crate) const RESERVE_MARK: &str = "(--disk-reserve)";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_refusal_is_known_by_its_mark_and_no_other_error() {
        let reserve = NodeError::DiskReserve {
            path: "d/blobs".into(),
            free: 300 << 20,
            adding: 50 << 20,
            reserve: 256 << 20,
        };
        let text = reserve.to_string();
        assert!(text.contains(RESERVE_MARK), "{text}");
        assert!(
            text.contains("300.0 MiB free, and 50.0 MiB more") && text.contains("256.0 MiB"),
            "{text}"
        );
        assert!(reserve.is_disk_full());
        let other = NodeError::io(Path::new("d/blobs"), std::io::Error::other("boom"));
        assert!(!other.to_string().contains(RESERVE_MARK));
    }
}
