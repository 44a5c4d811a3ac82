//! The training-step pieces of `wildfire-engine` on distributed layouts: one-collective overflow
//! agreement and a global gradient norm that equals the single-device norm.

use super::{Dist, Plain, sharded_mlp, threads};
use burn::backend::Flex;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;
use wildfire::demo::{
    Classifier, EncoderClassifier, EncoderClassifierConfig, Mlp, SyntheticTask, deterministic_init,
};
use wildfire::engine::{DynamicLossScaler, LossScalerConfig, StepDecision, unscale_check_clip};
use wildfire::models::CausalLm;
use wildfire::parallel::{
    CollectiveKind, DTensor, DeviceMesh, Distributed, FsdpStrategy, TpPlan, TpStyle, dtensor,
    from_dtensor, fully_shard, sync_gradients, tensor_parallel,
};

fn task() -> SyntheticTask {
    super::task(4, 41)
}

fn loss_of<B: burn::tensor::backend::AutodiffBackend, M: Classifier<B>>(
    m: &M,
    rows: std::ops::Range<usize>,
    device: &B::Device,
) -> Tensor<B, 1> {
    let n = rows.len();
    let (x, y) = task().batch(0, rows);
    let x = Tensor::<B, 3>::from_data(x, device);
    let y = Tensor::<B, 1, Int>::from_data(TensorData::new(y, [n]), device);
    burn::nn::loss::CrossEntropyLossConfig::new()
        .init(device)
        .forward(m.logits(x), y)
}

/// The loss of micro-batch `i` (2 rows) of `rank`'s 4 rows; when `poison`, infinite on rank 1's
/// second micro-batch.
fn micro_batch_loss(
    m: &Mlp<Dist>,
    rank: usize,
    i: usize,
    poison: bool,
    device: &wildfire::parallel::DistDevice<Flex>,
) -> Tensor<Dist, 1> {
    let rows = rank * 4 + i * 2..rank * 4 + i * 2 + 2;
    let loss = loss_of(m, rows, device);
    if poison && rank == 1 && i == 1 {
        loss.mul_scalar(f32::INFINITY)
    } else {
        loss
    }
}

fn model<B: Backend>(device: &B::Device) -> EncoderClassifier<B> {
    deterministic_init(
        EncoderClassifierConfig::new()
            .with_n_layers(1)
            .with_n_heads(2)
            .init(device),
        7,
    )
}

/// ‖g‖ of a plain model's gradients.
fn plain_norm() -> f32 {
    struct Sum<'a>(&'a GradientsParams, f64);
    impl ModuleVisitor<Plain> for Sum<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Plain, D>>) {
            if let Some(g) = self.0.get::<Flex, D>(param.id) {
                self.1 += f64::from(g.powi_scalar(2).sum().into_scalar());
            }
        }
    }
    let device = Default::default();
    let m = model::<Plain>(&device);
    let grads = GradientsParams::from_grads(loss_of(&m, 0..8, &device).backward(), &m);
    let mut s = Sum(&grads, 0.0);
    m.visit(&mut s);
    s.1.sqrt() as f32
}

