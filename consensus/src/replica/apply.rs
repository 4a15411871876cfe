//! Applying committed entries: commands to the state machine, membership changes to
//! raft-rs, and their outcomes back to whoever proposed them.

use super::*;
use crate::{MAX_CARRIED_RESULT, MAX_INLINE_RESULT};

impl Actor {
    pub(super) fn apply_entries(&mut self, entries: Vec<Entry>) {
        for entry in entries {
            let (index, term) = (entry.index, entry.term);
            if index <= self.state.get().applied_index() {
                continue;
            }
            match entry.get_entry_type() {
                EntryType::EntryNormal if entry.data.is_empty() => {
                    // A new leader's empty entry.
                    self.state.change(|s| s.skip(index, term));
                    self.settle(index, None);
                }
                EntryType::EntryNormal => match codec::from_bytes::<LogEntry>(&entry.data) {
                    Ok(le) => {
                        // Stored before the record names it, so whoever reads the
                        // record here finds the blob here.
                        if !self.keep_carried(index, &le.command) {
                            self.unkept.insert(index);
                        }
                        let applied = self.state.change(|s| s.apply(index, term, &le));
                        self.finish(index, term, le, applied);
                    }
                    Err(e) => {
                        // Every replica skips the same bytes alike: still deterministic.
                        error!(
                            raft_id = self.cfg.id,
                            index, "skipping undecodable entry: {e}"
                        );
                        self.state.change(|s| s.skip(index, term));
                        self.settle(index, None);
                    }
                },
                EntryType::EntryConfChange => self.apply_conf_change(&entry),
                EntryType::EntryConfChangeV2 => {
                    warn!(
                        raft_id = self.cfg.id,
                        index, "skipping unexpected ConfChangeV2"
                    );
                    self.state.change(|s| s.skip(index, term));
                    self.settle(index, None);
                }
            }
        }
    }

    /// Stores the result `command` carries that the record does not keep, if any
    /// (see [`CarriedStore`]); not yet synced. One whose bytes are not its blob's is
    /// left out (the record refuses it too). A failure is logged: the entry stays in
    /// the log, and the result is stored again before the log may lose it, and
    /// tried again meanwhile ([`Self::keep_unkept`]). False only for that failure.
    fn keep_carried(&self, index: u64, command: &Command) -> bool {
        let (Some(store), Some((blob, bytes))) = (&self.cfg.carried, command.carried()) else {
            return true;
        };
        if bytes.len() > MAX_CARRIED_RESULT || !blob.matches(bytes) {
            return true;
        }
        if let Err(e) = store.keep(blob, bytes) {
            warn!(raft_id = self.cfg.id, index, %blob, "cannot store a carried result: {e}");
            return false;
        }
        true
    }

    /// Tries again to store the carried results that could not be stored when
    /// applied (a full disk, since given room): until then this node cannot
    /// serve them, though its log keeps them. One gone from the log was stored
    /// before it went ([`Self::keep_carried_upto`]).
    pub(super) fn keep_unkept(&mut self) {
        let (Some(&last), Some(store)) = (self.unkept.last(), &self.cfg.carried) else {
            return;
        };
        let held: Vec<(u64, gpumesh_protocol::BlobId, Vec<u8>)> = self
            .raw
            .store()
            .held_entries(last)
            .filter(|e| self.unkept.contains(&e.index))
            .filter_map(|e| {
                let le = codec::from_bytes::<LogEntry>(&e.data).ok()?;
                let (blob, bytes) = le.command.carried()?;
                Some((e.index, blob, bytes.to_vec()))
            })
            .collect();
        let mut still = BTreeSet::new();
        for (index, blob, bytes) in held {
            // After one that still does not fit, the others wait for the next try.
            if still.is_empty() && store.keep(blob, &bytes).is_ok() {
                debug!(raft_id = self.cfg.id, index, %blob, "a carried result stored at last");
                continue;
            }
            still.insert(index);
        }
        self.unkept = still;
    }

