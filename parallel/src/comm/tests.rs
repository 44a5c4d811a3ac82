//! Collectives on N ranks as threads, compared with sequential references computed element by
//! element on the main thread.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use burn::tensor::{DType, Element, TensorData, bf16, f16};
use proptest::prelude::*;

use super::*;
use crate::launch::{LaunchOptions, launch};

/// Long enough never to fire in a passing test, short enough that a bug does not hang CI.
const TEST_TIMEOUT: Duration = Duration::from_secs(10);

fn run<T: Send>(mesh: &DeviceMesh, f: impl Fn(Arc<dyn Communicator>) -> T + Sync) -> Vec<T> {
    let options = LaunchOptions {
        timeout: TEST_TIMEOUT,
        ..Default::default()
    };
    launch(mesh, &options, f).expect("every rank succeeds")
}

fn dp(world: usize) -> DeviceMesh {
    DeviceMesh::new([("dp", world)]).unwrap()
}

fn splitmix(state: u64) -> u64 {
    crate::rng::SplitMix64::new(state).next_u64()
}

/// An element type under test, with the reference arithmetic of the definition.
trait TestElem: Element + Copy + PartialEq + Debug + Send + Sync {
    fn make(bits: u64) -> Self;
    fn add(self, other: Self) -> Self;
    fn max(self, other: Self) -> Self;
    fn div(self, count: usize) -> Self;
}

impl TestElem for f32 {
    fn make(bits: u64) -> Self {
        // Full-mantissa values in [-4, 4): sums round, so the order of the reduction shows.
        (bits >> 40) as f32 / (1u64 << 21) as f32 - 4.0
    }
    fn add(self, other: Self) -> Self {
        self + other
    }
    fn max(self, other: Self) -> Self {
        f32::max(self, other)
    }
    fn div(self, count: usize) -> Self {
        self / count as f32
    }
}

impl TestElem for i64 {
    fn make(bits: u64) -> Self {
        (bits % 2001) as i64 - 1000
    }
    fn add(self, other: Self) -> Self {
        self + other
    }
    fn max(self, other: Self) -> Self {
        Ord::max(self, other)
    }
    fn div(self, count: usize) -> Self {
        self / count as i64
    }
}

fn values<T: TestElem>(seed: u64, rank: usize, len: usize) -> Vec<T> {
    (0..len)
        .map(|index| T::make(splitmix(seed ^ splitmix((rank * 1_000_003 + index) as u64))))
        .collect()
}

fn numel(shape: [usize; 3]) -> usize {
    shape.iter().product()
}

fn flat(shape: [usize; 3], index: [usize; 3]) -> usize {
    (index[0] * shape[1] + index[1]) * shape[2] + index[2]
}

fn indices(shape: [usize; 3]) -> impl Iterator<Item = [usize; 3]> {
    (0..shape[0])
        .flat_map(move |a| (0..shape[1]).flat_map(move |b| (0..shape[2]).map(move |c| [a, b, c])))
}

/// Element-wise reduction in rank order.
fn reference_reduce<T: TestElem>(inputs: &[Vec<T>], op: ReduceOp) -> Vec<T> {
    let mut total = inputs[0].clone();
    for input in &inputs[1..] {
        for (acc, &x) in total.iter_mut().zip(input) {
            *acc = match op {
                ReduceOp::Sum | ReduceOp::Avg => acc.add(x),
                ReduceOp::Max => acc.max(x),
            };
        }
    }
    if op == ReduceOp::Avg {
        total.iter_mut().for_each(|x| *x = x.div(inputs.len()));
    }
    total
}

/// Concatenation along `dim`, element by element.
fn reference_concat<T: TestElem>(
    parts: &[Vec<T>],
    shapes: &[[usize; 3]],
    dim: usize,
) -> (Vec<T>, [usize; 3]) {
    let mut out_shape = shapes[0];
    out_shape[dim] = shapes.iter().map(|shape| shape[dim]).sum();
    let out = indices(out_shape)
        .map(|mut index| {
            let mut part = 0;
            while index[dim] >= shapes[part][dim] {
                index[dim] -= shapes[part][dim];
                part += 1;
            }
            parts[part][flat(shapes[part], index)]
        })
        .collect();
    (out, out_shape)
}

