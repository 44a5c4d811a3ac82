//! Data parallelism on stock burn-nn models: `Autodiff<Distributed<Flex>>` against
//! `Autodiff<Flex>`, ranks as threads.

use super::{Dist, Plain, threads};
use burn::backend::Flex;
use burn::module::Module;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::backend::AutodiffBackend;
use wildfire::demo::{
    Classifier, EncoderClassifierConfig, Mlp, SyntheticTask, TrainLog, deterministic_init,
    parameters, train,
};
use wildfire::parallel::{
    CollectiveKind, DeviceMesh, Distributed, Error, LaunchOptions, launch_ranks, replicate,
    sync_gradients,
};

const STEPS: usize = 10;
const GLOBAL_BATCH: usize = 8;
const LR: f64 = 0.05;

fn task() -> SyntheticTask {
    super::task(6, 17)
}

fn sgd<B: AutodiffBackend, M: burn::module::AutodiffModule<B>>() -> impl burn::optim::Optimizer<M, B>
{
    SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
        .init()
}

#[derive(Clone, Copy, Debug)]
enum Model {
    Mlp,
    Encoder,
}

impl Model {
    fn build<B: AutodiffBackend>(self, device: &B::Device) -> Box<dyn FnOnce() -> Built<B>> {
        let device = device.clone();
        match self {
            Model::Mlp => {
                Box::new(move || Built::Mlp(deterministic_init(Mlp::new(4, 16, 3, &device), 1)))
            }
            Model::Encoder => Box::new(move || {
                Built::Encoder(deterministic_init(
                    EncoderClassifierConfig::new().init(&device),
                    1,
                ))
            }),
        }
    }
}

enum Built<B: AutodiffBackend> {
    Mlp(Mlp<B>),
    Encoder(wildfire::demo::EncoderClassifier<B>),
}

/// Train a model built by `build` and return (losses, parameters).
fn run<B, M>(
    model: M,
    rows: std::ops::Range<usize>,
    device: &B::Device,
    after_backward: impl FnMut(&M, &mut GradientsParams),
) -> (TrainLog, Vec<Vec<f32>>)
where
    B: AutodiffBackend,
    M: Classifier<B> + burn::module::AutodiffModule<B>,
{
    let mut optim = sgd::<B, M>();
    let (model, log) = train(
        model,
        &mut optim,
        &task(),
        STEPS,
        LR,
        rows,
        device,
        after_backward,
    );
    (log, parameters(&model))
}

fn run_built<B>(
    built: Built<B>,
    rows: std::ops::Range<usize>,
    device: &B::Device,
    prepare: impl FnOnce(Built<B>) -> Built<B>,
    sync: bool,
) -> (TrainLog, Vec<Vec<f32>>)
where
    B: AutodiffBackend<InnerBackend = Distributed<Flex>>,
{
    match prepare(built) {
        Built::Mlp(m) => run(m, rows, device, |m, g| {
            if sync {
                sync_gradients(m, g).unwrap();
            }
        }),
        Built::Encoder(m) => run(m, rows, device, |m, g| {
            if sync {
                sync_gradients(m, g).unwrap();
            }
        }),
    }
}

fn plain_run(model: Model) -> (TrainLog, Vec<Vec<f32>>) {
    let device = Default::default();
    match model.build::<Plain>(&device)() {
        Built::Mlp(m) => run(m, 0..GLOBAL_BATCH, &device, |_, _| {}),
        Built::Encoder(m) => run(m, 0..GLOBAL_BATCH, &device, |_, _| {}),
    }
}

fn assert_close(what: &str, got: &[f32], expected: &[f32], rel: f32) {
    assert_eq!(got.len(), expected.len(), "{what}: lengths");
    for (i, (a, b)) in crate::suite::pairs(got, expected).enumerate() {
        assert!(
            (a - b).abs() <= rel * b.abs().max(1e-3),
            "{what}[{i}]: {a} vs {b} (relative {})",
            (a - b).abs() / b.abs().max(1e-3)
        );
    }
}

/// World size 1: the decorator changes nothing, bit for bit — except that it runs a linear layer
/// on an input of rank 3 or more as one GEMM over the input's rows (Burn's default runs one GEMM
/// per batch entry and sums the weight gradient over a `[batch, d_in, d_out]` temporary), which
/// sums the weight gradient in another order. So: the MLP (2-D inputs) bitwise, the encoder
/// (3-D inputs) within 1e-5 (relative) of plain Burn over the whole run.
#[test]
fn world_size_one_matches_plain_burn() {
    for model in [Model::Mlp, Model::Encoder] {
        let (plain_log, plain_params) = plain_run(model);
        let device = Default::default();
        let built = model.build::<Dist>(&device)();
        let (log, params) = run_built(built, 0..GLOBAL_BATCH, &device, |b| b, true);
        assert_eq!(log.losses.len(), plain_log.losses.len(), "{model:?} steps");
        assert_eq!(params.len(), plain_params.len(), "{model:?} parameters");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        match model {
            Model::Mlp => {
                assert_eq!(
                    bits(&log.losses),
                    bits(&plain_log.losses),
                    "{model:?} losses"
                );
                for (p, q) in crate::suite::pairs(&params, &plain_params) {
                    assert_eq!(bits(p), bits(q), "{model:?} parameters");
                }
            }
            Model::Encoder => {
                assert_close("encoder losses", &log.losses, &plain_log.losses, 1e-5);
                for (i, (p, q)) in crate::suite::pairs(&params, &plain_params).enumerate() {
                    assert_close(&format!("encoder parameter {i}"), p, q, 1e-5);
                }
            }
        }
        let best = plain_log
            .losses
            .iter()
            .copied()
            .fold(f32::INFINITY, f32::min);
        assert!(
            best < plain_log.losses[0],
            "{model:?} did not learn: {:?}",
            plain_log.losses
        );
    }
}

