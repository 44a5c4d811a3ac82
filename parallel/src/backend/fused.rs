//! `FusedOps` on `Distributed<B>`: placement rules that run `B`'s fused kernels on the local
//! shards.
//!
//! * Row ops (softmax, norms, GELU-with-bias) need whole rows: the input's channel (last)
//!   dimension is gathered where sharded — except GELU-with-bias, whose bias may be sharded like
//!   the channels (a column-parallel layer's output), so it stays local — and partials are
//!   reduced. Leading dimensions keep their placement (data-parallel `Local` batches, sequence
//!   shards), and so do the per-row statistics. Parameters are brought whole (or to the channel
//!   shard) exactly as the `layer_norm` rule does. A parameter's gradient is the kernel's local
//!   column sum, reduced like a linear layer's bias gradient ([`rules::column_grad`]).
//! * The SwiGLU gate is elementwise over two operands: `up` (and the incoming gradient) are
//!   brought to `gate`'s layout without partials (a column-parallel pair shares it already), the
//!   outputs keep it.
//! * The rotary embedding needs a head's dims and the positions whole (dims 2 and 3 of
//!   `[b, h, t, hd]`); batch and head shards stay local. Its tables are brought whole.
//! * Cross-entropy runs locally when the logits' rows and vocabulary are not sharded (the integer
//!   targets are per-rank values); otherwise — vocabulary-parallel logits — it takes the Burn-op
//!   defaults, which the decorator's loss-parallel rules shard.
//! * Attention runs locally on batch and head shards (tensor-parallel heads); sequence and
//!   head-dimension shards are gathered first. Packed attention likewise, its packed last dim
//!   whole.
//! * Backward passes bring the incoming gradient to the saved input's layout, then run locally.

use super::Distributed;
use super::context::{self, Context};
use super::rules::{self, column_grad, to_layout, whole_dim, without_partials, wrap};
use crate::placement::{Layout, Placement};
use crate::tensor::DTensor;
use burn_backend::tensor::IntTensor;
use burn_backend::{FloatDType, TensorMetadata};
use wildfire_kernels::experts::ExpertRoute;
use wildfire_kernels::{
    AttentionGrads, AttentionOutput, CrossEntropyOutput, FusedOps, LayerNormGrads, LayerNormOutput,
    RmsNormOutput, packed, reference,
};

type Dt<B> = DTensor<B>;

fn last(t: &Dt<impl FusedOps>) -> usize {
    t.shape.num_dims() - 1
}

/// The input with whole rows (channel dimension unsharded, no partials).
fn rows<B: FusedOps>(op: &'static str, x: Dt<B>) -> Dt<B> {
    let x = rules::unpadded(x.settled());
    let target = whole_dim(&x.layout, last(&x));
    to_layout(op, x, &target)
}

/// `t` (a gradient or a saved statistic) in `layout`.
fn like<B: FusedOps>(op: &'static str, t: Dt<B>, layout: &Layout) -> B::FloatTensorPrimitive {
    to_layout(op, rules::unpadded(t.settled()), layout).local
}

/// The dtype a norm's output is handed on in when it is not the input's: the precision
/// policy's compute dtype (the conversion counted under `op`, though the kernel writes it).
fn output_dtype<B: FusedOps>(op: &'static str, x: &Dt<B>) -> Option<FloatDType> {
    let d = rules::compute_dtype(&x.device).filter(|&d| d != dtype_of(x))?;
    x.device.ctx.count_cast(op);
    Some(d)
}

/// Whether a norm's backward reads the incoming gradient `dy` as it is, widened inside the kernel
/// (`fused_*_norm_backward_any`): `dy` narrower than an f32 input (a matmul's gradient under the
/// precision policy). The widening is exact, so the numbers are those of casting first; it is
/// counted under `op` as the conversion it is.
fn widened<B: FusedOps>(op: &'static str, x: &Dt<B>, dy: &B::FloatTensorPrimitive) -> bool {
    let wide = dtype_of(x) == FloatDType::F32 && FloatDType::from(dy.dtype()) != FloatDType::F32;
    if wide {
        x.device.ctx.count_cast(op);
    }
    wide
}

