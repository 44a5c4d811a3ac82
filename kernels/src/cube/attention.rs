//! Flash attention, FlashAttention-2 style: one cube per block of `bq` queries of one (batch,
//! head), key/value blocks of `bk` staged through shared memory, an online softmax whose
//! log-sum-exp is saved for the backward, and causal key blocks above the diagonal skipped
//! entirely. The tile products go through [`tile_mm`]: tensor-core fragments (`cmma`, 16 × 16 ×
//! 16, f32 accumulation) for f16/bf16 where the device has them, the same tiles as plain loops of
//! the cube's units everywhere else (Wgpu, f32) — one algorithm, two ways to multiply a tile.
//!
//! The operands are addressed through [`Heads`] (an offset and batch, head and token strides, the
//! head dimension contiguous), so the same kernels read separate `[b, h, t, d]` tensors and the
//! packed `[b, t, h, 3·d]` projections of a fused q/k/v linear in place, and write the output in
//! either layout: no split, no transpose, no concatenation around the kernels. Key/value heads
//! may be fewer than query heads (grouped-query attention: `kv_group` query heads per key/value
//! head), and queries and keys may start at position offsets (the causal mask compares absolute
//! positions: what context parallelism's blocks need).
//!
//! Shared memory per cube (elements of the input dtype `E`, f32 `4`):
//! forward `E·(bq·d + bk·d + bq·bk) + 4·(bq·bk + bq·d + 2·bq)`; see [`Tiles`].

use super::{NEG_BIG, arg, contiguous, empty, empty_f32, launched};
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::features::MmaConfig;
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim};

/// Units per cube: four planes of 32 on CUDA (the tensor-core tiles are spread over the planes).
pub(super) const UNITS: u32 = 128;

/// Where the rows of one operand live: element `(b, h, t, c)` is at
/// `offset + b·batch + h·head + t·token + c`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Heads {
    pub offset: usize,
    pub batch: usize,
    pub head: usize,
    pub token: usize,
}

impl Heads {
    /// A contiguous `[b, h, t, d]` tensor (or `[b, h, t]` with `d = 1`).
    pub fn plain(heads: usize, seq: usize, d: usize) -> Self {
        Self {
            offset: 0,
            batch: heads * seq * d,
            head: seq * d,
            token: d,
        }
    }

    /// Part `part` (0 = q, 1 = k, 2 = v) of packed `[b, t, h, parts·d]` projections, or with
    /// `parts = 1` a `[b, t, h, d]` tensor (`[b, t, h]` with `d = 1`).
    pub fn packed(heads: usize, seq: usize, d: usize, parts: usize, part: usize) -> Self {
        Self {
            offset: part * d,
            batch: seq * heads * parts * d,
            head: parts * d,
            token: heads * parts * d,
        }
    }

    /// `[offset, batch, head, token]` as kernel scalars.
    pub fn args(&self) -> [u32; 4] {
        [self.offset, self.batch, self.head, self.token]
            .map(|x| u32::try_from(x).expect("attention: tensor too large for 32-bit indexing"))
    }
}

/// The shape of one attention call.
#[derive(Debug, Clone, Copy)]
pub(super) struct Problem {
    pub batch: usize,
    pub heads: usize,
    /// Query heads per key/value head (1: multi-head attention).
    pub kv_group: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub causal: bool,
    /// Absolute position of query 0 minus that of key 0 (the causal mask is `key ≤ query`).
    pub q_offset: i64,
}

/// The tile sizes and the multiply of one launch (all comptime in the kernels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Tiles {
    /// Queries per tile.
    pub bq: usize,
    /// Keys per tile.
    pub bk: usize,
    /// Tensor-core (`cmma`) tile products.
    pub cmma: bool,
}

/// Which pass a tile choice is for (their shared-memory needs differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    Forward,
    BackwardQ,
    BackwardKv,
}

impl Tiles {
    /// Shared-memory bytes of `pass` with these tiles, head dimension `d`, input element size
    /// `es` (mirrors the kernels' allocations).
    pub fn shared_bytes(&self, pass: Pass, d: usize, es: usize) -> usize {
        let (bq, bk) = (self.bq, self.bk);
        match pass {
            Pass::Forward => es * (bq * d + bk * d + bq * bk) + 4 * (bq * bk + bq * d + 2 * bq),
            Pass::BackwardQ => {
                es * (2 * bq * d + 2 * bk * d + bq * bk) + 4 * (2 * bq * bk + bq * d + 2 * bq)
            }
            Pass::BackwardKv => {
                es * (2 * bk * d + 2 * bq * d + bk * bq) + 4 * (bk * bq + 2 * bk * d + 2 * bq)
            }
        }
    }

