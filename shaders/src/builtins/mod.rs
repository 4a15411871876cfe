//! The built-in kernels: each a `.wgsl` file in `shaders/kernels/` with a generator of
//! deterministic inputs and a CPU reference that a GPU result is checked against.
//!
//! | name | size means | merge | tolerance |
//! |---|---|---|---|
//! | `vector_add` | elements | changes | bit-exact |
//! | `matmul` | matrix side | changes | rounding bound 2·n·ε·Σ\|a\|\|b\| per element |
//! | `mandelbrot` | image side | changes | ≤ 1% of pixels may differ (float contraction at the set's edge) |
//! | `montecarlo_pi` | invocations | changes | bit-exact (integer sampling) |
//! | `histogram` | values | sum-u32 | bit-exact |
//! | `linreg_grad` | rows | sum-f32 | 1e-4 relative to Σ\|terms\| |
//! | `jacobi` | unknowns | changes | 2·n·ε relative to the row's magnitude |
//! | `blur` | image side | changes | bit-exact (integer weights) |

mod counting;
mod dense;
mod image;
pub mod sources;

pub use counting::montecarlo_reference;
pub use dense::{jacobi_system, linreg_reference, matmul_reference};
pub use image::{blur_reference, mandelbrot_reference, test_image};

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use gpumesh_protocol::{BindingRole, BindingSpec, BlobId, Grid, MergeRule, ShaderSource, TaskSpec};

use crate::error::{ExecError, Result};
use crate::job::Job;
use crate::kernel::Kernel;

/// Outputs by binding number.
pub type Outputs = BTreeMap<u32, Vec<u8>>;

type Reference = Box<dyn Fn(&Outputs) -> std::result::Result<Agreement, Mismatch> + Send + Sync>;

/// One built-in kernel.
pub struct Builtin {
    pub name: &'static str,
    pub summary: &'static str,
    /// What `--size` counts.
    pub size_means: &'static str,
    pub default_size: u32,
    /// A size small enough for tests on a software adapter.
    pub test_size: u32,
    pub source: &'static str,
    make: fn(&'static Builtin, u32) -> Result<Problem>,
}

impl Builtin {
    /// Generates inputs at `size` (rounded up to what the kernel tiles by).
    pub fn problem(&'static self, size: u32) -> Result<Problem> {
        if size == 0 {
            return Err(ExecError::Task(format!(
                "--size for {} must be at least 1",
                self.name
            )));
        }
        (self.make)(self, size)
    }
}

pub static ALL: &[Builtin] = &[
    Builtin {
        name: "vector_add",
        summary: "c = a + b over f32 vectors",
        size_means: "elements",
        default_size: 1 << 22,
        test_size: 1 << 14,
        source: sources::VECTOR_ADD,
        make: dense::vector_add,
    },
    Builtin {
        name: "matmul",
        summary: "register-tiled f32 matrix multiply C = A B",
        size_means: "matrix side (multiple of 64)",
        default_size: 1024,
        test_size: 256,
        source: sources::MATMUL,
        make: dense::matmul,
    },
    Builtin {
        name: "mandelbrot",
        summary: "escape-time Mandelbrot set, iterations per pixel",
        size_means: "image side in pixels (multiple of 16)",
        default_size: 1024,
        test_size: 128,
        source: sources::MANDELBROT,
        make: image::mandelbrot,
    },
    Builtin {
        name: "montecarlo_pi",
        summary: "Monte Carlo estimate of pi, hits per workgroup",
        size_means: "invocations (multiple of 64), 256 samples each",
        default_size: 1 << 16,
        test_size: 4096,
        source: sources::MONTECARLO_PI,
        make: counting::montecarlo_pi,
    },
    Builtin {
        name: "histogram",
        summary: "256-bin histogram of u32 values with atomics",
        size_means: "values (multiple of 2048)",
        default_size: 1 << 22,
        test_size: 1 << 16,
        source: sources::HISTOGRAM,
        make: counting::histogram,
    },
    Builtin {
        name: "linreg_grad",
        summary: "one gradient of linear-regression MSE, summed across shards",
        size_means: "rows of 8 features (multiple of 256)",
        default_size: 1 << 18,
        test_size: 1 << 12,
        source: sources::LINREG_GRAD,
        make: dense::linreg_grad,
    },
    Builtin {
        name: "jacobi",
        summary: "one Jacobi iteration step for A x = b",
        size_means: "unknowns (multiple of 64)",
        default_size: 2048,
        test_size: 256,
        source: sources::JACOBI,
        make: dense::jacobi,
    },
    Builtin {
        name: "blur",
        summary: "3x3 Gaussian blur of an RGBA8 image",
        size_means: "image side in pixels (multiple of 16)",
        default_size: 1024,
        test_size: 128,
        source: sources::BLUR,
        make: image::blur,
    },
];

/// The built-in kernel called `name`.
pub fn get(name: &str) -> Result<&'static Builtin> {
    ALL.iter()
        .find(|b| b.name == name)
        .ok_or_else(|| ExecError::UnknownBuiltin {
            name: name.to_string(),
            available: ALL.iter().map(|b| b.name.to_string()).collect(),
        })
}

