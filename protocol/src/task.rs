//! What a user asks the mesh to run.
//!
//! A [`TaskSpec`] names a WGSL shader (inline source or a built-in kernel), its entry
//! point, the buffers bound at `@group(0)`, the workgroup grid, how many shards to
//! split it into, and how shard outputs merge. Inputs are referenced by [`BlobId`]:
//! bulk data never travels inside a spec.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{ProtocolError, Result};
use crate::ids::BlobId;

/// Where the shader comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ShaderSource {
    /// WGSL source text, exactly as a WebGPU program would load it.
    Wgsl(String),
    /// A kernel from the built-in library, by name (e.g. `matmul`).
    Builtin(String),
}

/// One `@group(0) @binding(n)` resource of the task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BindingSpec {
    /// The `@binding(n)` number in `@group(0)`.
    pub binding: u32,
    pub role: BindingRole,
}

/// How a binding is filled and whether it comes back.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BindingRole {
    /// Read-only data (`var<storage, read>` or `var<uniform>`) held in a blob.
    Input { blob: BlobId, size: u64 },
    /// Small read-only parameters carried inline (at most [`MAX_INLINE_PARAM_BYTES`]).
    Param { data: Vec<u8> },
    /// A `var<storage, read_write>` buffer of `size` bytes that starts as zeros (or
    /// a reduction merge's identity) and is read back after the run.
    Output { size: u64 },
    /// A `var<storage, read_write>` buffer that starts as the bytes of a blob and is
    /// read back after the run: the kernel works on it in place.
    InOut { blob: BlobId, size: u64 },
}

impl BindingRole {
    /// The buffer's size in bytes.
    pub fn size(&self) -> u64 {
        match self {
            BindingRole::Input { size, .. }
            | BindingRole::Output { size }
            | BindingRole::InOut { size, .. } => *size,
            BindingRole::Param { data } => data.len() as u64,
        }
    }

    /// The blob the buffer is filled from, if any.
    pub fn blob(&self) -> Option<BlobId> {
        match self {
            BindingRole::Input { blob, .. } | BindingRole::InOut { blob, .. } => Some(*blob),
            _ => None,
        }
    }

    /// Whether the kernel writes it and it comes back: an output or an in-out buffer.
    pub fn is_writable(&self) -> bool {
        matches!(self, BindingRole::Output { .. } | BindingRole::InOut { .. })
    }
}

/// Inline parameters larger than this belong in a blob.
pub const MAX_INLINE_PARAM_BYTES: usize = 64 * 1024;

/// Element type of an elementwise merge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ElemType {
    U32,
    I32,
    F32,
}

impl ElemType {
    pub fn name(self) -> &'static str {
        match self {
            ElemType::U32 => "u32",
            ElemType::I32 => "i32",
            ElemType::F32 => "f32",
        }
    }
}

/// How the outputs of a task's shards combine into the task's outputs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MergeRule {
    /// The default. Every shard runs against the writable buffers as the unsharded
    /// run would see them; the words each shard changed are written into the
    /// starting buffer. Two shards changing one word to different values is a
    /// conflict and the task fails.
    #[default]
    Changes,
    /// Every shard writes a partial starting from 0; partials are summed elementwise.
    Sum(ElemType),
    /// Elementwise minimum of partials starting from the type's largest value.
    Min(ElemType),
    /// Elementwise maximum of partials starting from the type's smallest value.
    Max(ElemType),
    /// Bitwise or of partials starting from 0 (bits set with `atomicOr`). Integers
    /// only, as are the two below.
    Or(ElemType),
    /// Bitwise and of partials starting from all ones (`atomicAnd`).
    And(ElemType),
    /// Bitwise exclusive or of partials starting from 0 (`atomicXor`).
    Xor(ElemType),
}

