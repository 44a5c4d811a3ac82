//! Pipeline runs (ranks as threads, a `pp` axis) against one device running the same blocks on
//! the same micro-batches: losses and every parameter after AdamW steps, the messages each rank
//! sent and received against the schedule's prediction, the activations it held against the
//! schedule's simulation, and the failures (a dead stage, an unsupported schedule).

use super::*;
use crate::pipeline::{
    Costs, Schedule, ScheduleKind, StagePlan, StepOptions, pipeline, run_step, run_step_with,
};
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;

type A = Autodiff<Flex>;

#[derive(Module, Debug)]
struct Block<B: Backend> {
    linear: Linear<B>,
}

impl<B: Backend> Block<B> {
    fn new(d: usize, seed: u64, device: &B::Device) -> Self {
        let w = Tensor::from_data(values(&[d, d], seed), device).mul_scalar(0.5);
        let b = Tensor::from_data(values(&[d], seed + 1000), device).mul_scalar(0.1);
        Self {
            linear: Linear {
                weight: Param::from_tensor(w),
                bias: Some(Param::from_tensor(b)),
            },
        }
    }

    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        x.clone() + activation::gelu(self.linear.forward(x))
    }
}

/// A run of consecutive blocks: one pipeline stage, or the whole model on one device.
#[derive(Module, Debug)]
struct Blocks<B: Backend> {
    blocks: Vec<Block<B>>,
}

impl<B: Backend> Blocks<B> {
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.blocks.iter().fold(x, |x, b| b.forward(x))
    }

    fn values(&self) -> Vec<Vec<f32>> {
        self.blocks
            .iter()
            .flat_map(|b| {
                let bias = b.linear.bias.as_ref().expect("a bias").val();
                [b.linear.weight.val().into_data(), bias.into_data()]
            })
            .map(|d| d.to_vec::<f32>().unwrap())
            .collect()
    }
}

const D: usize = 8;
const PER_STAGE: usize = 2;
const STEPS: usize = 3;

fn input(step: usize, mb: usize) -> TensorData {
    values(&[2, 3, D], 7_000 + 100 * step as u64 + mb as u64)
}

fn target(step: usize, mb: usize) -> TensorData {
    values(&[2, 3, D], 9_000 + 100 * step as u64 + mb as u64)
}

fn mse<B: Backend>(out: Tensor<B, 3>, step: usize, mb: usize) -> Tensor<B, 1> {
    let t = Tensor::<B, 3>::from_data(target(step, mb), &out.device());
    (out - t).powi_scalar(2).mean()
}

fn adamw() -> AdamWConfig {
    AdamWConfig::new().with_weight_decay(0.01)
}

/// One device: every stage's blocks in order, the micro-batches' gradients accumulated, AdamW.
/// The mean loss of each step and the final parameters.
fn one_device(stages: usize, m: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
    let device = Default::default();
    let mut model = Blocks::<A> {
        blocks: (0..stages * PER_STAGE)
            .map(|i| Block::new(D, i as u64, &device))
            .collect(),
    };
    let mut optim = adamw().init::<A, Blocks<A>>();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let mut acc = burn::optim::GradientsAccumulator::new();
        let mut sum = 0.0;
        for mb in 0..m {
            let x = Tensor::<A, 3>::from_data(input(step, mb), &device);
            let loss = mse(model.forward(x), step, mb);
            sum += loss.clone().into_scalar();
            let grads = loss.div_scalar(m as f64).backward();
            acc.accumulate(&model, GradientsParams::from_grads(grads, &model));
        }
        losses.push(sum / m as f32);
        model = optim.step(1e-2, model, acc.grads());
    }
    (losses, model.values())
}

/// What a pipeline rank ends with.
struct RankRun {
    losses: Vec<f32>,
    /// Per chunk, its blocks' values.
    chunks: Vec<Vec<Vec<f32>>>,
    p2p: Vec<(usize, usize)>,
    peak_held: usize,
    /// Per step, the weight gradients the `W` actions computed.
    deferred: Vec<usize>,
    /// Per step, the most bytes of distributed tensors alive at once (the decorator's
    /// accounting; 0 on plain Flex).
    peak_bytes: Vec<u64>,
}