/// The global norm from `unscale_check_clip` equals the single-device norm under DDP, FullShard
/// and tensor parallelism, with one all-reduce; clipping brings it to the bound.
#[test]
fn global_norm_matches_one_device_on_every_layout() {
    let reference = plain_norm();
    let plan = TpPlan::new()
        .with("encoder.layers.*.mha.query|key|value", TpStyle::Colwise)
        .with("encoder.layers.*.mha.output", TpStyle::Rowwise)
        .with("encoder.layers.*.pwff.linear_inner", TpStyle::Colwise)
        .with("encoder.layers.*.pwff.linear_outer", TpStyle::Rowwise);
    for (name, mesh, fsdp, tp) in [
        (
            "ddp",
            DeviceMesh::new([("dp", 2)]).unwrap(),
            FsdpStrategy::NoShard,
            false,
        ),
        (
            "fsdp",
            DeviceMesh::new([("dp", 2)]).unwrap(),
            FsdpStrategy::FullShard,
            false,
        ),
        (
            "tp",
            DeviceMesh::new([("dp", 1), ("tp", 2)]).unwrap(),
            FsdpStrategy::NoShard,
            true,
        ),
        (
            "dp×tp fsdp",
            DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap(),
            FsdpStrategy::FullShard,
            true,
        ),
    ] {
        let out = threads(&mesh, |device| {
            let m = model::<Dist>(&device);
            let m = if tp {
                tensor_parallel(m, &mesh, &plan).unwrap()
            } else {
                m
            };
            let m = fully_shard(m, &mesh, fsdp).unwrap();
            let dp = mesh
                .axis_index("dp")
                .map(|a| mesh.axis_size(a))
                .unwrap_or(1);
            let dp_index = mesh.coords(device.rank())[0];
            let rows = dp_index * 8 / dp..(dp_index + 1) * 8 / dp;
            let mut grads = GradientsParams::from_grads(loss_of(&m, rows, &device).backward(), &m);
            sync_gradients(&m, &mut grads).unwrap();
            let before = device.context().comm().stats();
            let check = unscale_check_clip(&m, &mut grads, 1.0, Some(reference / 2.0)).unwrap();
            let reductions = device
                .context()
                .comm()
                .stats()
                .since(&before)
                .count(CollectiveKind::AllReduce);
            let after = unscale_check_clip(&m, &mut grads, 1.0, None).unwrap();
            (check, reductions, after.norm)
        });
        for (rank, (check, reductions, clipped)) in out.iter().enumerate() {
            assert!(!check.found_inf);
            assert!(
                (check.norm - reference).abs() <= 1e-5 * reference,
                "{name} rank {rank}: {} vs {reference}",
                check.norm
            );
            assert_eq!(
                *reductions, 1,
                "{name}: one all-reduce for overflow and norm"
            );
            assert!(
                (clipped - reference / 2.0).abs() <= 1e-4 * reference,
                "{name}: clipped to {clipped}"
            );
        }
    }
}

/// An overflow on rank 1 only: every rank sees it in the same collective and every rank's scaler
/// skips the step and halves the scale.
#[test]
fn overflow_on_one_rank_makes_every_rank_skip() {
    let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
    let out = threads(&mesh, |device| {
        let m = sharded_mlp(&device, &mesh, [4, 8, 3], 1, FsdpStrategy::NoShard);
        let scaler_config = LossScalerConfig::default();
        let mut scaler = DynamicLossScaler::new(scaler_config);
        let loss = loss_of(&m, device.rank() * 4..device.rank() * 4 + 4, &device)
            .mul_scalar(scaler.scale());
        let mut grads = GradientsParams::from_grads(loss.backward(), &m);
        sync_gradients(&m, &mut grads).unwrap();
        if device.rank() == 1 {
            // Inject an infinity into this rank's copy of the first parameter's gradient.
            struct Poison<'a>(&'a mut GradientsParams, bool);
            impl ModuleVisitor<Dist> for Poison<'_> {
                fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Dist, D>>) {
                    if self.1 {
                        return;
                    }
                    let g = self.0.remove::<Distributed<Flex>, D>(param.id).unwrap();
                    let t = dtensor(&g);
                    let local = Tensor::<Flex, D>::from_primitive(
                        burn::tensor::TensorPrimitive::Float(t.local().clone()),
                    );
                    let poisoned = local.add_scalar(f32::INFINITY).into_primitive().tensor();
                    let g = from_dtensor::<Distributed<Flex>, D>(
                        DTensor::from_local(poisoned, t.layout().clone(), t.device()).unwrap(),
                    );
                    self.0.register::<Distributed<Flex>, D>(param.id, g);
                    self.1 = true;
                }
            }
            m.visit(&mut Poison(&mut grads, false));
        }
        let check = unscale_check_clip(&m, &mut grads, 1.0 / scaler.scale(), Some(1.0)).unwrap();
        let decision = scaler.update(check.found_inf);
        (check.found_inf, decision, scaler.scale())
    });
    for (found_inf, decision, scale) in out {
        assert!(found_inf);
        assert_eq!(decision, StepDecision::Skip);
        assert_eq!(scale, 32768.0);
    }
}

