//! What a pretraining run is: [`PretrainConfig`], its command-line flags and its defaults in one
//! definition (clap reads the flags into it, `Default` is what the flags give when none is
//! passed, serde stores it in every checkpoint), the checks a run makes before any work, and
//! where a launched process sits ([`PretrainConfig::apply_launcher`]).

use super::PretrainError;
pub use super::plan::PlanMode;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
pub use wildfire_engine::MuonSplit;
use wildfire_engine::report::{LrDecay, LrSchedule};
use wildfire_models::data::DataFlags;
use wildfire_models::parallelize::ParallelConfig;
pub use wildfire_models::parallelize::Precision;
use wildfire_models::{ModelConfig, ModelFlags};
use wildfire_parallel::LaunchEnv;
pub use wildfire_parallel::{Collectives, Launch};

/// Everything a pretraining run needs: the binary's flags, stored in every checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, clap::Args)]
pub struct PretrainConfig {
    /// The model: a preset and the flags over it.
    #[serde(flatten)]
    #[command(flatten)]
    pub model: ModelFlags,

    /// The data: what the run trains on, its tokenizer, what is held out.
    #[serde(flatten)]
    #[command(flatten)]
    pub data: DataFlags,

    /// Total optimizer steps (a resumed run continues up to this step). 0 trains nothing: the
    /// weights as loaded (`--init-from`, `--resume`) or initialised are evaluated once, when
    /// validation is asked for, and sampled (`--sample-tokens`).
    #[arg(long, default_value_t = 300, help_heading = "Training")]
    pub steps: usize,
    /// Global batch: sequences per step over all data-parallel ranks.
    #[arg(long, default_value_t = 8, help_heading = "Training")]
    pub batch_size: usize,
    /// Gradient accumulation micro-batches per step.
    #[arg(long, default_value_t = 1, help_heading = "Training")]
    pub accum: usize,
    /// Peak learning rate (AdamW, β = (0.9, 0.95)).
    #[arg(long, default_value_t = 1e-3, help_heading = "Training")]
    pub lr: f64,
    /// Linear warmup steps, then the `--lr-decay` to `lr · --min-lr-ratio` at step
    /// `decay_steps`.
    #[arg(long, default_value_t = 20, help_heading = "Training")]
    pub warmup: usize,
    /// Where the decay ends (default: `steps`); set it to keep a schedule fixed when a
    /// run is stopped early and resumed with more steps.
    #[arg(long, help_heading = "Training")]
    pub decay_steps: Option<usize>,
    /// The learning rate after warmup: cosine (nanoGPT's), linear, wsd (warmup–stable–decay:
    /// the peak held, then a linear cooldown over the last `--cooldown` share), wsd-sqrt (the
    /// cooldown `1 − √q`), or constant.
    #[serde(default)]
    #[arg(long, value_enum, default_value_t = LrDecay::Cosine, help_heading = "Training")]
    pub lr_decay: LrDecay,
    /// The learning rate the decay ends at, as a share of `--lr`.
    #[serde(default = "default_min_lr_ratio")]
    #[arg(long, default_value_t = 0.1, help_heading = "Training")]
    pub min_lr_ratio: f64,
    /// The wsd decays' cooldown: this share of the steps from the warmup's end to the decay's
    /// end.
    #[serde(default = "default_cooldown")]
    #[arg(long, default_value_t = 0.2, help_heading = "Training")]
    pub cooldown: f64,
    /// Decoupled weight decay (AdamW's; Adafactor's too).
    #[arg(long, default_value_t = 0.1, help_heading = "Training")]
    pub weight_decay: f64,
    /// The optimizer: adamw (β = (0.9, 0.95), ε 1e-5); adafactor (PyTorch's
    /// `torch.optim.Adafactor`: a matrix's second moment kept as a row and a column statistic,
    /// no first moment, the relative step capped by the learning rate); or muon (PyTorch's
    /// `torch.optim.Muon` on the hidden matrices, momentum 0.95, Nesterov, five Newton–Schulz
    /// steps on the whole matrix, Moonlight's learning-rate match so `--lr` serves both halves;
    /// AdamW on the token/position tables, the head, norms and biases).
    #[serde(default)]
    #[arg(long, value_enum, default_value_t = OptimizerKind::Adamw, help_heading = "Training")]
    pub optimizer: OptimizerKind,
    /// The dtype of AdamW's two moments: f32 (8 bytes of state per parameter), bf16 (4; the
    /// update is computed in f32 and the moments rounded to nearest) or int8 (2 and an f32
    /// scale per 2,048 elements: bitsandbytes' block-wise dynamic quantisation; tensors under
    /// 4,096 elements keep f32).
    #[serde(default)]
    #[arg(long, value_enum, default_value_t = OptimState::F32, help_heading = "Training")]
    pub optim_state: OptimState,
    /// Keep AdamW's moments in host memory and run its step there (optimizer: ZeRO-Offload);
    /// the device holds the parameters, gradients and activations only.
    #[serde(default)]
    #[arg(long, value_enum, default_value_t = Offload::None, help_heading = "Training")]
    pub offload: Offload,
    /// Which ranks run Muon's Newton–Schulz iteration on a sharded matrix: owner (one rank of
    /// the data-parallel group per matrix, in turn, its result broadcast: 1/dp of the
    /// iterations per rank, one more broadcast per matrix) or every (each rank, every matrix).
    /// The same numbers either way.
    #[serde(default)]
    #[arg(long, value_enum, default_value_t = MuonSplit::Owner, help_heading = "Training")]
    pub muon_split: MuonSplit,
    /// Clip the global gradient norm to this (0: off).
    #[arg(long, default_value_t = 1.0, help_heading = "Training")]
    pub clip: f64,
    /// Stop after this many steps in a row with a non-finite loss or gradient norm (each is
    /// skipped on every rank); the error names the first parameter with a non-finite gradient.
    #[serde(default = "twenty")]
    #[arg(long, default_value_t = 20, help_heading = "Training")]
    pub max_skipped: usize,
    /// Seed of the data sampling (the weights' seed is part of the model).
    #[arg(long, default_value_t = 1337, help_heading = "Training")]
    pub seed: u64,

