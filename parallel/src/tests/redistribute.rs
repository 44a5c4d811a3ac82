//! Redistribution between layouts: round trips, the errors of layouts that cannot be reached,
//! and the device collectives carrying every redistribution.

use super::*;

/// Every pair (`from`, `to`) of global layouts of a rank-3 tensor on the device's mesh, with
/// `base` laid out as `from` on this rank (the pairs whose `from` cannot hold `base` left out).
fn layout_pairs<'a>(
    base: &'a TensorData,
    device: &'a DistDevice<F>,
) -> impl Iterator<Item = (Layout, Layout, DTensor<F>)> + 'a {
    let layouts = placed_layouts(device.mesh(), 3);
    let pairs: Vec<(Layout, Layout)> = layouts
        .iter()
        .flat_map(|from| layouts.iter().map(|to| (from.clone(), to.clone())))
        .collect();
    pairs.into_iter().filter_map(move |(from, to)| {
        let t = Tensor::<F, 3>::from_data(base.clone(), &Default::default());
        let dt = DTensor::from_full(t.into_primitive().tensor(), &from, device).ok()?;
        Some((from, to, dt))
    })
}

#[test]
fn redistribute_round_trips_every_layout_pair() {
    let mesh = mesh22();
    let base = values(&[4, 4, 8], 11);
    let results = threads(&mesh, |device| {
        let mut checked = 0;
        for (from, to, dt) in layout_pairs(&base, &device) {
            let Ok(moved) = dt.redistribute(&to) else {
                continue;
            };
            assert_eq!(moved.layout(), &to);
            let full = moved.full().unwrap();
            let got = Tensor::<F, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(full));
            close(&got.into_data(), &base).unwrap_or_else(|e| panic!("{from} -> {to}: {e}"));
            checked += 1;
        }
        checked
    });
    assert!(results[0] > 400, "{results:?}");
}

#[test]
fn uneven_shards_are_a_typed_error() {
    let mesh = DeviceMesh::new([("tp", 4)]).unwrap();
    let results = threads(&mesh, |device| {
        let t = Tensor::<F, 2>::from_data(values(&[6, 3], 1), &Default::default());
        DTensor::from_full(
            t.into_primitive().tensor(),
            &Layout::new([Placement::Shard(0)]),
            &device,
        )
        .map(|_| ())
    });
    for r in results {
        match r {
            Err(Error::Indivisible {
                dim: 0,
                size: 6,
                shards: 4,
                ..
            }) => {}
            other => panic!("expected Indivisible, got {other:?}"),
        }
    }
}

#[test]
fn local_data_cannot_become_global() {
    let mesh = DeviceMesh::new([("dp", 2)]).unwrap();
    let results = threads(&mesh, |device| {
        let t = Tensor::<D, 1>::from_data([1.0, 2.0], &device);
        assert_eq!(dtensor(&t).layout(), &Layout::new([Placement::Local]));
        dtensor(&t)
            .redistribute(&Layout::new([Placement::Replicate]))
            .map(|_| ())
    });
    assert!(matches!(
        results[0],
        Err(Error::InvalidRedistribution { .. })
    ));
}

/// With device collectives installed, every redistribution goes through them (none through the
/// host communicator directly), each collective along every dimension is only ever asked of
/// them along dim 0, and the results are bitwise those of the host path.
#[test]
fn device_collectives_carry_every_redistribution_bitwise() {
    let mesh = mesh22();
    let base = values(&[4, 4, 8], 5);
    let results = threads(&mesh, |device| {
        let comm = device.context().comm_arc();
        let run = |device: &DistDevice<F>| {
            let mut out = Vec::new();
            for (_, to, dt) in layout_pairs(&base, device) {
                // Partial → Shard must reach the shard by a reduce-scatter on any dim.
                let moved = dt.redistribute(&to).unwrap();
                out.push(crate::comm::read::<F>(moved.local().clone()));
            }
            // A per-rank value adopted from member 0 (a broadcast).
            let local = Tensor::<F, 2>::from_data(
                values(&[3, 5], device.rank() as u64),
                &Default::default(),
            );
            let dt = DTensor::from_local(
                local.into_primitive().tensor(),
                Layout::new([Placement::Local, Placement::Replicate]),
                device,
            )
            .unwrap();
            out.push(crate::comm::read::<F>(
                dt.adopt_from_first(0).unwrap().local().clone(),
            ));
            out
        };
        let host = run(&device);
        let host_stats = comm.stats();
        comm.reset_stats();
        let counting = Arc::new(HostStaged::new(comm.clone()));
        device
            .context()
            .set_device_collectives::<F>(counting.clone());
        let staged = run(&device);
        device.context().clear_device_collectives();
        let staged_stats = comm.stats();
        let calls = counting.calls();
        (host, staged, host_stats, staged_stats, calls)
    });
    for (host, staged, host_stats, staged_stats, calls) in results {
        assert_eq!(host.len(), staged.len());
        for (a, b) in host.iter().zip(&staged) {
            assert_eq!(a.as_bytes(), b.as_bytes());
            assert_eq!(a.shape, b.shape);
        }
        // The same collectives, by kind, and every one went through the device collectives
        // (whose host staging recorded it), along dim 0.
        for kind in [
            CollectiveKind::AllReduce,
            CollectiveKind::AllGather,
            CollectiveKind::ReduceScatter,
            CollectiveKind::Broadcast,
        ] {
            assert_eq!(host_stats.count(kind), staged_stats.count(kind), "{kind:?}");
            assert_eq!(host_stats.bytes(kind), staged_stats.bytes(kind), "{kind:?}");
            let calls = calls.get(&kind).copied().unwrap_or(0);
            assert_eq!(calls, host_stats.count(kind), "{kind:?}");
        }
        let count = |kind| calls.get(&kind).copied().unwrap_or(0);
        assert!(
            count(CollectiveKind::AllGather) > 50 && count(CollectiveKind::ReduceScatter) > 10,
            "{calls:?}"
        );
        assert_eq!(count(CollectiveKind::Broadcast), 1);
    }
}

