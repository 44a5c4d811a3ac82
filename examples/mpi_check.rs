//! Multi-process checks of the MPI communicator, run under `mpirun` (`scripts/mpi_test.sh` runs
//! them all on loopback):
//!
//! ```text
//! cargo build --example mpi_check --features mpi
//! mpirun --oversubscribe -np 4 target/debug/examples/mpi_check collectives
//! mpirun --oversubscribe -np 2 target/debug/examples/mpi_check fsdp
//! ```
//!
//! - `collectives`: every collective on the world and on each axis of a mesh (dp × tp when the
//!   world is 4, dp otherwise), f32 / f16 / i64, against the same calls on ranks-as-threads in
//!   this process — bitwise equal.
//! - `fsdp`: FullShard (ZeRO-3) training of a small transformer with AdamW, one rank per process:
//!   losses and parameters bitwise equal to the same run on ranks-as-threads, and parameters
//!   within 1e-5 of one device.
//! - `mismatch`: rank 0 calls an all-reduce where the others call an all-gather: every rank gets
//!   `Error::Mismatch` at that call (printed), nobody hangs; then an all-to-all whose splits
//!   disagree (rank 1 sends rank 0 two rows, rank 0 expects one): the same on every rank.
//! - `hang`: rank 1 never joins a barrier: the others' watchdog aborts the job after the 3 s
//!   timeout, naming the call.
//! - `kill`: rank 1 dies (SIGABRT) in the middle of training: `mpirun` stops the others.
//! - `hybrid`: 2 ranks as threads in each process (`mpirun -np 2`: a 2 × 2 mesh over 4 ranks):
//!   every collective bitwise equal to ranks-as-threads, and FullShard training over the 4
//!   ranks bitwise equal too.
//! - `bandwidth`: all-reduce / all-gather / reduce-scatter bus bandwidth for 1 KiB–256 MiB (build
//!   with `--release`), beside the algorithm's bytes `2(n−1)/n · S` (all-reduce) and
//!   `(n−1)/n · S` (the others), as nccl-tests reports them.

use burn::backend::{Autodiff, Flex};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{DType, TensorData};
use std::time::Duration;
use wildfire::demo::{
    EncoderClassifierConfig, SyntheticTask, deterministic_init, parameters, train,
};
use wildfire::parallel::comm::{Communicator, Group, ReduceOp};
use wildfire::parallel::{
    DeviceMesh, Distributed, FsdpOptimizer, FsdpStrategy, LaunchOptions, fully_shard, launch,
    launch_ranks, launch_ranks_mpi, sync_gradients,
};

type Dist = Autodiff<Distributed<Flex>>;
type Plain = Autodiff<Flex>;

const STEPS: usize = 6;
const BATCH: usize = 8;

fn world_size() -> usize {
    match wildfire::parallel::LaunchEnv::detect() {
        Ok(Some(env)) if env.launcher.is_mpi() => env.world_size,
        other => panic!("run under mpirun or srun (launcher environment: {other:?})"),
    }
}

fn main() {
    let scenario = std::env::args().nth(1).unwrap_or_else(|| "fsdp".into());
    let n = world_size();
    let code = match scenario.as_str() {
        "collectives" => collectives(n),
        "fsdp" => fsdp(n, None),
        "kill" => fsdp(n, Some(2)),
        "mismatch" => mismatch(n),
        "hang" => hang(n),
        "bandwidth" => bandwidth(n),
        "hybrid" => hybrid(n),
        other => {
            eprintln!(
                "unknown scenario '{other}': collectives, fsdp, kill, mismatch, hang or bandwidth"
            );
            2
        }
    };
    std::process::exit(code);
}

