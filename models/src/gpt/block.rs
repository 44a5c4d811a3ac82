//! The GPT-2 block: pre-LayerNorm attention and MLP with residual connections, each through the
//! fused kernels where the backend has them.

use super::*;

impl<B: Backend> Block<B> {
    /// How many parameter tensors the block holds.
    pub(super) fn num_params_tensors(&self) -> usize {
        struct Count(usize);
        impl<B: Backend> burn::module::ModuleVisitor<B> for Count {
            fn visit_float<const D: usize>(&mut self, _: &Param<Tensor<B, D>>) {
                self.0 += 1;
            }
        }
        let mut count = Count(0);
        self.visit(&mut count);
        count.0
    }
}

/// A pre-LayerNorm transformer block.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    /// Norm before attention.
    pub ln_1: LayerNorm<B>,
    /// Causal self-attention.
    pub attn: CausalSelfAttention<B>,
    /// Norm before the MLP.
    pub ln_2: LayerNorm<B>,
    /// The MLP.
    pub mlp: MlpBlock<B>,
    /// Dropout probability while training (attention probabilities, both residual branches).
    pub dropout: f64,
}

/// Multi-head causal self-attention with a fused q/k/v projection.
#[derive(Module, Debug)]
pub struct CausalSelfAttention<B: Backend> {
    /// q, k, v projection `[d, 3d]`, columns grouped by head: `[q₀ k₀ v₀ q₁ k₁ v₁ …]`.
    pub c_attn: Linear<B>,
    /// Output projection `[d, d]`.
    pub c_proj: Linear<B>,
    /// Heads.
    pub n_head: usize,
}

/// The GELU MLP `d -> 4d -> d`.
#[derive(Module, Debug)]
pub struct MlpBlock<B: Backend> {
    /// Up projection.
    pub c_fc: Linear<B>,
    /// Down projection.
    pub c_proj: Linear<B>,
    /// Which GELU.
    #[module(skip)]
    pub gelu: Gelu,
}

impl<B: FusedOps> CausalSelfAttention<B> {
    /// `[b, t, d] -> [b, t, d]` (no dropout).
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.forward_with(0, x, 0.0, &Inference)
    }

    /// Layer `layer`'s attention, its core through the hooks (recomputed under the selective
    /// policy while training), dropout `p` on the probabilities while training.
    pub fn forward_with<'a, H: ForwardHooks<'a, B>>(
        &self,
        layer: usize,
        x: Tensor<B, 3>,
        p: f64,
        hooks: &H,
    ) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        let (h, hd) = (self.n_head, d / self.n_head);
        // `c_attn`'s columns are grouped by head (q, k, v of head 0, then of head 1, …), so a
        // column-parallel split gives each rank whole heads and the split below stays local.
        let qkv = dense(&self.c_attn, x).reshape([b, t, h, 3 * hd]);
        let scale = 1.0 / (hd as f64).sqrt();
        let y = hooks.attention_qkv(layer, qkv, scale, true, p);
        dense(&self.c_proj, y.reshape([b, t, d]))
    }
}

impl<B: FusedOps> MlpBlock<B> {
    /// `[b, t, d] -> [b, t, d]`. With fused kernels, the up projection's bias and the GELU
    /// (either form) are one kernel.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let tanh = self.gelu == Gelu::Tanh;
        let h = match (&self.c_fc.bias, B::FUSED.gelu_bias) {
            (Some(bias), true) => ops::gelu_bias(
                wildfire_kernels::gemm::linear_layer(x, self.c_fc.weight.val(), None),
                bias.val(),
                tanh,
            ),
            _ if tanh => activation::gelu_approximate(dense(&self.c_fc, x)),
            _ => activation::gelu(dense(&self.c_fc, x)),
        };
        dense(&self.c_proj, h)
    }
}

/// LayerNorm's ε in every GPT block.
pub const LN_EPSILON: f64 = 1e-5;

/// `ln(x)`: the fused kernel where the backend has one, Burn's `LayerNorm` otherwise.
pub(super) fn layer_norm<B: FusedOps>(ln: &LayerNorm<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
    match (&ln.beta, B::FUSED.layer_norm) {
        (Some(beta), true) => ops::layer_norm(x, ln.gamma.val(), beta.val(), LN_EPSILON),
        _ => ln.forward(x),
    }
}

impl<B: FusedOps> Block<B> {
    /// `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))` (no dropout).
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.forward_with(0, x, &Inference)
    }

    /// Block `layer` with dropout on the residual branches while training.
    pub fn forward_with<'a, H: ForwardHooks<'a, B>>(
        &self,
        layer: usize,
        x: Tensor<B, 3>,
        hooks: &H,
    ) -> Tensor<B, 3> {
        let p = self.dropout;
        let h = self
            .attn
            .forward_with(layer, layer_norm(&self.ln_1, x.clone()), p, hooks);
        let x = x + hooks.dropout(layer, 1, h, p);
        let h = self.mlp.forward(layer_norm(&self.ln_2, x.clone()));
        x + hooks.dropout(layer, 2, h, p)
    }
}
