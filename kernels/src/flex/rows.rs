//! Row ops on Flex: LayerNorm, RMSNorm, GELU-with-bias and cross-entropy, forward and backward,
//! one pass (or two) over each row, rows in parallel.
//!
//! A parameter's gradient (γ, β, the bias) is a column sum over rows: each task of about 16k
//! elements' worth of rows writes its partial sums, and the partials are added in task order, so
//! the result does not depend on the number of threads.

use super::math::{self, dispatch, lane_max, lane_sum, lane_sum_map};
use super::{contiguous, float, written};
use crate::stats_shape;
use crate::{CrossEntropyOutput, LayerNormGrads, LayerNormOutput, RmsNormOutput};
use burn::backend::flex::FlexTensor;
use burn::tensor::{Shape, TensorMetadata};
use rayon::prelude::*;

/// Rows per parallel task for rows of `len` elements: about 16k elements a task.
pub(super) fn rows_per_task(len: usize) -> usize {
    (16_384 / len.max(1)).max(1)
}

/// Partial column sums of every task, added in task order.
fn column_sums(partials: Vec<Vec<f32>>, len: usize) -> Vec<f32> {
    let mut sum = vec![0f32; len];
    for p in partials {
        for (s, v) in sum.iter_mut().zip(p) {
            *s += v;
        }
    }
    sum
}

/// A backward over rows of `d` of `n` elements, rows in parallel, with one column sum:
/// `row(r, dx, sum)` writes row `r`'s `dx` and adds its part of the sum (a parameter's gradient).
fn rows_with_column_sum(
    n: usize,
    d: usize,
    row: impl Fn(usize, &mut [f32], &mut [f32]) + Sync,
) -> (Vec<f32>, Vec<f32>) {
    let per = rows_per_task(d);
    let mut partials: Vec<Vec<f32>> = Vec::new();
    // SAFETY: `row` assigns its row of `dx` whole (its callers' row functions write `*dx = …`
    // for every element, reading none), and the chunks cover the buffer.
    let dx = unsafe {
        written(n, |dx| {
            partials = dx
                .par_chunks_mut(per * d)
                .enumerate()
                .map(|(task, dx)| {
                    let mut sum = vec![0f32; d];
                    for (r, dx) in dx.chunks_mut(d).enumerate() {
                        row(task * per + r, dx, &mut sum);
                    }
                    sum
                })
                .collect();
        })
    };
    (dx, column_sums(partials, d))
}

// ---------------------------------------------------------------------------------------------
// LayerNorm

dispatch! {
    /// One row's output into `y`; returns its `(mean, rstd)`.
    fn layer_norm_row(x: &[f32], gamma: &[f32], beta: &[f32], y: &mut [f32], epsilon: f32) -> (f32, f32) {
        let d = x.len();
        let mean = lane_sum_map(x, |v| v) / d as f32;
        let var = lane_sum_map(x, |v| (v - mean) * (v - mean)) / d as f32;
        let rstd = 1.0 / (var + epsilon).sqrt();
        for (((y, &x), &g), &b) in y.iter_mut().zip(x).zip(gamma).zip(beta) {
            *y = (x - mean) * rstd * g + b;
        }
        (mean, rstd)
    }
}

