//! The fused operations written with Burn ops: the defaults of [`FusedOps`](crate::FusedOps) on
//! backends without kernels, and the references the kernels are tested against. They
//! materialise what the kernels avoid (probabilities, the attention score matrix); the formulas
//! are the kernels' formulas.

use crate::{
    AttentionGrads, AttentionOutput, CrossEntropyOutput, LayerNormGrads, LayerNormOutput,
    RmsNormOutput,
};
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Bool, Int, Shape, Tensor, TensorMetadata, TensorPrimitive};

/// `x` viewed as `[rows, last]`, with its original shape.
fn rows<B: Backend>(x: FloatTensor<B>) -> (Tensor<B, 2>, Shape) {
    let shape = x.shape();
    let cols = shape[shape.num_dims() - 1];
    let rows = shape.num_elements() / cols.max(1);
    let x = B::float_reshape(x, Shape::new([rows, cols]));
    (Tensor::from_primitive(TensorPrimitive::Float(x)), shape)
}

fn prim<B: Backend, const D: usize>(x: Tensor<B, D>) -> FloatTensor<B> {
    x.into_primitive().tensor()
}

fn float<B: Backend, const D: usize>(x: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

fn reshaped<B: Backend, const D: usize>(x: Tensor<B, D>, shape: Shape) -> FloatTensor<B> {
    B::float_reshape(prim(x), shape)
}

/// One value per row (`[rows, 1]` → `[rows]`).
fn per_row<B: Backend>(x: Tensor<B, 2>) -> FloatTensor<B> {
    prim(x.squeeze_dim::<1>(1))
}

fn column<B: Backend>(x: FloatTensor<B>) -> Tensor<B, 2> {
    float::<B, 1>(x).unsqueeze_dim(1)
}

/// Softmax (or log-softmax) over the last dimension.
pub fn softmax<B: Backend>(x: FloatTensor<B>, log: bool) -> FloatTensor<B> {
    let (x, shape) = rows::<B>(x);
    let y = if log {
        burn::tensor::activation::log_softmax(x, 1)
    } else {
        burn::tensor::activation::softmax(x, 1)
    };
    reshaped(y, shape)
}

/// Gradient of the softmax (or log-softmax) from its output.
pub fn softmax_backward<B: Backend>(
    y: FloatTensor<B>,
    dy: FloatTensor<B>,
    log: bool,
) -> FloatTensor<B> {
    let (y, shape) = rows::<B>(y);
    let (dy, _) = rows::<B>(dy);
    let dx = if log {
        dy.clone() - y.exp() * dy.sum_dim(1)
    } else {
        y.clone() * (dy.clone() - (dy * y).sum_dim(1))
    };
    reshaped(dx, shape)
}

/// LayerNorm over the last dimension.
pub fn layer_norm<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    epsilon: f64,
) -> LayerNormOutput<B> {
    let (x, shape) = rows::<B>(x);
    let mean = x.clone().mean_dim(1);
    let centred = x - mean.clone();
    let var = centred.clone().square().mean_dim(1);
    let rstd = var.add_scalar(epsilon).sqrt().recip();
    let y = centred * rstd.clone() * float::<B, 1>(gamma).unsqueeze_dim(0)
        + float::<B, 1>(beta).unsqueeze_dim(0);
    LayerNormOutput {
        output: reshaped(y, shape),
        mean: per_row(mean),
        rstd: per_row(rstd),
    }
}

/// Gradients of the LayerNorm: with `x̂ = (x − μ)·r` and `g = dy·γ`,
/// `dx = r·(g − mean(g) − x̂·mean(g·x̂))`, `dγ = Σ dy·x̂`, `dβ = Σ dy`.
pub fn layer_norm_backward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    mean: FloatTensor<B>,
    rstd: FloatTensor<B>,
    dy: FloatTensor<B>,
) -> LayerNormGrads<B> {
    let (x, shape) = rows::<B>(x);
    let (dy, _) = rows::<B>(dy);
    let rstd = column::<B>(rstd);
    let xhat = (x - column::<B>(mean)) * rstd.clone();
    let g = dy.clone() * float::<B, 1>(gamma).unsqueeze_dim(0);
    let dx = rstd
        * (g.clone() - g.clone().mean_dim(1) - xhat.clone() * (g * xhat.clone()).mean_dim(1));
    LayerNormGrads {
        x: reshaped(dx, shape),
        gamma: prim((dy.clone() * xhat).sum_dim(0).squeeze_dim::<1>(0)),
        beta: prim(dy.sum_dim(0).squeeze_dim::<1>(0)),
    }
}

