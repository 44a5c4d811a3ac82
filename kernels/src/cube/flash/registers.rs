//! The forward on register fragments, FlashAttention-2 proper: each plane keeps its 16 queries'
//! Q operand, scores, probabilities and output in registers for the whole loop over key blocks,
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
use cubecl::cmma::MmaDefinition;

/// Query rows per plane (one fragment high).
const ROWS: usize = 16;
/// Planes per cube.
const PLANES: usize = 4;
/// Keys per loop step.
const BLOCK: usize = 64;
/// Keys (queries) per product phase with the `mma` instruction.
const CHUNK: usize = 16;

/// This unit's lane in its plane and the lane's group `g` and thread-in-group `t`.
#[cube]
fn lane_gt() -> (usize, usize, usize) {
    let lane = UNIT_POS as usize % LANES;
    (lane, lane / 4, lane % 4)
}

/// An A operand's registers into the plane's emulation tile `sa` (16 rows, `lda` a row) at
/// column `16·kk`.
#[cube]
fn put_a<E: Float, N: Size>(
    sa: &mut SharedMemory<E>,
    a: &Array<Vector<E, N>>,
    #[comptime] kk: usize,
    #[comptime] lda: usize,
) {
    let (_, g, t) = lane_gt();
    let base = (UNIT_POS as usize / LANES) * 16 * lda;
    #[unroll]
    for r in 0..4usize {
        let x = a[r];
        #[unroll]
        for e in 0..2usize {
            sa[base + (g + 8 * (r % 2)) * lda + kk * 16 + 2 * t + 8 * (r / 2) + e] = x[e];
        }
    }
}

/// A B operand's registers into the emulation tile `sb` (`ldb` a row), element `(k, n)` at row
/// `k0 + k`, column `n0 + n`.
#[cube]
fn put_b<E: Float, N: Size>(
    sb: &mut SharedMemory<E>,
    b: &Array<Vector<E, N>>,
    k0: usize,
    n0: usize,
    #[comptime] ldb: usize,
) {
    let (_, g, t) = lane_gt();
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
/// (`k` the inner size).
#[cube]
fn emulated_product<E: Float, N: Size>(
    sa: &SharedMemory<E>,
    sb: &SharedMemory<E>,
    c: &mut Array<Vector<f32, N>>,
    n0: usize,
    #[comptime] k: usize,
    #[comptime] lda: usize,
    #[comptime] ldb: usize,
) {
    let (_, g, t) = lane_gt();
    let base = (UNIT_POS as usize / LANES) * 16 * lda;
    #[unroll]
    for v in 0..2usize {
        let mut acc = c[v];
        #[unroll]
        for e in 0..2usize {
            let mut x = acc[e];
            for kk in 0..k {
                x += f32::cast_from(sa[base + (g + 8 * v) * lda + kk])
                    * f32::cast_from(sb[kk * ldb + n0 + 2 * t + e]);
            }
            acc[e] = x;
        }
        c[v] = acc;
    }
}

/// `c += a · b` on the tensor cores (one `mma.m16n8k16`).
#[cube]
fn mma<E: Float, N: Size>(
    a: &Array<Vector<E, N>>,
    b: &Array<Vector<E, N>>,
    c: &mut Array<Vector<f32, N>>,
) {
    let def = MmaDefinition::<E, E, f32>::new(16usize, 8usize, 16usize);
    def.execute_inplace(a, b, c);
}

/// The score-like product of a phase: `a` (the plane's 16 rows, `d / 16` A operands) times the
/// rows `n0..n0 + chunk` of tile `sm` transposed, as `chunk / 8` accumulators (Q·Kᵀ).
#[cube]
#[allow(clippy::too_many_arguments)]
fn product_t<E: Float, N: Size>(
    a: &Sequence<Array<Vector<E, N>>>,
    sm: &SharedMemory<Vector<E, N>>,
    n0: usize,
    sa: &mut SharedMemory<E>,
    sb: &mut SharedMemory<E>,
    #[comptime] chunk: usize,
    #[comptime] d: usize,
    #[comptime] ldv: usize,
    #[comptime] native: bool,
) -> Sequence<Array<Vector<f32, N>>> {
    let mut out = Sequence::<Array<Vector<f32, N>>>::new();
    if comptime!(native) {
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
            put_a::<E, N>(sa, a.index(kk), kk, lda);
        }
        if UNIT_POS < 32u32 {
            #[unroll]
            for n in 0..comptime!(chunk / 8) {
                #[unroll]
                for kk in 0..comptime!(d / 16) {
                    let bf = b_transposed::<E, N>(sm, n0 + n * 8, kk, ldv);
                    put_b::<E, N>(sb, &bf, kk * 16, n * 8, chunk);
                }
            }
        }
        sync_cube();
        #[unroll]
        for n in 0..comptime!(chunk / 8) {
            let mut c = acc_zero::<N>();
            emulated_product::<E, N>(sa, sb, &mut c, n * 8, d, lda, chunk);
            out.push(c);
        }
        sync_cube();
    }
    out
}

