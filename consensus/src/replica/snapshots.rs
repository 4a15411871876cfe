//! Snapshots: restoring one received from the leader, and taking one when the log
//! has grown past the compaction threshold.

use super::*;
use crate::Compaction;

impl Actor {
    pub(super) fn restore(&mut self, snapshot: &Snapshot) -> Result<()> {
        let meta = snapshot.get_metadata();
        // Decoded off the task when it was received, unless it is not that one.
        let (state, decoded_on_receipt) = match self.received.take() {
            Some((index, term, state)) if (index, term) == (meta.index, meta.term) => (state, true),
            _ => (StateMachine::from_bytes(&snapshot.data)?, false),
        };
        self.state.replace(state);
        self.conf_state = meta.get_conf_state().clone();
        info!(
            raft_id = self.cfg.id,
            index = meta.index,
            term = meta.term,
            decoded_on_receipt,
            "restored state from a snapshot"
        );
        let _ = self.events.send(AppliedEvent::Restored {
            index: meta.index,
            term: meta.term,
        });
        // Proposals placed at or below the snapshot: the state says what happened.
        let covered: Vec<u64> = self
            .placed_at
            .range(..=meta.index)
            .map(|(i, _)| *i)
            .collect();
        for index in covered {
            for request_id in self.placed_at.remove(&index).unwrap_or_default() {
                let outcome = self.state.get().outcome_of(&request_id);
                match outcome {
                    Some(done) => self.resolve(request_id, &done),
                    None => self.unplace(request_id, index),
                }
            }
        }
        // Our own proposals may also be inside without a known placement.
        let inside: Vec<(RequestId, Committed)> = self
            .pending
            .keys()
            .filter_map(|id| self.state.get().outcome_of(id).map(|c| (*id, c)))
            .collect();
        for (id, done) in inside {
            self.resolve(id, &done);
        }
        Ok(())
    }

    pub(super) fn maybe_snapshot(&mut self) -> Result<()> {
        if self.compacting.is_some() {
            // One at a time; a request from Raft waits for the one in flight.
            return Ok(());
        }
        if self
            .snapshot_retry_at
            .is_some_and(|at| time::Instant::now() < at)
        {
            // The last could not be written: the log grows until the next try.
            return Ok(());
        }
        let applied = self.state.get().applied_index();
        let snap_index = self.raw.store().snapshot_metadata().index;
        let requested = self.raw.store().take_snapshot_request();
        let since = applied.saturating_sub(snap_index);
        // By bytes only once past the entries kept behind a snapshot, which a
        // compaction leaves in memory.
        let due = since >= self.cfg.staggered(self.cfg.snapshot_interval)
            || (since > self.cfg.log_retain
                && self.raw.store().log_bytes() >= self.cfg.staggered(self.cfg.snapshot_bytes));
        if since == 0 || !(requested || due) {
            return Ok(());
        }
        blocking(|| self.take_snapshot(applied))
    }

    /// Starts storing the state applied up to `applied` as a snapshot: a copy of
    /// the record (a few ms: it shares every task and actor) is encoded, and the
    /// files written, off this task; [`Self::snapshot_stored`] compacts the log behind it
    /// once they are.
    fn take_snapshot(&mut self, applied: u64) -> Result<()> {
        let began = std::time::Instant::now();
        if let Err(e) = self.keep_carried_upto(applied) {
            // The entries stay in the log, which keeps their results, until the
            // next try (a full disk: once there is room again).
            self.snapshot_not_written(e);
            return Ok(());
        }
        let state = self.state.get().for_encoding();
        let mut meta = SnapshotMetadata {
            index: applied,
            term: state.applied_term(),
            ..Default::default()
        };
        meta.set_conf_state(self.conf_state.clone());
        let compact_to = self.raw.store().keep_from(
            (applied + 1).saturating_sub(self.cfg.log_retain),
            applied,
            self.cfg.log_retain_bytes,
        );
        let encode = move || state.to_bytes();
        self.compacting = self
            .raw
            .mut_store()
            .begin_compaction(meta, encode, compact_to)?;
        debug!(
            raft_id = self.cfg.id,
            index = applied,
            ms = began.elapsed().as_secs_f64() * 1e3,
            "snapshot begun"
        );
        Ok(())
    }

    /// The snapshot's file is written: the store names it and the log behind it is
    /// compacted (its next generation started).
    pub(super) fn snapshot_stored(&mut self) -> Result<()> {
        self.compacting = None;
        let began = std::time::Instant::now();
        match blocking(|| self.raw.mut_store().finish_compaction())? {
            Compaction::Done => {
                self.snapshot_failures = 0;
                self.snapshot_retry_at = None;
                debug!(
                    raft_id = self.cfg.id,
                    snapshot = self.raw.store().snapshot_metadata().index,
                    ms = began.elapsed().as_secs_f64() * 1e3,
                    "snapshot stored, log compacted"
                );
            }
            Compaction::NotWritten(e) => self.snapshot_not_written(e),
        }
        Ok(())
    }

    /// A snapshot could not be written (`e`): the replica goes on with its log as
    /// it was (its appends are small next to a snapshot, and may still fit); the
    /// next snapshot waits, longer each time, up to a minute.
    fn snapshot_not_written(&mut self, e: impl std::fmt::Display) {
        self.snapshot_failures += 1;
        self.snapshot_failures_total += 1;
        let wait = SNAPSHOT_RETRY * 2u32.pow(self.snapshot_failures.min(6) - 1);
        let wait = wait.min(SNAPSHOT_RETRY_MAX);
        self.snapshot_retry_at = Some(time::Instant::now() + wait);
        warn!(
            raft_id = self.cfg.id,
            failures = self.snapshot_failures,
            retry_in_s = wait.as_secs_f64(),
            "a snapshot could not be written, the log is kept whole until the next try: {e}"
        );
    }
}

/// The wait before a snapshot is tried again after one could not be written,
/// doubled with each failure in a row up to [`SNAPSHOT_RETRY_MAX`].
const SNAPSHOT_RETRY: Duration = Duration::from_secs(1);
const SNAPSHOT_RETRY_MAX: Duration = Duration::from_secs(60);
