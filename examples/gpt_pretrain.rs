//! Pretrain a GPT on one machine: ranks as threads, data parallel over `--dp`.
//!
//! ```text
//! cargo run --release --example gpt_pretrain                    # tiny GPT, embedded corpus
//! cargo run --release --example gpt_pretrain -- --data input.txt --tokenizer gpt2 --preset small
//! cargo run --release --example gpt_pretrain -- --config run.toml --steps 500   # flags win
//! ```

/// mimalloc, keeping freed memory for the next step (see `wildfire::alloc`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use anyhow::{Context, Result, bail};
use clap::{CommandFactory, FromArgMatches, Parser};
use std::path::PathBuf;
use wildfire::models::data::TokenizerKind;
use wildfire::models::gpt::Preset;
use wildfire::models::parallelize::{FsdpStrategy, ParallelConfig, Recompute, parse_fsdp};
use wildfire::pretrain::{Collectives, Launch, Precision, PretrainConfig, estimate, run};

/// Pretrain a GPT language model with Wildfire.
#[derive(Parser, Debug)]
#[command(version, about, args_override_self = true)]
struct Args {
    /// A TOML file of flag values (keys are the long flag names, `batch-size = 16`); flags given
    /// on the command line win.
    #[arg(long, help_heading = "Run")]
    config: Option<PathBuf>,
    /// Print the per-rank memory estimate and exit.
    #[arg(long, help_heading = "Run")]
    estimate: bool,
    /// Inner backend.
    #[arg(long, default_value = "flex", value_parser = ["flex", "wgpu", "cuda"], help_heading = "Run")]
    backend: String,
    /// What moves the training tensors between ranks: host (threads / MPI) or nccl (CUDA GPUs,
    /// one per rank; needs --backend cuda).
    #[arg(long, default_value = "host", value_parser = ["host", "nccl"], help_heading = "Run")]
    collectives: String,

    /// Model preset: tiny, small, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b.
    #[arg(long, default_value = "tiny", help_heading = "Model")]
    preset: Preset,
    /// Transformer blocks (overrides the preset).
    #[arg(long, help_heading = "Model")]
    n_layer: Option<usize>,
    /// Attention heads (overrides the preset).
    #[arg(long, help_heading = "Model")]
    n_head: Option<usize>,
    /// Model width (overrides the preset).
    #[arg(long, help_heading = "Model")]
    n_embd: Option<usize>,
    /// Context length (overrides the preset).
    #[arg(long, help_heading = "Model")]
    block_size: Option<usize>,
    /// Dropout probability while training (embeddings, attention, residual branches).
    #[arg(long, default_value_t = 0.0, help_heading = "Model")]
    dropout: f64,

    /// Training data: a text file, or a nanoGPT / llm.c `.bin` token file (default: the embedded corpus).
    #[arg(long, help_heading = "Data")]
    data: Option<PathBuf>,
    /// Tokenizer for text: bytes or gpt2 (GPT-2 BPE, offline).
    #[arg(long, default_value = "bytes", help_heading = "Data")]
    tokenizer: TokenizerKind,
    /// Fraction of the tokens held out for validation.
    #[arg(long, default_value_t = 0.1, help_heading = "Data")]
    val_fraction: f64,

    /// Total optimizer steps (with --resume: continue up to this step).
    #[arg(long, default_value_t = 300, help_heading = "Training")]
    steps: usize,
    /// Global batch: sequences per step over all data-parallel ranks.
    #[arg(long, default_value_t = 8, help_heading = "Training")]
    batch_size: usize,
    /// Gradient accumulation micro-batches per step.
    #[arg(long, default_value_t = 1, help_heading = "Training")]
    accum: usize,
    /// Peak learning rate (AdamW, β = (0.9, 0.95)).
    #[arg(long, default_value_t = 1e-3, help_heading = "Training")]
    lr: f64,
    /// Warmup steps (then cosine decay to lr/10).
    #[arg(long, default_value_t = 20, help_heading = "Training")]
    warmup: usize,
    /// Step where the cosine decay ends (default: --steps).
    #[arg(long, help_heading = "Training")]
    decay_steps: Option<usize>,
    /// AdamW weight decay.
    #[arg(long, default_value_t = 0.1, help_heading = "Training")]
    weight_decay: f64,
    /// Clip the global gradient norm to this (0: off).
    #[arg(long, default_value_t = 1.0, help_heading = "Training")]
    clip: f64,
    /// Seed of the data sampling (the weights' seed is part of the model).
    #[arg(long, default_value_t = 1337, help_heading = "Training")]
    seed: u64,

