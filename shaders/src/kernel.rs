//! A WGSL compute kernel, parsed and validated by naga, with its declared interface.
//!
//! Validation happens here, before any GPU call, so a bad shader is rejected with a
//! line and column on whichever peer sees it first. [`Kernel::check`] then holds a
//! [`TaskSpec`] against what the shader declares: every binding present, of the right
//! access mode and a size the declared type accepts, a merge rule the outputs'
//! element type supports, and (for more than one shard) nothing that makes the shards'
//! results unmergeable: atomics under the `changes` merge, or an in-out buffer under a
//! reduction.

use std::collections::{BTreeMap, BTreeSet};

use gpumesh_protocol::{
    AdapterLimits, BindingRole, ElemType, KernelNeeds, MergeRule, ShaderSource, TaskSpec,
};
use naga::valid::{Capabilities, ModuleInfo, ValidationFlags, Validator};

pub use crate::atomic_ops::{AtomicOp, AtomicWords, Combine};
use crate::builtins::sources;
use crate::error::{ExecError, Result};
use crate::shard::{self, ShardRange};

/// How the shader declares a `@group(0)` binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Uniform,
    ReadOnly,
    ReadWrite,
}

impl Access {
    fn wgsl(self) -> &'static str {
        match self {
            Access::Uniform => "var<uniform>",
            Access::ReadOnly => "var<storage, read>",
            Access::ReadWrite => "var<storage, read_write>",
        }
    }
}

/// A `@group(0)` buffer as the shader declares it.
#[derive(Clone, Debug)]
pub struct DeclaredBinding {
    pub binding: u32,
    pub name: Option<String>,
    pub access: Access,
    /// Bytes of the fixed-size part of the type.
    pub fixed_size: u64,
    /// Element stride of a trailing runtime-sized array, if the type ends in one.
    pub stride: Option<u64>,
    /// The scalar the buffer holds (array element or struct tail), if it is one of
    /// the merge element types.
    pub elem: Option<ElemType>,
    /// Whether that scalar is `atomic<u32>`/`atomic<i32>`.
    pub atomic: bool,
    /// Whether the type holds an atomic anywhere (a counter beside an array, say).
    pub has_atomics: bool,
    /// Whether the kernel writes it at slots an atomic hands out (an append: see
    /// [`crate::slots`]); such a buffer cannot be split into shards.
    pub appended: bool,
    /// Whether the kernel writes it with a value an atomic on a buffer answered, or
    /// only where one said so (the last workgroup to finish sums the partials of
    /// all: see [`crate::slots`]); such a buffer cannot be split into shards either.
    pub steered: bool,
    /// The atomic functions the kernel applies to it (see `crate::atomic_ops`): a
    /// reduction must fold what they compute.
    pub atomic_ops: BTreeSet<AtomicOp>,
    /// Which of its words hold atomics: under a reduction those hold partials,
    /// the others values plain stores set.
    pub atomic_words: AtomicWords,
}

impl DeclaredBinding {
    /// Whether a buffer of `size` bytes fits the declared type.
    fn accepts(&self, size: u64) -> std::result::Result<(), String> {
        let ty = format!(
            "{} {}",
            self.access.wgsl(),
            self.name.as_deref().unwrap_or("_")
        );
        match self.stride {
            Some(stride) => {
                if size < self.fixed_size + stride {
                    return Err(format!(
                        "{size} bytes is too small for {ty}, which needs at least {} bytes",
                        self.fixed_size + stride
                    ));
                }
                if !(size - self.fixed_size).is_multiple_of(stride) {
                    return Err(format!(
                        "{size} bytes is not a whole number of {stride}-byte elements of {ty}"
                    ));
                }
            }
            None if size < self.fixed_size => {
                return Err(format!(
                    "{size} bytes is too small for {ty}, which is {} bytes",
                    self.fixed_size
                ));
            }
            None => {}
        }
        Ok(())
    }
}

/// The entry point's side of the contract.
#[derive(Clone, Debug)]
pub struct Interface {
    pub entry_point: String,
    pub workgroup_size: [u32; 3],
    /// Bytes of workgroup memory the entry point uses, counted as WebGPU counts
    /// them against `maxComputeWorkgroupStorageSize`: each `var<workgroup>` it uses
    /// rounded up to 16 bytes.
    pub workgroup_memory: u64,
    /// `@group(0)` buffers the entry point uses, by binding number.
    pub bindings: BTreeMap<u32, DeclaredBinding>,
}

