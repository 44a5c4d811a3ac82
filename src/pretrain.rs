//! GPT pretraining, the library behind `examples/gpt_pretrain`: data, model, the training loop on
//! every rank, evaluation, metrics, checkpoints and resume. One function, [`run`], that the binary
//! and the tests call alike.

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, Optimizer};
use burn::prelude::*;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use serde::{Deserialize, Serialize};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;
use wildfire_engine::{DynamicLossScaler, LossScalerConfig, TrainStep, TrainStepConfig};
use wildfire_kernels::FusedOps;
use wildfire_models::data::{
    BatchSampler, DataError, DataSource, TokenDataset, TokenSlice, Tokenizer, TokenizerKind,
};
use wildfire_models::gpt::{Gpt, GptConfig, ModelError, Preset};
use wildfire_models::parallelize::{ParallelConfig, ParallelizeError, Recompute, parallelize_gpt};
use wildfire_parallel::{
    DeviceMesh, DistDevice, DistError, Distributed, FsdpOptimizer, Group, LaunchError,
    LaunchOptions, ReduceOp, create_replicated, launch_ranks_on, parameter_bytes,
};

/// Numeric precision of the compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Precision {
    /// f32 everywhere.
    F32,
    /// bf16 compute, f32 master weights.
    Bf16,
    /// f16 compute with dynamic loss scaling, f32 master weights.
    F16,
}

impl Precision {
    /// The reduced dtype (`None` for f32).
    pub fn reduced_dtype(self) -> Option<burn::tensor::FloatDType> {
        match self {
            Precision::F32 => None,
            Precision::Bf16 => Some(burn::tensor::FloatDType::BF16),
            Precision::F16 => Some(burn::tensor::FloatDType::F16),
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "f32" => Precision::F32,
            "bf16" => Precision::Bf16,
            "f16" => Precision::F16,
            other => {
                return Err(format!(
                    "unknown --precision '{other}': choose f32, bf16 or f16"
                ));
            }
        })
    }
}

/// Everything a pretraining run needs (the binary's flags; stored in every checkpoint).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PretrainConfig {
    /// Model preset.
    pub preset: Preset,
    /// Overrides of the preset's shape.
    pub n_layer: Option<usize>,
    /// Heads override.
    pub n_head: Option<usize>,
    /// Width override.
    pub n_embd: Option<usize>,
    /// Context length override.
    pub block_size: Option<usize>,
    /// Dropout probability while training (0 for pretraining).
    #[serde(default)]
    pub dropout: f64,
    /// Data: the embedded corpus or a file.
    pub data: Option<PathBuf>,
    /// Tokenizer for text data.
    pub tokenizer: TokenizerKind,
    /// Fraction of the tokens held out for validation.
    pub val_fraction: f64,
    /// Total steps (a resumed run continues up to this step).
    pub steps: usize,
    /// Global batch: sequences per step over all data-parallel ranks.
    pub batch_size: usize,
    /// Gradient accumulation micro-batches per step.
    pub accum: usize,
    /// Peak learning rate (AdamW).
    pub lr: f64,
    /// Linear warmup steps, then cosine decay to `lr / 10` at step `decay_steps`.
    pub warmup: usize,
    /// Where the cosine decay ends (default: `steps`); set it to keep a schedule fixed when a run
    /// is stopped early and resumed with more steps.
    pub decay_steps: Option<usize>,
    /// AdamW weight decay.
    pub weight_decay: f64,
    /// Global gradient-norm clip (0: off).
    pub clip: f64,
    /// Seed of the data sampling.
    pub seed: u64,
    /// Parallelism.
    pub parallel: ParallelConfig,
    /// Compute precision.
    pub precision: Precision,
    /// The dtype data-parallel gradient reductions communicate in (f32: the master gradients').
    #[serde(default = "f32_precision")]
    pub grad_reduce: Precision,
    /// Per-rank budget on the bytes of live tensors (the decorator's accounting); a step that
    /// needs more fails with a typed error naming the rank.
    #[serde(default)]
    pub memory_budget: Option<u64>,
    /// Evaluate every this many steps (0: only at the end).
    pub eval_every: usize,
    /// Validation batches per evaluation.
    pub eval_iters: usize,
    /// Checkpoint directory.
    pub save: Option<PathBuf>,
    /// Checkpoint every this many steps (0: only at the end).
    pub save_every: usize,
    /// Resume from this checkpoint directory.
    pub resume: Option<PathBuf>,
    /// One JSON object per step (and per evaluation) to this file.
    pub metrics: Option<PathBuf>,
    /// A human log line every this many steps.
    pub log_every: usize,
    /// Peak FLOP/s of one rank's device, for the MFU column (none: no MFU in the log line).
    pub peak_flops: Option<f64>,
    /// Tokens of generated text at the end (0: none).
    pub sample_tokens: usize,
    /// Loss-curve PNG at the end.
    pub plot: Option<PathBuf>,
    /// Show a progress bar (rank 0, terminals only).
    pub progress: bool,
    /// Ranks as threads of this process, or this process as one rank of an MPI job.
    #[serde(default)]
    pub launch: Launch,
    /// What moves the training tensors between ranks: the host communicator (threads or MPI),
    /// or NCCL on the GPUs (CUDA; one GPU per rank, the rank's local index).
    #[serde(default)]
    pub collectives: Collectives,
}

/// What carries the collectives of the training tensors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Collectives {
    /// The host communicator: ranks as threads, or MPI between processes.
    #[default]
    Host,
    /// NCCL on the ranks' CUDA devices, bootstrapped over the host communicator (feature
    /// `cuda`, `--backend cuda`): rank `r` of a process uses GPU `r` (its local rank under MPI).
    Nccl,
}

/// Called on every rank's device before training (e.g. to install NCCL collectives).
pub type RankSetup<'a, B> = dyn Fn(&DistDevice<B>) -> Result<(), String> + Sync + 'a;

/// One rank's training, as handed to a [`ProcessLaunch`].
pub type RankBody<'a, B> = dyn FnMut(DistDevice<B>) -> Result<RunSummary, PretrainError> + 'a;

/// Runs this process's rank of `mesh` (its device made by the launcher) through the body
/// ([`Launch::Rendezvous`]).
pub type ProcessLaunch<'a, B> = dyn Fn(&DeviceMesh, &mut RankBody<'_, B>) -> Result<Result<RunSummary, PretrainError>, String>
    + 'a;

