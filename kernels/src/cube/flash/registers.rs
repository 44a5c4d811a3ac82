//! The flash kernels' register-fragment variant, FlashAttention-2 proper: in the forward each
//! plane keeps its 16 queries' Q operand, scores, probabilities and output in registers for the
//! whole loop over key blocks (the backward passes likewise their dQ, or dK and dV),
//! multiplied by the PTX `mma.m16n8k16` instruction (CubeCL's manual MMA) with f32
//! accumulation. The softmax runs on the score registers themselves — a row's four lanes
//! combine their maxima and sums by two shuffles — and the probabilities become the next
//! product's `A` operand without leaving registers (an `m16n8` accumulator pair is exactly an
//! `m16k16` operand's register). Only K and V go through shared memory, once per cube and block.
//! The output is rescaled on every block (a multiply of its registers), and the exponentials
//! are the fast ones (`__expf`).
//!
//! Without the instruction (Wgpu; CUDA before sm_80) the same kernels run with each product
//! phase emulated: the lanes write the operand registers they loaded (by the layouts below) to
//! shared memory, and each lane computes its accumulator elements from there; the shuffles go
//! through shared memory too. So the lavapipe tests check the register layouts, the loads, the
//! masking and the online softmax the GPU runs; only the multiply instruction differs. A phase
//! is a whole key (query) block when emulated, 16 keys natively (the backward's registers), and
//! the emulation costs two barriers per phase (lavapipe compiles each barrier into a coroutine
//! split: one per `mma` took minutes to compile).
//!
//! Register layouts of `m16n8k16` (PTX ISA, "Matrix fragments for mma.m16n8k16"), with
//! `g = lane / 4` and `t = lane % 4`, each register a pair of 16-bit elements (f32 pairs for C):
//! - A (16 × 16): register `r` holds row `g + 8·(r & 1)`, columns `2t + 8·(r >> 1) + {0, 1}`;
//! - B (16 × 8): register `r` holds rows (k) `2t + 8·r + {0, 1}`, column `g`;
//! - C (16 × 8): pair `v` holds row `g + 8·v`, columns `2t + {0, 1}`.

use super::*;
use cubecl::cmma::{MatrixIdent, MmaDefinition};

/// Query rows per plane (one fragment high).
const ROWS: usize = 16;
/// Planes per cube.
const PLANES: usize = 4;
/// Keys per loop step.
const BLOCK: usize = 64;

/// Keys (queries) per product phase with the `mma` instruction.
pub(super) const CHUNK: usize = 16;

/// This unit's lane's group `g` and thread-in-group `t` (the fragment layouts' coordinates).
#[cube]
pub(super) fn lane_gt() -> (usize, usize) {
    let lane = UNIT_POS as usize % LANES;
    (lane / 4, lane % 4)
}

/// An A operand's registers into the plane's A tile of the emulation memory (after the B tile's
/// `b_len` elements; 16 rows, `lda` a row) at column `16·kk`.
#[cube]
pub(super) fn put_a<E: Float, N: Size>(
    sa: &mut SharedMemory<E>,
    a: &Array<Vector<E, N>>,
    #[comptime] kk: usize,
    #[comptime] lda: usize,
    #[comptime] b_len: usize,
) {
    let (g, t) = lane_gt();
    let base = b_len + (UNIT_POS as usize / LANES) * 16 * lda;
    #[unroll]
    for r in 0..4usize {
        let x = a[r];
        #[unroll]
        for e in 0..2usize {
            sa[base + (g + 8 * (r % 2)) * lda + kk * 16 + 2 * t + 8 * (r / 2) + e] = x[e];
        }
    }
}

/// A B operand's registers into the B tile at the start of the emulation memory (`ldb` a row),
/// element `(k, n)` at row `k0 + k`, column `n0 + n`.
#[cube]
pub(super) fn put_b<E: Float, N: Size>(
    sb: &mut SharedMemory<E>,
    b: &Array<Vector<E, N>>,
    k0: usize,
    n0: usize,
    #[comptime] ldb: usize,
) {
    let (g, t) = lane_gt();
    #[unroll]
    for r in 0..2usize {
        let x = b[r];
        #[unroll]
        for e in 0..2usize {
            sb[(k0 + 2 * t + 8 * r + e) * ldb + n0 + g] = x[e];
        }
    }
}

/// `c += A · B[.., n0..n0 + 8]` for this lane's accumulator elements, from the emulation tiles
/// (`k` the inner size; B first, `k · ldb` elements, then the planes' A tiles).
#[cube]
pub(super) fn emulated_product<E: Float, N: Size>(
    emu: &SharedMemory<E>,
    c: &mut Array<Vector<f32, N>>,
    n0: usize,
    #[comptime] k: usize,
    #[comptime] lda: usize,
    #[comptime] ldb: usize,
) {
    let (g, t) = lane_gt();
    let base = comptime!(k * ldb) + (UNIT_POS as usize / LANES) * 16 * lda;
    #[unroll]
    for v in 0..2usize {
        let mut acc = c[v];
        #[unroll]
        for e in 0..2usize {
            let mut x = acc[e];
            for kk in 0..k {
                x += f32::cast_from(emu[base + (g + 8 * v) * lda + kk])
                    * f32::cast_from(emu[kk * ldb + n0 + 2 * t + e]);
            }
            acc[e] = x;
        }
        c[v] = acc;
    }
}

/// `c += a · b` on the tensor cores (one `mma.m16n8k16`).
#[cube]
pub(super) fn mma<E: Float, N: Size>(
    a: &Array<Vector<E, N>>,
    b: &Array<Vector<E, N>>,
    c: &mut Array<Vector<f32, N>>,
) {
    let def = MmaDefinition::<E, E, f32>::new(16usize, 8usize, 16usize);
    def.execute_inplace(a, b, c);
}

/// How the register kernels load their operands (comptime): the B operands by `ldmatrix`
/// (`ldsm`, CUDA) and the next key block's reads issued during the current block's products
/// (`prefetch`, [`kv_first`]: the forward and the dQ pass); whether the dK/dV pass reads its
/// keys' and values' A operands from shared memory at each product instead of holding them in
/// registers across the loop (`kv_reread`, [`kv_products`]: FlashAttention-2's way at large
/// head dims); and the cubes per multiprocessor `ptxas` is asked to fit their registers into
/// (`cubes_per_sm`, [`occupancy_hint`]; 0: no ask).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Loads {
    pub ldsm: bool,
    pub prefetch: bool,
    pub kv_reread: bool,
    pub cubes_per_sm: u32,
}

