//! Decorator overhead at world size 1: one training step of a small stock transformer on
//! `Autodiff<Flex>` and on `Autodiff<Distributed<Flex>>`, measured alternately in one process
//! (the machines are shared and noisy: only the ratio of interleaved runs means anything); then
//! the cost of one elementwise op on a small tensor (`x * x`, 64 elements) through Flex,
//! `Distributed<Flex>`, `Autodiff<Flex>` and `Autodiff<Distributed<Flex>>` (the autodiff ones on
//! a tracked tensor, so the graph bookkeeping is in). `benches/cpu_vs_pytorch.sh` prints
//! PyTorch's cost of the same op beside it.
//!
//! ```text
//! cargo bench --bench overhead [-- --rounds 15 --steps 5 --ops 200000]
//! ```

use burn::backend::{Autodiff, Flex};
use burn::optim::SgdConfig;
use burn::optim::momentum::MomentumConfig;
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use std::time::{Duration, Instant};
use wildfire::demo::{
    EncoderClassifier, EncoderClassifierConfig, SyntheticTask, deterministic_init, train,
};
use wildfire::parallel::Distributed;

mod common;

struct Runner<B: AutodiffBackend> {
    model: Option<EncoderClassifier<B>>,
    device: B::Device,
}

impl<B: AutodiffBackend> Runner<B> {
    fn new(config: &EncoderClassifierConfig) -> Self {
        let device = Default::default();
        Self {
            model: Some(deterministic_init(config.init::<B>(&device), 1)),
            device,
        }
    }

    /// Time `steps` training steps (the optimizer is rebuilt per call; its state is small).
    fn time(&mut self, task: &SyntheticTask, steps: usize, batch: usize) -> Duration {
        let mut optim = SgdConfig::new()
            .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
            .init();
        let start = Instant::now();
        let (model, log) = train(
            self.model.take().unwrap(),
            &mut optim,
            task,
            steps,
            0.01,
            0..batch,
            &self.device,
            |_, _| {},
        );
        let elapsed = start.elapsed();
        assert!(log.losses.iter().all(|l| l.is_finite()));
        self.model = Some(model);
        elapsed / steps as u32
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Nanoseconds per `x * x` on a 64-element tensor, the median of 5 runs of `ops` ops; `track`
/// makes `x` tracked (autodiff backends record a graph node per op).
fn per_op<B: Backend>(ops: usize, track: impl Fn(Tensor<B, 1>) -> Tensor<B, 1>) -> f64 {
    let x = track(Tensor::<B, 1>::ones([64], &Default::default()));
    let mut runs: Vec<f64> = (0..5)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..ops {
                std::hint::black_box(x.clone() * x.clone());
            }
            start.elapsed().as_secs_f64() * 1e9 / ops as f64
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    runs[2]
}

fn main() {
    // A smoke run (`cargo test --all-targets`): one round of one step.
    let smoke = common::smoke();
    let rounds = if smoke {
        1
    } else {
        common::arg("--rounds").unwrap_or(15)
    };
    let steps = if smoke {
        1
    } else {
        common::arg("--steps").unwrap_or(5)
    };
    let batch = common::arg("--batch").unwrap_or(16);
    let config = EncoderClassifierConfig::new()
        .with_d_input(16)
        .with_d_model(64)
        .with_n_heads(4)
        .with_n_layers(2)
        .with_d_ff(256)
        .with_n_classes(8);
    let task = SyntheticTask {
        seq: 32,
        d_input: 16,
        classes: 8,
        seed: 3,
    };
    let mut plain = Runner::<Autodiff<Flex>>::new(&config);
    let mut dist = Runner::<Autodiff<Distributed<Flex>>>::new(&config);
    // Warm up both.
    plain.time(&task, 2, batch);
    dist.time(&task, 2, batch);
    let (mut tp, mut td, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        // Alternate which goes first, so drift in machine load hits both alike.
        let (a, b) = if round % 2 == 0 {
            let a = plain.time(&task, steps, batch);
            (a, dist.time(&task, steps, batch))
        } else {
            let b = dist.time(&task, steps, batch);
            (plain.time(&task, steps, batch), b)
        };
        ratios.push(b.as_secs_f64() / a.as_secs_f64());
        tp.push(a);
        td.push(b);
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "training step, transformer d_model=64 layers=2 seq=32 batch={batch}, {rounds} rounds × {steps} steps, alternating"
    );
    println!("Autodiff<Flex>               median {:?}", median(tp));
    println!("Autodiff<Distributed<Flex>>  median {:?}", median(td));
    println!(
        "ratio distributed / plain: median {:.3} (min {:.3}, max {:.3}); target <= 1.03",
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1]
    );
    let ops = if smoke {
        100
    } else {
        common::arg("--ops").unwrap_or(200_000)
    };
    println!("one op (x * x, 64 f32 elements), median of 5 × {ops} ops:");
    let plain = per_op::<Flex>(ops, |x| x);
    println!("Flex                         {plain:8.0} ns/op");
    let dist = per_op::<Distributed<Flex>>(ops, |x| x);
    println!("Distributed<Flex>            {dist:8.0} ns/op");
    let ad = per_op::<Autodiff<Flex>>(ops, |x| x.require_grad());
    println!("Autodiff<Flex>               {ad:8.0} ns/op (tracked)");
    let add = per_op::<Autodiff<Distributed<Flex>>>(ops, |x| x.require_grad());
    println!("Autodiff<Distributed<Flex>>  {add:8.0} ns/op (tracked)");
}