/// `schedule` run for `STEPS` steps on plain Flex ranks.
fn pipelined(schedule: &Schedule) -> Vec<RankRun> {
    pipelined_on::<A>(schedule, |_| Default::default(), false, false)
}

/// `schedule` run for `STEPS` steps, each rank's chunks on `B` on the device `device_of` gives;
/// `split`: with the rank's context (the `Distributed` backend's deferred weight gradients) and
/// gradients kept unreduced.
fn pipelined_on<B: AutodiffBackend>(
    schedule: &Schedule,
    device_of: impl Fn(&DistDevice<F>) -> B::Device + Sync,
    split: bool,
    rematerialize: bool,
) -> Vec<RankRun> {
    let p = schedule.ranks();
    let v = schedule.stages() / p;
    let mesh = DeviceMesh::new([("pp", p)]).unwrap();
    threads(&mesh, |device| {
        let comm = device.context().comm_arc();
        let r = device.rank();
        let inner = device_of(&device);
        // Chunk c is stage c·p + r, its blocks as the plan splits them.
        let plan = StagePlan::even(schedule.stages() * PER_STAGE, schedule.stages()).unwrap();
        let mut chunks: Vec<Blocks<B>> = plan
            .chunks(schedule, r)
            .unwrap()
            .into_iter()
            .map(|range| Blocks {
                blocks: range.map(|i| Block::new(D, i as u64, &inner)).collect(),
            })
            .collect();
        assert_eq!(chunks.len(), v);
        let mut optims: Vec<_> = (0..v).map(|_| adamw().init::<B, Blocks<B>>()).collect();
        let (mut losses, mut p2p, mut peak_held, mut deferred) =
            (Vec::new(), Vec::new(), 0, Vec::new());
        let mut peak_bytes = Vec::new();
        let ctx = device.context();
        for step in 0..STEPS {
            ctx.set_no_sync(split);
            ctx.reset_peak_bytes();
            let out = run_step_with(
                schedule,
                &*comm,
                0,
                &chunks,
                StepOptions {
                    ctx: (split || rematerialize).then_some(&**ctx),
                    rematerialize,
                    ..StepOptions::default()
                },
                |chunk: &Blocks<B>, stage, mb, x| {
                    let x = x.unwrap_or_else(|| {
                        assert_eq!(stage, 0);
                        Tensor::from_data(input(step, mb), &inner)
                    });
                    chunk.forward(x)
                },
                |mb, out| mse(out, step, mb),
            )
            .unwrap();
            ctx.set_no_sync(false);
            if !out.losses.is_empty() {
                losses.push(out.losses.iter().sum::<f32>() / out.losses.len() as f32);
            }
            p2p.push((out.sends, out.recvs));
            peak_held = peak_held.max(out.peak_held);
            deferred.push(out.deferred);
            peak_bytes.push(ctx.peak_bytes());
            chunks = chunks
                .into_iter()
                .zip(out.grads)
                .zip(&mut optims)
                .map(|((chunk, grads), optim)| optim.step(1e-2, chunk, grads))
                .collect();
        }
        RankRun {
            losses,
            chunks: chunks.iter().map(Blocks::values).collect(),
            p2p,
            peak_held,
            deferred,
            peak_bytes,
        }
    })
}

/// GPipe, 1F1B and interleaved 1F1B (V = 2) at p = 2 and 4 with M = 4 and 8: the losses and
/// every parameter after 3 AdamW steps within 1e-6 of one device (the same micro-batch
/// gradients, accumulated in the same order); each rank sent and received exactly the messages
/// the schedule predicts, every step; and held at most the micro-batches the schedule's
/// simulation holds (1F1B ≤ p, GPipe M).
#[test]
fn pipelines_match_one_device() {
    for (kind, v) in [
        (ScheduleKind::GPipe, 1),
        (ScheduleKind::OneFOneB, 1),
        (ScheduleKind::Interleaved, 2),
    ] {
        for p in [2, 4] {
            for m in [4, 8] {
                let schedule = Schedule::new(kind, p, m, v).unwrap();
                let ranks = pipelined(&schedule);
                check_against_one_device(&schedule, &ranks);
                assert!(ranks.iter().all(|r| r.deferred.iter().all(|&d| d == 0)));
            }
        }
    }
}

