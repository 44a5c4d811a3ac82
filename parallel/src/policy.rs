//! A rank's policy for a run, as a typed value its [`RankContext`](crate::RankContext) holds:
//! precision, memory budget, and what the backend needs to know of the parallelism strategies
//! above it. The user and the strategies (`tensor_parallel`, `fully_shard`) set it, the backend
//! reads it, and neither imports the other.

use burn_backend::FloatDType;

use crate::dims::{CpLayout, CpRotate};

/// A rank's policy for a run: set once per run with
/// [`RankContext::set_policy`](crate::RankContext::set_policy), before the parallelism
/// transforms, which fill in their parts ([`tensor_parallel`](crate::tensor_parallel): the
/// sequence parallelism; [`fully_shard`](crate::fully_shard): the sharding). The default: no
/// casting, no budget, no sequence parallelism, everything replicated.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankPolicy {
    /// The precision policy, as `torch.autocast` runs it: matmuls, linear layers and attention
    /// (forward and backward) compute in this dtype, and what they produce stays in it — the
    /// activations between matmuls, their input gradients — while the weight gradients come
    /// back in f32: parameters, gradients and optimizer state stay f32 (master weights). Each
    /// operand value is cast at most once, its copy kept with it (an f32 weight: once per step,
    /// whatever the micro-batches and backward passes that use it); LayerNorm, softmax and the
    /// loss compute their statistics in f32, a norm hands its output on in this dtype, the loss
    /// comes back f32, and an elementwise op meeting two dtypes (the f32 residual stream and a
    /// bf16 branch) computes in the wider. Every cast is counted
    /// ([`OpCounters::casts`](crate::OpCounters)). `None`: no casting.
    pub compute_dtype: Option<FloatDType>,
    /// Reduce data-parallel gradients in this dtype (e.g. bf16: half the bytes on the wire; the
    /// in-process communicator accumulates in f32 and rounds once), casting back to the
    /// gradients' own dtype after the collective. `None`: the gradients' dtype (f32 master
    /// gradients).
    pub grad_reduce_dtype: Option<FloatDType>,
    /// Megatron sequence parallelism over this model axis (`None`: off): where a partial sum of
    /// a `[b, t, d]` activation meets a residual add, or a column-parallel layer's input gradient
    /// is reduced, it is reduce-scattered over the sequence (dim 1) instead of all-reduced, so
    /// LayerNorm, dropout and the residual stream hold `1/size` of the sequence; column-parallel
    /// layers all-gather their input. Set by `tensor_parallel` from a plan with
    /// `TpStyle::SequenceParallel`.
    pub sequence_parallel: Option<usize>,
    /// Sequence parallelism's trade between memory and communication. Off (the default, as
    /// Megatron-LM does): a column-parallel layer keeps its sequence-sharded input for backward
    /// and all-gathers it again for its weight gradient — per block 4 all-gathers + 2
    /// reduce-scatters in backward. On: the forward's gather is kept with the sharded value
    /// (counted in the live bytes) and reused — 2 all-gathers + 2 reduce-scatters each way, at
    /// the memory of the gathered inputs of the column-parallel layers (`2·b·t·d` per block).
    /// Inputs used by several layers (burn-nn's separate q, k, v projections) are then also
    /// gathered once in forward. Set by `tensor_parallel` from `TpPlan::keep_sequence_gathers`.
    pub keep_sequence_gathers: bool,
    /// A per-rank budget on the bytes of live tensors (the accounting behind
    /// [`RankContext::live_bytes`](crate::RankContext::live_bytes)): an op that would cross it
    /// fails the rank with [`Error::MemoryBudget`](crate::Error::MemoryBudget) (and the
    /// world with it). `None` (or 0): no budget.
    pub memory_budget: Option<u64>,
    /// How parameters, gradients and optimizer state rest on the data axes. Set by `fully_shard`.
    pub sharding: ShardingPolicy,
    /// FSDP prefetch: how many parameter all-gathers may be in flight ahead of the one in use,
    /// issued in the order the last step gathered them (see
    /// [`prefetch_parameters`](crate::prefetch_parameters)); 0: gather each when it is needed.
    pub prefetch: usize,
    /// Asynchronous gradient reductions: a data-parallel gradient reduced where it is born
    /// (FSDP / ZeRO-2 / HSDP's reduce-scatter) is issued on the rank's communication queue and
    /// waited for at its first use, so backward goes on while it runs; at most this many are
    /// outstanding (the oldest is waited for beyond). 0: each reduction blocks.
    pub reduce_in_flight: usize,
    /// DDP gradient buckets: replicated parameters' gradients (DDP, ZeRO-1) all-reduced where
    /// they are born, in flat buckets of this many bytes (PyTorch DDP's 25 MB), instead of one
    /// call per parameter in `sync_gradients`; with `reduce_in_flight` above 0 a bucket runs
    /// while backward goes on. 0: reduced in `sync_gradients` (a tied parameter's gradients are
    /// then summed before their one reduction; with buckets each is reduced, then summed).
    pub bucket_bytes: usize,
    /// Context parallelism (`None`: off): every sequence is split over this data axis as the
    /// layout says, and attention meets the other members' keys and values as the rotation
    /// says. Set by [`context_parallel`](crate::context_parallel).
    pub context: Option<ContextParallel>,
    /// Expert parallelism: the global shapes of the stacked expert weights, split `Shard(0)`
    /// over the mesh's expert axis; their gradients and optimizer state keep that split (they
    /// are the model's only parameters of rank 3). Set by
    /// [`expert_parallel`](crate::expert_parallel).
    pub expert_shapes: std::collections::BTreeSet<Vec<usize>>,
}

