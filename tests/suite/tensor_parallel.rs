//! Tensor parallelism on a stock burn-nn `TransformerEncoder` classifier: a plan on the module
//! paths, parity with one device (tp = 2 and 4, and tp × FSDP on a 2 × 2 mesh), Megatron's
//! collective count per block, and plan errors found before anything changes.

use super::{Dist, Plain, close, small_gpt, threads};
use burn::backend::Flex;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, SgdConfig};
use wildfire::demo::{
    EncoderClassifier, EncoderClassifierConfig, SyntheticTask, deterministic_init, parameters,
    train,
};
use wildfire::models::CausalLm;
use wildfire::parallel::{
    CollectiveKind, DeviceMesh, Distributed, Error, FsdpOptimizer, FsdpStrategy, LaunchOptions,
    TpPlan, TpStyle, fully_shard, launch_ranks, replicate, sync_gradients, tensor_parallel,
};

const STEPS: usize = 10;
const BATCH: usize = 8;
const LAYERS: usize = 2;

fn config() -> EncoderClassifierConfig {
    EncoderClassifierConfig::new()
        .with_n_layers(LAYERS)
        .with_n_heads(4)
}

fn task() -> SyntheticTask {
    super::task(4, 31)
}

/// Megatron's plan for burn-nn's encoder layer: q/k/v and the MLP's first layer column-wise, the
/// attention output and the MLP's second layer row-wise.
fn plan() -> TpPlan {
    TpPlan::new()
        .with_multi_head_attention("encoder.layers.*.mha", 4)
        .with("encoder.layers.*.pwff.linear_inner", TpStyle::Colwise)
        .with("encoder.layers.*.pwff.linear_outer", TpStyle::Rowwise)
}

fn sgd() -> SgdConfig {
    SgdConfig::new().with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
}

fn reference() -> (Vec<f32>, Vec<Vec<f32>>) {
    let device = Default::default();
    let m: EncoderClassifier<Plain> = deterministic_init(config().init(&device), 3);
    let (m, log) = train(
        m,
        &mut sgd().init(),
        &task(),
        STEPS,
        0.05,
        0..BATCH,
        &device,
        |_, _| {},
    );
    (log.losses, parameters(&m))
}

/// Losses, parameters, one step's collectives, fallback count.
type RankResult = (Vec<f32>, Vec<Vec<f32>>, wildfire::parallel::CommStats, u64);

/// Run on `mesh` (a `tp` axis, optionally a `dp` axis with `fsdp`; `sp`: sequence parallelism,
/// keeping its gathers or not); returns per rank the losses, parameters, and the collectives of
/// the last step.
fn sharded(mesh: &DeviceMesh, fsdp: Option<FsdpStrategy>, sp: Option<bool>) -> Vec<RankResult> {
    let dp = mesh
        .axis_index("dp")
        .map(|a| mesh.axis_size(a))
        .unwrap_or(1);
    launch_ranks::<Flex, _, _>(
        mesh,
        &Default::default(),
        &LaunchOptions::default(),
        |device| {
            let m: EncoderClassifier<Dist> = deterministic_init(config().init(&device), 3);
            // Sequence parallelism: the norms' style in the plan.
            let plan = match sp {
                Some(keep) => plan()
                    .with("encoder.layers.*.norm_1|norm_2", TpStyle::SequenceParallel)
                    .with_keep_sequence_gathers(keep),
                None => plan(),
            };
            let m = tensor_parallel(m, mesh, &plan).unwrap();
            let m = match fsdp {
                Some(s) => fully_shard(m, mesh, s).unwrap(),
                None => replicate(m, mesh).unwrap(),
            };
            let coords = mesh.coords(device.rank());
            let dp_index = mesh.axis_index("dp").map(|a| coords[a]).unwrap_or(0);
            let rows = dp_index * BATCH / dp..(dp_index + 1) * BATCH / dp;
            let ctx = device.context().clone();
            let (m, log) = train(
                m,
                &mut FsdpOptimizer::new(sgd().init()),
                &task(),
                STEPS,
                0.05,
                rows,
                &device,
                |m, g: &mut GradientsParams| {
                    sync_gradients(m, g).unwrap();
                },
            );
            // One more forward + backward to count one step's collectives in isolation.
            ctx.reset_counters();
            let (m, _) = train(
                m,
                &mut FsdpOptimizer::new(sgd().init()),
                &task(),
                1,
                0.0,
                0..BATCH / dp,
                &device,
                |m, g| {
                    sync_gradients(m, g).unwrap();
                },
            );
            let last = ctx.comm().stats();
            let counters = ctx.counters();
            let fallbacks = counters.fallback_total();
            (log.losses, parameters(&m), last, fallbacks)
        },
    )
    .unwrap()
}

