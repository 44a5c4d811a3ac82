//! Decorator overhead at world size 1: one training step of a small stock transformer on
//! `Autodiff<Flex>` and on `Autodiff<Distributed<Flex>>`, measured alternately in one process
//! (the machines are shared and noisy: only the ratio of interleaved runs means anything); then
//! the cost of one elementwise op on a small tensor (`x * x`, 64 elements) through Flex,
//! `Distributed<Flex>`, `Autodiff<Flex>` and `Autodiff<Distributed<Flex>>` (the autodiff ones on
//! a tracked tensor, so the graph bookkeeping is in; the two measured in alternating pairs, their
//! difference per pair reported). `benches/cpu_vs_pytorch.sh` prints
//! PyTorch's cost of the same op beside it.
//!
//! ```text
//! cargo bench --bench overhead [-- --rounds 15 --steps 5 --ops 200000 --pairs 15 --only step|ops|alloc]
//! ```
//!
//! `--only alloc` measures the allocator itself: a small block allocated and freed (64–127
//! bytes, 16 held at a time, as a step's metadata and closures are) through the global allocator
//! — mimalloc plus `wildfire::alloc`'s heap counting — against mimalloc called directly, on one
//! thread and on two at once (a rank and CubeCL's device thread allocate concurrently), in
//! alternating pairs.
//!
//! Both stacks allocate through the allocator `gpt_pretrain` and the other benches use
//! (`wildfire::alloc`: mimalloc for small blocks); `WILDFIRE_ALLOC=system` measures them on
//! glibc's malloc instead.

/// mimalloc, keeping freed memory, or `WILDFIRE_ALLOC=system` (see `wildfire::alloc`).
#[global_allocator]
static GLOBAL: wildfire::alloc::Allocator = wildfire::alloc::Allocator;

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

/// Nanoseconds per `x * x` on a 64-element tensor, the median of 5 runs of `ops` ops.
fn per_op<B: Backend>(ops: usize) -> f64 {
    let x = Tensor::<B, 1>::ones([64], &Default::default());
    median_ns(ops, || {
        for _ in 0..ops {
            std::hint::black_box(x.clone() * x.clone());
        }
    })
}

/// Ops per graph of [`per_tracked_op`].
const CHAIN: usize = 32;

/// Nanoseconds per tracked op as a training step pays it: chains of [`CHAIN`] products
/// `y = y * x` of a tracked 64-element `x`, each chain summed and taken backward (the graph built,
/// used and freed), the median of 5 runs of `ops` ops; the sum counts as an op.
fn per_tracked_op<B: AutodiffBackend>(ops: usize) -> f64 {
    let mut runs: Vec<f64> = (0..5).map(|_| tracked_run::<B>(ops)).collect();
    runs.sort_by(f64::total_cmp);
    runs[2]
}

/// One run of [`per_tracked_op`]: nanoseconds per op over about `ops` ops.
fn tracked_run<B: AutodiffBackend>(ops: usize) -> f64 {
    let x = Tensor::<B, 1>::ones([64], &Default::default()).require_grad();
    let chains = ops.div_ceil(CHAIN + 1);
    let start = Instant::now();
    for _ in 0..chains {
        let mut y = x.clone();
        for _ in 0..CHAIN {
            y = y * x.clone();
        }
        let grads = y.sum().backward();
        std::hint::black_box(x.grad(&grads));
    }
    start.elapsed().as_secs_f64() * 1e9 / (chains * (CHAIN + 1)) as f64
}

/// The decorator's cost per tracked op, `Autodiff<Distributed<Flex>>` minus `Autodiff<Flex>`,
/// from `rounds` back-to-back pairs of runs (alternating which goes first): on a shared machine
/// whose speed drifts by tens of percent from one second to the next, only the difference within
/// a pair is steady. Prints both stacks' medians and the median, min and max of the differences.
fn tracked_pairs(ops: usize, rounds: usize) {
    // Warm both (allocator, caches).
    tracked_run::<Autodiff<Flex>>(ops / 4);
    tracked_run::<Autodiff<Distributed<Flex>>>(ops / 4);
    let (mut plain, mut dist, mut diff) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let (p, d) = if round % 2 == 0 {
            let p = tracked_run::<Autodiff<Flex>>(ops);
            (p, tracked_run::<Autodiff<Distributed<Flex>>>(ops))
        } else {
            let d = tracked_run::<Autodiff<Distributed<Flex>>>(ops);
            (tracked_run::<Autodiff<Flex>>(ops), d)
        };
        plain.push(p);
        dist.push(d);
        diff.push(d - p);
    }
    let mid = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "Autodiff<Flex>               {:8.0} ns/op (forward + backward)",
        mid(&mut plain)
    );
    println!(
        "Autodiff<Distributed<Flex>>  {:8.0} ns/op (forward + backward)",
        mid(&mut dist)
    );
    let m = mid(&mut diff);
    println!(
        "the decorator per tracked op: median {m:+.0} ns (min {:+.0}, max {:+.0}) over {rounds} pairs; target <= +300",
        diff[0],
        diff[diff.len() - 1]
    );
}

