//! The training loop of one rank: build the model (or load the checkpoint), lay it out over the
//! mesh, then per step: the micro-batches, the step, the metrics, evaluation and checkpoints.

use super::*;
use burn::optim::record::AdaptorRecord;
use std::ops::Range;
use wildfire_checkpoint::dcp::state_file;
use wildfire_engine::StepRecord;
use wildfire_engine::metrics::{StepWatch, router_over_ranks};
use wildfire_engine::recompute::mix_seed;
use wildfire_engine::report::{MfuSpec, StepReporter};
use wildfire_models::gpt::TokenSampler;
use wildfire_models::llama::{init_llama, parallelize_llama};
use wildfire_models::{CausalLm, DistributedLm};
use wildfire_parallel::{
    RankContext, RankPolicy, StateCodec, context_columns, without_context_parallel,
};

type A<B> = Autodiff<Distributed<B>>;

/// Files rank 0 adds to a checkpoint: (name, bytes).
type Files = Vec<(String, Vec<u8>)>;

/// What one rank's training reads.
pub(super) struct RankRun<'a> {
    pub config: &'a PretrainConfig,
    pub data: &'a RunData,
    pub sampler: &'a BatchSampler,
    pub val_sampler: &'a BatchSampler,
    pub train: TokenSlice<'a>,
    pub val: TokenSlice<'a>,
    /// This rank's rows of the global batch.
    pub rows: std::ops::Range<usize>,
    pub metrics: Option<&'a MetricsLog>,
    /// The checkpoint and loss scaler to resume from.
    pub resume: Option<(&'a Checkpoint, Option<DynamicLossScaler>)>,
    pub first_step: usize,
    /// When this rank's part of the run started (its share of the wall clock's `build`).
    pub started: Instant,
    /// An elastic run's attempt: where rank 0 records its progress, the restart it follows
    /// (its first step's metrics carry it, timed), and with `--memory-checkpoints` the store
    /// every save is also kept in.
    pub attempt: Option<&'a super::elastic::Attempt>,
}