    /// The tiles for `pass` on `like`'s device: tensor cores when the dtype is f16/bf16, `d` a
    /// multiple of 16 and the device has 16 × 16 × 16 fragments for it with f32 accumulation and
    /// planes of 32 (unless `WILDFIRE_ATTENTION_CMMA=0`); tiles of 64 (32 without tensor cores),
    /// the larger halved while the cube's shared memory exceeds the device's (or 100 KB, two
    /// cubes per H100 multiprocessor) — down to 16 with tensor cores, 4 without.
    pub fn choose<R: CubeRuntime>(like: &CubeTensor<R>, pass: Pass, d: usize) -> Self {
        let props = like.client.properties();
        let es = like.dtype.size();
        let cmma = cmma_wanted()
            && matches!(like.dtype, DType::F16 | DType::BF16)
            && d.is_multiple_of(16)
            && props.hardware.plane_size_min == 32
            && props.hardware.plane_size_max == 32
            && props.features.matmul.cmma.contains(&MmaConfig {
                a_type: like.dtype.into(),
                b_type: like.dtype.into(),
                cd_type: DType::F32.into(),
                m: 16,
                n: 16,
                k: 16,
            });
        let limit = props.hardware.max_shared_memory_size.min(100 * 1024);
        let start = if cmma { 64 } else { 32 };
        let mut tiles = Tiles {
            bq: start,
            bk: start,
            cmma,
        };
        // Tensor-core tiles are whole 16 × 16 fragments; the plain loops take any size.
        let min = if cmma { 16 } else { 4 };
        while tiles.shared_bytes(pass, d, es) > limit && tiles.bq.max(tiles.bk) > min {
            if tiles.bk >= tiles.bq {
                tiles.bk /= 2;
            } else {
                tiles.bq /= 2;
            }
        }
        assert!(
            tiles.shared_bytes(pass, d, es) <= props.hardware.max_shared_memory_size,
            "attention: head dim {d} needs {} bytes of shared memory per cube, the device has {}",
            tiles.shared_bytes(pass, d, es),
            props.hardware.max_shared_memory_size
        );
        tiles
    }
}

/// `WILDFIRE_ATTENTION_CMMA=0` turns the tensor-core tile products off (the bench's comparison,
/// and a way around a device whose fragments misbehave).
fn cmma_wanted() -> bool {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WANTED.get_or_init(|| std::env::var("WILDFIRE_ATTENTION_CMMA").map_or(true, |v| v != "0"))
}

