//! The backend swap: a stock burn-nn `TransformerEncoder` classifier trained on `Autodiff<Flex>`,
//! then — the same code, with the backend type and one sharding call changed — data parallel on
//! `Autodiff<Distributed<Flex>>`, ranks as threads. Prints both loss curves side by side.
//!
//! ```text
//! cargo run --release --example backend_swap -- --dp 2 --steps 30
//! ```

/// mimalloc, keeping freed memory for the next step, or `WILDFIRE_ALLOC=system` (see
/// `wildfire::alloc`).
#[global_allocator]
static GLOBAL: wildfire::alloc::Allocator = wildfire::alloc::Allocator;

mod common;

use anyhow::{Context, Result};
use burn::backend::{Autodiff, Flex};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::backend::AutodiffBackend;
use clap::Parser;
use std::ops::Range;
use wildfire::demo::{
    EncoderClassifier, EncoderClassifierConfig, SyntheticTask, TrainLog, deterministic_init, train,
};
use wildfire::parallel::{
    DeviceMesh, Distributed, LaunchOptions, launch_ranks, replicate, sync_gradients,
};

/// Train the same stock model on one device and data parallel, and compare.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Training steps.
    #[arg(long, default_value_t = 30)]
    steps: usize,
    /// Data-parallel ranks (threads) for the distributed run.
    #[arg(long, default_value_t = 2)]
    dp: usize,
    /// Global batch (sequences per step, split over the ranks).
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Learning rate (SGD with momentum 0.9).
    #[arg(long, default_value_t = 0.05)]
    lr: f64,
}

fn main() -> Result<()> {
    common::init("error");
    let args = Args::parse();
    anyhow::ensure!(
        args.batch % args.dp == 0,
        "--batch {} does not split over --dp {}: choose a batch that is a multiple of the ranks",
        args.batch,
        args.dp
    );

    // 1. One device: type B = Autodiff<Flex>.
    type B = Autodiff<Flex>;
    let plain = train_encoder::<B>(&args, 0..args.batch, &Default::default(), |m| m, |_, _| {});

    // 2. Data parallel: type B = Autodiff<Distributed<Flex>>, plus `replicate` and `sync_gradients`.
    type D = Autodiff<Distributed<Flex>>;
    let mesh = DeviceMesh::new([("dp", args.dp)])?;
    let per_rank = args.batch / args.dp;
    let logs = launch_ranks::<Flex, _, _>(
        &mesh,
        &Default::default(),
        &LaunchOptions::default(),
        |device| {
            let rows = device.rank() * per_rank..(device.rank() + 1) * per_rank;
            let log = train_encoder::<D>(
                &args,
                rows,
                &device,
                |m| replicate(m, &mesh).expect("replicate"),
                |m, g| {
                    sync_gradients(m, g).expect("sync_gradients");
                },
            );
            (log, device.context().comm().stats())
        },
    )
    .context("distributed run failed")?;

    println!(
        "step | Autodiff<Flex> | Autodiff<Distributed<Flex>> dp={} | difference",
        args.dp
    );
    let mut worst = 0.0f32;
    for step in 0..args.steps {
        let dist = logs.iter().map(|(log, _)| log.losses[step]).sum::<f32>() / args.dp as f32;
        let diff = dist - plain.losses[step];
        worst = worst.max(diff.abs());
        println!(
            "{step:4} | {:14.6} | {:32.6} | {diff:+.2e}",
            plain.losses[step], dist
        );
    }
    println!("largest difference: {worst:.2e}");
    println!(
        "rank 0 communication over {} steps:\n{}",
        args.steps, logs[0].1
    );
    Ok(())
}

/// The training code of both runs, generic over the backend: the stock model, SGD with momentum
/// 0.9 on `rows` of the task; `place` is the one sharding call (none on one device) and `sync` the
/// one gradient hook, between backward and the optimizer step.
fn train_encoder<B: AutodiffBackend>(
    args: &Args,
    rows: Range<usize>,
    device: &B::Device,
    place: impl FnOnce(EncoderClassifier<B>) -> EncoderClassifier<B>,
    sync: impl FnMut(&EncoderClassifier<B>, &mut GradientsParams),
) -> TrainLog {
    let task = SyntheticTask {
        seq: 8,
        d_input: 4,
        classes: 3,
        seed: 7,
    };
    let model = place(deterministic_init(
        EncoderClassifierConfig::new().init::<B>(device),
        1,
    ));
    let mut sgd = SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
        .init();
    let (_, log) = train(
        model, &mut sgd, &task, args.steps, args.lr, rows, device, sync,
    );
    log
}
