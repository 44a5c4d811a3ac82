//! Softmax and log-softmax over the last dimension, forward and backward: one cube per row, read
//! and written in vectors of up to 16 bytes.

use super::reduce::{cube_sum, row_logsumexp, this_row};
use super::{arg, contiguous, empty_like, launched, row_launch, row_vector, rows_cols};
use burn::tensor::TensorMetadata;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

#[cube(launch)]
fn softmax_kernel<F: Float, N: Size>(
    input: &Tensor<Vector<F, N>>,
    output: &mut Tensor<Vector<F, N>>,
    rows: u32,
    cols: u32,
    #[comptime] block: usize,
    #[comptime] log: bool,
    #[define(F)] _dtype: StorageType,
) {
    let n = input.vector_size();
    let vectors = cols as usize / n;
    let (_, base) = this_row(rows, vectors);
    let lse = row_logsumexp::<F, N>(input, base, vectors, block);
    let mut c = UNIT_POS_X as usize;
    while c < vectors {
        let x = input[base + c];
        let mut y = Vector::<F, N>::empty();
        #[unroll]
        for j in 0..n {
            let v = f32::cast_from(x[j]);
            if log {
                y[j] = F::cast_from(v - lse);
            } else {
                y[j] = F::cast_from(f32::exp(v - lse));
            }
        }
        output[base + c] = y;
        c += CUBE_DIM_X as usize;
    }
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn softmax_backward_kernel<F: Float, N: Size>(
    y: &Tensor<Vector<F, N>>,
    dy: &Tensor<Vector<F, N>>,
    dx: &mut Tensor<Vector<F, N>>,
    rows: u32,
    cols: u32,
    #[comptime] block: usize,
    #[comptime] log: bool,
    #[define(F)] _dtype: StorageType,
) {
    let n = y.vector_size();
    let vectors = cols as usize / n;
    let (_, base) = this_row(rows, vectors);
    let tid = UNIT_POS_X as usize;
    let mut shared = SharedMemory::<f32>::new(block);
    // softmax: Σ dy·y; log-softmax: Σ dy.
    let mut acc = f32::new(0.0);
    let mut c = tid;
    while c < vectors {
        let g = dy[base + c];
        let v = y[base + c];
        #[unroll]
        for j in 0..n {
            if log {
                acc += f32::cast_from(g[j]);
            } else {
                acc += f32::cast_from(g[j]) * f32::cast_from(v[j]);
            }
        }
        c += CUBE_DIM_X as usize;
    }
    let total = cube_sum(&mut shared, acc);
    let mut c = tid;
    while c < vectors {
        let g = dy[base + c];
        let v = y[base + c];
        let mut out = Vector::<F, N>::empty();
        #[unroll]
        for j in 0..n {
            let (gj, vj) = (f32::cast_from(g[j]), f32::cast_from(v[j]));
            if log {
                out[j] = F::cast_from(gj - f32::exp(vj) * total);
            } else {
                out[j] = F::cast_from(vj * (gj - total));
            }
        }
        dx[base + c] = out;
        c += CUBE_DIM_X as usize;
    }
}

/// Softmax (or log-softmax) of `x`.
pub(super) fn forward<R: CubeRuntime>(x: CubeTensor<R>, log: bool) -> CubeTensor<R> {
    let x = into_contiguous(x);
    let (rows, cols) = rows_cols(&x.shape());
    let out = empty_like(&x);
    let n = row_vector(&[&x, &out], cols);
    let (count, dim, block) = row_launch(rows, cols / n);
    softmax_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        n,
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
    let n = row_vector(&[&y, &dy, &dx], cols);
    let (count, dim, block) = row_launch(rows, cols / n);
    softmax_backward_kernel::launch::<R>(
        &y.client,
        count,
        dim,
        n,
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
