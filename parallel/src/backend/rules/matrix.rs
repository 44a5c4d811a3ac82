//! Matmul and linear layers (PyTorch DTensor's `_matrix_ops`), forward and backward: column-
//! and row-parallel layers, sequence parallelism's gathers, and the precision policy's compute
//! dtype.

use super::gradients::{reduce_data_parallel, weight_grad_layouts};
use super::pointwise::sequence_dim;
use super::{
    MASTER_DTYPE, cast_local, check_param, check_synced, compute_dtype, dims, is_data, to_layout,
    to_master, whole_param, wrap,
};
use crate::backend::prelude::*;
use crate::comm::ReduceOp;
use crate::placement::{Layout, Placement};
use crate::tensor::DTensor;
use Placement::{Local, Partial, Replicate, Shard};
use burn_backend::TensorMetadata;
use wildfire_kernels::gemm;

/// What a matmul's result is under the precision policy's compute dtype.
#[derive(Clone, Copy)]
enum Out {
    /// An activation or an input gradient: it stays in the compute dtype (as under
    /// `torch.autocast`), so the next matmul takes it as it is.
    Compute,
    /// A weight gradient: back in the master weights' f32.
    Master,
}

/// The precision policy: run `f` on the operands' local pieces in the rank's compute dtype (when
/// one is set; each operand cast once per value, see [`DTensor::local_in`]) — f32 master
/// weights, bf16/f16 matmuls. Without a compute dtype, `f` on the pieces as they are.
fn in_compute_dtype<B: Backend, const N: usize>(
    op: &'static str,
    inputs: [DTensor<B>; N],
    out: Out,
    f: impl FnOnce([B::FloatTensorPrimitive; N]) -> B::FloatTensorPrimitive,
) -> B::FloatTensorPrimitive {
    let device = inputs[0].device.clone();
    let Some(compute) = compute_dtype(&device) else {
        return f(inputs.map(|t| t.local));
    };
    let result = f(inputs.map(|t| t.local_in(op, compute)));
    match out {
        Out::Compute => result,
        Out::Master => cast_local(op, &device, result, MASTER_DTYPE),
    }
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
    let device = lhs.device.clone();
    let local = in_compute_dtype("float_matmul", [lhs, rhs], Out::Compute, |[l, r]| {
        gemm::matmul::<B>(l, r)
    });
    wrap(local, out, device)
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
    let device = x.device.clone();
    let Some(bias) = bias else {
        let local = in_compute_dtype(OP, [x, weight], Out::Compute, |[x, w]| {
            flat_linear::<B>(x, w, None)
        });
        return wrap(local, out, device);
    };
    // The bias follows the output's last dim; with a partial sum only member 0 adds it.
    let mut tb = whole_param(&bias.layout);
    let mut add_bias = true;
    for a in 0..tb.len() {
        match out.get(a) {
            Shard(d) if d == rank - 1 => tb.set(a, Shard(0)),
            Partial(ReduceOp::Sum) => add_bias &= mesh.group_index(x.device.rank(), a) == 0,
            _ => {}
        }
    }
    let bias = to_layout(OP, bias, &tb);
    let local = if add_bias {
        in_compute_dtype(OP, [x, weight, bias], Out::Compute, |[x, w, b]| {
            flat_linear::<B>(x, w, Some(b))
        })
    } else {
        in_compute_dtype(OP, [x, weight], Out::Compute, |[x, w]| {
            flat_linear::<B>(x, w, None)
        })
    };
    wrap(local, out, device)
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

/// The linear layer over the input's rows (`gemm::linear`: cuBLASLt on CUDA, `B::linear`
/// elsewhere).
fn flat_linear<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    b: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let (x, lead) = rows_of::<B>(x);
    unrows::<B>(gemm::linear::<B>(x, w, b), lead)
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
    let device = g.device.clone();
    let local = in_compute_dtype(OP, [weight, g], Out::Compute, |[w, g]| {
        let (g, lead) = rows_of::<B>(g);
        unrows::<B>(gemm::linear_x_backward::<B>(w, g), lead)
    });
    // A column-parallel layer's input gradient is a partial sum over the model axis: reduce it
    // here, as Megatron's `f` does in backward. Left partial, it would be reduced wherever the
    // next non-linear backward op meets it — inside LayerNorm's backward, more than once, and
    // with the LayerNorm parameters' gradients born partial too.
    let grad = wrap(local, out.clone(), device);
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
    // Under a compute dtype the gradient goes back to f32: written so by the product where it
    // can (cuBLASLt), else cast by `in_compute_dtype`.
    let master = compute_dtype(&g.device).map(|_| MASTER_DTYPE);
    if g.device.ctx.defers_weight_gradients() {
        // A zero-bubble `I`: the gradient's layouts are decided (and any gather done) now, its
        // matmul runs at the `W`.
        let (xs, gs) = (x.local.shape(), g.local.shape());
        let (k, n) = (xs[xs.num_dims() - 1], gs[gs.num_dims() - 1]);
        let dtype = match master {
            Some(m) => m.into(),
            None => g.local.dtype(),
        };
        let device = g.device.clone();
        let compute = Box::new(move || {
            in_compute_dtype(OP, [x, g], Out::Master, |[x, g]| {
                gemm::linear_weight_backward_into::<B>(rows_of::<B>(x).0, rows_of::<B>(g).0, master)
            })
        });
        return super::gradients::deferred_data_parallel(
            compute,
            vec![k, n],
            dtype,
            out,
            &summands,
            device,
        );
    }
    let device = g.device.clone();
    let grad = in_compute_dtype(OP, [x, g], Out::Master, |[x, g]| {
        gemm::linear_weight_backward_into::<B>(rows_of::<B>(x).0, rows_of::<B>(g).0, master)
    });
    reduce_data_parallel(grad, out, &summands, device)
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
    // Under a compute dtype the gradient is summed into f32 by the kernel where one runs
    // (CubeCL), else summed in the compute dtype and cast by `to_master`.
    let master = compute_dtype(&g.meta.device).map(|_| MASTER_DTYPE);
    let sums = gemm::linear_bias_backward_into::<B>(g.local, master);
    let grad = to_master(OP, &g.meta.device, sums);
    reduce_data_parallel(grad, out, &summands, g.meta.device.clone())
}