/// Chunk `index` of `parts` equal chunks along `dim`, element by element.
fn reference_chunk<T: TestElem>(
    data: &[T],
    shape: [usize; 3],
    dim: usize,
    parts: usize,
    index: usize,
) -> (Vec<T>, [usize; 3]) {
    let mut out_shape = shape;
    out_shape[dim] = shape[dim] / parts;
    let out = indices(out_shape)
        .map(|mut at| {
            at[dim] += index * out_shape[dim];
            data[flat(shape, at)]
        })
        .collect();
    (out, out_shape)
}

/// Runs all-reduce, all-gather (uneven sizes along `dim`), reduce-scatter and broadcast on
/// `world` ranks and compares every rank's results with the references.
fn check_collectives<T: TestElem>(
    world: usize,
    shape: [usize; 3],
    dim: usize,
    seed: u64,
    op: ReduceOp,
) {
    let inputs: Vec<Vec<T>> = (0..world).map(|r| values(seed, r, numel(shape))).collect();
    let gather_shapes: Vec<[usize; 3]> = (0..world)
        .map(|r| {
            let mut s = shape;
            s[dim] += r % 2;
            s
        })
        .collect();
    let gather_inputs: Vec<Vec<T>> = (0..world)
        .map(|r| values(seed + 1, r, numel(gather_shapes[r])))
        .collect();
    let mut scatter_shape = shape;
    scatter_shape[dim] *= world;
    let scatter_inputs: Vec<Vec<T>> = (0..world)
        .map(|r| values(seed + 2, r, numel(scatter_shape)))
        .collect();
    let root = (seed % world as u64) as usize;

    let results = run(&dp(world), |comm| {
        let r = comm.rank();
        let reduced = comm
            .all_reduce(Group::World, TensorData::new(inputs[r].clone(), shape), op)
            .unwrap();
        let gathered = comm
            .all_gather(
                Group::World,
                TensorData::new(gather_inputs[r].clone(), gather_shapes[r]),
                dim,
            )
            .unwrap();
        let scattered = comm
            .reduce_scatter(
                Group::World,
                TensorData::new(scatter_inputs[r].clone(), scatter_shape),
                dim,
                op,
            )
            .unwrap();
        let mine = (r == root).then(|| TensorData::new(inputs[r].clone(), shape));
        let broadcast = comm.broadcast(Group::World, mine, root).unwrap();
        (reduced, gathered, scattered, broadcast)
    });

    let reduced = TensorData::new(reference_reduce(&inputs, op), shape);
    let (gathered, gathered_shape) = reference_concat(&gather_inputs, &gather_shapes, dim);
    let gathered = TensorData::new(gathered, gathered_shape);
    let scatter_total = reference_reduce(&scatter_inputs, op);
    let broadcast = TensorData::new(inputs[root].clone(), shape);
    for (r, (got_reduced, got_gathered, got_scattered, got_broadcast)) in
        results.into_iter().enumerate()
    {
        assert_eq!(got_reduced, reduced, "all_reduce on rank {r}");
        assert_eq!(got_gathered, gathered, "all_gather on rank {r}");
        let (chunk, chunk_shape) = reference_chunk(&scatter_total, scatter_shape, dim, world, r);
        assert_eq!(
            got_scattered,
            TensorData::new(chunk, chunk_shape),
            "reduce_scatter on rank {r}"
        );
        assert_eq!(got_broadcast, broadcast, "broadcast on rank {r}");
    }
}

