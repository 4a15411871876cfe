//! Bad input gets a clear error naming the problem, and the executor keeps working.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::sync::Arc;
use std::time::Duration;

use gpumesh_protocol::{
    BindingRole, BindingSpec, BlobId, ElemType, Grid, MergeRule, ShaderSource, TaskSpec,
};
use gpumesh_shaders::{builtins, BackendChoice, ExecError, Executor, ExecutorLimits, Job, Kernel};

const COPY: &str = r#"
@group(0) @binding(0) var<storage, read> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    dst[gid.x] = src[gid.x] * 2u;
}
"#;

fn spec(source: &str, bindings: Vec<BindingSpec>, grid: [u32; 3], merge: MergeRule) -> TaskSpec {
    TaskSpec {
        shader: ShaderSource::Wgsl(source.into()),
        entry_point: "main".into(),
        bindings,
        grid: Grid(grid),
        shards: 1,
        merge,
        merges: Default::default(),
        options: Default::default(),
    }
}

fn input(binding: u32, bytes: &[u8]) -> BindingSpec {
    BindingSpec {
        binding,
        role: BindingRole::Input {
            blob: BlobId::of(bytes),
            size: bytes.len() as u64,
        },
    }
}

fn output(binding: u32, size: u64) -> BindingSpec {
    BindingSpec {
        binding,
        role: BindingRole::Output { size },
    }
}

fn job(source: &str, spec: TaskSpec, data: &[u8]) -> Result<Job, ExecError> {
    let kernel = Arc::new(Kernel::compile(source, &spec.entry_point)?);
    let blob: Arc<[u8]> = Arc::from(data);
    Job::new(spec, kernel, |id| id.matches(&blob).then(|| blob.clone()))
}

/// A one-shard job of `source` over `groups` workgroups: `params` as the uniform
/// at binding 0, an output of `out_bytes` at binding 1.
fn with_params(source: &str, params: [u32; 4], out_bytes: u64, groups: u32) -> Job {
    let data = params.iter().flat_map(|w| w.to_le_bytes()).collect();
    let s = spec(
        source,
        vec![
            BindingSpec {
                binding: 0,
                role: BindingRole::Param { data },
            },
            output(1, out_bytes),
        ],
        [groups, 1, 1],
        MergeRule::Changes,
    );
    job(source, s, &[]).unwrap()
}

fn copy_job(
    bindings: Vec<BindingSpec>,
    grid: [u32; 3],
    merge: MergeRule,
    data: &[u8],
) -> Result<Job, ExecError> {
    job(COPY, spec(COPY, bindings, grid, merge), data)
}

/// A loop-free task on `executor` answers as the CPU does: what every test of a
/// refusal checks last.
fn copies_as_the_cpu(executor: &mut Executor, name: &str) {
    let data: Vec<u8> = (0..64u32).flat_map(|v| v.to_le_bytes()).collect();
    let j = copy_job(
        vec![input(0, &data), output(1, 256)],
        [1, 1, 1],
        MergeRule::Changes,
        &data,
    )
    .unwrap();
    let out = executor.run(&j, None).unwrap();
    let want: Vec<u8> = (0..64u32).flat_map(|v| (v * 2).to_le_bytes()).collect();
    assert_eq!(out.outputs[&1], want, "on {name}");
}

#[test]
fn malformed_wgsl_reports_line_and_column() {
    let source = "@compute @workgroup_size(1)\nfn main() {\n    let x = 1u +;\n}\n";
    match Kernel::compile(source, "main") {
        Err(ExecError::Shader {
            line,
            column,
            message,
            ..
        }) => {
            assert_eq!(line, 3, "{message}");
            assert!(column > 0);
            let shown = Kernel::compile(source, "main").unwrap_err().to_string();
            assert!(shown.contains("line 3"), "{shown}");
        }
        other => panic!("expected a shader error, got {other:?}"),
    }
}

#[test]
fn invalid_wgsl_that_parses_reports_where() {
    // Parses, but fails validation: a u32 stored into an f32 array.
    let source = "@group(0) @binding(0) var<storage, read_write> o: array<f32>;\n\
                  @compute @workgroup_size(1)\nfn main() {\n    o[0] = 1u;\n}\n";
    let err = Kernel::compile(source, "main").unwrap_err();
    assert!(matches!(err, ExecError::Shader { line: 4, .. }), "{err}");
}