/// LayerNorm over the last dimension (f32, any rank); `None` for other dtypes.
pub fn layer_norm(
    x: &FlexTensor,
    gamma: &FlexTensor,
    beta: &FlexTensor,
    epsilon: f64,
) -> Option<LayerNormOutput<burn::backend::Flex>> {
    let shape = x.shape();
    let (x, gamma, beta) = (contiguous(x)?, contiguous(gamma)?, contiguous(beta)?);
    let (xs, g, b) = (x.f32s(), gamma.f32s(), beta.f32s());
    let d = *shape.as_slice().last()?;
    if d == 0 || g.len() != d || b.len() != d {
        return None;
    }
    let rows = xs.len() / d;
    let mut mean = vec![0f32; rows];
    let mut rstd = vec![0f32; rows];
    let per = rows_per_task(d);
    // SAFETY: `layer_norm_row` assigns each element of its row (`*y = …`), every row once.
    let y = unsafe {
        written(xs.len(), |y| {
            y.par_chunks_mut(per * d)
                .zip(mean.par_chunks_mut(per))
                .zip(rstd.par_chunks_mut(per))
                .enumerate()
                .for_each(|(task, ((y, mean), rstd))| {
                    for r in 0..mean.len() {
                        let row = (task * per + r) * d;
                        let (m, s) = layer_norm_row(
                            &xs[row..row + d],
                            g,
                            b,
                            &mut y[r * d..(r + 1) * d],
                            epsilon as f32,
                        );
                        mean[r] = m;
                        rstd[r] = s;
                    }
                })
        })
    };
    let stats = stats_shape(&shape);
    Some(LayerNormOutput {
        output: float(y, shape),
        mean: float(mean, stats.clone()),
        rstd: float(rstd, stats),
    })
}

dispatch! {
    /// One row's `dx`; adds `dy·x̂` to `dgamma` and `dy` to `dbeta`.
    fn layer_norm_backward_row(
        x: &[f32],
        gamma: &[f32],
        dy: &[f32],
        stats: [f32; 2],
        dx: &mut [f32],
        sums: (&mut [f32], &mut [f32]),
    ) {
        let ([mean, rstd], (dgamma, dbeta)) = (stats, sums);
        let d = x.len();
        let (x, gamma, dy) = (&x[..d], &gamma[..d], &dy[..d]);
        let xhat = |i: usize| (x[i] - mean) * rstd;
        let mean_g = lane_sum(d, |i| dy[i] * gamma[i]) / d as f32;
        let mean_gx = lane_sum(d, |i| dy[i] * gamma[i] * xhat(i)) / d as f32;
        let rows = dx.iter_mut().zip(dgamma.iter_mut()).zip(dbeta.iter_mut());
        for ((((dx, dg), db), (&x, &g)), &dy) in rows.zip(x.iter().zip(gamma)).zip(dy) {
            let xh = (x - mean) * rstd;
            *dx = rstd * (dy * g - mean_g - xh * mean_gx);
            *dg += dy * xh;
            *db += dy;
        }
    }
}

