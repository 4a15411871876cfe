//! What the net actor tells the node ([`NetEvent`]) and what its handle asks of it.

use gpumesh_protocol::{MeshRequest, MeshResponse};
use libp2p::{Multiaddr, PeerId};
use tokio::sync::oneshot;

use crate::error::Result;

/// What the network tells the node.
#[derive(Debug)]
pub enum NetEvent {
    /// A Raft frame from `from`, read off its Raft stream.
    Raft { from: PeerId, frame: Vec<u8> },
    /// A `Join` or `Node` request; send the answer on `reply` within the request
    /// timeout. Dropping `reply` answers the peer with an error.
    Request {
        from: PeerId,
        request: MeshRequest,
        reply: oneshot::Sender<MeshResponse>,
    },
    /// The first connection to `peer` is up; `addr` is its remote address.
    PeerConnected { peer: PeerId, addr: Multiaddr },
    /// The last connection to the peer closed.
    PeerDisconnected(PeerId),
    /// Addresses of a gpumesh peer learned from mDNS or identify. The net actor
    /// remembers them for later dials but does not dial by itself: the node decides.
    PeerDiscovered { peer: PeerId, addrs: Vec<Multiaddr> },
}

pub(super) enum Command {
    ListenAddrs(oneshot::Sender<Vec<Multiaddr>>),
    Dial {
        addr: Multiaddr,
        reply: oneshot::Sender<Result<PeerId>>,
    },
    Request {
        to: PeerId,
        request: MeshRequest,
        reply: oneshot::Sender<Result<MeshResponse>>,
    },
    AddAddress {
        peer: PeerId,
        addr: Multiaddr,
    },
    Cut {
        peer: PeerId,
        cut: bool,
    },
}
