//! The `#[cube]` kernels and `FusedOps` for `CubeBackend` (Wgpu, Cuda, … — every CubeCL runtime),
//! one file per kernel family: `softmax`, `norm` (LayerNorm and RMSNorm), `cross_entropy`,
//! `gelu` (GELU with bias), `gated` (the SwiGLU gate and the rotary embedding), `attention` (flash attention's host side, separate or packed q/k/v),
//! `attention_backward` and `flash` (the flash-attention kernels), `heads` (what they share),
//! `optim` (the optimizer tail), `quant` (8-bit optimizer state), `embedding` (the table's gradient); the cube-wide reductions the row kernels share are in `reduce`,
//! the column sums (bias and norm parameter gradients) in `columns`, the flash kernels' CUDA
//! source without a GPU in `flash::codegen` (feature `cuda`), the host-side launch helpers here.
//!
//! Conventions shared by the kernels:
//! * inputs are made contiguous first; a row is `cols` consecutive elements;
//! * row kernels run one cube per row with `block` (a power of two, ≤ 256) units striding over
//!   the row in vectors of up to 16 bytes (`row_vector`), and reduce through shared memory (a
//!   tree, deterministic);
//! * arithmetic is in f32 whatever the tensor dtype (f16 and bf16 tensors are read and written in
//!   their dtype); per-row statistics (mean, 1/σ, log-sum-exp) are f32 tensors;
//! * "-infinity" is `-3.0e38` (WGSL has no infinity literal), which `exp` flushes to 0.

mod attention;
mod attention_backward;
#[cfg(feature = "cuda")]
pub mod blas;
mod columns;
pub(crate) use columns::column_sums;
mod cross_entropy;
mod embedding;
mod flash;
#[cfg(feature = "cuda")]
pub use flash::codegen;
pub use flash::{with_emulated_mma, with_fragment_kernels, with_kv_reread, with_native_mma};
mod gated;
mod gelu;
mod heads;
mod mixed;
pub(crate) use mixed::add_widened;
mod norm;
mod optim;
mod quant;
pub use quant::quant_launches;
mod reduce;
mod softmax;

use crate::{
    AdamWState, AdamWStep, AttentionGrads, AttentionOutput, CrossEntropyOutput, FusedOps,
    LayerNormGrads, LayerNormOutput, RmsNormOutput, UnscaleOutput,
};
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::TensorArg;
use cubecl::{CubeCount, CubeDim, calculate_cube_count_elemwise};
use std::sync::atomic::{AtomicU64, Ordering};

const NEG_BIG: f32 = -3.0e38;

type Cb<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// Kernel launches issued by this module since start-up (exact; for the benchmark's
/// launches-per-call column and the tests).
static LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// Fused-kernel launches so far (process-wide).
pub fn launches() -> u64 {
    LAUNCHES.load(Ordering::Relaxed)
}

