//! The fused operations written with Burn ops: the defaults of [`FusedOps`](crate::FusedOps) on
//! backends without kernels, and the references the kernels are tested against. They
//! materialise what the kernels avoid (probabilities, the attention score matrix); the formulas
//! are the kernels' formulas.

use crate::{
    AdamWState, AdamWStep, AttentionGrads, AttentionOutput, CrossEntropyOutput, LayerNormGrads,
    LayerNormOutput, RmsNormOutput, UnscaleOutput,
};
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Bool, IndexingUpdateOp, Int, Tensor, TensorMetadata, TensorPrimitive};

fn prim<B: Backend, const D: usize>(x: Tensor<B, D>) -> FloatTensor<B> {
    x.into_primitive().tensor()
}

fn float<B: Backend, const D: usize>(x: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

/// Call `$f::<$B, D>(args)` for the rank `D` of a primitive (1 to 6). The reference ops work on
/// the last dimension in place — no reshape to rows — so under `Distributed<B>` the leading
/// dimensions keep whatever placement they have (a reshape could force a gather).
macro_rules! ranked {
    ($rank:expr, $f:ident::<$B:ty>($($arg:expr),* $(,)?)) => {
        match $rank {
            1 => $f::<$B, 1>($($arg),*),
            2 => $f::<$B, 2>($($arg),*),
            3 => $f::<$B, 3>($($arg),*),
            4 => $f::<$B, 4>($($arg),*),
            5 => $f::<$B, 5>($($arg),*),
            6 => $f::<$B, 6>($($arg),*),
            r => panic!("the fused row ops take ranks 1 to 6, got {r}"),
        }
    };
}

fn rank<B: Backend>(x: &FloatTensor<B>) -> usize {
    x.shape().num_dims()
}

/// A per-channel vector broadcast against a rank-`D` tensor (`[1, …, 1, C]`).
fn channels<B: Backend, const D: usize>(v: FloatTensor<B>) -> Tensor<B, D> {
    float::<B, 1>(v).unsqueeze::<D>()
}

/// Sum over every dimension but the last, as a 1-D `[C]` (a parameter's gradient).
fn sum_leading<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    let c = t.dims()[D - 1];
    let mut t = t;
    for d in 0..D - 1 {
        t = t.sum_dim(d);
    }
    prim(t.reshape([c]))
}

/// Causal softmax of `[b, h, t, s]` scores (see
/// [`FusedOps::fused_causal_softmax`](crate::FusedOps::fused_causal_softmax)): the causal mask
/// filled with −1e9 (a large finite value: some backends implement `mask_fill` arithmetically,
/// and −∞ would give NaN there), then softmax.
pub fn causal_softmax<B: Backend>(scores: FloatTensor<B>) -> FloatTensor<B> {
    let scores = float::<B, 4>(scores);
    let [b, h, t, s] = scores.dims();
    let device = scores.device();
    // `true` strictly above the (shifted) diagonal: masked.
    let mask = Tensor::<B, 2, Bool>::tril_mask([t, s], s as i64 - t as i64, &device)
        .reshape([1, 1, t, s])
        .expand([b, h, t, s]);
    prim(burn::tensor::activation::softmax(
        scores.mask_fill(mask, -1.0e9),
        3,
    ))
}

/// Softmax (or log-softmax) over the last dimension.
pub fn softmax<B: Backend>(x: FloatTensor<B>, log: bool) -> FloatTensor<B> {
    ranked!(rank::<B>(&x), softmax_d::<B>(x, log))
}

fn softmax_d<B: Backend, const D: usize>(x: FloatTensor<B>, log: bool) -> FloatTensor<B> {
    let x = float::<B, D>(x);
    prim(if log {
        burn::tensor::activation::log_softmax(x, D - 1)
    } else {
        burn::tensor::activation::softmax(x, D - 1)
    })
}

