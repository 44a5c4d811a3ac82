//! The flash-attention kernels. The register kernels of [`registers`] (FlashAttention-2's data
//! flow: scores, probabilities and accumulators in registers, `mma.m16n8k16` on CUDA sm_80 and
//! later) run f16/bf16 there by default (`WILDFIRE_ATTENTION_MMA=0` opts out; checked on an
//! H200 against the f32 tiles, and emulated on lavapipe against Burn ops). Everything else runs
//! the kernels below.
//!
//! These use FlashAttention-2's work split: each plane (32 units, a CUDA
//! warp) owns `rows` rows of the cube's block — queries in the forward and the dQ pass, keys in
//! the dK/dV pass — and keeps their accumulators (O, dQ, dK and dV) in tensor-core fragments
//! (`cmma`, 16 × 16 × 16, f32) for the whole loop over the other side's blocks; only the operand
//! blocks the planes share (K and V, or Q and dO) go through shared memory. Each plane's score
//! tile goes to its own shared-memory scratch, where its units take a row each (`32 / rows`
//! units per row, a slice of the row each, rotated by lane so a plane's reads hit 32 banks) for
//! the softmax, synchronising only the plane. The forward rescales its output only when a row's
//! running maximum grows by more than `e^8` (FlashAttention-4's lazy rescale: exact, since the
//! final normalisation uses the same maximum), so the fragments leave registers on a rescale
//! only, in practice in the first blocks.
//!
//! Without tensor cores (Wgpu, f32) the same kernels run with the fragments replaced by plane
//! tiles in shared memory multiplied by plain loops, and every plane barrier widened to the cube
//! (a Wgpu plane need not have 32 units): one algorithm, two ways to multiply a tile — the
//! lavapipe tests check the one the GPU runs.
//!
//! Shared-memory rows are padded (`+8` elements of the input, `+4` f32) against bank conflicts
//! of the fragment loads and stores; [`Flash::shared_bytes`] mirrors the allocations.

use super::NEG_BIG;
use super::heads::{
    Heads, Operands, Problem, first_query_block, head_base, keys_end, load_stats, seq_arg,
    this_head, visible,
};
use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::features::MmaConfig;
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim};

/// The flash kernels' floating-point modes: `exp` as the hardware's approximation (`__expf` on
/// CUDA; the scores stay finite: masked ones are `NEG_BIG`, not −∞).
macro_rules! fast_exp {
    () => {
        FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
    };
}

/// Units per plane (a tensor-core fragment is spread over 32).
const LANES: usize = 32;
/// Padding of an input-dtype shared-memory row (16 bytes at 16 bits).
const PAD_E: usize = 8;
/// Padding of an f32 shared-memory row (16 bytes).
const PAD_F: usize = 4;
/// A row's running maximum is raised (and its output rescaled) only past this much growth.
const RESCALE_THRESHOLD: f32 = 8.0;

/// Which pass a tile choice is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    Forward,
    BackwardQ,
    BackwardKv,
}

/// The older kernels' comptime layout for head dim `d` and blocks of `blk`: an input row's pitch
/// (padded), a probability row's, an f32 row's, the units per row (`LANES / rows`) and the
/// columns of a block each of them takes.
const fn tile_layout(d: usize, blk: usize, rows: usize) -> (usize, usize, usize, usize, usize) {
    let w = if blk > d { blk } else { d };
    let per_row = LANES / rows;
    (d + PAD_E, blk + PAD_E, w + PAD_F, per_row, blk / per_row)
}

/// The work split of one launch (all comptime in the kernels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Flash {
    /// Planes per cube.
    pub planes: usize,
    /// Rows each plane owns (16 with tensor cores: one fragment high).
    pub rows: usize,
    /// Rows of the other side per loop step (keys, or queries in the dK/dV pass).
    pub block: usize,
    /// Tensor-core fragments (with `registers`: the `mma` instruction, else emulated).
    pub cmma: bool,
    /// The register-fragment kernels ([`registers`]).
    pub registers: bool,
    /// With `registers`: the B operands by `ldmatrix` (with the `mma` instruction, CUDA), and
    /// the next block's reads issued before the current block's products (software pipelining:
    /// the forward and the dQ pass).
    pub loads: registers::Loads,
}

