//! The network actor over real loopback TCP: real swarms, real Noise and Yamux, no
//! mocks. Every wait is bounded, so a broken actor fails a test instead of hanging it.

#![allow(clippy::unwrap_used)]
// tests unwrap: a failure should stop the test
// `Node::expect` hands unwanted events back as `Err(event)`; their size is no concern here.
#![allow(clippy::result_large_err)]

use std::collections::VecDeque;
use std::io;
use std::time::Duration;

use async_trait::async_trait;
use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, StreamExt};
use gpumesh_node::blobs::BlobStore;
use gpumesh_node::net::{
    bench_blob_transfer_with, BlobRoute, ConnectionCaps, NetConfig, NetEvent, NetHandle,
    CALL_PROTOCOL, MESH_PROTOCOL, RAFT_PROTOCOL,
};
use gpumesh_node::NodeError;
use gpumesh_protocol::{seal, BlobId, MeshRequest, MeshResponse};
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::pnet::PreSharedKey;
use libp2p::request_response::{self, ProtocolSupport};
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::{dummy, SwarmEvent};
use libp2p::{noise, tcp, yamux, Multiaddr, PeerId, StreamProtocol, Swarm, SwarmBuilder};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The longest any single wait in these tests may take.
const WAIT: Duration = Duration::from_secs(15);

struct Node {
    net: NetHandle,
    events: mpsc::Receiver<NetEvent>,
    backlog: VecDeque<NetEvent>,
    blobs: BlobStore,
    /// Listen address with `/p2p/<peer id>`.
    addr: Multiaddr,
    cancel: CancellationToken,
    task: JoinHandle<()>,
    _dir: tempfile::TempDir,
}

impl Node {
    async fn start(tune: impl FnOnce(&mut NetConfig)) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let blobs = BlobStore::open(dir.path(), 64 << 20).unwrap();
        let mut config = NetConfig::new(Keypair::generate_ed25519());
        config.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
        config.mdns = false;
        config.request_timeout = Duration::from_secs(10);
        config.dial_timeout = Duration::from_secs(5);
        tune(&mut config);
        let (tx, events) = mpsc::channel(64);
        let cancel = CancellationToken::new();
        let (net, task) = NetHandle::start(config, blobs.clone(), tx, cancel.clone())
            .await
            .unwrap();
        let addr = net.listen_addrs().await.unwrap()[0]
            .clone()
            .with(Protocol::P2p(net.local_peer_id()));
        Node {
            net,
            events,
            backlog: VecDeque::new(),
            blobs,
            addr,
            cancel,
            task,
            _dir: dir,
        }
    }

    fn id(&self) -> PeerId {
        self.net.local_peer_id()
    }

    /// The TCP port it listens on.
    fn port(&self) -> u16 {
        self.addr
            .iter()
            .find_map(|p| match p {
                Protocol::Tcp(port) => Some(port),
                _ => None,
            })
            .unwrap()
    }

    /// The first event that `pick` accepts (it hands back the others, which are kept
    /// for later calls, so arrival order between kinds does not matter); panics after
    /// [`WAIT`].
    async fn expect<T>(
        &mut self,
        what: &str,
        mut pick: impl FnMut(NetEvent) -> Result<T, NetEvent>,
    ) -> T {
        for _ in 0..self.backlog.len() {
            let event = self.backlog.pop_front().unwrap();
            match pick(event) {
                Ok(found) => return found,
                Err(event) => self.backlog.push_back(event),
            }
        }
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let event = tokio::time::timeout_at(deadline, self.events.recv())
                .await
                .unwrap_or_else(|_| panic!("no {what} event within {WAIT:?}"))
                .expect("net actor stopped");
            match pick(event) {
                Ok(found) => return found,
                Err(event) => self.backlog.push_back(event),
            }
        }
    }

    async fn stop(self) {
        self.cancel.cancel();
        tokio::time::timeout(WAIT, self.task)
            .await
            .unwrap()
            .unwrap();
    }
}

fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

