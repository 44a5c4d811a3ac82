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
//! The moment dtype and the offload change the optimizer state's device bytes (the resident
//! bytes after a step, which the probes read), and the transients of the sync and the optimizer
//! step (a tensor's moments widened to f32 on the way) and, with the parameters offloaded, of
//! the passes (a parameter uploaded for its use), which depend on the strategy but not on
//! the recomputation. So each of them is probed once per strategy, under full recomputation: its
//! sync and optimizer phases are its own, its forward and backward the f32 probe's of the same
//! policy shifted by what the variant changed in that phase under full recomputation (the
//! resident bytes' difference where full recomputation has no such phase), and its step time the
//! f32 one's plus the difference its optimizer made under full recomputation. (With the moments widened per tensor, the 8-bit
//! step's transient is the largest tensor's — the token table — at every depth.)
//!
//! **Under a pipeline** (`--pp`) the ranks hold different parts of the model — the token table
//! on the first stage, the head on the last, the most micro-batches in flight on the first —
//! and the budget binds every rank. The probes gather each pipeline position's phase peaks and
//! resident bytes, the largest over the data-parallel ranks there
//! ([`StepMetrics::stages`]), with `pp·a` and `pp·(a + p)` blocks (times the virtual stages):
//! every stage gains a period. Each rank is extrapolated on its own lines to the blocks it holds
//! at full depth, the prediction is the largest rank's (see [`probe`] for an interleaved split
//! the stages do not share evenly), and the variants' shifts are each rank's own measured
//! differences.
//!
//! **One launch.** The probes run inside one job of the run's mesh, every rank running each
//! probe with the others ([`plan_in_job`]): ranks as threads, or one process each under
//! `mpirun`/`srun`/`torchrun`, where a process can be launched once (MPI is initialised once)
//! and the run itself plans inside its launch before it builds the model. Every probe gathers
//! its peaks and its slowest rank's step time over the mesh, so every rank computes the same
//! plan from the same numbers, with no message to agree on it.
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

    /// `config` with the chosen candidate's flags, checked, to train with; with `log`, the
    /// choice and the table logged.
    pub(super) fn chosen_config(
        &self,
        config: &PretrainConfig,
        log: bool,
    ) -> Result<PretrainConfig, PretrainError> {
        let chosen = PretrainConfig {
            plan: PlanMode::Off,
            ..self.choice().candidate.apply(config)
        };
        if log {
            tracing::info!(
                "--plan auto: {} (predicted peak {} bytes per rank)\n{}",
                self.choice().candidate.flags(),
                self.choice().peak_bytes,
                self.table()
            );
        }
        chosen.check()?;
        Ok(chosen)
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

/// `config` run for three quiet steps, without the budget, from random weights (a run from
/// Hugging Face weights holds the same bytes); the probe's model, cut to fewer blocks, is its
/// [`RunData`]'s.
fn probe_config(config: &PretrainConfig) -> PretrainConfig {
    let mut probe = config.clone();
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
    probe.probe = true;
    probe
}

/// What a probe measured in its steady step (the second: the optimizer state alive throughout),
/// or that extrapolated to the full depth: per pipeline rank (one without a pipeline), the
/// largest over the mesh's ranks there, the peak of each phase and the bytes alive between steps
/// and in host memory; and the step time.
#[derive(Clone, Debug)]
struct Probe {
    /// Per pipeline rank: forward, backward, recomputed, sync, optimizer.
    phases: Vec<[f64; 5]>,
    /// Per pipeline rank: the bytes alive after the step (parameters' pieces, optimizer state).
    resident: Vec<f64>,
    /// Per pipeline rank: the bytes in host memory.
    host: Vec<f64>,
    /// The faster of the two steps after the first, each the slowest rank's (seconds).
    step_s: f64,
}

impl Probe {
    /// The probe's steady step, from every rank's peaks ([`StepMetrics::stages`], which the
    /// probes gather: every process of a job reads the same numbers and plans the same).
    fn of(summary: &RunSummary) -> Self {
        let ranks = &summary.steps[1].stages;
        let step_s = summary.steps[1..]
            .iter()
            .map(|m| m.stages.iter().map(|r| r.seconds).fold(0.0, f64::max))
            .fold(f64::INFINITY, f64::min);
        Self {
            phases: ranks
                .iter()
                .map(|r| {
                    let p = r.phases;
                    [p.forward, p.backward, p.recomputed, p.sync, p.optimizer].map(|b| b as f64)
                })
                .collect(),
            resident: ranks.iter().map(|r| r.resident_bytes as f64).collect(),
            host: ranks.iter().map(|r| r.host_bytes as f64).collect(),
            step_s,
        }
    }

    /// `short` and `long` (one period deeper on every stage) carried to the full depth: per
    /// rank, `periods[r]` periods past `short` on the line through both, plus what `uneven` (the
    /// `short` split with the full one's extra blocks) added to `short`; the step time
    /// `step_periods` along its line.
    fn extrapolate(
        short: &Self,
        long: &Self,
        uneven: Option<&Self>,
        periods: &[f64],
        step_periods: f64,
    ) -> Self {
        let line = |r: usize, s: f64, l: f64, u: Option<f64>| {
            s + periods[r] * (l - s) + u.map_or(0.0, |u| u - s)
        };
        let per_rank = |pick: fn(&Self) -> &Vec<f64>| -> Vec<f64> {
            (0..periods.len())
                .map(|r| line(r, pick(short)[r], pick(long)[r], uneven.map(|u| pick(u)[r])))
                .collect()
        };
        Self {
            phases: (0..periods.len())
                .map(|r| {
                    let at = |p: &Self, i: usize| p.phases[r][i];
                    std::array::from_fn(|i| {
                        line(r, at(short, i), at(long, i), uneven.map(|u| at(u, i)))
                    })
                })
                .collect(),
            resident: per_rank(|p| &p.resident),
            host: per_rank(|p| &p.host),
            step_s: (short.step_s + step_periods * (long.step_s - short.step_s)).max(short.step_s),
        }
    }
}

/// The blocks each pipeline rank holds of a model `depth` blocks deep under `config`'s schedule
/// (the balanced split, the longer runs first, a rank's stages `r`, `r + pp`, …); `[depth]`
/// without a pipeline.
fn rank_blocks(config: &PretrainConfig, depth: usize) -> Result<Vec<usize>, PretrainError> {
    if config.parallel.pp <= 1 {
        return Ok(vec![depth]);
    }
    let schedule = config.parallel.schedule()?;
    let plan = wildfire_parallel::pipeline::StagePlan::balanced(depth, schedule.stages())?;
    Ok((0..schedule.ranks())
        .map(|rank| schedule.stages_of(rank).map(|s| plan.blocks(s).len()).sum())
        .collect())
}

/// Probe `config` at two depths a period `p` per stage apart and extrapolate to `model`'s. The
/// shallower is one period per stage `a`, or two: without a pipeline under full recomputation,
/// which spares the last block (one block would have no recomputed pass to measure); under a
/// pipeline where the model has three periods a stage, because a stage of one block peaks at
/// another moment of its backward than a longer one (measured at pp 2 × dp 2, one sequence a
/// micro-batch: the first stage's peak grew 279,808 bytes from one block to two, then 293,248
/// a block).
///
/// Each pipeline rank is carried on its own lines. With one stage a rank, through the blocks
/// it holds. With several (the interleaved schedule) and a split the stages share evenly,
/// through the blocks of one stage. With several and an uneven split, the rank's stages differ —
/// its first ones hold a block more — and what it holds is not a function of its total: the
/// activations of a stage weigh by the micro-batches in flight there, a stage re-materialised
/// whole weighs by its own length. A third probe then runs the short split with the full one's
/// extra blocks (`stages·a + depth mod stages` blocks): linear in each stage's blocks, the full
/// depth is the short probe, whole periods along the line to the long one, and the third's
/// difference from the short for the extra blocks.
fn probe<B: FusedOps>(
    config: &PretrainConfig,
    data: &RunData,
    device: &DistDevice<B>,
    p: usize,
) -> Result<Probe, PretrainError> {
    let model = &data.model;
    let depth = model.n_layer();
    let (stages, pp) = match config.parallel.pp {
        0 | 1 => (1, 1),
        pp => (config.parallel.schedule()?.stages(), pp),
    };
    let a = match config.parallel.recompute {
        Recompute::Full if stages == 1 && depth >= 2 * p => 2 * p,
        _ if stages > 1 && depth >= 3 * p * stages => 2 * p,
        _ => p,
    };
    let measure = |n_layer: usize| -> Result<Probe, PretrainError> {
        let cut = RunData {
            model: model.clone().with_n_layer(n_layer),
            ..data.clone()
        };
        Ok(Probe::of(&super::run_on_rank(
            &probe_config(config),
            &cut,
            device,
        )?))
    };
    let (short, long) = (measure(stages * a)?, measure(stages * (a + p))?);
    let step_periods = (depth as f64 / stages as f64 - a as f64) / p as f64;
    if stages > pp && !depth.is_multiple_of(stages) {
        let uneven = measure(stages * a + depth % stages)?;
        let periods = vec![((depth / stages) as f64 - a as f64) / p as f64; pp];
        return Ok(Probe::extrapolate(
            &short,
            &long,
            Some(&uneven),
            &periods,
            step_periods,
        ));
    }
    let [s, l, f] = [stages * a, stages * (a + p), depth].map(|n| rank_blocks(config, n));
    let (s, l, f) = (s?, l?, f?);
    let periods: Vec<f64> = (0..s.len())
        .map(|r| (f[r] as f64 - s[r] as f64) / (l[r] as f64 - s[r] as f64))
        .collect();
    Ok(Probe::extrapolate(
        &short,
        &long,
        None,
        &periods,
        step_periods,
    ))
}

/// Plan `config` (see the module docs) on backend `B`: one job of the run's mesh, launched as
/// the run would be (ranks as threads sharing `device`, or this process's rank under `mpirun` or
/// `srun`), whose ranks run every probe together. The plan is this process's
/// first rank's (every rank's is the same).
pub fn plan_on<B: FusedOps>(
    config: &PretrainConfig,
    device: &B::Device,
) -> Result<Plan, PretrainError> {
    budget_of(config)?;
    let data = load_data(config)?;
    let job = job_spec(config)?;
    let launched = wildfire_parallel::launch_job(&job, device, &HostLaunch, |d: DistDevice<B>| {
        plan_in_job(config, &data, &d)
    })?;
    super::first_or_root_cause(launched.results)
}

/// `--plan auto`'s budget: `--memory-budget`, which it needs.
fn budget_of(config: &PretrainConfig) -> Result<u64, PretrainError> {
    config.memory_budget.ok_or_else(|| {
        PretrainError::Config(
            "--plan auto plans for a per-rank budget: give --memory-budget BYTES".into(),
        )
    })
}

/// Plan `config` over `data` (see the module docs) on this rank of a launched job (`device`):
/// every rank of the job calls it, runs each probe with the others, and reaches the same plan —
/// the probes' peaks and step times are gathered over the mesh ([`StepMetrics::stages`]), so
/// every process reads the same numbers.
pub(super) fn plan_in_job<B: FusedOps>(
    config: &PretrainConfig,
    data: &RunData,
    device: &DistDevice<B>,
) -> Result<Plan, PretrainError> {
    let budget = budget_of(config)?;
    let model = data.model.clone();
    let p = period(&model);
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
            .map(|&r| probe(&at(r, f32_state).apply(config), data, device, p))
            .collect::<Result<Vec<_>, _>>()?;
        // Another moment dtype or the offload changes the sync and the optimizer step (its
        // transients: a tensor's moments widened to f32 on the way) whatever the recomputation:
        // measured once, under full recomputation.
        let full = Recompute::Full;
        let by_variant = variants[1..]
            .iter()
            .map(|&v| probe(&at(full, v).apply(config), data, device, p))
            .collect::<Result<Vec<_>, _>>()?;
        let base = &by_policy[policies.len() - 1];
        for (&recompute, measured) in policies.iter().zip(&by_policy) {
            for (v, &variant) in variants.iter().enumerate() {
                let candidate = at(recompute, variant);
                // The forward and backward as measured with f32 moments, what lives on the
                // device throughout (the optimizer state, the parameters' pieces unless
                // offloaded) swapped for this one's; the sync and the step its own.
                let (own, step_s) = match v {
                    0 => (measured, measured.step_s),
                    _ => {
                        let own = &by_variant[v - 1];
                        (own, measured.step_s + (own.step_s - base.step_s))
                    }
                };
                let peak = (0..measured.phases.len())
                    .map(|r| {
                        let (m, t, b) = (&measured.phases[r], &own.phases[r], &base.phases[r]);
                        let shift = |i: usize| match v {
                            0 => 0.0,
                            _ if b[i] > 0.0 => t[i] - b[i],
                            _ => own.resident[r] - base.resident[r],
                        };
                        [
                            m[0] + shift(0),
                            m[1] + shift(1),
                            m[2] + shift(2),
                            t[3],
                            t[4],
                        ]
                        .into_iter()
                        .fold(0.0, f64::max)
                    })
                    .fold(0.0, f64::max);
                // Host bytes: the estimate's without a pipeline (exact), else the largest
                // rank's, extrapolated like the peaks.
                let host_bytes = if config.parallel.pp > 1 {
                    own.host.iter().copied().fold(0.0, f64::max).round() as u64
                } else {
                    estimate(&candidate.apply(config), &model).host_bytes as u64
                };
                candidates.push(Predicted {
                    candidate,
                    peak_bytes: peak.round() as u64,
                    host_bytes,
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