/// Pure f16 (parameters, gradients and AdamW state in f16, no loss scaling) goes wrong where the
/// mixed-precision step (f32 master weights, f16 compute, dynamic loss scaling; the
/// `mixed_precision_tracks_f32` test) tracks f32: a tiny GPT memorising one batch.
#[test]
fn pure_f16_without_scaling_fails() {
    use burn::module::ModuleMapper;
    use burn::optim::{AdamWConfig, Optimizer};
    use burn::tensor::FloatDType;
    use wildfire::models::gpt::Gpt;
    struct Cast(FloatDType);
    impl ModuleMapper<Plain> for Cast {
        fn map_float<const D: usize>(
            &mut self,
            param: Param<Tensor<Plain, D>>,
        ) -> Param<Tensor<Plain, D>> {
            let (id, t, mapper) = param.consume();
            Param::from_mapped_value(id, t.cast(self.0).detach().require_grad(), mapper)
        }
    }
    let device = Default::default();
    let train = |dtype: FloatDType| -> Vec<f32> {
        let mut model: Gpt<Plain> = super::small_gpt(2, 5)
            .init(&device)
            .unwrap()
            .map(&mut Cast(dtype));
        let mut optim = AdamWConfig::new().init();
        let ids = |shift: usize| {
            let v: Vec<i64> = (0..4 * 16)
                .map(|i| ((i * 13 + shift) % 64) as i64)
                .collect();
            Tensor::<Plain, 2, Int>::from_data(TensorData::new(v, [4, 16]), &device)
        };
        (0..40)
            .map(|_| {
                let loss = model.loss(ids(0), ids(1));
                let value = loss.clone().into_scalar().elem::<f32>();
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optim.step(3e-3, model.clone(), grads);
                value
            })
            .collect()
    };
    let f32_losses = train(FloatDType::F32);
    let f16_losses = train(FloatDType::F16);
    eprintln!("f32: {f32_losses:?}\nf16: {f16_losses:?}");
    // f32 memorises the batch (measured: 4.19 -> 1.14 in 40 steps).
    assert!(f32_losses[39] < 0.5 * f32_losses[0], "{f32_losses:?}");
    // Pure f16 does not: AdamW's ε = 1e-8 and the squared gradients underflow to 0 in f16, so the
    // first steps divide by ~0 and blow the loss up (measured 4.20 -> 7.68), after which it stalls
    // (4.21 at step 40) — or it is NaN outright.
    let last = f16_losses[39];
    assert!(
        !last.is_finite() || last > 0.9 * f16_losses[0],
        "pure f16 trained: {f16_losses:?}"
    );
    assert!(
        f16_losses
            .iter()
            .any(|l| !l.is_finite() || *l > 1.5 * f16_losses[0]),
        "{f16_losses:?}"
    );
}

/// `StepRunner` end to end on 2 ranks (FullShard, 2 micro-batches, f16-style loss scale): a finite
/// step updates the model and counts towards growth; a micro-batch whose loss overflows on rank 1
/// only makes both ranks skip (parameters untouched) and halves the scale.
#[test]
fn step_runner_steps_and_skips_together() {
    use burn::optim::AdamWConfig;
    use wildfire::engine::{StepRunner, StepRunnerConfig};
    use wildfire::parallel::FsdpOptimizer;
    let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
    let out = threads(&mesh, |device| {
        let rank = device.rank();
        let mut m = sharded_mlp(&device, &mesh, [4, 8, 3], 1, FsdpStrategy::FullShard);
        let mut optim = FsdpOptimizer::new(AdamWConfig::new().init::<Dist, Mlp<Dist>>());
        let mut step = StepRunner::new(
            StepRunnerConfig::default(),
            Some(DynamicLossScaler::new(LossScalerConfig::default())),
        );
        let mut records = Vec::new();
        for poison in [false, true] {
            let before = wildfire::demo::parameters(&m);
            let (next, record) = step
                .run(
                    &device,
                    m,
                    &mut optim,
                    None,
                    1e-2,
                    &[1, 2],
                    |m, i, _ckpt| micro_batch_loss(m, rank, i, poison, &device),
                )
                .unwrap();
            m = next;
            let changed = wildfire::demo::parameters(&m) != before;
            records.push((record.skipped, record.loss_scale, changed));
        }
        records.push((false, step.scaler().unwrap().scale(), false));
        records
    });
    for records in out {
        assert_eq!(
            records,
            vec![
                (false, 65536.0, true),
                (true, 65536.0, false),
                (false, 32768.0, false)
            ]
        );
    }
}