impl Flash {
    /// Rows a cube owns.
    pub fn owned(&self) -> usize {
        self.planes * self.rows
    }

    /// Shared-memory bytes of `pass` for head dimension `d` and input element size `es`
    /// (mirrors the kernels' allocations).
    pub fn shared_bytes(&self, pass: Pass, d: usize, es: usize) -> usize {
        let (own, blk) = (self.owned(), self.block);
        let ld = d + PAD_E;
        let w = blk.max(d) + PAD_F;
        let red = 4 * self.planes * LANES;
        let plain_acc = |n: usize| if self.cmma { 4 } else { 4 * n * own * d };
        match pass {
            Pass::Forward => {
                es * (own * ld + 2 * blk * ld + own * (blk + PAD_E))
                    + 4 * own * w
                    + red
                    + 4 * own
                    + plain_acc(1)
            }
            Pass::BackwardQ => {
                es * (2 * own * ld + 2 * blk * ld + own * (blk + PAD_E))
                    + 8 * own * w
                    + red
                    + plain_acc(1)
            }
            Pass::BackwardKv => {
                es * (2 * own * ld + 2 * blk * ld + 2 * own * (blk + PAD_E))
                    + 8 * own * w
                    + 8 * blk
                    + plain_acc(2)
            }
        }
    }

    /// The split for `pass` on `like`'s device: tensor cores when the dtype is f16/bf16, `d` a
    /// multiple of 16 and the device has 16 × 16 × 16 fragments for it with f32 accumulation and
    /// planes of 32 (unless `WILDFIRE_ATTENTION_CMMA=0`). Four planes of 16 rows (8 without
    /// tensor cores) and blocks of 64;
    /// while the cube's shared memory exceeds the device's (or 100 KB: two cubes per H100
    /// multiprocessor) the block halves down to 16, then the planes, then (without tensor cores)
    /// the rows down to 2.
    pub fn choose<R: CubeRuntime>(like: &CubeTensor<R>, pass: Pass, d: usize) -> Self {
        Self::split_on(like.client.properties(), like.dtype, pass, d)
    }

    /// [`Flash::choose`] for a device with `props` and operands of `dtype`.
    pub fn split_on(
        props: &cubecl::ir::DeviceProperties,
        dtype: DType,
        pass: Pass,
        d: usize,
    ) -> Self {
        let es = dtype.size();
        let cmma = cmma_wanted()
            && matches!(dtype, DType::F16 | DType::BF16)
            && d.is_multiple_of(16)
            && props.hardware.plane_size_min == 32
            && props.hardware.plane_size_max == 32
            && props.features.matmul.cmma.contains(&MmaConfig {
                a_type: dtype.into(),
                b_type: dtype.into(),
                cd_type: DType::F32.into(),
                m: 16,
                n: 16,
                k: 16,
            });
        let limit = props.hardware.max_shared_memory_size.min(100 * 1024);
        // Without tensor cores planes own 8 rows: on lavapipe, 16 gave wrong gradients for f16,
        // head dim 64, past ≈ 900 tokens (queries ≥ 896 against keys < 160; 8 and 4 rows, head
        // dim 32, f32 and 768 tokens were right) — not understood; see the note of 2026-11-27.
        let (planes, rows, block) = split_override().unwrap_or((4, if cmma { 16 } else { 8 }, 64));
        let mut f = Flash {
            planes,
            rows: if cmma { 16 } else { rows },
            block,
            cmma,
            registers: false,
            loads: registers::Loads::default(),
        };
        while f.shared_bytes(pass, d, es) > limit {
            if f.block > 16 {
                f.block /= 2;
            } else if f.planes > 1 {
                f.planes /= 2;
            } else if !cmma && f.rows > 2 {
                f.rows /= 2;
            } else {
                break;
            }
        }
        if split_override().is_some() {
            eprintln!(
                "attention split {pass:?} d {d}: {f:?}, {} of {limit} bytes",
                f.shared_bytes(pass, d, es)
            );
        }
        assert!(
            f.shared_bytes(pass, d, es) <= props.hardware.max_shared_memory_size,
            "attention: head dim {d} needs {} bytes of shared memory per cube, the device has {}",
            f.shared_bytes(pass, d, es),
            props.hardware.max_shared_memory_size
        );
        f
    }

