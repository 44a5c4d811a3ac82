//! The key/value cache of generation: a model's forward through [`KvCache`] attends its new
//! tokens' queries over every key and value the cache holds, so a generated token costs one
//! position's forward instead of the whole context's.

use burn::prelude::*;
use std::cell::RefCell;
use std::collections::BTreeMap;
use wildfire_kernels::FusedOps;
use wildfire_kernels::hooks::ForwardHooks;
use wildfire_kernels::ops;

/// Forward hooks that keep every layer's keys and values (`[b, kv_heads, len, hd]`, after the
/// rotary positions where the model has them) and continue the positions after them. Hand it to
/// [`CausalLm::forward_with`](crate::CausalLm::forward_with) (or a pipeline stage's) with the
/// tokens the cache does not hold yet: the first call (the prompt) is the plain causal forward;
/// each later one's queries see every cached key and their own tokens' up to themselves. No
/// dropout, nothing recomputed (the [`Inference`](wildfire_kernels::hooks::Inference)
/// forward's). A stage's cache holds its own layers only.
///
/// The cache only grows: a model with learned positions cannot go past its context, and past it
/// the window of the last `block_size` tokens moves by one position a token, changing every
/// position's embedding, so a generation starts the cache again ([`KvCache::clear`]) there.
/// A mixture of experts routes each call's tokens alone: under a capacity factor no single
/// token is dropped, where a forward over the whole context could drop some.
#[derive(Debug)]
pub struct KvCache<B: Backend> {
    layers: RefCell<BTreeMap<usize, [Tensor<B, 4>; 2]>>,
    /// Whether the head computes the last position's logits only ([`KvCache::last_logits`]).
    last_only: bool,
}

impl<B: Backend> Default for KvCache<B> {
    fn default() -> Self {
        Self {
            layers: RefCell::new(BTreeMap::new()),
            last_only: false,
        }
    }
}

impl<B: Backend> KvCache<B> {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// This cache, with the head computing the logits of each call's last position only
    /// (`[b, 1, vocab]`): what sampling needs; a prompt of `t` tokens then costs one row of
    /// the head's product instead of `t` (on GPT-2 124M's shape the head is a third of a
    /// forward's products).
    pub fn last_logits(mut self) -> Self {
        self.last_only = true;
        self
    }

    /// The positions the cache holds (every layer holds as many after a complete forward).
    pub fn len(&self) -> usize {
        let layers = self.layers.borrow();
        layers.values().next().map_or(0, |[k, _]| k.dims()[2])
    }

    /// Whether the cache holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forget every position.
    pub fn clear(&self) {
        self.layers.borrow_mut().clear();
    }

    /// Layer `layer`'s keys and values with `k`, `v` (`[b, kv_heads, t, hd]`) appended, and the
    /// positions it held before them.
    fn append(&self, layer: usize, k: Tensor<B, 4>, v: Tensor<B, 4>) -> (usize, [Tensor<B, 4>; 2]) {
        let mut layers = self.layers.borrow_mut();
        let (past, all) = match layers.remove(&layer) {
            None => (0, [k, v]),
            Some([pk, pv]) => (
                pk.dims()[2],
                [Tensor::cat(vec![pk, k], 2), Tensor::cat(vec![pv, v], 2)],
            ),
        };
        layers.insert(layer, all.clone());
        (past, all)
    }
}

/// A key, value, query or output tensor `[b, heads, t, hd]` (packed: `[b, t, h, 3·hd]`).
type T4<B> = Tensor<B, 4>;

/// The dropout argument is 0 in generation: nothing is dropped.
impl<B: FusedOps> ForwardHooks<'_, B> for KvCache<B> {
    fn positions(&self, _device: &B::Device, len: usize) -> Vec<usize> {
        let past = self.len();
        (past..past + len).collect()
    }

    fn head_input(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let t = x.dims()[1];
        if self.last_only && t > 1 {
            x.narrow(1, t - 1, 1)
        } else {
            x
        }
    }

    fn attention_qkv(&self, layer: usize, qkv: T4<B>, scale: f64, causal: bool, _: f64) -> T4<B> {
        assert!(causal, "a key/value cache serves causal attention only");
        let [q, k, v] = ops::split_qkv(qkv.clone());
        let (past, [k, v]) = self.append(layer, k, v);
        if past == 0 {
            // The prompt: the plain forward's packed attention.
            return ops::attention_qkv(qkv, scale, true);
        }
        attend(q, k, v, past, scale).swap_dims(1, 2)
    }

    fn attention_heads(&self, layer: usize, qkv: [T4<B>; 3], scale: f64, c: bool, _: f64) -> T4<B> {
        assert!(c, "a key/value cache serves causal attention only");
        let [q, k, v] = qkv;
        let (past, [k, v]) = self.append(layer, k, v);
        if past == 0 {
            // The prompt: the keys and values are its own.
            return ops::attention(q, k, v, scale, true);
        }
        attend(q, k, v, past, scale)
    }
}

