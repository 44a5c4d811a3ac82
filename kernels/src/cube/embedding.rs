//! The embedding table's gradient without atomics, deterministic: each output-gradient row added
//! to its token's row, with the work spread over the GPU. Burn's kernel gives each of the `d`
//! columns one unit that walks all `n` positions in turn (768 units for GPT-2, 8,192 dependent
//! steps each: 2.7 ms of a GPT-2 124M step on an H200); here:
//!
//! 1. a stable counting sort of the positions by token: position `i` goes to
//!    `#{j : idⱼ < idᵢ} + #{j < i : idⱼ = idᵢ}`, each unit counting against tiles of the ids in
//!    shared memory (`n²` comparisons spread over `n` units: a few µs at 8,192 tokens, and
//!    deterministic — PyTorch sorts too, then reduces segments); the sort also records, for
//!    each sorted position, where its token's run starts (`#{j : idⱼ < idᵢ}`) and how long it is;
//! 2. one cube per segment of at most [`SEGMENT`] positions of a run (a grid-stride over the
//!    sorted positions), its units over the columns, summing the segment's rows in position
//!    order in f32: a run of one segment straight into its token's row, a longer run's segments
//!    into partial rows;
//! 3. one cube per longer run, adding its segments' partial rows in order into the token's row
//!    (the same kernel's second pass);
//!
//! after one pass that zeroes the table. The table is a contiguous buffer of our own, zeroed by
//! [`zero_kernel`]: Burn's `float_zeros` allocates with CubeCL's "optimized" layout, which on
//! CUDA pads each row to an aligned pitch where the row's bytes are not a multiple of it (a
//! 5-wide f32 table gets row stride 8), and the kernels here write rows at `id · cols` — on that
//! layout, the wrong elements (the CUDA-only failure of the 37 × 5 case, 2026-11-30).
//!
//! A run of up to [`SEGMENT`] positions is summed exactly as Burn's `select_add` (and Flex) sum
//! it — `((0 + g₁) + g₂) + …` in position order, in f32 — so its row is their gradient bit for
//! bit; a longer one (a common token: ≈ 6% of a batch of text, 490 of GPT-2's 8,192 positions)
//! in segments of [`SEGMENT`], then the segments in order. On the H200 the earlier form, one cube
//! per run, took 0.98 ms at GPT-2's shape against PyTorch's 0.22: the commonest token's run,
//! summed by one cube alone. Ids outside `0..rows` add nothing (no
//! write outside the table).

use super::{arg, contiguous, elementwise, empty, empty_f32, launched};
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim};

/// Units per cube of both kernels (and ids per shared tile of the sort).
const BLOCK: usize = 256;

/// At most this many cubes stride over the sorted positions (most exit at once: only the first
/// position of each segment, or of each long run, works).
const MAX_RUN_CUBES: usize = 16_384;

/// Positions a cube sums in order ([`crate::EMBEDDING_SEGMENT`]).
const SEGMENT: usize = crate::EMBEDDING_SEGMENT;

/// `out[i] = 0` for every `i < n` (one unit per element).
#[cube(launch)]
fn zero_kernel<F: Float>(out: &mut Tensor<F>, n: u32, #[define(F)] _dtype: StorageType) {
    let i = ABSOLUTE_POS;
    if i < n as usize {
        out[i] = F::new(0.0);
    }
}

/// `order[key(i)] = i` for every position `i < len`, `key(i) = #{j : idⱼ < idᵢ} + #{j < i : idⱼ =
/// idᵢ}`: the positions sorted by token, stably; `first[key(i)] = #{j : idⱼ < idᵢ}` (where
/// `i`'s run starts in that order) and `count[key(i)] = #{j : idⱼ = idᵢ}` (its length).
#[cube(launch)]
fn embedding_order_kernel<I: Int>(
    ids: &Tensor<I>,
    order: &mut Tensor<u32>,
    first: &mut Tensor<u32>,
    count: &mut Tensor<u32>,
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
    let mut less = 0usize;
    let mut before = 0usize;
    let mut same = 0u32;
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
            if other < mine {
                less += 1;
            }
            if other == mine {
                same += 1;
                if start + k < i {
                    before += 1;
                }
            }
        }
        sync_cube();
        start += block;
    }
    if i < len {
        let key = less + before;
        order[key] = i as u32;
        first[key] = less as u32;
        count[key] = same;
    }
}

