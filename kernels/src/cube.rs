//! The `#[cube]` kernels and `FusedOps` for `CubeBackend` (Wgpu, Cuda, … — every CubeCL runtime).
//!
//! Conventions shared by the kernels:
//! * inputs are made contiguous first; a row is `cols` consecutive elements;
//! * row kernels run one cube per row with `block` (a power of two, ≤ 256) units striding over
//!   the row, and reduce through shared memory (a tree, deterministic);
//! * arithmetic is in f32 whatever the tensor dtype (f16 and bf16 tensors are read and written in
//!   their dtype); per-row statistics (mean, 1/σ, log-sum-exp) are f32 tensors;
//! * "-infinity" is `-3.0e38` (WGSL has no infinity literal), which `exp` flushes to 0.

use crate::{
    AdamWState, AdamWStep, AttentionGrads, AttentionOutput, CrossEntropyOutput, FusedOps,
    LayerNormGrads, LayerNormOutput, RmsNormOutput, UnscaleOutput, stats_shape,
};
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim, calculate_cube_count_elemwise};
use std::sync::atomic::{AtomicU64, Ordering};

const NEG_BIG: f32 = -3.0e38;

/// Kernel launches issued by this module since start-up (exact; for the benchmark's
/// launches-per-call column and the tests).
static LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// Fused-kernel launches so far (process-wide).
pub fn launches() -> u64 {
    LAUNCHES.load(Ordering::Relaxed)
}

fn launched(n: u64) {
    LAUNCHES.fetch_add(n, Ordering::Relaxed);
}

// ---------------------------------------------------------------------------------------------
// Reductions within a cube (one row per cube).

/// Tree-sum of `shared[0..CUBE_DIM_X]` into `shared[0]`. Callers sync before reading `[0]` and
/// again before reusing `shared`.
#[cube]
fn tree_sum(shared: &mut SharedMemory<f32>) {
    let tid = UNIT_POS_X as usize;
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if tid < stride {
            shared[tid] += shared[tid + stride];
        }
        sync_cube();
        stride /= 2;
    }
}

/// Tree-combine of per-unit online-softmax pairs (max, Σexp(x − max)) into `[0]`.
#[cube]
fn tree_max_sum(maxes: &mut SharedMemory<f32>, sums: &mut SharedMemory<f32>) {
    let tid = UNIT_POS_X as usize;
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if tid < stride {
            let m1 = maxes[tid];
            let m2 = maxes[tid + stride];
            let m = f32::max(m1, m2);
            sums[tid] = sums[tid] * f32::exp(m1 - m) + sums[tid + stride] * f32::exp(m2 - m);
            maxes[tid] = m;
        }
        sync_cube();
        stride /= 2;
    }
}

