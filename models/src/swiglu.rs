//! The SwiGLU MLP (Shazeer 2020) of the Llama family, and the experts of a mixture of experts.

use burn::nn::Linear;
use burn::prelude::*;
use burn::tensor::activation;
use wildfire_kernels::{FusedOps, ops};

/// The SwiGLU MLP: `down(silu(gate(x)) ⊙ up(x))`.
#[derive(Module, Debug)]
pub struct SwiGlu<B: Backend> {
    /// Gate projection `[d, ffn]`.
    pub gate_proj: Linear<B>,
    /// Up projection `[d, ffn]`.
    pub up_proj: Linear<B>,
    /// Down projection `[ffn, d]`.
    pub down_proj: Linear<B>,
}

impl<B: FusedOps> SwiGlu<B> {
    /// `[b, t, d] -> [b, t, d]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let (gate, up) = (self.gate_proj.forward(x.clone()), self.up_proj.forward(x));
        let h = if B::FUSED.swiglu {
            ops::swiglu(gate, up)
        } else {
            activation::silu(gate) * up
        };
        self.down_proj.forward(h)
    }
}