/// A per-channel parameter, whole, in `dtype` (the input's: cast once per value under the
/// precision policy, see [`DTensor::local_in`]).
fn param<B: FusedOps>(op: &'static str, p: Dt<B>, dtype: FloatDType) -> B::FloatTensorPrimitive {
    rules::check_param(op, &p);
    let whole = rules::whole_param(&p.layout);
    to_layout(op, rules::param_operand(p), &whole).local_in(op, dtype)
}

/// The dtype of `t`'s local piece.
fn dtype_of<B: FusedOps>(t: &Dt<B>) -> FloatDType {
    t.local.dtype().into()
}

/// Row ops without parameters: `f` on the local rows, the output laid out like them.
fn row_op<B: FusedOps>(
    op: &'static str,
    x: Dt<B>,
    f: impl FnOnce(B::FloatTensorPrimitive) -> B::FloatTensorPrimitive,
) -> Dt<B> {
    let x = rows(op, x);
    wrap(f(x.local), x.meta.layout.clone(), x.meta.device.clone())
}

fn row_backward<B: FusedOps>(
    op: &'static str,
    y: Dt<B>,
    dy: Dt<B>,
    f: impl FnOnce(B::FloatTensorPrimitive, B::FloatTensorPrimitive) -> B::FloatTensorPrimitive,
) -> Dt<B> {
    let y = rows(op, y);
    let dy = like(op, dy, &y.layout);
    wrap(f(y.local, dy), y.meta.layout.clone(), y.meta.device.clone())
}

/// No tensor-sharded axis (only `Replicate` and per-rank `Local`): the layout under which the
/// per-rank integer targets line up with the local logits.
fn unsharded_rows(layout: &Layout) -> bool {
    layout
        .placements()
        .iter()
        .all(|p| matches!(p, Placement::Replicate | Placement::Local))
}

/// Attention operands: no partials, sequence and head dimensions whole.
fn attention_layout(layout: &Layout) -> Layout {
    whole_dim(&whole_dim(layout, 2), 3)
}

/// Packed projections `[b, t, h, 3·hd]`: the sequence and the packed dim whole, batch and heads
/// (tensor-parallel heads: a column-parallel projection's output) left where they are. The
/// output `[b, t, h, hd]` and the log-sum-exp `[b, t, h]` keep the same placements (no dim 3 is
/// sharded).
fn packed_layout(layout: &Layout) -> Layout {
    whole_dim(&whole_dim(layout, 1), 3)
}

impl<B: FusedOps> FusedOps for Distributed<B> {
    const FUSED: wildfire_kernels::Fused = B::FUSED;
    const COMPUTES_ON_HOST_POOL: bool = B::COMPUTES_ON_HOST_POOL;

    fn sequence_positions(device: &crate::DistDevice<B>, len: usize) -> Vec<usize> {
        match Context::of(device) {
            Some(ctx) => ctx.positions(len),
            None => (0..len).collect(),
        }
    }

    fn expert_axis(device: &crate::DistDevice<B>) -> (usize, usize) {
        super::experts::position(device)
    }

    fn expert_counts(device: &crate::DistDevice<B>, counts: &[usize]) -> Vec<usize> {
        super::experts::gather_counts(device, counts)
    }

    fn data_sum(device: &crate::DistDevice<B>, values: &[usize]) -> Vec<usize> {
        super::experts::data_sum(device, values)
    }

    fn expert_dispatch(x: Dt<B>, route: &ExpertRoute) -> Dt<B> {
        super::experts::dispatch(x, route)
    }

    fn expert_dispatch_backward(grad: Dt<B>, route: &ExpertRoute) -> Dt<B> {
        super::experts::combine(grad, route)
    }

    fn expert_combine(y: Dt<B>, route: &ExpertRoute) -> Dt<B> {
        super::experts::combine(y, route)
    }

    fn expert_combine_backward(grad: Dt<B>, route: &ExpertRoute) -> Dt<B> {
        super::experts::dispatch(grad, route)
    }