fn reduce_op() -> impl Strategy<Value = ReduceOp> {
    prop_oneof![
        Just(ReduceOp::Sum),
        Just(ReduceOp::Avg),
        Just(ReduceOp::Max)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// f32 and i64 on the same world, shape, dimension, values and reduction.
    #[test]
    fn collectives_match_references(
        world in 1usize..=4,
        shape in [1usize..=3, 1usize..=3, 1usize..=3],
        dim in 0usize..3,
        seed in any::<u64>(),
        op in reduce_op(),
    ) {
        check_collectives::<f32>(world, shape, dim, seed, op);
        check_collectives::<i64>(world, shape, dim, seed, op);
    }
}

#[test]
fn half_precision_accumulates_in_f32_and_rounds_once() {
    let world = 3;
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| values(7, r, 64)).collect();
    let results = run(&dp(world), |comm| {
        let r = comm.rank();
        let half: Vec<f16> = inputs[r].iter().map(|&x| f16::from_f32(x)).collect();
        let brain: Vec<bf16> = inputs[r].iter().map(|&x| bf16::from_f32(x)).collect();
        let half = comm
            .all_reduce(Group::World, TensorData::new(half, [64]), ReduceOp::Avg)
            .unwrap();
        let brain = comm
            .all_reduce(Group::World, TensorData::new(brain, [8, 8]), ReduceOp::Sum)
            .unwrap();
        (half, brain)
    });
    let (half_ref, brain_ref): (Vec<f16>, Vec<bf16>) = (0..64)
        .map(|i| {
            let (mut half, mut brain) = (0.0f32, 0.0f32);
            for input in &inputs {
                half += f16::from_f32(input[i]).to_f32();
                brain += bf16::from_f32(input[i]).to_f32();
            }
            (f16::from_f32(half / world as f32), bf16::from_f32(brain))
        })
        .unzip();
    for (half, brain) in results {
        assert_eq!(half.dtype, DType::F16);
        assert_eq!(half.to_vec::<f16>().unwrap(), half_ref);
        assert_eq!(brain.shape.as_slice(), &[8, 8]);
        assert_eq!(brain.to_vec::<bf16>().unwrap(), brain_ref);
    }
}

#[test]
fn all_reduce_is_bitwise_identical_on_every_rank_and_run() {
    let world = 4;
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| values(99, r, 1000)).collect();
    let run_once = || {
        run(&dp(world), |comm| {
            let data = TensorData::new(inputs[comm.rank()].clone(), [1000]);
            comm.all_reduce(Group::World, data, ReduceOp::Avg)
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>()
        })
    };
    let first = run_once();
    assert!(first.iter().all(|bits| *bits == first[0]));
    assert_eq!(run_once(), first);
}

#[test]
fn size_one_groups_return_the_input_unchanged() {
    // A NaN with a payload and a value that Avg over a widened type could disturb.
    let odd = [f32::from_bits(0x7fc0_1234), 0.1, -0.0];
    let results = run(&DeviceMesh::new([("dp", 2), ("tp", 1)]).unwrap(), |comm| {
        let data = TensorData::new(odd.to_vec(), [3]);
        let reduced = comm
            .all_reduce(Group::Axis(1), data.clone(), ReduceOp::Avg)
            .unwrap();
        let scattered = comm
            .reduce_scatter(Group::Axis(1), data.clone(), 0, ReduceOp::Avg)
            .unwrap();
        let gathered = comm.all_gather(Group::Axis(1), data.clone(), 0).unwrap();
        let broadcast = comm
            .broadcast(Group::Axis(1), Some(data.clone()), 0)
            .unwrap();
        comm.barrier(Group::Axis(1)).unwrap();
        // Errors do not depend on the group size.
        let bytes = TensorData::new(vec![1u8, 2], [2]);
        let unsupported = comm.all_reduce(Group::Axis(1), bytes, ReduceOp::Sum);
        (
            data,
            [reduced, scattered, gathered, broadcast],
            unsupported,
            comm.stats(),
        )
    });
    for (data, outputs, unsupported, stats) in results {
        for output in outputs {
            assert_eq!(output.as_bytes(), data.as_bytes());
            assert_eq!(output.shape, data.shape);
        }
        assert_eq!(unsupported, Err(Error::UnsupportedDType("u8".into())));
        assert_eq!(stats.count_on(CollectiveKind::AllReduce, "tp"), 1);
        assert_eq!(stats.total_count(), 5);
    }
}

