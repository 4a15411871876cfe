//! Node-level messages, carried inside `MeshRequest::Node` / `MeshResponse::Node`.

use gpumesh_protocol::NodeCapability;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum NodeRequest {
    /// Who are you, and which mesh are you in?
    Hello,
    /// Add me (the authenticated sender) to your mesh as a learner.
    Join { capability: Option<NodeCapability> },
    /// Remove me from the mesh: I am shutting down.
    Leave,
    /// Which peers do you know, and where do they listen?
    Peers,
    /// Keep a copy of this blob, pulled from me, before I report it done.
    Replicate { blob: gpumesh_protocol::BlobId },
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum NodeReply {
    Hello {
        raft_id: u64,
        /// The mesh's cluster id, if this node belongs to one yet.
        cluster: Option<u64>,
    },
    Joined,
    Left,
    /// Peer ids with their listen addresses, as text.
    Peers(Vec<(String, Vec<String>)>),
    /// The blob is stored here (fsync'd).
    Replicated,
    Refused(String),
}

pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    gpumesh_protocol::codec::to_bytes(value).unwrap_or_default()
}

pub fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Option<T> {
    gpumesh_protocol::codec::from_bytes(bytes).ok()
}
