//! The SwiGLU MLP (Shazeer 2020) of the Llama family, and the experts of a mixture of experts.

use burn::nn::Linear;
use burn::prelude::*;
use burn::tensor::activation;
use wildfire_kernels::{FusedOps, ops};

use crate::lm::dense;

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
        let (gate, up) = (dense(&self.gate_proj, x.clone()), dense(&self.up_proj, x));
        let h = if B::FUSED.swiglu {
            ops::swiglu(gate, up)
        } else {
            activation::silu(gate) * up
        };
        dense(&self.down_proj, h)
    }
}
