//! Activation recomputation: step time and peak memory of each policy on the small GPT (4 layers,
//! d = 256, 4 heads, sequence 256, byte vocabulary, batch 4, f32, Flex), side by side in one run
//! (policies interleaved round by round, so machine noise hits them alike).
//!
//! ```text
//! cargo bench --bench recompute [-- --steps 4 --rounds 3]
//! cargo bench --bench recompute -- --n-embd 768 --n-head 12 --n-layer 2   # a wider block
//! ```
//!
//! `--n-embd`, `--n-head`, `--n-layer`, `--block-size` and `--batch` change the shape. The
//! attention core's share of a block's work is about `5·a·s / (34·h)` of its activations and
//! `s / (6·h)` of its matmul FLOPs, so the selective overhead shrinks as the width grows.
//!
//! Peak memory two ways: the decorator's live-bytes peak of the step (`peak_bytes`, tensors only)
//! and the process heap peak from a counting allocator (everything the step allocates).
//! Targets (issue): full ≤ 1.30× the step time of none, selective ≤ 1.05×.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use wildfire::engine::Recompute;
use wildfire::models::parallelize::ParallelConfig;
use wildfire::models::{ModelFlags, Preset};
use wildfire::pretrain::{PretrainConfig, run};

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

mod common;

fn main() {
    // A smoke run (`cargo test --all-targets`): one tiny step per policy.
    let smoke = common::smoke();
    let steps = common::arg("--steps").unwrap_or(if smoke { 1 } else { 4 });
    let rounds = common::arg("--rounds").unwrap_or(if smoke { 1 } else { 3 });
    let policies = [
        Recompute::None,
        Recompute::Selective,
        Recompute::Full,
        Recompute::EveryNth(2),
    ];
    let mut seconds = vec![Vec::new(); policies.len()];
    let mut peak_bytes = vec![0u64; policies.len()];
    let mut heap_peak = vec![0usize; policies.len()];
    let mut losses = vec![Vec::new(); policies.len()];
    for _ in 0..rounds {
        for (i, &policy) in policies.iter().enumerate() {
            let config = PretrainConfig {
                data: common::corpus(true),
                model: ModelFlags {
                    preset: if smoke { Preset::Tiny } else { Preset::Small },
                    n_layer: if smoke {
                        Some(2)
                    } else {
                        common::arg("--n-layer")
                    },
                    n_head: common::arg("--n-head"),
                    n_embd: common::arg("--n-embd"),
                    block_size: if smoke {
                        Some(32)
                    } else {
                        common::arg("--block-size")
                    },
                    ..PretrainConfig::quiet().model
                },
                steps: steps + 1,
                batch_size: common::arg("--batch").unwrap_or(4),
                parallel: ParallelConfig {
                    recompute: policy,
                    ..ParallelConfig::default()
                },
                ..PretrainConfig::quiet()
            };
            let base = CURRENT.load(Ordering::Relaxed);
            PEAK.store(base, Ordering::Relaxed);
            let summary = run(&config).expect("run");
            heap_peak[i] = heap_peak[i].max(PEAK.load(Ordering::Relaxed) - base);
            let tokens =
                (config.batch_size * summary.model.as_ref().expect("model").block_size()) as f64;
            // The first step includes one-time work; time the rest.
            for s in &summary.steps[1.min(summary.steps.len() - 1)..] {
                seconds[i].push(tokens / s.tokens_per_s);
            }
            peak_bytes[i] = peak_bytes[i].max(
                summary
                    .steps
                    .iter()
                    .map(|s| s.peak_bytes)
                    .max()
                    .unwrap_or(0),
            );
            losses[i] = summary.steps.iter().map(|s| s.loss).collect();
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let base_time = median(&seconds[0]);
    let model = PretrainConfig {
        model: ModelFlags {
            preset: Preset::Small,
            n_layer: common::arg("--n-layer"),
            n_head: common::arg("--n-head"),
            n_embd: common::arg("--n-embd"),
            block_size: common::arg("--block-size"),
            ..PretrainConfig::quiet().model
        },
        ..PretrainConfig::quiet()
    }
    .model_shape(256)
    .expect("model shape");
    if !smoke {
        println!(
            "{{\"bench\":\"recompute\",\"shape\":{{\"n_layer\":{},\"n_head\":{},\"n_embd\":{},\"block_size\":{},\"batch\":{}}}}}",
            model.n_layer(),
            model.n_head(),
            model.d_model(),
            model.block_size(),
            common::arg::<usize>("--batch").unwrap_or(4)
        );
    }
    for (i, policy) in policies.iter().enumerate() {
        let t = median(&seconds[i]);
        println!(
            "{{\"bench\":\"recompute\",\"policy\":\"{policy}\",\"step_s\":{t:.4},\"time_vs_none\":{:.3},\"peak_bytes\":{},\"peak_vs_none\":{:.3},\"heap_peak_bytes\":{},\"heap_peak_vs_none\":{:.3},\"same_losses_as_none\":{}}}",
            t / base_time,
            peak_bytes[i],
            peak_bytes[i] as f64 / peak_bytes[0] as f64,
            heap_peak[i],
            heap_peak[i] as f64 / heap_peak[0] as f64,
            losses[i] == losses[0],
        );
    }
}