    /// Parallelism.
    #[command(flatten)]
    pub parallel: ParallelConfig,
    /// Compute precision: f32, bf16, f16.
    #[arg(long, value_enum, default_value_t = Precision::F32, help_heading = "Parallelism")]
    pub precision: Precision,
    /// The dtype data-parallel gradient reductions communicate in: f32 (the master
    /// gradients'), bf16 (half the bytes), f16.
    #[serde(default = "f32_precision")]
    #[arg(long, value_enum, default_value_t = Precision::F32, help_heading = "Parallelism")]
    pub grad_reduce: Precision,
    /// Per-rank budget on the bytes of live tensors (the decorator's accounting); a step that
    /// needs more fails with a typed error naming the rank. What `--plan auto` plans for.
    #[serde(default)]
    #[arg(long, help_heading = "Parallelism")]
    pub memory_budget: Option<u64>,
    /// auto: choose the FSDP strategy, recomputation policy, AdamW moment dtype and optimizer
    /// offload that fit `--memory-budget`, the fastest first (each measured on the model cut to
    /// one and two blocks, extrapolated to its depth; `super::plan`); off: the flags as given.
    #[serde(default)]
    #[arg(long, value_enum, default_value_t = PlanMode::Off, help_heading = "Parallelism")]
    pub plan: PlanMode,
    /// FSDP prefetch: parameter all-gathers kept in flight ahead of the one in use (issued on
    /// each rank's communication thread in the order the last step gathered them, so they run
    /// while the rank computes; FSDP2's default is one); 0: gather each parameter when it is
    /// needed.
    #[serde(default = "default_prefetch")]
    #[arg(long, default_value_t = default_prefetch(), help_heading = "Parallelism")]
    pub prefetch: usize,
    /// Asynchronous gradient reductions (FSDP, ZeRO-2, HSDP): a gradient's reduce-scatter is
    /// issued on the rank's communication thread where the gradient is born and waited for at
    /// its first use, at most this many outstanding, so backward computes while they run (DDP's
    /// buckets too); 0: each blocks.
    #[serde(default = "default_reduce_in_flight")]
    #[arg(long, default_value_t = default_reduce_in_flight(), help_heading = "Parallelism")]
    pub reduce_in_flight: usize,
    /// DDP (and ZeRO-1): all-reduce the gradients where they are born, in buckets of this many
    /// MiB (PyTorch DDP's default is 25; fractions allowed), instead of one call per parameter
    /// after backward; with `--reduce-in-flight` above 0 the buckets run while backward goes on.
    /// 0: after backward.
    #[serde(default = "default_bucket_mb")]
    #[arg(long, default_value_t = default_bucket_mb(), help_heading = "Parallelism")]
    pub bucket_mb: f64,

