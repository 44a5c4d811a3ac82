//! Flash attention's operands and host side: the kernels (FlashAttention-2's work split, tensor
//! cores where the device has them) are in [`super::flash`]; the forward saves the log-sum-exp
//! for the backward and skips the causal key blocks above the diagonal entirely.
//!
//! The operands are addressed through [`Heads`] (an offset and batch, head and token strides, the
//! head dimension contiguous), so the same kernels read separate `[b, h, t, d]` tensors and the
//! packed `[b, t, h, 3·d]` projections of a fused q/k/v linear in place, and write the output in
//! either layout: no split, no transpose, no concatenation around the kernels. Key/value heads
//! may be fewer than query heads (grouped-query attention: `kv_group` query heads per key/value
//! head), and queries and keys may start at position offsets (the causal mask compares absolute
//! positions: what context parallelism's blocks need).

use super::{contiguous, empty, empty_f32, launched};
use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

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

/// `Heads` as the kernels' `Sequence<u32>` argument.
pub(super) fn seq_arg<R: CubeRuntime>(heads: &Heads) -> SequenceArg<R, u32> {
    let mut s = SequenceArg::new();
    for x in heads.args() {
        s.push(x);
    }
    s
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
    super::flash::forward(ops, p, output, lse);
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
