//! Context parallelism: every sequence split over a `cp` axis, attention as ring attention (or
//! one all-gather), trains as on one device — the GPT (learned positions) and the Llama (rotary
//! positions, grouped key/value heads), both layouts, both rotations, with dp, FSDP, tp + sp and
//! recomputation; the bytes on the ring follow the count, and bad sequence lengths are refused.

use super::{losses_close_f32, small_gpt, tensors_close, threads};
use burn::optim::AdamWConfig;
use burn::prelude::*;
use wildfire::engine::metrics::mean_over_ranks;
use wildfire::engine::{Recompute, StepRunner, StepRunnerConfig};
use wildfire::models::CausalLm;
use wildfire::models::gpt::{Gpt, GptConfig};
use wildfire::models::llama::{Llama, LlamaConfig, init_llama, parallelize_llama};
use wildfire::models::parallelize::{FsdpStrategy, ParallelConfig, init_gpt, parallelize_gpt};
use wildfire::parallel::{CpLayout, CpRotate, DistDevice, FsdpOptimizer, context_columns};

type Dist = super::Dist;

/// AdamW steps of each run.
const STEPS: usize = 3;
/// Rows of the global batch.
const ROWS: usize = 2;
/// Parameters after `STEPS` AdamW steps against one device's, relative to each tensor's scale.
/// Measured: every weight within 1.7e-5; the worst, 5.3e-5, is the GPT's last MLP bias at
/// t = 128 over cp 4 plain — a bias born zero, whose scale is three learning-rate steps, and
/// AdamW's `m/√v` turns rounding-level differences of its near-zero gradient (each rank's
/// positions summed apart, the attention blocks combined in another order) into that. The
/// losses agree within 1.2e-7.
const PARAM_TOL: f32 = 1e-4;

/// The GPT of these tests: the suite's small GPT (2 layers, 2 heads, width 32) with room for
/// 128 positions.
fn gpt() -> GptConfig {
    GptConfig {
        block_size: 128,
        ..small_gpt(2, 3)
    }
}

/// The Llama of these tests: 2 layers, 4 query heads over 2 key/value heads, width 32, rotary
/// positions with Llama-3.2's scaling.
fn llama() -> LlamaConfig {
    LlamaConfig {
        n_layer: 2,
        d_model: 32,
        ffn_hidden: 64,
        block_size: 128,
        tie_embeddings: false,
        init_seed: 5,
        ..LlamaConfig::tiny(64)
    }
}

/// `dp × cp × tp` with `fsdp`, the layout and rotation, the rest the defaults.
fn layout(
    dp: usize,
    cp: usize,
    tp: usize,
    fsdp: FsdpStrategy,
    cp_layout: CpLayout,
    cp_rotate: CpRotate,
) -> ParallelConfig {
    ParallelConfig {
        cp,
        cp_layout,
        cp_rotate,
        ..ParallelConfig::layout(dp, tp, fsdp, None)
    }
}

/// `cp` ranks alone, balanced, ring attention.
fn ring(cp: usize) -> ParallelConfig {
    layout(
        1,
        cp,
        1,
        FsdpStrategy::NoShard,
        CpLayout::Balanced,
        CpRotate::Ring,
    )
}

/// Row `r`'s token at position `p` (inputs: `p`, targets: `p + 1`): the same batch every step,
/// so the loss falls.
fn token(r: usize, p: usize) -> i64 {
    ((r * 31 + p * 7 + p * p / 3) % 64) as i64
}

/// Rows `rows` of `t` tokens from position `shift`, this rank's columns of them
/// ([`context_columns`]).
fn ids(
    rows: std::ops::Range<usize>,
    t: usize,
    shift: usize,
    device: &DistDevice<burn::backend::Flex>,
) -> Tensor<Dist, 2, Int> {
    let n = rows.len();
    let tokens: Vec<i64> = rows
        .flat_map(|r| (0..t).map(move |p| token(r, p + shift)))
        .collect();
    let whole = Tensor::<Dist, 2, Int>::from_data(TensorData::new(tokens, [n, t]), device);
    context_columns(whole).unwrap()
}

/// The model a run trains.
enum Model {
    Gpt,
    Llama,
}

