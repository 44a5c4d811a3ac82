//! The training loop of one rank of a pipeline-parallel run (`--pp N`): the rank builds only
//! its stages of the model (the blocks the [`StagePlan`] gives them, the token table on the
//! first stage, the final norm and the head on the last), then per step runs its part of the
//! schedule ([`StepRunner::run_pipeline`]), reports the metrics of the whole mesh, and evaluates
//! by a forward-only pass through the stages. Any family's stages
//! ([`PipelineStage`](wildfire_models::stage::PipelineStage)).

use super::rank::{StepAt, Trainee};
use super::*;
use burn::optim::record::AdaptorRecord;
use wildfire_engine::StepRecord;
use wildfire_models::gpt::cross_entropy;
use wildfire_models::llama::init_llama_stages;
use wildfire_models::parallelize::init_gpt_stages;
use wildfire_models::stage::{StageInput, TrainableStage, generate_staged, stage_pass};
use wildfire_parallel::StateCodec;
use wildfire_parallel::pipeline::{Schedule, StagePasses, gather_stage_parameters};

type A<B> = Autodiff<Distributed<B>>;

/// A rank's stages, in chunk order, with their stage numbers, optimizers (each stage's own
/// `O`) and schedule.
pub(super) struct Stages<B: FusedOps, S: TrainableStage<B>, O> {
    chunks: Vec<S>,
    /// Chunk `c` is stage `c·p + r`.
    numbers: Vec<usize>,
    optims: Vec<FsdpOptimizer<O>>,
    schedule: Schedule,
    /// `--offload params`: the stages' parameter pieces live in host memory between uses
    /// (loaded weights are moved there too).
    offload_params: bool,
    backend: std::marker::PhantomData<B>,
}

/// An optimizer a stage can train with and checkpoint: its record is Burn's adaptor record of a
/// per-tensor step ([`StageOptimizer::Codec`]) whose state the checkpoint can encode.
pub(super) trait StageOptimizer<B: FusedOps, S: TrainableStage<B>>:
    Optimizer<S, A<B>> + Clone
{
    /// The per-tensor step.
    type Codec: StateCodec<Distributed<B>>;

    /// The record as the checkpoint writes it.
    fn saved(record: Self::Record) -> ParamRecords<AdaptorRecord<Self::Codec, A<B>>>;

    /// The record from what the checkpoint read.
    fn loaded(record: ParamRecords<AdaptorRecord<Self::Codec, A<B>>>) -> Self::Record;
}

impl<B, S, X, O> StageOptimizer<B, S> for O
where
    B: FusedOps,
    S: TrainableStage<B>,
    X: StateCodec<Distributed<B>>,
    O: Optimizer<S, A<B>, Record = ParamRecords<AdaptorRecord<X, A<B>>>> + Clone,
{
    type Codec = X;

    fn saved(record: Self::Record) -> ParamRecords<AdaptorRecord<X, A<B>>> {
        record
    }

    fn loaded(record: ParamRecords<AdaptorRecord<X, A<B>>>) -> Self::Record {
        record
    }
}

