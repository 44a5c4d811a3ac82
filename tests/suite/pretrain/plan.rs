//! The memory planner (`--plan auto`): its predicted per-rank peak is the measured one for every
//! candidate it considers, it picks the levers in the order of their cost, and a budget nothing
//! fits is a typed error.

use super::*;
use wildfire::pretrain::{Offload, OptimState, Plan, PlanMode, plan_on};

/// The tiny GPT at 4 blocks (the planner measures 1 and 2) on 2 data ranks.
fn four_blocks() -> PretrainConfig {
    let mut config = PretrainConfig {
        parallel: ParallelConfig::layout(2, 1, FsdpStrategy::NoShard, None),
        memory_budget: Some(u64::MAX / 2),
        plan: PlanMode::Auto,
        ..small(3)
    };
    config.model.n_layer = Some(4);
    config
}

/// `base`'s plan, every candidate run at the full depth: the measured peak of the steady step
/// within 5% of the prediction, the host bytes exactly the prediction's (under a pipeline, the
/// largest rank's of both).
fn predictions_hold(base: &PretrainConfig, candidates: usize) {
    let plan = plan_on::<burn::backend::Flex>(base, &Default::default()).unwrap();
    assert_eq!(plan.candidates.len(), candidates);
    for p in &plan.candidates {
        let config = PretrainConfig {
            plan: PlanMode::Off,
            memory_budget: None,
            ..p.candidate.apply(base)
        };
        let measured = run(&config).unwrap();
        let step = &measured.steps[1];
        // Under a pipeline the stages differ: the largest rank's (the budget is every rank's).
        let (peak, host) = match step.stages.len() {
            0 => (step.peak_bytes, step.host_bytes),
            _ => (
                step.stages.iter().map(|r| r.peak_bytes).max().unwrap(),
                step.stages.iter().map(|r| r.host_bytes).max().unwrap(),
            ),
        };
        let error = (p.peak_bytes as f64 - peak as f64).abs() / peak as f64;
        assert!(
            error <= 0.05,
            "{}: predicted {} bytes, measured {peak} ({:.1}% off)",
            p.candidate.flags(),
            p.peak_bytes,
            100.0 * error
        );
        assert_eq!(host, p.host_bytes, "{}", p.candidate.flags());
    }
}

/// Every candidate — 4 FSDP strategies × 3 recomputation policies × (f32 moments, bf16 moments,
/// 8-bit moments, the optimizer offloaded), and FSDP's full sharding × 3 policies with the
/// parameters offloaded too — run at the full depth: the measured peak of the steady step (the
/// decorator's accounting, rank 0) within 5% of the prediction extrapolated from the 1- and
/// 2-block probes, and the host bytes exactly the estimate's.
#[test]
fn planner_predicts_every_candidates_peak() {
    predictions_hold(&four_blocks(), 4 * 3 * 4 + 3);
}

/// Where the phase that peaks changes with depth, as at GPT-2 350M: under full recomputation
/// the 2- and 3-block probes peak in the loss's backward pass (through the head, before any
/// block's gradient), 32 blocks in the recomputed blocks' passes (every block's gradient live).
/// One line through the probes' step peaks misses the measured peak by more than 5% (the
/// planner's first version did: 0.84 GB at 350M); the planner's lines, phase by phase, hold it
/// within 5% for every candidate.
#[test]
fn planner_follows_the_phase_that_peaks_at_depth() {
    let mut base = PretrainConfig {
        batch_size: 1,
        memory_budget: Some(u64::MAX / 2),
        plan: PlanMode::Auto,
        ..small(3)
    };
    base.model.n_embd = Some(64);
    base.model.n_head = Some(4);
    base.model.block_size = Some(256);
    let at = |layers| {
        let mut config = PretrainConfig {
            plan: PlanMode::Off,
            memory_budget: None,
            ..base.clone()
        };
        config.parallel.recompute = Recompute::Full;
        config.model.n_layer = Some(layers);
        run(&config).unwrap().steps[1].clone()
    };
    let (two, three, deep) = (at(2), at(3), at(32));
    assert!(
        two.phases.backward > two.phases.recomputed,
        "{:?}",
        two.phases
    );
    assert!(
        three.phases.backward > three.phases.recomputed,
        "{:?}",
        three.phases
    );
    assert!(
        deep.phases.recomputed > deep.phases.backward,
        "{:?}",
        deep.phases
    );
    assert_eq!(deep.peak_bytes, deep.phases.max());
    let line = two.peak_bytes as f64 + 30.0 * (three.peak_bytes as f64 - two.peak_bytes as f64);
    let missed = 1.0 - line / deep.peak_bytes as f64;
    assert!(missed > 0.05, "one line is {:.1}% under", 100.0 * missed);
    base.model.n_layer = Some(32);
    predictions_hold(&base, 3 * 4);
}

/// The same for a Llama whose every other block is a mixture of experts (the probes cut it to 2
/// and 4 blocks, one and two periods of its pattern), Muon its optimizer (one state variant per
/// strategy and policy), 8 blocks on 2 data ranks.
#[test]
fn planner_predicts_a_mixture_of_experts_peak() {
    let mut config = PretrainConfig {
        model: wildfire::models::ModelFlags {
            preset: wildfire::models::Preset::LlamaMoeTiny,
            ..PretrainConfig::quiet().model
        },
        optimizer: wildfire::pretrain::OptimizerKind::Muon,
        ..four_blocks()
    };
    config.model.n_layer = Some(8);
    config.model.block_size = Some(1024);
    predictions_hold(&config, 4 * 3);
}

