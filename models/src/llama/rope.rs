//! Rotary position embeddings as Hugging Face's Llama applies them: the "rotate half"
//! convention (a head's first half of dims paired with its second half), inverse frequencies
//! `θ^(−2i/hd)`, and Llama-3's frequency scaling (`rope_type: "llama3"`).

use burn::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use wildfire_kernels::{FusedOps, ops};

/// Llama-3's scaling of the rotary frequencies for long contexts (Llama-3.1 and 3.2): wavelengths
/// longer than `original_max_position_embeddings / low_freq_factor` are divided by `factor`,
/// shorter than `… / high_freq_factor` kept, and those between interpolated smoothly.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Llama3Scaling {
    /// How much longer the context is than the one trained without scaling.
    pub factor: f64,
    /// Low-frequency bound, as a fraction of the original context.
    pub low_freq_factor: f64,
    /// High-frequency bound, as a fraction of the original context.
    pub high_freq_factor: f64,
    /// The context the frequencies were first trained for.
    pub original_max_position_embeddings: usize,
}

/// The `cos` and `sin` values of [`Rope::tables`], row-major `[t, head_dim]`.
type HostTables = (Vec<f32>, Vec<f32>);

/// The rotary embedding of a model: base `theta` and an optional Llama-3 scaling.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rope {
    /// The base of the inverse frequencies.
    pub theta: f64,
    /// Llama-3's frequency scaling, if any.
    pub scaling: Option<Llama3Scaling>,
}

impl Rope {
    /// The `head_dim / 2` inverse frequencies, as `transformers` computes them (in f32:
    /// `1 / θ^(2i/hd)`, then the Llama-3 scaling).
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f32> {
        let base: Vec<f32> = (0..head_dim / 2)
            .map(|i| 1.0 / (self.theta as f32).powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let Some(s) = self.scaling else {
            return base;
        };
        let old = s.original_max_position_embeddings as f32;
        let (factor, low, high) = (
            s.factor as f32,
            s.low_freq_factor as f32,
            s.high_freq_factor as f32,
        );
        let (low_wavelen, high_wavelen) = (old / low, old / high);
        base.into_iter()
            .map(|f| {
                let wavelen = 2.0 * std::f32::consts::PI / f;
                if wavelen > low_wavelen {
                    f / factor
                } else if wavelen < high_wavelen {
                    f
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    (1.0 - smooth) * f / factor + smooth * f
                }
            })
            .collect()
    }

    /// `cos` and `sin` tables `[t, head_dim]` for positions `0..t` (each frequency's
    /// angle repeated in both halves of a head, as `transformers` builds them), computed once
    /// per shape on the host and kept for the process.
    pub fn tables<B: Backend>(
        &self,
        t: usize,
        head_dim: usize,
        device: &B::Device,
    ) -> [Tensor<B, 2>; 2] {
        let host = self.host_tables(t, head_dim);
        let [cos, sin] = [&host.0, &host.1].map(|v| TensorData::new(v.clone(), [t, head_dim]));
        [
            Tensor::from_data(cos, device),
            Tensor::from_data(sin, device),
        ]
    }

    /// `cos` and `sin` tables `[positions.len(), head_dim]` at `positions` (a context-parallel
    /// rank's chunks of the sequence): the rows of [`Rope::tables`] there.
    pub fn tables_at<B: Backend>(
        &self,
        positions: &[usize],
        head_dim: usize,
        device: &B::Device,
    ) -> [Tensor<B, 2>; 2] {
        let contiguous = positions.iter().enumerate().all(|(i, &p)| p == i);
        if contiguous {
            return self.tables(positions.len(), head_dim, device);
        }
        let n = positions.len();
        if n >= FEW_POSITIONS {
            // A context-parallel rank's chunks: rows of the cached table up to the last.
            let end = positions.iter().max().map_or(0, |&p| p + 1);
            let host = self.host_tables(end, head_dim);
            return [&host.0, &host.1].map(|v| {
                let rows: Vec<f32> = positions
                    .iter()
                    .flat_map(|&p| v[p * head_dim..(p + 1) * head_dim].iter().copied())
                    .collect();
                Tensor::from_data(TensorData::new(rows, [n, head_dim]), device)
            });
        }
        // A generation's new positions (one a token): each row as the tables compute it, the
        // same values — a table cached per length would keep one for every token generated.
        let inv_freq = self.inv_freq(head_dim);
        let (mut cos, mut sin) = (vec![0f32; n * head_dim], vec![0f32; n * head_dim]);
        for (r, &p) in positions.iter().enumerate() {
            let rows = r * head_dim..(r + 1) * head_dim;
            rope_row(&inv_freq, p, &mut cos[rows.clone()], &mut sin[rows]);
        }
        [cos, sin].map(|v| Tensor::from_data(TensorData::new(v, [n, head_dim]), device))
    }

    /// The host values of [`Rope::tables`], from the process-wide cache.
    fn host_tables(&self, t: usize, head_dim: usize) -> Arc<HostTables> {
        // The rotary parameters' bits, the length and the head width.
        type Key = ([u64; 6], usize, usize);
        static CACHE: OnceLock<Mutex<HashMap<Key, Arc<HostTables>>>> = OnceLock::new();
        let scaling = self.scaling.map_or([0; 4], |s| {
            let old = s.original_max_position_embeddings as f64;
            [s.factor, s.low_freq_factor, s.high_freq_factor, old].map(f64::to_bits)
        });
        let [a, b, c, d] = scaling;
        let scaled = u64::from(self.scaling.is_some());
        let key = ([self.theta.to_bits(), scaled, a, b, c, d], t, head_dim);
        let cache = CACHE.get_or_init(Default::default);
        if let Some(found) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return found.clone();
        }
        let inv_freq = self.inv_freq(head_dim);
        let (mut cos, mut sin) = (vec![0f32; t * head_dim], vec![0f32; t * head_dim]);
        for p in 0..t {
            let row = p * head_dim..(p + 1) * head_dim;
            rope_row(&inv_freq, p, &mut cos[row.clone()], &mut sin[row]);
        }
        let tables = Arc::new((cos, sin));
        let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.insert(key, tables.clone());
        tables
    }
}