    /// The launch over `rows` owned rows per (batch, head).
    pub fn launch_dims(&self, rows: usize, p: &Problem) -> (CubeCount, CubeDim) {
        let bh = p.batch * p.heads;
        assert!(
            bh <= 65_535,
            "attention: batch × heads {bh} exceeds one launch's 65,535 cubes along y"
        );
        (
            CubeCount::Static(rows.div_ceil(self.owned()).max(1) as u32, bh as u32, 1),
            CubeDim::new_1d((self.planes * LANES) as u32),
        )
    }
}

/// `WILDFIRE_ATTENTION_SPLIT=planes,rows,block` starts the split's search there instead of
/// `4,16,64` (`4,8,64` without tensor cores, whose rows it may set; with them rows stay 16), for
/// tuning on a new device; the shared-memory limit still applies.
fn split_override() -> Option<(usize, usize, usize)> {
    static SPLIT: std::sync::OnceLock<Option<(usize, usize, usize)>> = std::sync::OnceLock::new();
    *SPLIT.get_or_init(|| {
        let v = std::env::var("WILDFIRE_ATTENTION_SPLIT").ok()?;
        let n: Vec<usize> = v.split(',').filter_map(|x| x.trim().parse().ok()).collect();
        let ok = n.len() == 3
            && n[0].is_power_of_two()
            && n[0] <= 8
            && [2, 4, 8, 16].contains(&n[1])
            && n[2].is_power_of_two()
            && (16..=128).contains(&n[2]);
        if !ok {
            eprintln!("WILDFIRE_ATTENTION_SPLIT={v:?} is not planes,rows,block; ignored");
        }
        ok.then(|| (n[0], n[1], n[2]))
    })
}

/// `WILDFIRE_ATTENTION_CMMA=0` turns the tensor-core fragments off (the bench's comparison, and
/// a way around a device whose fragments misbehave).
fn cmma_wanted() -> bool {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WANTED.get_or_init(|| std::env::var("WILDFIRE_ATTENTION_CMMA").map_or(true, |v| v != "0"))
}

/// A barrier over the units that share a plane's tiles: the plane with tensor cores, the cube
/// without (a Wgpu plane may be narrower than 32 units). Called in uniform control flow.
#[cube]
fn sync_tiles(#[comptime] cmma: bool) {
    if comptime!(cmma) {
        sync_plane();
    } else {
        sync_cube();
    }
}

/// This unit's vectors of `rows` rows of one head (`d` elements each, from row `start`): vector
/// `e` of the tile is unit `e % units`'s read `e / units`. Every read is unconditional — a row
/// from `end` reads row `end − 1` instead (in bounds), which [`kept`] then replaces by zeros —
/// and the callers put a cube barrier between the reads and their first use: ptxas otherwise
/// issues each read right before its use, one memory latency per vector (a zero-initialised
/// value overwritten under a row guard is such a use; Nsight Compute on an H200 put 62% of the
/// register forward's stalls on them), where this way all of a tile's reads are in flight at once.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn fetch_rows<E: Float, N: Size>(
    src: &Tensor<Vector<E, N>>,
    l: &Sequence<u32>,
    b: usize,
    h: usize,
    start: usize,
    end: usize,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] units: usize,
) -> Sequence<Vector<E, N>> {
    let n = src.vector_size();
    let per_row = comptime!(d / n);
    let total = comptime!(rows * d / n);
    let base = head_base(l, b, h);
    let token = *l.index(3usize) as usize;
    let last = usize::max(end, 1) - 1;
    let unit = UNIT_POS as usize;
    let mut got = Sequence::<Vector<E, N>>::new();
    if comptime!(units.is_multiple_of(per_row)) {
        // A unit reads one column of every `units / per_row`-th row: its row and column once,
        // then a clamp and a multiply-add per read (a head's offset and token stride are whole
        // vectors: `vector_width` checks it). The general form below spent about a dozen
        // instructions per read on divisions and products (SASS of the sm_90 forward).
        let step = comptime!(units / per_row);
        let row0 = start + unit / per_row;
        let at = base / n + unit % per_row;
        let stride = token / n;
        #[unroll]
        for s in 0..comptime!(total.div_ceil(units)) {
            let r = usize::min(row0 + s * step, last);
            got.push(src[at + r * stride]);
        }
    } else {
        #[unroll]
        for s in 0..comptime!(total.div_ceil(units)) {
            let e = unit + s * units;
            let r = usize::min(start + e / per_row, last);
            got.push(src[(base + r * token) / n + e % per_row]);
        }
    }
    got
}