impl MergeRule {
    /// The element type of a reduction; `None` for `changes`.
    pub fn elem(self) -> Option<ElemType> {
        match self {
            MergeRule::Changes => None,
            MergeRule::Sum(e)
            | MergeRule::Min(e)
            | MergeRule::Max(e)
            | MergeRule::Or(e)
            | MergeRule::And(e)
            | MergeRule::Xor(e) => Some(e),
        }
    }

    /// Whether it is a bitwise reduction (`or`, `and`, `xor`), which takes
    /// integers only.
    pub fn is_bitwise(self) -> bool {
        matches!(
            self,
            MergeRule::Or(_) | MergeRule::And(_) | MergeRule::Xor(_)
        )
    }
}

impl fmt::Display for MergeRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MergeRule::Changes => f.write_str("changes"),
            MergeRule::Sum(e) => write!(f, "sum-{}", e.name()),
            MergeRule::Min(e) => write!(f, "min-{}", e.name()),
            MergeRule::Max(e) => write!(f, "max-{}", e.name()),
            MergeRule::Or(e) => write!(f, "or-{}", e.name()),
            MergeRule::And(e) => write!(f, "and-{}", e.name()),
            MergeRule::Xor(e) => write!(f, "xor-{}", e.name()),
        }
    }
}

impl FromStr for MergeRule {
    type Err = ProtocolError;

    fn from_str(s: &str) -> Result<Self> {
        // `concat` is the rule's earlier name; every answer it gave, `changes` gives.
        if s == "changes" || s == "concat" {
            return Ok(MergeRule::Changes);
        }
        let invalid = || ProtocolError::Invalid {
            what: "merge rule",
            reason: format!(
                "{s:?}; use changes (the default), sum|min|max followed by -u32, -i32 or -f32 \
                 (e.g. sum-f32), or or|and|xor followed by -u32 or -i32 (e.g. or-u32)"
            ),
        };
        let (op, elem) = s.split_once('-').ok_or_else(invalid)?;
        let elem = match elem {
            "u32" => ElemType::U32,
            "i32" => ElemType::I32,
            "f32" => ElemType::F32,
            _ => return Err(invalid()),
        };
        match op {
            "sum" => Ok(MergeRule::Sum(elem)),
            "min" => Ok(MergeRule::Min(elem)),
            "max" => Ok(MergeRule::Max(elem)),
            "or" | "and" | "xor" if elem == ElemType::F32 => Err(invalid()),
            "or" => Ok(MergeRule::Or(elem)),
            "and" => Ok(MergeRule::And(elem)),
            "xor" => Ok(MergeRule::Xor(elem)),
            _ => Err(invalid()),
        }
    }
}

/// A workgroup grid: how many workgroups along x, y and z.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Grid(pub [u32; 3]);

impl Grid {
    /// Workgroups in all, x·y·z; `u64::MAX` when that does not fit (three large
    /// dimensions reach 2^96), so a huge grid stays huge and over any limit instead
    /// of wrapping around to a small one.
    pub fn total(&self) -> u64 {
        self.0
            .iter()
            .fold(1u64, |n, &d| n.saturating_mul(u64::from(d)))
    }
}

impl fmt::Display for Grid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{},{},{}", self.0[0], self.0[1], self.0[2])
    }
}

impl FromStr for Grid {
    type Err = ProtocolError;

    /// Parses `X`, `X,Y` or `X,Y,Z`; missing dimensions are 1.
    fn from_str(s: &str) -> Result<Self> {
        let invalid = |reason: String| ProtocolError::Invalid {
            what: "grid",
            reason,
        };
        let parts: Vec<&str> = s.split(',').map(str::trim).collect();
        if parts.is_empty() || parts.len() > 3 {
            return Err(invalid(format!("{s:?}; expected X[,Y[,Z]]")));
        }
        let mut dims = [1u32; 3];
        for (dim, part) in dims.iter_mut().zip(&parts) {
            *dim = part
                .parse()
                .map_err(|_| invalid(format!("{part:?} in {s:?} is not a whole number")))?;
            if *dim == 0 {
                return Err(invalid(format!("{s:?} has a zero dimension")));
            }
        }
        Ok(Grid(dims))
    }
}