/// Gradient of the softmax (or log-softmax) from its output.
pub fn softmax_backward<B: Backend>(
    y: FloatTensor<B>,
    dy: FloatTensor<B>,
    log: bool,
) -> FloatTensor<B> {
    ranked!(rank::<B>(&y), softmax_backward_d::<B>(y, dy, log))
}

fn softmax_backward_d<B: Backend, const D: usize>(
    y: FloatTensor<B>,
    dy: FloatTensor<B>,
    log: bool,
) -> FloatTensor<B> {
    let (y, dy) = (float::<B, D>(y), float::<B, D>(dy));
    prim(if log {
        dy.clone() - y.exp() * dy.sum_dim(D - 1)
    } else {
        y.clone() * (dy.clone() - (dy * y).sum_dim(D - 1))
    })
}

/// LayerNorm over the last dimension; the statistics have the input's shape with a last
/// dimension of 1.
pub fn layer_norm<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    epsilon: f64,
) -> LayerNormOutput<B> {
    ranked!(rank::<B>(&x), layer_norm_d::<B>(x, gamma, beta, epsilon))
}

fn layer_norm_d<B: Backend, const D: usize>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    epsilon: f64,
) -> LayerNormOutput<B> {
    let x = float::<B, D>(x);
    let mean = x.clone().mean_dim(D - 1);
    let centred = x - mean.clone();
    let var = centred.clone().square().mean_dim(D - 1);
    let rstd = var.add_scalar(epsilon).sqrt().recip();
    let y = centred * rstd.clone() * channels::<B, D>(gamma) + channels::<B, D>(beta);
    LayerNormOutput {
        output: prim(y),
        mean: prim(mean),
        rstd: prim(rstd),
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
    ranked!(
        rank::<B>(&x),
        layer_norm_backward_d::<B>(x, gamma, mean, rstd, dy)
    )
}

fn layer_norm_backward_d<B: Backend, const D: usize>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    mean: FloatTensor<B>,
    rstd: FloatTensor<B>,
    dy: FloatTensor<B>,
) -> LayerNormGrads<B> {
    let (x, dy) = (float::<B, D>(x), float::<B, D>(dy));
    let rstd = float::<B, D>(rstd);
    let xhat = (x - float::<B, D>(mean)) * rstd.clone();
    let g = dy.clone() * channels::<B, D>(gamma);
    let dx = rstd
        * (g.clone()
            - g.clone().mean_dim(D - 1)
            - xhat.clone() * (g * xhat.clone()).mean_dim(D - 1));
    LayerNormGrads {
        x: prim(dx),
        gamma: sum_leading(dy.clone() * xhat),
        beta: sum_leading(dy),
    }
}

/// RMSNorm over the last dimension.
pub fn rms_norm<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    epsilon: f64,
) -> RmsNormOutput<B> {
    ranked!(rank::<B>(&x), rms_norm_d::<B>(x, gamma, epsilon))
}

fn rms_norm_d<B: Backend, const D: usize>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    epsilon: f64,
) -> RmsNormOutput<B> {
    let x = float::<B, D>(x);
    let rstd = x
        .clone()
        .square()
        .mean_dim(D - 1)
        .add_scalar(epsilon)
        .sqrt()
        .recip();
    RmsNormOutput {
        output: prim(x * rstd.clone() * channels::<B, D>(gamma)),
        rstd: prim(rstd),
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
    ranked!(rank::<B>(&x), rms_norm_backward_d::<B>(x, gamma, rstd, dy))
}

fn rms_norm_backward_d<B: Backend, const D: usize>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    rstd: FloatTensor<B>,
    dy: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (x, dy) = (float::<B, D>(x), float::<B, D>(dy));
    let rstd = float::<B, D>(rstd);
    let xhat = x * rstd.clone();
    let g = dy.clone() * channels::<B, D>(gamma);
    let dx = rstd * (g.clone() - xhat.clone() * (g * xhat.clone()).mean_dim(D - 1));
    (prim(dx), sum_leading(dy * xhat))
}

