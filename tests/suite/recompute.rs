//! Activation recomputation: every policy gives bitwise the loss and gradients of no
//! recomputation (f32, Flex, dropout on), also under FullShard on 2 ranks; the attention core's
//! written-out backward against Burn's autodiff; bytes retained for backward per layer against
//! Korthikanti et al.'s formulas.

use super::{Dist, Plain, close, threads};
use burn::backend::Flex;
use burn::module::{ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use wildfire::engine::{AttentionSpec, Recompute, Recomputer, attention_reference};
use wildfire::kernels::hooks::ForwardHooks;
use wildfire::models::CausalLm;
use wildfire::models::gpt::{Gpt, GptConfig};
use wildfire::models::parallelize::{FsdpStrategy, ParallelConfig, parallelize_gpt};
use wildfire::parallel::{
    CollectiveKind, DeviceMesh, Distributed, Error, Group, LaunchOptions, dtensor, launch_ranks,
    sync_gradients,
};

const POLICIES: [Recompute; 4] = [
    Recompute::None,
    Recompute::Selective,
    Recompute::Full,
    Recompute::EveryNth(2),
];

fn config(n_layer: usize, dropout: f64) -> GptConfig {
    GptConfig {
        dropout,
        ..super::small_gpt(n_layer, 3)
    }
}

fn tokens<B: Backend>(b: usize, t: usize, shift: usize, device: &B::Device) -> Tensor<B, 2, Int> {
    let v: Vec<i64> = (0..b * t).map(|i| ((i * 7 + shift) % 64) as i64).collect();
    Tensor::from_data(TensorData::new(v, [b, t]), device)
}

fn bits<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<u32> {
    t.into_data()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// Every parameter's gradient, in module order.
struct Collect<'g, B: AutodiffBackend>(&'g B::Gradients, Vec<Vec<u32>>);

impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let g = param
            .val()
            .grad(self.0)
            .expect("every parameter has a gradient");
        self.1.push(bits(g));
    }
}

/// One forward and backward of `policy` on one device: loss bits, gradient bits, regions.
fn one_step(policy: Recompute, dropout: f64) -> (u32, Vec<Vec<u32>>, usize) {
    let device = Default::default();
    let model: Gpt<Plain> = config(4, dropout).init(&device).unwrap();
    let ckpt = Recomputer::<Plain>::new(policy, 99);
    let loss = model.loss_with(tokens(2, 16, 0, &device), tokens(2, 16, 1, &device), &ckpt);
    let value = loss.clone().into_scalar().to_bits();
    let regions = ckpt.regions();
    let grads = ckpt.backward(loss, &model).unwrap();
    let mut collect = Collect::<Plain>(&grads, Vec::new());
    model.visit(&mut collect);
    (value, collect.1, regions)
}

#[test]
fn every_policy_is_bitwise_identical_to_no_recomputation() {
    let (loss, grads, regions) = one_step(Recompute::None, 0.1);
    assert_eq!(regions, 0);
    // Dropout is on: the training loss differs from the evaluation loss.
    let device = Default::default();
    let model: Gpt<Plain> = config(4, 0.1).init(&device).unwrap();
    let eval = model
        .loss(tokens(2, 16, 0, &device), tokens(2, 16, 1, &device))
        .into_scalar();
    assert_ne!(
        eval.to_bits(),
        loss,
        "dropout must change the training loss"
    );
    for (policy, expected_regions) in [
        (Recompute::Selective, 0),
        (Recompute::Full, 3),
        (Recompute::EveryNth(2), 2),
        (Recompute::EveryNth(3), 1),
    ] {
        let (l, g, r) = one_step(policy, 0.1);
        assert_eq!(r, expected_regions, "{policy}: regions");
        assert_eq!(l, loss, "{policy}: loss");
        assert_eq!(g.len(), grads.len());
        for (i, (a, b)) in crate::suite::pairs(&g, &grads).enumerate() {
            assert!(a == b, "{policy}: gradient of parameter {i} differs");
        }
    }
}