impl Interface {
    /// Which words of `binding` hold atomics (see [`DeclaredBinding::atomic_words`]).
    pub fn atomic_words(&self, binding: u32) -> Option<&AtomicWords> {
        self.bindings.get(&binding).map(|d| &d.atomic_words)
    }
}

/// A validated kernel, ready to be instrumented for sharded dispatch.
pub struct Kernel {
    /// blake3 of the source and entry point: the pipeline cache key.
    pub hash: [u8; 32],
    pub interface: Interface,
    /// The module rewritten so every dispatch sees full-grid builtins (see [`shard`]).
    pub(crate) instrumented: naga::Module,
    /// The same, also counting loop turns (see [`crate::turns`]), when the shader
    /// has loops: what runs on an adapter that ends loops early.
    pub(crate) counted: Option<naga::Module>,
}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernel")
            .field("hash", &blake3::Hash::from_bytes(self.hash).to_hex())
            .field("interface", &self.interface)
            .finish_non_exhaustive()
    }
}

/// The `@group` the executor binds shard offsets at; user resources live in group 0.
pub(crate) const SHARD_INFO_GROUP: u32 = 1;

impl Kernel {
    /// The entry point to run when none is named: the shader's one compute entry
    /// point, whatever it is called (`computeSomething`, `cs_main`), or `main`
    /// among several. Several without a `main` is an error naming them. A shader
    /// that does not parse, or has none, gets `main`, and compiling it says why.
    pub fn entry_point_of(source: &str) -> Result<String> {
        const MAIN: &str = "main";
        let Ok(module) = naga::front::wgsl::parse_str(source) else {
            return Ok(MAIN.into());
        };
        match compute_entry_points(&module).as_slice() {
            [one] => Ok(one.clone()),
            [] => Ok(MAIN.into()),
            many if many.iter().any(|n| n == MAIN) => Ok(MAIN.into()),
            many => Err(ExecError::Unsupported(format!(
                "the shader has {} compute entry points ({}); name the one to run \
                 (--entry NAME, or entry_point in the API)",
                many.len(),
                many.join(", ")
            ))),
        }
    }

    /// Parses, validates and instruments `source`.
    pub fn compile(source: &str, entry_point: &str) -> Result<Self> {
        let module = naga::front::wgsl::parse_str(source).map_err(|e| {
            let loc = e.location(source);
            ExecError::Shader {
                line: loc.map_or(0, |l| l.line_number),
                column: loc.map_or(0, |l| l.line_position),
                message: e.message().to_string(),
                rendered: e.emit_to_string(source),
            }
        })?;
        refuse_binding_arrays(&module)?;
        let info = validate(&module).map_err(|e| {
            let loc = e.location(source);
            let mut message = error_chain(e.as_inner());
            if let Some(what) = optional_feature(&message) {
                message = format!(
                    "the kernel uses {what}, an optional WebGPU feature that not every \
                     adapter has; gpumesh runs kernels of core WGSL, which every node of a \
                     mesh can run ({message})"
                );
            }
            ExecError::Shader {
                line: loc.map_or(0, |l| l.line_number),
                column: loc.map_or(0, |l| l.line_position),
                message,
                rendered: e.emit_to_string(source),
            }
        })?;
        let (module, info) = with_overrides_resolved(module, info, entry_point)?;
        let (interface, workgroup_vars) = reflect(&module, &info, entry_point)?;
        let mut instrumented = shard::instrument(&module, entry_point, SHARD_INFO_GROUP)?;
        crate::zero::zero_workgroup_memory(&mut instrumented, &workgroup_vars)?;
        validate(&instrumented).map_err(|e| {
            ExecError::Unsupported(format!(
                "the shader could not be prepared for sharded dispatch: {}",
                error_chain(e.as_inner())
            ))
        })?;
        let counted = if crate::turns::has_loops(&module) {
            let counted = crate::turns::count(
                &instrumented,
                SHARD_INFO_GROUP,
                crate::turns::Counting {
                    all: true,
                    bound: None,
                    workgroup_room: true,
                },
            )?;
            validate(&counted).map_err(|e| {
                ExecError::Unsupported(format!(
                    "the shader's loops could not be counted: {}",
                    error_chain(e.as_inner())
                ))
            })?;
            Some(counted)
        } else {
            None
        };
        let mut hasher = blake3::Hasher::new();
        hasher.update(source.as_bytes());
        hasher.update(&[0]);
        hasher.update(entry_point.as_bytes());
        Ok(Kernel {
            hash: *hasher.finalize().as_bytes(),
            interface,
            instrumented,
            counted,
        })
    }