/// A step on the fused tail reads the device once: the loss, the overflow flag and `Σg²` in one
/// read after the last backward (counted by the decorator: `OpCounters::host_reads`), with one
/// micro-batch and with four, on one rank and FullShard over two.
#[test]
fn one_host_read_per_step() {
    use wildfire::engine::FusedAdamW;
    for (dp, strategy) in [(1, FsdpStrategy::NoShard), (2, FsdpStrategy::FullShard)] {
        let reads = host_reads_per_step(dp, strategy, || {
            FusedAdamW::<Flex>::optimizer::<Mlp<Dist>>(tail_adamw())
        });
        for (rank, reads) in reads.iter().enumerate() {
            assert_eq!(
                reads,
                &[(1, 0); 4],
                "dp {dp} rank {rank}: host reads per step"
            );
        }
    }
}

/// With the optimizer offloaded to the host, a step reads the tail's one buffer and then each
/// parameter's piece and its gradient's once (2 reads × the MLP's 4 tensors): the clipping
/// coefficient and the skip flag come as the host computed them, not read back from the device
/// per parameter. Each of the 4 host steps is handed to the optimizer's thread.
#[test]
fn offloaded_optimizer_reads_each_piece_once_per_step() {
    use wildfire::engine::OffloadAdamW;
    for (dp, strategy) in [(1, FsdpStrategy::NoShard), (2, FsdpStrategy::FullShard)] {
        let reads = host_reads_per_step(dp, strategy, || {
            OffloadAdamW::<Flex>::optimizer::<Mlp<Dist>>(tail_adamw())
        });
        for (rank, reads) in reads.iter().enumerate() {
            assert_eq!(
                reads,
                &[(9, 4); 4],
                "dp {dp} rank {rank}: host reads and steps handed to the optimizer's thread, \
                 per step"
            );
        }
    }
}

fn tail_adamw() -> wildfire::engine::FusedAdamWConfig {
    wildfire::engine::FusedAdamWConfig {
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-5,
        weight_decay: 1e-4,
        ..Default::default()
    }
}

/// Each rank's host reads and offloaded steps handed to the optimizer's thread in four steps of an MLP on `dp` ranks (`strategy`), with clipping and
/// loss scaling, of one micro-batch, four, one and four: the optimizer and its tail inputs from
/// `optimizer`.
fn host_reads_per_step<O>(
    dp: usize,
    strategy: FsdpStrategy,
    optimizer: impl Fn() -> (O, wildfire::engine::TailInputs<Flex>) + Sync,
) -> Vec<Vec<(u64, u64)>>
where
    O: burn::optim::Optimizer<Mlp<Dist>, Dist>,
{
    use wildfire::engine::{StepRunner, StepRunnerConfig};
    use wildfire::parallel::FsdpOptimizer;
    let mesh = DeviceMesh::new([("dp", dp)]).unwrap();
    threads(&mesh, |device| {
        let rank = device.rank();
        let (adamw, inputs) = optimizer();
        let mut m = sharded_mlp(&device, &mesh, [4, 8, 3], 1, strategy);
        let mut optim = FsdpOptimizer::new(adamw);
        let config = StepRunnerConfig {
            clip: Some(0.05),
            ..StepRunnerConfig::default()
        };
        let mut step = StepRunner::new(
            config,
            Some(DynamicLossScaler::new(LossScalerConfig::default())),
        );
        let mut reads = Vec::new();
        for seeds in [&[1u64][..], &[1, 2, 3, 4], &[5], &[6, 7, 8, 9]] {
            device.context().reset_counters();
            let (next, record) = step
                .run(
                    &device,
                    m,
                    &mut optim,
                    Some(&inputs),
                    1e-2,
                    seeds,
                    |m, i, _| micro_batch_loss(m, rank, i % 2, false, &device),
                )
                .unwrap();
            m = next;
            assert!(record.loss.is_finite() && !record.skipped);
            let counters = device.context().counters();
            let handed = counters.work.get(wildfire::engine::HANDED_TO_ITS_THREAD);
            reads.push((counters.host_reads, handed.copied().unwrap_or(0)));
        }
        reads
    })
}