/// The dK/dV pass's two score-like products for the chunk at `n0`: `Sᵀ = K·Qᵀ` and
/// `dPᵀ = V·dOᵀ` for the plane's keys (rows `row0..row0 + 16` of `ks` and `vs`). With
/// `reread` the A operands are read from the tiles here, each product's right before it (32
/// registers live at a time at head dim 128 instead of 64 for the whole loop); else `kf` and
/// `vf` are the ones held in registers.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn kv_products<E: Float, N: Size>(
    kf: &Sequence<Array<Vector<E, N>>>,
    vf: &Sequence<Array<Vector<E, N>>>,
    ks: &SharedMemory<Vector<E, N>>,
    vs: &SharedMemory<Vector<E, N>>,
    qs: &SharedMemory<Vector<E, N>>,
    dos: &SharedMemory<Vector<E, N>>,
    row0: usize,
    n0: usize,
    emu: &mut SharedMemory<E>,
    #[comptime] ph: Phase,
    #[comptime] reread: bool,
) -> (Accs<N>, Accs<N>) {
    if comptime!(reread) {
        let kr = a_operands::<E, N>(ks, row0, ph.d, ph.ldv);
        let pt = product_t::<E, N>(&kr, qs, n0, emu, ph);
        let vr = a_operands::<E, N>(vs, row0, ph.d, ph.ldv);
        let dst = product_t::<E, N>(&vr, dos, n0, emu, ph);
        (pt, dst)
    } else {
        let pt = product_t::<E, N>(kf, qs, n0, emu, ph);
        let dst = product_t::<E, N>(vf, dos, n0, emu, ph);
        (pt, dst)
    }
}

/// Asks the CUDA compiler to fit `cubes` cubes of this kernel per multiprocessor (none for 0):
/// a comment that the workspace's `cubecl-cuda` turns into `__launch_bounds__`' second argument
/// (`cubecl::cuda::launch_hints`, `vendor/README.md`). Other targets ignore the comment. The
/// prefetch keeps the next block's K/V reads in registers across the products: 174 registers
/// in the forward, where three cubes of 128 units need at most 168 (65,536 / 384, in ptxas's
/// steps of 8).
#[cube]
#[allow(unused_variables)] // read only by the expansion (`intrinsic!`)
pub(super) fn occupancy_hint(#[comptime] cubes: u32) {
    intrinsic!(|scope| {
        if cubes > 0 {
            cubecl::frontend::cube_comment::expand(
                scope,
                &std::format!("{OCCUPANCY_MARKER}{cubes}"),
            );
        }
    })
}

/// The comment [`occupancy_hint`] writes (the vendored `cubecl-cuda`'s
/// `launch_hints::MARKER`, spelled here too because Wgpu builds do not have that crate).
pub(super) const OCCUPANCY_MARKER: &str = "wildfire:cubes-per-sm=";

/// A product phase's comptime shape: `chunk` keys (queries) of head dim `d` from pair tiles of
/// `ldv` pairs a row; on the `mma` instruction (`native`, else emulated), its B operands by
/// `ldmatrix` (`ldsm`, CUDA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Phase {
    pub chunk: usize,
    pub d: usize,
    pub ldv: usize,
    pub native: bool,
    pub ldsm: bool,
}

impl Phase {
    pub fn new(chunk: usize, d: usize, ldv: usize, native: bool, ldsm: bool) -> Self {
        Self {
            chunk,
            d,
            ldv,
            native,
            ldsm,
        }
    }
}

/// The score-like product of a phase: `a` (the plane's 16 rows, `d / 16` A operands) times the
/// rows `n0..n0 + chunk` of tile `sm` transposed, as `chunk / 8` accumulators (Q·Kᵀ).
#[cube]
pub(super) fn product_t<E: Float, N: Size>(
    a: &Sequence<Array<Vector<E, N>>>,
    sm: &SharedMemory<Vector<E, N>>,
    n0: usize,
    emu: &mut SharedMemory<E>,
    #[comptime] ph: Phase,
) -> Sequence<Array<Vector<f32, N>>> {
    let chunk = comptime!(ph.chunk);
    let d = comptime!(ph.d);
    let ldv = comptime!(ph.ldv);
    let native = comptime!(ph.native);
    let ldsm = comptime!(ph.ldsm);
    let mut out = Sequence::<Array<Vector<f32, N>>>::new();
    if comptime!(native && ldsm) {
        // One `ldmatrix.x4` gives the B operands of two consecutive `kk` (32 head columns).
        #[unroll]
        for n in 0..comptime!(chunk / 8) {
            let mut c = acc_zero::<N>();
            #[unroll]
            for k2 in 0..comptime!(d / 32) {
                let regs = ldsm_x4::<E, N>(sm, n0 + n * 8, k2 * 32, ldv, false);
                let (b0, b1) = split_x4::<E, N>(&regs);
                mma::<E, N>(a.index(2 * k2), &b0, &mut c);
                mma::<E, N>(a.index(2 * k2 + 1), &b1, &mut c);
            }
            if comptime!(!d.is_multiple_of(32)) {
                let kk = comptime!(d / 16 - 1);
                let bf = b_transposed::<E, N>(sm, n0 + n * 8, kk, ldv);
                mma::<E, N>(a.index(kk), &bf, &mut c);
            }
            out.push(c);
        }
    } else if comptime!(native) {
        #[unroll]
        for n in 0..comptime!(chunk / 8) {
            let mut c = acc_zero::<N>();
            #[unroll]
            for kk in 0..comptime!(d / 16) {
                let bf = b_transposed::<E, N>(sm, n0 + n * 8, kk, ldv);
                mma::<E, N>(a.index(kk), &bf, &mut c);
            }
            out.push(c);
        }
    } else {
        let lda = comptime!(d.max(chunk));
        #[unroll]
        for kk in 0..comptime!(d / 16) {
            put_a::<E, N>(emu, a.index(kk), kk, lda, comptime!(d * chunk));
        }
        if UNIT_POS < 32u32 {
            #[unroll]
            for n in 0..comptime!(chunk / 8) {
                #[unroll]
                for kk in 0..comptime!(d / 16) {
                    let bf = b_transposed::<E, N>(sm, n0 + n * 8, kk, ldv);
                    put_b::<E, N>(emu, &bf, kk * 16, n * 8, chunk);
                }
            }
        }
        sync_cube();
        #[unroll]
        for n in 0..comptime!(chunk / 8) {
            let mut c = acc_zero::<N>();
            emulated_product::<E, N>(emu, &mut c, n * 8, d, lda, chunk);
            out.push(c);
        }
        sync_cube();
    }
    out
}

