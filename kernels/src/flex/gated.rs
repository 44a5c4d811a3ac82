//! The Llama family's elementwise ops on Flex: the SwiGLU gate and the rotary position
//! embedding, forward and backward, one pass over memory each, chunks in parallel.

use super::math::{self, dispatch};
use super::{contiguous, float};
use burn::backend::flex::FlexTensor;
use burn::tensor::TensorMetadata;
use rayon::prelude::*;

/// Elements per parallel task.
const CHUNK: usize = 16_384;

/// `σ(g)`, through the vectorisable `exp`.
#[inline(always)]
fn sigmoid(g: f32) -> f32 {
    1.0 / (1.0 + math::exp(-g))
}

dispatch! {
    fn swiglu_chunk(gate: &[f32], up: &[f32], y: &mut [f32]) {
        for ((y, &g), &u) in y.iter_mut().zip(gate).zip(up) {
            *y = g * sigmoid(g) * u;
        }
    }
}

/// `silu(gate) ⊙ up` for two contiguous f32 tensors of one shape; `None` otherwise.
pub fn swiglu(gate: &FlexTensor, up: &FlexTensor) -> Option<FlexTensor> {
    let shape = gate.shape();
    if up.shape() != shape {
        return None;
    }
    let (gate, up) = (contiguous(gate)?, contiguous(up)?);
    let (gs, us) = (gate.f32s(), up.f32s());
    let mut y = vec![0f32; gs.len()];
    y.par_chunks_mut(CHUNK)
        .zip(gs.par_chunks(CHUNK).zip(us.par_chunks(CHUNK)))
        .for_each(|(y, (g, u))| swiglu_chunk(g, u, y));
    Some(float(y, shape))
}

dispatch! {
    fn swiglu_backward_chunk(gate: &[f32], up: &[f32], dy: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
        let outs = dgate.iter_mut().zip(dup.iter_mut());
        for ((dg, du), ((&g, &u), &dy)) in outs.zip(gate.iter().zip(up).zip(dy)) {
            let s = sigmoid(g);
            *du = dy * g * s;
            *dg = dy * u * s * (1.0 + g * (1.0 - s));
        }
    }
}

/// Gradients `(dgate, dup)` of [`swiglu`].
pub fn swiglu_backward(
    gate: &FlexTensor,
    up: &FlexTensor,
    dy: &FlexTensor,
) -> Option<(FlexTensor, FlexTensor)> {
    let shape = gate.shape();
    if up.shape() != shape || dy.shape() != shape {
        return None;
    }
    let (gate, up, dy) = (contiguous(gate)?, contiguous(up)?, contiguous(dy)?);
    let (gs, us, dys) = (gate.f32s(), up.f32s(), dy.f32s());
    let (mut dg, mut du) = (vec![0f32; gs.len()], vec![0f32; gs.len()]);
    dg.par_chunks_mut(CHUNK)
        .zip(du.par_chunks_mut(CHUNK))
        .zip(gs.par_chunks(CHUNK).zip(us.par_chunks(CHUNK)))
        .zip(dys.par_chunks(CHUNK))
        .for_each(|(((dg, du), (g, u)), dy)| swiglu_backward_chunk(g, u, dy, dg, du));
    Some((float(dg, shape.clone()), float(du, shape)))
}

dispatch! {
    /// Rows of `hd` (one token of one head each) against the table rows of their positions:
    /// `y₁ = x₁c₁ − x₂s₁`, `y₂ = x₂c₂ + x₁s₂`, or transposed `y₁ = x₁c₁ + x₂s₂`,
    /// `y₂ = x₂c₂ − x₁s₁`.
    fn rope_rows(x: &[f32], cos: &[f32], sin: &[f32], y: &mut [f32], hd: usize, transpose: bool) {
        let half = hd / 2;
        let rows = y.chunks_mut(hd).zip(x.chunks(hd));
        for ((y, x), (c, s)) in rows.zip(cos.chunks(hd).zip(sin.chunks(hd))) {
            let (y1, y2) = y.split_at_mut(half);
            let (x1, x2) = x.split_at(half);
            let ((c1, c2), (s1, s2)) = (c.split_at(half), s.split_at(half));
            for i in 0..half {
                let (a, b) = (x1[i], x2[i]);
                if transpose {
                    y1[i] = a * c1[i] + b * s2[i];
                    y2[i] = b * c2[i] - a * s1[i];
                } else {
                    y1[i] = a * c1[i] - b * s1[i];
                    y2[i] = b * c2[i] + a * s2[i];
                }
            }
        }
    }
}

/// The rotary embedding of `x` `[b, h, t, hd]` with tables `[t, hd]` (see
/// [`FusedOps::fused_rope`](crate::FusedOps::fused_rope)), or with `transpose` its gradient map;
/// `None` for shapes or dtypes it does not take.
pub fn rope(
    x: &FlexTensor,
    cos: &FlexTensor,
    sin: &FlexTensor,
    transpose: bool,
) -> Option<FlexTensor> {
    let shape = x.shape();
    let &[_, _, t, hd] = shape.as_slice() else {
        return None;
    };
    let table = [t, hd];
    if hd % 2 != 0 || cos.shape().as_slice() != table || sin.shape().as_slice() != table {
        return None;
    }
    let (x, cos, sin) = (contiguous(x)?, contiguous(cos)?, contiguous(sin)?);
    let (xs, cs, ss) = (x.f32s(), cos.f32s(), sin.f32s());
    let mut y = vec![0f32; xs.len()];
    // Whole sequences of one head per task (the table rows line up with the task's rows).
    let slab = (t * hd).max(1);
    y.par_chunks_mut(slab)
        .zip(xs.par_chunks(slab))
        .for_each(|(y, x)| rope_rows(x, cs, ss, y, hd, transpose));
    Some(float(y, shape))
}
