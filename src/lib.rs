//! Wildfire: train large models on [Burn](https://burn.dev) by swapping one type.
//!
//! ```text
//! type B = Autodiff<Flex>;                   // before
//! type B = Autodiff<Distributed<Flex>>;      // after: the same model, sharded over a mesh
//! ```
//!
//! This facade re-exports the workspace crates and hosts the examples and the cross-crate tests.
//! `use wildfire::prelude::*;` brings what a training program needs; the README's example
//! compiles and runs as a test of it.

pub use wildfire_checkpoint as checkpoint;
pub use wildfire_engine as engine;
pub use wildfire_kernels as kernels;
pub use wildfire_models as models;
pub use wildfire_parallel as parallel;

pub mod demo;
#[cfg(feature = "learner")]
pub mod learner;
pub mod plot;
pub mod pretrain;

/// What a training program on `Distributed<B>` needs, in one import.
pub mod prelude {
    pub use wildfire_engine::{
        DynamicLossScaler, LossScalerConfig, Recompute, Recomputer, StepRecord, StepRunner,
        StepRunnerConfig,
    };
    pub use wildfire_kernels::FusedOps;
    pub use wildfire_kernels::hooks::{ForwardHooks, Inference};
    pub use wildfire_models::CausalLm;
    pub use wildfire_parallel::{
        DeviceMesh, DistDevice, Distributed, FsdpOptimizer, FsdpStrategy, LaunchEnv, LaunchOptions,
        RankPolicy, TpPlan, TpStyle, fully_shard, init_sharded, launch_ranks, replicate,
        sync_gradients, tensor_parallel,
    };
}

/// The README's Rust examples, compiled and run as doc tests (the Learner's needs the `learner`
/// feature, which `scripts/test.sh` turns on).
#[cfg(all(doctest, feature = "learner"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

pub mod alloc;