/// RMSNorm over the last dimension.
pub fn rms_norm<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    epsilon: f64,
) -> RmsNormOutput<B> {
    let (x, shape) = rows::<B>(x);
    let rstd = x.clone().square().mean_dim(1).add_scalar(epsilon).sqrt().recip();
    let y = x * rstd.clone() * float::<B, 1>(gamma).unsqueeze_dim(0);
    RmsNormOutput {
        output: reshaped(y, shape),
        rstd: per_row(rstd),
    }
}

/// Gradients of the RMSNorm: with `x̂ = x·r`, `g = dy·γ`: `dx = r·(g − x̂·mean(g·x̂))`,
/// `dγ = Σ dy·x̂`.
pub fn rms_norm_backward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    rstd: FloatTensor<B>,
    dy: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (x, shape) = rows::<B>(x);
    let (dy, _) = rows::<B>(dy);
    let rstd = column::<B>(rstd);
    let xhat = x * rstd.clone();
    let g = dy.clone() * float::<B, 1>(gamma).unsqueeze_dim(0);
    let dx = rstd * (g.clone() - xhat.clone() * (g * xhat.clone()).mean_dim(1));
    (
        reshaped(dx, shape),
        prim((dy * xhat).sum_dim(0).squeeze_dim::<1>(0)),
    )
}

/// Rows with a negative target, as a `[rows, 1]` 0/1 float mask of kept rows, and the targets
/// clamped to a valid index.
fn kept_rows<B: Backend>(targets: IntTensor<B>) -> (Tensor<B, 2>, Tensor<B, 2, Int>) {
    let targets = Tensor::<B, 1, Int>::from_primitive(targets).unsqueeze_dim::<2>(1);
    let kept = targets.clone().greater_equal_elem(0).float();
    (kept, targets.clamp_min(0))
}

/// Cross-entropy with the log-softmax: per-row loss and log-sum-exp.
pub fn cross_entropy<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
) -> CrossEntropyOutput<B> {
    let (x, _) = rows::<B>(logits);
    let (kept, index) = kept_rows::<B>(targets);
    let max = x.clone().max_dim(1);
    let lse = (x.clone() - max.clone()).exp().sum_dim(1).log() + max;
    let picked = x.gather(1, index);
    CrossEntropyOutput {
        loss: per_row((lse.clone() - picked) * kept),
        lse: per_row(lse),
    }
}

/// Gradient of the cross-entropy w.r.t. the logits.
pub fn cross_entropy_backward<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
    lse: FloatTensor<B>,
    dloss: FloatTensor<B>,
) -> FloatTensor<B> {
    let (x, shape) = rows::<B>(logits);
    let [_, vocab] = x.dims();
    let device = x.device();
    let (kept, index) = kept_rows::<B>(targets);
    let p = (x - column::<B>(lse)).exp();
    let classes = Tensor::<B, 1, Int>::arange(0..vocab as i64, &device).unsqueeze_dim::<2>(0);
    let onehot = index.equal(classes).float();
    reshaped((p - onehot) * (column::<B>(dloss) * kept), shape)
}

const FRAC_1_SQRT_2: f64 = std::f64::consts::FRAC_1_SQRT_2;
/// `1/√(2π)`.
const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// `gelu(x + bias)`, erf form.
pub fn gelu_bias<B: Backend>(x: FloatTensor<B>, bias: FloatTensor<B>) -> FloatTensor<B> {
    let (x, shape) = rows::<B>(x);
    let z = x + float::<B, 1>(bias).unsqueeze_dim(0);
    let y = z.clone() * (z.mul_scalar(FRAC_1_SQRT_2).erf().add_scalar(1.0)).mul_scalar(0.5);
    reshaped(y, shape)
}

