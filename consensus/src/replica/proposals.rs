//! Proposals: idempotent by request id, batched on the leader, forwarded to it from
//! a follower, and settled (applied, dropped, or of unknown outcome) by where the
//! leader said it appended them.

use super::*;

impl Actor {
    pub(super) fn on_propose(&mut self, entry: LogEntry, respond_to: Reply<Committed>) {
        let request_id = entry.request_id;
        if let Some(done) = self.state.get().outcome_of(&request_id) {
            let _ = respond_to.send(Ok(done));
            return;
        }
        if let Some(p) = self.pending.get_mut(&request_id) {
            p.waiters.push(respond_to);
            return;
        }
        let now = Instant::now();
        self.pending.insert(
            request_id,
            Pending {
                entry,
                waiters: vec![respond_to],
                placements: Vec::new(),
                unacked: 0,
                sent: false,
                batched: false,
                made: now,
                deadline: now + self.cfg.proposal_timeout,
                next_retry: now,
            },
        );
        self.place(request_id);
    }

    /// Gets a pending proposal into some leader's log: ours if we lead, else by
    /// forwarding. Without a known leader it waits for a later tick.
    pub(super) fn place(&mut self, request_id: RequestId) {
        let leading = self.is_leader();
        let leader = self.leader();
        let retry_after = self.cfg.tick_interval * self.cfg.election_tick as u32;
        let Some(p) = self.pending.get_mut(&request_id) else {
            return;
        };
        p.next_retry = Instant::now() + retry_after;
        if leading {
            if p.entry.command.is_membership_change() {
                let entry = p.entry.clone();
                match self.propose_conf_change(&entry) {
                    Ok(Some(at)) => self.record_placement(request_id, at),
                    // Another change is in flight: try again next tick.
                    Ok(None) => {}
                    Err(reason) => self.drop_pending(request_id, reason),
                }
            } else if !p.batched {
                p.batched = true;
                p.sent = true;
                self.batch.push((p.entry.clone(), Source::Local));
                *self.workload.entry(self.cfg.id).or_default() += 1;
            }
        } else if leader != 0 {
            p.sent = true;
            p.unacked += 1;
            let body = FrameBody::Forward(p.entry.clone());
            self.send_frame(leader, body);
        }
    }

    pub(super) fn record_placement(&mut self, request_id: RequestId, (index, term): (u64, u64)) {
        if index <= self.state.get().applied_index() {
            // Already applied here and it was not ours (ours would have resolved the
            // proposal): that placement lost.
            if let Some(p) = self.pending.get_mut(&request_id) {
                p.sent = true;
                p.placements.push((index, term));
            }
            self.unplace(request_id, index);
            return;
        }
        if let Some(p) = self.pending.get_mut(&request_id) {
            p.sent = true;
            if !p.placements.contains(&(index, term)) {
                p.placements.push((index, term));
                self.placed_at.entry(index).or_default().push(request_id);
            }
        }
    }

    pub(super) fn drop_pending(&mut self, request_id: RequestId, reason: String) {
        if let Some(p) = self.pending.remove(&request_id) {
            for w in p.waiters {
                let _ = w.send(Err(ConsensusError::ProposalDropped {
                    request_id,
                    reason: reason.clone(),
                }));
            }
        }
    }

    pub(super) fn resolve(&mut self, request_id: RequestId, committed: &Committed) {
        if let Some(p) = self.pending.remove(&request_id) {
            for w in p.waiters {
                let _ = w.send(Ok(committed.clone()));
            }
        }
    }

    /// The entry at `index` is not `request_id`'s: forget that placement, and if
    /// no other could still commit, the proposal certainly failed.
    pub(super) fn unplace(&mut self, request_id: RequestId, index: u64) {
        let Some(p) = self.pending.get_mut(&request_id) else {
            return;
        };
        p.placements.retain(|(i, _)| *i != index);
        if p.placements.is_empty() && p.unacked == 0 && !p.batched {
            self.drop_pending(
                request_id,
                format!("a different entry was committed at index {index} (leader changed)"),
            );
        }
    }

