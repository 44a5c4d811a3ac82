//! The one host-side random generator of Wildfire: splitmix64 (Steele, Lea & Flood 2014), a
//! tiny, well-mixed, seedable stream. Everything that must be reproducible across backends,
//! thread counts and mesh shapes draws from it: initial weights, dropout masks, the batch
//! sampler's offsets, the embedded corpus, test data. (Backend RNGs are process-wide and
//! per-device, so ranks as threads would not draw reproducible values from them.)

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's finaliser: a bijective 64-bit mix.
pub fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The seed of one random stream, from a run seed and two coordinates (e.g. step and row).
pub fn mix_seed(seed: u64, a: u64, b: u64) -> u64 {
    finalize(seed ^ a.wrapping_mul(GAMMA) ^ b.wrapping_mul(0xD1B5_4A32_D192_ED03).rotate_left(17))
}

/// A splitmix64 stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The stream whose state starts at `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The stream `seed` after `draws` draws (jumping ahead costs nothing: the state is a
    /// counter).
    pub fn after(seed: u64, draws: u64) -> Self {
        Self(seed.wrapping_add(draws.wrapping_mul(GAMMA)))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        finalize(self.0)
    }

    /// The next value in `[0, 1)` (53 random bits).
    pub fn next_unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The next value in `[-1, 1)` as an f32 (24 random bits).
    pub fn next_signed_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    /// Uniform in `0..n` (`n > 0`), by multiply-shift.
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }
}

/// The values of `distribution` at flat indices `start..start + out.len()` of a tensor drawn from
/// stream `stream`: element `i`'s value depends only on the stream and `i` (uniform: draw `i`;
/// normal: Box–Muller on draws `2k`, `2k + 1` for the pair `k = i / 2`, the cosine at `2k`), so
/// any piece of a tensor is drawn alone and equals that piece of the whole draw.
pub fn fill_distribution(
    stream: u64,
    distribution: burn_backend::Distribution,
    start: usize,
    out: &mut [f32],
) {
    use burn_backend::Distribution;
    let unit = |i: usize| SplitMix64::after(stream, i as u64).next_unit();
    match distribution {
        Distribution::Default => {
            for (k, v) in out.iter_mut().enumerate() {
                *v = unit(start + k) as f32;
            }
        }
        Distribution::Uniform(low, high) => {
            for (k, v) in out.iter_mut().enumerate() {
                *v = (low + (high - low) * unit(start + k)) as f32;
            }
        }
        Distribution::Bernoulli(p) => {
            for (k, v) in out.iter_mut().enumerate() {
                *v = if unit(start + k) < p { 1.0 } else { 0.0 };
            }
        }
        Distribution::Normal(mean, std) => {
            box_muller(stream, start, out.len(), |k, r, trig| {
                out[k] = (mean + std * r * trig) as f32;
            });
        }
    }
}

/// Standard normal draws at flat indices `start..start + len` of stream `stream`, by Box–Muller
/// on pairs of draws (pair `k` from draws `2k` and `2k + 1`, each pair drawn once):
/// `f(i − start, r, trig)` for each index `i`, the value being `r · trig` (`trig` the cosine at
/// `2k`, the sine at `2k + 1`). Callers scale it in their own precision.
pub fn box_muller(stream: u64, start: usize, len: usize, mut f: impl FnMut(usize, f64, f64)) {
    let end = start + len;
    let mut pair = start / 2;
    let mut rng = SplitMix64::after(stream, 2 * pair as u64);
    while 2 * pair < end {
        let (u1, u2) = (rng.next_unit().max(1e-300), rng.next_unit());
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u2;
        for (i, trig) in [(2 * pair, theta.cos()), (2 * pair + 1, theta.sin())] {
            if (start..end).contains(&i) {
                f(i - start, r, trig);
            }
        }
        pair += 1;
    }
}

/// An xorshift64 stream (Marsaglia 2003, shifts 13, 7, 17): the demo models' initial weights and
/// synthetic task, and the GPT's token sampler (kept for their tests' recorded values and
/// tolerances; new code draws from [`SplitMix64`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XorShift64(u64);

impl XorShift64 {
    /// The stream from `seed`, spread by a multiplication (0 is made odd: xorshift's state must
    /// not be 0).
    pub fn new(seed: u64, spread: u64) -> Self {
        Self(seed.wrapping_mul(spread) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// The next value in `[-1, 1)` as an f32 (24 random bits).
    pub fn next_signed_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    /// The next value in `[0, 1)` (53 random bits).
    pub fn next_unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference sequence of splitmix64 from seed 1234567 (Vigna's `splitmix64.c`).
    #[test]
    fn matches_the_reference_generator() {
        let mut s = SplitMix64::new(1234567);
        let got: Vec<u64> = (0..3).map(|_| s.next_u64()).collect();
        assert_eq!(
            got,
            [
                6457827717110365317,
                3203168211198807973,
                9817491932198370423
            ]
        );
        assert!((0..1000).all(|_| (0.0..1.0).contains(&s.next_unit())));
        assert!((0..1000).all(|_| s.below(7) < 7));
    }

    /// Any run of a drawn tensor is the same run of the whole draw, for every distribution; the
    /// draws have about the asked mean and spread.
    #[test]
    fn any_run_of_a_draw_is_that_run_of_the_whole() {
        use burn_backend::Distribution;
        for d in [
            Distribution::Default,
            Distribution::Uniform(-2.0, 3.0),
            Distribution::Bernoulli(0.3),
            Distribution::Normal(1.0, 0.5),
        ] {
            let mut whole = vec![0.0; 4001];
            fill_distribution(9, d, 0, &mut whole);
            for (start, len) in [(0, 1), (1, 1), (1, 2), (7, 30), (2000, 2001), (4000, 1)] {
                let mut part = vec![0.0; len];
                fill_distribution(9, d, start, &mut part);
                assert_eq!(part, whole[start..start + len], "{d:?} {start}+{len}");
            }
            let mean = whole.iter().map(|&v| v as f64).sum::<f64>() / whole.len() as f64;
            let expected = match d {
                Distribution::Default => 0.5,
                Distribution::Uniform(a, b) => (a + b) / 2.0,
                Distribution::Bernoulli(p) => p,
                Distribution::Normal(m, _) => m,
            };
            assert!((mean - expected).abs() < 0.06, "{d:?}: mean {mean}");
        }
        let mut normal = vec![0.0; 4000];
        fill_distribution(3, Distribution::Normal(0.0, 2.0), 0, &mut normal);
        let var = normal.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 4000.0;
        assert!((var.sqrt() - 2.0).abs() < 0.1, "std {}", var.sqrt());
    }
}
