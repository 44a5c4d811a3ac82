//! The optimizer tail on Flex: unscale + `Σg²` + non-finite flag in one pass, and AdamW in one
//! pass over parameter, gradient and moments (in place where the buffers are not shared),
//! chunks in parallel.

use super::math::{LANES, dispatch};
use super::{contiguous, float, owned};
use crate::{AdamWState, AdamWStep, UnscaleOutput};
use burn::backend::flex::FlexTensor;
use burn::tensor::{Shape, TensorMetadata};
use rayon::prelude::*;

/// Elements per parallel task (fixed, so sums do not depend on the number of threads).
const CHUNK: usize = 1 << 16;

dispatch! {
    /// `g·inv` in place; returns `Σ (g·inv)²` and whether any value is not finite.
    fn unscale_chunk(g: &mut [f32], inv: f32) -> (f64, bool) {
        let mut acc = [0f32; LANES];
        let mut bad = [false; LANES];
        let mut chunks = g.chunks_exact_mut(LANES);
        for c in &mut chunks {
            for l in 0..LANES {
                let v = c[l] * inv;
                c[l] = v;
                acc[l] += v * v;
                bad[l] |= !v.is_finite();
            }
        }
        for (l, v) in chunks.into_remainder().iter_mut().enumerate() {
            *v *= inv;
            acc[l] += *v * *v;
            bad[l] |= !v.is_finite();
        }
        (acc.iter().map(|&a| a as f64).sum(), bad.iter().any(|&b| b))
    }
}

dispatch! {
    /// [`unscale_chunk`] by 1: `Σ g²` and whether any value is not finite, the same sums in the
    /// same order, nothing written.
    fn squares_chunk(g: &[f32]) -> (f64, bool) {
        let mut acc = [0f32; LANES];
        let mut bad = [false; LANES];
        let mut chunks = g.chunks_exact(LANES);
        for c in &mut chunks {
            for l in 0..LANES {
                let v = c[l];
                acc[l] += v * v;
                bad[l] |= !v.is_finite();
            }
        }
        for (l, v) in chunks.remainder().iter().enumerate() {
            acc[l] += *v * *v;
            bad[l] |= !v.is_finite();
        }
        (acc.iter().map(|&a| a as f64).sum(), bad.iter().any(|&b| b))
    }
}

/// [`FusedOps::fused_unscale`](crate::FusedOps::fused_unscale) on an f32 gradient. By an inverse
/// scale of 1 (no loss scale: f32 and bf16 runs) the gradient is only read and handed back as it
/// is (no copy of a shared buffer, no write).
pub fn unscale(grad: FlexTensor, inv_scale: f64) -> Option<UnscaleOutput<burn::backend::Flex>> {
    let (grad, parts): (FlexTensor, Vec<(f64, bool)>) = if inv_scale == 1.0 {
        let parts = contiguous(&grad)?
            .f32s()
            .par_chunks(CHUNK)
            .map(squares_chunk)
            .collect();
        (grad, parts)
    } else {
        let mut grad = owned(grad)?;
        let parts = grad
            .storage_mut::<f32>()
            .par_chunks_mut(CHUNK)
            .map(|c| unscale_chunk(c, inv_scale as f32))
            .collect();
        (grad, parts)
    };
    let sum: f64 = parts.iter().map(|p| p.0).sum();
    let bad = parts.iter().any(|p| p.1);
    Some(UnscaleOutput {
        grad,
        sum_squares: float(vec![sum as f32], Shape::new([1])),
        non_finite: float(vec![if bad { 1.0 } else { 0.0 }], Shape::new([1])),
    })
}

/// The coefficients of one AdamW step, in f32.
#[derive(Clone, Copy)]
struct Coefficients {
    beta1: f32,
    beta2: f32,
    decay: f32,
    lr: f32,
    bc1: f32,
    bc2: f32,
    epsilon: f32,
    grad_scale: f32,
}

dispatch! {
    fn adamw_chunk(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: Coefficients) {
        for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
            let g = g * c.grad_scale;
            let m2 = c.beta1 * *m + (1.0 - c.beta1) * g;
            let v2 = c.beta2 * *v + (1.0 - c.beta2) * (g * g);
            let m_hat = m2 / c.bc1;
            let v_hat = v2 / c.bc2;
            *p = *p * c.decay - c.lr * (m_hat / (v_hat.sqrt() + c.epsilon));
            *m = m2;
            *v = v2;
        }
    }
}

/// One AdamW step on host slices (parameter, gradient, moments; in place), chunks in parallel:
/// the arithmetic of [`adamw`] (the same function per element), so a step on host buffers gives
/// the Flex kernel's numbers bit for bit. `grad_scale` multiplies the gradient as it is read.
pub fn adamw_host(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    grad_scale: f32,
    s: AdamWStep,
) {
    assert!(
        g.len() == p.len() && m.len() == p.len() && v.len() == p.len(),
        "AdamW on host slices of different lengths"
    );
    let c = coefficients(s, grad_scale);
    p.par_chunks_mut(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK))
        .for_each(|(((p, m), v), g)| adamw_chunk(p, g, m, v, c));
}

/// The step's coefficients in f32.
fn coefficients(s: AdamWStep, grad_scale: f32) -> Coefficients {
    let t = s.step.max(1) as i32;
    Coefficients {
        beta1: s.beta1 as f32,
        beta2: s.beta2 as f32,
        decay: (1.0 - s.lr * s.weight_decay) as f32,
        lr: s.lr as f32,
        bc1: (1.0 - s.beta1.powi(t)) as f32,
        bc2: (1.0 - s.beta2.powi(t)) as f32,
        epsilon: s.epsilon as f32,
        grad_scale,
    }
}

/// The value of a `[1]` tensor.
fn scalar(t: &FlexTensor) -> Option<f32> {
    contiguous(t)?.f32s().first().copied()
}

/// [`FusedOps::fused_adamw`](crate::FusedOps::fused_adamw) on f32 tensors.
pub fn adamw(
    param: FlexTensor,
    grad: FlexTensor,
    m: FlexTensor,
    v: FlexTensor,
    grad_scale: FlexTensor,
    skip: FlexTensor,
    s: AdamWStep,
) -> Option<AdamWState<burn::backend::Flex>> {
    let n = param.shape().num_elements();
    if grad.shape().num_elements() != n || m.shape().num_elements() != n || v.shape() != m.shape() {
        return None;
    }
    if scalar(&skip)? != 0.0 {
        return Some(AdamWState { param, m, v });
    }
    let grad_scale = scalar(&grad_scale)?;
    let grad = contiguous(&grad)?;
    let (mut param, mut m, mut v) = (owned(param)?, owned(m)?, owned(v)?);
    adamw_host(
        param.storage_mut::<f32>(),
        grad.f32s(),
        m.storage_mut::<f32>(),
        v.storage_mut::<f32>(),
        grad_scale,
        s,
    );
    Some(AdamWState { param, m, v })
}
