//! A node's identity: an ed25519 keypair kept in its data dir, so a restarted node
//! comes back as the same peer, and the raft id derived from it.

use std::path::Path;

use libp2p::identity::Keypair;
use libp2p::PeerId;

use crate::error::{NodeError, Result};

const KEY_FILE: &str = "node.key";

/// Loads the node's keypair from `data_dir`, creating one on first start.
pub fn load_or_create(data_dir: &Path) -> Result<Keypair> {
    let path = data_dir.join(KEY_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => Keypair::from_protobuf_encoding(&bytes).map_err(|e| {
            NodeError::Config(format!(
                "{} is not a gpumesh node key ({e}); move it away to start as a new node",
                path.display()
            ))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = Keypair::generate_ed25519();
            let bytes = key
                .to_protobuf_encoding()
                .map_err(|e| NodeError::Config(format!("cannot encode the node key: {e}")))?;
            write_private(&path, &bytes)?;
            Ok(key)
        }
        Err(e) => Err(NodeError::io(&path, e)),
    }
}

fn write_private(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut f = options.open(path).map_err(|e| NodeError::io(path, e))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| NodeError::io(path, e))
}

/// The raft id of a peer: the first 8 bytes of blake3 of its peer id. Derived, not
/// assigned, so every node computes the same id for a peer, and a frame's sender id
/// comes from the Noise-authenticated peer id rather than from the frame.
pub fn raft_id(peer: &PeerId) -> u64 {
    let hash = blake3::hash(&peer.to_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&hash.as_bytes()[..8]);
    u64::from_le_bytes(first).max(1)
}