    /// Stores every result carried by an entry up to `upto` still in the log, and
    /// syncs: called before a snapshot at `upto` is stored, after which a restart no
    /// longer replays those entries and the log may drop them.
    pub(super) fn keep_carried_upto(&self, upto: u64) -> Result<()> {
        let Some(store) = &self.cfg.carried else {
            return Ok(());
        };
        let mut kept = 0usize;
        for entry in self.raw.store().held_entries(upto) {
            if entry.get_entry_type() != EntryType::EntryNormal
                || entry.data.len() <= MAX_INLINE_RESULT
            {
                continue;
            }
            let Ok(le) = codec::from_bytes::<LogEntry>(&entry.data) else {
                continue;
            };
            if let Some((blob, bytes)) = le.command.carried() {
                if bytes.len() <= MAX_CARRIED_RESULT && blob.matches(bytes) {
                    store
                        .keep(blob, bytes)
                        .map_err(|e| carried_error(format!("storing {blob}: {e}")))?;
                    kept += 1;
                }
            }
        }
        if kept > 0 {
            store
                .sync()
                .map_err(|e| carried_error(format!("syncing: {e}")))?;
        }
        Ok(())
    }

    pub(super) fn apply_conf_change(&mut self, entry: &Entry) {
        let (index, term) = (entry.index, entry.term);
        let decoded = ConfChange::parse_from_bytes(&entry.data)
            .map_err(|e| e.to_string())
            .and_then(|cc| {
                codec::from_bytes::<LogEntry>(&cc.context)
                    .map(|le| (cc, le))
                    .map_err(|e| e.to_string())
            });
        let (cc, le) = match decoded {
            Ok(x) => x,
            Err(e) => {
                error!(
                    raft_id = self.cfg.id,
                    index, "skipping undecodable conf change: {e}"
                );
                self.state.change(|s| s.skip(index, term));
                self.settle(index, None);
                return;
            }
        };
        let decided = self.state.get().outcome_of(&le.request_id).is_some();
        // Bound first: the verdict borrows the published state, which `change` writes.
        let verdict = self.state.get().membership_verdict(&le.command);
        let applied = if decided {
            self.state.change(|s| s.apply(index, term, &le))
        } else {
            match verdict {
                Ok(()) => match self.raw.apply_conf_change(&cc) {
                    Ok(cs) => {
                        self.conf_state = cs;
                        self.state.change(|s| s.apply(index, term, &le))
                    }
                    Err(e) => self.state.change(|s| {
                        s.conclude(
                            index,
                            term,
                            &le,
                            Outcome::Rejected(format!("raft refused: {e}")),
                        )
                    }),
                },
                Err(outcome) => self.state.change(|s| s.conclude(index, term, &le, outcome)),
            }
        };
        info!(
            raft_id = self.cfg.id,
            index,
            change = le.command.kind(),
            node = cc.node_id,
            outcome = ?applied.committed.outcome,
            "membership change applied"
        );
        self.finish(index, term, le, applied);
    }

    pub(super) fn finish(&mut self, index: u64, term: u64, entry: LogEntry, applied: Applied) {
        let request_id = entry.request_id;
        if entry.origin == self.cfg.id {
            self.resolve(request_id, &applied.committed);
        }
        self.settle(index, Some(request_id));
        let _ = self.events.send(AppliedEvent::Entry {
            index,
            term,
            entry: Arc::new(entry),
            committed: applied.committed,
            duplicate: applied.duplicate,
        });
    }

    /// Index `index` is applied with `request_id` (if any): other proposals placed
    /// there lost their slot.
    pub(super) fn settle(&mut self, index: u64, request_id: Option<RequestId>) {
        if self.placed_at.is_empty() {
            return;
        }
        // Placements below are settled too (they may be skipped by a snapshot).
        let done: Vec<u64> = self.placed_at.range(..=index).map(|(i, _)| *i).collect();
        for i in done {
            for id in self.placed_at.remove(&i).unwrap_or_default() {
                if Some(id) != request_id || i != index {
                    self.unplace(id, i);
                }
            }
        }
    }
}

/// A carried result that could not be stored or synced before the log may drop it:
/// the replica stops rather than compact it away.
fn carried_error(reason: String) -> ConsensusError {
    ConsensusError::Storage {
        path: "the blob store".into(),
        reason: format!("results carried in the log not stored durably ({reason})"),
    }
}
