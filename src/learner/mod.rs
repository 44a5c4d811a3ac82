//! Burn's own training loop, sharded: burn-train's `Learner` (`SupervisedTraining`, the Burn
//! Book's path) trains a model on `Autodiff<Distributed<B>>` data parallel, FSDP / ZeRO or HSDP
//! (and tensor parallel where the model was given a plan), with ranks as threads or MPI
//! processes.
//!
//! A Learner program changes in four places (the one-device line, then each rank's, with
//! `rank = LearnerRank::new(device)`):
//!
//! ```text
//! type B = Autodiff<Flex>;
//! type B = Autodiff<Distributed<Flex>>;
//!
//! let model = config.init::<B>(&device);
//! let model = fully_shard(config.init::<B>(&device), &mesh, FullShard)?;
//!
//! let train = DataLoaderBuilder::new(batcher).batch_size(64).shuffle(seed).build(dataset);
//! let train = rank.loader(batcher, dataset, global_batch, seed)?;
//!
//! let result = training.launch(Learner::new(model, optim, lr));
//! let result = rank.launch(training, model, optim, lr)?;
//! ```
//!
//! - [`LearnerRank::loader`] is a distributed sampler ([`ShardedLoader`]): every epoch the
//!   dataset is shuffled with a seed all ranks share (reshuffled per epoch), cut into global
//!   batches, and each data-parallel rank takes its disjoint part of each, so the global batch
//!   does not depend on the world size (a last partial global batch is dropped, so every rank
//!   runs the same number of steps).
//! - [`LearnerRank::launch`] runs the Learner with a custom training strategy
//!   ([`burn::train::TrainingStrategy::Custom`]) and wraps the optimizer
//!   ([`ShardedOptimizer`]): between backward and the optimizer step the gradients are
//!   synchronised (`sync_gradients`: all-reduce for DDP, reduce-scatter for FSDP), optionally
//!   clipped by the global norm over the whole mesh ([`LearnerRank::with_clip`]); ZeRO-1/2's
//!   sharded optimizer state is handled as
//!   [`FsdpOptimizer`](wildfire_parallel::FsdpOptimizer) handles it. The loop is the stock
//!   single-device loop (learning-rate schedule, gradient accumulation, metrics, validation,
//!   early stopping) with every decision that could part the ranks agreed across the mesh: a
//!   stop asked on any rank stops all at the same step; early stopping is rank 0's decision.
//! - Only rank 0 renders progress and writes metric logs (the other ranks compute their metrics
//!   in memory and render nothing). Every rank validates on the whole validation set, so the
//!   validation metrics are the one-device metrics (FSDP's forward needs every rank anyway); the
//!   training loss rank 0 shows is the loss of its own part of the batch.
//! - Checkpoints ([`LearnerRank::with_checkpoints`]) are the distributed checkpoint
//!   (`wildfire_checkpoint::dcp`): at each epoch's end every rank writes its own pieces of the model
//!   and of the optimizer state, in the background, atomically; [`LearnerRank::resume_from`]
//!   (or Burn's `.checkpoint(epoch)`) continues from an epoch on any layout, the learning-rate
//!   schedule replayed to where it was. Burn's file checkpointer would serialise sharded
//!   parameters on its own threads, outside the rank's collectives: it is not used.
//!   [`LearnerRank::save_model_file`] writes the trained model whole as a Burn record file
//!   (every rank gathers, rank 0 writes), which loads on one device.
//!
//! [`glyphs`] is a model in the Burn Book's style, with its data, for the examples and tests.

pub mod glyphs;
mod handoff;
mod history;
mod loader;
mod optim;
mod strategy;

use std::path::PathBuf;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

use burn::backend::Autodiff;
use burn::data::dataloader::DataLoader;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::lr_scheduler::LrScheduler;
use burn::module::{AutodiffModule, Module, ModuleMapper, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::record::FileRecorder;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};
use burn::train::{
    InferenceStep, Learner, LearnerSummary, LearningComponentsMarker, LearningResult,
    SupervisedTraining, TrainStep, TrainingStrategy,
};
use wildfire_checkpoint::CheckpointDir;
use wildfire_checkpoint::dcp::Checkpoint;
use wildfire_parallel::{
    DistDevice, Distributed, DistributedBackend, Layout, StateCodec, dtensor, map_value,
    redistribute,
};

pub use history::LossHistory;
pub use loader::ShardedLoader;
pub use optim::ShardedOptimizer;

use handoff::Handoff;
use strategy::ShardedStrategy;

/// The training backend of a sharded Learner on `X`.
pub type Sharded<X> = Autodiff<Distributed<X>>;

/// The learning components of a sharded Learner: the backend, the learning-rate scheduler `LR`,
/// the model `M` and Burn's optimizer of the rule `S` (AdamW, Adam, SGD…) wrapped in
/// [`ShardedOptimizer`].
pub type ShardedComponents<X, LR, M, S> = LearningComponentsMarker<
    Sharded<X>,
    LR,
    M,
    ShardedOptimizer<OptimizerAdaptor<S, M, Sharded<X>>>,
