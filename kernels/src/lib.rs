//! Wildfire's fused kernels and the [`FusedOps`] backend extension.
//!
//! Each fused operation is one method of [`FusedOps`], a trait every backend a model trains on
//! implements:
//!
//! * `CubeBackend` (feature `cube`, on by `wgpu`/`cuda`) runs
//!   `#[cube]` kernels written once in the `cube` module and compiled by CubeCL for CUDA, Vulkan (lavapipe
//!   in CI), Metal, …;
//! * `Fusion<B>` (feature `fusion`) registers each op as one custom operation of the fusion
//!   stream, run by `B`'s kernel (the `fusion` module);
//! * `Autodiff<B>` records one graph node per fused op and wires its backward to `B`'s fused
//!   backward kernel ([`autodiff`]);
//! * `Distributed<B>` (in `wildfire-parallel`) applies the op to the local shards under a
//!   placement rule;
//! * every other backend takes the trait's default methods, built from Burn ops
//!   ([`reference`](mod@reference)), so models written against `FusedOps` stay portable, and
//!   the defaults are the references the kernels are tested against;
//! * Flex, the CPU backend, runs native row-parallel loops for LayerNorm, RMSNorm,
//!   GELU-with-bias, the SwiGLU gate, the rotary embedding, cross-entropy, attention, the
//!   optimizer tail and the attention core's causal softmax ([`flex`]).
//!
//! [`FusedOps::FUSED`] says, family by family, which methods are fused on a backend.
//!
//! The tensor-level API is in [`ops`]: `softmax`, `log_softmax`, `layer_norm`, `rms_norm`,
//! `cross_entropy`, `gelu_bias`, `swiglu`, `rope`, `attention`.
//!
//! Shapes: the row ops (softmax, norms, cross-entropy, GELU-with-bias) work on the last dimension
//! of a tensor of rank 1 to 6 (every leading index is a row); the norms' per-row statistics (mean,
//! 1/σ) have the input's shape with a last dimension of 1, so under `Distributed<B>` they keep the
//! input's placement. Cross-entropy takes `[rows, vocab]` logits and gives 1-D per-row values.
//! Attention takes `[batch, heads, seq, head_dim]`, and so does the rotary embedding (its tables
//! `[seq, head_dim]`); the SwiGLU gate is elementwise over two tensors of one shape.

pub mod autodiff;
#[cfg(feature = "cube")]
pub mod cube;
pub mod experts;
pub mod flex;
#[cfg(feature = "fusion")]
pub mod fusion;
pub mod gemm;
pub mod hooks;
pub mod ops;
pub mod packed;
pub mod quant;
pub mod reference;

/// Sorted positions one cube of the CubeCL embedding gradient sums in order: a token's run of up
/// to this many positions is summed exactly as Burn's `select_add` sums it (bit for bit in f32),
/// a longer one in segments this long, then the segments in order (`cube/embedding.rs`).
pub const EMBEDDING_SEGMENT: usize = 32;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};

/// Output of a LayerNorm forward: the normalised tensor and the per-row statistics its backward
/// reads (the input's shape with a last dimension of 1).
#[derive(Debug, Clone)]
pub struct LayerNormOutput<B: Backend> {
    /// `(x − mean)·rstd·γ + β`, the shape of the input.
    pub output: FloatTensor<B>,
    /// Row means.
    pub mean: FloatTensor<B>,
    /// Row reciprocal standard deviations `1/√(var + ε)`.
    pub rstd: FloatTensor<B>,
}

/// Output of a RMSNorm forward.
#[derive(Debug, Clone)]
pub struct RmsNormOutput<B: Backend> {
    /// `x·rstd·γ`, the shape of the input.
    pub output: FloatTensor<B>,
    /// Row reciprocal root-mean-squares `1/√(mean(x²) + ε)`.
    pub rstd: FloatTensor<B>,
}