/// The attention op's written-out backward against Burn's autodiff of the same forward built from
/// Burn ops (causal, dropout on, a non-power-of-two sequence), and the selective variant equal to
/// it bitwise. With dropout on, the packed q/k/v form the GPT takes keeps that Burn-op path too
/// (the flash kernels have no dropout): its output is the reference's, masks included.
#[test]
fn attention_backward_matches_burn_autodiff() {
    let device = Default::default();
    let (b, h, t, d) = (2, 3, 7, 4);
    let data = |seed: u64| {
        let mut s = seed;
        let v: Vec<f32> = (0..b * h * t * d)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
            })
            .collect();
        Tensor::<Plain, 4>::from_data(TensorData::new(v, [b, h, t, d]), &device)
    };
    let weights = data(4).detach();
    let run = |how: &str| {
        let (q, k, v) = (
            data(1).require_grad(),
            data(2).require_grad(),
            data(3).require_grad(),
        );
        let ckpt = Recomputer::<Plain>::new(
            if how == "selective" {
                Recompute::Selective
            } else {
                Recompute::None
            },
            5,
        );
        let y = if how == "packed" {
            let packed = |t: Tensor<Plain, 4>| t.swap_dims(1, 2);
            let qkv = Tensor::cat(
                vec![packed(q.clone()), packed(k.clone()), packed(v.clone())],
                3,
            );
            ckpt.attention_qkv(0, qkv, 0.5, true, 0.25).swap_dims(1, 2)
        } else if how == "burn" {
            let spec = AttentionSpec {
                scale: 0.5,
                causal: true,
                dropout: 0.25,
                seed: ckpt.seed_of(0, 2),
            };
            attention_reference(q.clone(), k.clone(), v.clone(), &spec)
        } else {
            ckpt.attention_heads(0, [q.clone(), k.clone(), v.clone()], 0.5, true, 0.25)
        };
        let grads = (y.clone() * weights.clone()).sum().backward();
        let f = |t: Tensor<Flex, 4>| t.into_data().to_vec::<f32>().unwrap();
        (
            y.into_data().to_vec::<f32>().unwrap(),
            [
                f(q.grad(&grads).unwrap()),
                f(k.grad(&grads).unwrap()),
                f(v.grad(&grads).unwrap()),
            ],
        )
    };
    let (y_ref, g_ref) = run("burn");
    let (y, g) = run("op");
    let (y_sel, g_sel) = run("selective");
    close("attention output", &y, &y_ref);
    for (name, (a, r)) in ["dq", "dk", "dv"]
        .iter()
        .zip(crate::suite::pairs(&g, &g_ref))
    {
        close(name, a, r);
    }
    assert_eq!(y, y_sel);
    assert_eq!(g, g_sel);
    let (y_packed, g_packed) = run("packed");
    close("packed attention output, dropout on", &y_packed, &y_ref);
    for (name, (a, r)) in ["dq", "dk", "dv"]
        .iter()
        .zip(crate::suite::pairs(&g_packed, &g_ref))
    {
        close(name, a, r);
    }
}

