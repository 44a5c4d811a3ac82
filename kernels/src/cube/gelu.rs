//! GELU with bias (the exact, erf form), elementwise; the bias gradient as f32 column sums over
//! chunks of rows.

use super::reduce::column_chunk;
use super::{
    COLUMN_CHUNK, arg, column_launch, contiguous, elementwise, empty_like, finish_columns,
    launched, rows_cols,
};
use burn::tensor::TensorMetadata;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

/// `z = x + bias` at element `ABSOLUTE_POS` of `len`, in rows of `cols`; a unit past the last
/// element stops here.
#[cube]
fn biased<F: Float>(input: &Tensor<F>, bias: &Tensor<F>, len: u32, cols: u32) -> f32 {
    if ABSOLUTE_POS >= len as usize {
        terminate!();
    }
    f32::cast_from(input[ABSOLUTE_POS]) + f32::cast_from(bias[ABSOLUTE_POS % cols as usize])
}

/// The standard normal CDF `Φ(z) = (1 + erf(z/√2))/2`.
#[cube]
fn normal_cdf(z: f32) -> f32 {
    f32::new(0.5) * (f32::new(1.0) + Erf::erf(z * f32::new(0.70710677)))
}

#[cube(launch)]
fn gelu_bias_kernel<F: Float>(
    input: &Tensor<F>,
    bias: &Tensor<F>,
    output: &mut Tensor<F>,
    len: u32,
    cols: u32,
    #[define(F)] _dtype: StorageType,
) {
    let z = biased::<F>(input, bias, len, cols);
    output[ABSOLUTE_POS] = F::cast_from(z * normal_cdf(z));
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
    let z = biased::<F>(input, bias, len, cols);
    let pdf = f32::exp(f32::new(-0.5) * z * z) * f32::new(0.398_942_3);
    dx[ABSOLUTE_POS] = F::cast_from(f32::cast_from(dy[ABSOLUTE_POS]) * (normal_cdf(z) + z * pdf));
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
    let (col, start, end) = column_chunk(rows, cols, chunk);
    let mut acc = f32::new(0.0);
    for row in start..end {
        acc += f32::cast_from(input[row * cols + col]);
    }
    out[ABSOLUTE_POS] = acc;
}

/// `gelu(x + bias)`.
pub(super) fn forward<R: CubeRuntime>(x: CubeTensor<R>, bias: CubeTensor<R>) -> CubeTensor<R> {
    let [x, bias] = contiguous([x, bias]);
    let (rows, cols) = rows_cols(&x.shape());
    let out = empty_like(&x);
    let (count, dim) = elementwise(&x, rows * cols);
    gelu_bias_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        arg(&x),
        arg(&bias),
        arg(&out),
        (rows * cols) as u32,
        cols as u32,
        x.dtype.into(),
    );
    launched(1);
    out
}

/// `(dx, dbias)`.
pub(super) fn backward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    x: CubeTensor<R>,
    bias: CubeTensor<R>,
    dy: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [x, bias, dy] = contiguous([x, bias, dy]);
    let (rows, cols) = rows_cols(&x.shape());
    let dx = empty_like(&x);
    let (count, dim) = elementwise(&x, rows * cols);
    gelu_bias_backward_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        arg(&x),
        arg(&bias),
        arg(&dy),
        arg(&dx),
        (rows * cols) as u32,
        cols as u32,
        x.dtype.into(),
    );
    let (partial, count, dim) = column_launch(&x, rows, cols);
    column_sum_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        arg(&dx),
        arg(&partial),
        rows as u32,
        cols as u32,
        COLUMN_CHUNK as u32,
        x.dtype.into(),
    );
    launched(2);
    (dx, finish_columns::<R, F, I, BT>(partial, bias.dtype))
}
