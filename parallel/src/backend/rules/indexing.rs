//! Indexing (PyTorch DTensor's `_tensor_ops`): select, gather and scatter-add, with the
//! loss-parallel paths for a dimension split over one model axis.

use super::{dims, is_data, local_range, to_layout, wrap};
use crate::backend::prelude::*;
use crate::comm::ReduceOp;
use crate::device::DistDevice;
use crate::mesh::DeviceMesh;
use crate::placement::{Layout, Placement};
use crate::tensor::DTensor;
use Placement::{Local, Partial, Replicate, Shard};
use burn_backend::TensorMetadata;

pub(crate) fn float_select<B: Backend>(
    tensor: DTensor<B>,
    dim: usize,
    indices: B::IntTensorPrimitive,
) -> DTensor<B> {
    let mut target = tensor.layout.clone();
    for a in 0..target.len() {
        if target.get(a) == Shard(dim) {
            target.set(a, Replicate);
        }
    }
    let t = to_layout("float_select", tensor, &target);
    wrap(
        B::float_select(t.local, dim, indices),
        t.meta.layout.clone(),
        t.meta.device.clone(),
    )
}

/// Indices into a dimension split over a model axis: shifted to this rank's range `[lo, lo+len)`,
/// clamped to 0 where they fall outside, and the mask of those outside.
pub(super) fn localize_indices<B: Backend>(
    indices: B::IntTensorPrimitive,
    lo: usize,
    len: usize,
    device: &DistDevice<B>,
) -> (B::IntTensorPrimitive, B::BoolTensorPrimitive) {
    let bool_dtype = burn_backend::get_device_settings::<B>(&device.inner).bool_dtype;
    let shifted = B::int_sub_scalar(indices, Scalar::from(lo as i64));
    let below = B::int_lower_elem(shifted.clone(), Scalar::from(0i64), bool_dtype);
    let above = B::int_greater_equal_elem(shifted.clone(), Scalar::from(len as i64), bool_dtype);
    let outside = B::bool_or(below, above);
    (
        B::int_mask_fill(shifted, outside.clone(), Scalar::from(0i64)),
        outside,
    )
}

/// `scatter_add(dim)`, the backward of `gather`. Loss-parallel: when the target is whole, or
/// already split over `dim` on that axis, and its `dim` divides over the one model axis larger
/// than 1 (the vocabulary of log-probabilities under tensor parallelism), each rank adds only the
/// values whose indices fall in its range into its slice, and the result stays split — the
/// `[N, vocab]` gradient is never held whole. (A whole target, zeros from autodiff, is still
/// created whole for a moment: Burn creates it before the scatter.) Otherwise the counted
/// fallback.
pub(crate) fn float_scatter_add<B: Backend>(
    dim: usize,
    tensor: DTensor<B>,
    indices: B::IntTensorPrimitive,
    value: DTensor<B>,
) -> DTensor<B> {
    let mesh = tensor.device.mesh().clone();
    let global = dims(&tensor);
    // The pipeline axis holds different stages, not pieces of one tensor: never split over it.
    let model_axes: Vec<usize> = (0..mesh.axes().len())
        .filter(|&a| !is_data(&mesh, a) && !mesh.axis(a).is_pipeline() && mesh.axis_size(a) > 1)
        .collect();
    let whole = |l: &Layout| !l.placements().iter().any(|p| matches!(p, Shard(_)));
    // The target may already be split over `dim` on that axis (a gradient being built up in
    // place): each rank then scatters into the slice it holds.
    let whole_or_split_on = |l: &Layout, a: usize| {
        (0..l.len()).all(|b| !matches!(l.get(b), Shard(_)) || (b == a && l.get(b) == Shard(dim)))
    };
    let split = match model_axes[..] {
        [a] if whole_or_split_on(&tensor.layout, a)
            && whole(&value.layout)
            && global[dim].is_multiple_of(mesh.axis_size(a)) =>
        {
            Some(a)
        }
        _ => None,
    };
    let Some(a) = split else {
        let fb = Fallback::<B>::new("float_scatter_add");
        let tensor = fb.float(tensor);
        let value = fb.float(value);
        return fb.wrap(B::float_scatter_add(dim, tensor, indices, value));
    };
    // Values: reduce partial sums; per-rank (`Local`) data stays per rank, and so does the sum.
    let whole_value = value.layout.unsharded();
    let value = to_layout("float_scatter_add", value, &whole_value);
    let mut out = tensor.layout.unsharded();
    for b in 0..out.len() {
        if value.layout.get(b) == Local {
            out.set(b, Local);
        }
    }
    let t = to_layout(
        "float_scatter_add",
        tensor,
        &out.clone().with(a, Shard(dim)),
    );
    let len = t.local.shape()[dim];
    let lo = mesh.group_index(t.device.rank(), a) * len;
    let (local_indices, outside) = localize_indices::<B>(indices, lo, len, &t.device);
    let values = B::float_mask_fill(value.local, outside, Scalar::from(0.0f64));
    let local = B::float_scatter_add(dim, t.local, local_indices, values);
    wrap(local, t.meta.layout.clone(), t.meta.device.clone())
}