    /// The module whose loops stop once an invocation's turns reach `bound`
    /// (counted whole as a loop starts where [`crate::turns::counted_loop`] knows
    /// them then, one by one otherwise), counting every loop's turns one by one
    /// too with `all` (see [`crate::turns`]): what runs where a bound applies.
    /// `workgroup_memory`: the adapter's limit, to tell whether the workgroup has
    /// room for its count of turns. `Ok(None)` when the shader has no loops.
    pub(crate) fn bounded(
        &self,
        bound: u32,
        all: bool,
        workgroup_memory: u64,
    ) -> Result<Option<naga::Module>> {
        if self.counted.is_none() {
            return Ok(None);
        }
        let counting = crate::turns::Counting {
            all,
            bound: Some(bound),
            workgroup_room: self.interface.workgroup_memory + WORKGROUP_ROUNDING
                <= workgroup_memory,
        };
        let bounded = crate::turns::count(&self.instrumented, SHARD_INFO_GROUP, counting)?;
        validate(&bounded).map_err(|e| {
            ExecError::Unsupported(format!(
                "the shader's loops could not be bounded: {}",
                error_chain(e.as_inner())
            ))
        })?;
        Ok(Some(bounded))
    }

    /// Compiles a task's shader, inline or built-in.
    pub fn for_source(shader: &ShaderSource, entry_point: &str) -> Result<Self> {
        match shader {
            ShaderSource::Wgsl(source) => Self::compile(source, entry_point),
            ShaderSource::Builtin(name) => Self::compile(sources::source(name)?, entry_point),
        }
    }

    /// What the kernel asks of an adapter besides room for its buffers.
    pub fn needs(&self) -> KernelNeeds {
        KernelNeeds {
            workgroup_size: self.interface.workgroup_size,
            workgroup_memory: self.interface.workgroup_memory,
        }
    }

    /// Checks `spec` run with this kernel against an adapter's `limits`: its
    /// workgroup's size and memory, its buffers' sizes and how many it binds.
    pub fn fits(&self, spec: &TaskSpec, limits: &AdapterLimits) -> Result<()> {
        let l = limits;
        if let Some(e) = self.needs().exceeds(l) {
            return Err(ExecError::Limit {
                what: e.what,
                value: e.value,
                limit: e.limit,
            });
        }
        let mut storage = 0u64;
        for b in &spec.bindings {
            let size = b.role.size();
            let access = self.interface.bindings.get(&b.binding).map(|d| d.access);
            let (kind, limit) = match access {
                Some(Access::Uniform) => ("uniform", u64::from(l.max_uniform_buffer_binding_size)),
                _ => {
                    storage += 1;
                    ("storage", u64::from(l.max_storage_buffer_binding_size))
                }
            };
            let limit = limit.min(l.max_buffer_size);
            if size > limit {
                return Err(ExecError::Limit {
                    what: format!("binding {} ({kind} buffer) size in bytes", b.binding),
                    value: size,
                    limit,
                });
            }
        }
        if storage > u64::from(l.max_storage_buffers_per_shader_stage) {
            return Err(ExecError::Limit {
                what: "storage buffers".into(),
                value: storage,
                limit: l.max_storage_buffers_per_shader_stage.into(),
            });
        }
        Ok(())
    }

