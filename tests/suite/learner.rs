//! burn-train's Learner, sharded (`wildfire::learner`): the Burn Book's training path on
//! `Autodiff<Distributed<Flex>>`, ranks as threads, against the one-device Learner.

use std::path::PathBuf;
use std::sync::Arc;

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::DataLoaderBuilder;
use burn::module::Module;
use burn::optim::AdamWConfig;
use burn::record::{BinFileRecorder, FullPrecisionSettings};
use burn::train::logger::InMemoryMetricLogger;
use burn::train::metric::{
    LossInput, Metric, MetricMetadata, MetricName, Numeric, NumericEntry, SerializedEntry,
};
use burn::train::{Interrupter, Learner, SupervisedTraining};
use wildfire::demo::{deterministic_init, parameters};
use wildfire::learner::glyphs::{GlyphBatcher, GlyphClassifierConfig, GlyphDataset};
use wildfire::learner::{LearnerError, LearnerRank, LossHistory, Quiet, Sharded, ShardedLoader};
use wildfire::parallel::{
    DeviceMesh, FsdpStrategy, LaunchOptions, TpPlan, TpStyle, fully_shard, launch_ranks, replicate,
    tensor_parallel,
};

use crate::suite::{pairs, tensors_close};

/// A loss metric that stops the rank's training (its interrupter) once it has seen `after`
/// steps.
#[derive(Clone)]
struct StopAfter {
    interrupter: Interrupter,
    after: usize,
    history: LossHistory,
}

impl Metric for StopAfter {
    type Input = LossInput<Flex>;

    fn name(&self) -> MetricName {
        self.history.name()
    }

    fn update(&mut self, item: &Self::Input, metadata: &MetricMetadata) -> SerializedEntry {
        let entry = self.history.update(item, metadata);
        if self.history.values().len() == self.after {
            self.interrupter.stop(Some("asked on one rank"));
        }
        entry
    }

    fn clear(&mut self) {
        self.history.clear();
    }
}

impl Numeric for StopAfter {
    fn value(&self) -> NumericEntry {
        self.history.value()
    }

    fn running_value(&self) -> NumericEntry {
        self.history.running_value()
    }
}

const GLOBAL_BATCH: usize = 16;
/// 5 steps per epoch.
const TRAIN_ROWS: usize = 5 * GLOBAL_BATCH + 7;
const LR: f64 = 2e-2;

/// What a run gave: every step's training loss (per rank), every validation batch's loss (rank
/// 0), and the parameters at the end.
#[derive(Debug, Clone)]
struct Run {
    train: Vec<Vec<f64>>,
    valid: Vec<f64>,
    parameters: Vec<Vec<f32>>,
}

impl Run {
    /// The loss of each step over the whole global batch: the mean of the ranks' losses (each
    /// the mean over an equal share of its rows).
    fn global_losses(&self) -> Vec<f64> {
        let n = self.train.len() as f64;
        (0..self.train[0].len())
            .map(|i| self.train.iter().map(|r| r[i]).sum::<f64>() / n)
            .collect()
    }
}

fn scratch_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("wildfire-learner-{name}-{}", std::process::id()))
}

fn scratch(name: &str) -> PathBuf {
    let dir = scratch_path(name);
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// What a run trains on and with: the training rows, the global batch (per micro-batch), Burn's
/// gradient accumulation, AdamW's ε, and an early-stopping strategy on the validation loss.
#[derive(Clone, Copy, Debug)]
struct Setup {
    rows: usize,
    batch: usize,
    accumulation: Option<usize>,
    epsilon: f32,
    early_stopping: bool,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            rows: TRAIN_ROWS,
            batch: GLOBAL_BATCH,
            accumulation: None,
            epsilon: 1e-5, // AdamWConfig's default
            early_stopping: false,
        }
    }
}

