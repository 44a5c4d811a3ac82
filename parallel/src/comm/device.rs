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

use std::fmt;
use std::sync::Arc;

use burn::tensor::TensorData;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorMetadata};

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
/// (which counts the call), upload the result. It is what runs when nothing is installed; installed explicitly it lets a
/// test check the device path's dispatch and dimension handling on any backend (CPU included).
pub struct HostStaged {
    comm: Arc<dyn Communicator>,
}

impl HostStaged {
    /// Collectives through `comm`, staged through host memory.
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        Self { comm }
    }
}

impl fmt::Debug for HostStaged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostStaged(rank {})", self.comm.rank())
    }
}

fn read<B: Backend>(t: FloatTensor<B>) -> TensorData {
    crate::tensor::read::<B>(t)
}

impl<B: Backend> DeviceCollectives<B> for HostStaged {
    fn all_reduce(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
        op: ReduceOp,
    ) -> Result<FloatTensor<B>, CommError> {
        let device = B::float_device(&tensor);
        let data = self.comm.all_reduce(group, read::<B>(tensor), op)?;
        Ok(B::float_from_data(data, &device))
    }

    fn all_gather_first(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
    ) -> Result<FloatTensor<B>, CommError> {
        let device = B::float_device(&tensor);
        let data = self.comm.all_gather(group, read::<B>(tensor), 0)?;
        Ok(B::float_from_data(data, &device))
    }

    fn reduce_scatter_first(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
        op: ReduceOp,
    ) -> Result<FloatTensor<B>, CommError> {
        let device = B::float_device(&tensor);
        let data = self.comm.reduce_scatter(group, read::<B>(tensor), 0, op)?;
        Ok(B::float_from_data(data, &device))
    }

    fn broadcast(
        &self,
        group: Group,
        tensor: FloatTensor<B>,
        root: usize,
    ) -> Result<FloatTensor<B>, CommError> {
        let device = B::float_device(&tensor);
        let data = self.comm.broadcast(group, Some(read::<B>(tensor)), root)?;
        Ok(B::float_from_data(data, &device))
    }
}

fn check_dim(kind: CollectiveKind, ndims: usize, dim: usize) -> Result<(), CommError> {
    if dim < ndims {
        Ok(())
    } else {
        Err(CommError::InvalidDim {
            op: kind,
            dim,
            ndims,
        })
    }
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
        None => {
            let data = device
                .context()
                .comm()
                .all_reduce(group, read::<B>(tensor), op)?;
            Ok(B::float_from_data(data, device.inner()))
        }
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
        None => {
            let data = device
                .context()
                .comm()
                .all_gather(group, read::<B>(tensor), dim)?;
            Ok(B::float_from_data(data, device.inner()))
        }
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
            if !shape[dim].is_multiple_of(n) {
                return Err(CommError::Indivisible {
                    dim,
                    size: shape[dim],
                    parts: n,
                });
            }
            if dim == 0 {
                return dc.reduce_scatter_first(group, tensor, op);
            }
            let chunk = dc.reduce_scatter_first(group, B::float_swap_dims(tensor, 0, dim), op)?;
            Ok(B::float_swap_dims(chunk, 0, dim))
        }
        None => {
            let data = ctx
                .comm()
                .reduce_scatter(group, read::<B>(tensor), dim, op)?;
            Ok(B::float_from_data(data, device.inner()))
        }
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
        None => {
            let data = device
                .context()
                .comm()
                .broadcast(group, Some(read::<B>(tensor)), root)?;
            Ok(B::float_from_data(data, device.inner()))
        }
    }
}
