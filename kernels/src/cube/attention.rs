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

use super::heads::{Heads, Operands, Problem};
use super::{contiguous, empty, empty_f32, launched};
use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;

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