#[test]
fn sub_groups_on_a_2x2_mesh() {
    let mesh = DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap();
    let results = run(&mesh, |comm| {
        let r = comm.rank();
        let mine = TensorData::new(vec![10.0 * r as f32 + 1.0, r as f32], [2]);
        let over_dp = comm
            .all_reduce(Group::Axis(0), mine.clone(), ReduceOp::Sum)
            .unwrap();
        let over_tp = comm
            .all_reduce(Group::Axis(1), mine.clone(), ReduceOp::Sum)
            .unwrap();
        let gathered_tp = comm.all_gather(Group::Axis(1), mine, 0).unwrap();
        let dp_root = comm
            .broadcast(
                Group::Axis(0),
                Some(TensorData::new(vec![r as i64], [1])),
                1,
            )
            .unwrap();
        [over_dp, over_tp, gathered_tp, dp_root].map(|data| data.iter::<f64>().collect::<Vec<_>>())
    });
    // dp groups: {0, 2} and {1, 3}; tp groups: {0, 1} and {2, 3}.
    let expected = [
        [
            vec![22.0, 2.0],
            vec![12.0, 1.0],
            vec![1.0, 0.0, 11.0, 1.0],
            vec![2.0],
        ],
        [
            vec![42.0, 4.0],
            vec![12.0, 1.0],
            vec![1.0, 0.0, 11.0, 1.0],
            vec![3.0],
        ],
        [
            vec![22.0, 2.0],
            vec![52.0, 5.0],
            vec![21.0, 2.0, 31.0, 3.0],
            vec![2.0],
        ],
        [
            vec![42.0, 4.0],
            vec![52.0, 5.0],
            vec![21.0, 2.0, 31.0, 3.0],
            vec![3.0],
        ],
    ];
    assert_eq!(results, expected);
}

#[test]
fn consecutive_rounds_never_mix() {
    let world = 4;
    let results = run(&dp(world), |comm| {
        (0..50)
            .map(|round| {
                // Different sizes per round and uneven work per rank.
                let len = 1 + round % 7;
                if comm.rank() == round % world {
                    std::thread::yield_now();
                }
                let data = TensorData::new(vec![(round * 10 + comm.rank()) as i64; len], [len]);
                let sum = comm.all_reduce(Group::World, data, ReduceOp::Sum).unwrap();
                sum.to_vec::<i64>().unwrap()
            })
            .collect::<Vec<_>>()
    });
    for rank_results in results {
        for (round, sum) in rank_results.into_iter().enumerate() {
            assert_eq!(sum, vec![(round * 40 + 6) as i64; 1 + round % 7]);
        }
    }
}

#[test]
fn missing_rank_gives_a_timeout_not_a_hang() {
    let timeout = Duration::from_millis(200);
    let options = LaunchOptions {
        timeout,
        ..Default::default()
    };
    let results = launch(&dp(3), &options, |comm| {
        if comm.rank() == 2 {
            return Vec::new(); // never arrives
        }
        let data = TensorData::new(vec![1.0f32], [1]);
        let mut errors = vec![
            comm.all_reduce(Group::World, data, ReduceOp::Sum)
                .unwrap_err(),
        ];
        if comm.rank() == 0 {
            errors.push(comm.point_to_point().unwrap().recv(2).unwrap_err());
        }
        errors
    })
    .unwrap();
    for (rank, errors) in results.iter().enumerate().take(2) {
        match &errors[0] {
            Error::Timeout {
                op: CollectiveKind::AllReduce,
                group,
                rank: who,
                waited,
                missing,
            } => {
                assert_eq!(group, "world");
                assert_eq!(*who, rank);
                assert!(*waited >= timeout && *waited < 25 * timeout, "{waited:?}");
                assert_eq!(missing, &vec![2]);
            }
            other => panic!("rank {rank}: expected a timeout, got {other:?}"),
        }
        assert!(
            errors[0].to_string().contains("rank 2 never arrived"),
            "{}",
            errors[0]
        );
    }
    assert!(matches!(
        &results[0][1],
        Error::Timeout { op: CollectiveKind::Recv, group, missing, .. }
            if group == "p2p" && missing == &vec![2]
    ));
}

