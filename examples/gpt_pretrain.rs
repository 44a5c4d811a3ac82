//! Pretrain a GPT on one machine: ranks as threads, data parallel over `--dp`.
//!
//! ```text
//! cargo run --release --example gpt_pretrain                    # tiny GPT, embedded corpus
//! cargo run --release --example gpt_pretrain -- --data input.txt --tokenizer gpt2 --preset small
//! cargo run --release --example gpt_pretrain -- --config run.toml --steps 500   # flags win
//! ```

/// mimalloc, keeping freed memory for the next step, or `WILDFIRE_ALLOC=system` (see
/// `wildfire::alloc`).
#[global_allocator]
static GLOBAL: wildfire::alloc::Allocator = wildfire::alloc::Allocator;

mod common;

use anyhow::{Context, Result, bail};
use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser};
use wildfire::parallel::LaunchEnv;
use wildfire::pretrain::{PlanMode, PretrainConfig, estimate, load_data, plan_on, run};

/// Pretrain a GPT language model with Wildfire.
#[derive(Parser, Debug)]
#[command(version, about, args_override_self = true)]
struct Args {
    /// A TOML file of flag values (keys are the long flag names, `batch-size = 16`); flags given
    /// on the command line win.
    #[arg(long, help_heading = "Run")]
    config: Option<std::path::PathBuf>,
    /// Print the per-rank memory estimate and exit; with `--plan auto`, the planner's candidates
    /// for `--memory-budget` (each measured, see `--plan`) and its choice.
    #[arg(long, help_heading = "Run")]
    estimate: bool,
    /// Print the pipeline schedule of `--pp`, `--pp-schedule`, `--microbatches` and
    /// `--pp-virtual` as a table (a row per pipeline rank, a column per time unit with forward =
    /// input gradient = weight gradient = 1, each rank's bubble) and exit.
    #[arg(long, help_heading = "Pipeline")]
    pp_schedule_dump: bool,
    /// With --pp-schedule-dump: also draw the schedule's timeline as an SVG picture here.
    #[arg(long, value_name = "FILE", help_heading = "Pipeline")]
    pp_svg: Option<std::path::PathBuf>,
    /// Inner backend.
    #[arg(long, default_value = "flex", value_parser = ["flex", "wgpu", "cuda"], help_heading = "Run")]
    backend: String,
    /// The run: every flag of `PretrainConfig` (its defaults are the library's).
    #[command(flatten)]
    run: PretrainConfig,
}

/// Read the TOML file as flags placed before the real ones (so the real ones win).
fn args_with_config() -> Result<(Args, ArgMatches)> {
    let argv: Vec<String> = std::env::args().collect();
    let parse = |argv: &[String]| {
        let matches = Args::command()
            .try_get_matches_from(argv)
            .unwrap_or_else(|e| e.exit());
        let args = Args::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
        (args, matches)
    };
    let (args, matches) = parse(&argv);
    let Some(path) = &args.config else {
        return Ok((args, matches));
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
    Ok(parse(&merged))
}

fn main() -> Result<()> {
    common::init("info");
    let (args, matches) = args_with_config()?;
    let mut config = args.run.clone();
    // mpirun / srun / torchrun: this process is one rank; --dp defaults to the launched world.
    let dp_given = matches.value_source("dp") != Some(ValueSource::DefaultValue);
    config.apply_launcher(LaunchEnv::detect()?, dp_given)?;
    if args.pp_schedule_dump {
        use wildfire::parallel::pipeline::Costs;
        let schedule = config.parallel.schedule()?;
        print!("{}", schedule.table()?);
        if let Some(path) = &args.pp_svg {
            std::fs::write(path, schedule.svg(&Costs::default())?)
                .with_context(|| format!("writing {}", path.display()))?;
            println!("timeline: {}", path.display());
        }
        return Ok(());
    }
    tracing::info!("config: {}", serde_json::to_string(&config)?);
    if args.estimate && config.plan == PlanMode::Auto {
        let plan = match args.backend.as_str() {
            "flex" => plan_on::<burn::backend::Flex>(&config, &Default::default())?,
            #[cfg(feature = "wgpu")]
            "wgpu" => plan_on::<burn::backend::Wgpu>(&config, &Default::default())?,
            other => bail!("--estimate --plan auto measures on flex or wgpu, not {other}"),
        };
        // Under a launcher every process plans the same; the first reports.
        if LaunchEnv::detect()?.is_none_or(|env| env.rank == 0) {
            print!("{}", plan.table());
            println!("chosen: {}", plan.choice().candidate.flags());
        }
        return Ok(());
    }
    if args.estimate {
        let model = load_data(&config)?.model;
        println!(
            "{}",
            serde_json::to_string_pretty(&estimate(&config, &model))?
        );
        return Ok(());
    }
    let summary = match args.backend.as_str() {
        "flex" => run(&config)?,
        #[cfg(feature = "wgpu")]
        "wgpu" => wildfire::pretrain::run_on::<burn::backend::Wgpu>(&config, &Default::default())?,
        #[cfg(feature = "cuda")]
        "cuda" => wildfire::pretrain::run_cuda(&config)?,
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
    if let Some(loss) = summary.val_loss {
        println!("final: no step trained, val_loss {loss:.4}");
    }
    println!("{}", summary.wall);
    for (i, r) in summary.restarts.iter().enumerate() {
        println!(
            "restart {}: rank(s) {:?} lost after step {} ({:?} replaced), --dp {} → {} \
             (micro-batches {} → {}), resumed from step {} ({}): lost {:.2} s (detect {:.2} s, \
             re-form {:.2} s, reload {:.2} s) and {} steps trained again",
            i + 1,
            r.lost_ranks,
            r.failed_at,
            r.replaced,
            r.dp[0],
            r.dp[1],
            r.micro_batches[0],
            r.micro_batches[1],
            r.resumed_from,
            if r.from_memory {
                "in memory"
            } else {
                "on disk"
            },
            r.lost(),
            r.detect,
            r.reform,
            r.reload,
            r.redone_steps()
        );
    }
    if !summary.sample.is_empty() {
        println!("--- sample ---\n{}\n--------------", summary.sample);
    }
    // A run that trained no step (`--steps 0`) draws no curve and logs no step.
    if let Some(plot) = config.plot.as_ref().filter(|_| !summary.steps.is_empty()) {
        println!("loss curve: {}", plot.display());
    }
    if let Some(metrics) = config
        .metrics
        .as_ref()
        .filter(|_| !summary.steps.is_empty())
    {
        println!("metrics: {}", metrics.display());
    }
    tracing::debug!(
        allocator = wildfire::alloc::allocator_name(),
        large_blocks = ?wildfire::alloc::large_block_stats(),
        "allocator"
    );
    Ok(())
}
