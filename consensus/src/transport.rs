//! How a replica reaches its peers. The consensus crate knows nothing of the network:
//! the node crate implements [`Transport`] over libp2p, tests over [`crate::sim`].

/// The peer could not be reached right now; Raft will retry on its own schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unreachable;

/// Sends frames to other replicas by raft id.
///
/// `send` must not block: queue the bytes and return. Delivery is best effort —
/// Raft tolerates loss, duplication and reordering — and the receiving side hands
/// the bytes to its [`ConsensusHandle::receive`] (or `try_receive`) together with the
/// sender's raft id as the transport authenticated it.
///
/// [`ConsensusHandle::receive`]: crate::ConsensusHandle::receive
pub trait Transport: Send + Sync + 'static {
    fn send(&self, to: u64, frame: Vec<u8>) -> Result<(), Unreachable>;
}
