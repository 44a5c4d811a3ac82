//! Softmax and log-softmax over the last dimension, forward and backward: one cube per row.

use super::reduce::{cube_sum, row_logsumexp, this_row};
use super::{arg, contiguous, empty_like, launched, row_launch, rows_cols};
use burn::tensor::TensorMetadata;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

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
    let cols = cols as usize;
    let (_, base) = this_row(rows, cols);
    let lse = row_logsumexp::<F>(input, base, cols, block);
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
    let cols = cols as usize;
    let (_, base) = this_row(rows, cols);
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
    let total = cube_sum(&mut shared, acc);
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

/// Softmax (or log-softmax) of `x`.
pub(super) fn forward<R: CubeRuntime>(x: CubeTensor<R>, log: bool) -> CubeTensor<R> {
    let x = into_contiguous(x);
    let (rows, cols) = rows_cols(&x.shape());
    let out = empty_like(&x);
    let (count, dim, block) = row_launch(rows, cols);
    softmax_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        arg(&x),
        arg(&out),
        rows as u32,
        cols as u32,
        block,
        log,
        x.dtype.into(),
    );
    launched(1);
    out
}

/// The gradient from the output `y` and its gradient `dy`.
pub(super) fn backward<R: CubeRuntime>(
    y: CubeTensor<R>,
    dy: CubeTensor<R>,
    log: bool,
) -> CubeTensor<R> {
    let [y, dy] = contiguous([y, dy]);
    let (rows, cols) = rows_cols(&y.shape());
    let dx = empty_like(&y);
    let (count, dim, block) = row_launch(rows, cols);
    softmax_backward_kernel::launch::<R>(
        &y.client,
        count,
        dim,
        arg(&y),
        arg(&dy),
        arg(&dx),
        rows as u32,
        cols as u32,
        block,
        log,
        y.dtype.into(),
    );
    launched(1);
    dx
}
