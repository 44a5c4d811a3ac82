//! The cube-wide reductions the row kernels share (one row per cube, `CUBE_DIM_X` units striding
//! over it, a tree through shared memory: deterministic).

use super::NEG_BIG;
use cubecl::prelude::*;

/// Tree-sum of `shared[0..CUBE_DIM_X]` into `shared[0]`. Callers sync before reading `[0]` and
/// again before reusing `shared`.
#[cube]
pub(super) fn tree_sum(shared: &mut SharedMemory<f32>) {
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

/// Σ of every unit's `value` over the cube, through `shared` (`CUBE_DIM_X` long), returned to
/// every unit; `shared` may be reused after the call.
#[cube]
pub(super) fn cube_sum(shared: &mut SharedMemory<f32>, value: f32) -> f32 {
    shared[UNIT_POS_X as usize] = value;
    sync_cube();
    tree_sum(shared);
    let total = shared[0];
    sync_cube();
    total
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

/// `(row, first element)` of the row of `cols` handled by this cube (rows are spread over the x
/// and y cube counts); a cube past the last row stops here (all its units: no barrier is left
/// waiting).
#[cube]
pub(super) fn this_row(rows: u32, cols: usize) -> (usize, usize) {
    let row = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    if row >= rows as usize {
        terminate!();
    }
    (row, row * cols)
}

/// Log-sum-exp of the row of `vectors` vectors from vector `base` (an online max and Σexp per
/// unit — one rescale per vector — combined over the cube), returned to every unit.
#[cube]
pub(super) fn row_logsumexp<F: Float, N: Size>(
    input: &Tensor<Vector<F, N>>,
    base: usize,
    vectors: usize,
    #[comptime] block: usize,
) -> f32 {
    let n = input.vector_size();
    let tid = UNIT_POS_X as usize;
    let step = CUBE_DIM_X as usize;
    let mut maxes = SharedMemory::<f32>::new(block);
    let mut sums = SharedMemory::<f32>::new(block);
    let mut m = f32::new(NEG_BIG);
    let mut s = f32::new(0.0);
    let mut c = tid;
    while c < vectors {
        let x = input[base + c];
        let mut vm = f32::cast_from(x[0]);
        #[unroll]
        for j in 1..n {
            vm = f32::max(vm, f32::cast_from(x[j]));
        }
        let nm = f32::max(m, vm);
        let mut add = f32::new(0.0);
        #[unroll]
        for j in 0..n {
            add += f32::exp(f32::cast_from(x[j]) - nm);
        }
        s = s * f32::exp(m - nm) + add;
        m = nm;
        c += step;
    }
    maxes[tid] = m;
    sums[tid] = s;
    sync_cube();
    tree_max_sum(&mut maxes, &mut sums);
    maxes[0] + f32::ln(sums[0])
}

/// For a column reduction over chunks of `chunk` rows, one unit per (chunk, column), `cols`
/// columns: this unit's column and its chunk's rows `start..end`; a unit past the last chunk
/// stops here.
#[cube]
pub(super) fn column_chunk(rows: u32, cols: usize, chunk: u32) -> (usize, usize, usize) {
    if ABSOLUTE_POS >= (rows as usize).div_ceil(chunk as usize) * cols {
        terminate!();
    }
    let part = ABSOLUTE_POS / cols;
    let col = ABSOLUTE_POS % cols;
    let start = part * chunk as usize;
    let end = usize::min(start + chunk as usize, rows as usize);
    (col, start, end)
}
