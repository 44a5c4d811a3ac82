//! The GPT pretraining driver, one file per theme: [`learning`] (a real corpus, parallel runs
//! against one rank, precision), [`checkpoints`] (resume, export), [`config`] (refusals, the
//! estimate, the launcher, defaults), [`overlap`] (collectives, traces, links, prefetch, buckets)
//! and [`pipeline`]. The helpers they share are here.

mod checkpoints;
mod config;
mod data;
mod elastic;
mod learning;
mod llama;
mod moe;
mod optimizers;
mod overlap;
mod pipeline;
mod plan;

use crate::suite::{losses_close, pairs, tensors_close};
use std::path::PathBuf;
use wildfire::models::ModelFlags;
use wildfire::models::Preset;
use wildfire::models::data::{DataFlags, TokenizerKind};
use wildfire::models::parallelize::{FsdpStrategy, ParallelConfig, Recompute};
use wildfire::pretrain::{Collectives, Precision, PretrainConfig, PretrainError, RunSummary, run};

/// A CI-sized model on the embedded corpus.
fn small(steps: usize) -> PretrainConfig {
    PretrainConfig {
        model: crate::suite::tiny_gpt_flags(),
        steps,
        batch_size: 4,
        warmup: 2,
        decay_steps: Some(10),
        eval_iters: 2,
        log_every: 1000,
        ..PretrainConfig::quiet()
    }
}

/// `layout` with two pipeline ranks, two micro-batches a step, and `virtual_stages` stages a
/// rank (the interleaved schedule when more than one, else the default).
fn two_stages(layout: ParallelConfig, virtual_stages: usize) -> ParallelConfig {
    ParallelConfig {
        pp: 2,
        microbatches: 2,
        pp_virtual: virtual_stages,
        pp_schedule: if virtual_stages > 1 {
            "interleaved".into()
        } else {
            ParallelConfig::default().pp_schedule
        },
        ..layout
    }
}

/// `layout` in two pipeline stages on `schedule` with `m` micro-batches a step.
fn pipelined(layout: ParallelConfig, schedule: &str, m: usize) -> ParallelConfig {
    ParallelConfig {
        pp: 2,
        pp_schedule: schedule.into(),
        microbatches: m,
        ..layout
    }
}

/// One rank accumulating `n` micro-batches of `base`, run once per `n` and kept in `runs`.
fn accumulating<'a>(
    runs: &'a mut std::collections::HashMap<usize, RunSummary>,
    base: &PretrainConfig,
    n: usize,
) -> &'a RunSummary {
    runs.entry(n).or_insert_with(|| {
        run(&PretrainConfig {
            accum: n,
            ..base.clone()
        })
        .unwrap()
    })
}

/// The tiny Llama directory `transformers` wrote (grouped heads, an untied head).
fn transformers_llama_dir() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama_tiny/untied")
}

/// [`small`] started from [`transformers_llama_dir`] (its `config.json` the shape), context 24.
fn from_transformers_llama(steps: usize) -> PretrainConfig {
    PretrainConfig {
        model: ModelFlags {
            preset: Preset::LlamaTiny,
            block_size: Some(24),
            ..small(steps).model
        },
        init_from: Some(transformers_llama_dir()),
        ..small(steps)
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wildfire-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `got` is `expected` bit for bit, tensor by tensor.
fn same_bits(what: &str, got: &[Vec<f32>], expected: &[Vec<f32>]) {
    for (p, q) in pairs(got, expected) {
        assert_eq!(bits(p), bits(q), "{what}");
    }
}

/// The losses of a run saved part-way (`first`) and then resumed, step by step.
fn resumed_losses(first: &RunSummary, resumed: &RunSummary) -> Vec<f32> {
    first
        .steps
        .iter()
        .chain(&resumed.steps)
        .map(|s| s.loss)
        .collect()
}

fn losses(run: &RunSummary) -> Vec<f32> {
    run.steps.iter().map(|s| s.loss).collect()
}

/// `got` is `expected` within `tol` (relative): every step's loss, validation loss and gradient
/// norm, and every parameter at the end.
fn same_run(what: &str, got: &RunSummary, expected: &RunSummary, tol: f32) {
    same_steps(what, got, expected, tol);
    assert_eq!(got.parameters.len(), expected.parameters.len(), "{what}");
    tensors_close(what, &got.parameters, &expected.parameters, tol);
}

/// [`same_run`]'s step records only: losses, validation losses and gradient norms.
fn same_steps(what: &str, got: &RunSummary, expected: &RunSummary, tol: f32) {
    losses_close(what, &got.steps, &expected.steps, tol);
    for (a, b) in pairs(&got.steps, &expected.steps) {
        assert_eq!(a.val_loss.is_some(), b.val_loss.is_some(), "{what}");
        if let (Some(x), Some(y)) = (a.val_loss, b.val_loss) {
            assert!((x - y).abs() <= tol * y, "{what}: val loss {x} vs {y}");
        }
        assert!(
            (a.grad_norm - b.grad_norm).abs() <= 10.0 * tol * b.grad_norm,
            "{what} step {}: grad norm {} vs {}",
            a.step,
            a.grad_norm,
            b.grad_norm
        );
    }
}

/// The memory estimate of `base`'s model equals the decorator's accounting of one step:
/// parameter, gradient and AdamW-state bytes under DDP, ZeRO-2 and FSDP on 2 ranks, tensor
/// parallelism on 2, and FSDP over dp 2 × tp 2 (the vocabulary the data's, via `load_data`).
fn estimate_matches_the_accounting(base: &PretrainConfig) {
    estimate_matches_the_accounting_at(
        base,
        &[
            (2, 1, FsdpStrategy::NoShard),
            (2, 1, FsdpStrategy::ShardGradOp),
            (2, 1, FsdpStrategy::FullShard),
            (1, 2, FsdpStrategy::NoShard),
            (2, 2, FsdpStrategy::FullShard),
        ],
    );
}

/// [`estimate_matches_the_accounting`] at the `(dp, tp, fsdp)` layouts given.
fn estimate_matches_the_accounting_at(
    base: &PretrainConfig,
    layouts: &[(usize, usize, FsdpStrategy)],
) {
    let layouts: Vec<ParallelConfig> = layouts
        .iter()
        .map(|&(dp, tp, fsdp)| ParallelConfig::layout(dp, tp, fsdp, None))
        .collect();
    estimate_matches_the_accounting_on(base, &layouts);
}

/// [`estimate_matches_the_accounting`] on the parallel layouts given.
fn estimate_matches_the_accounting_on(base: &PretrainConfig, layouts: &[ParallelConfig]) {
    use wildfire::pretrain::{estimate, load_data};
    for parallel in layouts {
        let (dp, tp, ep, fsdp) = (parallel.dp, parallel.tp, parallel.ep, parallel.fsdp);
        let config = PretrainConfig {
            parallel: parallel.clone(),
            ..base.clone()
        };
        let summary = run(&config).unwrap();
        let model = load_data(&config).unwrap().model;
        assert_eq!(summary.model.as_ref(), Some(&model));
        let e = estimate(&config, &model);
        let m = &summary.steps[0];
        let estimated =
            [e.param_bytes, e.grad_bytes, e.optim_bytes, e.host_bytes].map(|b| b as u64);
        assert_eq!(
            [m.param_bytes, m.grad_bytes, m.optim_bytes, m.host_bytes],
            estimated,
            "dp {dp} tp {tp} ep {ep} {fsdp:?}"
        );
    }
}
