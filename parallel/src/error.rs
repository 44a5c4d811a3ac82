//! Typed errors of the `Distributed<B>` decorator.

use crate::comm::CommError;
use crate::mesh::MeshError;
use crate::placement::Placement;

/// What can go wrong when placing, redistributing or training with distributed tensors.
///
/// Public functions return it; backend ops (which cannot return a `Result` in Burn's API) panic
/// with it as the message, and the launcher ([`crate::launch_ranks`]) turns that back into this
/// value ([`crate::LaunchError::Dist`]), so a test or a binary always sees the typed error.
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
pub enum DistError {
    /// A collective failed (timeout, a dead peer, a mismatched schedule).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A mesh problem.
    #[error(transparent)]
    Mesh(#[from] MeshError),
    /// A tensor dimension does not divide by the number of shards.
    #[error(
        "cannot shard {what}: dimension {dim} has size {size}, which does not divide into {shards} \
         shards; choose a mesh axis size that divides it (uneven shards are not supported: FSDP pads \
         flat parameters instead)"
    )]
    Indivisible {
        /// What was being sharded.
        what: String,
        /// The tensor dimension.
        dim: usize,
        /// Its global size.
        size: usize,
        /// The number of shards asked for.
        shards: usize,
    },
    /// A layout that does not fit the tensor or the mesh.
    #[error("invalid layout for a tensor of shape {shape:?} on mesh {mesh}: {reason}")]
    InvalidLayout {
        /// The tensor's global shape.
        shape: Vec<usize>,
        /// The mesh.
        mesh: String,
        /// What is wrong.
        reason: String,
    },
    /// A redistribution that has no meaning (e.g. from per-rank `Local` data to a global layout).
    #[error("cannot redistribute on mesh axis '{axis}' from {from:?} to {to:?}: {reason}")]
    InvalidRedistribution {
        /// The mesh axis.
        axis: String,
        /// The current placement.
        from: Placement,
        /// The requested placement.
        to: Placement,
        /// Why not.
        reason: String,
    },
    /// A parameter is used as per-rank data on a data-parallel axis of size > 1: the model was not
    /// given a placement (`replicate` / `fully_shard`) after it was built.
    #[error(
        "{op}: a parameter of shape {shape:?} is per-rank (`Local`) on data axis '{axis}' of size \
         {size}; call `wildfire_parallel::replicate(model, &mesh)` (or `fully_shard`) after building \
         the model"
    )]
    UnplacedParameter {
        /// The op that received it.
        op: &'static str,
        /// Its shape.
        shape: Vec<usize>,
        /// The data axis.
        axis: String,
        /// The axis size.
        size: usize,
    },
    /// A forward pass started after a backward pass whose gradients were never synchronised.
    #[error(
        "{op}: the gradients of the previous backward pass were not synchronised across the \
         data-parallel axes; call `wildfire_parallel::sync_gradients(&model, &mut grads)` between \
         `backward()` and the optimizer step"
    )]
    GradientsNotSynced {
        /// The op that noticed.
        op: &'static str,
    },
    /// A rank's tensors outgrew its memory budget (`RankPolicy::memory_budget`).
    #[error(
        "rank {rank} needs {bytes} bytes of tensors, over its budget of {budget} bytes: shard more \
         (--fsdp full), use more ranks, or recompute activations (--recompute full)"
    )]
    MemoryBudget {
        /// The rank.
        rank: usize,
        /// Its live bytes when the budget was crossed.
        bytes: u64,
        /// The budget.
        budget: u64,
    },
    /// A gradient could not be reduced to its parameter's placement.
    #[error("parameter {param} (shape {shape:?}): {reason}")]
    UnreducedGradient {
        /// The parameter id.
        param: String,
        /// Its shape.
        shape: Vec<usize>,
        /// Why.
        reason: String,
    },
}

thread_local! {
    static RAISED: std::cell::RefCell<Option<DistError>> = const { std::cell::RefCell::new(None) };
}

/// Raise a [`DistError`] from inside a backend op (which cannot return a `Result`): a panic whose
/// message is the error, with the typed value kept for [`crate::launch_ranks`] to return.
#[track_caller]
pub fn raise(error: impl Into<DistError>) -> ! {
    let error = error.into();
    RAISED.with(|r| *r.borrow_mut() = Some(error.clone()));
    panic!("{error}")
}

/// The error this thread raised last, if any.
pub(crate) fn take_raised() -> Option<DistError> {
    RAISED.with(|r| r.borrow_mut().take())
}
