//! The Ready loop: ticks, frames from peers, and each Ready handled in the order
//! raft-rs documents (send the leader's messages, persist, send what waited on
//! the persist, apply, then the light Ready's messages and applies),
//! on the replica's own task (see [`blocking`] for what leaves it).

use super::*;

impl Actor {
    /// Handles every pending Ready (see the module docs for the order).
    pub(super) fn drive(&mut self) -> Result<()> {
        loop {
            // Before each Ready: a read answered in the last one may let the next
            // batch go out at once.
            self.issue_reads();
            self.tell_commit();
            if !self.raw.has_ready() {
                break;
            }
            let mut ready = self.raw.ready();
            tracing::trace!(
                raft_id = self.cfg.id,
                number = ready.number(),
                entries = ?ready.entries().first().map(|e| (e.index, ready.entries().len())),
                msgs = ready.messages().len(),
                persisted_msgs = ready.persisted_messages().len(),
                committed = ready.committed_entries().len(),
                "ready"
            );
            if !ready.messages().is_empty() {
                self.send_raft(ready.take_messages());
            }
            let snapshot = (!ready.snapshot().is_empty()).then(|| ready.snapshot().clone());
            if let Some(s) = &snapshot {
                // It replaces the log: what the log carried becomes blobs first.
                blocking(|| self.keep_carried_upto(s.get_metadata().index))?;
            }
            if snapshot.is_some() || !ready.entries().is_empty() || ready.hs().is_some() {
                let bytes: usize = ready.entries().iter().map(|e| e.data.len()).sum();
                let store = self.raw.mut_store();
                let mut persist = || store.persist(snapshot.as_ref(), ready.entries(), ready.hs());
                let many = ready.entries().len() > INLINE_PERSIST_ENTRIES;
                if snapshot.is_some() || many || bytes > INLINE_PERSIST_BYTES {
                    blocking(persist)?;
                } else {
                    persist()?;
                }
            }
            if let Some(snapshot) = snapshot {
                blocking(|| self.restore(&snapshot))?;
            }
            // A follower's answer to the append just written goes before the applies:
            // the leader's commit waits on it, and nothing in it waits on them.
            if !ready.persisted_messages().is_empty() {
                self.send_raft(ready.take_persisted_messages());
            }
            self.on_read_states(ready.take_read_states());
            self.apply_entries(ready.take_committed_entries());
            let mut light = self.raw.advance(ready);
            if let Some(commit) = light.commit_index() {
                self.raw.mut_store().set_commit(commit);
            }
            self.send_raft(light.take_messages());
            self.apply_entries(light.take_committed_entries());
            self.raw.advance_apply();
        }
        self.serve_reads();
        self.maybe_snapshot()?;
        self.publish_status();
        Ok(())
    }

    /// Leader-side: once the commit index moves, tells the followers (an append
    /// carrying it, as raft-rs would) unless every newly committed entry is one of
    /// this leader's own that only it acts on. Skipped, the commit reaches them
    /// with the next append or heartbeat, and a lone actor call does not wake both
    /// followers to apply it just as its answer goes out. A linearizable read on a
    /// follower is unaffected: the leader's heartbeat round for it carries the
    /// commit index.
    pub(super) fn tell_commit(&mut self) {
        if !self.is_leader() {
            self.told_commit = 0;
            self.quiet.clear();
            return;
        }
        let committed = self.raw.raft.raft_log.committed;
        if committed <= self.told_commit {
            return;
        }
        // Right after an election told_commit is 0, and the new term's first
        // entry is never quiet: followers are told.
        let tell = followers_act_on(self.told_commit, committed, &mut self.quiet);
        self.told_commit = committed;
        if tell {
            self.raw.raft.bcast_append();
        }
    }

    pub(super) fn send_raft(&mut self, msgs: Vec<RaftMessage>) {
        for msg in msgs {
            let to = msg.to;
            let is_snapshot = msg.get_msg_type() == MessageType::MsgSnapshot;
            let delivered = match encode_raft(&msg) {
                Ok(bytes) => self.send_frame(to, FrameBody::Raft(bytes)),
                Err(e) => {
                    error!(raft_id = self.cfg.id, to, "cannot encode raft message: {e}");
                    false
                }
            };
            if !delivered {
                self.raw.report_unreachable(to);
            }
            if is_snapshot {
                // The transport gives no receipt: report at once. If the snapshot is
                // lost, the follower rejects the next append and Raft sends it again.
                let status = if delivered {
                    raft::SnapshotStatus::Finish
                } else {
                    raft::SnapshotStatus::Failure
                };
                self.raw.report_snapshot(to, status);
            }
        }
    }

