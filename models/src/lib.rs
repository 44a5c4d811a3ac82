//! Wildfire's model family (GPT-2, its parallelisation) and token datasets.

pub mod data;
mod error;
mod family;
pub mod gpt;
pub mod hf;
mod init;
pub mod llama;
mod lm;
pub mod memory;
pub mod moe;
pub mod parallelize;
mod shape;
pub mod stage;
pub mod swiglu;

pub use error::Error;
pub use family::{ModelConfig, Preset};
pub use init::LayoutFn;
pub use lm::{CausalLm, DistributedLm, KvCache, TokenSampler, is_table};
pub use shape::{ModelFlags, MoeFlags, padded_vocab};

/// The largest absolute difference between `got` and `want` (of equal length), for the tests'
/// comparisons with `transformers`' logits.
#[cfg(test)]
pub(crate) fn largest_difference(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "compared lists differ in length");
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
}
