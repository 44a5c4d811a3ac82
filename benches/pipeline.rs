//! Pipeline bubbles, measured (issue 20): the pipeline runner on a stack of residual MLP blocks
//! (2 per stage, d = 512, micro-batches of 8 × 64 tokens), ranks as threads on a `pp` axis, one
//! step after a warm-up. Per rank, the time its actions computed (from the moment each one's
//! input was in hand to its end) against the step's span on one time axis; the bubble is the
//! idle fraction, averaged over the ranks, beside the theory for uniform stages —
//! (p−1)/(M+p−1) for GPipe and 1F1B, (p−1)/(V·M+p−1) for interleaved 1F1B, (p−1)/(3M+p−1) for
//! ZB-H1 (F = I = W: a third of 1F1B's) — and beside the schedule's own simulation with unit
//! costs. The blocks run on `Autodiff<Distributed<Flex>>`, as training does (ZB-H1 defers the
//! linear layers' weight gradients to its `W` actions there). Writes the measured 1F1B timeline
//! for p = 4, M = 8 as an SVG. Then, for p = 2, each action kind's mean time alone (the other
//! rank idle) and alongside the other rank's action: what sharing the cores costs, which the
//! bubble beyond the theory absorbs.
//!
//! Valid only where every rank has cores of its own: ranks as threads share the machine's cores
//! and Flex's thread pool, so on a 2-core machine a step with more than two busy ranks runs each
//! action slower than alone, which stretches the busy time, not the bubble, but the two-core
//! figures for p = 4 are a lower bound on what one core per rank gives.
//!
//! ```text
//! cargo bench --bench pipeline [-- --svg FILE]
//! ```

#[global_allocator]
static GLOBAL: wildfire::alloc::Allocator = wildfire::alloc::Allocator;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor, activation};
use wildfire::parallel::Distributed;
use wildfire::parallel::mesh::DeviceMesh;
use wildfire::parallel::pipeline::{
    Costs, Placed, Schedule, ScheduleKind, StepOptions, Timeline, Work, run_step_with,
};

mod common;

type A = Autodiff<Distributed<Flex>>;

#[derive(Module, Debug)]
struct Block<B: Backend> {
    linear: Linear<B>,
}

#[derive(Module, Debug)]
struct Blocks<B: Backend> {
    blocks: Vec<Block<B>>,
}

impl<B: Backend> Blocks<B> {
    fn new(n: usize, d: usize, device: &B::Device) -> Self {
        let blocks = (0..n)
            .map(|_| {
                let w = Tensor::random([d, d], Distribution::Normal(0.0, 0.02), device);
                let b = Tensor::zeros([d], device);
                Block {
                    linear: Linear {
                        weight: Param::from_tensor(w),
                        bias: Some(Param::from_tensor(b)),
                    },
                }
            })
            .collect();
        Self { blocks }
    }

    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.blocks
            .iter()
            .fold(x, |x, b| x.clone() + activation::gelu(b.linear.forward(x)))
    }
}

/// One measured step of `schedule`: every rank's timeline on a common time axis.
fn measure(schedule: &Schedule, d: usize, tokens: [usize; 2]) -> Timeline {
    let p = schedule.ranks();
    let v = schedule.stages() / p;
    let mesh = DeviceMesh::new([("pp", p)]).expect("a pp mesh");
    let runs = wildfire::parallel::launch_ranks::<Flex, _, _>(
        &mesh,
        &Default::default(),
        &Default::default(),
        |device| {
            let ctx = device.context().clone();
            let comm = ctx.comm_arc();
            let inner = device.clone();
            let chunks: Vec<Blocks<A>> = (0..v).map(|_| Blocks::new(2, d, &inner)).collect();
            let step = || {
                // Gradients stay unreduced through the schedule, as the training step keeps them.
                ctx.set_no_sync(true);
                let out = run_step_with(
                    schedule,
                    &*comm,
                    0,
                    &chunks,
                    StepOptions {
                        ctx: Some(&ctx),
                        ..StepOptions::default()
                    },
                    |chunk: &Blocks<A>, _, _, x| {
                        chunk.forward(x.unwrap_or_else(|| {
                            Tensor::random([tokens[0], tokens[1], d], Distribution::Default, &inner)
                        }))
                    },
                    |_, out| out.powi_scalar(2).mean(),
                )
                .expect("a pipeline step");
                ctx.set_no_sync(false);
                out
            };
            step(); // warm-up
            let out = step();
            (out.started, out.timeline)
        },
    )
    .expect("the ranks");
    let origin = runs.iter().map(|(s, _)| *s).min().expect("a rank");
    Timeline {
        ranks: runs
            .into_iter()
            .map(|(started, placed)| {
                let offset = started.duration_since(origin).as_secs_f64();
                placed
                    .into_iter()
                    .map(|p| Placed {
                        start: p.start + offset,
                        end: p.end + offset,
                        ..p
                    })
                    .collect()
            })
            .collect(),
    }
}