impl RankRun<'_> {
    /// Train this rank's stages of the model (see the module docs): the plan splits the blocks
    /// as evenly as they go (the longer runs first), each rank draws only its stages'
    /// parameters; the summary's losses are the mesh's.
    pub fn train_pipelined<B: FusedOps>(
        &self,
        device: &DistDevice<B>,
    ) -> Result<RunSummary, PretrainError> {
        self.set_policy(device.context());
        let (parallel, schedule) = (&self.config.parallel, self.config.parallel.schedule()?);
        match &self.data.model {
            ModelConfig::Gpt(c) => {
                let chunks =
                    self.build(device, || init_gpt_stages(c, device, parallel, &schedule))?;
                self.train_stages(device, chunks, schedule)
            }
            ModelConfig::Llama(c) => {
                let chunks =
                    self.build(device, || init_llama_stages(c, device, parallel, &schedule))?;
                self.train_stages(device, chunks, schedule)
            }
        }
    }

    /// `chunks` (stage number, stage) trained under `schedule` with the run's optimizer per
    /// stage: Burn's AdamW (β₂ 0.95, the configured weight decay), the fused AdamW for bf16
    /// moments (the step's clipping and skip decided by the pipeline runner before it), or
    /// Adafactor.
    fn train_stages<B: FusedOps, S: TrainableStage<B>>(
        &self,
        device: &DistDevice<B>,
        chunks: Vec<(usize, S)>,
        schedule: Schedule,
    ) -> Result<RunSummary, PretrainError> {
        match (self.config.optimizer, self.config.optim_state) {
            (OptimizerKind::Adafactor, _) => {
                let adafactor = self.adafactor();
                self.train_stages_with(device, chunks, schedule, |_| Ok(adafactor.init()))
            }
            (OptimizerKind::Muon, _) => {
                let muon = self.muon();
                self.train_stages_with(device, chunks, schedule, |stage| {
                    muon.init::<B, S>(stage, wildfire_models::is_table)
                        .map_err(PretrainError::Config)
                })
            }
            (OptimizerKind::Adamw, _) if self.config.offload != Offload::None => {
                let fused = self.fused_adamw();
                self.train_stages_with(device, chunks, schedule, |_| {
                    Ok(wildfire_engine::OffloadAdamW::<B>::optimizer::<S>(fused).0)
                })
            }
            (OptimizerKind::Adamw, OptimState::F32) => {
                let adamw = self.adamw();
                self.train_stages_with(device, chunks, schedule, |_| Ok(adamw.init()))
            }
            (OptimizerKind::Adamw, OptimState::Int8) => {
                let fused = self.fused_adamw();
                self.train_stages_with(device, chunks, schedule, |_| {
                    Ok(wildfire_engine::QuantAdamW::<B>::optimizer::<S>(fused).0)
                })
            }
            (OptimizerKind::Adamw, OptimState::Bf16) => {
                let fused = self.fused_adamw();
                self.train_stages_with(device, chunks, schedule, |_| {
                    Ok(wildfire_engine::FusedAdamW::<B>::optimizer::<S>(fused).0)
                })
            }
        }
    }

    /// [`RankRun::train_stages`] with an optimizer per stage from `optim`.
    fn train_stages_with<B: FusedOps, S: TrainableStage<B>, O: StageOptimizer<B, S>>(
        &self,
        device: &DistDevice<B>,
        chunks: Vec<(usize, S)>,
        schedule: Schedule,
        optim: impl Fn(&S) -> Result<O, PretrainError>,
    ) -> Result<RunSummary, PretrainError> {
        let optims = chunks
            .iter()
            .map(|(_, stage)| optim(stage).map(FsdpOptimizer::new))
            .collect::<Result<_, _>>()?;
        let (numbers, mut chunks): (Vec<usize>, Vec<S>) = chunks.into_iter().unzip();
        let offload_params = self.config.offload == Offload::Params;
        if offload_params {
            chunks = chunks
                .into_iter()
                .map(wildfire_parallel::offload_parameters)
                .collect();
        }
        let microbatches = schedule.microbatches();
        let stages = Stages {
            chunks,
            numbers,
            optims,
            schedule,
            offload_params,
            backend: std::marker::PhantomData,
        };
        self.train_loop(device, stages, microbatches)
    }
}

impl<B: FusedOps, S: TrainableStage<B>, O: StageOptimizer<B, S>> Trainee<B> for Stages<B, S, O> {
    /// This rank's part of the schedule ([`StepRunner::run_pipeline`]); the loss is the mesh's.
    fn step(
        &mut self,
        runner: &mut StepRunner,
        at: &StepAt<B>,
    ) -> Result<StepRecord, PretrainError> {
        let (next, record) = runner.run_pipeline(
            at.device,
            &self.schedule,
            std::mem::take(&mut self.chunks),
            &mut self.optims,
            at.lr,
            at.seeds,
            S::tied_table,
            |chunk: &S, _stage, mb, input, ckpt| {
                let input = match input {
                    Some(hidden) => StageInput::Hidden(hidden),
                    None => StageInput::Tokens((at.batch)(mb)[0].clone()),
                };
                chunk.forward_with(input, ckpt)
            },
            |mb, logits| {
                let [_, y] = (at.batch)(mb);
                cross_entropy(logits, y)
            },
        )?;
        self.chunks = next;
        tracing::debug!(
            rank = at.device.rank(),
            sends = record.sends,
            recvs = record.recvs,
            peak_held = record.peak_held,
            "pipeline step"
        );
        Ok(record.step)
    }