impl RankRun<'_> {
    /// The whole model of the run's family, laid out over the mesh (each rank drawing only its
    /// pieces of the parameters the layout splits), trained by [`RankRun::train_model`].
    pub fn train<B: FusedOps>(&self, device: &DistDevice<B>) -> Result<RunSummary, PretrainError> {
        let parallel = &self.config.parallel;
        // Set once, before the layout fills in the sharding and sequence parallelism.
        self.set_policy(device.context());
        let mesh = device.mesh();
        match &self.data.model {
            ModelConfig::Gpt(c) => {
                let model = self.build(device, || init_gpt::<A<B>>(c, device, parallel))?;
                self.train_model(device, parallelize_gpt(model, mesh, parallel)?)
            }
            ModelConfig::Llama(c) => {
                let model = self.build(device, || init_llama::<A<B>>(c, device, parallel))?;
                self.train_model(device, parallelize_llama(model, mesh, parallel)?)
            }
        }
    }

    /// The model (or this rank's stages) that `build` makes: with no value drawn when a
    /// checkpoint is resumed — the load overwrites every element, and checks that it does.
    pub(super) fn build<B: Backend, R>(
        &self,
        device: &DistDevice<B>,
        build: impl FnOnce() -> R,
    ) -> R {
        match self.resume {
            Some(_) => device.context().build_for_load(build),
            None => build(),
        }
    }

    /// `model` trained with the run's optimizer under `FsdpOptimizer`: AdamW (β₂ 0.95, the
    /// configured weight decay) — on backends with kernels, or with bf16 moments, the fused
    /// optimizer tail (one unscale + Σg² + overflow pass per gradient, one AdamW pass per
    /// parameter; Burn-op defaults where the backend has no kernels), with 8-bit moments the
    /// quantised AdamW on that tail, elsewhere Burn's AdamW —
    /// Adafactor, or Muon with AdamW for the tables and vectors.
    fn train_model<B: FusedOps, M: DistributedLm<B>>(
        &self,
        device: &DistDevice<B>,
        model: M,
    ) -> Result<RunSummary, PretrainError> {
        let accum = self.config.accum;
        match self.config.optimizer {
            OptimizerKind::Adafactor => {
                let adafactor = self.adafactor().init::<A<B>, M>();
                let whole = Whole::new(model, FsdpOptimizer::new(adafactor), None);
                self.train_loop(device, whole, accum)
            }
            OptimizerKind::Muon => {
                let muon = self
                    .muon()
                    .init::<B, M>(&model, wildfire_models::is_table)
                    .map_err(PretrainError::Config)?;
                let whole = Whole::new(model, FsdpOptimizer::new(muon), None);
                self.train_loop(device, whole, accum)
            }
            OptimizerKind::Adamw if self.config.offload != Offload::None => {
                let (adamw, inputs) =
                    wildfire_engine::OffloadAdamW::<B>::optimizer::<M>(self.fused_adamw());
                let mut whole = Whole::new(model, FsdpOptimizer::new(adamw), Some(inputs));
                if self.config.offload == Offload::Params {
                    whole = whole.offloading_params();
                }
                self.train_loop(device, whole, accum)
            }
            OptimizerKind::Adamw if self.config.optim_state == OptimState::Int8 => {
                let (adamw, inputs) =
                    wildfire_engine::QuantAdamW::<B>::optimizer::<M>(self.fused_adamw());
                let whole = Whole::new(model, FsdpOptimizer::new(adamw), Some(inputs));
                self.train_loop(device, whole, accum)
            }
            OptimizerKind::Adamw
                if B::FUSED.optimizer || self.config.optim_state != OptimState::F32 =>
            {
                let (adamw, inputs) =
                    wildfire_engine::FusedAdamW::<B>::optimizer::<M>(self.fused_adamw());
                let whole = Whole::new(model, FsdpOptimizer::new(adamw), Some(inputs));
                self.train_loop(device, whole, accum)
            }
            OptimizerKind::Adamw => {
                let adamw = self.adamw().init::<A<B>, M>();
                let whole = Whole::new(model, FsdpOptimizer::new(adamw), None);
                self.train_loop(device, whole, accum)
            }
        }
    }

    /// Burn's AdamW with the hyper-parameters of [`RankRun::fused_adamw`].
    pub(super) fn adamw(&self) -> AdamWConfig {
        let c = self.fused_adamw();
        AdamWConfig::new()
            .with_beta_1(c.beta1 as f32)
            .with_beta_2(c.beta2 as f32)
            .with_epsilon(c.epsilon as f32)
            .with_weight_decay(c.weight_decay as f32)
    }

    /// The run's AdamW: β = (0.9, 0.95), ε 1e-5 (Burn's AdamW default), the configured weight
    /// decay, its moments in `--optim-state`'s dtype.
    pub(super) fn fused_adamw(&self) -> wildfire_engine::FusedAdamWConfig {
        wildfire_engine::FusedAdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            epsilon: 1e-5,
            weight_decay: self.config.weight_decay,
            moments: self.config.optim_state,
            multi_tensor: true,
        }
    }

    /// Muon (PyTorch's defaults) for the hidden matrices with Moonlight's learning-rate match
    /// (`MuonLr::MatchRmsAdamw`: `--lr` and `--weight-decay` serve both halves), and the run's
    /// AdamW (β₂ 0.95, ε 1e-5) for the tables and vectors.
    pub(super) fn muon(&self) -> wildfire_engine::MuonConfig {
        let adamw = self.fused_adamw();
        wildfire_engine::MuonConfig {
            weight_decay: adamw.weight_decay,
            adjust_lr: wildfire_engine::MuonLr::MatchRmsAdamw,
            adamw_beta1: adamw.beta1,
            adamw_beta2: adamw.beta2,
            adamw_epsilon: adamw.epsilon,
            split: self.config.muon_split,
            ..wildfire_engine::MuonConfig::default()
        }
    }

    /// Adafactor (PyTorch's defaults) with the run's weight decay.
    pub(super) fn adafactor(&self) -> wildfire_engine::AdafactorConfig {
        wildfire_engine::AdafactorConfig::new().with_weight_decay(self.config.weight_decay)
    }

    /// The training loop, whatever the rank trains (the whole model, or its pipeline stages):
    /// per step its `microbatches` micro-batches of this rank's rows, the step, the metrics,
    /// evaluation and checkpoints; at the end the peaks, the parameters and a sample.
    pub(super) fn train_loop<B: FusedOps, T: Trainee<B>>(
        &self,
        device: &DistDevice<B>,
        mut trainee: T,
        microbatches: usize,
    ) -> Result<RunSummary, PretrainError> {
        let config = self.config;
        // The checkpoint resumed (parameters and optimizer state), or the Hugging Face weights
        // of `--init-from`: each rank reads the pieces that overlap its own, in this run's
        // layout (the saving run's mesh and strategy may differ).
        match (&self.resume, &config.init_from) {
            (Some((checkpoint, _)), _) => {
                let loading = Instant::now();
                trainee.load(checkpoint, true)?;
                if device.rank() == 0 {
                    tracing::info!(
                        "loaded the checkpoint {} in {:.2} s{}",
                        checkpoint.dir().display(),
                        loading.elapsed().as_secs_f64(),
                        if checkpoint.is_in_memory() {
                            " (from memory)"
                        } else {
                            ""
                        }
                    );
                }
            }
            (None, Some(file)) => trainee.load(&self.data.model.import_hf(file)?, false)?,
            (None, None) => {}
        }
        let (rank, ctx) = (device.rank(), device.context().clone());
        let mut runner = self.step_runner();
        let mut writer = match &config.save {
            Some(root) => {
                let writer = CheckpointWriter::new(root, rank, device.mesh().world_size())?;
                Some(match self.attempt.and_then(|a| a.memory.clone()) {
                    Some(store) => writer.with_memory(store),
                    None => writer,
                })
            }
            None => None,
        };
        // The process's peaks once every rank's setup is done (ranks as threads share the
        // process: rank 0 reading them alone would read them early).
        ctx.comm().barrier(wildfire_parallel::Group::World)?;
        let mut summary = RunSummary::at_setup();
        summary.wall.build = self.started.elapsed().as_secs_f64();
        let reporter = (rank == 0).then(|| self.reporter());
        let member = ctx.comm().member();
        member.set_tracing(config.trace.is_some());
        let schedule = config.schedule();
        let (moe_blocks, experts) = self.data.model.moe_blocks();
        // Rank 0 records where an elastic attempt got to.
        let attempt = self.attempt.filter(|_| rank == 0);
        if let Some(attempt) = attempt {
            attempt.progress.looping(self.first_step);
        }
        let timeout = std::time::Duration::from_secs_f64(config.timeout);
        // One profile per process, started by the first of its ranks to get there.
        let profile_from = super::host_profile::first_profiled(self.first_step, config.steps);
        let mut profile = None;
        for step in self.first_step..config.steps {
            if step == profile_from
                && let Some(path) = &config.host_profile
            {
                let path = match config.launch {
                    Launch::Threads => path.clone(),
                    _ => path.with_extension(format!("rank-{rank}.folded")),
                };
                profile = super::host_profile::HostProfile::start(&path)?;
            }
            if let Some(fail) = &config.fail_at {
                fail.strike(step, rank, ctx.comm(), timeout)?;
            }
            // On a CPU backend the rank's other pool workers look for work through the step and
            // evaluation instead of sleeping between ops (each wake-up is a futex call); on a
            // device backend there is none for them (see `busy_workers_for`).
            let _busy = wildfire_parallel::busy_workers_for::<B>();
            let watch = StepWatch::start(&ctx);
            // Every `n` steps (0: never), and at the last step.
            let due =
                |n: usize| (n > 0 && (step + 1).is_multiple_of(n)) || step + 1 == config.steps;
            let lr = schedule.at(step);
            // Recomputation and dropout streams are seeded by (run seed, step, the micro-batch's
            // first global row), so tensor-parallel peers (same rows) draw the same masks and
            // pipeline stages the masks one device would.
            let rows = BatchSampler::microbatches(self.rows.clone(), microbatches);
            let seed = |r: &Range<usize>| mix_seed(config.seed, step as u64, r.start as u64);
            let seeds: Vec<u64> = rows.iter().map(seed).collect();
            let batch = |i: usize| {
                let rows = rows[i].clone();
                let sampler = self.sampler;
                let batch = sampler.tensors::<A<B>>(self.train, step as u64, rows, device);
                // Under context parallelism, this rank's chunks of every row.
                batch
                    .expect("the sampler was checked")
                    .map(|t| context_columns(t).expect("the sequence length was checked"))
            };
            let step_started = Instant::now();
            let at = StepAt {
                device,
                lr,
                seeds: &seeds,
                batch: &batch,
            };
            let record = trainee.step(&mut runner, &at)?;
            member.trace_region("step", step_started);
            let tokens = config.batch_size * self.data.model.block_size();
            let (mut m, elapsed) =
                watch.finish(&ctx, step, lr, &record, trainee.param_bytes(), tokens);
            if config.probe || config.parallel.pp > 1 {
                m.stages = self.ranks_peaks(device, &m, elapsed)?;
            }
            // The wall clock's steps are the seconds the metrics report.
            if step == self.first_step {
                summary.wall.first_step = elapsed;
            } else {
                summary.wall.steps += elapsed;
            }
            m.router = router_over_ranks(&ctx, record.router.as_ref(), &moe_blocks, experts)?;
            if step == self.first_step
                && let Some(attempt) = attempt
                && let Some((restart, decided)) = &attempt.restart
            {
                m.restart = Some(attempt.progress.timed(restart, *decided));
            }
            let (evaluate, save) = (due(config.eval_every), due(config.save_every));
            if evaluate && self.validates() {
                let eval_started = Instant::now();
                m.val_loss = Some(trainee.evaluate(self, device)?);
                summary.wall.eval += eval_started.elapsed().as_secs_f64();
            }
            if let Some(reporter) = &reporter {
                reporter
                    .report(&m, elapsed)
                    .map_err(io_err(reporter.log_path().unwrap_or(Path::new("metrics"))))?;
            }
            summary.steps.push(m);
            if let Some(writer) = writer.as_mut()
                && save
            {
                // This rank's pieces are held (the part on the step's path: no copy), then read
                // out and written in the background while training goes on; rank 0 adds the run
                // state and commits. No collective runs.
                // The previous save's write first: a wait here is on the step's path.
                let started = Instant::now();
                let waited = match writer.wait()? {
                    Some(_) => started.elapsed().as_secs_f64(),
                    None => 0.0, // no save before this one
                };
                if waited > 0.01 {
                    tracing::info!(
                        step,
                        "checkpoint: waited {waited:.2} s for the previous save's write \
                         (saves closer together than a write takes)"
                    );
                }
                summary.save_waits.push(waited);
                summary.wall.save_wait += waited;
                let taken = Instant::now();
                let snapshot = trainee.snapshot()?;
                let copy = taken.elapsed().as_secs_f64();
                tracing::debug!(step, bytes = snapshot.bytes(), copy, "checkpoint taken");
                summary.saves.push((copy, 0.0));
                let files = self.state_files(rank, step + 1, runner.scaler());
                writer.save(snapshot, step + 1, files)?;
                summary.wall.checkpoint += taken.elapsed().as_secs_f64();
            }
            if let Some(attempt) = attempt {
                attempt.progress.stepped(step + 1);
            }
        }
        // No step trained (`--steps 0`, or a resume at its last step): the weights as loaded are
        // evaluated once, when validation is asked for.
        if self.first_step >= config.steps && self.validates() {
            let eval_started = Instant::now();
            let loss = trainee.evaluate(self, device)?;
            summary.wall.eval += eval_started.elapsed().as_secs_f64();
            if rank == 0 {
                tracing::info!("no step trained: val_loss {loss:.4}");
            }
            summary.val_loss = Some(loss);
        }
        drop(reporter);
        if let Some(profile) = profile {
            profile.finish(config.steps - profile_from)?;
        }
        if let Some(writer) = writer.as_mut() {
            let waited = Instant::now();
            writer.wait()?;
            summary.wall.checkpoint += waited.elapsed().as_secs_f64();
            for (save, report) in summary.saves.iter_mut().zip(writer.reports()) {
                save.1 = report.write_time.as_secs_f64();
            }
        }
        let end_started = Instant::now();
        // Likewise at the end: every rank's last step and checkpoint written.
        ctx.comm().barrier(wildfire_parallel::Group::World)?;
        self.finish(&mut summary, rank, member);
        summary.prefetch = ctx.prefetch_stats();
        let counters = ctx.counters();
        summary.host_uploads = counters.host_uploads;
        summary.host_gathers = counters.host_gathers;
        summary.comm_uploads = counters.comm_uploads;
        summary.orthogonalised = counters
            .work
            .get(wildfire_engine::NEWTON_SCHULZ)
            .copied()
            .unwrap_or(0);
        // Gathering sharded parameters and sampling take collectives: every rank does them.
        if config.gather_parameters {
            summary.parameters = trainee.parameters(device)?;
        }
        if config.sample_tokens > 0 {
            summary.sample = self.data.tokenizer.decode(&trainee.sample(self, device)?);
        }
        summary.wall.end = end_started.elapsed().as_secs_f64();
        Ok(summary)
    }

    /// Whether the run evaluates: validation batches asked for, and validation data longer than
    /// a context.
    pub(super) fn validates(&self) -> bool {
        self.config.eval_iters > 0 && self.val.len() > self.data.model.block_size()
    }

    /// Validation batch `i` of this rank's rows (the same batches every evaluation).
    pub(super) fn val_batch<B: FusedOps>(
        &self,
        i: usize,
        device: &DistDevice<B>,
    ) -> Result<[Tensor<Distributed<B>, 2, Int>; 2], PretrainError> {
        let batch = self.val_sampler.tensors::<Distributed<B>>(
            self.val,
            i as u64,
            self.rows.clone(),
            device,
        )?;
        let [x, y] = batch.map(context_columns);
        Ok([x?, y?])
    }

    /// The rank's run-wide policy from the configuration (before the model is laid out).
    pub(super) fn set_policy(&self, ctx: &RankContext) {
        let config = self.config;
        ctx.set_policy(RankPolicy {
            compute_dtype: config.precision.reduced_dtype(),
            grad_reduce_dtype: config.grad_reduce.reduced_dtype(),
            memory_budget: config.memory_budget,
            prefetch: config.prefetch,
            reduce_in_flight: config.reduce_in_flight,
            bucket_bytes: (config.bucket_mb * (1u64 << 20) as f64) as usize,
            ..RankPolicy::default()
        });
    }

    /// The step runner: clipping, recomputation, the skip limit, and for f16 the loss scaler
    /// (the checkpoint's when resuming), its steps numbered from the first step run.
    pub(super) fn step_runner(&self) -> StepRunner {
        let config = self.config;
        let resume_scaler = self.resume.as_ref().and_then(|(_, s)| s.clone());
        let scaler = (config.precision == Precision::F16).then(|| {
            resume_scaler.unwrap_or_else(|| DynamicLossScaler::new(LossScalerConfig::default()))
        });
        StepRunner::new(
            StepRunnerConfig {
                clip: (config.clip > 0.0).then_some(config.clip as f32),
                recompute: config.parallel.recompute,
                max_skipped_in_a_row: config.max_skipped,
            },
            scaler,
        )
        .starting_at(self.first_step)
    }

    /// The run state rank 0 writes next to the pieces (`state.json`: steps done, config, model
    /// shape, loss scaler); nothing on the other ranks.
    fn state_files(&self, rank: usize, step: usize, scaler: Option<&DynamicLossScaler>) -> Files {
        let state = CheckpointState {
            step,
            config: self.config.clone(),
            model: self.data.model.clone(),
            scaler: scaler.cloned(),
        };
        state_file(rank, "state.json", &state)
    }

    /// The end of a rank's run: peaks, and the trace when one was asked for.
    pub(super) fn finish(
        &self,
        summary: &mut RunSummary,
        rank: usize,
        member: &wildfire_parallel::comm::Member,
    ) {
        summary.final_peak_rss = peak_rss();
        if self.config.trace.is_some() {
            summary.trace = vec![(rank, member.take_trace())];
            member.set_tracing(false);
        }
        summary.final_heap_peak = crate::alloc::heap_peak() as u64;
    }

    /// Every pipeline position's peaks in the step `m` (`elapsed` seconds), the largest over
    /// the ranks there ([`wildfire_engine::metrics::ranks_peaks`]).
    fn ranks_peaks<B: FusedOps>(
        &self,
        device: &DistDevice<B>,
        m: &StepMetrics,
        elapsed: f64,
    ) -> Result<Vec<wildfire_engine::RankPeaks>, PretrainError> {
        let (ctx, mesh) = (device.context(), device.mesh());
        let (position, positions) = match mesh.axis_index(wildfire_parallel::PIPELINE_AXIS) {
            Ok(axis) => (mesh.group_index(device.rank(), axis), mesh.axis_size(axis)),
            Err(_) => (0, 1),
        };
        let mine = wildfire_engine::RankPeaks {
            peak_bytes: m.peak_bytes,
            phases: m.phases,
            resident_bytes: ctx.live_bytes(),
            host_bytes: m.host_bytes,
            seconds: elapsed,
        };
        Ok(wildfire_engine::metrics::ranks_peaks(
            ctx, position, positions, mine,
        )?)
    }

    /// Rank 0's report: the metrics file, the progress bar, the log line (with MFU given
    /// `--peak-flops`).
    fn reporter(&self) -> StepReporter<'_> {
        let config = self.config;
        let model = &self.data.model;
        let mfu = config.peak_flops.map(|peak_flops| MfuSpec {
            flops_per_token: model.flops_per_token(model.block_size()),
            peak_flops,
            world_size: config.parallel.world_size(),
        });
        let (first, steps) = (self.first_step, config.steps);
        StepReporter::new(
            self.metrics,
            first,
            steps,
            config.log_every,
            config.progress,
        )
        .with_mfu(mfu)
        .quiet(config.probe)
    }

    /// `--sample-tokens` generation's prompt (`--prompt`, a newline by default, in the run's
    /// tokens) and sampler (`--temperature`, `--sample-top-k`, `--top-p`, seeded by
    /// `--sample-seed` or `--seed`; checked with the configuration), which stops at the
    /// end-of-text tokens an `--init-from` directory names (as `transformers` does).
    pub(super) fn sampling(&self) -> Result<(Vec<u32>, TokenSampler), PretrainError> {
        let config = self.config;
        let prompt = self
            .data
            .tokenizer
            .encode(config.prompt.as_deref().unwrap_or("\n"));
        let seed = config.sample_seed.unwrap_or(config.seed);
        // A Hugging Face directory says which tokens end a text; otherwise the tokenizer's own
        // end-of-text (GPT-2's `<|endoftext|>`), if it has one.
        let stop = match &config.init_from {
            Some(dir) => wildfire_models::hf::eos_tokens(dir)?,
            None => self.data.tokenizer.end_of_text().into_iter().collect(),
        };
        let sampler = TokenSampler::new(config.temperature, config.sample_top_k, seed)
            .with_top_p(config.top_p)
            .with_stop_tokens(stop);
        Ok((prompt, sampler))
    }
}