/// FullShard on 2 ranks, dropout on: every policy's loss and every rank's gradient shards equal
/// no recomputation's, bitwise.
#[test]
fn policies_are_bitwise_identical_under_full_shard() {
    let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
    let out = threads(&mesh, |device| {
        let rank = device.rank();
        let ctx = device.context().clone();
        POLICIES
            .iter()
            .map(|&policy| {
                let model = parallelize_gpt(
                    config(4, 0.1).init::<Dist>(&device).unwrap(),
                    &mesh,
                    &ParallelConfig {
                        dp: 2,
                        fsdp: FsdpStrategy::FullShard,
                        ..ParallelConfig::default()
                    },
                )
                .unwrap();
                let ckpt = Recomputer::<Dist>::new(policy, 7 + rank as u64)
                    .with_fence(|| ctx.comm().barrier(Group::World));
                let loss = model.loss_with(
                    tokens(2, 16, rank, &device),
                    tokens(2, 16, rank + 1, &device),
                    &ckpt,
                );
                let value = loss.clone().into_scalar().to_bits();
                let gathers = ctx.comm().stats().count(CollectiveKind::AllGather);
                let grads = ckpt.backward(loss, &model).unwrap();
                drop(ckpt);
                let gathers = ctx.comm().stats().count(CollectiveKind::AllGather) - gathers;
                let mut grads = GradientsParams::from_grads(grads, &model);
                sync_gradients(&model, &mut grads).unwrap();
                let mut shards = Shards(&grads, Vec::new());
                model.visit(&mut shards);
                (value, shards.1, gathers)
            })
            .collect::<Vec<_>>()
    });
    for per_rank in out {
        let (loss, grads, gathers) = &per_rank[0];
        assert_eq!(per_rank.len(), POLICIES.len(), "a run per policy");
        for (policy, (l, g, _)) in POLICIES.iter().zip(&per_rank).skip(1) {
            assert_eq!(l, loss, "{policy}: loss");
            assert!(g == grads, "{policy}: gradient shards differ");
        }
        // FSDP re-gathers a recomputed block's parameters inside its recomputation: the same
        // extra all-gathers per region (3 regions under full, 2 under every-2), none otherwise.
        let extra: Vec<u64> = per_rank.iter().map(|(_, _, n)| n - gathers).collect();
        assert_eq!(extra[1], 0, "selective recomputes no parameter use");
        assert!(extra[2] > 0 && extra[2].is_multiple_of(3), "{extra:?}");
        assert_eq!(extra[2] / 3, extra[3] / 2, "{extra:?}");
    }
}

/// Each rank's local gradient shards.
struct Shards<'g>(&'g GradientsParams, Vec<Vec<u32>>);

impl ModuleVisitor<Dist> for Shards<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Dist, D>>) {
        let g = self
            .0
            .get::<Distributed<Flex>, D>(param.id)
            .expect("every parameter has a gradient");
        let local = dtensor(&g).local().clone();
        let local = Tensor::<Flex, D>::from_primitive(burn::tensor::TensorPrimitive::Float(local));
        self.1.push(bits(local));
    }
}

/// Bytes kept for backward after the forward pass, per layer (the difference between 3 layers and
/// 1, so the embedding and the head cancel), measured by the decorator's accounting, against
/// Korthikanti et al. (2022): kept ≈ s·b·h·(34 + 5·a·s/h) bytes at 16 bits with 1-byte dropout
/// masks, selective ≈ 34·s·b·h, full = 2·s·b·h (×2 here: f32).
#[test]
fn retained_bytes_per_layer_follow_the_formulas() {
    let (b, s, h, a) = (2usize, 16usize, 32usize, 2usize);
    let retained = |policy: Recompute, layers: usize| -> i64 {
        let device = wildfire::parallel::DistDevice::<Flex>::default();
        let ctx = device.context().clone();
        let model: Gpt<Dist> = config(layers, 0.1).init(&device).unwrap();
        let x = tokens::<Dist>(b, s, 0, &device);
        let y = tokens::<Dist>(b, s, 1, &device);
        let before = ctx.live_bytes() as i64;
        let ckpt = Recomputer::<Dist>::new(policy, 1);
        let loss = model.loss_with(x, y, &ckpt);
        let kept = ctx.live_bytes() as i64 - before;
        let _ = ckpt.backward(loss, &model).unwrap();
        kept
    };
    let per_layer = |policy| (retained(policy, 3) - retained(policy, 1)) / 2;
    let sbh = (s * b * h) as f64;
    let none = per_layer(Recompute::None);
    let selective = per_layer(Recompute::Selective);
    let full = per_layer(Recompute::Full);
    let predicted = [
        (
            "none",
            none,
            2.0 * sbh * (34.0 + 5.0 * (a * s) as f64 / h as f64),
        ),
        ("selective", selective, 2.0 * sbh * 34.0),
        ("full", full, 2.0 * 2.0 * sbh),
    ];
    for (name, measured, predicted) in predicted {
        println!(
            "{name}: {measured} bytes/layer retained, formula {predicted:.0}, measured/predicted {:.2}",
            measured as f64 / predicted
        );
    }
    // Full keeps exactly each block's f32 input (and a 4-byte handle on each region's output).
    assert_eq!(full, 4 * (s * b * h) as i64 + 4);
    // Selective drops what the attention op keeps otherwise: the probabilities and the dropout
    // mask, a·s²·b f32 each (the scores and the dropped-out probabilities are never kept: the op's
    // backward needs only the probabilities and the mask).
    assert_eq!(none - selective, 2 * 4 * (a * s * s * b) as i64);
    assert!(selective > full);
    let ratio = none as f64 / (2.0 * sbh * (34.0 + 5.0 * (a * s) as f64 / h as f64));
    assert!(
        (0.5..2.0).contains(&ratio),
        "measured/predicted {ratio} for no recomputation"
    );
}

