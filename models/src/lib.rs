//! Wildfire's model family (GPT-2, its parallelisation) and token datasets.

pub mod checkpoint;
pub mod data;
pub mod gpt;
pub mod io;
pub mod memory;
pub mod parallelize;
pub mod safetensors;
