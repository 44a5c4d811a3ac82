//! FSDP and the ZeRO family on a stock burn-nn transformer: every strategy on 2 and 4 ranks (HSDP
//! on 2 × 2) against one device, with SGD+momentum and AdamW; per-rank memory against the ZeRO
//! formulas.

use super::{Dist, Plain, close, sharded_mlp, threads};
use burn::backend::Flex;
use burn::module::Module;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use wildfire::demo::{
    Classifier, EncoderClassifier, EncoderClassifierConfig, SyntheticTask, deterministic_init,
    parameters, train,
};
use wildfire::parallel::{
    CollectiveKind, DeviceMesh, FsdpOptimizer, FsdpStrategy, Group, LaunchOptions, fully_shard,
    gradient_bytes, launch_ranks, parameter_bytes, sync_gradients,
};

const STEPS: usize = 20;
/// The strategies over one data axis (HSDP needs two).
const ONE_AXIS: [FsdpStrategy; 4] = [
    FsdpStrategy::NoShard,
    FsdpStrategy::ShardOptimizer,
    FsdpStrategy::ShardGradOp,
    FsdpStrategy::FullShard,
];
const GLOBAL_BATCH: usize = 8;

fn task() -> SyntheticTask {
    super::task(4, 23)
}

fn model<B: burn::tensor::backend::AutodiffBackend>(device: &B::Device) -> EncoderClassifier<B> {
    deterministic_init(
        EncoderClassifierConfig::new().with_n_layers(1).init(device),
        5,
    )
}

#[derive(Clone, Copy, Debug)]
enum Opt {
    Sgd,
    AdamW,
}

type Model<B> = EncoderClassifier<B>;

fn run<B, O>(
    mut optim: O,
    model: Model<B>,
    rows: std::ops::Range<usize>,
    device: &B::Device,
    mut sync: impl FnMut(&Model<B>, &mut GradientsParams),
) -> (Vec<f32>, Vec<Vec<f32>>)
where
    B: burn::tensor::backend::AutodiffBackend,
    O: Optimizer<Model<B>, B>,
{
    let (model, log) = train(
        model,
        &mut optim,
        &task(),
        STEPS,
        0.02,
        rows,
        device,
        |m, g| sync(m, g),
    );
    (log.losses, parameters(&model))
}

fn sgd() -> SgdConfig {
    SgdConfig::new().with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
}

/// One device, plain Burn.
fn reference(opt: Opt) -> (Vec<f32>, Vec<Vec<f32>>) {
    let device = Default::default();
    let m = model::<Plain>(&device);
    match opt {
        Opt::Sgd => run(sgd().init(), m, 0..GLOBAL_BATCH, &device, |_, _| {}),
        Opt::AdamW => run(
            AdamWConfig::new().init(),
            m,
            0..GLOBAL_BATCH,
            &device,
            |_, _| {},
        ),
    }
}

/// One rank of a sharded run: the optimizer wrapped in `FsdpOptimizer`, `sync_gradients` added.
fn distributed(
    opt: Opt,
    m: Model<Dist>,
    rows: std::ops::Range<usize>,
    device: &wildfire::parallel::DistDevice<Flex>,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let sync = |m: &Model<Dist>, g: &mut GradientsParams| {
        sync_gradients(m, g).unwrap();
    };
    match opt {
        Opt::Sgd => run(FsdpOptimizer::new(sgd().init()), m, rows, device, sync),
        Opt::AdamW => run(
            FsdpOptimizer::new(AdamWConfig::new().init()),
            m,
            rows,
            device,
            sync,
        ),
    }
}