/// Read `s` of [`fetch_rows`] (tile vector `e`), or zeros where its row is past `end`.
#[cube]
pub(super) fn kept<E: Float, N: Size>(
    got: &Sequence<Vector<E, N>>,
    #[comptime] s: usize,
    e: usize,
    start: usize,
    end: usize,
    #[comptime] per_row: usize,
) -> Vector<E, N> {
    let mut x = *got.index(s);
    if start + e / per_row >= end {
        x = Vector::new(E::new(0.0));
    }
    x
}

/// Stores [`fetch_rows`]' reads into `dst` at row pitch `ld` (elements), zeros from row `end`
/// (after a cube barrier behind the reads: [`fetch_rows`] says why).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn store_head<E: Float, N: Size>(
    got: &Sequence<Vector<E, N>>,
    start: usize,
    end: usize,
    dst: &mut SharedMemory<E>,
    #[comptime] n: usize,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] ld: usize,
    #[comptime] units: usize,
) {
    let per_row = comptime!(d / n);
    let total = comptime!(rows * d / n);
    let unit = UNIT_POS as usize;
    #[unroll]
    for s in 0..comptime!(total.div_ceil(units)) {
        let e = unit + s * units;
        if e < total {
            let at = (e / per_row) * ld + (e % per_row) * n;
            let x = kept::<E, N>(got, s, e, start, end, per_row);
            #[unroll]
            for j in 0..n {
                dst[at + j] = x[j];
            }
        }
    }
}

/// Rows `start..start + rows` of one head of two operands with the same rows (K and V, or Q and
/// dO; zeros from row `end`) into `xs` and `ys` at row pitch `ld`. Each unit reads vectors of
/// `N` elements (4 bytes: `bf16×2`, `f16×2`, one f32: a warp's read is 128 contiguous bytes per
/// row and its element stores hit 32 distinct banks), both tiles' reads in flight together
/// before one cube barrier and the stores ([`fetch_rows`]). Called in uniform control flow.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_pair<E: Float, N: Size>(
    x: &Tensor<Vector<E, N>>,
    x_l: &Sequence<u32>,
    y: &Tensor<Vector<E, N>>,
    y_l: &Sequence<u32>,
    b: usize,
    h: usize,
    start: usize,
    end: usize,
    xs: &mut SharedMemory<E>,
    ys: &mut SharedMemory<E>,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] ld: usize,
    #[comptime] units: usize,
) {
    let n = x.vector_size();
    let gx = fetch_rows::<E, N>(x, x_l, b, h, start, end, rows, d, units);
    let gy = fetch_rows::<E, N>(y, y_l, b, h, start, end, rows, d, units);
    sync_cube();
    store_head::<E, N>(&gx, start, end, xs, n, rows, d, ld, units);
    store_head::<E, N>(&gy, start, end, ys, n, rows, d, ld, units);
}

/// This unit's plane, lane, row in the plane (`lane / per_row`) and part of the row.
#[cube]
fn lane_layout(#[comptime] per_row: usize) -> (usize, usize, usize, usize) {
    let unit = UNIT_POS as usize;
    let lane = unit % LANES;
    (unit / LANES, lane, lane / per_row, lane % per_row)
}

