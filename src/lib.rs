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
        RankPolicy, TpPlan, TpStyle, fully_shard, init_sharded, launch_ranks, replicate,
        sync_gradients, tensor_parallel,
    };
}

/// The README's Rust examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The allocator the binaries use, counting the bytes live on the heap and their peak.
///
/// By default mimalloc, told to keep the memory training frees: a training step frees and
/// allocates the same large buffers every step (a 50k-vocabulary model's logits and their
/// gradient are 206 MB each at batch 4, sequence 256). glibc's malloc returns them to the kernel,
/// and mimalloc purges freed pages after a delay; either way the next step faults the pages in
/// again and the kernel zeroes them (13% of such a step, 47k page faults in 10 steps; 1k with
/// purging off). The price is resident memory: with ranks as threads, mimalloc's per-thread pages
/// hold up to a third more than the live heap at the step's peak (measured in the `fsdp_memory`
/// bench). `WILDFIRE_ALLOC=system` picks glibc's allocator instead, whose resident set stays
/// within a few percent of the live heap.
///
/// Binaries declare
/// `#[global_allocator] static GLOBAL: wildfire::alloc::Allocator = wildfire::alloc::Allocator;`
/// and call [`alloc::keep_freed_memory`] first thing in `main`; [`alloc::heap_peak`] then tells
/// the program's own memory apart from what the allocator keeps.
pub mod alloc {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

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

    static LIVE: AtomicUsize = AtomicUsize::new(0);
    static PEAK: AtomicUsize = AtomicUsize::new(0);
    /// 0: not chosen yet, 1: mimalloc, 2: the system's.
    static CHOICE: AtomicU8 = AtomicU8::new(0);

    /// Bytes allocated through [`Allocator`] and not yet freed (0 where it is not the global
    /// allocator).
    pub fn heap_live() -> usize {
        LIVE.load(Ordering::Relaxed)
    }

    /// The most bytes live at once through [`Allocator`] since the start or the last
    /// [`reset_heap_peak`]: what the resident set would be if the allocator kept nothing.
    pub fn heap_peak() -> usize {
        PEAK.load(Ordering::Relaxed)
    }

    /// Start a new [`heap_peak`] from the bytes live now.
    pub fn reset_heap_peak() {
        PEAK.store(heap_live(), Ordering::Relaxed);
    }

    /// Whether [`Allocator`] forwards to the system's allocator (`WILDFIRE_ALLOC=system`).
    pub fn uses_system_allocator() -> bool {
        system()
    }

    fn system() -> bool {
        match CHOICE.load(Ordering::Relaxed) {
            0 => {
                // Read with libc's getenv: the first allocation happens before `main`, and
                // `std::env` would allocate. Every later call sees the same answer.
                // SAFETY: a NUL-terminated name; the returned pointer is only compared and read
                // as a C string while the environment is not being modified (process start).
                let value = unsafe { libc::getenv(c"WILDFIRE_ALLOC".as_ptr()) };
                let system = !value.is_null()
                    // SAFETY: getenv returned a valid C string.
                    && unsafe { std::ffi::CStr::from_ptr(value) }.to_bytes() == b"system";
                let choice = if system { 2 } else { 1 };
                match CHOICE.compare_exchange(0, choice, Ordering::Relaxed, Ordering::Relaxed) {
                    Ok(_) => system,
                    Err(chosen) => chosen == 2,
                }
            }
            chosen => chosen == 2,
        }
    }

    fn grow(bytes: usize) {
        let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
        PEAK.fetch_max(live, Ordering::Relaxed);
    }

    /// The binaries' global allocator (see the module docs): mimalloc or, with
    /// `WILDFIRE_ALLOC=system`, the system's; either way counted.
    pub struct Allocator;

    // SAFETY: every call is forwarded unchanged to one allocator, chosen once before the first
    // allocation returns and never changed, so each block is freed by the allocator that made it;
    // the counters only observe sizes.
    unsafe impl GlobalAlloc for Allocator {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            // SAFETY: forwarded with the caller's guarantees.
            let p = unsafe {
                if system() {
                    System.alloc(layout)
                } else {
                    mimalloc::MiMalloc.alloc(layout)
                }
            };
            if !p.is_null() {
                grow(layout.size());
            }
            p
        }

        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            // SAFETY: forwarded with the caller's guarantees.
            let p = unsafe {
                if system() {
                    System.alloc_zeroed(layout)
                } else {
                    mimalloc::MiMalloc.alloc_zeroed(layout)
                }
            };
            if !p.is_null() {
                grow(layout.size());
            }
            p
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            // SAFETY: forwarded with the caller's guarantees, to the allocator that made it.
            unsafe {
                if system() {
                    System.dealloc(ptr, layout)
                } else {
                    mimalloc::MiMalloc.dealloc(ptr, layout)
                }
            }
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            // SAFETY: forwarded with the caller's guarantees, to the allocator that made it.
            let p = unsafe {
                if system() {
                    System.realloc(ptr, layout, new_size)
                } else {
                    mimalloc::MiMalloc.realloc(ptr, layout, new_size)
                }
            };
            if !p.is_null() {
                LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
                grow(new_size);
            }
            p
        }
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
