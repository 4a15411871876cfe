//! The dashboard's throughput series: each member's shard results per second, from
//! the applied log, kept while the API runs so the plot has a history the moment the
//! page opens.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpumesh_consensus::{AppliedEvent, Command, ConsensusHandle, Outcome};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::views::hex;

/// Throughput samples kept: one a second.
pub const THROUGHPUT_SAMPLES: usize = 120;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ThroughputPoint {
    /// Milliseconds since the Unix epoch at the end of the second.
    pub at_ms: u64,
    pub rates: BTreeMap<String, f64>,
}

/// Each member's count of shard results committed, sampled once a second from the
/// applied log, so the plot has a history the moment the page opens.
#[derive(Default)]
pub(crate) struct Throughput {
    samples: Mutex<VecDeque<(u64, BTreeMap<u64, u64>)>>,
}

impl Throughput {
    /// Counts results as they are applied and samples the counts every second.
    pub(crate) async fn track(
        self: Arc<Self>,
        consensus: ConsensusHandle,
        cancel: CancellationToken,
    ) {
        let mut events = consensus.subscribe();
        let mut counts: BTreeMap<u64, u64> = BTreeMap::new();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                event = events.recv() => match event {
                    Ok(AppliedEvent::Entry { entry, committed, duplicate: false, .. }) => {
                        if let Some(node) = result_of(&entry.command, &committed.outcome) {
                            *counts.entry(node).or_default() += 1;
                        }
                    }
                    Ok(_) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                },
                _ = tick.tick() => {
                    if let Ok(mut samples) = self.samples.lock() {
                        samples.push_back((crate::scheduler::now_ms(), counts.clone()));
                        while samples.len() > THROUGHPUT_SAMPLES + 1 {
                            samples.pop_front();
                        }
                    }
                }
            }
        }
    }

    pub(crate) fn points(&self) -> Vec<ThroughputPoint> {
        let Ok(samples) = self.samples.lock() else {
            return Vec::new();
        };
        samples
            .iter()
            .zip(samples.iter().skip(1))
            .map(|((t0, before), (t1, after))| {
                let secs = (t1.saturating_sub(*t0) as f64 / 1e3).max(1e-3);
                ThroughputPoint {
                    at_ms: *t1,
                    rates: after
                        .iter()
                        .map(|(node, n)| {
                            let was = before.get(node).copied().unwrap_or(0);
                            (hex(*node), n.saturating_sub(was) as f64 / secs)
                        })
                        .collect(),
                }
            })
            .collect()
    }
}

/// The node whose shard result `command` recorded, if it recorded one: a
/// `ShardResult` that took effect, or a task run where it was sent.
fn result_of(command: &Command, outcome: &Outcome) -> Option<u64> {
    match (command, outcome) {
        (Command::ShardResult { node, .. }, Outcome::Applied) => Some(*node),
        (Command::TaskRan { node, ran, .. }, Outcome::TaskSubmitted { .. })
            if matches!(**ran, gpumesh_consensus::Ran::Result { .. }) =>
        {
            Some(*node)
        }
        _ => None,
    }
}