>;

/// What a sharded Learner run can fail with, before or during training.
#[derive(Debug, thiserror::Error)]
pub enum LearnerError {
    /// A collective, a layout or the mesh.
    #[error(transparent)]
    Parallel(#[from] wildfire_parallel::Error),
    /// A checkpoint that cannot be read or written.
    #[error(transparent)]
    Checkpoint(#[from] wildfire_checkpoint::Error),
    /// A setting that cannot work.
    #[error("{0}")]
    Config(String),
    /// The training loop stopped on this rank (a panic inside the Learner, with its message).
    #[error("the Learner stopped on rank {rank}: {message}")]
    Failed {
        /// The rank.
        rank: usize,
        /// What it said.
        message: String,
    },
}

/// One rank's side of a sharded Learner run (see the module docs): its device, the sampler's
/// epoch shared with the training strategy, and the run's options.
#[derive(Debug)]
pub struct LearnerRank<X: Backend> {
    device: DistDevice<X>,
    /// The epoch counters of the loaders made by [`LearnerRank::loader`] (set on a resume).
    counters: Arc<Mutex<Vec<Arc<AtomicUsize>>>>,
    clip: Option<f32>,
    checkpoints: Option<PathBuf>,
    resume: Option<usize>,
}

impl<X: Backend> LearnerRank<X> {
    /// The rank of `device` (from `launch_ranks`, `launch_ranks_mpi`, …).
    pub fn new(device: DistDevice<X>) -> Self {
        Self {
            device,
            counters: Arc::default(),
            clip: None,
            checkpoints: None,
            resume: None,
        }
    }

    /// The rank's device (the device of `Sharded<X>` and of `Distributed<X>`).
    pub fn device(&self) -> &DistDevice<X> {
        &self.device
    }

    /// This rank in the world.
    pub fn rank(&self) -> usize {
        self.device.rank()
    }

    /// Whether this is rank 0, the one that renders and writes logs.
    pub fn is_main(&self) -> bool {
        self.device.rank() == 0
    }

    /// This rank's index among the data-parallel ranks, and their number (the product of the
    /// mesh's data axes): the ranks of one tensor-parallel group read the same rows.
    pub fn data_rank(&self) -> (usize, usize) {
        self.device.mesh().data_index(self.device.rank())
    }

    /// Clip the gradients to `max_norm` by their global norm over the whole mesh (one
    /// all-reduce per step, after the gradient synchronisation); a non-finite norm skips the step
    /// on every rank.
    pub fn with_clip(mut self, max_norm: f32) -> Self {
        self.clip = Some(max_norm);
        self
    }

    /// Save a distributed checkpoint under `root` at the end of every epoch
    /// (`root/step-<epoch>/`: every rank its pieces, rank 0 the metadata and `learner.json`).
    pub fn with_checkpoints(mut self, root: impl Into<PathBuf>) -> Self {
        self.checkpoints = Some(root.into());
        self
    }

    /// Continue from the checkpoint of `epoch` (under [`with_checkpoints`](Self::with_checkpoints)'
    /// root): the model, the optimizer state, the learning-rate schedule and the sampler's
    /// epoch as they were after it. Checked when [`launch`](Self::launch) starts.
    pub fn resume_from(mut self, epoch: usize) -> Self {
        self.resume = Some(epoch);
        self
    }

    /// A loader of this rank's part of every global batch of `dataset` ([`ShardedLoader`]):
    /// `global_batch` rows per step over all data-parallel ranks, shuffled per epoch with `seed`.
    pub fn loader<B, I, O>(
        &self,
        batcher: impl Batcher<B, I, O> + 'static,
        dataset: impl Dataset<I> + 'static,
        global_batch: usize,
        seed: u64,
    ) -> Result<Arc<dyn DataLoader<B, O>>, LearnerError>
    where
        B: Backend<Device = DistDevice<X>>,
        I: Send + Sync + 'static,
        O: Send + 'static,
    {
        let (index, ranks) = self.data_rank();
        let epochs = Arc::new(AtomicUsize::new(0));
        self.counters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(epochs.clone());
        let loader = ShardedLoader::new(
            batcher,
            dataset,
            global_batch,
            seed,
            index,
            ranks,
            self.device.clone(),
        )?
        .with_epochs(epochs);
        Ok(Arc::new(loader))
    }

    /// Train: `training.launch(Learner::new(model, optim, lr_scheduler))` on this rank, with the
    /// sharded strategy and optimizer (see the module docs). On ranks other than 0 the renderer
    /// renders nothing, metrics stay in memory and no application logger is installed. Returns
    /// the trained model (its inner module, laid out as trained), or this rank's error; a rank
    /// that fails releases the others (they fail at once instead of waiting out a timeout).
    pub fn launch<LR, M, S>(
        &self,
        training: SupervisedTraining<ShardedComponents<X, LR, M, S>>,
        model: M,
        optim: OptimizerAdaptor<S, M, Sharded<X>>,
        lr_scheduler: LR,
    ) -> Result<LearningResult<M::InnerModule>, LearnerError>
    where
        LR: LrScheduler + 'static,
        M: TrainStep + AutodiffModule<Sharded<X>> + core::fmt::Display + 'static,
        M::InnerModule: InferenceStep,
        S: StateCodec<Distributed<X>> + 'static,
    {
        let rank = self.rank();
        // A rank that cannot start releases the others at once (they fail instead of waiting).
        let failed = |e: LearnerError| {
            self.device.context().comm().fail(e.to_string());
            e
        };
        if let Some(epoch) = self.resume {
            let root = self.checkpoints.as_ref().ok_or_else(|| {
                failed(LearnerError::Config(format!(
                    "resume_from({epoch}) reads the checkpoints under with_checkpoints(root): \
                     name the root"
                )))
            })?;
            // The metadata and every file's size, before any rank starts training.
            CheckpointDir::new(root)
                .at(epoch)
                .and_then(Checkpoint::open)
                .map_err(|e| failed(e.into()))?;
        }
        let handoff = Handoff::default();
        let strategy = ShardedStrategy::new(
            self.device.clone(),
            self.counters.clone(),
            handoff.clone(),
            self.checkpoints.clone(),
        );
        let mut training =
            training.with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)));
        if let Some(epoch) = self.resume {
            training = training.checkpoint(epoch);
        }
        if rank != 0 {
            training = training
                .renderer(Quiet)
                .with_metric_logger(burn::train::logger::InMemoryMetricLogger::new())
                .with_application_logger(None);
        }
        let optim = ShardedOptimizer::new(optim, self.clip, handoff);
        let learner = Learner::new(model, optim, lr_scheduler);
        let outcome =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| training.launch(learner)));
        outcome.map_err(|panic| {
            let message = panic_message(&*panic);
            self.device.context().comm().fail(message.clone());
            LearnerError::Failed { rank, message }
        })
    }
}

