//! What the API answers, as JSON: the types `gpumesh::Client` and the CLI read back,
//! and how a task of the record becomes a [`TaskView`].

use std::collections::HashMap;

use gpumesh_consensus::{RequestId, ShardState, StateMachine};
use gpumesh_protocol::TaskSpec;
pub use gpumesh_protocol::TaskState;
use serde::{Deserialize, Serialize};

use crate::liveness::{LivenessView, Presence};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SubmitRequest {
    pub spec: TaskSpec,
    /// Idempotency key: a retried submit with the same id returns the same task.
    pub request_id: Option<RequestId>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SubmitReply {
    pub task: u64,
}

/// `POST /v1/tasks/run`: the task once it finished (or the wait ran out), and its
/// outputs, with their bytes when all of them together are small.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunReply {
    pub task: TaskView,
    pub outputs: Vec<RunOutput>,
}

/// One output of a finished task; `hex` holds its bytes when they came inline
/// (at most [`RUN_INLINE_BYTES`] for all outputs together). In a binary answer
/// (see [`RUN_BINARY`]) `attached` says its bytes follow the JSON instead.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunOutput {
    pub binding: u32,
    pub size: u64,
    pub blake3: String,
    pub hex: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub attached: bool,
}

/// Output bytes `POST /v1/tasks/run` carries in its answer, all outputs together,
/// in hex in a JSON answer.
pub const RUN_INLINE_BYTES: u64 = 64 << 10;

/// The same in a binary answer (see [`RUN_BINARY`]). A larger result is stored
/// on the node and fetched in a request of its own.
pub const RUN_ATTACHED_BYTES: u64 = 64 << 20;

/// The media type a client names in `Accept` to have `POST /v1/tasks/run` answer
/// in binary: the bytes of each output marked `attached`, in the order listed,
/// each `size` long, after the first `skip` bytes of the body; then the
/// [`RunEnd`] as JSON; then that JSON's length as a u32 (little-endian). Output
/// bytes cost no hex on either side that way (an answer's 48 KB output: 96 KB of
/// JSON text to write, parse and decode).
///
/// The JSON comes last so that a task run where it was sent can have its outputs
/// on the way to the client while its result is being stored on two nodes and
/// recorded: what says the bytes are the answer (the task completed, the record
/// holds that result, each output's hash) comes only once that is done. A body
/// that ends without it is no answer.
pub const RUN_BINARY: &str = "application/vnd.gpumesh.run.v2";

/// The end of a binary answer (see [`RUN_BINARY`]): the reply, or the error that
/// took its place (a status and reason, as an HTTP error would have given them).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunEnd {
    /// Bytes at the body's start that are no output of the reply: sent before the
    /// run was recorded, when the record then held something else.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub skip: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply: Option<RunReply>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<RunError>,
}

/// An error at the end of a binary answer whose body had begun.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunError {
    pub status: u16,
    pub error: String,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Each output's bytes in a run's answer, in the order of its outputs: `None` for
/// one whose bytes did not come with it.
pub type AttachedBytes = Vec<Option<Vec<u8>>>;

/// The end of a binary answer: `end` as JSON, then its length.
pub fn encode_run_end(end: &RunEnd) -> Result<Vec<u8>, String> {
    let mut json =
        serde_json::to_vec(end).map_err(|e| format!("the answer did not encode: {e}"))?;
    let len =
        u32::try_from(json.len()).map_err(|_| "the answer's JSON is over 4 GiB".to_string())?;
    json.extend_from_slice(&len.to_le_bytes());
    Ok(json)
}

/// `reply` with its outputs' bytes (`bytes[i]` for `reply.outputs[i]`, `None` where
/// an output's bytes do not come with the answer) in the binary form of
/// [`RUN_BINARY`], after `skip` bytes already sent: each output with bytes is
/// marked `attached`. In pieces, to be sent one after another: each attached
/// output's bytes as they were given (not copied into one), then the end.
pub fn encode_run_binary(
    mut reply: RunReply,
    bytes: AttachedBytes,
    skip: u64,
) -> Result<Vec<Vec<u8>>, String> {
    let mut pieces = Vec::new();
    for (o, b) in reply.outputs.iter_mut().zip(bytes) {
        o.hex = None;
        o.attached = b.is_some();
        pieces.extend(b);
    }
    pieces.push(encode_run_end(&RunEnd {
        skip,
        reply: Some(reply),
        error: None,
    })?);
    Ok(pieces)
}

