//! The bytes of the last blobs that this node stored or read whole for a reader
//! who will want them again (packed or in files of their own), kept in memory up to
//! a budget. An actor's state is the case: each
//! call stores the state it leaves (on its host and on the node that keeps the
//! second copy), and the next call reads it back on both to start from it; kept
//! here, that read (the file, then its hash checked) is not made again.
//!
//! Only bytes already checked against their id come in: stored by the store
//! (hashed by the writer, or checked), or read and checked by it. A blob leaves
//! when the store removes it, or when newer ones need the room (the oldest kept
//! goes first).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use gpumesh_protocol::BlobId;

/// What is kept at most, in bytes.
const RECENT_BYTES: u64 = 64 << 20;
/// A larger blob is not kept: it would push out everything else.
const RECENT_LARGEST: u64 = RECENT_BYTES / 4;

#[derive(Debug, Default)]
pub(super) struct Recent {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    blobs: HashMap<BlobId, Arc<[u8]>>,
    /// Ids in the order they came; one that left early may still be here (skipped
    /// when it comes up).
    order: VecDeque<BlobId>,
    bytes: u64,
}

impl Recent {
    /// Blob `id`'s bytes, if kept.
    pub(super) fn get(&self, id: &BlobId) -> Option<Arc<[u8]>> {
        self.lock().blobs.get(id).cloned()
    }

    /// Keeps `bytes`, which are blob `id`'s (checked by the caller), if small
    /// enough; the oldest kept go to make room.
    pub(super) fn keep(&self, id: BlobId, bytes: Arc<[u8]>) {
        let len = bytes.len() as u64;
        if len > RECENT_LARGEST {
            return;
        }
        let mut inner = self.lock();
        if inner.blobs.contains_key(&id) {
            return;
        }
        while inner.bytes + len > RECENT_BYTES {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            if let Some(gone) = inner.blobs.remove(&oldest) {
                inner.bytes -= gone.len() as u64;
            }
        }
        inner.blobs.insert(id, bytes);
        inner.order.push_back(id);
        inner.bytes += len;
    }

    /// Lets blob `id` go (removed from the store, or found damaged there).
    pub(super) fn forget(&self, id: &BlobId) {
        let mut inner = self.lock();
        if let Some(gone) = inner.blobs.remove(id) {
            inner.bytes -= gone.len() as u64;
            inner.order.retain(|o| o != id);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Nothing in here is left half-changed by a panic between statements that
        // matter: each step keeps `bytes` the sum of `blobs`.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn blob(len: u64, fill: u8) -> (BlobId, Arc<[u8]>) {
        let bytes = vec![fill; len as usize];
        (BlobId::of(&bytes), Arc::from(bytes))
    }

    #[test]
    fn the_oldest_go_first_to_stay_within_the_budget_and_a_forgotten_one_goes_at_once() {
        let recent = Recent::default();
        let blobs: Vec<_> = (0..5).map(|n| blob(RECENT_BYTES / 4, n)).collect();
        for (id, bytes) in &blobs[..4] {
            recent.keep(*id, bytes.clone());
        }
        assert!(blobs[..4].iter().all(|(id, _)| recent.get(id).is_some()));
        recent.keep(blobs[4].0, blobs[4].1.clone());
        assert!(recent.get(&blobs[0].0).is_none(), "the oldest made room");
        assert!(blobs[1..].iter().all(|(id, _)| recent.get(id).is_some()));
        assert_eq!(&*recent.get(&blobs[4].0).unwrap(), &*blobs[4].1);
        recent.forget(&blobs[2].0);
        assert!(recent.get(&blobs[2].0).is_none());
        // Its room is free: one more fits without pushing another out.
        let extra = blob(RECENT_BYTES / 4, 9);
        recent.keep(extra.0, extra.1);
        assert!([1, 3, 4].iter().all(|&i| recent.get(&blobs[i].0).is_some()));
        assert_eq!(recent.lock().bytes, RECENT_BYTES);
    }

    #[test]
    fn a_blob_over_the_largest_kept_is_not_kept() {
        let recent = Recent::default();
        let (id, bytes) = blob(RECENT_LARGEST + 4, 1);
        recent.keep(id, bytes);
        assert!(recent.get(&id).is_none());
        assert_eq!(recent.lock().bytes, 0);
    }
}
