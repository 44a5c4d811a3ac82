//! The memory planner (`--plan auto`): which FSDP strategy, recomputation policy, AdamW moment
//! dtype and offload (optimizer, parameters) fit a run into `--memory-budget` per rank, and the fastest of
//! those that do.
//!
//! **Predicted by measuring, not by formula.** For each FSDP strategy × recomputation policy the
//! planner runs three steps of the model cut to `a` and `a + p` blocks (`p`: the block pattern's
//! period, 1 for a GPT, `--moe-every` for a Llama with experts every few blocks; `a` is `p`, or
//! `2p` under full recomputation, which spares the last block) at the run's
//! width, sequence, micro-batch, mesh and precision, on the run's backend, and reads the
//! decorator's accounting of the second step (the optimizer state alive throughout): the peak
//! of live tensor bytes **in each phase** of the step — forward, the loss's backward pass, the
//! recomputed regions' passes, gradient sync, optimizer step ([`wildfire_engine::PhasePeaks`]) —
//! and the step time. Each phase's peak grows with depth by the same amount per `p` blocks, so
//! the full depth `L`'s is the extrapolation `m(a) + ((L − a)/p)·(m(a + p) − m(a))`, phase by
//! phase, and the predicted peak is the largest.
//! (Extrapolating the step's peak alone is wrong when the phase that peaks changes with depth:
//! at one or two blocks of GPT-2 350M under recomputation it is the backward through the
//! 50,257-wide head, at 24 the recomputed blocks' backward with every block's gradient live,
//! 0.84 GB higher than the one line predicted. Without recomputation the backward is one pass,
//! which peaks at its start, every activation live, as long as a block's activations outweigh
//! its gradients — a sequence longer than a third of the width.)
//!
//! The moment dtype and the offload change the optimizer state's device bytes, which
//! [`crate::pretrain::estimate`] counts exactly, and the transients of the sync and the optimizer
//! step (a tensor's moments widened to f32 on the way), which depend on the strategy but not on
//! the recomputation. So each of them is probed once per strategy, under full recomputation: its
//! sync and optimizer phases are its own, its forward and backward the f32 probe's of the same
//! policy shifted by the state's difference, and its step time the f32 one's plus the difference
//! its optimizer made under full recomputation. (With the moments widened per tensor, the 8-bit
//! step's transient is the largest tensor's — the token table — at every depth.)
//!
//! A candidate **fits** when its predicted peak and a 5% margin ([`MARGIN`], the accuracy the
//! tests hold the prediction to: measured within 2% for the tiny GPT) are within the budget,
//! which the run then enforces.
//!
//! **Cheapest** is the levers in the order of what they cost: first the strategy and policy with
//! the shortest predicted step among those that fit (f32 moments on the device); if none fits,
//! the same with bf16 moments (numerics); then with 8-bit moments (more numerics, a slower
//! step); then with the optimizer offloaded (host transfers each step); then, under FSDP's full
//! sharding, with the parameters' shards offloaded too (`--offload params`: an upload per use,
//! probed once like the other variants, its forward and backward shifted by the shards' bytes
//! as well). A budget nothing fits is a typed error naming the smallest predicted peak.

use super::*;
use serde::Serialize;
use wildfire_models::parallelize::{FsdpStrategy, Recompute};

/// The margin a fitting candidate keeps under the budget, as a fraction of its predicted peak.
pub const MARGIN: f64 = 0.05;

/// One configuration the planner considers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Candidate {
    /// The FSDP strategy.
    pub fsdp: FsdpStrategy,
    /// The recomputation policy.
    pub recompute: Recompute,
    /// AdamW's moment dtype.
    pub optim_state: OptimState,
    /// Where the optimizer runs.
    pub offload: Offload,
}

impl Candidate {
    /// `config` with this candidate's choices.
    pub fn apply(&self, config: &PretrainConfig) -> PretrainConfig {
        let mut config = config.clone();
        config.parallel.fsdp = self.fsdp;
        config.parallel.recompute = self.recompute;
        config.optim_state = self.optim_state;
        config.offload = self.offload;
        config
    }