/// The value-like product of a phase: `acc` (`d / 8` accumulators) `+= p · sm[k0..k0 + chunk]`,
/// `p` the plane's `chunk / 8` f32 accumulators (probabilities) as A operands in `E` (P·V).
#[cube]
pub(super) fn product_acc<E: Float, N: Size>(
    p: &Sequence<Array<Vector<f32, N>>>,
    sm: &SharedMemory<Vector<E, N>>,
    k0: usize,
    acc: &mut Sequence<Array<Vector<f32, N>>>,
    emu: &mut SharedMemory<E>,
    #[comptime] ph: Phase,
) {
    let chunk = comptime!(ph.chunk);
    let d = comptime!(ph.d);
    let ldv = comptime!(ph.ldv);
    let native = comptime!(ph.native);
    let ldsm = comptime!(ph.ldsm);
    if comptime!(native && ldsm) {
        // One `ldmatrix.x4.trans` gives the B operands of two consecutive `u` (16 head columns),
        // transposed on the way: no 16-bit selects and packs (`b_plain`).
        #[unroll]
        for kk in 0..comptime!(chunk / 16) {
            let a = a_from_acc::<E, N>(p.index(2 * kk), p.index(2 * kk + 1));
            #[unroll]
            for u2 in 0..comptime!(d / 16) {
                let regs = ldsm_x4::<E, N>(sm, k0 + kk * 16, u2 * 16, ldv, true);
                let (b0, b1) = split_x4::<E, N>(&regs);
                mma::<E, N>(&a, &b0, acc.index_mut(2 * u2));
                mma::<E, N>(&a, &b1, acc.index_mut(2 * u2 + 1));
            }
        }
    } else if comptime!(native) {
        #[unroll]
        for kk in 0..comptime!(chunk / 16) {
            let a = a_from_acc::<E, N>(p.index(2 * kk), p.index(2 * kk + 1));
            #[unroll]
            for u in 0..comptime!(d / 8) {
                let bf = b_plain::<E, N>(sm, k0 + kk * 16, u * 8, ldv);
                mma::<E, N>(&a, &bf, acc.index_mut(u));
            }
        }
    } else {
        let lda = comptime!(d.max(chunk));
        #[unroll]
        for kk in 0..comptime!(chunk / 16) {
            let a = a_from_acc::<E, N>(p.index(2 * kk), p.index(2 * kk + 1));
            put_a::<E, N>(emu, &a, kk, lda, comptime!(d * chunk));
        }
        if UNIT_POS < 32u32 {
            #[unroll]
            for kk in 0..comptime!(chunk / 16) {
                #[unroll]
                for u in 0..comptime!(d / 8) {
                    let bf = b_plain::<E, N>(sm, k0 + kk * 16, u * 8, ldv);
                    put_b::<E, N>(emu, &bf, kk * 16, u * 8, d);
                }
            }
        }
        sync_cube();
        #[unroll]
        for u in 0..comptime!(d / 8) {
            emulated_product::<E, N>(emu, acc.index_mut(u), u * 8, chunk, lda, d);
        }
        sync_cube();
    }
}

/// The combination (`max`, else sum) of `x0` and of `x1` over the four lanes of this unit's
/// group: two shuffles each (`native`), or through `red` (two slots per unit). Uniform control
/// flow.
#[cube]
pub(super) fn quad_combine(
    x0: f32,
    x1: f32,
    red: &mut SharedMemory<f32>,
    #[comptime] max: bool,
    #[comptime] native: bool,
) -> (f32, f32) {
    let mut y0 = x0;
    let mut y1 = x1;
    if comptime!(native) {
        #[unroll]
        for s in 0..2u32 {
            let o0 = plane_shuffle_xor(y0, 1u32 << s);
            let o1 = plane_shuffle_xor(y1, 1u32 << s);
            if comptime!(max) {
                y0 = f32::max(y0, o0);
                y1 = f32::max(y1, o1);
            } else {
                y0 += o0;
                y1 += o1;
            }
        }
    } else {
        let unit = UNIT_POS as usize;
        red[2 * unit] = x0;
        red[2 * unit + 1] = x1;
        sync_cube();
        let first = 2 * (unit - unit % 4);
        y0 = red[first];
        y1 = red[first + 1];
        #[unroll]
        for s in 1..4usize {
            if comptime!(max) {
                y0 = f32::max(y0, red[first + 2 * s]);
                y1 = f32::max(y1, red[first + 2 * s + 1]);
            } else {
                y0 += red[first + 2 * s];
                y1 += red[first + 2 * s + 1];
            }
        }
        sync_cube();
    }
    (y0, y1)
}