#[test]
fn tensor_parallel_matches_one_device_and_counts_collectives() {
    let (ref_losses, ref_params) = reference();
    for tp in [2, 4] {
        let mesh = DeviceMesh::new([("tp", tp)]).unwrap();
        for (rank, (losses, params, stats, fallbacks)) in
            sharded(&mesh, None, None).iter().enumerate()
        {
            close(&format!("tp={tp} rank {rank} loss"), losses, &ref_losses);
            for (i, (p, q)) in crate::suite::pairs(params, &ref_params).enumerate() {
                close(&format!("tp={tp} rank {rank} param {i}"), p, q);
            }
            // Per block and step: forward 2 (after attention and after the MLP: Megatron's `g`,
            // asserted alone below); backward 4, one per column-parallel layer (Megatron's `f`):
            // burn-nn's attention has separate q, k and v projections (Megatron fuses them: 2).
            assert_eq!(
                stats.count_on(CollectiveKind::AllReduce, "tp"),
                6 * LAYERS as u64,
                "tp={tp}\n{stats}"
            );
            assert_eq!(*fallbacks, 0, "tp={tp}: fallbacks");
        }
    }
}

#[test]
fn tensor_parallel_composes_with_fsdp_on_a_2x2_mesh() {
    let (ref_losses, ref_params) = reference();
    let mesh = DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap();
    let results = sharded(&mesh, Some(FsdpStrategy::FullShard), None);
    let mean: Vec<f32> = (0..STEPS)
        .map(|s| (results[0].0[s] + results[2].0[s]) / 2.0)
        .collect();
    close("dp×tp loss", &mean, &ref_losses);
    for (rank, (_, params, _, fallbacks)) in results.iter().enumerate() {
        for (i, (p, q)) in crate::suite::pairs(params, &ref_params).enumerate() {
            close(&format!("dp×tp rank {rank} param {i}"), p, q);
        }
        assert_eq!(*fallbacks, 0);
    }
}

/// Sequence parallelism on stock burn-nn encoder layers (tp = 2 and 4, and dp × tp with
/// FullShard; at tp = 2 also keeping the gathers): 10 SGD steps match one device (1e-5), no
/// fallback; per block and step the activation all-reduces are gone (reduce-scatters +
/// all-gathers instead).
#[test]
fn sequence_parallel_on_stock_layers_matches_one_device() {
    let (ref_losses, ref_params) = reference();
    let mut gathers = Vec::new();
    for (dp, tp, keep) in [(1, 2, false), (1, 4, false), (2, 2, false), (1, 2, true)] {
        let mesh = DeviceMesh::new([("dp", dp), ("tp", tp)]).unwrap();
        let fsdp = (dp > 1).then_some(FsdpStrategy::FullShard);
        let results = sharded(&mesh, fsdp, Some(keep));
        if dp == 1 && tp == 2 {
            gathers.push(results[0].2.count_on(CollectiveKind::AllGather, "tp"));
        }
        for (rank, (losses, params, stats, fallbacks)) in results.iter().enumerate() {
            if dp == 1 {
                close(&format!("sp tp={tp} rank {rank} loss"), losses, &ref_losses);
            }
            for (i, (p, q)) in crate::suite::pairs(params, &ref_params).enumerate() {
                close(&format!("sp dp={dp} tp={tp} rank {rank} param {i}"), p, q);
            }
            assert_eq!(*fallbacks, 0, "sp dp={dp} tp={tp}: fallbacks");
            assert!(
                stats.count_on(CollectiveKind::ReduceScatter, "tp") >= 4 * LAYERS as u64,
                "sp dp={dp} tp={tp}\n{stats}"
            );
            eprintln!("sp dp={dp} tp={tp} keep={keep} rank {rank}:\n{stats}");
        }
    }
    // Keeping the gathers: q, k and v share one forward gather of their input (not 3), and no
    // column-parallel layer gathers its input again in backward (4 per block: q, k, v, MLP).
    // burn-nn's layers are post-norm, so the first layer's attention input is the model input,
    // not sequence-sharded (no gather either way): 2·(L−1) fewer forward, 4·L − 3 fewer backward.
    // (Measured at L = 2: 13 → 6 all-gathers per step; forward 5 → 3.)
    let l = LAYERS as u64;
    assert_eq!(
        gathers[0] - gathers[1],
        2 * (l - 1) + 4 * l - 3,
        "{gathers:?}"
    );
}