/// The value-like product of a phase: `acc` (`d / 8` accumulators) `+= p · sm[k0..k0 + chunk]`,
/// `p` the plane's `chunk / 8` f32 accumulators (probabilities) as A operands in `E` (P·V).
#[cube]
#[allow(clippy::too_many_arguments)]
fn product_acc<E: Float, N: Size>(
    p: &Sequence<Array<Vector<f32, N>>>,
    sm: &SharedMemory<Vector<E, N>>,
    k0: usize,
    acc: &mut Sequence<Array<Vector<f32, N>>>,
    sa: &mut SharedMemory<E>,
    sb: &mut SharedMemory<E>,
    #[comptime] chunk: usize,
    #[comptime] d: usize,
    #[comptime] ldv: usize,
    #[comptime] native: bool,
) {
    if comptime!(native) {
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
            put_a::<E, N>(sa, &a, kk, lda);
        }
        if UNIT_POS < 32u32 {
            #[unroll]
            for kk in 0..comptime!(chunk / 16) {
                #[unroll]
                for u in 0..comptime!(d / 8) {
                    let bf = b_plain::<E, N>(sm, k0 + kk * 16, u * 8, ldv);
                    put_b::<E, N>(sb, &bf, kk * 16, u * 8, d);
                }
            }
        }
        sync_cube();
        #[unroll]
        for u in 0..comptime!(d / 8) {
            emulated_product::<E, N>(sa, sb, acc.index_mut(u), u * 8, chunk, lda, d);
        }
        sync_cube();
    }
}

/// The combination (`max`, else sum) of `x0` and of `x1` over the four lanes of this unit's
/// group: two shuffles each (`native`), or through `red` (two slots per unit). Uniform control
/// flow.
#[cube]
fn quad_combine(
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

/// `rows` head rows from `start` (zeros from `end`) into `dst` as element pairs, `ldv` pairs a
/// row: a plane's reads are a row's contiguous bytes, all issued before the first store.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_rows<E: Float, N: Size>(
    src: &Tensor<Vector<E, N>>,
    l: &Sequence<u32>,
    b: usize,
    h: usize,
    start: usize,
    end: usize,
    dst: &mut SharedMemory<Vector<E, N>>,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] ldv: usize,
    #[comptime] units: usize,
) {
    let per_row = comptime!(d / 2);
    let total = comptime!(rows * d / 2);
    let steps = comptime!(total.div_ceil(units));
    let base = head_base(l, b, h) / 2;
    let token = *l.index(3usize) as usize / 2;
    let unit = UNIT_POS as usize;
    let mut got = Sequence::<Vector<E, N>>::new();
    #[unroll]
    for s in 0..steps {
        let e = unit + s * units;
        let r = e / per_row;
        let mut x = Vector::<E, N>::new(E::new(0.0));
        if e < total && start + r < end {
            x = src[base + (start + r) * token + e % per_row];
        }
        got.push(x);
    }
    #[unroll]
    for s in 0..steps {
        let e = unit + s * units;
        if e < total {
            dst[(e / per_row) * ldv + e % per_row] = *got.index(s);
        }
    }
}

/// A zeroed accumulator (two f32 pairs).
#[cube]
fn acc_zero<N: Size>() -> Array<Vector<f32, N>> {
    let mut c = Array::<Vector<f32, N>>::new(2usize);
    c[0] = Vector::new(0.0f32);
    c[1] = Vector::new(0.0f32);
    c
}

