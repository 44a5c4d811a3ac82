//! GPT pretraining, the library behind `examples/gpt_pretrain`, read top to bottom as nanoGPT's
//! `train.py`: the configuration ([`PretrainConfig`]), the data and the model, the parallel
//! layout, then the training loop on every rank with evaluation, metrics and checkpoints. One
//! function, [`run`], that the binary and the tests call alike.
//!
//! The pieces it puts together live with their concern: metrics and the log line in
//! `wildfire_engine::metrics` (the `--trace` file in `wildfire_engine::trace`), checkpoint files in `wildfire_checkpoint`, the memory
//! estimate in `wildfire_models::memory`, launcher detection in `wildfire_parallel::LaunchEnv`.

mod config;
#[cfg(feature = "cuda")]
mod cuda;
mod elastic;
mod error;
pub mod host_profile;

pub use crate::plot::plot_losses;
pub use config::{
    Collectives, FailAt, Launch, MuonSplit, Offload, OptimState, OptimizerKind, PlanMode,
    Precision, PretrainConfig,
};
#[cfg(feature = "cuda")]
pub use cuda::run_cuda;
pub use elastic::{lost_ranks, shrink};
pub use error::PretrainError;
pub(crate) use error::io_err;
pub use plan::{Candidate, MARGIN as PLAN_MARGIN, Plan, Predicted, plan_on};
pub use wildfire_engine::metrics::{Restart, StepMetrics, mfu};
pub use wildfire_models::memory::MemoryEstimate;

use burn::backend::Autodiff;
use burn::optim::{AdamWConfig, Optimizer};
use burn::prelude::*;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Instant;
use wildfire_checkpoint::dcp::{Checkpoint, CheckpointWriter, Snapshot, read_state_file};
use wildfire_checkpoint::{CheckpointDir, ParamRecords};
use wildfire_engine::metrics::{MetricsLog, mean_over_ranks, peak_rss};
use wildfire_engine::{DynamicLossScaler, LossScalerConfig, StepRunner, StepRunnerConfig};
use wildfire_kernels::FusedOps;
use wildfire_models::ModelConfig;
use wildfire_models::data::{BatchSampler, TokenDataset, TokenSlice, Tokenizer};
use wildfire_models::gpt::GptConfig;
use wildfire_models::memory::Offloaded;
use wildfire_models::parallelize::{init_gpt, parallelize_gpt};
use wildfire_parallel::{
    DeviceLaunch, DistDevice, Distributed, FsdpOptimizer, HostLaunch, JobSpec, LaunchOptions,
    check_job, launch_job, parameter_bytes,
};

/// What a run produced.
#[derive(Clone, Debug, Default)]
pub struct RunSummary {
    /// Metrics of each step run (from the first step after a resume).
    pub steps: Vec<StepMetrics>,
    /// Generated text, if asked for.
    pub sample: String,
    /// The validation loss of the weights as the run started, when it trained no step
    /// (`--steps 0`, or a resume at its last step) and validation was asked for; a training
    /// run's evaluations are in its [`RunSummary::steps`].
    pub val_loss: Option<f32>,
    /// Every parameter at the end, in visiting order (rank 0; with `gather_parameters`).
    pub parameters: Vec<Vec<f32>>,
    /// The process's peak resident set (VmHWM) once the model was built, laid out and loaded,
    /// before the first step (rank 0's view of the process).
    pub setup_peak_rss: u64,
    /// The process's peak resident set at the end, after the last checkpoint was written.
    pub final_peak_rss: u64,
    /// The most heap bytes live at once before the first step ([`crate::alloc::heap_peak`]:
    /// 0 unless the binary's global allocator is [`crate::alloc::Allocator`]).
    pub setup_heap_peak: u64,
    /// The most heap bytes live at once by the end.
    pub final_heap_peak: u64,
    /// Per checkpoint saved: the seconds on the step's path (taking the pieces) and the
    /// seconds rank 0's background thread took to write and commit.
    pub saves: Vec<(f64, f64)>,
    /// Per checkpoint saved: the seconds the step's path waited first for the previous save's
    /// background write (0 when it was done, and for the first); in the wall clock's
    /// `save_wait`.
    pub save_waits: Vec<f64>,
    /// The model shape.
    pub model: Option<ModelConfig>,
    /// The rank this summary comes from (0, except on the other processes of an MPI job).
    pub rank: usize,
    /// With `--trace`: (rank, its trace) of every rank of this process.
    pub trace: Vec<(usize, Vec<wildfire_parallel::comm::TraceEvent>)>,
    /// What FSDP prefetch (`--prefetch`) did on this rank.
    pub prefetch: wildfire_parallel::PrefetchStats,
    /// Uploads of offloaded parameter pieces by this rank's own thread (`--offload params`:
    /// a use that no FSDP gather serves).
    pub host_uploads: u64,
    /// Offloaded shards gathered from host memory as they are (`--offload params` under FSDP:
    /// the gathered parameter is uploaded on the communication thread). With
    /// [`RunSummary::host_uploads`]: one per use.
    pub host_gathers: u64,
    /// Results of queued collectives uploaded on this rank's communication thread.
    pub comm_uploads: u64,
    /// Muon's Newton–Schulz iterations this rank ran, one per matrix (`--muon-split`).
    pub orthogonalised: u64,
    /// With `--plan auto`: the candidates and the one this run trained with.
    pub plan: Option<Plan>,
    /// With `--max-restarts`: each restart after a lost rank, with the time it cost. The
    /// steps, peaks and parameters above are the last attempt's.
    pub restarts: Vec<Restart>,
    /// Where the run's wall clock went (rank 0's view).
    pub wall: WallClock,
}