thread_local! {
    static THREAD_LAUNCHES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Fused-kernel launches so far issued from the calling thread: what a test counts while other
/// tests launch kernels on their own threads.
pub fn thread_launches() -> u64 {
    THREAD_LAUNCHES.get()
}

fn launched(n: u64) {
    LAUNCHES.fetch_add(n, Ordering::Relaxed);
    THREAD_LAUNCHES.set(THREAD_LAUNCHES.get() + n);
}

static REGISTER_ATTENTION: AtomicU64 = AtomicU64::new(0);

/// Flash-attention launches (forward and each backward pass) that ran the register-fragment
/// kernels so far (process-wide), with the `mma` instruction or emulated.
pub fn register_attention_launches() -> u64 {
    REGISTER_ATTENTION.load(Ordering::Relaxed)
}

/// Gradients one launch of the step's unscale takes on `like`'s device (as many as its
/// bindings hold, at most 32): a step's unscale is `⌈gradients / this⌉` launches (per run of one
/// dtype) and one fold. `write`: under a loss scale, each gradient's unscaled output is bound too.
pub fn gradients_per_unscale_launch<R: CubeRuntime>(like: &CubeTensor<R>, write: bool) -> usize {
    optim::unscale_chunk(like, write)
}

// ---------------------------------------------------------------------------------------------
// Launch helpers.

/// Each of `tensors` made contiguous (the kernels index rows and columns directly).
fn contiguous<R: CubeRuntime, const N: usize>(tensors: [CubeTensor<R>; N]) -> [CubeTensor<R>; N] {
    tensors.map(into_contiguous)
}

/// `t` as a kernel argument (its handle cloned: `t` stays usable, as outputs must).
fn arg<R: CubeRuntime>(t: &CubeTensor<R>) -> TensorArg<R> {
    t.clone().into_tensor_arg()
}

/// `(rows, cols)` of a tensor seen as rows over its last dimension.
fn rows_cols(shape: &Shape) -> (usize, usize) {
    let cols = shape[shape.num_dims() - 1];
    (shape.num_elements() / cols.max(1), cols)
}

/// A row kernel's launch: one cube per row, spread over x and y (each at most 65 535), of
/// `block` units — a power of two from 32 to 256, about 4 elements per unit (fewer barrier
/// levels in the tree reductions; a 50k-vocabulary row still gets 256 units).
fn row_launch(rows: usize, cols: usize) -> (CubeCount, CubeDim, usize) {
    let block = cols.div_ceil(4).next_power_of_two().clamp(32, 256);
    let x = rows.clamp(1, 65_535);
    let count = CubeCount::Static(x as u32, rows.div_ceil(x).max(1) as u32, 1);
    (count, CubeDim::new_1d(block as u32), block)
}

/// The widest vector (elements) a row kernel reads and writes `tensors` in: 16 bytes, halved
/// until it divides the row length `cols`, every buffer's start is aligned to it and the device
/// reads that width (each row then starts on a vector). 2-byte accesses left an H200's
/// cross-entropy backward at 649 GB/s of 4.8 TB/s.
fn row_vector<R: CubeRuntime>(tensors: &[&CubeTensor<R>], cols: usize) -> usize {
    let es = tensors[0].dtype.size();
    let fits = |n: usize| {
        cols.is_multiple_of(n)
            && tensors.iter().all(|t| {
                t.dtype.size() == es
                    && (t.handle.offset_start.unwrap_or(0) as usize).is_multiple_of(n * es)
            })
            && tensors[0]
                .client
                .io_optimized_vector_sizes(es)
                .any(|v| v == n)
    };
    let mut n = (16 / es).max(1);
    while n > 1 && !fits(n) {
        n /= 2;
    }
    n
}

fn empty<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape, dtype: DType) -> CubeTensor<R> {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype)
}

/// A new tensor of `like`'s shape and dtype (a kernel's output).
fn empty_like<R: CubeRuntime>(like: &CubeTensor<R>) -> CubeTensor<R> {
    empty(like, like.shape(), like.dtype)
}

/// A new f32 tensor on `like`'s device (per-row statistics, partial sums).
fn empty_f32<R: CubeRuntime>(like: &CubeTensor<R>, shape: impl Into<Shape>) -> CubeTensor<R> {
    empty(like, shape.into(), DType::F32)
}

/// `t` contiguous and in `dtype` (a kernel's operands taken in one dtype). Contiguous after the
/// cast: Burn's cast writes a new tensor in CubeCL's "optimized" layout, which on CUDA pads rows
/// whose bytes are not a multiple of their alignment (see `embedding.rs`), and the kernels read
/// packed rows.
fn as_dtype<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    t: CubeTensor<R>,
    dtype: DType,
) -> CubeTensor<R> {
    let t = if t.dtype == dtype {
        t
    } else {
        Cb::<R, F, I, BT>::float_cast(t, dtype.into())
    };
    into_contiguous(t)
}

/// One unit per element of `n`.
fn elementwise<R: CubeRuntime>(like: &CubeTensor<R>, n: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(&like.client, n.max(1));
    (
        calculate_cube_count_elemwise(&like.client, n.max(1), dim),
        dim,
    )
}

