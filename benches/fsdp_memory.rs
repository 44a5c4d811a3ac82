//! FSDP / ZeRO memory and communication per rank on the small GPT (4 layers, d = 256, 4 heads,
//! sequence 256, GPT-2 vocabulary 50304, global batch 4, f32, AdamW), for N = 1, 2, 4 ranks (as
//! threads) and each strategy: the decorator's measured bytes after a step beside the ZeRO
//! formulas, and their ratio. A markdown table, printed and written to a file.
//!
//! ```text
//! cargo bench --bench fsdp_memory [-- --out target/fsdp_memory.md]
//! ```
//!
//! Formulas (Ψ parameters, f32): parameters 4Ψ (4Ψ/N sharded), gradients 4Ψ (4Ψ/N), AdamW state
//! 8Ψ (8Ψ/N); communication in the bytes each rank passes to its collectives: DDP all-reduces the
//! gradients (4Ψ), ZeRO-1 adds the parameters' all-gather after the step (4Ψ/N), ZeRO-2
//! reduce-scatters instead of all-reducing (4Ψ + 4Ψ/N), FSDP gathers the parameters for forward
//! and again for backward (2 × 4Ψ/N) and reduce-scatters the gradients (4Ψ). Measured figures add
//! the padding of uneven shards, the tied embedding's second use and the small collectives of the
//! step (loss metric, overflow and norm check).

use wildfire::models::data::TokenizerKind;
use wildfire::models::gpt::Preset;
use wildfire::models::parallelize::{FsdpStrategy, ParallelConfig};
use wildfire::pretrain::{PretrainConfig, run};

mod common;

fn main() {
    // A smoke run (`cargo test --all-targets`): a tiny model, N = 1 and 2.
    let smoke = common::smoke();
    let out = common::arg::<String>("--out").unwrap_or_else(|| {
        let dir = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
        format!("{dir}/fsdp_memory.md")
    });
    let strategies = [
        ("ddp", FsdpStrategy::NoShard),
        ("zero1", FsdpStrategy::ShardOptimizer),
        ("zero2", FsdpStrategy::ShardGradOp),
        ("fsdp", FsdpStrategy::FullShard),
    ];
    let ranks: &[usize] = if smoke { &[1, 2] } else { &[1, 2, 4] };
    let mut table = String::from(
        "| N | strategy | params (formula) | grads (formula) | AdamW state (formula) | persistent / 16Ψ | peak | comm bytes (formula) |\n|---|---|---|---|---|---|---|---|\n",
    );
    for &n in ranks {
        for (name, strategy) in strategies {
            let config = PretrainConfig {
                preset: if smoke { Preset::Tiny } else { Preset::Small },
                n_layer: smoke.then_some(2),
                block_size: smoke.then_some(32),
                tokenizer: if smoke {
                    TokenizerKind::Bytes
                } else {
                    TokenizerKind::Gpt2
                },
                steps: 2,
                batch_size: 4,
                parallel: ParallelConfig {
                    dp: n,
                    fsdp: strategy,
                    ..ParallelConfig::default()
                },
                ..PretrainConfig::quiet()
            };
            let summary = run(&config).expect("run");
            let psi = summary.model.as_ref().expect("model").num_params() as f64;
            let m = summary.steps.last().expect("a step");
            let nf = n as f64;
            let sharded = |full: f64, yes: bool| if yes { full / nf } else { full };
            let (p, g, o) = match strategy {
                FsdpStrategy::NoShard => (4.0 * psi, 4.0 * psi, 8.0 * psi),
                FsdpStrategy::ShardOptimizer => (4.0 * psi, 4.0 * psi, sharded(8.0 * psi, true)),
                FsdpStrategy::ShardGradOp => (
                    4.0 * psi,
                    sharded(4.0 * psi, true),
                    sharded(8.0 * psi, true),
                ),
                _ => (
                    sharded(4.0 * psi, true),
                    sharded(4.0 * psi, true),
                    sharded(8.0 * psi, true),
                ),
            };
            let comm = if n == 1 {
                0.0
            } else {
                match strategy {
                    FsdpStrategy::NoShard => 4.0 * psi,
                    FsdpStrategy::ShardOptimizer | FsdpStrategy::ShardGradOp => {
                        4.0 * psi + 4.0 * psi / nf
                    }
                    _ => 4.0 * psi + 2.0 * 4.0 * psi / nf,
                }
            };
            let ratio = |measured: u64, formula: f64| {
                if formula == 0.0 {
                    "—".to_string()
                } else {
                    format!("{:.3}", measured as f64 / formula)
                }
            };
            let persistent = m.param_bytes + m.grad_bytes + m.optim_bytes;
            table.push_str(&format!(
                "| {n} | {name} | {} ({:.0}, ×{}) | {} ({:.0}, ×{}) | {} ({:.0}, ×{}) | {:.3} | {} | {} ({:.0}, ×{}) |\n",
                m.param_bytes,
                p,
                ratio(m.param_bytes, p),
                m.grad_bytes,
                g,
                ratio(m.grad_bytes, g),
                m.optim_bytes,
                o,
                ratio(m.optim_bytes, o),
                persistent as f64 / (16.0 * psi),
                m.peak_bytes,
                m.comm_bytes,
                comm,
                ratio(m.comm_bytes, comm),
            ));
        }
    }
    println!("{table}");
    match std::fs::write(&out, &table) {
        Ok(()) => eprintln!("written to {out}"),
        Err(e) => eprintln!("could not write {out}: {e}"),
    }
}
