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
//!
//! One file per family of ops, as PyTorch DTensor groups its op strategies: [`pointwise`]
//! (elementwise ops and masks), [`reductions`], [`views`] (reshapes, permutations, slices,
//! concatenation), [`indexing`] (select, gather, scatter), [`matrix`] (matmul and linear layers),
//! [`embedding`], [`norms`], [`gradients`] (where data-parallel weight gradients are reduced),
//! [`creation`] (creation, devices) and [`structs`] (ops returning Burn's structs). The helpers
//! every family uses are here. A rule is a `pub(crate) fn` named after its op, with the op's
//! arguments, in any of these files: `tools/gen_forward.py` finds it there and forwards the op
//! to it (as `rules::<op>`: every file's items are re-exported here).

mod creation;
mod embedding;
mod gradients;
mod indexing;
pub(crate) mod matrix;
mod norms;
mod pointwise;
mod reductions;
mod structs;
mod views;

pub(crate) use creation::*;
pub(crate) use embedding::*;
pub(crate) use gradients::*;
pub(crate) use indexing::*;
pub(crate) use matrix::*;
pub(crate) use norms::*;
pub(crate) use pointwise::*;
pub(crate) use reductions::*;
pub(crate) use structs::*;
pub(crate) use views::*;

use crate::device::DistDevice;
use crate::error::{Error, raise};
use crate::mesh::{AxisKind, DeviceMesh};
use crate::placement::{Layout, Placement};
use crate::tensor::DTensor;
use burn_backend::Slice;
use burn_backend::{Backend, FloatDType, TensorMetadata};

use Placement::{Local, Partial, Replicate, Shard};

/// The precision policy's compute dtype on this rank ([`crate::RankPolicy::compute_dtype`]).
pub(crate) fn compute_dtype<B: Backend>(device: &DistDevice<B>) -> Option<FloatDType> {
    device.ctx.with_policy(|p| p.compute_dtype)
}

/// The dtype of master weights, their gradients and the statistics the precision policy keeps
/// wide (a loss): what weight gradients and losses come back in under a compute dtype.
pub(crate) const MASTER_DTYPE: FloatDType = FloatDType::F32;

/// `local` in `dtype`, cast (and counted under `op`) when it is not: a result the precision
/// policy hands on in another dtype than it was computed in.
pub(crate) fn cast_local<B: Backend>(
    op: &'static str,
    device: &DistDevice<B>,
    local: B::FloatTensorPrimitive,
    dtype: FloatDType,
) -> B::FloatTensorPrimitive {
    if FloatDType::from(local.dtype()) == dtype {
        return local;
    }
    device.ctx.count_cast(op);
    B::float_cast(local, dtype)
}

/// Under a compute dtype, `local` (a weight gradient, a loss) back in f32; as it is otherwise.
pub(crate) fn to_master<B: Backend>(
    op: &'static str,
    device: &DistDevice<B>,
    local: B::FloatTensorPrimitive,
) -> B::FloatTensorPrimitive {
    cast_to(
        op,
        device,
        local,
        compute_dtype(device).map(|_| MASTER_DTYPE),
    )
}

fn cast_to<B: Backend>(
    op: &'static str,
    device: &DistDevice<B>,
    local: B::FloatTensorPrimitive,
    dtype: Option<FloatDType>,
) -> B::FloatTensorPrimitive {
    match dtype {
        Some(d) => cast_local(op, device, local, d),
        None => local,
    }
}

/// Redistribute as a rule asks, counting the call when it communicates.
pub(crate) fn to_layout<B: Backend>(
    op: &'static str,
    t: DTensor<B>,
    target: &Layout,
) -> DTensor<B> {
    if &t.layout == target {
        return t.ready();
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
            raise(Error::UnplacedParameter {
                op,
                shape: dims(w),
                axis: mesh.axis(a).name.clone(),
                size: mesh.axis_size(a),
            });
        }
    }
}

/// A parameter brought whole: `Replicate` everywhere, except that `Local` stays (a parameter is
/// `Local` only on axes of one member, where its piece is whole already): relabelled, it would be
/// a new value at each use, and lose the compute-dtype copy kept with it.
pub(crate) fn whole_param(layout: &Layout) -> Layout {
    Layout::new(
        layout
            .placements()
            .iter()
            .map(|p| if *p == Local { Local } else { Replicate }),
    )
}

/// A forward op that uses parameters: the previous backward's gradients must have been synced.
fn check_synced<B: Backend>(op: &'static str, device: &DistDevice<B>) {
    if device.ctx.gradients_pending() && !crate::device::is_recomputing() {
        raise(Error::GradientsNotSynced { op });
    }
}

/// The value with its padded splits gathered (see [`DTensor`]): every rule but the elementwise
/// ones, which keep padded shards, takes its float inputs through this.
pub(crate) fn unpadded<B: Backend>(t: DTensor<B>) -> DTensor<B> {
    t.unpadded()
}

/// A parameter operand that the rule brings to its layout (`to_layout`) before reading its
/// piece: [`DTensor::unpadded_param`].
pub(crate) fn param_operand<B: Backend>(t: DTensor<B>) -> DTensor<B> {
    t.unpadded_param()
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