    /// Data-parallel ranks (threads).
    #[arg(
        long,
        default_value_t = 1,
        env = "WILDFIRE_DP",
        help_heading = "Parallelism"
    )]
    dp: usize,
    /// Tensor-parallel ranks.
    #[arg(long, default_value_t = 1, help_heading = "Parallelism")]
    tp: usize,
    /// Megatron sequence parallelism over the tensor-parallel ranks (needs --tp 2 or more).
    #[arg(long, help_heading = "Parallelism")]
    sp: bool,
    /// With --sp: keep the sequence all-gathers of the column-parallel layers' inputs for their
    /// backward (2 all-gathers + 2 reduce-scatters per block each way, 2·b·t·d more bytes per
    /// block) instead of gathering again (the default, as Megatron-LM).
    #[arg(long, help_heading = "Parallelism")]
    sp_keep_gathers: bool,
    /// Data-parallel strategy: none (DDP), zero1, grad-op, full (FSDP / ZeRO-3), hybrid (HSDP).
    #[arg(long, default_value = "none", value_parser = parse_fsdp, help_heading = "Parallelism")]
    fsdp: FsdpStrategy,
    /// HSDP: ranks per shard group (the dp / dp-shard groups replicate).
    #[arg(long, help_heading = "Parallelism")]
    dp_shard: Option<usize>,
    /// Compute precision: f32, bf16, f16.
    #[arg(long, default_value = "f32", help_heading = "Parallelism")]
    precision: Precision,
    /// The dtype data-parallel gradient reductions communicate in: f32, bf16 (half the bytes), f16.
    #[arg(long, default_value = "f32", help_heading = "Parallelism")]
    grad_reduce: Precision,
    /// Per-rank budget on tensor bytes (the decorator's accounting): a step over it fails, naming the rank.
    #[arg(long, help_heading = "Parallelism")]
    memory_budget: Option<u64>,
    /// Activation recomputation: none, selective, full, every-N.
    #[arg(long, default_value = "none", help_heading = "Parallelism")]
    recompute: Recompute,

    /// Evaluate every N steps (and at the end).
    #[arg(
        long,
        default_value_t = 50,
        help_heading = "Evaluation and checkpoints"
    )]
    eval_every: usize,
    /// Validation batches per evaluation.
    #[arg(long, default_value_t = 4, help_heading = "Evaluation and checkpoints")]
    eval_iters: usize,
    /// Checkpoint directory.
    #[arg(long, help_heading = "Evaluation and checkpoints")]
    save: Option<PathBuf>,
    /// Checkpoint every N steps (and at the end).
    #[arg(long, default_value_t = 0, help_heading = "Evaluation and checkpoints")]
    save_every: usize,
    /// Resume from a checkpoint directory.
    #[arg(long, help_heading = "Evaluation and checkpoints")]
    resume: Option<PathBuf>,

    /// Write one JSON object per step to this file.
    #[arg(long, help_heading = "Output")]
    metrics: Option<PathBuf>,
    /// A log line every N steps.
    #[arg(long, default_value_t = 10, help_heading = "Output")]
    log_every: usize,
    /// Peak FLOP/s of one rank's device (e.g. 9.9e14 for an H100's dense bf16), for the MFU
    /// column of the log line; without it the line has no MFU (a guessed peak would mislead).
    #[arg(long, help_heading = "Output")]
    peak_flops: Option<f64>,
    /// Tokens of text to generate at the end (0: none).
    #[arg(long, default_value_t = 300, help_heading = "Output")]
    sample_tokens: usize,
    /// Loss-curve PNG written at the end.
    #[arg(long, default_value = "loss.png", help_heading = "Output")]
    plot: PathBuf,
}