/// Gradients of [`layer_norm`] from its statistics.
pub fn layer_norm_backward(
    x: &FlexTensor,
    gamma: &FlexTensor,
    mean: &FlexTensor,
    rstd: &FlexTensor,
    dy: &FlexTensor,
) -> Option<LayerNormGrads<burn::backend::Flex>> {
    let shape = x.shape();
    let (x, gamma, mean, rstd, dy) = (
        contiguous(x)?,
        contiguous(gamma)?,
        contiguous(mean)?,
        contiguous(rstd)?,
        contiguous(dy)?,
    );
    let (xs, g, mu, rs, dys) = (x.f32s(), gamma.f32s(), mean.f32s(), rstd.f32s(), dy.f32s());
    let d = g.len();
    if d == 0 || xs.len() != dys.len() || xs.len() != mu.len() * d || mu.len() != rs.len() {
        return None;
    }
    let per = rows_per_task(d);
    let mut partials: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
    // SAFETY: `layer_norm_backward_row` assigns each element of its row of `dx` (`*dx = …`).
    let dx = unsafe {
        written(xs.len(), |dx| {
            partials = dx
                .par_chunks_mut(per * d)
                .enumerate()
                .map(|(task, dx)| {
                    let (mut dg, mut db) = (vec![0f32; d], vec![0f32; d]);
                    for (r, dx) in dx.chunks_mut(d).enumerate() {
                        let row = task * per + r;
                        let span = row * d..(row + 1) * d;
                        layer_norm_backward_row(
                            &xs[span.clone()],
                            g,
                            &dys[span],
                            [mu[row], rs[row]],
                            dx,
                            (&mut dg, &mut db),
                        );
                    }
                    (dg, db)
                })
                .collect();
        })
    };
    let (dg, db): (Vec<_>, Vec<_>) = partials.into_iter().unzip();
    Some(LayerNormGrads {
        x: float(dx, shape),
        gamma: float(column_sums(dg, d), Shape::new([d])),
        beta: float(column_sums(db, d), Shape::new([d])),
    })
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

dispatch! {
    /// One row's output into `y`; returns its `rstd`.
    fn rms_norm_row(x: &[f32], gamma: &[f32], y: &mut [f32], epsilon: f32) -> f32 {
        let d = x.len();
        let rstd = 1.0 / (lane_sum_map(x, |v| v * v) / d as f32 + epsilon).sqrt();
        for ((y, &x), &g) in y.iter_mut().zip(x).zip(gamma) {
            *y = x * rstd * g;
        }
        rstd
    }
}

/// RMSNorm over the last dimension (f32, any rank): `x·rstd·γ`, `rstd = 1/√(mean(x²) + ε)`;
/// `None` for other dtypes.
pub fn rms_norm(
    x: &FlexTensor,
    gamma: &FlexTensor,
    epsilon: f64,
) -> Option<RmsNormOutput<burn::backend::Flex>> {
    let shape = x.shape();
    let (x, gamma) = (contiguous(x)?, contiguous(gamma)?);
    let (xs, g) = (x.f32s(), gamma.f32s());
    let d = *shape.as_slice().last()?;
    if d == 0 || g.len() != d {
        return None;
    }
    let rows = xs.len() / d;
    let mut rstd = vec![0f32; rows];
    let per = rows_per_task(d);
    // SAFETY: `rms_norm_row` assigns each element of its row (`*y = …`), every row once.
    let y = unsafe {
        written(xs.len(), |y| {
            y.par_chunks_mut(per * d)
                .zip(rstd.par_chunks_mut(per))
                .enumerate()
                .for_each(|(task, (y, rstd))| {
                    for (r, rstd) in rstd.iter_mut().enumerate() {
                        let row = (task * per + r) * d;
                        let out = &mut y[r * d..(r + 1) * d];
                        *rstd = rms_norm_row(&xs[row..row + d], g, out, epsilon as f32);
                    }
                })
        })
    };
    Some(RmsNormOutput {
        output: float(y, shape.clone()),
        rstd: float(rstd, stats_shape(&shape)),
    })
}

dispatch! {
    /// One row's `dx` (with `x̂ = x·r`, `g = dy·γ`: `r·(g − x̂·mean(g·x̂))`); adds `dy·x̂` to
    /// `dgamma`.
    fn rms_norm_backward_row(
        x: &[f32],
        gamma: &[f32],
        dy: &[f32],
        rstd: f32,
        dx: &mut [f32],
        dgamma: &mut [f32],
    ) {
        let d = x.len();
        let (x, gamma, dy) = (&x[..d], &gamma[..d], &dy[..d]);
        let mean_gx = lane_sum(d, |i| dy[i] * gamma[i] * x[i] * rstd) / d as f32;
        let rows = dx.iter_mut().zip(dgamma.iter_mut());
        for (((dx, dg), (&x, &g)), &dy) in rows.zip(x.iter().zip(gamma)).zip(dy) {
            let xh = x * rstd;
            *dx = rstd * (dy * g - xh * mean_gx);
            *dg += dy * xh;
        }
    }
}

/// Gradients `(dx, dγ)` of [`rms_norm`] from its `rstd`.
pub fn rms_norm_backward(
    x: &FlexTensor,
    gamma: &FlexTensor,
    rstd: &FlexTensor,
    dy: &FlexTensor,
) -> Option<(FlexTensor, FlexTensor)> {
    let shape = x.shape();
    let (x, gamma, rstd, dy) = (
        contiguous(x)?,
        contiguous(gamma)?,
        contiguous(rstd)?,
        contiguous(dy)?,
    );
    let (xs, g, rs, dys) = (x.f32s(), gamma.f32s(), rstd.f32s(), dy.f32s());
    let d = g.len();
    if d == 0 || xs.len() != dys.len() || xs.len() != rs.len() * d {
        return None;
    }
    let (dx, dg) = rows_with_column_sum(xs.len(), d, |row, dx, dg| {
        let span = row * d..(row + 1) * d;
        rms_norm_backward_row(&xs[span.clone()], g, &dys[span], rs[row], dx, dg);
    });
    Some((float(dx, shape), float(dg, Shape::new([d]))))
}

// ---------------------------------------------------------------------------------------------
// GELU with bias (erf form, or the tanh approximation)

const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// `1/√(2π)`.
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;
/// `√(2/π)`, the tanh form's scale.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The tanh form's cubic coefficient.
const GELU_CUBIC: f32 = 0.044_715;

/// `(Φ̃(z), Φ̃'(z)·z)` of the tanh form: `gelu(z) = z·Φ̃(z)`, `Φ̃ = (1 + tanh u)/2` with
/// `u = √(2/π)(z + 0.044715 z³)`, so `gelu'(z) = Φ̃ + z·(1 − tanh² u)·u'/2`.
#[inline(always)]
fn tanh_cdf(z: f32) -> (f32, f32) {
    let t = math::tanh(SQRT_2_OVER_PI * (z + GELU_CUBIC * z * z * z));
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * z * z);
    (0.5 * (1.0 + t), 0.5 * z * (1.0 - t * t) * du)
}

