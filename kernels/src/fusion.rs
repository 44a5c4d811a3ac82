//! `FusedOps` for `Fusion<B>` (Burn's default `Wgpu`/`Cuda` aliases with the `fusion` feature):
//! each fused op is one custom operation in the fusion stream, executed by `B`'s kernel when the
//! stream is flushed. Burn's fusion optimiser treats it as a boundary (it does not fuse through
//! it); everything around it still fuses.

use crate::{
    AdamWState, AdamWStep, AttentionGrads, AttentionOutput, CrossEntropyOutput, FusedOps,
    LayerNormGrads, LayerNormOutput, RmsNormOutput, UnscaleOutput, stats_shape,
};
use burn::tensor::{DType, Shape};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};
use std::marker::PhantomData;

/// Which fused op a stream entry runs, with its scalar arguments.
#[derive(Clone, Copy, Debug)]
enum Call {
    Softmax(bool),
    SoftmaxBackward(bool),
    LayerNorm(f64),
    LayerNormBackward,
    RmsNorm(f64),
    RmsNormBackward,
    /// Inputs: logits, targets (int).
    CrossEntropy,
    /// Inputs: logits, lse, dloss, targets (int).
    CrossEntropyBackward,
    /// Inputs: table (its shape), grad, ids (int).
    EmbeddingBackward,
    /// With the tanh approximation or not.
    GeluBias(bool),
    GeluBiasBackward(bool),
    SwiGlu,
    SwiGluBackward,
    /// Inputs: x (or dy), cos, sin; with `true` the backward.
    Rope(bool),
    Attention(f64, bool),
    AttentionBackward(f64, bool),
    Unscale(f64),
    AdamW(AdamWStep),
}

struct FusedCall<B> {
    desc: CustomOpIr,
    call: Call,
    _backend: PhantomData<fn() -> B>,
}

impl<B> Clone for FusedCall<B> {
    fn clone(&self) -> Self {
        Self {
            desc: self.desc.clone(),
            call: self.call,
            _backend: PhantomData,
        }
    }
}

impl<B> std::fmt::Debug for FusedCall<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FusedCall")
            .field("call", &self.call)
            .finish()
    }
}

impl<B: FusionBackend + FusedOps> Operation<B::FusionRuntime> for FusedCall<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let inputs = &self.desc.inputs;
        let mut float = |i: usize| handles.get_float_tensor::<B>(&inputs[i]);
        let outs: Vec<B::FloatTensorPrimitive> = match self.call {
            Call::Softmax(log) => {
                let x = float(0);
                vec![if log {
                    B::fused_log_softmax(x)
                } else {
                    B::fused_softmax(x)
                }]
            }
            Call::SoftmaxBackward(log) => {
                let (y, dy) = (float(0), float(1));
                vec![if log {
                    B::fused_log_softmax_backward(y, dy)
                } else {
                    B::fused_softmax_backward(y, dy)
                }]
            }
            Call::LayerNorm(eps) => {
                let o = B::fused_layer_norm(float(0), float(1), float(2), eps);
                vec![o.output, o.mean, o.rstd]
            }
            Call::LayerNormBackward => {
                let g =
                    B::fused_layer_norm_backward(float(0), float(1), float(2), float(3), float(4));
                vec![g.x, g.gamma, g.beta]
            }
            Call::RmsNorm(eps) => {
                let o = B::fused_rms_norm(float(0), float(1), eps);
                vec![o.output, o.rstd]
            }
            Call::RmsNormBackward => {
                let (dx, dg) = B::fused_rms_norm_backward(float(0), float(1), float(2), float(3));
                vec![dx, dg]
            }
            Call::CrossEntropy => {
                let logits = float(0);
                let targets = handles.get_int_tensor::<B>(&inputs[1]);
                let o = B::fused_cross_entropy(logits, targets);
                vec![o.loss, o.lse]
            }
            Call::CrossEntropyBackward => {
                let (logits, lse, dloss) = (float(0), float(1), float(2));
                let targets = handles.get_int_tensor::<B>(&inputs[3]);
                vec![B::fused_cross_entropy_backward(logits, targets, lse, dloss)]
            }
            Call::EmbeddingBackward => {
                let (table, grad) = (float(0), float(1));
                let ids = handles.get_int_tensor::<B>(&inputs[2]);
                vec![B::fused_embedding_backward(table, grad, ids)]
            }
            Call::GeluBias(tanh) => vec![B::fused_gelu_bias(float(0), float(1), tanh)],
            Call::GeluBiasBackward(tanh) => {
                let (dx, db) = B::fused_gelu_bias_backward(float(0), float(1), float(2), tanh);
                vec![dx, db]
            }
            Call::SwiGlu => vec![B::fused_swiglu(float(0), float(1))],
            Call::SwiGluBackward => {
                let (dg, du) = B::fused_swiglu_backward(float(0), float(1), float(2));
                vec![dg, du]
            }
            Call::Rope(backward) => {
                let (x, cos, sin) = (float(0), float(1), float(2));
                vec![if backward {
                    B::fused_rope_backward(x, cos, sin)
                } else {
                    B::fused_rope(x, cos, sin)
                }]
            }
            Call::Attention(scale, causal) => {
                let o = B::fused_attention(float(0), float(1), float(2), scale, causal);
                vec![o.output, o.lse]
            }
            Call::AttentionBackward(scale, causal) => {
                let (q, k, v, o, lse, d_o) =
                    (float(0), float(1), float(2), float(3), float(4), float(5));
                let g = B::fused_attention_backward(q, k, v, o, lse, d_o, scale, causal);
                vec![g.q, g.k, g.v]
            }
            Call::Unscale(inv_scale) => {
                let o = B::fused_unscale(float(0), inv_scale);
                vec![o.grad, o.sum_squares, o.non_finite]
            }
            Call::AdamW(step) => {
                let (p, g, m, v, gs, skip) =
                    (float(0), float(1), float(2), float(3), float(4), float(5));
                let o = B::fused_adamw(p, g, m, v, gs, skip, step);
                vec![o.param, o.m, o.v]
            }
        };
        for (ir, tensor) in self.desc.outputs.iter().zip(outs) {
            handles.register_float_tensor::<B>(&ir.id, tensor);
        }
    }
}

