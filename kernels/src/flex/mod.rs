//! Native implementations of the fused operations on Flex, the CPU backend: plain Rust loops over
//! contiguous f32 rows, rows (or chunks) in parallel with rayon, the inner loops compiled for the
//! CPU's vector width (AVX-512, AVX2 + FMA or the baseline, chosen at run time). Burn ops would
//! take 10–30 passes over memory for what each of these does in one or two.
//!
//! | op | what |
//! |---|---|
//! | causal softmax of the attention core | [`attention`]: visible keys only |
//! | attention on packed q/k/v, forward and backward | [`attention`]: two GEMMs per (batch, head) reading q, k, v in place, probabilities recomputed from the log-sum-exp in backward |
//! | attention on separate q, k, v with grouped key/value heads, forward and backward | [`attention`]: the same per (batch, head); the key/value gradients summed over the query heads of a group in one task |
//! | LayerNorm and RMSNorm, forward and backward | [`rows`]: one pass for the statistics, one for the output |
//! | GELU-with-bias, forward and backward | [`rows`]: the erf form, a polynomial erf |
//! | SwiGLU gate and rotary embedding, forward and backward | [`gated`]: one elementwise pass |
//! | cross-entropy, forward and backward | [`rows`]: log-sum-exp per row; `p − onehot` per row |
//! | a one-row product (a generated token through a weight or the tied table) | `gemv`: `gemm`'s matrix–vector order bit for bit, at the memory's speed, columns over the pool |
//! | unscale + `Σg²` + non-finite flag, AdamW | [`optim`]: one pass each, AdamW in place |
//! | 8-bit block-wise state: block maxima, quantise, dequantise | [`quant`]: one pass each, `u8` codes |
//!
//! Anything else — other dtypes (f16, bf16), shapes the fast path does not take — goes to the
//! Burn-op form ([`crate::reference`]), so the ops are total. Results agree with the
//! Burn-op form to rounding, not bitwise (sums are taken in another order); a run uses one form
//! throughout, so recomputation and the sharded-versus-one-device comparisons stay exact.

pub mod attention;
pub mod gated;
pub(crate) mod gemv;
pub(crate) mod math;
pub mod optim;
pub mod quant;
pub mod rows;

pub use attention::causal_softmax;

use burn::backend::Flex;
use burn::backend::flex::FlexTensor;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Shape, TensorData, TensorMetadata};

use crate::{
    AdamWState, AdamWStep, CrossEntropyOutput, FusedOps, LayerNormGrads, LayerNormOutput,
    RmsNormOutput, UnscaleOutput, reference,
};

/// A contiguous f32 tensor whose storage starts at its first element.
pub(crate) struct F32(FlexTensor);

impl F32 {
    pub(crate) fn f32s(&self) -> &[f32] {
        self.0.as_slice::<f32>().expect("a contiguous f32 tensor")
    }
}

/// `t` as contiguous f32 (a copy only when it is strided), `None` for other dtypes.
pub(crate) fn contiguous(t: &FlexTensor) -> Option<F32> {
    (t.dtype() == DType::F32).then(|| F32(t.to_contiguous()))
}

/// `t` contiguous f32 and ready to be written in place (`storage_mut` copies it only if its
/// buffer is shared).
pub(crate) fn owned(t: FlexTensor) -> Option<FlexTensor> {
    (t.dtype() == DType::F32).then(|| t.to_contiguous())
}

/// `n` f32 that `fill` writes — every element assigned before anything reads it — without the
/// zeroing pass of `vec![0.0; n]` (a memset of each output: 4% of a step of nanoGPT's
/// shakespeare-char model on 2 cores, where the kernels write every element anyway).
///
/// # Safety
/// `fill` assigns every element of the slice it is given and reads none before assigning it.
/// (The slice's memory is allocated but not initialised; f32 has no invalid bit patterns, so
/// once assigned each element is a value.)
pub(crate) unsafe fn written(n: usize, fill: impl FnOnce(&mut [f32])) -> Vec<f32> {
    let mut v = Vec::<f32>::with_capacity(n);
    // SAFETY: the allocation holds `n` f32; by the caller's contract `fill` assigns all of them
    // and reads none first, so `set_len` exposes only assigned values. A panic in `fill` leaves
    // the length 0.
    unsafe {
        fill(std::slice::from_raw_parts_mut(v.as_mut_ptr(), n));
        v.set_len(n);
    }
    v
}

