//! Any model that is a sequence of blocks, split into pipeline stages in one call:
//! [`pipeline`] cuts the model by a [`StagePlan`] and keeps the chunks of this rank (its stages
//! under the [`Schedule`]); [`Pipeline::step`] runs one step of the schedule on them.
//!
//! A model says how it splits by implementing [`Sequential`]: how many blocks it has, how to
//! cut it into stages, and a stage's forward. A stock burn-nn [`TransformerEncoder`] is one (each
//! stage an encoder holding its run of layers, its stock forward), and so is a `Vec` of any
//! blocks that implement [`Layer`] (burn-nn's [`TransformerEncoderLayer`] among them).
//!
//! `pipeline` takes the whole model, so every rank builds it first and then drops what it does
//! not hold. A model too large for one rank builds only its own stages instead — as
//! `wildfire_models::GptConfig::init_stage` does for the GPT, whose first stage reads tokens —
//! and hands them to [`Pipeline::from_chunks`].

use std::ops::Range;

use burn::module::{AutodiffModule, Module};
use burn::nn::transformer::{TransformerEncoder, TransformerEncoderInput, TransformerEncoderLayer};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};

use super::plan::StagePlan;
use super::runner::{
    PipelineStep, StepOptions, Transport, Whole, check_chunks, pipeline_group, run_step_custom,
};
use super::schedule::Schedule;
use crate::comm::Communicator;
use crate::error::Error;

/// A model that is a sequence of blocks: the input goes through them in order, each block's
/// output (a `[batch, seq, d]` tensor) the next one's input.
pub trait Sequential<B: Backend>: Module<B> {
    /// A stage: a run of consecutive blocks (with, for models that have them, the parts before
    /// the first block on the first stage and after the last on the last).
    type Stage: Module<B>;

    /// How many blocks the model has.
    fn blocks(&self) -> usize;

    /// The model cut into `ranges.len()` stages, stage `s` holding the blocks `ranges[s]`
    /// (contiguous, in order, covering every block: [`pipeline`] checks them). Parameters keep
    /// their values and ids.
    fn into_stages(self, ranges: &[Range<usize>]) -> Vec<Self::Stage>;

    /// A stage's forward: its blocks in order.
    fn forward_stage(stage: &Self::Stage, x: Tensor<B, 3>) -> Tensor<B, 3>;
}

/// A block of a [`Sequential`] `Vec`: `[batch, seq, d]` in and out.
pub trait Layer<B: Backend>: Module<B> {
    /// The block's forward.
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3>;
}

impl<B: Backend> Layer<B> for TransformerEncoderLayer<B> {
    /// The layer without masks.
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        TransformerEncoderLayer::forward(self, x, None, None)
    }
}

impl<B: Backend, L: Layer<B>> Sequential<B> for Vec<L> {
    type Stage = Vec<L>;

    fn blocks(&self) -> usize {
        self.len()
    }

    fn into_stages(self, ranges: &[Range<usize>]) -> Vec<Vec<L>> {
        let mut blocks = self.into_iter();
        ranges
            .iter()
            .map(|r| blocks.by_ref().take(r.len()).collect())
            .collect()
    }

    fn forward_stage(stage: &Vec<L>, x: Tensor<B, 3>) -> Tensor<B, 3> {
        stage.iter().fold(x, |x, block| block.forward(x))
    }
}

/// Each stage an encoder with the same settings holding its run of layers; the stock forward
/// (no masks).
impl<B: Backend> Sequential<B> for TransformerEncoder<B> {
    type Stage = TransformerEncoder<B>;

    fn blocks(&self) -> usize {
        self.layers.len()
    }

    fn into_stages(self, ranges: &[Range<usize>]) -> Vec<TransformerEncoder<B>> {
        let TransformerEncoder {
            layers,
            d_model,
            d_ff,
            n_heads,
            n_layers: _,
            dropout,
            norm_first,
            quiet_softmax,
        } = self;
        let mut layers = layers.into_iter();
        ranges
            .iter()
            .map(|r| TransformerEncoder {
                layers: layers.by_ref().take(r.len()).collect(),
                d_model,
                d_ff,
                n_heads,
                n_layers: r.len(),
                dropout,
                norm_first,
                quiet_softmax,
            })
            .collect()
    }

    fn forward_stage(stage: &TransformerEncoder<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
        stage.forward(TransformerEncoderInput::new(x))
    }
}

/// This rank's part of a pipeline: its chunks (the stages `c·p + r` of pipeline rank `r`, for
/// `c = 0, 1, …`) and the schedule that runs them.
pub struct Pipeline<B: Backend, S: Sequential<B>> {
    schedule: Schedule,
    axis: usize,
    rank: usize,
    chunks: Vec<S::Stage>,
    transport: Box<dyn Transport<B> + Send + Sync>,
}

impl<B: Backend, S: Sequential<B>> std::fmt::Debug for Pipeline<B, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("schedule", &self.schedule.kind())
            .field("axis", &self.axis)
            .field("rank", &self.rank)
            .field("stages", &self.stages())
            .finish()
    }
}