    /// Sends a frame; false if the transport says the peer is unreachable.
    pub(super) fn send_frame(&self, to: u64, body: FrameBody) -> bool {
        let frame = Frame {
            cluster: self.cluster,
            from: self.cfg.id,
            body,
        };
        match frame.encode() {
            Ok(bytes) => self.transport.send(to, bytes).is_ok(),
            Err(e) => {
                error!(raft_id = self.cfg.id, to, "cannot encode frame: {e}");
                false
            }
        }
    }

    pub(super) fn on_frame(&mut self, from: u64, bytes: &[u8]) {
        let frame = match Frame::decode(bytes) {
            Ok(f) => f,
            Err(e) => {
                warn!(raft_id = self.cfg.id, from, "dropping malformed frame: {e}");
                return;
            }
        };
        if frame.cluster != self.cluster {
            warn!(
                raft_id = self.cfg.id,
                from,
                theirs = %frame.cluster,
                ours = %self.cluster,
                "dropping frame from another cluster"
            );
            return;
        }
        if frame.from != from {
            warn!(
                raft_id = self.cfg.id,
                from,
                claimed = frame.from,
                "dropping frame whose sender does not match the transport's"
            );
            return;
        }
        match frame.body {
            FrameBody::Raft(bytes) => self.on_raft_message(from, &bytes),
            FrameBody::Forward(entry) => self.on_forward(from, entry),
            FrameBody::ForwardAccepted {
                request_id,
                index,
                term,
            } => {
                if let Some(p) = self.pending.get_mut(&request_id) {
                    p.unacked = p.unacked.saturating_sub(1);
                    self.record_placement(request_id, (index, term));
                }
            }
            FrameBody::ForwardRefused {
                request_id,
                leader,
                reason,
            } => {
                debug!(raft_id = self.cfg.id, %request_id, leader, "forward refused: {reason}");
                if let Some(p) = self.pending.get_mut(&request_id) {
                    p.unacked = p.unacked.saturating_sub(1);
                    // Retry at the next tick, when the leader may be known.
                    p.next_retry = Instant::now();
                }
            }
        }
    }

    pub(super) fn on_raft_message(&mut self, from: u64, bytes: &[u8]) {
        let msg = match decode_raft(bytes) {
            Ok(m) => m,
            Err(e) => {
                warn!(
                    raft_id = self.cfg.id,
                    from, "dropping malformed raft message: {e}"
                );
                return;
            }
        };
        if msg.from != from || msg.to != self.cfg.id {
            warn!(
                raft_id = self.cfg.id,
                from,
                msg_from = msg.from,
                msg_to = msg.to,
                "dropping misaddressed raft message"
            );
            return;
        }
        if raft::raw_node::is_local_msg(msg.get_msg_type()) {
            warn!(
                raft_id = self.cfg.id,
                from, "dropping local-only raft message type"
            );
            return;
        }
        if msg.get_msg_type() == MessageType::MsgSnapshot {
            // Check the state inside before raft-rs adopts it (a snapshot we cannot
            // restore must not replace our log), decoding it off this task (10,000
            // finished tasks take tens of milliseconds): it is stepped when that is
            // done, and the state decoded is the one restored.
            let myself = self.myself.clone();
            let decode = move || {
                let state = StateMachine::from_bytes(&msg.get_snapshot().data);
                if let Some(inbox) = myself.upgrade() {
                    let _ = inbox.blocking_send(Msg::SnapshotChecked {
                        from,
                        msg: Box::new(msg),
                        state,
                    });
                }
            };
            drop(tokio::task::spawn_blocking(decode));
            return;
        }
        self.step(from, msg);
    }