/// What one step is given: the device, the learning rate, the micro-batches' seeds and the
/// micro-batches themselves (`batch(i)`: tokens and targets).
pub(super) struct StepAt<'a, B: FusedOps> {
    pub device: &'a DistDevice<B>,
    pub lr: f64,
    pub seeds: &'a [u64],
    pub batch: &'a dyn Fn(usize) -> [Tensor<A<B>, 2, Int>; 2],
}

/// What a rank trains: the whole model ([`Whole`]) or its stages of a pipeline.
pub(super) trait Trainee<B: FusedOps> {
    /// One step over the micro-batches; its record, the loss the mesh's.
    fn step(
        &mut self,
        runner: &mut StepRunner,
        at: &StepAt<B>,
    ) -> Result<StepRecord, PretrainError>;

    /// Load `weights`' parameters (with `optimizer`, the optimizer state too), each piece by
    /// the whole model's names.
    fn load(&mut self, weights: &Checkpoint, optimizer: bool) -> Result<(), PretrainError>;

    /// The bytes of this rank's parameter pieces.
    fn param_bytes(&self) -> u64;

    /// The mean validation loss over `eval_iters` batches, the mesh's.
    fn evaluate(&self, run: &RankRun, device: &DistDevice<B>) -> Result<f32, PretrainError>;

