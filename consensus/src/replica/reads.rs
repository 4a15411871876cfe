//! Linearizable reads through ReadIndex, batched as in etcd: one request in flight
//! covers every read that arrived before it was sent.

use super::*;

impl Actor {
    /// Sends a ReadIndex request covering every waiting read, when one is due: none
    /// in flight, the leader changed since the last one, or it went unanswered
    /// for a few heartbeats (raft-rs drops requests silently, see the module docs).
    pub(super) fn issue_reads(&mut self) {
        let Some(&newest) = self.reads.keys().next_back() else {
            return;
        };
        let leader = self.leader();
        // Without a leader a follower drops the request, and a leader drops it until
        // it has committed an entry in its term; a commit in the current term seen
        // here means the leader has one. Wait for that instead of sending in vain.
        if leader == 0 || !self.raw.raft.commit_to_current_term() {
            return;
        }
        let now = Instant::now();
        let due = self.read_requests.is_empty()
            || self
                .read_sent
                .is_none_or(|(to, retry_at)| to != leader || now >= retry_at);
        if !due {
            return;
        }
        let ctx = self.ids.next_id();
        self.read_requests.insert(ctx.seq, newest);
        // Bound the answers we still wait for (older ones cover fewer reads).
        while self.read_requests.len() > MAX_READ_REQUESTS {
            self.read_requests.pop_first();
        }
        let retry_after = self.cfg.tick_interval * (2 * self.cfg.heartbeat_tick as u32).max(3);
        self.read_sent = Some((leader, now + retry_after));
        let mut bytes = Vec::with_capacity(16);
        bytes.extend_from_slice(&ctx.client.to_le_bytes());
        bytes.extend_from_slice(&ctx.seq.to_le_bytes());
        self.raw.read_index(bytes);
    }

    pub(super) fn on_read_states(&mut self, states: Vec<raft::ReadState>) {
        for rs in states {
            let ctx = rs.request_ctx.as_slice();
            if ctx.len() != 16 {
                continue;
            }
            let (client, seq) = ctx.split_at(8);
            let (Ok(client), Ok(seq)) = (<[u8; 8]>::try_from(client), <[u8; 8]>::try_from(seq))
            else {
                continue;
            };
            if u64::from_le_bytes(client) != self.cfg.id {
                continue;
            }
            let Some(covers) = self.read_requests.get(&u64::from_le_bytes(seq)).copied() else {
                // Answered already through a later request, or expired.
                continue;
            };
            // Earlier requests cover fewer reads: they are settled too.
            self.read_requests.retain(|_, c| *c > covers);
            let later = self.reads.split_off(&(covers + 1));
            let served = std::mem::replace(&mut self.reads, later);
            self.confirmed_reads
                .extend(served.into_values().map(|r| (rs.index, r)));
        }
        if self.read_requests.is_empty() {
            self.read_sent = None;
        }
    }

    pub(super) fn serve_reads(&mut self) {
        if self.confirmed_reads.is_empty() {
            return;
        }
        let applied = self.state.get().applied_index();
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.confirmed_reads)
            .into_iter()
            .partition(|(index, _)| *index <= applied);
        self.confirmed_reads = waiting;
        for (_, r) in ready {
            (r.read)(Ok(&self.state.get()));
        }
    }

    /// Answers the reads whose deadline passed, saying which step was missing.
    pub(super) fn expire_reads(&mut self, now: Instant) {
        let late: Vec<u64> = self
            .reads
            .iter()
            .filter(|(_, r)| now >= r.deadline)
            .map(|(n, _)| *n)
            .collect();
        if !late.is_empty() {
            let reason = self.unconfirmed_read_reason();
            for n in late {
                if let Some(r) = self.reads.remove(&n) {
                    (r.read)(Err(ConsensusError::ReadTimeout {
                        reason: reason.clone(),
                    }));
                }
            }
            // Requests that cover no waiting read any more.
            match self.reads.keys().next() {
                Some(&oldest) => self.read_requests.retain(|_, c| *c >= oldest),
                None => self.read_requests.clear(),
            }
            if self.read_requests.is_empty() {
                self.read_sent = None;
            }
        }
        if self.confirmed_reads.iter().any(|(_, r)| now >= r.deadline) {
            let applied = self.state.get().applied_index();
            let (late, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.confirmed_reads)
                .into_iter()
                .partition(|(_, r)| now >= r.deadline);
            self.confirmed_reads = waiting;
            for (index, r) in late {
                (r.read)(Err(ConsensusError::ReadTimeout {
                    reason: format!(
                        "the leader confirmed read index {index}, but this replica has \
                         applied only up to {applied} (it is catching up)"
                    ),
                }));
            }
        }
    }

    /// Why a read still has no read index.
    pub(super) fn unconfirmed_read_reason(&self) -> String {
        let leader = self.leader();
        if leader == 0 {
            "no Raft leader is known to this replica (an election is under way, or it \
             cannot reach a quorum of the mesh)"
                .into()
        } else if !self.raw.raft.commit_to_current_term() {
            if self.is_leader() {
                "this replica was just elected leader and has not yet committed an entry \
                 in its term, which a quorum must acknowledge first"
                    .into()
            } else {
                format!(
                    "this replica has not yet seen leader {leader} commit an entry in its \
                     term (it may be catching up, or the leader lacks a quorum)"
                )
            }
        } else {
            format!("leader {leader} did not confirm its leadership with a quorum in time")
        }
    }
}