    /// Holds `spec` against the shader and returns its shard plan. Adapter limits are
    /// checked separately, by the executor that will run it.
    pub fn check(&self, spec: &TaskSpec) -> Result<Vec<ShardRange>> {
        let iface = &self.interface;
        for b in &spec.bindings {
            let declared = iface
                .bindings
                .get(&b.binding)
                .ok_or_else(|| ExecError::Binding {
                    binding: b.binding,
                    problem: format!(
                        "entry point {:?} uses no @group(0) @binding({}); it uses {}",
                        iface.entry_point,
                        b.binding,
                        list(iface.bindings.keys())
                    ),
                })?;
            let (size, is_output) = (b.role.size(), b.role.is_writable());
            match (is_output, declared.access) {
                (true, Access::ReadWrite) | (false, Access::ReadOnly | Access::Uniform) => {}
                (true, access) => {
                    return Err(ExecError::Binding {
                        binding: b.binding,
                        problem: format!(
                            "given as an output but declared {}; outputs and in-out buffers \
                             must be var<storage, read_write> (pass it with --input instead)",
                            access.wgsl()
                        ),
                    })
                }
                (false, access) => {
                    return Err(ExecError::Binding {
                        binding: b.binding,
                        problem: format!(
                            "given as an input but declared {}; pass it with --inout \
                             {}=FILE (it starts as the file and comes back as an output), or \
                             declare it var<storage, read>",
                            access.wgsl(),
                            b.binding
                        ),
                    })
                }
            }
            declared
                .accepts(size)
                .map_err(|problem| ExecError::Binding {
                    binding: b.binding,
                    problem,
                })?;
            if size % 4 != 0 {
                return Err(ExecError::Binding {
                    binding: b.binding,
                    problem: format!("{size} bytes is not a multiple of 4"),
                });
            }
            if is_output {
                let rule = spec.merge_of(b.binding);
                if rule.is_bitwise() && rule.elem() == Some(ElemType::F32) {
                    return Err(ExecError::Binding {
                        binding: b.binding,
                        problem: format!(
                            "merge {rule} is bitwise, and bitwise merges take u32 or i32 \
                             elements"
                        ),
                    });
                }
                if let Some(want) = rule.elem() {
                    // atomic<u32> holding f32 bit patterns is the WGSL idiom for
                    // float atomics (a compare-exchange loop), so it may merge as f32.
                    let float_atomic = want == ElemType::F32
                        && declared.atomic
                        && declared.elem == Some(ElemType::U32);
                    if declared.elem != Some(want) && !float_atomic {
                        return Err(ExecError::Binding {
                            binding: b.binding,
                            problem: format!(
                                "merge {} needs {} elements but the shader declares {}",
                                rule,
                                want.name(),
                                declared
                                    .elem
                                    .map_or("words of another or of mixed types", ElemType::name)
                            ),
                        });
                    }
                }
            }
        }
        spec.check_shape()?;
        for &binding in iface.bindings.keys() {
            if !spec.bindings.iter().any(|b| b.binding == binding) {
                return Err(ExecError::Binding {
                    binding,
                    problem: format!(
                        "the shader uses it but the task does not provide it; pass \
                         --input {binding}=FILE, --inout {binding}=FILE or --output \
                         {binding}:BYTES"
                    ),
                });
            }
        }
        for (axis, (&groups, &size)) in spec.grid.0.iter().zip(&iface.workgroup_size).enumerate() {
            if u64::from(groups) * u64::from(size) > u64::from(u32::MAX) {
                return Err(ExecError::Task(format!(
                    "grid dimension {} ({groups} workgroups of {size}) overflows the 32-bit \
                     global_invocation_id",
                    ["x", "y", "z"][axis]
                )));
            }
        }
        let plan = shard::plan(spec.grid, spec.shards)?;
        if plan.len() > 1 {
            self.check_splittable(spec)?;
        }
        Ok(plan)
    }

    /// What makes a kernel's writable buffers impossible to merge from shards without
    /// risking an answer that differs from the unsharded one.
    fn check_splittable(&self, spec: &TaskSpec) -> Result<()> {
        let writable = || {
            spec.bindings
                .iter()
                .filter(|b| b.role.is_writable())
                .filter_map(|b| {
                    let declared = self.interface.bindings.get(&b.binding)?;
                    Some((b, declared, declared.name.as_deref().unwrap_or("_")))
                })
        };
        // First: no merge rule helps here, so it is the one thing to say.
        if let Some((b, _, name)) = writable().find(|(_, d, _)| d.appended) {
            return Err(ExecError::Unsplittable(format!(
                "binding {binding} ({name}) is written at slots an atomic hands out (an append: \
                 `out[atomicAdd(&count, 1u)] = ...`): every shard's counter starts from the same \
                 value, so shards would write the same slots and one shard's entries would hide \
                 another's, whatever the merge. Run it with --shards 1",
                binding = b.binding
            )));
        }
        if let Some((b, _, name)) = writable().find(|(_, d, _)| d.steered) {
            return Err(ExecError::Unsplittable(format!(
                "binding {binding} ({name}) is written with what an atomic on a buffer \
                 answered, or only where one said so (the last workgroup to finish sums \
                 the others' partials: `if (atomicAdd(&done, 1u) == last) {{ ... }}`): a \
                 shard sees only its own workgroups' updates, so split, the answer would \
                 not be the one the whole grid gives, whatever the merge. Run it with \
                 --shards 1",
                binding = b.binding
            )));
        }
        for (b, declared, name) in writable() {
            let rule = spec.merge_of(b.binding);
            match (rule, &b.role) {
                // Shards counting from the same start would each report their own
                // count: equal counts look like agreement and the total is lost.
                (MergeRule::Changes, _) if declared.has_atomics => {
                    return Err(ExecError::Unsplittable(format!(
                        "binding {binding} ({name}) is updated with atomics, and shards that \
                         each start from the same counter or bins cannot be merged word by \
                         word. Run it with --shards 1; if the binding holds sums, minima, \
                         maxima or bits (a histogram, a total, a bitset), merge it with a \
                         reduction: --merge {binding}=sum|min|max|or|and|xor-u32|i32|f32",
                        binding = b.binding
                    )));
                }
                (rule, BindingRole::InOut { .. }) if rule != MergeRule::Changes => {
                    return Err(ExecError::Unsplittable(format!(
                        "binding {} ({name}) is an in-out buffer, but merge {} combines \
                         partials that each start from the reduction's identity, not from \
                         the file. Pass it with --output (it then starts from the identity), \
                         use the default merge, or run it with --shards 1",
                        b.binding, rule
                    )));
                }
                _ => {}
            }
            if let Some(refusal) = unfolded(b.binding, name, rule, declared) {
                return Err(refusal);
            }
        }
        Ok(())
    }
}