#[test]
fn bad_plans_are_refused_before_anything_changes() {
    let mesh = DeviceMesh::new([("tp", 2)]).unwrap();
    let errors = threads(&mesh, |device| {
        let m = || -> EncoderClassifier<Dist> { config().init(&device) };
        let none = tensor_parallel(
            m(),
            &mesh,
            &TpPlan::new().with("encoder.layers.*.attention", TpStyle::Colwise),
        )
        .unwrap_err();
        let twice = tensor_parallel(
            m(),
            &mesh,
            &TpPlan::new()
                .with("encoder.layers.*.mha.query", TpStyle::Colwise)
                .with("encoder.layers.0.mha.*", TpStyle::Rowwise),
        )
        .unwrap_err();
        let odd =
            tensor_parallel(m(), &mesh, &TpPlan::new().with("head", TpStyle::Colwise)).unwrap_err();
        let no_axis =
            tensor_parallel(m(), &DeviceMesh::new([("dp", 2)]).unwrap(), &plan()).unwrap_err();
        // One head does not split over tp = 2, although the q/k/v weights' width divides.
        let one_head = config().with_n_heads(1).init::<Dist>(&device);
        let heads = tensor_parallel(
            one_head,
            &mesh,
            &TpPlan::new().with_multi_head_attention("encoder.layers.*.mha", 1),
        )
        .unwrap_err();
        let no_heads = tensor_parallel(m(), &mesh, &plan().with_heads("encoder.layers.*.attn", 4))
            .unwrap_err();
        (none, twice, odd, no_axis, heads, no_heads)
    });
    let (_, _, _, _, heads, no_heads) = &errors[0];
    assert_eq!(
        heads,
        &Error::PlanHeads {
            module: "encoder.layers.0.mha".into(),
            heads: 1,
            tp: 2
        }
    );
    assert!(
        heads.to_string().contains("has 1 attention heads"),
        "{heads}"
    );
    assert!(
        matches!(no_heads, Error::PlanNoMatch(p) if p == "encoder.layers.*.attn"),
        "{no_heads}"
    );
    let (none, twice, odd, no_axis, _, _) = &errors[0];
    assert!(
        matches!(none, Error::PlanNoMatch(p) if p == "encoder.layers.*.attention"),
        "{none}"
    );
    assert!(matches!(twice, Error::PlanConflict { .. }), "{twice}");
    assert!(
        matches!(
            odd,
            Error::PlanIndivisible {
                dim: 1,
                size: 3,
                tp: 2,
                ..
            }
        ),
        "{odd}"
    );
    assert!(matches!(no_axis, Error::NoTpAxis(_)), "{no_axis}");
}