type Ft<B> = FusionTensor<<B as FusionBackend>::FusionRuntime>;

/// Register one fused op in the stream: float inputs, then an optional int input, and outputs of
/// the given shapes and dtypes.
fn register<B: FusionBackend + FusedOps>(
    call: Call,
    floats: Vec<Ft<B>>,
    int: Option<Ft<B>>,
    outputs: &[(Shape, DType)],
) -> Vec<Ft<B>> {
    let client = floats[0].client.clone();
    let streams = OperationStreams::with_inputs(floats.iter().chain(int.iter()));
    let mut inputs: Vec<TensorIr> = floats.into_iter().map(|t| t.into_ir()).collect();
    inputs.extend(int.map(|t| t.into_ir()));
    let outputs: Vec<TensorIr> = outputs
        .iter()
        .map(|(shape, dtype)| TensorIr::uninit(client.create_empty_handle(), shape.clone(), *dtype))
        .collect();
    let desc = CustomOpIr::new("wildfire_fused", &inputs, &outputs);
    client.register(
        streams,
        OperationIr::Custom(desc.clone()),
        FusedCall::<B> {
            desc,
            call,
            _backend: PhantomData,
        },
    )
}

fn take<const N: usize, T: std::fmt::Debug>(v: Vec<T>) -> [T; N] {
    v.try_into().expect("the fused op registered its outputs")
}

/// The dtype of per-row statistics and reductions: f32 from kernels, the input's otherwise.
fn stats<B: FusedOps>(input: DType) -> DType {
    if B::FUSED.any() { DType::F32 } else { input }
}

fn meta<B: FusionBackend>(t: &Ft<B>) -> (Shape, DType) {
    (t.shape.clone(), t.dtype)
}

/// Register an op whose one output has the shape and dtype of its first float input.
fn like_first<B: FusionBackend + FusedOps>(
    call: Call,
    floats: Vec<Ft<B>>,
    int: Option<Ft<B>>,
) -> Ft<B> {
    let out = meta::<B>(&floats[0]);
    let [y] = take(register::<B>(call, floats, int, &[out]));
    y
}

