//! LayerNorm and RMSNorm over the last dimension (one kernel each way, `rms` at compile time):
//! one cube per row; the parameter gradients as f32 column sums over chunks of rows.

use super::columns::{column_launch, finish_columns};
use super::reduce::{column_chunk, cube_sum, this_row};
use super::{
    COLUMN_CHUNK, arg, contiguous, empty, empty_f32, empty_like, launched, row_launch, rows_cols,
};
use crate::stats_shape;
use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// The output in its own dtype `O` (the precision policy's compute dtype, or the input's).
#[cube(launch)]
fn norm_kernel<F: Float, O: Float>(
    input: &Tensor<F>,
    gamma: &Tensor<F>,
    beta: &Tensor<F>,
    output: &mut Tensor<O>,
    mean_out: &mut Tensor<f32>,
    rstd_out: &mut Tensor<f32>,
    rows: u32,
    cols: u32,
    epsilon: f32,
    #[comptime] block: usize,
    #[comptime] rms: bool,
    #[define(F, O)] _dtypes: [StorageType; 2],
) {
    let cols = cols as usize;
    let (row, base) = this_row(rows, cols);
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
        mean = cube_sum(&mut shared, acc) / n;
    }
    let mut acc = f32::new(0.0);
    let mut c = tid;
    while c < cols {
        let d = f32::cast_from(input[base + c]) - mean;
        acc += d * d;
        c += step;
    }
    let rstd = f32::new(1.0) / f32::sqrt(cube_sum(&mut shared, acc) / n + epsilon);
    let mut c = tid;
    while c < cols {
        let xhat = (f32::cast_from(input[base + c]) - mean) * rstd;
        let mut y = xhat * f32::cast_from(gamma[c]);
        if !rms {
            y += f32::cast_from(beta[c]);
        }
        output[base + c] = O::cast_from(y);
        c += step;
    }
    if tid == 0 {
        mean_out[row] = mean;
        rstd_out[row] = rstd;
    }
}

/// `dy` in its own dtype `D` (read widened to f32, as every operand).
#[cube(launch)]
fn norm_backward_kernel<F: Float, D: Float>(
    input: &Tensor<F>,
    gamma: &Tensor<F>,
    mean: &Tensor<f32>,
    rstd: &Tensor<f32>,
    dy: &Tensor<D>,
    dx: &mut Tensor<F>,
    rows: u32,
    cols: u32,
    #[comptime] block: usize,
    #[comptime] rms: bool,
    #[define(F, D)] _dtypes: [StorageType; 2],
) {
    let cols = cols as usize;
    let (row, base) = this_row(rows, cols);
    let tid = UNIT_POS_X as usize;
    let step = CUBE_DIM_X as usize;
    let n = f32::cast_from(cols);
    let mut mu = f32::new(0.0);
    if !rms {
        mu = mean[row];
    }
    let r = rstd[row];
    let mut shared = SharedMemory::<f32>::new(block);
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
    let mut mean_g = f32::new(0.0);
    if !rms {
        mean_g = cube_sum(&mut shared, a) / n;
    }
    let mean_gx = cube_sum(&mut shared, b) / n;
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
fn norm_param_grads_kernel<F: Float, D: Float>(
    input: &Tensor<F>,
    mean: &Tensor<f32>,
    rstd: &Tensor<f32>,
    dy: &Tensor<D>,
    dgamma: &mut Tensor<f32>,
    dbeta: &mut Tensor<f32>,
    rows: u32,
    cols: u32,
    chunk: u32,
    #[comptime] rms: bool,
    #[define(F, D)] _dtypes: [StorageType; 2],
) {
    let cols = cols as usize;
    let (col, start, end) = column_chunk(rows, cols, chunk);
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

/// `(output, mean, rstd)`, the output in `output`'s dtype; `beta` is `None` for RMSNorm (whose
/// `mean` is then a placeholder).
pub(super) fn forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    gamma: CubeTensor<R>,
    beta: Option<CubeTensor<R>>,
    epsilon: f64,
    output: DType,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let [x, gamma] = contiguous([x, gamma]);
    let rms = beta.is_none();
    let beta = beta.map(into_contiguous).unwrap_or_else(|| gamma.clone());
    let shape = x.shape();
    let (rows, cols) = rows_cols(&shape);
    assert_eq!(
        gamma.shape().num_elements(),
        cols,
        "norm: γ must have the last dimension's size"
    );
    let out = empty(&x, shape.clone(), output);
    let mean = empty_f32(&x, stats_shape(&shape));
    let rstd = empty_like(&mean);
    let (count, dim, block) = row_launch(rows, cols);
    norm_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        arg(&x),
        arg(&gamma),
        arg(&beta),
        arg(&out),
        arg(&mean),
        arg(&rstd),
        rows as u32,
        cols as u32,
        epsilon as f32,
        block,
        rms,
        [x.dtype.into(), out.dtype.into()],
    );
    launched(1);
    (out, mean, rstd)
}

/// `(dx, dγ, dβ)`; `mean` is `None` for RMSNorm.
pub(super) fn backward<R: CubeRuntime>(
    x: CubeTensor<R>,
    gamma: CubeTensor<R>,
    mean: Option<CubeTensor<R>>,
    rstd: CubeTensor<R>,
    dy: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>, Option<CubeTensor<R>>) {
    let [x, gamma, rstd, dy] = contiguous([x, gamma, rstd, dy]);
    let rms = mean.is_none();
    let mean = mean.map(into_contiguous).unwrap_or_else(|| rstd.clone());
    let (rows, cols) = rows_cols(&x.shape());
    let dx = empty_like(&x);
    let (count, dim, block) = row_launch(rows, cols);
    norm_backward_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        arg(&x),
        arg(&gamma),
        arg(&mean),
        arg(&rstd),
        arg(&dy),
        arg(&dx),
        rows as u32,
        cols as u32,
        block,
        rms,
        [x.dtype.into(), dy.dtype.into()],
    );
    let (dgamma, count, dim) = column_launch(&x, rows, cols, 1);
    let dbeta = if rms {
        dgamma.clone()
    } else {
        empty_like(&dgamma)
    };
    norm_param_grads_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        arg(&x),
        arg(&mean),
        arg(&rstd),
        arg(&dy),
        arg(&dgamma),
        arg(&dbeta),
        rows as u32,
        cols as u32,
        COLUMN_CHUNK as u32,
        rms,
        [x.dtype.into(), dy.dtype.into()],
    );
    launched(2);
    let dtype = gamma.dtype;
    let dgamma = finish_columns(dgamma, dtype);
    let dbeta = (!rms).then(|| finish_columns(dbeta, dtype));
    (dx, dgamma, dbeta)
}
