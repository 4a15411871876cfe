//! The id that names one mesh: stored at init and carried by every frame, so two
//! meshes never mix records even if their transports meet.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Names one mesh. Stored in the storage at init and carried by every frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ClusterId(pub u64);

impl ClusterId {
    /// A cluster id derived from arbitrary bytes (e.g. the cluster key), via blake3.
    pub fn derive(seed: &[u8]) -> Self {
        let hash = gpumesh_protocol::BlobId::of(seed).0;
        let mut first = [0u8; 8];
        first.copy_from_slice(&hash[..8]);
        Self(u64::from_le_bytes(first))
    }
}

impl fmt::Display for ClusterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}
