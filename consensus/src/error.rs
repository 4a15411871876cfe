//! The one error type of this crate.

use thiserror::Error;

use crate::cluster::ClusterId;
use crate::command::RequestId;

/// Everything that can go wrong in the replicated record.
#[derive(Debug, Error)]
pub enum ConsensusError {
    /// The storage file could not be opened, read or written.
    #[error("consensus storage at {path}: {reason}")]
    Storage { path: String, reason: String },

    /// The storage holds bytes we cannot decode: refusing to guess what they meant.
    #[error(
        "consensus storage at {path} is corrupt ({what}); refusing to start. Restore the data \
         directory from a backup, or remove it and re-join the mesh as a new member"
    )]
    CorruptStorage { path: String, what: String },

    /// The storage was initialised for another mesh.
    #[error(
        "consensus storage at {path} belongs to cluster {found}, not {expected}; refusing to \
         mix their records. Point --data-dir at this mesh's directory or at an empty one"
    )]
    ClusterMismatch {
        path: String,
        expected: ClusterId,
        found: ClusterId,
    },

    /// `initialize` was called on storage that already holds a Raft state.
    #[error("consensus storage at {path} is already initialised; start without --init to rejoin")]
    AlreadyInitialized { path: String },

    /// An error from raft-rs itself.
    #[error("raft: {0}")]
    Raft(#[from] raft::Error),

    /// A value could not be encoded or decoded.
    #[error("codec: {0}")]
    Codec(#[from] gpumesh_protocol::ProtocolError),

    /// A protobuf Raft message could not be encoded or decoded.
    #[error("raft message codec: {0}")]
    Protobuf(#[from] protobuf::ProtobufError),

    /// A frame from a peer was not acceptable (wrong cluster, spoofed sender...).
    #[error("rejected message from peer {from}: {reason}")]
    BadMessage { from: u64, reason: String },

    /// No leader is known, and the proposal was never handed to one: it did not commit.
    #[error("no Raft leader is known; the proposal was not submitted (retry later)")]
    NoLeader,

    /// The proposal certainly did not commit (overwritten by a new leader, or refused).
    #[error("proposal {request_id} was dropped and did not commit: {reason}; it is safe to retry")]
    ProposalDropped {
        request_id: RequestId,
        reason: String,
    },

    /// The proposal may or may not have committed.
    #[error(
        "outcome of proposal {request_id} is unknown ({reason}); retry with the same request id, \
         which is applied at most once"
    )]
    OutcomeUnknown {
        request_id: RequestId,
        reason: String,
    },

    /// A linearizable read could not be served before its deadline; `reason` says
    /// which step did not happen (no leader known, the leader not confirmed by a
    /// quorum, or this replica not caught up to the read index).
    #[error(
        "linearizable read timed out: {reason}; retry later, or read locally for a possibly \
         stale answer"
    )]
    ReadTimeout { reason: String },

    /// The request was invalid before reaching Raft.
    #[error("invalid request: {0}")]
    Invalid(String),

    /// The consensus actor has stopped (shut down, or a storage failure stopped it).
    #[error("the consensus actor has stopped")]
    Stopped,
}

/// Result with [`ConsensusError`].
pub type Result<T, E = ConsensusError> = std::result::Result<T, E>;