/// A contiguous f32 tensor of `shape` from `values`.
pub(crate) fn float(values: Vec<f32>, shape: Shape) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// Flex runs native loops for the ops a training step spends its time in (see the module table),
/// and the Burn-op default for the softmax.
impl FusedOps for Flex {
    // Every family, native (softmax alone keeps its Burn-op default).
    const FUSED: crate::Fused = crate::Fused::ALL;
    // Flex's parallel ops run on the calling thread's rayon pool.
    const COMPUTES_ON_HOST_POOL: bool = true;

    fn fused_causal_softmax(scores: FloatTensor<Self>) -> FloatTensor<Self> {
        causal_softmax(scores)
    }

    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> LayerNormOutput<Self> {
        rows::layer_norm(&x, &gamma, &beta, epsilon)
            .unwrap_or_else(|| reference::layer_norm::<Self>(x, gamma, beta, epsilon))
    }

    fn fused_layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> LayerNormGrads<Self> {
        rows::layer_norm_backward(&x, &gamma, &mean, &rstd, &dy)
            .unwrap_or_else(|| reference::layer_norm_backward::<Self>(x, gamma, mean, rstd, dy))
    }

    fn fused_rms_norm(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        eps: f64,
    ) -> RmsNormOutput<Self> {
        rows::rms_norm(&x, &scale, eps)
            .unwrap_or_else(|| reference::rms_norm::<Self>(x, scale, eps))
    }

    fn fused_rms_norm_backward(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        r: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        rows::rms_norm_backward(&x, &scale, &r, &dy)
            .unwrap_or_else(|| reference::rms_norm_backward::<Self>(x, scale, r, dy))
    }

    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> CrossEntropyOutput<Self> {
        rows::cross_entropy(&logits, &targets)
            .unwrap_or_else(|| reference::cross_entropy::<Self>(logits, targets))
    }