/// Stores [`fetch_rows`]' reads into `dst` as element pairs, `ldv` pairs a row, zeros from row
/// `end` (after a cube barrier behind the reads: [`fetch_rows`] says why).
#[cube]
#[allow(clippy::too_many_arguments)]
// The identical-looking stores: one under a comptime condition (no runtime test), one under the
// tail's row guard.
#[allow(clippy::if_same_then_else)]
pub(super) fn store_rows<E: Float, N: Size>(
    got: &Sequence<Vector<E, N>>,
    start: usize,
    end: usize,
    dst: &mut SharedMemory<Vector<E, N>>,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] ldv: usize,
    #[comptime] units: usize,
) {
    // This unit's pairs are the tile's pairs `unit`, `unit + units`, …: a row has `d / 2`.
    let per_row = comptime!(d / 2);
    let total = comptime!(rows * d / 2);
    let unit = UNIT_POS as usize;
    if comptime!(units.is_multiple_of(per_row)) {
        // One column of every `units / per_row`-th row (as `fetch_rows` read them); a tile
        // inside the sequence (every one but the last) stores without a per-pair row test, and
        // a whole number of pairs per unit without the tail's guard.
        let step = comptime!(units / per_row);
        let (row0, col) = (unit / per_row, unit % per_row);
        if start + rows <= end {
            #[unroll]
            for s in 0..comptime!(total.div_ceil(units)) {
                let row = row0 + s * step;
                if comptime!(total.is_multiple_of(units)) {
                    dst[row * ldv + col] = *got.index(s);
                } else if row < rows {
                    dst[row * ldv + col] = *got.index(s);
                }
            }
        } else {
            #[unroll]
            for s in 0..comptime!(total.div_ceil(units)) {
                let row = row0 + s * step;
                let mut x = *got.index(s);
                if start + row >= end {
                    x = Vector::new(E::new(0.0));
                }
                if comptime!(total.is_multiple_of(units)) {
                    dst[row * ldv + col] = x;
                } else if row < rows {
                    dst[row * ldv + col] = x;
                }
            }
        }
    } else {
        #[unroll]
        for s in 0..comptime!(total.div_ceil(units)) {
            let e = unit + s * units;
            if e < total {
                dst[(e / per_row) * ldv + e % per_row] =
                    kept::<E, N>(got, s, e, start, end, per_row);
            }
        }
    }
}

/// Rows `start..start + rows` of one head of two operands with the same rows (K and V, or Q and
/// dO; zeros from row `end`) into `xs` and `ys` as element pairs, `ldv` pairs a row: a plane's
/// reads are a row's contiguous bytes, both tiles' reads in flight together before one cube
/// barrier and the stores ([`fetch_rows`]). Called in uniform control flow.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn load_rows_pair<E: Float, N: Size>(
    x: &Tensor<Vector<E, N>>,
    x_l: &Sequence<u32>,
    xs: &mut SharedMemory<Vector<E, N>>,
    y: &Tensor<Vector<E, N>>,
    y_l: &Sequence<u32>,
    ys: &mut SharedMemory<Vector<E, N>>,
    b: usize,
    h: usize,
    start: usize,
    end: usize,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] ldv: usize,
    #[comptime] units: usize,
) {
    let gx = fetch_rows::<E, N>(x, x_l, b, h, start, end, rows, d, units);
    let gy = fetch_rows::<E, N>(y, y_l, b, h, start, end, rows, d, units);
    sync_cube();
    store_rows::<E, N>(&gx, start, end, xs, rows, d, ldv, units);
    store_rows::<E, N>(&gy, start, end, ys, rows, d, ldv, units);
}

/// A zeroed accumulator (two f32 pairs).
#[cube]
pub(super) fn acc_zero<N: Size>() -> Array<Vector<f32, N>> {
    let mut c = Array::<Vector<f32, N>>::new(2usize);
    c[0] = Vector::new(0.0f32);
    c[1] = Vector::new(0.0f32);
    c
}

/// The A operand of rows `row0..row0 + 16`, head columns `16·kk..16·kk + 16` of a pair tile
/// (`ldv` pairs a row).
#[cube]
pub(super) fn a_rows<E: Float, N: Size>(
    sm: &SharedMemory<Vector<E, N>>,
    row0: usize,
    #[comptime] kk: usize,
    #[comptime] ldv: usize,
) -> Array<Vector<E, N>> {
    let (g, t) = lane_gt();
    let mut a = Array::<Vector<E, N>>::new(4usize);
    #[unroll]
    for r in 0..4usize {
        a[r] = sm[(row0 + g + 8 * (r % 2)) * ldv + kk * 8 + t + 4 * (r / 2)];
    }
    a
}

/// The B operand `B(k, n) = tile[n0 + n][16·kk + k]` (a product with the tile's rows
/// transposed: Q·Kᵀ): each register one pair of a row.
#[cube]
pub(super) fn b_transposed<E: Float, N: Size>(
    sm: &SharedMemory<Vector<E, N>>,
    n0: usize,
    #[comptime] kk: usize,
    #[comptime] ldv: usize,
) -> Array<Vector<E, N>> {
    let (g, t) = lane_gt();
    let mut b = Array::<Vector<E, N>>::new(2usize);
    #[unroll]
    for r in 0..2usize {
        b[r] = sm[(n0 + g) * ldv + kk * 8 + t + 4 * r];
    }
    b
}

/// The B operand `B(k, n) = tile[k0 + k][n0 + n]` (P·V): each register two rows' elements of one
/// column.
#[cube]
pub(super) fn b_plain<E: Float, N: Size>(
    sm: &SharedMemory<Vector<E, N>>,
    k0: usize,
    n0: usize,
    #[comptime] ldv: usize,
) -> Array<Vector<E, N>> {
    let (g, t) = lane_gt();
    let col = n0 + g;
    let odd = col % 2 == 1;
    let mut b = Array::<Vector<E, N>>::new(2usize);
    #[unroll]
    for r in 0..2usize {
        let key = k0 + 2 * t + 8 * r;
        let x0 = sm[key * ldv + col / 2];
        let x1 = sm[(key + 1) * ldv + col / 2];
        let mut y = Vector::<E, N>::new(E::new(0.0));
        y[0] = select(odd, x0[1], x0[0]);
        y[1] = select(odd, x1[1], x1[0]);
        b[r] = y;
    }
    b
}

/// Two B operands by one `ldmatrix.x4` (CUDA only; the pair tile `sm`, `ldv` pairs a row,
/// 16-byte aligned). Matrix `m` comes from lanes `8m..8m + 8`, a 16-byte row each, and lane
/// `(g, t)` gets elements `(g, 2t), (g, 2t + 1)` of each matrix, or with `trans` elements
/// `(2t, g), (2t + 1, g)`:
/// - without `trans`, rows `row0..row0 + 8` and columns `col0 + 8m..`: the [`b_transposed`]
///   operands of columns `col0..col0 + 32` (two `kk`) — Q·Kᵀ;
/// - with `trans`, rows `row0 + 8·(m % 2)..` and columns `col0 + 8·(m / 2)..`: the [`b_plain`]
///   operands of rows `row0..row0 + 16`, columns `col0..col0 + 16` (two `u`) — P·V.
#[cube]
pub(super) fn ldsm_x4<E: Float, N: Size>(
    sm: &SharedMemory<Vector<E, N>>,
    row0: usize,
    col0: usize,
    #[comptime] ldv: usize,
    #[comptime] trans: bool,
) -> Array<Vector<E, N>> {
    let lane = UNIT_POS as usize % LANES;
    let m = lane / 8;
    let mut row = row0 + lane % 8;
    let mut col = col0 + 8 * m;
    if comptime!(trans) {
        row += 8 * (m % 2);
        col = col0 + 8 * (m / 2);
    }
    let start = row * ldv + col / 2;
    let def = MmaDefinition::<E, E, f32>::new(16usize, 8usize, 16usize);
    def.load_matrix::<Vector<E, N>, N>(&sm.slice(start, start + 4), MatrixIdent::B, 4usize, trans)
}