/// Everything needed to run one task, apart from the input blobs themselves.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskSpec {
    pub shader: ShaderSource,
    pub entry_point: String,
    pub bindings: Vec<BindingSpec>,
    pub grid: Grid,
    /// How many shards the grid is split into (1 = unsharded).
    pub shards: u32,
    /// How every writable binding's shard results merge…
    pub merge: MergeRule,
    /// …except the bindings named here (an atomic total summed beside outputs
    /// merged by changes, say).
    #[serde(default)]
    pub merges: std::collections::BTreeMap<u32, MergeRule>,
    #[serde(default)]
    pub options: TaskOptions,
}

/// The most nodes one shard may run on for verification.
pub const MAX_REPLICAS: u32 = 3;

/// The longest deadline a task may ask for: one day.
pub const MAX_DEADLINE_MS: u64 = 24 * 60 * 60 * 1000;

/// How a task is run and checked, beyond what it computes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskOptions {
    /// Nodes each shard runs on (1 to [`MAX_REPLICAS`]). With 2 or more, the outputs
    /// are compared before a result is accepted; a disagreement brings in one more
    /// node and the majority wins.
    pub replicas: u32,
    /// How replica outputs are compared: `None` bit for bit (integer outputs),
    /// `Some(r)` as f32 values equal within relative tolerance `r`
    /// (|a − b| ≤ r · max(|a|, |b|, 1e-30)).
    pub tolerance: Option<f32>,
    /// How long one shard may run on a GPU before it is stopped and the task fails
    /// (a shader that never ends); `None` uses the node's default.
    pub deadline_ms: Option<u64>,
}

impl Default for TaskOptions {
    fn default() -> Self {
        TaskOptions {
            replicas: 1,
            tolerance: None,
            deadline_ms: None,
        }
    }
}

impl TaskOptions {
    /// Whether two outputs of the same shard agree under these options.
    pub fn agree(&self, a: &[u8], b: &[u8]) -> bool {
        values_agree(a, b, self.tolerance)
    }
}

/// Whether two byte strings are equal, or (with a tolerance) equal as f32 values
/// within the relative tolerance: |a − b| ≤ r · max(|a|, |b|, 1e-30).
pub(crate) fn values_agree(a: &[u8], b: &[u8], tolerance: Option<f32>) -> bool {
    match tolerance {
        None => a == b,
        Some(tol) => {
            a.len() == b.len()
                && a.len().is_multiple_of(4)
                && a.chunks_exact(4).zip(b.chunks_exact(4)).all(|(x, y)| {
                    let x = f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
                    let y = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
                    x.to_bits() == y.to_bits()
                        || (x - y).abs() <= tol * x.abs().max(y.abs()).max(1e-30)
                })
        }
    }
}

impl TaskSpec {
    /// Bytes of all its bindings together.
    pub fn binding_bytes(&self) -> u64 {
        self.bindings.iter().map(|b| b.role.size()).sum()
    }

    /// Bytes of its writable bindings (outputs and in-out buffers) together.
    pub fn writable_bytes(&self) -> u64 {
        let writable = self.bindings.iter().filter(|b| b.role.is_writable());
        writable.map(|b| b.role.size()).sum()
    }

    /// The merge rule of writable binding `binding`.
    pub fn merge_of(&self, binding: u32) -> MergeRule {
        self.merges.get(&binding).copied().unwrap_or(self.merge)
    }

    /// Every merge rule in use, for display: `changes`, or `changes, 2=sum-u32`.
    pub fn merge_label(&self) -> String {
        let mut label = self.merge.to_string();
        for (binding, rule) in &self.merges {
            label.push_str(&format!(", {binding}={rule}"));
        }
        label
    }

    /// A stable hash of the spec, for deduplication and the replicated record.
    pub fn hash(&self) -> Result<[u8; 32]> {
        Ok(*blake3::hash(&crate::codec::to_bytes(self)?).as_bytes())
    }