    fn grouped_matmul(x: Dt<B>, w: Dt<B>, groups: &[usize]) -> Dt<B> {
        rules::matrix::grouped_matmul(x, w, |x, w| B::grouped_matmul(x, w, groups))
    }

    fn grouped_matmul_backward(x: Dt<B>, w: Dt<B>, dy: Dt<B>, groups: &[usize]) -> (Dt<B>, Dt<B>) {
        rules::matrix::grouped_matmul_backward(x, w, dy, |x, w, dy| {
            B::grouped_matmul_backward(x, w, dy, groups)
        })
    }

    fn fused_softmax(x: Dt<B>) -> Dt<B> {
        row_op("fused_softmax", x, B::fused_softmax)
    }

    fn fused_causal_softmax(scores: Dt<B>) -> Dt<B> {
        // The mask depends on the query and key positions: both dims whole.
        const OP: &str = "fused_causal_softmax";
        let scores = rules::unpadded(scores.settled());
        let layout = attention_layout(&scores.layout);
        let scores = to_layout(OP, scores, &layout);
        wrap(
            B::fused_causal_softmax(scores.local),
            layout,
            scores.meta.device.clone(),
        )
    }

    fn fused_softmax_backward(y: Dt<B>, dy: Dt<B>) -> Dt<B> {
        row_backward("fused_softmax_backward", y, dy, B::fused_softmax_backward)
    }

    fn fused_log_softmax(x: Dt<B>) -> Dt<B> {
        row_op("fused_log_softmax", x, B::fused_log_softmax)
    }

    fn fused_log_softmax_backward(y: Dt<B>, dy: Dt<B>) -> Dt<B> {
        row_backward(
            "fused_log_softmax_backward",
            y,
            dy,
            B::fused_log_softmax_backward,
        )
    }

    fn fused_layer_norm(
        x: Dt<B>,
        gamma: Dt<B>,
        beta: Dt<B>,
        epsilon: f64,
    ) -> LayerNormOutput<Self> {
        const OP: &str = "fused_layer_norm";
        let x = rows(OP, x);
        let dtype = dtype_of(&x);
        let (gamma, beta) = (param(OP, gamma, dtype), param(OP, beta, dtype));
        // Under the precision policy the statistics stay f32 and the output, which feeds
        // matmuls, is handed on in the compute dtype (what autodiff keeps for their backward),
        // written in it by the kernel (counted as the conversion it is).
        let out = match output_dtype(OP, &x) {
            Some(d) => B::fused_layer_norm_as(x.local, gamma, beta, epsilon, d),
            None => B::fused_layer_norm(x.local, gamma, beta, epsilon),
        };
        let dev = x.meta.device.clone();
        LayerNormOutput {
            output: wrap(out.output, x.meta.layout.clone(), dev.clone()),
            mean: wrap(out.mean, x.meta.layout.clone(), dev.clone()),
            rstd: wrap(out.rstd, x.meta.layout.clone(), dev),
        }
    }

    fn fused_layer_norm_backward(
        x: Dt<B>,
        gamma: Dt<B>,
        mean: Dt<B>,
        rstd: Dt<B>,
        dy: Dt<B>,
    ) -> LayerNormGrads<Self> {
        const OP: &str = "fused_layer_norm_backward";
        let x = rows(OP, x);
        let dtype = dtype_of(&x);
        let gamma = param(OP, gamma, dtype);
        let (mean, rstd, dy) = (
            like(OP, mean, &x.layout),
            like(OP, rstd, &x.layout),
            like(OP, dy, &x.layout),
        );
        let rank = x.shape.num_dims();
        let g = if widened(OP, &x, &dy) {
            B::fused_layer_norm_backward_any([x.local, gamma, mean, rstd, dy])
        } else {
            let dy = rules::cast_local(OP, &x.device, dy, dtype);
            B::fused_layer_norm_backward(x.local, gamma, mean, rstd, dy)
        };
        let dev = x.meta.device.clone();
        let (dgamma, dbeta) = (
            rules::to_master(OP, &dev, g.gamma),
            rules::to_master(OP, &dev, g.beta),
        );
        LayerNormGrads {
            x: wrap(g.x, x.meta.layout.clone(), dev.clone()),
            gamma: column_grad(dgamma, &x.meta.layout, rank, dev.clone()),
            beta: column_grad(dbeta, &x.meta.layout, rank, dev),
        }
    }