/// Whether merge `rule` folds the partials that atomic `op` left in each shard into
/// what `op` leaves over the whole grid. `float_bits`: the buffer holds f32 bit
/// patterns in `atomic<u32>`, which an integer function would treat as integers.
fn folds(rule: MergeRule, float_bits: bool, op: AtomicOp) -> bool {
    use AtomicOp as A;
    // Setting a word (a flag) gives the same word whichever shard's is kept.
    let sets = matches!(op, A::Store | A::Exchange | A::Claim);
    match rule {
        // `changes` takes no atomics at all; a compare-exchange whose operation is
        // not seen ([`AtomicOp::CompareExchange`]), or that keeps an index
        // ([`AtomicOp::IndexExchange`]), folds under no rule.
        MergeRule::Changes => false,
        // A loop computes on the value as the kernel casts it (floats, say).
        MergeRule::Sum(_) => {
            op == A::Loop(Combine::Add) || !float_bits && matches!(op, A::Add | A::Sub)
        }
        MergeRule::Min(_) => sets || op == A::Loop(Combine::Min) || (!float_bits && op == A::Min),
        MergeRule::Max(_) => sets || op == A::Loop(Combine::Max) || (!float_bits && op == A::Max),
        MergeRule::Or(_) => matches!(op, A::Or | A::Loop(Combine::Or)),
        MergeRule::And(_) => matches!(op, A::And | A::Loop(Combine::And)),
        MergeRule::Xor(_) => matches!(op, A::Xor | A::Loop(Combine::Xor)),
    }
}