/// Context parallelism over one data axis of the mesh (see [`RankPolicy::context`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextParallel {
    /// The context axis.
    pub axis: usize,
    /// Which chunks of each sequence a member holds.
    pub layout: CpLayout,
    /// How attention meets the other members' keys and values.
    pub rotate: CpRotate,
}

/// How a rank's parameters, gradients and optimizer state are spread over the data axes. Set by
/// [`fully_shard`](crate::fully_shard); the default (no strategy applied, or
/// [`replicate`](crate::replicate)) is everything replicated, gradients reduced where they are
/// born.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardingPolicy {
    /// Data axes over which parameters rest sharded (`Shard(0)`), gathered for use: ZeRO-3 / FSDP,
    /// HSDP's shard axis.
    pub(crate) param_shard_axes: Vec<usize>,
    /// Data axes on which a gradient whose first dimension divides is reduce-scattered into
    /// `Shard(0)` (ZeRO-2/3, HSDP's shard axis); on the others it is all-reduced.
    pub(crate) grad_shard_axes: Vec<usize>,
    /// Data axes over which the optimizer state is sharded (ZeRO-1/2/3, HSDP's shard axis).
    pub(crate) optimizer_shard_axes: Vec<usize>,
    /// When data-parallel gradients are reduced.
    pub(crate) gradient_reduction: GradientReduction,
    /// The global shapes of the parameters [`crate::fully_shard`] laid out: a 2-D gradient whose
    /// shape is no parameter's but whose transpose is one's (a tied embedding used as the head's
    /// weight) is reduce-scattered along dim 1, the parameter's own dim 0.
    pub(crate) param_shapes: std::collections::BTreeSet<Vec<usize>>,
}

/// When a rank reduces its data-parallel gradients.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GradientReduction {
    /// Where each gradient is born, in backward (reduce-scattered where it is sharded, so
    /// full-size gradients never pile up).
    #[default]
    WhereBorn,
    /// Replicated gradients are kept as per-rank summands and all-reduced once per step by
    /// [`sync_gradients`](crate::sync_gradients), as PyTorch DDP's buckets do: a parameter used
    /// twice (a tied embedding) then costs one all-reduce, not one per use.
    AtSync,
}

impl ShardingPolicy {
    /// A policy from where each part rests (what `fully_shard` sets for a strategy).
    pub(crate) fn new(
        param_shard_axes: Vec<usize>,
        grad_shard_axes: Vec<usize>,
        optimizer_shard_axes: Vec<usize>,
        gradient_reduction: GradientReduction,
    ) -> Self {
        Self {
            param_shard_axes,
            grad_shard_axes,
            optimizer_shard_axes,
            gradient_reduction,
            param_shapes: Default::default(),
        }
    }

    /// Data axes over which parameters rest sharded.
    pub fn param_shard_axes(&self) -> &[usize] {
        &self.param_shard_axes
    }

    /// Data axes on which gradients are reduce-scattered into `Shard(0)`.
    pub fn grad_shard_axes(&self) -> &[usize] {
        &self.grad_shard_axes
    }

    /// Data axes over which the optimizer state is sharded.
    pub fn optimizer_shard_axes(&self) -> &[usize] {
        &self.optimizer_shard_axes
    }

    /// When data-parallel gradients are reduced.
    pub fn gradient_reduction(&self) -> GradientReduction {
        self.gradient_reduction
    }
}