/// `STEPS` AdamW steps (clipped at 1) on `ROWS` rows of `t` tokens laid out as `parallel` says
/// (each data-parallel rank its rows, each context-parallel rank its chunks of them),
/// recomputing per `recompute`: the mesh's loss per step and, on rank 0, every parameter at the
/// end (whole, in visiting order).
fn train(
    model: Model,
    t: usize,
    parallel: &ParallelConfig,
    recompute: Recompute,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    parallel.check_sequence(t).unwrap();
    let mesh = parallel.mesh().unwrap();
    let out = threads(
        &mesh,
        |device: DistDevice<burn::backend::Flex>| match model {
            Model::Gpt => {
                let m = init_gpt::<Dist>(&gpt(), &device, parallel).unwrap();
                let m = parallelize_gpt(m, device.mesh(), parallel).unwrap();
                let optim = AdamWConfig::new().with_weight_decay(0.1);
                let optim = FsdpOptimizer::new(optim.init::<Dist, Gpt<Dist>>());
                run(m, optim, &device, t, parallel, recompute)
            }
            Model::Llama => {
                let m = init_llama::<Dist>(&llama(), &device, parallel).unwrap();
                let m = parallelize_llama(m, device.mesh(), parallel).unwrap();
                let optim = AdamWConfig::new().with_weight_decay(0.1);
                let optim = FsdpOptimizer::new(optim.init::<Dist, Llama<Dist>>());
                run(m, optim, &device, t, parallel, recompute)
            }
        },
    );
    out.into_iter().next().unwrap()
}

fn run<M, O>(
    mut model: M,
    mut optim: O,
    device: &DistDevice<burn::backend::Flex>,
    t: usize,
    parallel: &ParallelConfig,
    recompute: Recompute,
) -> (Vec<f32>, Vec<Vec<f32>>)
where
    M: CausalLm<Dist> + burn::module::AutodiffModule<Dist> + 'static,
    O: burn::optim::Optimizer<M, Dist>,
{
    let mut runner = StepRunner::new(
        StepRunnerConfig {
            recompute,
            ..Default::default()
        },
        None,
    );
    let rows = ROWS / parallel.dp;
    let first = device.mesh().data_index(device.rank()).0 * rows;
    let mut losses = Vec::new();
    for _ in 0..STEPS {
        let batch = |shift: usize| ids(first..first + rows, t, shift, device);
        let (next, record) = runner
            .run(
                device,
                model,
                &mut optim,
                None,
                3e-3,
                &[11],
                |m, _, ckpt| m.loss_with(batch(0), batch(1), ckpt),
            )
            .unwrap();
        model = next;
        losses.push(mean_over_ranks(device, record.loss).unwrap());
    }
    (losses, wildfire::demo::parameters(&model))
}

/// Prints the largest relative loss difference and the largest parameter difference (relative
/// to its tensor's scale, with the tensor's index).
fn report(what: &str, l: &[f32], losses: &[f32], p: &[Vec<f32>], params: &[Vec<f32>]) {
    let loss = crate::suite::pairs(l, losses)
        .map(|(a, b)| (a - b).abs() / b.abs())
        .fold(0f32, f32::max);
    let (mut worst, mut at) = (0f32, 0);
    for (i, (x, y)) in crate::suite::pairs(p, params).enumerate() {
        let scale = y.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = crate::suite::pairs(x, y)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
            / scale;
        if d > worst {
            (worst, at) = (d, i);
        }
    }
    println!("{what}: losses within {loss:.1e}, parameters within {worst:.1e} (tensor {at})");
}