/// Where a run's wall clock went, in seconds (rank 0's view; the other ranks run alongside).
/// What a user waits for is [`WallClock::total`]; the step times in the metrics are
/// [`WallClock::first_step`] and [`WallClock::steps`] only.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct WallClock {
    /// `--plan auto`: probing the candidates.
    pub plan: f64,
    /// Reading and tokenising the data (or the token cache), the samplers, a checkpoint's
    /// metadata.
    pub data: f64,
    /// Building the model, laying it out over the mesh, loading a checkpoint or Hugging Face
    /// weights, up to the first step.
    pub build: f64,
    /// The first step run (the kernels' and the allocator's warm-up).
    pub first_step: f64,
    /// Every later step (micro-batches, step, metrics).
    pub steps: f64,
    /// Evaluation.
    pub eval: f64,
    /// Checkpoints: taking the pieces on the step's path, and waiting for the writes at the end.
    pub checkpoint: f64,
    /// Checkpoints: a save waiting, on the step's path, for the previous save's background
    /// write to finish (saves closer together than a write takes).
    pub save_wait: f64,
    /// After the loop: gathering the parameters, the sample, the plot, the trace, the export.
    pub end: f64,
    /// `--max-restarts`: the attempts that failed and the restarts, up to the last attempt's
    /// start (the other parts are the last attempt's).
    pub restarts: f64,
    /// Everything, from the call to its return.
    pub total: f64,
}

impl WallClock {
    /// The measured parts, named as the log line names them (every field but the total).
    pub fn parts(&self) -> [(&'static str, f64); 10] {
        [
            ("plan", self.plan),
            ("data", self.data),
            ("build", self.build),
            ("first step", self.first_step),
            ("steps", self.steps),
            ("eval", self.eval),
            ("checkpoints", self.checkpoint),
            ("save wait", self.save_wait),
            ("end", self.end),
            ("restarts", self.restarts),
        ]
    }

    /// What the parts do not cover: the launch, thread start-up, the reports between steps.
    pub fn other(&self) -> f64 {
        let parts: f64 = self.parts().iter().map(|(_, seconds)| seconds).sum();
        (self.total - parts).max(0.0)
    }
}

impl std::fmt::Display for WallClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "wall clock {:.2} s:", self.total)?;
        let mut first = true;
        for (name, seconds) in self.parts().into_iter().chain([("other", self.other())]) {
            if seconds > 0.0 || name == "steps" {
                write!(f, "{} {name} {seconds:.2} s", if first { "" } else { "," })?;
                first = false;
            }
        }
        Ok(())
    }
}

impl RunSummary {
    /// A summary whose setup peaks are the process's now (the model built, laid out, loaded).
    fn at_setup() -> Self {
        Self {
            setup_peak_rss: peak_rss(),
            setup_heap_peak: crate::alloc::heap_peak() as u64,
            ..Self::default()
        }
    }
}

/// The state stored next to the weights in a checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct CheckpointState {
    /// Steps completed.
    step: usize,
    /// The run's configuration.
    config: PretrainConfig,
    /// The model shape.
    model: ModelConfig,
    /// The loss scaler (f16 runs).
    #[serde(default)]
    scaler: Option<DynamicLossScaler>,
}

/// The data of a run and the model shape it implies (the vocabulary is the data's). Cheap to
/// clone: the tokens are shared.
#[derive(Clone)]
pub struct RunData {
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// All tokens.
    pub dataset: std::sync::Arc<TokenDataset>,
    /// The model shape.
    pub model: ModelConfig,
}

