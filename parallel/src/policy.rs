//! What the backend needs to know of the parallelism strategies above it, as a typed value the
//! rank holds ([`RankContext`](crate::RankContext)): the strategies (`fully_shard`) set it, the
//! backend reads it, and neither imports the other.

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
