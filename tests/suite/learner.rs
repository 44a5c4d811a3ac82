//! burn-train's Learner, sharded (`wildfire::learner`): the Burn Book's training path on
//! `Autodiff<Distributed<Flex>>`, ranks as threads, against the one-device Learner.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::DataLoaderBuilder;
use burn::optim::AdamWConfig;
use burn::train::logger::InMemoryMetricLogger;
use burn::train::metric::{
    LossInput, LossMetric, Metric, MetricMetadata, MetricName, Numeric, NumericEntry,
    SerializedEntry,
};
use burn::train::{Learner, SupervisedTraining};
use wildfire::demo::{deterministic_init, parameters};
use wildfire::learner::glyphs::{GlyphBatcher, GlyphClassifierConfig, GlyphDataset};
use wildfire::learner::{LearnerError, LearnerRank, Quiet, Sharded, ShardedLoader};
use wildfire::parallel::{
    DeviceMesh, FsdpStrategy, LaunchOptions, fully_shard, launch_ranks, replicate,
};

use crate::suite::{pairs, tensors_close};

/// The Learner's loss metric, each value also kept in `values` (every step's loss on the rank,
/// in order): the metric pipeline the Learner runs, read back.
#[derive(Clone)]
struct LossLog {
    inner: LossMetric<Flex>,
    name: MetricName,
    values: Arc<Mutex<Vec<f64>>>,
}

impl LossLog {
    fn new(name: &str) -> (Self, Arc<Mutex<Vec<f64>>>) {
        let values = Arc::new(Mutex::new(Vec::new()));
        let log = Self {
            inner: LossMetric::new(),
            name: Arc::new(name.to_string()),
            values: values.clone(),
        };
        (log, values)
    }
}

impl Metric for LossLog {
    type Input = LossInput<Flex>;

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn update(&mut self, item: &Self::Input, metadata: &MetricMetadata) -> SerializedEntry {
        let entry = self.inner.update(item, metadata);
        let value = match self.inner.value() {
            NumericEntry::Value(v) => v,
            NumericEntry::Aggregated {
                aggregated_value, ..
            } => aggregated_value,
        };
        self.values.lock().unwrap().push(value);
        entry
    }

    fn clear(&mut self) {
        self.inner.clear();
    }
}

impl Numeric for LossLog {
    fn value(&self) -> NumericEntry {
        self.inner.value()
    }

    fn running_value(&self) -> NumericEntry {
        self.inner.running_value()
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

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wildfire-learner-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The Learner as the Burn Book runs it, on one device (`Autodiff<Flex>`, burn-train's own
/// single-device strategy), `epochs` epochs, the training rows in the sampler's order for one
/// rank.
fn one_device(epochs: usize, dir: &str) -> Run {
    type B = Autodiff<Flex>;
    let device = Default::default();
    let model = deterministic_init(GlyphClassifierConfig::new().init::<B>(&device), 1);
    let train = ShardedLoader::new(
        GlyphBatcher,
        GlyphDataset::new(TRAIN_ROWS, 1),
        GLOBAL_BATCH,
        5,
        0,
        1,
        device,
    )
    .unwrap();
    let valid = DataLoaderBuilder::new(GlyphBatcher)
        .batch_size(8)
        .build(GlyphDataset::new(24, 2));
    let (train_log, train_values) = LossLog::new("Loss log");
    let (valid_log, valid_values) = LossLog::new("Loss log");
    let training = SupervisedTraining::new(scratch(dir), Arc::new(train), valid)
        .metric_train_numeric(train_log)
        .metric_valid_numeric(valid_log)
        .with_application_logger(None)
        .renderer(Quiet)
        .with_metric_logger(InMemoryMetricLogger::new())
        .num_epochs(epochs);
    let result = training.launch(Learner::new(model, AdamWConfig::new().init(), LR));
    let train = train_values.lock().unwrap().clone();
    let valid = valid_values.lock().unwrap().clone();
    Run {
        train: vec![train],
        valid,
        parameters: parameters(&result.model),
    }
}

/// How a sharded run lays the model out.
#[derive(Clone, Copy, Debug)]
enum Layout {
    Ddp,
    Fsdp(FsdpStrategy),
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
    type B = Sharded<Flex>;
    let mesh = DeviceMesh::new([("dp", dp)]).unwrap();
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
            };
            let train = rank.loader(
                GlyphBatcher,
                GlyphDataset::new(TRAIN_ROWS, 1),
                GLOBAL_BATCH,
                5,
            )?;
            let valid = DataLoaderBuilder::new(GlyphBatcher)
                .batch_size(8)
                .set_device(device.clone())
                .build(GlyphDataset::new(24, 2));
            let (train_log, train_values) = LossLog::new("Loss log");
            let (valid_log, valid_values) = LossLog::new("Loss log");
            let training = SupervisedTraining::new(root.join("artifacts"), train, valid)
                .metric_train_numeric(train_log)
                .metric_valid_numeric(valid_log)
                .with_application_logger(None)
                .renderer(Quiet)
                .with_metric_logger(InMemoryMetricLogger::new())
                .num_epochs(epochs);
            let result = rank.launch(training, model, AdamWConfig::new().init(), LR)?;
            let parameters = parameters(&result.model);
            let train = train_values.lock().unwrap().clone();
            let valid = valid_values.lock().unwrap().clone();
            Ok(Run {
                train: vec![train],
                valid,
                parameters,
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
/// bitwise (losses, validation losses, parameters); DDP and FullShard on 2 and 4 ranks within
/// 1e-5 (the global loss of every step, every validation batch's loss on rank 0, every
/// parameter). The global batch is the same at every world size.
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
            let got = sharded(dp, layout, 2, &format!("dp{dp}"), |r| r).unwrap();
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
    // ZeRO-1 and ZeRO-2 too (the optimizer state sharded).
    for strategy in [FsdpStrategy::ShardOptimizer, FsdpStrategy::ShardGradOp] {
        let got = sharded(2, Layout::Fsdp(strategy), 2, "zero", |r| r).unwrap();
        let what = format!("dp 2 {strategy:?}");
        close(
            &format!("{what}: loss"),
            &got.global_losses(),
            &reference.train[0],
            1e-5,
        );
        tensors_close(&what, &got.parameters, &reference.parameters, 1e-5);
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
    for (rank, (got, all)) in resumed.train.iter().zip(&straight.train).enumerate() {
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