#[test]
fn recompute_errors_come_back_typed() {
    // A fence that fails (a peer died): backward stops with that error, nothing hangs.
    let device = Default::default();
    let model: Gpt<Plain> = config(2, 0.0).init(&device).unwrap();
    let ckpt = Recomputer::<Plain>::new(Recompute::Full, 0).with_fence(|| {
        Err(Error::PeerFailed {
            rank: 1,
            reason: "peer gone".into(),
        })
    });
    let loss = model.loss_with(tokens(1, 8, 0, &device), tokens(1, 8, 1, &device), &ckpt);
    let Err(err) = ckpt.backward(loss, &model) else {
        panic!("the failed fence must stop the backward passes")
    };
    assert!(err.to_string().contains("peer gone"), "{err}");
    assert!("every-0".parse::<Recompute>().is_err());
    assert_eq!("every-3".parse::<Recompute>(), Ok(Recompute::EveryNth(3)));
}

/// Any Burn module works as a region: burn-nn's stock `TransformerEncoderLayer`s, each a
/// recomputed block, give bitwise the gradients of plain Burn autodiff (no checkpointer at all).
#[test]
fn stock_burn_nn_layers_recompute_bitwise() {
    use burn::nn::transformer::{TransformerEncoder, TransformerEncoderConfig};
    let device = Default::default();
    let encoder: TransformerEncoder<Plain> = wildfire::demo::deterministic_init(
        TransformerEncoderConfig::new(16, 32, 2, 3)
            .with_dropout(0.0)
            .init(&device),
        11,
    );
    let input = || {
        let v: Vec<f32> = (0..2 * 5 * 16)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        Tensor::<Plain, 3>::from_data(TensorData::new(v, [2, 5, 16]), &device)
    };
    let collect = |grads: &<Plain as AutodiffBackend>::Gradients| {
        let mut c = Collect::<Plain>(grads, Vec::new());
        encoder.visit(&mut c);
        c.1
    };
    // Plain Burn.
    let mut x = input();
    for layer in &encoder.layers {
        x = layer.forward(x, None, None);
    }
    let reference = collect(&(x.powf_scalar(2.0).sum()).backward());
    for policy in [Recompute::Full, Recompute::EveryNth(2)] {
        let ckpt = Recomputer::<Plain>::new(policy, 0);
        let mut x = input();
        for (i, layer) in encoder.layers.iter().enumerate() {
            let n = encoder.layers.len();
            x = ckpt.block(i, n, layer, x, |layer, x, _| layer.forward(x, None, None));
        }
        let grads = ckpt.backward(x.powf_scalar(2.0).sum(), &encoder).unwrap();
        assert!(
            collect(&grads) == reference,
            "{policy}: gradients differ from plain Burn"
        );
    }
}