    /// The flags that select it.
    pub fn flags(&self) -> String {
        let fsdp = match self.fsdp {
            FsdpStrategy::NoShard => "none",
            FsdpStrategy::ShardOptimizer => "zero1",
            FsdpStrategy::ShardGradOp => "grad-op",
            FsdpStrategy::FullShard => "full",
            FsdpStrategy::Hybrid => "hybrid",
        };
        let recompute = match self.recompute {
            Recompute::None => "none".to_string(),
            Recompute::Selective => "selective".to_string(),
            Recompute::Full => "full".to_string(),
            Recompute::EveryNth(n) => format!("every-{n}"),
        };
        let state = match self.optim_state {
            OptimState::F32 => "f32",
            OptimState::Bf16 => "bf16",
            OptimState::Int8 => "int8",
        };
        let offload = match self.offload {
            Offload::None => "none",
            Offload::Optimizer => "optimizer",
            Offload::Params => "params",
        };
        format!("--fsdp {fsdp} --recompute {recompute} --optim-state {state} --offload {offload}")
    }

    /// The tier of what it gives up: 0 nothing, 1 bf16 moments, 2 8-bit moments, 3 the
    /// optimizer offloaded, 4 the parameters too.
    fn tier(&self) -> usize {
        match (self.optim_state, self.offload) {
            (OptimState::F32, Offload::None) => 0,
            (OptimState::Bf16, _) => 1,
            (OptimState::Int8, _) => 2,
            (_, Offload::Optimizer) => 3,
            (_, Offload::Params) => 4,
        }
    }
}

/// A candidate and what the planner predicts for it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Predicted {
    /// The configuration.
    pub candidate: Candidate,
    /// Predicted peak of a rank's live device bytes in a step.
    pub peak_bytes: u64,
    /// Predicted host bytes (an offloaded optimizer's moments).
    pub host_bytes: u64,
    /// Predicted step time (seconds, on the measuring machine).
    pub step_s: f64,
    /// Whether it fits the budget.
    pub fits: bool,
}

/// The planner's answer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Plan {
    /// The per-rank budget planned for.
    pub budget: u64,
    /// Every candidate, as measured and extrapolated.
    pub candidates: Vec<Predicted>,
    /// The index of the chosen one.
    pub chosen: usize,
}

impl Predicted {
    /// The smallest budget it fits: its predicted peak and the margin
    /// ([`crate::pretrain::PLAN_MARGIN`]).
    pub fn needs(&self) -> u64 {
        (self.peak_bytes as f64 * (1.0 + MARGIN)).ceil() as u64
    }
}

impl Plan {
    /// The cheapest of `candidates` (their fits recomputed for `budget`): within the first tier
    /// that has a fitting candidate (f32 moments on the device, then bf16 moments, then 8-bit
    /// moments, then the optimizer offloaded, then the parameters too), the shortest predicted
    /// step. An error naming the smallest predicted
    /// peak if none fits.
    pub fn choose(mut candidates: Vec<Predicted>, budget: u64) -> Result<Plan, PretrainError> {
        for c in &mut candidates {
            c.fits = c.needs() <= budget;
        }
        let chosen = (0..5).find_map(|tier| {
            candidates
                .iter()
                .enumerate()
                .filter(|(_, c)| c.fits && c.candidate.tier() == tier)
                .min_by(|a, b| a.1.step_s.total_cmp(&b.1.step_s))
                .map(|(i, _)| i)
        });
        let Some(chosen) = chosen else {
            let smallest = candidates.iter().min_by_key(|c| c.needs()).ok_or_else(|| {
                PretrainError::Config("--plan auto: no candidate to choose from".into())
            })?;
            return Err(PretrainError::Config(format!(
                "no candidate fits --memory-budget {budget}: the smallest predicted per-rank \
                 peak is {} bytes ({}), {} with the planner's 5% margin; raise the budget, add \
                 data-parallel ranks, or shorten the micro-batch",
                smallest.peak_bytes,
                smallest.candidate.flags(),
                smallest.needs()
            )));
        };
        Ok(Plan {
            budget,
            candidates,
            chosen,
        })
    }

    /// The chosen candidate.
    pub fn choice(&self) -> &Predicted {
        &self.candidates[self.chosen]
    }

    /// The candidates as a markdown table, the choice marked.
    pub fn table(&self) -> String {
        let mut out = format!(
            "budget {:.3} GB per rank\n\n| candidate | predicted peak | host | step (s) | fits |\n\
             |---|---|---|---|---|\n",
            self.budget as f64 / 1e9
        );
        for (i, p) in self.candidates.iter().enumerate() {
            out += &format!(
                "| `{}`{} | {:.3} GB | {:.3} GB | {:.3} | {} |\n",
                p.candidate.flags(),
                if i == self.chosen { " (chosen)" } else { "" },
                p.peak_bytes as f64 / 1e9,
                p.host_bytes as f64 / 1e9,
                p.step_s,
                if p.fits { "yes" } else { "no" }
            );
        }
        out
    }
}

