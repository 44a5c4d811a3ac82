//! Propagation rules: from the input layouts, pick the output layout and the redistributions the
//! inputs need, then run the op on the local pieces (PyTorch DTensor's sharding propagation).
//!
//! Conventions used throughout (one decision per mesh axis):
//! - `Local` (data axes) absorbs `Replicate`; a sharded or partial operand meeting `Local` data is
//!   gathered or reduced first (that gather is FSDP's parameter all-gather).
//! - `Replicate -> Shard` is a local slice and costs nothing.
//! - `Partial(Sum | Avg)` passes through linear ops only; everything else reduces it first.
//! - Data-parallel weight gradients are reduced where they are born (`linear_weight_backward`,
//!   `linear_bias_backward`, `embedding_backward`): each rank's gradient is a summand of the global
//!   gradient, averaged over the data axes (each rank's loss is a mean over its slice of the batch).

use super::prelude::*;
use crate::comm::ReduceOp;
use crate::device::{DistDevice, current_device};
use crate::error::{DistError, raise};
use crate::mesh::{AxisKind, DeviceMesh};
use crate::placement::{Layout, Placement};
use crate::tensor::DTensor;
use burn_backend::TensorMetadata;
use burn_backend::ops::{
    DeformConv2dBackward, MaxPool1dBackward, MaxPool1dWithIndices, MaxPool2dBackward,
    MaxPool2dWithIndices, TransactionPrimitiveData,
};

use Placement::{Local, Partial, Replicate, Shard};

/// Whether a unary op commutes with sums (so `Partial(Sum | Avg)` may pass).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Linearity {
    /// `f(a + b) = f(a) + f(b)`.
    Linear,
    /// Anything else.
    NonLinear,
}

/// How a binary elementwise op treats `Partial` operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BinaryKind {
    /// `Partial ± Partial` stays partial.
    Add,
    /// `Partial * Replicate` (either side) stays partial.
    Mul,
    /// `Partial / Replicate` stays partial.
    Div,
    /// Every partial operand is reduced first.
    NonLinear,
}

/// Redistribute as a rule asks, counting the call when it communicates.
pub(crate) fn to_layout<B: Backend>(
    op: &'static str,
    t: DTensor<B>,
    target: &Layout,
) -> DTensor<B> {
    if &t.layout == target {
        return t;
    }
    let communicates = t
        .layout
        .placements()
        .iter()
        .zip(target.placements())
        .any(|(from, to)| from.is_distributed() && from != to);
    if communicates {
        t.device.ctx.count_redistribution(op);
    }
    t.redistribute(target).unwrap_or_else(|e| raise(e))
}

/// The layout with every `Partial` that `keep` rejects turned into `Replicate`.
pub(crate) fn without_partials(layout: &Layout, keep: impl Fn(Placement) -> bool) -> Layout {
    let mut out = layout.clone();
    for (a, p) in layout.placements().iter().enumerate() {
        if matches!(p, Partial(_)) && !keep(*p) {
            out.set(a, Replicate);
        }
    }
    out
}

pub(crate) fn wrap<B: Backend>(
    local: B::FloatTensorPrimitive,
    layout: Layout,
    device: DistDevice<B>,
) -> DTensor<B> {
    DTensor::new_unchecked(local, layout, device)
}

fn dims<B: Backend>(t: &DTensor<B>) -> Vec<usize> {
    t.shape.to_vec().clone()
}

fn is_data(mesh: &DeviceMesh, axis: usize) -> bool {
    mesh.axis(axis).kind == AxisKind::Data
}

/// A parameter operand must have a placement on every data axis with more than one member.
pub(crate) fn check_param<B: Backend>(op: &'static str, w: &DTensor<B>) {
    let mesh = w.device.mesh();
    for (a, p) in w.layout.placements().iter().enumerate() {
        if *p == Local && mesh.axis_size(a) > 1 {
            raise(DistError::UnplacedParameter {
                op,
                shape: dims(w),
                axis: mesh.axis(a).name.clone(),
                size: mesh.axis_size(a),
            });
        }
    }
}

/// A forward op that uses parameters: the previous backward's gradients must have been synced.
fn check_synced<B: Backend>(op: &'static str, device: &DistDevice<B>) {
    if device.ctx.gradients_pending() && !crate::device::is_recomputing() {
        raise(DistError::GradientsNotSynced { op });
    }
}

// ---------------------------------------------------------------------------------------------
// Elementwise

pub(crate) fn unary<B: Backend>(
    op: &'static str,
    t: DTensor<B>,
    linearity: Linearity,
    f: impl FnOnce(B::FloatTensorPrimitive) -> B::FloatTensorPrimitive,
) -> DTensor<B> {
    let t = t.settled();
    let target = without_partials(&t.layout, |p| {
        linearity == Linearity::Linear && p.is_linear_partial()
    });
    let t = to_layout(op, t, &target);
    // Elementwise: the shape is the input's (a padded shard's cannot be read off its piece).
    DTensor::new_shaped(f(t.local), t.layout, t.shape, t.device)
}

/// Decide one mesh axis of a broadcasting elementwise op: (lhs target, rhs target, output).
fn decide_elementwise(
    mut pl: Placement,
    mut pr: Placement,
    kind: BinaryKind,
    gl: &[usize],
    gr: &[usize],
    sequence: Option<usize>,
) -> (Placement, Placement, Placement) {
    // Partial operands first.
    match (pl, pr) {
        (Partial(p), Partial(q)) if kind == BinaryKind::Add && p == q && pl.is_linear_partial() => {
            return (pl, pr, pl);
        }
        (Partial(_), Replicate)
            if matches!(kind, BinaryKind::Mul | BinaryKind::Div) && pl.is_linear_partial() =>
        {
            return (pl, pr, pl);
        }
        (Replicate, Partial(_)) if kind == BinaryKind::Mul && pr.is_linear_partial() => {
            return (pl, pr, pr);
        }
        _ => {}
    }
    // Sequence parallelism: a partial sum meeting a residual add is reduce-scattered over the
    // sequence instead of all-reduced.
    let reduced = match sequence {
        Some(d) if kind == BinaryKind::Add => Shard(d),
        _ => Replicate,
    };
    if matches!(pl, Partial(_)) {
        pl = reduced;
    }
    if matches!(pr, Partial(_)) {
        pr = reduced;
    }
    let shard_for = |d: usize, g: &[usize]| if g[d] == 1 { Replicate } else { Shard(d) };
    match (pl, pr) {
        (Local, Local) | (Local, Replicate) | (Replicate, Local) => (pl, pr, Local),
        (Local, _) => (Local, Replicate, Local),
        (_, Local) => (Replicate, Local, Local),
        (Replicate, Replicate) => (Replicate, Replicate, Replicate),
        (Shard(d), Shard(e)) if d == e => (pl, pr, pl),
        (Shard(d), _) => (pl, shard_for(d, gr), pl),
        (_, Shard(d)) => (shard_for(d, gl), pr, pr),
        (Partial(_), _) | (_, Partial(_)) => unreachable!("partials were reduced above"),
    }
}