/// The experts' grouped matmul `x [rows, k]` by stacked `w [E, k, n]`, one mesh axis: (x
/// target, w target, output). On the expert axis the rows are per-rank and the weights split by
/// expert (anything else is an error naming the axis); elsewhere each expert is a linear layer
/// (`w`'s dims 1 and 2 a linear weight's 0 and 1), its split over the experts on a data axis
/// (FSDP) gathered.
fn decide_grouped(
    expert_axis: bool,
    px: Placement,
    pw: Placement,
) -> Result<(Placement, Placement, Placement), (Placement, Placement)> {
    if expert_axis {
        return match (px, pw) {
            (Local, Shard(0)) => Ok((Local, Shard(0), Local)),
            other => Err(other),
        };
    }
    let as_linear = match pw {
        Shard(1) => Shard(0),
        Shard(2) => Shard(1),
        Shard(_) => Replicate,
        p => p,
    };
    let (tx, tw, out) = decide_linear(px, as_linear, 2);
    let tw = match tw {
        Shard(0) => Shard(1),
        Shard(1) => Shard(2),
        p => p,
    };
    Ok((tx, tw, out))
}

/// The targets of [`decide_grouped`] on every axis.
fn grouped_layouts<B: Backend>(
    op: &'static str,
    x: &DTensor<B>,
    w: &DTensor<B>,
) -> (Layout, Layout, Layout) {
    let mesh = x.device.mesh();
    let expert = mesh.expert_axis().map(|(a, _)| a);
    let (mut tx, mut tw, mut out) = (x.layout.clone(), w.layout.clone(), x.layout.clone());
    for a in 0..tx.len() {
        match decide_grouped(Some(a) == expert, x.layout.get(a), w.layout.get(a)) {
            Ok((px, pw, o)) => {
                tx.set(a, px);
                tw.set(a, pw);
                out.set(a, o);
            }
            Err((px, pw)) => crate::error::raise(crate::Error::InvalidLayout {
                shape: dims(w),
                mesh: mesh.to_string(),
                reason: format!(
                    "{op}: on the expert axis '{}' the rows are per-rank (Local) and the stacked \
                     weights split by expert (Shard(0)); got rows {px:?}, weights {pw:?}",
                    mesh.axis(a).name
                ),
            }),
        }
    }
    (tx, tw, out)
}