impl Setup {
    /// `training` with this setup's accumulation and early stopping (`valid_log` the metric it
    /// watches).
    fn apply<LC: burn::train::LearningComponentsTypes>(
        self,
        training: SupervisedTraining<LC>,
        valid_log: &LossHistory,
    ) -> SupervisedTraining<LC> {
        let training = match self.accumulation {
            Some(n) => training.grads_accumulation(n),
            None => training,
        };
        if !self.early_stopping {
            return training;
        }
        // Stop once the validation loss has not *risen* for an epoch: a loss that falls stops
        // the run early, at an epoch the numbers decide.
        use burn::train::metric::store::{Aggregate, Direction, Split};
        use burn::train::{MetricEarlyStoppingStrategy, StoppingCondition};
        training.early_stopping(MetricEarlyStoppingStrategy::new(
            valid_log,
            Aggregate::Mean,
            Direction::Highest,
            Split::Valid,
            StoppingCondition::NoImprovementSince { n_epochs: 1 },
        ))
    }

    fn optimizer(self) -> AdamWConfig {
        AdamWConfig::new().with_epsilon(self.epsilon)
    }
}

/// The Learner as the Burn Book runs it, on one device (`Autodiff<Flex>`, burn-train's own
/// single-device strategy), `epochs` epochs, the training rows in the sampler's order for one
/// rank.
fn one_device(epochs: usize, dir: &str) -> Run {
    one_device_with(epochs, dir, Setup::default(), LR)
}

/// [`one_device`] with `setup` and the learning-rate scheduler `lr`.
fn one_device_with<S: burn::lr_scheduler::LrScheduler + 'static>(
    epochs: usize,
    dir: &str,
    setup: Setup,
    lr: S,
) -> Run {
    type B = Autodiff<Flex>;
    let device = Default::default();
    let model = deterministic_init(GlyphClassifierConfig::new().init::<B>(&device), 1);
    let train = ShardedLoader::new(
        GlyphBatcher,
        GlyphDataset::new(setup.rows, 1),
        setup.batch,
        5,
        0,
        1,
        device,
    )
    .unwrap();
    let valid = DataLoaderBuilder::new(GlyphBatcher)
        .batch_size(8)
        .build(GlyphDataset::new(24, 2));
    let (train_log, valid_log) = (LossHistory::new("Loss log"), LossHistory::new("Loss log"));
    let training = SupervisedTraining::new(scratch(dir), Arc::new(train), valid)
        .metric_train_numeric(train_log.clone())
        .metric_valid_numeric(valid_log.clone())
        .with_application_logger(None)
        .renderer(Quiet)
        .with_metric_logger(InMemoryMetricLogger::new())
        .num_epochs(epochs);
    let training = setup.apply(training, &valid_log);
    let result = training.launch(Learner::new(model, setup.optimizer().init(), lr));
    Run {
        train: vec![train_log.values()],
        valid: valid_log.values(),
        parameters: parameters(&result.model),
    }
}

/// How a sharded run lays the model out.
#[derive(Clone, Copy, Debug)]
enum Layout {
    Ddp,
    Fsdp(FsdpStrategy),
    /// HSDP: replicated over `dp_replicate`, sharded over `dp_shard` (2 × 2).
    Hybrid,
    /// Megatron TP over `tp` (the hidden layer column-wise, the output layer row-wise) inside
    /// FullShard over `dp` (2 × 2).
    TensorParallel,
}

impl Layout {
    fn mesh(self, dp: usize) -> DeviceMesh {
        match self {
            Layout::Hybrid => DeviceMesh::new([("dp_replicate", 2), ("dp_shard", 2)]),
            Layout::TensorParallel => DeviceMesh::new([("dp", 2), ("tp", 2)]),
            _ => DeviceMesh::new([("dp", dp)]),
        }
        .unwrap()
    }
}

/// The same Learner program on `Autodiff<Distributed<Flex>>`, `dp` ranks as threads: the model
/// laid out, the training loader sharded, `LearnerRank::launch` instead of `launch`.
/// `configure` adds options (checkpoints, resume) to each rank.
fn sharded(
    dp: usize,
    layout: Layout,
    epochs: usize,
    dir: &str,
    configure: impl Fn(LearnerRank<Flex>) -> LearnerRank<Flex> + Sync,
) -> Result<Run, LearnerError> {
    sharded_setup(
        dp,
        layout,
        epochs,
        dir,
        configure,
        None,
        Setup::default(),
        LR,
    )
}

