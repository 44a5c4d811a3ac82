//! Optimizer state beyond AdamW's: Adafactor (factored second moments, a row and a column
//! statistic per matrix) sharded against one device, and its state through the distributed
//! checkpoint across a change of mesh and strategy.

use super::{Dist, Plain, close, pairs, tensors_close, threads};
use burn::module::{AutodiffModule, Module, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use wildfire::checkpoint::dcp::{Checkpoint, CheckpointWriter, Snapshot};
use wildfire::demo::{
    Classifier, EncoderClassifier, EncoderClassifierConfig, SyntheticTask, deterministic_init,
    parameters,
};
use wildfire::engine::AdafactorConfig;
use wildfire::parallel::{
    DeviceMesh, FsdpOptimizer, FsdpStrategy, Group, Placement, StateShape, dtensor, fully_shard,
    state_layout, sync_gradients,
};

/// PyTorch's `torch.optim.Adafactor` on three parameters (rank 2, 1 and 3) for 5 steps, two
/// configurations: `tools/adafactor_reference.py` wrote it.
const TORCH: &str = include_str!("../fixtures/adafactor_torch.json");

const GLOBAL_BATCH: usize = 8;
/// Adafactor's relative step is capped by the learning rate (PyTorch's default).
const LR: f64 = 1e-2;

fn task() -> SyntheticTask {
    super::task(4, 31)
}

fn model<B: AutodiffBackend>(device: &B::Device) -> EncoderClassifier<B> {
    deterministic_init(
        EncoderClassifierConfig::new().with_n_layers(1).init(device),
        5,
    )
}

/// Train `steps` steps starting at data step `first`; the losses.
fn train<B, M, O>(
    model: &mut M,
    optim: &mut O,
    steps: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
    device: &B::Device,
    sync: impl Fn(&M, &mut GradientsParams),
) -> Vec<f32>
where
    B: AutodiffBackend,
    M: Classifier<B> + AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    let task = task();
    let mut losses = Vec::new();
    for step in steps {
        let (x, y) = task.batch(step, rows.clone());
        let x = Tensor::<B, 3>::from_data(x, device);
        let y = Tensor::<B, 1, Int>::from_data(TensorData::new(y, [rows.len()]), device);
        let loss = loss_fn.forward(model.logits(x), y);
        losses.push(loss.clone().into_scalar().elem::<f32>());
        let mut grads = GradientsParams::from_grads(loss.backward(), model);
        sync(model, &mut grads);
        *model = optim.step(LR, model.clone(), grads);
    }
    losses
}

/// `config`'s Adafactor stepped with the fixture's gradients from its initial values, one
/// parameter of shape `shape` (rank `D`): the parameter after each step.
fn adafactor_steps<const D: usize>(
    config: &AdafactorConfig,
    lr: f64,
    shape: [usize; D],
    init: &serde_json::Value,
    grads: &[&serde_json::Value],
) -> Vec<Vec<f32>> {
    use burn::optim::SimpleOptimizer;
    let floats = |v: &serde_json::Value| -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    let device = Default::default();
    let tensor =
        |v| Tensor::<burn::backend::Flex, D>::from_data(TensorData::new(floats(v), shape), &device);
    let optim = config.build();
    let (mut param, mut state) = (tensor(init), None);
    grads
        .iter()
        .map(|g| {
            (param, state) = optim.step(lr, param.clone(), tensor(g), state.take());
            param.to_data().to_vec::<f32>().unwrap()
        })
        .collect()
}

