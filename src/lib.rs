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

pub use wildfire_engine as engine;
pub use wildfire_kernels as kernels;
pub use wildfire_models as models;
pub use wildfire_parallel as parallel;

pub mod demo;
pub mod pretrain;

/// What a training program on `Distributed<B>` needs, in one import.
pub mod prelude {
    pub use wildfire_engine::{
        DynamicLossScaler, LossScalerConfig, Recompute, Recomputer, StepRecord, StepRunner,
        StepRunnerConfig,
    };
    pub use wildfire_kernels::FusedOps;
    pub use wildfire_kernels::hooks::{ForwardHooks, Inference};
    pub use wildfire_parallel::{
        DeviceMesh, DistDevice, Distributed, FsdpOptimizer, FsdpStrategy, LaunchEnv, LaunchOptions,
        RankPolicy, TpPlan, TpStyle, fully_shard, launch_ranks, replicate, sync_gradients,
        tensor_parallel,
    };
}

/// The README's Rust examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The allocator the binaries use: mimalloc, told to keep the memory training frees.
///
/// A training step frees and allocates the same large buffers every step (a 50k-vocabulary
/// model's logits and their gradient are 206 MB each at batch 4, sequence 256). glibc's malloc
/// returns them to the kernel, and mimalloc purges freed pages after a delay; either way the next
/// step faults the pages in again and the kernel zeroes them (13% of such a step, 47k page faults
/// in 10 steps; 1k with purging off). Binaries declare
/// `#[global_allocator] static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;` and call
/// [`alloc::keep_freed_memory`] first thing in `main`.
pub mod alloc {
    /// mimalloc's `mi_option_purge_delay` (the `mi_option_e` enum of mimalloc 3, `mimalloc.h`).
    const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

    /// Never purge freed pages (mimalloc's purge delay −1): memory a step frees stays mapped for
    /// the next step. The process's resident set then stays at its peak, as with PyTorch's CPU
    /// caching allocator.
    pub fn keep_freed_memory() {
        // SAFETY: sets one integer option; mimalloc documents `mi_option_set` as callable at any
        // time (we call it before any thread of ours starts).
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }

    #[cfg(test)]
    mod tests {
        /// The option number is the purge delay's: its documented default (1000 ms in
        /// mimalloc 3) before, −1 after.
        #[test]
        fn the_purge_delay_is_the_option_set() {
            // SAFETY: reads an integer option.
            let get = || unsafe { libmimalloc_sys::mi_option_get(super::MI_OPTION_PURGE_DELAY) };
            assert_eq!(get(), 1000);
            super::keep_freed_memory();
            assert_eq!(get(), -1);
        }
    }
}