/// [`sharded`] with `setup`, the learning-rate scheduler `lr` (each rank its copy) and
/// `stop = Some((rank, after))`: that rank's interrupter is stopped (from the metrics thread, as
/// a TUI's `q` would) once its metrics have seen `after` steps.
#[allow(clippy::too_many_arguments)]
fn sharded_setup<S: burn::lr_scheduler::LrScheduler + Clone + Sync + 'static>(
    dp: usize,
    layout: Layout,
    epochs: usize,
    dir: &str,
    configure: impl Fn(LearnerRank<Flex>) -> LearnerRank<Flex> + Sync,
    stop: Option<(usize, usize)>,
    setup: Setup,
    lr: S,
) -> Result<Run, LearnerError> {
    type B = Sharded<Flex>;
    let mesh = layout.mesh(dp);
    let root = scratch(dir);
    let results = launch_ranks::<Flex, _, _>(
        &mesh,
        &Default::default(),
        &LaunchOptions::default(),
        |device| -> Result<Run, LearnerError> {
            let rank = configure(LearnerRank::new(device.clone()));
            let model = deterministic_init(GlyphClassifierConfig::new().init::<B>(&device), 1);
            let model = match layout {
                Layout::Ddp => replicate(model, &mesh)?,
                Layout::Fsdp(strategy) => fully_shard(model, &mesh, strategy)?,
                Layout::Hybrid => fully_shard(model, &mesh, FsdpStrategy::Hybrid)?,
                Layout::TensorParallel => {
                    let plan = TpPlan::new()
                        .with("hidden", TpStyle::Colwise)
                        .with("output", TpStyle::Rowwise);
                    let model = tensor_parallel(model, &mesh, &plan)?;
                    fully_shard(model, &mesh, FsdpStrategy::FullShard)?
                }
            };
            let train = rank.loader(
                GlyphBatcher,
                GlyphDataset::new(setup.rows, 1),
                setup.batch,
                5,
            )?;
            let valid = DataLoaderBuilder::new(GlyphBatcher)
                .batch_size(8)
                .set_device(device.clone())
                .build(GlyphDataset::new(24, 2));
            let (train_log, valid_log) =
                (LossHistory::new("Loss log"), LossHistory::new("Loss log"));
            let training = SupervisedTraining::new(root.join("artifacts"), train, valid)
                .metric_train_numeric(train_log.clone())
                .metric_valid_numeric(valid_log.clone())
                .with_application_logger(None)
                .renderer(Quiet)
                .with_metric_logger(InMemoryMetricLogger::new())
                .num_epochs(epochs);
            let training = setup.apply(training, &valid_log);
            let training = match stop {
                Some((who, after)) if who == rank.rank() => {
                    let interrupter = Interrupter::new();
                    training
                        .with_interrupter(interrupter.clone())
                        .metric_train_numeric(StopAfter {
                            interrupter,
                            after,
                            history: LossHistory::new("Stop after"),
                        })
                }
                _ => training,
            };
            let result = rank.launch(training, model, setup.optimizer().init(), lr.clone())?;
            // The trained model, whole, as a Burn record file (rank 0 writes it).
            let file = root.join("model");
            rank.save_model_file(result.model.clone(), &file, &recorder())?;
            Ok(Run {
                train: vec![train_log.values()],
                valid: valid_log.values(),
                parameters: parameters(&result.model),
            })
        },
    )?;
    let mut run = Run {
        train: Vec::new(),
        valid: Vec::new(),
        parameters: Vec::new(),
    };
    for (rank, result) in results.into_iter().enumerate() {
        let one = result?;
        run.train.extend(one.train);
        if rank == 0 {
            run.valid = one.valid;
            run.parameters = one.parameters;
        }
    }
    Ok(run)
}

fn recorder() -> BinFileRecorder<FullPrecisionSettings> {
    BinFileRecorder::new()
}

/// The model file a sharded run's rank 0 wrote, loaded into the model on one device.
fn load_model_file(dir: &str) -> Vec<Vec<f32>> {
    let device = Default::default();
    let model = GlyphClassifierConfig::new()
        .init::<Flex>(&device)
        .load_file(scratch_path(dir).join("model"), &recorder(), &device)
        .expect("the model file");
    parameters(&model)
}

fn same_bits(what: &str, got: &[f64], expected: &[f64]) {
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(got), bits(expected), "{what}");
}

fn close(what: &str, got: &[f64], expected: &[f64], tol: f64) {
    for (i, (a, b)) in pairs(got, expected).enumerate() {
        assert!((a - b).abs() <= tol * b.abs(), "{what} [{i}]: {a} vs {b}");
    }
}