    /// This rank's pieces of the parameters and the optimizer state, held for a save.
    fn snapshot(&self) -> Result<Snapshot, PretrainError>;

    /// Every parameter of the whole model, in visiting order, on rank 0.
    fn parameters(&self, device: &DistDevice<B>) -> Result<Vec<Vec<f32>>, PretrainError>;

    /// `--sample-tokens` tokens generated after a newline.
    fn sample(&self, run: &RankRun, device: &DistDevice<B>) -> Result<Vec<u32>, PretrainError>;
}

/// The whole model and its optimizer (`tail`: the fused optimizer tail's device inputs).
pub(super) struct Whole<B: FusedOps, M, O, X> {
    model: Option<M>,
    optim: O,
    tail: Option<wildfire_engine::TailInputs<B>>,
    /// `--offload params`: the parameters' pieces live in host memory between uses (loaded
    /// weights are moved there too).
    offload_params: bool,
    codec: std::marker::PhantomData<X>,
}

impl<B: FusedOps, M, O, X> Whole<B, M, O, X> {
    fn new(model: M, optim: O, tail: Option<wildfire_engine::TailInputs<B>>) -> Self {
        Self {
            model: Some(model),
            optim,
            tail,
            offload_params: false,
            codec: std::marker::PhantomData,
        }
    }