    /// Evaluate every this many steps, and at the end (0: only at the end).
    #[arg(
        long,
        default_value_t = 50,
        help_heading = "Evaluation and checkpoints"
    )]
    pub eval_every: usize,
    /// Validation batches per evaluation.
    #[arg(long, default_value_t = 4, help_heading = "Evaluation and checkpoints")]
    pub eval_iters: usize,
    /// Checkpoint directory.
    #[arg(long, help_heading = "Evaluation and checkpoints")]
    pub save: Option<PathBuf>,
    /// Checkpoint every this many steps, and at the end (0: only at the end).
    #[arg(long, default_value_t = 0, help_heading = "Evaluation and checkpoints")]
    pub save_every: usize,
    /// Resume from this checkpoint: the directory given to `--save` (its latest step), or one
    /// step's directory in it.
    #[arg(long, help_heading = "Evaluation and checkpoints")]
    pub resume: Option<PathBuf>,
    /// Start from Hugging Face weights (F32, BF16 or F16), each rank reading its pieces: a GPT-2
    /// safetensors file (the model flags must match its shapes — the vocabulary may be padded,
    /// the context shorter — and `--n-head` its heads), or for a Llama preset a
    /// `LlamaForCausalLM` file or directory (one `model.safetensors`, or shards with their
    /// index; a directory's `config.json` gives the model's shape).
    #[serde(default)]
    #[arg(long, value_name = "FILE", help_heading = "Evaluation and checkpoints")]
    pub init_from: Option<PathBuf>,
    /// At the end, write the last checkpoint's weights as one Hugging Face safetensors file
    /// (GPT-2's or Llama's names; needs --save), streamed tensor by tensor.
    #[serde(default)]
    #[arg(long, value_name = "FILE", help_heading = "Evaluation and checkpoints")]
    pub export_hf: Option<PathBuf>,

    /// One JSON object per step (and per evaluation) to this file (its folder made if missing);
    /// appended to on --resume. The default puts a run's outputs in `runs/latest/`, beside the
    /// loss curve, never over a tracked file.
    #[arg(
        long,
        default_value = "runs/latest/metrics.jsonl",
        help_heading = "Output"
    )]
    pub metrics: Option<PathBuf>,
    /// A log line every this many steps.
    #[arg(long, default_value_t = 10, help_heading = "Output")]
    pub log_every: usize,
    /// Peak FLOP/s of one rank's device (e.g. 9.9e14 for an H100's dense bf16), for the MFU
    /// column of the log line; without it the line has no MFU (a guessed peak would mislead).
    #[arg(long, help_heading = "Output")]
    pub peak_flops: Option<f64>,
    /// Tokens of text to generate at the end (0: none), continuing `--prompt`.
    #[arg(long, default_value_t = 300, help_heading = "Generation")]
    pub sample_tokens: usize,
    /// The text the generated sample continues, encoded by the run's tokenizer (default: a
    /// newline). The printed sample starts with it.
    #[serde(default)]
    #[arg(long, value_name = "TEXT", help_heading = "Generation")]
    pub prompt: Option<String>,
    /// The sample's temperature: the logits are divided by it before the softmax; 0 decodes
    /// greedily (the most likely token at every step, as `transformers`' `do_sample=False`).
    #[serde(default = "default_temperature")]
    #[arg(long, default_value_t = 0.8, help_heading = "Generation")]
    pub temperature: f32,
    /// Sample among this many most likely tokens (0: the whole vocabulary).
    #[serde(default = "default_sample_top_k")]
    #[arg(long, default_value_t = 40, help_heading = "Generation")]
    pub sample_top_k: usize,
    /// Nucleus sampling: among those, the most likely tokens whose probabilities first add up
    /// to this share (1: no cut).
    #[serde(default = "default_top_p")]
    #[arg(long, default_value_t = 1.0, help_heading = "Generation")]
    pub top_p: f64,
    /// The sample's seed (default: `--seed`); the same weights, prompt and seed give the same
    /// text on any mesh.
    #[serde(default)]
    #[arg(long, help_heading = "Generation")]
    pub sample_seed: Option<u64>,
    /// Loss-curve PNG written at the end (its folder made if missing).
    #[arg(long, default_value = "runs/latest/loss.png", help_heading = "Output")]
    pub plot: Option<PathBuf>,
    /// Chrome / Perfetto trace (JSON) of every rank's compute regions and collectives, written
    /// at the end (under MPI, one file per process: `FILE.rank-N.json`).
    #[arg(long, value_name = "FILE", help_heading = "Output")]
    pub trace: Option<PathBuf>,
    /// Folded stacks of every thread of the process (where the host's time goes), sampled from
    /// the third step to the last and written at the end (under MPI, one file per process:
    /// `FILE.rank-N.folded`); flamegraph tools and `tools/host_profile.py` read it. Needs a
    /// build with `--features host-profile`.
    #[arg(long, value_name = "FILE", help_heading = "Output")]
    pub host_profile: Option<PathBuf>,
    /// Show a progress bar (rank 0, terminals only).
    #[arg(skip = true)]
    pub progress: bool,
    /// Gather every parameter at the end into the run summary (tests compare them; it holds the
    /// whole model on every rank for a moment, so runs do without).
    #[serde(default, skip_serializing)]
    #[arg(skip = false)]
    pub gather_parameters: bool,
    /// A run of the memory planner's (one of its probes), not a user's: every pipeline
    /// position's peaks, the largest over the mesh's ranks there, are gathered after each step
    /// ([`StepMetrics::stages`](crate::pretrain::StepMetrics::stages); one small all-reduce, as
    /// under `--pp`), so that every process plans from the same numbers, and the step lines log
    /// at debug level (dozens of short runs come before the real one).
    #[serde(default, skip_serializing)]
    #[arg(skip = false)]
    pub probe: bool,
    /// Ranks as threads of this process, or this process as one rank of a launched job (set
    /// from the environment by [`PretrainConfig::apply_launcher`]).
    #[serde(default)]
    #[arg(skip)]
    pub launch: Launch,
    /// What moves the training tensors between ranks: host (threads / MPI), nccl (CUDA GPUs,
    /// one per rank, the rank's local index; needs --backend cuda), or staged (the device
    /// path over the host communicator, for testing it).
    #[serde(default)]
    #[arg(
        long,
        default_value = "host",
        value_parser = |s: &str| s.parse::<Collectives>(),
        help_heading = "Run"
    )]
    pub collectives: Collectives,
    /// Ranks as threads: model an axis's links, `AXIS=BANDWIDTH,LATENCY` (`dp=25GB/s,5us`) or
    /// `AXIS=nvlink|infiniband|ethernet`, so its collectives take the time they would on them;
    /// repeat per axis.
    #[serde(default)]
    #[arg(long = "link", value_name = "AXIS=LINK", help_heading = "Run")]
    pub links: Vec<String>,
    /// How long a rank waits for its peers in a collective before the job fails (seconds): a
    /// rank that died or hangs is detected after this long at most.
    #[serde(default = "sixty")]
    #[arg(long, default_value_t = 60.0, help_heading = "Resilience")]
    pub timeout: f64,
    /// Ranks as threads: when a rank is lost (it panicked, or its peers timed out waiting for
    /// it), restart up to this many times with the data-parallel replicas that remain, from the
    /// latest checkpoint of `--save`, resharded, the global batch kept (more accumulation per
    /// rank where the micro-batch would grow). Model axes (tp, pp, cp) cannot shrink. Under MPI
    /// use `scripts/elastic_mpirun.sh`.
    #[serde(default)]
    #[arg(long, default_value_t = 0, help_heading = "Resilience")]
    pub max_restarts: usize,
    /// With `--max-restarts`: before shrinking, wait up to this many seconds for a replacement
    /// of each lost rank — its device answering again (a small tensor made and read back on it)
    /// — and restart with the replaced ranks in the mesh: at full size when every lost rank is
    /// replaced, the global batch and micro-batches unchanged. 0 (the default): shrink at once.
    /// A rank that died of a software fault has a healthy device and is replaced at once; a
    /// device that stays gone (`--fail-at STEP:RANK:gone`) costs the whole grace period.
    #[serde(default)]
    #[arg(
        long,
        default_value_t = 0.0,
        value_name = "SECONDS",
        help_heading = "Resilience"
    )]
    pub restart_grace: f64,
    /// A test hook, off by default: `STEP:RANK` kills rank RANK (a panic) at the start of step
    /// STEP; `STEP:RANK:hang` makes it stop arriving at collectives instead, as a rank stuck
    /// inside one, until the others' timeout aborts the job; `STEP:RANK:gone` kills it and its
    /// device stays gone (it never answers `--restart-grace`'s probe). Only the first attempt
    /// of an elastic run fails.
    #[serde(default)]
    #[arg(
        long,
        value_name = "STEP:RANK[:hang|:gone]",
        help_heading = "Resilience"
    )]
    pub fail_at: Option<FailAt>,
    /// With `--max-restarts`: keep each checkpoint in host memory too — every rank its own
    /// files and a copy of the previous rank's (a ring of buddies) — so a restart after losing
    /// one rank reads no file (the disk checkpoint when a rank and its buddy are both lost).
    /// Costs twice the checkpoint's size in host memory.
    #[serde(default)]
    #[arg(long, help_heading = "Resilience")]
    pub memory_checkpoints: bool,
}

