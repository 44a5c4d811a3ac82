//! Flash attention forward: one unit per query row over `[batch·heads, seq, head_dim]`, an online
//! softmax over the keys, the score matrix never stored; the per-row helpers the backward kernels
//! share.

use super::{NEG_BIG, arg, contiguous, empty_f32, empty_like, launched};
use burn::tensor::TensorMetadata;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim};

/// This unit's row (query or key) of `seq` within its (batch, head), `CUBE_POS_Y`; a unit past
/// the last row stops here.
#[cube]
pub(super) fn unit_row(seq: usize) -> usize {
    let i = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    if i >= seq {
        terminate!();
    }
    i
}

/// For one unit per query row: `(i, row, k_base)`, this unit's query within its (batch, head),
/// that query's row over all of them, and the first element of the (batch, head)'s keys; a unit
/// past the last query stops here.
#[cube]
pub(super) fn query_row(
    seq_q: usize,
    seq_k: usize,
    #[comptime] head_dim: usize,
) -> (usize, usize, usize) {
    let bh = CUBE_POS_Y as usize;
    let i = unit_row(seq_q);
    (i, bh * seq_q + i, bh * seq_k * head_dim)
}

/// `t[base..base + head_dim]` times `scale`, in f32.
#[cube]
pub(super) fn load_row<F: Float>(
    t: &Tensor<F>,
    base: usize,
    scale: f32,
    #[comptime] head_dim: usize,
) -> Array<f32> {
    let mut row = Array::<f32>::new(head_dim);
    #[unroll]
    for d in 0..head_dim {
        row[d] = f32::cast_from(t[base + d]) * scale;
    }
    row
}

/// A zeroed accumulator of `head_dim`.
#[cube]
pub(super) fn zeros(#[comptime] head_dim: usize) -> Array<f32> {
    let mut acc = Array::<f32>::new(head_dim);
    #[unroll]
    for d in 0..head_dim {
        acc[d] = f32::new(0.0);
    }
    acc
}

/// `Σ_d a[d]·t[base + d]`.
#[cube]
pub(super) fn dot<F: Float>(
    a: &Array<f32>,
    t: &Tensor<F>,
    base: usize,
    #[comptime] head_dim: usize,
) -> f32 {
    let mut s = f32::new(0.0);
    #[unroll]
    for d in 0..head_dim {
        s += a[d] * f32::cast_from(t[base + d]);
    }
    s
}

/// The keys query `i` attends to: `0..seq_k`, or `0..=i` when causal.
#[cube]
pub(super) fn keys_end(i: usize, seq_k: usize, #[comptime] causal: bool) -> usize {
    let mut end = seq_k;
    if causal {
        end = i + 1;
    }
    end
}

#[cube(launch)]
fn attention_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    output: &mut Tensor<F>,
    lse_out: &mut Tensor<f32>,
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
    let mut acc = zeros(head_dim);
    let mut m = f32::new(NEG_BIG);
    let mut l = f32::new(0.0);
    for j in 0..keys_end(i, seq_k, causal) {
        let kj = k_base + j * head_dim;
        let s = dot::<F>(&qr, k, kj, head_dim);
        let nm = f32::max(m, s);
        let corr = f32::exp(m - nm);
        let p = f32::exp(s - nm);
        l = l * corr + p;
        #[unroll]
        for d in 0..head_dim {
            acc[d] = acc[d] * corr + p * f32::cast_from(v[kj + d]);
        }
        m = nm;
    }
    let inv = f32::new(1.0) / l;
    #[unroll]
    for d in 0..head_dim {
        output[row * head_dim + d] = F::cast_from(acc[d] * inv);
    }
    lse_out[row] = m + f32::ln(l);
}

/// `(batch·heads, seq_q, seq_k, head_dim)` of `q` and `k` `[batch, heads, seq, head_dim]`.
pub(super) fn attention_shape<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    causal: bool,
) -> (usize, usize, usize, usize) {
    let [b, h, sq, d] = q.shape().dims::<4>();
    let [kb, kh, sk, kd] = k.shape().dims::<4>();
    assert!(
        (b, h, d) == (kb, kh, kd),
        "attention: q {:?} and k {:?} differ in batch, heads or head_dim",
        q.shape(),
        k.shape()
    );
    assert!(
        !causal || sq == sk,
        "causal attention needs as many queries as keys ({sq} vs {sk})"
    );
    (b * h, sq, sk, d)
}

/// One unit per row of `seq`, cubes of 64 along x, one (batch, head) per y.
pub(super) fn attention_launch(seq: usize, batch_heads: usize) -> (CubeCount, CubeDim) {
    let block = 64usize;
    (
        CubeCount::Static(seq.div_ceil(block) as u32, batch_heads as u32, 1),
        CubeDim::new_1d(block as u32),
    )
}

/// `(output, lse)`.
pub(super) fn forward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    scale: f64,
    causal: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [q, k, v] = contiguous([q, k, v]);
    let (bh, sq, sk, d) = attention_shape(&q, &k, causal);
    let shape = q.shape();
    let output = empty_like(&q);
    let lse = empty_f32(&q, [shape[0], shape[1], sq]);
    let (count, dim) = attention_launch(sq, bh);
    attention_kernel::launch::<R>(
        &q.client,
        count,
        dim,
        arg(&q),
        arg(&k),
        arg(&v),
        arg(&output),
        arg(&lse),
        sq as u32,
        sk as u32,
        scale as f32,
        d,
        causal,
        q.dtype.into(),
    );
    launched(1);
    (output, lse)
}