    fn fused_cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rows::cross_entropy_backward(&logits, &targets, &lse, &dloss).unwrap_or_else(|| {
            reference::cross_entropy_backward::<Self>(logits, targets, lse, dloss)
        })
    }

    fn fused_gelu_bias(
        input: FloatTensor<Self>,
        b: FloatTensor<Self>,
        tanh: bool,
    ) -> FloatTensor<Self> {
        rows::gelu_bias(&input, &b, tanh)
            .unwrap_or_else(|| reference::gelu_bias::<Self>(input, b, tanh))
    }

    fn fused_gelu_bias_backward(
        x: FloatTensor<Self>,
        b: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        tanh: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        rows::gelu_bias_backward(&x, &b, &dout, tanh)
            .unwrap_or_else(|| reference::gelu_bias_backward::<Self>(x, b, dout, tanh))
    }

    fn fused_swiglu(g: FloatTensor<Self>, u: FloatTensor<Self>) -> FloatTensor<Self> {
        gated::swiglu(&g, &u).unwrap_or_else(|| reference::swiglu::<Self>(g, u))
    }

    fn fused_swiglu_backward(
        g: FloatTensor<Self>,
        u: FloatTensor<Self>,
        dout: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        gated::swiglu_backward(&g, &u, &dout)
            .unwrap_or_else(|| reference::swiglu_backward::<Self>(g, u, dout))
    }

    fn fused_rope(
        input: FloatTensor<Self>,
        c: FloatTensor<Self>,
        s: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        gated::rope(&input, &c, &s, false)
            .unwrap_or_else(|| reference::rope::<Self>(input, c, s, false))
    }

    fn fused_rope_backward(
        dout: FloatTensor<Self>,
        c: FloatTensor<Self>,
        s: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        gated::rope(&dout, &c, &s, true)
            .unwrap_or_else(|| reference::rope::<Self>(dout, c, s, true))
    }

    fn fused_attention(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        alpha: f64,
        masked: bool,
    ) -> crate::AttentionOutput<Self> {
        let (q, k, v) = (queries, keys, values);
        attention::attention(&q, &k, &v, alpha, masked)
            .unwrap_or_else(|| reference::attention::<Self>(q, k, v, alpha, masked))
    }

    fn fused_attention_backward(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        alpha: f64,
        masked: bool,
    ) -> crate::AttentionGrads<Self> {
        let (q, k, v, o, d_o) = (queries, keys, values, out, d_out);
        attention::attention_backward(&q, &k, &v, &o, &lse, &d_o, alpha, masked).unwrap_or_else(
            || reference::attention_backward::<Self>(q, k, v, o, lse, d_o, alpha, masked),
        )
    }

    fn fused_attention_qkv(
        qkv: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> crate::AttentionOutput<Self> {
        attention::attention_qkv(&qkv, scale, causal)
            .unwrap_or_else(|| crate::packed::attention::<Self>(qkv, scale, causal))
    }

    fn fused_attention_qkv_backward(
        qkv: FloatTensor<Self>,
        output: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_output: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> FloatTensor<Self> {
        attention::attention_qkv_backward(&qkv, &output, &lse, &d_output, scale, causal)
            .unwrap_or_else(|| {
                crate::packed::attention_backward::<Self>(qkv, output, lse, d_output, scale, causal)
            })
    }

    fn fused_unscale(grad: FloatTensor<Self>, inv_scale: f64) -> UnscaleOutput<Self> {
        if grad.dtype() != DType::F32 {
            return reference::unscale::<Self>(grad, inv_scale);
        }
        optim::unscale(grad, inv_scale).expect("an f32 gradient")
    }

    fn fused_adamw(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        grad_scale: FloatTensor<Self>,
        skip: FloatTensor<Self>,
        step: AdamWStep,
    ) -> AdamWState<Self> {
        let f32s = [&param, &grad, &m, &v, &grad_scale, &skip]
            .iter()
            .all(|t| t.dtype() == DType::F32);
        let same = param.shape() == grad.shape() && param.shape() == m.shape();
        if !(f32s && same && m.shape() == v.shape()) {
            return reference::adamw::<Self>(param, grad, m, v, grad_scale, skip, step);
        }
        optim::adamw(param, grad, m, v, grad_scale, skip, step).expect("checked f32 tensors")
    }

    fn blockwise_absmax(
        piece: FloatTensor<Self>,
        start: usize,
        block: usize,
        total: usize,
    ) -> FloatTensor<Self> {
        quant::absmax(&piece, start, block, total)
            .unwrap_or_else(|| crate::quant::absmax::<Self>(piece, start, block, total))
    }

    fn blockwise_quantise(
        piece: FloatTensor<Self>,
        absmax: FloatTensor<Self>,
        midpoints: FloatTensor<Self>,
        start: usize,
        block: usize,
        dtype: burn::tensor::IntDType,
    ) -> IntTensor<Self> {
        if dtype == burn::tensor::IntDType::U8
            && let Some(codes) = quant::quantise(&piece, &absmax, &midpoints, start, block)
        {
            return codes;
        }
        crate::quant::quantise::<Self>(piece, absmax, midpoints, start, block, dtype)
    }

    /// The flag read on the host (free on the CPU): one of the two, no pass over them.
    fn int_unless_skipped(
        new: IntTensor<Self>,
        old: IntTensor<Self>,
        flag: FloatTensor<Self>,
    ) -> IntTensor<Self> {
        match contiguous(&flag).and_then(|s| s.f32s().first().copied()) {
            Some(skipped) if skipped != 0.0 => old,
            Some(_) => new,
            None => crate::quant::unless_skipped::<Self>(new, old, flag),
        }
    }

    fn blockwise_dequantise(
        piece: IntTensor<Self>,
        absmax: FloatTensor<Self>,
        values: FloatTensor<Self>,
        start: usize,
        block: usize,
    ) -> FloatTensor<Self> {
        quant::dequantise(&piece, &absmax, &values, start, block).unwrap_or_else(|| {
            crate::quant::dequantise::<Self>(piece, absmax, values, start, block)
        })
    }
}
