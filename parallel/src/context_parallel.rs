//! [`context_parallel`]: every sequence split over the mesh's context axis.

use crate::data_parallel::DistributedBackend;
use crate::dims::{CpLayout, CpRotate};
use crate::error::Error;
use crate::mesh::CONTEXT_AXIS;
use crate::policy::ContextParallel;

/// Split every sequence over the context axis ([`CONTEXT_AXIS`]) of `device`'s mesh: the rank's
/// activations hold the chunks `layout` gives it ([`CpLayout::ranges`] are the columns of each
/// row its data loader hands it), models read their positions from
/// [`FusedOps::sequence_positions`](wildfire_kernels::FusedOps::sequence_positions), and
/// attention meets the other members' keys and values as `rotate` says. Parameters need no
/// change: the context axis is a data axis, so they are replicated or sharded over it, and their
/// gradients reduced over it, as over `dp` (each member's loss is the mean over its own
/// positions, and the mean of those is the whole sequence's).
///
/// A mesh without a context axis is an error ([`Error::NoSuchAxis`]); a context axis of one
/// member changes nothing.
pub fn context_parallel<B: DistributedBackend>(
    device: &B::Device,
    layout: CpLayout,
    rotate: CpRotate,
) -> Result<(), Error> {
    let dist = B::dist_device(device);
    let axis = dist.mesh().axis_index(CONTEXT_AXIS)?;
    dist.context().update_policy(|p| {
        p.context = Some(ContextParallel {
            axis,
            layout,
            rotate,
        })
    });
    Ok(())
}

/// The ranges of a sequence of `t` positions that `device`'s rank holds, in its order: `0..t`
/// without context parallelism, else its chunks ([`CpLayout::ranges`]) — the columns of every
/// row its data loader hands it. A `t` that does not split into the layout's chunks is an
/// [`Error::InvalidDims`] naming the lengths that do.
pub fn context_ranges<B: burn::tensor::backend::Backend>(
    device: &crate::DistDevice<B>,
    t: usize,
) -> Result<Vec<std::ops::Range<usize>>, Error> {
    match crate::backend::Context::of(device) {
        Some(ctx) => ctx.ranges(t),
        None => Ok(std::iter::once(0..t).collect()),
    }
}

/// The columns of `x` (`[rows, t]`: token ids or targets) that the rank of `x`'s device holds
/// ([`context_ranges`]): `x` itself without context parallelism.
pub fn context_columns<B: DistributedBackend>(
    x: burn::tensor::Tensor<B, 2, burn::tensor::Int>,
) -> Result<burn::tensor::Tensor<B, 2, burn::tensor::Int>, Error> {
    let t = x.dims()[1];
    let ranges = context_ranges(&B::dist_device(&x.device()), t)?;
    if ranges.len() == 1 && ranges[0] == (0..t) {
        return Ok(x);
    }
    let parts = ranges
        .into_iter()
        .map(|r| x.clone().narrow(1, r.start, r.len()))
        .collect();
    Ok(burn::tensor::Tensor::cat(parts, 1))
}

/// `f` with `device`'s rank out of context parallelism: its sequences whole, attention local
/// (generation, whose prompts have any length: every member of the group computes the same).
/// The policy is restored after, also when `f` panics (a rank failure unwinds through it).
pub fn without_context_parallel<B: burn::tensor::backend::Backend, R>(
    device: &crate::DistDevice<B>,
    f: impl FnOnce() -> R,
) -> R {
    struct Restore<'a>(&'a crate::RankContext, Option<ContextParallel>);
    impl Drop for Restore<'_> {
        fn drop(&mut self) {
            let context = self.1;
            self.0.update_policy(|p| p.context = context);
        }
    }
    let ctx = device.context();
    let saved = ctx.with_policy(|p| p.context);
    ctx.update_policy(|p| p.context = None);
    let _restore = Restore(ctx, saved);
    f()
}