dispatch! {
    fn gelu_bias_row(x: &[f32], bias: &[f32], y: &mut [f32], tanh: bool) {
        for ((y, &x), &b) in y.iter_mut().zip(x).zip(bias) {
            let z = x + b;
            *y = if tanh {
                z * tanh_cdf(z).0
            } else {
                0.5 * z * (1.0 + math::erf(z * FRAC_1_SQRT_2))
            };
        }
    }
}

/// `gelu(x + bias)` with `bias` over the last dimension (with `tanh`, the tanh approximation).
pub fn gelu_bias(x: &FlexTensor, bias: &FlexTensor, tanh: bool) -> Option<FlexTensor> {
    let shape = x.shape();
    let (x, bias) = (contiguous(x)?, contiguous(bias)?);
    let (xs, b) = (x.f32s(), bias.f32s());
    let d = b.len();
    if d == 0 || *shape.as_slice().last()? != d {
        return None;
    }
    let per = rows_per_task(d);
    // SAFETY: `gelu_bias_row` assigns each element of its row (`*y = …`), every row once.
    let y = unsafe {
        written(xs.len(), |y| {
            y.par_chunks_mut(per * d)
                .zip(xs.par_chunks(per * d))
                .for_each(|(y, x)| {
                    for (y, x) in y.chunks_mut(d).zip(x.chunks(d)) {
                        gelu_bias_row(x, b, y, tanh);
                    }
                })
        })
    };
    Some(float(y, shape))
}

dispatch! {
    fn gelu_bias_backward_row(
        x: &[f32],
        bias: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        dbias: &mut [f32],
        tanh: bool,
    ) {
        let outs = dx.iter_mut().zip(dbias.iter_mut());
        for (((dx, db), (&x, &b)), &dy) in outs.zip(x.iter().zip(bias)).zip(dy) {
            let z = x + b;
            let slope = if tanh {
                let (cdf, rest) = tanh_cdf(z);
                cdf + rest
            } else {
                let cdf = 0.5 * (1.0 + math::erf(z * FRAC_1_SQRT_2));
                cdf + z * FRAC_1_SQRT_2PI * math::exp(-0.5 * z * z)
            };
            let g = dy * slope;
            *dx = g;
            *db += g;
        }
    }
}