/// A new f32 accumulator fragment.
#[cube]
fn acc_fragment() -> cmma::Matrix<f32> {
    unsafe {
        cmma::Matrix::<f32>::uninitialized(
            cmma::MatrixIdent::Accumulator,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::Undefined,
        )
    }
}

/// `n / 16` zeroed accumulator fragments (none without tensor cores).
#[cube]
fn acc_fragments(#[comptime] n: usize, #[comptime] cmma: bool) -> Sequence<cmma::Matrix<f32>> {
    let mut accs = Sequence::<cmma::Matrix<f32>>::new();
    if comptime!(cmma) {
        #[unroll]
        for _ in 0..comptime!(n / 16) {
            let f = acc_fragment();
            cmma::fill(&f, 0.0f32);
            accs.push(f);
        }
    }
    accs
}

/// A 16 × 16 `A` fragment loaded from `a` at `off` (row-major, stride `ld`).
#[cube]
fn a_fragment<E: Float>(a: &SharedMemory<E>, off: usize, #[comptime] ld: usize) -> cmma::Matrix<E> {
    let f = unsafe {
        cmma::Matrix::<E>::uninitialized(
            cmma::MatrixIdent::A,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::RowMajor,
        )
    };
    cmma::load(&f, &a.slice(off, a.len()), ld as u32);
    f
}

/// A 16 × 16 `B` fragment loaded from `b` at `off` with stride `ld`: row-major, or (`col`) stored
/// as its transpose.
#[cube]
fn b_fragment<E: Float>(
    b: &SharedMemory<E>,
    off: usize,
    #[comptime] ld: usize,
    #[comptime] col: bool,
) -> cmma::Matrix<E> {
    let layout = comptime!(if col {
        cmma::MatrixLayout::ColMajor
    } else {
        cmma::MatrixLayout::RowMajor
    });
    let f = unsafe {
        cmma::Matrix::<E>::uninitialized(cmma::MatrixIdent::B, 16usize, 16usize, 16usize, layout)
    };
    cmma::load(&f, &b.slice(off, b.len()), ld as u32);
    f
}

/// `c = a · bᵀ` for one plane: `a` its `rows × k` rows (from `a_off`, stride `lda`), `b` stored
/// `n × k` (from `b_off`, stride `ldb`), `c` f32 `rows × n` at `c_off` with stride `ldc`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn plane_scores<E: Float>(
    a: &SharedMemory<E>,
    a_off: usize,
    b: &SharedMemory<E>,
    c: &mut SharedMemory<f32>,
    c_off: usize,
    #[comptime] rows: usize,
    #[comptime] n: usize,
    #[comptime] k: usize,
    #[comptime] lda: usize,
    #[comptime] ldb: usize,
    #[comptime] ldc: usize,
    #[comptime] cmma: bool,
) {
    if comptime!(cmma) {
        let accs = acc_fragments(n, true);
        #[unroll]
        for kk in 0..comptime!(k / 16) {
            let fa = a_fragment::<E>(a, a_off + kk * 16, lda);
            #[unroll]
            for t in 0..comptime!(n / 16) {
                let fb = b_fragment::<E>(b, t * 16 * ldb + kk * 16, ldb, true);
                cmma::execute::<E, E, f32, f32>(&fa, &fb, accs.index(t), accs.index(t));
            }
        }
        #[unroll]
        for t in 0..comptime!(n / 16) {
            cmma::store(
                &mut c.slice_mut(c_off + t * 16, c.len()),
                accs.index(t),
                ldc as u32,
                cmma::MatrixLayout::RowMajor,
            );
        }
    } else {
        let mut e = (UNIT_POS as usize) % LANES;
        while e < rows * n {
            let i = e / n;
            let j = e % n;
            let mut s = 0.0f32;
            for kk in 0..k {
                s += f32::cast_from(a[a_off + i * lda + kk]) * f32::cast_from(b[j * ldb + kk]);
            }
            c[c_off + i * ldc + j] = s;
            e += LANES;
        }
    }
}