/// Output of a fused cross-entropy forward.
#[derive(Debug, Clone)]
pub struct CrossEntropyOutput<B: Backend> {
    /// Per-row loss `logsumexp(row) − row[target]`, 0 for ignored rows (negative target). 1-D.
    pub loss: FloatTensor<B>,
    /// Per-row log-sum-exp, kept for the backward (which then never needs the probabilities). 1-D.
    pub lse: FloatTensor<B>,
}

/// Output of a flash-attention forward.
#[derive(Debug, Clone)]
pub struct AttentionOutput<B: Backend> {
    /// `softmax(q·kᵀ·scale [+ causal mask])·v`, `[batch, heads, seq_q, head_dim]`.
    pub output: FloatTensor<B>,
    /// Per-query log-sum-exp of the scaled scores, `[batch, heads, seq_q]` — all the backward
    /// needs to recompute the probabilities key by key in backward.
    pub lse: FloatTensor<B>,
}

/// Gradients of a LayerNorm.
#[derive(Debug, Clone)]
pub struct LayerNormGrads<B: Backend> {
    /// Gradient w.r.t. the input.
    pub x: FloatTensor<B>,
    /// Gradient w.r.t. γ (summed over rows).
    pub gamma: FloatTensor<B>,
    /// Gradient w.r.t. β (summed over rows).
    pub beta: FloatTensor<B>,
}

/// Gradients of an attention call.
#[derive(Debug, Clone)]
pub struct AttentionGrads<B: Backend> {
    /// Gradient w.r.t. the queries.
    pub q: FloatTensor<B>,
    /// Gradient w.r.t. the keys.
    pub k: FloatTensor<B>,
    /// Gradient w.r.t. the values.
    pub v: FloatTensor<B>,
}

/// Output of [`FusedOps::fused_unscale`]: the optimizer tail's first pass.
#[derive(Debug, Clone)]
pub struct UnscaleOutput<B: Backend> {
    /// The gradient times `inv_scale`.
    pub grad: FloatTensor<B>,
    /// `Σ g²` of the unscaled gradient, shape `[1]` (for the global norm; stays on the device).
    pub sum_squares: FloatTensor<B>,
    /// `1` if any unscaled element is infinite or NaN, else `0`, shape `[1]`.
    pub non_finite: FloatTensor<B>,
}

/// Hyper-parameters of one AdamW step (PyTorch's decoupled weight decay:
/// `p ← p·(1 − lr·wd) − lr·m̂/(√v̂ + ε)`, `m̂ = m/(1 − β₁ᵗ)`, `v̂ = v/(1 − β₂ᵗ)`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay β₁.
    pub beta1: f64,
    /// Second-moment decay β₂.
    pub beta2: f64,
    /// ε in the denominator.
    pub epsilon: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// The step number `t`, from 1 (bias correction).
    pub step: u32,
}

/// A parameter and its AdamW moments after [`FusedOps::fused_adamw`].
#[derive(Debug, Clone)]
pub struct AdamWState<B: Backend> {
    /// The parameter.
    pub param: FloatTensor<B>,
    /// First moment.
    pub m: FloatTensor<B>,
    /// Second moment.
    pub v: FloatTensor<B>,
}

/// One parameter's result of [`FusedOps::fused_adamw_many`]: its new parameter and moments, and
/// the new parameter's copy where its entry asked for one.
pub type AdamWResult<B> = (AdamWState<B>, Option<FloatTensor<B>>);

/// One parameter's step in [`FusedOps::fused_adamw_many`].
#[derive(Debug, Clone)]
pub struct AdamWEntry<B: Backend> {
    /// `[param, grad, m, v]`, as [`FusedOps::fused_adamw`] takes them.
    pub operands: [FloatTensor<B>; 4],
    /// Its hyper-parameters and step number.
    pub step: AdamWStep,
    /// The dtype of the new parameter's copy to write too ([`FusedOps::fused_adamw_with_copy`]),
    /// if any.
    pub copy: Option<burn::tensor::FloatDType>,
}