/// `c (+)= a · b` for shared-memory tiles, by the whole cube (every unit calls it; callers sync
/// around it). `a` is `m × k`, stored row-major with row stride `lda`, or (`a_t`) as its
/// transpose `k × m`; `b` is `k × n`, row-major with stride `ldb`, or (`b_t`) as its transpose
/// `n × k`; `c` is f32, row-major with stride `ldc` or (`c_t`) stored as its transpose `n × m`,
/// overwritten or (`acc`) added to. With `cmma`
/// each plane takes 16 × 16 output tiles in turn (tensor-core fragments, f32 accumulation; `m`,
/// `n`, `k` multiples of 16); without, each unit takes output elements in turn.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn tile_mm<E: Float>(
    a: &SharedMemory<E>,
    b: &SharedMemory<E>,
    c: &mut SharedMemory<f32>,
    #[comptime] m: usize,
    #[comptime] n: usize,
    #[comptime] k: usize,
    #[comptime] lda: usize,
    #[comptime] ldb: usize,
    #[comptime] ldc: usize,
    #[comptime] a_t: bool,
    #[comptime] b_t: bool,
    #[comptime] c_t: bool,
    #[comptime] acc: bool,
    #[comptime] cmma: bool,
) {
    if comptime!(cmma) {
        let tiles_n = comptime!(n / 16);
        let tiles = comptime!((m / 16) * (n / 16));
        let planes = (CUBE_DIM / PLANE_DIM) as usize;
        let a_len = a.len();
        let b_len = b.len();
        let c_len = c.len();
        let a_layout = comptime!(if a_t {
            cmma::MatrixLayout::ColMajor
        } else {
            cmma::MatrixLayout::RowMajor
        });
        let b_layout = comptime!(if b_t {
            cmma::MatrixLayout::ColMajor
        } else {
            cmma::MatrixLayout::RowMajor
        });
        let c_layout = comptime!(if c_t {
            cmma::MatrixLayout::ColMajor
        } else {
            cmma::MatrixLayout::RowMajor
        });
        let mut t = (UNIT_POS / PLANE_DIM) as usize;
        while t < tiles {
            let i0 = (t / tiles_n) * 16usize;
            let j0 = (t % tiles_n) * 16usize;
            let c_start = if comptime!(c_t) {
                j0 * ldc + i0
            } else {
                i0 * ldc + j0
            };
            let out = unsafe {
                cmma::Matrix::<f32>::uninitialized(
                    cmma::MatrixIdent::Accumulator,
                    16usize,
                    16usize,
                    16usize,
                    cmma::MatrixLayout::Undefined,
                )
            };
            if comptime!(acc) {
                cmma::load_with_layout(&out, &c.slice(c_start, c_len), ldc as u32, c_layout);
            } else {
                cmma::fill(&out, 0.0f32);
            }
            #[unroll]
            for kk in 0usize..comptime!(k / 16) {
                let fa = unsafe {
                    cmma::Matrix::<E>::uninitialized(
                        cmma::MatrixIdent::A,
                        16usize,
                        16usize,
                        16usize,
                        a_layout,
                    )
                };
                let fb = unsafe {
                    cmma::Matrix::<E>::uninitialized(
                        cmma::MatrixIdent::B,
                        16usize,
                        16usize,
                        16usize,
                        b_layout,
                    )
                };
                let a_start = if comptime!(a_t) {
                    kk * 16usize * lda + i0
                } else {
                    i0 * lda + kk * 16usize
                };
                let b_start = if comptime!(b_t) {
                    j0 * ldb + kk * 16usize
                } else {
                    kk * 16usize * ldb + j0
                };
                cmma::load(&fa, &a.slice(a_start, a_len), lda as u32);
                cmma::load(&fb, &b.slice(b_start, b_len), ldb as u32);
                cmma::execute::<E, E, f32, f32>(&fa, &fb, &out, &out);
            }
            cmma::store(&mut c.slice_mut(c_start, c_len), &out, ldc as u32, c_layout);
            t += planes;
        }
    } else {
        let mut e = UNIT_POS as usize;
        while e < m * n {
            // Consecutive units on consecutive elements of `c` as stored.
            let (i, j) = if comptime!(c_t) {
                (e % m, e / m)
            } else {
                (e / n, e % n)
            };
            let ci = if comptime!(c_t) {
                j * ldc + i
            } else {
                i * ldc + j
            };
            let mut s = 0.0f32;
            if comptime!(acc) {
                s = c[ci];
            }
            for kk in 0usize..k {
                let av = if comptime!(a_t) {
                    a[kk * lda + i]
                } else {
                    a[i * lda + kk]
                };
                let bv = if comptime!(b_t) {
                    b[j * ldb + kk]
                } else {
                    b[kk * ldb + j]
                };
                s += f32::cast_from(av) * f32::cast_from(bv);
            }
            c[ci] = s;
            e += CUBE_DIM as usize;
        }
    }
}

/// Rows `start..start + rows` of one (batch, head) of `src` (first element `base`, row stride
/// `token`, `d` columns) into `dst` (`rows × d`, row-major), rows at or past `end` as zeros; by
/// the whole cube, consecutive units on consecutive columns.
#[cube]
pub(super) fn load_rows<E: Float>(
    src: &Tensor<E>,
    base: usize,
    token: usize,
    start: usize,
    end: usize,
    dst: &mut SharedMemory<E>,
    #[comptime] rows: usize,
    #[comptime] d: usize,
) {
    let mut e = UNIT_POS as usize;
    while e < rows * d {
        let r = e / d;
        let c = e % d;
        let mut x = E::new(0.0);
        if start + r < end {
            x = src[base + (start + r) * token + c];
        }
        dst[e] = x;
        e += CUBE_DIM as usize;
    }
}