/// Stock burn-nn layers with their own `Dropout` (drawing from the backend) under FullShard on 2
/// ranks as threads: the checkpointer re-seeds the backend per region and `Distributed<B>` keeps a
/// stream per rank, so the recomputation replays the same masks — bitwise the gradients of no
/// recomputation, whatever the other rank's thread draws meanwhile.
#[test]
fn stock_dropout_replays_under_thread_ranks() {
    use burn::nn::transformer::{TransformerEncoder, TransformerEncoderConfig};
    use wildfire::parallel::fully_shard;
    let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
    let out = threads(&mesh, |device| {
        let ctx = device.context().clone();
        let rank = device.rank();
        [Recompute::None, Recompute::Full, Recompute::None]
            .iter()
            .enumerate()
            .map(|(run, &policy)| {
                let encoder: TransformerEncoder<Dist> = fully_shard(
                    wildfire::demo::deterministic_init(
                        TransformerEncoderConfig::new(16, 32, 2, 3)
                            .with_dropout(0.2)
                            .init(&device),
                        11,
                    ),
                    &mesh,
                    FsdpStrategy::FullShard,
                )
                .unwrap();
                let v: Vec<f32> = (0..2 * 5 * 16)
                    .map(|i| ((i * 37 % 23 + rank) as f32 - 11.0) / 7.0)
                    .collect();
                let mut x = Tensor::<Dist, 3>::from_data(TensorData::new(v, [2, 5, 16]), &device);
                // The last run uses another step seed: other masks, another loss.
                let ckpt = Recomputer::<Dist>::new(policy, if run == 2 { 9 } else { 3 })
                    .with_fence(|| ctx.comm().barrier(Group::World));
                let n = encoder.layers.len();
                for (i, layer) in encoder.layers.iter().enumerate() {
                    x = ckpt.block(i, n, layer, x, |l, x, _| l.forward(x, None, None));
                }
                let loss = x.powf_scalar(2.0).mean();
                let value = loss.clone().into_scalar().to_bits();
                let grads = ckpt.backward(loss, &encoder).unwrap();
                drop(ckpt);
                let mut grads = GradientsParams::from_grads(grads, &encoder);
                sync_gradients(&encoder, &mut grads).unwrap();
                let mut shards = Shards(&grads, Vec::new());
                encoder.visit(&mut shards);
                (value, shards.1)
            })
            .collect::<Vec<_>>()
    });
    for runs in out {
        assert_eq!(runs[1].0, runs[0].0, "loss");
        assert!(runs[1].1 == runs[0].1, "gradient shards differ");
        assert_ne!(runs[2].0, runs[0].0, "dropout must depend on the seed");
    }
}

/// `Backend::seed` on `Distributed<B>` starts a stream per rank: ranks as threads draw the same
/// numbers as a lone rank, however their draws interleave.
#[test]
fn seeded_random_is_per_rank_and_deterministic() {
    use burn::tensor::Distribution;
    let draw = |device: &wildfire::parallel::DistDevice<Flex>| {
        <Distributed<Flex> as Backend>::seed(device, 42);
        (0..20)
            .map(|_| {
                bits(Tensor::<Distributed<Flex>, 2>::random(
                    [3, 7],
                    Distribution::Uniform(0.0, 1.0),
                    device,
                ))
            })
            .collect::<Vec<_>>()
    };
    let alone = draw(&Default::default());
    let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
    let out =
        launch_ranks::<Flex, _, _>(&mesh, &Default::default(), &LaunchOptions::default(), |d| {
            draw(&d)
        })
        .unwrap();
    for per_rank in out {
        assert!(per_rank == alone);
    }
}
