//! Expert parallelism's dispatch and combine on `Distributed<B>`
//! ([`FusedOps::expert_dispatch`](wildfire_kernels::FusedOps::expert_dispatch)): the routed rows
//! travel over the mesh's expert axis ([`EXPERT_AXIS`]) in one all-to-all each way.
//!
//! Placements: a rank's routed rows are per-rank data, `Local` on the expert axis; the
//! dispatched batch `[local experts, capacity, d]` is the expert axis's share of one batch
//! `[E, capacity, d]`, `Shard(0)` on it, as the stacked expert weights are: the batched matmuls
//! between them run locally, and the experts' weight gradients come out `Shard(0)` too, never
//! reduced over the expert axis (each member's own experts saw every member's rows). Other data
//! axes stay `Local` (their gradients average there, as every data-parallel gradient does).
//! Model axes are brought whole first (partial sums reduced), so under tensor parallelism every
//! peer exchanges the same rows.
//!
//! Gradients keep the data-parallel convention: a `Local` tensor's gradient is the rank's own
//! loss's, a global tensor's that of the mean loss over the ranks. Combine turns the batch into
//! rows, so its backward (the dispatch of the rows' gradients) divides by the axis's size;
//! dispatch's backward multiplies by it.

use super::rules::{to_layout, wrap};
use crate::comm::Group;
use crate::device::DistDevice;
use crate::error::{Error, raise};
use crate::mesh::{AxisKind, EXPERT_AXIS};
use crate::placement::{Layout, Placement};
use crate::tensor::DTensor;
use burn::tensor::TensorData;
use burn_backend::Backend;
use wildfire_kernels::experts::{self, ExpertRoute};

/// The mesh's expert axis, when it has one of more than one member.
fn axis<B: Backend>(device: &DistDevice<B>) -> Option<usize> {
    let mesh = device.mesh();
    mesh.axis_index(EXPERT_AXIS)
        .ok()
        .filter(|&a| mesh.axis_size(a) > 1)
}

/// This rank's index on the expert axis and its size; `(0, 1)` without one.
pub(super) fn position<B: Backend>(device: &DistDevice<B>) -> (usize, usize) {
    match axis(device) {
        Some(a) => (
            device.mesh().group_index(device.rank(), a),
            device.mesh().axis_size(a),
        ),
        None => (0, 1),
    }
}

/// Every expert-axis member's routing counts, member-major (one all-gather over the axis).
pub(super) fn gather_counts<B: Backend>(device: &DistDevice<B>, counts: &[usize]) -> Vec<usize> {
    let Some(a) = axis(device) else {
        return counts.to_vec();
    };
    let data = TensorData::new(
        counts.iter().map(|&c| c as i64).collect::<Vec<_>>(),
        [counts.len()],
    );
    let all = device
        .context()
        .comm()
        .all_gather(Group::Axis(a), data, 0)
        .unwrap_or_else(|e| raise(e));
    all.convert::<i64>()
        .into_vec::<i64>()
        .expect("i64 counts gather as i64")
        .into_iter()
        .map(|c| c as usize)
        .collect()
}

/// `t` whole on the model axes (partial sums reduced, shards gathered), its data axes as they
/// are save partial sums (reduced), checked to hold `expect` on the expert axis.
fn settle<B: Backend>(op: &'static str, t: DTensor<B>, expect: Placement) -> DTensor<B> {
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
                 are per-rank, the dispatched batch sharded by expert)",
                t.layout.get(a)
            ),
        });
    }
    to_layout(op, t, &target)
}

/// Rows `[rows, d]` (`Local` on the expert axis) to the dispatched batch (`Shard(0)`), divided
/// by the axis's size when `gradient` (combine's backward).
pub(super) fn dispatch<B: Backend>(
    x: DTensor<B>,
    route: &ExpertRoute,
    gradient: bool,
) -> DTensor<B> {
    const OP: &str = "expert_dispatch";
    let x = settle(OP, x, Placement::Local);
    let device = x.device.clone();
    let mut local = x.local;
    let mut layout = x.layout;
    if let Some(a) = axis(&device) {
        if gradient {
            local = B::float_mul_scalar(local, (1.0 / route.members as f64).into());
        }
        local = crate::collectives::all_to_all(
            &device,
            Group::Axis(a),
            local,
            &route.send(),
            &route.recv(),
        )
        .unwrap_or_else(|e| raise(e));
        layout = layout.with(a, Placement::Shard(0));
    }
    wrap(experts::pad::<B>(local, route), layout, device)
}

/// The dispatched batch (`Shard(0)` on the expert axis) back to the rows of the ranks that
/// routed them (`Local`), times the axis's size when `gradient` (dispatch's backward).
pub(super) fn combine<B: Backend>(
    y: DTensor<B>,
    route: &ExpertRoute,
    gradient: bool,
) -> DTensor<B> {
    const OP: &str = "expert_combine";
    let y = settle(OP, y, Placement::Shard(0));
    let device = y.device.clone();
    let mut local = experts::unpad::<B>(y.local, route);
    let mut layout: Layout = y.layout;
    if let Some(a) = axis(&device) {
        local = crate::collectives::all_to_all(
            &device,
            Group::Axis(a),
            local,
            &route.recv(),
            &route.send(),
        )
        .unwrap_or_else(|e| raise(e));
        if gradient {
            local = B::float_mul_scalar(local, (route.members as f64).into());
        }
        layout = layout.with(a, Placement::Local);
    }
    wrap(local, layout, device)
}