/// A binary answer (see [`RUN_BINARY`]) taken apart: the reply, and each output's
/// bytes in order (`None` for one not attached), every attached output exactly
/// `size` bytes after the skipped ones and nothing left over; or the error it
/// ends with. A body that is cut short, runs on, or does not parse is an error
/// that says which. The first attached output keeps the body's allocation (an
/// answer of one output is not copied).
pub fn decode_run_binary(
    mut body: Vec<u8>,
) -> Result<Result<(RunReply, AttachedBytes), RunError>, String> {
    let at = body
        .len()
        .checked_sub(4)
        .ok_or("a binary answer shorter than its end's length")?;
    let l = &body[at..];
    let len = u32::from_le_bytes([l[0], l[1], l[2], l[3]]) as usize;
    let start = at
        .checked_sub(len)
        .ok_or_else(|| format!("a binary answer shorter than its {len}-byte end"))?;
    let end: RunEnd = serde_json::from_slice(&body[start..at])
        .map_err(|e| format!("a binary answer's end: {e}"))?;
    body.truncate(start);
    let skip = usize::try_from(end.skip).unwrap_or(usize::MAX);
    if skip > body.len() {
        return Err(format!(
            "a binary answer shorter than the {skip} bytes it skips"
        ));
    }
    let reply = match (end.reply, end.error) {
        (_, Some(error)) => return Ok(Err(error)),
        (Some(reply), None) => reply,
        (None, None) => return Err("a binary answer ends with neither reply nor error".into()),
    };
    let mut left = body.len() - skip;
    for o in reply.outputs.iter().filter(|o| o.attached) {
        let size = usize::try_from(o.size).unwrap_or(usize::MAX);
        if size > left {
            return Err(format!(
                "output {} ({size} bytes) runs past its part of the answer",
                o.binding
            ));
        }
        left -= size;
    }
    if left > 0 {
        return Err(format!("{left} bytes in the answer past its outputs"));
    }
    body.drain(..skip);
    // From the last output back, so the first keeps the body's allocation.
    let first = reply.outputs.iter().position(|o| o.attached);
    let mut bytes = vec![None; reply.outputs.len()];
    for (i, o) in reply.outputs.iter().enumerate().rev() {
        if !o.attached {
            continue;
        }
        bytes[i] = Some(if Some(i) == first {
            std::mem::take(&mut body)
        } else {
            body.split_off(body.len() - o.size as usize)
        });
    }
    Ok(Ok((reply, bytes)))
}

/// Lower-case hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = Vec::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)]);
        out.push(DIGITS[usize::from(b & 15)]);
    }
    // Only ASCII digits were pushed.
    String::from_utf8(out).unwrap_or_default()
}

/// The value of each ASCII hex digit, lower or upper case; 0xFF for anything else.
const HEX_VALUE: [u8; 256] = {
    let mut table = [0xFF; 256];
    let mut i = 0;
    while i < 10 {
        table[b'0' as usize + i] = i as u8;
        i += 1;
    }
    let mut i = 0;
    while i < 6 {
        table[b'a' as usize + i] = 10 + i as u8;
        table[b'A' as usize + i] = 10 + i as u8;
        i += 1;
    }
    table
};

