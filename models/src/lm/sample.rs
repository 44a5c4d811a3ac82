//! Seeded sampling of the next token.

/// Sampling of the next token from its logits: with `temperature` among the `top_k` most likely
/// and, of those, the smallest set whose probabilities add up to `top_p` (nucleus sampling),
/// seeded (xorshift): the same logits and seed give the same text, however the logits were
/// computed (one device, or pipeline stages). The filters apply in `transformers`' order
/// (temperature, top-k, top-p); a temperature of 0 is greedy decoding (the most likely token,
/// the lowest id among equal logits, as `argmax` picks it; no random draw). A generation ends
/// early at one of its stop tokens ([`TokenSampler::with_stop_tokens`]: a model's end-of-text,
/// which `transformers`' `generate` stops at too), that token the last of the text.
#[derive(Clone, Debug)]
pub struct TokenSampler {
    temperature: f32,
    top_k: usize,
    top_p: f64,
    stop: Vec<u32>,
    rng: wildfire_parallel::rng::XorShift64,
}

impl TokenSampler {
    /// A sampler seeded with `seed`: `temperature` (0: greedy) among the `top_k` most likely
    /// tokens (0: the whole vocabulary), no nucleus cut ([`TokenSampler::with_top_p`]).
    ///
    /// # Panics
    /// On a negative or non-finite temperature ([`TokenSampler::check`] says why first).
    pub fn new(temperature: f32, top_k: usize, seed: u64) -> Self {
        if let Err(why) = Self::check(temperature, 1.0) {
            panic!("{why}");
        }
        Self {
            temperature,
            top_k,
            top_p: 1.0,
            stop: Vec::new(),
            rng: wildfire_parallel::rng::XorShift64::new(seed, 1),
        }
    }

    /// This sampler drawing only among the most likely tokens whose probabilities (after the
    /// temperature and the top-k cut) first reach `top_p` in total; 1 keeps them all.
    ///
    /// # Panics
    /// Outside `0 < top_p ≤ 1` ([`TokenSampler::check`] says why first).
    pub fn with_top_p(mut self, top_p: f64) -> Self {
        if let Err(why) = Self::check(self.temperature, top_p) {
            panic!("{why}");
        }
        self.top_p = top_p;
        self
    }

    /// This sampler ending a generation at any of `tokens` (kept as its last token).
    pub fn with_stop_tokens(mut self, tokens: impl IntoIterator<Item = u32>) -> Self {
        self.stop = tokens.into_iter().collect();
        self
    }

    /// The tokens a generation ends at.
    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop
    }

    /// Why `temperature` and `top_p` cannot sample, if they cannot: a temperature is finite and
    /// 0 or more, a nucleus `0 < top_p ≤ 1`.
    pub fn check(temperature: f32, top_p: f64) -> Result<(), String> {
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(format!(
                "a sampling temperature is a finite number, 0 (greedy) or more; got {temperature}"
            ));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(format!(
                "top-p is the share of the probability mass sampled from, above 0 and at most 1; got {top_p}"
            ));
        }
        Ok(())
    }

    /// Whether this sampler decodes greedily (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The next token, given the last position's logits over the vocabulary.
    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        // The `top_k` most likely first, ties in vocabulary order: selected, then only those
        // sorted (a whole vocabulary's sort was a few percent of a cached generation's token).
        let most_likely = |&a: &usize, &b: &usize| logits[b].total_cmp(&logits[a]).then(a.cmp(&b));
        let mut order: Vec<usize> = (0..logits.len()).collect();
        let all = order.len().max(1);
        let k = match self.top_k {
            0 => all,
            k => k.min(all),
        };
        let k = if self.is_greedy() { 1 } else { k };
        if k < order.len() {
            order.select_nth_unstable_by(k - 1, most_likely);
            order.truncate(k);
        }
        order.sort_unstable_by(most_likely);
        if self.is_greedy() {
            return order.first().map_or(0, |&i| i as u32);
        }
        let max = logits[order[0]];
        let mut weights: Vec<f64> = order
            .iter()
            .map(|&i| (((logits[i] - max) / self.temperature) as f64).exp())
            .collect();
        if self.top_p < 1.0 {
            // The nucleus: the most likely tokens up to the first whose running share of the
            // probability reaches `top_p` (that one included; at least one token).
            let total: f64 = weights.iter().sum();
            let mut running = 0.0;
            let kept = weights
                .iter()
                .position(|w| {
                    running += w / total;
                    running >= self.top_p
                })
                .map_or(weights.len(), |i| i + 1);
            order.truncate(kept);
            weights.truncate(kept);
        }
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

