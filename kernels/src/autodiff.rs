//! `FusedOps` for `Autodiff<B>`: each fused forward is one graph node whose backward calls `B`'s
//! fused backward (a kernel where `B` has one). The nodes keep what the kernels need — the
//! softmax output, the norms' input and per-row statistics, the logits and per-row log-sum-exp
//! (never the probabilities), attention's q, k, v (or packed qkv), output and log-sum-exp (never
//! the scores).

use crate::{AttentionOutput, CrossEntropyOutput, FusedOps, LayerNormOutput, RmsNormOutput};
use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::ops::{FloatTensor, IntTensor};

/// Register a gradient for a parent when that parent is tracked (the node type is private to
/// burn-autodiff, hence a macro).
macro_rules! register {
    ($B:ty, $grads:expr, $parent:expr, $grad:expr) => {
        if let Some(node) = $parent {
            $grads.register::<$B>(node.id, $grad);
        }
    };
}

#[derive(Debug)]
struct SoftmaxOp {
    log: bool,
}

impl<B: FusedOps> Backward<B, 1> for SoftmaxOp {
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let dx = if self.log {
            B::fused_log_softmax_backward(ops.state, dy)
        } else {
            B::fused_softmax_backward(ops.state, dy)
        };
        register!(B, grads, &ops.parents[0], dx);
    }
}

fn softmax<B: FusedOps, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    log: bool,
) -> FloatTensor<Autodiff<B, C>> {
    let y = if log {
        B::fused_log_softmax(x.primitive)
    } else {
        B::fused_softmax(x.primitive)
    };
    match (SoftmaxOp { log })
        .prepare::<C>([x.node])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(y.clone(), y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

#[derive(Debug)]
struct LayerNormOp;

impl<B: FusedOps> Backward<B, 3> for LayerNormOp {
    /// x, γ, mean, rstd.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let (x, gamma, mean, rstd) = ops.state;
        let g = B::fused_layer_norm_backward(x, gamma, mean, rstd, dy);
        let [px, pg, pb] = &ops.parents;
        register!(B, grads, px, g.x);
        register!(B, grads, pg, g.gamma);
        register!(B, grads, pb, g.beta);
    }
}

#[derive(Debug)]
struct RmsNormOp;

impl<B: FusedOps> Backward<B, 2> for RmsNormOp {
    /// x, γ, rstd.
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let (x, gamma, rstd) = ops.state;
        let (dx, dgamma) = B::fused_rms_norm_backward(x, gamma, rstd, dy);
        let [px, pg] = &ops.parents;
        register!(B, grads, px, dx);
        register!(B, grads, pg, dgamma);
    }
}

#[derive(Debug)]
struct CrossEntropyOp;

impl<B: FusedOps> Backward<B, 1> for CrossEntropyOp {
    /// logits, targets, lse.
    type State = (FloatTensor<B>, IntTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dloss = grads.consume::<B>(&ops.node);
        let (logits, targets, lse) = ops.state;
        let dx = B::fused_cross_entropy_backward(logits, targets, lse, dloss);
        register!(B, grads, &ops.parents[0], dx);
    }
}

#[derive(Debug)]
struct EmbeddingOp;

impl<B: FusedOps> Backward<B, 1> for EmbeddingOp {
    /// table (its shape is what the backward reads), ids.
    type State = (FloatTensor<B>, IntTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let (table, ids) = ops.state;
        let dtable = B::fused_embedding_backward(table, dy, ids);
        register!(B, grads, &ops.parents[0], dtable);
    }
}

/// With the tanh approximation or not.
#[derive(Debug)]
struct GeluBiasOp(bool);

impl<B: FusedOps> Backward<B, 2> for GeluBiasOp {
    /// x, bias.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let (x, bias) = ops.state;
        let (dx, dbias) = B::fused_gelu_bias_backward(x, bias, dy, self.0);
        let [px, pb] = &ops.parents;
        register!(B, grads, px, dx);
        register!(B, grads, pb, dbias);
    }
}

#[derive(Debug)]
struct SwiGluOp;

impl<B: FusedOps> Backward<B, 2> for SwiGluOp {
    /// gate, up.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let (gate, up) = ops.state;
        let (dgate, dup) = B::fused_swiglu_backward(gate, up, dy);
        let [pg, pu] = &ops.parents;
        register!(B, grads, pg, dgate);
        register!(B, grads, pu, dup);
    }
}

/// The rotary tables are constants: `x` is the one parent.
#[derive(Debug)]
struct RopeOp;

impl<B: FusedOps> Backward<B, 1> for RopeOp {
    /// cos, sin.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let (cos, sin) = ops.state;
        register!(
            B,
            grads,
            &ops.parents[0],
            B::fused_rope_backward(dy, cos, sin)
        );
    }
}

#[derive(Debug)]
struct AttentionOp {
    scale: f64,
    causal: bool,
}

