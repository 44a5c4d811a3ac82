//! Expert parallelism's dispatch and combine on `Distributed<B>`
//! ([`FusedOps::expert_dispatch`](wildfire_kernels::FusedOps::expert_dispatch)): the routed rows
//! travel over the mesh's expert axis ([`EXPERT_AXIS`]) in one all-to-all each way, and the
//! experts' grouped matmul runs on each member's share of the stacked weights.
//!
//! Placements: routed rows are per-rank data, `Local` on the expert axis before dispatch and
//! after (a member's rows for its experts: a different count on each); the stacked expert
//! weights are `Shard(0)` on it, each member its experts. The grouped matmul takes the local
//! rows and the local experts (other data axes: weights gathered whole, rows `Local`; model
//! axes as a linear layer's, each expert split like one). Model axes of the rows are brought
//! whole before an exchange (partial sums reduced), so tensor-parallel peers exchange the same
//! rows.
//!
//! Gradients keep the data-parallel convention (a `Local` tensor's gradient is its rank's own
//! loss's): the exchanges move gradients unscaled, and an expert's weight gradient — its
//! member's rows came from every member of the axis, so it sums all their losses' gradients —
//! is divided by the axis's size and averaged over the other data axes as every weight
//! gradient is ([`super::rules::matrix::grouped_matmul_backward`]).

use super::rules::{to_layout, wrap};
use crate::comm::Group;
use crate::device::DistDevice;
use crate::error::{Error, raise};
use crate::mesh::{AxisKind, EXPERT_AXIS};
use crate::placement::Placement;
use crate::tensor::DTensor;
use burn::tensor::TensorData;
use burn_backend::Backend;
use wildfire_kernels::experts::{self, ExpertRoute};

/// The mesh's expert axis, when it has one of more than one member.
fn axis<B: Backend>(device: &DistDevice<B>) -> Option<usize> {
    device.mesh().expert_axis().map(|(a, _)| a)
}

/// This rank's index on the expert axis and its size; `(0, 1)` without one.
pub(super) fn position<B: Backend>(device: &DistDevice<B>) -> (usize, usize) {
    match device.mesh().expert_axis() {
        Some((a, size)) => (device.mesh().group_index(device.rank(), a), size),
        None => (0, 1),
    }
}

/// Counts as a host buffer for a collective.
fn counts_data(counts: &[usize]) -> TensorData {
    let v: Vec<i64> = counts.iter().map(|&c| c as i64).collect();
    TensorData::new(v, [counts.len()])
}

/// A collective's result of [`counts_data`] buffers, back as counts.
fn counts_of(data: TensorData) -> Vec<usize> {
    data.convert::<i64>()
        .into_vec::<i64>()
        .expect("i64 counts come back i64")
        .into_iter()
        .map(|c| c as usize)
        .collect()
}

/// Every expert-axis member's routing counts, member-major (one all-gather over the axis).
pub(super) fn gather_counts<B: Backend>(device: &DistDevice<B>, counts: &[usize]) -> Vec<usize> {
    let Some(a) = axis(device) else {
        return counts.to_vec();
    };
    let all = device
        .context()
        .comm()
        .all_gather(Group::Axis(a), counts_data(counts), 0)
        .unwrap_or_else(|e| raise(e));
    counts_of(all)
}

/// `values` summed over every data axis of the mesh (one all-reduce per axis above one
/// member; exact: integers).
pub(super) fn data_sum<B: Backend>(device: &DistDevice<B>, values: &[usize]) -> Vec<usize> {
    let mesh = device.mesh();
    let mut sums = values.to_vec();
    for (a, ax) in mesh.axes().iter().enumerate() {
        if ax.kind != AxisKind::Data || ax.size == 1 {
            continue;
        }
        let reduced = device
            .context()
            .comm()
            .all_reduce(
                Group::Axis(a),
                counts_data(&sums),
                crate::comm::ReduceOp::Sum,
            )
            .unwrap_or_else(|e| raise(e));
        sums = counts_of(reduced);
    }
    sums
}

/// `t` whole on the model axes (partial sums reduced, shards gathered), its data axes as they
/// are save partial sums (reduced), checked to be per-rank (`Local`) on the expert axis.
fn settle<B: Backend>(op: &'static str, t: DTensor<B>) -> DTensor<B> {
    let expect = Placement::Local;
    let t = t.settled().unpadded();
    let mesh = t.device.mesh().clone();
    let mut target = t.layout.clone();
    for (a, ax) in mesh.axes().iter().enumerate() {
        let p = t.layout.get(a);
        if ax.kind == AxisKind::Model || matches!(p, Placement::Partial(_)) {
            target.set(a, Placement::Replicate);
        }
    }
    if let Some(a) = axis(&t.device)
        && target.get(a) != expect
    {
        raise(Error::InvalidLayout {
            shape: t.shape.to_vec(),
            mesh: mesh.to_string(),
            reason: format!(
                "{op} takes {expect:?} on the expert axis '{EXPERT_AXIS}', got {:?} (routed rows \
                 are per-rank data on both sides of an exchange)",
                t.layout.get(a)
            ),
        });
    }
    to_layout(op, t, &target)
}

/// Rows `[rows, d]` sorted by expert to the members holding the experts, regrouped there
/// expert by expert (both `Local` on the expert axis).
pub(super) fn dispatch<B: Backend>(x: DTensor<B>, route: &ExpertRoute) -> DTensor<B> {
    let x = settle("expert_dispatch", x);
    let device = x.device.clone();
    let local = exchange(&device, x.local, &route.send(), &route.recv());
    wrap(
        experts::regroup::<B>(local, route),
        x.meta.layout.clone(),
        device,
    )
}

/// The experts' rows back to the ranks that routed them, in their order (dispatch's adjoint).
pub(super) fn combine<B: Backend>(y: DTensor<B>, route: &ExpertRoute) -> DTensor<B> {
    let y = settle("expert_combine", y);
    let device = y.device.clone();
    let local = experts::ungroup::<B>(y.local, route);
    let local = exchange(&device, local, &route.recv(), &route.send());
    wrap(local, y.meta.layout.clone(), device)
}

/// The all-to-all of rows over the expert axis; nothing without one.
fn exchange<B: Backend>(
    device: &DistDevice<B>,
    local: B::FloatTensorPrimitive,
    send: &[usize],
    recv: &[usize],
) -> B::FloatTensorPrimitive {
    match axis(device) {
        Some(a) => crate::collectives::all_to_all(device, Group::Axis(a), local, send, recv)
            .unwrap_or_else(|e| raise(e)),
        None => local,
    }
}