pub use sources::source;

/// A built-in kernel instantiated at one size: its bindings, inputs and reference.
pub struct Problem {
    pub builtin: &'static Builtin,
    /// The size actually used (after rounding up).
    pub size: u32,
    pub grid: Grid,
    pub merge: MergeRule,
    pub bindings: Vec<BindingSpec>,
    pub blobs: BTreeMap<BlobId, Arc<[u8]>>,
    /// Floating-point operations of one run, for GFLOP/s (0 where not meaningful).
    pub flops: f64,
    reference: Reference,
}

impl Problem {
    fn new(builtin: &'static Builtin, size: u32, grid: [u32; 3], merge: MergeRule) -> Self {
        Problem {
            builtin,
            size,
            grid: Grid(grid),
            merge,
            bindings: Vec::new(),
            blobs: BTreeMap::new(),
            flops: 0.0,
            reference: Box::new(|_| Err(Mismatch::new(0, "no reference set"))),
        }
    }

    fn input(&mut self, binding: u32, bytes: Vec<u8>) {
        let blob = BlobId::of(&bytes);
        self.bindings.push(BindingSpec {
            binding,
            role: BindingRole::Input {
                blob,
                size: bytes.len() as u64,
            },
        });
        self.blobs.insert(blob, Arc::from(bytes));
    }

    fn param(&mut self, binding: u32, words: [u32; 4]) {
        self.bindings.push(BindingSpec {
            binding,
            role: BindingRole::Param {
                data: bytemuck::cast_slice(&words).to_vec(),
            },
        });
    }

    fn output(&mut self, binding: u32, size: u64) {
        self.bindings.push(BindingSpec {
            binding,
            role: BindingRole::Output { size },
        });
    }

    /// The task spec of this problem split into `shards`.
    pub fn spec(&self, shards: u32) -> TaskSpec {
        TaskSpec {
            shader: ShaderSource::Builtin(self.builtin.name.to_string()),
            entry_point: "main".into(),
            bindings: self.bindings.clone(),
            grid: self.grid,
            shards,
            merge: self.merge,
            merges: Default::default(),
            options: Default::default(),
        }
    }

    /// A checked job for `shards` shards.
    pub fn job(&self, shards: u32) -> Result<Job> {
        let kernel = Arc::new(Kernel::compile(self.builtin.source, "main")?);
        Job::new(self.spec(shards), kernel, |id| self.blobs.get(id).cloned())
    }

    /// Compares `outputs` with the CPU reference.
    pub fn verify(&self, outputs: &Outputs) -> std::result::Result<Agreement, Mismatch> {
        (self.reference)(outputs)
    }
}