/// The fused optimizer tail (`StepRunner::run` with its tail inputs + `FusedAdamW`: one unscale + Σg² + overflow
/// pass per gradient, one AdamW pass per parameter, clipping coefficient and skip flag on the
/// device) follows Burn's AdamW through `StepRunner::run` step by step — DDP, ZeRO-1 (gradients on
/// another layout than the parameters) and FullShard on 2 ranks, with clipping active and an
/// overflow on rank 1 only at step 2 (both skip, parameters untouched, the scale halves) —
/// losses and parameters within 1e-5 of each tensor's scale, the same norms and decisions.
#[test]
fn fused_optimizer_tail_follows_burn_adamw() {
    use burn::optim::AdamWConfig;
    use wildfire::engine::{FusedAdamW, FusedAdamWConfig, StepRunner, StepRunnerConfig};
    use wildfire::parallel::FsdpOptimizer;
    let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
    for strategy in [
        FsdpStrategy::NoShard,
        FsdpStrategy::ShardOptimizer,
        FsdpStrategy::FullShard,
    ] {
        let out = threads(&mesh, |device| {
            let rank = device.rank();
            let model = || sharded_mlp(&device, &mesh, [4, 8, 3], 1, strategy);
            let config = StepRunnerConfig {
                clip: Some(0.05),
                ..StepRunnerConfig::default()
            };
            let scaler = || Some(DynamicLossScaler::new(LossScalerConfig::default()));
            let loss = |m: &Mlp<Dist>, i: usize, poison: bool| {
                micro_batch_loss(m, rank, i, poison, &device)
            };
            // Burn's AdamW.
            let (mut m, mut optim) = (
                model(),
                FsdpOptimizer::new(AdamWConfig::new().init::<Dist, Mlp<Dist>>()),
            );
            let mut step = StepRunner::new(config, scaler());
            let mut burn = Vec::new();
            for s in 0..5 {
                let (next, r) = step
                    .run(&device, m, &mut optim, None, 1e-2, &[1, 2], |m, i, _| {
                        loss(m, i, s == 2)
                    })
                    .unwrap();
                m = next;
                burn.push((r, wildfire::demo::parameters(&m)));
            }
            // The fused tail.
            let (adamw, inputs) = FusedAdamW::<Flex>::optimizer::<Mlp<Dist>>(FusedAdamWConfig {
                beta1: 0.9,
                beta2: 0.999,
                epsilon: 1e-5,
                weight_decay: 1e-4,
                ..FusedAdamWConfig::default()
            });
            let (mut m, mut optim) = (model(), FsdpOptimizer::new(adamw));
            let mut step = StepRunner::new(config, scaler());
            let mut fused = Vec::new();
            for s in 0..5 {
                let (next, r) = step
                    .run(
                        &device,
                        m,
                        &mut optim,
                        Some(&inputs),
                        1e-2,
                        &[1, 2],
                        |m, i, _| loss(m, i, s == 2),
                    )
                    .unwrap();
                m = next;
                fused.push((r, wildfire::demo::parameters(&m)));
            }
            (burn, fused)
        });
        for (rank, (burn, fused)) in out.iter().enumerate() {
            for (s, ((a, pa), (b, pb))) in crate::suite::pairs(burn, fused).enumerate() {
                let what = format!("{strategy:?} rank {rank} step {s}");
                assert_eq!(
                    (a.skipped, a.loss_scale),
                    (b.skipped, b.loss_scale),
                    "{what}"
                );
                assert_eq!(a.skipped, s == 2, "{what}");
                if !a.skipped {
                    assert!(
                        (a.loss - b.loss).abs() <= 1e-5 * a.loss.abs(),
                        "{what}: loss {} vs {}",
                        a.loss,
                        b.loss
                    );
                    assert!(
                        (a.grad_norm - b.grad_norm).abs() <= 1e-5 * a.grad_norm,
                        "{what}: norm {} vs {}",
                        a.grad_norm,
                        b.grad_norm
                    );
                    // Clipping is active (the norm is above 0.05).
                    assert!(a.grad_norm > 0.05, "{what}");
                }
                for (i, (p, q)) in crate::suite::pairs(pb, pa).enumerate() {
                    super::close(&format!("{what} param {i}"), p, q);
                }
            }
            // The skipped step left the parameters as they were.
            assert_eq!(fused[2].1, fused[1].1, "{strategy:?} rank {rank}");
        }
    }
}