#[tokio::test]
async fn dialled_nodes_exchange_raft_frames_both_ways_with_sender_ids() {
    let mut a = Node::start(|_| {}).await;
    let mut b = Node::start(|_| {}).await;

    let got = b.net.dial(a.addr.clone()).await.unwrap();
    assert_eq!(got, a.id());
    let b_id = b.id();
    a.expect("PeerConnected", |e| match e {
        NetEvent::PeerConnected { peer, .. } if peer == b_id => Ok(()),
        other => Err(other),
    })
    .await;
    assert_eq!(b.net.connected_peers(), vec![a.id()]);

    b.net.send_raft(a.id(), b"vote for me".to_vec()).unwrap();
    let (from, frame) = a
        .expect("Raft", |e| match e {
            NetEvent::Raft { from, frame } => Ok((from, frame)),
            other => Err(other),
        })
        .await;
    assert_eq!((from, frame.as_slice()), (b.id(), &b"vote for me"[..]));

    // The other way, over the connection b opened.
    a.net.send_raft(b.id(), b"granted".to_vec()).unwrap();
    let (from, frame) = b
        .expect("Raft", |e| match e {
            NetEvent::Raft { from, frame } => Ok((from, frame)),
            other => Err(other),
        })
        .await;
    assert_eq!((from, frame.as_slice()), (a.id(), &b"granted"[..]));

    // Many frames in a row arrive, each once.
    for i in 0..200u32 {
        b.net.send_raft(a.id(), i.to_le_bytes().to_vec()).unwrap();
    }
    let mut seen = [false; 200];
    for _ in 0..200 {
        let frame = a
            .expect("Raft", |e| match e {
                NetEvent::Raft { frame, .. } => Ok(frame),
                other => Err(other),
            })
            .await;
        let i = u32::from_le_bytes(frame.try_into().unwrap()) as usize;
        assert!(!seen[i], "frame {i} twice");
        seen[i] = true;
    }

    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn three_nodes_reach_each_other_through_known_addresses() {
    let mut hub = Node::start(|_| {}).await;
    let mut b = Node::start(|_| {}).await;
    let mut c = Node::start(|_| {}).await;
    b.net.dial(hub.addr.clone()).await.unwrap();
    c.net.dial(hub.addr.clone()).await.unwrap();

    // c has never connected to b; an address (as the membership table would give)
    // is enough for a Raft frame to find it.
    c.net.add_address(b.id(), b.addr.clone()).await.unwrap();
    c.net.send_raft(b.id(), b"c->b".to_vec()).unwrap();
    let (from, frame) = b
        .expect("Raft from c", |e| match e {
            NetEvent::Raft { from, frame } => Ok((from, frame)),
            other => Err(other),
        })
        .await;
    assert_eq!((from, frame), (c.id(), b"c->b".to_vec()));

    for (sender, to) in [(&hub, b.id()), (&hub, c.id()), (&b, hub.id())] {
        sender.net.send_raft(to, sender.id().to_bytes()).unwrap();
    }
    for node in [&mut b, &mut c, &mut hub] {
        let (from, frame) = node
            .expect("Raft", |e| match e {
                NetEvent::Raft { from, frame } => Ok((from, frame)),
                other => Err(other),
            })
            .await;
        assert_eq!(frame, from.to_bytes(), "the frame names its sender");
    }
    let mut peers = hub.net.connected_peers();
    peers.sort();
    let mut want = vec![b.id(), c.id()];
    want.sort();
    assert_eq!(peers, want);

    // identify told the hub where b listens.
    let b_id = b.id();
    let b_listen = b.addr.clone();
    let addrs = hub
        .expect("PeerDiscovered", |e| match e {
            NetEvent::PeerDiscovered { peer, addrs } if peer == b_id => Ok(addrs),
            other => Err(other),
        })
        .await;
    assert!(
        addrs
            .iter()
            .any(|a| b_listen.to_string().starts_with(&a.to_string())),
        "{addrs:?} should hold {b_listen}"
    );

    for node in [hub, b, c] {
        node.stop().await;
    }
}

#[tokio::test]
async fn a_ten_megabyte_blob_arrives_in_chunks_byte_for_byte() {
    // A holder without the blob lane: the bytes come in chunks.
    let server = Node::start(|c| c.blob_lane = false).await;
    // Small chunks and an odd size: many pipelined requests and a short last chunk.
    let client = Node::start(|c| {
        c.chunk_bytes = 256 << 10;
        c.fetch_window = 6;
    })
    .await;
    let data = pseudo_random(10_000_003, 7);
    let id = server.blobs.put(&data).unwrap();
    let peer = client.net.dial(server.addr.clone()).await.unwrap();

    client.net.fetch_blob(peer, id).await.unwrap();
    assert!(
        client.blobs.get(&id).unwrap().unwrap() == data,
        "bytes differ"
    );
    // Already here: a second fetch does not touch the network.
    client.net.fetch_blob(peer, id).await.unwrap();

    // An empty blob is a blob too.
    let empty = server.blobs.put(b"").unwrap();
    client.net.fetch_blob(peer, empty).await.unwrap();
    assert_eq!(client.blobs.get(&empty).unwrap().unwrap(), b"");

    server.stop().await;
    client.stop().await;
}

/// A blob being stored (staged: hashed, held in memory while it is written) is
/// served to a peer pulling its second copy, over the direct channel, the lane's
/// stream and in chunks alike, and is no longer served once the guard goes without
/// it stored.
#[tokio::test]
async fn a_staged_blob_is_served_while_it_is_written() {
    for (lane, direct) in [(true, true), (true, false), (false, false)] {
        let server = Node::start(|c| {
            c.blob_lane = lane;
            c.blob_direct = direct;
        })
        .await;
        let client = Node::start(|_| {}).await;
        let data = std::sync::Arc::new(pseudo_random(3_000_017, 11));
        let id = BlobId::of(&data);
        let staged = server.blobs.stage(id, data.clone());
        assert!(!server.blobs.has(&id), "staged is not stored");
        let peer = client.net.dial(server.addr.clone()).await.unwrap();
        client.net.fetch_blob(peer, id).await.unwrap();
        assert!(
            client.blobs.get(&id).unwrap().unwrap() == *data,
            "bytes differ (lane {lane}, direct {direct})"
        );
        drop(staged);
        let other = pseudo_random(2_000_003, 12);
        let other_id = BlobId::of(&other);
        let gone = server.blobs.stage(other_id, std::sync::Arc::new(other));
        drop(gone);
        let err = client.net.fetch_blob(peer, other_id).await.unwrap_err();
        assert!(err.to_string().contains(&other_id.to_string()), "{err}");
        server.stop().await;
        client.stop().await;
    }
}

#[tokio::test]
async fn fetching_an_unknown_blob_names_the_blob_and_the_peer() {
    let server = Node::start(|_| {}).await;
    let client = Node::start(|_| {}).await;
    let peer = client.net.dial(server.addr.clone()).await.unwrap();
    let id = BlobId::of(b"nobody has this");
    let err = client.net.fetch_blob(peer, id).await.unwrap_err();
    assert!(matches!(err, NodeError::BlobNotFound { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains(&id.to_string()) && text.contains(&peer.to_string()),
        "{text}"
    );
    assert!(!client.blobs.has(&id));
    server.stop().await;
    client.stop().await;
}

#[tokio::test]
async fn node_requests_reach_the_node_and_its_answer_comes_back() {
    let mut a = Node::start(|_| {}).await;
    let b = Node::start(|_| {}).await;
    b.net.dial(a.addr.clone()).await.unwrap();
    let a_id = a.id();

    let asking = tokio::spawn({
        let net = b.net.clone();
        async move { net.request(a_id, MeshRequest::Node(b"ping".to_vec())).await }
    });
    let (request, reply) = a
        .expect("Request", |e| match e {
            NetEvent::Request { request, reply, .. } => Ok((request, reply)),
            other => Err(other),
        })
        .await;
    assert_eq!(request, MeshRequest::Node(b"ping".to_vec()));
    reply.send(MeshResponse::Node(b"pong".to_vec())).unwrap();
    let answer = tokio::time::timeout(WAIT, asking)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(answer, MeshResponse::Node(b"pong".to_vec()));

    // A node that drops the reply answers with an error instead of leaving the peer
    // waiting out its timeout.
    let asking = tokio::spawn({
        let net = b.net.clone();
        async move {
            net.request(a_id, MeshRequest::Node(b"hello?".to_vec()))
                .await
        }
    });
    let reply = a
        .expect("Request", |e| match e {
            NetEvent::Request { reply, .. } => Ok(reply),
            other => Err(other),
        })
        .await;
    drop(reply);
    let answer = tokio::time::timeout(WAIT, asking)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(
        matches!(answer, MeshResponse::Error(ref e) if e.contains("did not handle the node request")),
        "{answer:?}"
    );

    a.stop().await;
    b.stop().await;
}

/// Writes whatever bytes it is given as a "request" on the gpumesh protocol.
#[derive(Clone, Default)]
struct JunkCodec;

#[async_trait]
impl request_response::Codec for JunkCodec {
    type Protocol = StreamProtocol;
    type Request = Vec<u8>;
    type Response = Vec<u8>;

    async fn read_request<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<Vec<u8>>
    where
        T: AsyncRead + Unpin + Send,
    {
        let mut out = Vec::new();
        io.read_to_end(&mut out).await?;
        Ok(out)
    }

    async fn read_response<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<Vec<u8>>
    where
        T: AsyncRead + Unpin + Send,
    {
        let mut out = Vec::new();
        io.read_to_end(&mut out).await?;
        Ok(out)
    }

    async fn write_request<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        req: Vec<u8>,
    ) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        io.write_all(&req).await
    }

    async fn write_response<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        res: Vec<u8>,
    ) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        io.write_all(&res).await
    }
}

