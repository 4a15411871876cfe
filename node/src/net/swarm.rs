//! The swarm: transport (TCP, cluster key, Noise, Yamux), the behaviour (admission
//! first), listening, and how a refused dial or connection is put into words.

use std::fmt;
use std::time::Duration;

use futures::stream::StreamExt;
use libp2p::connection_limits::{self};
use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::{Boxed, ListenerId};
use libp2p::core::upgrade::Version;
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::pnet::PreSharedKey;
use libp2p::request_response::{self, ProtocolSupport};
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::{ConnectionDenied, DialError, NetworkBehaviour, SwarmEvent};
use libp2p::{
    allow_block_list, dns, identify, mdns, noise, tcp, yamux, Multiaddr, PeerId, Swarm,
    SwarmBuilder, Transport,
};

use super::codec::{self, MESH_PROTOCOL};
use super::config::NetConfig;
use crate::error::{NodeError, Result};

/// Identify's protocol version: peers announcing anything else are not gpumesh nodes,
/// and their addresses are not remembered. The same in every data format: the agent
/// version names the format (see [`gpumesh_protocol::format::agent`]).
pub(super) const IDENTIFY_PROTOCOL: &str = "/gpumesh/id/1";

// Admission comes first: a connection the allow-list or the caps refuse is denied
// before any other behaviour sets up a handler for it.
#[derive(NetworkBehaviour)]
pub(super) struct MeshBehaviour {
    pub(super) allow: Toggle<allow_block_list::Behaviour<allow_block_list::AllowedPeers>>,
    pub(super) cut: allow_block_list::Behaviour<allow_block_list::BlockedPeers>,
    pub(super) caps: connection_limits::Behaviour,
    pub(super) rpc: request_response::Behaviour<codec::MeshCodec>,
    pub(super) raft: libp2p_stream::Behaviour,
    pub(super) identify: identify::Behaviour,
    pub(super) mdns: Toggle<mdns::tokio::Behaviour>,
}

/// TCP, then Noise (which authenticates the peer id and, when the mesh has a
/// cluster key, proves both ends hold it), then Yamux for streams. Every byte is
/// encrypted once, by Noise.
fn build_transport(
    keypair: &Keypair,
    psk: Option<PreSharedKey>,
) -> std::result::Result<Boxed<(PeerId, StreamMuxerBox)>, Box<dyn std::error::Error + Send + Sync>>
{
    // nodelay: request-response is latency-bound for Raft; Nagle would hold frames.
    let tcp = || tcp::tokio::Transport::new(tcp::Config::default().nodelay(true));
    // /dns, /dns4 and /dns6 addresses (a peer named by its host name) resolve with
    // the system's resolver; without its configuration, the hosts file still names.
    let tcp = dns::tokio::Transport::system(tcp()).unwrap_or_else(|e| {
        tracing::warn!(
            "no system DNS configuration ({e}); host names resolve from the hosts file only"
        );
        dns::tokio::Transport::custom(
            tcp(),
            dns::ResolverConfig::new(),
            dns::ResolverOpts::default(),
        )
    });
    let mut noise = noise::Config::new(keypair)?;
    if let Some(psk) = psk {
        noise = noise.with_prologue(noise_prologue(&psk).to_vec());
    }
    Ok(tcp
        .upgrade(Version::V1Lazy)
        .authenticate(noise)
        .multiplex(yamux::Config::default())
        .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)))
        .boxed())
}

/// The Noise prologue of a mesh with cluster key `psk`: both ends mix it into the
/// handshake's transcript, so the handshake's first encrypted payload fails to
/// decrypt unless they hold the same key (none, or another one, fails alike). The
/// prologue is derived from the key and never sent.
pub fn noise_prologue(psk: &PreSharedKey) -> [u8; 32] {
    blake3::derive_key(
        "gpumesh cluster key 2026-11 noise prologue",
        psk.to_string().as_bytes(),
    )
}