    fn fused_rms_norm(x: Dt<B>, gamma: Dt<B>, epsilon: f64) -> RmsNormOutput<Self> {
        const OP: &str = "fused_rms_norm";
        let x = rows(OP, x);
        let gamma = param(OP, gamma, dtype_of(&x));
        let out = match output_dtype(OP, &x) {
            Some(d) => B::fused_rms_norm_as(x.local, gamma, epsilon, d),
            None => B::fused_rms_norm(x.local, gamma, epsilon),
        };
        RmsNormOutput {
            output: wrap(out.output, x.meta.layout.clone(), x.meta.device.clone()),
            rstd: wrap(out.rstd, x.meta.layout.clone(), x.meta.device.clone()),
        }
    }

    fn fused_rms_norm_backward(x: Dt<B>, gamma: Dt<B>, rstd: Dt<B>, dy: Dt<B>) -> (Dt<B>, Dt<B>) {
        const OP: &str = "fused_rms_norm_backward";
        let x = rows(OP, x);
        let dtype = dtype_of(&x);
        let gamma = param(OP, gamma, dtype);
        let (rstd, dy) = (like(OP, rstd, &x.layout), like(OP, dy, &x.layout));
        let rank = x.shape.num_dims();
        let (dx, dgamma) = if widened(OP, &x, &dy) {
            B::fused_rms_norm_backward_any([x.local, gamma, rstd, dy])
        } else {
            let dy = rules::cast_local(OP, &x.device, dy, dtype);
            B::fused_rms_norm_backward(x.local, gamma, rstd, dy)
        };
        let dgamma = rules::to_master(OP, &x.meta.device, dgamma);
        (
            wrap(dx, x.meta.layout.clone(), x.meta.device.clone()),
            column_grad(dgamma, &x.meta.layout, rank, x.meta.device.clone()),
        )
    }

    fn fused_cross_entropy(logits: Dt<B>, targets: IntTensor<B>) -> CrossEntropyOutput<Self> {
        const OP: &str = "fused_cross_entropy";
        let logits = rules::unpadded(logits.settled());
        let target = without_partials(&logits.layout, |_| false);
        if !unsharded_rows(&target) {
            // Vocabulary-parallel: Burn ops in the logits' dtype, the loss in f32 as below.
            let mut out = reference::cross_entropy::<Self>(logits, targets);
            if rules::compute_dtype(&out.loss.device).is_some() {
                out.loss = rules::float_cast(out.loss, rules::MASTER_DTYPE);
            }
            return out;
        }
        let logits = to_layout(OP, logits, &target);
        let out = B::fused_cross_entropy(logits.local, targets);
        // The kernels compute in f32 whatever the logits' dtype; the loss goes on in f32.
        let loss = rules::to_master(OP, &logits.meta.device, out.loss);
        CrossEntropyOutput {
            loss: wrap(loss, logits.meta.layout.clone(), logits.meta.device.clone()),
            lse: wrap(
                out.lse,
                logits.meta.layout.clone(),
                logits.meta.device.clone(),
            ),
        }
    }

    fn fused_cross_entropy_backward(
        logits: Dt<B>,
        targets: IntTensor<B>,
        lse: Dt<B>,
        dloss: Dt<B>,
    ) -> Dt<B> {
        const OP: &str = "fused_cross_entropy_backward";
        let logits = rules::unpadded(logits.settled());
        let target = without_partials(&logits.layout, |_| false);
        if !unsharded_rows(&target) {
            return reference::cross_entropy_backward::<Self>(logits, targets, lse, dloss);
        }
        let logits = to_layout(OP, logits, &target);
        let (lse, dloss) = (
            like(OP, lse, &logits.layout),
            like(OP, dloss, &logits.layout),
        );
        let dloss = rules::cast_local(OP, &logits.device, dloss, dtype_of(&logits));
        let dx = B::fused_cross_entropy_backward(logits.local, targets, lse, dloss);
        wrap(dx, logits.meta.layout.clone(), logits.meta.device.clone())
    }