    /// The same trainee with its parameters offloaded to host memory (`--offload params`).
    fn offloading_params(mut self) -> Self
    where
        M: burn::module::Module<A<B>>,
    {
        self.offload_params = true;
        self.model = self.model.take().map(wildfire_parallel::offload_parameters);
        self
    }

    fn model(&self) -> &M {
        self.model.as_ref().expect("a model between steps")
    }
}

impl<B, M, O, X> Trainee<B> for Whole<B, M, O, X>
where
    B: FusedOps,
    M: DistributedLm<B>,
    O: Optimizer<M, A<B>, Record = ParamRecords<AdaptorRecord<X, A<B>>>>,
    X: StateCodec<Distributed<B>>,
{
    fn step(
        &mut self,
        runner: &mut StepRunner,
        at: &StepAt<B>,
    ) -> Result<StepRecord, PretrainError> {
        let model = self.model.take().expect("a model between steps");
        let (next, record) = runner.run(
            at.device,
            model,
            &mut self.optim,
            self.tail.as_ref(),
            at.lr,
            at.seeds,
            |model: &M, i, ckpt| {
                let [x, y] = (at.batch)(i);
                model.loss_with(x, y, ckpt)
            },
        )?;
        self.model = Some(next);
        Ok(StepRecord {
            loss: mean_over_ranks(at.device, record.loss)?,
            ..record
        })
    }

    fn load(&mut self, weights: &Checkpoint, optimizer: bool) -> Result<(), PretrainError> {
        let mut model = weights.load_model(self.model.take().expect("a model between steps"))?;
        if optimizer {
            let record = weights.load_optimizer::<A<B>, _, X>(&model)?;
            self.optim = self.optim.clone().load_record(record);
        }
        if self.offload_params {
            model = wildfire_parallel::offload_parameters(model);
        }
        self.model = Some(model);
        Ok(())
    }

    fn param_bytes(&self) -> u64 {
        parameter_bytes(self.model())
    }

    fn evaluate(&self, run: &RankRun, device: &DistDevice<B>) -> Result<f32, PretrainError> {
        let model = self.model().valid();
        let mut total = 0.0;
        for i in 0..run.config.eval_iters {
            let [x, y] = run.val_batch(i, device)?;
            total += model.loss(x, y).into_scalar().elem::<f32>();
        }
        let mean = total / run.config.eval_iters as f32;
        Ok(mean_over_ranks(device, mean)?)
    }

    fn snapshot(&self) -> Result<Snapshot, PretrainError> {
        Ok(Snapshot::take(self.model(), Some(self.optim.to_record()))?)
    }

    fn parameters(&self, _: &DistDevice<B>) -> Result<Vec<Vec<f32>>, PretrainError> {
        Ok(crate::demo::parameters(self.model()))
    }

    fn sample(&self, run: &RankRun, device: &DistDevice<B>) -> Result<Vec<u32>, PretrainError> {
        let (prompt, sampler) = run.sampling()?;
        let block_size = run.data.model.block_size();
        let model = self.model().valid();
        // Every rank generates the whole sequence (prompts of any length): the context split
        // is off meanwhile.
        Ok(without_context_parallel(device, || {
            model.sample(
                &prompt,
                run.config.sample_tokens,
                block_size,
                sampler,
                device,
            )
        }))
    }
}

