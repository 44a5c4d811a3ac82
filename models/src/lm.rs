//! What a causal language model offers a trainer, whatever its family ([`crate::gpt::Gpt`],
//! [`crate::llama::Llama`]): logits through the trainer's hooks, the loss, and sampling.

mod cache;
mod sample;

pub use cache::KvCache;
pub use sample::TokenSampler;
pub(crate) use sample::{generate_cached, ids};

use burn::module::AutodiffModule;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::prelude::*;
use wildfire_kernels::FusedOps;
use wildfire_kernels::hooks::{ForwardHooks, Inference};
use wildfire_kernels::ops;
use wildfire_parallel::Distributed;

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

    /// `prompt` (`[0]` when empty) continued by `new_tokens` tokens (fewer when one of the
    /// sampler's stop tokens comes, the text's last), each sampled by `sampler`
    /// (seeded: a sample is reproducible) from the logits of the last `block_size` tokens. The
    /// forward runs through a key/value cache ([`KvCache`]): within the context a token costs
    /// one position's forward.
    fn sample(
        &self,
        prompt: &[u32],
        new_tokens: usize,
        block_size: usize,
        mut sampler: TokenSampler,
        device: &B::Device,
    ) -> Vec<u32> {
        let cache = KvCache::new().last_logits();
        let stop = sampler.stop_tokens().to_vec();
        // A token's forward is a few dozen parallel products of tens to hundreds of
        // microseconds each on a CPU backend: the pool's other workers look for work between
        // them instead of being woken for each (a futex wake-up cost a 768 × 768 product of one
        // row more than the product itself).
        let _busy = wildfire_parallel::busy_workers_for::<B>();
        let next = |feed: &[u32], fresh: bool| {
            if fresh {
                cache.clear();
            }
            let logits = self.forward_with(ids(feed, device), &cache);
            let logits: Vec<f32> = logits.into_data().convert::<f32>().to_vec().unwrap();
            Ok::<_, std::convert::Infallible>(sampler.pick(&logits))
        };
        match generate_cached(prompt, new_tokens, block_size, &stop, next) {
            Ok(tokens) => tokens,
            Err(never) => match never {},
        }
    }
}

/// A linear layer's `x · W + b` through
/// [`gemm::linear_layer`](wildfire_kernels::gemm::linear_layer): on a plain backend whose
/// products this engine runs (Flex, CUDA) the input's rows as one matrix, Burn's
/// `Linear::forward` elsewhere.
pub(crate) fn dense<B: Backend, const D: usize>(
    layer: &burn::nn::Linear<B>,
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    wildfire_kernels::gemm::linear_layer(
        x,
        layer.weight.val(),
        layer.bias.as_ref().map(|b| b.val()),
    )
}

/// The logit of a padded vocabulary entry: far enough below any real logit that its
/// probability is exactly 0 in f32, f16 and bf16, and finite in all three.
pub const PADDED_LOGIT: f32 = -1e4;

/// Logits `x · tableᵀ` for a `[vocab, d]` table (a tied token table, or an output head kept in
/// the same orientation), the columns past the `used` tokens that exist set to
/// [`PADDED_LOGIT`] (one add of a constant row; none without padding).
pub(crate) fn table_logits<B: Backend>(
    x: Tensor<B, 3>,
    table: Tensor<B, 2>,
    used: usize,
) -> Tensor<B, 3> {
    let vocab = table.dims()[0];
    let logits = wildfire_kernels::gemm::linear_layer(x, table.transpose(), None);
    if used >= vocab {
        return logits;
    }
    let mut row = vec![0f32; vocab];
    row[used..].fill(PADDED_LOGIT);
    let mask = Tensor::<B, 1>::from_data(TensorData::new(row, [vocab]), &logits.device())
        .cast(logits.dtype())
        .reshape([1, 1, vocab]);
    logits.add(mask)
}

/// A [`CausalLm`] trained on `Autodiff<Distributed<B>>` whose inner module (evaluation,
/// generation) is one too: what a training loop over a whole model takes.
pub trait DistributedLm<B: FusedOps>:
    AutodiffModule<Ad<B>, InnerModule: CausalLm<Distributed<B>>> + CausalLm<Ad<B>> + 'static
{
}

impl<B: FusedOps, M> DistributedLm<B> for M where
    M: AutodiffModule<Ad<B>, InnerModule: CausalLm<Distributed<B>>> + CausalLm<Ad<B>> + 'static
{
}

type Ad<B> = burn::backend::Autodiff<Distributed<B>>;

/// Whether the parameter at `path` (the whole model's, or a pipeline stage's) is a table: the
/// token or position embedding, or the output head (`wte`, `wpe`, `embed_tokens`, `lm_head` in
/// both families). Muon leaves them to AdamW.
pub fn is_table(path: &str) -> bool {
    matches!(
        path.split('.').next(),
        Some("wte" | "wpe" | "embed_tokens" | "lm_head")
    )
}

/// Mean cross-entropy of `logits` `[b, t, vocab]` against `targets` `[b, t]`: the fused kernel
/// where the backend has one (loss and log-sum-exp in one pass over the logits, the backward
/// writing their gradient in one more, never materialising the probabilities), Burn's otherwise.
pub fn cross_entropy<B: FusedOps>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
) -> Tensor<B, 1> {
    let [b, t, vocab] = logits.dims();
    if B::FUSED.cross_entropy {
        return ops::cross_entropy_mean(logits.reshape([b * t, vocab]), targets.reshape([b * t]));
    }
    CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits.reshape([b * t, vocab]), targets.reshape([b * t]))
}