/// Load the data and derive the model shape from it.
pub fn load_data(config: &PretrainConfig) -> Result<RunData, PretrainError> {
    let (tokenizer, dataset) = config.data.load()?;
    let model = config.model_shape(tokenizer.vocab_size().max(dataset.max_token() as usize + 1))?;
    dataset.check_vocab(model.vocab_size())?;
    config.parallel.check_model(&model)?;
    tracing::info!(model = ?model, params = model.num_params(), tokens = dataset.len(), data = %config.data.source());
    Ok(RunData {
        tokenizer,
        dataset: std::sync::Arc::new(dataset),
        model,
    })
}

/// The per-rank memory `config` needs for `model` ([`wildfire_models::memory::estimate`]).
pub fn estimate(config: &PretrainConfig, model: &ModelConfig) -> MemoryEstimate {
    wildfire_models::memory::estimate(
        model,
        &config.parallel,
        config.batch_size,
        config.precision.reduced_dtype(),
        config.optimizer_state(),
        match config.offload {
            Offload::None => Offloaded::Nothing,
            Offload::Optimizer => Offloaded::Optimizer,
            Offload::Params => Offloaded::Params,
        },
    )
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
    run_on_with::<B, _>(config, device, &HostLaunch)
}

/// [`run_on`] with what the backend adds to a launch (`support`: NCCL on CUDA,
/// `wildfire_parallel::NcclLaunch`). With [`Collectives::Nccl`] rank `r` of a process runs on the
/// device `r` places after `device` (its local rank: one GPU per rank). With `--max-restarts`, a
/// lost rank restarts the run on the replicas that remain ([`Restart`]).
pub fn run_on_with<B: FusedOps, D: DeviceLaunch<B>>(
    config: &PretrainConfig,
    device: &B::Device,
    support: &D,
) -> Result<RunSummary, PretrainError> {
    // 1. Configuration: refuse what cannot run before any work.
    config.check()?;
    elastic::run_elastic::<B, D>(config, device, support)
}

/// How `config`'s ranks start and talk.
fn job_spec(config: &PretrainConfig) -> Result<JobSpec, PretrainError> {
    Ok(JobSpec {
        mesh: config.parallel.mesh()?,
        launch: config.launch,
        collectives: config.collectives,
        options: LaunchOptions {
            links: config.links()?,
            timeout: std::time::Duration::from_secs_f64(config.timeout),
        },
    })
}