/// The calls of the `collectives` scenario; returns every result's bytes.
fn calls(comm: &dyn Communicator, p2p: bool) -> Vec<(String, Vec<u8>)> {
    let rank = comm.rank();
    let mesh = comm.mesh().clone();
    let value = |salt: usize, len: usize| -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7 + rank * 13 + salt * 3) % 23) as f32 * 0.37 - 3.1 + 1e-3 * i as f32)
            .collect()
    };
    let mut out = Vec::new();
    let mut keep = |name: String, data: TensorData| out.push((name, data.bytes.to_vec()));
    let mut groups = vec![Group::World];
    groups.extend((0..mesh.axes().len()).map(Group::Axis));
    for (g, group) in groups.into_iter().enumerate() {
        let size = group.size(&mesh).unwrap();
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            // An odd length: element ranges of unequal size.
            let data = TensorData::new(value(g, 3 * 37), [3, 37]);
            keep(
                format!("all_reduce {op} f32 group {g}"),
                comm.all_reduce(group, data, op).unwrap(),
            );
        }
        // Fewer elements than members: empty ranges.
        let scalar = TensorData::new(value(g + 5, 1), [1]);
        keep(
            format!("all_reduce scalar group {g}"),
            comm.all_reduce(group, scalar, ReduceOp::Sum).unwrap(),
        );
        let half = TensorData::new(value(g + 9, 50), [5, 10]).convert_dtype(DType::F16);
        keep(
            format!("all_reduce f16 group {g}"),
            comm.all_reduce(group, half, ReduceOp::Sum).unwrap(),
        );
        let ints = TensorData::new((0..6).map(|i| (i * rank) as i64).collect::<Vec<_>>(), [6]);
        keep(
            format!("all_reduce i64 group {g}"),
            comm.all_reduce(group, ints, ReduceOp::Max).unwrap(),
        );
        let piece = TensorData::new(value(g + 1, 2 * 3 * 4), [2, 3, 4]);
        keep(
            format!("all_gather dim 1 group {g}"),
            comm.all_gather(group, piece, 1).unwrap(),
        );
        let whole = TensorData::new(value(g + 2, 4 * size * 3), [4 * size, 3]);
        keep(
            format!("reduce_scatter group {g}"),
            comm.reduce_scatter(group, whole, 0, ReduceOp::Sum).unwrap(),
        );
        let root = size - 1;
        let mine = (group.index(&mesh, rank).unwrap() == root)
            .then(|| TensorData::new(value(g + 4, 7), [7]));
        keep(
            format!("broadcast group {g}"),
            comm.broadcast(group, mine, root).unwrap(),
        );
        // Rows of unequal (and some empty) splits to every member.
        let (i, rows) = (group.index(&mesh, rank).unwrap(), |i: usize, j: usize| {
            (3 * i + 5 * j + g) % 4
        });
        let send: Vec<usize> = (0..size).map(|j| rows(i, j)).collect();
        let recv: Vec<usize> = (0..size).map(|j| rows(j, i)).collect();
        let total = send.iter().sum::<usize>();
        let rows_data = TensorData::new(value(g + 6, 3 * total), [total, 3]);
        keep(
            format!("all_to_all group {g}"),
            comm.all_to_all(group, rows_data, &send, &recv).unwrap(),
        );
        comm.barrier(group).unwrap();
    }
    if !p2p {
        return out;
    }
    // A ring of point-to-point messages.
    let n = mesh.world_size();
    let comm = comm.point_to_point().unwrap();
    comm.send((rank + 1) % n, TensorData::new(value(40, 9), [3, 3]))
        .unwrap();
    keep(
        "recv from the left".into(),
        comm.recv((rank + n - 1) % n).unwrap(),
    );
    out
}

fn mesh_for(n: usize) -> DeviceMesh {
    if n == 4 {
        DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap()
    } else {
        DeviceMesh::new([("dp", n)]).unwrap()
    }
}