/// `--fail-at STEP:RANK[:hang|:gone]`: a test hook that makes rank `rank` fail at the start of
/// step `step` (0-based, as the metrics count): a panic (a dead rank), with `hang` a rank that
/// no longer arrives at collectives until the job is aborted, with `gone` a dead rank whose
/// device does not come back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailAt {
    /// The step at whose start the rank fails.
    pub step: usize,
    /// The global rank that fails.
    pub rank: usize,
    /// Hang instead of dying.
    pub hang: bool,
    /// Die, and the rank's device never answers `--restart-grace`'s probe (no replacement).
    #[serde(default)]
    pub gone: bool,
}

impl FromStr for FailAt {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let number = |part: &str, what: &str| {
            part.parse::<usize>()
                .map_err(|_| format!("--fail-at {s}: {what} `{part}` is not a number"))
        };
        let (step, rank, hang, gone) = match s.split(':').collect::<Vec<_>>().as_slice() {
            [step, rank] => (*step, *rank, false, false),
            [step, rank, "hang"] => (*step, *rank, true, false),
            [step, rank, "gone"] => (*step, *rank, false, true),
            _ => {
                return Err(format!(
                    "--fail-at {s}: write STEP:RANK (the rank dies), STEP:RANK:hang or \
                     STEP:RANK:gone (it dies and its device does not come back)"
                ));
            }
        };
        Ok(FailAt {
            step: number(step, "the step")?,
            rank: number(rank, "the rank")?,
            hang,
            gone,
        })
    }
}