/// Wildfire's Adafactor against PyTorch's own (`torch.optim.Adafactor`, the fixture): every
/// parameter after each of 5 steps, for a matrix, a vector and a rank-3 tensor (factored over its
/// last two dims), under PyTorch's defaults and under weight decay, `ε₁`, `d` and `β₂` decay set.
#[test]
fn adafactor_matches_pytorch() {
    let fixture: serde_json::Value = serde_json::from_str(TORCH).unwrap();
    for run in fixture["runs"].as_array().unwrap() {
        let c = &run["config"];
        let get = |k: &str| c.get(k).and_then(serde_json::Value::as_f64);
        let mut config = AdafactorConfig::new();
        if let Some(wd) = get("weight_decay") {
            config = config.with_weight_decay(wd);
        }
        if let Some(d) = get("d") {
            config = config.with_clip_threshold(d);
        }
        if let Some(decay) = get("beta2_decay") {
            config = config.with_beta2_decay(decay);
        }
        if let Some(eps1) = get("eps1") {
            config = config.with_epsilon1(Some(eps1));
        }
        if let Some(eps2) = get("eps2") {
            config = config.with_epsilon2(eps2);
        }
        let lr = get("lr").unwrap();
        let steps = run["grads"].as_array().unwrap();
        for k in 0..3 {
            let grads: Vec<&serde_json::Value> = steps.iter().map(|s| &s[k]).collect();
            let init = &run["init"][k];
            let got = match k {
                0 => adafactor_steps(&config, lr, [5, 3], init, &grads),
                1 => adafactor_steps(&config, lr, [4], init, &grads),
                _ => adafactor_steps(&config, lr, [2, 3, 4], init, &grads),
            };
            for (step, got) in got.iter().enumerate() {
                let want: Vec<f32> = run["params"][step][k]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
                    .collect();
                // Within f32 rounding of the different summation orders.
                tensors_close(
                    &format!("{c} parameter {k} step {}", step + 1),
                    std::slice::from_ref(got),
                    std::slice::from_ref(&want),
                    2e-6,
                );
            }
        }
    }
}

/// One device, plain Burn: `steps` Adafactor steps.
fn reference(steps: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
    let device = Default::default();
    let mut m = model::<Plain>(&device);
    let mut optim = AdafactorConfig::new().init();
    let losses = train(
        &mut m,
        &mut optim,
        0..steps,
        0..GLOBAL_BATCH,
        &device,
        |_, _| {},
    );
    (losses, parameters(&m))
}

fn sync(m: &EncoderClassifier<Dist>, g: &mut GradientsParams) {
    sync_gradients(m, g).unwrap();
}

/// The global mean of each step's per-rank losses.
fn mean_losses(per_rank: &[Vec<f32>]) -> Vec<f32> {
    (0..per_rank[0].len())
        .map(|s| per_rank.iter().map(|l| l[s]).sum::<f32>() / per_rank.len() as f32)
        .collect()
}

/// Adafactor on 2 ranks under every sharding strategy trains like one device: the statistics of
/// row-sharded matrices are combined across the shards by the step's own ops.
#[test]
fn adafactor_sharded_matches_one_device() {
    const STEPS: usize = 6;
    let (ref_losses, ref_params) = reference(STEPS);
    let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
    use FsdpStrategy::*;
    for strategy in [NoShard, ShardOptimizer, ShardGradOp, FullShard] {
        let out = threads(&mesh, |device| {
            let mut m = fully_shard(model::<Dist>(&device), &mesh, strategy).unwrap();
            let mut optim = FsdpOptimizer::new(AdafactorConfig::new().init());
            let rows = device.rank() * 4..(device.rank() + 1) * 4;
            let losses = train(&mut m, &mut optim, 0..STEPS, rows, &device, sync);
            (losses, parameters(&m))
        });
        let losses: Vec<Vec<f32>> = out.iter().map(|o| o.0.clone()).collect();
        close(
            &format!("{strategy:?} loss"),
            &mean_losses(&losses),
            &ref_losses,
        );
        for (rank, (_, params)) in out.iter().enumerate() {
            tensors_close(
                &format!("{strategy:?} rank {rank}"),
                params,
                &ref_params,
                1e-5,
            );
        }
    }
}

