//! The training loop of one rank of a pipeline-parallel run (`--pp N`): the rank builds only
//! its stages of the GPT (the blocks the [`StagePlan`] gives them, the embeddings on the first
//! stage, the final norm and the tied head on the last), then per step runs its part of the
//! schedule ([`StepRunner::run_pipeline`]), reports the metrics of the whole mesh, and evaluates
//! by a forward-only pass through the stages.

use super::rank::{StepAt, Trainee};
use super::*;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::AdamW;
use wildfire_engine::StepRecord;
use wildfire_kernels::hooks::Inference;
use wildfire_models::gpt::{GptStage, StageInput, TokenSampler, cross_entropy, stage_param_name};
use wildfire_models::parallelize::init_gpt_stage;
use wildfire_parallel::pipeline::{Schedule, StagePlan};
use wildfire_parallel::{Group, PIPELINE_AXIS};

type A<B> = Autodiff<Distributed<B>>;

/// A rank's stages, in chunk order, with their stage numbers, optimizers and schedule.
pub(super) struct Stages<B: FusedOps> {
    chunks: Vec<GptStage<A<B>>>,
    /// Chunk `c` is stage `c·p + r`.
    numbers: Vec<usize>,
    optims: Vec<StageOptimizer<B>>,
    schedule: Schedule,
}

type StageOptimizer<B> =
    FsdpOptimizer<burn::optim::adaptor::OptimizerAdaptor<AdamW, GptStage<A<B>>, A<B>>>;

impl RankRun<'_> {
    /// Train this rank's stages (see the module docs); the summary's losses are the mesh's.
    pub fn train_pipelined<B: FusedOps>(
        &self,
        device: &DistDevice<B>,
    ) -> Result<RunSummary, PretrainError> {
        let config = self.config;
        self.set_policy(device.context());
        let schedule = config.parallel.schedule()?;
        let mut stages = self.build_stages::<B>(device, schedule)?;
        if let (None, Some(file)) = (&self.resume, &config.init_from) {
            // Hugging Face GPT-2 weights, by the whole model's names: each stage its blocks.
            let weights = wildfire_models::hf::import_gpt2(file, self.data.model.n_head)?;
            for chunk in stages.chunks.iter_mut() {
                let first = chunk.first_block;
                let name = move |path: &str| stage_param_name(first, path);
                *chunk = weights.load_model_named(chunk.clone(), &name)?;
            }
        }
        if let Some((checkpoint, _)) = &self.resume {
            // The checkpoint holds the whole model under its own names (whatever layout saved
            // it): each stage reads its blocks' pieces.
            for (chunk, optim) in stages.chunks.iter_mut().zip(stages.optims.iter_mut()) {
                let first = chunk.first_block;
                let name = move |path: &str| stage_param_name(first, path);
                *chunk = checkpoint.load_model_named(chunk.clone(), &name)?;
                let record = checkpoint.load_optimizer_named::<A<B>, _, AdamW>(chunk, &name)?;
                *optim = optim.clone().load_record(record);
            }
        }
        let microbatches = stages.schedule.microbatches();
        self.train_loop(device, stages, microbatches)
    }

    /// This rank's stages under `schedule`: the plan splits the blocks as evenly as they go
    /// (the longer runs first), and each rank draws only its stages' parameters.
    /// This rank's stages under `schedule`: the plan splits the blocks as evenly as they go
    /// (the longer runs first), and each rank draws only its stages' parameters; AdamW (β₂
    /// 0.95, the configured weight decay) per stage.
    fn build_stages<B: FusedOps>(
        &self,
        device: &DistDevice<B>,
        schedule: Schedule,
    ) -> Result<Stages<B>, PretrainError> {
        let model = &self.data.model;
        let plan = StagePlan::balanced(model.n_layer, schedule.stages())?;
        let mesh = device.mesh();
        let axis = mesh.axis_index(PIPELINE_AXIS)?;
        let pp_rank = Group::Axis(axis).index(mesh, device.rank())?;
        let last = schedule.stages() - 1;
        let adamw = AdamWConfig::new()
            .with_beta_2(0.95)
            .with_weight_decay(self.config.weight_decay as f32);
        let mut stages = Stages {
            chunks: Vec::new(),
            numbers: Vec::new(),
            optims: Vec::new(),
            schedule,
        };
        let chunks = plan.chunks(&stages.schedule, pp_rank)?;
        for (stage, blocks) in stages.schedule.stages_of(pp_rank).zip(chunks) {
            if device.rank() == 0 || pp_rank == 0 {
                tracing::debug!(stage, ?blocks, "pipeline stage");
            }
            stages.chunks.push(init_gpt_stage(
                model,
                device,
                &self.config.parallel,
                blocks,
                stage == 0,
                stage == last,
            )?);
            stages.numbers.push(stage);
            stages
                .optims
                .push(FsdpOptimizer::new(adamw.init::<A<B>, GptStage<A<B>>>()));
        }
        Ok(stages)
    }
}

