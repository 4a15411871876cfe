//! `gpumesh run`: one task on a local adapter, no mesh.
//!
//! Everything that can be checked without a GPU (the WGSL, the bindings, the grid,
//! the merge rule, the input files) is checked before an adapter is opened.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use gpumesh_protocol::{BindingRole, BindingSpec, BlobId, ShaderSource, TaskSpec};
use gpumesh_shaders::builtins::{self, Problem};
use gpumesh_shaders::{ExecError, Executor, Job, Kernel};
use serde::Serialize;

use super::{RunArgs, TaskArgs};

#[derive(Serialize)]
struct Report {
    kernel: String,
    adapter: String,
    backend: &'static str,
    shards: Vec<ShardReport>,
    elapsed_ms: f64,
    gflops: Option<f64>,
    outputs: Vec<OutputReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    verify: Option<VerifyReport>,
}

#[derive(Serialize)]
struct ShardReport {
    index: u32,
    workgroups: String,
    elapsed_ms: f64,
}

#[derive(Serialize)]
struct OutputReport {
    binding: u32,
    bytes: usize,
    blake3: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    path: Option<PathBuf>,
}

#[derive(Serialize)]
struct VerifyReport {
    ok: bool,
    detail: String,
}

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    if args.verify && args.task.builtin.is_none() {
        bail!("--verify needs a CPU reference, which only built-in kernels have (use --builtin)");
    }
    if args.task.kernel.is_some() && args.out_dir.is_none() {
        bail!("--out-dir DIR is required: each output is written to DIR/<binding>.bin");
    }
    let prepared = prepare(&args.task)?;
    let label = prepared.label.clone();
    let problem = prepared.problem;
    let job = Job::new(prepared.spec, prepared.kernel, |id| {
        prepared.blobs.get(id).cloned()
    })?;
    if args.repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    let mut executor = Executor::new(args.backend)?;
    let deadline = args.deadline.map(Duration::from_secs_f64);
    let mut out = executor.run(&job, deadline)?;
    if args.repeat > 1 {
        let mut runs = Vec::new();
        for _ in 0..args.repeat {
            runs.push(executor.run(&job, deadline)?);
        }
        runs.sort_by_key(|r| r.elapsed);
        out = runs.swap_remove(runs.len() / 2);
    }

    let mut outputs = Vec::new();
    if let Some(dir) = &args.out_dir {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create output directory {}", dir.display()))?;
    }
    for (&binding, bytes) in &out.outputs {
        let path = match &args.out_dir {
            Some(dir) => {
                let path = dir.join(format!("{binding}.bin"));
                std::fs::write(&path, bytes)
                    .with_context(|| format!("cannot write {}", path.display()))?;
                Some(path)
            }
            None => None,
        };
        outputs.push(OutputReport {
            binding,
            bytes: bytes.len(),
            blake3: BlobId::of(bytes).to_hex(),
            path,
        });
    }
    let verify = match (&problem, args.verify) {
        (Some(p), true) => Some(match p.verify(&out.outputs) {
            Ok(agreement) => VerifyReport {
                ok: true,
                detail: agreement.to_string(),
            },
            Err(mismatch) => VerifyReport {
                ok: false,
                detail: mismatch.to_string(),
            },
        }),
        _ => None,
    };
    let cap = executor.capability();
    let secs = out.elapsed.as_secs_f64();
    let label = if args.repeat > 1 {
        format!("{label}, median of {} runs", args.repeat)
    } else {
        label
    };
    let report = Report {
        kernel: label,
        adapter: cap.adapter_name.clone(),
        backend: cap.backend.name(),
        shards: out
            .shards
            .iter()
            .map(|s| ShardReport {
                index: s.range.index,
                workgroups: format!(
                    "{}..{} along {}",
                    s.range.start,
                    s.range.start + s.range.count,
                    ["x", "y", "z"][s.range.axis]
                ),
                elapsed_ms: s.elapsed.as_secs_f64() * 1e3,
            })
            .collect(),
        elapsed_ms: secs * 1e3,
        gflops: problem
            .as_ref()
            .filter(|p| p.flops > 0.0)
            .map(|p| p.flops / secs / 1e9),
        outputs,
        verify,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_text(&report);
    }
    Ok(match report.verify {
        Some(VerifyReport { ok: false, .. }) => ExitCode::from(3),
        _ => ExitCode::SUCCESS,
    })
}

fn print_text(r: &Report) {
    println!(
        "ran {} on {} ({}) in {} shard{}: {:.2} ms{}",
        r.kernel,
        r.adapter,
        r.backend,
        r.shards.len(),
        if r.shards.len() == 1 { "" } else { "s" },
        r.elapsed_ms,
        r.gflops
            .map(|g| format!(", {g:.2} GFLOP/s"))
            .unwrap_or_default()
    );
    if r.shards.len() > 1 {
        for s in &r.shards {
            println!(
                "  shard {}: workgroups {}, {:.2} ms",
                s.index, s.workgroups, s.elapsed_ms
            );
        }
    }
    for o in &r.outputs {
        println!(
            "  output {}: {} bytes, blake3 {}{}",
            o.binding,
            o.bytes,
            o.blake3,
            o.path
                .as_ref()
                .map(|p| format!(" -> {}", p.display()))
                .unwrap_or_default()
        );
    }
    if let Some(v) = &r.verify {
        println!(
            "  verify: {} — {}",
            if v.ok { "OK" } else { "MISMATCH" },
            v.detail
        );
    }
}