#[test]
fn missing_entry_point_lists_the_ones_there_are() {
    let err = Kernel::compile(COPY, "mian").unwrap_err();
    let shown = err.to_string();
    assert!(
        matches!(err, ExecError::MissingEntryPoint { .. }),
        "{shown}"
    );
    assert!(
        shown.contains("\"mian\"") && shown.contains("main"),
        "{shown}"
    );
}

#[test]
fn the_entry_point_when_none_is_named_is_the_one_there_is_or_main() {
    let named = |name: &str| COPY.replace("fn main(", &format!("fn {name}("));
    // One compute entry point, however it is called (WebGPU tutorials' names).
    let one = named("computeSomething");
    assert_eq!(Kernel::entry_point_of(&one).unwrap(), "computeSomething");
    assert!(Kernel::compile(&one, "computeSomething").is_ok());
    // Several: `main` if one of them is.
    let second = "\n@compute @workgroup_size(1)\nfn other() {}\n";
    assert_eq!(
        Kernel::entry_point_of(&format!("{COPY}{second}")).unwrap(),
        "main"
    );
    // Several without a `main`: refused, naming them.
    let err = Kernel::entry_point_of(&format!("{}{second}", named("cs_main")))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cs_main") && err.contains("other") && err.contains("--entry"),
        "{err}"
    );
    // None, or a shader that does not parse: `main`, and compiling says why.
    assert_eq!(Kernel::entry_point_of("fn f() {}").unwrap(), "main");
    assert_eq!(Kernel::entry_point_of("fn (").unwrap(), "main");
}

#[test]
fn binding_the_shader_does_not_declare_is_named() {
    let data = [0u8; 256];
    let err = copy_job(
        vec![input(0, &data), output(1, 256), output(7, 256)],
        [1, 1, 1],
        MergeRule::Changes,
        &data,
    )
    .unwrap_err();
    assert!(
        matches!(err, ExecError::Binding { binding: 7, .. }),
        "{err}"
    );
}