/// ZB-H1 on the `Distributed` backend at p = 2 and 4 with M = 4 and 8: the same parity, counts
/// and peaks as the other schedules, and on every stage but the first (whose backwards stay
/// whole: it has no input gradient to send) every linear layer's weight gradient (one per block,
/// `PER_STAGE` per stage, for each of the M micro-batches) deferred by its `I` action and
/// computed by its `W`, every step.
#[test]
fn zero_bubble_defers_weight_gradients_and_matches_one_device() {
    for p in [2, 4] {
        for m in [4, 8] {
            let schedule = Schedule::new(ScheduleKind::ZeroBubble, p, m, 1).unwrap();
            let ranks =
                pipelined_on::<Autodiff<Distributed<F>>>(&schedule, |d| d.clone(), true, false);
            check_against_one_device(&schedule, &ranks);
            for (r, run) in ranks.iter().enumerate() {
                let splits = schedule
                    .actions(r)
                    .iter()
                    .filter(|a| a.work == crate::pipeline::Work::BackwardInput)
                    .count();
                // The first stage has no input gradient to send: its backwards stay whole.
                assert_eq!(splits, if r == 0 { 0 } else { m }, "p={p} m={m} rank {r}");
                assert_eq!(
                    run.deferred,
                    vec![PER_STAGE * splits; STEPS],
                    "p={p} m={m} rank {r}"
                );
            }
        }
    }
}

/// Held activations in bytes, from the decorator's accounting (rank 0 of p = 2, the peak of the
/// last step, after the optimizer state exists): GPipe's peak grows by one micro-batch's
/// activations per micro-batch (exactly linear in M), 1F1B's does not grow with M at all (it
/// holds p micro-batches), and at M = 8 GPipe holds more than 1F1B; re-materialised, GPipe
/// computes the same values holding only each micro-batch's stage input.
#[test]
fn one_f_one_b_holds_p_micro_batches_where_gpipe_holds_m() {
    let run = |kind: ScheduleKind, m: usize, remat: bool| {
        let schedule = Schedule::new(kind, 2, m, 1).unwrap();
        pipelined_on::<Autodiff<Distributed<F>>>(&schedule, |d| d.clone(), false, remat)
    };
    let peak = |kind: ScheduleKind, m: usize| run(kind, m, false)[0].peak_bytes[STEPS - 1];
    let (g2, g4, g8) = (
        peak(ScheduleKind::GPipe, 2),
        peak(ScheduleKind::GPipe, 4),
        peak(ScheduleKind::GPipe, 8),
    );
    let per_micro_batch = (g4 - g2) / 2;
    assert!(
        per_micro_batch > 0 && g4 - g2 == 2 * per_micro_batch,
        "{g2} {g4}"
    );
    assert_eq!(
        g8 - g4,
        4 * per_micro_batch,
        "GPipe holds all M micro-batches"
    );
    let (o4, o8) = (
        peak(ScheduleKind::OneFOneB, 4),
        peak(ScheduleKind::OneFOneB, 8),
    );
    assert_eq!(o4, o8, "1F1B holds p micro-batches, whatever M");
    assert!(g8 > o8 + 4 * per_micro_batch, "GPipe {g8}, 1F1B {o8}");
    // Re-materialisation: the same arithmetic (bitwise the same parameters and losses), and
    // each stage keeps only its input per micro-batch — the first stage (which reads its
    // micro-batches itself) nothing, whatever the schedule and M; the last stage under GPipe
    // exactly its M inputs ([2, 3, D] f32 each).
    let input_bytes = (2 * 3 * D * 4) as u64;
    let mut first = Vec::new();
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        for m in [4, 8] {
            let (plain, again) = (run(kind, m, false), run(kind, m, true));
            for (a, b) in plain.iter().zip(&again) {
                assert_eq!(a.chunks, b.chunks, "{kind:?}");
                assert_eq!(a.losses, b.losses, "{kind:?}");
            }
            let (kept, remat) = (
                plain[0].peak_bytes[STEPS - 1],
                again[0].peak_bytes[STEPS - 1],
            );
            assert!(
                remat < kept,
                "{kind:?} M = {m}: re-materialised holds {remat}, kept {kept}"
            );
            first.push(remat);
        }
    }
    assert!(first.iter().all(|&b| b == first[0]), "{first:?}");
    let last = |m| run(ScheduleKind::GPipe, m, true)[1].peak_bytes[STEPS - 1];
    assert_eq!(last(8) - last(4), 4 * input_bytes);
}

