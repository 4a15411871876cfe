//! Leaving a mesh for good (`gpumesh leave`, `POST /v1/leave`), and the mark that a
//! node which left puts in its data dir.
//!
//! Stopping a node (Ctrl-C, SIGTERM, a crash) keeps it a member: started again on
//! its data dir it comes back with its state. Leaving takes it out of the record
//! for good: it first has other members keep a copy of every blob it holds that
//! the record still names (two copies where the mesh has two other members), so
//! leaving loses no result and no actor state; hands leadership away; is removed
//! from the Raft configuration; and marks its data dir, which no node starts on
//! again (its Raft log ends with its own removal, and its peers no longer answer
//! it).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;
use gpumesh_consensus::{ClusterId, Command, ConsensusHandle};
use gpumesh_protocol::BlobId;
use tokio_util::sync::CancellationToken;

use crate::api::LeftView;
use crate::blobs::BlobsHandle;
use crate::error::{NodeError, Result};
use crate::liveness::LivenessHandle;

/// The file in a data dir whose node has left its mesh.
pub const LEFT_FILE: &str = "left";

/// How many other members a leaving node has keep each of its blobs.
const COPIES: usize = 2;
/// How many blobs are handed off at once.
const HAND_OFF_AT_ONCE: usize = 8;
/// How long a removal (this node's, or one asked of it) may take to commit.
pub(crate) const REMOVAL_WAIT: Duration = Duration::from_secs(10);
/// How long a leader waits for another voter to take over before it goes on.
const HAND_OVER_WAIT: Duration = Duration::from_secs(3);

/// Why a node did not leave; either way it stays a member, running as it was.
#[derive(Debug)]
pub(crate) enum NotLeft {
    /// It may not leave now (the mesh's only voter, a leave under way).
    Refused(String),
    /// Leaving failed on the way (a blob no other member kept, a removal the mesh
    /// did not commit).
    Failed(String),
}

impl std::fmt::Display for NotLeft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotLeft::Refused(why) | NotLeft::Failed(why) => f.write_str(why),
        }
    }
}

impl From<NotLeft> for NodeError {
    fn from(e: NotLeft) -> Self {
        NodeError::Config(e.to_string())
    }
}

/// What leaving needs of a running node; shared by the API and [`super::MeshNode`].
#[derive(Clone)]
pub(crate) struct Leaving {
    pub consensus: ConsensusHandle,
    pub blobs: BlobsHandle,
    pub liveness: LivenessHandle,
    pub data_dir: PathBuf,
    pub cluster: ClusterId,
    /// Cancelled once this node has left: whoever runs it then stops it.
    pub left: CancellationToken,
    /// One leave at a time.
    pub once: Arc<tokio::sync::Mutex<()>>,
}