/// The experts' grouped matmul ([`wildfire_kernels::experts::grouped_matmul`]) on the local
/// rows and the local experts, `local` running it.
pub(crate) fn grouped_matmul<B: Backend>(
    x: DTensor<B>,
    w: DTensor<B>,
    local: impl FnOnce(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) -> DTensor<B> {
    const OP: &str = "grouped_matmul";
    check_param(OP, &w);
    check_synced(OP, &x.device);
    let (x, w) = (x.settled().unpadded(), w.settled());
    let (tx, tw, out) = grouped_layouts(OP, &x, &w);
    let x = to_layout(OP, x, &tx);
    let w = to_layout(OP, w, &tw);
    let device = x.device.clone();
    let y = in_compute_dtype(OP, [x, w], Out::Compute, |[x, w]| local(x, w));
    wrap(y, out, device)
}

/// The gradients `(dx, dw)` of [`grouped_matmul`] from the output's `dy`, `local` computing
/// them on the local pieces. `dx` is laid out as the rows (a column-parallel expert's partial
/// sum over the model axis reduced); `dw` as the weights: split by expert on the expert axis,
/// divided by its size (the member's rows came from every member, each row's gradient its own
/// rank's loss's), and averaged over the other data axes where the rows are per-rank, reduced
/// where it is born as a linear layer's weight gradient is.
pub(crate) fn grouped_matmul_backward<B: Backend>(
    x: DTensor<B>,
    w: DTensor<B>,
    dy: DTensor<B>,
    local: impl FnOnce(
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
    ) -> (FloatTensor<B>, FloatTensor<B>),
) -> (DTensor<B>, DTensor<B>) {
    const OP: &str = "grouped_matmul_backward";
    let (x, w) = (x.settled().unpadded(), w.settled());
    let (tx, tw, out) = grouped_layouts(OP, &x, &w);
    let mesh = x.device.mesh().clone();
    let x = to_layout(OP, x, &tx);
    let w = to_layout(OP, w, &tw);
    let dy = to_layout(OP, dy.settled().unpadded(), &out.reduced());
    let device = x.device.clone();
    let (dx, dw) = match compute_dtype(&device) {
        Some(c) => {
            let (dx, dw) = local(x.local_in(OP, c), w.local_in(OP, c), dy.local_in(OP, c));
            (dx, cast_local(OP, &device, dw, MASTER_DTYPE))
        }
        None => local(x.local, w.local, dy.local),
    };
    // dx: like the rows, a column-parallel expert's (w split on its output) partial over that
    // model axis.
    let mut dx_layout = tx.clone();
    let mut dw_layout = tw.clone();
    let mut summands = Vec::new();
    let expert = mesh.expert_axis();
    for a in 0..tx.len() {
        if is_data(&mesh, a) {
            if Some(a) != expert.map(|(e, _)| e) && tx.get(a) == Local {
                dw_layout.set(a, Replicate);
                if mesh.axis_size(a) > 1 {
                    summands.push(a);
                }
            }
            continue;
        }
        if tw.get(a) == Shard(2) {
            dx_layout.set(a, Partial(ReduceOp::Sum));
        }
    }
    let dx = to_layout(
        OP,
        wrap(dx, dx_layout.clone(), device.clone()),
        &dx_layout.reduced(),
    );
    let dw = match expert {
        Some((_, size)) => B::float_mul_scalar(dw, (1.0 / size as f64).into()),
        None => dw,
    };
    let dw = reduce_data_parallel(dw, dw_layout, &summands, device);
    (dx, dw)
}