/// The one model axis that splits `dim` of `layout`, if exactly one does (and no data axis).
pub(super) fn single_model_split(layout: &Layout, dim: usize, mesh: &DeviceMesh) -> Option<usize> {
    let axes: Vec<usize> = (0..layout.len())
        .filter(|&a| layout.get(a) == Shard(dim))
        .collect();
    match axes[..] {
        [a] if !is_data(mesh, a) => Some(a),
        _ => None,
    }
}

/// `gather(dim)`: `dim` must be whole; other sharded dims keep their shards, and the per-rank
/// (full) index tensor is sliced to match. Gathering is linear, so partial values pass.
pub(crate) fn float_gather<B: Backend>(
    dim: usize,
    tensor: DTensor<B>,
    indices: B::IntTensorPrimitive,
) -> DTensor<B> {
    let global = dims(&tensor);
    let index_dims = indices.shape().to_vec();
    // Loss-parallel: gathering along a dim split over one model axis (log-probabilities sharded on
    // the vocabulary) looks up this rank's range and yields a partial sum, zero elsewhere.
    // (Only when no other dim is split: the index tensor is not sliced on this path.)
    let others_split = tensor
        .layout
        .placements()
        .iter()
        .any(|p| matches!(p, Shard(d) if *d != dim));
    let vocab_axis =
        single_model_split(&tensor.layout, dim, tensor.device.mesh()).filter(|_| !others_split);
    let mut target = tensor.layout.clone();
    for a in 0..target.len() {
        if let Shard(d) = target.get(a)
            && ((d == dim && Some(a) != vocab_axis) || (d != dim && index_dims[d] != global[d]))
        {
            target.set(a, Replicate);
        }
    }
    let t = to_layout("float_gather", tensor, &target);
    if let Some(a) = vocab_axis {
        let len = t.local.shape()[dim];
        let lo = t.device.mesh().group_index(t.device.rank(), a) * len;
        let (local_indices, outside) = localize_indices::<B>(indices, lo, len, &t.device);
        let picked = B::float_gather(dim, t.local, local_indices);
        let picked = B::float_mask_fill(picked, outside, Scalar::from(0.0f64));
        let out = t.meta.layout.clone().with(a, Partial(ReduceOp::Sum));
        return wrap(picked, out, t.meta.device.clone());
    }
    let mut slices: Vec<Slice> = index_dims
        .iter()
        .map(|&s| Slice::new(0, Some(s as isize), 1))
        .collect();
    let mut sliced = false;
    for (d, slice) in slices.iter_mut().enumerate() {
        if target.shards_of(d, t.device.mesh()) > 1 {
            *slice = local_range(&target, d, global[d], &t.device);
            sliced = true;
        }
    }
    let indices = if sliced {
        B::int_slice(indices, &slices)
    } else {
        indices
    };
    wrap(
        B::float_gather(dim, t.local, indices),
        t.meta.layout.clone(),
        t.meta.device.clone(),
    )
}
