//! A model in the Burn Book's style with data it generates itself (nothing downloaded): 8×8
//! "glyphs" of ten classes, MNIST-like. Each class is a fixed pattern of strokes; a sample is
//! its class's pattern shifted by up to a pixel each way, with some pixels flipped and noise
//! added, all drawn from the sample's index and the dataset's seed (the dataset holds no data).
//!
//! The model is the Book's: a `#[derive(Module)]` struct, its `#[derive(Config)]`, a
//! `forward_classification` giving a `ClassificationOutput`, and `TrainStep` / `InferenceStep`.

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use wildfire_parallel::rng::SplitMix64;

/// Pixels of a glyph (8 × 8).
pub const PIXELS: usize = 64;
/// Classes.
pub const CLASSES: usize = 10;

/// One glyph and its class.
#[derive(Clone, Debug)]
pub struct GlyphItem {
    /// Intensities in [0, 1], row-major.
    pub pixels: Vec<f32>,
    /// The class, `0..CLASSES`.
    pub label: usize,
}

/// `len` glyphs drawn from `seed` (sample `i` is the same whoever asks).
#[derive(Clone, Debug)]
pub struct GlyphDataset {
    len: usize,
    seed: u64,
}

impl GlyphDataset {
    /// A dataset of `len` glyphs.
    pub fn new(len: usize, seed: u64) -> Self {
        Self { len, seed }
    }
}

/// The strokes of class `class`: horizontal, vertical and diagonal bars chosen by the class.
fn pattern(class: usize) -> [f32; PIXELS] {
    let mut p = [0.0; PIXELS];
    let mut set = |r: usize, c: usize| p[r * 8 + c] = 1.0;
    let bits = [
        0b1000_1110,
        0b0010_0101,
        0b1100_0011,
        0b0101_1000,
        0b1011_0001,
        0b0110_1100,
        0b1001_0110,
        0b0011_1001,
        0b1110_0010,
        0b0101_0111,
    ][class];
    for (i, (r, horizontal)) in [
        (1, true),
        (4, true),
        (6, true),
        (1, false),
        (4, false),
        (6, false),
    ]
    .into_iter()
    .enumerate()
    {
        if bits & (1 << i) != 0 {
            for k in 1..7 {
                if horizontal { set(r, k) } else { set(k, r) }
            }
        }
    }
    if bits & (1 << 6) != 0 {
        (1..7).for_each(|k| set(k, k));
    }
    if bits & (1 << 7) != 0 {
        (1..7).for_each(|k| set(k, 7 - k));
    }
    p
}

impl Dataset<GlyphItem> for GlyphDataset {
    fn get(&self, index: usize) -> Option<GlyphItem> {
        if index >= self.len {
            return None;
        }
        let mut rng =
            SplitMix64::new(self.seed ^ (index as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
        let label = (rng.next_u64() % CLASSES as u64) as usize;
        let base = pattern(label);
        let (dr, dc) = (
            (rng.next_u64() % 3) as isize - 1,
            (rng.next_u64() % 3) as isize - 1,
        );
        let mut pixels = vec![0.0f32; PIXELS];
        for r in 0..8isize {
            for c in 0..8isize {
                let (sr, sc) = (r - dr, c - dc);
                let on = (0..8).contains(&sr)
                    && (0..8).contains(&sc)
                    && base[(sr * 8 + sc) as usize] > 0.0;
                let flip = rng.next_u64().is_multiple_of(16);
                let noise = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 0.3;
                pixels[(r * 8 + c) as usize] = if on != flip { 0.7 + noise } else { noise };
            }
        }
        Some(GlyphItem { pixels, label })
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// A batch: `images` `[n, 64]`, `targets` `[n]`.
#[derive(Clone, Debug)]
pub struct GlyphBatch<B: Backend> {
    /// The pixels.
    pub images: Tensor<B, 2>,
    /// The classes.
    pub targets: Tensor<B, 1, Int>,
}

/// Makes [`GlyphBatch`]es on the device it is given.
#[derive(Clone, Copy, Debug, Default)]
pub struct GlyphBatcher;

impl<B: Backend> Batcher<B, GlyphItem, GlyphBatch<B>> for GlyphBatcher {
    fn batch(&self, items: Vec<GlyphItem>, device: &B::Device) -> GlyphBatch<B> {
        let n = items.len();
        let pixels: Vec<f32> = items
            .iter()
            .flat_map(|i| i.pixels.iter().copied())
            .collect();
        let labels: Vec<i64> = items.iter().map(|i| i.label as i64).collect();
        GlyphBatch {
            images: Tensor::from_data(TensorData::new(pixels, [n, PIXELS]), device),
            targets: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// The classifier: two linear layers with a ReLU between them.
#[derive(Module, Debug)]
pub struct GlyphClassifier<B: Backend> {
    hidden: Linear<B>,
    output: Linear<B>,
    activation: Relu,
}

/// The classifier's shape.
#[derive(Config, Debug)]
pub struct GlyphClassifierConfig {
    /// Hidden units.
    #[config(default = 64)]
    pub hidden: usize,
}

impl GlyphClassifierConfig {
    /// The model on `device`.
    pub fn init<B: Backend>(&self, device: &B::Device) -> GlyphClassifier<B> {
        GlyphClassifier {
            hidden: LinearConfig::new(PIXELS, self.hidden).init(device),
            output: LinearConfig::new(self.hidden, CLASSES).init(device),
            activation: Relu::new(),
        }
    }
}

impl<B: Backend> GlyphClassifier<B> {
    /// Class logits `[n, 10]` of `images` `[n, 64]`.
    pub fn forward(&self, images: Tensor<B, 2>) -> Tensor<B, 2> {
        self.output
            .forward(self.activation.forward(self.hidden.forward(images)))
    }

    /// The logits and their cross-entropy against `targets`.
    pub fn forward_classification(
        &self,
        images: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
    ) -> ClassificationOutput<B> {
        let output = self.forward(images);
        let loss = CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output.clone(), targets.clone());
        ClassificationOutput::new(loss, output, targets)
    }
}

impl<B: AutodiffBackend> TrainStep for GlyphClassifier<B> {
    type Input = GlyphBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: GlyphBatch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let item = self.forward_classification(batch.images, batch.targets);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: Backend> InferenceStep for GlyphClassifier<B> {
    type Input = GlyphBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: GlyphBatch<B>) -> ClassificationOutput<B> {
        self.forward_classification(batch.images, batch.targets)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glyphs_are_reproducible_and_every_class_appears() {
        let data = GlyphDataset::new(200, 3);
        let a = data.get(17).unwrap();
        let b = GlyphDataset::new(200, 3).get(17).unwrap();
        assert_eq!((a.label, &a.pixels), (b.label, &b.pixels));
        assert!(data.get(200).is_none());
        let mut seen = [false; CLASSES];
        for i in 0..200 {
            seen[data.get(i).unwrap().label] = true;
        }
        assert!(seen.iter().all(|&s| s));
        let patterns: std::collections::HashSet<Vec<u32>> = (0..CLASSES)
            .map(|c| pattern(c).iter().map(|v| v.to_bits()).collect())
            .collect();
        assert_eq!(patterns.len(), CLASSES, "ten different patterns");
    }
}