/// The row handled by this cube (rows are spread over the x and y cube counts).
#[cube]
fn row_index() -> usize {
    (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize
}

/// Online max and Σexp over row `base..base + cols`, combined over the cube.
#[cube]
fn row_max_sumexp<F: Float>(
    input: &Tensor<F>,
    base: usize,
    cols: usize,
    maxes: &mut SharedMemory<f32>,
    sums: &mut SharedMemory<f32>,
) {
    let tid = UNIT_POS_X as usize;
    let step = CUBE_DIM_X as usize;
    let mut m = f32::new(NEG_BIG);
    let mut s = f32::new(0.0);
    let mut c = tid;
    while c < cols {
        let v = f32::cast_from(input[base + c]);
        let nm = f32::max(m, v);
        s = s * f32::exp(m - nm) + f32::exp(v - nm);
        m = nm;
        c += step;
    }
    maxes[tid] = m;
    sums[tid] = s;
    sync_cube();
    tree_max_sum(maxes, sums);
}

// ---------------------------------------------------------------------------------------------
// Softmax and log-softmax.

#[cube(launch)]
fn softmax_kernel<F: Float>(
    input: &Tensor<F>,
    output: &mut Tensor<F>,
    rows: u32,
    cols: u32,
    #[comptime] block: usize,
    #[comptime] log: bool,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index();
    if row >= rows as usize {
        terminate!();
    }
    let cols = cols as usize;
    let base = row * cols;
    let mut maxes = SharedMemory::<f32>::new(block);
    let mut sums = SharedMemory::<f32>::new(block);
    row_max_sumexp::<F>(input, base, cols, &mut maxes, &mut sums);
    let max = maxes[0];
    let lse = max + f32::ln(sums[0]);
    let mut c = UNIT_POS_X as usize;
    while c < cols {
        let v = f32::cast_from(input[base + c]);
        if log {
            output[base + c] = F::cast_from(v - lse);
        } else {
            output[base + c] = F::cast_from(f32::exp(v - lse));
        }
        c += CUBE_DIM_X as usize;
    }
}

#[cube(launch)]
fn softmax_backward_kernel<F: Float>(
    y: &Tensor<F>,
    dy: &Tensor<F>,
    dx: &mut Tensor<F>,
    rows: u32,
    cols: u32,
    #[comptime] block: usize,
    #[comptime] log: bool,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index();
    if row >= rows as usize {
        terminate!();
    }
    let cols = cols as usize;
    let base = row * cols;
    let tid = UNIT_POS_X as usize;
    let mut shared = SharedMemory::<f32>::new(block);
    // softmax: Σ dy·y; log-softmax: Σ dy.
    let mut acc = f32::new(0.0);
    let mut c = tid;
    while c < cols {
        let g = f32::cast_from(dy[base + c]);
        if log {
            acc += g;
        } else {
            acc += g * f32::cast_from(y[base + c]);
        }
        c += CUBE_DIM_X as usize;
    }
    shared[tid] = acc;
    sync_cube();
    tree_sum(&mut shared);
    let total = shared[0];
    let mut c = tid;
    while c < cols {
        let g = f32::cast_from(dy[base + c]);
        let v = f32::cast_from(y[base + c]);
        if log {
            dx[base + c] = F::cast_from(g - f32::exp(v) * total);
        } else {
            dx[base + c] = F::cast_from(v * (g - total));
        }
        c += CUBE_DIM_X as usize;
    }
}

// ---------------------------------------------------------------------------------------------
// LayerNorm and RMSNorm.

#[cube(launch)]
fn norm_kernel<F: Float>(
    input: &Tensor<F>,
    gamma: &Tensor<F>,
    beta: &Tensor<F>,
    output: &mut Tensor<F>,
    mean_out: &mut Tensor<f32>,
    rstd_out: &mut Tensor<f32>,
    rows: u32,
    cols: u32,
    epsilon: f32,
    #[comptime] block: usize,
    #[comptime] rms: bool,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index();
    if row >= rows as usize {
        terminate!();
    }
    let cols = cols as usize;
    let base = row * cols;
    let tid = UNIT_POS_X as usize;
    let step = CUBE_DIM_X as usize;
    let n = f32::cast_from(cols);
    let mut shared = SharedMemory::<f32>::new(block);
    let mut mean = f32::new(0.0);
    if !rms {
        let mut acc = f32::new(0.0);
        let mut c = tid;
        while c < cols {
            acc += f32::cast_from(input[base + c]);
            c += step;
        }
        shared[tid] = acc;
        sync_cube();
        tree_sum(&mut shared);
        mean = shared[0] / n;
        sync_cube();
    }
    let mut acc = f32::new(0.0);
    let mut c = tid;
    while c < cols {
        let d = f32::cast_from(input[base + c]) - mean;
        acc += d * d;
        c += step;
    }
    shared[tid] = acc;
    sync_cube();
    tree_sum(&mut shared);
    let rstd = f32::new(1.0) / f32::sqrt(shared[0] / n + epsilon);
    let mut c = tid;
    while c < cols {
        let xhat = (f32::cast_from(input[base + c]) - mean) * rstd;
        let mut y = xhat * f32::cast_from(gamma[c]);
        if !rms {
            y += f32::cast_from(beta[c]);
        }
        output[base + c] = F::cast_from(y);
        c += step;
    }
    if tid == 0 {
        mean_out[row] = mean;
        rstd_out[row] = rstd;
    }
}

#[cube(launch)]
fn norm_backward_kernel<F: Float>(
    input: &Tensor<F>,
    gamma: &Tensor<F>,
    mean: &Tensor<f32>,
    rstd: &Tensor<f32>,
    dy: &Tensor<F>,
    dx: &mut Tensor<F>,
    rows: u32,
    cols: u32,
    #[comptime] block: usize,
    #[comptime] rms: bool,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index();
    if row >= rows as usize {
        terminate!();
    }
    let cols = cols as usize;
    let base = row * cols;
    let tid = UNIT_POS_X as usize;
    let step = CUBE_DIM_X as usize;
    let n = f32::cast_from(cols);
    let mut mu = f32::new(0.0);
    if !rms {
        mu = mean[row];
    }
    let r = rstd[row];
    let mut sum_g = SharedMemory::<f32>::new(block);
    let mut sum_gx = SharedMemory::<f32>::new(block);
    let mut a = f32::new(0.0);
    let mut b = f32::new(0.0);
    let mut c = tid;
    while c < cols {
        let g = f32::cast_from(dy[base + c]) * f32::cast_from(gamma[c]);
        let xhat = (f32::cast_from(input[base + c]) - mu) * r;
        a += g;
        b += g * xhat;
        c += step;
    }
    sum_g[tid] = a;
    sum_gx[tid] = b;
    sync_cube();
    tree_sum(&mut sum_g);
    tree_sum(&mut sum_gx);
    let mut mean_g = f32::new(0.0);
    if !rms {
        mean_g = sum_g[0] / n;
    }
    let mean_gx = sum_gx[0] / n;
    let mut c = tid;
    while c < cols {
        let g = f32::cast_from(dy[base + c]) * f32::cast_from(gamma[c]);
        let xhat = (f32::cast_from(input[base + c]) - mu) * r;
        dx[base + c] = F::cast_from(r * (g - mean_g - xhat * mean_gx));
        c += step;
    }
}

/// Partial sums over a chunk of `chunk` rows, one unit per (chunk, column): `Σ dy·x̂` into
/// `dgamma[chunk, col]` and `Σ dy` into `dbeta[chunk, col]` (LayerNorm only).
#[cube(launch)]
fn norm_param_grads_kernel<F: Float>(
    input: &Tensor<F>,
    mean: &Tensor<f32>,
    rstd: &Tensor<f32>,
    dy: &Tensor<F>,
    dgamma: &mut Tensor<f32>,
    dbeta: &mut Tensor<f32>,
    rows: u32,
    cols: u32,
    chunk: u32,
    #[comptime] rms: bool,
    #[define(F)] _dtype: StorageType,
) {
    let cols = cols as usize;
    let chunks = (rows as usize).div_ceil(chunk as usize);
    if ABSOLUTE_POS >= chunks * cols {
        terminate!();
    }
    let part = ABSOLUTE_POS / cols;
    let col = ABSOLUTE_POS % cols;
    let start = part * chunk as usize;
    let end = usize::min(start + chunk as usize, rows as usize);
    let mut g = f32::new(0.0);
    let mut b = f32::new(0.0);
    for row in start..end {
        let d = f32::cast_from(dy[row * cols + col]);
        let mut mu = f32::new(0.0);
        if !rms {
            mu = mean[row];
        }
        g += d * (f32::cast_from(input[row * cols + col]) - mu) * rstd[row];
        b += d;
    }
    dgamma[ABSOLUTE_POS] = g;
    if !rms {
        dbeta[ABSOLUTE_POS] = b;
    }
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy.

#[cube(launch)]
fn cross_entropy_kernel<F: Float, I: Int>(
    logits: &Tensor<F>,
    targets: &Tensor<I>,
    loss: &mut Tensor<F>,
    lse_out: &mut Tensor<f32>,
    rows: u32,
    cols: u32,
    #[comptime] block: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = row_index();
    if row >= rows as usize {
        terminate!();
    }
    let cols = cols as usize;
    let base = row * cols;
    let mut maxes = SharedMemory::<f32>::new(block);
    let mut sums = SharedMemory::<f32>::new(block);
    row_max_sumexp::<F>(logits, base, cols, &mut maxes, &mut sums);
    if UNIT_POS_X == 0 {
        let lse = maxes[0] + f32::ln(sums[0]);
        let target = i32::cast_from(targets[row]);
        let mut l = f32::new(0.0);
        if target >= 0 {
            l = lse - f32::cast_from(logits[base + target as usize]);
        }
        loss[row] = F::cast_from(l);
        lse_out[row] = lse;
    }
}

#[cube(launch)]
fn cross_entropy_backward_kernel<F: Float, I: Int>(
    logits: &Tensor<F>,
    targets: &Tensor<I>,
    lse: &Tensor<f32>,
    dloss: &Tensor<F>,
    dx: &mut Tensor<F>,
    rows: u32,
    cols: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let cols = cols as usize;
    if ABSOLUTE_POS >= rows as usize * cols {
        terminate!();
    }
    let row = ABSOLUTE_POS / cols;
    let col = ABSOLUTE_POS % cols;
    let target = i32::cast_from(targets[row]);
    let mut g = f32::new(0.0);
    if target >= 0 {
        let p = f32::exp(f32::cast_from(logits[ABSOLUTE_POS]) - lse[row]);
        let mut hot = f32::new(0.0);
        if col == target as usize {
            hot = f32::new(1.0);
        }
        g = f32::cast_from(dloss[row]) * (p - hot);
    }
    dx[ABSOLUTE_POS] = F::cast_from(g);
}

// ---------------------------------------------------------------------------------------------
// GELU with bias (erf form).

#[cube(launch)]
fn gelu_bias_kernel<F: Float>(
    input: &Tensor<F>,
    bias: &Tensor<F>,
    output: &mut Tensor<F>,
    len: u32,
    cols: u32,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= len as usize {
        terminate!();
    }
    let z =
        f32::cast_from(input[ABSOLUTE_POS]) + f32::cast_from(bias[ABSOLUTE_POS % cols as usize]);
    let cdf = f32::new(0.5) * (f32::new(1.0) + Erf::erf(z * f32::new(0.70710677)));
    output[ABSOLUTE_POS] = F::cast_from(z * cdf);
}

/// `dz = dy·(Φ(z) + z·φ(z))` per element.
#[cube(launch)]
fn gelu_bias_backward_kernel<F: Float>(
    input: &Tensor<F>,
    bias: &Tensor<F>,
    dy: &Tensor<F>,
    dx: &mut Tensor<F>,
    len: u32,
    cols: u32,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= len as usize {
        terminate!();
    }
    let z =
        f32::cast_from(input[ABSOLUTE_POS]) + f32::cast_from(bias[ABSOLUTE_POS % cols as usize]);
    let cdf = f32::new(0.5) * (f32::new(1.0) + Erf::erf(z * f32::new(0.70710677)));
    let pdf = f32::exp(f32::new(-0.5) * z * z) * f32::new(0.398_942_3);
    dx[ABSOLUTE_POS] = F::cast_from(f32::cast_from(dy[ABSOLUTE_POS]) * (cdf + z * pdf));
}

/// Column sums over chunks of rows (`out[chunk, col]`), f32 accumulation.
#[cube(launch)]
fn column_sum_kernel<F: Float>(
    input: &Tensor<F>,
    out: &mut Tensor<f32>,
    rows: u32,
    cols: u32,
    chunk: u32,
    #[define(F)] _dtype: StorageType,
) {
    let cols = cols as usize;
    let chunks = (rows as usize).div_ceil(chunk as usize);
    if ABSOLUTE_POS >= chunks * cols {
        terminate!();
    }
    let part = ABSOLUTE_POS / cols;
    let col = ABSOLUTE_POS % cols;
    let start = part * chunk as usize;
    let end = usize::min(start + chunk as usize, rows as usize);
    let mut acc = f32::new(0.0);
    for row in start..end {
        acc += f32::cast_from(input[row * cols + col]);
    }
    out[ABSOLUTE_POS] = acc;
}

// ---------------------------------------------------------------------------------------------
// Flash attention: one unit per query row (forward, dQ) or key row (dK, dV), online softmax, the
// score matrix never stored.

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
    let bh = CUBE_POS_Y as usize;
    let i = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    let seq_q = seq_q as usize;
    let seq_k = seq_k as usize;
    if i >= seq_q {
        terminate!();
    }
    let row = bh * seq_q + i;
    let k_base = bh * seq_k * head_dim;
    let mut qr = Array::<f32>::new(head_dim);
    let mut acc = Array::<f32>::new(head_dim);
    #[unroll]
    for d in 0..head_dim {
        qr[d] = f32::cast_from(q[row * head_dim + d]) * scale;
        acc[d] = f32::new(0.0);
    }
    let mut m = f32::new(NEG_BIG);
    let mut l = f32::new(0.0);
    let mut end = seq_k;
    if causal {
        end = i + 1;
    }
    for j in 0..end {
        let kj = k_base + j * head_dim;
        let mut s = f32::new(0.0);
        #[unroll]
        for d in 0..head_dim {
            s += qr[d] * f32::cast_from(k[kj + d]);
        }
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
    let i = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    let seq_q = seq_q as usize;
    let seq_k = seq_k as usize;
    if i >= seq_q {
        terminate!();
    }
    let row = bh * seq_q + i;
    let k_base = bh * seq_k * head_dim;
    let mut qr = Array::<f32>::new(head_dim);
    let mut dor = Array::<f32>::new(head_dim);
    let mut acc = Array::<f32>::new(head_dim);
    let mut delta = f32::new(0.0);
    #[unroll]
    for d in 0..head_dim {
        qr[d] = f32::cast_from(q[row * head_dim + d]) * scale;
        let g = f32::cast_from(d_output[row * head_dim + d]);
        dor[d] = g;
        delta += g * f32::cast_from(output[row * head_dim + d]);
        acc[d] = f32::new(0.0);
    }
    let lse_i = lse[row];
    let mut end = seq_k;
    if causal {
        end = i + 1;
    }
    for j in 0..end {
        let kj = k_base + j * head_dim;
        let mut s = f32::new(0.0);
        let mut dp = f32::new(0.0);
        #[unroll]
        for d in 0..head_dim {
            s += qr[d] * f32::cast_from(k[kj + d]);
            dp += dor[d] * f32::cast_from(v[kj + d]);
        }
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
    let j = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    let seq_q = seq_q as usize;
    let seq_k = seq_k as usize;
    if j >= seq_k {
        terminate!();
    }
    let key = bh * seq_k + j;
    let q_base = bh * seq_q;
    let mut kr = Array::<f32>::new(head_dim);
    let mut vr = Array::<f32>::new(head_dim);
    let mut dk_acc = Array::<f32>::new(head_dim);
    let mut dv_acc = Array::<f32>::new(head_dim);
    #[unroll]
    for d in 0..head_dim {
        kr[d] = f32::cast_from(k[key * head_dim + d]);
        vr[d] = f32::cast_from(v[key * head_dim + d]);
        dk_acc[d] = f32::new(0.0);
        dv_acc[d] = f32::new(0.0);
    }
    let mut start = 0;
    if causal {
        start = j;
    }
    for i in start..seq_q {
        let qi = (q_base + i) * head_dim;
        let mut s = f32::new(0.0);
        let mut dp = f32::new(0.0);
        #[unroll]
        for d in 0..head_dim {
            s += f32::cast_from(q[qi + d]) * kr[d];
            dp += f32::cast_from(d_output[qi + d]) * vr[d];
        }
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

// ---------------------------------------------------------------------------------------------
// The optimizer tail: unscale + Σg² + non-finite flag in one pass, then AdamW predicated on the
// flag (read on the device).

/// Each unit strides over the gradient, writing the unscaled values; per-cube partial `Σ g²` and
/// non-finite flags go to `partial_sq[cube]` and `partial_bad[cube]`.
#[cube(launch)]
fn unscale_kernel<F: Float>(
    grad: &Tensor<F>,
    output: &mut Tensor<F>,
    partial_sq: &mut Tensor<f32>,
    partial_bad: &mut Tensor<f32>,
    len: u32,
    inv_scale: f32,
    #[comptime] block: usize,
    #[define(F)] _dtype: StorageType,
) {
    let tid = UNIT_POS_X as usize;
    let cube = CUBE_POS_X as usize;
    let stride = (CUBE_COUNT_X * CUBE_DIM_X) as usize;
    let mut sq = SharedMemory::<f32>::new(block);
    let mut bad = SharedMemory::<f32>::new(block);
    let mut acc = f32::new(0.0);
    let mut flag = f32::new(0.0);
    let mut i = cube * CUBE_DIM_X as usize + tid;
    while i < len as usize {
        let g = f32::cast_from(grad[i]) * inv_scale;
        let out = F::cast_from(g);
        // Checked in the gradient's own dtype (an f16 overflow is caught), read back as f32.
        let back = f32::cast_from(out);
        if f32::is_nan(back) || f32::is_inf(back) {
            flag = f32::new(1.0);
        }
        output[i] = out;
        acc += g * g;
        i += stride;
    }
    sq[tid] = acc;
    bad[tid] = flag;
    sync_cube();
    tree_sum(&mut sq);
    tree_sum(&mut bad);
    if tid == 0 {
        partial_sq[cube] = sq[0];
        partial_bad[cube] = bad[0];
    }
}

#[cube(launch)]
fn adamw_kernel<F: Float>(
    param: &Tensor<F>,
    grad: &Tensor<F>,
    m: &Tensor<F>,
    v: &Tensor<F>,
    grad_scale: &Tensor<F>,
    skip: &Tensor<F>,
    param_out: &mut Tensor<F>,
    m_out: &mut Tensor<F>,
    v_out: &mut Tensor<F>,
    len: u32,
    lr: f32,
    beta1: f32,
    beta2: f32,
    epsilon: f32,
    decay: f32,
    correction1: f32,
    correction2: f32,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= len as usize {
        terminate!();
    }
    let p = f32::cast_from(param[i]);
    let m0 = f32::cast_from(m[i]);
    let v0 = f32::cast_from(v[i]);
    if f32::cast_from(skip[0]) != f32::new(0.0) {
        param_out[i] = param[i];
        m_out[i] = m[i];
        v_out[i] = v[i];
    } else {
        let g = f32::cast_from(grad[i]) * f32::cast_from(grad_scale[0]);
        let m1 = beta1 * m0 + (f32::new(1.0) - beta1) * g;
        let v1 = beta2 * v0 + (f32::new(1.0) - beta2) * g * g;
        let m_hat = m1 / correction1;
        let v_hat = v1 / correction2;
        param_out[i] = F::cast_from(p * decay - lr * m_hat / (f32::sqrt(v_hat) + epsilon));
        m_out[i] = F::cast_from(m1);
        v_out[i] = F::cast_from(v1);
    }
}

// ---------------------------------------------------------------------------------------------
// Host side.

/// `(rows, cols)` of a tensor seen as rows over its last dimension.
fn rows_cols(shape: &Shape) -> (usize, usize) {
    let cols = shape[shape.num_dims() - 1];
    (shape.num_elements() / cols.max(1), cols)
}

/// Units per row cube: a power of two from 32 to 256, about 4 elements per unit (fewer barrier
/// levels in the tree reductions; a 50k-vocabulary row still gets 256 units).
fn row_block(cols: usize) -> usize {
    cols.div_ceil(4).next_power_of_two().clamp(32, 256)
}

/// One cube per row, spread over x and y (each at most 65 535).
fn row_cubes(rows: usize) -> CubeCount {
    let x = rows.clamp(1, 65_535);
    CubeCount::Static(x as u32, rows.div_ceil(x).max(1) as u32, 1)
}

fn empty<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape, dtype: DType) -> CubeTensor<R> {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype)
}

fn elementwise<R: CubeRuntime>(like: &CubeTensor<R>, n: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(&like.client, n.max(1));
    (
        calculate_cube_count_elemwise(&like.client, n.max(1), dim),
        dim,
    )
}

/// Rows per partial sum of the column reductions (norm parameter gradients, bias gradients).
const COLUMN_CHUNK: usize = 256;

/// Sum `[chunks, cols]` f32 partials over the chunks, cast to `dtype`.
fn finish_columns<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    partial: CubeTensor<R>,
    dtype: DType,
) -> CubeTensor<R> {
    type Cb<R, F, I, BT> = CubeBackend<R, F, I, BT>;
    let cols = partial.shape()[1];
    let summed =
        <Cb<R, F, I, BT> as burn::tensor::ops::FloatTensorOps<Cb<R, F, I, BT>>>::float_sum_dim(
            partial, 0,
        );
    let summed =
        <Cb<R, F, I, BT> as burn::tensor::ops::FloatTensorOps<Cb<R, F, I, BT>>>::float_reshape(
            summed,
            Shape::new([cols]),
        );
    if dtype == DType::F32 {
        summed
    } else {
        <Cb<R, F, I, BT> as burn::tensor::ops::FloatTensorOps<Cb<R, F, I, BT>>>::float_cast(
            summed,
            dtype.into(),
        )
    }
}

fn column_launch<R: CubeRuntime>(
    like: &CubeTensor<R>,
    rows: usize,
    cols: usize,
) -> (usize, CubeCount, CubeDim) {
    let chunks = rows.div_ceil(COLUMN_CHUNK).max(1);
    let (count, dim) = elementwise(like, chunks * cols);
    (chunks, count, dim)
}

fn attention_launch(seq: usize, batch_heads: usize) -> (CubeCount, CubeDim) {
    let block = 64usize;
    (
        CubeCount::Static(seq.div_ceil(block) as u32, batch_heads as u32, 1),
        CubeDim::new_1d(block as u32),
    )
}

fn softmax_impl<R: CubeRuntime>(x: CubeTensor<R>, log: bool) -> CubeTensor<R> {
    let x = into_contiguous(x);
    let shape = x.shape();
    let (rows, cols) = rows_cols(&shape);
    let out = empty(&x, shape, x.dtype);
    let block = row_block(cols);
    softmax_kernel::launch::<R>(
        &x.client,
        row_cubes(rows),
        CubeDim::new_1d(block as u32),
        x.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        rows as u32,
        cols as u32,
        block,
        log,
        x.dtype.into(),
    );
    launched(1);
    out
}

fn softmax_backward_impl<R: CubeRuntime>(
    y: CubeTensor<R>,
    dy: CubeTensor<R>,
    log: bool,
) -> CubeTensor<R> {
    let (y, dy) = (into_contiguous(y), into_contiguous(dy));
    let shape = y.shape();
    let (rows, cols) = rows_cols(&shape);
    let dx = empty(&y, shape, y.dtype);
    let block = row_block(cols);
    softmax_backward_kernel::launch::<R>(
        &y.client,
        row_cubes(rows),
        CubeDim::new_1d(block as u32),
        y.clone().into_tensor_arg(),
        dy.into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        rows as u32,
        cols as u32,
        block,
        log,
        y.dtype.into(),
    );
    launched(1);
    dx
}

fn norm_impl<R: CubeRuntime>(
    x: CubeTensor<R>,
    gamma: CubeTensor<R>,
    beta: Option<CubeTensor<R>>,
    epsilon: f64,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let x = into_contiguous(x);
    let gamma = into_contiguous(gamma);
    let rms = beta.is_none();
    let beta = beta.map(into_contiguous).unwrap_or_else(|| gamma.clone());
    let shape = x.shape();
    let (rows, cols) = rows_cols(&shape);
    assert_eq!(
        gamma.shape().num_elements(),
        cols,
        "norm: γ must have the last dimension's size"
    );
    let stats = stats_shape(&shape);
    let out = empty(&x, shape, x.dtype);
    let mean = empty(&x, stats.clone(), DType::F32);
    let rstd = empty(&x, stats, DType::F32);
    let block = row_block(cols);
    norm_kernel::launch::<R>(
        &x.client,
        row_cubes(rows),
        CubeDim::new_1d(block as u32),
        x.clone().into_tensor_arg(),
        gamma.into_tensor_arg(),
        beta.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        mean.clone().into_tensor_arg(),
        rstd.clone().into_tensor_arg(),
        rows as u32,
        cols as u32,
        epsilon as f32,
        block,
        rms,
        x.dtype.into(),
    );
    launched(1);
    (out, mean, rstd)
}

/// `(dx, dγ, dβ)`; `mean` is `None` for RMSNorm.
fn norm_backward_impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    x: CubeTensor<R>,
    gamma: CubeTensor<R>,
    mean: Option<CubeTensor<R>>,
    rstd: CubeTensor<R>,
    dy: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>, Option<CubeTensor<R>>) {
    let (x, gamma, dy) = (
        into_contiguous(x),
        into_contiguous(gamma),
        into_contiguous(dy),
    );
    let rstd = into_contiguous(rstd);
    let rms = mean.is_none();
    let mean = mean.map(into_contiguous).unwrap_or_else(|| rstd.clone());
    let shape = x.shape();
    let (rows, cols) = rows_cols(&shape);
    let dx = empty(&x, shape, x.dtype);
    let block = row_block(cols);
    norm_backward_kernel::launch::<R>(
        &x.client,
        row_cubes(rows),
        CubeDim::new_1d(block as u32),
        x.clone().into_tensor_arg(),
        gamma.clone().into_tensor_arg(),
        mean.clone().into_tensor_arg(),
        rstd.clone().into_tensor_arg(),
        dy.clone().into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        rows as u32,
        cols as u32,
        block,
        rms,
        x.dtype.into(),
    );
    let (chunks, count, dim) = column_launch(&x, rows, cols);
    let dgamma = empty(&x, Shape::new([chunks, cols]), DType::F32);
    let dbeta = if rms {
        dgamma.clone()
    } else {
        empty(&x, Shape::new([chunks, cols]), DType::F32)
    };
    norm_param_grads_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        x.clone().into_tensor_arg(),
        mean.into_tensor_arg(),
        rstd.into_tensor_arg(),
        dy.into_tensor_arg(),
        dgamma.clone().into_tensor_arg(),
        dbeta.clone().into_tensor_arg(),
        rows as u32,
        cols as u32,
        COLUMN_CHUNK as u32,
        rms,
        x.dtype.into(),
    );
    launched(2);
    let dtype = gamma.dtype;
    let dgamma = finish_columns::<R, F, I, BT>(dgamma, dtype);
    let dbeta = (!rms).then(|| finish_columns::<R, F, I, BT>(dbeta, dtype));
    (dx, dgamma, dbeta)
}