fn check(strategy: FsdpStrategy, mesh: DeviceMesh) {
    for opt in [Opt::Sgd, Opt::AdamW] {
        let (ref_losses, ref_params) = reference(opt);
        let world = mesh.world_size();
        let per_rank = GLOBAL_BATCH / world;
        let results = threads(&mesh, |device| {
            let m = fully_shard(model::<Dist>(&device), &mesh, strategy).unwrap();
            let rows = device.rank() * per_rank..(device.rank() + 1) * per_rank;
            distributed(opt, m, rows, &device)
        });
        for (rank, (losses, params)) in results.iter().enumerate() {
            assert_eq!(losses.len(), STEPS);
            for (i, (p, q)) in crate::suite::pairs(params, &ref_params).enumerate() {
                close(
                    &format!("{strategy:?} {opt:?} {mesh} rank {rank} param {i}"),
                    p,
                    q,
                );
            }
        }
        let mean: Vec<f32> = (0..STEPS)
            .map(|s| results.iter().map(|r| r.0[s]).sum::<f32>() / world as f32)
            .collect();
        close(
            &format!("{strategy:?} {opt:?} {mesh} loss"),
            &mean,
            &ref_losses,
        );
    }
}

#[test]
fn every_strategy_matches_one_device() {
    for strategy in ONE_AXIS {
        for dp in [2, 4] {
            check(strategy, DeviceMesh::new([("dp", dp)]).unwrap());
        }
    }
    check(
        FsdpStrategy::Hybrid,
        DeviceMesh::new([("dp_replicate", 2), ("dp_shard", 2)]).unwrap(),
    );
}

/// After one AdamW step: parameter, gradient and optimizer-state bytes on each rank equal the
/// ZeRO formulas (16Ψ for DDP … 16Ψ/N for FSDP), where the only excess is the padding of first
/// dimensions that do not divide by N (and parameters with fewer rows than ranks, kept whole).
#[test]
fn memory_matches_the_zero_formulas() {
    let n = 4;
    let mesh = DeviceMesh::new([("dp", n)]).unwrap();
    let reference = model::<Plain>(&Default::default());
    // Ψ, and the elements a rank holds when every shardable parameter is sharded.
    let dims = param_dims(&reference);
    let psi: u64 = dims
        .iter()
        .map(|d| d.iter().product::<usize>() as u64)
        .sum();
    let sharded: u64 = dims
        .iter()
        .map(|d| {
            let size = d.iter().product::<usize>() as u64;
            // Dim 0 split n ways, padded to a multiple of n (kept whole below one row per rank).
            if d[0] >= n {
                d[0].div_ceil(n) as u64 * (size / d[0] as u64)
            } else {
                size
            }
        })
        .sum();
    for strategy in ONE_AXIS {
        let results = threads(&mesh, |device| {
            let m = fully_shard(model::<Dist>(&device), &mesh, strategy).unwrap();
            let mut optim = FsdpOptimizer::new(AdamWConfig::new().init());
            let rows = device.rank() * 2..device.rank() * 2 + 2;
            let (x, y) = task().batch(0, rows.clone());
            let x = Tensor::<Dist, 3>::from_data(x, &device);
            let y = Tensor::<Dist, 1, Int>::from_data(TensorData::new(y, [2]), &device);
            let loss = burn::nn::loss::CrossEntropyLossConfig::new()
                .init(&device)
                .forward(m.logits(x), y);
            let grads = loss.backward();
            drop(loss);
            let mut grads = GradientsParams::from_grads(grads, &m);
            sync_gradients(&m, &mut grads).unwrap();
            let grad_bytes = gradient_bytes(&m, &grads);
            let stats_before = device.context().comm().stats();
            let m = optim.step(1e-3, m, grads);
            let step_stats = device.context().comm().stats().since(&stats_before);
            let param_bytes = parameter_bytes(&m);
            // Everything still alive is the parameters and the optimizer state.
            let optim_bytes = device.context().live_bytes() - param_bytes;
            drop((m, optim));
            (
                param_bytes,
                grad_bytes,
                optim_bytes,
                step_stats.count(CollectiveKind::AllGather),
            )
        });
        let full = 4 * psi;
        let shard = 4 * sharded;
        let (p, g, o) = match strategy {
            FsdpStrategy::NoShard => (full, full, 2 * full),
            FsdpStrategy::ShardOptimizer => (full, full, 2 * shard),
            FsdpStrategy::ShardGradOp => (full, shard, 2 * shard),
            _ => (shard, shard, 2 * shard),
        };
        for (rank, &(param_bytes, grad_bytes, optim_bytes, gathers)) in results.iter().enumerate() {
            assert_eq!(
                (param_bytes, grad_bytes, optim_bytes),
                (p, g, o),
                "{strategy:?} rank {rank} (Ψ = {psi})"
            );
            let regathers = matches!(
                strategy,
                FsdpStrategy::ShardOptimizer | FsdpStrategy::ShardGradOp
            );
            assert_eq!(
                gathers > 0,
                regathers,
                "{strategy:?}: parameters re-gathered after the step"
            );
        }
        eprintln!(
            "{strategy:?} N={n} Ψ={psi}: params {p} grads {g} optim {o} bytes = {:.3}Ψ (formula {})",
            (p + g + o) as f64 / psi as f64,
            match strategy {
                FsdpStrategy::NoShard => "16Ψ",
                FsdpStrategy::ShardOptimizer => "8Ψ + 8Ψ/N = 10Ψ",
                FsdpStrategy::ShardGradOp => "4Ψ + 12Ψ/N = 7Ψ",
                _ => "16Ψ/N = 4Ψ",
            }
        );
    }
}