    fn fused_embedding(table: Dt<B>, ids: IntTensor<B>) -> Dt<B> {
        rules::embedding::<B>(rules::param_operand(table), ids)
    }

    fn fused_embedding_backward(table: Dt<B>, grad: Dt<B>, ids: IntTensor<B>) -> Dt<B> {
        rules::embedding_backward_with::<B>(
            rules::param_operand(table),
            rules::unpadded(grad),
            ids,
            B::fused_embedding_backward,
        )
    }

    fn fused_gelu_bias(x: Dt<B>, bias: Dt<B>, tanh: bool) -> Dt<B> {
        const OP: &str = "fused_gelu_bias";
        let (x, bias) = gelu_operands(OP, x, bias);
        let y = B::fused_gelu_bias(x.local, bias, tanh);
        wrap(y, x.meta.layout.clone(), x.meta.device.clone())
    }

    fn fused_gelu_bias_backward(x: Dt<B>, bias: Dt<B>, dy: Dt<B>, tanh: bool) -> (Dt<B>, Dt<B>) {
        const OP: &str = "fused_gelu_bias_backward";
        let (x, bias) = gelu_operands(OP, x, bias);
        let dy = like(OP, dy, &x.layout);
        let rank = x.shape.num_dims();
        let dy = rules::cast_local(OP, &x.device, dy, dtype_of(&x));
        let (dx, dbias) = B::fused_gelu_bias_backward(x.local, bias, dy, tanh);
        let dbias = rules::to_master(OP, &x.meta.device, dbias);
        (
            wrap(dx, x.meta.layout.clone(), x.meta.device.clone()),
            column_grad(dbias, &x.meta.layout, rank, x.meta.device.clone()),
        )
    }

    fn fused_swiglu(gate: Dt<B>, up: Dt<B>) -> Dt<B> {
        const OP: &str = "fused_swiglu";
        let (gate, up) = swiglu_operands(OP, gate, up);
        let y = B::fused_swiglu(gate.local, up);
        wrap(y, gate.meta.layout.clone(), gate.meta.device.clone())
    }

    fn fused_swiglu_backward(gate: Dt<B>, up: Dt<B>, dy: Dt<B>) -> (Dt<B>, Dt<B>) {
        const OP: &str = "fused_swiglu_backward";
        let (gate, up) = swiglu_operands(OP, gate, up);
        let dy = like(OP, dy, &gate.layout);
        let dy = rules::cast_local(OP, &gate.device, dy, dtype_of(&gate));
        let (dgate, dup) = B::fused_swiglu_backward(gate.local, up, dy);
        (
            wrap(dgate, gate.meta.layout.clone(), gate.meta.device.clone()),
            wrap(dup, gate.meta.layout.clone(), gate.meta.device.clone()),
        )
    }

    fn fused_rope(x: Dt<B>, cos: Dt<B>, sin: Dt<B>) -> Dt<B> {
        rope_op("fused_rope", x, cos, sin, B::fused_rope)
    }

    fn fused_rope_backward(dy: Dt<B>, cos: Dt<B>, sin: Dt<B>) -> Dt<B> {
        rope_op("fused_rope_backward", dy, cos, sin, B::fused_rope_backward)
    }

    fn fused_attention(
        q: Dt<B>,
        k: Dt<B>,
        v: Dt<B>,
        scale: f64,
        causal: bool,
    ) -> AttentionOutput<Self> {
        const OP: &str = "fused_attention";
        let q = rules::unpadded(q.settled());
        let layout = attention_layout(&q.layout);
        let q = to_layout(OP, q, &layout);
        let (k, v, _) = kv_operands(OP, k, v, &layout);
        let out = match Context::of(&q.device) {
            Some(ctx) => context::attention(&ctx, &q.meta.device, q.local, k, v, scale, causal),
            None => B::fused_attention(q.local, k, v, scale, causal),
        };
        AttentionOutput {
            output: wrap(out.output, layout.clone(), q.meta.device.clone()),
            lse: wrap(out.lse, layout, q.meta.device.clone()),
        }
    }

