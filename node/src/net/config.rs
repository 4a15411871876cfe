//! How a node joins the network ([`NetConfig`]) and how many connections peers may
//! hold ([`ConnectionCaps`]).

use std::fmt;
use std::time::Duration;

use libp2p::connection_limits::ConnectionLimits;
use libp2p::identity::Keypair;
use libp2p::pnet::PreSharedKey;
use libp2p::{Multiaddr, PeerId};

use crate::error::{NodeError, Result};
use crate::metrics::NetMetrics;

/// Room for the envelope and the response's own fields around a chunk's bytes.
pub(super) const FRAME_OVERHEAD: usize = 64;

/// How a node joins the network. Start from [`NetConfig::new`] and change fields.
#[derive(Clone)]
pub struct NetConfig {
    /// The node's identity; its public key is the node's [`PeerId`].
    pub keypair: Keypair,
    /// Addresses to listen on, e.g. `/ip4/0.0.0.0/tcp/4001` (port 0 picks one).
    pub listen: Vec<Multiaddr>,
    /// Bootstrap peers, dialled at start and redialled with backoff while not
    /// connected. A trailing `/p2p/<peer id>` is optional.
    pub peers: Vec<Multiaddr>,
    /// Discover peers on the LAN with mDNS. If it cannot start (common in containers)
    /// the node logs a warning and works with `peers` alone.
    pub mdns: bool,
    /// The cluster key: only nodes holding the same key can connect at all.
    pub psk: Option<PreSharedKey>,
    /// When not empty, the only peers this node keeps connections with, both ways:
    /// any other peer is disconnected as soon as Noise has authenticated its id.
    pub allow_peers: Vec<PeerId>,
    /// How many connections peers may hold open or half-open.
    pub connections: ConnectionCaps,
    /// The largest frame (one request or response) accepted or sent.
    pub max_frame_bytes: usize,
    /// Bytes asked for per blob chunk request.
    pub chunk_bytes: u32,
    /// Chunk requests kept in flight by one blob fetch (from a peer without the
    /// blob lane).
    pub fetch_window: usize,
    /// Serve and use the blob lane (a blob streamed on one stream per pull); off,
    /// blobs move in chunks over request-response only.
    pub blob_lane: bool,
    /// With the blob lane: serve and use the direct channel (a blob's bytes on a TCP
    /// connection of their own, sealed with AES-256-GCM under a key agreed on the
    /// lane; see `blob_direct`). The holder listens on the IP of its first TCP
    /// listen address, on any free port; a puller that cannot reach it streams on
    /// the lane instead.
    pub blob_direct: bool,
    /// Records of a direct pull opened on blocking threads while the next is read;
    /// 0 opens each on the pulling task as it arrives. 0 by default: on two cores
    /// opening ahead made a pull slower (`bench blobs` measures both).
    pub blob_open_ahead: usize,
    /// How long one request may take before it fails.
    pub request_timeout: Duration,
    /// How long a dial may take (TCP connect + handshakes) before it fails.
    pub dial_timeout: Duration,
    /// How long a connection with no open stream stays up. Generous, so that the
    /// pauses between Raft messages do not churn connections.
    pub idle_timeout: Duration,
    /// The first wait before redialling a bootstrap peer; doubles on each failure.
    pub redial_interval: Duration,
    /// Where the bytes sent and received (per lane) and the connected peers are
    /// counted; the default counts into no registry.
    pub metrics: NetMetrics,
}

impl NetConfig {
    /// Defaults tuned on loopback (see [`bench_blob_transfer`]); listens nowhere and
    /// dials nobody until `listen` / `peers` are set.
    pub fn new(keypair: Keypair) -> Self {
        NetConfig {
            keypair,
            listen: Vec::new(),
            peers: Vec::new(),
            mdns: true,
            psk: None,
            allow_peers: Vec::new(),
            connections: ConnectionCaps::default(),
            max_frame_bytes: 32 << 20,
            chunk_bytes: 1 << 20,
            fetch_window: 8,
            blob_lane: true,
            blob_direct: true,
            blob_open_ahead: 0,
            request_timeout: Duration::from_secs(30),
            dial_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            redial_interval: Duration::from_secs(2),
            metrics: NetMetrics::default(),
        }
    }

    pub(super) fn check(&self) -> Result<()> {
        let fail = |what: String| Err(NodeError::NetSetup(what));
        if self.chunk_bytes == 0 || self.fetch_window == 0 {
            return fail("chunk_bytes and fetch_window must be at least 1".into());
        }
        self.connections.check()?;
        if self.max_frame_bytes > gpumesh_protocol::codec::MAX_MESSAGE_BYTES {
            return fail(format!(
                "max_frame_bytes {} is over the codec limit of {}",
                self.max_frame_bytes,
                gpumesh_protocol::codec::MAX_MESSAGE_BYTES
            ));
        }
        if self.chunk_bytes as usize + FRAME_OVERHEAD > self.max_frame_bytes {
            return fail(format!(
                "chunk_bytes {} does not fit in max_frame_bytes {}",
                self.chunk_bytes, self.max_frame_bytes
            ));
        }
        Ok(())
    }
}

// By hand: the keypair and the cluster key are secrets and stay out of logs.
impl fmt::Debug for NetConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NetConfig")
            .field("peer_id", &self.keypair.public().to_peer_id())
            .field("listen", &self.listen)
            .field("peers", &self.peers)
            .field("mdns", &self.mdns)
            .field("psk", &self.psk.map(|k| k.fingerprint().to_string()))
            .field("allow_peers", &self.allow_peers)
            .field("connections", &self.connections)
            .field("max_frame_bytes", &self.max_frame_bytes)
            .field("chunk_bytes", &self.chunk_bytes)
            .field("fetch_window", &self.fetch_window)
            .field("blob_lane", &self.blob_lane)
            .field("blob_direct", &self.blob_direct)
            .field("request_timeout", &self.request_timeout)
            .field("dial_timeout", &self.dial_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .finish()
    }
}

/// Caps on connections, enforced by libp2p's `connection_limits` behaviour: a
/// connection over a cap is closed as soon as it is counted, and the node carries on
/// with the ones it has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionCaps {
    /// Established connections with any one peer. Two nodes need one, sometimes two
    /// (both dialled at once); more is a misbehaving or looping peer.
    pub per_peer: u32,
    /// Established connections in all, with every peer.
    pub total: u32,
    /// Incoming connections still in their handshakes (Noise, Yamux): bounds
    /// what a flood of half-open connections can cost.
    pub pending_incoming: u32,
}

impl Default for ConnectionCaps {
    fn default() -> Self {
        ConnectionCaps {
            per_peer: 8,
            total: 256,
            pending_incoming: 64,
        }
    }
}

impl ConnectionCaps {
    pub(super) fn check(&self) -> Result<()> {
        if self.per_peer == 0 || self.total == 0 || self.pending_incoming == 0 {
            return Err(NodeError::NetSetup(format!(
                "connection limits must be at least 1 (got {self:?}): a node that \
                 accepts no connection cannot be in a mesh"
            )));
        }
        Ok(())
    }

    pub(super) fn limits(&self) -> ConnectionLimits {
        ConnectionLimits::default()
            .with_max_established_per_peer(Some(self.per_peer))
            .with_max_established(Some(self.total))
            .with_max_pending_incoming(Some(self.pending_incoming))
    }
}