/// A fragment's registers.
type Regs<E, N> = Array<Vector<E, N>>;

/// A product's f32 accumulators (one per 8 columns).
type Accs<N> = Sequence<Array<Vector<f32, N>>>;

/// The two B operands (registers 0, 1 and 2, 3) of an [`ldsm_x4`] load.
#[cube]
pub(super) fn split_x4<E: Float, N: Size>(regs: &Regs<E, N>) -> (Regs<E, N>, Regs<E, N>) {
    let mut b0 = Array::<Vector<E, N>>::new(2usize);
    let mut b1 = Array::<Vector<E, N>>::new(2usize);
    b0[0] = regs[0];
    b0[1] = regs[1];
    b1[0] = regs[2];
    b1[1] = regs[3];
    (b0, b1)
}

/// Accumulators `lo` and `hi` (16 × 8 each, side by side) as one A operand (16 × 16) in `E`.
#[cube]
pub(super) fn a_from_acc<E: Float, N: Size>(
    lo: &Array<Vector<f32, N>>,
    hi: &Array<Vector<f32, N>>,
) -> Array<Vector<E, N>> {
    let mut a = Array::<Vector<E, N>>::new(4usize);
    a[0] = Vector::cast_from(lo[0]);
    a[1] = Vector::cast_from(lo[1]);
    a[2] = Vector::cast_from(hi[0]);
    a[3] = Vector::cast_from(hi[1]);
    a
}

/// This unit's plane and its lane's group `g` and thread-in-group `t`.
#[cube]
pub(super) fn plane_lanes() -> (usize, usize, usize) {
    let (g, t) = lane_gt();
    (UNIT_POS as usize / LANES, g, t)
}

/// Where a key block sits: the cube's batch and key/value head, the block's first key, the
/// sequence lengths, the cube's first query and the queries' position offset.
#[derive(CubeType, Clone, Copy)]
pub(super) struct KeyBlock {
    pub b: usize,
    pub hk: usize,
    pub k_start: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub q_start: usize,
    pub q_offset: i32,
}

/// The start of a step of a loop over key blocks: without `prefetch` the K and V rows of block
/// `at` (`bk` of them, zeros from `seq_k`) into `ks` and `vs`, then a cube barrier; with it
/// ([`kv_first`]) the block is in shared memory already and only the barrier runs, after the
/// next block's reads (which it keeps in flight). Whether the block needs its mask.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn kv_block<E: Float, N: Size>(
    k: &Tensor<Vector<E, N>>,
    k_l: &Sequence<u32>,
    v: &Tensor<Vector<E, N>>,
    v_l: &Sequence<u32>,
    at: &KeyBlock,
    ks: &mut SharedMemory<Vector<E, N>>,
    vs: &mut SharedMemory<Vector<E, N>>,
    #[comptime] bk: usize,
    #[comptime] d: usize,
    #[comptime] units: usize,
    #[comptime] causal: bool,
    #[comptime] prefetch: bool,
) -> bool {
    if comptime!(!prefetch) {
        let ldv = comptime!((d + 8) / 2);
        load_rows_pair::<E, N>(
            k, k_l, ks, v, v_l, vs, at.b, at.hk, at.k_start, at.seq_k, bk, d, ldv, units,
        );
    }
    sync_cube();
    block_masked(at, bk, causal)
}

/// Block 0 of a loop over key blocks: the cube's batch `b` and key/value head `hk`, the
/// sequence lengths, the cube's first query and the queries' position offset.
#[cube]
pub(super) fn first_block(
    b: usize,
    hk: usize,
    seq_q: usize,
    seq_k: usize,
    q_start: usize,
    q_offset: i32,
) -> KeyBlock {
    KeyBlock {
        b,
        hk,
        k_start: 0,
        seq_q,
        seq_k,
        q_start,
        q_offset,
    }
}

/// Key block `kb` (of `bk` keys) of the loop `first` starts.
#[cube]
pub(super) fn key_block(first: &KeyBlock, kb: usize, #[comptime] bk: usize) -> KeyBlock {
    KeyBlock {
        b: first.b,
        hk: first.hk,
        k_start: kb * bk,
        seq_q: first.seq_q,
        seq_k: first.seq_k,
        q_start: first.q_start,
        q_offset: first.q_offset,
    }
}

/// The next block's reads of one operand (`ahead` rows after block `at`: `bk` with
/// `prefetch`, none without; [`kv_first`]).
#[cube]
pub(super) fn kv_ahead<E: Float, N: Size>(
    x: &Tensor<Vector<E, N>>,
    x_l: &Sequence<u32>,
    at: &KeyBlock,
    #[comptime] bk: usize,
    #[comptime] ahead: usize,
    #[comptime] d: usize,
    #[comptime] units: usize,
) -> Sequence<Vector<E, N>> {
    fetch_rows::<E, N>(
        x,
        x_l,
        at.b,
        at.hk,
        at.k_start + bk,
        at.seq_k,
        ahead,
        d,
        units,
    )
}