#[test]
fn mismatched_calls_and_buffers_fail_on_every_member() {
    let results = run(&dp(2), |comm| {
        let data = TensorData::new(vec![1.0f32, 2.0], [2]);
        let different_call = if comm.rank() == 0 {
            comm.all_reduce(Group::World, data.clone(), ReduceOp::Sum)
        } else {
            comm.all_gather(Group::World, data.clone(), 0)
        };
        let longer = TensorData::new(vec![1.0f32; 2 + comm.rank()], [2 + comm.rank()]);
        let different_shape = comm.all_reduce(Group::World, longer, ReduceOp::Sum);
        let ints = TensorData::new(vec![1i32, 2], [2]);
        let mixed = if comm.rank() == 0 { data.clone() } else { ints };
        let different_dtype = comm.all_gather(Group::World, mixed, 0);
        let different_root = comm.broadcast(Group::World, Some(data.clone()), comm.rank());
        // Still in step afterwards.
        let fine = comm.all_reduce(Group::World, data, ReduceOp::Max);
        (
            different_call,
            different_shape,
            different_dtype,
            different_root,
            fine,
        )
    });
    for (rank, (call, shape, dtype, root, fine)) in results.into_iter().enumerate() {
        let call = call.unwrap_err();
        assert!(matches!(call, Error::Mismatch { .. }), "{call:?}");
        let message = call.to_string();
        assert!(
            message.contains("rank 0 called all_reduce(sum)")
                && message.contains("rank 1 called all_gather(dim 0)"),
            "rank {rank}: {message}"
        );
        let shape = shape.unwrap_err().to_string();
        assert!(shape.contains("rank 1 passed f32 [3]"), "{shape}");
        let dtype = dtype.unwrap_err().to_string();
        assert!(dtype.contains("rank 1 passed i32 [2]"), "{dtype}");
        assert!(matches!(
            root,
            Err(Error::Mismatch {
                op: CollectiveKind::Broadcast,
                ..
            })
        ));
        assert_eq!(fine.unwrap().to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
    }
}

#[test]
fn invalid_arguments_are_typed_errors() {
    let results = run(&dp(2), |comm| {
        let data = TensorData::new(vec![1.0f32, 2.0, 3.0], [3]);
        let indivisible = comm.reduce_scatter(Group::World, data.clone(), 0, ReduceOp::Sum);
        let bad_dim = comm.all_gather(Group::World, data.clone(), 1);
        let bad_root = comm.broadcast(Group::World, Some(data.clone()), 2);
        let bad_axis = comm.barrier(Group::Axis(1));
        let bad_peer = comm.point_to_point().unwrap().send(5, data);
        (indivisible, bad_dim, bad_root, bad_axis, bad_peer)
    });
    for (indivisible, bad_dim, bad_root, bad_axis, bad_peer) in results {
        assert_eq!(
            indivisible,
            Err(Error::Unsplittable {
                dim: 0,
                size: 3,
                parts: 2
            })
        );
        assert_eq!(
            bad_dim,
            Err(Error::InvalidDim {
                op: CollectiveKind::AllGather,
                dim: 1,
                ndims: 1
            })
        );
        assert!(matches!(
            bad_root,
            Err(Error::InvalidRank {
                rank: 2,
                size: 2,
                ..
            })
        ));
        assert!(matches!(
            bad_axis,
            Err(Error::NoSuchAxisIndex { axis: 1, .. })
        ));
        assert!(matches!(
            bad_peer,
            Err(Error::InvalidRank {
                rank: 5,
                size: 2,
                ..
            })
        ));
    }
}

#[test]
fn stats_count_calls_and_bytes_as_defined() {
    let mesh = DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap();
    let results = run(&mesh, |comm| {
        let r = comm.rank();
        let f32s = |len: usize| TensorData::new(vec![r as f32; len], [len]);
        comm.all_reduce(Group::Axis(0), f32s(4), ReduceOp::Sum)
            .unwrap();
        comm.all_reduce(Group::Axis(0), f32s(4), ReduceOp::Avg)
            .unwrap();
        comm.all_gather(Group::Axis(1), f32s(3), 0).unwrap();
        comm.reduce_scatter(Group::World, f32s(8), 0, ReduceOp::Sum)
            .unwrap();
        let mine = (comm.group_index_on(1) == 0).then(|| f32s(5));
        comm.broadcast(Group::Axis(1), mine, 0).unwrap();
        comm.barrier(Group::World).unwrap();
        let p2p = comm.point_to_point().unwrap();
        p2p.send((r + 1) % 4, f32s(2)).unwrap();
        p2p.recv((r + 3) % 4).unwrap();
        let stats = comm.stats();
        comm.reset_stats();
        (stats, comm.stats())
    });
    for (stats, after_reset) in results {
        use CollectiveKind::*;
        assert_eq!(stats.count_on(AllReduce, "dp"), 2);
        assert_eq!(stats.bytes_on(AllReduce, "dp"), 32);
        assert_eq!(stats.count_on(AllReduce, "tp"), 0);
        assert_eq!(stats.bytes_on(AllGather, "tp"), 12);
        assert_eq!(stats.bytes_on(ReduceScatter, "world"), 32);
        assert_eq!(stats.bytes_on(Broadcast, "tp"), 20);
        assert_eq!(stats.count_on(Barrier, "world"), 1);
        assert_eq!(stats.bytes(Barrier), 0);
        assert_eq!(stats.bytes_on(Send, "p2p"), 8);
        assert_eq!(stats.bytes_on(Recv, "p2p"), 8);
        assert_eq!(stats.count(AllReduce), 2);
        assert_eq!(stats.total_bytes(), 32 + 12 + 32 + 20 + 8 + 8);
        assert!(after_reset.is_empty());
    }
}

#[test]
fn send_recv_ring_over_three_ranks() {
    let world = 3;
    let results = run(&dp(world), |comm| {
        let r = comm.rank();
        let comm = comm.point_to_point().unwrap();
        let next = (r + 1) % world;
        let prev = (r + world - 1) % world;
        for message in 0..3 {
            let data = TensorData::new(vec![(r * 100 + message) as i64], [1]);
            comm.send(next, data).unwrap();
        }
        (0..3)
            .map(|_| comm.recv(prev).unwrap().to_vec::<i64>().unwrap()[0])
            .collect::<Vec<_>>()
    });
    for (r, received) in results.into_iter().enumerate() {
        let prev = ((r + world - 1) % world) as i64;
        assert_eq!(received, vec![prev * 100, prev * 100 + 1, prev * 100 + 2]);
    }
}

/// The test's shorthand for this rank's index along a mesh axis.
trait GroupIndex {
    fn group_index_on(&self, axis: usize) -> usize;
}

impl GroupIndex for Arc<dyn Communicator> {
    fn group_index_on(&self, axis: usize) -> usize {
        self.mesh().group_index(self.rank(), axis)
    }
}

/// The rows member `i` sends member `j` in the all-to-all tests: unequal, some empty.
fn a2a_rows(i: usize, j: usize) -> usize {
    (3 * i + 5 * j + 1) % 4
}

/// Every row of an all-to-all reaches its member, in group order of the senders, on the world
/// of 4 and on each axis of a 2 × 2 mesh; sent back with the splits swapped (its conjugate),
/// every member has its buffer again; the statistics count one call of the buffer's bytes per
/// direction.
#[test]
fn all_to_all_moves_each_row_to_its_member() {
    // Row r of member i's buffer is [i, destination, r].
    let buffer = |i: usize, n: usize| {
        let mut v = Vec::new();
        for j in 0..n {
            for r in 0..a2a_rows(i, j) {
                v.extend([i as i64, j as i64, r as i64]);
            }
        }
        let rows = v.len() / 3;
        TensorData::new(v, [rows, 3])
    };
    for mesh in [dp(4), DeviceMesh::new([("dp", 2), ("tp", 2)]).unwrap()] {
        let groups: Vec<Group> = if mesh.axes().len() == 1 {
            vec![Group::World]
        } else {
            vec![Group::World, Group::Axis(0), Group::Axis(1)]
        };
        for group in groups {
            let results = run(&mesh, |comm| {
                let (m, rank) = (comm.mesh().clone(), comm.rank());
                let (i, n) = (group.index(&m, rank).unwrap(), group.size(&m).unwrap());
                let send: Vec<usize> = (0..n).map(|j| a2a_rows(i, j)).collect();
                let recv: Vec<usize> = (0..n).map(|j| a2a_rows(j, i)).collect();
                let mine = buffer(i, n);
                let got = comm.all_to_all(group, mine.clone(), &send, &recv).unwrap();
                let back = comm.all_to_all(group, got.clone(), &recv, &send).unwrap();
                assert_eq!(back, mine, "the conjugate brings every row home");
                let stats = comm.stats();
                assert_eq!(stats.count(CollectiveKind::AllToAll), 2);
                assert_eq!(
                    stats.bytes(CollectiveKind::AllToAll),
                    (mine.bytes.len() + got.bytes.len()) as u64
                );
                (i, n, got)
            });
            for (i, n, got) in results {
                let mut expected = Vec::new();
                for sender in 0..n {
                    for r in 0..a2a_rows(sender, i) {
                        expected.extend([sender as i64, i as i64, r as i64]);
                    }
                }
                let rows = expected.len() / 3;
                assert_eq!(
                    got,
                    TensorData::new(expected, [rows, 3]),
                    "{group} member {i}"
                );
            }
        }
    }
}

/// Splits that do not fit — a member expecting other rows than are sent to it, or sending more
/// rows than its buffer holds — fail on every member with the same mismatch, naming each
/// member's splits; a group of one returns its buffer, and refuses splits that are not its
/// rows.
#[test]
fn all_to_all_splits_that_disagree_fail_on_every_member() {
    let options = LaunchOptions {
        timeout: TEST_TIMEOUT,
        ..Default::default()
    };
    let errors = launch(&dp(2), &options, |comm| {
        let data = TensorData::new(vec![1.0f32; 6], [3, 2]);
        // Rank 1 sends rank 0 two rows; rank 0 expects one.
        let (send, recv) = if comm.rank() == 0 {
            (vec![1, 2], vec![1, 1])
        } else {
            (vec![2, 1], vec![2, 1])
        };
        comm.all_to_all(Group::World, data, &send, &recv)
            .map(|_| ())
            .unwrap_err()
    })
    .unwrap();
    for e in &errors {
        let text = e.to_string();
        assert!(
            matches!(
                e,
                Error::Mismatch {
                    op: CollectiveKind::AllToAll,
                    ..
                }
            ) && text.contains("rank 0 sends [1, 2] and expects [1, 1]")
                && text.contains("rank 1 sends [2, 1] and expects [2, 1]"),
            "{text}"
        );
    }
    assert_eq!(errors[0], errors[1]);
    let too_many = launch(&dp(2), &options, |comm| {
        let data = TensorData::new(vec![1.0f32; 4], [2, 2]);
        comm.all_to_all(Group::World, data, &[2, 1], &[2, 1])
            .map(|_| ())
            .unwrap_err()
    })
    .unwrap();
    assert!(
        too_many[0].to_string().contains("of 2 rows"),
        "{}",
        too_many[0]
    );
    let alone = run(&dp(1), |comm| {
        let data = TensorData::new(vec![1.0f32, 2.0, 3.0], [3, 1]);
        let same = comm
            .all_to_all(Group::World, data.clone(), &[3], &[3])
            .unwrap();
        let refused = comm
            .all_to_all(Group::World, data.clone(), &[2], &[3])
            .is_err();
        (same == data, refused)
    });
    assert_eq!(alone, vec![(true, true)]);
}

/// `issue_then`'s finishing step runs on the rank's communication thread once the call
/// completed, and the waiter gets what it made: each rank's gather, finished there — under the
/// device stream of the thread that issued it (where its upload must go: the communication
/// thread's own stream, which it is not, would race the compute stream), and so is a step
/// wrapped in `on_callers_stream` by hand.
#[test]
fn issued_calls_finish_on_the_communication_thread() {
    use burn_backend::StreamId;
    let results = run(&dp(2), |comm| {
        let queue = CommQueue::new(comm.clone());
        let mine = TensorData::new(vec![comm.rank() as f32; 3], [3]);
        let call = Call::all_gather(Group::World, Operand::of(&mine), 0);
        let pending = queue.issue_then(call, Some(mine), |gathered: TensorData| {
            let thread = std::thread::current().name().map(str::to_owned);
            (
                gathered.to_vec::<f32>().unwrap(),
                thread,
                StreamId::current(),
            )
        });
        let finished = pending.wait().unwrap();
        let again = TensorData::new(vec![0.0f32], [1]);
        let call = Call::all_gather(Group::World, Operand::of(&again), 0);
        let wrapped = on_callers_stream(|_| StreamId::current());
        let wrapped = queue.issue_then(call, Some(again), wrapped);
        (finished, StreamId::current(), wrapped.wait().unwrap())
    });
    let mut callers = Vec::new();
    for (rank, ((gathered, thread, stream), caller, wrapped)) in results.into_iter().enumerate() {
        assert_eq!(gathered, [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        assert_eq!(thread.as_deref(), Some(&*format!("wildfire-comm-{rank}")));
        assert_eq!(stream, caller, "rank {rank}: the finishing step's stream");
        assert_eq!(wrapped, caller, "rank {rank}: a wrapped step's stream");
        callers.push(caller);
    }
    assert_ne!(
        callers[0], callers[1],
        "each rank's thread has a stream of its own"
    );
}
