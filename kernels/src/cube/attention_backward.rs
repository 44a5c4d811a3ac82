//! Flash attention backward: the probabilities recomputed from the forward's log-sum-exp, one
//! unit per query row for dQ (and `delta = rowsum(dO∘O)`), then one unit per key row for dK and
//! dV.

use super::attention::{
    attention_launch, attention_shape, dot, keys_end, load_row, unit_row, zeros,
};
use super::{empty, launched};
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
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
    let bh = CUBE_POS_Y as usize;
    let seq_q = seq_q as usize;
    let seq_k = seq_k as usize;
    let i = unit_row(seq_q);
    let row = bh * seq_q + i;
    let k_base = bh * seq_k * head_dim;
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

/// `(dq, dk, dv)`.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    output: CubeTensor<R>,
    lse: CubeTensor<R>,
    d_output: CubeTensor<R>,
    scale: f64,
    causal: bool,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
    let (output, lse, d_output) = (
        into_contiguous(output),
        into_contiguous(lse),
        into_contiguous(d_output),
    );
    let (bh, sq, sk, d) = attention_shape(&q, &k, causal);
    let dq = empty(&q, q.shape(), q.dtype);
    let dk = empty(&k, k.shape(), k.dtype);
    let dv = empty(&v, v.shape(), v.dtype);
    let delta = empty(&q, Shape::new([bh * sq]), DType::F32);
    let (count, dim) = attention_launch(sq, bh);
    attention_backward_q_kernel::launch::<R>(
        &q.client,
        count,
        dim,
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        output.into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        d_output.clone().into_tensor_arg(),
        dq.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
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
        q.clone().into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        lse.into_tensor_arg(),
        delta.into_tensor_arg(),
        d_output.into_tensor_arg(),
        dk.clone().into_tensor_arg(),
        dv.clone().into_tensor_arg(),
        sq as u32,
        sk as u32,
        scale as f32,
        d,
        causal,
        q.dtype.into(),
    );
    launched(2);
    (dq, dk, dv)
}
