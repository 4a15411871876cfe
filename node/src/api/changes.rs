//! Wakes the API's long polls (a task's wait, a queued actor call's answer) when an
//! entry about their task or actor is applied here. One reader of the applied log
//! serves every waiting request: with one subscription each, every applied entry
//! woke every waiter, so a thousand waiting requests cost a thousand wake-ups per
//! entry, nearly all of them for nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use gpumesh_consensus::{AppliedEvent, ConsensusHandle, TaskId};
use tokio::sync::{broadcast, Notify};
use tokio_util::sync::CancellationToken;

/// What a request waits on.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Topic {
    Task(TaskId),
    Actor(String),
}

#[derive(Default)]
pub(crate) struct Changes {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    next: u64,
    waiting: HashMap<Topic, HashMap<u64, Arc<Notify>>>,
    /// The log is no longer followed (the node is stopping): every wait ends.
    closed: bool,
}

/// One request's interest in a topic, from its creation on: a change applied after
/// [`Changes::watch`] returned wakes the next [`Watch::changed`], even one called
/// later. Dropping it stops the interest.
pub(crate) struct Watch {
    changes: Arc<Changes>,
    topic: Topic,
    id: u64,
    notify: Arc<Notify>,
}

impl Watch {
    /// Waits for an entry about the topic (or a gap in what this node saw, after
    /// which anything may have changed); `false` once the node is stopping.
    pub(crate) async fn changed(&self) -> bool {
        self.notify.notified().await;
        !self.changes.lock().closed
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut inner = self.changes.lock();
        if let Some(ids) = inner.waiting.get_mut(&self.topic) {
            ids.remove(&self.id);
            if ids.is_empty() {
                inner.waiting.remove(&self.topic);
            }
        }
    }
}

impl Changes {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts waiting on `topic`; read the state after this, then wait on the watch.
    pub(crate) fn watch(self: &Arc<Self>, topic: Topic) -> Watch {
        let notify = Arc::new(Notify::new());
        let mut inner = self.lock();
        if inner.closed {
            notify.notify_one();
        }
        inner.next += 1;
        let id = inner.next;
        inner
            .waiting
            .entry(topic.clone())
            .or_default()
            .insert(id, notify.clone());
        drop(inner);
        Watch {
            changes: self.clone(),
            topic,
            id,
            notify,
        }
    }

    /// Wakes each waiter on `topic` (all of them when `None`).
    fn wake(&self, topic: Option<&Topic>) {
        let inner = self.lock();
        let wake = |ids: &HashMap<u64, Arc<Notify>>| ids.values().for_each(|n| n.notify_one());
        match topic {
            Some(t) => inner.waiting.get(t).into_iter().for_each(wake),
            None => inner.waiting.values().for_each(wake),
        }
    }

    /// Follows this node's applied log until `cancel` or the replica stops, waking
    /// the waiters of each entry's task or actor.
    pub(crate) async fn follow(
        self: Arc<Self>,
        consensus: ConsensusHandle,
        cancel: CancellationToken,
    ) {
        let mut events = consensus.subscribe();
        loop {
            let event = tokio::select! {
                _ = cancel.cancelled() => break,
                event = events.recv() => event,
            };
            match event {
                Ok(AppliedEvent::Entry { entry, .. }) => {
                    if let Some(task) = entry.command.task() {
                        self.wake(Some(&Topic::Task(task)));
                    }
                    if let Some(name) = entry.command.actor() {
                        self.wake(Some(&Topic::Actor(name.to_string())));
                    }
                }
                // A snapshot replaced the state, or entries went by unseen.
                Ok(AppliedEvent::Restored { .. }) | Err(broadcast::error::RecvError::Lagged(_)) => {
                    self.wake(None)
                }
                Err(broadcast::error::RecvError::Closed) => break,
            }
        }
        self.lock().closed = true;
        self.wake(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn woken(w: &Watch) -> bool {
        tokio::time::timeout(Duration::from_millis(50), w.changed())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_change_wakes_only_its_topics_waiters_even_before_they_wait() {
        let changes = Arc::new(Changes::default());
        let t1 = changes.watch(Topic::Task(TaskId(1)));
        let t1_again = changes.watch(Topic::Task(TaskId(1)));
        let t2 = changes.watch(Topic::Task(TaskId(2)));
        let actor = changes.watch(Topic::Actor("a".into()));
        // Before anyone waits: kept for the next wait, not lost.
        changes.wake(Some(&Topic::Task(TaskId(1))));
        assert!(woken(&t1).await);
        assert!(woken(&t1_again).await);
        assert!(!woken(&t2).await);
        assert!(!woken(&actor).await);
        // Several changes before a wait are one wake-up.
        changes.wake(Some(&Topic::Actor("a".into())));
        changes.wake(Some(&Topic::Actor("a".into())));
        assert!(woken(&actor).await);
        assert!(!woken(&actor).await);
        changes.wake(None);
        assert!(woken(&t2).await);
        drop((t1, t1_again, t2, actor));
        assert!(
            changes.lock().waiting.is_empty(),
            "dropped watches are gone"
        );
    }
}