#[cfg(test)]
mod tests {
    use wildfire_parallel::busy_workers_for;
    use wildfire_parallel::{DeviceMesh, LaunchOptions, launch};

    /// On a rank's pool of two or more workers, the loop keeps the other workers looking for
    /// work on Flex and not on a device backend (whose ops never use the pool).
    #[test]
    fn pool_workers_stay_busy_only_for_a_backend_that_computes_on_them() {
        let mesh = DeviceMesh::new([("dp", 1)]).unwrap();
        let pool = wildfire_parallel::launch::rank_threads(1);
        let [(flex, device)] = launch(&mesh, &LaunchOptions::default(), |_| {
            let flex = busy_workers_for::<burn::backend::Flex>().is_some();
            #[cfg(feature = "wgpu")]
            let device = busy_workers_for::<burn::backend::Wgpu>().is_some();
            #[cfg(not(feature = "wgpu"))]
            let device = false;
            (flex, device)
        })
        .unwrap()[..] else {
            panic!("one rank")
        };
        // Off only where the pool has one worker (or `WILDFIRE_BUSY_WORKERS=0`).
        let off = std::env::var("WILDFIRE_BUSY_WORKERS").is_ok_and(|v| v == "0");
        assert_eq!(flex, pool > 1 && !off, "Flex on a pool of {pool}");
        assert!(!device, "a device backend keeps no pool worker spinning");
    }
}
