//! Collectives over the inner backend's own device buffers, beside the host [`Communicator`].
//!
//! The [`Communicator`] trait moves host buffers ([`TensorData`]): right for ranks as threads
//! and for MPI between CPU processes, but on GPUs every collective would cost a device → host →
//! device round trip. A rank can therefore install [`DeviceCollectives`] for its inner backend
//! ([`RankContext::set_device_collectives`](crate::RankContext::set_device_collectives)): the
//! redistributions of `Distributed<B>` (FSDP gathers, gradient reductions, tensor-parallel
//! partial sums, broadcasts) then hand the backend's tensors to it as they are, and only the
//! host-side calls (a norm's scalar, a barrier, checkpoint gathers) keep using the host
//! communicator. NCCL on CUDA ([`NcclCommunicator`](super::NcclCommunicator), feature `cuda`) is
//! the implementation this exists for.
//!
//! Implementations only see dim 0: [`all_gather`] and [`reduce_scatter`] move the requested
//! dimension to the front with a stride permutation (`swap_dims`, no copy) and back, so a
//! collective library's flat buffer semantics (NCCL's) serve every dimension.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use burn::tensor::TensorData;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorMetadata};

use super::buffer::{check_dim, check_divisible};
use super::{CollectiveKind, CommError, CommStats, Communicator, Group, ReduceOp};
use crate::device::DistDevice;

/// Collectives on `B`'s device tensors, with the semantics of [`Communicator`] restricted to
/// dim 0. Every member of the group calls the same sequence (SPMD). Implementations count
/// their calls with [`CommStats`]' byte conventions, in their own [`DeviceCollectives::stats`]
/// or in the host communicator's; [`RankContext::comm_stats`](crate::RankContext::comm_stats)
/// reads both.
pub trait DeviceCollectives<B: Backend>: Send + Sync + fmt::Debug {
    /// The calls counted here rather than by the host communicator (default: none).
    fn stats(&self) -> CommStats {
        CommStats::default()
    }

    /// Every member gets the element-wise reduction of all members' tensors (same shape).
    fn all_reduce(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
        op: ReduceOp,
    ) -> Result<FloatTensor<B>, CommError>;

    /// The concatenation along dim 0 of every member's tensor, in group order. Members' shapes
    /// agree except on dim 0.
    fn all_gather_first(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
    ) -> Result<FloatTensor<B>, CommError>;

    /// Reduce, then this member's chunk along dim 0 (the caller checked divisibility).
    fn reduce_scatter_first(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
        op: ReduceOp,
    ) -> Result<FloatTensor<B>, CommError>;

    /// Every member gets the tensor of the member at group index `root`; the others pass a
    /// tensor of the same shape and dtype as the receive buffer.
    fn broadcast(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
        root: usize,
    ) -> Result<FloatTensor<B>, CommError>;
}

/// The host path written as [`DeviceCollectives`]: read the tensor, call the host communicator
/// (which counts the call in its statistics), upload the result. It is what runs when nothing
/// is installed; installed explicitly it lets a test check the device path's dispatch and
/// dimension handling on any backend (CPU included), and it counts the calls it was given
/// ([`HostStaged::calls`]).
pub struct HostStaged {
    comm: Arc<dyn Communicator>,
    calls: Mutex<BTreeMap<CollectiveKind, u64>>,
}

impl HostStaged {
    /// Collectives through `comm`, staged through host memory.
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        Self {
            comm,
            calls: Mutex::default(),
        }
    }

    /// How many calls of each kind went through these collectives.
    pub fn calls(&self) -> BTreeMap<CollectiveKind, u64> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn staged<B: Backend>(
        &self,
        kind: CollectiveKind,
        tensor: FloatTensor<B>,
        call: impl FnOnce(&dyn Communicator, TensorData) -> Result<TensorData, CommError>,
    ) -> Result<FloatTensor<B>, CommError> {
        *self
            .calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(kind)
            .or_default() += 1;
        let device = B::float_device(&tensor);
        stage::<B>(&*self.comm, &device, tensor, call)
    }
}

impl fmt::Debug for HostStaged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostStaged(rank {})", self.comm.rank())
    }
}

/// Read `tensor`, run `call` on the host communicator, upload the result to `device`.
fn stage<B: Backend>(
    comm: &dyn Communicator,
    device: &B::Device,
    tensor: FloatTensor<B>,
    call: impl FnOnce(&dyn Communicator, TensorData) -> Result<TensorData, CommError>,
) -> Result<FloatTensor<B>, CommError> {
    let data = call(comm, crate::tensor::read::<B>(tensor))?;
    Ok(B::float_from_data(data, device))
}