/// The refusal of a reduction that does not fold an atomic function the kernel
/// applies to the binding (a maximum kept with `atomicMax`, merged with `sum`:
/// the sum of every shard's maximum), naming a rule that would fold them all.
fn unfolded(
    binding: u32,
    name: &str,
    rule: MergeRule,
    declared: &DeclaredBinding,
) -> Option<ExecError> {
    let elem = rule.elem()?;
    let float_bits =
        elem == ElemType::F32 && declared.atomic && declared.elem == Some(ElemType::U32);
    let ops = &declared.atomic_ops;
    let op = *ops.iter().find(|&&op| !folds(rule, float_bits, op))?;
    if op == AtomicOp::IndexExchange {
        return Some(ExecError::Unsplittable(format!(
            "binding {binding} ({name}) holds an index kept with a compare-exchange by the \
             value it points at (values[old], as an argmin or argmax keeps it), so no merge \
             rule folds what it left in each shard into what it leaves over the whole grid \
             ({rule} included): each shard's index is the best of its own part, and which \
             of them is best is for their values to say, not the indices as numbers. Find \
             it in two runs that split: the least (or greatest) value first (atomicMin or \
             atomicMax of a u32 that orders as the values do, or a compare-exchange loop \
             that keeps it, under --merge {binding}=min-… or max-…), then the least index \
             holding that value (atomicMin of i where values[i] equals it, under --merge \
             {binding}=min-u32); or run it with --shards 1"
        )));
    }
    if op == AtomicOp::CompareExchange {
        // No rule folds it, whichever was asked for.
        return Some(ExecError::Unsplittable(format!(
            "binding {binding} ({name}) is updated with a compare-exchange whose new value \
             is not seen to be one operation on the old value (as old + v or max(old, v) \
             are), nor a value swapped in once it beats the old one, so no merge rule \
             folds what it left in each shard into what it leaves over the whole grid \
             ({rule} included). Write the exchange's new value as one operation on the \
             old one in the call (bitcast<u32>(bitcast<f32>(old) + v), max(old, v)), or \
             leave the loop once the old value wins (bitcast<f32>(old) >= v) and swap v \
             in; or run it with --shards 1"
        )));
    }
    let what = match rule {
        _ if float_bits
            && matches!(
                op,
                AtomicOp::Add
                    | AtomicOp::Sub
                    | AtomicOp::Min
                    | AtomicOp::Max
                    | AtomicOp::And
                    | AtomicOp::Or
                    | AtomicOp::Xor
            ) =>
        {
            return Some(ExecError::Unsplittable(format!(
                "binding {binding} ({name}) holds f32 bit patterns in atomic<u32> and is \
                 updated with {op}, which works on them as integers, while merge {rule} \
                 folds them as floats: split, the answer would not be the one the whole \
                 grid gives. Run it with --shards 1"
            )))
        }
        MergeRule::Sum(_) => "adds the shards' partials up: split, the answer would be the sum",
        MergeRule::Min(_) => {
            "keeps the least of the shards' partials: split, the answer would be the least"
        }
        MergeRule::Max(_) => {
            "keeps the greatest of the shards' partials: split, the answer would be the greatest"
        }
        MergeRule::Or(_) => "ors the shards' partials together: split, the answer would be the or",
        MergeRule::And(_) => {
            "ands the shards' partials together: split, the answer would be the and"
        }
        MergeRule::Xor(_) => {
            "xors the shards' partials together: split, the answer would be the xor"
        }
        MergeRule::Changes => return None,
    };
    let fix = [
        MergeRule::Sum(elem),
        MergeRule::Min(elem),
        MergeRule::Max(elem),
        MergeRule::Or(elem),
        MergeRule::And(elem),
        MergeRule::Xor(elem),
    ]
    .into_iter()
    .filter(|r| !(r.is_bitwise() && elem == ElemType::F32))
    .find(|&r| ops.iter().all(|&op| folds(r, float_bits, op)));
    let fix = match fix {
        Some(r) => format!("Merge it with --merge {binding}={r}, or run it with --shards 1"),
        // Several functions no one rule folds (a count and a maximum in one struct).
        None if ops.len() > 1 => {
            let names: Vec<String> = ops.iter().map(AtomicOp::to_string).collect();
            format!(
                "It is updated with {}: give the words each updates a binding of its own, \
                 merged by its own rule (--merge BINDING=RULE), or run it with --shards 1",
                names.join(", ")
            )
        }
        None => "Run it with --shards 1".to_string(),
    };
    Some(ExecError::Unsplittable(format!(
        "binding {binding} ({name}) is updated with {op}, and merge {rule} {what} of what \
         {op} left in each shard, not what it leaves over the whole grid. {fix}"
    )))
}

fn list<'a>(items: impl Iterator<Item = &'a u32>) -> String {
    let v: Vec<String> = items.map(u32::to_string).collect();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

fn validate(
    module: &naga::Module,
) -> std::result::Result<ModuleInfo, Box<naga::WithSpan<naga::valid::ValidationError>>> {
    Validator::new(ValidationFlags::all(), Capabilities::default())
        .validate(module)
        .map_err(Box::new)
}

/// Refuses a `binding_array` (several buffers in one binding, as wgpu's example of
/// buffers past the size limit uses) by name: the validator would say only that a
/// type is invalid, without where.
fn refuse_binding_arrays(module: &naga::Module) -> Result<()> {
    for (_, var) in module.global_variables.iter() {
        if let naga::TypeInner::BindingArray { .. } = module.types[var.ty].inner {
            let name = var.name.as_deref().unwrap_or("_");
            let problem = format!(
                "({name}) is a binding_array, an optional WebGPU feature; gpumesh binds one \
                 buffer per binding: give each buffer a @binding of its own"
            );
            return Err(match &var.binding {
                Some(rb) => ExecError::Binding {
                    binding: rb.binding,
                    problem,
                },
                None => ExecError::Unsupported(format!("{name} {problem}")),
            });
        }
    }
    Ok(())
}

/// The optional WebGPU feature a validation error says a kernel needs, named as
/// WGSL names it, if it is one.
fn optional_feature(message: &str) -> Option<&'static str> {
    [
        ("FLOAT16", "f16 (`enable f16;`)"),
        (
            "SUBGROUP",
            "subgroup operations (`subgroupAdd`, `subgroup_invocation_id`, ...)",
        ),
        ("SHADER_INT64", "64-bit integers"),
        ("FLOAT64", "f64"),
        ("DUAL_SOURCE_BLENDING", "dual-source blending"),
    ]
    .into_iter()
    .find(|(flag, _)| message.contains(flag))
    .map(|(_, what)| what)
}

