//! Where a replica puts the results that ride in log entries but not in the record
//! (between [`crate::MAX_INLINE_RESULT`] and [`crate::MAX_CARRIED_RESULT`] bytes).
//!
//! Such a result is durable on a quorum once its entry commits: it is in their
//! logs. Each replica stores it as a blob when applying the entry (so the node can
//! serve it at once) without waiting for a sync, and before anything could drop
//! the entry from its log — a snapshot taken here, which a restart replays from,
//! or one received from the leader, which replaces the log — it stores every
//! carried result up to the snapshot's index again (a no-op for those stored) and
//! syncs. So the bytes are always in a synced log or a synced blob store.

use gpumesh_protocol::BlobId;

/// A node's blob store, as the replica needs it for carried results.
pub trait CarriedStore: Send + Sync + std::fmt::Debug {
    /// Stores `bytes` (which hash to `blob`) as blob `blob`, found at once; it need
    /// not be durable before [`CarriedStore::sync`]. Storing a blob already held
    /// does nothing.
    fn keep(&self, blob: BlobId, bytes: &[u8]) -> Result<(), String>;

    /// Makes every blob kept so far durable.
    fn sync(&self) -> Result<(), String>;
}