pub(super) fn build_swarm(config: &NetConfig) -> Result<Swarm<MeshBehaviour>> {
    let setup = |e: &dyn fmt::Display| NodeError::NetSetup(e.to_string());
    let psk = config.psk;
    let rpc_config = request_response::Config::default()
        .with_request_timeout(config.request_timeout)
        // Pipelined blob chunks plus forwarded calls.
        .with_max_concurrent_streams(256);
    let codec = codec::MeshCodec::new(config.max_frame_bytes).counted_in(config.metrics.clone());
    let want_mdns = config.mdns;
    let allow = (!config.allow_peers.is_empty()).then(|| {
        let mut allow = allow_block_list::Behaviour::<allow_block_list::AllowedPeers>::default();
        for peer in &config.allow_peers {
            allow.allow_peer(*peer);
        }
        allow
    });
    let caps = config.connections.limits();
    let swarm = SwarmBuilder::with_existing_identity(config.keypair.clone())
        .with_tokio()
        .with_other_transport(|key| build_transport(key, psk))
        .map_err(|e| setup(&e))?
        .with_behaviour(|key| {
            let peer_id = key.public().to_peer_id();
            let mdns = if want_mdns {
                match mdns::tokio::Behaviour::new(mdns::Config::default(), peer_id) {
                    Ok(mdns) => Some(mdns),
                    Err(e) => {
                        tracing::warn!(
                            "mDNS could not start ({e}); peers must be given with --peer"
                        );
                        None
                    }
                }
            } else {
                None
            };
            MeshBehaviour {
                allow: Toggle::from(allow),
                cut: allow_block_list::Behaviour::default(),
                caps: connection_limits::Behaviour::new(caps),
                rpc: request_response::Behaviour::with_codec(
                    codec,
                    [(MESH_PROTOCOL, ProtocolSupport::Full)],
                    rpc_config,
                ),
                raft: libp2p_stream::Behaviour::new(),
                identify: identify::Behaviour::new(
                    identify::Config::new(IDENTIFY_PROTOCOL.into(), key.public())
                        .with_agent_version(gpumesh_protocol::format::agent()),
                ),
                mdns: Toggle::from(mdns),
            }
        })
        .map_err(|e| setup(&e))?
        .with_swarm_config(|c| c.with_idle_connection_timeout(config.idle_timeout))
        // A little longer than the handle waits, so that a caller of `dial` gets the
        // clearer "did not complete within" error rather than the transport's.
        .with_connection_timeout(config.dial_timeout + Duration::from_secs(1))
        .build();
    Ok(swarm)
}

/// Starts every listener and waits until each reports its bound address, so a port 0
/// has become a real port before anyone asks.
pub(super) async fn listen(swarm: &mut Swarm<MeshBehaviour>, addrs: &[Multiaddr]) -> Result<()> {
    let mut waiting: Vec<(ListenerId, Multiaddr)> = Vec::new();
    for addr in addrs {
        let id = swarm.listen_on(addr.clone()).map_err(|e| {
            NodeError::NetSetup(format!(
                "listen on {addr}: {}; pick another --listen address",
                innermost(&e)
            ))
        })?;
        waiting.push((id, addr.clone()));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !waiting.is_empty() {
        let event = tokio::time::timeout_at(deadline, swarm.select_next_some())
            .await
            .map_err(|_| {
                NodeError::NetSetup(format!("listeners did not start within 10s: {waiting:?}"))
            })?;
        match event {
            SwarmEvent::NewListenAddr {
                listener_id,
                address,
            } => {
                tracing::info!(%address, "listening");
                waiting.retain(|(id, _)| *id != listener_id);
            }
            SwarmEvent::ListenerClosed {
                listener_id,
                reason,
                ..
            } => {
                let addr = waiting.iter().find(|(id, _)| *id == listener_id);
                return Err(NodeError::NetSetup(format!(
                    "listener {addr:?} closed: {reason:?}"
                )));
            }
            SwarmEvent::ListenerError { listener_id, error } => {
                let addr = waiting.iter().find(|(id, _)| *id == listener_id);
                return Err(NodeError::NetSetup(format!("listener {addr:?}: {error}")));
            }
            other => tracing::debug!(?other, "swarm event while starting"),
        }
    }
    Ok(())
}

/// The peer id at the end of `/…/p2p/<id>`, if any.
pub(super) fn peer_of(addr: &Multiaddr) -> Option<PeerId> {
    match addr.iter().last() {
        Some(Protocol::P2p(peer)) => Some(peer),
        _ => None,
    }
}

/// The innermost cause of `error` ("Connection refused", "Address already in use"):
/// the useful part of a transport's error, whose outer layers may print nothing.
fn innermost(error: &dyn std::error::Error) -> String {
    let mut cause = error;
    while let Some(inner) = cause.source() {
        cause = inner;
    }
    cause.to_string()
}

/// Why a dial failed, in words, without repeating the address the caller named.
pub(super) fn dial_reason(error: &DialError) -> String {
    match error {
        DialError::Transport(errors) => {
            let mut reasons: Vec<String> = Vec::new();
            for (_, e) in errors {
                let text = innermost(e);
                if !reasons.contains(&text) {
                    reasons.push(text);
                }
            }
            reasons.join("; ")
        }
        DialError::WrongPeerId { obtained, .. } => {
            format!("the node there is {obtained}, not the peer id in the address")
        }
        DialError::Denied { cause } => denial(cause),
        other => other.to_string(),
    }
}

/// Why this node's admission refused a connection, naming the setting involved.
pub(super) fn denial(cause: &ConnectionDenied) -> String {
    if let Some(not_allowed) = cause.downcast_ref::<allow_block_list::NotAllowed>() {
        format!("{not_allowed} of this node (--allow-peer)")
    } else if let Some(exceeded) = cause.downcast_ref::<connection_limits::Exceeded>() {
        format!(
            "{exceeded} (--max-connections-per-peer, --max-connections, --max-pending-incoming)"
        )
    } else {
        format!("refused by this node: {cause}")
    }
}
