//! The WGSL text of each built-in kernel, by name. Kept apart from the kernels'
//! generators and references so that compiling a task (`kernel.rs`) can resolve a
//! built-in's source without depending on them.

use crate::error::{ExecError, Result};

pub const VECTOR_ADD: &str = include_str!("../../kernels/vector_add.wgsl");
pub const MATMUL: &str = include_str!("../../kernels/matmul.wgsl");
pub const MANDELBROT: &str = include_str!("../../kernels/mandelbrot.wgsl");
pub const MONTECARLO_PI: &str = include_str!("../../kernels/montecarlo_pi.wgsl");
pub const HISTOGRAM: &str = include_str!("../../kernels/histogram.wgsl");
pub const LINREG_GRAD: &str = include_str!("../../kernels/linreg_grad.wgsl");
pub const JACOBI: &str = include_str!("../../kernels/jacobi.wgsl");
pub const BLUR: &str = include_str!("../../kernels/blur.wgsl");

const NAMED: &[(&str, &str)] = &[
    ("vector_add", VECTOR_ADD),
    ("matmul", MATMUL),
    ("mandelbrot", MANDELBROT),
    ("montecarlo_pi", MONTECARLO_PI),
    ("histogram", HISTOGRAM),
    ("linreg_grad", LINREG_GRAD),
    ("jacobi", JACOBI),
    ("blur", BLUR),
];

/// The WGSL source of the built-in kernel called `name`.
pub fn source(name: &str) -> Result<&'static str> {
    NAMED
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, wgsl)| *wgsl)
        .ok_or_else(|| ExecError::UnknownBuiltin {
            name: name.to_string(),
            available: NAMED.iter().map(|(n, _)| n.to_string()).collect(),
        })
}
