//! A closed mesh: real nodes on loopback behind a cluster key and an allow-list.
//! Outsiders fail to join with an error that says why, and the mesh goes on serving.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::time::Duration;

use common::{client, config, refused, seed, still_serves, stop, LIMIT};
use gpumesh::node::{identity, ClusterKey, Formation, MeshNode, PeerId};

/// How long an outsider keeps trying before it gives up.
const OUTSIDER_JOIN: Duration = Duration::from_secs(3);

/// Members as the node's API reports them.
async fn members(node: &MeshNode) -> usize {
    client(node).status().await.unwrap().members.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_nodes_holding_the_cluster_key_join_and_the_mesh_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let key = ClusterKey::generate();
    tokio::time::timeout(LIMIT, async {
        let mut c = config(&dir.path().join("a"), Formation::Init, &[]);
        c.cluster_key = Some(key);
        let a = MeshNode::start(c).await.unwrap();
        let mut c = config(&dir.path().join("b"), Formation::Join, &[seed(&a)]);
        c.cluster_key = Some(key);
        let b = MeshNode::start(c).await.unwrap();
        assert_eq!(members(&a).await, 2);

        // Without a key and without --open a node does not even try.
        let mut c = config(&dir.path().join("keyless"), Formation::Join, &[seed(&a)]);
        c.cluster_key = None;
        let msg = refused(c).await;
        assert!(msg.contains("--join TICKET"), "{msg}");

        // Another key, then an open node (no key at all): the Noise handshake fails
        // either way.
        for (name, outsider_key) in [
            ("other-key", Some(ClusterKey::generate())),
            ("no-key", None),
        ] {
            let mut c = config(&dir.path().join(name), Formation::Join, &[seed(&a)]);
            c.cluster_key = outsider_key;
            c.open = outsider_key.is_none();
            c.join_timeout = OUTSIDER_JOIN;
            let msg = refused(c).await;
            assert!(
                msg.contains("no mesh member answered") && msg.contains("cluster key"),
                "{name}: {msg}"
            );
            assert!(
                msg.contains(&a.listen_addrs[0].to_string()),
                "{name}: {msg}"
            );
        }

        assert_eq!(members(&a).await, 2, "no outsider became a member");
        assert_eq!(members(&b).await, 2);
        still_serves(&b, &a).await;
        stop(vec![a, b]).await;
    })
    .await
    .expect("bounded");
}

/// Makes the node identity in `dir` ahead of its first start, to list it.
fn peer_id_of(dir: &std::path::Path) -> PeerId {
    std::fs::create_dir_all(dir).unwrap();
    identity::load_or_create(dir).unwrap().public().to_peer_id()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_listed_peers_are_admitted_and_the_mesh_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let key = ClusterKey::generate();
    let (a_dir, b_dir) = (dir.path().join("a"), dir.path().join("b"));
    let (a_id, b_id) = (peer_id_of(&a_dir), peer_id_of(&b_dir));
    tokio::time::timeout(LIMIT, async {
        let mut c = config(&a_dir, Formation::Init, &[]);
        c.cluster_key = Some(key);
        c.allow_peers = vec![b_id];
        let a = MeshNode::start(c).await.unwrap();
        let mut c = config(&b_dir, Formation::Join, &[seed(&a)]);
        c.cluster_key = Some(key);
        c.allow_peers = vec![a_id];
        let b = MeshNode::start(c).await.unwrap();
        assert_eq!(members(&a).await, 2);

        // Holds the key but is not listed: `a` closes its connections as soon as
        // Noise has told it who is calling.
        let c_dir = dir.path().join("unlisted");
        let c_id = peer_id_of(&c_dir);
        let mut c = config(&c_dir, Formation::Join, &[seed(&a)]);
        c.cluster_key = Some(key);
        c.join_timeout = OUTSIDER_JOIN;
        let msg = refused(c).await;
        assert!(
            msg.contains("--allow-peer") && msg.contains(&c_id.to_string()),
            "names the setting and the peer id to add: {msg}"
        );

        // Lists only `b`, so it will not keep a connection to `a` itself.
        let mut c = config(&dir.path().join("picky"), Formation::Join, &[seed(&a)]);
        c.cluster_key = Some(key);
        c.allow_peers = vec![b_id];
        c.join_timeout = OUTSIDER_JOIN;
        let msg = refused(c).await;
        assert!(
            msg.contains(&format!("peer {a_id} is not in the allow list")),
            "{msg}"
        );

        assert_eq!(members(&a).await, 2, "no outsider became a member");
        still_serves(&a, &b).await;
        stop(vec![a, b]).await;
    })
    .await
    .expect("bounded");
}