/// The Learner trains 10 steps (2 epochs of 5) sharded as on one device: at world size 1
/// bitwise (losses, validation losses, parameters); DDP and FullShard on 2 and 4 ranks, ZeRO-1,
/// ZeRO-2, HSDP and tensor parallelism inside FSDP within 1e-5 (the global loss of every step,
/// every validation batch's loss on rank 0, every parameter). The global batch is the same at
/// every world size. The model file rank 0 writes (`save_model_file`) holds the whole trained
/// model: loaded on one device, its parameters are the sharded run's, bitwise.
#[test]
fn learner_sharded_matches_one_device() {
    let reference = one_device(2, "one");
    assert_eq!(reference.train[0].len(), 10);
    assert_eq!(reference.valid.len(), 2 * 3);
    // It learns (so the comparisons below compare something): the last three steps' loss below
    // the first three's.
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let losses = &reference.train[0];
    assert!(mean(&losses[7..]) < mean(&losses[..3]) - 0.05, "{losses:?}");
    let world_one = sharded(1, Layout::Ddp, 2, "w1", |r| r).unwrap();
    same_bits("world 1: losses", &world_one.train[0], &reference.train[0]);
    same_bits("world 1: validation", &world_one.valid, &reference.valid);
    for (a, b) in pairs(&world_one.parameters, &reference.parameters) {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(a), bits(b), "world 1: parameters");
    }
    for dp in [2, 4] {
        for layout in [Layout::Ddp, Layout::Fsdp(FsdpStrategy::FullShard)] {
            let what = format!("dp {dp} {layout:?}");
            let dir = format!("dp{dp}-{layout:?}");
            let got = sharded(dp, layout, 2, &dir, |r| r).unwrap();
            // The model file holds the whole trained model: it loads on one device.
            let loaded = load_model_file(&dir);
            for (a, b) in pairs(&loaded, &got.parameters) {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(a), bits(b), "{what}: the model file");
            }
            assert_eq!(got.train.len(), dp);
            // Each rank reads its own rows.
            assert_ne!(got.train[0], got.train[1], "{what}");
            close(
                &format!("{what}: loss"),
                &got.global_losses(),
                &reference.train[0],
                1e-5,
            );
            close(
                &format!("{what}: validation"),
                &got.valid,
                &reference.valid,
                1e-5,
            );
            tensors_close(&what, &got.parameters, &reference.parameters, 1e-5);
        }
    }
    // ZeRO-1 and ZeRO-2 (the optimizer state sharded), HSDP (2 × 2) within 1e-5; TP inside
    // FSDP (2 × 2) within 1e-4 (the row-parallel layer sums its halves in another order, which
    // AdamW's normalised step turns into ~1e-5 on tiny gradients, as in the GPT's TP tests).
    for (layout, tol) in [
        (Layout::Fsdp(FsdpStrategy::ShardOptimizer), 1e-5),
        (Layout::Fsdp(FsdpStrategy::ShardGradOp), 1e-5),
        (Layout::Hybrid, 1e-5),
        (Layout::TensorParallel, 1e-5),
    ] {
        let what = format!("{layout:?}");
        let dir = format!("more-{layout:?}");
        let got = sharded(2, layout, 2, &dir, |r| r).unwrap();
        assert_eq!(
            load_model_file(&dir),
            got.parameters,
            "{what}: the model file"
        );
        close(
            &format!("{what}: loss"),
            &got.global_losses(),
            &reference.train[0],
            tol,
        );
        close(
            &format!("{what}: validation"),
            &got.valid,
            &reference.valid,
            tol,
        );
        tensors_close(&what, &got.parameters, &reference.parameters, tol as f32);
    }
}