/// Rows with a negative target, as a `[rows, 1]` 0/1 float mask of kept rows, and the targets
/// clamped to a valid index.
fn kept_rows<B: Backend>(
    targets: IntTensor<B>,
    dtype: burn::tensor::DType,
) -> (Tensor<B, 2>, Tensor<B, 2, Int>) {
    let targets = Tensor::<B, 1, Int>::from_primitive(targets).unsqueeze_dim::<2>(1);
    // In the logits' dtype (`float()` gives the backend's default one).
    let kept = targets.clone().greater_equal_elem(0).float().cast(dtype);
    (kept, targets.clamp_min(0))
}

/// Cross-entropy with the log-softmax: per-row loss and log-sum-exp.
pub fn cross_entropy<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
) -> CrossEntropyOutput<B> {
    let x = float::<B, 2>(logits);
    let (kept, index) = kept_rows::<B>(targets, x.dtype());
    let max = x.clone().max_dim(1);
    let lse = (x.clone() - max.clone()).exp().sum_dim(1).log() + max;
    let picked = x.gather(1, index);
    CrossEntropyOutput {
        loss: prim(((lse.clone() - picked) * kept).squeeze_dim::<1>(1)),
        lse: prim(lse.squeeze_dim::<1>(1)),
    }
}

/// Gradient of the cross-entropy w.r.t. the logits: `exp(x − lse)`, minus 1 at the target
/// (a scatter-add of one value per row, no one-hot matrix), times the row's upstream gradient.
pub fn cross_entropy_backward<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
    lse: FloatTensor<B>,
    dloss: FloatTensor<B>,
) -> FloatTensor<B> {
    let x = float::<B, 2>(logits);
    let (kept, index) = kept_rows::<B>(targets, x.dtype());
    let p = (x - float::<B, 1>(lse).unsqueeze_dim::<2>(1)).exp();
    let g = p.scatter(1, index, kept.clone().neg(), IndexingUpdateOp::Add);
    prim(g * (float::<B, 1>(dloss).unsqueeze_dim::<2>(1) * kept))
}

const FRAC_1_SQRT_2: f64 = std::f64::consts::FRAC_1_SQRT_2;
/// `1/√(2π)`.
const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// `√(2/π)`, the tanh form's scale.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The tanh form's cubic coefficient.
const GELU_CUBIC: f64 = 0.044_715;

/// `gelu(x + bias)`: erf form, or with `tanh` the tanh approximation
/// `z·(1 + tanh(√(2/π)(z + 0.044715 z³)))/2`.
pub fn gelu_bias<B: Backend>(
    x: FloatTensor<B>,
    bias: FloatTensor<B>,
    tanh: bool,
) -> FloatTensor<B> {
    ranked!(rank::<B>(&x), gelu_bias_d::<B>(x, bias, tanh))
}

fn gelu_bias_d<B: Backend, const D: usize>(
    x: FloatTensor<B>,
    bias: FloatTensor<B>,
    tanh: bool,
) -> FloatTensor<B> {
    let z = float::<B, D>(x) + channels::<B, D>(bias);
    if tanh {
        return prim(z.clone() * tanh_inner(z).tanh().add_scalar(1.0).mul_scalar(0.5));
    }
    prim(z.clone() * (z.mul_scalar(FRAC_1_SQRT_2).erf().add_scalar(1.0)).mul_scalar(0.5))
}

/// `√(2/π)(z + 0.044715 z³)`.
fn tanh_inner<B: Backend, const D: usize>(z: Tensor<B, D>) -> Tensor<B, D> {
    (z.clone() + z.powi_scalar(3).mul_scalar(GELU_CUBIC)).mul_scalar(SQRT_2_OVER_PI)
}