impl<X: Backend> LearnerRank<X> {
    /// Write `model` (a trained model, as [`launch`](Self::launch) returns it: laid out as it
    /// trained) to `path` as a Burn record file with `recorder`, whole: every rank gathers each
    /// parameter (collectives: call it on every rank), rank 0 writes. The file loads into the
    /// same model on any backend (`load_file`), on one device.
    pub fn save_model_file<M, FR>(
        &self,
        model: M,
        path: impl Into<PathBuf>,
        recorder: &FR,
    ) -> Result<(), LearnerError>
    where
        M: Module<Distributed<X>>,
        FR: FileRecorder<Distributed<X>>,
    {
        let mut gather = Gather { error: None };
        let whole = model.map(&mut gather);
        if let Some(e) = gather.error {
            return Err(e.into());
        }
        if self.is_main() {
            whole
                .save_file(path.into(), recorder)
                .map_err(|e| LearnerError::Config(format!("writing the model: {e}")))?;
        }
        Ok(())
    }
}

/// Every parameter whole on every rank (`Replicate` on every mesh axis). It goes on through every
/// parameter after a failure (keeping the first error): each gather is a collective, and a rank
/// that stopped early would leave its peers waiting in theirs.
struct Gather {
    error: Option<wildfire_parallel::Error>,
}

impl<B: DistributedBackend> ModuleMapper<B> for Gather {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        map_value(param, |tensor| {
            let mesh = dtensor(tensor).device().mesh().clone();
            redistribute(tensor.clone(), &Layout::replicated(&mesh))
        })
        .unwrap_or_else(|(e, param)| {
            self.error.get_or_insert(e);
            param
        })
    }
}

/// A panic's message, whatever its payload.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_string()))
        .unwrap_or_else(|| "a panic with a payload that is not a string".into())
}

/// The renderer of the ranks other than 0: renders nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct Quiet;

impl MetricsRendererTraining for Quiet {
    fn update_train(&mut self, _: MetricState) {}
    fn update_valid(&mut self, _: MetricState) {}
    fn render_train(&mut self, _: TrainingProgress, _: Vec<ProgressType>) {}
    fn render_valid(&mut self, _: TrainingProgress, _: Vec<ProgressType>) {}
    fn on_train_end(
        &mut self,
        _: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl MetricsRendererEvaluation for Quiet {
    fn update_test(&mut self, _: EvaluationName, _: MetricState) {}
    fn render_test(&mut self, _: EvaluationProgress, _: Vec<ProgressType>) {}
    fn on_test_end(
        &mut self,
        _: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl MetricsRenderer for Quiet {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _: burn::train::metric::MetricDefinition) {}
}
