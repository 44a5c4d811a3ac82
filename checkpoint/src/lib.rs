//! Wildfire's checkpoints, for any Burn model and any optimizer with a
//! [`wildfire_parallel::StateCodec`]:
//!
//! - [`io`]: the atomic write (temporary file, sync, rename) every other file goes through;
//! - [`safetensors`]: a module's parameters as a safetensors file, by module path, and back;
//! - [`CheckpointDir`]: a run's step directories, committed by a rename and a `latest` pointer;
//! - [`dcp`]: the distributed checkpoint — each rank writes its own pieces of the parameters and
//!   optimizer state in the background, and a load reshards onto any mesh and strategy.
//!
//! It knows no model: the GPT's Hugging Face import and export (`wildfire_models::hf`) build on
//! [`dcp`]'s readers and writers.

pub mod dcp;
mod dir;
mod error;
pub mod io;
pub mod safetensors;

pub use dir::{CheckpointDir, ParamRecords};
pub use error::Error;