/// Read the TOML file as flags placed before the real ones (so the real ones win).
fn args_with_config() -> Result<Args> {
    let argv: Vec<String> = std::env::args().collect();
    let first = Args::command()
        .try_get_matches_from(&argv)
        .map(|m| Args::from_arg_matches(&m));
    let args = match first {
        Ok(Ok(a)) => a,
        Ok(Err(e)) | Err(e) => e.exit(),
    };
    let Some(path) = &args.config else {
        return Ok(args);
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading --config {}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .with_context(|| format!("{} is not valid TOML", path.display()))?;
    let mut merged = vec![argv[0].clone()];
    for (key, value) in table {
        let flag = format!("--{}", key.replace('_', "-"));
        match value {
            toml::Value::Boolean(true) => merged.push(flag),
            toml::Value::Boolean(false) => {}
            toml::Value::String(s) => merged.extend([flag, s]),
            toml::Value::Integer(i) => merged.extend([flag, i.to_string()]),
            toml::Value::Float(f) => merged.extend([flag, f.to_string()]),
            other => bail!(
                "{}: key '{key}' has an unsupported value {other}",
                path.display()
            ),
        }
    }
    merged.extend(argv[1..].iter().cloned());
    Args::try_parse_from(merged).map_err(|e| e.exit())
}

fn main() -> Result<()> {
    wildfire::alloc::keep_freed_memory();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = args_with_config()?;
    let launch = launcher_environment(&args)?;
    let config = PretrainConfig {
        preset: args.preset,
        n_layer: args.n_layer,
        n_head: args.n_head,
        n_embd: args.n_embd,
        block_size: args.block_size,
        dropout: args.dropout,
        data: args.data.clone(),
        tokenizer: args.tokenizer,
        val_fraction: args.val_fraction,
        steps: args.steps,
        batch_size: args.batch_size,
        accum: args.accum,
        lr: args.lr,
        warmup: args.warmup,
        decay_steps: args.decay_steps,
        weight_decay: args.weight_decay,
        clip: args.clip,
        seed: args.seed,
        parallel: ParallelConfig {
            dp: args.dp,
            tp: args.tp,
            sp: args.sp,
            sp_keep_gathers: args.sp_keep_gathers,
            fsdp: args.fsdp,
            dp_shard: args.dp_shard,
            recompute: args.recompute,
        },
        precision: args.precision,
        grad_reduce: args.grad_reduce,
        memory_budget: args.memory_budget,
        eval_every: args.eval_every,
        eval_iters: args.eval_iters,
        save: args.save.clone(),
        save_every: args.save_every,
        resume: args.resume.clone(),
        metrics: args.metrics.clone(),
        log_every: args.log_every,
        peak_flops: args.peak_flops,
        sample_tokens: args.sample_tokens,
        plot: Some(args.plot.clone()),
        progress: true,
        launch,
        collectives: match args.collectives.as_str() {
            "nccl" => Collectives::Nccl,
            _ => Collectives::Host,
        },
    };
    tracing::info!("config: {}", serde_json::to_string(&config)?);
    if args.estimate {
        let vocab = match args.tokenizer {
            TokenizerKind::Bytes => 256,
            TokenizerKind::Gpt2 => 50257,
        };
        let model = config.model(vocab)?;
        let e = estimate(&config, &model);
        println!("{}", serde_json::to_string_pretty(&e)?);
        return Ok(());
    }
    let summary = match args.backend.as_str() {
        "flex" => run(&config)?,
        #[cfg(feature = "wgpu")]
        "wgpu" => wildfire::pretrain::run_on::<burn::backend::Wgpu>(&config, &Default::default())?,
        #[cfg(feature = "cuda")]
        "cuda" => run_cuda(&config)?,
        other => bail!(
            "--backend {other} is not compiled in: cargo run --release --features {other} --example gpt_pretrain -- --backend {other}"
        ),
    };
    if summary.rank != 0 {
        // Another process of an MPI job: rank 0 reports.
        return Ok(());
    }
    if let Some(last) = summary.steps.last() {
        println!(
            "final: step {} loss {:.4} val_loss {}",
            last.step,
            last.loss,
            last.val_loss.map_or("-".into(), |v| format!("{v:.4}"))
        );
    }
    if !summary.sample.is_empty() {
        println!("--- sample ---\n{}\n--------------", summary.sample);
    }
    println!("loss curve: {}", args.plot.display());
    Ok(())
}

/// torchrun, SLURM and Open MPI variables, resolved once: a world of several processes runs
/// this process as one rank of an MPI job (`mpirun -np N` / `srun`, feature `mpi`).
fn launcher_environment(args: &Args) -> Result<Launch> {
    let var = |names: &[&str]| {
        names
            .iter()
            .find_map(|n| std::env::var(n).ok().map(|v| (n.to_string(), v)))
    };
    let world = var(&[
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "SLURM_NTASKS",
        "WORLD_SIZE",
    ]);
    let rank = var(&["OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "RANK"]);
    let Some((name, value)) = &world else {
        return Ok(Launch::Threads);
    };
    tracing::info!(launcher_world = %value, from = %name, rank = ?rank, "launcher environment");
    let size: usize = value
        .parse()
        .with_context(|| format!("{name}={value} is not a number"))?;
    if size <= 1 {
        return Ok(Launch::Threads);
    }
    let mesh = args.dp * args.tp;
    if name == "WORLD_SIZE" {
        // torchrun-style: no MPI; NCCL on CUDA, bootstrapped at MASTER_ADDR:MASTER_PORT.
        if args.backend != "cuda" || args.collectives != "nccl" || !cfg!(feature = "cuda") {
            bail!(
                "WORLD_SIZE={size} (a torchrun-style launch): without MPI the ranks need NCCL: \
                 a binary built with --features cuda, run with --backend cuda --collectives nccl; \
                 or run mpirun -np {size} (or srun) with a binary built with --features mpi"
            );
        }
        if size != mesh {
            bail!(
                "WORLD_SIZE={size} processes, but --dp {} × --tp {} = {mesh} ranks: one process per rank",
                args.dp,
                args.tp
            );
        }
        return Ok(Launch::Rendezvous);
    }
    if size != mesh {
        bail!(
            "{name}={size} processes, but --dp {} × --tp {} = {mesh} ranks: one process per rank (mpirun -np {mesh}, or change --dp/--tp)",
            args.dp,
            args.tp
        );
    }
    if cfg!(feature = "mpi") {
        Ok(Launch::Mpi)
    } else {
        bail!(
            "{name}={size}: this binary was built without MPI; build it with --features mpi (needs Open MPI and libclang) and run it under mpirun again"
        )
    }
}

/// `--backend cuda`: with `--collectives nccl`, every rank installs NCCL on its GPU first.
#[cfg(feature = "cuda")]
fn run_cuda(config: &PretrainConfig) -> Result<wildfire::pretrain::RunSummary> {
    type Cuda = burn::backend::Cuda;
    let device = Default::default();
    if config.collectives == Collectives::Host {
        return Ok(wildfire::pretrain::run_on::<Cuda>(config, &device)?);
    }
    #[cfg(not(feature = "fusion"))]
    {
        use wildfire::parallel::{DistDevice, NcclCommunicator, launch_ranks_rendezvous};
        use wildfire::pretrain::{RankBody, RankHooks, run_on_with};
        // Ranks as threads or MPI processes: NCCL over the host communicator's bootstrap.
        let setup = |d: &DistDevice<Cuda>| {
            NcclCommunicator::install(d, Default::default())
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        // A torchrun-style process: NCCL is the only communicator.
        let launch = |mesh: &wildfire::parallel::DeviceMesh, body: &mut RankBody<'_, Cuda>| {
            launch_ranks_rendezvous(mesh, &Default::default(), body).map_err(|e| e.to_string())
        };
        let hooks = match config.launch {
            Launch::Rendezvous => RankHooks {
                setup: None,
                launch: Some(&launch),
            },
            _ => RankHooks {
                setup: Some(&setup),
                launch: None,
            },
        };
        Ok(run_on_with::<Cuda>(config, &device, &hooks)?)
    }
    #[cfg(feature = "fusion")]
    bail!(
        "--collectives nccl runs on Burn's CUDA backend without operation fusion: build without --features fusion"
    )
}