/// An error and its sources, one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// `module` with its pipeline-overridable constants (`override`) at their
/// defaults, `@workgroup_size` included, for the entry point: a task sets none of
/// them. Unchanged where it has none (or no such compute entry point, which
/// [`reflect`] reports).
fn with_overrides_resolved(
    module: naga::Module,
    info: ModuleInfo,
    entry_point: &str,
) -> Result<(naga::Module, ModuleInfo)> {
    let compute = module
        .entry_points
        .iter()
        .any(|ep| ep.name == entry_point && ep.stage == naga::ShaderStage::Compute);
    if module.overrides.is_empty() || !compute {
        return Ok((module, info));
    }
    let no_values = naga::back::PipelineConstants::default();
    let (resolved, resolved_info) = naga::back::pipeline_constants::process_overrides(
        &module,
        &info,
        Some((naga::ShaderStage::Compute, entry_point)),
        &no_values,
    )
    .map_err(|e| match e {
        naga::back::pipeline_constants::PipelineConstantError::MissingValue(name) => {
            ExecError::Unsupported(format!(
                "override {name} has no default value, and a task cannot set one; \
                 give it a default (override {name}: u32 = 64u;) or make it a const"
            ))
        }
        other => ExecError::Unsupported(format!("the shader's overrides: {other}")),
    })?;
    Ok((resolved.into_owned(), resolved_info.into_owned()))
}

/// The names of `module`'s compute entry points.
fn compute_entry_points(module: &naga::Module) -> Vec<String> {
    module
        .entry_points
        .iter()
        .filter(|ep| ep.stage == naga::ShaderStage::Compute)
        .map(|ep| ep.name.clone())
        .collect()
}

/// The entry point's interface, and the workgroup variables it uses.
fn reflect(
    module: &naga::Module,
    info: &ModuleInfo,
    entry_point: &str,
) -> Result<(Interface, Vec<naga::Handle<naga::GlobalVariable>>)> {
    let (index, ep) = module
        .entry_points
        .iter()
        .enumerate()
        .find(|(_, ep)| ep.name == entry_point && ep.stage == naga::ShaderStage::Compute)
        .ok_or_else(|| ExecError::MissingEntryPoint {
            name: entry_point.to_string(),
            available: compute_entry_points(module),
        })?;
    if ep.workgroup_size_overrides.is_some() {
        return Err(ExecError::Unsupported(format!(
            "entry point {entry_point:?} sizes its workgroup with an override; \
             use constant @workgroup_size values"
        )));
    }
    let uses = info.get_entry_point(index);
    let gctx = module.to_ctx();
    let atomic_uses = crate::slots::atomic_uses(module);
    let mut atomic_ops = crate::atomic_ops::atomic_ops(module, info, index);
    let mut bindings = BTreeMap::new();
    for (handle, var) in module.global_variables.iter() {
        let Some(rb) = &var.binding else { continue };
        if uses[handle].is_empty() {
            continue;
        }
        let name = var.name.clone();
        if rb.group != 0 {
            return Err(ExecError::Unsupported(format!(
                "{} is bound at @group({}); task resources must be in @group(0)",
                name.as_deref().unwrap_or("a resource"),
                rb.group
            )));
        }
        let access = match var.space {
            naga::AddressSpace::Uniform => Access::Uniform,
            naga::AddressSpace::Storage { access } => {
                if access.contains(naga::StorageAccess::STORE) {
                    Access::ReadWrite
                } else {
                    Access::ReadOnly
                }
            }
            _ => {
                return Err(ExecError::Binding {
                    binding: rb.binding,
                    problem: "is a texture or sampler; gpumesh tasks bind buffers only".into(),
                })
            }
        };
        let atomic = is_atomic(module, var.ty);
        let has_atomics = holds_atomic(&module.types, var.ty);
        let (fixed_size, stride, elem) =
            layout_of(module, gctx, var.ty).ok_or_else(|| ExecError::Binding {
                binding: rb.binding,
                problem: "has a type too large to lay out".into(),
            })?;
        bindings.insert(
            rb.binding,
            DeclaredBinding {
                binding: rb.binding,
                name,
                access,
                fixed_size,
                stride,
                elem,
                atomic,
                has_atomics,
                appended: atomic_uses.appended.contains(&rb.binding),
                steered: atomic_uses.steered.contains(&rb.binding),
                atomic_ops: atomic_ops.remove(&rb.binding).unwrap_or_default(),
                atomic_words: AtomicWords::of(module, var.ty),
            },
        );
    }
    let mut workgroup_memory = 0u64;
    let mut workgroup_vars = Vec::new();
    for (handle, var) in module.global_variables.iter() {
        if var.space != naga::AddressSpace::WorkGroup || uses[handle].is_empty() {
            continue;
        }
        workgroup_vars.push(handle);
        let size = module.types[var.ty].inner.try_size(gctx).ok_or_else(|| {
            ExecError::Unsupported(format!(
                "var<workgroup> {} has a type too large to lay out",
                var.name.as_deref().unwrap_or("_")
            ))
        })?;
        workgroup_memory += u64::from(size).next_multiple_of(WORKGROUP_ROUNDING);
    }
    let interface = Interface {
        entry_point: entry_point.to_string(),
        workgroup_size: ep.workgroup_size,
        workgroup_memory,
        bindings,
    };
    Ok((interface, workgroup_vars))
}