/// One attempt of a checked, planned run (`attempt`: an elastic run's, where rank 0 records its
/// progress, with the checkpoints kept in memory).
fn run_once<B: FusedOps, D: DeviceLaunch<B>>(
    config: &PretrainConfig,
    device: &B::Device,
    support: &D,
    attempt: Option<&elastic::Attempt>,
) -> Result<RunSummary, PretrainError> {
    let started = Instant::now();
    let job = job_spec(config)?;
    check_job(&job, support)?;
    if let Some(dtype) = config.precision.reduced_dtype()
        && !B::supports_dtype(device, dtype.into())
    {
        return Err(PretrainError::Config(format!(
            "--precision {:?}: the {} backend cannot compute in {dtype:?}; use --precision f32",
            config.precision,
            B::name(device)
        )));
    }
    // 2. Data and model shape; the batch sampler gives every data-parallel rank its rows.
    let data = load_data(config)?;
    let validate = config.eval_iters > 0;
    let (seed, block) = (config.seed, data.model.block_size());
    config.parallel.check_sequence(block)?;
    // Refused before any work: Hugging Face files of a mixture of experts not shaped as
    // Mixtral's.
    if config.export_hf.is_some() || config.init_from.is_some() {
        data.model.hf_importable()?;
    }
    let [(train, sampler), (val, val_sampler)] =
        (config.data).samplers(&data.dataset, seed, block, config.batch_size, validate)?;
    // An elastic restart may resume from the checkpoint held in memory (reading no file).
    let resume = match attempt.and_then(|a| a.from_memory.as_ref()) {
        Some((label, files)) => Some(read_state_in_memory(label, files.clone(), &data.model)?),
        None => config
            .resume
            .as_deref()
            .map(|dir| read_state(dir, &data.model))
            .transpose()?,
    };
    let first_step = resume.as_ref().map_or(0, |(state, _)| state.step);
    let data_seconds = started.elapsed().as_secs_f64();
    tracing::info!("pretraining {} steps from step {first_step}", config.steps);
    // Ranks as threads share one metrics file (rank 0 writes); a launched process's rank 0 opens
    // its own.
    let open_metrics = |rank: usize| match &config.metrics {
        Some(path) if rank == 0 => MetricsLog::open(path, config.resume.is_some())
            .map(Some)
            .map_err(io_err(path)),
        _ => Ok(None),
    };
    let shared_metrics = match config.launch {
        Launch::Threads => open_metrics(0)?,
        Launch::Mpi | Launch::Rendezvous => None,
    };
    // 3. Every rank (its collectives installed by the launch): build, parallelize, train.
    let rank_body = |device: DistDevice<B>| -> Result<RunSummary, PretrainError> {
        let rank_started = Instant::now();
        if let Some(attempt) = attempt.filter(|_| device.rank() == 0) {
            attempt.progress.launched();
        }
        let own_metrics = match config.launch {
            Launch::Threads => None,
            _ => open_metrics(device.rank())?,
        };
        // Under a launcher, the plan (every rank probes together, and chooses the same).
        let planned = match config.plan {
            PlanMode::Auto => {
                let plan_started = Instant::now();
                let plan = plan::plan_in_job(config, &data, &device)?;
                let chosen = plan.chosen_config(config, device.rank() == 0)?;
                Some((plan, chosen, plan_started.elapsed().as_secs_f64()))
            }
            PlanMode::Off => None,
        };
        let config = planned.as_ref().map_or(config, |(_, chosen, _)| chosen);
        let run = RankRun {
            config,
            data: &data,
            sampler: &sampler,
            val_sampler: &val_sampler,
            train,
            val,
            rows: sampler.rows_for(
                device.mesh().data_index(device.rank()).0,
                config.parallel.dp,
            )?,
            metrics: own_metrics.as_ref().or(shared_metrics.as_ref()),
            resume: resume
                .as_ref()
                .map(|(state, checkpoint)| (checkpoint, state.scaler.clone())),
            first_step,
            started: rank_started,
            attempt,
        };
        let mut summary = train_rank(run, &device)?;
        if let Some((plan, _, seconds)) = planned {
            summary.plan = Some(plan);
            summary.wall.plan = seconds;
        }
        Ok(summary)
    };
    let launched = launch_job(&job, device, support, rank_body)?;
    let rank = launched.first_rank;
    // Ranks as threads: every rank's trace goes with rank 0's summary.
    let trace: Vec<_> = launched
        .results
        .iter()
        .flat_map(|r| r.as_ref().ok().map(|s| s.trace.clone()))
        .flatten()
        .collect();
    let mut summary = RunSummary {
        trace,
        ..first_or_root_cause(launched.results)?
    };
    let end_started = Instant::now();
    summary.model = Some(data.model.clone());
    summary.rank = rank;
    if rank == 0
        && let Some(path) = &config.plot
    {
        plot_losses(path, &summary.steps).map_err(io_err(path))?;
    }
    if let Some(path) = &config.trace {
        // Ranks as threads: one file; processes: one each.
        let path = match config.launch {
            Launch::Threads => path.clone(),
            _ => path.with_extension(format!("rank-{rank}.json")),
        };
        let bytes = wildfire_engine::trace::chrome_trace_bytes(&summary.trace);
        wildfire_checkpoint::io::write_atomic(&path, &bytes).map_err(|source| {
            PretrainError::Io {
                path: path.clone(),
                source,
            }
        })?;
        tracing::info!("trace: {}", path.display());
    }
    if rank == 0
        && let Some(out) = &config.export_hf
    {
        // Rank 0 committed the last checkpoint before its run returned.
        let root = config
            .save
            .as_ref()
            .expect("checked: --export-hf needs --save");
        let checkpoint = Checkpoint::open(CheckpointDir::new(root).latest()?)?;
        data.model.export_hf(&checkpoint, out)?;
        tracing::info!("exported the weights to {}", out.display());
    }
    summary.wall.data = data_seconds;
    summary.wall.end += end_started.elapsed().as_secs_f64();
    summary.wall.total = started.elapsed().as_secs_f64();
    tracing::debug!("{}", summary.wall);
    Ok(summary)
}

/// This rank's part of `run` on `device` (the job launched): the whole model, or its stages
/// under `--pp`. A rank that stops with an error releases the others from waiting for it (ranks
/// as threads): they fail at once, naming it and its error.
fn train_rank<B: FusedOps>(
    run: RankRun,
    device: &DistDevice<B>,
) -> Result<RunSummary, PretrainError> {
    let result = if run.config.parallel.pp > 1 {
        run.train_pipelined(device)
    } else {
        run.train(device)
    };
    if let Err(e) = &result {
        device.context().comm().fail(e.to_string());
    }
    result
}

