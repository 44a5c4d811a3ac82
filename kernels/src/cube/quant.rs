//! 8-bit optimizer state on the device (bitsandbytes' `quantize_blockwise` and
//! `dequantize_blockwise`, Dettmers et al. 2022): the block maxima, the quantisation and the
//! dequantisation of a flat piece, one launch each, where the Burn-op forms
//! ([`crate::quant`]) take about a dozen.
//!
//! The arithmetic is the host loops' ([`crate::flex`]'s `quant`), so the three give the same
//! numbers: each block's largest magnitude (a max, exact in any order), each value times its
//! block's `1 / max(absmax, 1e-38)` in f32, clamped to ±1, and the number of the map's 255
//! midpoints below it (an 8-level binary search); a value is `map[code] · absmax[block]`. Blocks
//! past the tensor (a padded piece's zeros) read a scale of 0.
//!
//! * `absmax`: one cube per block of the tensor, its units striding over the block's elements
//!   the piece holds, a tree max through shared memory; blocks the piece does not touch get 0
//!   (what the all-reduce over the pieces needs);
//! * `quantise` and `dequantise`: a grid of cubes striding over the piece, the map (or its
//!   midpoints) first loaded into shared memory, so the search reads no global memory;
//! * `unless_skipped`: the loss scaler's flag read on the device, element by element.
//!
//! Codes are any integer dtype the backend stores: `u8` on CUDA, `i32` on Wgpu (WGSL has no 8-bit
//! integers).

use super::{arg, as_dtype, empty, launched, row_launch};
use burn::tensor::{DType, IntDType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim};

/// Launches of these kernels since start-up (process-wide; the tests check that they ran).
static LAUNCHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The 8-bit state kernels' launches so far.
pub fn quant_launches() -> u64 {
    LAUNCHES.load(std::sync::atomic::Ordering::Relaxed)
}