/// Gradients of `gelu(x + bias)`: `gelu'(z) = Φ(z) + z·φ(z)`; for the tanh form
/// `(1 + t)/2 + z(1 − t²)·√(2/π)(1 + 3·0.044715 z²)/2` with `t = tanh(…)`.
pub fn gelu_bias_backward<B: Backend>(
    x: FloatTensor<B>,
    bias: FloatTensor<B>,
    dy: FloatTensor<B>,
    tanh: bool,
) -> (FloatTensor<B>, FloatTensor<B>) {
    ranked!(rank::<B>(&x), gelu_bias_backward_d::<B>(x, bias, dy, tanh))
}

fn gelu_bias_backward_d<B: Backend, const D: usize>(
    x: FloatTensor<B>,
    bias: FloatTensor<B>,
    dy: FloatTensor<B>,
    tanh: bool,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let z = float::<B, D>(x) + channels::<B, D>(bias);
    if tanh {
        let t = tanh_inner(z.clone()).tanh();
        let du = z
            .clone()
            .square()
            .mul_scalar(3.0 * GELU_CUBIC)
            .add_scalar(1.0);
        let rest =
            (t.clone().square().neg().add_scalar(1.0) * du * z).mul_scalar(0.5 * SQRT_2_OVER_PI);
        let dz = float::<B, D>(dy) * (t.add_scalar(1.0).mul_scalar(0.5) + rest);
        return (prim(dz.clone()), sum_leading(dz));
    }
    let cdf = z
        .clone()
        .mul_scalar(FRAC_1_SQRT_2)
        .erf()
        .add_scalar(1.0)
        .mul_scalar(0.5);
    let pdf = z
        .clone()
        .square()
        .mul_scalar(-0.5)
        .exp()
        .mul_scalar(FRAC_1_SQRT_2PI);
    let dz = float::<B, D>(dy) * (cdf + z * pdf);
    (prim(dz.clone()), sum_leading(dz))
}

/// `silu(gate) ⊙ up`.
pub fn swiglu<B: Backend>(gate: FloatTensor<B>, up: FloatTensor<B>) -> FloatTensor<B> {
    ranked!(rank::<B>(&gate), swiglu_d::<B>(gate, up))
}

fn swiglu_d<B: Backend, const D: usize>(
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
) -> FloatTensor<B> {
    prim(burn::tensor::activation::silu(float::<B, D>(gate)) * float::<B, D>(up))
}

/// Gradients `(dgate, dup)` of [`swiglu`]: with `s = σ(g)`, `dup = dy·g·s` and
/// `dgate = dy·up·s·(1 + g·(1 − s))`.
pub fn swiglu_backward<B: Backend>(
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
    dy: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    ranked!(rank::<B>(&gate), swiglu_backward_d::<B>(gate, up, dy))
}

fn swiglu_backward_d<B: Backend, const D: usize>(
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
    dy: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (g, u, dy) = (float::<B, D>(gate), float::<B, D>(up), float::<B, D>(dy));
    let s = burn::tensor::activation::sigmoid(g.clone());
    let dup = dy.clone() * g.clone() * s.clone();
    let slope = s.clone() * (g * s.neg().add_scalar(1.0)).add_scalar(1.0);
    (prim(dy * u * slope), prim(dup))
}

/// The rotary embedding of `x` `[b, h, t, hd]` with tables `[t, hd]`: `x·cos + R(x)·sin` with
/// `R([x₁, x₂]) = [−x₂, x₁]`, or with `transpose` its gradient map `x·cos + Rᵀ(x·sin)`,
/// `Rᵀ([g₁, g₂]) = [g₂, −g₁]`.
pub fn rope<B: Backend>(
    x: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    transpose: bool,
) -> FloatTensor<B> {
    let x = float::<B, 4>(x);
    let half = x.dims()[3] / 2;
    let [cos, sin] = [cos, sin].map(|t| float::<B, 2>(t).unsqueeze::<4>());
    let halves = |t: Tensor<B, 4>| (t.clone().narrow(3, 0, half), t.narrow(3, half, half));
    let turned = if transpose {
        let (g1, g2) = halves(x.clone() * sin);
        Tensor::cat(vec![g2, g1.neg()], 3)
    } else {
        let (x1, x2) = halves(x.clone());
        Tensor::cat(vec![x2.neg(), x1], 3) * sin
    };
    prim(x * cos + turned)
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
fn scores<B: Backend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    scale: f64,
    causal: bool,
) -> Tensor<B, 4> {
    let s = q
        .clone()
        .matmul(k.clone().swap_dims(2, 3))
        .mul_scalar(scale);
    if causal {
        let [b, h, sq, sk] = s.dims();
        let mask = causal_mask::<B>(sq, sk, &s.device()).expand([b, h, sq, sk]);
        s.mask_fill(mask, f32::NEG_INFINITY)
    } else {
        s
    }
}

