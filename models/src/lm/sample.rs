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
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        order.truncate(self.top_k.max(1));
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

/// `prompt` (`[0]` when empty) continued by `new_tokens` tokens, each chosen by `next` from the
/// last `block_size` tokens (the context, as ids).
pub(crate) fn generate_by<E>(
    prompt: &[u32],
    new_tokens: usize,
    block_size: usize,
    mut next: impl FnMut(Vec<i64>) -> Result<u32, E>,
) -> Result<Vec<u32>, E> {
    let mut tokens: Vec<u32> = if prompt.is_empty() {
        vec![0]
    } else {
        prompt.to_vec()
    };
    for _ in 0..new_tokens {
        let start = tokens.len().saturating_sub(block_size);
        let token = next(tokens[start..].iter().map(|&t| i64::from(t)).collect())?;
        tokens.push(token);
    }
    Ok(tokens)
}
