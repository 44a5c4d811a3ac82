//! Burn's own training loop, sharded: a classifier in the Burn Book's style (`wildfire::learner::
//! glyphs`: 8×8 glyphs of ten classes, generated, nothing downloaded) trained with burn-train's
//! `Learner` on one device, then — the same program with the backend type swapped, the model
//! laid out and the loader sharded — FSDP over `--dp` ranks. Prints both loss curves.
//!
//! ```text
//! cargo run --release --features learner --example learner_fsdp -- --dp 2 --epochs 3
//! # ranks as MPI processes (one per rank):
//! cargo build --release --features learner,mpi --example learner_fsdp
//! mpirun -np 2 target/release/examples/learner_fsdp --dp 2
//! ```

/// mimalloc, keeping freed memory for the next step (see `wildfire::alloc`).
#[global_allocator]
static GLOBAL: wildfire::alloc::Allocator = wildfire::alloc::Allocator;

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::DataLoaderBuilder;
use burn::optim::AdamWConfig;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{Learner, SupervisedTraining};
use clap::Parser;
use wildfire::demo::deterministic_init;
use wildfire::learner::glyphs::{GlyphBatcher, GlyphClassifierConfig, GlyphDataset};
use wildfire::learner::{LearnerRank, LossHistory, Quiet, Sharded, ShardedLoader};
use wildfire::parallel::{
    DeviceMesh, FsdpStrategy, Group, LaunchEnv, LaunchOptions, ReduceOp, fully_shard,
};

/// Train the glyph classifier with burn-train's Learner on one device and with FSDP.
#[derive(Parser, Debug, Clone)]
#[command(version, about)]
struct Args {
    /// Data-parallel ranks of the FSDP run (threads, or MPI processes under mpirun).
    #[arg(long, default_value_t = 2)]
    dp: usize,
    /// Epochs.
    #[arg(long, default_value_t = 3)]
    epochs: usize,
    /// Training glyphs (the epoch's steps: rows / global batch).
    #[arg(long, default_value_t = 1024)]
    rows: usize,
    /// Rows per step over all ranks.
    #[arg(long, default_value_t = 32)]
    global_batch: usize,
    /// AdamW's learning rate.
    #[arg(long, default_value_t = 1e-2)]
    lr: f64,
    /// Where the Learners write (metric logs of rank 0, checkpoints with --save).
    #[arg(long, default_value = "learner-fsdp")]
    dir: PathBuf,
    /// Save a distributed checkpoint at every epoch's end (under DIR/checkpoints).
    #[arg(long)]
    save: bool,
    /// Continue the FSDP run from the checkpoint of this epoch (with --save's directory).
    #[arg(long)]
    resume: Option<usize>,
    /// Show burn-train's own progress display on rank 0 (its CLI renderer prints every item).
    #[arg(long)]
    burn_progress: bool,
}

const SEED: u64 = 5;

fn main() -> Result<()> {
    common::init("error");
    let args = Args::parse();
    let env = LaunchEnv::detect()?;
    let mpi = env.is_some_and(|e| e.world_size > 1);
    // 1. One device: Autodiff<Flex>, the Learner as the Burn Book runs it (in process 0 only
    //    under MPI).
    let reference = env.is_none_or(|e| e.rank == 0).then(|| one_device(&args));
    // 2. FSDP: Autodiff<Distributed<Flex>>, ranks as threads or MPI processes.
    let mesh = DeviceMesh::new([("dp", args.dp)])?;
    let options = LaunchOptions::default();
    let curves = if mpi {
        launch_mpi(&mesh, &options, &args)?
    } else {
        let mut all = wildfire::parallel::launch_ranks::<Flex, _, _>(
            &mesh,
            &Default::default(),
            &options,
            |device| fsdp_rank(&args, &mesh, LearnerRank::new(device)),
        )?;
        Some(all.remove(0)?)
    };
    let (Some((train, valid)), Some((one_train, one_valid))) = (curves, reference) else {
        return Ok(()); // an MPI process other than 0
    };
    println!(
        "burn-train's Learner: one device (Autodiff<Flex>) vs FSDP over {} ranks \
         (Autodiff<Distributed<Flex>>), global batch {}",
        args.dp, args.global_batch
    );
    println!("step | one device | FSDP dp={} | difference", args.dp);
    let skip = one_train.len() - train.len(); // a resumed run starts later
    let mut worst = 0f64;
    for (i, (&a, &b)) in one_train[skip..].iter().zip(&train).enumerate() {
        worst = worst.max((a - b).abs());
        println!("{:4} | {a:10.6} | {b:9.6} | {:+.2e}", skip + i, b - a);
    }
    // (Validation batches of one epoch: the one-device run validates every epoch.)
    let batches = (one_valid.len() / args.epochs.max(1)).max(1);
    let per_epoch = |v: &[f64]| -> Vec<f64> {
        v.chunks(batches)
            .map(|c| c.iter().sum::<f64>() / c.len() as f64)
            .collect()
    };
    println!(
        "validation loss per epoch, one device: {:.6?}",
        per_epoch(&one_valid)
    );
    println!(
        "validation loss per epoch, FSDP:       {:.6?}{}",
        per_epoch(&valid),
        if skip > 0 {
            " (the epochs after the resume)"
        } else {
            ""
        }
    );
    println!("largest difference in the training loss: {worst:.2e}");
    println!("curve: {train:?}");
    Ok(())
}

