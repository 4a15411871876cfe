//! Image kernels: the Mandelbrot set and a Gaussian blur.

use gpumesh_protocol::MergeRule;

use super::{
    exact_u32, output, round_up, u32_bytes, words, Agreement, Builtin, Mismatch, Problem, Rng,
};
use crate::error::Result;

const MAX_ITER: u32 = 256;

pub(super) fn mandelbrot(builtin: &'static Builtin, size: u32) -> Result<Problem> {
    let side = round_up(size, 16)?;
    let mut p = Problem::new(builtin, side, [side / 16, side / 16, 1], MergeRule::Changes);
    p.param(0, [side, side, MAX_ITER, 0]);
    p.output(1, u64::from(side) * u64::from(side) * 4);
    p.reference = Box::new(move |outputs| {
        let want = mandelbrot_reference(side, side, MAX_ITER);
        let got = output(outputs, 1, want.len())?;
        // Adapters may contract x*x - y*y + c into fused multiply-adds, which moves
        // escape times at the fractal's edge; elsewhere counts must match.
        let differing = words(got)
            .map(u32::from_le_bytes)
            .zip(&want)
            .filter(|(g, w)| g != *w)
            .count();
        let allowed = want.len() / 100;
        if differing > allowed {
            return Err(Mismatch::new(
                1,
                format!(
                    "{differing} of {} pixels differ; at most 1% ({allowed}) may",
                    want.len()
                ),
            ));
        }
        Ok(Agreement {
            compared: want.len(),
            differing,
            max_abs_err: 0.0,
            tolerance: "at most 1% of pixels may differ",
            note: None,
        })
    });
    Ok(p)
}

/// Iteration counts in f32, in the shader's order of operations.
pub fn mandelbrot_reference(width: u32, height: u32, max_iter: u32) -> Vec<u32> {
    let mut out = Vec::with_capacity((width * height) as usize);
    for py in 0..height {
        for px in 0..width {
            let cx = -2.0f32 + (px as f32 + 0.5) * (2.5 / width as f32);
            let cy = -1.25f32 + (py as f32 + 0.5) * (2.5 / height as f32);
            let (mut x, mut y, mut i) = (0.0f32, 0.0f32, 0);
            while i < max_iter && x * x + y * y <= 4.0 {
                let xt = x * x - y * y + cx;
                y = 2.0 * x * y + cy;
                x = xt;
                i += 1;
            }
            out.push(i);
        }
    }
    out
}

pub(super) fn blur(builtin: &'static Builtin, size: u32) -> Result<Problem> {
    let side = round_up(size, 16)?;
    let image = test_image(side, side, 5);
    let mut p = Problem::new(builtin, side, [side / 16, side / 16, 1], MergeRule::Changes);
    p.param(0, [side, side, 0, 0]);
    p.input(1, u32_bytes(&image));
    p.output(2, u64::from(side) * u64::from(side) * 4);
    p.reference =
        Box::new(move |outputs| exact_u32(outputs, 2, &blur_reference(&image, side, side)));
    Ok(p)
}

/// A generated RGBA8 picture: smooth gradients, rings and noise, one u32 per pixel.
pub fn test_image(width: u32, height: u32, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::with_capacity((width * height) as usize);
    for y in 0..height {
        for x in 0..width {
            let (fx, fy) = (x as f32 / width as f32, y as f32 / height as f32);
            let d = ((fx - 0.5).powi(2) + (fy - 0.5).powi(2)).sqrt();
            let r = (255.0 * fx) as u32;
            let g = (255.0 * fy) as u32;
            let b = if ((d * 24.0) as u32).is_multiple_of(2) {
                230
            } else {
                40
            };
            let noise = rng.next_u32() & 0x1f;
            out.push(r | (g << 8) | ((b ^ noise) << 16) | (255 << 24));
        }
    }
    out
}

/// The 1-2-1 Gaussian blur with clamped edges, rounded to nearest.
pub fn blur_reference(src: &[u32], width: u32, height: u32) -> Vec<u32> {
    let (w, h) = (width as i64, height as i64);
    let mut out = Vec::with_capacity(src.len());
    for y in 0..h {
        for x in 0..w {
            let mut sum = [0u32; 4];
            for dy in -1..=1i64 {
                for dx in -1..=1i64 {
                    let sx = (x + dx).clamp(0, w - 1);
                    let sy = (y + dy).clamp(0, h - 1);
                    let p = src[(sy * w + sx) as usize];
                    let weight = ((2 - dx.abs()) * (2 - dy.abs())) as u32;
                    for (c, s) in sum.iter_mut().enumerate() {
                        *s += ((p >> (8 * c)) & 0xff) * weight;
                    }
                }
            }
            let c: Vec<u32> = sum.iter().map(|s| (s + 8) / 16).collect();
            out.push(c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24));
        }
    }
    out
}