impl fmt::Display for FailAt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.step, self.rank)?;
        if self.hang {
            write!(f, ":hang")?;
        }
        if self.gone {
            write!(f, ":gone")?;
        }
        Ok(())
    }
}

fn sixty() -> f64 {
    60.0
}

/// The optimizer of a run (`--optimizer`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// AdamW, fused where the backend has the kernels.
    #[default]
    Adamw,
    /// Adafactor ([`wildfire_engine::Adafactor`]).
    Adafactor,
    /// Muon for the hidden matrices, AdamW for the tables and vectors
    /// ([`wildfire_engine::MuonOptimizer`]).
    Muon,
}

/// What lives in host memory instead of the device (`--offload`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Offload {
    /// Everything on the device.
    #[default]
    None,
    /// AdamW's moments, and its step ([`wildfire_engine::OffloadAdamW`]).
    Optimizer,
    /// The optimizer as above, and the parameters' shards between uses
    /// ([`wildfire_parallel::offload_parameters`]: each FSDP gather uploads its shard, ahead of
    /// use under the prefetch). Needs `--fsdp full` (or hybrid), as DeepSpeed's parameter
    /// offload needs ZeRO-3.
    Params,
}

/// The dtype AdamW keeps its moments in (`--optim-state`): f32 or bf16.
pub type OptimState = wildfire_engine::MomentDtype;

fn default_min_lr_ratio() -> f64 {
    0.1
}

fn default_cooldown() -> f64 {
    0.2
}

fn default_prefetch() -> usize {
    1
}

fn default_reduce_in_flight() -> usize {
    2
}

fn default_bucket_mb() -> f64 {
    25.0
}

fn f32_precision() -> Precision {
    Precision::F32
}