/// `model` split by `plan` into the stages of `schedule`, over the mesh axis `axis` of `comm`'s
/// mesh (the pipeline group): this rank's chunks. Refused with [`Error::InvalidStagePlan`]
/// when the plan's blocks are not the model's or its stages not the schedule's, and with
/// [`Error::InvalidSchedule`] when the axis is not as long as the schedule has ranks — before
/// any step runs.
pub fn pipeline<B: Backend, S: Sequential<B>>(
    model: S,
    comm: &dyn Communicator,
    axis: usize,
    plan: &StagePlan,
    schedule: &Schedule,
) -> Result<Pipeline<B, S>, Error> {
    let blocks = model.blocks();
    let covered = plan.blocks(plan.stages() - 1).end;
    if covered != blocks {
        return Err(Error::InvalidStagePlan(format!(
            "a plan of blocks 0..{covered} for a model of {blocks} blocks"
        )));
    }
    let (_, rank) = pipeline_group(comm, axis, schedule)?;
    // Refused unless the plan has the schedule's stages.
    plan.chunks(schedule, rank)?;
    let ranges: Vec<_> = (0..plan.stages()).map(|s| plan.blocks(s)).collect();
    let mut stages: Vec<Option<S::Stage>> =
        model.into_stages(&ranges).into_iter().map(Some).collect();
    if stages.len() != ranges.len() {
        return Err(Error::InvalidStagePlan(format!(
            "the model was cut into {} stages for a plan of {}",
            stages.len(),
            ranges.len()
        )));
    }
    let chunks = schedule
        .stages_of(rank)
        .map(|s| stages[s].take().expect("each stage taken once"))
        .collect();
    Ok(Pipeline {
        schedule: schedule.clone(),
        axis,
        rank,
        chunks,
        transport: Box::new(Whole),
    })
}

impl<B: Backend, S: Sequential<B>> Pipeline<B, S> {
    /// A pipeline of chunks this rank built itself (its stages `c·p + r`, in order), for a
    /// model no rank may hold whole.
    pub fn from_chunks(
        chunks: Vec<S::Stage>,
        comm: &dyn Communicator,
        axis: usize,
        schedule: &Schedule,
    ) -> Result<Self, Error> {
        let (_, rank) = pipeline_group(comm, axis, schedule)?;
        check_chunks(schedule, rank, chunks.len())?;
        Ok(Self {
            schedule: schedule.clone(),
            axis,
            rank,
            chunks,
            transport: Box::new(Whole),
        })
    }

    /// How activations and their gradients travel between stages (default [`Whole`]; on the
    /// `Distributed` backend [`Pieces`](super::Pieces) sends each rank's piece).
    pub fn with_transport(mut self, transport: impl Transport<B> + Send + Sync + 'static) -> Self {
        self.transport = Box::new(transport);
        self
    }

    /// This rank's index on the pipeline axis.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The stages this rank holds, chunk by chunk.
    pub fn stages(&self) -> Vec<usize> {
        self.schedule.stages_of(self.rank).collect()
    }

    /// This rank's chunks.
    pub fn chunks(&self) -> &[S::Stage] {
        &self.chunks
    }

    /// This rank's chunks, taken out.
    pub fn into_chunks(self) -> Vec<S::Stage> {
        self.chunks
    }

    /// Each chunk replaced by `f(chunk index, chunk)` (an optimizer step, sharding a stage):
    /// the first error stops it.
    pub fn try_map<E>(
        mut self,
        mut f: impl FnMut(usize, S::Stage) -> Result<S::Stage, E>,
    ) -> Result<Self, E> {
        self.chunks = std::mem::take(&mut self.chunks)
            .into_iter()
            .enumerate()
            .map(|(c, chunk)| f(c, chunk))
            .collect::<Result<_, _>>()?;
        Ok(self)
    }
}

impl<B, S> Pipeline<B, S>
where
    B: AutodiffBackend,
    S: Sequential<B>,
    S::Stage: AutodiffModule<B>,
{
    /// One step of the schedule on this rank's chunks: `input(micro-batch)` is the first
    /// stage's input, `loss(micro-batch, output)` turns the last stage's output into the
    /// micro-batch's loss. The gradients come back per chunk, summed over the micro-batches
    /// (those of the mean loss).
    pub fn step(
        &self,
        comm: &dyn Communicator,
        options: StepOptions<'_>,
        input: impl Fn(usize) -> Tensor<B, 3>,
        loss: impl Fn(usize, Tensor<B, 3>) -> Tensor<B, 1>,
    ) -> Result<PipelineStep, Error> {
        run_step_custom(
            &self.schedule,
            comm,
            self.axis,
            &self.chunks,
            options,
            |chunk, _, mb, x| S::forward_stage(chunk, x.unwrap_or_else(|| input(mb))),
            loss,
            |_, _, _, root, _| Ok(root.backward()),
            &*self.transport,
        )
    }
}