/// A partial sum about to be broadcast to `elements` values is reduced first, while it is small
/// (the row sums of a softmax over a split vocabulary: `N` values, not `N × vocab`).
fn reduced_before_broadcast<B: Backend>(
    op: &'static str,
    t: DTensor<B>,
    elements: usize,
) -> DTensor<B> {
    if elements > t.shape.num_elements() && t.layout.has_partial() {
        let target = without_partials(&t.layout, |_| false);
        to_layout(op, t.settled(), &target)
    } else {
        t
    }
}

/// Sequence parallelism: `(axis, 1)` when it is on and both operands are `[b, t, d]` activations
/// (broadcasting on the other dims: a `[1, t, d]` position embedding) whose sequence divides by
/// the axis size.
fn sequence_dim<B: Backend>(
    device: &DistDevice<B>,
    gl: &[usize],
    gr: &[usize],
) -> Option<(usize, usize)> {
    let axis = device.ctx.sequence_parallel()?;
    (gl.len() == 3
        && gl.len() == gr.len()
        && gl[1] == gr[1]
        && gl[1].is_multiple_of(device.mesh().axis_size(axis)))
    .then_some((axis, 1))
}

/// Align the two operands of an elementwise op; returns them and the output layout.
fn align2<B: Backend>(
    op: &'static str,
    lhs: DTensor<B>,
    rhs: DTensor<B>,
    kind: BinaryKind,
) -> (DTensor<B>, DTensor<B>, Layout) {
    let (lhs, rhs) = (lhs.settled(), rhs.settled());
    let (gl, gr) = (dims(&lhs), dims(&rhs));
    let numel = |g: &[usize]| g.iter().product::<usize>();
    let lhs = reduced_before_broadcast(op, lhs, numel(&gr));
    let rhs = reduced_before_broadcast(op, rhs, numel(&gl));
    let mut tl = lhs.layout.clone();
    let mut tr = rhs.layout.clone();
    let mut out = lhs.layout.clone();
    let sp = sequence_dim(&lhs.device, &gl, &gr);
    for a in 0..tl.len() {
        let sequence = sp.filter(|&(axis, _)| axis == a).map(|(_, d)| d);
        let (l, r, o) = decide_elementwise(
            lhs.layout.get(a),
            rhs.layout.get(a),
            kind,
            &gl,
            &gr,
            sequence,
        );
        tl.set(a, l);
        tr.set(a, r);
        out.set(a, o);
    }
    (to_layout(op, lhs, &tl), to_layout(op, rhs, &tr), out)
}

pub(crate) fn binary<B: Backend>(
    op: &'static str,
    lhs: DTensor<B>,
    rhs: DTensor<B>,
    kind: BinaryKind,
    f: impl FnOnce(B::FloatTensorPrimitive, B::FloatTensorPrimitive) -> B::FloatTensorPrimitive,
) -> DTensor<B> {
    let (lhs, rhs, out) = align2(op, lhs, rhs, kind);
    // Broadcasting: the output's shape from the operands' (padded shards cannot tell it).
    let shape: Vec<usize> = dims(&lhs)
        .iter()
        .zip(dims(&rhs))
        .map(|(&l, r)| if l == 1 { r } else { l })
        .collect();
    DTensor::new_shaped(f(lhs.local, rhs.local), out, Shape::from(shape), lhs.device)
}

/// An op that works along `dim` (softmax, cumsum, sort): that dim must be whole and no operand
/// partial; every other placement passes.
pub(crate) fn dim_local<B: Backend>(
    op: &'static str,
    t: DTensor<B>,
    dim: usize,
    f: impl FnOnce(B::FloatTensorPrimitive) -> B::FloatTensorPrimitive,
) -> DTensor<B> {
    let target = whole_dim(&t.layout, dim);
    let t = to_layout(op, t, &target);
    DTensor::new_shaped(f(t.local), t.layout, t.shape, t.device)
}

/// The value with its padded splits gathered (see [`DTensor`]): every rule but the elementwise
/// ones, which keep padded shards, takes its float inputs through this.
pub(crate) fn unpadded<B: Backend>(t: DTensor<B>) -> DTensor<B> {
    t.unpadded()
}

/// `layout` with `dim` unsharded and no partials.
pub(crate) fn whole_dim(layout: &Layout, dim: usize) -> Layout {
    let mut target = without_partials(layout, |_| false);
    for a in 0..target.len() {
        if target.get(a) == Shard(dim) {
            target.set(a, Replicate);
        }
    }
    target
}

/// The range of global indices along `dim` this rank holds under `layout` (nested shards in axis
/// order), as a slice.
fn local_range<B: Backend>(
    layout: &Layout,
    dim: usize,
    global: usize,
    device: &DistDevice<B>,
) -> Slice {
    let mesh = device.mesh();
    let (mut index, mut parts) = (0, 1);
    for a in 0..layout.len() {
        if layout.get(a) == Shard(dim) {
            index = index * mesh.axis_size(a) + mesh.group_index(device.rank(), a);
            parts *= mesh.axis_size(a);
        }
    }
    let len = global / parts;
    Slice::new(
        (index * len) as isize,
        Some(((index + 1) * len) as isize),
        1,
    )
}

/// Slice a per-rank (full) bool mask to the local piece of a tensor laid out as `layout`.
fn slice_mask<B: Backend>(
    mask: B::BoolTensorPrimitive,
    layout: &Layout,
    global: &[usize],
    device: &DistDevice<B>,
) -> B::BoolTensorPrimitive {
    let mask_dims = mask.shape().to_vec();
    let offset = global.len() - mask_dims.len();
    let mut slices: Vec<Slice> = mask_dims
        .iter()
        .map(|&s| Slice::new(0, Some(s as isize), 1))
        .collect();
    let mut any = false;
    for d in offset..global.len() {
        if layout.shards_of(d, device.mesh()) > 1 && mask_dims[d - offset] == global[d] {
            slices[d - offset] = local_range(layout, d, global[d], device);
            any = true;
        }
    }
    if any {
        B::bool_slice(mask, &slices)
    } else {
        mask
    }
}

pub(crate) fn float_mask_fill<B: Backend>(
    tensor: DTensor<B>,
    mask: B::BoolTensorPrimitive,
    value: Scalar,
) -> DTensor<B> {
    let target = without_partials(&tensor.layout, |_| false);
    let t = to_layout("float_mask_fill", tensor, &target);
    let mask = slice_mask(mask, &t.layout, &t.shape.to_vec(), &t.device);
    wrap(B::float_mask_fill(t.local, mask, value), t.layout, t.device)
}

pub(crate) fn float_mask_where<B: Backend>(
    tensor: DTensor<B>,
    mask: B::BoolTensorPrimitive,
    value: DTensor<B>,
) -> DTensor<B> {
    let (t, v, out) = align2("float_mask_where", tensor, value, BinaryKind::NonLinear);
    let global = out.global_shape(&t.local.shape().to_vec(), t.device.mesh());
    let mask = slice_mask(mask, &out, &global, &t.device);
    wrap(B::float_mask_where(t.local, mask, v.local), out, t.device)
}

// ---------------------------------------------------------------------------------------------
// Reductions