    fn fused_attention_qkv(qkv: Dt<B>, scale: f64, causal: bool) -> AttentionOutput<Self> {
        const OP: &str = "fused_attention_qkv";
        let qkv = rules::unpadded(qkv.settled());
        let layout = packed_layout(&qkv.layout);
        let qkv = to_layout(OP, qkv, &layout);
        // In the compute dtype (as `torch.autocast` runs SDPA): bf16/f16 q, k, v take the
        // kernels' tensor-core tiles, the output stays in it (it feeds the output projection),
        // the log-sum-exp is f32.
        let qkv_local = match rules::compute_dtype(&qkv.device) {
            Some(c) => qkv.local_in(OP, c),
            None => qkv.local,
        };
        let out = match Context::of(&qkv.meta.device) {
            Some(ctx) => packed_context(&ctx, &qkv.meta.device, qkv_local, scale, causal),
            None => B::fused_attention_qkv(qkv_local, scale, causal),
        };
        AttentionOutput {
            output: wrap(out.output, layout.clone(), qkv.meta.device.clone()),
            lse: wrap(out.lse, layout, qkv.meta.device.clone()),
        }
    }

    fn fused_attention_qkv_backward(
        qkv: Dt<B>,
        output: Dt<B>,
        lse: Dt<B>,
        d_output: Dt<B>,
        scale: f64,
        causal: bool,
    ) -> Dt<B> {
        const OP: &str = "fused_attention_qkv_backward";
        let qkv = rules::unpadded(qkv.settled());
        let layout = packed_layout(&qkv.layout);
        let qkv = to_layout(OP, qkv, &layout);
        let (o, lse, d_o) = (
            like(OP, output, &layout),
            like(OP, lse, &layout),
            like(OP, d_output, &layout),
        );
        // The forward's dtype: the compute dtype under the precision policy (the gradient stays
        // in it), the operands' own otherwise.
        let dtype = rules::compute_dtype(&qkv.device).unwrap_or(dtype_of(&qkv));
        let dev = qkv.device.clone();
        let (o, d_o) = (
            rules::cast_local(OP, &dev, o, dtype),
            rules::cast_local(OP, &dev, d_o, dtype),
        );
        let qkv_local = qkv.local_in(OP, dtype);
        let g = match Context::of(&dev) {
            Some(ctx) => {
                packed_context_backward(&ctx, &dev, qkv_local, [o, lse, d_o], scale, causal)
            }
            None => B::fused_attention_qkv_backward(qkv_local, o, lse, d_o, scale, causal),
        };
        wrap(g, layout, dev)
    }

    fn fused_attention_backward(
        q: Dt<B>,
        k: Dt<B>,
        v: Dt<B>,
        output: Dt<B>,
        lse: Dt<B>,
        d_output: Dt<B>,
        scale: f64,
        causal: bool,
    ) -> AttentionGrads<Self> {
        const OP: &str = "fused_attention_backward";
        let q = rules::unpadded(q.settled());
        let layout = attention_layout(&q.layout);
        let q = to_layout(OP, q, &layout);
        let (k, v, replica) = kv_operands(OP, k, v, &layout);
        let (o, lse, d_o) = (
            like(OP, output, &layout),
            like(OP, lse, &layout),
            like(OP, d_output, &layout),
        );
        let dev = q.device.clone();
        let g = match Context::of(&dev) {
            Some(ctx) => {
                context::attention_backward(&ctx, &dev, q.local, k, v, o, lse, d_o, scale, causal)
            }
            None => B::fused_attention_backward(q.local, k, v, o, lse, d_o, scale, causal),
        };
        let (dk, dv) = match replica {
            None => (
                wrap(g.k, layout.clone(), dev.clone()),
                wrap(g.v, layout.clone(), dev.clone()),
            ),
            Some(r) => (r.gradient(g.k, &dev), r.gradient(g.v, &dev)),
        };
        AttentionGrads {
            q: wrap(g.q, layout, dev),
            k: dk,
            v: dv,
        }
    }
}