/// The median over 5 runs of `run`'s nanoseconds per op (`ops` ops a run).
fn median_ns(ops: usize, mut run: impl FnMut()) -> f64 {
    let mut runs: Vec<f64> = (0..5)
        .map(|_| {
            let start = Instant::now();
            run();
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
    let only: Option<String> = common::arg("--only");
    let on = |name: &str| only.as_deref().is_none_or(|o| o == name);
    if on("step") {
        training_step(rounds, steps);
    }
    if on("ops") {
        one_op(smoke);
    }
    if on("alloc") {
        alloc_cost(smoke);
    }
}

/// Blocks each thread holds at once in [`alloc_run`].
const HELD: usize = 16;

/// Nanoseconds per small block allocated and freed, on each of `threads` threads at once, through
/// the global allocator (`counted`) or mimalloc directly.
fn alloc_run(threads: usize, blocks: usize, counted: bool) -> f64 {
    use std::alloc::{GlobalAlloc, Layout};
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(move || {
                let mut held = [(std::ptr::null_mut::<u8>(), Layout::new::<u8>()); HELD];
                for i in 0..blocks + HELD {
                    let (old, layout) = held[i % HELD];
                    if !old.is_null() {
                        // SAFETY: allocated below with this layout by the same allocator.
                        unsafe {
                            if counted {
                                std::alloc::dealloc(old, layout)
                            } else {
                                mimalloc::MiMalloc.dealloc(old, layout)
                            }
                        }
                    }
                    let layout = Layout::from_size_align(64 + (i & 63), 8).unwrap();
                    // SAFETY: a non-zero size.
                    let p = unsafe {
                        if counted {
                            std::alloc::alloc(layout)
                        } else {
                            mimalloc::MiMalloc.alloc(layout)
                        }
                    };
                    assert!(!p.is_null());
                    // SAFETY: the block has at least one byte.
                    unsafe { p.write(i as u8) };
                    held[i % HELD] = (std::hint::black_box(p), layout);
                }
                for (p, layout) in held {
                    // SAFETY: as above.
                    unsafe {
                        if counted {
                            std::alloc::dealloc(p, layout)
                        } else {
                            mimalloc::MiMalloc.dealloc(p, layout)
                        }
                    }
                }
            });
        }
    });
    start.elapsed().as_secs_f64() * 1e9 / (blocks + HELD) as f64
}

/// The heap counting's cost per small block: the global allocator against mimalloc directly, in
/// alternating pairs, on one thread and on two.
fn alloc_cost(smoke: bool) {
    let blocks = if smoke {
        1_000
    } else {
        common::arg("--blocks").unwrap_or(2_000_000)
    };
    let pairs = if smoke {
        1
    } else {
        common::arg("--pairs").unwrap_or(15)
    };
    println!(
        "one small block allocated and freed ({blocks} a thread, {HELD} held), median of {pairs} pairs ({}):",
        wildfire::alloc::allocator_name()
    );
    for threads in [1, 2] {
        alloc_run(threads, blocks / 4, true);
        alloc_run(threads, blocks / 4, false);
        let (mut counted, mut raw, mut diff) = (Vec::new(), Vec::new(), Vec::new());
        for pair in 0..pairs {
            let (c, r) = if pair % 2 == 0 {
                let c = alloc_run(threads, blocks, true);
                (c, alloc_run(threads, blocks, false))
            } else {
                let r = alloc_run(threads, blocks, false);
                (alloc_run(threads, blocks, true), r)
            };
            counted.push(c);
            raw.push(r);
            diff.push(c - r);
        }
        println!(
            "{threads} thread(s): global allocator {:6.1} ns, mimalloc directly {:6.1} ns, the counting {:+6.1} ns",
            common::median(counted),
            common::median(raw),
            common::median(diff)
        );
    }
}

/// The training step on both backends, alternating.
fn training_step(rounds: usize, steps: usize) {
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
}

/// One elementwise op on a small tensor through each backend stack.
fn one_op(smoke: bool) {
    let ops = if smoke {
        100
    } else {
        common::arg("--ops").unwrap_or(200_000)
    };
    // `--stack flex|dist|autodiff|autodiff-dist`: one stack alone (to profile it).
    let stack: Option<String> = common::arg("--stack");
    let on = |name: &str| stack.as_deref().is_none_or(|s| s == name);
    println!("one op (x * x, 64 f32 elements), median of 5 × {ops} ops:");
    if on("flex") {
        println!(
            "Flex                         {:8.0} ns/op",
            per_op::<Flex>(ops)
        );
    }
    if on("dist") {
        let ns = per_op::<Distributed<Flex>>(ops);
        println!("Distributed<Flex>            {ns:8.0} ns/op");
    }
    println!("tracked, chains of {CHAIN} `y = y * x` each summed and taken backward:");
    if stack.is_none() {
        let rounds = if smoke {
            1
        } else {
            common::arg("--pairs").unwrap_or(15)
        };
        tracked_pairs(ops, rounds);
        return;
    }
    if on("autodiff") {
        let ns = per_tracked_op::<Autodiff<Flex>>(ops);
        println!("Autodiff<Flex>               {ns:8.0} ns/op (forward + backward)");
    }
    if on("autodiff-dist") {
        let ns = per_tracked_op::<Autodiff<Distributed<Flex>>>(ops);
        println!("Autodiff<Distributed<Flex>>  {ns:8.0} ns/op (forward + backward)");
    }
}