fn collectives(n: usize) -> i32 {
    let mesh = mesh_for(n);
    let mut rank = 0;
    let mine = launch_ranks_mpi::<Flex, _, _, _>(
        &mesh,
        |_| Default::default(),
        &LaunchOptions::default(),
        |device| {
            rank = device.rank();
            calls(device.context().comm(), true)
        },
    )
    .unwrap();
    let threads = launch(&mesh, &LaunchOptions::default(), |comm| {
        calls(comm.as_ref(), true)
    })
    .unwrap();
    let reference = &threads[rank];
    let mut bad = 0;
    for ((name, got), (_, want)) in mine.iter().zip(reference) {
        if got != want {
            eprintln!("rank {rank}: {name}: MPI result differs from ranks-as-threads");
            bad += 1;
        }
    }
    if bad > 0 || mine.len() != reference.len() {
        return 1;
    }
    println!(
        "rank {rank}: {} collective results on {mesh} bitwise equal to ranks-as-threads",
        mine.len()
    );
    0
}

fn task() -> SyntheticTask {
    SyntheticTask {
        seq: 4,
        d_input: 4,
        classes: 3,
        seed: 23,
    }
}

/// FullShard training on this rank's rows of the global batch; `die_at`: rank 1 aborts its
/// process at that step.
fn fsdp_rank(
    device: wildfire::parallel::DistDevice<Flex>,
    mesh: &DeviceMesh,
    die_at: Option<usize>,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let rank = device.rank();
    // This rank's slice of the batch by its data-parallel coordinate (tp peers share it).
    let dp_axis = mesh.axis_index("dp").unwrap();
    let n = mesh.axis_size(dp_axis);
    let d = mesh.coords(rank)[dp_axis];
    let m = deterministic_init(
        EncoderClassifierConfig::new()
            .with_n_layers(1)
            .init::<Dist>(&device),
        5,
    );
    let m = fully_shard(m, mesh, FsdpStrategy::FullShard).unwrap();
    let mut step = 0;
    let (m, log) = train(
        m,
        &mut FsdpOptimizer::new(AdamWConfig::new().init()),
        &task(),
        STEPS,
        0.02,
        d * BATCH / n..(d + 1) * BATCH / n,
        &device,
        |m, g: &mut GradientsParams| {
            step += 1;
            if die_at == Some(step) && rank == 1 {
                eprintln!("rank 1: dying at step {step} (abort)");
                std::process::abort();
            }
            sync_gradients(m, g).unwrap();
        },
    );
    (log.losses, parameters(&m))
}

fn fsdp(n: usize, die_at: Option<usize>) -> i32 {
    let mesh = DeviceMesh::new([("dp", n)]).unwrap();
    let options = LaunchOptions {
        timeout: Duration::from_secs(60),
        ..Default::default()
    };
    let mut rank = 0;
    let (losses, params) = launch_ranks_mpi::<Flex, _, _, _>(
        &mesh,
        |_| Default::default(),
        &options,
        |device| {
            rank = device.rank();
            fsdp_rank(device, &mesh, die_at)
        },
    )
    .unwrap();
    // The same run, ranks as threads of this process.
    let threads = launch_ranks::<Flex, _, _>(&mesh, &Default::default(), &options, |device| {
        fsdp_rank(device, &mesh, None)
    })
    .unwrap();
    let (t_losses, t_params) = &threads[rank];
    let bitwise = losses == *t_losses && params == *t_params;
    // One device, the whole batch.
    let device = Default::default();
    let m = deterministic_init(
        EncoderClassifierConfig::new()
            .with_n_layers(1)
            .init::<Plain>(&device),
        5,
    );
    let (m, _) = train(
        m,
        &mut AdamWConfig::new().init(),
        &task(),
        STEPS,
        0.02,
        0..BATCH,
        &device,
        |_, _| {},
    );
    let one = parameters(&m);
    let mut worst = 0f32;
    for (p, q) in params.iter().zip(&one) {
        let scale = q.iter().fold(0f32, |a, x| a.max(x.abs())).max(1e-6);
        for (a, b) in p.iter().zip(q) {
            worst = worst.max((a - b).abs() / scale);
        }
    }
    println!(
        "rank {rank}: FullShard over MPI on {n} processes, {STEPS} AdamW steps: bitwise equal to ranks-as-threads: {bitwise}; parameters vs one device: max diff {worst:.2e} of scale"
    );
    if bitwise && worst <= 1e-5 { 0 } else { 1 }
}

