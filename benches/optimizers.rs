//! The optimizers side by side, one rank on this machine's CPU (Flex), in one run:
//!
//! 1. GPT-2 350M (24 layers, width 1024, context 1024, the GPT-2 vocabulary), batch 1 × 1024,
//!    f32: for AdamW, AdamW with bf16 and with 8-bit moments, Adafactor, Muon, AdamW
//!    offloaded to the host, and AdamW with the parameters offloaded too, the decorator's peak of live tensor bytes in a step, the device's
//!    and the host's optimizer-state bytes after it, and the median step time of the steps after
//!    the first. Then the planner (`--plan auto`) for two budgets: what it chooses, the peak it
//!    predicts, and the peak the chosen run measures.
//! 2. The `small` preset (4 layers, width 256, context 256; byte vocabulary) trained for a fixed
//!    number of steps on the embedded corpus at one learning rate (AdamW's default, 1e-3; Muon
//!    with Moonlight's learning-rate match, so the same rate serves it): the validation loss at
//!    the end of each.
//!
//! 3. Muon on GPT-2 124M (batch 1 × 1024 per rank, f32) over dp 2 (ZeRO-1, ranks as threads):
//!    every rank orthogonalising every matrix (`--muon-split every`) against owner ranks
//!    (`--muon-split owner`): the Newton–Schulz iterations per rank and step, the bytes a rank
//!    moved per step, the median step time.
//!
//! Memory is exact (the accounting); step times on a 2-core CPU are a CPU's, not a GPU's.
//!
//! ```text
//! cargo bench --bench optimizers [-- --steps 3 --train-steps 200
//!                                    --only table|planner|losses|muon --setting NAME]
//! ```

/// mimalloc, keeping freed memory for the next step, or `WILDFIRE_ALLOC=system` (see
/// `wildfire::alloc`).
#[global_allocator]
static GLOBAL: wildfire::alloc::Allocator = wildfire::alloc::Allocator;

use wildfire::models::{ModelFlags, Preset};
use wildfire::pretrain::{Offload, OptimState, OptimizerKind, PretrainConfig, run};

mod common;

/// The settings compared: a name, the optimizer, its state dtype, the offload.
const SETTINGS: [(&str, OptimizerKind, OptimState, Offload); 7] = [
    (
        "AdamW",
        OptimizerKind::Adamw,
        OptimState::F32,
        Offload::None,
    ),
    (
        "AdamW, bf16 moments",
        OptimizerKind::Adamw,
        OptimState::Bf16,
        Offload::None,
    ),
    (
        "AdamW, 8-bit moments",
        OptimizerKind::Adamw,
        OptimState::Int8,
        Offload::None,
    ),
    (
        "Adafactor",
        OptimizerKind::Adafactor,
        OptimState::F32,
        Offload::None,
    ),
    ("Muon", OptimizerKind::Muon, OptimState::F32, Offload::None),
    (
        "AdamW, offloaded",
        OptimizerKind::Adamw,
        OptimState::F32,
        Offload::Optimizer,
    ),
    (
        "AdamW and parameters offloaded (FSDP full)",
        OptimizerKind::Adamw,
        OptimState::F32,
        Offload::Params,
    ),
];

fn with(
    base: &PretrainConfig,
    setting: &(&str, OptimizerKind, OptimState, Offload),
) -> PretrainConfig {
    let mut config = PretrainConfig {
        optimizer: setting.1,
        optim_state: setting.2,
        offload: setting.3,
        ..base.clone()
    };
    if setting.3 == Offload::Params {
        // The parameters' offload is FSDP's (on one rank each use uploads the whole piece).
        config.parallel.fsdp = wildfire::models::parallelize::FsdpStrategy::FullShard;
    }
    config
}

fn main() {
    wildfire::alloc::keep_freed_memory();
    // A smoke run (`cargo test --all-targets`): the tiny preset, two steps.
    let smoke = common::smoke();
    let steps: usize = common::arg("--steps").unwrap_or(if smoke { 2 } else { 3 });
    let train_steps: usize = common::arg("--train-steps").unwrap_or(if smoke { 2 } else { 200 });
    // One part of the three (the optimizers' table, the planner, the validation losses).
    let only: Option<String> = common::arg("--only");
    let part = |name: &str| only.as_deref().is_none_or(|o| o == name);
    let (preset, bytes, block) = if smoke {
        (Preset::Tiny, true, 64)
    } else {
        (Preset::Gpt2_350m, false, 1024)
    };
    let big = PretrainConfig {
        data: common::corpus(bytes),
        model: ModelFlags {
            preset,
            block_size: Some(block),
            ..PretrainConfig::quiet().model
        },
        batch_size: 1,
        steps,
        gather_parameters: false,
        ..PretrainConfig::quiet()
    };
    if part("table") {
        optimizers_table(&big, steps, block);
    }
    if part("planner") {
        plan_for_two_budgets(&big, smoke);
    }
    if part("losses") {
        losses(smoke, train_steps);
    }
    if part("muon") {
        muon_split(smoke, steps);
    }
}