/// Which families of [`FusedOps`] a backend runs as fused kernels ([`FusedOps::FUSED`]), op by
/// op: a CPU backend may have a native LayerNorm and cross-entropy but keep Burn's matmuls for
/// attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fused {
    /// `fused_layer_norm`, forward and backward.
    pub layer_norm: bool,
    /// `fused_rms_norm`, forward and backward.
    pub rms_norm: bool,
    /// `fused_gelu_bias`, forward and backward.
    pub gelu_bias: bool,
    /// `fused_swiglu`, forward and backward.
    pub swiglu: bool,
    /// `fused_rope`, forward and backward.
    pub rope: bool,
    /// `fused_cross_entropy`, forward and backward.
    pub cross_entropy: bool,
    /// `fused_attention` (flash attention), forward and backward.
    pub attention: bool,
    /// The optimizer tail: `fused_unscale` and `fused_adamw`.
    pub optimizer: bool,
}

impl Fused {
    /// Every family on Burn ops.
    pub const NONE: Fused = Fused {
        layer_norm: false,
        rms_norm: false,
        gelu_bias: false,
        swiglu: false,
        rope: false,
        cross_entropy: false,
        attention: false,
        optimizer: false,
    };
    /// Every family fused.
    pub const ALL: Fused = Fused {
        layer_norm: true,
        rms_norm: true,
        gelu_bias: true,
        swiglu: true,
        rope: true,
        cross_entropy: true,
        attention: true,
        optimizer: true,
    };

    /// Whether any family is fused.
    pub const fn any(self) -> bool {
        self.layer_norm
            || self.rms_norm
            || self.gelu_bias
            || self.swiglu
            || self.rope
            || self.cross_entropy
            || self.attention
            || self.optimizer
    }
}

/// `t`'s float dtype.
fn dtype_of<B: Backend>(t: &FloatTensor<B>) -> burn::tensor::FloatDType {
    use burn::tensor::TensorMetadata;
    t.dtype().into()
}

/// `t` in `dtype` (itself when it has it).
fn cast_to<B: Backend>(t: FloatTensor<B>, dtype: burn::tensor::FloatDType) -> FloatTensor<B> {
    if dtype_of::<B>(&t) == dtype {
        t
    } else {
        B::float_cast(t, dtype)
    }
}

/// Fused operations, forward and backward. Every method has a default built from Burn ops (see
/// [`reference`](mod@reference)), so any backend can implement the trait with an empty `impl`; backends with
/// kernels override them.
pub trait FusedOps: Backend {
    /// Which method families run fused kernels on this backend (the rest are the Burn-op
    /// defaults). Models ask this, op by op, to take a fused path only where it pays and keep
    /// their plain Burn ops (and their numerics) elsewhere.
    const FUSED: Fused = Fused::NONE;

    /// Whether this backend computes on the calling thread's rayon pool (a CPU backend: Flex),
    /// so that keeping the pool's other workers awake between its ops pays
    /// (`wildfire_parallel::busy_workers`). A device backend's ops run on the device: the rank's
    /// thread only hands them to CubeCL's device thread, and workers spinning for work that
    /// never comes would take the cores that thread, the driver's and the communication threads
    /// need.
    const COMPUTES_ON_HOST_POOL: bool = false;

    /// The global positions of the `len` sequence positions this rank's activations hold on
    /// `device`: `0..len`, except under context parallelism (a `Distributed` backend with a
    /// context axis), where a rank holds chunks of every sequence. Models take their position
    /// embeddings (learned or rotary) at these.
    fn sequence_positions(device: &burn::tensor::Device<Self>, len: usize) -> Vec<usize> {
        let _ = device;
        (0..len).collect()
    }

    /// `x`, unchanged, carrying an auxiliary `loss` into backward: there `loss` receives the
    /// gradient `w` (every element), as if `w · Σ loss` had been added to the quantity
    /// backward starts from, and `x`'s gradient passes through. This is how a block adds a loss
    /// term (a mixture of experts' load-balancing loss) without a second output: recomputed
    /// blocks and pipeline stages hand on one tensor, as Megatron's `MoEAuxLossAutoScaler`
    /// does. `w` is the factor backward's root carries (the loss scale over the
    /// micro-batches). Without autodiff there is no backward: `x` is returned and `loss` dropped.
    fn carry_loss(x: FloatTensor<Self>, loss: FloatTensor<Self>, w: f64) -> FloatTensor<Self> {
        let _ = (loss, w);
        x
    }