/// Mean durations (ms) of `work` actions that ran alone (another rank busy < 10% of the time)
/// and alongside another rank's action (> 90%): with ranks as threads on shared cores, the cost
/// of contention that the bubble absorbs. `None` where no action fell in a class.
fn alone_and_shared(t: &Timeline, work: Work) -> (Option<f64>, Option<f64>) {
    let (mut alone, mut shared) = (Vec::new(), Vec::new());
    for (r, actions) in t.ranks.iter().enumerate() {
        for a in actions.iter().filter(|a| a.action.work == work) {
            let span = (a.end - a.start).max(1e-12);
            let busy: f64 = t
                .ranks
                .iter()
                .enumerate()
                .filter(|(o, _)| *o != r)
                .flat_map(|(_, other)| other.iter())
                .map(|b| (a.end.min(b.end) - a.start.max(b.start)).max(0.0))
                .sum();
            let share = busy / span;
            if share < 0.1 {
                alone.push(span);
            } else if share > 0.9 {
                shared.push(span);
            }
        }
    }
    let mean = |v: &[f64]| (!v.is_empty()).then(|| 1e3 * v.iter().sum::<f64>() / v.len() as f64);
    (mean(&alone), mean(&shared))
}

fn main() {
    let smoke = common::smoke();
    let (d, tokens) = if smoke { (16, [2, 4]) } else { (512, [8, 64]) };
    let cases: Vec<(ScheduleKind, usize, usize, usize)> = if smoke {
        vec![
            (ScheduleKind::OneFOneB, 2, 4, 1),
            (ScheduleKind::ZeroBubble, 2, 4, 1),
        ]
    } else {
        let mut cases = Vec::new();
        for (kind, v) in [
            (ScheduleKind::GPipe, 1),
            (ScheduleKind::OneFOneB, 1),
            (ScheduleKind::Interleaved, 2),
            (ScheduleKind::ZeroBubble, 1),
        ] {
            for p in [2, 4] {
                for m in [4, 8, 16] {
                    cases.push((kind, p, m, v));
                }
            }
        }
        cases
    };
    println!(
        "pipeline bubble, measured: 2 residual MLP blocks per stage, d = {d}, micro-batches of \
         {} x {} tokens, ranks as threads\n\n| schedule | p | M | V | measured | theory | \
         simulated (unit costs) | simulated (measured F and B) | F (ms) | B = I + W (ms) |\n\
         |---|---|---|---|---|---|---|---|---|---|",
        tokens[0], tokens[1]
    );
    let svg_path = common::arg::<String>("--svg").unwrap_or_else(|| {
        std::env::temp_dir()
            .join("wildfire-pipeline-1f1b.svg")
            .display()
            .to_string()
    });
    let mut contention = Vec::new();
    for (kind, p, m, v) in cases {
        let schedule = Schedule::new(kind, p, m, v).expect("a schedule");
        let measured = measure(&schedule, d, tokens);
        let theory = match kind {
            ScheduleKind::ZeroBubble => (p - 1) as f64 / (3 * m + p - 1) as f64,
            _ => (p - 1) as f64 / (v * m + p - 1) as f64,
        };
        let chunk = 1.0 / v as f64;
        let simulated = schedule
            .simulate(&Costs {
                forward: chunk,
                backward_input: chunk,
                backward_weight: chunk,
                transfer: 0.0,
            })
            .expect("a simulation")
            .mean_bubble();
        // The same schedule simulated with the forward and backward times this run measured
        // (means over every action): what uniform stages with these costs would give, so the
        // rest of the gap to the measurement is the runner's and the machine's.
        let mean = |work: Work| {
            let times: Vec<f64> = measured
                .ranks
                .iter()
                .flatten()
                .filter(|p| p.action.work == work)
                .map(|p| p.end - p.start)
                .collect();
            times.iter().sum::<f64>() / times.len().max(1) as f64
        };
        let f = mean(Work::Forward);
        // A whole backward, or (ZB-H1) the split ones: the stages that split give I and W.
        let (i, w) = match kind {
            ScheduleKind::ZeroBubble => (mean(Work::BackwardInput), mean(Work::BackwardWeight)),
            _ => (mean(Work::Backward) / 2.0, mean(Work::Backward) / 2.0),
        };
        let b = i + w;
        let with_costs = schedule
            .simulate(&Costs {
                forward: f,
                backward_input: i,
                backward_weight: w,
                transfer: 0.0,
            })
            .expect("a simulation")
            .mean_bubble();
        println!(
            "| {kind:?} | {p} | {m} | {v} | {:.1}% | {:.1}% | {:.1}% | {:.1}% | {:.2} | {:.2} |",
            100.0 * measured.mean_bubble(),
            100.0 * theory,
            100.0 * simulated,
            100.0 * with_costs,
            1e3 * f,
            1e3 * b
        );
        if p == 2 && kind != ScheduleKind::ZeroBubble {
            contention.push((kind, m, measured.clone()));
        }
        if (kind, p, m) == (ScheduleKind::OneFOneB, 4, 8) || smoke {
            let title = format!("{kind:?}: p = {p}, M = {m}, measured");
            std::fs::write(&svg_path, measured.svg(&title)).expect("writing the SVG");
            println!("\n(timeline: {svg_path})\n");
        }
    }
    // p = 2: what an action costs alone and alongside the other rank's (2 cores, one Flex thread
    // pool): where the bubble beyond the theory comes from.
    println!(
        "\nrank contention at p = 2: mean action time (ms) alone (the other rank idle > 90% of \
         it) and shared (busy > 90%)\n\n| schedule | M | F alone | F shared | B alone | B shared |\n\
         |---|---|---|---|---|---|"
    );
    let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.2}"));
    for (kind, m, timeline) in contention {
        let (fa, fs) = alone_and_shared(&timeline, Work::Forward);
        let (ba, bs) = alone_and_shared(&timeline, Work::Backward);
        println!(
            "| {kind:?} | {m} | {} | {} | {} | {} |",
            ms(fa),
            ms(fs),
            ms(ba),
            ms(bs)
        );
    }
}
