//! Layout changes between packed `[b, t, h, 3·hd]` projections and the `[b, h, t, hd]` heads of
//! [`FusedOps::fused_attention`].

use crate::{AttentionOutput, FusedOps};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive, backend::Backend};

fn t<B: Backend, const D: usize>(x: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

fn p<B: Backend, const D: usize>(x: Tensor<B, D>) -> FloatTensor<B> {
    x.into_primitive().tensor()
}

/// `[b, t, h, 3·hd]` → q, k, v `[b, h, t, hd]`.
pub fn split<B: Backend>(qkv: FloatTensor<B>) -> [FloatTensor<B>; 3] {
    crate::ops::split_qkv(t::<B, 4>(qkv)).map(p)
}

/// Dims 1 and 2 swapped: heads `[b, h, t, hd]` ↔ `[b, t, h, hd]`, and log-sum-exps
/// `[b, h, t]` ↔ `[b, t, h]`.
pub fn swap_heads<B: Backend, const D: usize>(x: FloatTensor<B>) -> FloatTensor<B> {
    p(t::<B, D>(x).swap_dims(1, 2))
}

/// dq, dk, dv `[b, h, t, hd]` → `[b, t, h, 3·hd]`.
pub fn join<B: Backend>(grads: [FloatTensor<B>; 3]) -> FloatTensor<B> {
    let parts = grads.map(|g| t::<B, 4>(swap_heads::<B, 4>(g))).to_vec();
    p(Tensor::cat(parts, 3))
}

/// [`FusedOps::fused_attention_qkv`] through [`FusedOps::fused_attention`]: split, attend,
/// heads back to the last-but-one place.
pub fn attention<B: FusedOps>(qkv: FloatTensor<B>, scale: f64, causal: bool) -> AttentionOutput<B> {
    let [q, k, v] = split::<B>(qkv);
    let out = B::fused_attention(q, k, v, scale, causal);
    AttentionOutput {
        output: swap_heads::<B, 4>(out.output),
        lse: swap_heads::<B, 3>(out.lse),
    }
}

/// [`FusedOps::fused_attention_qkv_backward`] through
/// [`FusedOps::fused_attention_backward`].
pub fn attention_backward<B: FusedOps>(
    qkv: FloatTensor<B>,
    output: FloatTensor<B>,
    lse: FloatTensor<B>,
    d_output: FloatTensor<B>,
    scale: f64,
    causal: bool,
) -> FloatTensor<B> {
    let [q, k, v] = split::<B>(qkv);
    let g = B::fused_attention_backward(
        q,
        k,
        v,
        swap_heads::<B, 4>(output),
        swap_heads::<B, 3>(lse),
        swap_heads::<B, 4>(d_output),
        scale,
        causal,
    );
    join::<B>([g.q, g.k, g.v])
}