/// Each rank's run of `schedule` against one device: losses and parameters within 1e-6, the
/// point-to-point messages the schedule predicts, the peak of held activations its simulation
/// gives.
fn check_against_one_device(schedule: &Schedule, ranks: &[RankRun]) {
    let (kind, p, m) = (schedule.kind(), schedule.ranks(), schedule.microbatches());
    let what = format!("{kind:?} p={p} m={m} v={}", schedule.stages() / p);
    let (losses, params) = one_device(schedule.stages(), m);
    let timeline = schedule.simulate(&Costs::default()).unwrap();
    let last = schedule.rank_of(schedule.stages() - 1);
    for (r, run) in ranks.iter().enumerate() {
        if r == last {
            for (a, b) in run.losses.iter().zip(&losses) {
                assert!((a - b).abs() <= 1e-6 * b.abs(), "{what}: {a} vs {b}");
            }
            assert_eq!(run.losses.len(), STEPS, "{what}");
        } else {
            assert!(run.losses.is_empty(), "{what}: rank {r} reports losses");
        }
        for (c, chunk) in run.chunks.iter().enumerate() {
            let stage = c * p + r;
            for (i, got) in chunk.iter().enumerate() {
                let want = &params[stage * PER_STAGE * 2 + i];
                for (x, y) in got.iter().zip(want) {
                    assert!((x - y).abs() <= 1e-6, "{what}: stage {stage}: {x} vs {y}");
                }
            }
        }
        assert_eq!(
            run.p2p,
            vec![schedule.p2p_counts(r); STEPS],
            "{what} rank {r}"
        );
        assert_eq!(
            run.peak_held,
            timeline.peak_activations(r),
            "{what} rank {r}"
        );
    }
    if kind == ScheduleKind::GPipe {
        assert!(ranks.iter().all(|r| r.peak_held == m), "{what}");
    }
    if kind == ScheduleKind::OneFOneB {
        assert!(ranks.iter().all(|r| r.peak_held <= p), "{what}");
    }
}

/// A stage that dies mid-schedule (rank 1 panics before its first send) is an error on every
/// rank, never a hang; a zero-bubble schedule is refused where the backend cannot defer weight
/// gradients (no rank context given).
#[test]
fn a_dead_stage_fails_every_rank_and_zero_bubble_is_refused() {
    let schedule = Schedule::new(ScheduleKind::OneFOneB, 2, 4, 1).unwrap();
    let mesh = DeviceMesh::new([("pp", 2)]).unwrap();
    let result =
        launch_ranks::<F, _, _>(&mesh, &Default::default(), &Default::default(), |device| {
            let comm = device.context().comm_arc();
            let inner = Default::default();
            let chunk = Blocks::<A> {
                blocks: vec![Block::new(D, device.rank() as u64, &inner)],
            };
            run_step(
                &schedule,
                &*comm,
                0,
                std::slice::from_ref(&chunk),
                |chunk: &Blocks<A>, stage, mb, x| {
                    assert!(stage == 0, "stage {stage} dies at micro-batch {mb}");
                    chunk.forward(x.unwrap_or_else(|| Tensor::from_data(input(0, mb), &inner)))
                },
                |mb, out| mse(out, 0, mb),
            )
            .map(|_| ())
        });
    let err = result.unwrap_err();
    assert!(err.to_string().contains("rank 1"), "{err}");

    let zb = Schedule::new(ScheduleKind::ZeroBubble, 2, 4, 1).unwrap();
    let results = threads(&mesh, |device| {
        let comm = device.context().comm_arc();
        let chunk = Blocks::<A> {
            blocks: vec![Block::new(D, 0, &Default::default())],
        };
        run_step(
            &zb,
            &*comm,
            0,
            std::slice::from_ref(&chunk),
            |chunk: &Blocks<A>, _, mb, x| {
                chunk.forward(
                    x.unwrap_or_else(|| Tensor::from_data(input(0, mb), &Default::default())),
                )
            },
            |mb, out| mse(out, 0, mb),
        )
        .map(|_| ())
    });
    for r in results {
        assert!(matches!(r, Err(Error::InvalidSchedule(_))), "{r:?}");
    }
}