impl<B: FusionBackend + FusedOps> FusedOps for Fusion<B> {
    const FUSED: crate::Fused = B::FUSED;
    const COMPUTES_ON_HOST_POOL: bool = B::COMPUTES_ON_HOST_POOL;

    fn sequence_positions(device: &burn::tensor::Device<Self>, len: usize) -> Vec<usize> {
        B::sequence_positions(device, len)
    }

    fn fused_softmax(x: Ft<B>) -> Ft<B> {
        like_first::<B>(Call::Softmax(false), vec![x], None)
    }

    fn fused_softmax_backward(y: Ft<B>, dy: Ft<B>) -> Ft<B> {
        like_first::<B>(Call::SoftmaxBackward(false), vec![y, dy], None)
    }

    fn fused_log_softmax(x: Ft<B>) -> Ft<B> {
        like_first::<B>(Call::Softmax(true), vec![x], None)
    }

    fn fused_log_softmax_backward(y: Ft<B>, dy: Ft<B>) -> Ft<B> {
        like_first::<B>(Call::SoftmaxBackward(true), vec![y, dy], None)
    }

    fn fused_layer_norm(
        x: Ft<B>,
        gamma: Ft<B>,
        beta: Ft<B>,
        epsilon: f64,
    ) -> LayerNormOutput<Self> {
        let (shape, dtype) = meta::<B>(&x);
        let st = (stats_shape(&shape), stats::<B>(dtype));
        let [output, mean, rstd] = take(register::<B>(
            Call::LayerNorm(epsilon),
            vec![x, gamma, beta],
            None,
            &[(shape, dtype), st.clone(), st],
        ));
        LayerNormOutput { output, mean, rstd }
    }

    fn fused_layer_norm_backward(
        x: Ft<B>,
        gamma: Ft<B>,
        mean: Ft<B>,
        rstd: Ft<B>,
        dy: Ft<B>,
    ) -> LayerNormGrads<Self> {
        let (xm, gm) = (meta::<B>(&x), meta::<B>(&gamma));
        let [x, gamma, beta] = take(register::<B>(
            Call::LayerNormBackward,
            vec![x, gamma, mean, rstd, dy],
            None,
            &[xm, gm.clone(), gm],
        ));
        LayerNormGrads { x, gamma, beta }
    }

    fn fused_rms_norm(x: Ft<B>, gamma: Ft<B>, epsilon: f64) -> RmsNormOutput<Self> {
        let (shape, dtype) = meta::<B>(&x);
        let st = (stats_shape(&shape), stats::<B>(dtype));
        let [output, rstd] = take(register::<B>(
            Call::RmsNorm(epsilon),
            vec![x, gamma],
            None,
            &[(shape, dtype), st],
        ));
        RmsNormOutput { output, rstd }
    }

    fn fused_rms_norm_backward(x: Ft<B>, gamma: Ft<B>, rstd: Ft<B>, dy: Ft<B>) -> (Ft<B>, Ft<B>) {
        let (xm, gm) = (meta::<B>(&x), meta::<B>(&gamma));
        let [dx, dg] = take(register::<B>(
            Call::RmsNormBackward,
            vec![x, gamma, rstd, dy],
            None,
            &[xm, gm],
        ));
        (dx, dg)
    }

    fn fused_cross_entropy(logits: Ft<B>, targets: Ft<B>) -> CrossEntropyOutput<Self> {
        let (shape, dtype) = meta::<B>(&logits);
        let rows = Shape::new([shape[0]]);
        let [loss, lse] = take(register::<B>(
            Call::CrossEntropy,
            vec![logits],
            Some(targets),
            &[(rows.clone(), dtype), (rows, stats::<B>(dtype))],
        ));
        CrossEntropyOutput { loss, lse }
    }

    fn fused_cross_entropy_backward(
        logits: Ft<B>,
        targets: Ft<B>,
        lse: Ft<B>,
        dloss: Ft<B>,
    ) -> Ft<B> {
        like_first::<B>(
            Call::CrossEntropyBackward,
            vec![logits, lse, dloss],
            Some(targets),
        )
    }

    fn fused_embedding_backward(table: Ft<B>, grad: Ft<B>, ids: Ft<B>) -> Ft<B> {
        let out = (
            Shape::new([table.shape[0], grad.shape[grad.shape.num_dims() - 1]]),
            grad.dtype,
        );
        let [dtable] = take(register::<B>(
            Call::EmbeddingBackward,
            vec![table, grad],
            Some(ids),
            &[out],
        ));
        dtable
    }