/// Reduce over `dims` (`None`: all) with `kind`; sharded reduced dims become `Partial(kind)`.
fn reduction<B: Backend>(
    op: &'static str,
    t: DTensor<B>,
    dim: Option<usize>,
    kind: ReduceOp,
    f: impl FnOnce(B::FloatTensorPrimitive) -> B::FloatTensorPrimitive,
) -> DTensor<B> {
    let target = without_partials(&t.layout, |p| match kind {
        ReduceOp::Sum | ReduceOp::Avg => p.is_linear_partial(),
        ReduceOp::Max => p == Partial(ReduceOp::Max),
    });
    let t = to_layout(op, t, &target);
    let mut out = t.layout.clone();
    for a in 0..out.len() {
        if let Shard(d) = out.get(a) {
            match dim {
                None => out.set(a, Partial(kind)),
                Some(dim) if dim == d => out.set(a, Partial(kind)),
                Some(_) => {}
            }
        }
    }
    if dim.is_none() {
        // The output is a one-element tensor; nothing stays sharded.
        for a in 0..out.len() {
            if matches!(out.get(a), Shard(_)) {
                out.set(a, Replicate);
            }
        }
    }
    wrap(f(t.local), out, t.device)
}

pub(crate) fn float_sum<B: Backend>(tensor: DTensor<B>) -> DTensor<B> {
    reduction("float_sum", tensor, None, ReduceOp::Sum, B::float_sum)
}

pub(crate) fn float_sum_dim<B: Backend>(tensor: DTensor<B>, dim: usize) -> DTensor<B> {
    reduction("float_sum_dim", tensor, Some(dim), ReduceOp::Sum, |t| {
        B::float_sum_dim(t, dim)
    })
}

pub(crate) fn float_mean<B: Backend>(tensor: DTensor<B>) -> DTensor<B> {
    reduction("float_mean", tensor, None, ReduceOp::Avg, B::float_mean)
}

pub(crate) fn float_mean_dim<B: Backend>(tensor: DTensor<B>, dim: usize) -> DTensor<B> {
    reduction("float_mean_dim", tensor, Some(dim), ReduceOp::Avg, |t| {
        B::float_mean_dim(t, dim)
    })
}

pub(crate) fn float_max<B: Backend>(tensor: DTensor<B>) -> DTensor<B> {
    reduction("float_max", tensor, None, ReduceOp::Max, B::float_max)
}

pub(crate) fn float_max_dim<B: Backend>(tensor: DTensor<B>, dim: usize) -> DTensor<B> {
    reduction("float_max_dim", tensor, Some(dim), ReduceOp::Max, |t| {
        B::float_max_dim(t, dim)
    })
}

pub(crate) fn float_min<B: Backend>(tensor: DTensor<B>) -> DTensor<B> {
    let target = tensor.layout.unsharded();
    let t = to_layout("float_min", tensor, &target);
    wrap(B::float_min(t.local), t.layout, t.device)
}

pub(crate) fn float_min_dim<B: Backend>(tensor: DTensor<B>, dim: usize) -> DTensor<B> {
    dim_local("float_min_dim", tensor, dim, |t| B::float_min_dim(t, dim))
}

// ---------------------------------------------------------------------------------------------
// Shapes

pub(crate) fn float_reshape<B: Backend>(tensor: DTensor<B>, shape: Shape) -> DTensor<B> {
    let input = dims(&tensor);
    let mesh = tensor.device.mesh().clone();
    let mut target = tensor.layout.clone();
    let mut out = tensor.layout.clone();
    for a in 0..target.len() {
        if let Shard(d) = target.get(a) {
            let parts = tensor.layout.shards_of(d, &mesh);
            let prefix: usize = input[..d].iter().product();
            // An output dim with the same prefix whose size splits evenly keeps each rank's
            // contiguous block.
            let mapped = (0..shape.num_dims()).find(|&e| {
                shape[..e].iter().product::<usize>() == prefix
                    && shape[e].is_multiple_of(parts)
                    && shape[e] > 1
            });
            match mapped {
                Some(e) => out.set(a, Shard(e)),
                None => {
                    target.set(a, Replicate);
                    out.set(a, Replicate);
                }
            }
        }
    }
    let t = to_layout("float_reshape", tensor, &target);
    let mut local = shape.to_vec().clone();
    for (e, size) in local.iter_mut().enumerate() {
        *size /= out.shards_of(e, &mesh);
    }
    wrap(B::float_reshape(t.local, Shape::from(local)), out, t.device)
}

fn map_shards(layout: &Layout, f: impl Fn(usize) -> usize) -> Layout {
    let mut out = layout.clone();
    for a in 0..out.len() {
        if let Shard(d) = out.get(a) {
            out.set(a, Shard(f(d)));
        }
    }
    out
}

pub(crate) fn float_swap_dims<B: Backend>(
    tensor: DTensor<B>,
    dim1: usize,
    dim2: usize,
) -> DTensor<B> {
    let out = map_shards(&tensor.layout, |d| {
        if d == dim1 {
            dim2
        } else if d == dim2 {
            dim1
        } else {
            d
        }
    });
    wrap(
        B::float_swap_dims(tensor.local, dim1, dim2),
        out,
        tensor.device,
    )
}

pub(crate) fn float_permute<B: Backend>(tensor: DTensor<B>, axes: &[usize]) -> DTensor<B> {
    let out = map_shards(&tensor.layout, |d| {
        axes.iter().position(|&x| x == d).unwrap()
    });
    wrap(B::float_permute(tensor.local, axes), out, tensor.device)
}

fn is_full(slice: &Slice, size: usize) -> bool {
    slice.start == 0 && slice.step == 1 && slice.end.is_none_or(|e| e == size as isize)
}

pub(crate) fn float_slice<B: Backend>(tensor: DTensor<B>, slices: &[Slice]) -> DTensor<B> {
    let global = dims(&tensor);
    let mut target = tensor.layout.clone();
    for a in 0..target.len() {
        if let Shard(d) = target.get(a)
            && d < slices.len()
            && !is_full(&slices[d], global[d])
        {
            target.set(a, Replicate);
        }
    }
    let t = to_layout("float_slice", tensor, &target);
    let mut local: Vec<Slice> = slices.to_vec();
    for (d, s) in local.iter_mut().enumerate() {
        if target.shards_of(d, t.device.mesh()) > 1 {
            *s = Slice::full();
        }
    }
    wrap(B::float_slice(t.local, &local), t.layout, t.device)
}