/// The bytes of lower-case or upper-case hex, or why it is not hex.
pub fn from_hex(text: &str) -> Result<Vec<u8>, String> {
    if !text.len().is_multiple_of(2) {
        return Err(format!("{} hex digits: not whole bytes", text.len()));
    }
    let mut out = Vec::with_capacity(text.len() / 2);
    for pair in text.as_bytes().chunks_exact(2) {
        let (hi, lo) = (
            HEX_VALUE[usize::from(pair[0])],
            HEX_VALUE[usize::from(pair[1])],
        );
        if hi == 0xFF || lo == 0xFF {
            // The message is made only for the first digit that is wrong.
            let wrong = if hi == 0xFF { pair[0] } else { pair[1] };
            return Err(format!("{:?} is not a hex digit", wrong as char));
        }
        out.push(hi << 4 | lo);
    }
    Ok(out)
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BlobReply {
    pub id: String,
    pub size: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ShardView {
    pub index: u32,
    pub state: String,
    /// The node of the latest attempt in flight, or of the accepted result.
    pub node: Option<u64>,
    pub epoch: u32,
    /// Attempts in flight as (node, epoch); more than one for replicas and
    /// speculative copies of stragglers.
    #[serde(default)]
    pub attempts: Vec<(u64, u32)>,
    /// Nodes whose results are in, awaiting comparison with other replicas.
    #[serde(default)]
    pub reported_by: Vec<u64>,
    pub failures: u32,
    pub last_error: Option<String>,
    pub output: Option<String>,
    /// Nodes (raft ids, hex) of the attempts in flight, or of the accepted result:
    /// what the dashboard shows (JavaScript numbers lose precision past 2^53).
    #[serde(default)]
    pub nodes: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TaskView {
    pub id: u64,
    pub status: TaskState,
    pub reason: Option<String>,
    pub kernel: String,
    pub submitter: String,
    pub merge: String,
    pub grid: String,
    pub shards_done: usize,
    pub shards: Vec<ShardView>,
    /// Nodes each shard runs on for verification.
    #[serde(default = "one")]
    pub replicas: u32,
    /// Replica results that disagreed.
    #[serde(default)]
    pub mismatches: u32,
    /// Assignments, retries, replica comparisons, newest last.
    #[serde(default)]
    pub history: Vec<HistoryView>,
    /// Set where no leader confirmed the read: the task as the node answering last
    /// knew it (it may be cut off from the majority), and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unconfirmed: Option<String>,
}

/// What [`TaskView::unconfirmed`] says.
pub(crate) const UNCONFIRMED: &str = "as this node last knew it: no leader confirmed the read \
     within 1 s (an election, or this node is cut off from most of the mesh)";

fn one() -> u32 {
    1
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HistoryView {
    pub index: u64,
    pub shard: Option<u32>,
    pub what: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OutputView {
    pub binding: u32,
    pub size: u64,
    pub blake3: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MemberView {
    pub raft_id: u64,
    /// The raft id in hex, as `gpumesh status` and the dashboard show it.
    #[serde(default)]
    pub id: String,
    pub peer_id: String,
    pub role: String,
    /// Heard from within `down_after` and not known unreachable (see `liveness`).
    pub alive: bool,
    /// This node has no connection to it and could not dial it (its connections
    /// closed, or it never took a dial since this node started).
    #[serde(default)]
    pub unreachable: bool,
    /// Counted alive, but nothing from it has reached this node yet, which started
    /// less than `down_after` ago (a node that just joined, asked about a member
    /// that may be down).
    #[serde(default)]
    pub unheard: bool,
    /// Where it listens, from its membership record.
    #[serde(default)]
    pub addrs: Vec<String>,
    pub adapter: Option<String>,
    pub backend: Option<String>,
    pub gflops: Option<f64>,
    pub gbps: Option<f64>,
    /// Bytes of GPU memory it keeps actors' state and reused inputs in (`--gpu-memory`).
    #[serde(default)]
    pub gpu_memory: Option<u64>,
    /// Attempts placed on it and not finished.
    pub queue: u32,
    /// Its shard results accepted so far (over the tasks the record holds).
    #[serde(default)]
    pub shards_done: u64,
}

/// `POST /v1/leave`: a node that has left its mesh (and is stopping).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LeftView {
    /// Its raft id.
    pub node: u64,
    /// The blobs the record names that it held, each now kept by `copies` other
    /// members (every other member where there are fewer).
    pub blobs_handed_off: usize,
    pub bytes_handed_off: u64,
    pub copies: usize,
    /// The voter it handed the leadership to, if it led.
    pub leadership_to: Option<u64>,
    pub took_ms: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StatusView {
    pub node: u64,
    pub peer_id: String,
    pub leader: u64,
    pub term: u64,
    pub commit_index: u64,
    pub applied_index: u64,
    pub members: Vec<MemberView>,
    /// Every GPU actor: its host, epoch, version, moves.
    #[serde(default)]
    pub actors: Vec<ActorView>,
    /// The data format this node reads and writes (every member's is the same).
    #[serde(default)]
    pub data_format: u16,
}

#[derive(Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}

/// A task's kernel as people know it: a built-in's name, or `wgsl:<entry point>`.
pub(crate) fn kernel_name(spec: &gpumesh_protocol::TaskSpec) -> String {
    match &spec.shader {
        gpumesh_protocol::ShaderSource::Builtin(n) => n.clone(),
        gpumesh_protocol::ShaderSource::Wgsl(_) => format!("wgsl:{}", spec.entry_point),
    }
}

pub(crate) fn view(t: &gpumesh_consensus::Task) -> TaskView {
    let (status, reason) = (t.status.state(), t.status.reason().map(str::to_string));
    TaskView {
        id: t.id.0,
        status,
        reason,
        kernel: kernel_name(&t.spec),
        submitter: t.submitter.clone(),
        merge: t.spec.merge_label(),
        grid: t.spec.grid.to_string(),
        shards_done: t
            .shards
            .iter()
            .filter(|s| s.state == ShardState::Done)
            .count(),
        shards: t
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| ShardView {
                index: i as u32,
                state: format!("{:?}", s.state).to_lowercase(),
                node: s.assigned_to().or(s.output.map(|o| o.node)),
                epoch: s.epoch,
                attempts: s.attempts.iter().map(|a| (a.node, a.epoch)).collect(),
                reported_by: s.reports.iter().map(|r| r.node).collect(),
                failures: s.failures,
                last_error: s.last_error.clone(),
                output: s.output.map(|o| o.blob.to_hex()),
                nodes: match &s.output {
                    Some(out) => vec![hex(out.node)],
                    None => s.attempts.iter().map(|a| hex(a.node)).collect(),
                },
            })
            .collect(),
        replicas: t.spec.options.replicas,
        mismatches: t.mismatches,
        history: t
            .history
            .iter()
            .map(|e| HistoryView {
                index: e.index,
                shard: e.shard,
                what: e.what.clone(),
            })
            .collect(),
        unconfirmed: None,
    }
}

/// A raft id as the dashboard shows it: hex (JavaScript numbers lose precision past
/// 2^53, and raft ids are 64-bit).
pub(crate) fn hex(id: u64) -> String {
    format!("{id:x}")
}

/// Every member as this node sees it: its record, its liveness (see
/// [`crate::liveness`]), its queue and its accepted shard results.
pub(crate) fn members(s: &StateMachine, liveness: &LivenessView) -> Vec<MemberView> {
    let queue = s.queue_by_node();
    let mut done: HashMap<u64, u64> = HashMap::new();
    for t in s.tasks() {
        for sh in &t.shards {
            if let Some(out) = &sh.output {
                *done.entry(out.node).or_default() += 1;
            }
        }
    }
    s.members()
        .values()
        .map(|m| MemberView {
            raft_id: m.raft_id,
            id: hex(m.raft_id),
            peer_id: m.peer_id.clone(),
            role: format!("{:?}", m.role).to_lowercase(),
            alive: liveness.is_alive(m.raft_id),
            unreachable: liveness.presence(m.raft_id) == Presence::Unreachable,
            unheard: liveness.presence(m.raft_id) == Presence::Unheard,
            addrs: m.addrs.clone(),
            adapter: m.capability.as_ref().map(|c| c.adapter_name.clone()),
            backend: m.capability.as_ref().map(|c| c.backend.name().to_string()),
            gflops: m.capability.as_ref().map(|c| c.gflops),
            gbps: m.capability.as_ref().map(|c| c.gbps),
            gpu_memory: m.capability.as_ref().map(|c| c.memory),
            queue: queue.get(&m.raft_id).copied().unwrap_or(0),
            shards_done: done.get(&m.raft_id).copied().unwrap_or(0),
        })
        .collect()
}

/// `POST /v1/actors`: a new actor and where its state starts.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CreateActorRequest {
    pub name: String,
    pub state: Vec<StateInit>,
    /// Host it on a node of this backend (vulkan, gl, metal, dx12); any if none.
    #[serde(default)]
    pub backend: Option<String>,
    /// Idempotency key: a retried create with the same id answers with the actor it
    /// made, where another id is refused because the name is taken.
    #[serde(default)]
    pub request_id: Option<RequestId>,
}

/// One state buffer of a new actor: `size` bytes at `binding`, starting as the bytes
/// of an uploaded blob, or zeros.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StateInit {
    pub binding: u32,
    pub size: u64,
    #[serde(default)]
    pub blob: Option<gpumesh_protocol::BlobId>,
}

/// An actor as the record holds it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ActorView {
    pub name: String,
    /// The host's peer id; empty until the leader places it.
    pub node: String,
    /// The host's raft id, hex.
    pub host: String,
    /// Placements so far; a report from an older one does not count.
    pub epoch: u32,
    /// Calls that ran (each makes a new version of the state).
    pub version: u64,
    /// Bytes of state, all buffers together.
    pub bytes: u64,
    pub state: Vec<gpumesh_protocol::StateBuffer>,
    pub backend: Option<String>,
    /// Moves off a host that was down or gone.
    pub moves: u32,
    /// Calls waiting to run.
    pub pending: usize,
    /// The raft id (hex) of the node keeping the second copy of the state.
    pub backup: Option<String>,
}

/// `POST /v1/actors/{name}/calls`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CallRequest {
    pub call: gpumesh_protocol::ActorCall,
    /// Idempotency key: a retried call with the same id runs once and answers the same.
    pub request_id: Option<RequestId>,
}

/// A call that ran: its place in the actor's order, the state version it made, and
/// its own outputs (fetch each with `GET /v1/blobs/{blake3}`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CallReply {
    pub seq: u64,
    pub version: u64,
    pub outputs: Vec<OutputView>,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn reply(outputs: &[(u32, u64)]) -> RunReply {
        RunReply {
            task: TaskView {
                id: 7,
                status: TaskState::Completed,
                reason: None,
                kernel: "k".into(),
                submitter: "s".into(),
                merge: "changes".into(),
                grid: "1x1x1".into(),
                shards_done: 1,
                shards: Vec::new(),
                replicas: 1,
                mismatches: 0,
                history: Vec::new(),
                unconfirmed: None,
            },
            outputs: outputs
                .iter()
                .map(|&(binding, size)| RunOutput {
                    binding,
                    size,
                    blake3: String::new(),
                    hex: None,
                    attached: false,
                })
                .collect(),
        }
    }

    #[test]
    fn a_binary_answer_goes_both_ways_and_garbage_is_refused_with_the_reason() {
        let bytes = vec![Some(vec![1u8, 2, 3]), None, Some(vec![9u8; 5])];
        let body = encode_run_binary(reply(&[(0, 3), (1, 1 << 20), (2, 5)]), bytes.clone(), 0)
            .unwrap()
            .concat();
        let (back, got) = decode_run_binary(body.clone()).unwrap().unwrap();
        assert_eq!(got, bytes);
        assert_eq!(back.task.id, 7);
        let marks: Vec<bool> = back.outputs.iter().map(|o| o.attached).collect();
        assert_eq!(marks, vec![true, false, true]);

        // Bytes sent ahead and then disowned: skipped, the outputs after them.
        let mut ahead = vec![0xeeu8; 11];
        ahead.extend(
            encode_run_binary(reply(&[(0, 3), (1, 1 << 20), (2, 5)]), bytes.clone(), 11)
                .unwrap()
                .concat(),
        );
        assert_eq!(decode_run_binary(ahead).unwrap().unwrap().1, bytes);

        // An answer that ends in an error, whatever came before it.
        let mut failed = vec![1u8, 2, 3];
        let error = RunError {
            status: 503,
            error: "no quorum".into(),
        };
        failed.extend(
            encode_run_end(&RunEnd {
                skip: 3,
                reply: None,
                error: Some(error.clone()),
            })
            .unwrap(),
        );
        assert_eq!(decode_run_binary(failed).unwrap().unwrap_err(), error);

        let fails = |body: &[u8], why: &str| {
            let e = decode_run_binary(body.to_vec()).unwrap_err();
            assert!(e.contains(why), "{e}");
        };
        fails(&body[..3], "shorter than its end's length");
        // Cut anywhere, the end is not where its length says.
        fails(&body[..body.len() - 1], "");
        fails(&body[1..], "runs past its part");
        let mut longer = vec![0];
        longer.extend_from_slice(&body);
        fails(&longer, "past its outputs");
        let mut bad_json = body.clone();
        let n = bad_json.len();
        bad_json[n - 6] = b'?';
        fails(&bad_json, "end:");
        fails(&[b'}', 0xff, 0xff, 0xff, 0xff], "shorter than its");
        fails(&[b'{', b'}', 2, 0, 0, 0], "neither reply nor error");
        let mut skips_too_much = b"{\"skip\":9}".to_vec();
        skips_too_much.extend_from_slice(&10u32.to_le_bytes());
        fails(&skips_too_much, "shorter than the 9 bytes it skips");
    }

    #[test]
    fn hex_goes_both_ways_and_says_which_digit_is_wrong() {
        let bytes: Vec<u8> = (0..=255).collect();
        let hex = to_hex(&bytes);
        assert_eq!(&hex[..8], "00010203");
        assert_eq!(&hex[hex.len() - 4..], "feff");
        assert_eq!(from_hex(&hex).unwrap(), bytes);
        assert_eq!(from_hex("ABcd0F").unwrap(), vec![0xab, 0xcd, 0x0f]);
        assert_eq!(from_hex("").unwrap(), Vec::<u8>::new());
        assert!(from_hex("abc").unwrap_err().contains("not whole bytes"));
        assert!(from_hex("0g")
            .unwrap_err()
            .contains("'g' is not a hex digit"));
        assert!(from_hex("x0")
            .unwrap_err()
            .contains("'x' is not a hex digit"));
    }
}