fn param_dims<B: Backend, M: Module<B>>(m: &M) -> Vec<Vec<usize>> {
    struct Dims(Vec<Vec<usize>>);
    impl<B: Backend> burn::module::ModuleVisitor<B> for Dims {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
            self.0.push(param.val().dims().to_vec());
        }
    }
    let mut d = Dims(Vec::new());
    m.visit(&mut d);
    d.0
}

/// FullShard on a two-layer MLP: the collectives of one step are exactly what the plan predicts —
/// parameters gathered per use (three uses forward, fc2's weight again for the input gradient),
/// gradients reduce-scattered where they are born; fc2's bias of 3 is padded to 4 on 2 ranks
/// (gathered and reduce-scattered like the rest) and kept whole on 4 (fewer rows than ranks:
/// all-reduced).
#[test]
fn full_shard_collectives_per_step_match_the_plan() {
    for n in [2usize, 4] {
        let mesh = DeviceMesh::new([("dp", n)]).unwrap();
        let stats = threads(&mesh, |device| {
            let m = sharded_mlp(&device, &mesh, [4, 16, 3], 2, FsdpStrategy::FullShard);
            device.context().reset_counters();
            let mut optim = FsdpOptimizer::new(SgdConfig::new().init());
            let rows = device.rank() * 2..device.rank() * 2 + 2;
            let (m, _) = train(m, &mut optim, &task(), 1, 0.1, rows, &device, |m, g| {
                sync_gradients(m, g).unwrap();
            });
            drop(m);
            (device.context().comm().stats(), device.context().counters())
        });
        let f = 4u64; // bytes per f32
        let n64 = n as u64;
        // fc1: w [4, 16], b [16]; fc2: w [16, 3], b [3] (padded to 4 on 2 ranks, whole on 4).
        let mut gathers = vec![4 * 16 / n64, 16 / n64, 16 * 3 / n64, 16 * 3 / n64];
        let mut scatters = vec![4 * 16, 16, 16 * 3];
        let bias_sharded = n <= 3;
        if bias_sharded {
            gathers.push(3u64.div_ceil(n64));
            scatters.push(3u64.div_ceil(n64) * n64);
        }
        for (rank, (s, counters)) in stats.iter().enumerate() {
            let what = format!("N={n} rank {rank}\n{s}");
            for (kind, elements) in [
                (CollectiveKind::AllGather, &gathers),
                (CollectiveKind::ReduceScatter, &scatters),
            ] {
                assert_eq!(s.count(kind), elements.len() as u64, "{kind:?} {what}");
                assert_eq!(
                    s.bytes(kind),
                    f * elements.iter().sum::<u64>(),
                    "{kind:?} {what}"
                );
            }
            let all_reduces = u64::from(!bias_sharded);
            assert_eq!(s.count(CollectiveKind::AllReduce), all_reduces, "{what}");
            assert_eq!(
                s.bytes(CollectiveKind::AllReduce),
                f * 3 * all_reduces,
                "{what}"
            );
            assert_eq!(s.count(CollectiveKind::Barrier), 1, "{what}");
            assert_eq!(counters.fallback_total(), 0, "{:?}", counters.fallbacks);
        }
    }
}