fn counted() {
    launched(1);
    LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Units per cube of the strided kernels (and the map's 256 entries: one load each).
const UNITS: usize = 256;

/// The floor of a block's scale before its reciprocal (the host loops' and bitsandbytes').
const FLOOR: f32 = 1e-38;

/// The reciprocal of a block's scale: `1 / max(a, FLOOR)`, with the floor's reciprocal computed
/// on the host (`big`), so a device that flushes subnormals (`FLOOR` is one) still gives the
/// host's number for an all-zero block.
#[cube]
fn recip(a: f32, floor: f32, big: f32) -> f32 {
    select(a > floor, f32::new(1.0) / a, big)
}

/// The first `n` entries of a 256-value table (the map, or its 255 midpoints) in `shared`: one
/// load per unit of the cube, then a barrier.
#[cube]
fn load_table<F: Float>(table: &Tensor<F>, shared: &mut SharedMemory<f32>, #[comptime] n: usize) {
    let tid = UNIT_POS_X as usize;
    if tid < n {
        shared[tid] = f32::cast_from(table[tid]);
    }
    sync_cube();
}

/// Whether element `i` of the piece (flat `start + i`) lies in one of the tensor's `total`
/// blocks, and that block's scale (0 past the tensor: a padded piece's zeros).
#[cube]
fn block_scale<F: Float>(
    absmax: &Tensor<F>,
    i: usize,
    start: u32,
    block: u32,
    total: u32,
) -> (bool, f32) {
    let b = (start as usize + i) / block as usize;
    let inside = b < total as usize;
    let mut scale = f32::new(0.0);
    if inside {
        scale = f32::cast_from(absmax[b]);
    }
    (inside, scale)
}

#[cube(launch)]
fn absmax_kernel<F: Float>(
    x: &Tensor<F>,
    out: &mut Tensor<F>,
    len: u32,
    start: u32,
    block: u32,
    total: u32,
    #[comptime] units: usize,
    #[define(F)] _dtype: StorageType,
) {
    let b = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    if b >= total as usize {
        terminate!();
    }
    let tid = UNIT_POS_X as usize;
    let len = len as usize;
    let start = start as usize;
    let block = block as usize;
    // The block's elements in the piece: flat `b·block ..` less the piece's start, clipped.
    let global = b * block;
    let end = global + block;
    let mut lo = 0usize;
    if global > start {
        lo = global - start;
    }
    let mut hi = 0usize;
    if end > start {
        hi = end - start;
    }
    lo = usize::min(lo, len);
    hi = usize::min(hi, len);
    let mut shared = SharedMemory::<f32>::new(units);
    let mut m = f32::new(0.0);
    let mut i = lo + tid;
    while i < hi {
        m = f32::max(m, f32::abs(f32::cast_from(x[i])));
        i += units;
    }
    shared[tid] = m;
    sync_cube();
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if tid < stride {
            shared[tid] = f32::max(shared[tid], shared[tid + stride]);
        }
        sync_cube();
        stride /= 2;
    }
    if tid == 0 {
        out[b] = F::cast_from(shared[0]);
    }
}

#[cube(launch)]
fn quantise_kernel<F: Float, I: Int>(
    x: &Tensor<F>,
    absmax: &Tensor<F>,
    mids: &Tensor<F>,
    codes: &mut Tensor<I>,
    len: u32,
    start: u32,
    block: u32,
    total: u32,
    floor: f32,
    big: f32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let mut shared = SharedMemory::<f32>::new(256usize);
    load_table::<F>(mids, &mut shared, 255usize);
    let stride = (CUBE_COUNT_X * CUBE_DIM_X) as usize;
    let mut i = CUBE_POS_X as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    while i < len as usize {
        let (inside, a) = block_scale::<F>(absmax, i, start, block, total);
        let r = select(inside, recip(a, floor, big), f32::new(0.0));
        let scaled = clamp(f32::cast_from(x[i]) * r, f32::new(-1.0), f32::new(1.0));
        // Branchless, as the host loop: the count of midpoints below the value.
        let mut at = 0usize;
        #[unroll]
        for level in 0..8u32 {
            let step = 128usize >> level as usize;
            at += select(scaled > shared[at + step - 1], step, 0usize);
        }
        codes[i] = I::cast_from(at as u32);
        i += stride;
    }
}

#[cube(launch)]
fn dequantise_kernel<F: Float, I: Int>(
    codes: &Tensor<I>,
    absmax: &Tensor<F>,
    map: &Tensor<F>,
    out: &mut Tensor<F>,
    len: u32,
    start: u32,
    block: u32,
    total: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let mut shared = SharedMemory::<f32>::new(256usize);
    load_table::<F>(map, &mut shared, 256usize);
    let stride = (CUBE_COUNT_X * CUBE_DIM_X) as usize;
    let mut i = CUBE_POS_X as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    while i < len as usize {
        let (_, scale) = block_scale::<F>(absmax, i, start, block, total);
        let code = u32::cast_from(codes[i]) as usize;
        out[i] = F::cast_from(shared[code] * scale);
        i += stride;
    }
}

#[cube(launch)]
fn unless_skipped_kernel<F: Float, I: Int>(
    new: &Tensor<I>,
    kept: &Tensor<I>,
    skip: &Tensor<F>,
    out: &mut Tensor<I>,
    len: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i >= len as usize {
        terminate!();
    }
    if f32::cast_from(skip[0]) != f32::new(0.0) {
        out[i] = kept[i];
    } else {
        out[i] = new[i];
    }
}

/// A grid of `UNITS`-unit cubes striding over `len` elements, about 4 per unit.
fn strided(len: usize) -> (CubeCount, CubeDim) {
    let cubes = len.div_ceil(UNITS * 4).clamp(1, 65_535);
    (
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_1d(UNITS as u32),
    )
}

/// Flat indices are `u32` in the kernels.
fn index(n: usize, what: &str) -> u32 {
    u32::try_from(n).unwrap_or_else(|_| panic!("8-bit state: {what} {n} is past u32"))
}

/// [`crate::FusedOps::blockwise_absmax`]: `[total]` in the piece's dtype.
pub(super) fn absmax<R: CubeRuntime>(
    x: CubeTensor<R>,
    start: usize,
    block: usize,
    total: usize,
) -> CubeTensor<R> {
    let x = into_contiguous(x);
    let len = x.shape().num_elements();
    let out = empty(&x, Shape::new([total]), x.dtype);
    if total == 0 {
        return out;
    }
    let (count, _, _) = row_launch(total, 1);
    absmax_kernel::launch::<R>(
        &x.client,
        count,
        CubeDim::new_1d(UNITS as u32),
        arg(&x),
        arg(&out),
        index(len, "piece length"),
        index(start, "start"),
        index(block, "block"),
        index(total, "blocks"),
        UNITS,
        x.dtype.into(),
    );
    counted();
    out
}

/// Where a flat piece lies in its tensor: its first element's flat index, and the block size.
#[derive(Clone, Copy, Debug)]
pub(super) struct At {
    pub start: usize,
    pub block: usize,
}

/// [`crate::FusedOps::blockwise_quantise`]: the codes as `dtype`.
pub(super) fn quantise<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    [x, absmax, mids]: [CubeTensor<R>; 3],
    At { start, block }: At,
    dtype: IntDType,
) -> CubeTensor<R> {
    let x = into_contiguous(x);
    let [absmax, mids] = [absmax, mids].map(|t| as_dtype::<R, F, I, BT>(t, x.dtype));
    assert_eq!(mids.shape().num_elements(), 255, "quantise: 255 midpoints");
    let len = x.shape().num_elements();
    let total = absmax.shape().num_elements();
    let codes = empty(&x, Shape::new([len]), DType::from(dtype));
    if len == 0 {
        return codes;
    }
    let (count, dim) = strided(len);
    quantise_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        arg(&x),
        arg(&absmax),
        arg(&mids),
        arg(&codes),
        index(len, "piece length"),
        index(start, "start"),
        index(block, "block"),
        index(total, "blocks"),
        FLOOR,
        1.0 / FLOOR,
        [x.dtype.into(), codes.dtype.into()],
    );
    counted();
    codes
}

