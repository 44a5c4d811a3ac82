//! Flash attention backward: the probabilities recomputed from the forward's log-sum-exp, one
//! unit per query row for dQ (and `delta = rowsum(dO∘O)`), then one unit per key row for dK and
//! dV.

use super::attention::{
    attention_launch, attention_shape, dot, keys_end, load_row, query_row, unit_row, zeros,
};
use super::{arg, contiguous, empty_f32, empty_like, launched};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// dQ (and `delta = rowsum(dO∘O)`, written for the dK/dV kernel), one unit per query row.
#[cube(launch)]
fn attention_backward_q_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    output: &Tensor<F>,
    lse: &Tensor<f32>,
    d_output: &Tensor<F>,
    dq: &mut Tensor<F>,
    delta_out: &mut Tensor<f32>,
    seq_q: u32,
    seq_k: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let seq_k = seq_k as usize;
    let (i, row, k_base) = query_row(seq_q as usize, seq_k, head_dim);
    let qr = load_row::<F>(q, row * head_dim, scale, head_dim);
    let dor = load_row::<F>(d_output, row * head_dim, f32::new(1.0), head_dim);
    let delta = dot::<F>(&dor, output, row * head_dim, head_dim);
    let mut acc = zeros(head_dim);
    let lse_i = lse[row];
    for j in 0..keys_end(i, seq_k, causal) {
        let kj = k_base + j * head_dim;
        let s = dot::<F>(&qr, k, kj, head_dim);
        let dp = dot::<F>(&dor, v, kj, head_dim);
        let ds = f32::exp(s - lse_i) * (dp - delta);
        #[unroll]
        for d in 0..head_dim {
            acc[d] += ds * f32::cast_from(k[kj + d]);
        }
    }
    #[unroll]
    for d in 0..head_dim {
        dq[row * head_dim + d] = F::cast_from(acc[d] * scale);
    }
    delta_out[row] = delta;
}

/// dK and dV, one unit per key row.
#[cube(launch)]
fn attention_backward_kv_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    d_output: &Tensor<F>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    seq_q: u32,
    seq_k: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let bh = CUBE_POS_Y as usize;
    let seq_q = seq_q as usize;
    let seq_k = seq_k as usize;
    let j = unit_row(seq_k);
    let key = bh * seq_k + j;
    let q_base = bh * seq_q;
    let kr = load_row::<F>(k, key * head_dim, f32::new(1.0), head_dim);
    let vr = load_row::<F>(v, key * head_dim, f32::new(1.0), head_dim);
    let mut dk_acc = zeros(head_dim);
    let mut dv_acc = zeros(head_dim);
    // The queries that attend to key `j`: all, or `j..` when causal.
    let mut start = 0;
    if causal {
        start = j;
    }
    for i in start..seq_q {
        let qi = (q_base + i) * head_dim;
        let s = dot::<F>(&kr, q, qi, head_dim);
        let dp = dot::<F>(&vr, d_output, qi, head_dim);
        let p = f32::exp(s * scale - lse[q_base + i]);
        let ds = p * (dp - delta[q_base + i]);
        #[unroll]
        for d in 0..head_dim {
            dv_acc[d] += p * f32::cast_from(d_output[qi + d]);
            dk_acc[d] += ds * f32::cast_from(q[qi + d]);
        }
    }
    #[unroll]
    for d in 0..head_dim {
        dk[key * head_dim + d] = F::cast_from(dk_acc[d] * scale);
        dv[key * head_dim + d] = F::cast_from(dv_acc[d]);
    }
}

/// `(dq, dk, dv)` from `[q, k, v, output, lse, d_output]`.
pub(super) fn backward<R: CubeRuntime>(
    operands: [CubeTensor<R>; 6],
    scale: f64,
    causal: bool,
) -> [CubeTensor<R>; 3] {
    let [q, k, v, output, lse, d_output] = contiguous(operands);
    let (bh, sq, sk, d) = attention_shape(&q, &k, causal);
    let [dq, dk, dv] = [&q, &k, &v].map(empty_like);
    let delta = empty_f32(&q, [bh * sq]);
    let (count, dim) = attention_launch(sq, bh);
    attention_backward_q_kernel::launch::<R>(
        &q.client,
        count,
        dim,
        arg(&q),
        arg(&k),
        arg(&v),
        arg(&output),
        arg(&lse),
        arg(&d_output),
        arg(&dq),
        arg(&delta),
        sq as u32,
        sk as u32,
        scale as f32,
        d,
        causal,
        q.dtype.into(),
    );
    let (count, dim) = attention_launch(sk, bh);
    attention_backward_kv_kernel::launch::<R>(
        &q.client,
        count,
        dim,
        arg(&q),
        arg(&k),
        arg(&v),
        arg(&lse),
        arg(&delta),
        arg(&d_output),
        arg(&dk),
        arg(&dv),
        sq as u32,
        sk as u32,
        scale as f32,
        d,
        causal,
        q.dtype.into(),
    );
    launched(2);
    [dq, dk, dv]
}
