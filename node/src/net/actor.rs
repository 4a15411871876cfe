//! The actor's loop: the swarm's events, the handle's commands, answers on their way
//! back, and bootstrap peers redialled with backoff.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use futures::stream::StreamExt;
use gpumesh_protocol::{MeshRequest, MeshResponse};
use libp2p::multiaddr::Protocol;
use libp2p::request_response::{self, OutboundRequestId, ResponseChannel};
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::{ConnectionId, ListenError, SwarmEvent};
use libp2p::{identify, mdns, Multiaddr, PeerId, Swarm};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::config::{NetConfig, FRAME_OVERHEAD};
use super::events::{Command, NetEvent};
use super::swarm::{
    denial, dial_reason, peer_of, MeshBehaviour, MeshBehaviourEvent, IDENTIFY_PROTOCOL,
};
use crate::blobs::store::BlobStore;
use crate::error::{NodeError, Result};
use crate::metrics::NetMetrics;

/// Answers computed off the actor (blob reads, node replies) on their way back to it.
const REPLY_QUEUE: usize = 256;
/// Events the node has not taken yet; beyond this, events are dropped and logged.
const OUTBOX_LIMIT: usize = 4096;
/// The longest a bootstrap peer that keeps failing waits between dials.
const MAX_REDIAL_BACKOFF: Duration = Duration::from_secs(60);

/// What the actor keeps up to date for the handles to read without a turn of it.
pub(super) struct Shared {
    /// Where each peer was reached, for pulls on the direct blob channel.
    pub direct: super::blob_direct::Peers,
    /// The peers connected now ([`super::NetHandle::connected_peers`]).
    pub connected: super::raft_direct::PeerSet,
    /// Peers refused for their data format ([`super::NetHandle::refusal`]).
    pub refused: super::OtherFormats,
}

/// Spawns the actor over a swarm that listens already; it stops when `cancel` fires
/// or every handle is dropped.
pub(super) fn spawn(
    swarm: Swarm<MeshBehaviour>,
    config: &NetConfig,
    commands: mpsc::Receiver<Command>,
    events: mpsc::Sender<NetEvent>,
    blobs: BlobStore,
    Shared {
        direct,
        connected,
        refused,
    }: Shared,
    cancel: CancellationToken,
) -> JoinHandle<()> {
    let (replies_tx, replies) = mpsc::channel(REPLY_QUEUE);
    let bootstrap = config
        .peers
        .iter()
        .map(|addr| Bootstrap {
            addr: addr.clone(),
            peer: peer_of(addr),
            dialing: None,
            failures: 0,
            next_try: Instant::now(),
        })
        .collect();
    let actor = NetActor {
        swarm,
        commands,
        events,
        outbox: VecDeque::new(),
        replies_tx,
        replies,
        blobs,
        direct,
        connected,
        refused,
        pending_requests: HashMap::new(),
        pending_dials: HashMap::new(),
        bootstrap,
        // Leave the peer some of its own timeout to get our error answer back.
        max_chunk: (config.max_frame_bytes - FRAME_OVERHEAD) as u32,
        redial_interval: config.redial_interval,
        metrics: config.metrics.clone(),
    };
    tokio::spawn(actor.run(cancel))
}

struct PendingDial {
    addr: Multiaddr,
    reply: Option<oneshot::Sender<Result<PeerId>>>,
    bootstrap: Option<usize>,
}

enum PendingRequest {
    Reply(oneshot::Sender<Result<MeshResponse>>),
}

/// A `--peer` address the node keeps trying to be connected to.
struct Bootstrap {
    addr: Multiaddr,
    peer: Option<PeerId>,
    dialing: Option<ConnectionId>,
    failures: u32,
    next_try: Instant,
}

type Reply = (ResponseChannel<MeshResponse>, MeshResponse);

// One lives on the stack for one loop turn; boxing a variant would only add an
// allocation per event.
#[allow(clippy::large_enum_variant)]
enum Wake {
    Reply(Reply),
    Command(Command),
    Swarm(SwarmEvent<MeshBehaviourEvent>),
    Redial,
}

struct NetActor {
    swarm: Swarm<MeshBehaviour>,
    commands: mpsc::Receiver<Command>,
    events: mpsc::Sender<NetEvent>,
    /// Events the node has not had room for yet, in order.
    outbox: VecDeque<NetEvent>,
    replies_tx: mpsc::Sender<Reply>,
    replies: mpsc::Receiver<Reply>,
    blobs: BlobStore,
    /// Where each peer was reached, for pulls on the direct blob channel.
    direct: super::blob_direct::Peers,
    /// The peers connected now, kept for [`super::NetHandle::connected_peers`] to
    /// read without a turn of this actor.
    connected: super::raft_direct::PeerSet,
    /// Peers of another data format, refused, and why (see [`Shared::refused`]).
    refused: super::OtherFormats,
    pending_requests: HashMap<OutboundRequestId, PendingRequest>,
    pending_dials: HashMap<ConnectionId, PendingDial>,
    bootstrap: Vec<Bootstrap>,
    max_chunk: u32,
    redial_interval: Duration,
    metrics: NetMetrics,
}