const LAYERS: usize = 4;

/// Every parameter drawn from [`values`] (the same on every backend), keeping its id.
struct Fill(u64);

impl<B: Backend> burn::module::ModuleMapper<B> for Fill {
    fn map_float<const K: usize>(&mut self, p: Param<Tensor<B, K>>) -> Param<Tensor<B, K>> {
        self.0 += 1;
        let seed = 500 + self.0;
        p.map(|t| {
            let fresh = Tensor::from_data(values(&t.dims(), seed), &t.device()).mul_scalar(0.5);
            if t.is_require_grad() {
                fresh.require_grad()
            } else {
                fresh
            }
        })
    }
}

/// A stock burn-nn encoder of `LAYERS` layers, no dropout, its parameters from [`Fill`].
fn encoder<B: Backend>(device: &B::Device) -> TransformerEncoder<B> {
    TransformerEncoderConfig::new(D, 2 * D, 2, LAYERS)
        .with_dropout(0.0)
        .init(device)
        .map(&mut Fill(0))
}

/// Every parameter's values, in visiting order (gathered whole on the `Distributed` backend).
fn param_values<B: Backend, M: Module<B>>(m: &M) -> Vec<Vec<f32>> {
    struct Collect(Vec<Vec<f32>>);
    impl<B: Backend> burn::module::ModuleVisitor<B> for Collect {
        fn visit_float<const K: usize>(&mut self, p: &Param<Tensor<B, K>>) {
            self.0.push(p.val().into_data().to_vec::<f32>().unwrap());
        }
    }
    let mut c = Collect(Vec::new());
    m.visit(&mut c);
    c.0
}

/// The encoder on one device, `m` micro-batches a step: the mean losses and the parameters.
fn encoder_one_device(m: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
    let device = Default::default();
    let mut model = encoder::<A>(&device);
    let mut optim = adamw().init::<A, TransformerEncoder<A>>();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let mut acc = burn::optim::GradientsAccumulator::new();
        let mut sum = 0.0;
        for mb in 0..m {
            let x = Tensor::<A, 3>::from_data(input(step, mb), &device);
            let loss = mse(model.forward(TransformerEncoderInput::new(x)), step, mb);
            sum += loss.clone().into_scalar();
            let grads = loss.div_scalar(m as f64).backward();
            acc.accumulate(&model, GradientsParams::from_grads(grads, &model));
        }
        losses.push(sum / m as f32);
        model = optim.step(1e-2, model, acc.grads());
    }
    (losses, param_values(&model))
}

/// The stages' parameters, in stage order, against the whole model's; the losses against one
/// device's.
fn check_stages(
    what: &str,
    losses: &[f32],
    stages: Vec<Vec<Vec<f32>>>,
    expected: &(Vec<f32>, Vec<Vec<f32>>),
    tol: f32,
) {
    assert_eq!(losses.len(), STEPS, "{what}");
    for (a, b) in losses.iter().zip(&expected.0) {
        assert!((a - b).abs() <= tol * b.abs(), "{what}: loss {a} vs {b}");
    }
    let got: Vec<Vec<f32>> = stages.into_iter().flatten().collect();
    assert_eq!(got.len(), expected.1.len(), "{what}");
    for (i, (g, e)) in got.iter().zip(&expected.1).enumerate() {
        for (x, y) in g.iter().zip(e) {
            assert!((x - y).abs() <= tol, "{what}: parameter {i}: {x} vs {y}");
        }
    }
}