/// Data parallel on 2 and 4 ranks matches one device on the global batch, with one all-reduce
/// per parameter per step, 4 bytes per parameter element, and no fallback redistribution.
#[test]
fn data_parallel_matches_single_device() {
    for model in [Model::Mlp, Model::Encoder] {
        let (plain_log, plain_params) = plain_run(model);
        let n_params = plain_params.len() as u64;
        let n_elements: u64 = plain_params.iter().map(|p| p.len() as u64).sum();
        for dp in [2, 4] {
            let mesh = DeviceMesh::new([("dp", dp)]).unwrap();
            let per_rank = GLOBAL_BATCH / dp;
            let results = threads(&mesh, |device| {
                let built = model.build::<Dist>(&device)();
                let ctx = device.context().clone();
                let rows = device.rank() * per_rank..(device.rank() + 1) * per_rank;
                let prepare = |b: Built<Dist>| {
                    let b = replicated(b, &mesh);
                    ctx.reset_counters();
                    b
                };
                let out = run_built(built, rows, &device, prepare, true);
                (
                    out,
                    device.context().comm().stats(),
                    device.context().counters(),
                )
            });
            for (rank, ((log, params), stats, counters)) in results.iter().enumerate() {
                let mean_losses: Vec<f32> = (0..STEPS)
                    .map(|s| results.iter().map(|r| r.0.0.losses[s]).sum::<f32>() / dp as f32)
                    .collect();
                assert_close(
                    &format!("{model:?} dp={dp} loss"),
                    &mean_losses,
                    &plain_log.losses,
                    1e-5,
                );
                for (i, (p, q)) in crate::suite::pairs(params, &plain_params).enumerate() {
                    assert_close(
                        &format!("{model:?} dp={dp} rank {rank} param {i}"),
                        p,
                        q,
                        1e-5,
                    );
                }
                assert_eq!(log.losses.len(), STEPS);
                assert_eq!(
                    stats.count(CollectiveKind::AllReduce),
                    n_params * STEPS as u64,
                    "{model:?} dp={dp}\n{stats}"
                );
                assert_eq!(
                    stats.bytes(CollectiveKind::AllReduce),
                    4 * n_elements * STEPS as u64,
                    "{stats}"
                );
                assert_eq!(
                    stats.count(CollectiveKind::Barrier),
                    STEPS as u64,
                    "{stats}"
                );
                assert_eq!(
                    stats.total_count(),
                    stats.count(CollectiveKind::AllReduce) + STEPS as u64,
                    "{stats}"
                );
                assert_eq!(
                    counters.fallback_total(),
                    0,
                    "fallbacks: {:?}",
                    counters.fallbacks
                );
            }
        }
    }
}

fn replicated(built: Built<Dist>, mesh: &DeviceMesh) -> Built<Dist> {
    match built {
        Built::Mlp(m) => Built::Mlp(replicate(m, mesh).unwrap()),
        Built::Encoder(m) => Built::Encoder(replicate(m, mesh).unwrap()),
    }
}

/// Train `model` on 2 data-parallel ranks, 4 rows each, replicated or not, its gradients synced or
/// not: the launch's error.
fn two_rank_error(model: Model, replicate: bool, sync: bool) -> Error {
    let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
    launch_ranks::<Flex, _, _>(
        &mesh,
        &Default::default(),
        &LaunchOptions::default(),
        |device| {
            let built = model.build::<Dist>(&device)();
            let prepare = |b| if replicate { replicated(b, &mesh) } else { b };
            let rows = device.rank() * 4..device.rank() * 4 + 4;
            run_built(built, rows, &device, prepare, sync)
        },
    )
    .unwrap_err()
}

/// Without `replicate`, a data-parallel mesh refuses the per-rank parameters with a typed error.
#[test]
fn unplaced_model_is_a_typed_error() {
    let err = two_rank_error(Model::Mlp, false, true);
    let Error::OnRank { error, .. } = err else {
        panic!("expected a rank's typed error, got {err:?}");
    };
    match *error {
        Error::UnplacedParameter {
            op, axis, size: 2, ..
        } => {
            assert_eq!(op, "linear");
            assert_eq!(axis, "dp");
        }
        other => panic!("expected UnplacedParameter, got {other:?}"),
    }
}

/// Skipping `sync_gradients` is refused at the next forward pass.
#[test]
fn missing_sync_is_a_typed_error() {
    let err = two_rank_error(Model::Encoder, true, false);
    assert!(
        matches!(
            &err,
            Error::OnRank { error, .. } if matches!(**error, Error::GradientsNotSynced { .. })
        ),
        "{err:?}"
    );
}

/// `Autodiff<Flex>` and `Autodiff<Distributed<Flex>>` in one binary, one function: the stock
/// model code is the same.
#[test]
fn plain_and_distributed_side_by_side() {
    fn steps<B: AutodiffBackend>(device: &B::Device) -> usize {
        let model = deterministic_init(Mlp::<B>::new(4, 8, 3, device), 3);
        model.num_params()
    }
    assert_eq!(
        steps::<Plain>(&Default::default()),
        steps::<Dist>(&Default::default())
    );
}
