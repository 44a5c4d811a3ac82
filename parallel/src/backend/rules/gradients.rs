//! Data-parallel weight gradients, reduced where they are born: the layouts of a weight-gradient
//! op's operands, and the reduction of its per-rank summands into the layout the rank's sharding
//! policy gives gradients.

use super::is_data;
use crate::backend::prelude::*;
use crate::comm::ReduceOp;
use crate::device::DistDevice;
use crate::error::raise;
use crate::mesh::DeviceMesh;
use crate::placement::{Layout, Placement};
use crate::policy::GradientReduction;
use crate::tensor::DTensor;
use Placement::{Local, Partial, Replicate, Shard};
use burn_backend::TensorMetadata;

/// After computing a weight gradient from per-rank data: average the summands over every data
/// axis where an operand was `Local`, into the layout the rank's sharding policy gives gradients
/// (`Replicate` for DDP and ZeRO-1, `Shard(0)` on the shard axes of ZeRO-2/3 and HSDP): reduced
/// where it is born.
pub(super) fn reduce_data_parallel<B: Backend>(
    grad: B::FloatTensorPrimitive,
    mut layout: Layout,
    summand_axes: &[usize],
    device: DistDevice<B>,
) -> DTensor<B> {
    device.ctx.mark_gradients_pending();
    let mut target = layout.clone();
    let global = layout.global_shape(&grad.shape(), device.mesh());
    let plan = device.ctx.grad_layout(&global, &layout);
    for &a in summand_axes {
        layout.set(a, Partial(ReduceOp::Avg));
        target.set(a, plan.get(a));
    }
    // Replicated gradients (DDP, ZeRO-1) are all-reduced once per step by `sync_gradients`, as
    // PyTorch DDP's buckets do: a parameter used twice (a tied embedding) then costs one
    // all-reduce, not one per use. Sharded ones (ZeRO-2/3) are reduce-scattered here, where they
    // are born, so full-size gradients never pile up.
    let at_sync = device
        .ctx
        .with_policy(|p| p.sharding.gradient_reduction == GradientReduction::AtSync);
    let defer = device.ctx.no_sync() || at_sync;
    let asynchronous = device.ctx.with_policy(|p| p.reduce_in_flight > 0);
    let grad = DTensor::new_unchecked(grad, layout, device);
    if !grad.device().context().no_sync()
        && let Some(limit) = crate::tensor::buckets::limit(grad.device().context())
        && crate::tensor::buckets::fits(&grad, &target)
    {
        // DDP buckets: reduced with the gradients born next to it, as the bucket fills.
        return crate::tensor::buckets::add(grad, &target, limit);
    }
    if defer {
        // Keep the summands; `sync_gradients` reduces the sum once.
        return grad;
    }
    if asynchronous {
        return grad
            .reduce_gradient_async(&target)
            .unwrap_or_else(|e| raise(e));
    }
    grad.reduce_gradient(&target).unwrap_or_else(|e| raise(e))
}

/// [`reduce_data_parallel`] for a weight gradient whose computation is deferred (a zero-bubble
/// `I` action; gradients kept unreduced, so no reduction runs here): a stand-in of the local
/// shape `local_shape` and `dtype` that `compute` fills at its first use or when the rank runs
/// its deferred weight gradients.
pub(super) fn deferred_data_parallel<B: Backend>(
    compute: crate::tensor::DeferredPiece<B>,
    local_shape: Vec<usize>,
    dtype: burn_backend::DType,
    mut layout: Layout,
    summand_axes: &[usize],
    device: DistDevice<B>,
) -> DTensor<B> {
    device.ctx.mark_gradients_pending();
    for &a in summand_axes {
        layout.set(a, Partial(ReduceOp::Avg));
    }
    let global = burn_backend::Shape::from(layout.global_shape(&local_shape, device.mesh()));
    let awaited = std::sync::Arc::new(crate::tensor::Awaited::deferred(compute));
    device.ctx.defer(awaited.clone());
    DTensor::awaiting(awaited, local_shape, dtype, layout, global, device, true)
}

/// Split the mesh axes of a weight-gradient op: data axes where an operand is `Local` produce
/// summands (both operands brought to `Local`/`Replicate`); the rest go through `decide`.
pub(super) fn weight_grad_layouts(
    mesh: &DeviceMesh,
    a_layout: &Layout,
    b_layout: &Layout,
    decide: impl Fn(Placement, Placement) -> (Placement, Placement, Placement),
) -> (Layout, Layout, Layout, Vec<usize>) {
    let (mut ta, mut tb, mut out) = (a_layout.clone(), b_layout.clone(), a_layout.clone());
    let mut summands = Vec::new();
    for a in 0..ta.len() {
        let (pa, pb) = (a_layout.get(a), b_layout.get(a));
        if is_data(mesh, a) && (pa == Local || pb == Local) {
            let whole = |p: Placement| if p == Local { Local } else { Replicate };
            ta.set(a, whole(pa));
            tb.set(a, whole(pb));
            out.set(a, Replicate);
            if mesh.axis_size(a) > 1 {
                summands.push(a);
            }
        } else {
            let (x, y, o) = decide(pa, pb);
            ta.set(a, x);
            tb.set(a, y);
            out.set(a, o);
        }
    }
    (ta, tb, out, summands)
}

/// The gradient of a per-channel parameter (a norm's γ or β, a bias) from its local column sums
/// `local_sum` `[C]` over the rows of a tensor laid out as `rows` (no partials, the channel
/// dimension `rank − 1` whole or sharded like the parameter): the same reduction as
/// [`linear_bias_backward`]'s — `Partial(Sum)` where the rows are sharded, reduced into the data
/// plan where they are per-rank.
pub(crate) fn column_grad<B: Backend>(
    local_sum: B::FloatTensorPrimitive,
    rows: &Layout,
    rank: usize,
    device: DistDevice<B>,
) -> DTensor<B> {
    let mesh = device.mesh().clone();
    let (_, _, out, summands) = weight_grad_layouts(&mesh, rows, rows, |_, pg| match pg {
        Shard(i) if i == rank - 1 => (pg, pg, Shard(0)),
        Shard(_) => (pg, pg, Partial(ReduceOp::Sum)),
        Partial(_) if pg.is_linear_partial() => (pg, pg, pg),
        _ => (Replicate, Replicate, Replicate),
    });
    reduce_data_parallel(local_sum, out, &summands, device)
}
