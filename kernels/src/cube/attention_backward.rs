//! Flash attention backward, FlashAttention-2 style, in two passes that need no atomics
//! (deterministic, and Wgpu has no float atomics):
//!
//! 1. **dQ** — each plane owns queries: `delta = rowsum(dO∘O)` for its rows (written for pass
//!    2), then over the key blocks up to the diagonal: `S = Q·Kᵀ` and `dP = dO·Vᵀ`, then
//!    `P = exp(S·scale − lse)` and `dS = P∘(dP − delta)` in f32 (rounded once), `dQ += dS·K`.
//! 2. **dK, dV** — each plane owns keys, over the query blocks from the diagonal on:
//!    `Sᵀ = K·Qᵀ`, `dPᵀ = V·dOᵀ`, `Pᵀ`, `dSᵀ = Pᵀ∘(dPᵀ − delta)`, `dV += Pᵀ·dO`, `dK += dSᵀ·Q`.
//!
//! No `t × t` buffer exists; the probabilities are recomputed from the forward's log-sum-exp.
//! The kernels are in [`super::flash`]; this file is their host side.

use super::attention::{packed_operands, problem};
use super::heads::{Heads, Operands, Problem};
use super::{Cb, contiguous, empty, empty_f32, launched};
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeRuntime, FloatElement, IntElement};

/// Both passes: dQ into `dq` (laid out `dq_l`), dK and dV into `dkv` (laid out `dk_l`, `dv_l`:
/// per query head, `[b, h, …]`).
#[allow(clippy::too_many_arguments)]
fn backward_into<R: CubeRuntime>(
    ops: &Operands<R>,
    p: &Problem,
    output: (&CubeTensor<R>, Heads),
    d_output: &CubeTensor<R>,
    lse: (&CubeTensor<R>, Heads),
    dq: (&CubeTensor<R>, Heads),
    dkv: &CubeTensor<R>,
    dk_l: Heads,
    dv_l: Heads,
) {
    let delta = empty_f32(&ops.q.0, lse.0.shape());
    super::flash::backward(ops, p, output, d_output, lse, &delta, dq, dkv, dk_l, dv_l);
    launched(2);
}

/// `(dq, dk, dv)` from `[q, k, v, output, lse, d_output]` (`[b, h, t, d]`, lse `[b, h, t]`).
pub(super) fn backward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    operands: [CubeTensor<R>; 6],
    scale: f64,
    causal: bool,
) -> [CubeTensor<R>; 3] {
    let [q, k, v, output, lse, d_output] = contiguous(operands);
    let p = problem(&q, &k, scale, causal);
    let (b, h, sk, d) = (p.batch, p.heads, p.seq_k, p.head_dim);
    let kv_heads = h / p.kv_group;
    let dq = empty(&q, q.shape(), q.dtype);
    // dK and dV of every query head in one buffer `[2, b, h, s, d]` (one writable binding).
    let dkv = empty(&q, Shape::new([2, b, h, sk, d]), q.dtype);
    let ops = Operands {
        q: (q, Heads::plain(h, p.seq_q, d)),
        k: (k, Heads::plain(kv_heads, sk, d)),
        v: (v, Heads::plain(kv_heads, sk, d)),
    };
    let mut dv_l = Heads::plain(h, sk, d);
    dv_l.offset = b * h * sk * d;
    backward_into(
        &ops,
        &p,
        (&output, Heads::plain(h, p.seq_q, d)),
        &d_output,
        (&lse, Heads::plain(h, p.seq_q, 1)),
        (&dq, Heads::plain(h, p.seq_q, d)),
        &dkv,
        Heads::plain(h, sk, d),
        dv_l,
    );
    let half = |i: usize| {
        let t = burn_cubecl::kernel::slice(dkv.clone(), &[i..i + 1, 0..b, 0..h, 0..sk, 0..d]);
        let t = burn_cubecl::ops::reshape(t, Shape::new([b, h, sk, d]));
        group_sum::<R, F, I, BT>(t, [b, kv_heads, p.kv_group, sk, d])
    };
    let (dk, dv) = (half(0), half(1));
    [dq, dk, dv]
}

/// Per-query-head key/value gradients `[b, h, s, d]` summed over each group of `group` query
/// heads into `[b, h / group, s, d]` (grouped-query attention); unchanged when `group` is 1.
fn group_sum<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    t: CubeTensor<R>,
    [b, kv_heads, group, s, d]: [usize; 5],
) -> CubeTensor<R> {
    if group == 1 {
        return t;
    }
    let t = burn_cubecl::ops::reshape(t, Shape::new([b, kv_heads, group, s * d]));
    let summed = Cb::<R, F, I, BT>::float_sum_dim(t, 2);
    burn_cubecl::ops::reshape(summed, Shape::new([b, kv_heads, s, d]))
}

/// The gradient of packed `qkv` `[b, t, h, 3·d]` (written in place, packed like it) from the
/// output `[b, t, h, d]`, its gradient and lse `[b, t, h]`.
pub(super) fn backward_packed<R: CubeRuntime>(
    qkv: CubeTensor<R>,
    output: CubeTensor<R>,
    lse: CubeTensor<R>,
    d_output: CubeTensor<R>,
    scale: f64,
    causal: bool,
) -> CubeTensor<R> {
    let [output, lse, d_output] = contiguous([output, lse, d_output]);
    let (ops, p) = packed_operands(qkv, scale, causal);
    let (h, t, d) = (p.heads, p.seq_q, p.head_dim);
    let dqkv = empty(&ops.q.0, ops.q.0.shape(), ops.q.0.dtype);
    backward_into(
        &ops,
        &p,
        (&output, Heads::packed(h, t, d, 1, 0)),
        &d_output,
        (&lse, Heads::packed(h, t, 1, 1, 0)),
        (&dqkv, Heads::packed(h, t, d, 3, 0)),
        &dqkv,
        Heads::packed(h, t, d, 3, 1),
        Heads::packed(h, t, d, 3, 2),
    );
    dqkv
}