/// Queries `q` `[b, h, t, hd]` at positions `past..past + t` over keys and values
/// `[b, kv_heads, past + t, hd]`: query `i` sees keys `0..=past + i`. One new token (generation's
/// every step after the prompt) sees them all; several are taken one at a time.
fn attend<B: FusedOps>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    past: usize,
    scale: f64,
) -> Tensor<B, 4> {
    let t = q.dims()[2];
    if t == 1 {
        return ops::attention(q, k, v, scale, false);
    }
    let rows = (0..t)
        .map(|i| {
            let seen = past + i + 1;
            ops::attention(
                q.clone().narrow(2, i, 1),
                k.clone().narrow(2, 0, seen),
                v.clone().narrow(2, 0, seen),
                scale,
                false,
            )
        })
        .collect();
    Tensor::cat(rows, 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CausalLm;
    use crate::gpt::{Gelu, GptConfig};
    use crate::llama::LlamaConfig;
    use crate::lm::{TokenSampler, generate_cached, ids};
    use burn::backend::Flex;

    /// The last position's logits of a forward over `window` without a cache.
    fn window_logits<M: CausalLm<Flex>>(model: &M, window: &[u32]) -> Vec<f32> {
        let t = window.len();
        let logits = model.forward(ids(window, &Default::default()));
        logits.narrow(1, t - 1, 1).into_data().to_vec().unwrap()
    }

    /// A cached generation of `model` (context `block`): at every step the logits equal a
    /// forward over the window without a cache (the prompt's bitwise: the same forward), past
    /// the context too; several tokens handed to a filled cache at once give every position's
    /// logits of the whole forward; and the seeded sample is the one a generation without a
    /// cache draws.
    fn follows_the_uncached_forward<M: CausalLm<Flex>>(model: &M, block: usize, what: &str) {
        let device = Default::default();
        let cache = KvCache::new();
        let mut worst = 0f32;
        let mut history = Vec::new();
        generate_cached(&[5, 9, 2], 2 * block, block, &[], |feed, fresh| {
            if fresh {
                cache.clear();
            }
            let t = feed.len();
            let held = cache.len();
            let logits = model.forward_with(ids(feed, &device), &cache);
            assert_eq!(
                cache.len(),
                held + t,
                "{what}: the cache holds the fed tokens"
            );
            let got: Vec<f32> = logits.narrow(1, t - 1, 1).into_data().to_vec().unwrap();
            // The window the cache now holds ends with `feed`; without a cache the generation
            // forwards exactly that window.
            let window = cache_window(&cache, feed, &mut history);
            let want = window_logits(model, &window);
            if fresh {
                assert_eq!(got, want, "{what}: a fresh forward is the plain one");
            }
            worst = worst.max(crate::largest_difference(&got, &want));
            // Greedy: the next token is the argmax.
            let best = (0..got.len()).max_by(|&a, &b| got[a].total_cmp(&got[b]));
            Ok::<_, ()>(best.unwrap() as u32)
        })
        .unwrap();
        assert!(
            worst <= 2e-5,
            "{what}: cached logits {worst:e} off the window's"
        );

        // Three tokens at once after a prompt of four: each sees the cache and the tokens before
        // it.
        let tokens = [3u32, 1, 4, 1, 5, 9, 2];
        cache.clear();
        let _ = model.forward_with(ids(&tokens[..4], &device), &cache);
        let got: Vec<f32> = model
            .forward_with(ids(&tokens[4..], &device), &cache)
            .into_data()
            .to_vec()
            .unwrap();
        let whole: Vec<f32> = model
            .forward(ids(&tokens, &device))
            .narrow(1, 4, 3)
            .into_data()
            .to_vec()
            .unwrap();
        let off = crate::largest_difference(&got, &whole);
        assert!(off <= 2e-5, "{what}: three tokens at once {off:e} off");

        // A cache for sampling: each call's last position only, the prompt's too.
        let last = KvCache::new().last_logits();
        for (feed, upto) in [(&tokens[..4], 4), (&tokens[4..], 7)] {
            let logits = model.forward_with(ids(feed, &device), &last);
            assert_eq!(logits.dims()[1], 1, "{what}: the last position only");
            let got: Vec<f32> = logits.into_data().to_vec().unwrap();
            let off = crate::largest_difference(&got, &window_logits(model, &tokens[..upto]));
            assert!(
                off <= 2e-5,
                "{what}: last logits after {upto} tokens {off:e} off"
            );
        }

        // The seeded sample with the cache, against one without.
        let sampled = model.sample(
            &[5, 9],
            2 * block,
            block,
            TokenSampler::new(0.8, 8, 3),
            &device,
        );
        let mut sampler = TokenSampler::new(0.8, 8, 3);
        let mut plain = vec![5u32, 9];
        for _ in 0..2 * block {
            let window = &plain[plain.len().saturating_sub(block)..];
            let token = sampler.pick(&window_logits(model, window));
            plain.push(token);
        }
        assert_eq!(sampled, plain, "{what}: the seeded sample");
    }

    /// The tokens a cache holds after a forward of `feed`, recorded across calls: the window a
    /// forward without a cache reads at this step.
    fn cache_window(cache: &KvCache<Flex>, feed: &[u32], history: &mut Vec<u32>) -> Vec<u32> {
        if cache.len() == feed.len() {
            history.clear();
        }
        history.extend_from_slice(feed);
        history.clone()
    }

    #[test]
    fn a_cached_gpt_generation_follows_the_uncached_forward() {
        let config = GptConfig {
            vocab_size: 64,
            block_size: 12,
            n_layer: 2,
            n_head: 2,
            n_embd: 32,
            init_seed: 7,
            dropout: 0.0,
            vocab_used: None,
            gelu: Gelu::Tanh,
        };
        let model = config.init::<Flex>(&Default::default()).unwrap();
        follows_the_uncached_forward(&model, 12, "gpt");
    }

    /// Grouped-query attention (4 query heads over 2) with rotary positions, and a mixture of
    /// experts in every other block (dropless).
    #[test]
    fn a_cached_llama_generation_follows_the_uncached_forward() {
        for (config, what) in [
            (LlamaConfig::tiny(64), "llama"),
            (LlamaConfig::tiny_moe(64), "llama-moe"),
        ] {
            let config = LlamaConfig {
                n_layer: 2,
                d_model: 32,
                ffn_hidden: 64,
                block_size: 12,
                ..config
            };
            let model = config.init::<Flex>(&Default::default()).unwrap();
            follows_the_uncached_forward(&model, 12, what);
        }
    }
}
