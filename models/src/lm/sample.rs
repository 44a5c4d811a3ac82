//! Seeded sampling of the next token.

/// Sampling of the next token from its logits, with `temperature` among the `top_k` most likely,
/// seeded (xorshift): the same logits and seed give the same text, however the logits were
/// computed (one device, or pipeline stages).
#[derive(Clone, Debug)]
pub struct TokenSampler {
    temperature: f32,
    top_k: usize,
    rng: wildfire_parallel::rng::XorShift64,
}

impl TokenSampler {
    /// A sampler seeded with `seed`.
    pub fn new(temperature: f32, top_k: usize, seed: u64) -> Self {
        Self {
            temperature,
            top_k,
            rng: wildfire_parallel::rng::XorShift64::new(seed, 1),
        }
    }

    /// The next token, given the last position's logits over the vocabulary.
    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        // The `top_k` most likely first, ties in vocabulary order: selected, then only those
        // sorted (a whole vocabulary's sort was a few percent of a cached generation's token).
        let most_likely = |&a: &usize, &b: &usize| logits[b].total_cmp(&logits[a]).then(a.cmp(&b));
        let mut order: Vec<usize> = (0..logits.len()).collect();
        let k = self.top_k.clamp(1, order.len().max(1));
        if k < order.len() {
            order.select_nth_unstable_by(k - 1, most_likely);
            order.truncate(k);
        }
        order.sort_unstable_by(most_likely);
        let max = logits[order[0]];
        let weights: Vec<f64> = order
            .iter()
            .map(|&i| (((logits[i] - max) / self.temperature.max(1e-6)) as f64).exp())
            .collect();
        let mut pick = self.rng.next_unit() * weights.iter().sum::<f64>();
        // Should rounding leave `pick` past every weight: the least likely token that can be
        // drawn at all (a masked one, of weight 0, never).
        let last = weights.iter().rposition(|w| *w > 0.0).unwrap_or(0);
        let mut choice = order[last];
        for (&i, w) in order.iter().zip(&weights) {
            if pick < *w {
                choice = i;
                break;
            }
            pick -= w;
        }
        choice as u32
    }
}

/// `prompt` (`[0]` when empty) continued by `new_tokens` tokens, each chosen by `next(feed,
/// fresh)` from a forward over the token ids `feed` through a key/value cache
/// ([`super::KvCache`]), emptied first when `fresh`. Within the context the cache holds every
/// earlier token, so `feed` is the prompt and then one token a step. Past the context (the last
/// `block_size` tokens) the window moves by one position a token, and every position's
/// embedding with it, so each step starts again from the window: the logits a forward over the
/// window alone gives, as a generation without a cache computes them at every step.
pub(crate) fn generate_cached<E>(
    prompt: &[u32],
    new_tokens: usize,
    block_size: usize,
    mut next: impl FnMut(&[u32], bool) -> Result<u32, E>,
) -> Result<Vec<u32>, E> {
    let mut tokens: Vec<u32> = if prompt.is_empty() {
        vec![0]
    } else {
        prompt.to_vec()
    };
    // The tokens the cache holds (a prefix of `tokens`).
    let mut held = 0;
    for _ in 0..new_tokens {
        let len = tokens.len();
        let token = if len <= block_size {
            let token = next(&tokens[held..], held == 0)?;
            held = len;
            token
        } else {
            next(&tokens[len - block_size..], true)?
        };
        tokens.push(token);
    }
    Ok(tokens)
}

/// Token ids `[1, t]` on `device`.
pub(crate) fn ids<B: burn::tensor::backend::Backend>(
    feed: &[u32],
    device: &B::Device,
) -> burn::tensor::Tensor<B, 2, burn::tensor::Int> {
    let ids: Vec<i64> = feed.iter().map(|&t| i64::from(t)).collect();
    burn::tensor::Tensor::from_data(burn::tensor::TensorData::new(ids, [1, feed.len()]), device)
}

#[cfg(test)]
mod tests {
    use super::{TokenSampler, generate_cached};

    /// The selected `top_k` are the first `top_k` of the whole vocabulary sorted by logit
    /// (stable: ties in vocabulary order), so a seed draws the tokens a full sort drew.
    #[test]
    fn the_top_k_are_selected_as_a_full_stable_sort_orders_them() {
        // Few distinct values: many ties, at the boundary of the top k too.
        let logits: Vec<f32> = (0..997).map(|i| ((i * 7919) % 13) as f32 * 0.25).collect();
        for top_k in [1, 2, 5, 64, 997, 5000] {
            let (mut selected, mut full) = (
                TokenSampler::new(0.7, top_k, 3),
                TokenSampler::new(0.7, top_k, 3),
            );
            let mut order: Vec<usize> = (0..logits.len()).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
            order.truncate(top_k);
            for _ in 0..50 {
                let token = selected.pick(&logits);
                // The same draw over the full sort's prefix.
                let max = logits[order[0]];
                let weights: Vec<f64> = order
                    .iter()
                    .map(|&i| ((logits[i] - max) / 0.7) as f64)
                    .map(f64::exp)
                    .collect();
                let mut pick = full.rng.next_unit() * weights.iter().sum::<f64>();
                let expected = order
                    .iter()
                    .zip(&weights)
                    .find(|(_, w)| {
                        let hit = pick < **w;
                        pick -= **w;
                        hit
                    })
                    .map_or(order[order.len() - 1], |(&i, _)| i);
                assert_eq!(token as usize, expected, "top_k {top_k}");
            }
        }
        let greedy = TokenSampler::new(1.0, 1, 0).pick(&[0.5, 2.0, -1.0, 2.0]);
        assert_eq!(greedy, 1, "the first of two equal maxima");
    }

    /// The feeds a generation hands its forward: the prompt, then one token a step while the
    /// context holds them all, then the whole window, fresh, at every step past it.
    #[test]
    fn the_cache_is_fed_new_tokens_within_the_context_and_windows_past_it() {
        let mut feeds = Vec::new();
        let mut next_id = 10;
        let tokens = generate_cached(&[1, 2, 3], 5, 5, |feed, fresh| {
            feeds.push((feed.to_vec(), fresh));
            next_id += 1;
            Ok::<_, ()>(next_id)
        })
        .unwrap();
        assert_eq!(tokens, [1, 2, 3, 11, 12, 13, 14, 15]);
        assert_eq!(
            feeds,
            [
                (vec![1, 2, 3], true),
                (vec![11], false),
                (vec![12], false),
                (vec![2, 3, 11, 12, 13], true),
                (vec![3, 11, 12, 13, 14], true),
            ]
        );
        // An empty prompt is token 0; a prompt past the context is windowed at once.
        let mut feeds = Vec::new();
        generate_cached(&[], 1, 4, |feed, fresh| {
            feeds.push((feed.to_vec(), fresh));
            Ok::<_, ()>(7)
        })
        .unwrap();
        assert_eq!(feeds, [(vec![0], true)]);
        let mut feeds = Vec::new();
        generate_cached(&[1, 2, 3, 4], 1, 2, |feed, fresh| {
            feeds.push((feed.to_vec(), fresh));
            Ok::<_, ()>(7)
        })
        .unwrap();
        assert_eq!(feeds, [(vec![3, 4], true)]);
    }
}
