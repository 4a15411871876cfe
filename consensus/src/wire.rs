//! What replicas say to each other, as bytes handed to a [`Transport`].
//!
//! Every frame is a `gpumesh_protocol` envelope (magic + wire version) around a
//! [`Frame`]: the cluster id (so two meshes never mix records even if their
//! transports meet), the sender's raft id, and one of: a Raft message (protobuf, as
//! raft-rs defines it), a proposal forwarded to the leader, or the leader's answer.
//!
//! [`Transport`]: crate::transport::Transport

use gpumesh_protocol::envelope;
use protobuf::Message as _;
use raft::eraftpb::Message as RaftMessage;
use serde::{Deserialize, Serialize};

use crate::cluster::ClusterId;
use crate::command::{LogEntry, RequestId};
use crate::error::Result;

/// One message between replicas.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Frame {
    pub cluster: ClusterId,
    pub from: u64,
    pub body: FrameBody,
}

/// The kinds of message replicas exchange.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum FrameBody {
    /// A raft-rs message, protobuf-encoded.
    Raft(#[serde(with = "gpumesh_protocol::mesh::bytes")] Vec<u8>),
    /// A follower hands a proposal to the node it believes leads.
    Forward(LogEntry),
    /// The leader appended the forwarded proposal at (`index`, `term`): it commits
    /// exactly when the entry found at `index` later carries `term`.
    ForwardAccepted {
        request_id: RequestId,
        index: u64,
        term: u64,
    },
    /// The receiver did not append the proposal (not the leader, or refused).
    ForwardRefused {
        request_id: RequestId,
        /// The leader the receiver knows of (0 if none).
        leader: u64,
        reason: String,
    },
}

impl Frame {
    pub fn encode(&self) -> Result<Vec<u8>> {
        Ok(envelope::seal(self)?)
    }

    pub fn decode(bytes: &[u8]) -> Result<Self> {
        Ok(envelope::open(bytes)?)
    }
}

pub fn encode_raft(msg: &RaftMessage) -> Result<Vec<u8>> {
    Ok(msg.write_to_bytes()?)
}

pub fn decode_raft(bytes: &[u8]) -> Result<RaftMessage> {
    Ok(RaftMessage::parse_from_bytes(bytes)?)
}