impl<B: FusedOps> Trainee<B> for Stages<B> {
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
            tied_table::<B>,
            |chunk: &GptStage<A<B>>, _stage, mb, input, ckpt| {
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

    fn param_bytes(&self) -> u64 {
        self.chunks.iter().map(parameter_bytes).sum()
    }

    /// Each batch a forward-only pass through the stages ([`InferenceStages`]), the last stage's
    /// losses averaged over the mesh.
    fn evaluate(&self, run: &RankRun, device: &DistDevice<B>) -> Result<f32, PretrainError> {
        let stages = InferenceStages::new(&self.chunks, &self.numbers, device)?;
        let (mut total, mut count) = (0.0f64, 0usize);
        for i in 0..run.config.eval_iters {
            let [x, y] = run.val_batch(i, device)?;
            if let Some(logits) = stages.forward(x)? {
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
            let part = Snapshot::take_named(chunk, Some(optim.to_record()), &|path: &str| {
                chunk.saved_name(path)
            })?;
            match snapshot.as_mut() {
                Some(s) => s.merge(part),
                None => snapshot = Some(part),
            }
        }
        Ok(snapshot.expect("a rank holds a stage"))
    }

    fn parameters(&self, device: &DistDevice<B>) -> Result<Vec<Vec<f32>>, PretrainError> {
        gather_parameters(device, &self.chunks)
    }

    /// `--sample-tokens` tokens after a newline, generated through the stages: per token, a
    /// forward-only pass through the stages in order (as in evaluation), the last stage samples
    /// the next token from the last position's logits ([`TokenSampler`], seeded as one device
    /// seeds it, so the text is one device's) and sends it to every other member of its
    /// pipeline group. Every rank of the mesh takes part; each has the tokens at the end.
    fn sample(&self, run: &RankRun, device: &DistDevice<B>) -> Result<Vec<u32>, PretrainError> {
        let stages = InferenceStages::new(&self.chunks, &self.numbers, device)?;
        let p2p = device.context().comm().point_to_point()?;
        let prompt = run.data.tokenizer.encode("\n");
        let mut tokens: Vec<u32> = if prompt.is_empty() { vec![0] } else { prompt };
        let mut sampler = TokenSampler::new(0.8, 40, run.config.seed);
        let block_size = run.data.model.block_size;
        for _ in 0..run.config.sample_tokens {
            let start = tokens.len().saturating_sub(block_size);
            let context: Vec<i64> = tokens[start..].iter().map(|&t| i64::from(t)).collect();
            let t = context.len();
            let idx = Tensor::from_data(TensorData::new(context, [1, t]), device);
            let token = match stages.forward(idx)? {
                Some(logits) => {
                    let logits = logits.narrow(1, t - 1, 1).into_data().convert::<f32>();
                    let token = sampler.pick(&logits.to_vec::<f32>().expect("f32 logits"));
                    for &member in stages.members.iter().filter(|&&m| m != device.rank()) {
                        p2p.send(member, TensorData::new(vec![i64::from(token)], [1]))?;
                    }
                    token
                }
                // The last stage (stage p·V − 1) is on the last pipeline rank.
                None => {
                    let last = *stages.members.last().expect("a pipeline rank");
                    p2p.recv(last)?.to_vec::<i64>().expect("a token")[0] as u32
                }
            };
            tokens.push(token);
        }
        Ok(tokens)
    }
}

/// A rank's stages for forward-only passes (evaluation, generation): a batch goes through the
/// stages in order, each rank running its stages in order, receiving each one's input from the
/// stage before and sending its output on.
struct InferenceStages<'a, B: FusedOps> {
    chunks: Vec<GptStage<Distributed<B>>>,
    numbers: &'a [usize],
    /// The global ranks of the pipeline group, by pipeline index.
    members: Vec<usize>,
    device: &'a DistDevice<B>,
}

impl<'a, B: FusedOps> InferenceStages<'a, B> {
    fn new(
        chunks: &[GptStage<A<B>>],
        numbers: &'a [usize],
        device: &'a DistDevice<B>,
    ) -> Result<Self, PretrainError> {
        let mesh = device.mesh();
        let axis = mesh.axis_index(PIPELINE_AXIS)?;
        Ok(Self {
            chunks: chunks.iter().map(|c| c.valid()).collect(),
            numbers,
            members: Group::Axis(axis).ranks(mesh, device.rank())?,
            device,
        })
    }