/// `config` run on this rank of a launched job (`device`) over `data`: no metrics file, resume
/// or elastic attempt. The memory planner's probes, which every rank of the job runs together.
fn run_on_rank<B: FusedOps>(
    config: &PretrainConfig,
    data: &RunData,
    device: &DistDevice<B>,
) -> Result<RunSummary, PretrainError> {
    let block = data.model.block_size();
    config.parallel.check_sequence(block)?;
    let validate = config.eval_iters > 0;
    let [(train, sampler), (val, val_sampler)] = (config.data).samplers(
        &data.dataset,
        config.seed,
        block,
        config.batch_size,
        validate,
    )?;
    let data_rank = device.mesh().data_index(device.rank()).0;
    let run = RankRun {
        config,
        data,
        sampler: &sampler,
        val_sampler: &val_sampler,
        train,
        val,
        rows: sampler.rows_for(data_rank, config.parallel.dp)?,
        metrics: None,
        resume: None,
        first_step: 0,
        started: Instant::now(),
        attempt: None,
    };
    train_rank(run, device)
}

/// The first rank's summary, or when it failed the root cause: the first error that is not a
/// rank released by another's failure ([`wildfire_parallel::Error::PeerFailed`]) — a peer's
/// timeout names the ranks it waited for, where rank 0 only learns that the job was aborted.
fn first_or_root_cause<T>(results: Vec<Result<T, PretrainError>>) -> Result<T, PretrainError> {
    let released = |r: &Result<T, PretrainError>| {
        matches!(
            r,
            Err(PretrainError::Parallel(
                wildfire_parallel::Error::PeerFailed { .. }
            ))
        )
    };
    let mut results = results.into_iter();
    let first = results.next().expect("a rank ran");
    if !released(&first) {
        return first;
    }
    results
        .find(|r| r.is_err() && !released(r))
        .unwrap_or(first)
}

/// The checkpoint `--resume` names: `root` itself when it is one step's directory (it holds the
/// metadata), else the latest step under it.
fn resume_dir(root: &Path) -> Result<std::path::PathBuf, PretrainError> {
    if root.join("metadata.json").is_file() {
        return Ok(root.to_path_buf());
    }
    Ok(CheckpointDir::new(root).latest()?)
}

/// The checkpoint to resume from: its state, checked against this run's model, and directory.
fn read_state(
    root: &Path,
    model: &ModelConfig,
) -> Result<(CheckpointState, Checkpoint), PretrainError> {
    let dir = resume_dir(root)?;
    // The metadata and every file's size, checked before any rank starts.
    let checkpoint = Checkpoint::open(&dir)?;
    let state: CheckpointState = read_state_file(&dir, "state.json")?;
    check_state(checkpoint, state, &dir, model)
}

/// [`read_state`] of a checkpoint held in memory (`label` names it).
fn read_state_in_memory(
    label: &Path,
    files: std::sync::Arc<wildfire_checkpoint::dcp::MemoryFiles>,
    model: &ModelConfig,
) -> Result<(CheckpointState, Checkpoint), PretrainError> {
    let state = files
        .get("state.json")
        .map(|bytes| serde_json::from_slice(bytes));
    let Some(Ok(state)) = state else {
        return Err(PretrainError::Checkpoint {
            path: label.join("state.json"),
            reason: "the run state held in memory is missing or unreadable".into(),
        });
    };
    let checkpoint = Checkpoint::in_memory(label.to_path_buf(), files)?;
    check_state(checkpoint, state, label, model)
}

/// The checkpoint and its run state, when it holds `model`.
fn check_state(
    checkpoint: Checkpoint,
    state: CheckpointState,
    dir: &Path,
    model: &ModelConfig,
) -> Result<(CheckpointState, Checkpoint), PretrainError> {
    // A checkpoint from before the padded vocabulary was masked (`vocab_used`) has the same
    // weights: it resumes, masked from here on.
    let saved = match (&state.model, model) {
        (ModelConfig::Gpt(saved), ModelConfig::Gpt(this)) => ModelConfig::Gpt(GptConfig {
            vocab_used: this.vocab_used,
            ..saved.clone()
        }),
        (saved, _) => saved.clone(),
    };
    if &saved != model {
        return Err(PretrainError::Checkpoint {
            path: dir.to_path_buf(),
            reason: format!(
                "it holds a model of shape {:?}, this run builds {:?}; resume with the same model flags",
                state.model, model
            ),
        });
    }
    Ok((state, checkpoint))
}

mod pipeline;
mod plan;
mod rank;
use rank::RankRun;