/// Grouped key/value heads that the axis sharding the query heads cannot split (more members
/// than key/value heads: Megatron's and vLLM's replication of key/value heads when tp exceeds
/// their count). The key/value projections are replicated over that axis; each member reads
/// the one key/value head its query heads share, and its key/value gradients are its summand of
/// the whole (`Partial(Sum)` over the axis, zero at the other heads).
struct KvReplica {
    /// The key/value operands' layout: the query's, with the head axis replicated.
    layout: Layout,
    /// The head axis.
    axis: usize,
    /// This member's key/value head, of `heads`.
    head: usize,
    heads: usize,
}

impl KvReplica {
    /// For queries laid out as `layout` (heads `Shard(1)` on exactly one axis of `n` members)
    /// against `heads` key/value heads: `Some` when `n` is a multiple of `heads` larger than it.
    fn of<B: FusedOps>(
        layout: &Layout,
        device: &crate::DistDevice<B>,
        heads: usize,
    ) -> Option<Self> {
        let mesh = device.mesh();
        let axes: Vec<usize> = (0..layout.len())
            .filter(|&a| layout.get(a) == Placement::Shard(1) && mesh.axis_size(a) > 1)
            .collect();
        let &[axis] = axes.as_slice() else {
            return None;
        };
        let n = mesh.axis_size(axis);
        if heads == 0 || heads >= n || !n.is_multiple_of(heads) {
            return None;
        }
        let mut kv_layout = layout.clone();
        kv_layout.set(axis, Placement::Replicate);
        let member = mesh.coords(device.rank())[axis];
        Some(Self {
            layout: kv_layout,
            axis,
            head: member / (n / heads),
            heads,
        })
    }

    /// This member's key/value head of `t` (laid out as `self.layout`).
    fn select<B: FusedOps>(&self, t: B::FloatTensorPrimitive) -> B::FloatTensorPrimitive {
        let mut slices = vec![burn_backend::Slice::full(); 4];
        slices[1] = burn_backend::Slice::from(self.head..self.head + 1);
        B::float_slice(t, &slices)
    }

    /// A gradient of the selected head, as this member's summand of the whole key/value
    /// gradient: zeros at the other heads, `Partial(Sum)` over the head axis.
    fn gradient<B: FusedOps>(
        &self,
        g: B::FloatTensorPrimitive,
        device: &crate::DistDevice<B>,
    ) -> Dt<B> {
        let (shape, local) = (g.shape(), B::float_device(&g));
        let dtype: FloatDType = g.dtype().into();
        let zeros = |n: usize| {
            let mut dims = shape.to_vec();
            dims[1] = n;
            B::float_zeros(dims.into(), &local, dtype)
        };
        let parts = [zeros(self.head), g, zeros(self.heads - self.head - 1)]
            .into_iter()
            .filter(|t| t.shape()[1] > 0)
            .collect();
        let mut layout = self.layout.clone();
        layout.set(self.axis, Placement::Partial(crate::comm::ReduceOp::Sum));
        wrap(B::float_cat(parts, 1), layout, device.clone())
    }
}

/// Keys and values for queries laid out as `layout`: in the same layout, or (see
/// [`KvReplica`]) whole on the head axis and narrowed to this member's head.
fn kv_operands<B: FusedOps>(
    op: &'static str,
    k: Dt<B>,
    v: Dt<B>,
    layout: &Layout,
) -> (
    B::FloatTensorPrimitive,
    B::FloatTensorPrimitive,
    Option<KvReplica>,
) {
    let heads = k.shape[1];
    match KvReplica::of(layout, &k.device, heads) {
        None => (like(op, k, layout), like(op, v, layout), None),
        Some(r) => {
            let (k, v) = (like(op, k, &r.layout), like(op, v, &r.layout));
            (r.select::<B>(k), r.select::<B>(v), Some(r))
        }
    }
}