    /// Structural checks that need no shader or adapter: non-empty grid, at least one
    /// shard and one output, unique binding numbers, bounded inline parameters.
    pub fn check_shape(&self) -> Result<()> {
        let invalid = |reason: String| ProtocolError::Invalid {
            what: "task",
            reason,
        };
        if self.grid.0.contains(&0) {
            return Err(invalid(format!("grid {} has a zero dimension", self.grid)));
        }
        if self.shards == 0 {
            return Err(invalid("shard count must be at least 1".into()));
        }
        if !(1..=MAX_REPLICAS).contains(&self.options.replicas) {
            return Err(invalid(format!(
                "replicas {} is outside 1..={MAX_REPLICAS}",
                self.options.replicas
            )));
        }
        if let Some(t) = self.options.tolerance {
            if !(t.is_finite() && (0.0..1.0).contains(&t)) {
                return Err(invalid(format!(
                    "tolerance {t} must be a relative error in [0, 1)"
                )));
            }
        }
        match self.options.deadline_ms {
            Some(0) => return Err(invalid("deadline must be more than 0 ms".into())),
            Some(ms) if ms > MAX_DEADLINE_MS => {
                return Err(invalid(format!(
                    "deadline {ms} ms is over the maximum of {MAX_DEADLINE_MS} ms (24 h)"
                )))
            }
            _ => {}
        }
        if self.entry_point.is_empty() {
            return Err(invalid("entry point name is empty".into()));
        }
        let mut seen = std::collections::BTreeSet::new();
        let mut outputs = 0;
        for b in &self.bindings {
            if !seen.insert(b.binding) {
                return Err(invalid(format!("binding {} is given twice", b.binding)));
            }
            match &b.role {
                BindingRole::Output { size } | BindingRole::InOut { size, .. } => {
                    outputs += 1;
                    if *size == 0 {
                        return Err(invalid(format!("output binding {} has size 0", b.binding)));
                    }
                }
                BindingRole::Param { data } if data.len() > MAX_INLINE_PARAM_BYTES => {
                    return Err(invalid(format!(
                        "inline parameters of binding {} are {} bytes; the limit is {} \
                         (pass larger data as an input blob)",
                        b.binding,
                        data.len(),
                        MAX_INLINE_PARAM_BYTES
                    )));
                }
                _ => {}
            }
        }
        for &binding in self.merges.keys() {
            if !self
                .bindings
                .iter()
                .any(|b| b.binding == binding && b.role.is_writable())
            {
                return Err(invalid(format!(
                    "a merge rule names binding {binding}, which is not an output or in-out \
                     binding of the task"
                )));
            }
        }
        if outputs == 0 {
            return Err(invalid(
                "the task has no output binding (give --output BINDING:BYTES or --inout \
                 BINDING=FILE)"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// Where a task stands, as the API, the CLI and the dashboard say it (lowercase in
/// JSON). Why a task failed or was cancelled travels beside it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskState {
    /// No shard has been assigned yet.
    Pending,
    /// Some shard is assigned, running or done; not all are done.
    Running,
    /// Every one of its several shards has a result; the leader is merging them.
    Merging,
    Completed,
    Failed,
    Cancelled,
}

impl TaskState {
    /// Every state, in the order a task goes through them.
    pub const ALL: [TaskState; 6] = [
        TaskState::Pending,
        TaskState::Running,
        TaskState::Merging,
        TaskState::Completed,
        TaskState::Failed,
        TaskState::Cancelled,
    ];

    pub fn name(self) -> &'static str {
        match self {
            TaskState::Pending => "pending",
            TaskState::Running => "running",
            TaskState::Merging => "merging",
            TaskState::Completed => "completed",
            TaskState::Failed => "failed",
            TaskState::Cancelled => "cancelled",
        }
    }

    /// Whether the task will change no more.
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            TaskState::Completed | TaskState::Failed | TaskState::Cancelled
        )
    }
}

impl fmt::Display for TaskState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}