impl<B: Backend> DeviceCollectives<B> for HostStaged {
    fn all_reduce(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
        op: ReduceOp,
    ) -> Result<FloatTensor<B>, CommError> {
        self.staged::<B>(CollectiveKind::AllReduce, tensor, |c, d| {
            c.all_reduce(group, d, op)
        })
    }

    fn all_gather_first(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
    ) -> Result<FloatTensor<B>, CommError> {
        self.staged::<B>(CollectiveKind::AllGather, tensor, |c, d| {
            c.all_gather(group, d, 0)
        })
    }

    fn reduce_scatter_first(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
        op: ReduceOp,
    ) -> Result<FloatTensor<B>, CommError> {
        self.staged::<B>(CollectiveKind::ReduceScatter, tensor, |c, d| {
            c.reduce_scatter(group, d, 0, op)
        })
    }

    fn broadcast(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
        root: usize,
    ) -> Result<FloatTensor<B>, CommError> {
        self.staged::<B>(CollectiveKind::Broadcast, tensor, |c, d| {
            c.broadcast(group, Some(d), root)
        })
    }
}

/// The host path of a rank: through its host communicator.
fn host<B: Backend>(
    device: &DistDevice<B>,
    tensor: FloatTensor<B>,
    call: impl FnOnce(&dyn Communicator, TensorData) -> Result<TensorData, CommError>,
) -> Result<FloatTensor<B>, CommError> {
    stage::<B>(device.context().comm(), device.inner(), tensor, call)
}

/// All-reduce of this rank's tensor on `group`: on the installed device collectives, else
/// through the host communicator.
pub(crate) fn all_reduce<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    tensor: FloatTensor<B>,
    op: ReduceOp,
) -> Result<FloatTensor<B>, CommError> {
    match device.context().device_collectives::<B>() {
        Some(dc) => dc.all_reduce(group, tensor, op),
        None => host(device, tensor, |c, d| c.all_reduce(group, d, op)),
    }
}

/// All-gather along `dim` (see [`Communicator::all_gather`]).
pub(crate) fn all_gather<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    tensor: FloatTensor<B>,
    dim: usize,
) -> Result<FloatTensor<B>, CommError> {
    match device.context().device_collectives::<B>() {
        Some(dc) => {
            check_dim(CollectiveKind::AllGather, tensor.shape().num_dims(), dim)?;
            if dim == 0 {
                return dc.all_gather_first(group, tensor);
            }
            let gathered = dc.all_gather_first(group, B::float_swap_dims(tensor, 0, dim))?;
            Ok(B::float_swap_dims(gathered, 0, dim))
        }
        None => host(device, tensor, |c, d| c.all_gather(group, d, dim)),
    }
}

/// Reduce-scatter along `dim` (see [`Communicator::reduce_scatter`]).
pub(crate) fn reduce_scatter<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    tensor: FloatTensor<B>,
    dim: usize,
    op: ReduceOp,
) -> Result<FloatTensor<B>, CommError> {
    let ctx = device.context();
    match ctx.device_collectives::<B>() {
        Some(dc) => {
            let shape = tensor.shape();
            check_dim(CollectiveKind::ReduceScatter, shape.num_dims(), dim)?;
            let n = group.size(ctx.mesh())?;
            check_divisible(shape[dim], dim, n)?;
            if dim == 0 {
                return dc.reduce_scatter_first(group, tensor, op);
            }
            let chunk = dc.reduce_scatter_first(group, B::float_swap_dims(tensor, 0, dim), op)?;
            Ok(B::float_swap_dims(chunk, 0, dim))
        }
        None => host(device, tensor, |c, d| c.reduce_scatter(group, d, dim, op)),
    }
}

/// Broadcast from group index `root`; every member passes its own tensor (the root's is sent,
/// the others' shape and dtype are the receive buffer's).
pub(crate) fn broadcast<B: Backend>(
    device: &DistDevice<B>,
    group: Group,
    tensor: FloatTensor<B>,
    root: usize,
) -> Result<FloatTensor<B>, CommError> {
    match device.context().device_collectives::<B>() {
        Some(dc) => dc.broadcast(group, tensor, root),
        None => host(device, tensor, |c, d| c.broadcast(group, Some(d), root)),
    }
}