/// `slice_assign`: the assigned region must be whole on every sharded dim; both operands are
/// brought to one layout per axis (a replicated operand is sliced to the other's shard for free),
/// partial sums pass when both are partial alike.
pub(crate) fn float_slice_assign<B: Backend>(
    tensor: DTensor<B>,
    slices: &[Slice],
    value: DTensor<B>,
) -> DTensor<B> {
    const OP: &str = "float_slice_assign";
    let global = dims(&tensor);
    let whole = |d: usize| d >= slices.len() || is_full(&slices[d], global[d]);
    let mut target = tensor.layout.clone();
    for a in 0..target.len() {
        let (pt, pv) = (tensor.layout.get(a), value.layout.get(a));
        let p = match (pt, pv) {
            (Local, _) | (_, Local) => Local,
            (Shard(d), Shard(e)) if d == e && whole(d) => Shard(d),
            (Replicate, Shard(d)) | (Shard(d), Replicate) if whole(d) => Shard(d),
            (Partial(p), Partial(q)) if p == q && pt.is_linear_partial() => pt,
            _ => Replicate,
        };
        target.set(a, p);
    }
    let own = |t: &DTensor<B>| {
        let mut l = target.clone();
        for a in 0..l.len() {
            if l.get(a) == Local && t.layout.get(a) != Local {
                l.set(a, Replicate);
            }
        }
        l
    };
    let (lt, lv) = (own(&tensor), own(&value));
    let tensor = to_layout(OP, tensor, &lt);
    let value = to_layout(OP, value, &lv);
    let mut local: Vec<Slice> = slices.to_vec();
    for (d, s) in local.iter_mut().enumerate() {
        if target.shards_of(d, tensor.device.mesh()) > 1 {
            *s = Slice::full();
        }
    }
    wrap(
        B::float_slice_assign(tensor.local, &local, value.local),
        target,
        tensor.device,
    )
}

pub(crate) fn float_cat<B: Backend>(tensors: Vec<DTensor<B>>, dim: usize) -> DTensor<B> {
    let first = tensors[0].layout.clone();
    let mut target = first.clone();
    for a in 0..target.len() {
        let same = tensors.iter().all(|t| t.layout.get(a) == first.get(a));
        if !same || first.get(a) == Shard(dim) {
            let any_local = tensors.iter().any(|t| t.layout.get(a) == Local);
            target.set(a, if any_local { Local } else { Replicate });
        }
    }
    let device = tensors[0].device.clone();
    let locals: Vec<_> = tensors
        .into_iter()
        .map(|t| {
            // `Local` data absorbs replicated and gathered operands.
            let mut own = target.clone();
            for a in 0..own.len() {
                if own.get(a) == Local && t.layout.get(a) != Local {
                    own.set(a, Replicate);
                }
            }
            let t = to_layout("float_cat", t, &own);
            t.local
        })
        .collect();
    wrap(B::float_cat(locals, dim), target, device)
}

pub(crate) fn float_expand<B: Backend>(tensor: DTensor<B>, shape: Shape) -> DTensor<B> {
    let tensor = reduced_before_broadcast("float_expand", tensor, shape.num_elements());
    let offset = shape.num_dims() - tensor.shape.num_dims();
    let out = map_shards(&tensor.layout, |d| d + offset);
    let mut local = shape.to_vec().clone();
    for (e, size) in local.iter_mut().enumerate() {
        *size /= out.shards_of(e, tensor.device.mesh());
    }
    wrap(
        B::float_expand(tensor.local, Shape::from(local)),
        out,
        tensor.device,
    )
}

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
    wrap(B::float_select(t.local, dim, indices), t.layout, t.device)
}

/// Indices into a dimension split over a model axis: shifted to this rank's range `[lo, lo+len)`,
/// clamped to 0 where they fall outside, and the mask of those outside.
fn localize_indices<B: Backend>(
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
    let model_axes: Vec<usize> = (0..mesh.axes().len())
        .filter(|&a| !is_data(&mesh, a) && mesh.axis_size(a) > 1)
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
        let fb = super::fallback::Fallback::<B>::new("float_scatter_add");
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
    wrap(local, t.layout, t.device)
}

/// The model axis of a vocabulary-parallel embedding table (`Shard(0)` on exactly one model
/// axis, nothing else split).
fn vocab_parallel_axis(layout: &Layout, mesh: &DeviceMesh) -> Option<usize> {
    let others = layout
        .placements()
        .iter()
        .any(|p| matches!(p, Shard(d) if *d != 0));
    single_model_split(layout, 0, mesh).filter(|_| !others)
}

/// A `[.., 1]`-shaped row mask broadcast to `shape` (one flag per looked-up row).
fn rows_mask<B: Backend>(mask: B::BoolTensorPrimitive, shape: &[usize]) -> B::BoolTensorPrimitive {
    let mut with_one = mask.shape().to_vec();
    with_one.push(1);
    let mask = B::bool_reshape(mask, Shape::from(with_one));
    B::bool_expand(mask, Shape::from(shape.to_vec()))
}

/// The one model axis that splits `dim` of `layout`, if exactly one does (and no data axis).
fn single_model_split(layout: &Layout, dim: usize, mesh: &DeviceMesh) -> Option<usize> {
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
        let out = t.layout.clone().with(a, Partial(ReduceOp::Sum));
        return wrap(picked, out, t.device);
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
    wrap(B::float_gather(dim, t.local, indices), t.layout, t.device)
}

// ---------------------------------------------------------------------------------------------
// Matmul and linear layers

/// The precision policy: run `f` on the local operands cast to the rank's compute dtype (if one
/// is set and differs), and cast the result back to the operands' dtype — f32 master weights and
/// activations, bf16/f16 matmuls.
fn in_compute_dtype<B: Backend, const N: usize>(
    device: &DistDevice<B>,
    inputs: [B::FloatTensorPrimitive; N],
    f: impl FnOnce([B::FloatTensorPrimitive; N]) -> B::FloatTensorPrimitive,
) -> B::FloatTensorPrimitive {
    let Some(compute) = device.ctx.compute_dtype() else {
        return f(inputs);
    };
    let original: FloatDType = inputs[0].dtype().into();
    if original == compute {
        return f(inputs);
    }
    let cast = inputs.map(|t| B::float_cast(t, compute));
    B::float_cast(f(cast), original)
}

/// `lhs [.., m, k] @ rhs [.., k, n]`, one mesh axis: (lhs target, rhs target, output).
fn decide_matmul(
    pl: Placement,
    pr: Placement,
    rank: usize,
    gl: &[usize],
    gr: &[usize],
) -> (Placement, Placement, Placement) {
    let (m, k_l, k_r, n) = (rank - 2, rank - 1, rank - 2, rank - 1);
    if pl == Local || pr == Local {
        let whole = |p: Placement| if p == Local { Local } else { Replicate };
        return (whole(pl), whole(pr), Local);
    }
    let batch_for = |b: usize, g: &[usize]| if g[b] == 1 { Replicate } else { Shard(b) };
    match (pl, pr) {
        (Replicate, Replicate) => (pl, pr, Replicate),
        (Shard(b), Replicate) if b < m => (pl, batch_for(b, gr), Shard(b)),
        (Replicate, Shard(b)) if b < k_r => (batch_for(b, gl), pr, Shard(b)),
        (Shard(b), Shard(c)) if b == c && b < m => (pl, pr, Shard(b)),
        (Shard(d), Replicate) if d == m => (pl, pr, Shard(m)),
        (Replicate, Shard(d)) if d == n => (pl, pr, Shard(n)),
        (Shard(d), Shard(e)) if d == k_l && e == k_r => (pl, pr, Partial(ReduceOp::Sum)),
        (Shard(d), Replicate) if d == k_l => (pl, Shard(k_r), Partial(ReduceOp::Sum)),
        (Replicate, Shard(e)) if e == k_r => (Shard(k_l), pr, Partial(ReduceOp::Sum)),
        (Partial(_), Replicate) if pl.is_linear_partial() => (pl, pr, pl),
        (Replicate, Partial(_)) if pr.is_linear_partial() => (pl, pr, pr),
        _ => {
            let reduce = |p: Placement| {
                if matches!(p, Partial(_)) {
                    Replicate
                } else {
                    p
                }
            };
            if matches!(pl, Partial(_)) || matches!(pr, Partial(_)) {
                decide_matmul(reduce(pl), reduce(pr), rank, gl, gr)
            } else {
                (Replicate, Replicate, Replicate)
            }
        }
    }
}