/// `acc += a · b` for one plane: `a` its `rows × k` tile (from `a_off`, stride `lda`), `b`
/// `k × n` row-major (stride `ldb`); the accumulator is `accs` (`n / 16` fragments) with
/// tensor cores, else the f32 tile at `plain_off` (stride `n`) of `plain`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn plane_accumulate<E: Float>(
    a: &SharedMemory<E>,
    a_off: usize,
    b: &SharedMemory<E>,
    accs: &Sequence<cmma::Matrix<f32>>,
    plain: &mut SharedMemory<f32>,
    plain_off: usize,
    #[comptime] rows: usize,
    #[comptime] n: usize,
    #[comptime] k: usize,
    #[comptime] lda: usize,
    #[comptime] ldb: usize,
    #[comptime] cmma: bool,
) {
    if comptime!(cmma) {
        #[unroll]
        for kk in 0..comptime!(k / 16) {
            let fa = a_fragment::<E>(a, a_off + kk * 16, lda);
            #[unroll]
            for t in 0..comptime!(n / 16) {
                let fb = b_fragment::<E>(b, kk * 16 * ldb + t * 16, ldb, false);
                cmma::execute::<E, E, f32, f32>(&fa, &fb, accs.index(t), accs.index(t));
            }
        }
    } else {
        let mut e = (UNIT_POS as usize) % LANES;
        while e < rows * n {
            let i = e / n;
            let j = e % n;
            let mut s = plain[plain_off + i * n + j];
            for kk in 0..k {
                s += f32::cast_from(a[a_off + i * lda + kk]) * f32::cast_from(b[kk * ldb + j]);
            }
            plain[plain_off + i * n + j] = s;
            e += LANES;
        }
    }
}

/// A plane's accumulator (`rows × n`) into `dst` at `off` with stride `ld` (f32): the fragments
/// stored, or the plain tile copied. The caller syncs the plane's tiles after.
#[cube]
#[allow(clippy::too_many_arguments)]
fn plane_spill(
    accs: &Sequence<cmma::Matrix<f32>>,
    plain: &SharedMemory<f32>,
    plain_off: usize,
    dst: &mut SharedMemory<f32>,
    off: usize,
    #[comptime] rows: usize,
    #[comptime] n: usize,
    #[comptime] ld: usize,
    #[comptime] cmma: bool,
) {
    if comptime!(cmma) {
        #[unroll]
        for t in 0..comptime!(n / 16) {
            cmma::store(
                &mut dst.slice_mut(off + t * 16, dst.len()),
                accs.index(t),
                ld as u32,
                cmma::MatrixLayout::RowMajor,
            );
        }
    } else {
        let mut e = (UNIT_POS as usize) % LANES;
        while e < rows * n {
            dst[off + (e / n) * ld + e % n] = plain[plain_off + e];
            e += LANES;
        }
    }
}

/// Zeroes a plane's plain accumulator tile (`rows × n` at `off`; nothing with tensor cores,
/// whose fragments start zeroed).
#[cube]
fn plane_zero(
    plain: &mut SharedMemory<f32>,
    off: usize,
    #[comptime] rows: usize,
    #[comptime] n: usize,
    #[comptime] cmma: bool,
) {
    if comptime!(!cmma) {
        let mut e = (UNIT_POS as usize) % LANES;
        while e < rows * n {
            plain[off + e] = 0.0;
            e += LANES;
        }
    }
}

/// This unit's share (columns `part`, `part + per_row`, …) of the `d` values of a row starting at
/// `start` of `buf`, multiplied by `corr`.
#[cube]
fn scale_row(
    buf: &mut SharedMemory<f32>,
    start: usize,
    corr: f32,
    part: usize,
    #[comptime] per_row: usize,
    #[comptime] d: usize,
) {
    let mut c = part;
    while c < d {
        buf[start + c] *= corr;
        c += per_row;
    }
}

