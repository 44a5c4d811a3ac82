//! What flash attention's kernels and host code share: where the heads of an operand live
//! ([`Heads`]: an offset and batch, head and token strides, the head dimension contiguous), the
//! shape of a call ([`Problem`]) and the device-side index helpers (visibility under the causal
//! mask, a cube's head, a head's first element, the last key a query block sees).

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

/// The first query block (of `bq` queries) that sees key `k_start`: 0, or when causal the block of
/// query `k_start − q_offset`.
#[cube]
pub(super) fn first_query_block(
    k_start: usize,
    q_offset: i32,
    #[comptime] bq: usize,
    #[comptime] causal: bool,
) -> usize {
    let mut first = 0usize;
    if comptime!(causal) {
        let q_first = i32::cast_from(k_start) - q_offset;
        first = usize::cast_from(i32::max(q_first, 0)) / bq;
    }
    first
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