    /// Proposes a membership change as a Raft ConfChange carrying the log entry.
    /// `Ok(None)`: another change is pending; retry later.
    pub(super) fn propose_conf_change(
        &mut self,
        entry: &LogEntry,
    ) -> Result<Option<(u64, u64)>, String> {
        if self.raw.raft.has_pending_conf() {
            return Ok(None);
        }
        let (change_type, node_id) = match &entry.command {
            Command::NodeJoined { raft_id, .. } => (ConfChangeType::AddLearnerNode, *raft_id),
            Command::NodePromoted { raft_id } => (ConfChangeType::AddNode, *raft_id),
            Command::NodeLeft { raft_id } => (ConfChangeType::RemoveNode, *raft_id),
            other => return Err(format!("{} is not a membership change", other.kind())),
        };
        // No early verdict here: apply judges every change against the replicated
        // state, so the proposer gets a committed Outcome either way.
        let mut cc = ConfChange::default();
        cc.set_change_type(change_type);
        cc.node_id = node_id;
        cc.context = codec::to_bytes(entry).map_err(|e| e.to_string())?.into();
        let before = self.raw.raft.raft_log.last_index();
        self.raw
            .propose_conf_change(vec![], cc)
            .map_err(|e| e.to_string())?;
        let after = self.raw.raft.raft_log.last_index();
        if after == before {
            return Err("raft dropped the proposal".into());
        }
        Ok(Some((after, self.raw.raft.term)))
    }

    /// Proposes this round's normal proposals as one MsgPropose: one append, one
    /// broadcast, one fsync for all of them.
    pub(super) fn flush_batch(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.batch);
        let mut msg = RaftMessage::default();
        msg.set_msg_type(MessageType::MsgPropose);
        msg.from = self.cfg.id;
        let mut encoded = Vec::with_capacity(batch.len());
        for (entry, _) in &batch {
            match codec::to_bytes(entry) {
                Ok(data) => {
                    encoded.push(Entry {
                        data: data.into(),
                        ..Default::default()
                    });
                }
                Err(e) => encoded.push({
                    warn!(request_id = %entry.request_id, "cannot encode proposal: {e}");
                    Entry::default()
                }),
            }
        }
        msg.set_entries(encoded.into());
        let before = self.raw.raft.raft_log.last_index();
        let result = if self.is_leader() {
            self.raw.step(msg).map_err(|e| e.to_string())
        } else {
            Err("no longer the leader".to_string())
        };
        let after = self.raw.raft.raft_log.last_index();
        let term = self.raw.raft.term;
        let appended = result.is_ok() && after == before + batch.len() as u64;
        let leader = self.leader();
        for (i, (entry, source)) in batch.into_iter().enumerate() {
            let at = (before + 1 + i as u64, term);
            match source {
                Source::Local => {
                    if let Some(p) = self.pending.get_mut(&entry.request_id) {
                        p.batched = false;
                    }
                    if appended {
                        if entry.command.only_proposer_acts() {
                            self.quiet.push_back(at.0);
                        }
                        self.record_placement(entry.request_id, at);
                    }
                    // Otherwise it stays pending and is forwarded on a later tick.
                }
                Source::Forwarded(origin) => {
                    let body = if appended {
                        FrameBody::ForwardAccepted {
                            request_id: entry.request_id,
                            index: at.0,
                            term: at.1,
                        }
                    } else {
                        FrameBody::ForwardRefused {
                            request_id: entry.request_id,
                            leader,
                            reason: result
                                .clone()
                                .err()
                                .unwrap_or_else(|| "raft dropped the proposal".into()),
                        }
                    };
                    self.send_frame(origin, body);
                }
            }
        }
    }

    pub(super) fn on_forward(&mut self, from: u64, entry: LogEntry) {
        let request_id = entry.request_id;
        if entry.origin != from {
            warn!(
                raft_id = self.cfg.id,
                from,
                origin = entry.origin,
                "dropping forwarded proposal with a foreign origin"
            );
            return;
        }
        if !self.is_leader() {
            let leader = self.leader();
            self.send_frame(
                from,
                FrameBody::ForwardRefused {
                    request_id,
                    leader,
                    reason: "not the leader".into(),
                },
            );
            return;
        }
        if entry.command.is_membership_change() {
            let body = match self.propose_conf_change(&entry) {
                Ok(Some((index, term))) => FrameBody::ForwardAccepted {
                    request_id,
                    index,
                    term,
                },
                Ok(None) => FrameBody::ForwardRefused {
                    request_id,
                    leader: self.cfg.id,
                    reason: "another membership change is in progress".into(),
                },
                Err(reason) => FrameBody::ForwardRefused {
                    request_id,
                    leader: self.cfg.id,
                    reason,
                },
            };
            self.send_frame(from, body);
            return;
        }
        self.batch.push((entry, Source::Forwarded(from)));
        *self.workload.entry(from).or_default() += 1;
    }
}
