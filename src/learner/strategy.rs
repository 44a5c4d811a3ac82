//! The training strategy of a sharded Learner: burn-train's single-device loop, every rank in
//! lockstep, with distributed checkpoints.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use burn::data::dataloader::Progress;
use burn::lr_scheduler::LrScheduler;
use burn::module::AutodiffModule;
use burn::optim::GradientsAccumulator;
use burn::tensor::TensorData;
use burn::tensor::backend::Backend;
use burn::train::{
    EventProcessorTraining, InferenceStep, Learner, LearnerEvent, LearningResult,
    SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader, TrainStep,
    TrainingComponents, TrainingItem, ValidLoader,
};
use serde::{Deserialize, Serialize};
use wildfire_checkpoint::dcp::{
    Checkpoint, CheckpointWriter, Snapshot, read_state_file, state_file,
};
use wildfire_checkpoint::{CheckpointDir, ParamRecords};
use wildfire_parallel::{DistDevice, Distributed, Group, ReduceOp, StateCodec};

use super::handoff::Handoff;
use super::{LearnerError, Sharded, ShardedComponents as Components};

/// The run state rank 0 writes beside a checkpoint's pieces (`learner.json`).
#[derive(Debug, Serialize, Deserialize)]
struct LearnerState {
    /// Epochs completed.
    epoch: usize,
    /// Learning-rate scheduler steps taken (one per batch).
    lr_steps: usize,
}

pub(crate) struct ShardedStrategy<X: Backend> {
    device: DistDevice<X>,
    /// The epoch counters of the rank's sharded loaders.
    counters: Arc<Mutex<Vec<Arc<AtomicUsize>>>>,
    handoff: Handoff,
    checkpoints: Option<PathBuf>,
}

impl<X: Backend> ShardedStrategy<X> {
    pub(crate) fn new(
        device: DistDevice<X>,
        counters: Arc<Mutex<Vec<Arc<AtomicUsize>>>>,
        handoff: Handoff,
        checkpoints: Option<PathBuf>,
    ) -> Self {
        Self {
            device,
            counters,
            handoff,
            checkpoints,
        }
    }

    /// Whether `flag` holds on any rank (one all-reduce over the world): every rank takes the
    /// same branch.
    fn any(&self, flag: bool) -> bool {
        let comm = self.device.context().comm();
        let out = comm
            .all_reduce(
                Group::World,
                TensorData::new(vec![f32::from(u8::from(flag))], [1]),
                ReduceOp::Max,
            )
            .unwrap_or_else(|e| wildfire_parallel::internal::raise(e));
        out.to_vec::<f32>().expect("an f32")[0] > 0.0
    }
}

/// Stop this rank with `error` (caught by [`super::LearnerRank::launch`]).
fn fail(error: LearnerError) -> ! {
    match error {
        LearnerError::Parallel(e) => wildfire_parallel::internal::raise(e),
        e => panic!("{e}"),
    }
}