/// The block pattern's period: the depth two probes differ by.
fn period(model: &ModelConfig) -> usize {
    match model {
        ModelConfig::Llama(c) => c.moe.as_ref().map_or(1, |m| m.every.max(1)),
        ModelConfig::Gpt(_) => 1,
    }
}

/// `config` with its model (`model`) cut to `n_layer` blocks, run for three quiet steps, without
/// the budget, from random weights (a run from Hugging Face weights holds the same bytes).
fn probe_config(config: &PretrainConfig, model: &ModelConfig, n_layer: usize) -> PretrainConfig {
    let mut probe = config.clone();
    probe.shape_override = Some(model.clone().with_n_layer(n_layer));
    probe.init_from = None;
    probe.plan = PlanMode::Off;
    probe.memory_budget = None;
    probe.steps = 3;
    probe.warmup = 1;
    probe.decay_steps = None;
    probe.eval_every = 0;
    probe.eval_iters = 0;
    probe.sample_tokens = 0;
    probe.save = None;
    probe.save_every = 0;
    probe.resume = None;
    probe.export_hf = None;
    probe.metrics = None;
    probe.plot = None;
    probe.trace = None;
    probe.progress = false;
    probe.gather_parameters = false;
    probe.max_restarts = 0;
    probe.fail_at = None;
    probe
}

/// What a probe measured in its steady step (the second: the optimizer state alive throughout),
/// or that extrapolated to the full depth: the peak of each phase and the step time.
#[derive(Clone, Copy, Debug)]
struct Probe {
    /// Forward, backward, recomputed, sync, optimizer.
    phases: [f64; 5],
    /// The faster of the two steps after the first (seconds).
    step_s: f64,
}

impl Probe {
    fn of(summary: &RunSummary, tokens: usize) -> Self {
        let p = summary.steps[1].phases;
        let step_s = summary.steps[1..]
            .iter()
            .map(|m| tokens as f64 / m.tokens_per_s)
            .fold(f64::INFINITY, f64::min);
        Self {
            phases: [p.forward, p.backward, p.recomputed, p.sync, p.optimizer].map(|b| b as f64),
            step_s,
        }
    }

    /// `short` (at depth `a`) and `long` (one period `p` deeper) carried to depth `depth`, each
    /// phase on its own line.
    fn extrapolate(short: &Self, long: &Self, a: usize, p: usize, depth: usize) -> Self {
        let periods = (depth as f64 - a as f64) / p as f64;
        let line = |s: f64, l: f64| s + periods * (l - s);
        Self {
            phases: std::array::from_fn(|i| line(short.phases[i], long.phases[i])),
            step_s: line(short.step_s, long.step_s).max(short.step_s),
        }
    }
}

/// Probe `config` at two depths a period `p` apart and extrapolate to `model`'s. The shallower is
/// one period, or two under full recomputation, which spares the last block (one block would
/// have no recomputed pass to measure).
fn probe<B: FusedOps>(
    config: &PretrainConfig,
    model: &ModelConfig,
    device: &B::Device,
    p: usize,
    tokens: usize,
) -> Result<Probe, PretrainError> {
    let depth = model.n_layer();
    let a = match config.parallel.recompute {
        Recompute::Full if depth >= 2 * p => 2 * p,
        _ => p,
    };
    let short = Probe::of(
        &run_on::<B>(&probe_config(config, model, a), device)?,
        tokens,
    );
    let long = Probe::of(
        &run_on::<B>(&probe_config(config, model, a + p), device)?,
        tokens,
    );
    Ok(Probe::extrapolate(&short, &long, a, p, depth))
}

