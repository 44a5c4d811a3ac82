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
pub mod parallelize;

pub use error::Error;
pub use family::{ModelConfig, Preset};
pub use init::LayoutFn;
pub use lm::CausalLm;