/// Per-row f32 values `start..start + rows` (stride `token` from `base`) into `dst`, `fill` past
/// `end`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn load_stats(
    src: &Tensor<f32>,
    base: usize,
    token: usize,
    start: usize,
    end: usize,
    fill: f32,
    dst: &mut SharedMemory<f32>,
    #[comptime] rows: usize,
) {
    let mut r = UNIT_POS as usize;
    while r < rows {
        let mut x = fill;
        if start + r < end {
            x = src[base + (start + r) * token];
        }
        dst[r] = x;
        r += CUBE_DIM as usize;
    }
}

/// Whether query `i` (of `seq_q`) sees key `j` (of `seq_k`): both real, and `j ≤ i + q_offset`
/// when causal.
#[cube]
pub(super) fn visible(
    i: usize,
    j: usize,
    seq_q: usize,
    seq_k: usize,
    q_offset: i32,
    #[comptime] causal: bool,
) -> bool {
    let mut ok = i < seq_q && j < seq_k;
    if comptime!(causal) {
        ok = ok && i32::cast_from(j) <= i32::cast_from(i) + q_offset;
    }
    ok
}

/// The (batch, head) of this cube (`CUBE_POS_Y`) and its key/value head.
#[cube]
pub(super) fn this_head(heads: u32, kv_group: u32) -> (usize, usize, usize) {
    let bh = CUBE_POS_Y as usize;
    let h = bh % heads as usize;
    (bh / heads as usize, h, h / kv_group as usize)
}

/// First element of (batch `b`, head `h`) of an operand laid out as `l` ([`Heads::args`]).
#[cube]
pub(super) fn head_base(l: &Sequence<u32>, b: usize, h: usize) -> usize {
    *l.index(0usize) as usize + b * *l.index(1usize) as usize + h * *l.index(2usize) as usize
}

/// The keys the queries `q_start..q_start + bq` see: all `seq_k`, or when causal up to the last
/// query's position (`q_offset` after key 0's).
#[cube]
pub(super) fn keys_end(
    q_start: usize,
    seq_k: usize,
    q_offset: i32,
    #[comptime] bq: usize,
    #[comptime] causal: bool,
) -> usize {
    let mut end = seq_k;
    if comptime!(causal) {
        let last = i32::cast_from(q_start + bq) + q_offset;
        end = usize::min(seq_k, usize::cast_from(i32::max(last, 0)));
    }
    end
}