/// Rows per partial sum of the column reductions (norm parameter gradients, bias gradients).
/// Each unit walks its chunk one row at a time, a dependent chain of loads: at 256 rows GPT-2's
/// 8192 × 768 LayerNorm gradients made 768 warps for the whole GPU (under 6 per H200
/// multiprocessor) and took 0.18 ms a launch (CubeCL's profiler, 2026-11-28; the bytes read take
/// ≈ 0.01 ms). At 32 rows the same call has 6,144 warps, and the partials (`[256, 768]` f32) are
/// summed by one reduction.
const COLUMN_CHUNK: usize = 32;

/// `x` `[b, h, t, hd]` with an even `hd`, tables `[t, hd]` in its dtype: what the rotary kernel
/// takes.
fn rope_shapes<R: CubeRuntime>(
    x: &CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
) -> bool {
    let shape = x.shape();
    let dims = shape.as_slice();
    dims.len() == 4
        && dims[3].is_multiple_of(2)
        && [cos, sin]
            .iter()
            .all(|t| t.shape().as_slice() == &dims[2..] && t.dtype == x.dtype)
}

// ---------------------------------------------------------------------------------------------
// The trait, one family file per group of methods.

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> FusedOps
    for CubeBackend<R, F, I, BT>
{
    const FUSED: crate::Fused = crate::Fused::ALL;

    fn fused_softmax(x: CubeTensor<R>) -> CubeTensor<R> {
        softmax::forward(x, false)
    }

    fn fused_softmax_backward(y: CubeTensor<R>, dy: CubeTensor<R>) -> CubeTensor<R> {
        softmax::backward(y, dy, false)
    }

    fn fused_log_softmax(x: CubeTensor<R>) -> CubeTensor<R> {
        softmax::forward(x, true)
    }

    fn fused_log_softmax_backward(y: CubeTensor<R>, dy: CubeTensor<R>) -> CubeTensor<R> {
        softmax::backward(y, dy, true)
    }

    fn fused_layer_norm(
        x: CubeTensor<R>,
        gamma: CubeTensor<R>,
        beta: CubeTensor<R>,
        epsilon: f64,
    ) -> LayerNormOutput<Self> {
        let dtype = x.dtype.into();
        Self::fused_layer_norm_as(x, gamma, beta, epsilon, dtype)
    }

    fn fused_layer_norm_as(
        x: CubeTensor<R>,
        gamma: CubeTensor<R>,
        beta: CubeTensor<R>,
        epsilon: f64,
        dtype: burn::tensor::FloatDType,
    ) -> LayerNormOutput<Self> {
        let (output, mean, rstd) = norm::forward(x, gamma, Some(beta), epsilon, dtype.into());
        LayerNormOutput { output, mean, rstd }
    }

    fn fused_layer_norm_backward(
        x: CubeTensor<R>,
        gamma: CubeTensor<R>,
        mean: CubeTensor<R>,
        rstd: CubeTensor<R>,
        dy: CubeTensor<R>,
    ) -> LayerNormGrads<Self> {
        let (x, gamma, beta) = norm::backward(x, gamma, Some(mean), rstd, dy);
        LayerNormGrads {
            x,
            gamma,
            beta: beta.expect("LayerNorm has a β gradient"),
        }
    }

    fn fused_layer_norm_backward_any(operands: [CubeTensor<R>; 5]) -> LayerNormGrads<Self> {
        // The kernels read `dy` in its own dtype.
        let [x, gamma, mean, rstd, dy] = operands;
        Self::fused_layer_norm_backward(x, gamma, mean, rstd, dy)
    }

    fn fused_rms_norm(x: CubeTensor<R>, gamma: CubeTensor<R>, epsilon: f64) -> RmsNormOutput<Self> {
        let dtype = x.dtype.into();
        Self::fused_rms_norm_as(x, gamma, epsilon, dtype)
    }

    fn fused_rms_norm_as(
        x: CubeTensor<R>,
        gamma: CubeTensor<R>,
        epsilon: f64,
        dtype: burn::tensor::FloatDType,
    ) -> RmsNormOutput<Self> {
        let (output, _, rstd) = norm::forward(x, gamma, None, epsilon, dtype.into());
        RmsNormOutput { output, rstd }
    }

    fn fused_rms_norm_backward(
        x: CubeTensor<R>,
        gamma: CubeTensor<R>,
        rstd: CubeTensor<R>,
        dy: CubeTensor<R>,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        let (dx, dgamma, _) = norm::backward(x, gamma, None, rstd, dy);
        (dx, dgamma)
    }

    fn fused_rms_norm_backward_any(operands: [CubeTensor<R>; 4]) -> (CubeTensor<R>, CubeTensor<R>) {
        let [x, gamma, rstd, dy] = operands;
        Self::fused_rms_norm_backward(x, gamma, rstd, dy)
    }

    fn fused_cross_entropy(
        logits: CubeTensor<R>,
        targets: CubeTensor<R>,
    ) -> CrossEntropyOutput<Self> {
        let (loss, lse) = cross_entropy::forward(logits, targets);
        CrossEntropyOutput { loss, lse }
    }

    fn fused_cross_entropy_backward(
        logits: CubeTensor<R>,
        targets: CubeTensor<R>,
        lse: CubeTensor<R>,
        dloss: CubeTensor<R>,
    ) -> CubeTensor<R> {
        cross_entropy::backward(logits, targets, lse, dloss)
    }

    fn fused_embedding_backward(
        table: CubeTensor<R>,
        grad: CubeTensor<R>,
        ids: CubeTensor<R>,
    ) -> CubeTensor<R> {
        embedding::backward::<R>(table.shape()[0], grad, ids)
    }

    fn fused_gelu_bias(x: CubeTensor<R>, bias: CubeTensor<R>, tanh: bool) -> CubeTensor<R> {
        gelu::forward(x, bias, tanh)
    }

    fn fused_gelu_bias_backward(
        x: CubeTensor<R>,
        bias: CubeTensor<R>,
        dy: CubeTensor<R>,
        tanh: bool,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        gelu::backward(x, bias, dy, tanh)
    }

    fn fused_swiglu(gate: CubeTensor<R>, up: CubeTensor<R>) -> CubeTensor<R> {
        if gate.shape() != up.shape() {
            return crate::reference::swiglu::<Self>(gate, up);
        }
        gated::swiglu(gate, up)
    }

    fn fused_swiglu_backward(
        gate: CubeTensor<R>,
        up: CubeTensor<R>,
        dy: CubeTensor<R>,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        if gate.shape() != up.shape() || gate.shape() != dy.shape() {
            return crate::reference::swiglu_backward::<Self>(gate, up, dy);
        }
        gated::swiglu_backward(gate, up, dy)
    }

    fn fused_rope(x: CubeTensor<R>, cos: CubeTensor<R>, sin: CubeTensor<R>) -> CubeTensor<R> {
        if !rope_shapes(&x, &cos, &sin) {
            return crate::reference::rope::<Self>(x, cos, sin, false);
        }
        gated::rope(x, cos, sin, false)
    }

    fn fused_rope_backward(
        dy: CubeTensor<R>,
        cos: CubeTensor<R>,
        sin: CubeTensor<R>,
    ) -> CubeTensor<R> {
        if !rope_shapes(&dy, &cos, &sin) {
            return crate::reference::rope::<Self>(dy, cos, sin, true);
        }
        gated::rope(dy, cos, sin, true)
    }

    fn fused_unscale(grad: CubeTensor<R>, inv_scale: f64) -> UnscaleOutput<Self> {
        let (grad, sum_squares, non_finite) = optim::unscale::<R, F, I, BT>(grad, inv_scale);
        UnscaleOutput {
            grad,
            sum_squares,
            non_finite,
        }
    }

    fn fused_unscale_all(
        grads: Vec<CubeTensor<R>>,
        copies: &[usize],
        inv_scale: f64,
    ) -> (Vec<CubeTensor<R>>, CubeTensor<R>) {
        optim::unscale_all(grads, copies, inv_scale)
    }

    fn fused_adamw(
        param: CubeTensor<R>,
        grad: CubeTensor<R>,
        m: CubeTensor<R>,
        v: CubeTensor<R>,
        grad_scale: CubeTensor<R>,
        skip: CubeTensor<R>,
        step: AdamWStep,
    ) -> AdamWState<Self> {
        let operands = [param, grad, m, v, grad_scale, skip];
        let ([param, m, v], _) = optim::adamw::<R, F, I, BT>(operands, step, None);
        AdamWState { param, m, v }
    }

    fn fused_adamw_with_copy(
        operands: [CubeTensor<R>; 6],
        step: AdamWStep,
        copy: burn::tensor::FloatDType,
    ) -> (AdamWState<Self>, CubeTensor<R>) {
        let ([param, m, v], copy) =
            optim::adamw::<R, F, I, BT>(operands, step, Some(DType::from(copy)));
        let copy = copy.expect("the kernel wrote the copy");
        (AdamWState { param, m, v }, copy)
    }

    fn fused_adamw_many(
        entries: Vec<crate::AdamWEntry<Self>>,
        grad_scale: CubeTensor<R>,
        skip: CubeTensor<R>,
    ) -> Vec<crate::AdamWResult<Self>> {
        optim::adamw_many::<R, F, I, BT>(entries, grad_scale, skip)
    }

    fn adamw_batch(like: &CubeTensor<R>) -> usize {
        optim::adamw_chunk(like, true)
    }

    fn blockwise_absmax(
        x: CubeTensor<R>,
        start: usize,
        block: usize,
        total: usize,
    ) -> CubeTensor<R> {
        quant::absmax(x, start, block, total)
    }

    fn blockwise_quantise(
        x: CubeTensor<R>,
        absmax: CubeTensor<R>,
        mids: CubeTensor<R>,
        start: usize,
        block: usize,
        dtype: burn::tensor::IntDType,
    ) -> CubeTensor<R> {
        quant::quantise::<R, F, I, BT>([x, absmax, mids], quant::At { start, block }, dtype)
    }

    fn int_unless_skipped(
        new: CubeTensor<R>,
        kept: CubeTensor<R>,
        skip: CubeTensor<R>,
    ) -> CubeTensor<R> {
        quant::unless_skipped(new, kept, skip)
    }

    fn blockwise_dequantise(
        codes: CubeTensor<R>,
        absmax: CubeTensor<R>,
        map: CubeTensor<R>,
        start: usize,
        block: usize,
    ) -> CubeTensor<R> {
        quant::dequantise::<R, F, I, BT>([codes, absmax, map], quant::At { start, block })
    }

    fn fused_attention(
        q: CubeTensor<R>,
        k: CubeTensor<R>,
        v: CubeTensor<R>,
        scale: f64,
        causal: bool,
    ) -> AttentionOutput<Self> {
        let (output, lse) = attention::forward(q, k, v, scale, causal);
        AttentionOutput { output, lse }
    }

    fn fused_attention_backward(
        q: CubeTensor<R>,
        k: CubeTensor<R>,
        v: CubeTensor<R>,
        output: CubeTensor<R>,
        lse: CubeTensor<R>,
        d_output: CubeTensor<R>,
        scale: f64,
        causal: bool,
    ) -> AttentionGrads<Self> {
        let operands = [q, k, v, output, lse, d_output];
        let [q, k, v] = attention_backward::backward::<R, F, I, BT>(operands, scale, causal);
        AttentionGrads { q, k, v }
    }

    fn fused_attention_qkv(qkv: CubeTensor<R>, scale: f64, causal: bool) -> AttentionOutput<Self> {
        let (output, lse) = attention::forward_packed(qkv, scale, causal);
        AttentionOutput { output, lse }
    }

    fn fused_attention_qkv_backward(
        qkv: CubeTensor<R>,
        output: CubeTensor<R>,
        lse: CubeTensor<R>,
        d_output: CubeTensor<R>,
        scale: f64,
        causal: bool,
    ) -> CubeTensor<R> {
        attention_backward::backward_packed(qkv, output, lse, d_output, scale, causal)
    }
}
