//! GELU with bias (the exact, erf form, or the tanh approximation: one kernel each, chosen at
//! compile time), elementwise; the bias gradient as f32 column sums over chunks of rows.

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

/// `tanh(√(2/π)(z + 0.044715 z³))`, the tanh form's.
#[cube]
fn tanh_form(z: f32) -> f32 {
    f32::tanh(f32::new(0.797_884_6) * (z + f32::new(0.044_715) * z * z * z))
}

#[cube(launch)]
fn gelu_bias_kernel<F: Float>(
    input: &Tensor<F>,
    bias: &Tensor<F>,
    output: &mut Tensor<F>,
    len: u32,
    cols: u32,
    #[comptime] tanh: bool,
    #[define(F)] _dtype: StorageType,
) {
    let z = biased::<F>(input, bias, len, cols);
    let y = if comptime!(tanh) {
        f32::new(0.5) * z * (f32::new(1.0) + tanh_form(z))
    } else {
        z * normal_cdf(z)
    };
    output[ABSOLUTE_POS] = F::cast_from(y);
}

/// `dz = dy·(Φ(z) + z·φ(z))` per element; for the tanh form
/// `dy·((1 + t)/2 + z(1 − t²)·√(2/π)(1 + 3·0.044715 z²)/2`.
#[cube(launch)]
fn gelu_bias_backward_kernel<F: Float>(
    input: &Tensor<F>,
    bias: &Tensor<F>,
    dy: &Tensor<F>,
    dx: &mut Tensor<F>,
    len: u32,
    cols: u32,
    #[comptime] tanh: bool,
    #[define(F)] _dtype: StorageType,
) {
    let z = biased::<F>(input, bias, len, cols);
    let slope = if comptime!(tanh) {
        let t = tanh_form(z);
        let du = f32::new(0.797_884_6) * (f32::new(1.0) + f32::new(0.134_145) * z * z);
        f32::new(0.5) * (f32::new(1.0) + t) + f32::new(0.5) * z * (f32::new(1.0) - t * t) * du
    } else {
        let pdf = f32::exp(f32::new(-0.5) * z * z) * f32::new(0.398_942_3);
        normal_cdf(z) + z * pdf
    };
    dx[ABSOLUTE_POS] = F::cast_from(f32::cast_from(dy[ABSOLUTE_POS]) * slope);
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

/// `gelu(x + bias)` (with `tanh`, the tanh form).
pub(super) fn forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    bias: CubeTensor<R>,
    tanh: bool,
) -> CubeTensor<R> {
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
        tanh,
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
    tanh: bool,
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
        tanh,
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