/// Software pipelining of a loop over key blocks (`prefetch`): block 0 goes to shared memory
/// before the loop ([`kv_first`]); each step reads the next block's K and V into registers
/// ([`fetch_rows`] of `ahead` rows: `bk` with `prefetch`, none without) before its products,
/// holds them in flight behind a barrier ([`kv_block`]) and stores them after its products
/// ([`kv_next`]), so the reads' latency hides behind the block's tensor-core work, as
/// FlashAttention-2 overlaps the next tile's copy with the current one's compute. Without
/// `prefetch` each step loads its own block first and waits for it. Returns the loop's block
/// count (the cube's `own` queries' visible keys). Called in uniform control flow.
#[cube]
#[allow(clippy::too_many_arguments)]
// A comptime condition and a runtime one: CubeCL expands the first, so they stay two `if`s.
#[allow(clippy::collapsible_if)]
pub(super) fn kv_first<E: Float, N: Size>(
    k: &Tensor<Vector<E, N>>,
    k_l: &Sequence<u32>,
    v: &Tensor<Vector<E, N>>,
    v_l: &Sequence<u32>,
    first: &KeyBlock,
    ks: &mut SharedMemory<Vector<E, N>>,
    vs: &mut SharedMemory<Vector<E, N>>,
    #[comptime] own: usize,
    #[comptime] bk: usize,
    #[comptime] d: usize,
    #[comptime] units: usize,
    #[comptime] causal: bool,
    #[comptime] prefetch: bool,
) -> usize {
    let blocks = keys_end(first.q_start, first.seq_k, first.q_offset, own, causal).div_ceil(bk);
    if comptime!(prefetch) {
        if blocks > 0 {
            let ldv = comptime!((d + 8) / 2);
            load_rows_pair::<E, N>(
                k,
                k_l,
                ks,
                v,
                v_l,
                vs,
                first.b,
                first.hk,
                0,
                first.seq_k,
                bk,
                d,
                ldv,
                units,
            );
            sync_cube();
        }
    }
    blocks
}

/// The end of step `kb` of [`kv_first`]'s loop (after a barrier behind its products): with
/// `prefetch` the next block's reads `gk`, `gv` stored, unless `kb` was the last of `blocks`.
#[cube]
#[allow(clippy::too_many_arguments)]
// A comptime condition and a runtime one: CubeCL expands the first, so they stay two `if`s.
#[allow(clippy::collapsible_if)]
pub(super) fn kv_next<E: Float, N: Size>(
    gk: &Sequence<Vector<E, N>>,
    gv: &Sequence<Vector<E, N>>,
    at: &KeyBlock,
    kb: usize,
    blocks: usize,
    ks: &mut SharedMemory<Vector<E, N>>,
    vs: &mut SharedMemory<Vector<E, N>>,
    #[comptime] bk: usize,
    #[comptime] d: usize,
    #[comptime] units: usize,
    #[comptime] prefetch: bool,
) {
    if comptime!(prefetch) {
        if kb + 1 < blocks {
            let ldv = comptime!((d + 8) / 2);
            let next = at.k_start + bk;
            store_rows::<E, N>(gk, next, at.seq_k, ks, bk, d, ldv, units);
            store_rows::<E, N>(gv, next, at.seq_k, vs, bk, d, ldv, units);
            sync_cube();
        }
    }
}

/// Whether key block `at` needs its mask: it crosses the keys' end, or (causal) the diagonal of
/// the cube's queries.
#[cube]
pub(super) fn block_masked(at: &KeyBlock, #[comptime] bk: usize, #[comptime] causal: bool) -> bool {
    let mut masked = at.k_start + bk > at.seq_k;
    if comptime!(causal) {
        masked = masked
            || i32::cast_from(at.k_start + bk - 1) > i32::cast_from(at.q_start) + at.q_offset;
    }
    masked
}

/// Scores `x` (columns `j, j + 1` of row `i` of block `at`) scaled, and (with `mask`: a block
/// crossing the diagonal or the sequence's end) masked to `NEG_BIG` where `i` does not see them;
/// `mx` raised to their maximum.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn scale_mask<N: Size>(
    x: Vector<f32, N>,
    i: usize,
    j: usize,
    at: &KeyBlock,
    scale: f32,
    mx: &mut f32,
    #[comptime] mask: bool,
    #[comptime] causal: bool,
) -> Vector<f32, N> {
    let mut y = x;
    #[unroll]
    for e in 0..2usize {
        let mut s = y[e] * scale;
        if comptime!(mask) && !visible(i, j + e, at.seq_q, at.seq_k, at.q_offset, causal) {
            s = f32::new(NEG_BIG);
        }
        y[e] = s;
        *mx = f32::max(*mx, s);
    }
    y
}

/// `exp(x − m)` of a pair of scores, added to `l`; with `mask` (a masked block), 0 for a masked
/// score (a row that has seen no key yet has `m = NEG_BIG` too).
#[cube]
pub(super) fn exp_pair<N: Size>(
    x: Vector<f32, N>,
    m: f32,
    l: &mut f32,
    #[comptime] mask: bool,
) -> Vector<f32, N> {
    let mut y = x;
    #[unroll]
    for e in 0..2usize {
        let v = y[e];
        let mut p = f32::exp(v - m);
        if comptime!(mask) && v == f32::new(NEG_BIG) {
            p = 0.0;
        }
        y[e] = p;
        *l += p;
    }
    y
}

/// [`scale_mask`] over a block's score accumulators `s` (`bk / 8` of 16 × 8): rows `i0` and
/// `i0 + 8`, the lane's first column `j0`; the rows' maxima raised into `mx0` and `mx1`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn scale_mask_block<N: Size>(
    s: &mut Sequence<Array<Vector<f32, N>>>,
    i0: usize,
    j0: usize,
    at: &KeyBlock,
    scale: f32,
    mx0: &mut f32,
    mx1: &mut f32,
    #[comptime] bk: usize,
    #[comptime] mask: bool,
    #[comptime] causal: bool,
) {
    #[unroll]
    for n in 0..comptime!(bk / 8) {
        let c = s.index_mut(n);
        let j = j0 + n * 8;
        c[0] = scale_mask::<N>(c[0], i0, j, at, scale, mx0, mask, causal);
        c[1] = scale_mask::<N>(c[1], i0 + 8, j, at, scale, mx1, mask, causal);
    }
}

/// [`exp_pair`] over a block's score accumulators `s`, rows against maxima `m0` and `m1`,
/// summed into `l0` and `l1`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn exp_block<N: Size>(
    s: &mut Sequence<Array<Vector<f32, N>>>,
    m0: f32,
    m1: f32,
    l0: &mut f32,
    l1: &mut f32,
    #[comptime] bk: usize,
    #[comptime] mask: bool,
) {
    #[unroll]
    for n in 0..comptime!(bk / 8) {
        let c = s.index_mut(n);
        c[0] = exp_pair::<N>(c[0], m0, l0, mask);
        c[1] = exp_pair::<N>(c[1], m1, l1, mask);
    }
}

