//! Views and shapes (PyTorch DTensor's `_view_ops`): reshape, swap and permute dims, expand,
//! slice and slice-assign, concatenate. Shards follow the dims they map to; a dim that cannot
//! keep its shard is gathered.

use super::pointwise::reduced_before_broadcast;
use super::{dims, to_layout, wrap};
use crate::backend::prelude::*;
use crate::placement::{Layout, Placement};
use crate::tensor::DTensor;
use Placement::{Local, Partial, Replicate, Shard};

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
    wrap(
        B::float_reshape(t.local, Shape::from(local)),
        out,
        t.meta.device.clone(),
    )
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
        tensor.meta.device.clone(),
    )
}

pub(crate) fn float_permute<B: Backend>(tensor: DTensor<B>, axes: &[usize]) -> DTensor<B> {
    let out = map_shards(&tensor.layout, |d| {
        axes.iter().position(|&x| x == d).unwrap()
    });
    wrap(
        B::float_permute(tensor.local, axes),
        out,
        tensor.meta.device.clone(),
    )
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
    wrap(
        B::float_slice(t.local, &local),
        t.meta.layout.clone(),
        t.meta.device.clone(),
    )
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
        tensor.meta.device.clone(),
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
        tensor.meta.device.clone(),
    )
}