impl<X, LR, M, S> SupervisedLearningStrategy<Components<X, LR, M, S>> for ShardedStrategy<X>
where
    X: Backend,
    LR: LrScheduler + 'static,
    M: TrainStep + AutodiffModule<Sharded<X>> + core::fmt::Display + 'static,
    M::InnerModule: InferenceStep,
    S: StateCodec<Distributed<X>> + 'static,
{
    /// burn-train's `train`, with the resume from a distributed checkpoint (Burn's file
    /// checkpointer is not used) and the summary on rank 0 only.
    fn train(
        &self,
        mut learner: Learner<Components<X, LR, M, S>>,
        dataloader_train: TrainLoader<Components<X, LR, M, S>>,
        dataloader_valid: ValidLoader<Components<X, LR, M, S>>,
        mut components: TrainingComponents<Components<X, LR, M, S>>,
    ) -> LearningResult<M::InnerModule> {
        let main = self.device.rank() == 0;
        if components.checkpointer.take().is_some() && main {
            tracing::warn!(
                "a sharded Learner saves distributed checkpoints (LearnerRank::with_checkpoints): \
                 Burn's file checkpointer is not used"
            );
        }
        if !main {
            components.summary = None;
        }
        let (starting_epoch, lr_steps) = match components.checkpoint {
            Some(epoch) => {
                let steps = self.resume(&mut learner, epoch).unwrap_or_else(|e| fail(e));
                (epoch + 1, steps)
            }
            None => (1, 0),
        };
        let summary_config = components.summary.clone();
        components
            .event_processor
            .process_train(LearnerEvent::Start);
        let (model, mut processor) = self.run(
            components,
            learner,
            dataloader_train,
            dataloader_valid,
            starting_epoch,
            lr_steps,
        );
        // (burn-train names the model in the summary with a crate-private method.)
        let summary = summary_config.and_then(|summary| summary.init().ok());
        processor.process_train(LearnerEvent::End(summary));
        let model = model.valid();
        let renderer = processor.renderer();
        LearningResult { model, renderer }
    }

    fn fit(
        &self,
        components: TrainingComponents<Components<X, LR, M, S>>,
        learner: Learner<Components<X, LR, M, S>>,
        dataloader_train: TrainLoader<Components<X, LR, M, S>>,
        dataloader_valid: ValidLoader<Components<X, LR, M, S>>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<Components<X, LR, M, S>>) {
        // Without a resume (`train` replays the schedule when there is one).
        self.run(
            components,
            learner,
            dataloader_train,
            dataloader_valid,
            starting_epoch,
            0,
        )
    }
}

impl<X: Backend> ShardedStrategy<X> {
    /// The epochs from `starting_epoch` on (burn-train's single-device loop, in lockstep).
    fn run<LR, M, S>(
        &self,
        components: TrainingComponents<Components<X, LR, M, S>>,
        mut learner: Learner<Components<X, LR, M, S>>,
        dataloader_train: TrainLoader<Components<X, LR, M, S>>,
        dataloader_valid: ValidLoader<Components<X, LR, M, S>>,
        starting_epoch: usize,
        mut lr_steps: usize,
    ) -> (M, SupervisedTrainingEventProcessor<Components<X, LR, M, S>>)
    where
        LR: LrScheduler + 'static,
        M: TrainStep + AutodiffModule<Sharded<X>> + core::fmt::Display + 'static,
        M::InnerModule: InferenceStep,
        S: StateCodec<Distributed<X>> + 'static,
    {
        let ctx = self.device.context().clone();
        let mut processor = components.event_processor;
        let mut early_stopping = components.early_stopping;
        let interrupter = components.interrupter;
        let num_epochs = components.num_epochs;
        let accumulation = components.grad_accumulation.unwrap_or(1).max(1);
        let mut writer = self.checkpoints.as_ref().map(|root| {
            CheckpointWriter::new(root, self.device.rank(), self.device.mesh().world_size())
                .unwrap_or_else(|e| fail(e.into()))
        });
        for epoch in starting_epoch..=num_epochs {
            let global = Progress::new(epoch, num_epochs);
            let mut iterator = dataloader_train.iter();
            let mut iteration = 0;
            let mut accumulator = GradientsAccumulator::new();
            let mut accumulated = 0;
            let mut stopped = false;
            while let Some(item) = iterator.next() {
                iteration += 1;
                learner.lr_step();
                lr_steps += 1;
                let progress = iterator.progress();
                // FSDP prefetch, when the rank's policy asks for it.
                wildfire_parallel::prefetch_parameters::<Sharded<X>, X, M>(&learner.model());
                // Accumulation: the micro-batches' gradients stay unreduced until the last.
                ctx.set_no_sync(accumulation > 1);
                let out = learner.train_step(item);
                accumulator.accumulate(&learner.model(), out.grads);
                accumulated += 1;
                if accumulated == accumulation {
                    ctx.set_no_sync(false);
                    learner.optimizer_step(accumulator.grads());
                    accumulated = 0;
                }
                let item = TrainingItem::new(
                    out.item,
                    progress,
                    global.clone(),
                    Some(iteration),
                    Some(learner.lr_current()),
                );
                processor.process_train(LearnerEvent::ProcessedItem(item));
                // A stop asked on any rank stops every rank here.
                if self.any(interrupter.should_stop()) {
                    stopped = true;
                    break;
                }
            }
            ctx.set_no_sync(false);
            processor.process_train(LearnerEvent::EndEpoch(epoch));
            if stopped {
                tracing::info!(
                    reason = interrupter.get_message().unwrap_or_default(),
                    "training interrupted"
                );
                break;
            }
            // Every rank validates on the whole validation set (FSDP's forward needs them all).
            let model = learner.model().valid();
            let mut iterator = dataloader_valid.iter();
            let mut iteration = 0;
            while let Some(item) = iterator.next() {
                let progress = iterator.progress();
                iteration += 1;
                let item = InferenceStep::step(&model, item);
                let item = TrainingItem::new(item, progress, global.clone(), Some(iteration), None);
                processor.process_valid(LearnerEvent::ProcessedItem(item));
            }
            processor.process_valid(LearnerEvent::EndEpoch(epoch));
            if let Some(writer) = writer.as_mut() {
                self.save::<M, S>(writer, &learner.model(), epoch, lr_steps)
                    .unwrap_or_else(|e| fail(e));
            }
            // Early stopping is rank 0's decision (its metrics), taken by every rank.
            if let Some(strategy) = early_stopping.as_mut() {
                let stop =
                    self.device.rank() == 0 && strategy.should_stop(epoch, &components.event_store);
                if self.any(stop) {
                    break;
                }
            }
        }
        if let Some(writer) = writer.as_mut() {
            writer.wait().unwrap_or_else(|e| fail(e.into()));
        }
        (learner.model(), processor)
    }