/// The casts a small GPT of `l` blocks counts in a step of `a` micro-batches under a bf16 compute
/// dtype (see [`bf16_casts_each_weight_once_per_step`]): each micro-batch's values, and with
/// `weights` the weights the forward casts (once per step).
fn gpt_casts(l: u64, a: u64, weights: bool) -> std::collections::BTreeMap<&'static str, u64> {
    let mut casts: std::collections::BTreeMap<_, _> = [
        ("linear", a),
        ("fused_layer_norm", (2 * l + 1) * a),
        ("float_add", 2 * l * a),
        ("fused_cross_entropy", a),
        ("fused_cross_entropy_backward", a),
        ("linear_weight_backward", (4 * l + 1) * a),
        ("linear_bias_backward", l * a),
        ("fused_gelu_bias_backward", l * a),
        ("linear_x_backward", 2 * l * a),
        ("fused_layer_norm_backward", (2 * l + 1) * a),
    ]
    .into_iter()
    .collect();
    if weights {
        *casts.get_mut("linear").unwrap() += 7 * l;
        casts.insert("fused_gelu_bias", l);
    }
    casts
}

/// Sets the bf16 compute dtype on `device`'s rank and gives the casts tests' token batches
/// (`[2, 16]` ids of a 64-token vocabulary, shifted by the micro-batch).
fn bf16_batches(
    device: &wildfire::parallel::DistDevice<Flex>,
) -> impl Fn(usize) -> Tensor<Dist, 2, Int> + '_ {
    device
        .context()
        .update_policy(|p| p.compute_dtype = Some(burn::tensor::FloatDType::BF16));
    move |shift: usize| {
        let v: Vec<i64> = (0..2 * 16)
            .map(|i| ((i * 13 + shift) % 64) as i64)
            .collect();
        Tensor::<Dist, 2, Int>::from_data(TensorData::new(v, [2, 16]), device)
    }
}