/// `count` zeroed accumulators.
#[cube]
pub(super) fn acc_zeros<N: Size>(#[comptime] count: usize) -> Sequence<Array<Vector<f32, N>>> {
    let mut accs = Sequence::<Array<Vector<f32, N>>>::new();
    #[unroll]
    for _ in 0..count {
        accs.push(acc_zero::<N>());
    }
    accs
}

/// The plane's A operands of its 16 rows from `row0` of a pair tile: `d / 16` of them.
#[cube]
pub(super) fn a_operands<E: Float, N: Size>(
    sm: &SharedMemory<Vector<E, N>>,
    row0: usize,
    #[comptime] d: usize,
    #[comptime] ldv: usize,
) -> Sequence<Array<Vector<E, N>>> {
    let mut a = Sequence::<Array<Vector<E, N>>>::new();
    #[unroll]
    for kk in 0..comptime!(d / 16) {
        a.push(a_rows::<E, N>(sm, row0, kk, ldv));
    }
    a
}

/// Row part `pv` (row `g + 8·pv`) of the plane's `d / 8` accumulators times `factor`, into `dst`
/// from `at` (the row's first element plus `2t`).
#[cube]
pub(super) fn store_pairs<E: Float, N: Size>(
    dst: &mut Tensor<E>,
    accs: &Sequence<Array<Vector<f32, N>>>,
    at: usize,
    factor: f32,
    #[comptime] pv: usize,
    #[comptime] d: usize,
) {
    #[unroll]
    for u in 0..comptime!(d / 8) {
        let x = accs.index(u)[pv];
        dst[at + u * 8] = E::cast_from(x[0] * factor);
        dst[at + u * 8 + 1] = E::cast_from(x[1] * factor);
    }
}

/// Shared memory of the emulation: one B tile (`d · chunk` elements of `E`) then the planes' A
/// tiles, and the quad reductions' slots (f32); one element each natively.
#[cube]
pub(super) fn emulation_memory<E: Float>(
    #[comptime] planes: usize,
    #[comptime] chunk: usize,
    #[comptime] d: usize,
    #[comptime] native: bool,
) -> (SharedMemory<E>, SharedMemory<f32>) {
    let len = comptime!(if native {
        1
    } else {
        d * chunk + planes * 16 * d.max(chunk)
    });
    let red = SharedMemory::<f32>::new(comptime!(if native { 1 } else { 2 * planes * LANES }));
    (SharedMemory::<E>::new(len), red)
}

/// The register kernels' split for `pass` on `q`'s device, where they run: f16/bf16 with head dim
/// a multiple of 16 and Q, K, V (and O, dO) readable in 16-bit pairs (`n == 2`); with the
/// `mma` instruction (`cmma` set) where the device has `mma.m16n8k16` for the dtype with f32
/// accumulation and planes of 32 (CUDA sm_80 and later) — the default since an H200 ran them
/// (checked against the f32 tiles; the three passes 14 ms of a GPT-2 124M step in CubeCL's
/// profiler; end to end level with the fragment kernels within run-to-run noise, README "On a
/// GPU") — unless `WILDFIRE_ATTENTION_MMA=0` or
/// [`with_fragment_kernels`] asks for the `cmma` fragment kernels; emulated when
/// `WILDFIRE_ATTENTION_MMA=emulate` or [`with_emulated_mma`] asks. Otherwise the fragment (or,
/// without tensor cores, plain) kernels run. Four planes of 16 rows and blocks of 64; while
/// the cube's shared memory exceeds the device's the block halves down to 16, then the planes.
pub(super) fn registers_split<R: CubeRuntime>(
    q: &CubeTensor<R>,
    pass: Pass,
    d: usize,
    n: usize,
) -> Option<Flash> {
    split_on(q.client.properties(), q.dtype, pass, d, n)
}

/// [`registers_split`] for a device with `props` and operands of `dtype`.
pub(super) fn split_on(
    props: &cubecl::ir::DeviceProperties,
    dtype: DType,
    pass: Pass,
    d: usize,
    n: usize,
) -> Option<Flash> {
    let mode = mma_mode();
    if mode == MmaMode::Off
        || !matches!(dtype, DType::F16 | DType::BF16)
        || n != 2
        || !d.is_multiple_of(16)
    {
        return None;
    }
    let planes32 = props.hardware.plane_size_min == 32 && props.hardware.plane_size_max == 32;
    let has_mma = planes32
        && props.features.matmul.mma.contains(&MmaConfig {
            a_type: dtype.into(),
            b_type: dtype.into(),
            cd_type: DType::F32.into(),
            m: 16,
            n: 8,
            k: 16,
        });
    let native = match mode {
        MmaMode::Emulate => false,
        MmaMode::Native if has_mma => true,
        _ => return None,
    };
    let ldsm = native && ldmatrix_on() && props.features.matmul.ldmatrix.contains(&dtype.into());
    let mut f = Flash {
        planes: PLANES,
        rows: ROWS,
        block: BLOCK,
        cmma: native,
        registers: true,
        loads: Loads {
            ldsm,
            prefetch: prefetch_on(),
            // only the dK/dV pass has the choice: the other passes' kernels stay one variant
            kv_reread: pass == Pass::BackwardKv && kv_reread(d),
            cubes_per_sm: if native { cubes_wanted(d) } else { 0 },
        },
    };
    let limit = props.hardware.max_shared_memory_size;
    let es = dtype.size();
    while register_bytes(&f, pass, d, es) > limit {
        if f.block > 16 {
            f.block /= 2;
        } else if f.planes > 1 {
            f.planes /= 2;
        } else {
            return None;
        }
    }
    Some(f)
}

/// Shared-memory bytes of the register kernel of `pass` (mirrors its allocations).
fn register_bytes(f: &Flash, pass: Pass, d: usize, es: usize) -> usize {
    let row = (d + 8) * es;
    let own = f.owned();
    let chunk = if f.cmma { CHUNK } else { f.block };
    let emulation = if f.cmma {
        0
    } else {
        es * (own * d.max(chunk) + d * chunk) + 8 * f.planes * LANES
    };
    emulation
        + match pass {
            Pass::Forward => (own + 2 * f.block) * row,
            Pass::BackwardQ => 2 * (own + f.block) * row,
            Pass::BackwardKv => 2 * (own + f.block) * row + 8 * f.block,
        }
}

