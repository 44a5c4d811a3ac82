//! What a pretraining run is: [`PretrainConfig`], its command-line flags and its defaults in one
//! definition (clap reads the flags into it, `Default` is what the flags give when none is
//! passed, serde stores it in every checkpoint), the checks a run makes before any work, and
//! where a launched process sits ([`PretrainConfig::apply_launcher`]).

use super::PretrainError;
use burn::tensor::FloatDType;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use wildfire_models::data::TokenizerKind;
use wildfire_models::gpt::{Gelu, GptConfig};
use wildfire_models::llama::LlamaConfig;
use wildfire_models::parallelize::ParallelConfig;
use wildfire_models::{ModelConfig, Preset};
use wildfire_parallel::LaunchEnv;
pub use wildfire_parallel::{Collectives, Launch};

/// Numeric precision of the compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[value(rename_all = "lowercase")]
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
    pub fn reduced_dtype(self) -> Option<FloatDType> {
        match self {
            Precision::F32 => None,
            Precision::Bf16 => Some(FloatDType::BF16),
            Precision::F16 => Some(FloatDType::F16),
        }
    }
}

/// Everything a pretraining run needs: the binary's flags, stored in every checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, clap::Args)]
pub struct PretrainConfig {
    /// Model preset: GPT-2 (tiny, small, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b) or
    /// Llama-3 (llama-tiny, llama3-1b, llama3-3b, llama3-8b).
    #[arg(long, default_value = "tiny", help_heading = "Model")]
    pub preset: Preset,
    /// Transformer blocks (overrides the preset).
    #[arg(long, help_heading = "Model")]
    pub n_layer: Option<usize>,
    /// Attention heads (overrides the preset).
    #[arg(long, help_heading = "Model")]
    pub n_head: Option<usize>,
    /// Model width (overrides the preset; a Llama's SwiGLU width keeps the preset's ratio).
    #[arg(long, help_heading = "Model")]
    pub n_embd: Option<usize>,
    /// A GPT's GELU: erf (the presets') or tanh (GPT-2's `gelu_new`); a Hugging Face directory
    /// given to `--init-from` names its own.
    #[serde(default)]
    #[arg(long, value_enum, default_value_t = Gelu::Erf, help_heading = "Model")]
    pub gelu: Gelu,
    /// Key/value heads of a Llama (grouped-query attention; overrides the preset).
    #[serde(default)]
    #[arg(long, help_heading = "Model")]
    pub n_kv_head: Option<usize>,
    /// Context length (overrides the preset).
    #[arg(long, help_heading = "Model")]
    pub block_size: Option<usize>,
    /// Dropout probability while training (embeddings, attention, residual branches; 0 for
    /// pretraining).
    #[serde(default)]
    #[arg(long, default_value_t = 0.0, help_heading = "Model")]
    pub dropout: f64,

    /// Training data: a text file, or a nanoGPT / llm.c `.bin` token file (default: the
    /// embedded corpus). A text file is tokenised once and its tokens cached beside it as
    /// `<file>.<tokenizer>.tokens` (keyed by the file's content: an edit tokenises again, a
    /// fresh checkout does not); `--token-cache` puts the cache elsewhere.
    #[arg(long, help_heading = "Data")]
    pub data: Option<PathBuf>,
    /// Folder for the token cache of a text `--data` file (made if missing), instead of the
    /// data file's own folder.
    #[serde(default)]
    #[arg(long, value_name = "DIR", help_heading = "Data")]
    pub token_cache: Option<PathBuf>,
    /// Tokenizer for text: bytes or gpt2 (GPT-2 BPE, offline).
    #[arg(long, default_value = "bytes", help_heading = "Data")]
    pub tokenizer: TokenizerKind,
    /// Fraction of the tokens held out for validation.
    #[arg(long, default_value_t = 0.1, help_heading = "Data")]
    pub val_fraction: f64,