/// Gradients `(dx, dbias)` of [`gelu_bias`].
pub fn gelu_bias_backward(
    x: &FlexTensor,
    bias: &FlexTensor,
    dy: &FlexTensor,
    tanh: bool,
) -> Option<(FlexTensor, FlexTensor)> {
    let shape = x.shape();
    let (x, bias, dy) = (contiguous(x)?, contiguous(bias)?, contiguous(dy)?);
    let (xs, b, dys) = (x.f32s(), bias.f32s(), dy.f32s());
    let d = b.len();
    if d == 0 || xs.len() != dys.len() || *shape.as_slice().last()? != d {
        return None;
    }
    let (dx, db) = rows_with_column_sum(xs.len(), d, |row, dx, db| {
        let span = row * d..(row + 1) * d;
        gelu_bias_backward_row(&xs[span.clone()], b, &dys[span], dx, db, tanh);
    });
    Some((float(dx, shape), float(db, Shape::new([d]))))
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy fused with the log-softmax

dispatch! {
    /// `log Σ exp(x)` of one row.
    fn log_sum_exp(x: &[f32]) -> f32 {
        let max = lane_max(x);
        if max == f32::NEG_INFINITY || max.is_nan() {
            return max;
        }
        max + lane_sum_map(x, |v| math::exp(v - max)).ln()
    }
}

dispatch! {
    /// `scale·exp(x − lse)` into `g`.
    fn softmax_grad_row(x: &[f32], lse: f32, scale: f32, g: &mut [f32]) {
        for (g, &x) in g.iter_mut().zip(x) {
            *g = scale * math::exp(x - lse);
        }
    }
}

/// The targets as `i64` (Flex keeps ints as i32 or i64).
fn targets_of(targets: &FlexTensor) -> Vec<i64> {
    targets.clone().into_data().iter::<i64>().collect()
}

/// Cross-entropy of `[rows, vocab]` logits: per-row loss and log-sum-exp.
pub fn cross_entropy(
    logits: &FlexTensor,
    targets: &FlexTensor,
) -> Option<CrossEntropyOutput<burn::backend::Flex>> {
    let shape = logits.shape();
    let [rows, vocab] = shape.dims::<2>();
    let logits = contiguous(logits)?;
    let x = logits.f32s();
    let targets = targets_of(targets);
    if targets.len() != rows || vocab == 0 || targets.iter().any(|&t| t >= vocab as i64) {
        return None;
    }
    let mut loss = vec![0f32; rows];
    let mut lse = vec![0f32; rows];
    loss.par_iter_mut()
        .zip(lse.par_iter_mut())
        .enumerate()
        .with_min_len(rows_per_task(vocab))
        .for_each(|(r, (loss, lse))| {
            let row = &x[r * vocab..(r + 1) * vocab];
            *lse = log_sum_exp(row);
            let t = targets[r];
            *loss = if t < 0 { 0.0 } else { *lse - row[t as usize] };
        });
    Some(CrossEntropyOutput {
        loss: float(loss, Shape::new([rows])),
        lse: float(lse, Shape::new([rows])),
    })
}

/// Gradient w.r.t. the logits: `dloss·(exp(x − lse) − onehot(target))`, 0 on ignored rows.
pub fn cross_entropy_backward(
    logits: &FlexTensor,
    targets: &FlexTensor,
    lse: &FlexTensor,
    dloss: &FlexTensor,
) -> Option<FlexTensor> {
    let shape = logits.shape();
    let [rows, vocab] = shape.dims::<2>();
    let (logits, lse, dloss) = (contiguous(logits)?, contiguous(lse)?, contiguous(dloss)?);
    let (x, lse, dloss) = (logits.f32s(), lse.f32s(), dloss.f32s());
    let targets = targets_of(targets);
    if targets.len() != rows
        || lse.len() != rows
        || dloss.len() != rows
        || vocab == 0
        || targets.iter().any(|&t| t >= vocab as i64)
    {
        return None;
    }
    // SAFETY: every row is assigned whole: zeros for an ignored target, else
    // `softmax_grad_row`'s `*g = …` for each element before the target's is read.
    let g = unsafe {
        written(x.len(), |g| {
            g.par_chunks_mut(vocab)
                .enumerate()
                .with_min_len(rows_per_task(vocab))
                .for_each(|(r, g)| {
                    let t = targets[r];
                    if t < 0 {
                        g.fill(0.0);
                        return;
                    }
                    softmax_grad_row(&x[r * vocab..(r + 1) * vocab], lse[r], dloss[r], g);
                    g[t as usize] -= dloss[r];
                })
        })
    };
    Some(float(g, shape))
}