fn framed(body: &[u8]) -> Vec<u8> {
    let mut out = (body.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(body);
    out
}

#[tokio::test]
async fn garbage_on_the_wire_does_not_stop_the_node_from_serving() {
    let victim = Node::start(|c| c.max_frame_bytes = 4 << 20).await;
    let data = pseudo_random(300_000, 3);
    let id = victim.blobs.put(&data).unwrap();

    // 1. Raw TCP junk at the listening port: fails the handshake, nothing more.
    let tcp_port = victim.port();
    for junk in [&b"GET / HTTP/1.1\r\n\r\n"[..], &[0xFF; 4096][..], &[][..]] {
        use tokio::io::AsyncWriteExt as _;
        let mut raw = tokio::net::TcpStream::connect(("127.0.0.1", tcp_port))
            .await
            .unwrap();
        let _ = raw.write_all(junk).await;
        let _ = raw.shutdown().await;
    }

    // 2. A real, authenticated libp2p peer that speaks the gpumesh protocol badly.
    let mut rogue = SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_tcp(
            tcp::Config::default(),
            noise::Config::new,
            yamux::Config::default,
        )
        .unwrap()
        .with_behaviour(|_| {
            request_response::Behaviour::<JunkCodec>::new(
                [(MESH_PROTOCOL, ProtocolSupport::Full)],
                request_response::Config::default().with_request_timeout(Duration::from_secs(5)),
            )
        })
        .unwrap()
        .build();
    rogue.dial(victim.addr.clone()).unwrap();
    let junk: Vec<Vec<u8>> = vec![
        b"definitely not an envelope".to_vec(), // no length prefix at all
        u32::MAX.to_le_bytes().to_vec(),        // a length over the limit
        framed(&[0xAB; 100]),                   // bad magic
        framed(&seal(&"a string, not a request").unwrap()), // right envelope, wrong type
        [framed(&seal(&MeshRequest::Node(vec![1; 64])).unwrap())[..40].to_vec()].concat(), // cut short
        vec![],                     // nothing
        pseudo_random(1 << 20, 11), // a megabyte of noise
    ];
    // And a well-formed node request: those come on the call lane only, so this
    // protocol refuses it, saying where they go, and the node never sees it.
    let node_request = [
        framed(&seal(&MeshRequest::Node(vec![])).unwrap()),
        framed(&[1; 64]),
    ]
    .concat();
    let mut refused = None;
    let victim_id = victim.id();
    let mut outstanding = 0;
    let mut sent = false;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let event = tokio::time::timeout_at(deadline, rogue.select_next_some())
            .await
            .expect("rogue peer's requests did not all finish");
        match event {
            SwarmEvent::ConnectionEstablished { peer_id, .. } if peer_id == victim_id && !sent => {
                for bytes in &junk {
                    rogue
                        .behaviour_mut()
                        .send_request(&victim_id, bytes.clone());
                    outstanding += 1;
                }
                let id = rogue
                    .behaviour_mut()
                    .send_request(&victim_id, node_request.clone());
                refused = Some((id, None));
                outstanding += 1;
                sent = true;
            }
            SwarmEvent::Behaviour(request_response::Event::OutboundFailure { .. }) => {
                outstanding -= 1;
            }
            SwarmEvent::Behaviour(request_response::Event::Message { message, .. }) => {
                if let request_response::Message::Response {
                    response,
                    request_id,
                } = message
                {
                    match refused.as_mut() {
                        Some((id, answer)) if *id == request_id => *answer = Some(response),
                        // The victim never answers junk with a real answer.
                        _ => assert!(
                            response.is_empty(),
                            "answered junk with {} bytes",
                            response.len()
                        ),
                    }
                }
                outstanding -= 1;
            }
            _ => {}
        }
        if sent && outstanding == 0 {
            break;
        }
    }
    assert!(
        rogue.is_connected(&victim_id),
        "bad streams must not cost the connection"
    );
    assert!(!victim.task.is_finished(), "the net actor died");
    let answer = refused
        .and_then(|(_, a)| a)
        .expect("the node request was answered");
    let len = u32::from_le_bytes(answer[..4].try_into().unwrap()) as usize;
    let answer: MeshResponse = gpumesh_protocol::open(&answer[4..4 + len]).unwrap();
    match answer {
        MeshResponse::Error(why) => assert!(why.contains(CALL_PROTOCOL.as_ref()), "{why}"),
        other => panic!("a node request on the blob protocol was answered {other:?}"),
    }

    // 3. The victim still serves a well-behaved peer.
    let client = Node::start(|c| c.chunk_bytes = 64 << 10).await;
    let peer = client.net.dial(victim.addr.clone()).await.unwrap();
    client.net.fetch_blob(peer, id).await.unwrap();
    assert_eq!(client.blobs.get(&id).unwrap().unwrap(), data);
    client.net.send_raft(peer, b"still here?".to_vec()).unwrap();
    let mut victim = victim;
    let frame = victim
        .expect("Raft", |e| match e {
            NetEvent::Raft { frame, .. } => Ok(frame),
            other => Err(other),
        })
        .await;
    assert_eq!(frame, b"still here?");
    while let Ok(event) = victim.events.try_recv() {
        victim.backlog.push_back(event);
    }
    assert!(
        !victim
            .backlog
            .iter()
            .any(|e| matches!(e, NetEvent::Request { .. })),
        "a node request on the blob protocol reached the node"
    );

    victim.stop().await;
    client.stop().await;
}

/// A libp2p peer outside gpumesh, dialled to `victim`, that opens raw streams on
/// its connection: its id, its stream control, and the task polling its swarm
/// (streams open only while the swarm is polled).
fn rogue_streams(victim: &Multiaddr) -> (PeerId, libp2p_stream::Control, JoinHandle<()>) {
    let mut rogue = SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_tcp(
            tcp::Config::default(),
            noise::Config::new,
            yamux::Config::default,
        )
        .unwrap()
        .with_behaviour(|_| libp2p_stream::Behaviour::new())
        .unwrap()
        .build();
    let id = *rogue.local_peer_id();
    let control = rogue.behaviour().new_control();
    rogue.dial(victim.clone()).unwrap();
    let driver = tokio::spawn(async move {
        loop {
            rogue.select_next_some().await;
        }
    });
    (id, control, driver)
}

#[tokio::test]
async fn garbage_on_a_raft_stream_closes_that_stream_and_nothing_else() {
    let mut victim = Node::start(|c| {
        c.max_frame_bytes = 1 << 20;
        c.chunk_bytes = 64 << 10;
    })
    .await;
    let victim_id = victim.id();
    let (_, mut control, driver) = rogue_streams(&victim.addr);
    let raft = RAFT_PROTOCOL;
    let framed_raft =
        |body: &[u8]| [(body.len() as u32).to_le_bytes().to_vec(), body.to_vec()].concat();
    let junk: Vec<Vec<u8>> = vec![
        u32::MAX.to_le_bytes().to_vec(),       // a length far over the limit
        (2u32 << 20).to_le_bytes().to_vec(),   // just over it
        framed_raft(&[7; 100])[..50].to_vec(), // cut short
        vec![1, 2],                            // not even a length
    ];
    for bytes in &junk {
        let mut stream = tokio::time::timeout(WAIT, control.open_stream(victim_id, raft.clone()))
            .await
            .unwrap()
            .unwrap();
        let _ = stream.write_all(bytes).await;
        let _ = stream.close().await;
        // The victim closes an over-limit stream from its end: reading ends.
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(WAIT, stream.read_to_end(&mut rest))
            .await
            .unwrap();
    }
    // A well-formed frame from the same peer, on a fresh stream, still arrives;
    // the first junk stream's frames never did.
    let mut stream = control.open_stream(victim_id, raft).await.unwrap();
    stream
        .write_all(&framed_raft(b"hello after junk"))
        .await
        .unwrap();
    stream.flush().await.unwrap();
    let frame = victim
        .expect("Raft", |e| match e {
            NetEvent::Raft { frame, .. } => Ok(frame),
            other => Err(other),
        })
        .await;
    assert_eq!(frame, b"hello after junk");
    assert!(!victim.task.is_finished(), "the net actor died");
    driver.abort();
    victim.stop().await;
}