/// The SwiGLU operands: `gate` without partials, `up` in its layout and dtype.
fn swiglu_operands<B: FusedOps>(
    op: &'static str,
    gate: Dt<B>,
    up: Dt<B>,
) -> (Dt<B>, B::FloatTensorPrimitive) {
    let gate = rules::unpadded(gate.settled());
    let target = without_partials(&gate.layout, |_| false);
    let gate = to_layout(op, gate, &target);
    let up = like(op, up, &gate.layout);
    let up = rules::cast_local(op, &gate.device, up, dtype_of(&gate));
    (gate, up)
}

/// The rotary embedding (or its gradient map) on `x`'s batch and head shards, positions and
/// head dims whole, the tables whole in `x`'s dtype.
fn rope_op<B: FusedOps>(
    op: &'static str,
    x: Dt<B>,
    cos: Dt<B>,
    sin: Dt<B>,
    f: impl FnOnce(
        B::FloatTensorPrimitive,
        B::FloatTensorPrimitive,
        B::FloatTensorPrimitive,
    ) -> B::FloatTensorPrimitive,
) -> Dt<B> {
    let x = rules::unpadded(x.settled());
    let layout = attention_layout(&x.layout);
    let x = to_layout(op, x, &layout);
    let dtype = dtype_of(&x);
    let [cos, sin] = [cos, sin].map(|t| {
        let t = rules::unpadded(t.settled());
        let whole = rules::whole_param(&t.layout);
        let t = to_layout(op, t, &whole).local;
        rules::cast_local(op, &x.device, t, dtype)
    });
    wrap(f(x.local, cos, sin), layout, x.meta.device.clone())
}

/// GELU-with-bias operands: the input without partials, its channels left sharded where they are
/// (a column-parallel output), and the bias brought to the same channel shards (gathered on the
/// other axes, as a parameter).
fn gelu_operands<B: FusedOps>(
    op: &'static str,
    x: Dt<B>,
    bias: Dt<B>,
) -> (Dt<B>, B::FloatTensorPrimitive) {
    rules::check_param(op, &bias);
    let x = rules::unpadded(x.settled());
    let target = without_partials(&x.layout, |_| false);
    let x = to_layout(op, x, &target);
    let channels = last(&x);
    let mut bias_layout = rules::whole_param(&bias.layout);
    for (a, p) in x.layout.placements().iter().enumerate() {
        if *p == Placement::Shard(channels) {
            bias_layout.set(a, Placement::Shard(0));
        }
    }
    let bias = to_layout(op, rules::param_operand(bias), &bias_layout).local_in(op, dtype_of(&x));
    (x, bias)
}

/// Context-parallel attention ([`context::attention`]) on packed projections: output
/// `[b, t, h, hd]` and log-sum-exp `[b, t, h]`, as [`FusedOps::fused_attention_qkv`] gives them.
fn packed_context<B: FusedOps>(
    ctx: &Context,
    device: &crate::DistDevice<B>,
    qkv: B::FloatTensorPrimitive,
    scale: f64,
    causal: bool,
) -> AttentionOutput<B> {
    let [q, k, v] = packed::split::<B>(qkv);
    let out = context::attention(ctx, device, q, k, v, scale, causal);
    AttentionOutput {
        output: packed::swap_heads::<B, 4>(out.output),
        lse: packed::swap_heads::<B, 3>(out.lse),
    }
}

/// The gradient of [`packed_context`] w.r.t. the packed projections, packed like them;
/// `saved` is its output, log-sum-exp and output gradient, packed-shaped.
fn packed_context_backward<B: FusedOps>(
    ctx: &Context,
    device: &crate::DistDevice<B>,
    qkv: B::FloatTensorPrimitive,
    [o, lse, d_o]: [B::FloatTensorPrimitive; 3],
    scale: f64,
    causal: bool,
) -> B::FloatTensorPrimitive {
    let [q, k, v] = packed::split::<B>(qkv);
    let (o, lse, d_o) = (
        packed::swap_heads::<B, 4>(o),
        packed::swap_heads::<B, 3>(lse),
        packed::swap_heads::<B, 4>(d_o),
    );
    let g = context::attention_backward(ctx, device, q, k, v, o, lse, d_o, scale, causal);
    packed::join::<B>([g.q, g.k, g.v])
}