/// Forward: one cube per `bq` queries of one (batch, head).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_forward_kernel<E: Float>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
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
    #[comptime] bq: usize,
    #[comptime] bk: usize,
    #[comptime] d: usize,
    #[comptime] causal: bool,
    #[comptime] cmma: bool,
    #[define(E)] _dtype: StorageType,
) {
    let seq_q = seq_q as usize;
    let seq_k = seq_k as usize;
    let (b, h, hk) = this_head(heads, kv_group);
    let q_base = head_base(&q_l, b, h);
    let k_base = head_base(&k_l, b, hk);
    let v_base = head_base(&v_l, b, hk);
    let q_start = CUBE_POS_X as usize * bq;

    let mut qs = SharedMemory::<E>::new(bq * d);
    let mut kvs = SharedMemory::<E>::new(bk * d);
    let mut ss = SharedMemory::<f32>::new(bq * bk);
    let mut ps = SharedMemory::<E>::new(bq * bk);
    let mut os = SharedMemory::<f32>::new(bq * d);
    let mut row_max = SharedMemory::<f32>::new(bq);
    let mut row_sum = SharedMemory::<f32>::new(bq);

    load_rows::<E>(
        q,
        q_base,
        *q_l.index(3usize) as usize,
        q_start,
        seq_q,
        &mut qs,
        bq,
        d,
    );
    let mut e = UNIT_POS as usize;
    while e < bq * d {
        os[e] = 0.0;
        e += CUBE_DIM as usize;
    }
    let mut r = UNIT_POS as usize;
    while r < bq {
        row_max[r] = NEG_BIG;
        row_sum[r] = 0.0;
        r += CUBE_DIM as usize;
    }
    // Key blocks up to the last key the block's last query sees.
    let blocks = keys_end(q_start, seq_k, q_offset, bq, causal).div_ceil(bk);
    sync_cube();

    for kb in 0..blocks {
        let k_start = kb * bk;
        load_rows::<E>(
            k,
            k_base,
            *k_l.index(3usize) as usize,
            k_start,
            seq_k,
            &mut kvs,
            bk,
            d,
        );
        sync_cube();
        // S = Q·Kᵀ, stored transposed (`ss[j·bq + r]`), as are P and O: the softmax below runs one
        // unit per query row, so consecutive units read consecutive words (row-major, a warp's
        // 32 rows `bk` words apart would all hit one shared-memory bank).
        tile_mm::<E>(
            &qs, &kvs, &mut ss, bq, bk, d, d, d, bq, false, true, true, false, cmma,
        );
        sync_cube();
        // Online softmax, one unit per query row: the new running max, P = exp(S·scale − max)
        // (0 where masked), the running sum, and the output rows rescaled.
        let mut r = UNIT_POS as usize;
        while r < bq {
            let i = q_start + r;
            let m_old = row_max[r];
            let mut mx = m_old;
            for j in 0..bk {
                if visible(i, k_start + j, seq_q, seq_k, q_offset, causal) {
                    mx = f32::max(mx, ss[j * bq + r] * scale);
                }
            }
            let corr = f32::exp(m_old - mx);
            let mut sum = 0.0f32;
            for j in 0..bk {
                let mut p = 0.0f32;
                if visible(i, k_start + j, seq_q, seq_k, q_offset, causal) {
                    p = f32::exp(ss[j * bq + r] * scale - mx);
                }
                ps[j * bq + r] = E::cast_from(p);
                sum += p;
            }
            row_sum[r] = row_sum[r] * corr + sum;
            row_max[r] = mx;
            for c in 0..d {
                os[c * bq + r] *= corr;
            }
            r += CUBE_DIM as usize;
        }
        load_rows::<E>(
            v,
            v_base,
            *v_l.index(3usize) as usize,
            k_start,
            seq_k,
            &mut kvs,
            bk,
            d,
        );
        sync_cube();
        // O += P·V (P and O transposed)
        tile_mm::<E>(
            &ps, &kvs, &mut os, bq, d, bk, bq, d, bq, true, false, true, true, cmma,
        );
        sync_cube();
    }

    let o_base = head_base(&o_l, b, h);
    let o_token = *o_l.index(3usize) as usize;
    let mut e = UNIT_POS as usize;
    while e < bq * d {
        let r = e / d;
        let c = e % d;
        if q_start + r < seq_q {
            out[o_base + (q_start + r) * o_token + c] = E::cast_from(os[c * bq + r] / row_sum[r]);
        }
        e += CUBE_DIM as usize;
    }
    let s_base = head_base(&s_l, b, h);
    let mut r = UNIT_POS as usize;
    while r < bq {
        if q_start + r < seq_q {
            lse[s_base + (q_start + r) * *s_l.index(3usize) as usize] =
                row_max[r] + f32::ln(row_sum[r]);
        }
        r += CUBE_DIM as usize;
    }
}

/// `Heads` as the kernels' `Sequence<u32>` argument.
pub(super) fn seq_arg<R: CubeRuntime>(heads: &Heads) -> SequenceArg<R, u32> {
    let mut s = SequenceArg::new();
    for x in heads.args() {
        s.push(x);
    }
    s
}

/// The launch of a pass over `rows` rows per (batch, head) in blocks of `block`.
pub(super) fn launch_dims(rows: usize, block: usize, p: &Problem) -> (CubeCount, CubeDim) {
    let bh = p.batch * p.heads;
    assert!(
        bh <= 65_535,
        "attention: batch × heads {bh} exceeds one launch's 65,535 cubes along y"
    );
    (
        CubeCount::Static(rows.div_ceil(block).max(1) as u32, bh as u32, 1),
        CubeDim::new_1d(UNITS),
    )
}

/// The operands of one call: the tensors and where their heads live.
pub(super) struct Operands<R: CubeRuntime> {
    pub q: (CubeTensor<R>, Heads),
    pub k: (CubeTensor<R>, Heads),
    pub v: (CubeTensor<R>, Heads),
}