#[test]
fn binding_the_shader_needs_but_the_task_omits_is_named() {
    let err = copy_job(vec![output(1, 256)], [1, 1, 1], MergeRule::Changes, &[]).unwrap_err();
    assert!(
        matches!(err, ExecError::Binding { binding: 0, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("--input 0=FILE"), "{err}");
}

#[test]
fn wrong_access_mode_is_refused_both_ways() {
    let data = [0u8; 256];
    // The read-only source given as an output.
    let err = copy_job(
        vec![output(0, 256), output(1, 256)],
        [1, 1, 1],
        MergeRule::Changes,
        &data,
    )
    .unwrap_err();
    assert!(
        matches!(err, ExecError::Binding { binding: 0, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("read_write"), "{err}");
    // The read_write destination given as an input.
    let err = copy_job(
        vec![input(0, &data), input(1, &data)],
        [1, 1, 1],
        MergeRule::Changes,
        &data,
    )
    .unwrap_err();
    assert!(
        matches!(err, ExecError::Binding { binding: 1, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("--inout 1=FILE"), "{err}");
    // The read-only source given as an in-out buffer.
    let inout = BindingSpec {
        binding: 0,
        role: BindingRole::InOut {
            blob: BlobId::of(&data),
            size: 256,
        },
    };
    let err = copy_job(
        vec![inout, output(1, 256)],
        [1, 1, 1],
        MergeRule::Changes,
        &data,
    )
    .unwrap_err();
    assert!(
        matches!(err, ExecError::Binding { binding: 0, .. }),
        "{err}"
    );
}

#[test]
fn merge_rule_of_another_element_type_is_refused() {
    let data = [0u8; 256];
    let err = copy_job(
        vec![input(0, &data), output(1, 256)],
        [1, 1, 1],
        MergeRule::Sum(ElemType::F32),
        &data,
    )
    .unwrap_err();
    assert!(
        matches!(err, ExecError::Binding { binding: 1, .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("f32") && err.to_string().contains("u32"),
        "{err}"
    );
}

#[test]
fn output_too_small_for_its_declared_type_is_refused() {
    let problem = builtins::get("histogram").unwrap().problem(2048).unwrap();
    let mut spec = problem.spec(1);
    for b in &mut spec.bindings {
        if let BindingRole::Output { size } = &mut b.role {
            *size = 16; // the shader declares array<atomic<u32>, 256>
        }
    }
    let kernel = Arc::new(Kernel::for_source(&spec.shader, "main").unwrap());
    let err = Job::new(spec, kernel, |id| problem.blobs.get(id).cloned()).unwrap_err();
    assert!(
        matches!(err, ExecError::Binding { binding: 1, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("too small"), "{err}");
}

#[test]
fn no_divisibility_rule_between_outputs_and_workgroups() {
    // 3 workgroups, 64 words, 4 shards of a 1-word output: all accepted.
    let data = [0u8; 256];
    for (grid, out, shards) in [(3, 256, 3), (3, 4, 1), (7, 4, 7), (5, 252, 2)] {
        let mut s = spec(
            COPY,
            vec![input(0, &data), output(1, out)],
            [grid, 1, 1],
            MergeRule::Changes,
        );
        s.shards = shards;
        job(COPY, s, &data).unwrap();
    }
}

#[test]
fn more_shards_than_workgroups_is_refused() {
    let data = [0u8; 256];
    let mut s = spec(
        COPY,
        vec![input(0, &data), output(1, 256)],
        [4, 1, 1],
        MergeRule::Changes,
    );
    s.shards = 5;
    let err = job(COPY, s, &data).unwrap_err();
    assert!(err.to_string().contains("5 shards"), "{err}");
}

#[test]
fn missing_or_corrupt_input_blob_is_refused() {
    let data = [1u8; 256];
    let kernel = Arc::new(Kernel::compile(COPY, "main").unwrap());
    let s = spec(
        COPY,
        vec![input(0, &data), output(1, 256)],
        [1, 1, 1],
        MergeRule::Changes,
    );
    let err = Job::new(s.clone(), kernel.clone(), |_| None).unwrap_err();
    assert!(err.to_string().contains("not available"), "{err}");
    let wrong: Arc<[u8]> = Arc::from(vec![2u8; 256]);
    let err = Job::new(s, kernel, |_| Some(wrong.clone())).unwrap_err();
    assert!(err.to_string().contains("do not match"), "{err}");
}

#[test]
fn resources_outside_group_zero_are_refused() {
    let source = "@group(1) @binding(0) var<storage, read_write> o: array<u32>;\n\
                  @compute @workgroup_size(1)\nfn main() { o[0] = 1u; }\n";
    let err = Kernel::compile(source, "main").unwrap_err();
    assert!(err.to_string().contains("@group(1)"), "{err}");
}

#[test]
fn workgroup_and_grid_over_the_limits_are_refused() {
    let big_wg = "@group(0) @binding(0) var<storage, read_write> o: array<u32>;\n\
                  @compute @workgroup_size(4096)\nfn main() { o[0] = 1u; }\n";
    for adapter in common::adapters() {
        let executor = common::lock(adapter);
        let j = job(
            big_wg,
            spec(big_wg, vec![output(0, 256)], [1, 1, 1], MergeRule::Changes),
            &[],
        )
        .unwrap();
        let err = executor.check_limits(&j).unwrap_err();
        assert!(matches!(err, ExecError::Limit { .. }), "{err}");
        assert!(err.to_string().contains("workgroup size along x"), "{err}");

        let data = [0u8; 256];
        let j = copy_job(
            vec![input(0, &data), output(1, 65536 * 4)],
            [65536, 65536, 1],
            MergeRule::Changes,
            &data,
        )
        .unwrap();
        let err = executor.check_limits(&j).unwrap_err();
        assert!(err.to_string().contains("grid 65536,65536,1"), "{err}");
    }
}

#[test]
fn grid_overflowing_invocation_ids_is_refused() {
    let data = [0u8; 256];
    let err = copy_job(
        vec![input(0, &data), output(1, 256)],
        [u32::MAX / 2, 1, 1],
        MergeRule::Changes,
        &data,
    )
    .unwrap_err();
    assert!(err.to_string().contains("overflows"), "{err}");
}

#[test]
fn buffer_over_the_adapter_maximum_is_refused_before_allocation() {
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let limit = u64::from(executor.capability().limits.max_storage_buffer_binding_size)
            .min(executor.capability().limits.max_buffer_size);
        let data = [0u8; 256];
        let size = (limit + 256).next_multiple_of(256);
        let j = copy_job(
            vec![input(0, &data), output(1, size)],
            [4, 1, 1],
            MergeRule::Changes,
            &data,
        )
        .unwrap();
        let err = executor.run(&j, None).unwrap_err();
        assert!(matches!(err, ExecError::Limit { .. }), "{err}");
        assert!(err.to_string().contains("binding 1"), "{err}");
        // And the executor still runs good work.
        copies_as_the_cpu(&mut executor, adapter.backend.name());
    }
}

/// Ends only when `stop` is set, and it never is: slow on any adapter. llvmpipe and
/// lavapipe cut any shader's loops off after 65535 iterations, which makes it about
/// a second of work there; other adapters run it until the deadline.
const SPIN: &str = r#"
struct Params { stop: u32, _a: u32, _b: u32, _c: u32 }
@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var x = gid.x;
    loop {
        x = (x ^ (x >> 13u)) * 1664525u + 1u;
        if (params.stop != 0u) {
            break;
        }
    }
    out[gid.x] = x;
}
"#;

#[test]
fn a_task_past_its_deadline_fails_and_the_next_task_runs() {
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let slow = with_params(SPIN, [0; 4], 2048 * 64 * 4, 2048);
        let before = executor.rebuilds();
        let t = std::time::Instant::now();
        let err = executor
            .run(&slow, Some(Duration::from_millis(20)))
            .unwrap_err();
        eprintln!(
            "{}: deadline reported after {:?}",
            adapter.backend.name(),
            t.elapsed()
        );
        assert!(matches!(err, ExecError::Deadline { .. }), "{err}");
        assert_eq!(executor.rebuilds(), before + 1, "the device is rebuilt");
        // The old device is dropped once the dispatch ends (here it does: the
        // software adapters cap its loops, GL ran it to its end at submit); until
        // then it counts as abandoned.
        let devices = executor.device_counts();
        let given = std::time::Instant::now();
        while devices.abandoned() > 0 && given.elapsed() < Duration::from_secs(120) {
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!(
            "{}: the abandoned device was dropped {:?} after the deadline",
            adapter.backend.name(),
            given.elapsed()
        );
        assert_eq!(devices.abandoned(), 0, "the old device is dropped");
        assert_eq!(devices.rebuilt(), executor.rebuilds());
        copies_as_the_cpu(&mut executor, adapter.backend.name());
    }
}

#[test]
fn a_lost_device_is_rebuilt_and_the_next_task_runs() {
    let problem = builtins::get("vector_add").unwrap().problem(1024).unwrap();
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let before = executor.rebuilds();
        executor.simulate_device_loss();
        let first = executor.run(&problem.job(2).unwrap(), None);
        if let Err(e) = &first {
            assert!(
                matches!(e, ExecError::DeviceLost(_)),
                "a loss is reported as such: {e}"
            );
        }
        let out = executor.run(&problem.job(2).unwrap(), None).unwrap();
        problem.verify(&out.outputs).unwrap();
        assert!(
            executor.rebuilds() > before,
            "on {}",
            adapter.backend.name()
        );
    }
}

/// Sums 1..=`outer` × `inner` the slow way, in two nested loops (what a
/// per-invocation reduction written plainly looks like); ends with a bounds check.
const NESTED_SUM: &str = r#"
struct Params { outer: u32, inner: u32, _a: u32, _b: u32 }
@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var total = 0u;
    var k = 0u;
    for (var i = 0u; i < params.outer; i++) {
        for (var j = 0u; j < params.inner; j++) {
            k = k + 1u;
            total = total + k;
        }
    }
    if (gid.x < arrayLength(&out)) {
        out[gid.x] = total + gid.x;
    }
}
"#;

#[test]
fn loops_an_adapter_cuts_short_are_refused_not_answered_wrong() {
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let name = adapter.backend.name();
        // Mesa's software adapters (the ones CI has) end loops after 65,535 turns.
        let software = executor.capability().adapter_name.contains("llvmpipe");
        assert!(
            !software || executor.loop_cap() == Some(65_535),
            "{name}: probe found {:?}",
            executor.loop_cap()
        );
        // (outer, inner): 3 × 20,000 turns is within any cap; 3 × 40,000 is not
        // within Mesa's, in all though each loop alone is.
        for (outer, inner) in [(3u32, 20_000u32), (3, 40_000)] {
            let j = with_params(NESTED_SUM, [outer, inner, 0, 0], 100 * 4, 2);
            let n = u64::from(outer) * u64::from(inner);
            let cpu: Vec<u8> = (0..100u32)
                .flat_map(|x| ((n * (n + 1) / 2) as u32).wrapping_add(x).to_le_bytes())
                .collect();
            let turns = n + u64::from(outer);
            match (executor.run(&j, None), executor.loop_cap()) {
                (Ok(out), cap) => {
                    assert!(
                        cap.is_none_or(|c| turns < u64::from(c)),
                        "{name}: {turns} turns answered under a cap of {cap:?}"
                    );
                    assert_eq!(out.outputs[&1], cpu, "{name}: {outer} × {inner}");
                }
                (Err(e), Some(cap)) if turns >= u64::from(cap) => {
                    assert!(matches!(e, ExecError::LoopCap { .. }), "{name}: {e}");
                    assert!(e.to_string().contains("cannot be trusted"), "{e}");
                }
                (Err(e), cap) => panic!("{name}: {outer} × {inner} under {cap:?}: {e}"),
            }
        }
    }
}

/// Counts from -5,000 up to `n` in an `i32` loop: `n` + 5,000 turns.
const SIGNED_COUNT: &str = r#"
struct Params { n: u32, _a: u32, _b: u32, _c: u32 }
@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var turns = 0u;
    for (var i = -5000; i < i32(params.n); i++) {
        turns = turns + 1u;
    }
    if (gid.x < arrayLength(&out)) {
        out[gid.x] = turns + gid.x;
    }
}
"#;

/// A counted loop of `n` turns, then a short open one: with `n` = 2^32 - 1 the
/// first alone is past any bound, and what the second counts after it must not
/// bring the count back under.
const LONG_THEN_SHORT: &str = r#"
struct Params { n: u32, _a: u32, _b: u32, _c: u32 }
@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var x = 0u;
    for (var i = 0u; i < params.n; i++) {
        x = x + 1u;
    }
    var k = 0u;
    loop {
        k = k + 1u;
        if (k == 5u) { break; }
    }
    if (gid.x < arrayLength(&out)) {
        out[gid.x] = x + k;
    }
}
"#;

/// 1 + 2 + … + `n` in a `while (k <= n)` loop: open-ended as far as the executor
/// can see (at `n` = 2^32 - 1 it never ends).
const OPEN_SUM: &str = r#"
struct Params { n: u32, _a: u32, _b: u32, _c: u32 }
@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var total = 0u;
    var k = 1u;
    while (k <= params.n) {
        total = total + k;
        k = k + 1u;
    }
    if (gid.x < arrayLength(&out)) {
        out[gid.x] = total + gid.x;
    }
}
"#;

/// Sums each workgroup's 64 words by halving, a barrier after every step: the
/// reduction WebGPU tutorials write, its loop uniform across the workgroup.
const WORKGROUP_SUM: &str = r#"
@group(0) @binding(0) var<storage, read> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;
var<workgroup> part: array<u32, 64>;

@compute @workgroup_size(64)
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    part[lid] = src[gid.x];
    workgroupBarrier();
    for (var half = 32u; half > 0u; half = half >> 1u) {
        if (lid < half) {
            part[lid] = part[lid] + part[lid + half];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        out[wid.x] = part[0];
    }
}
"#;

/// Invocation `lid` of a workgroup first turns a loop `lid` × `n` times, then the
/// workgroup sums what they counted by halving, a barrier after every step. Under a
/// bound between the counts of the first and last invocations, part of each
/// workgroup reaches it before the reduction: were those to leave the reduction's
/// loop alone, the rest would wait at its barrier for them (on a GPU, for ever).
const UNEVEN_THEN_REDUCED: &str = r#"
struct Params { n: u32, _a: u32, _b: u32, _c: u32 }
@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;
var<workgroup> part: array<u32, 64>;

@compute @workgroup_size(64)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    var x = 0u;
    let end = lid * params.n;
    for (var i = 0u; i < end; i++) {
        x = x + 1u;
    }
    part[lid] = x;
    workgroupBarrier();
    for (var half = 32u; half > 0u; half = half >> 1u) {
        if (lid < half) {
            part[lid] = part[lid] + part[lid + half];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        out[wid.x] = part[0];
    }
}
"#;

/// A loop with a barrier in it that never ends (`stop` is never set).
const BARRIER_SPIN: &str = r#"
struct Params { stop: u32, _a: u32, _b: u32, _c: u32 }
@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;
var<workgroup> shared_word: u32;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    var x = gid.x;
    loop {
        if (lid == 0u) { shared_word = x; }
        workgroupBarrier();
        x = (shared_word ^ (x >> 13u)) * 1664525u + 1u;
        workgroupBarrier();
        if (params.stop != 0u) {
            break;
        }
    }
    out[gid.x] = x;
}
"#;

#[test]
fn loops_past_the_executors_bound_are_stopped_and_refused_and_the_next_task_runs() {
    const BOUND: u32 = 10_000;
    for adapter in common::adapters() {
        let name = adapter.backend.name();
        // A bound under Mesa's own cap, so it is the bound that stops them here too.
        let limits = ExecutorLimits {
            loop_bound: Some(BOUND),
            ..ExecutorLimits::default()
        };
        let mut executor =
            Executor::with_limits(BackendChoice::Only(adapter.backend), limits).unwrap();
        // Counted `for` loops are counted whole as they start: 3 × 2,000 turns
        // (and the outer loop's 3) is under the bound, answered as the CPU answers;
        // 3 × 4,000 is over it, and 2^32 × 2^32 far over it: each refused before
        // its inner loop runs past the bound.
        for (outer, inner) in [(3u32, 2_000u32), (3, 4_000), (u32::MAX, u32::MAX)] {
            let j = with_params(NESTED_SUM, [outer, inner, 0, 0], 100 * 4, 2);
            let n = u64::from(outer) * u64::from(inner);
            let turns = n + u64::from(outer);
            let t = std::time::Instant::now();
            match executor.run(&j, None) {
                Ok(out) => {
                    assert!(turns < u64::from(BOUND), "{name}: {turns} turns answered");
                    let cpu: Vec<u8> = (0..100u32)
                        .flat_map(|x| ((n * (n + 1) / 2) as u32).wrapping_add(x).to_le_bytes())
                        .collect();
                    assert_eq!(out.outputs[&1], cpu, "{name}: {outer} × {inner}");
                }
                Err(e) => {
                    assert!(
                        turns >= u64::from(BOUND),
                        "{name}: {turns} turns refused: {e}"
                    );
                    assert!(
                        matches!(e, ExecError::LoopBound { bound: BOUND }),
                        "{name}: {e}"
                    );
                    eprintln!("{name}: {outer} × {inner} refused after {:?}", t.elapsed());
                }
            }
        }
        // Past the bound at once, then a few turns more: refused, not answered
        // with the first loop skipped.
        let j = with_params(LONG_THEN_SHORT, [u32::MAX, 0, 0, 0], 100 * 4, 2);
        match executor.run(&j, None) {
            Err(ExecError::LoopBound { bound: BOUND }) => {}
            other => panic!("{name}: a loop of 2^32 - 1 turns then one of 5: {other:?}"),
        }
        // An i32 loop from below zero: 9,000 turns answered, 11,000 refused.
        for n in [4_000u32, 6_000] {
            let j = with_params(SIGNED_COUNT, [n, 0, 0, 0], 100 * 4, 2);
            let turns = n + 5_000;
            match executor.run(&j, None) {
                Ok(out) => {
                    assert!(turns < BOUND, "{name}: {turns} turns answered");
                    let cpu: Vec<u8> = (0..100u32)
                        .flat_map(|x| (turns + x).to_le_bytes())
                        .collect();
                    assert_eq!(out.outputs[&1], cpu, "{name}: i32 loop to {n}");
                }
                Err(e) => {
                    assert!(turns >= BOUND, "{name}: {turns} turns refused: {e}");
                    assert!(
                        matches!(e, ExecError::LoopBound { bound: BOUND }),
                        "{name}: {e}"
                    );
                }
            }
        }
        // The same sum as a `while (k <= n)` (it may never end: n = u32::MAX),
        // counted turn by turn: 5,000 turns answered, 20,000 refused.
        for turns in [5_000u32, 20_000] {
            let j = with_params(OPEN_SUM, [turns, 0, 0, 0], 100 * 4, 2);
            let n = u64::from(turns);
            match executor.run(&j, None) {
                Ok(out) => {
                    assert!(turns < BOUND, "{name}: {turns} turns answered");
                    let cpu: Vec<u8> = (0..100u32)
                        .flat_map(|x| ((n * (n + 1) / 2) as u32).wrapping_add(x).to_le_bytes())
                        .collect();
                    assert_eq!(out.outputs[&1], cpu, "{name}: {turns} turns");
                }
                Err(e) => {
                    assert!(turns >= BOUND, "{name}: {turns} turns refused: {e}");
                    assert!(
                        matches!(e, ExecError::LoopBound { bound: BOUND }),
                        "{name}: {e}"
                    );
                    assert!(e.to_string().contains("--max-loop-turns"), "{e}");
                }
            }
        }

        // Loops that never end, one with barriers in it: each stops at the bound,
        // long before the deadline, and the device is not rebuilt.
        for source in [SPIN, BARRIER_SPIN] {
            let runaway = with_params(source, [0; 4], 2048 * 64 * 4, 2048);
            let rebuilds = executor.rebuilds();
            let t = std::time::Instant::now();
            let err = executor
                .run(&runaway, Some(Duration::from_secs(120)))
                .unwrap_err();
            eprintln!("{name}: a runaway loop stopped after {:?}", t.elapsed());
            assert!(
                matches!(err, ExecError::LoopBound { bound: BOUND }),
                "{name}: {err}"
            );
            assert_eq!(executor.rebuilds(), rebuilds, "{name}: no device rebuilt");
        }

        // Part of each workgroup past the bound before a loop with a barrier: the
        // workgroup leaves that loop together, and the run is refused at once
        // (the device not rebuilt); under the bound, answered as the CPU.
        for n in [100u32, 300] {
            let j = with_params(UNEVEN_THEN_REDUCED, [n, 0, 0, 0], 4 * 4, 4);
            let most = 63 * n + 6;
            let rebuilds = executor.rebuilds();
            match executor.run(&j, Some(Duration::from_secs(60))) {
                Ok(out) => {
                    assert!(most < BOUND, "{name}: {most} turns answered");
                    let cpu: Vec<u8> = (0..4).flat_map(|_| (n * 2016).to_le_bytes()).collect();
                    assert_eq!(out.outputs[&1], cpu, "{name}: n = {n}");
                }
                Err(e) => {
                    assert!(most >= BOUND, "{name}: {most} turns refused: {e}");
                    assert!(
                        matches!(e, ExecError::LoopBound { bound: BOUND }),
                        "{name}: {e}"
                    );
                }
            }
            assert_eq!(executor.rebuilds(), rebuilds, "{name}: no device rebuilt");
        }

        // A loop with barriers under the bound answers as the CPU does.
        let src: Vec<u32> = (0..4 * 64u32)
            .map(|v| v.wrapping_mul(2_654_435_761))
            .collect();
        let data: Vec<u8> = src.iter().flat_map(|v| v.to_le_bytes()).collect();
        let s = spec(
            WORKGROUP_SUM,
            vec![input(0, &data), output(1, 4 * 4)],
            [4, 1, 1],
            MergeRule::Changes,
        );
        let out = executor
            .run(&job(WORKGROUP_SUM, s, &data).unwrap(), None)
            .unwrap();
        let cpu: Vec<u8> = src
            .chunks(64)
            .flat_map(|c| c.iter().fold(0u32, |a, v| a.wrapping_add(*v)).to_le_bytes())
            .collect();
        assert_eq!(out.outputs[&1], cpu, "{name}: the workgroup sums");

        // And a loop-free task after it all.
        copies_as_the_cpu(&mut executor, name);
    }
}

/// [`UNEVEN_THEN_REDUCED`] with its workgroup array `words` long (only its first 64
/// are used).
fn uneven_then_reduced_in(words: u32, n: u32) -> Job {
    let source = UNEVEN_THEN_REDUCED.replace("array<u32, 64>", &format!("array<u32, {words}>"));
    with_params(&source, [n, 0, 0, 0], 4 * 4, 4)
}

#[test]
fn kernels_at_the_workgroup_memory_limit_run_under_the_bound_and_past_it_are_refused() {
    for adapter in common::bounded() {
        let name = adapter.backend.name();
        let mut executor = adapter.executor.lock().unwrap();
        let limit = executor
            .capability()
            .limits
            .max_compute_workgroup_storage_size;
        let rebuilds = executor.rebuilds();
        // Every byte the adapter has, with a reduction loop (barriers in it) after
        // unequal counts: no room for the bound's workgroup count, so the reduction
        // runs as written and only the loop before it is left at the bound. Under
        // the bound, the CPU's answer; past it, refused.
        for n in [100u32, 2_000] {
            let most = 63 * n + 6;
            match executor.run(
                &uneven_then_reduced_in(limit / 4, n),
                Some(Duration::from_secs(60)),
            ) {
                Ok(out) => {
                    assert!(
                        most < common::UNDER_THE_CAP,
                        "{name}: {most} turns answered"
                    );
                    let cpu: Vec<u8> = (0..4).flat_map(|_| (n * 2016).to_le_bytes()).collect();
                    assert_eq!(out.outputs[&1], cpu, "{name}: n = {n}");
                }
                Err(e) => {
                    assert!(
                        most >= common::UNDER_THE_CAP,
                        "{name}: {most} turns refused: {e}"
                    );
                    assert!(matches!(e, ExecError::LoopBound { .. }), "{name}: {e}");
                }
            }
        }
        // Sixteen bytes more than the adapter has: refused before it reaches the
        // driver, which names no cause (OpenGL's loses the device).
        let over = uneven_then_reduced_in(limit / 4 + 4, 100);
        let err = executor.run(&over, None).unwrap_err();
        assert!(
            matches!(err, ExecError::Limit { value, limit: l, .. } if value == u64::from(limit) + 16 && l == u64::from(limit)),
            "{name}: {err}"
        );
        assert!(
            err.to_string().contains("workgroup memory"),
            "{name}: {err}"
        );
        assert_eq!(executor.rebuilds(), rebuilds, "{name}: no device rebuilt");
        copies_as_the_cpu(&mut executor, name);
    }
}

#[test]
fn an_override_without_a_default_is_refused_naming_it() {
    let source = "override SCALE: u32;
@group(0) @binding(0) var<storage, read_write> dst: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) { dst[gid.x] = gid.x * SCALE; }";
    let err = Kernel::compile(source, "main").unwrap_err().to_string();
    assert!(
        err.contains("SCALE") && err.contains("default"),
        "the message names the override and what to do: {err}"
    );
}

