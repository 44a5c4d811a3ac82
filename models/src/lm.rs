//! What a causal language model offers a trainer, whatever its family ([`crate::gpt::Gpt`],
//! [`crate::llama::Llama`]): logits through the trainer's hooks, the loss, and sampling.

use crate::gpt::{TokenSampler, cross_entropy, generate_by};
use burn::prelude::*;
use wildfire_kernels::FusedOps;
use wildfire_kernels::hooks::{ForwardHooks, Inference};

/// A causal language model: token ids in, next-token logits out.
pub trait CausalLm<B: FusedOps> {
    /// Logits `[b, t, vocab]` for token ids `[b, t]` through the trainer's hooks (the training
    /// step's `Recomputer`: blocks recomputed per its policy, dropout while training).
    fn forward_with<'a, H: ForwardHooks<'a, B>>(
        &self,
        idx: Tensor<B, 2, Int>,
        hooks: &H,
    ) -> Tensor<B, 3>;

    /// Logits without hooks (evaluation, generation): no dropout, nothing recomputed.
    fn forward(&self, idx: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.forward_with(idx, &Inference)
    }

    /// Mean cross-entropy of next-token prediction: `inputs` and `targets` are `[b, t]`.
    fn loss(&self, inputs: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        self.loss_with(inputs, targets, &Inference)
    }

    /// [`loss`](Self::loss) through the trainer's hooks.
    fn loss_with<'a, H: ForwardHooks<'a, B>>(
        &self,
        inputs: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
        hooks: &H,
    ) -> Tensor<B, 1> {
        cross_entropy(self.forward_with(inputs, hooks), targets)
    }

    /// `prompt` (`[0]` when empty) continued by `new_tokens` tokens, each sampled by `sampler`
    /// (seeded: a sample is reproducible) from the logits of the last `block_size` tokens.
    fn sample(
        &self,
        prompt: &[u32],
        new_tokens: usize,
        block_size: usize,
        mut sampler: TokenSampler,
        device: &B::Device,
    ) -> Vec<u32> {
        let next = |context: Vec<i64>| {
            let t = context.len();
            let idx = Tensor::<B, 2, Int>::from_data(TensorData::new(context, [1, t]), device);
            let logits = self.forward(idx).narrow(1, t - 1, 1);
            let logits: Vec<f32> = logits.into_data().convert::<f32>().to_vec().unwrap();
            Ok::<_, std::convert::Infallible>(sampler.pick(&logits))
        };
        match generate_by(prompt, new_tokens, block_size, next) {
            Ok(tokens) => tokens,
            Err(never) => match never {},
        }
    }
}