/// A call-lane frame: length, id, kind, body.
fn call_frame(id: u64, kind: u8, body: &[u8]) -> Vec<u8> {
    [
        ((8 + 1 + body.len()) as u32).to_le_bytes().to_vec(),
        id.to_le_bytes().to_vec(),
        vec![kind],
        body.to_vec(),
    ]
    .concat()
}

#[tokio::test]
async fn node_requests_in_flight_together_each_get_their_own_answer() {
    let mut a = Node::start(|_| {}).await;
    let b = Node::start(|_| {}).await;
    b.net.dial(a.addr.clone()).await.unwrap();
    let a_id = a.id();
    let mut asking = Vec::new();
    for i in 0..20u8 {
        let net = b.net.clone();
        asking.push(tokio::spawn(async move {
            net.request(a_id, MeshRequest::Node(vec![i; 1 + usize::from(i)]))
                .await
        }));
    }
    let mut replies = Vec::new();
    for _ in 0..20 {
        replies.push(
            a.expect("Request", |e| match e {
                NetEvent::Request {
                    request: MeshRequest::Node(body),
                    reply,
                    ..
                } => Ok((body, reply)),
                other => Err(other),
            })
            .await,
        );
    }
    // Answered newest first: each caller still gets the answer to its own request.
    for (body, reply) in replies.into_iter().rev() {
        let answer = body.iter().map(|b| b.wrapping_mul(3)).collect();
        reply.send(MeshResponse::Node(answer)).unwrap();
    }
    for (i, asked) in asking.into_iter().enumerate() {
        let answer = tokio::time::timeout(WAIT, asked)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let i = i as u8;
        assert_eq!(
            answer,
            MeshResponse::Node(vec![i.wrapping_mul(3); 1 + usize::from(i)])
        );
    }
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn first_requests_from_many_peers_at_once_are_all_answered() {
    // Each peer's first request opens its call stream; arriving together, the
    // node cannot take them all at once (libp2p drops what its queue of new streams
    // has no room for), and each must still get through.
    let mut victim = Node::start(|_| {}).await;
    let victim_id = victim.id();
    let mut peers = Vec::new();
    for _ in 0..8 {
        let p = Node::start(|_| {}).await;
        p.net.dial(victim.addr.clone()).await.unwrap();
        peers.push(p);
    }
    for round in 0..3u8 {
        let start = std::sync::Arc::new(tokio::sync::Barrier::new(peers.len()));
        let mut asking = Vec::new();
        for (i, p) in peers.iter().enumerate() {
            let (net, start) = (p.net.clone(), start.clone());
            asking.push(tokio::spawn(async move {
                start.wait().await;
                net.request(victim_id, MeshRequest::Node(vec![round, i as u8]))
                    .await
            }));
        }
        for _ in 0..peers.len() {
            let (body, reply) = victim
                .expect("Request", |e| match e {
                    NetEvent::Request {
                        request: MeshRequest::Node(body),
                        reply,
                        ..
                    } => Ok((body, reply)),
                    other => Err(other),
                })
                .await;
            reply.send(MeshResponse::Node(body)).unwrap();
        }
        for (i, asked) in asking.into_iter().enumerate() {
            let answer = tokio::time::timeout(WAIT, asked).await.unwrap().unwrap();
            assert_eq!(
                answer.unwrap(),
                MeshResponse::Node(vec![round, i as u8]),
                "peer {i}, round {round}"
            );
        }
    }
    victim.stop().await;
    for p in peers {
        p.stop().await;
    }
}

#[tokio::test]
async fn many_peers_pulling_from_one_holder_at_once_all_get_the_blob() {
    // Small and large (the direct channel) blobs, each pull on a blob stream of its
    // own opened at the same moment: the holder cannot take them all at once.
    let holder = Node::start(|_| {}).await;
    let small = pseudo_random(10_000, 3);
    let large = pseudo_random(1_500_000, 4);
    let ids = [
        holder.blobs.put(&small).unwrap(),
        holder.blobs.put(&large).unwrap(),
    ];
    let mut pullers = Vec::new();
    for _ in 0..8 {
        let p = Node::start(|_| {}).await;
        p.net.dial(holder.addr.clone()).await.unwrap();
        pullers.push(p);
    }
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(pullers.len() * 2));
    let mut pulling = Vec::new();
    for p in &pullers {
        for id in ids {
            let (net, start, from) = (p.net.clone(), start.clone(), holder.id());
            pulling.push(tokio::spawn(async move {
                start.wait().await;
                net.fetch_blob(from, id).await
            }));
        }
    }
    for pulled in pulling {
        tokio::time::timeout(WAIT, pulled)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
    for p in &pullers {
        assert!(p.blobs.get(&ids[0]).unwrap().unwrap() == small);
        assert!(p.blobs.get(&ids[1]).unwrap().unwrap() == large);
    }
    holder.stop().await;
    for p in pullers {
        p.stop().await;
    }
}

#[tokio::test]
async fn first_raft_frames_from_many_peers_at_once_all_arrive() {
    let mut victim = Node::start(|_| {}).await;
    let victim_id = victim.id();
    let mut peers = Vec::new();
    for _ in 0..8 {
        let p = Node::start(|_| {}).await;
        p.net.dial(victim.addr.clone()).await.unwrap();
        peers.push(p);
    }
    // Each peer's first frame opens its Raft stream, all at the same moment.
    for (i, p) in peers.iter().enumerate() {
        p.net.send_raft(victim_id, vec![i as u8; 3]).unwrap();
    }
    let mut got = std::collections::BTreeMap::new();
    for _ in 0..peers.len() {
        let (from, frame) = victim
            .expect("Raft", |e| match e {
                NetEvent::Raft { from, frame } => Ok((from, frame)),
                other => Err(other),
            })
            .await;
        got.insert(from, frame);
    }
    for (i, p) in peers.iter().enumerate() {
        assert_eq!(got.get(&p.id()), Some(&vec![i as u8; 3]), "peer {i}");
    }
    victim.stop().await;
    for p in peers {
        p.stop().await;
    }
}

#[tokio::test]
async fn a_request_to_a_peer_not_connected_dials_it_at_a_known_address_or_says_it_cannot() {
    let mut a = Node::start(|_| {}).await;
    let b = Node::start(|c| c.request_timeout = Duration::from_secs(600)).await;
    let a_id = a.id();
    // No connection and no address: nothing can be sent, and the error says so at
    // once (not after the request timeout).
    let err = tokio::time::timeout(WAIT, b.net.request(a_id, MeshRequest::Node(b"hi".to_vec())))
        .await
        .expect("waited out a timeout")
        .unwrap_err();
    assert!(
        matches!(err, NodeError::Unreached { ref peer, .. } if *peer == a_id.to_string()),
        "{err:?}"
    );
    // An address learned for it (as the membership sweep hands them on): the
    // request dials it and is answered.
    b.net.add_address(a_id, a.addr.clone()).await.unwrap();
    assert!(!b.net.connected_peers().contains(&a_id));
    let asking = tokio::spawn({
        let net = b.net.clone();
        async move { net.request(a_id, MeshRequest::Node(b"hi".to_vec())).await }
    });
    let reply = a
        .expect("Request", |e| match e {
            NetEvent::Request { reply, .. } => Ok(reply),
            other => Err(other),
        })
        .await;
    reply.send(MeshResponse::Node(b"hello".to_vec())).unwrap();
    let answer = tokio::time::timeout(WAIT, asking).await.unwrap().unwrap();
    assert_eq!(answer.unwrap(), MeshResponse::Node(b"hello".to_vec()));
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn a_request_waiting_on_a_peer_that_stops_fails_without_waiting_out_its_timeout() {
    let mut a = Node::start(|_| {}).await;
    let b = Node::start(|c| c.request_timeout = Duration::from_secs(600)).await;
    b.net.dial(a.addr.clone()).await.unwrap();
    let a_id = a.id();
    let asking = tokio::spawn({
        let net = b.net.clone();
        async move {
            net.request(a_id, MeshRequest::Node(b"anyone?".to_vec()))
                .await
        }
    });
    let reply = a
        .expect("Request", |e| match e {
            NetEvent::Request { reply, .. } => Ok(reply),
            other => Err(other),
        })
        .await;
    // The node stops without answering (its reply is never sent).
    std::mem::forget(reply);
    a.stop().await;
    let err = tokio::time::timeout(WAIT, asking)
        .await
        .expect("the request waited on a stopped peer")
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(err, NodeError::Request { ref peer, .. } if *peer == a_id.to_string()),
        "{err:?}"
    );
    b.stop().await;
}

#[tokio::test]
async fn garbage_on_a_call_stream_closes_that_stream_and_nothing_else() {
    let mut victim = Node::start(|c| {
        c.max_frame_bytes = 1 << 20;
        c.chunk_bytes = 64 << 10;
    })
    .await;
    let victim_id = victim.id();
    let (rogue_id, mut control, driver) = rogue_streams(&victim.addr);
    let lane = CALL_PROTOCOL;
    let junk: Vec<Vec<u8>> = vec![
        u32::MAX.to_le_bytes().to_vec(), // a length far over the limit
        ((1u32 << 20) + 1).to_le_bytes().to_vec(), // just over it
        3u32.to_le_bytes().to_vec(),     // too short for an id and a kind
        call_frame(1, 7, b"what kind is this"), // an unknown kind
        call_frame(2, 1, b"an answer nobody asked for"), // an answer sent as a request
        call_frame(3, 0, &[9; 100])[..50].to_vec(), // cut short
        vec![1, 2],                      // not even a length
    ];
    for bytes in &junk {
        let mut stream = tokio::time::timeout(WAIT, control.open_stream(victim_id, lane.clone()))
            .await
            .unwrap()
            .unwrap();
        let _ = stream.write_all(bytes).await;
        let _ = stream.close().await;
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(WAIT, stream.read_to_end(&mut rest))
            .await
            .unwrap();
        // The serving side's first byte says it took the stream; nothing follows.
        assert!(rest.len() <= 1, "junk was answered: {rest:?}");
    }
    // None of it reached the node as a request.
    assert!(!victim
        .backlog
        .iter()
        .any(|e| matches!(e, NetEvent::Request { .. })));
    while let Ok(e) = victim.events.try_recv() {
        assert!(
            !matches!(e, NetEvent::Request { .. }),
            "junk reached the node"
        );
    }
    // A well-formed request on a fresh stream reaches the node, and its answer comes
    // back under the request's id.
    let mut stream = control.open_stream(victim_id, lane).await.unwrap();
    stream
        .write_all(&call_frame(41, 0, b"hello after junk"))
        .await
        .unwrap();
    stream.flush().await.unwrap();
    let (from, reply) = victim
        .expect("Request", |e| match e {
            NetEvent::Request {
                from,
                request: MeshRequest::Node(body),
                reply,
            } if body == b"hello after junk" => Ok((from, reply)),
            other => Err(other),
        })
        .await;
    assert_eq!(from, rogue_id);
    reply.send(MeshResponse::Node(b"hi".to_vec())).unwrap();
    let mut answer = vec![0u8; 1 + 4 + 8 + 1 + 2];
    tokio::time::timeout(WAIT, stream.read_exact(&mut answer))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(answer, [&[0xA5][..], &call_frame(41, 1, b"hi")].concat());
    assert!(!victim.task.is_finished(), "the net actor died");
    driver.abort();
    victim.stop().await;
}

#[tokio::test]
async fn dialling_a_closed_port_is_refused_not_timed_out_naming_the_address() {
    // A dial timeout far longer than the test may take: the error must come from
    // the refusal itself, not from waiting the timeout out.
    let node = Node::start(|c| c.dial_timeout = Duration::from_secs(600)).await;
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    }; // closed again here
    let addr: Multiaddr = format!("/ip4/127.0.0.1/tcp/{port}").parse().unwrap();
    let err = node.net.dial(addr.clone()).await.unwrap_err();
    assert!(matches!(err, NodeError::Dial { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains(&addr.to_string()), "{text}");
    assert!(text.to_lowercase().contains("refused"), "{text}");
    node.stop().await;
}

#[tokio::test]
async fn a_peer_named_by_host_name_is_dialled_and_serves_blobs() {
    let server = Node::start(|_| {}).await;
    let client = Node::start(|_| {}).await;
    let named: Multiaddr = format!("/dns4/localhost/tcp/{}/p2p/{}", server.port(), server.id())
        .parse()
        .unwrap();
    assert_eq!(client.net.dial(named).await.unwrap(), server.id());
    // Over a megabyte: the pull asks for the direct channel.
    let data = pseudo_random(3_000_001, 11);
    let id = server.blobs.put(&data).unwrap();
    client.net.fetch_blob(server.id(), id).await.unwrap();
    assert!(
        client.blobs.get(&id).unwrap().unwrap() == data,
        "bytes differ"
    );

    // A name that does not resolve is an error that names the address.
    let nowhere: Multiaddr = "/dns4/no-such-host.invalid/tcp/4001".parse().unwrap();
    let err = client.net.dial(nowhere.clone()).await.unwrap_err();
    assert!(err.to_string().contains(&nowhere.to_string()), "{err}");
    server.stop().await;
    client.stop().await;
}

#[tokio::test]
async fn a_peer_that_never_answers_times_out_naming_the_address() {
    let node = Node::start(|c| c.dial_timeout = Duration::from_millis(800)).await;
    // Accepts TCP connections and then says nothing, like a wedged process.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let addr: Multiaddr = format!("/ip4/127.0.0.1/tcp/{port}").parse().unwrap();
    let err = node.net.dial(addr.clone()).await.unwrap_err();
    // The configured timeout ended it, and the error says which address and how long.
    match &err {
        NodeError::DialTimeout { secs, .. } => assert!((secs - 0.8).abs() < 0.05, "{err}"),
        other => panic!("expected a dial timeout, got {other:?}"),
    }
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
    holder.abort();
    node.stop().await;
}

#[tokio::test]
async fn only_nodes_with_the_same_cluster_key_connect() {
    let key = PreSharedKey::new([7; 32]);
    let a = Node::start(|c| c.psk = Some(key)).await;
    let b = Node::start(|c| c.psk = Some(key)).await;
    let stranger = Node::start(|c| {
        c.psk = Some(PreSharedKey::new([8; 32]));
        c.dial_timeout = Duration::from_millis(1500);
    })
    .await;
    let open = Node::start(|c| c.dial_timeout = Duration::from_millis(1500)).await;

    assert_eq!(b.net.dial(a.addr.clone()).await.unwrap(), a.id());
    // Usually refused at once; a handshake that reads the other side's random bytes as
    // a length can also just stall, which the dial timeout ends.
    for outsider in [&stranger, &open] {
        let err = outsider.net.dial(a.addr.clone()).await.unwrap_err();
        assert!(err.to_string().contains(&a.addr.to_string()), "{err}");
    }
    assert_eq!(a.net.connected_peers(), vec![b.id()]);
    for node in [a, b, stranger, open] {
        node.stop().await;
    }
}

#[tokio::test]
async fn bootstrap_peers_are_dialled_at_start_and_after_they_come_up() {
    let mut a = Node::start(|_| {}).await;
    let a_addr = a.addr.clone();
    // A bootstrap peer that is not up yet, on a port that is closed for now.
    let later_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let later_addr: Multiaddr = format!("/ip4/127.0.0.1/tcp/{later_port}").parse().unwrap();
    let mut b = Node::start(|c| {
        c.peers = vec![a_addr, later_addr.clone()];
        c.redial_interval = Duration::from_millis(100);
    })
    .await;
    let b_id = b.id();
    a.expect("PeerConnected from bootstrap", |e| match e {
        NetEvent::PeerConnected { peer, .. } if peer == b_id => Ok(()),
        other => Err(other),
    })
    .await;

    let late = Node::start(|c| c.listen = vec![later_addr.clone()]).await;
    let late_id = late.id();
    b.expect("PeerConnected to the late peer", |e| match e {
        NetEvent::PeerConnected { peer, .. } if peer == late_id => Ok(()),
        other => Err(other),
    })
    .await;
    for node in [a, b, late] {
        node.stop().await;
    }
}

#[tokio::test]
async fn the_transfer_bench_reports_all_three_paths() {
    // How the paths compare is the benchmark's to measure (`gpumesh bench blobs`);
    // this test checks that every path ran and is reported, on each route.
    for route in [BlobRoute::Direct, BlobRoute::Stream, BlobRoute::Chunks] {
        let report = bench_blob_transfer_with(2 << 20, 256 << 10, 4, route)
            .await
            .unwrap();
        assert!(report.raw_tcp > Duration::ZERO && report.mesh_pull > Duration::ZERO);
        assert!(report.fetch_blob > Duration::ZERO && report.disk > Duration::ZERO);
        let text = report.to_string();
        assert!(
            text.contains("raw TCP") && text.contains("fetch_blob") && text.contains("disk alone"),
            "{text}"
        );
        assert_eq!(
            text.contains("blob lane"),
            route != BlobRoute::Chunks,
            "{text}"
        );
        assert_eq!(
            text.contains("direct"),
            route == BlobRoute::Direct,
            "{text}"
        );
    }
}

#[tokio::test]
async fn a_node_with_mdns_on_starts_and_works_even_where_multicast_does_not() {
    // In a container mDNS may fail to start; the node must log it and carry on.
    let a = Node::start(|c| c.mdns = true).await;
    let b = Node::start(|c| c.mdns = true).await;
    assert_eq!(b.net.dial(a.addr.clone()).await.unwrap(), a.id());
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn a_peer_with_a_smaller_frame_limit_serves_a_blob_in_smaller_pieces() {
    let server = Node::start(|c| {
        c.max_frame_bytes = 256 << 10;
        c.chunk_bytes = 128 << 10;
        c.blob_lane = false;
    })
    .await;
    let client = Node::start(|c| c.chunk_bytes = 1 << 20).await;
    let data = pseudo_random(3_000_001, 5);
    let id = server.blobs.put(&data).unwrap();
    let peer = client.net.dial(server.addr.clone()).await.unwrap();
    client.net.fetch_blob(peer, id).await.unwrap();
    assert!(
        client.blobs.get(&id).unwrap().unwrap() == data,
        "bytes differ"
    );
    server.stop().await;
    client.stop().await;
}

/// A bare libp2p peer (TCP + Noise + Yamux, no protocols) that keeps idle connections,
/// to open as many as it likes.
fn bare_peer() -> Swarm<dummy::Behaviour> {
    SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_tcp(
            tcp::Config::default(),
            noise::Config::new,
            yamux::Config::default,
        )
        .unwrap()
        .with_behaviour(|_| dummy::Behaviour)
        .unwrap()
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(60)))
        .build()
}

/// Dials `to` `times` times, each a connection of its own, and drives the swarm until
/// every dial has ended up open or closed and nothing has changed for a moment;
/// returns how many stay open.
async fn open_connections(
    swarm: &mut Swarm<dummy::Behaviour>,
    to: &Multiaddr,
    times: usize,
) -> u32 {
    let peer = match to.iter().last() {
        Some(Protocol::P2p(peer)) => peer,
        _ => panic!("{to} has no /p2p/"),
    };
    for _ in 0..times {
        swarm
            .dial(
                DialOpts::peer_id(peer)
                    .addresses(vec![to.clone()])
                    .condition(PeerCondition::Always)
                    .build(),
            )
            .unwrap();
    }
    let mut ended = 0;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let quiet = tokio::time::Instant::now() + Duration::from_millis(700);
        match tokio::time::timeout_at(quiet.min(deadline), swarm.select_next_some()).await {
            Ok(
                SwarmEvent::ConnectionEstablished { .. }
                | SwarmEvent::OutgoingConnectionError { .. },
            ) => ended += 1,
            Ok(_) => {}
            Err(_) if ended >= times => break,
            Err(_) => assert!(
                tokio::time::Instant::now() < deadline,
                "only {ended} of {times} dials ended within {WAIT:?}"
            ),
        }
    }
    swarm.network_info().connection_counters().num_established()
}