    /// One pass of token ids `idx` (used by the first stage); the last stage's logits on the
    /// rank that holds it, `None` elsewhere.
    fn forward(
        &self,
        idx: Tensor<Distributed<B>, 2, Int>,
    ) -> Result<Option<Tensor<Distributed<B>, 3>>, PretrainError> {
        let p2p = self.device.context().comm().point_to_point()?;
        let p = self.members.len();
        let mut idx = Some(idx);
        for (chunk, &stage) in self.chunks.iter().zip(self.numbers) {
            let input = if chunk.is_first() {
                StageInput::Tokens(idx.take().expect("one first stage"))
            } else {
                let data = p2p.recv(self.members[(stage - 1) % p])?;
                StageInput::Hidden(Tensor::from_data(data, self.device))
            };
            let out = chunk.forward_with(input, &Inference);
            if chunk.is_last() {
                return Ok(Some(out));
            }
            p2p.send(self.members[(stage + 1) % p], out.into_data())?;
        }
        Ok(None)
    }
}

/// The token table's copy on the first and on the last stage (the tied parameter).
fn tied_table<B: FusedOps>(chunk: &GptStage<A<B>>) -> Vec<ParamId> {
    chunk.wte.as_ref().map(|p| p.id).into_iter().collect()
}

/// Every parameter of the whole model on rank 0, in the whole model's visiting order (the
/// stages' parameters carry the whole model's ids): the other ranks of rank 0's pipeline group
/// send theirs. The last stage's copy of the tied table is left out (it equals the first's).
fn gather_parameters<B: FusedOps>(
    device: &DistDevice<B>,
    chunks: &[GptStage<A<B>>],
) -> Result<Vec<Vec<f32>>, PretrainError> {
    struct Collect(Vec<(u64, Vec<f32>)>, Option<ParamId>);
    impl<B: burn::tensor::backend::Backend> ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if Some(param.id) == self.1 {
                return;
            }
            let id: u64 = param.id.val();
            let values = param.val().into_data().convert::<f32>().to_vec().unwrap();
            self.0.push((id, values));
        }
    }
    let mut mine = Collect(Vec::new(), None);
    for chunk in chunks {
        mine.1 = (!chunk.is_first())
            .then(|| chunk.wte.as_ref().map(|p| p.id))
            .flatten();
        chunk.visit(&mut mine);
    }
    let mesh = device.mesh();
    let axis = mesh.axis_index(PIPELINE_AXIS)?;
    let members = Group::Axis(axis).ranks(mesh, device.rank())?;
    if !members.contains(&0) {
        return Ok(Vec::new());
    }
    let p2p = device.context().comm().point_to_point()?;
    let mut all = mine.0;
    if device.rank() == 0 {
        for &from in &members[1..] {
            let n = p2p.recv(from)?.to_vec::<i64>().expect("a count")[0] as usize;
            for _ in 0..n {
                let id = p2p.recv(from)?.to_vec::<i64>().expect("an id")[0] as u64;
                all.push((id, p2p.recv(from)?.to_vec::<f32>().expect("values")));
            }
        }
        all.sort_by_key(|(id, _)| *id);
        Ok(all.into_iter().map(|(_, v)| v).collect())
    } else {
        p2p.send(0, TensorData::new(vec![all.len() as i64], [1]))?;
        for (id, values) in all {
            let n = values.len();
            p2p.send(0, TensorData::new(vec![id as i64], [1]))?;
            p2p.send(0, TensorData::new(values, [n]))?;
        }
        Ok(Vec::new())
    }
}