/// A FullShard Learner run saved after epoch 1 and resumed from that checkpoint continues as the
/// uninterrupted run: the second epoch's losses and the parameters bitwise (the learning-rate
/// schedule replayed, the sampler at its second epoch). The same checkpoint resumes on one
/// rank (DDP, world 1) within 1e-5. A missing checkpoint is a typed error before training.
#[test]
fn learner_resumes_from_its_distributed_checkpoint() {
    let fsdp = Layout::Fsdp(FsdpStrategy::FullShard);
    let root = scratch("resume-checkpoints");
    let straight = sharded(2, fsdp, 2, "straight", |r| r).unwrap();
    let saving = {
        let root = root.clone();
        move |r: LearnerRank<Flex>| r.with_checkpoints(&root)
    };
    let first = sharded(2, fsdp, 1, "first", &saving).unwrap();
    assert_eq!(first.train[0].len(), 5);
    assert!(root.join("step-00000001").join("learner.json").is_file());
    let resuming = {
        let root = root.clone();
        move |r: LearnerRank<Flex>| r.with_checkpoints(&root).resume_from(1)
    };
    let resumed = sharded(2, fsdp, 2, "resumed", &resuming).unwrap();
    for (rank, (got, all)) in crate::suite::pairs(&resumed.train, &straight.train).enumerate() {
        same_bits(
            &format!("rank {rank}: losses after the resume"),
            got,
            &all[5..],
        );
    }
    same_bits(
        "validation after the resume",
        &resumed.valid,
        &straight.valid[3..],
    );
    for (a, b) in pairs(&resumed.parameters, &straight.parameters) {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(a), bits(b), "parameters after the resume");
    }
    // On one rank: the same rows per step, summed in another order.
    let one = sharded(1, Layout::Ddp, 2, "resumed-one", &resuming).unwrap();
    close(
        "one rank after the resume",
        &one.train[0],
        &straight.global_losses()[5..],
        1e-5,
    );
    tensors_close(
        "one rank after the resume",
        &one.parameters,
        &straight.parameters,
        1e-5,
    );
    // No checkpoint of epoch 7.
    let missing = {
        let root = root.clone();
        move |r: LearnerRank<Flex>| r.with_checkpoints(&root).resume_from(7)
    };
    let err = sharded(2, fsdp, 8, "missing", &missing).unwrap_err();
    assert!(err.to_string().contains("no checkpoint of step 7"), "{err}");
}

/// A stop asked on one rank (its interrupter, as a TUI's `q` would) stops every rank at the
/// same step: no rank is left waiting in a collective, and the run ends cleanly on all.
#[test]
fn a_stop_on_one_rank_stops_every_rank_at_the_same_step() {
    let fsdp = Layout::Fsdp(FsdpStrategy::FullShard);
    let stop = Some((1, 3));
    let run = sharded_setup(2, fsdp, 2, "stop", |r| r, stop, Setup::default(), LR).unwrap();
    let steps: Vec<usize> = run.train.iter().map(Vec::len).collect();
    assert_eq!(steps[0], steps[1], "{steps:?}");
    assert!((3..10).contains(&steps[0]), "{steps:?}");
}

/// Clipping by the global norm (`with_clip`): FullShard on 2 ranks clips as one rank does (the
/// norm agreed over the mesh, not per shard), within 1e-5; and the clip acts (the parameters
/// part from the unclipped run's).
#[test]
fn learner_clips_by_the_global_norm_over_the_mesh() {
    let clip = |r: LearnerRank<Flex>| r.with_clip(0.05);
    let one = sharded(1, Layout::Ddp, 1, "clip-one", clip).unwrap();
    let fsdp = sharded(
        2,
        Layout::Fsdp(FsdpStrategy::FullShard),
        1,
        "clip-fsdp",
        clip,
    )
    .unwrap();
    close("clipped: loss", &fsdp.global_losses(), &one.train[0], 1e-5);
    tensors_close("clipped", &fsdp.parameters, &one.parameters, 1e-5);
    let unclipped = sharded(1, Layout::Ddp, 1, "clip-none", |r| r).unwrap();
    let moved = crate::suite::pairs(&one.parameters, &unclipped.parameters)
        .flat_map(|(a, b)| crate::suite::pairs(a, b))
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        moved > 1e-4,
        "clipping changed the parameters by only {moved}"
    );
}

