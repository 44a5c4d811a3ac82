//! GELU with bias (the exact, erf form, or the tanh approximation: one kernel each, chosen at
//! compile time), elementwise in vectors of up to 16 bytes; the backward writes the bias
//! gradient's f32 column sums over chunks of rows in the same pass.

use super::columns::{column_launch, finish_columns};
use super::reduce::column_chunk;
use super::{
    COLUMN_CHUNK, arg, contiguous, elementwise, empty_like, launched, row_vector, rows_cols,
};
use burn::tensor::TensorMetadata;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// The standard normal CDF `Φ(z) = (1 + erf(z/√2))/2`.
#[cube]
fn normal_cdf(z: f32) -> f32 {
    f32::new(0.5) * (f32::new(1.0) + Erf::erf(z * f32::new(0.70710677)))
}

/// `tanh(√(2/π)(z + 0.044715 z³))`, the tanh form's.
#[cube]
fn tanh_form(z: f32) -> f32 {
    f32::tanh(f32::new(0.797_884_6) * (z + f32::new(0.044_715) * z * z * z))
}

/// `gelu(x + bias)` per element, a vector of `N` (up to 16 bytes) per unit: `len` vectors in
/// rows of `cols` vectors.
#[cube(launch)]
fn gelu_bias_kernel<F: Float, N: Size>(
    input: &Tensor<Vector<F, N>>,
    bias: &Tensor<Vector<F, N>>,
    output: &mut Tensor<Vector<F, N>>,
    len: u32,
    cols: u32,
    #[comptime] tanh: bool,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= len as usize {
        terminate!();
    }
    let x = input[ABSOLUTE_POS];
    let b = bias[(ABSOLUTE_POS as u32 % cols) as usize];
    let mut y = Vector::<F, N>::empty();
    #[unroll]
    for j in 0..input.vector_size() {
        let z = f32::cast_from(x[j]) + f32::cast_from(b[j]);
        let v = if comptime!(tanh) {
            f32::new(0.5) * z * (f32::new(1.0) + tanh_form(z))
        } else {
            z * normal_cdf(z)
        };
        y[j] = F::cast_from(v);
    }
    output[ABSOLUTE_POS] = y;
}

/// `dz = dy·(Φ(z) + z·φ(z))` per element; for the tanh form
/// `dy·((1 + t)/2 + z(1 − t²)·√(2/π)(1 + 3·0.044715 z²)/2`. Fused with the bias gradient's first
/// pass: one unit per (chunk of `chunk` rows, vector of columns) writes its `dx` and the chunk's
/// f32 column sums of it (as stored) into `partial[chunk, col]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn gelu_bias_backward_kernel<F: Float, N: Size>(
    input: &Tensor<Vector<F, N>>,
    bias: &Tensor<Vector<F, N>>,
    dy: &Tensor<Vector<F, N>>,
    dx: &mut Tensor<Vector<F, N>>,
    partial: &mut Tensor<f32>,
    rows: u32,
    cols: u32,
    chunk: u32,
    #[comptime] tanh: bool,
    #[define(F)] _dtype: StorageType,
) {
    let n = input.vector_size();
    let vcols = cols as usize;
    let (col, start, end) = column_chunk(rows, vcols, chunk);
    let b = bias[col];
    let mut acc = Vector::<f32, N>::new(0.0);
    for row in start..end {
        let at = row * vcols + col;
        let (x, g) = (input[at], dy[at]);
        let mut out = Vector::<F, N>::empty();
        #[unroll]
        for j in 0..n {
            let z = f32::cast_from(x[j]) + f32::cast_from(b[j]);
            let slope = if comptime!(tanh) {
                let t = tanh_form(z);
                let du = f32::new(0.797_884_6) * (f32::new(1.0) + f32::new(0.134_145) * z * z);
                f32::new(0.5) * (f32::new(1.0) + t)
                    + f32::new(0.5) * z * (f32::new(1.0) - t * t) * du
            } else {
                let pdf = f32::exp(f32::new(-0.5) * z * z) * f32::new(0.398_942_3);
                normal_cdf(z) + z * pdf
            };
            out[j] = F::cast_from(f32::cast_from(g[j]) * slope);
        }
        dx[at] = out;
        acc += Vector::<f32, N>::cast_from(out);
    }
    #[unroll]
    for j in 0..n {
        partial[ABSOLUTE_POS * n + j] = acc[j];
    }
}

/// `gelu(x + bias)` (with `tanh`, the tanh form).
pub(super) fn forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    bias: CubeTensor<R>,
    tanh: bool,
) -> CubeTensor<R> {
    let [x, bias] = contiguous([x, bias]);
    let (rows, cols) = rows_cols(&x.shape());
    let out = empty_like(&x);
    let n = row_vector(&[&x, &bias, &out], cols);
    let (count, dim) = elementwise(&x, rows * cols / n);
    gelu_bias_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        n,
        arg(&x),
        arg(&bias),
        arg(&out),
        (rows * cols / n) as u32,
        (cols / n).max(1) as u32,
        tanh,
        x.dtype.into(),
    );
    launched(1);
    out
}

/// `(dx, dbias)`: one pass writing `dx` and the bias gradient's chunk sums, one adding those.
pub(super) fn backward<R: CubeRuntime>(
    x: CubeTensor<R>,
    bias: CubeTensor<R>,
    dy: CubeTensor<R>,
    tanh: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [x, bias, dy] = contiguous([x, bias, dy]);
    let (rows, cols) = rows_cols(&x.shape());
    let dx = empty_like(&x);
    let n = row_vector(&[&x, &bias, &dy, &dx], cols);
    let (partial, count, dim) = column_launch(&x, rows, cols, n);
    gelu_bias_backward_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        n,
        arg(&x),
        arg(&bias),
        arg(&dy),
        arg(&dx),
        arg(&partial),
        rows as u32,
        (cols / n) as u32,
        COLUMN_CHUNK as u32,
        tanh,
        x.dtype.into(),
    );
    launched(1);
    (dx, finish_columns(partial, bias.dtype))
}