impl NetActor {
    async fn run(mut self, cancel: CancellationToken) {
        let mut redial = tokio::time::interval(self.redial_interval.min(Duration::from_secs(1)));
        redial.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // The branches only pick what to do: their futures borrow the actor's
            // fields until the select ends, so the handling happens after it.
            let wake = tokio::select! {
                biased;
                _ = cancel.cancelled() => break,
                // Answers first: each one finishes a stream a peer is waiting on.
                Some(reply) = self.replies.recv() => Wake::Reply(reply),
                permit = self.events.reserve(), if !self.outbox.is_empty() => {
                    match permit {
                        Ok(permit) => {
                            if let Some(event) = self.outbox.pop_front() {
                                permit.send(event);
                            }
                        }
                        Err(_) => self.outbox.clear(),
                    }
                    continue;
                }
                command = self.commands.recv() => match command {
                    Some(command) => Wake::Command(command),
                    None => break,
                },
                event = self.swarm.select_next_some() => Wake::Swarm(event),
                _ = redial.tick() => Wake::Redial,
            };
            match wake {
                Wake::Reply((channel, response)) => self.respond(channel, response),
                Wake::Command(command) => self.on_command(command),
                Wake::Swarm(event) => self.on_swarm_event(event),
                Wake::Redial => self.redial(),
            }
        }
        self.connected.clear();
        tracing::debug!(peer = %self.swarm.local_peer_id(), "net actor stopped");
    }

    /// Hands an event to the node without ever waiting for it; returns whether the
    /// event was kept (dropped only when the node is gone or far behind).
    fn emit(&mut self, event: NetEvent) -> bool {
        if self.events.is_closed() {
            return false;
        }
        if self.outbox.is_empty() {
            match self.events.try_send(event) {
                Ok(()) => return true,
                Err(mpsc::error::TrySendError::Closed(_)) => return false,
                Err(mpsc::error::TrySendError::Full(event)) => {
                    self.outbox.push_back(event);
                    return true;
                }
            }
        }
        if self.outbox.len() >= OUTBOX_LIMIT {
            tracing::warn!(?event, "the node is not taking network events; dropped one");
            return false;
        }
        self.outbox.push_back(event);
        true
    }

    fn respond(&mut self, channel: ResponseChannel<MeshResponse>, response: MeshResponse) {
        if let Err(response) = self
            .swarm
            .behaviour_mut()
            .rpc
            .send_response(channel, response)
        {
            tracing::debug!(?response, "peer went away before its answer was ready");
        }
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::ListenAddrs(reply) => {
                let _ = reply.send(self.swarm.listeners().cloned().collect());
            }
            Command::Dial { addr, reply } => self.dial(addr, Some(reply), None),
            Command::Request { to, request, reply } => {
                let id = self.swarm.behaviour_mut().rpc.send_request(&to, request);
                self.pending_requests
                    .insert(id, PendingRequest::Reply(reply));
            }
            Command::AddAddress { peer, addr } => self.swarm.add_peer_address(peer, addr),
            Command::Cut { peer, cut: true } => {
                tracing::warn!(%peer, "fault injection: cutting every connection to the peer");
                self.swarm.behaviour_mut().cut.block_peer(peer);
            }
            Command::Cut { peer, cut: false } => {
                tracing::warn!(%peer, "fault injection: connections to the peer allowed again");
                self.swarm.behaviour_mut().cut.unblock_peer(peer);
            }
        }
    }

    fn dial(
        &mut self,
        addr: Multiaddr,
        reply: Option<oneshot::Sender<Result<PeerId>>>,
        bootstrap: Option<usize>,
    ) {
        let opts = match peer_of(&addr) {
            Some(peer) if self.swarm.is_connected(&peer) => {
                if let Some(reply) = reply {
                    let _ = reply.send(Ok(peer));
                }
                return;
            }
            Some(peer) => DialOpts::peer_id(peer)
                .addresses(vec![addr.clone()])
                // An explicit dial is answered by its own connection, even if another
                // dial to the peer is already under way.
                .condition(PeerCondition::Always)
                .build(),
            None => DialOpts::unknown_peer_id().address(addr.clone()).build(),
        };
        let connection = opts.connection_id();
        match self.swarm.dial(opts) {
            Ok(()) => {
                if let Some(index) = bootstrap {
                    self.bootstrap[index].dialing = Some(connection);
                }
                self.pending_dials.insert(
                    connection,
                    PendingDial {
                        addr,
                        reply,
                        bootstrap,
                    },
                );
            }
            Err(e) => {
                let error = NodeError::Dial {
                    addr: addr.to_string(),
                    reason: dial_reason(&e),
                };
                match reply {
                    Some(reply) => {
                        let _ = reply.send(Err(error));
                    }
                    None => tracing::warn!("{error}"),
                }
            }
        }
    }

    /// Dials every bootstrap peer that is neither connected nor being dialled, once
    /// its backoff has passed.
    fn redial(&mut self) {
        let now = Instant::now();
        for index in 0..self.bootstrap.len() {
            let entry = &self.bootstrap[index];
            let connected = entry.peer.is_some_and(|p| self.swarm.is_connected(&p));
            if connected || entry.dialing.is_some() || entry.next_try > now {
                continue;
            }
            let addr = entry.addr.clone();
            self.dial(addr, None, Some(index));
        }
    }

    fn on_swarm_event(&mut self, event: SwarmEvent<MeshBehaviourEvent>) {
        match event {
            SwarmEvent::Behaviour(MeshBehaviourEvent::Rpc(event)) => self.on_rpc(event),
            SwarmEvent::Behaviour(MeshBehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                info,
                ..
            })) => {
                if info.protocol_version != IDENTIFY_PROTOCOL {
                    tracing::debug!(%peer_id, version = %info.protocol_version, "not a gpumesh peer");
                    return;
                }
                // Its streams would be refused one by one (the format is in every
                // protocol's name); say why once, and close the connection.
                if let Err(why) = gpumesh_protocol::format::check_agent(&info.agent_version) {
                    if self.refused.insert(peer_id, why.clone()) {
                        tracing::warn!(
                            peer = %peer_id,
                            "refused: {why}; nodes of different data formats cannot share a \
                             mesh: run one gpumesh build on every node"
                        );
                    }
                    let _ = self.swarm.disconnect_peer_id(peer_id);
                    return;
                }
                self.refused.remove(&peer_id);
                let addrs: Vec<Multiaddr> = info
                    .listen_addrs
                    .into_iter()
                    .filter(|a| !is_unspecified(a))
                    .collect();
                for addr in &addrs {
                    self.swarm.add_peer_address(peer_id, addr.clone());
                }
                self.emit(NetEvent::PeerDiscovered {
                    peer: peer_id,
                    addrs,
                });
            }
            SwarmEvent::Behaviour(MeshBehaviourEvent::Identify(_)) => {}
            SwarmEvent::Behaviour(MeshBehaviourEvent::Mdns(mdns::Event::Discovered(found))) => {
                let mut by_peer: HashMap<PeerId, Vec<Multiaddr>> = HashMap::new();
                for (peer, addr) in found {
                    self.swarm.add_peer_address(peer, addr.clone());
                    by_peer.entry(peer).or_default().push(addr);
                }
                for (peer, addrs) in by_peer {
                    tracing::debug!(%peer, ?addrs, "found by mDNS");
                    self.emit(NetEvent::PeerDiscovered { peer, addrs });
                }
            }
            SwarmEvent::Behaviour(MeshBehaviourEvent::Mdns(mdns::Event::Expired(_))) => {}
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                num_established,
                ..
            } => {
                let remote = endpoint.get_remote_address().clone();
                // Before the dial is answered: its caller may look next.
                self.connected.set(peer_id, true);
                self.direct.connected(peer_id, &remote);
                if endpoint.is_dialer() {
                    // Remember what worked, so request-response can redial it.
                    self.swarm.add_peer_address(peer_id, remote.clone());
                }
                if let Some(dial) = self.pending_dials.remove(&connection_id) {
                    if let Some(index) = dial.bootstrap {
                        let entry = &mut self.bootstrap[index];
                        entry.peer = Some(peer_id);
                        entry.dialing = None;
                        entry.failures = 0;
                    }
                    if let Some(reply) = dial.reply {
                        let _ = reply.send(Ok(peer_id));
                    }
                }
                if num_established.get() == 1 {
                    self.metrics
                        .set_connected_peers(self.swarm.connected_peers().count());
                    tracing::info!(peer = %peer_id, addr = %remote, "connected");
                    self.emit(NetEvent::PeerConnected {
                        peer: peer_id,
                        addr: remote,
                    });
                }
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                num_established: 0,
                cause,
                ..
            } => {
                self.connected.set(peer_id, false);
                self.metrics
                    .set_connected_peers(self.swarm.connected_peers().count());
                tracing::info!(peer = %peer_id, ?cause, "disconnected");
                self.emit(NetEvent::PeerDisconnected(peer_id));
            }
            SwarmEvent::OutgoingConnectionError {
                connection_id,
                peer_id,
                error,
            } => {
                let Some(dial) = self.pending_dials.remove(&connection_id) else {
                    tracing::debug!(?peer_id, "dial failed: {error}");
                    return;
                };
                let error = NodeError::Dial {
                    addr: dial.addr.to_string(),
                    reason: dial_reason(&error),
                };
                if let Some(index) = dial.bootstrap {
                    let entry = &mut self.bootstrap[index];
                    entry.dialing = None;
                    entry.failures += 1;
                    let backoff = self.redial_interval * 2u32.pow(entry.failures.min(6));
                    entry.next_try = Instant::now() + backoff.min(MAX_REDIAL_BACKOFF);
                    if entry.failures == 1 {
                        tracing::warn!("bootstrap peer: {error}; retrying in the background");
                    } else {
                        tracing::debug!(failures = entry.failures, "bootstrap peer: {error}");
                    }
                }
                if let Some(reply) = dial.reply {
                    let _ = reply.send(Err(error));
                }
            }
            SwarmEvent::IncomingConnectionError {
                send_back_addr,
                error,
                peer_id,
                ..
            } => {
                // Strangers, port scanners, nodes with another cluster key, peers off
                // the allow-list or over a connection limit.
                let reason = match &error {
                    ListenError::Denied { cause } => denial(cause),
                    other => other.to_string(),
                };
                match peer_id {
                    Some(peer) => tracing::info!(
                        from = %send_back_addr, %peer, "refused an incoming connection: {reason}"
                    ),
                    None => tracing::info!(
                        from = %send_back_addr, "refused an incoming connection: {reason}"
                    ),
                }
            }
            SwarmEvent::NewListenAddr { address, .. } => {
                tracing::info!(%address, "listening");
            }
            SwarmEvent::ListenerError { error, .. } => {
                tracing::warn!("listener error: {error}");
            }
            _ => {}
        }
    }

    fn on_rpc(&mut self, event: request_response::Event<MeshRequest, MeshResponse>) {
        use request_response::{Event, InboundFailure, Message};
        match event {
            Event::Message {
                peer,
                message:
                    Message::Request {
                        request, channel, ..
                    },
                ..
            } => self.on_request(peer, request, channel),
            Event::Message {
                message:
                    Message::Response {
                        request_id,
                        response,
                    },
                ..
            } => match self.pending_requests.remove(&request_id) {
                Some(PendingRequest::Reply(reply)) => {
                    let _ = reply.send(Ok(response));
                }
                None => {}
            },
            Event::OutboundFailure {
                peer,
                request_id,
                error,
                ..
            } => match self.pending_requests.remove(&request_id) {
                Some(PendingRequest::Reply(reply)) => {
                    let _ = reply.send(Err(NodeError::Request {
                        peer: peer.to_string(),
                        reason: error.to_string(),
                    }));
                }
                None => {}
            },
            Event::InboundFailure { peer, error, .. } => match error {
                InboundFailure::Io(e) => {
                    tracing::warn!(%peer, "bad request from peer dropped: {e}");
                }
                other => tracing::debug!(%peer, "inbound request failed: {other}"),
            },
            Event::ResponseSent { .. } => {}
        }
    }

    fn on_request(
        &mut self,
        from: PeerId,
        request: MeshRequest,
        channel: ResponseChannel<MeshResponse>,
    ) {
        match request {
            MeshRequest::BlobChunk { id, offset, len } => {
                let blobs = self.blobs.clone();
                let replies = self.replies_tx.clone();
                let len = u64::from(len.min(self.max_chunk));
                // Disk reads stay off the actor; the answer comes back through
                // `replies` because only the actor may touch the swarm.
                tokio::spawn(async move {
                    let read =
                        tokio::task::spawn_blocking(move || blobs.read_range(&id, offset, len))
                            .await;
                    let response = match read {
                        Ok(Ok(Some((total, data)))) => MeshResponse::BlobChunk { total, data },
                        Ok(Ok(None)) => MeshResponse::NotFound,
                        Ok(Err(e)) => {
                            tracing::warn!(%from, "serving blob {id}: {e}");
                            MeshResponse::Error(format!("could not read blob {id}: {e}"))
                        }
                        Err(e) => MeshResponse::Error(format!("blob read failed: {e}")),
                    };
                    let _ = replies.send((channel, response)).await;
                });
            }
            MeshRequest::Node(_) => {
                // Node requests come on the call lane, where they are taken in
                // turn; this protocol serves blob chunks alone.
                tracing::debug!(%from, "a node request on the blob protocol; refused");
                let response = MeshResponse::Error(format!(
                    "node requests go on {}; {} serves blob chunks only",
                    super::call_lane::CALL_PROTOCOL,
                    super::MESH_PROTOCOL
                ));
                self.respond(channel, response);
            }
        }
    }
}

fn is_unspecified(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| match p {
        Protocol::Ip4(ip) => ip.is_unspecified(),
        Protocol::Ip6(ip) => ip.is_unspecified(),
        _ => false,
    })
}