/// [`crate::FusedOps::blockwise_dequantise`]: the values in the scales' dtype.
pub(super) fn dequantise<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    [codes, absmax, map]: [CubeTensor<R>; 3],
    At { start, block }: At,
) -> CubeTensor<R> {
    let [codes, absmax] = [codes, absmax].map(into_contiguous);
    let map = as_dtype::<R, F, I, BT>(map, absmax.dtype);
    assert_eq!(
        map.shape().num_elements(),
        256,
        "dequantise: a 256-value map"
    );
    let len = codes.shape().num_elements();
    let total = absmax.shape().num_elements();
    let out = empty(&absmax, Shape::new([len]), absmax.dtype);
    if len == 0 {
        return out;
    }
    let (count, dim) = strided(len);
    dequantise_kernel::launch::<R>(
        &codes.client,
        count,
        dim,
        arg(&codes),
        arg(&absmax),
        arg(&map),
        arg(&out),
        index(len, "piece length"),
        index(start, "start"),
        index(block, "block"),
        index(total, "blocks"),
        [absmax.dtype.into(), codes.dtype.into()],
    );
    counted();
    out
}

/// [`crate::FusedOps::int_unless_skipped`] in one elementwise pass.
pub(super) fn unless_skipped<R: CubeRuntime>(
    new: CubeTensor<R>,
    kept: CubeTensor<R>,
    skip: CubeTensor<R>,
) -> CubeTensor<R> {
    let [new, kept, skip] = [new, kept, skip].map(into_contiguous);
    assert_eq!(new.shape(), kept.shape(), "unless_skipped: shapes");
    let len = new.shape().num_elements();
    let out = empty(&new, new.shape(), new.dtype);
    if len == 0 {
        return out;
    }
    let (count, dim) = super::elementwise(&new, len);
    unless_skipped_kernel::launch::<R>(
        &new.client,
        count,
        dim,
        arg(&new),
        arg(&kept),
        arg(&skip),
        arg(&out),
        index(len, "length"),
        [skip.dtype.into(), new.dtype.into()],
    );
    counted();
    out
}