/// Gradients of `gelu(x + bias)`: `gelu'(z) = Φ(z) + z·φ(z)`.
pub fn gelu_bias_backward<B: Backend>(
    x: FloatTensor<B>,
    bias: FloatTensor<B>,
    dy: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (x, shape) = rows::<B>(x);
    let (dy, _) = rows::<B>(dy);
    let z = x + float::<B, 1>(bias).unsqueeze_dim(0);
    let cdf = z
        .clone()
        .mul_scalar(FRAC_1_SQRT_2)
        .erf()
        .add_scalar(1.0)
        .mul_scalar(0.5);
    let pdf = z.clone().square().mul_scalar(-0.5).exp().mul_scalar(FRAC_1_SQRT_2PI);
    let dz = dy * (cdf + z * pdf);
    (
        reshaped(dz.clone(), shape),
        prim(dz.sum_dim(0).squeeze_dim::<1>(0)),
    )
}

/// The causal mask `j > i` of a `[seq, seq]` score matrix, broadcast to `[1, 1, seq, seq]`.
fn causal_mask<B: Backend>(seq_q: usize, seq_k: usize, device: &B::Device) -> Tensor<B, 4, Bool> {
    assert_eq!(
        seq_q, seq_k,
        "causal attention needs as many queries as keys ({seq_q} vs {seq_k})"
    );
    Tensor::<B, 2, Bool>::tril_mask([seq_q, seq_k], 0, device).unsqueeze::<4>()
}

/// Scaled (and masked) scores `[b, h, s_q, s_k]`.
fn scores<B: Backend>(q: &Tensor<B, 4>, k: &Tensor<B, 4>, scale: f64, causal: bool) -> Tensor<B, 4> {
    let s = q.clone().matmul(k.clone().swap_dims(2, 3)).mul_scalar(scale);
    if causal {
        let [b, h, sq, sk] = s.dims();
        let mask = causal_mask::<B>(sq, sk, &s.device()).expand([b, h, sq, sk]);
        s.mask_fill(mask, f32::NEG_INFINITY)
    } else {
        s
    }
}

/// Attention through the full score matrix.
pub fn attention<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    scale: f64,
    causal: bool,
) -> AttentionOutput<B> {
    let (q, k, v) = (float::<B, 4>(q), float::<B, 4>(k), float::<B, 4>(v));
    let s = scores(&q, &k, scale, causal);
    let max = s.clone().max_dim(3);
    let lse = (s.clone() - max.clone()).exp().sum_dim(3).log() + max;
    let p = (s - lse.clone()).exp();
    AttentionOutput {
        output: prim(p.matmul(v)),
        lse: prim(lse.squeeze_dim::<3>(3)),
    }
}

/// Attention gradients: `P = exp(S − lse)`, `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `D = rowsum(dO∘O)`,
/// `dS = P∘(dP − D)`, `dQ = dS·K·scale`, `dK = dSᵀ·Q·scale`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    output: FloatTensor<B>,
    lse: FloatTensor<B>,
    d_output: FloatTensor<B>,
    scale: f64,
    causal: bool,
) -> AttentionGrads<B> {
    let (q, k, v) = (float::<B, 4>(q), float::<B, 4>(k), float::<B, 4>(v));
    let (o, d_o) = (float::<B, 4>(output), float::<B, 4>(d_output));
    let lse = float::<B, 3>(lse).unsqueeze_dim::<4>(3);
    let p = (scores(&q, &k, scale, causal) - lse).exp();
    let dv = p.clone().swap_dims(2, 3).matmul(d_o.clone());
    let dp = d_o.clone().matmul(v.swap_dims(2, 3));
    let delta = (d_o * o).sum_dim(3);
    let ds = p * (dp - delta);
    AttentionGrads {
        q: prim(ds.clone().matmul(k).mul_scalar(scale)),
        k: prim(ds.swap_dims(2, 3).matmul(q).mul_scalar(scale)),
        v: prim(dv),
    }
}
