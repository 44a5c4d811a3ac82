//! Embedding lookups and their backward (PyTorch DTensor's `_embedding_ops`): vocabulary-parallel
//! tables (`Shard(0)` on one model axis) look up their own range and yield a partial sum.

use super::gradients::{reduce_data_parallel, weight_grad_layouts};
use super::indexing::{localize_indices, single_model_split};
use super::{check_param, check_synced, dims, is_data, to_layout, wrap};
use crate::backend::prelude::*;
use crate::comm::ReduceOp;
use crate::mesh::DeviceMesh;
use crate::placement::{Layout, Placement};
use crate::tensor::DTensor;
use Placement::{Partial, Replicate, Shard};
use burn_backend::TensorMetadata;

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
            w.meta.device.clone(),
        );
    }
    wrap(B::embedding(w.local, indices), out, w.meta.device.clone())
}

pub(crate) fn embedding_backward<B: Backend>(
    weights: DTensor<B>,
    output_grad: DTensor<B>,
    indices: B::IntTensorPrimitive,
) -> DTensor<B> {
    embedding_backward_with(weights, output_grad, indices, B::embedding_backward)
}

/// [`embedding_backward`] with `inner` as the local op (`B`'s fused kernel, or Burn's
/// `embedding_backward`): `inner(table, grad, ids)` reads only the table's shape.
pub(crate) fn embedding_backward_with<B: Backend>(
    weights: DTensor<B>,
    output_grad: DTensor<B>,
    indices: B::IntTensorPrimitive,
    inner: impl FnOnce(
        B::FloatTensorPrimitive,
        B::FloatTensorPrimitive,
        B::IntTensorPrimitive,
    ) -> B::FloatTensorPrimitive,
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
    // The inner op reads only the weight's shape (and device): hand it that shape.
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
    let grad = if is_flex::<B>() && g_local.dtype() == burn_backend::DType::F32 {
        rows_added_once::<B>(local[0], local[1], g_local, indices, &g.meta.device.inner)
    } else {
        // A broadcast view of one zero: no table-sized buffer (the gradient's own is the inner
        // op's; a materialised stand-in cost a third table-sized buffer at the step's peak).
        let one = B::float_zeros(
            Shape::from(vec![1; local.len()]),
            &g.meta.device.inner,
            dtype,
        );
        let shape_only = B::float_expand(one, Shape::from(local));
        inner(shape_only, g_local, indices)
    };
    reduce_data_parallel(grad, out, &summands, g.meta.device.clone())
}

/// Whether the inner backend is Flex (Burn's CPU backend).
fn is_flex<B: Backend>() -> bool {
    std::any::TypeId::of::<B>() == std::any::TypeId::of::<burn::backend::Flex>()
}

/// Flex's embedding backward: a `[rows, cols]` table of zeros with each output-gradient row
/// added to its token's row, in token order — in one buffer. Flex's own makes the zero table and
/// then `select_add` copies it, so two table-sized buffers live at once (150 MB each for GPT-2's
/// table, at the step's memory peak, on every rank); the sums are the same, bitwise.
fn rows_added_once<B: Backend>(
    rows: usize,
    cols: usize,
    grad: B::FloatTensorPrimitive,
    indices: B::IntTensorPrimitive,
    device: &B::Device,
) -> B::FloatTensorPrimitive {
    let grad = crate::comm::read::<B>(grad);
    let indices =
        burn_backend::read_sync(B::int_into_data(indices)).expect("reading token indices failed");
    let grad: &[f32] = grad.as_slice().expect("an f32 gradient");
    let mut table = vec![0f32; rows * cols];
    for (i, token) in indices.iter::<i64>().enumerate() {
        let row = usize::try_from(token)
            .ok()
            .filter(|&r| r < rows)
            .unwrap_or_else(|| panic!("embedding_backward: index {token} out of 0..{rows}"));
        let dst = &mut table[row * cols..(row + 1) * cols];
        for (d, s) in dst.iter_mut().zip(&grad[i * cols..(i + 1) * cols]) {
            *d += *s;
        }
    }
    B::float_from_data(TensorData::new(table, [rows, cols]), device)
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