#[tokio::test]
async fn connections_over_the_caps_are_refused_and_the_node_keeps_serving() {
    let mut victim = Node::start(|c| {
        c.connections = ConnectionCaps {
            per_peer: 2,
            total: 3,
            pending_incoming: 16,
        }
    })
    .await;
    let data = pseudo_random(200_000, 17);
    let id = victim.blobs.put(&data).unwrap();

    // One peer asks for five connections: it keeps two.
    let mut greedy = bare_peer();
    assert_eq!(open_connections(&mut greedy, &victim.addr, 5).await, 2);
    // Another asks for two: the node holds three in all, so it keeps one.
    let mut second = bare_peer();
    assert_eq!(open_connections(&mut second, &victim.addr, 2).await, 1);

    // The node's own dials count too, and its refusal names the limit and the flag.
    let spare = Node::start(|_| {}).await;
    let without_id: Multiaddr = spare
        .addr
        .iter()
        .filter(|p| !matches!(p, Protocol::P2p(_)))
        .collect();
    let err = victim.net.dial(without_id).await.unwrap_err().to_string();
    assert!(
        err.contains("at most 3 established connections") && err.contains("--max-connections"),
        "{err}"
    );

    // Room again once a peer goes: a well-behaved node gets in and is served.
    drop(second);
    let client = Node::start(|c| c.chunk_bytes = 64 << 10).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    let peer = loop {
        // The node notices the closed connection a moment after it closes.
        let peer = client.net.dial(victim.addr.clone()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        if client.net.connected_peers().contains(&peer) {
            break peer;
        }
        assert!(tokio::time::Instant::now() < deadline, "never admitted");
    };
    client.net.fetch_blob(peer, id).await.unwrap();
    assert_eq!(client.blobs.get(&id).unwrap().unwrap(), data);
    client.net.send_raft(peer, b"served".to_vec()).unwrap();
    let frame = victim
        .expect("Raft", |e| match e {
            NetEvent::Raft { frame, .. } => Ok(frame),
            other => Err(other),
        })
        .await;
    assert_eq!(frame, b"served");
    // The greedy peer's two connections were never dropped.
    assert_eq!(open_connections(&mut greedy, &victim.addr, 0).await, 2);
    assert!(!victim.task.is_finished(), "the net actor died");

    for node in [victim, spare, client] {
        node.stop().await;
    }
}

#[tokio::test]
async fn an_allow_list_admits_only_its_peers_both_ways() {
    let friend_key = Keypair::generate_ed25519();
    let friend_id = friend_key.public().to_peer_id();
    let guarded = Node::start(|c| c.allow_peers = vec![friend_id]).await;
    let friend = Node::start(|c| c.keypair = friend_key).await;
    let stranger = Node::start(|_| {}).await;

    assert_eq!(
        friend.net.dial(guarded.addr.clone()).await.unwrap(),
        guarded.id()
    );
    // The stranger completes its handshake, and then the guarded node hangs up.
    let _ = stranger.net.dial(guarded.addr.clone()).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while stranger.net.connected_peers().contains(&guarded.id()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "stranger still connected"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stranger_id = stranger.id();
    let err = stranger
        .net
        .request(guarded.id(), MeshRequest::Node(b"hello?".to_vec()))
        .await
        .unwrap_err();
    // Nothing was sent: the guarded node cannot be reached at all.
    assert!(matches!(err, NodeError::Unreached { .. }), "{err:?}");
    // Nor does the guarded node connect out to anyone unlisted.
    let err = guarded.net.dial(stranger.addr.clone()).await.unwrap_err();
    assert!(
        err.to_string()
            .contains(&format!("peer {stranger_id} is not in the allow list")),
        "{err}"
    );
    assert_eq!(guarded.net.connected_peers(), vec![friend_id]);

    for node in [guarded, friend, stranger] {
        node.stop().await;
    }
}

/// The next Raft frame `node` gets within `within`, if any.
async fn raft_frame_within(node: &mut Node, within: Duration) -> Option<(PeerId, Vec<u8>)> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let event = tokio::time::timeout_at(deadline, node.events.recv())
            .await
            .ok()??;
        if let NetEvent::Raft { from, frame } = event {
            return Some((from, frame));
        }
    }
}