pub(crate) fn float_matmul<B: Backend>(lhs: DTensor<B>, rhs: DTensor<B>) -> DTensor<B> {
    let (lhs, rhs) = (lhs.settled(), rhs.settled());
    let (gl, gr) = (dims(&lhs), dims(&rhs));
    let rank = gl.len();
    let mut tl = lhs.layout.clone();
    let mut tr = rhs.layout.clone();
    let mut out = lhs.layout.clone();
    for a in 0..tl.len() {
        let (l, r, o) = decide_matmul(lhs.layout.get(a), rhs.layout.get(a), rank, &gl, &gr);
        tl.set(a, l);
        tr.set(a, r);
        out.set(a, o);
    }
    let lhs = to_layout("float_matmul", lhs, &tl);
    let rhs = to_layout("float_matmul", rhs, &tr);
    let local = in_compute_dtype(&lhs.device, [lhs.local, rhs.local], |[l, r]| {
        B::float_matmul(l, r)
    });
    wrap(local, out, lhs.device)
}

/// `x [.., k] @ w [k, n]` (Burn's `linear` layout), one mesh axis.
fn decide_linear(px: Placement, pw: Placement, rank: usize) -> (Placement, Placement, Placement) {
    let last = rank - 1;
    if px == Local || pw == Local {
        let whole = |p: Placement| if p == Local { Local } else { Replicate };
        return (whole(px), whole(pw), Local);
    }
    match (px, pw) {
        (Replicate, Replicate) => (px, pw, Replicate),
        (Shard(i), Replicate) if i < last => (px, pw, Shard(i)),
        (Replicate, Shard(1)) => (px, pw, Shard(last)),
        // Sequence-parallel input to a column-parallel layer: all-gather the input only.
        (Shard(i), Shard(1)) if i < last => (Replicate, pw, Shard(last)),
        (Shard(i), Shard(0)) if i == last => (px, pw, Partial(ReduceOp::Sum)),
        (Shard(i), Replicate) if i == last => (px, Shard(0), Partial(ReduceOp::Sum)),
        (Replicate, Shard(0)) => (Shard(last), pw, Partial(ReduceOp::Sum)),
        (Partial(_), Replicate) if px.is_linear_partial() => (px, pw, px),
        _ => {
            if matches!(px, Partial(_)) || matches!(pw, Partial(_)) {
                let reduce = |p: Placement| {
                    if matches!(p, Partial(_)) {
                        Replicate
                    } else {
                        p
                    }
                };
                decide_linear(reduce(px), reduce(pw), rank)
            } else {
                (Replicate, Replicate, Replicate)
            }
        }
    }
}

pub(crate) fn linear<B: Backend>(
    x: DTensor<B>,
    weight: DTensor<B>,
    bias: Option<DTensor<B>>,
) -> DTensor<B> {
    const OP: &str = "linear";
    check_param(OP, &weight);
    if let Some(b) = &bias {
        check_param(OP, b);
    }
    check_synced(OP, &x.device);
    let rank = x.shape.num_dims();
    let mesh = x.device.mesh().clone();
    let mut tx = x.layout.clone();
    let mut tw = weight.layout.clone();
    let mut out = x.layout.clone();
    for a in 0..tx.len() {
        let (px, pw, o) = decide_linear(x.layout.get(a), weight.layout.get(a), rank);
        tx.set(a, px);
        tw.set(a, pw);
        out.set(a, o);
    }
    let x = to_layout(OP, x, &tx);
    let weight = to_layout(OP, weight, &tw);
    let Some(bias) = bias else {
        let local = in_compute_dtype(&x.device, [x.local, weight.local], |[x, w]| {
            flat_linear::<B>(x, w, None)
        });
        return wrap(local, out, x.device);
    };
    // The bias follows the output's last dim; with a partial sum only member 0 adds it.
    let mut tb = Layout::replicated(&mesh);
    let mut add_bias = true;
    for a in 0..tb.len() {
        match out.get(a) {
            Shard(d) if d == rank - 1 => tb.set(a, Shard(0)),
            Partial(ReduceOp::Sum) => add_bias &= mesh.group_index(x.device.rank(), a) == 0,
            _ => {}
        }
    }
    let bias = to_layout(OP, bias, &tb);
    let bias = add_bias.then_some(bias.local);
    let local = match bias {
        Some(b) => in_compute_dtype(&x.device, [x.local, weight.local, b], |[x, w, b]| {
            flat_linear::<B>(x, w, Some(b))
        }),
        None => in_compute_dtype(&x.device, [x.local, weight.local], |[x, w]| {
            flat_linear::<B>(x, w, None)
        }),
    };
    wrap(local, out, x.device)
}

/// `[a, b, …, k]` as `[a·b·…, k]` (a view when contiguous) and the leading dims to restore.
/// Burn's default linear on a rank-3 input runs one GEMM per batch entry, and its weight gradient
/// sums a `[batch, k, n]` temporary (206 MB for a 50k-vocabulary output layer at batch 4); on the
/// rows it is one GEMM each way, which also parallelises better. The local pieces alone are
/// reshaped, so no placement is involved.
fn rows_of<B: Backend>(t: FloatTensor<B>) -> (FloatTensor<B>, Option<Vec<usize>>) {
    let shape = t.shape();
    let d = shape.num_dims();
    if d <= 2 {
        return (t, None);
    }
    let lead = shape[..d - 1].to_vec();
    let rows = lead.iter().product();
    (
        B::float_reshape(t, Shape::new([rows, shape[d - 1]])),
        Some(lead),
    )
}

/// `[rows, n]` back to `[lead…, n]`.
fn unrows<B: Backend>(t: FloatTensor<B>, lead: Option<Vec<usize>>) -> FloatTensor<B> {
    match lead {
        None => t,
        Some(mut dims) => {
            dims.push(t.shape()[1]);
            B::float_reshape(t, Shape::from(dims))
        }
    }
}

/// `B::linear` over the input's rows.
fn flat_linear<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    b: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let (x, lead) = rows_of::<B>(x);
    unrows::<B>(B::linear(x, w, b), lead)
}