/// Where each matrix's Adafactor statistics live under FSDP on 2 ranks, as the state layout rule
/// says: the row statistic (`n × 1`) sharded with the rows, the column statistic (`1 × m`) —
/// reduced over the sharded rows — replicated.
fn check_factored_layouts(
    model: &EncoderClassifier<Dist>,
    records: &wildfire::checkpoint::ParamRecords<
        burn::optim::record::AdaptorRecord<wildfire::engine::Adafactor, Dist>,
    >,
) -> usize {
    struct Check<'a> {
        records: &'a wildfire::checkpoint::ParamRecords<
            burn::optim::record::AdaptorRecord<wildfire::engine::Adafactor, Dist>,
        >,
        matrices: usize,
    }
    impl burn::module::ModuleVisitor<Dist> for Check<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Dist, D>>) {
            let Some(record) = self.records.get(&param.id) else {
                return;
            };
            let state = record.clone().into_state::<D>();
            let p = dtensor(&param.val().inner());
            let Some(col) = state.col else {
                return;
            };
            if p.layout().get(0) != Placement::Shard(0) {
                return;
            }
            self.matrices += 1;
            let row = dtensor(&state.row);
            let col = dtensor(&col);
            assert_eq!(row.layout().get(0), Placement::Shard(0), "row statistic");
            assert_eq!(
                col.layout().get(0),
                Placement::Replicate,
                "column statistic"
            );
            assert_eq!(
                row.layout(),
                &state_layout(&p, &StateShape::Reduced(vec![D - 1]))
            );
            assert_eq!(
                col.layout(),
                &state_layout(&p, &StateShape::Reduced(vec![D - 2]))
            );
        }
    }
    let mut check = Check {
        records,
        matrices: 0,
    };
    model.visit(&mut check);
    check.matrices
}

