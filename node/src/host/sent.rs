//! Calls sent straight to an actor's host: the API node hands a call to the node
//! that hosts the actor (itself, or a peer over the mesh), which runs it with the
//! others waiting and records them all, results included, in one entry
//! (`ActorCallsRan`). Anything short of that record — the host gone, moved, busy
//! with queued calls, an input not reachable — answers [`CallAnswer::NotRun`], and
//! the API node queues the call in the record under the same request id instead:
//! the record runs a request id once whichever way it went.

use gpumesh_consensus::{CallResult, ConsensusHandle, Outcome, RequestId};
use gpumesh_protocol::ActorCall;
use libp2p::PeerId;
use tokio::sync::{mpsc, oneshot};

use crate::error::NodeError;
use crate::net::NetHandle;
use crate::peers::PeersHandle;
pub use crate::wire::CallAnswer;
use crate::wire::{self, NodeReply, NodeRequest};

/// How long a call sent to another node's host is awaited before this node also
/// watches its record for the actor moving off that host.
const WATCH_FOR_MOVE_AFTER: std::time::Duration = std::time::Duration::from_secs(2);

/// A call handed to this node's actor host.
pub(crate) struct SentCall {
    pub name: String,
    pub call: ActorCall,
    pub request: RequestId,
    /// The node it came through (it holds the call's input blobs).
    pub caller: PeerId,
    pub reply: oneshot::Sender<CallAnswer>,
    /// Batches it was in that the record did not take.
    pub tries: u32,
}

impl CallAnswer {
    /// The answer the record gives for request `request` of actor `name`, once a
    /// batch holding it was applied here.
    pub fn recorded(consensus: &ConsensusHandle, name: &str, request: RequestId) -> CallAnswer {
        let name = name.to_string();
        consensus.read_local(move |s| {
            let Some(Outcome::CallQueued { seq }) = s.prior(&request).map(|c| &c.outcome) else {
                return CallAnswer::NotRun(format!("request {request} is not in the record"));
            };
            match s.actor(&name).and_then(|a| a.results.get(seq)) {
                Some(CallResult::Done {
                    version, outputs, ..
                }) => CallAnswer::Done {
                    seq: *seq,
                    version: *version,
                    outputs: outputs.clone(),
                },
                Some(CallResult::Failed { reason, .. }) => CallAnswer::Failed {
                    seq: *seq,
                    reason: reason.clone(),
                },
                None => CallAnswer::NotRun(format!("call {seq} of actor {name} has no result")),
            }
        })
    }
}

/// Hands a call to the actor host behind `inbox` and waits for its answer.
pub(crate) async fn ask(
    inbox: &mpsc::Sender<SentCall>,
    name: String,
    call: ActorCall,
    request: RequestId,
    caller: PeerId,
) -> CallAnswer {
    let (reply, answer) = oneshot::channel();
    let sent = SentCall {
        name,
        call,
        request,
        caller,
        reply,
        tries: 0,
    };
    if inbox.send(sent).await.is_err() {
        return CallAnswer::NotRun("this node hosts no actors (it has no GPU)".into());
    }
    answer
        .await
        .unwrap_or_else(|_| CallAnswer::NotRun("the host stopped before answering".into()))
}

/// Sends calls to actor hosts: this node's own, or a peer's over the mesh.
#[derive(Clone)]
pub(crate) struct CallSender {
    pub me: u64,
    pub inbox: mpsc::Sender<SentCall>,
    pub net: NetHandle,
    pub peers: PeersHandle,
    pub consensus: ConsensusHandle,
}

impl CallSender {
    /// Sends `call` to node `host` (the actor's host as this node's record has it)
    /// and waits for it to be recorded there.
    pub async fn send(
        &self,
        host: u64,
        name: &str,
        call: ActorCall,
        request: RequestId,
    ) -> CallAnswer {
        let me = self.peers.me();
        if host == self.me {
            return ask(&self.inbox, name.to_string(), call, request, me).await;
        }
        let peer = self.peers.peer(host).or_else(|| {
            self.consensus
                .read_local(move |s| s.member(host).and_then(|m| m.peer_id.parse().ok()))
        });
        let Some(peer) = peer else {
            return CallAnswer::NotRun(format!("the host, node {host:x}, is not reachable"));
        };
        let asked = NodeRequest::Call {
            name: name.to_string(),
            call,
            request,
        };
        let sent = async {
            let answer = wire::call(&self.net, peer, &asked).await;
            if let Err(NodeError::Unreached { .. }) = answer {
                // No connection to the host yet (a mesh just formed, a connection
                // lost): connect as the membership sweep would, at once, and send
                // the call again (it was not sent), rather than the slow way,
                // through the record.
                let connected = self.net.connected_peers();
                self.peers.connect(&connected, &[peer]).await;
                return wire::call(&self.net, peer, &asked).await;
            }
            answer
        };
        tokio::pin!(sent);
        // A host cut off without its connection closing answers nothing until the
        // request times out (30 s); once the record moves the actor, the call goes
        // through the record to the new host instead. (Watched only past the time
        // a call usually takes: every apply would wake each watcher.)
        let answer = match tokio::time::timeout(WATCH_FOR_MOVE_AFTER, &mut sent).await {
            Ok(answer) => answer,
            Err(_) => tokio::select! {
                answer = &mut sent => answer,
                () = self.moved_off(name, host) => {
                    return CallAnswer::NotRun(format!(
                        "actor {name} moved off node {host:x} while the call waited for it"
                    ));
                }
            },
        };
        match answer {
            Ok(NodeReply::Called(answer)) => answer,
            Ok(NodeReply::Refused(why)) => CallAnswer::NotRun(why),
            Ok(other) => CallAnswer::NotRun(format!("the host answered {other:?}")),
            Err(e) => CallAnswer::NotRun(e.to_string()),
        }
    }

    /// Returns once this node's record no longer has actor `name` on node `host`
    /// (moved, or deleted); never if the record stops changing for good.
    async fn moved_off(&self, name: &str, host: u64) {
        let mut state = self.consensus.watch_state();
        loop {
            if state
                .borrow_and_update()
                .actor(name)
                .is_none_or(|a| a.host != Some(host))
            {
                return;
            }
            if state.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }
}