/// Sends frame `tag` from `from` to `to` every 100 ms until `to` gets one of them.
async fn resend_until_one_arrives(from: &Node, to: &mut Node, tag: &[u8]) {
    for _ in 0..150 {
        let _ = from.net.send_raft(to.id(), tag.to_vec());
        if let Some((peer, frame)) = raft_frame_within(to, Duration::from_millis(100)).await {
            if peer == from.id() && frame == tag {
                return;
            }
        }
    }
    panic!("no frame {tag:?} arrived within 15 s");
}

#[tokio::test]
async fn raft_frames_go_over_the_direct_channel_and_a_cut_peer_gets_none_either_way() {
    let mut a = Node::start(|_| {}).await;
    let b = Node::start(|_| {}).await;
    b.net.dial(a.addr.clone()).await.unwrap();
    for i in 0..100u32 {
        b.net.send_raft(a.id(), i.to_le_bytes().to_vec()).unwrap();
    }
    let mut seen = [false; 100];
    for _ in 0..100 {
        let (from, frame) = raft_frame_within(&mut a, WAIT).await.expect("a frame");
        assert_eq!(from, b.id());
        let i = u32::from_le_bytes(frame.try_into().unwrap()) as usize;
        assert!(!seen[i], "frame {i} twice");
        seen[i] = true;
    }
    assert_eq!(
        b.net.raft_direct_peers(),
        vec![a.id()],
        "b's frames to a go over the direct channel"
    );

    // The receiver cuts the sender off while the sender's direct connection is up:
    // what arrives on it is dropped and the connection closed.
    a.net.cut(b.id()).await.unwrap();
    for i in 0..10u32 {
        let _ = b.net.send_raft(a.id(), i.to_le_bytes().to_vec());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        raft_frame_within(&mut a, Duration::from_secs(1)).await,
        None
    );
    a.net.mend(b.id()).await.unwrap();
    resend_until_one_arrives(&b, &mut a, b"after the receiver mended").await;

    // The sender cuts the receiver off: nothing is written to it, directly or not.
    b.net.cut(a.id()).await.unwrap();
    for _ in 0..10 {
        let _ = b.net.send_raft(a.id(), b"dropped".to_vec());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        raft_frame_within(&mut a, Duration::from_secs(1)).await,
        None
    );
    assert!(b.net.raft_direct_peers().is_empty());
    b.net.mend(a.id()).await.unwrap();
    resend_until_one_arrives(&b, &mut a, b"after the sender mended").await;

    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn without_the_direct_channel_raft_frames_go_over_the_stream() {
    let mut a = Node::start(|c| c.blob_direct = false).await;
    let b = Node::start(|c| c.blob_direct = false).await;
    b.net.dial(a.addr.clone()).await.unwrap();
    b.net.send_raft(a.id(), b"on the stream".to_vec()).unwrap();
    let (from, frame) = raft_frame_within(&mut a, WAIT).await.expect("a frame");
    assert_eq!((from, frame.as_slice()), (b.id(), &b"on the stream"[..]));
    assert!(b.net.raft_direct_peers().is_empty());
    a.stop().await;
    b.stop().await;
}

/// Has `node` answer every node request itself, with the body reversed and the
/// asker's id appended; returns how many it has answered.
fn answer_reversed(node: &Node) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let answered = std::sync::Arc::new(AtomicUsize::new(0));
    let count = answered.clone();
    node.net
        .set_request_sink(std::sync::Arc::new(move |from, request| {
            count.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                match request {
                    MeshRequest::Node(mut body) => {
                        body.reverse();
                        body.extend_from_slice(&from.to_bytes());
                        MeshResponse::Node(body)
                    }
                    other => MeshResponse::Error(format!("not a node request: {other:?}")),
                }
            })
        }));
    answered
}