impl Leaving {
    /// Leaves the mesh (see the module's documentation). A refusal (the mesh's only
    /// voter, a leave already under way) or a failure before the removal commits
    /// leaves the node a member, running as it was.
    pub async fn leave(&self) -> std::result::Result<LeftView, NotLeft> {
        let Ok(_one) = self.once.try_lock() else {
            return Err(NotLeft::Refused(
                "this node is already leaving the mesh".into(),
            ));
        };
        if self.left.is_cancelled() {
            return Err(NotLeft::Refused(
                "this node has left the mesh already".into(),
            ));
        }
        let me = self.consensus.id();
        let status = self.consensus.status().await.map_err(failed)?;
        if !self.consensus.read_local(move |s| s.member(me).is_some()) {
            return Err(NotLeft::Refused(
                "this node is not a member of the mesh it knows (it is still joining, or was \
                 removed)"
                    .into(),
            ));
        }
        if status.voters.iter().all(|&v| v == me) {
            return Err(NotLeft::Refused(
                "this node is the mesh's only voter: it cannot leave (no member would be left \
                 to keep the record); stop it with Ctrl-C instead (it stays a member and comes \
                 back with its state), or start more nodes first"
                    .into(),
            ));
        }
        // Raft would remove it even so, and the mesh would then wait for voters
        // that are not there.
        let others: Vec<u64> = status.voters.iter().copied().filter(|&v| v != me).collect();
        let view = self.liveness.view();
        let running = others.iter().filter(|&&v| view.is_alive(v)).count();
        let majority = others.len() / 2 + 1;
        if running < majority {
            return Err(NotLeft::Refused(format!(
                "leaving now would leave the mesh without a quorum: of the {} other voters {running} \
                 run, and {majority} must; start the others first (or stop this node with Ctrl-C \
                 instead: it stays a member)",
                others.len()
            )));
        }
        let started = Instant::now();
        let mut handed = HashSet::new();
        let (mut blobs, mut bytes) = self.hand_off(&mut handed).await.map_err(failed)?;
        let mut handed_to = None;
        if status.leader_id == me {
            handed_to = self.hand_over_leadership(me, &status.voters).await;
        }
        // What arrived while the first round ran (a shard's result made here).
        let (more, more_bytes) = self.hand_off(&mut handed).await.map_err(failed)?;
        blobs += more;
        bytes += more_bytes;
        // Marked first: the removal may commit without this node ever applying it
        // (the leader stops sending to a node it removed), and a node started again
        // on this data dir would then campaign unheard for ever.
        mark_left(&self.data_dir, self.cluster, None).map_err(failed)?;
        let removal = tokio::time::timeout(
            REMOVAL_WAIT,
            self.consensus.propose(Command::NodeLeft { raft_id: me }),
        )
        .await;
        match removal {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                let mark = self.data_dir.join(LEFT_FILE);
                if let Err(e) = std::fs::remove_file(&mark) {
                    tracing::warn!(error = %e, path = %mark.display(), "could not remove the mark of leaving");
                }
                return Err(NotLeft::Failed(format!(
                    "the mesh did not remove this node ({e}); it stays a member"
                )));
            }
            // The removal may yet commit: the mark stays, and says what to do if not.
            Err(_) => {
                return Err(NotLeft::Failed(format!(
                    "the mesh did not remove this node within {REMOVAL_WAIT:?} (is a majority of \
                     its voters running?); it may yet be removed: `gpumesh status` on another \
                     member shows whether it was"
                )))
            }
        }
        tracing::info!(blobs, bytes, "left the mesh; other members keep its blobs");
        self.left.cancel();
        Ok(LeftView {
            node: me,
            blobs_handed_off: blobs,
            bytes_handed_off: bytes,
            copies: COPIES,
            leadership_to: handed_to,
            took_ms: started.elapsed().as_millis() as u64,
        })
    }

    /// Has other members keep every blob stored here that the record names and that
    /// `handed` does not hold yet; adds them to it. Their count and bytes.
    async fn hand_off(&self, handed: &mut HashSet<BlobId>) -> Result<(usize, u64)> {
        let mut todo = self.blobs.named_here().await?;
        todo.retain(|b| !handed.contains(b));
        let mut done = futures::stream::iter(todo.iter().copied())
            .map(|id| async move { (id, self.blobs.hand_off(id, COPIES).await) })
            .buffer_unordered(HAND_OFF_AT_ONCE);
        let mut bytes = 0;
        while let Some((id, outcome)) = done.next().await {
            if let Err(e) = outcome {
                return Err(NodeError::Config(format!(
                    "could not hand blob {id} to other members before leaving ({e}); this node \
                     stays a member"
                )));
            }
            bytes += self.blobs.store().size(&id).unwrap_or(0);
            handed.insert(id);
        }
        Ok((todo.len(), bytes))
    }

    /// Has another running voter take the leadership over; which one did, if any did
    /// in time.
    pub async fn hand_over_leadership(&self, me: u64, voters: &[u64]) -> Option<u64> {
        // One that runs, as this node sees it: a transfer to one that does not
        // would only hold the leadership back until it times out.
        let view = self.liveness.view();
        let to = *voters.iter().find(|&&v| v != me && view.is_alive(v))?;
        self.consensus.transfer_leader(to).await.ok()?;
        let mut status = self.consensus.watch_status();
        let moved = tokio::time::timeout(HAND_OVER_WAIT, async {
            loop {
                let leader = status.borrow_and_update().leader_id;
                if leader != me && leader != 0 {
                    return leader;
                }
                if status.changed().await.is_err() {
                    return 0;
                }
            }
        })
        .await;
        moved.ok().filter(|&l| l != 0)
    }
}

fn failed(e: impl std::fmt::Display) -> NotLeft {
    NotLeft::Failed(e.to_string())
}

/// Marks `dir` as the data dir of a node that left mesh `cluster`: by leaving, or
/// removed by another member (`removed`: how this node learned of it; see
/// [`super::removed`]).
pub(super) fn mark_left(dir: &Path, cluster: ClusterId, removed: Option<&str>) -> Result<()> {
    let at = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let path = dir.join(LEFT_FILE);
    let file = std::fs::File::create(&path).map_err(|e| NodeError::io(&path, e))?;
    let mut text = format!("mesh {:x}\nat {at}\n", cluster.0);
    if let Some(how) = removed {
        text.push_str(&format!("removed {}\n", how.replace('\n', " ")));
    }
    std::io::Write::write_all(&mut &file, text.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(|e| NodeError::io(&path, e))
}

/// Refuses a data dir whose node left its mesh, saying so and what to do instead.
pub(super) fn refuse_if_left(dir: &Path) -> Result<()> {
    let path = dir.join(LEFT_FILE);
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(());
    };
    let field = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_string()))
            .unwrap_or_else(|| "?".into())
    };
    let ago = field("at ")
        .parse::<u64>()
        .ok()
        .and_then(|at| {
            let now = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .ok()?
                .as_secs();
            Some(format!(" {} s ago", now.saturating_sub(at)))
        })
        .unwrap_or_default();
    let again = "to be a member again, start it with a new --data-dir and --join TICKET (or \
                 --peer ADDRESS of a member)";
    if let Some(how) = text.lines().find_map(|l| l.strip_prefix("removed ")) {
        return Err(NodeError::Config(format!(
            "the node of this data dir ({}) was removed from mesh {}{ago}: {}; a removed node \
             does not come back on its old data dir; {again}",
            dir.display(),
            field("mesh "),
            how.trim(),
        )));
    }
    Err(NodeError::Config(format!(
        "the node of this data dir ({}) left mesh {}{ago} (gpumesh leave): a node that left does \
         not come back on its old data dir; {again}. (Only if it stopped while leaving and \
         `gpumesh status` on a member still lists it: remove {} and start it again.)",
        dir.display(),
        field("mesh "),
        path.display(),
    )))
}