    fn fused_gelu_bias(x: Ft<B>, bias: Ft<B>, tanh: bool) -> Ft<B> {
        like_first::<B>(Call::GeluBias(tanh), vec![x, bias], None)
    }

    fn fused_gelu_bias_backward(x: Ft<B>, bias: Ft<B>, dy: Ft<B>, tanh: bool) -> (Ft<B>, Ft<B>) {
        let (xm, bm) = (meta::<B>(&x), meta::<B>(&bias));
        let [dx, db] = take(register::<B>(
            Call::GeluBiasBackward(tanh),
            vec![x, bias, dy],
            None,
            &[xm, bm],
        ));
        (dx, db)
    }

    fn fused_swiglu(gate: Ft<B>, up: Ft<B>) -> Ft<B> {
        like_first::<B>(Call::SwiGlu, vec![gate, up], None)
    }

    fn fused_swiglu_backward(gate: Ft<B>, up: Ft<B>, dy: Ft<B>) -> (Ft<B>, Ft<B>) {
        let (gm, um) = (meta::<B>(&gate), meta::<B>(&up));
        let [dg, du] = take(register::<B>(
            Call::SwiGluBackward,
            vec![gate, up, dy],
            None,
            &[gm, um],
        ));
        (dg, du)
    }

    fn fused_rope(x: Ft<B>, cos: Ft<B>, sin: Ft<B>) -> Ft<B> {
        like_first::<B>(Call::Rope(false), vec![x, cos, sin], None)
    }

    fn fused_rope_backward(dy: Ft<B>, cos: Ft<B>, sin: Ft<B>) -> Ft<B> {
        like_first::<B>(Call::Rope(true), vec![dy, cos, sin], None)
    }

    fn fused_attention(
        q: Ft<B>,
        k: Ft<B>,
        v: Ft<B>,
        scale: f64,
        causal: bool,
    ) -> AttentionOutput<Self> {
        let (shape, dtype) = meta::<B>(&q);
        let lse = Shape::new([shape[0], shape[1], shape[2]]);
        let [output, lse] = take(register::<B>(
            Call::Attention(scale, causal),
            vec![q, k, v],
            None,
            &[(shape, dtype), (lse, stats::<B>(dtype))],
        ));
        AttentionOutput { output, lse }
    }

    fn fused_attention_backward(
        q: Ft<B>,
        k: Ft<B>,
        v: Ft<B>,
        output: Ft<B>,
        lse: Ft<B>,
        d_output: Ft<B>,
        scale: f64,
        causal: bool,
    ) -> AttentionGrads<Self> {
        let (qm, km, vm) = (meta::<B>(&q), meta::<B>(&k), meta::<B>(&v));
        let [q, k, v] = take(register::<B>(
            Call::AttentionBackward(scale, causal),
            vec![q, k, v, output, lse, d_output],
            None,
            &[qm, km, vm],
        ));
        AttentionGrads { q, k, v }
    }

    fn fused_unscale(grad: Ft<B>, inv_scale: f64) -> UnscaleOutput<Self> {
        let (shape, dtype) = meta::<B>(&grad);
        let one = (Shape::new([1]), stats::<B>(dtype));
        let [grad, sum_squares, non_finite] = take(register::<B>(
            Call::Unscale(inv_scale),
            vec![grad],
            None,
            &[(shape, dtype), one.clone(), one],
        ));
        UnscaleOutput {
            grad,
            sum_squares,
            non_finite,
        }
    }

    fn fused_adamw(
        param: Ft<B>,
        grad: Ft<B>,
        m: Ft<B>,
        v: Ft<B>,
        grad_scale: Ft<B>,
        skip: Ft<B>,
        step: AdamWStep,
    ) -> AdamWState<Self> {
        let out = meta::<B>(&param);
        let [param, m, v] = take(register::<B>(
            Call::AdamW(step),
            vec![param, grad, m, v, grad_scale, skip],
            None,
            &[out.clone(), out.clone(), out],
        ));
        AdamWState { param, m, v }
    }
}
