//! Wildfire's model family (GPT-2, its parallelisation) and token datasets.

pub mod data;
mod error;
pub mod gpt;
pub mod hf;
mod init;
pub mod llama;
pub mod memory;
pub mod parallelize;

pub use error::Error;
