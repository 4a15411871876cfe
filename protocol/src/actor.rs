//! GPU actors: a name, state buffers that live on one node's GPU between calls, and
//! calls that run a kernel with the state bound beside the call's own buffers.
//!
//! A call runs as a one-shard task whose bindings are the call's own plus each state
//! buffer, read-write and in place, at its binding ([`ActorCall::as_task`]); what the
//! kernel changed in the state is the call's effect on it.

use serde::{Deserialize, Serialize};

use crate::error::{ProtocolError, Result};
use crate::ids::BlobId;
use crate::task::{BindingRole, BindingSpec, Grid, MergeRule, ShaderSource, TaskOptions, TaskSpec};

/// The longest actor name.
pub const MAX_ACTOR_NAME: usize = 64;

/// One state buffer of an actor: `@binding(binding)` in `@group(0)`, `size` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateBuffer {
    pub binding: u32,
    pub size: u64,
}

/// One call: a kernel, the call's own buffers, and its grid. The actor's state is
/// bound at its own bindings by the node that hosts it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActorCall {
    pub shader: ShaderSource,
    pub entry_point: String,
    /// The call's own inputs, parameters and outputs; none at a state binding.
    pub bindings: Vec<BindingSpec>,
    pub grid: Grid,
    /// How long the call may run on the GPU.
    pub deadline_ms: Option<u64>,
}

/// Refuses a name that cannot be an actor's: empty, too long, or with characters
/// other than ASCII letters, digits, `-`, `_` and `.` (names travel in URLs).
pub fn check_name(name: &str) -> Result<()> {
    let invalid = |reason: String| ProtocolError::Invalid {
        what: "actor name",
        reason,
    };
    if name.is_empty() {
        return Err(invalid("it is empty".into()));
    }
    if name.len() > MAX_ACTOR_NAME {
        return Err(invalid(format!(
            "{name:?} is {} bytes; the limit is {MAX_ACTOR_NAME}",
            name.len()
        )));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(invalid(format!(
            "{name:?} holds {c:?}; use letters, digits, '-', '_' and '.'"
        )));
    }
    Ok(())
}

/// Refuses a state layout no actor can have: none, a binding twice, a size of zero
/// or not a whole number of 4-byte words.
pub fn check_layout(state: &[StateBuffer]) -> Result<()> {
    let invalid = |reason: String| ProtocolError::Invalid {
        what: "actor state",
        reason,
    };
    if state.is_empty() {
        return Err(invalid(
            "an actor needs at least one state buffer (--state BINDING:BYTES)".into(),
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    for s in state {
        if !seen.insert(s.binding) {
            return Err(invalid(format!("binding {} is given twice", s.binding)));
        }
        if s.size == 0 || s.size % 4 != 0 {
            return Err(invalid(format!(
                "binding {} has {} bytes; a state buffer is a positive whole number of \
                 4-byte words",
                s.binding, s.size
            )));
        }
    }
    Ok(())
}

impl ActorCall {
    /// The one-shard task this call runs as on its host: the call's bindings, and
    /// each state buffer in-out at its binding, starting from `state`'s blob (or as
    /// zeros, an output, where there is none yet).
    pub fn as_task(&self, state: &[(StateBuffer, Option<BlobId>)]) -> TaskSpec {
        let mut bindings = self.bindings.clone();
        bindings.extend(state.iter().map(|(s, blob)| BindingSpec {
            binding: s.binding,
            role: match blob {
                Some(blob) => BindingRole::InOut {
                    blob: *blob,
                    size: s.size,
                },
                None => BindingRole::Output { size: s.size },
            },
        }));
        TaskSpec {
            shader: self.shader.clone(),
            entry_point: self.entry_point.clone(),
            bindings,
            grid: self.grid,
            shards: 1,
            merge: MergeRule::Changes,
            merges: Default::default(),
            options: TaskOptions {
                deadline_ms: self.deadline_ms,
                ..Default::default()
            },
        }
    }

    /// Structural checks against the actor's layout: no call binding at a state
    /// binding, and the task it runs as well formed.
    pub fn check_shape(&self, layout: &[StateBuffer]) -> Result<()> {
        for b in &self.bindings {
            if layout.iter().any(|s| s.binding == b.binding) {
                return Err(ProtocolError::Invalid {
                    what: "actor call",
                    reason: format!(
                        "binding {} is the actor's state; the call's own buffers take \
                         other bindings",
                        b.binding
                    ),
                });
            }
        }
        let state: Vec<(StateBuffer, Option<BlobId>)> = layout.iter().map(|s| (*s, None)).collect();
        self.as_task(&state).check_shape()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn call(bindings: Vec<BindingSpec>) -> ActorCall {
        ActorCall {
            shader: ShaderSource::Wgsl("@compute @workgroup_size(1) fn main() {}".into()),
            entry_point: "main".into(),
            bindings,
            grid: Grid([1, 1, 1]),
            deadline_ms: None,
        }
    }

    #[test]
    fn names_are_short_and_plain() {
        check_name("counter-1.v2_x").unwrap();
        for bad in ["", "a b", "a/b", "é", &"x".repeat(MAX_ACTOR_NAME + 1)] {
            assert!(check_name(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn a_layout_has_buffers_of_whole_words_each_bound_once() {
        let s = |binding, size| StateBuffer { binding, size };
        check_layout(&[s(0, 4), s(3, 1024)]).unwrap();
        assert!(check_layout(&[]).is_err());
        assert!(check_layout(&[s(0, 4), s(0, 8)]).is_err());
        assert!(check_layout(&[s(0, 0)]).is_err());
        assert!(check_layout(&[s(0, 6)]).is_err());
    }

    #[test]
    fn a_call_runs_as_a_task_with_the_state_in_out_and_may_not_bind_over_it() {
        let layout = [StateBuffer {
            binding: 0,
            size: 16,
        }];
        let own = BindingSpec {
            binding: 1,
            role: BindingRole::Param { data: vec![0; 4] },
        };
        let c = call(vec![own.clone()]);
        c.check_shape(&layout).unwrap();
        let blob = BlobId::of(b"state");
        let task = c.as_task(&[(layout[0], Some(blob))]);
        assert_eq!(task.shards, 1);
        assert_eq!(task.bindings[0], own);
        assert_eq!(task.bindings[1].role, BindingRole::InOut { blob, size: 16 });
        // A state never written starts as zeros.
        let fresh = c.as_task(&[(layout[0], None)]);
        assert_eq!(fresh.bindings[1].role, BindingRole::Output { size: 16 });
        let over = call(vec![BindingSpec {
            binding: 0,
            role: BindingRole::Output { size: 4 },
        }]);
        let err = over.check_shape(&layout).unwrap_err().to_string();
        assert!(err.contains("binding 0 is the actor's state"), "{err}");
    }
}