    /// The checkpoint (or Hugging Face weights) holds the whole model under its own names,
    /// whatever layout saved it: each stage reads its blocks' pieces.
    fn load(&mut self, weights: &Checkpoint, optimizer: bool) -> Result<(), PretrainError> {
        for (chunk, optim) in self.chunks.iter_mut().zip(self.optims.iter_mut()) {
            let first = chunk.first_block();
            let name = move |path: &str| wildfire_models::stage::stage_param_name(first, path);
            *chunk = weights.load_model_named(chunk.clone(), &name)?;
            if optimizer {
                let record = weights.load_optimizer_named::<A<B>, _, O::Codec>(chunk, &name)?;
                *optim = optim.clone().load_record(O::loaded(record));
            }
            if self.offload_params {
                *chunk = wildfire_parallel::offload_parameters(chunk.clone());
            }
        }
        Ok(())
    }

    fn param_bytes(&self) -> u64 {
        self.chunks.iter().map(parameter_bytes).sum()
    }

    /// Each batch a forward-only pass through the stages ([`StagePasses`]), the last stage's
    /// losses averaged over the mesh.
    fn evaluate(&self, run: &RankRun, device: &DistDevice<B>) -> Result<f32, PretrainError> {
        let (passes, chunks) = self.passes(device)?;
        let (mut total, mut count) = (0.0f64, 0usize);
        for i in 0..run.config.eval_iters {
            let [x, y] = run.val_batch(i, device)?;
            if let Some(logits) = passes.forward(stage_pass(&chunks, x))? {
                total += f64::from(cross_entropy(logits, y).into_scalar().elem::<f32>());
                count += 1;
            }
        }
        Ok(wildfire_engine::metrics::mean_where_held(
            device.context(),
            total,
            count,
        )?)
    }

    /// Every chunk's pieces under the whole model's names (a copy of the tied table not at all).
    fn snapshot(&self) -> Result<Snapshot, PretrainError> {
        let mut snapshot: Option<Snapshot> = None;
        for (chunk, optim) in self.chunks.iter().zip(&self.optims) {
            let part =
                Snapshot::take_named(chunk, Some(O::saved(optim.to_record())), &|path: &str| {
                    chunk.saved_name(path)
                })?;
            match snapshot.as_mut() {
                Some(s) => s.merge(part),
                None => snapshot = Some(part),
            }
        }
        Ok(snapshot.expect("a rank holds a stage"))
    }

    /// The last stage's copy of the tied table left out (it equals the first's).
    fn parameters(&self, device: &DistDevice<B>) -> Result<Vec<Vec<f32>>, PretrainError> {
        let copy = S::tied_copy;
        Ok(gather_stage_parameters(device, &self.chunks, copy)?)
    }

    /// `--sample-tokens` tokens after the prompt, generated through the stages
    /// ([`generate_staged`]).
    fn sample(&self, run: &RankRun, device: &DistDevice<B>) -> Result<Vec<u32>, PretrainError> {
        let (passes, chunks) = self.passes(device)?;
        let (prompt, sampler) = run.sampling()?;
        let (tokens, block_size) = (run.config.sample_tokens, run.data.model.block_size());
        // Every rank generates the whole sequence: the context split is off meanwhile.
        let generate = wildfire_parallel::without_context_parallel(device, || {
            generate_staged(&chunks, &passes, &prompt, tokens, block_size, sampler)
        });
        Ok(generate?)
    }
}

impl<B: FusedOps, S: TrainableStage<B>, O> Stages<B, S, O> {
    /// Forward-only passes through this rank's stages, and the stages without autodiff.
    fn passes<'a>(
        &'a self,
        device: &'a DistDevice<B>,
    ) -> Result<(StagePasses<'a, B>, Vec<S::InnerModule>), PretrainError> {
        let passes = StagePasses::new(device, &self.numbers, self.schedule.stages())?;
        Ok((passes, self.chunks.iter().map(|c| c.valid()).collect()))
    }
}