impl Default for PretrainConfig {
    /// What the flags give when none is passed (the environment not read).
    fn default() -> Self {
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            config: PretrainConfig,
        }
        let command =
            <Flags as clap::CommandFactory>::command().mut_arg("dp", |a| a.env(None::<&str>));
        let matches = command.get_matches_from(["wildfire"]);
        <Flags as clap::FromArgMatches>::from_arg_matches(&matches)
            .expect("the defaults parse")
            .config
    }
}

impl PretrainConfig {
    /// The defaults without output: no evaluation, no generated sample, no plot or metrics file, no progress
    /// bar, a one-step warmup (benchmarks and tests start from it).
    pub fn quiet() -> Self {
        Self {
            warmup: 1,
            eval_every: 0,
            eval_iters: 0,
            sample_tokens: 0,
            progress: false,
            plot: None,
            metrics: None,
            gather_parameters: true,
            ..Self::default()
        }
    }

    /// The modelled links of `--link`, each naming an axis of the mesh.
    pub fn links(&self) -> Result<wildfire_parallel::comm::Links, PretrainError> {
        Ok(self.parallel.links(&self.links)?)
    }

    /// The model shape for a vocabulary of `vocab` tokens ([`ModelFlags::resolve`]): the
    /// preset's with the model flags over it, or a Hugging Face directory's `config.json`'s.
    pub fn model_shape(&self, vocab: usize) -> Result<ModelConfig, wildfire_models::Error> {
        self.model.resolve(vocab, self.init_from.as_deref())
    }

    /// Refuse options that are not implemented yet, and impossible values.
    pub fn check(&self) -> Result<(), PretrainError> {
        self.parallel.check_available()?;
        self.links()?;
        if self.export_hf.is_some() && self.save.is_none() {
            return Err(PretrainError::Config(
                "--export-hf writes the last checkpoint's weights: it needs --save DIR".into(),
            ));
        }
        if !(self.bucket_mb.is_finite() && self.bucket_mb >= 0.0) {
            return Err(PretrainError::Config(format!(
                "--bucket-mb {}: a bucket size is a number of MiB, 0 or more",
                self.bucket_mb
            )));
        }
        wildfire_models::TokenSampler::check(self.temperature, self.top_p)
            .map_err(|why| PretrainError::Config(format!("--temperature / --top-p: {why}")))?;
        if self.host_profile.is_some() && !cfg!(feature = "host-profile") {
            return Err(PretrainError::Config(super::host_profile::NOT_BUILT.into()));
        }
        if self.offload != Offload::None
            && (self.optimizer != OptimizerKind::Adamw || self.optim_state != OptimState::F32)
        {
            return Err(PretrainError::Config(
                "--offload optimizer and --offload params run AdamW's step on the host with f32 \
                 moments; train with \
                 --optimizer adamw --optim-state f32, or without --offload"
                    .into(),
            ));
        }
        if self.offload == Offload::Params {
            use wildfire_models::parallelize::FsdpStrategy as S;
            if !matches!(self.parallel.fsdp, S::FullShard | S::Hybrid) {
                return Err(PretrainError::Config(
                    "--offload params keeps each rank's parameter shards in host memory and \
                     uploads them for each gather: it needs --fsdp full or hybrid (a replicated \
                     parameter would be uploaded whole at every use)"
                        .into(),
                ));
            }
        }
        if self.optimizer != OptimizerKind::Adamw && self.optim_state != OptimState::F32 {
            return Err(PretrainError::Config(format!(
                "--optim-state {} sets the dtype of AdamW's moments; --optimizer {} keeps f32 \
                 state: drop --optim-state, or train with --optimizer adamw",
                match self.optim_state {
                    OptimState::Bf16 => "bf16",
                    _ => "int8",
                },
                match self.optimizer {
                    OptimizerKind::Adafactor => "adafactor",
                    _ => "muon",
                }
            )));
        }
        if self.parallel.cp > 1 && self.model.dropout > 0.0 {
            return Err(PretrainError::Config(format!(
                "--cp {} with --dropout {}: dropout on the attention probabilities takes the \
                 composed attention path, which context parallelism does not split; train with \
                 --dropout 0 (pretraining's usual choice)",
                self.parallel.cp, self.model.dropout
            )));
        }
        self.parallel.check_batch(self.batch_size, self.accum)?;
        self.schedule().check().map_err(PretrainError::Config)?;
        self.data.check()?;
        self.check_resilience()?;
        Ok(())
    }