/// Whether the register kernels may load their B operands by `ldmatrix` where the device has it
/// (the default; `WILDFIRE_ATTENTION_LDSM=0` keeps the 32-bit shared-memory reads, for a
/// comparison).
fn ldmatrix_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("WILDFIRE_ATTENTION_LDSM").map_or(true, |v| v != "0"))
}

/// Whether the register forward and dQ pass read each next key block ahead of the current
/// block's products (`prefetch`, [`kv_first`]; the default — `WILDFIRE_ATTENTION_PREFETCH=0`
/// loads each block at its step, for a comparison).
fn prefetch_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("WILDFIRE_ATTENTION_PREFETCH").map_or(true, |v| v != "0"))
}

/// The cubes per multiprocessor the register kernels ask `ptxas` for ([`occupancy_hint`]):
/// three at head dims up to 64 (GPT-2's: forward 164, dQ 168 and dK/dV 168 registers in ptxas,
/// only dK/dV spilling, 8 bytes — where they took 174/172/172 and two cubes without the ask;
/// `docs/architecture.md` §26), none above (at 128 every pass needs ~255: two cubes). `WILDFIRE_ATTENTION_CUBES_PER_SM=N` asks for N instead (0: no ask), for a comparison.
fn cubes_wanted(d: usize) -> u32 {
    static ASK: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    let ask = *ASK.get_or_init(|| {
        std::env::var("WILDFIRE_ATTENTION_CUBES_PER_SM")
            .ok()
            .and_then(|v| v.parse().ok())
    });
    ask.unwrap_or(if d <= 64 { 3 } else { 0 })
}

/// Whether the dK/dV pass rereads its K and V operands from shared memory ([`kv_products`]):
/// above head dim 96. At 128 its dK and dV accumulators are 128 registers a unit and the held
/// operands 64 more; ptxas spilled 658 bytes (283 `LDL` and 201 `STL` in each block's loop,
/// §26). `WILDFIRE_ATTENTION_KV_REREAD=0|1` decides instead, for a comparison
/// ([`with_kv_reread`] for one thread: the tests).
fn kv_reread(d: usize) -> bool {
    static ASK: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let ask = *ASK.get_or_init(|| {
        std::env::var("WILDFIRE_ATTENTION_KV_REREAD")
            .ok()
            .map(|v| v != "0")
    });
    REREAD_HERE.get().or(ask).unwrap_or(d > 96)
}

std::thread_local! {
    /// This thread's choice of [`kv_reread`] ([`with_kv_reread`]).
    static REREAD_HERE: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with the register dK/dV pass launched from this thread rereading its K and V
/// operands from shared memory (`on`) or holding them in registers, whatever the head dim
/// (`WILDFIRE_ATTENTION_KV_REREAD` for this thread only): how the tests cover both ways.
pub fn with_kv_reread<T>(on: bool, f: impl FnOnce() -> T) -> T {
    with_here(&REREAD_HERE, on, f)
}

/// Runs `f` with this thread's override `cell` set to `value`, restored afterwards (also when
/// `f` panics).
fn with_here<V: Copy + 'static, T>(
    cell: &'static std::thread::LocalKey<std::cell::Cell<Option<V>>>,
    value: V,
    f: impl FnOnce() -> T,
) -> T {
    struct Restore<V: Copy + 'static>(
        &'static std::thread::LocalKey<std::cell::Cell<Option<V>>>,
        Option<V>,
    );
    impl<V: Copy + 'static> Drop for Restore<V> {
        fn drop(&mut self) {
            self.0.set(self.1);
        }
    }
    let _restore = Restore(cell, cell.replace(Some(value)));
    f()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MmaMode {
    /// The fragment kernels (`WILDFIRE_ATTENTION_MMA=0`).
    Off,
    /// The register kernels on the `mma` instruction where the device has it (the default).
    Native,
    /// The register kernels with the `mma` emulated, on any device.
    Emulate,
}

std::thread_local! {
    /// This thread's override of `WILDFIRE_ATTENTION_MMA` ([`with_emulated_mma`]).
    static MODE_HERE: std::cell::Cell<Option<MmaMode>> = const { std::cell::Cell::new(None) };
}

fn mma_mode() -> MmaMode {
    static MODE: std::sync::OnceLock<MmaMode> = std::sync::OnceLock::new();
    MODE_HERE.get().unwrap_or_else(|| {
        *MODE.get_or_init(
            || match std::env::var("WILDFIRE_ATTENTION_MMA").as_deref() {
                Ok("1") | Err(_) => MmaMode::Native,
                Ok("emulate") => MmaMode::Emulate,
                Ok("0") => MmaMode::Off,
                Ok(other) => {
                    eprintln!("WILDFIRE_ATTENTION_MMA={other:?} is not 0, 1 or emulate; ignored");
                    MmaMode::Native
                }
            },
        )
    })
}

/// Runs `f` with the attention launched from this thread on the register kernels with their
/// `mma` emulated (`WILDFIRE_ATTENTION_MMA=emulate` for this thread only): how the lavapipe tests
/// check the algorithm the tensor cores run, on any backend; f16/bf16 operands with head dims
/// a multiple of 16 take it.
pub fn with_emulated_mma<T>(f: impl FnOnce() -> T) -> T {
    with_mode(MmaMode::Emulate, f)
}

/// Runs `f` with the attention launched from this thread on the `cmma` fragment kernels, not
/// the register kernels (`WILDFIRE_ATTENTION_MMA=0` for this thread only): how the GPU bench's
/// correctness half still checks them.
pub fn with_fragment_kernels<T>(f: impl FnOnce() -> T) -> T {
    with_mode(MmaMode::Off, f)
}

/// Runs `f` with the attention launched from this thread on the register kernels with the
/// `mma` instruction where the device has it (`WILDFIRE_ATTENTION_MMA=1` for this thread only).
pub fn with_native_mma<T>(f: impl FnOnce() -> T) -> T {
    with_mode(MmaMode::Native, f)
}

fn with_mode<T>(mode: MmaMode, f: impl FnOnce() -> T) -> T {
    with_here(&MODE_HERE, mode, f)
}