/// Forward only: exactly two all-reduces per block (Megatron's `g` after the row-parallel
/// attention output and MLP output), nothing else, no fallback.
#[test]
fn tensor_parallel_forward_has_two_all_reduces_per_block() {
    use burn::prelude::*;
    use wildfire::demo::Classifier;
    let mesh = DeviceMesh::new([("tp", 2)]).unwrap();
    let counts = threads(&mesh, |device| {
        let m: EncoderClassifier<Dist> = deterministic_init(config().init(&device), 3);
        let m = tensor_parallel(m, &mesh, &plan()).unwrap();
        device.context().reset_counters();
        let (x, _) = task().batch(0, 0..BATCH);
        let logits = m.logits(Tensor::<Dist, 3>::from_data(x, &device));
        let stats = device.context().comm().stats();
        drop(logits);
        (
            stats.count(CollectiveKind::AllReduce),
            stats.total_count(),
            device.context().counters().fallback_total(),
        )
    });
    for (all_reduce, total, fallbacks) in counts {
        assert_eq!(
            (all_reduce, total, fallbacks),
            (2 * LAYERS as u64, 2 * LAYERS as u64, 0)
        );
    }
}

/// Our GPT under its plan (tp = 2, vocabulary-parallel embedding and loss-parallel
/// cross-entropy): exactly Megatron's collectives, and no fallback (the q/k/v split of the head-grouped `c_attn` stays local,
/// and so does its backward's slice-assign).
#[test]
fn gpt_tensor_parallel_has_megatron_collectives_and_no_fallback() {
    use burn::prelude::*;
    let mesh = DeviceMesh::new([("dp", 1), ("tp", 2)]).unwrap();
    let out = threads(&mesh, |device| {
        let m = tp_gpt(&mesh, &device, false, false);
        let ctx = device.context().clone();
        ctx.reset_counters();
        let x = Tensor::<Dist, 2, Int>::from_data(
            TensorData::new((0..32).map(|i| i % 64).collect::<Vec<i64>>(), [2, 16]),
            &device,
        );
        let loss = m.loss(x.clone(), x);
        let forward = ctx.comm().stats().count(CollectiveKind::AllReduce);
        let _grads = loss.backward();
        let stats = ctx.comm().stats();
        (
            forward,
            stats.count(CollectiveKind::AllReduce),
            ctx.counters().fallback_total(),
            stats.count(CollectiveKind::AllGather),
        )
    });
    // Megatron's count: per block 2 all-reduces forward and 2 backward (the fused q/k/v projection
    // and the MLP's first layer); around the blocks, the vocabulary-parallel embedding's partial
    // lookup (1), the loss-parallel cross-entropy's row max, row sum and target logit ([N, 1]
    // each, 3: the fused cross-entropy keeps the log-sum-exp, so its backward needs no
    // reduction), and in backward the tied output projection's input gradient (1). No
    // all-gather, no reduce-scatter: no rank holds the full logits or their gradient.
    for (forward, total, fallbacks, gathers) in out {
        assert_eq!(
            (forward, total, fallbacks, gathers),
            (2 * LAYERS as u64 + 4, 4 * LAYERS as u64 + 5, 0, 0)
        );
    }
}

/// Per-rank parameter bytes: every parameter the plan splits holds exactly 1/tp of its bytes,
/// the others stay whole.
#[test]
fn split_layers_hold_one_tp_th_of_their_bytes() {
    use burn::module::{ModuleVisitor, Param};
    use burn::prelude::*;
    struct Bytes(Vec<(usize, usize)>);
    impl ModuleVisitor<Dist> for Bytes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Dist, D>>) {
            let t = wildfire::parallel::dtensor(&param.val());
            let local: usize = t.local_shape().num_elements();
            self.0.push((local, t.global_shape().num_elements()));
        }
    }
    for tp in [2usize, 4] {
        let mesh = DeviceMesh::new([("tp", tp)]).unwrap();
        let out = threads(&mesh, |device| {
            let m = tensor_parallel(config().init::<Dist>(&device), &mesh, &plan()).unwrap();
            let mut b = Bytes(Vec::new());
            burn::module::Module::visit(&m, &mut b);
            b.0
        });
        let split = out[0]
            .iter()
            .filter(|(local, global)| local != global)
            .count();
        // Per layer: q, k, v, MLP-inner weights and biases (8), output and MLP-outer weights (2).
        assert_eq!(split, 10 * LAYERS, "tp={tp}");
        for (local, global) in &out[0] {
            assert!(
                *local == *global || *local * tp == *global,
                "tp={tp}: {local} of {global}"
            );
        }
    }
}

