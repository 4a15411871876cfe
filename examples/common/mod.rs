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

/// Little-endian bytes of `v`, as a blob holds an `array<f32>`.
#[allow(dead_code)] // not every example that includes this module uploads floats
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The regression examples' data: `y = x · true_w + noise` for `rows` rows of
/// `features` values uniform in [-1, 1), from a fixed seed. Returns (true_w, x, y).
#[allow(dead_code)] // used by the two regression examples
pub fn regression_data(rows: usize, features: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let true_w: Vec<f32> = (0..features).map(|j| j as f32 * 0.25 - 1.0).collect();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    };
    let x: Vec<f32> = (0..rows * features).map(|_| uniform()).collect();
    let y: Vec<f32> = x
        .chunks_exact(features)
        .map(|r| r.iter().zip(&true_w).map(|(a, b)| a * b).sum::<f32>() + 0.01 * uniform())
        .collect();
    (true_w, x, y)
}