impl<B: FusedOps> Backward<B, 3> for AttentionOp {
    /// q, k, v, output, lse.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let d_o = grads.consume::<B>(&ops.node);
        let (q, k, v, o, lse) = ops.state;
        let g = B::fused_attention_backward(q, k, v, o, lse, d_o, self.scale, self.causal);
        let [pq, pk, pv] = &ops.parents;
        register!(B, grads, pq, g.q);
        register!(B, grads, pk, g.k);
        register!(B, grads, pv, g.v);
    }
}

#[derive(Debug)]
struct AttentionQkvOp {
    scale: f64,
    causal: bool,
}

impl<B: FusedOps> Backward<B, 1> for AttentionQkvOp {
    /// qkv, output, lse.
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let d_o = grads.consume::<B>(&ops.node);
        let (qkv, o, lse) = ops.state;
        let g = B::fused_attention_qkv_backward(qkv, o, lse, d_o, self.scale, self.causal);
        register!(B, grads, &ops.parents[0], g);
    }
}

/// `x` carrying an auxiliary loss: its gradient passes through, the loss's is the weight.
#[derive(Debug)]
struct AuxiliaryLossOp {
    weight: f64,
}

impl<B: FusedOps> Backward<B, 2> for AuxiliaryLossOp {
    /// The auxiliary loss's shape and dtype.
    type State = (burn::tensor::Shape, burn::tensor::DType);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let [px, paux] = &ops.parents;
        if let Some(node) = paux {
            let (shape, dtype) = ops.state;
            let device = B::float_device(&dy);
            let weight = B::float_full(shape, self.weight.into(), &device, dtype.into());
            grads.register::<B>(node.id, weight);
        }
        register!(B, grads, px, dy);
    }
}

/// Expert parallelism's dispatch (`combine: false`) or combine: backward is the other
/// direction's gradient op.
#[derive(Debug)]
struct ExpertExchangeOp {
    route: crate::experts::ExpertRoute,
    combine: bool,
}

impl<B: FusedOps> Backward<B, 1> for ExpertExchangeOp {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let dx = if self.combine {
            B::expert_combine_backward(dy, &self.route)
        } else {
            B::expert_dispatch_backward(dy, &self.route)
        };
        register!(B, grads, &ops.parents[0], dx);
    }
}