/// Kernels using optional WebGPU features (f16, subgroups, binding arrays) are
/// refused naming the feature, not a validator flag or an invalid type alone.
#[test]
fn kernels_needing_optional_features_are_refused_naming_them() {
    for (source, what) in [
        (
            "enable f16;\n@group(0) @binding(0) var<storage, read_write> o: array<f16>;\n\
             @compute @workgroup_size(64)\nfn main(@builtin(global_invocation_id) g: vec3u) \
             { o[g.x] = f16(g.x) * 0.5h; }\n",
            "f16",
        ),
        (
            "@group(0) @binding(0) var<storage, read_write> o: array<u32>;\n\
             @compute @workgroup_size(64)\nfn main(@builtin(global_invocation_id) g: vec3u) \
             { o[g.x] = subgroupAdd(1u); }\n",
            "subgroup operations",
        ),
        (
            "@group(0) @binding(3) var<storage, read_write> parts: binding_array<array<f32>, 2>;\n\
             @compute @workgroup_size(64)\nfn main(@builtin(global_invocation_id) g: vec3u) \
             { parts[0][g.x] = 1.0; }\n",
            "binding 3: (parts) is a binding_array",
        ),
    ] {
        let err = Kernel::compile(source, "main").unwrap_err().to_string();
        assert!(
            err.contains(what) && err.contains("optional WebGPU feature"),
            "{err}"
        );
    }
}