/// With room for everything the planner keeps f32 moments on the device; a budget just under
/// what the smallest such candidate needs (its predicted peak and the 5% margin) takes bf16
/// moments; under those, 8-bit moments; under those, the optimizer offloaded; under those, the
/// parameters offloaded too; under everything,
/// a typed error naming the smallest predicted peak. A run with `--plan auto` trains with the choice, its budget enforced,
/// and reports the plan.
#[test]
fn planner_picks_the_levers_in_order_of_cost() {
    let base = four_blocks();
    let plan = plan_on::<burn::backend::Flex>(&base, &Default::default()).unwrap();
    let smallest = |state: OptimState, offload: Offload| {
        plan.candidates
            .iter()
            .filter(|c| c.candidate.optim_state == state && c.candidate.offload == offload)
            .map(|c| c.needs())
            .min()
            .unwrap()
    };
    let f32_min = smallest(OptimState::F32, Offload::None);
    let bf16_min = smallest(OptimState::Bf16, Offload::None);
    let int8_min = smallest(OptimState::Int8, Offload::None);
    let offload_min = smallest(OptimState::F32, Offload::Optimizer);
    let params_min = smallest(OptimState::F32, Offload::Params);
    assert!(
        params_min < offload_min
            && offload_min < int8_min
            && int8_min < bf16_min
            && bf16_min < f32_min
    );
    let roomy = plan.choice().candidate;
    assert_eq!(
        (roomy.optim_state, roomy.offload),
        (OptimState::F32, Offload::None)
    );
    for (budget, state, offload) in [
        (f32_min, OptimState::F32, Offload::None),
        (f32_min - 1, OptimState::Bf16, Offload::None),
        (bf16_min - 1, OptimState::Int8, Offload::None),
        (int8_min - 1, OptimState::F32, Offload::Optimizer),
        (offload_min - 1, OptimState::F32, Offload::Params),
    ] {
        let chosen = Plan::choose(plan.candidates.clone(), budget).unwrap();
        let c = chosen.choice();
        assert!(c.fits && c.needs() <= budget, "{budget}");
        assert_eq!(
            (c.candidate.optim_state, c.candidate.offload),
            (state, offload),
            "{budget}"
        );
    }
    let err = Plan::choose(plan.candidates.clone(), params_min - 1).unwrap_err();
    assert!(
        matches!(&err, PretrainError::Config(m) if m.contains(&format!("{params_min} with"))),
        "{err}"
    );
    // A run planned for a budget only bf16 moments or offload meet: it trains within it.
    let budget = f32_min - 1;
    let summary = run(&PretrainConfig {
        memory_budget: Some(budget),
        ..base.clone()
    })
    .unwrap();
    let chosen = summary.plan.as_ref().unwrap().choice().candidate;
    assert_ne!(
        (chosen.optim_state, chosen.offload),
        (OptimState::F32, Offload::None)
    );
    assert!(summary.steps.iter().all(|s| s.peak_bytes <= budget));
    // --plan auto needs a budget.
    let err = run(&PretrainConfig {
        memory_budget: None,
        ..base
    })
    .unwrap_err();
    assert!(
        matches!(&err, PretrainError::Config(m) if m.contains("--memory-budget")),
        "{err}"
    );
}

/// `--init-from` a directory `transformers` wrote (its `config.json` gives the shape: grouped
/// heads, an untied head): the probes run that shape cut to fewer blocks from random weights,
/// and every candidate's run from the file's weights peaks as predicted.
#[test]
fn planner_plans_a_run_from_hugging_face_weights() {
    let config = PretrainConfig {
        memory_budget: Some(u64::MAX / 2),
        plan: PlanMode::Auto,
        ..from_transformers_llama(3)
    };
    predictions_hold(&config, 3 * 4);
}

/// Pipeline stages (`--pp 2`, 2 micro-batches), where the ranks hold different parts of the
/// model and the budget binds the fullest: a 7-block GPT splits 4 + 3, the probes run 2 and 4
/// blocks (one and two a stage), and each rank is carried to its own depth on its own lines.
/// Every candidate's largest rank peaks as predicted, within 5%, under the one-forward-one-
/// backward schedule and the interleaved one (two stages a rank: the probes 4 and 8 blocks, the
/// full 10 split 3 + 3 + 2 + 2), and a planned run trains within its budget on every rank.
#[test]
fn planner_plans_pipeline_stages() {
    let pipelined = |virtual_stages: usize, layers: usize| {
        let mut config = PretrainConfig {
            parallel: two_stages(
                ParallelConfig::layout(1, 1, FsdpStrategy::NoShard, None),
                virtual_stages,
            ),
            memory_budget: Some(u64::MAX / 2),
            plan: PlanMode::Auto,
            ..small(3)
        };
        config.model.n_layer = Some(layers);
        config
    };
    predictions_hold(&pipelined(1, 7), 3 * 4);
    predictions_hold(&pipelined(2, 10), 3 * 4);
    // pp 2 × dp 2: every FSDP strategy (the parameters offloaded too under full sharding), the
    // largest of a stage's data-parallel ranks.
    let mut sharded = pipelined(1, 7);
    sharded.parallel.dp = 2;
    predictions_hold(&sharded, 4 * 3 * 4 + 3);
    // The ranks differ: a plan that read rank 0 alone would miss the other's peak.
    let base = pipelined(1, 7);
    let plan = plan_on::<burn::backend::Flex>(&base, &Default::default()).unwrap();
    let budget = plan.choice().needs();
    let summary = run(&PretrainConfig {
        memory_budget: Some(budget),
        ..base
    })
    .unwrap();
    for step in &summary.steps {
        assert_eq!(step.stages.len(), 2);
        assert!(step.stages.iter().all(|r| r.peak_bytes <= budget));
    }
    let [first, last] = [&summary.steps[1].stages[0], &summary.steps[1].stages[1]];
    assert_ne!(first.peak_bytes, last.peak_bytes);
}
