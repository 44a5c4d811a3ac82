//! Generation speed on CPU (Flex, f32): a GPT's greedy continuation of a prompt through the
//! key/value cache (`CausalLm::sample`, what `--sample-tokens` runs) against the same
//! continuation forwarding the whole window at every token (what sampling did before the cache,
//! and does past the context; the head on the last position only),
//! one JSON line each; both continuations must be the same tokens. Each on one rank of the
//! decorator (`Distributed<Flex>`, what `gpt_pretrain --sample-tokens` runs) and on plain Flex. The model is GPT-2 124M's
//! shape (12 layers, d 768, 12 heads, tanh GELU, vocabulary 50304, context 1024), randomly
//! initialised. `benches/generate_vs_pytorch.sh` runs it beside `transformers`' `generate` with
//! and without its cache on the same shape.
//!
//! ```text
//! cargo bench --bench generate [-- --prompt 32 --tokens 32] [--no-uncached] [--backend decorator|flex]
//! ```

/// mimalloc, keeping freed memory (see `wildfire::alloc`).
#[global_allocator]
static GLOBAL: wildfire::alloc::Allocator = wildfire::alloc::Allocator;

use burn::backend::Flex;
use burn::prelude::*;
use std::time::Instant;
use wildfire::kernels::FusedOps;
use wildfire::models::gpt::{Gelu, Gpt, GptConfig, TokenSampler};
use wildfire::models::{CausalLm, KvCache};
use wildfire::parallel::{DeviceMesh, Distributed, LaunchOptions, launch_ranks};

mod common;

fn main() {
    wildfire::alloc::keep_freed_memory();
    let smoke = common::smoke();
    let prompt_len: usize = common::arg("--prompt").unwrap_or(if smoke { 4 } else { 32 });
    let tokens: usize = common::arg("--tokens").unwrap_or(if smoke { 3 } else { 32 });
    let uncached = !std::env::args().any(|a| a == "--no-uncached");
    // One side only (to profile it): `decorator` or `flex`.
    let only: Option<String> = common::arg("--backend");
    let runs = |backend: &str| only.as_deref().is_none_or(|o| o == backend);
    let (n_layer, n_embd) = if smoke { (2, 64) } else { (12, 768) };
    let config = GptConfig {
        vocab_size: 50304,
        block_size: 1024,
        n_layer,
        n_head: n_embd / 64,
        n_embd,
        init_seed: 1,
        dropout: 0.0,
        vocab_used: None,
        gelu: Gelu::Tanh,
    };
    let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| (i * 7919) % 50257).collect();
    let bench = Bench {
        config,
        prompt,
        tokens,
        uncached,
    };
    // What `--sample-tokens` runs: the model on one rank of the decorator.
    let mesh = DeviceMesh::new([("dp", 1)]).expect("mesh");
    if runs("decorator") {
        launch_ranks::<Flex, _, _>(
            &mesh,
            &Default::default(),
            &LaunchOptions::default(),
            |device| {
                bench.run::<Distributed<Flex>>(&device, "decorator");
            },
        )
        .expect("one rank");
    }
    // A Burn user's own `Gpt<Flex>`.
    if runs("flex") {
        bench.run::<Flex>(&Default::default(), "flex");
    }
}

struct Bench {
    config: GptConfig,
    prompt: Vec<u32>,
    tokens: usize,
    uncached: bool,
}

impl Bench {
    /// The cached and (unless `--no-uncached`) the uncached generation on backend `B`, a JSON
    /// line each.
    fn run<B: FusedOps>(&self, device: &B::Device, backend: &str) {
        let (config, prompt, tokens) = (&self.config, &self.prompt, self.tokens);
        let model: Gpt<B> = config.init(device).expect("model");
        let line = |mode: &str, seconds: f64| {
            println!(
                "{{\"bench\":\"generate\",\"framework\":\"wildfire\",\"backend\":\"{backend}\",\"mode\":\"{mode}\",\"model\":\"gpt2-124m shape\",\"prompt\":{},\"tokens\":{tokens},\"seconds\":{seconds:.4},\"tokens_per_s\":{:.2}}}",
                prompt.len(),
                tokens as f64 / seconds,
            )
        };
        // Greedy, so that both generations must give the same tokens.
        let greedy = || TokenSampler::new(1.0, 1, 0);
        // A warm-up: pools, the allocator's first pages.
        model.sample(prompt, 2, config.block_size, greedy(), device);

        let start = Instant::now();
        let cached = model.sample(prompt, tokens, config.block_size, greedy(), device);
        line("cached", start.elapsed().as_secs_f64());
        if !self.uncached {
            return;
        }
        let start = Instant::now();
        let mut sampler = greedy();
        let mut out = prompt.clone();
        for _ in 0..tokens {
            let window = &out[out.len().saturating_sub(config.block_size)..];
            let ids: Vec<i64> = window.iter().map(|&t| i64::from(t)).collect();
            let t = ids.len();
            let idx = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, t]), device);
            // The window through every layer, the head on its last position: what a
            // generation past the context runs at every token (and `transformers` without its
            // cache).
            let logits = model.forward_with(idx, &KvCache::new().last_logits());
            out.push(sampler.pick(&logits.into_data().to_vec::<f32>().unwrap()));
        }
        line("uncached", start.elapsed().as_secs_f64());
        assert_eq!(out, cached, "the cache changed the greedy continuation");
    }
}