/// `grad_x = grad_out [.., n] @ w^T`, one mesh axis: (w target, grad target, output).
fn decide_linear_x_backward(
    pw: Placement,
    pg: Placement,
    rank: usize,
) -> (Placement, Placement, Placement) {
    let last = rank - 1;
    if pw == Local || pg == Local {
        let whole = |p: Placement| if p == Local { Local } else { Replicate };
        return (whole(pw), whole(pg), Local);
    }
    match (pw, pg) {
        (Replicate, Replicate) => (pw, pg, Replicate),
        // Column-parallel backward: the conjugate of the forward identity is an all-reduce.
        (Shard(1), Shard(i)) if i == last => (pw, pg, Partial(ReduceOp::Sum)),
        (Shard(1), Replicate) => (pw, Shard(last), Partial(ReduceOp::Sum)),
        (Replicate, Shard(i)) if i == last => (Shard(1), pg, Partial(ReduceOp::Sum)),
        // Row-parallel backward: the input gradient comes out sharded like the input.
        (Shard(0), Replicate) => (pw, pg, Shard(last)),
        // Sequence parallelism: the row-parallel layer's output gradient arrives sharded over the
        // sequence; all-gather it (the conjugate of the forward reduce-scatter).
        (Shard(0), Shard(i)) if i < last => (pw, Replicate, Shard(last)),
        (Replicate, Shard(i)) if i < last => (pw, pg, Shard(i)),
        (Replicate, Partial(_)) if pg.is_linear_partial() => (pw, pg, pg),
        _ => {
            if matches!(pw, Partial(_)) || matches!(pg, Partial(_)) {
                let reduce = |p: Placement| {
                    if matches!(p, Partial(_)) {
                        Replicate
                    } else {
                        p
                    }
                };
                decide_linear_x_backward(reduce(pw), reduce(pg), rank)
            } else {
                (Replicate, Replicate, Replicate)
            }
        }
    }
}

/// A gradient (type-erased `DTensor<B>`) and its gathered value.
type GatheredGrad = (Box<dyn std::any::Any>, Box<dyn std::any::Any>);

thread_local! {
    /// A linear layer's gathered output gradient, for the next backward op of the same layer:
    /// Burn calls `linear_x_backward`, then `linear_weight_backward`, with clones of one gradient,
    /// and under sequence parallelism both need it gathered — once is enough. Holds the gradient
    /// it was gathered from (so the key stays unique) and the result; used once.
    static GATHERED_GRAD: std::cell::RefCell<Option<GatheredGrad>> =
        const { std::cell::RefCell::new(None) };
}

/// Drop a gathered gradient no weight-gradient op took (a frozen weight), at the end of a step.
pub(crate) fn clear_gathered_gradient() {
    GATHERED_GRAD.with(|c| c.borrow_mut().take());
}

/// `to_layout` for a linear layer's output gradient, sharing one gather between the layer's
/// input- and weight-gradient ops.
fn gradient_to_layout<B: Backend>(op: &'static str, g: DTensor<B>, target: &Layout) -> DTensor<B> {
    let gathers = (0..target.len()).any(|a| {
        matches!(g.layout.get(a), Shard(_))
            && target.get(a) == Replicate
            && !is_data(g.device.mesh(), a)
    });
    if !gathers {
        return to_layout(op, g, target);
    }
    let cached = GATHERED_GRAD.with(|c| {
        let (from, out) = c.borrow_mut().take()?;
        let (from, out) = (
            from.downcast::<DTensor<B>>().ok()?,
            out.downcast::<DTensor<B>>().ok()?,
        );
        (from.same_value(&g) && &out.layout == target).then_some(*out)
    });
    if let Some(out) = cached {
        return out;
    }
    let out = to_layout(op, g.clone(), target);
    GATHERED_GRAD.with(|c| *c.borrow_mut() = Some((Box::new(g), Box::new(out.clone()))));
    out
}

pub(crate) fn linear_x_backward<B: Backend>(
    weight: DTensor<B>,
    output_grad: DTensor<B>,
) -> DTensor<B> {
    const OP: &str = "linear_x_backward";
    check_param(OP, &weight);
    let output_grad = output_grad.settled();
    let rank = output_grad.shape.num_dims();
    let mut tw = weight.layout.clone();
    let mut tg = output_grad.layout.clone();
    let mut out = output_grad.layout.clone();
    for a in 0..tw.len() {
        let (pw, pg, o) =
            decide_linear_x_backward(weight.layout.get(a), output_grad.layout.get(a), rank);
        tw.set(a, pw);
        tg.set(a, pg);
        out.set(a, o);
    }
    let weight = to_layout(OP, weight, &tw);
    let g = gradient_to_layout(OP, output_grad, &tg);
    let local = in_compute_dtype(&g.device, [weight.local, g.local], |[w, g]| {
        let (g, lead) = rows_of::<B>(g);
        unrows::<B>(B::linear_x_backward(w, g), lead)
    });
    // A column-parallel layer's input gradient is a partial sum over the model axis: reduce it
    // here, as Megatron's `f` does in backward. Left partial, it would be reduced wherever the
    // next non-linear backward op meets it — inside LayerNorm's backward, more than once, and
    // with the LayerNorm parameters' gradients born partial too.
    let grad = wrap(local, out.clone(), g.device);
    let mut reduced = out;
    let sp = sequence_dim(&grad.device, &dims(&grad), &dims(&grad));
    for a in 0..reduced.len() {
        if matches!(reduced.get(a), Partial(_)) && !is_data(grad.device.mesh(), a) {
            // Sequence parallelism: reduce-scatter over the sequence instead.
            match sp {
                Some((axis, d)) if axis == a => reduced.set(a, Shard(d)),
                _ => reduced.set(a, Replicate),
            }
        }
    }
    to_layout(OP, grad, &reduced)
}

/// After computing a weight gradient from per-rank data: average the summands over every data
/// axis where an operand was `Local`, into the rank's data plan (`Replicate` for DDP and ZeRO-1,
/// `Shard(0)` on the shard axes of ZeRO-2/3 and HSDP): reduced where it is born.
fn reduce_data_parallel<B: Backend>(
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
    let replicated_plan = matches!(
        device.ctx.plan().strategy,
        Some(crate::fsdp::FsdpStrategy::NoShard | crate::fsdp::FsdpStrategy::ShardOptimizer)
    );
    let defer = device.ctx.no_sync() || replicated_plan;
    let grad = DTensor::new_unchecked(grad, layout, device);
    if defer {
        // Keep the summands; `sync_gradients` reduces the sum once.
        return grad;
    }
    grad.reduce_gradient(&target).unwrap_or_else(|e| raise(e))
}

/// `grad_w [k, n] = x^T [k, ..] @ grad_out [.., n]`, one model axis.
fn decide_linear_weight_backward(
    px: Placement,
    pg: Placement,
    rank: usize,
) -> (Placement, Placement, Placement) {
    let last = rank - 1;
    match (px, pg) {
        (Replicate, Replicate) => (px, pg, Replicate),
        (Replicate, Shard(i)) if i == last => (px, pg, Shard(1)),
        (Shard(i), Replicate) if i == last => (px, pg, Shard(0)),
        (Shard(i), Shard(j)) if i == j && i < last => (px, pg, Partial(ReduceOp::Sum)),
        // Sequence parallelism: a column-parallel layer's saved input is sequence-sharded (gather
        // it); a row-parallel layer's output gradient is (gather that).
        (Shard(i), Shard(j)) if i < last && j == last => (Replicate, pg, Shard(1)),
        (Shard(i), Shard(j)) if i == last && j < last => (px, Replicate, Shard(0)),
        (Shard(i), Replicate) if i < last => (px, Shard(i), Partial(ReduceOp::Sum)),
        (Replicate, Shard(i)) if i < last => (Shard(i), pg, Partial(ReduceOp::Sum)),
        (Replicate, Partial(_)) if pg.is_linear_partial() => (px, pg, pg),
        (Partial(_), Replicate) if px.is_linear_partial() => (px, pg, px),
        _ => {
            if matches!(px, Partial(_)) || matches!(pg, Partial(_)) {
                let reduce = |p: Placement| {
                    if matches!(p, Partial(_)) {
                        Replicate
                    } else {
                        p
                    }
                };
                decide_linear_weight_backward(reduce(px), reduce(pg), rank)
            } else {
                (Replicate, Replicate, Replicate)
            }
        }
    }
}