/// What WebGPU rounds each workgroup variable's size up to when it sums them against
/// the adapter's workgroup memory limit.
pub(crate) const WORKGROUP_ROUNDING: u64 = 16;

/// (fixed bytes, runtime-array stride, element scalar) of a buffer type.
fn layout_of(
    module: &naga::Module,
    gctx: naga::proc::GlobalCtx,
    ty: naga::Handle<naga::Type>,
) -> Option<(u64, Option<u64>, Option<ElemType>)> {
    use naga::TypeInner;
    let inner = &module.types[ty].inner;
    Some(match inner {
        TypeInner::Array {
            base,
            size: naga::ArraySize::Dynamic,
            stride,
        } => (0, Some(u64::from(*stride)), elem_of(module, *base)),
        TypeInner::Array { base, .. } => (
            u64::from(inner.try_size(gctx)?),
            None,
            elem_of(module, *base),
        ),
        TypeInner::Struct { members, span } => match members.last() {
            Some(last) => match module.types[last.ty].inner {
                TypeInner::Array {
                    base,
                    size: naga::ArraySize::Dynamic,
                    stride,
                } => (
                    u64::from(last.offset),
                    Some(u64::from(stride)),
                    elem_of(module, base),
                ),
                _ => (u64::from(*span), None, elem_of(module, ty)),
            },
            None => (u64::from(*span), None, None),
        },
        _ => (u64::from(inner.try_size(gctx)?), None, elem_of(module, ty)),
    })
}

/// The scalar type every word of `ty` holds, if it is one of the merge element
/// types: a scalar, a vector or matrix of it, an atomic, or an array or struct
/// whose members all hold the same (a struct of u32 counters is u32).
fn elem_of(module: &naga::Module, ty: naga::Handle<naga::Type>) -> Option<ElemType> {
    use naga::{ScalarKind, TypeInner};
    let scalar = match &module.types[ty].inner {
        TypeInner::Scalar(s) | TypeInner::Atomic(s) | TypeInner::Vector { scalar: s, .. } => *s,
        TypeInner::Matrix { scalar, .. } => *scalar,
        TypeInner::Array { base, .. } => return elem_of(module, *base),
        TypeInner::Struct { members, .. } => {
            let first = elem_of(module, members.first()?.ty)?;
            return members
                .iter()
                .all(|m| elem_of(module, m.ty) == Some(first))
                .then_some(first);
        }
        _ => return None,
    };
    match (scalar.kind, scalar.width) {
        (ScalarKind::Uint, 4) => Some(ElemType::U32),
        (ScalarKind::Sint, 4) => Some(ElemType::I32),
        (ScalarKind::Float, 4) => Some(ElemType::F32),
        _ => None,
    }
}

/// Whether a type contains an atomic at any depth.
pub(crate) fn holds_atomic(
    types: &naga::UniqueArena<naga::Type>,
    ty: naga::Handle<naga::Type>,
) -> bool {
    use naga::TypeInner;
    match &types[ty].inner {
        TypeInner::Atomic(_) => true,
        TypeInner::Array { base, .. } | TypeInner::BindingArray { base, .. } => {
            holds_atomic(types, *base)
        }
        TypeInner::Struct { members, .. } => members.iter().any(|m| holds_atomic(types, m.ty)),
        _ => false,
    }
}

/// Whether a buffer type's elements are atomics.
fn is_atomic(module: &naga::Module, ty: naga::Handle<naga::Type>) -> bool {
    use naga::TypeInner;
    match &module.types[ty].inner {
        TypeInner::Atomic(_) => true,
        TypeInner::Array { base, .. } => is_atomic(module, *base),
        TypeInner::Struct { members, .. } => {
            members.last().is_some_and(|m| is_atomic(module, m.ty))
        }
        _ => false,
    }
}