/// The casts each of three steps counts (1, 3 and 1 micro-batches of [`bf16_batches`]) and their
/// losses, for a small GPT of `l` blocks under `optim` (with the fused tail's inputs `tail`),
/// each step's model handed to `next` before the following step.
fn casts_over_three_steps<O>(
    device: &wildfire::parallel::DistDevice<Flex>,
    l: u64,
    optim: &mut O,
    tail: Option<&wildfire::engine::TailInputs<Flex>>,
    next: impl Fn(wildfire::models::gpt::Gpt<Dist>) -> wildfire::models::gpt::Gpt<Dist>,
) -> (Vec<std::collections::BTreeMap<&'static str, u64>>, Vec<f32>)
where
    O: burn::optim::Optimizer<wildfire::models::gpt::Gpt<Dist>, Dist>,
{
    use wildfire::engine::{StepRunner, StepRunnerConfig};
    let ids = bf16_batches(device);
    let mut model: wildfire::models::gpt::Gpt<Dist> =
        super::small_gpt(l as usize, 5).init(device).unwrap();
    let mut step = StepRunner::new(StepRunnerConfig::default(), None);
    let (mut counted, mut losses) = (Vec::new(), Vec::new());
    for seeds in [&[1u64][..], &[1, 2, 3], &[4]] {
        device.context().reset_counters();
        let (stepped, record) = step
            .run(device, model, optim, tail, 1e-3, seeds, |m, i, hooks| {
                m.loss_with(ids(i), ids(i + 1), hooks)
            })
            .unwrap();
        model = next(stepped);
        assert!(record.loss.is_finite() && !record.skipped);
        losses.push(record.loss);
        counted.push(device.context().counters().casts);
    }
    (counted, losses)
}

/// The fused AdamW writes each weight's bf16 copy in the pass that updates it
/// (`FusedOps::fused_adamw_with_copy`), for every parameter the forward used in bf16: after the
/// first step (whose forward casts them, as in [`bf16_casts_each_weight_once_per_step`]), no
/// step casts a weight again — only the per-micro-batch values remain (the tied head's fresh
/// transpose among them). The copies are the casts bit for bit (the kernel test
/// `check_optimizer_tail`), so the steps' numbers do not change: the losses equal, to the bit,
/// those of the same run with every parameter rebuilt after each step (no copy kept: each
/// forward casts its weights again).
#[test]
fn fused_adamw_writes_the_bf16_weights_for_the_next_forward() {
    use burn::module::ModuleMapper;
    use wildfire::engine::{FusedAdamW, FusedAdamWConfig};
    use wildfire::models::gpt::Gpt;
    use wildfire::parallel::FsdpOptimizer;
    /// Each parameter as a new value (`· 1`, bit for bit), without the copy its old value kept.
    struct Fresh;
    impl ModuleMapper<Dist> for Fresh {
        fn map_float<const D: usize>(
            &mut self,
            param: Param<Tensor<Dist, D>>,
        ) -> Param<Tensor<Dist, D>> {
            let (id, t, mapper) = param.consume();
            Param::from_mapped_value(id, t.mul_scalar(1.0).detach().require_grad(), mapper)
        }
    }
    let l: u64 = 2;
    let mesh = DeviceMesh::new([("dp", 1)]).unwrap();
    let runs = threads(&mesh, |device| {
        // The fused step hands the copies on, or the parameters are rebuilt without them after
        // each step (each forward casts its weights again).
        let run = |copies: bool| {
            let (adamw, inputs) =
                FusedAdamW::<Flex>::optimizer::<Gpt<Dist>>(FusedAdamWConfig::default());
            let mut optim = FsdpOptimizer::new(adamw);
            let next = |m: Gpt<Dist>| if copies { m } else { m.map(&mut Fresh) };
            casts_over_three_steps(&device, l, &mut optim, Some(&inputs), next)
        };
        (run(true), run(false))
    });
    let ((counted, losses), (burn_counted, burn_losses)) = &runs[0];
    // After a fused step no weight is cast: only the values of each micro-batch (the tied
    // head's transpose among them); rebuilt parameters keep no copy, every step casts again.
    let (cast_again, later) = (|a| gpt_casts(l, a, true), |a| gpt_casts(l, a, false));
    assert_eq!(
        counted,
        &vec![cast_again(1), later(3), later(1)],
        "casts per step (1, 3, 1 micro-batches)"
    );
    assert_eq!(
        burn_counted,
        &vec![cast_again(1), cast_again(3), cast_again(1)],
        "casts per step without the copies"
    );
    assert_eq!(losses, burn_losses, "the copies are the casts");
}

/// Mixed precision without per-op casts (what `torch.autocast`'s cast cache does): under a bf16
/// compute dtype each f32 weight is cast once per step — not once per use, per micro-batch, per
/// backward pass — and the activations between matmuls stay bf16. The decorator counts every
/// cast by the rule that asked for it; a tiny GPT (2 layers, tied embedding) trained by
/// `StepRunner::run` with one micro-batch, with three, and with one again (after an update the
/// new weights are cast again) casts exactly:
/// - once per step, the weights: `linear` the 7 weights and biases of each block's
///   projections (the MLP's first bias goes with the GELU: `fused_gelu_bias`);
/// - per micro-batch forward: the output of each LayerNorm into bf16 (`2L + 1`), the bf16
///   branch of each residual add promoted to the f32 stream (`float_add`, `2L`), the tied
///   head's weight (a fresh transpose of the embedding each micro-batch, `linear`), the loss back
///   to f32 (`fused_cross_entropy`);
/// - per micro-batch backward: the loss gradient into the logits' bf16, each weight gradient
///   back to f32 (`linear_weight_backward`, `4L + 1`; the first projection's bias gradient
///   `linear_bias_backward`, `L`; the GELU's bias `fused_gelu_bias_backward`, `L`), the f32
///   residual gradient into bf16 once for both uses by the two projections that write the
///   stream (`linear_x_backward`, `2L`), and each LayerNorm's bf16 input gradient to its f32
///   input (`fused_layer_norm_backward`, `2L + 1`).
///
/// GPT-2 124M under this count casts 12·7 + 12 = 96 weights a step and 14·12 + 6 = 174 values
/// per micro-batch, against the 478 casts per step the H100 profile showed before the cache.
#[test]
fn bf16_casts_each_weight_once_per_step() {
    use burn::optim::AdamWConfig;
    let l: u64 = 2;
    let mesh = DeviceMesh::new([("dp", 1)]).unwrap();
    let counted = threads(&mesh, |device| {
        let mut optim = AdamWConfig::new().init();
        casts_over_three_steps(&device, l, &mut optim, None, |m| m).0
    });
    let expected = |a: u64| gpt_casts(l, a, true);
    assert_eq!(
        counted[0],
        vec![expected(1), expected(3), expected(1)],
        "casts per step (1, 3, 1 micro-batches)"
    );
}
