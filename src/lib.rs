//! Wildfire: train large models on [Burn](https://burn.dev) by swapping one type.
//!
//! ```text
//! type B = Autodiff<Flex>;                   // before
//! type B = Autodiff<Distributed<Flex>>;      // after: the same model, sharded over a mesh
//! ```
//!
//! This facade re-exports the workspace crates and hosts the examples and the cross-crate tests.

pub use wildfire_engine as engine;
pub use wildfire_kernels as kernels;
pub use wildfire_models as models;
pub use wildfire_parallel as parallel;

pub mod demo;
pub mod pretrain;
