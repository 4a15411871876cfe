//! Node-level messages, carried inside `MeshRequest::Node` / `MeshResponse::Node`.

use gpumesh_protocol::mesh::{MeshRequest, MeshResponse};
use gpumesh_protocol::NodeCapability;
use libp2p::PeerId;
use serde::{Deserialize, Serialize};

use crate::error::{NodeError, Result};
use crate::net::NetHandle;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum NodeRequest {
    /// Who are you, and which mesh are you in?
    Hello,
    /// Add me (the authenticated sender) to your mesh as a learner.
    Join { capability: Option<NodeCapability> },
    /// Which peers do you know, and where do they listen?
    Peers,
    /// Keep a copy of this blob, pulled from me, before I report it done.
    Replicate { blob: gpumesh_protocol::BlobId },
    /// Keep a copy of this small blob (at most [`crate::blobs::store::SENT_MAX`]
    /// bytes), its bytes here, before I report it done; refused unless they are
    /// that blob's.
    Keep {
        blob: gpumesh_protocol::BlobId,
        #[serde(with = "gpumesh_protocol::mesh::bytes")]
        bytes: Vec<u8>,
    },
    /// Keep the next state of an actor whose state you hold: make each buffer from
    /// its `base` and the call's changes (in the request, or a blob pulled from me);
    /// what you make must be `next`, byte for byte. Only what the call changed
    /// travels; a base you lack is pulled from me whole.
    Advance {
        changes: Changes,
        buffers: Vec<NextState>,
    },
    /// Run this call of actor `name`, which you host, and record it (its input blobs
    /// are on me); answer once it is recorded, or that it was not.
    Call {
        name: String,
        call: gpumesh_protocol::ActorCall,
        request: gpumesh_consensus::RequestId,
    },
    /// Am I (the authenticated sender) a member of the mesh you know? Asked by a
    /// member that hears no leader, to learn whether it was removed while it could
    /// not hear (see the node's `mesh::removed`).
    Membership,
}

/// What a call changed in an actor's state (`ShardChanges`, encoded).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Changes {
    /// The bytes themselves (small changes).
    Inline(#[serde(with = "gpumesh_protocol::mesh::bytes")] Vec<u8>),
    /// A blob to pull from the sender.
    Blob(gpumesh_protocol::BlobId),
    /// Most of the state changed: each buffer's `next` is pulled from the sender
    /// whole (hashed as it arrives, like any blob fetched), not made from the base.
    Whole,
}

/// One state buffer of an [`NodeRequest::Advance`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NextState {
    pub binding: u32,
    pub size: u64,
    /// Its blob before the call (`None`: zeros).
    pub base: Option<gpumesh_protocol::BlobId>,
    /// Its blob after the call.
    pub next: gpumesh_protocol::BlobId,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum NodeReply {
    Hello {
        raft_id: u64,
        /// The mesh's cluster id, if this node belongs to one yet.
        cluster: Option<u64>,
    },
    Joined,
    /// Peer ids with their listen addresses, as text.
    Peers(Vec<(String, Vec<String>)>),
    /// The blob (or an actor's next state) is stored here (fsync'd).
    Replicated,
    /// What came of a [`NodeRequest::Call`].
    Called(CallAnswer),
    Refused(String),
    /// What the answering node's record says of the asker: whether it is a member,
    /// as of the entries the answerer has applied (`applied`), in mesh `cluster`.
    Membership {
        cluster: u64,
        applied: u64,
        member: bool,
    },
}

/// How a call sent to the host ended.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum CallAnswer {
    /// Recorded: it ran as call `seq`, leaving the state at `version`.
    Done {
        seq: u64,
        version: u64,
        outputs: Vec<gpumesh_consensus::MergedOutput>,
    },
    /// Recorded as call `seq`: it failed and left the state as it was.
    Failed { seq: u64, reason: String },
    /// Not recorded by the host, for this reason: queue it in the record.
    NotRun(String),
}

pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    Ok(gpumesh_protocol::codec::to_bytes(value)?)
}

/// The value in `bytes`, or why they are not one.
pub fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    Ok(gpumesh_protocol::codec::from_bytes(bytes)?)
}

/// Asks `peer` one node request and decodes its answer. A refusal from the network
/// layer (`MeshResponse::Error`) is [`NodeError::PeerRefused`]; an answer that is no
/// node reply is [`NodeError::Codec`].
pub async fn call(net: &NetHandle, peer: PeerId, request: &NodeRequest) -> Result<NodeReply> {
    match net
        .request(peer, MeshRequest::Node(encode(request)?))
        .await?
    {
        MeshResponse::Node(bytes) => decode(&bytes),
        MeshResponse::Error(reason) => Err(NodeError::PeerRefused {
            peer: peer.to_string(),
            reason,
        }),
        other => Err(NodeError::Request {
            peer: peer.to_string(),
            reason: format!("answered {other:?} to a node request"),
        }),
    }
}