/// The GPT at t = 64 over cp 2 and 4, both layouts and both rotations, with dp 2 FullShard, with
/// dp 2 × cp 2 × tp 2 FullShard + SP, and with recomputation, and at t = 128 over cp 4: one
/// device's losses (to 1e-5; measured within 1.2e-7) and every parameter after AdamW steps (to
/// `PARAM_TOL` of its tensor's scale).
#[test]
fn gpt_context_parallel_matches_one_device() {
    use CpLayout::{Balanced, Plain};
    use CpRotate::{AllGather, Ring};
    use FsdpStrategy::{FullShard, NoShard};
    for t in [64, 128] {
        let (losses, params) = train(Model::Gpt, t, &ParallelConfig::default(), Recompute::None);
        assert!(losses[STEPS - 1] < losses[0], "it learns: {losses:?}");
        let mut runs = vec![
            (
                "cp 4 balanced ring",
                layout(1, 4, 1, NoShard, Balanced, Ring),
                Recompute::None,
            ),
            (
                "cp 4 plain ring",
                layout(1, 4, 1, NoShard, Plain, Ring),
                Recompute::None,
            ),
        ];
        if t == 64 {
            let sp = |p: ParallelConfig| ParallelConfig { sp: true, ..p };
            runs.extend([
                (
                    "cp 2 balanced ring",
                    layout(1, 2, 1, NoShard, Balanced, Ring),
                    Recompute::None,
                ),
                (
                    "cp 2 plain allgather",
                    layout(1, 2, 1, NoShard, Plain, AllGather),
                    Recompute::None,
                ),
                (
                    "cp 4 balanced allgather",
                    layout(1, 4, 1, NoShard, Balanced, AllGather),
                    Recompute::None,
                ),
                (
                    "dp 2 x cp 2 FullShard, selective recompute",
                    layout(2, 2, 1, FullShard, Balanced, Ring),
                    Recompute::Selective,
                ),
                (
                    "cp 2 full recompute",
                    layout(1, 2, 1, NoShard, Balanced, Ring),
                    Recompute::Full,
                ),
                (
                    "dp 2 x cp 2 x tp 2 FullShard + SP",
                    sp(layout(2, 2, 2, FullShard, Balanced, Ring)),
                    Recompute::None,
                ),
            ]);
        }
        let mut first_loss = std::collections::HashMap::new();
        for (what, parallel, recompute) in runs {
            let (l, p) = train(Model::Gpt, t, &parallel, recompute);
            first_loss.insert(what, l[0].to_bits());
            let what = format!("t {t}: {what}");
            report(&what, &l, &losses, &p, &params);
            losses_close_f32(&what, &l, &losses, 1e-5);
            tensors_close(&what, &p, &params, PARAM_TOL);
        }
        // The all-gather visits the blocks in the ring's order: the same forward, bit for bit.
        if let (Some(ring), Some(gather)) = (
            first_loss.get("cp 4 balanced ring"),
            first_loss.get("cp 4 balanced allgather"),
        ) {
            assert_eq!(
                ring, gather,
                "t {t}: the ring's and the all-gather's first loss"
            );
        }
    }
}

/// The Llama (rotary positions at the rank's chunks, grouped key/value heads) at t = 64 over
/// cp 2 and 4, with tp 2 + SP, and at t = 128 over cp 2 with dp 2 FullShard: one device's
/// losses and parameters.
#[test]
fn llama_context_parallel_matches_one_device() {
    use CpLayout::{Balanced, Plain};
    use CpRotate::{AllGather, Ring};
    use FsdpStrategy::{FullShard, NoShard};
    for t in [64, 128] {
        let (losses, params) = train(Model::Llama, t, &ParallelConfig::default(), Recompute::None);
        let runs = if t == 64 {
            vec![
                (
                    "cp 2 balanced ring",
                    layout(1, 2, 1, NoShard, Balanced, Ring),
                ),
                (
                    "cp 4 plain allgather",
                    layout(1, 4, 1, NoShard, Plain, AllGather),
                ),
                (
                    "cp 2 x tp 2 + SP",
                    ParallelConfig {
                        sp: true,
                        ..layout(1, 2, 2, NoShard, Balanced, Ring)
                    },
                ),
            ]
        } else {
            vec![(
                "dp 2 x cp 2 FullShard",
                layout(2, 2, 1, FullShard, Balanced, Ring),
            )]
        };
        for (what, parallel) in runs {
            let what = format!("t {t}: {what}");
            let (l, p) = train(Model::Llama, t, &parallel, Recompute::None);
            report(&what, &l, &losses, &p, &params);
            losses_close_f32(&what, &l, &losses, 1e-5);
            tensors_close(&what, &p, &params, PARAM_TOL);
        }
    }
}