fn expert_exchange<B: FusedOps, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    route: &crate::experts::ExpertRoute,
    combine: bool,
) -> FloatTensor<Autodiff<B, C>> {
    let y = if combine {
        B::expert_combine(x.primitive, route)
    } else {
        B::expert_dispatch(x.primitive, route)
    };
    let op = ExpertExchangeOp {
        route: route.clone(),
        combine,
    };
    match op.prepare::<C>([x.node]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish((), y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

/// The experts' grouped matmul: backward is `B`'s grouped backward on the saved operands.
#[derive(Debug)]
struct GroupedMatmulOp {
    groups: Vec<usize>,
}

impl<B: FusedOps> Backward<B, 2> for GroupedMatmulOp {
    /// x, w.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let (x, w) = ops.state;
        let (dx, dw) = B::grouped_matmul_backward(x, w, dy, &self.groups);
        let [px, pw] = &ops.parents;
        register!(B, grads, px, dx);
        register!(B, grads, pw, dw);
    }
}

/// An untracked autodiff tensor (the per-row statistics handed back to callers).
fn constant<B: FusedOps, C: CheckpointStrategy>(x: FloatTensor<B>) -> FloatTensor<Autodiff<B, C>> {
    <Autodiff<B, C> as burn::tensor::backend::AutodiffBackend>::from_inner(x)
}

impl<B: FusedOps, C: CheckpointStrategy> FusedOps for Autodiff<B, C> {
    const FUSED: crate::Fused = B::FUSED;
    const COMPUTES_ON_HOST_POOL: bool = B::COMPUTES_ON_HOST_POOL;

    fn sequence_positions(device: &burn::tensor::Device<Self>, len: usize) -> Vec<usize> {
        B::sequence_positions(device, len)
    }

    fn carry_loss(x: FloatTensor<Self>, loss: FloatTensor<Self>, w: f64) -> FloatTensor<Self> {
        use burn::tensor::TensorMetadata;
        let state = (loss.primitive.shape(), loss.primitive.dtype());
        match (AuxiliaryLossOp { weight: w })
            .prepare::<C>([x.node, loss.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, x.primitive),
            OpsKind::UnTracked(prep) => prep.finish(x.primitive),
        }
    }

    fn expert_axis(device: &burn::tensor::Device<Self>) -> (usize, usize) {
        B::expert_axis(device)
    }

    fn expert_counts(device: &burn::tensor::Device<Self>, counts: &[usize]) -> Vec<usize> {
        B::expert_counts(device, counts)
    }

    fn data_sum(device: &burn::tensor::Device<Self>, values: &[usize]) -> Vec<usize> {
        B::data_sum(device, values)
    }

    fn expert_dispatch(
        x: FloatTensor<Self>,
        route: &crate::experts::ExpertRoute,
    ) -> FloatTensor<Self> {
        expert_exchange::<B, C>(x, route, false)
    }

    fn expert_combine(
        y: FloatTensor<Self>,
        route: &crate::experts::ExpertRoute,
    ) -> FloatTensor<Self> {
        expert_exchange::<B, C>(y, route, true)
    }

    fn grouped_matmul(
        rows: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        groups: &[usize],
    ) -> FloatTensor<Self> {
        let (x, w) = (rows, weights);
        let y = B::grouped_matmul(x.primitive.clone(), w.primitive.clone(), groups);
        let op = GroupedMatmulOp {
            groups: groups.to_vec(),
        };
        match op.prepare::<C>([x.node, w.node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((x.primitive, w.primitive), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        softmax::<B, C>(x, false)
    }

    fn fused_log_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        softmax::<B, C>(x, true)
    }

    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> LayerNormOutput<Self> {
        let out = B::fused_layer_norm(
            x.primitive.clone(),
            gamma.primitive.clone(),
            beta.primitive,
            epsilon,
        );
        let output = match LayerNormOp
            .prepare::<C>([x.node, gamma.node, beta.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                (
                    x.primitive,
                    gamma.primitive,
                    out.mean.clone(),
                    out.rstd.clone(),
                ),
                out.output,
            ),
            OpsKind::UnTracked(prep) => prep.finish(out.output),
        };
        LayerNormOutput {
            output,
            mean: constant::<B, C>(out.mean),
            rstd: constant::<B, C>(out.rstd),
        }
    }

    fn fused_rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
    ) -> RmsNormOutput<Self> {
        let out = B::fused_rms_norm(x.primitive.clone(), gamma.primitive.clone(), epsilon);
        let output = match RmsNormOp
            .prepare::<C>([x.node, gamma.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                prep.finish((x.primitive, gamma.primitive, out.rstd.clone()), out.output)
            }
            OpsKind::UnTracked(prep) => prep.finish(out.output),
        };
        RmsNormOutput {
            output,
            rstd: constant::<B, C>(out.rstd),
        }
    }

    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> CrossEntropyOutput<Self> {
        let out = B::fused_cross_entropy(logits.primitive.clone(), targets.clone());
        let loss = match CrossEntropyOp
            .prepare::<C>([logits.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                prep.finish((logits.primitive, targets, out.lse.clone()), out.loss)
            }
            OpsKind::UnTracked(prep) => prep.finish(out.loss),
        };
        CrossEntropyOutput {
            loss,
            lse: constant::<B, C>(out.lse),
        }
    }

    fn fused_embedding(table: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        let y = B::fused_embedding(table.primitive.clone(), ids.clone());
        match EmbeddingOp
            .prepare::<C>([table.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((table.primitive, ids), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_gelu_bias(
        x: FloatTensor<Self>,
        b: FloatTensor<Self>,
        tanh: bool,
    ) -> FloatTensor<Self> {
        let bias = b;
        let y = B::fused_gelu_bias(x.primitive.clone(), bias.primitive.clone(), tanh);
        match GeluBiasOp(tanh)
            .prepare::<C>([x.node, bias.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((x.primitive, bias.primitive), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let y = B::fused_swiglu(gate.primitive.clone(), up.primitive.clone());
        match SwiGluOp
            .prepare::<C>([gate.node, up.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((gate.primitive, up.primitive), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_rope(
        heads: FloatTensor<Self>,
        cos_rows: FloatTensor<Self>,
        sin_rows: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let (cos, sin) = (cos_rows.primitive, sin_rows.primitive);
        let y = B::fused_rope(heads.primitive, cos.clone(), sin.clone());
        match RopeOp.prepare::<C>([heads.node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((cos, sin), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_attention_qkv(
        qkv: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> AttentionOutput<Self> {
        let out = B::fused_attention_qkv(qkv.primitive.clone(), scale, causal);
        let output = match (AttentionQkvOp { scale, causal })
            .prepare::<C>([qkv.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                (qkv.primitive, out.output.clone(), out.lse.clone()),
                out.output,
            ),
            OpsKind::UnTracked(prep) => prep.finish(out.output),
        };
        AttentionOutput {
            output,
            lse: constant::<B, C>(out.lse),
        }
    }

    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> AttentionOutput<Self> {
        let out = B::fused_attention(
            q.primitive.clone(),
            k.primitive.clone(),
            v.primitive.clone(),
            scale,
            causal,
        );
        let output = match (AttentionOp { scale, causal })
            .prepare::<C>([q.node, k.node, v.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                (
                    q.primitive,
                    k.primitive,
                    v.primitive,
                    out.output.clone(),
                    out.lse.clone(),
                ),
                out.output,
            ),
            OpsKind::UnTracked(prep) => prep.finish(out.output),
        };
        AttentionOutput {
            output,
            lse: constant::<B, C>(out.lse),
        }
    }
}
