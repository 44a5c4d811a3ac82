//! Wildfire's model family (GPT-2, its parallelisation) and token datasets.

pub mod data;
pub mod gpt;
pub mod parallelize;
pub mod safetensors;