/// Keys or values of `[b, kv_heads, s, d]` repeated for the `h` query heads they serve
/// (grouped-query attention: query head `j` reads key/value head `j / (h / kv_heads)`);
/// unchanged when there are as many.
pub fn repeat_heads<B: Backend>(x: Tensor<B, 4>, h: usize) -> Tensor<B, 4> {
    let [b, kv, s, d] = x.dims();
    if kv == h {
        return x;
    }
    x.unsqueeze_dim::<5>(2)
        .expand([b, kv, h / kv, s, d])
        .reshape([b, h, s, d])
}

/// The gradient of [`repeat_heads`]: the query heads' summed per key/value head.
fn sum_heads<B: Backend>(x: Tensor<B, 4>, kv: usize) -> Tensor<B, 4> {
    let [b, h, s, d] = x.dims();
    if kv == h {
        return x;
    }
    x.reshape([b, kv, h / kv, s, d])
        .sum_dim(2)
        .squeeze_dim::<4>(2)
}

/// Attention through the full score matrix; `k` and `v` may have fewer heads than `q`, each
/// serving consecutive query heads (grouped-query attention).
pub fn attention<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    scale: f64,
    causal: bool,
) -> AttentionOutput<B> {
    let q = float::<B, 4>(q);
    let h = q.dims()[1];
    let (k, v) = (
        repeat_heads(float::<B, 4>(k), h),
        repeat_heads(float::<B, 4>(v), h),
    );
    let s = scores(&q, &k, scale, causal);
    let max = s.clone().max_dim(3);
    let lse = (s.clone() - max.clone()).exp().sum_dim(3).log() + max;
    let p = (s - lse.clone()).exp();
    AttentionOutput {
        output: prim(p.matmul(v)),
        lse: prim(lse.squeeze_dim::<3>(3)),
    }
}

/// Attention gradients (grouped key/value heads as [`attention`] takes them): `P = exp(S − lse)`, `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `D = rowsum(dO∘O)`,
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
    let q = float::<B, 4>(q);
    let (h, kv) = (q.dims()[1], k.shape()[1]);
    let (k, v) = (
        repeat_heads(float::<B, 4>(k), h),
        repeat_heads(float::<B, 4>(v), h),
    );
    let (o, d_o) = (float::<B, 4>(output), float::<B, 4>(d_output));
    let lse = float::<B, 3>(lse).unsqueeze_dim::<4>(3);
    let p = (scores(&q, &k, scale, causal) - lse).exp();
    let dv = p.clone().swap_dims(2, 3).matmul(d_o.clone());
    let dp = d_o.clone().matmul(v.swap_dims(2, 3));
    let delta = (d_o * o).sum_dim(3);
    let ds = p * (dp - delta);
    AttentionGrads {
        q: prim(ds.clone().matmul(k).mul_scalar(scale)),
        k: prim(sum_heads(
            ds.swap_dims(2, 3).matmul(q).mul_scalar(scale),
            kv,
        )),
        v: prim(sum_heads(dv, kv)),
    }
}

/// Unscale, `Σ g²` and the non-finite flag with Burn ops.
pub fn unscale<B: Backend>(grad: FloatTensor<B>, inv_scale: f64) -> UnscaleOutput<B> {
    ranked!(rank::<B>(&grad), unscale_d::<B>(grad, inv_scale))
}