fn mismatch(n: usize) -> i32 {
    let mesh = DeviceMesh::new([("dp", n)]).unwrap();
    let errors = launch_ranks_mpi::<Flex, _, _, _>(
        &mesh,
        |_| Default::default(),
        &LaunchOptions::default(),
        |device| {
            let comm = device.context().comm();
            let data = TensorData::new(vec![1.0f32; 4], [4]);
            let result = if comm.rank() == 0 {
                comm.all_reduce(Group::World, data, ReduceOp::Sum)
            } else {
                comm.all_gather(Group::World, data, 0)
            };
            let rows = TensorData::new(vec![1.0f32; 6], [3, 2]);
            let (mut send, mut recv) = (vec![1; n], vec![1; n]);
            send[0] = 3 - (n - 1);
            if comm.rank() == 1 {
                send[0] += 1;
                send[1] -= 1;
            }
            recv[0] = send[0];
            let splits = comm.all_to_all(Group::World, rows, &send, &recv);
            (comm.rank(), result.map(|_| ()), splits.map(|_| ()))
        },
    )
    .unwrap();
    let mut code = 0;
    for (what, result) in [("call", errors.1), ("all-to-all", errors.2)] {
        match result {
            Err(e) => println!("rank {}: detected: {e}", errors.0),
            Ok(()) => {
                eprintln!("rank {}: the mismatched {what} went through", errors.0);
                code = 1;
            }
        }
    }
    code
}

fn hang(n: usize) -> i32 {
    let mesh = DeviceMesh::new([("dp", n)]).unwrap();
    let options = LaunchOptions {
        timeout: Duration::from_secs(3),
        ..Default::default()
    };
    launch_ranks_mpi::<Flex, _, _, _>(
        &mesh,
        |_| Default::default(),
        &options,
        |device| {
            let comm = device.context().comm();
            comm.barrier(Group::World).unwrap();
            if comm.rank() == 1 {
                // Never joins the next barrier.
                std::thread::sleep(Duration::from_secs(60));
            } else {
                comm.barrier(Group::World).unwrap();
            }
        },
    )
    .unwrap();
    eprintln!("the hang scenario should have been aborted by the watchdog");
    1
}