/// Forward into `output` (laid out as `o_l`) and `lse` (f32, laid out as `s_l`).
pub(super) fn forward_into<R: CubeRuntime>(
    ops: &Operands<R>,
    p: &Problem,
    output: (&CubeTensor<R>, Heads),
    lse: (&CubeTensor<R>, Heads),
) {
    let q = &ops.q.0;
    let tiles = Tiles::choose(q, Pass::Forward, p.head_dim);
    let (count, dim) = launch_dims(p.seq_q, tiles.bq, p);
    flash_forward_kernel::launch::<R>(
        &q.client,
        count,
        dim,
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
        p.heads as u32,
        p.kv_group as u32,
        p.seq_q as u32,
        p.seq_k as u32,
        p.q_offset as i32,
        p.scale,
        tiles.bq,
        tiles.bk,
        p.head_dim,
        p.causal,
        tiles.cmma,
        q.dtype.into(),
    );
    launched(1);
}

/// The problem of `q` `[b, h, t, d]` and `k` `[b, h_kv, s, d]`.
pub(super) fn problem<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    scale: f64,
    causal: bool,
) -> Problem {
    let [b, h, sq, d] = q.shape().dims::<4>();
    let [kb, kh, sk, kd] = k.shape().dims::<4>();
    assert!(
        b == kb && d == kd && kh > 0 && h.is_multiple_of(kh),
        "attention: q {:?} and k {:?} differ in batch or head_dim, or the query heads are not a \
         multiple of the key/value heads",
        q.shape(),
        k.shape()
    );
    assert!(
        !causal || sq == sk,
        "causal attention needs as many queries as keys ({sq} vs {sk})"
    );
    Problem {
        batch: b,
        heads: h,
        kv_group: h / kh,
        seq_q: sq,
        seq_k: sk,
        head_dim: d,
        scale: scale as f32,
        causal,
        q_offset: 0,
    }
}

/// `(output, lse)` of `q`, `k`, `v` `[b, h, t, d]`: output `[b, h, t, d]`, lse `[b, h, t]`.
pub(super) fn forward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    scale: f64,
    causal: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [q, k, v] = contiguous([q, k, v]);
    let p = problem(&q, &k, scale, causal);
    let kv_heads = p.heads / p.kv_group;
    let output = empty(&q, q.shape(), q.dtype);
    let lse = empty_f32(&q, [p.batch, p.heads, p.seq_q]);
    let ops = Operands {
        q: (q, Heads::plain(p.heads, p.seq_q, p.head_dim)),
        k: (k, Heads::plain(kv_heads, p.seq_k, p.head_dim)),
        v: (v, Heads::plain(kv_heads, p.seq_k, p.head_dim)),
    };
    forward_into(
        &ops,
        &p,
        (&output, Heads::plain(p.heads, p.seq_q, p.head_dim)),
        (&lse, Heads::plain(p.heads, p.seq_q, 1)),
    );
    (output, lse)
}

/// The problem and operands of packed `qkv` `[b, t, h, 3·d]` (read in place).
pub(super) fn packed_operands<R: CubeRuntime>(
    qkv: CubeTensor<R>,
    scale: f64,
    causal: bool,
) -> (Operands<R>, Problem) {
    let [qkv] = contiguous([qkv]);
    let [b, t, h, d3] = qkv.shape().dims::<4>();
    assert!(
        d3.is_multiple_of(3),
        "packed attention: last dim {d3} is not 3·head_dim"
    );
    let d = d3 / 3;
    let p = Problem {
        batch: b,
        heads: h,
        kv_group: 1,
        seq_q: t,
        seq_k: t,
        head_dim: d,
        scale: scale as f32,
        causal,
        q_offset: 0,
    };
    let part = |i| (qkv.clone(), Heads::packed(h, t, d, 3, i));
    let ops = Operands {
        q: part(0),
        k: part(1),
        v: part(2),
    };
    (ops, p)
}

/// `(output, lse)` of packed `qkv` `[b, t, h, 3·d]`: output `[b, t, h, d]`, lse `[b, t, h]`.
pub(super) fn forward_packed<R: CubeRuntime>(
    qkv: CubeTensor<R>,
    scale: f64,
    causal: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (ops, p) = packed_operands(qkv, scale, causal);
    let q = &ops.q.0;
    let output = empty(
        q,
        Shape::new([p.batch, p.seq_q, p.heads, p.head_dim]),
        q.dtype,
    );
    let lse = empty_f32(q, [p.batch, p.seq_q, p.heads]);
    forward_into(
        &ops,
        &p,
        (&output, Heads::packed(p.heads, p.seq_q, p.head_dim, 1, 0)),
        (&lse, Heads::packed(p.heads, p.seq_q, 1, 1, 0)),
    );
    (output, lse)
}
