//! The training loop of one rank of a pipeline-parallel run (`--pp N`): the rank builds only
//! its stages of the GPT (the blocks the [`StagePlan`] gives them, the embeddings on the first
//! stage, the final norm and the tied head on the last), then per step runs its part of the
//! schedule ([`StepRunner::run_pipeline`]), reports the metrics of the whole mesh, and evaluates
//! by a forward-only pass through the stages.

use super::*;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::AdamW;
use wildfire_engine::recompute::mix_seed;
use wildfire_kernels::hooks::Inference;
use wildfire_models::gpt::{GptStage, StageInput, TokenSampler, cross_entropy, stage_param_name};
use wildfire_models::parallelize::init_gpt_stage;
use wildfire_parallel::pipeline::{Schedule, StagePlan};
use wildfire_parallel::{Group, PIPELINE_AXIS};

type A<B> = Autodiff<Distributed<B>>;

/// A rank's stages, in chunk order, with their stage numbers.
struct Stages<B: FusedOps> {
    chunks: Vec<GptStage<A<B>>>,
    /// Chunk `c` is stage `c·p + r`.
    numbers: Vec<usize>,
}

impl RankRun<'_> {
    /// Train this rank's stages (see the module docs); the summary's losses are the mesh's.
    pub fn train_pipelined<B: FusedOps>(
        &self,
        device: &DistDevice<B>,
    ) -> Result<RunSummary, PretrainError> {
        let config = self.config;
        let rank = device.rank();
        let ctx = device.context().clone();
        self.set_policy(&ctx);
        let schedule = config.parallel.schedule()?;
        let stages = self.build_stages::<B>(device, &schedule)?;
        let mut chunks = stages.chunks;
        let adamw = AdamWConfig::new()
            .with_beta_2(0.95)
            .with_weight_decay(config.weight_decay as f32);
        let mut optims: Vec<_> = chunks
            .iter()
            .map(|_| FsdpOptimizer::new(adamw.init::<A<B>, GptStage<A<B>>>()))
            .collect();
        if let (None, Some(file)) = (&self.resume, &config.init_from) {
            // Hugging Face GPT-2 weights, by the whole model's names: each stage its blocks.
            let weights = wildfire_models::hf::import_gpt2(file)?;
            for chunk in chunks.iter_mut() {
                let first = chunk.first_block;
                let name = move |path: &str| stage_param_name(first, path);
                *chunk = weights.load_model_named(chunk.clone(), &name)?;
            }
        }
        if let Some((checkpoint, _)) = &self.resume {
            // The checkpoint holds the whole model under its own names (whatever layout saved
            // it): each stage reads its blocks' pieces.
            for (chunk, optim) in chunks.iter_mut().zip(optims.iter_mut()) {
                let first = chunk.first_block;
                let name = move |path: &str| stage_param_name(first, path);
                *chunk = checkpoint.load_model_named(chunk.clone(), &name)?;
                let record = checkpoint.load_optimizer_named::<A<B>, _, AdamW>(chunk, &name)?;
                *optim = optim.clone().load_record(record);
            }
        }
        let mut writer = self.checkpoint_writer(rank, device.mesh().world_size())?;
        let mut step_runner = self.step_runner();
        let mut summary = RunSummary::at_setup();
        let progress = (rank == 0 && config.progress).then(|| self.progress_bar());
        let member = ctx.comm().member();
        member.set_tracing(config.trace.is_some());
        let m = schedule.microbatches();
        let micro = self.rows.len() / m;
        for step in self.first_step..config.steps {
            let started = Instant::now();
            let stats_before = ctx.comm_stats();
            ctx.reset_peak_bytes();
            let lr = config.lr_at(step);
            let batch = |mb: usize| {
                let start = self.rows.start + mb * micro;
                self.sampler
                    .tensors::<A<B>>(self.train, step as u64, start..start + micro, device)
                    .expect("the sampler was checked")
            };
            // Dropout masks seeded as the unpipelined step seeds them (run seed, step, the
            // micro-batch's first global row; each block by its model index), so the stages
            // draw the masks one device would.
            let seeds: Vec<u64> = (0..m)
                .map(|mb| {
                    let start = self.rows.start + mb * micro;
                    mix_seed(config.seed, step as u64, start as u64)
                })
                .collect();
            let step_started = Instant::now();
            let (next, record) = step_runner.run_pipeline(
                device,
                &schedule,
                chunks,
                &mut optims,
                lr,
                &seeds,
                tied_table::<B>,
                |chunk: &GptStage<A<B>>, _stage, mb, input, ckpt| {
                    let input = match input {
                        Some(hidden) => StageInput::Hidden(hidden),
                        None => StageInput::Tokens(batch(mb)[0].clone()),
                    };
                    chunk.forward_with(input, ckpt)
                },
                |mb, logits| {
                    let [_, y] = batch(mb);
                    cross_entropy(logits, y)
                },
            )?;
            chunks = next;
            member.trace_region("step", step_started);
            let param_bytes: u64 = chunks.iter().map(parameter_bytes).sum();
            let (mut metrics, elapsed) = self.step_metrics(
                &ctx,
                step,
                lr,
                &record.step,
                param_bytes,
                started,
                &stats_before,
            );
            tracing::debug!(
                step,
                rank,
                sends = record.sends,
                recvs = record.recvs,
                peak_held = record.peak_held,
                "pipeline step"
            );
            let (evaluate, save) = self.due(step);
            if evaluate {
                metrics.val_loss = self.evaluate_pipelined(&chunks, &stages.numbers, device)?;
            }
            if rank == 0 {
                self.report(&metrics, progress.as_ref(), elapsed)?;
            }
            summary.steps.push(metrics);
            if let Some(writer) = writer.as_mut()
                && save
            {
                let started = Instant::now();
                let mut snapshot: Option<Snapshot> = None;
                for (chunk, optim) in chunks.iter().zip(&optims) {
                    let part =
                        Snapshot::take_named(chunk, Some(optim.to_record()), &|path: &str| {
                            chunk.saved_name(path)
                        })?;
                    match snapshot.as_mut() {
                        Some(s) => s.merge(part),
                        None => snapshot = Some(part),
                    }
                }
                let snapshot = snapshot.expect("a rank holds a stage");
                let copy = started.elapsed().as_secs_f64();
                let files = self.state_files(rank, step + 1, step_runner.scaler());
                let previous = writer.save(snapshot, step + 1, files)?;
                if let (Some(report), Some(last)) = (previous, summary.saves.last_mut()) {
                    last.1 = report.write_time.as_secs_f64();
                }
                summary.saves.push((copy, 0.0));
            }
        }
        if let Some(writer) = writer.as_mut()
            && let Some(report) = writer.wait()?
            && let Some(last) = summary.saves.last_mut()
        {
            last.1 = report.write_time.as_secs_f64();
        }
        if let Some(bar) = &progress {
            bar.finish_and_clear();
        }
        self.finish(&mut summary, rank, member);
        if config.gather_parameters {
            summary.parameters = gather_parameters(device, &chunks)?;
        }
        if config.sample_tokens > 0 {
            let tokens = self.generate_pipelined(&chunks, &stages.numbers, device)?;
            summary.sample = self.data.tokenizer.decode(&tokens);
        }
        Ok(summary)
    }

    /// This rank's stages under `schedule`: the plan splits the blocks as evenly as they go
    /// (the longer runs first), and each rank draws only its stages' parameters.
    fn build_stages<B: FusedOps>(
        &self,
        device: &DistDevice<B>,
        schedule: &Schedule,
    ) -> Result<Stages<B>, PretrainError> {
        let model = &self.data.model;
        let plan = StagePlan::balanced(model.n_layer, schedule.stages())?;
        let mesh = device.mesh();
        let axis = mesh.axis_index(PIPELINE_AXIS)?;
        let pp_rank = Group::Axis(axis).index(mesh, device.rank())?;
        let last = schedule.stages() - 1;
        let mut stages = Stages {
            chunks: Vec::new(),
            numbers: Vec::new(),
        };
        let chunks = plan.chunks(schedule, pp_rank)?;
        for (stage, blocks) in schedule.stages_of(pp_rank).zip(chunks) {
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
        }
        Ok(stages)
    }

    /// The mean validation loss over `eval_iters` batches, each a forward-only pass through the
    /// stages ([`InferenceStages`]), the last stage's losses averaged over the mesh.
    fn evaluate_pipelined<B: FusedOps>(
        &self,
        chunks: &[GptStage<A<B>>],
        numbers: &[usize],
        device: &DistDevice<B>,
    ) -> Result<Option<f32>, PretrainError> {
        if !self.validates() {
            return Ok(None);
        }
        let ctx = device.context();
        let stages = InferenceStages::new(chunks, numbers, device)?;
        let (mut total, mut count) = (0.0f64, 0usize);
        for i in 0..self.config.eval_iters {
            let [x, y] = self.val_batch(i, device)?;
            if let Some(logits) = stages.forward(x)? {
                total += f64::from(cross_entropy(logits, y).into_scalar().elem::<f32>());
                count += 1;
            }
        }
        Ok(Some(wildfire_engine::metrics::mean_where_held(
            ctx, total, count,
        )?))
    }
}

impl RankRun<'_> {
    /// `--sample-tokens` tokens after a newline, generated through the stages: per token, a
    /// forward-only pass through the stages in order (as in evaluation), the last stage samples
    /// the next token from the last position's logits ([`TokenSampler`], seeded as one device
    /// seeds it, so the text is one device's) and sends it to every other member of its
    /// pipeline group. Every rank of the mesh takes part; each has the tokens at the end.
    fn generate_pipelined<B: FusedOps>(
        &self,
        chunks: &[GptStage<A<B>>],
        numbers: &[usize],
        device: &DistDevice<B>,
    ) -> Result<Vec<u32>, PretrainError> {
        let stages = InferenceStages::new(chunks, numbers, device)?;
        let p2p = device.context().comm().point_to_point()?;
        let prompt = self.data.tokenizer.encode("\n");
        let mut tokens: Vec<u32> = if prompt.is_empty() { vec![0] } else { prompt };
        let mut sampler = TokenSampler::new(0.8, 40, self.config.seed);
        let block_size = self.data.model.block_size;
        for _ in 0..self.config.sample_tokens {
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