    /// Save epoch `epoch`'s distributed checkpoint (in the background; the previous one is
    /// waited for first).
    fn save<M, S>(
        &self,
        writer: &mut CheckpointWriter,
        model: &M,
        epoch: usize,
        lr_steps: usize,
    ) -> Result<(), LearnerError>
    where
        M: AutodiffModule<Sharded<X>>,
        S: StateCodec<Distributed<X>> + 'static,
    {
        type Records<S, X> = ParamRecords<burn::optim::record::AdaptorRecord<S, Sharded<X>>>;
        let records = self.handoff.get::<Records<S, X>>();
        let snapshot = Snapshot::take::<Sharded<X>, M, S>(model, records)?;
        let state = LearnerState { epoch, lr_steps };
        let files = state_file(self.device.rank(), "learner.json", &state);
        writer.save(snapshot, epoch, files)?;
        Ok(())
    }

    /// Load the checkpoint of `epoch` into `learner` (the model and the optimizer state, each
    /// rank its pieces, from any layout that saved it); set the loaders' epochs; returns the
    /// learning-rate steps taken, which it replays.
    fn resume<LR, M, S>(
        &self,
        learner: &mut Learner<Components<X, LR, M, S>>,
        epoch: usize,
    ) -> Result<usize, LearnerError>
    where
        LR: LrScheduler + 'static,
        M: TrainStep + AutodiffModule<Sharded<X>> + core::fmt::Display + 'static,
        M::InnerModule: InferenceStep,
        S: StateCodec<Distributed<X>> + 'static,
    {
        let root = self.checkpoints.as_ref().ok_or_else(|| {
            LearnerError::Config(format!(
                "resuming from epoch {epoch} reads the checkpoints under \
                 LearnerRank::with_checkpoints(root): name the root"
            ))
        })?;
        let dir = CheckpointDir::new(root).at(epoch)?;
        let checkpoint = Checkpoint::open(&dir)?;
        let state: LearnerState = read_state_file(&dir, "learner.json")?;
        let model = checkpoint.load_model::<Sharded<X>, M>(learner.model())?;
        let records = checkpoint.load_optimizer::<Sharded<X>, M, S>(&model)?;
        learner.load_model(model.into_record());
        learner.load_optim(records);
        for _ in 0..state.lr_steps {
            learner.lr_step();
        }
        for counter in self
            .counters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            counter.store(state.epoch, Ordering::SeqCst);
        }
        tracing::info!(epoch, lr_steps = state.lr_steps, dir = %dir.display(), "resumed");
        Ok(state.lr_steps)
    }
}