/// The validation loader: the whole validation set on every rank.
fn valid_rows() -> GlyphDataset {
    GlyphDataset::new(256, 2)
}

/// Every step's training loss and every validation batch's loss of the one-device Learner.
fn one_device(args: &Args) -> (Vec<f64>, Vec<f64>) {
    type B = Autodiff<Flex>;
    let device = Default::default();
    let model = deterministic_init(GlyphClassifierConfig::new().init::<B>(&device), 1);
    // The sampler of one rank: the order the FSDP run's global batches follow.
    let train = ShardedLoader::new(
        GlyphBatcher,
        GlyphDataset::new(args.rows, 1),
        args.global_batch,
        SEED,
        0,
        1,
        device,
    )
    .expect("a global batch of the dataset");
    let valid = DataLoaderBuilder::new(GlyphBatcher)
        .batch_size(64)
        .build(valid_rows());
    let (train_loss, valid_loss) = (
        LossHistory::new("Loss (steps)"),
        LossHistory::new("Loss (steps)"),
    );
    let training = SupervisedTraining::new(args.dir.join("one-device"), Arc::new(train), valid)
        .metrics((AccuracyMetric::new(), LossMetric::new()))
        .metric_train_numeric(train_loss.clone())
        .metric_valid_numeric(valid_loss.clone())
        .with_application_logger(None)
        .renderer(Quiet)
        .num_epochs(args.epochs);
    training.launch(Learner::new(model, AdamWConfig::new().init(), args.lr));
    (train_loss.values(), valid_loss.values())
}

/// One FSDP rank: the same program on `Sharded<Flex>`, the model fully sharded, the training
/// loader sharded, `rank.launch`. Returns the global loss of every step (the mean of the ranks'
/// losses, one all-reduce) and rank 0's validation losses.
fn fsdp_rank(
    args: &Args,
    mesh: &DeviceMesh,
    rank: LearnerRank<Flex>,
) -> Result<(Vec<f64>, Vec<f64>)> {
    type B = Sharded<Flex>;
    let mut rank = rank;
    if args.save || args.resume.is_some() {
        rank = rank.with_checkpoints(args.dir.join("checkpoints"));
    }
    if let Some(epoch) = args.resume {
        rank = rank.resume_from(epoch);
    }
    let device = rank.device().clone();
    let model = deterministic_init(GlyphClassifierConfig::new().init::<B>(&device), 1);
    let model = fully_shard(model, mesh, FsdpStrategy::FullShard)?;
    let train = rank.loader(
        GlyphBatcher,
        GlyphDataset::new(args.rows, 1),
        args.global_batch,
        SEED,
    )?;
    let valid = DataLoaderBuilder::new(GlyphBatcher)
        .batch_size(64)
        .set_device(device.clone())
        .build(valid_rows());
    let (train_loss, valid_loss) = (
        LossHistory::new("Loss (steps)"),
        LossHistory::new("Loss (steps)"),
    );
    let mut training = SupervisedTraining::new(args.dir.join("fsdp"), train, valid)
        .metrics((AccuracyMetric::new(), LossMetric::new()))
        .metric_train_numeric(train_loss.clone())
        .metric_valid_numeric(valid_loss.clone())
        .with_application_logger(None)
        .num_epochs(args.epochs);
    if !args.burn_progress {
        training = training.renderer(Quiet);
    }
    rank.launch(training, model, AdamWConfig::new().init(), args.lr)?;
    // The loss of each step over the whole global batch: the ranks' losses averaged.
    let local: Vec<f32> = train_loss.values().iter().map(|&v| v as f32).collect();
    let n = local.len();
    let global = device
        .context()
        .comm()
        .all_reduce(
            Group::World,
            burn::tensor::TensorData::new(local, [n]),
            ReduceOp::Avg,
        )
        .context("averaging the ranks' losses")?;
    let global = global
        .to_vec::<f32>()
        .expect("f32")
        .iter()
        .map(|&v| f64::from(v))
        .collect();
    Ok((global, valid_loss.values()))
}

#[cfg(feature = "mpi")]
fn launch_mpi(
    mesh: &DeviceMesh,
    options: &LaunchOptions,
    args: &Args,
) -> Result<Option<(Vec<f64>, Vec<f64>)>> {
    let mut rank = 0;
    let curves = wildfire::parallel::launch_ranks_mpi::<Flex, _, _, _>(
        mesh,
        |_| Default::default(),
        options,
        |device| {
            rank = device.rank();
            fsdp_rank(args, mesh, LearnerRank::new(device))
        },
    )??;
    Ok((rank == 0).then_some(curves))
}

#[cfg(not(feature = "mpi"))]
fn launch_mpi(_: &DeviceMesh, _: &LaunchOptions, _: &Args) -> Result<Option<(Vec<f64>, Vec<f64>)>> {
    anyhow::bail!(
        "started by an MPI launcher, but built without MPI: cargo build --features learner,mpi \
         --example learner_fsdp"
    )
}
