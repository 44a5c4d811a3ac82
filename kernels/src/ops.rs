//! The fused operations on Burn tensors, for any backend implementing [`FusedOps`].

use crate::FusedOps;
use burn::tensor::{Int, Tensor, TensorPrimitive};

fn prim<B: FusedOps, const D: usize>(x: Tensor<B, D>) -> burn::tensor::ops::FloatTensor<B> {
    x.into_primitive().tensor()
}

fn tensor<B: FusedOps, const D: usize>(x: burn::tensor::ops::FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

/// `x`, carrying the auxiliary `loss` into backward with weight `weight` (see
/// [`FusedOps::carry_loss`]).
pub fn carry_loss<B: FusedOps, const D: usize, const E: usize>(
    x: Tensor<B, D>,
    loss: Tensor<B, E>,
    weight: f64,
) -> Tensor<B, D> {
    tensor(B::carry_loss(prim(x), prim(loss), weight))
}

/// The rows of `table` `[rows, d]` at `ids` `[batch, seq]`: `[batch, seq, d]`, as Burn's
/// `module::embedding`, with the table's gradient from [`FusedOps::fused_embedding_backward`].
pub fn embedding<B: FusedOps>(table: Tensor<B, 2>, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
    tensor(B::fused_embedding(prim(table), ids.into_primitive()))
}

/// Softmax over the last dimension.
pub fn softmax<B: FusedOps, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    tensor(B::fused_softmax(prim(x)))
}

/// Log-softmax over the last dimension.
pub fn log_softmax<B: FusedOps, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    tensor(B::fused_log_softmax(prim(x)))
}

/// LayerNorm over the last dimension: `(x − mean)/√(var + ε)·γ + β`.
pub fn layer_norm<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    gamma: Tensor<B, 1>,
    beta: Tensor<B, 1>,
    epsilon: f64,
) -> Tensor<B, D> {
    tensor(B::fused_layer_norm(prim(x), prim(gamma), prim(beta), epsilon).output)
}

/// RMSNorm over the last dimension: `x/√(mean(x²) + ε)·γ`.
pub fn rms_norm<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    gamma: Tensor<B, 1>,
    epsilon: f64,
) -> Tensor<B, D> {
    tensor(B::fused_rms_norm(prim(x), prim(gamma), epsilon).output)
}

/// Per-row cross-entropy of `logits` `[rows, vocab]` against `targets` `[rows]` (a negative
/// target is ignored: loss 0, no gradient).
pub fn cross_entropy<B: FusedOps>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
) -> Tensor<B, 1> {
    tensor(B::fused_cross_entropy(prim(logits), targets.into_primitive()).loss)
}

/// Mean cross-entropy over the rows whose target is not ignored.
pub fn cross_entropy_mean<B: FusedOps>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
) -> Tensor<B, 1> {
    let kept = targets.clone().greater_equal_elem(0).int().sum();
    let losses = cross_entropy(logits, targets);
    let dtype = losses.dtype();
    losses.sum() / kept.float().cast(dtype).clamp_min(1.0)
}

/// `gelu(x + bias)`, `bias` broadcast over the last dimension: the erf form, or with `tanh` the
/// tanh approximation (GPT-2's).
pub fn gelu_bias<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    bias: Tensor<B, 1>,
    tanh: bool,
) -> Tensor<B, D> {
    tensor(B::fused_gelu_bias(prim(x), prim(bias), tanh))
}

/// The SwiGLU gate `silu(gate) ⊙ up`, elementwise.
pub fn swiglu<B: FusedOps, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>) -> Tensor<B, D> {
    tensor(B::fused_swiglu(prim(gate), prim(up)))
}

/// Rotary position embedding of `x` `[batch, heads, seq, head_dim]` (Hugging Face's
/// rotate-half convention) with `cos`, `sin` `[seq, head_dim]`, cast to `x`'s dtype where they
/// are not in it.
pub fn rope<B: FusedOps>(x: Tensor<B, 4>, cos: Tensor<B, 2>, sin: Tensor<B, 2>) -> Tensor<B, 4> {
    let dtype = x.dtype();
    let [cos, sin] = [cos, sin].map(|t| if t.dtype() == dtype { t } else { t.cast(dtype) });
    tensor(B::fused_rope(prim(x), prim(cos), prim(sin)))
}

/// Attention `softmax(q·kᵀ·scale)·v` over `[batch, heads, seq, head_dim]`, causal or not.
pub fn attention<B: FusedOps>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    scale: f64,
    causal: bool,
) -> Tensor<B, 4> {
    tensor(B::fused_attention(prim(q), prim(k), prim(v), scale, causal).output)
}

/// Attention on packed projections `qkv` `[b, t, h, 3·hd]` (per head: its queries, keys and
/// values side by side, as a q/k/v projection whose columns are grouped by head gives them):
/// `[b, t, h, hd]`, each head's `softmax(q·kᵀ·scale)·v`. Needs no split of `qkv` and no layout
/// change of the output, forward or backward.
pub fn attention_qkv<B: FusedOps>(qkv: Tensor<B, 4>, scale: f64, causal: bool) -> Tensor<B, 4> {
    tensor(B::fused_attention_qkv(prim(qkv), scale, causal).output)
}

/// Packed projections `[b, t, h, 3·hd]` split into q, k, v `[b, h, t, hd]` (the heads of
/// [`attention`]).
pub fn split_qkv<B: burn::tensor::backend::Backend>(qkv: Tensor<B, 4>) -> [Tensor<B, 4>; 3] {
    let hd = qkv.dims()[3] / 3;
    [0, 1, 2].map(|i| qkv.clone().narrow(3, i * hd, hd).swap_dims(1, 2))
}

/// Expert parallelism's dispatch ([`FusedOps::expert_dispatch`]): this rank's routed rows
/// `[rows, d]`, sorted by expert, as the rows of the experts this rank holds, grouped by expert
/// (`route.groups()` of each).
pub fn expert_dispatch<B: FusedOps>(
    x: Tensor<B, 2>,
    route: &crate::experts::ExpertRoute,
) -> Tensor<B, 2> {
    tensor(B::expert_dispatch(prim(x), route))
}

/// Expert parallelism's combine ([`FusedOps::expert_combine`]): the experts' rows back to this
/// rank's routed rows `[rows, d]`, in their order.
pub fn expert_combine<B: FusedOps>(
    y: Tensor<B, 2>,
    route: &crate::experts::ExpertRoute,
) -> Tensor<B, 2> {
    tensor(B::expert_combine(prim(y), route))
}

/// The experts' grouped matmul ([`FusedOps::grouped_matmul`]): rows `x [rows, k]` in runs of
/// `groups[l]`, run `l` times `w[l]` (`w [groups, k, n]`).
pub fn grouped_matmul<B: FusedOps>(
    x: Tensor<B, 2>,
    w: Tensor<B, 3>,
    groups: &[usize],
) -> Tensor<B, 2> {
    tensor(B::grouped_matmul(prim(x), prim(w), groups))
}