/// `prompt` (`[0]` when empty) continued by up to `new_tokens` tokens — fewer when one of
/// `stop` comes, which ends the text — each chosen by `next(feed, fresh)` from a forward over
/// the token ids `feed` through a key/value cache ([`super::KvCache`]), emptied first when
/// `fresh`. Within the context the cache holds every
/// earlier token, so `feed` is the prompt and then one token a step. Past the context (the last
/// `block_size` tokens) the window moves by one position a token, and every position's
/// embedding with it, so each step starts again from the window: the logits a forward over the
/// window alone gives, as a generation without a cache computes them at every step.
pub(crate) fn generate_cached<E>(
    prompt: &[u32],
    new_tokens: usize,
    block_size: usize,
    stop: &[u32],
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
        if stop.contains(&token) {
            break;
        }
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

    /// Temperature 0 is greedy decoding: the largest logit, the lowest id among equal ones,
    /// whatever `top_k` and `top_p` say, and no draw from the generator (the sampler's state
    /// stays where it was).
    #[test]
    fn temperature_zero_takes_the_most_likely_token_without_drawing() {
        let logits = [0.5, 2.0, -1.0, 2.0, 1.9];
        for (top_k, top_p) in [(0, 1.0), (1, 1.0), (3, 0.5), (40, 0.01)] {
            let mut greedy = TokenSampler::new(0.0, top_k, 9).with_top_p(top_p);
            let before = greedy.rng.clone().next_unit();
            assert_eq!(greedy.pick(&logits), 1, "top_k {top_k}, top_p {top_p}");
            assert_eq!(greedy.pick(&[-3.0, -2.5, -2.5]), 1);
            assert_eq!(greedy.rng.next_unit(), before, "no draw");
        }
        // `top_k` 0 is the whole vocabulary: every token is drawn sometimes.
        let mut all = TokenSampler::new(1.0, 0, 1);
        let mut seen = [false; 5];
        for _ in 0..2000 {
            seen[all.pick(&logits) as usize] = true;
        }
        assert_eq!(seen, [true; 5]);
    }

    /// Top-p keeps the most likely tokens up to the first whose running probability reaches
    /// `p` (after the temperature and the top-k cut), and draws among them in proportion to
    /// their probabilities: checked against the nucleus written out by hand and the draws' shares.
    #[test]
    fn top_p_draws_from_the_smallest_set_that_reaches_p() {
        // Probabilities at temperature 1: 0.4, 0.3, 0.2, 0.1 (token 3, 0, 2, 1 in order).
        let logits: Vec<f32> = [0.3f32, 0.1, 0.2, 0.4].iter().map(|p| p.ln()).collect();
        let cases: [(f64, usize, &[u32]); 6] = [
            (1.0, 0, &[3, 0, 2, 1]),
            (0.95, 0, &[3, 0, 2, 1]),
            (0.65, 0, &[3, 0]),
            (0.75, 0, &[3, 0, 2]),
            (0.3, 0, &[3]),
            // After top-2 the probabilities are 4/7 and 3/7: p 0.6 keeps both.
            (0.6, 2, &[3, 0]),
        ];
        for (top_p, top_k, nucleus) in cases {
            let mut sampler = TokenSampler::new(1.0, top_k, 11).with_top_p(top_p);
            let mut counts = [0usize; 4];
            let n = 20_000;
            for _ in 0..n {
                counts[sampler.pick(&logits) as usize] += 1;
            }
            let drawn: Vec<u32> = (0..4).filter(|&t| counts[t as usize] > 0).collect();
            let mut want = nucleus.to_vec();
            want.sort();
            assert_eq!(
                drawn, want,
                "top_p {top_p}, top_k {top_k}: the tokens drawn"
            );
            // Each kept token's share is its probability over the nucleus's.
            let p = [0.3, 0.1, 0.2, 0.4];
            let mass: f64 = nucleus.iter().map(|&t| p[t as usize]).sum();
            for &t in nucleus {
                let share = counts[t as usize] as f64 / n as f64;
                let expected = p[t as usize] / mass;
                assert!(
                    (share - expected).abs() < 0.02,
                    "top_p {top_p}: token {t} drawn {share}, expected {expected}"
                );
            }
        }
        assert!(TokenSampler::check(0.8, 0.0).is_err());
        assert!(TokenSampler::check(0.8, 1.5).is_err());
        assert!(TokenSampler::check(-0.1, 1.0).is_err());
        assert!(TokenSampler::check(f32::NAN, 1.0).is_err());
        assert!(TokenSampler::check(0.0, 1.0).is_ok());
    }

    /// The feeds a generation hands its forward: the prompt, then one token a step while the
    /// context holds them all, then the whole window, fresh, at every step past it.
    #[test]
    fn the_cache_is_fed_new_tokens_within_the_context_and_windows_past_it() {
        let mut feeds = Vec::new();
        let mut next_id = 10;
        let tokens = generate_cached(&[1, 2, 3], 5, 5, &[], |feed, fresh| {
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
        generate_cached(&[], 1, 4, &[], |feed, fresh| {
            feeds.push((feed.to_vec(), fresh));
            Ok::<_, ()>(7)
        })
        .unwrap();
        assert_eq!(feeds, [(vec![0], true)]);
        let mut feeds = Vec::new();
        generate_cached(&[1, 2, 3, 4], 1, 2, &[], |feed, fresh| {
            feeds.push((feed.to_vec(), fresh));
            Ok::<_, ()>(7)
        })
        .unwrap();
        assert_eq!(feeds, [(vec![3, 4], true)]);
        // A stop token ends the text, kept as its last token; one in the prompt does not.
        let mut next_id = 10;
        let tokens = generate_cached(&[12, 2], 5, 8, &[12, 13], |_, _| {
            next_id += 1;
            Ok::<_, ()>(next_id)
        })
        .unwrap();
        assert_eq!(tokens, [12, 2, 11, 12]);
    }
}