/// A task built from the command line and checked against its shader.
pub struct Prepared {
    pub spec: TaskSpec,
    pub kernel: Arc<Kernel>,
    pub blobs: BTreeMap<BlobId, Arc<[u8]>>,
    pub problem: Option<Problem>,
    pub label: String,
}

/// Builds and checks the task without touching a GPU.
pub fn prepare(args: &TaskArgs) -> anyhow::Result<Prepared> {
    if args.shards == 0 {
        bail!("--shards must be at least 1");
    }
    if let Some(name) = &args.builtin {
        for (given, flag) in [
            (!args.inputs.is_empty(), "--input"),
            (!args.outputs.is_empty(), "--output"),
            (!args.inouts.is_empty(), "--inout"),
            (args.grid.is_some(), "--grid"),
            (!args.merges.is_empty(), "--merge"),
        ] {
            if given {
                bail!("{flag} cannot be used with --builtin: the built-in kernel {name} fixes its own");
            }
        }
        let builtin = builtins::get(name)?;
        let problem = builtin.problem(args.size.unwrap_or(builtin.default_size))?;
        let spec = problem.spec(args.shards);
        let kernel = Arc::new(Kernel::compile(builtin.source, &spec.entry_point)?);
        kernel.check(&spec)?;
        return Ok(Prepared {
            label: format!("{} ({} {})", builtin.name, problem.size, builtin.size_means),
            spec,
            kernel,
            blobs: problem.blobs.clone(),
            problem: Some(problem),
        });
    }
    let path = args
        .kernel
        .as_ref()
        .context("give a WGSL file or --builtin NAME")?;
    let source = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read kernel file {}", path.display()))?;
    let entry_point = match &args.entry {
        Some(name) => name.clone(),
        None => Kernel::entry_point_of(&source)?,
    };
    let kernel = Kernel::compile(&source, &entry_point).map_err(|e| located(path, e))?;
    let grid = args
        .grid
        .context("--grid X[,Y[,Z]] is required for a WGSL kernel")?;
    if args.outputs.is_empty() && args.inouts.is_empty() {
        bail!("a task needs at least one --output BINDING:BYTES or --inout BINDING=FILE");
    }
    let mut blobs: BTreeMap<BlobId, Arc<[u8]>> = BTreeMap::new();
    let mut bindings = Vec::new();
    let files = args.inputs.iter().map(|f| (f, false));
    for ((binding, file), inout) in files.chain(args.inouts.iter().map(|f| (f, true))) {
        let bytes = read_input(*binding, file)?;
        let (blob, size) = (BlobId::of(&bytes), bytes.len() as u64);
        let role = if inout {
            BindingRole::InOut { blob, size }
        } else {
            BindingRole::Input { blob, size }
        };
        bindings.push(BindingSpec {
            binding: *binding,
            role,
        });
        blobs.insert(blob, Arc::from(bytes));
    }
    for &(binding, size) in &args.outputs {
        bindings.push(BindingSpec {
            binding,
            role: BindingRole::Output { size },
        });
    }
    let mut merge = None;
    let mut merges = BTreeMap::new();
    for &(binding, rule) in &args.merges {
        let repeated = match binding {
            None => merge.replace(rule).is_some(),
            Some(b) => merges.insert(b, rule).is_some(),
        };
        if repeated {
            bail!(
                "--merge gives {} twice",
                binding.map_or("the rule of every binding".into(), |b| format!(
                    "the rule of binding {b}"
                ))
            );
        }
    }
    let spec = TaskSpec {
        shader: ShaderSource::Wgsl(source),
        entry_point,
        bindings,
        grid,
        shards: args.shards,
        merge: merge.unwrap_or_default(),
        merges,
        options: Default::default(),
    };
    kernel.check(&spec)?;
    Ok(Prepared {
        spec,
        kernel: Arc::new(kernel),
        blobs,
        problem: None,
        label: path.display().to_string(),
    })
}

fn read_input(binding: u32, file: &Path) -> anyhow::Result<Vec<u8>> {
    std::fs::read(file).with_context(|| {
        format!(
            "cannot read input file {} for binding {binding}",
            file.display()
        )
    })
}

/// A shader error with the file name in front of its line and column.
fn located(path: &Path, e: ExecError) -> anyhow::Error {
    match e {
        ExecError::Shader {
            line,
            column,
            message,
            rendered,
        } => anyhow::anyhow!("{}:{line}:{column}: {message}\n{rendered}", path.display()),
        other => other.into(),
    }
}
