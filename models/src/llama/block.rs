//! The Llama block: pre-RMSNorm grouped-query attention with rotary positions and a SwiGLU MLP,
//! residual connections around both, no biases.

use super::rope::apply_rope;
use crate::lm::dense;
use crate::moe::MoeMlp;
pub use crate::swiglu::SwiGlu;
use burn::module::Param;
use burn::nn::{Linear, RmsNorm};
use burn::prelude::*;
use wildfire_kernels::hooks::{Auxiliary, ForwardHooks, Inference};
use wildfire_kernels::{FusedOps, ops};

/// A pre-RMSNorm Llama block.
#[derive(Module, Debug)]
pub struct LlamaBlock<B: Backend> {
    /// Norm before attention.
    pub input_layernorm: RmsNorm<B>,
    /// Grouped-query self-attention.
    pub self_attn: LlamaAttention<B>,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm<B>,
    /// The SwiGLU MLP of a dense block.
    pub mlp: Option<SwiGlu<B>>,
    /// The mixture of experts of a sparse block (instead of `mlp`).
    pub moe: Option<MoeMlp<B>>,
}

/// Causal grouped-query self-attention: `n_head` query heads share `n_kv_head` key/value heads
/// (each key/value head serves `n_head / n_kv_head` consecutive query heads), rotary positions
/// on queries and keys.
#[derive(Module, Debug)]
pub struct LlamaAttention<B: Backend> {
    /// Query projection `[d, n_head·hd]`.
    pub q_proj: Linear<B>,
    /// Key projection `[d, n_kv_head·hd]`.
    pub k_proj: Linear<B>,
    /// Value projection `[d, n_kv_head·hd]`.
    pub v_proj: Linear<B>,
    /// Output projection `[n_head·hd, d]`.
    pub o_proj: Linear<B>,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads.
    pub n_kv_head: usize,
}

/// `norm(x)`: the fused RMSNorm kernel where the backend has one ([`FusedOps::FUSED`]), Burn's
/// `RmsNorm` otherwise.
pub(super) fn rms_norm<B: FusedOps>(norm: &RmsNorm<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
    if B::FUSED.rms_norm {
        ops::rms_norm(x, norm.gamma.val(), norm.epsilon)
    } else {
        norm.forward(x)
    }
}

/// A bias-free linear layer with weight `[d_in, d_out]` (Burn's layout).
pub(super) fn linear<B: Backend>(weight: Tensor<B, 2>) -> Linear<B> {
    Linear {
        weight: Param::from_tensor(weight),
        bias: None,
    }
}

impl<B: FusedOps> LlamaAttention<B> {
    /// `[b, t, d] -> [b, t, d]` with rotary tables `cos`, `sin` (`[t, hd]`), the core
    /// through the hooks (the flash kernel where the backend has one; recomputed under the
    /// selective policy while training).
    pub fn forward_with<'a, H: ForwardHooks<'a, B>>(
        &self,
        layer: usize,
        x: Tensor<B, 3>,
        [cos, sin]: &[Tensor<B, 2>; 2],
        hooks: &H,
    ) -> Tensor<B, 3> {
        let [b, t, _] = x.dims();
        let (h, kv) = (self.n_head, self.n_kv_head);
        let hd = self.q_proj.weight.dims()[1] / h;
        let heads = |proj: &Linear<B>, n: usize| {
            dense(proj, x.clone())
                .reshape([b, t, n, hd])
                .swap_dims(1, 2)
        };
        let q = apply_rope(heads(&self.q_proj, h), cos, sin);
        let k = apply_rope(heads(&self.k_proj, kv), cos, sin);
        let v = heads(&self.v_proj, kv);
        let scale = 1.0 / (hd as f64).sqrt();
        // The key/value heads as they are: the attention reads each for its group of query heads
        // (the flash kernels in place; Burn's ops repeat them).
        let y = hooks.attention_heads(layer, [q, k, v], scale, true, 0.0);
        dense(&self.o_proj, y.swap_dims(1, 2).reshape([b, t, h * hd]))
    }
}

impl<B: FusedOps> LlamaBlock<B> {
    /// `x + attn(norm(x))`, then `x + mlp(norm(x))`, without hooks.
    pub fn forward(&self, x: Tensor<B, 3>, rope: &[Tensor<B, 2>; 2]) -> Tensor<B, 3> {
        self.forward_with(0, x, rope, &Inference)
    }

    /// Block `layer` through the hooks.
    pub fn forward_with<'a, H: ForwardHooks<'a, B>>(
        &self,
        layer: usize,
        x: Tensor<B, 3>,
        rope: &[Tensor<B, 2>; 2],
        hooks: &H,
    ) -> Tensor<B, 3> {
        let h = self.self_attn.forward_with(
            layer,
            rms_norm(&self.input_layernorm, x.clone()),
            rope,
            hooks,
        );
        let x = x + h;
        let h = rms_norm(&self.post_attention_layernorm, x.clone());
        let h = match (&self.mlp, &self.moe) {
            (Some(mlp), _) => mlp.forward(h),
            (None, Some(moe)) => {
                // The routing losses ride on the output into backward; the counts go to the
                // trainer.
                let out = moe.forward(h);
                let loss = out.aux_loss + out.z_loss;
                let routing = out.stats;
                hooks.auxiliary_loss(layer, out.output, Auxiliary { loss, routing })
            }
            (None, None) => unreachable!("a block has a dense MLP or a mixture of experts"),
        };
        x + h
    }
}