/// Asks `to` from `from` until an answer comes (at most 15 s); checks it.
async fn ask_until_answered(from: &Node, to: PeerId, body: &[u8]) {
    let mut expected: Vec<u8> = body.iter().rev().copied().collect();
    expected.extend_from_slice(&from.id().to_bytes());
    for _ in 0..75 {
        let asked = from.net.request(to, MeshRequest::Node(body.to_vec()));
        if let Ok(Ok(answer)) = tokio::time::timeout(Duration::from_secs(2), asked).await {
            assert_eq!(answer, MeshResponse::Node(expected));
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("no answer to {body:?} within 15 s");
}

/// Asks `to` from `from` `times` times while one has cut the other off: each
/// request fails at once (it does not wait out its timeout) and none reaches `to`,
/// whose served requests `served` counts.
async fn fail_unserved(
    from: &Node,
    to: PeerId,
    served: &std::sync::atomic::AtomicUsize,
    times: usize,
) {
    use std::sync::atomic::Ordering;
    let before = served.load(Ordering::SeqCst);
    for _ in 0..times {
        let asked = from.net.request(to, MeshRequest::Node(b"cut".to_vec()));
        let answer = tokio::time::timeout(WAIT, asked)
            .await
            .expect("a quick failure");
        assert!(answer.is_err(), "{answer:?}");
    }
    assert_eq!(
        served.load(Ordering::SeqCst),
        before,
        "a cut request was served"
    );
}

#[tokio::test]
async fn node_requests_go_over_the_direct_connection_and_a_cut_peer_gets_none_either_way() {
    use std::sync::atomic::Ordering;
    let a = Node::start(|_| {}).await;
    let b = Node::start(|_| {}).await;
    let (at_a, at_b) = (answer_reversed(&a), answer_reversed(&b));
    b.net.dial(a.addr.clone()).await.unwrap();
    // Many in flight at once, each answered under its own id, both ways.
    let mut asking = Vec::new();
    for i in 0..40u8 {
        let (from, to) = match i % 2 {
            0 => (b.net.clone(), a.id()),
            _ => (a.net.clone(), b.id()),
        };
        asking.push(tokio::spawn(async move {
            let body = vec![i; 1 + 100 * usize::from(i)];
            let answer = from.request(to, MeshRequest::Node(body.clone())).await;
            (body, from.local_peer_id(), answer)
        }));
    }
    for asked in asking {
        let (mut body, from, answer) = tokio::time::timeout(WAIT, asked).await.unwrap().unwrap();
        body.reverse();
        body.extend_from_slice(&from.to_bytes());
        assert_eq!(answer.unwrap(), MeshResponse::Node(body));
    }
    assert_eq!(
        b.net.call_direct_peers(),
        vec![a.id()],
        "b's calls go direct"
    );
    assert_eq!(
        a.net.call_direct_peers(),
        vec![b.id()],
        "a's calls go direct"
    );

    // The receiver cuts the asker off while the direct connection is up: the
    // request fails (it does not wait out its timeout) and never reaches the node.
    a.net.cut(b.id()).await.unwrap();
    fail_unserved(&b, a.id(), &at_a, 3).await;
    a.net.mend(b.id()).await.unwrap();
    ask_until_answered(&b, a.id(), b"after the receiver mended").await;

    // The asker cuts the receiver off: nothing is written to it either way.
    b.net.cut(a.id()).await.unwrap();
    fail_unserved(&b, a.id(), &at_a, 1).await;
    assert!(b.net.call_direct_peers().is_empty());
    b.net.mend(a.id()).await.unwrap();
    ask_until_answered(&b, a.id(), b"after the asker mended").await;
    assert_eq!(b.net.call_direct_peers(), vec![a.id()]);
    assert!(at_b.load(Ordering::SeqCst) >= 20);

    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn a_peer_without_a_direct_listener_gets_its_node_requests_on_the_stream() {
    // a takes no direct connections; b offers one, is told no, and asks on the
    // stream from then on.
    let a = Node::start(|c| c.blob_direct = false).await;
    let b = Node::start(|_| {}).await;
    answer_reversed(&a);
    b.net.dial(a.addr.clone()).await.unwrap();
    ask_until_answered(&b, a.id(), b"on the stream").await;
    ask_until_answered(&b, a.id(), b"still on the stream").await;
    assert!(b.net.call_direct_peers().is_empty());
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn garbage_on_a_direct_call_connection_closes_it_and_nothing_else() {
    let victim = Node::start(|_| {}).await;
    let victim_id = victim.id();
    let served = answer_reversed(&victim);
    let (_rogue_id, mut control, driver) = rogue_streams(&victim.addr);
    let lane = CALL_PROTOCOL;
    // An offer, then on the port it is given: the ticket and records that do not
    // open, a length over any limit, and a ticket that is not the one offered.
    let records: Vec<Vec<u8>> = vec![
        [&20u32.to_le_bytes()[..], &[7; 20]].concat(),
        u32::MAX.to_le_bytes().to_vec(),
        [&4u32.to_le_bytes()[..], b"tiny"].concat(),
    ];
    for (i, record) in records.iter().enumerate() {
        for wrong_ticket in [false, true] {
            let mut stream =
                tokio::time::timeout(WAIT, control.open_stream(victim_id, lane.clone()))
                    .await
                    .unwrap()
                    .unwrap();
            let (ticket, key) = ([i as u8 + 1; 16], [9u8; 32]);
            stream
                .write_all(&[&0u32.to_le_bytes()[..], &ticket, &key].concat())
                .await
                .unwrap();
            stream.flush().await.unwrap();
            let mut answer = [0u8; 4];
            tokio::time::timeout(WAIT, stream.read_exact(&mut answer))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(answer[..2], [0xA5, 1], "taken, and a port offered");
            let port = u16::from_le_bytes([answer[2], answer[3]]);
            let mut socket = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap();
            let sent = match wrong_ticket {
                true => [0xEE; 16],
                false => ticket,
            };
            use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
            socket.write_all(&sent).await.unwrap();
            let _ = socket.write_all(record).await;
            // The victim closes the connection and sends nothing on it.
            let mut rest = Vec::new();
            let read = tokio::time::timeout(WAIT, socket.read_to_end(&mut rest)).await;
            assert!(read.is_ok(), "the connection was left open");
            assert!(rest.is_empty(), "garbage was answered: {rest:?}");
        }
    }
    assert_eq!(served.load(std::sync::atomic::Ordering::SeqCst), 0);
    // The victim still serves a real peer, over its own direct connection.
    let peer = Node::start(|_| {}).await;
    peer.net.dial(victim.addr.clone()).await.unwrap();
    ask_until_answered(&peer, victim_id, b"after the garbage").await;
    assert_eq!(peer.net.call_direct_peers(), vec![victim_id]);
    driver.abort();
    victim.stop().await;
    peer.stop().await;
}