/// What a backend-specific caller adds to [`run_on_with`].
pub struct RankHooks<'a, B: Backend> {
    /// Run on every rank's device before training.
    pub setup: Option<&'a RankSetup<'a, B>>,
    /// Starts this process's rank for [`Launch::Rendezvous`].
    pub launch: Option<&'a ProcessLaunch<'a, B>>,
}

impl<B: Backend> Default for RankHooks<'_, B> {
    fn default() -> Self {
        Self {
            setup: None,
            launch: None,
        }
    }
}

/// How the ranks run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Launch {
    /// One thread per rank in this process.
    #[default]
    Threads,
    /// This process is one rank of the job `mpirun` / `srun` started (feature `mpi`); the mesh
    /// must have as many ranks as the job has processes.
    Mpi,
    /// This process is one rank of a torchrun-style launch (`MASTER_ADDR`, `MASTER_PORT`,
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`), with no MPI: NCCL on CUDA carries everything
    /// (feature `cuda`, `--collectives nccl`; the caller passes [`RankHooks::launch`]).
    Rendezvous,
}

impl Default for PretrainConfig {
    fn default() -> Self {
        Self {
            preset: Preset::Tiny,
            n_layer: None,
            n_head: None,
            n_embd: None,
            block_size: None,
            dropout: 0.0,
            data: None,
            tokenizer: TokenizerKind::Bytes,
            val_fraction: 0.1,
            steps: 200,
            batch_size: 8,
            accum: 1,
            lr: 1e-3,
            warmup: 20,
            decay_steps: None,
            weight_decay: 0.1,
            clip: 1.0,
            seed: 1337,
            parallel: ParallelConfig::default(),
            precision: Precision::F32,
            grad_reduce: Precision::F32,
            memory_budget: None,
            eval_every: 50,
            eval_iters: 4,
            save: None,
            save_every: 0,
            resume: None,
            metrics: None,
            log_every: 10,
            peak_flops: None,
            sample_tokens: 200,
            plot: None,
            progress: true,
            launch: Launch::Threads,
            collectives: Collectives::Host,
        }
    }
}

/// A run that cannot start or cannot go on; each message says what to do.
#[derive(thiserror::Error, Debug)]
pub enum PretrainError {
    /// Data problem.
    #[error(transparent)]
    Data(#[from] DataError),
    /// Model shape problem.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Parallelisation problem.
    #[error(transparent)]
    Parallelize(#[from] ParallelizeError),
    /// Distributed problem.
    #[error(transparent)]
    Dist(#[from] DistError),
    /// A rank failed.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// An option that is not implemented yet.
    #[error("{what} is not available yet (it lands with the {issue} issue); run without it")]
    NotAvailable {
        /// The option.
        what: String,
        /// The issue that brings it.
        issue: &'static str,
    },
    /// A bad option value.
    #[error("{0}")]
    Config(String),
    /// A checkpoint that cannot be used.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// Where.
        path: PathBuf,
        /// What is wrong, and what to do.
        reason: String,
    },
    /// File output failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> PretrainError + '_ {
    move |source| PretrainError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn f32_precision() -> Precision {
    Precision::F32
}

impl PretrainConfig {
    /// The model shape for a vocabulary of `vocab` tokens (GPT-2's padded to 50304, as nanoGPT).
    pub fn model(&self, vocab: usize) -> Result<GptConfig, ModelError> {
        let vocab = if vocab > 256 {
            vocab.div_ceil(64) * 64
        } else {
            vocab
        };
        let mut c = self.preset.config(vocab);
        c.n_layer = self.n_layer.unwrap_or(c.n_layer);
        c.n_head = self.n_head.unwrap_or(c.n_head);
        c.n_embd = self.n_embd.unwrap_or(c.n_embd);
        c.block_size = self.block_size.unwrap_or(c.block_size);
        c.dropout = self.dropout;
        c.validate()?;
        Ok(c)
    }

    /// Refuse options that are not implemented yet, and impossible values.
    pub fn check(&self) -> Result<(), PretrainError> {
        self.parallel.check_available()?;
        if self.accum == 0
            || !self
                .batch_size
                .is_multiple_of(self.parallel.dp * self.accum)
        {
            return Err(PretrainError::Config(format!(
                "--batch-size {} does not split into --dp {} × --accum {} micro-batches: choose a multiple of {}",
                self.batch_size,
                self.parallel.dp,
                self.accum,
                self.parallel.dp * self.accum
            )));
        }
        if self.steps == 0 || self.batch_size == 0 {
            return Err(PretrainError::Config(
                "--steps and --batch-size must be at least 1".into(),
            ));
        }
        if !self.batch_size.is_multiple_of(self.parallel.dp) {
            return Err(PretrainError::Config(format!(
                "--batch-size {} does not split over --dp {}: choose a multiple of {}",
                self.batch_size, self.parallel.dp, self.parallel.dp
            )));
        }
        if !(0.0..1.0).contains(&self.val_fraction) {
            return Err(PretrainError::Config(
                "--val-fraction must be in [0, 1)".into(),
            ));
        }
        Ok(())
    }

    /// Learning rate at `step`: linear warmup, then cosine decay to a tenth (nanoGPT).
    pub fn lr_at(&self, step: usize) -> f64 {
        let min = self.lr / 10.0;
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self
            .decay_steps
            .unwrap_or(self.steps)
            .saturating_sub(self.warmup)
            .max(1) as f64;
        let progress = ((step - self.warmup) as f64 / span).min(1.0);
        min + 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()) * (self.lr - min)
    }
}

/// Per-rank memory estimate in bytes: f32 parameters, gradients and AdamW state after the ZeRO
/// formulas for the strategy (Rajbhandari et al. 2020), the blocks' weights split `tp` ways; and
/// activations after Korthikanti et al. 2022, s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes per layer at
/// 16-bit (doubled for f32), plus the f32 logits and their gradient.
#[derive(Clone, Debug, Serialize)]
pub struct MemoryEstimate {
    /// Parameters Ψ of the whole model.
    pub params: usize,
    /// Parameters a rank holds before data-parallel sharding (blocks split by tp).
    pub params_per_tp_rank: usize,
    /// Data-parallel ranks that shard (N of the formulas).
    pub shard_ranks: usize,
    /// Parameter bytes.
    pub param_bytes: usize,
    /// Gradient bytes.
    pub grad_bytes: usize,
    /// Optimizer-state bytes (AdamW's two moments).
    pub optim_bytes: usize,
    /// Activations kept for backward (this rank's share of the batch).
    pub activation_bytes: usize,
    /// The sum.
    pub total_bytes: usize,
}

/// The estimate for `config` on one rank.
pub fn estimate(config: &PretrainConfig, model: &GptConfig) -> MemoryEstimate {
    use wildfire_models::parallelize::FsdpStrategy as S;
    let psi = model.num_params();
    let (s, h, a, l, t) = (
        model.block_size,
        model.n_embd,
        model.n_head,
        model.n_layer,
        config.parallel.tp.max(1),
    );
    let blocks = l * (12 * h * h + 13 * h);
    let local = psi - blocks + blocks / t;
    let n = match config.parallel.fsdp {
        S::Hybrid => config.parallel.dp_shard.unwrap_or(config.parallel.dp),
        _ => config.parallel.dp,
    }
    .max(1);
    let (p, g, o) = match config.parallel.fsdp {
        S::NoShard => (4 * local, 4 * local, 8 * local),
        S::ShardOptimizer => (4 * local, 4 * local, 8 * local / n),
        S::ShardGradOp => (4 * local, 4 * local / n, 8 * local / n),
        S::FullShard | S::Hybrid => (4 * local / n, 4 * local / n, 8 * local / n),
    };
    let b = config.batch_size / config.parallel.dp.max(1);
    // Korthikanti et al. (2022), bytes per layer at 16 bits with tensor parallelism t: all kept
    // sbh(10 + 24/t) + 5as²b/t, with sequence parallelism sbh·34/t + 5as²b/t; selective
    // recomputation drops the 5as²b/t attention core; full keeps the block input 2sbh (2sbh/t
    // with sequence parallelism), and one block's activations while it is recomputed.
    let sp = config.parallel.sp && t > 1;
    let kept_linear = if sp {
        // Keeping the sequence gathers: the two column-parallel inputs also whole (2·2sbh).
        s * b * h * 34 / t + usize::from(config.parallel.sp_keep_gathers) * 4 * s * b * h
    } else {
        s * b * h * (10 + 24 / t)
    };
    let keep_all = kept_linear + 5 * a * s * s * b / t;
    let keep_selective = kept_linear;
    let keep_input = if sp { 2 * s * b * h / t } else { 2 * s * b * h };
    let per_layer_16: usize = (0..l)
        .map(|i| match config.parallel.recompute {
            Recompute::None => keep_all,
            Recompute::Selective => keep_selective,
            r if r.recomputes_block(i, l) => keep_input,
            _ => keep_all,
        })
        .sum();
    let transient = match config.parallel.recompute {
        Recompute::Full | Recompute::EveryNth(_) => keep_all,
        _ => 0,
    };
    let logits = s * b * model.vocab_size * 4 * 2;
    let activation_bytes = (per_layer_16 + transient) * 2 + logits;
    MemoryEstimate {
        params: psi,
        params_per_tp_rank: local,
        shard_ranks: n,
        param_bytes: p,
        grad_bytes: g,
        optim_bytes: o,
        activation_bytes,
        total_bytes: p + g + o + activation_bytes,
    }
}

/// One step's record (rank 0's view; `loss` is the mean over the data-parallel ranks).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct StepMetrics {
    /// Step number (0-based).
    pub step: usize,
    /// Training loss.
    pub loss: f32,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// Loss scale (1 without loss scaling).
    pub loss_scale: f32,
    /// Whether the optimizer step was skipped.
    pub skipped: bool,
    /// Training tokens per second over all ranks.
    pub tokens_per_s: f64,
    /// Parameter bytes on this rank.
    pub param_bytes: u64,
    /// Gradient bytes on this rank.
    pub grad_bytes: u64,
    /// Optimizer-state bytes on this rank.
    pub optim_bytes: u64,
    /// Peak bytes of this rank's live distributed tensors during the step (the decorator's
    /// accounting; clones count once, views made by ops again: an upper bound).
    pub peak_bytes: u64,
    /// Of those, the peak of parameters gathered over data axes for use (FSDP).
    #[serde(default)]
    pub gathered_peak_bytes: u64,
    /// Peak resident memory of the whole process so far (VmHWM; all thread-ranks share it).
    pub process_peak_rss: u64,
    /// Bytes this rank passed to collectives during the step.
    pub comm_bytes: u64,
    /// Validation loss, on evaluation steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f32>,
}

/// What a run produced.
#[derive(Clone, Debug, Default)]
pub struct RunSummary {
    /// Metrics of each step run (from the first step after a resume).
    pub steps: Vec<StepMetrics>,
    /// Generated text, if asked for.
    pub sample: String,
    /// Every parameter at the end, in visiting order (rank 0).
    pub parameters: Vec<Vec<f32>>,
    /// The model shape.
    pub model: Option<GptConfig>,
    /// The rank this summary comes from (0, except on the other processes of an MPI job).
    pub rank: usize,
}

/// The state stored next to the weights in a checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct CheckpointState {
    /// Steps completed.
    step: usize,
    /// The run's configuration.
    config: PretrainConfig,
    /// The model shape.
    model: GptConfig,
    /// The loss scaler (f16 runs).
    #[serde(default)]
    scaler: Option<DynamicLossScaler>,
}

/// Run pretraining with `config` on the Flex CPU backend (ranks as threads).
pub fn run(config: &PretrainConfig) -> Result<RunSummary, PretrainError> {
    run_on::<burn::backend::Flex>(config, &Default::default())
}

/// Run pretraining on the inner backend `B` (all ranks share `device`).
pub fn run_on<B: FusedOps>(
    config: &PretrainConfig,
    device: &B::Device,
) -> Result<RunSummary, PretrainError> {
    run_on_with::<B>(config, device, &RankHooks::default())
}

/// [`run_on`] with backend-specific hooks: `setup` runs on every rank's device first, `launch`
/// starts the rank of a [`Launch::Rendezvous`] process. With [`Collectives::Nccl`] the setup
/// installs NCCL, and rank `r` of a process runs on the device `r` places after `device` (its
/// local rank: one GPU per rank).
pub fn run_on_with<B: FusedOps>(
    config: &PretrainConfig,
    device: &B::Device,
    hooks: &RankHooks<'_, B>,
) -> Result<RunSummary, PretrainError> {
    config.check()?;
    let setup = hooks.setup;
    if config.collectives == Collectives::Nccl && setup.is_none() && hooks.launch.is_none() {
        return Err(PretrainError::Config(
            "--collectives nccl runs on CUDA: build with --features cuda and pass --backend cuda"
                .into(),
        ));
    }
    let per_rank_device = |local: usize| -> B::Device {
        if config.collectives == Collectives::Nccl {
            use burn::tensor::backend::Device as _;
            let id = device.to_id();
            B::Device::from_id(burn::tensor::backend::DeviceId::new(
                id.type_id,
                id.index_id + local as u16,
            ))
        } else {
            device.clone()
        }
    };
    let wanted = config
        .precision
        .reduced_dtype()
        .map(burn::tensor::DType::from);
    if let Some(dtype) = wanted
        && !B::supports_dtype(device, dtype)
    {
        return Err(PretrainError::Config(format!(
            "--precision {:?}: the {} backend cannot compute in {dtype:?}; use --precision f32",
            config.precision,
            B::name(device)
        )));
    }
    let tokenizer = Tokenizer::new(config.tokenizer)?;
    let source = match &config.data {
        Some(path) => DataSource::File(path.clone()),
        None => DataSource::Embedded,
    };
    let dataset = TokenDataset::load(&source, &tokenizer)?;
    let model_config =
        config.model(tokenizer.vocab_size().max(dataset.max_token() as usize + 1))?;
    dataset.check_vocab(model_config.vocab_size)?;
    let (train, val) = dataset.split(config.val_fraction);
    let sampler = BatchSampler {
        seed: config.seed,
        block_size: model_config.block_size,
        global_batch: config.batch_size,
    };
    sampler.check(train)?;
    let val_sampler = BatchSampler {
        seed: config.seed ^ 0x0056_414C,
        ..sampler.clone()
    };
    if config.eval_iters > 0 && config.val_fraction > 0.0 {
        val_sampler.check(val)?;
    }
    let start = match &config.resume {
        Some(dir) => Some(read_state(dir, &model_config)?),
        None => None,
    };
    let first_step = start.as_ref().map_or(0, |(s, _)| s.step);
    tracing::info!(
        model = ?model_config, params = model_config.num_params(), tokens = dataset.len(), data = %source,
        "pretraining {} steps from step {first_step}", config.steps
    );
    let mesh = config.parallel.mesh()?;
    let dp = config.parallel.dp;
    let open_metrics = || -> Result<_, PretrainError> {
        match &config.metrics {
            // A resumed run appends (as llm.c does), so one file holds the whole run.
            Some(path) => Ok(Some(std::sync::Mutex::new(
                fs::OpenOptions::new()
                    .create(true)
                    .write(true)
                    .append(config.resume.is_some())
                    .truncate(config.resume.is_none())
                    .open(path)
                    .map_err(io_err(path))?,
            ))),
            None => Ok(None),
        }
    };
    // Ranks as threads share one file (rank 0 writes it); under MPI only rank 0 opens it.
    let metrics_file = match config.launch {
        Launch::Threads => open_metrics()?,
        Launch::Mpi | Launch::Rendezvous => None,
    };
    let rank_body = |device: DistDevice<B>| -> Result<RunSummary, PretrainError> {
        let rank = device.rank();
        if let Some(setup) = setup {
            setup(&device).map_err(PretrainError::Config)?;
        }
        let own_metrics = match config.launch {
            Launch::Mpi | Launch::Rendezvous if rank == 0 => open_metrics()?,
            _ => None,
        };
        // The data-parallel index: row-major over the data axes (tensor-parallel peers share rows).
        let mesh = device.mesh();
        let coords = mesh.coords(rank);
        let dp_index = mesh
            .axes()
            .iter()
            .enumerate()
            .filter(|(_, axis)| axis.kind == wildfire_parallel::AxisKind::Data)
            .fold(0, |index, (a, axis)| index * axis.size + coords[a]);
        let rows = sampler.rows_for(dp_index, dp).expect("checked above");
        let ctx = RankRun {
            config,
            model_config: &model_config,
            sampler: &sampler,
            val_sampler: &val_sampler,
            train,
            val,
            rows,
            metrics: own_metrics.as_ref().or(metrics_file.as_ref()),
            tokenizer: &tokenizer,
        };
        ctx.train::<B>(
            &device,
            start.as_ref().map(|(_, dir)| dir.as_path()),
            start.as_ref().and_then(|(state, _)| state.scaler.clone()),
            first_step,
        )
    };
    let (rank, summary) = match config.launch {
        Launch::Threads => {
            let results = launch_ranks_on::<B, _, _, _>(
                &mesh,
                per_rank_device,
                &LaunchOptions::default(),
                rank_body,
            )?;
            (0, results.into_iter().next().expect("rank 0"))
        }
        #[cfg(feature = "mpi")]
        Launch::Mpi => {
            let mut rank = 0;
            let summary = wildfire_parallel::launch_ranks_mpi::<B, _, _, _>(
                &mesh,
                per_rank_device,
                &LaunchOptions::default(),
                |d| {
                    rank = d.rank();
                    rank_body(d)
                },
            )
            .map_err(|e| PretrainError::Config(e.to_string()))?;
            (rank, summary)
        }
        #[cfg(not(feature = "mpi"))]
        Launch::Mpi => {
            return Err(PretrainError::Config(
                "this binary was built without MPI: cargo build --features mpi --example gpt_pretrain, then mpirun -np N …".into(),
            ));
        }
        Launch::Rendezvous => {
            let Some(launch) = hooks.launch else {
                return Err(PretrainError::Config(
                    "a torchrun-style launch (WORLD_SIZE, MASTER_ADDR) needs --backend cuda --collectives nccl (feature cuda), or run under mpirun (feature mpi)".into(),
                ));
            };
            let mut rank = 0;
            let mut body = |d: DistDevice<B>| {
                rank = d.rank();
                rank_body(d)
            };
            let summary = launch(&mesh, &mut body).map_err(PretrainError::Config)?;
            (rank, summary)
        }
    };
    let mut summary = summary?;
    summary.model = Some(model_config);
    summary.rank = rank;
    if rank == 0
        && let Some(path) = &config.plot
    {
        plot_losses(path, &summary.steps)?;
    }
    Ok(summary)
}

fn read_state(dir: &Path, model: &GptConfig) -> Result<(CheckpointState, PathBuf), PretrainError> {
    let latest = dir.join("latest");
    let name = fs::read_to_string(&latest).map_err(|e| PretrainError::Checkpoint {
        path: dir.to_path_buf(),
        reason: format!("no checkpoint here ({e}); pass the directory given to --save"),
    })?;
    let step_dir = dir.join(name.trim());
    let state: CheckpointState = serde_json::from_str(
        &fs::read_to_string(step_dir.join("state.json")).map_err(io_err(&step_dir))?,
    )
    .map_err(|e| PretrainError::Checkpoint {
        path: step_dir.clone(),
        reason: format!("state.json is corrupt: {e}"),
    })?;
    if &state.model != model {
        return Err(PretrainError::Checkpoint {
            path: step_dir,
            reason: format!(
                "it holds a model of shape {:?}, this run builds {:?}; resume with the same model flags",
                state.model, model
            ),
        });
    }
    Ok((state, step_dir))
}

/// Write `bytes` to `path` atomically (temp file + rename).
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), PretrainError> {
    let tmp = path.with_extension("tmp");
    let mut f = fs::File::create(&tmp).map_err(io_err(&tmp))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(io_err(&tmp))?;
    fs::rename(&tmp, path).map_err(io_err(path))
}

struct RankRun<'a> {
    config: &'a PretrainConfig,
    model_config: &'a GptConfig,
    sampler: &'a BatchSampler,
    val_sampler: &'a BatchSampler,
    train: TokenSlice<'a>,
    val: TokenSlice<'a>,
    rows: std::ops::Range<usize>,
    metrics: Option<&'a std::sync::Mutex<fs::File>>,
    tokenizer: &'a Tokenizer,
}

type Recs = BinBytesRecorder<FullPrecisionSettings>;

/// The optimizer state per parameter (Burn's optimizer records are maps keyed by parameter).
type OptimRecord<R> = hashbrown::HashMap<burn::module::ParamId, R>;

const OPTIM_MAGIC: &[u8; 8] = b"WFOPTv1\n";

/// Encode the optimizer state one parameter at a time, in parameter-id order. Gathering a
/// sharded moment is a collective: every rank must walk the entries in the same order, which a
/// `HashMap`'s iteration order (seeded per process) does not give.
fn encode_optimizer<B: Backend, R: burn::record::Record<B>>(
    record: OptimRecord<R>,
) -> Result<Vec<u8>, burn::record::RecorderError> {
    let mut entries: Vec<_> = record.into_iter().collect();
    entries.sort_by_key(|(id, _)| id.to_string());
    let mut out = OPTIM_MAGIC.to_vec();
    out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    for (id, r) in entries {
        let one: OptimRecord<R> = [(id, r)].into_iter().collect();
        let bytes = Recs::new().record(one, ())?;
        out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(&bytes);
    }
    Ok(out)
}

/// The inverse of [`encode_optimizer`].
fn decode_optimizer<B: Backend, R: burn::record::Record<B>>(
    bytes: &[u8],
    device: &B::Device,
) -> Result<OptimRecord<R>, String> {
    let body = bytes
        .strip_prefix(&OPTIM_MAGIC[..])
        .ok_or("not a wildfire optimizer state (bad magic)")?;
    let word = |at: usize| -> Result<usize, String> {
        body.get(at..at + 8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")) as usize)
            .ok_or_else(|| "truncated".to_string())
    };
    let count = word(0)?;
    let mut at = 8;
    let mut out = OptimRecord::new();
    for _ in 0..count {
        let len = word(at)?;
        let chunk = body.get(at + 8..at + 8 + len).ok_or("truncated")?;
        let one: OptimRecord<R> = Recs::new()
            .load(chunk.to_vec(), device)
            .map_err(|e| e.to_string())?;
        out.extend(one);
        at += 8 + len;
    }
    if at != body.len() {
        return Err("trailing bytes".into());
    }
    Ok(out)
}

fn batch_tensors<B: Backend>(
    sampler: &BatchSampler,
    data: TokenSlice<'_>,
    step: u64,
    rows: std::ops::Range<usize>,
    device: &B::Device,
) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let n = rows.len();
    let (x, y) = sampler.batch(data, step, rows).expect("sampler checked");
    let t = sampler.block_size;
    let to = |v: Vec<u32>| {
        Tensor::<B, 2, Int>::from_data(
            TensorData::new(v.into_iter().map(i64::from).collect::<Vec<_>>(), [n, t]),
            device,
        )
    };
    (to(x), to(y))
}

/// Mean of a per-rank scalar over the world.
fn mean_over_ranks<B: Backend>(device: &DistDevice<B>, value: f32) -> f32 {
    let comm = device.context().comm();
    if comm.mesh().world_size() == 1 {
        return value;
    }
    let data = comm
        .all_reduce(
            Group::World,
            TensorData::new(vec![value], [1]),
            ReduceOp::Avg,
        )
        .expect("all-reduce of a metric");
    data.to_vec::<f32>().expect("f32")[0]
}

fn peak_rss() -> u64 {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Model FLOPs utilisation: the run's model FLOP/s (`flops_per_token × tokens_per_s`, tokens of
/// the global batch) over the peak of every rank's device (`peak_flops × world_size`: data,
/// tensor and any other model axis alike).
pub fn mfu(flops_per_token: f64, tokens_per_s: f64, peak_flops: f64, world_size: usize) -> f64 {
    flops_per_token * tokens_per_s / (peak_flops * world_size.max(1) as f64)
}

type A<B> = Autodiff<Distributed<B>>;

impl RankRun<'_> {
    /// AdamW (β₂ 0.95, the configured weight decay): on backends with kernels the fused
    /// optimizer tail (one unscale + Σg² + overflow kernel per gradient, one AdamW kernel per
    /// parameter), elsewhere Burn's AdamW; both under `FsdpOptimizer`.
    fn train<B: FusedOps>(
        &self,
        device: &DistDevice<B>,
        resume: Option<&Path>,
        resume_scaler: Option<DynamicLossScaler>,
        first_step: usize,
    ) -> Result<RunSummary, PretrainError> {
        let weight_decay = self.config.weight_decay;
        if B::FUSED.optimizer {
            let (adamw, inputs) = wildfire_engine::FusedAdamW::<B>::optimizer::<Gpt<A<B>>>(
                wildfire_engine::FusedAdamWConfig {
                    beta1: 0.9,
                    beta2: 0.95,
                    // Burn's AdamW default.
                    epsilon: 1e-5,
                    weight_decay,
                },
            );
            let optim = FsdpOptimizer::new(adamw);
            self.train_with(
                device,
                optim,
                Some(inputs),
                resume,
                resume_scaler,
                first_step,
            )
        } else {
            let optim = FsdpOptimizer::new(
                AdamWConfig::new()
                    .with_beta_2(0.95)
                    .with_weight_decay(weight_decay as f32)
                    .init::<A<B>, Gpt<A<B>>>(),
            );
            self.train_with(device, optim, None, resume, resume_scaler, first_step)
        }
    }

    fn train_with<B, O, R>(
        &self,
        device: &DistDevice<B>,
        mut optim: O,
        tail: Option<wildfire_engine::TailInputs<B>>,
        resume: Option<&Path>,
        resume_scaler: Option<DynamicLossScaler>,
        first_step: usize,
    ) -> Result<RunSummary, PretrainError>
    where
        B: FusedOps,
        O: Optimizer<Gpt<A<B>>, A<B>, Record = OptimRecord<R>>,
        R: burn::record::Record<A<B>>,
    {
        let config = self.config;
        let rank = device.rank();
        // Precision policy: f32 master weights, matmuls in the compute dtype; f16 adds a
        // dynamic loss scale.
        device
            .context()
            .set_compute_dtype(config.precision.reduced_dtype());
        device.context().set_memory_budget(config.memory_budget);
        device
            .context()
            .set_gradient_reduce_dtype(config.grad_reduce.reduced_dtype());
        let scaler = (config.precision == Precision::F16).then(|| {
            resume_scaler.unwrap_or_else(|| DynamicLossScaler::new(LossScalerConfig::default()))
        });
        let mut train_step = TrainStep::new(
            TrainStepConfig {
                clip: (config.clip > 0.0).then_some(config.clip as f32),
                recompute: config.parallel.recompute,
            },
            scaler,
        );
        let mesh = device.mesh().clone();
        let mut model: Gpt<A<B>> = self.model_config.init(device)?;
        if let Some(dir) = resume {
            // Every rank loads the same files: the values are replicated by construction.
            let bad = |what: &str, reason: String| PretrainError::Checkpoint {
                path: dir.to_path_buf(),
                reason: format!("{what}: {reason}"),
            };
            model = create_replicated(|| {
                wildfire_models::safetensors::load(model, &dir.join("model.safetensors"))
            })
            .map_err(|e| bad("model weights", e.to_string()))?;
            let bytes = fs::read(dir.join("optimizer.bin"))
                .map_err(|e| bad("optimizer state", e.to_string()))?;
            let o = create_replicated(|| decode_optimizer::<A<B>, R>(&bytes, device))
                .map_err(|e| bad("optimizer state", e))?;
            optim = create_replicated(|| optim.load_record(o));
        }
        let mut model = parallelize_gpt(model, &mesh, &config.parallel)?;
        let ctx = device.context().clone();
        let tokens_per_step = (config.batch_size * self.model_config.block_size) as f64;
        let progress = (rank == 0 && config.progress).then(|| {
            let bar = indicatif::ProgressBar::new(config.steps as u64);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{bar:40} {pos}/{len} steps {msg} [{elapsed_precise}<{eta_precise}]",
                )
                .expect("template"),
            );
            bar.set_position(first_step as u64);
            bar
        });
        let mut summary = RunSummary::default();
        for step in first_step..config.steps {
            let started = Instant::now();
            let stats_before = device.context().comm_stats();
            ctx.reset_peak_bytes();
            let lr = config.lr_at(step);
            // `accum` micro-batches of this rank's rows. Recomputation and dropout streams are
            // seeded by (run seed, step, first global row), so tensor-parallel peers (same rows)
            // draw the same masks.
            let micro = self.rows.len() / config.accum;
            let starts: Vec<usize> = (0..config.accum)
                .map(|i| self.rows.start + i * micro)
                .collect();
            let seeds: Vec<u64> = starts
                .iter()
                .map(|&start| {
                    wildfire_engine::recompute::mix_seed(config.seed, step as u64, start as u64)
                })
                .collect();
            let batch = |i: usize| {
                batch_tensors::<A<B>>(
                    self.sampler,
                    self.train,
                    step as u64,
                    starts[i]..starts[i] + micro,
                    device,
                )
            };
            let (next, record) = match &tail {
                Some(inputs) => train_step.run_fused(
                    device,
                    model,
                    &mut optim,
                    inputs,
                    lr,
                    &seeds,
                    |model: &Gpt<A<B>>, i, ckpt| {
                        let (x, y) = batch(i);
                        model.loss_with(x, y, ckpt)
                    },
                )?,
                None => train_step.run(
                    device,
                    model,
                    &mut optim,
                    lr,
                    &seeds,
                    |model: &Gpt<A<B>>, i, ckpt| {
                        let (x, y) = batch(i);
                        model.loss_with(x, y, ckpt)
                    },
                )?,
            };
            model = next;
            let (local_loss, grad_norm, scale, skipped, grad_bytes) = (
                record.loss,
                record.grad_norm,
                record.loss_scale,
                record.skipped,
                record.grad_bytes,
            );
            // The decorator's accounting of this rank's local pieces. After the step only the
            // parameters and the optimizer state are alive (the loss and its graph are dropped,
            // the gradients consumed), so the optimizer state is the rest.
            let param_bytes = parameter_bytes(&model);
            let optim_bytes = ctx.live_bytes().saturating_sub(param_bytes);
            let loss = mean_over_ranks(device, local_loss);
            let elapsed = started.elapsed().as_secs_f64();
            let mut m = StepMetrics {
                step,
                loss,
                lr,
                grad_norm,
                loss_scale: scale,
                skipped,
                tokens_per_s: tokens_per_step / elapsed,
                param_bytes,
                grad_bytes,
                optim_bytes,
                peak_bytes: ctx.peak_bytes(),
                gathered_peak_bytes: ctx.peak_gathered_bytes(),
                process_peak_rss: peak_rss(),
                comm_bytes: device
                    .context()
                    .comm_stats()
                    .since(&stats_before)
                    .total_bytes(),
                val_loss: None,
            };
            let last = step + 1 == config.steps;
            if (config.eval_every > 0 && (step + 1) % config.eval_every == 0) || last {
                m.val_loss = self.evaluate(&model, device);
            }
            if rank == 0 {
                self.report(&m, progress.as_ref(), elapsed)?;
            }
            summary.steps.push(m);
            if config.save.is_some()
                && ((config.save_every > 0 && (step + 1) % config.save_every == 0) || last)
            {
                self.save(&model, &optim, train_step.scaler(), step + 1, rank)?;
            }
        }
        if let Some(bar) = &progress {
            bar.finish_and_clear();
        }
        // Gathering sharded parameters and sampling take collectives: every rank does them.
        summary.parameters = crate::demo::parameters(&model);
        if config.sample_tokens > 0 {
            let prompt = self.tokenizer.encode("\n");
            let tokens =
                model
                    .valid()
                    .generate(&prompt, config.sample_tokens, 0.8, 40, config.seed, device);
            summary.sample = self.tokenizer.decode(&tokens);
        }
        Ok(summary)
    }

    fn evaluate<B: FusedOps>(
        &self,
        model: &Gpt<Autodiff<Distributed<B>>>,
        device: &DistDevice<B>,
    ) -> Option<f32> {
        if self.config.eval_iters == 0 || self.val.len() <= self.model_config.block_size {
            return None;
        }
        let model = model.valid();
        let mut total = 0.0;
        for i in 0..self.config.eval_iters {
            let (x, y) = batch_tensors::<Distributed<B>>(
                self.val_sampler,
                self.val,
                i as u64,
                self.rows.clone(),
                device,
            );
            total += model.loss(x, y).into_scalar().elem::<f32>();
        }
        Some(mean_over_ranks(
            device,
            total / self.config.eval_iters as f32,
        ))
    }

    fn report(
        &self,
        m: &StepMetrics,
        bar: Option<&indicatif::ProgressBar>,
        elapsed: f64,
    ) -> Result<(), PretrainError> {
        if let Some(file) = self.metrics {
            let line = serde_json::to_string(m).expect("metrics serialise");
            let mut f = file.lock().unwrap();
            writeln!(f, "{line}").map_err(|source| PretrainError::Io {
                path: self.config.metrics.clone().unwrap_or_default(),
                source,
            })?;
        }
        let mfu = self.config.peak_flops.map_or(String::new(), |peak| {
            let flops = self
                .model_config
                .flops_per_token(self.model_config.block_size);
            let mfu = mfu(
                flops,
                m.tokens_per_s,
                peak,
                self.config.parallel.world_size(),
            );
            format!(" | mfu {:.2}%", 100.0 * mfu)
        });
        let line = format!(
            "step {} | loss {:.4} | lr {:.2e} | grad_norm {:.3} | tok/s {:.0}{mfu} | scale {}{}",
            m.step,
            m.loss,
            m.lr,
            m.grad_norm,
            m.tokens_per_s,
            m.loss_scale,
            m.val_loss
                .map(|v| format!(" | val_loss {v:.4}"))
                .unwrap_or_default()
        );
        if let Some(bar) = bar {
            bar.set_position(m.step as u64 + 1);
            bar.set_message(format!("loss {:.4} ({:.0} ms/step)", m.loss, elapsed * 1e3));
        }
        if m.step.is_multiple_of(self.config.log_every.max(1))
            || m.val_loss.is_some()
            || m.step + 1 == self.config.steps
        {
            match bar {
                Some(bar) => bar.suspend(|| tracing::info!("{line}")),
                None => tracing::info!("{line}"),
            }
        }
        Ok(())
    }

    /// Save weights (`model.safetensors`, named by module path), optimizer state (one Burn record
    /// per parameter, in parameter-id order, see [`encode_optimizer`]) and the run state (`state.json`: step, config,
    /// model shape; the sampler needs nothing else) to `save/step-N`, then point `latest` at it.
    /// The step directory is built under a temporary name and renamed; `latest` moves last.
    fn save<B, O, R>(
        &self,
        model: &Gpt<Autodiff<Distributed<B>>>,
        optim: &O,
        scaler: Option<&DynamicLossScaler>,
        step: usize,
        rank: usize,
    ) -> Result<(), PretrainError>
    where
        B: Backend,
        O: Optimizer<Gpt<A<B>>, A<B>, Record = OptimRecord<R>>,
        R: burn::record::Record<A<B>>,
    {
        // Sharded values are gathered for the files: every rank takes part, in the same order;
        // rank 0 writes.
        let weights = wildfire_models::safetensors::to_bytes(model);
        let optimizer = encode_optimizer::<A<B>, R>(optim.to_record()).map_err(|e| {
            PretrainError::Checkpoint {
                path: self.config.save.clone().unwrap_or_default(),
                reason: format!("optimizer state: {e}"),
            }
        })?;
        if rank != 0 {
            return Ok(());
        }
        let root = self.config.save.as_ref().expect("save dir");
        let name = format!("step-{step:08}");
        let tmp = root.join(format!(".{name}.tmp"));
        let dir = root.join(&name);
        fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
        write_atomic(&tmp.join("model.safetensors"), &weights)?;
        write_atomic(&tmp.join("optimizer.bin"), &optimizer)?;
        let state = CheckpointState {
            step,
            config: self.config.clone(),
            model: self.model_config.clone(),
            scaler: scaler.cloned(),
        };
        write_atomic(
            &tmp.join("state.json"),
            serde_json::to_string_pretty(&state)
                .expect("state")
                .as_bytes(),
        )?;
        if dir.exists() {
            fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
        }
        fs::rename(&tmp, &dir).map_err(io_err(&dir))?;
        write_atomic(&root.join("latest"), name.as_bytes())?;
        tracing::info!("saved checkpoint {}", dir.display());
        Ok(())
    }
}

/// A 3×5 bitmap of `c` (rows top to bottom, bit 2 = left column): digits, `.`, `-` and the
/// letters of the plot's labels; anything else is blank.
fn glyph(c: char) -> [u8; 5] {
    match c {
        '0' => [0b111, 0b101, 0b101, 0b101, 0b111],
        '1' => [0b010, 0b110, 0b010, 0b010, 0b111],
        '2' => [0b111, 0b001, 0b111, 0b100, 0b111],
        '3' => [0b111, 0b001, 0b111, 0b001, 0b111],
        '4' => [0b101, 0b101, 0b111, 0b001, 0b001],
        '5' => [0b111, 0b100, 0b111, 0b001, 0b111],
        '6' => [0b111, 0b100, 0b111, 0b101, 0b111],
        '7' => [0b111, 0b001, 0b010, 0b010, 0b010],
        '8' => [0b111, 0b101, 0b111, 0b101, 0b111],
        '9' => [0b111, 0b101, 0b111, 0b001, 0b111],
        '.' => [0b000, 0b000, 0b000, 0b000, 0b010],
        '-' => [0b000, 0b000, 0b111, 0b000, 0b000],
        'a' => [0b000, 0b011, 0b101, 0b101, 0b011],
        'e' => [0b000, 0b111, 0b111, 0b100, 0b111],
        'i' => [0b010, 0b000, 0b010, 0b010, 0b010],
        'l' => [0b100, 0b100, 0b100, 0b100, 0b011],
        'n' => [0b000, 0b110, 0b101, 0b101, 0b101],
        'o' => [0b000, 0b111, 0b101, 0b101, 0b111],
        'p' => [0b000, 0b111, 0b101, 0b111, 0b100],
        'r' => [0b000, 0b101, 0b110, 0b100, 0b100],
        's' => [0b000, 0b011, 0b110, 0b011, 0b110],
        't' => [0b010, 0b111, 0b010, 0b010, 0b011],
        'v' => [0b000, 0b101, 0b101, 0b101, 0b010],
        _ => [0; 5],
    }
}

/// Draw the training (and validation) loss curves into a PNG, with the loss and step ranges on
/// the axes and a legend.
fn plot_losses(path: &Path, steps: &[StepMetrics]) -> Result<(), PretrainError> {
    const W: usize = 640;
    const H: usize = 400;
    const M: usize = 40;
    let mut img = vec![255u8; W * H * 3];
    if steps.is_empty() {
        return Ok(());
    }
    let losses: Vec<f32> = steps
        .iter()
        .map(|s| s.loss)
        .chain(steps.iter().filter_map(|s| s.val_loss))
        .collect();
    let (lo, hi) = losses
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    let (lo, hi) = if hi > lo {
        (lo, hi)
    } else {
        (lo - 1.0, hi + 1.0)
    };
    let (s0, s1) = (
        steps[0].step as f32,
        steps[steps.len() - 1].step.max(steps[0].step + 1) as f32,
    );
    let xy = |step: usize, loss: f32| {
        let x = M as f32 + (step as f32 - s0) / (s1 - s0) * (W - 2 * M) as f32;
        let y = (H - M) as f32 - (loss - lo) / (hi - lo) * (H - 2 * M) as f32;
        (x, y)
    };
    let mut put = |x: f32, y: f32, rgb: [u8; 3]| {
        let (x, y) = (x.round() as isize, y.round() as isize);
        for (dx, dy) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
            let (px, py) = (x + dx, y + dy);
            if px >= 0 && py >= 0 && (px as usize) < W && (py as usize) < H {
                let i = (py as usize * W + px as usize) * 3;
                img[i..i + 3].copy_from_slice(&rgb);
            }
        }
    };
    for i in M..=W - M {
        put(i as f32, (H - M) as f32, [0, 0, 0]);
    }
    for j in M..=H - M {
        put(M as f32, j as f32, [0, 0, 0]);
    }
    let mut line = |points: &[(f32, f32)], rgb: [u8; 3]| {
        for w in points.windows(2) {
            let ((x0, y0), (x1, y1)) = (w[0], w[1]);
            let n = ((x1 - x0).abs().max((y1 - y0).abs()) as usize).max(1);
            for k in 0..=n {
                let t = k as f32 / n as f32;
                put(x0 + t * (x1 - x0), y0 + t * (y1 - y0), rgb);
            }
        }
    };
    let train: Vec<(f32, f32)> = steps.iter().map(|s| xy(s.step, s.loss)).collect();
    let val: Vec<(f32, f32)> = steps
        .iter()
        .filter_map(|s| s.val_loss.map(|v| xy(s.step, v)))
        .collect();
    line(&train, [31, 119, 180]);
    line(&val, [214, 39, 40]);
    // Labels: the loss range on the y axis, the step range on the x axis, the legend.
    let mut text = |x: usize, y: usize, s: &str, rgb: [u8; 3]| {
        for (k, c) in s.chars().enumerate() {
            let rows = glyph(c);
            for (r, bits) in rows.iter().enumerate() {
                for col in 0..3 {
                    if bits & (0b100 >> col) != 0 {
                        // 2× scale: each font pixel is a 2×2 block (`put` draws 2×2).
                        put((x + k * 8 + col * 2) as f32, (y + r * 2) as f32, rgb);
                    }
                }
            }
        }
    };
    let black = [0, 0, 0];
    text(2, M - 4, &format!("{hi:.2}"), black);
    text(2, H - M - 6, &format!("{lo:.2}"), black);
    text(2, H / 2 - 5, "loss", black);
    text(M, H - M + 8, &format!("{}", steps[0].step), black);
    let last = format!("{}", steps[steps.len() - 1].step);
    text(W - M - 8 * last.len(), H - M + 8, &last, black);
    text(W / 2 - 16, H - M + 8, "step", black);
    text(W - M - 48, 8, "train", [31, 119, 180]);
    if !val.is_empty() {
        text(W - M - 48, 22, "val", [214, 39, 40]);
    }
    let file = fs::File::create(path).map_err(io_err(path))?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), W as u32, H as u32);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(|e| PretrainError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e),
    })?;
    writer
        .write_image_data(&img)
        .map_err(|e| PretrainError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::other(e),
        })?;
    Ok(())
}