fn attention_shape<R: CubeRuntime>(
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

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> FusedOps
    for CubeBackend<R, F, I, BT>
{
    const FUSED: crate::Fused = crate::Fused::ALL;

    fn fused_softmax(x: CubeTensor<R>) -> CubeTensor<R> {
        softmax_impl(x, false)
    }

    fn fused_softmax_backward(y: CubeTensor<R>, dy: CubeTensor<R>) -> CubeTensor<R> {
        softmax_backward_impl(y, dy, false)
    }

    fn fused_log_softmax(x: CubeTensor<R>) -> CubeTensor<R> {
        softmax_impl(x, true)
    }

    fn fused_log_softmax_backward(y: CubeTensor<R>, dy: CubeTensor<R>) -> CubeTensor<R> {
        softmax_backward_impl(y, dy, true)
    }

    fn fused_layer_norm(
        x: CubeTensor<R>,
        gamma: CubeTensor<R>,
        beta: CubeTensor<R>,
        epsilon: f64,
    ) -> LayerNormOutput<Self> {
        let (output, mean, rstd) = norm_impl(x, gamma, Some(beta), epsilon);
        LayerNormOutput { output, mean, rstd }
    }

    fn fused_layer_norm_backward(
        x: CubeTensor<R>,
        gamma: CubeTensor<R>,
        mean: CubeTensor<R>,
        rstd: CubeTensor<R>,
        dy: CubeTensor<R>,
    ) -> LayerNormGrads<Self> {
        let (x, gamma, beta) = norm_backward_impl::<R, F, I, BT>(x, gamma, Some(mean), rstd, dy);
        LayerNormGrads {
            x,
            gamma,
            beta: beta.expect("LayerNorm has a β gradient"),
        }
    }

    fn fused_rms_norm(x: CubeTensor<R>, gamma: CubeTensor<R>, epsilon: f64) -> RmsNormOutput<Self> {
        let (output, _, rstd) = norm_impl(x, gamma, None, epsilon);
        RmsNormOutput { output, rstd }
    }

    fn fused_rms_norm_backward(
        x: CubeTensor<R>,
        gamma: CubeTensor<R>,
        rstd: CubeTensor<R>,
        dy: CubeTensor<R>,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        let (dx, dgamma, _) = norm_backward_impl::<R, F, I, BT>(x, gamma, None, rstd, dy);
        (dx, dgamma)
    }

    fn fused_cross_entropy(
        logits: CubeTensor<R>,
        targets: CubeTensor<R>,
    ) -> CrossEntropyOutput<Self> {
        let logits = into_contiguous(logits);
        let targets = into_contiguous(targets);
        let (rows, cols) = rows_cols(&logits.shape());
        assert_eq!(
            targets.shape().num_elements(),
            rows,
            "cross_entropy: one target per row"
        );
        let loss = empty(&logits, Shape::new([rows]), logits.dtype);
        let lse = empty(&logits, Shape::new([rows]), DType::F32);
        let block = row_block(cols);
        cross_entropy_kernel::launch::<R>(
            &logits.client,
            row_cubes(rows),
            CubeDim::new_1d(block as u32),
            logits.clone().into_tensor_arg(),
            targets.clone().into_tensor_arg(),
            loss.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            rows as u32,
            cols as u32,
            block,
            [logits.dtype.into(), targets.dtype.into()],
        );
        launched(1);
        CrossEntropyOutput { loss, lse }
    }

    fn fused_cross_entropy_backward(
        logits: CubeTensor<R>,
        targets: CubeTensor<R>,
        lse: CubeTensor<R>,
        dloss: CubeTensor<R>,
    ) -> CubeTensor<R> {
        let logits = into_contiguous(logits);
        let (targets, lse, dloss) = (
            into_contiguous(targets),
            into_contiguous(lse),
            into_contiguous(dloss),
        );
        let shape = logits.shape();
        let (rows, cols) = rows_cols(&shape);
        let dx = empty(&logits, shape, logits.dtype);
        let (count, dim) = elementwise(&logits, rows * cols);
        cross_entropy_backward_kernel::launch::<R>(
            &logits.client,
            count,
            dim,
            logits.clone().into_tensor_arg(),
            targets.clone().into_tensor_arg(),
            lse.into_tensor_arg(),
            dloss.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            rows as u32,
            cols as u32,
            [logits.dtype.into(), targets.dtype.into()],
        );
        launched(1);
        dx
    }

    fn fused_gelu_bias(x: CubeTensor<R>, bias: CubeTensor<R>) -> CubeTensor<R> {
        let (x, bias) = (into_contiguous(x), into_contiguous(bias));
        let shape = x.shape();
        let (rows, cols) = rows_cols(&shape);
        let out = empty(&x, shape, x.dtype);
        let (count, dim) = elementwise(&x, rows * cols);
        gelu_bias_kernel::launch::<R>(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            bias.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            (rows * cols) as u32,
            cols as u32,
            x.dtype.into(),
        );
        launched(1);
        out
    }

    fn fused_gelu_bias_backward(
        x: CubeTensor<R>,
        bias: CubeTensor<R>,
        dy: CubeTensor<R>,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        let (x, bias, dy) = (
            into_contiguous(x),
            into_contiguous(bias),
            into_contiguous(dy),
        );
        let shape = x.shape();
        let (rows, cols) = rows_cols(&shape);
        let dx = empty(&x, shape, x.dtype);
        let (count, dim) = elementwise(&x, rows * cols);
        gelu_bias_backward_kernel::launch::<R>(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            bias.clone().into_tensor_arg(),
            dy.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            (rows * cols) as u32,
            cols as u32,
            x.dtype.into(),
        );
        let (chunks, count, dim) = column_launch(&x, rows, cols);
        let partial = empty(&x, Shape::new([chunks, cols]), DType::F32);
        column_sum_kernel::launch::<R>(
            &x.client,
            count,
            dim,
            dx.clone().into_tensor_arg(),
            partial.clone().into_tensor_arg(),
            rows as u32,
            cols as u32,
            COLUMN_CHUNK as u32,
            x.dtype.into(),
        );
        launched(2);
        (dx, finish_columns::<R, F, I, BT>(partial, bias.dtype))
    }

    fn fused_unscale(grad: CubeTensor<R>, inv_scale: f64) -> UnscaleOutput<Self> {
        type Cb<R, F, I, BT> = CubeBackend<R, F, I, BT>;
        let grad = into_contiguous(grad);
        let shape = grad.shape();
        let len = shape.num_elements();
        let block = 256usize;
        // Enough cubes to fill a GPU, each unit covering several elements.
        let cubes = len.div_ceil(block * 8).clamp(1, 1024);
        let output = empty(&grad, shape, grad.dtype);
        let partial_sq = empty(&grad, Shape::new([cubes]), DType::F32);
        let partial_bad = empty(&grad, Shape::new([cubes]), DType::F32);
        unscale_kernel::launch::<R>(
            &grad.client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(block as u32),
            grad.clone().into_tensor_arg(),
            output.clone().into_tensor_arg(),
            partial_sq.clone().into_tensor_arg(),
            partial_bad.clone().into_tensor_arg(),
            len as u32,
            inv_scale as f32,
            block,
            grad.dtype.into(),
        );
        launched(1);
        let sum = <Cb<R, F, I, BT> as FloatTensorOps<Cb<R, F, I, BT>>>::float_sum;
        let max = <Cb<R, F, I, BT> as FloatTensorOps<Cb<R, F, I, BT>>>::float_max;
        UnscaleOutput {
            grad: output,
            sum_squares: sum(partial_sq),
            non_finite: max(partial_bad),
        }
    }

    fn fused_adamw(
        param: CubeTensor<R>,
        grad: CubeTensor<R>,
        m: CubeTensor<R>,
        v: CubeTensor<R>,
        grad_scale: CubeTensor<R>,
        skip: CubeTensor<R>,
        step: AdamWStep,
    ) -> AdamWState<Self> {
        type Cb<R, F, I, BT> = CubeBackend<R, F, I, BT>;
        let param = into_contiguous(param);
        let dtype = param.dtype;
        let same = |t: CubeTensor<R>| {
            let t = into_contiguous(t);
            if t.dtype == dtype {
                t
            } else {
                <Cb<R, F, I, BT> as FloatTensorOps<Cb<R, F, I, BT>>>::float_cast(t, dtype.into())
            }
        };
        let (grad, m, v) = (same(grad), same(m), same(v));
        let (grad_scale, skip) = (same(grad_scale), same(skip));
        let shape = param.shape();
        let len = shape.num_elements();
        let (count, dim) = elementwise(&param, len);
        let out = |_: ()| empty(&param, shape.clone(), dtype);
        let (p_out, m_out, v_out) = (out(()), out(()), out(()));
        let t = step.step.max(1) as i32;
        adamw_kernel::launch::<R>(
            &param.client,
            count,
            dim,
            param.clone().into_tensor_arg(),
            grad.into_tensor_arg(),
            m.into_tensor_arg(),
            v.into_tensor_arg(),
            grad_scale.into_tensor_arg(),
            skip.into_tensor_arg(),
            p_out.clone().into_tensor_arg(),
            m_out.clone().into_tensor_arg(),
            v_out.clone().into_tensor_arg(),
            len as u32,
            step.lr as f32,
            step.beta1 as f32,
            step.beta2 as f32,
            step.epsilon as f32,
            (1.0 - step.lr * step.weight_decay) as f32,
            (1.0 - step.beta1.powi(t)) as f32,
            (1.0 - step.beta2.powi(t)) as f32,
            dtype.into(),
        );
        launched(1);
        AdamWState {
            param: p_out,
            m: m_out,
            v: v_out,
        }
    }

    fn fused_attention(
        q: CubeTensor<R>,
        k: CubeTensor<R>,
        v: CubeTensor<R>,
        scale: f64,
        causal: bool,
    ) -> AttentionOutput<Self> {
        let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
        let (bh, sq, sk, d) = attention_shape(&q, &k, causal);
        let shape = q.shape();
        let output = empty(&q, shape.clone(), q.dtype);
        let lse = empty(&q, Shape::new([shape[0], shape[1], sq]), DType::F32);
        let (count, dim) = attention_launch(sq, bh);
        attention_kernel::launch::<R>(
            &q.client,
            count,
            dim,
            q.clone().into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            sq as u32,
            sk as u32,
            scale as f32,
            d,
            causal,
            q.dtype.into(),
        );
        launched(1);
        AttentionOutput { output, lse }
    }

    fn fused_attention_backward(
        q: CubeTensor<R>,
        k: CubeTensor<R>,
        v: CubeTensor<R>,
        output: CubeTensor<R>,
        lse: CubeTensor<R>,
        d_output: CubeTensor<R>,
        scale: f64,
        causal: bool,
    ) -> AttentionGrads<Self> {
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
        AttentionGrads {
            q: dq,
            k: dk,
            v: dv,
        }
    }
}
