//! Training throughput on CPU, one JSON line, for comparison with other frameworks running the
//! same configuration: 4 layers, d = 256, 4 heads, sequence 256, vocabulary 50304, batch 4, f32.
//! `--preset llama-tiny` trains the Llama family at the same width, depth and context (SwiGLU
//! width 768 and 2 key/value heads: the same 12·d² parameters per block as the GPT's).
//!
//! ```text
//! cargo bench --bench gpt_throughput [-- --steps 8] [--preset llama-tiny]
//! ```

/// mimalloc, keeping freed memory for the next step, or `WILDFIRE_ALLOC=system` (see
/// `wildfire::alloc`).
#[global_allocator]
static GLOBAL: wildfire::alloc::Allocator = wildfire::alloc::Allocator;

use wildfire::models::{ModelFlags, Preset};
use wildfire::pretrain::{PretrainConfig, run};

mod common;

fn main() {
    wildfire::alloc::keep_freed_memory();
    // A smoke run (`cargo test --all-targets`): one step.
    let smoke = common::smoke();
    let steps = common::arg("--steps").unwrap_or(if smoke { 1 } else { 8 });
    let preset: Preset = common::arg("--preset").unwrap_or(Preset::Small);
    let llama = preset.llama(256).is_some();
    let config = PretrainConfig {
        data: common::corpus(false),
        model: ModelFlags {
            preset,
            n_layer: Some(4),
            n_head: Some(4),
            n_embd: Some(256),
            block_size: Some(256),
            n_kv_head: llama.then_some(2),
            ..PretrainConfig::quiet().model
        },
        steps: steps + 1,
        batch_size: 4,
        ..PretrainConfig::quiet()
    };
    let summary = run(&config).expect("run");
    let model = summary.model.expect("model");
    // The first step includes one-time work; report the rest.
    let timed = &summary.steps[1.min(summary.steps.len() - 1)..];
    let tokens_per_s = timed.len() as f64 / timed.iter().map(|s| 1.0 / s.tokens_per_s).sum::<f64>();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "{{\"bench\":\"gpt_throughput\",\"framework\":\"wildfire\",\"model\":\"{preset}\",\"backend\":\"flex\",\"n_layer\":{},\"n_embd\":{},\"n_head\":{},\"seq\":{},\"vocab\":{},\"batch\":4,\"dtype\":\"f32\",\"threads\":{threads},\"params\":{},\"steps\":{},\"tokens_per_s\":{tokens_per_s:.1},\"peak_rss_bytes\":{},\"peak_tensor_bytes\":{}}}",
        model.n_layer(),
        model.d_model(),
        model.n_head(),
        model.block_size(),
        model.vocab_size(),
        model.num_params(),
        timed.len(),
        // The process's peak resident set (VmHWM), and the decorator's peak of live tensor bytes.
        summary.steps.last().map_or(0, |s| s.process_peak_rss),
        summary.steps.last().map_or(0, |s| s.peak_bytes)
    );
}
