//! An actor's next state made where its second copy is kept: the old state (kept
//! there) with the changes of one call written over it, stored only when it is
//! byte for byte the state the host has (its blob id is the hash of its bytes).

use gpumesh_protocol::ShardChanges;

use super::BlobStore;
use crate::wire::NextState;

/// Makes and stores each buffer's `next` blob from its `base` (stored here, or
/// zeros) and `changes`; refuses, storing nothing more, at the first buffer whose
/// result is not its `next`.
pub(super) fn keep(
    store: &BlobStore,
    changes: &ShardChanges,
    buffers: &[NextState],
) -> Result<(), String> {
    for b in buffers {
        if store.has(&b.next) {
            continue;
        }
        let mut bytes = match b.base {
            Some(base) => store
                .get_shared(&base)
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("the base state {base} is not stored here"))?
                .to_vec(),
            None => vec![0; usize::try_from(b.size).map_err(|e| e.to_string())?],
        };
        if bytes.len() as u64 != b.size {
            return Err(format!(
                "state binding {}: the base is {} bytes, the buffer {}",
                b.binding,
                bytes.len(),
                b.size
            ));
        }
        if let Some(c) = changes.0.get(&b.binding) {
            if c.size != b.size {
                return Err(format!(
                    "state binding {}: the changes are for {} bytes, the buffer is {}",
                    b.binding, c.size, b.size
                ));
            }
            c.apply_to(&mut bytes);
        }
        if !b.next.matches(&bytes) {
            return Err(format!(
                "state binding {}: the state made from the changes is not {} (the host's); \
                 refusing to keep it",
                b.binding, b.next
            ));
        }
        // Checked just above.
        store
            .put_hashed(b.next, &bytes)
            .map_err(|e| e.to_string())?;
        // The next call's changes are made on it.
        store.remember(b.next, bytes.into());
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::BTreeMap;

    use gpumesh_protocol::changes::{Base, BufferChanges};
    use gpumesh_protocol::BlobId;

    use super::*;

    fn store() -> (tempfile::TempDir, BlobStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path(), 1 << 20).unwrap();
        (dir, store)
    }

    /// `before` → `after` as a call would report it at `binding`.
    fn call(binding: u32, before: &[u8], after: &[u8]) -> ShardChanges {
        ShardChanges(BTreeMap::from([(
            binding,
            BufferChanges::diff(Base::Bytes(before), after),
        )]))
    }

    #[test]
    fn the_next_state_is_the_base_with_the_changes_written_over_it() {
        let (_dir, store) = store();
        let before: Vec<u8> = (0..64u8).collect();
        let mut after = before.clone();
        after[8..12].copy_from_slice(&[9, 9, 9, 9]);
        after[60..64].copy_from_slice(&[1, 2, 3, 4]);
        let base = store.put(&before).unwrap();
        let next = BlobId::of(&after);
        let buffers = [NextState {
            binding: 2,
            size: 64,
            base: Some(base),
            next,
        }];
        keep(&store, &call(2, &before, &after), &buffers).unwrap();
        assert_eq!(store.get(&next).unwrap().unwrap(), after);
        // Again: already kept, nothing to do.
        keep(&store, &call(2, &before, &after), &buffers).unwrap();
    }

    #[test]
    fn a_buffer_never_written_starts_as_zeros() {
        let (_dir, store) = store();
        let zeros = vec![0u8; 32];
        let mut after = zeros.clone();
        after[0] = 7;
        let next = BlobId::of(&after);
        let buffers = [NextState {
            binding: 0,
            size: 32,
            base: None,
            next,
        }];
        keep(&store, &call(0, &zeros, &after), &buffers).unwrap();
        assert_eq!(store.get(&next).unwrap().unwrap(), after);
    }

    #[test]
    fn a_result_that_is_not_the_hosts_state_is_refused_and_not_stored() {
        let (_dir, store) = store();
        let before = vec![1u8; 16];
        let base = store.put(&before).unwrap();
        let mut after = before.clone();
        after[4] = 2;
        // The host claims a different result than base + changes gives.
        let mut claimed = after.clone();
        claimed[12] = 3;
        let next = BlobId::of(&claimed);
        let buffers = [NextState {
            binding: 0,
            size: 16,
            base: Some(base),
            next,
        }];
        let e = keep(&store, &call(0, &before, &after), &buffers).unwrap_err();
        assert!(e.contains("refusing"), "{e}");
        assert!(!store.has(&next));
    }

    #[test]
    fn a_missing_base_or_a_size_that_disagrees_is_refused() {
        let (_dir, store) = store();
        let before = vec![0u8; 16];
        let after = vec![5u8; 16];
        let missing = BlobId::of(b"never stored");
        let next = BlobId::of(&after);
        let e = keep(
            &store,
            &call(0, &before, &after),
            &[NextState {
                binding: 0,
                size: 16,
                base: Some(missing),
                next,
            }],
        )
        .unwrap_err();
        assert!(e.contains("not stored here"), "{e}");
        let e = keep(
            &store,
            &call(0, &before, &after),
            &[NextState {
                binding: 0,
                size: 32,
                base: None,
                next,
            }],
        )
        .unwrap_err();
        assert!(e.contains("the changes are for 16 bytes"), "{e}");
        assert!(!store.has(&next));
    }
}
