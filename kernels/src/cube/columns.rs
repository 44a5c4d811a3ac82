//! Column sums (a bias's gradient, a norm's parameter gradients) in two deterministic passes:
//! f32 partial sums over chunks of `COLUMN_CHUNK` rows, one unit per (chunk, vector of columns),
//! then one cube per 32 columns adding a column's partials in a fixed tree. No Burn reduction and
//! no cast in between: the result is written in its dtype by the second pass (f32 for the master
//! weights' gradients under a 16-bit compute dtype).

use super::reduce::column_chunk;
use super::{
    COLUMN_CHUNK, arg, contiguous, elementwise, empty, empty_f32, launched, row_vector, rows_cols,
};
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim};

/// Columns per cube of the finishing pass (a warp's coalesced row of partials).
const FINISH_COLS: usize = 32;
/// Units per column in the finishing pass (each adds every `FINISH_ROWS`-th partial).
const FINISH_ROWS: usize = 8;

/// Column sums over chunks of rows into `out[chunk, col]` (f32), `cols` vectors per row, each
/// unit a vector of columns.
#[cube(launch)]
fn column_sum_kernel<F: Float, N: Size>(
    input: &Tensor<Vector<F, N>>,
    out: &mut Tensor<f32>,
    rows: u32,
    cols: u32,
    chunk: u32,
    #[define(F)] _dtype: StorageType,
) {
    let n = input.vector_size();
    let vcols = cols as usize;
    let (col, start, end) = column_chunk(rows, vcols, chunk);
    let mut acc = Vector::<f32, N>::new(0.0);
    for row in start..end {
        acc += Vector::<f32, N>::cast_from(input[row * vcols + col]);
    }
    #[unroll]
    for j in 0..n {
        out[ABSOLUTE_POS * n + j] = acc[j];
    }
}

/// `out[col] = Σ partial[c, col]` over the `chunks` rows of `partial` (`cols` columns): a cube
/// per `FINISH_COLS` columns, `FINISH_ROWS` units per column each adding every
/// `FINISH_ROWS`-th chunk, then a tree over them (the same order on every run).
#[cube(launch)]
fn column_finish_kernel<O: Float>(
    partial: &Tensor<f32>,
    out: &mut Tensor<O>,
    chunks: u32,
    cols: u32,
    #[define(O)] _dtype: StorageType,
) {
    let (cols, chunks) = (cols as usize, chunks as usize);
    let (x, y) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
    let width = comptime!(FINISH_COLS);
    let group = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let col = group * width + x;
    let mut shared = SharedMemory::<f32>::new(comptime!(FINISH_COLS * FINISH_ROWS));
    let mut acc = f32::new(0.0);
    if col < cols {
        let mut c = y;
        while c < chunks {
            acc += partial[c * cols + col];
            c += comptime!(FINISH_ROWS);
        }
    }
    shared[y * width + x] = acc;
    sync_cube();
    #[unroll]
    for level in 0..comptime!(FINISH_ROWS.trailing_zeros()) {
        let stride = comptime!(FINISH_ROWS >> (level + 1));
        if y < stride {
            shared[y * width + x] += shared[(y + stride) * width + x];
        }
        sync_cube();
    }
    if y == 0 && col < cols {
        out[col] = O::cast_from(shared[x]);
    }
}

/// The chunk launch over `rows × cols` with vectors of `n` columns: `(partial, count, dim)`,
/// the partials `[chunks, cols]` f32.
pub(super) fn column_launch<R: CubeRuntime>(
    like: &CubeTensor<R>,
    rows: usize,
    cols: usize,
    n: usize,
) -> (CubeTensor<R>, CubeCount, CubeDim) {
    let chunks = rows.div_ceil(COLUMN_CHUNK).max(1);
    let (count, dim) = elementwise(like, chunks * cols / n);
    (empty_f32(like, [chunks, cols]), count, dim)
}

/// Sums `[chunks, cols]` f32 partials over the chunks into a `[cols]` tensor of `dtype` (one
/// launch).
pub(super) fn finish_columns<R: CubeRuntime>(
    partial: CubeTensor<R>,
    dtype: DType,
) -> CubeTensor<R> {
    let (chunks, cols) = (partial.shape()[0], partial.shape()[1]);
    let out = empty(&partial, Shape::new([cols]), dtype);
    let groups = cols.div_ceil(FINISH_COLS).max(1);
    let x = groups.min(65_535);
    column_finish_kernel::launch::<R>(
        &partial.client,
        CubeCount::Static(x as u32, groups.div_ceil(x) as u32, 1),
        CubeDim::new_2d(FINISH_COLS as u32, FINISH_ROWS as u32),
        arg(&partial),
        arg(&out),
        chunks as u32,
        cols as u32,
        dtype.into(),
    );
    launched(1);
    out
}

/// `Σ x` over every dimension but the last (a linear layer's bias gradient: Burn's
/// `linear_bias_backward`), accumulated in f32 and written in `dtype`: two launches, where
/// Burn's is a strided reduction per leading dimension (the first of them one unit per output
/// element, 8,192 rows each at GPT-2's shapes) and a cast.
pub(crate) fn column_sums<R: CubeRuntime>(x: CubeTensor<R>, dtype: DType) -> CubeTensor<R> {
    let [x] = contiguous([x]);
    let (rows, cols) = rows_cols(&x.shape());
    let n = row_vector(&[&x], cols);
    let (partial, count, dim) = column_launch(&x, rows, cols, n);
    column_sum_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        n,
        arg(&x),
        arg(&partial),
        rows as u32,
        (cols / n) as u32,
        COLUMN_CHUNK as u32,
        x.dtype.into(),
    );
    launched(1);
    finish_columns(partial, dtype)
}
