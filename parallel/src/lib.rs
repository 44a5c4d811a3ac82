//! Wildfire's parallel layer: device meshes, communicators, and the `Distributed<B>` backend
//! decorator that shards Burn tensors transparently.
//!
//! ```text
//! type B = Autodiff<Flex>;                   // before
//! type B = Autodiff<Distributed<Flex>>;      // after: the same model, data parallel
//! let model = replicate(model, &mesh)?;      // once, after building it
//! // ... loss.backward(); let mut grads = GradientsParams::from_grads(g, &model);
//! sync_gradients(&model, &mut grads)?;       // before the optimizer step
//! ```
//!
//! Placement model (PyTorch FSDP2 + DTensor): every float tensor is a [`DTensor`] — this rank's
//! local piece plus one [`Placement`] per mesh axis (`Replicate`, `Shard(dim)`, `Partial(op)`,
//! and, on data axes, `Local`: per-rank batch data). Every op applies a propagation rule
//! (`backend/rules/`) or the counted fallback; see `../shared/ARCHITECTURE.md` §3.

// Layers, bottom to top: a module imports only from the layers below it (`tests.rs` from any).
//
//   error, params → mesh, dims → comm → placement → policy → device → collectives → tensor
//        → backend → data_parallel → fsdp, tensor_parallel, context_parallel, pipeline → optim_state
//        → launch → ranks
//
// - error: the crate's one error type (and `CollectiveKind`, which it names), plain data only;
//   params: walks over a Burn module's parameters with their paths (Burn only).
// - mesh, dims, comm: the device mesh; the run's parallel degrees (`ParallelDims`) and the mesh
//   they make; the communicators (host buffers, and the device-collectives trait) — they know
//   nothing of ranks' devices.
// - placement: layouts (`Placement` per mesh axis).
// - policy: what the strategies tell the backend, as a value the rank holds.
// - device: `DistDevice` and its `RankContext`; collectives: a rank's collectives on its device
//   tensors (device collectives when installed, else the host communicator); tensor: `DTensor`
//   and its redistributions.
// - backend: `Distributed<B>`, its propagation rules and fallback. It reads the policy and never
//   imports a strategy; the strategies call down into it (`backend::gradients_synced`).
// - data_parallel, fsdp, tensor_parallel, context_parallel, pipeline: the strategies, which set
//   the policy
//   (pipeline: its schedules, plain data, and the runner; its ZB split backward sets the
//   rank context's weight-gradient deferral).
// - optim_state: optimizer state as named tensors with layout rules (reads fsdp's state layout).
// - launch, ranks: ranks as threads, MPI processes, threads × processes, or a torchrun-style
//   NCCL process (the process launchers and `NcclCommunicator::install` live in ranks/).
//
// `python3 tools/check_layers.py` checks this order (CI runs it); there is no exception.

mod backend;
mod collectives;
pub mod comm;
mod context_parallel;
mod data_parallel;
mod device;
mod dims;
mod error;
mod expert_parallel;
mod fsdp;
pub mod launch;
pub mod mesh;
mod optim_state;
mod params;
pub mod pipeline;
mod placement;
mod policy;
mod ranks;
pub mod rng;
mod tensor;
mod tensor_parallel;

pub use backend::Distributed;
pub use comm::{
    Bootstrap, CommStats, Communicator, DeviceCollectives, Group, HostStaged, InProcessWorld,
    ReduceOp, TcpRendezvous, exchange_group_ids,
};
#[cfg(feature = "mpi")]
pub use comm::{HybridCommunicator, HybridWorld, MpiCommunicator, MpiWorld};
#[cfg(feature = "cuda")]
pub use comm::{NcclCommunicator, NcclOptions, check_libcuda};
pub use context_parallel::{
    context_columns, context_parallel, context_ranges, without_context_parallel,
};
pub use data_parallel::{
    DistributedBackend, SyncReport, dtensor, fresh_leaves, from_dtensor, offload_parameters,
    redistribute, replicate, sync_gradients,
};
pub use device::{
    DeferredWeights, DeviceBytes, DistDevice, HostBytes, MemoryReport, OpCounters, PrefetchStats,
    RankContext,
};
pub use dims::{CpLayout, CpRotate, ParallelDims};
pub use error::{CollectiveKind, Error};
pub use expert_parallel::{ExpertPlan, expert_parallel};
pub use fsdp::{
    FsdpOptimizer, FsdpStrategy, fully_shard, gradient_bytes, init_sharded, optimizer_state_layout,
    parameter_bytes, planned_layouts, planned_layouts_with_experts, prefetch_parameters,
};
pub use launch::{
    BusyWorkers, LaunchEnv, LaunchOptions, Launcher, busy_workers, busy_workers_for, launch,
};
pub use mesh::{AxisKind, CONTEXT_AXIS, DeviceMesh, EXPERT_AXIS, MeshAxis, PIPELINE_AXIS};
pub use optim_state::{
    EncodedState, MIN_QUANT_SIZE, QUANT_BLOCK, StateCodec, StateShape, StateSpec, adamw_specs,
    blocks_layout, decode_adamw, encode_adamw, state_layout,
};
pub use params::{
    Mapped, ModulePath, ParamMapper, ParamVisitor, TryParamMapper, TryParamVisitor, map_params,
    map_value, try_map_params, try_visit_params, visit_params,
};
pub use placement::{Layout, Placement, create_replicated, for_each_row};
pub use policy::{ContextParallel, GradientReduction, RankPolicy, ShardingPolicy};
pub use ranks::{
    Collectives, DeviceLaunch, HostLaunch, JobSpec, Launch, Launched, check_job, launch_job,
    launch_ranks, launch_ranks_on, rank_device,
};
#[cfg(feature = "cuda")]
pub use ranks::{NcclLaunch, launch_ranks_rendezvous};
#[cfg(feature = "mpi")]
pub use ranks::{launch_ranks_hybrid, launch_ranks_mpi};
pub use tensor::{DTensor, DeferredPiece};
pub use tensor_parallel::{TpPlan, TpStyle, tensor_parallel};

/// For Wildfire's own crates (the engine raises typed errors inside backend ops and marks its
/// recomputation passes); not part of the API.
#[doc(hidden)]
pub mod internal {
    pub use crate::comm::read as read_local;
    pub use crate::device::RecomputeScope;
    pub use crate::error::raise;
}

#[cfg(test)]
mod tests;