/// Bus bandwidth per collective and size (nccl-tests' definitions): `S` is the full buffer
/// (all-reduce and reduce-scatter input, all-gather output), `algbw = S / t`, and
/// `busbw = algbw · 2(n−1)/n` for all-reduce, `algbw · (n−1)/n` for all-gather and
/// reduce-scatter — the bytes each rank must move, so busbw compares with the link speed.
fn bandwidth(n: usize) -> i32 {
    use std::time::Instant;
    let mesh = DeviceMesh::new([("dp", n)]).unwrap();
    let world = wildfire::parallel::MpiWorld::init(mesh.clone(), Duration::from_secs(600)).unwrap();
    let native = world.communicator();
    let rows = {
        {
            let comm: &dyn Communicator = native.as_ref();
            let mut rows = Vec::new();
            let mut bytes = 1usize << 10;
            while bytes <= 256 << 20 {
                let elements = bytes / 4;
                for kind in [
                    "all_reduce",
                    "MPI_Allreduce",
                    "all_gather",
                    "reduce_scatter",
                ] {
                    let len = if kind == "all_gather" {
                        elements / n
                    } else {
                        elements
                    };
                    let input = TensorData::new(vec![1.0f32; len.max(1)], [len.max(1)]);
                    let mut raw = vec![1.0f32; len.max(1)];
                    let mut call = || -> Result<(), wildfire::parallel::Error> {
                        // The trait takes its buffer by value: one copy per call, counted.
                        let data = input.clone();
                        match kind {
                            "all_reduce" => comm.all_reduce(Group::World, data, ReduceOp::Sum)?,
                            "MPI_Allreduce" => {
                                native.native_all_reduce_sum(Group::World, &mut raw);
                                data
                            }
                            "all_gather" => comm.all_gather(Group::World, data, 0)?,
                            _ => comm.reduce_scatter(Group::World, data, 0, ReduceOp::Sum)?,
                        };
                        Ok(())
                    };
                    let iters = ((1usize << 30) / bytes).clamp(3, 50);
                    call().unwrap();
                    comm.barrier(Group::World).unwrap();
                    let start = Instant::now();
                    for _ in 0..iters {
                        call().unwrap();
                    }
                    let mine = start.elapsed().as_secs_f64() / iters as f64;
                    // The slowest rank's time.
                    let t = comm
                        .all_reduce(
                            Group::World,
                            TensorData::new(vec![mine], [1]),
                            ReduceOp::Max,
                        )
                        .unwrap()
                        .to_vec::<f64>()
                        .unwrap()[0];
                    let factor = if kind.ends_with("llreduce") || kind == "all_reduce" {
                        2.0 * (n - 1) as f64 / n as f64
                    } else {
                        (n - 1) as f64 / n as f64
                    };
                    let algbw = bytes as f64 / t / 1e9;
                    rows.push(format!(
                        "| {kind} | {} | {:.1} | {algbw:.3} | {:.3} |",
                        if bytes >= 1 << 20 {
                            format!("{} MiB", bytes >> 20)
                        } else {
                            format!("{} KiB", bytes >> 10)
                        },
                        t * 1e6,
                        algbw * factor
                    ));
                }
                bytes *= 4;
            }
            (comm.rank(), rows)
        }
    };
    drop(world);
    if rows.0 == 0 {
        println!(
            "MPI on {n} processes (loopback); busbw = algbw × 2(n−1)/n (all-reduce), × (n−1)/n (all-gather, reduce-scatter)\n"
        );
        println!("| collective | size | time (µs) | algbw (GB/s) | busbw (GB/s) |");
        println!("|---|---|---|---|---|");
        for row in rows.1 {
            println!("{row}");
        }
    }
    0
}

/// Two ranks as threads per process, processes across: one mesh.
fn hybrid(n: usize) -> i32 {
    const THREADS: usize = 2;
    let mesh = DeviceMesh::new([("dp", n), ("tp", THREADS)]).unwrap();
    let options = LaunchOptions {
        timeout: Duration::from_secs(60),
        ..Default::default()
    };
    let mine = wildfire::parallel::launch_ranks_hybrid::<Flex, _, _, _>(
        &mesh,
        THREADS,
        |_| Default::default(),
        &options,
        |device| {
            let rank = device.rank();
            let calls = calls(device.context().comm(), false);
            // Point-to-point is not offered on a hybrid world: a typed error, no hang.
            let p2p = device.context().comm().point_to_point();
            assert!(
                matches!(p2p, Err(wildfire::parallel::Error::Unsupported(_))),
                "{p2p:?}"
            );
            (rank, calls, fsdp_rank(device, &mesh, None))
        },
    )
    .unwrap();
    let trained = launch_ranks::<Flex, _, _>(&mesh, &Default::default(), &options, |device| {
        fsdp_rank(device, &mesh, None)
    })
    .unwrap();
    let threads = launch(&mesh, &LaunchOptions::default(), |comm| {
        calls(comm.as_ref(), false)
    })
    .unwrap();
    let mut bad = 0;
    for (rank, got, training) in &mine {
        if *training != trained[*rank] {
            eprintln!("rank {rank}: FullShard training differs from ranks-as-threads");
            bad += 1;
        }
        for ((name, a), (_, b)) in got.iter().zip(&threads[*rank]) {
            if a != b {
                eprintln!("rank {rank}: {name}: hybrid result differs from ranks-as-threads");
                bad += 1;
            }
        }
    }
    println!(
        "ranks {:?}: {} collective results each and {STEPS} FullShard AdamW steps on {mesh} (2 threads × {n} processes): equal to ranks-as-threads: {}",
        mine.iter().map(|(r, _, _)| *r).collect::<Vec<_>>(),
        mine[0].1.len(),
        bad == 0
    );
    i32::from(bad > 0)
}
