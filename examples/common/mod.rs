//! A small loopback mesh for the examples: real nodes in this process.

use std::path::PathBuf;

use gpumesh::node::{Formation, MeshNode, Multiaddr, NodeConfig};

pub struct LocalMesh {
    pub nodes: Vec<MeshNode>,
    root: PathBuf,
}

impl LocalMesh {
    /// Starts `n` nodes on 127.0.0.1: the first forms the mesh, the rest join it.
    pub async fn start(name: &str, n: usize) -> anyhow::Result<LocalMesh> {
        tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "warn,wgpu_hal=error,wgpu_core=error,naga=error".into()),
            )
            .try_init()
            .ok();
        let root = std::env::temp_dir().join(format!("gpumesh-{name}-{}", std::process::id()));
        let config = |i: usize, formation, peers: Vec<Multiaddr>, key| {
            let mut c = NodeConfig::new(root.join(format!("node-{i}")));
            c.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().expect("multiaddr")];
            c.api = "127.0.0.1:0".parse().expect("socket address");
            c.mdns = false;
            c.formation = formation;
            c.peers = peers;
            // The first node makes the mesh's cluster key; the others join with it.
            c.cluster_key = key;
            c
        };
        let first = MeshNode::start(config(0, Formation::Init, vec![], None)).await?;
        let key = first.cluster_key;
        let seed: Multiaddr = format!("{}/p2p/{}", first.listen_addrs[0], first.peer_id).parse()?;
        let mut nodes = vec![first];
        for i in 1..n {
            nodes.push(MeshNode::start(config(i, Formation::Join, vec![seed.clone()], key)).await?);
        }
        Ok(LocalMesh { nodes, root })
    }

    pub fn client(&self, i: usize) -> gpumesh::Client {
        gpumesh::Client::new(self.nodes[i].api_addr.to_string())
    }

    pub async fn stop(self) {
        // Joiners first: a joiner left running would keep dialling its seed.
        for n in self.nodes.into_iter().rev() {
            n.stop().await;
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