/// Adafactor's state (a row and a column vector per matrix, a full second moment per vector)
/// saved by 2 FSDP ranks after 3 steps, loaded by 4 ZeRO-2 ranks, which train 3 more: the same
/// losses and parameters as 6 steps on one device. The checkpoint holds `row` (`n × 1`) and
/// `col` (`1 × m`) per matrix, and loading reads them into the new layout.
#[test]
fn adafactor_state_round_trips_the_distributed_checkpoint_across_layouts() {
    const FIRST: usize = 3;
    const STEPS: usize = 6;
    let (ref_losses, ref_params) = reference(STEPS);
    let root = std::env::temp_dir().join(format!("wildfire-adafactor-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let two = DeviceMesh::new([("dp", 2)]).unwrap();
    let first = threads(&two, |device| {
        let mut m = fully_shard(model::<Dist>(&device), &two, FsdpStrategy::FullShard).unwrap();
        let mut optim = FsdpOptimizer::new(AdafactorConfig::new().init());
        let rows = device.rank() * 4..(device.rank() + 1) * 4;
        let losses = train(&mut m, &mut optim, 0..FIRST, rows, &device, sync);
        let records = optim.to_record();
        let matrices = check_factored_layouts(&m, &records);
        let mut writer = CheckpointWriter::new(&root, device.rank(), 2).unwrap();
        device.context().comm().barrier(Group::World).unwrap();
        let snapshot =
            Snapshot::take::<Dist, _, wildfire::engine::Adafactor>(&m, Some(records)).unwrap();
        writer.save(snapshot, FIRST, Vec::new()).unwrap();
        writer.wait().unwrap();
        (losses, matrices)
    });
    assert!(first.iter().all(|(_, matrices)| *matrices >= 2));
    let checkpoint = Checkpoint::open(root.join(format!("step-{FIRST:08}"))).unwrap();
    let meta = checkpoint.metadata();
    let (mut rows, mut cols, mut seconds) = (0, 0, 0);
    for (name, t) in &meta.tensors {
        let Some(param) = name.strip_prefix("optim/") else {
            continue;
        };
        let model = &meta.tensors[&format!("model/{}", &param[..param.rfind('/').unwrap()])];
        let d = model.shape.len();
        match &param[param.rfind('/').unwrap() + 1..] {
            "row" => {
                rows += 1;
                assert_eq!(t.shape[..d - 1], model.shape[..d - 1], "{name}");
                assert_eq!(t.shape[d - 1], 1, "{name}");
            }
            "col" => {
                cols += 1;
                assert_eq!(t.shape[d - 2], 1, "{name}");
                assert_eq!(t.shape[d - 1], model.shape[d - 1], "{name}");
            }
            "second" => {
                seconds += 1;
                assert_eq!(t.shape, model.shape, "{name}");
            }
            other => panic!("{name}: unexpected state tensor {other}"),
        }
    }
    assert!(
        rows > 0 && rows == cols && seconds > 0,
        "{rows} {cols} {seconds}"
    );
    assert!(meta.optimizer_steps.values().all(|&s| s == FIRST));

    let four = DeviceMesh::new([("dp", 4)]).unwrap();
    let second = threads(&four, |device| {
        // Other initial values: the checkpoint must replace them all.
        let fresh = deterministic_init(model::<Dist>(&device), 99);
        let fresh = fully_shard(fresh, &four, FsdpStrategy::ShardGradOp).unwrap();
        let mut m = checkpoint.load_model(fresh).unwrap();
        let records = checkpoint
            .load_optimizer::<Dist, _, wildfire::engine::Adafactor>(&m)
            .unwrap();
        let mut optim = FsdpOptimizer::new(AdafactorConfig::new().init()).load_record(records);
        let rows = device.rank() * 2..(device.rank() + 1) * 2;
        let losses = train(&mut m, &mut optim, FIRST..STEPS, rows, &device, sync);
        (losses, parameters(&m))
    });
    let before: Vec<Vec<f32>> = first.into_iter().map(|(l, _)| l).collect();
    let after: Vec<Vec<f32>> = second.iter().map(|(l, _)| l.clone()).collect();
    let mut losses = mean_losses(&before);
    losses.extend(mean_losses(&after));
    close("losses across the resume", &losses, &ref_losses);
    for (rank, (_, params)) in second.iter().enumerate() {
        tensors_close(&format!("rank {rank}"), params, &ref_params, 1e-5);
    }
    for (a, b) in pairs(&second[0].1, &second[3].1) {
        assert_eq!(a, b, "the ranks agree");
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// One matrix parameter, for stepping an optimizer with gradients the test chooses.
#[derive(Module, Debug)]
struct OneMatrix<B: Backend> {
    w: Param<Tensor<B, 2>>,
}

/// The gradient of step `s`, element `i`: signs and four decades of magnitude mixed, so the
/// moments span many bf16 exponents.
fn chosen_grad(s: usize, i: usize) -> f32 {
    ((i as f32 * 0.37 + s as f32 * 1.3).sin()) * 10f32.powi((i % 5) as i32 - 3)
}

/// AdamW with bf16 moments (`MomentDtype::Bf16`) against the update written out on the host in
/// f32, step by step from the device's previous state: the moments widened,
/// `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`, the bias-corrected step with decoupled weight
/// decay in f32, then the moments rounded to the nearest bf16. Six steps on a 6 × 700 matrix:
/// each step's parameter within 1e-6 of its scale, every moment within one bf16 step of the
/// reference's and nearly all equal (an f32 rounding apart can flip one). The kept moments are
/// bf16 tensors (their bytes are asserted by the pretraining estimate tests), where the f32
/// setting keeps f32 moments that are not all bf16 values.
#[test]
fn bf16_adamw_moments_follow_the_rounded_formula() {
    use burn::optim::adaptor::OptimizerAdaptor;
    use burn::tensor::{DType, bf16};
    use wildfire::engine::{FusedAdamW, FusedAdamWConfig, MomentDtype};
    const STEPS: usize = 6;
    const LR: f64 = 1e-2;
    let (rows, cols) = (6, 700);
    let n = rows * cols;
    let init: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let config = FusedAdamWConfig {
        beta1: 0.9,
        beta2: 0.95,
        epsilon: 1e-5,
        weight_decay: 0.1,
        moments: MomentDtype::Bf16,
        multi_tensor: true,
    };
    let mesh = DeviceMesh::new([("dp", 1)]).unwrap();
    // Per step: the parameter and the two moments, and the moments' dtypes.
    type Trace = Vec<([Vec<f32>; 3], [DType; 2])>;
    let out = threads(&mesh, |device| {
        let run = |moments: MomentDtype| -> Trace {
            let w =
                Tensor::<Dist, 2>::from_data(TensorData::new(init.clone(), [rows, cols]), &device);
            let mut m = OneMatrix {
                w: Param::from_tensor(w),
            };
            let (adamw, _) =
                FusedAdamW::<burn::backend::Flex>::optimizer::<OneMatrix<Dist>>(FusedAdamWConfig {
                    moments,
                    ..config
                });
            let mut optim: OptimizerAdaptor<_, _, Dist> = adamw;
            let f32s = |t: Tensor<_, 2>| t.into_data().convert::<f32>().to_vec::<f32>().unwrap();
            (0..STEPS)
                .map(|s| {
                    let g: Vec<f32> = (0..n).map(|i| chosen_grad(s, i)).collect();
                    let g = Tensor::<Dist, 2>::from_data(TensorData::new(g, [rows, cols]), &device);
                    let loss = (m.w.val() * g).sum();
                    let grads = GradientsParams::from_grads(loss.backward(), &m);
                    m = optim.step(LR, m.clone(), grads);
                    let record = optim.to_record().remove(&m.w.id).unwrap();
                    let state = record.into_state::<2>().momentum;
                    let (m1, m2) = (state.moment_1, state.moment_2);
                    let dtypes = [m1.dtype(), m2.dtype()];
                    ([f32s(m.w.val().inner()), f32s(m1), f32s(m2)], dtypes)
                })
                .collect()
        };
        (run(MomentDtype::Bf16), run(MomentDtype::F32))
    });
    let (trace, trace_f32) = &out[0];
    let round = |x: f32| bf16::from_f32(x).to_f32();
    let (b1, b2, eps, wd) = (0.9f64, 0.95f64, 1e-5f64, 0.1f64);
    let (mut p, mut rm, mut rv) = (init.clone(), vec![0f32; n], vec![0f32; n]);
    let mut equal = 0;
    for (s, ([w, m1, m2], dtypes)) in trace.iter().enumerate() {
        assert_eq!(dtypes, &[DType::BF16, DType::BF16], "step {s}");
        assert!(m1.iter().chain(m2).all(|&x| round(x) == x), "step {s}");
        // The host's step from the device's previous state.
        let t = (s + 1) as i32;
        let (c1, c2) = ((1.0 - b1.powi(t)) as f32, (1.0 - b2.powi(t)) as f32);
        let (mut ep, mut em, mut ev) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        // One bf16 step of the sum's terms: where `β·old` and `(1−β)·new` nearly cancel, an
        // f32 rounding apart is a larger share of the result.
        let (mut m_terms, mut v_terms) = (vec![0f32; n], vec![0f32; n]);
        for i in 0..n {
            let g = chosen_grad(s, i);
            let (m_old, m_new) = (rm[i] * b1 as f32, g * (1.0 - b1) as f32);
            let (v_old, v_new) = (rv[i] * b2 as f32, g * g * (1.0 - b2) as f32);
            let (m, v) = (m_old + m_new, v_old + v_new);
            m_terms[i] = m_old.abs() + m_new.abs();
            v_terms[i] = v_old + v_new;
            let step = (m / c1) / ((v / c2).sqrt() + eps as f32);
            ep[i] = p[i] * (1.0 - LR * wd) as f32 - step * LR as f32;
            (em[i], ev[i]) = (round(m), round(v));
        }
        close(&format!("step {s}: parameter"), w, &ep);
        for (what, got, expected, terms) in [("m", m1, &em, &m_terms), ("v", m2, &ev, &v_terms)] {
            for (i, (a, b)) in crate::suite::pairs(got, expected).enumerate() {
                assert!(
                    (a - b).abs() <= terms[i] / 128.0,
                    "step {s}: {what}[{i}]: {a} vs {b}: more than one bf16 step apart"
                );
                equal += usize::from(a == b);
            }
        }
        (p, rm, rv) = (w.clone(), m1.clone(), m2.clone());
    }
    let total = 2 * n * STEPS;
    assert!(
        equal >= total * 99 / 100,
        "{equal} of {total} moments equal"
    );
    for (s, ([_, m1, _], dtypes)) in trace_f32.iter().enumerate() {
        assert_eq!(dtypes, &[DType::F32, DType::F32], "step {s}");
        assert!(m1.iter().any(|&x| round(x) != x), "step {s}");
    }
}

/// PyTorch's `torch.optim.Muon` on a wide and a tall matrix for 5 steps, two configurations, its
/// Newton–Schulz iteration in f32: `tools/muon_reference.py` wrote it.
const TORCH_MUON: &str = include_str!("../fixtures/muon_torch.json");

/// Two hidden matrices, `[in, out]` as Burn's linear weights are.
#[derive(Module, Debug)]
struct TwoMatrices<B: Backend> {
    wide: Param<Tensor<B, 2>>,
    tall: Param<Tensor<B, 2>>,
}

/// `values` of a PyTorch `[out, in]` matrix as Burn's `[in, out]`.
fn transposed(values: &serde_json::Value, [out, inp]: [usize; 2]) -> Vec<f32> {
    let v: Vec<f32> = values
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    (0..inp)
        .flat_map(|i| (0..out).map(move |o| (o, i)))
        .map(|(o, i)| v[o * inp + i])
        .collect()
}

/// Wildfire's Muon against PyTorch's own (`torch.optim.Muon`, the fixture): both matrices after
/// each of 5 steps within 1e-5 of their scale, under PyTorch's defaults with weight decay (Nesterov,
/// the "original" learning-rate ratio — a tall `[out, in]` matrix is scaled, a wide one not) and
/// under plain momentum 0.9 with Moonlight's "match_rms_adamw" ratio. The weights are Burn's
/// transposes of PyTorch's, so the test also shows the ratio reads Burn's orientation.
#[test]
fn muon_matches_pytorch() {
    use wildfire::engine::{MuonConfig, MuonLr};
    let fixture: serde_json::Value = serde_json::from_str(TORCH_MUON).unwrap();
    let shapes = [[6, 10], [12, 5]];
    let mesh = DeviceMesh::new([("dp", 1)]).unwrap();
    for run in fixture["runs"].as_array().unwrap() {
        let c = &run["config"];
        let f = |k: &str| c[k].as_f64().unwrap();
        let config = MuonConfig {
            momentum: f("momentum"),
            nesterov: c["nesterov"].as_bool().unwrap(),
            weight_decay: f("weight_decay"),
            adjust_lr: match c["adjust_lr_fn"].as_str().unwrap() {
                "original" => MuonLr::Original,
                _ => MuonLr::MatchRmsAdamw,
            },
            ..MuonConfig::default()
        };
        let lr = f("lr");
        let got = threads(&mesh, |device| {
            let param = |v: &serde_json::Value, [out, inp]: [usize; 2]| {
                Param::from_tensor(Tensor::<Dist, 2>::from_data(
                    TensorData::new(transposed(v, [out, inp]), [inp, out]),
                    &device,
                ))
            };
            let mut m = TwoMatrices {
                wide: param(&run["init"][0], shapes[0]),
                tall: param(&run["init"][1], shapes[1]),
            };
            let mut optim = config
                .init::<burn::backend::Flex, _>(&m, |_| false)
                .unwrap();
            let mut after = Vec::new();
            for step in run["grads"].as_array().unwrap() {
                let grad = |k: usize| {
                    let [out, inp] = shapes[k];
                    Tensor::<Dist, 2>::from_data(
                        TensorData::new(transposed(&step[k], [out, inp]), [inp, out]),
                        &device,
                    )
                };
                let loss = (m.wide.val() * grad(0)).sum() + (m.tall.val() * grad(1)).sum();
                let grads = GradientsParams::from_grads(loss.backward(), &m);
                m = optim.step(lr, m, grads);
                after.push(parameters(&m));
            }
            after
        });
        for (step, got) in got[0].iter().enumerate() {
            let want: Vec<Vec<f32>> = (0..2)
                .map(|k| transposed(&run["params"][step][k], shapes[k]))
                .collect();
            tensors_close(&format!("{c} step {}", step + 1), got, &want, 1e-5);
        }
    }
}