/// Split the mesh axes of a weight-gradient op: data axes where an operand is `Local` produce
/// summands (both operands brought to `Local`/`Replicate`); the rest go through `decide`.
fn weight_grad_layouts(
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

pub(crate) fn linear_weight_backward<B: Backend>(
    x: DTensor<B>,
    output_grad: DTensor<B>,
) -> DTensor<B> {
    const OP: &str = "linear_weight_backward";
    let (x, output_grad) = (x.settled(), output_grad.settled());
    let rank = x.shape.num_dims();
    let mesh = x.device.mesh().clone();
    let (tx, tg, out, summands) =
        weight_grad_layouts(&mesh, &x.layout, &output_grad.layout, |px, pg| {
            decide_linear_weight_backward(px, pg, rank)
        });
    let x = to_layout(OP, x, &tx);
    let g = gradient_to_layout(OP, output_grad, &tg);
    let grad = in_compute_dtype(&g.device, [x.local, g.local], |[x, g]| {
        B::linear_weight_backward(rows_of::<B>(x).0, rows_of::<B>(g).0)
    });
    reduce_data_parallel(grad, out, &summands, g.device)
}

pub(crate) fn linear_bias_backward<B: Backend>(output_grad: DTensor<B>) -> DTensor<B> {
    const OP: &str = "linear_bias_backward";
    let rank = output_grad.shape.num_dims();
    let mesh = output_grad.device.mesh().clone();
    let layout = output_grad.layout.clone();
    let (_, tg, out, summands) = weight_grad_layouts(&mesh, &layout, &layout, |_, pg| match pg {
        Shard(i) if i == rank - 1 => (pg, pg, Shard(0)),
        Shard(_) => (pg, pg, Partial(ReduceOp::Sum)),
        Partial(_) if pg.is_linear_partial() => (pg, pg, pg),
        _ => (Replicate, Replicate, Replicate),
    });
    let g = to_layout(OP, output_grad, &tg);
    let grad = B::linear_bias_backward(g.local);
    reduce_data_parallel(grad, out, &summands, g.device)
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

pub(crate) fn embedding<B: Backend>(
    weights: DTensor<B>,
    indices: B::IntTensorPrimitive,
) -> DTensor<B> {
    const OP: &str = "embedding";
    check_param(OP, &weights);
    check_synced(OP, &weights.device);
    let mesh = weights.device.mesh().clone();
    let out_rank = indices.shape().num_dims() + 1;
    let vocab_axis = vocab_parallel_axis(&weights.layout, &mesh);
    let mut tw = weights.layout.clone();
    let mut out = Layout::fresh(&mesh);
    for a in 0..tw.len() {
        match weights.layout.get(a) {
            // Vocabulary-parallel: look up the own range, zeros elsewhere: a partial sum.
            Shard(0) if Some(a) == vocab_axis => out.set(a, Partial(ReduceOp::Sum)),
            Shard(1) if !is_data(&mesh, a) => out.set(a, Shard(out_rank - 1)),
            Replicate => {}
            _ => tw.set(a, Replicate),
        }
    }
    let w = to_layout(OP, weights, &tw);
    if let Some(a) = vocab_axis {
        let len = w.local.shape()[0];
        let lo = mesh.group_index(w.device.rank(), a) * len;
        let (local_indices, outside) = localize_indices::<B>(indices, lo, len, &w.device);
        let rows = B::embedding(w.local, local_indices);
        let mask = rows_mask::<B>(outside, &rows.shape());
        return wrap(
            B::float_mask_fill(rows, mask, Scalar::from(0.0f64)),
            out,
            w.device,
        );
    }
    wrap(B::embedding(w.local, indices), out, w.device)
}

pub(crate) fn embedding_backward<B: Backend>(
    weights: DTensor<B>,
    output_grad: DTensor<B>,
    indices: B::IntTensorPrimitive,
) -> DTensor<B> {
    const OP: &str = "embedding_backward";
    check_param(OP, &weights);
    let mesh = weights.device.mesh().clone();
    let last = output_grad.shape.num_dims() - 1;
    let vocab_axis = vocab_parallel_axis(&weights.layout, &mesh);
    let (_, tg, out, summands) = weight_grad_layouts(
        &mesh,
        &weights.layout,
        &output_grad.layout,
        |pw, pg| match (pw, pg) {
            // Vocabulary-parallel: every rank sees the whole (replicated) output gradient and
            // adds the rows of its own vocabulary range.
            (Shard(0), _) if vocab_axis.is_some() => (pw, Replicate, Shard(0)),
            (Shard(1), Shard(i)) if i == last => (pw, pg, Shard(1)),
            (Shard(1), Replicate) => (pw, Shard(last), Shard(1)),
            (Replicate, Partial(_)) if pg.is_linear_partial() => (pw, pg, pg),
            _ => (Replicate, Replicate, Replicate),
        },
    );
    let g = to_layout(OP, output_grad, &tg);
    // The inner op reads only the weight's shape: hand it zeros of the local gradient's shape.
    let mut local = dims(&weights);
    for (d, size) in local.iter_mut().enumerate() {
        *size /= out.shards_of(d, &mesh);
    }
    let dtype = g.local.dtype().into();
    let (indices, g_local) = match vocab_axis {
        Some(a) => {
            let len = local[0];
            let lo = mesh.group_index(g.device.rank(), a) * len;
            let (local_indices, outside) = localize_indices::<B>(indices, lo, len, &g.device);
            // Tokens of other ranks' ranges add nothing (their rows are zeroed).
            let mask = rows_mask::<B>(outside, &g.local.shape());
            (
                local_indices,
                B::float_mask_fill(g.local, mask, Scalar::from(0.0f64)),
            )
        }
        None => (indices, g.local),
    };
    let zeros = B::float_zeros(Shape::from(local), &g.device.inner, dtype);
    let grad = B::embedding_backward(zeros, g_local, indices);
    reduce_data_parallel(grad, out, &summands, g.device)
}

pub(crate) fn layer_norm<B: Backend>(
    tensor: DTensor<B>,
    gamma: DTensor<B>,
    beta: Option<DTensor<B>>,
    epsilon: f64,
) -> DTensor<B> {
    const OP: &str = "layer_norm";
    check_param(OP, &gamma);
    let last = tensor.shape.num_dims() - 1;
    let target = whole_dim(&tensor.layout, last);
    let x = to_layout(OP, tensor, &target);
    let whole = Layout::replicated(x.device.mesh());
    let gamma = to_layout(OP, gamma, &whole).local;
    let beta = beta.map(|b| {
        check_param(OP, &b);
        to_layout(OP, b, &whole).local
    });
    wrap(
        B::layer_norm(x.local, gamma, beta, epsilon),
        x.layout,
        x.device,
    )
}

// ---------------------------------------------------------------------------------------------
// Creation, devices, transactions, and ops returning backend structs

pub(crate) fn float_from_data<B: Backend>(data: TensorData, device: &DistDevice<B>) -> DTensor<B> {
    let local = B::float_from_data(data, &device.inner);
    wrap(local, Layout::fresh(device.mesh()), device.clone())
}

/// Random values from this rank's stream once `Backend::seed` was called on the device (ranks as
/// threads draw deterministically, whatever the other threads do), else from the inner backend.
/// Replicated: ranks seeded alike draw alike.
pub(crate) fn float_random<B: Backend>(
    shape: Shape,
    distribution: Distribution,
    device: &DistDevice<B>,
    dtype: FloatDType,
) -> DTensor<B> {
    let drawn = device.ctx.with_rng(|rng| {
        TensorData::random::<f32, _, _>(shape.clone(), distribution, rng)
            .convert_dtype(burn_backend::DType::from(dtype))
    });
    let local = match drawn {
        Some(data) => B::float_from_data(data, &device.inner),
        None => B::float_random(shape, distribution, &device.inner, dtype),
    };
    wrap(local, Layout::replicated(device.mesh()), device.clone())
}

pub(crate) fn float_device<B: Backend>(tensor: &DTensor<B>) -> DistDevice<B> {
    tensor.device.clone()
}

pub(crate) fn float_to_device<B: Backend>(
    tensor: DTensor<B>,
    device: &DistDevice<B>,
) -> DTensor<B> {
    if tensor.device.mesh() == device.mesh() && tensor.device.rank() == device.rank() {
        let local = B::float_to_device(tensor.local, &device.inner);
        return DTensor::new_shaped(local, tensor.layout, tensor.shape, device.clone());
    }
    let fb = Fallback::<B>::new("float_to_device");
    let local = fb.float(tensor);
    wrap(
        B::float_to_device(local, &device.inner),
        Layout::fresh(device.mesh()),
        device.clone(),
    )
}

pub(crate) fn int_device<B: Backend>(_tensor: &B::IntTensorPrimitive) -> DistDevice<B> {
    current_device::<B>()
}

pub(crate) fn bool_device<B: Backend>(_tensor: &B::BoolTensorPrimitive) -> DistDevice<B> {
    current_device::<B>()
}

pub(crate) fn q_device<B: Backend>(_tensor: &B::QuantizedTensorPrimitive) -> DistDevice<B> {
    current_device::<B>()
}

pub(crate) fn tr_execute<B: Backend>(
    transaction: TransactionPrimitive<Distributed<B>>,
) -> impl Future<Output = Result<TransactionPrimitiveData, ExecutionError>> + Send {
    let fb = Fallback::<B>::new("tr_execute");
    let floats = transaction
        .read_floats
        .into_iter()
        .map(|t| fb.float(t))
        .collect();
    B::tr_execute(TransactionPrimitive::new(
        floats,
        transaction.read_qfloats,
        transaction.read_ints,
        transaction.read_bools,
    ))
}

pub(crate) fn quantize<B: Backend>(
    tensor: DTensor<B>,
    scheme: &QuantScheme,
    qparams: QuantizationParametersPrimitive<Distributed<B>>,
) -> B::QuantizedTensorPrimitive {
    let fb = Fallback::<B>::new("quantize");
    let tensor = fb.float(tensor);
    let scales = fb.float(qparams.scales);
    B::quantize(tensor, scheme, QuantizationParametersPrimitive { scales })
}

pub(crate) fn max_pool1d_with_indices<B: Backend>(
    x: DTensor<B>,
    kernel_size: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
    ceil_mode: bool,
) -> MaxPool1dWithIndices<Distributed<B>> {
    let fb = Fallback::<B>::new("max_pool1d_with_indices");
    let x = fb.float(x);
    let out = B::max_pool1d_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode);
    MaxPool1dWithIndices::new(fb.wrap(out.output), out.indices)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn max_pool1d_with_indices_backward<B: Backend>(
    x: DTensor<B>,
    kernel_size: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
    ceil_mode: bool,
    output_grad: DTensor<B>,
    indices: B::IntTensorPrimitive,
) -> MaxPool1dBackward<Distributed<B>> {
    let fb = Fallback::<B>::new("max_pool1d_with_indices_backward");
    let (x, g) = (fb.float(x), fb.float(output_grad));
    let out = B::max_pool1d_with_indices_backward(
        x,
        kernel_size,
        stride,
        padding,
        dilation,
        ceil_mode,
        g,
        indices,
    );
    MaxPool1dBackward::new(fb.wrap(out.x_grad))
}

pub(crate) fn max_pool2d_with_indices<B: Backend>(
    x: DTensor<B>,
    kernel_size: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    ceil_mode: bool,
) -> MaxPool2dWithIndices<Distributed<B>> {
    let fb = Fallback::<B>::new("max_pool2d_with_indices");
    let x = fb.float(x);
    let out = B::max_pool2d_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode);
    MaxPool2dWithIndices::new(fb.wrap(out.output), out.indices)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn max_pool2d_with_indices_backward<B: Backend>(
    x: DTensor<B>,
    kernel_size: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    ceil_mode: bool,
    output_grad: DTensor<B>,
    indices: B::IntTensorPrimitive,
) -> MaxPool2dBackward<Distributed<B>> {
    let fb = Fallback::<B>::new("max_pool2d_with_indices_backward");
    let (x, g) = (fb.float(x), fb.float(output_grad));
    let out = B::max_pool2d_with_indices_backward(
        x,
        kernel_size,
        stride,
        padding,
        dilation,
        ceil_mode,
        g,
        indices,
    );
    MaxPool2dBackward::new(fb.wrap(out.x_grad))
}

pub(crate) fn deform_conv2d_backward<B: Backend>(
    x: DTensor<B>,
    offset: DTensor<B>,
    weight: DTensor<B>,
    mask: Option<DTensor<B>>,
    bias: Option<DTensor<B>>,
    output_grad: DTensor<B>,
    options: DeformConvOptions<2>,
) -> DeformConv2dBackward<Distributed<B>> {
    let fb = Fallback::<B>::new("deform_conv2d_backward");
    let (x, offset, weight) = (fb.float(x), fb.float(offset), fb.float(weight));
    let (mask, bias) = (mask.map(|t| fb.float(t)), bias.map(|t| fb.float(t)));
    let out = B::deform_conv2d_backward(
        x,
        offset,
        weight,
        mask,
        bias,
        fb.float(output_grad),
        options,
    );
    DeformConv2dBackward::new(
        fb.wrap(out.x_grad),
        fb.wrap(out.offset_grad),
        fb.wrap(out.weight_grad),
        out.mask_grad.map(|t| fb.wrap(t)),
        out.bias_grad.map(|t| fb.wrap(t)),
    )
}