/// Plan `config` (see the module docs) on backend `B`: probe runs on `device`.
pub fn plan_on<B: FusedOps>(
    config: &PretrainConfig,
    device: &B::Device,
) -> Result<Plan, PretrainError> {
    let Some(budget) = config.memory_budget else {
        return Err(PretrainError::Config(
            "--plan auto plans for a per-rank budget: give --memory-budget BYTES".into(),
        ));
    };
    if config.launch != Launch::Threads {
        return Err(PretrainError::Config(
            "--plan auto measures its candidates with ranks as threads; under a launcher \
             (mpirun, srun, torchrun) choose --fsdp and --recompute by hand (--estimate helps)"
                .into(),
        ));
    }
    if config.parallel.pp > 1 {
        return Err(PretrainError::Config(
            "--plan auto does not plan pipeline stages (--pp) yet: choose --fsdp and \
             --recompute by hand"
                .into(),
        ));
    }
    let model = load_data(config)?.model;
    let p = period(&model);
    let tokens = config.batch_size * model.block_size();
    let strategies: &[FsdpStrategy] = if config.parallel.dims().shard_degree() > 1 {
        &[
            FsdpStrategy::NoShard,
            FsdpStrategy::ShardOptimizer,
            FsdpStrategy::ShardGradOp,
            FsdpStrategy::FullShard,
        ]
    } else {
        &[FsdpStrategy::NoShard]
    };
    let policies = [Recompute::None, Recompute::Selective, Recompute::Full];
    // AdamW's moment dtype and offload are candidates; another optimizer keeps its own state.
    let variants: &[(OptimState, Offload)] = if config.optimizer == OptimizerKind::Adamw {
        &[
            (OptimState::F32, Offload::None),
            (OptimState::Bf16, Offload::None),
            (OptimState::Int8, Offload::None),
            (OptimState::F32, Offload::Optimizer),
        ]
    } else {
        &[(OptimState::F32, Offload::None)]
    };
    let mut candidates = Vec::new();
    for &fsdp in strategies {
        // The parameters offloaded too, where they are FSDP shards (`--offload params`).
        let variants: Vec<(OptimState, Offload)> = variants
            .iter()
            .copied()
            .chain(
                (fsdp == FsdpStrategy::FullShard && config.optimizer == OptimizerKind::Adamw)
                    .then_some((OptimState::F32, Offload::Params)),
            )
            .collect();
        let at = |recompute, (optim_state, offload)| Candidate {
            fsdp,
            recompute,
            optim_state,
            offload,
        };
        let f32_state = (OptimState::F32, Offload::None);
        let by_policy = policies
            .iter()
            .map(|&r| probe::<B>(&at(r, f32_state).apply(config), &model, device, p, tokens))
            .collect::<Result<Vec<_>, _>>()?;
        // Another moment dtype or the offload changes the sync and the optimizer step (its
        // transients: a tensor's moments widened to f32 on the way) whatever the recomputation:
        // measured once, under full recomputation.
        let full = Recompute::Full;
        let by_variant = variants[1..]
            .iter()
            .map(|&v| probe::<B>(&at(full, v).apply(config), &model, device, p, tokens))
            .collect::<Result<Vec<_>, _>>()?;
        // What lives on the device throughout: the optimizer state, and the parameters' pieces
        // unless offloaded.
        let state = |c: &Candidate| {
            let e = estimate(&c.apply(config), &model);
            (e.optim_bytes + e.param_bytes) as f64
        };
        for (&recompute, measured) in policies.iter().zip(&by_policy) {
            for (v, &variant) in variants.iter().enumerate() {
                let candidate = at(recompute, variant);
                // The forward and backward as measured with f32 moments, the optimizer state
                // (alive throughout) swapped for this one's; the sync and the step its own.
                let shift = state(&candidate) - state(&at(recompute, f32_state));
                let (tail, step_s) = match v {
                    0 => (measured, measured.step_s),
                    _ => {
                        let own = &by_variant[v - 1];
                        let base = &by_policy[policies.len() - 1];
                        (own, measured.step_s + (own.step_s - base.step_s))
                    }
                };
                let phases = [
                    measured.phases[0] + shift,
                    measured.phases[1] + shift,
                    measured.phases[2] + shift,
                    tail.phases[3],
                    tail.phases[4],
                ];
                let peak = phases.into_iter().fold(0.0, f64::max);
                let e = estimate(&candidate.apply(config), &model);
                candidates.push(Predicted {
                    candidate,
                    peak_bytes: peak.round() as u64,
                    host_bytes: e.host_bytes as u64,
                    // (Timing noise could make the difference more than the whole.)
                    step_s: if step_s > 0.0 {
                        step_s
                    } else {
                        measured.step_s
                    },
                    fits: false,
                });
            }
        }
    }
    Plan::choose(candidates, budget)
}

/// What `--plan` does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum PlanMode {
    /// Run the flags as given.
    #[default]
    Off,
    /// Choose the FSDP strategy, recomputation, moment dtype and offload for `--memory-budget`.
    Auto,
}