    /// A snapshot whose state was decoded off the task: stepped if it decoded.
    pub(super) fn on_snapshot_checked(
        &mut self,
        from: u64,
        msg: raft::eraftpb::Message,
        state: Result<StateMachine>,
    ) {
        match state {
            Ok(state) => {
                let meta = msg.get_snapshot().get_metadata();
                self.received = Some((meta.index, meta.term, state));
                self.step(from, msg);
            }
            Err(e) => warn!(
                raft_id = self.cfg.id,
                from, "dropping snapshot with bad state: {e}"
            ),
        }
    }

    fn step(&mut self, from: u64, msg: raft::eraftpb::Message) {
        tracing::trace!(
            raft_id = self.cfg.id,
            from,
            kind = ?msg.get_msg_type(),
            index = msg.index,
            entries = ?msg.entries.iter().map(|e| (e.index, e.term)).collect::<Vec<_>>(),
            last = self.raw.raft.raft_log.last_index(),
            "step"
        );
        if let Err(e) = self.raw.step(msg) {
            debug!(raft_id = self.cfg.id, from, "raft ignored message: {e}");
        }
    }

    pub(super) fn on_tick(&mut self) {
        self.raw.tick();
        self.ticks += 1;
        let now = Instant::now();

        self.leader_changed();

        // Proposals: answer the expired, retry the unplaced. One never sent while
        // this replica has known no leader for longer than elections take (cut off
        // from the majority, or the majority gone) is answered NoLeader once it has
        // waited an election's length itself, not its whole deadline: its caller
        // learns in about a second, not ten, that nothing was recorded.
        let election = self.cfg.tick_interval * self.cfg.election_tick as u32;
        let given_up = self
            .leaderless_since
            .is_some_and(|since| now.duration_since(since) >= election * LEADERLESS_ELECTIONS);
        let mut expired = Vec::new();
        let mut retry = Vec::new();
        for (id, p) in &self.pending {
            let abandoned = given_up && !p.sent && now.duration_since(p.made) >= election;
            if now >= p.deadline || abandoned {
                expired.push(*id);
            } else if p.placements.is_empty() && !p.batched && now >= p.next_retry {
                retry.push(*id);
            }
        }
        for id in expired {
            if let Some(p) = self.pending.remove(&id) {
                let err = || {
                    if p.sent {
                        ConsensusError::OutcomeUnknown {
                            request_id: id,
                            reason: "no commit seen before the deadline".into(),
                        }
                    } else {
                        ConsensusError::NoLeader
                    }
                };
                for w in p.waiters {
                    let _ = w.send(Err(err()));
                }
            }
        }
        for id in retry {
            self.place(id);
        }

        self.expire_reads(now);
        if self.ticks.is_multiple_of(UNKEPT_RETRY_TICKS) {
            self.keep_unkept();
        }

        if self.cfg.auto_promote && self.is_leader() && self.ticks.is_multiple_of(5) {
            self.maybe_promote();
        }
        if now.duration_since(self.workload_since) >= FOLLOW_WINDOW {
            self.maybe_follow_workload();
            self.workload.clear();
            self.workload_since = now;
        }
    }

    /// Whether the leader changed since last seen; if so, proposals forwarded to
    /// the old one (now lost) and those waiting for a leader go to the new one at
    /// once rather than after the retry interval.
    pub(super) fn leader_changed(&mut self) -> bool {
        let leader = self.leader();
        if leader == self.last_leader {
            return false;
        }
        self.last_leader = leader;
        self.workload.clear();
        if leader == 0 {
            self.leaderless_since = Some(Instant::now());
            return false;
        }
        self.leaderless_since = None;
        let unplaced: Vec<RequestId> = self
            .pending
            .iter()
            .filter(|(_, p)| p.placements.is_empty() && !p.batched)
            .map(|(id, _)| *id)
            .collect();
        for id in unplaced {
            self.place(id);
        }
        true
    }