    /// Total optimizer steps (a resumed run continues up to this step).
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
    /// Linear warmup steps, then cosine decay to `lr / 10` at step `decay_steps`.
    #[arg(long, default_value_t = 20, help_heading = "Training")]
    pub warmup: usize,
    /// Where the cosine decay ends (default: `steps`); set it to keep a schedule fixed when a
    /// run is stopped early and resumed with more steps.
    #[arg(long, help_heading = "Training")]
    pub decay_steps: Option<usize>,
    /// AdamW weight decay.
    #[arg(long, default_value_t = 0.1, help_heading = "Training")]
    pub weight_decay: f64,
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
    /// needs more fails with a typed error naming the rank.
    #[serde(default)]
    #[arg(long, help_heading = "Parallelism")]
    pub memory_budget: Option<u64>,
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
    /// Resume from this checkpoint directory.
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
    /// Tokens of text to generate at the end (0: none).
    #[arg(long, default_value_t = 300, help_heading = "Output")]
    pub sample_tokens: usize,
    /// Loss-curve PNG written at the end (its folder made if missing).
    #[arg(long, default_value = "runs/latest/loss.png", help_heading = "Output")]
    pub plot: Option<PathBuf>,
    /// Chrome / Perfetto trace (JSON) of every rank's compute regions and collectives, written
    /// at the end (under MPI, one file per process: `FILE.rank-N.json`).
    #[arg(long, value_name = "FILE", help_heading = "Output")]
    pub trace: Option<PathBuf>,
    /// Show a progress bar (rank 0, terminals only).
    #[arg(skip = true)]
    pub progress: bool,
    /// Gather every parameter at the end into the run summary (tests compare them; it holds the
    /// whole model on every rank for a moment, so runs do without).
    #[serde(default, skip_serializing)]
    #[arg(skip = false)]
    pub gather_parameters: bool,
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
        let mesh = self.parallel.mesh()?;
        let mut links = wildfire_parallel::comm::Links::default();
        for spec in &self.links {
            links.add(spec).map_err(PretrainError::Config)?;
        }
        for axis in links.0.keys() {
            if mesh.axis_index(axis).is_err() {
                return Err(PretrainError::Config(format!(
                    "--link {axis}=…: the mesh {mesh} has no axis {axis}"
                )));
            }
        }
        Ok(links)
    }

    /// The model shape for a vocabulary of `vocab` tokens (padded past 256 to a multiple of 64,
    /// as nanoGPT pads GPT-2's to 50304; the padded entries masked out of the logits), the
    /// preset's with the model flags over it — or, for a Llama started from a Hugging Face
    /// directory, its `config.json`'s, with `--block-size` (default: the preset's context, at
    /// most the file's positions).
    pub fn model(&self, vocab: usize) -> Result<ModelConfig, wildfire_models::Error> {
        let pad = |used: usize| {
            if used > 256 {
                used.div_ceil(64) * 64
            } else {
                used
            }
        };
        let used = vocab;
        let vocab = pad(used);
        let flag = |name: &str, given: bool, family: &str| {
            if given {
                Err(wildfire_models::Error::Config(format!(
                    "--{name} is a flag of the {family} family, not of --preset {}",
                    self.preset
                )))
            } else {
                Ok(())
            }
        };
        // A Hugging Face directory's configuration gives the shape.
        let hf_config = self
            .init_from
            .as_deref()
            .map(|p| p.join("config.json"))
            .filter(|f| f.is_file());
        let mut model = self.preset.model(vocab);
        match &mut model {
            ModelConfig::Gpt(c) => {
                flag("n-kv-head", self.n_kv_head.is_some(), "Llama")?;
                // The tokens that exist: the data's, or a Hugging Face model's vocabulary.
                let mut real = used;
                if let Some(file) = hf_config {
                    let hf = wildfire_models::hf::gpt2_config(&file, self.block_size)?;
                    real = real.max(hf.vocab_size);
                    *c = GptConfig {
                        init_seed: c.init_seed,
                        ..hf
                    };
                } else {
                    c.n_layer = self.n_layer.unwrap_or(c.n_layer);
                    c.n_head = self.n_head.unwrap_or(c.n_head);
                    c.n_embd = self.n_embd.unwrap_or(c.n_embd);
                    c.block_size = self.block_size.unwrap_or(c.block_size);
                    c.gelu = self.gelu;
                }
                c.vocab_size = pad(real);
                c.vocab_used = (c.vocab_size > real).then_some(real);
                c.dropout = self.dropout;
            }
            ModelConfig::Llama(c) => {
                flag("dropout", self.dropout != 0.0, "GPT")?;
                flag("gelu", self.gelu != Gelu::Erf, "GPT")?;
                if let Some(file) = hf_config {
                    let block = self.block_size.unwrap_or(c.block_size);
                    let hf = LlamaConfig::from_hf_config(&file, block)?;
                    if used > hf.vocab_size {
                        return Err(wildfire_models::Error::Config(format!(
                            "the data's tokens reach {used}, the vocabulary of {} {}: use the \
                             tokenizer the model was trained with",
                            file.display(),
                            hf.vocab_size
                        )));
                    }
                    *c = LlamaConfig {
                        init_seed: c.init_seed,
                        ..hf
                    };
                } else {
                    c.vocab_used = (vocab > used).then_some(used);
                    c.n_layer = self.n_layer.unwrap_or(c.n_layer);
                    c.n_head = self.n_head.unwrap_or(c.n_head);
                    c.n_kv_head = self.n_kv_head.unwrap_or(c.n_kv_head.min(c.n_head));
                    if let Some(d) = self.n_embd {
                        // The SwiGLU width keeps the preset's ratio to the width.
                        c.ffn_hidden = c.ffn_hidden * d / c.d_model;
                        c.d_model = d;
                    }
                    c.block_size = self.block_size.unwrap_or(c.block_size);
                }
            }
        }
        model.validate()?;
        Ok(model)
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
        let dp = self.parallel.dp;
        if self.steps == 0 || self.batch_size == 0 {
            return Err(PretrainError::Config(
                "--steps and --batch-size must be at least 1".into(),
            ));
        }
        if self.accum == 0 || !self.batch_size.is_multiple_of(dp * self.accum) {
            return Err(PretrainError::Config(format!(
                "--batch-size {} does not split into --dp {dp} × --accum {} micro-batches: choose a multiple of {}",
                self.batch_size,
                self.accum,
                dp * self.accum
            )));
        }
        let pp = &self.parallel;
        if pp.pp > 1 {
            let m = pp.microbatches;
            if self.accum != 1 {
                return Err(PretrainError::Config(format!(
                    "--pp {}: the pipeline's micro-batches are its gradient accumulation: use \
                     --microbatches instead of --accum {}",
                    pp.pp, self.accum
                )));
            }
            if !self.batch_size.is_multiple_of(dp * m) {
                return Err(PretrainError::Config(format!(
                    "--batch-size {} does not split into --dp {dp} × --microbatches {m}: choose \
                     a multiple of {}",
                    self.batch_size,
                    dp * m
                )));
            }
            pp.schedule()?;
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
        let (world, tp) = (env.world_size, self.parallel.tp.max(1));
        if !dp_given && let Some(dp) = self.parallel.dims().data_degree_of(world) {
            self.parallel.dp = dp;
        }
        let mesh = self.parallel.world_size();
        if mesh != world {
            return Err(PretrainError::Config(format!(
                "{} started {world} processes, but --dp {} × --pp {} × --tp {tp} = {mesh} ranks: one process per rank (change --dp/--pp/--tp or the launcher's process count)",
                env.launcher, self.parallel.dp, self.parallel.pp
            )));
        }
        self.launch = Launch::of(Some(&env));
        Ok(())
    }
}

/// The default of `max_skipped` in run files and checkpoints that predate it.
fn twenty() -> usize {
    20
}