/// Gradient accumulation (burn-train's `grads_accumulation(2)`): FullShard on 2 ranks taking
/// 2 micro-batches of a global 16 rows per step trains as one device taking the 32 rows at once
/// (within 1e-5: losses of the validation, every parameter). Burn's accumulator sums the
/// micro-batches' gradients, twice the scale of one batch's mean: AdamW's step does not see
/// the scale but through its ε, which is set to 1e-12 in both runs (with the default
/// ε = 1e-5 the validation losses part by 4e-4). The gradients of the first micro-batch stay unreduced (`no_sync`) until the last.
#[test]
fn learner_accumulation_matches_one_device_at_twice_the_batch() {
    let micro = Setup {
        rows: 4 * GLOBAL_BATCH + 7, // 4 micro-batches: 2 steps an epoch
        accumulation: Some(2),
        epsilon: 1e-12,
        ..Setup::default()
    };
    let whole = Setup {
        batch: 2 * GLOBAL_BATCH,
        accumulation: None,
        ..micro
    };
    let fsdp = Layout::Fsdp(FsdpStrategy::FullShard);
    let reference = one_device_with(2, "accum-one", whole, LR);
    let got = sharded_setup(2, fsdp, 2, "accum-fsdp", |r| r, None, micro, LR).unwrap();
    assert_eq!(reference.train[0].len(), 4);
    assert_eq!(got.train[0].len(), 8, "a loss per micro-batch");
    close(
        "accumulated: validation",
        &got.valid,
        &reference.valid,
        1e-5,
    );
    tensors_close("accumulated", &got.parameters, &reference.parameters, 1e-5);
    // Control: without accumulation the same rows train 4 smaller steps, another model.
    let unaccumulated = Setup {
        accumulation: None,
        ..micro
    };
    let other = sharded_setup(2, fsdp, 2, "accum-none", |r| r, None, unaccumulated, LR).unwrap();
    assert!(
        max_difference(&other.parameters, &reference.parameters) > 1e-3,
        "the control is not different"
    );
}

/// The largest element-wise difference of two models.
fn max_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    pairs(a, b)
        .flat_map(|(a, b)| pairs(a, b))
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
}

/// An early-stopping strategy (burn-train's `MetricEarlyStoppingStrategy` on the validation
/// loss, rank 0's decision taken by every rank) stops every rank at the epoch one device stops
/// at (the 3rd of 4 here), the same steps on every rank, the same model within 1e-5.
#[test]
fn learner_early_stopping_stops_every_rank_at_one_devices_epoch() {
    let stopping = Setup {
        early_stopping: true,
        ..Setup::default()
    };
    let reference = one_device_with(4, "early-one", stopping, LR);
    let stopped = reference.train[0].len();
    assert!(
        stopped < 20 && stopped.is_multiple_of(5),
        "one device stops early: {stopped} steps"
    );
    let fsdp = Layout::Fsdp(FsdpStrategy::FullShard);
    let got = sharded_setup(2, fsdp, 4, "early-fsdp", |r| r, None, stopping, LR).unwrap();
    let steps: Vec<usize> = got.train.iter().map(Vec::len).collect();
    assert_eq!(
        steps,
        vec![stopped; 2],
        "every rank stops at one device's epoch"
    );
    assert_eq!(got.valid.len(), reference.valid.len());
    close(
        "early stopping: loss",
        &got.global_losses(),
        &reference.train[0],
        1e-5,
    );
    tensors_close(
        "early stopping",
        &got.parameters,
        &reference.parameters,
        1e-5,
    );
}

/// A learning-rate schedule that changes every step (burn's linear decay, 2e-2 to 2e-3 over the
/// 10 steps) is replayed on every rank as on one device: FullShard on 2 ranks within 1e-5; and
/// it acts (the model differs from the constant rate's).
#[test]
fn learner_follows_a_changing_learning_rate_as_one_device() {
    let linear = burn::lr_scheduler::linear::LinearLrSchedulerConfig::new(LR, LR / 10.0, 10)
        .init()
        .unwrap();
    let reference = one_device_with(2, "sched-one", Setup::default(), linear);
    let fsdp = Layout::Fsdp(FsdpStrategy::FullShard);
    let got = sharded_setup(
        2,
        fsdp,
        2,
        "sched-fsdp",
        |r| r,
        None,
        Setup::default(),
        linear,
    )
    .unwrap();
    close(
        "scheduled: loss",
        &got.global_losses(),
        &reference.train[0],
        1e-5,
    );
    close("scheduled: validation", &got.valid, &reference.valid, 1e-5);
    tensors_close("scheduled", &got.parameters, &reference.parameters, 1e-5);
    let constant = one_device(2, "sched-constant");
    assert!(
        max_difference(&constant.parameters, &reference.parameters) > 1e-3,
        "the schedule did not change the model"
    );
}
