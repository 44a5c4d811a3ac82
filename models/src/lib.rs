//! Wildfire's model family (GPT-2, its parallelisation) and token datasets.

pub mod checkpoint;
pub mod data;
pub mod dcp;
mod error;
pub mod gpt;
pub mod hf;
mod init;
pub mod io;
pub mod memory;
pub mod parallelize;
pub mod safetensors;

pub use error::Error;