    /// Leader-side: hands leadership to the voter that proposed most of what this
    /// leader appended over the last window (see [`FOLLOW_MIN`]).
    pub(super) fn maybe_follow_workload(&mut self) {
        if !self.cfg.follow_workload
            || !self.is_leader()
            || self.raw.raft.lead_transferee.is_some()
            || self.raw.raft.has_pending_conf()
            || self
                .followed_at
                .is_some_and(|at| at.elapsed() < FOLLOW_COOLDOWN)
        {
            return;
        }
        let total: u64 = self.workload.values().sum();
        let Some((&to, &theirs)) = self
            .workload
            .iter()
            .filter(|(id, _)| **id != self.cfg.id)
            .max_by_key(|(_, n)| **n)
        else {
            return;
        };
        if theirs < FOLLOW_MIN || theirs * 4 < total * 3 {
            return;
        }
        let last = self.raw.raft.raft_log.last_index();
        let voter = self.raw.raft.prs().conf().voters().contains(to);
        // Nearly caught up: raft-rs holds new proposals back during the handover
        // and sends the rest of the log first.
        let caught_up = self
            .raw
            .raft
            .prs()
            .get(to)
            .is_some_and(|p| p.matched + FOLLOW_LAG >= last);
        if !voter || !caught_up {
            return;
        }
        info!(
            raft_id = self.cfg.id,
            to,
            theirs,
            of = total,
            "handing leadership to the replica that proposes most"
        );
        self.followed_at = Some(Instant::now());
        self.raw.transfer_leader(to);
    }

    pub(super) fn on_peer_unreachable(&mut self, id: u64) {
        if id == self.cfg.id {
            return;
        }
        self.raw.report_unreachable(id);
        let raft = &mut self.raw.raft;
        if raft.state == StateRole::Follower && raft.leader_id == id {
            let stagger = 1 + (self.cfg.id % 3) as usize;
            let elapsed = raft
                .randomized_election_timeout()
                .saturating_sub(stagger)
                .max(raft.election_timeout());
            if elapsed > raft.election_elapsed {
                tracing::info!(
                    leader = id,
                    "lost the connection to the leader; campaigning without waiting out its lease"
                );
                raft.election_elapsed = elapsed;
            }
        }
    }

    /// Promotes one caught-up learner while voters are below the cap.
    pub(super) fn maybe_promote(&mut self) {
        let state = self.state.get();
        if self.raw.raft.has_pending_conf()
            || state.voter_count() >= state.settings().max_voters as usize
        {
            return;
        }
        let last = self.raw.raft.raft_log.last_index();
        let learner = state.members().values().find(|m| {
            m.role == crate::state::Role::Learner
                && self
                    .raw
                    .raft
                    .prs()
                    .get(m.raft_id)
                    .is_some_and(|p| p.matched + 100 >= last)
        });
        let learner = learner.map(|m| m.raft_id);
        drop(state);
        let Some(learner) = learner else {
            return;
        };
        let entry = LogEntry {
            origin: self.cfg.id,
            request_id: self.ids.next_id(),
            command: Command::NodePromoted { raft_id: learner },
        };
        match self.propose_conf_change(&entry) {
            Ok(Some(_)) => info!(raft_id = self.cfg.id, learner, "promoting learner"),
            Ok(None) => {}
            Err(e) => debug!(raft_id = self.cfg.id, "not promoting: {e}"),
        }
    }
}

/// Whether any entry committed past `told` up to `committed` is one followers act
/// on: not in `quiet`, the ascending indices of entries only the leader acts on.
/// Drops from `quiet` the indices up to `committed`.
fn followers_act_on(told: u64, committed: u64, quiet: &mut VecDeque<u64>) -> bool {
    let mut skipped = 0;
    while let Some(&i) = quiet.front() {
        if i > committed {
            break;
        }
        quiet.pop_front();
        if i > told {
            skipped += 1;
        }
    }
    skipped < committed.saturating_sub(told)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn followers_are_told_of_a_commit_unless_every_new_entry_is_quiet() {
        let mut quiet = VecDeque::from([5, 6, 8]);
        // 5 and 6: both quiet.
        assert!(!followers_act_on(4, 6, &mut quiet));
        assert_eq!(quiet, [8]);
        // 7 is not quiet, 8 is: told.
        assert!(followers_act_on(6, 8, &mut quiet));
        assert!(quiet.is_empty());
        // Nothing quiet: told.
        assert!(followers_act_on(8, 9, &mut quiet));
        // A quiet index not yet committed stays; an old one (at or below what was
        // told, say from before a leader change) does not count.
        let mut quiet = VecDeque::from([3, 11, 12]);
        assert!(!followers_act_on(10, 11, &mut quiet));
        assert_eq!(quiet, [12]);
        let mut quiet = VecDeque::from([3, 11]);
        assert!(followers_act_on(2, 4, &mut quiet));
        assert_eq!(quiet, [11]);
    }
}