/// The bytes on the ring per layer and rank: forward `(cp − 1)·2·b·(t/cp)·kv_heads·head_dim`
/// f32 values sent (the key and value pieces, each passed on `cp − 1` times), backward twice
/// that (the pieces again, and their gradients on their way home); with all-gather one
/// all-gather of keys and of values per layer forward, the same again and one reduce-scatter
/// of each gradient backward. Nothing else communicates on a cp-only mesh but the gradients'
/// reduction over cp.
#[test]
fn the_ring_moves_the_counted_bytes() {
    use wildfire::parallel::CollectiveKind::{AllGather, ReduceScatter, Send};
    let (b, t, layers) = (2usize, 64usize, 2usize);
    let config = gpt();
    for (cp, rotate) in [
        (2, CpRotate::Ring),
        (4, CpRotate::Ring),
        (4, CpRotate::AllGather),
    ] {
        let parallel = layout(1, cp, 1, FsdpStrategy::NoShard, CpLayout::Balanced, rotate);
        let mesh = parallel.mesh().unwrap();
        let stats = threads(&mesh, |device| {
            let m = init_gpt::<Dist>(&config, &device, &parallel).unwrap();
            let m = parallelize_gpt(m, device.mesh(), &parallel).unwrap();
            let loss = m.loss(ids(0..b, t, 0, &device), ids(0..b, t, 1, &device));
            let forward = device.context().comm_stats();
            let _grads = loss.backward();
            (forward, device.context().comm_stats())
        });
        let piece = (b * (t / cp) * config.n_embd * 4) as u64;
        for (rank, (forward, all)) in stats.into_iter().enumerate() {
            let what = format!("cp {cp} {rotate}, rank {rank}");
            match rotate {
                CpRotate::Ring => {
                    let per_layer = (cp as u64 - 1) * 2 * piece;
                    assert_eq!(
                        forward.bytes(Send),
                        per_layer * layers as u64,
                        "{what}: forward"
                    );
                    assert_eq!(
                        all.bytes(Send),
                        3 * per_layer * layers as u64,
                        "{what}: forward and backward"
                    );
                    assert_eq!(forward.count(AllGather), 0, "{what}");
                }
                CpRotate::AllGather => {
                    assert_eq!(forward.count(Send), 0, "{what}");
                    assert_eq!(
                        forward.count_on(AllGather, "cp"),
                        2 * layers as u64,
                        "{what}"
                    );
                    assert_eq!(forward.bytes_on(AllGather, "cp"), 2 * piece * layers as u64);
                    assert_eq!(all.count_on(AllGather, "cp"), 4 * layers as u64, "{what}");
                    assert_eq!(
                        all.bytes_on(ReduceScatter, "cp"),
                        2 * cp as u64 * piece * layers as u64,
                        "{what}: the whole sequence's key/value gradients, scattered"
                    );
                }
            }
        }
    }
}

/// A Llama block's activations kept for backward, per rank, by the decorator's accounting (the
/// difference between 3 blocks and 1): at cp 2 half of one device's, and what
/// `llama_activation_bytes` counts for cp 2 (within a tenth, as the one-device count).
#[test]
fn a_context_parallel_rank_keeps_half_the_activations() {
    use wildfire::engine::Recomputer;
    use wildfire::models::memory::llama_activation_bytes;
    let (b, t) = (2usize, 32usize);
    let kept = |cp: usize, layers: usize| -> i64 {
        let parallel = ring(cp);
        let mesh = parallel.mesh().unwrap();
        let config = LlamaConfig {
            n_layer: layers,
            ..llama()
        };
        let out = threads(&mesh, |device| {
            let ctx = device.context().clone();
            let m = init_llama::<Dist>(&config, &device, &parallel).unwrap();
            let m = parallelize_llama(m, device.mesh(), &parallel).unwrap();
            let (x, y) = (ids(0..b, t, 0, &device), ids(0..b, t, 1, &device));
            let before = ctx.live_bytes() as i64;
            let ckpt = Recomputer::<Dist>::new(Recompute::None, 1);
            let loss = m.loss_with(x, y, &ckpt);
            let kept = ctx.live_bytes() as i64 - before;
            let _ = ckpt.backward(loss, &m).unwrap();
            kept
        });
        out[0]
    };
    let per_block = |cp| (kept(cp, 3) - kept(cp, 1)) / 2;
    let (one, two) = (per_block(1), per_block(2));
    let ratio = two as f64 / one as f64;
    println!("llama block: {one} bytes at cp 1, {two} at cp 2 (ratio {ratio:.4})");
    assert!((0.49..=0.51).contains(&ratio), "cp 2 keeps {two} of {one}");
    let count = |layers| {
        let parallel = ring(2);
        let config = LlamaConfig {
            n_layer: layers,
            block_size: t,
            ..llama()
        };
        llama_activation_bytes(&config, &parallel, b, false) as i64
    };
    let counted = (count(3) - count(1)) / 2;
    let ratio = two as f64 / counted as f64;
    assert!((0.9..1.1).contains(&ratio), "kept {two}, counted {counted}");
}