/// Muon over dp 2, every rank against owner ranks.
fn muon_split(smoke: bool, steps: usize) {
    use wildfire::models::parallelize::{FsdpStrategy, ParallelConfig};
    use wildfire::pretrain::MuonSplit;
    let (preset, block) = if smoke {
        (Preset::Tiny, 64)
    } else {
        (Preset::Gpt2_124m, 1024)
    };
    let config = PretrainConfig {
        data: common::corpus(smoke),
        model: ModelFlags {
            preset,
            block_size: Some(block),
            ..PretrainConfig::quiet().model
        },
        optimizer: OptimizerKind::Muon,
        parallel: ParallelConfig::layout(2, 1, FsdpStrategy::ShardOptimizer, None),
        batch_size: 2,
        steps,
        gather_parameters: false,
        ..PretrainConfig::quiet()
    };
    println!(
        "\n{preset:?}, Muon, dp 2 (ZeRO-1, ranks as threads), batch 1 x {block} per rank, f32; \
         {steps} steps, times the median after the first\n\n\
         | `--muon-split` | Newton-Schulz per rank and step | MB moved per rank and step | step (s) |\n\
         |---|---|---|---|"
    );
    for (name, split) in [("every", MuonSplit::Every), ("owner", MuonSplit::Owner)] {
        let summary = run(&PretrainConfig {
            muon_split: split,
            ..config.clone()
        })
        .expect("run");
        let m = summary.steps.last().expect("a step ran");
        println!(
            "| {name} | {} | {:.1} | {:.1} |",
            summary.orthogonalised / steps as u64,
            m.comm_bytes as f64 / 1e6,
            common::median_step_ms(&summary, 2 * block) / 1e3,
        );
    }
}

/// The optimizers side by side on `big`: peak and state bytes, step time.
fn optimizers_table(big: &PretrainConfig, steps: usize, block: usize) {
    println!(
        "{:?}, batch 1 x {block}, f32, one rank (Flex, this CPU); {steps} steps, times the \
         median after the first\n\n\
         | optimizer | peak bytes | optimizer bytes, device | host bytes | step (s) |\n\
         |---|---|---|---|---|",
        big.model.preset
    );
    // `--setting TEXT`: only the settings whose name contains it.
    let only: Option<String> = common::arg("--setting");
    for setting in SETTINGS
        .iter()
        .filter(|s| only.as_deref().is_none_or(|o| s.0.contains(o)))
    {
        let summary = run(&with(big, setting)).expect("run");
        let m = summary.steps.last().expect("a step ran");
        let step_ms = common::median_step_ms(&summary, block);
        println!(
            "| {} | {:.2} GB | {:.1} MB | {:.1} MB | {:.1} |",
            setting.0,
            m.peak_bytes as f64 / 1e9,
            m.optim_bytes as f64 / 1e6,
            m.host_bytes as f64 / 1e6,
            step_ms / 1e3,
        );
    }
}

/// The validation loss after a short run of the `small` preset, per optimizer.
fn losses(smoke: bool, train_steps: usize) {
    let small = PretrainConfig {
        data: common::corpus(true),
        model: ModelFlags {
            preset: if smoke { Preset::Tiny } else { Preset::Small },
            ..PretrainConfig::quiet().model
        },
        steps: train_steps,
        batch_size: 8,
        warmup: train_steps / 10,
        eval_every: train_steps,
        eval_iters: 8,
        gather_parameters: false,
        ..PretrainConfig::quiet()
    };
    println!(
        "\n{:?}, {train_steps} steps of batch 8 x {}, lr 1e-3 (warmup, cosine), weight decay \
         0.1, embedded corpus (bytes)\n\n\
         | optimizer | validation loss | train loss, last step |\n|---|---|---|",
        small.model.preset,
        small
            .model
            .resolve(256, None)
            .expect("a model")
            .block_size(),
    );
    for setting in &SETTINGS[..5] {
        let summary = run(&with(&small, setting)).expect("run");
        let last = summary.steps.last().expect("a step ran");
        let val = summary
            .steps
            .iter()
            .rev()
            .find_map(|s| s.val_loss)
            .expect("an evaluation");
        println!("| {} | {val:.4} | {:.4} |", setting.0, last.loss);
    }
}

/// The planner on `big` for two per-rank budgets (one measurement, two choices), each choice
/// then run: its flags, predicted and measured peaks.
fn plan_for_two_budgets(big: &PretrainConfig, smoke: bool) {
    use wildfire::pretrain::{PlanMode, plan_on};
    let budgets: [u64; 2] = if smoke {
        [u64::MAX / 4, u64::MAX / 8]
    } else {
        [6_000_000_000, 4_500_000_000]
    };
    let config = PretrainConfig {
        plan: PlanMode::Auto,
        memory_budget: Some(budgets[0]),
        ..big.clone()
    };
    let plan = plan_on::<burn::backend::Flex>(&config, &Default::default()).expect("a plan");
    println!(
        "\nthe planner (`--plan auto`), {} candidates measured once; the measured peak is the \
         largest of the chosen run's steps\n\n\
         | budget | chosen | predicted peak | measured peak | step (s) |\n|---|---|---|---|---|",
        plan.candidates.len()
    );
    for budget in budgets {
        let plan = wildfire::pretrain::Plan::choose(plan.candidates.clone(), budget)
            .expect("a candidate fits");
        let chosen = plan.choice();
        let summary = run(&PretrainConfig {
            memory_budget: Some(budget),
            ..chosen.candidate.apply(big)
        })
        .expect("run");
        let peak = summary
            .steps
            .iter()
            .map(|s| s.peak_bytes)
            .max()
            .unwrap_or(0);
        println!(
            "| {:.2} GB | `{}` | {:.2} GB | {:.2} GB | {:.1} |",
            budget as f64 / 1e9,
            chosen.candidate.flags(),
            chosen.peak_bytes as f64 / 1e9,
            peak as f64 / 1e9,
            common::median_step_ms(&summary, big.model.block_size.unwrap_or(1024)) / 1e3,
        );
    }
}