/// Megatron sequence parallelism on our GPT (tp = 2): the same loss and gradients as tensor
/// parallelism alone; the residual stream, LayerNorms and dropout hold half the sequence, so
/// fewer bytes are kept for backward; the activation all-reduces become reduce-scatters +
/// all-gathers (counted); no fallback.
#[test]
fn sequence_parallel_matches_tensor_parallel_and_shards_activations() {
    use burn::module::{ModuleVisitor, Param};
    use burn::prelude::*;
    struct Grads<'g>(&'g GradientsParams, Vec<Vec<f32>>);
    impl ModuleVisitor<Dist> for Grads<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Dist, D>>) {
            let g = self.0.get::<Distributed<Flex>, D>(param.id).unwrap();
            self.1.push(g.into_data().to_vec::<f32>().unwrap());
        }
    }
    let mesh = DeviceMesh::new([("dp", 1), ("tp", 2)]).unwrap();
    let run = |sp: bool, keep: bool| {
        threads(&mesh, |device| {
            let m = tp_gpt(&mesh, &device, sp, keep);
            let ctx = device.context().clone();
            ctx.reset_counters();
            let x = Tensor::<Dist, 2, Int>::from_data(
                TensorData::new((0..32).map(|i| (i * 5) % 64).collect::<Vec<i64>>(), [2, 16]),
                &device,
            );
            let y = Tensor::<Dist, 2, Int>::from_data(
                TensorData::new(
                    (0..32).map(|i| (i * 5 + 1) % 64).collect::<Vec<i64>>(),
                    [2, 16],
                ),
                &device,
            );
            let before = ctx.live_bytes();
            let loss = m.loss(x, y);
            let kept = ctx.live_bytes() - before;
            let stats = ctx.comm().stats();
            let count = |s: &wildfire::parallel::CommStats| {
                [
                    s.count(CollectiveKind::AllReduce),
                    s.count(CollectiveKind::AllGather),
                    s.count(CollectiveKind::ReduceScatter),
                ]
            };
            let forward = count(&stats);
            let grads = loss.clone().backward();
            let total = count(&ctx.comm().stats());
            let fallbacks = ctx.counters().fallback_total();
            let value = loss.into_scalar();
            let mut grads = GradientsParams::from_grads(grads, &m);
            sync_gradients(&m, &mut grads).unwrap();
            let mut g = Grads(&grads, Vec::new());
            m.visit(&mut g);
            (value, g.1, kept, forward, total, fallbacks)
        })
    };
    let tp = run(false, false);
    let sp = run(true, false);
    let keep = run(true, true);
    // A run's loss and every gradient within 1e-5 of the expected run's.
    type Values<'a> = (f32, &'a [Vec<f32>]);
    let same_values =
        |what: &str, (loss, grads): Values, (expected_loss, expected_grads): Values| {
            assert!(
                (loss - expected_loss).abs() <= 1e-5 * expected_loss.abs(),
                "{what} loss {loss} vs {expected_loss}"
            );
            for (i, (a, b)) in crate::suite::pairs(grads, expected_grads).enumerate() {
                close(&format!("{what} gradient {i}"), a, b);
            }
        };
    assert_eq!(keep.len(), tp.len(), "a flag per step");
    for ((t, s), k) in crate::suite::pairs(&tp, &sp).zip(&keep) {
        same_values("sp", (s.0, &s.1), (t.0, &t.1));
        assert!(s.2 < t.2, "kept for backward: sp {} vs tp {}", s.2, t.2);
        assert_eq!(s.5, 0, "fallbacks");
        // Forward. tp: per block 2 all-reduces, + embedding, + loss-parallel max, sum and target
        // logit (the fused cross-entropy).
        assert_eq!(t.3, [2 * LAYERS as u64 + 4, 0, 0]);
        // sp: per block the 2 all-reduces become 2 reduce-scatters (after the row-parallel
        // layers) + 2 all-gathers (before the column-parallel ones); the embedding's reduction a
        // reduce-scatter; the head's input an all-gather; loss-parallel max, sum and target logit
        // unchanged.
        assert_eq!(s.3, [3, 2 * LAYERS as u64 + 1, 2 * LAYERS as u64 + 1]);
        // Backward, tp: per block 2 all-reduces (the column-parallel input gradients), + the head's
        // input gradient (the fused cross-entropy's backward is local: the gradient stays split
        // over the vocabulary, the log-sum-exp is kept).
        let backward = |forward: [u64; 3], total: [u64; 3]| {
            [
                total[0] - forward[0],
                total[1] - forward[1],
                total[2] - forward[2],
            ]
        };
        assert_eq!(backward(t.3, t.4), [2 * LAYERS as u64 + 1, 0, 0]);
        // sp: per block 2 reduce-scatters (the column-parallel input gradients) and 4 all-gathers:
        // the row-parallel layers' output gradients (one gather shared by their input- and
        // weight-gradient ops) and, as Megatron-LM does, the column-parallel layers' inputs again
        // for their weight gradients (keeping them gathered would undo the memory saving); + the
        // head's (1 all-gather, 1 reduce-scatter), + the two embedding gradients' all-gathers.
        assert_eq!(
            backward(s.3, s.4),
            [0, 4 * LAYERS as u64 + 3, 2 * LAYERS as u64 + 1]
        );
        // Keeping the sequence gathers (`--sp-keep-gathers`): the same values; the count,
        // 2 all-gathers + 2 reduce-scatters per block each way — in backward the row-parallel
        // layers' output gradients are gathered and the column-parallel input gradients
        // reduce-scattered, the forward gathers reused for the weight gradients — and around the
        // blocks the head's input-gradient reduce-scatter and the embedding gradients'
        // all-gathers; more bytes kept than plain SP.
        same_values("keep", (k.0, &k.1), (s.0, &s.1));
        assert_eq!(k.5, 0, "fallbacks");
        assert_eq!(k.3, s.3, "forward");
        assert_eq!(
            backward(k.3, k.4),
            [0, 2 * LAYERS as u64 + 2, 2 * LAYERS as u64 + 1]
        );
        assert!(k.2 > s.2, "kept for backward: keep {} vs sp {}", k.2, s.2);
        eprintln!(
            "collectives [all-reduce, all-gather, reduce-scatter] fwd+bwd: tp {:?}, sp {:?}, sp keeping gathers {:?}; kept bytes tp {} sp {} keep {}",
            t.4, s.4, k.4, t.2, s.2, k.2
        );
    }
}