    /// This rank's index on the expert-parallel axis and the axis's size: `(0, 1)` without
    /// expert parallelism (a `Distributed` backend whose mesh has an `ep` axis has one).
    fn expert_axis(device: &burn::tensor::Device<Self>) -> (usize, usize) {
        let _ = device;
        (0, 1)
    }

    /// Every expert-axis member's routing counts (`counts[e]`: the rows it routes to expert
    /// `e`), member-major: what [`experts::ExpertRoute::new`] takes. Without expert
    /// parallelism, `counts` itself.
    fn expert_counts(device: &burn::tensor::Device<Self>, counts: &[usize]) -> Vec<usize> {
        let _ = device;
        counts.to_vec()
    }

    /// `values` summed over the data-parallel ranks (every data axis of a `Distributed`
    /// backend's mesh, not the model axes, whose ranks hold the same values): a mixture of
    /// experts' routing counts over the global batch. Without data parallelism, `values`.
    fn data_sum(device: &burn::tensor::Device<Self>, values: &[usize]) -> Vec<usize> {
        let _ = device;
        values.to_vec()
    }

    /// Expert parallelism's dispatch: this rank's routed rows `[rows, d]`, sorted by expert,
    /// go to the members holding their experts, which regroup what they receive expert by
    /// expert (see [`experts`]): the rows of the rank's experts, `route.groups()` of each.
    /// Without expert parallelism the rows, as they are.
    fn expert_dispatch(x: FloatTensor<Self>, route: &experts::ExpertRoute) -> FloatTensor<Self> {
        experts::regroup::<Self>(x, route)
    }

    /// The gradient of [`FusedOps::expert_dispatch`]'s input from its output's.
    fn expert_dispatch_backward(
        grad: FloatTensor<Self>,
        route: &experts::ExpertRoute,
    ) -> FloatTensor<Self> {
        experts::ungroup::<Self>(grad, route)
    }

    /// Expert parallelism's combine, [`FusedOps::expert_dispatch`]'s adjoint: the experts'
    /// rows back to the ranks that routed them, in their order.
    fn expert_combine(y: FloatTensor<Self>, route: &experts::ExpertRoute) -> FloatTensor<Self> {
        experts::ungroup::<Self>(y, route)
    }

    /// The gradient of [`FusedOps::expert_combine`]'s input from its output's.
    fn expert_combine_backward(
        grad: FloatTensor<Self>,
        route: &experts::ExpertRoute,
    ) -> FloatTensor<Self> {
        experts::regroup::<Self>(grad, route)
    }

    /// The experts' grouped matmul: rows `x [rows, k]` in runs of `groups[l]` rows, run `l`
    /// times `w[l]` (`w [groups, k, n]`, stacked expert weights): `[rows, n]`, each expert on
    /// exactly its rows ([`experts::grouped_matmul`]).
    fn grouped_matmul(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        groups: &[usize],
    ) -> FloatTensor<Self> {
        experts::grouped_matmul::<Self>(x, w, groups)
    }