/// The combination over a row's `per_row` units of their partial `x` (`max` or sum): through
/// the plane's slots of `red`. Every unit calls it in uniform control flow.
#[cube]
fn row_combine(
    red: &mut SharedMemory<f32>,
    x: f32,
    #[comptime] per_row: usize,
    #[comptime] max: bool,
    #[comptime] cmma: bool,
) -> f32 {
    let unit = UNIT_POS as usize;
    let first = unit - unit % per_row;
    red[unit] = x;
    sync_tiles(cmma);
    let mut y = red[first];
    #[unroll]
    for t in 1..per_row {
        if comptime!(max) {
            y = f32::max(y, red[first + t]);
        } else {
            y += red[first + t];
        }
    }
    y
}

/// Launches flash kernel `$kernel` over `$count` × `$dim` with its tensor and layout arguments
/// `[$args]` followed by the scalars and comptime split every flash kernel takes (from problem
/// `$p` and split `$f`; `$q` gives the client and dtype).
macro_rules! launch_flash {
    ($kernel:ident, $q:ident, $p:ident, $f:ident, $count:ident, $dim:ident, $n:expr, [$($arg:expr),* $(,)?]) => {
        if checked_launches() {
            $kernel::launch::<R>(
                &$q.client, $count, $dim, $n, $($arg,)* $p.heads as u32, $p.kv_group as u32,
                $p.seq_q as u32, $p.seq_k as u32, $p.q_offset as i32, $p.scale, $f.planes,
                $f.rows, $f.block, $p.head_dim, $p.causal, $f.cmma, $f.registers, $f.loads, $q.dtype.into(),
            )
        } else {
            // SAFETY: every global read and write of the flash kernels is guarded by its row's
            // bounds (`start + r < end` in the loads, `ii < seq_q` / `jj < seq_k` in the
            // stores, the statistics likewise), and every shared-memory index stays inside the
            // comptime sizes `Flash::shared_bytes` mirrors; the lavapipe tests and the GPU
            // bench's checks (`WILDFIRE_KERNELS_CHECKED=1` for CubeCL's bounds checks) run them.
            unsafe {
                $kernel::launch_unchecked::<R>(
                    &$q.client, $count, $dim, $n, $($arg,)* $p.heads as u32, $p.kv_group as u32,
                    $p.seq_q as u32, $p.seq_k as u32, $p.q_offset as i32, $p.scale, $f.planes,
                    $f.rows, $f.block, $p.head_dim, $p.causal, $f.cmma, $f.registers, $f.loads, $q.dtype.into(),
                )
            }
        }
    };
}

/// The vector width of the operands the kernels read whole head rows of (Q, K, V, dO): 4 bytes
/// per read (2 elements at 16 bits) where every operand's offsets and strides are multiples of
/// it, its buffer starts aligned to it and the device reads that width; else 1.
pub(super) fn vector_width<R: CubeRuntime>(
    operands: &[(&CubeTensor<R>, Heads)],
    d: usize,
) -> usize {
    let (first, _) = operands[0];
    let es = first.dtype.size();
    let n = (4 / es).max(1);
    let fits = |(t, l): &(&CubeTensor<R>, Heads)| {
        let start = t.handle.offset_start.unwrap_or(0) as usize;
        [l.offset, l.batch, l.head, l.token]
            .iter()
            .all(|x| x.is_multiple_of(n))
            && start.is_multiple_of(n * es)
    };
    let ok = n > 1
        && d.is_multiple_of(n)
        && operands.iter().all(fits)
        && first.client.io_optimized_vector_sizes(es).any(|v| v == n);
    if ok { n } else { 1 }
}

/// Whether the flash kernels launch with CubeCL's bounds checks (`WILDFIRE_KERNELS_CHECKED=1`):
/// every tensor and shared-memory index then becomes a compare, a clamp and a select, in the
/// kernels' innermost loops. Off by default: their indices are in bounds by construction.
fn checked_launches() -> bool {
    static CHECKED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CHECKED.get_or_init(|| std::env::var("WILDFIRE_KERNELS_CHECKED").is_ok_and(|v| v == "1"))
}

mod backward;
#[cfg(feature = "cuda")]
pub mod codegen;
mod forward;
mod registers;

pub use registers::{with_emulated_mma, with_fragment_kernels, with_kv_reread, with_native_mma};

pub(super) use backward::backward;
pub(super) use forward::forward;