/// A stock burn-nn `TransformerEncoder` split by [`pipeline`] (each stage an encoder holding
/// its run of layers, its stock forward): 1F1B at p = 2 with M = 4, and interleaved 1F1B over
/// 2 ranks × 2 chunks (one layer a stage), give the losses and every parameter of the whole
/// encoder on one device after 3 AdamW steps, within 1e-6.
#[test]
fn a_stock_transformer_encoder_splits_into_a_pipeline() {
    const M: usize = 4;
    let expected = encoder_one_device(M);
    for (schedule, plan) in [
        (
            Schedule::new(ScheduleKind::OneFOneB, 2, M, 1).unwrap(),
            StagePlan::even(LAYERS, 2).unwrap(),
        ),
        (
            Schedule::new(ScheduleKind::Interleaved, 2, M, 2).unwrap(),
            StagePlan::even(LAYERS, 4).unwrap(),
        ),
    ] {
        let mesh = DeviceMesh::new([("pp", 2)]).unwrap();
        let ranks = threads(&mesh, |dist| {
            let comm = dist.context().comm_arc();
            let device = Default::default();
            let mut pipe = pipeline(encoder::<A>(&device), &*comm, 0, &plan, &schedule).unwrap();
            assert_eq!(
                pipe.stages(),
                (dist.rank()..plan.stages()).step_by(2).collect::<Vec<_>>()
            );
            let mut optims: Vec<_> = pipe
                .chunks()
                .iter()
                .map(|_| adamw().init::<A, TransformerEncoder<A>>())
                .collect();
            let mut losses = Vec::new();
            for step in 0..STEPS {
                let out = pipe
                    .step(
                        &*comm,
                        StepOptions::default(),
                        |mb| Tensor::from_data(input(step, mb), &device),
                        |mb, out| mse(out, step, mb),
                    )
                    .unwrap();
                if !out.losses.is_empty() {
                    losses.push(out.losses.iter().sum::<f32>() / M as f32);
                }
                let mut grads = out.grads.into_iter();
                pipe = pipe
                    .try_map(|c, chunk| {
                        Ok::<_, ()>(optims[c].step(1e-2, chunk, grads.next().unwrap()))
                    })
                    .unwrap();
            }
            let stages = pipe.stages();
            let values = pipe.chunks().iter().map(param_values).collect::<Vec<_>>();
            (losses, stages.into_iter().zip(values).collect::<Vec<_>>())
        });
        let losses = ranks[(schedule.stages() - 1) % 2].0.clone();
        let mut stages: Vec<_> = ranks.into_iter().flat_map(|(_, s)| s).collect();
        stages.sort_by_key(|(s, _)| *s);
        let what = format!("{:?}", schedule.kind());
        check_stages(
            &what,
            &losses,
            stages.into_iter().map(|(_, v)| v).collect(),
            &expected,
            1e-6,
        );
    }
}

/// The split composes with FSDP inside each stage: a 2 × 2 `dp × pp` mesh, each stage's
/// encoder fully sharded over `dp` (`Pipeline::try_map`), each data-parallel rank feeding its
/// half of every micro-batch, 1F1B with M = 4: the losses (mean over `dp`) and every parameter
/// match one device within 1e-5. Run twice: the pieces as host messages, and on installed
/// device collectives ([`HostStaged`], the device path NCCL takes on CUDA), which carry every
/// piece the runner sends and receives (their counts are the runner's).
#[test]
fn a_split_encoder_trains_fully_sharded_inside_its_stages() {
    for on_device in [false, true] {
        split_encoder_fully_sharded(on_device);
    }
}