/// Below this many positions (a generation's new tokens) [`Rope::tables_at`] computes the rows
/// instead of cutting them from a cached table.
const FEW_POSITIONS: usize = 64;

/// Position `p`'s row of the tables (`cos`, `sin`: a head's width): each frequency's angle in
/// both halves.
fn rope_row(inv_freq: &[f32], p: usize, cos: &mut [f32], sin: &mut [f32]) {
    let half = inv_freq.len();
    for (i, &f) in inv_freq.iter().enumerate() {
        let (s, c) = (p as f32 * f).sin_cos();
        for j in [i, i + half] {
            cos[j] = c;
            sin[j] = s;
        }
    }
}

/// `x·cos + rotate_half(x)·sin` over `[b, h, t, hd]` with tables `[t, hd]`, where
/// `rotate_half([x₁, x₂]) = [−x₂, x₁]` (the halves of each head's dims): the fused kernel where
/// the backend has one ([`FusedOps::FUSED`]), Burn ops otherwise.
pub fn apply_rope<B: FusedOps>(
    x: Tensor<B, 4>,
    cos: &Tensor<B, 2>,
    sin: &Tensor<B, 2>,
) -> Tensor<B, 4> {
    if B::FUSED.rope {
        return ops::rope(x, cos.clone(), sin.clone());
    }
    let hd = x.dims()[3];
    let half = hd / 2;
    let (x1, x2) = (
        x.clone().narrow(3, 0, half),
        x.clone().narrow(3, half, half),
    );
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    let dtype = x.dtype();
    let [cos, sin] = [cos, sin].map(|t| t.clone().cast(dtype).unsqueeze::<4>());
    x * cos + rotated * sin
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The three regimes of the Llama-3 scaling at head width 8, θ 500,000 (Llama-3.2's
    /// parameters): the values `transformers` 5.24 computes (`LlamaRotaryEmbedding.inv_freq`).
    #[test]
    fn llama3_scaling_matches_transformers() {
        let rope = Rope {
            theta: 500_000.0,
            scaling: Some(Llama3Scaling {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            }),
        };
        let want = [1.0f32, 3.7606e-2, 4.2956e-4, 1.6620e-6];
        for (got, want) in rope.inv_freq(8).iter().zip(want) {
            assert!((got - want).abs() <= 1e-4 * want, "{got} vs {want}");
        }
        let plain = Rope {
            scaling: None,
            ..rope
        };
        assert!((plain.inv_freq(8)[3] - 5.3183e-5).abs() < 1e-8);
    }
}