fn unscale_d<B: Backend, const D: usize>(grad: FloatTensor<B>, inv_scale: f64) -> UnscaleOutput<B> {
    let g = float::<B, D>(grad).mul_scalar(inv_scale);
    let bad = g.clone().is_nan().bool_or(g.clone().is_inf()).any().float();
    UnscaleOutput {
        sum_squares: prim(g.clone().square().sum()),
        non_finite: prim(bad),
        grad: prim(g),
    }
}

/// [`FusedOps::fused_unscale_all`](crate::FusedOps::fused_unscale_all) by
/// [`FusedOps::fused_unscale`](crate::FusedOps::fused_unscale) per gradient: each `Σ g²` divided
/// by its copies, summed in order, the flags' maximum.
pub fn unscale_all<B: crate::FusedOps>(
    grads: Vec<FloatTensor<B>>,
    copies: &[usize],
    inv_scale: f64,
) -> (Vec<FloatTensor<B>>, FloatTensor<B>) {
    assert_eq!(grads.len(), copies.len(), "a copy count per gradient");
    let mut sum: Option<(Tensor<B, 1>, Tensor<B, 1>)> = None;
    let outputs = grads
        .into_iter()
        .zip(copies)
        .map(|(grad, &copies)| {
            let out = B::fused_unscale(grad, inv_scale);
            let sq = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(out.sum_squares));
            let sq = if copies > 1 {
                sq.div_scalar(copies as f64)
            } else {
                sq
            };
            let flag = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(out.non_finite));
            sum = Some(match sum.take() {
                Some((s, f)) => (s + sq, f.max_pair(flag)),
                None => (sq, flag),
            });
            out.grad
        })
        .collect();
    let (sum, flag) = sum.expect("fused_unscale_all of no gradient");
    (outputs, prim(Tensor::cat(vec![flag, sum], 0)))
}

/// AdamW with Burn ops, predicated on `skip`.
pub fn adamw<B: Backend>(
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    m: FloatTensor<B>,
    v: FloatTensor<B>,
    grad_scale: FloatTensor<B>,
    skip: FloatTensor<B>,
    step: AdamWStep,
) -> AdamWState<B> {
    ranked!(
        rank::<B>(&param),
        adamw_d::<B>(param, grad, m, v, grad_scale, skip, step)
    )
}

fn adamw_d<B: Backend, const D: usize>(
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    m: FloatTensor<B>,
    v: FloatTensor<B>,
    grad_scale: FloatTensor<B>,
    skip: FloatTensor<B>,
    s: AdamWStep,
) -> AdamWState<B> {
    let (p, m, v) = (float::<B, D>(param), float::<B, D>(m), float::<B, D>(v));
    let shape = p.shape();
    let g = float::<B, D>(grad) * float::<B, 1>(grad_scale).reshape([1; D]);
    let m2 = m.clone().mul_scalar(s.beta1) + g.clone().mul_scalar(1.0 - s.beta1);
    let v2 = v.clone().mul_scalar(s.beta2) + g.square().mul_scalar(1.0 - s.beta2);
    let t = s.step.max(1) as i32;
    let m_hat = m2.clone().div_scalar(1.0 - s.beta1.powi(t));
    let v_hat = v2.clone().div_scalar(1.0 - s.beta2.powi(t));
    let p2 = p.clone().mul_scalar(1.0 - s.lr * s.weight_decay)
        - m_hat
            .div(v_hat.sqrt().add_scalar(s.epsilon))
            .mul_scalar(s.lr);
    let skipped = float::<B, 1>(skip)
        .not_equal_elem(0.0)
        .reshape([1; D])
        .expand(shape);
    AdamWState {
        param: prim(p2.mask_where(skipped.clone(), p)),
        m: prim(m2.mask_where(skipped.clone(), m)),
        v: prim(v2.mask_where(skipped, v)),
    }
}