/// Partial sums becoming nested shards of one dimension (FSDP's gradients over two data axes)
/// take one reduce-scatter per axis, the outer first, and no all-reduce — padded where the rows
/// do not divide; so does a partial sum under an outer shard that divides evenly (a stacked
/// expert weight's gradient, split over the expert axis, reduced over the data axis inside).
/// The values are the sums either way.
#[test]
fn nested_shards_of_partial_sums_reduce_scatter_outer_first() {
    use crate::CollectiveKind::{AllReduce, ReduceScatter};
    use Placement::{Partial, Shard};
    // Two data axes (a data split may pad).
    let mesh = DeviceMesh::new([("ep", 2), ("dp", 2)]).unwrap();
    let sum = Partial(ReduceOp::Sum);
    let cases = [
        // (rows, from, reduce-scatters)
        (8, Layout::new([sum, sum]), 2),
        (6, Layout::new([sum, sum]), 2),
        (8, Layout::new([Shard(0), sum]), 1),
    ];
    for (rows, from, scatters) in cases {
        let target = Layout::new([Shard(0), Shard(0)]);
        let results = threads(&mesh, |device| {
            let rank = device.rank();
            // Every rank's summand; under an outer shard, its piece of the rank's summand.
            let whole = values(&[rows, 3], 40 + rank as u64);
            let t = Tensor::<F, 2>::from_data(whole.clone(), &Default::default());
            let local = match from.get(0) {
                Shard(_) => {
                    let i = mesh.group_index(rank, 0);
                    t.narrow(0, i * rows / 2, rows / 2)
                }
                _ => t,
            };
            let dt = DTensor::new_unchecked(
                local.into_primitive().tensor(),
                from.clone(),
                device.clone(),
            );
            let before = device.context().comm_stats();
            let moved = dt.redistribute(&target).unwrap();
            let after = device.context().comm_stats();
            let full = Tensor::<F, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(
                moved.full().unwrap(),
            ));
            (
                full.into_data(),
                after.count(ReduceScatter) - before.count(ReduceScatter),
                after.count(AllReduce) - before.count(AllReduce),
            )
        });
        // The expected sum: over every rank's summand (under an outer shard, each piece summed
        // over the inner axis only, which is what a shard of a sum over the inner axis holds).
        let summands: Vec<Vec<f32>> = (0..4)
            .map(|r| values(&[rows, 3], 40 + r).into_vec().unwrap())
            .collect();
        let expected: Vec<f32> = (0..rows * 3)
            .map(|i| match from.get(0) {
                Shard(_) => {
                    // Row block i / (rows/2·3) lives on the outer member of that index; its
                    // inner members are ranks 2·outer and 2·outer + 1.
                    let outer = i / (rows / 2 * 3);
                    summands[2 * outer][i] + summands[2 * outer + 1][i]
                }
                _ => summands.iter().map(|s| s[i]).sum(),
            })
            .collect();
        for (rank, (full, rs, ar)) in results.into_iter().enumerate() {
            let what = format!("{rows} rows from {from}, rank {rank}");
            close(&full, &TensorData::new(expected.clone(), [rows, 3]))
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(rs, scatters, "{what}: reduce-scatters");
            assert_eq!(ar, 0, "{what}: all-reduces");
        }
    }
}