/// A distributed checkpoint of a stock burn-nn model: every rank writes only its own pieces, with
/// no collective; rank 0 commits once every rank's part is there. A rank that never finishes its
/// part (it died) leaves the previous checkpoint the latest, and rank 0 gets a typed error naming
/// it. The pieces cover every tensor once; loading onto another mesh (dp 4) reads the parts of
/// the pieces that overlap each rank's own (each half piece read by one rank: the whole
/// checkpoint once, plus at most a checksum chunk at each end of a part) and gives the saved
/// values exactly.
#[test]
fn distributed_checkpoint_reshards_a_stock_model() {
    use burn::optim::AdamW;
    use wildfire::checkpoint::dcp::{Checkpoint, CheckpointWriter, Snapshot};
    let root = std::env::temp_dir().join(format!("wildfire-dcp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
    let out = threads(&mesh, |device| {
        let m = fully_shard(model::<Dist>(&device), &mesh, FsdpStrategy::FullShard).unwrap();
        // Checksums per 64 bytes: a rank reads its part of a piece, not the piece.
        let writer = CheckpointWriter::new(&root, device.rank(), 2)
            .unwrap()
            .with_chunk_bytes(64);
        // Rank 0 clears stale staging directories before anyone saves (in training, the steps
        // between the writer's creation and the first save order it so).
        device.context().comm().barrier(Group::World).unwrap();
        device.context().reset_counters();
        let mut writer = writer.with_commit_timeout(std::time::Duration::from_millis(300));
        let snapshot = Snapshot::take::<Dist, _, AdamW>(&m, None).unwrap();
        writer.save(snapshot, 1, Vec::new()).unwrap();
        let report = writer.wait().unwrap().unwrap();
        let without_comm = device.context().comm().stats().total_count() == 0;
        // Save 2: rank 1 dies before writing its part.
        let failed = (device.rank() == 0).then(|| {
            let snapshot = Snapshot::take::<Dist, _, AdamW>(&m, None).unwrap();
            writer.save(snapshot, 2, Vec::new()).unwrap();
            writer.wait().unwrap_err().to_string()
        });
        (without_comm, report.dir.is_some(), failed, parameters(&m))
    });
    for (rank, (without_comm, committed, _, _)) in out.iter().enumerate() {
        assert!(without_comm, "rank {rank}: saving must not communicate");
        assert_eq!(*committed, rank == 0, "rank 0 commits");
    }
    let failed = out[0].2.as_ref().unwrap();
    assert!(failed.contains("rank 1 did not finish"), "{failed}");
    assert_eq!(
        std::fs::read_to_string(root.join("latest")).unwrap(),
        "step-00000001"
    );
    let checkpoint = Checkpoint::open(root.join("step-00000001")).unwrap();
    let meta = checkpoint.metadata();
    assert_eq!(meta.files.len(), 2);
    for (name, t) in &meta.tensors {
        let volume =
            |s: &[usize], e: &[usize]| s.iter().zip(e).map(|(a, b)| b - a).product::<usize>();
        let covered: usize = t.pieces.iter().map(|p| volume(&p.start, &p.end)).sum();
        assert_eq!(covered, t.shape.iter().product::<usize>(), "{name}");
    }
    let saved = out[0].3.clone();
    loads_onto_four_ranks(&checkpoint, &saved);
    let data: u64 = meta.files.values().sum();
    let (tensors, pieces) = (meta.tensors.len() as u64, 2 * meta.tensors.len() as u64);
    let slack = 4 * pieces * 2 * 64;
    let read = checkpoint.bytes_read();
    assert!(
        read <= data + slack && read < data * 3 / 2,
        "read {read} bytes of {data} ({tensors} tensors)"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

/// `checkpoint` loaded into a fresh model FullShard on 4 ranks gives `saved` on every rank.
fn loads_onto_four_ranks(checkpoint: &wildfire::checkpoint::dcp::Checkpoint, saved: &[Vec<f32>]) {
    let four = DeviceMesh::new([("dp", 4)]).unwrap();
    let loaded = threads(&four, |device| {
        let fresh = deterministic_init(
            EncoderClassifierConfig::new()
                .with_n_layers(1)
                .init::<Dist>(&device),
            99,
        );
        let fresh = fully_shard(fresh, &four, FsdpStrategy::FullShard).unwrap();
        parameters(&checkpoint.load_model(fresh).unwrap())
    });
    for params in loaded {
        assert_eq!(params, saved);
    }
}

/// A checkpoint kept in host memory (`CheckpointWriter::with_memory`): each of 2 ranks holds its
/// files and a copy of its buddy's, so with rank 1 lost and the directory deleted the checkpoint
/// still loads — onto dp 4, resharded, the saved values exactly — and reads no file. With both
/// copies of a rank's files gone there is nothing to recover.
#[test]
fn a_checkpoint_held_in_memory_survives_a_lost_rank_without_its_files() {
    use burn::optim::AdamW;
    use wildfire::checkpoint::dcp::{Checkpoint, CheckpointWriter, MemoryCheckpoints, Snapshot};
    let root = std::env::temp_dir().join(format!("wildfire-dcp-memory-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
    let store = MemoryCheckpoints::new();
    let saved = threads(&mesh, |device| {
        let m = fully_shard(model::<Dist>(&device), &mesh, FsdpStrategy::FullShard).unwrap();
        let mut writer = CheckpointWriter::new(&root, device.rank(), 2)
            .unwrap()
            .with_memory(store.clone());
        device.context().comm().barrier(Group::World).unwrap();
        let snapshot = Snapshot::take::<Dist, _, AdamW>(&m, None).unwrap();
        let state = vec![("state.json".to_string(), b"{}".to_vec())];
        writer.save(snapshot, 3, state).unwrap();
        writer.wait().unwrap();
        parameters(&m)
    })
    .remove(0);
    let on_disk: u64 = std::fs::read_dir(root.join("step-00000003"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert_eq!(
        store.bytes(),
        2 * on_disk,
        "every file twice: its rank's and its buddy's"
    );
    // Each file held is the disk's, byte for byte (the data files copied as they were written).
    let (_, held) = store.recover().expect("every file is held");
    for (name, bytes) in held.iter() {
        let disk = std::fs::read(root.join("step-00000003").join(name)).unwrap();
        assert!(**bytes == disk, "{name}: held in memory ≠ on disk");
    }
    std::fs::remove_dir_all(&root).unwrap();
    store.lose(&[1]);
    let (step, files) = store.recover().expect("rank 1's files are on rank 0");
    assert_eq!(step, 3);
    assert_eq!(&*files["state.json"], b"{}");
    let checkpoint = Checkpoint::in_memory(root.join("step-00000003"), files).unwrap();
    assert!(checkpoint.is_in_memory());
    loads_onto_four_ranks(&checkpoint, &saved);
    assert!(!root.exists(), "nothing was written back");
    store.lose(&[0]);
    assert!(
        store.recover().is_none(),
        "both copies of every file are gone"
    );
}

/// FullShard's peak during a step (the decorator's live-bytes peak on each of 4 ranks, second step
/// so the optimizer state exists): at most the persistent shards + the activations kept by the
/// forward + 2 × the largest layer's gathered parameters (one gathered for use, one gradient
/// born full before its reduce-scatter).
#[test]
fn full_shard_peak_stays_within_two_gathered_layers() {
    let n = 4;
    let mesh = DeviceMesh::new([("dp", n)]).unwrap();
    // The largest layer: a parameterised module's weight and bias, gathered.
    let reference = model::<Plain>(&Default::default());
    let largest_layer = {
        let dims = param_dims(&reference);
        let sizes: Vec<u64> = dims
            .iter()
            .map(|d| 4 * d.iter().product::<usize>() as u64)
            .collect();
        // Weights are followed by their biases in module order.
        sizes.windows(2).map(|w| w[0] + w[1]).max().unwrap_or(0)
    };
    let results = threads(&mesh, |device| {
        let ctx = device.context().clone();
        let mut m = fully_shard(model::<Dist>(&device), &mesh, FsdpStrategy::FullShard).unwrap();
        let mut optim = FsdpOptimizer::new(AdamWConfig::new().init());
        let mut out = (0, 0, 0, 0, 0);
        for step in 0..2 {
            let persistent = ctx.live_bytes();
            ctx.reset_peak_bytes();
            let rows = device.rank() * 2..device.rank() * 2 + 2;
            let (x, y) = task().batch(step, rows);
            let x = Tensor::<Dist, 3>::from_data(x, &device);
            let y = Tensor::<Dist, 1, Int>::from_data(TensorData::new(y, [2]), &device);
            let loss = burn::nn::loss::CrossEntropyLossConfig::new()
                .init(&device)
                .forward(m.logits(x), y);
            let activations = ctx.live_bytes() - persistent;
            let grads = loss.backward();
            let mut grads = GradientsParams::from_grads(grads, &m);
            sync_gradients(&m, &mut grads).unwrap();
            m = optim.step(1e-3, m, grads);
            let report = ctx.memory_report(wildfire::parallel::parameter_bytes(&m), 0);
            out = (
                persistent,
                activations,
                report.peak,
                report.peak_gathered,
                report.gathered,
            );
        }
        out
    });
    for (rank, (persistent, activations, peak, peak_gathered, gathered)) in
        results.into_iter().enumerate()
    {
        // Gathered parameters: never more than two layers at once, none left after the step.
        assert!(
            peak_gathered <= 2 * largest_layer,
            "rank {rank}: {peak_gathered} bytes gathered at once"
        );
        assert!(peak_gathered > 0);
        assert_eq!(
            gathered, 0,
            "rank {rank}: gathered parameters outlived the step"
        );
        let bound = persistent + activations + 2 * largest_layer;
        eprintln!(
            "rank {rank}: peak {peak} = persistent {persistent} + activations {activations} + {} (largest layer gathered {largest_layer}, bound {bound})",
            peak as i64 - persistent as i64 - activations as i64
        );
        assert!(peak <= bound, "rank {rank}: peak {peak} > bound {bound}");
    }
}

/// Padded shards: an MLP whose every dimension is odd (5 → 7 → 3; nothing divides by 2 or 4)
/// trains under every sharding strategy on 2 and 4 ranks like one device (AdamW, 1e-5), with
/// every parameter of at least N rows sharded — each rank holds ⌈rows/N⌉ rows.
#[test]
fn odd_shapes_shard_with_padding_and_match_one_device() {
    use burn::tensor::backend::AutodiffBackend;
    use wildfire::demo::Mlp;
    const ODD_STEPS: usize = 8;
    const BATCH: usize = 8;
    /// AdamW steps of the 5 → 7 → 3 MLP, placed by `place`, on `rows` of a 5-feature task.
    fn train_odd<B: AutodiffBackend>(
        place: impl FnOnce(Mlp<B>) -> Mlp<B>,
        optim: &mut impl Optimizer<Mlp<B>, B>,
        rows: std::ops::Range<usize>,
        device: &B::Device,
        sync: impl FnMut(&Mlp<B>, &mut GradientsParams),
    ) -> (Vec<f32>, Mlp<B>) {
        let odd_task = SyntheticTask {
            d_input: 5,
            ..task()
        };
        let m = place(deterministic_init(Mlp::new(5, 7, 3, device), 9));
        let (m, log) = train(m, optim, &odd_task, ODD_STEPS, 0.02, rows, device, sync);
        (log.losses, m)
    }
    let (ref_losses, m) = train_odd::<Plain>(
        |m| m,
        &mut AdamWConfig::new().init(),
        0..BATCH,
        &Default::default(),
        |_, _| {},
    );
    let ref_params = parameters(&m);
    for n in [2usize, 4] {
        let mesh = DeviceMesh::new([("dp", n)]).unwrap();
        for strategy in [
            FsdpStrategy::ShardOptimizer,
            FsdpStrategy::ShardGradOp,
            FsdpStrategy::FullShard,
        ] {
            let results = threads(&mesh, |device| {
                let rows = device.rank() * BATCH / n..(device.rank() + 1) * BATCH / n;
                let (losses, m) = train_odd(
                    |m| fully_shard(m, &mesh, strategy).unwrap(),
                    &mut FsdpOptimizer::new(AdamWConfig::new().init()),
                    rows,
                    &device,
                    |m, g| {
                        sync_gradients(m, g).unwrap();
                    },
                );
                (losses, parameters(&m), param_local_rows(&m))
            });
            for (rank, (_, params, local_rows)) in results.iter().enumerate() {
                for (i, (p, q)) in crate::suite::pairs(params, &ref_params).enumerate() {
                    close(&format!("{strategy:?} N={n} rank {rank} param {i}"), p, q);
                }
                if strategy == FsdpStrategy::FullShard {
                    // w1 [5, 7], b1 [7], w2 [7, 3], b2 [3]: sharded when rows >= N.
                    let expected: Vec<usize> = [5usize, 7, 7, 3]
                        .iter()
                        .map(|&r| if r >= n { r.div_ceil(n) } else { r })
                        .collect();
                    assert_eq!(local_rows, &expected, "N={n} rank {rank}");
                }
            }
            let mean: Vec<f32> = (0..ODD_STEPS)
                .map(|s| results.iter().map(|r| r.0[s]).sum::<f32>() / n as f32)
                .collect();
            close(&format!("{strategy:?} N={n} loss"), &mean, &ref_losses);
        }
    }
}

/// Rows of each parameter's local piece.
fn param_local_rows(m: &wildfire::demo::Mlp<Dist>) -> Vec<usize> {
    struct Rows(Vec<usize>);
    impl burn::module::ModuleVisitor<Dist> for Rows {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<Dist, D>>) {
            let t = wildfire::parallel::dtensor(&param.val());
            self.0.push(t.local_shape()[0]);
        }
    }
    let mut r = Rows(Vec::new());
    m.visit(&mut r);
    r.0
}

/// A per-rank memory budget (enforced by the decorator's accounting): a model whose step needs
/// more than the budget on one rank fails there with a typed error, and trains on 4 ranks under
/// FullShard within the same budget, like one device.
#[test]
fn a_model_over_budget_on_one_rank_trains_on_four() {
    let step = |n: usize, strategy: FsdpStrategy, budget: Option<u64>| {
        let mesh = DeviceMesh::new([("dp", n)]).unwrap();
        launch_ranks::<Flex, _, _>(
            &mesh,
            &Default::default(),
            &LaunchOptions::default(),
            |device| {
                device.context().update_policy(|p| p.memory_budget = budget);
                device.context().reset_peak_bytes();
                let m = fully_shard(model::<Dist>(&device), &mesh, strategy).unwrap();
                let rows = device.rank() * GLOBAL_BATCH / n..(device.rank() + 1) * GLOBAL_BATCH / n;
                let (losses, _) = distributed(Opt::AdamW, m, rows, &device);
                (losses, device.context().peak_bytes())
            },
        )
    };
    let one = step(1, FsdpStrategy::NoShard, None).unwrap();
    let four = step(4, FsdpStrategy::FullShard, None).unwrap();
    let (one_peak, four_peak) = (one[0].1, four.iter().map(|r| r.1).max().unwrap());
    assert!(4 * four_peak < 3 * one_peak, "{four_peak} vs {one_peak}");
    let budget = (one_peak + four_peak) / 2;
    match step(1, FsdpStrategy::NoShard, Some(budget)) {
        Err(wildfire::parallel::Error::OnRank { error, .. }) if matches!(*error, wildfire::parallel::Error::MemoryBudget { budget: b, .. } if b == budget) =>
            {}
        other => panic!("expected a memory-budget error, got {other:?}"),
    }
    let fits = step(4, FsdpStrategy::FullShard, Some(budget)).unwrap();
    let (reference, _) = reference(Opt::AdamW);
    let mean: Vec<f32> = (0..STEPS)
        .map(|s| fits.iter().map(|r| r.0[s]).sum::<f32>() / 4.0)
        .collect();
    close("loss under the budget on 4 ranks", &mean, &reference);
    eprintln!(
        "budget {budget} bytes: one rank peaks at {one_peak}, four FullShard ranks at {four_peak}"
    );
}

/// Sharded initialisation of a stock burn-nn model (Burn's lazy parameters): under dp 4
/// FullShard, each rank makes only its pieces (the decorator's peak of live bytes during the init
/// is the rank's sharded parameter bytes, and `fully_shard` after it communicates nothing), and
/// the pieces are those of the same initialisation at world size 1, bitwise; DDP's replicas are
/// that whole initialisation on every rank.
#[test]
fn stock_models_initialise_sharded() {
    use wildfire::parallel::init_sharded;
    let build = |device: &wildfire::parallel::DistDevice<Flex>| {
        EncoderClassifierConfig::new()
            .with_n_layers(1)
            .init::<Dist>(device)
    };
    let one = DeviceMesh::new([("dp", 1)]).unwrap();
    let whole = threads(&one, |device| {
        let m = init_sharded(build(&device), &one, None, FsdpStrategy::NoShard, 7).unwrap();
        parameters(&m)
    })
    .remove(0);
    // Another seed draws other values.
    let other = threads(&one, |device| {
        parameters(&init_sharded(build(&device), &one, None, FsdpStrategy::NoShard, 8).unwrap())
    })
    .remove(0);
    assert_ne!(whole, other);
    for (n, strategy) in [(4, FsdpStrategy::FullShard), (2, FsdpStrategy::NoShard)] {
        let mesh = DeviceMesh::new([("dp", n)]).unwrap();
        let out = threads(&mesh, |device| {
            let ctx = device.context().clone();
            ctx.reset_peak_bytes();
            let before = ctx.live_bytes();
            let m = init_sharded(build(&device), &mesh, None, strategy, 7).unwrap();
            let peak = ctx.peak_bytes() - before;
            let bytes = parameter_bytes(&m);
            ctx.reset_counters();
            let m = fully_shard(m, &mesh, strategy).unwrap();
            let moved = ctx.comm().stats().total_count();
            (parameters(&m), peak, bytes, parameter_bytes(&m), moved)
        });
        for (rank, (params, peak, bytes, after, moved)) in out.into_iter().enumerate() {
            assert_eq!(params, whole, "{strategy:?} rank {rank}");
            assert_eq!(
                moved, 0,
                "{strategy:?} rank {rank}: fully_shard moved nothing"
            );
            assert_eq!(bytes, after, "{strategy:?} rank {rank}");
            assert!(
                peak <= bytes,
                "{strategy:?} rank {rank}: peak {peak} > {bytes}"
            );
        }
    }
}