/// A sequence that does not split into the layout's chunks is refused before step 0 with the
/// lengths that do, by the configuration and where a rank takes its columns; a mesh without a
/// cp axis cannot take the policy.
#[test]
fn bad_context_parallel_input_is_refused() {
    let balanced = ring(4);
    let e = balanced.check_sequence(36).unwrap_err().to_string();
    assert!(e.contains("multiple of 8"), "{e}");
    balanced.check_sequence(40).unwrap();
    let plain = ParallelConfig {
        cp_layout: CpLayout::Plain,
        ..balanced.clone()
    };
    plain.check_sequence(36).unwrap();
    let e = plain.check_sequence(38).unwrap_err().to_string();
    assert!(e.contains("multiple of 4"), "{e}");
    // The columns a rank takes: a length that does not split is a typed error there too.
    let mesh = balanced.mesh().unwrap();
    let errors = threads(&mesh, |device| {
        let m = init_gpt::<Dist>(&gpt(), &device, &balanced).unwrap();
        let _m = parallelize_gpt(m, device.mesh(), &balanced).unwrap();
        let x = Tensor::<Dist, 2, Int>::zeros([1, 12], &device);
        context_columns(x).unwrap_err().to_string()
    });
    assert!(
        errors.iter().all(|e| e.contains("multiple of 8")),
        "{errors:?}"
    );
    let device = DistDevice::<burn::backend::Flex>::default();
    let e = wildfire::parallel::context_parallel::<Dist>(&device, CpLayout::Plain, CpRotate::Ring)
        .unwrap_err()
        .to_string();
    assert!(e.contains("cp"), "{e}");
}

/// Ring attention's transfers run on the rank's communication thread while its compute thread
/// works on the blocks it holds: over a modelled slow cp link (each 16 kB piece 8 ms), the
/// trace shows every exchange (`SendRecv`, 6 per layer at cp 2: the keys and values forward,
/// again backward, and their gradients home) and, in every layer, attention blocks computed
/// while an exchange was in flight — forward and backward.
#[test]
fn ring_transfers_overlap_the_attention_blocks() {
    use wildfire::parallel::comm::Links;
    use wildfire::parallel::{LaunchOptions, launch_ranks};
    let (b, t, layers) = (2usize, 128usize, 2usize);
    let parallel = ring(2);
    let mesh = parallel.mesh().unwrap();
    let mut links = Links::default();
    links.add("cp=2MB/s,10us").unwrap();
    let options = LaunchOptions {
        links,
        ..LaunchOptions::default()
    };
    let run = |device: DistDevice<burn::backend::Flex>| {
        let m = init_gpt::<Dist>(&gpt(), &device, &parallel).unwrap();
        let m = parallelize_gpt(m, device.mesh(), &parallel).unwrap();
        let member = device.context().comm().member();
        member.set_tracing(true);
        let loss = m.loss(ids(0..b, t, 0, &device), ids(0..b, t, 1, &device));
        let _grads = loss.backward();
        member.take_trace()
    };
    let traces =
        launch_ranks::<burn::backend::Flex, _, _>(&mesh, &Default::default(), &options, run)
            .unwrap();
    for (rank, trace) in traces.iter().enumerate() {
        let exchanges: Vec<_> = trace.iter().filter(|e| e.name == "SendRecv").collect();
        let blocks: Vec<_> = trace.iter().filter(|e| e.name == "cp attention").collect();
        assert_eq!(exchanges.len(), 6 * layers, "rank {rank}: {trace:?}");
        // A message arrives 8 ms after it was sent: an exchange lasts that long unless its
        // incoming message left before the exchange began.
        assert!(
            exchanges.iter().any(|e| e.dur_us >= 8000.0),
            "rank {rank}: the link's time is spent on the exchanges"
        );
        let overlapped = blocks
            .iter()
            .filter(|blk| {
                // In flight from its issue to its completion.
                exchanges.iter().any(|e| {
                    blk.start_us < e.start_us + e.dur_us && e.issued_us < blk.start_us + blk.dur_us
                })
            })
            .count();
        println!(
            "rank {rank}: {} blocks, {overlapped} under an exchange",
            blocks.len()
        );
        assert!(
            overlapped >= 2 * layers,
            "rank {rank}: {overlapped} of {} blocks overlap an exchange",
            blocks.len()
        );
    }
}