fn split_encoder_fully_sharded(on_device: bool) {
    type Dist = Autodiff<D>;
    const M: usize = 4;
    let expected = encoder_one_device(M);
    let schedule = Schedule::new(ScheduleKind::OneFOneB, 2, M, 1).unwrap();
    let plan = StagePlan::even(LAYERS, 2).unwrap();
    let mesh = DeviceMesh::new([("dp", 2), ("pp", 2)]).unwrap();
    let ranks = threads(&mesh, |dist| {
        let comm = dist.context().comm_arc();
        let ctx = dist.context();
        let staged = Arc::new(HostStaged::new(comm.clone()));
        if on_device {
            ctx.set_device_collectives::<F>(staged.clone());
        }
        let mut messages = (0, 0);
        let dp = dist.mesh().coords(dist.rank())[0];
        let pipe = pipeline(encoder::<Dist>(&dist), &*comm, 1, &plan, &schedule).unwrap();
        let mut pipe = pipe
            .try_map(|_, chunk| fully_shard(chunk, dist.mesh(), FsdpStrategy::FullShard))
            .unwrap()
            .with_transport(crate::pipeline::Pieces);
        let mut optim = FsdpOptimizer::new(adamw().init::<Dist, TransformerEncoder<Dist>>());
        let mut losses = Vec::new();
        let rows = |t: TensorData| Tensor::<Dist, 3>::from_data(t, &dist).narrow(0, dp, 1);
        for step in 0..STEPS {
            ctx.set_no_sync(true);
            let out = pipe
                .step(
                    &*comm,
                    StepOptions {
                        ctx: Some(&**ctx),
                        ..StepOptions::default()
                    },
                    |mb| rows(input(step, mb)),
                    |mb, out| (out - rows(target(step, mb))).powi_scalar(2).mean(),
                )
                .unwrap();
            ctx.set_no_sync(false);
            if !out.losses.is_empty() {
                losses.push(out.losses.iter().sum::<f32>() / M as f32);
            }
            messages.0 += out.sends as u64;
            messages.1 += out.recvs as u64;
            let mut grads = out.grads.into_iter();
            pipe = pipe
                .try_map(|_, chunk| {
                    let mut g = grads.next().unwrap();
                    sync_gradients(&chunk, &mut g)?;
                    Ok::<_, Error>(optim.step(1e-2, chunk, g))
                })
                .unwrap();
        }
        let values: Vec<_> = pipe.chunks().iter().map(param_values).collect();
        // Each rank holds half of its stage's parameters (every dimension here is even).
        let numel: usize = values.iter().flatten().map(Vec::len).sum();
        let held: u64 = pipe.chunks().iter().map(parameter_bytes).sum();
        assert_eq!(2 * held, 4 * numel as u64);
        // 1F1B over 2 stages: each rank sends and receives one message per micro-batch.
        assert_eq!(messages, ((STEPS * M) as u64, (STEPS * M) as u64));
        let calls = staged.calls();
        let count = |kind| calls.get(&kind).copied().unwrap_or(0);
        if on_device {
            assert_eq!(
                (count(CollectiveKind::Send), count(CollectiveKind::Recv)),
                messages
            );
            ctx.clear_device_collectives();
        } else {
            assert!(calls.is_empty(), "{calls:?}");
        }
        (dist.rank(), pipe.rank(), losses, values)
    });
    // The mean loss over the two data-parallel ranks of the last stage.
    let last: Vec<_> = ranks.iter().filter(|r| r.1 == 1).collect();
    let losses: Vec<f32> = (0..STEPS)
        .map(|s| last.iter().map(|r| r.2[s]).sum::<f32>() / 2.0)
        .collect();
    for dp in 0..2 {
        let stages: Vec<_> = (0..2)
            .map(|pp| {
                let r = ranks
                    .iter()
                    .find(|r| r.0 == mesh.rank_of(&[dp, pp]))
                    .unwrap();
                r.3.clone().into_iter().flatten().collect::<Vec<_>>()
            })
            .collect();
        let what = format!("dp rank {dp}, device collectives {on_device}");
        check_stages(&what, &losses, stages, &expected, 1e-5);
    }
}

/// What the splitter refuses before any step: a plan for another number of blocks, a plan
/// whose stages are not the schedule's, an axis the schedule does not fit.
#[test]
fn the_splitter_refuses_plans_that_do_not_fit() {
    let mesh = DeviceMesh::new([("pp", 2)]).unwrap();
    let errors = threads(&mesh, |dist| {
        let comm = dist.context().comm_arc();
        let device = Default::default();
        let one_f_one_b = Schedule::new(ScheduleKind::OneFOneB, 2, 4, 1).unwrap();
        let four = Schedule::new(ScheduleKind::OneFOneB, 4, 4, 1).unwrap();
        let split = |plan: &StagePlan, schedule: &Schedule| {
            pipeline(encoder::<A>(&device), &*comm, 0, plan, schedule).unwrap_err()
        };
        [
            split(&StagePlan::even(6, 2).unwrap(), &one_f_one_b),
            split(&StagePlan::even(4, 4).unwrap(), &one_f_one_b),
            split(&StagePlan::even(4, 4).unwrap(), &four),
        ]
        .map(|e| e.to_string())
    });
    for e in &errors {
        assert!(
            e[0].contains("0..6") && e[0].contains("4 blocks"),
            "{}",
            e[0]
        );
        assert!(
            e[1].contains("a plan of 4 stages for a schedule of 2"),
            "{}",
            e[1]
        );
        assert!(
            e[2].contains("4 pipeline ranks on an axis of 2"),
            "{}",
            e[2]
        );
    }
}