/// Two passes over the sorted positions (a grid-stride; a cube works only where its pass
/// begins something), each cube's units striding over the columns, summing in f32:
/// - `combine` false: for each segment of a run of equal ids in `order` — the run's positions
///   `k·seg..(k + 1)·seg` from its start (`first`; `count` long) — the segment's gradient rows
///   in order, into `table[id, ..]` when the run is one segment, else into `partial[p, ..]` (`p`
///   the segment's first sorted position);
/// - `combine` true: for each run of more than `seg` ids, its segments' partial rows in order,
///   into `table[id, ..]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments, clippy::manual_is_multiple_of)]
fn embedding_rows_kernel<F: Float, I: Int>(
    grad: &Tensor<F>,
    ids: &Tensor<I>,
    order: &Tensor<u32>,
    first: &Tensor<u32>,
    count: &Tensor<u32>,
    table: &mut Tensor<F>,
    partial: &mut Tensor<f32>,
    len: u32,
    rows: u32,
    cols: u32,
    #[comptime] seg: usize,
    #[comptime] combine: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let len = len as usize;
    let cols = cols as usize;
    let mut p = CUBE_POS_X as usize;
    while p < len {
        let at = p - first[p] as usize;
        let n = count[p] as usize;
        let id = i32::cast_from(ids[order[p] as usize]);
        let mut works = id >= 0 && id < rows as i32;
        if combine {
            works = works && at == 0 && n > seg;
        } else {
            works = works && at % seg == 0;
        }
        if works {
            let dst = id as usize * cols;
            let mut c = UNIT_POS_X as usize;
            while c < cols {
                let mut acc = f32::new(0.0);
                if combine {
                    let mut q = p;
                    while q < p + n {
                        acc += partial[q * cols + c];
                        q += seg;
                    }
                    table[dst + c] = F::cast_from(acc);
                } else {
                    let mut end = at + seg;
                    if end > n {
                        end = n;
                    }
                    for q in p..p + (end - at) {
                        acc += f32::cast_from(grad[order[q] as usize * cols + c]);
                    }
                    if n <= seg {
                        table[dst + c] = F::cast_from(acc);
                    } else {
                        partial[p * cols + c] = acc;
                    }
                }
                c += CUBE_DIM_X as usize;
            }
        }
        p += CUBE_COUNT_X as usize;
    }
}

/// The gradient of an embedding lookup of a `[rows, cols]` table: `grad` `[.., cols]` (one row
/// per id of `ids`, in order) added row by row into a zero table in `grad`'s dtype.
pub(super) fn backward<R: CubeRuntime>(
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
    // Contiguous (see the module docs), zeroed here.
    let table = empty(&grad, Shape::new([rows, cols]), dtype);
    let (count, dim) = elementwise(&grad, rows * cols);
    zero_kernel::launch::<R>(
        &grad.client,
        count,
        dim,
        arg(&table),
        (rows * cols) as u32,
        dtype.into(),
    );
    if len == 0 {
        launched(1);
        return table;
    }
    let order = empty(&ids, Shape::new([len]), DType::U32);
    let first = empty(&ids, Shape::new([len]), DType::U32);
    let count = empty(&ids, Shape::new([len]), DType::U32);
    embedding_order_kernel::launch::<R>(
        &ids.client,
        CubeCount::Static(len.div_ceil(BLOCK) as u32, 1, 1),
        CubeDim::new_1d(BLOCK as u32),
        arg(&ids),
        arg(&order),
        arg(&first),
        arg(&count),
        len as u32,
        BLOCK,
        ids.dtype.into(),
    );
    // The partial rows of runs longer than one segment (written only for them, at the row of
    // each segment's first sorted position).
    let partial = empty_f32(&grad, [len, cols]);
    let cubes = CubeCount::Static(len.min(MAX_RUN_CUBES) as u32, 1, 1);
    let dim = CubeDim::new_1d(BLOCK.min(cols.next_power_of_two()).max(32) as u32);
    for combine in [false, true] {
        embedding_rows_kernel::launch::<R>(
            &grad.client,
            cubes.clone(),
            dim,
            arg(&grad),
            arg(&ids),
            arg(&order),
            arg(&first),
            arg(&count),
            arg(&table),
            arg(&partial),
            len as u32,
            rows as u32,
            cols as u32,
            SEGMENT,
            combine,
            [dtype.into(), ids.dtype.into()],
        );
    }
    launched(4);
    table
}
