//! The embedding table's gradient without atomics and in token order: each output-gradient row
//! added to its token's row exactly as Burn's `select_add` (and Flex) add them — `((0 + g₁) +
//! g₂) + …` over the token's positions in order, in f32 — but with the work spread over the
//! GPU. Burn's kernel gives each of the `d` columns one unit that walks all `n` positions in turn
//! (768 units for GPT-2, 8,192 dependent steps each: 2.7 ms of a GPT-2 124M step on an H200);
//! here:
//!
//! 1. a stable counting sort of the positions by token: position `i` goes to
//!    `#{j : idⱼ < idᵢ} + #{j < i : idⱼ = idᵢ}`, each unit counting against tiles of the ids in
//!    shared memory (`n²` comparisons spread over `n` units: a few µs at 8,192 tokens, and
//!    deterministic — PyTorch sorts too, then reduces segments);
//! 2. one cube per run of equal tokens in that order (a grid-stride over its first positions),
//!    its units over the columns, summing the run's rows in position order into the token's row;
//!
//! after one pass that zeroes the table. The rows of a run are independent loads (their
//! positions are known from the sort), so a run's sum is bound by the reads, not by a chain of
//! latencies; the one imbalance left is a run as long as the batch (every token the same), which
//! one cube sums alone. Ids outside `0..rows` add nothing (no write outside the table).

use super::{Cb, arg, contiguous, empty, launched};
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim};

/// Units per cube of both kernels (and ids per shared tile of the sort).
const BLOCK: usize = 256;

/// At most this many cubes stride over the sorted positions (most exit at once: only the first
/// position of each run works).
const MAX_RUN_CUBES: usize = 16_384;

/// `order[key(i)] = i` for every position `i < len`, `key(i) = #{j : idⱼ < idᵢ} + #{j < i : idⱼ =
/// idᵢ}`: the positions sorted by token, stably.
#[cube(launch)]
fn embedding_order_kernel<I: Int>(
    ids: &Tensor<I>,
    order: &mut Tensor<u32>,
    len: u32,
    #[comptime] block: usize,
    #[define(I)] _dtype: StorageType,
) {
    let len = len as usize;
    let tid = UNIT_POS_X as usize;
    let i = CUBE_POS_X as usize * block + tid;
    let mut tile = SharedMemory::<i32>::new(block);
    let mut mine = i32::new(0);
    if i < len {
        mine = i32::cast_from(ids[i]);
    }
    let mut key = 0usize;
    let mut start = 0usize;
    while start < len {
        // Every unit takes part in the tile's load and barriers, in range or not.
        if start + tid < len {
            tile[tid] = i32::cast_from(ids[start + tid]);
        }
        sync_cube();
        let mut end = len - start;
        if end > block {
            end = block;
        }
        for k in 0..end {
            let other = tile[k];
            let j = start + k;
            if other < mine || (other == mine && j < i) {
                key += 1;
            }
        }
        sync_cube();
        start += block;
    }
    if i < len {
        order[key] = i as u32;
    }
}

/// For each run of equal ids in `order` (a grid-stride over the sorted positions; a cube works
/// only at a run's first position), `table[id, c] = Σ grad[pos, c]` over the run's positions in
/// order, summed in f32, for every column `c` (the cube's units striding over them).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn embedding_rows_kernel<F: Float, I: Int>(
    grad: &Tensor<F>,
    ids: &Tensor<I>,
    order: &Tensor<u32>,
    table: &mut Tensor<F>,
    len: u32,
    rows: u32,
    cols: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let len = len as usize;
    let cols = cols as usize;
    let mut p = CUBE_POS_X as usize;
    while p < len {
        let id = i32::cast_from(ids[order[p] as usize]);
        let mut first = true;
        if p > 0 {
            first = i32::cast_from(ids[order[p - 1] as usize]) != id;
        }
        if first && id >= 0 && id < rows as i32 {
            let dst = id as usize * cols;
            let mut c = UNIT_POS_X as usize;
            while c < cols {
                let mut acc = f32::new(0.0);
                let mut q = p;
                let mut more = true;
                while more {
                    let pos = order[q] as usize;
                    acc += f32::cast_from(grad[pos * cols + c]);
                    q += 1;
                    more = q < len;
                    if more {
                        more = i32::cast_from(ids[order[q] as usize]) == id;
                    }
                }
                table[dst + c] = F::cast_from(acc);
                c += CUBE_DIM_X as usize;
            }
        }
        p += CUBE_COUNT_X as usize;
    }
}

/// The gradient of an embedding lookup of a `[rows, cols]` table: `grad` `[.., cols]` (one row
/// per id of `ids`, in order) added row by row into a zero table in `grad`'s dtype.
pub(super) fn backward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    rows: usize,
    grad: CubeTensor<R>,
    ids: CubeTensor<R>,
) -> CubeTensor<R> {
    let [grad, ids] = contiguous([grad, ids]);
    let len = ids.shape().num_elements();
    let cols = grad.shape()[grad.shape().num_dims() - 1];
    assert_eq!(
        grad.shape().num_elements(),
        len * cols,
        "embedding_backward: one gradient row per id"
    );
    let dtype = grad.dtype;
    let table =
        Cb::<R, F, I, BT>::float_zeros(Shape::new([rows, cols]), &grad.device, dtype.into());
    if len == 0 {
        return table;
    }
    let order = empty(&ids, Shape::new([len]), DType::U32);
    embedding_order_kernel::launch::<R>(
        &ids.client,
        CubeCount::Static(len.div_ceil(BLOCK) as u32, 1, 1),
        CubeDim::new_1d(BLOCK as u32),
        arg(&ids),
        arg(&order),
        len as u32,
        BLOCK,
        ids.dtype.into(),
    );
    embedding_rows_kernel::launch::<R>(
        &grad.client,
        CubeCount::Static(len.min(MAX_RUN_CUBES) as u32, 1, 1),
        CubeDim::new_1d(BLOCK.min(cols.next_power_of_two()).max(32) as u32),
        arg(&grad),
        arg(&ids),
        arg(&order),
        arg(&table),
        len as u32,
        rows as u32,
        cols as u32,
        [dtype.into(), ids.dtype.into()],
    );
    launched(2);
    table
}