    /// The gradients `(dx, dw)` of [`FusedOps::grouped_matmul`] from the output's `dy`.
    fn grouped_matmul_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        groups: &[usize],
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        experts::grouped_matmul_backward::<Self>(x, w, dy, groups)
    }

    /// Softmax over the last dimension.
    fn fused_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::softmax::<Self>(x, false)
    }

    /// Causal softmax of attention scores `[b, h, t, s]` over the last dimension: query `i`
    /// keeps keys `j <= i + (s − t)` and gives the others probability exactly 0, as
    /// `mask_fill(−1e9)` then softmax does (a row with no key left is uniform). The
    /// probabilities an attention core keeps or recomputes.
    fn fused_causal_softmax(scores: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::causal_softmax::<Self>(scores)
    }

    /// Gradient of [`FusedOps::fused_softmax`] from its output `y`: `y·(dy − Σ dy·y)`.
    fn fused_softmax_backward(y: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::softmax_backward::<Self>(y, dy, false)
    }

    /// Log-softmax over the last dimension.
    fn fused_log_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::softmax::<Self>(x, true)
    }

    /// Gradient of [`FusedOps::fused_log_softmax`] from its output `y`: `dy − exp(y)·Σ dy`.
    fn fused_log_softmax_backward(
        y: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::softmax_backward::<Self>(y, dy, true)
    }

    /// LayerNorm over the last dimension with affine `γ`, `β` (1-D, the last dimension's size).
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> LayerNormOutput<Self> {
        reference::layer_norm::<Self>(x, gamma, beta, epsilon)
    }

    /// [`FusedOps::fused_layer_norm`] with the output in `dtype` — the precision policy's
    /// compute dtype, what the next matmul reads — and the statistics f32 as ever: the cast of
    /// its output, bit for bit. Kernels write it in `dtype` directly (one pass fewer over the
    /// activations); the default casts.
    fn fused_layer_norm_as(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        dtype: burn::tensor::FloatDType,
    ) -> LayerNormOutput<Self> {
        let mut out = Self::fused_layer_norm(x, gamma, beta, epsilon);
        out.output = cast_to::<Self>(out.output, dtype);
        out
    }

    /// Gradients of [`FusedOps::fused_layer_norm`] from the kept statistics.
    fn fused_layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> LayerNormGrads<Self> {
        reference::layer_norm_backward::<Self>(x, gamma, mean, rstd, dy)
    }

    /// RMSNorm over the last dimension with scale `γ`.
    fn fused_rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
    ) -> RmsNormOutput<Self> {
        reference::rms_norm::<Self>(x, gamma, epsilon)
    }

    /// [`FusedOps::fused_rms_norm`] with the output in `dtype`, as
    /// [`FusedOps::fused_layer_norm_as`].
    fn fused_rms_norm_as(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
        dtype: burn::tensor::FloatDType,
    ) -> RmsNormOutput<Self> {
        let mut out = Self::fused_rms_norm(x, gamma, epsilon);
        out.output = cast_to::<Self>(out.output, dtype);
        out
    }

    /// [`FusedOps::fused_layer_norm_backward`] with `dy` in its own dtype (under the precision
    /// policy a matmul's input gradient, in the compute dtype, while `x` is f32): kernels read it
    /// as it is, one pass over the gradient fewer; the default casts it to `x`'s dtype first.
    /// For an f32 `x` the numbers are the same either way (widening is exact).
    ///
    /// The operands are [`FusedOps::fused_layer_norm_backward`]'s: `[x, gamma, mean, rstd, dy]`.
    fn fused_layer_norm_backward_any(operands: [FloatTensor<Self>; 5]) -> LayerNormGrads<Self> {
        let [x, gamma, mean, rstd, dy] = operands;
        let dy = cast_to::<Self>(dy, dtype_of::<Self>(&x));
        Self::fused_layer_norm_backward(x, gamma, mean, rstd, dy)
    }

    /// Gradients `(dx, dγ)` of [`FusedOps::fused_rms_norm`].
    fn fused_rms_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::rms_norm_backward::<Self>(x, gamma, rstd, dy)
    }

    /// [`FusedOps::fused_rms_norm_backward`] with `dy` in its own dtype, as
    /// [`FusedOps::fused_layer_norm_backward_any`].
    ///
    /// The operands are [`FusedOps::fused_rms_norm_backward`]'s: `[x, gamma, rstd, dy]`.
    fn fused_rms_norm_backward_any(
        operands: [FloatTensor<Self>; 4],
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let [x, gamma, rstd, dy] = operands;
        let dy = cast_to::<Self>(dy, dtype_of::<Self>(&x));
        Self::fused_rms_norm_backward(x, gamma, rstd, dy)
    }

    /// Cross-entropy of `logits` `[rows, vocab]` against integer `targets` `[rows]`, fused with
    /// the log-softmax: per-row loss and log-sum-exp, no probability tensor. A negative target
    /// marks an ignored row (loss 0, gradient 0), like PyTorch's `ignore_index = -100`.
    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> CrossEntropyOutput<Self> {
        reference::cross_entropy::<Self>(logits, targets)
    }

    /// Gradient w.r.t. the logits of [`FusedOps::fused_cross_entropy`] for per-row upstream
    /// gradients `dloss` `[rows]`: `dloss·(exp(logits − lse) − onehot(target))`, one pass over the
    /// logits.
    fn fused_cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::cross_entropy_backward::<Self>(logits, targets, lse, dloss)
    }

    /// The rows of `table` `[rows, d]` at `ids` `[batch, seq]`: `[batch, seq, d]` (Burn's
    /// `embedding`; every backend looks up with Burn's op, the backward is what differs).
    fn fused_embedding(table: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        <Self as burn::tensor::ops::ModuleOps<Self>>::embedding(table, ids)
    }

    /// The gradient of [`FusedOps::fused_embedding`] w.r.t. the table (only `table`'s shape is
    /// read): each row of `grad` `[batch, seq, d]` added into its id's row of a zero table in
    /// `grad`'s dtype, in position order — the sums of Burn's `embedding_backward`, bitwise in
    /// f32. CubeCL backends sort the positions by id and sum each id's rows in one cube (see
    /// `cube/embedding.rs`) instead of Burn's one unit per column over every position.
    fn fused_embedding_backward(
        table: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        ids: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        <Self as burn::tensor::ops::ModuleOps<Self>>::embedding_backward(table, grad, ids)
    }

    /// `gelu(x + bias)` with `bias` broadcast over the last dimension: the exact (erf) form, or
    /// with `tanh` the tanh approximation (GPT-2's `gelu_new`, PyTorch's `approximate="tanh"`).
    fn fused_gelu_bias(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        tanh: bool,
    ) -> FloatTensor<Self> {
        reference::gelu_bias::<Self>(x, bias, tanh)
    }

    /// Gradients `(dx, dbias)` of [`FusedOps::fused_gelu_bias`].
    fn fused_gelu_bias_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        tanh: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::gelu_bias_backward::<Self>(x, bias, dy, tanh)
    }

    /// The SwiGLU gate `silu(gate) ⊙ up` (`silu(g) = g·σ(g)`), elementwise over two tensors of
    /// one shape: the Llama MLP's activation between its gate/up and down projections.
    fn fused_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::swiglu::<Self>(gate, up)
    }

    /// Gradients `(dgate, dup)` of [`FusedOps::fused_swiglu`]: `dup = dy·silu(g)`,
    /// `dgate = dy·up·σ(g)·(1 + g·(1 − σ(g)))`.
    fn fused_swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::swiglu_backward::<Self>(gate, up, dy)
    }

    /// Rotary position embedding of `x` `[batch, heads, seq, head_dim]` in Hugging Face's
    /// rotate-half convention: `x·cos + rotate_half(x)·sin` with `rotate_half([x₁, x₂]) =
    /// [−x₂, x₁]` (the two halves of each head's dims), tables `cos`, `sin` `[seq, head_dim]` in
    /// `x`'s dtype (row `p` for the token at position `p` of the sequence dim).
    fn fused_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::rope::<Self>(x, cos, sin, false)
    }

    /// The gradient of [`FusedOps::fused_rope`] w.r.t. `x`: the transposed rotation,
    /// `dx₁ = dy₁·cos₁ + dy₂·sin₂`, `dx₂ = dy₂·cos₂ − dy₁·sin₁` (the tables are constants).
    fn fused_rope_backward(
        dy: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::rope::<Self>(dy, cos, sin, true)
    }

    /// Attention `softmax(q·kᵀ·scale)·v` over `[batch, heads, seq, head_dim]`, causal (query `i`
    /// sees keys `0..=i`; needs `seq_q == seq_k`) or not. The kernel never materialises the
    /// `seq × seq` scores (online softmax).
    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> AttentionOutput<Self> {
        reference::attention::<Self>(q, k, v, scale, causal)
    }

    /// Gradients of [`FusedOps::fused_attention`] from its output and log-sum-exp; the kernel
    /// recomputes the probabilities from `lse` (one unit per query row for dQ, one per key row for
    /// dK and dV; no shared-memory tiling yet).
    #[allow(clippy::too_many_arguments)]
    fn fused_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        output: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_output: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> AttentionGrads<Self> {
        reference::attention_backward::<Self>(q, k, v, output, lse, d_output, scale, causal)
    }

    /// [`FusedOps::fused_attention`] on packed projections `qkv` `[b, t, h, 3·hd]` (per head:
    /// queries, keys, values side by side): output `[b, t, h, hd]` and log-sum-exp `[b, t, h]`,
    /// with no split of `qkv` and no layout change of the output where the backend implements it
    /// natively. The default splits and calls [`FusedOps::fused_attention`].
    fn fused_attention_qkv(
        qkv: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> AttentionOutput<Self> {
        packed::attention::<Self>(qkv, scale, causal)
    }

    /// The gradient of [`FusedOps::fused_attention_qkv`] w.r.t. `qkv`, packed like it.
    fn fused_attention_qkv_backward(
        qkv: FloatTensor<Self>,
        output: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_output: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> FloatTensor<Self> {
        packed::attention_backward::<Self>(qkv, output, lse, d_output, scale, causal)
    }

    /// The optimizer tail's first pass over a gradient: unscale by `inv_scale` (the loss
    /// scaler's `1/scale`), sum of squares and non-finite flag, in one pass.
    fn fused_unscale(grad: FloatTensor<Self>, inv_scale: f64) -> UnscaleOutput<Self> {
        reference::unscale::<Self>(grad, inv_scale)
    }

    /// The optimizer tail's first pass over every gradient of a step at once (`grads` not
    /// empty): each unscaled by `inv_scale` as [`FusedOps::fused_unscale`] does, and one `[2]`
    /// f32 tensor `[non-finite flag (1 or 0), Σᵢ Σ g²ᵢ / copiesᵢ]` (`copies[i]`: how many ranks
    /// hold gradient `i`'s piece, so the sum over the mesh counts it once). The default runs
    /// `fused_unscale` per gradient and combines on the device (on a GPU about six launches per
    /// gradient); CubeCL backends write every gradient's partial sums into one buffer and fold
    /// it once (a launch per gradient, then one).
    fn fused_unscale_all(
        grads: Vec<FloatTensor<Self>>,
        copies: &[usize],
        inv_scale: f64,
    ) -> (Vec<FloatTensor<Self>>, FloatTensor<Self>) {
        reference::unscale_all::<Self>(grads, copies, inv_scale)
    }

    /// One AdamW step on `param` with moments `m`, `v`, for the gradient `grad · grad_scale`
    /// (`grad_scale` `[1]`: a clipping coefficient kept on the device), predicated on `skip`
    /// (`[1]`; non-zero — an overflowed step — returns the inputs unchanged), so a skipped step
    /// never leaves the device.
    #[allow(clippy::too_many_arguments)]
    fn fused_adamw(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        grad_scale: FloatTensor<Self>,
        skip: FloatTensor<Self>,
        step: AdamWStep,
    ) -> AdamWState<Self> {
        reference::adamw::<Self>(param, grad, m, v, grad_scale, skip, step)
    }

    /// [`FusedOps::fused_adamw`] that also hands back the new parameter in `copy` — the
    /// precision policy's compute dtype: the copy the next forward's matmuls read, which would
    /// otherwise be cast from it in a launch of its own per parameter and step (as
    /// `torch.autocast` re-casts each weight). Backends with kernels write it in the same pass;
    /// it is the parameter's cast, bit for bit.
    ///
    /// The operands are [`FusedOps::fused_adamw`]'s, in its order: `[param, grad, m, v,
    /// grad_scale, skip]`.
    fn fused_adamw_with_copy(
        operands: [FloatTensor<Self>; 6],
        step: AdamWStep,
        copy: burn::tensor::FloatDType,
    ) -> (AdamWState<Self>, FloatTensor<Self>) {
        let [param, grad, m, v, grad_scale, skip] = operands;
        let out = Self::fused_adamw(param, grad, m, v, grad_scale, skip, step);
        let cast = cast_to::<Self>(out.param.clone(), copy);
        (out, cast)
    }

    /// Several AdamW steps sharing `grad_scale` and `skip` (each entry's
    /// [`FusedOps::fused_adamw`], or [`FusedOps::fused_adamw_with_copy`] where it asks for a
    /// copy), in the entries' order: a multi-tensor AdamW, as PyTorch's `fused=True`. Backends
    /// with kernels run many parameters per launch ([`FusedOps::adamw_batch`]); every result is
    /// the single step's bit for bit.
    fn fused_adamw_many(
        entries: Vec<AdamWEntry<Self>>,
        grad_scale: FloatTensor<Self>,
        skip: FloatTensor<Self>,
    ) -> Vec<AdamWResult<Self>> {
        entries
            .into_iter()
            .map(|e| {
                let [param, grad, m, v] = e.operands;
                let (scale, skip) = (grad_scale.clone(), skip.clone());
                match e.copy {
                    Some(c) => {
                        let operands = [param, grad, m, v, scale, skip];
                        let (out, copy) = Self::fused_adamw_with_copy(operands, e.step, c);
                        (out, Some(copy))
                    }
                    None => (
                        Self::fused_adamw(param, grad, m, v, scale, skip, e.step),
                        None,
                    ),
                }
            })
            .collect()
    }

    /// How many parameters [`FusedOps::fused_adamw_many`] runs per launch on `like`'s device: 1
    /// where batching gains nothing (a CPU backend updates each parameter in place as it comes),
    /// so the optimizer runs each step at once.
    fn adamw_batch(_like: &FloatTensor<Self>) -> usize {
        1
    }

    /// 8-bit optimizer state ([`quant`](mod@quant)): the largest magnitude of each block of
    /// `block` elements the flat piece `x` (flat indices `start ..` of its tensor) overlaps, in
    /// a `[total]` vector with zeros for the other blocks.
    fn blockwise_absmax(
        x: FloatTensor<Self>,
        start: usize,
        block: usize,
        total: usize,
    ) -> FloatTensor<Self> {
        quant::absmax::<Self>(x, start, block, total)
    }

    /// The 8-bit codes of the flat piece `x` against the tensor's block scales `absmax`
    /// (`[total]`) and the 255 midpoints `mids` of a sorted 256-value map, as `dtype`:
    /// bitsandbytes' `quantize_blockwise` (see [`quant::quantise`]).
    fn blockwise_quantise(
        x: FloatTensor<Self>,
        absmax: FloatTensor<Self>,
        mids: FloatTensor<Self>,
        start: usize,
        block: usize,
        dtype: burn::tensor::IntDType,
    ) -> IntTensor<Self> {
        quant::quantise::<Self>(x, absmax, mids, start, block, dtype)
    }

    /// `kept` where the `[1]` flag `skip` is non-zero, else `new` (an 8-bit state's codes after
    /// a step the loss scaler skipped keep their old values), without reading the flag on the
    /// host: the default masks element by element.
    fn int_unless_skipped(
        new: IntTensor<Self>,
        kept: IntTensor<Self>,
        skip: FloatTensor<Self>,
    ) -> IntTensor<Self> {
        quant::unless_skipped::<Self>(new, kept, skip)
    }

    /// The values of a flat piece's codes: `map[code] · absmax[block]`.
    fn blockwise_dequantise(
        codes: IntTensor<Self>,
        absmax: FloatTensor<Self>,
        map: FloatTensor<Self>,
        start: usize,
        block: usize,
    ) -> FloatTensor<Self> {
        quant::dequantise::<Self>(codes, absmax, map, start, block)
    }
}

/// The shape of the norms' per-row statistics: the input's with a last dimension of 1.
pub(crate) fn stats_shape(shape: &burn::tensor::Shape) -> burn::tensor::Shape {
    let mut dims = shape.to_vec();
    if let Some(last) = dims.last_mut() {
        *last = 1;
    }
    burn::tensor::Shape::from(dims)
}