/// The A operand of rows `row0..row0 + 16`, head columns `16·kk..16·kk + 16` of a pair tile
/// (`ldv` pairs a row).
#[cube]
fn a_rows<E: Float, N: Size>(
    sm: &SharedMemory<Vector<E, N>>,
    row0: usize,
    #[comptime] kk: usize,
    #[comptime] ldv: usize,
) -> Array<Vector<E, N>> {
    let (_, g, t) = lane_gt();
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
fn b_transposed<E: Float, N: Size>(
    sm: &SharedMemory<Vector<E, N>>,
    n0: usize,
    #[comptime] kk: usize,
    #[comptime] ldv: usize,
) -> Array<Vector<E, N>> {
    let (_, g, t) = lane_gt();
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
fn b_plain<E: Float, N: Size>(
    sm: &SharedMemory<Vector<E, N>>,
    k0: usize,
    n0: usize,
    #[comptime] ldv: usize,
) -> Array<Vector<E, N>> {
    let (_, g, t) = lane_gt();
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

/// Accumulators `lo` and `hi` (16 × 8 each, side by side) as one A operand (16 × 16) in `E`.
#[cube]
fn a_from_acc<E: Float, N: Size>(
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

/// Shared memory of the emulation: the planes' A tiles and one B tile (elements of `E`), and the
/// quad reductions' slots (f32); one element each natively.
#[cube]
fn emulation_memory<E: Float>(
    #[comptime] planes: usize,
    #[comptime] chunk: usize,
    #[comptime] d: usize,
    #[comptime] native: bool,
) -> (SharedMemory<E>, SharedMemory<E>, SharedMemory<f32>) {
    let sa = SharedMemory::<E>::new(comptime!(if native {
        1
    } else {
        planes * 16 * d.max(chunk)
    }));
    let sb = SharedMemory::<E>::new(comptime!(if native { 1 } else { d * chunk }));
    let red = SharedMemory::<f32>::new(comptime!(if native { 1 } else { 2 * planes * LANES }));
    (sa, sb, red)
}

/// Forward: one cube per `planes · 16` queries of one (batch, head), each plane its 16, over
/// the key blocks up to the last one its cube's last query sees.
#[cube(
    launch,
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
#[allow(clippy::too_many_arguments)]
fn flash_forward_registers_kernel<E: Float, N: Size>(
    q: &Tensor<Vector<E, N>>,
    k: &Tensor<Vector<E, N>>,
    v: &Tensor<Vector<E, N>>,
    out: &mut Tensor<E>,
    lse: &mut Tensor<f32>,
    q_l: Sequence<u32>,
    k_l: Sequence<u32>,
    v_l: Sequence<u32>,
    o_l: Sequence<u32>,
    s_l: Sequence<u32>,
    heads: u32,
    kv_group: u32,
    seq_q: u32,
    seq_k: u32,
    q_offset: i32,
    scale: f32,
    #[comptime] planes: usize,
    #[comptime] rows: usize,
    #[comptime] bk: usize,
    #[comptime] d: usize,
    #[comptime] causal: bool,
    #[comptime] native: bool,
    #[define(E)] _dtype: StorageType,
) {
    let own = comptime!(planes * rows);
    let units = comptime!(planes * LANES);
    // Rows padded by 8 elements (16 bytes): a fragment's 32-bit reads hit 32 banks.
    let ldv = comptime!((d + 8) / 2);
    let seq_q = seq_q as usize;
    let seq_k = seq_k as usize;
    let (b, h, hk) = this_head(heads, kv_group);
    let q_start = CUBE_POS_X as usize * own;
    let plane = UNIT_POS as usize / LANES;
    let (_, g, t) = lane_gt();
    let i0 = q_start + plane * rows + g;

    let mut qs = SharedMemory::<Vector<E, N>>::new(own * ldv);
    let mut ks = SharedMemory::<Vector<E, N>>::new(bk * ldv);
    let mut vs = SharedMemory::<Vector<E, N>>::new(bk * ldv);
    let (mut sa, mut sb, mut red) = emulation_memory::<E>(planes, bk, d, native);

    // The plane's Q operand, in registers for the whole loop.
    load_rows::<E, N>(q, &q_l, b, h, q_start, seq_q, &mut qs, own, d, ldv, units);
    sync_cube();
    let mut qf = Sequence::<Array<Vector<E, N>>>::new();
    #[unroll]
    for kk in 0..comptime!(d / 16) {
        qf.push(a_rows::<E, N>(&qs, plane * rows, kk, ldv));
    }
    let mut o = Sequence::<Array<Vector<f32, N>>>::new();
    #[unroll]
    for _ in 0..comptime!(d / 8) {
        o.push(acc_zero::<N>());
    }
    // Rows g and g + 8: running maxima (scaled scores) and this lane's partial sums.
    let mut m0 = f32::new(NEG_BIG);
    let mut m1 = f32::new(NEG_BIG);
    let mut l0 = 0.0f32;
    let mut l1 = 0.0f32;
    let blocks = keys_end(q_start, seq_k, q_offset, own, causal).div_ceil(bk);

    for kb in 0..blocks {
        let k_start = kb * bk;
        load_rows::<E, N>(k, &k_l, b, hk, k_start, seq_k, &mut ks, bk, d, ldv, units);
        load_rows::<E, N>(v, &v_l, b, hk, k_start, seq_k, &mut vs, bk, d, ldv, units);
        sync_cube();
        // S = Q·Kᵀ: bk / 8 accumulators of 16 × 8.
        let mut s = product_t::<E, N>(&qf, &ks, 0, &mut sa, &mut sb, bk, d, ldv, native);
        // Scale, mask (only a block that crosses the diagonal or the keys' end), row maxima.
        let mut masked = k_start + bk > seq_k;
        if comptime!(causal) {
            masked =
                masked || i32::cast_from(k_start + bk - 1) > i32::cast_from(q_start) + q_offset;
        }
        let mut mx0 = m0;
        let mut mx1 = m1;
        #[unroll]
        for n in 0..comptime!(bk / 8) {
            let c = s.index_mut(n);
            #[unroll]
            for pv in 0..2usize {
                let mut x = c[pv];
                #[unroll]
                for e in 0..2usize {
                    let mut y = x[e] * scale;
                    if masked {
                        let j = k_start + n * 8 + 2 * t + e;
                        if !visible(i0 + 8 * pv, j, seq_q, seq_k, q_offset, causal) {
                            y = f32::new(NEG_BIG);
                        }
                    }
                    x[e] = y;
                    if comptime!(pv == 0) {
                        mx0 = f32::max(mx0, y);
                    } else {
                        mx1 = f32::max(mx1, y);
                    }
                }
                c[pv] = x;
            }
        }
        let (mx0, mx1) = quad_combine(mx0, mx1, &mut red, true, native);
        let corr0 = f32::exp(m0 - mx0);
        let corr1 = f32::exp(m1 - mx1);
        m0 = mx0;
        m1 = mx1;
        l0 *= corr0;
        l1 *= corr1;
        #[unroll]
        for u in 0..comptime!(d / 8) {
            let c = o.index_mut(u);
            c[0] = c[0] * Vector::new(corr0);
            c[1] = c[1] * Vector::new(corr1);
        }
        // P = exp(S − m), summed into the lane's partial sums (a masked score gives 0).
        #[unroll]
        for n in 0..comptime!(bk / 8) {
            let c = s.index_mut(n);
            #[unroll]
            for pv in 0..2usize {
                let mut x = c[pv];
                let mut m = m1;
                if comptime!(pv == 0) {
                    m = m0;
                }
                #[unroll]
                for e in 0..2usize {
                    let y = x[e];
                    let mut p = f32::exp(y - m);
                    if masked && y == f32::new(NEG_BIG) {
                        p = 0.0;
                    }
                    x[e] = p;
                    if comptime!(pv == 0) {
                        l0 += p;
                    } else {
                        l1 += p;
                    }
                }
                c[pv] = x;
            }
        }
        // O += P·V (the accumulator pairs of 16 keys are P's A operand).
        product_acc::<E, N>(&s, &vs, 0, &mut o, &mut sa, &mut sb, bk, d, ldv, native);
        sync_cube();
    }

    let (l0, l1) = quad_combine(l0, l1, &mut red, false, native);
    let o_base = head_base(&o_l, b, h);
    let o_token = *o_l.index(3usize) as usize;
    #[unroll]
    for pv in 0..2usize {
        let i = i0 + 8 * pv;
        let mut l = l1;
        let mut m = m1;
        if comptime!(pv == 0) {
            l = l0;
            m = m0;
        }
        let inv = select(l > 0.0, 1.0 / l, 0.0);
        if i < seq_q {
            #[unroll]
            for u in 0..comptime!(d / 8) {
                let x = o.index(u)[pv];
                let at = o_base + i * o_token + u * 8 + 2 * t;
                out[at] = E::cast_from(x[0] * inv);
                out[at + 1] = E::cast_from(x[1] * inv);
            }
            if t == 0 {
                let s_base = head_base(&s_l, b, h);
                lse[s_base + i * *s_l.index(3usize) as usize] = m + f32::ln(l);
            }
        }
    }
}

/// Backward pass 1 on registers: dQ and `delta = rowsum(dO∘O)` (for pass 2); one cube per
/// `planes · 16` queries, each plane its 16, over the key blocks up to the diagonal. Per phase
/// (`chunk` keys) the plane forms S = Q·Kᵀ and dP = dO·Vᵀ, then dS = P∘(dP − delta) with
/// P = exp(S·scale − lse), the A operand of dQ += dS·K.
#[cube(
    launch,
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
#[allow(clippy::too_many_arguments)]
fn flash_backward_q_registers_kernel<E: Float, N: Size>(
    q: &Tensor<Vector<E, N>>,
    k: &Tensor<Vector<E, N>>,
    v: &Tensor<Vector<E, N>>,
    out: &Tensor<Vector<E, N>>,
    d_out: &Tensor<Vector<E, N>>,
    lse: &Tensor<f32>,
    dq: &mut Tensor<E>,
    delta: &mut Tensor<f32>,
    q_l: Sequence<u32>,
    k_l: Sequence<u32>,
    v_l: Sequence<u32>,
    o_l: Sequence<u32>,
    s_l: Sequence<u32>,
    dq_l: Sequence<u32>,
    heads: u32,
    kv_group: u32,
    seq_q: u32,
    seq_k: u32,
    q_offset: i32,
    scale: f32,
    #[comptime] planes: usize,
    #[comptime] rows: usize,
    #[comptime] bk: usize,
    #[comptime] d: usize,
    #[comptime] causal: bool,
    #[comptime] native: bool,
    #[define(E)] _dtype: StorageType,
) {
    let own = comptime!(planes * rows);
    let units = comptime!(planes * LANES);
    let ldv = comptime!((d + 8) / 2);
    let chunk = comptime!(if native { CHUNK } else { bk });
    let seq_q = seq_q as usize;
    let seq_k = seq_k as usize;
    let (b, h, hk) = this_head(heads, kv_group);
    let q_start = CUBE_POS_X as usize * own;
    let plane = UNIT_POS as usize / LANES;
    let (_, g, t) = lane_gt();
    let i0 = q_start + plane * rows + g;
    let s_base = head_base(&s_l, b, h);
    let s_token = *s_l.index(3usize) as usize;

    let mut qs = SharedMemory::<Vector<E, N>>::new(own * ldv);
    let mut dos = SharedMemory::<Vector<E, N>>::new(own * ldv);
    let mut ks = SharedMemory::<Vector<E, N>>::new(bk * ldv);
    let mut vs = SharedMemory::<Vector<E, N>>::new(bk * ldv);
    let (mut sa, mut sb, mut red) = emulation_memory::<E>(planes, chunk, d, native);

    load_rows::<E, N>(q, &q_l, b, h, q_start, seq_q, &mut qs, own, d, ldv, units);
    load_rows::<E, N>(
        d_out, &o_l, b, h, q_start, seq_q, &mut dos, own, d, ldv, units,
    );
    // delta and lse of rows g and g + 8: each of a row's four lanes sums every fourth pair.
    let o_base = head_base(&o_l, b, h) / 2;
    let o_token = *o_l.index(3usize) as usize / 2;
    let mut part0 = 0.0f32;
    let mut part1 = 0.0f32;
    let mut lse0 = 0.0f32;
    let mut lse1 = 0.0f32;
    #[unroll]
    for pv in 0..2usize {
        let i = i0 + 8 * pv;
        let mut acc = 0.0f32;
        let mut row_lse = 0.0f32;
        if i < seq_q {
            let mut got = Sequence::<Vector<E, N>>::new();
            #[unroll]
            for c in 0..comptime!(d / 8) {
                got.push(out[o_base + i * o_token + 4 * c + t]);
            }
            #[unroll]
            for c in 0..comptime!(d / 8) {
                let gv = d_out[o_base + i * o_token + 4 * c + t];
                let ov = *got.index(c);
                acc += f32::cast_from(gv[0]) * f32::cast_from(ov[0])
                    + f32::cast_from(gv[1]) * f32::cast_from(ov[1]);
            }
            row_lse = lse[s_base + i * s_token];
        }
        if comptime!(pv == 0) {
            part0 = acc;
            lse0 = row_lse;
        } else {
            part1 = acc;
            lse1 = row_lse;
        }
    }
    let (delta0, delta1) = quad_combine(part0, part1, &mut red, false, native);
    if t == 0 {
        if i0 < seq_q {
            delta[s_base + i0 * s_token] = delta0;
        }
        if i0 + 8 < seq_q {
            delta[s_base + (i0 + 8) * s_token] = delta1;
        }
    }
    sync_cube();
    let mut qf = Sequence::<Array<Vector<E, N>>>::new();
    let mut dof = Sequence::<Array<Vector<E, N>>>::new();
    #[unroll]
    for kk in 0..comptime!(d / 16) {
        qf.push(a_rows::<E, N>(&qs, plane * rows, kk, ldv));
        dof.push(a_rows::<E, N>(&dos, plane * rows, kk, ldv));
    }
    let mut acc = Sequence::<Array<Vector<f32, N>>>::new();
    #[unroll]
    for _ in 0..comptime!(d / 8) {
        acc.push(acc_zero::<N>());
    }
    let blocks = keys_end(q_start, seq_k, q_offset, own, causal).div_ceil(bk);

    for kb in 0..blocks {
        let k_start = kb * bk;
        load_rows::<E, N>(k, &k_l, b, hk, k_start, seq_k, &mut ks, bk, d, ldv, units);
        load_rows::<E, N>(v, &v_l, b, hk, k_start, seq_k, &mut vs, bk, d, ldv, units);
        sync_cube();
        let mut masked = k_start + bk > seq_k;
        if comptime!(causal) {
            masked =
                masked || i32::cast_from(k_start + bk - 1) > i32::cast_from(q_start) + q_offset;
        }
        #[unroll]
        for ph in 0..comptime!(bk / chunk) {
            let n0 = ph * chunk;
            let mut ds = product_t::<E, N>(&qf, &ks, n0, &mut sa, &mut sb, chunk, d, ldv, native);
            let dp = product_t::<E, N>(&dof, &vs, n0, &mut sa, &mut sb, chunk, d, ldv, native);
            #[unroll]
            for n in 0..comptime!(chunk / 8) {
                let c = ds.index_mut(n);
                let y = dp.index(n);
                #[unroll]
                for pv in 0..2usize {
                    let mut x = c[pv];
                    let z = y[pv];
                    let mut row_lse = lse1;
                    let mut dl = delta1;
                    if comptime!(pv == 0) {
                        row_lse = lse0;
                        dl = delta0;
                    }
                    #[unroll]
                    for e in 0..2usize {
                        let mut p = f32::exp(x[e] * scale - row_lse);
                        if masked {
                            let j = k_start + n0 + n * 8 + 2 * t + e;
                            if !visible(i0 + 8 * pv, j, seq_q, seq_k, q_offset, causal) {
                                p = 0.0;
                            }
                        }
                        x[e] = p * (z[e] - dl);
                    }
                    c[pv] = x;
                }
            }
            // dQ += dS·K
            product_acc::<E, N>(
                &ds, &ks, n0, &mut acc, &mut sa, &mut sb, chunk, d, ldv, native,
            );
        }
        sync_cube();
    }

    let dq_base = head_base(&dq_l, b, h);
    let dq_token = *dq_l.index(3usize) as usize;
    #[unroll]
    for pv in 0..2usize {
        let i = i0 + 8 * pv;
        if i < seq_q {
            #[unroll]
            for u in 0..comptime!(d / 8) {
                let x = acc.index(u)[pv];
                let at = dq_base + i * dq_token + u * 8 + 2 * t;
                dq[at] = E::cast_from(x[0] * scale);
                dq[at + 1] = E::cast_from(x[1] * scale);
            }
        }
    }
}

/// Backward pass 2 on registers: dK and dV, one cube per `planes · 16` keys of one (batch,
/// query head), each plane its 16, over the query blocks from the diagonal on. Per phase
/// (`chunk` queries) the plane forms Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, then Pᵀ and
/// dSᵀ = Pᵀ∘(dPᵀ − delta), the A operands of dV += Pᵀ·dO and dK += dSᵀ·Q. `dkv` holds both
/// (laid out `dk_l`, `dv_l`; with grouped key/value heads a partial per query head, summed by the
/// host).
#[cube(
    launch,
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
#[allow(clippy::too_many_arguments)]
fn flash_backward_kv_registers_kernel<E: Float, N: Size>(
    q: &Tensor<Vector<E, N>>,
    k: &Tensor<Vector<E, N>>,
    v: &Tensor<Vector<E, N>>,
    d_out: &Tensor<Vector<E, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dkv: &mut Tensor<E>,
    q_l: Sequence<u32>,
    k_l: Sequence<u32>,
    v_l: Sequence<u32>,
    o_l: Sequence<u32>,
    s_l: Sequence<u32>,
    dk_l: Sequence<u32>,
    dv_l: Sequence<u32>,
    heads: u32,
    kv_group: u32,
    seq_q: u32,
    seq_k: u32,
    q_offset: i32,
    scale: f32,
    #[comptime] planes: usize,
    #[comptime] rows: usize,
    #[comptime] bq: usize,
    #[comptime] d: usize,
    #[comptime] causal: bool,
    #[comptime] native: bool,
    #[define(E)] _dtype: StorageType,
) {
    let own = comptime!(planes * rows);
    let units = comptime!(planes * LANES);
    let ldv = comptime!((d + 8) / 2);
    let chunk = comptime!(if native { CHUNK } else { bq });
    let seq_q = seq_q as usize;
    let seq_k = seq_k as usize;
    let (b, h, hk) = this_head(heads, kv_group);
    let k_start = CUBE_POS_X as usize * own;
    let plane = UNIT_POS as usize / LANES;
    let (_, g, t) = lane_gt();
    let key0 = k_start + plane * rows + g;
    let s_base = head_base(&s_l, b, h);
    let s_token = *s_l.index(3usize) as usize;

    let mut ks = SharedMemory::<Vector<E, N>>::new(own * ldv);
    let mut vs = SharedMemory::<Vector<E, N>>::new(own * ldv);
    let mut qs = SharedMemory::<Vector<E, N>>::new(bq * ldv);
    let mut dos = SharedMemory::<Vector<E, N>>::new(bq * ldv);
    let mut lse_s = SharedMemory::<f32>::new(bq);
    let mut delta_s = SharedMemory::<f32>::new(bq);
    let (mut sa, mut sb, _) = emulation_memory::<E>(planes, chunk, d, native);

    load_rows::<E, N>(k, &k_l, b, hk, k_start, seq_k, &mut ks, own, d, ldv, units);
    load_rows::<E, N>(v, &v_l, b, hk, k_start, seq_k, &mut vs, own, d, ldv, units);
    sync_cube();
    let mut kf = Sequence::<Array<Vector<E, N>>>::new();
    let mut vf = Sequence::<Array<Vector<E, N>>>::new();
    #[unroll]
    for kk in 0..comptime!(d / 16) {
        kf.push(a_rows::<E, N>(&ks, plane * rows, kk, ldv));
        vf.push(a_rows::<E, N>(&vs, plane * rows, kk, ldv));
    }
    let mut dk = Sequence::<Array<Vector<f32, N>>>::new();
    let mut dv = Sequence::<Array<Vector<f32, N>>>::new();
    #[unroll]
    for _ in 0..comptime!(d / 8) {
        dk.push(acc_zero::<N>());
        dv.push(acc_zero::<N>());
    }
    // Query blocks from the first query that sees this cube's first key.
    let mut first = 0usize;
    if comptime!(causal) {
        let q_first = i32::cast_from(k_start) - q_offset;
        first = usize::cast_from(i32::max(q_first, 0)) / bq;
    }
    let blocks = seq_q.div_ceil(bq);

    for qb in first..blocks {
        let q_start = qb * bq;
        sync_cube();
        load_rows::<E, N>(q, &q_l, b, h, q_start, seq_q, &mut qs, bq, d, ldv, units);
        load_rows::<E, N>(
            d_out, &o_l, b, h, q_start, seq_q, &mut dos, bq, d, ldv, units,
        );
        load_stats(lse, s_base, s_token, q_start, seq_q, 0.0, &mut lse_s, bq);
        load_stats(
            delta,
            s_base,
            s_token,
            q_start,
            seq_q,
            0.0,
            &mut delta_s,
            bq,
        );
        sync_cube();
        let mut masked = q_start + bq > seq_q || k_start + own > seq_k;
        if comptime!(causal) {
            masked =
                masked || i32::cast_from(k_start + own - 1) > i32::cast_from(q_start) + q_offset;
        }
        #[unroll]
        for ph in 0..comptime!(bq / chunk) {
            let n0 = ph * chunk;
            let mut pt = product_t::<E, N>(&kf, &qs, n0, &mut sa, &mut sb, chunk, d, ldv, native);
            let mut dst = product_t::<E, N>(&vf, &dos, n0, &mut sa, &mut sb, chunk, d, ldv, native);
            #[unroll]
            for n in 0..comptime!(chunk / 8) {
                let c = pt.index_mut(n);
                let y = dst.index_mut(n);
                #[unroll]
                for pv in 0..2usize {
                    let mut x = c[pv];
                    let mut z = y[pv];
                    #[unroll]
                    for e in 0..2usize {
                        let qj = n0 + n * 8 + 2 * t + e;
                        let mut p = f32::exp(x[e] * scale - lse_s[qj]);
                        if masked {
                            let key = key0 + 8 * pv;
                            if !visible(q_start + qj, key, seq_q, seq_k, q_offset, causal) {
                                p = 0.0;
                            }
                        }
                        x[e] = p;
                        z[e] = p * (z[e] - delta_s[qj]);
                    }
                    c[pv] = x;
                    y[pv] = z;
                }
            }
            // dV += Pᵀ·dO, dK += dSᵀ·Q
            product_acc::<E, N>(
                &pt, &dos, n0, &mut dv, &mut sa, &mut sb, chunk, d, ldv, native,
            );
            product_acc::<E, N>(
                &dst, &qs, n0, &mut dk, &mut sa, &mut sb, chunk, d, ldv, native,
            );
        }
    }

    let dk_base = head_base(&dk_l, b, h);
    let dk_token = *dk_l.index(3usize) as usize;
    let dv_base = head_base(&dv_l, b, h);
    let dv_token = *dv_l.index(3usize) as usize;
    #[unroll]
    for pv in 0..2usize {
        let j = key0 + 8 * pv;
        if j < seq_k {
            #[unroll]
            for u in 0..comptime!(d / 8) {
                let c = u * 8 + 2 * t;
                let x = dk.index(u)[pv];
                dkv[dk_base + j * dk_token + c] = E::cast_from(x[0] * scale);
                dkv[dk_base + j * dk_token + c + 1] = E::cast_from(x[1] * scale);
                let y = dv.index(u)[pv];
                dkv[dv_base + j * dv_token + c] = E::cast_from(y[0]);
                dkv[dv_base + j * dv_token + c + 1] = E::cast_from(y[1]);
            }
        }
    }
}

/// The register kernels' split for `pass` on `q`'s device, where they run: f16/bf16 with head dim
/// a multiple of 16 and Q, K, V (and O, dO) readable in 16-bit pairs (`n == 2`); with the
/// `mma` instruction (`cmma` set) when `WILDFIRE_ATTENTION_MMA=1` asks and the device has
/// `mma.m16n8k16` for the dtype with f32 accumulation and planes of 32 (CUDA sm_80 and later),
/// emulated when `WILDFIRE_ATTENTION_MMA=emulate` or [`with_emulated_mma`] asks. Otherwise the
/// older kernels run: the register kernels are opt-in until a GPU run has checked them (they
/// have run emulated on lavapipe only; `benches/gpu.sh` checks and times both). Four planes of 16 rows and blocks of 64;
/// while the cube's shared memory exceeds the device's the block halves down to 16, then the
/// planes.
pub(super) fn registers_split<R: CubeRuntime>(
    q: &CubeTensor<R>,
    pass: Pass,
    d: usize,
    n: usize,
) -> Option<Flash> {
    let mode = mma_mode();
    if mode == MmaMode::Off
        || !matches!(q.dtype, DType::F16 | DType::BF16)
        || n != 2
        || !d.is_multiple_of(16)
    {
        return None;
    }
    let props = q.client.properties();
    let planes32 = props.hardware.plane_size_min == 32 && props.hardware.plane_size_max == 32;
    let has_mma = planes32
        && props.features.matmul.mma.contains(&MmaConfig {
            a_type: q.dtype.into(),
            b_type: q.dtype.into(),
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
    let mut f = Flash {
        planes: PLANES,
        rows: ROWS,
        block: BLOCK,
        cmma: native,
    };
    let limit = props.hardware.max_shared_memory_size;
    let es = q.dtype.size();
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MmaMode {
    /// The older kernels (the default until a GPU run has checked the register kernels).
    Off,
    /// The register kernels on the `mma` instruction where the device has it.
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
                Ok("1") => MmaMode::Native,
                Ok("emulate") => MmaMode::Emulate,
                Ok("0") | Err(_) => MmaMode::Off,
                Ok(other) => {
                    eprintln!("WILDFIRE_ATTENTION_MMA={other:?} is not 0, 1 or emulate; ignored");
                    MmaMode::Off
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

/// Runs `f` with the attention launched from this thread on the register kernels with the
/// `mma` instruction where the device has it (`WILDFIRE_ATTENTION_MMA=1` for this thread only).
pub fn with_native_mma<T>(f: impl FnOnce() -> T) -> T {
    with_mode(MmaMode::Native, f)
}

fn with_mode<T>(mode: MmaMode, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<MmaMode>);
    impl Drop for Restore {
        fn drop(&mut self) {
            MODE_HERE.set(self.0);
        }
    }
    let _restore = Restore(MODE_HERE.replace(Some(mode)));
    f()
}

/// Launches the register forward (split `f`) into `output` and `lse`.
pub(super) fn forward_registers<R: CubeRuntime>(
    ops: &Operands<R>,
    p: &Problem,
    output: (&CubeTensor<R>, Heads),
    lse: (&CubeTensor<R>, Heads),
    f: Flash,
) {
    use super::super::arg;
    let q = &ops.q.0;
    let (count, dim) = f.launch_dims(p.seq_q, p);
    super::super::REGISTER_ATTENTION.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    launch_flash!(
        flash_forward_registers_kernel,
        q,
        p,
        f,
        count,
        dim,
        2,
        [
            arg(q),
            arg(&ops.k.0),
            arg(&ops.v.0),
            arg(output.0),
            arg(lse.0),
            seq_arg(&ops.q.1),
            seq_arg(&ops.k.1),
            seq_arg(&ops.v.1),
            seq_arg(&output.1),
            seq_arg(&lse.1),
        ]
    );
}

/// Launches both register backward passes (splits `fq` and `fkv`); arguments as
/// [`super::backward`]'s.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward_registers<R: CubeRuntime>(
    ops: &Operands<R>,
    p: &Problem,
    output: (&CubeTensor<R>, Heads),
    d_output: &CubeTensor<R>,
    lse: (&CubeTensor<R>, Heads),
    delta: &CubeTensor<R>,
    dq: (&CubeTensor<R>, Heads),
    dkv: &CubeTensor<R>,
    dk_l: Heads,
    dv_l: Heads,
    (fq, fkv): (Flash, Flash),
) {
    use super::super::arg;
    let q = &ops.q.0;
    let f = fq;
    let (count, dim) = f.launch_dims(p.seq_q, p);
    super::super::REGISTER_ATTENTION.fetch_add(2, std::sync::atomic::Ordering::Relaxed);
    launch_flash!(
        flash_backward_q_registers_kernel,
        q,
        p,
        f,
        count,
        dim,
        2,
        [
            arg(q),
            arg(&ops.k.0),
            arg(&ops.v.0),
            arg(output.0),
            arg(d_output),
            arg(lse.0),
            arg(dq.0),
            arg(delta),
            seq_arg(&ops.q.1),
            seq_arg(&ops.k.1),
            seq_arg(&ops.v.1),
            seq_arg(&output.1),
            seq_arg(&lse.1),
            seq_arg(&dq.1),
        ]
    );
    let f = fkv;
    let (count, dim) = f.launch_dims(p.seq_k, p);
    launch_flash!(
        flash_backward_kv_registers_kernel,
        q,
        p,
        f,
        count,
        dim,
        2,
        [
            arg(q),
            arg(&ops.k.0),
            arg(&ops.v.0),
            arg(d_output),
            arg(lse.0),
            arg(delta),
            arg(dkv),
            seq_arg(&ops.q.1),
            seq_arg(&ops.k.1),
            seq_arg(&ops.v.1),
            seq_arg(&output.1),
            seq_arg(&lse.1),
            seq_arg(&dk_l),
            seq_arg(&dv_l),
        ]
    );
}