/// Our tiny GPT under its tensor-parallel plan on `mesh` (tp = 2), with or without sequence
/// parallelism.
fn tp_gpt(
    mesh: &DeviceMesh,
    device: &wildfire::parallel::DistDevice<Flex>,
    sp: bool,
    sp_keep_gathers: bool,
) -> wildfire::models::gpt::Gpt<Dist> {
    use wildfire::models::parallelize::{ParallelConfig, parallelize_gpt};
    parallelize_gpt(
        small_gpt(LAYERS, 7).init::<Dist>(device).unwrap(),
        mesh,
        &ParallelConfig {
            tp: 2,
            sp,
            sp_keep_gathers,
            ..ParallelConfig::default()
        },
    )
    .unwrap()
}

/// A small full transformer LM (our GPT: 4 heads, vocabulary-parallel embedding, loss-parallel
/// cross-entropy) over 10 SGD steps at tp = 2 and tp = 4, each with and without sequence
/// parallelism, and on a 2 × 2 mesh (dp × tp, FullShard, with SP): losses and every parameter
/// within 1e-5 of one device, no fallback.
#[test]
fn gpt_lm_tensor_parallel_matches_one_device() {
    use burn::prelude::*;
    use wildfire::models::gpt::{Gpt, GptConfig};
    use wildfire::models::parallelize::{ParallelConfig, parallelize_gpt};
    const LM_STEPS: usize = 10;
    const ROWS: usize = 4;
    let config = GptConfig {
        n_head: 4,
        ..small_gpt(LAYERS, 11)
    };
    let tokens = |rows: std::ops::Range<usize>, shift: i64| -> TensorData {
        let data: Vec<i64> = rows
            .clone()
            .flat_map(|r| (0..16).map(move |t| ((r as i64) * 7 + t * 5 + shift) % 64))
            .collect();
        TensorData::new(data, [rows.len(), 16])
    };
    /// Train `m` on `rows` of the batch; `sync` runs between backward and the step.
    fn train_lm<B: burn::tensor::backend::AutodiffBackend + wildfire::kernels::FusedOps>(
        mut m: Gpt<B>,
        mut optim: impl burn::optim::Optimizer<Gpt<B>, B>,
        x: TensorData,
        y: TensorData,
        device: &B::Device,
        mut sync: impl FnMut(&Gpt<B>, &mut GradientsParams),
    ) -> (Vec<f32>, Vec<Vec<f32>>) {
        let mut losses = Vec::new();
        for _ in 0..LM_STEPS {
            let loss = m.loss(
                Tensor::<B, 2, Int>::from_data(x.clone(), device),
                Tensor::<B, 2, Int>::from_data(y.clone(), device),
            );
            losses.push(loss.clone().into_data().to_vec::<f32>().unwrap()[0]);
            let mut grads = GradientsParams::from_grads(loss.backward(), &m);
            sync(&m, &mut grads);
            m = optim.step(0.05, m, grads);
        }
        (losses, parameters(&m))
    }
    let device = Default::default();
    let (ref_losses, ref_params) = train_lm(
        config.init::<Plain>(&device).unwrap(),
        sgd().init(),
        tokens(0..ROWS, 0),
        tokens(0..ROWS, 1),
        &device,
        |_, _| {},
    );
    for (dp, tp, sp) in [
        (1, 2, false),
        (1, 2, true),
        (1, 4, false),
        (1, 4, true),
        (2, 2, true),
    ] {
        let mesh = DeviceMesh::new([("dp", dp), ("tp", tp)]).unwrap();
        let results = threads(&mesh, |device| {
            let m = parallelize_gpt(
                config.init::<Dist>(&device).unwrap(),
                &mesh,
                &ParallelConfig {
                    dp,
                    tp,
                    sp,
                    fsdp: if dp > 1 {
                        FsdpStrategy::FullShard
                    } else {
                        FsdpStrategy::NoShard
                    },
                    ..ParallelConfig::default()
                },
            )
            .unwrap();
            let d = mesh.coords(device.rank())[0];
            let rows = d * ROWS / dp..(d + 1) * ROWS / dp;
            let out = train_lm(
                m,
                FsdpOptimizer::new(sgd().init()),
                tokens(rows.clone(), 0),
                tokens(rows, 1),
                &device,
                |m, g| {
                    sync_gradients(m, g).unwrap();
                },
            );
            // Reading values to the host (the loss, the parameters) is the test's doing.
            let counters = device.context().counters();
            let reads = counters
                .fallbacks
                .get("float_into_data")
                .copied()
                .unwrap_or(0);
            (out, counters.fallback_total() - reads)
        });
        for (rank, ((losses, params), fallbacks)) in results.iter().enumerate() {
            let what = format!("gpt dp={dp} tp={tp} sp={sp} rank {rank}");
            if dp == 1 {
                close(&format!("{what} loss"), losses, &ref_losses);
            }
            for (i, (p, q)) in crate::suite::pairs(params, &ref_params).enumerate() {
                close(&format!("{what} param {i}"), p, q);
            }
            assert_eq!(*fallbacks, 0, "{what}: fallbacks");
        }
        if dp > 1 {
            // The mean of the data-parallel halves' losses is the one-device loss.
            let mean: Vec<f32> = (0..LM_STEPS)
                .map(|s| (results[0].0.0[s] + results[tp].0.0[s]) / 2.0)
                .collect();
            close("gpt dp×tp loss", &mean, &ref_losses);
        }
    }
}