    /// Refuse what an elastic run or the hook cannot do, before any work.
    fn check_resilience(&self) -> Result<(), PretrainError> {
        if !(self.timeout.is_finite() && self.timeout > 0.0) {
            return Err(PretrainError::Config(format!(
                "--timeout {}: a number of seconds above 0",
                self.timeout
            )));
        }
        if !(self.restart_grace.is_finite() && self.restart_grace >= 0.0) {
            return Err(PretrainError::Config(format!(
                "--restart-grace {}: a number of seconds, 0 or more",
                self.restart_grace
            )));
        }
        if self.restart_grace > 0.0 && self.max_restarts == 0 {
            return Err(PretrainError::Config(
                "--restart-grace waits for replacements at the restarts of --max-restarts N: \
                 pass it too"
                    .into(),
            ));
        }
        if self.memory_checkpoints && self.max_restarts == 0 {
            return Err(PretrainError::Config(
                "--memory-checkpoints keeps checkpoints in host memory for the restarts of \
                 --max-restarts N: pass it too"
                    .into(),
            ));
        }
        if self.max_restarts > 0 {
            if self.save.is_none() {
                return Err(PretrainError::Config(
                    "--max-restarts resumes from the latest checkpoint of --save DIR: pass --save \
                     (and --save-every N to have checkpoints before the end)"
                        .into(),
                ));
            }
            if self.launch != Launch::Threads {
                return Err(PretrainError::Config(
                    "--max-restarts restarts the rank threads of this process; a launched process \
                     cannot restart its peers: run the job under scripts/elastic_mpirun.sh, which \
                     relaunches it"
                        .into(),
                ));
            }
        }
        if let Some(fail) = self.fail_at {
            let world = self.parallel.mesh()?.world_size();
            if fail.rank >= world || fail.step >= self.steps {
                return Err(PretrainError::Config(format!(
                    "--fail-at {fail}: the run has ranks 0..{world} and steps 0..{}",
                    self.steps
                )));
            }
        }
        Ok(())
    }

    /// The optimizer state the run keeps, as the memory estimate counts it.
    pub fn optimizer_state(&self) -> wildfire_models::memory::OptimizerState {
        use wildfire_models::memory::OptimizerState as O;
        match self.optimizer {
            OptimizerKind::Adamw if self.optim_state == OptimState::Int8 => O::AdamW8bit,
            OptimizerKind::Adamw => O::AdamW {
                moment_bytes: self.optim_state.bytes(),
            },
            OptimizerKind::Adafactor => O::Adafactor,
            OptimizerKind::Muon => O::Muon,
        }
    }

    /// The learning-rate schedule: linear warmup, then `--lr-decay` (by default nanoGPT's
    /// cosine to a tenth).
    pub fn schedule(&self) -> LrSchedule {
        LrSchedule {
            lr: self.lr,
            warmup: self.warmup,
            decay_steps: self.decay_steps.unwrap_or(self.steps),
            decay: self.lr_decay,
            min_ratio: self.min_lr_ratio,
            cooldown: self.cooldown,
        }
    }

    /// Place this process in the world its launcher started (`env`, from
    /// [`LaunchEnv::detect`]): none or a world of one runs the ranks as threads; `mpirun`,
    /// `mpiexec` and `srun` make it one rank of an MPI job; `torchrun` one rank of a
    /// rendezvous (NCCL only). Unless `dp_given`, `--dp` becomes the launcher's world over
    /// `--tp`; then the mesh must have one rank per process.
    pub fn apply_launcher(
        &mut self,
        env: Option<LaunchEnv>,
        dp_given: bool,
    ) -> Result<(), PretrainError> {
        let Some(env) = env.filter(|e| e.world_size > 1) else {
            self.launch = Launch::Threads;
            return Ok(());
        };
        let launcher = env.launcher.to_string();
        self.parallel
            .fit_world(env.world_size, &launcher, dp_given)?;
        self.launch = Launch::of(Some(&env));
        Ok(())
    }
}

/// The default of `max_skipped` in run files and checkpoints that predate it.
fn twenty() -> usize {
    20
}

fn default_temperature() -> f32 {
    0.8
}

fn default_sample_top_k() -> usize {
    40
}

fn default_top_p() -> f64 {
    1.0
}