/// A GPU result that agrees with the CPU reference, and by how much.
#[derive(Clone, Debug)]
pub struct Agreement {
    pub compared: usize,
    /// Elements that differ at all (within tolerance where one is allowed).
    pub differing: usize,
    pub max_abs_err: f64,
    pub tolerance: &'static str,
    /// A figure worth printing (e.g. the pi estimate), if the kernel has one.
    pub note: Option<String>,
}

impl fmt::Display for Agreement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} values agree with the CPU reference ({}; {} differ, max abs error {:.3e})",
            self.compared, self.tolerance, self.differing, self.max_abs_err
        )?;
        if let Some(note) = &self.note {
            write!(f, "; {note}")?;
        }
        Ok(())
    }
}

/// A GPU result outside the tolerance.
#[derive(Clone, Debug)]
pub struct Mismatch {
    pub binding: u32,
    pub detail: String,
}

impl Mismatch {
    fn new(binding: u32, detail: impl Into<String>) -> Self {
        Mismatch {
            binding,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "output {} disagrees with the CPU reference: {}",
            self.binding, self.detail
        )
    }
}

impl std::error::Error for Mismatch {}

fn output(outputs: &Outputs, binding: u32, len: usize) -> std::result::Result<&[u8], Mismatch> {
    let bytes = outputs
        .get(&binding)
        .ok_or_else(|| Mismatch::new(binding, "missing"))?;
    if bytes.len() != len * 4 {
        return Err(Mismatch::new(
            binding,
            format!("{} bytes, expected {}", bytes.len(), len * 4),
        ));
    }
    Ok(bytes)
}

fn words(bytes: &[u8]) -> impl Iterator<Item = [u8; 4]> + '_ {
    bytes.chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]])
}

/// Every u32 equal.
fn exact_u32(
    outputs: &Outputs,
    binding: u32,
    want: &[u32],
) -> std::result::Result<Agreement, Mismatch> {
    let got = output(outputs, binding, want.len())?;
    for (i, (g, &w)) in words(got).map(u32::from_le_bytes).zip(want).enumerate() {
        if g != w {
            return Err(Mismatch::new(
                binding,
                format!("element {i} is {g}, the reference says {w} (bit-exact required)"),
            ));
        }
    }
    Ok(Agreement {
        compared: want.len(),
        differing: 0,
        max_abs_err: 0.0,
        tolerance: "bit-exact",
        note: None,
    })
}

/// Each f32 within `bound[i]` of the f64 reference.
fn close_f32(
    outputs: &Outputs,
    binding: u32,
    want: &[f64],
    bound: impl Fn(usize) -> f64,
    tolerance: &'static str,
) -> std::result::Result<Agreement, Mismatch> {
    let got = output(outputs, binding, want.len())?;
    let (mut max_abs_err, mut differing) = (0.0f64, 0);
    for (i, (g, &w)) in words(got).map(f32::from_le_bytes).zip(want).enumerate() {
        let err = (f64::from(g) - w).abs();
        // NaN compares false both ways, so it fails this test too.
        if err.is_nan() || err > bound(i) {
            return Err(Mismatch::new(
                binding,
                format!("element {i} is {g}, the reference says {w} (error {err:.3e}, allowed {:.3e}: {tolerance})", bound(i)),
            ));
        }
        if err > 0.0 {
            differing += 1;
        }
        max_abs_err = max_abs_err.max(err);
    }
    Ok(Agreement {
        compared: want.len(),
        differing,
        max_abs_err,
        tolerance,
        note: None,
    })
}

/// Deterministic inputs (splitmix64), so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }

    /// Uniform in [-1, 1), exactly representable in f32.
    fn unit_f32(&mut self) -> f32 {
        (self.next_u32() >> 8) as f32 / (1u32 << 23) as f32 - 1.0
    }

    fn f32s(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.unit_f32()).collect()
    }
}

fn round_up(size: u32, multiple: u32) -> Result<u32> {
    size.checked_next_multiple_of(multiple)
        .ok_or_else(|| ExecError::Task(format!("size {size} is too large")))
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn u32_bytes(v: &[u32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}
