//! Data formats: nodes of different formats never read each other's bytes. A peer
//! of another format is refused by name and the mesh goes on serving; a data
//! directory written by another format is refused and left as it was.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::{client, config, mesh_key, refused, seed, still_serves, stop, submit, LIMIT};
use futures::StreamExt;
use gpumesh::node::data_dir::FORMAT_FILE;
use gpumesh::node::net::noise_prologue;
use gpumesh::node::{Formation, MeshNode};
use gpumesh::protocol::FORMAT;
use gpumesh::shaders::builtins;
use libp2p::swarm::SwarmEvent;
use libp2p::{identify, noise, tcp, yamux, Multiaddr, PeerId, SwarmBuilder};
use tokio::sync::mpsc;

/// What the peer of another format saw.
#[derive(Debug)]
enum Seen {
    Listening(Multiaddr),
    Connected(PeerId),
    Closed(PeerId),
}

/// A libp2p peer holding the mesh's cluster key that identifies as a gpumesh node
/// of `agent` (as an older build would), listening on loopback and dialling `dial`;
/// what it sees comes on the channel. Stops with the test's runtime.
fn other_build(agent: &'static str, dial: Multiaddr) -> (PeerId, mpsc::UnboundedReceiver<Seen>) {
    let prologue = noise_prologue(&mesh_key().psk()).to_vec();
    let mut swarm = SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_tcp(
            tcp::Config::default(),
            move |key: &libp2p::identity::Keypair| {
                noise::Config::new(key).map(|c| c.with_prologue(prologue))
            },
            yamux::Config::default,
        )
        .unwrap()
        .with_behaviour(|key| {
            identify::Behaviour::new(
                identify::Config::new("/gpumesh/id/1".into(), key.public())
                    .with_agent_version(agent.into()),
            )
        })
        .unwrap()
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(60)))
        .build();
    let id = *swarm.local_peer_id();
    swarm
        .listen_on("/ip4/127.0.0.1/tcp/0".parse().unwrap())
        .unwrap();
    swarm.dial(dial).unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(event) = swarm.next().await {
            let seen = match event {
                SwarmEvent::NewListenAddr { address, .. } => Seen::Listening(address),
                SwarmEvent::ConnectionEstablished { peer_id, .. } => Seen::Connected(peer_id),
                SwarmEvent::ConnectionClosed {
                    peer_id,
                    num_established: 0,
                    ..
                } => Seen::Closed(peer_id),
                _ => continue,
            };
            if tx.send(seen).is_err() {
                return;
            }
        }
    });
    (id, rx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_peer_of_another_data_format_is_refused_by_name_and_the_mesh_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let a = MeshNode::start(config(&dir.path().join("a"), Formation::Init, &[]))
            .await
            .unwrap();

        // A node of an older format, holding the key, dials a member: the member
        // closes the connection once the peer has said what it runs.
        let (old, mut seen) = other_build("gpumesh/0.1.0 format/4", seed(&a));
        let mut listening = None;
        let mut connected = false;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let event = tokio::time::timeout_at(deadline, seen.recv())
                .await
                .expect("the member did not close the connection of another format")
                .unwrap();
            match event {
                Seen::Listening(addr) => listening = Some(addr),
                Seen::Connected(peer) if peer == a.peer_id => connected = true,
                Seen::Closed(peer) if peer == a.peer_id => break,
                _ => {}
            }
        }
        assert!(connected, "the connection was refused before the handshake");
        let old_addr: Multiaddr = format!("{}/p2p/{old}", listening.unwrap()).parse().unwrap();

        // A newcomer pointed at that node only is told why it cannot join.
        let mut c = config(
            &dir.path().join("b"),
            Formation::Join,
            std::slice::from_ref(&old_addr),
        );
        c.join_timeout = Duration::from_secs(3);
        let msg = refused(c).await;
        assert!(
            msg.contains("data format 4")
                && msg.contains(&format!("this node format {FORMAT}"))
                && msg.contains("run one gpumesh build on every node")
                && msg.contains(&old_addr.to_string()),
            "{msg}"
        );

        assert_eq!(client(&a).status().await.unwrap().members.len(), 1);
        still_serves(&a, &a).await;
        stop(vec![a]).await;
    })
    .await
    .expect("bounded");
}

/// Every file under `dir` but the format stamp, with its bytes.
fn contents(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                todo.push(path);
            } else if path.file_name().unwrap() != FORMAT_FILE {
                let name = path.strip_prefix(dir).unwrap().display().to_string();
                out.insert(name, std::fs::read(&path).unwrap());
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_data_dir_of_another_format_is_refused_and_left_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("a");
    tokio::time::timeout(LIMIT, async {
        let a = MeshNode::start(config(&data, Formation::Init, &[]))
            .await
            .unwrap();
        let problem = builtins::get("vector_add")
            .unwrap()
            .problem(256 * 4)
            .unwrap();
        let task = submit(&client(&a), &problem, 1).await;
        stop(vec![a]).await;
        let stamp = std::fs::read_to_string(data.join(FORMAT_FILE)).unwrap();
        assert_eq!(stamp.trim(), format!("gpumesh data format {FORMAT}"));
        let before = contents(&data);

        // As a build of another format left it, then as one from before formats.
        std::fs::write(data.join(FORMAT_FILE), "gpumesh data format 4\n").unwrap();
        let msg = refused(config(&data, Formation::Init, &[])).await;
        assert!(
            msg.contains("written by gpumesh data format 4")
                && msg.contains(&format!("reads data format {FORMAT}"))
                && msg.contains("empty --data-dir"),
            "{msg}"
        );
        std::fs::remove_file(data.join(FORMAT_FILE)).unwrap();
        let msg = refused(config(&data, Formation::Init, &[])).await;
        assert!(msg.contains("before data formats were numbered"), "{msg}");
        assert!(
            contents(&data) == before,
            "a refused start changed the directory"
        );

        // Formats 6 and 7, which this build reads as they are (6 packed blobs of up
        // to 256 KiB, 7 of up to 4 MiB; 8 added a node request): opened and stamped
        // with this one; the node comes back with what it had.
        for older in [6, 7] {
            std::fs::write(
                data.join(FORMAT_FILE),
                format!("gpumesh data format {older}\n"),
            )
            .unwrap();
            let a = MeshNode::start(config(&data, Formation::Init, &[]))
                .await
                .unwrap();
            assert_eq!(client(&a).task(task).await.unwrap().id, task);
            stop(vec![a]).await;
            assert_eq!(
                std::fs::read_to_string(data.join(FORMAT_FILE)).unwrap(),
                stamp,
                "format {older}"
            );
        }

        // Its own format again: the node comes back with what it had.
        let a = MeshNode::start(config(&data, Formation::Init, &[]))
            .await
            .unwrap();
        assert_eq!(client(&a).task(task).await.unwrap().id, task);
        stop(vec![a]).await;
    })
    .await
    .expect("bounded");
}
