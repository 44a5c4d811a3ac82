//! Reductions (PyTorch DTensor's `_math_ops`): a reduced sharded dim becomes a partial value.

use super::{to_layout, whole_dim, without_partials, wrap};
use crate::backend::prelude::*;
use crate::comm::ReduceOp;
use crate::placement::Placement;
use crate::tensor::DTensor;
use Placement::{Partial, Replicate, Shard};

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
    wrap(f(t.local), out, t.meta.device.clone())
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
    wrap(
        B::float_min(t.local),
        t.meta.layout.clone(),
        t.meta.device.clone(),
    )
}

pub(crate) fn float_min_dim<B: Backend>(tensor: DTensor<B>, dim: usize) -> DTensor<B> {
    const OP: &str = "float_min_dim";
    let target = whole_dim(&tensor.layout, dim);
    let t = to_layout(OP, tensor, &target);
    // `dim` is whole here and becomes 1; every other dim keeps its global size.
    let mut shape = t.shape.to_vec();
    shape[dim] = 1;
    DTensor::new_shaped(
        B::float_min_dim(t.local, dim),
        t.meta.layout.clone(),
        Shape::from(shape),
        t.meta.device.clone(),
    )
}
